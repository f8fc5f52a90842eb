"""GPT-Neo (`gpt_neo`): GPT-2's pre-LayerNorm decoder with learned positions and a tied LM head, its
attention torch `nn.Linear`s (q, k, v without bias, out_proj with one), scores not scaled by
1/sqrt(head_dim), and layers global or local (`attention_types`, expanded to `attention_layers`): a
local layer's query sees the `window_size` last keys.

Leaves (d = hidden_size, f = intermediate_size or 4 d):
    embeddings/word/embedding (vocab_size, d), embeddings/position/embedding (max_position_embeddings, d)
    layers/{i}/attention_norm/{scale,bias}                  ln_1
    layers/{i}/attention/{query,key,value}/kernel (d, d)    attn.attention.{q,k,v}_proj
    layers/{i}/attention/out/{kernel,bias}                  attn.attention.out_proj
    layers/{i}/mlp_norm/{scale,bias}                        ln_2
    layers/{i}/mlp/{up,down}/{kernel,bias}                  mlp.c_fc, mlp.c_proj (nn.Linear)
    final_norm/{scale,bias}                                 ln_f
    heads: lm (tied to wte unless tie_word_embeddings=False), sequence_classification (head/score, no
    bias, last token that is not padding), token_classification (head/token_classifier), question_answering.
Every group of GPT-2 holds: the window and the missing scale are the same for every head.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from .config import BOOL, FLOAT, INT, STR, ConfigSchema, Kind
from .family import Family, Head, Norm, embedding, linear, norm, pre_norm_folds


def _inner(config) -> int:
    return config.intermediate_size if config.intermediate_size is not None else 4 * config.hidden_size


_D = "hidden_size"
_LAYER = (
    *norm("h.{i}.ln_1", "layers/{i}/attention_norm", _D),
    *(t for proj, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"))
      for t in linear(f"h.{{i}}.attn.attention.{proj}", f"layers/{{i}}/attention/{ours}", _D, _D, bias=False, reads=True)),
    *linear("h.{i}.attn.attention.out_proj", "layers/{i}/attention/out", _D, _D, writes=True),
    *norm("h.{i}.ln_2", "layers/{i}/mlp_norm", _D),
    *linear("h.{i}.mlp.c_fc", "layers/{i}/mlp/up", _D, _inner, reads=True),
    *linear("h.{i}.mlp.c_proj", "layers/{i}/mlp/down", _inner, _D, writes=True),
)


def _untied(config) -> bool:
    return not config.tie_word_embeddings


def _lm_tied(config):
    return {"lm_head.weight": "embeddings/word/embedding"} if config.tie_word_embeddings else {}


_LM = tuple(dataclasses.replace(t, when=_untied) for t in linear("lm_head", "lm_head", _D, "vocab_size", bias=False, reads=True))
HEADS = (
    Head("lm", "ForCausalLM", _LM, markers=("lm_head.weight",), tied=_lm_tied, forward=True),
    Head("sequence_classification", "ForSequenceClassification", linear("score", "head/score", _D, "num_labels", bias=False, reads=True),
         markers=("score.weight",), forward=True),
    Head("token_classification", "ForTokenClassification", linear("classifier", "head/token_classifier", _D, "num_labels", reads=True),
         markers=("classifier.weight",), forward=True),
    Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", _D, 2, reads=True),
         markers=("qa_outputs.weight",), loss=False, forward=True),
)

_TYPES = ("global", "local")
ATTENTION_TYPES = Kind("a list of [[attention types], repeats] pairs",
                       lambda v: isinstance(v, list) and all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], list)
                                                             and isinstance(x[1], int) and not isinstance(x[1], bool) for x in v))


def _derive(values: dict, raw) -> None:
    """GPTNeoConfig: `attention_layers` is always `attention_types` expanded (a stored one is
    replaced), one type per layer, each "global" or "local"."""
    types = values["attention_types"] if values["attention_types"] is not None else [[["global", "local"], 12]]
    values["attention_types"] = types
    values["attention_layers"] = [t for kinds, repeats in types for _ in range(repeats) for t in kinds]
    bad = sorted({t for t in values["attention_layers"]} - set(_TYPES))
    if bad:
        raise InputError(f"attention_types names {bad}: GPT-Neo's layers are {list(_TYPES)}")
    if len(values["attention_layers"]) != values["num_layers"]:
        raise InputError(f"attention_types expands to {len(values['attention_layers'])} layers, num_layers={values['num_layers']} "
                         "(transformers requires len(attention_layers) == num_layers)")


SCHEMA = ConfigSchema("gpt_neo", "GPTNeoConfig", {
    "vocab_size": (INT, 50257), "max_position_embeddings": (INT, 2048), "hidden_size": (INT, 2048), "num_layers": (INT, 24),
    "attention_types": (ATTENTION_TYPES.optional(), None), "num_heads": (INT, 16), "intermediate_size": (INT.optional(), None),
    "window_size": (INT, 256), "activation_function": (STR, "gelu_new"), "layer_norm_epsilon": (FLOAT, 1e-5),
    "initializer_range": (FLOAT, 0.02), "tie_word_embeddings": (BOOL, True), "pad_token_id": (INT.optional(), None),
}, derive=_derive, aliases={"num_attention_heads": "num_heads", "num_hidden_layers": "num_layers"}, consumed=("attention_layers",))

GPT_NEO = Family(
    name="gpt_neo",
    configs=(SCHEMA,),
    stems={"gpt_neo": "GPTNeo"},
    prefix="transformer.",
    marker="wte.weight",
    embeddings=embedding("wte.weight", "embeddings/word/embedding", "vocab_size", _D)
    + embedding("wpe.weight", "embeddings/position/embedding", "max_position_embeddings", _D),
    layer=_LAYER,
    final=norm("ln_f", "final_norm", _D),
    heads=HEADS,
    default_head="lm",
    norm=Norm("layernorm", placement="pre", folds=pre_norm_folds("up", r"(lm_head|head/(score|token_classifier|qa_outputs))")),
    num_layers="num_layers",
    build=lambda config, layout, dtype, rngs: rj.nets.gpt_neo.GPTNeoDecoder(config, layout, dtype, rngs=rngs),
    # the causal (and local) mask buffers older transformers versions saved with the weights
    ignored=(r"(transformer\.)?h\.\d+\.attn\.attention\.(bias|masked_bias)",),
)
