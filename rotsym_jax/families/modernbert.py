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

import jax.numpy as jnp
from flax import nnx

from ..errors import InputError
from ..spec import HeadGeometry
from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema
from .family import NO_READER, Family, Head, Layout, Norm, Tensor, embedding, linear, norm, split_rows, weight
from .layers import MLP, Attention, LayerNorm, activation, attention_bias, dense, embed, multi_head, rope_cos_sin
from .llama import rope_inv_freq

_LAYER_TYPES = ("full_attention", "sliding_attention")


def _inv_freq(config, layer_type: str) -> tuple[float, ...]:
    """The RoPE frequencies of a layer type's own parameters (`llama.rope_inv_freq`)."""
    return tuple(float(f) for f in rope_inv_freq(config, config.rope_parameters[layer_type]))


class TaskHead(nnx.Module):
    """HF ModernBertPredictionHead (dense, activation, LayerNorm), then a `classifier`, or for the
    masked LM the tied decoder's `bias`. Its dense and norm are `transform`, `transform_norm` in
    the masked LM, whose tied decoder reads the norm in the stream's space, and `dense`, `norm` in
    the classifiers, whose norm is their own space (one leaf name, one role on the stream)."""

    def __init__(self, config, *, classifier: bool, dtype, rngs, std):
        d = config.hidden_size
        self.act = activation(config.classifier_activation)
        self.names = ("dense", "norm") if classifier else ("transform", "transform_norm")
        setattr(self, self.names[0], dense(d, d, bias=config.classifier_bias, dtype=dtype, rngs=rngs, std=std))
        setattr(self, self.names[1], LayerNorm(d, eps=config.norm_eps, dtype=dtype, bias=config.norm_bias))
        self.classifier = dense(d, config.num_labels, bias=True, dtype=dtype, rngs=rngs, std=std) if classifier else None
        self.bias = nnx.Param(jnp.zeros((config.vocab_size,), dtype)) if not classifier and config.decoder_bias else None

    def __call__(self, x, word=None):
        x = getattr(self, self.names[1])(self.act(getattr(self, self.names[0])(x)))
        if self.classifier is not None:
            return self.classifier(x)
        logits = word.attend(x)
        return logits if self.bias is None else logits + self.bias[...]


class Layer(nnx.Module):
    def __init__(self, config, first: bool, dtype, rngs):
        d, std, eps, nb = config.hidden_size, config.initializer_range, config.norm_eps, config.norm_bias
        self.attention_norm = None if first else LayerNorm(d, eps=eps, dtype=dtype, bias=nb)
        self.attention = Attention(d, heads=multi_head(d, config.num_attention_heads), qkv_bias=config.attention_bias, out_bias=config.attention_bias,
                                   dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = LayerNorm(d, eps=eps, dtype=dtype, bias=nb)
        self.mlp = MLP(d, config.intermediate_size, act=config.hidden_activation, gated=True, bias=config.mlp_bias, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias, rope):
        h = x if self.attention_norm is None else self.attention_norm(x)
        x = x + self.attention(h, bias, rope)
        return x + self.mlp(self.mlp_norm(x))


class Encoder(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError("modernbert has no pooler: layout.pooler must be False")
        d, std = config.hidden_size, config.initializer_range
        self.types = tuple(config.layer_types[: config.num_hidden_layers])
        self.inv_freqs = tuple((t, _inv_freq(config, t)) for t in sorted(set(self.types)))  # hashable: part of the graph
        self.band = config.local_attention // 2
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([Layer(config, i == 0, dtype, rngs) for i in range(config.num_hidden_layers)])
        self.final_norm = LayerNorm(d, eps=config.norm_eps, dtype=dtype, bias=config.norm_bias)
        self.pooling, self.kind = config.classifier_pooling, layout.head
        if layout.head == "masked_lm" and not config.tie_word_embeddings:
            raise InputError("tie_word_embeddings=False: an untied ModernBERT decoder is not run here")
        if layout.head not in (None, "masked_lm", "sequence_classification", "token_classification", "question_answering"):
            raise InputError(f"head {layout.head!r} has no forward pass")
        self.head = None if layout.head is None else TaskHead(config, classifier=layout.head != "masked_lm", dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None):
        b, t = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        ropes = {k: rope_cos_sin(f, positions) for k, f in self.inv_freqs}
        biases = {"full_attention": attention_bias(attention_mask, t, causal=False),
                  "sliding_attention": attention_bias(attention_mask, t, causal=False, band=self.band)}
        x = self.embeddings(input_ids)
        for layer, kind in zip(self.layers, self.types):
            x = layer(x, biases[kind], ropes[kind])
        x = self.final_norm(x)
        out = {"last_hidden_state": x}
        if self.kind == "masked_lm":
            out["logits"] = self.head(x, self.embeddings.word)
        elif self.kind == "sequence_classification":
            if self.pooling == "cls":
                pooled = x[:, 0]
            else:
                mask = jnp.ones((b, t), x.dtype) if attention_mask is None else attention_mask.astype(x.dtype)
                pooled = jnp.sum(x * mask[..., None], axis=1) / jnp.sum(mask, axis=1, keepdims=True)
            out["logits"] = self.head(pooled)
        elif self.kind == "token_classification":
            out["logits"] = self.head(x)
        elif self.kind == "question_answering":
            logits = self.head(x)
            out["start_logits"], out["end_logits"] = logits[..., 0], logits[..., 1]
        return out


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        self.word = embed(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs, std=config.initializer_range)
        self.norm = LayerNorm(config.hidden_size, eps=config.norm_eps, dtype=dtype, bias=config.norm_bias)

    def __call__(self, input_ids):
        return self.norm(self.word(input_ids))


# ---- the record -----------------------------------------------------------------------------------

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
    unknown = sorted(set(values["layer_types"]) - set(_LAYER_TYPES))
    if unknown:
        raise InputError(f"layer_types {unknown} are not supported; supported: {list(_LAYER_TYPES)}")
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
    build=lambda config, layout, dtype, rngs: Encoder(config, layout, dtype, rngs=rngs),
    rotary="rotate_half",
    head_geometry=_head_geometry,
)
