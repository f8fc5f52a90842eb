"""Qwen's hybrid linear-attention decoders (model types qwen3_5_text: Qwen3.5's dense text model;
qwen3_5_moe_text: Qwen3.5-MoE's; qwen3_next: Qwen3-Next-80B-A3B): layers (`layer_types[i]`) of a
Gated DeltaNet ("linear_attention") or gated attention ("full_attention"), each reading a
zero-centred RMSNorm of the stream (`input_layernorm`, gain 1 + w), then an MLP after
`post_attention_layernorm`: a SwiGLU (qwen3_5_text; Qwen3-Next's `mlp_only_layers` and the layers
`decoder_sparse_step` skips) or a mixture (softmax top k, renormalised with norm_topk_prob, always
for qwen3_5_moe_text) beside a shared SwiGLU expert times sigmoid(shared_expert_gate(x)).

A Gated DeltaNet (nk key heads of dk, nv value heads of dv, r = nv / nk; K taps):
    q, k, v = in_q(h), in_k(h), in_v(h)       in_proj_qkv's rows (Qwen3-Next: in_proj_qkvz's, per key head)
    q, k, v = silu(depthwise causal conv1d)   each channel its own taps
    q, k L2-normed per key head (q also / sqrt(dk)), each serving r consecutive value heads
    beta = sigmoid(in_b(h)); g = -exp(A_log) softplus(in_a(h) + dt_bias)   one per value head
    S_t = exp(g) S + k (beta (v - S^T k))^T;  o = S_t^T q   per value head (dk, dv)
    out_proj(gain * rms(o) * silu(in_z(h)))   the RMS over each head's dv, one gain (dv,) for all heads
Gated attention: q_proj's rows are each head's query then its output gate ([q; gate] per head),
a per-head QK RMSNorm (gain 1 + w) before RoPE on the first partial_rotary_factor of each head,
and each head's output times sigmoid(gate) entry by entry before o_proj.

Groups (each checked in transformers by the conformance tests and tests/test_qwen3_next.py): the
attention layers' kv-group and query-head permutations with the gate's rows, Q/K sign flips of whole
rotary pairs and of each entry past them (the QK-norm), V/O sign flips and scales of each entry
(`HeadGeometry.gated_output`: the gate is entry by entry, so no V/O rotation); the Gated DeltaNet
layers' key heads ("deltanet", a permutation group): each key head with the r value heads it serves
moves in every leaf that has them (q/k/v/z/b/a rows, conv channels, A_log, dt_bias, out_proj's
columns); the SwiGLU's and the shared expert's units; the experts with their router rows, each
expert's units; the stream (pre-norm, every gain folded). `Family.left_out` names what is not
declared: the finer DeltaNet permutations (value heads within a key head, a head's entries), which
hold but no element carries, and any rotation or scale of its channels or of V/O, which do not hold.

Leaves (per layer i):
    embeddings/word/embedding                       model.embed_tokens
    layers/{i}/attention_norm/scale, mlp_norm/scale input_layernorm, post_attention_layernorm (w; gain 1 + w)
    layers/{i}/deltanet/in_{q,k}/kernel (d, nk, dk), in_{v,z}/kernel (d, nk, r dv), in_{b,a}/kernel (d, nk, r)
    layers/{i}/deltanet/conv_{q,k}/kernel (nk, dk, K), conv_v/kernel (nk, r dv, K)   conv1d.weight (C, 1, K)
    layers/{i}/deltanet/A_log, dt_bias (nk, r), norm/scale (dv,), out/kernel (nk, r dv, d)
    layers/{i}/attention/{query,gate}/kernel (d, H dh)   q_proj's rows, split per head
    layers/{i}/attention/{key,value,out}/kernel, attention/{query,key}_norm/scale (dh,)
    layers/{i}/mlp/{gate,up,down}/kernel            the SwiGLU's
    layers/{i}/moe/router/kernel (d, E), moe/{gate,up}/kernel (E, d, f), moe/down/kernel (E, f, d)
    layers/{i}/shared_mlp/{gate,up,down}/kernel, shared_gate/kernel (d, 1)
    final_norm/scale; task head: lm (lm_head, untied by default)
"""

from __future__ import annotations

import dataclasses

import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry, Spec
from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema, Kind
from .deepseek import MIXTURE_RULES
from .family import (
    COPY,
    OPTIONAL,
    SPEC_RULES,
    STACKED_GATE_UP,
    STACKED_TRANSPOSE,
    TRANSPOSE,
    Convert,
    Family,
    Norm,
    Tensor,
    embedding,
    gated_mlp,
    linear,
    norm,
    split_rows,
)
from .llama._config import rope_parameters_of
from .llama._tensors import HEADS as LLAMA_HEADS

_L = r"layers/(?P<layer>\d+)"
LAYER_TYPES = ("linear_attention", "full_attention")
MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


def attention_layer(c, i: int) -> bool:
    return c.layer_types[i] == "full_attention"


def deltanet_layer(c, i: int) -> bool:
    return c.layer_types[i] == "linear_attention"


def sparse_layer(c, i: int) -> bool:
    """Whether layer i's MLP is the mixture: always in Qwen3.5-MoE, never in Qwen3.5; in Qwen3-Next
    outside mlp_only_layers, with experts, every decoder_sparse_step-th layer (as its decoder layer)."""
    if c.model_type == "qwen3_5_moe_text":
        return True
    if c.model_type == "qwen3_5_text":
        return False
    return i not in c.mlp_only_layers and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0


def _dense_layer(c, i: int) -> bool:
    return not sparse_layer(c, i)


def _fused(c) -> bool:
    return c.model_type == "qwen3_next"


def _split(c) -> bool:
    return not _fused(c)


def _key_width(c) -> int:
    return c.linear_num_key_heads * c.linear_key_head_dim


def _value_width(c) -> int:
    return c.linear_num_value_heads * c.linear_value_head_dim


def _value_heads(c) -> int:
    return c.linear_num_value_heads


def _q_width(c) -> int:
    return c.num_attention_heads * c.head_dim


def _kv_width(c) -> int:
    return c.num_key_value_heads * c.head_dim


def _experts(c) -> int:
    return c.num_experts


def rotary_dim(c) -> int:
    """partial_rotary_factor of each head's entries, as transformers' RoPE init computes it (int())."""
    return int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0))


def head_geometry(c) -> HeadGeometry | None:
    """The full-attention layers' heads (None where every layer is a Gated DeltaNet): GQA, RoPE on the
    first rotary_dim entries, a per-head QK-norm, each head's output gated entry by entry."""
    if "full_attention" not in c.layer_types:
        return None
    return HeadGeometry(c.num_attention_heads, c.num_key_value_heads, c.head_dim, rotary_dim=rotary_dim(c), qk_norm="head", gated_output=True)


def inv_freq(c) -> np.ndarray:
    """RoPE's inverse frequencies (rotary_dim / 2,) in float32, as transformers' default init."""
    dim = rotary_dim(c)
    return (1.0 / (c.rope_parameters["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(np.float32)


# ---- conversions -----------------------------------------------------------------------------------

def _per_key_head(c):
    nk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    return nk, dk, (c.linear_num_value_heads // nk) * dv, c.linear_num_value_heads // nk


def _blocks_to_ours(a, nk, sizes):
    """(nk * sum(sizes), d) rows grouped per key head -> our kernels (d, nk * size), one per part."""
    parts = np.split(a.reshape(nk, sum(sizes), a.shape[-1]), np.cumsum(sizes)[:-1], axis=1)
    return tuple(p.reshape(-1, a.shape[-1]).T for p in parts)


def _blocks_to_hf(t, nk):
    return np.concatenate([x.T.reshape(nk, -1, x.shape[0]) for x in t], axis=1).reshape(-1, t[0].shape[0])


def _qkvz_to_ours(a, c):
    nk, dk, rv, _ = _per_key_head(c)
    return _blocks_to_ours(a, nk, (dk, dk, rv, rv))


def _ba_to_ours(a, c):
    nk, _, _, r = _per_key_head(c)
    return _blocks_to_ours(a, nk, (r, r))


# Qwen3-Next's fused projections: each key head's [q; k; v; z] rows (its r value heads' v and z), and [b; a]
QKVZ = Convert("qwen3_next_qkvz", _qkvz_to_ours, lambda t, c: _blocks_to_hf(t, c.linear_num_key_heads))
BA = Convert("qwen3_next_ba", _ba_to_ours, lambda t, c: _blocks_to_hf(t, c.linear_num_key_heads))
# q_proj's rows: each head's query, then its gate
QUERY_GATE = Convert("query_gate", lambda a, c: _blocks_to_ours(a, c.num_attention_heads, (c.head_dim, c.head_dim)),
                     lambda t, c: _blocks_to_hf(t, c.num_attention_heads))


def _conv_to_ours(a, c):
    a = a[:, 0, :]  # torch's depthwise (channels, 1, taps)
    return tuple(np.split(a, np.cumsum([_key_width(c), _key_width(c)]), axis=0))


CONV = Convert("deltanet_conv", _conv_to_ours, lambda t, c: np.concatenate(t, axis=0)[:, None, :])


def _split_axis(x, axis, nk):
    return x.reshape(*x.shape[:axis], nk, x.shape[axis] // nk, *x.shape[axis + 1:])


def _merge_axis(x, axis):
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])


def per_key_head(inner: Convert, axes) -> Convert:
    """`inner`'s leaves with their axis `axes[j]` (nk x w entries, key head major) split into (nk, w):
    the key heads' axis, which the group "deltanet" permutes."""
    def to_ours(a, c):
        return tuple(_split_axis(x, axis, c.linear_num_key_heads) for x, axis in zip(inner.to_ours(a, c), axes))

    return Convert(f"{inner.name}_per_key_head", to_ours, lambda t, c: inner.to_hf(tuple(_merge_axis(x, axis) for x, axis in zip(t, axes)), c))


def _in(in_layer, tensors, stacked=None):
    return tuple(dataclasses.replace(t, in_layer=in_layer, stacked=stacked) for t in tensors)


_D, _DA = "layers.{i}.linear_attn", "layers/{i}/deltanet"
_A, _AT, _MLP, _MOE_AT = "layers.{i}.self_attn", "layers/{i}/attention", "layers.{i}.mlp", "layers/{i}/moe"
_EXPERT = {"gate": (_experts, "hidden_size", "moe_intermediate_size"), "up": (_experts, "hidden_size", "moe_intermediate_size"),
           "down": (_experts, "moe_intermediate_size", "hidden_size")}


def _nk(c) -> int:
    return c.linear_num_key_heads


def _per_value_group(c) -> int:
    """The value heads each key head serves."""
    return c.linear_num_value_heads // c.linear_num_key_heads


def _values_per_key(c) -> int:
    return _per_value_group(c) * c.linear_value_head_dim


# Each part's entries per key head: q, k its dk; v, z its value heads' dv each; b, a one per value head
_WIDTH = {"q": "linear_key_head_dim", "k": "linear_key_head_dim", "v": _values_per_key, "z": _values_per_key, "b": _per_value_group,
          "a": _per_value_group}


def _in_tensor(hf: str, parts: str, convert: Convert, when) -> Tensor:
    """Input projections: our kernels (d, nk, width), the stream on axis 0, the key heads on axis 1."""
    return Tensor(hf, tuple(f"{_DA}/in_{p}/kernel" for p in parts), tuple(("hidden_size", _nk, _WIDTH[p]) for p in parts), (0,) * len(parts),
                  per_key_head(convert, (1,) * len(parts)), when)


_DELTANET = (
    _in_tensor(f"{_D}.in_proj_qkv.weight", "qkv", split_rows((_key_width, _key_width, _value_width)), _split),
    _in_tensor(f"{_D}.in_proj_z.weight", "z", TRANSPOSE, _split),
    _in_tensor(f"{_D}.in_proj_b.weight", "b", TRANSPOSE, _split),
    _in_tensor(f"{_D}.in_proj_a.weight", "a", TRANSPOSE, _split),
    _in_tensor(f"{_D}.in_proj_qkvz.weight", "qkvz", QKVZ, _fused),
    _in_tensor(f"{_D}.in_proj_ba.weight", "ba", BA, _fused),
    Tensor(f"{_D}.conv1d.weight", tuple(f"{_DA}/conv_{p}/kernel" for p in "qkv"),
           tuple((_nk, _WIDTH[p], "linear_conv_kernel_dim") for p in "qkv"), (None,) * 3, per_key_head(CONV, (0, 0, 0))),
    *(Tensor(f"{_D}.{p}", (f"{_DA}/{p}",), ((_nk, _per_value_group),), (None,), per_key_head(COPY, (0,))) for p in ("A_log", "dt_bias")),
    *norm(f"{_D}.norm", f"{_DA}/norm", "linear_value_head_dim", bias=False, stream=False),
    Tensor(f"{_D}.out_proj.weight", (f"{_DA}/out/kernel",), ((_nk, _values_per_key, "hidden_size"),), (2,), per_key_head(TRANSPOSE, (0,))),
)

_ATTENTION = (
    Tensor(f"{_A}.q_proj.weight", (f"{_AT}/query/kernel", f"{_AT}/gate/kernel"), (("hidden_size", _q_width),) * 2, (0, 0), QUERY_GATE),
    *linear(f"{_A}.k_proj", f"{_AT}/key", "hidden_size", _kv_width, bias=False, reads=True),
    *linear(f"{_A}.v_proj", f"{_AT}/value", "hidden_size", _kv_width, bias=False, reads=True),
    *linear(f"{_A}.o_proj", f"{_AT}/out", _q_width, "hidden_size", bias=False, writes=True),
    *norm(f"{_A}.q_norm", f"{_AT}/query_norm", "head_dim", bias=False, stream=False),
    *norm(f"{_A}.k_norm", f"{_AT}/key_norm", "head_dim", bias=False, stream=False),
)

_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *_in(deltanet_layer, _DELTANET),
    *_in(attention_layer, _ATTENTION),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm", bias=False),
    *_in(_dense_layer, gated_mlp(_MLP, "layers/{i}/mlp")),
    *_in(sparse_layer, (
        Tensor(f"{_MLP}.gate.weight", (f"{_MOE_AT}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE),
        *gated_mlp(f"{_MLP}.shared_expert", "layers/{i}/shared_mlp", f="shared_expert_intermediate_size"),
        *linear(f"{_MLP}.shared_expert_gate", "layers/{i}/shared_gate", "hidden_size", 1, bias=False, reads=True),
    )),
    # one tensor per expert, as save_pretrained writes them
    *_in(sparse_layer, tuple(
        Tensor(f"{_MLP}.experts.{{e}}.{proj}_proj.weight", (f"{_MOE_AT}/{proj}/kernel",), (_EXPERT[proj],), (2 if proj == "down" else 1,),
               TRANSPOSE, experts=_experts) for proj in ("gate", "up", "down")), stacked=False),
    # stacked, as transformers 5 holds them in memory
    *_in(sparse_layer, (
        Tensor(f"{_MLP}.experts.gate_up_proj", (f"{_MOE_AT}/gate/kernel", f"{_MOE_AT}/up/kernel"), (_EXPERT["gate"],) * 2, (1, 1), STACKED_GATE_UP),
        Tensor(f"{_MLP}.experts.down_proj", (f"{_MOE_AT}/down/kernel",), (_EXPERT["down"],), (2,), STACKED_TRANSPOSE),
    ), stacked=True),
)

# Every gain of the stream folds into what reads it: the mixers' input projections, the MLP's or the
# mixture's (router, experts, shared expert and its gate), the LM head.
_FOLDS = (
    (r"layers/(\d+)/attention_norm/scale", r"layers/\1/(attention/(query|key|value|gate)|deltanet/in_(q|k|v|z|b|a))/kernel"),
    (r"layers/(\d+)/mlp_norm/scale", r"layers/\1/(mlp/(up|gate)|shared_mlp/(up|gate)|shared_gate|moe/(router|up|gate))/kernel"),
    (r"final_norm/scale", r"lm_head/kernel"),
)

# The gate's rows follow the query heads (`spec.GATE_ROLE`); the Gated DeltaNet's key heads, each with the value
# heads it serves, permute together in every leaf that has them (the gated norm's gain, one for all heads, stays).
_RULES = (
    (rf"{_L}/attention/gate/kernel", (None, "attn.g")),
    (rf"{_L}/deltanet/in_(q|k|v|z|b|a)/kernel", (None, "deltanet", None)),
    (rf"{_L}/deltanet/(conv_(q|k|v)|out)/kernel", ("deltanet", None, None)),
    (rf"{_L}/deltanet/(A_log|dt_bias)", ("deltanet", None)),
    (rf"{_L}/deltanet/norm/scale", None),
    (rf"{_L}/shared_gate/kernel", None),
    *MIXTURE_RULES,
)

_INTS = Kind("a list of ints", lambda v: isinstance(v, list) and all(INT.accepts(x) for x in v))


def _derive(values: dict, raw) -> None:
    """Qwen3_5TextConfig, Qwen3_5MoeTextConfig, Qwen3NextConfig: layer_types every
    full_attention_interval-th layer (4) full attention, the others linear; RoPE's
    partial_rotary_factor 0.25 unless given; mlp_only_layers [] (Qwen3-Next); the sizes checked."""
    if values["layer_types"] is None:
        every = raw.get("full_attention_interval", 4)
        if not INT.accepts(every) or every < 1:
            raise InputError(f"full_attention_interval={every!r}: expected a positive int")
        values["layer_types"] = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(values["num_hidden_layers"])]
    if len(values["layer_types"]) != values["num_hidden_layers"] or set(values["layer_types"]) - set(LAYER_TYPES):
        raise InputError(f"layer_types={values['layer_types']!r}: expected {values['num_hidden_layers']} of {list(LAYER_TYPES)}")
    if "mlp_only_layers" in values and values["mlp_only_layers"] is None:
        values["mlp_only_layers"] = []
    values["rope_parameters"] = rope_parameters_of(values, raw)
    values["rope_parameters"].setdefault("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    if values["rope_parameters"]["rope_type"] != "default":
        raise InputError(f"rope_type={values['rope_parameters']['rope_type']!r}: only the default RoPE of these models is run")
    rotary = values["head_dim"] * values["rope_parameters"]["partial_rotary_factor"]
    if int(rotary) % 2 or int(rotary) < 2:
        raise InputError(f"partial_rotary_factor={values['rope_parameters']['partial_rotary_factor']} gives {int(rotary)} rotary entries of a "
                         f"{values['head_dim']}-wide head: expected an even number >= 2")
    nk, nv = values["linear_num_key_heads"], values["linear_num_value_heads"]
    if nk < 1 or nv % nk:
        raise InputError(f"linear_num_value_heads={nv} is not a multiple of linear_num_key_heads={nk}: each key head serves whole value heads")
    if values["num_attention_heads"] % values["num_key_value_heads"]:
        raise InputError(f"num_attention_heads={values['num_attention_heads']} is not a multiple of num_key_value_heads="
                         f"{values['num_key_value_heads']}")
    if "num_experts" in values and values["num_experts_per_tok"] > values["num_experts"] > 0:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} exceeds num_experts={values['num_experts']}")


def _fields(vocab, hidden, layers, kv_heads, **more):
    return {
        "vocab_size": (INT, vocab), "hidden_size": (INT, hidden), "num_hidden_layers": (INT, layers), "num_attention_heads": (INT, 16),
        "num_key_value_heads": (INT, kv_heads), "hidden_act": (STR, "silu"), "max_position_embeddings": (INT, 32768),
        "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-6), "tie_word_embeddings": (BOOL, False),
        "rope_parameters": (DICT.optional(), None), "attention_bias": (BOOL, False), "head_dim": (INT, 256),
        "linear_conv_kernel_dim": (INT, 4), "linear_key_head_dim": (INT, 128), "linear_value_head_dim": (INT, 128),
        "linear_num_key_heads": (INT, 16), "linear_num_value_heads": (INT, 32), "layer_types": (STRINGS.optional(), None),
        "pad_token_id": (INT.optional(), None), **more,
    }


_CONSUMED = ("rope_scaling", "rope_theta", "partial_rotary_factor", "full_attention_interval")
_MIXTURE = {"moe_intermediate_size": (INT, 512), "shared_expert_intermediate_size": (INT, 512)}

SCHEMAS = (
    ConfigSchema("qwen3_5_text", "Qwen3_5TextConfig", _fields(248320, 4096, 32, 4, intermediate_size=(INT, 12288)),
                 derive=_derive, consumed=_CONSUMED),
    ConfigSchema("qwen3_5_moe_text", "Qwen3_5MoeTextConfig", _fields(248320, 2048, 40, 2, **_MIXTURE, num_experts_per_tok=(INT, 8),
                                                                      num_experts=(INT, 256)), derive=_derive, consumed=_CONSUMED),
    ConfigSchema("qwen3_next", "Qwen3NextConfig", _fields(151936, 2048, 48, 2, intermediate_size=(INT, 5632), **_MIXTURE,
                                                          num_experts_per_tok=(INT, 10), num_experts=(INT, 512), decoder_sparse_step=(INT, 1),
                                                          norm_topk_prob=(BOOL, True), mlp_only_layers=(_INTS.optional(), None)),
                 derive=_derive, consumed=_CONSUMED),
)


@dataclasses.dataclass(frozen=True)
class HybridFamily(Family):
    """The record, with the Gated DeltaNet's key heads named in its spec and what it leaves out said."""

    def spec(self, config, layout=None) -> Spec:
        geometry = self.head_geometry(config)
        return Spec(self.rules + SPEC_RULES, heads={} if geometry is None else {"attn": geometry}, residual=self.residual_spec(config, layout),
                    optional=OPTIONAL, unit_names={"deltanet": "key head"})

    def left_out(self, config) -> tuple[str, ...]:
        out = []
        if "linear_attention" in config.layer_types:
            r = config.linear_num_value_heads // config.linear_num_key_heads
            out.append(f"the Gated DeltaNet layers' key heads permute with the {r} value head(s) each serves, nothing finer: "
                       "permutations of the value heads within a key head, of a key head's dk entries (q, k and their conv taps) or "
                       "of the dv entries every value head shares (one gated-norm gain serves all) keep the function too but are "
                       "not declared; no rotation or scale of their channels does (the depthwise convolution and SiLU act channel "
                       "by channel, q and k are L2-normed per head)")
        if "full_attention" in config.layer_types:
            out.append("no V/O rotation of the full-attention layers: each entry of a head's output is multiplied by its own sigmoid "
                       "gate (q_proj's gate rows), which only diagonal maps commute with: V/O keeps sign flips and scales")
        return tuple(out)


QWEN3_NEXT = HybridFamily(
    name="qwen3_next",
    configs=SCHEMAS,
    stems={"qwen3_5_text": "Qwen3_5Text", "qwen3_5_moe_text": "Qwen3_5MoeText", "qwen3_next": "Qwen3Next"},
    class_names={"Qwen3_5TextForCausalLM": "Qwen3_5ForCausalLM", "Qwen3_5MoeTextForCausalLM": "Qwen3_5MoeForCausalLM"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("norm", "final_norm", bias=False),
    heads=tuple(h for h in LLAMA_HEADS if h.name == "lm"),
    default_head="lm",
    norm=Norm("rmsnorm", placement="pre", gain="one_plus", folds=_FOLDS),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.qwen3_next.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry,
    rules=_RULES,
    ignored=(r"mtp\..*",),  # the multi-token-prediction layers, which transformers does not load
    unsupported=(("attention_bias", "biases on q_proj's query and gate rows, k_proj, v_proj and o_proj, which the gated attention "
                                    "read here does not hold"),),
)
