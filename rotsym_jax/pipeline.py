"""The checkpoint pipelines, in the library: `align_checkpoints` and `merge_checkpoints` take
Hugging Face folders (or Hub ids) or Orbax checkpoints (`io.orbax`: a checkpoint, a run's latest
step, a step folder) and write a folder (Hugging Face, or Orbax with `format="orbax"`) with the
weights, a report, a model card and the recipe, atomically: load → fold → align → statistics → merge → save, in memory or streamed a
chunk of layers at a time (`streaming`), whichever the memory allows. The `rotsym` command line
only parses its arguments into these calls and prints what they return.

Every refusal comes before any weight is read (configs and safetensors headers first), as a
`PipelineError` naming the problem. A dry run checks as much and returns the plan.
"""

from __future__ import annotations

import dataclasses
import errno
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import yaml

import rotsym_jax as rj

from . import verify
from .checks import (
    CONFIG_KEYS_OF_NO_ARCHITECTURE,
    TASK_HEAD_LEAVES,
    architecture_mismatch,
    config_differences,
    heads_mismatch,
    mergeable,
    with_config_differences,
)
from .engine.activations import required_tokens
from .engine.distances import distance_report
from .engine.learned import objective_for
from .engine.residual import rotation_refusal, signed_refusal
from .errors import RotsymError
from .families.family import InferredRecord
from .io import recipe as recipe_mod
from .io.card import CARD_FILES, distance_rows, files_of, model_card, report_of
from .io.hf import (
    Checkpoint,
    CheckpointError,
    NonFiniteWeights,
    check_output,
    held_dtype,
    save_hf,
    spec_for,
)
from .io.loading import PipelineError, Progress, load_checkpoint, note_unused_records, proven, unusable
from .io.memory import checkpoint_bytes as nbytes
from .io.memory import cost_bytes, in_memory_bytes
from .io.orbax import save_orbax
from .io.reconcile import notes as change_notes
from .io.reconcile import reconciled
from .merging import methods as merge_methods
from .options import DTYPES, FORMATS, OPTIMIZERS, AlignOptions, ManyOptions, recorded
from .pytree import flatten
from .spec import MIXTURE, bind
from .timings import Clock


@dataclasses.dataclass(frozen=True)
class DryRun:
    """A dry run's plan: what would be done (`lines`), the peak memory `estimate` in bytes and how
    it was counted (`formula`). Nothing was read but configs and headers, nothing written."""

    lines: list[str]
    estimate: int
    formula: str


@dataclasses.dataclass(frozen=True)
class Written:
    """A pipeline's output: the folder `path`, its `report` (rotsym_report.json), the distance
    rows of its tables, and the layers per chunk of a streamed run (None in memory)."""

    path: Path
    report: dict
    rows: list
    chunk_layers: int | None = None


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a pipeline call runs and writes, checked on construction. overwrite: replace an existing
    `out` (`overwrite_option`: how the caller names it in messages, the command line
    "--overwrite"); max_memory: the bytes a streamed run's peak must fit (None: in memory, or
    streamed when the in-memory estimate exceeds the memory available); dry_run: check and plan,
    read no weight, write nothing; format: "hf" or "orbax" (`FORMATS`); command: what the report
    records as the command; progress: what the run tells as it goes (None: nothing); records: the
    inferred records (`infer_record`, saved as JSON) to read the model types without one of their
    own by, instead of proving one in transformers on every run."""

    overwrite: bool = False
    max_memory: int | None = None
    dry_run: bool = False
    format: str = "hf"
    command: str | None = None
    progress: Progress | None = None
    overwrite_option: str = "overwrite=True"
    records: tuple[InferredRecord, ...] = ()

    def __post_init__(self):
        _check_max_memory(self.max_memory)
        _check_format(self.format)
        object.__setattr__(self, "records", tuple(self.records))
        for r in self.records:
            if not isinstance(r, InferredRecord):
                raise PipelineError(f"records holds a {type(r).__name__}; expected InferredRecord (InferredRecord.from_json of a saved record)")
        if self.progress is None:
            object.__setattr__(self, "progress", Progress())

    @classmethod
    def of(cls, run: RunOptions | None, keywords: dict) -> RunOptions:
        """`run` (None: the defaults) with `keywords` naming its fields over it."""
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(keywords) - set(fields))
        if unknown:
            raise PipelineError(f"unknown keywords {unknown}; the run options are {fields}")
        if run is not None and not isinstance(run, cls):
            raise PipelineError(f"run is a {type(run).__name__}; expected a rotsym_jax.pipeline.RunOptions")
        return dataclasses.replace(run, **keywords) if run is not None else cls(**keywords)


def _check_max_memory(max_memory) -> None:
    if max_memory is not None and (isinstance(max_memory, bool) or not isinstance(max_memory, (int, np.integer)) or max_memory < 1):
        raise PipelineError(f"max_memory={max_memory!r}; expected None or a number of bytes (an integer, e.g. 3 * 2**30)")


def align_options_of(options) -> AlignOptions:
    try:
        options = checked(AlignOptions.of, options)
    except TypeError as e:  # unknown keys
        raise PipelineError(str(e)) from None
    if not isinstance(options.optimizer, str):
        raise PipelineError(f"optimizer={options.optimizer!r}: a pipeline writes its options into the report and recipe, which "
                            f"cannot hold an optax object; name one of {OPTIMIZERS} (with learning_rate), or call rj.align in Python")
    return options


def settled_for(options: AlignOptions, checkpoint: Checkpoint) -> AlignOptions:
    """`options` with each "auto" resolved as the pipelines run them (`AlignOptions.settled`): the
    data methods' residual is the strongest group `checkpoint`'s family allows, since the
    pipelines fold the norm gains and untie a tied head for a rotation (`folded`, `reconciled`)."""
    if options.residual == "auto" and options.method != "weights":
        options = options.settled(verify.strongest_as_run(checkpoint)[0])
    return options.settled()


# ---- align ------------------------------------------------------------------------------------------

def align_checkpoints(a, b, out, options: AlignOptions | dict | None = None, *, data: recipe_mod.Data | None = None, seed: int = 0,
                      dtype: str | None = None, run: RunOptions | None = None, **keywords) -> DryRun | Written:
    """B (a folder or Hub id) moved as close as possible to A, written to `out` with B's dtypes
    (or `dtype`, one of `options.DTYPES`, as `rotsym merge --dtype`: the moved weights computed in
    float32 where B is stored narrower, then rounded once) and tokenizer, its report, model card
    and recipe. Streamed (`max_memory` bytes, or
    automatically when the in-memory estimate exceeds the memory available) or in memory.
    `data`: what options.method="activations" or "learned" runs both models on (a `recipe.Data`:
    texts tokenized with A's tokenizer, or an .npz), checked against the model before any weight
    is read; `seed`: the key of method="learned". `run`: how the call runs and writes
    (`RunOptions`; `keywords`: its fields, `overwrite=True`, `max_memory=...`, `dry_run=True`).
    Orbax inputs stream as Hugging Face folders do; an Orbax output is written whole."""
    start = time.perf_counter()
    run = RunOptions.of(run, keywords)
    progress, overwrite, format = run.progress, run.overwrite, run.format
    options = align_options_of(options)
    if dtype is not None and dtype not in DTYPES:
        raise PipelineError(f"dtype={dtype!r}: expected None (B's stored dtypes) or one of {DTYPES}")
    command = run.command or f"rotsym_jax.pipeline.align_checkpoints({str(a)!r}, {str(b)!r}, {str(out)!r})"
    # Configs and headers first: every refusal comes before any weight is read.
    ck_a = load_checkpoint(a, "A", weights=False, prove=verify.infer_record, progress=progress, records=run.records)
    ck_b = load_checkpoint(b, "B", weights=False, prove=verify.infer_record, progress=progress, records=proven(run.records, [ck_a]))
    note_unused_records(progress, run.records, [ck_a, ck_b])
    options = settled_for(options, ck_b)
    shown = recorded(options)
    check_rotation(ck_b, shown)
    (ck_a, ck_b), changes = reconciled([ck_a, ck_b], shown["residual"])
    same_architecture(ck_a, ck_b, "B", "A")
    _note_config_differences(progress, [("A", ck_a), ("B", ck_b)], "B")
    check_out(out, [ck_a, ck_b], nbytes(ck_b, dtype), run)
    held = held_dtype(dtype, [ck_a, ck_b])
    batches = _data_batches(options, data, ck_a, run.max_memory, "--data FILE" if run.overwrite_option.startswith("--") else "data=")
    _note_headless_residual(progress, shown, [("B", ck_b)])
    _note_folded_frame(progress, shown)
    _note_unscaled_ffn(progress, shown, ck_b)
    estimate = in_memory_bytes([nbytes(ck_a, held), nbytes(ck_b, held)], moved=[nbytes(ck_b, held)], cost_bytes=checked(cost_bytes, ck_b))
    reported = {**shown, **({"dtype": dtype} if dtype is not None else {})}  # the report's options: the run's, its output dtype too
    what = [f"align {b} ({ck_b.family}) to {a}, options {shown}, write {out}" + (f" in {dtype}" if dtype else ""),
            *(f"  {note}" for note in change_notes(changes))]
    max_memory = _streaming_budget(run.max_memory, estimate, shown, progress,
                                   unstreamable=_unstreamable(format))
    # what the run computes, whichever way it runs (how it streams is the report's "streaming")
    recipe = {"command": "align", "a": str(a), "b": str(b), "options": shown, **({"format": format} if format != "hf" else {}),
              **({"dtype": dtype} if dtype is not None else {}),
              **({"data": {**dataclasses.asdict(data), "file": str(data.file)}} if batches else {}),
              **({"seed": seed} if options.method == "learned" else {})}
    if max_memory is not None:
        if run.dry_run:
            plan = _stream_call(rj.streaming.plan_align, ck_a, ck_b, max_memory=max_memory, data=batches, dtype=dtype, **shown)
            return DryRun([*what, plan.describe()], plan.peak_bytes, f"streaming, {_layers(plan.chunk_layers)} at a time")

        _note_changes(progress, changes)
        report = {}

        def files(result):
            report.update(report_of(command, {"a": ck_a, "b": ck_b}, reported, {**result, **changes}, start))
            return files_of(_align_card(out, a, b, recipe, report), recipe, report)

        with progress.chunks("align (streaming)") as update:
            result = _stream_call(rj.streaming.align_to_disk, ck_a, ck_b, out, **shown, data=batches, max_memory=max_memory, dtype=dtype,
                                  overwrite=overwrite, extra_files=files, progress=update)
        if result.report.get("chosen", {}).get("note"):
            progress.note(result.report["chosen"]["note"])
        return Written(result.path, report, distance_rows(result.report), result.plan.chunk_layers)
    if run.dry_run:
        return DryRun(what + ([f"  data: {data.file} ({len(batches)} batches)"] if batches else []), estimate,
                      "the runtime + A + B + B moved + the FFN cost matrices")
    clock = Clock()
    ck_a = progress.step("loading A", clock.timed, "read", load_checkpoint, a, "A", prove=verify.infer_record, record=ck_a.model_config.record,
                         changes=changes, dtype=held)
    ck_b = progress.step("loading B", clock.timed, "read", load_checkpoint, b, "B", prove=verify.infer_record, record=ck_b.model_config.record,
                         changes=changes, dtype=held)
    _note_changes(progress, changes)
    params_a, params_b = folded([ck_a.params, ck_b.params], ck_b, shown)
    # Task heads may differ (other label sets, or none): align leaves them out and B keeps its own.
    result = progress.step("aligning B to A", align_pair, params_a, params_b, ck_b, options, batches, seed, progress)
    _add_timings(clock, [result.report["timings"]])
    report = {}

    def files():  # called once the weights are written: the report times them
        report.update(report_of(command, {"a": ck_a, "b": ck_b}, reported, {**result.report, **changes, "timings": clock.report(start)},
                                start))
        return files_of(_align_card(out, a, b, recipe, report), recipe, report)

    path = progress.step("saving", _save, ck_b, result.params, out, run, dtype, files, clock)
    return Written(path, report, distance_rows(result.report))


def align_pair(params_a, params_b, checkpoint: Checkpoint, options: AlignOptions, batches, seed: int, progress: Progress):
    """`align(A, B)` with the pipelines' spec (task heads set aside); the data methods run on
    `batches` with `checkpoint`, learning shows its steps. Where another result than the method's
    own was kept (the identity, another start: the report's "chosen"), one line says which and why."""
    kwargs = options.as_dict()
    if batches is None:
        result = checked(rj.align, params_a, params_b, aligning_spec(checkpoint), **kwargs)
    elif options.method != "learned":
        result = checked(rj.align, params_a, params_b, aligning_spec(checkpoint), **kwargs, data=batches, checkpoint=checkpoint,
                         key=jax.random.key(seed))
    else:
        with progress.detail("learning", options.steps, "step") as tick:
            result = checked(rj.align, params_a, params_b, aligning_spec(checkpoint), **kwargs, data=batches, checkpoint=checkpoint,
                             key=jax.random.key(seed), progress=tick)
    if result.report.get("chosen", {}).get("note"):
        progress.note(result.report["chosen"]["note"])
    return result


def _align_card(out, a, b, recipe: dict, report: dict) -> str:
    return model_card(Path(out).name, base=str(b), tags=["rotsym_jax", "aligned"], recipe=recipe, report=report,
                      summary=f"{b} moved by rotsym_jax, without changing its function, as close as possible to {a}.")


# ---- merge ------------------------------------------------------------------------------------------

# How a recipe or the command line gives a merge's inputs (`Method.bind`'s messages).
MERGE_INPUTS_GIVEN = {"base": "--base, or base: in the recipe", "weights": "--weights, or weights: in the recipe",
                      "fishers": "give a recipe with a data section: rotsym merge CONFIG.yaml OUT",
                      "grams": "give a recipe with a data section: rotsym merge CONFIG.yaml OUT"}


def merge_checkpoints(plan: recipe_mod.Recipe, out, *, run: RunOptions | None = None, **keywords) -> DryRun | Written:
    """The merge a recipe describes (`recipe.Recipe`: the models, the first the anchor, the
    method and its parameters, the base, the alignment, the data of statistics merges), written
    to `out` with the anchor's layout and tokenizer, its report, model card and recipe. Streamed
    (`max_memory` bytes, or automatically when the in-memory estimate exceeds the memory
    available and the method streams) or in memory. `run`, `keywords`: as `align_checkpoints`'.
    `plan.weights` weigh the models of the methods that take weights (average, fisher, ot_fusion)."""
    start = time.perf_counter()
    run = RunOptions.of(run, keywords)
    if not isinstance(plan, recipe_mod.Recipe):
        raise PipelineError(f"plan is a {type(plan).__name__}; expected a rotsym_jax.recipe.Recipe (recipe.load reads one from YAML)")
    job, estimate = _checked_merge(plan, out, run, start)
    max_memory = _streaming_budget(run.max_memory, estimate, job.options, run.progress, method=job.method.name, align=plan.align,
                                   unstreamable=_unstreamable(run.format))
    if max_memory is not None:
        return _merge_streaming(job, max_memory)
    if run.dry_run:
        held = " + ".join(["the runtime", "the models", *(["the base"] if job.base is not None else []),
                           *(["the aligned copies and cost matrices"] if plan.align != "none" else []), "the merge in float32"])
        return DryRun(job.what, estimate, held)
    return _merge_in_memory(job)


@dataclasses.dataclass(frozen=True)
class _Merge:
    """A merge checked from its configs and headers (`_checked_merge`): what it runs, in memory
    or streamed, and what it records."""

    plan: recipe_mod.Recipe
    out: object
    run: RunOptions
    start: float
    command: str
    method: merge_methods.Method
    params: dict  # the method's, as `Method.bind` checked them
    options: dict  # the align options recorded
    models: list  # Checkpoints, configs and headers only
    base: Checkpoint | None
    batches: list | None
    what: list  # what a dry run prints
    recipe_text: str
    recorded: dict
    changes: dict  # what made the models one architecture (`io.reconcile`)
    held: object = None  # the dtype the weights are held in (`hf.held_dtype`; None: as stored)

    def files(self, report: dict, result: dict) -> dict:
        """The report (updated with `result`), model card and recipe written beside the weights."""
        report.update(report_of(self.command, _merge_inputs(self.models, self.base), self.recorded, {**result, **self.changes},
                                self.start))
        return files_of(_merge_card(self.out, self.plan, self.method, self.recipe_text, report), self.recipe_text, report)


def _checked_merge(plan: recipe_mod.Recipe, out, run: RunOptions, start: float) -> tuple[_Merge, int]:
    """Every refusal of a merge, from configs and headers alone; the merge and its in-memory estimate."""
    progress = run.progress
    command = run.command or f"rotsym_jax.pipeline.merge_checkpoints({plan.method!r} of {list(plan.models)!r}, {str(out)!r})"
    method = merge_method(plan.method)
    # the inputs the recipe gives and those the pipeline makes from it
    made = {"key", "spec"} | ({"checkpoint", "batches", method.statistics} if plan.data is not None else set())
    given = {k for k, v in (("base", plan.base), ("weights", plan.weights)) if v is not None} | (made & method.needs)
    params = checked(method.bind, len(plan.models), plan.params, given, MERGE_INPUTS_GIVEN)
    models, prove = [], verify.infer_record if plan.align != "none" else None  # a merge that moves no weight proves no record
    for i, p in enumerate(plan.models):
        models.append(load_checkpoint(p, f"model {i}", weights=False, progress=progress, records=proven(run.records, models),
                                      prove=prove, merging=True))
    base = None if plan.base is None else load_checkpoint(plan.base, "base", weights=False, progress=progress,
                                                         records=proven(run.records, models), prove=prove, merging=True)
    note_unused_records(progress, run.records, [*models, *([base] if base is not None else [])])
    options = recorded(settled_for(align_options_of(plan.align_options), models[0]))
    if plan.align != "none":
        check_rotation(models[0], options)
    inputs, changes = reconciled(models + [base], options["residual"] if plan.align != "none" else "none")
    models, base = inputs[:-1], inputs[-1]
    for i, ck in enumerate(models[1:], 1):
        same_architecture(models[0], ck, f"model {i}")
    if base is not None:
        same_architecture(models[0], base, "base")
    checked(mergeable, [(f"model {i}", ck.params) for i, ck in enumerate(models)], plan.task_head)  # heads too, from the headers
    _note_config_differences(progress, [(f"model {i}", ck) for i, ck in enumerate(models)] + ([("base", base)] if base is not None else []), "model 0")
    if plan.align != "none":
        _note_headless_residual(progress, options, [(f"model {i}", ck) for i, ck in enumerate(models)])
        _note_folded_frame(progress, options)
        _note_unscaled_ffn(progress, options, models[0])
    check_out(out, models + ([base] if base is not None else []), nbytes(models[0], plan.dtype), run)
    if plan.align != "none" and base is not None and str(plan.base) != str(plan.models[0]):  # the anchor is model 0; the base is not moved
        progress.note(f"note: the base ({plan.base}) is not aligned, only the models are (to model 0): task vectors are taken "
                      "from it as stored, which suits fine-tunes of it; a base in another frame than model 0's goes first, as the anchor")
    if "fishers" in method.needs:  # the Fisher needs every model's logits
        for i, ck in enumerate(models):
            try:
                ck.require_head("Fisher merging")
            except CheckpointError as e:
                raise PipelineError(f"model {i}: {e}") from None
    # the data tokenized with the anchor's tokenizer (its folder and config: no weights needed)
    batches = None if plan.data is None else checked(recipe_mod.batches, plan.data, models[0])
    if plan.align != "none" and options["method"] != "weights":
        _check_data_alignment(plan, batches, models[0], options, run.max_memory)
    held = held_dtype(plan.dtype, models + ([base] if base is not None else []))
    sizes = [nbytes(ck, held) for ck in models]
    aligned = plan.align != "none"
    estimate = in_memory_bytes(sizes + ([nbytes(base, held)] if base is not None else []), moved=sizes[1:] if aligned else [],
                               cost_bytes=checked(cost_bytes, models[0]) if aligned else 0, merged_bytes=nbytes(models[0], np.float32))
    shown = {**{name: p.default for name, p in method.params.items()}, **params}  # what runs, the defaults included
    what = [f"merge {len(models)} {models[0].family} models by {method.name}{f' {shown}' if shown else ''} (alignment: {plan.align}), "
            f"write {out}",
            *(f"  model {i}: {p}" for i, p in enumerate(plan.models)), *([f"  base: {plan.base}"] if plan.base else []),
            *([f"  data: {plan.data.file}"] if plan.data else []), *(f"  {note}" for note in change_notes(changes))]
    recipe_text = recipe_mod.to_yaml(dataclasses.replace(plan, params=params, align_options=options))
    recorded_options = {"method": method.name, "params": params, "align": plan.align, **({"align_options": options} if aligned else {}),
                        **({"weights": list(plan.weights)} if plan.weights is not None else {}),
                        **({"dtype": plan.dtype} if plan.dtype is not None else {})}
    return _Merge(plan, out, run, start, command, method, params, options, models, base, batches, what, recipe_text, recorded_options,
                  changes, held), estimate


def _check_data_alignment(plan: recipe_mod.Recipe, batches, anchor: Checkpoint, options: dict, max_memory) -> None:
    """A merge aligned from data (options' method "activations" or "learned") refused from the config alone."""
    if batches is None:
        raise PipelineError(f"align_options.method={options['method']!r} matches the models' activations on data: the recipe needs a data section")
    if max_memory is not None:
        _stream_call(rj.streaming.streamed_options, options, merging=plan.align)  # refused, with the reason
    check_alignment_data(batches, anchor, align_options_of(options), plan.data.file)
    if plan.align == "many" and options["method"] == "learned":
        raise PipelineError("align_options.method='learned' aligns pairs (each model to the anchor): use align: anchor")


def _merge_in_memory(job: _Merge) -> Written:
    plan, method, progress, clock = job.plan, job.method, job.run.progress, Clock()
    models = [progress.step(f"loading model {i}", clock.timed, "read", load_checkpoint, p, f"model {i}", prove=verify.infer_record,
                            record=ck.model_config.record, changes=job.changes, dtype=job.held) for i, (p, ck) in enumerate(zip(plan.models, job.models))]
    base = job.base
    if plan.base is not None:
        base = progress.step("loading base", clock.timed, "read", load_checkpoint, plan.base, "base", prove=verify.infer_record,
                             record=base.model_config.record, changes=job.changes, dtype=job.held)
    _note_changes(progress, job.changes)
    anchor = models[0]
    params_list, alignment = progress.step(f"alignment: {plan.align}", checked, aligned, models, plan.align, job.options, progress, clock,
                                           job.batches, plan.seed)
    # the base's norm gains are folded as the models' were (task vectors compare like with like)
    base_params = None if base is None or plan.align == "none" else folded([base.params], anchor, job.options)[0]
    inputs = {"base": None if base is None else _with_anchor_head(base_params if base_params is not None else base.params, anchor.params, plan.task_head)}
    inputs["key"] = jax.random.key(plan.seed) if "key" in method.needs else None
    inputs["spec"] = spec_for(anchor) if "spec" in method.needs else None
    inputs["weights"] = plan.weights
    if job.batches is not None:
        inputs.update(progress.step("statistics", clock.timed, "statistics", _statistics, method, models, params_list, job.batches, plan.seed,
                                    progress))
        if "batches" in method.optional:
            inputs["checkpoint"], inputs["batches"] = anchor, job.batches
    inputs = {k: v for k, v in inputs.items() if v is not None and (k in method.needs or k in method.optional)}
    # On the host, where save_hf takes the weights anyway: the distance needs no compilation there.
    merged = progress.step("merging", clock.timed, "merge", lambda: jax.device_get(
        checked(merge_methods.merge, method.name, params_list, task_head=plan.task_head, **inputs, **job.params)))
    # to the anchor in the frame the models were merged in (norms folded for a rotation), as a streamed run measures it
    anchor_frame = anchor.params if plan.align == "none" else folded([anchor.params], anchor, job.options)[0]
    distance = clock.timed("distances", distance_report, spec_for(anchor), jax.device_get(anchor_frame), merged)["total"]
    merge_report = {"alignment": alignment, "merged_distance_to_anchor": distance}
    report = {}
    # called once the weights are written: the report times them
    files = lambda: job.files(report, {**merge_report, "timings": clock.report(job.start)})  # noqa: E731
    path = progress.step("saving", _save, anchor, merged, job.out, job.run, plan.dtype, files, clock)
    return Written(path, report, distance_rows(merge_report, model_names(plan)))


def _merge_streaming(job: _Merge, max_memory: int) -> DryRun | Written:
    plan, method = job.plan, job.method
    from_data = plan.align != "none" and job.options.get("method", "weights") == "activations"
    if plan.data is not None and method.name not in merge_methods.STATISTICS and not from_data:
        raise PipelineError(f"method {method.name}: statistics from data are not streamed; run without --max-memory")
    merging = {"align": plan.align, "align_options": job.options if plan.align != "none" else None, "params": job.params,
               "weights": plan.weights, "seed": plan.seed, "task_head": plan.task_head, "dtype": plan.dtype}
    if job.batches is not None:  # the Fisher's kind and key as in memory
        merging["fisher_kind"], merging["fisher_key"] = _fisher_choice(job.batches, job.models[0], plan.seed)
    if job.run.dry_run:
        estimate = _stream_call(rj.streaming.plan_merge, method.name, job.models, merging, base=job.base, batches=job.batches,
                                max_memory=max_memory)
        return DryRun([*job.what, estimate.describe()], estimate.peak_bytes, f"streaming, {_layers(estimate.chunk_layers)} at a time")
    _note_changes(job.run.progress, job.changes)
    report = {}
    with job.run.progress.chunks(f"{method.name} merge (streaming)") as update:
        result = _stream_call(rj.streaming.merge_to_disk, method.name, job.models, job.out, merging, base=job.base, batches=job.batches,
                              max_memory=max_memory, overwrite=job.run.overwrite, extra_files=lambda result: job.files(report, result),
                              progress=update)
    return Written(result.path, report, distance_rows(result.report, model_names(plan)), result.plan.chunk_layers)


def merge_method(name: str):
    """The registered merge method `name` (`merge.METHODS`), else a PipelineError naming them."""
    method = merge_methods.METHODS.get(name)
    if method is None:
        raise PipelineError(f"method {name!r}: unknown; known methods: {sorted(merge_methods.METHODS)}")
    return method


def model_names(plan) -> list[str]:
    """The merged models' folder names, for the tables that list them."""
    return [Path(p).name for p in plan.models]


def _merge_inputs(models: list[Checkpoint], base: Checkpoint | None) -> dict:
    return {**{f"model {i}": ck for i, ck in enumerate(models)}, **({"base": base} if base is not None else {})}


def _merge_card(out, plan, method, recipe_text: str, report: dict) -> str:
    """The model card of a merge: its `base_model` is the base the models were fine-tuned from
    when there is one, else the models merged (Hugging Face's convention for merges)."""
    base = plan.base if plan.base is not None else list(plan.models)
    return model_card(Path(out).name, base=base, tags=["merge", "rotsym_jax"], recipe=yaml.safe_load(recipe_text), report=report,
                      names=model_names(plan), summary=f"{'An' if method.name[0] in 'aeiou' else 'A'} {method.name} merge by rotsym_jax of {', '.join(plan.models)}"
                              f"{f' (base {plan.base})' if plan.base else ''} (alignment: {plan.align}).")


def _statistics(method, models, params_list, batches, seed, progress) -> dict:
    """Fisher or Gram statistics of each model as aligned (each run by its own checkpoint)."""
    with progress.detail("statistics", len(models) * len(batches), "batch") as tick:
        if "fishers" in method.needs:
            kind, key = _fisher_choice(batches, models[0], seed)
            return {"fishers": [checked(rj.stats.fisher, ck, p, batches, kind=kind, key=key, progress=tick) for ck, p in zip(models, params_list)]}
        if "grams" in method.needs:
            return {"grams": [checked(rj.stats.grams, ck, p, batches, progress=tick) for ck, p in zip(models, params_list)]}
    return {}


def _fisher_choice(batches, anchor: Checkpoint, seed: int) -> tuple[str, jax.Array | None]:
    """The Fisher's kind and key: empirical with labels; else expected, sampled from the recipe's
    seed for an LM head (exact over the classes otherwise)."""
    labelled = "labels" in batches[0]
    key = None if labelled or anchor.layout.head != "lm" else jax.random.key(seed)
    return ("empirical" if labelled else "expected"), key


def aligned(models: list[Checkpoint], mode: str, options: dict, progress: Progress, clock: Clock, batches=None, seed: int = 0) -> tuple[list, dict]:
    """The models' params after the alignment `mode`, and the report of the alignment (its
    timings added to `clock`). Task heads may differ (other label sets, or none): align leaves
    them out and each model keeps its own. `batches`: the data of options' method="activations"."""
    params = [ck.params for ck in models]
    if mode == "none":
        return params, {"mode": "none"}
    params = folded(params, models[0], options)
    spec = aligning_spec(models[0])
    if options.get("method", "weights") != "weights":
        options = {**options, "data": batches, "checkpoint": models[0], "key": jax.random.key(seed)}
    if mode == "anchor":
        results = []
        with progress.detail("aligning to the anchor", len(params) - 1, "model") as tick:
            for i, p in enumerate(params[1:], 1):
                results.append(rj.align(params[0], p, spec, **options))
                if results[-1].report.get("chosen", {}).get("note"):
                    progress.note(f"model {i}: {results[-1].report['chosen']['note']}")
                tick()
        report = {"mode": "anchor", "distances": [{k: r.report[k] for k in ("before", "after", "layers", "chosen") if k in r.report}
                                                  for r in results]}
        _add_timings(clock, [r.report["timings"] for r in results])
        return [params[0]] + [r.params for r in results], report
    # At most max_iters sweeps (align_many's default) after the initial pass.
    passes = 1 + ManyOptions().max_iters
    with progress.detail("align_many", passes, "pass") as tick:
        many = clock.timed("solve", rj.align_many, params, spec, progress=tick, **options)
    return many.params, {"mode": "many", "objective": many.objective, "stop": many.report["stop"]}


def folded(params: list, checkpoint: Checkpoint, options: dict) -> list:
    """With residual="rotation", every model's norm gains (and LayerNorm biases) folded into the
    layers that read them (same function, a valid checkpoint of the same type): a rotation of the
    residual stream needs uniform gains (MATH.md §10)."""
    if options.get("residual") != "rotation":
        return params
    return [rj.fold_norms(spec_for(checkpoint), p) for p in params]


def _data_batches(options: AlignOptions, data, anchor: Checkpoint, max_memory, data_option: str) -> list | None:
    """The batches a data-driven alignment runs on, checked against the model from its config
    and headers alone (token ids in the vocabulary, image shapes, enough tokens), or None."""
    if options.method == "weights":
        if data is not None:
            raise PipelineError(f"{data.file}: data drives method='activations'; method='weights' reads only the weights")
        return None
    if data is None:
        raise PipelineError(f"method={options.method!r} matches the models' activations on data: give {data_option}")
    if max_memory is not None:
        _stream_call(rj.streaming.streamed_options, options)  # refused, with the reason
    batches = checked(recipe_mod.batches, data, anchor)
    check_alignment_data(batches, anchor, options, data.file)
    return batches


def _check_learning(batches: list, anchor: Checkpoint, options: AlignOptions) -> None:
    """method="learned" refused from the config alone: no task head with logits, the task
    objective without labels, too few batches for the held-out split."""
    if options.method != "learned":
        return
    try:
        objective = objective_for(anchor, batches, options.objective)
        if objective == "task":
            checked(recipe_mod.loss_fn, anchor, batches)  # labels the head can score
    except (CheckpointError, ValueError) as e:
        raise PipelineError(str(e)) from None
    held = max(1, round(options.holdout * len(batches))) if options.holdout > 0 else 0
    if held >= len(batches):
        raise PipelineError(f"method='learned' holds out {held} of {len(batches)} batches for early stopping and trains on the rest: "
                            "give more data (or a smaller --batch-size), or --holdout 0")


def check_alignment_data(batches: list, anchor: Checkpoint, options: AlignOptions, file) -> None:
    """Batches a data-driven alignment cannot use refused from the config alone: inputs the model
    cannot read, too few tokens to determine the sites."""
    tokens = 0
    for i, batch in enumerate(batches):
        tokens += checked(anchor.check_batch, batch, f"{file}: batch {i}")
    need, why = required_tokens(bind(aligning_spec(anchor), anchor.params), options)
    if tokens < need:
        raise PipelineError(f"{file}: {tokens} tokens (padding excluded); matching from activations needs at least {need}: {why}")
    _check_learning(batches, anchor, options)


def check_rotation(checkpoint: Checkpoint, options: dict) -> None:
    """residual="rotation" on a post-norm family, "signed_permutation" on a LayerNorm one, refused
    from the config alone."""
    refuse = {"rotation": rotation_refusal, "signed_permutation": signed_refusal}.get(options.get("residual"))
    refusal = refuse and refuse(spec_for(checkpoint).residual)
    if refusal:
        raise PipelineError(f"{checkpoint.family}: {refusal}")


def _with_anchor_head(base: dict, anchor: dict, task_head: str) -> dict:
    """A base model without the anchor's task head gets it (task vectors of the head are moot
    when the anchor's head is kept)."""
    if task_head == "anchor" and "head" in anchor:
        return {**base, "head": anchor["head"]}
    return base


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise PipelineError(f"format={format!r}; choose one of {FORMATS}")


def _unstreamable(format: str) -> str | None:
    """Why a run cannot stream (it writes safetensors a chunk at a time; it reads Hugging Face and
    Orbax inputs alike), or None."""
    return "--format orbax writes the params whole" if format == "orbax" else None


def same_architecture(anchor: Checkpoint, other: Checkpoint, what: str, anchor_what: str = "the anchor") -> None:
    shapes = lambda ck: {p: np.shape(x) for p, x in flatten(ck.params).items()}  # noqa: E731
    named = f"{anchor_what} ({anchor.source})", f"{what} ({other.source})"
    heads = spec_for(anchor).heads, spec_for(other).heads
    problem = (architecture_mismatch((named[0], anchor.family, shapes(anchor)), (named[1], other.family, shapes(other)), heads)
               or heads_mismatch((named[0], heads[0]), (named[1], heads[1])))
    problem = with_config_differences(problem, {anchor_what: anchor.model_config.raw, what: other.model_config.raw})
    if problem:
        raise PipelineError(problem)


def aligning_spec(checkpoint: Checkpoint):
    """The spec the pipelines align with: the family's, with every task head set aside (label
    spaces may differ even where the heads' shapes agree), as the streamed runs do."""
    return dataclasses.replace(spec_for(checkpoint), task_head=TASK_HEAD_LEAVES)


def checked(fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, its refusals (RotsymError, or any ValueError: bad options, models that
    do not fit) a PipelineError."""
    try:
        return fn(*args, **kwargs)
    except (PipelineError, RuntimeError):  # a ProcessError (another process failed) too: as it is
        raise
    except (RotsymError, ValueError) as e:
        raise PipelineError(str(e)) from None


# Config keys the shape checks and width notes cover, besides those that name, label or train a
# model: a difference in any other key (hidden_act, rope_theta, rope_scaling, norm eps...) changes
# what the tensors compute, and OUT keeps one model's.
_CONFIG_KEYS_NOTED_ELSEWHERE = CONFIG_KEYS_OF_NO_ARCHITECTURE | {
    "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "n_inner", "n_head"}


def _note_config_differences(progress: Progress, models: list, kept: str) -> None:
    """Checkpoints of one family but other model types (llama and mistral) are aligned and merged
    as the tensors they share, as are checkpoints whose configs compute otherwise (another
    activation, RoPE base or scaling): the user should know the configs differ."""
    types = {what: ck.model_config.model_type for what, ck in models}
    if len(set(types.values())) > 1:
        progress.note(f"note: the models' types differ ({', '.join(f'{w}: {t}' for w, t in types.items())}); their tensors and shapes "
                      f"agree, so they are read as {models[0][1].family} checkpoints; OUT keeps {kept}'s config")
    differ, shown = config_differences({what: ck.model_config.raw for what, ck in models}, _CONFIG_KEYS_NOTED_ELSEWHERE,
                                       skip=("model_type",))  # noted above
    if differ:
        progress.note(f"note: the models' configs differ in what their tensors compute ({shown}); OUT keeps {kept}'s config, "
                      "so it computes as that model's does")


def _layers(n: int) -> str:
    return f"{n} layer{'' if n == 1 else 's'}"


def _note_changes(progress: Progress, changes: dict) -> None:
    for note in change_notes(changes):
        progress.note(f"note: {note}")


def _note_unscaled_ffn(progress: Progress, options: dict, ck) -> None:
    """--ffn scaled on a model with no gated FFN group solves its permutations alone: said, not silent."""
    if options.get("ffn") != "scaled":
        return
    bound = bind(rj.spec_for(ck), {p: np.broadcast_to(np.zeros((), np.int8), x.shape) for p, x in flatten(ck.params).items()})  # shapes alone
    if not any(g.scaled for g in bound.perms):
        names = list(dict.fromkeys(g.names for g in bound.experts))  # what each experts block is (Mamba-2's: SSM heads)
        why = "; ".join(f"{n.block}: their {n.unit}s are never scaled" for n in names) or "no gate: a unit's scale would pass its activation"
        units = (["FFN units"] if bound.perms or MIXTURE in names else []) + [f"{n.expert}s' {n.unit}s" for n in names if n != MIXTURE]
        progress.note(f"note: --ffn scaled: this {ck.family} model has no gated FFN group ({why}), so its {' and '.join(units)} are permuted only")


def _note_headless_residual(progress: Progress, options: dict, models: list) -> None:
    """A model without a task head outputs the residual stream itself: aligning the stream moves
    its last hidden state into the new basis (what a head reading it would compute is kept)."""
    headless = [what for what, ck in models if ck.layout.head is None]
    if options.get("residual", "none") != "none" and headless:
        progress.note(f"note: {', '.join(headless)} {'has' if len(headless) == 1 else 'have'} no task head, so with --residual the last "
                      "hidden state comes out in the aligned basis (its features permuted or rotated); what a head reading it computes "
                      "is unchanged")


def _note_folded_frame(progress: Progress, options: dict) -> None:
    """A rotation of the stream folds the norms first: the distances are between the folded models
    (the same functions), not the models as stored (a new-user trial saw "before" change)."""
    if options.get("residual") == "rotation":
        progress.note("note: --residual rotation folds every model's norm gains (and LayerNorm biases) into the layers that read them "
                      "before aligning (the same functions): the distances are the folded models'")


# ---- streaming (checkpoints bigger than memory) -----------------------------------------------------

def _streaming_budget(max_memory: int | None, estimate: int, options: dict, progress: Progress, method=None, align="anchor",
                      unstreamable: str | None = None) -> int | None:
    """The memory budget of a streamed run, or None for the in-memory path: `max_memory` when
    given (the streaming path refuses what it cannot do, with the reason; `unstreamable` says why
    this run cannot stream at all); 80% of the memory available when the in-memory `estimate`
    (`memory.in_memory_bytes`, what a dry run prints) exceeds it and the run is one the
    streaming path can do."""
    processes = jax.process_count()
    if processes > 1:  # the processes split a streamed run's layers: it must stream
        why = unstreamable or unstreamed(options, method, align)
        if why:
            raise PipelineError(f"{processes} processes split a streamed run's layers between them, and {why}; run it in one process")
        return max_memory if max_memory is not None else int(0.8 * rj.streaming.available_memory())
    if max_memory is not None and unstreamable:
        raise PipelineError(f"--max-memory: {unstreamable}; run without it (in memory)")
    if max_memory is not None:
        return max_memory
    if unstreamable or unstreamed(options, method, align):
        return None
    available = rj.streaming.available_memory()
    if estimate <= available:
        return None
    progress.note(f"the models need about {estimate / 2**30:.1f} GiB in memory, {available / 2**30:.1f} GiB is available: "
                  "streaming from disk to disk (--max-memory picks the budget)")
    return int(0.8 * available)


def unstreamed(options: dict, method, align) -> str | None:
    """Why the streaming path cannot do this run, or None."""
    why = rj.streaming.unstreamed_method(options.get("method", "weights"), merging=align if method is not None else None)
    if why:
        return why
    known = merge_methods.METHODS.get(method) if method is not None else None
    why = known.unstreamed() if known is not None else None
    if why:
        return f"the merge method {method!r} is not streamed: {why}"
    return None


def _stream_call(fn, *args, **kwargs):
    """A streaming call, its refusals and bad inputs as PipelineErrors naming the problem."""
    try:
        return fn(*args, **kwargs)
    except NonFiniteWeights as e:
        raise unusable(e) from None
    except (rj.streaming.StreamingError, CheckpointError, FileNotFoundError) as e:
        raise PipelineError(str(e)) from None
    except FileExistsError as e:
        raise PipelineError(f"OUT: {e}") from None
    except ValueError as e:
        raise PipelineError(str(e)) from None


# ---- output -----------------------------------------------------------------------------------------

def check_out(out, sources: list[Checkpoint], output_bytes: int, run: RunOptions) -> None:
    """OUT checked before any weight is read: not a source folder, not existing without
    `run.overwrite`, writable, with room for the weights on its disk."""
    try:
        check_output(out, [ck.source for ck in sources], overwrite=run.overwrite, output_bytes=output_bytes, overwrite_option=run.overwrite_option,
                     writes=("config.json", *CARD_FILES))
    except (FileExistsError, NotADirectoryError, PermissionError) as e:
        raise PipelineError(f"OUT: {e}") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise PipelineError(f"OUT: {e.strerror or e}") from None
        raise


def _add_timings(clock: Clock, timings: list[dict]) -> None:
    """The phases of `align` runs (their in-memory solves, distances, moves) added to a pipeline's clock."""
    for t in timings:
        for key in ("solve", "assignment", "attention", "distances", "apply", "compile"):
            clock[key] += t[key]


def _save(checkpoint: Checkpoint, params, out, run: RunOptions, dtype, files: Callable[[], dict], clock: Clock) -> Path:
    """`save_hf` (or `save_orbax`); `files()` (the report, card and recipe) is called once the weights
    are written, after their seconds are added to the clock's "write"."""
    t0 = time.perf_counter()

    def timed_files():
        clock["write"] += time.perf_counter() - t0
        return files()

    try:
        save = save_orbax if run.format == "orbax" else save_hf
        return save(checkpoint, params, out, dtype=dtype, overwrite=run.overwrite, extra_files=timed_files)
    except (CheckpointError, FileExistsError) as e:
        raise PipelineError(f"OUT: {e}") from None
