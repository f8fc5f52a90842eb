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

import rotsym_jax as rj

from .config import BOOL, FLOAT, INT, SIZE, STR, ConfigSchema
from .family import Convert, Family, Head, Norm, Tensor, linear, norm, pre_norm_folds, weight


def pair_of(size) -> tuple[int, int]:
    """ViTConfig's image_size / patch_size: an int or an (h, w) pair."""
    return (size, size) if isinstance(size, int) else tuple(size)


def grid_of(config) -> tuple[int, int]:
    (h, w), (ph, pw) = pair_of(config.image_size), pair_of(config.patch_size)
    return h // ph, w // pw


def _patch_in(config) -> int:
    (ph, pw) = pair_of(config.patch_size)
    return config.num_channels * ph * pw


def _positions(config) -> int:
    gh, gw = grid_of(config)
    return gh * gw + 1


def _patch_to_ours(a, config):
    """Conv2d weight (d, C, ph, pw) -> dense kernel (C*ph*pw, d), rows in (c, i, j) order."""
    return (a.reshape(config.hidden_size, _patch_in(config)).T,)


def _patch_to_hf(t, config):
    (ph, pw) = pair_of(config.patch_size)
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
    build=lambda config, layout, dtype, rngs: rj.nets.vit.ViT(config, layout, dtype, rngs=rngs),
    input="pixel_values",
)
