"""config.json read as the library reads it: the family record of a model type, the `ModelConfig`
of a config's JSON (checked as transformers' config class would check it), the same config untied,
and a transformers config as a `ModelConfig`. Split out of `hf` (whose public names they stay)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..errors import InputError, InputTypeError, MissingPath
from ..families import FAMILIES
from ..families.config import ModelConfig
from ..families.family import Family, InferredRecord
from ..families.tensors import TENSORS
from ._files import CheckpointError, read_json_object


def family_for(model_type: str, where: str = "config") -> Family:
    if model_type == TENSORS.name:  # what a record of an architecture without a layout reads it as (not a model type)
        return TENSORS
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise CheckpointError(f"{where}: unsupported model_type {model_type!r}; supported: {supported_model_types()}. A checkpoint whose "
                          "tensors follow one of their layouts can be read with a record inferred and proven in transformers: "
                          "rotsym_jax.infer_record(folder) (the command line infers one itself)")


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in f.model_types)


def family_of(config: ModelConfig) -> Family:
    """The family record a config is read with: its model_type's, or the one its inferred record
    reads it as (`InferredRecord`)."""
    if config.record is not None:
        return family_for(config.record.read_as).inferred(config.record)
    return family_for(config.model_type)


def read_config(raw: Mapping, where: str = "config", record: InferredRecord | None = None) -> ModelConfig:
    """The `ModelConfig` of a config.json's content (`where` names it in errors); ValueError
    naming the key for a value transformers' config class would refuse. `record`: an inferred
    record for a model_type without one (read as `record.read_as`)."""
    model_type = raw.get("model_type")
    if model_type is None:
        raise CheckpointError(f"{where}: no 'model_type' key, so the model family is unknown")
    if not isinstance(model_type, str):
        raise CheckpointError(f"{where}: model_type={model_type!r}; expected a string")
    if record is None:
        return ModelConfig(raw, family_for(model_type, where).schema(model_type))
    if record.model_type != model_type:
        raise CheckpointError(f"{where}: model_type {model_type!r}, but the inferred record given is for {record.model_type!r}")
    if model_type in supported_model_types():
        raise CheckpointError(f"{where}: model_type {model_type!r} has its own record; an inferred one is for model types without")
    return ModelConfig(raw, family_for(record.read_as, where).schema(record.read_as), record=record)


TIE_KEY = "tie_word_embeddings"


def untied_config(config: ModelConfig, where: str) -> ModelConfig | None:
    """`config` with `TIE_KEY` false (in a vision–language model's `text_config` too, which ties
    Llama 4's head), or None where its family has no untied form (BART, Whisper). Untying changes
    the tie alone: a key config.json leaves to the tie (T5's scale_decoder_outputs, true unless
    the tie says false: a v1.0 config written before transformers 5 states neither) keeps the
    value it was read with."""
    raw = config.raw
    raw[TIE_KEY] = False
    if isinstance(raw.get("text_config"), dict):
        raw["text_config"][TIE_KEY] = False
    try:
        untied = read_config(raw, where, config.record)
        family = family_of(untied)
        fields = family.schema(untied.model_type).fields
        derived = {k: getattr(config, k) for k in fields if k not in raw and not isinstance(getattr(config, k, None), dict)
                   and getattr(untied, k, None) != getattr(config, k, None)}
        if derived:
            untied = read_config({**raw, **derived}, where, config.record)
        family.check(untied)
    except InputError:
        return None
    return untied


def _transformers_config_class():
    # Only an imported transformers can have made a transformers config: never import it here.
    module = sys.modules.get("transformers.configuration_utils")
    return None if module is None else module.PreTrainedConfig


def as_model_config(config) -> ModelConfig:
    """`config` itself when it is a ModelConfig; a transformers config as a ModelConfig (read from
    what `save_pretrained` would write; its `transformers()` returns `config` itself)."""
    if isinstance(config, ModelConfig):
        return config
    cls = _transformers_config_class()
    if cls is None or not isinstance(config, cls):
        raise InputTypeError(f"expected a transformers config or a ModelConfig, got {type(config).__name__}")
    model_type = config.model_type
    raw = json.loads(config.to_json_string(use_diff=True))
    return ModelConfig(raw, family_for(model_type).schema(model_type), built=config)


def describe_config(config) -> str:
    keys = (
        "hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
        "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "image_size",
        "patch_size", "num_channels",
    )
    raw = config.to_dict()
    return ", ".join(f"{k}={raw[k]}" for k in keys if raw.get(k) is not None)
# Sizes a model cannot be built without; each must be a positive integer where the config sets it.
_POSITIVE_SIZES = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "max_position_embeddings", "type_vocab_size", "image_size",
    "patch_size", "num_channels", "num_labels",
)
_PER_AXIS = ("image_size", "patch_size")
_EPSILONS = ("layer_norm_eps", "layer_norm_epsilon", "rms_norm_eps")


def check_config(config, where: str = "config", zero_sizes: tuple[str, ...] = ()) -> None:
    """Raise CheckpointError when `config`'s sizes cannot describe a model (zero or negative sizes,
    heads that do not divide the width, a negative or non-finite norm epsilon); `zero_sizes` (the
    family's `Family.zero_sizes`) may be 0."""
    for key in _POSITIVE_SIZES:
        value = getattr(config, key, None)
        if value is None:
            continue
        # Image and patch sizes may be (height, width).
        parts = value if key in _PER_AXIS and isinstance(value, (list, tuple)) and len(value) == 2 else [value]
        least = 0 if key in zero_sizes else 1
        if any(isinstance(v, bool) or not isinstance(v, int) or v < least for v in parts):
            raise CheckpointError(f"{where}: {key}={value!r}; expected a {'non-negative' if least == 0 else 'positive'} integer")
    for key in _EPSILONS:
        value = getattr(config, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not np.isfinite(value) or value < 0):
            raise CheckpointError(f"{where}: {key}={value!r}; expected a finite number >= 0")
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if heads and getattr(config, "head_dim", None) is None and config.hidden_size % heads:
        raise CheckpointError(
            f"{where}: hidden_size={config.hidden_size} is not a multiple of num_attention_heads={heads}"
        )
    if heads and kv and heads % kv:
        raise CheckpointError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")


def read_model_config(config_file: Path, record: InferredRecord | None = None) -> tuple[ModelConfig, Family]:
    """A checkpoint's config.json read and checked as every loader does: (config, family)."""
    if not config_file.is_file():
        raise MissingPath(f"{config_file}: missing; a checkpoint folder needs config.json")
    raw = read_json_object(config_file, "a model config")
    config = config_step(config_file, lambda: read_config(raw, str(config_file), record))
    family = family_of(config)
    if family.name != TENSORS.name:  # read as its tensors alone, a model's sizes are its tensors' shapes, not config.json's
        check_config(config, str(config_file), family.zero_sizes)
    config_step(config_file, lambda: family.check(config))
    return config, family


def config_step(config_file: Path, step):
    """Run a step that reads the config; a value it cannot use becomes a CheckpointError."""
    try:
        return step()
    except CheckpointError:
        raise
    except Exception as e:  # a value the config or the family cannot use: ValueError, TypeError, ...
        raise CheckpointError(f"{config_file}: cannot read the model from this config ({type(e).__name__}: {e})") from e
