"""Small helpers shared by the solvers: batched matrices over their last two axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import custom_batching

from ..errors import InputError

Array = jax.Array


def check_square(M: Array, name: str = "M") -> None:
    if M.ndim < 2 or M.shape[-1] != M.shape[-2]:
        raise InputError(f"{name} must have shape (..., n, n), got {M.shape}")


def mT(x: Array) -> Array:
    return jnp.swapaxes(x, -1, -2)


def fro(x: Array) -> Array:
    """Frobenius norm over the last two axes, keeping them (shape (..., 1, 1))."""
    return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))


def norms(x: Array) -> Array:
    """Frobenius norms of a flat batch (B, n, n): shape (B,)."""
    return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1)))


def spread(s: Array, X: Array) -> Array:
    """Per-matrix values s (...) spread over a batch X (..., n, n) by one broadcast_in_dim.
    The iterations below use this, never (B, 1, 1) arrays: XLA:GPU (jax 0.11.2) rewrote such
    broadcasts inside lax.cond branches into invalid HLO (an hlo_verifier RET_CHECK)."""
    return jax.lax.broadcast_in_dim(s, X.shape, tuple(range(s.ndim)))


def spread_over_rows(v: Array, X: Array) -> Array:
    """Per-column values v (..., n) spread over X (..., m, n) (each row gets v), as `spread`."""
    return jax.lax.broadcast_in_dim(v, X.shape, tuple(range(v.ndim - 1)) + (X.ndim - 1,))


def trace_inner(R: Array, X: Array) -> Array:
    """tr(R^T X) = <R, X> over the last two axes."""
    return jnp.sum(R * X, axis=(-2, -1))


def eye_like(M: Array) -> Array:
    return jnp.broadcast_to(jnp.eye(M.shape[-1], dtype=M.dtype), M.shape)


def unbatched_at_one(fn):
    """`fn` (pytrees of arrays to a pytree of arrays) whose `vmap` over a batch of one runs `fn`'s
    own program on the one element: vmap would batch every matmul and reduction of a stack of
    one in its own order (other float32 bits) and, on a GPU, other kernels (slower). Other batch
    sizes are `vmap(fn)`. Not differentiable (as `batch_cond`): `align` holds its result constant
    under differentiation (a `custom_jvp` around it)."""
    wrapped = custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def batched(axis_size, in_batched, *args):
        if axis_size == 1:
            one = jax.tree.map(lambda x, b: x[0] if b else x, list(args), list(in_batched))
            out = jax.tree.map(lambda x: jnp.asarray(x)[None], fn(*one))  # an eager call may give Python scalars
        else:
            out = jax.vmap(fn, in_axes=tuple(jax.tree.map(lambda b: 0 if b else None, list(in_batched))), axis_size=axis_size)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return wrapped


def batch_cond(pred: Array, cheap, general, *operands):
    """`lax.cond(pred, cheap, general, *operands)` for a choice made for a whole batch: `cheap`
    gives the right answer only where `pred` holds, `general` gives it everywhere. Under `vmap`,
    `lax.cond` with a batched predicate becomes a select that runs both branches (the host
    assignment and the SVD every time); here the predicate is taken over the vmapped axis too
    (`cheap` when every element allows it, else `general` for all), so a vmapped program takes
    the branches a jitted one takes, and at N = 1 is the jitted one. `cheap` and `general` must
    take the operands explicitly (no closure over traced values)."""

    @custom_batching.custom_vmap
    def run(pred, *operands):
        return jax.lax.cond(pred, cheap, general, *operands)

    @run.def_vmap
    def batched(axis_size, in_batched, pred, *operands):
        pred_batched, *operands_batched = in_batched
        axes = tuple(jax.tree.map(lambda b: 0 if b else None, list(operands_batched)))
        every = jnp.all(pred) if pred_batched else pred
        if not any(jax.tree.leaves(operands_batched)):  # only the predicate varies: one choice, unbatched results
            out = batch_cond(every, cheap, general, *operands)
            return out, jax.tree.map(lambda _: False, out)
        out = batch_cond(every, jax.vmap(cheap, in_axes=axes, axis_size=axis_size), jax.vmap(general, in_axes=axes, axis_size=axis_size),
                         *operands)  # itself batchable: an outer vmap keeps the choice batch-wide too
        return out, jax.tree.map(lambda _: True, out)

    return run(pred, *operands)
