"""dots.llm1 (model type dots1, rednote-hilab): Qwen3's attention (grouped-query, a per-head RMSNorm
over q and k before RoPE over the whole head, q/k/v/o biases with `attention_bias`; sliding-window
layers where `layer_types` says so, by default from `max_window_layers` on with a `sliding_window`
set) in pre-norm layers, and DeepSeek-V3's mixture (`families/deepseek.py`): `first_k_dense_replace`
dense MLPs, then a sigmoid router adding `e_score_correction_bias` for its group-limited choice,
routed_scaling_factor, and `n_shared_experts` shared experts.

The record is GLM-4-MoE's (`families/glm4_moe.py`: its mixture's tables under the same names, its
folds, groups, head and forward pass, `nets/deepseek.py`) with Dots1Config's schema, an o_proj bias
beside q/k/v's and the QK-norm always. Refused by name: a config without the mixture's sizes where a
layer holds one (Dots1Config's own defaults leave n_routed_experts, n_shared_experts and
num_experts_per_tok None, which transformers cannot build), sliding layers without a window, a head
whose RoPE would not cover it (partial_rotary_factor: Dots1's default RoPE ignores it).
"""

from __future__ import annotations

import dataclasses

from ..errors import InputError
from ..spec import HeadGeometry
from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema
from .deepseek import MIXTURE
from .family import attention_projections, norm
from .glm4_moe import GLM4_MOE
from .llama._config import head_dim_of, kv_width, q_width, resolve_layer_types, rope_parameters_of, rotary_dim_of, sizes


def _bias(c) -> bool:
    return c.attention_bias


def _derive(values: dict, raw) -> None:
    """Dots1Config's __post_init__ (kv heads, layer_types from max_window_layers) and what its model
    needs to be built: the mixture's sizes wherever a layer holds one, checked as GLM-4-MoE's."""
    n = values["num_hidden_layers"]
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    window = values["sliding_window"]
    if values["layer_types"] is None:
        values["layer_types"] = ["sliding_attention" if window is not None and i >= (values["max_window_layers"] or 0) else "full_attention"
                                 for i in range(n)]
    resolve_layer_types(values, values["layer_types"], supported=True)
    if window is None and "sliding_attention" in values["layer_types"]:
        raise InputError("layer_types has 'sliding_attention' layers but sliding_window is None: transformers' mask needs a window")
    head_dim = raw.get("head_dim")  # not a field: the attention reads getattr(config, "head_dim", hidden_size // heads)
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2):
        raise InputError(f"head_dim={head_dim!r}: RoPE needs an even, positive head dimension")
    values["rope_parameters"] = rope_parameters_of(values, raw)
    dense = values["first_k_dense_replace"]
    if dense is None:
        raise InputError("first_k_dense_replace is None: Dots1DecoderLayer compares each layer's index with it")
    if dense >= n:
        return  # every layer dense: no router is built
    missing = [k for k in ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group") if values[k] is None]
    if missing:
        raise InputError(f"{', '.join(missing)} None with mixtures from layer {dense} on (first_k_dense_replace): transformers cannot "
                         "build or run the mixture without them (Dots1Config's defaults leave the expert counts None)")
    experts, groups, top = values["n_routed_experts"], values["n_group"], values["topk_group"]
    if experts % groups or (groups > 1 and experts // groups < 2) or top > groups or values["num_experts_per_tok"] > experts:
        raise InputError(f"n_routed_experts={experts} in n_group={groups} groups, topk_group={top}, num_experts_per_tok="
                         f"{values['num_experts_per_tok']}: the router needs equal groups of at least 2 experts and cannot pick more than there are")


SCHEMA = ConfigSchema("dots1", "Dots1Config", {
    **sizes(152064, 4608, 10944, 62, 32), "moe_intermediate_size": (INT, 1408), "num_key_value_heads": (INT.optional(), 32),
    "n_shared_experts": (INT.optional(), None), "n_routed_experts": (INT.optional(), None), "n_group": (INT.optional(), 1),
    "topk_group": (INT.optional(), 1), "num_experts_per_tok": (INT.optional(), None), "first_k_dense_replace": (INT.optional(), 0),
    "norm_topk_prob": (BOOL.optional(), False), "hidden_act": (STR, "silu"), "max_position_embeddings": (INT, 2048),
    "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-6), "tie_word_embeddings": (BOOL, False),
    "rope_parameters": (DICT.optional(), None), "attention_bias": (BOOL, False), "routed_scaling_factor": (FLOAT, 1.0),
    "sliding_window": (INT.optional(), 4096), "max_window_layers": (INT.optional(), 62), "layer_types": (STRINGS.optional(), None),
    "pad_token_id": (INT.optional(), None),
}, derive=_derive, aliases={"num_local_experts": "n_routed_experts"}, consumed=("rope_scaling", "rope_theta"))


# GLM-4-MoE's layer with Qwen3's attention: the QK-norm always, o_proj's bias with q/k/v's
_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *attention_projections("layers.{i}.self_attn", "layers/{i}/attention", q_width, kv_width, bias=_bias, out_bias=_bias),
    *norm("layers.{i}.self_attn.q_norm", "layers/{i}/attention/query_norm", head_dim_of, bias=False, stream=False),
    *norm("layers.{i}.self_attn.k_norm", "layers/{i}/attention/key_norm", head_dim_of, bias=False, stream=False),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm", bias=False),
    *MIXTURE,
)


def head_geometry(config) -> HeadGeometry:
    """Qwen3's heads: GQA, a per-head QK-norm, RoPE over the whole head (on the sliding layers too)."""
    return HeadGeometry(config.num_attention_heads, config.num_key_value_heads, head_dim_of(config), rotary_dim=rotary_dim_of(config),
                        qk_norm="head")


DOTS1 = dataclasses.replace(
    GLM4_MOE,
    name="dots1",
    configs=(SCHEMA,),
    stems={"dots1": "Dots1"},
    layer=_LAYER,
    head_geometry=head_geometry,
    ignored=(),  # Dots1PreTrainedModel ignores no unexpected key (no multi-token-prediction layer)
)
