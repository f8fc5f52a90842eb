"""`align_to_disk`: B aligned to A, disk to disk, a chunk of layers at a time."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from pathlib import Path

import jax
import numpy as np

from ..engine import driver
from ..engine.alignment import identity_like
from ..engine.report import alignment_report
from ..io import hf
from ..options import AlignOptions, StreamOptions
from ..processes import Team
from ..timings import Clock
from ..verify import strongest_as_run
from ._activations import ActivationMatching, with_whole_models
from ._common import Output, StreamingError, fallback_choice, split_options
from ._descent import ResidualDescent, summary_of
from ._lanes import Passes, full_streams, moved_chunk, moved_rows, on_streams, run_in_flight, solve_transforms, sq_of, ticker, write_tensor, write_together
from ._plan import StreamPlan, Work, check_stream_output, out_specs, plan_stream, with_sweeps
from ._source import Layout, Source, Writer, check_same_architecture, header

# ---- align -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StreamResult:
    """A streaming run's outcome: `path` written, `report` (distances as `align` / the merge
    command report them, "timings": the keys of `timings.TIMINGS`, as `align` reports them),
    `transforms` (per aligned model, over all layers: what `align` returns; with align="many",
    every model's, None for the one that stays as given), `plan`."""

    path: Path
    report: dict
    transforms: list
    plan: StreamPlan


def plan_align(a, b, options: AlignOptions | Mapping | None = None, *, spec=None, stream: StreamOptions | Mapping | None = None,
               data=None, dtype=None, **keywords) -> StreamPlan:
    """The plan of `align_to_disk(a, b, options, ...)` from the configs and headers alone (and
    the shapes of `data`'s batches, for method="activations")."""
    options, stream = split_options(options, stream, keywords)
    b = header(b)
    options, _ = settled_for_source(options, b)
    sa, sb, out_dtype = _sources(a, b, options, dtype)
    try:
        check_same_architecture(sa, sb)
        return _planned(sa, sb, Layout.of([sb, sa], spec), options, stream, Team.current().count, None if data is None else list(data),
                        out_dtype)
    finally:
        sa.close(), sb.close()


def _sources(a, b, options: AlignOptions, dtype) -> tuple[Source, Source, np.dtype | None]:
    """A and B read as the run reads them: the norm gains folded for a rotation of the residual
    stream, in float32 where B is stored narrower than it is written (`hf.held_dtype`); and
    `dtype` checked (None: B's stored dtypes)."""
    fold = options.residual == "rotation"  # the norm gains folded as each tensor is read, as align's callers fold them
    out_dtype = None if dtype is None else hf.floating_dtype(dtype)
    a, b = header(a), header(b)
    held = hf.held_dtype(out_dtype, [a, b])
    latent = options.latents == "rotation"  # MLA's latent gains folded as read, as `pipeline.folded` folds them
    return (Source(a, "A (the anchor)", fold=fold, dtype=held, fold_latents=latent), Source(b, "B", fold=fold, dtype=held, fold_latents=latent),
            out_dtype)


def settled_for_source(options: AlignOptions, checkpoint) -> tuple[AlignOptions, dict | None]:
    """A data method's residual "auto" settled: the strongest group the family allows, as the
    pipelines settle it (the gains folded as read), and report["settled"] (None: nothing was auto)."""
    if options.residual != "auto":
        return options, None
    mode, why = strongest_as_run(checkpoint)
    return options.settled(mode), {"residual": mode, "why": why}


def align_to_disk(a, b, out, options: AlignOptions | Mapping | None = None, *, spec=None, stream: StreamOptions | Mapping | None = None,
                  data=None, dtype=None, extra_files=None, **keywords) -> StreamResult:
    """`align(A, B)` then `save_hf` of B moved, from folder `a` and `b` to folder `out`, a chunk of
    layers at a time (see the module docstring). The options are `align`'s (method "weights", or
    "activations" with `data`, batches of model inputs as `align` takes them: each model then held
    whole in turn, `ActivationMatching`; "learned" is refused, `unstreamed_method`;
    with residual="rotation", every tensor is read with the norm gains folded, as `fold_norms`
    leaves it; a head tied to the embedding must be untied first, `rj.untie`). Chunk size: `stream`'s
    `chunk_layers`, else the most layers whose estimated peak fits its `max_memory` bytes, else 4. B's task head is kept, as `rotsym align` keeps it.
    `extra_files`: as `save_hf`'s, or a function of the report returning them (written with the
    checkpoint). `stream`'s `progress(done, total)` is called after every chunk of every pass
    (`total`: the most the run can take; the residual descent may stop sooner); its `overwrite`
    replaces an existing `out`. `keywords`: fields of `AlignOptions` or of `StreamOptions`
    (`max_memory=...`, `overwrite=True`, `progress=...`), over `options` and `stream`. `dtype`:
    the dtype written (None: B's stored dtypes), from the float32 computation where B is stored
    narrower (`hf.held_dtype`), as `save_hf(dtype=)` writes `align`'s result on params loaded so.
    Raises before reading any weight on bad input: architectures that differ, missing or
    truncated shards, an output that exists (without `overwrite`) or does not fit on its disk."""
    start = time.perf_counter()
    team = Team.current()
    with team.together():
        options, stream = split_options(options, stream, keywords)
        b = header(b)
        options, settled = settled_for_source(options, b)
        sa, sb, out_dtype = _sources(a, b, options, dtype)
        try:
            return run_align_to_disk(sa, sb, Output(out, stream.overwrite, extra_files, stream.progress), start, options, spec=spec,
                                     stream=stream, data=data, settled=settled, out_dtype=out_dtype)
        finally:
            sa.close(), sb.close()


def run_align_to_disk(sa: Source, sb: Source, output: Output, start: float, options: AlignOptions, *, spec, stream: StreamOptions,
                      data=None, settled: dict | None = None, out_dtype=None) -> StreamResult:
    """`align_to_disk` on its sources, read as the run reads them (`_sources`), in this process's team."""
    team = Team.current()
    check_same_architecture(sa, sb)
    layout = Layout.of([sb, sa], spec)
    driver.layer_masks(layout.bound, options.layers)  # bad layer indices: the error `align` gives, before any read
    from_data = options.method == "activations"
    if from_data and data is None:
        raise StreamingError("method='activations' matches the models' activations on data: give data= (batches of model inputs)")
    if not from_data and data is not None:
        raise StreamingError("data= drives method='activations'; method='weights' reads only the weights")
    batches = None if data is None else list(data)
    plan = _planned(sa, sb, layout, options, stream, team.count, batches, out_dtype)
    target = check_stream_output(output.path, [sa, sb], output.overwrite, plan.output_bytes, plan.scratch_bytes)
    team.agree("runs", {"a": str(sa.path), "b": str(sb.path), "out": str(target), "options": options.as_dict(), "plan": plan, "dtype": str(out_dtype),
                        "spec": None if spec is None else repr(spec)})
    chunks = layout.chunks(plan.chunk_layers)
    mine = team.share(chunks)  # the chunks this process reads, solves and writes
    tick = ticker(len(mine) * (plan.passes + plan.passes_per_sweep * plan.max_sweeps) + 1, output.progress)
    clock = Clock()
    passes = Passes(clock, tick, team, plan.in_flight)
    solved = _solved(layout, sa, sb, chunks, options, passes, batches, target.parent, plan.block_bytes)
    by_record = driver.settled(layout.bound, options.residual, options.method, options.ffn)
    settled = {**(settled or {}), **by_record} if by_record else settled
    written = _Write(layout, sa, sb, options, plan, passes, mine, {**solved, "settled": settled}, start, out_dtype)
    specs = out_specs(sb, out_dtype)
    writes = [name for chunk in mine for layer in chunk for name in layout.layer_rules[layer]] + (layout.global_rules if team.lead else [])
    path, report = write_together(team, sb.ck, target, {n: d for n, (d, _) in specs.items()},
                                  lambda tmp, create: Writer(tmp, sb, specs, stream.max_shard_bytes, create=create, writes=writes), written,
                                  output.extra_files, start)
    return StreamResult(path, report, [written.transforms()], plan)


class _Write:
    """The write pass of a streamed align: B moved by the result kept (`kept`: the method's, or,
    `fallback`, B as given where that is closer to A), measured and written by every process."""

    def __init__(self, layout: Layout, sa: Source, sb: Source, options: AlignOptions, plan: StreamPlan, passes: Passes, mine, solved: dict,
                 start: float, out_dtype=None):
        self.out_dtype = out_dtype  # None: each tensor as B stores it
        self.layout, self.sa, self.sb, self.options, self.plan, self.passes, self.mine = layout, sa, sb, options, plan, passes, mine
        self.solved, self.start = solved, start
        self.residual = options.residual != "none"
        self.sq_before = solved["sq_before"]
        method = solved.get("method", "weights")
        # activation matching's fallback is decided before anything is written; weight matching's once B moved is measured
        self.kept = {"method": method, "moving": None if method == "identity" else solved["transforms"], "chosen": solved.get("chosen"),
                     "decided": options.method == "activations"}
        self.streams = full_streams(layout, sb) if self.residual else ()

    def write_mine(self, writer) -> dict:
        """This process's chunks (and, process 0, the tensors outside the layers) moved and
        written; the squared distances after, those outside the layers apart, and its timings."""
        layout, sa, sb, clock, tick = self.layout, self.sa, self.sb, self.passes.clock, self.passes.tick
        moving = self.kept["moving"]  # None: B as given

        def write_share(share, clock, turn):
            sq_after = {}
            for chunk in share:
                names = [name for layer in chunk for name in layout.layer_rules[layer]]
                # the leaves that move: the groups' members, every leaf with the residual stream
                measured = [p for name in names for p in layout.rule_ours[name]] if self.residual else layout.members(chunk)
                flat_b = sb.leaves(names, clock)
                flat_a = sa.leaves(sorted({k for p in measured for k in sa.keys_of[p]}), clock)
                with turn:
                    moved = flat_b if moving is None else moved_chunk(layout, chunk, flat_b, moving, clock)
                    sq_after.update(sq_of(clock, flat_a, moved, measured))
                sq_after.update({p: self.sq_before[p] for p in moved if p not in measured})
                del flat_b, flat_a  # held while written: the moved leaves only
                for name in names:
                    write_tensor(writer, clock, name, sb.rules[name], moved, self.written(name))
                del moved
                tick()
            return sq_after

        sq_after, sq_global = {}, {}
        try:
            for part in run_in_flight(self.mine, write_share, clock, self.plan.in_flight):
                sq_after.update(part)
            for name in layout.global_rules if self.passes.team.lead else ():
                sq_global.update(copy_global(sb, sa, name, writer, self.plan.block_bytes, clock, moving or {}, self.streams,
                                             self.written(name), aside=layout.aside))
            tick()
            writer.finish()
        finally:
            writer.close()
        return {"sq_after": sq_after, "sq_global": sq_global, "timings": clock.report(self.start)}

    def written(self, name: str) -> np.dtype:
        """The dtype tensor `name` is written in: the run's `dtype`, else as B stores it."""
        return self.sb.stored(name) if self.out_dtype is None else self.out_dtype

    def distances(self, every) -> tuple[dict, dict]:
        """(squared distances before, after) of every leaf measured, from every process's writes."""
        sq_global = {p: v for done in every for p, v in done["sq_global"].items()}
        # left as they were (no residual transform, or B as given): the same distance before and after
        before = self.sq_before | (sq_global if not self.residual or self.kept["moving"] is None else {})
        return before, {p: v for done in every for p, v in done["sq_after"].items()} | sq_global

    def again(self, every) -> bool:
        """`align`'s fallback (`engine.choice`), decided alike in every process once B moved is
        written and measured: where B as given is closer to A, it is written instead."""
        kept = self.kept
        if kept["moving"] is None or kept["decided"]:
            return False
        kept["chosen"] = fallback_choice(self.options, *self.distances(every))
        if kept["chosen"] is None or kept["chosen"]["method"] == "weights":
            return False
        kept.update(method="identity", moving=None)
        return True

    def summary(self, every) -> dict:
        """The report from every process's `write_mine` results, as `align` builds it (`alignment_report`)."""
        team = self.passes.team
        processes = {"count": team.count, "timings": [done["timings"] for done in every]} if team.count > 1 else None
        return alignment_report(self.layout.bound, *(summary_of(self.layout.bound, sq) for sq in self.distances(every)), self.transforms(),
                                winner=self.kept["method"], sweeps=self.solved.get("distance_per_sweep") if self.residual else None,
                                chosen=self.kept["chosen"], settled=self.solved.get("settled"), timings=self.passes.clock.report(self.start),
                                streaming=dataclasses.asdict(self.plan), processes=processes)

    def transforms(self) -> dict:
        return identity_like(self.layout.bound, self.options) if self.kept["method"] == "identity" else self.solved["transforms"]


def _planned(sa: Source, sb: Source, layout: Layout, options: AlignOptions, stream: StreamOptions, processes: int, batches,
             out_dtype=None) -> StreamPlan:
    """The plan of an align: its chunked passes, the residual descent's sweeps, and the passes
    that hold a model whole (method="activations", with the shapes of `batches`)."""
    plan = plan_stream([sa, sb], layout, stream, Work(aligned=True, merging=False, elementwise=True, residual=options.residual, out_dtype=out_dtype),
                       output=sb,
                       processes=processes)
    plan = with_sweeps(plan, residual=options.residual, residual_sweeps=options.residual_sweeps)
    if options.method == "activations" and batches is not None:
        plan = with_whole_models(plan, [sa, sb], layout, batches, options, stream.max_memory)
    return plan


def _solved(layout: Layout, sa: Source, sb: Source, chunks, options: AlignOptions, passes: Passes, batches, scratch: Path,
            block_bytes: int) -> dict:
    """The method's transforms and the distances before (activation matching: its fallback
    decided too, before anything is written)."""
    if options.method == "activations":
        return ActivationMatching(layout, sa, sb, chunks, options, passes, batches, scratch, block_bytes).run()
    if options.residual != "none":
        return ResidualDescent(layout, sa, sb, chunks, options, passes, block_bytes).run()
    (solved,) = solve_transforms(layout, sa, [sb], chunks, options, passes)
    return solved


def copy_global(source: Source, anchor: Source | None, name: str, writer, block_bytes: int, clock, moving=None, streams=(),
                out_dtype=None, *, aside: frozenset) -> dict:
    """A tensor outside the layers, left as it is (align), or moved by the elements of `streams`
    that `moving` (a transforms dict) holds: written back as `save_hf` writes it,
    with its squared distance to the anchor's (the leaves not set `aside`; None for no anchor). Whole when
    small (the distance as `align` computes it); in row blocks otherwise, the distance summed on
    the host in float64. A stored dtype JAX does not hold (float64 without x64) goes through the
    leaf, as `load_hf` rounds it. `out_dtype`: the dtype written (None: as stored)."""
    rule = source.rules[name]
    shape, stored = source.hf_shape(name), source.stored(name)
    out_dtype = stored if out_dtype is None else np.dtype(out_dtype)
    body = [p for p in rule.ours if p not in aside] if anchor is not None and name in anchor.rules else []
    canonical = np.dtype(jax.dtypes.canonicalize_dtype(stored)) == stored
    moves = moving is not None and any(s.name in moving for s in streams)
    on_two = sum(any(p in rule.ours for p, _ in s.axes) for s in streams if moves and s.name in moving) > 1
    # whole where row blocks cannot move it: a fused tensor, a leaf on two streams (a block may cut the other's axis)
    if math.prod(shape) * 4 <= block_bytes or not canonical or len(shape) == 0 or (moves and len(rule.ours) > 1) or on_two:
        flat = source.leaves([name], clock)
        if moves:
            flat = on_streams(streams, flat, moving, clock)
        sq = {}
        if anchor is not None and body:
            flat_a = anchor.leaves([name], clock)
            sq = sq_of(clock, flat_a, flat, body)
        write_tensor(writer, clock, name, rule, flat, out_dtype)
        return sq
    rows = max(1, block_bytes // (4 * max(1, math.prod(shape[1:]))))
    total = 0.0
    for start in range(0, shape[0], rows):
        span = (start, min(shape[0], start + rows))
        block = source.tensor(name, clock, span)
        if moves:
            block = moved_rows(rule, streams, moving, block, clock)
        if anchor is not None and body:
            anchor_block = anchor.tensor(name, clock, span)
            with clock.phase("distances"):
                d = (anchor_block.astype(np.float32) - block.astype(np.float32)).astype(np.float64).ravel()
                total += float(np.dot(d, d))
        with clock.phase("write"):
            writer.write_rows(name, span[0], np.asarray(block.astype(out_dtype, copy=False), order="C"))
    writer.done(name)
    return {p: total for p in body} if anchor is not None else {}
