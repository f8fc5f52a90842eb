"""`rotsym moe CONFIG.yml OUT`: a mergekit-moe config run (`merging.moe`), its experts' models
aligned onto the base first where asked, written atomically with its report.

The models are read whole, in memory (a mixture from dense models holds every expert's FFN at
once anyway); `build_moe` reads them leaf by leaf, so a streamed run would read the same
tensors layer by layer (not written yet)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp

import rotsym_jax as rj

from .io import recipe as recipe_mod
from .io.card import jsonable, report_of
from .io.hf import Checkpoint, save_hf
from .io.tokenizers import load_tokenizer
from .loading import PipelineError, load_checkpoint
from .merging import moe
from .options import AlignOptions, recorded
from .pipeline import aligning_spec, checked
from .pytree import flatten

# The gates' condition number above which mergekit warns that experts may be underused.
DEGENERATE_CONDITION = 5.0


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
    `align_options` where `align` (`data`: the batches of method="activations"). `result` is what
    the report records."""
    options = checked(lambda: recorded(AlignOptions(**dict(align_options or {})).settled())) if align else {}
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
    cks = {path: load_checkpoint(path, "base_model" if path == cfg.base else f"expert {path}") for path in cfg.models}
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
                allow_all_same: bool = False, overwrite: bool = False, command: str = "rotsym moe") -> tuple[Path, dict]:
    """Run the mergekit-moe config `config` (a path or a `moe.MoeConfig`) into the folder `out`:
    the mixture's checkpoint, the base's tokenizer, the config as `mergekit_moe_config.yml` (as
    mergekit keeps it) and `rotsym_report.json`, written under a temporary name and moved into
    place. Returns (out, report)."""
    start = time.perf_counter()
    cfg = config if isinstance(config, moe.MoeConfig) else checked(moe.load, config, allow_all_same=allow_all_same)
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

