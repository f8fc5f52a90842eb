"""GPT-OSS (model type gpt_oss: openai/gpt-oss-20b, -120b; transformers' GptOssForCausalLM): Llama's
pre-RMSNorm decoder with grouped-query attention, biases on q/k/v/o with attention_bias (True by
default), RoPE over the whole head (YaRN by default: cos and sin times its attention factor), layers
of sliding-window and full attention as layer_types says (alternating by default), and in each
head an attention sink (`self_attn.sinks`, one logit per query head that joins the head's softmax
beside its scores and is dropped after it). Every layer holds a mixture of experts: a router with
a bias whose top num_experts_per_tok logits, softmaxed among themselves, weight the picked
experts; each expert down(clamped_swiglu(gate_up(x))) with biases, where
clamped_swiglu = (clamp(up, -l, l) + 1) * g * sigmoid(alpha g), g = clamp(gate, max=l)
(l = swiglu_limit, alpha = swiglu_alpha).

Tensors as save_pretrained writes them (transformers holds the experts stacked and saves them so):
`mlp.router.{weight,bias}`, `mlp.experts.gate_up_proj` (E, d, 2f) in (in, out) order with the gate
and up columns interleaved (gate 0::2, up 1::2), `gate_up_proj_bias` (E, 2f) likewise,
`mlp.experts.down_proj` (E, f, d), `down_proj_bias` (E, d).
Leaves: Llama's attention with `attention/sinks` (H,); `layers/{i}/moe/router/{kernel,bias}`,
`moe/{gate,up}/{kernel,bias}` (E, d, f), (E, f), `moe/down/{kernel,bias}` (E, f, d), (E, d).

Groups: the heads (each head's sink moves with it; no map within a head reaches it, since q.k
and the values a head mixes are unchanged), QK rotations of each rotary pair and scales, VO
rotations and scales; the experts (the router's rows and bias with them) and each expert's units,
permuted only: the clamps and the +1 make the SwiGLU neither homogeneous in gate nor linear in up,
so no unit scale keeps it (the experts kind has none); the stream's rotations (RMSNorm, gains
folded into q/k/v, the router and the experts' gate and up). Refused by name: sliding_window null
(GptOssModel builds a sliding-window mask on every call and raises without one), quantized
checkpoints (the published ones are MXFP4: transformers' Mxfp4Config(dequantize=True) reads them
into a model whose save_pretrained writes these tensors)."""

from __future__ import annotations

import dataclasses

import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from .config import BOOL, FLOAT, INT, STRINGS, positive_ints
from .family import Convert, Norm, Tensor, attention_projections, linear, norm, pre_norm_folds
from .llama import LLAMA
from .llama._config import ROPE_TYPES, kv_width, q_width, resolve_layer_types, rope_parameters_of, schema, sizes
from .llama._tensors import HEADS

_L = r"layers/(?P<layer>\d+)"
_MOE, _MOE_AT = "layers.{i}.mlp", "layers/{i}/moe"

# GptOssConfig.__post_init__'s RoPE where the config gives none (rope_theta: its default_theta)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
RUN_ROPE_TYPES = (*ROPE_TYPES, "yarn")


def _derive(values: dict, raw) -> None:
    """GptOssConfig.__post_init__: num_key_value_heads from the heads, head_dim from the width,
    layer_types alternating sliding and full from the first layer, YaRN's RoPE by default (theta
    150000); and what transformers cannot run refused."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values["head_dim"] is None and positive_ints(values, "hidden_size", "num_attention_heads"):
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if isinstance(values["head_dim"], int) and values["head_dim"] % 2:
        raise InputError(f"head_dim={values['head_dim']}: RoPE needs an even head dimension")
    if values["layer_types"] is None:
        values["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(values["num_hidden_layers"])]
    resolve_layer_types(values, values["layer_types"], supported=True)
    if values["sliding_window"] is None:
        raise InputError("sliding_window is null: GptOssModel builds a sliding-window mask on every forward pass and raises without "
                         "one (transformers cannot run this config)")
    if values["rope_parameters"] is None and not raw.get("rope_scaling"):
        values["rope_parameters"] = dict(DEFAULT_ROPE)
    params = rope_parameters_of(values, raw, default_theta=150000.0)
    if params["rope_type"] not in RUN_ROPE_TYPES:
        raise InputError(f"rope_type {params['rope_type']!r} in config.rope_parameters is not supported for gpt_oss; supported: "
                         f"{list(RUN_ROPE_TYPES)}")
    if params["rope_type"] == "yarn" and not isinstance(params.get("factor"), (int, float)):
        raise InputError(f"rope_parameters of rope_type 'yarn' need a number 'factor'; got {params.get('factor')!r}")
    values["rope_parameters"] = params
    if values["num_experts_per_tok"] > values["num_local_experts"]:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} exceeds num_local_experts={values['num_local_experts']}")


SCHEMA = schema("gpt_oss", "GptOssConfig", {
    **sizes(201088, 2880, 2880, 36, 64), "num_key_value_heads": (INT.optional(), 8), "head_dim": (INT.optional(), 64),
    "num_local_experts": (INT, 128), "num_experts_per_tok": (INT, 4), "sliding_window": (INT.optional(), 128),
    "max_position_embeddings": (INT, 131072), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
    "swiglu_alpha": (FLOAT, 1.702), "swiglu_limit": (FLOAT, 7.0), "attention_bias": (BOOL, True),
    "layer_types": (STRINGS.optional(), None),
}, derive=_derive, aliases={"num_experts": "num_local_experts"})


def _attention_bias(c) -> bool:
    return bool(c.attention_bias)


def _experts(c) -> int:
    return c.num_local_experts


def _interleaved_to_ours(a, c):
    return a[..., 0::2], a[..., 1::2]


def _interleaved_to_hf(t, c):
    gate, up = t
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


# gate_up_proj (E, d, 2f) and its bias (E, 2f): column 2j is unit j's gate, 2j + 1 its up (GptOssExperts._apply_gate)
INTERLEAVED_GATE_UP = Convert("interleaved_gate_up", _interleaved_to_ours, _interleaved_to_hf)

_GATE_UP = (_experts, "hidden_size", "intermediate_size")
LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *attention_projections("layers.{i}.self_attn", "layers/{i}/attention", q_width, kv_width, bias=_attention_bias, out_bias=_attention_bias),
    Tensor("layers.{i}.self_attn.sinks", ("layers/{i}/attention/sinks",), (("num_attention_heads",),), (None,)),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm", bias=False),
    *linear(f"{_MOE}.router", f"{_MOE_AT}/router", "hidden_size", _experts, reads=True),
    Tensor(f"{_MOE}.experts.gate_up_proj", (f"{_MOE_AT}/gate/kernel", f"{_MOE_AT}/up/kernel"), (_GATE_UP,) * 2, (1, 1), INTERLEAVED_GATE_UP),
    Tensor(f"{_MOE}.experts.gate_up_proj_bias", (f"{_MOE_AT}/gate/bias", f"{_MOE_AT}/up/bias"), ((_experts, "intermediate_size"),) * 2,
           (None, None), INTERLEAVED_GATE_UP),
    Tensor(f"{_MOE}.experts.down_proj", (f"{_MOE_AT}/down/kernel",), ((_experts, "intermediate_size", "hidden_size"),), (2,)),
    Tensor(f"{_MOE}.experts.down_proj_bias", (f"{_MOE_AT}/down/bias",), ((_experts, "hidden_size"),), (1,)),
)

# The sinks follow the heads; the router's bias its experts; each expert's gate and up biases its
# units; the down bias (one per expert, on the stream) its expert.
RULES = (
    (rf"{_L}/attention/sinks", ("attn.s",)),
    (rf"{_L}/moe/router/bias", ("moe.expert",)),
    (rf"{_L}/moe/(gate|up)/bias", ("moe.expert", "moe.unit")),
    (rf"{_L}/moe/down/bias", ("moe.expert", None)),
)

# GptOssForCausalLM, ForSequenceClassification and ForTokenClassification (transformers' Generic heads, Llama's tables)
_HEADS = tuple(h for h in HEADS if h.name in ("lm", "sequence_classification", "token_classification"))


GPT_OSS = dataclasses.replace(
    LLAMA,
    name="gpt_oss",
    configs=(SCHEMA,),
    stems={"gpt_oss": "GptOss"},
    layer=LAYER,
    heads=_HEADS,
    norm=Norm("rmsnorm", placement="pre", folds=pre_norm_folds("(up|gate)", r"(lm_head|head/(score|token_classifier))", moe=True)),
    build=lambda config, layout, dtype, rngs: rj.nets.gpt_oss.Decoder(config, layout, dtype, rngs=rngs),
    rules=RULES,
    ignored=(),
    # the published checkpoints' MXFP4 experts (blocks and scales): transformers reads them dequantized with
    # Mxfp4Config(dequantize=True), and that model's save_pretrained writes the tensors read here
    unsupported=(("quantization_config", "quantized experts; dequantize them in transformers (Mxfp4Config(dequantize=True)) and "
                                         "save_pretrained the result"),),
)
