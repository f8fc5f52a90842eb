"""BERT and RoBERTa encoders (post-LayerNorm), with a pooler and every task head transformers defines.

The RoBERTa family also reads `xlm-roberta` (XLM-RoBERTa) and `camembert` (CamemBERT) checkpoints:
transformers' modeling files for both are RoBERTa's, renamed (the same modules and tensor names,
base_model_prefix "roberta", padding_idx position ids, the same classification head); their config
classes differ from RobertaConfig only in the vocab_size default. A checkpoint keeps its
model_type, and is saved with its own class names (XLMRobertaModel, CamembertForSequenceClassification).
Look-alikes that differ are not aliases: xlm-roberta-xl and roberta-prelayernorm are pre-LayerNorm,
data2vec-text names its tensors `data2vec_text.`, xmod adds per-language adapters.

Leaves (d = hidden_size, f = intermediate_size, H = num_attention_heads, dh = d // H):
    embeddings/word/embedding        (vocab_size, d)
    embeddings/position/embedding    (max_position_embeddings, d)
    embeddings/token_type/embedding  (type_vocab_size, d)
    embeddings/norm/{scale,bias}     (d,)
    layers/{i}/attention/{query,key,value}/kernel (d, H*dh), .../bias (H*dh,)
    layers/{i}/attention/out/kernel  (H*dh, d), layers/{i}/attention/out/bias (d,)
    layers/{i}/attention_norm/{scale,bias}   LayerNorm after the attention residual
    layers/{i}/mlp/up/kernel (d, f), layers/{i}/mlp/up/bias (f,)
    layers/{i}/mlp/down/kernel (f, d), layers/{i}/mlp/down/bias (d,)
    layers/{i}/mlp_norm/{scale,bias}         LayerNorm after the FFN residual
    pooler/dense/{kernel (d, d), bias}       when the checkpoint has a pooler
    task heads (the records at the bottom; `nets/heads.py` runs those marked forward):
        sequence_classification  BERT: head/classifier on the pooler output; RoBERTa: head/dense and
                                 head/out_proj on the first token                       (forward)
        token_classification     head/token_classifier on every token                   (forward)
        question_answering       head/qa_outputs on every token: start and end logits   (forward)
        masked_lm                head/transform (dense), head/transform_norm, head/bias, and the
                                 word embeddings as decoder (tied) or head/decoder       (forward)
        next_sentence            BERT: head/seq_relationship on the pooler output       (forward)
        multiple_choice          head/classifier (one score per choice) on the pooler output
        pretraining              BERT: masked_lm's tensors and head/seq_relationship
        lm                       the causal-LM classes (BertLMHeadModel, RobertaForCausalLM):
                                 masked_lm's tensors
Inputs: input_ids (B, T), attention_mask (B, T) 1 = token 0 = padding, token_type_ids, position_ids.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import Family, Head, Norm, embedding, linear, norm, weight


def _embeddings():
    return (
        *embedding("embeddings.word_embeddings.weight", "embeddings/word/embedding", "vocab_size"),
        *embedding("embeddings.position_embeddings.weight", "embeddings/position/embedding", "max_position_embeddings"),
        *embedding("embeddings.token_type_embeddings.weight", "embeddings/token_type/embedding", "type_vocab_size"),
        *norm("embeddings.LayerNorm", "embeddings/norm"),
    )


# public: ELECTRA reads the same layers (families/electra.py)
LAYER = (
    *(t for proj in ("query", "key", "value")
      for t in linear(f"encoder.layer.{{i}}.attention.self.{proj}", f"layers/{{i}}/attention/{proj}", "hidden_size", "hidden_size", reads=True)),
    *linear("encoder.layer.{i}.attention.output.dense", "layers/{i}/attention/out", "hidden_size", "hidden_size", writes=True),
    *norm("encoder.layer.{i}.attention.output.LayerNorm", "layers/{i}/attention_norm"),
    *linear("encoder.layer.{i}.intermediate.dense", "layers/{i}/mlp/up", "hidden_size", "intermediate_size", reads=True),
    *linear("encoder.layer.{i}.output.dense", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", writes=True),
    *norm("encoder.layer.{i}.output.LayerNorm", "layers/{i}/mlp_norm"),
)
_POOLER = linear("pooler.dense", "pooler/dense", "hidden_size", "hidden_size", reads=True)


def _untied(config) -> bool:
    return not config.tie_word_embeddings


def _lm_tensors(module: str, transform: str, transform_norm: str) -> tuple:
    """The LM head: the transform reads the stream and writes the space the decoder reads, which
    is the stream's when the decoder is the word embeddings, so a residual transform moves both
    of its axes (and the norm after it). Tied (tie_word_embeddings), the decoder is the word
    embeddings and its bias is `bias`; untied, transformers ties neither: the decoder has its own
    kernel and bias, and `bias` is kept but unused."""
    return (
        *linear(f"{module}.{transform}", "head/transform", "hidden_size", "hidden_size", reads=True, writes=True),
        *norm(f"{module}.{transform_norm}", "head/transform_norm"),
        *weight(f"{module}.bias", "head/bias", ("vocab_size",)),
        *(dataclasses.replace(t, when=_untied)
          for t in linear(f"{module}.decoder", "head/decoder", "hidden_size", "vocab_size", reads=True)),
    )


def _lm_tied(module: str):
    def tied(config):
        if not config.tie_word_embeddings:
            return {}
        return {f"{module}.decoder.weight": "embeddings/word/embedding", f"{module}.decoder.bias": "head/bias"}

    return tied


def _heads(roberta: bool) -> tuple[Head, ...]:
    token = Head("token_classification", "ForTokenClassification",
                 linear("classifier", "head/token_classifier", "hidden_size", "num_labels", reads=True),
                 markers=("classifier.weight",), needs_no_pooler=True, forward=True)
    qa = Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", "hidden_size", "num_labels", reads=True),
              markers=("qa_outputs.weight",), loss=False, forward=True)
    choice = Head("multiple_choice", "ForMultipleChoice", linear("classifier", "head/classifier", "hidden_size", 1), pooler=True)
    if roberta:
        lm = _lm_tensors("lm_head", "dense", "layer_norm")
        return (
            Head("sequence_classification", "ForSequenceClassification",
                 linear("classifier.dense", "head/dense", "hidden_size", "hidden_size", reads=True)
                 + linear("classifier.out_proj", "head/out_proj", "hidden_size", "num_labels"),
                 markers=("classifier.out_proj.weight",), forward=True),
            token, qa,
            Head("masked_lm", "ForMaskedLM", lm, markers=("lm_head.bias",), tied=_lm_tied("lm_head"), forward=True),
            choice,
            Head("lm", "ForCausalLM", lm, tied=_lm_tied("lm_head")),
        )
    lm = _lm_tensors("cls.predictions", "transform.dense", "transform.LayerNorm")
    nsp = linear("cls.seq_relationship", "head/seq_relationship", "hidden_size", 2)
    return (
        Head("pretraining", "ForPreTraining", lm + nsp, pooler=True, markers=("cls.predictions.bias", "cls.seq_relationship.weight"),
             tied=_lm_tied("cls.predictions")),
        Head("sequence_classification", "ForSequenceClassification", linear("classifier", "head/classifier", "hidden_size", "num_labels"),
             pooler=True, markers=("classifier.weight",), forward=True),
        token, qa,
        Head("masked_lm", "ForMaskedLM", lm, markers=("cls.predictions.bias",), tied=_lm_tied("cls.predictions"), forward=True),
        Head("next_sentence", "ForNextSentencePrediction", nsp, pooler=True, markers=("cls.seq_relationship.weight",), forward=True),
        choice,
        Head("lm", "LMHeadModel", lm, tied=_lm_tied("cls.predictions")),
    )


IGNORED = (r"(\w+\.)?embeddings\.position_ids",)


def _schema(model_type: str, class_name: str, vocab_size: int, pad_token_id: int) -> ConfigSchema:
    """What the encoder reads, with the types and defaults of `class_name` (BertConfig, RobertaConfig,
    XLMRobertaConfig and CamembertConfig declare the same ones but for vocab_size and pad_token_id)."""
    return ConfigSchema(model_type, class_name, {
        "vocab_size": (INT, vocab_size), "hidden_size": (INT, 768), "num_hidden_layers": (INT, 12),
        "num_attention_heads": (INT, 12), "intermediate_size": (INT, 3072), "hidden_act": (STR, "gelu"),
        "max_position_embeddings": (INT, 512), "type_vocab_size": (INT, 2), "initializer_range": (FLOAT, 0.02),
        "layer_norm_eps": (FLOAT, 1e-12), "pad_token_id": (INT.optional(), pad_token_id),
        "tie_word_embeddings": (BOOL, True), "is_decoder": (BOOL, False), "add_cross_attention": (BOOL, False),
    })

def _family(name: str, configs, stems, roberta: bool) -> Family:
    return Family(
        name=name,
        configs=configs,
        stems=stems,
        prefix=f"{name}.",
        marker="embeddings.word_embeddings.weight",
        embeddings=_embeddings(),
        layer=LAYER,
        final=(),
        pooler=_POOLER,
        heads=_heads(roberta),
        norm=Norm("layernorm", placement="post"),
        build=lambda config, layout, dtype, rngs: rj.nets.bert.Encoder(config, layout, dtype, rngs=rngs, roberta=roberta),
        ignored=IGNORED,
        unsupported=(("add_cross_attention", "a decoder's cross-attention"),),
    )


BERT = _family("bert", (_schema("bert", "BertConfig", 30522, 0),), {"bert": "Bert"}, roberta=False)
ROBERTA = _family(
    "roberta",
    (
        _schema("roberta", "RobertaConfig", 50265, 1),
        _schema("xlm-roberta", "XLMRobertaConfig", 30522, 1),
        _schema("camembert", "CamembertConfig", 30522, 1),
    ),
    {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert"},
    roberta=True,
)
