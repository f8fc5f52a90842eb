"""CLIP's towers in Flax NNX (their records: `families/clip.py`): ViT's pre-LayerNorm encoder
layers; the image tower's patch convolution, class embedding and positions, `pre_layrnorm` before
the first layer, the pooled class token through `post_layernorm`; the text tower's token and
position embeddings, causal attention, `final_layer_norm` and the eos token's pooled state; with
the projection, the embeddings in the joint space."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from .layers import LayerNorm, attention_bias, dense, embed, normal_init, run_layers
from .vit import EncoderLayer, patches


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std, p = config.hidden_size, config.initializer_range, config.patch_size
        self.image_size, self.patch_size, self.num_channels = config.image_size, p, config.num_channels
        self.patch = dense(config.num_channels * p * p, d, bias=False, dtype=dtype, rngs=rngs, std=std)
        init = normal_init(std)
        # leaf embeddings/class, as the record names it ("class" is a keyword: set and read by name)
        setattr(self, "class", nnx.Param(init(rngs.params(), (d,), dtype)))
        self.position = nnx.Param(init(rngs.params(), ((config.image_size // p) ** 2 + 1, d), dtype))
        self.norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)

    def __call__(self, pixel_values):
        b, c, h, w = pixel_values.shape
        if (c, h, w) != (self.num_channels, self.image_size, self.image_size):
            raise InputError(f"pixel_values of shape {pixel_values.shape}: expected (B, {self.num_channels}, {self.image_size}, "
                             f"{self.image_size}) from the config (other sizes would need interpolate_pos_encoding, which is not supported)")
        x = self.patch(patches(pixel_values.astype(self.patch.kernel.dtype), (self.patch_size, self.patch_size)))
        cls = jnp.broadcast_to(getattr(self, "class")[...], (b, 1, x.shape[-1]))
        return self.norm(jnp.concatenate([cls, x], axis=1) + self.position[...])


class Projection(nnx.Module):
    """visual_projection or text_projection: the pooled state into the joint image-text space (leaf projection/kernel)."""

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
        x = run_layers(self.layers, x, lambda i: (bias,))
        pooled = self.final_norm(x[:, 0])
        out = {"last_hidden_state": x, "pooler_output": pooled}
        if self.head is not None:
            out["image_embeds"] = self.head.projection(pooled)
        return out


class TextTower(nnx.Module):
    """CLIPTextModel (head None) or CLIPTextModelWithProjection (head "text_embeds")."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        d = config.hidden_size
        self.embeddings = TextEmbeddings(config, dtype, rngs)
        self.layers = nnx.List([EncoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.final_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)
        self.eos_token_id = config.eos_token_id
        self.head = Projection(config, dtype, rngs) if layout.head == "text_embeds" else None

    def __call__(self, input_ids, attention_mask=None):
        x = self.embeddings(input_ids)
        bias = attention_bias(attention_mask, x.shape[1], causal=True)
        x = run_layers(self.layers, x, lambda i: (bias,))
        x = self.final_norm(x)
        # the first eos token's state (the largest id's for eos_token_id 2, as transformers reads older configs)
        eos = jnp.argmax(input_ids, axis=-1) if self.eos_token_id == 2 else jnp.argmax(input_ids == self.eos_token_id, axis=-1)
        pooled = jnp.take_along_axis(x, eos[:, None, None], axis=1)[:, 0]
        out = {"last_hidden_state": x, "pooler_output": pooled}
        if self.head is not None:
            out["text_embeds"] = self.head.projection(pooled)
        return out


class Dual(nnx.Module):
    """CLIPModel: both towers (leaves text/..., vision/...), each projection into the joint space
    (text/projection, vision/projection: `projection_dim` of the CLIPConfig) and `logit_scale`."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.text = TextTower(config.text_config, Layout(), dtype, rngs=rngs)
        self.vision = VisionTower(config.vision_config, Layout(), dtype, rngs=rngs)
        for tower in (self.text, self.vision):
            tower.projection = dense(tower.final_norm.scale.shape[0], config.projection_dim, bias=False, dtype=dtype, rngs=rngs,
                                     std=config.text_config.initializer_range)
        self.logit_scale = nnx.Param(jnp.asarray(config.logit_scale_init_value if hasattr(config, "logit_scale_init_value") else 2.6592, dtype))

    def __call__(self, input_ids, pixel_values, attention_mask=None):
        text, vision = self.text(input_ids, attention_mask), self.vision(pixel_values)
        text_embeds, image_embeds = self.text.projection(text["pooler_output"]), self.vision.projection(vision["pooler_output"])
        text_embeds = text_embeds / jnp.linalg.norm(text_embeds, axis=-1, keepdims=True)
        image_embeds = image_embeds / jnp.linalg.norm(image_embeds, axis=-1, keepdims=True)
        logits_per_text = text_embeds @ image_embeds.T * jnp.exp(self.logit_scale[...])
        return {"logits_per_image": logits_per_text.T, "logits_per_text": logits_per_text, "text_embeds": text_embeds,
                "image_embeds": image_embeds, "text_last_hidden_state": text["last_hidden_state"],
                "vision_last_hidden_state": vision["last_hidden_state"]}


class TextEmbeddings(nnx.Module):
    """Token and position embeddings (leaves word/embedding, position)."""

    def __init__(self, config, dtype, rngs):
        std = getattr(config, "initializer_range", 0.02)  # SigLIP's text tower, which reuses these, has none
        init = normal_init(std)
        self.word = embed(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs, std=std)
        self.position = nnx.Param(init(rngs.params(), (config.max_position_embeddings, config.hidden_size), dtype))

    def __call__(self, input_ids):
        t = input_ids.shape[1]
        if t > self.position.shape[0]:
            raise InputError(f"input_ids of length {t}: CLIP's text tower holds {self.position.shape[0]} positions")
        return self.word(input_ids) + self.position[...][:t]
