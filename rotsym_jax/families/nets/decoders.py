"""The decoder whose layers differ by type (attention beside convolutions, state spaces or linear
attention: LFM2, Granite-4's hybrid, Qwen3.5 / Qwen3-Next, MiniMax): token embeddings, one layer
per index as its family builds it, a final RMSNorm and an LM head where the config unties one.
Each family's layer is called as layer(x, bias, rope, attention_mask); its runs of alike layers
scan (`layers.run_layers`)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from . import heads
from .layers import RMSNorm, WordEmbeddings, attention_bias, dense, rope_cos_sin, run_layers


class HybridDecoder(nnx.Module):
    """`layer(config, i, dtype, rngs)` builds layer i; `inv_freq`: the rotary frequencies (None:
    no layer rotates); `tied`: whether the LM head reads the embedding; `eps`, `one_plus`: the
    final norm's; `embedding_scale`: a factor on the looked-up rows. Head None (the base model)
    or "lm"."""

    def __init__(self, config, layout: Layout, dtype, rngs: nnx.Rngs, *, layer, inv_freq, tied: bool, eps: float,
                 one_plus: bool = False, embedding_scale: float | None = None):
        if layout.pooler:
            raise InputError(f"{config.model_type} has no pooler: layout.pooler must be False")
        self.inv_freq = None if inv_freq is None else tuple(float(f) for f in inv_freq)  # static: part of the graph
        self.embeddings = WordEmbeddings(config, dtype, rngs, scale=embedding_scale)
        self.layers = nnx.List([layer(config, i, dtype, rngs) for i in range(config.num_hidden_layers)])
        self.final_norm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype, one_plus=one_plus)
        self.lm = layout.head == "lm"
        untied = self.lm and not tied
        self.lm_head = dense(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=config.initializer_range) if untied else None

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        rope = None if self.inv_freq is None else rope_cos_sin(self.inv_freq, position_ids)
        bias = attention_bias(attention_mask, t, causal=True)
        x = run_layers(self.layers, self.embeddings(input_ids), lambda i: (bias, rope, attention_mask))
        return heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=self.lm_head, lm=self.lm, head=None,
                                     input_ids=input_ids)
