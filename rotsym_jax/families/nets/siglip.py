"""SigLIP's towers in Flax NNX (their records: `families/siglip.py`): CLIP's encoder layers; the
image tower's patch convolution with a bias and positions (no class token, no norm before the
layers), `post_layernorm` over every token and the attention-pooling head (a learned probe as the
one query); the text tower's bidirectional attention, the last token's state through `head`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from .clip import TextEmbeddings
from .layers import MLP, Attention, LayerNorm, attention_bias, dense, multi_head, normal_init, run_layers
from .vit import EncoderLayer, patches

STD = 0.02  # SigLIP's configs carry no initializer_range


class _Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, p = config.hidden_size, config.patch_size
        self.image_size, self.patch_size, self.num_channels = config.image_size, p, config.num_channels
        self.patch = dense(config.num_channels * p * p, d, bias=True, dtype=dtype, rngs=rngs, std=STD)
        self.position = nnx.Param(normal_init(STD)(rngs.params(), ((config.image_size // p) ** 2, d), dtype))

    def __call__(self, pixel_values):
        b, c, h, w = pixel_values.shape
        if (c, h, w) != (self.num_channels, self.image_size, self.image_size):
            raise InputError(f"pixel_values of shape {pixel_values.shape}: expected (B, {self.num_channels}, {self.image_size}, "
                             f"{self.image_size}) from the config (other sizes would need interpolate_pos_encoding, which is not supported)")
        return self.patch(patches(pixel_values.astype(self.patch.kernel.dtype), (self.patch_size, self.patch_size))) + self.position[...]


class _PoolBlock(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d = config.hidden_size
        self.attention = Attention(d, heads=multi_head(d, config.num_attention_heads), dtype=dtype, rngs=rngs, std=STD)
        self.mlp_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = MLP(d, config.intermediate_size, act=config.hidden_act, dtype=dtype, rngs=rngs, std=STD)


class AttentionPooling(nnx.Module):
    """SiglipMultiheadAttentionPoolingHead: the probe attends to the normed states; then a
    residual MLP block of its own (leaves probe, layers/0/{attention, mlp_norm, mlp})."""

    def __init__(self, config, dtype, rngs):
        self.probe = nnx.Param(normal_init(1.0)(rngs.params(), (1, 1, config.hidden_size), dtype))
        self.layers = nnx.List([_PoolBlock(config, dtype, rngs)])

    def __call__(self, x):
        block = self.layers[0]
        probe = jnp.broadcast_to(self.probe[...], (x.shape[0], 1, x.shape[-1]))
        h = block.attention(probe, attention_bias(None, 1, causal=False), memory=x)
        return (h + block.mlp(block.mlp_norm(h)))[:, 0]


class VisionTower(nnx.Module):
    """SiglipVisionModel, with its pooling head where the checkpoint has one (vision_use_head)."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.embeddings = _Embeddings(config, dtype, rngs)
        self.layers = nnx.List([EncoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.final_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.pooler = AttentionPooling(config, dtype, rngs) if layout.pooler else None

    def __call__(self, pixel_values):
        x = self.embeddings(pixel_values)
        bias = attention_bias(None, x.shape[1], causal=False)
        x = run_layers(self.layers, x, lambda i: (bias,))
        x = self.final_norm(x)
        out = {"last_hidden_state": x}
        if self.pooler is not None:
            out["pooler_output"] = self.pooler(x)
        return out


class _Pooler(nnx.Module):
    def __init__(self, config, dtype, rngs):
        self.dense = dense(config.hidden_size, config.projection_size, bias=True, dtype=dtype, rngs=rngs, std=STD)


class TextTower(nnx.Module):
    """SiglipTextModel: no causal mask; the pooled output is the last token's state through `head`."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.embeddings = TextEmbeddings(config, dtype, rngs)
        self.layers = nnx.List([EncoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.final_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.pooler = _Pooler(config, dtype, rngs)

    def __call__(self, input_ids, attention_mask=None):
        x = self.embeddings(input_ids)
        bias = attention_bias(attention_mask, x.shape[1], causal=False)
        x = run_layers(self.layers, x, lambda i: (bias,))
        x = self.final_norm(x)
        # the last token's state, padding or not, as transformers pools it
        return {"last_hidden_state": x, "pooler_output": self.pooler.dense(x[:, -1])}


class Dual(nnx.Module):
    """SiglipModel: both towers (leaves text/..., vision/...), `logit_scale` and `logit_bias` (1,)."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.text = TextTower(config.text_config, Layout(), dtype, rngs=rngs)
        self.vision = VisionTower(config.vision_config, Layout(pooler=True), dtype, rngs=rngs)
        self.logit_scale, self.logit_bias = nnx.Param(jnp.zeros((1,), dtype)), nnx.Param(jnp.zeros((1,), dtype))

    def __call__(self, input_ids, pixel_values, attention_mask=None):
        text, vision = self.text(input_ids, attention_mask), self.vision(pixel_values)
        text_embeds, image_embeds = text["pooler_output"], vision["pooler_output"]
        text_embeds = text_embeds / jnp.linalg.norm(text_embeds, axis=-1, keepdims=True)
        image_embeds = image_embeds / jnp.linalg.norm(image_embeds, axis=-1, keepdims=True)
        logits_per_text = text_embeds @ image_embeds.T * jnp.exp(self.logit_scale[...]) + self.logit_bias[...]
        return {"logits_per_image": logits_per_text.T, "logits_per_text": logits_per_text, "text_embeds": text_embeds,
                "image_embeds": image_embeds, "text_last_hidden_state": text["last_hidden_state"],
                "vision_last_hidden_state": vision["last_hidden_state"]}
