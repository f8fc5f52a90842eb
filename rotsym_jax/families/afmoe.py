"""AFMoE (model type afmoe: Arcee's Trinity models): grouped-query attention whose output is gated
per channel, Gemma 2's four norms a layer, and a mixture of experts with shared experts.

Per layer (H heads, G kv groups, dh = head_dim, all RMSNorms with their gain as stored):
    attention: RMSNorm (input_layernorm), q/k/v/o (biases with attention_bias), an RMSNorm over
        each head's q and k (q_norm, k_norm: one gain of dh for all heads), RoPE (rotate_half, the
        whole head) on the sliding-window layers only (config.layer_types; by default every
        global_attn_every_n_layers-th layer attends to the whole context, without RoPE), then
        each head's output times sigmoid(gate_proj(x)) entry by entry before o_proj, and an
        RMSNorm on the result (post_attention_layernorm) before it joins the stream;
    MLP: RMSNorm (pre_mlp_layernorm), then a gated SiLU MLP in the first num_dense_layers layers,
        else a mixture: a sigmoid router (`mlp.router.gate`) whose choice of top k adds
        `mlp.expert_bias`, the picked (unbiased) scores normalised to sum to 1 and times
        route_scale weighting the experts, plus shared experts (one MLP of
        moe_intermediate_size x num_shared_experts); an RMSNorm (post_mlp_layernorm) on the sum.
    mup_enabled: the embedded tokens times sqrt(hidden_size).

The groups (each proven in transformers, tests/test_afmoe.py): the attention's kv-group and
query-head permutations (the gate's rows, tagged attn.g, with the query heads), Q/K sign flips of
whole rotary pairs (the QK-norm; also on the layers without RoPE), V/O sign flips of each entry and
scales (`HeadGeometry.gated_output`: the gate multiplies each entry of a head's output by its own
sigmoid, which diagonal maps of V/O pass through and no rotation does; V/O permutations of a head's
entries with the gate's rows keep the function too, but the element does not hold them); the dense
MLPs' and the shared experts' units (permutations and unit scales); the experts with their router
rows and expert_bias entries (every expert reachable: no routing groups), each expert's units; the
stream, permutations and sign flips only (its sublayer outputs pass norms whose gains cannot fold,
as Gemma 2's), the pre-norms' gains folded into their readers. A V/O rotation, or a rotation of
the stream, changes transformers' outputs.

Leaves (d = hidden_size, E = num_experts, f = moe_intermediate_size):
    embeddings/word/embedding (vocab, d); layers/{i}/attention_norm/scale (d,)
    layers/{i}/attention/{query,key,value,out} (+ biases), attention/gate/kernel (d, H dh),
        attention/{query,key}_norm/scale (dh,), layers/{i}/attention_post_norm/scale (d,)
    layers/{i}/mlp_norm/scale, layers/{i}/mlp_post_norm/scale (d,)
    layers/{i}/mlp/{gate,up,down} (dense layers); layers/{i}/moe/router/kernel (d, E),
        moe/score_correction (E,), moe/{gate,up}/kernel (E, d, f), moe/down/kernel (E, f, d);
        layers/{i}/shared_mlp/{gate,up,down}
    final_norm/scale (d,); lm_head/kernel (d, vocab) unless tied
Experts are read one tensor per expert (save_pretrained's `mlp.experts.{e}.*_proj`) or stacked
(`mlp.experts.gate_up_proj`, transformers 5's state dict) and written back as read.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry
from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema
from .deepseek import MIXTURE_FOLD, MIXTURE_RULES
from .family import (
    NO_READER,
    STACKED_GATE_UP,
    STACKED_TRANSPOSE,
    TRANSPOSE,
    Family,
    Norm,
    Tensor,
    attention_projections,
    embedding,
    gated_mlp,
    linear,
    norm,
)
from .llama._config import head_dim_of, kv_width, q_width, resolve_layer_types, rope_parameters_of, sizes
from .llama._tensors import HEADS as LLAMA_HEADS

_L = r"layers/(?P<layer>\d+)"


def _bias(c) -> bool:
    return c.attention_bias


def sparse_layer(c, i: int) -> bool:
    return i >= c.num_dense_layers


def _dense_layer(c, i: int) -> bool:
    return not sparse_layer(c, i)


def _experts(c) -> int:
    return c.num_experts


def shared_width(c) -> int:
    return c.moe_intermediate_size * c.num_shared_experts


def _in(in_layer, tensors, stacked=None):
    return tuple(dataclasses.replace(t, in_layer=in_layer, stacked=stacked) for t in tensors)


_A, _AT, _MOE, _MOE_AT = "layers.{i}.self_attn", "layers/{i}/attention", "layers.{i}.mlp", "layers/{i}/moe"
_SHAPES = {"gate": (_experts, "hidden_size", "moe_intermediate_size"), "up": (_experts, "hidden_size", "moe_intermediate_size"),
           "down": (_experts, "moe_intermediate_size", "hidden_size")}

_LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *attention_projections(_A, _AT, q_width, kv_width, bias=_bias, out_bias=_bias),
    *linear(f"{_A}.gate_proj", f"{_AT}/gate", "hidden_size", q_width, bias=False, reads=True),
    *norm(f"{_A}.q_norm", f"{_AT}/query_norm", head_dim_of, bias=False, stream=False),
    *norm(f"{_A}.k_norm", f"{_AT}/key_norm", head_dim_of, bias=False, stream=False),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/attention_post_norm", bias=False),
    *norm("layers.{i}.pre_mlp_layernorm", "layers/{i}/mlp_norm", bias=False),
    *norm("layers.{i}.post_mlp_layernorm", "layers/{i}/mlp_post_norm", bias=False),
    *_in(_dense_layer, gated_mlp(_MOE, "layers/{i}/mlp")),
    *_in(sparse_layer, (
        Tensor(f"{_MOE}.router.gate.weight", (f"{_MOE_AT}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE),
        Tensor(f"{_MOE}.expert_bias", (f"{_MOE_AT}/score_correction",), ((_experts,),), (None,)),
        *gated_mlp(f"{_MOE}.shared_experts", "layers/{i}/shared_mlp", f=shared_width),
    )),
    # one tensor per expert, as save_pretrained writes them
    *_in(sparse_layer, tuple(
        Tensor(f"{_MOE}.experts.{{e}}.{proj}_proj.weight", (f"{_MOE_AT}/{proj}/kernel",), (_SHAPES[proj],), (2 if proj == "down" else 1,),
               TRANSPOSE, experts=_experts) for proj in ("gate", "up", "down")), stacked=False),
    # stacked, as transformers 5 holds them in memory
    *_in(sparse_layer, (
        Tensor(f"{_MOE}.experts.gate_up_proj", (f"{_MOE_AT}/gate/kernel", f"{_MOE_AT}/up/kernel"), (_SHAPES["gate"],) * 2, (1, 1), STACKED_GATE_UP),
        Tensor(f"{_MOE}.experts.down_proj", (f"{_MOE_AT}/down/kernel",), (_SHAPES["down"],), (2,), STACKED_TRANSPOSE),
    ), stacked=True),
)

# The pre-norms fold into their readers (the gate reads the attention's norm too); the output norms have none.
_FOLDS = (
    (r"layers/(\d+)/attention_norm/scale", r"layers/\1/attention/(query|key|value|gate)/kernel"),
    MIXTURE_FOLD,
    (r"layers/(\d+)/(attention|mlp)_post_norm/scale", NO_READER),
    (r"final_norm/scale", r"lm_head/kernel"),
)

# The gate on the heads' outputs: its rows follow the query heads (`spec.GATE_ROLE`).
_RULES = ((rf"{_L}/attention/gate/kernel", (None, "attn.g")), *MIXTURE_RULES)


def head_geometry(config) -> HeadGeometry:
    """GQA heads, RoPE over the whole head (where a layer takes it: the QK-norm's sign flips of
    whole pairs hold on the others too), a per-head QK-norm, the heads' outputs gated."""
    dh = head_dim_of(config)
    return HeadGeometry(config.num_attention_heads, config.num_key_value_heads, dh, rotary_dim=dh, qk_norm="head", gated_output=True)


_REQUIRED = ("num_dense_layers", "num_experts", "num_experts_per_tok", "num_shared_experts", "route_scale", "global_attn_every_n_layers")


def _derive(values: dict, raw) -> None:
    """AfmoeConfig: kv heads default to the heads; layer_types every global_attn_every_n_layers-th
    layer full, the others sliding; the sizes AfmoeForCausalLM builds from checked (it declares
    them optional, but cannot build a model where one is None)."""
    missing = [k for k in _REQUIRED if values[k] is None]
    if missing:
        raise InputError(f"{missing} are null: transformers' AfmoeModel builds its layers from them")
    if values["global_attn_every_n_layers"] < 1:
        raise InputError(f"global_attn_every_n_layers={values['global_attn_every_n_layers']}: expected >= 1")
    if values["layer_types"] is None:
        every = values["global_attn_every_n_layers"]
        values["layer_types"] = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(values["num_hidden_layers"])]
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    resolve_layer_types(values, values["layer_types"], supported=True)
    if values["sliding_window"] is None and "sliding_attention" in values["layer_types"]:
        raise InputError("config.layer_types has 'sliding_attention' layers but sliding_window is not set")
    values["rope_parameters"] = rope_parameters_of(values, raw)
    if values["num_experts_per_tok"] > values["num_experts"]:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} exceeds num_experts={values['num_experts']}")
    if values["num_shared_experts"] < 1:
        raise InputError(f"num_shared_experts={values['num_shared_experts']}: a shared MLP of width 0 is not read (expected >= 1)")


SCHEMA = ConfigSchema("afmoe", "AfmoeConfig", {
    **sizes(200192, 2048, 6144, 32, 16), "moe_intermediate_size": (INT, 1408), "num_dense_layers": (INT.optional(), 1),
    "num_key_value_heads": (INT.optional(), None), "head_dim": (INT.optional(), 128), "hidden_act": (STR, "silu"),
    "max_position_embeddings": (INT, 16384), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
    "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None), "num_experts": (INT.optional(), 64),
    "num_experts_per_tok": (INT.optional(), 6), "num_shared_experts": (INT.optional(), 2), "route_scale": (FLOAT.optional(), 1.0),
    "global_attn_every_n_layers": (INT.optional(), 4), "sliding_window": (INT.optional(), 1024), "layer_types": (STRINGS.optional(), None),
    "mup_enabled": (BOOL.optional(), False), "pad_token_id": (INT.optional(), None), "attention_bias": (BOOL, False),
}, derive=_derive, consumed=("rope_scaling", "rope_theta"))


AFMOE = Family(
    name="afmoe",
    configs=(SCHEMA,),
    stems={"afmoe": "Afmoe"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("norm", "final_norm", bias=False),
    heads=tuple(h for h in LLAMA_HEADS if h.name == "lm"),  # transformers has no other Afmoe head
    default_head="lm",
    norm=Norm("rmsnorm", placement="sandwich", folds=_FOLDS),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.afmoe.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry,
    rules=_RULES,
)
