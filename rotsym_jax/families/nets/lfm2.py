"""The LFM2 forward pass in Flax NNX (its record: `families/lfm2.py`): attention layers and gated
short convolutions, each followed by a SwiGLU MLP."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from .. import lfm2
from ..family import Layout
from ..llama._config import is_tied, rope_inv_freq
from .decoders import HybridDecoder
from .layers import MLP, Attention, QKNorm, RMSNorm, dense
from .mamba import DepthwiseConv


class ShortConv(nnx.Module):
    """b, c, x = in_b(h), in_c(h), in_x(h); out(c * conv(b * x)), padding zeroed before it as transformers does."""

    def __init__(self, config, *, dtype, rngs, std):
        d, kw = config.hidden_size, dict(bias=config.conv_bias, dtype=dtype, rngs=rngs, std=std)
        self.in_b, self.in_c, self.in_x = dense(d, d, **kw), dense(d, d, **kw), dense(d, d, **kw)
        self.conv = DepthwiseConv(d, config.conv_L_cache, **kw)
        self.out = dense(d, d, **kw)

    def __call__(self, h, mask):
        if mask is not None:
            h = h * mask[..., None].astype(h.dtype)
        return self.out(self.in_c(h) * self.conv(self.in_b(h) * self.in_x(h)))


class Layer(nnx.Module):
    def __init__(self, config, index, dtype, rngs):
        d, std, eps = config.hidden_size, config.initializer_range, config.norm_eps
        self.operator_norm = RMSNorm(d, eps=eps, dtype=dtype)
        attention = config.layer_types[index] == "full_attention"
        self.attention = Attention(d, heads=lfm2.head_geometry(config), qkv_bias=False, out_bias=False, qk_norm=QKNorm(eps),
                                   dtype=dtype, rngs=rngs, std=std) if attention else None
        self.conv = None if attention else ShortConv(config, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = MLP(d, lfm2.ffn_width(config), act="silu", gated=True, bias=False, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias, rope, mask):
        normed = self.operator_norm(x)
        x = x + (self.attention(normed, bias, rope) if self.conv is None else self.conv(normed, mask))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(HybridDecoder):
    """LFM2's model; head None (`Lfm2Model`) or "lm" (`Lfm2ForCausalLM`)."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        super().__init__(config, layout, dtype, rngs, layer=Layer, inv_freq=rope_inv_freq(config), tied=is_tied(config), eps=config.norm_eps)
