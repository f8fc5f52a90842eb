"""The Phi-3.5-MoE forward pass in Flax NNX (its record: `families/phimoe.py`): pre-LayerNorm
layers (gains and biases), Llama's attention (biases with attention_bias), a mixture of experts in
every layer routed by sparsemixer's top two, as transformers runs it at inference; an LM head with a
bias with lm_head_bias; RoPE "default" or Phi-3.5-MoE's "longrope"."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...errors import InputError
from ..family import Layout
from ..llama._config import head_geometry_of, rope_inv_freq
from . import heads
from .layers import Attention, LayerNorm, MoE, WordEmbeddings, attention_bias, rope_cos_sin, run_layers
from .phi import lm_head


def _masked_softmax_at(logits, candidates, top, picked, eps):
    """sparsemixer's weight of expert `picked` (B, T): the softmax of `candidates` over the experts
    whose logit lies within 2 eps of `top`, relative to max(|logit|, top) (the others -inf)."""
    factor = jnp.maximum(jnp.abs(logits), top)
    kept = jnp.where((top - logits) / factor > 2 * eps, -jnp.inf, candidates)
    return jnp.take_along_axis(jax.nn.softmax(kept, axis=-1), picked[..., None], axis=-1)[..., 0]


class SparseMixerMoE(MoE):
    """PhimoeTopKRouter at inference (sparsemixer, training False): the first expert the top logit,
    the second the top logit of the others (the first's set to -inf), each weighted by its masked
    softmax (`_masked_softmax_at`: the first's threshold on the original logits, the second's on
    them with the first removed). Two experts, whatever num_experts_per_tok says (transformers
    hard-codes them)."""

    def __init__(self, config, *, dtype, rngs, std):
        super().__init__(config.hidden_size, config.intermediate_size, config.num_local_experts, 2, act=config.hidden_act, normalize=False,
                         dtype=dtype, rngs=rngs, std=std)
        self.eps = float(config.router_jitter_noise)

    def weights(self, x):
        scores = self.router(x).astype(jnp.float32)
        experts = scores.shape[-1]
        first = jnp.argmax(scores, axis=-1)
        w1 = _masked_softmax_at(scores, scores, jnp.max(scores, axis=-1, keepdims=True), first, self.eps)
        others = jnp.where(jax.nn.one_hot(first, experts, dtype=bool), -jnp.inf, scores)
        second = jnp.argmax(others, axis=-1)
        # the second's threshold reads the original logits, its softmax the others', as transformers'
        w2 = _masked_softmax_at(scores, others, jnp.max(others, axis=-1, keepdims=True), second, self.eps)
        return jax.nn.one_hot(first, experts, dtype=jnp.float32) * w1[..., None] + jax.nn.one_hot(second, experts, dtype=jnp.float32) * w2[..., None]


class DecoderLayer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std, eps, bias = config.hidden_size, config.initializer_range, config.rms_norm_eps, bool(config.attention_bias)
        self.attention_norm = LayerNorm(d, eps=eps, dtype=dtype)
        self.attention = Attention(d, heads=head_geometry_of(config), qkv_bias=bias, out_bias=bias, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = LayerNorm(d, eps=eps, dtype=dtype)
        self.moe = SparseMixerMoE(config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias, rope):
        x = x + self.attention(self.attention_norm(x), bias, rope)
        return x + self.moe(self.mlp_norm(x))


def _inv_freq(config) -> np.ndarray:
    """PhimoeRotaryEmbedding's frequencies: the default ones, or longrope's with short_factor at
    every length (transformers' forward recomputes them without the sequence length)."""
    params = config.rope_parameters
    if params["rope_type"] == "default":
        return rope_inv_freq(config)
    dim = config.hidden_size // config.num_attention_heads
    shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    return (1.0 / (np.asarray(params["short_factor"], np.float32) * np.float32(params["rope_theta"]) ** shape)).astype(np.float32)


class Decoder(nnx.Module):
    """PhimoeModel (head None), PhimoeForCausalLM ("lm"), PhimoeForSequenceClassification."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError(f"{config.model_type} has no pooler: layout.pooler must be False")
        self.inv_freq = tuple(float(f) for f in _inv_freq(config))  # static: part of the graph
        params = config.rope_parameters
        # longrope: cos and sin times short_mscale, or long_mscale past the original context
        self.mscales = None if params["rope_type"] == "default" else (
            float(params["short_mscale"]), float(params["long_mscale"]), int(params["original_max_position_embeddings"]))
        self.window = config.sliding_window
        self.embeddings = WordEmbeddings(config, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        d, std, bias = config.hidden_size, config.initializer_range, bool(config.lm_head_bias)
        self.final_norm = LayerNorm(d, eps=config.rms_norm_eps, dtype=dtype)
        self.lm, self.tied = layout.head == "lm", bool(config.tie_word_embeddings)
        self.lm_head = lm_head(self.lm, self.tied, bias, d, config.vocab_size, dtype, rngs, std)
        self.head = heads.decoder_head(layout.head, d, config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        cos, sin = rope_cos_sin(self.inv_freq, position_ids)
        if self.mscales is not None:
            short, long, original = self.mscales
            mscale = jnp.where(jnp.max(position_ids) + 1 > original, long, short).astype(jnp.float32)
            cos, sin = cos * mscale, sin * mscale
        bias = attention_bias(attention_mask, t, causal=True, sliding_window=self.window)
        x = self.embeddings(input_ids)
        rope = (cos, sin)  # one object: the layers scanned together share it (`run_layers`)
        x = run_layers(self.layers, x, lambda i: (bias, rope))
        out = heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=None if self.tied else self.lm_head, lm=self.lm,
                                    head=self.head, input_ids=input_ids)
        if self.tied and self.lm_head is not None:
            out["logits"] = out["logits"] + self.lm_head.bias[...]
        return out
