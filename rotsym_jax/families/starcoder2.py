"""StarCoder2: a sequential pre-LayerNorm decoder (a norm before attention, another before the MLP,
both with biases), grouped-query attention with RoPE over the whole head (rotate_half), q/k/v/o
biases and a GELU MLP (`c_fc`, `c_proj`) with biases, all of them with `use_bias` (the norms keep
theirs), a sliding window over every layer where `sliding_window` is set, and an LM head without
a bias, tied to the embedding by default.

Leaves (d = hidden_size, f = intermediate_size, H = heads, G = kv heads, dh = head_dim or d // H):
    embeddings/word/embedding        (vocab_size, d)     model.embed_tokens
    layers/{i}/attention_norm/{scale,bias}   (d,)     input_layernorm
    layers/{i}/attention/query/kernel (d, H dh), key, value (d, G dh), biases with use_bias
    layers/{i}/attention/out/kernel  (H dh, d), .../bias (d,) with use_bias     self_attn.o_proj
    layers/{i}/mlp_norm/{scale,bias}         (d,)     post_attention_layernorm
    layers/{i}/mlp/up/kernel (d, f), .../bias (f,) with use_bias      mlp.c_fc
    layers/{i}/mlp/down/kernel (f, d), .../bias (d,) with use_bias    mlp.c_proj
    final_norm/{scale,bias}          (d,)     model.norm
    task heads (all run here):
        lm                       Starcoder2ForCausalLM: lm_head/kernel (d, V), no bias (the embedding where tied)
        sequence_classification  head/score (d, num_labels), no bias, on the last non-padding token
        token_classification     head/token_classifier (d, num_labels), HF score
RoPE: rotate_half over the whole head, as Llama's rope types compute it (transformers' StarCoder2
ignores a partial_rotary_factor with the default rope type: refused on load, as for Llama).
The dropouts (embedding, residual, attention) do not act at inference.
"""

from __future__ import annotations

import dataclasses

from .config import BOOL, DICT, FLOAT, INT, STR, ConfigSchema
from .family import Norm, attention_projections, linear, norm, pre_norm_folds
from .llama._config import head_dim_of, rope_parameters_of, sizes
from .phi import CLASSIFIER_HEADS, LM_HEAD
from .stablelm import STABLELM


def _q_width(config) -> int:
    return config.num_attention_heads * head_dim_of(config)


def _kv_width(config) -> int:
    return config.num_key_value_heads * head_dim_of(config)


def _bias(config) -> bool:
    return config.use_bias


_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm"),
    *attention_projections("layers.{i}.self_attn", "layers/{i}/attention", _q_width, _kv_width, bias=_bias, out_bias=_bias),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm"),
    *linear("layers.{i}.mlp.c_fc", "layers/{i}/mlp/up", "hidden_size", "intermediate_size", bias=_bias, reads=True),
    *linear("layers.{i}.mlp.c_proj", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", bias=_bias, writes=True),
)


_HEADS = (LM_HEAD, *CLASSIFIER_HEADS)

# Each norm folds into its readers: the attention norm into Q/K/V, the MLP norm into c_fc.
_FOLDS = pre_norm_folds("up", r"(lm_head|head/(score|token_classifier))")


def _derive(values: dict, raw) -> None:
    """Starcoder2Config: RoPE parameters from the legacy rope_theta / rope_scaling (theta 10000)."""
    values["rope_parameters"] = rope_parameters_of(values, raw)


SCHEMA = ConfigSchema("starcoder2", "Starcoder2Config", {
    **sizes(49152, 3072, 12288, 30, 24), "num_key_value_heads": (INT, 2), "hidden_act": (STR, "gelu_pytorch_tanh"),
    "max_position_embeddings": (INT, 4096), "initializer_range": (FLOAT, 0.018042), "norm_epsilon": (FLOAT, 1e-5),
    "pad_token_id": (INT.optional(), None), "rope_parameters": (DICT.optional(), None), "sliding_window": (INT.optional(), None),
    "use_bias": (BOOL, True), "tie_word_embeddings": (BOOL, True),
}, derive=_derive, consumed=("rope_scaling", "rope_theta", "partial_rotary_factor"))


# StableLM's record (sequential LayerNorm layers, its heads, its forward pass) with its own tensors
STARCODER2 = dataclasses.replace(
    STABLELM,
    name="starcoder2",
    configs=(SCHEMA,),
    stems={"starcoder2": "Starcoder2"},
    layer=_LAYER,
    heads=_HEADS,
    norm=Norm("layernorm", placement="pre", folds=_FOLDS),
    unsupported=(),
)
