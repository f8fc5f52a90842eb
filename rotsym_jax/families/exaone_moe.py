"""EXAONE MoE (model type exaone_moe: K-EXAONE): EXAONE 4's attention (a per-head RMSNorm over q and
k before RoPE; no biases; sliding-window layers with RoPE and, where there are sliding ones, full
layers without RoPE) in pre-norm layers (OLMoE's: input_layernorm, post_attention_layernorm), and
DeepSeek-V3's mixture otherwise (`families/deepseek.py`): dense MLPs in the first
`first_k_dense_replace` layers, then a sigmoid router adding `e_score_correction_bias` for its
group-limited choice, routed_scaling_factor, and `num_shared_experts` shared experts. So GLM-4-MoE's
record (`families/glm4_moe.py`: its tables, folds, groups and forward pass) with the QK-norm always
on, full RoPE, and EXAONE 4's layer types; transformers' `mtp.*` tensors (multi-token prediction)
are skipped, as transformers skips them.

Refused by name: an `mlp_layer_types` that is not dense layers then sparse ones (our tables place
the mixture by first_k_dense_replace), and the "LLLG" pattern strings (as EXAONE 4's record).
"""

from __future__ import annotations

import dataclasses

from ..errors import InputError
from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema, Kind
from .glm4_moe import GLM4_MOE
from .llama._config import resolve_layer_types, rope_parameters_of, sizes


def _derive(values: dict, raw) -> None:
    """ExaoneMoeConfig (Exaone4Config's __post_init__ and its own): layer_types from
    sliding_window_pattern, mlp_layer_types from first_k_dense_replace; the attention's head width
    getattr(config, "head_dim", hidden_size // heads); the values GLM-4-MoE's record reads."""
    pattern = values["sliding_window_pattern"]  # sliding_window is an int here (ExaoneMoeConfig refuses None)
    n = values["num_hidden_layers"]
    if values["layer_types"] is None:
        if not isinstance(pattern, int):
            raise InputError(f"sliding_window_pattern={pattern!r}: only a number of layers is read (the 'LLLG' pattern strings are not)")
        values["layer_types"] = ["sliding_attention" if pattern and (i + 1) % pattern else "full_attention" for i in range(n)]
    resolve_layer_types(values, values["layer_types"], supported=True)
    k = values["first_k_dense_replace"]
    if values["mlp_layer_types"] is None:
        values["mlp_layer_types"] = ["dense" if i < k else "sparse" for i in range(n)]
    types = values["mlp_layer_types"]
    dense = sum(1 for t in types if t == "dense")
    if len(types) != n or types != ["dense"] * dense + ["sparse"] * (n - dense):
        raise InputError(f"mlp_layer_types={types}: only dense layers then sparse ones, one entry per layer ({n}), are read "
                         "(the mixture's tables place it from a first dense count)")
    values["first_k_dense_replace"] = dense  # transformers places the mixture by mlp_layer_types
    head_dim = raw.get("head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2):
        raise InputError(f"head_dim={head_dim!r}: RoPE needs an even, positive head dimension")
    values["head_dim"] = head_dim or values["hidden_size"] // values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters_of(values, raw)
    values["use_qk_norm"], values["attention_bias"] = True, False  # EXAONE 4's attention: always a QK-norm, no biases
    experts, groups, top = values["n_routed_experts"], values["n_group"], values["topk_group"]
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
    "moe_intermediate_size": (INT, 1024), "n_routed_experts": (INT, 64), "num_experts_per_tok": (INT, 8),
    "n_shared_experts": (INT, 1), "norm_topk_prob": (BOOL, True), "routed_scaling_factor": (FLOAT, 2.5), "n_group": (INT, 1),
    "topk_group": (INT, 1),
}, derive=_derive, aliases={"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"},
    consumed=("rope_scaling", "rope_theta"))


def _correction_bias_as_saved(layer):
    """The router's correction bias: save_pretrained writes it as `mlp.e_score_correction_bias` (transformers' conversion
    mapping renames it to `mlp.gate.e_score_correction_bias` on load, where the stacked in-memory form holds it)."""
    out = []
    for t in layer:
        if t.hf.endswith(".mlp.gate.e_score_correction_bias"):
            out += [dataclasses.replace(t, hf=t.hf.replace(".gate.", "."), stacked=False), dataclasses.replace(t, stacked=True)]
        else:
            out.append(t)
    return tuple(out)


EXAONE_MOE = dataclasses.replace(
    GLM4_MOE,
    name="exaone_moe",
    configs=(SCHEMA,),
    stems={"exaone_moe": "ExaoneMoe"},
    layer=_correction_bias_as_saved(GLM4_MOE.layer),
    ignored=(r"mtp\..*",),  # transformers' _keys_to_ignore_on_load_unexpected
)
