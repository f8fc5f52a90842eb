"""SigLIP's towers, each a family of its own (model types siglip_vision_model: SiglipVisionModel;
siglip_text_model: SiglipTextModel), CLIP's layers (`clip.LAYER`) under CLIP's names.

The image tower: a patch convolution with a bias and learned positions (no class token, no norm
before the first layer), pre-LayerNorm layers, `post_layernorm` over every token (the last hidden
state), and, with vision_use_head, the multihead-attention pooling head (`head.*`: the pooled
output): a learned probe is the one query, the normed states the keys and values
(`head.attention`, torch's nn.MultiheadAttention, its q/k/v fused in `in_proj_weight`), then
`head.layernorm` and `head.mlp` in a residual block of the head's own. That attention is an
attention site of its own: its heads permute and rotate as any layer's (block "pool", one
instance outside the layers), and its MLP's units permute ("pool_ffn"). The stream rotates (no
norm reads the embeddings; rotations fixing the ones vector): `post_layernorm` folds into the
head's keys and values, and the probe, the query's input, moves with the stream.

The text tower: CLIP's text tower without the causal mask (padding masked), the pooled state the
last token's (padding or not, as transformers takes it) through `head` (a Linear with a bias, to
`projection_size`, the hidden size unless given). Leaves:
    embeddings/patch/{kernel (C p p, d), bias}, embeddings/position (N, d)      image tower
    embeddings/word/embedding, embeddings/position                           text tower
    layers/{i}/...                           CLIP's
    final_norm/{scale,bias}                  post_layernorm, final_layer_norm
    pooler/probe (1, 1, d)                   head.probe
    pooler/layers/0/attention/{query,key,value,out}, pooler/layers/0/mlp_norm, pooler/layers/0/mlp/{up,down}
                                             head.attention (in_proj split), head.layernorm, head.mlp: a stack of one
                                             layer, so that the streamed passes, which go by integer layers, take it
    pooler/dense (d, projection_size)        the text tower's head

The dual model (model type siglip: SiglipModel) holds both towers as CLIPModel does (`clip.DualFamily`:
each tower's tables and groups under `text/` and `vision/`, the pooling head's "vision_pool" and
"vision_pool_ffn"), and `logit_scale`, `logit_bias` (1,). It has no projections: the joint space
is the text head's output and the image tower's pooling head's own space (its attention's output,
its MLP block's norm, reads and writes), of the vision width. The pooled states are normalised
before their cosine similarities, and the pooling head's MLP reads its space through a LayerNorm:
so the joint space is a pre-norm LayerNorm stream (the head's norm folded into its MLP), its group
the rotations fixing the ones vector, permutations among them (MATH §10).
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from ..spec import ResidualSpec, Spec
from .bart import site_rules
from .clip import LAYER, PATCH, TEXT_EMBEDDINGS, DualFamily, dual_schema, ffn_rules, tower_tables
from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import Family, Norm, Tensor, linear, norm, pre_norm_folds, split_rows, weight


def _positions(config) -> int:
    return (config.image_size // config.patch_size) ** 2


def _patch_in(config) -> int:
    return config.num_channels * config.patch_size**2


_D3 = ("hidden_size",) * 3
_EMBEDDINGS = (
    Tensor("embeddings.patch_embedding.weight", ("embeddings/patch/kernel",), ((_patch_in, "hidden_size"),), (1,), PATCH),
    *weight("embeddings.patch_embedding.bias", "embeddings/patch/bias", ("hidden_size",), stream=0),
    *weight("embeddings.position_embedding.weight", "embeddings/position", (_positions, "hidden_size"), stream=1),
)
_POOL = "pooler/layers/0"  # the head's one attention block, as a stack of one layer (the streamed passes go by integer layers)
_QKV = tuple(f"{_POOL}/attention/{leaf}" for leaf in ("query", "key", "value"))
# The pooling head: the probe and the q/k/v kernels read the stream (the probe as the query's input, the keys and values
# post_layernorm's output); what the attention writes is the head's own space, not the stream.
_POOLER = (
    *weight("head.probe", "pooler/probe", (1, 1, "hidden_size"), stream=2),
    Tensor("head.attention.in_proj_weight", tuple(f"{p}/kernel" for p in _QKV), (("hidden_size", "hidden_size"),) * 3, (0, 0, 0),
           split_rows(_D3)),
    Tensor("head.attention.in_proj_bias", tuple(f"{p}/bias" for p in _QKV), (("hidden_size",),) * 3, (None,) * 3, split_rows(_D3)),
    *linear("head.attention.out_proj", f"{_POOL}/attention/out", "hidden_size", "hidden_size"),
    *norm("head.layernorm", f"{_POOL}/mlp_norm", stream=False),
    *linear("head.mlp.fc1", f"{_POOL}/mlp/up", "hidden_size", "intermediate_size"),
    *linear("head.mlp.fc2", f"{_POOL}/mlp/down", "intermediate_size", "hidden_size"),
)
def pool_rules(at: str, block: str) -> tuple:
    """The pooling head's rules under `at` (its one layer captured): its attention (block `block`), its MLP's units
    (`<block>_ffn`), the rest untouched."""
    return (*site_rules(at, "attention", block), *ffn_rules(rf"{at}/layers/(?P<layer>\d+)", f"{block}_ffn"),
            (rf"{at}/layers/(?P<layer>\d+)/(?:attention/out/bias|mlp_norm/.*|mlp/down/bias)", None), (rf"{at}/probe", None))


POOL_RULES = pool_rules("pooler", "pool")


def _derive_vision(values: dict, raw) -> None:
    """SiglipVisionConfig: square images of whole patches."""
    if values["image_size"] % values["patch_size"]:
        raise InputError(f"image_size={values['image_size']} is not a multiple of patch_size={values['patch_size']}")


def _derive_text(values: dict, raw) -> None:
    """SiglipTextConfig: projection_size is the hidden size unless given."""
    if values["projection_size"] is None:
        values["projection_size"] = values["hidden_size"]


VISION_SCHEMA = ConfigSchema("siglip_vision_model", "SiglipVisionConfig", {
    "hidden_size": (INT, 768), "intermediate_size": (INT, 3072), "num_hidden_layers": (INT, 12), "num_attention_heads": (INT, 12),
    "num_channels": (INT, 3), "image_size": (INT, 224), "patch_size": (INT, 16), "hidden_act": (STR, "gelu_pytorch_tanh"),
    "layer_norm_eps": (FLOAT, 1e-6), "vision_use_head": (BOOL, True),
}, derive=_derive_vision)

TEXT_SCHEMA = ConfigSchema("siglip_text_model", "SiglipTextConfig", {
    "vocab_size": (INT, 32000), "hidden_size": (INT, 768), "intermediate_size": (INT, 3072), "num_hidden_layers": (INT, 12),
    "num_attention_heads": (INT, 12), "max_position_embeddings": (INT, 64), "hidden_act": (STR, "gelu_pytorch_tanh"),
    "layer_norm_eps": (FLOAT, 1e-6), "pad_token_id": (INT.optional(), 1), "bos_token_id": (INT.optional(), 49406),
    "projection_size": (INT.optional(), None),
}, derive=_derive_text)


@dataclasses.dataclass(frozen=True)
class PooledFamily(Family):
    """A family whose pooler is an attention of its own (SigLIP's image tower): its block "pool"
    has the layers' head geometry."""

    def check_layout(self, config, layout) -> None:
        super().check_layout(config, layout)
        if layout.pooler != config.vision_use_head:  # transformers would build (or drop) a head the weights do not hold
            held = "holds" if layout.pooler else "does not hold"
            raise InputError(f"vision_use_head={config.vision_use_head}, but the checkpoint {held} the pooling head ({layout.prefix}head.probe, "
                             "head.attention, head.layernorm, head.mlp): the config does not describe these weights")

    def spec(self, config, layout=None) -> Spec:
        spec = super().spec(config, layout)
        return dataclasses.replace(spec, heads={**spec.heads, "pool": spec.heads["attn"]})


SIGLIP_VISION = PooledFamily(
    name="siglip_vision",
    configs=(VISION_SCHEMA,),
    stems={"siglip_vision_model": "SiglipVision"},
    prefix="vision_model.",
    marker="embeddings.patch_embedding.weight",
    embeddings=_EMBEDDINGS,
    layer=LAYER,
    final=norm("post_layernorm", "final_norm"),
    pooler=_POOLER,
    # each norm before a sublayer folds into its readers, post_layernorm into the pooling head's keys and values
    norm=Norm("layernorm", placement="pre", folds=pre_norm_folds("up", r"pooler/layers/0/attention/(key|value)")),
    build=lambda config, layout, dtype, rngs: rj.nets.siglip.VisionTower(config, layout, dtype, rngs=rngs),
    input="pixel_values",
    rules=POOL_RULES,
)


SIGLIP_TEXT = Family(
    name="siglip_text",
    configs=(TEXT_SCHEMA,),
    stems={"siglip_text_model": "SiglipText"},
    prefix="text_model.",
    marker="embeddings.token_embedding.weight",
    embeddings=TEXT_EMBEDDINGS,
    layer=LAYER,
    final=(*norm("final_layer_norm", "final_norm"), *linear("head", "pooler/dense", "hidden_size", "projection_size", reads=True)),
    norm=Norm("layernorm", placement="pre", folds=pre_norm_folds("up", r"pooler/dense")),
    build=lambda config, layout, dtype, rngs: rj.nets.siglip.TextTower(config, layout, dtype, rngs=rngs),
)


# ---- the dual model (SiglipModel) ------------------------------------------------------------------------------

def image_tower_rules(at: str) -> tuple:
    """The image tower's groups with its leaves under `at/` (the dual model's, a vision–language model's tower): its
    attention (block `at`), its MLP's units (`<at>_ffn`), its pooling head's (`<at>_pool`, `<at>_pool_ffn`)."""
    return (*site_rules(at, "attention", at), *ffn_rules(rf"{at}/layers/(?P<layer>\d+)", f"{at}_ffn"), *pool_rules(f"{at}/pooler", f"{at}_pool"))


DUAL_RULES = (
    *site_rules("text", "attention", "text"), *ffn_rules(r"text/layers/(?P<layer>\d+)", "text_ffn"),
    *image_tower_rules("vision"),
    (r"(?:text|vision)/layers/(?P<layer>\d+)/(?:(?:attention|mlp)_norm/.*|attention/out/bias|mlp/down/bias)", None),
    (r"(?:text|vision)/(?:embeddings/.*|final_norm/.*)|text/pooler/dense/.*|logit_scale|logit_bias", None),
)
_AT_POOL = "vision/pooler/layers/0"
# The joint space: the text head's output, and what the image tower's pooling head writes and its MLP block reads.
JOINT = ResidualSpec((
    (r"text/pooler/dense/kernel", 1), (r"text/pooler/dense/bias", 0),
    (rf"{_AT_POOL}/attention/out/kernel", 1), (rf"{_AT_POOL}/attention/out/bias", 0), (rf"{_AT_POOL}/mlp_norm/(scale|bias)", 0),
    (rf"{_AT_POOL}/mlp/up/kernel", 0), (rf"{_AT_POOL}/mlp/down/kernel", 1), (rf"{_AT_POOL}/mlp/down/bias", 0), (r".*", None),
), "layernorm", folds=((rf"{_AT_POOL}/mlp_norm/scale", rf"{_AT_POOL}/mlp/up/kernel"),), placement="pre")


def _check_joint(config) -> None:
    """SiglipModel: the text head's width is the image tower's (their embeddings meet in one space), which pools with its head."""
    text, vision = config.text_config, config.vision_config
    if text.projection_size != vision.hidden_size:
        raise InputError(f"text_config.projection_size={text.projection_size} and vision_config.hidden_size={vision.hidden_size}: "
                         "SiglipModel compares the text head's output with the image tower's pooled state, which need one width")
    if not vision.vision_use_head:
        raise InputError("vision_config.vision_use_head=false: SiglipModel reads the image tower's pooled state, which its head gives")


SIGLIP = DualFamily(
    name="siglip",
    configs=(dual_schema("siglip", "SiglipConfig", TEXT_SCHEMA, VISION_SCHEMA, {}, legacy=False),),
    stems={"siglip": "Siglip"},
    prefix="",
    marker="text_model.embeddings.token_embedding.weight",
    embeddings=(*tower_tables(TEXT_EMBEDDINGS, "text"), *tower_tables(_EMBEDDINGS, "vision")),
    layer=(),
    towers=(("text_config", tower_tables(LAYER, "text")), ("vision_config", tower_tables(LAYER, "vision"))),
    final=(*tower_tables(SIGLIP_TEXT.final, "text"), *tower_tables(SIGLIP_VISION.final + _POOLER, "vision"),
           *weight("logit_scale", "logit_scale", (1,)), *weight("logit_bias", "logit_bias", (1,))),
    num_layers="",
    blocks=(("text", "text_config"), ("vision", "vision_config"), ("vision_pool", "vision_config")),
    joint=JOINT,
    check_joint=_check_joint,
    # each tower's own stream, as its family's; the pooling head's attention output and MLP block are the joint space's
    tower_streams=(("text", SIGLIP_TEXT, None), ("vision", SIGLIP_VISION, rf"{_AT_POOL}/(?:attention/out/.*|mlp_norm/.*|mlp/.*)")),
    norm=Norm("layernorm", placement="pre"),
    build=lambda config, layout, dtype, rngs: rj.nets.siglip.Dual(config, layout, dtype, rngs=rngs),
    rules=DUAL_RULES,
)
