"""The gpt_neox forward pass in Flax NNX; its record (tensors, config, heads) is `families/gpt_neox.py`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...errors import InputError
from ..family import Layout
from ..gpt_neox import head_dim_of
from . import heads
from .layers import MLP, Attention, LayerNorm, WordEmbeddings, attention_bias, dense, multi_head, rope_cos_sin, run_layers


def _rotary_dim(config) -> int:
    return int(head_dim_of(config) * config.rope_parameters["partial_rotary_factor"])


def _inv_freq(config) -> np.ndarray:
    """RoPE inverse frequencies (rotary_dim/2,) in float32, as transformers computes them."""
    dim = _rotary_dim(config)
    return (1.0 / (config.rope_parameters["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(np.float32)


class DecoderLayer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std, eps = config.hidden_size, config.initializer_range, config.layer_norm_eps
        self.parallel = config.use_parallel_residual
        self.attention_norm = LayerNorm(d, eps=eps, dtype=dtype)
        self.attention = Attention(d, heads=multi_head(d, config.num_attention_heads), qkv_bias=config.attention_bias,
                                   out_bias=config.attention_bias, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = LayerNorm(d, eps=eps, dtype=dtype)
        self.mlp = MLP(d, config.intermediate_size, act=config.hidden_act, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias, rope):
        attn = self.attention(self.attention_norm(x), bias, rope)
        if self.parallel:
            return x + attn + self.mlp(self.mlp_norm(x))
        x = x + attn
        return x + self.mlp(self.mlp_norm(x))


class NeoXDecoder(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError("GPT-NeoX has no pooler: layout.pooler must be False")
        self.inv_freq = tuple(float(f) for f in _inv_freq(config))  # static: part of the graph
        d, std = config.hidden_size, config.initializer_range
        self.embeddings = WordEmbeddings(config, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.final_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)
        self.lm = layout.head == "lm"
        tied = config.tie_word_embeddings
        self.lm_head = dense(d, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=std) if self.lm and not tied else None
        self.head = heads.decoder_head(layout.head, d, config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        rope = rope_cos_sin(self.inv_freq, position_ids)
        bias = attention_bias(attention_mask, t, causal=True)
        x = self.embeddings(input_ids)
        x = run_layers(self.layers, x, lambda i: (bias, rope))
        return heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=self.lm_head, lm=self.lm, head=self.head,
                                     input_ids=input_ids)
