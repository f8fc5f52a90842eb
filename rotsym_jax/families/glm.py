"""GLM (model type glm: GLM-4-9B-chat-hf) and GLM-4 (glm4: GLM-4-0414, GLM-Z1): Llama's pre-RMSNorm
decoder with q/k/v biases (`attention_bias`, true by default; o_proj has none), RoPE on interleaved
pairs (2i, 2i + 1) of the first half of each head (`partial_rotary_factor` 0.5 by default), and
Phi-3's fused `gate_up_proj` (gate rows, then up rows); GLM-4 also norms each sublayer's output
(`post_self_attn_layernorm`, `post_mlp_layernorm`) before it joins the stream.

Our q and k kernels (and biases) hold each head's rotary entries in the rotate_half order
(`family.interleaved_rotary`, as GPT-J's and Cohere's), so the groups are Llama's with partial
rotary: kv-group and query-head permutations, rotations of each rotary pair and of the entries past
them, scales. The stream: GLM's as Llama's (rotations, the gains folded); GLM-4's output norms
commute with permutations and sign flips only (Gemma 2's sandwich).

Leaves: Llama's (`families/llama`), GLM-4's output norms as Gemma 2's (`layers/{i}/attention_post_norm`,
`layers/{i}/mlp_post_norm`).
"""

from __future__ import annotations

import dataclasses

from .config import BOOL, DICT, FLOAT, INT, STR, ConfigSchema
from .family import NO_READER, Norm, Tensor, interleaved_projection, linear, norm, split_rows
from .llama import LLAMA
from .llama._config import head_dim_of, kv_width, q_width, rope_parameters_of, rotary_dim_of, sizes
from .llama._tensors import FOLDS, HEADS


def _bias(c) -> bool:
    return c.attention_bias


def _rotated(proj: str, ours: str, heads: str, width) -> tuple[Tensor, ...]:
    """q_proj or k_proj, reordered from GLM's interleaved pairs (RoPE over part of the head)."""
    return interleaved_projection(proj, ours, heads, head_dim_of, rotary_dim_of, width, bias=_bias)


_A = "layers.{i}.self_attn"
_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *_rotated(f"{_A}.q_proj", "layers/{i}/attention/query", "num_attention_heads", q_width),
    *_rotated(f"{_A}.k_proj", "layers/{i}/attention/key", "num_key_value_heads", kv_width),
    *linear(f"{_A}.v_proj", "layers/{i}/attention/value", "hidden_size", kv_width, bias=_bias, reads=True),
    *linear(f"{_A}.o_proj", "layers/{i}/attention/out", q_width, "hidden_size", bias=False, writes=True),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm", bias=False),
    Tensor("layers.{i}.mlp.gate_up_proj.weight", ("layers/{i}/mlp/gate/kernel", "layers/{i}/mlp/up/kernel"),
           (("hidden_size", "intermediate_size"),) * 2, (0, 0), split_rows(("intermediate_size", "intermediate_size"))),
    *linear("layers.{i}.mlp.down_proj", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", bias=False, writes=True),
)
_GLM4_LAYER = (
    *_LAYER,
    *norm("layers.{i}.post_self_attn_layernorm", "layers/{i}/attention_post_norm", bias=False),
    *norm("layers.{i}.post_mlp_layernorm", "layers/{i}/mlp_post_norm", bias=False),
)


def _derive(values: dict, raw) -> None:
    """GlmConfig / Glm4Config: RoPE over half of each head unless the config says otherwise."""
    values["rope_parameters"] = rope_parameters_of(values, raw)
    values["rope_parameters"].setdefault("partial_rotary_factor", 0.5)


def _schema(model_type: str, class_name: str) -> ConfigSchema:
    return ConfigSchema(model_type, class_name, {
        **sizes(151552, 4096, 13696, 40, 32), "num_key_value_heads": (INT.optional(), 2), "head_dim": (INT.optional(), 128),
        "hidden_act": (STR, "silu"), "max_position_embeddings": (INT, 131072), "initializer_range": (FLOAT, 0.02),
        "rms_norm_eps": (FLOAT, 0.00000015625), "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None),
        "pad_token_id": (INT.optional(), 151329), "attention_bias": (BOOL, True),
    }, derive=_derive, consumed=("rope_scaling", "rope_theta", "partial_rotary_factor"))


_HEADS = tuple(h for h in HEADS if h.name != "question_answering")  # transformers has no GLM QA class

GLM = dataclasses.replace(
    LLAMA,
    name="glm",
    configs=(_schema("glm", "GlmConfig"),),
    stems={"glm": "Glm"},
    layer=_LAYER,
    heads=_HEADS,
    ignored=(),
)

# The output norms have no reader to fold into: they only follow a permutation.
GLM4 = dataclasses.replace(
    GLM,
    name="glm4",
    configs=(_schema("glm4", "Glm4Config"),),
    stems={"glm4": "Glm4"},
    layer=_GLM4_LAYER,
    norm=Norm("rmsnorm", placement="sandwich", folds=FOLDS + ((r"layers/(\d+)/(attention|mlp)_post_norm/scale", NO_READER),)),
)
