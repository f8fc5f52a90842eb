"""Llama 4's text model in Flax NNX (its record: `families/llama4.py`): RoPE layers (interleaved
pairs, which our leaves hold in the rotate_half order) with chunked attention and, with
use_qk_norm, q and k divided by each head's RMS after RoPE; NoPE layers with attention temperature
tuning; dense SwiGLU MLPs and mixtures whose sigmoid router scales each chosen expert's input,
beside a shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from ..llama._config import head_dim_of, is_tied, rope_inv_freq
from . import heads
from .layers import MLP, Experts, RMSNorm, WordEmbeddings, activation, apply_rope, attention_bias, dense, rope_cos_sin, run_layers


def _unit_rms(x, eps):
    """Llama4TextWeightlessRMSNorm: each head's entries divided by their RMS, in float32."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention of one layer. Leaves: query, key, value, out (kernel, bias with attention_bias)."""

    def __init__(self, config, index, dtype, rngs):
        d, std, bias = config.hidden_size, config.initializer_range, config.attention_bias
        self.h, self.g, self.dh = config.num_attention_heads, config.num_key_value_heads, head_dim_of(config)
        self.rope = bool(config.no_rope_layers[index])
        self.norm_eps = config.rms_norm_eps if config.use_qk_norm and self.rope else None
        # NoPE layers scale q by 1 + attn_scale log(1 + floor((pos + 1) / floor_scale))
        self.temperature = (config.floor_scale, config.attn_scale) if config.attn_temperature_tuning and not self.rope else None
        kw = dict(bias=bias, dtype=dtype, rngs=rngs, std=std)
        self.query, self.key = dense(d, self.h * self.dh, **kw), dense(d, self.g * self.dh, **kw)
        self.value, self.out = dense(d, self.g * self.dh, **kw), dense(self.h * self.dh, d, **kw)

    def __call__(self, x, bias, rope):
        b, t, _ = x.shape
        h, g, dh = self.h, self.g, self.dh
        q, k, v = self.query(x).reshape(b, t, h, dh), self.key(x).reshape(b, t, g, dh), self.value(x).reshape(b, t, g, dh)
        if self.rope:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.norm_eps is not None:
            q, k = _unit_rms(q, self.norm_eps), _unit_rms(k, self.norm_eps)
        if self.temperature is not None:
            floor_scale, scale = self.temperature
            positions = jnp.arange(t, dtype=jnp.float32)  # transformers counts the tokens, whatever position_ids say
            q = (q * (jnp.log1p(jnp.floor((positions + 1.0) / floor_scale)) * scale + 1.0)[None, :, None, None]).astype(q.dtype)
        q = q.reshape(b, t, g, h // g, dh)
        scores = jnp.einsum("btgrd,bsgd->bgrts", q, k).astype(jnp.float32) * dh**-0.5 + bias[:, :, None]
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return self.out(jnp.einsum("bgrts,bsgd->btgrd", probs, v).reshape(b, t, h * dh))


class MoE(nnx.Module):
    """Llama4TextMoe: the router's top-k logits through a sigmoid (the others 0) scale each expert's
    input; every expert a SwiGLU; a shared expert on every token. Leaves: moe/router/kernel (d, E),
    moe/{gate,up}/kernel (E, d, f), moe/down/kernel (E, f, d), shared_mlp/{gate,up,down}. Every
    expert runs on every token (an unpicked expert reads zeros and gives zeros: exact)."""

    def __init__(self, config, dtype, rngs):
        d, f, e, std = config.hidden_size, config.intermediate_size, config.num_local_experts, config.initializer_range
        self.act, self.top_k = activation(config.hidden_act), config.num_experts_per_tok
        self.router = dense(d, e, bias=False, dtype=dtype, rngs=rngs, std=std)
        kw = dict(dtype=dtype, rngs=rngs, std=std)
        self.gate, self.up, self.down = Experts(e, d, f, **kw), Experts(e, d, f, **kw), Experts(e, f, d, **kw)

    def weights(self, x):
        """(B, T, E): each expert's sigmoid score where picked, 0 elsewhere."""
        logits = self.router(x)
        top, picked = jax.lax.top_k(logits, self.top_k)
        scores = jax.nn.sigmoid(top.astype(jnp.float32)).astype(logits.dtype)
        return jnp.sum(jax.nn.one_hot(picked, logits.shape[-1], dtype=scores.dtype) * scores[..., None], axis=-2)

    def __call__(self, x):
        routed = x[..., None, :] * self.weights(x)[..., None]  # (B, T, E, d): each expert's input
        hidden = self.act(jnp.einsum("bted,edf->btef", routed, self.gate.kernel[...])) * jnp.einsum("bted,edf->btef", routed, self.up.kernel[...])
        if self.down.record:  # every expert's hidden units on every token at score 1 (activation matching's site: an
            # unpicked expert's own are zeros, which would tell experts apart by their routing alone)
            self.down.sow(nnx.Intermediate, "inputs", self.act(jnp.einsum("btd,edf->btef", x, self.gate.kernel[...]))
                          * jnp.einsum("btd,edf->btef", x, self.up.kernel[...]))
        return jnp.einsum("btef,efd->btd", hidden, self.down.kernel[...])


class DecoderLayer(nnx.Module):
    def __init__(self, config, index, dtype, rngs):
        d, eps, std = config.hidden_size, config.rms_norm_eps, config.initializer_range
        self.attention_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.attention = Attention(config, index, dtype, rngs)
        self.mlp_norm = RMSNorm(d, eps=eps, dtype=dtype)
        kw = dict(act=config.hidden_act, gated=True, bias=False, dtype=dtype, rngs=rngs, std=std)
        if index in config.moe_layers:
            self.moe = MoE(config, dtype, rngs)
            self.shared_mlp = MLP(d, config.intermediate_size, **kw)
        else:
            self.mlp = MLP(d, config.intermediate_size_mlp, **kw)

    def __call__(self, x, bias, rope):
        x = x + self.attention(self.attention_norm(x), bias, rope)
        y = self.mlp_norm(x)
        return x + (self.moe(y) + self.shared_mlp(y) if hasattr(self, "moe") else self.mlp(y))


def chunked_bias(attention_mask, t, chunk):
    """The causal bias within chunks of `chunk` tokens, counted from each row's first token that is
    not left padding (transformers' chunked mask)."""
    causal = attention_bias(attention_mask, t, causal=True)
    left = jnp.zeros((1,), jnp.int32) if attention_mask is None else jnp.sum(jnp.cumsum(attention_mask, axis=-1) == 0, axis=-1)
    idx = jnp.arange(t)[None, :] - left[:, None]  # (B, T)
    same = (idx[:, :, None] // chunk) == (idx[:, None, :] // chunk)
    return jnp.where(same[:, None], causal, jnp.finfo(jnp.float32).min)


class Decoder(nnx.Module):
    """Llama4TextModel (head None) or Llama4ForCausalLM ("lm")."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler or layout.head not in (None, "lm"):
            raise InputError(f"llama4_text runs its base model and its LM head; got layout {layout}")
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(config))
        self.chunks = tuple(config.attention_chunk_size if kind == "chunked_attention" else None
                            for kind in config.layer_types[: config.num_hidden_layers])
        self.embeddings = WordEmbeddings(config, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs) for i in range(config.num_hidden_layers)])
        self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.lm = layout.head == "lm"
        untied = self.lm and not is_tied(config)
        self.lm_head = dense(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=config.initializer_range) if untied else None

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        rope = rope_cos_sin(self.inv_freq, position_ids)
        biases = {c: attention_bias(attention_mask, t, causal=True) if c is None else chunked_bias(attention_mask, t, c) for c in set(self.chunks)}
        x = self.embeddings(input_ids)
        x = run_layers(self.layers, x, lambda i: (biases[self.chunks[i]], rope))
        return heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=self.lm_head, lm=self.lm, head=None, input_ids=input_ids)
