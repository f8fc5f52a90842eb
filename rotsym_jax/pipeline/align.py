"""`align_checkpoints`: B moved as close as possible to A, in memory or streamed, written with its
report, model card and recipe."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import yaml

import rotsym_jax as rj

from .. import verify
from ..io import recipe as recipe_mod
from ..io.card import distance_rows, files_of, model_card, report_of
from ..io.hf import Checkpoint, held_dtype
from ..io.loading import PipelineError, Progress, load_checkpoint, note_unused_records, proven
from ..io.memory import checkpoint_bytes as nbytes
from ..io.memory import cost_bytes, in_memory_bytes
from ..io.reconcile import notes as change_notes
from ..io.reconcile import reconciled
from ..options import DTYPES, AlignOptions, recorded
from ..timings import Clock
from .notes import note_alignment, note_changes, note_config_differences
from .refusals import check_out, check_rotation, data_batches, same_architecture
from .run import DryRun, RunOptions, Written, add_timings, align_options_of, aligning_spec, checked, folded, layers_text, save_output, settled_for
from .streamed import format_unstreamable, stream_call, streaming_budget


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
    note_config_differences(progress, [("A", ck_a), ("B", ck_b)], "B")
    check_out(out, [ck_a, ck_b], nbytes(ck_b, dtype), run)
    held = held_dtype(dtype, [ck_a, ck_b])
    batches = data_batches(options, data, ck_a, run.max_memory, "--data FILE" if run.overwrite_option.startswith("--") else "data=")
    note_alignment(progress, shown, [("B", ck_b)])
    estimate = in_memory_bytes([nbytes(ck_a, held), nbytes(ck_b, held)], moved=[nbytes(ck_b, held)], cost_bytes=checked(cost_bytes, ck_b))
    # the report's options: every choice that ran (the recipe's, less the models)
    reported = {**shown, **({"dtype": dtype} if dtype is not None else {}), **({"format": format} if format != "hf" else {}),
                **({"data": recipe_mod.data_node(data)} if batches else {}), **({"seed": seed} if options.method == "learned" else {})}
    what = [f"align {b} ({ck_b.family}) to {a}, options {shown}, write {out}" + (f" in {dtype}" if dtype else ""),
            *(f"  {note}" for note in change_notes(changes))]
    max_memory, chosen = streaming_budget(run.max_memory, estimate, shown, progress, unstreamable=format_unstreamable(format))
    # what the run computes, whichever way it runs (how it streams is the report's "streaming")
    # its paths relative to OUT, where it is written, as a recipe's are read
    # (`rotsym align OUT/rotsym_config.yaml NEW` replays it)
    recipe = yaml.safe_load(recipe_mod.AlignRecipe(str(a), str(b), shown, format, dtype, data if batches else None, seed).to_yaml(Path(out)))
    if max_memory is not None:
        if run.dry_run:
            plan = stream_call(rj.streaming.plan_align, ck_a, ck_b, max_memory=max_memory, data=batches, dtype=dtype, chosen=chosen, **shown)
            return DryRun([*what, plan.describe()], plan.peak_bytes, f"streaming, {layers_text(plan.chunk_layers)} at a time")

        note_changes(progress, changes)
        report = {}

        def files(result):
            report.update(report_of(command, {"a": ck_a, "b": ck_b}, reported, {**result, **changes}, start))
            return files_of(_align_card(out, a, b, recipe, report), recipe, report)

        with progress.chunks("align (streaming)") as update:
            result = stream_call(rj.streaming.align_to_disk, ck_a, ck_b, out, **shown, data=batches, max_memory=max_memory, dtype=dtype,
                                  overwrite=overwrite, extra_files=files, progress=update, chosen=chosen)
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
    note_changes(progress, changes)
    params_a, params_b = folded([ck_a.params, ck_b.params], ck_b, shown)
    # Task heads may differ (other label sets, or none): align leaves them out and B keeps its own.
    result = progress.step("aligning B to A", align_pair, params_a, params_b, ck_b, options, batches, seed, progress)
    add_timings(clock, [result.report["timings"]])
    report = {}

    def files():  # called once the weights are written: the report times them
        report.update(report_of(command, {"a": ck_a, "b": ck_b}, reported, {**result.report, **changes, "timings": clock.report(start)},
                                start))
        return files_of(_align_card(out, a, b, recipe, report), recipe, report)

    path = progress.step("saving", save_output, ck_b, result.params, out, run, dtype, files, clock)
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
