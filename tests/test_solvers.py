"""rotsym_jax.solvers against independent references (MATH.md sections 2-5).

References are written here in NumPy float64: the SVD polar factor, Haar-random orthogonal
matrices and a projected-gradient local search on O(n) (Procrustes optimality), random and
brute-force angle grids (RoPE), fine log grids over the scale `a` (rescaling), and brute force
over all permutations (linear assignment).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize as scipy_optimize

from rotsym_jax import solvers
from rotsym_jax.precision import exact_jit
from rotsym_jax.solvers import assignment, procrustes, rescale

FAST = settings(max_examples=12, deadline=None)
SEEDS = st.integers(0, 2**31 - 1)


# ----------------------------------------------------------------------------------------------
# references (NumPy float64)


def ref_polar(M):
    u, _, vt = np.linalg.svd(np.asarray(M, np.float64))
    return u @ vt


def ref_nuclear(M):
    return np.linalg.svd(np.asarray(M, np.float64), compute_uv=False).sum(-1)


def haar_orthogonal(rng, count, n):
    """Haar-distributed orthogonal matrices: QR of a Gaussian with the sign of diag(R) fixed."""
    q, r = np.linalg.qr(rng.standard_normal((count, n, n)))
    return q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]


def local_search(M, R0, steps=300, lr=0.5):
    """Projected gradient ascent of tr(R^T M) on O(n): R <- orthonormalise(R + lr M / ||M||)."""
    M = np.asarray(M, np.float64)
    G = M / np.linalg.norm(M)
    R = R0
    for _ in range(steps):
        R = ref_polar(R + lr * G)
    return R


def ref_rope_polar(M, rotary_dim):
    """NumPy float64 RoPE-group maximiser: per-pair angle, SVD polar factor of the rest."""
    M = np.asarray(M, np.float64)
    half, n = rotary_dim // 2, M.shape[-1]
    i = np.arange(half)
    j = i + half
    theta = np.arctan2(M[..., i, j] - M[..., j, i], M[..., i, i] + M[..., j, j])
    R = np.zeros_like(M)
    R[..., i, i] = R[..., j, j] = np.cos(theta)
    R[..., i, j], R[..., j, i] = np.sin(theta), -np.sin(theta)
    if rotary_dim < n:
        R[..., rotary_dim:, rotary_dim:] = ref_polar(M[..., rotary_dim:, rotary_dim:])
    return R


def trace_inner(R, M):
    return np.sum(np.asarray(R, np.float64) * np.asarray(M, np.float64), axis=(-2, -1))


def cross_products(rng, batch, rows, n, planted=False):
    xb = rng.standard_normal((batch, rows, n)).astype(np.float32)
    if planted:
        q = haar_orthogonal(rng, batch, n)
        xa = (xb @ q + 0.1 * rng.standard_normal((batch, rows, n))).astype(np.float32)
    else:
        xa = rng.standard_normal((batch, rows, n)).astype(np.float32)
    return np.einsum("bri,brj->bij", xb, xa).astype(np.float32)


def f_seq(a, s_qq, s_qa, s_kk, s_ka):
    a = np.asarray(a, np.float64)
    return a * a * s_qq - 2 * a * s_qa + s_kk / (a * a) - 2 * s_ka / a


# ----------------------------------------------------------------------------------------------
# polar


@pytest.mark.parametrize("method", solvers.POLAR_METHODS)
@pytest.mark.parametrize("planted", [False, True], ids=["random", "planted"])
def test_polar_matches_float64_svd(method, planted):
    rng = np.random.default_rng(0)
    M = cross_products(rng, 6, 769, 64, planted=planted)
    R = np.asarray(solvers.polar(M, method=method), np.float64)
    assert R.dtype == np.float64 and np.abs(R - ref_polar(M)).max() < 1e-5
    assert np.abs(np.swapaxes(R, -1, -2) @ R - np.eye(64)).max() < 1e-5
    np.testing.assert_allclose(trace_inner(R, M), ref_nuclear(M), rtol=1e-6)


def test_newton_schulz_branches(monkeypatch):
    # Near-orthogonal (planted) cross products stay inside the design and converge in the matmul
    # steps alone, to the float64 SVD factor; ill-conditioned random ones (condition numbers up to
    # ~5e4 here) take the Newton step first, and come out as accurate as the SVD, with no SVD.
    rng = np.random.default_rng(0)
    start = exact_jit(procrustes._schulz_start)
    finish = exact_jit(lambda X, A: procrustes._schulz_apply(X, A, procrustes._schulz_schedule(64, "float32")[procrustes.SCHULZ_CHECK:])[0])
    for planted in (True, False):
        M = cross_products(rng, 6, 769, 64, planted=planted)
        X, A, inside = start(jnp.asarray(M))
        assert np.all(np.asarray(inside)) == planted
        if planted:
            assert np.abs(np.asarray(finish(X, A), np.float64) - ref_polar(M)).max() < 1e-5
    u, v = haar_orthogonal(rng, 4, 64), haar_orthogonal(rng, 4, 64)

    def graded(cond):  # singular values from 1 to 1 / cond, geometrically
        return ((u * np.geomspace(1, 1 / cond, 64)) @ np.swapaxes(v, -1, -2)).astype(np.float32)

    M = np.concatenate([cross_products(rng, 60, 769, 64), graded(1e3)])
    s = np.linalg.svd(M.astype(np.float64), compute_uv=False)
    assert (s[:60, 0] / s[:60, -1]).max() > 1e3
    # condition number 1e5: float32 limits every method (SVD 1e-4 off); ours is no worse
    svd_error = np.abs(np.asarray(solvers.polar(graded(1e5), "svd"), np.float64) - ref_polar(graded(1e5))).max()
    monkeypatch.setattr(procrustes, "_polar_svd", lambda m: jnp.full_like(m, jnp.nan))  # NaN if the SVD ran
    ns = exact_jit(procrustes._newton_schulz)
    assert np.abs(np.asarray(ns(jnp.asarray(M)), np.float64) - ref_polar(M)).max() < 1e-5
    assert np.abs(np.asarray(ns(jnp.asarray(graded(1e5))), np.float64) - ref_polar(graded(1e5))).max() < 1.5 * svd_error
    # every singular value in the design range [1 / (max_cond n^(1/16)), 1] goes to 1, staying
    # positive, within the promised intervals
    for n, dtype, cond, tol in ((64, "float32", procrustes.SCHULZ_MAX_COND, 1e-7), (8, "float32", procrustes.SCHULZ_MAX_COND, 1e-7),
                                (64, "float64", procrustes.SCHULZ_MAX_COND, 1e-15), (64, "float32", procrustes.SCHULZ_NEWTON_COND, 1e-7)):
        x = np.geomspace(1 / (cond * n ** (1 / 16)), 1, 10_000)
        for a, b, err in procrustes._schulz_schedule(n, dtype, cond):
            x = a * x + b * x**3
            assert np.all(x > 0) and np.abs(x - 1).max() <= err * (1 + 1e-9) + 1e-15
        assert np.abs(x - 1).max() < tol


# the first method (svd) in the default run (time budget), every one in the slow suite
@pytest.mark.parametrize("method", [m if m == solvers.POLAR_METHODS[0] else pytest.param(m, marks=pytest.mark.slow) for m in solvers.POLAR_METHODS])
def test_polar_leading_axes_and_dtypes(method):
    rng = np.random.default_rng(1)
    M = cross_products(rng, 6, 40, 8).reshape(2, 3, 8, 8)
    R = solvers.polar(M, method=method)
    assert R.shape == (2, 3, 8, 8) and R.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(R), ref_polar(M), atol=1e-5)
    Rv = jax.vmap(functools.partial(solvers.polar, method=method))(M)  # usable under vmap too
    np.testing.assert_allclose(np.asarray(Rv), np.asarray(R), atol=1e-5)
    dtypes = (jnp.float16, jnp.bfloat16)
    for dtype in dtypes:
        Mlow = jnp.asarray(M, dtype)
        Rlow = solvers.polar(Mlow, method=method)
        assert Rlow.dtype == jnp.float32  # computed in float32, from the rounded input
        np.testing.assert_allclose(np.asarray(Rlow), ref_polar(np.asarray(Mlow, np.float64)), atol=1e-4)


@pytest.mark.parametrize("method", solvers.POLAR_METHODS)
def test_polar_rank_deficient_is_finite_orthogonal_and_optimal(method):
    rng = np.random.default_rng(2)
    n = 16
    low = [rng.standard_normal((n, k)) @ rng.standard_normal((k, n)) for k in (0, 1, 5, 15)]
    M = np.stack(low).astype(np.float32)
    R = np.asarray(solvers.polar(M, method=method), np.float64)
    assert np.isfinite(R).all()
    assert np.abs(np.swapaxes(R, -1, -2) @ R - np.eye(n)).max() < 1e-5
    np.testing.assert_allclose(R[0], np.eye(n), atol=0)  # M = 0 -> identity
    np.testing.assert_allclose(trace_inner(R, M), ref_nuclear(M), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", solvers.POLAR_METHODS)
def test_polar_beats_random_orthogonal_and_local_search(method):
    rng = np.random.default_rng(3)
    n = 4
    Ms = rng.standard_normal((3, n, n)).astype(np.float32)
    Rs = np.asarray(solvers.polar(Ms, method=method), np.float64)
    haar = haar_orthogonal(rng, 10_000, n)
    for M, R in zip(Ms, Rs):
        ours = trace_inner(R, M)
        best_random = np.max(np.einsum("kij,ij->k", haar, M.astype(np.float64)))
        assert ours >= best_random - 1e-5 * abs(ours)
        assert ours > best_random - 1.0  # sanity: random draws get close on a 4x4 problem
        for start in haar_orthogonal(rng, 6, n):
            found = trace_inner(local_search(M, start), M)
            assert ours >= found - 1e-5 * abs(ours)


@FAST
@given(seed=SEEDS, n=st.sampled_from([1, 2, 5, 8]))
def test_polar_procrustes_value_property(seed, n):
    batch = 3
    rng = np.random.default_rng(seed)
    M = (rng.standard_normal((batch, n, n)) * rng.uniform(0.01, 100)).astype(np.float32)
    for method in ("svd", "newton_schulz"):
        R = np.asarray(solvers.polar(M, method=method), np.float64)
        assert np.abs(np.swapaxes(R, -1, -2) @ R - np.eye(n)).max() < 1e-5
        nuc = ref_nuclear(M)
        np.testing.assert_allclose(trace_inner(R, M), nuc, rtol=2e-6, atol=1e-6 * nuc.max())


def test_polar_unknown_method_and_shape_errors():
    with pytest.raises(ValueError, match="unknown polar method"):
        solvers.polar(np.eye(3), method="nope")
    with pytest.raises(ValueError, match="shape"):
        solvers.polar(np.ones((3, 4)))


def test_nuclear_norm():
    rng = np.random.default_rng(4)
    M = rng.standard_normal((2, 3, 7, 7)).astype(np.float32)
    out = solvers.nuclear_norm(M)
    assert out.shape == (2, 3)
    np.testing.assert_allclose(np.asarray(out), ref_nuclear(M), rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# RoPE


def _pair_blocks(R, r):
    half = r // 2
    i = np.arange(half)
    j = i + half
    return R[..., i, i], R[..., i, j], R[..., j, i], R[..., j, j]


def test_rope_polar_structure_and_optimality():
    rng = np.random.default_rng(5)
    n = r = 8
    half = r // 2
    Ms = rng.standard_normal((3, n, n)).astype(np.float32)
    Rs = np.asarray(solvers.rope_polar(Ms, r), np.float64)
    ii = np.arange(half)
    mask = np.zeros((n, n), bool)
    mask[ii, ii] = mask[ii + half, ii + half] = mask[ii, ii + half] = mask[ii + half, ii] = True
    assert np.all(Rs[:, ~mask] == 0)
    cii, sij, sji, cjj = _pair_blocks(Rs, r)
    np.testing.assert_allclose(cii, cjj, atol=1e-7)
    np.testing.assert_allclose(sij, -sji, atol=1e-7)
    np.testing.assert_allclose(cii * cjj - sij * sji, 1, atol=1e-6)  # det +1: rotations only
    # 10^4 random draws from SO(2)^(r/2)
    angles = rng.uniform(-np.pi, np.pi, (10_000, half))
    for M, R in zip(Ms.astype(np.float64), Rs):
        ours = trace_inner(R, M)
        Mii, Mij, Mji, Mjj = M[ii, ii], M[ii, ii + half], M[ii + half, ii], M[ii + half, ii + half]
        random_vals = (np.cos(angles) * (Mii + Mjj) + np.sin(angles) * (Mij - Mji)).sum(-1)
        assert ours >= random_vals.max() - 1e-6
        # brute force: a fine angle grid per pair (the pairs decouple)
        grid = np.linspace(-np.pi, np.pi, 200_001)[:, None]
        per_pair = np.cos(grid) * (Mii + Mjj) + np.sin(grid) * (Mij - Mji)
        np.testing.assert_allclose(ours, per_pair.max(0).sum(), rtol=1e-6)
        theta_grid = grid[per_pair.argmax(0), 0]
        theta = np.arctan2(R[ii, ii + half], R[ii, ii])
        np.testing.assert_allclose(np.angle(np.exp(1j * (theta - theta_grid))), 0, atol=1e-3)


def test_rope_polar_partial_rotary_and_batching():
    rng = np.random.default_rng(6)
    n, r = 10, 6
    M = rng.standard_normal((2, 3, n, n)).astype(np.float32)
    R = np.asarray(solvers.rope_polar(M, r), np.float64)
    assert R.shape == (2, 3, n, n)
    np.testing.assert_allclose(R[..., r:, r:], ref_polar(M[..., r:, r:]), atol=1e-5)
    assert np.all(R[..., :r, r:] == 0) and np.all(R[..., r:, :r] == 0)
    full = np.asarray(solvers.rope_polar(M[0, 0], r), np.float64)
    np.testing.assert_allclose(full, R[0, 0], atol=1e-5)  # float32: seen 1.2e-6 unoptimised (conftest)
    np.testing.assert_allclose(np.asarray(solvers.rope_polar(M, 0)), ref_polar(M), atol=1e-5)
    zero = np.asarray(solvers.rope_polar(np.zeros((n, n)), r))
    np.testing.assert_allclose(zero, np.eye(n))
    for bad in (3, 12, -2):
        with pytest.raises(ValueError, match="rotary_dim"):
            solvers.rope_polar(M, bad)


# one method in the default run (time budget), every one in the slow suite
@pytest.mark.parametrize("method", [m if m == solvers.POLAR_METHODS[0] else pytest.param(m, marks=pytest.mark.slow) for m in solvers.POLAR_METHODS])
def test_polar_stack_equals_separate_calls(method):
    """One polar call for stacked problems (align's QK + VO) gives each problem's own maximiser;
    a partial-rotary block enters padded block-diagonally."""
    rng = np.random.default_rng(15)
    n = 10
    M = np.stack([cross_products(rng, 6, 40, n, planted=p).reshape(2, 3, n, n) for p in (False, True, True)], axis=-3)
    for dims in ((None, None, None), (4, None, 0), (n, None, 4), (n, n, n)):
        R = np.asarray(solvers.polar_stack(M, dims, method=method))
        assert R.shape == M.shape
        for slot, r in enumerate(dims):
            want = solvers.polar(M[..., slot, :, :], method) if not r else solvers.rope_polar(M[..., slot, :, :], r, method)
            np.testing.assert_allclose(R[..., slot, :, :], np.asarray(want), atol=2e-6)
            if r:
                np.testing.assert_allclose(R[..., slot, :, :], ref_rope_polar(M[..., slot, :, :], r), atol=1e-5)
            else:
                np.testing.assert_allclose(R[..., slot, :, :], ref_polar(M[..., slot, :, :]), atol=1e-5)
    Z = M.copy()
    Z[1, 2, 0, 4:, 4:] = 0  # zero block: identity there, as rope_polar gives
    np.testing.assert_allclose(np.asarray(solvers.polar_stack(Z, (4, None, 0), method))[1, 2, 0, 4:, 4:], np.eye(n - 4), atol=1e-6)
    with pytest.raises(ValueError, match="shape"):
        solvers.polar_stack(M, (None, None))
    with pytest.raises(ValueError, match="rotary_dim"):
        solvers.polar_stack(M, (3, None, None))


# ----------------------------------------------------------------------------------------------
# rescaling

LOG_GRID = np.geomspace(1e-3, 1e3, 200_000)


def _random_stats(rng, count):
    """Random problems whose minimisers lie well inside [1e-3, 1e3], including cases with two
    local minima (large positive s_qa and s_ka)."""
    s_qq = 10 ** rng.uniform(-2, 2, count)
    s_kk = 10 ** rng.uniform(-2, 2, count)
    scale = np.sqrt(s_qq * s_kk) ** 0.5
    s_qa = rng.standard_normal(count) * scale * 10 ** rng.uniform(-1, 1, count) * np.sqrt(s_qq)
    s_ka = rng.standard_normal(count) * scale * 10 ** rng.uniform(-1, 1, count) * np.sqrt(s_kk)
    return s_qq, s_qa, s_kk, s_ka


@FAST
@given(seed=SEEDS)
def test_rescale_sequential_matches_fine_grid(seed):
    rng = np.random.default_rng(seed)
    s_qq, s_qa, s_kk, s_ka = _random_stats(rng, 24)
    a = np.asarray(solvers.rescale_sequential(*(x.astype(np.float32) for x in (s_qq, s_qa, s_kk, s_ka))))
    assert a.shape == (24,) and np.all(a > 0)
    stats = [x.astype(np.float32).astype(np.float64) for x in (s_qq, s_qa, s_kk, s_ka)]
    ours = f_seq(a, *stats)
    grid = f_seq(LOG_GRID[:, None], *(x[None] for x in stats))
    best = grid.min(0)
    scale = np.abs(grid).max(0)
    assert np.all(ours <= best + 1e-9 * scale), (ours - best) / scale
    assert np.all(ours >= best - 1e-6 * scale)  # the grid is fine: it can't be beaten by much


def test_rescale_sequential_argument_is_float32_accurate():
    """The minimiser itself, not only its value (f is flat there: a value test cannot see an
    argument 1e-4 off). Planted: B's q side is A's divided by a*, its k side A's times a*, so a*
    is the exact optimum; random: the float64 roots of the quartic (NumPy), wherever the best
    of two local minima is not a near tie."""
    rng = np.random.default_rng(7)
    a_star = np.exp(rng.uniform(-3, 3, 4000))
    nq, nk = 10 ** rng.uniform(-2, 2, (2, 4000))
    planted = (nq / a_star**2, nq / a_star, nk * a_star**2, nk * a_star)
    a = np.asarray(solvers.rescale_sequential(*(x.astype(np.float32) for x in planted)), np.float64)
    assert np.abs(a / a_star - 1).max() < 2e-6
    stats = [x.astype(np.float32).astype(np.float64) for x in _random_stats(rng, 1000)]
    a = np.asarray(solvers.rescale_sequential(*(x.astype(np.float32) for x in stats)), np.float64)
    checked = 0
    for i in range(len(a)):
        s_qq, s_qa, s_kk, s_ka = (x[i] for x in stats)
        roots = np.roots([s_qq, -s_qa, 0.0, s_ka, -s_kk])
        roots = roots[(np.abs(roots.imag) <= 1e-9 * np.abs(roots)) & (roots.real > 0)].real
        values = np.sort(f_seq(roots, s_qq, s_qa, s_kk, s_ka))
        if len(values) > 1 and values[1] - values[0] < 1e-4 * np.abs(values).max():
            continue
        best = roots[np.argmin(f_seq(roots, s_qq, s_qa, s_kk, s_ka))]
        assert abs(a[i] / best - 1) < 2e-6, (i, a[i], best)
        checked += 1
    assert checked > 900


def test_rescale_sequential_two_minima_picks_global():
    # f(t) = t^2 + 1/t^2 - 2 p t - 2 q / t with p = q large: minima near t = p and t = 1/q.
    p = np.array([3.0, 3.0, 5.0])
    q = np.array([3.0, 2.9, 4.0])
    a = np.asarray(solvers.rescale_sequential(1.0, p, 1.0, q), np.float64)
    grid = f_seq(LOG_GRID[:, None], 1.0, p, 1.0, q)
    assert np.all(f_seq(a, 1.0, p, 1.0, q) <= grid.min(0) + 1e-9 * np.abs(grid).max(0))


def test_rescale_sequential_degenerate_and_shapes():
    """One side empty (VO matched from activations): f is a parabola in a (or 1/a), minimised by
    least squares, checked on a grid; both sides empty, or a non-positive cross term: a = 1."""
    s_qq, s_kk = np.array([0.0, 1.0, 0.0, 2.0, 1.0]), np.array([1.0, 0.0, 0.0, 3.0, 0.0])
    s_qa, s_ka = np.array([0.0, 1.5, 1.0, 1.0, -1.0]), np.array([0.5, 0.0, 0.5, 0.5, 0.0])
    a = np.asarray(solvers.rescale_sequential(s_qq, s_qa, s_kk, s_ka))
    assert a.dtype == np.float32
    np.testing.assert_allclose(a[[0, 1, 2, 4]], [2.0, 1.5, 1.0, 1.0], rtol=1e-6)
    grid = np.exp(np.linspace(-4, 4, 20001))
    for i in (0, 1):
        f = grid**2 * s_qq[i] - 2 * grid * s_qa[i] + s_kk[i] / grid**2 - 2 * s_ka[i] / grid
        np.testing.assert_allclose(a[i], grid[np.argmin(f)], rtol=1e-3)
    # closed form: with s_qa = s_ka = 0 the optimum is (s_kk / s_qq)^(1/4)
    np.testing.assert_allclose(solvers.rescale_sequential(2.0, 0.0, 32.0, 0.0), 2.0, rtol=1e-6)
    out = solvers.rescale_sequential(np.ones((2, 3)), 0.5, np.ones(3), jnp.bfloat16(0.25))
    assert out.shape == (2, 3) and out.dtype == jnp.float32


def _joint_problem(rng, batch, n, rows=12, planted=None):
    xq_b = rng.standard_normal((batch, rows, n))
    xk_b = rng.standard_normal((batch, rows, n)) * rng.uniform(0.2, 5, (batch, 1, 1))
    if planted is None:
        xq_a = rng.standard_normal((batch, rows, n)) * rng.uniform(0.2, 5, (batch, 1, 1))
        xk_a = rng.standard_normal((batch, rows, n))
    else:
        a, R = planted
        xq_a = a[:, None, None] * xq_b @ R
        xk_a = xk_b @ R / a[:, None, None]
    cast = lambda x: x.astype(np.float32)  # noqa: E731
    xq_b, xk_b, xq_a, xk_a = map(cast, (xq_b, xk_b, xq_a, xk_a))
    Mq = np.einsum("bri,brj->bij", xq_b, xq_a)
    Mk = np.einsum("bri,brj->bij", xk_b, xk_a)
    s_qq = np.sum(xq_b.astype(np.float64) ** 2, axis=(1, 2)).astype(np.float32)
    s_kk = np.sum(xk_b.astype(np.float64) ** 2, axis=(1, 2)).astype(np.float32)
    return Mq, Mk, s_qq, s_kk, (xq_b, xk_b, xq_a, xk_a)


def _sequential(Mq, Mk, s_qq, s_kk, project=ref_polar):
    R = project(np.asarray(Mq, np.float64) + Mk)
    a = np.asarray(solvers.rescale_sequential(s_qq, trace_inner(R, Mq), s_kk, trace_inner(R, Mk)), np.float64)
    return a, R


def _objective(R, a, Mq, Mk, s_qq, s_kk):
    a = np.asarray(a, np.float64)
    s_qq, s_kk = np.asarray(s_qq, np.float64), np.asarray(s_kk, np.float64)
    return a * a * s_qq + s_kk / (a * a) - 2 * (a * trace_inner(R, Mq) + trace_inner(R, Mk) / a)


_joint = solvers.rescale_joint
_rope_joint = functools.partial(solvers.rescale_joint, project=solvers.RopePolar(4))


@pytest.mark.slow  # time budget of the default run; test_rescale_modes_are_ordered keeps the ordering there
@FAST
@given(seed=SEEDS)
def test_rescale_joint_never_worse_than_sequential(seed):
    rng = np.random.default_rng(seed)
    Mq, Mk, s_qq, s_kk, _ = _joint_problem(rng, 8, 6)
    a, R = _joint(Mq, Mk, s_qq, s_kk)
    a, R = np.asarray(a, np.float64), np.asarray(R, np.float64)
    assert a.shape == (8,) and R.shape == (8, 6, 6) and np.all(a > 0)
    ours = _objective(R, a, Mq, Mk, s_qq, s_kk)
    seq = _objective(*reversed(_sequential(Mq, Mk, s_qq, s_kk)), Mq, Mk, s_qq, s_kk)
    scale = np.abs(seq) + s_qq + s_kk
    assert np.all(ours <= seq + 1e-6 * scale), (ours - seq) / scale
    assert np.abs(np.swapaxes(R, -1, -2) @ R - np.eye(6)).max() < 1e-5
    np.testing.assert_allclose(np.asarray(solvers.objective_value(R, a, Mq, Mk, s_qq, s_kk)), ours, rtol=1e-5,
                               atol=1e-5 * scale.max())


def _g_on_grid(us, Mq, Mk, s_qq, s_kk, h):
    a = np.exp(us)[:, None]
    X = a[..., None, None] * np.asarray(Mq, np.float64)[None] + np.asarray(Mk, np.float64)[None] / a[..., None, None]
    return a**2 * s_qq + s_kk / a**2 - 2 * h(X)


def test_rescale_joint_matches_brute_force_grid():
    rng = np.random.default_rng(7)
    Mq, Mk, s_qq, s_kk, _ = _joint_problem(rng, 8, 6)
    a, R = _joint(Mq, Mk, s_qq, s_kk)
    ours = _objective(np.asarray(R, np.float64), np.asarray(a, np.float64), Mq, Mk, s_qq, s_kk)
    us = np.linspace(-5, 5, 4001)
    g = _g_on_grid(us, Mq, Mk, s_qq.astype(np.float64), s_kk.astype(np.float64), ref_nuclear)
    best = g.min(0)
    scale = np.abs(best) + s_qq + s_kk
    assert np.all(ours <= best + 1e-6 * scale), (ours - best) / scale
    assert np.all(ours >= best - 1e-4 * scale)  # exact objective: can't beat the true minimum
    assert np.all(np.abs(np.log(np.asarray(a)) - us[g.argmin(0)]) < 0.02)
    # the joint optimum is strictly better than rotate-then-scale on these random problems
    seq = _objective(*reversed(_sequential(Mq, Mk, s_qq, s_kk)), Mq, Mk, s_qq, s_kk)
    assert np.mean(ours < seq - 1e-4 * scale) > 0.5


def test_rescale_joint_recovers_planted():
    rng = np.random.default_rng(8)
    n = 6
    a_star = np.exp(rng.uniform(-1.5, 1.5, 8))
    R_star = haar_orthogonal(rng, 8, n)
    Mq, Mk, s_qq, s_kk, _ = _joint_problem(rng, 8, n, planted=(a_star, R_star))
    a, R = _joint(Mq, Mk, s_qq, s_kk)
    np.testing.assert_allclose(np.asarray(a), a_star, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(R), R_star, atol=1e-4)
    a2, _ = _joint(Mq, Mk, s_qq, s_kk, a_init=np.full(8, 10.0, np.float32))
    np.testing.assert_allclose(np.asarray(a2), a_star, rtol=1e-4)


def test_rescale_joint_rope_project():
    rng = np.random.default_rng(9)
    n, r = 6, 4
    Mq, Mk, s_qq, s_kk, _ = _joint_problem(rng, 8, n)
    a, R = _rope_joint(Mq, Mk, s_qq, s_kk)
    a, R = np.asarray(a, np.float64), np.asarray(R, np.float64)
    # structure: R is in the RoPE group (projecting it onto the group leaves it unchanged)
    np.testing.assert_allclose(R, ref_rope_polar(R, r), atol=1e-6)
    rope = functools.partial(ref_rope_polar, rotary_dim=r)
    ours = _objective(R, a, Mq, Mk, s_qq, s_kk)
    seq = _objective(*reversed(_sequential(Mq, Mk, s_qq, s_kk, project=rope)), Mq, Mk, s_qq, s_kk)
    scale = np.abs(seq) + s_qq + s_kk
    assert np.all(ours <= seq + 1e-6 * scale)
    us = np.linspace(-5, 5, 1001)
    g = _g_on_grid(us, Mq, Mk, s_qq.astype(np.float64), s_kk.astype(np.float64), lambda X: trace_inner(rope(X), X))
    assert np.all(ours <= g.min(0) + 1e-4 * scale)


def test_rescale_joint_projections_compare_by_value():
    rng = np.random.default_rng(14)
    Mq, Mk, s_qq, s_kk, _ = _joint_problem(rng, 8, 6)
    results = [solvers.rescale_joint(Mq, Mk, s_qq, s_kk, project=solvers.RopePolar(4)) for _ in range(2)]
    size = rescale._rescale_joint._cache_size()
    a, R = _rope_joint(Mq, Mk, s_qq, s_kk)  # yet another equal partial: no new compilation
    assert rescale._rescale_joint._cache_size() == size
    for a2, R2 in results:
        np.testing.assert_array_equal(np.asarray(a2), np.asarray(a))
        np.testing.assert_array_equal(np.asarray(R2), np.asarray(R))


def test_rescale_joint_degenerate_and_shapes():
    rng = np.random.default_rng(10)
    Mq, Mk, s_qq, s_kk, _ = _joint_problem(rng, 4, 5)
    s_qq[0], Mq[0] = 0.0, 0.0  # one side empty: R does not depend on a, a is the least-squares one
    s_kk[1], Mk[1] = 0.0, 0.0
    a, R = solvers.rescale_joint(Mq.reshape(2, 2, 5, 5), Mk.reshape(2, 2, 5, 5), s_qq.reshape(2, 2), s_kk.reshape(2, 2))
    assert a.shape == (2, 2) and R.shape == (2, 2, 5, 5)
    a, R = np.asarray(a).reshape(4), np.asarray(R).reshape(4, 5, 5)
    want = ref_polar(Mq[:2] + Mk[:2])
    np.testing.assert_allclose(R[:2], want, atol=1e-5)
    np.testing.assert_allclose(a[0], s_kk[0] / np.sum(want[0] * Mk[0]), rtol=1e-5)
    np.testing.assert_allclose(a[1], np.sum(want[1] * Mq[1]) / s_qq[1], rtol=1e-5)
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(R))


def test_objective_value_is_the_alignment_cost():
    rng = np.random.default_rng(11)
    Mq, Mk, s_qq, s_kk, (xq_b, xk_b, xq_a, xk_a) = _joint_problem(rng, 3, 5)
    R = haar_orthogonal(rng, 3, 5)
    a = np.array([0.5, 1.0, 2.0])
    b = [x.astype(np.float64) for x in (xq_b, xk_b, xq_a, xk_a)]
    direct = (np.sum((a[:, None, None] * b[0] @ R - b[2]) ** 2, axis=(1, 2))
              + np.sum((b[1] @ R / a[:, None, None] - b[3]) ** 2, axis=(1, 2))
              - np.sum(b[2] ** 2, axis=(1, 2)) - np.sum(b[3] ** 2, axis=(1, 2)))
    ours = np.asarray(solvers.objective_value(R, a, Mq, Mk, s_qq, s_kk), np.float64)
    np.testing.assert_allclose(ours, direct, rtol=1e-4, atol=1e-4 * np.abs(direct).max())


# ----------------------------------------------------------------------------------------------
# linear assignment (host)


@FAST
@given(seed=SEEDS, n=st.integers(1, 6), maximize=st.booleans())
def test_linear_assignment_brute_force(seed, n, maximize):
    rng = np.random.default_rng(seed)
    S = rng.standard_normal((n, n))
    given_scores = S.copy()
    p = solvers.linear_assignment(S, maximize=maximize)
    np.testing.assert_array_equal(S, given_scores)  # it negates its own copy, never the caller's
    assert sorted(p.tolist()) == list(range(n))
    value = lambda perm: S[list(perm), range(n)].sum()  # noqa: E731  sum_j S[p[j], j]
    values = [value(perm) for perm in itertools.permutations(range(n))]
    np.testing.assert_allclose(value(p), max(values) if maximize else min(values), rtol=1e-12, atol=1e-12)


@FAST
@given(seed=SEEDS, n=st.integers(1, 6), maximize=st.booleans(), ties=st.booleans())
def test_linear_assignment_float32_brute_force(seed, n, maximize, ties):
    """float32 scores go to lapx's float32 solver: still an optimum (brute force), also among
    exact ties (small integers)."""
    rng = np.random.default_rng(seed)
    S = (rng.integers(0, 3, (n, n)) if ties else rng.standard_normal((n, n))).astype(np.float32)
    p = solvers.linear_assignment(S, maximize=maximize)
    assert sorted(p.tolist()) == list(range(n))
    value = lambda perm: S.astype(np.float64)[list(perm), range(n)].sum()  # noqa: E731
    values = [value(perm) for perm in itertools.permutations(range(n))]
    np.testing.assert_allclose(value(p), max(values) if maximize else min(values), rtol=1e-6, atol=1e-6)


def _alignment_like_scores(rng, n, kind):
    """Score matrices of the kinds alignment produces: unrelated units, fine-tune-like units (a
    shared base, noise), near ties (units repeated), exact ties (small integers), scaled large."""
    d = 32
    A = rng.standard_normal((n, d))
    if kind == "unrelated":
        S = rng.standard_normal((n, d)) @ A.T
    elif kind == "fine_tune":
        S = (A[rng.permutation(n)] + 0.5 * rng.standard_normal((n, d))) @ A.T
    elif kind == "near_ties":
        A[1::2] = A[::2][: n // 2] + 1e-6 * rng.standard_normal((n // 2, d))
        S = (A + 0.01 * rng.standard_normal((n, d))) @ A.T
    elif kind == "integer_ties":
        S = rng.integers(-2, 3, (n, n)).astype(np.float64)
    else:  # scaled large: magnitudes as big FFN units give
        S = 1e4 * (rng.standard_normal((n, d)) @ A.T)
    return S.astype(np.float32)


@pytest.mark.parametrize("kind", ["unrelated", "fine_tune", "near_ties", "integer_ties", "scaled"])
def test_fast_solver_optimum_equals_scipy(kind, monkeypatch):
    """lapx (float32 scores) against SciPy, the reference, in float64 on the same matrices: equal
    objective to float32 tolerance (exactly on integer scores), the same answer on a second call,
    and with lapx absent SciPy's own answer."""
    assert assignment.lap is not None, "lapx is a dependency: the fast solver must be importable here"
    rng = np.random.default_rng(["unrelated", "fine_tune", "near_ties", "integer_ties", "scaled"].index(kind))
    for n in (2, 17, 300, 1000):
        S = _alignment_like_scores(rng, n, kind)
        S64 = S.astype(np.float64)
        p = solvers.linear_assignment(S)
        rows, cols = scipy_optimize.linear_sum_assignment(S64, maximize=True)
        best = S64[rows, cols].sum()
        got = S64[p, np.arange(n)].sum()
        tol = 0 if kind == "integer_ties" else n * np.finfo(np.float32).eps * np.abs(S64).max()
        assert best - tol <= got <= best + 1e-9 * abs(best), (kind, n, got, best)
        np.testing.assert_array_equal(solvers.linear_assignment(S), p)
        with monkeypatch.context() as m:
            m.setattr(assignment, "lap", None)
            want = np.empty(n, np.int64)
            want[cols] = rows
            np.testing.assert_array_equal(solvers.linear_assignment(S), want)


def test_linear_assignment_convention_planted_permutation():
    rng = np.random.default_rng(12)
    n, d = 50, 20
    A = rng.standard_normal((n, d))
    q = rng.permutation(n)
    B = A[q] + 0.01 * rng.standard_normal((n, d))  # B's unit i is A's unit q[i]
    S = B @ A.T  # S[i_B, j_A]
    p = solvers.linear_assignment(S)
    np.testing.assert_array_equal(p, np.argsort(q))
    np.testing.assert_allclose(B[p], A, atol=0.1)  # B'[j] = B[p[j]] lines up with A[j]
    with pytest.raises(ValueError, match="square"):
        solvers.linear_assignment(np.ones((3, 4)))


def _brute_force_best(S, maximize):
    n = S.shape[0]
    values = [S[list(perm), range(n)].sum() for perm in itertools.permutations(range(n))]
    return max(values) if maximize else min(values)


def test_certified_assignment_is_optimal_and_agrees_with_the_host():
    """Whenever the device certifies its argmax matching it is optimal (brute force), the host
    certifies the same matrices with the same permutation, and linear_assignment returns it. Both
    the column and the row rule are exercised (small random matrices satisfy each sometimes)."""
    rng = np.random.default_rng(21)
    kinds = {"columns": 0, "rows": 0, "none": 0}
    for _ in range(200):
        n, maximize = int(rng.integers(1, 7)), bool(rng.integers(2))
        S = rng.standard_normal((n, n)).astype(np.float32)
        perm, certified = jax.device_get(solvers.certified_assignment(S, maximize=maximize))
        host = assignment._host_certificate(S.astype(np.float64) * (1 if maximize else -1))
        assert certified == (host is not None)
        if certified:
            np.testing.assert_array_equal(perm, host)
            np.testing.assert_allclose(S[perm, range(n)].sum(), _brute_force_best(S, maximize), rtol=1e-6)
            np.testing.assert_array_equal(solvers.linear_assignment(S, maximize), perm)
        best_rows = np.argmax(S if maximize else -S, axis=0)
        kinds["none" if not certified else "columns" if len(set(best_rows)) == n else "rows"] += 1
    assert min(kinds.values()) > 0, kinds


def _full_rule(S):
    """The certificate's rule read off every line (no sample), in plain NumPy: each column's best
    row, else each row's best column inverted, when they are all different; else None."""
    n = S.shape[0]
    best_rows, best_cols = S.argmax(axis=0), S.argmax(axis=1)
    if len(set(best_rows.tolist())) == n:
        return best_rows
    if len(set(best_cols.tolist())) == n:
        return np.argsort(best_cols)
    return None


def test_certificate_reads_a_sample_first_without_changing_its_answer():
    """Device and host test a sample of lines first (`_sample_size`: 32 of 60 here) and stop when
    two of them share a best line both ways. Matrices with a planted matching and hubs (a row
    that wins two columns, a column that wins two rows) put inside the sample, past it, or
    nowhere: both give the full rule's answer (NumPy, every line), under vmap too, and every case
    occurs: refuted by the sample, refuted past it, certified by columns, by rows."""
    rng = np.random.default_rng(24)
    n = 60
    k = assignment._sample_size(n)
    assert k == 32
    cases, matrices, seen = [], [], set()
    for _ in range(160):
        S = 0.1 * rng.standard_normal((n, n)).astype(np.float32)
        planted = rng.permutation(n)  # column j's best row
        S[planted, np.arange(n)] = 2.0
        col_of = np.argsort(planted)  # row i's best column
        for _ in range(int(rng.integers(0, 3))):  # hubs, among the sample's lines or past them
            a, b = rng.choice(np.arange(k, n) if rng.integers(2) else np.arange(k), size=2, replace=False)
            if rng.integers(2):  # columns a, b share their best row (the rows keep theirs)
                S[planted[a], b], S[planted[b], b] = 1.5, 1.0
            else:  # rows a, b share their best column (the columns keep theirs)
                S[b, col_of[a]], S[b, col_of[b]] = 1.5, 1.0
        want = _full_rule(S)
        sample_refutes = len(set(S[:, :k].argmax(0).tolist())) < k and len(set(S[:k].argmax(1).tolist())) < k
        seen.add("sample" if sample_refutes else "past the sample" if want is None else "columns" if len(set(S.argmax(0).tolist())) == n else "rows")
        perm, certified = jax.device_get(solvers.certified_assignment(S))
        host = assignment._host_certificate(S.astype(np.float64))
        assert certified == (want is not None) == (host is not None)
        if want is not None:
            np.testing.assert_array_equal(perm, want)
            np.testing.assert_array_equal(host, want)
        cases.append((want, certified))
        matrices.append(S)
    assert seen == {"sample", "past the sample", "columns", "rows"}, seen
    perms, certified = jax.device_get(jax.vmap(solvers.certified_assignment)(np.stack(matrices)))
    for (want, ok), batched_perm, batched_ok in zip(cases, perms, certified):
        assert batched_ok == ok
        if ok:
            np.testing.assert_array_equal(batched_perm, want)


def test_certified_assignments_never_reach_scipy(monkeypatch):
    """A planted pair's cost matrix (B's units are A's permuted, plus noise) is certified on the
    device and on the host: the answer is the planted permutation and SciPy never runs; an
    unrelated pair's is not, and SciPy solves it (same answer as before the certificate)."""
    rng = np.random.default_rng(22)
    n, d = 64, 32
    A = rng.standard_normal((n, d))
    q = rng.permutation(n)
    planted = (A[q] + 0.05 * rng.standard_normal((n, d))) @ A.T
    unrelated = rng.standard_normal((n, d)) @ A.T
    want_unrelated = solvers.linear_assignment(unrelated.astype(np.float32))
    calls = []
    solve = assignment.minimum_assignment
    monkeypatch.setattr(assignment, "minimum_assignment", lambda S: calls.append(S.shape) or solve(S))
    assert bool(solvers.certified_assignment(planted)[1]) and not bool(solvers.certified_assignment(unrelated)[1])
    for scores in (planted, jnp.asarray(planted, jnp.float32)):
        np.testing.assert_array_equal(assignment.linear_assignments([scores, scores])[0], np.argsort(q))
        np.testing.assert_array_equal(solvers.linear_assignment(-np.asarray(scores), maximize=False), np.argsort(q))
    assert calls == []
    got = assignment.linear_assignments([jnp.asarray(unrelated, jnp.float32), jnp.asarray(planted, jnp.float32)])
    np.testing.assert_array_equal(got[0], want_unrelated)
    assert calls == [(n, n)]


def test_offsets_certify_matchings_the_raw_scores_cannot():
    """Units of unequal norms, correlated (as in trained models): B = A + small noise. Raw inner
    products peak on A's large units, so no certificate holds on them; with half the squared
    norms as offsets (S' = -||B_i - A_j||^2 / 2) it holds, the answer is the identity (brute force
    on a small case, SciPy on a large one), and SciPy never runs."""
    rng = np.random.default_rng(23)
    for n, d in ((7, 5), (300, 40)):
        base = rng.standard_normal((1, d))
        A = rng.lognormal(0, 1, (n, 1)) * (base + 0.6 * rng.standard_normal((n, d)))
        B = A + 0.01 * rng.standard_normal((n, d))
        S = (B @ A.T).astype(np.float32)
        rows, cols = (0.5 * (B * B).sum(1)).astype(np.float32), (0.5 * (A * A).sum(1)).astype(np.float32)
        assert not bool(solvers.certified_assignment(S)[1]) and assignment._host_certificate(S.astype(np.float64)) is None
        perm, certified = solvers.certified_assignment(S, rows, cols)
        assert bool(certified)
        want = np.arange(n) if n > 7 else max(itertools.permutations(range(n)), key=lambda q: S[list(q), range(n)].sum())
        np.testing.assert_array_equal(perm, want)
        np.testing.assert_array_equal(solvers.linear_assignment(S), want)
        # minimising -S with negated offsets is the same problem
        np.testing.assert_array_equal(solvers.certified_assignment(-S, -rows, -cols, maximize=False)[0], want)
        solve = assignment.minimum_assignment
        try:
            assignment.minimum_assignment = None  # any call fails
            got = assignment.linear_assignments([jnp.asarray(S), jnp.asarray(S)], offsets=[(rows, cols), (rows, cols)])
        finally:
            assignment.minimum_assignment = solve
        np.testing.assert_array_equal(got[0], want)


def test_offsets_never_certify_within_rounding():
    """With offsets the reduced scores are rounded: a lead smaller than the rounding bound of its
    line is not trusted (an exact tie neither), while raw scores compare exactly."""
    tie = np.array([[1.0, 0.0], [1.0, 0.0]], np.float32)
    assert not bool(solvers.certified_assignment(tie, np.zeros(2, np.float32), np.zeros(2, np.float32))[1])
    S = np.array([[1e8 + 8, 1e8], [1e8, 1e8 + 8]], np.float32)  # exact in float32
    rows = np.array([1e8, 1e8], np.float32)  # S - rows = [[8, 0], [0, 8]]: leads of 8 at magnitude 2e8
    assert not bool(solvers.certified_assignment(S, rows, np.zeros(2, np.float32))[1])
    perm, certified = solvers.certified_assignment(S)
    assert bool(certified) and perm.tolist() == [0, 1]


def test_device_scores_that_are_not_finite_are_refused():
    scores = jnp.eye(4).at[1, 2].set(jnp.nan)
    with pytest.raises(ValueError, match="non-finite"):
        assignment.linear_assignments([scores, jnp.eye(4)])
    with pytest.raises(ValueError, match="square"):
        assignment.linear_assignments([jnp.ones((3, 4))])
    with pytest.raises(ValueError, match=r"row_offsets of shape \(3,\) for scores of shape \(4, 4\)"):
        assignment.linear_assignments([jnp.eye(4)], offsets=[(jnp.ones(3), jnp.ones(4))])
    assert not bool(solvers.certified_assignment(jnp.eye(4), jnp.full(4, jnp.inf), jnp.zeros(4))[1])


def test_batched_linear_assignment():
    rng = np.random.default_rng(13)
    S = rng.standard_normal((2, 3, 7, 7)).astype(np.float32)
    P = assignment.batched_linear_assignment(S)
    assert P.shape == (2, 3, 7) and P.dtype == np.int32
    for idx in np.ndindex(2, 3):
        np.testing.assert_array_equal(P[idx], solvers.linear_assignment(S[idx]))
    Pmin = assignment.batched_linear_assignment(S, maximize=False)
    np.testing.assert_array_equal(Pmin[1, 2], solvers.linear_assignment(S[1, 2], maximize=False))
    S_jax = jnp.asarray(S, jnp.bfloat16)  # device arrays and low precision are accepted
    assert assignment.batched_linear_assignment(S_jax).shape == (2, 3, 7)
