"""ERNIE 4.5 (Baidu's dense models, e.g. ERNIE-4.5-0.3B): Llama's pre-RMSNorm decoder (grouped-query
attention, a SwiGLU MLP) with RoPE over the whole head in the interleaved layout (pairs
(2i, 2i + 1), GLM's `rotate_half`, the frequencies repeat_interleave'd over each pair), a bias on
every projection (q/k/v/o and the MLP's) with `use_bias`, head_dim 128 unless null (then
hidden_size / heads), and a causal LM head tied to the embedding by default.

Our q and k kernels (and biases) hold each head's entries in the rotate_half order: the loader
reorders them (`helium.interleaved_layer`), the saver restores ERNIE's; the groups and the
forward pass are Llama's. Leaves: Llama's (`families/llama/`).
"""

from __future__ import annotations

import dataclasses

from ..errors import InputError
from .config import BOOL, FLOAT, INT, positive_ints
from .helium import interleaved_layer
from .llama import LLAMA
from .llama._config import is_odd_rope_dim, resolve_layer_types, rope_parameters_of, schema, sizes
from .llama._tensors import HEADS


def _derive(values: dict, raw) -> None:
    """Ernie4_5Config.__post_init__: num_key_value_heads and head_dim, where null, the heads and
    hidden_size / heads; RoPE theta 500000 by default; no layer types."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values["head_dim"] is None and positive_ints(values, "hidden_size", "num_attention_heads"):
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if is_odd_rope_dim(values["head_dim"]):
        raise InputError(f"head_dim={values['head_dim']}: RoPE needs an even head dimension")
    values["rope_parameters"] = rope_parameters_of(values, raw, default_theta=500000.0)
    resolve_layer_types(values, raw.get("layer_types"), supported=False)


ERNIE4_5 = dataclasses.replace(
    LLAMA,
    name="ernie4_5",
    configs=(
        schema("ernie4_5", "Ernie4_5Config", {
            **sizes(103424, 1024, 3072, 18, 16), "num_key_value_heads": (INT.optional(), 2), "head_dim": (INT.optional(), 128),
            "max_position_embeddings": (INT, 131072), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
            "pad_token_id": (INT.optional(), 0), "tie_word_embeddings": (BOOL, True), "use_bias": (BOOL.optional(), False),
        }, derive=_derive),
    ),
    stems={"ernie4_5": "Ernie4_5"},
    layer=interleaved_layer(),
    heads=tuple(h for h in HEADS if h.name == "lm"),
    rotary="rotate_half",  # as our leaves hold it (the loader reorders ERNIE's pairs)
    ignored=(),
)
