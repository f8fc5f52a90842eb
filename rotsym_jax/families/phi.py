"""Phi (Phi-1, Phi-1.5, Phi-2): a decoder whose attention and MLP read the same LayerNorm of the
stream and both add to it (a parallel layer with one norm), partial rotary embeddings, biases
everywhere, a GELU MLP and an LM head with a bias.

Leaves (d = hidden_size, f = intermediate_size, H = heads, G = kv heads, dh = d // H):
    embeddings/word/embedding        (vocab_size, d)     model.embed_tokens
    layers/{i}/attention_norm/{scale,bias}   (d,)     input_layernorm (read by attention and MLP)
    layers/{i}/attention/query/kernel (d, H dh), key, value (d, G dh), each with a bias
    layers/{i}/attention/out/kernel  (H dh, d), .../bias (d,)    self_attn.dense
    layers/{i}/mlp/up/kernel (d, f), .../bias (f,)      mlp.fc1
    layers/{i}/mlp/down/kernel (f, d), .../bias (d,)    mlp.fc2
    final_norm/{scale,bias}          (d,)     model.final_layernorm
    task heads (all run here):
        lm                       PhiForCausalLM: lm_head/kernel (d, V) and lm_head/bias (V,) (its kernel the
                                 embedding where tied)
        sequence_classification  head/score (d, num_labels), no bias, on the last non-padding token
        token_classification     head/token_classifier (d, num_labels), HF score
RoPE: rotate_half on the first dh * partial_rotary_factor entries of each head, as Llama's rope
types compute them. qk_layernorm (a LayerNorm with a bias on each head's q and k, which no rotation
of a head commutes with) is refused on load.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from .config import BOOL, DICT, FLOAT, INT, STR, ConfigSchema
from .family import Family, Head, Norm, embedding, linear, norm, pre_norm_folds
from .llama._config import head_geometry_of, resolve_layer_types, rope_parameters_of, sizes


def _q_width(config) -> int:
    return config.hidden_size


def kv_width(config) -> int:
    """The key and value projections' width (kv heads x head width), shared with StableLM."""
    return config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)


_A = "layers.{i}.self_attn"
_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm"),
    *linear(f"{_A}.q_proj", "layers/{i}/attention/query", "hidden_size", _q_width, reads=True),
    *linear(f"{_A}.k_proj", "layers/{i}/attention/key", "hidden_size", kv_width, reads=True),
    *linear(f"{_A}.v_proj", "layers/{i}/attention/value", "hidden_size", kv_width, reads=True),
    *linear(f"{_A}.dense", "layers/{i}/attention/out", _q_width, "hidden_size", writes=True),
    *linear("layers.{i}.mlp.fc1", "layers/{i}/mlp/up", "hidden_size", "intermediate_size", reads=True),
    *linear("layers.{i}.mlp.fc2", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", writes=True),
)


def untied(config) -> bool:
    return not config.tie_word_embeddings


def lm_tied(config):
    return {"lm_head.weight": "embeddings/word/embedding"} if config.tie_word_embeddings else {}


# The causal-LM head of the decoders whose lm_head has no bias (StableLM, StarCoder2, Cohere); it
# merges like the body (not under head/).
LM_HEAD = Head("lm", "ForCausalLM",
               tuple(dataclasses.replace(t, when=untied) for t in linear("lm_head", "lm_head", "hidden_size", "vocab_size", bias=False, reads=True)),
               markers=("lm_head.weight",), tied=lm_tied, forward=True)

# The classifiers transformers' generic heads add to Phi and StableLM alike.
CLASSIFIER_HEADS = (
    Head("sequence_classification", "ForSequenceClassification",
         linear("score", "head/score", "hidden_size", "num_labels", bias=False, reads=True), markers=("score.weight",), forward=True),
    Head("token_classification", "ForTokenClassification",
         linear("score", "head/token_classifier", "hidden_size", "num_labels", reads=True), markers=("score.bias",), forward=True),
)


_LM = linear("lm_head", "lm_head", "hidden_size", "vocab_size", reads=True)
_HEADS = (
    # The LM head merges like the body (not under head/); tied, its kernel is the embedding and its bias its own.
    Head("lm", "ForCausalLM", (dataclasses.replace(_LM[0], when=untied), _LM[1]), markers=("lm_head.bias",), tied=lm_tied, forward=True),
    *CLASSIFIER_HEADS,
)

# The one norm of a layer is read by Q/K/V and by the MLP's up projection.
_READERS = pre_norm_folds("up", r"(lm_head|head/(score|token_classifier))")
_FOLDS = ((_READERS[0][0], r"layers/\1/(attention/(query|key|value)|mlp/up)/kernel"), _READERS[2])


def _derive(values: dict, raw) -> None:
    """PhiConfig: num_key_value_heads defaults to the heads; partial_rotary_factor 0.5 unless given."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters_of(values, raw)
    values["rope_parameters"].setdefault("partial_rotary_factor", 0.5)
    resolve_layer_types(values, raw.get("layer_types"), supported=False)


SCHEMA = ConfigSchema("phi", "PhiConfig", {
    **sizes(51200, 2048, 8192, 24, 32), "num_key_value_heads": (INT.optional(), None), "hidden_act": (STR, "gelu_new"),
    "max_position_embeddings": (INT, 2048), "initializer_range": (FLOAT, 0.02), "layer_norm_eps": (FLOAT, 1e-5),
    "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None), "qk_layernorm": (BOOL, False),
    "pad_token_id": (INT.optional(), None),
}, derive=_derive, consumed=("rope_scaling", "rope_theta", "partial_rotary_factor"))


PHI = Family(
    name="phi",
    configs=(SCHEMA,),
    stems={"phi": "Phi"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("final_layernorm", "final_norm"),
    heads=_HEADS,
    norm=Norm("layernorm", placement="pre", folds=_FOLDS),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.phi.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry_of,
    unsupported=(("qk_layernorm", "a LayerNorm with a bias on each head's q and k, which no rotation of a head commutes with"),),
    ignored=(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq",),
)
