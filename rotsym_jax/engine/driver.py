"""The alignment engine: one driver for every source of weights, over the group kinds' solvers.

Each group kind's solver (`kinds.GroupSolver`, declared in its module under `rotsym_jax/kinds/`
and looked up here by `group.kind`: `rj.kinds.of(group).solver`) is four pure functions in the
manner of optax's `GradientTransformation`:

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

and how the element acts on leaves is the element's own (the kind's `element`). `Solve` drives
them: `align` adds its in-memory params as one chunk, `streaming.align_to_disk` adds the
safetensors a planned chunk of layers at a time; both then `finish`. The same functions run in
the same order on the same arrays, so the two paths agree bit for bit. The driver names no group
kind: a new one is a module under `rotsym_jax/kinds/` and its line in `kinds.KINDS`.

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
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from ..options import AlignOptions
from ..spec import BoundSpec
from ..timings import Clock
from ..transforms import UnitPermutation, identity_transform
from . import residual as residual_mod
from .groups import act_on_groups

# ---- a group solved before another --------------------------------------------------------------

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
        if isinstance(part, UnitPermutation):  # a latent's rotation (MATH §17): its element over the chunk's layers
            element = part
        else:
            element = UnitPermutation(jnp.asarray(part[0] if isinstance(part, tuple) else part, jnp.int32))
        held = dataclasses.replace(first, members=tuple(m for m in first.members if paths & set(m.paths)))
        moved.update(act_on_groups((held,), ChainMap(moved, leaves_b), {first.name: element}))
    return {**leaves_b, **moved} if moved else leaves_b



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
        order = sorted(bound.groups, key=lambda g: (not rj.kinds.of(g).solver.host_reduce, bool(g.after)))
        groups = {g.name: g for g in bound.groups}
        statistics, reduced, t_device, compiled = {}, {}, None, 0.0

        def part(name):  # the chunk's part of a group, reduced once: kept, and handed to the groups solved after it
            if name not in reduced:
                group = groups[name]
                reduced[name] = rj.kinds.of(group).solver.reduce(group, statistics.pop(name), options, self.traced)
                self.parts[name].append((key, reduced[name]))
            return reduced[name]

        for group in order:
            solver = rj.kinds.of(group).solver
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
                if not rj.kinds.of(group).solver.host_reduce:
                    self._solve_early(group, statistics.pop(group.name), key)
            ready = None if self.traced else _ready_time(self.early)
        for group in order:
            if group.name in statistics:
                part(group.name)
        if last and not self.blocking and not self.traced:  # the device's seconds, its programs' compilation apart
            clock["attention"] += ready() - t_device - (clock["compile"] - compiled)

    def _solve_early(self, group, statistics, key):
        solver = rj.kinds.of(group).solver
        self.parts[group.name].append((key, solver.reduce(group, statistics, self.options, self.traced)))
        self.early[group.name] = solver.solve(group, self._combined(group), self.options)
        del self.parts[group.name]

    def _combined(self, group):
        return rj.kinds.of(group).solver.combine([part for _, part in sorted(self.parts[group.name], key=lambda kp: kp[0])])

    def _solve(self, group):
        return rj.kinds.of(group).solver.solve(group, self._combined(group), self.options)

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
                element = self.clock.timed("assignment" if rj.kinds.of(group).solver.host_reduce else "attention", self._solve, group)
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


# ---- what the model's record settles -----------------------------------------------------------------

def settled(bound: BoundSpec, residual: str, method: str, ffn: str) -> dict | None:
    """report["settled"]'s parts that the model's record decides, the same for every path (align in
    memory and streamed, merges): each stream's group where `residual` is a ceiling
    (`residual.settled_streams`), and ffn="scaled" on a model without a gated FFN group, whose units
    are then permuted alone. None: as asked."""
    out = dict(residual_mod.settled_streams(bound, residual, signed=method == "weights") or {})
    if ffn == "scaled" and not any(g.scaled for g in bound.perms):
        out.update(ffn="permutation", ffn_why="no gated FFN group (a unit's scale passes only a gate's product, MATH §1): its units "
                                              "are permuted alone")
    return out or None


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
