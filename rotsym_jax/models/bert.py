"""BERT and RoBERTa encoders (post-LayerNorm), with pooler and sequence-classification heads.

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
    head (sequence_classification):
        BERT:    head/classifier/{kernel (d, num_labels), bias}, on the pooler output
        RoBERTa: head/dense/{kernel (d, d), bias}, head/out_proj/{kernel (d, num_labels), bias},
                 on the first token's hidden state
Inputs: input_ids (B, T), attention_mask (B, T) 1 = token 0 = padding, token_type_ids, position_ids.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import Family, Layout, copy, detect_prefix, layer_norm, linear
from .layers import MLP, Attention, LayerNorm, attention_bias, dense, embed


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, config.initializer_range
        self.word = embed(config.vocab_size, d, dtype=dtype, rngs=rngs, std=std)
        self.position = embed(config.max_position_embeddings, d, dtype=dtype, rngs=rngs, std=std)
        self.token_type = embed(config.type_vocab_size, d, dtype=dtype, rngs=rngs, std=std)
        self.norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)

    def __call__(self, input_ids, token_type_ids, position_ids):
        x = self.word(input_ids) + self.token_type(token_type_ids) + self.position(position_ids)
        return self.norm(x)


class EncoderLayer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, config.initializer_range
        self.attention = Attention(d, num_heads=config.num_attention_heads, dtype=dtype, rngs=rngs, std=std)
        self.attention_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(d, config.intermediate_size, act=config.hidden_act, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)

    def __call__(self, x, bias):
        x = self.attention_norm(x + self.attention(x, bias))
        return self.mlp_norm(x + self.mlp(x))


class Pooler(nnx.Module):
    def __init__(self, d, dtype, rngs, std):
        self.dense = dense(d, d, bias=True, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x):
        return jnp.tanh(self.dense(x[:, 0]))


class BertClassifier(nnx.Module):
    def __init__(self, d, num_labels, dtype, rngs, std):
        self.classifier = dense(d, num_labels, bias=True, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, hidden, pooled):
        return self.classifier(pooled)


class RobertaClassifier(nnx.Module):
    def __init__(self, d, num_labels, dtype, rngs, std):
        self.dense = dense(d, d, bias=True, dtype=dtype, rngs=rngs, std=std)
        self.out_proj = dense(d, num_labels, bias=True, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, hidden, pooled):
        return self.out_proj(jnp.tanh(self.dense(hidden[:, 0])))


class Encoder(nnx.Module):
    """BERT (`roberta=False`) or RoBERTa (`roberta=True`: positions count non-padding tokens from
    padding_idx + 1, and the classification head reads the first token)."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs, roberta: bool):
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type={config.position_embedding_type!r} is not supported (only 'absolute')"
            )
        d, std = config.hidden_size, config.initializer_range
        self.roberta = roberta
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([EncoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.pooler = Pooler(d, dtype, rngs, std) if layout.pooler else None
        if layout.head == "sequence_classification":
            if roberta:
                self.head = RobertaClassifier(d, config.num_labels, dtype, rngs, std)
            else:
                if not layout.pooler:
                    raise ValueError("BERT sequence classification reads the pooler: layout.pooler must be True")
                self.head = BertClassifier(d, config.num_labels, dtype, rngs, std)
        elif layout.head is None:
            self.head = None
        else:
            raise ValueError(f"unsupported head {layout.head!r} for BERT/RoBERTa; use None or 'sequence_classification'")

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None):
        b, t = input_ids.shape
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        if position_ids is None:
            if self.roberta:
                not_pad = (input_ids != self.pad_token_id).astype(jnp.int32)
                position_ids = jnp.cumsum(not_pad, axis=1) * not_pad + self.pad_token_id
            else:
                position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        x = self.embeddings(input_ids, token_type_ids, position_ids)
        bias = attention_bias(attention_mask, t, causal=False)
        for layer in self.layers:
            x = layer(x, bias)
        out = {"last_hidden_state": x}
        pooled = None
        if self.pooler is not None:
            pooled = out["pooler_output"] = self.pooler(x)
        if self.head is not None:
            out["logits"] = self.head(x, pooled)
        return out


def _tensors(config, layout: Layout, *, roberta: bool):
    n = layout.name
    rules = [
        copy(n("embeddings.word_embeddings.weight"), "embeddings/word/embedding"),
        copy(n("embeddings.position_embeddings.weight"), "embeddings/position/embedding"),
        copy(n("embeddings.token_type_embeddings.weight"), "embeddings/token_type/embedding"),
        *layer_norm(n("embeddings.LayerNorm"), "embeddings/norm"),
    ]
    for i in range(config.num_hidden_layers):
        hf, ours = n(f"encoder.layer.{i}"), f"layers/{i}"
        for proj in ("query", "key", "value"):
            rules += linear(f"{hf}.attention.self.{proj}", f"{ours}/attention/{proj}")
        rules += linear(f"{hf}.attention.output.dense", f"{ours}/attention/out")
        rules += layer_norm(f"{hf}.attention.output.LayerNorm", f"{ours}/attention_norm")
        rules += linear(f"{hf}.intermediate.dense", f"{ours}/mlp/up")
        rules += linear(f"{hf}.output.dense", f"{ours}/mlp/down")
        rules += layer_norm(f"{hf}.output.LayerNorm", f"{ours}/mlp_norm")
    if layout.pooler:
        rules += linear(n("pooler.dense"), "pooler/dense")
    if layout.head == "sequence_classification":
        if roberta:  # RobertaClassificationHead, under every RoBERTa model_type
            rules += linear("classifier.dense", "head/dense") + linear("classifier.out_proj", "head/out_proj")
        else:
            rules += linear("classifier", "head/classifier")
    return rules


def _detect(names, config, *, prefix, head_marker):
    prefix = detect_prefix(names, prefix, "embeddings.word_embeddings.weight")
    head = "sequence_classification" if head_marker in names else None
    return Layout(prefix=prefix, head=head, pooler=prefix + "pooler.dense.weight" in names)


# The transformers class-name stem of each model_type (XLMRobertaModel, CamembertForSequenceClassification, ...).
_STEMS = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert"}


def _architecture(config, layout: Layout) -> str:
    return _STEMS[config.model_type] + ("ForSequenceClassification" if layout.head else "Model")


_IGNORED = (r"(\w+\.)?embeddings\.position_ids",)


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

BERT = Family(
    name="bert",
    prefix="bert.",
    configs=(_schema("bert", "BertConfig", 30522, 0),),
    build=lambda config, layout, dtype, rngs: Encoder(config, layout, dtype, rngs=rngs, roberta=False),
    tensors=lambda config, layout: _tensors(config, layout, roberta=False),
    detect=lambda names, config: _detect(names, config, prefix="bert.", head_marker="classifier.weight"),
    architecture=_architecture,
    ignored=_IGNORED,
)

ROBERTA = Family(
    name="roberta",
    prefix="roberta.",
    configs=(
        _schema("roberta", "RobertaConfig", 50265, 1),
        _schema("xlm-roberta", "XLMRobertaConfig", 30522, 1),
        _schema("camembert", "CamembertConfig", 30522, 1),
    ),
    build=lambda config, layout, dtype, rngs: Encoder(config, layout, dtype, rngs=rngs, roberta=True),
    tensors=lambda config, layout: _tensors(config, layout, roberta=True),
    detect=lambda names, config: _detect(names, config, prefix="roberta.", head_marker="classifier.out_proj.weight"),
    architecture=_architecture,
    ignored=_IGNORED,
)
