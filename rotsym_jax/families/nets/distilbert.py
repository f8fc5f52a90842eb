"""The distilbert forward pass in Flax NNX; its record (tensors, config, heads) is `families/distilbert.py`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from . import heads
from .layers import MLP, Attention, LayerNorm, attention_bias, dense, embed, multi_head, run_layers

EPS = 1e-12


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, config.initializer_range
        self.word = embed(config.vocab_size, d, dtype=dtype, rngs=rngs, std=std)
        self.position = embed(config.max_position_embeddings, d, dtype=dtype, rngs=rngs, std=std)
        self.norm = LayerNorm(d, eps=EPS, dtype=dtype)

    def __call__(self, input_ids):
        t = input_ids.shape[1]
        return self.norm(self.word(input_ids) + self.position(jnp.arange(t))[None])


class EncoderLayer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.hidden_size, config.initializer_range
        self.attention = Attention(d, heads=multi_head(d, config.num_attention_heads), dtype=dtype, rngs=rngs, std=std)
        self.attention_norm = LayerNorm(d, eps=EPS, dtype=dtype)
        self.mlp = MLP(d, config.hidden_dim, act=config.activation, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = LayerNorm(d, eps=EPS, dtype=dtype)

    def __call__(self, x, bias):
        x = self.attention_norm(x + self.attention(x, bias))
        return self.mlp_norm(x + self.mlp(x))


class PreClassifier(nnx.Module):
    """DistilBERT's sequence classifier: pre_classifier, ReLU, classifier, on the first token."""

    def __init__(self, d: int, num_labels: int, *, dtype, rngs, std):
        self.pre_classifier = dense(d, d, bias=True, dtype=dtype, rngs=rngs, std=std)
        self.classifier = dense(d, num_labels, bias=True, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, hidden, **_) -> dict:
        return {"logits": self.classifier(jax.nn.relu(self.pre_classifier(hidden[:, 0])))}


class Encoder(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError("distilbert has no pooler: layout.pooler must be False")
        d, std, n = config.hidden_size, config.initializer_range, config.num_labels
        kw = dict(dtype=dtype, rngs=rngs, std=std)
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([EncoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        match layout.head:
            case None:
                self.head = None
            case "masked_lm":
                if not config.tie_word_embeddings:
                    raise InputError("tie_word_embeddings=False: an untied DistilBERT masked-LM decoder is not run here")
                self.head = heads.MaskedLM(d, config.vocab_size, act=config.activation, eps=EPS, tied=True, **kw)
            case "sequence_classification":
                self.head = PreClassifier(d, n, **kw)
            case "token_classification":
                self.head = heads.Linear("token_classifier", d, n, reads="tokens", **kw)
            case "question_answering":
                self.head = heads.Linear("qa_outputs", d, 2, reads="tokens", split=("start_logits", "end_logits"), **kw)
            case _:
                raise InputError(f"head {layout.head!r} has no forward pass")

    def __call__(self, input_ids, attention_mask=None):
        x = self.embeddings(input_ids)
        bias = attention_bias(attention_mask, input_ids.shape[1], causal=False)
        x = run_layers(self.layers, x, lambda i: (bias,))
        out = {"last_hidden_state": x}
        if self.head is not None:
            out.update(self.head(x, input_ids=input_ids, word=self.embeddings.word))
        return out
