"""Granite-4's hybrid (model type granitemoehybrid: ibm-granite/granite-4.0-h-*): a decoder whose
layers are Mamba-2 mixers (`layer_types[i]` "linear_attention", the older configs' "mamba") or
grouped-query attention ("full_attention", older "attention"; RoPE only with `position_embedding_type`
"rope", as transformers reads it: None or any other value, "nope" say, is none), each reading an
RMSNorm of the stream (`input_layernorm`), then a shared SwiGLU MLP (`shared_mlp.input_linear`
[gate; up], `output_linear`) beside an optional mixture of experts (`num_local_experts` > 0: a
top-k router, experts stacked [gate; up]), after `post_attention_layernorm`. Granite's four
multipliers (embedding, residual, attention scale, logits' divisor) commute with every group.

Groups: the mixers' heads with their channels ("ssm", an experts block) and, with one group of B/C,
their state entries ("state"), as Mamba-2's (`families/mamba2.py`, docs/MATH.md §17); the attention
layers' heads (§1, no RoPE pairs without RoPE); the shared MLP's units ("shared_ffn"); the experts
("moe", §5); the stream, pre-norm (§10).

Leaves (per layer i):
    embeddings/word/embedding                 model.embed_tokens
    layers/{i}/attention_norm/scale           input_layernorm (before the mixer or the attention)
    layers/{i}/mamba/...                      mamba.* (the mixer's leaves, `families/mamba2.py`)
    layers/{i}/attention/{query,key,value,out}/kernel (+ biases with attention_bias)   self_attn.*
    layers/{i}/mlp_norm/scale                 post_attention_layernorm
    layers/{i}/shared_mlp/{gate,up,down}/kernel   shared_mlp.input_linear (2s, d), output_linear
    layers/{i}/moe/router/kernel (d, E), moe/{gate,up}/kernel (E, d, f), moe/down/kernel (E, f, d)
        block_sparse_moe.router.weight, experts.gate_up_proj, experts.down_proj (transformers 5;
        IBM's checkpoints: router.layer.weight, input_linear.weight, output_linear.weight)
    final_norm/scale                          model.norm
    task head: lm, GraniteMoeHybridForCausalLM's lm_head (untied by default)
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry
from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema, Kind, check_number
from .deepseek import MIXTURE_RULES
from .family import STACKED_GATE_UP, STACKED_TRANSPOSE, TRANSPOSE, Norm, Tensor, attention_projections, embedding, linear, norm, split_rows
from .llama._config import rope_parameters_of
from .llama._tensors import HEADS as LLAMA_HEADS
from .mamba2 import MixerFamily, check_mixer, mixer

_L = r"layers/(?P<layer>\d+)"
LAYER_TYPES = ("linear_attention", "full_attention")
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # as transformers remaps them
_MOE, _MOE_AT = "layers.{i}.block_sparse_moe", "layers/{i}/moe"


def layer_types(config) -> list[str]:
    """Each layer's mixer; GraniteMoe's and GraniteMoeShared's layers (`families/granitemoe.py`) are all attention."""
    if config.model_type != "granitemoehybrid":
        return ["full_attention"] * config.num_hidden_layers
    return config.layer_types


def shared_mlp(config) -> bool:
    """Whether the layers hold a shared MLP: the hybrid's always (transformers builds one of any
    width), GraniteMoeShared's where shared_intermediate_size > 0, GraniteMoe's never."""
    return config.model_type == "granitemoehybrid" or getattr(config, "shared_intermediate_size", 0) > 0


def _attention(config, i: int) -> bool:
    return layer_types(config)[i] == "full_attention"


def _mamba(config, i: int) -> bool:
    return layer_types(config)[i] == "linear_attention"


def _experts(config) -> int:
    return config.num_local_experts


def _sparse(config, i: int) -> bool:
    return config.num_local_experts > 0


def head_dim(config) -> int:
    return config.hidden_size // config.num_attention_heads


def head_geometry(config) -> HeadGeometry | None:
    """The attention layers' heads (None where every layer is a mixer); RoPE over the whole head or none."""
    if "full_attention" not in layer_types(config):
        return None
    dh = head_dim(config)
    return HeadGeometry(config.num_attention_heads, config.num_key_value_heads, dh, rotary_dim=dh if rotary(config) else None)


def rotary(config) -> bool:
    """RoPE in the attention layers: the hybrid's with position_embedding_type "rope", GraniteMoe's always."""
    return config.model_type != "granitemoehybrid" or config.position_embedding_type == "rope"


def _in(layer, tensors, **changes):
    return tuple(dataclasses.replace(t, in_layer=layer, **changes) for t in tensors)


def _q_width(config) -> int:
    return config.num_attention_heads * head_dim(config)


def _kv_width(config) -> int:
    return config.num_key_value_heads * head_dim(config)


_EXPERT = (_experts, "hidden_size", "intermediate_size")

_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *_in(_mamba, mixer("layers.{i}.mamba", "layers/{i}/mamba")),
    *_in(_attention, attention_projections("layers.{i}.self_attn", "layers/{i}/attention", _q_width, _kv_width,
                                           bias=lambda c: c.attention_bias, out_bias=lambda c: c.attention_bias)),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm", bias=False),
    Tensor("layers.{i}.shared_mlp.input_linear.weight", ("layers/{i}/shared_mlp/gate/kernel", "layers/{i}/shared_mlp/up/kernel"),
           (("hidden_size", "shared_intermediate_size"),) * 2, (0, 0), split_rows(("shared_intermediate_size", "shared_intermediate_size")),
           when=shared_mlp),
    *(dataclasses.replace(t, when=shared_mlp) for t in linear("layers.{i}.shared_mlp.output_linear", "layers/{i}/shared_mlp/down",
                                                               "shared_intermediate_size", "hidden_size", bias=False, writes=True)),
    # the mixture, as transformers 5 names it (stacked) and as IBM's checkpoints do
    *_in(_sparse, (
        Tensor(f"{_MOE}.router.weight", (f"{_MOE_AT}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE),
        Tensor(f"{_MOE}.experts.gate_up_proj", (f"{_MOE_AT}/gate/kernel", f"{_MOE_AT}/up/kernel"), (_EXPERT,) * 2, (1, 1), STACKED_GATE_UP),
        Tensor(f"{_MOE}.experts.down_proj", (f"{_MOE_AT}/down/kernel",), ((_experts, "intermediate_size", "hidden_size"),), (2,),
               STACKED_TRANSPOSE),
    ), stacked=True),
    *_in(_sparse, (
        Tensor(f"{_MOE}.router.layer.weight", (f"{_MOE_AT}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE),
        Tensor(f"{_MOE}.input_linear.weight", (f"{_MOE_AT}/gate/kernel", f"{_MOE_AT}/up/kernel"), (_EXPERT,) * 2, (1, 1), STACKED_GATE_UP),
        Tensor(f"{_MOE}.output_linear.weight", (f"{_MOE_AT}/down/kernel",), ((_experts, "intermediate_size", "hidden_size"),), (2,),
               STACKED_TRANSPOSE),
    ), stacked=False),
)

_RULES = (
    (rf"{_L}/(attention|mlp)_norm/scale", None),
    *MIXTURE_RULES,
)

_FOLDS = (
    (r"layers/(\d+)/attention_norm/scale", r"layers/\1/(attention/(query|key|value)|mamba/in_(z|x|b|c|dt))/kernel"),
    (r"layers/(\d+)/mlp_norm/scale", r"layers/\1/(shared_mlp/(gate|up)|moe/(router|gate|up))/kernel"),
    (r"final_norm/scale", r"lm_head/kernel"),
)

NUMBER = Kind("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
_HEAD_DIM = Kind('an int or "auto"', lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool)))
_LIMIT = Kind("two numbers", lambda v: isinstance(v, (list, tuple)) and len(v) == 2)
_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def _derive(values: dict, raw) -> None:
    """GraniteMoeHybridConfig: kv heads default to the heads, the mixer's head width from expand x
    hidden_size ("auto"), every layer a mixer without layer_types (older names remapped as
    transformers remaps them); the mixer's sizes checked."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    inner = values["mamba_expand"] * values["hidden_size"]
    if values["mamba_d_head"] == "auto":
        values["mamba_d_head"] = inner // values["mamba_n_heads"] if values["mamba_n_heads"] else 0
    if values["mamba_d_head"] * values["mamba_n_heads"] != inner:
        raise InputError(f"mamba_n_heads={values['mamba_n_heads']} x mamba_d_head={values['mamba_d_head']} differs from mamba_expand="
                         f"{values['mamba_expand']} x hidden_size={values['hidden_size']}: transformers requires them equal")
    if values["layer_types"] is None:
        values["layer_types"] = ["linear_attention"] * values["num_hidden_layers"]
    values["layer_types"] = [_LEGACY.get(t, t) for t in values["layer_types"]]
    if len(values["layer_types"]) != values["num_hidden_layers"] or set(values["layer_types"]) - set(LAYER_TYPES):
        raise InputError(f"layer_types={values['layer_types']!r}: expected {values['num_hidden_layers']} of {list(LAYER_TYPES)}")
    values["rope_parameters"] = rope_parameters_of(values, raw)
    for name in _MULTIPLIERS:
        check_number(name, values[name])
    if values["logits_scaling"] == 0:
        raise InputError("logits_scaling=0: the LM logits are divided by it")
    if values["hidden_act"] != "silu":
        raise InputError(f"hidden_act={values['hidden_act']!r}: the mixer's convolution is run with silu only")
    if "full_attention" in values["layer_types"] and values["hidden_size"] % values["num_attention_heads"]:
        raise InputError(f"hidden_size={values['hidden_size']} is not a multiple of num_attention_heads={values['num_attention_heads']}")
    check_mixer(values, dict(heads="mamba_n_heads", head_dim="mamba_d_head", groups="mamba_n_groups", state="mamba_d_state", conv="mamba_d_conv"))


SCHEMA = ConfigSchema("granitemoehybrid", "GraniteMoeHybridConfig", {
    "vocab_size": (INT, 32000), "hidden_size": (INT, 4096), "intermediate_size": (INT, 11008), "num_hidden_layers": (INT, 32),
    "num_attention_heads": (INT, 32), "num_key_value_heads": (INT.optional(), None), "hidden_act": (STR, "silu"),
    "max_position_embeddings": (INT, 2048), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-6), "pad_token_id": (INT.optional(), None),
    "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None), "attention_bias": (BOOL, False),
    **{name: (NUMBER, 1.0) for name in _MULTIPLIERS},
    "num_local_experts": (INT, 8), "num_experts_per_tok": (INT, 2), "shared_intermediate_size": (INT, 1024),
    "position_embedding_type": (STR.optional(), None), "layer_types": (STRINGS.optional(), None), "mamba_n_heads": (INT, 128),
    "mamba_n_groups": (INT, 1), "mamba_d_state": (INT, 256), "mamba_d_head": (_HEAD_DIM, "auto"), "mamba_d_conv": (INT, 4),
    "mamba_expand": (INT, 2), "mamba_conv_bias": (BOOL, True), "mamba_proj_bias": (BOOL, False),
    "time_step_limit": (_LIMIT.optional(), (0.0, float("inf"))),
}, derive=_derive, aliases={"layers_block_type": "layer_types"}, consumed=("rope_scaling", "rope_theta"))


GRANITE_MOE_HYBRID = MixerFamily(
    name="granitemoehybrid",
    configs=(SCHEMA,),
    stems={"granitemoehybrid": "GraniteMoeHybrid"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("norm", "final_norm", bias=False),
    heads=tuple(h for h in LLAMA_HEADS if h.name == "lm"),
    default_head="lm",
    norm=Norm("rmsnorm", placement="pre", folds=_FOLDS),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.granitemoehybrid.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry,
    rules=_RULES,
    mixer_at="mamba",
)
