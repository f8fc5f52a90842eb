"""Falcon (Falcon-7B/40B/180B, Falcon 1B/RW): a pre-LayerNorm decoder whose attention reads one
fused `query_key_value` projection, RoPE over the whole head (rotate_half), a GELU MLP
(`dense_h_to_4h`, `dense_4h_to_h`), biases on every linear layer with `bias` (the norms keep
theirs), and an LM head without a bias, tied to the embedding by default.

Its three layouts of a layer:
    new_decoder_architecture (Falcon-40B/180B): grouped kv heads (`num_kv_heads`), attention and
        MLP in parallel, each reading its own norm (`ln_attn`, `ln_mlp`; num_ln_in_parallel_attn
        2, the default) or both one norm (`input_layernorm`; num_ln_in_parallel_attn 1);
    parallel_attn (Falcon-7B): attention and MLP read one `input_layernorm`, multi-query attention
        (`multi_query`, the default) or multi-head;
    sequential (parallel_attn False): `input_layernorm` before attention, `post_attention_layernorm`
        before the MLP.
query_key_value's output rows, in every layout, are grouped by kv head: [G, (H/G queries, k, v),
dh] (transformers' new-architecture split; multi-head is G = H, [H, (q, k, v), dh], and
multi-query G = 1, [q of every head | k | v]): the loader splits them into our query, key and
value, the saver fuses them back in that order.

Leaves (d = hidden_size, f = ffn_hidden_size, H = heads, G = kv heads, dh = d // H):
    embeddings/word/embedding        (vocab_size, d)     transformer.word_embeddings
    layers/{i}/attention_norm/{scale,bias}   (d,)   input_layernorm or ln_attn
    layers/{i}/attention/query/kernel (d, H dh), key, value (d, G dh), biases with `bias`
        HF h.{i}.self_attention.query_key_value ((H + 2G) dh, d), split per kv group
    layers/{i}/attention/out/kernel  (H dh, d), .../bias (d,) with `bias`   self_attention.dense
    layers/{i}/mlp_norm/{scale,bias}         (d,)   post_attention_layernorm or ln_mlp (absent
                                                    where one norm feeds both sublayers)
    layers/{i}/mlp/up/kernel (d, f), .../bias (f,) with `bias`      mlp.dense_h_to_4h
    layers/{i}/mlp/down/kernel (f, d), .../bias (d,) with `bias`    mlp.dense_4h_to_h
    final_norm/{scale,bias}          (d,)     transformer.ln_f
    task heads (all run here):
        lm                       FalconForCausalLM: lm_head/kernel (d, V), no bias (the embedding where tied)
        sequence_classification  head/score (d, num_labels), no bias, on the last non-padding token
        token_classification     head/token_classifier (d, num_labels), HF classifier
        question_answering       head/qa_outputs (d, 2): start and end logits
`alibi` (per-head position slopes added to the scores instead of RoPE, which fix the heads'
order: a permutation of the heads would pair each head with another's slope) is refused on load.
The dropouts do not act at inference.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from .config import BOOL, DICT, FLOAT, INT, STR, ConfigSchema
from .family import Convert, Family, Norm, Tensor, embedding, linear, norm, pre_norm_folds
from .gpt_neox import GENERIC_HEADS
from .llama._config import head_geometry_of, rope_parameters_of
from .phi import LM_HEAD


def head_dim_of(config) -> int:
    return config.hidden_size // config.num_attention_heads


def _groups(config) -> tuple[int, int, int]:
    """(kv heads G, queries per group H / G, head width dh)."""
    g = config.num_key_value_heads
    return g, config.num_attention_heads // g, head_dim_of(config)


def _split_qkv(a: np.ndarray, config) -> tuple[np.ndarray, ...]:
    """HF's fused ((H + 2G) dh[, d]), rows [G, (H/G queries, k, v), dh] -> q (H dh[, d]), k, v (G dh[, d])."""
    g, r, dh = _groups(config)
    rest = a.shape[1:]
    grouped = a.reshape((g, r + 2, dh) + rest)
    parts = (grouped[:, :r].reshape((g * r * dh,) + rest), grouped[:, r].reshape((g * dh,) + rest), grouped[:, r + 1].reshape((g * dh,) + rest))
    return tuple(x.T if x.ndim == 2 else x for x in parts)


def _fuse_qkv(parts, config) -> np.ndarray:
    g, r, dh = _groups(config)
    q, k, v = (x.T if x.ndim == 2 else x for x in parts)
    rest = q.shape[1:]
    grouped = np.concatenate([q.reshape((g, r, dh) + rest), k.reshape((g, 1, dh) + rest), v.reshape((g, 1, dh) + rest)], axis=1)
    return grouped.reshape((g * (r + 2) * dh,) + rest)


QKV = Convert("falcon_qkv", _split_qkv, _fuse_qkv)
_QKV = tuple(f"layers/{{i}}/attention/{proj}" for proj in ("query", "key", "value"))


def _kv_width(config) -> int:
    return config.num_key_value_heads * head_dim_of(config)


def _bias(config) -> bool:
    return config.bias


def parallel(config) -> bool:
    """Attention and MLP read the stream side by side (the new architecture always does)."""
    return config.new_decoder_architecture or config.parallel_attn


def two_norms(config) -> bool:
    """The new architecture's ln_attn and ln_mlp (num_ln_in_parallel_attn 2, or None: FalconDecoderLayer
    makes it 2)."""
    return config.new_decoder_architecture and config.num_ln_in_parallel_attn in (None, 2)


def one_norm(config) -> bool:
    """Attention and MLP read one input_layernorm."""
    return parallel(config) and not two_norms(config)


def _when(tensors, when):
    return tuple(dataclasses.replace(t, when=when) for t in tensors)


_A = "h.{i}.self_attention"
_LAYER = (
    *_when(norm("h.{i}.input_layernorm", "layers/{i}/attention_norm"), lambda c: not two_norms(c)),
    *_when(norm("h.{i}.ln_attn", "layers/{i}/attention_norm"), two_norms),
    Tensor(f"{_A}.query_key_value.weight", tuple(f"{m}/kernel" for m in _QKV),
           (("hidden_size", "hidden_size"), ("hidden_size", _kv_width), ("hidden_size", _kv_width)), (0, 0, 0), QKV),
    Tensor(f"{_A}.query_key_value.bias", tuple(f"{m}/bias" for m in _QKV), (("hidden_size",), (_kv_width,), (_kv_width,)),
           (None, None, None), QKV, _bias),
    *linear(f"{_A}.dense", "layers/{i}/attention/out", "hidden_size", "hidden_size", bias=_bias, writes=True),
    *_when(norm("h.{i}.post_attention_layernorm", "layers/{i}/mlp_norm"), lambda c: not parallel(c)),
    *_when(norm("h.{i}.ln_mlp", "layers/{i}/mlp_norm"), two_norms),
    *linear("h.{i}.mlp.dense_h_to_4h", "layers/{i}/mlp/up", "hidden_size", "ffn_hidden_size", bias=_bias, reads=True),
    *linear("h.{i}.mlp.dense_4h_to_h", "layers/{i}/mlp/down", "ffn_hidden_size", "hidden_size", bias=_bias, writes=True),
)


_HEADS = (
    LM_HEAD,
    *GENERIC_HEADS,
)

_TWO_NORM_FOLDS = pre_norm_folds("up", r"(lm_head|head/(score|token_classifier|qa_outputs))")
# One norm read by both sublayers folds into Q/K/V and the MLP's up projection.
_ONE_NORM_FOLDS = ((_TWO_NORM_FOLDS[0][0], r"layers/\1/(attention/(query|key|value)|mlp/up)/kernel"), _TWO_NORM_FOLDS[2])


def _folds(config):
    """The folds of `config`'s layers (without a config: the default, one norm)."""
    return _TWO_NORM_FOLDS if config is not None and not one_norm(config) else _ONE_NORM_FOLDS


def _derive(values: dict, raw) -> None:
    """FalconConfig: n_embed is the old name of hidden_size; num_kv_heads defaults to the heads, the
    kv heads attention uses are num_kv_heads in the new architecture or without multi_query, else
    1; ffn_hidden_size 4 d by default; head_dim d / H; RoPE parameters from the legacy rope_theta / rope_scaling.
    Refuses the combinations transformers builds but cannot run, or runs wrong."""
    if raw.get("n_embed") is not None:
        values["hidden_size"] = raw["n_embed"]
    heads, d = values["num_attention_heads"], values["hidden_size"]
    if heads > 0 and d % heads:
        raise InputError(f"hidden_size={d} is not a multiple of num_attention_heads={heads} (FalconAttention refuses it)")
    values["head_dim"] = d // heads if heads > 0 else 0  # FalconConfig.head_dim
    if values["num_kv_heads"] is None:
        values["num_kv_heads"] = heads
    new = values["new_decoder_architecture"]
    values["num_key_value_heads"] = values["num_kv_heads"] if (new or not values["multi_query"]) else 1
    g = values["num_key_value_heads"]
    if g <= 0 or heads <= 0 or heads % g:
        raise InputError(f"num_kv_heads={g} does not divide num_attention_heads={heads}")
    if not new and not values["multi_query"] and g != heads:
        raise InputError(f"num_kv_heads={g} with multi_query=False and new_decoder_architecture=False: query_key_value then holds "
                         f"{heads} keys, which transformers repeats as if there were {g} (its outputs are wrong or it fails)")
    if values["ffn_hidden_size"] is None:
        values["ffn_hidden_size"] = 4 * d
    if new and not values["parallel_attn"]:
        raise InputError("new_decoder_architecture=True with parallel_attn=False: FalconDecoderLayer builds the sequential layer's "
                         "norms and runs the new architecture's, and fails")
    if not new and values["parallel_attn"] and values["num_ln_in_parallel_attn"] == 2:
        raise InputError("num_ln_in_parallel_attn=2 without new_decoder_architecture: FalconDecoderLayer builds ln_attn and ln_mlp "
                         "and runs input_layernorm, and fails")
    if new and values["num_ln_in_parallel_attn"] not in (None, 1, 2):
        raise InputError(f"num_ln_in_parallel_attn={values['num_ln_in_parallel_attn']}: 1 or 2 norms a layer")
    values["rope_parameters"] = rope_parameters_of(values, raw)


SCHEMA = ConfigSchema("falcon", "FalconConfig", {
    "vocab_size": (INT, 65024), "hidden_size": (INT, 4544), "num_hidden_layers": (INT, 32), "num_attention_heads": (INT, 71),
    "num_ln_in_parallel_attn": (INT.optional(), None), "layer_norm_epsilon": (FLOAT, 1e-5), "initializer_range": (FLOAT, 0.02),
    "num_kv_heads": (INT.optional(), None), "alibi": (BOOL, False), "new_decoder_architecture": (BOOL, False),
    "multi_query": (BOOL, True), "parallel_attn": (BOOL, True), "bias": (BOOL, False), "max_position_embeddings": (INT, 2048),
    "rope_parameters": (DICT.optional(), None), "pad_token_id": (INT.optional(), None), "ffn_hidden_size": (INT.optional(), None),
    "activation": (STR, "gelu"), "tie_word_embeddings": (BOOL, True),
}, derive=_derive, consumed=("rope_scaling", "rope_theta", "partial_rotary_factor", "n_embed", "num_key_value_heads", "head_dim"))


FALCON = Family(
    name="falcon",
    configs=(SCHEMA,),
    stems={"falcon": "Falcon"},
    prefix="transformer.",
    marker="word_embeddings.weight",
    embeddings=embedding("word_embeddings.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("ln_f", "final_norm"),
    heads=_HEADS,
    default_head="lm",  # a tied FalconForCausalLM stores no lm_head.weight
    norm=Norm("layernorm", placement="pre", folds=_folds),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.phi.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry_of,
    unsupported=(("alibi", "per-head ALiBi slopes added to the scores in place of RoPE, which fix the heads' order (a permutation "
                           "of the heads pairs each head with another's slope)"),),
    ignored=(r"(transformer\.)?(h\.\d+\.self_attention\.)?rotary_emb\.inv_freq",),
)
