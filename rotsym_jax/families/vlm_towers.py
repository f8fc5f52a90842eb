"""The vision towers of vision–language models (`vlm.py`) whose groups are aligned: SigLIP's (Gemma 3,
read with SigLIP's own record, `siglip.SIGLIP_VISION`), Pixtral's (Mistral 3), Qwen2-VL's, Qwen2.5-VL's,
Qwen3-VL's and Llama 4's vision transformers. Each is a `Tower`: its tensors, named inside the tower, with
leaves under `vision/` in our naming (`vision/layers/{i}/attention/{query,key,value,out}`,
`vision/layers/{i}/mlp/{gate,up,down}`), and its groups: the attention block "vision" (per-head Q/K
and V/O maps, head permutations) and the MLP's units "vision_ffn" (gated: with each unit's scale).
The tower's own residual stream never moves (the engine moves one stream per model: the text
model's), so its norms, embeddings and biases after a sublayer are merged as they are.

Pixtral's and Qwen2-VL's vision blocks turn each head's rotary pairs (i, i + head_dim/2), the
rotate_half layout over the whole head, by an angle of the patch's row or column (a 2-D RoPE):
every element of a pair's 2-D rotations (and scaled rotations) commutes with any such turn, so
their QK group is the text models' RoPE group (`HeadGeometry.rotary_dim` the head's width).

Llama 4's vision model (Llama4VisionModel, `vision_apply_rotary_emb`) turns each head's interleaved
pairs (2k, 2k + 1) as complex numbers: pairs k < head_dim/4 by (column + 1) * theta_k, the others by
(row + 1) * theta_(k - head_dim/4), the class token by 0; one angle table for every head. A 2-D
rotation (or scaled rotation) M of a pair commutes with every turn R: q^T M^T R(a)^T R(b) M^-T k =
q^T R(b - a) k, as M^T R M^-T = R for M = s R'. A rotation mixing two pairs (different frequencies,
or column against row) does not, nor does a reflection of a pair (F^T R(a) F = R(-a)). Its q_proj
and k_proj are read reordered into the rotate_half order (`family.interleaved_projection`, as Llama
4's text model), so its QK group is Pixtral's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..spec import HeadGeometry, ResidualSpec
from .bart import site_rules
from .clip import ffn_rules, tower_stream
from .config import ModelConfig
from .family import NO_READER, Convert, Tensor, attention_projections, gated_mlp, interleaved_projection, linear, multi_head_geometry, norm, size, split_rows, weight
from .siglip import SIGLIP_VISION, image_tower_rules

_AT = r"vision/layers/(?P<layer>\d+)"


@dataclasses.dataclass(frozen=True)
class Tower:
    """A vision tower: `tables(v)` its tensors for the vision config `v` (names inside the tower,
    leaves under vision/, off the text model's stream), `rules` its groups' spec rules, `heads(v)`
    the geometry of each attention block they name."""

    tables: Callable[[ModelConfig], tuple[Tensor, ...]]
    rules: tuple = ()
    heads: Callable[[ModelConfig], dict[str, HeadGeometry]] = lambda v: {}
    # the tower's own residual stream for the vision config (its family's record under vision/), None: not moved
    stream: Callable[[ModelConfig], ResidualSpec] | None = None


def resolved(tensors, v: ModelConfig, i: int | None = None) -> tuple[Tensor, ...]:
    """A tower record's tensors (of layer `i`) as the vision–language model holds them: names with
    the layer filled, leaves under vision/, sizes and conversions read from the vision config `v`
    (the model's own config holds it nested), off the text model's stream."""
    def fill(s: str) -> str:
        return s if i is None else s.replace("{i}", str(i))

    def one(t: Tensor) -> Tensor:
        c = t.convert
        return Tensor(fill(t.hf), tuple(f"vision/{fill(p)}" for p in t.ours), tuple(tuple(size(v, d) for d in s) for s in t.shapes),
                      (None,) * len(t.ours), Convert(c.name, lambda a, _: c.to_ours(a, v), lambda x, _: c.to_hf(x, v)))
    return tuple(one(t) for t in tensors if t.present(v))


def _stack(v, embeddings, layer, final, layers: int) -> tuple[Tensor, ...]:
    return (*resolved(embeddings, v), *(t for i in range(layers) for t in resolved(layer, v, i)), *resolved(final, v))


def _gated_rules(group: str) -> tuple:
    """A gated MLP's units under vision/layers/{i}/mlp (biases or none): permuted, each scaled (act(gate) * up is linear in up)."""
    at = f"{_AT}/mlp"
    return ((rf"{at}/gate/kernel", (None, group)), (rf"{at}/gate/bias", (group,)), (rf"{at}/up/kernel", (None, f"{group}.in")),
            (rf"{at}/up/bias", (f"{group}.in",)), (rf"{at}/down/kernel", (f"{group}.out", None)))


def _rotary(heads: str, width: str) -> Callable[[ModelConfig], dict[str, HeadGeometry]]:
    """A block of `heads` heads over `width` whose rotary pairs span each head (2-D RoPE, rotate_half layout)."""
    def geometry(v):
        h = getattr(v, heads)
        dh = getattr(v, width) // h
        return {"vision": HeadGeometry(h, h, dh, rotary_dim=dh)}
    return geometry


# ---- SigLIP (Gemma 3): SigLIP's record, its pooling head (stored, never run by Gemma 3) with it ----------------

def _siglip(v) -> tuple[Tensor, ...]:
    pooler = SIGLIP_VISION.pooler if v.vision_use_head else ()
    return _stack(v, SIGLIP_VISION.embeddings, SIGLIP_VISION.layer, SIGLIP_VISION.final + pooler, v.num_hidden_layers)


def _siglip_stream(v) -> ResidualSpec:
    """SigLIP's image stream inside Gemma 3: its record's, but `post_layernorm` folds into nothing
    (Gemma 3 pools its output and norms it again: no linear reader; its pooling head is never run)."""
    spec = tower_stream(SIGLIP_VISION.residual_spec(v), "vision")
    return dataclasses.replace(spec, folds=tuple((g, NO_READER if "final_norm" in g else r) for g, r in spec.folds))


SIGLIP_TOWER = Tower(_siglip, image_tower_rules("vision"),
                     lambda v: {"vision": multi_head_geometry(v), "vision_pool": multi_head_geometry(v)}, _siglip_stream)


# ---- Pixtral (Mistral 3): RMSNorms, q/k/v/o without biases, 2-D RoPE, a gated SiLU MLP -------------------------

_P = "transformer.layers.{i}"
_PIXTRAL_LAYER = (
    *norm(f"{_P}.attention_norm", "layers/{i}/attention_norm", bias=False),
    *attention_projections(f"{_P}.attention", "layers/{i}/attention", "hidden_size", "hidden_size"),
    *norm(f"{_P}.ffn_norm", "layers/{i}/mlp_norm", bias=False),
    *gated_mlp(f"{_P}.feed_forward", "layers/{i}/mlp"),
)


def _pixtral(v) -> tuple[Tensor, ...]:
    ph, pw = (v.patch_size, v.patch_size) if isinstance(v.patch_size, int) else v.patch_size
    embeddings = (*weight("patch_conv.weight", "embeddings/patch/kernel", ("hidden_size", "num_channels", ph, pw)),
                  *norm("ln_pre", "embeddings/norm", bias=False))
    return _stack(v, embeddings, _PIXTRAL_LAYER, (), v.num_hidden_layers)


PIXTRAL_TOWER = Tower(_pixtral, (*site_rules("vision", "attention", "vision"), *_gated_rules("vision_ffn")),
                      _rotary("num_attention_heads", "hidden_size"))


# ---- Qwen2-VL and Qwen2.5-VL: a fused qkv with biases, 2-D RoPE; Qwen2-VL LayerNorms and a GELU MLP, 2.5 RMSNorms and
# a gated SiLU MLP with biases ----------------------------------------------------------------------------------

def _units(v) -> int:
    return v.embed_dim * v.mlp_ratio if hasattr(v, "mlp_ratio") else v.intermediate_size


def _qwen_layer(e, gated: bool, names: tuple[str, str]) -> tuple[Tensor, ...]:
    """A Qwen vision block of width `e` (a `Dim`); a GELU MLP's maps named `names`."""
    b, qkv = "blocks.{i}", tuple(f"layers/{{i}}/attention/{leaf}" for leaf in ("query", "key", "value"))
    mlp = (gated_mlp(f"{b}.mlp", "layers/{i}/mlp", bias=True, d=e) if gated else
           (*linear(f"{b}.mlp.{names[0]}", "layers/{i}/mlp/up", e, _units), *linear(f"{b}.mlp.{names[1]}", "layers/{i}/mlp/down", _units, e)))
    return (
        *norm(f"{b}.norm1", "layers/{i}/attention_norm", e, bias=not gated),
        Tensor(f"{b}.attn.qkv.weight", tuple(f"{p}/kernel" for p in qkv), ((e, e),) * 3, (None,) * 3, split_rows((e,) * 3)),
        Tensor(f"{b}.attn.qkv.bias", tuple(f"{p}/bias" for p in qkv), ((e,),) * 3, (None,) * 3, split_rows((e,) * 3)),
        *linear(f"{b}.attn.proj", "layers/{i}/attention/out", e, e),
        *norm(f"{b}.norm2", "layers/{i}/mlp_norm", e, bias=not gated),
        *mlp,
    )


def _qwen(e: str, gated: bool, mlp: tuple[str, str] = ("fc1", "fc2"), positions: bool = False) -> Callable[[ModelConfig], tuple[Tensor, ...]]:
    layer = _qwen_layer(e, gated, mlp)

    def tables(v):
        patch = weight("patch_embed.proj.weight", "embeddings/patch/kernel",
                       (e, "in_channels", "temporal_patch_size", "patch_size", "patch_size"))
        if positions:  # Qwen3-VL: the patch embedding's bias, learned positions resampled to each image's grid
            patch += (*weight("patch_embed.proj.bias", "embeddings/patch/bias", (e,)),
                      *weight("pos_embed.weight", "embeddings/position", ("num_position_embeddings", e)))
        return _stack(v, patch, layer, (), v.depth)
    return tables


QWEN2_VL_TOWER = Tower(_qwen("embed_dim", gated=False), (*site_rules("vision", "attention", "vision"), *ffn_rules(_AT, "vision_ffn")),
                       _rotary("num_heads", "embed_dim"))
# Qwen3-VL's: as Qwen2-VL's, a GELU MLP (linear_fc1, linear_fc2) of intermediate_size units, learned positions
QWEN3_VL_TOWER = Tower(_qwen("hidden_size", gated=False, mlp=("linear_fc1", "linear_fc2"), positions=True),
                       (*site_rules("vision", "attention", "vision"), *ffn_rules(_AT, "vision_ffn")), _rotary("num_heads", "hidden_size"))
QWEN2_5_VL_TOWER = Tower(_qwen("hidden_size", gated=True), (*site_rules("vision", "attention", "vision"), *_gated_rules("vision_ffn")),
                         _rotary("num_heads", "hidden_size"))


# ---- Llama 4: LayerNorms, q/k/v/o with biases, 2-D RoPE on interleaved pairs, a GELU MLP (fc1, fc2) with biases ----

def _head_dim(v) -> int:
    return v.hidden_size // v.num_attention_heads


_L = "model.layers.{i}"
_LLAMA4_LAYER = (
    *norm(f"{_L}.input_layernorm", "layers/{i}/attention_norm"),
    *(t for role, leaf in (("q", "query"), ("k", "key")) for t in interleaved_projection(
        f"{_L}.self_attn.{role}_proj", f"layers/{{i}}/attention/{leaf}", "num_attention_heads", _head_dim, _head_dim, "hidden_size", bias=True)),
    *linear(f"{_L}.self_attn.v_proj", "layers/{i}/attention/value", "hidden_size", "hidden_size"),
    *linear(f"{_L}.self_attn.o_proj", "layers/{i}/attention/out", "hidden_size", "hidden_size"),
    *norm(f"{_L}.post_attention_layernorm", "layers/{i}/mlp_norm"),
    *linear(f"{_L}.mlp.fc1", "layers/{i}/mlp/up", "hidden_size", "intermediate_size"),
    *linear(f"{_L}.mlp.fc2", "layers/{i}/mlp/down", "intermediate_size", "hidden_size"),
)


def _llama4(v) -> tuple[Tensor, ...]:
    """Without its pixel-shuffle adapter, which `vlm.LLAMA4_PROJECTOR` reads with the projector (their units one chain)."""
    (ih, iw), (ph, pw) = ((s, s) if isinstance(s, int) else tuple(s) for s in (v.image_size, v.patch_size))
    embeddings = (*weight("patch_embedding.linear.weight", "embeddings/patch/kernel", ("hidden_size", v.num_channels * ph * pw)),
                  *weight("class_embedding", "embeddings/class", ("hidden_size",)),
                  *weight("positional_embedding_vlm", "embeddings/position", ((ih // ph) * (iw // pw) + 1, "hidden_size")),
                  *norm("layernorm_pre", "embeddings/norm"))
    return _stack(v, embeddings, _LLAMA4_LAYER, norm("layernorm_post", "final_norm"), v.num_hidden_layers)


LLAMA4_TOWER = Tower(_llama4, (*site_rules("vision", "attention", "vision"), *ffn_rules(_AT, "vision_ffn")),
                     _rotary("num_attention_heads", "hidden_size"))

# A projector's MLP between the tower and the text stream (Mistral 3's linear_1 -> GELU -> linear_2, Qwen2-VL's merger
# mlp.0 -> GELU -> mlp.2): its hidden units permute (GELU: no scale); linear_2's output side is the stream's.
# Its leaves under projector/layers/0 (one layer: the streamed passes go by integer layers).
_MLP = r"projector/layers/(?P<layer>\d+)"
PROJECTOR_RULES = ((rf"{_MLP}/up/kernel", (None, "projector_ffn")), (rf"{_MLP}/up/bias", ("projector_ffn",)),
                   (rf"{_MLP}/out/kernel", ("projector_ffn", None)))
# Qwen3-VL's DeepStack mergers (norm -> linear_fc1 -> GELU -> linear_fc2 each, under projector/deepstack/{k}): their units
# permute, merger k's a group instance of layer k
_DEEPSTACK = r"projector/deepstack/(?P<layer>\d+)"
DEEPSTACK_RULES = ((rf"{_DEEPSTACK}/up/kernel", (None, "deepstack_ffn")), (rf"{_DEEPSTACK}/up/bias", ("deepstack_ffn",)),
                   (rf"{_DEEPSTACK}/out/kernel", ("deepstack_ffn", None)))
# Llama 4's pixel-shuffle adapter and projector (vision_adapter.mlp.fc1 -> GELU -> fc2 -> GELU -> multi_modal_projector.linear_1,
# no biases; leaves up, mid, out): fc1's units permute with fc2's input rows ("adapter_ffn"), fc2's output units, through the
# second GELU, with linear_1's input rows ("projector_ffn"). fc1 reads the tower's pixel-shuffled stream, which stays.
LLAMA4_PROJECTOR_RULES = ((rf"{_MLP}/up/kernel", (None, "adapter_ffn")), (rf"{_MLP}/mid/kernel", ("adapter_ffn", "projector_ffn")),
                          (rf"{_MLP}/out/kernel", ("projector_ffn", None)))
