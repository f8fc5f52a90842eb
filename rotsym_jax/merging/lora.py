"""LoRA extraction, as mergekit 0.1.5's `mergekit-extract-lora` defines it: each linear module's
delta (tuned - base, in the checkpoint's stored dtype) factored by a truncated SVD in float32, and
written as a PEFT adapter folder that `peft` loads onto the base transformers model.

What is extracted follows mergekit's plan over transformers' modules (`modules_of`, the model built
on the meta device): nn.Linear and nn.Embedding get LoRA factors; the input and output embeddings
and every nn.Embedding go to `modules_to_save` whole (the tuned tensors) unless `embed_lora`; any
other module with a weight (norms, convolutions, GPT-2's Conv1D) is saved whole too, or skipped with
`skip_undecomposable`; `save_modules`, `include` and `exclude` (regular expressions searched in the
module name) as mergekit reads them. Each module's rank is min(`rank`, its smaller side), lowered
to the number of singular values above `sv_epsilon` (an absolute threshold, as mergekit's) where
that is positive. `distribute_scale`: A = sqrt(S) Vh, B = U sqrt(S) (else A = S Vh, B = U); alpha =
rank, so PEFT's scaling is 1 and B @ A is the delta's best rank-r approximation.

Differences from mergekit, on purpose: a module whose singular values all fall below `sv_epsilon`
keeps rank 1 (mergekit writes rank 0, which PEFT refuses to load); where a linear module has a bias,
its delta (`lora_B.bias`, mergekit's name) is announced with `lora_bias: true`, without which PEFT
drops it (PEFT refuses it beside factored embeddings: then a warning says the deltas are not
loaded); `task_type(checkpoint)` is CAUSAL_LM for a *ForCausalLM and null otherwise (mergekit writes
CAUSAL_LM always); each singular pair's sign is fixed (U's largest entry positive) so that the
factors do not depend on the SVD's backend; convolutions (nn.Conv1d, nn.Conv2d: ViT's patches, Whisper's
front end) are kept whole like a norm (mergekit factors their 3- or 4-D weights as matrices, which
fails or is not what PEFT's Conv LoRA holds); leaves that changed but lie in no extracted module
(ViT's class token: not in a module with a weight) are named in a warning, where mergekit is silent.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from .. import owned
from ..errors import InputError, PathExists
from ..io.hf import Checkpoint, check_params, family_of, publish

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class Module:
    """A transformers module that holds a weight: `kind` "linear" (nn.Linear), "embedding"
    (nn.Embedding) or "other" (saved whole: norms, convolutions, GPT-2's Conv1D); `params`: its own
    parameters' names ("weight", "bias"); `io_embedding`: the model's input or output embedding;
    `stored`: {parameter: the checkpoint tensor holding it} where the names differ (transformers 5
    renames some models' tensors on load: ViT's encoder.layer.0.attention.attention.query is
    layers.0.attention.q_proj); PEFT names the module, the tensors are read by their stored names."""

    name: str
    kind: str
    params: tuple[str, ...]
    io_embedding: bool = False
    stored: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def tensor(self, param: str) -> str:
        return self.stored.get(param, f"{self.name}.{param}")


@dataclasses.dataclass(frozen=True)
class Lora:
    """An extracted adapter, by module name: `a` and `b` its factors as PEFT stores them (nn.Linear:
    A (r, in), B (out, r); an embedding: A (r, vocab), B (d, r)), `bias` the linear biases' deltas,
    `embeddings` the modules factored as embeddings, `saved` the tensors kept whole ({HF name:
    the tuned tensor}) and `modules_to_save` their modules' keys, as PEFT's config names them."""

    a: Mapping[str, np.ndarray]
    b: Mapping[str, np.ndarray]
    bias: Mapping[str, np.ndarray]
    embeddings: frozenset[str]
    saved: Mapping[str, np.ndarray]
    modules_to_save: tuple[str, ...]
    stored: Mapping[str, str] = dataclasses.field(default_factory=dict)  # a factored module: its weight's checkpoint tensor

    @property
    def ranks(self) -> dict[str, int]:
        return {name: int(a.shape[0]) for name, a in self.a.items()}

    def delta(self, name: str) -> np.ndarray:
        """Module `name`'s delta as B @ A gives it, in the weight's layout (an embedding's (vocab, d))."""
        product = np.asarray(self.b[name], np.float32) @ np.asarray(self.a[name], np.float32)
        return product.T if name in self.embeddings else product


def modules_of(checkpoint: Checkpoint) -> tuple[Module, ...]:
    """The modules of `checkpoint`'s transformers model that hold a weight, in its order (mergekit
    plans from the same list). Builds the model on the meta device: imports torch and transformers."""
    try:
        import torch
        import transformers
    except ImportError as e:  # torch is an optional dependency of the package
        raise InputError(f"LoRA extraction plans its modules from transformers' model, built on torch's meta device: {e}") from None

    name = family_of(checkpoint.model_config).architecture(checkpoint.model_config, checkpoint.layout)
    with torch.device("meta"):
        model = getattr(transformers, name)(checkpoint.config)
    stored = _stored_names(checkpoint, model)
    ends = {id(m) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    out = []
    for module_name, module in model.named_modules():
        if getattr(module, "weight", None) is None:
            continue
        kind = "linear" if isinstance(module, torch.nn.Linear) else "embedding" if isinstance(module, torch.nn.Embedding) else "other"
        params = tuple(p for p, v in module.named_parameters(recurse=False) if v is not None)
        renamed = {p: stored[f"{module_name}.{p}"] for p in params if stored.get(f"{module_name}.{p}", f"{module_name}.{p}") != f"{module_name}.{p}"}
        out.append(Module(module_name, kind, params, id(module) in ends, renamed))
    return tuple(out)


def _stored_names(checkpoint: Checkpoint, model) -> dict[str, str]:
    """{the model's parameter name: the checkpoint tensor transformers loads it from}, by transformers'
    own renamings of this model (none for most); a tensor that a converter splits or fuses is left out."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    meta = model.state_dict()
    out = {}
    for rule in family_of(checkpoint.model_config).tensors(checkpoint.model_config, checkpoint.layout):
        renamed, converted = rename_source_key(rule.hf, renamings, converters, model.base_model_prefix, meta)
        if converted is None:
            out[renamed] = rule.hf
    return out


def hf_tensors(checkpoint: Checkpoint, params) -> dict[str, np.ndarray]:
    """`params` as the checkpoint's HF tensors ({name: array}, in the params' dtype), the tensors
    transformers ties to one of ours (a tied head) included."""
    flat = check_params(checkpoint, params)
    family = family_of(checkpoint.model_config)
    out = {rule.hf: np.asarray(rule.to_hf(tuple(np.asarray(flat[p]) for p in rule.ours)))
           for rule in family.tensors(checkpoint.model_config, checkpoint.layout)}
    for name, leaf in family.tied(checkpoint.model_config, checkpoint.layout).items():
        out.setdefault(name, np.asarray(flat[leaf]))
    return out


def _plan(modules: Sequence[Module], embed_lora: bool, save_modules, include, exclude, skip_undecomposable):
    """mergekit's `plan_extraction`: ([(module, as embedding)] to factor, [module] kept whole,
    modules_to_save's keys)."""
    to_save, factored, whole = list(save_modules), [], []
    key = lambda name: name.split(".")[-1]  # noqa: E731
    for m in modules:
        if not embed_lora and (m.io_embedding or m.kind == "embedding") and not any(re.search(r, m.name) for r in exclude):
            if key(m.name) not in to_save:
                to_save.append(key(m.name))
        if m.name in to_save or key(m.name) in to_save:
            whole.append(m)
        elif (not include or any(re.search(r, m.name) for r in include)) and not any(re.search(r, m.name) for r in exclude):
            if m.kind in ("linear", "embedding"):
                factored.append((m, m.kind == "embedding"))
            elif not skip_undecomposable:
                if key(m.name) not in to_save:
                    to_save.append(key(m.name))
                whole.append(m)
    return factored, whole, tuple(to_save)


@functools.partial(jax.jit, static_argnames=("rank", "distribute_scale"))
def _factors(deltas: jax.Array, rank: int, distribute_scale: bool):
    """A batch of same-shape deltas (n, out, in) -> (A (n, rank, in), B (n, out, rank), singular values)."""
    u, s, vh = jax.vmap(functools.partial(jnp.linalg.svd, full_matrices=False))(deltas.astype(jnp.float32))
    u, s, vh = u[..., :rank], s, vh[..., :rank, :]
    # a singular pair's sign is arbitrary: U's largest entry positive, whatever the backend
    biggest = jnp.take_along_axis(u, jnp.argmax(jnp.abs(u), axis=1)[:, None, :], axis=1)
    sign = jnp.where(biggest < 0, -1.0, 1.0)
    u, vh = u * sign, vh * jnp.swapaxes(sign, 1, 2)
    top = s[:, :rank]
    scale_a, scale_b = (jnp.sqrt(top), jnp.sqrt(top)) if distribute_scale else (top, jnp.ones_like(top))
    return scale_a[..., None] * vh, u * scale_b[:, None, :], s


@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """mergekit-extract-lora's options (this module's docstring): the largest rank, the absolute
    singular-value threshold below which a module's rank is cut, whether A and B share the singular
    values' square roots, whether embeddings are factored, and the modules saved whole, factored
    only if named, left out (regular expressions searched in the module name), or skipped where
    they cannot be factored."""

    rank: int = 128
    sv_epsilon: float = 0.0
    distribute_scale: bool = True
    embed_lora: bool = False
    save_modules: Sequence[str] = ()
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    skip_undecomposable: bool = False

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise InputError(f"rank={self.rank!r}: expected a positive integer")
        if not self.sv_epsilon >= 0:
            raise InputError(f"sv_epsilon={self.sv_epsilon!r}: expected a number >= 0")


def extract_lora(base_params, tuned_params, checkpoint: Checkpoint, options: LoraOptions = LoraOptions(), *,
                 modules: Sequence[Module] | None = None) -> Lora:
    """The LoRA adapter that takes `base_params` towards `tuned_params` (two params pytrees of
    `checkpoint`'s architecture), as `mergekit-extract-lora` extracts it with `options` (this
    module's docstring): every same-shape delta factored in one batched SVD on the device.
    `modules`: the model's modules (default `modules_of(checkpoint)`, which needs torch)."""
    o = options
    base, tuned = hf_tensors(checkpoint, base_params), hf_tensors(checkpoint, tuned_params)
    factored, whole, to_save = _plan(modules_of(checkpoint) if modules is None else modules, o.embed_lora, o.save_modules,
                                     o.include, o.exclude, o.skip_undecomposable)

    def tensor(source, name, what):
        if name not in source:
            raise InputError(f"{name}: a parameter of transformers' model ({what}) that no tensor of the {checkpoint.family} "
                             "checkpoint holds as it is (transformers splits or fuses it on load); exclude its module")
        return source[name]

    deltas, out_dtypes, bias = {}, {}, {}
    for m, as_embedding in factored:
        delta = tensor(tuned, m.tensor("weight"), "to factor") - tensor(base, m.tensor("weight"), "to factor")
        if delta.ndim != 2:
            raise InputError(f"{m.name}.weight: shape {delta.shape}, expected a matrix to factor")
        deltas[m.name], out_dtypes[m.name] = (delta.T if as_embedding else delta), delta.dtype
        if "bias" in m.params:
            bias[m.name] = tensor(tuned, m.tensor("bias"), "a bias") - tensor(base, m.tensor("bias"), "a bias")
    a, b = {}, {}
    by_shape = collections.defaultdict(list)
    for name, delta in deltas.items():
        by_shape[delta.shape].append(name)
    for shape, names in by_shape.items():
        keep = min(o.rank, *shape)
        fa, fb, s = jax.device_get(_factors(jnp.stack([jnp.asarray(deltas[n]) for n in names]), keep, o.distribute_scale))
        for i, name in enumerate(names):
            r = max(1, min(keep, int(np.sum(s[i] > o.sv_epsilon)))) if o.sv_epsilon > 0 else keep
            a[name], b[name] = fa[i, :r].astype(out_dtypes[name]), fb[i, :, :r].astype(out_dtypes[name])
    saved = {f"{m.name}.{p}": tensor(tuned, m.tensor(p), "kept whole") for m in whole for p in m.params}
    used = {m.tensor(p) for m, _ in factored for p in ("weight", "bias") if p in m.params} | {m.tensor(p) for m in whole for p in m.params}
    left = _changed_elsewhere(checkpoint, base_params, tuned_params, used)
    if left:
        warnings.warn(f"{len(left)} leaves changed in the tuned model lie in no extracted module, so the adapter does not carry them: "
                      f"{', '.join(left[:6])}{' ...' if len(left) > 6 else ''}", stacklevel=2)
    return Lora(a, b, bias, frozenset(m.name for m, e in factored if e), saved, to_save, {m.name: m.tensor("weight") for m, _ in factored})


def bias_loads(lora: Lora) -> bool:
    """Whether PEFT loads the biases' deltas: with `lora_bias`, which it refuses beside factored embeddings."""
    return bool(lora.bias) and not lora.embeddings


def _changed_elsewhere(checkpoint: Checkpoint, base_params, tuned_params, used: set[str]) -> list[str]:
    """Our leaves that differ between the two params and that no tensor in `used` (stored names, or
    the names transformers ties to one of our leaves) holds: what the adapter silently lacks otherwise
    (mergekit's plan leaves out parameters outside modules with a weight: ViT's class token)."""
    family = family_of(checkpoint.model_config)
    held = {p for rule in family.tensors(checkpoint.model_config, checkpoint.layout) if rule.hf in used for p in rule.ours}
    held |= {leaf for name, leaf in family.tied(checkpoint.model_config, checkpoint.layout).items() if name in used}
    base, tuned = check_params(checkpoint, base_params), check_params(checkpoint, tuned_params)
    return sorted(p for p in tuned if p not in held and not np.array_equal(np.asarray(tuned[p]), np.asarray(base[p])))


def adapter_config(lora: Lora, base_model: str, task_type: str | None) -> dict:
    """adapter_config.json as mergekit's `make_config_dict` writes it (this module's docstring: lora_bias)."""
    ranks = lora.ranks
    top = max(ranks.values(), default=1)
    other = {name: r for name, r in ranks.items() if r != top}
    return {
        "base_model_name_or_path": base_model, "peft_type": "LORA", "use_rslora": False,
        "target_modules": sorted({name.split(".")[-1] for name in ranks}), "modules_to_save": list(lora.modules_to_save),
        "task_type": task_type, "r": top, "lora_alpha": top, "rank_pattern": other, "alpha_pattern": other,
        "lora_dropout": 0.0, "fan_in_fan_out": False, "inference_mode": True, "lora_bias": bias_loads(lora),
    }


def adapter_tensors(lora: Lora) -> dict[str, np.ndarray]:
    """The adapter's tensors by the names PEFT saves them under (mergekit's)."""
    out = {}
    for name in lora.a:
        kind, suffix = ("lora_embedding", "") if name in lora.embeddings else ("lora", ".weight")
        out[f"base_model.model.{name}.{kind}_A{suffix}"] = lora.a[name]
        out[f"base_model.model.{name}.{kind}_B{suffix}"] = lora.b[name]
    out.update({f"base_model.model.{name}.lora_B.bias": v for name, v in lora.bias.items()})
    out.update({f"base_model.model.{name}": v for name, v in lora.saved.items()})
    return {k: np.asarray(v, order="C") for k, v in out.items()}


def task_type(checkpoint: Checkpoint) -> str | None:
    """PEFT's task_type for the checkpoint's transformers class: CAUSAL_LM for a *ForCausalLM, else
    None (PEFT's plain model: mergekit writes CAUSAL_LM always, which wraps an encoder wrongly)."""
    name = family_of(checkpoint.model_config).architecture(checkpoint.model_config, checkpoint.layout)
    return "CAUSAL_LM" if name.endswith("ForCausalLM") else None


def is_adapter_folder(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_WEIGHTS).is_file()


def save_lora(lora: Lora, path: str | os.PathLike, *, base_model: str, task_type: str | None = "CAUSAL_LM",
              overwrite: bool = False) -> Path:
    """Write `lora` as a PEFT adapter folder (adapter_config.json + adapter_model.safetensors), under a
    temporary name beside `path` then moved into place. An existing `path` is replaced only with
    `overwrite`, and only if it is an adapter folder."""
    target = Path(path)
    if target.exists() or target.is_symlink():
        if target.is_symlink() or not target.is_dir() or not is_adapter_folder(target):
            raise PathExists(f"{target} exists and is not a PEFT adapter folder ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}); choose another path")
        if not overwrite:
            raise PathExists(f"{target} exists; pass overwrite=True to replace it")
    if lora.bias and not bias_loads(lora):
        warnings.warn(f"{target}: PEFT refuses lora_bias beside factored embeddings, so the {len(lora.bias)} biases' deltas written "
                      "(mergekit's lora_B.bias) are not loaded; without embed_lora they are", stacklevel=2)
    target.parent.mkdir(parents=True, exist_ok=True)
    with owned.writing(target):
        tmp = owned.temp_folder(target.parent, ".rotsym-tmp-", target)
        try:
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(lora, base_model, task_type), indent=4) + "\n")
            safetensors.numpy.save_file(adapter_tensors(lora), tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
            owned.sync_tree(tmp)
            with owned.critical():
                owned.unmark(tmp)
                replaced = publish(tmp, target)
                owned.published(tmp, target, replaced)
        except BaseException:
            owned.discard(tmp)
            raise
        owned.sync_folder(target.parent)
        if replaced is not None:
            owned.discard(replaced)
    return target


def relative_error(lora: Lora, base_params, tuned_params, checkpoint: Checkpoint) -> float:
    """||delta - B A|| / ||delta|| over every factored module (Frobenius, float64): what the rank loses."""
    base, tuned = hf_tensors(checkpoint, base_params), hf_tensors(checkpoint, tuned_params)
    lost = total = 0.0
    for name in lora.a:
        stored = lora.stored.get(name, f"{name}.weight")
        delta = (tuned[stored] - base[stored]).astype(np.float64)
        lost += float(np.sum((delta - lora.delta(name)) ** 2))
        total += float(np.sum(delta**2))
    return float(np.sqrt(lost / total)) if total else 0.0

