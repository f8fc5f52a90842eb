"""Jais 2 (Inception, Jais-2-8B): Llama's decoder (grouped-query attention, RoPE over the whole head,
an untied LM head by default) with LayerNorms (a gain and a bias, `nn.LayerNorm`) where Llama has its
RMSNorms, and Nemotron's MLP without a gate (down(relu2(up(x))) by default); biases on q/k/v/o with
`attention_bias` and on up/down with `mlp_bias`, both on by default. transformers has only
Jais2Model and Jais2ForCausalLM.

Leaves: Nemotron's (`families/nemotron.py`), every gain stored as is (no 1 + w); no classifier
heads. Folding a gain moves it into its readers and leaves 1, its bias beta / g in the readers'
biases as Nemotron's; the stream then takes rotations fixing the ones vector (LayerNorm centres
the width).
"""

from __future__ import annotations

import dataclasses

from .config import BOOL, DICT, FLOAT, INT, STR, ConfigSchema
from .family import Norm, pre_norm_folds
from .llama._config import derive_llama, sizes
from .nemotron import NEMOTRON

# Jais2Config: head_dim hidden_size / heads and num_key_value_heads the heads unless given, RoPE theta
# 10000, hidden_size a multiple of the heads (its validate_architecture): LlamaConfig's derivation
SCHEMA = ConfigSchema("jais2", "Jais2Config", {
    **sizes(150272, 3328, 26624, 32, 26), "head_dim": (INT.optional(), None), "num_key_value_heads": (INT.optional(), None),
    "hidden_act": (STR, "relu2"), "max_position_embeddings": (INT, 8192), "initializer_range": (FLOAT, 0.02), "layer_norm_eps": (FLOAT, 1e-5),
    "pad_token_id": (INT.optional(), None), "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None),
    "attention_bias": (BOOL, True), "mlp_bias": (BOOL, True),
}, derive=derive_llama, consumed=("rope_scaling", "rope_theta", "partial_rotary_factor"))


JAIS2 = dataclasses.replace(
    NEMOTRON,
    name="jais2",
    configs=(SCHEMA,),
    stems={"jais2": "Jais2"},
    heads=tuple(h for h in NEMOTRON.heads if h.name == "lm"),  # Jais2ForCausalLM is its one head
    norm=Norm("layernorm", placement="pre", folds=pre_norm_folds("up", r"lm_head")),
)
