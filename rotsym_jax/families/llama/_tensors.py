"""The Llama-family tensor tables: each Hugging Face tensor and the leaf it becomes (fused Phi-3
projections split, experts stacked), the task heads, and the norm gains that fold."""

from __future__ import annotations

import dataclasses

from ..family import STACKED_GATE_UP, STACKED_TRANSPOSE, TRANSPOSE, Head, Tensor, gated_mlp, linear, norm, pre_norm_folds, split_rows
from ._config import (
    biases_of,
    dense_layer,
    dense_mlp,
    expert_width,
    experts_in_mlp,
    experts_of,
    gated,
    head_dim_of,
    is_mixtral,
    is_tied,
    kv_width,
    q_width,
    qk_norm_of,
    shared_expert,
    sparse_layer,
)


def token_bias_of(config) -> bool:
    return bool(getattr(config, "token_classification_bias", True))


# ---- the tensors and their leaves ------------------------------------------------------------------

def _intermediate(config) -> int:
    return config.intermediate_size


def _qkv_bias(config) -> bool:
    return biases_of(config)[0]


def _out_bias(config) -> bool:
    return biases_of(config)[1]


def _mlp_bias(config) -> bool:
    return biases_of(config)[2]


def _per_head_qk_norm(config) -> bool:
    return qk_norm_of(config) == "head"


def _full_qk_norm(config) -> bool:
    return qk_norm_of(config) == "full"


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
    return tuple(dataclasses.replace(t, in_layer=dense_layer) for t in _only(dense_mlp, tensors))


def _moe_tensors(block: str, router: str, gate: str, up: str, down: str, when) -> tuple[Tensor, ...]:
    """A sparse MoE block stored per expert (`{e}`), stacked into our leaves: the router (E, d)
    and each expert's gate, up (f, d) and down (d, f) projections; in the sparse layers only."""
    moe = "layers/{i}/moe"
    return tuple(dataclasses.replace(t, in_layer=sparse_layer, stacked=False) for t in _moe_leaves(block, router, gate, up, down, when, moe))


def _stacked_moe_tensors(when) -> tuple[Tensor, ...]:
    """The same mixture as transformers 5 holds it in memory, and as tools that save its state
    dict (mergekit) write it: `mlp.gate` and every expert's projections stacked in
    `mlp.experts.gate_up_proj` (E, 2f, d) and `mlp.experts.down_proj` (E, d, f)."""
    moe, block = "layers/{i}/moe", "layers.{i}.mlp"
    return tuple(dataclasses.replace(t, in_layer=sparse_layer, stacked=True) for t in (
        Tensor(f"{block}.gate.weight", (f"{moe}/router/kernel",), (("hidden_size", experts_of),), (0,), TRANSPOSE, when),
        Tensor(f"{block}.experts.gate_up_proj", (f"{moe}/gate/kernel", f"{moe}/up/kernel"), ((experts_of, "hidden_size", expert_width),) * 2,
               (1, 1), STACKED_GATE_UP, when),
        Tensor(f"{block}.experts.down_proj", (f"{moe}/down/kernel",), ((experts_of, expert_width, "hidden_size"),), (2,), STACKED_TRANSPOSE, when),
    ))


def _any_moe(config) -> bool:
    return is_mixtral(config) or experts_in_mlp(config)


def _moe_leaves(block, router, gate, up, down, when, moe) -> tuple[Tensor, ...]:
    return (
        Tensor(f"{block}.{router}.weight", (f"{moe}/router/kernel",), (("hidden_size", experts_of),), (0,), TRANSPOSE, when),
        Tensor(f"{block}.experts.{{e}}.{gate}.weight", (f"{moe}/gate/kernel",), ((experts_of, "hidden_size", expert_width),), (1,), TRANSPOSE, when,
               experts=experts_of),
        Tensor(f"{block}.experts.{{e}}.{up}.weight", (f"{moe}/up/kernel",), ((experts_of, "hidden_size", expert_width),), (1,), TRANSPOSE, when,
               experts=experts_of),
        Tensor(f"{block}.experts.{{e}}.{down}.weight", (f"{moe}/down/kernel",), ((experts_of, expert_width, "hidden_size"),), (2,), TRANSPOSE, when,
               experts=experts_of),
    )


def _shared_expert_tensors() -> tuple[Tensor, ...]:
    """Qwen2-MoE's shared expert beside each mixture (a SwiGLU of shared_expert_intermediate_size)
    and its gate `mlp.shared_expert_gate` (1, d), a reader of the normed stream; in the sparse layers."""
    return tuple(dataclasses.replace(t, in_layer=sparse_layer) for t in _only(shared_expert, (
        *gated_mlp("layers.{i}.mlp.shared_expert", "layers/{i}/shared_mlp", f="shared_expert_intermediate_size"),
        *linear("layers.{i}.mlp.shared_expert_gate", "layers/{i}/shared_gate", "hidden_size", 1, bias=False, reads=True),
    )))


_A = "layers.{i}.self_attn"


_QKV = tuple(f"layers/{{i}}/attention/{proj}/kernel" for proj in ("query", "key", "value"))


LAYER = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *_separately(linear(f"{_A}.q_proj", "layers/{i}/attention/query", "hidden_size", q_width, bias=_qkv_bias, reads=True)),
    *_separately(linear(f"{_A}.k_proj", "layers/{i}/attention/key", "hidden_size", kv_width, bias=_qkv_bias, reads=True)),
    *_separately(linear(f"{_A}.v_proj", "layers/{i}/attention/value", "hidden_size", kv_width, bias=_qkv_bias, reads=True)),
    Tensor(f"{_A}.qkv_proj.weight", _QKV, (("hidden_size", q_width), ("hidden_size", kv_width), ("hidden_size", kv_width)), (0, 0, 0),
           split_rows((q_width, kv_width, kv_width)), _fused),
    *linear(f"{_A}.o_proj", "layers/{i}/attention/out", q_width, "hidden_size", bias=_out_bias, writes=True),
    # QK-norm: over each head (one gain of head_dim), or over all heads at once (a gain per entry)
    *_only(_per_head_qk_norm, norm(f"{_A}.q_norm", "layers/{i}/attention/query_norm", head_dim_of, bias=False, stream=False)),
    *_only(_per_head_qk_norm, norm(f"{_A}.k_norm", "layers/{i}/attention/key_norm", head_dim_of, bias=False, stream=False)),
    *_only(_full_qk_norm, norm(f"{_A}.q_norm", "layers/{i}/attention/query_norm", q_width, bias=False, stream=False)),
    *_only(_full_qk_norm, norm(f"{_A}.k_norm", "layers/{i}/attention/key_norm", kv_width, bias=False, stream=False)),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm", bias=False),
    *_only(gated, _dense_separately(linear("layers.{i}.mlp.gate_proj", "layers/{i}/mlp/gate", "hidden_size", "intermediate_size", bias=_mlp_bias,
                                           reads=True))),
    *_dense_separately(linear("layers.{i}.mlp.up_proj", "layers/{i}/mlp/up", "hidden_size", "intermediate_size", bias=_mlp_bias, reads=True)),
    Tensor("layers.{i}.mlp.gate_up_proj.weight", ("layers/{i}/mlp/gate/kernel", "layers/{i}/mlp/up/kernel"),
           (("hidden_size", "intermediate_size"),) * 2, (0, 0), split_rows((_intermediate, _intermediate)), _fused),
    *_dense_layers(linear("layers.{i}.mlp.down_proj", "layers/{i}/mlp/down", "intermediate_size", "hidden_size", bias=_mlp_bias, writes=True)),
    *_moe_tensors("layers.{i}.block_sparse_moe", "gate", "w1", "w3", "w2", is_mixtral),
    *_moe_tensors("layers.{i}.mlp", "gate", "gate_proj", "up_proj", "down_proj", experts_in_mlp),
    *_stacked_moe_tensors(_any_moe),
    *_shared_expert_tensors(),
)


def _untied(config) -> bool:
    return not is_tied(config)


def _lm_tied(config):
    # {HF name: our leaf}, the direction rotsym_jax.hf reads it in.
    return {"lm_head.weight": "embeddings/word/embedding"} if is_tied(config) else {}


HEADS = (
    # A decoder's own LM head (untied) merges like the body: not under head/.
    Head("lm", "ForCausalLM",
         tuple(dataclasses.replace(t, when=_untied) for t in linear("lm_head", "lm_head", "hidden_size", "vocab_size", bias=False, reads=True)),
         markers=("lm_head.weight",), tied=_lm_tied, forward=True),
    Head("sequence_classification", "ForSequenceClassification",
         linear("score", "head/score", "hidden_size", "num_labels", bias=False, reads=True), forward=True),
    Head("token_classification", "ForTokenClassification",
         linear("score", "head/token_classifier", "hidden_size", "num_labels", bias=token_bias_of, reads=True), forward=True),
    Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", "hidden_size", 2, reads=True),
         markers=("qa_outputs.weight",), loss=False, forward=True,
         prefixes={"llama": "transformer.", "arcee": "transformer.", "exaone4": "transformer.", "qwen2": "transformer.", "qwen3": "transformer.", "qwen3_moe": "transformer.",
                   "smollm3": "transformer.", "ministral": "transformer.", "seed_oss": "transformer."}),
)


# The norms before attention, the MLP and the heads: each gain folds into the kernels that read it
# (the MLP norm's into a mixture's router and experts, and Qwen2-MoE's shared expert and its gate, too).
FOLDS = pre_norm_folds("(up|gate)|shared_mlp/(up|gate)|shared_gate", r"(lm_head|head/(score|token_classifier|qa_outputs))", moe=True)

# Qwen2-MoE's shared expert: its units a permutation group of their own (gate and up together, a
# gated unit's scale); its gate's kernel (d, 1) moves with the stream alone, as the router's rows.
_L = r"layers/(?P<layer>\d+)"
SHARED_EXPERT_RULES = (
    (rf"{_L}/shared_mlp/gate/kernel", (None, "shared_ffn")),
    (rf"{_L}/shared_mlp/up/kernel", (None, "shared_ffn.in")),
    (rf"{_L}/shared_mlp/down/kernel", ("shared_ffn.out", None)),
    (rf"{_L}/shared_gate/kernel", None),
)
