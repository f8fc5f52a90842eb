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

The dual model (model type clip: CLIPModel) holds both towers side by side, each tower's tables and
groups as its own family has them under `text/` and `vision/` (its config nests theirs:
text_config, vision_config), both projections into one joint space of `projection_dim` (the
CLIPConfig's, not the towers'), and `logit_scale`:
    text/..., vision/...                   text_model..., vision_model... (the towers' leaves above, but the projection)
    text/projection/kernel (d_text, p), vision/projection/kernel (d_vision, p)
                                           text_projection, visual_projection
    logit_scale ()
Its groups: each tower's attention ("text", "vision") and FFN units ("text_ffn", "vision_ffn").
Its "residual stream" is the joint space (MATH §10, a dual encoder's joint space): both projections' outputs, which CLIPModel
normalises before their cosine similarities (an RMSNorm without a gain), so any orthogonal map of
it applied to both keeps logits_per_image. Each tower's own stream is a stream of the dual model
too ("text_residual", "vision_residual", as its tower family declares it; `tower_stream`), each
projection's rows moving with its tower's and its columns with the joint space.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from ..spec import ResidualSpec, Spec
from .bart import site_rules
from .config import FLOAT, INT, STR, ConfigSchema, ModelConfig
from .family import NO_READER, OPTIONAL, TRANSPOSE, Convert, Family, Head, Layout, Norm, Tensor, linear, multi_head_geometry, norm, pre_norm_folds, size, weight


def _patch_in(config) -> int:
    return config.num_channels * config.patch_size**2


def _positions(config) -> int:
    return (config.image_size // config.patch_size) ** 2 + 1


# Conv2d weight (d, C, p, p) <-> a dense kernel (C p p, d), rows in (c, i, j) order
PATCH = Convert("patch", lambda a, c: (a.reshape(a.shape[0], -1).T,),
                 lambda t, c: t[0].T.reshape(c.hidden_size, c.num_channels, c.patch_size, c.patch_size))

_E = "encoder.layers.{i}"
LAYER = (
    *norm(f"{_E}.layer_norm1", "layers/{i}/attention_norm"),
    *(t for proj, leaf in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"))
      for t in linear(f"{_E}.self_attn.{proj}", f"layers/{{i}}/attention/{leaf}", "hidden_size", "hidden_size", reads=True)),
    *linear(f"{_E}.self_attn.out_proj", "layers/{i}/attention/out", "hidden_size", "hidden_size", writes=True),
    *norm(f"{_E}.layer_norm2", "layers/{i}/mlp_norm"),
    *linear(f"{_E}.mlp.fc1", "layers/{i}/mlp/up", "hidden_size", "intermediate_size", reads=True),
    *linear(f"{_E}.mlp.fc2", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", writes=True),
)
_EMBEDDINGS = (
    Tensor("embeddings.patch_embedding.weight", ("embeddings/patch/kernel",), ((_patch_in, "hidden_size"),), (1,), PATCH),
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


TEXT_EMBEDDINGS = (
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
    layer=LAYER,
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
    embeddings=TEXT_EMBEDDINGS,
    layer=LAYER,
    final=norm("final_layer_norm", "final_norm"),
    heads=_TEXT_HEADS,
    norm=Norm("layernorm", placement="pre", folds=pre_norm_folds("up", r"head/projection")),
    build=lambda config, layout, dtype, rngs: rj.nets.clip.TextTower(config, layout, dtype, rngs=rngs),
)


# ---- the dual model (CLIPModel): both towers, their projections into one joint space ----------------------

def within(t: Tensor, hf: str, ours: str, tower: str) -> Tensor:
    """A tower's tensor inside the dual model: its names under `hf` and `ours`, its sizes and
    layout read from the nested config `tower` (text_config, vision_config); off the joint space."""
    def sub(d):
        return d if isinstance(d, int) else (lambda c: size(getattr(c, tower), d))

    convert = Convert(t.convert.name, lambda a, c: t.convert.to_ours(a, getattr(c, tower)), lambda x, c: t.convert.to_hf(x, getattr(c, tower)))
    return dataclasses.replace(t, hf=hf + t.hf, ours=tuple(ours + p for p in t.ours), shapes=tuple(tuple(sub(d) for d in s) for s in t.shapes),
                               stream=(None,) * len(t.ours), convert=convert, when=None if t.when is None else lambda c: t.when(getattr(c, tower)))


def tower_tables(tensors, name: str) -> tuple[Tensor, ...]:
    """A tower's tables inside a dual model: under `<name>_model.` and `<name>/`, sized from `<name>_config`."""
    return tuple(within(t, f"{name}_model.", f"{name}/", f"{name}_config") for t in tensors)


def _projection(hf: str, tower: str) -> Tensor:
    # on the joint space (axis 1): the dual model's only "stream"
    return Tensor(f"{hf}.weight", (f"{tower}/projection/kernel",), ((lambda c: getattr(c, f"{tower}_config").hidden_size, "projection_dim"),),
                  (1,), TRANSPOSE)


def dual_schema(model_type: str, class_name: str, text: ConfigSchema, vision: ConfigSchema, fields: dict, *, legacy: bool) -> ConfigSchema:
    """A dual model's config: each tower's config (text_config, vision_config) read with its own schema (its defaults, its
    checks); `legacy`: a `<tower>_config_dict` replaces the tower's config (CLIPConfig updates it with every key of that
    dict's full config)."""
    def derive(values: dict, raw) -> None:
        for key, schema in (("text_config", text), ("vision_config", vision)):
            given = raw.get(f"{key}_dict") if legacy and raw.get(f"{key}_dict") is not None else raw.get(key)
            if given is None:
                given = {}
            if not isinstance(given, dict):
                raise InputError(f"'{key}' is {given!r}; expected a JSON object (the {schema.class_name})")
            values[key] = ModelConfig(given, schema)

    legacy_keys = ("text_config_dict", "vision_config_dict") if legacy else ()
    return ConfigSchema(model_type, class_name, fields, derive=derive, consumed=("text_config", "vision_config", *legacy_keys))


DUAL_SCHEMA = dual_schema("clip", "CLIPConfig", TEXT_SCHEMA, SCHEMA, {"projection_dim": (INT, 512)}, legacy=True)

TOWERS = ("text", "vision")


def ffn_rules(at: str, group: str) -> tuple:
    """The FFN units' rules of the MLPs under `at` (a regex capturing the layer), group `group`."""
    return ((rf"{at}/mlp/up/kernel", (None, group)), (rf"{at}/mlp/up/bias", (group,)), (rf"{at}/mlp/down/kernel", (group, None)))


DUAL_RULES = (
    *(r for tower in TOWERS for r in (*site_rules(tower, "attention", tower), *ffn_rules(rf"{tower}/layers/(?P<layer>\d+)", f"{tower}_ffn"))),
    (r"(?:text|vision)/layers/(?P<layer>\d+)/(?:(?:attention|mlp)_norm/.*|attention/out/bias|mlp/down/bias)", None),
    (r"(?:text|vision)/(?:embeddings/.*|final_norm/.*|projection/kernel)|logit_scale", None),  # no layer: nothing captured
)


@dataclasses.dataclass(frozen=True)
class DualFamily(Family):
    """Two towers side by side in one checkpoint (CLIPModel): `towers` pairs each tower's nested
    config attribute with its layer tensors (named inside the dual model); `embeddings` and
    `final` hold both towers' others, the projections and the scale. `blocks`: each attention
    block's name and the tower config whose heads it has; `joint`: the joint space (the stream
    named `RESIDUAL`); `check_joint(config)`: what the towers' configs must agree on;
    `tower_streams`: (tower, its family, a regex of its leaves on the joint space instead) whose
    own stream is a stream of the dual model too (`<tower>_residual`, read from the family's
    record: its projection, the head there, reads it)."""

    towers: tuple[tuple[str, tuple[Tensor, ...]], ...] = ()
    blocks: tuple[tuple[str, str], ...] = (("text", "text_config"), ("vision", "vision_config"))
    joint: ResidualSpec | None = None
    check_joint: Callable[[Any], None] = lambda config: None
    tower_streams: tuple[tuple[str, Family, str | None], ...] = ()

    def example_inputs(self, config, rng) -> dict:
        """Texts and images for both towers (`rotsym inspect --verify`): each text's last token its
        eos, which the text tower pools."""
        text, vision = config.text_config, config.vision_config
        ids = rng.integers(0, text.vocab_size, size=(2, min(8, text.max_position_embeddings)))
        eos = getattr(text, "eos_token_id", None)
        if isinstance(eos, int) and 0 <= eos < text.vocab_size:
            ids[:, -1] = eos
        return {"input_ids": ids, "attention_mask": np.ones_like(ids),
                "pixel_values": rng.normal(size=(3, vision.num_channels, vision.image_size, vision.image_size)).astype(np.float32)}

    def _tables(self, config, layout: Layout):
        for t in self.embeddings:
            yield t, None, True
        for tower, layer in self.towers:
            for i in range(getattr(config, tower).num_hidden_layers):
                for t in layer:
                    yield t, i, True
        for t in self.final:
            yield t, None, True

    def record_tensors(self) -> tuple[Tensor, ...]:
        return self.embeddings + tuple(t for _, layer in self.towers for t in layer) + self.final

    def check(self, config) -> None:
        for tower, _ in self.towers:
            sub = getattr(config, tower)
            if sub.hidden_size % sub.num_attention_heads:
                raise InputError(f"{tower}: hidden_size={sub.hidden_size} is not a multiple of num_attention_heads={sub.num_attention_heads}")
            for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
                if getattr(sub, key) < 1:
                    raise InputError(f"{tower}: {key}={getattr(sub, key)}; expected a positive integer")
        self.check_joint(config)

    def data_refusal(self) -> str | None:
        return ("two towers with streams of their own and a joint space; alignment and statistics from data do not run on it yet "
                "(align it from its weights)")

    def spec(self, config, layout: Layout | None = None) -> Spec:
        """Each tower's attention and FFN groups; the joint space as the stream."""
        heads = {block: multi_head_geometry(getattr(config, tower)) for block, tower in self.blocks}
        towers = tuple(tower_stream(family.residual_spec(getattr(config, f"{tower}_config")), tower, joint)
                       for tower, family, joint in self.tower_streams)
        return Spec(self.rules, heads=heads, residual=(self.joint, *towers) if towers else self.joint, optional=OPTIONAL)


def tower_stream(residual: ResidualSpec, tower: str, joint: str | None = None) -> ResidualSpec:
    """A tower family's stream inside the dual model: its rules and folds under `<tower>/` (its
    projection head's kernel as the dual model's `<tower>/projection`), every other leaf off it,
    and the leaves `joint` names too (on the joint space instead: SigLIP's pooling head's block)."""
    def rooted(pattern: str) -> str:
        return rf"{tower}/(?:{pattern.replace('head/projection', 'projection')})"

    rules = (((joint, None),) if joint else ()) + tuple((rooted(p), axis) for p, axis in residual.rules) + ((".*", None),)
    folds = tuple((rooted(gain), readers if readers == NO_READER else rooted(readers)) for gain, readers in residual.folds)
    return dataclasses.replace(residual, rules=rules, folds=folds, name=f"{tower}_residual")


def _check_projection(config) -> None:
    if config.projection_dim < 1:
        raise InputError(f"projection_dim={config.projection_dim}; expected a positive integer")


_DUAL_EMBEDDINGS = (*tower_tables(TEXT_EMBEDDINGS, "text"), *tower_tables(_EMBEDDINGS, "vision"))
_DUAL_FINAL = (
    *tower_tables(norm("final_layer_norm", "final_norm"), "text"), *tower_tables(norm("post_layernorm", "final_norm"), "vision"),
    _projection("text_projection", "text"), _projection("visual_projection", "vision"),
    Tensor("logit_scale", ("logit_scale",), ((),), (None,)),
)

CLIP = DualFamily(
    name="clip",
    configs=(DUAL_SCHEMA,),
    stems={"clip": "CLIP"},
    prefix="",
    marker="text_model.embeddings.token_embedding.weight",
    embeddings=_DUAL_EMBEDDINGS,
    layer=(),
    towers=(("text_config", tower_tables(LAYER, "text")), ("vision_config", tower_tables(LAYER, "vision"))),
    final=_DUAL_FINAL,
    num_layers="",
    # both projections' outputs, which CLIPModel normalises (an RMSNorm without a gain) before their cosine similarities:
    # any orthogonal map of the joint space keeps every logit
    joint=ResidualSpec(((r"(?:text|vision)/projection/kernel", 1), (r".*", None)), "rmsnorm", placement="pre"),
    check_joint=_check_projection,
    tower_streams=(("text", CLIP_TEXT, None), ("vision", CLIP_VISION, None)),
    # the towers' norms stay (the joint space has none to fold): nothing here rotates their streams
    norm=Norm("layernorm", placement="pre"),
    build=lambda config, layout, dtype, rngs: rj.nets.clip.Dual(config, layout, dtype, rngs=rngs),
    rules=DUAL_RULES,
)
