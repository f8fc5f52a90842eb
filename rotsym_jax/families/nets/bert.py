"""The bert forward pass in Flax NNX; its record (tensors, config, heads) is `families/bert.py`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from . import heads
from .layers import MLP, Attention, LayerNorm, attention_bias, dense, embed, multi_head, run_layers


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
        self.attention = Attention(d, heads=multi_head(d, config.num_attention_heads), dtype=dtype, rngs=rngs, std=std)
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


class Encoder(nnx.Module):
    """BERT (`roberta=False`) or RoBERTa (`roberta=True`: positions count non-padding tokens from
    padding_idx + 1, and the classification head reads the first token)."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs, roberta: bool):
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise InputError(
                f"position_embedding_type={config.position_embedding_type!r} is not supported (only 'absolute')"
            )
        d, std = config.hidden_size, config.initializer_range
        self.roberta = roberta
        self.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([EncoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.pooler = Pooler(d, dtype, rngs, std) if layout.pooler else None
        self.head = _head_module(config, layout, roberta, dtype, rngs)

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
        x = run_layers(self.layers, x, lambda i: (bias,))
        out = {"last_hidden_state": x}
        pooled = None
        if self.pooler is not None:
            pooled = out["pooler_output"] = self.pooler(x)
        if self.head is not None:
            out.update(self.head(x, pooled=pooled, input_ids=input_ids, word=self.embeddings.word))
        return out


def _head_module(config, layout: Layout, roberta: bool, dtype, rngs):
    """The Flax head of `layout` (heads.py), None without one; a head without a forward pass here
    is refused by `Family.build` before this runs."""
    d, std, n = config.hidden_size, config.initializer_range, config.num_labels
    kw = dict(dtype=dtype, rngs=rngs, std=std)
    match layout.head:
        case None:
            return None
        case "sequence_classification" if roberta:
            return heads.RobertaClassifier(d, n, **kw)
        case "sequence_classification":
            return heads.Linear("classifier", d, n, reads="pooled", **kw)
        case "next_sentence":
            return heads.Linear("seq_relationship", d, 2, reads="pooled", **kw)
        case "token_classification":
            return heads.Linear("token_classifier", d, n, reads="tokens", **kw)
        case "question_answering":
            return heads.Linear("qa_outputs", d, n, reads="tokens", split=("start_logits", "end_logits"), **kw)
        case "masked_lm":
            return heads.MaskedLM(d, config.vocab_size, act="gelu" if roberta else config.hidden_act, eps=config.layer_norm_eps,
                                  tied=config.tie_word_embeddings, **kw)
    raise InputError(f"head {layout.head!r} has no forward pass")
