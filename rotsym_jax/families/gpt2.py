"""GPT-2: a pre-LayerNorm causal decoder with learned positions and an LM head tied to the
token embedding.

Leaves (d = n_embd, f = n_inner or 4 d, H = n_head, dh = d // H):
    embeddings/word/embedding        (vocab_size, d)       also the LM head: logits = x @ word^T
    embeddings/position/embedding    (n_positions, d)
    layers/{i}/attention_norm/{scale,bias}   (d,)   ln_1, before attention
    layers/{i}/attention/{query,key,value}/kernel (d, H*dh), .../bias (H*dh,)
        the thirds of HF's fused attn.c_attn (Conv1D weight (d, 3d), bias (3d,))
    layers/{i}/attention/out/kernel  (H*dh, d), layers/{i}/attention/out/bias (d,)   attn.c_proj
    layers/{i}/mlp_norm/{scale,bias}         (d,)   ln_2, before the MLP
    layers/{i}/mlp/up/kernel (d, f), layers/{i}/mlp/up/bias (f,)       mlp.c_fc
    layers/{i}/mlp/down/kernel (f, d), layers/{i}/mlp/down/bias (d,)   mlp.c_proj
    final_norm/{scale,bias}          (d,)   ln_f
    task heads (the records at the bottom; those marked forward run here):
        lm                       GPT2LMHeadModel: tied to wte (no leaf; a stored lm_head.weight equal
                                 to wte is wte; one that differs is read as the untied model's, which
                                 transformers computes), or, with tie_word_embeddings=False,
                                 lm_head/kernel (d, V)
                                                                                           (forward)
        sequence_classification  head/score (d, num_labels), no bias, on the last token that is
                                 not padding                                               (forward)
        token_classification     head/token_classifier on every token                     (forward)
        question_answering       head/qa_outputs (d, 2): start and end logits              (forward)
        double_heads             GPT2DoubleHeadsModel: the LM head and head/summary (d, 1)
Inputs: input_ids (B, T), attention_mask (B, T) 1 = token 0 = padding, position_ids (default arange).
Outputs: last_hidden_state (after ln_f) and the head's logits.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import Family, Head, Norm, Tensor, embedding, linear, norm, pre_norm_folds, split


def _inner(config) -> int:
    return config.n_inner if config.n_inner is not None else 4 * config.n_embd


# attn.c_attn (Conv1D, already (in, out)) holds [query | key | value] along its last axis.
_QKV = tuple(f"layers/{{i}}/attention/{proj}" for proj in ("query", "key", "value"))
_LAYER = (
    *norm("h.{i}.ln_1", "layers/{i}/attention_norm", "n_embd"),
    Tensor("h.{i}.attn.c_attn.weight", tuple(f"{m}/kernel" for m in _QKV), (("n_embd", "n_embd"),) * 3, (0, 0, 0), split(3)),
    Tensor("h.{i}.attn.c_attn.bias", tuple(f"{m}/bias" for m in _QKV), (("n_embd",),) * 3, (None, None, None), split(3)),
    *linear("h.{i}.attn.c_proj", "layers/{i}/attention/out", "n_embd", "n_embd", writes=True, transpose=False),
    *norm("h.{i}.ln_2", "layers/{i}/mlp_norm", "n_embd"),
    *linear("h.{i}.mlp.c_fc", "layers/{i}/mlp/up", "n_embd", _inner, reads=True, transpose=False),
    *linear("h.{i}.mlp.c_proj", "layers/{i}/mlp/down", _inner, "n_embd", writes=True, transpose=False),
)


def _untied(config) -> bool:
    return not config.tie_word_embeddings


def _lm_tied(config):
    return {"lm_head.weight": "embeddings/word/embedding"} if config.tie_word_embeddings else {}


# A decoder's own LM head (untied) merges like the body: not under head/.
_LM = tuple(dataclasses.replace(t, when=_untied) for t in linear("lm_head", "lm_head", "n_embd", "vocab_size", bias=False, reads=True))
_HEADS = (
    Head("double_heads", "DoubleHeadsModel", _LM + linear("multiple_choice_head.summary", "head/summary", "n_embd", 1, reads=True),
         markers=("multiple_choice_head.summary.weight",), tied=_lm_tied),
    Head("lm", "LMHeadModel", _LM, markers=("lm_head.weight",), tied=_lm_tied, forward=True),
    Head("sequence_classification", "ForSequenceClassification", linear("score", "head/score", "n_embd", "num_labels", bias=False, reads=True),
         markers=("score.weight",), forward=True),
    Head("token_classification", "ForTokenClassification", linear("classifier", "head/token_classifier", "n_embd", "num_labels", reads=True),
         markers=("classifier.weight",), forward=True),
    Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", "n_embd", 2, reads=True),
         markers=("qa_outputs.weight",), loss=False, forward=True),
)


# The norms before attention, the MLP and the heads: each gain (and bias) folds into the layers
# that read it. A tied LM head reads the final norm too: then it has no fold (Family.residual_spec).
_FOLDS = pre_norm_folds("up", r"(lm_head|head/(score|token_classifier|qa_outputs|summary))")


SCHEMA = ConfigSchema("gpt2", "GPT2Config", {
    "vocab_size": (INT, 50257), "n_positions": (INT, 1024), "n_embd": (INT, 768), "n_layer": (INT, 12),
    "n_head": (INT, 12), "n_inner": (INT.optional(), None), "activation_function": (STR, "gelu_new"),
    "layer_norm_epsilon": (FLOAT, 1e-5), "initializer_range": (FLOAT, 0.02), "scale_attn_weights": (BOOL, True),
    "scale_attn_by_inverse_layer_idx": (BOOL, False), "reorder_and_upcast_attn": (BOOL, False),
    "add_cross_attention": (BOOL, False), "tie_word_embeddings": (BOOL, True), "pad_token_id": (INT.optional(), None),
}, aliases={"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
            "num_hidden_layers": "n_layer"})

GPT2 = Family(
    name="gpt2",
    configs=(SCHEMA,),
    stems={"gpt2": "GPT2"},
    prefix="transformer.",
    marker="wte.weight",
    embeddings=embedding("wte.weight", "embeddings/word/embedding", "vocab_size", "n_embd")
    + embedding("wpe.weight", "embeddings/position/embedding", "n_positions", "n_embd"),
    layer=_LAYER,
    final=norm("ln_f", "final_norm", "n_embd"),
    heads=_HEADS,
    # The original OpenAI checkpoints store an LM model with bare names; their config says so.
    default_head="lm",
    norm=Norm("layernorm", placement="pre", folds=_FOLDS),
    num_layers="n_layer",
    build=lambda config, layout, dtype, rngs: rj.nets.gpt2.GPT2Decoder(config, layout, dtype, rngs=rngs),
    unsupported=(("add_cross_attention", "an encoder-decoder GPT-2's cross-attention"),),
    # Causal-mask buffers that older transformers versions saved with the weights.
    ignored=(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",),
)
