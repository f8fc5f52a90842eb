"""The experts kind ("experts"): a mixture of experts' block (`spec.ExpertGroup`), moved by a
permutation of its experts and one of each expert's units (`transforms.ExpertPermutation`), solved
by the exact nested search on the host (`engine/experts.py`, docs/MATH.md §5)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..engine import activations, experts
from ..engine.report import fraction, with_layers
from ..errors import InputError
from ..options import AlignOptions, expert_pairs_at_once
from ..spec import MIXTURE, ExpertGroup
from ..transforms import ExpertPermutation
from .base import FIXED, ActivationSites, GroupSolver, Kind, unfused, unmixed

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


# ---- activation matching's sites (engine/activations.py) ------------------------------------------------

def _reads(group, member) -> tuple[bool, bool]:
    """The router: its logits; down (E, f, d): its input, every expert's hidden units."""
    if member.unit_axis is None:
        return True, True
    return member.unit_axis == member.axis + 1, False


def _site(group, member, path, options):
    return path + activations.OUT if member.unit_axis is None else path if member.unit_axis == member.axis + 1 else None


def _pseudo(group, member, path, x):
    """A mixture of experts' sites: the router's logits, standardised (tokens, E) where its kernel
    (d, E) is, so that two experts score by how alike they are routed; each expert's hidden units
    on every token, standardised per expert and unit, (E, f, tokens) where down's (E, f, d) is, so
    that units score by their correlation; zeros for gate and up (their expert and unit axes kept)."""
    if x is not None and member.unit_axis is None:
        return activations.standardised(x)
    if x is not None:
        z = activations.standardised(x.reshape(len(x), -1)).reshape(x.shape)  # (tokens, E, f)
        return np.asarray(np.moveaxis(z, 0, -1), order="C")
    shape = [1] * (3 if member.unit_axis is not None else 2)
    shape[member.axis] = group.num_experts
    if member.unit_axis is not None:
        shape[member.unit_axis] = group.units
    return np.zeros(tuple(shape), np.float32)


SITES = ActivationSites(check=lambda group, shapes: None, reads=_reads, site=_site, pseudo=_pseudo)


# ---- the memory model, and what it cannot solve -------------------------------------------------------

def _cost_matrices(group, per_layer: bool) -> tuple[int, int]:
    """A batch of expert pairs' unit cost matrices (`options.EXPERT_PAIR_BYTES`): its layers, and the
    blocks, are matched one after another."""
    return 0, expert_pairs_at_once(group.num_experts, group.units) * 4 * group.units ** 2


def _refusal(group, options: AlignOptions, traced: bool) -> str | None:
    """Matched on the host, from weights or activations: not learned, not inside jit / vmap."""
    if not (options.method == "learned" or traced and options.ffn != "none"):
        return None
    # named as what its experts are (Mamba-2's SSM heads)
    return (f"experts block {group.name!r}: {group.names.expert}s are matched on the host (nested assignments), from "
            "weights or activations: " + ("method='learned' does not match them yet; use method='weights' or 'activations'"
                                          if options.method == "learned"
                                          else f"call align outside jax.jit / jax.vmap / jax.grad for {group.names.block} "
                                               "(or ffn='none')"))


def said(m: dict) -> list[str]:
    """`summary` as the command line prints it."""
    expert, unit = (m["names"]["expert"], m["names"]["unit"]) if "names" in m else ("expert", "unit")
    return [f"{m['experts']:.0%} of {expert}s moved, {m['units']:.0%} of their {unit}s permuted"]


KIND = Kind(group=ExpertGroup, element=ExpertPermutation, solver=SOLVER, summary=summary, said=said, activations=SITES,
            cost_matrices=_cost_matrices, mixed=unmixed, refusal=_refusal, learned=FIXED,  # refused for learned (`_refusal`)
            fusion=unfused(lambda group: f"OT fusion does not transport experts yet (experts block {group.name!r}): align the mixture of "
                                         "experts first and merge with an elementwise method (average, ties, ...)"))
