"""CLIP's towers, each a family of its own: the image tower (model type clip_vision_model:
CLIPVisionModel, CLIPVisionModelWithProjection), the encoder the task-arithmetic literature merges,
and the text tower (clip_text_model: CLIPTextModel, CLIPTextModelWithProjection).

The image tower: ViT's pre-LayerNorm layers behind a patch
convolution without a bias, a class embedding and learned positions, the embeddings passed through
a LayerNorm (`pre_layrnorm`) before the first layer, and the class token's final state through
`post_layernorm` (the pooled output), which `visual_projection` maps into the joint image-text
space (the image embeddings).

The groups: per-head Q/K and V/O (rotations, scales, head permutations), the MLP's units, and
the stream's permutations; the stream does not rotate, as mBART's: `pre_layrnorm`'s output is
the stream itself, so its gains stay on it. The projection is a head (`head/projection`), set
aside by the command line like every head and moved by the stream's permutation.

Leaves (d = hidden_size, f = intermediate_size, H = heads, C = num_channels, p = patch_size,
N = (image_size / p)^2 patches):
    embeddings/patch/kernel (C p p, d)     embeddings.patch_embedding (Conv2d without a bias)
    embeddings/class (d,), embeddings/position (N + 1, d)
    embeddings/norm/{scale,bias} (d,)      pre_layrnorm
    layers/{i}/attention_norm, attention/{query,key,value,out}, mlp_norm, mlp/{up,down}
                                           encoder.layers.{i}.{layer_norm1, self_attn, layer_norm2, mlp}
    final_norm/{scale,bias} (d,)           post_layernorm (the class token's state only)
    head/projection/kernel (d, projection_dim)   visual_projection (WithProjection), no bias

The text tower: the same pre-LayerNorm layers over token and position embeddings, causal attention
(padding masked), `final_layer_norm` over every token, the pooled state the first eos token's (the
largest token id's where eos_token_id is 2, as transformers reads older configs), and
`text_projection` into the joint space. No norm reads the embeddings, so the stream also rotates
(rotations fixing the ones vector, the gains folded, as GPT-2's). Leaves:
    embeddings/word/embedding (vocab_size, d), embeddings/position (max_position_embeddings, d)
    layers/{i}/...                         as the image tower's
    final_norm/{scale,bias} (d,)           final_layer_norm
    head/projection/kernel (d, projection_dim)   text_projection (WithProjection), no bias
A CLIPModel checkpoint (both towers, model type clip) is not read: its config nests the towers'.
"""

from __future__ import annotations

import rotsym_jax as rj

from ..errors import InputError
from .config import FLOAT, INT, STR, ConfigSchema
from .family import NO_READER, Convert, Family, Head, Norm, Tensor, linear, norm, pre_norm_folds, weight


def _patch_in(config) -> int:
    return config.num_channels * config.patch_size**2


def _positions(config) -> int:
    return (config.image_size // config.patch_size) ** 2 + 1


# Conv2d weight (d, C, p, p) <-> a dense kernel (C p p, d), rows in (c, i, j) order
_PATCH = Convert("patch", lambda a, c: (a.reshape(a.shape[0], -1).T,),
                 lambda t, c: t[0].T.reshape(c.hidden_size, c.num_channels, c.patch_size, c.patch_size))

_E = "encoder.layers.{i}"
_LAYER = (
    *norm(f"{_E}.layer_norm1", "layers/{i}/attention_norm"),
    *(t for proj, leaf in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"))
      for t in linear(f"{_E}.self_attn.{proj}", f"layers/{{i}}/attention/{leaf}", "hidden_size", "hidden_size", reads=True)),
    *linear(f"{_E}.self_attn.out_proj", "layers/{i}/attention/out", "hidden_size", "hidden_size", writes=True),
    *norm(f"{_E}.layer_norm2", "layers/{i}/mlp_norm"),
    *linear(f"{_E}.mlp.fc1", "layers/{i}/mlp/up", "hidden_size", "intermediate_size", reads=True),
    *linear(f"{_E}.mlp.fc2", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", writes=True),
)
_EMBEDDINGS = (
    Tensor("embeddings.patch_embedding.weight", ("embeddings/patch/kernel",), ((_patch_in, "hidden_size"),), (1,), _PATCH),
    *weight("embeddings.class_embedding", "embeddings/class", ("hidden_size",), stream=0),
    *weight("embeddings.position_embedding.weight", "embeddings/position", (_positions, "hidden_size"), stream=1),
    *norm("pre_layrnorm", "embeddings/norm"),
)
_HEADS = (
    Head("image_embeds", "ModelWithProjection", linear("visual_projection", "head/projection", "hidden_size", "projection_dim", bias=False,
                                                       reads=True),
         markers=("visual_projection.weight",), forward=True, loss=False),
)

# Each norm before a sublayer folds into its readers, post_layernorm into the projection; pre_layrnorm's
# output is the stream itself: its gain has no reader.
_FOLDS = (*pre_norm_folds("up", r"head/projection"), (r"embeddings/norm/scale", NO_READER))


def _derive(values: dict, raw) -> None:
    """CLIPVisionConfig: square images of whole patches."""
    if values["image_size"] % values["patch_size"]:
        raise InputError(f"image_size={values['image_size']} is not a multiple of patch_size={values['patch_size']}")


SCHEMA = ConfigSchema("clip_vision_model", "CLIPVisionConfig", {
    "hidden_size": (INT, 768), "intermediate_size": (INT, 3072), "projection_dim": (INT, 512), "num_hidden_layers": (INT, 12),
    "num_attention_heads": (INT, 12), "num_channels": (INT, 3), "image_size": (INT, 224), "patch_size": (INT, 32),
    "hidden_act": (STR, "quick_gelu"), "layer_norm_eps": (FLOAT, 1e-5), "initializer_range": (FLOAT, 0.02),
}, derive=_derive)


_TEXT_EMBEDDINGS = (
    *weight("embeddings.token_embedding.weight", "embeddings/word/embedding", ("vocab_size", "hidden_size"), stream=1),
    *weight("embeddings.position_embedding.weight", "embeddings/position", ("max_position_embeddings", "hidden_size"), stream=1),
)
_TEXT_HEADS = (
    Head("text_embeds", "ModelWithProjection", linear("text_projection", "head/projection", "hidden_size", "projection_dim", bias=False,
                                                      reads=True),
         markers=("text_projection.weight",), forward=True, loss=False),
)

TEXT_SCHEMA = ConfigSchema("clip_text_model", "CLIPTextConfig", {
    "vocab_size": (INT, 49408), "hidden_size": (INT, 512), "intermediate_size": (INT, 2048), "projection_dim": (INT, 512),
    "num_hidden_layers": (INT, 12), "num_attention_heads": (INT, 8), "max_position_embeddings": (INT, 77), "hidden_act": (STR, "quick_gelu"),
    "layer_norm_eps": (FLOAT, 1e-5), "initializer_range": (FLOAT, 0.02), "pad_token_id": (INT.optional(), 1),
    "bos_token_id": (INT.optional(), 49406), "eos_token_id": (INT.optional(), 49407),
})


CLIP_VISION = Family(
    name="clip_vision",
    configs=(SCHEMA,),
    stems={"clip_vision_model": "CLIPVision"},
    prefix="vision_model.",
    marker="embeddings.class_embedding",
    embeddings=_EMBEDDINGS,
    layer=_LAYER,
    final=norm("post_layernorm", "final_norm"),
    heads=_HEADS,
    norm=Norm("layernorm", placement="pre", folds=_FOLDS),
    build=lambda config, layout, dtype, rngs: rj.nets.clip.VisionTower(config, layout, dtype, rngs=rngs),
    input="pixel_values",
)


CLIP_TEXT = Family(
    name="clip_text",
    configs=(TEXT_SCHEMA,),
    stems={"clip_text_model": "CLIPText"},
    prefix="text_model.",
    marker="embeddings.token_embedding.weight",
    embeddings=_TEXT_EMBEDDINGS,
    layer=_LAYER,
    final=norm("final_layer_norm", "final_norm"),
    heads=_TEXT_HEADS,
    norm=Norm("layernorm", placement="pre", folds=pre_norm_folds("up", r"head/projection")),
    build=lambda config, layout, dtype, rngs: rj.nets.clip.TextTower(config, layout, dtype, rngs=rngs),
)
