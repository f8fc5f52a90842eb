"""The merge methods' arithmetic on leaves ({path: array}), in float32, streamed in fixed-size
chunks through one jitted kernel per method (`merging.methods` validates and calls these): the
elementwise means (average, Fisher), RegMean's per-kernel solves, task arithmetic, TIES' exact
trim and sign election, DARE's salted masks and SLERP's per-tensor angle.
"""

from __future__ import annotations

import functools
import math
import warnings
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import checks
from ..errors import InputError
from ..precision import exact_jit, is_traced


def to_jax(x) -> jax.Array:
    """`x` as a JAX array of its canonical dtype, put on the device without a compiled staging
    program (`jnp.asarray` compiles one per shape)."""
    if isinstance(x, jax.Array):
        return x
    x = np.asarray(x)
    return jax.device_put(np.asarray(x, dtype=jax.dtypes.canonicalize_dtype(x.dtype), order="C"))


# ---- the arithmetic ---------------------------------------------------------------------------------
# Every method but slerp and RegMean's solves is elementwise once its per-tensor choices are made
# (TIES' trim, DARE's masks): one jitted kernel runs over all leaves laid end to end in float32, in
# chunks of one fixed size (`_stream`). That is one compilation per method and chunk size, where a
# kernel per leaf compiles once per leaf shape (about 0.1 s each, most of a merge's time), with
# the same arithmetic entry by entry. Results are cast to the anchor's dtype on the host (round to
# nearest even, as XLA casts). TIES' trim is a selection, done exactly on the host (`_trim`).

_CHUNK = 1 << 22  # entries per kernel call (16 MiB per float32 input): a bounded working set


def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _out_dtype(x) -> np.dtype:
    # x.dtype where there is one: NumPy deprecates reading a dtype from an array (result_type(array)).
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _host32(x) -> np.ndarray:
    """A leaf as a flat float32 host array (a view where it is one already)."""
    return np.asarray(x, np.float32).reshape(-1)


def _stream(kernel, shapes: Mapping[str, tuple], inputs, out_dtypes: Mapping[str, Any], *args, rows: int | None = None) -> dict:
    """{path: kernel over path's entries, cast to out_dtypes[path]} for each path of `shapes`.

    inputs(path) -> a tuple of arrays of shapes[path] (any float dtype), prepared when the stream
    reaches the path. `kernel(x, *args)` takes them stacked, x of shape (n_inputs, C) in float32,
    and returns C values, or (rows, C) when `rows` is given (each path then gets (rows, *shape)).
    The kernel must be elementwise along C: entries of several leaves share a call, and a chunk's
    unused tail holds zeros."""
    total = sum(math.prod(shape) for shape in shapes.values())
    # Powers of two: small merges (tests) share a handful of compiled sizes.
    chunk = min(_CHUNK, 1 << max(10, (total - 1).bit_length()))
    lead = () if rows is None else (rows,)
    results = {p: np.empty(lead + (math.prod(shape),), np.float32) for p, shape in shapes.items()}
    buf, fill, pending = None, 0, []

    def flush():
        buf[:, fill:] = 0
        # np.asarray waits for the kernel, so that the buffer may be filled again, even where
        # device_put aliases it: one buffer for every call (fresh ones cost their page faults)
        out = np.asarray(kernel(jax.device_put(buf), *args))
        for path, src, dst, count in pending:
            results[path][..., src:src + count] = out[..., dst:dst + count]

    for path in shapes:
        prepared = inputs(path)
        if is_traced(prepared):  # inside jit / vmap (the first leaf tells): the kernel traced on each whole leaf
            return _traced(kernel, shapes, inputs, out_dtypes, *args, rows=rows)
        arrays = [_host32(x) for x in prepared]
        size, src = arrays[0].size, 0
        while src < size:
            if buf is None:
                buf = np.empty((len(arrays), chunk), np.float32)
            take = min(size - src, chunk - fill)
            for i, a in enumerate(arrays):
                buf[i, fill:fill + take] = a[src:src + take]
            pending.append((path, src, fill, take))
            fill, src = fill + take, src + take
            if fill == chunk:
                flush()
                fill, pending = 0, []
    if fill:
        flush()
    return {
        p: to_jax(results[p].reshape(lead + tuple(shape)).astype(out_dtypes[p], copy=False))
        for p, shape in shapes.items()
    }


def _traced(kernel, shapes: Mapping[str, tuple], inputs, out_dtypes: Mapping[str, Any], *args, rows: int | None = None) -> dict:
    """`_stream`'s result where the leaves are traced (a merge inside jax.jit or vmap): the same
    elementwise kernel on each leaf's entries at once, in float32, cast to out_dtypes[path]."""
    lead = () if rows is None else (rows,)
    out = {}
    for path, shape in shapes.items():
        x = jnp.stack([jnp.asarray(a, jnp.float32).reshape(-1) for a in inputs(path)])
        out[path] = kernel(x, *args).reshape(lead + tuple(shape)).astype(out_dtypes[path])
    return out


def refuse_traced(method: str, *trees) -> None:
    """The merges whose choices run on the host (TIES' exact trim, statistics checked against
    their params) cannot trace: refused by name inside jax.jit / vmap / grad."""
    if is_traced(*trees):
        name = "otfusion.ot_fuse (merge 'ot_fusion')" if method == "ot_fusion" else f"merge.{method}"
        raise InputError(f"{name} runs on the host ({HOST_ONLY[method]}): call it outside jax.jit, vmap and grad; "
                         f"average, task_arithmetic, dare (then='task_arithmetic') and slerp trace")


HOST_ONLY = {"ties": "its trim is an exact selection of each task vector's largest entries",
             "dare": "then='ties' trims each task vector by an exact selection",
             "fisher": "its statistics are checked against the params they were computed on",
             "regmean": "its statistics are checked against the params they were computed on",
             "ot_fusion": "it solves its transport plans with SciPy or POT"}


def _elementwise(kernel, models, per_leaf=(), *args, rows=None, anchor=None) -> dict:
    """`_stream` over the merged leaves of `models` ({path: leaf} each): the kernel gets each
    model's leaf, then those of each mapping in `per_leaf` (e.g. the base), stacked; results in
    the anchor's dtype (`anchor`, default models[0])."""
    anchor = models[0] if anchor is None else anchor
    shapes = {p: np.shape(x) for p, x in models[0].items()}
    out = {p: _out_dtype(anchor[p]) for p in shapes}
    inputs = lambda p: tuple(m[p] for m in models) + tuple(extra[p] for extra in per_leaf)
    return _stream(kernel, shapes, inputs, out, *args, rows=rows)


@exact_jit
def _average_kernel(x, weights):
    acc = 0.0
    for i in range(x.shape[0]):
        acc = acc + weights[i] * x[i]
    return acc


def average_leaves(models, weights):
    return _elementwise(_average_kernel, models, (), weights)


@exact_jit
def _fisher_kernel(x, weights, eps):
    n = x.shape[0] // 2  # the models' entries, then their Fishers'
    num, den = 0.0, 0.0
    for i in range(n):
        f = weights[i] * (x[n + i] + eps)
        num, den = num + f * x[i], den + f
    return num / den


def fisher_leaves(models, fishers, weights, eps):
    return _elementwise(_fisher_kernel, models, fishers, weights, eps)


@exact_jit
def _regmean_leaf(xs, gs, alpha, jitter):
    s, rhs = 0.0, 0.0
    for x, g in zip(xs, gs):
        g = _f32(g)
        g = alpha * g + (1.0 - alpha) * jnp.diag(jnp.diag(g))
        s = s + g
        rhs = rhs + jnp.matmul(g, _f32(x))
    diag = jnp.diag(s)
    s = s + jnp.diag(jnp.full_like(diag, jitter * jnp.mean(diag)))
    merged = jnp.linalg.solve(s, rhs)
    growth = jnp.linalg.norm(merged) / jnp.maximum(jnp.max(jnp.stack([jnp.linalg.norm(_f32(x)) for x in xs])), jnp.finfo(jnp.float32).tiny)
    return merged.astype(xs[0].dtype), growth


# A least-squares merge many times larger than every model it merges solved a singular system.
REGMEAN_GROWTH_LIMIT = 10.0


def regmean_leaves(models, grams, alpha, jitter) -> tuple[dict, dict]:
    """The merged leaves, and the kernels that grew past REGMEAN_GROWTH_LIMIT ({path: (their norm
    over the largest model's, their inputs)}) for `warn_if_grown`: a streamed merge warns once
    for all its chunks."""
    # Leaves without Grams are averaged (streamed together); each kernel solves its regression.
    uniform = np.full(len(models), 1.0 / len(models), np.float32)
    rest = [{p: x for p, x in m.items() if p not in grams[0]} for m in models]
    out = _elementwise(_average_kernel, rest, (), uniform, anchor=models[0])
    growths = {}
    for path in models[0]:
        if path in grams[0]:
            xs = tuple(to_jax(m[path]) for m in models)
            out[path], growths[path] = _regmean_leaf(xs, tuple(g[path] for g in grams), alpha, jitter)
    # read once the kernels are all dispatched (one host round-trip, not one per kernel)
    grown = {p: (float(g), np.shape(models[0][p])[0]) for p, g in jax.device_get(growths).items()
             if not g <= REGMEAN_GROWTH_LIMIT}  # NaN included
    return {p: out[p] for p in models[0]}, grown


def warn_if_grown(grown: dict) -> None:
    """One warning for RegMean's kernels that grew past REGMEAN_GROWTH_LIMIT (`regmean_leaves`)."""
    if not grown:
        return
    worst = max(grown, key=lambda p: grown[p][0] if math.isfinite(grown[p][0]) else math.inf)
    growth, inputs = grown[worst]
    warnings.warn(
        f"regmean: {len(grown)} merged kernel(s) came out over {REGMEAN_GROWTH_LIMIT:.0f}x the norm of every model's "
        f"({worst!r}: {growth:.3g}x): their summed Gram matrices are singular or nearly (the data spans fewer "
        f"directions than the kernel's {inputs} inputs), so the regression is underdetermined and "
        "the merge is likely broken; pass alpha < 1 (e.g. 0.9: the paper's shrinkage of the off-diagonal), jitter > 0, or "
        "more varied data",
        stacklevel=3,
    )


@exact_jit
def _task_arithmetic_kernel(x, lam):
    b = x[-1]  # the models' entries, then the base's
    tau = sum(x[i] - b for i in range(x.shape[0] - 1))
    return b + lam * tau


def task_arithmetic_leaves(base, models, lam):
    return _elementwise(_task_arithmetic_kernel, models, (base,), lam)


def _keep_count(density, size):
    # Rounded first: 0.7 * 10 is 7.000000000000001 in floating point, and should keep 7.
    return max(1, math.ceil(round(density * size, 9)))


def _trim(tau: np.ndarray, density: float) -> np.ndarray:
    """`tau` (float32, on the host) with all but its ceil(density * size) entries of largest
    magnitude zeroed: exactly that many, equal magnitudes kept in index order (lower first,
    `keep_largest`)."""
    flat = np.asarray(tau, np.float32).reshape(-1)
    k = _keep_count(density, flat.size)
    if k >= flat.size:
        return flat.reshape(np.shape(tau))
    return np.where(keep_largest(flat, k), flat, np.float32(0.0)).reshape(np.shape(tau))


def keep_largest(x: np.ndarray, k: int) -> np.ndarray:
    """The mask (x's shape) of the k entries of `x` (float32) of largest magnitude: exactly k,
    equal magnitudes kept in index order (lower first). The k-th largest magnitude is selected on
    the float32 bit patterns (for non-negative floats they order as the values, subnormals and
    zeros included) in linear time."""
    flat = np.asarray(x, np.float32).reshape(-1)
    keep = np.zeros(flat.size, bool)
    if k <= 0 or k >= flat.size:
        keep[:] = k > 0
        return keep.reshape(np.shape(x))
    bits = np.abs(flat).view(np.int32)
    kth = np.partition(bits, flat.size - k)[flat.size - k]
    keep = bits > kth
    ties = np.flatnonzero(bits == kth)[: k - int(np.count_nonzero(keep))]
    keep[ties] = True
    return keep.reshape(np.shape(x))


def _ties_combine(taus):
    """TIES' elect and disjoint mean of trimmed task vectors (a sequence of arrays)."""
    gamma = jnp.sign(sum(taus))
    total, count = 0.0, 0
    for tau in taus:
        agree = (jnp.sign(tau) == gamma) & (tau != 0)
        total = total + jnp.where(agree, tau, 0.0)
        count = count + agree.astype(jnp.int32)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)


@exact_jit
def _ties_kernel(x, lam):
    b = x[-1]  # the trimmed task vectors, then the base
    return b + lam * _ties_combine([x[i] for i in range(x.shape[0] - 1)])


def _per_tensor(path, fn, x):
    """`fn` on the leaf, or on each slot of a stacked leaf (`checks.STACKED_LEAVES`: one
    checkpoint tensor per expert)."""
    return np.stack([fn(slot) for slot in x]) if checks.is_stacked(path) else fn(x)


def _trimmed_taus(base, models, density):
    # The task vectors, in float32 on the host (a subtraction: the kernels' own arithmetic), trimmed per tensor.
    return lambda p: tuple(_per_tensor(p, lambda t: _trim(t, density), (_host32(m[p]) - _host32(base[p])).reshape(np.shape(base[p])))
                           for m in models)


def ties_leaves(base, models, lam, *, density):
    shapes = {p: np.shape(x) for p, x in models[0].items()}
    taus = _trimmed_taus(base, models, density)
    out = {p: _out_dtype(models[0][p]) for p in shapes}
    return _stream(_ties_kernel, shapes, lambda p: (*taus(p), base[p]), out, lam)


def _path_salt(path):
    return np.uint32(zlib.crc32(path.encode()))


@functools.partial(exact_jit, static_argnums=(3, 4))
def _dare_masks(key, salt, drop, n, size):
    # Every model's mask in one draw (row i: model i), as documented; (n, size) draws the same bits
    # as (n, *leaf shape), and compiles once per leaf size rather than per shape.
    return jax.random.bernoulli(jax.random.fold_in(key, salt), 1.0 - drop, (n, size))


@exact_jit
def _dare_taus_kernel(x, drop):
    n = x.shape[0] // 2  # the models' entries, then their masks, then the base
    keep, b = 1.0 - drop, x[-1]
    return jnp.stack([jnp.where(x[n + i] != 0, (x[i] - b) / keep, 0.0) for i in range(n)])


@exact_jit
def _dare_sum_kernel(x, drop, lam):
    b = x[-1]
    return b + lam * sum(_dare_taus_kernel(x, drop))


def dare_leaves(base, models, key, drop, lam, *, then, density):
    n = len(models)
    shapes = {p: np.shape(x) for p, x in models[0].items()}
    out = {p: _out_dtype(models[0][p]) for p in shapes}

    traced = is_traced(models, base, key)

    def inputs(p):
        masks = _dare_masks(key, _path_salt(p), drop, n, math.prod(shapes[p]))
        return (*(m[p] for m in models), *(masks if traced else np.asarray(masks)), base[p])

    if then == "task_arithmetic":
        return _stream(_dare_sum_kernel, shapes, inputs, out, drop, lam)
    # TIES on the rescaled task vectors: computed by the kernel, trimmed on the host, combined.
    f32 = {p: np.float32 for p in shapes}
    taus = _stream(_dare_taus_kernel, shapes, inputs, f32, drop, rows=n)
    trimmed = lambda p: (*(_per_tensor(p, lambda x: _trim(x, density), np.asarray(t).reshape(shapes[p])) for t in taus[p]), base[p])
    return _stream(_ties_kernel, shapes, trimmed, out, lam)


@exact_jit
def _slerp_leaf(xs, t, eps):
    x_a, x_b = xs
    a, b = _f32(x_a).ravel(), _f32(x_b).ravel()
    na, nb = jnp.linalg.norm(a), jnp.linalg.norm(b)
    zero = (na == 0) | (nb == 0)
    ua, ub = a / jnp.where(zero, 1.0, na), b / jnp.where(zero, 1.0, nb)
    omega = 2.0 * jnp.arctan2(jnp.linalg.norm(ua - ub), jnp.linalg.norm(ua + ub))
    sin = jnp.sin(omega)
    linear = zero | (sin < eps)
    safe = jnp.where(linear, 1.0, sin)
    ca = jnp.where(linear, 1.0 - t, jnp.sin((1.0 - t) * omega) / safe)
    cb = jnp.where(linear, t, jnp.sin(t * omega) / safe)
    return (ca * a + cb * b).reshape(jnp.shape(x_a)).astype(x_a.dtype)


def slerp_leaves(leaves_a, leaves_b, t, eps):
    # Per tensor (its norms): a kernel per leaf shape; a stacked leaf's slots (experts) each their own.
    def one(p):
        a, b = to_jax(leaves_a[p]), to_jax(leaves_b[p])
        if checks.is_stacked(p):
            return jnp.stack([_slerp_leaf((a[e], b[e]), t, eps) for e in range(a.shape[0])])
        return _slerp_leaf((a, b), t, eps)

    return {p: one(p) for p in leaves_a}
