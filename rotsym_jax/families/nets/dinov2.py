"""The DINOv2 forward pass in Flax NNX; its record is `families/dinov2.py`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..dinov2 import mlp_width, swiglu_width
from ..family import Layout
from .layers import MLP, Attention, LayerNorm, attention_bias, multi_head, normal_init, run_layers
from .vit import Embeddings as ViTEmbeddings


class Embeddings(ViTEmbeddings):
    def __init__(self, config, dtype, rngs):
        super().__init__(config, dtype, rngs)
        # read only with bool_masked_pos (not run here); kept so that it round-trips
        self.mask_token = nnx.Param(jnp.zeros((1, config.hidden_size), dtype)) if getattr(config, "use_mask_token", True) else None
        # dinov2_with_registers: register tokens after the CLS token, added after the positions (none have one)
        registers = getattr(config, "num_register_tokens", 0)
        self.register_tokens = nnx.Param(jnp.zeros((1, registers, config.hidden_size), dtype)) if registers else None

    def __call__(self, pixel_values):
        x = super().__call__(pixel_values)
        if self.register_tokens is None:
            return x
        r = jnp.broadcast_to(self.register_tokens[...], (x.shape[0],) + self.register_tokens.shape[1:])
        return jnp.concatenate([x[:, :1], r, x[:, 1:]], axis=1)


class LayerScale(nnx.Module):
    def __init__(self, d, value, dtype):
        self.scale = nnx.Param(jnp.full((d,), value, dtype))

    def __call__(self, x):
        return x * self.scale[...]


class Layer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std, eps = config.hidden_size, config.initializer_range, config.layer_norm_eps
        self.attention_norm = LayerNorm(d, eps=eps, dtype=dtype)
        self.attention = Attention(d, heads=multi_head(d, config.num_attention_heads), qkv_bias=config.qkv_bias, dtype=dtype, rngs=rngs, std=std)
        self.attention_scale = LayerScale(d, config.layerscale_value, dtype)
        self.mlp_norm = LayerNorm(d, eps=eps, dtype=dtype)
        if config.use_swiglu_ffn:
            self.mlp = MLP(d, swiglu_width(config), act="silu", gated=True, dtype=dtype, rngs=rngs, std=std)
        else:
            self.mlp = MLP(d, mlp_width(config), act=config.hidden_act, dtype=dtype, rngs=rngs, std=std)
        self.mlp_scale = LayerScale(d, config.layerscale_value, dtype)

    def __call__(self, x, bias):
        x = x + self.attention_scale(self.attention(self.attention_norm(x), bias))
        return x + self.mlp_scale(self.mlp(self.mlp_norm(x)))


class Classifier(nnx.Module):
    """Dinov2ForImageClassification's linear layer over [CLS token; mean of the patch tokens]."""

    def __init__(self, d, num_labels, *, first_patch: int, dtype, rngs, std):
        self.first_patch = first_patch  # past the CLS token and any register tokens
        self.classifier = _Halves(d, num_labels, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x):
        c = self.classifier
        logits = x[:, 0] @ c.kernel[...] + x[:, self.first_patch:].mean(axis=1) @ c.mean_kernel[...] + c.bias[...]
        return {"logits": logits}


class _Halves(nnx.Module):
    """The classifier's two halves (leaves `kernel`, `mean_kernel`) and its `bias`."""

    def __init__(self, d, num_labels, *, dtype, rngs, std):
        init = normal_init(std)
        self.kernel = nnx.Param(init(rngs.params(), (d, num_labels), dtype))
        self.mean_kernel = nnx.Param(init(rngs.params(), (d, num_labels), dtype))
        self.bias = nnx.Param(jnp.zeros((num_labels,), dtype))


class Dinov2(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError("DINOv2 has no pooler layer: layout.pooler must be False")
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([Layer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.final_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        if layout.head == "image_classification" and config.num_labels < 1:  # transformers swaps in nn.Identity
            raise InputError(f"image classification needs num_labels >= 1, got {config.num_labels}")
        first_patch = 1 + getattr(config, "num_register_tokens", 0)
        self.head = Classifier(config.hidden_size, config.num_labels, first_patch=first_patch, dtype=dtype, rngs=rngs,
                               std=config.initializer_range) if layout.head == "image_classification" else None

    def __call__(self, pixel_values, attention_mask=None):
        x = self.embeddings(pixel_values)
        bias = attention_bias(attention_mask, x.shape[1], causal=False)
        x = self.final_norm(run_layers(self.layers, x, lambda i: (bias,)))
        out = {"last_hidden_state": x, "pooler_output": x[:, 0]}  # Dinov2Model's pooled output: the normed CLS token
        if self.head is not None:
            out.update(self.head(x))
        return out
