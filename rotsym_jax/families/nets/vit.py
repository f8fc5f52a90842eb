"""The vit forward pass in Flax NNX; its record (tensors, config, heads) is `families/vit.py`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from ..vit import grid_of, pair_of
from . import heads
from .layers import MLP, Attention, LayerNorm, activation, attention_bias, dense, multi_head, normal_init, run_layers


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, config.initializer_range
        (ph, pw), (gh, gw) = pair_of(config.patch_size), grid_of(config)
        self.image_size, self.patch_size = pair_of(config.image_size), (ph, pw)
        self.num_channels = config.num_channels
        self.patch = dense(config.num_channels * ph * pw, d, bias=True, dtype=dtype, rngs=rngs, std=std)
        # transformers draws these from a normal truncated at +-2 (absolute): at std 0.02, a normal.
        init = normal_init(std)
        self.cls_token = nnx.Param(init(rngs.params(), (1, 1, d), dtype))
        self.position = nnx.Param(init(rngs.params(), (1, gh * gw + 1, d), dtype))

    def __call__(self, pixel_values):
        b, c, h, w = pixel_values.shape
        if c != self.num_channels or (h, w) != self.image_size:
            raise InputError(
                f"pixel_values of shape {pixel_values.shape}: expected (B, {self.num_channels}, "
                f"{self.image_size[0]}, {self.image_size[1]}) from the config (other sizes would need "
                f"interpolate_pos_encoding, which is not supported)"
            )
        x = patches(pixel_values.astype(self.patch.kernel.dtype), self.patch_size)
        cls = jnp.broadcast_to(self.cls_token[...], (b, 1, self.cls_token.shape[-1]))
        return jnp.concatenate([cls, self.patch(x)], axis=1) + self.position[...]


def patches(x, patch_size):
    """Images (B, C, H, W) as their patches (B, N, C ph pw), row-major over the grid, each in
    (c, i, j) order: what a stride-p convolution reads (the rows and columns past the last whole
    patch dropped, as it drops them)."""
    b, c, h, w = x.shape
    ph, pw = patch_size
    gh, gw = h // ph, w // pw
    x = x[:, :, : gh * ph, : gw * pw].reshape(b, c, gh, ph, gw, pw)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * ph * pw)


class EncoderLayer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, getattr(config, "initializer_range", 0.02)  # SigLIP's configs have none
        self.attention_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)
        self.attention = Attention(
            d,
            heads=multi_head(d, config.num_attention_heads, getattr(config, "head_dim", None)),
            qkv_bias=getattr(config, "qkv_bias", True),  # CLIP's tower (which reuses this layer) always has them
            dtype=dtype,
            rngs=rngs,
            std=std,
        )
        self.mlp_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(d, config.intermediate_size, act=config.hidden_act, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias):
        x = x + self.attention(self.attention_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class Pooler(nnx.Module):
    def __init__(self, config, dtype, rngs):
        self.act = activation(config.pooler_act)
        self.dense = dense(
            config.hidden_size, config.pooler_output_size, bias=True, dtype=dtype, rngs=rngs,
            std=config.initializer_range,
        )

    def __call__(self, x):
        return self.act(self.dense(x[:, 0]))


class ViT(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([EncoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.final_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.pooler = Pooler(config, dtype, rngs) if layout.pooler else None
        if layout.head == "image_classification" and config.num_labels < 1:  # transformers swaps in nn.Identity
            raise InputError(f"image classification needs num_labels >= 1, got {config.num_labels}")
        self.head = heads.Linear("classifier", config.hidden_size, config.num_labels, reads="first", dtype=dtype, rngs=rngs,
                                 std=config.initializer_range) if layout.head == "image_classification" else None

    def __call__(self, pixel_values, attention_mask=None):
        x = self.embeddings(pixel_values)
        bias = attention_bias(attention_mask, x.shape[1], causal=False)
        x = run_layers(self.layers, x, lambda i: (bias,))
        x = self.final_norm(x)
        out = {"last_hidden_state": x}
        if self.pooler is not None:
            out["pooler_output"] = self.pooler(x)
        if self.head is not None:
            out.update(self.head(x))
        return out
