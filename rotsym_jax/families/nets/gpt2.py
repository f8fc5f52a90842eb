"""The gpt2 forward pass in Flax NNX; its records (tensors, config, heads) are `families/gpt2.py` and
`families/gpt_bigcode.py` (GPTBigCode: GPT-2's layer with multi-query or multi-head attention)."""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from ..gpt_bigcode import head_geometry
from . import heads
from .layers import MLP, Attention, LayerNorm, Scores, attention_bias, dense, embed, multi_head, run_layers


def _check_config(config, layout: Layout):
    unsupported = {
        # HF's upcast-and-reorder attention rounds differently in half precision: refuse, not differ.
        "reorder_and_upcast_attn": "reorder_and_upcast_attn=True is not supported",
        "add_cross_attention": "add_cross_attention=True (encoder-decoder GPT-2) is not supported",
    }
    for key, message in unsupported.items():
        if (key == "add_cross_attention" or config.model_type == "gpt2") and getattr(config, key, False):
            raise InputError(f"{config.model_type} config: {message}")
    if layout.pooler:
        raise InputError("GPT-2 has no pooler: layout.pooler must be False")


def _attention_scale(config, layer_idx):
    scale = 1.0 / math.sqrt(config.n_embd // config.n_head) if config.scale_attn_weights else 1.0
    if config.model_type == "gpt2" and config.scale_attn_by_inverse_layer_idx:  # GPT-2's alone
        scale /= layer_idx + 1
    return scale


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.n_embd, config.initializer_range
        self.word = embed(config.vocab_size, d, dtype=dtype, rngs=rngs, std=std)
        self.position = embed(config.n_positions, d, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, position_ids):
        return self.word(input_ids) + self.position(position_ids)


class DecoderLayer(nnx.Module):
    def __init__(self, config, layer_idx, dtype, rngs):
        d, std, eps = config.n_embd, config.initializer_range, config.layer_norm_epsilon
        f = config.n_inner if config.n_inner is not None else 4 * d
        self.attention_norm = LayerNorm(d, eps=eps, dtype=dtype)
        # GPTBigCode: multi-query (one kv head) or multi-head
        geometry = head_geometry(config) if config.model_type == "gpt_bigcode" else multi_head(d, config.n_head)
        self.attention = Attention(d, heads=geometry, scores=Scores(_attention_scale(config, layer_idx)), dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = LayerNorm(d, eps=eps, dtype=dtype)
        self.mlp = MLP(d, f, act=config.activation_function, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias):
        x = x + self.attention(self.attention_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class GPT2Decoder(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        _check_config(config, layout)
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs) for i in range(config.n_layer)])
        self.final_norm = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, dtype=dtype)
        d, std = config.n_embd, config.initializer_range
        self.lm = layout.head == "lm"
        self.lm_head = dense(d, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=std) if self.lm and not config.tie_word_embeddings else None
        self.head = heads.decoder_head(layout.head, d, config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        x = self.embeddings(input_ids, position_ids)
        bias = attention_bias(attention_mask, t, causal=True)
        x = run_layers(self.layers, x, lambda i: (bias,))
        return heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=self.lm_head, lm=self.lm, head=self.head,
                                     input_ids=input_ids)
