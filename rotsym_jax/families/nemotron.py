"""Nemotron (Nemotron-4, Minitron 4B / 8B): a pre-norm decoder whose LayerNorms store their gain as
w and apply 1 + w (`NemotronLayerNorm1P`, with a bias), an MLP without a gate (down(relu2(up(x)))
by default), partial rotary embeddings (half of each head by default) and grouped-query attention.

Leaves (d = hidden_size, f = intermediate_size, H = heads, G = kv heads, dh = head_dim, else d // H):
    embeddings/word/embedding        (vocab_size, d)     model.embed_tokens
    layers/{i}/attention_norm/{scale,bias}   (d,)     input_layernorm (scale holds w: the gain is 1 + w)
    layers/{i}/attention/query/kernel (d, H dh), key, value (d, G dh), out (H dh, d);
        biases on all four with attention_bias                self_attn.{q,k,v,o}_proj
    layers/{i}/mlp_norm/{scale,bias}         (d,)     post_attention_layernorm
    layers/{i}/mlp/up/kernel (d, f), layers/{i}/mlp/down/kernel (f, d), biases with mlp_bias
    final_norm/{scale,bias}          (d,)     model.norm
    task heads (all run here):
        lm                       NemotronForCausalLM: lm_head/kernel (d, V) (the embedding where tied)
        sequence_classification  head/score (d, num_labels), no bias, on the last non-padding token
        token_classification     head/token_classifier (d, num_labels), HF score
        question_answering       head/qa_outputs (d, 2); its base model is `transformer.`
RoPE: rotate_half on the first dh * partial_rotary_factor entries of each head (0.5 by default).
Folding a gain moves 1 + w into its readers and leaves w = 0 (as Gemma's); the stream then takes
rotations fixing the ones vector (LayerNorm centres the width).
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from .config import BOOL, DICT, FLOAT, INT, STR, ConfigSchema, positive_ints
from .family import Family, Norm, attention_projections, embedding, linear, norm, pre_norm_folds
from .llama._config import head_geometry_of, kv_width, q_width, rope_parameters_of, sizes
from .llama._tensors import HEADS


def _attention_bias(config) -> bool:
    return config.attention_bias


def _mlp_bias(config) -> bool:
    return config.mlp_bias


_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm"),
    *attention_projections("layers.{i}.self_attn", "layers/{i}/attention", q_width, kv_width, bias=_attention_bias, out_bias=_attention_bias),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm"),
    *linear("layers.{i}.mlp.up_proj", "layers/{i}/mlp/up", "hidden_size", "intermediate_size", bias=_mlp_bias, reads=True),
    *linear("layers.{i}.mlp.down_proj", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", bias=_mlp_bias, writes=True),
)


# Llama's four heads; NemotronForQuestionAnswering names its base model `transformer.`
_HEADS = tuple(dataclasses.replace(h, prefixes={"nemotron": "transformer."}) if h.name == "question_answering" else h for h in HEADS)


def _derive(values: dict, raw) -> None:
    """NemotronConfig: head_dim hidden_size / heads unless given; partial_rotary_factor 0.5 unless
    given. num_key_value_heads has no default there: NemotronAttention divides by it."""
    if values["head_dim"] is None and positive_ints(values, "hidden_size", "num_attention_heads"):
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values["num_key_value_heads"] is None:
        raise InputError("num_key_value_heads is not set: NemotronConfig gives it no default and NemotronAttention divides by it "
                         "(transformers cannot build the model)")
    values["rope_parameters"] = rope_parameters_of(values, raw)
    values["rope_parameters"].setdefault("partial_rotary_factor", 0.5)


SCHEMA = ConfigSchema("nemotron", "NemotronConfig", {
    **sizes(256000, 6144, 24576, 32, 48), "head_dim": (INT.optional(), None), "num_key_value_heads": (INT.optional(), None),
    "hidden_act": (STR, "relu2"), "max_position_embeddings": (INT, 4096), "initializer_range": (FLOAT, 0.0134), "norm_eps": (FLOAT, 1e-5),
    "pad_token_id": (INT.optional(), None), "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None),
    "attention_bias": (BOOL, False), "mlp_bias": (BOOL, False),
}, derive=_derive, consumed=("rope_scaling", "rope_theta", "partial_rotary_factor"))


NEMOTRON = Family(
    name="nemotron",
    configs=(SCHEMA,),
    stems={"nemotron": "Nemotron"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("norm", "final_norm"),
    heads=_HEADS,
    default_head="lm",  # a tied *ForCausalLM stores no lm_head.weight
    norm=Norm("layernorm", placement="pre", gain="one_plus", folds=pre_norm_folds("up", r"(lm_head|head/(score|token_classifier|qa_outputs))")),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.phi.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry_of,
    ignored=(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq",),
)
