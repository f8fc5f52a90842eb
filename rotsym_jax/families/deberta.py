"""DeBERTa-v2 and v3 encoders (model type deberta-v2; post-LayerNorm, disentangled attention), with
every task head transformers defines; our forward pass (`nets/deberta.py`) runs the base model and
the heads marked forward below, so that data flows through them (activations, learned alignment,
Fisher, RegMean, barriers).

Disentangled attention (He et al. 2021) adds to each head's content score q . k the content-to-
position score q . k_r and the position-to-content score k . q_r, where k_r and q_r project the
shared relative-position embeddings (`encoder.rel_embeddings`, after `encoder.LayerNorm` where
`norm_rel_ebd` says layer_norm). With `share_att_key` (DeBERTa-v3) they are projected by the same
`key_proj` and `query_proj` as the tokens; otherwise by `pos_key_proj` (c2p) and `pos_query_proj`
(p2c). Either way, a head's rotation R and scale s of Q and K keep every score, provided k_r moves
as k does (R, 1/s) and q_r as q does (R, s): our leaves `attention/pos_key` and `attention/pos_query`
are tagged as members of K and Q (`RULES`). The relative embeddings and their norm are
read by those projections as the tokens' stream is: a residual transform moves them with the stream.

Leaves (d = hidden_size, f = intermediate_size, H = num_attention_heads, dh = d // H):
    embeddings/word/embedding            (vocab_size, d)
    embeddings/position/embedding        (max_position_embeddings, d)  position_biased_input
    embeddings/token_type/embedding      (type_vocab_size, d)           type_vocab_size > 0
    embeddings/norm/{scale,bias}         (d,)
    embeddings/relative/embedding        (2 * buckets, d)  relative_attention (buckets: position_buckets
                                         where > 0, else max_relative_positions, else max_position_embeddings)
    embeddings/relative_norm/{scale,bias}  (d,)  norm_rel_ebd holds layer_norm
    layers/{i}/attention/{query,key,value}/{kernel (d, H*dh), bias}
    layers/{i}/attention/pos_key/{kernel,bias}    relative_attention, not share_att_key, c2p
    layers/{i}/attention/pos_query/{kernel,bias}  relative_attention, not share_att_key, p2c
    layers/{i}/attention/out/{kernel (H*dh, d), bias}, layers/{i}/attention_norm/{scale,bias}
    layers/{i}/mlp/up/{kernel (d, f), bias}, layers/{i}/mlp/down/{kernel (f, d), bias}, layers/{i}/mlp_norm/...
    task heads (the pooler of the sequence and multiple-choice classifiers, transformers' ContextPooler,
    is part of their head, `head/pooler`):
        sequence_classification  head/pooler, head/classifier                            (forward)
        multiple_choice          head/pooler, head/classifier (one score per choice)
        token_classification     head/token_classifier                                   (forward)
        question_answering       head/qa_outputs                                         (forward)
        masked_lm                (forward) head/transform, head/transform_norm, head/bias; the word embeddings as
                                 decoder (legacy: cls.predictions.*, tied, or head/decoder untied;
                                 legacy=false: lm_predictions.lm_head.*, always the embeddings)
Refused by name: a convolution after the first layer (conv_kernel_size > 0, DeBERTa-v2-xlarge's),
an embedding narrower than the model (embedding_size != hidden_size: embed_proj), a head width other
than hidden_size / num_attention_heads, and a pooler width other than hidden_size.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from .config import BOOL, FLOAT, INT, STR, ConfigSchema, Kind
from .family import Family, Head, Norm, embedding, linear, multi_head_geometry, norm, weight

POS_ATT_TYPE = Kind("a list of strings, a string (c2p|p2c) or null",
                    lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)))


def _derive(values: dict, raw) -> None:
    # DebertaV2Config: "c2p|p2c" is read as ["c2p", "p2c"]; the pooler is hidden_size wide unless given
    if isinstance(values["pos_att_type"], str):
        values["pos_att_type"] = [x.strip() for x in values["pos_att_type"].lower().split("|")]
    if "pooler_hidden_size" not in raw:
        values["pooler_hidden_size"] = values["hidden_size"]


SCHEMA = ConfigSchema("deberta-v2", "DebertaV2Config", {
    "vocab_size": (INT, 128100), "hidden_size": (INT, 1536), "num_hidden_layers": (INT, 24), "num_attention_heads": (INT, 24),
    "intermediate_size": (INT, 6144), "hidden_act": (STR, "gelu"), "max_position_embeddings": (INT, 512), "type_vocab_size": (INT, 0),
    "initializer_range": (FLOAT, 0.02), "layer_norm_eps": (FLOAT, 1e-7), "relative_attention": (BOOL, False),
    "max_relative_positions": (INT, -1), "pad_token_id": (INT.optional(), 0), "position_biased_input": (BOOL, True),
    "pos_att_type": (POS_ATT_TYPE, None), "pooler_hidden_act": (STR, "gelu"), "legacy": (BOOL, True), "tie_word_embeddings": (BOOL, True),
    "pooler_hidden_size": (INT.optional(), None),
}, derive=_derive)


def _att_types(config) -> list:
    return list(config.pos_att_type or [])


def _relative(config) -> bool:
    return bool(config.relative_attention)


def relative_rows(config) -> int:
    """Rows of encoder.rel_embeddings: two per bucket (DebertaV2Encoder)."""
    buckets = getattr(config, "position_buckets", -1)
    if buckets > 0:
        return 2 * buckets
    positions = config.max_relative_positions
    return 2 * (positions if positions >= 1 else config.max_position_embeddings)


def _own_position_projection(kind: str):
    return lambda config: _relative(config) and not getattr(config, "share_att_key", False) and kind in _att_types(config)


def normed_relative(config) -> bool:
    return "layer_norm" in [x.strip() for x in str(getattr(config, "norm_rel_ebd", "none")).lower().split("|")]


def _when(tensors: tuple, predicate) -> tuple:
    return tuple(dataclasses.replace(t, when=predicate) for t in tensors)


_EMBEDDINGS = (
    *embedding("embeddings.word_embeddings.weight", "embeddings/word/embedding", "vocab_size"),
    *_when(embedding("embeddings.position_embeddings.weight", "embeddings/position/embedding", "max_position_embeddings"),
           lambda c: c.position_biased_input),
    *_when(embedding("embeddings.token_type_embeddings.weight", "embeddings/token_type/embedding", "type_vocab_size"),
           lambda c: c.type_vocab_size > 0),
    *norm("embeddings.LayerNorm", "embeddings/norm"),
    *_when(embedding("encoder.rel_embeddings.weight", "embeddings/relative/embedding", relative_rows), _relative),
    *_when(norm("encoder.LayerNorm", "embeddings/relative_norm"), normed_relative),
)

_SELF = "encoder.layer.{i}.attention.self"
_LAYER = (
    *(t for proj in ("query", "key", "value")
      for t in linear(f"{_SELF}.{proj}_proj", f"layers/{{i}}/attention/{proj}", "hidden_size", "hidden_size", reads=True)),
    *_when(linear(f"{_SELF}.pos_key_proj", "layers/{i}/attention/pos_key", "hidden_size", "hidden_size", reads=True),
           _own_position_projection("c2p")),
    *_when(linear(f"{_SELF}.pos_query_proj", "layers/{i}/attention/pos_query", "hidden_size", "hidden_size", reads=True),
           _own_position_projection("p2c")),
    *linear("encoder.layer.{i}.attention.output.dense", "layers/{i}/attention/out", "hidden_size", "hidden_size", writes=True),
    *norm("encoder.layer.{i}.attention.output.LayerNorm", "layers/{i}/attention_norm"),
    *linear("encoder.layer.{i}.intermediate.dense", "layers/{i}/mlp/up", "hidden_size", "intermediate_size", reads=True),
    *linear("encoder.layer.{i}.output.dense", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", writes=True),
    *norm("encoder.layer.{i}.output.LayerNorm", "layers/{i}/mlp_norm"),
)


def _legacy(config) -> bool:
    return bool(config.legacy)


def _masked_lm() -> Head:
    """Legacy (the default): cls.predictions' transform, bias, and a decoder tied to the word
    embeddings (its bias to cls.predictions.bias) or its own; legacy=false: lm_predictions.lm_head's
    transform and bias, the decoder always the word embeddings (nothing tied, nothing stored). The
    transform reads the stream and writes the space the word embeddings decode: a residual
    transform moves both of its axes, and the norm after it."""
    tensors = (
        *_when(linear("cls.predictions.transform.dense", "head/transform", "hidden_size", "hidden_size", reads=True, writes=True), _legacy),
        *_when(norm("cls.predictions.transform.LayerNorm", "head/transform_norm"), _legacy),
        *_when(weight("cls.predictions.bias", "head/bias", ("vocab_size",)), _legacy),
        *_when(linear("cls.predictions.decoder", "head/decoder", "hidden_size", "vocab_size", reads=True),
               lambda c: c.legacy and not c.tie_word_embeddings),
        *_when(linear("lm_predictions.lm_head.dense", "head/transform", "hidden_size", "hidden_size", reads=True, writes=True),
               lambda c: not c.legacy),
        *_when(norm("lm_predictions.lm_head.LayerNorm", "head/transform_norm"), lambda c: not c.legacy),
        *_when(weight("lm_predictions.lm_head.bias", "head/bias", ("vocab_size",)), lambda c: not c.legacy),
    )

    def tied(config):
        if not (config.legacy and config.tie_word_embeddings):
            return {}
        return {"cls.predictions.decoder.weight": "embeddings/word/embedding", "cls.predictions.decoder.bias": "head/bias"}

    return Head("masked_lm", "ForMaskedLM", tensors, markers=("cls.predictions.bias",), tied=tied, forward=True)


def _pooled(outputs) -> tuple:
    """ContextPooler (the first token, dense, activation) and the classifier on it."""
    return (linear("pooler.dense", "head/pooler", "hidden_size", "hidden_size", reads=True)
            + linear("classifier", "head/classifier", "hidden_size", outputs))


HEADS = (
    Head("sequence_classification", "ForSequenceClassification", _pooled("num_labels"), markers=("pooler.dense.weight", "classifier.weight"),
         forward=True),
    Head("multiple_choice", "ForMultipleChoice", _pooled(1)),
    Head("token_classification", "ForTokenClassification",
         linear("classifier", "head/token_classifier", "hidden_size", "num_labels", reads=True), markers=("classifier.weight",), forward=True),
    Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", "hidden_size", "num_labels", reads=True),
         markers=("qa_outputs.weight",), loss=False, forward=True),
    _masked_lm(),
)


def head_geometry(config):
    """Heads of hidden_size / num_attention_heads, no RoPE; the configs whose tensors or symmetries
    this record does not describe are refused here, by name."""
    refusals = []
    if getattr(config, "conv_kernel_size", 0) > 0:
        refusals.append(f"conv_kernel_size={config.conv_kernel_size} (a convolution beside the first layer, DeBERTa-v2-xlarge's)")
    if getattr(config, "embedding_size", config.hidden_size) != config.hidden_size:
        refusals.append(f"embedding_size={config.embedding_size} != hidden_size={config.hidden_size} (an embedding projection)")
    if config.hidden_size % config.num_attention_heads:
        refusals.append(f"hidden_size={config.hidden_size} not a multiple of num_attention_heads={config.num_attention_heads}")
    elif getattr(config, "attention_head_size", None) not in (None, config.hidden_size // config.num_attention_heads):
        refusals.append(f"attention_head_size={config.attention_head_size} (heads wider or narrower than hidden_size / heads)")
    if config.pooler_hidden_size != config.hidden_size:
        refusals.append(f"pooler_hidden_size={config.pooler_hidden_size} != hidden_size={config.hidden_size}")
    if refusals:
        raise InputError(f"deberta-v2: {'; '.join(refusals)} is not supported")
    return multi_head_geometry(config)


# The positions' own projections (not share_att_key): the keys' (c2p) move with K, the queries' (p2c) with Q.
_LAYER_RE = r"layers/(?P<layer>\d+)"
RULES = (
    (rf"{_LAYER_RE}/attention/pos_key/kernel", (None, "attn.k")),
    (rf"{_LAYER_RE}/attention/pos_key/bias", ("attn.k",)),
    (rf"{_LAYER_RE}/attention/pos_query/kernel", (None, "attn.q")),
    (rf"{_LAYER_RE}/attention/pos_query/bias", ("attn.q",)),
)

DEBERTA_V2 = Family(
    name="deberta",
    configs=(SCHEMA,),
    stems={"deberta-v2": "DebertaV2"},
    prefix="deberta.",
    marker="embeddings.word_embeddings.weight",
    embeddings=_EMBEDDINGS,
    layer=_LAYER,
    final=(),
    heads=HEADS,
    norm=Norm("layernorm", placement="post"),
    build=lambda config, layout, dtype, rngs: rj.nets.deberta.Encoder(config, layout, dtype, rngs=rngs),
    ignored=(r"(deberta\.)?embeddings\.position_ids", r"mask_predictions\..*"),
    head_geometry=head_geometry,
    rules=RULES,
    zero_sizes=("type_vocab_size",),
)
