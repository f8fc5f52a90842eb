"""Qwen3.5's and Qwen3-Next's forward pass in Flax NNX (their record: `families/qwen3_next.py`): Gated
DeltaNet layers (the gated delta rule as a `jax.lax.scan` over tokens, in float32) or gated attention,
each followed by a SwiGLU or a mixture with a gated shared expert; zero-centred RMSNorms (1 + w)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .. import qwen3_next as record
from ..family import Layout
from ..llama._config import is_tied
from .decoders import HybridDecoder
from .layers import MLP, Attention, MoE, QKNorm, RMSNorm, activation, dense, normal_init


def l2_normed(x, eps=1e-6):
    """x / sqrt(sum x^2 + eps) over the last axis, as transformers' (and FLA's) l2norm."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_delta_rule(q, k, v, g, beta):
    """q, k (B, T, H, dk), v (B, T, H, dv), g, beta (B, T, H), float32: per head the state S (dk, dv)
    decays by exp(g), then S += k (beta (v - S^T k))^T; the output is S^T q, token by token."""
    b, _, h, dk = k.shape

    def step(state, inputs):
        q_t, k_t, v_t, g_t, beta_t = inputs
        state = state * jnp.exp(g_t)[..., None, None]
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", state, k_t)) * beta_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)

    state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
    _, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)))
    return jnp.moveaxis(out, 0, 1)


class GatedNorm(nnx.Module):
    """RMSNorm over each head's dv entries (one gain for all heads), then times silu(z); leaf `scale`."""

    def __init__(self, d, *, eps, dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((d,), dtype))

    def __call__(self, x, z):
        x32 = x.astype(jnp.float32)
        y = (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)).astype(x.dtype)
        return (self.scale[...] * y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class HeadKernel(nnx.Module):
    """A leaf `kernel` of the given shape (the key heads on one of its axes), read by `spec` in einsum.
    With `record` (set where activation matching asks for its sites, `layers.record_dense_inputs(...,
    sites=True)`: no `Dense`, whose inputs RegMean would read), it sows its input: the stream for in_*,
    each key head's entries for conv_* (the projections) and out (the gated norm's output)."""

    record = False
    site = True

    def __init__(self, shape, spec, *, dtype, rngs, std):
        self.kernel = nnx.Param(normal_init(std)(rngs.params(), shape, dtype))
        self.spec = spec

    def read(self, x):
        if self.record:
            self.sow(nnx.Intermediate, "inputs", x)
        return x

    def __call__(self, x):
        return jnp.einsum(self.spec, self.read(x), self.kernel[...])


def head_conv(x, kernel):
    """x (B, T, nk, w), kernel (nk, w, taps): each channel's causal convolution over time (zeros before the start)."""
    taps, t = kernel.shape[-1], x.shape[1]
    padded = jnp.pad(x, ((0, 0), (taps - 1, 0), (0, 0), (0, 0)))
    return sum(padded[:, j:j + t] * kernel[..., j] for j in range(taps))


class GatedDeltaNet(nnx.Module):
    """Leaves as the record lists them, the key heads' axis explicit: in_q ... in_a (d, nk, w), conv_q/k/v
    (nk, w, taps), A_log and dt_bias (nk, r), norm (dv,), out (nk, r dv, d)."""

    def __init__(self, config, *, dtype, rngs, std):
        d, nk, dk = config.hidden_size, config.linear_num_key_heads, config.linear_key_head_dim
        nv, dv, taps = config.linear_num_value_heads, config.linear_value_head_dim, config.linear_conv_kernel_dim
        r = nv // nk
        self.nk, self.dk, self.nv, self.dv = nk, dk, nv, dv
        kw = dict(dtype=dtype, rngs=rngs, std=std)
        widths = dict(q=dk, k=dk, v=r * dv, z=r * dv, b=r, a=r)
        self.in_q, self.in_k, self.in_v, self.in_z, self.in_b, self.in_a = (
            HeadKernel((d, nk, widths[p]), "btd,dnw->btnw", **kw) for p in "qkvzba")
        self.conv_q, self.conv_k, self.conv_v = (HeadKernel((nk, widths[p], taps), None, **kw) for p in "qkv")
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, nv)).reshape(nk, r).astype(dtype))
        self.dt_bias = nnx.Param(jnp.ones((nk, r), dtype))
        self.norm = GatedNorm(dv, eps=config.rms_norm_eps, dtype=dtype)
        self.out = HeadKernel((nk, r * dv, d), "btnw,nwd->btd", **kw)
        self.act = activation(config.hidden_act)

    def __call__(self, h, mask):
        if mask is not None:  # padding's hidden states zeroed, as transformers does
            h = h * mask[..., None].astype(h.dtype)
        b, t, _ = h.shape
        q, k, v = (self.act(head_conv(conv.read(proj(h)), conv.kernel[...])) for proj, conv in
                   ((self.in_q, self.conv_q), (self.in_k, self.conv_k), (self.in_v, self.conv_v)))
        v = v.reshape(b, t, self.nv, self.dv)
        beta = jax.nn.sigmoid(self.in_b(h)).reshape(b, t, self.nv).astype(jnp.float32)
        a = self.in_a(h).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = (-jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)).reshape(b, t, self.nv)
        # each key head serves nv / nk consecutive value heads
        q, k = (jnp.repeat(l2_normed(x.astype(jnp.float32)), self.nv // self.nk, axis=2) for x in (q, k))
        out = gated_delta_rule(q * self.dk ** -0.5, k, v.astype(jnp.float32), g, beta).astype(h.dtype)
        z = self.in_z(h).reshape(b, t, self.nv, self.dv)
        return self.out(self.norm(out, z).reshape(b, t, self.nk, -1))


class Layer(nnx.Module):
    def __init__(self, config, index, dtype, rngs):
        d, std, eps = config.hidden_size, config.initializer_range, config.rms_norm_eps
        self.attention_norm = RMSNorm(d, eps=eps, dtype=dtype, one_plus=True)
        attention = record.attention_layer(config, index)
        self.attention = Attention(d, heads=record.head_geometry(config), qkv_bias=False, out_bias=False, qk_norm=QKNorm(eps, one_plus=True),
                                   dtype=dtype, rngs=rngs, std=std) if attention else None
        self.deltanet = None if attention else GatedDeltaNet(config, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = RMSNorm(d, eps=eps, dtype=dtype, one_plus=True)
        sparse = record.sparse_layer(config, index)
        normalize = config.model_type == "qwen3_5_moe_text" or getattr(config, "norm_topk_prob", True)
        self.moe = MoE(d, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok, act=config.hidden_act,
                       normalize=normalize, dtype=dtype, rngs=rngs, std=std) if sparse else None
        self.shared_mlp = MLP(d, config.shared_expert_intermediate_size, act=config.hidden_act, gated=True, bias=False, dtype=dtype,
                              rngs=rngs, std=std) if sparse else None
        self.shared_gate = dense(d, 1, bias=False, dtype=dtype, rngs=rngs, std=std) if sparse else None
        self.mlp = None if sparse else MLP(d, config.intermediate_size, act=config.hidden_act, gated=True, bias=False, dtype=dtype,
                                           rngs=rngs, std=std)

    def __call__(self, x, bias, rope, mask):
        normed = self.attention_norm(x)
        x = x + (self.attention(normed, bias, rope) if self.deltanet is None else self.deltanet(normed, mask))
        normed = self.mlp_norm(x)
        if self.moe is None:
            return x + self.mlp(normed)
        return x + self.moe(normed) + jax.nn.sigmoid(self.shared_gate(normed)) * self.shared_mlp(normed)


class Decoder(HybridDecoder):
    """Qwen3.5's, Qwen3.5-MoE's or Qwen3-Next's text model; head None (`...Model`) or "lm" (`...ForCausalLM`)."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        rope = "full_attention" in config.layer_types
        super().__init__(config, layout, dtype, rngs, layer=Layer, inv_freq=record.inv_freq(config) if rope else None, tied=is_tied(config),
                         eps=config.rms_norm_eps, one_plus=True)
