"""Rescaling after (or jointly with) the rotation (MATH.md section 3): rescale_sequential, the
paper's quartic; rescale_joint, the exact joint optimum over (a, R); objective_value."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..precision import exact_jit, upcast
from .batched import check_square, trace_inner
from .procrustes import nuclear_norm, polar

Array = jax.Array


@exact_jit
def objective_value(R, a, Mq, Mk, s_qq, s_kk) -> Array:
    """`a^2 s_qq + s_kk / a^2 - 2 tr(R^T (a Mq + Mk / a))`: the QK (or VO) alignment cost
    `||a X_q^B R - X_q^A||^2 + ||X_k^B R / a - X_k^A||^2` minus the constant `||X^A||^2`.
    Shapes: R, Mq, Mk (..., n, n); a, s_qq, s_kk (...)."""
    R, Mq, Mk = upcast(R), upcast(Mq), upcast(Mk)
    a, s_qq, s_kk = upcast(a), upcast(s_qq), upcast(s_kk)
    tq, tk = trace_inner(R, Mq), trace_inner(R, Mk)
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

    One side empty (`s_kk = 0`: nothing on the `1/a` side, as for a VO pair matched from
    activations, where values and attention outputs both scale with `a`): the least-squares
    `a = s_qa / s_qq` (symmetrically `a = s_kk / s_ka` when `s_qq = 0`); `a = 1` where that is
    not positive or both sides are empty (degenerate). Inputs broadcast; output has their
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
    # One side empty: f is a parabola in a (or in 1/a).
    only_q = (s_qq > 0) & ~(s_kk > 0) & (s_qa > 0)
    only_k = (s_kk > 0) & ~(s_qq > 0) & (s_ka > 0)
    one_sided = jnp.where(only_q, s_qa / jnp.where(only_q, s_qq, 1), jnp.where(only_k, s_kk / jnp.where(only_k, s_ka, 1), 1))
    return jnp.where(degenerate, one_sided, t * (rk / rq))


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
    # Each function's two stretches are bracketed together, stacked on a new axis 0: one program
    # of elementwise steps instead of two (XLA:CPU's compile time grows with their number).
    sign = jnp.asarray([-1, 1], p.dtype).reshape((2,) + (1,) * p.ndim)
    crit_lo, crit_hi = _bracket(lambda u, p, q: sign[..., None] * dP(u, p, q), jnp.stack([lo, log_m]), jnp.stack([log_m, hi]), p, q)
    c1, c2 = crit_hi[0], crit_lo[1]  # P' falls on (0, m), rises after
    c1, c2 = jnp.where(falls, c1, lo), jnp.where(falls, c2, lo)
    has1, has3 = P(c1) > 0, P(c2) < 0
    r1, r3 = _polished_root(P, dP, *_bracket(P, jnp.stack([lo, c2]), jnp.stack([c1, hi]), p, q))
    f1 = jnp.where(has1, _f_normalised(r1, p, q), jnp.inf)
    f3 = jnp.where(has3, _f_normalised(r3, p, q), jnp.inf)
    return jnp.where(f1 < f3, r1, r3)


def _bracket(g, lo, hi, p, q):
    """[a, b] within [lo, hi] around the sign change of `g(u, p, q)`, increasing in u: LEVELS
    rounds of GRID points (a = lo side if g >= 0 throughout, b = hi side if g < 0 throughout).
    lo and hi may carry leading axes over p and q's shape. A loop: XLA compiles one round."""
    steps = np.arange(GRID)

    def level(_, bracket):
        lo, hi = bracket
        width = (hi - lo) / (GRID - 1)
        u = lo[..., None] + width[..., None] * steps
        i = jnp.clip(jnp.sum(g(u, p[..., None], q[..., None]) < 0, axis=-1), 1, GRID - 1)
        lo = lo + (i - 1) * width  # a sum of counts, not a gather: XLA:CPU compiles gathers slowly
        return lo, lo + width

    return jax.lax.fori_loop(0, LEVELS, level, (lo, hi))


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
            return trace_inner(project(X), X)

    Mq, Mk = upcast(Mq), upcast(Mk)
    check_square(Mq, "Mq")
    check_square(Mk, "Mk")
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
    nq, nk = trace_inner(Rs[1], Mq), trace_inner(Rs[2], Mk)
    a0 = rescale_sequential(s_qq, trace_inner(R0, Mq), s_kk, trace_inner(R0, Mk))
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
    a1 = rescale_sequential(s_qq, trace_inner(R1, Mq), s_kk, trace_inner(R1, Mk))
    R1 = project(a1[..., None, None] * Mq + Mk / a1[..., None, None])
    v1 = objective_value(R1, a1, Mq, Mk, s_qq, s_kk)
    use_joint = (v1 < v0) & ~degenerate
    a = jnp.where(use_joint, a1, a0)
    R = jnp.where(use_joint[..., None, None], R1, R0)
    return a, R
