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


@functools.partial(exact_jit, static_argnums=0)
def layer_costs(axes, leaves_a, leaves_b):
    """C[i, j] = sum over member leaves of <B unit i, A unit j> (MATH §5), float32."""
    cost = 0.0
    for axis, xa, xb in zip(axes, leaves_a, leaves_b):
        n = xa.shape[axis]
        xa = jnp.moveaxis(jnp.asarray(xa, jnp.float32), axis, 0).reshape(n, -1)
        xb = jnp.moveaxis(jnp.asarray(xb, jnp.float32), axis, 0).reshape(n, -1)
        cost = cost + jnp.matmul(xb, xa.T)
    return cost
