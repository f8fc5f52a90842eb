"""The checkpoint commands of `rotsym` (align, merge, barrier, inspect): each parses its arguments
into a library call (`pipeline.align_checkpoints`, `pipeline.merge_checkpoints`, `barrier`,
`align`) and prints what it returns; a `pipeline.PipelineError` becomes a one-line usage error.

A command reaches the heavy modules (alignment and its solvers, statistics and the Flax models,
streaming) through `rotsym_jax`'s lazy attributes (`rj.align`, `rj.stats`...), imported when it
runs: a plain merge then starts in the time JAX takes to import, not in that of everything the
CLI can do."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import yaml

import rotsym_jax as rj

from .. import owned, verify
from ..checks import is_head
from ..engine.report import MOVED_LEGEND, moved_lines
from ..errors import InputError
from ..io import hf as hf_mod
from ..io import orbax as orbax_mod
from ..io import recipe as recipe_mod
from ..io.card import distance_legend, distance_rows, kinds_shown, report_of
from ..io.hf import CheckpointError, spec_for
from ..io.loading import load_checkpoint
from ..landscape import barrier as barrier_mod
from ..mergekit_pipeline import merge_mergekit
from ..merging import lora as lora_mod
from ..merging import mergekit as mergekit_mod
from ..merging import moe as moe_mod
from ..moe_pipeline import moe_to_disk
from ..options import DECLARED, AlignOptions, recorded
from ..pipeline import (
    DryRun,
    PipelineError,
    Progress,
    align_checkpoints,
    align_pair,
    aligning_spec,
    check_alignment_data,
    checked,
    folded,
    merge_checkpoints,
    merge_method,
    same_architecture,
)
from ..processes import ProcessError
from ..pytree import flatten, write_text_atomic
from ..spec import bind
from ..verify import verify_groups
from .solved import settled_line, solved_with


def _options(args, method: str | None = None) -> dict:
    """The command line's alignment options (with `method`, or the command's --method), checked
    by `AlignOptions` (a bad pair is a usage error), as reports record them."""
    given = {dest: getattr(args, dest) for dest in ALIGN_FLAGS if hasattr(args, dest)}
    method = method or getattr(args, "align_method", "weights")
    if hasattr(args, "align_methods") and method == "activations":  # barrier's several methods: --maps is learned's and weights'
        given.pop("maps", None)
    return _usage(args, lambda: recorded(AlignOptions(**given, method=method).settled()))


# The alignment flags (`options.DECLARED`) by argparse dest: the option's name.
ALIGN_FLAGS = tuple(name for name, declared in DECLARED.items() if declared.flag is not None)


def _given_align_flags(args) -> dict:
    """The alignment flags given on the command line with a value other than their default."""
    parser = args.error.__self__
    return {dest: getattr(args, dest) for dest in ALIGN_FLAGS if hasattr(args, dest) and getattr(args, dest) != parser.get_default(dest)}


def _flag_names(dests) -> str:
    return ", ".join(DECLARED[d].flag for d in dests)


def _data(args, label_field=None) -> recipe_mod.Data | None:
    """The command's --data and its options as a `recipe.Data`, or None without --data."""
    if args.data is None:
        return None
    return recipe_mod.Data(Path(args.data), args.text_field, label_field, args.batch_size, args.count, args.max_length)


def _usage(args, fn, *fn_args, **fn_kwargs):
    """`fn(...)`, a PipelineError (or a ValueError: bad options, models that do not fit) as a usage error."""
    team = getattr(args, "team", None)  # joined processes: a failure here fails them all, with its message
    try:
        with team.together() if team is not None else contextlib.nullcontext():
            return checked(fn, *fn_args, **fn_kwargs)
    except (PipelineError, ProcessError) as e:  # another process's failure, or runs that differ: its message, no traceback
        args.error(str(e))


def _command(args) -> str:
    return shlex.join(["rotsym", *args.argv])


class _Progress(Progress):
    """The steps of a long command (loading each model, aligning, statistics, merging, saving) as a
    progress bar on stderr, and a second bar inside the steps that have natural units: statistics
    batches, models aligned to the anchor, align_many passes, streamed chunks. Off with --quiet,
    with --dry-run, and when stderr is not a terminal; notes go to stderr unless --quiet. An
    alignment shows no per-layer progress: every layer is solved in one batched computation."""

    def __init__(self, args, total: int, what: str):
        from tqdm import tqdm  # the command line's only, loaded with it

        self._tqdm, self.quiet = tqdm, args.quiet
        self.disable = args.quiet or getattr(args, "dry_run", False) or not sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=what, unit="step", file=sys.stderr, leave=False, disable=self.disable)

    def step(self, name: str, fn, *fn_args, **fn_kwargs):
        self.bar.set_postfix_str(name)
        result = fn(*fn_args, **fn_kwargs)
        self.bar.update()
        return result

    @contextlib.contextmanager
    def detail(self, what: str, total: int | None, unit: str):
        bar = self._tqdm(total=total, desc=what, unit=unit, file=sys.stderr, leave=False, position=1, disable=self.disable)
        try:
            yield bar.update
        finally:
            bar.close()

    @contextlib.contextmanager
    def chunks(self, what: str):
        """A streamed run's chunks on the main bar (the streamed run is its one step)."""
        self.bar.set_description(what)
        self.bar.unit = "chunk"

        def update(done, total):
            self.bar.total, self.bar.n = total, done
            self.bar.refresh()

        yield update

    def note(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stderr)

    def close(self):
        self.bar.close()


class _Notes(Progress):
    """Notes on stderr, no bars: a command that prints its own lines (barrier)."""

    def note(self, text: str) -> None:
        print(text, file=sys.stderr)


def _finish(args, outcome, start: float) -> int:
    """Print a dry run's plan, or a written run's distances and where it went."""
    if isinstance(outcome, DryRun):
        print("\n".join(outcome.lines))
        print(f"memory estimate: {outcome.estimate / 2**30:.2f} GiB at the peak ({outcome.formula}); nothing was read but configs and "
              "headers, nothing written")
        return 0
    if getattr(args, "team", None) is not None and not args.team.lead:  # process 0 prints the run's summary
        return 0
    if not args.quiet:
        _print_table(outcome.rows)
        result = outcome.report.get("result") or {}
        alignment = result.get("alignment") or {}
        _print_moved([("B", result.get("moved"))] + [(f"model {i}", d.get("moved")) for i, d in enumerate(alignment.get("distances", []), 1)]
                     + [(f"model {i}", m) for i, m in enumerate(alignment.get("moved", []))])  # align_many's: every model, the first too
        if alignment.get("mode") == "many":  # every model moved: no before/after of one model to print
            f = alignment["objective"]
            stopped = STOPS.get(alignment["stop"], alignment["stop"])
            print(f"align_many: the models' summed squared distance to their mean, F = {f[0]:.6g} after the first pass, {f[-1]:.6g} after "
                  f"{len(f) - 1} sweep{'s' * (len(f) != 2)} ({stopped})")
        options = outcome.report.get("options") or {}
        settled = settled_line(result.get("settled") or alignment.get("settled"), (options.get("align_options") or options).get("residual"))
        if settled:  # what a ceiling (or "auto") became where it is not what was asked
            print(settled)
        chunks = "" if outcome.chunk_layers is None else f", {outcome.chunk_layers} layer{'s' * (outcome.chunk_layers != 1)} at a time"
        print(f"wrote {outcome.path} ({time.perf_counter() - start:.1f} s{chunks})")
    return 0


@contextlib.contextmanager
def _writing(args, out, progress, inputs):
    """The lock beside OUT held while the command runs (`owned.writing`), taken before any weight is
    read: a second run writing the same OUT refuses at once. What killed runs left beside OUT is
    cleaned up (`owned.sweep`), what is not provably theirs named in a note. Dry runs, the
    processes that do not publish and an OUT inside one of the `inputs` (refused by the run, which
    never writes into its inputs, not even a lock file) take no lock."""
    team = getattr(args, "team", None)
    resolved = Path(out).resolve()
    inside = any(Path(p).resolve() in (resolved, *resolved.parents) for p in inputs if p is not None and Path(p).exists())
    if args.dry_run or (team is not None and not team.lead) or inside:
        yield
        return
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(owned.writing(out))
        except owned.OutputBusy as e:
            args.error(f"OUT: {e}")
        for note in owned.sweep(Path(out).absolute().parent):
            progress.note(f"note: {note}")
        yield


# ---- align ------------------------------------------------------------------------------------------

def _at_step(args, paths: list) -> list:
    """The inputs with every Orbax run replaced by its folder of step --step, else of its latest
    step (so that plans, reports and cards name the step read)."""
    runs = [p for p in paths if p is not None and orbax_mod.steps(p)]
    if args.step is not None and not runs:
        args.error(f"--step {args.step}: none of the inputs is an Orbax training run (a folder of numbered steps)")
    return [str(_usage(args, orbax_mod.step_folder, p, args.step)) if p in runs else p for p in paths]


def _join_processes(args, out, unstreamed: str | None = None) -> None:
    """`processes.initialize` from --coordinator/--num-processes/--process-id or --distributed,
    before anything else touches JAX, and after the refusals that need no other process (an
    output that exists, an option the processes cannot split: `unstreamed` says which), so that
    a lone process refuses at once instead of waiting for the others. --dry-run joins nothing
    (it reads headers only). Joined, `args.team` is this process's `processes.Team`."""
    given = {"--coordinator": args.coordinator, "--num-processes": args.num_processes, "--process-id": args.process_id}
    named = [flag for flag, value in given.items() if value is not None]
    if not (named or args.distributed):
        return
    if args.distributed and named:
        args.error(f"--distributed detects the processes from the cluster; drop {', '.join(named)} or --distributed")
    if named:
        missing = [flag for flag, value in given.items() if value is None]
        if missing:
            args.error(f"{', '.join(named)} needs {', '.join(missing)} too (or --distributed on a cluster JAX detects)")
        if not 0 <= args.process_id < args.num_processes:
            args.error(f"--process-id {args.process_id}: expected 0 to {args.num_processes - 1} (--num-processes {args.num_processes})")
    if args.dry_run:
        return
    if unstreamed:
        args.error(f"several processes split a streamed run's layers between them, and {unstreamed}; run it in one process")
    if Path(out).exists() and not args.overwrite:
        args.error(f"OUT: {out} exists; pass --overwrite to replace it")
    if not args.quiet:
        where = "as the cluster says" if args.distributed else f"at {args.coordinator}, process {args.process_id} of {args.num_processes}"
        print(f"joining the other processes {where} (each waits for all; JAX gives up after 5 minutes)", file=sys.stderr)
    rj.processes.initialize(*(() if args.distributed else (args.coordinator, args.num_processes, args.process_id)))
    args.team = rj.processes.Team.current()


def _run_options(args, progress) -> dict:
    """How the align and merge commands run and write (`pipeline.RunOptions`' fields), from their flags."""
    return {"overwrite": args.overwrite, "max_memory": args.max_memory, "dry_run": args.dry_run, "format": args.format,
            "command": _command(args), "progress": progress, "overwrite_option": "--overwrite", "records": _records(args)}


def _records(args) -> tuple:
    """The inferred records of --record FILE (each a JSON object, as the proof's note prints it)."""
    records = []
    for file in args.record or ():
        try:
            record = rj.InferredRecord.from_json(json.loads(Path(file).read_text()))
            if not record.proven:
                args.error(f"--record {file}: its 'proven' is empty; a record is taken with the proof it was printed with")
            records.append(record)
        except OSError as e:
            args.error(f"--record {file}: {e.strerror or e}")
        except (ValueError, AttributeError) as e:  # not JSON, not an object, or missing keys
            args.error(f"--record {file}: not an inferred record as the note prints it ({e})")
    return tuple(records)


def _align(args) -> int:
    start = time.perf_counter()
    replay = _align_recipe(args)
    if replay is None:
        if len(args.paths) != 3:
            args.error("give A B OUT, or the recipe an align wrote and the output folder: rotsym align RECIPE.yaml OUT")
        args.a, args.b, args.out = args.paths
        options, data, seed, dtype = _options(args), _data(args, args.label_field), args.align_seed, args.dtype
    else:
        args.a, args.b, args.out = replay.a, replay.b, args.paths[1]
        options = _usage(args, lambda: recorded(AlignOptions(**replay.options).settled()))  # as `_options` checks the flags
        data, seed, dtype, args.format = replay.data, replay.seed, replay.dtype, replay.format
    _join_processes(args, args.out, rj.pipeline.unstreamed({"residual": options["residual"], "method": options["method"]}, None, "anchor"))
    args.a, args.b = _at_step(args, [args.a, args.b])
    progress = _Progress(args, 4, "align")
    try:
        with _writing(args, args.out, progress, [args.a, args.b]):
            outcome = _usage(args, align_checkpoints, args.a, args.b, args.out, options, data=data, seed=seed, dtype=dtype,
                             **_run_options(args, progress))
    finally:
        progress.close()
    return _finish(args, outcome, start)


def _align_recipe(args) -> recipe_mod.AlignRecipe | None:
    """The align recipe of `rotsym align RECIPE.yaml OUT` (None: A B OUT), read and checked; the
    flags it sets itself are refused where given."""
    if len(args.paths) != 2 or Path(args.paths[0]).suffix not in (".yaml", ".yml"):
        return None
    if not recipe_mod.is_align_recipe(args.paths[0]):
        args.error(f"{args.paths[0]}: not the recipe of an align (command: align); rotsym merge CONFIG.yaml OUT runs the others")
    set_by_recipe = dict(method="align_method", data="data", batch_size="batch_size", count="count", max_length="max_length",
                         text_field="text_field", label_field="label_field", seed="align_seed", dtype="dtype", format="format", step="step")
    given = [f"--{flag.replace('_', '-')}" for flag, dest in set_by_recipe.items() if getattr(args, dest) != args.error.__self__.get_default(dest)]
    _refuse_flags(args, [(flag, True) for flag in given + [DECLARED[d].flag for d in _given_align_flags(args)]],
                  "the recipe names its options, data, seed, dtype and format itself")
    try:
        return recipe_mod.load_align(args.paths[0])
    except recipe_mod.RecipeError as e:
        args.error(str(e))


# ---- merge ------------------------------------------------------------------------------------------

def _merge(args) -> int:
    start = time.perf_counter()
    unstreamed = None if args.method is None else rj.pipeline.unstreamed({"residual": args.residual}, args.method, args.align or "anchor")
    _join_processes(args, args.paths[-1], unstreamed)
    if args.method is None:
        if len(args.paths) != 2 or Path(args.paths[0]).suffix not in (".yaml", ".yml"):
            args.error("give a recipe and the output folder (rotsym merge CONFIG.yaml OUT), or --method NAME A B ... OUT")
        if mergekit_mod.is_mergekit(args.paths[0]):
            return _merge_mergekit(args, start)
        if moe_mod.is_moe_config(args.paths[0]):
            args.error(f"{args.paths[0]} is a mergekit-moe config (experts:, no merge_method): rotsym moe CONFIG.yml OUT runs it")
        _refuse_flags(args, (("--last", args.last), ("--weights", args.weights), ("--align", args.align), ("--step", args.step),
                             ("--task-head", args.task_head), ("--seed", args.seed)), "a recipe names its models, weights, alignment and seed itself")
        if _given_align_flags(args):
            args.error(f"{_flag_names(_given_align_flags(args))}: a recipe names its alignment options itself (align_options)")
        try:
            plan = recipe_mod.load(args.paths[0])
        except recipe_mod.RecipeError as e:
            args.error(str(e))
        out = args.paths[1]
    else:
        *model_paths, out = args.paths
        if len(model_paths) == 1 and Path(model_paths[0]).suffix in (".yaml", ".yml") and Path(model_paths[0]).is_file():
            args.error(f"--method {args.method}: {model_paths[0]} is a config, which names its method itself: rotsym merge CONFIG.yml OUT")
        if args.last is not None:
            model_paths = _last_steps(args, model_paths)
        if len(model_paths) < 2:
            args.error("give at least two models and the output folder: rotsym merge --method NAME A B OUT")
        model_paths = _at_step(args, model_paths + [args.base])
        model_paths, args.base = model_paths[:-1], model_paths[-1]
        method = _usage(args, merge_method, args.method)
        # Checkpoint averaging (--last): one run's steps share a basin and a head; all of it is averaged.
        align = args.align or ("none" if args.last is not None else "anchor")
        if align == "none" and _given_align_flags(args):
            args.error(f"{_flag_names(_given_align_flags(args))}: alignment options, but this merge aligns nothing (--align none"
                       f"{', the default with --last' if args.align is None else ''}); give --align anchor, or drop them")
        task_head = args.task_head or ("merge" if args.last is not None else "anchor")
        plan = _usage(args, recipe_mod.Recipe,
                      models=tuple(model_paths), method=method.name, params=_method_params(method, args.param, args.error), base=args.base,
                      align=align, align_options=_options(args) if align != "none" else {}, task_head=task_head, dtype=args.dtype, seed=0 if args.seed is None else args.seed,
                      weights=args.weights)
    args.out = out
    steps = len(plan.models) + (plan.base is not None) + 3 + (plan.data is not None)
    progress = _Progress(args, steps, f"{plan.method} merge")
    try:
        with _writing(args, out, progress, [*plan.models, plan.base]):
            outcome = _usage(args, merge_checkpoints, plan, out, **_run_options(args, progress))
    finally:
        progress.close()
    return _finish(args, outcome, start)


def _refuse_flags(args, flags, why: str) -> None:
    """A usage error naming the flags of (flag, value) given (not None) where a config says it itself."""
    given = [flag for flag, value in flags if value is not None]
    if given:
        args.error(f"{', '.join(given)}: {why}")


def _merge_mergekit(args, start: float) -> int:
    """A mergekit config, run as it is; --align (and the align flags) over its rotsym: block."""
    _refuse_flags(args, (("--last", args.last), ("--weights", args.weights), ("--step", args.step), ("--task-head", args.task_head),
                         ("--base", args.base), ("--dtype", args.dtype), ("--format", None if args.format == "hf" else args.format),
                         ("--param", args.param or None)), "a mergekit config names its models, parameters and dtypes itself")
    try:
        config = mergekit_mod.load(args.paths[0])
    except recipe_mod.RecipeError as e:
        args.error(str(e))
    if args.seed is not None:  # the draws of dare_* and della*, over the rotsym: block's seed
        config = dataclasses.replace(config, seed=args.seed)
    args.out = out = args.paths[1]
    # the flags given, over the rotsym: block's options (a flag left at its default does not reset the block's)
    options = _given_align_flags(args)
    progress = _Progress(args, len(config.inputs) + 3, f"mergekit {config.method.name} merge")
    try:
        with _writing(args, out, progress, [inp.path for inp in config.inputs]):
            outcome = _usage(args, merge_mergekit, config, out, align=args.align, align_options=options, **_run_options(args, progress))
    finally:
        progress.close()
    return _finish(args, outcome, start)


def _convert_config(args) -> int:
    """A recipe as a mergekit config, or a mergekit config as a recipe (refused where they differ)."""
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        args.error(f"OUT {out} exists; pass --overwrite to replace it")
    try:
        if mergekit_mod.is_mergekit(args.source):
            text = recipe_mod.to_yaml(mergekit_mod.to_recipe(mergekit_mod.load(args.source)), out.parent)
        else:
            plan = recipe_mod.load(args.source)
            anchor = load_checkpoint(plan.models[0], "model 0", weights=False, prove=verify.infer_record)
            family = hf_mod.family_of(anchor.model_config)
            heads = [r.hf for r in family.tensors(anchor.model_config, anchor.layout) if any(is_head(p) for p in r.ours)]
            text = yaml.safe_dump(mergekit_mod.to_mergekit(plan, heads), sort_keys=False)
    except (recipe_mod.RecipeError, InputError, PipelineError) as e:
        args.error(str(e))
    write_text_atomic(out, text)
    print(f"wrote {out}")
    return 0


def _last_steps(args, paths: list[str]) -> list[str]:
    """--last K: the one input, an Orbax run, as its last K step folders (oldest first)."""
    if len(paths) != 1:
        args.error(f"--last {args.last} merges the last steps of one Orbax training run: give RUN OUT (got {len(paths)} inputs)")
    if args.step is not None:
        args.error("--last and --step: pick the steps one way")
    found = orbax_mod.steps(paths[0])
    if not found:
        args.error(f"--last {args.last}: {paths[0]} is not an Orbax training run (a folder of numbered step folders)")
    if args.last > len(found):
        args.error(f"--last {args.last}: {paths[0]} has {len(found)} steps ({', '.join(map(str, found[-8:]))})")
    return [str(Path(paths[0]) / str(step)) for step in found[-args.last:]]


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
    args.a, args.b = _at_step(args, [args.a, args.b])
    a, b = (_usage(args, load_checkpoint, path, what, weights=False, prove=verify.infer_record) for path, what in ((args.a, "A"), (args.b, "B")))
    _usage(args, same_architecture, a, b, "B", "A")
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
    data = _data(args, args.label_field)
    if not data.file.is_file():
        args.error(f"--data {data.file}: no such file")
    out = Path(args.out)
    _check_writable_folder(args, out, "--out")
    earlier = [name for name in BARRIER_FILES if (out / name).exists()]
    if earlier and not args.overwrite:
        args.error(f"--out {out} holds {' and '.join(earlier)} (an earlier run?); pass --overwrite to replace them")
    batches = _usage(args, recipe_mod.batches, data, a)
    loss = _usage(args, recipe_mod.loss_fn, a, batches)  # the graph of A's config: its weights come as the loss's argument
    options = _options(args)
    methods = args.align_methods if args.align == "anchor" else ()
    align_batches = _barrier_align_data(args, a, data, methods)
    a, b = _usage(args, load_checkpoint, args.a, "A", prove=verify.infer_record), _usage(args, load_checkpoint, args.b, "B", prove=verify.infer_record)
    alphas = np.linspace(0.0, 1.0, args.points)
    results = {"plain": _usage(args, barrier_mod.loss_barrier, loss, a.params, b.params, alphas)}
    start_a, start_b = _usage(args, folded, [a.params, b.params], b, options)  # the same functions (MATH §10)
    chosen = {}  # where another result than the method's own was kept (the identity, weight matching), said and recorded
    moved = {}  # what each alignment's transforms moved (`moved`), recorded and printed as align prints it
    for method in methods:
        aligned = _usage(args, align_pair, start_a, start_b, b, AlignOptions.of(_options(args, method)),
                         None if method == "weights" else align_batches, args.align_seed, _Notes())
        name = "aligned" if method == "weights" else f"aligned ({method})"
        results[name] = _usage(args, barrier_mod.loss_barrier, loss, start_a, aligned.params, alphas)
        if aligned.report.get("chosen", {}).get("note"):
            chosen[name] = aligned.report["chosen"]
        if "moved" in aligned.report:
            moved[name] = aligned.report["moved"]
    extra = {"methods": list(methods), **({"align_data": args.align_data} if align_batches else {})}
    report = report_of(_command(args), {"a": a, "b": b}, {"align": args.align, **options, **extra, "points": args.points, "data": str(data.file)},
                     {name: {"barrier": r["barrier"], "alpha_max": r["alpha_max"], "curve": {k: np.asarray(v).tolist() for k, v in r["curve"].items()},
                             **({"chosen": chosen[name]} if name in chosen else {}), **({"moved": moved[name]} if name in moved else {})}
                      for name, r in results.items()}, start)
    write_text_atomic(out / "barrier.json", json.dumps(report, indent=2))
    name_a, name_b = Path(args.a).name, Path(args.b).name
    rj.plots.curves(results, path=out / "barrier.png", title=f"{name_a} → {name_b}", xlabel=f"α  (0: {name_a}, 1: {name_b})")
    for name, r in results.items():
        print(f"{name:<8} barrier {r['barrier']:.4f} at alpha {r['alpha_max']:.2f}")
    _print_moved([(f"B, {name}", summary) for name, summary in moved.items()])
    print(f"wrote {out / 'barrier.json'} and {out / 'barrier.png'} ({time.perf_counter() - start:.1f} s)")
    return 0


BARRIER_FILES = ("barrier.json", "barrier.png")


def _barrier_align_data(args, anchor, data, methods) -> list | None:
    """The batches the data methods align on (--align-data), checked before any weight is read;
    never the data the loss is measured on (a barrier on the transforms' own data flatters them)."""
    data_methods = [m for m in methods if m != "weights"]
    if not data_methods:
        if args.align_data is not None:
            args.error("--align-data is the data of the data methods (--method activations or learned); --method weights reads only weights")
        return None
    if args.align_data is None:
        args.error(f"--method {','.join(data_methods)} aligns on data: give --align-data FILE (other data than --data, which the loss is measured on)")
    align_data = recipe_mod.Data(Path(args.align_data), args.text_field, args.label_field, args.batch_size, args.count, args.max_length)
    if not align_data.file.is_file():
        args.error(f"--align-data {align_data.file}: no such file")
    if align_data.file.resolve() == data.file.resolve():
        args.error("--align-data is the --data the loss is measured on: measure a barrier on data the alignment did not see")
    batches = _usage(args, recipe_mod.batches, align_data, anchor)
    for method in data_methods:
        _usage(args, check_alignment_data, batches, anchor, AlignOptions.of(_options(args, method)), align_data.file)
    return batches


def _check_writable_folder(args, folder: Path, what: str) -> None:
    """A folder the command may write into (created if missing), checked before any work."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if existing == folder and not folder.is_dir():
        args.error(f"{what} {folder}: exists and is not a folder")
    if existing != folder and not existing.is_dir():
        args.error(f"{what} {folder}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        args.error(f"{what} {folder}: {existing} is not writable")


# ---- extract-lora ------------------------------------------------------------------------------------

def _extract_lora(args) -> int:
    """mergekit-extract-lora's adapter of TUNED against BASE (`merging.lora`), TUNED aligned to BASE first with --align."""
    options = _options(args)
    if not args.align and _given_align_flags(args):
        args.error(f"{_flag_names(_given_align_flags(args))}: alignment options need --align")
    # a rotation of these keeps the function only with norm gains folded, and the adapter is taken against BASE as stored
    folding = [DECLARED[name].flag for name in ("residual", "latents") if options.get(name) == "rotation"]
    if folding:
        args.error(f"{' rotation, '.join(folding)} rotation: a rotation keeps the function only once the norm gains are folded into "
                   "the layers reading them, and the adapter is extracted against BASE as stored, whose gains are not folded; use "
                   f"{' permutation and '.join(folding)} permutation")
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        args.error(f"OUT {out} exists; pass --overwrite to replace it")
    args.base, args.tuned = _at_step(args, [args.base, args.tuned])
    base = _usage(args, load_checkpoint, args.base, "BASE", prove=verify.infer_record)
    tuned = _usage(args, load_checkpoint, args.tuned, "TUNED", prove=verify.infer_record)
    _usage(args, same_architecture, base, tuned, "TUNED", "BASE")
    params = tuned.params
    if args.align:  # B moved onto A keeps B's function: the adapter then carries only what the symmetries cannot remove
        params = _usage(args, rj.align, base.params, params, aligning_spec(tuned), **options).params
    settings = _usage(args, lora_mod.LoraOptions, rank=args.rank, sv_epsilon=args.sv_epsilon, distribute_scale=args.distribute_scale,
                      embed_lora=args.embed_lora, save_modules=tuple(args.save_modules), include=tuple(args.include),
                      exclude=tuple(args.exclude), skip_undecomposable=args.skip_undecomposable)
    extracted = _usage(args, lora_mod.extract_lora, base.params, params, base, settings)
    _usage(args, lora_mod.save_lora, extracted, out, base_model=str(args.base), task_type=lora_mod.task_type(base), overwrite=args.overwrite)
    if not args.quiet:
        ranks = extracted.ranks
        error = lora_mod.relative_error(extracted, base.params, params, base)
        print(f"wrote {out}: {len(ranks)} modules factored (rank {min(ranks.values(), default=0)} to {max(ranks.values(), default=0)}), "
              f"{len(extracted.saved)} tensors kept whole ({', '.join(extracted.modules_to_save) or 'none'}); relative error of the "
              f"factored deltas {error:.4f}")
    return 0


# ---- moe ----------------------------------------------------------------------------------------------

def _moe(args) -> int:
    """mergekit-moe's Mixtral from a config (`merging.moe`, `moe_pipeline`); --align and its flags over the config's rotsym: block."""
    cfg = _usage(args, moe_mod.load, args.config, allow_all_same=args.allow_all_same)
    align = cfg.align if args.align is None else args.align
    given = _given_align_flags(args)
    if given and not align:
        args.error(f"{_flag_names(given)}: alignment options need alignment (--align, or rotsym.align: true in the config)")
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        args.error(f"OUT {out} exists; pass --overwrite to replace it")
    path, report = _usage(args, moe_to_disk, cfg, out, align=align, align_options={**cfg.align_options, **given} if align else None, seed=args.seed,
                          overwrite=args.overwrite, max_memory=args.max_memory, command=_command(args))
    if not args.quiet:
        result = report["result"]
        degenerate = result["degenerate_layers"]
        print(f"wrote {path}: {len(result['experts'])} experts, gate_mode {result['gate_mode']}, shared tensors from "
              f"{'the base' if result['shared'] == 'base' else 'the models averaged'}{', experts aligned onto the base' if align else ''}"
              + (f"; layers {degenerate} have nearly dependent gates (condition number over 5): some experts may be underused"
                 if degenerate else ""))
    return 0


# ---- inspect ----------------------------------------------------------------------------------------

def _inspect(args) -> int:
    options = _options(args)  # checked before anything is printed
    args.a, args.b = _at_step(args, [args.a, args.b])
    a = _usage(args, load_checkpoint, args.a, "A", prove=verify.infer_record)
    bound = bind(spec_for(a), a.params)
    flat = flatten(a.params)
    count = sum(int(np.size(x)) for x in flat.values())
    dtypes = sorted({str(np.dtype(d)) for d in a.stored_dtypes.values()}) if a.stored_dtypes else [str(a.dtype)]
    runs = " (run here)" if a.runs_head else " (read, aligned, merged and saved; not run here)"
    record = a.model_config.record
    family = f"{a.family} ({a.model_config.model_type})" if record is None else f"{record.model_type}, read as {record.read_as}"
    head = "no task head" if a.layout.head is None else f"head {a.layout.head}{runs}"
    print(f"{a.source}: {family}, {head}, {count:,} parameters, stored as {'/'.join(dtypes)}")
    if record is not None:
        print(f"model_type {record.model_type!r} has no record of its own: its tensors are {record.read_as}'s, and every group of that "
              f"record held in transformers' {record.stem} model ({len(record.proven)} element kinds, largest change "
              f"{max(record.proven.values(), default=0):.1e}); weights move with it, our forward pass does not run it. The inferred record:")
        print(f"  {json.dumps(record.to_json())}")
    print(f"{len(flat)} leaves; symmetry groups of the built-in spec:")
    for group in bound.groups:
        print(f"  {group.describe()}")
    for why in hf_mod.family_of(a.model_config).left_out(a.model_config):
        print(f"  {why}")
    print(f"  untouched: {len(bound.ignored)} leaves ({untouched_kinds(bound.ignored) or 'none'})")
    print(f"solved with these options: {solved_with(options, bound.attention, bound.perms + bound.experts, bound.streams)}")
    if args.b is not None:
        b = _usage(args, load_checkpoint, args.b, "B", prove=verify.infer_record)
        _usage(args, same_architecture, a, b, "B", "A")
        # the gains a rotation needs folded are folded first, as `rotsym align` folds them (same functions)
        result = _usage(args, rj.align, *folded([a.params, b.params], b, options), aligning_spec(b), **options)
        _print_distances(result.report, per_layer=True)
        _print_moved([("B", result.report["moved"])])
    if args.verify:
        return _verify(args, record)
    return 0


def untouched_kinds(paths) -> str:
    """What the leaves no group moves are, in words, in the order a model holds them."""
    def kind(path: str) -> str:
        if is_head(path):
            return "task head"
        if path.startswith("embeddings/"):
            return "embeddings"
        if "norm" in path:
            return "norms"
        if path.startswith(("pooler/", "lm_head/")):
            return path.split("/")[0].replace("_", " ").replace("lm", "LM")
        return "output biases" if path.endswith("/bias") else "others"
    return ", ".join(dict.fromkeys(sorted((kind(p) for p in paths), key=_UNTOUCHED.index)))


_UNTOUCHED = ["embeddings", "norms", "output biases", "others", "pooler", "LM head", "task head"]


def _verify(args, record) -> int:
    """Each element kind of A's groups applied at random and run in transformers (`verify`)."""
    if orbax_mod.is_orbax(args.a):
        args.error("--verify runs A in transformers: give a Hugging Face folder (rotsym align/merge --format hf, or rj.save_hf, writes one)")
    try:
        checks = verify_groups(args.a, record=record)
    except RuntimeError as e:
        args.error(str(e))
    print("\nverified in transformers (a random element of each kind applied to A's weights; outputs against A's):")
    width = max([29] + [len(c.element) + 1 for c in checks])  # a title naming a model's own groups (Mamba's) may be longer
    for c in checks:
        result = "n/a" if c.difference is None else f"{c.difference:9.2e}  {'ok' if c.ok else 'CHANGES THE OUTPUTS'}"
        print(f"  {c.element:<{width}}{c.group:<46}{result}{'  (' + c.note + ')' if c.note else ''}")
    failed = [c.element for c in checks if not c.ok]
    if failed:
        print(f"not a symmetry of this model: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# ---- output ----------------------------------------------------------------------------------------

def _print_distances(report: dict, per_layer: bool = False) -> None:
    rows = distance_rows(report)
    if per_layer:
        rows += [(f"layer {layer} {label}", d[label]) for layer, d in report["layers"].items() for label in ("before", "after")]
    _print_table(rows)


def _print_moved(models: list[tuple[str, dict | None]]) -> None:
    """Each aligned model's `moved` section (what its transforms moved, per group), where the report has one."""
    shown = [(name, summary) for name, summary in models if summary]
    for name, summary in shown:
        print(f"moved, {name}:")
        print("\n".join(moved_lines(summary)))
    if shown:
        print(MOVED_LEGEND)


# Why align_many stopped (its report's "stop"), as the command line says it.
STOPS = {"rejected": "stopped: a sweep moved no model closer to the mean", "converged": "converged", "max_iters": "stopped at the sweep limit",
         "zero_objective": "the models coincide (up to rounding)", "single_pass": "one pass"}


def _print_table(rows: list[tuple[str, dict]]) -> None:
    """Distances per kind, one row per (label, {kind: distance}); the first column holds the widest
    label, so every number sits under its heading (a kind a row lacks is left blank); no rows, no table."""
    if not rows:
        return
    kinds = kinds_shown(rows)
    width = max([12] + [len(label) + 1 for label, _ in rows])
    # a column as wide as its longest number, one space apart (a broken merge's 186886.1175 too)
    column = max([10] + [len(f"{d[k]:.4f}") + 1 for _, d in rows for k in kinds if k in d] + [len(k) + 1 for k in kinds])  # (decoder_ffn)
    print(f"{'distance':<{width}}" + "".join(f"{k:>{column}}" for k in kinds))
    for label, d in rows:
        print(f"{label:<{width}}" + "".join(f"{d[k]:>{column}.4f}" if k in d else " " * column for k in kinds))
    print(distance_legend(kinds))


