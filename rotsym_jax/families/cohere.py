"""Cohere (Command R): a parallel decoder layer (attention and a SwiGLU MLP read one LayerNorm of
the stream, without a bias, and both add to it), grouped-query attention with RoPE over the whole
head in the interleaved layout (pairs (2i, 2i + 1): its `rotate_half` takes x[..., ::2] and
x[..., 1::2]), q/k/v/o biases with `attention_bias`, and an LM head tied to the embedding by
default whose logits are multiplied by `logit_scale`.

Our q and k kernels (and biases) hold each head's entries in the rotate_half order (pairs
(i, i + dh/2)) every other family and the attention solvers use: the loader reorders them
(`family.interleaved_rotary`, as GPT-J's), the saver restores Cohere's. The same reordering of q
and of k leaves every score as it was, and RoPE on the reordered entries is Cohere's RoPE
reordered (its frequencies repeat_interleave'd over each pair), so the groups are Phi's.

Leaves (d = hidden_size, f = intermediate_size, H = heads, G = kv heads, dh = head_dim or d // H):
    embeddings/word/embedding        (vocab_size, d)     model.embed_tokens
    layers/{i}/attention_norm/scale  (d,)     input_layernorm (no bias; read by attention and MLP)
    layers/{i}/attention/query/kernel (d, H dh), key, value (d, G dh), biases with attention_bias
    layers/{i}/attention/out/kernel  (H dh, d), .../bias (d,) with attention_bias    self_attn.o_proj
    layers/{i}/mlp/{gate,up}/kernel (d, f), layers/{i}/mlp/down/kernel (f, d), no biases
    final_norm/scale                 (d,)     model.norm (no bias)
    task heads (run here):
        lm                       CohereForCausalLM: lm_head/kernel (d, V), no bias (the embedding where
                                 tied, the default); logits = h W * logit_scale
use_qk_norm (Command R+: a LayerNorm over each head's q and k with each head's own gains, which
no rotation of a rotary pair commutes with, nor a scale of q against k) is refused on load.

Cohere 2 (Command R7B, Command A; model type cohere2): Cohere's tensors and layers, its layers
sliding-window attention with RoPE or, every `sliding_window_pattern`-th (`layer_types`), full
attention without RoPE. The groups are Cohere's: a rotary pair's rotations are a subgroup of the
no-RoPE layers' rotations.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema
from .family import Family, Norm, Tensor, embedding, gated_mlp, interleaved_projection, linear, norm, pre_norm_folds
from .llama._config import head_dim_of, head_geometry_of, kv_width, q_width, resolve_layer_types, rope_parameters_of, sizes
from .phi import LM_HEAD


def _bias(config) -> bool:
    return config.attention_bias


def _rotated(proj: str, ours: str, heads: str, width) -> tuple[Tensor, ...]:
    """q_proj or k_proj, reordered from Cohere's interleaved pairs (RoPE over the whole head)."""
    return interleaved_projection(proj, ours, heads, head_dim_of, head_dim_of, width, bias=_bias)


_A = "layers.{i}.self_attn"
_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *_rotated(f"{_A}.q_proj", "layers/{i}/attention/query", "num_attention_heads", q_width),
    *_rotated(f"{_A}.k_proj", "layers/{i}/attention/key", "num_key_value_heads", kv_width),
    *linear(f"{_A}.v_proj", "layers/{i}/attention/value", "hidden_size", kv_width, bias=_bias, reads=True),
    *linear(f"{_A}.o_proj", "layers/{i}/attention/out", q_width, "hidden_size", bias=_bias, writes=True),
    *gated_mlp("layers.{i}.mlp", "layers/{i}/mlp"),
)


_HEADS = (LM_HEAD,)

# The one norm of a layer is read by Q/K/V and by the MLP's gate and up projections.
_READERS = pre_norm_folds("(up|gate)", r"lm_head")
_FOLDS = ((_READERS[0][0], r"layers/\1/(attention/(query|key|value)|mlp/(up|gate))/kernel"), _READERS[2])


def _derive(values: dict, raw) -> None:
    """CohereConfig: num_key_value_heads defaults to the heads; RoPE parameters from the legacy
    rope_theta / rope_scaling, theta 500000 by default."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters_of(values, raw, default_theta=500000.0)


SCHEMA = ConfigSchema("cohere", "CohereConfig", {
    **sizes(256000, 8192, 22528, 40, 64), "logit_scale": (FLOAT.optional(), 0.0625), "num_key_value_heads": (INT.optional(), None),
    "hidden_act": (STR, "silu"), "max_position_embeddings": (INT, 8192), "initializer_range": (FLOAT, 0.02),
    "layer_norm_eps": (FLOAT.optional(), 1e-5), "pad_token_id": (INT.optional(), 0), "tie_word_embeddings": (BOOL, True),
    "rope_parameters": (DICT.optional(), None), "attention_bias": (BOOL, False), "use_qk_norm": (BOOL.optional(), False),
}, derive=_derive, consumed=("rope_scaling", "rope_theta", "partial_rotary_factor"))


COHERE = Family(
    name="cohere",
    configs=(SCHEMA,),
    stems={"cohere": "Cohere"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("norm", "final_norm", bias=False),
    heads=_HEADS,
    default_head="lm",  # a tied *ForCausalLM stores no lm_head.weight
    norm=Norm("layernorm", placement="pre", folds=_FOLDS),
    rotary="rotate_half",  # as our leaves hold it (the loader reorders Cohere's pairs)
    build=lambda config, layout, dtype, rngs: rj.nets.phi.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry_of,
    unsupported=(("use_qk_norm", "a LayerNorm over each head's q and k with each head's own gains, which no rotation of a rotary "
                                 "pair commutes with"),),
    ignored=(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq",),
)


def _derive_cohere2(values: dict, raw) -> None:
    """Cohere2Config: Cohere's values, but RoPE theta 10000 by default; the head hidden_size / heads
    whatever config.json says; layer_types from sliding_window_pattern (every 4th layer full by default)."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters_of(values, raw)
    values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values["layer_types"] is None:
        pattern = raw.get("sliding_window_pattern", 4)
        values["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(values["num_hidden_layers"])]
    resolve_layer_types(values, values["layer_types"], supported=True)


COHERE2 = dataclasses.replace(
    COHERE,
    name="cohere2",
    configs=(ConfigSchema("cohere2", "Cohere2Config", {
        **{k: v for k, v in SCHEMA.fields.items() if k != "use_qk_norm"}, "sliding_window": (INT.optional(), 4096),
        "layer_types": (STRINGS.optional(), None), "head_dim": (INT.optional(), None),
    }, derive=_derive_cohere2, consumed=("rope_scaling", "rope_theta", "partial_rotary_factor", "sliding_window_pattern")),),
    stems={"cohere2": "Cohere2"},
    unsupported=(),
)
