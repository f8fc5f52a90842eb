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

import dataclasses
import functools
import math
import types
import warnings
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import rotsym_jax as rj

from .. import checks
from ..errors import InputError
from ..options import OT_SOURCES, OT_TRANSPORTS
from ..precision import exact_jit, is_traced
from ..pytree import Params, flatten, unflatten

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
            kernel, gram = np.shape(model[path]), np.shape(flat[path])
            if len(kernel) != 2:
                raise InputError(f"regmean merges linear kernels (d_in, d_out): leaf {path!r} has shape {kernel}")
            if gram != (kernel[0], kernel[0]):
                raise InputError(
                    f"grams[{i}] has shape {gram} at {path!r}; the kernel has shape {kernel}, "
                    f"so expected (d_in, d_in) = {(kernel[0], kernel[0])}"
                )
    values = [{p: flat[p] for p in paths} for flat in flats]
    merged, grown = regmean_leaves(models, values, alpha, jitter)
    warn_if_grown(grown)
    return _assemble(anchor, merged)


def task_arithmetic(base: Params, params_list: Sequence[Params], *, lam: float = 1.0, task_head: str = "anchor") -> Params:
    """Task arithmetic (Ilharco et al. 2023): theta* = base + lam sum_i (theta_i - base)."""
    checks.choice("task_head", task_head, TASK_HEAD)
    lam = checks.scalar("lam", lam)
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
    a mixture's stacked experts: of each expert's tensor, as the checkpoint stores them;
    ties in magnitude go to the earlier entry), elect gamma = sign(sum_i trimmed tau_i), disjoint
    mean (per entry, the mean of the nonzero trimmed tau_i of sign gamma, 0 where there is none);
    theta* = base + lam * merged tau."""
    checks.choice("task_head", task_head, TASK_HEAD)
    density = checks.scalar("density", density, low=0.0, high=1.0, low_open=True)
    lam = checks.scalar("lam", lam)
    refuse_traced("ties", base, params_list)
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
    checks.choice("task_head", task_head, TASK_HEAD)
    checks.choice("then", then, DARE_COMBINES)
    drop = checks.scalar("drop", drop, low=0.0, high=1.0, high_open=True)
    lam = checks.scalar("lam", lam)
    density = checks.scalar("density", density, low=0.0, high=1.0, low_open=True)
    key = checks.prng_key(key)
    if then == "ties":
        refuse_traced("dare", base, params_list, key)
    anchor, base_flat, models = _prepare_with_base(base, params_list, task_head)
    return _assemble(anchor, _dare_leaves(base_flat, models, key, drop, lam, then=then, density=density))


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
    return _assemble(anchor, _slerp_leaves(models[0], models[1], t, eps))


# ---- registry --------------------------------------------------------------------------------------
# Every method by name with its declared options, for callers that choose a method at run time (the
# command line, recipes). The functions above are the implementations; `merge` only validates the
# call and hands it on.

PARAM_TYPES = (float, int, str)
# The inputs a method may take besides the models (`Method.needs` and `Method.optional`).
INPUTS = ("base", "fishers", "grams", "key", "spec", "checkpoint", "batches", "weights")
INPUT_MEANINGS = {"base": "a base model: the model the others were fine-tuned from",
                  "fishers": "fishers: statistics from data, each model's Fisher (stats.fisher)",
                  "grams": "grams: statistics from data, each model's Gram matrices (stats.grams)"}


@dataclasses.dataclass(frozen=True)
class Param:
    """A declared option of a merge method: its type (float, int or str), default, allowed interval
    (numbers: `low`/`high`, open or closed) or `choices` (strings), and a one-line help."""

    name: str
    type: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()

    def check(self, value):
        """`value` checked against the declaration (ValueError naming the option): a float for a
        float option, the int or str itself otherwise."""
        if self.type is str:
            return checks.choice(self.name, value, self.choices)
        if self.type is int and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise InputError(f"{self.name}={value!r}; {self.name} must be an int")
        x = checks.scalar(self.name, value, low=self.low, high=self.high, low_open=self.low_open, high_open=self.high_open)
        return int(value) if self.type is int else x

    def parse(self, text: str):
        """The option from its text (a command line's `--param name=value`), checked."""
        if self.type is str:
            return self.check(text)
        try:
            value = self.type(text)
        except ValueError:
            raise InputError(f"{self.name}={text!r}; expected {'an int' if self.type is int else 'a number'}") from None
        return self.check(value)


# How a method's result on a leaf depends on its inputs, which says what a streamed run may hand it:
# "element": entry by entry (a row block of a tensor merges on its own); "tensor": each tensor on
# its own, across the models (a chunk of layers merges as the whole model would: TIES' trim and
# SLERP's angle read the whole tensor); "model": the models whole (OT fusion couples the layers).
GRANULARITIES = ("element", "tensor", "model")
# The inputs a run that holds a chunk of layers at a time gives a method; statistics ("fishers",
# "grams") only to the built-in methods whose statistics pass `streaming` runs (STATISTICS).
CHUNK_INPUTS = frozenset({"base", "key", "weights"})
STATISTICS = {"fisher": "fishers", "regmean": "grams"}


@dataclasses.dataclass(frozen=True)
class Method:
    """A merge method by name. `fn(params_list=models, **inputs, **params, task_head=...)` returns
    the merged params; `params` declares its options, `needs` the inputs it requires and
    `optional` those it may take (both among `INPUTS`); `max_models`: None for any number >= 2;
    `granularity` (GRANULARITIES) what its result on a leaf reads: a method that declares
    "element" or "tensor" and needs no input but CHUNK_INPUTS is merged a chunk of layers at a
    time by the streamed runs (`merge_to_disk`, `--max-memory`); "model", the default, holds the
    models whole."""

    name: str
    fn: Callable[..., Params]
    params: Mapping[str, Param]
    needs: frozenset = frozenset()
    optional: frozenset = frozenset()
    max_models: int | None = None
    help: str = ""
    granularity: str = "model"

    def __post_init__(self):
        if not set(self.needs) | set(self.optional) <= set(INPUTS):
            raise InputError(f"method {self.name!r}: inputs {sorted(set(self.needs) | set(self.optional))}, expected some of {INPUTS}")
        if set(self.params) & set(INPUTS):  # `merge` tells its inputs from its options by name
            raise InputError(f"method {self.name!r}: parameters {sorted(set(self.params) & set(INPUTS))} are named as inputs {INPUTS}")
        for key, p in self.params.items():
            if key != p.name or p.type not in PARAM_TYPES:
                raise InputError(f"method {self.name!r}: bad declaration of {key!r}: {p}")
        checks.choice(f"method {self.name!r}: granularity", self.granularity, GRANULARITIES)

    @property
    def statistics(self) -> str | None:
        """The statistics it merges by ("fishers" or "grams"), or None."""
        return next((k for k in ("fishers", "grams") if k in self.needs), None)

    def unstreamed(self) -> str | None:
        """Why a streamed run (a chunk of layers at a time) cannot merge with this method, or None."""
        if self.granularity == "model":
            return "it needs every model whole (its granularity is 'model')"
        if self.statistics is not None and STATISTICS.get(self.name) != self.statistics:
            return f"its {self.statistics} are computed by the in-memory path only (streamed: {sorted(STATISTICS)})"
        beyond = sorted(self.needs - CHUNK_INPUTS - {self.statistics})
        if beyond:
            return f"it needs {' and '.join(beyond)}, which a chunk of layers does not give"
        return None

    def bind(self, models: int, params: Mapping | None = None, given: Collection[str] = (), how: Mapping[str, str] | None = None) -> dict:
        """The call checked once, before any work: `models` models, the options `params` (names,
        types, ranges; InputError naming the option), the inputs `given` (names among INPUTS: those
        needed are there, no others). `how`: {input: how the caller's user gives it} for the
        messages (the command line's flags). Returns the checked options (declared defaults not filled)."""
        params, how = dict(params or {}), dict(how or {})
        unknown = [k for k in params if k not in self.params]
        if unknown:
            raise InputError(f"merge method {self.name!r} has no parameter {unknown[0]!r}; its parameters: {list(self.params)}")
        checked = {k: self.params[k].check(v) for k, v in params.items()}
        missing = [k for k in INPUTS if k in self.needs and k not in given]
        if missing:
            what = INPUT_MEANINGS.get(missing[0], missing[0])
            raise InputError((f"merge method {self.name!r} needs {what}" if len(missing) == 1 else
                              f"merge method {self.name!r} needs {' and '.join(missing)}") + (f" ({how[missing[0]]})" if missing[0] in how else ""))
        extra = [k for k in given if k not in self.needs | self.optional]
        if extra:
            takes = sorted(self.needs | self.optional)
            others = sorted(m.name for m in METHODS.values() if extra[0] in m.needs | m.optional)
            raise InputError(f"merge method {self.name!r} does not use {' or '.join(extra)}{f' ({how[extra[0]]})' if extra[0] in how else ''}: "
                             f"it takes {takes or 'no other inputs'}; the methods that take {extra[0]}: {others}")
        if models < 2:
            raise InputError(f"give at least two models to merge, got {models}")
        if self.max_models is not None and models > self.max_models:
            raise InputError(f"merge method {self.name!r} merges at most {self.max_models} models; got {models}")
        return checked


_METHODS: dict[str, Method] = {}
METHODS: Mapping[str, Method] = types.MappingProxyType(_METHODS)  # read-only; `register` adds methods


def register(method: Method) -> Method:
    """Add `method` to `METHODS` (a name can be registered once)."""
    return _add(method)


def _add(method: Method) -> Method:
    if method.name in _METHODS:
        raise InputError(f"merge method {method.name!r} is already registered")
    _METHODS[method.name] = method
    return method


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
    return m.fn(params_list=models, **given, **options, task_head=task_head)


def method_named(name: str) -> Method:
    """The registered method `name` (InputError listing the known ones)."""
    if name not in METHODS:
        raise InputError(f"unknown merge method {name!r}; known methods: {sorted(METHODS)}")
    return METHODS[name]


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
    _add(_method)
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


def _average_leaves(models, weights):
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


def _task_arithmetic_leaves(base, models, lam):
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


def _ties_leaves(base, models, lam, *, density):
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


def _dare_leaves(base, models, key, drop, lam, *, then, density):
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


def _slerp_leaves(leaves_a, leaves_b, t, eps):
    # Per tensor (its norms): a kernel per leaf shape; a stacked leaf's slots (experts) each their own.
    def one(p):
        a, b = to_jax(leaves_a[p]), to_jax(leaves_b[p])
        if checks.is_stacked(p):
            return jnp.stack([_slerp_leaf((a[e], b[e]), t, eps) for e in range(a.shape[0])])
        return _slerp_leaf((a, b), t, eps)

    return {p: one(p) for p in leaves_a}
