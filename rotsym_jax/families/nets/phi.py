"""The forward pass in Flax NNX of the LayerNorm decoders with partial rotary embeddings whose
records are `families/phi.py` (Phi: attention and MLP read one LayerNorm of the stream and both
add to it), `families/gptj.py` (GPT-J: Phi's layer without attention biases, its rotary pairs
reordered by the loader), `families/stablelm.py` (StableLM: that parallel layer, or a
sequential one with a norm before each sublayer) and `families/starcoder2.py` (StarCoder2: the
sequential layer with a GELU MLP, biases with `use_bias`, a sliding window over every layer) and
`families/cohere.py` (Cohere: the parallel layer with LayerNorms without biases, a SwiGLU MLP, its
rotary pairs reordered by the loader, its LM logits scaled by `logit_scale`; Cohere 2 with sliding
layers with RoPE and full ones without) and
`families/falcon.py` (Falcon: parallel layers reading one norm or two, `ln_attn` and `ln_mlp`, or
sequential ones; a GELU MLP, biases with `bias`) and `families/nemotron.py` (Nemotron: the
sequential layer, LayerNorms with gains 1 + w, an MLP without a gate, biases with attention_bias and
mlp_bias) and `families/jais2.py` (Jais 2: Nemotron's layer with plain LayerNorm gains, whole-head RoPE)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from .. import falcon, gptj
from ..family import Layout
from ..llama._config import head_geometry_of, rope_inv_freq
from . import heads
from .layers import MLP, Attention, LayerNorm, WordEmbeddings, attention_bias, dense, rope_cos_sin, run_layers


def _layer_options(config) -> dict:
    """(parallel, q/k/v bias, out bias, gated MLP, MLP bias, LM head bias, norm bias, the MLP's own norm) of Phi, GPT-J, StarCoder2,
    Cohere, Falcon and StableLM."""
    options = _options(config)
    options.setdefault("mlp_norm", not options["parallel"])
    return options


def _options(config) -> dict:
    if config.model_type == "falcon":
        b = config.bias
        return dict(parallel=falcon.parallel(config), qkv_bias=b, out_bias=b, gated=False, mlp_bias=b, lm_bias=False, norm_bias=True,
                    mlp_norm=not falcon.one_norm(config))
    if config.model_type in ("phi", "gptj"):
        phi = config.model_type == "phi"
        return dict(parallel=True, qkv_bias=phi, out_bias=phi, gated=False, mlp_bias=True, lm_bias=True, norm_bias=True)
    if config.model_type == "starcoder2":
        b = config.use_bias
        return dict(parallel=False, qkv_bias=b, out_bias=b, gated=False, mlp_bias=b, lm_bias=False, norm_bias=True)
    if config.model_type in ("cohere", "cohere2"):
        b = config.attention_bias
        return dict(parallel=True, qkv_bias=b, out_bias=b, gated=True, mlp_bias=False, lm_bias=False, norm_bias=False)
    if config.model_type == "nemotron":  # LayerNorm1P: gains stored as w, applied as 1 + w
        b = config.attention_bias
        return dict(parallel=False, qkv_bias=b, out_bias=b, gated=False, mlp_bias=config.mlp_bias, lm_bias=False, norm_bias=True, one_plus=True)
    if config.model_type == "jais2":  # Nemotron's layer with nn.LayerNorm (gains as stored), RoPE over the whole head
        b = config.attention_bias
        return dict(parallel=False, qkv_bias=b, out_bias=b, gated=False, mlp_bias=config.mlp_bias, lm_bias=False, norm_bias=True)
    return dict(parallel=config.use_parallel_residual, qkv_bias=config.use_qkv_bias, out_bias=False, gated=True, mlp_bias=False, lm_bias=False,
                norm_bias=True)


def _sizes(config) -> dict:
    """(norm eps, MLP width, activation, head geometry, RoPE frequencies, attention window) under each config's names."""
    if config.model_type == "gptj":
        return dict(eps=config.layer_norm_epsilon, inner=gptj.inner_width(config), act=config.activation_function,
                    heads=gptj.head_geometry(config), inv_freq=gptj.inv_freq(config), window=None)
    if config.model_type == "falcon":
        return dict(eps=config.layer_norm_epsilon, inner=config.ffn_hidden_size, act=config.activation, heads=head_geometry_of(config),
                    inv_freq=rope_inv_freq(config), window=None)
    starcoder2 = config.model_type == "starcoder2"
    eps = {"starcoder2": "norm_epsilon", "nemotron": "norm_eps"}.get(config.model_type, "layer_norm_eps")
    return dict(eps=getattr(config, eps), inner=config.intermediate_size, act=config.hidden_act,
                heads=head_geometry_of(config), inv_freq=rope_inv_freq(config), window=config.sliding_window if starcoder2 else None)


class DecoderLayer(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std, s = config.hidden_size, config.initializer_range, _sizes(config)
        o = _layer_options(config)
        self.attention_norm = LayerNorm(d, eps=s["eps"], dtype=dtype, bias=o["norm_bias"], one_plus=o.get("one_plus", False))
        self.attention = Attention(d, heads=s["heads"], qkv_bias=o["qkv_bias"], out_bias=o["out_bias"], dtype=dtype, rngs=rngs, std=std)
        self.parallel = o["parallel"]
        self.mlp_norm = LayerNorm(d, eps=s["eps"], dtype=dtype, bias=o["norm_bias"], one_plus=o.get("one_plus", False)) if o["mlp_norm"] else None
        self.mlp = MLP(d, s["inner"], act=s["act"], gated=o["gated"], bias=o["mlp_bias"], dtype=dtype, rngs=rngs, std=std)

    def __call__(self, x, bias, rope):
        normed = self.attention_norm(x)
        attended = self.attention(normed, bias, rope)
        if self.parallel:  # both sublayers read the stream: one norm, or each its own (Falcon's ln_attn, ln_mlp)
            return x + attended + self.mlp(normed if self.mlp_norm is None else self.mlp_norm(x))
        x = x + attended
        return x + self.mlp(self.mlp_norm(x))


class LMBias(nnx.Module):
    """A tied LM head's own bias (its kernel is the word embedding): leaf `lm_head/bias`."""

    def __init__(self, vocab: int, dtype):
        self.bias = nnx.Param(jnp.zeros((vocab,), dtype))


def lm_head(lm: bool, tied: bool, bias: bool, d: int, vocab: int, dtype, rngs, std):
    """An LM head of its own (`lm_head/kernel`, and a bias with `bias`), its bias alone where it is
    tied to the word embedding (`LMBias`), or None (no LM head, or a tied one without a bias)."""
    if not lm or (tied and not bias):
        return None
    if tied:
        return LMBias(vocab, dtype)
    return dense(d, vocab, bias=bias, dtype=dtype, rngs=rngs, std=std)


class Decoder(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError(f"{config.model_type} has no pooler: layout.pooler must be False")
        sizes = _sizes(config)
        self.inv_freq = tuple(float(f) for f in sizes["inv_freq"])  # static: part of the graph
        # each layer's (attention window, whether it applies RoPE): StarCoder2's window over every
        # layer; Cohere 2's sliding layers with RoPE, its full ones without
        sliding = [t == "sliding_attention" for t in config.layer_types] if config.model_type == "cohere2" else None
        self.layer_attention = tuple((config.sliding_window, True) if s else (None, False) for s in sliding) if sliding \
            else ((sizes["window"], True),) * config.num_hidden_layers
        d, std = config.hidden_size, config.initializer_range
        self.embeddings = WordEmbeddings(config, dtype, rngs)
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_hidden_layers)])
        options = _layer_options(config)
        self.final_norm = LayerNorm(d, eps=sizes["eps"], dtype=dtype, bias=options["norm_bias"], one_plus=options.get("one_plus", False))
        self.lm = layout.head == "lm"
        self.tied = config.tie_word_embeddings
        cohere = config.model_type in ("cohere", "cohere2")
        self.logit_scale = config.logit_scale if cohere else None  # Cohere: logits times logit_scale
        if self.lm and cohere and self.logit_scale is None:
            raise InputError("logit_scale=None: CohereForCausalLM multiplies its logits by it (transformers fails on None)")
        self.lm_head = lm_head(self.lm, self.tied, options["lm_bias"], d, config.vocab_size, dtype, rngs, std)
        self.head = heads.decoder_head(layout.head, d, config, dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        rope = rope_cos_sin(self.inv_freq, position_ids)
        biases = {window: attention_bias(attention_mask, t, causal=True, sliding_window=window) for window, _ in set(self.layer_attention)}
        x = self.embeddings(input_ids)
        x = run_layers(self.layers, x, lambda i: (biases[self.layer_attention[i][0]], rope if self.layer_attention[i][1] else None))
        untied_head = None if self.tied else self.lm_head
        out = heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=untied_head, lm=self.lm, head=self.head,
                                    input_ids=input_ids)
        if self.tied and isinstance(self.lm_head, LMBias):
            out["logits"] = out["logits"] + self.lm_head.bias[...]
        if self.logit_scale is not None and self.lm:
            out["logits"] = out["logits"] * self.logit_scale
        return out
