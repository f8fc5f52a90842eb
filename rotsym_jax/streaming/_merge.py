"""`merge_to_disk`: the models aligned and merged, disk to disk, a chunk of layers at a time."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from .. import checks
from ..checks import is_head
from ..engine import driver
from ..engine.alignment import identity_like
from ..engine.distances import before_after, host_sq_dist, summarise_distances
from ..engine.report import moved as what_moved
from ..errors import InputError
from ..io import hf
from ..merging import arithmetic
from ..merging import methods as merge_methods
from ..options import ManyOptions, MergeOptions, StreamOptions
from ..processes import Team
from ..pytree import flatten, unflatten
from ..spec import bind
from ..timings import Clock
from ._activations import ActivationMatching, with_whole_models
from ._align import StreamResult
from ._common import Output, StreamingError, fallback_choice, merge_options_of, merges_in_row_blocks, streamed_method
from ._descent import AlignMany, ResidualDescent, summary_of
from ._lanes import Passes, blocked_globals, full_streams, moved_chunk, moved_rows, on_streams, run_in_flight, solve_transforms, sq_of, ticker, write_tensor, write_together
from ._plan import StreamPlan, Work, check_stream_output, moved_model_count, out_specs, with_sweeps
from ._source import Layout, Source, Writer, check_same_architecture, header, shape_stand_ins_of
from ._statistics import Spill, StatisticsMerge, check_statistics_models, plan_merge_stream, statistics_inputs_of

# ---- merge -----------------------------------------------------------------------------------------

def plan_merge(method: str, models: Sequence, options: MergeOptions | Mapping | None = None, *, base=None, batches=None,
               stream: StreamOptions | Mapping | None = None, **keywords) -> StreamPlan:
    """The plan of `merge_to_disk(method, models, options, ...)` from the configs and headers
    alone (and, for fisher / regmean, the shapes of `batches`: the statistics pass's estimate)."""
    run = StreamedMerge(method, models, base, *merge_options_of(options, stream, keywords), batches, Team.current())
    try:
        return run.checked_plan()
    finally:
        run.close()


def merge_to_disk(method: str, models: Sequence, out, options: MergeOptions | Mapping | None = None, *, base=None,
                  batches: Sequence[Mapping] | None = None, stream: StreamOptions | Mapping | None = None, extra_files=None,
                  **keywords) -> StreamResult:
    """`rotsym merge` from disk to disk a chunk of layers at a time: the models (folders; the
    first is the anchor) aligned to the anchor (`options.align` "anchor", `options.align_options`
    as `align`'s, the residual stream included), to one another ("many": `align_many`'s sweeps,
    `AlignMany`) or not ("none"), merged by `method` (one of `streamed_methods()`, its options in
    `options.params`; dare draws from `jax.random.key(options.seed)`), written to `out` in the
    anchor's dtypes (or `options.dtype`). `keywords`: fields of `MergeOptions` (`align="many"`,
    `params={...}`, `weights=[...]`) or of `StreamOptions` (`max_memory=...`, `overwrite=True`,
    `progress=...`: as `align_to_disk`'s), over `options` and `stream`. `extra_files`: as
    `align_to_disk`'s. The weights equal `merge.merge` on the in-memory aligned models, saved by
    `save_hf`, bit for bit. report: {"alignment": as the merge command's,
    "merged_distance_to_anchor", "timings"}.

    fisher and regmean (`merge.STATISTICS`) need `batches`: a list of dicts of model inputs, as
    `stats.fisher` / `stats.grams` take them. Each model's statistics are computed on it as aligned
    in a statistics pass that holds one model at a time (`stats.fisher(ck, aligned, batches,
    kind=fisher_kind, key=fisher_key, samples=fisher_samples)`, or `stats.grams(ck, aligned,
    batches)`), spilled to a temporary folder beside `out` and read back chunk by chunk; the
    weights equal `merge.fisher` / `merge.regmean` (with `weights`, `params`) on the in-memory
    aligned models with those statistics, bit for bit. The report then has "statistics".
    `align_options` method="activations" (align="anchor") aligns each model from its activations
    on `batches` too (`ActivationMatching`: each model whole in turn, the fallback decided as
    `align` decides it)."""
    start = time.perf_counter()
    team = Team.current()
    with team.together():
        run = StreamedMerge(method, models, base, *merge_options_of(options, stream, keywords), batches, team)
        try:
            return run.run(Output(out, run.stream.overwrite, extra_files, run.stream.progress), start)
        finally:
            run.close()


class StreamedMerge:
    """One streamed merge: its inputs checked on construction (before any weight is read), its
    plan (`checked_plan`), then `run`: the alignment's passes (`solve`), the statistics pass, and
    pass 2, each process merging and writing its share of the chunks (`write_mine`) and process 0
    the tensors outside the layers (`merge_globals`)."""

    def __init__(self, method: str, models: Sequence, base, options: MergeOptions, stream: StreamOptions, batches, team: Team):
        self.method, self.options, self.stream, self.team = streamed_method(method), options, stream, team
        self.from_data = options.aligning is not None and options.aligning.method == "activations"
        if self.from_data and batches is None:
            raise StreamingError("align_options method='activations' matches the models' activations on data: give batches=[...]")
        self.inputs = statistics_inputs_of(method, batches, options.fisher_kind, options.fisher_key, options.fisher_samples,
                                           aligning_from_data=self.from_data)
        self.batches = None if batches is None else list(batches)
        if self.inputs is not None and team.count > 1:
            raise StreamingError(f"method {method!r} over {team.count} processes: its statistics pass holds each model whole, which the "
                                 "processes do not split; run it in one process")
        given = {k for k, v in (("base", base), ("weights", options.weights)) if v is not None} | ({"key"} & self.method.needs)
        given |= {self.method.statistics} if self.method.statistics else set()  # computed by the statistics pass
        try:
            self.params = self.method.bind(len(models), options.params, given)
            if options.weights is not None:
                checks.weights(options.weights, len(models))
        except InputError as e:
            raise StreamingError(str(e)) from None
        self.aligning = options.aligning
        self.residual = options.residual != "none"  # the models' leaves outside the layers move too
        self.out_dtype = None if options.dtype is None else hf.floating_dtype(options.dtype)
        fold = options.residual == "rotation"  # the norm gains folded as read, the base's too
        models, base = [header(p) for p in models], None if base is None else header(base)
        # in float32 where a model is stored narrower than it is written: the merge rounded once, as in memory
        held = hf.held_dtype(self.out_dtype, models + ([base] if base is not None else []))
        latent = self.aligning is not None and self.aligning.latents == "rotation"  # MLA's latent gains folded as read, the base's too
        self.sources = [Source(p, f"model {i}", fold=fold, dtype=held, fold_latents=latent) for i, p in enumerate(models)]
        self.base = None if base is None else Source(base, "base", fold=fold, dtype=held, fold_latents=latent)
        self.everything = self.sources + ([self.base] if self.base else [])
        self.spill = self.statistics = None

    def close(self) -> None:
        if self.spill is not None:
            self.spill.remove()
        for s in self.everything:
            s.close()

    def checked_plan(self) -> StreamPlan:
        """The sources checked against the anchor's architecture, then the plan from the headers."""
        for s in self.everything[1:]:
            check_same_architecture(self.sources[0], s)
        self.layout = Layout.of(self.sources, None)
        align, models = self.options.align, len(self.sources)
        work = Work(aligned=align != "none", merging=True, elementwise=False, moved=moved_model_count(align, models), residual=self.options.residual,
                    out_dtype=self.out_dtype)
        plan = plan_merge_stream(self.everything, self.layout, self.method.name, self.stream, work, inputs=self.inputs,
                                 task_head=self.options.task_head, processes=self.team.count)
        plan = with_sweeps(plan, align=align, residual=self.options.residual, residual_sweeps=self.options.align_options.residual_sweeps,
                           models=models)
        if self.from_data:  # each model whole in turn, as the statistics pass holds it
            plan = with_whole_models(plan, self.sources, self.layout, self.batches, self.aligning, self.stream.max_memory)
        return plan

    def run(self, output: Output, start: float) -> StreamResult:
        team, options, anchor = self.team, self.options, self.sources[0]
        plan = self.plan = self.checked_plan()
        if self.aligning is not None:
            driver.layer_masks(self.layout.bound, self.aligning.layers)
        if self.inputs is not None:
            check_statistics_models(self.sources, options.task_head, self.inputs)
        target = check_stream_output(output.path, self.everything, output.overwrite, plan.output_bytes, plan.scratch_bytes)
        team.agree("runs", {"models": [str(s.path) for s in self.everything], "out": str(target), "method": self.method.name,
                            "params": self.params, "weights": options.weights, "seed": options.seed, "task_head": options.task_head,
                            "dtype": str(self.out_dtype), "align": options.align,
                            "options": None if self.aligning is None else self.aligning.as_dict(), "plan": plan})
        chunks = self.layout.chunks(plan.chunk_layers)
        self.mine = team.share(chunks)  # the chunks this process reads, merges and writes
        self.tick = ticker(len(self.mine) * (plan.passes + plan.passes_per_sweep * plan.max_sweeps) + 1
                           + (len(self.sources) if self.inputs is not None else 0), output.progress)
        self.clock, self.start = Clock(), start
        self.key = jax.random.key(options.seed) if "key" in self.method.needs else None
        self.scratch = target.parent
        self.chosen, self.given = [], {}  # each aligned model's report["chosen"]; {model: distances} of those kept as given
        self.transforms, self.solved, many = self.solve(chunks)
        if self.inputs is not None:  # the statistics pass: one model at a time, spilled beside the output
            self.spill = Spill(target.parent)
            self.statistics = StatisticsMerge(self.inputs, self.spill, task_head=options.task_head, weights=options.weights,
                                              params=self.params, clock=self.clock)
            if self.method.name == "fisher":
                self.statistics.blocked = blocked_globals(self.layout, self.sources, plan.block_bytes, lambda name: True)
            self.statistics.run(self.sources, self.layout, self.transforms, self.tick)
        self.specs = out_specs(anchor, self.out_dtype)
        writes = ([name for chunk in self.mine for layer in chunk for name in self.layout.layer_rules[layer]]
                  + (self.layout.global_rules if team.lead else []))
        self.many = many
        path, report = write_together(team, anchor.ck, target, {n: d for n, (d, _) in self.specs.items()},
                                      lambda tmp, create: Writer(tmp, anchor, self.specs, self.stream.max_shard_bytes, create=create, writes=writes),
                                      self, output.extra_files, start)
        if many:
            return StreamResult(path, report, self.transforms, plan)
        moved = [identity_like(self.layout.bound, self.aligning) if i in self.given else t for i, t in enumerate(self.transforms[1:], 1)]
        return StreamResult(path, report, [t for t in moved if t is not None], plan)

    def again(self, every: list) -> bool:
        """`align`'s fallback for each model aligned to the anchor, decided alike in every process
        once the models moved are merged and measured: a model closer to the anchor as given is
        merged as given, in a second pass (its distances then those before)."""
        if not self.solved or self.chosen or not self.aligning.fallback:
            return False
        for i, s in enumerate(self.solved, 1):
            before = s["sq_before"] | {p: v for done in every for p, v in done["sq_global"][i - 1].items()}
            after = {p: v for done in every for p, v in done["sq_after"][i - 1].items()}
            self.chosen.append(fallback_choice(self.aligning, before, after))
            if self.chosen[-1] is not None and self.chosen[-1]["method"] == "identity":
                self.given[i] = before
                self.transforms[i] = None
        return bool(self.given)

    def solve(self, chunks) -> tuple[list, list, dict | None]:
        """(every model's transforms, None where it stays; each aligned model's solve (transforms
        and distances before); align_many's report, None for the other modes)."""
        layout, anchor, others, options = self.layout, self.sources[0], self.sources[1:], self.aligning
        passes = Passes(self.clock, self.tick, self.team, self.plan.in_flight)
        if self.options.align == "many":  # every model moved, the first too: no distances to an anchor
            transforms, many = AlignMany(layout, self.sources, chunks, options, passes, self.plan.block_bytes).run(ManyOptions().max_iters, ManyOptions().tol)
            return transforms, [], many
        if self.from_data:  # each model to the anchor, the fallback decided there (`again` has nothing left to decide)
            solved = [ActivationMatching(layout, anchor, other, chunks, options, passes, self.batches, self.scratch, self.plan.block_bytes).run()
                      for other in others]
            for i, s in enumerate(solved, 1):
                self.chosen.append(s["chosen"])
                if s["method"] == "identity":
                    self.given[i] = s["sq_before"]
            return [None] + [None if i in self.given else s["transforms"] for i, s in enumerate(solved, 1)], solved, None
        if self.residual:  # each model's descent in turn
            solved = [ResidualDescent(layout, anchor, other, chunks, options, passes, self.plan.block_bytes).run() for other in others]
        else:
            solved = solve_transforms(layout, anchor, others, chunks, options, passes) if options is not None else []
        return [None] + ([s["transforms"] for s in solved] if solved else [None] * len(others)), solved, None

    def merged_of(self, flats, base_flat, rows=None, clock=None):
        """The merge of the models' `flats` (and the base's), on the host; `rows`: (HF name, span)
        of a row block of a tensor outside the layers."""
        clock = clock or self.clock
        if self.statistics is not None:
            return self.statistics.merged(flats, rows)
        extra = {} if base_flat is None else {"base": unflatten(base_flat)}
        if self.key is not None:
            extra["key"] = self.key
        if self.options.weights is not None:
            extra["weights"] = self.options.weights
        out = clock.timed("merge", merge_methods.merge, self.method.name, [unflatten(f) for f in flats], task_head=self.options.task_head,
                          **extra, **self.params)
        with clock.phase("transfer"):
            return jax.device_get(flatten(out))

    def merge_share(self, share, clock, turn) -> tuple[list, dict]:
        """A lane's chunks moved, merged and written: the squared distances of each aligned model
        to the anchor after alignment, and of the merge to the anchor."""
        layout, sources, transforms, solved = self.layout, self.sources, self.transforms, self.solved
        sq_after, sq_merged = [{} for _ in solved], {}
        for chunk in share:
            names = [name for layer in chunk for name in layout.layer_rules[layer]]
            # the leaves that move: the groups' members, every leaf with the residual stream
            members = [p for name in names for p in layout.rule_ours[name]] if self.residual else layout.members(chunk)
            flats = [s.leaves(names, clock) for s in sources]
            base_flat = None if self.base is None else self.base.leaves(names, clock)
            with turn:
                anchor_flat = flats[0]  # as read: the merge's distance is to the anchor as given
                for i in range(len(flats)):
                    if transforms[i] is not None:
                        flats[i] = moved_chunk(layout, chunk, flats[i], transforms[i], clock)
                    if transforms[i] is not None and solved:
                        sq_after[i - 1].update(sq_of(clock, flats[0], flats[i], members))
                        sq_after[i - 1].update({p: solved[i - 1]["sq_before"][p] for p in flats[i] if p not in members})
                merged = self.merged_of(flats, base_flat, clock=clock)
                sq_merged.update(merged_sq(anchor_flat, merged, clock))
                del anchor_flat
            del flats, base_flat  # held while written: the merged leaves only
            for name in names:
                write_tensor(self.writer, clock, name, sources[0].rules[name], merged, self.specs[name][0])
            del merged
            self.tick()
        return sq_after, sq_merged

    def write_mine(self, writer) -> dict:
        """This process's chunks (and, process 0, the tensors outside the layers) merged and
        written; the squared distances (those outside the layers before alignment apart)."""
        self.writer = writer
        sq_after, sq_merged, sq_global = [{} for _ in self.solved], {}, [{} for _ in self.solved]
        try:
            for after, merged in run_in_flight(self.mine, self.merge_share, self.clock, self.plan.in_flight):
                for i, sq in enumerate(after):
                    sq_after[i].update(sq)
                sq_merged.update(merged)
            if self.team.lead:
                self.merge_globals(sq_merged, sq_global, sq_after)
            if self.statistics is not None and self.method.name == "regmean":  # once for the chunks, as in memory
                arithmetic.warn_if_grown(self.statistics.grown)
            self.tick()
            writer.finish()
        finally:
            writer.close()
        return {"sq_after": sq_after, "sq_merged": sq_merged, "sq_global": sq_global, "timings": self.clock.report(self.start)}

    def summary(self, every: list) -> dict:
        """The report from every process's `write_mine` results (`many`: align_many's report, or None)."""
        many = self.many
        anchor, bound, solved = self.sources[0], self.layout.bound, self.solved
        sq_after = [{p: v for done in every for p, v in done["sq_after"][i].items()} for i in range(len(solved))]
        sq_merged = {p: v for done in every for p, v in done["sq_merged"].items()}
        for i, s in enumerate(solved):
            s["sq_before"].update({p: v for done in every for p, v in done["sq_global"][i].items()})
        full = bind(hf.spec_for(anchor.ck), unflatten(shape_stand_ins_of(anchor.shapes)))
        distances = []
        for i, (s, after) in enumerate(zip(solved, sq_after), 1):
            before = self.given.get(i, s["sq_before"])
            distances.append(before_after(summary_of(bound, before), summary_of(bound, before if i in self.given else after)))
            if self.chosen and self.chosen[i - 1] is not None:
                distances[-1]["chosen"] = self.chosen[i - 1]
            distances[-1]["moved"] = what_moved(bound, identity_like(bound, self.aligning) if i in self.given else self.transforms[i])
            if s.get("distance_per_sweep") is not None:  # the residual descent's, as `align` reports it
                distances[-1]["residual"] = {"distance_per_sweep": s["distance_per_sweep"]}
        alignment = many or ({"mode": "none"} if self.aligning is None else {"mode": "anchor", "distances": distances})
        report = {"alignment": alignment,
                  "merged_distance_to_anchor": summarise_distances(full, {p: sq_merged[p] for p, _ in full.shapes})["total"]}
        if self.statistics is not None:
            report["statistics"] = self.statistics.report
        report["timings"] = self.clock.report(self.start)
        report["streaming"] = dataclasses.asdict(self.plan)
        if self.team.count > 1:
            report["processes"] = {"count": self.team.count, "timings": [done["timings"] for done in every]}
        return report

    # ---- the tensors outside the layers --------------------------------------------------------------

    def merge_globals(self, sq_merged: dict, sq_before: list, sq_after: list) -> None:
        """The tensors outside the layers (never moved by the per-layer groups; by a residual
        transform, whole): small ones merged together, as `merge` does; big ones of an
        elementwise method (Fisher's and RegMean's as their statistics allow) in row blocks."""
        anchor = self.sources[0]
        # moved by the per-layer groups never; by a residual transform (align_many's too), whole
        transforms = self.transforms if self.solved or self.residual else [None] * len(self.sources)
        if self.statistics is not None:
            blockable = lambda name: self.statistics.blockable(name, anchor.rules[name].ours)  # noqa: E731
        else:
            row_blocked = merges_in_row_blocks(self.method)
            blockable = lambda name: row_blocked  # noqa: E731
        blocked = blocked_globals(self.layout, self.sources, self.plan.block_bytes, blockable)
        streams = [() if t is None or not self.layout.bound.streams_in(t) else full_streams(self.layout, s) for s, t in zip(self.sources, transforms)]
        self.merge_whole_globals([name for name in self.layout.global_rules if name not in blocked], transforms, streams,
                                 sq_merged, sq_before, sq_after)
        for name in blocked:
            self.merge_in_row_blocks(name, transforms, streams, sq_merged, sq_before, sq_after)

    def merge_whole_globals(self, whole: list, transforms: list, streams: list, sq_merged: dict, sq_before: list, sq_after: list) -> None:
        """Every model's own leaves of `whole` (heads may differ when the anchor's is kept) merged together."""
        clock, sources = self.clock, self.sources
        flats = [s.leaves([n for n in whole if n in s.rules], clock) for s in sources]
        anchor_flat = flats[0]  # as read: the merge's distance is to the anchor as given (align_many moves it too)
        for i in range(len(flats)):
            if transforms[i] is None:
                continue
            body = {p for p in flats[i] if not is_head(p) and p in flats[0]}  # not a pooler the anchor lacks
            if streams[i]:  # moved along the streams; their distances before are the descent's
                flats[i] = on_streams(streams[i], flats[i], transforms[i], clock)
                if self.solved:  # distances to the anchor (align_many reports its objective instead)
                    sq_after[i - 1].update(sq_of(clock, flats[0], flats[i], sorted(body)))
                continue
            sq = sq_of(clock, flats[0], flats[i], sorted(body))
            sq_before[i - 1].update(sq)
            sq_after[i - 1].update(sq)
        base_flat = None
        if self.base is not None:
            base_flat = self.base.leaves([n for n in whole if n in self.base.rules], clock)
            if self.options.task_head == "anchor":  # as the merge command gives the base the anchor's head
                base_flat = {**{p: x for p, x in base_flat.items() if not is_head(p)}, **{p: x for p, x in flats[0].items() if is_head(p)}}
        if whole:
            merged = self.merged_of(flats, base_flat)
            sq_merged.update(merged_sq(anchor_flat, merged, clock))
            for name in whole:
                write_tensor(self.writer, clock, name, sources[0].rules[name], merged, self.specs[name][0])

    def merge_in_row_blocks(self, name: str, transforms: list, streams: list, sq_merged: dict, sq_before: list, sq_after: list) -> None:
        """A big tensor outside the layers read, moved, merged and written a block of rows at a
        time; its distances summed on the host in float64."""
        clock, sources, anchor = self.clock, self.sources, self.sources[0]
        path = anchor.rules[name].ours[0]
        shape = anchor.hf_shape(name)
        rows = max(1, self.plan.block_bytes // (4 * max(1, math.prod(shape[1:]))))
        totals = {"merged": 0.0, **{i: 0.0 for i in range(1, len(sources))}}
        for start in range(0, shape[0], rows):
            span = (start, min(shape[0], start + rows))
            blocks = [s.tensor(name, clock, span) for s in sources]
            anchor_block = blocks[0]  # as read, for the merge's distance (align_many moves it too)
            blocks = [moved_rows(s.rules[name], stream, t, b, clock) if stream else b for b, s, t, stream in zip(blocks, sources, transforms, streams)]
            with clock.phase("distances"):
                for i in range(1, len(sources) if self.solved else 1):  # to the anchor; align_many reports its objective
                    if transforms[i] is not None and not is_head(path):
                        d = (blocks[0].astype(np.float32) - blocks[i].astype(np.float32)).astype(np.float64).ravel()
                        totals[i] += float(np.dot(d, d))
            base_block = None
            if self.base is not None:
                keep_anchor_head = self.options.task_head == "anchor" and is_head(path)
                base_block = {path: blocks[0] if keep_anchor_head else self.base.tensor(name, clock, span)}
            merged = self.merged_of([{path: b} for b in blocks], base_block, (name, span))[path]
            with clock.phase("distances"):
                d = (np.asarray(anchor_block, np.float32) - np.asarray(merged, np.float32)).astype(np.float64).ravel()
                totals["merged"] += float(np.dot(d, d))
            with clock.phase("write"):
                self.writer.write_rows(name, span[0], np.asarray(np.asarray(merged).astype(self.specs[name][0], copy=False), order="C"))
            del blocks, anchor_block, base_block, merged, d  # before the next block is read: one block's arrays at a time
        self.writer.done(name)
        sq_merged[path] = totals["merged"]
        for i in range(1, len(sources) if self.solved else 1):
            if transforms[i] is not None and not is_head(path):
                if not streams[i]:  # else moved: its distance before is the descent's
                    sq_before[i - 1][path] = totals[i]
                sq_after[i - 1][path] = totals[i]


def merged_sq(anchor_flat: Mapping, merged: Mapping, clock) -> dict:
    """{path: squared distance of the merge to the anchor}, on the host (the merge is there)."""
    with clock.phase("transfer"):
        anchor_host = jax.device_get({p: anchor_flat[p] for p in merged})
    with clock.phase("distances"):
        return {p: host_sq_dist(np.asarray(anchor_host[p]), np.asarray(merged[p])) for p in merged}
