"""The OPT forward pass in Flax NNX; its record (tensors, config, heads) is `families/opt.py`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from . import heads
from .layers import MLP, Attention, LayerNorm, attention_bias, dense, embed, multi_head, run_layers

_OFFSET = 2  # OPT's learned positions: row position + 2 (rows 0 and 1 are never read for real tokens)


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        std = config.init_std
        self.word = embed(config.vocab_size, config.word_embed_proj_dim, dtype=dtype, rngs=rngs, std=std)
        self.position = embed(config.max_position_embeddings + _OFFSET, config.hidden_size, dtype=dtype, rngs=rngs, std=std)


class DecoderLayer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std, affine = config.hidden_size, config.init_std, config.layer_norm_elementwise_affine
        self.pre = config.do_layer_norm_before
        self.attention_norm = LayerNorm(d, eps=1e-5, dtype=dtype, scale=affine)
        self.attention = Attention(d, heads=multi_head(d, config.num_attention_heads), qkv_bias=config.enable_bias,
                                   out_bias=config.enable_bias, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = LayerNorm(d, eps=1e-5, dtype=dtype, scale=affine)
        self.mlp = MLP(d, config.ffn_dim, act=config.activation_function, bias=config.enable_bias, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias):
        if self.pre:
            x = x + self.attention(self.attention_norm(x), bias)
            return x + self.mlp(self.mlp_norm(x))
        x = self.attention_norm(x + self.attention(x, bias))
        return self.mlp_norm(x + self.mlp(x))


class OPTDecoder(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError("OPT has no pooler: layout.pooler must be False")
        d, p, std = config.hidden_size, config.word_embed_proj_dim, config.init_std
        self.embeddings = Embeddings(config, dtype, rngs)
        projected = p != d
        self.project_in = dense(p, d, bias=False, dtype=dtype, rngs=rngs, std=std) if projected else None
        self.project_out = dense(d, p, bias=False, dtype=dtype, rngs=rngs, std=std) if projected else None
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        final = config.do_layer_norm_before and not config._remove_final_layer_norm
        # a final norm without affine parameters still normalises (transformers keeps the module)
        self.final_norm = LayerNorm(d, eps=1e-5, dtype=dtype, scale=config.layer_norm_elementwise_affine) if final else None
        self.lm = layout.head == "lm"
        self.lm_head = dense(p, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=std) if self.lm and not config.tie_word_embeddings else None
        self.head = heads.decoder_head(layout.head, p, config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        mask = jnp.ones((b, t), jnp.int32) if attention_mask is None else attention_mask.astype(jnp.int32)
        if position_ids is None:  # as transformers: each token's count of real tokens up to it, minus 1 (padding: -1)
            position_ids = jnp.cumsum(mask, axis=1) * mask - 1
        x = self.embeddings.word(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embeddings.position(position_ids + _OFFSET)
        bias = attention_bias(attention_mask, t, causal=True)
        x = run_layers(self.layers, x, lambda i: (bias,))
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return heads.decoder_outputs(x, word=self.embeddings.word, lm_head=self.lm_head, lm=self.lm, head=self.head, input_ids=input_ids)
