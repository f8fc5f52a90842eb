"""EXAONE MoE (model type exaone_moe: K-EXAONE): EXAONE 4's attention (grouped-query, no biases, a
per-head RMSNorm over q and k before RoPE; sliding-window layers with RoPE and the full layers without
it, transformers' Exaone4Attention with a sliding_window set, which ExaoneMoeConfig always has) in
pre-norm layers (OLMoE's: input_layernorm, post_attention_layernorm), and DeepSeek-V3's mixture
(`families/deepseek.py`): a dense MLP where `mlp_layer_types` says "dense" (by default the first
`first_k_dense_replace` layers), elsewhere a sigmoid router adding `e_score_correction_bias` for its
group-limited choice, routed_scaling_factor, and `num_shared_experts` shared experts.

The record is GLM-4-MoE's (`families/glm4_moe.py`: its folds, groups and forward pass,
`nets/deepseek.py`) with tables of its own: ExaoneMoeConfig's names (num_experts,
num_shared_experts; no use_qk_norm, attention_bias or head_dim fields) so that transformers' config
reads as ours does, and the correction bias under the name save_pretrained writes
(`mlp.e_score_correction_bias`; `mlp.gate.` beside stacked experts, as transformers holds them).
The multi-token-prediction block (`mtp.*`) is skipped, as transformers skips it. Refused by name:
the "LLLG" sliding_window_pattern strings without layer_types (as EXAONE 4's record).
"""

from __future__ import annotations

import dataclasses

from ..errors import InputError
from ..spec import HeadGeometry
from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema, Kind
from .family import STACKED_GATE_UP, STACKED_TRANSPOSE, TRANSPOSE, Tensor, attention_projections, gated_mlp, norm
from .glm4_moe import GLM4_MOE
from .llama._config import head_dim_of, kv_width, q_width, resolve_layer_types, rope_parameters_of, sizes


def _derive(values: dict, raw) -> None:
    """ExaoneMoeConfig (Exaone4Config's __post_init__ and its own): layer_types from
    sliding_window_pattern, mlp_layer_types from first_k_dense_replace; the attention's head width
    head_dim checked; the router's sizes checked as GLM-4-MoE's."""
    pattern = values["sliding_window_pattern"]  # sliding_window is an int here (ExaoneMoeConfig refuses None)
    n = values["num_hidden_layers"]
    if values["layer_types"] is None:
        if not isinstance(pattern, int):
            raise InputError(f"sliding_window_pattern={pattern!r}: only a number of layers is read (the 'LLLG' pattern strings are not)")
        values["layer_types"] = ["sliding_attention" if pattern and (i + 1) % pattern else "full_attention" for i in range(n)]
    resolve_layer_types(values, values["layer_types"], supported=True)
    if values["mlp_layer_types"] is None:
        values["mlp_layer_types"] = ["dense" if i < values["first_k_dense_replace"] else "sparse" for i in range(n)]
    types = values["mlp_layer_types"]
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise InputError(f"mlp_layer_types={types}: one entry per layer ({n}), each 'dense' or 'sparse', as ExaoneMoeDecoderLayer reads them")
    head_dim = raw.get("head_dim")  # not a field: the attention reads getattr(config, "head_dim", hidden_size // heads)
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2):
        raise InputError(f"head_dim={head_dim!r}: RoPE needs an even, positive head dimension")
    values["rope_parameters"] = rope_parameters_of(values, raw)
    experts, groups, top = values["num_experts"], values["n_group"], values["topk_group"]
    if experts % groups or (groups > 1 and experts // groups < 2) or top > groups or values["num_experts_per_tok"] > experts:
        raise InputError(f"num_experts={experts} in n_group={groups} groups, topk_group={top}, num_experts_per_tok="
                         f"{values['num_experts_per_tok']}: the router needs equal groups of at least 2 experts and cannot pick more than there are")


SCHEMA = ConfigSchema("exaone_moe", "ExaoneMoeConfig", {
    **sizes(102400, 4096, 16384, 32, 32), "num_key_value_heads": (INT, 32), "hidden_act": (STR, "silu"),
    "max_position_embeddings": (INT, 2048), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
    "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None), "pad_token_id": (INT.optional(), 0),
    "sliding_window": (INT, 4096),
    "sliding_window_pattern": (Kind("an int or a string", lambda v: v is None or isinstance(v, (int, str))), 4),
    "layer_types": (STRINGS.optional(), None), "mlp_layer_types": (STRINGS.optional(), None), "first_k_dense_replace": (INT, 1),
    "moe_intermediate_size": (INT, 1024), "num_experts": (INT, 64), "num_experts_per_tok": (INT, 8),
    "num_shared_experts": (INT, 1), "norm_topk_prob": (BOOL, True), "routed_scaling_factor": (FLOAT, 2.5), "n_group": (INT, 1),
    "topk_group": (INT, 1),
}, derive=_derive, consumed=("rope_scaling", "rope_theta"))


def _sparse(c, i: int) -> bool:
    return c.mlp_layer_types[i] == "sparse"


def _dense(c, i: int) -> bool:
    return c.mlp_layer_types[i] == "dense"


def _experts(c) -> int:
    return c.num_experts


def _shared_width(c) -> int:
    return c.moe_intermediate_size * c.num_shared_experts


def _in(in_layer, tensors, stacked=None):
    return tuple(dataclasses.replace(t, in_layer=in_layer, stacked=stacked) for t in tensors)


_MOE, _MOE_AT = "layers.{i}.mlp", "layers/{i}/moe"
_EXPERT_SHAPES = {"gate": (_experts, "hidden_size", "moe_intermediate_size"), "up": (_experts, "hidden_size", "moe_intermediate_size"),
                  "down": (_experts, "moe_intermediate_size", "hidden_size")}

# DeepSeek-V3's mixture (`deepseek.MIXTURE`, its leaves), under ExaoneMoeConfig's names and placed by
# mlp_layer_types; the router's correction bias as save_pretrained writes it (`mlp.e_score_correction_bias`,
# which transformers' conversion mapping renames on load) or, stacked, as transformers holds it in memory.
_MIXTURE = (
    *_in(_dense, gated_mlp("layers.{i}.mlp", "layers/{i}/mlp")),
    *_in(_sparse, (
        Tensor(f"{_MOE}.gate.weight", (f"{_MOE_AT}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE),
        *gated_mlp(f"{_MOE}.shared_experts", "layers/{i}/shared_mlp", f=_shared_width),
    )),
    *_in(_sparse, (
        Tensor(f"{_MOE}.e_score_correction_bias", (f"{_MOE_AT}/score_correction",), ((_experts,),), (None,)),
        *(Tensor(f"{_MOE}.experts.{{e}}.{proj}_proj.weight", (f"{_MOE_AT}/{proj}/kernel",), (_EXPERT_SHAPES[proj],), (2 if proj == "down" else 1,),
                 TRANSPOSE, experts=_experts) for proj in ("gate", "up", "down")),
    ), stacked=False),
    *_in(_sparse, (
        Tensor(f"{_MOE}.gate.e_score_correction_bias", (f"{_MOE_AT}/score_correction",), ((_experts,),), (None,)),
        Tensor(f"{_MOE}.experts.gate_up_proj", (f"{_MOE_AT}/gate/kernel", f"{_MOE_AT}/up/kernel"), (_EXPERT_SHAPES["gate"],) * 2, (1, 1),
               STACKED_GATE_UP),
        Tensor(f"{_MOE}.experts.down_proj", (f"{_MOE_AT}/down/kernel",), (_EXPERT_SHAPES["down"],), (2,), STACKED_TRANSPOSE),
    ), stacked=True),
)


# GLM-4-MoE's layer with EXAONE 4's attention: the QK-norm always, no biases
_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *attention_projections("layers.{i}.self_attn", "layers/{i}/attention", q_width, kv_width),
    *norm("layers.{i}.self_attn.q_norm", "layers/{i}/attention/query_norm", head_dim_of, bias=False, stream=False),
    *norm("layers.{i}.self_attn.k_norm", "layers/{i}/attention/key_norm", head_dim_of, bias=False, stream=False),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm", bias=False),
    *_MIXTURE,
)


def head_geometry(config) -> HeadGeometry:
    """Llama's heads with a per-head QK-norm, RoPE over the whole head (on the sliding layers; the full
    layers' heads take none, and every rotation a rotary pair's does commutes with no RoPE too)."""
    return HeadGeometry(config.num_attention_heads, config.num_key_value_heads, head_dim_of(config), rotary_dim=head_dim_of(config),
                        qk_norm="head")


EXAONE_MOE = dataclasses.replace(
    GLM4_MOE,
    name="exaone_moe",
    configs=(SCHEMA,),
    stems={"exaone_moe": "ExaoneMoe"},
    layer=_LAYER,
    head_geometry=head_geometry,
    ignored=(r"mtp\..*",),  # transformers' _keys_to_ignore_on_load_unexpected
)
