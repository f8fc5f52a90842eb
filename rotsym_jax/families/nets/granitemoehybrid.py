"""Granite-4's hybrid forward pass in Flax NNX (its record: `families/granitemoehybrid.py`): Mamba-2
mixers or attention, each followed by a shared SwiGLU MLP beside an optional mixture of experts,
with Granite's four multipliers."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from .. import granitemoehybrid as record
from ..family import Layout
from ..llama._config import is_tied, rope_inv_freq
from .decoders import HybridDecoder
from .layers import MLP, Attention, MoE, RMSNorm, Scores
from .mamba2 import Mixer


class Layer(nnx.Module):
    def __init__(self, config, index, dtype, rngs):
        d, std, eps = config.hidden_size, config.initializer_range, config.rms_norm_eps
        self.attention_norm = RMSNorm(d, eps=eps, dtype=dtype)
        attention = record.layer_types(config)[index] == "full_attention"
        bias = config.attention_bias
        self.attention = Attention(d, heads=record.head_geometry(config), qkv_bias=bias, out_bias=bias, scores=Scores(config.attention_multiplier),
                                   dtype=dtype, rngs=rngs, std=std) if attention else None
        self.mamba = None if attention else Mixer(config, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.shared_mlp = MLP(d, config.shared_intermediate_size, act="silu", gated=True, bias=False, dtype=dtype, rngs=rngs,
                              std=std) if record.shared_mlp(config) else None
        self.moe = MoE(d, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok, act="silu", normalize=True,
                       dtype=dtype, rngs=rngs, std=std) if config.num_local_experts > 0 else None
        self.residual_multiplier = config.residual_multiplier

    def __call__(self, x, bias, rope, mask):
        normed = self.attention_norm(x)
        mixed = self.attention(normed, bias, rope) if self.mamba is None else self.mamba(normed, mask)
        x = x + mixed * self.residual_multiplier
        normed = self.mlp_norm(x)
        out = (0 if self.shared_mlp is None else self.shared_mlp(normed)) + (0 if self.moe is None else self.moe(normed))
        return x + out * self.residual_multiplier


class Decoder(HybridDecoder):
    """Granite-4's hybrid model, or GraniteMoe(Shared)'s (every layer attention); head None (`...Model`) or "lm" (`...ForCausalLM`)."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        rope = record.rotary(config) and "full_attention" in record.layer_types(config)
        super().__init__(config, layout, dtype, rngs, layer=Layer, inv_freq=rope_inv_freq(config) if rope else None, tied=is_tied(config),
                         eps=config.rms_norm_eps, embedding_scale=config.embedding_multiplier)
        self.logits_scaling = config.logits_scaling

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        out = super().__call__(input_ids, attention_mask, position_ids)
        if self.lm:
            out["logits"] = out["logits"] / self.logits_scaling
        return out
