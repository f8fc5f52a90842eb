"""The T5 forward pass in Flax NNX; its record (tensors, config, heads, groups) is `families/t5.py`."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...errors import InputError
from ...spec import HeadGeometry
from ..family import Layout
from ..t5 import has_own_head, own_embeddings, per_layer_position_bias
from . import heads
from .bart import EosClassifier, required, shift_right
from .layers import MLP, Attention, RMSNorm, Scores, attention_bias, dense, embed, run_layers


def relative_buckets(q_len: int, k_len: int, *, bidirectional: bool, num_buckets: int, max_distance: int) -> np.ndarray:
    """T5's bucket of each (query, key) pair's relative position key - query (q_len, k_len): exact
    below half the buckets (of each direction), logarithmic beyond, the last bucket from
    max_distance on; in float32 as transformers computes it."""
    relative = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]
    buckets = np.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0) * num_buckets
        relative = np.abs(relative)
    else:
        relative = -np.minimum(relative, 0)
    max_exact = num_buckets // 2
    # (a position below max_exact takes its own bucket: its log, taken at 1 here, is not used)
    scaled = np.log(np.maximum(relative, 1).astype(np.float32) / np.float32(max_exact)) / np.float32(math.log(max_distance / max_exact))
    large = max_exact + (scaled * np.float32(num_buckets - max_exact)).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return buckets + np.where(relative < max_exact, relative, large)


class Layer(nnx.Module):
    """Pre-norm: self-attention, cross-attention (decoder), MLP, each reading its RMSNorm of the stream."""

    def __init__(self, config, cross: bool, dtype, rngs):
        d, eps, std = config.d_model, config.layer_norm_epsilon, config.initializer_factor * 0.05
        geometry = HeadGeometry(config.num_heads, config.num_heads, config.d_kv)
        kw = dict(heads=geometry, qkv_bias=False, out_bias=False, scores=Scores(1.0), dtype=dtype, rngs=rngs, std=std)
        self.attention = Attention(d, **kw)
        self.attention_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.cross_attention = Attention(d, **kw) if cross else None
        self.cross_attention_norm = RMSNorm(d, eps=eps, dtype=dtype) if cross else None
        self.mlp = MLP(d, config.d_ff, act=config.dense_act_fn, gated=config.is_gated_act, bias=False, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = RMSNorm(d, eps=eps, dtype=dtype)
        # umT5: the layer's own position bias table (buckets, H)
        own = per_layer_position_bias(config)
        self.position_bias = embed(config.relative_attention_num_buckets, config.num_heads, dtype=dtype, rngs=rngs, std=0.05) if own else None

    def __call__(self, x, bias, memory=None, memory_bias=None, buckets=None):
        if self.position_bias is not None:
            bias = bias + jnp.transpose(self.position_bias.embedding[...][buckets], (2, 0, 1))[None]
        x = x + self.attention(self.attention_norm(x), bias)
        if self.cross_attention is not None:
            x = x + self.cross_attention(self.cross_attention_norm(x), memory_bias, memory=memory)
        return x + self.mlp(self.mlp_norm(x))


class Stack(nnx.Module):
    def __init__(self, config, stack: str, dtype, rngs):
        n = config.num_layers if stack == "encoder" else config.num_decoder_layers
        self.decoder = stack == "decoder"
        self.buckets, self.max_distance = config.relative_attention_num_buckets, config.relative_attention_max_distance
        self.layers = nnx.List([Layer(config, self.decoder, dtype, rngs) for _ in range(n)])
        self.final_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon, dtype=dtype)

    def __call__(self, x, mask, table, memory=None, memory_bias=None):
        """mask: the stack's attention mask (B, T) or None; table: its position bias (buckets, H), or None where each
        layer holds its own (umT5)."""
        t = x.shape[1]
        buckets = relative_buckets(t, t, bidirectional=not self.decoder, num_buckets=self.buckets, max_distance=self.max_distance)
        bias = attention_bias(mask, t, causal=self.decoder)
        if table is None:
            buckets = jnp.asarray(buckets)
            x = run_layers(self.layers, x, lambda i: (bias, memory, memory_bias, buckets))
            return self.final_norm(x)
        position = jnp.transpose(table[...][buckets], (2, 0, 1))[None]  # (1, H, T, T): every layer adds it
        bias = position + bias
        x = run_layers(self.layers, x, lambda i: (bias, memory, memory_bias))
        return self.final_norm(x)


class Embeddings(nnx.Module):
    """`shared` (word), each stack's position bias, and the stacks' own tables where the layout has
    them (`T5Layout`: transformers embeds with those, not `shared`)."""

    def __init__(self, config, layout: Layout, dtype, rngs):
        own = own_embeddings(layout)

        def table():
            return embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs, std=config.initializer_factor)

        self.word = table()
        self.encoder_word = table() if "encoder" in own else None
        self.decoder_word = table() if "decoder" in own else None
        shared = not per_layer_position_bias(config)  # umT5's tables are its layers'
        self.encoder_position_bias = embed(config.relative_attention_num_buckets, config.num_heads, dtype=dtype, rngs=rngs, std=0.05) if shared else None
        self.decoder_position_bias = embed(config.relative_attention_num_buckets, config.num_heads, dtype=dtype, rngs=rngs, std=0.05) if shared else None

    def position_bias(self, stack: str):
        """The table every layer of `stack` adds, or None (umT5: each layer its own)."""
        table = self.encoder_position_bias if stack == "encoder" else self.decoder_position_bias
        return None if table is None else table.embedding

    def of(self, stack: str):
        """The table `stack` embeds its input with: its own, else `shared`."""
        own = self.encoder_word if stack == "encoder" else self.decoder_word
        return self.word if own is None else own


class Seq2Seq(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError("t5 has no pooler: layout.pooler must be False")
        d = config.d_model
        self.pad_token_id, self.start_token_id = config.pad_token_id, config.decoder_start_token_id
        self.embeddings = Embeddings(config, layout, dtype, rngs)
        self.encoder = Stack(config, "encoder", dtype, rngs)
        self.decoder = Stack(config, "decoder", dtype, rngs)
        self.lm = layout.head == "lm"
        self.lm_scale = d ** -0.5 if config.scale_decoder_outputs else None
        self.lm_head = dense(d, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=0.05) if self.lm and has_own_head(config, layout) else None
        kw = dict(dtype=dtype, rngs=rngs, std=0.05)
        self.head = {
            None: lambda: None, "lm": lambda: None,
            "sequence_classification": lambda: EosClassifier(d, config.num_labels, config.eos_token_id, **kw),
            "question_answering": lambda: heads.Linear("qa_outputs", d, config.num_labels, reads="tokens", split=("start_logits", "end_logits"),
                                                       **kw),
        }[layout.head]()

    def __call__(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None):
        required(input_ids, "input_ids", "T5", "the encoder's token ids (the decoder's, when not given, are them shifted right)")
        if decoder_input_ids is None:
            if self.pad_token_id is None or self.start_token_id is None:
                raise InputError("decoder_input_ids are made from input_ids with pad_token_id and decoder_start_token_id, which the config lacks")
            decoder_input_ids = shift_right(input_ids, self.pad_token_id, self.start_token_id)
        e = self.embeddings
        word = e.word
        memory = self.encoder(e.of("encoder")(input_ids), attention_mask, e.position_bias("encoder"))
        t = decoder_input_ids.shape[1]
        x = self.decoder(e.of("decoder")(decoder_input_ids), decoder_attention_mask, e.position_bias("decoder"), memory,
                         attention_bias(attention_mask, t, causal=False))
        out = {"last_hidden_state": x, "encoder_last_hidden_state": memory}
        if self.lm:
            scaled = x if self.lm_scale is None else x * self.lm_scale
            out["logits"] = word.attend(scaled) if self.lm_head is None else self.lm_head(scaled)
        if self.head is not None:
            out.update(self.head(x, input_ids=input_ids))
        return out
