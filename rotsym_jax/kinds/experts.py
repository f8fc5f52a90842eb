"""The experts kind ("experts"): a mixture of experts' block (`spec.ExpertGroup`), moved by a
permutation of its experts and one of each expert's units (`transforms.ExpertPermutation`), solved
by the exact nested search on the host (`engine/experts.py`, docs/MATH.md §5)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..engine import experts
from ..engine.report import fraction, with_layers
from ..errors import InputError
from ..options import AlignOptions
from ..spec import MIXTURE, ExpertGroup
from ..transforms import ExpertPermutation
from .base import GroupSolver, Kind

# ---- the solver: an expert assignment nested with each expert's unit assignment ---------------------


def _statistics(group, leaves_a, leaves_b, options: AlignOptions, solved=()):
    if options.ffn == "none":
        return None
    return [(experts.layer_leaves(group, leaves_a, i), experts.layer_leaves(group, leaves_b, i)) for i in range(len(group.layers))]


def _reduce(group, layers, options: AlignOptions, traced: bool):
    if layers is None:
        return None
    if traced:
        raise InputError(f"experts block {group.name!r}: matching experts is a host search (nested assignments); "
                         "call align outside jax.jit / jax.vmap / jax.grad for a mixture-of-experts model")
    solved = [experts.match_layer(a[0], a[1], b[1], a[2], a[3], b[3], routing_groups=group.routing_groups) for a, b in layers]
    return np.stack([p for p, _ in solved]), np.stack([u for _, u in solved])


def _combine(parts):
    if parts[0] is None:
        return None
    return tuple(np.concatenate([part[k] for part in parts]) for k in range(2))


def _solve(group, part, options: AlignOptions):
    return ExpertPermutation.identity(group) if part is None else ExpertPermutation(*(jnp.asarray(x) for x in part))


SOLVER = GroupSolver(
    statistics=_statistics,
    reduce=_reduce,
    combine=_combine,
    solve=_solve,
    host_reduce=True,
)


# ---- what moved (the report's `moved`) ----------------------------------------------------------------

def summary(group, t) -> dict:
    """What moved: "experts" the fraction of experts that left their slot, "units" the fraction of
    units not fixed within their expert, and "names", what its experts and units are where they
    are not a mixture's (Mamba-2's SSM heads, channels) (engine/report.py's `moved`)."""
    perm, units = np.asarray(t.perm), np.asarray(t.units)
    n, e, f = units.shape
    experts_left, left = perm != np.arange(e), units != np.arange(f)
    out = with_layers(n, experts_left.any(axis=1) | left.reshape(n, -1).any(axis=1), {"experts": fraction(experts_left), "units": fraction(left)})
    if group.names != MIXTURE:
        out["names"] = {"expert": group.names.expert, "unit": group.names.unit}
    return out


KIND = Kind(group=ExpertGroup, element=ExpertPermutation, solver=SOLVER, summary=summary)
