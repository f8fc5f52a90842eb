"""The Llama-family forward pass in Flax NNX (its records: `families/llama/`): the decoder
layer (pre-, post- or sandwich-normed; dense or mixture-of-experts MLP; Granite's scalar
multipliers) and the decoder."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ...precision import exact_jit
from ..family import Layout
from ..llama._config import (
    activation_of,
    attention_scale,
    biases_of,
    embedding_scale,
    expert_width,
    experts_of,
    gated,
    head_geometry_of,
    is_gemma,
    is_sandwich,
    is_tied,
    layer_rope_parameters,
    logits_divisor,
    norm_eps,
    normalized_top_k,
    output_norms,
    parameterless_norms,
    plain_shared_expert,
    post_only,
    qk_norm_after_rope,
    qk_norm_of,
    residual_multiplier,
    rope_inv_freq,
    rotary_dim_of,
    shared_expert,
    sliding_windows,
    sparse_layer,
    top_k_of,
)
from ..llama._tensors import token_bias_of
from . import heads
from .deepseek import yarn
from .layers import MLP, Attention, LayerNorm, MoE, QKNorm, RMSNorm, Scores, WordEmbeddings, attention_bias, dense, rope_cos_sin, run_layers


def _stream_norm(config, d, dtype):
    """The norm before a sublayer or the heads: an RMSNorm (Gemma's with gains 1 + w), OLMo 1's
    LayerNorm without parameters."""
    if parameterless_norms(config):
        return LayerNorm(d, eps=norm_eps(config), dtype=dtype, scale=False)
    return RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype, one_plus=is_gemma(config))


class DecoderLayer(nnx.Module):
    record = False  # set by `layer_inputs`: the layer sows the stream it reads

    def __init__(self, config, index, dtype, rngs):
        d, std, eps = config.hidden_size, config.initializer_range, norm_eps(config)
        qkv_bias, out_bias, mlp_bias = biases_of(config)
        pre = not post_only(config)
        self.attention_norm = _stream_norm(config, d, dtype) if pre else None
        sandwich = output_norms(config)
        self.attention = Attention(
            d,
            heads=head_geometry_of(config),
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            qk_norm=QKNorm(eps, one_plus=is_gemma(config), after_rope=qk_norm_after_rope(config)) if qk_norm_of(config) else None,
            # Gemma 2 caps its attention scores; Gemma 3's config keeps the key, which transformers does not apply
            scores=Scores(attention_scale(config), config.attn_logit_softcapping if config.model_type == "gemma2" else None),
            dtype=dtype,
            rngs=rngs,
            std=std,
        )
        # sandwich norms (Gemma 2, GLM-4) and OLMo-2's: each sublayer's output normed before it joins the stream
        post = sandwich or not pre
        self.attention_post_norm = RMSNorm(d, eps=eps, dtype=dtype, one_plus=is_gemma(config)) if post else None
        self.mlp_post_norm = RMSNorm(d, eps=eps, dtype=dtype, one_plus=is_gemma(config)) if post else None
        self.mlp_norm = _stream_norm(config, d, dtype) if pre else None
        if sparse_layer(config, index):
            self.moe = MoE(d, expert_width(config), experts_of(config), top_k_of(config, index), act=config.hidden_act,
                           normalize=normalized_top_k(config), dtype=dtype, rngs=rngs, std=std)
            if shared_expert(config):  # Qwen2-MoE: a shared expert beside the routed ones, its output times sigmoid(shared_gate(x))
                self.shared_mlp = MLP(d, config.shared_expert_intermediate_size, act=config.hidden_act, gated=True, bias=False,
                                      dtype=dtype, rngs=rngs, std=std)
                self.shared_gate = dense(d, 1, bias=False, dtype=dtype, rngs=rngs, std=std)
            elif plain_shared_expert(config):  # HunYuan MoE: a shared MLP beside the routed experts, no gate
                self.shared_mlp = MLP(d, config.intermediate_size, act=config.hidden_act, gated=True, bias=False, dtype=dtype, rngs=rngs, std=std)
        else:
            self.mlp = MLP(
                d, config.intermediate_size, act=activation_of(config), gated=gated(config), bias=mlp_bias,
                dtype=dtype, rngs=rngs, std=std,
            )
        self.residual_multiplier = residual_multiplier(config)  # Granite: each sublayer's output scaled before the sum

    def __call__(self, x, bias, rope):
        def normed(norm, y):
            return y if norm is None else norm(y)

        def scaled(y):
            return y if self.residual_multiplier is None else y * self.residual_multiplier

        if self.record:
            self.sow(nnx.Intermediate, "stream", x)
        x = x + scaled(normed(self.attention_post_norm, self.attention(normed(self.attention_norm, x), bias, rope)))
        return x + scaled(normed(self.mlp_post_norm, self.feed_forward(normed(self.mlp_norm, x))))

    def feed_forward(self, y):
        if not hasattr(self, "moe"):
            return self.mlp(y)
        if not hasattr(self, "shared_mlp"):
            return self.moe(y)
        if not hasattr(self, "shared_gate"):
            return self.moe(y) + self.shared_mlp(y)
        return self.moe(y) + jax.nn.sigmoid(self.shared_gate(y)) * self.shared_mlp(y)


class Decoder(nnx.Module):
    """Llama / Mistral / Qwen2 decoder; head None (`*Model`) or "lm" (`*ForCausalLM`)."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError(f"{config.model_type} has no pooler: layout.pooler must be False")
        # Static (hashable) tuples, not arrays: they belong to the graph, not to the params.
        self.inv_freqs = tuple(None if p is None else _rope(config, p) for p in layer_rope_parameters(config))
        self.windows = sliding_windows(config)
        if getattr(config, "use_bidirectional_attention", False):
            raise InputError("use_bidirectional_attention=True (attention without the causal mask) is not run here")
        self.embeddings = WordEmbeddings(config, dtype, rngs, scale=embedding_scale(config))
        self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs) for i in range(config.num_hidden_layers)])
        self.final_norm = _stream_norm(config, config.hidden_size, dtype)
        self.tied = is_tied(config)
        d, std = config.hidden_size, config.initializer_range
        untied_head = layout.head == "lm" and not self.tied
        self.lm_head = dense(d, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=std) if untied_head else None
        self.lm = layout.head == "lm"
        self.final_softcap = config.final_logit_softcapping if is_sandwich(config) else None
        self.logits_divisor = logits_divisor(config)  # Granite's logits_scaling
        self.head = heads.decoder_head(layout.head, d, config, token_bias=token_bias_of(config), dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        ropes = {f: None if f is None else _scaled(rope_cos_sin(f[0], position_ids), f[1]) for f in set(self.inv_freqs)}
        biases = {
            w: attention_bias(attention_mask, t, causal=True, sliding_window=w) for w in set(self.windows)
        }
        x = self.embeddings(input_ids)
        x = run_layers(self.layers, x, lambda i: (biases[self.windows[i]], ropes[self.inv_freqs[i]]))
        out = heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=self.lm_head, lm=self.lm, head=self.head,
                                    input_ids=input_ids)
        if self.final_softcap is not None and "logits" in out and self.lm:  # Gemma 2's LM logits only
            out["logits"] = self.final_softcap * jnp.tanh(out["logits"] / self.final_softcap)
        if self.logits_divisor is not None and self.lm:
            out["logits"] = out["logits"] / self.logits_divisor
        return out


def _rope(config, params) -> tuple[tuple[float, ...], float]:
    """One layer's RoPE: its inverse frequencies and the factor on cos and sin (YaRN's attention factor, else 1), as
    transformers computes them; YaRN's `truncate` is read from the config's top-level parameters, as transformers reads it."""
    if params.get("rope_type") == "yarn":
        truncate = (config.rope_parameters or {}).get("truncate", True)
        inv_freq, factor = yarn({**params, "truncate": truncate}, rotary_dim_of(config))
    else:
        inv_freq, factor = rope_inv_freq(config, params), 1.0
    return tuple(float(f) for f in inv_freq), float(factor)


def _scaled(cos_sin, factor: float):
    return cos_sin if factor == 1.0 else tuple(x * factor for x in cos_sin)


@partial(exact_jit, static_argnums=0)
def layer_inputs(graphdef, params, inputs):
    """(layers, batch, tokens, d): the residual stream each decoder layer reads (transformers'
    `hidden_states[:-1]`: the embeddings', then each layer's output but the last), from one forward
    pass of the model `graphdef` with `params` on `inputs`."""
    model = nnx.merge(graphdef, params)  # a fresh copy: setting `record` touches nothing else
    for _, module in nnx.iter_modules(model):
        if isinstance(module, DecoderLayer):
            module.record = True
    _, recorded = nnx.capture(model, nnx.Intermediate)(**inputs)
    return jnp.stack([variable.get_value()[0] for _, variable in sorted(nnx.to_flat_state(recorded), key=lambda kv: int(kv[0][1]))])
