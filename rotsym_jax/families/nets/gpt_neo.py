"""The GPT-Neo forward pass in Flax NNX; its record is `families/gpt_neo.py`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from . import heads
from .layers import MLP, Attention, LayerNorm, Scores, attention_bias, dense, embed, multi_head, run_layers


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, config.initializer_range
        self.word = embed(config.vocab_size, d, dtype=dtype, rngs=rngs, std=std)
        self.position = embed(config.max_position_embeddings, d, dtype=dtype, rngs=rngs, std=std)


class Block(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std, eps = config.hidden_size, config.initializer_range, config.layer_norm_epsilon
        f = config.intermediate_size if config.intermediate_size is not None else 4 * d
        self.attention_norm = LayerNorm(d, eps=eps, dtype=dtype)
        # GPT-Neo does not scale its scores by 1/sqrt(head_dim)
        self.attention = Attention(d, heads=multi_head(d, config.num_heads), qkv_bias=False, out_bias=True, scores=Scores(1.0),
                                   dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = LayerNorm(d, eps=eps, dtype=dtype)
        self.mlp = MLP(d, f, act=config.activation_function, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias):
        x = x + self.attention(self.attention_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class GPTNeoDecoder(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError("GPT-Neo has no pooler: layout.pooler must be False")
        d, std = config.hidden_size, config.initializer_range
        self.local = tuple(t == "local" for t in config.attention_layers)
        self.window = config.window_size
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([Block(config, dtype, rngs) for _ in range(config.num_layers)])
        self.final_norm = LayerNorm(d, eps=config.layer_norm_epsilon, dtype=dtype)
        self.lm = layout.head == "lm"
        self.lm_head = dense(d, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=std) if self.lm and not config.tie_word_embeddings else None
        self.head = heads.decoder_head(layout.head, d, config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        x = self.embeddings.word(input_ids) + self.embeddings.position(position_ids)
        # one object per kind of layer, so that runs of alike layers scan together
        full = attention_bias(attention_mask, t, causal=True)
        local = attention_bias(attention_mask, t, causal=True, sliding_window=self.window)
        x = run_layers(self.layers, x, lambda i: (local if self.local[i] else full,))
        return heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=self.lm_head, lm=self.lm, head=self.head,
                                     input_ids=input_ids)
