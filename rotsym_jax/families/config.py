"""A checkpoint's config.json as the model families read it, without importing transformers.

Importing a transformers config class imports PyTorch and much of transformers (seconds), and a
merge or an alignment needs neither. `ModelConfig` holds, for every attribute a family reads, the
value transformers' config class for that `model_type` would hold: the class default where
config.json leaves the key out, and what the class derives (head_dim, num_key_value_heads,
layer_types and sliding_window, rope_parameters from the legacy rope_theta / rope_scaling,
num_labels from id2label, ...). Those values are type-checked as transformers' strict config
classes check them (an int where an int is declared, a float where a float is), so a config that
transformers refuses is refused here too, when the checkpoint is loaded. Other keys of config.json
are attributes as they are, as transformers keeps them. tests/test_model_config.py checks every
attribute against the transformers config, for every family and a range of configs.

A family declares what it reads as a `ConfigSchema` per model_type, next to its tensor-name map.
`ModelConfig.transformers()` builds the transformers config itself, for callers that need one.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import InputError


@dataclasses.dataclass(frozen=True)
class Kind:
    """A declared type of a config value: its name in errors and its test."""

    name: str
    accepts: Callable[[Any], bool]

    def optional(self) -> Kind:
        return Kind(f"{self.name} or null", lambda v: v is None or self.accepts(v))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


INT = Kind("an int", _is_int)
# transformers' strict config classes refuse an int where they declare a float (1 for 1.0).
FLOAT = Kind("a float (with a decimal point)", lambda v: isinstance(v, float))
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
STR = Kind("a string", lambda v: isinstance(v, str))
SIZE = Kind("an int or a list of ints", lambda v: _is_int(v) or (isinstance(v, (list, tuple)) and all(_is_int(x) for x in v)))
DICT = Kind("a JSON object", lambda v: isinstance(v, dict))
STRINGS = Kind("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))


def unit_float(name: str = "a float in [0, 1]") -> Kind:
    return Kind(name, lambda v: isinstance(v, float) and 0.0 <= v <= 1.0)


@dataclasses.dataclass(frozen=True)
class ConfigSchema:
    """What transformers' config class of `model_type` holds, for the attributes a family reads.

    fields: {name: (Kind, default)}: the class's declared type and default.
    derive(values): fills in the values the class computes from others (in place), and raises
        ValueError naming the key for a combination the class refuses.
    aliases: {alias: name} (transformers' attribute_map, e.g. GPT-2's hidden_size -> n_embd).
    consumed: keys of config.json the class turns into others and does not keep (legacy RoPE keys).
    class_name: the transformers class, built by `ModelConfig.transformers()`.
    """

    model_type: str
    class_name: str
    fields: Mapping[str, tuple[Kind, Any]]
    derive: Callable[[dict, Mapping], None] | None = None
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    consumed: tuple[str, ...] = ()


# Fields of every transformers config (PreTrainedConfig) that a family reads.
COMMON_FIELDS = {"architectures": (STRINGS.optional(), None)}
# Keys every transformers config turns into others (PreTrainedConfig.__post_init__).
_ALWAYS_CONSUMED = ("torch_dtype", "num_labels")


# Counts the families build a table per element of (layers, heads, experts): a config.json that
# claims a billion layers is refused before anything is built per layer. No model comes near this.
COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads",
          "num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "decoder_sparse_step")
MAX_COUNT = 2**16


def bad_value(name: str, value, kind: str) -> InputError:
    return InputError(f"'{name}' is {value!r} ({type(value).__name__}); expected {kind}")


def _num_labels(raw: Mapping) -> int:
    """PreTrainedConfig: num_labels as given, else the length of id2label, else 2."""
    if "num_labels" in raw:
        value = raw["num_labels"]
        if not _is_int(value):
            raise bad_value("num_labels", value, INT.name)
        return value
    id2label = raw.get("id2label")
    if id2label is None:
        return 2
    if not isinstance(id2label, dict):
        raise bad_value("id2label", id2label, DICT.name)
    return len(id2label)


class ModelConfig:
    """A read-only config: the attributes a family reads (see the module docstring), the other keys
    of config.json as they are, `model_type`, `to_dict()` and `raw` (the JSON it was read from,
    which `save_hf` writes back)."""

    __slots__ = ("_schema", "_raw", "_values", "_extras", "_key", "_built", "_record")

    def __init__(self, raw: Mapping, schema: ConfigSchema, *, built=None, record=None):
        raw = copy.deepcopy(dict(raw))
        values: dict[str, Any] = {}
        # An alias key sets its field, after the field's own key (transformers sets it last).
        given = {k: v for k, v in raw.items() if k not in schema.aliases}
        given.update({schema.aliases[k]: v for k, v in raw.items() if k in schema.aliases})
        for name, (kind, default) in {**COMMON_FIELDS, **schema.fields}.items():
            value = given.get(name, default)
            if not kind.accepts(value):
                raise bad_value(name, value, kind.name)
            if name in COUNTS and _is_int(value) and value > MAX_COUNT:
                raise bad_value(name, value, f"at most {MAX_COUNT} (a count of layers, heads or experts; no model has so many)")
            values[name] = copy.deepcopy(value)
        values["num_labels"] = _num_labels(raw)
        if schema.derive is not None:
            schema.derive(values, raw)
        values["model_type"] = schema.model_type
        skip = set(COMMON_FIELDS) | set(schema.fields) | set(schema.aliases) | set(schema.consumed) | set(_ALWAYS_CONSUMED) | {"model_type"}
        extras = {k: v for k, v in raw.items() if k not in skip}
        set_ = object.__setattr__
        set_(self, "_schema", schema)
        set_(self, "_raw", raw)
        set_(self, "_values", values)
        set_(self, "_extras", extras)
        # Equal configs build equal models: every attribute counts (a family reads some extras too).
        set_(self, "_key", (schema.model_type, record, json.dumps({**extras, **values}, sort_keys=True, default=repr)))
        set_(self, "_built", built)
        set_(self, "_record", record)

    @property
    def record(self):
        """The `InferredRecord` this config is read with (its model_type then is `record.read_as`;
        `raw` keeps the checkpoint's own), or None."""
        return self._record

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ModelConfig.__slots__:
            raise AttributeError(name)
        name = self._schema.aliases.get(name, name)
        for source in (self._values, self._extras):
            if name in source:
                value = source[name]
                return copy.deepcopy(value) if isinstance(value, (dict, list)) else value  # read-only
        raise AttributeError(f"{self._schema.model_type} config has no attribute {name!r}")

    def __setattr__(self, name, value):
        raise AttributeError(
            f"ModelConfig is read-only (setting {name!r}); change config.json, or build a transformers config "
            "and pass it to init_checkpoint"
        )

    def __eq__(self, other):
        return isinstance(other, ModelConfig) and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __copy__(self):
        return self  # read-only

    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return f"ModelConfig({self._values})"

    def to_dict(self) -> dict:
        """Every attribute: config.json's other keys and the values the families read."""
        return copy.deepcopy({**self._extras, **self._values})

    @property
    def raw(self) -> dict:
        """A copy of the JSON this config was read from."""
        return copy.deepcopy(self._raw)

    def transformers(self):
        """The transformers config of this config.json (built on the first call, imports
        transformers), as `transformers.AutoConfig.from_pretrained` would read it."""
        if self._built is None:
            import transformers

            # an inferred record's config is its own model_type's class, not the one it is read as
            cls = transformers.CONFIG_MAPPING[self._raw["model_type"]] if self._record else getattr(transformers, self._schema.class_name)
            # as from_pretrained reads config.json: {"__float__": "Infinity"} is the float it stands for
            raw = transformers.PreTrainedConfig._decode_special_floats(copy.deepcopy(self._raw))
            object.__setattr__(self, "_built", cls.from_dict(raw))
        return self._built


def positive_ints(values: Mapping, *names: str) -> bool:
    """True when each named value is a positive int (derivations divide by them; check_config
    names the ones that are not)."""
    return all(_is_int(values.get(n)) and values[n] > 0 for n in names)


def check_number(name: str, value, *, above_zero: bool = False) -> None:
    """ValueError naming `name` unless `value` is a finite number (> 0 with above_zero)."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)) or (above_zero and value <= 0):
        raise bad_value(name, value, "a finite positive number" if above_zero else "a finite number")
