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
    task heads (the records at the bottom):
        image_classification     head/classifier/{kernel (d, num_labels), bias}, on the CLS token
                                 of the final-norm output (ViTForImageClassification has no pooler)
                                                                                            (run here)
        masked_image_modeling    ViTForMaskedImageModeling: head/mask_token (1, 1, d) (HF's
                                 vit.embeddings.mask_token) and head/decoder/{kernel (d, s*s*C),
                                 bias} (HF's 1x1 conv decoder.0, s = encoder_stride); read, aligned,
                                 merged and saved, not run
Inputs: pixel_values (B, C, H, W) at the config's image_size, as transformers takes them;
attention_mask (B, N + 1) optional, 1 = attend. Not supported: `interpolate_pos_encoding` (other
image sizes), `bool_masked_pos`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ..errors import InputError
from . import heads
from .config import BOOL, FLOAT, INT, SIZE, STR, ConfigSchema
from .family import Convert, Family, Head, Layout, Norm, Tensor, linear, norm, pre_norm_folds, weight
from .layers import MLP, Attention, LayerNorm, activation, attention_bias, dense, multi_head


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
            raise InputError(
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
            heads=multi_head(d, config.num_attention_heads, getattr(config, "head_dim", None)),
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
        for layer in self.layers:
            x = layer(x, bias)
        x = self.final_norm(x)
        out = {"last_hidden_state": x}
        if self.pooler is not None:
            out["pooler_output"] = self.pooler(x)
        if self.head is not None:
            out.update(self.head(x))
        return out


# ---- the record ----------------------------------------------------------------------------------------

def _patch_in(config) -> int:
    (ph, pw) = _pair(config.patch_size)
    return config.num_channels * ph * pw


def _positions(config) -> int:
    gh, gw = _grid(config)
    return gh * gw + 1


def _patch_to_ours(a, config):
    """Conv2d weight (d, C, ph, pw) -> dense kernel (C*ph*pw, d), rows in (c, i, j) order."""
    return (a.reshape(config.hidden_size, _patch_in(config)).T,)


def _patch_to_hf(t, config):
    (ph, pw) = _pair(config.patch_size)
    return t[0].T.reshape(config.hidden_size, config.num_channels, ph, pw)


# A 1x1 conv's weight (out, in, 1, 1) <-> a dense kernel (in, out).
_CONV1X1 = Convert("conv1x1", lambda a, c: (a[:, :, 0, 0].T,), lambda t, c: t[0].T[:, :, None, None])


def _decoder_out(config) -> int:
    return config.encoder_stride**2 * config.num_channels


def _qkv_bias(config) -> bool:
    return config.qkv_bias


_E = "encoder.layer.{i}"
_LAYER = (
    *norm(f"{_E}.layernorm_before", "layers/{i}/attention_norm"),
    *(t for proj in ("query", "key", "value")
      for t in linear(f"{_E}.attention.attention.{proj}", f"layers/{{i}}/attention/{proj}", "hidden_size", "hidden_size",
                      bias=_qkv_bias, reads=True)),
    *linear(f"{_E}.attention.output.dense", "layers/{i}/attention/out", "hidden_size", "hidden_size", writes=True),
    *norm(f"{_E}.layernorm_after", "layers/{i}/mlp_norm"),
    *linear(f"{_E}.intermediate.dense", "layers/{i}/mlp/up", "hidden_size", "intermediate_size", reads=True),
    *linear(f"{_E}.output.dense", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", writes=True),
)
_EMBEDDINGS = (
    Tensor("embeddings.patch_embeddings.projection.weight", ("embeddings/patch/kernel",), ((_patch_in, "hidden_size"),), (1,),
           Convert("patch", _patch_to_ours, _patch_to_hf)),
    *weight("embeddings.patch_embeddings.projection.bias", "embeddings/patch/bias", ("hidden_size",), stream=0),
    *weight("embeddings.cls_token", "embeddings/cls_token", (1, 1, "hidden_size"), stream=2),
    *weight("embeddings.position_embeddings", "embeddings/position", (1, _positions, "hidden_size"), stream=2),
)
_HEADS = (
    Head("image_classification", "ForImageClassification", linear("classifier", "head/classifier", "hidden_size", "num_labels", reads=True),
         markers=("classifier.weight",), forward=True),
    Head("masked_image_modeling", "ForMaskedImageModeling",
         weight("{prefix}embeddings.mask_token", "head/mask_token", (1, 1, "hidden_size"), stream=2)
         + (Tensor("decoder.0.weight", ("head/decoder/kernel",), (("hidden_size", _decoder_out),), (0,), _CONV1X1),)
         + weight("decoder.0.bias", "head/decoder/bias", (_decoder_out,)),
         markers=("decoder.0.weight",)),
)


# The norms before attention, the MLP and what reads the final norm (pooler, classifier, the masked
# image modeling decoder): each gain (and bias) folds into the layers that read it.
_FOLDS = pre_norm_folds("up", r"(pooler/dense|head/(classifier|decoder))")


def _derive(values, raw):
    # ViTConfig: a pooler as wide as the model unless config.json names a (nonzero) width.
    values["pooler_output_size"] = values["pooler_output_size"] or values["hidden_size"]


SCHEMA = ConfigSchema("vit", "ViTConfig", {
    "hidden_size": (INT, 768), "num_hidden_layers": (INT, 12), "num_attention_heads": (INT, 12),
    "intermediate_size": (INT, 3072), "hidden_act": (STR, "gelu"), "initializer_range": (FLOAT, 0.02),
    "layer_norm_eps": (FLOAT, 1e-12), "image_size": (SIZE, 224), "patch_size": (SIZE, 16), "num_channels": (INT, 3),
    "qkv_bias": (BOOL, True), "encoder_stride": (INT, 16), "pooler_output_size": (INT.optional(), None), "pooler_act": (STR, "tanh"),
}, derive=_derive)

VIT = Family(
    name="vit",
    configs=(SCHEMA,),
    stems={"vit": "ViT"},
    prefix="vit.",
    marker="embeddings.cls_token",
    embeddings=_EMBEDDINGS,
    layer=_LAYER,
    final=norm("layernorm", "final_norm"),
    pooler=linear("pooler.dense", "pooler/dense", "hidden_size", "pooler_output_size", reads=True),
    heads=_HEADS,
    norm=Norm("layernorm", placement="pre", folds=_FOLDS),
    build=lambda config, layout, dtype, rngs: ViT(config, layout, dtype, rngs=rngs),
    input="pixel_values",
)
