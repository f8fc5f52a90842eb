"""The GPT-OSS forward pass in Flax NNX (its record: `families/gpt_oss.py`): pre-RMSNorm layers,
grouped-query attention with biases and a sink per head, sliding-window or full as layer_types
says, RoPE (YaRN's frequencies and factor on cos and sin by default), and in every layer a mixture
whose router (with a bias) picks the top k logits and weights them by their softmax among
themselves; each expert (biases on both projections) runs the clamped SwiGLU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from ..llama._config import head_geometry_of, is_tied, rope_inv_freq
from . import heads
from .deepseek import yarn
from .layers import Attention, Experts, RMSNorm, WordEmbeddings, attention_bias, dense, normal_init, rope_cos_sin, run_layers
from .phi import lm_head


class SinkAttention(Attention):
    """GptOssAttention: the shared attention with leaf `sinks` (H,), one logit per query head."""

    def __init__(self, d, *, heads, std, dtype, rngs, **kw):
        super().__init__(d, heads=heads, std=std, dtype=dtype, rngs=rngs, **kw)
        self.sinks = nnx.Param(normal_init(std)(rngs.params(), (heads.num_heads,), dtype))


class ClampedSwiGLUExperts(nnx.Module):
    """GptOssMLP: router/kernel (d, E) and router/bias (E,); the top k logits softmaxed among
    themselves weight the picked experts; expert e: (clamp(u, -l, l) + 1) * g * sigmoid(alpha g),
    g = clamp(gate, max=l), u = up (each x @ kernel + bias), then down (with its bias). Every expert
    runs on every token, weighted by zero where not picked (exact; the forward pass measures)."""

    def __init__(self, config, *, dtype, rngs, std):
        d, f, e = config.hidden_size, config.intermediate_size, config.num_local_experts
        self.top_k, self.alpha, self.limit = config.num_experts_per_tok, float(config.swiglu_alpha), float(config.swiglu_limit)
        self.router = dense(d, e, bias=True, dtype=dtype, rngs=rngs, std=std)
        kw = dict(dtype=dtype, rngs=rngs, std=std)
        self.gate, self.up, self.down = Experts(e, d, f, **kw), Experts(e, d, f, **kw), Experts(e, f, d, **kw)
        for experts, width in ((self.gate, f), (self.up, f), (self.down, d)):
            experts.bias = nnx.Param(jnp.zeros((e, width), dtype))  # transformers' init: zeros

    def weights(self, x):
        """(B, T, E): each token's weight of every expert, zero where not picked."""
        logits = self.router(x).astype(jnp.float32)
        top, picked = jax.lax.top_k(logits, self.top_k)
        top = jax.nn.softmax(top, axis=-1)
        return jnp.sum(jax.nn.one_hot(picked, logits.shape[-1], dtype=top.dtype) * top[..., None], axis=-2)

    def __call__(self, x):
        weights = self.weights(x)
        gate = jnp.einsum("btd,edf->btef", x, self.gate.kernel[...]) + self.gate.bias[...]
        up = jnp.einsum("btd,edf->btef", x, self.up.kernel[...]) + self.up.bias[...]
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        hidden = (up + 1) * gate * jax.nn.sigmoid(gate * self.alpha)
        if self.down.record:  # every expert's hidden units, on every token (activation matching's site)
            self.down.sow(nnx.Intermediate, "inputs", hidden)
        out = jnp.einsum("btef,efd->bted", hidden, self.down.kernel[...]) + self.down.bias[...]
        return jnp.einsum("bte,bted->btd", weights.astype(out.dtype), out)


class DecoderLayer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std, eps, bias = config.hidden_size, config.initializer_range, config.rms_norm_eps, bool(config.attention_bias)
        self.attention_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.attention = SinkAttention(d, heads=head_geometry_of(config), qkv_bias=bias, out_bias=bias, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.moe = ClampedSwiGLUExperts(config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias, rope):
        x = x + self.attention(self.attention_norm(x), bias, rope)
        return x + self.moe(self.mlp_norm(x))


class Decoder(nnx.Module):
    """GptOssModel (head None), GptOssForCausalLM ("lm"), GptOssForSequenceClassification,
    GptOssForTokenClassification."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError(f"{config.model_type} has no pooler: layout.pooler must be False")
        params = config.rope_parameters or {}
        inv_freq, factor = yarn(params, config.head_dim) if params.get("rope_type") == "yarn" else (rope_inv_freq(config), 1.0)
        self.inv_freq, self.rope_factor = tuple(float(f) for f in inv_freq), factor  # static: part of the graph
        self.windows = tuple(config.sliding_window if t == "sliding_attention" else None for t in config.layer_types[: config.num_hidden_layers])
        self.embeddings = WordEmbeddings(config, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        d, std = config.hidden_size, config.initializer_range
        self.final_norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype)
        self.lm, self.tied = layout.head == "lm", is_tied(config)
        self.lm_head = lm_head(self.lm, self.tied, False, d, config.vocab_size, dtype, rngs, std)
        self.head = heads.decoder_head(layout.head, d, config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        cos, sin = rope_cos_sin(self.inv_freq, position_ids)
        rope = (cos * self.rope_factor, sin * self.rope_factor)
        masks = {w: attention_bias(attention_mask, t, causal=True, sliding_window=w) for w in set(self.windows)}
        x = self.embeddings(input_ids)
        x = run_layers(self.layers, x, lambda i: (masks[self.windows[i]], rope))
        return heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=None if self.tied else self.lm_head, lm=self.lm,
                                     head=self.head, input_ids=input_ids)
