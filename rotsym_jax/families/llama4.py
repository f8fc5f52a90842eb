"""Llama 4's text model (model type llama4_text: Llama4ForCausalLM, the language model of Llama 4
Scout and Maverick): pre-RMSNorm decoder layers with grouped-query attention and, interleaved,
dense SwiGLU MLPs and mixtures of experts.

Attention: q/k/v/o (biases on all four with `attention_bias`); the layers `no_rope_layers` marks 1
rotate q and k in interleaved pairs (2i, 2i + 1) (as complex numbers), the others (NoPE, every
`no_rope_layer_interval`-th by default) take no RoPE and multiply q by a per-position temperature
(`attn_temperature_tuning`: 1 + attn_scale log(1 + floor((pos + 1) / floor_scale))); with
`use_qk_norm` each RoPE layer then divides each head's q and k by their RMS (an RMSNorm without
weights, after RoPE); the RoPE layers attend within chunks of `attention_chunk_size` tokens.
Our q and k kernels (and biases) hold each head's entries in the rotate_half order every solver
uses: the loader reorders them (`family.interleaved_rotary`, as GPT-J's and Cohere's), the saver
restores Llama 4's; the same reordering of q and of k leaves every score, every q and k norm (a
norm over a whole head) and the NoPE layers as they were.

Feed-forward: the layers in `moe_layers` (every `interleave_moe_layer_step`-th by default) hold a
mixture: a router (E, d) whose top-k logits pass a sigmoid, each chosen expert reading the token
times its score (the routed expert's input, not its output, is scaled), every expert a SwiGLU of
width intermediate_size stored fused (`experts.gate_up_proj` (E, d, 2f): [gate | up] columns,
`experts.down_proj` (E, f, d), both (in, out) as they multiply), beside a shared expert (a SwiGLU
of width intermediate_size) that reads every token; the other layers a dense SwiGLU of width
intermediate_size_mlp.

The groups (each proven in transformers: tests/test_llama4.py, tests/test_conformance.py):
- head and kv-group permutations; VO rotations, scales and invertible maps per kv group;
- QK: rotations of each rotary pair (a subgroup of the NoPE layers' rotations, which commute with
  RoPE and keep each head's RMS); without `use_qk_norm` (Maverick) scales and the pairs' 2x2
  scaled rotations too; with it (Scout) no scale and no other invertible map
  (`HeadGeometry.qk_norm="unit"`): the norm erases a scale of q against k only up to its eps, and
  a map that is not a rotation changes each head's RMS (tests/test_llama4.py shows both in
  transformers);
- the dense MLPs' units (permutations, a gated unit's scales), the shared expert's units, the
  experts with the router's rows (top-k and the sigmoid act on each expert's logit alone) and
  each expert's units (permuted);
- the stream: permutations, signed permutations and rotations (RMSNorm; the gains fold into
  q/k/v, the MLP's, the shared expert's, the router's and every expert's input rows).
Its forward pass (`nets/llama4.py`) computes transformers' outputs (tests/test_conformance.py), so
what runs the model (activation matching, Fisher and Gram statistics, barriers) runs on it; RegMean
refuses the experts' stacked kernels by name, as for every mixture.

Leaves (d = hidden_size, H = heads, G = kv heads, dh = head_dim, E = num_local_experts,
f = intermediate_size, F = intermediate_size_mlp; per layer i):
    embeddings/word/embedding            (V, d)         model.embed_tokens
    layers/{i}/attention_norm/scale      (d,)           input_layernorm
    layers/{i}/attention/{query,key,value}/kernel (d, H dh | G dh) (+ bias)   self_attn.{q,k,v}_proj
    layers/{i}/attention/out/kernel      (H dh, d) (+ bias)                    self_attn.o_proj
    layers/{i}/mlp_norm/scale            (d,)           post_attention_layernorm
    layers/{i}/mlp/{gate,up}/kernel (d, F), mlp/down/kernel (F, d)           dense: feed_forward.*_proj
    layers/{i}/moe/router/kernel (d, E)                                      feed_forward.router
    layers/{i}/moe/{gate,up}/kernel (E, d, f), moe/down/kernel (E, f, d)     feed_forward.experts.*
    layers/{i}/shared_mlp/{gate,up}/kernel (d, f), shared_mlp/down/kernel (f, d)   feed_forward.shared_expert
    final_norm/scale (d,)                model.norm
    lm_head/kernel (d, V)                Llama4ForCausalLM's lm_head (the embedding where tied)
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry
from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema
from .deepseek import MIXTURE_FOLD, MIXTURE_RULES
from .family import COPY, TRANSPOSE, Family, Norm, Tensor, embedding, gated_mlp, interleaved_projection, linear, norm, split
from .llama._config import INTS, head_dim_of, is_odd_rope_dim, kv_width, q_width, resolve_layer_types, rope_parameters_of, sizes
from .llama._tensors import HEADS as LLAMA_HEADS


def _bias(c) -> bool:
    return c.attention_bias


def sparse_layer(c, i: int) -> bool:
    """Whether layer i holds a mixture of experts (config.moe_layers)."""
    return i in c.moe_layers


def _dense_layer(c, i: int) -> bool:
    return not sparse_layer(c, i)


def _experts(c) -> int:
    return c.num_local_experts


def _in(in_layer, tensors):
    return tuple(dataclasses.replace(t, in_layer=in_layer) for t in tensors)


def _rotated(proj: str, ours: str, heads: str, width) -> tuple[Tensor, ...]:
    """q_proj or k_proj, reordered from Llama 4's interleaved pairs (RoPE over the whole head)."""
    return interleaved_projection(proj, ours, heads, head_dim_of, head_dim_of, width, bias=_bias)


_A, _FF, _MOE = "layers.{i}.self_attn", "layers.{i}.feed_forward", "layers/{i}/moe"
_EXPERT = (_experts, "hidden_size", "intermediate_size")

LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *_rotated(f"{_A}.q_proj", "layers/{i}/attention/query", "num_attention_heads", q_width),
    *_rotated(f"{_A}.k_proj", "layers/{i}/attention/key", "num_key_value_heads", kv_width),
    *linear(f"{_A}.v_proj", "layers/{i}/attention/value", "hidden_size", kv_width, bias=_bias, reads=True),
    *linear(f"{_A}.o_proj", "layers/{i}/attention/out", q_width, "hidden_size", bias=_bias, writes=True),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm", bias=False),
    *_in(_dense_layer, gated_mlp(_FF, "layers/{i}/mlp", f="intermediate_size_mlp")),
    *_in(sparse_layer, (
        Tensor(f"{_FF}.router.weight", (f"{_MOE}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE),
        # (E, d, 2f): each expert's gate columns, then its up columns, (in, out) as torch.bmm multiplies them
        Tensor(f"{_FF}.experts.gate_up_proj", (f"{_MOE}/gate/kernel", f"{_MOE}/up/kernel"), (_EXPERT, _EXPERT), (1, 1), split(2, axis=2)),
        Tensor(f"{_FF}.experts.down_proj", (f"{_MOE}/down/kernel",), ((_experts, "intermediate_size", "hidden_size"),), (2,), COPY),
        *gated_mlp(f"{_FF}.shared_expert", "layers/{i}/shared_mlp"),
    )),
)

_FOLDS = (
    (r"layers/(\d+)/attention_norm/scale", r"layers/\1/attention/(query|key|value)/kernel"),
    MIXTURE_FOLD,
    (r"final_norm/scale", r"lm_head/kernel"),
)


def head_geometry(config) -> HeadGeometry:
    """GQA heads, RoPE over the whole head (rotate_half pairs, as our leaves hold it); with
    use_qk_norm, a QK-norm without weights (rotations of the rotary pairs, no QK scale or other map)."""
    heads = config.num_attention_heads
    dh = head_dim_of(config)
    return HeadGeometry(heads, config.num_key_value_heads, dh, rotary_dim=dh, qk_norm="unit" if config.use_qk_norm else False)


def _derive(values: dict, raw) -> None:
    """Llama4TextConfig.__post_init__: no_rope_layers (where null or empty) a NoPE layer every
    no_rope_layer_interval-th, moe_layers every interleave_moe_layer_step-th layer, layer_types
    chunked attention on the RoPE layers (where attention_chunk_size is set); RoPE theta 500000
    by default."""
    n = values["num_hidden_layers"]
    if not values["no_rope_layers"]:
        interval = values["no_rope_layer_interval"]
        if interval < 1:
            raise InputError(f"no_rope_layer_interval={interval}: transformers takes layer i + 1 modulo it; expected >= 1")
        values["no_rope_layers"] = [int((i + 1) % interval != 0) for i in range(n)]
    if len(values["no_rope_layers"]) < n:
        raise InputError(f"no_rope_layers has {len(values['no_rope_layers'])} entries for num_hidden_layers={n}")
    if values["moe_layers"] is None:
        step = values["interleave_moe_layer_step"]
        if step < 1:
            raise InputError(f"interleave_moe_layer_step={step}: expected >= 1")
        values["moe_layers"] = list(range(step - 1, n, step))
    if values["layer_types"] is None:
        chunked = values["attention_chunk_size"] is not None
        values["layer_types"] = ["chunked_attention" if rope and chunked else "full_attention" for rope in values["no_rope_layers"]]
    resolve_layer_types(values, values["layer_types"], supported=False)
    values["rope_parameters"] = rope_parameters_of(values, raw, default_theta=500000.0)
    if is_odd_rope_dim(values["head_dim"]):
        raise InputError(f"head_dim={values['head_dim']}: RoPE needs an even head dimension")
    if values["num_experts_per_tok"] > values["num_local_experts"]:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} exceeds num_local_experts={values['num_local_experts']}")


SCHEMA = ConfigSchema("llama4_text", "Llama4TextConfig", {
    **sizes(202048, 5120, 8192, 48, 40), "intermediate_size_mlp": (INT, 16384), "num_key_value_heads": (INT, 8),
    "head_dim": (INT, 128), "hidden_act": (STR, "silu"), "max_position_embeddings": (INT, 4096 * 32),
    "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5), "pad_token_id": (INT.optional(), None),
    "tie_word_embeddings": (BOOL, False), "num_experts_per_tok": (INT, 1), "num_local_experts": (INT, 16),
    "moe_layers": (INTS.optional(), None), "interleave_moe_layer_step": (INT, 1), "use_qk_norm": (BOOL, True),
    "rope_parameters": (DICT.optional(), None), "no_rope_layers": (INTS.optional(), None), "no_rope_layer_interval": (INT, 4),
    "attention_chunk_size": (INT.optional(), 8192), "layer_types": (STRINGS.optional(), None), "attn_temperature_tuning": (BOOL, True),
    "floor_scale": (INT, 8192), "attn_scale": (FLOAT, 0.1), "attention_bias": (BOOL, False),
}, derive=_derive, consumed=("rope_scaling", "rope_theta"))


LLAMA4_TEXT = Family(
    name="llama4_text",
    configs=(SCHEMA,),
    stems={"llama4_text": "Llama4Text"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=LAYER,
    final=norm("norm", "final_norm", bias=False),
    heads=tuple(h for h in LLAMA_HEADS if h.name == "lm"),  # Llama4ForCausalLM, transformers' one text class with a head
    default_head="lm",
    norm=Norm("rmsnorm", placement="pre", folds=_FOLDS),
    rotary="rotate_half",  # as our leaves hold it (the loader reorders Llama 4's pairs)
    build=lambda config, layout, dtype, rngs: rj.nets.llama4.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry,
    rules=MIXTURE_RULES,
    class_names={"Llama4TextForCausalLM": "Llama4ForCausalLM"},
)
