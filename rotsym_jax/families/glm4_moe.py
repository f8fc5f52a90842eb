"""GLM-4-MoE (model type glm4_moe: GLM-4.5, GLM-4.5-Air, GLM-4.6): grouped-query attention with q/k/v
biases (`attention_bias`; o_proj has none), an optional RMSNorm over each head's q and k
(`use_qk_norm`), RoPE (`rotate_half`) on the first half of each head (`partial_rotary_factor` 0.5
by default), and DeepSeek-V3's layers otherwise: `first_k_dense_replace` dense MLPs, then a
mixture whose sigmoid router adds `e_score_correction_bias` for its group-limited choice, with
shared experts (`families/deepseek.py` describes the mixture and why its experts move within their
routing group).

The groups: Llama's attention (kv-group and query-head permutations, rotations of each rotary pair
and of the non-rotary entries, scales; with the QK-norm, sign flips), the dense MLPs' and shared
experts' units, the experts within their routing groups with their units, the stream (the gains
folded, every head untied). The multi-token-prediction layer of a full checkpoint
(`model.layers.{num_hidden_layers}`, 46 or 92) is skipped, as transformers skips it.

Leaves: Llama's attention (`layers/{i}/attention/{query,key,value,out}`, `query_norm`, `key_norm`)
and DeepSeek-V3's mixture (`layers/{i}/mlp`, `moe`, `shared_mlp`).
"""

from __future__ import annotations

import dataclasses
import math

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry
from .config import BOOL, DICT, FLOAT, INT, STR, ConfigSchema
from .deepseek import HEADS, MIXTURE, MIXTURE_FOLD, MIXTURE_RULES, RoutedFamily
from .family import Norm, attention_projections, embedding, norm
from .llama._config import head_dim_of, kv_width, q_width, rope_parameters_of, sizes


def _bias(c) -> bool:
    return c.attention_bias


def _qk_norm(c) -> bool:
    return c.use_qk_norm


def _only(condition, tensors):
    return tuple(dataclasses.replace(t, when=condition) for t in tensors)


_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *attention_projections("layers.{i}.self_attn", "layers/{i}/attention", q_width, kv_width, bias=_bias, out_bias=False),
    *_only(_qk_norm, norm("layers.{i}.self_attn.q_norm", "layers/{i}/attention/query_norm", head_dim_of, bias=False, stream=False)),
    *_only(_qk_norm, norm("layers.{i}.self_attn.k_norm", "layers/{i}/attention/key_norm", head_dim_of, bias=False, stream=False)),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm", bias=False),
    *MIXTURE,
)

_FOLDS = (
    (r"layers/(\d+)/attention_norm/scale", r"layers/\1/attention/(query|key|value)/kernel"),
    MIXTURE_FOLD,
    (r"final_norm/scale", r"lm_head/kernel"),
)


def head_geometry(config) -> HeadGeometry:
    """Llama's heads; the rotated entries those transformers rotates: 2 ceil(r / 2) of r = int(head_dim
    x partial_rotary_factor), an odd r included (Glm4MoeConfig's own default: 42-wide heads)."""
    rotary = int(head_dim_of(config) * (config.rope_parameters or {}).get("partial_rotary_factor", 1.0))
    return HeadGeometry(config.num_attention_heads, config.num_key_value_heads, head_dim_of(config), rotary_dim=2 * math.ceil(rotary / 2),
                        qk_norm="head" if config.use_qk_norm else False)


def _derive(values: dict, raw) -> None:
    """Glm4MoeConfig: RoPE over half of each head unless the config says otherwise (the head width is
    hidden_size / heads unless head_dim is given: `head_dim_of`); the router's sizes checked as
    DeepSeek-V3's."""
    if values["head_dim"] is None:  # transformers' getattr(config, "head_dim", hidden_size // heads), as the attention reads it
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters_of(values, raw)
    values["rope_parameters"].setdefault("partial_rotary_factor", 0.5)
    experts, groups, top = values["n_routed_experts"], values["n_group"], values["topk_group"]
    if experts % groups or (groups > 1 and experts // groups < 2) or top > groups or values["num_experts_per_tok"] > experts:
        raise InputError(f"n_routed_experts={experts} in n_group={groups} groups, topk_group={top}, num_experts_per_tok="
                         f"{values['num_experts_per_tok']}: the router needs equal groups of at least 2 experts and cannot pick more than there are")


SCHEMA = ConfigSchema("glm4_moe", "Glm4MoeConfig", {
    **sizes(151552, 4096, 10944, 46, 96), "num_key_value_heads": (INT, 8), "head_dim": (INT.optional(), None), "hidden_act": (STR, "silu"),
    "max_position_embeddings": (INT, 131072), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
    "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None), "attention_bias": (BOOL, False),
    "moe_intermediate_size": (INT, 1408), "num_experts_per_tok": (INT, 8), "n_shared_experts": (INT, 1), "n_routed_experts": (INT, 128),
    "routed_scaling_factor": (FLOAT, 1.0), "n_group": (INT, 1), "topk_group": (INT, 1), "first_k_dense_replace": (INT, 1),
    "norm_topk_prob": (BOOL, True), "use_qk_norm": (BOOL, False), "pad_token_id": (INT.optional(), None),
}, derive=_derive, aliases={"num_local_experts": "n_routed_experts"}, consumed=("rope_scaling", "rope_theta", "partial_rotary_factor"))


GLM4_MOE = RoutedFamily(
    name="glm4_moe",
    configs=(SCHEMA,),
    stems={"glm4_moe": "Glm4Moe"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("norm", "final_norm", bias=False),
    heads=tuple(h for h in HEADS if h.name == "lm"),  # transformers has no other Glm4Moe head
    default_head="lm",
    norm=Norm("rmsnorm", placement="pre", folds=_FOLDS),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.deepseek.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry,
    rules=MIXTURE_RULES,
    # the multi-token-prediction layer past the last one (transformers' _keys_to_ignore_on_load_unexpected)
    ignored=(r"(model\.)?layers\.(46|92)\..*",),
)
