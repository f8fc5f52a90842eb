"""Qwen2-MoE (model type qwen2_moe: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B; Qwen2MoeModel and its LM,
sequence, token and QA heads): Qwen2's pre-RMSNorm decoder layers and attention (q/k/v biases with
qkv_bias, no o bias, RoPE over the whole head), a sparse mixture in every decoder_sparse_step-th
layer not in mlp_only_layers (a dense SwiGLU of intermediate_size elsewhere), as Qwen3-MoE's, and
beside each mixture a shared expert.

Mixture (transformers' Qwen2MoeSparseMoeBlock, on the normed stream x): a router `mlp.gate` (E, d)
whose softmax picks each token's top num_experts_per_tok (renormalised with norm_topk_prob), every
expert a SwiGLU of moe_intermediate_size (stored per expert, `mlp.experts.{e}.*_proj`, as
save_pretrained writes them, or stacked, `mlp.experts.gate_up_proj` (E, 2f, d) and
`mlp.experts.down_proj` (E, d, f), as transformers 5 holds them: both read, the layout kept on
save); plus a shared expert (`mlp.shared_expert.{gate,up,down}_proj`, a SwiGLU of
shared_expert_intermediate_size on every token) times sigmoid(`mlp.shared_expert_gate`(x)), a (1, d)
linear of the normed stream.

Sliding windows as Qwen2MoeConfig sets them: sliding_window 0 unless use_sliding_window; the
default layer_types window every other layer (0, 2, ...) below max_window_layers.

The groups (each proven in transformers: tests/test_conformance.py, tests/test_qwen2_moe.py):
- head and kv-group permutations, QK rotations per rotary pair and scales, VO maps per kv group;
- the dense MLPs' units, the shared expert's units (gate and up together, their own group
  "shared_ffn"), the experts with the router's rows (the softmax and top-k permute with them) and
  each expert's units;
- the stream: permutations, signed permutations, rotations (RMSNorm; the MLP norm's gain folds into
  the router, every expert's, the shared expert's and the shared gate's input rows; the shared
  gate's kernel moves with the stream like the router's and no unit group touches it).

Leaves (Llama's, `families/llama/`, and in the sparse layers; f = moe_intermediate_size,
s = shared_expert_intermediate_size):
    layers/{i}/moe/router/kernel (d, E)                                  mlp.gate
    layers/{i}/moe/{gate,up}/kernel (E, d, f), moe/down/kernel (E, f, d) mlp.experts.*
    layers/{i}/shared_mlp/{gate,up}/kernel (d, s), shared_mlp/down/kernel (s, d)   mlp.shared_expert.*
    layers/{i}/shared_gate/kernel (d, 1)                                 mlp.shared_expert_gate
"""

from __future__ import annotations

import dataclasses

from ..errors import InputError
from .config import BOOL, FLOAT, INT, STRINGS
from .deepseek import MIXTURE_RULES
from .family import gated_mlp, linear
from .llama import LLAMA
from .llama._config import INTS, is_odd_rope_dim, resolve_layer_types, rope_parameters_of, schema, sizes, sparse_layer
from .llama._tensors import FOLDS, HEADS, LAYER


def _derive(values: dict, raw) -> None:
    """Qwen2MoeConfig.__post_init__: mlp_only_layers [] where null, sliding_window 0 without
    use_sliding_window, layer_types sliding on the even layers below max_window_layers (with
    use_sliding_window); and the checks of what transformers could not build or run."""
    values["mlp_only_layers"] = values["mlp_only_layers"] or []
    if not values["use_sliding_window"]:
        values["sliding_window"] = 0
    if values["layer_types"] is None:
        values["layer_types"] = [
            "sliding_attention" if (i + 1) % 2 and i < values["max_window_layers"] and values["use_sliding_window"] else "full_attention"
            for i in range(values["num_hidden_layers"])
        ]
    resolve_layer_types(values, values["layer_types"], supported=True)
    if "sliding_attention" in values["layer_types"] and not values["sliding_window"]:
        raise InputError(f"layer_types has 'sliding_attention' layers but sliding_window={values['sliding_window']!r} "
                         f"(use_sliding_window={values['use_sliding_window']}): transformers' window would hide every token")
    if values["num_key_value_heads"] is None:
        raise InputError("num_key_value_heads is null: Qwen2MoeAttention divides the heads by it")
    values["rope_parameters"] = rope_parameters_of(values, raw)
    if is_odd_rope_dim(raw.get("head_dim")):
        raise InputError(f"head_dim={raw['head_dim']}: RoPE needs an even head dimension")
    if values["decoder_sparse_step"] < 1:
        raise InputError(f"decoder_sparse_step={values['decoder_sparse_step']}: transformers takes layer i + 1 modulo it; expected >= 1")
    if values["num_experts"] > 0 and values["num_experts_per_tok"] > values["num_experts"]:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} exceeds num_experts={values['num_experts']}")


SCHEMA = schema("qwen2_moe", "Qwen2MoeConfig", {
    **sizes(151936, 2048, 5632, 24, 16), "num_key_value_heads": (INT.optional(), 16), "max_position_embeddings": (INT, 32768),
    "initializer_range": (FLOAT, 0.02), "use_sliding_window": (BOOL, False), "sliding_window": (INT.optional(), 4096),
    "max_window_layers": (INT, 28), "decoder_sparse_step": (INT, 1), "moe_intermediate_size": (INT, 1408),
    "shared_expert_intermediate_size": (INT, 5632), "num_experts_per_tok": (INT, 4), "num_experts": (INT, 60),
    "norm_topk_prob": (BOOL, False), "mlp_only_layers": (INTS.optional(), None), "qkv_bias": (BOOL, True),
    "layer_types": (STRINGS.optional(), None),
}, derive=_derive)


_SHARED = tuple(dataclasses.replace(t, in_layer=sparse_layer) for t in (
    *gated_mlp("layers.{i}.mlp.shared_expert", "layers/{i}/shared_mlp", f="shared_expert_intermediate_size"),
    *linear("layers.{i}.mlp.shared_expert_gate", "layers/{i}/shared_gate", "hidden_size", 1, bias=False, reads=True),
))

# The MLP norm's gain folds into every reader of the normed stream: dense MLP, router, experts, shared expert and its gate.
_FOLDS = (FOLDS[0], (r"layers/(\d+)/mlp_norm/scale", r"layers/\1/(mlp/(up|gate)|moe/(router|up|gate)|shared_mlp/(up|gate)|shared_gate)/kernel"),
          FOLDS[2])

QWEN2_MOE = dataclasses.replace(
    LLAMA,
    name="qwen2_moe",
    configs=(SCHEMA,),
    stems={"qwen2_moe": "Qwen2Moe"},
    layer=LAYER + _SHARED,
    heads=HEADS,  # Qwen2MoeForQuestionAnswering names its base model `model.` (the family's prefix)
    norm=dataclasses.replace(LLAMA.norm, folds=_FOLDS),
    # the shared expert's units are a permutation group of their own (DeepSeek's rules); its gate's
    # kernel (d, 1) moves with the stream alone
    rules=(*MIXTURE_RULES, (r"layers/(?P<layer>\d+)/shared_gate/kernel", None)),
    ignored=(),
)
