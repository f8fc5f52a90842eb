"""ViT image encoder (pre-LayerNorm), with pooler and image-classification heads.

Leaves (d = hidden_size, f = intermediate_size, H = num_attention_heads, dh = head_dim or d // H, C =
num_channels, patches ph x pw, a gh x gw grid of N = gh * gw patches):
    embeddings/patch/kernel (C*ph*pw, d), embeddings/patch/bias (d,)
        HF's Conv2d `projection` (d, C, ph, pw) flattened: row c*ph*pw + i*pw + j of the kernel
        multiplies pixel (c, i, j) of a patch. Patches are numbered row-major over the grid, as
        the conv output's `flatten(2)`.
    embeddings/cls_token             (1, 1, d)
    embeddings/position              (1, N + 1, d)   position 0 is the CLS token's
    layers/{i}/attention_norm/{scale,bias}   LayerNorm before attention (layernorm_before)
    layers/{i}/attention/{query,key,value}/kernel (d, H*dh), .../bias (H*dh,) unless qkv_bias=False
    layers/{i}/attention/out/kernel  (H*dh, d), layers/{i}/attention/out/bias (d,)
    layers/{i}/mlp_norm/{scale,bias}         LayerNorm before the MLP (layernorm_after)
    layers/{i}/mlp/up/kernel (d, f), layers/{i}/mlp/up/bias (f,)       (intermediate.dense)
    layers/{i}/mlp/down/kernel (f, d), layers/{i}/mlp/down/bias (d,)   (output.dense)
    final_norm/{scale,bias}          (d,)            (layernorm)
    pooler/dense/{kernel (d, pooler_output_size), bias}   when the checkpoint has a pooler
    head (image_classification): head/classifier/{kernel (d, num_labels), bias}, on the CLS token
        of the final-norm output (ViTForImageClassification has no pooler)
Inputs: pixel_values (B, C, H, W) at the config's image_size, as transformers takes them;
attention_mask (B, N + 1) optional, 1 = attend. Not supported: `interpolate_pos_encoding` (other
image sizes), `bool_masked_pos` / mask_token and ViTForMaskedImageModeling (the only user of
`encoder_stride`).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from .config import BOOL, FLOAT, INT, SIZE, STR, ConfigSchema
from .family import Family, Layout, TensorRule, copy, detect_prefix, layer_norm, linear
from .layers import MLP, Attention, LayerNorm, activation, attention_bias, dense

HEADS = ("image_classification",)


def _pair(size) -> tuple[int, int]:
    """ViTConfig's image_size / patch_size: an int or an (h, w) pair."""
    return (size, size) if isinstance(size, int) else tuple(size)


def _grid(config) -> tuple[int, int]:
    (h, w), (ph, pw) = _pair(config.image_size), _pair(config.patch_size)
    return h // ph, w // pw


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, config.initializer_range
        (ph, pw), (gh, gw) = _pair(config.patch_size), _grid(config)
        self.image_size, self.patch_size = _pair(config.image_size), (ph, pw)
        self.num_channels = config.num_channels
        self.patch = dense(config.num_channels * ph * pw, d, bias=True, dtype=dtype, rngs=rngs, std=std)
        # transformers draws these from a normal truncated at +-2 (absolute): at std 0.02, a normal.
        init = nnx.initializers.normal(stddev=std)
        self.cls_token = nnx.Param(init(rngs.params(), (1, 1, d), dtype))
        self.position = nnx.Param(init(rngs.params(), (1, gh * gw + 1, d), dtype))

    def __call__(self, pixel_values):
        b, c, h, w = pixel_values.shape
        if c != self.num_channels or (h, w) != self.image_size:
            raise ValueError(
                f"pixel_values of shape {pixel_values.shape}: expected (B, {self.num_channels}, "
                f"{self.image_size[0]}, {self.image_size[1]}) from the config (other sizes would need "
                f"interpolate_pos_encoding, which is not supported)"
            )
        x = pixel_values.astype(self.patch.kernel.dtype)
        ph, pw = self.patch_size
        gh, gw = h // ph, w // pw
        # A stride-p conv drops the rows/columns past the last whole patch; so do we.
        x = x[:, :, : gh * ph, : gw * pw].reshape(b, c, gh, ph, gw, pw)
        patches = x.transpose(0, 2, 4, 1, 3, 5).reshape(b, gh * gw, c * ph * pw)
        cls = jnp.broadcast_to(self.cls_token[...], (b, 1, self.cls_token.shape[-1]))
        return jnp.concatenate([cls, self.patch(patches)], axis=1) + self.position[...]


class EncoderLayer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, config.initializer_range
        self.attention_norm = LayerNorm(d, eps=config.layer_norm_eps, dtype=dtype)
        self.attention = Attention(
            d,
            num_heads=config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None),
            qkv_bias=config.qkv_bias,
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


class Classifier(nnx.Module):
    def __init__(self, config, dtype, rngs):
        if config.num_labels < 1:  # transformers swaps in nn.Identity: no head to hold
            raise ValueError(f"image classification needs num_labels >= 1, got {config.num_labels}")
        self.classifier = dense(
            config.hidden_size, config.num_labels, bias=True, dtype=dtype, rngs=rngs,
            std=config.initializer_range,
        )

    def __call__(self, x):
        return self.classifier(x[:, 0])


class ViT(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.head not in (None, *HEADS):
            raise ValueError(f"unsupported head {layout.head!r} for ViT; use None or {HEADS[0]!r}")
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([EncoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        self.final_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.pooler = Pooler(config, dtype, rngs) if layout.pooler else None
        self.head = Classifier(config, dtype, rngs) if layout.head else None

    def __call__(self, pixel_values, attention_mask=None):
        x = self.embeddings(pixel_values)
        bias = attention_bias(attention_mask, x.shape[1], causal=False)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.final_norm(x)
        out = {"last_hidden_state": x}
        if self.pooler is not None:
            out["pooler_output"] = self.pooler(x)
        if self.head is not None:
            out["logits"] = self.head(x)
        return out


def _patch_rule(config, hf: str, ours: str) -> TensorRule:
    """Conv2d weight (d, C, ph, pw) <-> dense kernel (C*ph*pw, d), rows in (c, i, j) order."""
    d, c, (ph, pw) = config.hidden_size, config.num_channels, _pair(config.patch_size)
    return TensorRule(
        hf, (ours,), lambda a: (a.reshape(d, c * ph * pw).T,), lambda t: t[0].T.reshape(d, c, ph, pw)
    )


def _tensors(config, layout: Layout):
    n = layout.name
    rules = [
        _patch_rule(config, n("embeddings.patch_embeddings.projection.weight"), "embeddings/patch/kernel"),
        copy(n("embeddings.patch_embeddings.projection.bias"), "embeddings/patch/bias"),
        copy(n("embeddings.cls_token"), "embeddings/cls_token"),
        copy(n("embeddings.position_embeddings"), "embeddings/position"),
    ]
    # The names transformers writes to disk (its legacy layout; in memory it renames them).
    for i in range(config.num_hidden_layers):
        hf, ours = n(f"encoder.layer.{i}"), f"layers/{i}"
        rules += layer_norm(f"{hf}.layernorm_before", f"{ours}/attention_norm")
        for proj in ("query", "key", "value"):
            rules += linear(f"{hf}.attention.attention.{proj}", f"{ours}/attention/{proj}", bias=config.qkv_bias)
        rules += linear(f"{hf}.attention.output.dense", f"{ours}/attention/out")
        rules += layer_norm(f"{hf}.layernorm_after", f"{ours}/mlp_norm")
        rules += linear(f"{hf}.intermediate.dense", f"{ours}/mlp/up")
        rules += linear(f"{hf}.output.dense", f"{ours}/mlp/down")
    rules += layer_norm(n("layernorm"), "final_norm")
    if layout.pooler:
        rules += linear(n("pooler.dense"), "pooler/dense")
    if layout.head == "image_classification":
        rules += linear("classifier", "head/classifier")
    return rules


def _detect(names, config) -> Layout:
    prefix = detect_prefix(names, "vit.", "embeddings.cls_token")
    if "decoder.0.weight" in names or prefix + "embeddings.mask_token" in names:
        raise ValueError(
            "ViT masked image modeling (decoder / mask_token) is not supported; "
            "supported: ViTModel and ViTForImageClassification"
        )
    head = "image_classification" if "classifier.weight" in names else None
    return Layout(prefix=prefix, head=head, pooler=prefix + "pooler.dense.weight" in names)


def _derive(values, raw):
    # ViTConfig: a pooler as wide as the model unless config.json names a (nonzero) width.
    values["pooler_output_size"] = values["pooler_output_size"] or values["hidden_size"]


SCHEMA = ConfigSchema("vit", "ViTConfig", {
    "hidden_size": (INT, 768), "num_hidden_layers": (INT, 12), "num_attention_heads": (INT, 12),
    "intermediate_size": (INT, 3072), "hidden_act": (STR, "gelu"), "initializer_range": (FLOAT, 0.02),
    "layer_norm_eps": (FLOAT, 1e-12), "image_size": (SIZE, 224), "patch_size": (SIZE, 16), "num_channels": (INT, 3),
    "qkv_bias": (BOOL, True), "pooler_output_size": (INT.optional(), None), "pooler_act": (STR, "tanh"),
}, derive=_derive)

VIT = Family(
    name="vit",
    prefix="vit.",
    configs=(SCHEMA,),
    build=lambda config, layout, dtype, rngs: ViT(config, layout, dtype, rngs=rngs),
    tensors=_tensors,
    detect=_detect,
    architecture=lambda config, layout: "ViTForImageClassification" if layout.head else "ViTModel",
)
