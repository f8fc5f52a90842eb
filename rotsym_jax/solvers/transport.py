"""Optimal transport between two models' units (MATH.md §9), on the host in float64: the squared
distances between units' features, a plan per cost matrix with uniform marginals (exact OT, which
gives a permutation for units of equal count, or entropic OT rounded onto the marginals), and a
plan as a permutation or as barycentric weights. OT fusion's kernels (`merging/otfusion.py`), which
each group kind's view of it uses (`kinds.Fusion`). POT is imported only when a plan is solved."""

from __future__ import annotations

import warnings

import numpy as np

from ..errors import InputError

# Sinkhorn: iteration cap; it stops when the L2 norm of the marginal violation is below
# SINKHORN_TOL / n (marginals 1/n: relative 1e-6 per unit).
SINKHORN_ITERS = 5_000
SINKHORN_TOL = 1e-6
# A plan whose marginals are still off by more than this (relative to 1/n) gets a warning; every
# plan is then rounded onto the exact marginals.
MARGINAL_WARN = 1e-3


def sq_dists(xb, xa):
    """(..., n, D), (..., m, D) -> (..., n, m) squared Euclidean distances, float64, >= 0."""
    cross = np.matmul(xb, np.swapaxes(xa, -1, -2))
    d = np.sum(xb * xb, -1)[..., :, None] + np.sum(xa * xa, -1)[..., None, :] - 2.0 * cross
    return np.maximum(d, 0.0)


def _relative_reg(cost, reg):
    med = float(np.median(cost))
    scale = med if med > 0 else float(np.max(cost))
    return reg * (scale if scale > 0 else 1.0)


def solve(costs, transport, reg, what):
    """Plans (..., n, n) for cost matrices (..., n, n), uniform marginals 1/n; one solver call
    per matrix (a layer, or a layer's kv group)."""
    import ot  # POT: only OT fusion needs it, so the engine runs where it is not installed

    costs = np.asarray(costs, np.float64)
    n = costs.shape[-1]
    a = np.full(n, 1.0 / n)
    plans = np.empty_like(costs)
    for idx in np.ndindex(costs.shape[:-2]):
        c = np.asarray(costs[idx], order="C")
        where = f"{what}, layer index {idx[0]}" + (f", kv group {idx[1]}" if len(idx) > 1 else "")
        if not np.all(np.isfinite(c)):
            raise InputError(f"{where}: the cost matrix has non-finite entries (NaN or inf in the weights or activations)")
        if transport == "hard":
            plan, log = ot.emd(a, a, c, numItermax=max(100_000, 100 * n * n), log=True)
            if log["warning"] is not None:
                raise RuntimeError(f"{where}: exact OT (ot.emd) did not solve: {log['warning']}")
        else:
            plan = _sinkhorn(a, c, _relative_reg(c, reg), where)
        plans[idx] = plan
    return plans


def _sinkhorn(a, cost, reg, where):
    """Entropic OT plan with exact marginals `a`: POT's stabilised Sinkhorn (its log-domain
    Sinkhorn where that overflows), then rounded onto the marginals (Altschuler et al. 2017, Alg. 2:
    a change of the order of the remaining marginal error), so every plan is a coupling."""
    import ot

    n = a.shape[0]
    plan = None
    for method in ("sinkhorn_stabilized", "sinkhorn_log"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # non-convergence is judged below, with context
            plan = np.asarray(
                ot.sinkhorn(a, a, cost, reg, method=method, numItermax=SINKHORN_ITERS, stopThr=SINKHORN_TOL / n, warn=False),
                np.float64,
            )
        if np.all(np.isfinite(plan)) and np.all(plan.sum(0) > 0) and np.all(plan.sum(1) > 0):
            break
    else:
        raise RuntimeError(f"{where}: Sinkhorn failed (non-finite or empty plan) with regularisation {reg:.3g}; increase sinkhorn_reg")
    err = max(np.abs(plan.sum(0) - a).max(), np.abs(plan.sum(1) - a).max()) * n
    if err > MARGINAL_WARN:
        warnings.warn(
            f"{where}: Sinkhorn did not converge in {SINKHORN_ITERS} iterations (relative marginal error "
            f"{err:.1e}, rounded onto the marginals); a larger sinkhorn_reg converges faster",
            RuntimeWarning,
            stacklevel=5,
        )
    return round_to_marginals(plan, a)


def round_to_marginals(plan, a):
    plan = plan * np.minimum(a / plan.sum(1), 1.0)[:, None]
    plan = plan * np.minimum(a / plan.sum(0), 1.0)[None, :]
    err_rows, err_cols = a - plan.sum(1), a - plan.sum(0)
    total = err_cols.sum()
    return plan + np.outer(err_rows, err_cols) / total if total > 0 else plan


def plan_to_perm(plans, what):
    """Permutation matrices / n (..., n, n) -> p (..., n) with B'[k] = B[p[k]]; checked."""
    n = plans.shape[-1]
    p = np.argmax(plans, axis=-2)
    onehot = np.zeros_like(plans)
    np.put_along_axis(onehot, p[..., None, :], 1.0, axis=-2)
    if not np.allclose(plans * n, onehot, atol=1e-9) or np.any(np.sort(p, axis=-1) != np.arange(n)):
        raise RuntimeError(f"{what}: the exact OT plan is not a permutation (units of equal count must give one)")
    return p.astype(np.int32)


def barycentric(plans):
    """Column-normalised plans: fused unit k = sum_j W[j, k] unit_j (= n T[j, k] at convergence)."""
    return plans / plans.sum(-2, keepdims=True)
