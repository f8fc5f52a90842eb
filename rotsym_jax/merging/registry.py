"""The merge methods' one registry. A method is declared once (`Method`): its parameters (`Param`:
type, default or required, range or choices, scope, help), the inputs it takes (a base required,
optional or ignored; a key; statistics...), how many models it merges, what a leaf of its result
reads (`granularity`), one line of help; and one or two implementations of it:

- `jax`: the models in memory as params pytrees (jit-able where its arithmetic is): `merge.merge`,
  the command line's `--method`, recipes and the streamed merges run it;
- `tensorwise`: NumPy, one output tensor at a time, mergekit's arithmetic: a mergekit config's
  `merge_method` runs it (`mergekit_pipeline`).

Each implementation names the method in its own vocabulary: `METHODS` (public as
`merge.METHODS`) holds the methods with a `jax` implementation, `MERGEKIT` (`tensorwise.METHODS`,
filled as `tensorwise` loads, which `merge` imports) those with a `tensorwise` one; a method with both is in both under its one name, with one set of
parameters. A name means one method in each vocabulary, not across them: rotsym's `ties` (the
paper's: ceil(density n) kept, `lam`) and mergekit's `ties` (floor, per-model `weight` and
`density`, `normalize`) compute different things from different parameters, so they are two
declared methods, one in each (`mergekit.NOT_MERGEKIT` says how each pair differs, and
`mergekit.to_recipe` / `to_mergekit` convert the pairs that do agree: average = linear,
task_arithmetic = task_arithmetic, tested on the merged tensors).

`register` adds a method to the vocabularies of its implementations: the library's own methods
are registered where they are defined (`merging/methods.py`, `merging/tensorwise.py`), a user's
where it is written (docs/guides/merging.md).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from .. import checks
from ..errors import InputError


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # a parameter's default where it has none: the caller must give it
PARAM_TYPES = (float, int, str, bool)
# Where a parameter's value comes from in a mergekit config: "shared" (one value per tensor), "input"
# (one per model, the base too) or "non_base" (one per model besides the base). A `jax`
# implementation takes shared parameters only (its per-model values are inputs: `weights`).
SCOPES = ("shared", "input", "non_base")
# The inputs a method may take besides the models (`Method.needs` and `Method.optional`).
INPUTS = ("base", "fishers", "grams", "key", "spec", "checkpoint", "batches", "weights")
INPUT_MEANINGS = {"base": "a base model: the model the others were fine-tuned from",
                  "fishers": "fishers: statistics from data, each model's Fisher (stats.fisher)",
                  "grams": "grams: statistics from data, each model's Gram matrices (stats.grams)"}
# The inputs a tensorwise implementation gets: the base among its tensors, and the key as its
# generators (a mergekit config's seed, salted by the tensor's name and the model's position).
TENSORWISE_INPUTS = frozenset({"base", "key"})
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
class Param:
    """A declared parameter of a merge method: its type (float, int, str or bool), default
    (`REQUIRED`: none, the caller gives it), one-line help, allowed interval (numbers: `low`/`high`,
    open or closed) or `choices` (strings), and `scope` (SCOPES: shared, or one value per model in
    a mergekit config)."""

    name: str
    type: type
    default: Any = REQUIRED
    help: str = ""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()
    scope: str = "shared"

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def check(self, value):
        """`value` checked against the declaration (InputError naming the parameter): a float for a
        float parameter, the int, str or bool itself otherwise."""
        if self.type is str:
            return checks.choice(self.name, value, self.choices)
        if self.type is bool:
            if not isinstance(value, (bool, np.bool_)):
                raise InputError(f"{self.name}={value!r}; {self.name} must be true or false")
            return bool(value)
        if self.type is int and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise InputError(f"{self.name}={value!r}; {self.name} must be an int")
        x = checks.scalar(self.name, value, low=self.low, high=self.high, low_open=self.low_open, high_open=self.high_open)
        return int(value) if self.type is int else x

    def parse(self, text: str):
        """The parameter from its text (a command line's `--param name=value`), checked."""
        if self.type is str:
            return self.check(text)
        if self.type is bool:
            if text.lower() not in ("true", "false"):
                raise InputError(f"{self.name}={text!r}; expected true or false")
            return text.lower() == "true"
        try:
            value = self.type(text)
        except ValueError:
            raise InputError(f"{self.name}={text!r}; expected {'an int' if self.type is int else 'a number'}") from None
        return self.check(value)

    def read(self, value, where: str):
        """`value` as a mergekit config gives it, read as mergekit's pydantic reads it (a bool from
        0 or 1, a number from its text), then checked against the declared interval or choices;
        else InputError naming `where`."""
        if self.type is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, (int, float)) and value in (0, 1):
                return bool(value)
            raise InputError(f"{where}: {self.name} = {value!r}; expected true or false")
        if self.type is str:
            if not isinstance(value, str) or (self.choices and value not in self.choices):
                raise InputError(f"{where}: {self.name} = {value!r}; expected one of {self.choices}")
            return value
        if isinstance(value, str):  # pydantic, as mergekit reads its configs, takes "0.5" for 0.5
            value = _number(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InputError(f"{where}: {self.name} = {value!r}; expected a number")
        if self.low is not None or self.high is not None:
            try:
                checks.scalar(self.name, value, low=self.low, high=self.high, low_open=self.low_open, high_open=self.high_open)
            except InputError as e:
                raise InputError(f"{where}: {e}") from None
        return int(value) if self.type is int else float(value)


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


@dataclasses.dataclass(frozen=True)
class Method:
    """A merge method, declared once. `params`: its parameters (`Param`, by name; a sequence of them
    is taken too). `needs` / `optional`: the inputs it requires / may take (among `INPUTS`; its base
    is required, optional or ignored as "base" is in one or neither). `min_models` / `max_models`:
    how many models it merges besides its base (None: any number; a method that takes no base
    counts every model). `granularity` (GRANULARITIES) what its result on a leaf reads: a method
    that declares "element" or "tensor" and needs no input but CHUNK_INPUTS is merged a chunk of
    layers at a time by the streamed runs (`merge_to_disk`, `--max-memory`); "model", the default,
    holds the models whole.

    Its implementations, at least one: `jax(params_list=models, **inputs, **params, task_head=...)`
    returns the merged params (shared parameters only; `merge.merge` checks a call by `bind` and
    runs it); `tensorwise(tensors, base, shared, per_input, rng)` returns one merged tensor in
    float32 (`tensorwise.merge_tensor`: the models' tensors, the base among them where it takes
    one, the shared parameters, one mapping per model, `rng(i)` model i's generator)."""

    name: str
    jax: Callable[..., Any] | None
    params: Mapping[str, Param]
    needs: frozenset = frozenset()
    optional: frozenset = frozenset()
    max_models: int | None = None
    help: str = ""
    granularity: str = "model"
    tensorwise: Callable[..., np.ndarray] | None = None
    min_models: int = 2

    def __post_init__(self):
        params = self.params
        if not isinstance(params, Mapping):  # a sequence of Params, keyed by their names
            params = {p.name: p for p in params} if all(isinstance(p, Param) for p in params) else params
        object.__setattr__(self, "params", dict(params))
        object.__setattr__(self, "needs", frozenset(self.needs))
        object.__setattr__(self, "optional", frozenset(self.optional))
        if not set(self.needs) | set(self.optional) <= set(INPUTS):
            raise InputError(f"method {self.name!r}: inputs {sorted(set(self.needs) | set(self.optional))}, expected some of {INPUTS}")
        if set(self.params) & set(INPUTS):  # `merge` tells its inputs from its options by name
            raise InputError(f"method {self.name!r}: parameters {sorted(set(self.params) & set(INPUTS))} are named as inputs {INPUTS}")
        for key, p in self.params.items():
            if not isinstance(p, Param) or key != p.name or p.type not in PARAM_TYPES or p.scope not in SCOPES:
                raise InputError(f"method {self.name!r}: bad declaration of {key!r}: {p}")
        checks.choice(f"method {self.name!r}: granularity", self.granularity, GRANULARITIES)
        self._check_implementations()
        if self.min_models < 0 or (self.max_models is not None and self.max_models < self.min_models):
            raise InputError(f"method {self.name!r}: min_models={self.min_models}, max_models={self.max_models}; expected 0 <= min <= max")

    def _check_implementations(self) -> None:
        if self.jax is None and self.tensorwise is None:
            raise InputError(f"method {self.name!r} has no implementation: give jax (params in memory), tensorwise (a tensor at a time) or both")
        if self.jax is not None:
            per_model = [p.name for p in self.params.values() if p.scope != "shared"]
            if per_model:
                raise InputError(f"method {self.name!r}: parameters {per_model} are per model; its jax implementation takes shared "
                                 "parameters only (per-model values are its inputs, as weights)")
        if self.tensorwise is not None:
            beyond = sorted((self.needs | self.optional) - TENSORWISE_INPUTS)
            if beyond:
                raise InputError(f"method {self.name!r}: inputs {beyond}; a tensorwise implementation takes {sorted(TENSORWISE_INPUTS)} only")

    @property
    def fn(self) -> Callable[..., Any] | None:
        """The jax implementation (its name before the registry held two)."""
        return self.jax

    @property
    def vocabularies(self) -> tuple[str, ...]:
        """Where the method is named: "rotsym" (`merge.METHODS`) with a jax implementation,
        "mergekit" (a mergekit config's merge_method) with a tensorwise one."""
        return (("rotsym",) if self.jax is not None else ()) + (("mergekit",) if self.tensorwise is not None else ())

    @property
    def base(self) -> str:
        """"required", "optional" or "ignored": whether it takes a base model."""
        return "required" if "base" in self.needs else "optional" if "base" in self.optional else "ignored"

    @property
    def random(self) -> bool:
        """Whether it draws at random (it needs a key: a mergekit config's seed)."""
        return "key" in self.needs

    @property
    def statistics(self) -> str | None:
        """The statistics it merges by ("fishers" or "grams"), or None."""
        return next((k for k in ("fishers", "grams") if k in self.needs), None)

    def shared(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params.values() if p.scope == "shared")

    def per_input(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params.values() if p.scope != "shared")

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
        """The call of its jax implementation checked once, before any work: `models` models, the
        parameters `params` (names, types, ranges; InputError naming the parameter), the inputs
        `given` (names among INPUTS: those needed are there, no others). `how`: {input: how the
        caller's user gives it} for the messages (the command line's flags). Returns the checked
        parameters (declared defaults not filled)."""
        params, how = dict(params or {}), dict(how or {})
        unknown = [k for k in params if k not in self.params]
        if unknown:
            raise InputError(f"merge method {self.name!r} has no parameter {unknown[0]!r}; its parameters: {list(self.params)}")
        checked = {k: self.params[k].check(v) for k, v in params.items()}
        unset = [k for k, p in self.params.items() if p.required and k not in checked]
        if unset:
            raise InputError(f"merge method {self.name!r} needs the parameter {unset[0]!r} ({self.params[unset[0]].help or 'no default'})")
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
        if models < self.min_models:
            raise InputError(f"give at least {_COUNTS.get(self.min_models, self.min_models)} models to merge, got {models}")
        if self.max_models is not None and models > self.max_models:
            raise InputError(f"merge method {self.name!r} merges at most {self.max_models} models; got {models}")
        if self.jax is None:
            raise InputError(f"merge method {self.name!r} is mergekit's (a tensor at a time): run it from a mergekit config")
        return checked


_COUNTS = {1: "one", 2: "two", 3: "three"}

# The one registry, by vocabulary: the methods named in rotsym's (a jax implementation) and in
# mergekit configs' (a tensorwise one). Read-only views; `register` adds methods.
_VOCABULARIES: dict[str, dict[str, Method]] = {"rotsym": {}, "mergekit": {}}
METHODS: Mapping[str, Method] = types.MappingProxyType(_VOCABULARIES["rotsym"])
MERGEKIT: Mapping[str, Method] = types.MappingProxyType(_VOCABULARIES["mergekit"])


def register(method: Method) -> Method:
    """Add `method` to the vocabularies of its implementations (`METHODS` for jax, `MERGEKIT` for
    tensorwise); a name can be registered once in each."""
    for vocabulary in method.vocabularies:
        if method.name in _VOCABULARIES[vocabulary]:
            raise InputError(f"merge method {method.name!r} is already registered" + (" as a mergekit method" if vocabulary == "mergekit" else ""))
    for vocabulary in method.vocabularies:
        _VOCABULARIES[vocabulary][method.name] = method
    return method


def method_named(name: str) -> Method:
    """The method `name` of rotsym's vocabulary (InputError listing the known ones)."""
    if name not in METHODS:
        raise InputError(f"unknown merge method {name!r}; known methods: {sorted(METHODS)}")
    return METHODS[name]


def counts(method: Method, sources: int, base_among: bool) -> str | None:
    """Why `sources` models of a mergekit slice (`base_among`: the base one of them) are not what
    `method` merges, in mergekit's terms (a count of every input, the base included, where the
    method takes a base it requires or none; of the others where its base is optional), or None."""
    if method.base == "optional":
        others = sources - base_among
        if others < method.min_models or (method.max_models is not None and others > method.max_models):
            return f"merges {_want(method.min_models, method.max_models)} models besides the base; the config gives {others}"
        return None
    extra = method.base == "required"
    low, high = max(method.min_models + extra, 1), None if method.max_models is None else method.max_models + extra
    if sources < low or (high is not None and sources > high):
        return f"merges {_want(low, high)} models (the base included); the config gives {sources}"
    return None


def _want(low: int, high: int | None) -> str:
    return f"exactly {low}" if low == high else f"at most {high}" if high is not None else f"at least {low}"

