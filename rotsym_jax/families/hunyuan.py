"""HunYuan dense (Tencent's Hunyuan-7B / 4B / 1.8B / 0.5B, model_type hunyuan_v1_dense): Llama's
pre-RMSNorm decoder (grouped-query attention, a SwiGLU MLP without biases, RoPE over the whole head in
the rotate_half layout) with an RMSNorm over each head's q and k, one gain of head_dim entries for
all heads, applied AFTER RoPE (`query_layernorm(rope(q))`, Qwen3's comes before it); q/k/v/o biases
with `attention_bias`; an LM head untied by default, and a sequence classifier.

The groups are Qwen3's (`HeadGeometry.qk_norm="head"`): Q/K keeps what commutes with RoPE, the
per-head RMS and the shared gains, which is the sign flips of whole rotary pairs (a turn by pi of a
pair: it commutes with every RoPE angle, keeps the RMS, and multiplies a pair's two gains alike),
with the head permutations (one gain for every head) and no scale (the RMS erases it only up to its
eps). A pair's other rotations commute with RoPE and the RMS but not with its gains unless the pair's
two are equal, which no record can assume; a single entry's flip is a reflection, which RoPE does
not commute with. VO, the FFN units and the stream are Llama's. The forward pass is Llama's with the
norm moved after RoPE (`nets.layers.QKNorm.after_rope`).

RoPE: "default", "linear", "llama3", and the checkpoints' "dynamic" with a fixed `alpha`, which
transformers runs as a static base theta * alpha^(dh / (dh - 2)) ("ntk_alpha"); "dynamic" without
alpha (frequencies that change with the sequence length) is read, aligned, merged and saved but not
run, as Llama's record does with it (the groups do not depend on the frequencies).
A null head_dim (the config class's default) is read as hidden_size / heads, as transformers' RoPE
init takes it (reading, aligning, merging and saving need no more), but not run: HunYuanDenseV1Attention
takes config.head_dim as it is, and transformers fails on it.

Leaves: Llama's and Qwen3's (`families/llama/`): `layers/{i}/attention/{query,key}_norm/scale` (dh,)
are HF's self_attn.query_layernorm and key_layernorm.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from .config import BOOL, FLOAT, INT, check_number
from .family import norm
from .llama import LLAMA
from .llama._config import head_dim_of, is_odd_rope_dim, resolve_layer_types, rope_parameters_of, schema, sizes
from .llama._tensors import HEADS, LAYER

_A = "layers.{i}.self_attn"


def _derive(values: dict, raw) -> None:
    """HunYuanDenseV1Config.__post_init__: kv heads default to the heads; a RoPE alpha a positive
    number (the forward pass refuses what it does not run: a null head_dim, "dynamic" RoPE without alpha)."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    head_dim = values["head_dim"]
    if is_odd_rope_dim(head_dim):
        raise InputError(f"head_dim={head_dim}: RoPE needs an even head dimension")
    resolve_layer_types(values, raw.get("layer_types"), supported=False)
    params = values["rope_parameters"] = rope_parameters_of(values, raw)
    if params["rope_type"] == "dynamic" and params.get("alpha"):
        check_number("rope_parameters.alpha", params["alpha"], above_zero=True)
        if head_dim is not None and head_dim <= 2:
            raise InputError(f"head_dim={head_dim} with rope alpha: transformers' NTK-alpha base divides by head_dim - 2")


def _build(config, layout, dtype, rngs):
    """Llama's forward pass (the QK-norm after RoPE: `_config.qk_norm_after_rope`), where transformers runs the config."""
    if config.head_dim is None:
        raise InputError("head_dim is null: HunYuanDenseV1Attention takes config.head_dim as it is, and transformers fails on it "
                         "(the tensors are read as hidden_size / heads wide)")
    return rj.nets.llama.Decoder(config, layout, dtype, rngs=rngs)


# Llama's layer with Qwen3's per-head QK-norm leaves under HunYuan's names
_LAYER = (
    *(t for t in LAYER if not t.hf.startswith((f"{_A}.q_norm.", f"{_A}.k_norm."))),
    *norm(f"{_A}.query_layernorm", "layers/{i}/attention/query_norm", head_dim_of, bias=False, stream=False),
    *norm(f"{_A}.key_layernorm", "layers/{i}/attention/key_norm", head_dim_of, bias=False, stream=False),
)


HUNYUAN_V1_DENSE = dataclasses.replace(
    LLAMA,
    name="hunyuan_v1_dense",
    configs=(
        schema("hunyuan_v1_dense", "HunYuanDenseV1Config", {
            **sizes(290943, 4096, 11008, 32, 32), "num_key_value_heads": (INT.optional(), None), "head_dim": (INT.optional(), None),
            "max_position_embeddings": (INT, 2048), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
            "pad_token_id": (INT.optional(), 0), "attention_bias": (BOOL, False),
        }, derive=_derive),
    ),
    stems={"hunyuan_v1_dense": "HunYuanDenseV1"},
    layer=_LAYER,
    heads=tuple(h for h in HEADS if h.name in ("lm", "sequence_classification")),
    build=_build,
    ignored=(),
)
