"""The AFMoE forward pass in Flax NNX (its record: `families/afmoe.py`): gated grouped-query
attention with a per-head QK-norm, RoPE on the sliding-window layers alone, four RMSNorms a layer,
dense MLPs, then a sigmoid-routed mixture with its expert bias and shared experts."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from .. import afmoe
from ..family import Layout
from ..llama._config import is_tied, rope_inv_freq
from . import heads
from .deepseek import GroupLimitedMoE
from .layers import MLP, Attention, MoE, QKNorm, RMSNorm, WordEmbeddings, attention_bias, dense, rope_cos_sin, run_layers


class TokenChoiceMoE(GroupLimitedMoE):
    """AFMoE's router: DeepSeek-V3's sigmoid choice with its correction bias (`mlp.expert_bias`), no
    routing groups, the picked scores always normalised, times route_scale."""

    def __init__(self, config, *, dtype, rngs, std):
        MoE.__init__(self, config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
                     act=config.hidden_act, normalize=True, dtype=dtype, rngs=rngs, std=std)
        self.v2, self.groups, self.top_groups, self.scaling = False, 1, 1, config.route_scale
        self.score_correction = nnx.Param(jnp.zeros((config.num_experts,), jnp.float32))


class DecoderLayer(nnx.Module):
    def __init__(self, config, index, dtype, rngs):
        d, std, eps = config.hidden_size, config.initializer_range, config.rms_norm_eps
        self.attention_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.attention = Attention(d, heads=afmoe.head_geometry(config), qkv_bias=config.attention_bias, out_bias=config.attention_bias,
                                   qk_norm=QKNorm(eps), dtype=dtype, rngs=rngs, std=std)
        self.attention_post_norm, self.mlp_norm, self.mlp_post_norm = (RMSNorm(d, eps=eps, dtype=dtype) for _ in range(3))
        kw = dict(act=config.hidden_act, gated=True, bias=False, dtype=dtype, rngs=rngs, std=std)
        if afmoe.sparse_layer(config, index):
            self.moe = TokenChoiceMoE(config, dtype=dtype, rngs=rngs, std=std)
            self.shared_mlp = MLP(d, afmoe.shared_width(config), **kw)
        else:
            self.mlp = MLP(d, config.intermediate_size, **kw)

    def __call__(self, x, bias, rope):
        x = x + self.attention_post_norm(self.attention(self.attention_norm(x), bias, rope))
        y = self.mlp_norm(x)
        return x + self.mlp_post_norm(self.moe(y) + self.shared_mlp(y) if hasattr(self, "moe") else self.mlp(y))


class Decoder(nnx.Module):
    """AfmoeModel (head None) or AfmoeForCausalLM ("lm")."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError(f"{config.model_type} has no pooler: layout.pooler must be False")
        n = config.num_hidden_layers
        sliding = tuple(t == "sliding_attention" for t in config.layer_types[:n])
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(config))  # static: part of the graph
        self.windows = tuple(config.sliding_window if s else None for s in sliding)  # the sliding layers alone take RoPE
        self.embeddings = WordEmbeddings(config, dtype, rngs, scale=config.hidden_size ** 0.5 if config.mup_enabled else None)
        self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs) for i in range(n)])
        self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        d, std = config.hidden_size, config.initializer_range
        self.lm = layout.head == "lm"
        self.lm_head = dense(d, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=std) if self.lm and not is_tied(config) else None
        self.head = heads.decoder_head(layout.head, d, config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        rope = rope_cos_sin(self.inv_freq, position_ids)
        biases = {w: attention_bias(attention_mask, t, causal=True, sliding_window=w) for w in set(self.windows)}
        x = self.embeddings(input_ids)
        x = run_layers(self.layers, x, lambda i: (biases[self.windows[i]], None if self.windows[i] is None else rope))
        return heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=self.lm_head, lm=self.lm, head=self.head,
                                     input_ids=input_ids)
