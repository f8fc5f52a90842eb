"""The DeepSeek-V2 and V3 forward pass in Flax NNX (their records: `families/deepseek.py`; GLM-4-MoE's,
`families/glm4_moe.py`, EXAONE MoE's and dots.llm1's, too; GLM-4.7-Flash's, DeepSeek-V3's placed by mlp_layer_types; MiniCPM3's,
dense with its scalars): multi-head latent attention (or GLM's, EXAONE 4's or Qwen3's grouped-query attention), the
routers (V3's and GLM's sigmoid with group-limited choice, V2's softmax), shared experts, and the
decoder."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...errors import InputError
from .. import dots1, exaone_moe, glm4_moe
from ..deepseek import sparse_layer
from ..family import Layout
from ..llama._config import is_tied, rope_inv_freq
from ..llama._tensors import token_bias_of
from . import heads
from .layers import MLP, Attention, MoE, QKNorm, RMSNorm, WordEmbeddings, apply_rope, attention_bias, dense, rope_cos_sin, run_layers

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps, not rms_norm_eps
LATENT_EPS = 1e-6


def interleaved_rope(x, cos, sin):
    """DeepSeek's RoPE on interleaved pairs (2i, 2i + 1), its output in the rotate_half order
    (the even entries' results, then the odd ones'), as transformers computes it."""
    half = cos.shape[-1] // 2
    cos, sin = (a[:, :, None, :half].astype(x.dtype) for a in (cos, sin))
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)


class LatentAttention(nnx.Module):
    """Multi-head latent attention (MLA): leaves as `families/deepseek.py` lists them."""

    def __init__(self, config, *, dtype, rngs, std):
        d, h = config.hidden_size, config.num_attention_heads
        self.h, self.nope, self.rope, self.v = h, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        kw = dict(dtype=dtype, rngs=rngs, std=std)
        bias = config.attention_bias
        if config.q_lora_rank is None:
            self.query, self.query_rope = dense(d, h * self.nope, bias=False, **kw), dense(d, h * self.rope, bias=False, **kw)
        else:
            q = config.q_lora_rank
            self.query_down = dense(d, q, bias=bias, **kw)
            self.query_down_norm = RMSNorm(q, eps=LATENT_EPS, dtype=dtype)
            self.query_up, self.query_up_rope = dense(q, h * self.nope, bias=False, **kw), dense(q, h * self.rope, bias=False, **kw)
        kv = config.kv_lora_rank
        self.kv_down, self.key_rope = dense(d, kv, bias=bias, **kw), dense(d, self.rope, bias=bias, **kw)
        self.kv_down_norm = RMSNorm(kv, eps=LATENT_EPS, dtype=dtype)
        self.key, self.value = dense(kv, h * self.nope, bias=False, **kw), dense(kv, h * self.v, bias=False, **kw)
        self.out = dense(h * self.v, d, bias=bias, **kw)
        self.scale = _softmax_scale(config)
        self.interleaved = config.rope_interleave  # V2's config has none: its derive sets True (complex RoPE on pairs)

    def __call__(self, x, bias, rope):
        b, t, _ = x.shape
        if hasattr(self, "query"):
            q_nope, q_rot = self.query(x), self.query_rope(x)
        else:
            latent = self.query_down_norm(self.query_down(x))
            q_nope, q_rot = self.query_up(latent), self.query_up_rope(latent)
        latent = self.kv_down_norm(self.kv_down(x))
        k_nope, v = self.key(latent).reshape(b, t, self.h, self.nope), self.value(latent).reshape(b, t, self.h, self.v)
        q_nope, q_rot, k_rot = q_nope.reshape(b, t, self.h, self.nope), q_rot.reshape(b, t, self.h, self.rope), self.key_rope(x)[:, :, None]
        positional = interleaved_rope if self.interleaved else apply_rope
        q_rot, k_rot = positional(q_rot, *rope), positional(k_rot, *rope)
        scores = (jnp.einsum("bthd,bshd->bhts", q_nope, k_nope) + jnp.einsum("bthd,bsd->bhts", q_rot, k_rot[:, :, 0])).astype(jnp.float32)
        probs = jax.nn.softmax(scores * self.scale + bias, axis=-1).astype(v.dtype)
        return self.out(jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, self.h * self.v))


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _softmax_scale(config) -> float:
    """(n + r)^-1/2, times YaRN's mscale squared where the RoPE parameters set mscale_all_dim."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = config.rope_parameters or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        scale *= _mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


def _longrope(config, factors) -> np.ndarray:
    dim = config.qk_rope_head_dim
    shape = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    return (1.0 / (np.asarray(factors, np.float32) * np.float32(config.rope_parameters["rope_theta"]) ** shape)).astype(np.float32)


def long_rope_of(config) -> tuple[np.ndarray, int] | None:
    """LongRoPE (MiniCPM3-4B's): the inverse frequencies of long_factor and the original context
    past which transformers uses them for the whole batch (max position + 1 beyond it); None for
    the other rope types."""
    params = config.rope_parameters or {}
    if params.get("rope_type") != "longrope":
        return None
    return _longrope(config, params["long_factor"]), int(params["original_max_position_embeddings"])


def rope_of(config) -> tuple[np.ndarray, float]:
    """The RoPE inverse frequencies (r/2,) and the factor on cos and sin: YaRN's (DeepSeek-V3's
    checkpoints) as transformers computes them, LongRoPE's short factors (MiniCPM3-4B's; the long
    ones: `long_rope_of`), else the shared rope types'."""
    params = config.rope_parameters or {}
    if params.get("rope_type") == "longrope":
        factor = params.get("factor") or config.max_position_embeddings / params["original_max_position_embeddings"]
        attention = params.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(params["original_max_position_embeddings"])) if factor > 1 else 1.0
        return _longrope(config, params["short_factor"]), float(attention)
    if params.get("rope_type") != "yarn":
        return rope_inv_freq(config), 1.0
    return yarn(params, config.qk_rope_head_dim)


def yarn(params: dict, dim: int) -> tuple[np.ndarray, float]:
    """YaRN's inverse frequencies (dim/2,) and factor on cos and sin from RoPE parameters `params`
    (a rope_type "yarn" set), over `dim` rotary entries, as transformers' _compute_yarn_parameters."""
    base, factor = params["rope_theta"], params["factor"]
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    attention = params.get("attention_factor")
    if attention is None:
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)

    def correction(rotations):  # the dimension whose wavelength fits `rotations` times in the original context
        return dim * math.log(params["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(params.get("beta_fast") or 32), correction(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    positions = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolated = 1 - ramp  # the fast dimensions keep their frequency, the slow ones are interpolated
    inv_freq = (1.0 / (factor * positions)) * (1 - extrapolated) + (1.0 / positions) * extrapolated
    return inv_freq.astype(np.float32), float(attention)


class GroupLimitedMoE(MoE):
    """DeepSeek-V3's routed experts: sigmoid scores; the choice adds `score_correction` and, with
    routing groups, keeps the `topk_group` groups whose two best scores sum highest; the picked
    (uncorrected) scores, normalised or not, times `scaling`, weight the experts. DeepSeek-V2's:
    softmax scores, greedy or (group_limited_greedy) zero outside the `topk_group` groups holding
    the best scores; the picked ones times `scaling`."""

    def __init__(self, config, *, dtype, rngs, std):
        if config.num_experts_per_tok is None:
            raise InputError("num_experts_per_tok is not set: the router picks no expert")
        self.v2 = config.model_type == "deepseek_v2"
        experts = config.num_experts if config.model_type == "exaone_moe" else config.n_routed_experts  # ExaoneMoeConfig's name
        super().__init__(config.hidden_size, config.moe_intermediate_size, experts, config.num_experts_per_tok,
                         act=config.hidden_act, normalize=config.norm_topk_prob and not self.v2, dtype=dtype, rngs=rngs, std=std)
        if not self.v2:
            self.score_correction = nnx.Param(jnp.zeros((experts,), jnp.float32))
        limited = not self.v2 or config.topk_method == "group_limited_greedy"
        self.groups, self.top_groups = (config.n_group or 1, config.topk_group or 1) if limited else (1, 1)
        self.scaling = config.routed_scaling_factor

    def weights(self, x):
        if self.v2:
            return self._softmax_weights(x)
        scores = jax.nn.sigmoid(self.router(x).astype(jnp.float32))
        choice = scores + self.score_correction[...].astype(jnp.float32)
        e = scores.shape[-1]
        if self.groups > 1:
            grouped = choice.reshape(*choice.shape[:-1], self.groups, e // self.groups)
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
            kept = jnp.sum(jax.nn.one_hot(jax.lax.top_k(group_scores, self.top_groups)[1], self.groups, dtype=bool), axis=-2) > 0
            choice = jnp.where(jnp.repeat(kept, e // self.groups, axis=-1), choice, -jnp.inf)
        picked = jax.lax.top_k(choice, self.top_k)[1]
        top = jnp.take_along_axis(scores, picked, axis=-1)
        if self.normalize:
            top = top / (jnp.sum(top, axis=-1, keepdims=True) + 1e-20)
        top = top * self.scaling
        return jnp.sum(jax.nn.one_hot(picked, e, dtype=top.dtype) * top[..., None], axis=-2)

    def _softmax_weights(self, x):
        scores = jax.nn.softmax(self.router(x).astype(jnp.float32), axis=-1)
        e = scores.shape[-1]
        if self.groups > 1:
            best = jnp.max(scores.reshape(*scores.shape[:-1], self.groups, e // self.groups), axis=-1)
            kept = jnp.sum(jax.nn.one_hot(jax.lax.top_k(best, self.top_groups)[1], self.groups, dtype=bool), axis=-2) > 0
            scores = jnp.where(jnp.repeat(kept, e // self.groups, axis=-1), scores, 0.0)
        top, picked = jax.lax.top_k(scores, self.top_k)
        top = top * self.scaling
        return jnp.sum(jax.nn.one_hot(picked, e, dtype=top.dtype) * top[..., None], axis=-2)


def _attention(config, *, dtype, rngs, std):
    """MLA (DeepSeek), or grouped-query attention with partial RoPE and an optional per-head
    QK-norm (GLM-4-MoE)."""
    if hasattr(config, "kv_lora_rank"):
        return LatentAttention(config, dtype=dtype, rngs=rngs, std=std)
    if config.model_type == "exaone_moe":  # EXAONE 4's attention: the QK-norm always, no biases
        return Attention(config.hidden_size, heads=exaone_moe.head_geometry(config), qkv_bias=False, out_bias=False,
                         qk_norm=QKNorm(config.rms_norm_eps), dtype=dtype, rngs=rngs, std=std)
    if config.model_type == "dots1":  # Qwen3's attention: the QK-norm always, q/k/v/o biases with attention_bias
        return Attention(config.hidden_size, heads=dots1.head_geometry(config), qkv_bias=config.attention_bias, out_bias=config.attention_bias,
                         qk_norm=QKNorm(config.rms_norm_eps), dtype=dtype, rngs=rngs, std=std)
    qk_norm = QKNorm(config.rms_norm_eps) if config.use_qk_norm else None
    return Attention(config.hidden_size, heads=glm4_moe.head_geometry(config), qkv_bias=config.attention_bias, out_bias=False,
                     qk_norm=qk_norm, dtype=dtype, rngs=rngs, std=std)


def minicpm3_scales(config) -> tuple[float | None, float | None, float | None]:
    """MiniCPM3's scalars (None elsewhere): on the embedded tokens (scale_emb), on each sublayer's
    output before it joins the stream (scale_depth / sqrt(layers)), the divisor of the LM's input
    (hidden_size / dim_model_base)."""
    if config.model_type != "minicpm3":
        return None, None, None
    return config.scale_emb, config.scale_depth / math.sqrt(config.num_hidden_layers), config.hidden_size / config.dim_model_base


class DecoderLayer(nnx.Module):
    def __init__(self, config, index, dtype, rngs):
        d, std, eps = config.hidden_size, config.initializer_range, config.rms_norm_eps
        self.residual_scale = minicpm3_scales(config)[1]
        self.attention_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.attention = _attention(config, dtype=dtype, rngs=rngs, std=std)
        self.mlp_norm = RMSNorm(d, eps=eps, dtype=dtype)
        kw = dict(act=config.hidden_act, gated=True, bias=getattr(config, "mlp_bias", False), dtype=dtype, rngs=rngs, std=std)
        if (config.mlp_layer_types[index] == "sparse") if config.model_type == "exaone_moe" else sparse_layer(config, index):
            self.moe = GroupLimitedMoE(config, dtype=dtype, rngs=rngs, std=std)
            shared = config.num_shared_experts if config.model_type == "exaone_moe" else config.n_shared_experts
            self.shared_mlp = MLP(d, config.moe_intermediate_size * shared, **kw)
        else:
            self.mlp = MLP(d, config.intermediate_size, **kw)

    def __call__(self, x, bias, rope):
        def scaled(y):
            return y if self.residual_scale is None else y * self.residual_scale

        x = x + scaled(self.attention(self.attention_norm(x), bias, rope))
        y = self.mlp_norm(x)
        return x + scaled(self.moe(y) + self.shared_mlp(y) if hasattr(self, "moe") else self.mlp(y))


class Decoder(nnx.Module):
    """DeepSeek-V3's decoder; head None (`*Model`), "lm", or a sequence or token classifier."""

    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler:
            raise InputError(f"{config.model_type} has no pooler: layout.pooler must be False")
        inv_freq, self.rope_factor = rope_of(config)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: part of the graph
        long = long_rope_of(config)
        self.long_rope = None if long is None else (tuple(float(f) for f in long[0]), long[1])
        embed_scale, _, self.lm_divisor = minicpm3_scales(config)
        self.embeddings = WordEmbeddings(config, dtype, rngs, scale=embed_scale)
        self.layers = nnx.List([DecoderLayer(config, i, dtype, rngs) for i in range(config.num_hidden_layers)])
        self.final_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        d, std = config.hidden_size, config.initializer_range
        self.lm = layout.head == "lm"
        self.lm_head = dense(d, config.vocab_size, bias=False, dtype=dtype, rngs=rngs, std=std) if self.lm and not is_tied(config) else None
        self.head = heads.decoder_head(layout.head, d, config, token_bias=token_bias_of(config), dtype=dtype, rngs=rngs, std=std)
        # EXAONE MoE: sliding-window layers; with a sliding_window set, RoPE on those only (transformers' Exaone4Attention);
        # dots1: sliding-window layers, RoPE on every layer (Qwen3's)
        window = getattr(config, "sliding_window", None) if config.model_type in ("exaone_moe", "dots1") else None
        sliding = [window is not None and t == "sliding_attention" for t in config.layer_types] if window is not None else [False] * len(self.layers)
        self.windows = tuple(window if s else None for s in sliding)
        self.no_rope = tuple(window is not None and not s and config.model_type == "exaone_moe" for s in sliding)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        rope = rope_cos_sin(self.inv_freq, position_ids)
        if self.long_rope is not None:  # LongRoPE: the long factors for the whole batch once it passes the original context
            past = jnp.max(position_ids) + 1 > self.long_rope[1]
            rope = tuple(jnp.where(past, long, short) for long, short in zip(rope_cos_sin(self.long_rope[0], position_ids), rope, strict=True))
        rope = tuple(a * self.rope_factor for a in rope)
        biases = {w: attention_bias(attention_mask, t, causal=True, sliding_window=w) for w in set(self.windows)}
        x = self.embeddings(input_ids)
        x = run_layers(self.layers, x, lambda i: (biases[self.windows[i]], None if self.no_rope[i] else rope))
        out = heads.decoder_outputs(self.final_norm(x), word=self.embeddings.word, lm_head=self.lm_head, lm=self.lm, head=self.head,
                                    input_ids=input_ids)
        if self.lm_divisor is not None and self.lm:  # MiniCPM3: the LM head's input divided (its head has no bias: the logits alike)
            out["logits"] = out["logits"] / self.lm_divisor
        return out
