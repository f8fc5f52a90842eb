"""MiniMax's forward pass in Flax NNX (its record: `families/minimax.py`): layers of softmax attention
(Llama's) or lightning attention (a causal linear attention whose every head decays by its own slope),
each followed by a Mixtral mixture; the stream itself passes each norm (y = norm(x); x = alpha y + beta f(y))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from .. import minimax as record
from ..family import Layout
from ..llama._config import is_tied
from .decoders import HybridDecoder
from .layers import Attention, MoE, RMSNorm, dense


class Lightning(nnx.Module):
    """Leaves as the record lists them: query, key, value, gate (d, H dh), norm (H dh,), out (H dh, d), and the
    decay buffers transformers saves (slope_rate read here; the others kept as read)."""

    def __init__(self, config, index, *, dtype, rngs, std):
        d, h, dh = config.hidden_size, config.num_attention_heads, record.head_dim(config)
        kw = dict(bias=False, dtype=dtype, rngs=rngs, std=std)
        self.heads, self.head_dim = h, dh
        self.query, self.key, self.value, self.gate = (dense(d, h * dh, **kw) for _ in range(4))
        self.norm = RMSNorm(h * dh, eps=record.LIGHTNING_EPS, dtype=dtype)
        self.out = dense(h * dh, d, **kw)
        for name, value in zip(record.BUFFERS, record.decays(config, index)):
            setattr(self, name, nnx.Param(jnp.asarray(value, dtype)))
        self.act = jax.nn.silu if config.hidden_act == "silu" else None
        if self.act is None:
            raise InputError(f"hidden_act={config.hidden_act!r}: the lightning layers here run silu, as MiniMax's checkpoints")

    def __call__(self, x, mask):
        b, t, _ = x.shape
        h, dh = self.heads, self.head_dim
        q, k, v = (self.act(p(x)) for p in (self.query, self.key, self.value))
        if mask is not None:  # padding's q, k and v zeroed, as transformers does
            q, k, v = (y * mask[..., None].astype(y.dtype) for y in (q, k, v))
        q, k, v = (y.reshape(b, t, h, dh).astype(jnp.float32) for y in (q, k, v))
        # o_t = sum_{s <= t} exp(-slope (t - s)) (q_t . k_s) v_s: transformers' blocks (intra and inter) sum to this
        slope = self.slope_rate[...].astype(jnp.float32).reshape(h, 1, 1)
        steps = jnp.arange(t, dtype=jnp.float32)
        gap = steps[:, None] - steps[None, :]
        decay = jnp.where(gap >= 0, jnp.exp(-slope * jnp.maximum(gap, 0.0)), 0.0)  # (H, T, T)
        scores = jnp.einsum("bthd,bshd->bhts", q, k) * decay
        o = jnp.einsum("bhts,bshd->bthd", scores, v).reshape(b, t, h * dh).astype(x.dtype)
        return self.out(jax.nn.sigmoid(self.gate(x)) * self.norm(o))


class Layer(nnx.Module):
    def __init__(self, config, index, dtype, rngs):
        d, std, eps = config.hidden_size, config.initializer_range, config.rms_norm_eps
        self.attention_norm = RMSNorm(d, eps=eps, dtype=dtype)
        full = record.attention_layer(config, index)
        self.attention = Attention(d, heads=record.head_geometry(config), qkv_bias=False, out_bias=False, dtype=dtype, rngs=rngs,
                                   std=std) if full else None
        self.lightning = None if full else Lightning(config, index, dtype=dtype, rngs=rngs, std=std)
        kind = "full_attn" if full else "linear_attn"
        self.alpha, self.beta = float(getattr(config, f"{kind}_alpha_factor")), float(getattr(config, f"{kind}_beta_factor"))
        self.mlp_alpha, self.mlp_beta = float(config.mlp_alpha_factor), float(config.mlp_beta_factor)
        self.mlp_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.moe = MoE(d, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok, act=config.hidden_act,
                       normalize=True, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias, rope, mask):
        y = self.attention_norm(x)
        x = y * self.alpha + (self.attention(y, bias, rope) if self.lightning is None else self.lightning(y, mask)) * self.beta
        y = self.mlp_norm(x)
        return y * self.mlp_alpha + self.moe(y) * self.mlp_beta


class Decoder(HybridDecoder):
    """MiniMax's text model; head None (`MiniMaxModel`) or "lm" (`MiniMaxForCausalLM`)."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        rope = "full_attention" in config.layer_types
        super().__init__(config, layout, dtype, rngs, layer=Layer, inv_freq=record.inv_freq(config) if rope else None, tied=is_tied(config),
                         eps=config.rms_norm_eps)
