"""The Phi forward pass in Flax NNX (its record: `families/phi.py`): attention and MLP read one
LayerNorm of the stream and both add to it."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from ..llama._config import head_geometry_of, rope_inv_freq
from . import heads
from .layers import MLP, Attention, LayerNorm, WordEmbeddings, attention_bias, dense, rope_cos_sin


class DecoderLayer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, config.initializer_range
        self.attention_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)
        self.attention = Attention(d, heads=head_geometry_of(config), dtype=dtype, rngs=rngs, std=std)
        self.mlp = MLP(d, config.intermediate_size, act=config.hidden_act, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias, rope):
        normed = self.attention_norm(x)
        return x + self.attention(normed, bias, rope) + self.mlp(normed)


class LMBias(nnx.Module):
    """A tied LM head's own bias (its kernel is the word embedding): leaf `lm_head/bias`."""

    def __init__(self, vocab: int, dtype):
        self.bias = nnx.Param(jnp.zeros((vocab,), dtype))


class PhiDecoder(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError("Phi has no pooler: layout.pooler must be False")
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(config))  # static: part of the graph
        d, std = config.hidden_size, config.initializer_range
        self.embeddings = WordEmbeddings(config, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.final_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)
        self.lm = layout.head == "lm"
        self.tied = config.tie_word_embeddings
        if not self.lm:
            self.lm_head = None
        elif self.tied:
            self.lm_head = LMBias(config.vocab_size, dtype)
        else:
            self.lm_head = dense(d, config.vocab_size, bias=True, dtype=dtype, rngs=rngs, std=std)
        self.head = heads.decoder_head(layout.head, d, config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        rope = rope_cos_sin(self.inv_freq, position_ids)
        bias = attention_bias(attention_mask, t, causal=True)
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, bias, rope)
        untied_head = None if self.tied else self.lm_head
        out = heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=untied_head, lm=self.lm, head=self.head,
                                    input_ids=input_ids)
        if self.lm and self.tied:
            out["logits"] = out["logits"] + self.lm_head.bias[...]
        return out
