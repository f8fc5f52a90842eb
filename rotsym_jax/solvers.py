"""Numerical solvers for aligning one model to another (MATH.md sections 2 to 5).

Device functions (jittable, batched over arbitrary leading axes, computed in float32 at least:
float16 / bfloat16 / integer inputs are upcast to float32, float64 stays float64):

    polar(M)                         orthogonal polar factor U V^T of M = U S V^T (Procrustes)
    rope_polar(M, rotary_dim)        the same maximiser within the RoPE group SO(2)^(r/2) x O(n-r)
    polar_stack(M, rotary_dims)      several of those (stacked on axis -3) by one polar call
    RopePolar, StackedPolar          those projections as hashable values (`rescale_joint`'s project)
    nuclear_norm(M)                  sum of singular values
    rescale_sequential(...)          best scalar a > 0 for a fixed rotation (quartic, Eq. 11-12)
    rescale_joint(Mq, Mk, ...)       exact joint optimum over (a, R) by a 1-D search over log a
    objective_value(R, a, ...)       the QK/VO alignment cost, up to a constant
    certified_assignment(S)          the assignment of each column's best row, and whether that
                                     is provably optimal (then no host solver is needed)

Host functions (NumPy / SciPy, not jittable):

    linear_assignment(S)             permutation p maximising sum_j S[p[j], j]
    linear_assignments([S, ...])     the same for a sequence, on a thread pool
    batched_linear_assignment(S)     the same over leading axes

and their bridge, usable anywhere: `assign(S)`, `batched_linear_assignment` on concrete arrays and
through `jax.pure_callback` on traced ones (inside jit, vmap, grad-free training steps).

The device functions are wrapped in `precision.exact_jit` (`jax.jit` with every matmul at full
float32 precision; string/int/callable options are static), so eager calls are compiled once per
shape; they can also be called inside other jitted code.

Conventions (MATH.md section 2): `R` acts by right-multiplication, `x @ R`; for cross products
`M = X_B^T X_A` the orthogonal maximiser of `tr(R^T M)` is the `R` for which `X_B @ R` is closest
to `X_A`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

from .options import DEFAULT_POLAR_METHOD, POLAR_METHODS
from .precision import exact_jit, upcast

Array = jax.Array

__all__ = [
    "POLAR_METHODS",
    "DEFAULT_POLAR_METHOD",
    "polar",
    "rope_polar",
    "polar_stack",
    "nuclear_norm",
    "rescale_sequential",
    "rescale_joint",
    "objective_value",
    "linear_assignment",
    "linear_assignments",
    "certified_assignment",
    "batched_linear_assignment",
]

# POLAR_METHODS and DEFAULT_POLAR_METHOD live in `options` (the command line reads them before JAX loads).
# "newton_schulz" is the default: matmul steps, with one LAPACK inverse first on ill-conditioned
# batches; the fastest method on CPU and GPU (benchmarks/polar_methods.py) and as accurate as the
# SVD (`_guarded` hands the SVD whatever did not converge). One call per program: two independent
# iterative polar calls in one jitted program can deadlock XLA:CPU (jax 0.10.2), so `align`
# stacks QK and VO (`polar_stack`) and every other batch into one call.

# "newton": fixed number of Frobenius-scaled Newton steps.
NEWTON_ITERS = 8
# "newton_schulz": matmul-only steps designed for condition numbers <= SCHULZ_MAX_COND (the
# cross products of related models: planted pairs about 2.3); a batch with a matrix outside that
# (unrelated models: about 250, up to 5e4) takes one Newton step (LAPACK inverse), then steps
# designed for SCHULZ_NEWTON_COND; what is still not orthogonal takes the SVD. See `_newton_schulz`.
SCHULZ_MAX_COND = 4.0
SCHULZ_NEWTON_COND = 100.0
SCHULZ_CHECK = 2


# ----------------------------------------------------------------------------------------------
# helpers


def _check_square(M: Array, name: str = "M") -> None:
    if M.ndim < 2 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"{name} must have shape (..., n, n), got {M.shape}")


def _mT(x: Array) -> Array:
    return jnp.swapaxes(x, -1, -2)


def _fro(x: Array) -> Array:
    """Frobenius norm over the last two axes, keeping them (shape (..., 1, 1))."""
    return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))


def _norms(x: Array) -> Array:
    """Frobenius norms of a flat batch (B, n, n): shape (B,)."""
    return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1)))


def _spread(s: Array, X: Array) -> Array:
    """Per-matrix values s (...) spread over a batch X (..., n, n) by one broadcast_in_dim.
    The iterations below use this, never (B, 1, 1) arrays: XLA:GPU (jax 0.11.2) rewrote such
    broadcasts inside lax.cond branches into invalid HLO (an hlo_verifier RET_CHECK)."""
    return jax.lax.broadcast_in_dim(s, X.shape, tuple(range(s.ndim)))


def _spread_over_rows(v: Array, X: Array) -> Array:
    """Per-column values v (..., n) spread over X (..., m, n) (each row gets v), as `_spread`."""
    return jax.lax.broadcast_in_dim(v, X.shape, tuple(range(v.ndim - 1)) + (X.ndim - 1,))


def _trace_inner(R: Array, X: Array) -> Array:
    """tr(R^T X) = <R, X> over the last two axes."""
    return jnp.sum(R * X, axis=(-2, -1))


def _eye_like(M: Array) -> Array:
    return jnp.broadcast_to(jnp.eye(M.shape[-1], dtype=M.dtype), M.shape)


# ----------------------------------------------------------------------------------------------
# polar factor


def _polar_svd(M: Array) -> Array:
    # LAPACK gesvd (QR iteration) on CPU: as exact as jnp.linalg.svd's gesdd (divide and conquer)
    # and faster on these sizes, most of all on a loaded machine. For M = 0 it returns U = V = I.
    finite = _spread(_finite(M), M)
    u, _, vt = jax.lax.linalg.svd(
        _nonfinite_as_zero(M, finite), full_matrices=False, algorithm=jax.lax.linalg.SvdAlgorithm.QR
    )
    return jnp.where(finite, u @ vt, jnp.nan)


def _finite(M: Array) -> Array:
    return jnp.all(jnp.isfinite(M), axis=(-2, -1))


def _nonfinite_as_zero(M: Array, finite: Array) -> Array:
    """LAPACK's SVD never returns on a matrix holding Inf or NaN (measured: hangs on CPU), so such
    matrices enter it as zeros, and their results are set to NaN by the caller."""
    return jnp.where(finite, M, 0.0)


def _polar_qdwh(M: Array) -> Array:
    safe = jnp.where(_spread(_norms(M) == 0, M), _eye_like(M), M)  # a flat batch (B, n, n)
    return jax.vmap(lambda m: jax.scipy.linalg.polar(m, method="qdwh")[0])(safe)


def _unit_start(M: Array) -> Array:
    """M / ||M||_F per matrix of a flat batch; the identity for M = 0."""
    norm = _norms(M)
    zero = norm == 0
    return jnp.where(_spread(zero, M), _eye_like(M), M / _spread(jnp.where(zero, 1, norm), M))


def _scaled_newton(M: Array, iters: int) -> Array:
    """`iters` Frobenius-scaled Newton steps  X <- (z X + (z X)^{-T}) / 2,
    `z = sqrt(||X^{-1}||_F / ||X||_F)`, from X0 = M / ||M||_F (M = 0: from the identity), on a
    flat batch (B, n, n). They keep the singular vectors of M and map every singular value to a
    positive one; all converge to 1 quadratically (8 steps reach float32 accuracy for condition
    numbers up to ~1e6). Unrolled: a while loop here also broke XLA:GPU's compiler (`_spread`)."""
    X = _unit_start(M)
    for _ in range(iters):
        Xi = jnp.linalg.inv(X)
        z = _spread(jnp.sqrt(_norms(Xi) / _norms(X)), X)
        X = 0.5 * (z * X + _mT(Xi) / z)
    return X


def _newton_schulz(M: Array) -> Array:
    """Polar factor by Newton-Schulz steps `X <- a X + b X (X^T X)` (matmul only).

    X0 = M / ||M||_F (M = 0: the identity) is divided by `sqrt(lam)`, a guaranteed bound on
    sigma_max(X0)^2 (`_schulz_scaled`), so its singular values lie in (0, 1]; then the steps of
    `_schulz_schedule(SCHULZ_MAX_COND)`, designed for singular values in
    [1 / (SCHULZ_MAX_COND n^(1/16)), 1]. Every step acts on each singular value separately, maps
    (0, u] into (0, u'] and keeps it positive, so a result that is orthogonal to working
    precision is the polar factor (`_guarded` checks it and gives the others the SVD's factor).

    After SCHULZ_CHECK steps, a batch with some matrix provably outside that design (its
    ||X^T X - I||_2, bounded below by the largest diagonal deviation and ||.||_F / sqrt(n),
    beyond what the schedule allows; one branch for the batch: XLA cannot take a subset) goes on
    from there with one Frobenius-scaled Newton step `X <- (z X + (z X)^{-T}) / 2`, which maps
    the condition number k to about sqrt(k) and keeps the singular vectors, then the steps of
    `_schulz_schedule(SCHULZ_NEWTON_COND)`. The Newton step also keeps the result as accurate as
    the SVD's on ill-conditioned M (matmul steps alone from k ~ 1e4: 3e-5 off in float32).
    M is a flat batch (B, n, n)."""
    # XLA:CPU runs one batched matmul of these sizes on one thread: independent chains on parts
    # of the batch let it use the other cores.
    starts = [_schulz_start(p) for p in _batch_parts(M)]
    inside = jnp.all(jnp.stack([jnp.all(s[2]) for s in starts]))
    n, dtype = M.shape[-1], jnp.dtype(M.dtype).name

    def direct():
        return _join([_schulz_apply(X, A, _schulz_schedule(n, dtype)[SCHULZ_CHECK:])[0] for X, A, _ in starts])

    def newton_first():
        Y = _scaled_newton(_join([X for X, _, _ in starts]), 1)
        steps = _schulz_schedule(n, dtype, SCHULZ_NEWTON_COND)
        return _join([_schulz_apply(*_schulz_scaled(p), steps)[0] for p in _batch_parts(Y)])

    return _guarded(M, jax.lax.cond(inside, direct, newton_first))


def _batch_parts(M: Array) -> list[Array]:
    """A flat batch M (B, n, n) as up to os.cpu_count() parts of the flattened batch on XLA:CPU (one if it
    is small); one part elsewhere: a GPU runs the whole batch in one matmul, and parts only add
    launches."""
    k = max(1, min(os.cpu_count() or 1, M.shape[0] // 32)) if jax.default_backend() == "cpu" else 1
    if k == 1:
        return [M]
    bounds = np.linspace(0, M.shape[0], k + 1).astype(int)
    return [M[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _join(parts: list[Array]) -> Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _schulz_scaled(X: Array) -> tuple[Array, Array]:
    """X / sqrt(lam) and its Gram matrix, lam = ||A^4||_F^(1/4) >= lambda_max(A) = sigma_max(X)^2
    (A = X^T X): at most n^(1/16) too large in sigma, exact for one dominant singular value."""
    A = _mT(X) @ X
    A4 = A @ A
    A4 = A4 @ A4
    lam = jnp.sqrt(jnp.sqrt(_norms(A4)))
    return X / _spread(jnp.sqrt(lam), X), A / _spread(lam, A)


def _schulz_apply(X: Array, A: Array, steps) -> tuple[Array, Array]:
    """The steps (a, b, E) from X and A = X^T X: the result and its Gram matrix."""
    for a, b, _ in steps:
        X = a * X + b * (X @ A)
        A = _mT(X) @ X  # unused after the last step: XLA drops it
    return X, A


def _schulz_start(M: Array) -> tuple[Array, Array, Array]:
    """The scaling and the first SCHULZ_CHECK steps of `_newton_schulz`: (X, X^T X, inside)."""
    n = M.shape[-1]
    X = _unit_start(M)
    schedule = _schulz_schedule(n, jnp.dtype(M.dtype).name)
    X, A = _schulz_apply(*_schulz_scaled(X), schedule[:SCHULZ_CHECK])
    # singular values in [1 - E, 1 + E] => ||A - I||_2 <= (1 + E)^2 - 1
    bound = (1 + schedule[SCHULZ_CHECK - 1][2]) ** 2 - 1
    dev = A - jnp.eye(n, dtype=A.dtype)
    lower = jnp.maximum(jnp.max(jnp.abs(jnp.diagonal(dev, axis1=-2, axis2=-1)), axis=-1), _norms(dev) / math.sqrt(n))
    return X, A, lower <= bound  # False for NaN too


def _schulz_schedule(n: int, dtype: str, max_cond: float = SCHULZ_MAX_COND) -> tuple[tuple[float, float, float], ...]:
    """Steps (a, b, E) of `_newton_schulz`: p(x) = a x + b x^3 maps [l, u] into [1 - E, 1 + E],
    starting from l = 1 / (max_cond n^(1/16)), u = 1. Each step is the minimax cubic for the
    interval the previous one left: with s = u^2 + u l + l^2, p(x) = c (s x - x^3) has
    p(l) = p(u) and its maximum at x* = sqrt(s / 3) (increasing on [0, x*]: values below l stay
    positive); c = 2 / (f(l) + f(x*)) gives p(l) = 1 - E, p(x*) = 1 + E (equioscillation). Up to
    E < eps / 4 (n = 64, float32: 5 steps, E = 0.39, 0.11, 9e-3, 7e-5, 4e-9; max_cond = 100:
    9 steps)."""
    lo, hi = 1.0 / (max_cond * n ** (1 / 16)), 1.0
    tol = float(np.finfo(dtype).eps) / 4
    steps = []
    for _ in range(60):
        s = hi * hi + hi * lo + lo * lo
        f = lambda x, s=s: s * x - x**3
        c = 2 / (f(lo) + f(math.sqrt(s / 3)))
        err = c * f(math.sqrt(s / 3)) - 1
        steps.append((c * s, -c, err))
        if err < tol:
            break
        lo, hi = 1 - err, 1 + err
    return tuple(steps)


def _orthogonality_error(X: Array) -> Array:
    return jnp.max(jnp.abs(_mT(X) @ X - jnp.eye(X.shape[-1], dtype=X.dtype)), axis=(-2, -1))


def _guarded(M: Array, X: Array) -> Array:
    """Replace results that are not orthogonal to working precision (non-finite, or iterations not
    converged: rank-deficient or extremely ill-conditioned M) by the SVD polar factor. The
    iterations only ever map singular values to positive ones, so an orthogonal result is the
    polar factor. The SVD runs only when some matrix of the batch needs it (under an outer vmap,
    `lax.cond` becomes a select and it always runs). M, X: flat batches (B, n, n)."""
    n = M.shape[-1]
    tol = max(1e-5, 10.0 * math.sqrt(n) * float(jnp.finfo(X.dtype).eps))
    err = _orthogonality_error(X)
    bad = ~(err <= tol)  # catches NaN
    return jax.lax.cond(
        jnp.any(bad),
        lambda: jnp.where(_spread(bad, X), _polar_svd(M), X),
        lambda: X,
    )


@functools.partial(exact_jit, static_argnames=("method",))
def polar(M, method: str = DEFAULT_POLAR_METHOD) -> Array:
    """Orthogonal polar factor of `M` (..., n, n): with `M = U S V^T`, returns `R = U V^T`.

    `R` solves the orthogonal Procrustes problem  `R = argmax_{R^T R = I} tr(R^T M)`;  for
    `M = X_B^T X_A` it minimises `||X_B R - X_A||_F` (apply as `x @ R`). The optimum value is
    `tr(R^T M) = ||M||_*`.

    Methods (all within 1e-5 of a float64 SVD's factor on random and planted cross products;
    timings for 288 matrices 64x64 on a 2-core CPU in benchmarks/polar_methods.py):
      "svd"            LAPACK gesvd (QR iteration) on CPU.
      "newton"         `NEWTON_ITERS` Frobenius-scaled Newton steps from `M / ||M||_F`.
      "newton_schulz"  (default) minimax cubic Newton-Schulz steps (matmul only); a batch
                       outside their design (condition number > `SCHULZ_MAX_COND`) takes one
                       Newton step first (see `_newton_schulz`). The fastest on CPU, most of all
                       for near-orthogonal cross products; see the note at
                       `DEFAULT_POLAR_METHOD` before calling it twice in one jitted program.
      "qdwh"           `jax.scipy.linalg.polar(method="qdwh")` (QR-based dynamically weighted
                       Halley), vmapped.
    The iterative methods check their result (orthogonality to working precision) and replace
    the matrices that fail by the SVD factor (see `_guarded`); the SVD only runs when some
    matrix fails.

    Rank-deficient `M`: the factor is not unique (any orthogonal completion on the null space is
    optimal); every method returns some orthogonal maximiser, never NaN. `M = 0` gives the
    identity. Non-finite `M` gives NaN.
    """
    M = upcast(M)
    _check_square(M)
    if method not in POLAR_METHODS:
        raise ValueError(f"unknown polar method {method!r}; expected one of {POLAR_METHODS}")
    if method == "svd":
        return _polar_svd(M)
    flat = M.reshape((-1,) + M.shape[-2:])  # the iterations work on flat batches (see `_spread`)
    if method == "newton":
        R = _guarded(flat, _scaled_newton(flat, NEWTON_ITERS))
    elif method == "newton_schulz":
        R = _newton_schulz(flat)
    else:
        R = _guarded(flat, _polar_qdwh(flat))
    return R.reshape(M.shape)


@functools.partial(exact_jit, static_argnames=("rotary_dim", "method"))
def rope_polar(M, rotary_dim: int, method: str = DEFAULT_POLAR_METHOD) -> Array:
    """Maximiser of `tr(R^T M)` over the RoPE-compatible group (MATH.md sections 1-2).

    Rotary pairs are `(i, j = i + rotary_dim/2)`, `i < rotary_dim/2` (HF rotate_half layout). On
    each pair `R` is the 2-D rotation  `R[i,i] = R[j,j] = cos t, R[i,j] = sin t, R[j,i] = -sin t`
    with  `t = atan2(M[i,j] - M[j,i], M[i,i] + M[j,j])`  (the pair's contribution to the trace is
    `cos t (M_ii + M_jj) + sin t (M_ij - M_ji)`). No reflections. Dimensions `>= rotary_dim` get
    `polar` of the block `M[r:, r:]`; all other entries are 0. A pair with a zero 2x2 signal gets
    the identity. `rotary_dim = 0` is plain `polar`.
    """
    M = upcast(M)
    _check_square(M)
    n = M.shape[-1]
    r = _check_rotary(rotary_dim, n)
    if r == 0:
        return polar(M, method)
    R = _rope_pairs(M, r)
    if r < n:
        R = R.at[..., r:, r:].set(polar(M[..., r:, r:], method))
    return _nan_where_nonfinite(M, R)


def _check_rotary(rotary_dim, n: int) -> int:
    r = int(rotary_dim)
    if r % 2 or not 0 <= r <= n:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and in [0, {n}]")
    return r


def rope_pair_terms(M: Array, r: int) -> tuple[Array, Array]:
    """Per rotary pair (i, j = i + r/2): (M_ii + M_jj, M_ij - M_ji). Their angle is the pair's
    best rotation (MATH §2), their length the best value of tr(R^T M) on the pair."""
    i = np.arange(r // 2)
    j = i + r // 2
    return M[..., i, i] + M[..., j, j], M[..., i, j] - M[..., j, i]


def _rope_pairs(M: Array, r: int) -> Array:
    """The 2-D rotations of the rotary pairs of `rope_polar` (r > 0); zeros elsewhere."""
    i = np.arange(r // 2)
    j = i + r // 2
    cos_part, sin_part = rope_pair_terms(M, r)
    theta = jnp.arctan2(sin_part, cos_part)
    c, s = jnp.cos(theta), jnp.sin(theta)
    R = jnp.zeros_like(M)
    return R.at[..., i, i].set(c).at[..., j, j].set(c).at[..., i, j].set(s).at[..., j, i].set(-s)


def _nan_where_nonfinite(M: Array, R: Array) -> Array:
    """NaN factors for non-finite M: atan2 would turn an Inf into a finite angle."""
    return jnp.where(_spread(_finite(M), M), R, jnp.nan)


@functools.partial(exact_jit, static_argnames=("rotary_dims", "method"))
def polar_stack(M, rotary_dims: tuple, method: str = DEFAULT_POLAR_METHOD) -> Array:
    """Maximisers of `tr(R^T M)` for `k` problems stacked on axis -3 of `M` (..., k, n, n):
    slot `s` is `polar(M[..., s, :, :], method)` where `rotary_dims[s]` is None or 0, else
    `rope_polar(M[..., s, :, :], rotary_dims[s], method)`.

    Every polar factor comes from ONE `polar` call on a stacked batch, so a program holds one
    chain of LAPACK calls (two running at once can deadlock XLA:CPU: see the note at
    `DEFAULT_POLAR_METHOD`), and batching them is faster. A partial-rotary block `B = M[r:, r:]`
    enters as the n x n matrix `diag(c I_r, B)`, whose polar factor is `diag(I_r, polar(B))`
    (the iterations and the SVD act on each diagonal block separately); `c = ||B||_F /
    sqrt(n - r)` is the RMS singular value of `B`, inside its singular value range, so the
    condition number stays that of `B` (`B = 0` gives `c = 0` and the identity, as `polar`)."""
    M = upcast(M)
    _check_square(M)
    n = M.shape[-1]
    if M.ndim < 3 or M.shape[-3] != len(rotary_dims):
        raise ValueError(f"M must have shape (..., {len(rotary_dims)}, n, n) for rotary_dims={rotary_dims}, got {M.shape}")
    dims = [0 if r is None else _check_rotary(r, n) for r in rotary_dims]
    if not any(dims):
        return polar(M, method)
    out, blocks, slots = [], [], []
    for slot, r in enumerate(dims):
        m = M[..., slot, :, :]
        out.append(None if r == 0 else _rope_pairs(m, r))
        if r == 0:
            blocks.append(m)
        elif r < n:
            sub = m[..., r:, r:]
            c = _fro(sub) / math.sqrt(n - r)
            blocks.append(jnp.zeros_like(m).at[..., :r, :r].set(c * jnp.eye(r, dtype=m.dtype)).at[..., r:, r:].set(sub))
        else:
            continue
        slots.append(slot)
    if blocks:
        P = polar(jnp.stack(blocks, axis=-3), method)
        for k, slot in enumerate(slots):
            r = dims[slot]
            out[slot] = P[..., k, :, :] if r == 0 else out[slot].at[..., r:, r:].set(P[..., k, r:, r:])
    return _nan_where_nonfinite(M, jnp.stack(out, axis=-3))


@dataclasses.dataclass(frozen=True)
class RopePolar:
    """The projection `M -> rope_polar(M, rotary_dim, method)` as a value (hashable, compared by
    its fields), for `rescale_joint(..., project=...)`."""

    rotary_dim: int
    method: str = DEFAULT_POLAR_METHOD

    def __call__(self, M) -> Array:
        return rope_polar(M, self.rotary_dim, self.method)


@dataclasses.dataclass(frozen=True)
class StackedPolar:
    """The projection `M -> polar_stack(M, rotary_dims, method)` as a value."""

    rotary_dims: tuple
    method: str = DEFAULT_POLAR_METHOD

    def __call__(self, M) -> Array:
        return polar_stack(M, self.rotary_dims, self.method)


@exact_jit
def nuclear_norm(M) -> Array:
    """`||M||_* = sum of singular values` over the last two axes (= `max_R tr(R^T M)`)."""
    M = upcast(M)
    finite = _finite(M)
    singular_values = jnp.linalg.svd(_nonfinite_as_zero(M, _spread(finite, M)), compute_uv=False)
    return jnp.where(finite, jnp.sum(singular_values, axis=-1), jnp.nan)


# ----------------------------------------------------------------------------------------------
# rescaling


@exact_jit
def objective_value(R, a, Mq, Mk, s_qq, s_kk) -> Array:
    """`a^2 s_qq + s_kk / a^2 - 2 tr(R^T (a Mq + Mk / a))`: the QK (or VO) alignment cost
    `||a X_q^B R - X_q^A||^2 + ||X_k^B R / a - X_k^A||^2` minus the constant `||X^A||^2`.
    Shapes: R, Mq, Mk (..., n, n); a, s_qq, s_kk (...)."""
    R, Mq, Mk = upcast(R), upcast(Mq), upcast(Mk)
    a, s_qq, s_kk = upcast(a), upcast(s_qq), upcast(s_kk)
    tq, tk = _trace_inner(R, Mq), _trace_inner(R, Mk)
    return a * a * s_qq + s_kk / (a * a) - 2 * (a * tq + tk / a)


def _f_normalised(t, p, q):
    return t * t + 1 / (t * t) - 2 * p * t - 2 * q / t


# `_quartic_minimiser` brackets a root of a monotone function by LEVELS rounds of GRID evenly
# spaced points in log t (a range of 2 log b <= 14 for b <= 1e3 shrinks 31^3 times: 5e-4), then
# takes NEWTON_POLISH Newton steps (quadratic: 5e-4 -> 3e-7 -> float32 precision).
GRID, LEVELS, NEWTON_POLISH = 32, 3, 2


@exact_jit
def rescale_sequential(s_qq, s_qa, s_kk, s_ka) -> Array:
    """Best `a > 0` for a fixed rotation (MATH.md section 3; the paper's Eq. 11-12):

        minimise  f(a) = a^2 s_qq - 2 a s_qa + s_kk / a^2 - 2 s_ka / a,
        stationary points: positive real roots of  s_qq a^4 - s_qa a^3 + s_ka a - s_kk = 0.

    `a = 1` where `s_qq <= 0` or `s_kk <= 0` (degenerate). Inputs broadcast; output has their
    broadcast shape.

    Numerics: substitute `a = a0 t`, `a0 = (s_kk / s_qq)^(1/4)`, which turns the problem into the
    dimensionless `f / sqrt(s_qq s_kk) = t^2 + 1/t^2 - 2 p t - 2 q / t` with
    `p = s_qa / (s_qq^(3/4) s_kk^(1/4))`, `q = s_ka / (s_kk^(3/4) s_qq^(1/4))`, whose stationary
    points are the positive roots of `P(t) = t^4 - p t^3 + q t - 1`; `_quartic_minimiser` brackets
    every local minimiser and bisects it (elementwise arithmetic only: no eigenvalue solver, which
    GPUs run slowly, and an argument accurate to float32 precision, not only its value).
    """
    s_qq, s_qa, s_kk, s_ka = jnp.broadcast_arrays(*map(upcast, (s_qq, s_qa, s_kk, s_ka)))
    dtype = jnp.result_type(s_qq, s_qa, s_kk, s_ka)
    s_qq, s_qa, s_kk, s_ka = (x.astype(dtype) for x in (s_qq, s_qa, s_kk, s_ka))
    degenerate = ~((s_qq > 0) & (s_kk > 0))
    sq = jnp.where(degenerate, 1, s_qq)
    sk = jnp.where(degenerate, 1, s_kk)
    rq, rk = sq**0.25, sk**0.25
    p = jnp.where(degenerate, 0, s_qa / (rq**3 * rk))
    q = jnp.where(degenerate, 0, s_ka / (rk**3 * rq))
    t = _quartic_minimiser(p, q)
    return jnp.where(degenerate, 1, t * (rk / rq))


def _quartic_minimiser(p, q):
    """Global minimiser over t > 0 of `t^2 + 1/t^2 - 2 p t - 2 q / t`, elementwise.

    Its derivative is `2 P(t) / t^3`, `P(t) = t^4 - p t^3 + q t - 1`, so the local minimisers are
    the roots where P crosses zero upwards. P(0) = -1 and every positive root lies in [1/b, b],
    `b = 1 + max(|p|, |q|, 1)` (Cauchy's bound, for P and for its reversed polynomial).
    `P'' = 6 t (2 t - p)`: P' decreases on (0, m), `m = max(p, 0) / 2`, and increases after. If
    P'(m) >= 0, P increases everywhere and has one root. Else P' has the roots c1 < m (when
    P'(0) = q > 0) and c2 > m; P increases on (0, c1) and on (c2, inf), so the upward roots are
    r1 in (0, c1) (when P(c1) > 0) and r3 in (c2, inf) (when P(c2) < 0). Each is bracketed on a
    stretch where its function is monotone (`_bracket`); both are compared by value.
    """
    big = 1 + jnp.maximum(jnp.maximum(jnp.abs(p), jnp.abs(q)), 1)
    lo, hi = -jnp.log(big), jnp.log(big)

    def P(u, p=p, q=q):  # of log t, broadcasting p, q over trailing grid axes
        t = jnp.exp(u)
        return ((t - p) * t * t + q) * t - 1

    def dP(u, p=p, q=q):
        t = jnp.exp(u)
        return (4 * t - 3 * p) * t * t + q

    m = jnp.maximum(p, 0) / 2
    falls = (4 * m - 3 * p) * m * m + q < 0  # P'(m) < 0
    log_m = jnp.clip(jnp.log(jnp.maximum(m, jnp.finfo(p.dtype).tiny)), lo, hi)
    c1 = _bracket(lambda u, p, q: -dP(u, p, q), lo, log_m, p, q)[1]  # P' falls on (0, m)
    c2 = _bracket(dP, log_m, hi, p, q)[0]  # and rises after
    c1, c2 = jnp.where(falls, c1, lo), jnp.where(falls, c2, lo)
    has1, has3 = P(c1) > 0, P(c2) < 0
    r1 = _polished_root(P, dP, *_bracket(P, lo, c1, p, q))
    r3 = _polished_root(P, dP, *_bracket(P, c2, hi, p, q))
    f1 = jnp.where(has1, _f_normalised(r1, p, q), jnp.inf)
    f3 = jnp.where(has3, _f_normalised(r3, p, q), jnp.inf)
    return jnp.where(f1 < f3, r1, r3)


def _bracket(g, lo, hi, p, q):
    """[a, b] within [lo, hi] around the sign change of `g(u, p, q)`, increasing in u: LEVELS
    rounds of GRID points (a = lo side if g >= 0 throughout, b = hi side if g < 0 throughout)."""
    steps = np.arange(GRID)
    for _ in range(LEVELS):
        width = (hi - lo) / (GRID - 1)
        u = lo[..., None] + width[..., None] * steps
        i = jnp.clip(jnp.sum(g(u, p[..., None], q[..., None]) < 0, axis=-1), 1, GRID - 1)
        lo = lo + (i - 1) * width  # a sum of counts, not a gather: XLA:CPU compiles gathers slowly
        hi = lo + width
    return lo, hi


def _polished_root(P, dP, lo, hi):
    """Newton steps on P (a function of log t) from the middle of the bracket [lo, hi] (log t),
    kept inside it; returns t."""
    t_lo, t_hi = jnp.exp(lo), jnp.exp(hi)
    u = (lo + hi) / 2
    for _ in range(NEWTON_POLISH):
        d = dP(u)
        step = jnp.where(d > 0, P(u) / jnp.where(d > 0, d, 1), 0)
        u = jnp.log(jnp.clip(jnp.exp(u) - step, t_lo, t_hi))
    return jnp.exp(u)


def _golden_section(fun, lo, hi, iters):
    """Batched golden-section search for a minimum of `fun` on [lo, hi] (elementwise brackets).
    Returns (x_best, f_best) over every point evaluated. One `fun` evaluation per iteration."""
    inv_phi = (math.sqrt(5) - 1) / 2
    c = hi - inv_phi * (hi - lo)
    d = lo + inv_phi * (hi - lo)
    fc, fd = fun(jnp.stack([c, d]))  # one call: see the note at DEFAULT_POLAR_METHOD
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
    R (..., n, n). Jitted; `grid`, `iters` and `project` are static, so `project` must be
    hashable: `RopePolar(r)` and `StackedPolar(rotary_dims)` compare by value (a new equal one per
    call does not recompile); any other function is compared by identity. Cost: about
    `grid + iters + 6` batched SVDs.
    """
    return _rescale_joint(Mq, Mk, s_qq, s_kk, a_init, grid=grid, iters=iters, project=project)


@functools.partial(exact_jit, static_argnames=("grid", "iters", "project"))
def _rescale_joint(Mq, Mk, s_qq, s_kk, a_init, *, grid, iters, project):
    if project is None:
        project = polar
        h_of = nuclear_norm
    else:

        def h_of(X):
            return _trace_inner(project(X), X)

    Mq, Mk = upcast(Mq), upcast(Mk)
    _check_square(Mq, "Mq")
    _check_square(Mk, "Mk")
    Mq, Mk = jnp.broadcast_arrays(Mq, Mk)
    batch = Mq.shape[:-2]
    s_qq = jnp.broadcast_to(upcast(s_qq), batch).astype(Mq.dtype)
    s_kk = jnp.broadcast_to(upcast(s_kk), batch).astype(Mq.dtype)
    degenerate = ~((s_qq > 0) & (s_kk > 0))
    sq = jnp.where(degenerate, 1, s_qq)
    sk = jnp.where(degenerate, 1, s_kk)

    # 1. sequential, and h(Mq), h(Mk) for step 2: one projection call (independent calls could
    # run at once; see the note at DEFAULT_POLAR_METHOD)
    Rs = project(jnp.stack([Mq + Mk, Mq, Mk]))
    R0 = Rs[0]
    nq, nk = _trace_inner(Rs[1], Mq), _trace_inner(Rs[2], Mk)
    a0 = rescale_sequential(s_qq, _trace_inner(R0, Mq), s_kk, _trace_inner(R0, Mk))
    v0 = objective_value(R0, a0, Mq, Mk, s_qq, s_kk)

    def g_of_u(u):
        a = jnp.exp(u)
        X = a[..., None, None] * Mq + Mk / a[..., None, None]
        return a * a * sq + sk / (a * a) - 2 * h_of(X)

    # 2. bracket [u_lo, u_hi] containing every minimiser
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
        a_init = jnp.broadcast_to(upcast(a_init), batch).astype(Mq.dtype)
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

    Exact. When every column's best row is a different row (or every row's best column a
    different column), that matching is optimal: no assignment beats each column's (row's)
    maximum (`certified_assignment` without offsets), and no solver runs. Otherwise
    `scipy.optimize.linear_sum_assignment` (a shortest augmenting path method) solves it.
    Non-finite scores raise ValueError. Ties: any optimal permutation.
    """
    S = _square_scores(scores)
    if not maximize:  # negated in place: the test below maximises, SciPy minimises
        np.negative(S, out=S)
    p = _host_certificate(S)
    if p is not None:
        return p
    np.negative(S, out=S)  # SciPy's maximize would negate into a second float64 copy
    return _perm_from_assignment(*scipy.optimize.linear_sum_assignment(S), S.shape[0])


def _square_scores(scores):
    S = np.asarray(scores)
    if S.ndim != 2 or S.shape[0] != S.shape[1]:
        raise ValueError(f"scores must be a square (n, n) matrix, got shape {S.shape}")
    S = S.astype(np.float64)  # always a copy: negated in place below
    bad = S.size - np.count_nonzero(np.isfinite(S))
    if bad:
        raise ValueError(f"scores of shape {S.shape} hold {bad} non-finite entries (NaN or Inf); an assignment needs finite scores")
    return S


def _host_certificate(S: np.ndarray):
    """`certified_assignment` of one matrix on the host, without offsets (maximising): the
    permutation or None. The same rule as on the device (first maximum on ties), so both give
    the same answer."""
    n = S.shape[0]
    k = _sample_size(n)
    if _all_different(np.argmax(S[:, :k], axis=0)):
        best_rows = np.argmax(S, axis=0)  # p[j] = the best row of column j
        if _all_different(best_rows):
            return best_rows.astype(np.int64)
    if _all_different(np.argmax(S[:k], axis=1)):
        best_cols = np.argmax(S, axis=1)  # row i's best column; a permutation q gives p = q^-1
        if _all_different(best_cols):
            return _perm_from_assignment(np.arange(n), best_cols, n)
    return None


def _sample_size(n: int) -> int:
    """How many lines a certificate test reads first. Two of them sharing their best line refute
    it, so unrelated models (no certificate) cost a sample, not a pass over the matrix: with
    k = 4 sqrt(n) lines whose best lines were uniformly random, about k^2 / 2n = 8 pairs collide,
    and none with probability e^-8."""
    return min(n, 4 * math.ceil(math.sqrt(n)))


def _all_different(indices: np.ndarray) -> bool:
    return np.unique(indices).size == indices.size


@functools.partial(exact_jit, static_argnames="maximize")
def certified_assignment(scores, row_offsets=None, col_offsets=None, maximize: bool = True) -> tuple[Array, Array]:
    """Device. For scores S (..., n, n): (p (..., n) int32, certified (...) bool), where
    `certified` says that `p` is an optimal assignment of S (same convention as
    `linear_assignment`); where it is False, p means nothing and a solver must run.

    The proof: for any offsets r (rows) and c (columns), every permutation's sum of
    `S'[i, j] = S[i, j] - r[i] - c[j]` is its sum of S minus one constant, so S and S' have the
    same optimal assignments, and  sum_j S'[p[j], j] <= sum_j max_i S'[i, j].  If the best rows of
    the columns of S' are all different, `p[j] = argmax_i S'[i, j]` attains that bound. Otherwise
    the same test on the rows (each row's best column, inverted).

    Offsets matter for real models: there a large unit scores high against every unit it is
    correlated with, so raw inner products rarely peak on the matching units. With half the
    squared unit norms, `r = ||B_i||^2 / 2`, `c = ||A_j||^2 / 2`, S' is `-||B_i - A_j||^2 / 2`
    and the test reads "each unit's nearest unit of the other model is a different one", true
    for a model against itself, for fine-tunes of one base and for permuted copies.

    Exactness: without offsets, the comparisons are of S's own values (ties go to the first
    maximum, as on the host: both give the same answer). With offsets, S' is rounded (each entry
    within `2u (|S| + |r| + |c|)`, u the unit roundoff), so each best entry must beat its
    runner-up by `8u max(|S| + |r| + |c|)` over its line, twice what two entries' errors can
    close, which makes the float argmax the exact one (docs/MATH.md §5).
    Non-finite scores or offsets are never certified (the host refuses them)."""
    S = upcast(scores)
    _check_square(S, "scores")
    for name, o in (("row_offsets", row_offsets), ("col_offsets", col_offsets)):
        if o is not None and np.shape(o) != S.shape[:-1]:
            raise ValueError(f"{name} of shape {np.shape(o)} for scores of shape {S.shape}; expected {S.shape[:-1]}")
    finite = jnp.all(jnp.isfinite(S), axis=(-2, -1))
    offsets = row_offsets is not None or col_offsets is not None
    r = jnp.zeros(S.shape[:-1], S.dtype) if row_offsets is None else upcast(row_offsets)
    c = jnp.zeros(S.shape[:-1], S.dtype) if col_offsets is None else upcast(col_offsets)
    if offsets:
        finite = finite & jnp.all(jnp.isfinite(r), axis=-1) & jnp.all(jnp.isfinite(c), axis=-1)

    # Broadcasts by broadcast_in_dim only (`_spread`): part of this runs in a lax.cond branch.
    def reduced(rows=slice(None), cols=slice(None)):  # S' (signed to maximise) on a block of lines
        part = S[..., rows, cols]
        if offsets:
            part = part - _spread(r[..., rows], part) - _spread_over_rows(c[..., cols], part)
        return part if maximize else -part

    k = _sample_size(S.shape[-1])
    refuted = _collide(jnp.argmax(reduced(cols=slice(k)), axis=-2)) & _collide(jnp.argmax(reduced(rows=slice(k)), axis=-1))

    def test():
        bound = jnp.abs(S) + _spread(jnp.abs(r), S) + _spread_over_rows(jnp.abs(c), S) if offsets else None
        tol = 8 * float(jnp.finfo(S.dtype).eps / 2)
        best_rows, by_columns = _distinct_maxima(reduced(), bound, tol, axis=-2)  # p[j] = best row of j
        best_cols, by_rows = _distinct_maxima(reduced(), bound, tol, axis=-1)  # q[i] = best column of i
        inverse = jnp.argsort(best_cols, axis=-1).astype(jnp.int32)  # q^-1 where q is a permutation
        return jnp.where(_spread(by_columns, best_rows), best_rows, inverse), by_columns | by_rows

    def refute():  # a sample of the lines already shares a best line both ways (`_sample_size`)
        return jnp.zeros(S.shape[:-1], jnp.int32), jnp.zeros(S.shape[:-2], bool)

    p, certified = jax.lax.cond(jnp.all(refuted), refute, test)
    return p, finite & certified


def _collide(indices: Array) -> Array:
    """Whether two of the indices (..., k) are equal."""
    ordered = jnp.sort(indices, axis=-1)
    return jnp.any(ordered[..., 1:] == ordered[..., :-1], axis=-1)


def _distinct_maxima(S: Array, bound, tol: float, axis: int) -> tuple[Array, Array]:
    """The index of each line's maximum along `axis` (first on ties), and whether they are all
    different and (unless `bound` is None: exact values, ties allowed) each maximum leads the
    line's runner-up by more than `tol * max(bound)` over the line."""
    best = jnp.argmax(S, axis=axis).astype(jnp.int32)
    ok = jnp.all(jnp.sort(best, axis=-1) == jax.lax.broadcasted_iota(jnp.int32, best.shape, best.ndim - 1), axis=-1)
    if bound is not None:  # broadcasts as in `certified_assignment`
        spread = _spread if axis == -1 else _spread_over_rows
        is_best = jax.lax.broadcasted_iota(jnp.int32, S.shape, S.ndim + axis) == spread(best, S)
        lead = jnp.max(S, axis=axis) - jnp.max(jnp.where(is_best, -jnp.inf, S), axis=axis)
        ok = ok & jnp.all(lead > tol * jnp.max(bound, axis=axis), axis=-1)
    return best, ok


def _perm_from_assignment(rows, cols, n):
    # rows == arange(n): B unit rows[k] goes to A slot cols[k]; p is the inverse map.
    p = np.empty(n, dtype=np.int64)
    p[cols] = rows
    return p


def linear_assignments(scores, maximize: bool = True, offsets=None) -> list[np.ndarray]:
    """Host. `linear_assignment` of each matrix of the sequence `scores` (NumPy or JAX arrays,
    shapes may differ), solved by a pool of threads: SciPy releases the GIL while it solves.

    A JAX array is first tested on its device (`certified_assignment`, with `offsets[k] =
    (row_offsets, col_offsets)` for matrix k where given): a certified one never leaves it, only
    its permutation does. The others are fetched inside their worker, so a device array still
    being computed is awaited there while earlier problems are solved; SciPy gets them as they
    are (offsets do not change the optimal assignments). Returns int64 permutations."""
    scores = list(scores)
    offsets = [None] * len(scores) if offsets is None else list(offsets)
    if len(offsets) != len(scores):
        raise ValueError(f"{len(offsets)} offsets for {len(scores)} score matrices")
    scores = [_device_certified(s, o, maximize) if isinstance(s, jax.Array) else s for s, o in zip(scores, offsets)]
    if len(scores) <= 1:
        return [_assignment_of(s, maximize) for s in scores]
    workers = min(len(scores), os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(functools.partial(_assignment_of, maximize=maximize), scores))


@dataclasses.dataclass(frozen=True)
class _DeviceScores:
    scores: Array
    perm: Array
    certified: Array


def _device_certified(S: Array, offsets, maximize: bool) -> _DeviceScores:
    if S.ndim != 2 or S.shape[0] != S.shape[1]:
        raise ValueError(f"scores must be a square (n, n) matrix, got shape {S.shape}")
    row, col = (None, None) if offsets is None else offsets
    return _DeviceScores(S, *certified_assignment(S, row, col, maximize=maximize))  # dispatched, not awaited


def _assignment_of(scores, maximize: bool) -> np.ndarray:
    if not isinstance(scores, _DeviceScores):
        return linear_assignment(scores, maximize)
    perm, certified = jax.device_get((scores.perm, scores.certified))
    if certified:
        return perm.astype(np.int64)
    return linear_assignment(scores.scores, maximize)  # the host's own test may still certify it


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


def assign(scores, maximize: bool = True, offsets=None):
    """`batched_linear_assignment` as a JAX operation: (..., n, n) scores -> (..., n) int32.

    With `offsets = (row_offsets, col_offsets)`, each (..., n), the batch is first tested on the
    device (`certified_assignment`); when every matrix is certified, that is the answer and the
    host is not called. Otherwise concrete arrays are solved at once, and traced ones (inside
    `jax.jit` or `jax.vmap`) through `jax.pure_callback`, still exact (SciPy on the host). Under
    vmap the callback receives the whole batch (`vmap_method="broadcast_all"`), so every model's
    matrices share one thread pool (and the test cannot skip it: vmap runs both sides of a
    `lax.cond`). Non-finite scores raise ValueError (inside jit: when the program runs)."""
    traced = isinstance(scores, jax.core.Tracer) or any(isinstance(o, jax.core.Tracer) for o in (offsets or ()))
    if offsets is not None:
        perm, certified = certified_assignment(scores, *offsets, maximize=maximize)
        if not traced and bool(jnp.all(certified)):
            return perm
    if not traced:
        return jnp.asarray(batched_linear_assignment(scores, maximize), jnp.int32)
    solve = functools.partial(batched_linear_assignment, maximize=maximize)
    result = jax.ShapeDtypeStruct(scores.shape[:-1], jnp.int32)
    on_host = lambda: jax.pure_callback(solve, result, scores, vmap_method="broadcast_all")  # noqa: E731
    return on_host() if offsets is None else jax.lax.cond(jnp.all(certified), lambda: perm, on_host)
