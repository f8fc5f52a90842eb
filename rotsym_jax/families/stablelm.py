"""StableLM (StableLM-3B-4E1T, StableLM 2): a LayerNorm decoder with partial rotary embeddings, a
SwiGLU MLP, and either a norm before each sublayer (sequential, the default) or attention and MLP
reading one norm and both adding to the stream (`use_parallel_residual`).

Leaves (d = hidden_size, f = intermediate_size, H = heads, G = kv heads, dh = d // H):
    embeddings/word/embedding        (vocab_size, d)     model.embed_tokens
    layers/{i}/attention_norm/{scale,bias}   (d,)     input_layernorm
    layers/{i}/attention/query/kernel (d, H dh), key, value (d, G dh), biases with use_qkv_bias
    layers/{i}/attention/out/kernel  (H dh, d), no bias      self_attn.o_proj
    layers/{i}/mlp_norm/{scale,bias}         (d,)     post_attention_layernorm (sequential only)
    layers/{i}/mlp/{gate,up}/kernel (d, f), layers/{i}/mlp/down/kernel (f, d), no biases
    final_norm/{scale,bias}          (d,)     model.norm
    task heads (all run here):
        lm                       StableLmForCausalLM: lm_head/kernel (d, V) (the embedding where tied)
        sequence_classification  head/score (d, num_labels), no bias, on the last non-padding token
        token_classification     head/token_classifier (d, num_labels), HF score
RoPE: rotate_half on the first dh * partial_rotary_factor entries of each head (0.25 by default).
qk_layernorm (StableLM 2 12B: a LayerNorm per head on q and k, each head's own gains) is refused on
load.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from .config import BOOL, DICT, FLOAT, INT, STR, ConfigSchema
from .family import Family, Norm, attention_projections, embedding, gated_mlp, norm, pre_norm_folds
from .llama._config import head_geometry_of, resolve_layer_types, rope_parameters_of, sizes
from .phi import CLASSIFIER_HEADS, LM_HEAD, kv_width


def _qkv_bias(config) -> bool:
    return config.use_qkv_bias


def _sequential(config) -> bool:
    return not config.use_parallel_residual


_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm"),
    *attention_projections("layers.{i}.self_attn", "layers/{i}/attention", "hidden_size", kv_width, bias=_qkv_bias),
    *(dataclasses.replace(t, when=_sequential) for t in norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm")),
    *gated_mlp("layers.{i}.mlp", "layers/{i}/mlp"),
)


_HEADS = (LM_HEAD, *CLASSIFIER_HEADS)

_SEQUENTIAL_FOLDS = pre_norm_folds("(up|gate)", r"(lm_head|head/(score|token_classifier))")
# A parallel layer's one norm is read by Q/K/V and by the MLP's gate and up projections.
_PARALLEL_FOLDS = ((_SEQUENTIAL_FOLDS[0][0], r"layers/\1/(attention/(query|key|value)|mlp/(up|gate))/kernel"), _SEQUENTIAL_FOLDS[2])


def _folds(config):
    """The folds of `config`'s layers (without a config: the default, sequential ones)."""
    return _PARALLEL_FOLDS if config is not None and config.use_parallel_residual else _SEQUENTIAL_FOLDS


def _derive(values: dict, raw) -> None:
    """StableLmConfig: partial_rotary_factor 0.25 unless given."""
    values["rope_parameters"] = rope_parameters_of(values, raw)
    values["rope_parameters"].setdefault("partial_rotary_factor", 0.25)
    resolve_layer_types(values, raw.get("layer_types"), supported=False)


SCHEMA = ConfigSchema("stablelm", "StableLmConfig", {
    **sizes(50304, 2560, 6912, 32, 32), "num_key_value_heads": (INT, 32), "hidden_act": (STR, "silu"),
    "max_position_embeddings": (INT, 4096), "initializer_range": (FLOAT, 0.02), "layer_norm_eps": (FLOAT, 1e-5),
    "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None), "use_qkv_bias": (BOOL, False),
    "qk_layernorm": (BOOL, False), "use_parallel_residual": (BOOL, False), "pad_token_id": (INT.optional(), None),
}, derive=_derive, consumed=("rope_scaling", "rope_theta", "partial_rotary_factor"))


STABLELM = Family(
    name="stablelm",
    configs=(SCHEMA,),
    stems={"stablelm": "StableLm"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("norm", "final_norm"),
    heads=_HEADS,
    default_head="lm",  # a tied *ForCausalLM stores no lm_head.weight
    norm=Norm("layernorm", placement="pre", folds=_folds),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.phi.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry_of,
    unsupported=(("qk_layernorm", "a LayerNorm on each head's q and k with each head's own gains"),),
    ignored=(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq",),
)
