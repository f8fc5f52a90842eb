"""The Flax forward passes of the task heads that data flows through (barriers, Fisher and RegMean
statistics, OT fusion from activations). Each family's record (`Head`) says which of its heads run
here (`Head.forward`); the others are read, aligned, merged and saved from their tensors alone.

Every head module takes the base model's last hidden state (B, T, d) and, by keyword, what else
its class reads (`pooled`: the pooler's output; `input_ids`; `word`: the word-embedding table a
tied decoder reads), and returns a dict of outputs as transformers names them: "logits" (one
distribution over labels per example or token), or the class's own names where it gives several
(question answering: "start_logits", "end_logits", and no "logits"). Leaves are
named as the family records name them (`head/<attribute>/...`).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from .layers import LayerNorm, activation, dense

# A label that is not scored (transformers' convention: padding, the last position of a causal LM).
READS = ("pooled", "first", "tokens", "last")


class Linear(nnx.Module):
    """One dense layer on `reads`: the pooler's output ("pooled"), the first token ("first", a
    CLS token), every token ("tokens": token classification, question answering) or the last
    token that is not padding ("last": a decoder's sequence classification, as transformers picks
    it: the rightmost position whose input id is not `pad_token_id`, the last position when the
    config has none). Its leaves are `<attribute>/kernel` (and `bias`)."""

    def __init__(self, attribute: str, d_in: int, d_out: int, *, reads: str, bias: bool = True, pad_token_id=None,
                 split: tuple[str, ...] = (), dtype, rngs, std):
        if reads not in READS:
            raise InputError(f"reads={reads!r}; expected one of {READS}")
        self.attribute, self.reads, self.pad_token_id, self.split = attribute, reads, pad_token_id, split
        setattr(self, attribute, dense(d_in, d_out, bias=bias, dtype=dtype, rngs=rngs, std=std))

    def __call__(self, hidden, *, pooled=None, input_ids=None, word=None) -> dict:
        x = {"pooled": lambda: pooled, "first": lambda: hidden[:, 0], "tokens": lambda: hidden, "last": lambda: hidden}[self.reads]()
        logits = getattr(self, self.attribute)(x)
        if self.reads == "last":
            t = hidden.shape[1]
            if self.pad_token_id is None or input_ids is None:
                last = jnp.full((hidden.shape[0],), t - 1)
            else:
                last = jnp.argmax(jnp.arange(t) * (input_ids != self.pad_token_id), axis=-1)
            logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
        if self.split:  # outputs that are not one distribution (question answering's start and end): named apart
            return {name: logits[..., k] for k, name in enumerate(self.split)}
        return {"logits": logits}


def decoder_head(head: str | None, d: int, config, *, token_bias: bool = True, dtype, rngs, std) -> Linear | None:
    """The task head a causal decoder runs (GPT-2, GPT-NeoX, the Llama family), None for a bare
    model or an LM head (the decoder computes that one): sequence classification on the last
    token that is not padding (`head/score`, no bias), token classification (`head/token_classifier`)
    and question answering (`head/qa_outputs`: start and end logits)."""
    kw = dict(dtype=dtype, rngs=rngs, std=std)
    return {
        None: lambda: None, "lm": lambda: None,
        "sequence_classification": lambda: Linear("score", d, config.num_labels, reads="last", bias=False, pad_token_id=config.pad_token_id, **kw),
        "token_classification": lambda: Linear("token_classifier", d, config.num_labels, reads="tokens", bias=token_bias, **kw),
        "question_answering": lambda: Linear("qa_outputs", d, 2, reads="tokens", split=("start_logits", "end_logits"), **kw),
    }[head]()


def decoder_outputs(x, *, word, lm_head, lm: bool, head, input_ids) -> dict:
    """A causal decoder's outputs from its final hidden state `x`: the LM logits where it has an LM
    head (`lm_head`, or the word embedding `word` when tied) and its task head's."""
    out = {"last_hidden_state": x}
    if lm:
        out["logits"] = word.attend(x) if lm_head is None else lm_head(x)
    if head is not None:
        out.update(head(x, input_ids=input_ids))
    return out


class RobertaClassifier(nnx.Module):
    """RoBERTa's sequence classifier: dense, tanh, out_proj, on the first token (leaves `dense`,
    `out_proj`)."""

    def __init__(self, d: int, num_labels: int, *, dtype, rngs, std):
        self.dense = dense(d, d, bias=True, dtype=dtype, rngs=rngs, std=std)
        self.out_proj = dense(d, num_labels, bias=True, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, hidden, **_) -> dict:
        return {"logits": self.out_proj(jnp.tanh(self.dense(hidden[:, 0])))}


class MaskedLM(nnx.Module):
    """BERT's and RoBERTa's language-model head: `transform` (dense, `act`, `transform_norm`
    LayerNorm), then the decoder: tied, the word embeddings plus the output `bias` over the
    vocabulary; untied, its own `decoder` (kernel and bias: transformers then leaves `bias`
    unused, kept here so that it round-trips)."""

    def __init__(self, d: int, vocab: int, *, act: str, eps: float, tied: bool, dtype, rngs, std):
        self.act = activation(act)
        self.transform = dense(d, d, bias=True, dtype=dtype, rngs=rngs, std=std)
        self.transform_norm = LayerNorm(d, eps=eps, dtype=dtype)
        self.decoder = None if tied else dense(d, vocab, bias=True, dtype=dtype, rngs=rngs, std=std)
        self.bias = nnx.Param(jnp.zeros((vocab,), dtype))

    def __call__(self, hidden, *, word=None, **_) -> dict:
        x = self.transform_norm(self.act(self.transform(hidden)))
        return {"logits": word.attend(x) + self.bias[...] if self.decoder is None else self.decoder(x)}
