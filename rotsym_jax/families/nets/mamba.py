"""The Mamba forward pass in Flax NNX (its record: `families/mamba.py`): the selective state-space
mixer, run as transformers' sequential scan (one step per token, float32 states), and the decoder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from ..llama._config import is_tied
from . import heads
from .layers import RMSNorm, WordEmbeddings, dense, normal_init, run_layers


class DepthwiseConv(nnx.Module):
    """A causal convolution over time of each channel on its own: leaves kernel (f, taps), bias (f,)."""

    def __init__(self, channels, taps, *, bias, dtype, rngs, std):
        self.kernel = nnx.Param(normal_init(std)(rngs.params(), (channels, taps), dtype))
        self.bias = nnx.Param(jnp.zeros((channels,), dtype)) if bias else None

    def __call__(self, x):
        """x (B, T, f) -> (B, T, f): out[t] = sum_j kernel[:, j] x[t - taps + 1 + j] (zeros before the start)."""
        kernel = self.kernel[...]
        taps, t = kernel.shape[1], x.shape[1]
        padded = jnp.pad(x, ((0, 0), (taps - 1, 0), (0, 0)))
        out = sum(padded[:, j:j + t] * kernel[:, j] for j in range(taps))
        return out if self.bias is None else out + self.bias[...]


class Mixer(nnx.Module):
    """Leaves as `families/mamba.py` lists them."""

    def __init__(self, config, *, dtype, rngs, std):
        d, f, n, r, k = config.hidden_size, config.intermediate_size, config.state_size, config.time_step_rank, config.conv_kernel
        kw = dict(dtype=dtype, rngs=rngs, std=std)
        self.in_x, self.in_gate = dense(d, f, bias=config.use_bias, **kw), dense(d, f, bias=config.use_bias, **kw)
        self.conv = DepthwiseConv(f, k, bias=config.use_conv_bias, **kw)
        self.x_dt, self.x_b, self.x_c = dense(f, r, bias=False, **kw), dense(f, n, bias=False, **kw), dense(f, n, bias=False, **kw)  # x_proj's thirds
        self.dt_proj = dense(r, f, bias=True, **kw)
        self.A_log = nnx.Param(jnp.log(jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.float32), (f, n))).astype(dtype))
        self.D = nnx.Param(jnp.ones((f,), dtype))
        self.out = dense(f, d, bias=config.use_bias, **kw)

    def __call__(self, h, mask):
        if mask is not None:  # padding's hidden states are zeroed before and after the convolution, as transformers does
            h = h * mask[..., None].astype(h.dtype)
        x, z = self.in_x(h), self.in_gate(h)
        x = jax.nn.silu(self.conv(x))
        if mask is not None:
            x = x * mask[..., None].astype(x.dtype)
        dt, b, c = self.x_dt(x), self.x_b(x), self.x_c(x)
        dt = jax.nn.softplus(self.dt_proj(dt).astype(jnp.float32))  # (B, T, f)
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))  # (f, N)
        decay = jnp.exp(a * dt[..., None])  # (B, T, f, N)
        drive = dt[..., None] * b[:, :, None, :].astype(jnp.float32) * x[..., None].astype(jnp.float32)

        def step(state, inputs):
            decay_t, drive_t, c_t = inputs
            state = decay_t * state + drive_t
            return state, jnp.einsum("bfn,bn->bf", state, c_t)

        start = jnp.zeros((x.shape[0], *a.shape), jnp.float32)
        _, y = jax.lax.scan(step, start, (jnp.moveaxis(decay, 1, 0), jnp.moveaxis(drive, 1, 0), jnp.moveaxis(c.astype(jnp.float32), 1, 0)))
        y = jnp.moveaxis(y, 0, 1) + x.astype(jnp.float32) * self.D[...].astype(jnp.float32)
        y = y * jax.nn.silu(z.astype(jnp.float32))
        return self.out(y.astype(h.dtype))


class Layer(nnx.Module):
    def __init__(self, config, dtype, rngs, mixer=Mixer):
        self.mixer_norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon, dtype=dtype)
        self.mixer = mixer(config, dtype=dtype, rngs=rngs, std=config.initializer_range)

    def __call__(self, x, mask):
        return x + self.mixer(self.mixer_norm(x), mask)


class Decoder(nnx.Module):
    """Mamba's backbone; head None (`MambaModel`) or "lm" (`MambaForCausalLM`). Mamba-2's is this one
    with its own mixer (`mixer`)."""

    mixer = Mixer

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError(f"{config.model_type} has no pooler: layout.pooler must be False")
        self.embeddings = WordEmbeddings(config, dtype, rngs)
        self.layers = nnx.List([Layer(config, dtype, rngs, type(self).mixer) for _ in range(config.num_hidden_layers)])
        self.final_norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon, dtype=dtype)
        self.lm = layout.head == "lm"
        untied = self.lm and not is_tied(config)
        self.lm_head = dense(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=config.initializer_range) if untied else None

    def __call__(self, input_ids, attention_mask=None):
        x = self.embeddings(input_ids)
        x = run_layers(self.layers, x, lambda i: (attention_mask,))
        return heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=self.lm_head, lm=self.lm, head=None,
                                     input_ids=input_ids)
