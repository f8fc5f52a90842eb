"""Llama, Mistral, Qwen2, Qwen3 and Phi-3: pre-RMSNorm causal decoders with RoPE, grouped-query
attention and a SwiGLU MLP, with an optional (tied or untied) language-model head. One model class
serves all five; Qwen3 adds QK-norm (an RMSNorm over each head's q and k, before RoPE); Phi-3 fuses
its projections (qkv_proj = [Q; K; V], gate_up_proj = [gate; up], split into the shared leaves) and
may rotate only part of each head (partial_rotary_factor).

Leaves (d = hidden_size, f = intermediate_size, V = vocab_size, H = num_attention_heads,
G = num_key_value_heads, dh = config.head_dim, else d // H):
    embeddings/word/embedding                  (V, d)        HF embed_tokens
    layers/{i}/attention_norm/scale            (d,)          HF input_layernorm (RMSNorm)
    layers/{i}/attention/query/kernel (d, H*dh), .../bias (H*dh,)   Llama attention_bias; Qwen2
    layers/{i}/attention/key/kernel   (d, G*dh), .../bias (G*dh,)   Llama attention_bias; Qwen2
    layers/{i}/attention/value/kernel (d, G*dh), .../bias (G*dh,)   Llama attention_bias; Qwen2
    layers/{i}/attention/out/kernel   (H*dh, d), .../bias (d,)      Llama, Qwen3 attention_bias only
    layers/{i}/attention/{query,key}_norm/scale (dh,)   Qwen3 q_norm, k_norm
    layers/{i}/mlp_norm/scale                  (d,)          HF post_attention_layernorm
    layers/{i}/mlp/{gate,up}/kernel (d, f), layers/{i}/mlp/down/kernel (f, d)
                                               (+ bias (f,) / (d,) with Llama mlp_bias)
    final_norm/scale                           (d,)          HF model.norm
    task heads (the records at the bottom; all run here):
        lm                       *ForCausalLM: lm_head/kernel (d, V) without tie_word_embeddings;
                                 tied: logits = h @ embeddings/word/embedding^T
        sequence_classification  head/score (d, num_labels), no bias, on the last token that is
                                 not padding
        token_classification     head/token_classifier (d, num_labels) on every token (HF `score`)
        question_answering       head/qa_outputs (d, 2): start and end logits (LlamaFor... and
                                 Qwen2For... name their base model `transformer.`)
MLP: down(silu(gate(x)) * up(x)). RoPE in HF's rotate_half layout (pairs (i, i + dh/2)); rope_type
"default", "linear" or "llama3", over the whole head (partial_rotary_factor 1).
Sliding window (as transformers 5 applies it): Mistral windows every layer when config.sliding_window
is set; Qwen2 and Qwen3 window the layers config.layer_types marks "sliding_attention" (by default those from
max_window_layers on, and only with use_sliding_window); Llama never windows.
Inputs: input_ids (B, T), attention_mask (B, T) 1 = token 0 = padding, position_ids (default arange).
Outputs: last_hidden_state (after the final norm), logits with head "lm".
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..errors import InputError
from ..spec import HeadGeometry
from . import heads
from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema, Kind, bad_value, check_number, positive_ints, unit_float
from .family import NO_READER, TRANSPOSE, Family, Head, Layout, Norm, Tensor, embedding, linear, norm, pre_norm_folds, split_rows
from .layers import MLP, Attention, MoE, RMSNorm, WordEmbeddings, attention_bias, dense, rope_cos_sin

_STEMS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3", "mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe"}
ROPE_TYPES = ("default", "linear", "llama3")


def _head_dim(config) -> int:
    # Llama/Mistral configs fill head_dim; a Qwen2 config has one only when config.json names it.
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _head_geometry(config) -> HeadGeometry:
    """GQA heads; RoPE on the first rotary_dim entries of each head (rotate_half pairs): the whole
    head, or Phi-3's partial_rotary_factor of it. The frequencies (the rope_type) do not matter
    to the symmetry; the rotary width does."""
    heads, dh = config.num_attention_heads, _head_dim(config)
    return HeadGeometry(heads, getattr(config, "num_key_value_heads", None) or heads, dh, rotary_dim=_rotary_dim(config), qk_norm=_qk_norm(config))


def _rotary_dim(config) -> int:
    factor = (config.rope_parameters or {}).get("partial_rotary_factor", 1.0)
    dh = _head_dim(config)
    if factor != 1.0 and config.model_type != "phi3":
        raise InputError(f"partial_rotary_factor={factor} is not supported for {config.model_type} (only 1.0: RoPE over the whole head)")
    rotary = dh * factor
    if rotary != int(rotary) or int(rotary) % 2 or not rotary:
        raise InputError(f"partial_rotary_factor={factor} gives {rotary} rotary dims of a {dh}-wide head; an even whole number is supported")
    return int(rotary)


def _qk_norm(config) -> bool | str:
    """Qwen3 and Gemma 3 normalise each head's q and k ("head": an RMSNorm over head_dim, one gain
    for all heads); OLMo-2 all heads' q at once, and k ("full": a gain per entry)."""
    if config.model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
        return "head"
    return "full" if config.model_type in ("olmo2", "olmoe") else False


def _post_only(config) -> bool:
    """OLMo-2: no norm before the sublayers; each sublayer's output passes an RMSNorm before it
    joins the stream (HF post_attention_layernorm, post_feedforward_layernorm)."""
    return config.model_type == "olmo2"


def _tied(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def _biases(config) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o bias, MLP bias), as each transformers class hard-codes or reads them."""
    if config.model_type == "qwen2":
        return True, False, False
    if config.model_type in ("qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "olmo2", "olmoe"):
        return config.attention_bias, config.attention_bias, False
    if config.model_type == "phi3":
        return False, False, False
    if config.model_type == "llama":
        return config.attention_bias, config.attention_bias, config.mlp_bias
    return False, False, False  # Mistral


def _gemma(config) -> bool:
    """Gemma 1 to 3: RMSNorm gains stored as w (the gain is 1 + w), the embedding scaled by sqrt(hidden_size)."""
    return config.model_type in ("gemma", "gemma2", "gemma3_text")


def _sandwich(config) -> bool:
    """Gemma 2 and 3: each sublayer's output passes an RMSNorm before it joins the stream; attention
    scores scaled by query_pre_attn_scalar^-1/2 and soft-capped where the config says, the LM
    logits likewise."""
    return config.model_type in ("gemma2", "gemma3_text")


def _act(config) -> str:
    return config.hidden_activation if _sandwich(config) else config.hidden_act


def _embedding_scale(config) -> float | None:
    return config.hidden_size ** 0.5 if _gemma(config) else None


def _moe(config) -> bool:
    """Mixtral, Qwen3-MoE and OLMoE replace each layer's MLP by a sparse mixture of experts (top-k routing)."""
    return config.model_type in ("mixtral", "qwen3_moe", "olmoe")


def _is_mixtral(config) -> bool:
    return config.model_type == "mixtral"


def _is_qwen3_moe(config) -> bool:
    return config.model_type == "qwen3_moe"


def _experts_in_mlp(config) -> bool:
    """Qwen3-MoE and OLMoE store the mixture as `mlp.gate` (the router) and `mlp.experts.{e}.*_proj`."""
    return config.model_type in ("qwen3_moe", "olmoe")


def _sparse_layer(config, i: int) -> bool:
    """Whether layer i holds a mixture of experts: every layer of Mixtral; Qwen3-MoE's layers not in
    mlp_only_layers, every decoder_sparse_step-th (the others hold a dense MLP)."""
    if _is_qwen3_moe(config):
        return i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
    return _moe(config)


def _dense_layer(config, i: int) -> bool:
    return not _sparse_layer(config, i)


def _dense_mlp(config) -> bool:
    """Whether some layer holds a dense MLP."""
    return not all(_sparse_layer(config, i) for i in range(config.num_hidden_layers))


def _experts(config) -> int:
    return config.num_experts if _experts_in_mlp(config) else config.num_local_experts


def _expert_width(config) -> int:
    return config.moe_intermediate_size if _is_qwen3_moe(config) else config.intermediate_size


def _normalized_top_k(config) -> bool:
    """Mixtral renormalises the top k router probabilities; Qwen3-MoE and OLMoE where norm_topk_prob says so."""
    return config.norm_topk_prob if _experts_in_mlp(config) else True


def _sliding_windows(config) -> tuple[int | None, ...]:
    """Each layer's attention window (None: full causal attention); see the module docstring."""
    n = config.num_hidden_layers
    if config.model_type in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        return (config.sliding_window,) * n
    if config.model_type in ("qwen2", "qwen3", "gemma2", "gemma3_text"):
        windows = tuple(config.sliding_window if t == "sliding_attention" else None for t in config.layer_types[:n])
        if config.sliding_window is None and "sliding_attention" in config.layer_types[:n]:
            raise InputError("config.layer_types has 'sliding_attention' layers but sliding_window is not set")
        return windows
    return (None,) * n


def layer_rope_parameters(config) -> list[dict]:
    """Each layer's RoPE parameters: config.rope_parameters, or Gemma 3's of the layer's type
    (its local, sliding layers with their own base)."""
    params = config.rope_parameters or {}
    if config.model_type == "gemma3_text":
        return [params[t] for t in config.layer_types[: config.num_hidden_layers]]
    return [params] * config.num_hidden_layers


def rope_inv_freq(config, params=None) -> np.ndarray:
    """RoPE inverse frequencies (dh/2,) in float32, computed as transformers' rope init functions do
    (from `params`, default config.rope_parameters)."""
    params = (config.rope_parameters if params is None else params) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise InputError(f"unsupported rope_type {rope_type!r} in config.rope_parameters; supported: {ROPE_TYPES}")
    dim = _rotary_dim(config)
    # float32 throughout, like torch, so the frequencies agree to the last bit or nearly.
    inv_freq = 1.0 / (params["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_context = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, those in between interpolated.
        scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


class DecoderLayer(nnx.Module):
    def __init__(self, config, index, dtype, rngs):
        d, std, eps = config.hidden_size, config.initializer_range, config.rms_norm_eps
        qkv_bias, out_bias, mlp_bias = _biases(config)
        pre = not _post_only(config)
        self.attention_norm = RMSNorm(d, eps=eps, dtype=dtype, one_plus=_gemma(config)) if pre else None
        sandwich = _sandwich(config)
        self.attention = Attention(
            d,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=_head_dim(config),
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            qk_norm_eps=eps if _qk_norm(config) else None,
            qk_norm_one_plus=_gemma(config),
            qk_norm_full=_qk_norm(config) == "full",
            scale=config.query_pre_attn_scalar ** -0.5 if sandwich else None,
            # Gemma 2 caps its attention scores; Gemma 3's config keeps the key, which transformers does not apply
            softcap=config.attn_logit_softcapping if config.model_type == "gemma2" else None,
            dtype=dtype,
            rngs=rngs,
            std=std,
        )
        # sandwich norms (Gemma 2) and OLMo-2's: each sublayer's output normed before it joins the stream
        post = sandwich or not pre
        self.attention_post_norm = RMSNorm(d, eps=eps, dtype=dtype, one_plus=_gemma(config)) if post else None
        self.mlp_post_norm = RMSNorm(d, eps=eps, dtype=dtype, one_plus=_gemma(config)) if post else None
        self.mlp_norm = RMSNorm(d, eps=eps, dtype=dtype, one_plus=_gemma(config)) if pre else None
        if _sparse_layer(config, index):
            self.moe = MoE(d, _expert_width(config), _experts(config), config.num_experts_per_tok, act=config.hidden_act,
                           normalize=_normalized_top_k(config), dtype=dtype, rngs=rngs, std=std)
        else:
            self.mlp = MLP(
                d, config.intermediate_size, act=_act(config), gated=True, bias=mlp_bias,
                dtype=dtype, rngs=rngs, std=std,
            )

    def __call__(self, x, bias, rope):
        def normed(norm, y):
            return y if norm is None else norm(y)

        x = x + normed(self.attention_post_norm, self.attention(normed(self.attention_norm, x), bias, rope))
        return x + normed(self.mlp_post_norm, (self.moe if hasattr(self, "moe") else self.mlp)(normed(self.mlp_norm, x)))


class Decoder(nnx.Module):
    """Llama / Mistral / Qwen2 decoder; head None (`*Model`) or "lm" (`*ForCausalLM`)."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError(f"{config.model_type} has no pooler: layout.pooler must be False")
        # Static (hashable) tuples, not arrays: they belong to the graph, not to the params.
        self.inv_freqs = tuple(tuple(float(f) for f in rope_inv_freq(config, p)) for p in layer_rope_parameters(config))
        self.windows = _sliding_windows(config)
        if getattr(config, "use_bidirectional_attention", False):
            raise InputError("use_bidirectional_attention=True (attention without the causal mask) is not run here")
        self.embeddings = WordEmbeddings(config, dtype, rngs, scale=_embedding_scale(config))
        self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs) for i in range(config.num_hidden_layers)])
        self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, one_plus=_gemma(config))
        self.tied = _tied(config)
        d, std = config.hidden_size, config.initializer_range
        untied_head = layout.head == "lm" and not self.tied
        self.lm_head = dense(d, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=std) if untied_head else None
        self.lm = layout.head == "lm"
        self.final_softcap = config.final_logit_softcapping if _sandwich(config) else None
        self.head = heads.decoder_head(layout.head, d, config, token_bias=_token_bias(config), dtype=dtype, rngs=rngs, std=std)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        ropes = {f: rope_cos_sin(f, position_ids) for f in set(self.inv_freqs)}
        biases = {
            w: attention_bias(attention_mask, t, causal=True, sliding_window=w) for w in set(self.windows)
        }
        x = self.embeddings(input_ids)
        for layer, window, freqs in zip(self.layers, self.windows, self.inv_freqs):
            x = layer(x, biases[window], ropes[freqs])
        out = heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=self.lm_head, lm=self.lm, head=self.head,
                                    input_ids=input_ids)
        if self.final_softcap is not None and "logits" in out and self.lm:  # Gemma 2's LM logits only
            out["logits"] = self.final_softcap * jnp.tanh(out["logits"] / self.final_softcap)
        return out


def _token_bias(config) -> bool:
    return bool(getattr(config, "token_classification_bias", True))


# ---- the record ----------------------------------------------------------------------------------------

def _q_width(config) -> int:
    return config.num_attention_heads * _head_dim(config)


def _kv_width(config) -> int:
    return config.num_key_value_heads * _head_dim(config)


def _intermediate(config) -> int:
    return config.intermediate_size


def _qkv_bias(config) -> bool:
    return _biases(config)[0]


def _out_bias(config) -> bool:
    return _biases(config)[1]


def _mlp_bias(config) -> bool:
    return _biases(config)[2]


def _per_head_qk_norm(config) -> bool:
    return _qk_norm(config) == "head"


def _full_qk_norm(config) -> bool:
    return _qk_norm(config) == "full"


def _fused(config) -> bool:
    """Phi-3 stores Q, K and V as one qkv_proj ([Q; K; V] rows) and gate and up as one gate_up_proj."""
    return config.model_type == "phi3"


def _separate(config) -> bool:
    return not _fused(config)


def _only(condition, tensors):
    """`tensors` present only where `condition(config)` holds (and their own `when`)."""
    return tuple(dataclasses.replace(t, when=condition if t.when is None else (lambda c, w=t.when: condition(c) and w(c))) for t in tensors)


def _separately(tensors):
    return _only(_separate, tensors)


def _dense_separately(tensors):
    return _dense_layers(_only(_separate, tensors))


def _dense_layers(tensors):
    """`tensors` held by the layers with a dense MLP (all but a mixture of experts' sparse ones)."""
    return tuple(dataclasses.replace(t, in_layer=_dense_layer) for t in _only(_dense_mlp, tensors))


def _moe_tensors(block: str, router: str, gate: str, up: str, down: str, when) -> tuple[Tensor, ...]:
    """A sparse MoE block stored per expert (`{e}`), stacked into our leaves: the router (E, d)
    and each expert's gate, up (f, d) and down (d, f) projections; in the sparse layers only."""
    moe = "layers/{i}/moe"
    return tuple(dataclasses.replace(t, in_layer=_sparse_layer) for t in _moe_leaves(block, router, gate, up, down, when, moe))


def _moe_leaves(block, router, gate, up, down, when, moe) -> tuple[Tensor, ...]:
    return (
        Tensor(f"{block}.{router}.weight", (f"{moe}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE, when),
        Tensor(f"{block}.experts.{{e}}.{gate}.weight", (f"{moe}/gate/kernel",), ((_experts, "hidden_size", _expert_width),), (1,), TRANSPOSE, when,
               experts=_experts),
        Tensor(f"{block}.experts.{{e}}.{up}.weight", (f"{moe}/up/kernel",), ((_experts, "hidden_size", _expert_width),), (1,), TRANSPOSE, when,
               experts=_experts),
        Tensor(f"{block}.experts.{{e}}.{down}.weight", (f"{moe}/down/kernel",), ((_experts, _expert_width, "hidden_size"),), (2,), TRANSPOSE, when,
               experts=_experts),
    )


_A = "layers.{i}.self_attn"
_QKV = tuple(f"layers/{{i}}/attention/{proj}/kernel" for proj in ("query", "key", "value"))
_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *_separately(linear(f"{_A}.q_proj", "layers/{i}/attention/query", "hidden_size", _q_width, bias=_qkv_bias, reads=True)),
    *_separately(linear(f"{_A}.k_proj", "layers/{i}/attention/key", "hidden_size", _kv_width, bias=_qkv_bias, reads=True)),
    *_separately(linear(f"{_A}.v_proj", "layers/{i}/attention/value", "hidden_size", _kv_width, bias=_qkv_bias, reads=True)),
    Tensor(f"{_A}.qkv_proj.weight", _QKV, (("hidden_size", _q_width), ("hidden_size", _kv_width), ("hidden_size", _kv_width)), (0, 0, 0),
           split_rows((_q_width, _kv_width, _kv_width)), _fused),
    *linear(f"{_A}.o_proj", "layers/{i}/attention/out", _q_width, "hidden_size", bias=_out_bias, writes=True),
    # QK-norm: over each head (one gain of head_dim), or over all heads at once (a gain per entry)
    *_only(_per_head_qk_norm, norm(f"{_A}.q_norm", "layers/{i}/attention/query_norm", _head_dim, bias=False, stream=False)),
    *_only(_per_head_qk_norm, norm(f"{_A}.k_norm", "layers/{i}/attention/key_norm", _head_dim, bias=False, stream=False)),
    *_only(_full_qk_norm, norm(f"{_A}.q_norm", "layers/{i}/attention/query_norm", _q_width, bias=False, stream=False)),
    *_only(_full_qk_norm, norm(f"{_A}.k_norm", "layers/{i}/attention/key_norm", _kv_width, bias=False, stream=False)),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm", bias=False),
    *_dense_separately(linear("layers.{i}.mlp.gate_proj", "layers/{i}/mlp/gate", "hidden_size", "intermediate_size", bias=_mlp_bias, reads=True)),
    *_dense_separately(linear("layers.{i}.mlp.up_proj", "layers/{i}/mlp/up", "hidden_size", "intermediate_size", bias=_mlp_bias, reads=True)),
    Tensor("layers.{i}.mlp.gate_up_proj.weight", ("layers/{i}/mlp/gate/kernel", "layers/{i}/mlp/up/kernel"),
           (("hidden_size", "intermediate_size"),) * 2, (0, 0), split_rows((_intermediate, _intermediate)), _fused),
    *_dense_layers(linear("layers.{i}.mlp.down_proj", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", bias=_mlp_bias, writes=True)),
    *_moe_tensors("layers.{i}.block_sparse_moe", "gate", "w1", "w3", "w2", _is_mixtral),
    *_moe_tensors("layers.{i}.mlp", "gate", "gate_proj", "up_proj", "down_proj", _experts_in_mlp),
)


def _untied(config) -> bool:
    return not _tied(config)


def _lm_tied(config):
    # {HF name: our leaf}, the direction rotsym_jax.hf reads it in.
    return {"lm_head.weight": "embeddings/word/embedding"} if _tied(config) else {}


_HEADS = (
    # A decoder's own LM head (untied) merges like the body: not under head/.
    Head("lm", "ForCausalLM",
         tuple(dataclasses.replace(t, when=_untied) for t in linear("lm_head", "lm_head", "hidden_size", "vocab_size", bias=False, reads=True)),
         markers=("lm_head.weight",), tied=_lm_tied, forward=True),
    Head("sequence_classification", "ForSequenceClassification",
         linear("score", "head/score", "hidden_size", "num_labels", bias=False, reads=True), forward=True),
    Head("token_classification", "ForTokenClassification",
         linear("score", "head/token_classifier", "hidden_size", "num_labels", bias=_token_bias, reads=True), forward=True),
    Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", "hidden_size", 2, reads=True),
         markers=("qa_outputs.weight",), loss=False, forward=True,
         prefixes={"llama": "transformer.", "qwen2": "transformer.", "qwen3": "transformer.", "qwen3_moe": "transformer."}),
)
# The norms before attention, the MLP and the heads: each gain folds into the kernels that read it.
_FOLDS = pre_norm_folds("(up|gate)", r"(lm_head|head/(score|token_classifier|qa_outputs))", moe=True)


# ---- what the family reads from config.json (config.py), as transformers' config classes hold it --

_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Keys the RoPE parameters of rope types we run must hold (transformers' _validate_*_rope_parameters).
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}


def _rope_parameters(values: dict, raw, default_theta: float = 10000.0) -> dict:
    """config.rope_parameters as transformers standardises it: a legacy rope_scaling wins over
    rope_parameters, rope_theta and partial_rotary_factor beside them fill in (theta 10000 by
    default, or the config class's `default_theta`), "type" is the old name of "rope_type", and the scaled types get
    original_max_position_embeddings = max_position_embeddings unless they name one."""
    params = raw.get("rope_scaling") or values["rope_parameters"] or {}
    if not isinstance(params, dict):
        raise bad_value("rope_scaling", params, DICT.name)
    params = dict(params)
    nested = [k for k in params if k in (values.get("layer_types") or ())]
    if nested:
        raise InputError(f"rope_parameters per layer type ({nested}) are not supported: give one set for every layer")
    theta = raw.get("rope_theta", default_theta)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", theta)
    if raw.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
    check_number("rope_theta", params["rope_theta"], above_zero=True)
    missing = [k for k in _ROPE_KEYS.get(params["rope_type"], ()) if k not in params]
    if missing:
        raise InputError(f"rope_parameters of rope_type {params['rope_type']!r} miss {missing}")
    for key in _ROPE_KEYS.get(params["rope_type"], ()):
        check_number(f"rope_parameters.{key}", params[key])
    return params


def _layer_types(values: dict, layer_types, *, supported: bool) -> None:
    """transformers refuses layer_types whose length is not num_hidden_layers; of the layer types,
    only Qwen2's are read (`supported`), and we run full and sliding-window attention."""
    if layer_types is None:
        return
    if not STRINGS.accepts(layer_types):
        raise bad_value("layer_types", layer_types, STRINGS.name)
    if len(layer_types) != values["num_hidden_layers"]:
        raise InputError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={values['num_hidden_layers']}")
    unknown = sorted(set(layer_types) - set(_ATTENTION_LAYER_TYPES))
    if supported and unknown:
        raise InputError(f"layer_types {unknown} are not supported; supported: {list(_ATTENTION_LAYER_TYPES)}")


def _derive(values: dict, raw) -> None:
    """The values LlamaConfig, MistralConfig and Qwen2Config compute in __post_init__ and the
    checks of their validators (the ones a config that loads can fail)."""
    heads = values["num_attention_heads"]
    if "use_sliding_window" in values:  # Qwen2
        if not values["use_sliding_window"]:
            values["sliding_window"] = None
        if values["layer_types"] is None:
            windowed = values["sliding_window"] is not None
            values["layer_types"] = [
                "sliding_attention" if windowed and i >= values["max_window_layers"] else "full_attention"
                for i in range(values["num_hidden_layers"])
            ]
        _layer_types(values, values["layer_types"], supported=True)
    else:
        if values["head_dim"] is None and positive_ints(values, "hidden_size", "num_attention_heads"):
            values["head_dim"] = values["hidden_size"] // heads
        _layer_types(values, raw.get("layer_types"), supported=False)
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads
    values["rope_parameters"] = _rope_parameters(values, raw)
    head_dim = values.get("head_dim", raw.get("head_dim"))
    if _is_odd_rope_dim(head_dim):
        raise InputError(f"head_dim={head_dim}: RoPE needs an even head dimension")


def _derive_phi3(values: dict, raw) -> None:
    """Phi3Config: num_key_value_heads defaults to the heads; the legacy rope types 'su' and 'yarn'
    are its 'longrope'; the head is hidden_size / heads (no head_dim key)."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = _rope_parameters(values, raw)
    if values["rope_parameters"].get("rope_type") in ("su", "yarn"):
        values["rope_parameters"]["rope_type"] = "longrope"
    values["rope_parameters"].setdefault("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if positive_ints(values, "hidden_size", "num_attention_heads") and hidden % heads:
        raise InputError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")


def _derive_gemma(values: dict, raw) -> None:
    """GemmaConfig: the legacy hidden_act "gelu" of the official releases means the tanh approximation."""
    if values["hidden_act"] == "gelu":
        values["hidden_act"] = "gelu_pytorch_tanh"
    values["rope_parameters"] = _rope_parameters(values, raw)
    _layer_types(values, raw.get("layer_types"), supported=False)


def _derive_mixtral(values: dict, raw) -> None:
    """MixtralConfig: num_key_value_heads defaults to the heads; head_dim stays None unless given
    (the attention then takes hidden_size / heads)."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = _rope_parameters(values, raw, default_theta=1e6)  # MixtralConfig's default
    _layer_types(values, raw.get("layer_types"), supported=False)
    if values["num_experts_per_tok"] > values["num_local_experts"]:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} exceeds num_local_experts={values['num_local_experts']}")


def _derive_qwen3_moe(values: dict, raw) -> None:
    """Qwen3MoeConfig: the window only with use_sliding_window (then on every layer); dense layers
    (a plain MLP of intermediate_size) where mlp_only_layers names them or off every
    decoder_sparse_step-th layer."""
    if not values["use_sliding_window"]:
        values["sliding_window"] = None
    values["mlp_only_layers"] = values["mlp_only_layers"] or []
    values["rope_parameters"] = _rope_parameters(values, raw)
    if values["decoder_sparse_step"] < 1:
        raise InputError(f"decoder_sparse_step={values['decoder_sparse_step']}: transformers takes layer i + 1 modulo it; expected >= 1")
    if values["num_experts_per_tok"] > values["num_experts"]:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} exceeds num_experts={values['num_experts']}")


def _is_odd_rope_dim(head_dim) -> bool:
    # transformers lets tiny test heads (<= 4) through.
    return isinstance(head_dim, int) and head_dim > 4 and head_dim % 2 == 1


def _derive_llama(values: dict, raw) -> None:
    _derive(values, raw)
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if positive_ints(values, "hidden_size", "num_attention_heads") and hidden % heads:
        raise InputError(
            f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (LlamaConfig requires it, "
            "head_dim or not)"
        )


INTS = Kind("a list of ints", lambda v: isinstance(v, list) and all(INT.accepts(x) for x in v))


def _schema(model_type, class_name, fields, derive=_derive, aliases=None) -> ConfigSchema:
    common = {
        "hidden_act": (STR, "silu"), "rms_norm_eps": (FLOAT, 1e-6), "pad_token_id": (INT.optional(), None),
        "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None),
    }
    return ConfigSchema(model_type, class_name, {**common, **fields}, derive=derive, aliases=aliases or {},
                        consumed=("rope_scaling", "rope_theta", "partial_rotary_factor"))


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _sizes(*defaults) -> dict:
    return {name: (INT, d) for name, d in zip(_SIZES, defaults)}


CONFIGS = (
    _schema("llama", "LlamaConfig", {
        **_sizes(32000, 4096, 11008, 32, 32), "num_key_value_heads": (INT.optional(), None),
        "max_position_embeddings": (INT, 2048), "initializer_range": (unit_float(), 0.02),
        "attention_bias": (BOOL, False), "mlp_bias": (BOOL, False), "head_dim": (INT.optional(), None),
    }, derive=_derive_llama),
    _schema("mistral", "MistralConfig", {
        **_sizes(32000, 4096, 14336, 32, 32), "num_key_value_heads": (INT, 8), "head_dim": (INT.optional(), None),
        "max_position_embeddings": (INT, 4096 * 32), "initializer_range": (FLOAT, 0.02),
        "sliding_window": (INT.optional(), 4096),
    }),
    _schema("qwen2", "Qwen2Config", {
        **_sizes(151936, 4096, 22016, 32, 32), "num_key_value_heads": (INT.optional(), 32),
        "max_position_embeddings": (INT, 32768), "initializer_range": (FLOAT, 0.02),
        "use_sliding_window": (BOOL, False), "sliding_window": (INT.optional(), 4096), "max_window_layers": (INT, 28),
        "layer_types": (STRINGS.optional(), None),
    }),
    _schema("phi3", "Phi3Config", {
        **_sizes(32064, 3072, 8192, 32, 32), "num_key_value_heads": (INT.optional(), None),
        "max_position_embeddings": (INT, 4096), "original_max_position_embeddings": (INT, 4096), "initializer_range": (FLOAT, 0.02),
        "rms_norm_eps": (FLOAT, 1e-5), "sliding_window": (INT.optional(), None), "pad_token_id": (INT.optional(), 32000),
    }, derive=_derive_phi3),
    _schema("mixtral", "MixtralConfig", {
        **_sizes(32000, 4096, 14336, 32, 32), "num_key_value_heads": (INT.optional(), 8), "head_dim": (INT.optional(), None),
        "max_position_embeddings": (INT, 4096 * 32), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
        "sliding_window": (INT.optional(), None), "num_experts_per_tok": (INT, 2), "num_local_experts": (INT, 8),
    }, derive=_derive_mixtral, aliases={"num_experts": "num_local_experts"}),
    _schema("qwen3_moe", "Qwen3MoeConfig", {
        **_sizes(151936, 2048, 6144, 24, 32), "num_key_value_heads": (INT, 4), "max_position_embeddings": (INT, 32768),
        "initializer_range": (FLOAT, 0.02), "attention_bias": (BOOL, False), "use_sliding_window": (BOOL, False),
        "sliding_window": (INT.optional(), 4096), "decoder_sparse_step": (INT, 1), "moe_intermediate_size": (INT, 768),
        "num_experts_per_tok": (INT, 8), "num_experts": (INT, 128), "norm_topk_prob": (BOOL, False),
        "mlp_only_layers": (INTS.optional(), None),
    }, derive=_derive_qwen3_moe, aliases={"num_local_experts": "num_experts"}),
    _schema("qwen3", "Qwen3Config", {
        **_sizes(151936, 4096, 22016, 32, 32), "num_key_value_heads": (INT.optional(), 32), "head_dim": (INT, 128),
        "max_position_embeddings": (INT, 32768), "initializer_range": (FLOAT, 0.02), "attention_bias": (BOOL, False),
        "use_sliding_window": (BOOL, False), "sliding_window": (INT.optional(), 4096), "max_window_layers": (INT, 28),
        "layer_types": (STRINGS.optional(), None),
    }),
)

LLAMA = Family(
    name="llama",
    configs=CONFIGS,
    stems=_STEMS,
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("norm", "final_norm", bias=False),
    heads=_HEADS,
    default_head="lm",  # a tied *ForCausalLM stores no lm_head.weight
    norm=Norm("rmsnorm", placement="pre", folds=_FOLDS),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: Decoder(config, layout, dtype, rngs=rngs),
    # Rotary-frequency buffers that some older Llama checkpoints saved: derived, never parameters.
    ignored=(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq",),
    head_geometry=_head_geometry,
)

def _derive_gemma2(values: dict, raw) -> None:
    """Gemma2Config: layer_types alternate sliding and full attention, starting with sliding."""
    if values["layer_types"] is None:
        values["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(values["num_hidden_layers"])]
    _layer_types(values, values["layer_types"], supported=True)
    if values["sliding_window"] is None and "sliding_attention" in values["layer_types"]:
        raise InputError("config.layer_types has 'sliding_attention' layers but sliding_window is not set")
    values["rope_parameters"] = _rope_parameters(values, raw)
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if positive_ints(values, "hidden_size", "num_attention_heads") and hidden % heads:
        raise InputError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (Gemma2Config requires it)")


def _sandwich_fields(vocab: int, positions: int, *, caps: tuple, bidirectional) -> dict:
    """Gemma2Config's and Gemma3TextConfig's fields: the same keys, these defaults apart (the
    final and attention soft-caps)."""
    return {
        **_sizes(vocab, 2304, 9216, 26, 8), "num_key_value_heads": (INT, 4), "head_dim": (INT, 256),
        "hidden_activation": (STR, "gelu_pytorch_tanh"), "max_position_embeddings": (INT, positions), "initializer_range": (FLOAT, 0.02),
        "rms_norm_eps": (FLOAT, 1e-6), "pad_token_id": (INT.optional(), 0), "tie_word_embeddings": (BOOL, True),
        "rope_parameters": (DICT.optional(), None), "attention_bias": (BOOL, False), "query_pre_attn_scalar": (INT, 256),
        "sliding_window": (INT.optional(), 4096), "layer_types": (STRINGS.optional(), None),
        "final_logit_softcapping": (FLOAT.optional(), caps[0]), "attn_logit_softcapping": (FLOAT.optional(), caps[1]),
        "use_bidirectional_attention": (BOOL.optional(), bidirectional),
    }


# Gemma 2: its norms are four per layer (HF post_attention_layernorm is the attention output's)
_GEMMA2_LAYER = (
    *(t for t in _LAYER if not t.hf.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))),
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/attention_post_norm", bias=False),
    *norm("layers.{i}.pre_feedforward_layernorm", "layers/{i}/mlp_norm", bias=False),
    *norm("layers.{i}.post_feedforward_layernorm", "layers/{i}/mlp_post_norm", bias=False),
)
# The sublayers' output gains have no reader to fold into: they only follow a permutation (a gain
# without readers stays as it is, `ResidualSpec.folds`).
_SANDWICH_FOLDS = _FOLDS + ((r"layers/(\d+)/(attention|mlp)_post_norm/scale", NO_READER),)

GEMMA2 = dataclasses.replace(
    LLAMA,
    name="gemma2",
    configs=(
        ConfigSchema("gemma2", "Gemma2Config", _sandwich_fields(256000, 8192, caps=(30.0, 50.0), bidirectional=None),
                     derive=_derive_gemma2, consumed=("rope_scaling", "rope_theta")),
    ),
    stems={"gemma2": "Gemma2"},
    layer=_GEMMA2_LAYER,
    heads=tuple(h for h in _HEADS if h.name != "question_answering"),
    norm=Norm("rmsnorm", placement="sandwich", gain="one_plus", folds=_SANDWICH_FOLDS),
    ignored=(),
)


def _derive_gemma3(values: dict, raw) -> None:
    """Gemma3TextConfig: layer_types from sliding_window_pattern (5 sliding, then 1 full, by
    default); RoPE parameters per layer type (full attention: rope_theta, 1e6 by default, and the
    legacy rope_scaling; sliding: rope_local_base_freq, 1e4); a bidirectional config's window as
    transformers halves it."""
    if values["use_bidirectional_attention"] and values["sliding_window"] is not None:
        values["sliding_window"] = values["sliding_window"] // 2 + 1
    if values["layer_types"] is None:
        pattern = raw.get("sliding_window_pattern", 6)
        values["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(values["num_hidden_layers"])]
    _layer_types(values, values["layer_types"], supported=True)
    given = values["rope_parameters"]
    params = {t: dict(p) for t, p in (given or {}).items()}
    if given is not None and not all(t in _ATTENTION_LAYER_TYPES and isinstance(p, dict) for t, p in given.items()):
        raise InputError(f"rope_parameters={given!r}: Gemma 3 gives them per layer type ({list(_ATTENTION_LAYER_TYPES)})")
    if raw.get("rope_scaling"):
        params.setdefault("full_attention", {"rope_type": "default"}).update(raw["rope_scaling"])
    for layer_type, key, theta in (("full_attention", "rope_theta", 1e6), ("sliding_attention", "rope_local_base_freq", 1e4)):
        p = params.setdefault(layer_type, {"rope_type": "default"})
        p.setdefault("rope_theta", theta if raw.get(key) is None else raw[key])
        params[layer_type] = _rope_parameters({**values, "rope_parameters": p, "layer_types": None}, {})
    values["rope_parameters"] = params


# Gemma 3 (text): Gemma 2's layers with QK-norm (gains 1 + w) and a RoPE base per layer type
GEMMA3 = dataclasses.replace(
    GEMMA2,
    name="gemma3",
    configs=(
        ConfigSchema("gemma3_text", "Gemma3TextConfig", _sandwich_fields(262208, 131072, caps=(None, None), bidirectional=False),
                     derive=_derive_gemma3, consumed=("rope_scaling", "rope_theta", "rope_local_base_freq", "sliding_window_pattern")),
    ),
    stems={"gemma3_text": "Gemma3Text"},
    heads=tuple(h for h in _HEADS if h.name in ("lm", "sequence_classification")),
    class_names={"Gemma3TextForCausalLM": "Gemma3ForCausalLM"},
)

# Gemma: the Llama family's tensors and forward pass, its own gain convention (1 + w: folding moves
# 1 + w into the readers and leaves w = 0) and heads (no question answering in transformers).
GEMMA = dataclasses.replace(
    LLAMA,
    name="gemma",
    configs=(
        _schema("gemma", "GemmaConfig", {
            **_sizes(256000, 3072, 24576, 28, 16), "num_key_value_heads": (INT, 16), "head_dim": (INT, 256), "hidden_act": (STR, "gelu_pytorch_tanh"),
            "max_position_embeddings": (INT, 8192), "initializer_range": (FLOAT, 0.02), "pad_token_id": (INT.optional(), 0),
            "tie_word_embeddings": (BOOL, True), "attention_bias": (BOOL, False), "use_bidirectional_attention": (BOOL.optional(), None),
        }, derive=_derive_gemma),
    ),
    stems={"gemma": "Gemma"},
    heads=tuple(h for h in _HEADS if h.name != "question_answering"),
    norm=Norm("rmsnorm", placement="pre", gain="one_plus", folds=_FOLDS),
    ignored=(),
)



def _derive_olmo2(values: dict, raw) -> None:
    """Olmo2Config: num_key_value_heads defaults to the heads; no layer types (every layer attends
    to the whole causal context)."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = _rope_parameters(values, raw)
    _layer_types(values, raw.get("layer_types"), supported=False)
    head_dim = raw.get("head_dim")
    if _is_odd_rope_dim(head_dim):
        raise InputError(f"head_dim={head_dim}: RoPE needs an even head dimension")


# OLMo-2: no norm before the sublayers, an RMSNorm on each sublayer's output (HF's
# post_attention_layernorm is the attention output's, post_feedforward_layernorm the MLP's), and
# QK-norm over all heads' q at once (gain (H*dh,)) and over all k (G*dh,), before RoPE.
_OLMO2_LAYER = (
    *(t for t in _LAYER if not t.hf.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/attention_post_norm", bias=False),
    *norm("layers.{i}.post_feedforward_layernorm", "layers/{i}/mlp_post_norm", bias=False),
)

OLMO2 = dataclasses.replace(
    LLAMA,
    name="olmo2",
    configs=(
        _schema("olmo2", "Olmo2Config", {
            **_sizes(50304, 4096, 11008, 32, 32), "num_key_value_heads": (INT.optional(), None), "max_position_embeddings": (INT, 2048),
            "initializer_range": (FLOAT, 0.02), "pad_token_id": (INT.optional(), 1), "attention_bias": (BOOL, False),
            "rms_norm_eps": (FLOAT, 1e-5),
        }, derive=_derive_olmo2),
    ),
    stems={"olmo2": "Olmo2"},
    layer=_OLMO2_LAYER,
    heads=tuple(h for h in _HEADS if h.name in ("lm", "sequence_classification")),
    # The stream is read raw; the sublayers' output gains have no reader (they follow a
    # permutation, with sign flips under RMSNorm); the final norm folds into the heads.
    norm=Norm("rmsnorm", placement="post", folds=((r"layers/(\d+)/(attention|mlp)_post_norm/scale", NO_READER), _FOLDS[-1])),
    ignored=(),
)


def _derive_olmoe(values: dict, raw) -> None:
    """OlmoeConfig: num_key_value_heads defaults to the heads; the head is hidden_size / heads (its
    q_norm spans hidden_size)."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = _rope_parameters(values, raw)
    _layer_types(values, raw.get("layer_types"), supported=False)
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if positive_ints(values, "hidden_size", "num_attention_heads") and hidden % heads:
        raise InputError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (OLMoE's q_norm spans hidden_size)")
    if values["num_experts_per_tok"] > values["num_experts"]:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} exceeds num_experts={values['num_experts']}")


# OLMoE: Llama's pre-norm layers, OLMo-2's full-width QK-norm, a mixture of experts in every layer
OLMOE = dataclasses.replace(
    LLAMA,
    name="olmoe",
    configs=(
        _schema("olmoe", "OlmoeConfig", {
            **_sizes(50304, 2048, 2048, 16, 16), "num_key_value_heads": (INT.optional(), None), "max_position_embeddings": (INT, 4096),
            "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5), "pad_token_id": (INT.optional(), 1),
            "attention_bias": (BOOL, False), "clip_qkv": (FLOAT.optional(), None), "num_experts_per_tok": (INT, 8),
            "num_experts": (INT, 64), "norm_topk_prob": (BOOL, False),
        }, derive=_derive_olmoe, aliases={"num_local_experts": "num_experts"}),
    ),
    stems={"olmoe": "Olmoe"},
    heads=tuple(h for h in _HEADS if h.name == "lm"),
    # a clamp of q, k and v elementwise: permutations and sign flips commute with it, V's rotations do not
    unsupported=(("clip_qkv", "q, k and v clamped elementwise, which no rotation of V commutes with"),),
    ignored=(),
)
