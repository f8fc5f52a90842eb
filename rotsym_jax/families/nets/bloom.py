"""The BLOOM forward pass in Flax NNX; its record is `families/bloom.py`."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...errors import InputError
from ..family import Layout
from . import heads
from .layers import MLP, Attention, LayerNorm, attention_bias, dense, embed, multi_head, run_layers


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Each head's ALiBi slope, as transformers' BLOOM computes them (a geometric series over the
    largest power of two <= H heads, the rest interleaved from the next power's series)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = np.float32(2 ** (-(2 ** -(math.log2(closest) - 3))))
    slopes = [base ** np.float32(p) for p in range(1, closest + 1)]
    if closest != num_heads:
        extra = np.float32(2 ** (-(2 ** -(math.log2(2 * closest) - 3))))
        slopes += [extra ** np.float32(p) for p in range(1, 1 + 2 * min(closest, num_heads - closest), 2)]
    return np.asarray(slopes, np.float32)


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d = config.hidden_size
        self.word = embed(config.vocab_size, d, dtype=dtype, rngs=rngs, std=config.initializer_range)
        self.norm = LayerNorm(d, eps=config.layer_norm_epsilon, dtype=dtype)


class Block(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std, eps = config.hidden_size, config.initializer_range, config.layer_norm_epsilon
        self.attention_norm = LayerNorm(d, eps=eps, dtype=dtype)
        self.attention = Attention(d, heads=multi_head(d, config.n_head), dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = LayerNorm(d, eps=eps, dtype=dtype)
        self.mlp = MLP(d, 4 * d, act="gelu_new", dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias):
        x = x + self.attention(self.attention_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class BloomDecoder(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError("BLOOM has no pooler: layout.pooler must be False")
        if config.apply_residual_connection_post_layernorm:
            raise InputError("bloom config: apply_residual_connection_post_layernorm=True is not supported")
        d, std = config.hidden_size, config.initializer_range
        self.slopes = tuple(float(s) for s in alibi_slopes(config.n_head))  # static: no leaf
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([Block(config, dtype, rngs) for _ in range(config.n_layer)])
        self.final_norm = LayerNorm(d, eps=config.layer_norm_epsilon, dtype=dtype)
        self.lm = layout.head == "lm"
        self.lm_head = dense(d, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=std) if self.lm and not config.tie_word_embeddings else None
        self.head = heads.decoder_head(layout.head, d, config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None):
        b, t = input_ids.shape
        mask = jnp.ones((b, t), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)
        x = self.embeddings.norm(self.embeddings.word(input_ids))
        # ALiBi: head j's slope times each key's position among the real tokens, one bias (B, H, T, T) for every layer
        keys = ((jnp.cumsum(mask, axis=1) - 1) * mask).astype(jnp.float32)
        alibi = jnp.asarray(self.slopes, jnp.float32)[None, :, None, None] * keys[:, None, None, :]
        bias = attention_bias(attention_mask, t, causal=True) + alibi
        x = run_layers(self.layers, x, lambda i: (bias,))
        return heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=self.lm_head, lm=self.lm, head=self.head,
                                     input_ids=input_ids)
