"""The orthogonal polar factor and Procrustes within the attention groups (MATH.md section 2):
polar, rope_polar, polar_stack (and their hashable forms RopePolar, StackedPolar), nuclear_norm."""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputError
from ..options import DEFAULT_POLAR_METHOD, POLAR_METHODS
from ..precision import exact_jit, upcast
from .batched import batch_cond, check_square, eye_like, fro, mT, norms, spread

Array = jax.Array

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
# multiply-adds of one batched matmul (B n^3) from which XLA:CPU gets the batch in parts (`_batch_parts`)
PARTS_MIN_WORK = 1 << 28



def _polar_svd(M: Array) -> Array:
    # LAPACK gesvd (QR iteration) on CPU: as exact as jnp.linalg.svd's gesdd (divide and conquer)
    # and faster on these sizes, most of all on a loaded machine. For M = 0 it returns U = V = I.
    finite = spread(_finite(M), M)
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
    safe = jnp.where(spread(norms(M) == 0, M), eye_like(M), M)  # a flat batch (B, n, n)
    return jax.vmap(lambda m: jax.scipy.linalg.polar(m, method="qdwh")[0])(safe)


def _unit_start(M: Array) -> Array:
    """M / ||M||_F per matrix of a flat batch; the identity for M = 0."""
    norm = norms(M)
    zero = norm == 0
    return jnp.where(spread(zero, M), eye_like(M), M / spread(jnp.where(zero, 1, norm), M))


def _scaled_newton(M: Array, iters: int) -> Array:
    """`iters` Frobenius-scaled Newton steps  X <- (z X + (z X)^{-T}) / 2,
    `z = sqrt(||X^{-1}||_F / ||X||_F)`, from X0 = M / ||M||_F (M = 0: from the identity), on a
    flat batch (B, n, n). They keep the singular vectors of M and map every singular value to a
    positive one; all converge to 1 quadratically (8 steps reach float32 accuracy for condition
    numbers up to ~1e6). Unrolled: a while loop here also broke XLA:GPU's compiler (`spread`)."""
    X = _unit_start(M)
    for _ in range(iters):
        Xi = jnp.linalg.inv(X)
        z = spread(jnp.sqrt(norms(Xi) / norms(X)), X)
        X = 0.5 * (z * X + mT(Xi) / z)
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

    def direct(starts):
        return _join([_schulz_apply(X, A, _schulz_schedule(n, dtype)[SCHULZ_CHECK:])[0] for X, A, _ in starts])

    def newton_first(starts):
        Y = _scaled_newton(_join([X for X, _, _ in starts]), 1)
        steps = _schulz_schedule(n, dtype, SCHULZ_NEWTON_COND)
        return _join([_schulz_apply(*_schulz_scaled(p), steps)[0] for p in _batch_parts(Y)])

    return _guarded(M, batch_cond(inside, direct, newton_first, starts))


def _batch_parts(M: Array) -> list[Array]:
    """A flat batch M (B, n, n) as up to os.cpu_count() parts of the flattened batch on XLA:CPU,
    where it is large (B n^3 >= PARTS_MIN_WORK); one part elsewhere: a GPU runs the whole batch in
    one matmul, and parts only add launches. Each part is a chain of its own in the program, so
    parts cost compile time (0.1-0.25 s a program on 2 cores) and gain run time only on large
    batches (2 cores: 1024 64x64 matrices 365 -> 333 ms; 288 64x64 or 72 32x32 the same)."""
    large = M.shape[0] * M.shape[-1] ** 3 >= PARTS_MIN_WORK
    k = max(1, min(os.cpu_count() or 1, M.shape[0] // 32)) if large and jax.default_backend() == "cpu" else 1
    if k == 1:
        return [M]
    bounds = np.linspace(0, M.shape[0], k + 1).astype(int)
    return [M[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _join(parts: list[Array]) -> Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _schulz_scaled(X: Array) -> tuple[Array, Array]:
    """X / sqrt(lam) and its Gram matrix, lam = ||A^4||_F^(1/4) >= lambda_max(A) = sigma_max(X)^2
    (A = X^T X): at most n^(1/16) too large in sigma, exact for one dominant singular value."""
    A = mT(X) @ X
    A4 = A @ A
    A4 = A4 @ A4
    lam = jnp.sqrt(jnp.sqrt(norms(A4)))
    return X / spread(jnp.sqrt(lam), X), A / spread(lam, A)


def _schulz_apply(X: Array, A: Array, steps) -> tuple[Array, Array]:
    """The steps (a, b, E) from X and A = X^T X: the result and its Gram matrix. A loop over the
    steps' coefficients: XLA compiles one step, not each (its compile time on CPU grows with
    every matmul it emits)."""
    if not steps:
        return X, A

    def step(carry, ab):
        X, A = carry
        X = ab[0] * X + ab[1] * (X @ A)
        return (X, mT(X) @ X), None

    coefficients = jnp.asarray([(a, b) for a, b, _ in steps], X.dtype)
    return jax.lax.scan(step, (X, A), coefficients)[0]


def _schulz_start(M: Array) -> tuple[Array, Array, Array]:
    """The scaling and the first SCHULZ_CHECK steps of `_newton_schulz`: (X, X^T X, inside)."""
    n = M.shape[-1]
    X = _unit_start(M)
    schedule = _schulz_schedule(n, jnp.dtype(M.dtype).name)
    X, A = _schulz_apply(*_schulz_scaled(X), schedule[:SCHULZ_CHECK])
    # singular values in [1 - E, 1 + E] => ||A - I||_2 <= (1 + E)^2 - 1
    bound = (1 + schedule[SCHULZ_CHECK - 1][2]) ** 2 - 1
    dev = A - jnp.eye(n, dtype=A.dtype)
    lower = jnp.maximum(jnp.max(jnp.abs(jnp.diagonal(dev, axis1=-2, axis2=-1)), axis=-1), norms(dev) / math.sqrt(n))
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
    return jnp.max(jnp.abs(mT(X) @ X - jnp.eye(X.shape[-1], dtype=X.dtype)), axis=(-2, -1))


def _guarded(M: Array, X: Array) -> Array:
    """Replace results that are not orthogonal to working precision (non-finite, or iterations not
    converged: rank-deficient or extremely ill-conditioned M) by the SVD polar factor. The
    iterations only ever map singular values to positive ones, so an orthogonal result is the
    polar factor. The SVD runs only when some matrix of the batch (of every model, under vmap:
    `batch_cond`) needs it. M, X: flat batches (B, n, n)."""
    n = M.shape[-1]
    tol = max(1e-5, 10.0 * math.sqrt(n) * float(jnp.finfo(X.dtype).eps))
    err = _orthogonality_error(X)
    bad = ~(err <= tol)  # catches NaN
    return batch_cond(~jnp.any(bad), lambda M, X, bad: X, lambda M, X, bad: jnp.where(spread(bad, X), _polar_svd(M), X), M, X, bad)


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
    check_square(M)
    if method not in POLAR_METHODS:
        raise InputError(f"unknown polar method {method!r}; expected one of {POLAR_METHODS}")
    if method == "svd":
        return _polar_svd(M)
    flat = M.reshape((-1,) + M.shape[-2:])  # the iterations work on flat batches (see `spread`)
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
    check_square(M)
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
        raise InputError(f"rotary_dim={rotary_dim} must be even and in [0, {n}]")
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
    return jnp.where(spread(_finite(M), M), R, jnp.nan)


def rope_signs(M: Array, rotary_dim: int) -> Array:
    """Maximiser of `tr(R^T M)` over the QK-norm group (MATH §1): diagonal sign flips, one sign
    for both entries of a rotary pair (i, i + r/2) (a rotation by pi; one entry alone would be a
    reflection, which RoPE does not commute with) and one per entry past the rotary part. The
    pair's sign is that of M_ii + M_jj, an entry's that of M_kk (ties: +1)."""
    M = upcast(M)
    n = M.shape[-1]
    r = _check_rotary(rotary_dim or 0, n)
    half = r // 2
    diag = jnp.diagonal(M, axis1=-2, axis2=-1)
    pair = diag[..., :half] + diag[..., half:r]
    signs = jnp.where(jnp.concatenate([pair, pair, diag[..., r:]], axis=-1) < 0, -1.0, 1.0).astype(M.dtype)
    return _nan_where_nonfinite(M, signs[..., None, :] * jnp.eye(n, dtype=M.dtype))


def sign_score(M: Array, rotary_dim: int) -> Array:
    """`max tr(R^T M)` over the QK-norm group (`rope_signs`): sum |M_ii + M_jj| + sum |M_kk|."""
    n = M.shape[-1]
    r = _check_rotary(rotary_dim or 0, n)
    diag = jnp.diagonal(M, axis1=-2, axis2=-1)
    return jnp.sum(jnp.abs(diag[..., : r // 2] + diag[..., r // 2 : r]), axis=-1) + jnp.sum(jnp.abs(diag[..., r:]), axis=-1)


@functools.partial(exact_jit, static_argnames=("rotary_dims", "method", "signs"))
def polar_stack(M, rotary_dims: tuple, method: str = DEFAULT_POLAR_METHOD, signs: tuple = ()) -> Array:
    """Maximisers of `tr(R^T M)` for `k` problems stacked on axis -3 of `M` (..., k, n, n):
    slot `s` is `polar(M[..., s, :, :], method)` where `rotary_dims[s]` is None or 0, else
    `rope_polar(M[..., s, :, :], rotary_dims[s], method)`; `rope_signs` where `signs[s]` is true
    (a QK-norm block's QK).

    Every polar factor comes from ONE `polar` call on a stacked batch, so a program holds one
    chain of LAPACK calls (two running at once can deadlock XLA:CPU: see the note at
    `DEFAULT_POLAR_METHOD`), and batching them is faster. A partial-rotary block `B = M[r:, r:]`
    enters as the n x n matrix `diag(c I_r, B)`, whose polar factor is `diag(I_r, polar(B))`
    (the iterations and the SVD act on each diagonal block separately); `c = ||B||_F /
    sqrt(n - r)` is the RMS singular value of `B`, inside its singular value range, so the
    condition number stays that of `B` (`B = 0` gives `c = 0` and the identity, as `polar`)."""
    M = upcast(M)
    check_square(M)
    n = M.shape[-1]
    if M.ndim < 3 or M.shape[-3] != len(rotary_dims):
        raise InputError(f"M must have shape (..., {len(rotary_dims)}, n, n) for rotary_dims={rotary_dims}, got {M.shape}")
    dims = [0 if r is None else _check_rotary(r, n) for r in rotary_dims]
    signed = [bool(signs[slot]) if slot < len(signs) else False for slot in range(len(dims))]
    if not any(dims) and not any(signed):
        return polar(M, method)
    out, blocks, slots = [], [], []
    for slot, r in enumerate(dims):
        m = M[..., slot, :, :]
        if signed[slot]:
            out.append(rope_signs(m, r))
            continue
        out.append(None if r == 0 else _rope_pairs(m, r))
        if r == 0:
            blocks.append(m)
        elif r < n:
            sub = m[..., r:, r:]
            c = fro(sub) / math.sqrt(n - r)
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
    signs: tuple = ()

    def __call__(self, M) -> Array:
        return polar_stack(M, self.rotary_dims, self.method, self.signs)


@exact_jit
def nuclear_norm(M) -> Array:
    """`||M||_* = sum of singular values` over the last two axes (= `max_R tr(R^T M)`)."""
    M = upcast(M)
    finite = _finite(M)
    singular_values = jnp.linalg.svd(_nonfinite_as_zero(M, spread(finite, M)), compute_uv=False)
    return jnp.where(finite, jnp.sum(singular_values, axis=-1), jnp.nan)
