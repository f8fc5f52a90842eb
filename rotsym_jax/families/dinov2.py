"""DINOv2 (`dinov2`): ViT's pre-LayerNorm image encoder with a layer scale after each sublayer (a gain
per channel, `lambda1`, on the sublayer's output before it joins the stream), a mask token, an MLP
(`fc1`, `fc2`, width hidden_size * mlp_ratio) or a SwiGLU FFN (`use_swiglu_ffn`).

Leaves (d = hidden_size):
    embeddings/patch/{kernel,bias}, embeddings/cls_token (1, 1, d), embeddings/position (1, N + 1, d): ViT's
    embeddings/mask_token (1, d)                    use_mask_token (read with bool_masked_pos, which is not run here)
    layers/{i}/attention_norm/{scale,bias}          norm1
    layers/{i}/attention/{query,key,value}/{kernel,bias}   attention.attention.{query,key,value} (the names
        transformers 5 writes, as the Hub's checkpoints hold them; attention.output.dense -> out)
    layers/{i}/attention_scale/scale (d,)           layer_scale1.lambda1
    layers/{i}/mlp_norm/{scale,bias}                norm2
    layers/{i}/mlp/{up,down}/{kernel,bias}          mlp.fc1, mlp.fc2 (SwiGLU: mlp.weights_in = [gate; up], weights_out = down)
    layers/{i}/mlp_scale/scale (d,)                 layer_scale2.lambda1
    final_norm/{scale,bias}                         layernorm
    image_classification: classifier (L, 2 d) over [CLS token; mean of the patch tokens], split into
        head/classifier/kernel (the CLS half), head/classifier/mean_kernel (the mean's half), head/classifier/bias.

The stream: permutations only. A layer scale is a gain per channel on what a sublayer writes: a
permutation moves it with the channels, a rotation R would need R^T diag(lambda) R to stay diagonal,
which it is not unless lambda is uniform (`DinoV2Family.residual_spec`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import rotsym_jax as rj

from .config import BOOL, FLOAT, INT, SIZE, STR, ConfigSchema, Kind
from .family import NO_READER, Convert, Family, Head, Norm, Tensor, linear, norm, pre_norm_folds, split_rows, weight
from .vit import VIT


def mlp_width(config) -> int:
    return int(config.hidden_size * config.mlp_ratio)


def swiglu_width(config) -> int:
    """Dinov2SwiGLUFFN's hidden width: 2/3 of the MLP's, rounded up to a multiple of 8."""
    return (int(mlp_width(config) * 2 / 3) + 7) // 8 * 8


def _swiglu(config) -> bool:
    return config.use_swiglu_ffn


def _plain(config) -> bool:
    return not config.use_swiglu_ffn


def _with(tensors, when):
    return tuple(dataclasses.replace(t, when=when) for t in tensors)


_D = "hidden_size"
_E = "encoder.layer.{i}"
_LAYER = (
    *norm(f"{_E}.norm1", "layers/{i}/attention_norm"),
    *(t for proj in ("query", "key", "value")
      for t in linear(f"{_E}.attention.attention.{proj}", f"layers/{{i}}/attention/{proj}", _D, _D, bias=lambda c: c.qkv_bias, reads=True)),
    *linear(f"{_E}.attention.output.dense", "layers/{i}/attention/out", _D, _D, writes=True),
    *weight(f"{_E}.layer_scale1.lambda1", "layers/{i}/attention_scale/scale", (_D,), stream=0),
    *norm(f"{_E}.norm2", "layers/{i}/mlp_norm"),
    *_with(linear(f"{_E}.mlp.fc1", "layers/{i}/mlp/up", _D, mlp_width, reads=True), _plain),
    *_with(linear(f"{_E}.mlp.fc2", "layers/{i}/mlp/down", mlp_width, _D, writes=True), _plain),
    # the SwiGLU FFN as transformers writes it: weights_in holds [gate; up] rows, weights_out is down
    Tensor(f"{_E}.mlp.weights_in.weight", ("layers/{i}/mlp/gate/kernel", "layers/{i}/mlp/up/kernel"), ((_D, swiglu_width),) * 2, (0, 0),
           split_rows((swiglu_width, swiglu_width)), _swiglu),
    Tensor(f"{_E}.mlp.weights_in.bias", ("layers/{i}/mlp/gate/bias", "layers/{i}/mlp/up/bias"), ((swiglu_width,),) * 2, (None, None),
           split_rows((swiglu_width, swiglu_width)), _swiglu),
    *_with(linear(f"{_E}.mlp.weights_out", "layers/{i}/mlp/down", swiglu_width, _D, writes=True), _swiglu),
    *weight(f"{_E}.layer_scale2.lambda1", "layers/{i}/mlp_scale/scale", (_D,), stream=0),
)
_EMBEDDINGS = (
    *VIT.embeddings,
    *weight("embeddings.mask_token", "embeddings/mask_token", (1, _D), stream=1, when=lambda c: c.use_mask_token),
)


def _split_classifier(a: np.ndarray, config):
    d = config.hidden_size
    return a[:, :d].T, a[:, d:].T


def _fuse_classifier(t, config) -> np.ndarray:
    return np.concatenate([t[0].T, t[1].T], axis=1)


CLASSIFIER = Convert("dinov2_classifier", _split_classifier, _fuse_classifier)
_HEADS = (
    Head("image_classification", "ForImageClassification",
         (Tensor("classifier.weight", ("head/classifier/kernel", "head/classifier/mean_kernel"), ((_D, "num_labels"),) * 2, (0, 0), CLASSIFIER),
          *weight("classifier.bias", "head/classifier/bias", ("num_labels",))),
         markers=("classifier.weight",), forward=True),
)
_LAYER_SCALES = (r"layers/(?P<layer>\d+)/(?:attention|mlp)_scale/scale", None)
_WHY = ("a layer scale (lambda1) multiplies each channel a sublayer writes: only permutations of the channels commute with it "
        "(a rotation would need R^T diag(lambda) R diagonal)")


@dataclasses.dataclass(frozen=True)
class DinoV2Family(Family):
    """DINOv2's record: its stream takes permutations only (the layer scales)."""

    def residual_spec(self, config=None, layout=None):
        return dataclasses.replace(super().residual_spec(config, layout), permutations_only=_WHY)


NUMBER = Kind("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))

SCHEMA = ConfigSchema("dinov2", "Dinov2Config", {
    "hidden_size": (INT, 768), "num_hidden_layers": (INT, 12), "num_attention_heads": (INT, 12), "mlp_ratio": (NUMBER, 4),
    "hidden_act": (STR, "gelu"), "initializer_range": (FLOAT, 0.02), "layer_norm_eps": (FLOAT, 1e-6), "image_size": (SIZE, 224),
    "patch_size": (SIZE, 14), "num_channels": (INT, 3), "qkv_bias": (BOOL, True), "layerscale_value": (FLOAT, 1.0),
    "use_swiglu_ffn": (BOOL, False), "use_mask_token": (BOOL, True),
})

DINOV2 = DinoV2Family(
    name="dinov2",
    configs=(SCHEMA,),
    stems={"dinov2": "Dinov2"},
    prefix="dinov2.",
    marker="embeddings.cls_token",
    embeddings=_EMBEDDINGS,
    layer=_LAYER,
    final=norm("layernorm", "final_norm"),
    heads=_HEADS,
    # the norms before each sublayer fold into their readers; the final one stays (the stream is permuted only)
    norm=Norm("layernorm", placement="pre", folds=(*pre_norm_folds("(up|gate)", NO_READER)[:2], (r"final_norm/scale", NO_READER))),
    build=lambda config, layout, dtype, rngs: rj.nets.dinov2.Dinov2(config, layout, dtype, rngs=rngs),
    input="pixel_values",
    rules=(_LAYER_SCALES,),
)


# dinov2_with_registers: DINOv2 with register tokens (1, R, d) after the CLS token, and always a mask token
REGISTERS_SCHEMA = ConfigSchema("dinov2_with_registers", "Dinov2WithRegistersConfig", {
    **{k: v for k, v in SCHEMA.fields.items() if k != "use_mask_token"}, "patch_size": (SIZE, 16), "num_register_tokens": (INT, 4),
})
DINOV2_WITH_REGISTERS = dataclasses.replace(
    DINOV2,
    name="dinov2_with_registers",
    configs=(REGISTERS_SCHEMA,),
    stems={"dinov2_with_registers": "Dinov2WithRegisters"},
    prefix="dinov2_with_registers.",
    embeddings=(*VIT.embeddings, *weight("embeddings.mask_token", "embeddings/mask_token", (1, _D), stream=1),
                *weight("embeddings.register_tokens", "embeddings/register_tokens", (1, "num_register_tokens", _D), stream=2)),
)
