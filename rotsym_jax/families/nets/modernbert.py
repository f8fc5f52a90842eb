"""The modernbert forward pass in Flax NNX; its record (tensors, config, heads) is `families/modernbert.py`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from ..llama import rope_inv_freq
from .layers import MLP, Attention, LayerNorm, activation, attention_bias, dense, embed, multi_head, rope_cos_sin, run_layers


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
        x = run_layers(self.layers, x, lambda i: (biases[self.types[i]], ropes[self.types[i]]))
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
