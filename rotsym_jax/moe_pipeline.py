"""`rotsym moe CONFIG.yml OUT`: a mergekit-moe config run (`merging.moe`), its experts' models
aligned onto the base first where asked, written atomically with its report.

In memory (`build`, `mixture`) the models are read whole. Streamed (`max_memory`, without
alignment) every output tensor is computed from the tensors it needs, read from the folders as it
is written (`merging.moe.mixture_leaf`, the in-memory path's own function): the same tensors, at
most one expert stack and the base (for hidden gates, which run it) in memory."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import rotsym_jax as rj

from . import verify
from .io import recipe as recipe_mod
from .io.card import jsonable, report_of
from .io.hf import (
    Checkpoint,
    ShardWriter,
    check_saved_finite,
    check_target,
    family_of,
    floating_dtype,
    save_hf,
    saved_array,
    write_folder,
)
from .io.loading import PipelineError, load_checkpoint
from .io.tokenizers import load_tokenizer
from .merging import moe
from .options import AlignOptions, recorded
from .pipeline import aligning_spec, checked
from .pytree import flatten
from .streaming._source import Source
from .timings import Clock

# The gates' condition number above which mergekit warns that experts may be underused.
DEGENERATE_CONDITION = 5.0
# What aligning an expert's model changes in the mixture is the basis of the residual stream its
# FFN reads (its units' order inside the expert and its discarded attention change nothing), so the
# stream is rotated unless the options say otherwise (the library's default leaves it in place).
ALIGN_DEFAULTS = {"residual": "rotation", "heads": "permute"}


def tokenized_prompts(cfg: moe.MoeConfig, folder) -> moe.Prompts:
    """Every expert's prompts as the base's tokenizer reads them in mergekit-moe: its BOS text
    before each, no special tokens added, padded on the left with BOS (else EOS)."""
    tokenizer = load_tokenizer(folder, "tokenize the experts' prompts", PipelineError)
    bos = tokenizer.bos_token or ""
    pad = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise PipelineError(f"{folder}: the tokenizer has neither a BOS nor an EOS token, which mergekit-moe pads the prompts with")

    def ids(texts):
        return [tokenizer(bos + text, add_special_tokens=False)["input_ids"] for text in texts]

    return moe.prompt_batch([(ids(e.positive_prompts), ids(e.negative_prompts)) for e in cfg.experts], pad)


def _aligned(cfg: moe.MoeConfig, params: Mapping, base: Checkpoint, options: dict, data=None) -> tuple[dict, dict]:
    """{model: params}, each expert's model moved onto the base (folded first for a residual
    rotation, the base too; from their activations on `data` for method="activations"), and each
    one's distances before and after."""
    params = dict(params)
    if options.get("residual") == "rotation":  # a rotation of the stream needs uniform gains (MATH §8)
        spec = rj.spec_for(base)
        params = {name: rj.fold_norms(spec, p) for name, p in params.items()}
    distances = {}
    for name in cfg.models[1:]:
        result = rj.align(params[cfg.base], params[name], aligning_spec(base), **options,
                          **({} if data is None else {"data": data, "checkpoint": base}))
        params[name] = result.params
        distances[name] = {"before": result.report["before"]["total"], "after": result.report["after"]["total"]}
    return params, distances


def _router_for(gates, base_params, params) -> jax.Array:
    """The router rows reading the base's folded stream as they read its normed one: a folded
    mlp_norm gain g (the output's gain 1) is carried by the rows, w -> w * g."""
    before, after = flatten(base_params), flatten(params)
    layers = range(gates.shape[0])
    ratio = jnp.stack([jnp.asarray(before[f"layers/{i}/mlp_norm/scale"], jnp.float32) / jnp.asarray(after[f"layers/{i}/mlp_norm/scale"], jnp.float32)
                       for i in layers])
    return gates * ratio[:, None, :]


def experts_of(cfg: moe.MoeConfig, key) -> moe.Experts:
    """The config's experts' scales, their noise drawn from `key`."""
    noisy = any(e.noise_scale is not None for e in cfg.experts)
    return moe.Experts(tuple(e.residual_scale for e in cfg.experts), tuple(e.noise_scale for e in cfg.experts), key if noisy else None)


def _condition_numbers(gates) -> list[float]:
    return [float(c) for c in jnp.linalg.cond(gates)]


def mixture(cfg: moe.MoeConfig, checkpoints: Mapping[str, Checkpoint], prompts: moe.Prompts | None = None, *, align: bool = False,
            align_options: Mapping | None = None, data=None, key=None) -> tuple[Checkpoint, dict, dict]:
    """(checkpoint, params, result): the mixture (Mixtral or Qwen3 MoE) of `cfg` made of `checkpoints` ({each model of
    `cfg.models`: its checkpoint}, in memory), the gates computed with the base on `prompts` (or
    drawn from `key`), each expert's model first moved onto the base by `rj.align` with
    `align_options` over ALIGN_DEFAULTS where `align` (`data`: the batches of method="activations").
    `result` is what the report records."""
    options = checked(lambda: recorded(AlignOptions(**{**ALIGN_DEFAULTS, **(align_options or {})}).settled())) if align else {}
    base = checkpoints[cfg.base]
    output = checked(moe.check_inputs, base, [checkpoints[m] for m in cfg.models[1:]], cfg.models, cfg.architecture)
    gate_key, noise_key = jax.random.split(jax.random.key(0) if key is None else key)
    gates = checked(moe.gate_vectors, cfg.gate_mode, base, base.params, len(cfg.experts), prompts, key=gate_key)
    params = {m: ck.params for m, ck in checkpoints.items() if m in cfg.models}
    params, distances = _aligned(cfg, params, base, options, data) if align else (params, {})
    router = _router_for(gates, base.params, params[cfg.base]) if options.get("residual") == "rotation" else gates
    shared = [params[cfg.base]] if cfg.shared == "base" else [params[m] for m in cfg.models]
    checkpoint, merged = checked(moe.build_moe, base, shared, [params[e.model] for e in cfg.experts], router, output=output,
                                 experts_per_token=cfg.experts_per_token, experts=experts_of(cfg, noise_key))
    conditions = _condition_numbers(gates)
    result = {"output": output.name, "gate_mode": cfg.gate_mode, "experts": [e.model for e in cfg.experts], "shared": cfg.shared, "aligned": align,
              "gate_condition_numbers": conditions,
              "degenerate_layers": [i for i, c in enumerate(conditions) if not c <= DEGENERATE_CONDITION]}
    if align:
        result["alignment"] = {"options": options, "distances": distances}
    return checkpoint, merged, result


def build(cfg: moe.MoeConfig, *, align: bool | None = None, align_options: dict | None = None, seed: int | None = None):
    """(checkpoint, params, run) of the mixture `cfg` describes, its models read from their
    folders and its prompts tokenized by the base's tokenizer: `mixture`, aligned where `align`
    (default: the config's `rotsym.align`) with `align_options` (default: the config's). `run`
    holds the checkpoints read, the alignment options and the report's result."""
    align = cfg.align if align is None else align
    if align_options and not align:  # the config's own are unused where align=False overrides it
        raise PipelineError(f"align_options {sorted(align_options)}: alignment options need align (rotsym.align: true, --align)")
    given = dict(cfg.align_options if align_options is None else align_options)
    seed = cfg.seed if seed is None else seed
    cks = {path: load_checkpoint(path, "base_model" if path == cfg.base else f"expert {path}", prove=verify.infer_record) for path in cfg.models}
    prompts = tokenized_prompts(cfg, cfg.base) if cfg.gate_mode in ("hidden", "cheap_embed") else None
    batches = None
    if align and given.get("method", "weights") != "weights":
        if cfg.data is None:
            raise PipelineError(f"align_options.method {given['method']}: it runs the models on data; give rotsym.data: {{file: ...}}")
        batches = checked(recipe_mod.batches, cfg.data, cks[cfg.base])
    checkpoint, merged, result = mixture(cfg, cks, prompts, align=align, align_options=given, data=batches, key=jax.random.key(seed))
    if cfg.gate_mode in ("random", "uniform_random") or any(e.noise_scale is not None for e in cfg.experts):
        result["seed"] = seed
    options = result.get("alignment", {}).get("options", {})
    return checkpoint, merged, {"checkpoints": cks, "options": options, "result": result}


def out_dtype(cfg: moe.MoeConfig, base) -> str | None:
    """mergekit-moe's: the config's dtype, else the base's config.json's, else each tensor's own."""
    raw = base.model_config.raw
    return cfg.dtype or raw.get("dtype") or raw.get("torch_dtype")


def moe_to_disk(config, out, *, align: bool | None = None, align_options: dict | None = None, seed: int | None = None,
                allow_all_same: bool = False, overwrite: bool = False, max_memory: int | None = None,
                command: str = "rotsym moe") -> tuple[Path, dict]:
    """Run the mergekit-moe config `config` (a path or a `moe.MoeConfig`) into the folder `out`:
    the mixture's checkpoint, the base's tokenizer, the config as `mergekit_moe_config.yml` (as
    mergekit keeps it) and `rotsym_report.json`, written under a temporary name and moved into
    place. `max_memory` (bytes): streamed, a tensor at a time (`streamed`). Returns (out, report)."""
    start = time.perf_counter()
    cfg = config if isinstance(config, moe.MoeConfig) else checked(moe.load, config, allow_all_same=allow_all_same)
    if max_memory is not None:
        if cfg.align if align is None else align:
            raise PipelineError("max_memory: a streamed mixture is not aligned (alignment holds the models in memory); give align=False "
                                "(--no-align) or no max_memory")
        return streamed(cfg, out, max_memory, seed=seed, overwrite=overwrite, command=command, start=start)
    checkpoint, params, run = build(cfg, align=align, align_options=align_options, seed=seed)
    names = {"base_model": cfg.base, **{f"expert {i}": e.model for i, e in enumerate(cfg.experts)}}
    inputs = {name: run["checkpoints"][path] for name, path in names.items()}
    report = {}

    def files():
        report.update(report_of(command, inputs, {"gate_mode": cfg.gate_mode, "align": run["result"]["aligned"],
                                                  "align_options": run["options"], "shared": cfg.shared}, run["result"], start))
        return {"mergekit_moe_config.yml": cfg.text, "rotsym_report.json": json.dumps(jsonable(report), indent=2)}

    dtype = out_dtype(cfg, run["checkpoints"][cfg.base])
    path = checked(save_hf, checkpoint, params, out, dtype=dtype, overwrite=overwrite,
                   extra_files=files)
    return path, report



def streamed(cfg: moe.MoeConfig, out, max_memory: int, *, seed: int | None = None, overwrite: bool = False, command: str = "rotsym moe",
             start: float | None = None) -> tuple[Path, dict]:
    """`moe_to_disk` without alignment, a tensor at a time: the models' headers read first, the
    base whole only for hidden gates (they run it), then each output tensor computed from the
    tensors it needs as they are read, and written. Refused where one step would need more than
    `max_memory` bytes, with the numbers."""
    start = time.perf_counter() if start is None else start
    seed = cfg.seed if seed is None else seed
    sources = {m: Source(load_checkpoint(m, "base_model" if m == cfg.base else f"expert {m}", weights=False, prove=verify.infer_record),
                         "base_model" if m == cfg.base else f"expert {m}") for m in cfg.models}
    try:
        headers = {m: source.ck for m, source in sources.items()}
        header = headers[cfg.base]
        output = checked(moe.check_inputs, header, [headers[m] for m in cfg.models[1:]], cfg.models, cfg.architecture)
        checkpoint = moe.mixture_checkpoint(header, output, len(cfg.experts), cfg.experts_per_token)
        family = family_of(checkpoint.model_config)
        rules = family.tensors(checkpoint.model_config, checkpoint.layout)
        shapes = family.shapes(checkpoint.model_config, checkpoint.layout)
        dtype = np.dtype(floating_dtype(out_dtype(cfg, header) or header.dtype))
        needed = 2 * max(4 * sum(int(np.prod(shapes[p])) for p in rule.ours) for rule in rules)  # a stack in float32, and its cast
        if cfg.gate_mode == "hidden":
            needed += sum(int(np.prod(np.shape(x))) * 4 for x in flatten(header.params).values())  # the base, run
        if needed > max_memory:
            raise PipelineError(f"max_memory {max_memory:,} bytes: the largest step needs about {needed:,} (an output tensor in float32 "
                                f"and its cast{', and the base model, which hidden gates run' if cfg.gate_mode == 'hidden' else ''})")
        clock = Clock()
        gate_key, noise_key = jax.random.split(jax.random.key(seed))
        if cfg.gate_mode == "hidden":  # the forward pass runs the whole base, as mergekit's does
            base = load_checkpoint(cfg.base, "base_model", prove=verify.infer_record)
            base_params = base.params
        else:
            base = header
            base_params = {"embeddings": {"word": {"embedding": _leaf(sources[cfg.base], "embeddings/word/embedding", clock)}}} \
                if cfg.gate_mode == "cheap_embed" else {}
        prompts = tokenized_prompts(cfg, cfg.base) if cfg.gate_mode in ("hidden", "cheap_embed") else None
        gates = checked(moe.gate_vectors, cfg.gate_mode, base, base_params, len(cfg.experts), prompts, key=gate_key)
        experts = experts_of(cfg, noise_key)
        layers = checkpoint.model_config.num_hidden_layers

        def write_weights(tmp):
            writer = ShardWriter(tmp, {r.hf: (dtype, _hf_shape(r, shapes)) for r in rules}, 5 * 2**30)
            nonfinite = []
            for rule in rules:
                leaves = tuple(np.asarray(moe.mixture_leaf(p, lambda q: _leaf(sources[cfg.base], q, clock),
                                                           lambda e, q: _leaf(sources[cfg.experts[e].model], q, clock), gates, experts, layers))
                               for p in rule.ours)
                writer.write(rule.hf, saved_array(rule.to_hf(leaves), dtype, "/".join(rule.ours), nonfinite))
            check_saved_finite(nonfinite, False)
            writer.finish()

        conditions = _condition_numbers(gates)
        result = {"output": output.name, "gate_mode": cfg.gate_mode, "experts": [e.model for e in cfg.experts], "shared": "base",
                  "aligned": False, "streamed": True, "gate_condition_numbers": conditions,
                  "degenerate_layers": [i for i, c in enumerate(conditions) if not c <= DEGENERATE_CONDITION]}
        if cfg.gate_mode in ("random", "uniform_random") or any(e.noise_scale is not None for e in cfg.experts):
            result["seed"] = seed
        report = {}
        inputs = {"base_model": headers[cfg.base], **{f"expert {i}": headers[e.model] for i, e in enumerate(cfg.experts)}}

        def files():
            report.update(report_of(command, inputs, {"gate_mode": cfg.gate_mode, "align": False, "align_options": {}, "shared": "base",
                                                      "max_memory": max_memory}, {**result, "timings": clock.report(start)}, start))
            return {"mergekit_moe_config.yml": cfg.text, "rotsym_report.json": json.dumps(jsonable(report), indent=2)}

        target = Path(out)
        checked(check_target, target, checkpoint.source, overwrite)
        path = checked(write_folder, checkpoint, target, {r.hf: dtype for r in rules}, write_weights, files)
    finally:
        for source in sources.values():
            source.close()
    return path, report


def _leaf(source: Source, path: str, clock) -> np.ndarray:
    """Our leaf `path` of a dense model, read from its folder."""
    return source.leaves(source.keys_of[path], clock, device=False)[path]


def _hf_shape(rule, shapes: dict) -> tuple:
    # from zeros the OS maps lazily (an int8 each): the layout's conversion gives the stored shape
    return tuple(rule.to_hf(tuple(np.zeros(shapes[p], np.int8) for p in rule.ours)).shape)
