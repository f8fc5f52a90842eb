"""DistilBERT: BERT's post-LayerNorm encoder without token types or a pooler, under other names.

Leaves (d = dim, f = hidden_dim, H = n_heads; transformers' aliases hidden_size, num_attention_heads
and num_hidden_layers read the same keys):
    embeddings/word/embedding        (vocab_size, d)        HF embeddings.word_embeddings
    embeddings/position/embedding    (max_position_embeddings, d)   learned or sinusoidal (stored alike)
    embeddings/norm/{scale,bias}     (d,)                   HF embeddings.LayerNorm
    layers/{i}/attention/{query,key,value,out}   HF transformer.layer.{i}.attention.{q,k,v,out}_lin
    layers/{i}/attention_norm/{scale,bias}       HF sa_layer_norm, after the attention residual
    layers/{i}/mlp/{up,down}                     HF ffn.lin1, ffn.lin2
    layers/{i}/mlp_norm/{scale,bias}             HF output_layer_norm, after the FFN residual
    task heads (all run here but multiple choice):
        masked_lm                head/transform (HF vocab_transform), head/transform_norm
                                 (vocab_layer_norm), head/bias (vocab_projector.bias); the decoder
                                 is the word embeddings (tied, as transformers ties it)
        sequence_classification  head/pre_classifier (d, d), ReLU, head/classifier on the first token
        token_classification     head/token_classifier on every token
        question_answering       head/qa_outputs on every token: start and end logits
        multiple_choice          head/pre_classifier, head/classifier (one score per choice)
Every LayerNorm has eps 1e-12 (transformers hard-codes it). Inputs: input_ids, attention_mask.
"""

from __future__ import annotations

import rotsym_jax as rj

from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import Family, Head, Norm, embedding, linear, norm, weight

_L = "transformer.layer.{i}"
_LAYER = (
    *(t for ours, hf in (("query", "q_lin"), ("key", "k_lin"), ("value", "v_lin"))
      for t in linear(f"{_L}.attention.{hf}", f"layers/{{i}}/attention/{ours}", "hidden_size", "hidden_size", reads=True)),
    *linear(f"{_L}.attention.out_lin", "layers/{i}/attention/out", "hidden_size", "hidden_size", writes=True),
    *norm(f"{_L}.sa_layer_norm", "layers/{i}/attention_norm"),
    *linear(f"{_L}.ffn.lin1", "layers/{i}/mlp/up", "hidden_size", "hidden_dim", reads=True),
    *linear(f"{_L}.ffn.lin2", "layers/{i}/mlp/down", "hidden_dim", "hidden_size", writes=True),
    *norm(f"{_L}.output_layer_norm", "layers/{i}/mlp_norm"),
)
_CLASSIFIER = (*linear("pre_classifier", "head/pre_classifier", "hidden_size", "hidden_size", reads=True),
               *linear("classifier", "head/classifier", "hidden_size", "num_labels"))
_HEADS = (
    # The decoder is the word embeddings: transformers ties vocab_projector.weight to them (saved
    # without it); vocab_projector.bias is the head's own.
    Head("masked_lm", "ForMaskedLM",
         (*linear("vocab_transform", "head/transform", "hidden_size", "hidden_size", reads=True, writes=True),
          *norm("vocab_layer_norm", "head/transform_norm"), *weight("vocab_projector.bias", "head/bias", ("vocab_size",))),
         markers=("vocab_projector.bias",), tied=lambda config: {"vocab_projector.weight": "embeddings/word/embedding"}, forward=True),
    Head("sequence_classification", "ForSequenceClassification", _CLASSIFIER, markers=("pre_classifier.weight",), forward=True),
    Head("token_classification", "ForTokenClassification",
         linear("classifier", "head/token_classifier", "hidden_size", "num_labels", reads=True), markers=("classifier.weight",), forward=True),
    Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", "hidden_size", 2, reads=True),
         markers=("qa_outputs.weight",), loss=False, forward=True),
    Head("multiple_choice", "ForMultipleChoice", (*linear("pre_classifier", "head/pre_classifier", "hidden_size", "hidden_size", reads=True),
                                                  *linear("classifier", "head/classifier", "hidden_size", 1))),
)

DISTILBERT = Family(
    name="distilbert",
    configs=(ConfigSchema("distilbert", "DistilBertConfig", {
        "vocab_size": (INT, 30522), "max_position_embeddings": (INT, 512), "sinusoidal_pos_embds": (BOOL, False), "n_layers": (INT, 6),
        "n_heads": (INT, 12), "dim": (INT, 768), "hidden_dim": (INT, 3072), "activation": (STR, "gelu"), "initializer_range": (FLOAT, 0.02),
        "pad_token_id": (INT.optional(), 0), "tie_word_embeddings": (BOOL, True),
    }, aliases={"hidden_size": "dim", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers"}),),
    stems={"distilbert": "DistilBert"},
    prefix="distilbert.",
    marker="embeddings.word_embeddings.weight",
    embeddings=(
        *embedding("embeddings.word_embeddings.weight", "embeddings/word/embedding", "vocab_size"),
        *embedding("embeddings.position_embeddings.weight", "embeddings/position/embedding", "max_position_embeddings"),
        *norm("embeddings.LayerNorm", "embeddings/norm"),
    ),
    layer=_LAYER,
    final=(),
    heads=_HEADS,
    norm=Norm("layernorm", placement="post"),
    build=lambda config, layout, dtype, rngs: rj.nets.distilbert.Encoder(config, layout, dtype, rngs=rngs),
    ignored=(r"(distilbert\.)?embeddings\.position_ids",),
    num_layers="n_layers",
)
