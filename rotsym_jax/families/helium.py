"""Helium (kyutai): Llama's pre-RMSNorm decoder (grouped-query attention, a SwiGLU MLP) with RoPE
over the whole head in the interleaved layout (pairs (2i, 2i + 1): its `rotate_half` takes
x[..., 0::2] and x[..., 1::2], the frequencies repeat_interleave'd over each pair), q/k/v biases
with `attention_bias` (o_proj never has one), MLP biases with `mlp_bias`, an untied LM head by
default, and sequence and token classifiers.

Our q and k kernels (and biases) hold each head's entries in the rotate_half order (pairs
(i, i + dh/2)) that the Llama forward pass and the attention solvers use: the loader reorders them
(`family.interleaved_projection`, as Cohere's and Llama 4's), the saver restores Helium's. The same
reordering of q and of k leaves every score as it was, and RoPE on the reordered entries is
Helium's RoPE reordered, so the groups are Llama's.

Leaves: Llama's (`families/llama/`), no attention/out/bias. transformers builds o_proj as
(hidden_size, hidden_size): a config whose heads * head_dim is not hidden_size does not run there
and is refused on load.
"""

from __future__ import annotations

import dataclasses

from ..errors import InputError
from .config import BOOL, FLOAT, INT, positive_ints
from .family import Tensor, interleaved_projection
from .llama import LLAMA
from .llama._config import biases_of, head_dim_of, kv_width, q_width, resolve_layer_types, rope_parameters_of, schema, sizes
from .llama._tensors import HEADS, LAYER

_A = "layers.{i}.self_attn"


def _qkv_bias(config) -> bool:
    return biases_of(config)[0]


def interleaved_layer(layer: tuple[Tensor, ...] = LAYER) -> tuple[Tensor, ...]:
    """Llama's layer table with q_proj and k_proj read through `interleaved_projection` (their
    pairs (2i, 2i + 1) reordered into the rotate_half order, RoPE over the whole head)."""
    rotated = (
        *interleaved_projection(f"{_A}.q_proj", "layers/{i}/attention/query", "num_attention_heads", head_dim_of, head_dim_of, q_width, bias=_qkv_bias),
        *interleaved_projection(f"{_A}.k_proj", "layers/{i}/attention/key", "num_key_value_heads", head_dim_of, head_dim_of, kv_width, bias=_qkv_bias),
    )
    return tuple(t for t in layer if not t.hf.startswith((f"{_A}.q_proj.", f"{_A}.k_proj."))) + rotated


def _derive(values: dict, raw) -> None:
    """HeliumConfig: RoPE theta 100000 by default; no layer types; the attention output read by
    o_proj (hidden_size, hidden_size), so heads * head_dim must be hidden_size."""
    values["rope_parameters"] = rope_parameters_of(values, raw, default_theta=100000.0)
    resolve_layer_types(values, raw.get("layer_types"), supported=False)
    if positive_ints(values, "num_attention_heads", "head_dim", "hidden_size"):
        width = values["num_attention_heads"] * values["head_dim"]
        if width != values["hidden_size"]:
            raise InputError(f"num_attention_heads * head_dim = {values['num_attention_heads']} * {values['head_dim']} = {width} is not "
                             f"hidden_size={values['hidden_size']}: Helium's o_proj reads hidden_size entries (transformers fails on it)")


HELIUM = dataclasses.replace(
    LLAMA,
    name="helium",
    configs=(
        schema("helium", "HeliumConfig", {
            **sizes(48000, 2560, 7040, 24, 20), "num_key_value_heads": (INT, 20), "head_dim": (INT, 128),
            "max_position_embeddings": (INT, 4096), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-8),
            "pad_token_id": (INT.optional(), 3), "attention_bias": (BOOL, False), "mlp_bias": (BOOL, False),
        }, derive=_derive),
    ),
    stems={"helium": "Helium"},
    layer=interleaved_layer(),
    heads=tuple(h for h in HEADS if h.name in ("lm", "sequence_classification", "token_classification")),
    rotary="rotate_half",  # as our leaves hold it (the loader reorders Helium's pairs)
    ignored=(),
)
