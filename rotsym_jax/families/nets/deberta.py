"""The DeBERTa-v2/v3 forward pass in Flax NNX; its record (tensors, config, heads) is
`families/deberta.py`, whose docstring says what disentangled attention adds to each score."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..deberta import normed_relative, relative_rows
from ..family import Layout
from . import heads
from .layers import MLP, LayerNorm, activation, attention_bias, dense, embed, run_layers


def relative_positions(length: int, buckets: int, max_position: int) -> jnp.ndarray:
    """(length, length) query minus key positions, in DeBERTa's log buckets where `buckets` > 0:
    exact within buckets / 2, logarithmic beyond (transformers' make_log_bucket_position)."""
    rel = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
    if buckets <= 0 or max_position <= 0:
        return rel
    mid = buckets // 2
    sign = jnp.sign(rel)
    abs_pos = jnp.where((rel < mid) & (rel > -mid), mid - 1, jnp.abs(rel)).astype(jnp.float32)
    log_pos = jnp.ceil(jnp.log(abs_pos / mid) / jnp.log(jnp.float32((max_position - 1) / mid)) * (mid - 1)) + mid
    return jnp.where(abs_pos <= mid, rel.astype(jnp.float32), log_pos * sign).astype(jnp.int32)


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, config.initializer_range
        self.word = embed(config.vocab_size, d, dtype=dtype, rngs=rngs, std=std)
        self.position = embed(config.max_position_embeddings, d, dtype=dtype, rngs=rngs, std=std) if config.position_biased_input else None
        self.token_type = embed(config.type_vocab_size, d, dtype=dtype, rngs=rngs, std=std) if config.type_vocab_size > 0 else None
        self.norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)
        self.relative = embed(relative_rows(config), d, dtype=dtype, rngs=rngs, std=std) if config.relative_attention else None
        self.relative_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype) if normed_relative(config) else None

    def __call__(self, input_ids, token_type_ids, position_ids, mask):
        x = self.word(input_ids)
        if self.position is not None:
            x = x + self.position(position_ids)
        if self.token_type is not None:
            x = x + self.token_type(token_type_ids)
        return self.norm(x) * mask[..., None].astype(x.dtype)

    def relative_table(self):
        """The relative-position embeddings every layer's attention reads (normed where the config says)."""
        table = self.relative.embedding[...]
        return table if self.relative_norm is None else self.relative_norm(table)


class Attention(nnx.Module):
    """Disentangled self-attention: content-to-content, content-to-position (c2p: the queries
    against the relative positions' keys) and position-to-content (p2c: the keys against their
    queries), each divided by sqrt(dh * the number of terms). Leaves: query, key, value, out, and
    pos_key, pos_query where the positions have projections of their own (not share_att_key)."""

    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, config.initializer_range
        kw = dict(bias=True, dtype=dtype, rngs=rngs, std=std)
        self.heads = config.num_attention_heads
        self.query, self.key, self.value, self.out = (dense(d, d, **kw) for _ in range(4))
        v1 = config.model_type == "deberta"  # v1: no key bias (in_proj has none), pos_proj without bias
        if v1:
            self.key = dense(d, d, **{**kw, "bias": False})
        self.types = tuple(config.pos_att_type or ()) if config.relative_attention else ()
        self.share = bool(getattr(config, "share_att_key", False))
        own = config.relative_attention and not self.share
        self.pos_key = dense(d, d, **{**kw, "bias": not v1}) if own and "c2p" in self.types else None
        self.pos_query = dense(d, d, **kw) if own and "p2c" in self.types else None
        self.span = relative_rows(config) // 2

    def _split(self, x):
        return x.reshape(*x.shape[:-1], self.heads, -1)

    def __call__(self, x, bias, relative, table):
        b, t, d = x.shape
        q, k, v = (self._split(proj(x)) for proj in (self.query, self.key, self.value))
        scale = math.sqrt(d // self.heads * (1 + len({"c2p", "p2c"} & set(self.types))))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / scale
        if "c2p" in self.types:  # score[i, j] += q_i . k_r[rel(i, j) + span]
            pos_key = self._split((self.key if self.share else self.pos_key)(table))
            c2p = jnp.einsum("bthd,rhd->bhtr", q, pos_key)
            index = jnp.clip(relative + self.span, 0, 2 * self.span - 1)
            scores = scores + jnp.take_along_axis(c2p, jnp.broadcast_to(index, (b, self.heads, t, t)), axis=-1) / scale
        if "p2c" in self.types:  # score[i, j] += k_j . q_r[rel(j, i) + span]
            pos_query = self._split((self.query if self.share else self.pos_query)(table))
            p2c = jnp.einsum("bshd,rhd->bhsr", k, pos_query)
            index = jnp.clip(-relative + self.span, 0, 2 * self.span - 1)
            scores = scores + jnp.swapaxes(jnp.take_along_axis(p2c, jnp.broadcast_to(index, (b, self.heads, t, t)), axis=-1), -1, -2) / scale
        probs = jax.nn.softmax(scores.astype(jnp.float32) + bias, axis=-1).astype(v.dtype)
        return self.out(jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, d))


class EncoderLayer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, config.initializer_range
        self.attention = Attention(config, dtype, rngs)
        self.attention_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(d, config.intermediate_size, act=config.hidden_act, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)

    def __call__(self, x, bias, relative, table):
        x = self.attention_norm(x + self.attention(x, bias, relative, table))
        return self.mlp_norm(x + self.mlp(x))


class PooledClassifier(nnx.Module):
    """The sequence classifier: transformers' ContextPooler (the first token, `pooler` dense, its
    activation) and `classifier` on it."""

    def __init__(self, d: int, num_labels: int, act: str, *, dtype, rngs, std):
        self.act = activation(act)
        self.pooler = dense(d, d, bias=True, dtype=dtype, rngs=rngs, std=std)
        self.classifier = dense(d, num_labels, bias=True, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, hidden, **_) -> dict:
        return {"logits": self.classifier(self.act(self.pooler(hidden[:, 0])))}


class Encoder(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([EncoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.buckets = getattr(config, "position_buckets", -1)
        self.max_relative = config.max_relative_positions if config.max_relative_positions >= 1 else config.max_position_embeddings
        self.head = _head_module(config, layout, dtype, rngs)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None):
        b, t = input_ids.shape
        mask = jnp.ones((b, t), jnp.int32) if attention_mask is None else attention_mask
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        x = self.embeddings(input_ids, token_type_ids, position_ids, mask)
        bias = attention_bias(mask, t, causal=False)
        relative, table = None, None
        if self.embeddings.relative is not None:
            relative, table = relative_positions(t, self.buckets, self.max_relative), self.embeddings.relative_table()
        x = run_layers(self.layers, x, lambda i: (bias, relative, table))
        out = {"last_hidden_state": x}
        if self.head is not None:
            out.update(self.head(x, input_ids=input_ids, word=self.embeddings.word))
        return out


def _head_module(config, layout: Layout, dtype, rngs):
    d, std, n = config.hidden_size, config.initializer_range, config.num_labels
    kw = dict(dtype=dtype, rngs=rngs, std=std)
    match layout.head:
        case None:
            return None
        case "sequence_classification":
            return PooledClassifier(d, n, config.pooler_hidden_act, **kw)
        case "token_classification":
            return heads.Linear("token_classifier", d, n, reads="tokens", **kw)
        case "question_answering":
            return heads.Linear("qa_outputs", d, n, reads="tokens", split=("start_logits", "end_logits"), **kw)
        case "masked_lm":  # legacy=false: the word embeddings decode, as a tied legacy head's do
            return heads.MaskedLM(d, config.vocab_size, act=config.hidden_act, eps=config.layer_norm_eps,
                                  tied=config.tie_word_embeddings or not config.legacy, **kw)
    raise InputError(f"head {layout.head!r} has no forward pass")
