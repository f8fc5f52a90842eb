"""The Mamba-2 forward pass in Flax NNX (its record: `families/mamba2.py`): the mixer, run as a
sequential scan over the tokens (float32 states; transformers' torch path computes the same sums in
chunks), which Granite-4's hybrid shares, and Mamba-2's decoder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..mamba2 import sizes
from . import mamba
from .layers import dense, normal_init


class Weights(nnx.Module):
    """A leaf `kernel` of any shape and an optional `bias`: the mixer's per-head leaves and its
    convolutions. With `record` (set where activation matching asks for its sites,
    `layers.record_dense_inputs(..., sites=True)`; a convolution is no linear layer, whose inputs
    RegMean would read), the mixer sows what it reads: each head's channels, each state entry."""

    record = False
    site = True

    def __init__(self, shape, bias_shape=None, *, dtype, rngs, std):
        self.kernel = nnx.Param(normal_init(std)(rngs.params(), shape, dtype))
        self.bias = None if bias_shape is None else nnx.Param(jnp.zeros(bias_shape, dtype))


class Scale(nnx.Module):
    def __init__(self, shape, dtype):
        self.scale = nnx.Param(jnp.ones(shape, dtype))


def _conv(x, kernel, bias):
    """Causal depthwise convolution over time: x (B, T, C), kernel (C, k), bias (C,) or None."""
    taps, t = kernel.shape[1], x.shape[1]
    padded = jnp.pad(x, ((0, 0), (taps - 1, 0), (0, 0)))
    out = sum(padded[:, j:j + t] * kernel[:, j] for j in range(taps))
    return out if bias is None else out + bias


class Mixer(nnx.Module):
    """Leaves as `families/mamba2.py` lists them."""

    def __init__(self, config, *, dtype, rngs, std):
        m = sizes(config)
        d, h, p, gn, k = config.hidden_size, m.heads, m.head_dim, m.groups * m.state, m.conv
        kw = dict(dtype=dtype, rngs=rngs, std=std)
        bias, conv_bias = m.bias, m.conv_bias
        self.in_z, self.in_x = (Weights((h, d, p), (h, p) if bias else None, **kw) for _ in range(2))
        self.in_b, self.in_c = (dense(d, gn, bias=bias, **kw) for _ in range(2))
        self.in_dt = dense(d, h, bias=bias, **kw)
        self.conv_x = Weights((h, p, k), (h, p) if conv_bias else None, **kw)
        self.conv_b, self.conv_c = (Weights((gn, k), (gn,) if conv_bias else None, **kw) for _ in range(2))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, h + 1, dtype=jnp.float32)).astype(dtype))
        self.D, self.dt_bias = nnx.Param(jnp.ones((h,), dtype)), nnx.Param(jnp.ones((h,), dtype))
        self.norm = Scale((h, p), dtype)
        self.out = Weights((h, p, d), (d,) if bias else None, **kw)
        self.groups, self.state, self.eps = m.groups, m.state, m.eps
        self.limit = m.limit

    def __call__(self, h, mask):
        if mask is not None:  # padding's hidden states are zeroed before and after the convolution, as transformers does
            h = h * mask[..., None].astype(h.dtype)
        heads, width = self.in_z.kernel.shape[0], self.in_z.kernel.shape[2]
        z, x = (jnp.einsum("btd,hdp->bthp", h, w.kernel[...]) + (0 if w.bias is None else w.bias[...]) for w in (self.in_z, self.in_x))
        b, c, dt = self.in_b(h), self.in_c(h), self.in_dt(h)
        for module, site in ((self.conv_x, x), (self.conv_b, b), (self.conv_c, c)):
            if module.record:  # each head's channels, each state entry, before the convolution
                module.sow(nnx.Intermediate, "inputs", site)
        x = jax.nn.silu(_conv(x.reshape(*x.shape[:2], -1), self.conv_x.kernel[...].reshape(heads * width, -1),
                              None if self.conv_x.bias is None else self.conv_x.bias[...].reshape(-1)))
        b, c = (jax.nn.silu(_conv(v, w.kernel[...], None if w.bias is None else w.bias[...])) for v, w in ((b, self.conv_b), (c, self.conv_c)))
        if mask is not None:
            x, b, c = (v * mask[..., None].astype(v.dtype) for v in (x, b, c))
        f32 = jnp.float32
        x = x.reshape(*x.shape[:2], heads, width).astype(f32)
        per_group = heads // self.groups  # head h reads group h // per_group
        b = jnp.repeat(b.reshape(*b.shape[:2], self.groups, self.state).astype(f32), per_group, axis=2)  # (B, T, H, N)
        c = jnp.repeat(c.reshape(*c.shape[:2], self.groups, self.state).astype(f32), per_group, axis=2)
        dt = jax.nn.softplus(dt.astype(f32) + self.dt_bias[...].astype(f32))  # (B, T, H)
        if self.limit is not None:
            dt = jnp.clip(dt, *self.limit)
        decay = jnp.exp(dt * -jnp.exp(self.A_log[...].astype(f32)))  # (B, T, H)

        def step(state, inputs):  # state (B, H, P, N)
            decay_t, dt_t, x_t, b_t, c_t = inputs
            state = decay_t[..., None, None] * state + (dt_t[..., None] * x_t)[..., None] * b_t[:, :, None, :]
            return state, jnp.einsum("bhpn,bhn->bhp", state, c_t)

        start = jnp.zeros((x.shape[0], heads, width, self.state), f32)
        _, y = jax.lax.scan(step, start, tuple(jnp.moveaxis(v, 1, 0) for v in (decay, dt, x, b, c)))
        y = jnp.moveaxis(y, 0, 1) + x * self.D[...].astype(f32)[:, None]  # (B, T, H, P)
        y = y * jax.nn.silu(z.astype(f32))
        grouped = y.reshape(*y.shape[:2], self.groups, -1)  # the RMS over each group's heads
        grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + self.eps)
        y = grouped.reshape(y.shape).astype(h.dtype) * self.norm.scale[...]
        if self.out.record:  # each head's channels as out_proj reads them
            self.out.sow(nnx.Intermediate, "inputs", y)
        out = jnp.einsum("bthp,hpd->btd", y, self.out.kernel[...])
        return out if self.out.bias is None else out + self.out.bias[...]


class Decoder(mamba.Decoder):
    """Mamba-2's backbone; head None (`Mamba2Model`) or "lm" (`Mamba2ForCausalLM`): Mamba's with this mixer."""

    mixer = Mixer
