"""The alignment engine: one solver per group kind, one driver for every source of weights.

A `GroupSolver` says how one kind of group (`group.kind` of a bound spec: "attention",
"permutation") is solved, as four pure functions in the manner of optax's
`GradientTransformation`:

    statistics(group, leaves_a, leaves_b, options, solved)
                                                    what one chunk of layers of A and B gives
                                                    (dispatched to the device, not awaited);
                                                    `solved`: (group, its chunk's part) of each
                                                    group solved before it (`group.after`)
    reduce(group, statistics, options, traced)      the chunk's part of the answer, small enough
                                                    to hold for every layer (the FFN: its
                                                    assignments on the host; attention: the
                                                    cross products as they are)
    combine(parts)                                  the chunks' parts as one, in layer order
    solve(group, part, options)                     the group's element over all its layers
                                                    (attention: one batched solve, which the
                                                    polar iteration needs: one branch per batch)

and how the element acts on leaves is the element's own (`transforms.ELEMENTS`). `Solve` drives
them: `align` adds its in-memory params as one chunk, `streaming.align_to_disk` adds the
safetensors a planned chunk of layers at a time; both then `finish`. The same functions run in
the same order on the same arrays, so the two paths agree bit for bit. A new group kind is a new
group record in `spec`, an element in `transforms.ELEMENTS` and a solver in `SOLVERS`.

In memory (`Solve.add(..., last=True)`), a solver that reduces on the host (`host_reduce`) has
its statistics dispatched first, then every other group is solved on the device while the host
reduces: the assignments run while the device computes the attention rotations.

Two groups that hold a leaf on two axes (`spec.Member.also`: MLA's latents and the attention
block, Mamba's channels and its state and time step) are solved in order within a chunk: the
group solved first is reduced before the statistics of the groups after it (`group.after`), which
it hands its part (each layer's assignment), so every assignment runs once per layer and chunk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import ChainMap
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputError
from ..options import AlignOptions
from ..precision import is_traced
from ..solvers import assignment
from ..spec import BoundSpec
from ..timings import Clock
from ..transforms import ELEMENTS, ExpertPermutation, UnitPermutation, identity_transform
from . import activations, attention, experts, ffn
from .groups import act_on_groups


@dataclasses.dataclass(frozen=True)
class GroupSolver:
    """How one group kind is solved (see the module docstring). `host_reduce`: whether `reduce`
    is host work that the device's solves of the other groups should overlap."""

    statistics: Callable
    reduce: Callable
    combine: Callable
    solve: Callable
    host_reduce: bool = False


# ---- attention blocks: per-head rotations (or dimension permutations) and scales ------------------

def _attention_statistics(block, leaves_a, leaves_b, options: AlignOptions, solved=()):
    if options.attention == "none":
        return None
    la, lb = attention.block_leaves(leaves_a, block), attention.block_leaves(in_frame_of(block, leaves_b, solved, options), block)
    perms = attention.assign_heads(block, la, lb) if options.heads == "permute" and not block.geometry.fixed_order else None
    # a full-width QK-norm's QK scale is solved on its gains
    gains = attention.gain_terms(block, la, lb, perms) if block.geometry.qk_norm == "full" and options.rescale != "none" else None
    # a RoPE key every head shares (MLA): its rotation per rotary pair, with every head's RoPE query
    rope = attention.rope_crosses(block, la, lb, perms) if block.geometry.shared_rope_dim and options.attention == "rotation" else None
    return perms, attention.layer_crosses(block, la, lb, perms, grams=options.maps == "invertible"), gains, rope


def in_frame_of(group, leaves_b, solved, options: AlignOptions) -> Mapping:
    """B's leaves with each group solved before `group` (`solved`: (that group, its chunk's part))
    acting on the leaves the two share, on its own axis (one program per layer template): the
    statistics of `group` then compare rows that match (MLA's kv_b_proj rows, the latent's units,
    before the heads' cross products; Mamba's A_log rows, the channels, before the state's costs)."""
    if options.method == "activations":  # the pseudo-leaves are sites, which see no other group's order
        return leaves_b
    paths, moved = {p for m in group.members for p in m.paths}, {}
    for first, part in solved:
        if part is None:  # not solved (ffn="none")
            continue
        perms = part[0] if isinstance(part, tuple) else part
        held = dataclasses.replace(first, members=tuple(m for m in first.members if paths & set(m.paths)))
        moved.update(act_on_groups((held,), ChainMap(moved, leaves_b), {first.name: UnitPermutation(jnp.asarray(perms, jnp.int32))}))
    return {**leaves_b, **moved} if moved else leaves_b


def _attention_combine(parts):
    if parts[0] is None:
        return None
    perms = None if parts[0][0] is None else {k: jnp.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}
    gains = None if parts[0][2] is None else jnp.concatenate([p[2] for p in parts])
    rope = None if parts[0][3] is None else [layer for p in parts for layer in p[3]]
    return perms, [layer for p in parts for layer in p[1]], gains, rope


def _attention_solve(block, part, options: AlignOptions):
    element = ELEMENTS[block.kind].identity(block)
    if part is None:
        return element
    perms, crosses, gains, rope = part
    if options.method == "activations":
        crosses = [activations.one_sided_vo(c) for c in crosses]
    rotary, qk_norm, gated = block.geometry.rotary_dim, block.geometry.qk_norm, block.geometry.gated_output
    if options.attention == "rotation":
        out = attention.solve_crossed(crosses, rotary, perms, options.rescale, options.polar_method, qk_norm, gated)
        if options.maps == "invertible":  # from the rotations, a descent of the distance over invertible maps
            out = attention.invertible_maps(out, crosses, rotary, qk_norm, gated)
    else:
        out = {**(perms or {}), **attention.finish_dim_permutation(attention.concat_crosses(crosses), options.rescale, rotary, qk_norm, gated)}
    if gains is not None:
        out["qk_scale"] = attention.gain_scale(gains)
    if rope is not None:
        out["rope"] = attention.rope_key_rotation(jnp.concatenate(rope), block.geometry)
    return element.replace(**out)


ATTENTION = GroupSolver(
    statistics=_attention_statistics,
    reduce=lambda block, statistics, options, traced: statistics,
    combine=_attention_combine,
    solve=_attention_solve,
)


# ---- permutation groups: a linear assignment per layer -------------------------------------------

def _permutation_statistics(group, leaves_a, leaves_b, options: AlignOptions, solved=()):
    """Each layer's cost matrices; with several local devices, concrete leaves and no default
    device set (`jax.default_device`: the caller, as a streamed run's lanes, placed the work),
    layer i's on device i % D: the devices compute them at once, the host assigns each as it
    arrives."""
    if options.ffn == "none":
        return None
    devices = jax.local_devices()
    traced = is_traced(leaves_a, leaves_b)
    spread = len(devices) > 1 and not traced and jax.config.jax_default_device is None
    scaled = options.ffn == "scaled" and group.scaled
    # From activations (`activations.pseudo_leaves`), a scaled group's up kernels hold the hidden
    # units as they are, for the scales alone: the assignment's costs are the units' correlations.
    from_activations = scaled and options.method == "activations"
    # Its leaves shared with a group solved after it (a latent's readers, the heads'; Mamba's A_log, the state's) are
    # in B's frame of that group's axis: not costed. Those shared with a group solved before it: in A's, moved by it.
    costed = dataclasses.replace(group, members=tuple(m for m in group.reads if not (from_activations and m.role == "in")))
    leaves_b = in_frame_of(group, leaves_b, solved, options)
    costs = [ffn.unit_costs(costed, leaves_a, leaves_b, i, devices[i % len(devices)] if spread else None) for i in range(len(group.layers))]
    # the scales are solved after the assignment, from the scaled members' leaves (held, not copied)
    sides = ffn.scale_sides(group, leaves_a, leaves_b, ("in",) if from_activations else ("in", "out")) if scaled else None
    return costs, sides


def _permutation_reduce(group, statistics, options: AlignOptions, traced: bool):
    """The assignments: on a pool of host threads, each matrix awaited as the device delivers it
    (a matrix the device certifies optimal never leaves it); traced (inside jit / vmap), the
    stacked matrices go to the host in one `assignment.assign` callback. With unit scales, each
    unit's four sums in the assigned frame (`ffn.scale_terms`) beside the permutations."""
    if statistics is None:
        return None
    costs, sides = statistics
    if traced:
        offsets = tuple(jnp.stack(o) for o in zip(*(cost.offsets() for cost in costs)))
        perms = assignment.assign(jnp.stack([cost.scores for cost in costs]), offsets=offsets, traced_nonfinite="identity")
    else:
        solved = assignment.linear_assignments([c.scores for c in costs], offsets=[c.offsets() for c in costs])
        perms = np.stack(solved).astype(np.int32)
    return perms if sides is None else (perms, ffn.scale_terms(sides, perms))


def _permutation_combine(parts):
    if parts[0] is None or len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tuple):  # (permutations, scale terms)
        return np.concatenate([p for p, _ in parts]), tuple(jnp.concatenate(t) for t in zip(*(terms for _, terms in parts)))
    return np.concatenate(parts)


def _permutation_solve(group, part, options: AlignOptions):
    if part is None:
        return ELEMENTS[group.kind].identity(group)
    perms, terms = part if isinstance(part, tuple) else (part, None)
    # device_put: jnp.asarray of a host array compiles a copy per shape
    return UnitPermutation(jax.device_put(perms), None if terms is None else ffn.unit_scales(terms, options.method == "activations"))


PERMUTATION = GroupSolver(
    statistics=_permutation_statistics,
    reduce=_permutation_reduce,
    combine=_permutation_combine,
    solve=_permutation_solve,
    host_reduce=True,
)

# ---- mixture-of-experts blocks: an expert assignment nested with each expert's unit assignment ----------

def _experts_statistics(group, leaves_a, leaves_b, options: AlignOptions, solved=()):
    if options.ffn == "none":
        return None
    return [(experts.layer_leaves(group, leaves_a, i), experts.layer_leaves(group, leaves_b, i)) for i in range(len(group.layers))]


def _experts_reduce(group, layers, options: AlignOptions, traced: bool):
    if layers is None:
        return None
    if traced:
        raise InputError(f"experts block {group.name!r}: matching experts is a host search (nested assignments); "
                         "call align outside jax.jit / jax.vmap / jax.grad for a mixture-of-experts model")
    solved = [experts.match_layer(a[0], a[1], b[1], a[2], a[3], b[3], routing_groups=group.routing_groups) for a, b in layers]
    return np.stack([p for p, _ in solved]), np.stack([u for _, u in solved])


def _experts_combine(parts):
    if parts[0] is None:
        return None
    return tuple(np.concatenate([part[k] for part in parts]) for k in range(2))


def _experts_solve(group, part, options: AlignOptions):
    return ELEMENTS[group.kind].identity(group) if part is None else ExpertPermutation(*(jnp.asarray(x) for x in part))


EXPERTS = GroupSolver(
    statistics=_experts_statistics,
    reduce=_experts_reduce,
    combine=_experts_combine,
    solve=_experts_solve,
    host_reduce=True,
)

# The solver of each group kind.
SOLVERS: dict[str, GroupSolver] = {"attention": ATTENTION, "permutation": PERMUTATION, "experts": EXPERTS}


# ---- the driver ------------------------------------------------------------------------------------

class Solve:
    """Every group's element of B aligned to A, from chunks of layers: `add` each chunk (its
    leaves named as `bound` binds them: a chunk's own bound spec), then `finish`. Its timings go
    to `clock` ("solve", "assignment", "attention" of `TIMINGS`).

    `blocking`: each step awaited before the next (streaming: a chunk's arrays are released
    before the next is read, and the phases add up); otherwise (in memory) only the host's work
    waits for the device, and the device-solved groups' readiness is watched by a thread.
    `traced`: inside jit / vmap (nothing is read back, nothing is timed)."""

    def __init__(self, bound: BoundSpec, options: AlignOptions, clock: Clock, *, blocking: bool = False, traced: bool = False):
        self.bound, self.options, self.clock, self.blocking, self.traced = bound, options, clock, blocking, traced
        self.parts: dict[str, list] = {g.name: [] for g in bound.groups}  # [(chunk key, part)]
        self.early: dict[str, object] = {}
        self.added = 0

    def add(self, bound: BoundSpec, leaves_a: Mapping, leaves_b: Mapping, *, last: bool = False, key=None) -> None:
        """One chunk of layers. `last`: no chunk follows (in memory: the only one), so the groups
        solved on the device are dispatched before the host reduces the others. `key`: the
        chunk's place among all chunks (default: the order of the calls); `finish` combines the
        parts in key order, so chunks may come in any order, from other processes too (`adopt`)."""
        if self.traced:
            return self._add(bound, leaves_a, leaves_b, last, key)
        with self.clock.phase("solve"), contextlib.nullcontext() if self.blocking else self.clock.phase("assignment"):
            self._add(bound, leaves_a, leaves_b, last, key)

    def _add(self, bound, leaves_a, leaves_b, last, key):
        options, clock = self.options, self.clock
        key = self.added if key is None else key
        self.added += 1
        # The host's groups first: their matrices are computed while the device goes on; a group solved
        # after others (`after`: it shares leaves with them) after them.
        order = sorted(bound.groups, key=lambda g: (not SOLVERS[g.kind].host_reduce, bool(g.after)))
        groups = {g.name: g for g in bound.groups}
        statistics, reduced, t_device, compiled = {}, {}, None, 0.0

        def part(name):  # the chunk's part of a group, reduced once: kept, and handed to the groups solved after it
            if name not in reduced:
                group = groups[name]
                reduced[name] = SOLVERS[group.kind].reduce(group, statistics.pop(name), options, self.traced)
                self.parts[name].append((key, reduced[name]))
            return reduced[name]

        for group in order:
            solver = SOLVERS[group.kind]
            solved = tuple((groups[name], part(name)) for name in group.after)
            if not self.blocking:
                if t_device is None and not solver.host_reduce:  # the device groups' work starts here
                    t_device, compiled = time.perf_counter(), clock["compile"]
                statistics[group.name] = solver.statistics(group, leaves_a, leaves_b, options, solved)
            elif solver.host_reduce:  # reduced at once: its matrices are not held while the next are computed
                statistics[group.name] = clock.timed("assignment", solver.statistics, group, leaves_a, leaves_b, options, solved)
                clock.timed("assignment", part, group.name)
            else:
                statistics[group.name] = clock.timed("attention", solver.statistics, group, leaves_a, leaves_b, options, solved)
        if last and not self.blocking:
            if t_device is None:
                t_device, compiled = time.perf_counter(), clock["compile"]
            for group in order:
                if not SOLVERS[group.kind].host_reduce:
                    self._solve_early(group, statistics.pop(group.name), key)
            ready = None if self.traced else _ready_time(self.early)
        for group in order:
            if group.name in statistics:
                part(group.name)
        if last and not self.blocking and not self.traced:  # the device's seconds, its programs' compilation apart
            clock["attention"] += ready() - t_device - (clock["compile"] - compiled)

    def _solve_early(self, group, statistics, key):
        solver = SOLVERS[group.kind]
        self.parts[group.name].append((key, solver.reduce(group, statistics, self.options, self.traced)))
        self.early[group.name] = solver.solve(group, self._combined(group), self.options)
        del self.parts[group.name]

    def _combined(self, group):
        return SOLVERS[group.kind].combine([part for _, part in sorted(self.parts[group.name], key=lambda kp: kp[0])])

    def _solve(self, group):
        return SOLVERS[group.kind].solve(group, self._combined(group), self.options)

    def export(self) -> dict:
        """The parts added so far, on the host ({group name: [(key, part)]}): what `adopt` takes."""
        return jax.device_get(self.parts)

    def adopt(self, exported: list[dict]) -> None:
        """The parts of every process (each `export`ed, this one's included) in place of this
        one's: `finish` then solves every group over all the processes' chunks, from the same
        inputs in every process."""
        self.parts = {name: [kp for parts in exported for kp in parts[name]] for name in self.parts}

    def finish(self) -> dict:
        """{group name: element} over all layers, the layers outside `options.layers` identity."""
        with contextlib.nullcontext() if self.traced else self.clock.phase("solve"):
            transforms = self._finish()
        return mask_layers(transforms, identity_transform(self.bound), layer_masks(self.bound, self.options.layers))

    def _finish(self) -> dict:
        transforms = identity_transform(self.bound)
        for group in self.bound.groups:
            if group.name in self.early:
                element = self.early[group.name]
            elif not self.parts[group.name]:  # no chunk held a layer of it
                element = transforms[group.name]
            elif self.blocking:
                element = self.clock.timed("assignment" if SOLVERS[group.kind].host_reduce else "attention", self._solve, group)
            else:
                element = self._solve(group)
            transforms[group.name] = element if self.traced else jax.block_until_ready(element)
        return transforms


def _ready_time(tree):
    """A function returning when `tree`'s arrays became ready: a thread waits for them while the
    caller goes on (the host assignments), so the device's time is measured, not the host's."""
    done = []

    def wait():
        jax.block_until_ready(tree)
        done.append(time.perf_counter())

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()

    def ready():
        waiter.join()
        return done[0]

    return ready


# ---- layers ----------------------------------------------------------------------------------------

def layer_masks(bound: BoundSpec, layers) -> dict:
    """{group name: None (every layer) or a bool mask over the group's layers}; ValueError for
    layers no group has. `layers`: None or `AlignOptions.layers`."""
    if layers is None:
        return {g.name: None for g in bound.groups}
    layers = set(AlignOptions(layers=layers).layers)
    known = {l for g in bound.groups for l in g.layers}
    unknown = sorted(layers - known, key=str)
    if unknown:
        raise InputError(f"layers {unknown} do not exist; the spec's groups have layers {sorted(known, key=str)}")
    return {g.name: np.array([l in layers for l in g.layers]) for g in bound.groups}


def mask_layers(transforms: dict, identity: dict, masks: dict) -> dict:
    """`transforms` with the layers outside each mask replaced by the identity's."""
    identity = with_inverses_of(identity, transforms)
    out = {}
    for name, t in transforms.items():
        mask = masks[name]
        if mask is None:
            out[name] = t
            continue

        def pick(x, i, mask=mask):
            m = mask.reshape((-1,) + (1,) * (x.ndim - 1))
            return jnp.where(m, x, i)

        out[name] = jax.tree_util.tree_map(pick, t, identity[name])
    return out


def with_inverses_of(identity: dict, transforms: dict) -> dict:
    """The identity with the optional fields `transforms` holds (an invertible map's inverse, unit
    scales) filled in as the identity's (`matching`), so that the two trees match leaf for leaf."""
    return {name: i.matching(transforms[name]) if name in transforms else i for name, i in identity.items()}
