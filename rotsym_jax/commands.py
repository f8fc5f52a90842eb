"""The checkpoint commands of `rotsym` (align, merge, inspect): Hugging Face folders in, a folder
out with the weights, a report, a model card and the recipe, written atomically by `save_hf`."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import shlex
import time
from pathlib import Path

import jax
import numpy as np
import yaml

from . import merge as merge_methods
from .align import ATTENTION, FFN, HEADS, RESCALE, align
from .distances import distance_report
from .hf import Checkpoint, CheckpointError, load_hf, save_hf, spec_for
from .many import align_many
from .pytree import flatten
from .spec import bind

ALIGN_MODES = ("none", "anchor", "many")
DTYPES = ("float32", "bfloat16", "float16", "float64")
# What the command line can give a merge method: a base model, a key from --seed, the spec.
# Statistics and activations (fishers, grams, batches) need data files, which only a recipe can name.
COMMAND_LINE_INPUTS = ("base", "key", "spec", "weights")


def version() -> str:
    try:
        return importlib.metadata.version("rotsym_jax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def add_commands(commands) -> None:
    align_cmd = commands.add_parser("align", help="move checkpoint B as close as possible to A (same function as B)")
    align_cmd.add_argument("a", help="the anchor: a Hugging Face checkpoint folder")
    align_cmd.add_argument("b", help="the checkpoint to move (same architecture as A)")
    align_cmd.add_argument("out", help="the folder to write (B moved)")
    _align_options(align_cmd)
    align_cmd.add_argument("--overwrite", action="store_true", help="replace OUT if it is a checkpoint folder")
    align_cmd.set_defaults(run=_align, error=align_cmd.error)

    merge_cmd = commands.add_parser("merge", help="align, then merge checkpoints with a registered method")
    merge_cmd.add_argument("--method", required=True, help=f"one of {sorted(merge_methods.METHODS)}")
    merge_cmd.add_argument("paths", nargs="+", metavar="PATH", help="the models (the first is the anchor), then OUT")
    merge_cmd.add_argument("--align", default="anchor", choices=ALIGN_MODES,
                           help="none; anchor: each model aligned to the first (default); many: align_many")
    merge_cmd.add_argument("--base", default=None, help="the shared base model (task_arithmetic, ties, dare)")
    merge_cmd.add_argument("--param", action="append", default=[], metavar="K=V", help="a method parameter, e.g. density=0.5")
    merge_cmd.add_argument("--seed", type=int, default=0, help="the random key of methods that draw (dare; default 0)")
    merge_cmd.add_argument("--dtype", default=None, choices=DTYPES, help="saved dtype (default: the anchor's)")
    merge_cmd.add_argument("--task-head", default="anchor", choices=merge_methods.TASK_HEAD, help="keep the anchor's head, or merge it")
    _align_options(merge_cmd)
    merge_cmd.add_argument("--overwrite", action="store_true", help="replace OUT if it is a checkpoint folder")
    merge_cmd.set_defaults(run=_merge, error=merge_cmd.error)

    inspect_cmd = commands.add_parser("inspect", help="describe a checkpoint; with B, the distances before and after matching")
    inspect_cmd.add_argument("a", help="a Hugging Face checkpoint folder")
    inspect_cmd.add_argument("b", nargs="?", default=None, help="a second checkpoint of the same architecture")
    _align_options(inspect_cmd)
    inspect_cmd.set_defaults(run=_inspect, error=inspect_cmd.error)


def _align_options(parser) -> None:
    group = parser.add_argument_group("alignment (rotsym_jax.align's options)")
    group.add_argument("--attention", default="rotation", choices=ATTENTION, help="per-head symmetry of Q/K and V/O (default rotation)")
    group.add_argument("--heads", default="fixed", choices=HEADS,
                       help="fixed: head i <-> head i (the paper, the default: on fine-tunes and shared inits permute changed "
                            "nothing in our experiments); permute: match heads first, which undoes head permutations")
    group.add_argument("--rescale", default="sequential", choices=RESCALE, help="per-head scale (default sequential, the paper's)")
    group.add_argument("--ffn", default="permutation", choices=FFN, help="FFN hidden-unit matching (default permutation)")
    group.add_argument("--layers", default=None, type=_layer_list, help="comma-separated layer indices to match (default: all)")


def _layer_list(text: str) -> list[int]:
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated layer indices, e.g. 0,3,5") from None
    if not layers:
        raise argparse.ArgumentTypeError("expected at least one layer index")
    return layers


def _options(args) -> dict:
    return {"attention": args.attention, "heads": args.heads, "rescale": args.rescale, "ffn": args.ffn, "layers": args.layers}


def _load(path: str, what: str, error) -> Checkpoint:
    try:
        return load_hf(path)
    except (FileNotFoundError, CheckpointError) as e:
        error(f"{what}: {e}")


def _same_architecture(anchor: Checkpoint, other: Checkpoint, what: str, error) -> None:
    shapes_a = {p: np.shape(x) for p, x in flatten(anchor.params).items() if not (p == "head" or p.startswith("head/"))}
    shapes_b = {p: np.shape(x) for p, x in flatten(other.params).items() if not (p == "head" or p.startswith("head/"))}
    if anchor.family != other.family or shapes_a != shapes_b:
        differ = sorted(p for p in shapes_a.keys() | shapes_b.keys() if shapes_a.get(p) != shapes_b.get(p))
        error(
            f"{what} ({other.source}, {other.family}) does not have the architecture of the anchor "
            f"({anchor.source}, {anchor.family}): leaves that differ {differ[:5]}"
        )


# ---- align ------------------------------------------------------------------------------------------

def _align(args) -> int:
    start = time.perf_counter()
    a, b = _load(args.a, "A", args.error), _load(args.b, "B", args.error)
    _same_architecture(a, b, "B", args.error)
    options = _options(args)
    # Task heads may differ (other label sets); they take no part in alignment and B keeps its own.
    result = _checked(args.error, align, _without_head(a.params), _without_head(b.params), spec_for(b), **options)
    moved = {**result.params, **_head(b.params)}
    report = _report(args, {"a": a, "b": b}, options, result.report, start)
    recipe = {"command": "align", "a": str(args.a), "b": str(args.b), "options": options}
    card = _model_card(Path(args.out).name, base=str(args.b), tags=["rotsym_jax", "aligned"], recipe=recipe, report=report,
                       summary=f"{args.b} moved by rotsym_jax, without changing its function, as close as possible to {args.a}.")
    out = _save(b, moved, args, None, report, recipe, card)
    _print_distances(result.report)
    print(f"wrote {out} ({time.perf_counter() - start:.1f} s)")
    return 0


# ---- merge ------------------------------------------------------------------------------------------

def _merge(args) -> int:
    start = time.perf_counter()
    if len(args.paths) < 3:
        args.error("give at least two models and the output folder: rotsym merge --method NAME A B OUT")
    *model_paths, out = args.paths
    method = merge_methods.METHODS.get(args.method)
    if method is None:
        args.error(f"--method {args.method!r}: unknown; known methods: {sorted(merge_methods.METHODS)}")
    params = _method_params(method, args.param, args.error)
    data_inputs = sorted(set(method.needs) - set(COMMAND_LINE_INPUTS))
    if data_inputs:
        args.error(f"--method {method.name} needs {data_inputs}, computed from data, which the command line cannot give yet")
    models = [_load(p, f"model {i}", args.error) for i, p in enumerate(model_paths)]
    for i, ck in enumerate(models[1:], 1):
        _same_architecture(models[0], ck, f"model {i}", args.error)
    base = None
    if args.base is not None:
        base = _load(args.base, "--base", args.error)
        _same_architecture(models[0], base, "--base", args.error)
    elif "base" in method.needs:
        args.error(f"--method {method.name} needs --base (the model the others were fine-tuned from)")
    anchor = models[0]
    options = _options(args)
    params_list, alignment = _checked(args.error, _aligned, models, args.align, options)
    inputs = {"base": None if base is None else _with_anchor_head(base.params, anchor.params, args.task_head)}
    inputs["key"] = jax.random.key(args.seed) if "key" in method.needs else None
    inputs["spec"] = spec_for(anchor) if "spec" in method.needs else None
    inputs = {k: v for k, v in inputs.items() if v is not None and (k in method.needs or k in method.optional)}
    try:
        merged = merge_methods.merge(method.name, params_list, task_head=args.task_head, **inputs, **params)
    except ValueError as e:
        args.error(str(e))
    merge_report = {"alignment": alignment, "merged_distance_to_anchor": distance_report(spec_for(anchor), anchor.params, merged)["total"]}
    report = _report(args, {f"model {i}": ck for i, ck in enumerate(models)}, {"method": method.name, "params": params,
                     "align": args.align, **({"align_options": options} if args.align != "none" else {})}, merge_report, start)
    recipe = {"command": "merge", "method": method.name, "params": params, "models": model_paths, "base": args.base,
              "align": args.align, "align_options": options, "seed": args.seed, "task_head": args.task_head, "dtype": args.dtype}
    card = _model_card(Path(out).name, base=model_paths[0], tags=["merge", "rotsym_jax"], recipe=recipe, report=report,
                       summary=f"A {method.name} merge by rotsym_jax of {', '.join(model_paths)} (alignment: {args.align}).")
    args.out = out
    written = _save(anchor, merged, args, args.dtype, report, recipe, card)
    print(f"wrote {written} ({time.perf_counter() - start:.1f} s)")
    return 0


def _checked(error, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, its ValueError (bad options, models that do not fit) as a usage error."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        error(str(e))


def _method_params(method, given: list[str], error) -> dict:
    params = {}
    for item in given:
        name, sep, text = item.partition("=")
        if not sep:
            error(f"--param {item!r}: expected NAME=VALUE")
        declared = method.params.get(name.strip())
        if declared is None:
            error(f"--param {name!r}: merge method {method.name!r} has no such parameter; its parameters: {list(method.params)}")
        try:
            params[declared.name] = declared.parse(text.strip())
        except ValueError as e:
            error(f"--param {item!r}: {e}")
    return params


def _aligned(models: list[Checkpoint], mode: str, options: dict) -> tuple[list, dict]:
    """The models' params after the alignment `mode`, and the report of the alignment."""
    params = [ck.params for ck in models]
    if mode == "none":
        return params, {"mode": "none"}
    bodies = [_without_head(p) for p in params]  # task heads may differ in shape: the bodies are aligned
    spec = bind(spec_for(models[0]), bodies[0])
    if mode == "anchor":
        results = [align(bodies[0], body, spec, **options) for body in bodies[1:]]
        moved = [bodies[0]] + [r.params for r in results]
        report = {"mode": "anchor", "distances": [{"before": r.report["before"], "after": r.report["after"]} for r in results]}
    else:
        many = align_many(bodies, spec, **options)
        moved = many.params
        report = {"mode": "many", "objective": many.objective, "stop": many.report["stop"]}
    return [{**m, **_head(p)} for m, p in zip(moved, params)], report


def _head(params: dict) -> dict:
    return {k: v for k, v in params.items() if k == "head"}


def _without_head(params: dict) -> dict:
    return {k: v for k, v in params.items() if k != "head"}


def _with_anchor_head(base: dict, anchor: dict, task_head: str) -> dict:
    """A base model without the anchor's task head gets it (task vectors of the head are moot
    when the anchor's head is kept)."""
    if task_head == "anchor" and "head" in anchor:
        return {**base, "head": anchor["head"]}
    return base


# ---- inspect ----------------------------------------------------------------------------------------

def _inspect(args) -> int:
    a = _load(args.a, "A", args.error)
    bound = bind(spec_for(a), a.params)
    flat = flatten(a.params)
    count = sum(int(np.size(x)) for x in flat.values())
    dtypes = sorted({str(np.dtype(d)) for d in a.stored_dtypes.values()}) if a.stored_dtypes else [str(a.dtype)]
    print(f"{a.source}: {a.family} ({a.config.model_type}), head {a.layout.head}, {count:,} parameters, stored as {'/'.join(dtypes)}")
    print(f"{len(flat)} leaves; symmetry groups of the built-in spec:")
    for block in bound.attention:
        g = block.geometry
        rope = f", RoPE on {g.rotary_dim} dims" if g.rotary_dim else ""
        print(f"  attention {block.name!r}: {len(block.layers)} layers, {g.num_heads} heads in {g.num_kv_heads} kv groups, head_dim {g.head_dim}{rope}")
    for group in bound.perms:
        print(f"  permutation {group.name!r}: {len(group.layers)} layers, {group.size} units ({len(group.members)} leaf kinds)")
    print(f"  untouched: {len(bound.ignored)} leaves (embeddings, norms, output biases, head)")
    if args.b is not None:
        b = _load(args.b, "B", args.error)
        _same_architecture(a, b, "B", args.error)
        result = _checked(args.error, align, _without_head(a.params), _without_head(b.params), spec_for(b), **_options(args))
        _print_distances(result.report, per_layer=True)
    return 0


# ---- output -----------------------------------------------------------------------------------------

KINDS_SHOWN = ("qk", "vo", "ffn", "other", "total")


def _print_distances(report: dict, per_layer: bool = False) -> None:
    kinds = [k for k in KINDS_SHOWN if k in report["before"]]
    print(f"{'distance':<12}" + "".join(f"{k:>10}" for k in kinds))
    for label in ("before", "after"):
        print(f"{label:<12}" + "".join(f"{report[label][k]:>10.4f}" for k in kinds))
    if per_layer:
        for layer, d in report["layers"].items():
            for label in ("before", "after"):
                print(f"{f'layer {layer} {label}':<12}" + "".join(f"{d[label].get(k, 0.0):>10.4f}" for k in kinds))


def _report(args, inputs: dict, options: dict, result: dict, start: float) -> dict:
    return {
        "command": shlex.join(["rotsym", *args.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "inputs": {name: {"path": str(ck.source), "family": ck.family, "model_type": ck.config.model_type} for name, ck in inputs.items()},
        "options": options,
        "result": _jsonable(result),
        "seconds": time.perf_counter() - start,
        "versions": {"rotsym_jax": version(), "jax": jax.__version__, "numpy": np.__version__, "python": platform.python_version()},
        "device": jax.devices()[0].device_kind,
    }


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


def _model_card(name: str, *, base: str, tags: list[str], recipe: dict, report: dict, summary: str) -> str:
    front = yaml.safe_dump({"base_model": base, "tags": tags}, sort_keys=False).strip()
    lines = ["---", front, "---", "", f"# {name}", "", summary, "", "## Recipe", "", "```yaml",
             yaml.safe_dump(recipe, sort_keys=False).strip(), "```", ""]
    distances = report["result"]
    if "before" in distances:
        kinds = [k for k in KINDS_SHOWN if k in distances["before"]]
        lines += ["## Distances to the anchor", "", "| | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
        lines += [f"| {label} | " + " | ".join(f"{distances[label][k]:.4f}" for k in kinds) + " |" for label in ("before", "after")]
        lines += [""]
    lines += [f"Made with rotsym_jax {report['versions']['rotsym_jax']} (`{report['command']}`); the full report is rotsym_report.json.", ""]
    return "\n".join(lines)


def _save(checkpoint: Checkpoint, params, args, dtype, report: dict, recipe: dict, card: str) -> Path:
    files = {
        "README.md": card,
        "rotsym_config.yaml": yaml.safe_dump(recipe, sort_keys=False),
        "rotsym_report.json": json.dumps(report, indent=2),
    }
    try:
        return save_hf(checkpoint, params, args.out, dtype=dtype, overwrite=args.overwrite, extra_files=files)
    except (CheckpointError, FileExistsError) as e:
        args.error(f"OUT: {e}")
