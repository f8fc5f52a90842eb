"""GPTBigCode (StarCoder 1, SantaCoder): GPT-2's pre-LayerNorm decoder with learned positions and
an LM head tied to the token embedding by default, its projections torch nn.Linear (not GPT-2's
Conv1D), and multi-query attention (`multi_query`, the default: one key and one value head) or
multi-head.

Its fused `c_attn` is Falcon's layout at kv heads G (1 with multi_query, else n_head): output rows
[G, (H/G queries, k, v), dh], that is [q (d) | k (dh) | v (dh)] multi-query and [H, (q, k, v), dh]
multi-head (transformers views it (H, 3 dh) and splits each head's three): the loader splits it
into our query, key and value (`falcon.QKV`), the saver fuses them back.

Leaves (d = n_embd, f = n_inner or 4 d, H = n_head, G = kv heads, dh = d // H):
    embeddings/word/embedding        (vocab_size, d)     transformer.wte
    embeddings/position/embedding    (n_positions, d)    transformer.wpe
    layers/{i}/attention_norm/{scale,bias}   (d,)   ln_1
    layers/{i}/attention/query/kernel (d, H dh), key, value (d, G dh), each with a bias   attn.c_attn
    layers/{i}/attention/out/kernel  (H dh, d), .../bias (d,)   attn.c_proj
    layers/{i}/mlp_norm/{scale,bias}         (d,)   ln_2
    layers/{i}/mlp/up/kernel (d, f), .../bias (f,)       mlp.c_fc
    layers/{i}/mlp/down/kernel (f, d), .../bias (d,)     mlp.c_proj
    final_norm/{scale,bias}          (d,)   ln_f
    task heads (all run here):
        lm                       GPTBigCodeForCausalLM: lm_head/kernel (d, V), no bias (wte where tied, the default)
        sequence_classification  head/score (d, num_labels), no bias, on the last non-padding token
        token_classification     head/token_classifier (d, num_labels), HF classifier
add_cross_attention (a cross-attention per layer, which transformers builds for multi-head only)
is refused on load. The dropouts do not act at inference; attention_softmax_in_fp32 changes
nothing in float32.
"""

from __future__ import annotations

import dataclasses

from ..errors import InputError
from ..spec import HeadGeometry
from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .falcon import QKV
from .family import Head, Norm, Tensor, linear, norm, pre_norm_folds
from .gpt2 import GPT2


def _inner(config) -> int:
    return config.n_inner if config.n_inner is not None else 4 * config.n_embd


def _kv_width(config) -> int:
    return config.num_key_value_heads * (config.n_embd // config.n_head)


def head_geometry(config) -> HeadGeometry:
    """Multi-query (one kv head) or multi-head, no RoPE."""
    return HeadGeometry(config.n_head, config.num_key_value_heads, config.n_embd // config.n_head)


_QKV = tuple(f"layers/{{i}}/attention/{proj}" for proj in ("query", "key", "value"))
_LAYER = (
    *norm("h.{i}.ln_1", "layers/{i}/attention_norm", "n_embd"),
    Tensor("h.{i}.attn.c_attn.weight", tuple(f"{m}/kernel" for m in _QKV), (("n_embd", "n_embd"), ("n_embd", _kv_width), ("n_embd", _kv_width)),
           (0, 0, 0), QKV),
    Tensor("h.{i}.attn.c_attn.bias", tuple(f"{m}/bias" for m in _QKV), (("n_embd",), (_kv_width,), (_kv_width,)), (None, None, None), QKV),
    *linear("h.{i}.attn.c_proj", "layers/{i}/attention/out", "n_embd", "n_embd", writes=True),
    *norm("h.{i}.ln_2", "layers/{i}/mlp_norm", "n_embd"),
    *linear("h.{i}.mlp.c_fc", "layers/{i}/mlp/up", "n_embd", _inner, reads=True),
    *linear("h.{i}.mlp.c_proj", "layers/{i}/mlp/down", _inner, "n_embd", writes=True),
)


def _untied(config) -> bool:
    return not config.tie_word_embeddings


def _lm_tied(config):
    return {"lm_head.weight": "embeddings/word/embedding"} if config.tie_word_embeddings else {}


_HEADS = (
    # The LM head merges like the body: not under head/.
    Head("lm", "ForCausalLM", tuple(dataclasses.replace(t, when=_untied) for t in linear("lm_head", "lm_head", "n_embd", "vocab_size", bias=False,
                                                                                        reads=True)),
         markers=("lm_head.weight",), tied=_lm_tied, forward=True),
    Head("sequence_classification", "ForSequenceClassification", linear("score", "head/score", "n_embd", "num_labels", bias=False, reads=True),
         markers=("score.weight",), forward=True),
    Head("token_classification", "ForTokenClassification", linear("classifier", "head/token_classifier", "n_embd", "num_labels", reads=True),
         markers=("classifier.weight",), forward=True),
)

_FOLDS = pre_norm_folds("up", r"(lm_head|head/(score|token_classifier))")


def _derive(values: dict, raw) -> None:
    """GPTBigCodeConfig: one kv head with multi_query, else n_head."""
    heads, d = values["n_head"], values["n_embd"]
    if heads > 0 and d % heads:
        raise InputError(f"n_embd={d} is not a multiple of n_head={heads}")
    values["num_key_value_heads"] = 1 if values["multi_query"] else heads


SCHEMA = ConfigSchema("gpt_bigcode", "GPTBigCodeConfig", {
    "vocab_size": (INT, 50257), "n_positions": (INT, 1024), "n_embd": (INT, 768), "n_layer": (INT, 12),
    "n_head": (INT, 12), "n_inner": (INT.optional(), None), "activation_function": (STR, "gelu_pytorch_tanh"),
    "layer_norm_epsilon": (FLOAT, 1e-5), "initializer_range": (FLOAT, 0.02), "scale_attn_weights": (BOOL, True),
    "multi_query": (BOOL, True), "add_cross_attention": (BOOL, False), "tie_word_embeddings": (BOOL, True),
    "pad_token_id": (INT.optional(), None),
}, derive=_derive, aliases={"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
                            "num_hidden_layers": "n_layer"}, consumed=("num_key_value_heads",))


# GPT-2's record (its embeddings, norms, forward pass) with its own attention and heads
GPT_BIGCODE = dataclasses.replace(
    GPT2,
    name="gpt_bigcode",
    configs=(SCHEMA,),
    stems={"gpt_bigcode": "GPTBigCode"},
    layer=_LAYER,
    heads=_HEADS,
    default_head="lm",  # a tied GPTBigCodeForCausalLM stores no lm_head.weight
    norm=Norm("layernorm", placement="pre", folds=_FOLDS),
    head_geometry=head_geometry,
    unsupported=(("add_cross_attention", "a cross-attention in every layer (an encoder-decoder's)"),),
)
