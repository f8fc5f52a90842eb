"""GPT-NeoX (Pythia): a pre-LayerNorm causal decoder with partial rotary embeddings, a fused
query-key-value projection interleaved per head, and (by default) a parallel residual: attention
and MLP read the same stream through their own norms and both add to it.

Leaves (d = hidden_size, f = intermediate_size, H = num_attention_heads, dh = d // H):
    embeddings/word/embedding        (vocab_size, d)       HF embed_in
    layers/{i}/attention_norm/{scale,bias}   (d,)   input_layernorm (attention's input)
    layers/{i}/attention/{query,key,value}/kernel (d, H*dh), .../bias (H*dh,)
        HF attention.query_key_value (3 H dh, d), rows ordered [head, (q|k|v), dh]: split per head
    layers/{i}/attention/out/kernel  (H*dh, d), .../bias (d,)   attention.dense
    layers/{i}/mlp_norm/{scale,bias}         (d,)   post_attention_layernorm (the MLP's input)
    layers/{i}/mlp/up/kernel (d, f), .../bias (f,)      mlp.dense_h_to_4h
    layers/{i}/mlp/down/kernel (f, d), .../bias (d,)    mlp.dense_4h_to_h
    final_norm/{scale,bias}          (d,)   final_layer_norm
    task heads (all run here):
        lm                       GPTNeoXForCausalLM: lm_head/kernel (d, V), HF embed_out (tied to
                                 embed_in with tie_word_embeddings)
        sequence_classification  head/score (d, num_labels), no bias, on the last non-padding token
        token_classification     head/token_classifier (d, num_labels) on every token
        question_answering       head/qa_outputs (d, 2): start and end logits
RoPE: rotate_half on the first rotary_dim = dh * partial_rotary_factor entries of each head (pairs
(i, i + rotary_dim/2)), the rest passes; rope_type "default" only.
Inputs: input_ids (B, T), attention_mask (B, T) 1 = token 0 = padding, position_ids (default arange).
Outputs: last_hidden_state (after final_layer_norm) and the head's logits.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry
from .config import BOOL, DICT, FLOAT, INT, STR, ConfigSchema, bad_value, check_number
from .family import Convert, Family, Head, Norm, Tensor, embedding, linear, norm, pre_norm_folds


def head_dim_of(config) -> int:
    return config.hidden_size // config.num_attention_heads


def head_geometry_of(config) -> HeadGeometry:
    """Multi-head; RoPE on the first rotary_dim entries of each head. Refuses what the forward pass
    and the group would get wrong: another rope type, a rotary part that is not an even width."""
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type != "default":
        raise InputError(f"rope_parameters.rope_type={rope_type!r} is not supported for GPT-NeoX (only 'default')")
    rotary = head_dim_of(config) * config.rope_parameters["partial_rotary_factor"]
    if rotary != int(rotary) or int(rotary) % 2:
        raise InputError(f"partial_rotary_factor={config.rope_parameters['partial_rotary_factor']} gives {rotary} rotary dims of a "
                         f"{head_dim_of(config)}-wide head; an even whole number is supported")
    heads_ = config.num_attention_heads
    return HeadGeometry(heads_, heads_, head_dim_of(config), rotary_dim=int(rotary) or None)


def _split_heads(weight: np.ndarray, config) -> tuple[np.ndarray, ...]:
    """HF's fused (3 H dh[, d]) -> q, k, v (H dh[, d]): its rows are [head, (q|k|v), dh]."""
    h, dh = config.num_attention_heads, head_dim_of(config)
    fused = weight.reshape((h, 3, dh) + weight.shape[1:])
    return tuple(fused[:, j].reshape((h * dh,) + weight.shape[1:]) for j in range(3))


def _fuse_heads(parts, config) -> np.ndarray:
    h, dh = config.num_attention_heads, head_dim_of(config)
    rest = parts[0].shape[1:]
    return np.stack([p.reshape((h, dh) + rest) for p in parts], axis=1).reshape((3 * h * dh,) + rest)


# The kernel: HF (3 H dh, d) -> ours (d, H dh) each; the bias: (3 H dh,) -> (H dh,) each.
_QKV_KERNEL = Convert("qkv_per_head_t", lambda a, c: tuple(x.T for x in _split_heads(a, c)), lambda t, c: _fuse_heads([x.T for x in t], c))
_QKV_BIAS = Convert("qkv_per_head", _split_heads, _fuse_heads)
_QKV = tuple(f"layers/{{i}}/attention/{proj}" for proj in ("query", "key", "value"))


def _bias(config) -> bool:
    return config.attention_bias


_A = "layers.{i}.attention"
_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm"),
    Tensor(f"{_A}.query_key_value.weight", tuple(f"{m}/kernel" for m in _QKV), (("hidden_size", "hidden_size"),) * 3, (0, 0, 0), _QKV_KERNEL),
    Tensor(f"{_A}.query_key_value.bias", tuple(f"{m}/bias" for m in _QKV), (("hidden_size",),) * 3, (None, None, None), _QKV_BIAS, _bias),
    *linear(f"{_A}.dense", "layers/{i}/attention/out", "hidden_size", "hidden_size", bias=_bias, writes=True),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm"),
    *linear("layers.{i}.mlp.dense_h_to_4h", "layers/{i}/mlp/up", "hidden_size", "intermediate_size", reads=True),
    *linear("layers.{i}.mlp.dense_4h_to_h", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", writes=True),
)


def _untied(config) -> bool:
    return not config.tie_word_embeddings


def _lm_tied(config):
    return {"embed_out.weight": "embeddings/word/embedding"} if config.tie_word_embeddings else {}


# transformers' generic task heads of GPT-NeoX and Falcon: score, classifier, qa_outputs
GENERIC_HEADS = (
    Head("sequence_classification", "ForSequenceClassification",
         linear("score", "head/score", "hidden_size", "num_labels", bias=False, reads=True), markers=("score.weight",), forward=True),
    Head("token_classification", "ForTokenClassification",
         linear("classifier", "head/token_classifier", "hidden_size", "num_labels", reads=True), markers=("classifier.weight",), forward=True),
    Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", "hidden_size", 2, reads=True),
         markers=("qa_outputs.weight",), loss=False, forward=True),
)

_HEADS = (
    # The LM head (embed_out) merges like the body: not under head/.
    Head("lm", "ForCausalLM",
         tuple(dataclasses.replace(t, when=_untied) for t in linear("embed_out", "lm_head", "hidden_size", "vocab_size", bias=False, reads=True)),
         markers=("embed_out.weight",), tied=_lm_tied, forward=True),
    *GENERIC_HEADS,
)
# Each layer's two norms read the same stream: the attention's folds into Q/K/V, the MLP's into up.
_FOLDS = pre_norm_folds("up", r"(lm_head|head/(score|token_classifier|qa_outputs))")


def _derive(values: dict, raw) -> None:
    """GPTNeoXConfig: rope_parameters from rope_scaling / rope_parameters, with the legacy
    rotary_emb_base (theta) and rotary_pct (the partial rotary factor, 0.25 by default)."""
    heads_, hidden = values["num_attention_heads"], values["hidden_size"]
    if isinstance(heads_, int) and isinstance(hidden, int) and heads_ > 0 and hidden % heads_:
        raise InputError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads_}")
    params = raw.get("rope_scaling") or values["rope_parameters"] or {}
    if not isinstance(params, dict):
        raise bad_value("rope_parameters", params, DICT.name)
    params = dict(params)
    params.setdefault("rope_theta", raw.get("rotary_emb_base", 10000.0))
    params.setdefault("partial_rotary_factor", raw.get("rotary_pct", 0.25))
    params.setdefault("rope_type", params.get("type", "default"))
    check_number("rope_theta", params["rope_theta"], above_zero=True)
    check_number("partial_rotary_factor", params["partial_rotary_factor"])
    values["rope_parameters"] = params


SCHEMA = ConfigSchema("gpt_neox", "GPTNeoXConfig", {
    "vocab_size": (INT, 50432), "hidden_size": (INT, 6144), "num_hidden_layers": (INT, 44), "num_attention_heads": (INT, 64),
    "intermediate_size": (INT, 24576), "hidden_act": (STR, "gelu"), "max_position_embeddings": (INT, 2048),
    "initializer_range": (FLOAT, 0.02), "layer_norm_eps": (FLOAT, 1e-5), "tie_word_embeddings": (BOOL, False),
    "use_parallel_residual": (BOOL, True), "rope_parameters": (DICT.optional(), None), "attention_bias": (BOOL, True),
    "pad_token_id": (INT.optional(), None),
}, derive=_derive, consumed=("rope_scaling", "rotary_emb_base", "rotary_pct"))


GPT_NEOX = Family(
    name="gpt_neox",
    configs=(SCHEMA,),
    stems={"gpt_neox": "GPTNeoX"},
    prefix="gpt_neox.",
    marker="embed_in.weight",
    embeddings=embedding("embed_in.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("final_layer_norm", "final_norm"),
    heads=_HEADS,
    default_head="lm",
    norm=Norm("layernorm", placement="pre", folds=_FOLDS),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.gpt_neox.NeoXDecoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry_of,
    # Causal-mask and rotary buffers that older transformers versions saved with the weights.
    ignored=(r"(gpt_neox\.)?layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",),
)
