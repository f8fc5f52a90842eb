"""Linear assignment (MATH.md section 5): exact, on the host, with a device certificate that skips
the host where each column's best row is provably optimal.

The host solver: lapx's `lapjvs` (a Jonker-Volgenant shortest augmenting path method) on float32
scores, the engine's, where lapx is installed: 2.3-6x faster than SciPy on alignment's score
matrices, equal optima (benchmarks/engine_choices.md); SciPy's `linear_sum_assignment` in float64
otherwise (float64 scores, or no lapx: the fallback and the tests' reference)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

try:  # lapx installs the module `lap`
    import lap
except ImportError:  # no wheel for this platform: SciPy solves everything
    lap = None

from ..errors import InputError
from ..precision import exact_jit, is_traced, upcast
from .batched import batch_cond, check_square, spread, spread_over_rows

Array = jax.Array


def linear_assignment(scores, maximize: bool = True) -> np.ndarray:
    """Host (NumPy, lapx or SciPy). For a square score matrix `S[i_B, j_A]` returns the permutation `p`
    (int64, shape (n,)) of B's units that maximises (or, `maximize=False`, minimises)
    `sum_j S[p[j], j]`: the aligned B is `B'[j] = B[p[j]]` (`B' = B[p]` along the unit axis).

    Example: if B's units are A's permuted, `B = A[q]`, then with `S = B A^T` (or any score that
    peaks on matching units) the result is `p = argsort(q)`, and `B[p] = A`.

    Exact. When every column's best row is a different row (or every row's best column a
    different column), that matching is optimal: no assignment beats each column's (row's)
    maximum (`certified_assignment` without offsets), and no solver runs. Otherwise
    `minimum_assignment` solves it: float32 scores (or narrower) in float32 by lapx when it is
    installed (optimal up to float32 rounding of the sums it compares: a float32 score matrix
    carries rounding of that size already), anything else in float64 by SciPy.
    Non-finite scores raise ValueError. Ties: an optimal permutation, the same one for the same
    scores and solver (both are deterministic), whatever the thread or device counts.
    """
    S = _square_scores(scores)
    if not maximize:  # negated in place: the test below maximises, the solvers minimise
        np.negative(S, out=S)
    p = _host_certificate(S)
    if p is not None:
        return p
    np.negative(S, out=S)  # SciPy's maximize would negate into a second copy
    return minimum_assignment(S)


def lap_solver_available() -> bool:
    """Whether lapx solves float32 scores here (else SciPy solves everything in float64)."""
    return lap is not None


def minimum_assignment(C: np.ndarray) -> np.ndarray:
    """The permutation p minimising `sum_j C[p[j], j]` of a finite square matrix (no certificate):
    lapx's `lapjvs` on float32, SciPy on anything else or without lapx."""
    n = C.shape[0]
    if C.dtype == np.float32 and lap is not None:
        cols = lap.lapjvs(C, return_cost=False, jvx_like=False, prefer_float32=True)[0]  # row i -> column cols[i]
        return _perm_from_assignment(np.arange(n), np.asarray(cols), n)
    from scipy.optimize import linear_sum_assignment  # 0.3 s to import, and lapx solves float32 scores without it

    return _perm_from_assignment(*linear_sum_assignment(C), n)


def _square_scores(scores):
    S = np.asarray(scores)
    if S.ndim != 2 or S.shape[0] != S.shape[1]:
        raise InputError(f"scores must be a square (n, n) matrix, got shape {S.shape}")
    # always a copy (negated in place below): float32 where lapx solves it, float64 for SciPy
    narrow = lap is not None and np.issubdtype(S.dtype, np.floating) and S.dtype.itemsize <= 4
    S = S.astype(np.float32 if narrow else np.float64)
    bad = S.size - np.count_nonzero(np.isfinite(S))
    if bad:
        raise InputError(f"scores of shape {S.shape} hold {bad} non-finite entries (NaN or Inf); an assignment needs finite scores")
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
    check_square(S, "scores")
    for name, o in (("row_offsets", row_offsets), ("col_offsets", col_offsets)):
        if o is not None and np.shape(o) != S.shape[:-1]:
            raise InputError(f"{name} of shape {np.shape(o)} for scores of shape {S.shape}; expected {S.shape[:-1]}")
    finite = jnp.all(jnp.isfinite(S), axis=(-2, -1))
    offsets = row_offsets is not None or col_offsets is not None
    r = jnp.zeros(S.shape[:-1], S.dtype) if row_offsets is None else upcast(row_offsets)
    c = jnp.zeros(S.shape[:-1], S.dtype) if col_offsets is None else upcast(col_offsets)
    if offsets:
        finite = finite & jnp.all(jnp.isfinite(r), axis=-1) & jnp.all(jnp.isfinite(c), axis=-1)

    # Broadcasts by broadcast_in_dim only (`spread`): part of this runs in a lax.cond branch.
    def reduced(S, r, c, rows=slice(None), cols=slice(None)):  # S' (signed to maximise) on a block of lines
        part = S[..., rows, cols]
        if offsets:
            part = part - spread(r[..., rows], part) - spread_over_rows(c[..., cols], part)
        return part if maximize else -part

    k = _sample_size(S.shape[-1])
    refuted = _collide(jnp.argmax(reduced(S, r, c, cols=slice(k)), axis=-2)) & _collide(jnp.argmax(reduced(S, r, c, rows=slice(k)), axis=-1))

    def test(S, r, c):
        bound = jnp.abs(S) + spread(jnp.abs(r), S) + spread_over_rows(jnp.abs(c), S) if offsets else None
        tol = 8 * float(jnp.finfo(S.dtype).eps / 2)
        best_rows, by_columns = _distinct_maxima(reduced(S, r, c), bound, tol, axis=-2)  # p[j] = best row of j
        best_cols, by_rows = _distinct_maxima(reduced(S, r, c), bound, tol, axis=-1)  # q[i] = best column of i
        inverse = jnp.argsort(best_cols, axis=-1).astype(jnp.int32)  # q^-1 where q is a permutation
        return jnp.where(spread(by_columns, best_rows), best_rows, inverse), by_columns | by_rows

    def refute(S, r, c):  # a sample of the lines already shares a best line both ways (`_sample_size`)
        return jnp.zeros(S.shape[:-1], jnp.int32), jnp.zeros(S.shape[:-2], bool)

    p, certified = batch_cond(jnp.all(refuted), refute, test, S, r, c)
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
        spread_best = spread if axis == -1 else spread_over_rows
        is_best = jax.lax.broadcasted_iota(jnp.int32, S.shape, S.ndim + axis) == spread_best(best, S)
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
    shapes may differ), solved by a pool of threads: both solvers release the GIL while they solve.

    A JAX array is first tested on its device (`certified_assignment`, with `offsets[k] =
    (row_offsets, col_offsets)` for matrix k where given): a certified one never leaves it, only
    its permutation does. The others are fetched inside their worker, so a device array still
    being computed is awaited there while earlier problems are solved; the solver gets them as they
    are (offsets do not change the optimal assignments). Returns int64 permutations."""
    scores = list(scores)
    offsets = [None] * len(scores) if offsets is None else list(offsets)
    if len(offsets) != len(scores):
        raise InputError(f"{len(offsets)} offsets for {len(scores)} score matrices")
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
        raise InputError(f"scores must be a square (n, n) matrix, got shape {S.shape}")
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
    """Host. `linear_assignment` of every (n, n) matrix of `scores` (..., n, n);
    returns (..., n) int32, same convention (`B'[j] = B[p[j]]`, maximising `sum_j S[p[j], j]`),
    solved as `linear_assignments` does."""
    S = np.asarray(scores)
    if S.ndim < 2 or S.shape[-1] != S.shape[-2]:
        raise InputError(f"scores must have shape (..., n, n), got {S.shape}")
    batch, n = S.shape[:-2], S.shape[-1]
    perms = linear_assignments(S.reshape((-1, n, n)), maximize=maximize)
    return np.stack(perms).astype(np.int32).reshape(batch + (n,))


def assign(scores, maximize: bool = True, offsets=None, *, traced_nonfinite: str = "raise"):
    """`batched_linear_assignment` as a JAX operation: (..., n, n) scores -> (..., n) int32.

    With `offsets = (row_offsets, col_offsets)`, each (..., n), the batch is first tested on the
    device (`certified_assignment`); when every matrix is certified, that is the answer and the
    host is not called. Otherwise concrete arrays are solved at once, and traced ones (inside
    `jax.jit` or `jax.vmap`) through `jax.pure_callback`, still exact (the host's solver). Under
    vmap the callback receives the whole batch (`vmap_method="broadcast_all"`), so every model's
    matrices share one thread pool, and is skipped when every model's matrices are certified
    (`batch_cond`). Non-finite scores raise ValueError (inside jit: when the program runs, as a
    JaxRuntimeError wrapping it, and XLA logs the callback's traceback). Traced, with
    `traced_nonfinite="identity"`, such a matrix gets the identity instead and the program runs on:
    for a caller that flags non-finite inputs itself and discards the result (`align` under jit)."""
    if traced_nonfinite not in ("raise", "identity"):
        raise InputError(f"traced_nonfinite={traced_nonfinite!r}; expected 'raise' or 'identity'")
    traced = is_traced(scores, offsets)
    if offsets is not None:
        perm, certified = certified_assignment(scores, *offsets, maximize=maximize)
        if not traced and bool(jnp.all(certified)):
            return perm
    if not traced:
        return jnp.asarray(batched_linear_assignment(scores, maximize), jnp.int32)
    solve = functools.partial(batched_linear_assignment if traced_nonfinite == "raise" else _identity_where_nonfinite, maximize=maximize)
    result = jax.ShapeDtypeStruct(scores.shape[:-1], jnp.int32)
    on_host = lambda perm, scores: jax.pure_callback(solve, result, scores, vmap_method="broadcast_all")  # noqa: E731
    return on_host(None, scores) if offsets is None else batch_cond(jnp.all(certified), lambda perm, scores: perm, on_host, perm, scores)


def _identity_where_nonfinite(scores, maximize: bool = True) -> np.ndarray:
    """`batched_linear_assignment`, with the identity for each matrix holding NaN or Inf: a host
    callback that raises fails the whole program (every model of a vmapped batch) as an opaque
    JaxRuntimeError, so the traced caller that asks for this flags such inputs on the device."""
    S = np.asarray(scores)
    finite = np.isfinite(S).all(axis=(-2, -1))
    if finite.all():  # the usual case: the batch as it came, in one call
        return batched_linear_assignment(S, maximize)
    out = np.broadcast_to(np.arange(S.shape[-1], dtype=np.int32), S.shape[:-1]).copy()
    if finite.any():
        out[finite] = batched_linear_assignment(S[finite], maximize)
    return out
