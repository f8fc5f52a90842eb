"""OPT (`opt`): a causal decoder with learned positions (offset 2), LayerNorms before each sublayer
(`do_layer_norm_before`, most sizes) or after each residual sum (OPT-350m), a ReLU FFN, biases
(`enable_bias`), and where `word_embed_proj_dim` != hidden_size (OPT-350m) a projection in from the
word embeddings and one out to them, both without bias.

Leaves (d = hidden_size, p = word_embed_proj_dim, f = ffn_dim):
    embeddings/word/embedding        (vocab_size, p)   embed_tokens; also the tied LM head
    embeddings/position/embedding    (max_position_embeddings + 2, d)   row position + 2
    project_in/kernel (p, d), project_out/kernel (d, p)   where p != d
    layers/{i}/attention_norm/{scale,bias}    self_attn_layer_norm
    layers/{i}/attention/{query,key,value,out}/{kernel,bias}
    layers/{i}/mlp_norm/{scale,bias}          final_layer_norm (the layer's, before or after fc1/fc2)
    layers/{i}/mlp/{up,down}/{kernel,bias}    fc1, fc2
    final_norm/{scale,bias}          decoder.final_layer_norm (pre-norm models without _remove_final_layer_norm)
    heads: lm (lm_head, tied to embed_tokens unless tie_word_embeddings=False), sequence_classification
    (head/score, no bias, on the last token that is not padding), question_answering (head/qa_outputs).
Positions are read from the attention mask as transformers reads them (cumsum(mask) - 1).

The stream: permutations only (LayerNorm). With p != d the word-embedding space is no group: the
embedding, the LM head and the task heads are off the stream, project_in writes it, project_out
reads it (`OPTFamily.residual_spec`).
"""

from __future__ import annotations

import dataclasses
import re

import rotsym_jax as rj

from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import Family, Head, Norm, embedding, linear, norm, pre_norm_folds, weight


def _projected(config) -> bool:
    return config.word_embed_proj_dim != config.hidden_size


def _bias(config) -> bool:
    return config.enable_bias


def _affine(config) -> bool:
    return config.layer_norm_elementwise_affine


def _final(config) -> bool:
    return config.do_layer_norm_before and not config._remove_final_layer_norm and config.layer_norm_elementwise_affine


def _with(tensors, when):
    return tuple(dataclasses.replace(t, when=when if t.when is None else (lambda c, a=t.when: a(c) and when(c))) for t in tensors)


_D = "hidden_size"
_LAYER = (
    *_with(norm("decoder.layers.{i}.self_attn_layer_norm", "layers/{i}/attention_norm", _D), _affine),
    *(t for proj, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"))
      for t in linear(f"decoder.layers.{{i}}.self_attn.{proj}", f"layers/{{i}}/attention/{ours}", _D, _D, bias=_bias, reads=True)),
    *linear("decoder.layers.{i}.self_attn.out_proj", "layers/{i}/attention/out", _D, _D, bias=_bias, writes=True),
    *_with(norm("decoder.layers.{i}.final_layer_norm", "layers/{i}/mlp_norm", _D), _affine),
    *linear("decoder.layers.{i}.fc1", "layers/{i}/mlp/up", _D, "ffn_dim", bias=_bias, reads=True),
    *linear("decoder.layers.{i}.fc2", "layers/{i}/mlp/down", "ffn_dim", _D, bias=_bias, writes=True),
)
_EMBEDDINGS = (
    *embedding("decoder.embed_tokens.weight", "embeddings/word/embedding", "vocab_size", "word_embed_proj_dim"),
    *weight("decoder.embed_positions.weight", "embeddings/position/embedding", (lambda c: c.max_position_embeddings + 2, _D), stream=1),
    *_with(linear("decoder.project_in", "project_in", "word_embed_proj_dim", _D, bias=False, writes=True), _projected),
)
_FINAL = (
    *_with(norm("decoder.final_layer_norm", "final_norm", _D), _final),
    *_with(linear("decoder.project_out", "project_out", _D, "word_embed_proj_dim", bias=False, reads=True), _projected),
)


def _untied(config) -> bool:
    return not config.tie_word_embeddings


def _lm_tied(config):
    return {"lm_head.weight": "embeddings/word/embedding"} if config.tie_word_embeddings else {}


_P = "word_embed_proj_dim"
_HEADS = (
    Head("lm", "ForCausalLM", _with(linear("lm_head", "lm_head", _P, "vocab_size", bias=False, reads=True), _untied),
         markers=("lm_head.weight",), tied=_lm_tied, forward=True),
    Head("sequence_classification", "ForSequenceClassification", linear("score", "head/score", _P, "num_labels", bias=False, reads=True),
         markers=("score.weight",), forward=True),
    Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", _P, 2, reads=True),
         markers=("qa_outputs.weight",), loss=False, forward=True),
)
# The leaves of the word-embedding space: on the stream only where it is the stream (p = d).
_WORD_SPACE = ("embeddings/word/embedding", "lm_head/kernel", "head/score/kernel", "head/qa_outputs/kernel")
_PRE_FOLDS = pre_norm_folds("up", r"(lm_head|head/(score|qa_outputs))")


def _folds(config):
    if config is None or config.do_layer_norm_before:
        if config is not None and _projected(config):  # the final norm is read by project_out alone
            return _PRE_FOLDS[:2] + ((r"final_norm/scale", r"project_out/kernel"),)
        return _PRE_FOLDS
    return ()  # post-norm: each gain stays where it is and follows the stream's permutations


@dataclasses.dataclass(frozen=True)
class OPTFamily(Family):
    """OPT's record: the norms' placement is the config's (`do_layer_norm_before`), and with a
    projection the word-embedding space leaves the stream."""

    def residual_spec(self, config=None, layout=None):
        spec = super().residual_spec(config, layout)
        if config is None:
            return spec
        rules = spec.rules
        if _projected(config):
            off = {re.escape(p) for p in _WORD_SPACE}
            rules = tuple((p, None if p in off else axis) for p, axis in rules)
        return dataclasses.replace(spec, rules=rules, placement="pre" if config.do_layer_norm_before else "post")


SCHEMA = ConfigSchema("opt", "OPTConfig", {
    "vocab_size": (INT, 50272), "hidden_size": (INT, 768), "num_hidden_layers": (INT, 12), "ffn_dim": (INT, 3072),
    "max_position_embeddings": (INT, 2048), "do_layer_norm_before": (BOOL, True), "_remove_final_layer_norm": (BOOL, False),
    "word_embed_proj_dim": (INT.optional(), None), "num_attention_heads": (INT, 12), "activation_function": (STR, "relu"),
    "init_std": (FLOAT, 0.02), "enable_bias": (BOOL, True), "layer_norm_elementwise_affine": (BOOL, True),
    "tie_word_embeddings": (BOOL, True), "pad_token_id": (INT.optional(), 1),
}, derive=lambda values, raw: values.__setitem__("word_embed_proj_dim", values["word_embed_proj_dim"] or values["hidden_size"]))

OPT = OPTFamily(
    name="opt",
    configs=(SCHEMA,),
    stems={"opt": "OPT"},
    prefix="model.",
    marker="decoder.embed_tokens.weight",
    embeddings=_EMBEDDINGS,
    layer=_LAYER,
    final=_FINAL,
    heads=_HEADS,
    default_head="lm",
    norm=Norm("layernorm", placement="pre", folds=_folds),
    build=lambda config, layout, dtype, rngs: rj.nets.opt.OPTDecoder(config, layout, dtype, rngs=rngs),
    rules=((r"project_(?:in|out)/kernel", None),),  # no capture group: a rule's group names a layer
)
