"""OLMo 1 (allenai/OLMo-1B-hf, OLMo-7B-hf): Llama's pre-norm decoder, SwiGLU MLP and RoPE with a
LayerNorm that holds no parameters at all (`OlmoLayerNorm`: no gain, no bias, eps 1e-5) before
each sublayer and after the last layer.

Leaves (d = hidden_size, f = intermediate_size, H = heads, G = kv heads, dh = d // H):
    embeddings/word/embedding        (vocab_size, d)     model.embed_tokens
    layers/{i}/attention/query/kernel (d, H dh), key, value (d, G dh), out (H dh, d);
        biases on all four with attention_bias                self_attn.{q,k,v,o}_proj
    layers/{i}/mlp/{gate,up}/kernel (d, f), layers/{i}/mlp/down/kernel (f, d), no biases
    task heads (both run here):
        lm                       OlmoForCausalLM: lm_head/kernel (d, V) (the embedding where tied)
        sequence_classification  head/score (d, num_labels), no bias, on the last non-padding token
The norms have nothing to fold; as they centre the width, the stream takes rotations fixing the
ones vector. clip_qkv (q, k and v clamped elementwise: no rotation of V commutes with it) is
refused on load, as OLMoE's record does.
"""

from __future__ import annotations

import dataclasses

from ..errors import InputError
from .config import BOOL, DICT, FLOAT, INT, STR, ConfigSchema, positive_ints
from .family import Norm
from .llama import LLAMA
from .llama._config import rope_parameters_of, sizes
from .llama._tensors import HEADS, LAYER


def _derive(values: dict, raw) -> None:
    """OlmoConfig: num_key_value_heads defaults to the heads; the head is hidden_size / heads."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters_of(values, raw)
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if positive_ints(values, "hidden_size", "num_attention_heads") and hidden % heads:
        raise InputError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (OLMo's heads are hidden_size / heads wide)")


SCHEMA = ConfigSchema("olmo", "OlmoConfig", {
    **sizes(50304, 4096, 11008, 32, 32), "num_key_value_heads": (INT.optional(), None), "hidden_act": (STR, "silu"),
    "max_position_embeddings": (INT, 2048), "initializer_range": (FLOAT, 0.02), "pad_token_id": (INT.optional(), 1),
    "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None), "attention_bias": (BOOL, False),
    "clip_qkv": (FLOAT.optional(), None),
}, derive=_derive, consumed=("rope_scaling", "rope_theta"))


# Llama's layer without its norms' gains (OLMo's norms hold none); no final norm tensor either
OLMO = dataclasses.replace(
    LLAMA,
    name="olmo",
    configs=(SCHEMA,),
    stems={"olmo": "Olmo"},
    layer=tuple(t for t in LAYER if not t.hf.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))),
    final=(),
    heads=tuple(h for h in HEADS if h.name in ("lm", "sequence_classification")),
    norm=Norm("layernorm", placement="pre"),
    # a clamp of q, k and v elementwise: permutations and sign flips commute with it, V's rotations do not
    unsupported=(("clip_qkv", "q, k and v clamped elementwise, which no rotation of V commutes with"),),
)
