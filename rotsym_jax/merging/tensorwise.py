"""mergekit's merge methods, one output tensor at a time, as mergekit 0.1.5 defines them: the
kernels `rotsym merge` runs on a mergekit config (`io.mergekit`), each declared in the one merge
registry (`registry.Method` with a `tensorwise` implementation) under mergekit's name.

They are not rotsym's `merge.METHODS` under other names: mergekit's SLERP interpolates linearly
below an angle of about 1.8 degrees (|cos| > 0.9995), its TIES keeps floor(density * n) entries
and elects + where the signs cancel, its DARE rescales by the L1 norm rather than 1 / density.
A config written for mergekit gets mergekit's arithmetic; rotsym's own recipes keep the papers'.

Each kernel takes the models' tensors in float32 (their order: the config's), the base's (None
where the method takes none), the shared parameters and one mapping of parameters per input, and
returns the merged tensor in float32, on the host. Random sparsification draws from `rng(i)`, a
generator per input that the caller seeds from the config's seed and the tensor's name, so that a
tensor's result does not depend on which tensors are merged before it (streamed or not).

Exceptions to bitwise agreement with mergekit, documented: entries of equal magnitude at the
boundary of a magnitude trim (mergekit's argsort does not specify their order; here the earlier
entry is kept), random masks (mergekit draws from torch's global generator), `arcee_fusion`'s
mask at its threshold (its scores multiply a KL divergence summed from nearly cancelling float32
terms, whose rounding decides about 0.1% of the entries) and over a million entries (mergekit
samples the scores' quantiles at random), and the methods mergekit computes in a low-precision
`dtype` (here in float32 after rounding the inputs to it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..errors import InputError
from .arithmetic import keep_largest
from .registry import MERGEKIT, REQUIRED, Method, Param, register

Kernel = Callable[..., np.ndarray]


# ---- linear, slerp, nuslerp, passthrough -------------------------------------------------------------

def _sum(x: np.ndarray, axis=None, keepdims: bool = False) -> np.ndarray:
    """A float32 reduction accumulated in float64: torch's float32 sums are cascaded, near the exact
    sum; NumPy's float32 dot products (BLAS) are not (1e-4 off on a 6M-entry embedding)."""
    return np.sum(x, axis=axis, dtype=np.float64, keepdims=keepdims).astype(np.float32)


def _norm(x: np.ndarray, axis=None, keepdims: bool = False) -> np.ndarray:
    return np.sqrt(_sum(np.square(x), axis=axis, keepdims=keepdims))


def linear(tensors, base, shared, inputs, rng) -> np.ndarray:
    """sum_i w_i x_i, divided by sum_i w_i when `normalize`."""
    weights = np.asarray([p["weight"] for p in inputs], np.float32)
    out = np.zeros_like(tensors[0])
    for x, w in zip(tensors, weights):
        out += x * w
    if shared["normalize"]:
        out /= _sum(weights)
    return out


def slerp(tensors, base, shared, inputs, rng) -> np.ndarray:
    """Spherical interpolation from the base (t = 0) to the other input (t = 1) over the whole
    tensor; linear where |cos| > 0.9995. Norms at most 1e-8 count as 1 (mergekit's guards)."""
    other = tensors[1] if tensors[0] is base else tensors[0]
    t = np.float32(shared["t"])
    a, b = base.reshape(-1), other.reshape(-1)
    if a.size == 0:
        return ((1 - t) * base + t * other).astype(np.float32)
    norm_a, norm_b = _norm(a), _norm(b)
    norm_a = norm_a if norm_a > 1e-8 else np.float32(1)
    norm_b = norm_b if norm_b > 1e-8 else np.float32(1)
    dot = np.float32(np.clip(_sum((a / norm_a) * (b / norm_b)), -1, 1))
    if abs(dot) > 0.9995:
        ca, cb = 1 - t, t
    else:
        theta = np.arccos(dot)
        sin = np.sin(theta)
        ca, cb = np.sin((1 - t) * theta) / sin, np.sin(t * theta) / sin
    return (np.float32(ca) * base + np.float32(cb) * other).astype(np.float32)


def _nuslerp(t: float, v0: np.ndarray, v1: np.ndarray, row_wise: bool, flatten: bool) -> np.ndarray:
    shape = v0.shape
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif row_wise:
        v0, v1 = np.swapaxes(v0, 0, -1), np.swapaxes(v1, 0, -1)

    def unit(x):
        return x / np.maximum(_norm(x, axis=-1, keepdims=True), np.float32(1e-7))

    cos = np.clip(_sum(unit(v0) * unit(v1), axis=-1, keepdims=True), -1, 1)
    colinear = (1 - cos * cos) <= np.float32(1e-16)
    theta = np.arccos(np.where(colinear, np.float32(0), cos))
    sin = np.sin(theta)
    with np.errstate(divide="ignore", invalid="ignore"):
        spherical = (np.sin((1 - t) * theta) * v0 + np.sin(t * theta) * v1) / sin
    out = np.where(colinear, (1 - t) * v0 + t * v1, spherical).astype(np.float32)
    if row_wise and not flatten:
        out = np.swapaxes(out, 0, -1)
    return out.reshape(shape)


def nuslerp(tensors, base, shared, inputs, rng) -> np.ndarray:
    """SLERP of the two non-base inputs at t = w_2 / (w_1 + w_2) (0.5 where the weights cancel),
    of their task vectors where there is a base; over the flattened tensor (`nuslerp_flatten`),
    else each row (`nuslerp_row_wise`) or each column."""
    pairs = [(x, p) for x, p in zip(tensors, inputs) if x is not base]
    (x0, p0), (x1, p1) = pairs
    total = p0["weight"] + p1["weight"]
    t = np.float32(0.5 if abs(total) < 1e-6 else p1["weight"] / total)
    row_wise, flatten = shared["nuslerp_row_wise"], shared["nuslerp_flatten"]
    if base is not None:
        return (base + _nuslerp(t, x0 - base, x1 - base, row_wise, flatten)).astype(np.float32)
    return _nuslerp(t, x0, x1, row_wise, flatten)


def passthrough(tensors, base, shared, inputs, rng) -> np.ndarray:
    """The one input, times its `scale` where given."""
    scale = inputs[0].get("scale")
    return tensors[0] if scale is None else tensors[0] * np.float32(scale)


def nearswap(tensors, base, shared, inputs, rng) -> np.ndarray:
    """The base, moved to the other model where they are within `t` of each other: each entry
    w b + (1 - w) a with w = min(1, t / |a - b|) (|a - b| at least 1e-6)."""
    other = next(x for x in tensors if x is not base)
    weight = np.clip(np.float32(shared["t"]) / np.maximum(np.abs(base - other), np.float32(1e-6)), 0, 1)
    return (weight * other + (1 - weight) * base).astype(np.float32)


# ---- RAM, RAM+ (tensor-local), Arcee Fusion ------------------------------------------------------------

def _ram_vectors(tensors, base, epsilon):
    """The task vectors (models, entries) zeroed where |x - base| <= epsilon, and how many models
    change each entry."""
    vectors = np.stack([x - base for x in tensors if x is not base]).reshape(len(tensors) - 1, -1)
    changed = np.abs(vectors) > np.float32(epsilon)
    return np.where(changed, vectors, np.float32(0)), changed, changed.sum(axis=0)


def ram(tensors, base, shared, inputs, rng) -> np.ndarray:
    """The base plus each changed entry of one model's task vector as it is, and the mean of those
    several models change (Reinforced Agent Merging, arXiv 2601.13572; mergekit's `ram`)."""
    if len(tensors) == 1:
        return base
    vectors, _, counts = _ram_vectors(tensors, base, shared["epsilon"])
    return (base + _sum(vectors / np.maximum(counts, 1).astype(np.float32), axis=0).reshape(base.shape)).astype(np.float32)


def ramplus_tl(tensors, base, shared, inputs, rng) -> np.ndarray:
    """RAM whose entries only one model changes are scaled, per model, by 1 + r min(alpha, rho),
    rho the model's entries it shares with another over those it changes alone (max(0, .))."""
    if len(tensors) == 1:
        return base
    vectors, changed, counts = _ram_vectors(tensors, base, shared["epsilon"])
    overlap, unique = counts > 1, counts == 1
    rho = (changed & overlap).sum(axis=1) / np.maximum((changed & unique).sum(axis=1).astype(np.float32), np.float32(shared["epsilon"]))
    scale = (1 + np.float32(shared["r"]) * np.clip(rho, 0, shared["alpha"])).astype(np.float32)
    merged = vectors * np.where(unique, scale[:, None], np.where(overlap, 1 / np.maximum(counts, 1).astype(np.float32), 0))
    return (base + _sum(merged, axis=0).reshape(base.shape)).astype(np.float32)


def arcee_fusion(tensors, base, shared, inputs, rng) -> np.ndarray:
    """The base, moved to the other model where its change is important: |x - base| times the KL
    divergence of softmax(x) from softmax(base) along the last axis, at least the median plus 1.5
    interquartile ranges of those scores (quantiles read off the sorted scores at floor(q (n - 1)),
    as mergekit; mergekit samples a million scores of larger tensors at random, here all are read)."""
    other = next(x for x in tensors if x is not base)

    def softmax(x):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / _sum(e, axis=-1, keepdims=True) + np.float32(1e-8)

    p, q = softmax(other), softmax(base)
    importance = np.abs(other - base) * _sum(p * np.log(p / q), axis=-1, keepdims=True)
    ordered = np.sort(importance.reshape(-1))
    q1, median, q3 = (ordered[int(np.float32(f) * (ordered.size - 1))] for f in (0.25, 0.5, 0.75))
    return (base + (other - base) * (importance >= median + np.float32(1.5) * (q3 - q1))).astype(np.float32)


def multislerp(tensors, base, shared, inputs, rng) -> np.ndarray:
    """Barycentric SLERP of the non-base inputs (their task vectors where there is a base), each
    flattened: their unit vectors' weighted mean, the weighted tangent vectors there mapped back by
    the exponential map, scaled to the weighted mean norm (mergekit's multislerp, `eps` its guard)."""
    pairs = [(x, p) for x, p in zip(tensors, inputs) if x is not base]
    if len(pairs) == 1:
        return pairs[0][0]
    stacked = np.stack([x for x, _ in pairs])
    if base is not None:
        stacked = stacked - base
    flat = stacked.reshape(len(pairs), -1)
    w = np.asarray([p["weight"] for _, p in pairs], np.float32)
    if shared["normalize_weights"]:
        w = w / np.float32(w.sum())
    eps = np.float32(shared["eps"])
    norms = _norm(flat, axis=-1, keepdims=True)
    unit = flat / (norms + eps)
    mean = (unit * w[:, None]).sum(0)
    mean_norm = _norm(mean)
    if mean_norm < eps:
        if len(pairs) != 2:
            raise InputError("multislerp: the weighted sum of the inputs is zero (antipodal inputs whose weights balance); "
                             "give other weights")
        result = (stacked[0] * w[0] + stacked[1] * w[1]).reshape(stacked.shape[1:])  # linear, as mergekit falls back
    else:
        mean = mean / mean_norm
        tangent = unit - _sum(unit * mean, axis=-1, keepdims=True) * mean
        direction = (tangent * w[:, None]).sum(0)
        length = _norm(direction) + eps
        result = (mean * np.cos(length) + direction * (np.sin(length) / length)) * (norms[:, 0] * w).sum()
        result = result.reshape(stacked.shape[1:])
    return (result if base is None else result + base).astype(np.float32)


def sce(tensors, base, shared, inputs, rng) -> np.ndarray:
    """SCE (FuseChat, Wan et al. 2024): the task vectors restricted to the `select_topk` share of
    entries where they vary most across the models (of the entries where they vary at all), each
    weighted by its selected entries' mean square (the weights normalised to sum to 1), the entries
    whose sign is not that of the task vectors' sum erased (TIES' sign election), divided by the
    weights left."""
    deltas = [x - base for x in tensors if x is not base]
    if not deltas:
        return base
    tvs = np.stack(deltas)
    share = shared["select_topk"]
    if share < 1:
        tvs = tvs * _top_variance(tvs, share)[None]
    majority = np.where(tvs.sum(axis=0) >= 0, np.float32(1), np.float32(-1))
    erase = (np.sign(tvs) == majority).astype(np.float32)
    weights = np.asarray([_sum(np.square(t)) / np.float32(t.size) for t in tvs], np.float32)
    total = float(weights.sum())
    weights = np.full(len(tvs), 1 / len(tvs), np.float32) if abs(total) < 1e-6 else weights / np.float32(total)
    erased = weights.reshape((-1,) + (1,) * base.ndim) * erase
    merged = (tvs * erased).sum(axis=0) / np.maximum(erased.sum(axis=0), np.float32(1e-6))
    return (base + merged).astype(np.float32)


def _top_variance(tvs: np.ndarray, share: float) -> np.ndarray:
    """1 on the int(share * n) entries of largest variance across the models (n: the entries whose
    variance is not 0), 0 elsewhere; ties at the boundary keep the lower index."""
    if share <= 0:
        return np.zeros(tvs.shape[1:], np.float32)
    var = np.var(tvs, axis=0, dtype=np.float64).astype(np.float32)
    k = int(np.count_nonzero(var) * share)
    mask = np.zeros(var.size, np.float32)
    if k:
        mask[np.argsort(-np.abs(var).reshape(-1), kind="stable")[:k]] = 1
    return mask.reshape(var.shape)


def karcher(tensors, base, shared, inputs, rng) -> np.ndarray:
    """The Karcher mean on the unit sphere of every input (equal weights), by at most `max_iter`
    Riemannian gradient steps until the tangent's norm is below `tol`, scaled by the mean norm
    (mergekit's karcher; inputs of norm at most `tol` left out of the direction)."""
    if len(tensors) == 1:
        return tensors[0]
    tol, alpha = shared["tol"], np.float32(1 / len(tensors))
    norms = [_norm(x) for x in tensors]
    valid = [(x / n).astype(np.float32) for x, n in zip(tensors, norms) if n > tol]
    if not valid:
        return np.zeros_like(tensors[0])
    weight = np.float32(1 / len(valid))
    mean = sum((weight * u for u in valid[1:]), weight * valid[0])
    mean_norm = _norm(mean)
    mean = valid[0].copy() if mean_norm < tol else mean / mean_norm
    for _ in range(int(shared["max_iter"])):
        tangent = np.zeros_like(mean)
        for u in valid:
            dot = np.float32(np.clip(_sum(mean * u), -1, 1))
            theta = np.arccos(dot)
            if theta < tol:
                continue
            tangent += weight * (theta / np.sin(theta)) * (u - dot * mean)
        length = _norm(tangent)
        if length < tol:
            break
        mean = np.cos(length) * mean + np.sin(length) * (tangent / length)
        unit_norm = _norm(mean)
        if unit_norm > tol:
            mean = mean / unit_norm
    return (sum(alpha * n for n in norms) * mean).astype(np.float32)


def model_stock(tensors, base, shared, inputs, rng) -> np.ndarray:
    """Model Stock (Jang et al. 2024): t * mean(models) + (1 - t) * base, with t = N cos / (1 + (N - 1)
    cos) from the mean cosine between the models' offsets from the base, over the whole tensor or
    (`filter_wise`) each row; the base where 1 + (N - 1) cos is within 1e-6 of 0 (mergekit's guard)."""
    ws = [x for x in tensors if x is not base]
    if shared["filter_wise"]:
        w0, ws = (base, ws) if base.ndim > 1 else (base[None], [w[None] for w in ws])
    else:
        w0, ws = base.reshape(-1), [w.reshape(-1) for w in ws]
    offsets = [w - w0 for w in ws]
    cosines = [np.clip(_sum(a * b, axis=-1) / np.maximum(_norm(a, axis=-1) * _norm(b, axis=-1), np.float32(1e-6)), -1, 1)
               for i, a in enumerate(offsets) for b in offsets[i + 1:]]
    cos = (_sum(np.stack(cosines), axis=0) / np.float32(len(cosines)))[..., None]
    n = np.float32(len(ws))
    denominator = 1 + (n - 1) * cos
    singular = np.abs(denominator) < 1e-6
    t = np.where(singular, np.float32(0), n * cos / np.where(singular, np.float32(1), denominator))
    average = sum(ws[1:], ws[0].copy()) / n
    return (t * average + (1 - t) * w0).reshape(base.shape).astype(np.float32)


# ---- generalized task arithmetic -------------------------------------------------------------------

def _rescaled(delta: np.ndarray, mask: np.ndarray, rescale: bool) -> np.ndarray:
    """delta * mask, scaled back to delta's L1 norm when `rescale` (unless either norm is below 1e-7)."""
    masked = delta * mask
    if not rescale:
        return masked
    before, after = _sum(np.abs(delta)), _sum(np.abs(masked))
    if before < 1e-7 or after < 1e-7:
        return masked
    return masked * np.float32(before / after)


def magnitude(delta, density, rescale, **_) -> np.ndarray:
    """The floor(density * n) entries of largest magnitude (at least one)."""
    if density >= 1:
        return delta
    if density <= 0 or delta.size == 0:
        return np.zeros_like(delta)
    k = max(1, int(density * delta.size))
    return _rescaled(delta, keep_largest(delta, k).astype(np.float32), rescale)


def magnitude_outliers(delta, density, rescale, gamma, **_) -> np.ndarray:
    """Model Breadcrumbs: the int(gamma * n) largest magnitudes dropped, then the smallest, to keep
    int(density * n) entries."""
    if density >= 1:
        return delta
    n = delta.size
    keep, top = int(density * n), int(gamma * n)
    # mergekit's ascending order, entries bottom..bottom + keep: the keep + top largest less the top
    # largest, or where bottom is 0, all but the n - keep largest (selections in linear time)
    if n - keep - top > 0:
        mask = keep_largest(delta, keep + top) & ~keep_largest(delta, top)
    else:
        mask = ~keep_largest(delta, n - keep) if n > keep else np.ones(delta.shape, bool)
    return _rescaled(delta, mask.astype(np.float32), rescale)


def bernoulli(delta, density, rescale, rng, **_) -> np.ndarray:
    """DARE: each entry kept with probability `density`."""
    if density >= 1:
        return delta
    mask = (rng.random(delta.shape, dtype=np.float32) < density).astype(np.float32)
    return _rescaled(delta, mask, rescale)


def della_magprune(delta, density, rescale, epsilon, rng, **_) -> np.ndarray:
    """DELLA's MagPrune: per row (a vector: one row), entry of magnitude rank r of c kept with
    probability density - epsilon + 2 epsilon (r - 1) / (c - 1)."""
    if density >= 1:
        return delta
    if density <= 0:
        return np.zeros_like(delta)
    if density + epsilon >= 1 or density - epsilon <= 0:
        raise InputError(f"della: density {density} +/- epsilon {epsilon} must stay in (0, 1)")
    rows = delta.reshape(1, -1) if delta.ndim < 2 else delta
    order = np.argsort(np.abs(rows), axis=1, kind="stable")
    ranks = np.empty(rows.shape, np.float32)  # the inverse permutation: each entry's rank, from 1
    np.put_along_axis(ranks, order, np.arange(1, rows.shape[1] + 1, dtype=np.float32)[None], axis=1)
    low, high = ranks.min(axis=1, keepdims=True), ranks.max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        normed = np.clip((ranks - low) / (high - low), 0, 1)
    probs = np.float32(density - epsilon) + normed * np.float32(2 * epsilon)
    mask = (rng.random(rows.shape, dtype=np.float32) < probs).astype(np.float32)
    return _rescaled(rows, mask, rescale).reshape(delta.shape)


SPARSIFY = {"magnitude": magnitude, "random": bernoulli, "magnitude_outliers": magnitude_outliers, "della_magprune": della_magprune}


def task_arithmetic_family(sparsify: str | None, consensus: bool) -> Kernel:
    """mergekit's generalized task arithmetic: task vectors x_i - base, sparsified per tensor,
    weighted; with `consensus`, each entry keeps the inputs whose sign is the sign of the weighted
    sum (+ where it is 0), divided by their summed weights with `normalize`; without, all of them
    divided by the summed weights; times `lambda`, added to the base."""

    def kernel(tensors, base, shared, inputs, rng) -> np.ndarray:
        others = [(i, x, p) for i, (x, p) in enumerate(zip(tensors, inputs)) if x is not base]
        if not others:
            return base
        deltas, weights = [], []
        for i, x, p in others:
            delta = x - base
            if sparsify is not None:
                delta = SPARSIFY[sparsify](delta, p["density"], shared["rescale"], gamma=p.get("gamma"), epsilon=p.get("epsilon"),
                                           rng=rng(i))
            weights.append(np.float32(p["weight"]))
            deltas.append(delta * weights[-1])
        stacked = np.stack(deltas)
        w = np.asarray(weights, np.float32).reshape((-1,) + (1,) * base.ndim)
        if consensus:
            majority = np.where(stacked.sum(axis=0) >= 0, np.float32(1), np.float32(-1))
            mask = (np.sign(stacked) == majority).astype(np.float32)
            mixed = (stacked * mask).sum(axis=0)
            divisor = (w * mask).sum(axis=0)
            divisor[divisor == 0] = 1
        else:
            mixed = stacked.sum(axis=0)
            divisor = np.broadcast_to(w.sum(axis=0), base.shape).copy()
            divisor[np.abs(divisor) < 1e-8] = 1
        if shared["normalize"]:
            mixed = mixed / divisor
        if shared["lambda"] != 1:
            mixed = mixed * np.float32(shared["lambda"])
        return (base + mixed).astype(np.float32)

    return kernel


# ---- the registry -----------------------------------------------------------------------------------
# Each method declared once (registry.Method, tensorwise implementation), as mergekit 0.1.5 declares
# it: its parameters, their scope and defaults (no ranges: mergekit takes any number), its base,
# how many models besides the base (every model where it takes none). Registered in the one
# registry under mergekit's names; rotsym's own methods of the same names (ties, slerp,
# task_arithmetic) are other methods, in rotsym's vocabulary (registry.py says why).

def _shared(name: str, type_: type, default, help: str = "") -> Param:
    return Param(name, type_, default, help)


def _each(name: str, type_: type, default, help: str = "", scope: str = "non_base") -> Param:
    return Param(name, type_, default, help, scope=scope)


_WEIGHT = _each("weight", float, REQUIRED, "the model's weight")
_INT8_MASK = _shared("int8_mask", bool, False, "masks stored as int8 (memory only: the result is the same)")


def _gta(name: str, sparsify: str | None, consensus: bool, normalize: bool, rescale: bool, help: str) -> Method:
    params = [_INT8_MASK, _shared("normalize", bool, normalize, "divide by the summed weights (of the agreeing models, with consensus)"),
              _shared("rescale", bool, rescale, "restore each sparsified task vector's L1 norm"),
              _shared("lambda", float, 1.0, "scale of the merged task vector"), _WEIGHT,
              _each("density", float, 1.0, "fraction of each task vector kept")]
    if sparsify == "magnitude_outliers":
        params.append(_each("gamma", float, 0.01, "fraction of the largest magnitudes dropped"))
    if sparsify == "della_magprune":
        params.append(_each("epsilon", float, 0.15, "spread of the keep probabilities around density"))
    random = sparsify in ("random", "della_magprune")
    grain = "element" if sparsify is None and not consensus else "tensor"
    return Method(name, None, params, needs={"base", "key"} if random else {"base"}, min_models=0, help=help, granularity=grain,
                  tensorwise=task_arithmetic_family(sparsify, consensus))


_T = _shared("t", float, REQUIRED, "interpolation: 0 gives the base, 1 the other model")
for _method in (
    Method("linear", None, [_each("weight", float, REQUIRED, "the model's weight", scope="input"),
                            _shared("normalize", bool, True, "divide by the summed weights")],
           min_models=1, help="weighted sum of the models", granularity="element", tensorwise=linear),
    Method("slerp", None, [_T], needs={"base"}, min_models=1, max_models=1, help="spherical interpolation from the base to the other model",
           granularity="tensor", tensorwise=slerp),
    Method("nuslerp", None, [_WEIGHT, _shared("nuslerp_row_wise", bool, False, "interpolate each row rather than each column"),
                             _shared("nuslerp_flatten", bool, True, "interpolate the flattened tensor")],
           optional={"base"}, min_models=2, max_models=2, help="spherical interpolation of two models (of their task vectors with a base)",
           granularity="tensor", tensorwise=nuslerp),
    Method("passthrough", None, [_each("scale", float, None, "a factor of the tensor", scope="input")], min_models=1, max_models=1,
           help="the one model's tensor", granularity="element", tensorwise=passthrough),
    Method("model_stock", None, [_shared("filter_wise", bool, False, "a ratio per row rather than per tensor")], needs={"base"}, min_models=2,
           help="the models' mean and the base by their offsets' angle (Jang et al. 2024)", granularity="tensor", tensorwise=model_stock),
    Method("sce", None, [_INT8_MASK, _shared("select_topk", float, 1.0, "share of the entries of largest variance kept")], needs={"base"},
           min_models=0, help="select, calculate, erase (FuseChat, Wan et al. 2024)", granularity="tensor", tensorwise=sce),
    Method("karcher", None, [_shared("max_iter", float, 10, "most gradient steps"), _shared("tol", float, 1e-5, "tangent norm to stop at")],
           min_models=1, help="the Karcher mean on the sphere", granularity="tensor", tensorwise=karcher),
    Method("nearswap", None, [_T], needs={"base"}, min_models=1, max_models=1, help="the base moved to the other model where they are near",
           granularity="element", tensorwise=nearswap),
    Method("multislerp", None, [_WEIGHT, _shared("normalize_weights", bool, True, "weights normalised to sum to 1"),
                                _shared("eps", float, 1e-8, "norm guard")],
           optional={"base"}, min_models=1, help="barycentric spherical interpolation", granularity="tensor", tensorwise=multislerp),
    Method("ram", None, [_shared("epsilon", float, 1e-5, "a change at most this is none")], needs={"base"}, min_models=0,
           help="Reinforced Agent Merging: unique changes kept, shared ones averaged", granularity="element", tensorwise=ram),
    Method("ramplus_tl", None, [_shared("r", float, 0.1, "rescaling strength"), _shared("alpha", float, 0.2, "rescaling cap"),
                                _shared("epsilon", float, 1e-5, "a change at most this is none")],
           needs={"base"}, min_models=0, help="RAM+ (tensor-local): unique changes rescaled by the overlap", granularity="tensor",
           tensorwise=ramplus_tl),
    Method("arcee_fusion", None, [], needs={"base"}, min_models=1, max_models=1, help="the base moved where the other's change is important",
           granularity="tensor", tensorwise=arcee_fusion),
    _gta("task_arithmetic", None, False, False, False, "the base plus the weighted task vectors"),
    _gta("ties", "magnitude", True, True, False, "TIES: trimmed by magnitude, sign consensus"),
    _gta("dare_ties", "random", True, False, True, "DARE's random drop, sign consensus"),
    _gta("dare_linear", "random", False, False, True, "DARE's random drop, summed"),
    _gta("breadcrumbs", "magnitude_outliers", False, False, False, "Model Breadcrumbs: outliers and small entries dropped"),
    _gta("breadcrumbs_ties", "magnitude_outliers", True, False, False, "Model Breadcrumbs, sign consensus"),
    _gta("della", "della_magprune", True, True, True, "DELLA: drop by magnitude rank, sign consensus"),
    _gta("della_linear", "della_magprune", False, False, True, "DELLA's drop, summed"),
):
    register(_method)
del _method

METHODS: Mapping[str, Method] = MERGEKIT  # every method of the mergekit vocabulary (a user's registered ones too)


def merge_tensor(method: Method, tensors: Sequence[np.ndarray], base_index: int | None, shared: Mapping, inputs: Sequence[Mapping],
                 rng: Callable[[int], np.random.Generator]) -> np.ndarray:
    """`method` on one tensor group: `tensors` (any float dtype, the same shape), the base among
    them at `base_index` (or None), parameters resolved for this tensor."""
    shape = np.shape(tensors[0])
    xs = [np.asarray(x, np.float32).reshape(shape or (1,)) for x in tensors]  # a 0-d tensor (Apertus' xIELU) as one entry
    base = None if base_index is None else xs[base_index]
    return np.asarray(method.tensorwise(xs, base, shared, inputs, rng)).reshape(shape)
