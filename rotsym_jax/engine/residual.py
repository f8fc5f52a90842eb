"""The residual stream's symmetry (MATH.md §10): one basis change T of the model width, applied to
every leaf that reads from or writes to the stream.

LayerNorm subtracts the mean and divides by the standard deviation of the width's coordinates:
both are invariant under a permutation of them, not under a general rotation, so LayerNorm
families (BERT/RoBERTa, ViT, GPT-2) get permutations. RMSNorm divides by the root mean square,
which every orthogonal T preserves; its gain g does not commute with T unless it is uniform, so
`fold_norms` first moves each gain into the input rows of the linear layers that read the norm
(diag(g) W), after which Llama-style models get any orthogonal T.

Each family's record (`rotsym_jax.models.family`) declares the axis of every leaf that carries the
width, and the readers of each RMSNorm gain; `Family.spec` turns them into the spec's
`ResidualSpec`. `residual_cross` and `solve_residual` are the closed-form step of `align`'s coordinate
descent (Hungarian for permutations, Procrustes for rotations).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..options import DEFAULT_POLAR_METHOD
from ..precision import exact, exact_jit
from ..pytree import flatten, unflatten
from ..solvers import assignment, procrustes
from ..spec import BoundSpec, Spec, SpecError, bind
from ..transforms import RESIDUAL, ResidualTransform, random_orthogonal


def _bound_stream(spec, params):
    bound = bind(spec, params)
    if bound.residual is None:
        raise SpecError("the spec has no residual rules (Spec.residual): the built-in families' specs have them")
    return bound


@exact
def fold_norms(spec: Spec | BoundSpec, params) -> dict:
    """New params computing the same function with every foldable RMSNorm gain moved into the
    input rows of the kernels that read it (gain -> 1, W -> diag(g) W). Raises for LayerNorm
    specs (their gains commute with permutations: nothing to fold). A gain without readers (a
    tied LM head's final norm) is left as it is; `align(residual="rotation")` then refuses it
    unless it is uniform."""
    bound = _bound_stream(spec, params)
    stream = bound.residual
    if stream.norm != "rmsnorm":
        raise ValueError(f"fold_norms folds RMSNorm gains; this spec's residual stream has {stream.norm}")
    flat = dict(flatten(params))
    for gain_path, readers in stream.folds:
        if not readers:
            continue
        gain = flat[gain_path]
        for reader in readers:
            w = flat[reader]
            flat[reader] = (gain.astype(jnp.float32)[:, None] * w.astype(jnp.float32)).astype(w.dtype)
        flat[gain_path] = jnp.ones_like(gain)
    return unflatten(flat)


def check_rotatable(bound: BoundSpec, params, what: str) -> None:
    """A rotation of the stream keeps the function only where every RMSNorm gain is uniform."""
    stream = bound.residual
    if stream.norm == "layernorm":
        raise ValueError(
            "residual='rotation' needs RMSNorm: LayerNorm subtracts the mean over the width, which only "
            "permutations of the residual stream preserve; use residual='permutation'"
        )
    flat = flatten(params)
    if any(isinstance(flat[g], jax.core.Tracer) for g in stream.gains):
        return  # inside jit: the caller folded (documented)
    bad = [g for g in stream.gains if not np.allclose(np.asarray(flat[g], np.float32), np.asarray(flat[g], np.float32).ravel()[0])]
    if bad:
        unfoldable = [g for g, readers in stream.folds if not readers and g in bad]
        hint = (f" {unfoldable} read by a tied LM head cannot be folded: align the residual stream with 'permutation'"
                if unfoldable else " fold them first: rj.fold_norms(spec, params) on both models (function-preserving)")
        raise ValueError(f"{what}: RMSNorm gains {bad[:4]} are not uniform, so a rotation of the residual stream would change the function;{hint}")


@exact_jit(static_argnums=(0, 3, 4))
def residual_cross(bound: BoundSpec, flat_a, flat_b, rotation: bool = False, untouched_only: bool = False):
    """M = sum over the stream's leaves of X_B^T X_A (d, d), each leaf's stream axis last and its
    other axes flattened into rows: the Procrustes / assignment score of T (MATH §10). A rotation
    leaves the (uniform) RMSNorm gains alone, so they do not score it. `untouched_only`: only the
    leaves no per-layer group moves (embeddings, norms, output biases, heads), which score T
    before the groups are known: the descent's first step."""
    d = bound.residual.size
    skip = set(bound.residual.gains) if rotation else set()
    if untouched_only:
        skip |= set(bound.transformed_paths())
    m = jnp.zeros((d, d), jnp.float32)
    paths = [p for p, _ in bound.residual.axes]
    for path, axis in bound.residual.axes:
        # A leaf on the stream along two axes (T^T W T) is not linear in T: it follows T, scores nothing.
        if path in skip or paths.count(path) > 1:
            continue
        xa = jnp.moveaxis(jnp.asarray(flat_a[path], jnp.float32), axis, -1).reshape(-1, d)
        xb = jnp.moveaxis(jnp.asarray(flat_b[path], jnp.float32), axis, -1).reshape(-1, d)
        m = m + xb.T @ xa
    return m


def solve_residual(cross, mode: str, polar_method: str | None = None) -> ResidualTransform:
    """The T maximising tr(T^T M): a linear assignment (permutation) or the polar factor (rotation)."""
    if mode == "permutation":
        return ResidualTransform(assignment.assign(cross))
    d = cross.shape[-1]
    return ResidualTransform(jnp.arange(d, dtype=jnp.int32), procrustes.polar(cross, method=polar_method or DEFAULT_POLAR_METHOD))


def random_residual(spec: Spec | BoundSpec, params, key, mode: str) -> ResidualTransform:
    """A random element of the stream's group: a permutation, or (RMSNorm) a Haar rotation."""
    bound = _bound_stream(spec, params)
    d = bound.residual.size
    perm = jax.random.permutation(key, d).astype(jnp.int32)
    if mode == "permutation":
        return ResidualTransform(perm)
    if mode != "rotation":
        raise ValueError(f"mode={mode!r}; expected 'permutation' or 'rotation'")
    return ResidualTransform(jnp.arange(d, dtype=jnp.int32), random_orthogonal(jax.random.fold_in(key, 1), (), d))


__all__ = ["RESIDUAL", "check_rotatable", "fold_norms", "random_residual", "residual_cross", "solve_residual"]
