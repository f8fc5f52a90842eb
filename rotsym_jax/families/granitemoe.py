"""IBM Granite 3.0/3.1's mixtures of experts (model types granitemoe: GraniteMoeForCausalLM,
ibm-granite/granite-3.1-3b-a800m say; granitemoeshared: the same with a shared SwiGLU MLP beside the
experts where shared_intermediate_size > 0): Granite-4's hybrid (`families/granitemoehybrid.py`)
whose every layer is Llama's grouped-query attention with RoPE over the whole head (transformers
builds it whatever position_embedding_type says), then the mixture (a top-k router whose k logits
are softmaxed, experts stacked [gate; up]), after `post_attention_layernorm`. Granite's four
multipliers (embedding, residual, attention scale, logits' divisor) commute with every group.

Groups: the attention heads with their RoPE pairs (§1), the experts (§5), the shared MLP's units
("shared_ffn", GraniteMoeShared), the stream, pre-norm (§10). The hybrid's tables without its mixer,
read by its forward pass (`nets/granitemoehybrid.py`).

Leaves (per layer i): the hybrid's (`families/granitemoehybrid.py`) without `layers/{i}/mamba/`;
`layers/{i}/shared_mlp/` only in a GraniteMoeShared with a shared MLP. The mixture as transformers 5
names it (block_sparse_moe.router.weight, experts.gate_up_proj, experts.down_proj) or as IBM's
checkpoints do (router.layer.weight, input_linear.weight, output_linear.weight).
"""

from __future__ import annotations

import rotsym_jax as rj

from ..errors import InputError
from . import granitemoehybrid as hybrid
from .config import BOOL, DICT, FLOAT, INT, STR, ConfigSchema, check_number
from .family import Family
from .llama._config import rope_parameters_of


def _derive(values: dict, raw) -> None:
    """GraniteMoeConfig: kv heads default to the heads; RoPE from rope_parameters or the legacy keys;
    and what transformers' model fails on, refused here."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters_of(values, raw)
    for name in hybrid._MULTIPLIERS:
        check_number(name, values[name])
    if values["logits_scaling"] == 0:
        raise InputError("logits_scaling=0: the LM logits are divided by it")
    if values["hidden_act"] != "silu":
        raise InputError(f"hidden_act={values['hidden_act']!r}: rotsym_jax runs GraniteMoe's experts with silu only")
    heads, d = values["num_attention_heads"], values["hidden_size"]
    if heads <= 0 or d % heads:
        raise InputError(f"hidden_size={d} is not a multiple of num_attention_heads={heads}")
    # transformers' attention reads a head_dim that config.json sets beside the class's fields
    if raw.get("head_dim") not in (None, d // heads):
        raise InputError(f"head_dim={raw['head_dim']!r} differs from hidden_size / num_attention_heads = {d // heads}: rotsym_jax reads "
                         "GraniteMoe's heads as hidden_size / num_attention_heads wide")
    experts, k = values["num_local_experts"], values["num_experts_per_tok"]
    if experts <= 0 or not 0 < k <= experts:
        raise InputError(f"num_local_experts={experts}, num_experts_per_tok={k}: GraniteMoe's router picks 1 to num_local_experts "
                         "experts of at least one (transformers' model fails otherwise)")


_FIELDS = {
    "vocab_size": (INT, 32000), "hidden_size": (INT, 4096), "intermediate_size": (INT, 11008), "num_hidden_layers": (INT, 32),
    "num_attention_heads": (INT, 32), "num_key_value_heads": (INT.optional(), None), "hidden_act": (STR, "silu"),
    "max_position_embeddings": (INT, 2048), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-6), "pad_token_id": (INT.optional(), None),
    "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None), "attention_bias": (BOOL, False),
    **{name: (hybrid.NUMBER, 1.0) for name in hybrid._MULTIPLIERS},
    "num_local_experts": (INT, 8), "num_experts_per_tok": (INT, 2),
}
_CONSUMED = ("rope_scaling", "rope_theta")

SCHEMA = ConfigSchema("granitemoe", "GraniteMoeConfig", _FIELDS, derive=_derive, consumed=_CONSUMED)
SHARED_SCHEMA = ConfigSchema("granitemoeshared", "GraniteMoeSharedConfig", {**_FIELDS, "shared_intermediate_size": (INT, 0)}, derive=_derive,
                             consumed=_CONSUMED)


GRANITE_MOE = Family(
    name="granitemoe",
    configs=(SCHEMA, SHARED_SCHEMA),
    stems={"granitemoe": "GraniteMoe", "granitemoeshared": "GraniteMoeShared"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=hybrid.GRANITE_MOE_HYBRID.embeddings,
    layer=tuple(t for t in hybrid.GRANITE_MOE_HYBRID.layer if not t.hf.startswith("layers.{i}.mamba.")),
    final=hybrid.GRANITE_MOE_HYBRID.final,
    heads=hybrid.GRANITE_MOE_HYBRID.heads,
    default_head="lm",
    norm=hybrid.GRANITE_MOE_HYBRID.norm,
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.granitemoehybrid.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=hybrid.head_geometry,
    rules=hybrid._RULES,
)
