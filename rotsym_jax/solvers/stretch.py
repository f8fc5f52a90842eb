"""Invertible maps near a rotation (MATH §14): `M = M0 · R · exp(S)`, `M^-T = M0^-T · R · exp(-S)`,
with `R` a rotation (Cayley; RoPE pair angles on rotary dims) and `S` symmetric of bounded norm, so
that every map's condition number stays below MAX_CONDITION. The learned method trains these
parameters on the merged model's loss; `fit_maps` descends the weight distance with them, from the
closed form's rotation (weight matching with maps="invertible")."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..precision import exact_jit
from ..transforms import rope_rotation, stretch_form, symmetric_exp

# cond(exp(S)) = exp(lambda_max - lambda_min) <= exp(sqrt(2) ||S||_F), so ||S||_F <= log(MAX_CONDITION) / sqrt(2)
# keeps it below MAX_CONDITION: a map far from orthogonal is found only as far as its inverse stays accurate in float32.
MAX_CONDITION = 100.0
STRETCH_NORM = float(np.log(MAX_CONDITION) / np.sqrt(2))  # the bound on ||S||_F

# The weight-distance descent: Adam steps from the closed form, its rate cosine-decayed to 0. The
# distance is quadratic in M and in M^-T: 500 steps bring the planted maps of the tests to within
# 1e-4 of their optimum (tests/test_invertible.py checks it against SciPy's BFGS).
FIT_STEPS = 500
FIT_RATE = 0.05


def bounded(s):
    """The symmetric part of s (..., n, n), its Frobenius norm squashed below log(MAX_CONDITION) / sqrt(2)
    (k tanh(|S| / k) / |S|: the identity near 0, smooth, with a finite gradient at 0)."""
    sym = (s + jnp.swapaxes(s, -1, -2)) / 2
    norm = jnp.sqrt(jnp.sum(jnp.square(sym), axis=(-2, -1), keepdims=True) + 1e-12)
    return sym * (STRETCH_NORM * jnp.tanh(norm / STRETCH_NORM) / norm)


def cayley(k):
    """(I - K)(I + K)^-1 of the skew part of k (..., n, n): a rotation (det +1), I at k = 0."""
    skew = (k - jnp.swapaxes(k, -1, -2)) / 2
    eye = jnp.eye(k.shape[-1], dtype=k.dtype)
    return jnp.linalg.solve(jnp.swapaxes(eye + skew, -1, -2), jnp.swapaxes(eye - skew, -1, -2)).swapaxes(-1, -2)


def near_maps(start, start_inv, params, rotary_dim):
    """`start · R · exp(S)` and `start_inv · R · exp(-S)` for `params` {"k": (..., n, n) whose skew
    part gives R by Cayley, "angles": (..., rotary_dim / 2) the rotary pairs' rotations,
    "s": (..., n, n) whose bounded symmetric part is S}. With `rotary_dim`, R rotates the rotary
    pairs by their angles and any rotation acts on the rest only, and S keeps one value per pair
    (`stretch_form`): the maps commute with RoPE."""
    k = params["k"]
    if rotary_dim:
        k = k.at[..., :rotary_dim, :].set(0).at[..., :, :rotary_dim].set(0)
    rotation = cayley(k)
    if rotary_dim:
        rotation = rope_rotation(params["angles"], k.shape[-1], rotary_dim) @ rotation
    log = stretch_form(bounded(params["s"]), rotary_dim or None)
    stretch = symmetric_exp(jnp.stack([log, -log]), max_norm=STRETCH_NORM)  # matmuls only (no second LAPACK call)
    return start @ rotation @ stretch[0], start_inv @ rotation @ stretch[1]


def distance_terms(m, n, cross, gram):
    """The two sides' distance `|X_B M - X_A|^2 + |Y_B N - Y_A|^2` less the constant |X_A|^2 + |Y_A|^2,
    from B's Grams (X_B^T X_B, Y_B^T Y_B) and the crosses (X_B^T X_A, Y_B^T Y_A): (...)."""
    total = 0.0
    for x, c, g in ((m, cross[0], gram[0]), (n, cross[1], gram[1])):
        total = total + jnp.einsum("...ij,...ik,...kj->...", x, g, x) - 2 * jnp.einsum("...ij,...ij->...", x, c)
    return total


@functools.partial(exact_jit, static_argnums=(4,))
def fit_maps(start, start_inv, cross, gram, rotary_dim):
    """The invertible maps `M` (and `M^-T`) of every problem on the leading axes that minimise the
    weight distance `distance_terms`, by FIT_STEPS Adam steps over `near_maps`' parameters from
    `start` (the closed form: a rotation times its scale, and its inverse transpose). Each problem
    keeps its best iterate, so none ends farther than it started. cross, gram: pairs of (..., n, n)
    (the q and k sides, or v and o)."""
    n = start.shape[-1]
    batch = start.shape[:-2]
    params = {"k": jnp.zeros((*batch, n, n), jnp.float32), "s": jnp.zeros((*batch, n, n), jnp.float32),
              "angles": jnp.zeros((*batch, (rotary_dim or 0) // 2), jnp.float32)}

    def objective(p):
        return distance_terms(*near_maps(start, start_inv, p, rotary_dim), cross, gram)

    def scored(p):
        values = objective(p)
        return jnp.sum(values / norm), values

    first = objective(params)
    # each problem weighs alike (they are independent): its objective over its own scale
    norm = jnp.abs(first) + jnp.sqrt(jnp.sum(jnp.square(cross[0]) + jnp.square(cross[1]), axis=(-2, -1))) + 1e-30

    def step(carry, i):
        p, moments, best, best_f = carry
        (_, f), grads = jax.value_and_grad(scored, has_aux=True)(p)
        best = _where(f < best_f, p, best)  # f is p's objective: the best iterate seen, p included
        p, moments = _adam(p, grads, moments, i)
        return (p, moments, best, jnp.minimum(f, best_f)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (p, _, best, best_f), _ = jax.lax.scan(step, (params, (zeros, zeros), params, first), jnp.arange(FIT_STEPS))
    best = _where(objective(p) < best_f, p, best)
    return near_maps(start, start_inv, best, rotary_dim)


def _adam(p, grads, moments, i, b1=0.9, b2=0.999, eps=1e-8):
    """One Adam step at step i (from 0), the rate cosine-decayed from FIT_RATE to 0 over FIT_STEPS
    (written out: the weight-matching path imports no optimiser library)."""
    rate = FIT_RATE * 0.5 * (1 + jnp.cos(jnp.pi * i / FIT_STEPS))
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, moments[0], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, moments[1], grads)
    t = i + 1
    p = jax.tree.map(lambda x, m, v: x - rate * (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps), p, m, v)
    return p, (m, v)


def _where(better, new, old):
    """Per problem (the leading axes of `better`), `new`'s parameters where better, else `old`'s."""
    return jax.tree.map(lambda x, y: jnp.where(better.reshape(better.shape + (1,) * (x.ndim - better.ndim)), x, y), new, old)
