"""`align(method="activations")` streamed: each model held whole in turn, as the statistics pass of a
streamed Fisher or RegMean merge holds it.

- The sites pass: each model loaded whole (its norm gains folded for a rotation, as the pipelines
  fold them), run on the data, its sites (`engine.activations.sites`: the groups' pseudo-leaves
  and the residual stream's reads) and its predictions spilled to disk beside the output; then
  dropped before the other is loaded.
- The solve: `driver.Solve` fed the spilled pseudo-leaves a chunk at a time, as weight matching is
  fed the weights; the residual transform from the spilled stream reads.
- The fallback (`engine.choice`), as `align` decides it: weight matching solved on the weights
  (its streamed passes), and each candidate (activation matching, weight matching, B as given)
  scored by the merged model (A + B moved) / 2, built a chunk at a time and held whole once, on
  the data: its divergence from the mean of A's and B's predictions; the weight distance where
  the models have no logits to compare. B moved by the winner is then written, as for `align`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import rotsym_jax as rj

from ..engine import activations, choice, driver
from ..engine import learned as learned_mod
from ..engine import residual as residual_mod
from ..engine.alignment import identity_like
from ..io import hf
from ..io.memory import runtime_bytes, size_text
from ..memory import release_freed_memory
from ..options import AlignOptions
from ..pytree import unflatten
from ._common import BudgetError, StreamingError
from ._descent import ResidualDescent
from ._lanes import Passes, full_streams, moved_chunk, on_streams, solve_transforms, sq_of
from ._plan import StreamPlan
from ._source import Layout, Source, shape_stand_ins_of
from ._statistics import Spill, data_tokens, forward_bytes, forward_classes

STREAM = "stream:"  # the spill's names of the residual stream's reads
TEACHER = "teacher:"  # and of the merged model's target on each batch


class _Spilled(Mapping):
    """One model's spilled arrays under a prefix, read when looked up (`residual_cross` reads them
    one reader at a time)."""

    def __init__(self, spill: Spill, i: int, prefix: str, clock):
        self.spill, self.i, self.prefix, self.clock = spill, i, prefix, clock
        self.names = sorted(n.removeprefix(prefix) for n in spill.names(i) if n.startswith(prefix))

    def __getitem__(self, name):
        return self.spill.read(self.i, self.prefix + name, self.clock)

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


class ActivationMatching:
    """One streamed activation matching of `other` to `anchor` (module docstring): `run()` gives
    {"transforms", "sq_before", "method", "chosen", "distance_per_sweep"} of the result kept."""

    def __init__(self, layout: Layout, anchor: Source, other: Source, chunks, options: AlignOptions, passes: Passes, batches: Sequence,
                 scratch: Path, block_bytes: int):
        if passes.team.count > 1:
            raise StreamingError(f"method='activations' over {passes.team.count} processes: it holds each model whole in turn, which "
                                 "the processes do not split; run it in one process")
        self.layout, self.anchor, self.other, self.options, self.passes = layout, anchor, other, options, passes
        self.clock, self.chunks, self.batches, self.scratch, self.block_bytes = passes.clock, chunks, list(batches), scratch, block_bytes
        stand_ins = [unflatten(shape_stand_ins_of(s.shapes)) for s in (anchor, other)]
        self.objective = learned_mod.merge_objective(anchor.ck, *stand_ins) if options.fallback else None

    def run(self) -> dict:
        spill = Spill(self.scratch)
        try:
            split = self._sites(spill)
            transforms = self._solve(spill)
            if not self.options.fallback:  # the method's own result; the distances before from B as read
                return {"transforms": transforms, "method": "activations", "chosen": None, "sq_before": self._score(None, spill, None)[0]}
            weights = self._weights()
            candidates = {"activations": transforms, "weights": weights["transforms"], "identity": None}
            scores = {name: self._score(t, spill, split) for name, t in candidates.items()}
        finally:
            spill.remove()
        distances = {name: choice.total_distance(sq) for name, (sq, _) in scores.items()}
        losses = {name: loss for name, (_, loss) in scores.items()} if self.objective else None
        before = distances["identity"]
        best = choice.pick(candidates, distances, losses, before)
        measure = f"{self.objective} loss of the merged model on the data" if self.objective else ""
        kept = candidates[best] if best != "identity" else identity_like(self.layout.bound, self.options)
        return {"transforms": kept, "method": best, "sq_before": scores["identity"][0],
                "chosen": choice.report("activations", best, distances, losses, measure, before),
                "distance_per_sweep": weights.get("distance_per_sweep") if best == "weights" else None}

    # ---- the sites pass ---------------------------------------------------------------------------

    def _sites(self, spill: Spill) -> list | None:
        """Each model's sites (and predictions) spilled; the batches as the scorer reads them."""
        bound, options, clock = self.layout.bound, self.options, self.clock
        split, predictions = None, None
        for i, (source, what) in enumerate(((self.anchor, "model A (the anchor)"), (self.other, "model B"))):
            with clock.phase("read"):
                ck = source.whole()
            params = ck.params
            modes = residual_mod.stream_modes(bound, options.residual, signed=False)
            rotated = [s for s in bound.streams if modes.get(s.name) == "rotation"]
            if rotated:  # as the pipelines fold them (`pipeline.folded`)
                params = rj.fold_norms(hf.spec_for(ck), params)
                residual_mod.check_rotatable(bound, params, what, rotated)
            ck = dataclasses.replace(ck, params=params)
            with clock.phase("statistics"):
                sites = activations.sites(ck, params, self.batches, bound, what, options)
                if i == 0:
                    activations.check_enough(bound, sites.tokens, options)
                values = {**sites.leaves, **{STREAM + p: x for p, x in sites.stream.items()}}
                if self.objective:
                    split = split or learned_mod.labelled_inputs(ck, self.objective, params, self.batches)
                    probabilities = [learned_mod.predictions(ck.forward(), params, x) for x, _ in split]
                    if predictions is None:
                        predictions = probabilities
                    else:  # the target, as `learned.merge_scorer` makes it
                        values.update({f"{TEACHER}{j}": learned_mod.teacher(self.objective, pa, pb)
                                       for j, (pa, pb) in enumerate(zip(predictions, probabilities))})
            spill.add(values, clock)
            del ck, params, sites, values
            release_freed_memory()
            self.passes.tick()
        return split

    # ---- the solves -------------------------------------------------------------------------------

    def _solve(self, spill: Spill) -> dict:
        """Every group's element from the spilled pseudo-leaves, a chunk at a time, and the
        residual transform from the spilled stream reads (as `alignment._solve_from_activations`)."""
        layout, clock, options = self.layout, self.clock, self.options
        run = driver.Solve(layout.bound, dataclasses.replace(options, method="activations", maps="orthogonal"), clock, blocking=True)
        for key, chunk in enumerate(self.chunks):
            members = layout.members(chunk)
            flat_a, flat_b = ({p: jnp.asarray(spill.read(i, p, clock)) for p in members} for i in (0, 1))
            run.add(layout.local_bound(chunk, self.other.shapes), layout.rename(chunk, flat_a), layout.rename(chunk, flat_b), key=key)
            del flat_a, flat_b
        transforms = run.finish()
        for stream in layout.bound.streams:
            mode = residual_mod.stream_modes(layout.bound, options.residual, signed=False).get(stream.name, "none")
            if mode == "none":
                continue
            rotation = mode == "rotation"
            cross = activations.residual_cross(stream, _Spilled(spill, 0, STREAM, clock), _Spilled(spill, 1, STREAM, clock),
                                               standardise=not rotation)
            fix_ones = rotation and residual_mod.fixes_ones(stream)
            transforms[stream.name] = residual_mod.solve_residual(jnp.asarray(cross), mode, options.polar_method, fix_ones=fix_ones)
        return transforms

    def _weights(self) -> dict:
        """Weight matching, the fallback's other closed form, on the weights (its streamed passes)."""
        options = dataclasses.replace(self.options, method="weights", maps="orthogonal")
        if options.residual != "none":
            return ResidualDescent(self.layout, self.anchor, self.other, self.chunks, options, self.passes, self.block_bytes).run()
        (solved,) = solve_transforms(self.layout, self.anchor, [self.other], self.chunks, options, self.passes)
        return solved

    # ---- the scores -------------------------------------------------------------------------------

    def _score(self, transforms: dict | None, spill: Spill, split) -> tuple[dict, float | None]:
        """(the squared distance to A of every body leaf of B moved by `transforms` (None: as
        given), the merged model's loss on the data or None): the merged model built a chunk at a
        time, as `learned.halves` makes it, and held whole for its forward passes."""
        layout, clock, anchor, other = self.layout, self.clock, self.anchor, self.other
        merged, sq = {}, {}
        streams = () if transforms is None else full_streams(layout, other)
        for chunk in self.chunks:
            names = [name for layer in chunk for name in layout.layer_rules[layer]]
            flat_a, flat_b = anchor.leaves(names, clock, device=False), other.leaves(names, clock)
            moved = flat_b if transforms is None else moved_chunk(layout, chunk, flat_b, transforms, clock)
            sq.update(sq_of(clock, flat_a, moved, list(flat_a)))
            if self.objective:
                merged.update(_halves(flat_a, moved, clock))
            del flat_a, flat_b, moved
        for name in layout.global_rules:
            flat_b = other.leaves([name], clock) if name in other.rules else {}
            flat_b = on_streams(streams, flat_b, transforms or {}, clock)
            flat_a = anchor.leaves([name], clock, device=False) if name in anchor.rules else {}
            body = [p for p in flat_b if p in flat_a and p not in layout.aside]
            sq.update(sq_of(clock, flat_a, flat_b, body))
            if self.objective:
                merged.update(_halves(flat_a, flat_b, clock))
            del flat_a, flat_b
        if not self.objective:
            return sq, None
        forward = anchor.ck.forward()
        with clock.phase("statistics"):
            params = unflatten(merged)
            losses = [learned_mod.scored_loss(forward, self.objective, params, x, y, jnp.asarray(spill.read(1, f"{TEACHER}{j}", clock)))
                      for j, (x, y) in enumerate(split)]
            loss = float(np.mean(losses))
        del merged, params
        release_freed_memory()
        self.passes.tick()
        return sq, loss


def _halves(flat_a: Mapping, flat_b: Mapping, clock) -> dict:
    """(A + B) / 2 of a chunk's leaves on the host, as `learned.merge_scorer` merges in memory."""
    with clock.phase("merge"):
        return learned_mod.flat_halves({p: np.asarray(x) for p, x in flat_a.items()}, {p: np.asarray(jax.device_get(x)) for p, x in flat_b.items()})


def with_whole_models(plan: StreamPlan, sources: Sequence[Source], layout: Layout, batches: Sequence, options: AlignOptions,
                      max_memory: int | None) -> StreamPlan:
    """`plan` with the passes that hold a model whole (`statistics_bytes`: the sites pass, each
    model as loaded, a float32 copy of it folded, its sites and one batch's forward pass; the
    scoring, the merged model whole and one batch's forward pass and target) and the sites spilled
    (`scratch_bytes`); refused where `max_memory` cannot hold them: no chunk size makes them smaller."""
    tokens = data_tokens(sources[0].ck.model_config, batches)
    peak = scratch = 0
    for s in sources:
        stored = sum(math.prod(s.hf_shape(name)) * s.stored(name).itemsize for name in s.rules)
        entries = sum(math.prod(shape) for shape in s.shapes.values())
        sites = sites_bytes(layout, s, tokens, options.residual != "none")
        target = 4 * tokens * forward_classes(s) if options.fallback else 0
        forward = forward_bytes(s, layout, batches)
        peak = max(peak, stored + 4 * entries + 2 * sites + forward + target)  # the sites' parts and their joins
        scratch += sites + target
    peak = runtime_bytes() + peak
    if max_memory is not None and peak > max_memory:
        raise BudgetError(max_memory, peak, f"what method='activations' needs streamed, about {size_text(peak, max_memory)}: "
                          "it holds one model whole at a time with its sites on the data and one batch's forward pass (fewer or "
                          "shorter examples need less); chunking the layers does not reduce it")
    return dataclasses.replace(plan, peak_bytes=max(plan.peak_bytes, peak), statistics_bytes=peak, scratch_bytes=scratch)


def sites_bytes(layout: Layout, source: Source, tokens: int, residual: bool) -> int:
    """An upper bound of one model's spilled sites (float32): every group member's pseudo-leaf
    (tokens x its widest axis) and, with the residual stream, two reads of it per layer."""
    members = sum(tokens * max(source.shapes[p]) for layer in layout.layers for p in layout.members([layer]))
    stream = 2 * len(layout.layers) * tokens * sum(s.size for s in layout.bound.streams) if residual else 0
    return 4 * (members + stream)
