"""ModernBERT: a pre-LayerNorm encoder with RoPE, fused projections and local and global layers.

Leaves (d = hidden_size, f = intermediate_size, H = num_attention_heads, dh = d // H):
    embeddings/word/embedding        (vocab_size, d)     HF embeddings.tok_embeddings
    embeddings/norm/{scale,bias}     (d,)                HF embeddings.norm: its output is the stream
    layers/{i}/attention_norm/...    (d,)                HF layers.{i}.attn_norm (layer 0 has none)
    layers/{i}/attention/{query,key,value}/kernel (d, d)  HF attn.Wqkv rows [Q; K; V], split
    layers/{i}/attention/out/kernel  (d, d)              HF attn.Wo
    layers/{i}/mlp_norm/...          (d,)                HF mlp_norm
    layers/{i}/mlp/{gate,up}/kernel  (d, f)              HF mlp.Wi rows [gate (activated); up], split
    layers/{i}/mlp/down/kernel       (f, d)              HF mlp.Wo
    final_norm/...                   (d,)                HF final_norm
    (biases where attention_bias / mlp_bias / norm_bias / classifier_bias say so)
    task heads: masked_lm (head/transform, head/transform_norm: HF head.dense, head.norm; the
        decoder is the word embeddings, tied, head/bias its decoder.bias), sequence_classification
        (the prediction head, head/dense and head/norm, on the first token or the mean of the
        tokens, then head/classifier), token_classification and question_answering (the prediction
        head on every token, then head/classifier), multiple_choice (read and saved).
Full attention in the global layers (every global_attn_every_n_layers-th, from the first), a
bidirectional band of local_attention // 2 tokens in the others, each kind with its RoPE base.
Inputs: input_ids, attention_mask.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry
from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema
from .family import NO_READER, Family, Head, Norm, Tensor, embedding, linear, norm, split_rows, weight

LAYER_TYPES = ("full_attention", "sliding_attention")


def _norm_bias(config) -> bool:
    return config.norm_bias


def _norm(hf: str, ours: str, **kw) -> tuple[Tensor, ...]:
    """A LayerNorm whose bias the config may omit (norm_bias)."""
    scale, bias = norm(hf, ours, bias=True, **kw)
    return scale, dataclasses.replace(bias, when=_norm_bias)


def _not_first(config, i: int) -> bool:
    return i > 0


def _attention_bias(config) -> bool:
    return config.attention_bias


def _mlp_bias(config) -> bool:
    return config.mlp_bias


def _classifier_bias(config) -> bool:
    return config.classifier_bias


def _fused(hf: str, ours: tuple[str, ...], d_in, d_out, bias) -> tuple[Tensor, ...]:
    """A fused nn.Linear reading the stream (rows [A; B; ...]) split into our kernels and biases."""
    n, rows = len(ours), split_rows((d_out,) * len(ours))
    return (Tensor(f"{hf}.weight", tuple(f"{o}/kernel" for o in ours), ((d_in, d_out),) * n, (0,) * n, rows),
            Tensor(f"{hf}.bias", tuple(f"{o}/bias" for o in ours), ((d_out,),) * n, (None,) * n, rows, bias))


_L = "layers.{i}"
_A = "layers/{i}/attention"
_LAYER = (
    *(dataclasses.replace(t, in_layer=_not_first) for t in _norm(f"{_L}.attn_norm", "layers/{i}/attention_norm")),
    *_fused(f"{_L}.attn.Wqkv", (f"{_A}/query", f"{_A}/key", f"{_A}/value"), "hidden_size", "hidden_size", _attention_bias),
    *linear(f"{_L}.attn.Wo", f"{_A}/out", "hidden_size", "hidden_size", bias=_attention_bias, writes=True),
    *_norm(f"{_L}.mlp_norm", "layers/{i}/mlp_norm"),
    *_fused(f"{_L}.mlp.Wi", ("layers/{i}/mlp/gate", "layers/{i}/mlp/up"), "hidden_size", "intermediate_size", _mlp_bias),
    *linear(f"{_L}.mlp.Wo", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", bias=_mlp_bias, writes=True),
)


def _prediction_head(module: str, *, writes_stream: bool):
    """The prediction head's dense and norm: under the tied decoder (the masked LM) it writes the
    stream's space (leaves head/transform, head/transform_norm), before a classifier its own
    (head/dense, head/norm): one leaf name has one role on the stream in every head."""
    dense_leaf, norm_leaf = ("head/transform", "head/transform_norm") if writes_stream else ("head/dense", "head/norm")
    return (*linear(f"{module}.dense", dense_leaf, "hidden_size", "hidden_size", bias=_classifier_bias, reads=True, writes=writes_stream),
            *_norm(f"{module}.norm", norm_leaf, stream=writes_stream))


def _decoder_bias(config) -> bool:
    return config.decoder_bias


_CLASSIFIER = linear("classifier", "head/classifier", "hidden_size", "num_labels")  # reads the head's norm, not the stream
_HEADS = (
    Head("masked_lm", "ForMaskedLM", (*_prediction_head("head", writes_stream=True),
                                      *(dataclasses.replace(t, when=_decoder_bias) for t in weight("decoder.bias", "head/bias", ("vocab_size",)))),
         markers=("head.dense.weight",), tied=lambda config: {"decoder.weight": "embeddings/word/embedding"}, forward=True),
    Head("sequence_classification", "ForSequenceClassification", (*_prediction_head("head", writes_stream=False), *_CLASSIFIER), forward=True),
    Head("token_classification", "ForTokenClassification", (*_prediction_head("head", writes_stream=False), *_CLASSIFIER), forward=True),
    Head("question_answering", "ForQuestionAnswering", (*_prediction_head("head", writes_stream=False), *_CLASSIFIER), loss=False, forward=True),
    Head("multiple_choice", "ForMultipleChoice", (*_prediction_head("head", writes_stream=False), *linear("classifier", "head/classifier", "hidden_size", 1))),
)


def _head_geometry(config) -> HeadGeometry:
    """Multi-head attention, RoPE over each whole head."""
    heads, dh = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    return HeadGeometry(heads, heads, dh, rotary_dim=dh)


def _derive(values: dict, raw) -> None:
    """ModernBertConfig: layer_types from global_attn_every_n_layers (global first, then every n-th);
    RoPE parameters per layer type (global_rope_theta 160000, local_rope_theta 10000 by default)."""
    if values["layer_types"] is None:
        n = raw.get("global_attn_every_n_layers", 3)
        values["layer_types"] = ["sliding_attention" if i % n else "full_attention" for i in range(values["num_hidden_layers"])]
    unknown = sorted(set(values["layer_types"]) - set(LAYER_TYPES))
    if unknown:
        raise InputError(f"layer_types {unknown} are not supported; supported: {list(LAYER_TYPES)}")
    params = {t: dict(p) for t, p in (values["rope_parameters"] or {}).items()}
    for layer_type, key, theta in (("full_attention", "global_rope_theta", 160000.0), ("sliding_attention", "local_rope_theta", 10000.0)):
        p = params.setdefault(layer_type, {"rope_type": "default"})
        if raw.get("rope_scaling"):
            p.update(raw["rope_scaling"])
        p.setdefault("rope_theta", theta if raw.get(key) is None else raw[key])
        p.setdefault("rope_type", p.pop("type", "default"))
    values["rope_parameters"] = params


MODERNBERT = Family(
    name="modernbert",
    configs=(ConfigSchema("modernbert", "ModernBertConfig", {
        "vocab_size": (INT, 50368), "hidden_size": (INT, 768), "intermediate_size": (INT, 1152), "num_hidden_layers": (INT, 22),
        "num_attention_heads": (INT, 12), "hidden_activation": (STR, "gelu"), "max_position_embeddings": (INT, 8192),
        "initializer_range": (FLOAT, 0.02), "norm_eps": (FLOAT, 1e-5), "norm_bias": (BOOL, False), "pad_token_id": (INT.optional(), 50283),
        "attention_bias": (BOOL, False), "layer_types": (STRINGS.optional(), None), "rope_parameters": (DICT.optional(), None),
        "local_attention": (INT, 128), "mlp_bias": (BOOL, False), "decoder_bias": (BOOL, True), "classifier_pooling": (STR, "cls"),
        "classifier_bias": (BOOL, False), "classifier_activation": (STR, "gelu"), "tie_word_embeddings": (BOOL, True),
    }, derive=_derive, consumed=("global_attn_every_n_layers", "global_rope_theta", "local_rope_theta", "rope_scaling")),),
    stems={"modernbert": "ModernBert"},
    prefix="model.",
    marker="embeddings.tok_embeddings.weight",
    embeddings=(*embedding("embeddings.tok_embeddings.weight", "embeddings/word/embedding", "vocab_size"),
                *_norm("embeddings.norm", "embeddings/norm")),
    layer=_LAYER,
    final=_norm("final_norm", "final_norm"),
    heads=_HEADS,
    # Pre-LN, but the embedding norm's output is the stream itself (no reader to fold its gain into),
    # and a tied decoder reads the head's norm: a rotation needs those gains uniform.
    norm=Norm("layernorm", placement="pre", folds=(
        (r"layers/(\d+)/attention_norm/scale", r"layers/\1/attention/(query|key|value)/kernel"),
        (r"layers/(\d+)/mlp_norm/scale", r"layers/\1/mlp/(gate|up)/kernel"),
        (r"final_norm/scale", r"head/(transform|dense)/kernel"),
        (r"embeddings/norm/scale", NO_READER),
        (r"head/transform_norm/scale", NO_READER),
    )),
    build=lambda config, layout, dtype, rngs: rj.nets.modernbert.Encoder(config, layout, dtype, rngs=rngs),
    rotary="rotate_half",
    head_geometry=_head_geometry,
)
