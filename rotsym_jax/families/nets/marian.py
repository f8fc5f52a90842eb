"""The forward passes of Marian, Pegasus, Blenderbot and M2M100 in Flax NNX: BART's stacks
(nets/bart.py; pre-LN as mBART's but Marian's) reading token embeddings (scaled where
`scale_embedding`) plus positions: sinusoids (Marian's and Pegasus's, M2M100's fairseq ones over
the tokens that are not padding) or Blenderbot's learned table; their records are
`families/marian.py`, `families/pegasus.py` and `families/m2m_100.py`."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...errors import InputError
from ..family import Layout
from .bart import FinalLogitsBias, Stack
from .bart import Seq2Seq as BartSeq2Seq
from .layers import embed


def sinusoids(rows: int, d: int) -> np.ndarray:
    """MarianSinusoidalPositionalEmbedding's table: angle pos / 10000^(2 (j // 2) / d); the sines of
    the even columns' angles, then the cosines of the odd ones' (not interleaved)."""
    j = np.arange(d)
    angle = np.arange(rows)[:, None] / np.power(10000, 2 * (j // 2) / d)[None]
    return np.concatenate([np.sin(angle[:, 0::2]), np.cos(angle[:, 1::2])], axis=1)


def fairseq_sinusoids(positions, d: int, pad: int):
    """M2M100SinusoidalPositionalEmbedding's rows at `positions` (tensor2tensor's: the sines of
    half the width, then the cosines; a zero column where d is odd; the row of `pad` zero), in float32 as torch builds them."""
    half = d // 2
    freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(10000) / (half - 1)))
    angle = positions.astype(jnp.float32)[..., None] * freq
    out = jnp.concatenate([jnp.sin(angle), jnp.cos(angle)] + ([jnp.zeros_like(angle[..., :1])] if d % 2 else []), axis=-1)
    return jnp.where((positions == pad)[..., None], 0.0, out)


class Embeddings(nnx.Module):
    """The word embedding (shared, or the encoder's with the decoder's `decoder_word`)."""

    def __init__(self, config, saved_positions: bool, dtype, rngs):
        d, std = config.d_model, config.init_std
        self.word = embed(config.vocab_size, d, dtype=dtype, rngs=rngs, std=std)
        shared = getattr(config, "share_encoder_decoder_embeddings", True)  # Marian's: Pegasus's stacks share theirs
        self.decoder_word = None if shared else embed(config.decoder_vocab_size, d, dtype=dtype, rngs=rngs, std=std)
        self.scale = math.sqrt(d) if config.scale_embedding else 1.0
        self.rows, self.d = config.max_position_embeddings, d
        self.fairseq = config.model_type == "m2m_100"  # positions counted over the tokens that are not padding
        self.pad = config.pad_token_id
        if self.fairseq and self.pad is None:
            raise InputError("m2m_100: pad_token_id is None; M2M100's positions count from it (M2M100SinusoidalPositionalEmbedding)")
        # saved tables (Pegasus's and MarianModel's sinusoids, Blenderbot's learned positions); else a constant, not a parameter
        table = sinusoids(self.rows, d).astype(dtype)
        self.encoder_position = nnx.Embed(self.rows, d, dtype=dtype, param_dtype=dtype, rngs=rngs) if saved_positions else None
        self.decoder_position = nnx.Embed(self.rows, d, dtype=dtype, param_dtype=dtype, rngs=rngs) if saved_positions else None
        for position in (self.encoder_position, self.decoder_position):
            if position is not None:
                position.embedding = nnx.Param(jnp.asarray(table))

    def table(self, stack: str):
        return self.word if stack == "encoder" or self.decoder_word is None else self.decoder_word

    def __call__(self, ids, stack: str):
        if self.fairseq:  # its table grows with the inputs: no length limit
            real = (ids != self.pad).astype(jnp.int32)
            positions = jnp.cumsum(real, axis=1) * real + self.pad
            return self.table(stack)(ids) * self.scale + fairseq_sinusoids(positions, self.d, self.pad).astype(self.table(stack).embedding.dtype)
        if ids.shape[1] > self.rows:
            raise InputError(f"the {stack}'s inputs hold {ids.shape[1]} tokens; the model has {self.rows} positions (max_position_embeddings)")
        x = self.table(stack)(ids) * self.scale
        position = self.encoder_position if stack == "encoder" else self.decoder_position
        if position is not None:
            return x + position(jnp.arange(ids.shape[1]))[None]
        return x + jnp.asarray(sinusoids(ids.shape[1], self.d), x.dtype)[None]


class Seq2Seq(BartSeq2Seq):
    """BART's forward pass (`nets.bart.Seq2Seq.__call__`) over these embeddings, with the LM head below."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError(f"{config.model_type} has no pooler: layout.pooler must be False")
        self.pad_token_id, self.start_token_id, self.language_start = config.pad_token_id, config.decoder_start_token_id, False
        self.embeddings = Embeddings(config, config.model_type in ("pegasus", "blenderbot") or (config.model_type == "marian" and layout.head is None), dtype, rngs)
        self.encoder = Stack(config, "encoder", dtype, rngs)
        self.decoder = Stack(config, "decoder", dtype, rngs)
        self.lm, self.head = layout.head == "lm", None
        rows = config.vocab_size if getattr(config, "share_encoder_decoder_embeddings", True) else config.decoder_vocab_size
        self.lm_head = FinalLogitsBias(rows, dtype) if self.lm and config.model_type != "m2m_100" else None  # M2M100's LM head has no bias
        self.model_name = config.model_type

    def logits(self, x):
        """The decoder's word embedding as LM head, with final_logits_bias where it has one."""
        logits = self.embeddings.table("decoder").attend(x)
        return logits if self.lm_head is None else logits + self.lm_head.bias[...]
