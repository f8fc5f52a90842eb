"""Permutation groups' cost matrices (MATH.md §5), internal to `align`: one float32 matrix per
layer, dispatched to the device so the host can assign layer l while the device computes the next.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from .precision import exact_jit


def unit_costs(group, flat_a, flat_b, i):
    """The cost matrix of layer i of a permutation group (dispatched, not awaited)."""
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
    return layer_costs(tuple(axes), tuple(leaves_a), tuple(leaves_b))


def layer_costs(axes, leaves_a, leaves_b):
    """C[i, j] = sum over member leaves of <B unit i, A unit j> (MATH §5), float32.

    A program per member, summed in member order: one program for all of them holds every
    member's float32 copies at once (Llama-3.2-3B FFN layer, bf16: 1.13 GiB above the leaves, 0.73
    GiB this way, same bits), the peak of a streamed alignment."""
    cost = None
    for axis, xa, xb in zip(axes, leaves_a, leaves_b):
        term = member_costs(axis, xa, xb)
        cost = term if cost is None else cost + term
    return cost


@functools.partial(exact_jit, static_argnums=0)
def member_costs(axis, xa, xb):
    """One member's part of `layer_costs`: <B unit i, A unit j> over the leaf's other axes."""
    n = xa.shape[axis]
    xa = jnp.moveaxis(jnp.asarray(xa, jnp.float32), axis, 0).reshape(n, -1)
    xb = jnp.moveaxis(jnp.asarray(xb, jnp.float32), axis, 0).reshape(n, -1)
    return jnp.matmul(xb, xa.T)
