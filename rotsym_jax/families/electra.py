"""ELECTRA: BERT's post-LayerNorm encoder behind embeddings of their own width (embedding_size E), projected
to hidden_size d by `embeddings_project` where E != d, with the discriminator's and the generator's heads.

Leaves (E = embedding_size, d = hidden_size):
    embeddings/{word,position,token_type}/embedding (rows, E), embeddings/norm/{scale,bias} (E,)   where E == d
    embedding_space/...                              the same tables where E != d: a space of their own (no group)
    embedding_space/project/{kernel (E, d), bias (d,)}   HF embeddings_project, where E != d: it writes the stream
    layers/{i}/...                                   as BERT's (families/bert.py)
    task heads (all run here; no pooler):
        sequence_classification  head/dense (d, d), GELU, head/out_proj, on the first token (ElectraClassificationHead)
        pretraining              the discriminator: head/dense (d, d), hidden_act, head/prediction (d, 1), one logit a token
        masked_lm                the generator: head/transform (d, E), GELU, head/transform_norm (E,), then the word
                                 embeddings (tied) or head/decoder (E, vocab) with head/bias (generator_lm_head.bias);
                                 where E != d, head/transform_e, head/transform_e_norm, head/decoder_e (off the stream)
        token_classification     head/token_classifier, question_answering head/qa_outputs, on every token
ElectraForMultipleChoice (its sequence summary) and ElectraForCausalLM are not read.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from .bert import IGNORED, LAYER
from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import Family, Head, Norm, linear, norm, weight


def projected(config) -> bool:
    """Whether the embeddings are projected to the stream (embedding_size != hidden_size: `embeddings_project`)."""
    return config.embedding_size != config.hidden_size


def _direct(config) -> bool:
    return not projected(config)


def _when(tensors, when) -> tuple:
    return tuple(dataclasses.replace(t, when=when) for t in tensors)


def space(config) -> str:
    """Where the embedding tables sit: `embeddings` where they write the stream (E == d), `embedding_space` where
    their width is their own (a leaf has one role on the stream, whatever the config)."""
    return "embedding_space" if projected(config) else "embeddings"


def _tables(at: str, stream: bool) -> tuple:
    axis = 1 if stream else None
    return (*weight("embeddings.word_embeddings.weight", f"{at}/word/embedding", ("vocab_size", "embedding_size"), stream=axis),
            *weight("embeddings.position_embeddings.weight", f"{at}/position/embedding", ("max_position_embeddings", "embedding_size"),
                    stream=axis),
            *weight("embeddings.token_type_embeddings.weight", f"{at}/token_type/embedding", ("type_vocab_size", "embedding_size"),
                    stream=axis),
            *norm("embeddings.LayerNorm", f"{at}/norm", "embedding_size", stream=stream))


def _embeddings() -> tuple:
    # E == d: the tables write the stream, as BERT's; E != d: their space is their own, the projection writes the stream
    return (*_when(_tables("embeddings", True), _direct), *_when(_tables("embedding_space", False), projected),
            *_when(linear("embeddings_project", "embedding_space/project", "embedding_size", "hidden_size", writes=True), projected))


def _untied(config) -> bool:
    return not config.tie_word_embeddings


def _generator() -> tuple:
    """The generator's head: its transform reads the stream and writes the space the decoder reads, which is the
    stream's where E == d (the word embeddings, tied, write the stream; untied, the decoder reads the same space);
    where E != d, the embedding space (leaves `*_e`)."""
    return (
        *_when(linear("generator_predictions.dense", "head/transform", "hidden_size", "embedding_size", reads=True, writes=True), _direct),
        *_when(norm("generator_predictions.LayerNorm", "head/transform_norm", "embedding_size"), _direct),
        *_when(linear("generator_lm_head", "head/decoder", "embedding_size", "vocab_size", bias=False, reads=True),
               lambda c: _untied(c) and _direct(c)),
        *_when(linear("generator_predictions.dense", "head/transform_e", "hidden_size", "embedding_size", reads=True), projected),
        *_when(norm("generator_predictions.LayerNorm", "head/transform_e_norm", "embedding_size", stream=False), projected),
        *_when(linear("generator_lm_head", "head/decoder_e", "embedding_size", "vocab_size", bias=False), lambda c: _untied(c) and projected(c)),
        *weight("generator_lm_head.bias", "head/bias", ("vocab_size",)),
    )


def _generator_tied(config) -> dict:
    return {"generator_lm_head.weight": f"{space(config)}/word/embedding"} if config.tie_word_embeddings else {}


HEADS = (
    Head("sequence_classification", "ForSequenceClassification",
         linear("classifier.dense", "head/dense", "hidden_size", "hidden_size", reads=True)
         + linear("classifier.out_proj", "head/out_proj", "hidden_size", "num_labels"),
         markers=("classifier.out_proj.weight",), forward=True),
    Head("pretraining", "ForPreTraining",
         linear("discriminator_predictions.dense", "head/dense", "hidden_size", "hidden_size", reads=True)
         + linear("discriminator_predictions.dense_prediction", "head/prediction", "hidden_size", 1),
         markers=("discriminator_predictions.dense_prediction.weight",), forward=True),
    Head("masked_lm", "ForMaskedLM", _generator(), markers=("generator_lm_head.bias",), tied=_generator_tied, forward=True),
    Head("token_classification", "ForTokenClassification", linear("classifier", "head/token_classifier", "hidden_size", "num_labels", reads=True),
         markers=("classifier.weight",), forward=True),
    Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", "hidden_size", "num_labels", reads=True),
         markers=("qa_outputs.weight",), loss=False, forward=True),
)


SCHEMA = ConfigSchema("electra", "ElectraConfig", {
    "vocab_size": (INT, 30522), "embedding_size": (INT, 128), "hidden_size": (INT, 256), "num_hidden_layers": (INT, 12),
    "num_attention_heads": (INT, 4), "intermediate_size": (INT, 1024), "hidden_act": (STR, "gelu"), "max_position_embeddings": (INT, 512),
    "type_vocab_size": (INT, 2), "initializer_range": (FLOAT, 0.02), "layer_norm_eps": (FLOAT, 1e-12), "pad_token_id": (INT.optional(), 0),
    "tie_word_embeddings": (BOOL, True), "is_decoder": (BOOL, False), "add_cross_attention": (BOOL, False),
})


ELECTRA = Family(
    name="electra",
    configs=(SCHEMA,),
    stems={"electra": "Electra"},
    prefix="electra.",
    marker="embeddings.word_embeddings.weight",
    embeddings=_embeddings(),
    layer=LAYER,
    final=(),
    heads=HEADS,
    norm=Norm("layernorm", placement="post"),
    build=lambda config, layout, dtype, rngs: rj.nets.electra.Encoder(config, layout, dtype, rngs=rngs),
    rules=((r"embedding_space/.*", None),),  # the stream's groups alone move the projection (its tensors' stream axes)
    ignored=(*IGNORED, r"(\w+\.)?embeddings\.token_type_ids"),
    unsupported=(("add_cross_attention", "a decoder's cross-attention"), ("is_decoder", "causal self-attention (ElectraForCausalLM)")),
)
