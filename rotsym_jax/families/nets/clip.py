"""CLIP's image tower in Flax NNX (its record: `families/clip.py`): ViT's pre-LayerNorm encoder
layers behind the patch convolution, the class embedding and positions, `pre_layrnorm` before the
first layer, the pooled class token through `post_layernorm` and, with the projection, the image
embeddings."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from .layers import LayerNorm, attention_bias, dense, normal_init
from .vit import EncoderLayer, patches


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std, p = config.hidden_size, config.initializer_range, config.patch_size
        self.image_size, self.patch_size, self.num_channels = config.image_size, p, config.num_channels
        self.patch = dense(config.num_channels * p * p, d, bias=False, dtype=dtype, rngs=rngs, std=std)
        init = normal_init(std)
        self.cls_token = nnx.Param(init(rngs.params(), (d,), dtype))
        self.position = nnx.Param(init(rngs.params(), ((config.image_size // p) ** 2 + 1, d), dtype))
        self.norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)

    def __call__(self, pixel_values):
        b, c, h, w = pixel_values.shape
        if (c, h, w) != (self.num_channels, self.image_size, self.image_size):
            raise InputError(f"pixel_values of shape {pixel_values.shape}: expected (B, {self.num_channels}, {self.image_size}, "
                             f"{self.image_size}) from the config (other sizes would need interpolate_pos_encoding, which is not supported)")
        x = self.patch(patches(pixel_values.astype(self.patch.kernel.dtype), (self.patch_size, self.patch_size)))
        cls = jnp.broadcast_to(self.cls_token[...], (b, 1, x.shape[-1]))
        return self.norm(jnp.concatenate([cls, x], axis=1) + self.position[...])


class Projection(nnx.Module):
    """visual_projection: the pooled state into the joint image-text space (leaf projection/kernel)."""

    def __init__(self, config, dtype, rngs):
        self.projection = dense(config.hidden_size, config.projection_dim, bias=False, dtype=dtype, rngs=rngs, std=config.initializer_range)


class VisionTower(nnx.Module):
    """CLIPVisionModel (head None) or CLIPVisionModelWithProjection (head "image_embeds")."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([EncoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.final_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.head = Projection(config, dtype, rngs) if layout.head == "image_embeds" else None

    def __call__(self, pixel_values):
        x = self.embeddings(pixel_values)
        bias = attention_bias(None, x.shape[1], causal=False)
        for layer in self.layers:
            x = layer(x, bias)
        pooled = self.final_norm(x[:, 0])
        out = {"last_hidden_state": x, "pooler_output": pooled}
        if self.head is not None:
            out["image_embeds"] = self.head.projection(pooled)
        return out
