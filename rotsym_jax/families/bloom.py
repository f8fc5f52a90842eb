"""BLOOM (`bloom`): a pre-LayerNorm causal decoder without positions but ALiBi (a fixed slope per
head times the key's position, added to the scores), its word embeddings normed
(`word_embeddings_layernorm`) before the first layer, a fused `query_key_value` whose rows are
[H, (q, k, v), dh], a tanh-GELU MLP of width 4 d, biases everywhere, an LM head tied to the embeddings.

Leaves (d = hidden_size, H = n_head, dh = d / H):
    embeddings/word/embedding (vocab_size, d)        word_embeddings; also the tied LM head
    embeddings/norm/{scale,bias}                     word_embeddings_layernorm: its output is the stream
    layers/{i}/attention_norm/{scale,bias}           input_layernorm
    layers/{i}/attention/{query,key,value}/{kernel,bias}   self_attention.query_key_value, split per head
    layers/{i}/attention/out/{kernel,bias}           self_attention.dense
    layers/{i}/mlp_norm/{scale,bias}                 post_attention_layernorm
    layers/{i}/mlp/{up,down}/{kernel,bias}           mlp.dense_h_to_4h, mlp.dense_4h_to_h
    final_norm/{scale,bias}                          ln_f
    heads: GPT-Neo's (lm, sequence_classification, token_classification, question_answering).

Groups: ALiBi's slopes are indexed by head and no leaf holds them: a permutation of the heads would
move each head onto another slope, so the heads keep their order (`HeadGeometry.fixed_order`); each
head's QK and VO maps commute with a bias added to its scores. The stream: permutations, and rotations
fixing the ones vector only while `word_embeddings_layernorm`'s gain is uniform (its output is the
stream itself, as mBART's embedding norms). `apply_residual_connection_post_layernorm` is refused.
"""

from __future__ import annotations

import numpy as np

import rotsym_jax as rj

from ..spec import HeadGeometry
from .config import BOOL, FLOAT, INT, ConfigSchema
from .family import NO_READER, Convert, Family, Norm, Tensor, embedding, linear, norm, pre_norm_folds
from .gpt_neo import HEADS


def _heads(config) -> tuple[int, int]:
    return config.n_head, config.hidden_size // config.n_head


def _split_qkv(a: np.ndarray, config) -> tuple[np.ndarray, ...]:
    """HF's fused (3 d[, d]), rows [H, (q, k, v), dh] -> q, k, v (d[, d]), each transposed to (in, out)."""
    h, dh = _heads(config)
    rest = a.shape[1:]
    grouped = a.reshape((h, 3, dh) + rest)
    return tuple((x.T if x.ndim == 2 else x) for x in (grouped[:, j].reshape((h * dh,) + rest) for j in range(3)))


def _fuse_qkv(parts, config) -> np.ndarray:
    h, dh = _heads(config)
    q, k, v = (x.T if x.ndim == 2 else x for x in parts)
    rest = q.shape[1:]
    return np.stack([x.reshape((h, dh) + rest) for x in (q, k, v)], axis=1).reshape((3 * h * dh,) + rest)


QKV = Convert("bloom_qkv", _split_qkv, _fuse_qkv)
_QKV = tuple(f"layers/{{i}}/attention/{proj}" for proj in ("query", "key", "value"))
_D = "hidden_size"


def _inner(config) -> int:
    return 4 * config.hidden_size


_A = "h.{i}.self_attention"
_LAYER = (
    *norm("h.{i}.input_layernorm", "layers/{i}/attention_norm"),
    Tensor(f"{_A}.query_key_value.weight", tuple(f"{m}/kernel" for m in _QKV), ((_D, _D),) * 3, (0, 0, 0), QKV),
    Tensor(f"{_A}.query_key_value.bias", tuple(f"{m}/bias" for m in _QKV), ((_D,),) * 3, (None, None, None), QKV),
    *linear(f"{_A}.dense", "layers/{i}/attention/out", _D, _D, writes=True),
    *norm("h.{i}.post_attention_layernorm", "layers/{i}/mlp_norm"),
    *linear("h.{i}.mlp.dense_h_to_4h", "layers/{i}/mlp/up", _D, _inner, reads=True),
    *linear("h.{i}.mlp.dense_4h_to_h", "layers/{i}/mlp/down", _inner, _D, writes=True),
)


def head_geometry(config) -> HeadGeometry:
    h, dh = _heads(config)
    # ALiBi's slope of head j is fixed by j: the heads keep their order
    return HeadGeometry(h, h, dh, fixed_order=True)


SCHEMA = ConfigSchema("bloom", "BloomConfig", {
    "vocab_size": (INT, 250880), "hidden_size": (INT, 64), "n_layer": (INT, 2), "n_head": (INT, 8), "layer_norm_epsilon": (FLOAT, 1e-5),
    "initializer_range": (FLOAT, 0.02), "apply_residual_connection_post_layernorm": (BOOL, False), "pretraining_tp": (INT, 1),
    "slow_but_exact": (BOOL, False), "tie_word_embeddings": (BOOL, True), "pad_token_id": (INT.optional(), None),
}, aliases={"num_hidden_layers": "n_layer", "num_attention_heads": "n_head"})

BLOOM = Family(
    name="bloom",
    configs=(SCHEMA,),
    stems={"bloom": "Bloom"},
    prefix="transformer.",
    marker="word_embeddings.weight",
    embeddings=(*embedding("word_embeddings.weight", "embeddings/word/embedding", "vocab_size", _D),
                *norm("word_embeddings_layernorm", "embeddings/norm", _D)),
    layer=_LAYER,
    final=norm("ln_f", "final_norm", _D),
    heads=HEADS,
    default_head="lm",
    # each norm before a sublayer folds into its readers; the embedding norm's output is the stream itself
    norm=Norm("layernorm", placement="pre", folds=(*pre_norm_folds("up", r"(lm_head|head/(score|token_classifier|qa_outputs))"),
                                                   (r"embeddings/norm/scale", NO_READER))),
    num_layers="n_layer",
    head_geometry=head_geometry,
    build=lambda config, layout, dtype, rngs: rj.nets.bloom.BloomDecoder(config, layout, dtype, rngs=rngs),
    unsupported=(("apply_residual_connection_post_layernorm", "each sublayer's residual taken after its LayerNorm: the stream "
                  "is then a norm's output, which our layers do not run"),),
)
