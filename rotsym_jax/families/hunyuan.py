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
`use_qk_norm` (Tencent's config.json; its remote code skipped the head norm when false) is a key transformers
5 does not read, for either model type: the attention always applies query_layernorm and key_layernorm and
save_pretrained writes their gains, so `use_qk_norm: false` reads, runs and keeps Qwen3's QK group as any
other config (tests/test_hunyuan.py). A checkpoint without those gains is refused as missing them:
transformers would run it with gains it initialises to 1, which is not the function of the code that wrote it.

HunYuan MoE (hunyuan_v1_moe, Hunyuan-A13B) is this record with a mixture on every layer: a softmax router
(`mlp.gate.wg`, float32) picking moe_topk experts (per layer where it is a list), weights renormalised,
experts of intermediate_size, and a shared MLP (`mlp.shared_mlp`) added without a gate: Mixtral's experts
and Qwen2-MoE's shared-expert group (`llama/_tensors.py`), run by Llama's forward pass.

Leaves: Llama's and Qwen3's (`families/llama/`): `layers/{i}/attention/{query,key}_norm/scale` (dh,)
are HF's self_attn.query_layernorm and key_layernorm.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from .config import BOOL, FLOAT, INT, SIZE, check_number
from .family import STACKED_GATE_UP, STACKED_TRANSPOSE, TRANSPOSE, Tensor, gated_mlp, norm
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


def _derive_moe(values: dict, raw) -> None:
    """HunYuanMoEV1Config: the dense record's checks, and the router's top k (moe_topk: one for every
    layer, or one per layer, as HunYuanMoEV1Gate reads it) within the experts."""
    _derive(values, raw)
    top, experts, n = values["moe_topk"], values["num_experts"], values["num_hidden_layers"]
    tops = top if isinstance(top, list) else [top]
    if isinstance(top, list) and len(top) != n:
        raise InputError(f"moe_topk={top}: one entry per layer ({n}), as HunYuanMoEV1Gate reads moe_topk[layer]")
    if experts < 1 or any(k < 1 or k > experts for k in tops):
        raise InputError(f"moe_topk={top} of num_experts={experts}: the router picks at least 1 expert and no more than there are")


_MOE_BLOCK, _MOE = "layers.{i}.mlp", "layers/{i}/moe"
_EXPERTS = {"gate": ("num_experts", "hidden_size", "intermediate_size"), "up": ("num_experts", "hidden_size", "intermediate_size"),
            "down": ("num_experts", "intermediate_size", "hidden_size")}

# HunYuan MoE's layer: the dense record's attention and norms; every layer's MLP a mixture: the router
# `mlp.gate.wg`, the experts one tensor each as save_pretrained writes them (or stacked, as transformers 5
# holds them), and a shared MLP of intermediate_size added without a gate
_MOE_LAYER = (
    *(t for t in _LAYER if not t.hf.startswith("layers.{i}.mlp.")),
    Tensor(f"{_MOE_BLOCK}.gate.wg.weight", (f"{_MOE}/router/kernel",), (("hidden_size", "num_experts"),), (0,), TRANSPOSE),
    *(dataclasses.replace(t, stacked=False) for t in (
        Tensor(f"{_MOE_BLOCK}.experts.{{e}}.{proj}_proj.weight", (f"{_MOE}/{proj}/kernel",), (_EXPERTS[proj],), (2 if proj == "down" else 1,),
               TRANSPOSE, experts="num_experts") for proj in ("gate", "up", "down"))),
    *(dataclasses.replace(t, stacked=True) for t in (
        Tensor(f"{_MOE_BLOCK}.experts.gate_up_proj", (f"{_MOE}/gate/kernel", f"{_MOE}/up/kernel"), (_EXPERTS["gate"],) * 2, (1, 1),
               STACKED_GATE_UP),
        Tensor(f"{_MOE_BLOCK}.experts.down_proj", (f"{_MOE}/down/kernel",), (_EXPERTS["down"],), (2,), STACKED_TRANSPOSE),
    )),
    *gated_mlp(f"{_MOE_BLOCK}.shared_mlp", "layers/{i}/shared_mlp"),
)


# HunYuan MoE (Hunyuan-A13B): the dense record's attention (the QK-norm after RoPE, biases with attention_bias,
# the NTK-alpha RoPE), and on every layer a mixture: a softmax router (float32) picking moe_topk experts
# (per layer where it is a list), their weights renormalised, experts of intermediate_size, a shared MLP beside them
HUNYUAN_V1_MOE = dataclasses.replace(
    HUNYUAN_V1_DENSE,
    name="hunyuan_v1_moe",
    configs=(
        schema("hunyuan_v1_moe", "HunYuanMoEV1Config", {
            **sizes(290943, 4096, 11008, 32, 32), "num_key_value_heads": (INT.optional(), None), "head_dim": (INT.optional(), None),
            "max_position_embeddings": (INT, 2048), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
            "pad_token_id": (INT.optional(), 0), "attention_bias": (BOOL, False), "num_experts": (INT, 1), "moe_topk": (SIZE, 1),
        }, derive=_derive_moe, aliases={"num_experts_per_tok": "moe_topk", "num_local_experts": "num_experts"}),
    ),
    stems={"hunyuan_v1_moe": "HunYuanMoEV1"},
    layer=_MOE_LAYER,
)
