"""`merge_checkpoints`: the merge a recipe describes, checked from configs and headers
(`_checked_merge`), then run in memory (`_merge_in_memory`) or streamed (`_merge_streaming`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import numpy as np
import yaml

import rotsym_jax as rj

from .. import verify
from ..checks import mergeable
from ..engine.distances import distance_report
from ..engine.residual import settled_streams
from ..io import recipe as recipe_mod
from ..io.card import distance_rows, files_of, model_card, report_of
from ..io.hf import Checkpoint, CheckpointError, held_dtype, spec_for
from ..io.loading import PipelineError, Progress, load_checkpoint, note_unused_records, proven
from ..io.memory import checkpoint_bytes as nbytes
from ..io.memory import cost_bytes, in_memory_bytes
from ..io.reconcile import notes as change_notes
from ..io.reconcile import reconciled
from ..merging import methods as merge_methods
from ..options import ManyOptions, recorded
from ..spec import bind
from ..timings import Clock
from .notes import note_alignment, note_changes, note_config_differences
from .refusals import check_alignment_data, check_out, check_rotation, same_architecture
from .run import DryRun, RunOptions, Written, add_timings, align_options_of, aligning_spec, checked, folded, layers_text, save_output, settled_for
from .streamed import Chosen, format_unstreamable, stream_call, streaming_budget

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
    max_memory, chosen = streaming_budget(run.max_memory, estimate, job.options, run.progress, method=job.method.name, align=plan.align,
                                           unstreamable=format_unstreamable(run.format))
    if max_memory is not None:
        return _merge_streaming(job, max_memory, chosen)
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
        """The report (updated with `result`, its alignment's `settled` added), model card and recipe
        written beside the weights."""
        settled = alignment_settled(self.models[0], self.options) if self.plan.align != "none" else None
        if settled and result.get("alignment"):
            result = {**result, "alignment": {**result["alignment"], "settled": settled}}
        report.update(report_of(self.command, _merge_inputs(self.models, self.base), self.recorded, {**result, **self.changes},
                                self.start))
        return files_of(_merge_card(self.out, self.plan, self.method, self.recipe_text, report), self.recipe_text, report)


def alignment_settled(anchor: Checkpoint, options: dict) -> dict | None:
    """What `options` (the pipelines' settled ones) became on each stream of the models where not
    every stream takes their residual mode: `rotsym align`'s report `settled`, by its rule
    (`residual.settled_streams`) on the spec the pipelines align with; one for a merge, in memory
    and streamed, anchor and many alike (every pair is aligned with those options). None: as asked."""
    return settled_streams(bind(aligning_spec(anchor), anchor.params), options["residual"], signed=options.get("method", "weights") == "weights")


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
    note_config_differences(progress, [(f"model {i}", ck) for i, ck in enumerate(models)] + ([("base", base)] if base is not None else []), "model 0")
    if plan.align != "none":
        note_alignment(progress, options, [(f"model {i}", ck) for i, ck in enumerate(models)])
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
    recipe_text = recipe_mod.to_yaml(dataclasses.replace(plan, params=params, align_options=options), Path(out))
    recorded_options = {"method": method.name, "params": params, "align": plan.align, **({"align_options": options} if aligned else {}),
                        **({"weights": list(plan.weights)} if plan.weights is not None else {}),
                        **({"dtype": plan.dtype} if plan.dtype is not None else {}), "task_head": plan.task_head, "seed": plan.seed,
                        **({"data": recipe_mod.data_node(plan.data)} if plan.data is not None else {})}  # every choice that ran
    return _Merge(plan, out, run, start, command, method, params, options, models, base, batches, what, recipe_text, recorded_options,
                  changes, held), estimate


def _check_data_alignment(plan: recipe_mod.Recipe, batches, anchor: Checkpoint, options: dict, max_memory) -> None:
    """A merge aligned from data (options' method "activations" or "learned") refused from the config alone."""
    if batches is None:
        raise PipelineError(f"align_options.method={options['method']!r} matches the models' activations on data: the recipe needs a data section")
    if max_memory is not None:
        stream_call(rj.streaming.streamed_options, options, merging=plan.align)  # refused, with the reason
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
    note_changes(progress, job.changes)
    anchor = models[0]
    params_list, alignment = progress.step(f"alignment: {plan.align}", checked, aligned, models, plan.align, job.options, progress, clock,
                                           job.batches, plan.seed)
    # the base's norm gains are folded as the models' were (task vectors compare like with like)
    base_params = None if base is None or plan.align == "none" else folded([base.params], anchor, job.options)[0]
    inputs = {"base": None if base is None else _with_anchor_head(base_params if base_params is not None else base.params, anchor.params, plan.task_head)}
    inputs["key"] = jax.random.key(plan.seed) if "key" in method.needs else None
    inputs["spec"] = spec_for(anchor) if "spec" in method.needs else None
    inputs["weights"] = plan.weights
    statistics = None
    if job.batches is not None:
        computed, statistics = progress.step("statistics", clock.timed, "statistics", _statistics, method, models, params_list, job.batches,
                                             plan.seed, progress)
        inputs.update(computed)
        if "batches" in method.optional:
            inputs["checkpoint"], inputs["batches"] = anchor, job.batches
    inputs = {k: v for k, v in inputs.items() if v is not None and (k in method.needs or k in method.optional)}
    # On the host, where save_hf takes the weights anyway: the distance needs no compilation there.
    merged = progress.step("merging", clock.timed, "merge", lambda: jax.device_get(
        checked(merge_methods.merge, method.name, params_list, task_head=plan.task_head, **inputs, **job.params)))
    # to the anchor in the frame the models were merged in (norms folded for a rotation), as a streamed run measures it
    anchor_frame = anchor.params if plan.align == "none" else folded([anchor.params], anchor, job.options)[0]
    distance = clock.timed("distances", distance_report, spec_for(anchor), jax.device_get(anchor_frame), merged)["total"]
    merge_report = {"alignment": alignment, "merged_distance_to_anchor": distance, **({"statistics": statistics} if statistics else {})}
    report = {}
    # called once the weights are written: the report times them
    files = lambda: job.files(report, {**merge_report, "timings": clock.report(job.start)})  # noqa: E731
    path = progress.step("saving", save_output, anchor, merged, job.out, job.run, plan.dtype, files, clock)
    return Written(path, report, distance_rows(merge_report, model_names(plan)))


def _merge_streaming(job: _Merge, max_memory: int, chosen: Chosen | None = None) -> DryRun | Written:
    plan, method = job.plan, job.method
    from_data = plan.align != "none" and job.options.get("method", "weights") == "activations"
    if plan.data is not None and method.name not in merge_methods.STATISTICS and not from_data:
        raise PipelineError(f"method {method.name}: statistics from data are not streamed; run without --max-memory")
    merging = {"align": plan.align, "align_options": job.options if plan.align != "none" else None, "params": job.params,
               "weights": plan.weights, "seed": plan.seed, "task_head": plan.task_head, "dtype": plan.dtype}
    if job.batches is not None:  # the Fisher's kind and key as in memory
        merging["fisher_kind"], merging["fisher_key"] = _fisher_choice(job.batches, job.models[0], plan.seed)
    if job.run.dry_run:
        estimate = stream_call(rj.streaming.plan_merge, method.name, job.models, merging, base=job.base, batches=job.batches,
                                max_memory=max_memory, chosen=chosen)
        return DryRun([*job.what, estimate.describe()], estimate.peak_bytes, f"streaming, {layers_text(estimate.chunk_layers)} at a time")
    note_changes(job.run.progress, job.changes)
    report = {}
    with job.run.progress.chunks(f"{method.name} merge (streaming)") as update:
        result = stream_call(rj.streaming.merge_to_disk, method.name, job.models, job.out, merging, base=job.base, batches=job.batches,
                              max_memory=max_memory, overwrite=job.run.overwrite, extra_files=lambda result: job.files(report, result),
                              progress=update, chosen=chosen)
    note_fallbacks(job.run.progress, result.report["alignment"])
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


def _statistics(method, models, params_list, batches, seed, progress) -> tuple[dict, dict | None]:
    """Fisher or Gram statistics of each model as aligned (each run by its own checkpoint), as the
    method's inputs, and what they were computed on (the report's `statistics`, as a streamed run
    gives it: method, examples, the Fisher's kind); ({}, None) for a method that needs neither."""
    with progress.detail("statistics", len(models) * len(batches), "batch") as tick:
        if "fishers" in method.needs:
            kind, key = _fisher_choice(batches, models[0], seed)
            fishers = [checked(rj.stats.fisher, ck, p, batches, kind=kind, key=key, progress=tick) for ck, p in zip(models, params_list)]
            return {"fishers": fishers}, {"method": method.name, "examples": fishers[0].count, "kind": kind}
        if "grams" in method.needs:
            grams = [checked(rj.stats.grams, ck, p, batches, progress=tick) for ck, p in zip(models, params_list)]
            return {"grams": grams}, {"method": method.name, "examples": grams[0].count}
    return {}, None


def _fisher_choice(batches, anchor: Checkpoint, seed: int) -> tuple[str, jax.Array | None]:
    """The Fisher's kind and key: empirical with labels; else expected, sampled from the recipe's
    seed for an LM head (exact over the classes otherwise)."""
    labelled = "labels" in batches[0]
    key = None if labelled or anchor.layout.head != "lm" else jax.random.key(seed)
    return ("empirical" if labelled else "expected"), key


def note_fallbacks(progress: Progress, alignment: dict) -> None:
    """A line for each model aligned to the anchor whose fallback kept another element than its
    method's (the alignment report's `chosen` note), in memory and streamed alike."""
    for i, entry in enumerate(alignment.get("distances", []), 1):
        if entry.get("chosen", {}).get("note"):
            progress.note(f"model {i}: {entry['chosen']['note']}")


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
            for p in params[1:]:
                results.append(rj.align(params[0], p, spec, **options))
                tick()
        report = {"mode": "anchor", "distances": [{k: r.report[k] for k in ("before", "after", "layers", "chosen", "moved", "residual") if k in r.report}
                                                  for r in results]}
        note_fallbacks(progress, report)
        add_timings(clock, [r.report["timings"] for r in results])
        return [params[0]] + [r.params for r in results], report
    # At most max_iters sweeps (align_many's default) after the initial pass.
    passes = 1 + ManyOptions().max_iters
    with progress.detail("align_many", passes, "pass") as tick:
        many = clock.timed("solve", rj.align_many, params, spec, progress=tick, **options)
    return many.params, {"mode": "many", "objective": many.objective, "stop": many.report["stop"], "moved": many.report["moved"]}


def _with_anchor_head(base: dict, anchor: dict, task_head: str) -> dict:
    """A base model without the anchor's task head gets it (task vectors of the head are moot
    when the anchor's head is kept)."""
    if task_head == "anchor" and "head" in anchor:
        return {**base, "head": anchor["head"]}
    return base
