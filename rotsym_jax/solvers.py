"""Numerical solvers for aligning one model to another (MATH.md sections 2 to 5).

Device functions (jittable, batched over arbitrary leading axes, computed in float32 at least:
float16 / bfloat16 / integer inputs are upcast to float32, float64 stays float64):

    polar(M)                         orthogonal polar factor U V^T of M = U S V^T (Procrustes)
    rope_polar(M, rotary_dim)        the same maximiser within the RoPE group SO(2)^(r/2) x O(n-r)
    nuclear_norm(M)                  sum of singular values
    rescale_sequential(...)          best scalar a > 0 for a fixed rotation (quartic, Eq. 11-12)
    rescale_joint(Mq, Mk, ...)       exact joint optimum over (a, R) by a 1-D search over log a
    objective_value(R, a, ...)       the QK/VO alignment cost, up to a constant

Host functions (NumPy / SciPy, not jittable):

    linear_assignment(S)             permutation p maximising sum_j S[p[j], j]
    linear_assignments([S, ...])     the same for a sequence, on a thread pool
    batched_linear_assignment(S)     the same over leading axes

The device functions are wrapped in `jax.jit` (string/int/callable options are static), so
eager calls are compiled once per shape; they can also be called inside other jitted code.

Conventions (MATH.md section 2): `R` acts by right-multiplication, `x @ R`; for cross products
`M = X_B^T X_A` the orthogonal maximiser of `tr(R^T M)` is the `R` for which `X_B @ R` is closest
to `X_A`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

Array = jax.Array

__all__ = [
    "POLAR_METHODS",
    "DEFAULT_POLAR_METHOD",
    "polar",
    "rope_polar",
    "nuclear_norm",
    "rescale_sequential",
    "rescale_joint",
    "objective_value",
    "linear_assignment",
    "linear_assignments",
    "batched_linear_assignment",
]

POLAR_METHODS = ("svd", "newton", "newton_schulz", "qdwh")
# Measured (288 cross products 64x64, 2-core CPU; results/polar_methods.json, min wall ms, random /
# planted): "newton" 138 / 165, "svd" 192 / 177 (about 105 inside the attention solve),
# "newton_schulz" 137 / 72: fast on near-orthogonal cross products (planted or fine-tuned pairs),
# the SVD's time on ill-conditioned ones. Timings vary about 2x with load. "newton" is the default: the
# most accurate in planted recovery (relative error <= 3e-7 on every test family; "svd" 2e-5 on
# one), and safe: two "newton_schulz" calls in one jitted program (the attention solve has one for
# QK and one for VO) deadlock XLA:CPU in jax 0.10.2 (reproduced with two independent calls; gone
# with XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= or
# --xla_cpu_enable_concurrency_optimized_scheduler=false, flags a library must not set).
DEFAULT_POLAR_METHOD = "newton"

# "newton": fixed number of Frobenius-scaled Newton steps.
NEWTON_ITERS = 8
# "newton_schulz": one Byers-Xu scaled Newton step, then SCHULZ_STEPS Newton-Schulz steps; only
# when every matrix of the batch has an estimated condition number <= SCHULZ_MAX_COND (beyond
# it they would not converge in that many steps; the SVD is used instead).
# After the Newton step the singular values lie in [1, (k^(1/2) + k^(-1/2)) / 2] (k: condition
# number); 4 Newton-Schulz steps take that to 1 within 2e-7 for k <= 4.
SCHULZ_STEPS = 4
SCHULZ_MAX_COND = 4.0


# ----------------------------------------------------------------------------------------------
# helpers


def _as_float(x) -> Array:
    """Upcast to a floating dtype of at least float32 precision."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return x.astype(jnp.float32)


def _check_square(M: Array, name: str = "M") -> None:
    if M.ndim < 2 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"{name} must have shape (..., n, n), got {M.shape}")


def _mT(x: Array) -> Array:
    return jnp.swapaxes(x, -1, -2)


def _fro(x: Array) -> Array:
    """Frobenius norm over the last two axes, keeping them (shape (..., 1, 1))."""
    return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))


def _trace_inner(R: Array, X: Array) -> Array:
    """tr(R^T X) = <R, X> over the last two axes."""
    return jnp.sum(R * X, axis=(-2, -1))


def _eye_like(M: Array) -> Array:
    return jnp.broadcast_to(jnp.eye(M.shape[-1], dtype=M.dtype), M.shape)


# ----------------------------------------------------------------------------------------------
# polar factor


def _polar_svd(M: Array) -> Array:
    # LAPACK gesdd on CPU. For M = 0 it returns U = V = I, so the result is the identity.
    u, _, vt = jnp.linalg.svd(M, full_matrices=False)
    return u @ vt


def _polar_qdwh(M: Array) -> Array:
    n = M.shape[-1]
    flat = M.reshape((-1, n, n))
    zero = _fro(flat) == 0
    safe = jnp.where(zero, _eye_like(flat), flat)
    u = jax.vmap(lambda m: jax.scipy.linalg.polar(m, method="qdwh")[0])(safe)
    return u.reshape(M.shape)


def _scaled_newton(M: Array, iters: int) -> Array:
    """`iters` Frobenius-scaled Newton steps  X <- (z X + (z X)^{-T}) / 2,
    `z = sqrt(||X^{-1}||_F / ||X||_F)`, from X0 = M / ||M||_F (M = 0: from the identity). They keep
    the singular vectors of M and map every singular value to a positive one; all converge to 1
    quadratically (8 steps reach float32 accuracy for condition numbers up to ~1e6)."""
    norm = _fro(M)
    zero = norm == 0
    X = jnp.where(zero, _eye_like(M), M / jnp.where(zero, 1, norm))

    def newton(_, X):
        Xi = jnp.linalg.inv(X)
        z = jnp.sqrt(_fro(Xi) / _fro(X))
        return 0.5 * (z * X + _mT(Xi) / z)

    return jax.lax.fori_loop(0, iters, newton, X)


def _norm2_estimate(X: Array, steps: int = 6) -> Array:
    """Spectral norm estimate (..., 1, 1) by power iteration on X^T X from a fixed start; a lower
    bound that is accurate to a few percent after a few steps for the matrices seen here."""
    v = jnp.ones(X.shape[:-1], dtype=X.dtype)[..., None] / math.sqrt(X.shape[-1])

    def body(_, v):
        w = _mT(X) @ (X @ v)
        return w / jnp.maximum(_fro(w), jnp.finfo(X.dtype).tiny)

    v = jax.lax.fori_loop(0, steps, body, v)
    return _fro(X @ v)


def _newton_schulz(M: Array, steps: int, max_cond: float) -> Array:
    """Polar factor by one scaled Newton step and `steps` Newton-Schulz steps, for well-conditioned
    batches; the SVD factor otherwise.

    From X0 = M / ||M||_F (M = 0: from the identity), with `alpha ~ sigma_max(X0)` and
    `beta ~ sigma_min(X0) = 1 / ||X0^{-1}||_2` estimated by power iteration, the Newton step
    `X <- (mu X + (mu X)^{-T}) / 2`, `mu = 1/sqrt(alpha beta)` (Byers & Xu 2008) maps the singular
    values in [beta, alpha] into [1, (k^(1/2) + k^(-1/2)) / 2], k = alpha / beta; Newton-Schulz
    `X <- X (3 I - X^T X) / 2` (matmul only) then converges quadratically to 1. If some matrix has
    `k > max_cond` the whole batch takes the SVD instead (one branch for the batch: XLA cannot
    take a data-dependent subset). The estimates may be off, so the result is checked by
    `_guarded`, with `ok` False where Newton-Schulz was not provably safe to start
    (`||X^T X - I||_F >= 2`: singular values above sqrt(3) would turn negative and converge to
    an orthogonal matrix that is not the polar factor, which orthogonality alone would not show).
    """
    X, Xi, alpha, beta = _schulz_start(M)
    easy = jnp.all(alpha <= max_cond * beta)  # False for NaN too
    return jax.lax.cond(easy, lambda: _guarded(M, *_schulz_iterate(X, Xi, alpha, beta, steps)), lambda: _polar_svd(M))


def _schulz_start(M: Array) -> tuple[Array, Array, Array, Array]:
    """X0 = M / ||M||_F (M = 0: the identity), its inverse, and estimates of its extreme singular
    values alpha ~ sigma_max(X0), beta ~ sigma_min(X0) = 1 / ||X0^{-1}||_2, shapes (..., 1, 1)."""
    norm = _fro(M)
    zero = norm == 0
    X = jnp.where(zero, _eye_like(M), M / jnp.where(zero, 1, norm))
    Xi = jnp.linalg.inv(X)
    alpha = jnp.minimum(_norm2_estimate(X), 1)  # ||X0||_2 <= ||X0||_F = 1
    beta = jnp.minimum(1 / _norm2_estimate(Xi), alpha)
    return X, Xi, alpha, beta


def _schulz_iterate(X, Xi, alpha, beta, steps: int) -> tuple[Array, Array]:
    """The scaled Newton step and `steps` Newton-Schulz steps: (result, ok)."""
    mu = 1 / jnp.sqrt(alpha * beta)
    Y = 0.5 * (mu * X + _mT(Xi) / mu)
    # ||Y^T Y - I||_2 <= ||Y^T Y - I||_F < 2  =>  every singular value of Y is below sqrt(3)
    ok = _fro(_mT(Y) @ Y - jnp.eye(X.shape[-1], dtype=X.dtype))[..., 0, 0] < 2
    for _ in range(steps):
        Y = 1.5 * Y - 0.5 * Y @ (_mT(Y) @ Y)
    return Y, ok


def _orthogonality_error(X: Array) -> Array:
    return jnp.max(jnp.abs(_mT(X) @ X - jnp.eye(X.shape[-1], dtype=X.dtype)), axis=(-2, -1))


def _guarded(M: Array, X: Array, ok: Array | None = None) -> Array:
    """Replace results that are not orthogonal to working precision (non-finite, or iterations not
    converged: rank-deficient or extremely ill-conditioned M), or flagged not `ok`, by the SVD
    polar factor. The iterations only ever map singular values to positive ones, so an
    orthogonal result is the polar factor. The SVD runs only when some matrix of the batch needs
    it (under an outer vmap, `lax.cond` becomes a select and it always runs)."""
    n = M.shape[-1]
    tol = max(1e-5, 10.0 * math.sqrt(n) * float(jnp.finfo(X.dtype).eps))
    err = _orthogonality_error(X)
    bad = ~(err <= tol)  # catches NaN
    if ok is not None:
        bad = bad | ~ok
    return jax.lax.cond(
        jnp.any(bad),
        lambda: jnp.where(bad[..., None, None], _polar_svd(M), X),
        lambda: X,
    )


@functools.partial(jax.jit, static_argnames=("method",))
def polar(M, method: str = DEFAULT_POLAR_METHOD) -> Array:
    """Orthogonal polar factor of `M` (..., n, n): with `M = U S V^T`, returns `R = U V^T`.

    `R` solves the orthogonal Procrustes problem  `R = argmax_{R^T R = I} tr(R^T M)`;  for
    `M = X_B^T X_A` it minimises `||X_B R - X_A||_F` (apply as `x @ R`). The optimum value is
    `tr(R^T M) = ||M||_*`.

    Methods (all within 1e-5 of a float64 SVD's factor on random and planted cross products;
    timings for 288 matrices 64x64 on a 2-core CPU in benchmarks/polar_methods.py):
      "svd"            `jnp.linalg.svd` (LAPACK gesdd on CPU).
      "newton"         `NEWTON_ITERS` Frobenius-scaled Newton steps from `M / ||M||_F`.
      "newton_schulz"  one Byers-Xu scaled Newton step and `SCHULZ_STEPS` Newton-Schulz
                       steps (matmul only) when the batch is well conditioned (estimated
                       condition numbers <= `SCHULZ_MAX_COND`), else the SVD (see
                       `_newton_schulz`). The fastest on CPU for near-orthogonal cross
                       products, as fast as "svd" on ill-conditioned ones; see the note at
                       `DEFAULT_POLAR_METHOD` before calling it twice in one jitted program.
      "qdwh"           `jax.scipy.linalg.polar(method="qdwh")` (QR-based dynamically weighted
                       Halley), vmapped.
    The iterative methods check their result (orthogonality, and for "newton_schulz" that the
    Newton-Schulz phase started in its region of convergence) and replace the matrices that fail
    by the SVD factor (see `_guarded`); the SVD only runs when some matrix fails.

    Rank-deficient `M`: the factor is not unique (any orthogonal completion on the null space is
    optimal); every method returns some orthogonal maximiser, never NaN. `M = 0` gives the
    identity. Non-finite `M` gives NaN.
    """
    M = _as_float(M)
    _check_square(M)
    if method == "svd":
        return _polar_svd(M)
    if method == "newton":
        return _guarded(M, _scaled_newton(M, NEWTON_ITERS))
    if method == "newton_schulz":
        return _newton_schulz(M, SCHULZ_STEPS, SCHULZ_MAX_COND)
    if method == "qdwh":
        return _guarded(M, _polar_qdwh(M))
    raise ValueError(f"unknown polar method {method!r}; expected one of {POLAR_METHODS}")


@functools.partial(jax.jit, static_argnames=("rotary_dim", "method"))
def rope_polar(M, rotary_dim: int, method: str = DEFAULT_POLAR_METHOD) -> Array:
    """Maximiser of `tr(R^T M)` over the RoPE-compatible group (MATH.md sections 1-2).

    Rotary pairs are `(i, j = i + rotary_dim/2)`, `i < rotary_dim/2` (HF rotate_half layout). On
    each pair `R` is the 2-D rotation  `R[i,i] = R[j,j] = cos t, R[i,j] = sin t, R[j,i] = -sin t`
    with  `t = atan2(M[i,j] - M[j,i], M[i,i] + M[j,j])`  (the pair's contribution to the trace is
    `cos t (M_ii + M_jj) + sin t (M_ij - M_ji)`). No reflections. Dimensions `>= rotary_dim` get
    `polar` of the block `M[r:, r:]`; all other entries are 0. A pair with a zero 2x2 signal gets
    the identity. `rotary_dim = 0` is plain `polar`.
    """
    M = _as_float(M)
    _check_square(M)
    n = M.shape[-1]
    r = int(rotary_dim)
    if r % 2 or not 0 <= r <= n:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and in [0, {n}]")
    if r == 0:
        return polar(M, method)
    half = r // 2
    i = np.arange(half)
    j = i + half
    theta = jnp.arctan2(M[..., i, j] - M[..., j, i], M[..., i, i] + M[..., j, j])
    c, s = jnp.cos(theta), jnp.sin(theta)
    R = jnp.zeros_like(M)
    R = R.at[..., i, i].set(c).at[..., j, j].set(c).at[..., i, j].set(s).at[..., j, i].set(-s)
    if r < n:
        R = R.at[..., r:, r:].set(polar(M[..., r:, r:], method))
    return R


@jax.jit
def nuclear_norm(M) -> Array:
    """`||M||_* = sum of singular values` over the last two axes (= `max_R tr(R^T M)`)."""
    M = _as_float(M)
    return jnp.sum(jnp.linalg.svd(M, compute_uv=False), axis=-1)


# ----------------------------------------------------------------------------------------------
# rescaling


@jax.jit
def objective_value(R, a, Mq, Mk, s_qq, s_kk) -> Array:
    """`a^2 s_qq + s_kk / a^2 - 2 tr(R^T (a Mq + Mk / a))`: the QK (or VO) alignment cost
    `||a X_q^B R - X_q^A||^2 + ||X_k^B R / a - X_k^A||^2` minus the constant `||X^A||^2`.
    Shapes: R, Mq, Mk (..., n, n); a, s_qq, s_kk (...)."""
    R, Mq, Mk = _as_float(R), _as_float(Mq), _as_float(Mk)
    a, s_qq, s_kk = _as_float(a), _as_float(s_qq), _as_float(s_kk)
    tq, tk = _trace_inner(R, Mq), _trace_inner(R, Mk)
    return a * a * s_qq + s_kk / (a * a) - 2 * (a * tq + tk / a)


def _f_normalised(t, p, q):
    return t * t + 1 / (t * t) - 2 * p * t - 2 * q / t


@jax.jit
def rescale_sequential(s_qq, s_qa, s_kk, s_ka) -> Array:
    """Best `a > 0` for a fixed rotation (MATH.md section 3; the paper's Eq. 11-12):

        minimise  f(a) = a^2 s_qq - 2 a s_qa + s_kk / a^2 - 2 s_ka / a,
        stationary points: positive real roots of  s_qq a^4 - s_qa a^3 + s_ka a - s_kk = 0.

    `a = 1` where `s_qq <= 0` or `s_kk <= 0` (degenerate). Inputs broadcast; output has their
    broadcast shape.

    Numerics: substitute `a = a0 t`, `a0 = (s_kk / s_qq)^(1/4)`, which turns the problem into the
    dimensionless `f / sqrt(s_qq s_kk) = t^2 + 1/t^2 - 2 p t - 2 q / t` with
    `p = s_qa / (s_qq^(3/4) s_kk^(1/4))`, `q = s_ka / (s_kk^(3/4) s_qq^(1/4))`, i.e. the monic
    quartic `t^4 - p t^3 + q t - 1 = 0`. Its roots are the eigenvalues of the 4x4 companion matrix
    (`jnp.linalg.eigvals`, batched); the real part of every eigenvalue and its refinement by three
    Newton steps on the quartic are candidates, as is `t = 1`; `f` is evaluated at every positive
    candidate and the best is kept. A candidate that is not a root can only be a worse choice, so
    spurious candidates are harmless, and the true minimiser (a root: `f -> inf` at `0+` and at
    `inf`) is always among them up to the eigenvalue accuracy.
    """
    s_qq, s_qa, s_kk, s_ka = jnp.broadcast_arrays(*map(_as_float, (s_qq, s_qa, s_kk, s_ka)))
    dtype = jnp.result_type(s_qq, s_qa, s_kk, s_ka)
    s_qq, s_qa, s_kk, s_ka = (x.astype(dtype) for x in (s_qq, s_qa, s_kk, s_ka))
    degenerate = ~((s_qq > 0) & (s_kk > 0))
    sq = jnp.where(degenerate, 1, s_qq)
    sk = jnp.where(degenerate, 1, s_kk)
    rq, rk = sq**0.25, sk**0.25
    p = s_qa / (rq**3 * rk)
    q = s_ka / (rk**3 * rq)
    p = jnp.where(degenerate, 0, p)
    q = jnp.where(degenerate, 0, q)

    one, zero = jnp.ones_like(p), jnp.zeros_like(p)
    companion = jnp.stack(
        [
            jnp.stack([p, zero, -q, one], -1),
            jnp.stack([one, zero, zero, zero], -1),
            jnp.stack([zero, one, zero, zero], -1),
            jnp.stack([zero, zero, one, zero], -1),
        ],
        -2,
    )
    roots = jnp.real(jnp.linalg.eigvals(companion)).astype(dtype)  # (..., 4)
    pp, qq = p[..., None], q[..., None]

    def newton(t):
        poly = ((t - pp) * t * t + qq) * t - 1
        deriv = (4 * t - 3 * pp) * t * t + qq
        step = poly / deriv
        t_new = t - step
        ok = jnp.isfinite(t_new) & (t_new > 0) & (deriv != 0)
        return jnp.where(ok, t_new, t)

    polished = roots
    for _ in range(3):
        polished = newton(polished)
    cand = jnp.concatenate([roots, polished, jnp.ones_like(roots[..., :1])], axis=-1)
    valid = (cand > 0) & jnp.isfinite(cand)
    safe = jnp.where(valid, cand, 1)
    values = jnp.where(valid, _f_normalised(safe, pp, qq), jnp.inf)
    values = jnp.where(jnp.isnan(values), jnp.inf, values)
    t = jnp.take_along_axis(safe, jnp.argmin(values, axis=-1)[..., None], axis=-1)[..., 0]
    return jnp.where(degenerate, 1, t * (rk / rq))


def _golden_section(fun, lo, hi, iters):
    """Batched golden-section search for a minimum of `fun` on [lo, hi] (elementwise brackets).
    Returns (x_best, f_best) over every point evaluated. One `fun` evaluation per iteration."""
    inv_phi = (math.sqrt(5) - 1) / 2
    c = hi - inv_phi * (hi - lo)
    d = lo + inv_phi * (hi - lo)
    fc, fd = fun(c), fun(d)
    best_x = jnp.where(fc <= fd, c, d)
    best_f = jnp.minimum(fc, fd)

    def body(_, state):
        lo, hi, c, d, fc, fd, best_x, best_f = state
        left = fc <= fd  # minimum in [lo, d]
        lo = jnp.where(left, lo, c)
        hi = jnp.where(left, d, hi)
        new_x = jnp.where(left, hi - inv_phi * (hi - lo), lo + inv_phi * (hi - lo))
        new_f = fun(new_x)
        c, d, fc, fd = (
            jnp.where(left, new_x, d),
            jnp.where(left, c, new_x),
            jnp.where(left, new_f, fd),
            jnp.where(left, fc, new_f),
        )
        better = new_f < best_f
        best_x = jnp.where(better, new_x, best_x)
        best_f = jnp.where(better, new_f, best_f)
        return lo, hi, c, d, fc, fd, best_x, best_f

    state = jax.lax.fori_loop(0, iters, body, (lo, hi, c, d, fc, fd, best_x, best_f))
    return state[-2], state[-1]


def rescale_joint(
    Mq,
    Mk,
    s_qq,
    s_kk,
    a_init=None,
    *,
    grid: int = 17,
    iters: int = 12,
    project: Callable[[Array], Array] | None = None,
) -> tuple[Array, Array]:
    """Joint optimum over `a > 0` and `R` (MATH.md section 3, "Joint optimum") of

        a^2 s_qq + s_kk / a^2 - 2 tr(R^T (a Mq + Mk / a)).

    For fixed `a` the best `R` is `project(a Mq + Mk / a)` (default `polar`), so it remains to
    minimise the scalar function
        g(a) = a^2 s_qq + s_kk / a^2 - 2 h(a Mq + Mk / a),   h(X) = tr(project(X)^T X)
    (`h = ||.||_*` for `polar`; for `rope_polar` the maximum over the smaller RoPE group).

    Search in `u = log a`:
      1. sequential candidate: `R0 = project(Mq + Mk)`, `a0 = rescale_sequential(s_qq,
         tr(R0^T Mq), s_kk, tr(R0^T Mk))` (rotate, then scale);
      2. a bracket that provably contains every global minimiser: `h` is sublinear, so
         `g(a) >= a^2 s_qq - 2 a h(Mq) - h(Mk)^2 / s_kk` (and symmetrically in `1/a`); a minimiser
         has `g <= g(a0)`, which bounds `a` above and `1/a` above (solve two quadratics);
      3. `grid` evenly spaced points over that bracket plus `a0` (and `a_init` when given),
         each a batched `h` evaluation;
      4. golden-section refinement (`iters` steps) between the neighbours of the best point;
      5. one step of alternating exact minimisation from there: `a` by `rescale_sequential` for
         `R = project(a Mq + Mk / a)`, then `R` for that `a`.
    Returns the best of the refined point and the sequential `(a0, R0)` by the exact objective,
    so it is never worse than the sequential solution. `g` need not be unimodal in `u`; the grid
    makes a missed better local minimum unlikely, not impossible.

    Degenerate `s_qq <= 0` or `s_kk <= 0`: `g` may be unbounded below; returns `a = 1`,
    `R = project(Mq + Mk)` as `rescale_sequential` does.

    Shapes: Mq, Mk (..., n, n); s_qq, s_kk, a_init (...) (broadcast). Returns a (...),
    R (..., n, n). Jitted; `grid`, `iters` and `project` are static. A `functools.partial` with
    hashable arguments, e.g. `functools.partial(rope_polar, rotary_dim=r)`, is compared by value,
    so making a new one per call does not recompile. Cost: about `grid + iters + 6` batched SVDs
    (about 1.8 s for 288 matrices 64x64 on 2 CPU cores with the defaults).
    """
    project = None if project is None else _StaticCallable(project)
    return _rescale_joint(Mq, Mk, s_qq, s_kk, a_init, grid=grid, iters=iters, project=project)


class _StaticCallable:
    """A callable compared and hashed by value when it is a `functools.partial` with hashable
    arguments, so that equal partials created per call share one jit cache entry."""

    def __init__(self, fn):
        self.fn = fn.fn if isinstance(fn, _StaticCallable) else fn
        key = self.fn
        if isinstance(self.fn, functools.partial):
            key = (self.fn.func, self.fn.args, tuple(sorted(self.fn.keywords.items())))
        try:
            hash(key)
        except TypeError:
            key = self.fn
        self.key = key

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _StaticCallable) and self.key == other.key


@functools.partial(jax.jit, static_argnames=("grid", "iters", "project"))
def _rescale_joint(Mq, Mk, s_qq, s_kk, a_init, *, grid, iters, project):
    if project is None:
        project = polar
        h_of = nuclear_norm
    else:

        def h_of(X):
            return _trace_inner(project(X), X)

    Mq, Mk = _as_float(Mq), _as_float(Mk)
    _check_square(Mq, "Mq")
    _check_square(Mk, "Mk")
    Mq, Mk = jnp.broadcast_arrays(Mq, Mk)
    batch = Mq.shape[:-2]
    s_qq = jnp.broadcast_to(_as_float(s_qq), batch).astype(Mq.dtype)
    s_kk = jnp.broadcast_to(_as_float(s_kk), batch).astype(Mq.dtype)
    degenerate = ~((s_qq > 0) & (s_kk > 0))
    sq = jnp.where(degenerate, 1, s_qq)
    sk = jnp.where(degenerate, 1, s_kk)

    # 1. sequential
    R0 = project(Mq + Mk)
    a0 = rescale_sequential(s_qq, _trace_inner(R0, Mq), s_kk, _trace_inner(R0, Mk))
    v0 = objective_value(R0, a0, Mq, Mk, s_qq, s_kk)

    def g_of_u(u):
        a = jnp.exp(u)
        X = a[..., None, None] * Mq + Mk / a[..., None, None]
        return a * a * sq + sk / (a * a) - 2 * h_of(X)

    # 2. bracket [u_lo, u_hi] containing every minimiser
    nq, nk = h_of(Mq), h_of(Mk)
    g0 = jnp.where(degenerate, 0, v0)
    ca = jnp.maximum(nq * nq + sq * (g0 + nk * nk / sk), 0)
    cb = jnp.maximum(nk * nk + sk * (g0 + nq * nq / sq), 0)
    a_hi = (nq + jnp.sqrt(ca)) / sq
    b_hi = (nk + jnp.sqrt(cb)) / sk  # bound on 1/a
    u0 = jnp.log(a0)
    tiny = jnp.finfo(Mq.dtype).tiny
    u_hi = jnp.log(jnp.maximum(a_hi, tiny))
    u_lo = -jnp.log(jnp.maximum(b_hi, tiny))
    centres = [u0]
    if a_init is not None:
        a_init = jnp.broadcast_to(_as_float(a_init), batch).astype(Mq.dtype)
        u_init = jnp.log(jnp.where(a_init > 0, a_init, a0))
        centres.append(jnp.where(jnp.isfinite(u_init), u_init, u0))
    for c in centres:
        u_lo = jnp.minimum(u_lo, c)
        u_hi = jnp.maximum(u_hi, c)
    margin = 0.02 * (u_hi - u_lo) + 1e-3  # float rounding of the bound, and a nonzero width
    u_lo, u_hi = u_lo - margin, u_hi + margin
    u_lo = jnp.where(degenerate | ~jnp.isfinite(u_lo), -1.0, u_lo)
    u_hi = jnp.where(degenerate | ~jnp.isfinite(u_hi), 1.0, u_hi)

    # 3. grid (+ centres), evaluated one point at a time over the batch (bounded memory)
    w = jnp.linspace(0.0, 1.0, grid, dtype=Mq.dtype)
    us = u_lo[..., None] + w * (u_hi - u_lo)[..., None]
    us = jnp.concatenate([us] + [jnp.clip(c, u_lo, u_hi)[..., None] for c in centres], axis=-1)
    us = jnp.sort(us, axis=-1)
    gs = jax.lax.map(g_of_u, jnp.moveaxis(us, -1, 0))
    gs = jnp.moveaxis(gs, 0, -1)
    gs = jnp.where(jnp.isnan(gs), jnp.inf, gs)
    k = jnp.argmin(gs, axis=-1)
    m = us.shape[-1]
    take = lambda arr, idx: jnp.take_along_axis(arr, idx[..., None], axis=-1)[..., 0]  # noqa: E731
    lo = take(us, jnp.maximum(k - 1, 0))
    hi = take(us, jnp.minimum(k + 1, m - 1))
    u_grid, g_grid = take(us, k), take(gs, k)

    # 4. golden section
    u_gs, g_gs = _golden_section(g_of_u, lo, hi, iters)
    u_best = jnp.where(g_gs < g_grid, u_gs, u_grid)

    # 5. polish: exact minimisation over a for the R of that point, then over R for that a.
    # Each step can only lower the objective; it makes `a` accurate to the quartic root's
    # precision instead of the ~sqrt(eps) a search on float32 values of g can resolve.
    a1 = jnp.exp(u_best)
    R1 = project(a1[..., None, None] * Mq + Mk / a1[..., None, None])
    a1 = rescale_sequential(s_qq, _trace_inner(R1, Mq), s_kk, _trace_inner(R1, Mk))
    R1 = project(a1[..., None, None] * Mq + Mk / a1[..., None, None])
    v1 = objective_value(R1, a1, Mq, Mk, s_qq, s_kk)
    use_joint = (v1 < v0) & ~degenerate
    a = jnp.where(use_joint, a1, a0)
    R = jnp.where(use_joint[..., None, None], R1, R0)
    return a, R


# ----------------------------------------------------------------------------------------------
# linear assignment (host)


def linear_assignment(scores, maximize: bool = True) -> np.ndarray:
    """Host (NumPy/SciPy). For a square score matrix `S[i_B, j_A]` returns the permutation `p`
    (int64, shape (n,)) of B's units that maximises (or, `maximize=False`, minimises)
    `sum_j S[p[j], j]`: the aligned B is `B'[j] = B[p[j]]` (`B' = B[p]` along the unit axis).

    Example: if B's units are A's permuted, `B = A[q]`, then with `S = B A^T` (or any score that
    peaks on matching units) the result is `p = argsort(q)`, and `B[p] = A`.

    Solved by `scipy.optimize.linear_sum_assignment` (a shortest augmenting path method, exact).
    Non-finite scores raise ValueError (SciPy's). Ties: any optimal permutation.
    """
    S = _square_scores(scores)
    return _perm_from_assignment(*scipy.optimize.linear_sum_assignment(S, maximize=maximize), S.shape[0])


def _square_scores(scores):
    S = np.asarray(scores)
    if S.ndim != 2 or S.shape[0] != S.shape[1]:
        raise ValueError(f"scores must be a square (n, n) matrix, got shape {S.shape}")
    return S.astype(np.float64)


def _perm_from_assignment(rows, cols, n):
    # rows == arange(n): B unit rows[k] goes to A slot cols[k]; p is the inverse map.
    p = np.empty(n, dtype=np.int64)
    p[cols] = rows
    return p


def linear_assignments(scores, maximize: bool = True) -> list[np.ndarray]:
    """Host. `linear_assignment` of each matrix of the sequence `scores` (NumPy or JAX arrays,
    shapes may differ), solved by a pool of threads: SciPy releases the GIL while it solves
    (measured on the 2-core development machine: 6 random 3072x3072 problems 4.7 s in a loop,
    2.8 s on 2 threads). Each matrix is fetched inside its worker, so a device array still being
    computed is awaited there while earlier problems are solved. Returns int64 permutations."""
    scores = list(scores)
    if len(scores) <= 1:
        return [linear_assignment(s, maximize=maximize) for s in scores]
    workers = min(len(scores), os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(functools.partial(linear_assignment, maximize=maximize), scores))


def batched_linear_assignment(scores, maximize: bool = True) -> np.ndarray:
    """Host (NumPy/SciPy). `linear_assignment` of every (n, n) matrix of `scores` (..., n, n);
    returns (..., n) int32, same convention (`B'[j] = B[p[j]]`, maximising `sum_j S[p[j], j]`),
    solved as `linear_assignments` does."""
    S = np.asarray(scores)
    if S.ndim < 2 or S.shape[-1] != S.shape[-2]:
        raise ValueError(f"scores must have shape (..., n, n), got {S.shape}")
    batch, n = S.shape[:-2], S.shape[-1]
    perms = linear_assignments(S.reshape((-1, n, n)), maximize=maximize)
    return np.stack(perms).astype(np.int32).reshape(batch + (n,))
