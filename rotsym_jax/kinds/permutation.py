"""The permutation kind ("permutation"): a permutation group's units (`spec.PermGroup`: an FFN's
hidden units, Mamba's channels, MLA's latents), moved by a permutation per layer and, for a gated
FFN, each unit's positive scale (`transforms.UnitPermutation`), solved by a linear assignment per
layer on the host (`engine/ffn.py`, `solvers/assignment.py`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..engine import ffn
from ..engine.driver import in_frame_of
from ..engine.report import MOVED_TOL, fraction, unmoved, value_range, with_layers
from ..options import AlignOptions
from ..precision import is_traced
from ..solvers import assignment
from ..spec import PermGroup
from ..transforms import UnitPermutation
from .base import GroupSolver, Kind

# ---- the solver: a linear assignment per layer ---------------------------------------------------------


def _statistics(group, leaves_a, leaves_b, options: AlignOptions, solved=()):
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


def _reduce(group, statistics, options: AlignOptions, traced: bool):
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


def _combine(parts):
    if parts[0] is None or len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tuple):  # (permutations, scale terms)
        return np.concatenate([p for p, _ in parts]), tuple(jnp.concatenate(t) for t in zip(*(terms for _, terms in parts)))
    return np.concatenate(parts)


def _solve(group, part, options: AlignOptions):
    if part is None:
        return UnitPermutation.identity(group)
    perms, terms = part if isinstance(part, tuple) else (part, None)
    # device_put: jnp.asarray of a host array compiles a copy per shape
    return UnitPermutation(jax.device_put(perms), None if terms is None else ffn.unit_scales(terms, options.method == "activations"))


SOLVER = GroupSolver(
    statistics=_statistics,
    reduce=_reduce,
    combine=_combine,
    solve=_solve,
    host_reduce=True,
)


# ---- what moved (the report's `moved`) ----------------------------------------------------------------

def summary(group, t) -> dict:
    """What moved: "units" the fraction of units not fixed, "scale" the units' [min, max] where
    their scales are solved (engine/report.py's `moved`)."""
    perm = np.asarray(t.perm)
    n, size = perm.shape
    left = perm != np.arange(size)
    layer = left.any(axis=1)
    out = {"units": fraction(left)}
    if t.scale is not None:
        scale = unmoved(np.asarray(t.scale, np.float64), 1.0)
        layer = layer | (np.abs(scale - 1).max(axis=1, initial=0) > MOVED_TOL)
        out["scale"] = value_range(scale)
    return with_layers(n, layer, out)


KIND = Kind(group=PermGroup, element=UnitPermutation, solver=SOLVER, summary=summary)
