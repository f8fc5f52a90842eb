"""Vision–language models: a vision tower, a projector that writes image features into the text
model's residual stream, and a text model of a family we have: `gemma3`
(Gemma3ForConditionalGeneration: SigLIP + Gemma 3), `mistral3` (Mistral3ForConditionalGeneration:
Pixtral + Mistral or Llama), `qwen2_vl` and `qwen2_5_vl` (Qwen2VL / Qwen2_5_VLForConditionalGeneration:
their own vision transformers + Qwen2 with multimodal RoPE), `qwen3_vl` and `qwen3_vl_moe`
(Qwen3VL / Qwen3VLMoeForConditionalGeneration: a vision transformer with DeepStack mergers + Qwen3
or Qwen3-MoE with interleaved multimodal RoPE), `llama4` (Llama4ForConditionalGeneration: its own
vision model + Llama 4's text model, `llama4.py`).

The language tower is read and aligned exactly as its text family's record reads and aligns it
(its attention and FFN groups, its residual stream and norms), as transformers 5 writes these
classes: Gemma 3's, Mistral 3's and Llama 4's under `language_model.model.` with the LM head
`language_model.lm_head`, Qwen2's under `model.` and Qwen3's under `model.language_model.` with
`lm_head`; the head tied to the embedding as the top-level `tie_word_embeddings` says (what
transformers reads for the whole model; Llama 4's as its `text_config` says: its
`Llama4ForCausalLM` ties itself). Qwen's text models are read as Qwen2, Qwen3 and Qwen3-MoE
(`_QWEN_TEXT`, `_QWEN3_TEXT`, `_QWEN3_MOE_TEXT`): multimodal RoPE turns each rotary pair by a time,
height or width position (Qwen3 interleaves them: pair j by height where j % 3 == 1, width where
j % 3 == 2, within mrope_section), and every element of a pair's 2-D rotations commutes with any
turn; under Qwen3's QK-norm the QK group is already only the sign flips of whole pairs (turns by
pi). Qwen3-VL-MoE's experts are stored stacked (`mlp.experts.gate_up_proj`, `down_proj`): as
transformers 5 holds them, (E, 2f, d) and (E, d, f), or as Qwen's releases store them, (E, d, 2f)
and (E, f, d); each read as transformers reads it (its own shape unless the other matches) and
written back as it was read (`TowerLayout.transposed_experts`).

The projector's output side moves with the stream: image features replace the token embeddings of
the image tokens, so the projector's last map is one more writer of the stream, as the embedding
is (Gemma 3's `mm_input_projection_weight` (vision d, d) along its columns; Mistral 3's `linear_2`,
Qwen2's `visual.merger.mlp.2`, Qwen3's `model.visual.merger.linear_fc2`, Llama 4's
`multi_modal_projector.linear_1`: kernel columns and bias).
Qwen3-VL's DeepStack mergers (`deepstack_merger_list.{k}`) are added to the hidden states of the
image tokens after text layer k: their `linear_fc2` writes the stream too and moves with it.

The towers of Gemma 3 (SigLIP's record), Mistral 3 (Pixtral), Qwen2-VL / 2.5-VL / 3-VL and Llama 4
are aligned (`vlm_towers.py`): their heads (block "vision") and MLP units ("vision_ffn") are groups
beside the text model's, and the projector's MLP between them (Mistral 3's linear_1 -> GELU ->
linear_2, Qwen's merger mlp.0 or linear_fc1 -> GELU -> mlp.2 or linear_fc2) a permutation group
("projector_ffn"; Qwen3-VL's DeepStack mergers' "deepstack_ffn"). Llama 4's pixel-shuffle adapter
(fc1 -> GELU -> fc2 -> GELU, inside its tower) and its projector's linear_1 are read as one chain:
fc1's units "adapter_ffn", fc2's outputs (linear_1's inputs) "projector_ffn". Gemma 3's SigLIP
tower's own stream is a second stream of the model ("vision_residual", `Tower.stream`, with the
projector's norm gain and input rows: permutations only); the other towers' do not move: their
projectors read them merged spatially (patches side by side), on which a permutation of the
stream acts tiled, which no stream's action here is. The rest of the projector (Mistral 3's and
Qwen's norms over the vision width, Mistral 3's patch merger) is merged as it is.

Leaves: the text family's (embeddings/word/embedding, layers/{i}/..., final_norm, lm_head), and
    projector/out/kernel (in, d) [+ projector/out/bias (d,)]   on the stream (axis 1; the bias 0)
    projector/layers/0/out/{kernel,bias}                        likewise, behind a projector MLP (Mistral 3, Qwen, Llama 4)
    projector/deepstack/{k}/out/{kernel,bias}                   likewise (Qwen3-VL)
    projector/norm/{scale,bias}, projector/merge/kernel, projector/{layers/0/,}up/{kernel,bias}, projector/layers/0/mid/kernel,
    projector/deepstack/{k}/{norm,up}/...                        off the stream
    vision/embeddings/..., vision/layers/{j}/..., vision/final_norm/..., vision/pooler/...
                                                                 every tower's, in our shared names (vlm_towers.py)
Gemma 3's tower is
read under `vision_tower.` (transformers 5) or `vision_tower.vision_model.` (the Hub's releases),
the same leaves either way, written back under the prefix it was read from.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InputError
from ..spec import Spec
from .config import BOOL, DICT, FLOAT, INT, SIZE, STR, ConfigSchema, ModelConfig
from .family import TRANSPOSE, Family, Head, Layout, Tensor, TensorRule, linear
from .llama import GEMMA3, LLAMA
from .llama._config import INTS, is_tied, sparse_layer
from .llama4 import LLAMA4_TEXT
from .siglip import VISION_SCHEMA as SIGLIP_VISION_SCHEMA
from .vlm_towers import DEEPSTACK_RULES, LLAMA4_PROJECTOR_RULES, LLAMA4_TOWER, PIXTRAL_TOWER, PROJECTOR_RULES, QWEN2_5_VL_TOWER, QWEN2_VL_TOWER, QWEN3_VL_TOWER, SIGLIP_TOWER, Tower


@dataclasses.dataclass(frozen=True)
class TowerLayout(Layout):
    """A vision–language checkpoint's layout: the prefix its vision tower's tensors carry, and
    which of a mixture's stacked expert tensors (`gate_up_proj`, `down_proj`) it stores as Qwen's
    releases do, (E, in, out), rather than as transformers 5 holds them, (E, out, in)."""

    tower: str = "vision_tower."
    transposed_experts: tuple[str, ...] = ()


_TEXT_PREFIX = "language_model.model."
_TEXT_FAMILY = {"gemma3": GEMMA3, "mistral3": LLAMA, "qwen2_vl": LLAMA, "qwen2_5_vl": LLAMA, "qwen3_vl": LLAMA, "qwen3_vl_moe": LLAMA,
                "llama4": LLAMA4_TEXT}
# the text model types each VLM's text_config may be (others are refused, naming them)
_TEXT_TYPES = {"gemma3": ("gemma3_text",), "mistral3": ("mistral", "llama"), "qwen2_vl": ("qwen2_vl_text",), "qwen2_5_vl": ("qwen2_5_vl_text",),
               "qwen3_vl": ("qwen3_vl_text",), "qwen3_vl_moe": ("qwen3_vl_moe_text",), "llama4": ("llama4_text",)}
# the VLMs whose LM head transformers ties as their text_config says (Llama4ForCausalLM inside ties itself), not the top level
TIED_BY_TEXT = ("llama4",)
_QWEN = ("qwen2_vl", "qwen2_5_vl")
_QWEN3_TYPES = ("qwen3_vl", "qwen3_vl_moe")
# Qwen2-VL's and Qwen2.5-VL's text model is Qwen2's (q/k/v biases, windows by layer type) with multimodal RoPE: each rotary
# pair turns by the time, height or width position (mrope_section), which every element of a pair's 2-D rotations commutes
# with. Read as Qwen2 (its tables and groups), with the defaults of Qwen2VLTextConfig.
_QWEN_TEXT = dataclasses.replace(LLAMA.schema("qwen2"), fields={
    **LLAMA.schema("qwen2").fields, "vocab_size": (INT, 152064), "hidden_size": (INT, 8192), "intermediate_size": (INT, 29568),
    "num_hidden_layers": (INT, 80), "num_attention_heads": (INT, 64), "num_key_value_heads": (INT.optional(), 8), "rms_norm_eps": (FLOAT, 1e-5),
    "use_sliding_window": (BOOL.optional(), False), "max_window_layers": (INT.optional(), 80)})
# Qwen3-VL's text model is Qwen3's (QK-norm; biases as attention_bias says; no windows), Qwen3-VL-MoE's Qwen3-MoE's (its
# top-k weights always renormalised, no windows), each with interleaved multimodal RoPE; read as those, with the defaults of
# Qwen3VLTextConfig and Qwen3VLMoeTextConfig.
_QWEN3_TEXT = dataclasses.replace(LLAMA.schema("qwen3"), fields={
    **LLAMA.schema("qwen3").fields, "vocab_size": (INT, 151936), "hidden_size": (INT, 4096), "intermediate_size": (INT, 22016),
    "num_hidden_layers": (INT, 32), "num_attention_heads": (INT, 32), "num_key_value_heads": (INT.optional(), 32), "head_dim": (INT, 128),
    "max_position_embeddings": (INT, 128000), "use_sliding_window": (BOOL.optional(), False)})
def _derive_qwen3_vl_moe(values: dict, raw) -> None:
    """Qwen3VLMoeTextConfig: Qwen3-MoE's values, and head_dim hidden_size / heads where none is given."""
    LLAMA.schema("qwen3_moe").derive(values, raw)
    if values["head_dim"] is None and values["num_attention_heads"]:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]


_QWEN3_MOE_TEXT = dataclasses.replace(LLAMA.schema("qwen3_moe"), derive=_derive_qwen3_vl_moe, fields={
    **LLAMA.schema("qwen3_moe").fields, "vocab_size": (INT, 151936), "hidden_size": (INT, 2048), "intermediate_size": (INT, 5632),
    "num_hidden_layers": (INT, 24), "num_attention_heads": (INT, 16), "num_key_value_heads": (INT, 16), "head_dim": (INT.optional(), None),
    "max_position_embeddings": (INT, 128000), "moe_intermediate_size": (INT, 1408), "num_experts_per_tok": (INT, 4), "num_experts": (INT, 60),
    "norm_topk_prob": (BOOL, True)})
_QWEN3_TEXTS = {"qwen3_vl": _QWEN3_TEXT, "qwen3_vl_moe": _QWEN3_MOE_TEXT}
# keys transformers' Qwen3-VL text configs do not read (no sliding windows; the MoE's top-k always renormalised)
_QWEN3_UNREAD = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "norm_topk_prob")
# the keys of a flat (pre-v5) Qwen2-VL config.json that are its text model's
_QWEN_TEXT_KEYS = (*_QWEN_TEXT.fields, "rope_scaling", "rope_theta", "use_cache", "attention_dropout", "bos_token_id", "eos_token_id")
# Mistral3Config's text and vision configs where config.json gives none (its sub_configs_defaults)
_MISTRAL3_TEXT = {"model_type": "mistral", "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
                  "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
                  "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072}
_MISTRAL3_VISION = {"model_type": "pixtral", "intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14, "image_size": 1540,
                    "num_hidden_layers": 24, "num_attention_heads": 16, "hidden_act": "gelu"}

PIXTRAL = ConfigSchema("pixtral", "PixtralVisionConfig", {
    "hidden_size": (INT, 1024), "intermediate_size": (INT, 4096), "num_hidden_layers": (INT, 24), "num_attention_heads": (INT, 16),
    "num_channels": (INT, 3), "image_size": (SIZE, 1024), "patch_size": (SIZE, 16), "hidden_act": (STR, "gelu"),
})
QWEN2_VL_VISION = ConfigSchema("qwen2_vl_vision", "Qwen2VLVisionConfig", {
    "depth": (INT, 32), "embed_dim": (INT, 1280), "hidden_size": (INT, 3584), "hidden_act": (STR, "quick_gelu"), "mlp_ratio": (INT, 4),
    "num_heads": (INT, 16), "in_channels": (INT, 3), "patch_size": (INT, 14), "spatial_merge_size": (INT, 2), "temporal_patch_size": (INT, 2),
})
QWEN2_5_VL_VISION = ConfigSchema("qwen2_5_vl_vision", "Qwen2_5_VLVisionConfig", {
    "depth": (INT, 32), "hidden_size": (INT, 3584), "hidden_act": (STR, "silu"), "intermediate_size": (INT, 3420), "num_heads": (INT, 16),
    "in_channels": (INT, 3), "patch_size": (INT, 14), "spatial_merge_size": (INT, 2), "temporal_patch_size": (INT, 2),
    "out_hidden_size": (INT, 3584),
})
QWEN3_VL_VISION = ConfigSchema("qwen3_vl_vision", "Qwen3VLVisionConfig", {
    "depth": (INT, 27), "hidden_size": (INT, 1152), "hidden_act": (STR, "gelu_pytorch_tanh"), "intermediate_size": (INT, 4304),
    "num_heads": (INT, 16), "in_channels": (INT, 3), "patch_size": (INT, 16), "spatial_merge_size": (INT, 2), "temporal_patch_size": (INT, 2),
    "out_hidden_size": (INT, 3584), "num_position_embeddings": (INT, 2304), "deepstack_visual_indexes": (INTS, [8, 16, 24]),
})
QWEN3_VL_MOE_VISION = dataclasses.replace(QWEN3_VL_VISION, model_type="qwen3_vl_moe_vision", class_name="Qwen3VLMoeVisionConfig")
LLAMA4_VISION = ConfigSchema("llama4_vision_model", "Llama4VisionConfig", {
    "hidden_size": (INT, 768), "hidden_act": (STR, "gelu"), "num_hidden_layers": (INT, 34), "num_attention_heads": (INT, 16), "num_channels": (INT, 3),
    "intermediate_size": (INT, 5632), "vision_output_dim": (INT, 7680), "image_size": (SIZE, 448), "patch_size": (SIZE, 14),
    "norm_eps": (FLOAT, 1e-5), "pixel_shuffle_ratio": (FLOAT, 0.5), "projector_input_dim": (INT, 4096), "projector_output_dim": (INT, 4096),
})
_VISION = {"gemma3": SIGLIP_VISION_SCHEMA, "mistral3": PIXTRAL, "qwen2_vl": QWEN2_VL_VISION, "qwen2_5_vl": QWEN2_5_VL_VISION, "qwen3_vl": QWEN3_VL_VISION,
           "qwen3_vl_moe": QWEN3_VL_MOE_VISION, "llama4": LLAMA4_VISION}


def _sub(given, key: str, default: dict | None, schema_of: Callable[[str], ConfigSchema], types: tuple[str, ...], model_type: str) -> ModelConfig:
    if given is not None and not isinstance(given, dict):
        raise InputError(f"'{key}' is {given!r}; expected a JSON object")
    sub = dict(default or {}) if given is None else dict(given)
    sub_type = sub.get("model_type", types[0])
    if sub_type not in types:
        raise InputError(f"{key}.model_type={sub_type!r}: a {model_type} checkpoint is read with a {key} of type {' or '.join(types)}")
    try:
        return ModelConfig(sub, schema_of(sub_type))
    except InputError as e:
        raise InputError(f"{key}: {e}") from None


def _qwen_text(raw, text) -> dict:
    """Qwen2VLConfig: a flat config.json's text keys are its text model's; the legacy rope type
    "mrope" is "default" (its sections kept); a text model tied ties the whole model."""
    text = {k: raw[k] for k in _QWEN_TEXT_KEYS if k in raw and k != "tie_word_embeddings"} if text is None else dict(text)
    text.pop("head_dim", None)  # Qwen2VLTextConfig has none: its heads are hidden_size / num_attention_heads wide, whatever the key says
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "mrope":
        text.pop("rope_scaling", None)
        text["rope_parameters"] = {**rope, "rope_type": "default"}
    text.setdefault("rope_theta", 1000000.0)  # Qwen2VLTextConfig's default theta, where rope_parameters names none
    return {**text, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False) or text.get("tie_word_embeddings", False))}


def _qwen3_text(raw, text) -> dict:
    """Qwen3VLConfig: the text config nested (its defaults where none), theta 500000 unless given;
    the whole model tied only as the top-level config says (a text model's own flag ties nothing)."""
    text = {k: v for k, v in (text or {}).items() if k not in _QWEN3_UNREAD}
    text.setdefault("rope_theta", 500000.0)  # the text configs' default_theta, where rope_parameters names none
    return {**text, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False))}


def _text_of(raw, model_type: str) -> ModelConfig:
    """The text model's config (`text_config`), its LM head tied as the top-level config says (what
    transformers reads for the whole model)."""
    text = raw.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise InputError(f"'text_config' is {text!r}; expected a JSON object")
    if model_type in _QWEN3_TYPES:
        schema = _QWEN3_TEXTS[model_type]
        return _sub(_qwen3_text(raw, text), "text_config", None, lambda t: schema, _TEXT_TYPES[model_type], model_type)
    if model_type in _QWEN:
        return _sub(_qwen_text(raw, text), "text_config", None, lambda t: _QWEN_TEXT, _TEXT_TYPES[model_type], model_type)
    if text is None:
        text = _MISTRAL3_TEXT if model_type == "mistral3" else {}
    if model_type not in TIED_BY_TEXT:
        text = {**text, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True))}
    return _sub(text, "text_config", None, _TEXT_FAMILY[model_type].schema, _TEXT_TYPES[model_type], model_type)


def _vision_of(raw, model_type: str) -> ModelConfig:
    schema = _VISION[model_type]
    default = _MISTRAL3_VISION if model_type == "mistral3" else None
    given = raw.get("vision_config")
    if model_type in ("qwen2_vl", *_QWEN3_TYPES) and isinstance(given, dict) and given.get("model_type") == model_type:
        given = {**given, "model_type": schema.model_type}  # older checkpoints' vision type, as transformers renames it
    return _sub(given, "vision_config", default, lambda t: schema, (schema.model_type,), model_type)


def _raw(config) -> dict:
    # a ModelConfig's JSON, or a transformers config's (its sub-configs as dicts)
    return config.raw if isinstance(config, ModelConfig) else config.to_dict()


@functools.lru_cache(maxsize=64)
def _cached(which, config: ModelConfig) -> ModelConfig:
    return which(config.raw, config.model_type)


def text_config(config) -> ModelConfig:
    """A vision–language config's text model config (a ModelConfig or a transformers config's), as
    its text family reads it."""
    return _cached(_text_of, config) if isinstance(config, ModelConfig) else _text_of(_raw(config), config.model_type)


def vision_config(config) -> ModelConfig:
    """A vision–language config's vision tower config."""
    return _cached(_vision_of, config) if isinstance(config, ModelConfig) else _vision_of(_raw(config), config.model_type)


def _deriving(model_type: str):
    def derive(values: dict, raw) -> None:
        """The text model's values as the VLM's own (the sizes, norms and heads every table and
        check reads, under their aliases too), the vision config checked; tie_word_embeddings the
        top-level one's."""
        text = _text_of(raw, model_type)
        _vision_of(raw, model_type)
        for key, value in text.to_dict().items():
            if key not in ("model_type", "architectures", "tie_word_embeddings"):
                values.setdefault(key, value)
        for alias, name in text._schema.aliases.items():  # Qwen3-MoE's num_local_experts
            values.setdefault(alias, values[name])
        values["text_model_type"] = text.model_type
    return derive


def _schema(model_type: str, class_name: str, fields: dict, aliases: dict) -> ConfigSchema:
    common = {"text_config": (DICT.optional(), None), "vision_config": (DICT.optional(), None)}
    return ConfigSchema(model_type, class_name, {**common, **fields}, derive=_deriving(model_type), aliases=aliases)


_GEMMA3_FIELDS = {"tie_word_embeddings": (BOOL.optional(), True), "initializer_range": (FLOAT.optional(), 0.02),
                  "mm_tokens_per_image": (INT.optional(), 256), "boi_token_index": (INT.optional(), 255999),
                  "eoi_token_index": (INT.optional(), 256000), "image_token_index": (INT.optional(), 262144)}
_MISTRAL3_FIELDS = {"tie_word_embeddings": (BOOL, True), "image_token_index": (INT, 10), "projector_hidden_act": (STR, "gelu"), "multimodal_projector_bias": (BOOL, False),
                    "spatial_merge_size": (INT, 2),
                    "vision_feature_layer": (SIZE, -1)}
GEMMA3_SCHEMA = _schema("gemma3", "Gemma3Config", _GEMMA3_FIELDS,
                        {"image_token_id": "image_token_index", "boi_token_id": "boi_token_index", "eoi_token_id": "eoi_token_index"})
MISTRAL3_SCHEMA = _schema("mistral3", "Mistral3Config", _MISTRAL3_FIELDS, {"image_token_id": "image_token_index"})
_QWEN_FIELDS = {"tie_word_embeddings": (BOOL, False), "image_token_id": (INT, 151655), "video_token_id": (INT, 151656),
                "vision_start_token_id": (INT, 151652), "vision_end_token_id": (INT, 151653)}
QWEN2_VL_SCHEMA = _schema("qwen2_vl", "Qwen2VLConfig", _QWEN_FIELDS, {})
_LLAMA4_FIELDS = {"tie_word_embeddings": (BOOL, False), "boi_token_index": (INT, 200080), "eoi_token_index": (INT, 200081),
                  "image_token_index": (INT, 200092)}
LLAMA4_SCHEMA = _schema("llama4", "Llama4Config", _LLAMA4_FIELDS,
                        {"image_token_id": "image_token_index", "boi_token_id": "boi_token_index", "eoi_token_id": "eoi_token_index"})
QWEN2_5_VL_SCHEMA = _schema("qwen2_5_vl", "Qwen2_5_VLConfig", _QWEN_FIELDS, {})
QWEN3_VL_SCHEMA = _schema("qwen3_vl", "Qwen3VLConfig", _QWEN_FIELDS, {})
QWEN3_VL_MOE_SCHEMA = _schema("qwen3_vl_moe", "Qwen3VLMoeConfig", _QWEN_FIELDS, {})


# ---- the tower and the projector --------------------------------------------------------------------

def _side(size_) -> tuple[int, int]:
    return tuple(size_) if isinstance(size_, (list, tuple)) else (size_, size_)


def _vision_width(config) -> int:
    return vision_config(config).hidden_size


def _text_width(config) -> int:
    return text_config(config).hidden_size


def _mistral3_features(config) -> int:
    layers = config.vision_feature_layer
    return _vision_width(config) * (1 if isinstance(layers, int) else len(layers))


def _projector_bias(config) -> bool:
    return config.multimodal_projector_bias


# a projector's MLP (Mistral 3's, Qwen2-VL's): a stack of one layer, its units a group that the streamed passes, which go
# by integer layers, take (`vlm_towers.PROJECTOR_RULES`)
_MLP = "projector/layers/0"
# Gemma3MultiModalProjector: avg-pooled patches -> mm_soft_emb_norm (Gemma's RMSNorm, vision width)
# -> x @ mm_input_projection_weight (vision d, d): a stored (in, out) matrix whose columns write the stream
GEMMA3_PROJECTOR = (
    Tensor("multi_modal_projector.mm_soft_emb_norm.weight", ("projector/norm/scale",), ((_vision_width,),), (None,)),
    Tensor("multi_modal_projector.mm_input_projection_weight", ("projector/out/kernel",), ((_vision_width, _text_width),), (1,)),
)
# Mistral3MultiModalProjector: norm (RMSNorm, vision width) -> patch_merger (s*s patches -> one, vision
# width) -> linear_1 -> GELU -> linear_2, whose output rows (and bias) write the stream
MISTRAL3_PROJECTOR = (
    Tensor("multi_modal_projector.norm.weight", ("projector/norm/scale",), ((_vision_width,),), (None,)),
    Tensor("multi_modal_projector.patch_merger.merging_layer.weight", ("projector/merge/kernel",),
           ((lambda c: _vision_width(c) * c.spatial_merge_size**2, _vision_width),), (None,), TRANSPOSE),
    *linear("multi_modal_projector.linear_1", f"{_MLP}/up", _mistral3_features, _text_width, bias=_projector_bias),
    *linear("multi_modal_projector.linear_2", f"{_MLP}/out", _text_width, _text_width, bias=_projector_bias, writes=True),
)


def _qwen_width(config) -> int:
    v = vision_config(config)
    return v.embed_dim if config.model_type == "qwen2_vl" else v.hidden_size


def _qwen_merged(config) -> int:
    return _qwen_width(config) * vision_config(config).spatial_merge_size ** 2


def _layernorm_merger(config) -> bool:
    return config.model_type == "qwen2_vl"


# The patch merger (Qwen2-VL: a LayerNorm; 2.5: an RMSNorm) -> merge^2 patches side by side -> mlp.0 -> GELU -> mlp.2, whose
# output rows and bias write the stream
QWEN_PROJECTOR = (
    Tensor("visual.merger.ln_q.weight", ("projector/norm/scale",), ((_qwen_width,),), (None,)),
    Tensor("visual.merger.ln_q.bias", ("projector/norm/bias",), ((_qwen_width,),), (None,), when=_layernorm_merger),
    *linear("visual.merger.mlp.0", f"{_MLP}/up", _qwen_merged, _qwen_merged),
    *linear("visual.merger.mlp.2", f"{_MLP}/out", _qwen_merged, _text_width, writes=True),
)


def _qwen3_merger(hf: str, ours: str, norm_width, mlp: str | None = None) -> tuple[Tensor, ...]:
    """A Qwen3-VL patch merger: a LayerNorm (over one patch, or the merged patches side by side)
    -> linear_fc1 -> GELU -> linear_fc2 (leaves under `mlp`, else `ours`), whose output rows and bias write the stream."""
    mlp = mlp or ours
    return (
        Tensor(f"{hf}.norm.weight", (f"{ours}/norm/scale",), ((norm_width,),), (None,)),
        Tensor(f"{hf}.norm.bias", (f"{ours}/norm/bias",), ((norm_width,),), (None,)),
        *linear(f"{hf}.linear_fc1", f"{mlp}/up", _qwen_merged, _qwen_merged),
        *linear(f"{hf}.linear_fc2", f"{mlp}/out", _qwen_merged, _text_width, writes=True),
    )


QWEN3_PROJECTOR = _qwen3_merger("model.visual.merger", "projector", _qwen_width, mlp=_MLP)
# the DeepStack mergers' outputs are added to the image tokens' hidden states after text layer k: linear_fc2 writes the stream
_DEEPSTACK_WRITERS = ((r"projector/deepstack/\d+/out/kernel", 1), (r"projector/deepstack/\d+/out/bias", 0))


def qwen3_deepstack(config) -> tuple[Tensor, ...]:
    """Qwen3-VL's DeepStack mergers, one per deepstack_visual_indexes entry, each normed over the
    merged patches side by side."""
    count = len(vision_config(config).deepstack_visual_indexes)
    return tuple(t for k in range(count)
                 for t in _qwen3_merger(f"model.visual.deepstack_merger_list.{k}", f"projector/deepstack/{k}", _qwen_merged))


# Llama 4's pixel-shuffle adapter (Llama4VisionMLP2: fc1 -> GELU -> fc2 -> GELU, no biases, inside its tower) and
# Llama4MultiModalProjector (one linear map without a bias, vision_output_dim -> d, whose output rows write the stream): one
# chain of two GELU MLPs, read as the projector's (`vlm_towers.LLAMA4_PROJECTOR_RULES`)
LLAMA4_PROJECTOR = (
    *linear("vision_model.vision_adapter.mlp.fc1", f"{_MLP}/up", lambda c: vision_config(c).intermediate_size,
            lambda c: vision_config(c).projector_input_dim, bias=False),
    *linear("vision_model.vision_adapter.mlp.fc2", f"{_MLP}/mid", lambda c: vision_config(c).projector_output_dim,
            lambda c: vision_config(c).projector_output_dim, bias=False),
    *linear("multi_modal_projector.linear_1", f"{_MLP}/out", lambda c: vision_config(c).vision_output_dim, _text_width, bias=False, writes=True),
)


def _lm(name: str) -> Head:
    """The one class read: the whole model with its LM head `name` (saved where untied)."""
    return Head("lm", "ForConditionalGeneration",
                tuple(dataclasses.replace(t, when=lambda c: not is_tied(c))
                      for t in linear(name, "lm_head", "hidden_size", "vocab_size", bias=False, reads=True)),
                markers=(f"{name}.weight",), tied=lambda c: {f"{name}.weight": "embeddings/word/embedding"} if is_tied(c) else {})


LM = _lm("language_model.lm_head")
_OFF_STREAM = ((r"vision/.*", None), (r"projector/.*", None))


@dataclasses.dataclass(frozen=True)
class VisionLanguageFamily(Family):
    """A `Family` of three parts: `text` (the language tower's record, its tensors under
    `language_model.model.`, its LM head `LM`), `projector` (whole-model names; the leaves on the
    stream move with it) and the vision tower (`tower(vision config)`: its tensors named inside
    it, read under the first of `tower_prefixes` the checkpoint holds `tower_marker` under).
    Every table of the text record is evaluated on the text config (`text_config`)."""

    text: Family | None = None
    projector: tuple[Tensor, ...] = ()
    tower: Callable[[ModelConfig], tuple[Tensor, ...]] = lambda v: ()
    tower_prefixes: tuple[str, ...] = ("vision_tower.",)
    tower_marker: str = ""
    # a batch of images for transformers' class: (its image inputs, the tokens of one image)
    images: Callable[[ModelConfig, Any, int], tuple[dict, int]] = lambda config, rng, batch: ({}, 0)
    image_token: str = "image_token_index"  # the config attribute of the image token's id
    start_token: str | None = None  # the config attribute of the token before an image's (Qwen's vision_start)
    type_ids: bool = False  # whether the class reads each token's modality (`mm_token_type_ids`: 1 an image's, 0 text)
    # projector tensors as many as the config says (Qwen3-VL's DeepStack mergers), and the rules of their leaves on the stream
    more_projector: Callable[[ModelConfig], tuple[Tensor, ...]] = lambda config: ()
    more_writers: tuple[tuple[str, int], ...] = ()
    stacked: bool = False  # a mixture's experts always stored stacked (transformers reads Qwen3-VL-MoE's no other way)
    # the tower's groups (`vlm_towers.Tower`: their rules, each block's geometry from the vision config) and the projector's
    tower_rules: tuple = ()
    tower_heads: Callable[[ModelConfig], dict] = lambda v: {}
    projector_rules: tuple = ()
    # the tower's own stream (`Tower.stream`), a second stream of the model, and the projector's leaves on it (regex, axis)
    tower_stream: Callable[[ModelConfig], Any] | None = None
    projector_on_tower: tuple = ()

    def example_inputs(self, config, rng, batch: int = 2) -> dict:
        """A batch for transformers' class: each row one image's tokens (`image_tokens` of them,
        where the model puts its features) amid random text, and the images."""
        vocab, image = text_config(config).vocab_size, getattr(config, self.image_token)
        images, tokens = self.images(config, rng, batch)
        ids = rng.integers(0, vocab, size=(batch, tokens + 4))
        special = [image] + ([getattr(config, self.start_token)] if self.start_token else [])
        ids[np.isin(ids, special)] = next(t for t in range(vocab) if t not in special)
        ids[:, 2:2 + tokens] = image
        if self.start_token:
            ids[:, 1] = special[1]
        types = {"mm_token_type_ids": (ids == image).astype(np.int64)} if self.type_ids else {}
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), **types, **images}

    def _extras(self, config, layout: Layout) -> list[tuple[Tensor, ModelConfig]]:
        tower = getattr(layout, "tower", self.tower_prefixes[-1])
        return ([(t, config) for t in (*self.projector, *self.more_projector(config)) if t.present(config)]
                + [(dataclasses.replace(t, hf=tower + t.hf), config) for t in self.tower(vision_config(config))])

    def _text_layout(self, layout: Layout) -> Layout:
        return dataclasses.replace(layout, stacked_experts=True) if self.stacked and not layout.stacked_experts else layout

    def tensors(self, config, layout: Layout, limit: int | None = None) -> list[TensorRule]:
        rules = self.text.tensors(text_config(config), self._text_layout(layout), limit)
        transposed = getattr(layout, "transposed_experts", ())
        if transposed:
            rules = [_transposed(r) if ".mlp.experts." in r.hf and r.hf.rsplit(".", 1)[-1] in transposed else r for r in rules]
        for t, c in self._extras(config, layout):
            rules += t.rules(c, "", in_base=False)
            if limit is not None and len(rules) > limit:
                raise InputError(f"its config implies more than {limit} tensors, far more than the checkpoint holds: the config does not "
                                 "describe these weights (its vision tower's layers?)")
        return rules

    def shapes(self, config, layout: Layout) -> dict[str, tuple[int, ...]]:
        out = self.text.shapes(text_config(config), self._text_layout(layout))
        for t, c in self._extras(config, layout):
            out.update(t.leaf_shapes(c))
        return out

    def tied(self, config, layout: Layout) -> dict[str, str]:
        return self.text.tied(text_config(config), layout)

    def detect(self, names: set[str], config, shapes: Callable[[str], tuple | None] | None = None) -> Layout:
        stem = self.stems[config.model_type]
        architectures = list(getattr(config, "architectures", None) or ())
        lm = self.heads[0]
        wanted = stem + lm.suffix
        if architectures and architectures[0] != wanted:
            raise InputError(f"config.json names {architectures[0]}; rotsym_jax reads {config.model_type} checkpoints as {wanted} only")
        if self.prefix + self.marker not in names:
            raise InputError(f"no tensor {self.prefix + self.marker}: a {wanted} checkpoint as transformers writes it holds its text model "
                             f"under {self.prefix!r}")
        tower = next((p for p in self.tower_prefixes if p + self.tower_marker in names), None)
        if tower is None:
            raise InputError(f"no vision tower: none of {[p + self.tower_marker for p in self.tower_prefixes]} is in the checkpoint")
        transposed = self._transposed_experts(config, shapes) if self.stacked and shapes is not None else ()
        return TowerLayout(prefix=self.prefix, head=lm.name, tower=tower, stacked_experts=self.stacked, transposed_experts=transposed)

    def _transposed_experts(self, config, shapes: Callable[[str], tuple | None]) -> tuple[str, ...]:
        """The stacked expert tensors stored (E, in, out), as Qwen's releases store them: each
        whose stored shape (in the first sparse layer) is not transformers' own (E, out, in) but its
        transpose. transformers reads each tensor so, its own shape first (where in = out)."""
        text = text_config(config)
        i = next((i for i in range(text.num_hidden_layers) if sparse_layer(text, i)), None)
        if i is None:
            return ()
        e, f, d = text.num_experts, text.moe_intermediate_size, text.hidden_size
        own = {"gate_up_proj": (e, 2 * f, d), "down_proj": (e, d, f)}
        stored = {name: shapes(f"{self.prefix}layers.{i}.mlp.experts.{name}") for name in own}
        return tuple(n for n, shape in own.items() if stored[n] != shape and stored[n] == (e, shape[2], shape[1]))

    def check_layout(self, config, layout: Layout) -> None:
        if layout.head != self.heads[0].name or layout.prefix != self.prefix or layout.pooler:
            raise InputError(f"{self.name}: only {self.stems[config.model_type]}{self.heads[0].suffix} is read (head 'lm' under {self.prefix!r})")

    def base_prefix(self, config, head: str | None) -> str:
        return self.prefix

    def check(self, config) -> None:
        self.text.check(text_config(config))

    def residual_spec(self, config=None, layout: Layout | None = None):
        text = self.text.residual_spec(None if config is None else text_config(config), layout)
        onto = list(self.more_writers)
        for t in self.projector:
            for path, axis in zip(t.ours, t.stream):
                if axis is not None:
                    onto.append((re.escape(path), axis))
        text = dataclasses.replace(text, rules=(*onto, *text.rules, *_OFF_STREAM))
        if config is None or self.tower_stream is None:
            return text
        vision = self.tower_stream(vision_config(config))
        return text, dataclasses.replace(vision, rules=(*self.projector_on_tower, *vision.rules))

    def spec(self, config, layout: Layout | None = None) -> Spec:
        """The text model's groups, the tower's (its blocks beside the text model's) and the projector's."""
        text = self.text.spec(text_config(config), layout)
        return dataclasses.replace(text, rules=(*self.tower_rules, *self.projector_rules, *_OFF_STREAM, *text.rules),
                                   heads={**text.heads, **self.tower_heads(vision_config(config))}, residual=self.residual_spec(config, layout))


def _transposed(rule: TensorRule) -> TensorRule:
    """A stacked expert tensor stored (E, in, out): swapped to transformers' (E, out, in) as read, back as written."""
    return dataclasses.replace(rule, to_ours=lambda a: rule.to_ours(np.swapaxes(a, 1, 2)), to_hf=lambda t: np.swapaxes(rule.to_hf(t), 1, 2))


def _square_images(config, rng, batch: int, tokens: int, sizes: bool = False) -> tuple[dict, int]:
    v = vision_config(config)
    side = _side(v.image_size)
    images = {"pixel_values": rng.normal(size=(batch, v.num_channels, *side)).astype(np.float32)}
    if sizes:
        images["image_sizes"] = np.array([side] * batch, np.int64)
    return images, tokens


def _gemma3_images(config, rng, batch: int) -> tuple[dict, int]:
    return _square_images(config, rng, batch, config.mm_tokens_per_image)


def _mistral3_images(config, rng, batch: int) -> tuple[dict, int]:
    """Mistral 3: one token per spatial_merge_size^2 patches."""
    v, merge = vision_config(config), config.spatial_merge_size
    (ih, iw), (ph, pw) = _side(v.image_size), _side(v.patch_size)
    return _square_images(config, rng, batch, (ih // ph // merge) * (iw // pw // merge), sizes=True)


def _llama4_images(config, rng, batch: int) -> tuple[dict, int]:
    """Llama 4: one image a row, pixel_shuffle_ratio^2 tokens per patch (the class token dropped)."""
    v = vision_config(config)
    (ih, iw), (ph, pw) = _side(v.image_size), _side(v.patch_size)
    return _square_images(config, rng, batch, round((ih // ph) * (iw // pw) * v.pixel_shuffle_ratio**2))


def _qwen_images(config, rng, batch: int) -> tuple[dict, int]:
    """Qwen2-VL: each image 2 x 2 merged patches (a grid of 1 x 2m x 2m), given as its patches flattened."""
    v = vision_config(config)
    m = v.spatial_merge_size
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2
    return {"pixel_values": rng.normal(size=(batch * 4 * m * m, patch)).astype(np.float32),
            "image_grid_thw": np.array([[1, 2 * m, 2 * m]] * batch, np.int64)}, 4


def _vlm(name: str, schema: ConfigSchema, stem: str, text: Family, projector, tower, *, lm: Head = LM, text_prefix: str = _TEXT_PREFIX,
         **more) -> VisionLanguageFamily:
    """The family of a VLM of `text`'s language model, `projector` and the vision `tower` (a `Tower`, or its tables alone);
    `more`: the other fields of `VisionLanguageFamily` (`tower_prefixes`, `tower_marker`, `images`, ...)."""
    view = dataclasses.replace(text, prefix=text_prefix, heads=(lm,), default_head=lm.name)
    if isinstance(tower, Tower):
        more.update(tower_rules=tower.rules, tower_heads=tower.heads, tower_stream=tower.stream)
        tower = tower.tables
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(Family)}
    fields.update(name=name, configs=(schema,), stems={schema.model_type: stem}, prefix=text_prefix, heads=(lm,), default_head=lm.name,
                  class_names={}, forward=False, head_geometry=lambda config: text.head_geometry(text_config(config)))
    return VisionLanguageFamily(**fields, text=view, projector=projector, tower=tower, **more)


GEMMA3_VLM = _vlm("gemma3_vlm", GEMMA3_SCHEMA, "Gemma3", GEMMA3, GEMMA3_PROJECTOR, SIGLIP_TOWER,
                  tower_prefixes=("vision_tower.vision_model.", "vision_tower."), tower_marker="embeddings.patch_embedding.weight",
                  images=_gemma3_images,
                  # the pooled image features' norm (its gain, each channel's) and the projection's input rows: on the tower's stream
                  projector_on_tower=((r"projector/norm/scale", 0), (r"projector/out/kernel", 0)))
MISTRAL3 = _vlm("mistral3", MISTRAL3_SCHEMA, "Mistral3", LLAMA, MISTRAL3_PROJECTOR, PIXTRAL_TOWER, tower_prefixes=("vision_tower.",),
                tower_marker="patch_conv.weight", images=_mistral3_images, projector_rules=PROJECTOR_RULES)
_QWEN_IMAGES = dict(images=_qwen_images, image_token="image_token_id", start_token="vision_start_token_id", type_ids=True, lm=_lm("lm_head"))
QWEN2_VL = _vlm("qwen2_vl", QWEN2_VL_SCHEMA, "Qwen2VL", LLAMA, QWEN_PROJECTOR, QWEN2_VL_TOWER, tower_prefixes=("visual.",),
                tower_marker="patch_embed.proj.weight", text_prefix="model.", projector_rules=PROJECTOR_RULES, **_QWEN_IMAGES)
QWEN2_5_VL = _vlm("qwen2_5_vl", QWEN2_5_VL_SCHEMA, "Qwen2_5_VL", LLAMA, QWEN_PROJECTOR, QWEN2_5_VL_TOWER, tower_prefixes=("visual.",),
                  tower_marker="patch_embed.proj.weight", text_prefix="model.", projector_rules=PROJECTOR_RULES, **_QWEN_IMAGES)
_QWEN3 = dict(tower=QWEN3_VL_TOWER, tower_prefixes=("model.visual.",), tower_marker="patch_embed.proj.weight", text_prefix="model.language_model.",
              more_projector=qwen3_deepstack, more_writers=_DEEPSTACK_WRITERS, projector_rules=(*PROJECTOR_RULES, *DEEPSTACK_RULES), **_QWEN_IMAGES)
QWEN3_VL = _vlm("qwen3_vl", QWEN3_VL_SCHEMA, "Qwen3VL", LLAMA, QWEN3_PROJECTOR, **_QWEN3)
QWEN3_VL_MOE = _vlm("qwen3_vl_moe", QWEN3_VL_MOE_SCHEMA, "Qwen3VLMoe", LLAMA, QWEN3_PROJECTOR, stacked=True, **_QWEN3)
LLAMA4 = _vlm("llama4", LLAMA4_SCHEMA, "Llama4", LLAMA4_TEXT, LLAMA4_PROJECTOR, LLAMA4_TOWER, tower_prefixes=("vision_model.",),
              tower_marker="patch_embedding.linear.weight", images=_llama4_images, projector_rules=LLAMA4_PROJECTOR_RULES)
