"""Phi-3.5-MoE (phimoe: microsoft/Phi-3.5-MoE-instruct): Mixtral's decoder with LayerNorms (gains
and biases, eps rms_norm_eps) before each sublayer and at the end, biases on q/k/v/o with
`attention_bias`, an LM head with a bias with `lm_head_bias`, and a mixture in every layer whose
router (no bias) chooses two experts by `sparsemixer`: at inference, the first is the top logit,
weighted by its softmax over the experts whose logit is within 2 router_jitter_noise (relative to
max(|logit|, top)) of the top; the second the top of the others, weighted likewise against it
(transformers hard-codes two: num_experts_per_tok is not read). Each expert weight depends on its
own logit and the others' as a set: a permutation of the experts with the router's rows keeps it.
RoPE: rotate_half over the whole head, rope_type "default" or "longrope" as PhimoeRotaryEmbedding
runs it (the short_factor frequencies at every length, cos and sin times short_mscale, or
long_mscale past original_max_position_embeddings). A sliding window, where set, on every layer.

Tensors: Mixtral's per-expert names as save_pretrained writes them (`block_sparse_moe.gate`,
`block_sparse_moe.experts.{e}.w1|w3|w2`), or stacked as transformers 5 holds them (`mlp.router`,
`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
Leaves: Llama's attention and mixture (`layers/{i}/moe/{router,gate,up,down}/kernel`), the norms'
`scale` and `bias`, lm_head/{kernel,bias}. Groups: the attention heads, the experts with each
expert's units, the stream (rotations fixing the ones vector: LayerNorm; gains folded, each norm's
bias into its readers' biases or kept as bias / gain where a reader has none, as the router)."""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from .config import BOOL, FLOAT, INT, positive_ints
from .family import STACKED_GATE_UP, STACKED_TRANSPOSE, TRANSPOSE, Head, Norm, Tensor, linear, norm
from .llama import LLAMA
from .llama._config import kv_width, q_width, resolve_layer_types, rope_parameters_of, schema, sizes
from .llama._tensors import HEADS

_A, _MOE = "layers.{i}.self_attn", "layers/{i}/moe"


def _attention_bias(c) -> bool:
    return bool(c.attention_bias)


def _lm_bias(c) -> bool:
    return bool(c.lm_head_bias)


def _experts(c) -> int:
    return c.num_local_experts


def _untied(c) -> bool:
    return not c.tie_word_embeddings


def _lm_tied(c):
    return {"lm_head.weight": "embeddings/word/embedding"} if c.tie_word_embeddings else {}


def _stacked(tensors, stacked: bool):
    return tuple(dataclasses.replace(t, stacked=stacked) for t in tensors)


_SHAPES = {"gate": (_experts, "hidden_size", "intermediate_size"), "up": (_experts, "hidden_size", "intermediate_size"),
           "down": (_experts, "intermediate_size", "hidden_size")}

LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm"),
    *linear(f"{_A}.q_proj", "layers/{i}/attention/query", "hidden_size", q_width, bias=_attention_bias, reads=True),
    *linear(f"{_A}.k_proj", "layers/{i}/attention/key", "hidden_size", kv_width, bias=_attention_bias, reads=True),
    *linear(f"{_A}.v_proj", "layers/{i}/attention/value", "hidden_size", kv_width, bias=_attention_bias, reads=True),
    *linear(f"{_A}.o_proj", "layers/{i}/attention/out", q_width, "hidden_size", bias=_attention_bias, writes=True),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm"),
    # one tensor per expert, as save_pretrained writes them (Mixtral's names: w1 gate, w3 up, w2 down)
    *_stacked((
        Tensor("layers.{i}.block_sparse_moe.gate.weight", (f"{_MOE}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE),
        *(Tensor(f"layers.{{i}}.block_sparse_moe.experts.{{e}}.{w}.weight", (f"{_MOE}/{proj}/kernel",), (_SHAPES[proj],),
                 (2 if proj == "down" else 1,), TRANSPOSE, experts=_experts) for proj, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))),
    ), False),
    # stacked, as transformers 5 holds them in memory
    *_stacked((
        Tensor("layers.{i}.mlp.router.weight", (f"{_MOE}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE),
        Tensor("layers.{i}.mlp.experts.gate_up_proj", (f"{_MOE}/gate/kernel", f"{_MOE}/up/kernel"), (_SHAPES["gate"],) * 2, (1, 1),
               STACKED_GATE_UP),
        Tensor("layers.{i}.mlp.experts.down_proj", (f"{_MOE}/down/kernel",), (_SHAPES["down"],), (2,), STACKED_TRANSPOSE),
    ), True),
)

# PhimoeForCausalLM's lm_head has a bias with lm_head_bias (its own where the kernel is the tied embedding)
_LM = linear("lm_head", "lm_head", "hidden_size", "vocab_size", bias=_lm_bias, reads=True)
_HEADS = (
    Head("lm", "ForCausalLM", (dataclasses.replace(_LM[0], when=_untied), _LM[1]), markers=("lm_head.weight", "lm_head.bias"),
         tied=_lm_tied, forward=True),
    *(h for h in HEADS if h.name == "sequence_classification"),
)

# The MLP norm's gain stays (no reader): its readers are the router and the stacked experts, and a
# The MLP norm's gain folds into the router and the stacked experts; its bias stays as beta / g (none of them has a bias).
_FOLDS = (
    (r"layers/(\d+)/attention_norm/scale", r"layers/\1/attention/(query|key|value)/kernel"),
    (r"layers/(\d+)/mlp_norm/scale", r"layers/\1/moe/(router|gate|up)/kernel"),
    (r"final_norm/scale", r"(lm_head|head/score)/kernel"),
)

# PhimoeConfig.validate_rope: a scaled RoPE names both mscales; the factors one per rotary pair
_LONGROPE_KEYS = ("short_factor", "long_factor", "short_mscale", "long_mscale", "original_max_position_embeddings")


def _derive(values: dict, raw) -> None:
    """PhimoeConfig: num_key_value_heads defaults to the heads; RoPE theta 1e6 by default; of the
    scaled RoPE types, the one Phi-3.5-MoE ships ("longrope", legacy "su") is run."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if positive_ints(values, "hidden_size", "num_attention_heads") and hidden % heads:
        raise InputError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
    params = rope_parameters_of(values, raw, default_theta=1e6)
    if params["rope_type"] == "su":
        params["rope_type"] = "longrope"
    if params["rope_type"] not in ("default", "longrope"):
        raise InputError(f"rope_type {params['rope_type']!r} in config.rope_parameters is not supported for phimoe; supported: default, longrope")
    if params["rope_type"] == "longrope":
        missing = [k for k in _LONGROPE_KEYS if k not in params]
        if missing:
            raise InputError(f"rope_parameters of rope_type 'longrope' miss {missing} (PhimoeRotaryEmbedding reads them)")
        half = hidden // heads // 2 if positive_ints(values, "hidden_size", "num_attention_heads") else None
        for key in ("short_factor", "long_factor"):
            if half is not None and len(params[key]) != half:
                raise InputError(f"rope_parameters.{key} has {len(params[key])} entries; expected head_dim / 2 = {half}")
    values["rope_parameters"] = params
    if values["num_local_experts"] < 2:
        raise InputError(f"num_local_experts={values['num_local_experts']}: sparsemixer always picks two experts")
    resolve_layer_types(values, raw.get("layer_types"), supported=False)


SCHEMA = schema("phimoe", "PhimoeConfig", {
    **sizes(32064, 4096, 6400, 32, 32), "num_key_value_heads": (INT.optional(), 8), "max_position_embeddings": (INT, 4096 * 32),
    "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5), "sliding_window": (INT.optional(), None),
    "num_experts_per_tok": (INT, 2), "num_local_experts": (INT, 16), "router_jitter_noise": (FLOAT, 0.01),
    "input_jitter_noise": (FLOAT, 0.0), "attention_bias": (BOOL, False), "lm_head_bias": (BOOL, False),
}, derive=_derive)


PHIMOE = dataclasses.replace(
    LLAMA,
    name="phimoe",
    configs=(SCHEMA,),
    stems={"phimoe": "Phimoe"},
    layer=LAYER,
    final=norm("norm", "final_norm"),
    heads=_HEADS,
    norm=Norm("layernorm", placement="pre", folds=_FOLDS),
    build=lambda config, layout, dtype, rngs: rj.nets.phimoe.Decoder(config, layout, dtype, rngs=rngs),
    rules=(),
    ignored=(),
)
