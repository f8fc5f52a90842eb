"""ERNIE 4.5 (Baidu's dense models, e.g. ERNIE-4.5-0.3B): Llama's pre-RMSNorm decoder (grouped-query
attention, a SwiGLU MLP) with RoPE over the whole head in the interleaved layout (pairs
(2i, 2i + 1), GLM's `rotate_half`, the frequencies repeat_interleave'd over each pair), a bias on
every projection (q/k/v/o and the MLP's) with `use_bias`, head_dim 128 unless null (then
hidden_size / heads), and a causal LM head tied to the embedding by default.

Our q and k kernels (and biases) hold each head's entries in the rotate_half order: the loader
reorders them (`helium.interleaved_layer`), the saver restores ERNIE's; the groups and the
forward pass are Llama's. Leaves: Llama's (`families/llama/`).

ERNIE 4.5 MoE (ernie4_5_moe: ERNIE-4.5-21B-A3B, 300B-A47B): that attention and, every
moe_layer_interval-th layer from moe_layer_start_index to moe_layer_end_index, a mixture in place of
the dense MLP: a router (`mlp.gate`, float32, no bias) whose softmax probabilities plus
`mlp.moe_statics.e_score_correction_bias` (1, E) choose the top moe_k experts, weighted by their
probabilities divided by their sum (clamped below at moe_norm_min); experts without biases
(`mlp.experts.{e}.*_proj`, or stacked as transformers 5 holds them, the bias then under
`mlp.gate.moe_statics`); moe_num_shared_experts shared experts (one MLP of moe_intermediate_size x
that many, biases with use_bias) beside them. Its lm_head has a bias with use_bias (tied: the
embedding's kernel and a bias of its own). The multi-token-prediction layer of a full checkpoint
(`model.mtp_*`) is skipped, as transformers skips it. The groups: Llama's attention, the dense MLPs'
and shared experts' units, the experts (router rows and correction-bias entries with them: the
softmax, the choice and the weights all commute with a permutation of the experts) with each
expert's units, the stream (gains folded; a tied LM head written untied for a rotation).
Leaves: Llama's attention and dense MLPs, DeepSeek's mixture (`layers/{i}/moe`, `moe/score_correction`,
`shared_mlp`), lm_head/bias.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from .config import BOOL, FLOAT, INT, positive_ints
from .deepseek import MIXTURE_FOLD, MIXTURE_RULES
from .family import STACKED_GATE_UP, STACKED_TRANSPOSE, TRANSPOSE, Convert, Head, Norm, Tensor, gated_mlp, linear
from .helium import interleaved_layer
from .llama import LLAMA
from .llama._config import is_odd_rope_dim, resolve_layer_types, rope_parameters_of, schema, sizes
from .llama._tensors import HEADS


def _derive(values: dict, raw) -> None:
    """Ernie4_5Config.__post_init__: num_key_value_heads and head_dim, where null, the heads and
    hidden_size / heads; RoPE theta 500000 by default; no layer types."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values["head_dim"] is None and positive_ints(values, "hidden_size", "num_attention_heads"):
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if is_odd_rope_dim(values["head_dim"]):
        raise InputError(f"head_dim={values['head_dim']}: RoPE needs an even head dimension")
    values["rope_parameters"] = rope_parameters_of(values, raw, default_theta=500000.0)
    resolve_layer_types(values, raw.get("layer_types"), supported=False)


ERNIE4_5 = dataclasses.replace(
    LLAMA,
    name="ernie4_5",
    configs=(
        schema("ernie4_5", "Ernie4_5Config", {
            **sizes(103424, 1024, 3072, 18, 16), "num_key_value_heads": (INT.optional(), 2), "head_dim": (INT.optional(), 128),
            "max_position_embeddings": (INT, 131072), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
            "pad_token_id": (INT.optional(), 0), "tie_word_embeddings": (BOOL, True), "use_bias": (BOOL.optional(), False),
        }, derive=_derive),
    ),
    stems={"ernie4_5": "Ernie4_5"},
    layer=interleaved_layer(),
    heads=tuple(h for h in HEADS if h.name == "lm"),
    rotary="rotate_half",  # as our leaves hold it (the loader reorders ERNIE's pairs)
    ignored=(),
)


# ---- ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B) -------------------------------------------------

def _use_bias(c) -> bool:
    return bool(c.use_bias)


def sparse_layer(c, i: int) -> bool:
    """Whether layer i holds the mixture: every moe_layer_interval-th layer from moe_layer_start_index
    to moe_layer_end_index (both included), as Ernie4_5_MoeDecoderLayer chooses."""
    return (i + 1) % c.moe_layer_interval == 0 and c.moe_layer_start_index <= i <= c.moe_layer_end_index


def _dense_layer(c, i: int) -> bool:
    return not sparse_layer(c, i)


def _experts(c) -> int:
    return c.moe_num_experts


def shared_width(c) -> int:
    return c.moe_intermediate_size * c.moe_num_shared_experts


def _shared(c) -> bool:
    return c.moe_num_shared_experts > 0


def _untied(c) -> bool:
    return not c.tie_word_embeddings


def _lm_tied(c):
    return {"lm_head.weight": "embeddings/word/embedding"} if c.tie_word_embeddings else {}


def _in(in_layer, tensors, stacked=None):
    return tuple(dataclasses.replace(t, in_layer=in_layer, stacked=stacked) for t in tensors)


def _when(condition, tensors):
    return tuple(dataclasses.replace(t, when=condition if t.when is None else (lambda c, w=t.when: condition(c) and w(c))) for t in tensors)


# the correction bias is stored (1, E): one group of experts
_ROW = Convert("row", lambda a, c: (a.reshape(-1),), lambda t, c: t[0].reshape(1, -1))
_A, _MOE, _MOE_AT = "layers.{i}.self_attn", "layers.{i}.mlp", "layers/{i}/moe"
_SHAPES = {"gate": (_experts, "hidden_size", "moe_intermediate_size"), "up": (_experts, "hidden_size", "moe_intermediate_size"),
           "down": (_experts, "moe_intermediate_size", "hidden_size")}

_MOE_LAYER = (
    *(t for t in interleaved_layer() if t.hf.startswith(("layers.{i}.input_layernorm", "layers.{i}.post_attention_layernorm", f"{_A}.q_proj",
                                                          f"{_A}.k_proj", f"{_A}.v_proj", f"{_A}.o_proj"))),
    *_in(_dense_layer, gated_mlp(_MOE, "layers/{i}/mlp", bias=_use_bias)),
    *_in(sparse_layer, (
        Tensor(f"{_MOE}.gate.weight", (f"{_MOE_AT}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE),
        *_when(_shared, gated_mlp(f"{_MOE}.shared_experts", "layers/{i}/shared_mlp", f=shared_width, bias=_use_bias)),
    )),
    # one tensor per expert, as save_pretrained writes them (the correction bias beside the router, as transformers writes it)
    *_in(sparse_layer, (
        Tensor(f"{_MOE}.moe_statics.e_score_correction_bias", (f"{_MOE_AT}/score_correction",), ((_experts,),), (None,), _ROW),
        *(Tensor(f"{_MOE}.experts.{{e}}.{proj}_proj.weight", (f"{_MOE_AT}/{proj}/kernel",), (_SHAPES[proj],), (2 if proj == "down" else 1,),
                 TRANSPOSE, experts=_experts) for proj in ("gate", "up", "down")),
    ), stacked=False),
    # stacked, as transformers 5 holds them in memory (the correction bias inside the router)
    *_in(sparse_layer, (
        Tensor(f"{_MOE}.gate.moe_statics.e_score_correction_bias", (f"{_MOE_AT}/score_correction",), ((_experts,),), (None,), _ROW),
        Tensor(f"{_MOE}.experts.gate_up_proj", (f"{_MOE_AT}/gate/kernel", f"{_MOE_AT}/up/kernel"), (_SHAPES["gate"],) * 2, (1, 1), STACKED_GATE_UP),
        Tensor(f"{_MOE}.experts.down_proj", (f"{_MOE_AT}/down/kernel",), (_SHAPES["down"],), (2,), STACKED_TRANSPOSE),
    ), stacked=True),
)

# Ernie4_5_MoeForCausalLM's lm_head has a bias with use_bias (its own where the kernel is the tied embedding)
_LM = linear("lm_head", "lm_head", "hidden_size", "vocab_size", bias=_use_bias, reads=True)
_MOE_HEADS = (Head("lm", "ForCausalLM", (dataclasses.replace(_LM[0], when=_untied), _LM[1]), markers=("lm_head.weight", "lm_head.bias"),
                   tied=_lm_tied, forward=True),)

_MOE_FOLDS = (
    (r"layers/(\d+)/attention_norm/scale", r"layers/\1/attention/(query|key|value)/kernel"),
    MIXTURE_FOLD,
    (r"final_norm/scale", r"lm_head/kernel"),
)


def _derive_moe(values: dict, raw) -> None:
    """Ernie4_5_MoeConfig: moe_layer_end_index -1 is the last layer; RoPE theta 500000 by default;
    the sizes the mixture is built from (declared optional) checked where transformers fails on them."""
    if values["moe_layer_end_index"] == -1:
        values["moe_layer_end_index"] = values["num_hidden_layers"] - 1
    missing = [k for k in ("moe_k", "moe_num_experts", "moe_num_shared_experts", "moe_layer_start_index", "moe_layer_end_index",
                           "moe_layer_interval", "moe_norm_min") if values[k] is None]
    if missing:
        raise InputError(f"{missing} are null: transformers' Ernie4_5_MoeModel builds and routes its mixture from them")
    if values["moe_layer_interval"] < 1:
        raise InputError(f"moe_layer_interval={values['moe_layer_interval']}: transformers takes layer i + 1 modulo it; expected >= 1")
    if values["moe_k"] > values["moe_num_experts"]:
        raise InputError(f"moe_k={values['moe_k']} exceeds moe_num_experts={values['moe_num_experts']}")
    if (values["num_nextn_predict_layers"] or 0) > 1:
        raise InputError(f"num_nextn_predict_layers={values['num_nextn_predict_layers']}: Ernie 4.5 MoE supports a single MTP layer (transformers refuses more)")
    if values["num_key_value_heads"] is None:
        raise InputError("num_key_value_heads is null: transformers' Ernie4_5_MoeAttention divides the heads by it (its config has no default for null)")
    head_dim = values["head_dim"]  # no field of Ernie4_5_MoeConfig: the attention takes config.json's, else hidden_size / heads
    if is_odd_rope_dim(head_dim):
        raise InputError(f"head_dim={head_dim}: RoPE needs an even head dimension")
    values["rope_parameters"] = rope_parameters_of(values, raw, default_theta=500000.0)
    resolve_layer_types(values, raw.get("layer_types"), supported=False)


ERNIE4_5_MOE = dataclasses.replace(
    LLAMA,
    name="ernie4_5_moe",
    configs=(
        schema("ernie4_5_moe", "Ernie4_5_MoeConfig", {
            **sizes(103424, 2560, 12288, 28, 20), "num_key_value_heads": (INT.optional(), 4), "head_dim": (INT.optional(), None),
            "max_position_embeddings": (INT, 131072), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
            "pad_token_id": (INT.optional(), 0), "tie_word_embeddings": (BOOL, True), "use_bias": (BOOL.optional(), False),
            "moe_intermediate_size": (INT, 1536), "moe_k": (INT.optional(), 6), "moe_num_experts": (INT.optional(), 64),
            "moe_num_shared_experts": (INT.optional(), 2), "moe_layer_start_index": (INT.optional(), 1), "moe_layer_end_index": (INT.optional(), -1),
            "moe_layer_interval": (INT.optional(), 1), "moe_norm_min": (FLOAT.optional(), 1e-12), "num_nextn_predict_layers": (INT.optional(), None),
        }, derive=_derive_moe, aliases={"num_experts": "moe_num_experts", "num_experts_per_tok": "moe_k", "num_mtp_layers": "num_nextn_predict_layers"}),
    ),
    stems={"ernie4_5_moe": "Ernie4_5_Moe"},
    layer=_MOE_LAYER,
    heads=_MOE_HEADS,
    norm=Norm("rmsnorm", placement="pre", folds=_MOE_FOLDS),
    rotary="rotate_half",  # as our leaves hold it (the loader reorders ERNIE's pairs)
    build=lambda config, layout, dtype, rngs: rj.nets.ernie4_5_moe.Decoder(config, layout, dtype, rngs=rngs),
    rules=MIXTURE_RULES,
    # the multi-token-prediction block of a full checkpoint (transformers' _keys_to_ignore_on_load_unexpected: "mtp")
    ignored=(r"(model\.)?mtp_.*",),
)
