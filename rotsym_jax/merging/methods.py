"""Merge methods: pure functions from a list of params pytrees to a new, merged params pytree.

- `average`: uniform or weighted mean of the parameters.
- `fisher`: mean weighted entry by entry by each model's diagonal Fisher (Matena & Raffel 2022).
- `regmean`: each linear layer solves the merged least-squares regression of the models' layers
  from their input Gram matrices (Jin et al. 2023); every other leaf is averaged.
- `task_arithmetic`: the base plus the scaled sum of the task vectors (Ilharco et al. 2023).
- `ties`: task vectors trimmed, sign-elected and averaged where they agree (Yadav et al. 2023).
- `dare`: task vectors randomly dropped and rescaled, then task arithmetic or TIES (Yu et al. 2024).
- `slerp`: per tensor, spherical interpolation between two models.

`merge(name, models, ...)` runs any of them, and OT fusion ("ot_fusion"), by name: `METHODS` holds
each with its declared options (`Param`) and the inputs it needs.

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

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

import rotsym_jax as rj

from .. import checks
from ..errors import InputError
from ..options import OT_SOURCES, OT_TRANSPORTS
from ..pytree import Params, flatten, unflatten
from . import tensorwise  # noqa: F401  (mergekit's methods, registered as it loads: one registry holds both)
from .arithmetic import (
    average_leaves,
    dare_leaves,
    fisher_leaves,
    refuse_traced,
    regmean_leaves,
    slerp_leaves,
    task_arithmetic_leaves,
    ties_leaves,
    to_jax,
    warn_if_grown,
)
from .registry import (
    CHUNK_INPUTS,
    GRANULARITIES,
    INPUT_MEANINGS,
    INPUTS,
    METHODS,
    PARAM_TYPES,
    REQUIRED,
    STATISTICS,
    Method,
    Param,
    method_named,
    register,
)

# The registry's names are public here too (`merge.Method`, `merge.register`...): one registry, registry.py.
__all__ = ["CHUNK_INPUTS", "DARE_COMBINES", "GRANULARITIES", "INPUTS", "INPUT_MEANINGS", "METHODS", "Method", "PARAM_TYPES", "Param",
           "REQUIRED", "STATISTICS", "TASK_HEAD", "average", "dare", "fisher", "merge", "method_named", "register", "regmean", "slerp",
           "task_arithmetic", "ties"]
TASK_HEAD = checks.TASK_HEAD
# How `dare` combines the dropped-and-rescaled task vectors (its `then` option).
DARE_COMBINES = ("task_arithmetic", "ties")


# ---- public methods --------------------------------------------------------------------------------

def average(params_list: Sequence[Params], weights: Sequence[float] | None = None, *, task_head: str = "anchor") -> Params:
    """Weighted mean: theta* = sum_i w_i theta_i, the weights normalised to sum to 1 (uniform if
    None). The plain average of fine-tuned models ("model soups", Wortsman et al. 2022)."""
    checks.choice("task_head", task_head, TASK_HEAD)
    anchor, models = checks.mergeable(checks.model_list(params_list), task_head)
    w = checks.weights(weights, len(models))
    return _assemble(anchor, average_leaves(models, w))


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
    checks.choice("task_head", task_head, TASK_HEAD)
    eps = checks.scalar("eps", eps, low=0.0, low_open=True)
    named = checks.model_list(params_list)
    anchor, models = checks.mergeable(named, task_head)
    w = checks.weights(weights, len(models))
    refuse_traced("fisher", params_list)
    stats = _checked_stats(fishers, "fishers", params_list, "fisher", "fisher")
    values = []
    for i, (s, model) in enumerate(zip(stats, models)):
        flat = flatten(s.values)
        for path, leaf in model.items():
            if path not in flat:
                raise InputError(f"fishers[{i}] has no Fisher for leaf {path!r} of params_list[{i}]")
            if np.shape(flat[path]) != np.shape(leaf):
                raise InputError(
                    f"fishers[{i}] has shape {np.shape(flat[path])} at {path!r}, but the leaf of "
                    f"params_list[{i}] has shape {np.shape(leaf)}: expected the same shape"
                )
        values.append({path: flat[path] for path in model})
    return _assemble(anchor, fisher_leaves(models, values, w, eps))


def check_regmean_kernel(path: str, kernel: tuple, gram: tuple, i: int) -> None:
    """InputError unless `path` is a linear kernel (d_in, d_out) with a Gram (d_in, d_in) of model
    i's inputs: what RegMean's regression solves (a stacked experts' kernel is not: its Gram would
    pool every token, not those routed to each expert). In memory and streamed alike."""
    if len(kernel) != 2:
        raise InputError(f"regmean merges linear kernels (d_in, d_out): leaf {path!r} has shape {kernel}")
    if gram != (kernel[0], kernel[0]):
        raise InputError(f"grams[{i}] has shape {gram} at {path!r}; the kernel has shape {kernel}, so expected (d_in, d_in) = "
                         f"{(kernel[0], kernel[0])}")


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
    checks.choice("task_head", task_head, TASK_HEAD)
    alpha = checks.scalar("alpha", alpha, low=0.0, high=1.0, low_open=True)
    jitter = checks.scalar("jitter", jitter, low=0.0)
    named = checks.model_list(params_list)
    anchor, models = checks.mergeable(named, task_head)
    refuse_traced("regmean", params_list)
    stats = _checked_stats(grams, "grams", params_list, "gram", "regmean")
    flats = [flatten(s.values) for s in stats]
    for i, flat in enumerate(flats[1:], 1):
        if flat.keys() != flats[0].keys():
            missing, extra = sorted(flats[0].keys() - flat.keys()), sorted(flat.keys() - flats[0].keys())
            raise InputError(
                f"grams[{i}] covers other kernels than grams[0]: missing {checks.some(missing)}, extra {checks.some(extra)}; "
                "every model needs Gram matrices for the same kernels"
            )
    # The head's Grams are moot when the head is copied from the anchor.
    paths = [p for p in flats[0] if task_head == "merge" or not checks.is_head(p)]
    for i, (flat, model) in enumerate(zip(flats, models)):
        for path in paths:
            if path not in model:
                raise InputError(f"grams[{i}] has a Gram matrix for {path!r}, which is not a leaf of params_list[{i}]")
            check_regmean_kernel(path, np.shape(model[path]), np.shape(flat[path]), i)
    values = [{p: flat[p] for p in paths} for flat in flats]
    merged, grown = regmean_leaves(models, values, alpha, jitter)
    warn_if_grown(grown)
    return _assemble(anchor, merged)


def task_arithmetic(base: Params, params_list: Sequence[Params], *, lam: float = 1.0, task_head: str = "anchor") -> Params:
    """Task arithmetic (Ilharco et al. 2023): theta* = base + lam sum_i (theta_i - base)."""
    checks.choice("task_head", task_head, TASK_HEAD)
    lam = checks.scalar("lam", lam)
    anchor, base_flat, models = _prepare_with_base(base, params_list, task_head)
    return _assemble(anchor, task_arithmetic_leaves(base_flat, models, lam))


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
    a mixture's stacked experts: of each expert's tensor, as the checkpoint stores them;
    ties in magnitude go to the earlier entry), elect gamma = sign(sum_i trimmed tau_i), disjoint
    mean (per entry, the mean of the nonzero trimmed tau_i of sign gamma, 0 where there is none);
    theta* = base + lam * merged tau."""
    checks.choice("task_head", task_head, TASK_HEAD)
    density = checks.scalar("density", density, low=0.0, high=1.0, low_open=True)
    lam = checks.scalar("lam", lam)
    refuse_traced("ties", base, params_list)
    anchor, base_flat, models = _prepare_with_base(base, params_list, task_head)
    return _assemble(anchor, ties_leaves(base_flat, models, lam, density=density))


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
    checks.choice("task_head", task_head, TASK_HEAD)
    checks.choice("then", then, DARE_COMBINES)
    drop = checks.scalar("drop", drop, low=0.0, high=1.0, high_open=True)
    lam = checks.scalar("lam", lam)
    density = checks.scalar("density", density, low=0.0, high=1.0, low_open=True)
    key = checks.prng_key(key)
    if then == "ties":
        refuse_traced("dare", base, params_list, key)
    anchor, base_flat, models = _prepare_with_base(base, params_list, task_head)
    return _assemble(anchor, dare_leaves(base_flat, models, key, drop, lam, then=then, density=density))


def slerp(params_a: Params, params_b: Params, t: float = 0.5, *, eps: float = 1e-6, task_head: str = "anchor") -> Params:
    """Per-tensor spherical linear interpolation (Shoemake 1985, as used for model merging; a
    mixture's stacked experts: per expert, as the checkpoint stores them):
    with Omega the angle between the flattened tensors a and b,
    theta* = sin((1 - t) Omega) / sin Omega * a + sin(t Omega) / sin Omega * b,
    and the linear interpolation (1 - t) a + t b where sin Omega < eps (near-parallel or
    anti-parallel) or a or b is zero. Omega is computed as 2 atan2(|a^ - b^|, |a^ + b^|) on the unit
    vectors: the same angle as arccos(<a, b> / (|a| |b|)), but accurate near 0 and pi, where the
    arccos of a rounded cosine is not. The anchor is params_a (t = 0 gives it, t = 1 gives b)."""
    checks.choice("task_head", task_head, TASK_HEAD)
    t = checks.scalar("t", t, low=0.0, high=1.0)
    eps = checks.scalar("eps", eps, low=0.0, low_open=True)
    anchor, models = checks.mergeable([("params_a", params_a), ("params_b", params_b)], task_head)
    return _assemble(anchor, slerp_leaves(models[0], models[1], t, eps))


# ---- registry --------------------------------------------------------------------------------------
# Every method by name with its declared parameters, for callers that choose a method at run time (the
# command line, recipes): one registry (`registry.py`) for these and mergekit's (`tensorwise.py`). The
# functions above are the jax implementations; `merge` only validates the call and hands it on.

def merge(method: str, models: Sequence[Params], *, task_head: str = "anchor", **keywords) -> Params:
    """Merge `models` (the first is the anchor) with the registered method `method`. `keywords`:
    the method's inputs (`INPUTS`: base, fishers, grams, key, spec, checkpoint, batches,
    weights; None is not given) and its options (the declared defaults otherwise). Checks the
    method name, the options (names, types, ranges), the model count and that the method's inputs
    are given and no others, then calls the method: the result is exactly that of calling its
    function."""
    m = method_named(method)
    checks.choice("task_head", task_head, TASK_HEAD)
    given = {k: v for k, v in keywords.items() if k in INPUTS and v is not None}
    params = {k: v for k, v in keywords.items() if k not in INPUTS}
    checks.model_list(models)
    options = m.bind(len(models), params, given)
    return m.jax(params_list=models, **given, **options, task_head=task_head)


def _slerp_list(params_list, **options):
    return slerp(*params_list, **options)


_LAM = Param("lam", float, 1.0, "scale of the merged task vector")
_DENSITY_RANGE = dict(low=0.0, high=1.0, low_open=True)

for _method in (
    Method("average", average, {}, optional=frozenset({"weights"}), help="weighted mean of the parameters", granularity="element"),
    Method(
        "fisher",
        fisher,
        {"eps": Param("eps", float, 1e-8, "added to every Fisher entry", low=0.0, low_open=True)},
        needs=frozenset({"fishers"}),
        optional=frozenset({"weights"}),
        help="mean weighted entry by entry by diagonal Fishers (Matena & Raffel 2022)",
        granularity="element",
    ),
    Method(
        "regmean",
        regmean,
        {
            "alpha": Param("alpha", float, 1.0, "weight of the Grams' off-diagonal", low=0.0, high=1.0, low_open=True),
            "jitter": Param("jitter", float, 0.0, "ridge, relative to the mean diagonal", low=0.0),
        },
        needs=frozenset({"grams"}),
        help="least-squares merge of linear layers from input Grams (Jin et al. 2023)",
        granularity="tensor",
    ),
    Method("task_arithmetic", task_arithmetic, {"lam": _LAM}, needs=frozenset({"base"}), help="base + lam * sum of task vectors (Ilharco et al. 2023)",
           granularity="element"),
    Method(
        "ties",
        ties,
        {"density": Param("density", float, 0.2, "fraction of each task vector kept", **_DENSITY_RANGE), "lam": _LAM},
        needs=frozenset({"base"}),
        help="trimmed, sign-elected task vectors (Yadav et al. 2023)",
        granularity="tensor",
    ),
    Method(
        "dare",
        dare,
        {
            "drop": Param("drop", float, 0.9, "probability of dropping a task-vector entry", low=0.0, high=1.0, high_open=True),
            "then": Param("then", str, "task_arithmetic", "how the rescaled task vectors are combined", choices=DARE_COMBINES),
            "lam": _LAM,
            "density": Param("density", float, 1.0, "TIES density (then='ties')", **_DENSITY_RANGE),
        },
        needs=frozenset({"base", "key"}),
        help="randomly dropped and rescaled task vectors (Yu et al. 2024)",
        granularity="tensor",  # each tensor's masks are drawn from the key salted by its path
    ),
    Method(
        "slerp",
        _slerp_list,
        {
            "t": Param("t", float, 0.5, "interpolation: 0 gives the first model, 1 the second", low=0.0, high=1.0),
            "eps": Param("eps", float, 1e-6, "below this sin(angle), interpolate linearly", low=0.0, low_open=True),
        },
        max_models=2,
        help="per-tensor spherical interpolation of two models",
        granularity="tensor",
    ),
    Method(
        "ot_fusion",
        lambda params_list, **options: rj.otfusion.ot_fuse(params_list, **options).params,  # SciPy and POT load when it runs
        {
            "source": Param("source", str, "weights", "unit costs from weights or activations", choices=OT_SOURCES),
            "transport": Param("transport", str, "hard", "exact OT (a permutation) or entropic OT", choices=OT_TRANSPORTS),
            "sinkhorn_reg": Param("sinkhorn_reg", float, 0.05, "entropic regularisation, relative to the cost's median", low=0.0, low_open=True),
        },
        needs=frozenset({"spec"}),
        optional=frozenset({"checkpoint", "batches", "weights"}),
        help="units transported onto the anchor's by optimal transport, then averaged (Imfeld et al. 2024)",
    ),
):
    register(_method)
del _method


# ---- validation ------------------------------------------------------------------------------------

def _prepare_with_base(base, params_list, task_head):
    """Base methods: the anchor is params_list[0]; the base must have the same merged leaves (it
    needs no head when the head is copied from the anchor)."""
    anchor, models = checks.mergeable([*checks.model_list(params_list), ("base", base)], task_head)
    return anchor, models[-1], models[:-1]


def _checked_stats(stats, name, params_list, kind, method):
    if isinstance(stats, Mapping) or not isinstance(stats, Sequence) or len(stats) != len(params_list):
        n = len(stats) if isinstance(stats, Sequence) else type(stats).__name__
        raise InputError(f"{name} must be a list of {kind} statistics, one per model: got {n} for {len(params_list)} models")
    for i, s in enumerate(stats):
        got = getattr(s, "kind", type(s).__name__)
        if got != kind:
            raise InputError(f"{name}[{i}] has kind {got!r}; {method} needs statistics of kind {kind!r}")
        s.check(params_list[i], f"params_list[{i}]")  # StatsError: computed on other params
    return stats


def _assemble(anchor, merged):
    # Leaves not merged (the anchor's head) are the anchor's, as (immutable) jax arrays.
    return unflatten({p: merged[p] if p in merged else to_jax(x) for p, x in anchor.items()})
