"""Building blocks shared by every model family.

Parameter leaves are laid out so that a per-head view is a reshape (MATH.md conventions):

    attention/query/kernel (d, H*dh)   attention/query/bias (H*dh,)   per head: (d, H, dh), (H, dh)
    attention/key/kernel   (d, G*dh)   attention/key/bias   (G*dh,)
    attention/value/kernel (d, G*dh)   attention/value/bias (G*dh,)
    attention/out/kernel   (H*dh, d)   attention/out/bias   (d,)    per head: (H, dh, d)
    mlp/up/kernel (d, f)  [mlp/gate/kernel (d, f)]  mlp/down/kernel (f, d)  (+ biases)

Query head h belongs to key/value group h // (H // G), the order of transformers' `repeat_kv`.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...errors import InputError
from ...precision import exact_jit, is_traced
from ...spec import HeadGeometry

BUCKETED_INIT = 1 << 22  # entries (16 MB of float32)


def normal_init(std):
    """transformers' weight init, normal(0, std = initializer_range) (biases: zeros): the values of
    `nnx.initializers.normal`, drawn by one program per power-of-two size instead of one per
    shape (an eager draw compiles a program for its shape: building the tests' models compiled
    hundreds). With threefry's partitionable counters, JAX's default, the first n values of a
    longer draw are the n-value draw itself (tests/test_precision.py pins it). A leaf past
    BUCKETED_INIT entries is drawn at its shape: its compile is small against its draw, and a
    padded draw would hold up to twice it."""
    def init(key, shape, dtype=jnp.float32):
        n = math.prod(shape)
        if (is_traced(key) or jnp.dtype(dtype) != jnp.float32 or not jax.config.jax_threefry_partitionable or n == 0
                or n > BUCKETED_INIT):
            return nnx.initializers.normal(stddev=std)(key, shape, dtype)
        flat = jax.random.normal(key, (1 << max(10, (n - 1).bit_length()),), dtype)
        return jax.device_put(np.asarray(flat)[:n].reshape(shape) * np.float32(std))  # uncommitted, as a draw is; jnp.asarray compiles per shape

    return init


class Dense(nnx.Linear):
    """nnx.Linear that, when `record` is set (by `rotsym_jax.stats`, under `nnx.capture`), sows
    its input as the intermediate `inputs`: the statistics that need every linear layer's inputs
    (RegMean Gram matrices, activation-based fusion) read them there."""

    record = False

    def __call__(self, x):
        if self.record:
            self.sow(nnx.Intermediate, "inputs", x)
        return super().__call__(x)


def run_layers(layers, x, args_of=lambda i: ()):
    """x through `layers` in order, layer i called as layer(x, *args_of(i)). A run of consecutive
    layers with one structure (their graphs equal) and the same arguments (the same objects) runs
    as one `jax.lax.scan` over their stacked weights: XLA then compiles one layer's program, not
    every layer's, and its backward pass (learned alignment's step) likewise. The stacked weights
    are a copy: a run stops at SCANNED_BYTES of them (past that, memory is worth more than the
    compile time a larger model's run takes anyway). A layer that records its inputs
    (`record_dense_inputs`) runs on its own, as its records are its own."""
    i, n = 0, len(layers)
    scannable = [_scannable(layer) for layer in layers]
    while i < n:
        graph, state = nnx.split(layers[i])
        args, states, j = args_of(i), [state], i + 1
        size = _bytes(state)
        while j < n and scannable[i] and scannable[j]:
            graph_j, state_j = nnx.split(layers[j])
            size += _bytes(state_j)
            if graph_j != graph or not _same(args_of(j), args) or size > SCANNED_BYTES:
                break
            states.append(state_j)
            j += 1
        x = layers[i](x, *args) if len(states) == 1 else _scanned(graph, states, x, args)
        i = j
    return x


def _scanned(graph, states: list, x, args: tuple):
    def body(h, weights):
        return nnx.merge(graph, weights)(h, *args), None

    return jax.lax.scan(body, x, jax.tree.map(lambda *leaves: jnp.stack(leaves), *states))[0]


SCANNED_BYTES = 1 << 30  # the most weights `run_layers` stacks for one scan


def _bytes(state) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))


def _scannable(layer) -> bool:
    return not any(getattr(module, "record", False) for _, module in nnx.iter_modules(layer))


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@partial(exact_jit, static_argnums=(0, 3))
def record_dense_inputs(graphdef, params, inputs, sites: bool = False):
    """Outputs and {kernel path: input of that linear layer} of one forward pass of the model
    `graphdef` with `params` on `inputs` (every `Dense` records its input, on a fresh copy). A
    layer called more than once (DeBERTa-v3's query and key, which also project the relative
    positions) records its first call's input, the tokens', under its path and the k-th call's
    under `path#k` (EXTRA_CALL). With `sites`, modules that are not linear layers but mark
    activation matching's sites (`site = True`: a Mamba-2 mixer's heads) record theirs too."""
    model = nnx.merge(graphdef, params)  # a fresh copy: setting `record` touches nothing else
    for _, module in nnx.iter_modules(model):
        if isinstance(module, (Dense, Experts)) or sites and getattr(module, "site", False):
            module.record = True
    out, recorded = nnx.capture(model, nnx.Intermediate)(**inputs)
    xs = {}
    for path, variable in nnx.to_flat_state(recorded):
        *module, _ = path
        path = "/".join(map(str, module)) + "/kernel"
        first, *later = variable.get_value()
        xs[path] = first
        for k, x in enumerate(later, 2):
            xs[f"{path}{EXTRA_CALL}{k}"] = x
    return out, xs


EXTRA_CALL = "#"  # `record_dense_inputs`: the k-th call's input of a layer called more than once is `path#k`


def dense(d_in, d_out, *, bias, dtype, rngs, std=0.02):
    """Dense with kernel (d_in, d_out), computing in the parameters' dtype."""
    return Dense(d_in, d_out, use_bias=bias, param_dtype=dtype, kernel_init=normal_init(std), rngs=rngs)


def embed(num, d, *, dtype, rngs, std=0.02):
    return nnx.Embed(num, d, param_dtype=dtype, embedding_init=normal_init(std), rngs=rngs)


class LayerNorm(nnx.Module):
    """LayerNorm with leaves `scale`, `bias` (none with bias=False: ModernBERT); statistics in
    float32 (two-pass variance, as torch). `one_plus` (Nemotron's LayerNorm1P): the leaf holds w
    and the gain is 1 + w; `scale=False` (OLMo 1): no gain and no bias at all."""

    def __init__(self, d, *, eps, dtype, bias: bool = True, one_plus: bool = False, scale: bool = True):
        self.eps, self.one_plus = eps, one_plus
        self.scale = (nnx.Param(jnp.zeros((d,), dtype) if one_plus else jnp.ones((d,), dtype))) if scale else None
        self.bias = nnx.Param(jnp.zeros((d,), dtype)) if bias and scale else None

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        if self.scale is not None:  # (Nemotron adds the 1 in the gain's own dtype, as transformers does)
            y = y * (self.scale[...] + 1 if self.one_plus else self.scale[...]).astype(jnp.float32)
        return (y if self.bias is None else y + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with leaf `scale`; normalises in float32, then scales in the input dtype (as HF Llama).
    `one_plus` (Gemma): the leaf holds w and the gain is 1 + w, applied in float32 before the cast."""

    def __init__(self, d, *, eps, dtype, one_plus: bool = False):
        self.eps, self.one_plus = eps, one_plus
        self.scale = nnx.Param(jnp.zeros((d,), dtype) if one_plus else jnp.ones((d,), dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
        if self.one_plus:
            return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return self.scale[...] * y.astype(x.dtype)


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


ACTIVATIONS = {
    "gelu": partial(jax.nn.gelu, approximate=False),
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # Arcee's and Nemotron's squared ReLU
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise InputError(
            f"unsupported activation {name!r} in config; supported: {sorted(ACTIVATIONS)}"
        ) from None


def attention_bias(attention_mask, q_len, *, causal, sliding_window=None, band=None):
    """Additive float32 attention bias of shape (B or 1, 1, q_len, k_len).

    `attention_mask` (B, k_len) has 1 for tokens to attend to and 0 for padding (or is None).
    `sliding_window` w lets query i see keys j with i - j < w (transformers' convention); `band` b
    (bidirectional, ModernBERT's local layers) keys j with |i - j| <= b.
    """
    k_len = q_len if attention_mask is None else attention_mask.shape[-1]
    allowed = jnp.ones((1, 1, q_len, k_len), bool)
    q_idx = jnp.arange(q_len)[:, None] + (k_len - q_len)
    k_idx = jnp.arange(k_len)[None, :]
    if causal:
        allowed = allowed & (k_idx <= q_idx)
    if sliding_window is not None:
        allowed = allowed & (q_idx - k_idx < sliding_window)
    if band is not None:
        allowed = allowed & (jnp.abs(q_idx - k_idx) <= band)
    if attention_mask is not None:
        allowed = allowed & attention_mask.astype(bool)[:, None, None, :]
    return jnp.where(allowed, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rope_cos_sin(inv_freq, position_ids):
    """cos, sin (B, T, rotary_dim) in float32 for `apply_rope`; each inverse frequency
    (rotary_dim/2,) repeated over both halves of the rotary part."""
    freqs = position_ids[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


class WordEmbeddings(nnx.Module):
    """A decoder's token embedding alone (leaf `word/embedding`): RoPE models have no position table.
    `scale`: a factor on the looked-up rows (Gemma's sqrt(hidden_size), in the table's dtype)."""

    def __init__(self, config, dtype, rngs, scale: float | None = None):
        self.word = embed(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs, std=config.initializer_range)
        self.scale = scale

    def __call__(self, input_ids):
        x = self.word(input_ids)
        return x if self.scale is None else x * jnp.asarray(self.scale, x.dtype)


def apply_rope(x, cos, sin):
    """HF `rotate_half` RoPE: x (B, T, N, dh); cos, sin (B, T, r), r <= dh: the first r entries
    rotate in pairs (i, i + r/2), the rest pass (partial rotary, GPT-NeoX)."""
    r = cos.shape[-1]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :r], x[..., r:]
    return jnp.concatenate([rot * cos + rotate_half(rot) * sin, rest], axis=-1)


@dataclasses.dataclass(frozen=True)
class QKNorm:
    """How an attention block norms q and k before RoPE (`HeadGeometry.qk_norm` says over what):
    an RMSNorm with `eps`, its gains stored as w for a gain of 1 + w with `one_plus` (Gemma);
    `after_rope` (HunYuan, a per-head norm only): after RoPE instead."""

    eps: float
    one_plus: bool = False
    after_rope: bool = False


@dataclasses.dataclass(frozen=True)
class Scores:
    """How an attention block scales its scores q.k: times `scale` (None: 1 / sqrt(head_dim)),
    then, with `softcap` (Gemma 2), softcap * tanh(scores / softcap), before the mask."""

    scale: float | None = None
    softcap: float | None = None


def multi_head(d: int, num_heads: int, head_dim: int | None = None) -> HeadGeometry:
    """The geometry of plain multi-head attention: `num_heads` heads of `head_dim` (d // num_heads) entries, no RoPE."""
    return HeadGeometry(num_heads, num_heads, head_dim or d // num_heads)


class Attention(nnx.Module):
    """Multi-head, grouped-query (num_kv_heads < num_heads) or multi-query (num_kv_heads = 1)
    self-attention. Leaves: query, key, value, out (each `kernel` and optional `bias`); `sinks`
    (H,) where a subclass sets it (GPT-OSS's): a logit per query head that joins its softmax beside
    the scores and is dropped after it."""

    sinks = None

    def __init__(self, d, *, heads: HeadGeometry, qkv_bias=True, out_bias=True, scores: Scores = Scores(), qk_norm: QKNorm | None = None,
                 key_bias: bool | None = None, dtype=jnp.float32, rngs, std=0.02):
        """`heads`: the heads' geometry (`multi_head` for plain multi-head attention); its
        `qk_norm` says over what q and k are normed, `qk_norm` here how (needed with it); its
        `gated_output` (AFMoE) adds leaf `gate`, (d, H*dh) without bias: the heads' outputs times
        sigmoid(gate(x)) entry by entry before `out`. `scores`: how the scores are scaled and capped."""
        if bool(heads.qk_norm) != (qk_norm is not None):
            raise InputError(f"heads.qk_norm={heads.qk_norm!r} with qk_norm={qk_norm!r}: a QK-norm needs both, its span and its eps")
        num_heads, num_kv_heads, head_dim = heads.num_heads, heads.num_kv_heads, heads.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim) if scores.scale is None else scores.scale
        self.softcap = scores.softcap
        kw = dict(dtype=dtype, rngs=rngs, std=std)
        self.query = dense(d, num_heads * head_dim, bias=qkv_bias, **kw)
        self.key = dense(d, num_kv_heads * head_dim, bias=qkv_bias if key_bias is None else key_bias, **kw)  # Whisper's has none
        self.value = dense(d, num_kv_heads * head_dim, bias=qkv_bias, **kw)
        self.out = dense(num_heads * head_dim, d, bias=out_bias, **kw)
        self.gate = dense(d, num_heads * head_dim, bias=False, **kw) if heads.gated_output else None
        # QK-norm, before RoPE: an RMSNorm over each head's entries with one gain for all heads (Qwen3,
        # Gemma 3), or over all heads' entries at once with a gain per entry ("full", OLMo-2).
        self.qk_norm_full = heads.qk_norm == "full"
        self.qk_norm_after_rope = qk_norm is not None and qk_norm.after_rope
        if self.qk_norm_after_rope and heads.qk_norm != "head":
            raise InputError(f"a QK-norm after RoPE is run over each head only (heads.qk_norm='head'), not {heads.qk_norm!r}")
        widths = (num_heads * head_dim, num_kv_heads * head_dim) if self.qk_norm_full else (head_dim, head_dim)
        self.query_norm, self.key_norm = (
            None if qk_norm is None else RMSNorm(w, eps=qk_norm.eps, dtype=dtype, one_plus=qk_norm.one_plus) for w in widths)

    def __call__(self, x, bias, rope=None, memory=None):
        """x (B, T, d); bias from `attention_bias`; rope = (cos, sin) or None; `memory` (B, S, d):
        what keys and values read in cross-attention (None: x)."""
        b, t, _ = x.shape
        h, g, dh = self.num_heads, self.num_kv_heads, self.head_dim
        source = x if memory is None else memory
        s = source.shape[1]
        q, k = self.query(x), self.key(source)
        if self.query_norm is not None and self.qk_norm_full:
            q, k = self.query_norm(q), self.key_norm(k)
        q, k = q.reshape(b, t, h, dh), k.reshape(b, s, g, dh)
        v = self.value(source).reshape(b, s, g, dh)
        if self.query_norm is not None and not self.qk_norm_full and not self.qk_norm_after_rope:
            q, k = self.query_norm(q), self.key_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.qk_norm_after_rope:
            q, k = self.query_norm(q), self.key_norm(k)
        q = q.reshape(b, t, g, h // g, dh)
        scores = jnp.einsum("btgrd,bsgd->bgrts", q, k).astype(jnp.float32) * self.scale
        if self.softcap is not None:
            scores = self.softcap * jnp.tanh(scores / self.softcap)
        scores = scores + bias[:, :, None]
        if self.sinks is None:
            probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        else:  # (b, g, r, t, s): head g * R + r's sink as one more key, dropped after the softmax
            sink = jnp.broadcast_to(self.sinks[...].astype(jnp.float32).reshape(1, g, h // g, 1, 1), scores.shape[:-1] + (1,))
            probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1].astype(v.dtype)
        ctx = jnp.einsum("bgrts,bsgd->btgrd", probs, v).reshape(b, t, h * dh)
        if self.gate is not None:
            ctx = ctx * jax.nn.sigmoid(self.gate(x))
        return self.out(ctx)


class XIELU(nnx.Module):
    """Apertus' xIELU activation, elementwise with a layer's scalars: alpha_p = softplus(a_p),
    alpha_n = beta + softplus(a_n); alpha_p x^2 + beta x where x > 0, else
    alpha_n (expm1(min(x, eps)) - x) + beta x. Leaves: a_p, a_n (1,) trained; beta, eps () the
    constants transformers saves beside them. Initialised as transformers initialises it."""

    def __init__(self, dtype, alpha_p=0.8, alpha_n=0.8, beta=0.5, eps=-1e-6):
        inverse_softplus = lambda v: jnp.log(jnp.expm1(jnp.asarray([v], dtype)))  # noqa: E731
        self.alpha_p, self.alpha_n = nnx.Param(inverse_softplus(alpha_p)), nnx.Param(inverse_softplus(alpha_n - beta))
        self.beta, self.eps = nnx.Param(jnp.asarray(beta, dtype)), nnx.Param(jnp.asarray(eps, dtype))

    def __call__(self, x):
        beta = self.beta[...]
        alpha_p, alpha_n = jax.nn.softplus(self.alpha_p[...]), beta + jax.nn.softplus(self.alpha_n[...])
        return jnp.where(x > 0, alpha_p * x * x + beta * x, (jnp.expm1(jnp.minimum(x, self.eps[...])) - x) * alpha_n + beta * x)


class MLP(nnx.Module):
    """Feed-forward block. Leaves: up, down, and gate when gated (down(act(gate(x)) * up(x))); act's
    own where the activation has parameters (xIELU)."""

    def __init__(self, d, f, *, act, gated=False, bias=True, dtype=jnp.float32, rngs, std=0.02):
        self.act = XIELU(dtype) if act == "xielu" else activation(act)
        kw = dict(bias=bias, dtype=dtype, rngs=rngs, std=std)
        if gated:
            self.gate = dense(d, f, **kw)
        self.up = dense(d, f, **kw)
        self.down = dense(f, d, **kw)
        self.gated = gated

    def __call__(self, x):
        hidden = self.act(self.gate(x)) * self.up(x) if self.gated else self.act(self.up(x))
        return self.down(hidden)


class Experts(nnx.Module):
    """One projection of every expert, stacked: leaf `kernel` (E, d_in, d_out). With `record` (as
    `Dense`), the MoE sows every expert's input to it, (..., E, d_in)."""

    record = False

    def __init__(self, experts, d_in, d_out, *, dtype, rngs, std=0.02):
        self.kernel = nnx.Param(normal_init(std)(rngs.params(), (experts, d_in, d_out), dtype))


class MoE(nnx.Module):
    """A sparse mixture of experts (Mixtral): the router's softmax over the experts picks each
    token's top k, their weights renormalised to sum to 1 (`normalize`) or not; each expert a gated
    MLP, down(act(gate(x)) * up(x)). Leaves: router/kernel (d, E), gate/kernel and up/kernel
    (E, d, f), down/kernel (E, f, d). Every expert runs on every token, weighted by zero where not
    picked: exact, at E/k times the sparse dispatch's work (the forward pass measures, it does not serve)."""

    def __init__(self, d, f, experts, top_k, *, act, normalize, dtype=jnp.float32, rngs, std=0.02):
        self.act, self.top_k, self.normalize = activation(act), top_k, normalize
        self.router = dense(d, experts, bias=False, dtype=dtype, rngs=rngs, std=std)
        kw = dict(dtype=dtype, rngs=rngs, std=std)
        self.gate, self.up, self.down = Experts(experts, d, f, **kw), Experts(experts, d, f, **kw), Experts(experts, f, d, **kw)

    def weights(self, x):
        """(B, T, E): each token's weight of every expert, zero where not picked."""
        probs = jax.nn.softmax(self.router(x).astype(jnp.float32), axis=-1)
        top, picked = jax.lax.top_k(probs, self.top_k)
        if self.normalize:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
        return jnp.sum(jax.nn.one_hot(picked, probs.shape[-1], dtype=top.dtype) * top[..., None], axis=-2)

    def __call__(self, x):
        weights = self.weights(x)
        hidden = self.act(jnp.einsum("btd,edf->btef", x, self.gate.kernel[...])) * jnp.einsum("btd,edf->btef", x, self.up.kernel[...])
        if self.down.record:  # every expert's hidden units, on every token (activation matching's site)
            self.down.sow(nnx.Intermediate, "inputs", hidden)
        out = jnp.einsum("btef,efd->bted", hidden, self.down.kernel[...])
        return jnp.einsum("bte,bted->btd", weights.astype(out.dtype), out)
