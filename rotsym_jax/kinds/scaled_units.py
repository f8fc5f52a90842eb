"""The scaled-units kind ("scaled_units"): a gated FFN's hidden units (`spec.ScaledUnits`: SwiGLU,
GeGLU, and units gated as they are, LFM2's convolutions' channels), moved by a permutation per
layer and then each unit's positive scale s, its up rows (NAME.in) times s and its down columns
(NAME.out) divided by s (`transforms.UnitPermutation` with `scale`; MATH §1). The gate passes
s up(x) * act(gate(x)) = s h, which down's columns divided by s undo.

The scales do not commute with the permutation of the same units (a scale belongs to a unit's new
slot), so the two are one element, composed and inverted as one; the permutation is solved first
(`kinds/permutation.py`'s assignment, on the same cost matrices), the scales after it, in the
assigned frame, only with ffn="scaled" (the paper's element is the permutation alone):

    weights        the best s of ||s up_B - up_A||^2 + ||down_B / s - down_A||^2 per unit (the
                   quartic of the head scales, `solvers.rescale`)
    activations    ||h_A|| / ||h_B|| of the hidden units on the data (`engine/ffn.unit_scales`)
    learned        log-scales beside the straight-through permutation, t0's scale times exp(log s)
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap

import jax.numpy as jnp
import numpy as np

from ..engine import ffn
from ..engine.groups import act_on_groups
from ..options import AlignOptions
from ..spec import ScaledUnits
from ..transforms import UnitPermutation
from . import permutation
from .base import GroupSolver, Kind, Learned, unmixed

# ---- the solver: the assignment, then the scales in its frame -------------------------------------------


def _scales_solved(options: AlignOptions) -> bool:
    return options.ffn == "scaled"


def _statistics(group, leaves_a, leaves_b, options: AlignOptions, solved=()):
    """The permutation's cost matrices and, with ffn="scaled", the leaves the scales act on (held,
    not copied). From activations (`SITES`), the up kernels hold the hidden units as they are, for
    the scales alone: the assignment's costs are the units' correlations, without them."""
    if options.ffn == "none":
        return None
    from_activations = options.method == "activations" and _scales_solved(options)
    costed = tuple(m for m in group.reads if not (from_activations and m.role == "in"))
    costs = permutation.layer_costs(group, costed, leaves_a, leaves_b, options, solved)
    sides = ffn.scale_sides(group, leaves_a, leaves_b, ("in",) if from_activations else ("in", "out")) if _scales_solved(options) else None
    return costs, sides


def _reduce(group, statistics, options: AlignOptions, traced: bool):
    """The assignments (host), and with the scales each unit's four sums in the assigned frame
    (`ffn.scale_terms`)."""
    if statistics is None:
        return None
    costs, sides = statistics
    perms = permutation.assign(costs, traced)
    return perms if sides is None else (perms, ffn.scale_terms(sides, perms))


def _combine(parts):
    if parts[0] is None or len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tuple):  # (permutations, scale terms)
        return np.concatenate([p for p, _ in parts]), tuple(jnp.concatenate(t) for t in zip(*(terms for _, terms in parts)))
    return np.concatenate(parts)


def _solve(group, part, options: AlignOptions):
    if not isinstance(part, tuple):
        return permutation.SOLVER.solve(group, part, options)
    perms, terms = part
    return permutation.SOLVER.solve(group, perms, options).replace(scale=ffn.unit_scales(terms, options.method == "activations"))


SOLVER = GroupSolver(statistics=_statistics, reduce=_reduce, combine=_combine, solve=_solve, host_reduce=True)


# ---- activation matching's sites: a unit's scale multiplies the hidden unit as it is ------------------------

def _site(group, member, path, options):
    """With the scales solved, a gated unit's up kernel reads its layer's hidden units, down's
    input, kept as they are (`engine/activations.pseudo_leaves`): the terms of the scale, which
    the assignment's costs leave out."""
    if member.role != "in":
        return permutation.site(group, member, path, options)
    down = next(m for m in group.members if m.role == "out")
    return down.paths[member.paths.index(path)] if _scales_solved(options) and path.endswith("/kernel") and down.axis == 0 else None


def _pseudo(group, member, path, x):
    """An up kernel's: the hidden units as they are, (tokens, units), which a unit's scale multiplies."""
    return np.array(x, np.float32) if member.role == "in" and x is not None else permutation.pseudo(group, member, path, x)


SITES = dataclasses.replace(permutation.SITES, site=_site, pseudo=_pseudo)


# ---- learned alignment: log-scales beside the straight-through permutation ------------------------------

def _initial(group, t0, frame, options: AlignOptions):
    """The permutation's free copy (in the frame before the scales: `_frame`), and with
    ffn="scaled" zero log-scales."""
    params = permutation.LEARNED.initial(group, t0, frame, options)
    if params is not None and _scales_solved(options):
        params["log_scale"] = jnp.zeros((len(group.layers), group.size), jnp.float32)
    return params


def _element(group, t0, params, projected):
    scale = t0.scale
    if "log_scale" in params:
        scale = jnp.exp(params["log_scale"]) if scale is None else scale * jnp.exp(params["log_scale"])
    return UnitPermutation(projected, scale)


def _frame(t):
    """The permutation alone: the scales act after the straight-through copies, so that their
    gradients flow."""
    return t if t.scale is None else t.replace(scale=None)


def _straight_through(group, params, t, flat) -> dict:
    out = permutation.LEARNED.straight_through(group, params, t, flat)
    if t.scale is None:
        return out
    scales = UnitPermutation.identity(group).replace(scale=t.scale)
    return {**out, **act_on_groups((group,), ChainMap(out, flat), {group.name: scales})}


LEARNED = Learned(initial=_initial, project=permutation.LEARNED.project, element=_element, frame=_frame,
                  straight_through=_straight_through)


KIND = Kind(group=ScaledUnits, element=UnitPermutation, solver=SOLVER, summary=permutation.summary, said=permutation.said,
            activations=SITES, cost_matrices=permutation.cost_matrices, mixed=unmixed,
            refusal=permutation.refusal, learned=LEARNED,
            fusion=permutation.FUSION)  # (the plans transport units; a soft plan blends their scales with them)
