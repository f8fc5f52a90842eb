"""GPT-2: a pre-LayerNorm causal decoder with learned positions and an LM head tied to the
token embedding.

Leaves (d = n_embd, f = n_inner or 4 d, H = n_head, dh = d // H):
    embeddings/word/embedding        (vocab_size, d)       also the LM head: logits = x @ word^T
    embeddings/position/embedding    (n_positions, d)
    layers/{i}/attention_norm/{scale,bias}   (d,)   ln_1, before attention
    layers/{i}/attention/{query,key,value}/kernel (d, H*dh), .../bias (H*dh,)
        the thirds of HF's fused attn.c_attn (Conv1D weight (d, 3d), bias (3d,))
    layers/{i}/attention/out/kernel  (H*dh, d), layers/{i}/attention/out/bias (d,)   attn.c_proj
    layers/{i}/mlp_norm/{scale,bias}         (d,)   ln_2, before the MLP
    layers/{i}/mlp/up/kernel (d, f), layers/{i}/mlp/up/bias (f,)       mlp.c_fc
    layers/{i}/mlp/down/kernel (f, d), layers/{i}/mlp/down/bias (d,)   mlp.c_proj
    final_norm/{scale,bias}          (d,)   ln_f
    head "lm" (GPT2LMHeadModel) adds no leaf: HF's lm_head.weight is tied to wte, so it is never
        saved, and when a checkpoint holds it, it must equal wte.
Inputs: input_ids (B, T), attention_mask (B, T) 1 = token 0 = padding, position_ids (default arange).
Outputs: last_hidden_state (after ln_f) and, with head "lm", logits (B, T, vocab_size).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import Family, Layout, TensorRule, conv1d, copy, detect_prefix, layer_norm
from .layers import MLP, Attention, LayerNorm, attention_bias, embed

_QKV = ("query", "key", "value")


def _check_config(config, layout: Layout):
    unsupported = {
        # HF's upcast-and-reorder attention rounds differently in half precision: refuse, not differ.
        "reorder_and_upcast_attn": "reorder_and_upcast_attn=True is not supported",
        "add_cross_attention": "add_cross_attention=True (encoder-decoder GPT-2) is not supported",
    }
    for key, message in unsupported.items():
        if getattr(config, key, False):
            raise ValueError(f"GPT-2 config: {message}")
    if layout.head not in (None, "lm"):
        raise ValueError(f"unsupported head {layout.head!r} for GPT-2; use None or 'lm'")
    if layout.head == "lm" and not config.tie_word_embeddings:
        raise ValueError("GPT-2 config: tie_word_embeddings=False (a separate lm_head) is not supported")
    if layout.pooler:
        raise ValueError("GPT-2 has no pooler: layout.pooler must be False")


def _attention_scale(config, layer_idx):
    scale = 1.0 / math.sqrt(config.n_embd // config.n_head) if config.scale_attn_weights else 1.0
    if config.scale_attn_by_inverse_layer_idx:
        scale /= layer_idx + 1
    return scale


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.n_embd, config.initializer_range
        self.word = embed(config.vocab_size, d, dtype=dtype, rngs=rngs, std=std)
        self.position = embed(config.n_positions, d, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, position_ids):
        return self.word(input_ids) + self.position(position_ids)


class DecoderLayer(nnx.Module):
    def __init__(self, config, layer_idx, dtype, rngs):
        d, std, eps = config.n_embd, config.initializer_range, config.layer_norm_epsilon
        f = config.n_inner if config.n_inner is not None else 4 * d
        self.attention_norm = LayerNorm(d, eps=eps, dtype=dtype)
        self.attention = Attention(
            d, num_heads=config.n_head, scale=_attention_scale(config, layer_idx), dtype=dtype, rngs=rngs, std=std
        )
        self.mlp_norm = LayerNorm(d, eps=eps, dtype=dtype)
        self.mlp = MLP(d, f, act=config.activation_function, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias):
        x = x + self.attention(self.attention_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class GPT2Decoder(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        _check_config(config, layout)
        self.embeddings = Embeddings(config, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs) for i in range(config.n_layer)])
        self.final_norm = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, dtype=dtype)
        self.lm_head = layout.head == "lm"

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        x = self.embeddings(input_ids, position_ids)
        bias = attention_bias(attention_mask, t, causal=True)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.final_norm(x)
        out = {"last_hidden_state": x}
        if self.lm_head:
            out["logits"] = self.embeddings.word.attend(x)
        return out


def _fused_qkv(hf_module: str, our_module: str) -> list[TensorRule]:
    """attn.c_attn (Conv1D, already (in, out)) holds [query | key | value] along its last axis."""
    return [
        TensorRule(
            f"{hf_module}.{kind}",
            tuple(f"{our_module}/{proj}/{leaf}" for proj in _QKV),
            lambda a: tuple(np.split(a, 3, axis=-1)),
            lambda t: np.concatenate(t, axis=-1),
        )
        for kind, leaf in (("weight", "kernel"), ("bias", "bias"))
    ]


def _tensors(config, layout: Layout):
    n = layout.name
    rules = [
        copy(n("wte.weight"), "embeddings/word/embedding"),
        copy(n("wpe.weight"), "embeddings/position/embedding"),
    ]
    for i in range(config.n_layer):
        hf, ours = n(f"h.{i}"), f"layers/{i}"
        rules += layer_norm(f"{hf}.ln_1", f"{ours}/attention_norm")
        rules += _fused_qkv(f"{hf}.attn.c_attn", f"{ours}/attention")
        rules += conv1d(f"{hf}.attn.c_proj", f"{ours}/attention/out")
        rules += layer_norm(f"{hf}.ln_2", f"{ours}/mlp_norm")
        rules += conv1d(f"{hf}.mlp.c_fc", f"{ours}/mlp/up")
        rules += conv1d(f"{hf}.mlp.c_proj", f"{ours}/mlp/down")
    rules += layer_norm(n("ln_f"), "final_norm")
    return rules


def _detect(names, config):
    prefix = detect_prefix(names, "transformer.", "wte.weight")
    # The original OpenAI checkpoints store an LM model with bare names; their config says so.
    lm = bool(prefix) or "lm_head.weight" in names or "GPT2LMHeadModel" in (config.architectures or ())
    return Layout(prefix=prefix, head="lm" if lm else None)


def _tied(config, layout: Layout):
    return {"lm_head.weight": "embeddings/word/embedding"} if layout.head == "lm" else {}


SCHEMA = ConfigSchema("gpt2", "GPT2Config", {
    "vocab_size": (INT, 50257), "n_positions": (INT, 1024), "n_embd": (INT, 768), "n_layer": (INT, 12),
    "n_head": (INT, 12), "n_inner": (INT.optional(), None), "activation_function": (STR, "gelu_new"),
    "layer_norm_epsilon": (FLOAT, 1e-5), "initializer_range": (FLOAT, 0.02), "scale_attn_weights": (BOOL, True),
    "scale_attn_by_inverse_layer_idx": (BOOL, False), "reorder_and_upcast_attn": (BOOL, False),
    "add_cross_attention": (BOOL, False), "tie_word_embeddings": (BOOL, True), "pad_token_id": (INT.optional(), None),
}, aliases={"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
            "num_hidden_layers": "n_layer"})

GPT2 = Family(
    name="gpt2",
    prefix="transformer.",
    configs=(SCHEMA,),
    build=lambda config, layout, dtype, rngs: GPT2Decoder(config, layout, dtype, rngs=rngs),
    tensors=_tensors,
    detect=_detect,
    architecture=lambda config, layout: "GPT2LMHeadModel" if layout.head == "lm" else "GPT2Model",
    # Causal-mask buffers that older transformers versions saved with the weights.
    ignored=(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",),
    tied=_tied,
)
