"""`merge_to_disk`: the models aligned and merged, disk to disk, a chunk of layers at a time."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from .. import checks
from ..checks import is_head
from ..engine import driver
from ..engine.distances import before_after, host_sq_dist, summarise_distances
from ..errors import InputError
from ..io import hf
from ..merging import methods as merge_methods
from ..options import ALIGN_MODES, StreamOptions
from ..processes import Team
from ..pytree import flatten, unflatten
from ..spec import bind
from ..timings import Clock
from ..transforms import RESIDUAL
from ._align import StreamResult
from ._common import MANY_STOPS, StreamingError, merges_in_row_blocks, stream_options_of, streamed_method, streamed_options
from ._descent import AlignMany, ResidualDescent, summary_of
from ._lanes import blocked_globals, full_stream, moved_chunk, moved_rows, on_stream, run_in_flight, solve_transforms, sq_of, ticker, write_tensor, write_together
from ._plan import StreamPlan, check_stream_output, moved_model_count, out_specs, with_sweeps
from ._source import Layout, Source, Writer, check_same_architecture, shape_stand_ins_of
from ._statistics import Spill, StatisticsMerge, check_statistics_models, plan_merge_stream, statistics_inputs_of

# ---- merge -----------------------------------------------------------------------------------------

def plan_merge(method: str, models: Sequence, *, base=None, align: str = "anchor", dtype=None, stream: StreamOptions | Mapping | None = None,
               task_head: str = "anchor", batches=None,
               fisher_kind: str = "empirical", fisher_key=None, fisher_samples: int = 1, residual: str = "none",
               residual_sweeps: int = 8, **stream_keywords) -> StreamPlan:
    """The plan of `merge_to_disk(method, models, ...)` from the configs and headers alone (and,
    for fisher / regmean, the shapes of `batches`: the statistics pass's estimate); `residual`:
    the alignment's residual mode."""
    inputs = statistics_inputs_of(method, batches, fisher_kind, fisher_key, fisher_samples)
    sources = [Source(m, f"model {i}") for i, m in enumerate(models)] + ([] if base is None else [Source(base, "base")])
    try:
        for s in sources[1:]:
            check_same_architecture(sources[0], s)
        layout = Layout.of(sources[0], None)
        residual = residual if align == "anchor" else "none"
        plan = plan_merge_stream(sources, layout, method, stream_options_of(stream, stream_keywords), aligned=align != "none", moved=moved_model_count(align, len(models)),
                           inputs=inputs, task_head=task_head, out_dtype=dtype, processes=Team.current().count, residual=residual)
        return with_sweeps(plan, align=align, residual=residual, residual_sweeps=residual_sweeps, models=len(models))
    finally:
        for s in sources:
            s.close()


def merge_to_disk(
    method: str, models: Sequence, out, *, base=None, align: str = "anchor", align_options: Mapping | None = None,
    weights: Sequence[float] | None = None, seed: int = 0, task_head: str = "anchor", dtype=None, params: Mapping | None = None,
    stream: StreamOptions | Mapping | None = None, overwrite: bool = False, extra_files=None, progress: Callable[[int, int], None] | None = None,
    batches: Sequence[Mapping] | None = None, fisher_kind: str = "empirical", fisher_key=None, fisher_samples: int = 1, **stream_keywords,
) -> StreamResult:
    """`rotsym merge` from disk to disk a chunk of layers at a time: the models (folders; the
    first is the anchor) aligned to the anchor (align="anchor", `align_options` as `align`'s, the
    residual stream included), to one another (align="many": `align_many`'s sweeps, `AlignMany`)
    or not ("none"), merged by `method` (one of `streamed_methods()`, its options in `params`; dare
    draws from `jax.random.key(seed)`), written to `out` in the anchor's dtypes (or `dtype`).
    The weights equal `merge.merge` on the in-memory aligned models, saved by `save_hf`, bit for
    bit. report: {"alignment": as the merge command's, "merged_distance_to_anchor", "timings"}.

    fisher and regmean (`merge.STATISTICS`) need `batches`: a list of dicts of model inputs, as
    `stats.fisher` / `stats.grams` take them. Each model's statistics are computed on it as aligned
    in a statistics pass that holds one model at a time (`stats.fisher(ck, aligned, batches,
    kind=fisher_kind, key=fisher_key, samples=fisher_samples)`, or `stats.grams(ck, aligned,
    batches)`), spilled to a temporary folder beside `out` and read back chunk by chunk; the
    weights equal `merge.fisher` / `merge.regmean` (with `weights`, `params`) on the in-memory
    aligned models with those statistics, bit for bit. The report then has "statistics"."""
    start = time.perf_counter()
    team = Team.current()
    with team.together():
        return run_merge_to_disk(method, models, out, team, start, base=base, align=align, align_options=align_options, weights=weights,
                              seed=seed, task_head=task_head, dtype=dtype, params=params, stream=stream_options_of(stream, stream_keywords),
                              overwrite=overwrite, extra_files=extra_files, progress=progress, batches=batches, fisher_kind=fisher_kind, fisher_key=fisher_key,
                              fisher_samples=fisher_samples)


def run_merge_to_disk(method, models, out, team: Team, start: float, *, base, align, align_options, weights, seed, task_head, dtype, params,
                   stream: StreamOptions, overwrite, extra_files, progress, batches, fisher_kind, fisher_key, fisher_samples) -> StreamResult:
    m = streamed_method(method)
    statistics_inputs = statistics_inputs_of(method, batches, fisher_kind, fisher_key, fisher_samples)
    if statistics_inputs is not None and team.count > 1:
        raise StreamingError(f"method {method!r} over {team.count} processes: its statistics pass holds each model whole, which the "
                             "processes do not split; run it in one process")
    given = {k for k, v in (("base", base), ("weights", weights)) if v is not None} | ({"key"} if "key" in m.needs else set())
    given |= {m.statistics} if m.statistics else set()  # computed by the statistics pass
    try:
        checks.choice("align", align, ALIGN_MODES)
        params = m.bind(len(models), params, given)
        if weights is not None:
            checks.weights(weights, len(models))
    except InputError as e:
        raise StreamingError(str(e)) from None
    checks.choice("task_head", task_head, checks.TASK_HEAD)
    options = streamed_options(align_options) if align != "none" else None
    out_dtype = None if dtype is None else hf.floating_dtype(dtype)
    sources = [Source(p, f"model {i}") for i, p in enumerate(models)]
    base_source = None if base is None else Source(base, "base")
    everything = sources + ([base_source] if base_source else [])
    spill = None
    try:
        for s in everything[1:]:
            check_same_architecture(sources[0], s)
        anchor = sources[0]
        layout = Layout.of(anchor, None)
        if options is not None:
            driver.layer_masks(layout.bound, options.layers)
        if statistics_inputs is not None:
            check_statistics_models(sources, task_head, statistics_inputs)
        residual = options is not None and options.residual != "none"  # the models' leaves outside the layers move too
        plan = plan_merge_stream(everything, layout, method, stream, aligned=align != "none", moved=moved_model_count(align, len(models)),
                           inputs=statistics_inputs, task_head=task_head, out_dtype=out_dtype, processes=team.count, residual=options.residual if residual else "none")
        plan = with_sweeps(plan, align=align, residual=options.residual if residual else "none",
                            residual_sweeps=options.residual_sweeps if options is not None else 8, models=len(models))
        target = check_stream_output(out, everything, overwrite, plan.output_bytes, plan.scratch_bytes)
        team.agree("runs", {"models": [str(s.path) for s in everything], "out": str(target), "method": method, "params": params,
                            "weights": weights, "seed": seed, "task_head": task_head, "dtype": str(out_dtype), "align": align,
                            "options": None if options is None else options.as_dict(), "plan": plan})
        chunks = layout.chunks(plan.chunk_layers)
        mine = team.share(chunks)  # the chunks this process reads, merges and writes
        tick = ticker(len(mine) * (plan.passes + plan.passes_per_sweep * plan.max_sweeps) + 1 + (len(sources) if statistics_inputs is not None else 0),
                       progress)
        clock = Clock()
        key = jax.random.key(seed) if "key" in m.needs else None
        inputs = {"weights": weights} if weights is not None else {}
        many = None
        if align == "many":  # every model moved, the first too: no distances to an anchor
            transforms, many = AlignMany(layout, sources, chunks, options, clock, team, plan.in_flight, tick).run(*MANY_STOPS)
            solved = []
        else:
            if residual:  # each model's descent in turn
                solved = [ResidualDescent(layout, anchor, other, chunks, options, clock, team, plan.in_flight, plan.block_bytes, tick).run()
                          for other in sources[1:]]
            else:
                solved = solve_transforms(layout, anchor, sources[1:], chunks, options, clock, tick, team, plan.in_flight) if options is not None else []
            transforms = [None] + ([s["transforms"] for s in solved] if solved else [None] * (len(sources) - 1))
        statistics = None
        if statistics_inputs is not None:  # the statistics pass: one model at a time, spilled beside the output
            spill = Spill(target.parent)
            statistics = StatisticsMerge(statistics_inputs, spill, task_head=task_head, weights=weights, params=params, clock=clock)
            if method == "fisher":
                statistics.blocked = blocked_globals(layout, sources, plan.block_bytes, lambda name: True)
            statistics.run(sources, layout, transforms, tick)
        report = {}
        specs = out_specs(anchor, out_dtype)
        writes = [name for chunk in mine for layer in chunk for name in layout.layer_rules[layer]] + (layout.global_rules if team.lead else [])

        def merged_of(flats, base_flat, rows=None, clock=clock):
            if statistics is not None:
                return statistics.merged(flats, rows)
            nested = [unflatten(f) for f in flats]
            extra = {} if base_flat is None else {"base": unflatten(base_flat)}
            if key is not None:
                extra["key"] = key
            out = clock.timed("merge", merge_methods.merge, method, nested, task_head=task_head, **extra, **inputs, **(params or {}))
            with clock.phase("transfer"):
                return jax.device_get(flatten(out))

        def write_mine(writer) -> dict:
            """This process's chunks (and, process 0, the tensors outside the layers) merged and
            written; the squared distances (those outside the layers before alignment apart)."""
            def merge_share(share, clock, turn):
                sq_after, sq_merged = [{} for _ in solved], {}
                for chunk in share:
                    names = [name for layer in chunk for name in layout.layer_rules[layer]]
                    # the leaves that move: the groups' members, every leaf with the residual stream
                    members = [p for name in names for p in layout.rule_ours[name]] if residual else layout.members(chunk)
                    flats = [s.leaves(names, clock) for s in sources]
                    base_flat = None if base_source is None else base_source.leaves(names, clock)
                    with turn:
                        anchor_flat = flats[0]  # as read: the merge's distance is to the anchor as given
                        for i in range(len(flats)):
                            if transforms[i] is not None:
                                flats[i] = moved_chunk(layout, chunk, flats[i], transforms[i], clock)
                            if transforms[i] is not None and solved:
                                sq_after[i - 1].update(sq_of(clock, flats[0], flats[i], members))
                                sq_after[i - 1].update({p: solved[i - 1]["sq_before"][p] for p in flats[i] if p not in members})
                        merged = merged_of(flats, base_flat, clock=clock)
                        sq_merged.update(merged_sq(anchor_flat, merged, clock))
                        del anchor_flat
                    del flats, base_flat  # held while written: the merged leaves only
                    for name in names:
                        write_tensor(writer, clock, name, anchor.rules[name], merged, specs[name][0])
                    del merged
                    tick()
                return sq_after, sq_merged

            sq_after, sq_merged, sq_global = [{} for _ in solved], {}, [{} for _ in solved]
            try:
                for after, merged in run_in_flight(mine, merge_share, clock, plan.in_flight):
                    for i, sq in enumerate(after):
                        sq_after[i].update(sq)
                    sq_merged.update(merged)
                if team.lead:
                    merge_globals(layout, sources, base_source, merged_of, method, task_head, writer, specs, plan.block_bytes, clock,
                                   sq_merged, sq_global, sq_after, transforms if solved else [None] * len(sources),
                                   None if statistics is None else (lambda name: statistics.blockable(name, anchor.rules[name].ours)))
                tick()
                writer.finish()
            finally:
                writer.close()
            return {"sq_after": sq_after, "sq_merged": sq_merged, "sq_global": sq_global, "timings": clock.report(start)}

        def summarise(every):
            sq_after = [{p: v for done in every for p, v in done["sq_after"][i].items()} for i in range(len(solved))]
            sq_merged = {p: v for done in every for p, v in done["sq_merged"].items()}
            for i, s in enumerate(solved):
                s["sq_before"].update({p: v for done in every for p, v in done["sq_global"][i].items()})
            full = bind(hf.spec_for(anchor.ck), unflatten(shape_stand_ins_of(anchor.shapes)))
            alignment = many or ({"mode": "none"} if options is None else {"mode": "anchor", "distances": [
                before_after(summary_of(layout.bound, s["sq_before"]), summary_of(layout.bound, after)) for s, after in zip(solved, sq_after)]})
            report.update({"alignment": alignment,
                           "merged_distance_to_anchor": summarise_distances(full, {p: sq_merged[p] for p, _ in full.shapes})["total"]})
            if statistics is not None:
                report["statistics"] = statistics.report
            report["timings"] = clock.report(start)
            report["streaming"] = dataclasses.asdict(plan)
            if team.count > 1:
                report["processes"] = {"count": team.count, "timings": [done["timings"] for done in every]}

        path, report = write_together(
            team, anchor.ck, target, {n: d for n, (d, _) in specs.items()},
            lambda tmp, create: Writer(tmp, anchor, specs, stream.max_shard_bytes, create=create, writes=writes), write_mine, summarise,
            extra_files, report, start)
        return StreamResult(path, report, transforms if many else [t for t in transforms[1:] if t is not None], plan)
    finally:
        if spill is not None:
            spill.remove()
        for s in everything:
            s.close()


def merged_sq(anchor_flat: Mapping, merged: Mapping, clock) -> dict:
    """{path: squared distance of the merge to the anchor}, on the host (the merge is there)."""
    with clock.phase("transfer"):
        anchor_host = jax.device_get({p: anchor_flat[p] for p in merged})
    with clock.phase("distances"):
        return {p: host_sq_dist(np.asarray(anchor_host[p]), np.asarray(merged[p])) for p in merged}


def merge_globals(layout, sources, base_source, merged_of, method, task_head, writer, specs, block_bytes, clock,
                   sq_merged, sq_before, sq_after, transforms, blockable=None):
    """The tensors outside the layers (never moved by the per-layer groups; by a residual
    transform, whole): small ones merged together, as `merge` does; big ones of an elementwise
    method (`blockable`, default: `merges_in_row_blocks`) in row blocks,
    `merged_of(blocks, base, (name, rows))`."""
    anchor = sources[0]
    row_blocked = merges_in_row_blocks(merge_methods.METHODS[method])
    blocked = blocked_globals(layout, sources, block_bytes, blockable or (lambda name: row_blocked))
    streams = [None if t is None or RESIDUAL not in t else full_stream(layout, s) for s, t in zip(sources, transforms)]
    whole = [name for name in layout.global_rules if name not in blocked]
    # Whole: every model's own global leaves (heads may differ when the anchor's is kept).
    flats = [s.leaves([n for n in whole if n in s.rules], clock) for s in sources]
    for i in range(1, len(flats)):
        if transforms[i] is not None:
            body = {p for p in flats[i] if not is_head(p) and p in flats[0]}  # not a pooler the anchor lacks
            if RESIDUAL in transforms[i]:  # moved along the stream; their distances before are the descent's
                flats[i] = on_stream(streams[i], flats[i], transforms[i][RESIDUAL], clock)
                sq_after[i - 1].update(sq_of(clock, flats[0], flats[i], sorted(body)))
                continue
            sq = sq_of(clock, flats[0], flats[i], sorted(body))
            sq_before[i - 1].update(sq)
            sq_after[i - 1].update(sq)
    base_flat = None
    if base_source is not None:
        base_flat = base_source.leaves([n for n in whole if n in base_source.rules], clock)
        if task_head == "anchor":  # as the merge command gives the base the anchor's head
            base_flat = {**{p: x for p, x in base_flat.items() if not is_head(p)}, **{p: x for p, x in flats[0].items() if is_head(p)}}
    if whole:
        merged = merged_of(flats, base_flat)
        sq_merged.update(merged_sq(flats[0], merged, clock))
        for name in whole:
            write_tensor(writer, clock, name, anchor.rules[name], merged, specs[name][0])
    del flats, base_flat
    for name in blocked:
        path = anchor.rules[name].ours[0]
        shape = anchor.hf_shape(name)
        rows = max(1, block_bytes // (4 * max(1, math.prod(shape[1:]))))
        totals = {"merged": 0.0, **{i: 0.0 for i in range(1, len(sources))}}
        for start in range(0, shape[0], rows):
            span = (start, min(shape[0], start + rows))
            blocks = [s.tensor(name, clock, span) for s in sources]
            blocks = [b if stream is None else moved_rows(s.rules[name], stream, t[RESIDUAL], b, clock)
                      for b, s, t, stream in zip(blocks, sources, transforms, streams)]
            with clock.phase("distances"):
                for i in range(1, len(sources)):
                    if transforms[i] is not None and not is_head(path):
                        d = (blocks[0].astype(np.float32) - blocks[i].astype(np.float32)).astype(np.float64).ravel()
                        totals[i] += float(np.dot(d, d))
            base_block = None
            if base_source is not None:
                base_block = {path: blocks[0] if (task_head == "anchor" and is_head(path)) else base_source.tensor(name, clock, span)}
            merged = merged_of([{path: b} for b in blocks], base_block, (name, span))[path]
            with clock.phase("distances"):
                d = (np.asarray(blocks[0], np.float32) - np.asarray(merged, np.float32)).astype(np.float64).ravel()
                totals["merged"] += float(np.dot(d, d))
            with clock.phase("write"):
                writer.write_rows(name, span[0], np.ascontiguousarray(np.asarray(merged).astype(specs[name][0], copy=False)))
            del blocks, base_block, merged, d  # before the next block is read: one block's arrays at a time
        writer.done(name)
        sq_merged[path] = totals["merged"]
        for i in range(1, len(sources)):
            if transforms[i] is not None and not is_head(path):
                if RESIDUAL not in transforms[i]:  # else moved: its distance before is the descent's
                    sq_before[i - 1][path] = totals[i]
                sq_after[i - 1][path] = totals[i]
