"""Permutation groups' cost matrices (MATH.md §5), internal to `align`: one float32 matrix per
layer, dispatched to the device so the host can assign layer l while the device computes the next,
with the squared norms of the units, the offsets that let `assignment.certified_assignment` prove a
matching optimal on the device (then the matrix never goes to the host).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..precision import exact_jit
from ..solvers.rescale import rescale_sequential


class LayerCosts(NamedTuple):
    """One layer's `scores[i, j] = <B unit i, A unit j>` and half the squared unit norms, summed
    over the group's member leaves (float32)."""

    scores: jax.Array
    half_sq_norms_b: jax.Array
    half_sq_norms_a: jax.Array

    def offsets(self) -> tuple[jax.Array, jax.Array]:
        """`assignment.certified_assignment`'s offsets: scores minus them are `-||B_i - A_j||^2 / 2`."""
        return self.half_sq_norms_b, self.half_sq_norms_a


def unit_costs(group, flat_a, flat_b, i, device=None) -> LayerCosts:
    """The costs of layer i of a permutation group (dispatched, not awaited), computed on
    `device` (None: where the leaves are)."""
    axes, leaves_a, leaves_b = [], [], []
    for m in group.members:
        if m.layer_axis is None:
            axes.append(m.axis)
            leaves_a.append(flat_a[m.paths[i]])
            leaves_b.append(flat_b[m.paths[i]])
        else:  # a scanned stack: take layer i
            axes.append(m.axis - (m.axis > m.layer_axis))
            leaves_a.append(jnp.take(flat_a[m.paths[0]], i, axis=m.layer_axis))
            leaves_b.append(jnp.take(flat_b[m.paths[0]], i, axis=m.layer_axis))
    if device is not None:
        leaves_a, leaves_b = jax.device_put((leaves_a, leaves_b), device)
    return layer_costs(tuple(axes), tuple(leaves_a), tuple(leaves_b))


def layer_costs(axes, leaves_a, leaves_b) -> LayerCosts:
    """C[i, j] = sum over member leaves of <B unit i, A unit j> (MATH §5), float32, and half the
    squared unit norms.

    A program per member, each adding its part to the sum so far, in member order: one program
    for all of them holds every member's float32 copies at once (Llama-3.2-3B FFN layer, bf16:
    1.13 GiB above the leaves, 0.73 GiB this way, same bits), the peak of a streamed alignment."""
    total = None
    for axis, xa, xb in zip(axes, leaves_a, leaves_b):
        total = member_costs(axis, xa, xb, total)
    return total


@functools.partial(exact_jit, static_argnums=0)
def member_costs(axis, xa, xb, total=None) -> LayerCosts:
    """One member's part of `layer_costs`, added to `total` (None: the first member):
    <B unit i, A unit j> over the leaf's other axes, and half the squared unit norms (halving
    is exact, so the halves sum to half the sum)."""
    n = xa.shape[axis]
    xa, xb = jnp.asarray(xa, jnp.float32), jnp.asarray(xb, jnp.float32)
    others = tuple(k for k in range(xa.ndim) if k != axis)  # the norms read the leaves as stored
    half_a, half_b = jnp.sum(xa * xa, axis=others) / 2, jnp.sum(xb * xb, axis=others) / 2
    xa = jnp.moveaxis(xa, axis, 0).reshape(n, -1)
    xb = jnp.moveaxis(xb, axis, 0).reshape(n, -1)
    term = LayerCosts(jnp.matmul(xb, xa.T), half_b, half_a)
    return term if total is None else LayerCosts(*(t + u for t, u in zip(total, term)))


# ---- a gated unit's scale (MATH §1): up times s, down divided by s, after the permutation ----------

def scale_sides(group, flat_a, flat_b, roles=("in", "out")) -> tuple:
    """The leaves the unit scales act on, per layer: ((role, axis, leaf of A, leaf of B) of each
    member of `roles`, NAME.in and NAME.out), the leaves held as they are (a scanned stack's layer
    taken)."""
    layers = []
    for i in range(len(group.layers)):
        layer = []
        for m in group.members:
            if m.role not in roles:
                continue
            if m.layer_axis is None:
                layer.append((m.role, m.axis, flat_a[m.paths[i]], flat_b[m.paths[i]]))
            else:
                axis = m.axis - (m.axis > m.layer_axis)
                layer.append((m.role, axis, jnp.take(flat_a[m.paths[0]], i, axis=m.layer_axis), jnp.take(flat_b[m.paths[0]], i, axis=m.layer_axis)))
        layers.append(tuple(layer))
    return tuple(layers)


def scale_terms(sides, perms) -> tuple:
    """Each unit's sums in the assigned frame, (L, n) each: ||in_B||^2, <in_B, in_A>, ||in_A||^2,
    then the same of out, over the layer's NAME.in (NAME.out) leaves, B's unit perm[l, j] against
    A's unit j (float32)."""
    perms = jnp.asarray(perms)
    rows = []
    for i, layer in enumerate(sides):
        sums = {"in": None, "out": None}
        for role, axis, xa, xb in layer:
            sums[role] = _member_terms(axis, xa, xb, perms[i], sums[role])
        none = (jnp.zeros(perms.shape[1:], jnp.float32),) * 3  # a side left out (from activations: down's)
        rows.append((*(sums["in"] or none), *(sums["out"] or none)))
    return tuple(jnp.stack(column) for column in zip(*rows))


@functools.partial(exact_jit, static_argnums=0)
def _member_terms(axis, xa, xb, perm, total=None):
    xa, xb = jnp.asarray(xa, jnp.float32), jnp.asarray(xb, jnp.float32)
    xa = jnp.moveaxis(xa, axis, -1).reshape(-1, xa.shape[axis])
    xb = jnp.take(jnp.moveaxis(xb, axis, -1).reshape(-1, xb.shape[axis]), perm, axis=1)
    terms = (jnp.sum(xb * xb, axis=0), jnp.sum(xb * xa, axis=0), jnp.sum(xa * xa, axis=0))
    return terms if total is None else tuple(t + u for t, u in zip(total, terms))


@functools.partial(exact_jit, static_argnums=1)
def unit_scales(terms, from_activations: bool = False):
    """Each unit's scale s > 0 from `scale_terms`. From weights, the best s for
    ||s in_B - in_A||^2 + ||out_B / s - out_A||^2: the quartic of the head scales
    (`rescale_sequential`), a unit's up row in the role of q and its down column in k's. From
    activations (the in side holds the hidden units h, which move as s h), the best s for
    ||sqrt(s) h_B - h_A / sqrt(s)||^2, the two models meeting halfway: ||h_A|| / ||h_B||, which a
    weak correlation never shrinks (the least-squares <h_A, h_B> / ||h_B||^2 would, blowing up the
    down rows by 1 / s; MATH §5)."""
    bb_in, ba_in, aa_in, bb_out, ba_out, _ = terms
    if from_activations:
        ok = (bb_in > 0) & (aa_in > 0)
        return jnp.where(ok, jnp.sqrt(jnp.where(ok, aa_in, 1) / jnp.where(ok, bb_in, 1)), 1.0)
    return rescale_sequential(bb_in, ba_in, bb_out, ba_out)
