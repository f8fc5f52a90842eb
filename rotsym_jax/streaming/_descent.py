"""The residual descent (`engine.residual.descend`) and `align_many` over chunks read from disk."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..engine import many as many_mod
from ..engine import residual as residual_mod
from ..engine.distances import host_sq_dist, summarise_distances
from ..engine.groups import moved_by_others
from ..options import DEFAULT_BLOCK_BYTES, AlignOptions
from ..pytree import layer_chunks, leaf_signatures, signature_digest
from ._common import StreamingError, fallback_choice
from ._lanes import OrderedSum, Passes, blocked_globals, gathered, moved_chunk, moved_rows, on_streams, run_in_flight, skip_ticks, solve_transforms, sq_of
from ._source import Layout, Source


class ResidualDescent:
    """`align`'s coordinate descent over (per-layer groups, residual T) (MATH §10,
    `engine.residual.descend`), streamed: every step a pass over the chunks.

    - The first T from the leaves no group moves (one pass reading those alone).
    - Each sweep: a pass solving the groups on B moved by T (`solve_transforms`), a pass summing
      T's cross products on B moved by the groups, and a pass measuring {groups, T}; the descent
      stops when a sweep makes no progress, keeping the best, as `align` does. (Measuring in the
      next sweep's solve pass saves a read but solves the groups once more when the descent
      stops, which on the 3B-shaped pair cost more: the FFN cost products dominate.)

    The cross products are summed per layer, on the device, then over the layers on the host in
    float32 in a fixed order: the leaves outside the layers first, then layer 0, 1, ... With
    several processes each adds its layers to the sum of the layers before them, passed on from
    process to process (`Team.in_order`): the same additions in the same order as one process,
    so the same bits. A process other than the first holds its layers' (d, d) sums until its
    turn. The descent's result equals `align`'s up to the order of those float32 sums (the same
    permutations on the tests' pairs)."""

    def __init__(self, layout: Layout, anchor: Source, other: Source, chunks, options: AlignOptions, passes: Passes,
                 block_bytes: int = DEFAULT_BLOCK_BYTES):
        self.layout, self.anchor, self.other, self.options, self.passes = layout, anchor, other, options, passes
        self.clock, self.team, self.lanes, self.tick = passes.clock, passes.team, passes.lanes, passes.tick
        self.block_bytes = block_bytes
        self.chunks, self.mine = chunks, passes.team.share(chunks)
        bound = layout.bound
        if not bound.streams:
            raise StreamingError(residual_mod.NO_STREAM)
        refused = residual_mod.mode_refusal(bound.streams, options.residual)
        if refused:
            raise StreamingError(refused)
        self.streams, self.modes = bound.streams, residual_mod.stream_modes(bound, options.residual)
        self.leaf_layer = dict(bound.leaf_layers)
        # the leaves outside the layers that alignment measures: the body's, where both models have them (an LM head
        # one lacks is set aside, as in memory)
        self.globals = [name for name in layout.global_rules if name in anchor.rules and name in other.rules
                        and any(p not in layout.aside for p in other.rules[name].ours)]
        # the big ones (embeddings, LM heads) in row blocks, as the write pass takes them
        self.blocked = [n for n in blocked_globals(layout, [anchor, other], block_bytes, lambda name: True) if n in self.globals]
        self.shared = residual_mod.shared_paths(bound)
        inside = sorted(p for p in self.shared if self.leaf_layer.get(p) is not None)
        if inside:
            raise StreamingError(f"{inside[0]} is on two residual streams inside a layer: a streamed run scores such a leaf only outside the layers")

    def _blocks(self, name: str):
        """(A's rows, B's rows as our leaf) of the tensor outside the layers `name`, block by block."""
        rule = self.other.rules[name]
        shape = self.other.hf_shape(name)
        rows = max(1, self.block_bytes // (4 * max(1, math.prod(shape[1:]))))
        for start in range(0, shape[0], rows):
            span = (start, min(shape[0], start + rows))
            (a,), (b,) = (rule.to_ours(s.tensor(name, self.clock, span)) for s in (self.anchor, self.other))
            yield a, b

    def _scored(self, untouched: bool) -> dict:
        """{stream name: its scored (path, axis) lists}: one list, or two for a signed permutation."""
        bound, out = self.layout.bound, {}
        for s in self.streams:
            mode = self.modes[s.name]
            if mode == "signed_permutation":  # (M without the gains, the gains' M): `residual.signed_cross`
                out[s.name] = [residual_mod.scored_axes(bound, s, True, untouched), residual_mod.scored_axes(bound, s, False, untouched, True)]
            else:
                out[s.name] = [residual_mod.scored_axes(bound, s, mode == "rotation", untouched)]
        return out

    def _crosses(self, scored: dict, layer, flat_a: Mapping, flat_b: Mapping, streams=None) -> dict:
        """{stream name: the cross products of `layer`'s scored leaves (None: those outside the
        layers; "shared": the leaves two streams share, which `_solve` adds last)}, on the host:
        one (d, d) array each, or the pair of a signed permutation."""
        out = {}
        for stream in self.streams if streams is None else streams:
            d, parts = stream.size, []
            for pairs in scored[stream.name]:
                pairs = [(p, axis) for p, axis in pairs if p in flat_a
                         and (p in self.shared if layer == "shared" else p not in self.shared and self.leaf_layer.get(p) == layer)]
                if not pairs:
                    parts.append(np.zeros((d, d), np.float32))
                    continue
                m = residual_mod.stream_cross(tuple(flat_a[p] for p, _ in pairs), tuple(flat_b[p] for p, _ in pairs), tuple(a for _, a in pairs), d)
                parts.append(np.asarray(jax.device_get(m)))
            out[stream.name] = parts[0] if len(parts) == 1 else tuple(parts)
        return out

    def _names(self, chunk, paths: set | None) -> list:
        """The chunk's tensors holding any of `paths` (None: all)."""
        names = [name for layer in chunk for name in self.layout.layer_rules[layer]]
        return names if paths is None else [n for n in names if set(self.layout.rule_ours[n]) & paths]

    def _solve(self, crosses: dict, scored: dict, shared: tuple, t_before: dict) -> dict:
        """{stream name: T} from each stream's cross products, one stream after the other: the
        leaves it shares with others (`shared`: A's and B's, read whole) scored last, B's moved
        along the others by their latest T (`groups.moved_by_others`), as `align` solves them."""
        def cross_of(stream, mode, t):
            cross = crosses[stream.name]
            if shared[0]:
                moved = moved_by_others(self.layout.bound, stream, shared[1], t)
                cross = jax.tree.map(np.add, cross, self._crosses(scored, "shared", shared[0], moved, [stream])[stream.name])
            return tuple(jnp.asarray(c) for c in cross) if isinstance(cross, tuple) else jnp.asarray(cross)

        def solve(*args, **kwargs):
            return self.clock.timed("solve", residual_mod.solve_residual, *args, **kwargs)

        return residual_mod.solve_streams(self.layout.bound, self.modes, cross_of, self.options.polar_method, t_before, solve)

    def cross_pass(self, groups: dict | None, t_before: dict | None = None):
        """T from B moved by `groups` (None: the first T, from the leaves no group moves) and, on a
        leaf two streams share, by the others' `t_before`."""
        t_before = t_before or {}
        scored = self._scored(untouched=groups is None)
        paths = {p for lists in scored.values() for pairs in lists for p, _ in pairs}
        # the leaves two streams share, outside the layers (`__init__`): read whole by every process, scored last
        names = [n for n in self.globals if set(self.layout.rule_ours[n]) & paths & self.shared]
        shared = (self.anchor.leaves(names, self.clock), self.other.leaves(names, self.clock)) if names else ({}, {})
        paths -= self.shared
        if groups is None:
            paths |= {g for s in self._rotated() for g in s.gains}  # read to check they are uniform
        keys = (["outside"] if self.team.lead else []) + [layer for chunk in self.mine for layer in chunk]
        total = OrderedSum(keys, eager=self.team.lead)
        if self.team.lead:  # the leaves outside the layers: the small ones at once, then the big ones' row blocks
            names = [n for n in self.globals if set(self.layout.rule_ours[n]) & paths and n not in self.blocked]
            flat_a, flat_b = self.anchor.leaves(names, self.clock), self.other.leaves(names, self.clock)
            self._check_gains(flat_a, flat_b)
            outside = self._crosses(scored, None, flat_a, flat_b)
            del flat_a, flat_b
            for name in self.blocked:
                (path,) = self.layout.rule_ours[name]
                if path not in paths:
                    continue
                for a, b in self._blocks(name):
                    outside = jax.tree.map(np.add, outside, self._crosses(scored, None, {path: a}, {path: b}))
            total.add("outside", outside)

        def work(share, clock, turn):
            for chunk in share:
                names = self._names(chunk, paths if groups is None else None)
                flat_a, flat_b = self.anchor.leaves(names, clock), self.other.leaves(names, clock)
                self._check_gains(flat_a, flat_b)
                with turn:
                    moved = flat_b if groups is None else moved_chunk(self.layout, chunk, flat_b, groups, clock)
                    with clock.phase("statistics"):
                        for layer in chunk:
                            total.add(layer, self._crosses(scored, layer, flat_a, moved))
                del flat_a, flat_b, moved
                self.tick()

        run_in_flight(self.mine, work, self.clock, self.lanes)
        return self._solve(self.team.in_order(total.total), scored, shared, t_before)

    def _check_gains(self, flat_a, flat_b) -> None:
        """A rotation keeps the function only with uniform norm gains (`residual.check_rotatable`)."""
        for flat, what in ((flat_a, "A (the anchor)"), (flat_b, "B")):
            bad = [g for s in self._rotated() for g in residual_mod.nonuniform_gains(s, flat)]
            if bad:
                raise StreamingError(f"{what}: norm gains {bad[:4]} are not uniform and no layer reads them (a head tied to the embedding "
                                     "does), so a rotation of the residual stream would change the function; untie the head first (rj.untie), "
                                     "or use residual='permutation'")

    def _rotated(self) -> list:
        return [s for s in self.streams if self.modes[s.name] == "rotation"]

    def outside_sq(self, t) -> dict:
        """The squared distances of the leaves outside the layers, B's moved by `t` ({stream name:
        T}, None: as read), every process's view (process 0 measures them)."""
        def measure():
            if not self.team.lead:
                return {}
            whole = [n for n in self.globals if n not in self.blocked]
            flat_a, flat_b = self.anchor.leaves(whole, self.clock), self.other.leaves(whole, self.clock)
            moved = flat_b if t is None else on_streams(self.streams, flat_b, t, self.clock)
            sq = sq_of(self.clock, flat_a, moved, [p for p in flat_a if p not in self.layout.aside])
            for name in self.blocked:  # summed on the host in float64, as the write pass sums them
                (path,) = self.layout.rule_ours[name]
                total = 0.0
                for a, b in self._blocks(name):
                    b = b if t is None else np.asarray(on_streams(self.streams, {path: b}, t, self.clock)[path])
                    total += host_sq_dist(a, b)
                sq[path] = total
            return sq
        return {p: v for part in self.team.exchange(measure) for p, v in part.items()}

    def measure_pass(self, transforms) -> dict:
        """The squared distance of every leaf of the layers, B's moved by `transforms`."""
        def read(chunk, clock):
            names = self._names(chunk, None)
            return self.anchor.leaves(names, clock), self.other.leaves(names, clock)

        def compute(chunk, flats, clock):
            flat_a, flat_b = flats
            return sq_of(clock, flat_a, moved_chunk(self.layout, chunk, flat_b, transforms, clock), list(flat_a))

        return gathered(self.team, self.mine, self.clock, self.lanes, self.tick, read, compute)

    def solve_pass(self, t, before: bool):
        """The groups solved on B moved by `t`; with `before`, the squared distances of the
        leaves of the layers, B as read (the report's before)."""
        def prepare(chunk, flat_a, flat_b, clock):
            moved = on_streams(self.streams, flat_b, t, clock)
            return moved, (sq_of(clock, flat_a, flat_b, list(flat_a)) if before else {})

        (solved,) = solve_transforms(self.layout, self.anchor, [self.other], self.chunks, self.options, self.passes, prepare=prepare)
        return solved["transforms"], solved["sq_before"]

    def run(self) -> dict:
        """{"transforms": the best sweep's groups and T, "sq_before": every body leaf's squared
        distance before alignment, "distance_per_sweep": the distance after each sweep}."""
        before = {}

        def groups_given(t, sweep):
            groups, sq = self.solve_pass(t, before=sweep == 0)
            if sweep == 0:
                before.update({**sq, **self.outside_sq(None)})
            return groups

        def squared_distance(transforms):
            sq = {**self.measure_pass(transforms), **self.outside_sq({s.name: transforms[s.name] for s in self.streams})}
            # `align`'s sum, in float32 and in its order: `sq_dists`' (a model's leaves by layer)
            return sum(sq[p] for chunk in layer_chunks([p for p in self.anchor.shapes if p in sq]) for p in chunk)

        best, per_sweep = residual_mod.descend(lambda: self.cross_pass(None), groups_given, self.cross_pass, squared_distance,
                                               self.options.residual_sweeps)
        sq_before = before
        skip_ticks(self.tick, 3 * (self.options.residual_sweeps - len(per_sweep)) * len(self.mine))  # the sweeps it did not need
        return {"transforms": best, "sq_before": sq_before, "distance_per_sweep": per_sweep}


def summary_of(bound, sq: dict) -> dict:
    """`align`'s summary: the leaves in the order its distances come back from the device
    (JAX returns a dict's keys sorted), so the sums run in the same order."""
    return summarise_distances(bound, {p: sq[p] for p in sorted(p for p, _ in bound.shapes) if p in sq})


# ---- align_many, streamed --------------------------------------------------------------------------

class AlignMany:
    """`align_many(models, mode="mean")` (`engine.many`), streamed: the same steps, each a pass
    over the chunks reading every model.

    - The canonical order: each model's `fingerprint`, from its leaves' signatures gathered chunk
      by chunk (a tie, bitwise-equal models in practice, is broken by `content_digest`, the tied
      models read leaf by leaf).
    - The objective F and each model's distance to the mean: each leaf's squares, as
      `many.total_and_squares` computes them, gathered and added exactly (`math.fsum`), so
      their order does not matter.
    - The medoid's alignment of the others: `solve_transforms` with the medoid as the anchor.
    - Each sweep aligns each model in turn to the mean of the others as aligned (computed chunk
      by chunk, `LeaveOneOut`), then a pass measures F, and the update is kept only if F falls.
    - Every alignment keeps `align`'s fallback (`fallback_choice`): a model is kept as read where
      that is closer to its anchor than moved, measured in the pass that measures F.
    - With the residual stream, every alignment is `align`'s descent (`ResidualDescent`), in the
      sweeps against the mean of the others read as a source (`LeaveOneOut`); the leaves outside
      the layers then move too, with each model's stream.
    Each update reads every model twice (with the stream: its descent's passes, then F). The
    transforms, F and the stop equal `align_many`'s bit for bit, over any lanes and processes:
    every sum runs as in memory, per leaf (the descent's as `ResidualDescent` says)."""

    def __init__(self, layout: Layout, sources: Sequence[Source], chunks, options: AlignOptions, passes: Passes,
                 block_bytes: int = DEFAULT_BLOCK_BYTES):
        self.layout, self.sources, self.chunks, self.options, self.passes = layout, list(sources), chunks, options, passes
        self.block_bytes = block_bytes
        self.clock, self.team, self.lanes, self.tick = passes.clock, passes.team, passes.lanes, passes.tick
        self.mine = passes.team.share(chunks)
        self.globals = [name for name in layout.global_rules if all(name in s.rules for s in self.sources)
                        and any(p not in layout.aside for p in layout.rule_ours[name])]
        self.order = list(range(len(sources)))

    def _names(self, chunk) -> list:
        return [name for layer in chunk for name in self.layout.layer_rules[layer]]

    def _body(self, flat: Mapping) -> dict:
        return {p: x for p, x in flat.items() if p not in self.layout.aside}

    def _read(self, chunk, clock) -> list:
        """Every model's leaves of `chunk` (None: those outside the layers), in the canonical order."""
        names = self.globals if chunk is None else self._names(chunk)
        return [self._body(self.sources[i].leaves(names, clock)) for i in self.order]

    def _moved_all(self, chunk, flats: list, transforms, clock) -> list:
        """`flats` (canonical order) moved by their transforms (None: as read); `chunk` None: the
        leaves outside the layers, moved only by a residual transform."""
        return [flat if t is None else moved_outside(self.layout, flat, t, clock) if chunk is None else moved_chunk(self.layout, chunk, flat, t, clock)
                for flat, t in zip(flats, transforms)]

    def _per_leaf(self, compute: Callable, tick=None) -> dict:
        """{path: compute(chunk, every model's leaves, clock)[path]} over every leaf, gathered from
        the lanes and processes (process 0's leaves outside the layers too, chunk None)."""
        every = gathered(self.team, self.mine, self.clock, self.lanes, tick or self.tick, self._read, compute)
        outside = self.team.exchange(lambda: compute(None, self._read(None, self.clock), self.clock) if self.team.lead and self.globals else {})
        return {**every, **outside[0]}

    def objective(self, transforms, tick=None) -> tuple[float, list]:
        """(F, each model's squared distance to the mean), the models moved by `transforms`."""
        def compute(chunk, flats, clock):
            flats = self._moved_all(chunk, flats, transforms, clock)
            with clock.phase("distances"):
                return _squares_by_leaf(flats)

        return _objective(self._per_leaf(compute, tick), len(self.sources))

    def started(self, medoid: int, transforms: list) -> tuple[list, float]:
        """The initial alignment to the medoid with `align`'s fallback, as `align_many` calls
        `align`: each model kept as read (None) where that is closer to the medoid than moved. One
        pass measures F and the distances; a pass more measures F where a model was kept as read."""
        others = [c for c, t in enumerate(transforms) if t is not None]

        def compute(chunk, flats, clock):
            moved = self._moved_all(chunk, flats, transforms, clock)
            with clock.phase("distances"):
                out = {p: [v] for p, v in _squares_by_leaf(moved).items()}
            for c in others:
                for sq in (sq_of(clock, flats[medoid], moved[c], out), sq_of(clock, flats[medoid], flats[c], out)):
                    for p, v in sq.items():
                        out[p].append(v)
            return out

        per_leaf = self._per_leaf(compute)
        objective, _ = _objective({p: v[0] for p, v in per_leaf.items()}, len(self.sources))
        kept = list(transforms)
        for i, c in enumerate(others):
            after, before = ({p: v[1 + 2 * i + j] for p, v in per_leaf.items()} for j in (0, 1))
            if not self._keeps_moved(before, after):
                kept[c] = None
        if kept != transforms:  # a rare pass beyond the plan's, not counted in the progress
            objective, _ = self.objective(kept, tick=lambda: None)
        return kept, objective

    def updated(self, c: int, transforms: list, solved: dict) -> tuple[float, list]:
        """Model c's update in a sweep, `align`'s fallback included, in one pass: (F, the
        transforms) with c moved by `solved` or, where `align` keeps B as given (c as read closer
        to its anchor, the mean of the others as `transforms` move them, than c moved), c as read."""
        n = len(self.sources)

        def compute(chunk, flats, clock):
            current = self._moved_all(chunk, flats, transforms, clock)
            moved = self._moved_all(chunk, [flats[c]], [solved], clock)[0]
            with clock.phase("distances"):
                total, _ = many_mod.total_and_squares(current)
                anchor = many_mod.leave_one_out(total, current[c], n)
                if_moved = _squares_by_leaf(current[:c] + [moved] + current[c + 1:])
                if_read = _squares_by_leaf(current[:c] + [flats[c]] + current[c + 1:])
            after, before = sq_of(clock, anchor, moved, anchor), sq_of(clock, anchor, flats[c], anchor)
            return {p: (if_moved[p], if_read[p], after[p], before[p]) for p in if_moved}

        per_leaf = self._per_leaf(compute)
        after, before = ({p: v[j] for p, v in per_leaf.items()} for j in (2, 3))
        if self._keeps_moved(before, after):
            return _objective({p: v[0] for p, v in per_leaf.items()}, n)[0], transforms[:c] + [solved] + transforms[c + 1:]
        return _objective({p: v[1] for p, v in per_leaf.items()}, n)[0], transforms[:c] + [None] + transforms[c + 1:]

    def _keeps_moved(self, sq_before: Mapping, sq_after: Mapping) -> bool:
        """Whether `align`'s fallback keeps the model moved (its squared distances to its anchor,
        as read and moved); always with fallback=False."""
        return not self.options.fallback or fallback_choice(self.options, sq_before, sq_after)["method"] == "weights"

    def canonical_order(self) -> list:
        """`many._canonical_order`: the input indices sorted by fingerprint, ties by content."""
        def compute(chunk, flats, clock):  # read in input order (the canonical order is not known yet)
            signed = [leaf_signatures(flat) for flat in flats]
            return {p: [s[p] for s in signed] for p in signed[0]}

        signed = self._per_leaf(compute)
        prints = [signature_digest({p: per_model[i] for p, per_model in signed.items()}) for i in range(len(self.sources))]
        tied = [i for i in range(len(prints)) if prints.count(prints[i]) > 1]
        contents = dict(zip(tied, self.team.exchange(lambda: [self._content_digest(i) for i in tied] if self.team.lead else None)[0]))
        keys = [(prints[i], contents.get(i, "")) for i in range(len(prints))]
        return sorted(range(len(prints)), key=lambda i: keys[i])

    def _content_digest(self, i: int) -> str:
        """`content_digest` of model i's body, read a leaf at a time in its order."""
        source, digest = self.sources[i], hashlib.sha256()
        for path in (p for p in source.shapes if p not in self.layout.aside):
            leaf = source.leaves(source.keys_of[path], self.clock, device=False)[path]
            digest.update(f"{path}|{leaf.dtype}|{leaf.shape}|".encode())
            digest.update(np.asarray(leaf, order="C").tobytes())
        return digest.hexdigest()

    def solve(self, c: int, transforms) -> dict:
        """Model c (canonical) aligned to the mean of the others as moved by `transforms`, read as a
        source (`LeaveOneOut`): with the residual stream by `align`'s descent, else in one pass."""
        anchor, other = LeaveOneOut(self, c, transforms), self.sources[self.order[c]]
        if self.options.residual != "none":
            return ResidualDescent(self.layout, anchor, other, self.chunks, self.options, self.passes, self.block_bytes).run()["transforms"]
        (solved,) = solve_transforms(self.layout, anchor, [other], self.chunks, self.options, self.passes)
        return solved["transforms"]

    def run(self, max_iters: int, tol: float) -> tuple[list, dict]:
        """(each model's transforms, in input order: None for the medoid as it stays;
        {"mode": "many", "objective": F after the initial alignment and each sweep, "stop", "moved"})."""
        n = len(self.sources)
        self.order = self.canonical_order()
        unaligned, per_model = self.objective([None] * n)
        medoid = min(range(n), key=lambda c: per_model[c])  # the first minimum, as `align_many`
        others = [c for c in range(n) if c != medoid]
        medoid_source, moved = self.sources[self.order[medoid]], [self.sources[self.order[c]] for c in others]
        if self.options.residual != "none":  # each model's descent in turn, as `align_many` aligns them
            solved = [ResidualDescent(self.layout, medoid_source, other, self.chunks, self.options, self.passes, self.block_bytes).run()
                      for other in moved]
        else:
            solved = solve_transforms(self.layout, medoid_source, moved, self.chunks, self.options, self.passes)
        transforms = [None] * n
        for c, s in zip(others, solved):
            transforms[c] = s["transforms"]
        transforms, objective = self.started(medoid, transforms)

        def update(c):
            objective, candidate = self.updated(c, transforms, self.solve(c, transforms))

            def keep():
                transforms[:] = candidate

            return objective, keep

        objectives, report = many_mod.gauss_seidel(objective, n, update, max_iters, tol, unaligned=unaligned)
        per_update = 2 if self.options.residual == "none" else 2 + 3 * self.options.residual_sweeps  # a descent's passes, and F's
        skip_ticks(self.tick, per_update * n * (max_iters - (len(objectives) - 1)) * len(self.mine))  # the sweeps it did not need
        out = [None] * n
        for c, i in enumerate(self.order):
            out[i] = transforms[c]
        return out, {"mode": "many", "objective": objectives, "stop": report["stop"], "moved": many_mod.moved_per_model(self.layout.bound, self.options, out)}


def _squares_by_leaf(flats: list) -> dict:
    """{path: each model's squared distance to the models' mean on that leaf} (float64, host)."""
    _, squares = many_mod.total_and_squares(flats)
    squares = np.asarray(jax.device_get(squares), np.float64)
    return {p: squares[:, j] for j, p in enumerate(flats[0])}


def _objective(squares_by_leaf: Mapping, n: int) -> tuple[float, list]:
    """(F, each model's squared distance to the mean) from every leaf's squares, added exactly."""
    squares = np.stack(list(squares_by_leaf.values()))
    return math.fsum(squares.ravel()), [math.fsum(squares[:, c]) for c in range(n)]


def moved_outside(layout: Layout, flat: Mapping, transforms: dict, clock) -> dict:
    """Leaves outside the layers (bodies: no task head) moved by a residual transform, if any."""
    return on_streams(layout.bound.streams, flat, transforms, clock)


class LeaveOneOut:
    """The anchor of `align_many`'s update of model c, read as a source: the mean of the other
    models as `transforms` move them, `many.leave_one_out` of their running sum, leaf by leaf as
    `align_many` computes it in memory (each request reads every model's layers it touches). What
    `ResidualDescent` reads of an anchor: its tensors' leaves, rows of a big tensor outside the
    layers, and its rules, shapes and dtypes (float32: the mean's)."""

    def __init__(self, many: AlignMany, c: int, transforms: list):
        self.many, self.c, self.transforms = many, c, transforms
        first = many.sources[0]  # the layout's source: its rules and shapes name every tensor
        self.rules, self.shapes, self.hf_shape = first.rules, first.shapes, first.hf_shape
        self.layer_of = {name: layer for layer, names in many.layout.layer_rules.items() for name in names}

    def stored(self, key: str) -> np.dtype:
        return np.dtype(np.float32)

    def _mean(self, flats: list, clock) -> dict:
        with clock.phase("merge"):
            total, _ = many_mod.total_and_squares(flats)
            return jax.block_until_ready(many_mod.leave_one_out(total, flats[self.c], len(flats)))

    def leaves(self, keys: Sequence[str], clock) -> dict:
        layers = sorted({self.layer_of[k] for k in keys if k in self.layer_of})
        outside = [k for k in keys if k not in self.layer_of]
        out = {}
        if layers:  # the whole layers, moved as chunks move
            mean = self._mean(self.many._moved_all(layers, self.many._read(layers, clock), self.transforms, clock), clock)
            out.update(mean)
        if outside:
            flats = [self.many._body(self.many.sources[i].leaves(outside, clock)) for i in self.many.order]
            out.update(self._mean(self.many._moved_all(None, flats, self.transforms, clock), clock))
        wanted = {p for k in keys for p in self.many.layout.rule_ours[k]}
        return {p: x for p, x in out.items() if p in wanted}

    def tensor(self, key: str, clock, rows=None) -> np.ndarray:
        """Rows of a tensor outside the layers holding one leaf, in its Hugging Face layout."""
        rule = self.rules[key]
        (path,) = rule.ours
        blocks = []
        for i, t in zip(self.many.order, self.transforms):
            source = self.many.sources[i]
            block = source.tensor(key, clock, rows)
            if t is not None:
                block = moved_rows(source.rules[key], self.many.layout.bound.streams, t, block, clock)
            blocks.append({path: rule.to_ours(block)[0]})
        return np.asarray(rule.to_hf((np.asarray(self._mean(blocks, clock)[path]),)), order="C")
