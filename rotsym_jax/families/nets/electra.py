"""The ELECTRA forward pass in Flax NNX; its record is `families/electra.py`. BERT's layers (`nets/bert.py`) behind
embeddings of their own width, projected to the stream where it differs."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..electra import projected
from ..family import Layout
from . import heads
from .bert import EncoderLayer
from .layers import LayerNorm, activation, attention_bias, dense, embed, run_layers


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        e, std = config.embedding_size, config.initializer_range
        self.word = embed(config.vocab_size, e, dtype=dtype, rngs=rngs, std=std)
        self.position = embed(config.max_position_embeddings, e, dtype=dtype, rngs=rngs, std=std)
        self.token_type = embed(config.type_vocab_size, e, dtype=dtype, rngs=rngs, std=std)
        self.norm = LayerNorm(e, eps=config.layer_norm_eps, dtype=dtype)
        self.project = dense(e, config.hidden_size, bias=True, dtype=dtype, rngs=rngs, std=std) if projected(config) else None  # E != d

    def __call__(self, input_ids, token_type_ids, position_ids):
        x = self.norm(self.word(input_ids) + self.token_type(token_type_ids) + self.position(position_ids))
        return x if self.project is None else self.project(x)


class Classifier(nnx.Module):
    """ElectraClassificationHead: dense, GELU, out_proj on the first token."""

    def __init__(self, d: int, num_labels: int, *, dtype, rngs, std):
        self.dense = dense(d, d, bias=True, dtype=dtype, rngs=rngs, std=std)
        self.out_proj = dense(d, num_labels, bias=True, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, hidden, **_) -> dict:
        return {"logits": self.out_proj(activation("gelu")(self.dense(hidden[:, 0])))}


class Discriminator(nnx.Module):
    """ElectraDiscriminatorPredictions: dense, hidden_act, one logit a token (B, T)."""

    def __init__(self, d: int, act: str, *, dtype, rngs, std):
        self.act = activation(act)
        self.dense = dense(d, d, bias=True, dtype=dtype, rngs=rngs, std=std)
        self.prediction = dense(d, 1, bias=True, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, hidden, **_) -> dict:
        return {"logits": self.prediction(self.act(self.dense(hidden)))[..., 0]}


class Generator(nnx.Module):
    """ElectraGeneratorPredictions and generator_lm_head: dense (d -> E), GELU, LayerNorm, then the word embeddings
    (tied) or a decoder of its own, plus `bias`."""

    def __init__(self, d: int, e: int, vocab: int, *, eps: float, tied: bool, dtype, rngs, std):
        self.suffix = "_e" if e != d else ""  # the record's leaves in the embedding space of its own (E != d)
        setattr(self, f"transform{self.suffix}", dense(d, e, bias=True, dtype=dtype, rngs=rngs, std=std))
        setattr(self, f"transform{self.suffix}_norm", LayerNorm(e, eps=eps, dtype=dtype))
        setattr(self, f"decoder{self.suffix}", None if tied else dense(e, vocab, bias=False, dtype=dtype, rngs=rngs, std=std))
        self.bias = nnx.Param(jnp.zeros((vocab,), dtype))

    def __call__(self, hidden, *, word=None, **_) -> dict:
        transform, norm, decoder = (getattr(self, f"{name}{self.suffix}{tail}") for name, tail in (("transform", ""), ("transform", "_norm"),
                                                                                                      ("decoder", "")))
        x = norm(activation("gelu")(transform(hidden)))
        return {"logits": (word.attend(x) if decoder is None else decoder(x)) + self.bias[...]}


class Encoder(nnx.Module):
    """ElectraModel and its heads (`layout.head`)."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError("electra has no pooler: layout.pooler must be False")
        d, std, n = config.hidden_size, config.initializer_range, config.num_labels
        # leaves under embedding_space/ where E != d (the record's `space`)
        self.embeddings = None if projected(config) else Embeddings(config, dtype, rngs)
        self.embedding_space = Embeddings(config, dtype, rngs) if projected(config) else None
        self.layers = nnx.List([EncoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        kw = dict(dtype=dtype, rngs=rngs, std=std)
        self.head = {
            None: lambda: None,
            "sequence_classification": lambda: Classifier(d, n, **kw),
            "pretraining": lambda: Discriminator(d, config.hidden_act, **kw),
            "masked_lm": lambda: Generator(d, config.embedding_size, config.vocab_size, eps=config.layer_norm_eps,
                                           tied=config.tie_word_embeddings, **kw),
            "token_classification": lambda: heads.Linear("token_classifier", d, n, reads="tokens", **kw),
            "question_answering": lambda: heads.Linear("qa_outputs", d, n, reads="tokens", split=("start_logits", "end_logits"), **kw),
        }[layout.head]()

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None):
        b, t = input_ids.shape
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        embeddings = self.embeddings if self.embedding_space is None else self.embedding_space
        x = embeddings(input_ids, token_type_ids, position_ids)
        bias = attention_bias(attention_mask, t, causal=False)
        x = run_layers(self.layers, x, lambda i: (bias,))
        out = {"last_hidden_state": x}
        if self.head is not None:
            out.update(self.head(x, input_ids=input_ids, word=embeddings.word))
        return out
