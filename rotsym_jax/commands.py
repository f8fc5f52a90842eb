"""The checkpoint commands of `rotsym` (align, merge, inspect): Hugging Face folders in, a folder
out with the weights, a report, a model card and the recipe, written atomically by `save_hf`.

A command reaches the heavy modules (alignment and its solvers, statistics and the Flax models,
streaming) through `rotsym_jax`'s lazy attributes (`rj.align`, `rj.stats`...), imported when it
runs: a plain merge then starts in the time JAX takes to import, not in that of everything the
CLI can do."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import inspect
import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

import jax
import numpy as np
import yaml

import rotsym_jax as rj

from . import barrier as barrier_mod
from . import merge as merge_methods
from . import recipe as recipe_mod
from .checks import TASK_HEAD_LEAVES, architecture_mismatch, is_head
from .distances import distance_report
from .hf import Checkpoint, CheckpointError, check_output, family_for, load_hf, save_hf, spec_for
from .memory import cost_matrix_bytes, in_memory_bytes
from .options import STREAMED_ALIGN_MODES, AlignOptions
from .pytree import flatten, write_text_atomic
from .spec import bind
from .version import version


def _options(args) -> dict:
    """The command line's alignment options, checked by `AlignOptions`, as reports record them."""
    return _recorded(AlignOptions(attention=args.attention, heads=args.heads, rescale=args.rescale, ffn=args.ffn, layers=args.layers,
                                  residual=args.residual))


def _recorded(options: AlignOptions) -> dict:
    """The options a report, a recipe and the command line name (`AlignOptions` defaults the rest)."""
    return {k: v for k, v in options.as_dict().items() if k in ("attention", "heads", "rescale", "ffn", "layers", "residual")}


def _load(path: str, what: str, error, weights: bool = True) -> Checkpoint:
    try:
        return load_hf(_folder(path, what, error), weights=weights)
    except (FileNotFoundError, CheckpointError) as e:
        error(f"{what}: {e}")


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a checkpoint folder needs from a Hub repository: config, weights, tokenizer, model card.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.md"]


def _folder(path: str, what: str, error) -> str:
    """`path` itself when it exists; a Hugging Face Hub id (org/name) becomes its snapshot folder
    (downloaded, or read from the local cache with HF_HUB_OFFLINE=1)."""
    if Path(path).exists() or not HUB_ID.fullmatch(str(path)):
        return path
    import huggingface_hub

    try:
        return huggingface_hub.snapshot_download(str(path), allow_patterns=HUB_FILES)
    except Exception as e:  # offline and not cached, unknown repository, network errors
        error(
            f"{what}: {path} is neither a folder nor a Hugging Face Hub id that can be fetched or found in the "
            f"local cache ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        )


def _nbytes(checkpoint: Checkpoint, dtype=None) -> int:
    """Bytes of the params as loaded (each leaf in its stored dtype, or `dtype`)."""
    flat = flatten(checkpoint.params)
    return sum(int(np.prod(x.shape)) * np.dtype(dtype or checkpoint.stored_dtypes.get(p, x.dtype)).itemsize for p, x in flat.items())


def _aligning_spec(checkpoint: Checkpoint):
    """The spec the commands align with: the family's, with every task head set aside (label
    spaces may differ even where the heads' shapes agree), as the streamed runs do."""
    return dataclasses.replace(spec_for(checkpoint), task_head=TASK_HEAD_LEAVES)


def _cost_bytes(checkpoint: Checkpoint) -> int:
    """The permutation groups' cost matrices, all layers at once (float32 on the device)."""
    return cost_matrix_bytes(bind(spec_for(checkpoint), checkpoint.params))


class _Progress:
    """The steps of a long command (loading each model, aligning, statistics, merging, saving) as a
    progress bar on stderr, and a second bar inside the steps that have natural units: statistics
    batches, models aligned to the anchor, align_many passes. Off with --quiet, with --dry-run, and
    when stderr is not a terminal. An alignment shows no per-layer progress: every layer is solved
    in one batched computation on the device."""

    def __init__(self, args, total: int, what: str):
        from tqdm import tqdm

        self._tqdm = tqdm
        self.disable = args.quiet or getattr(args, "dry_run", False) or not sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=what, unit="step", file=sys.stderr, leave=False, disable=self.disable)

    def step(self, name: str, fn, *fn_args, **fn_kwargs):
        self.bar.set_postfix_str(name)
        result = fn(*fn_args, **fn_kwargs)
        self.bar.update()
        return result

    @contextlib.contextmanager
    def detail(self, what: str, total: int | None, unit: str):
        """A second bar below the first; yields its `update` (call it once per unit done)."""
        bar = self._tqdm(total=total, desc=what, unit=unit, file=sys.stderr, leave=False, position=1, disable=self.disable)
        try:
            yield bar.update
        finally:
            bar.close()

    def close(self):
        self.bar.close()


def _print_plan(lines: list[str], estimate: int, formula: str) -> int:
    print("\n".join(lines))
    print(f"memory estimate: {estimate / 2**30:.2f} GiB at the peak ({formula}); nothing was read but configs and headers, nothing written")
    return 0


def _same_architecture(anchor: Checkpoint, other: Checkpoint, what: str, error, anchor_what: str = "the anchor") -> None:
    shapes = lambda ck: {p: np.shape(x) for p, x in flatten(ck.params).items()}
    problem = architecture_mismatch((f"{anchor_what} ({anchor.source})", anchor.family, shapes(anchor)),
                                    (f"{what} ({other.source})", other.family, shapes(other)))
    if problem:
        error(problem)


def _note_headless_residual(args, options: dict, models: list) -> None:
    """A model without a task head outputs the residual stream itself: aligning the stream moves
    its last hidden state into the new basis (what a head reading it would compute is kept)."""
    headless = [what for what, ck in models if ck.layout.head is None]
    if options.get("residual", "none") != "none" and headless and not args.quiet:
        print(f"note: {', '.join(headless)} {'has' if len(headless) == 1 else 'have'} no task head, so with --residual the last hidden "
              "state comes out in the aligned basis (its features permuted or rotated); what a head reading it computes is unchanged",
              file=sys.stderr)


def _check_out(args, sources: list[Checkpoint], output_bytes: int) -> None:
    """OUT checked before any weight is read: not a source folder, not existing without
    --overwrite, writable, with room for the weights on its disk."""
    try:
        check_output(args.out, [ck.source for ck in sources], overwrite=args.overwrite, output_bytes=output_bytes, overwrite_option="--overwrite")
    except (FileExistsError, NotADirectoryError, PermissionError) as e:
        args.error(f"OUT: {e}")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            args.error(f"OUT: {e.strerror or e}")
        raise


# ---- align ------------------------------------------------------------------------------------------

def _align(args) -> int:
    start = time.perf_counter()
    options = _options(args)
    # Configs and headers first: every refusal comes before any weight is read.
    a = _load(args.a, "A", args.error, weights=False)
    b = _load(args.b, "B", args.error, weights=False)
    _same_architecture(a, b, "B", args.error, "A")
    _check_out(args, [a, b], _nbytes(b))
    _note_headless_residual(args, options, [("B", b)])
    estimate = in_memory_bytes([_nbytes(a), _nbytes(b)], moved=[_nbytes(b)], cost_bytes=_checked(args.error, _cost_bytes, b))
    if _streaming_wanted(args, estimate, options):
        return _align_streaming(args, a, b, start)
    if args.dry_run:
        return _print_plan(
            [f"align {args.b} ({b.family}) to {args.a}, options {options}, write {args.out}"],
            estimate, "the runtime + A + B + B moved + the FFN cost matrices")
    progress = _Progress(args, 4, "align")
    a = progress.step("loading A", _load, args.a, "A", args.error)
    b = progress.step("loading B", _load, args.b, "B", args.error)
    params_a, params_b = _folded([a.params, b.params], b, options)
    # Task heads may differ (other label sets, or none): align leaves them out and B keeps its own.
    result = progress.step("aligning B to A", _checked, args.error, rj.align, params_a, params_b, _aligning_spec(b), **options)
    report = _report(args, {"a": a, "b": b}, options, result.report, start)
    recipe = {"command": "align", "a": str(args.a), "b": str(args.b), "options": options}
    card = _model_card(Path(args.out).name, base=str(args.b), tags=["rotsym_jax", "aligned"], recipe=recipe, report=report,
                       summary=f"{args.b} moved by rotsym_jax, without changing its function, as close as possible to {args.a}.")
    out = progress.step("saving", _save, b, result.params, args, None, report, recipe, card)
    progress.close()
    if not args.quiet:
        _print_distances(result.report)
        print(f"wrote {out} ({time.perf_counter() - start:.1f} s)")
    return 0


# ---- merge ------------------------------------------------------------------------------------------

def _merge(args) -> int:
    start = time.perf_counter()
    if args.method is None:
        if len(args.paths) != 2 or Path(args.paths[0]).suffix not in (".yaml", ".yml"):
            args.error("give a recipe and the output folder (rotsym merge CONFIG.yaml OUT), or --method NAME A B ... OUT")
        try:
            plan = recipe_mod.load(args.paths[0])
        except recipe_mod.RecipeError as e:
            args.error(str(e))
        out = args.paths[1]
    else:
        if len(args.paths) < 3:
            args.error("give at least two models and the output folder: rotsym merge --method NAME A B OUT")
        *model_paths, out = args.paths
        method = _method(args.method, args.error)
        plan = recipe_mod.Recipe(
            models=tuple(model_paths), method=method.name, params=_method_params(method, args.param, args.error), base=args.base,
            align=args.align, align_options=_options(args), task_head=args.task_head, dtype=args.dtype, seed=args.seed,
        )
    args.out = out
    return _run_merge(plan, args, start)


def _method(name: str, error):
    method = merge_methods.METHODS.get(name)
    if method is None:
        error(f"method {name!r}: unknown; known methods: {sorted(merge_methods.METHODS)}")
    return method


def _run_merge(plan, args, start: float) -> int:
    method = _method(plan.method, args.error)
    params = {}
    for name, value in plan.params.items():  # a recipe's parameters are checked as the command line's
        declared = method.params.get(name)
        if declared is None:
            args.error(f"parameter {name!r}: merge method {method.name!r} has no such parameter; its parameters: {list(method.params)}")
        params[name] = _checked(args.error, declared.check, value)
    if any(k in method.needs for k in ("fishers", "grams")) and plan.data is None:
        args.error(f"method {method.name} needs statistics from data: give a recipe with a data section (rotsym merge CONFIG.yaml OUT)")
    if plan.base is None and "base" in method.needs:
        args.error(f"method {method.name} needs a base model (--base, or base: in the recipe): the model the others were fine-tuned from")
    # Configs and headers first: every refusal comes before any weight is read.
    models = [_load(p, f"model {i}", args.error, weights=False) for i, p in enumerate(plan.models)]
    for i, ck in enumerate(models[1:], 1):
        _same_architecture(models[0], ck, f"model {i}", args.error)
    base = None if plan.base is None else _load(plan.base, "base", args.error, weights=False)
    if base is not None:
        _same_architecture(models[0], base, "base", args.error)
    _check_out(args, models + ([base] if base is not None else []), _nbytes(models[0], plan.dtype))
    if plan.align != "none":
        _note_headless_residual(args, plan.align_options, [(f"model {i}", ck) for i, ck in enumerate(models)])
    if "fishers" in method.needs:  # the Fisher needs every model's logits
        for i, ck in enumerate(models):
            try:
                ck.require_head("Fisher merging")
            except CheckpointError as e:
                args.error(f"model {i}: {e}")
    # the data tokenized with the anchor's tokenizer (its folder and config: no weights needed)
    batches = None if plan.data is None else _checked(args.error, recipe_mod.batches, plan.data, models[0])
    anchor = models[0]
    options = _checked(args.error, lambda: _recorded(AlignOptions.of(plan.align_options)))
    sizes = [_nbytes(ck) for ck in models]
    aligned = plan.align != "none"
    estimate = in_memory_bytes(sizes + ([_nbytes(base)] if base is not None else []), moved=sizes[1:] if aligned else [],
                               cost_bytes=_checked(args.error, _cost_bytes, anchor) if aligned else 0, merged_bytes=_nbytes(anchor, np.float32))
    if _streaming_wanted(args, estimate, options, method=method.name, align=plan.align):
        return _merge_streaming(args, plan, method, params, models, base, batches, start)
    if args.dry_run:
        return _print_plan(
            [f"merge {len(models)} {anchor.family} models by {method.name} {params} (alignment: {plan.align}), write {args.out}",
             *(f"  model {i}: {p}" for i, p in enumerate(plan.models)), *([f"  base: {plan.base}"] if plan.base else []),
             *([f"  data: {plan.data.file}"] if plan.data else [])],
            estimate, "the runtime + the models + the base + the aligned copies and cost matrices + the merge in float32")
    steps = len(plan.models) + (plan.base is not None) + 3 + (plan.data is not None)
    progress = _Progress(args, steps, f"{method.name} merge")
    models = [progress.step(f"loading model {i}", _load, p, f"model {i}", args.error) for i, p in enumerate(plan.models)]
    if plan.base is not None:
        base = progress.step("loading base", _load, plan.base, "base", args.error)
    anchor = models[0]
    params_list, alignment = progress.step(f"alignment: {plan.align}", _checked, args.error, _aligned, models, plan.align, options, progress)
    # the base's norm gains are folded as the models' were (task vectors compare like with like)
    base_params = None if base is None or plan.align == "none" else _folded([base.params], anchor, options)[0]
    inputs = {"base": None if base is None else _with_anchor_head(base_params if base_params is not None else base.params, anchor.params, plan.task_head)}
    inputs["key"] = jax.random.key(plan.seed) if "key" in method.needs else None
    inputs["spec"] = spec_for(anchor) if "spec" in method.needs else None
    if batches is not None:
        inputs.update(progress.step("statistics", _statistics, method, models, params_list, batches, plan.seed, args.error, progress))
        if "batches" in method.optional:
            inputs["checkpoint"], inputs["batches"] = anchor, batches
    inputs = {k: v for k, v in inputs.items() if v is not None and (k in method.needs or k in method.optional)}
    merged = progress.step("merging", _checked, args.error, merge_methods.merge, method.name, params_list, task_head=plan.task_head, **inputs, **params)
    # On the host, where save_hf takes the weights anyway: the distance needs no compilation there.
    merged = jax.device_get(merged)
    distance = distance_report(spec_for(anchor), jax.device_get(anchor.params), merged)["total"]
    merge_report = {"alignment": alignment, "merged_distance_to_anchor": distance}
    report = _report(args, _merge_inputs(models, base), {"method": method.name, "params": params,
                     "align": plan.align, **({"align_options": options} if plan.align != "none" else {})}, merge_report, start)
    recipe_text = recipe_mod.to_yaml(dataclasses.replace(plan, params=params, align_options=options))
    written = progress.step("saving", _save, anchor, merged, args, plan.dtype, report, recipe_text, _merge_card(args, plan, method, recipe_text, report))
    progress.close()
    if not args.quiet:
        _print_table(_distance_rows(merge_report, _model_names(plan)))
        print(f"wrote {written} ({time.perf_counter() - start:.1f} s)")
    return 0


def _model_names(plan) -> list[str]:
    """The merged models' folder names, for the tables that list them."""
    return [Path(p).name for p in plan.models]


def _merge_inputs(models: list[Checkpoint], base: Checkpoint | None) -> dict:
    return {**{f"model {i}": ck for i, ck in enumerate(models)}, **({"base": base} if base is not None else {})}


def _merge_card(args, plan, method, recipe_text: str, report: dict) -> str:
    """The model card of a merge: its `base_model` is the base the models were fine-tuned from
    when there is one, else the models merged (Hugging Face's convention for merges)."""
    base = plan.base if plan.base is not None else list(plan.models)
    return _model_card(Path(args.out).name, base=base, tags=["merge", "rotsym_jax"], recipe=yaml.safe_load(recipe_text), report=report,
                       names=_model_names(plan), summary=f"A {method.name} merge by rotsym_jax of {', '.join(plan.models)}"
                               f"{f' (base {plan.base})' if plan.base else ''} (alignment: {plan.align}).")


def _statistics(method, models, params_list, batches, seed, error, progress) -> dict:
    """Fisher or Gram statistics of each model as aligned (each run by its own checkpoint)."""
    with progress.detail("statistics", len(models) * len(batches), "batch") as tick:
        if "fishers" in method.needs:
            kind, key = _fisher_choice(batches, models[0], seed)
            return {"fishers": [_checked(error, rj.stats.fisher, ck, p, batches, kind=kind, key=key, progress=tick) for ck, p in zip(models, params_list)]}
        if "grams" in method.needs:
            return {"grams": [_checked(error, rj.stats.grams, ck, p, batches, progress=tick) for ck, p in zip(models, params_list)]}
    return {}


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


def _aligned(models: list[Checkpoint], mode: str, options: dict, progress) -> tuple[list, dict]:
    """The models' params after the alignment `mode`, and the report of the alignment. Task heads
    may differ (other label sets, or none): align leaves them out and each model keeps its own."""
    params = [ck.params for ck in models]
    if mode == "none":
        return params, {"mode": "none"}
    params = _folded(params, models[0], options)
    spec = _aligning_spec(models[0])
    if mode == "anchor":
        results = []
        with progress.detail("aligning to the anchor", len(params) - 1, "model") as tick:
            for p in params[1:]:
                results.append(rj.align(params[0], p, spec, **options))
                tick()
        report = {"mode": "anchor", "distances": [{k: r.report[k] for k in ("before", "after", "layers")} for r in results]}
        return [params[0]] + [r.params for r in results], report
    # At most max_iters sweeps (align_many's default) after the initial pass.
    passes = 1 + inspect.signature(rj.align_many).parameters["max_iters"].default
    with progress.detail("align_many", passes, "pass") as tick:
        many = rj.align_many(params, spec, progress=tick, **options)
    return many.params, {"mode": "many", "objective": many.objective, "stop": many.report["stop"]}


def _folded(params: list, checkpoint: Checkpoint, options: dict) -> list:
    """With residual="rotation" on an RMSNorm model, every model's norm gains folded into the
    layers that read them (same function, a valid checkpoint of the same type): a rotation of the
    residual stream needs uniform gains (MATH.md §10)."""
    if options.get("residual") != "rotation" or family_for(checkpoint.model_config.model_type).norm.kind != "rmsnorm":
        return params
    return [rj.fold_norms(spec_for(checkpoint), p) for p in params]


def _with_anchor_head(base: dict, anchor: dict, task_head: str) -> dict:
    """A base model without the anchor's task head gets it (task vectors of the head are moot
    when the anchor's head is kept)."""
    if task_head == "anchor" and "head" in anchor:
        return {**base, "head": anchor["head"]}
    return base


# ---- streaming (checkpoints bigger than memory) -----------------------------------------------------

def _streaming_wanted(args, estimate: int, options: dict, method=None, align="anchor") -> bool:
    """Stream when --max-memory is given (the streaming path refuses what it cannot do, with the
    reason), or when the in-memory run's `estimate` (`memory.in_memory_bytes`, what --dry-run
    prints) exceeds the memory available now and the run is one the streaming path can do;
    otherwise the in-memory path, as before."""
    if args.max_memory is not None:
        return True
    if options.get("residual", "none") != "none" or align not in STREAMED_ALIGN_MODES:
        return False
    if method is not None and method not in rj.streaming.STREAMABLE_METHODS:
        return False
    available = rj.streaming.available_memory()
    if estimate <= available:
        return False
    if not args.quiet:
        print(f"the models need about {estimate / 2**30:.1f} GiB in memory, {available / 2**30:.1f} GiB is available: "
              "streaming from disk to disk (--max-memory picks the budget)", file=sys.stderr)
    args.max_memory = int(0.8 * available)
    return True


def _stream_call(args, fn, *fn_args, **fn_kwargs):
    """A streaming call, its refusals and bad inputs as usage errors naming the problem."""
    try:
        return fn(*fn_args, **fn_kwargs)
    except (rj.streaming.StreamingError, CheckpointError, FileNotFoundError) as e:
        args.error(str(e))
    except FileExistsError as e:
        args.error(f"OUT: {e}")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            args.error(f"OUT: {e.strerror or e} (the partial output was removed; the inputs are untouched)")
        raise
    except ValueError as e:
        args.error(str(e))


def _stream_progress(args, what: str):
    """A progress callback (done, total) drawing one bar of layer chunks, and its closer."""
    progress = _Progress(args, 0, what)
    progress.bar.unit = "chunk"

    def update(done, total):
        progress.bar.total = total
        progress.bar.n = done
        progress.bar.refresh()

    return update, progress.close


def _align_streaming(args, a: Checkpoint, b: Checkpoint, start: float) -> int:
    options = _options(args)
    if args.dry_run:
        plan = _stream_call(args, rj.streaming.plan_align, args.a, args.b, max_memory=args.max_memory)
        return _print_plan([f"align {args.b} ({b.family}) to {args.a}, options {options}, write {args.out}", plan.describe()],
                           plan.peak_bytes, f"streaming, {plan.chunk_layers} layers at a time")
    recipe = {"command": "align", "a": str(args.a), "b": str(args.b), "options": options, "max_memory": args.max_memory}

    def files(result):
        report = _report(args, {"a": a, "b": b}, options, result, start)
        card = _model_card(Path(args.out).name, base=str(args.b), tags=["rotsym_jax", "aligned"], recipe=recipe, report=report,
                           summary=f"{args.b} moved by rotsym_jax, without changing its function, as close as possible to {args.a}.")
        return {"README.md": card, "rotsym_config.yaml": yaml.safe_dump(recipe, sort_keys=False), "rotsym_report.json": json.dumps(report, indent=2)}

    update, close = _stream_progress(args, "align (streaming)")
    try:
        result = _stream_call(args, rj.streaming.align_to_disk, args.a, args.b, args.out, **options, max_memory=args.max_memory,
                              overwrite=args.overwrite, extra_files=files, progress=update)
    finally:
        close()
    if not args.quiet:
        _print_distances(result.report)
        print(f"wrote {result.path} ({time.perf_counter() - start:.1f} s, {result.plan.chunk_layers} layers at a time)")
    return 0


def _merge_streaming(args, plan, method, params: dict, models: list[Checkpoint], base: Checkpoint | None, batches, start: float) -> int:
    if plan.data is not None and method.name not in rj.streaming.STATISTICS_METHODS:
        args.error(f"method {method.name}: statistics from data are not streamed; run without --max-memory")
    options = _checked(args.error, lambda: _recorded(AlignOptions.of(plan.align_options)))
    statistics = {}
    if batches is not None:  # the Fisher's kind and key as in memory
        kind, key = _fisher_choice(batches, models[0], plan.seed)
        statistics = {"batches": batches, "fisher_kind": kind, "fisher_key": key}
    if args.dry_run:
        estimate = _stream_call(args, rj.streaming.plan_merge, method.name, list(plan.models), base=plan.base, align=plan.align,
                                dtype=plan.dtype, max_memory=args.max_memory, task_head=plan.task_head, **statistics)
        return _print_plan(
            [f"merge {len(models)} {models[0].family} models by {method.name} {params} (alignment: {plan.align}), write {args.out}",
             *(f"  model {i}: {p}" for i, p in enumerate(plan.models)), *([f"  base: {plan.base}"] if plan.base else []),
             *([f"  data: {plan.data.file}"] if plan.data else []), estimate.describe()],
            estimate.peak_bytes, f"streaming, {estimate.chunk_layers} layers at a time")
    recipe_text = recipe_mod.to_yaml(dataclasses.replace(plan, params=params, align_options=options))

    def files(result):
        report = _report(args, _merge_inputs(models, base), {"method": method.name, "params": params,
                         "align": plan.align, **({"align_options": options} if plan.align != "none" else {})}, result, start)
        return {"README.md": _merge_card(args, plan, method, recipe_text, report), "rotsym_config.yaml": recipe_text,
                "rotsym_report.json": json.dumps(report, indent=2)}

    update, close = _stream_progress(args, f"{method.name} merge (streaming)")
    try:
        result = _stream_call(args, rj.streaming.merge_to_disk, method.name, list(plan.models), args.out, base=plan.base, align=plan.align,
                              align_options=options if plan.align != "none" else None, seed=plan.seed, task_head=plan.task_head,
                              dtype=plan.dtype, params=params, max_memory=args.max_memory, overwrite=args.overwrite, extra_files=files,
                              progress=update, **statistics)
    finally:
        close()
    if not args.quiet:
        _print_table(_distance_rows(result.report, _model_names(plan)))
        print(f"wrote {result.path} ({time.perf_counter() - start:.1f} s, {result.plan.chunk_layers} layers at a time)")
    return 0


def _fisher_choice(batches, anchor: Checkpoint, seed: int) -> tuple[str, jax.Array | None]:
    """The Fisher's kind and key: empirical with labels; else expected, sampled from the recipe's
    seed for an LM head (exact over the classes otherwise)."""
    labelled = "labels" in batches[0]
    key = None if labelled or anchor.layout.head != "lm" else jax.random.key(seed)
    return ("empirical" if labelled else "expected"), key


# ---- barrier ----------------------------------------------------------------------------------------

def _barrier(args) -> int:
    start = time.perf_counter()
    if args.points < 2:
        args.error(f"--points {args.points}: the path needs at least its two ends")
    try:
        import matplotlib  # noqa: F401  (plots draws with it)
    except ImportError as e:
        args.error(f"this command draws the curves with matplotlib, which is missing ({e}): pip install 'rotsym_jax[plots]'")
    # Configs and headers first: every refusal comes before any weight is read.
    a, b = _load(args.a, "A", args.error, weights=False), _load(args.b, "B", args.error, weights=False)
    _same_architecture(a, b, "B", args.error, "A")
    for what, ck in (("A", a), ("B", b)):
        try:
            ck.require_head("the loss along the path")
        except CheckpointError as e:
            args.error(f"{what}: {e}")
    heads = [{p: np.shape(x) for p, x in flatten(ck.params).items() if is_head(p)} for ck in (a, b)]
    if a.layout.head != b.layout.head:
        args.error(f"A has a {a.layout.head!r} head and B a {b.layout.head!r} head: the path between them needs one head")
    if heads[0] != heads[1]:
        args.error(f"A's and B's {a.layout.head!r} heads have different shapes (other label sets): the path between them needs one head")
    data = recipe_mod.Data(Path(args.data), args.text_field, args.label_field, args.batch_size, args.count, args.max_length)
    if not data.file.is_file():
        args.error(f"--data {data.file}: no such file")
    out = Path(args.out)
    _check_writable_folder(args, out, "--out")
    earlier = [name for name in BARRIER_FILES if (out / name).exists()]
    if earlier and not args.overwrite:
        args.error(f"--out {out} holds {' and '.join(earlier)} (an earlier run?); pass --overwrite to replace them")
    batches = _checked(args.error, recipe_mod.batches, data, a)
    a, b = _load(args.a, "A", args.error), _load(args.b, "B", args.error)
    loss = _checked(args.error, recipe_mod.loss_fn, a, batches)
    alphas = np.linspace(0.0, 1.0, args.points)
    paths = {"plain": b.params}
    options = _options(args)
    if args.align == "anchor":
        paths["aligned"] = _checked(args.error, rj.align, a.params, b.params, _aligning_spec(b), **options).params
    results = {name: barrier_mod.loss_barrier(loss, a.params, other, alphas) for name, other in paths.items()}
    report = _report(args, {"a": a, "b": b}, {"align": args.align, **options, "points": args.points, "data": str(data.file)},
                     {name: {"barrier": r["barrier"], "alpha_max": r["alpha_max"], "curve": {k: np.asarray(v).tolist() for k, v in r["curve"].items()}}
                      for name, r in results.items()}, start)
    write_text_atomic(out / "barrier.json", json.dumps(report, indent=2))
    name_a, name_b = Path(args.a).name, Path(args.b).name
    rj.plots.curves(results, path=out / "barrier.png", title=f"{name_a} → {name_b}", xlabel=f"α  (0: {name_a}, 1: {name_b})")
    for name, r in results.items():
        print(f"{name:<8} barrier {r['barrier']:.4f} at alpha {r['alpha_max']:.2f}")
    print(f"wrote {out / 'barrier.json'} and {out / 'barrier.png'} ({time.perf_counter() - start:.1f} s)")
    return 0


BARRIER_FILES = ("barrier.json", "barrier.png")


def _check_writable_folder(args, folder: Path, what: str) -> None:
    """A folder the command may write into (created if missing), checked before any work."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if existing == folder and not folder.is_dir():
        args.error(f"{what} {folder}: exists and is not a folder")
    if existing != folder and not existing.is_dir():
        args.error(f"{what} {folder}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        args.error(f"{what} {folder}: {existing} is not writable")


# ---- inspect ----------------------------------------------------------------------------------------

def _inspect(args) -> int:
    a = _load(args.a, "A", args.error)
    bound = bind(spec_for(a), a.params)
    flat = flatten(a.params)
    count = sum(int(np.size(x)) for x in flat.values())
    dtypes = sorted({str(np.dtype(d)) for d in a.stored_dtypes.values()}) if a.stored_dtypes else [str(a.dtype)]
    runs = "" if a.layout.head is None else " (run here)" if a.runs_head else " (read, aligned, merged and saved; not run here)"
    print(f"{a.source}: {a.family} ({a.model_config.model_type}), head {a.layout.head}{runs}, {count:,} parameters, stored as {'/'.join(dtypes)}")
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
        _same_architecture(a, b, "B", args.error, "A")
        result = _checked(args.error, rj.align, a.params, b.params, _aligning_spec(b), **_options(args))
        _print_distances(result.report, per_layer=True)
    return 0


# ---- output -----------------------------------------------------------------------------------------

KINDS_SHOWN = ("qk", "vo", "ffn", "other", "total")


def _print_distances(report: dict, per_layer: bool = False) -> None:
    rows = _distance_rows(report)
    if per_layer:
        rows += [(f"layer {layer} {label}", d[label]) for layer, d in report["layers"].items() for label in ("before", "after")]
    _print_table(rows)


def _print_table(rows: list[tuple[str, dict]]) -> None:
    """Distances per kind, one row per (label, {kind: distance}); the first column holds the widest
    label, so every number sits under its heading (a kind a row lacks is left blank)."""
    kinds = [k for k in KINDS_SHOWN if any(k in d for _, d in rows)]
    width = max([12] + [len(label) + 1 for label, _ in rows])
    print(f"{'distance':<{width}}" + "".join(f"{k:>10}" for k in kinds))
    for label, d in rows:
        print(f"{label:<{width}}" + "".join(f"{d[k]:>10.4f}" if k in d else " " * 10 for k in kinds))


def _report(args, inputs: dict, options: dict, result: dict, start: float) -> dict:
    return {
        "command": shlex.join(["rotsym", *args.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "inputs": {name: {"path": str(ck.source), "family": ck.family, "model_type": ck.model_config.model_type} for name, ck in inputs.items()},
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


def _model_card(name: str, *, base: str | list[str], tags: list[str], recipe: dict, report: dict, summary: str,
                names: list[str] | None = None) -> str:
    front = yaml.safe_dump({"base_model": base, "tags": tags}, sort_keys=False).strip()
    lines = ["---", front, "---", "", f"# {name}", "", summary, "", "## Recipe", "", "```yaml",
             yaml.safe_dump(recipe, sort_keys=False).strip(), "```", ""]
    rows = _distance_rows(report["result"], names)
    if rows:
        kinds = [k for k in KINDS_SHOWN if any(k in d for _, d in rows)]
        lines += ["## Distances to the anchor", "", "Euclidean distances of the weights (task heads left out), per kind.", "",
                  "| | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
        lines += [f"| {label} | " + " | ".join(f"{d[k]:.4f}" if k in d else "" for k in kinds) + " |" for label, d in rows]
        lines += [""]
    lines += [f"Made with rotsym_jax {report['versions']['rotsym_jax']} (`{report['command']}`); the full report is rotsym_report.json.", ""]
    return "\n".join(lines)


def _distance_rows(result: dict, names: list[str] | None = None) -> list[tuple[str, dict]]:
    """(label, {kind: distance}) rows of a report's distances: B before and after (align); each
    model (`names[i]` after its number) before and after its alignment, then the merged model."""
    if "before" in result:
        return [("before", result["before"]), ("after", result["after"])]
    rows = []
    for i, d in enumerate(result.get("alignment", {}).get("distances", []), 1):
        model = f"model {i}" + (f" ({names[i]})" if names else "")
        rows += [(f"{model} before alignment", d["before"]), (f"{model} after alignment", d["after"])]
    if "merged_distance_to_anchor" in result:
        rows.append(("merged, to the anchor", result["merged_distance_to_anchor"]))
    return rows


def _save(checkpoint: Checkpoint, params, args, dtype, report: dict, recipe: dict | str, card: str) -> Path:
    files = {
        "README.md": card,
        "rotsym_config.yaml": recipe if isinstance(recipe, str) else yaml.safe_dump(recipe, sort_keys=False),
        "rotsym_report.json": json.dumps(report, indent=2),
    }
    try:
        return save_hf(checkpoint, params, args.out, dtype=dtype, overwrite=args.overwrite, extra_files=files)
    except (CheckpointError, FileExistsError) as e:
        args.error(f"OUT: {e}")
