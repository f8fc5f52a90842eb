"""MiniMax (model type minimax: MiniMax-Text-01): layers (`layer_types[i]`) of softmax attention
("full_attention": GQA, RoPE over the whole head, rotate_half, no biases) or lightning attention
("linear_attention"), each followed by a Mixtral mixture (softmax router, top k renormalised, SwiGLU
experts). The norms sit on the stream itself: each layer computes

    y = input_layernorm(x);            x = alpha_a * y + beta_a * attention(y)
    y = post_attention_layernorm(x);   x = alpha_m * y + beta_m * moe(y)

(the alpha/beta scalars per sublayer kind from config), then the final norm. A lightning layer
(H heads of dh, one RMSNorm over all H dh entries with eps 1e-6):

    q, k, v = silu(qkv_proj(y))                       qkv_proj's rows per head [q; k; v]
    o_t = sum_{s <= t} exp(-slope_h (t - s)) (q_t . k_s) v_s        per head h, no softmax, no RoPE
    out_proj(sigmoid(output_gate(y)) * norm(o))
    slope_h = (2^(-8/H))^(h+1) * (1 - i / (L - 1 + 1e-5) + 1e-5)       fixed by the head's index

Groups (each checked in transformers by the conformance tests and tests/test_minimax.py): the
full-attention layers' heads as Llama's (kv-group and query-head permutations, RoPE's rotary-pair
rotations and the QK scale, V/O rotations and scales, any invertible map per kv group for Q/K and V/O
when asked); the experts with their router rows, each expert's units and their scales; the stream's
permutations and sign flips (the stream itself passes every norm's gain, as BERT's post-LN: no rotation).
`Family.left_out` says what is not declared: the lightning layers keep no head permutation (each head's
decay slope is fixed by its index) and no map of Q/K or V/O but permutations of entries (SiLU acts on
every entry of q, k and v; the norm's gain, the gate's rows and out_proj's columns follow V's entries).

The decay buffers transformers saves with each lightning layer (slope_rate, query_decay, key_decay,
diagonal_decay: functions of the config) are read as leaves that no group moves, and written back as
read; the forward pass reads each layer's slopes from slope_rate.

Leaves (per layer i):
    layers/{i}/attention_norm/scale, mlp_norm/scale     input_layernorm, post_attention_layernorm
    layers/{i}/attention/{query,key,value,out}/kernel   the full-attention layers' q/k/v/o_proj
    layers/{i}/lightning/{query,key,value}/kernel (d, H dh)   qkv_proj's rows, split per head
    layers/{i}/lightning/gate/kernel, out/kernel, norm/scale (H dh,)   output_gate, out_proj, norm
    layers/{i}/lightning/{slope_rate,query_decay,key_decay,diagonal_decay}   the buffers
    layers/{i}/moe/router/kernel (d, E), moe/{gate,up}/kernel (E, d, f), moe/down/kernel (E, f, d)
    final_norm/scale; task head: lm (lm_head, untied by default)
"""

from __future__ import annotations

import dataclasses

import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry, Spec
from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema, Kind, check_number
from .deepseek import MIXTURE_RULES
from .family import (
    COPY,
    NO_READER,
    SPEC_RULES,
    STACKED_GATE_UP,
    STACKED_TRANSPOSE,
    TRANSPOSE,
    Convert,
    Family,
    Norm,
    Tensor,
    embedding,
    linear,
    norm,
)
from .llama._config import rope_parameters_of
from .llama._tensors import HEADS as LLAMA_HEADS

_L = r"layers/(?P<layer>\d+)"
LAYER_TYPES = ("full_attention", "linear_attention")
LIGHTNING_EPS = 1e-6  # MiniMaxLightningAttention's norm takes RMSNorm's default eps, not rms_norm_eps


def attention_layer(c, i: int) -> bool:
    return c.layer_types[i] == "full_attention"


def lightning_layer(c, i: int) -> bool:
    return c.layer_types[i] == "linear_attention"


def head_dim(c) -> int:
    """head_dim, or hidden_size / heads where it is null (as both attentions take it)."""
    return c.head_dim or c.hidden_size // c.num_attention_heads


def _q_width(c) -> int:
    return c.num_attention_heads * head_dim(c)


def _kv_width(c) -> int:
    return c.num_key_value_heads * head_dim(c)


def _experts(c) -> int:
    return c.num_local_experts


def head_geometry(c) -> HeadGeometry | None:
    """The full-attention layers' heads (None where every layer is a lightning one): GQA, RoPE on the whole head."""
    if "full_attention" not in c.layer_types:
        return None
    return HeadGeometry(c.num_attention_heads, c.num_key_value_heads, head_dim(c), rotary_dim=head_dim(c))


def inv_freq(c) -> np.ndarray:
    dim = head_dim(c)
    return (1.0 / (c.rope_parameters["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(np.float32)


def decays(c, i: int) -> tuple[np.ndarray, ...]:
    """Layer i's buffers as MiniMaxLightningAttention computes them (float32): slope_rate (H, 1, 1), query_decay and
    key_decay (H, block, 1), diagonal_decay (1, H, block, block)."""
    h, block = c.num_attention_heads, c.block_size
    base = 1 / (2 ** (8 / h))
    factor = 1 - i / (c.num_hidden_layers - 1 + 1e-5) + 1e-5
    slope = (np.float32(base) ** np.arange(1, h + 1, dtype=np.float32) * np.float32(factor)).astype(np.float32)[:, None, None]
    steps = np.arange(block, dtype=np.float32) + 1
    query = np.exp(-slope * steps[:, None])
    key = np.exp(-slope * (block - steps[:, None]))
    diff = (steps[:, None] - steps[None, :])[None, None]
    scaled = slope[None] * diff
    diagonal = np.exp(np.where(scaled >= 0, -scaled, -np.inf))
    return tuple(x.astype(np.float32) for x in (slope, query, key, diagonal))


BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
_BUFFER_SHAPES = {"slope_rate": ("num_attention_heads", 1, 1), "query_decay": ("num_attention_heads", "block_size", 1),
                  "key_decay": ("num_attention_heads", "block_size", 1), "diagonal_decay": (1, "num_attention_heads", "block_size", "block_size")}


# ---- conversions -----------------------------------------------------------------------------------

def _qkv_to_ours(a, c):
    """qkv_proj (3 H dh, d), each head's [q; k; v] rows -> our kernels (d, H dh) for q, k and v."""
    h, dh = c.num_attention_heads, head_dim(c)
    parts = a.reshape(h, 3, dh, a.shape[-1])
    return tuple(parts[:, j].reshape(h * dh, -1).T for j in range(3))


def _qkv_to_hf(t, c):
    h, dh = c.num_attention_heads, head_dim(c)
    return np.stack([x.T.reshape(h, dh, -1) for x in t], axis=1).reshape(3 * h * dh, -1)


QKV = Convert("minimax_lightning_qkv", _qkv_to_ours, _qkv_to_hf)


def _in(in_layer, tensors, stacked=None):
    return tuple(dataclasses.replace(t, in_layer=in_layer, stacked=stacked) for t in tensors)


_A, _AT, _LT = "layers.{i}.self_attn", "layers/{i}/attention", "layers/{i}/lightning"
_MOE_AT = "layers/{i}/moe"
_EXPERT = {"gate": (_experts, "hidden_size", "intermediate_size"), "up": (_experts, "hidden_size", "intermediate_size"),
           "down": (_experts, "intermediate_size", "hidden_size")}

_ATTENTION = (
    *linear(f"{_A}.q_proj", f"{_AT}/query", "hidden_size", _q_width, bias=False, reads=True),
    *linear(f"{_A}.k_proj", f"{_AT}/key", "hidden_size", _kv_width, bias=False, reads=True),
    *linear(f"{_A}.v_proj", f"{_AT}/value", "hidden_size", _kv_width, bias=False, reads=True),
    *linear(f"{_A}.o_proj", f"{_AT}/out", _q_width, "hidden_size", bias=False, writes=True),
)

_LIGHTNING = (
    Tensor(f"{_A}.qkv_proj.weight", tuple(f"{_LT}/{p}/kernel" for p in ("query", "key", "value")), (("hidden_size", _q_width),) * 3,
           (0, 0, 0), QKV),
    *linear(f"{_A}.output_gate", f"{_LT}/gate", "hidden_size", _q_width, bias=False, reads=True),
    *norm(f"{_A}.norm", f"{_LT}/norm", _q_width, bias=False, stream=False),
    *linear(f"{_A}.out_proj", f"{_LT}/out", _q_width, "hidden_size", bias=False, writes=True),
    *(Tensor(f"{_A}.{b}", (f"{_LT}/{b}",), (_BUFFER_SHAPES[b],), (None,), COPY) for b in BUFFERS),
)

_BLOCK = "layers.{i}.block_sparse_moe"
_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *_in(attention_layer, _ATTENTION),
    *_in(lightning_layer, _LIGHTNING),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm", bias=False),
    # one tensor per expert (w1 gate, w3 up, w2 down), as save_pretrained writes them (MiniMax-Text-01's names)
    *_in(None, (
        Tensor(f"{_BLOCK}.gate.weight", (f"{_MOE_AT}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE),
        *(Tensor(f"{_BLOCK}.experts.{{e}}.{w}.weight", (f"{_MOE_AT}/{proj}/kernel",), (_EXPERT[proj],), (2 if proj == "down" else 1,),
                 TRANSPOSE, experts=_experts) for w, proj in (("w1", "gate"), ("w3", "up"), ("w2", "down"))),
    ), stacked=False),
    # stacked, as transformers 5 holds them in memory
    *_in(None, (
        Tensor("layers.{i}.mlp.gate.weight", (f"{_MOE_AT}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE),
        Tensor("layers.{i}.mlp.experts.gate_up_proj", (f"{_MOE_AT}/gate/kernel", f"{_MOE_AT}/up/kernel"), (_EXPERT["gate"],) * 2, (1, 1),
               STACKED_GATE_UP),
        Tensor("layers.{i}.mlp.experts.down_proj", (f"{_MOE_AT}/down/kernel",), (_EXPERT["down"],), (2,), STACKED_TRANSPOSE),
    ), stacked=True),
)

# The lightning layers' leaves belong to no group (the module docstring); the stream's axes are the tensors'.
_RULES = (
    (rf"{_L}/lightning/(query|key|value|gate)/kernel", None),
    (rf"{_L}/lightning/out/kernel", None),
    (rf"{_L}/lightning/norm/scale", None),
    (rf"{_L}/lightning/({'|'.join(BUFFERS)})", None),
    *MIXTURE_RULES,
)

_NUMBER = Kind("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))


def _derive(values: dict, raw) -> None:
    """MiniMaxConfig.__post_init__: kv heads default to the heads, layer_types alternate full (even layers) and linear
    (odd); RoPE's default theta 1e6; the sizes checked."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    n = values["num_hidden_layers"]
    if values["layer_types"] is None:
        values["layer_types"] = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)]
    if len(values["layer_types"]) != n or set(values["layer_types"]) - set(LAYER_TYPES):
        raise InputError(f"layer_types={values['layer_types']!r}: expected {n} of {list(LAYER_TYPES)}")
    values["rope_parameters"] = rope_parameters_of(values, raw, default_theta=1000000.0)
    if values["rope_parameters"]["rope_type"] != "default":
        raise InputError(f"rope_type={values['rope_parameters']['rope_type']!r}: only MiniMax's default RoPE is run")
    heads, kv = values["num_attention_heads"], values["num_key_value_heads"]
    if kv < 1 or heads % kv:
        raise InputError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    dh = values["head_dim"] or values["hidden_size"] // heads
    if dh % 2:
        raise InputError(f"head_dim={dh}: RoPE needs an even head dimension")
    if values["block_size"] < 1:
        raise InputError(f"block_size={values['block_size']}: expected a positive int")
    if not 0 < values["num_experts_per_tok"] <= values["num_local_experts"]:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} of num_local_experts={values['num_local_experts']}: the "
                         "router picks at least 1 expert and no more than there are")
    for key in ("full_attn_alpha_factor", "full_attn_beta_factor", "linear_attn_alpha_factor", "linear_attn_beta_factor",
                "mlp_alpha_factor", "mlp_beta_factor"):
        check_number(key, values[key])


SCHEMA = ConfigSchema("minimax", "MiniMaxConfig", {
    "vocab_size": (INT, 32000), "hidden_size": (INT, 4096), "intermediate_size": (INT, 14336), "num_hidden_layers": (INT, 32),
    "num_attention_heads": (INT, 32), "num_key_value_heads": (INT.optional(), 8), "head_dim": (INT.optional(), None),
    "hidden_act": (STR, "silu"), "max_position_embeddings": (INT, 4096 * 32), "initializer_range": (FLOAT, 0.02),
    "rms_norm_eps": (FLOAT, 1e-5), "pad_token_id": (INT.optional(), None), "tie_word_embeddings": (BOOL, False),
    "sliding_window": (INT.optional(), None), "num_experts_per_tok": (INT, 2), "num_local_experts": (INT, 8),
    "rope_parameters": (DICT.optional(), None), "layer_types": (STRINGS.optional(), None), "block_size": (INT, 256),
    "full_attn_alpha_factor": (_NUMBER, 1), "full_attn_beta_factor": (_NUMBER, 1), "linear_attn_alpha_factor": (_NUMBER, 1),
    "linear_attn_beta_factor": (_NUMBER, 1), "mlp_alpha_factor": (_NUMBER, 1), "mlp_beta_factor": (_NUMBER, 1),
}, derive=_derive, aliases={"num_experts": "num_local_experts"}, consumed=("rope_scaling", "rope_theta"))


@dataclasses.dataclass(frozen=True)
class MiniMaxFamily(Family):
    """The record, with what the lightning layers leave out said."""

    def spec(self, config, layout=None) -> Spec:
        geometry = self.head_geometry(config)
        return Spec(self.rules + SPEC_RULES, heads={} if geometry is None else {"attn": geometry}, residual=self.residual_spec(config, layout))

    def left_out(self, config) -> tuple[str, ...]:
        if "linear_attention" not in config.layer_types:
            return ()
        return ("the lightning-attention layers' heads do not permute (each head's decay slope is fixed by its index: "
                "slope_h = base^(h+1)) and keep no map of Q/K or V/O but permutations of entries (SiLU acts on every entry of q, k "
                "and v): q and k's entries permuted alike within a head, and v's with the norm's gain, the gate's rows and "
                "out_proj's columns, keep the function but are not declared",)


MINIMAX = MiniMaxFamily(
    name="minimax",
    configs=(SCHEMA,),
    stems={"minimax": "MiniMax"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("norm", "final_norm", bias=False),
    heads=tuple(h for h in LLAMA_HEADS if h.name == "lm"),
    default_head="lm",
    # the stream itself passes every norm's gain (y = norm(x) is what the residual sum adds to): permutations and sign
    # flips, the gains following the permutation alone (no reader folds them)
    norm=Norm("rmsnorm", placement="post", folds=((r"layers/(\d+)/(attention|mlp)_norm/scale", NO_READER), (r"final_norm/scale", NO_READER))),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.minimax.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry,
    rules=_RULES,
    ignored=(),
    unsupported=(("sliding_window", "a sliding window on the full-attention layers, which the forward pass here does not run"),),
)
