"""Mixture-of-experts blocks (MATH §5), internal to `align`: B's experts matched to A's by an
E x E assignment whose score for (A's expert a, B's expert b) is the overlap of b's units with
a's under b's best unit permutation (an inner assignment, as an FFN layer's) plus the overlap of
what moves with an expert but has no units (its router row); each matched expert's units are that
inner assignment's.

Exact without all E² inner assignments: each pair's inner optimum is bounded above by its units'
best partners (by rows and by columns, on the device); the outer assignment is solved on the
bounds where the exact value is unknown, and the pairs it picks that hold only a bound are solved
exactly; once it picks exact pairs alone it is optimal, since every other assignment's value is at
most its sum of bounds, which is at most this one's. Two models whose experts correspond solve
about E inner assignments (each maybe certified on the device, `assignment.certified_assignment`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..options import expert_pairs_at_once
from ..precision import exact_jit
from ..solvers import assignment
from .ffn import LayerCosts


def layer_leaves(group, flat, i) -> tuple:
    """Layer i of an experts block: ((expert axis, unit axis) of each expert member, their leaves),
    and (expert axis, leaf) of the members without units (the router)."""
    experts = [((m.axis, m.unit_axis), flat[m.paths[i]]) for m in group.members if m.unit_axis is not None]
    router = [(m.axis, flat[m.paths[i]]) for m in group.members if m.unit_axis is None]
    return tuple(a for a, _ in experts), tuple(x for _, x in experts), tuple(a for a, _ in router), tuple(x for _, x in router)


def _units(x, axes, e):
    """Expert e's (units, rest) rows of an expert leaf, in float32."""
    e_axis, u_axis = axes
    x = jax.lax.dynamic_index_in_dim(x, e, e_axis, keepdims=False)
    x = jnp.moveaxis(x.astype(jnp.float32), u_axis - (u_axis > e_axis), 0)
    return x.reshape(x.shape[0], -1)


@functools.partial(exact_jit, static_argnums=0)
def pair_costs(axes, leaves_a, leaves_b, a, b) -> LayerCosts:
    """`scores[i, j] = <unit i of B's expert b, unit j of A's expert a>` summed over the members,
    and half the squared unit norms: an FFN layer's costs (`ffn.layer_costs`) for one pair."""
    total = None
    for member_axes, xa, xb in zip(axes, leaves_a, leaves_b):
        ua, ub = _units(xa, member_axes, a), _units(xb, member_axes, b)
        term = LayerCosts(ub @ ua.T, jnp.sum(ub * ub, axis=1) / 2, jnp.sum(ua * ua, axis=1) / 2)
        total = term if total is None else LayerCosts(*(t + u for t, u in zip(total, term)))
    return total


@functools.partial(exact_jit, static_argnums=0)
def _bounds(axes, leaves_a, leaves_b, a_s, b_s):
    """Upper bounds of the inner optimum of the pairs (a_s[k], b_s[k]): no permutation gives more
    than each unit's best partner, counted by rows or by columns."""
    def bound(a, b):
        s = pair_costs(axes, leaves_a, leaves_b, a, b).scores
        return jnp.minimum(jnp.sum(jnp.max(s, axis=1)), jnp.sum(jnp.max(s, axis=0)))

    return jax.vmap(bound)(a_s, b_s)


def _pairs(pairs) -> tuple[jax.Array, jax.Array]:
    """[(a, b), ...] as the two index arrays `_bounds` maps over."""
    index = np.asarray(pairs, np.int32).reshape(-1, 2)
    return jnp.asarray(index[:, 0]), jnp.asarray(index[:, 1])


@functools.partial(exact_jit, static_argnums=0)
def _router_scores(axes, leaves_a, leaves_b):
    """[a, b] = <what moves with B's expert b, what moves with A's expert a> (the router's rows)."""
    total = 0.0
    for axis, xa, xb in zip(axes, leaves_a, leaves_b):
        ra = jnp.moveaxis(xa.astype(jnp.float32), axis, 0).reshape(xa.shape[axis], -1)
        rb = jnp.moveaxis(xb.astype(jnp.float32), axis, 0).reshape(xb.shape[axis], -1)
        total = total + ra @ rb.T
    return total


def match_layer(axes, leaves_a, leaves_b, router_axes, router_a, router_b, routing_groups: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (perm (E,), units (E, f)): new expert e of B is its old expert perm[e], whose
    unit units[e, j] becomes unit j; maximising the summed scores exactly (module docstring).
    `routing_groups`: experts pair only within the same block of E / routing_groups consecutive
    experts (a group-limited router's groups)."""
    from scipy.optimize import linear_sum_assignment  # imported where experts are matched: 0.3 s every other command would pay

    e_axis, u_axis = axes[0]
    num, units = leaves_a[0].shape[e_axis], leaves_a[0].shape[u_axis]
    router = np.asarray(jax.device_get(_router_scores(router_axes, router_a, router_b)), np.float64)
    chunk = expert_pairs_at_once(num, units)
    block = num // routing_groups
    every = [(a, b) for a in range(num) for b in range(num) if a // block == b // block]
    bound = np.full((num, num), -np.inf)  # pairs across routing groups are never picked
    bound[tuple(np.asarray(every).T)] = np.concatenate([np.asarray(jax.device_get(_bounds(axes, leaves_a, leaves_b, *_pairs(every[k:k + chunk]))))
                                                        for k in range(0, len(every), chunk)])
    exact, inner = {}, {}
    while True:
        value = bound.copy()
        for (a, b), v in exact.items():
            value[a, b] = v
        rows, cols = linear_sum_assignment(value + router, maximize=True)
        todo = [(int(a), int(b)) for a, b in zip(rows, cols) if (a, b) not in exact]
        if not todo:
            break
        for start in range(0, len(todo), chunk):  # at most `chunk` matrices held at once
            batch = todo[start:start + chunk]
            costs = [pair_costs(axes, leaves_a, leaves_b, jnp.int32(a), jnp.int32(b)) for a, b in batch]
            perms = assignment.linear_assignments([c.scores for c in costs], offsets=[c.offsets() for c in costs])
            # each pair's objective under its assignment, summed on the device, read back at once
            values = jax.device_get([jnp.sum(jnp.take_along_axis(c.scores, jnp.asarray(p)[None, :], axis=0)) for c, p in zip(costs, perms)])
            del costs
            for pair, p, v in zip(batch, perms, values):
                inner[pair], exact[pair] = p, float(v)
    perm = np.asarray(cols, np.int32)  # rows are 0..E-1 in order
    return perm, np.stack([inner[a, int(b)] for a, b in enumerate(perm)]).astype(np.int32)
