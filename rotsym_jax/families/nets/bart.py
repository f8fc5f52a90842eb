"""The BART and mBART forward passes in Flax NNX, and the layers Whisper's shares with them; their
records (tensors, config, heads, groups) are `families/bart.py` and `families/whisper.py`."""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from . import heads
from .layers import MLP, Attention, LayerNorm, attention_bias, dense, embed, multi_head, run_layers

EPS = 1e-5  # torch nn.LayerNorm's default, which BART's norms keep
OFFSET = 2  # BartLearnedPositionalEmbedding looks position p up at row p + 2
PRE_LN = ("mbart", "whisper", "pegasus", "m2m_100", "blenderbot")  # each sublayer reads its norm of the stream; a final norm per stack


class Embeddings(nnx.Module):
    """The shared word embedding and each stack's positions and norm."""

    def __init__(self, config, dtype, rngs):
        d, std, rows = config.d_model, config.init_std, config.max_position_embeddings + OFFSET
        self.word = embed(config.vocab_size, d, dtype=dtype, rngs=rngs, std=std)
        self.encoder_position = embed(rows, d, dtype=dtype, rngs=rngs, std=std)
        self.encoder_norm = LayerNorm(d, eps=EPS, dtype=dtype)
        self.decoder_position = embed(rows, d, dtype=dtype, rngs=rngs, std=std)
        self.decoder_norm = LayerNorm(d, eps=EPS, dtype=dtype)
        self.scale = math.sqrt(d) if config.scale_embedding else 1.0

    def __call__(self, ids, stack: str):
        position, norm = (self.encoder_position, self.encoder_norm) if stack == "encoder" else (self.decoder_position, self.decoder_norm)
        rows = position.embedding.shape[0] - OFFSET
        if ids.shape[1] > rows:  # a lookup past the table's end would give NaN, silently
            raise InputError(f"the {stack}'s inputs hold {ids.shape[1]} tokens; the model has {rows} learned positions (max_position_embeddings)")
        positions = jnp.arange(ids.shape[1]) + OFFSET
        return norm(self.word(ids) * self.scale + position(positions)[None])


class Layer(nnx.Module):
    """Self-attention, cross-attention (decoder), MLP: each followed by its norm (BART, post-LN) or
    reading its norm of the stream (mBART, `pre`)."""

    def __init__(self, config, heads: int, ffn: int, cross: bool, pre: bool, dtype, rngs):
        self.pre = pre
        d, std = config.d_model, config.init_std
        kw = dict(heads=multi_head(d, heads), key_bias=config.model_type != "whisper", dtype=dtype, rngs=rngs, std=std)
        self.attention = Attention(d, **kw)
        self.attention_norm = LayerNorm(d, eps=EPS, dtype=dtype)
        self.cross_attention = Attention(d, **kw) if cross else None
        self.cross_attention_norm = LayerNorm(d, eps=EPS, dtype=dtype) if cross else None
        self.mlp = MLP(d, ffn, act=config.activation_function, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = LayerNorm(d, eps=EPS, dtype=dtype)

    def __call__(self, x, bias, memory=None, memory_bias=None):
        sublayers = [(self.attention_norm, lambda h: self.attention(h, bias))]
        if self.cross_attention is not None:
            sublayers.append((self.cross_attention_norm, lambda h: self.cross_attention(h, memory_bias, memory=memory)))
        sublayers.append((self.mlp_norm, self.mlp))
        for norm, sublayer in sublayers:
            x = x + sublayer(norm(x)) if self.pre else norm(x + sublayer(x))
        return x


class Stack(nnx.Module):
    """A stack's layers, and its final norm where the layers are pre-LN (mBART)."""

    def __init__(self, config, stack: str, dtype, rngs):
        n, heads, ffn = (getattr(config, f"{stack}_{k}") for k in ("layers", "attention_heads", "ffn_dim"))
        pre = config.model_type in PRE_LN
        self.layers = nnx.List([Layer(config, heads, ffn, stack == "decoder", pre, dtype, rngs) for _ in range(n)])
        self.final_norm = LayerNorm(config.d_model, eps=EPS, dtype=dtype) if pre else None

    def __call__(self, x, bias, memory=None, memory_bias=None):
        x = run_layers(self.layers, x, lambda i: (bias, memory, memory_bias))
        return x if self.final_norm is None else self.final_norm(x)


class FinalLogitsBias(nnx.Module):
    """BartForConditionalGeneration's final_logits_bias (1, V): leaf `lm_head/bias`."""

    def __init__(self, vocab: int, dtype):
        self.bias = nnx.Param(jnp.zeros((1, vocab), dtype))


class EosClassifier(nnx.Module):
    """BART's classification head: dense, tanh, out_proj on the decoder's state at each example's
    last eos token (leaves `dense`, `out_proj`)."""

    def __init__(self, d: int, num_labels: int, eos_token_id: int, *, dtype, rngs, std):
        self.eos_token_id = eos_token_id
        self.dense = dense(d, d, bias=True, dtype=dtype, rngs=rngs, std=std)
        self.out_proj = dense(d, num_labels, bias=True, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, hidden, *, input_ids, **_) -> dict:
        t = hidden.shape[1]
        last = jnp.argmax(jnp.arange(t) * (input_ids == self.eos_token_id), axis=-1)
        x = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return {"logits": self.out_proj(jnp.tanh(self.dense(x)))}


def required(value, key: str, model: str, reads: str):
    """`value`, or InputError naming the missing input `key` (a batch without it reached the model
    as a None: Python's own message, a TypeError, named no model and no remedy)."""
    if value is None:
        raise InputError(f"the inputs lack {key}: {model} reads {reads}; give {key} (an .npz of data holds it as an array of that name)")
    return value


def shift_right(input_ids, pad_token_id: int, start_token_id: int | None):
    """The decoder's inputs when none are given: input_ids shifted one right after the start token
    (BART: decoder_start_token_id; mBART, None here: each example's last token that is not padding,
    its language id)."""
    ids = jnp.where(input_ids == -100, pad_token_id, input_ids)
    if start_token_id is None:
        last = jnp.sum(ids != pad_token_id, axis=1) - 1
        start = jnp.take_along_axis(ids, last[:, None], axis=1)
    else:
        start = jnp.full((ids.shape[0], 1), start_token_id, ids.dtype)
    return jnp.concatenate([start, ids[:, :-1]], axis=1)


class Seq2Seq(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError("bart has no pooler: layout.pooler must be False")
        d, std = config.d_model, config.init_std
        self.pad_token_id, self.start_token_id = config.pad_token_id, config.decoder_start_token_id
        self.language_start = config.model_type in ("mbart", "plbart")  # the decoder starts from the language id
        self.model_name = "mBART" if self.language_start else "BART"  # what a missing input's refusal names (`required`)
        self.embeddings = Embeddings(config, dtype, rngs)
        self.encoder = Stack(config, "encoder", dtype, rngs)
        self.decoder = Stack(config, "decoder", dtype, rngs)
        self.lm = layout.head == "lm"
        self.lm_head = FinalLogitsBias(config.vocab_size, dtype) if self.lm else None
        kw = dict(dtype=dtype, rngs=rngs, std=std)
        self.head = {
            None: lambda: None, "lm": lambda: None,
            "sequence_classification": lambda: EosClassifier(d, config.num_labels, config.eos_token_id, **kw),
            "question_answering": lambda: heads.Linear("qa_outputs", d, 2, reads="tokens", split=("start_logits", "end_logits"), **kw),
        }[layout.head]()

    def logits(self, x):
        """The LM head: the tied word embedding and final_logits_bias."""
        return self.embeddings.word.attend(x) + self.lm_head.bias[...]

    def __call__(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None):
        required(input_ids, "input_ids", self.model_name, "the encoder's token ids (the decoder's, when not given, are them shifted right)")
        if decoder_input_ids is None:
            if self.pad_token_id is None or (self.start_token_id is None and not self.language_start):
                raise InputError("decoder_input_ids are made from input_ids with pad_token_id and decoder_start_token_id, which the config lacks")
            decoder_input_ids = shift_right(input_ids, self.pad_token_id, None if self.language_start else self.start_token_id)
        t = decoder_input_ids.shape[1]
        memory = self.encoder(self.embeddings(input_ids, "encoder"), attention_bias(attention_mask, input_ids.shape[1], causal=False))
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        x = self.decoder(self.embeddings(decoder_input_ids, "decoder"), attention_bias(decoder_attention_mask, t, causal=True),
                         memory, attention_bias(attention_mask, t, causal=False))
        out = {"last_hidden_state": x, "encoder_last_hidden_state": memory}
        if self.lm:
            out["logits"] = self.logits(x)
        if self.head is not None:
            out.update(self.head(x, input_ids=input_ids))
        return out
