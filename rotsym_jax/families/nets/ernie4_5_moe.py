"""The ERNIE 4.5 MoE forward pass in Flax NNX (its record: `families/ernie4_5.py`): Llama's
pre-RMSNorm attention (biases with use_bias; q and k in the rotate_half order the loader reorders
them into), dense MLPs outside the mixture's layers, and a mixture whose softmax router picks its
top k by the probabilities plus a correction bias, weights them by their probabilities normalised
(the sum clamped at moe_norm_min), beside shared experts; an LM head with a bias with use_bias."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from .. import ernie4_5
from ..family import Layout
from ..llama._config import head_geometry_of, is_tied, rope_inv_freq
from . import heads
from .layers import MLP, Attention, MoE, RMSNorm, WordEmbeddings, attention_bias, rope_cos_sin, run_layers
from .phi import lm_head


class CorrectedSoftmaxMoE(MoE):
    """Ernie4_5_MoeTopKRouter: softmax over the router's logits (float32); the top k of the
    probabilities plus `score_correction` (moe_statics.e_score_correction_bias) chosen; the chosen
    probabilities divided by their sum, clamped below at moe_norm_min."""

    def __init__(self, config, *, dtype, rngs, std):
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.moe_num_experts, config.moe_k, act=config.hidden_act,
                         normalize=True, dtype=dtype, rngs=rngs, std=std)
        self.score_correction = nnx.Param(jnp.zeros((config.moe_num_experts,), jnp.float32))
        self.norm_min = config.moe_norm_min

    def weights(self, x):
        probs = jax.nn.softmax(self.router(x).astype(jnp.float32), axis=-1)
        picked = jax.lax.top_k(probs + self.score_correction[...].astype(jnp.float32), self.top_k)[1]
        top = jnp.take_along_axis(probs, picked, axis=-1)
        top = top / jnp.maximum(jnp.sum(top, axis=-1, keepdims=True), self.norm_min)
        return jnp.sum(jax.nn.one_hot(picked, probs.shape[-1], dtype=top.dtype) * top[..., None], axis=-2)


class DecoderLayer(nnx.Module):
    def __init__(self, config, index, dtype, rngs):
        d, std, eps, bias = config.hidden_size, config.initializer_range, config.rms_norm_eps, bool(config.use_bias)
        self.attention_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.attention = Attention(d, heads=head_geometry_of(config), qkv_bias=bias, out_bias=bias, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = RMSNorm(d, eps=eps, dtype=dtype)
        kw = dict(act=config.hidden_act, gated=True, bias=bias, dtype=dtype, rngs=rngs, std=std)
        if ernie4_5.sparse_layer(config, index):
            self.moe = CorrectedSoftmaxMoE(config, dtype=dtype, rngs=rngs, std=std)
            self.shared_mlp = MLP(d, ernie4_5.shared_width(config), **kw) if config.moe_num_shared_experts > 0 else None
        else:
            self.mlp = MLP(d, config.intermediate_size, **kw)

    def __call__(self, x, bias, rope):
        x = x + self.attention(self.attention_norm(x), bias, rope)
        y = self.mlp_norm(x)
        if not hasattr(self, "moe"):
            return x + self.mlp(y)
        return x + (self.moe(y) if self.shared_mlp is None else self.moe(y) + self.shared_mlp(y))


class Decoder(nnx.Module):
    """Ernie4_5_MoeModel (head None) or Ernie4_5_MoeForCausalLM ("lm")."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError(f"{config.model_type} has no pooler: layout.pooler must be False")
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(config))  # static: part of the graph
        self.embeddings = WordEmbeddings(config, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs) for i in range(config.num_hidden_layers)])
        self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        d, std, bias = config.hidden_size, config.initializer_range, bool(config.use_bias)
        self.lm, self.tied = layout.head == "lm", is_tied(config)
        self.lm_head = lm_head(self.lm, self.tied, bias, d, config.vocab_size, dtype, rngs, std)
        self.head = heads.decoder_head(layout.head, d, config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        rope = rope_cos_sin(self.inv_freq, position_ids)
        bias = attention_bias(attention_mask, t, causal=True)
        x = self.embeddings(input_ids)
        x = run_layers(self.layers, x, lambda i: (bias, rope))
        out = heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=None if self.tied else self.lm_head, lm=self.lm,
                                    head=self.head, input_ids=input_ids)
        if self.tied and self.lm_head is not None:
            out["logits"] = out["logits"] + self.lm_head.bias[...]
        return out
