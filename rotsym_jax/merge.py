"""Merge methods: pure functions from a list of params pytrees to a new, merged params pytree.

- `average`: uniform or weighted mean of the parameters.
- `fisher`: mean weighted entry by entry by each model's diagonal Fisher (Matena & Raffel 2022).
- `regmean`: each linear layer solves the merged least-squares regression of the models' layers
  from their input Gram matrices (Jin et al. 2023); every other leaf is averaged.
- `task_arithmetic`: the base plus the scaled sum of the task vectors (Ilharco et al. 2023).
- `ties`: task vectors trimmed, sign-elected and averaged where they agree (Yadav et al. 2023).
- `dare`: task vectors randomly dropped and rescaled, then task arithmetic or TIES (Yu et al. 2024).
- `slerp`: per tensor, spherical interpolation between two models.

Conventions shared by every method. The anchor is the first model (`params_list[0]`, or
`params_a` for slerp): the result has its leaves, each in its dtype; the arithmetic runs in
float32. Inputs are never modified. Every input is validated before any work (same leaves, same
shapes, sane options), and errors name the leaf path, the model and the shapes. The task head
(every leaf under the top-level key "head") is copied from the anchor by default
(task_head="anchor", the papers' setting: the models' label spaces usually differ), or merged
like every other leaf (task_head="merge").

Statistics (Fisher, Gram) belong to the exact params they were computed on: merging aligned
models with statistics of the unaligned ones is rejected (`stats.StatsError`).
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .precision import exact_jit
from .pytree import Params, flatten, unflatten


TASK_HEAD = ("anchor", "merge")
THEN = ("task_arithmetic", "ties")


# ---- public methods --------------------------------------------------------------------------------

def average(params_list: Sequence[Params], weights: Sequence[float] | None = None, *, task_head: str = "anchor") -> Params:
    """Weighted mean: theta* = sum_i w_i theta_i, the weights normalised to sum to 1 (uniform if
    None). The plain average of fine-tuned models ("model soups", Wortsman et al. 2022)."""
    _check_choice("task_head", task_head, TASK_HEAD)
    anchor, models = _prepare(_named_list(params_list), task_head)
    w = _normalised_weights(weights, len(models))
    return _assemble(anchor, _average_leaves(models, w))


def fisher(
    params_list: Sequence[Params],
    fishers: Sequence[Any],
    weights: Sequence[float] | None = None,
    *,
    eps: float = 1e-8,
    task_head: str = "anchor",
) -> Params:
    """Fisher merging (Matena & Raffel 2022): per entry
    theta* = sum_i w_i (F_i + eps) theta_i / sum_i w_i (F_i + eps),
    F_i the diagonal Fisher of model i (a `Stats` of kind "fisher" computed on params_list[i]).
    An entry no model is informed about (every F_i = 0) gets the weighted mean, thanks to eps > 0."""
    _check_choice("task_head", task_head, TASK_HEAD)
    eps = _check_scalar("eps", eps, low=0.0, low_open=True)
    named = _named_list(params_list)
    anchor, models = _prepare(named, task_head)
    w = _normalised_weights(weights, len(models))
    stats = _checked_stats(fishers, "fishers", params_list, "fisher", "fisher")
    values = []
    for i, (s, model) in enumerate(zip(stats, models)):
        flat = flatten(s.values)
        for path, leaf in model.items():
            if path not in flat:
                raise ValueError(f"fishers[{i}] has no Fisher for leaf {path!r} of params_list[{i}]")
            if np.shape(flat[path]) != np.shape(leaf):
                raise ValueError(
                    f"fishers[{i}] has shape {np.shape(flat[path])} at {path!r}, but the leaf of "
                    f"params_list[{i}] has shape {np.shape(leaf)}: expected the same shape"
                )
        values.append({path: flat[path] for path in model})
    return _assemble(anchor, _fisher_leaves(models, values, w, eps))


def regmean(
    params_list: Sequence[Params],
    grams: Sequence[Any],
    *,
    alpha: float = 1.0,
    jitter: float = 0.0,
    task_head: str = "anchor",
) -> Params:
    """RegMean (Jin et al. 2023). For each linear kernel W_i (d_in, d_out) with input Gram matrices
    G_i = X_i^T X_i (`Stats` of kind "gram", {kernel path: (d_in, d_in)}):
    G_i' = alpha G_i + (1 - alpha) diag(G_i), S = sum_i G_i' + jitter mean(diag S) I,
    W* = S^-1 sum_i G_i' W_i: with alpha = 1 and jitter = 0, the least-squares solution of the
    stacked regressions X_i W = X_i W_i. alpha < 1 shrinks the off-diagonal (the paper's fix for
    ill-conditioned Grams); jitter adds a relative ridge. Every other leaf is the uniform mean."""
    _check_choice("task_head", task_head, TASK_HEAD)
    alpha = _check_scalar("alpha", alpha, low=0.0, high=1.0, low_open=True)
    jitter = _check_scalar("jitter", jitter, low=0.0)
    named = _named_list(params_list)
    anchor, models = _prepare(named, task_head)
    stats = _checked_stats(grams, "grams", params_list, "gram", "regmean")
    flats = [flatten(s.values) for s in stats]
    for i, flat in enumerate(flats[1:], 1):
        if flat.keys() != flats[0].keys():
            missing, extra = sorted(flats[0].keys() - flat.keys()), sorted(flat.keys() - flats[0].keys())
            raise ValueError(
                f"grams[{i}] covers other kernels than grams[0]: missing {_some(missing)}, extra {_some(extra)}; "
                "every model needs Gram matrices for the same kernels"
            )
    # The head's Grams are moot when the head is copied from the anchor.
    paths = [p for p in flats[0] if task_head == "merge" or not _is_head(p)]
    for i, (flat, model) in enumerate(zip(flats, models)):
        for path in paths:
            if path not in model:
                raise ValueError(f"grams[{i}] has a Gram matrix for {path!r}, which is not a leaf of params_list[{i}]")
            kernel, gram = np.shape(model[path]), np.shape(flat[path])
            if len(kernel) != 2:
                raise ValueError(f"regmean merges linear kernels (d_in, d_out): leaf {path!r} has shape {kernel}")
            if gram != (kernel[0], kernel[0]):
                raise ValueError(
                    f"grams[{i}] has shape {gram} at {path!r}; the kernel has shape {kernel}, "
                    f"so expected (d_in, d_in) = {(kernel[0], kernel[0])}"
                )
    values = [{p: flat[p] for p in paths} for flat in flats]
    return _assemble(anchor, _regmean_leaves(models, values, alpha, jitter))


def task_arithmetic(base: Params, params_list: Sequence[Params], *, lam: float = 1.0, task_head: str = "anchor") -> Params:
    """Task arithmetic (Ilharco et al. 2023): theta* = base + lam sum_i (theta_i - base)."""
    _check_choice("task_head", task_head, TASK_HEAD)
    lam = _check_scalar("lam", lam)
    anchor, base_flat, models = _prepare_with_base(base, params_list, task_head)
    return _assemble(anchor, _task_arithmetic_leaves(base_flat, models, lam))


def ties(
    base: Params,
    params_list: Sequence[Params],
    *,
    density: float = 0.2,
    lam: float = 1.0,
    task_head: str = "anchor",
) -> Params:
    """TIES-merging (Yadav et al. 2023) of the task vectors tau_i = theta_i - base, per tensor:
    trim (keep the ceil(density * size) entries of largest magnitude of each tau_i, at least one;
    ties in magnitude go to the earlier entry), elect gamma = sign(sum_i trimmed tau_i), disjoint
    mean (per entry, the mean of the nonzero trimmed tau_i of sign gamma, 0 where there is none);
    theta* = base + lam * merged tau."""
    _check_choice("task_head", task_head, TASK_HEAD)
    density = _check_scalar("density", density, low=0.0, high=1.0, low_open=True)
    lam = _check_scalar("lam", lam)
    anchor, base_flat, models = _prepare_with_base(base, params_list, task_head)
    return _assemble(anchor, _ties_leaves(base_flat, models, lam, density=density))


def dare(
    base: Params,
    params_list: Sequence[Params],
    key: jax.Array,
    *,
    drop: float = 0.9,
    then: str = "task_arithmetic",
    lam: float = 1.0,
    density: float = 1.0,
    task_head: str = "anchor",
) -> Params:
    """DARE (Yu et al. 2024): each entry of each task vector tau_i = theta_i - base is dropped with
    probability `drop` and the survivors are rescaled by 1 / (1 - drop), which keeps the expected
    task vector; the results are combined by `task_arithmetic` (then="task_arithmetic", lam) or
    `ties` (then="ties", density, lam). Reproducible from the explicit key: the masks of leaf `path`
    are one Bernoulli draw of shape (n_models, *leaf shape) from fold_in(key, crc32(path)), row i
    for model i, so they do not depend on which other leaves exist."""
    _check_choice("task_head", task_head, TASK_HEAD)
    _check_choice("then", then, THEN)
    drop = _check_scalar("drop", drop, low=0.0, high=1.0, high_open=True)
    lam = _check_scalar("lam", lam)
    density = _check_scalar("density", density, low=0.0, high=1.0, low_open=True)
    key = _check_key(key)
    anchor, base_flat, models = _prepare_with_base(base, params_list, task_head)
    return _assemble(anchor, _dare_leaves(base_flat, models, key, drop, lam, then=then, density=density))


def slerp(params_a: Params, params_b: Params, t: float = 0.5, *, eps: float = 1e-6, task_head: str = "anchor") -> Params:
    """Per-tensor spherical linear interpolation (Shoemake 1985, as used for model merging):
    with Omega the angle between the flattened tensors a and b,
    theta* = sin((1 - t) Omega) / sin Omega * a + sin(t Omega) / sin Omega * b,
    and the linear interpolation (1 - t) a + t b where sin Omega < eps (near-parallel or
    anti-parallel) or a or b is zero. Omega is computed as 2 atan2(|a^ - b^|, |a^ + b^|) on the unit
    vectors: the same angle as arccos(<a, b> / (|a| |b|)), but accurate near 0 and pi, where the
    arccos of a rounded cosine is not. The anchor is params_a (t = 0 gives it, t = 1 gives b)."""
    _check_choice("task_head", task_head, TASK_HEAD)
    t = _check_scalar("t", t, low=0.0, high=1.0)
    eps = _check_scalar("eps", eps, low=0.0, low_open=True)
    anchor, models = _prepare([("params_a", params_a), ("params_b", params_b)], task_head)
    return _assemble(anchor, _slerp_leaves(models[0], models[1], t, eps))


# ---- validation ------------------------------------------------------------------------------------

def _check_choice(name, value, choices):
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r}; choose one of {choices}")


# The kernels compute in float32: a larger option is inf there.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _check_scalar(name, value, *, low=None, high=None, low_open=False, high_open=False) -> float:
    """A real in the given interval, finite in float32, as a float; else ValueError naming the option."""
    lo = "(-inf" if low is None else ("(" if low_open else "[") + f"{low:g}"
    hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
    allowed = f"{name} must be a finite number in {lo}, {hi} (and finite in float32, |{name}| <= {_FLOAT32_MAX:.4g})"
    if isinstance(value, bool) or np.ndim(value) != 0:
        raise ValueError(f"{name}={value!r}; {allowed}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}; {allowed}") from None
    ok = abs(x) <= _FLOAT32_MAX  # False for inf and nan too
    if ok and low is not None:
        ok = x > low if low_open else x >= low
    if ok and high is not None:
        ok = x < high if high_open else x <= high
    if not ok:
        raise ValueError(f"{name}={value!r}; {allowed}")
    return x


def _check_key(key):
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ()
    raw = dtype == np.uint32 and shape == (2,)  # a legacy jax.random.PRNGKey
    if not (typed or raw):
        raise ValueError(f"key={key!r}; expected one jax.random key, e.g. jax.random.key(0)")
    return key


def _normalised_weights(weights, n):
    if weights is None:
        return np.full(n, 1.0 / n, np.float32)
    try:
        w = np.asarray(weights, np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"weights={weights!r}; expected one number per model") from None
    if w.shape != (n,):
        raise ValueError(f"weights has shape {np.shape(weights)}; expected one weight per model, ({n},)")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or not np.any(w > 0):
        raise ValueError(f"weights={w.tolist()}; weights must be finite, >= 0, with a positive sum")
    # Scaled by the largest first: the sum of huge weights (1e308 + 1e308) overflows to inf.
    w = w / w.max()
    return (w / w.sum()).astype(np.float32)


def _named_list(params_list, least=2):
    if isinstance(params_list, Mapping) or not isinstance(params_list, Sequence):
        raise ValueError(f"params_list must be a list of params pytrees, got {type(params_list).__name__}")
    if len(params_list) < least:
        raise ValueError(f"params_list has {len(params_list)} model(s); merging needs at least {least}")
    return [(f"params_list[{i}]", p) for i, p in enumerate(params_list)]


def _is_head(path: str) -> bool:
    return path == "head" or path.startswith("head/")


def _some(paths, n=5):
    return f"{paths[:n]}" + (f" (+{len(paths) - n} more)" if len(paths) > n else "")


def _prepare(named, task_head, anchor=0):
    """Check that every model has the anchor's merged leaves, with the same shapes.

    Returns the anchor's full flat params and, per model, {path: leaf} of the leaves to merge
    (everything, or everything but the head when task_head="anchor")."""
    for name, params in named:
        if not isinstance(params, Mapping):
            raise ValueError(f"{name} must be a params pytree (a nested dict), got {type(params).__name__}")
    flats = [flatten(params) for _, params in named]
    ref_name, ref = named[anchor][0], flats[anchor]
    merged = [p for p in ref if task_head == "merge" or not _is_head(p)]
    wanted = set(merged)
    for (name, _), flat in zip(named, flats):
        have = {p for p in flat if task_head == "merge" or not _is_head(p)}
        if have != wanted:
            missing, extra = sorted(wanted - have), sorted(have - wanted)
            hint = ""
            if any(_is_head(p) for p in missing + extra):
                hint = '; the task heads differ: task_head="anchor" keeps the anchor\'s head'
            raise ValueError(
                f"{name} does not have the leaves of {ref_name} (the anchor): missing {_some(missing)}, "
                f"extra {_some(extra)}{hint}"
            )
        for path in merged:
            shape, ref_shape = np.shape(flat[path]), np.shape(ref[path])
            if shape != ref_shape:
                hint = ""
                if _is_head(path):
                    hint = (
                        " (task heads of different label spaces cannot be merged: "
                        'task_head="anchor" keeps the anchor\'s head)'
                    )
                raise ValueError(f"leaf {path!r} has shape {shape} in {name} but {ref_shape} in {ref_name} (the anchor){hint}")
    return ref, [{p: flat[p] for p in merged} for flat in flats]


def _prepare_with_base(base, params_list, task_head):
    """Base methods: the anchor is params_list[0]; the base must have the same merged leaves (it
    needs no head when the head is copied from the anchor)."""
    named = _named_list(params_list)
    anchor, models = _prepare([*named, ("base", base)], task_head)
    return anchor, models[-1], models[:-1]


def _checked_stats(stats, name, params_list, kind, method):
    if isinstance(stats, Mapping) or not isinstance(stats, Sequence) or len(stats) != len(params_list):
        n = len(stats) if isinstance(stats, Sequence) else type(stats).__name__
        raise ValueError(f"{name} must be a list of {kind} statistics, one per model: got {n} for {len(params_list)} models")
    for i, s in enumerate(stats):
        got = getattr(s, "kind", type(s).__name__)
        if got != kind:
            raise ValueError(f"{name}[{i}] has kind {got!r}; {method} needs statistics of kind {kind!r}")
        s.check(params_list[i], f"params_list[{i}]")  # StatsError: computed on other params
    return stats


def _assemble(anchor, merged):
    # Leaves not merged (the anchor's head) are the anchor's, as (immutable) jax arrays.
    return unflatten({p: merged[p] if p in merged else jnp.asarray(x) for p, x in anchor.items()})


# ---- per-leaf arithmetic ---------------------------------------------------------------------------
# One jitted kernel per method and leaf, called leaf by leaf: XLA caches it by shapes and dtypes,
# and a transformer repeats a handful of shapes across its layers. (One jitted call over the whole
# tree compiles every leaf separately: measured on a 12-layer toy, 35 s to compile DARE, 10 s TIES.)
# Kernels compute in float32 and return the anchor's dtype (the anchor's leaf is always xs[0]).

def _f32(x):
    return jnp.asarray(x, jnp.float32)


def _like(x, ref):
    return x.astype(ref.dtype)


def _per_leaf(models, kernel, *args, **static):
    """{path: kernel((leaf of each model), *per-leaf args, **static)} for each merged path."""
    return {path: kernel(tuple(m[path] for m in models), *args, **static) for path in models[0]}


@exact_jit
def _average_leaf(xs, weights):
    acc = 0.0
    for i, x in enumerate(xs):
        acc = acc + weights[i] * _f32(x)
    return _like(acc, xs[0])


def _average_leaves(models, weights):
    return _per_leaf(models, _average_leaf, weights)


@exact_jit
def _fisher_leaf(xs, fs, weights, eps):
    num, den = 0.0, 0.0
    for i, (x, f) in enumerate(zip(xs, fs)):
        f = weights[i] * (_f32(f) + eps)
        num, den = num + f * _f32(x), den + f
    return _like(num / den, xs[0])


def _fisher_leaves(models, fishers, weights, eps):
    return {p: _fisher_leaf(tuple(m[p] for m in models), tuple(f[p] for f in fishers), weights, eps) for p in models[0]}


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
    return _like(jnp.linalg.solve(s, rhs), xs[0])


def _regmean_leaves(models, grams, alpha, jitter):
    uniform = np.full(len(models), 1.0 / len(models), np.float32)
    out = {}
    for path in models[0]:
        xs = tuple(m[path] for m in models)
        if path in grams[0]:
            out[path] = _regmean_leaf(xs, tuple(g[path] for g in grams), alpha, jitter)
        else:
            out[path] = _average_leaf(xs, uniform)
    return out


@exact_jit
def _task_arithmetic_leaf(xs, base, lam):
    b = _f32(base)
    tau = sum(_f32(x) - b for x in xs)
    return _like(b + lam * tau, xs[0])


def _task_arithmetic_leaves(base, models, lam):
    return {p: _task_arithmetic_leaf(tuple(m[p] for m in models), base[p], lam) for p in models[0]}


def _keep_count(density, size):
    # Rounded first: 0.7 * 10 is 7.000000000000001 in floating point, and should keep 7.
    return max(1, math.ceil(round(density * size, 9)))


def _trim(tau, density):
    """Zero all but the ceil(density * size) entries of largest magnitude (exactly that many)."""
    k = _keep_count(density, tau.size)
    if k >= tau.size:
        return tau
    flat = tau.ravel()
    _, idx = jax.lax.top_k(jnp.abs(flat), k)  # equal magnitudes: the lower index first
    keep = jnp.zeros(flat.shape, bool).at[idx].set(True)
    return jnp.where(keep, flat, 0.0).reshape(tau.shape)


def _ties_combine(taus, density):
    trimmed = [_trim(tau, density) for tau in taus]
    gamma = jnp.sign(sum(trimmed))
    total, count = 0.0, 0
    for tau in trimmed:
        agree = (jnp.sign(tau) == gamma) & (tau != 0)
        total = total + jnp.where(agree, tau, 0.0)
        count = count + agree.astype(jnp.int32)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)


@functools.partial(exact_jit, static_argnames="density")
def _ties_leaf(xs, base, lam, *, density):
    b = _f32(base)
    merged = _ties_combine([_f32(x) - b for x in xs], density)
    return _like(b + lam * merged, xs[0])


def _ties_leaves(base, models, lam, *, density):
    return {p: _ties_leaf(tuple(m[p] for m in models), base[p], lam, density=density) for p in models[0]}


def _path_salt(path):
    return np.uint32(zlib.crc32(path.encode()))


@functools.partial(exact_jit, static_argnames=("then", "density"))
def _dare_leaf(xs, base, key, salt, drop, lam, *, then, density):
    keep = 1.0 - drop
    b = _f32(base)
    # Every model's mask in one draw (row i: model i): one random-bits computation per leaf.
    survive = jax.random.bernoulli(jax.random.fold_in(key, salt), keep, (len(xs),) + jnp.shape(b))
    taus = [jnp.where(survive[i], (_f32(x) - b) / keep, 0.0) for i, x in enumerate(xs)]
    merged = sum(taus) if then == "task_arithmetic" else _ties_combine(taus, density)
    return _like(b + lam * merged, xs[0])


def _dare_leaves(base, models, key, drop, lam, *, then, density):
    return {
        p: _dare_leaf(tuple(m[p] for m in models), base[p], key, _path_salt(p), drop, lam, then=then, density=density)
        for p in models[0]
    }


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
    return _like((ca * a + cb * b).reshape(jnp.shape(x_a)), x_a)


def _slerp_leaves(leaves_a, leaves_b, t, eps):
    return _per_leaf([leaves_a, leaves_b], _slerp_leaf, t, eps)
