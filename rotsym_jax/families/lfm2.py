"""LFM2 (model type lfm2: LiquidAI's LFM2-350M to 2.6B): a hybrid decoder whose layers are either
grouped-query attention (a per-head QK-norm, RoPE) or a gated short convolution, each reading an
RMSNorm of the stream (`operator_norm`) and followed by a SwiGLU MLP (`ffn_norm`,
`feed_forward.w1` gate, `w3` up, `w2` down); the final norm is HF's `embedding_norm`.

A short convolution (d = hidden_size, L = conv_L_cache):
    b, c, x = in_proj(h)                  three thirds of in_proj's (3d, d) rows
    y = c * depthwise causal conv1d(b * x)   each channel its own kernel of L taps
    out_proj(y) joins the stream
Every operation on the d channels is channel by channel, or a linear map reading (in_proj's rows)
or writing them (out_proj's columns), so a permutation of the channels, the same for b, c and x,
leaves the function as it was: our group "channels", as Mamba's (docs/MATH.md §17). A channel is
a gated FFN's unit too (c its up row, conv(b * x) its gate, out_proj's column its down column), so
the group holds each channel's scale as a gated FFN's (c's row and bias times s, out_proj's
column divided by s: tags channels.in / channels.out, solved with --ffn scaled). The other
diagonal scalings (b's against x's, the kernel's against c's) keep the function too, but the
element holds one scale per unit: not moved (MATH §17 works out all four).

Leaves (per layer i; attention layers `layer_types[i] == "full_attention"`, the others "conv"):
    embeddings/word/embedding              (vocab_size, d)   model.embed_tokens
    layers/{i}/operator_norm/scale         (d,)              operator_norm
    layers/{i}/attention/{query,key,value,out}/kernel         self_attn.{q,k,v,out}_proj
    layers/{i}/attention/{query,key}_norm/scale (dh,)        self_attn.{q,k}_layernorm
    layers/{i}/conv/{in_b,in_c,in_x}/kernel (d, d) (+ biases with conv_bias)   conv.in_proj (3d, d)
    layers/{i}/conv/conv/kernel            (d, L), conv/bias (d,) with conv_bias  conv.conv
    layers/{i}/conv/out/kernel             (d, d) (+ bias with conv_bias)     conv.out_proj
    layers/{i}/mlp_norm/scale, layers/{i}/mlp/{gate,up,down}/kernel           ffn_norm, feed_forward
    final_norm/scale                       (d,)              model.embedding_norm
    task head (run here): lm, Lfm2ForCausalLM's lm_head (tied to the embedding by default)
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry
from .config import BOOL, DICT, FLOAT, INT, STRINGS, ConfigSchema, Kind, check_number
from .family import SPEC_RULES, Convert, Family, Norm, Tensor, embedding, linear, norm, pre_norm_folds, split_rows
from .llama._config import rope_parameters_of
from .llama._tensors import HEADS as LLAMA_HEADS

_L = r"layers/(?P<layer>\d+)"
_A, _C = "layers.{i}.self_attn", "layers.{i}.conv"
LAYER_TYPES = ("full_attention", "conv")


def _attention(config, i: int) -> bool:
    return config.layer_types[i] == "full_attention"


def _conv(config, i: int) -> bool:
    return config.layer_types[i] == "conv"


def _conv_bias(config) -> bool:
    return config.conv_bias


def _head_dim(config) -> int:
    return config.hidden_size // config.num_attention_heads


def _q_width(config) -> int:
    return config.num_attention_heads * _head_dim(config)


def _kv_width(config) -> int:
    return config.num_key_value_heads * _head_dim(config)


def ffn_width(config) -> int:
    """The MLP's width as Lfm2MLP computes it: intermediate_size, or with block_auto_adjust_ff_dim
    2/3 of it, times block_ffn_dim_multiplier, rounded up to a multiple of block_multiple_of."""
    width = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if config.block_ffn_dim_multiplier is not None:
            width = int(config.block_ffn_dim_multiplier * width)
            width = config.block_multiple_of * ((width + config.block_multiple_of - 1) // config.block_multiple_of)
    return width


def head_geometry(config) -> HeadGeometry:
    return HeadGeometry(config.num_attention_heads, config.num_key_value_heads, _head_dim(config), rotary_dim=_head_dim(config), qk_norm="head")


def _in_layers(layer, tensors):
    """`tensors` held by the layers `layer(config, i)` says (attention or convolution)."""
    return tuple(dataclasses.replace(t, in_layer=layer) for t in tensors)


# torch's Conv1d weight (d, 1, L) of a depthwise convolution <-> our (d, L)
_DEPTHWISE = Convert("depthwise", lambda a, c: (a[:, 0, :],), lambda t, c: t[0][:, None, :])
_THIRDS = split_rows(("hidden_size", "hidden_size", "hidden_size"))
_CONV = "layers/{i}/conv"

_LAYER = (
    *norm("layers.{i}.operator_norm", "layers/{i}/operator_norm", bias=False),
    *_in_layers(_attention, (
        *linear(f"{_A}.q_proj", "layers/{i}/attention/query", "hidden_size", _q_width, bias=False, reads=True),
        *linear(f"{_A}.k_proj", "layers/{i}/attention/key", "hidden_size", _kv_width, bias=False, reads=True),
        *linear(f"{_A}.v_proj", "layers/{i}/attention/value", "hidden_size", _kv_width, bias=False, reads=True),
        *linear(f"{_A}.out_proj", "layers/{i}/attention/out", _q_width, "hidden_size", bias=False, writes=True),
        *norm(f"{_A}.q_layernorm", "layers/{i}/attention/query_norm", _head_dim, bias=False, stream=False),
        *norm(f"{_A}.k_layernorm", "layers/{i}/attention/key_norm", _head_dim, bias=False, stream=False),
    )),
    *_in_layers(_conv, (
        Tensor(f"{_C}.in_proj.weight", tuple(f"{_CONV}/in_{p}/kernel" for p in "bcx"), (("hidden_size", "hidden_size"),) * 3, (0, 0, 0),
               _THIRDS),
        Tensor(f"{_C}.in_proj.bias", tuple(f"{_CONV}/in_{p}/bias" for p in "bcx"), (("hidden_size",),) * 3, (None,) * 3, _THIRDS,
               _conv_bias),
        Tensor(f"{_C}.conv.weight", (f"{_CONV}/conv/kernel",), (("hidden_size", "conv_L_cache"),), (None,), _DEPTHWISE),
        Tensor(f"{_C}.conv.bias", (f"{_CONV}/conv/bias",), (("hidden_size",),), (None,), when=_conv_bias),
        *linear(f"{_C}.out_proj", f"{_CONV}/out", "hidden_size", "hidden_size", bias=_conv_bias, writes=True),
    )),
    *norm("layers.{i}.ffn_norm", "layers/{i}/mlp_norm", bias=False),
    *linear("layers.{i}.feed_forward.w1", "layers/{i}/mlp/gate", "hidden_size", ffn_width, bias=False, reads=True),
    *linear("layers.{i}.feed_forward.w3", "layers/{i}/mlp/up", "hidden_size", ffn_width, bias=False, reads=True),
    *linear("layers.{i}.feed_forward.w2", "layers/{i}/mlp/down", ffn_width, "hidden_size", bias=False, writes=True),
)

# The shared rules (attention heads, the FFN's units) and the convolutions' channels, one
# permutation for b, c, x and everything that reads or writes them; c's rows and out_proj's
# columns carry each channel's scale (c times s, out_proj divided by s: MATH §17), as up and down do.
_RULES = (
    (rf"{_L}/conv/in_c/kernel", (None, "channels.in")),
    (rf"{_L}/conv/in_c/bias", ("channels.in",)),
    (rf"{_L}/conv/in_(b|x)/kernel", (None, "channels")),
    (rf"{_L}/conv/(in_(b|x)|conv)/bias", ("channels",)),
    (rf"{_L}/conv/conv/kernel", ("channels", None)),
    (rf"{_L}/conv/out/kernel", ("channels.out", None)),
    (rf"{_L}/conv/out/bias", None),
    (rf"{_L}/operator_norm/scale", None),
    *SPEC_RULES,
)

_FOLDS = (
    (r"layers/(\d+)/operator_norm/scale", r"layers/\1/(attention/(query|key|value)|conv/in_(b|c|x))/kernel"),
    *pre_norm_folds("(up|gate)", r"lm_head")[1:],
)

_ATTENTION_INDICES = Kind("a list of layer indices", lambda v: isinstance(v, list) and all(INT.accepts(x) for x in v))


def _derive(values: dict, raw) -> None:
    """Lfm2Config: layer_types from full_attn_idxs (every layer attention without either), the
    legacy tie_embedding and block_ff_dim keys, RoPE parameters from the legacy rope_theta."""
    if "tie_embedding" in raw:
        values["tie_word_embeddings"] = raw["tie_embedding"]
    if "block_ff_dim" in raw:
        values["intermediate_size"] = raw["block_ff_dim"]
    if values["layer_types"] is None:
        if values["full_attn_idxs"] is None:
            values["full_attn_idxs"] = list(range(values["num_hidden_layers"]))
        values["layer_types"] = ["full_attention" if i in values["full_attn_idxs"] else "conv" for i in range(values["num_hidden_layers"])]
    if len(values["layer_types"]) != values["num_hidden_layers"] or set(values["layer_types"]) - set(LAYER_TYPES):
        raise InputError(f"layer_types={values['layer_types']!r}: expected {values['num_hidden_layers']} of {list(LAYER_TYPES)}")
    values["rope_parameters"] = rope_parameters_of(values, raw, default_theta=1000000.0)
    check_number("block_ffn_dim_multiplier", values["block_ffn_dim_multiplier"])
    if values["hidden_size"] % values["num_attention_heads"]:
        raise InputError(f"hidden_size={values['hidden_size']} is not a multiple of num_attention_heads={values['num_attention_heads']}")


SCHEMA = ConfigSchema("lfm2", "Lfm2Config", {
    "vocab_size": (INT, 65536), "hidden_size": (INT, 2560), "intermediate_size": (INT, 12288), "num_hidden_layers": (INT, 32),
    "num_attention_heads": (INT, 32), "num_key_value_heads": (INT, 8), "max_position_embeddings": (INT, 128000),
    "initializer_range": (FLOAT, 0.02), "norm_eps": (FLOAT, 1e-5), "pad_token_id": (INT.optional(), 0), "tie_word_embeddings": (BOOL, True),
    "rope_parameters": (DICT.optional(), None), "conv_bias": (BOOL, False), "conv_L_cache": (INT, 3), "block_multiple_of": (INT, 256),
    "block_ffn_dim_multiplier": (Kind("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)), 1.0),
    "block_auto_adjust_ff_dim": (BOOL, True), "full_attn_idxs": (_ATTENTION_INDICES.optional(), None), "layer_types": (STRINGS.optional(), None),
}, derive=_derive, consumed=("rope_scaling", "rope_theta", "tie_embedding", "block_ff_dim"))


LFM2 = Family(
    name="lfm2",
    configs=(SCHEMA,),
    stems={"lfm2": "Lfm2"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("embedding_norm", "final_norm", bias=False),
    heads=tuple(h for h in LLAMA_HEADS if h.name == "lm"),
    default_head="lm",  # a tied *ForCausalLM stores no lm_head.weight
    norm=Norm("rmsnorm", placement="pre", folds=_FOLDS),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.lfm2.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry,
    rules=_RULES,
)
