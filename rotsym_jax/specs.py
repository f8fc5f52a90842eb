"""The built-in spec of each model family (all families share one leaf naming scheme)."""

from __future__ import annotations

from .spec import HeadGeometry, Spec

_LAYER = r"layers/(?P<layer>\d+)"

# Leaves no symmetry group touches, listed explicitly so that a new leaf is never skipped silently.
# (The O bias and the FFN output bias live outside every head / hidden unit, MATH §1.)
_UNTOUCHED = (
    r"(embeddings|final_norm|pooler|head|lm_head)/.*"
    r"|layers/(?P<layer>\d+)/(attention_norm/.*|mlp_norm/.*|attention/out/bias|mlp/down/bias)"
)

RULES = (
    (rf"{_LAYER}/attention/query/kernel", (None, "attn.q")),
    (rf"{_LAYER}/attention/query/bias", ("attn.q",)),
    (rf"{_LAYER}/attention/key/kernel", (None, "attn.k")),
    (rf"{_LAYER}/attention/key/bias", ("attn.k",)),
    (rf"{_LAYER}/attention/value/kernel", (None, "attn.v")),
    (rf"{_LAYER}/attention/value/bias", ("attn.v",)),
    (rf"{_LAYER}/attention/out/kernel", ("attn.o", None)),
    (rf"{_LAYER}/mlp/(up|gate)/kernel", (None, "ffn")),
    (rf"{_LAYER}/mlp/(up|gate)/bias", ("ffn",)),
    (rf"{_LAYER}/mlp/down/kernel", ("ffn", None)),
    (_UNTOUCHED, None),
)


def head_geometry(config) -> HeadGeometry:
    """Head counts and width read from a transformers config (never assumed)."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    rope = config.model_type in ("llama", "mistral", "qwen2")
    return HeadGeometry(num_heads, num_kv_heads, head_dim, rotary_dim=head_dim if rope else None)


def spec_for(checkpoint_or_config) -> Spec:
    """The spec of a built-in family: per-head QK/VO groups of every layer's attention (GQA
    groups, RoPE pairs where the family uses RoPE) and the FFN hidden-unit permutation (gate and
    up together for gated FFNs)."""
    config = getattr(checkpoint_or_config, "config", checkpoint_or_config)
    return Spec(RULES, heads={"attn": head_geometry(config)})
