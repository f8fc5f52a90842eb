"""The Llama-family records (`Family`): Llama, Mistral, Qwen2/3, Phi-3, Mixtral, Qwen3-MoE, Qwen2-MoE, and
the particulars of Gemma 1-3, OLMo-2 / OLMo 3 / OLMoE, EXAONE 3 and 4, Granite and Apertus."""

from __future__ import annotations

import dataclasses
import re

import rotsym_jax as rj

from ...errors import InputError
from ..config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema, Kind, check_number, positive_ints
from ..family import NO_READER, Family, Norm, Tensor, embedding, norm
from ._config import ATTENTION_LAYER_TYPES, CONFIGS, STEMS, derive_gemma, derive_llama, head_geometry_of, is_odd_rope_dim, resolve_layer_types, rope_parameters_of, schema, sizes
from ._tensors import FOLDS, HEADS, LAYER, SHARED_EXPERT_RULES

LLAMA = Family(
    name="llama",
    configs=CONFIGS,
    stems=STEMS,
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=LAYER,
    final=norm("norm", "final_norm", bias=False),
    heads=HEADS,
    default_head="lm",  # a tied *ForCausalLM stores no lm_head.weight
    norm=Norm("rmsnorm", placement="pre", folds=FOLDS),
    rotary="rotate_half",
    build=lambda config, layout, dtype, rngs: rj.nets.llama.Decoder(config, layout, dtype, rngs=rngs),
    # Rotary-frequency buffers that some older Llama checkpoints saved: derived, never parameters.
    ignored=(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq",),
    head_geometry=head_geometry_of,
    rules=SHARED_EXPERT_RULES,
)


def _derive_gemma2(values: dict, raw) -> None:
    """Gemma2Config: layer_types alternate sliding and full attention, starting with sliding."""
    if values["layer_types"] is None:
        values["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(values["num_hidden_layers"])]
    resolve_layer_types(values, values["layer_types"], supported=True)
    if values["sliding_window"] is None and "sliding_attention" in values["layer_types"]:
        raise InputError("config.layer_types has 'sliding_attention' layers but sliding_window is not set")
    values["rope_parameters"] = rope_parameters_of(values, raw)
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if positive_ints(values, "hidden_size", "num_attention_heads") and hidden % heads:
        raise InputError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (Gemma2Config requires it)")


def _sandwich_fields(vocab: int, positions: int, *, caps: tuple, bidirectional) -> dict:
    """Gemma2Config's and Gemma3TextConfig's fields: the same keys, these defaults apart (the
    final and attention soft-caps)."""
    return {
        **sizes(vocab, 2304, 9216, 26, 8), "num_key_value_heads": (INT, 4), "head_dim": (INT, 256),
        "hidden_activation": (STR, "gelu_pytorch_tanh"), "max_position_embeddings": (INT, positions), "initializer_range": (FLOAT, 0.02),
        "rms_norm_eps": (FLOAT, 1e-6), "pad_token_id": (INT.optional(), 0), "tie_word_embeddings": (BOOL, True),
        "rope_parameters": (DICT.optional(), None), "attention_bias": (BOOL, False), "query_pre_attn_scalar": (INT, 256),
        "sliding_window": (INT.optional(), 4096), "layer_types": (STRINGS.optional(), None),
        "final_logit_softcapping": (FLOAT.optional(), caps[0]), "attn_logit_softcapping": (FLOAT.optional(), caps[1]),
        "use_bidirectional_attention": (BOOL.optional(), bidirectional),
    }


# Gemma 2: its norms are four per layer (HF post_attention_layernorm is the attention output's)
_GEMMA2_LAYER = (
    *(t for t in LAYER if not t.hf.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))),
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/attention_post_norm", bias=False),
    *norm("layers.{i}.pre_feedforward_layernorm", "layers/{i}/mlp_norm", bias=False),
    *norm("layers.{i}.post_feedforward_layernorm", "layers/{i}/mlp_post_norm", bias=False),
)


# The sublayers' output gains have no reader to fold into: they only follow a permutation (a gain
# without readers stays as it is, `ResidualSpec.folds`).
_SANDWICH_FOLDS = FOLDS + ((r"layers/(\d+)/(attention|mlp)_post_norm/scale", NO_READER),)


GEMMA2 = dataclasses.replace(
    LLAMA,
    name="gemma2",
    configs=(
        ConfigSchema("gemma2", "Gemma2Config", _sandwich_fields(256000, 8192, caps=(30.0, 50.0), bidirectional=None),
                     derive=_derive_gemma2, consumed=("rope_scaling", "rope_theta")),
    ),
    stems={"gemma2": "Gemma2"},
    layer=_GEMMA2_LAYER,
    heads=tuple(h for h in HEADS if h.name != "question_answering"),
    norm=Norm("rmsnorm", placement="sandwich", gain="one_plus", folds=_SANDWICH_FOLDS),
    ignored=(),
)


def _derive_gemma3(values: dict, raw) -> None:
    """Gemma3TextConfig: layer_types from sliding_window_pattern (5 sliding, then 1 full, by
    default); RoPE parameters per layer type (full attention: rope_theta, 1e6 by default, and the
    legacy rope_scaling; sliding: rope_local_base_freq, 1e4); a bidirectional config's window as
    transformers halves it."""
    if values["use_bidirectional_attention"] and values["sliding_window"] is not None:
        values["sliding_window"] = values["sliding_window"] // 2 + 1
    if values["layer_types"] is None:
        pattern = raw.get("sliding_window_pattern", 6)
        values["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(values["num_hidden_layers"])]
    resolve_layer_types(values, values["layer_types"], supported=True)
    given = values["rope_parameters"]
    params = {t: dict(p) for t, p in (given or {}).items()}
    if given is not None and not all(t in ATTENTION_LAYER_TYPES and isinstance(p, dict) for t, p in given.items()):
        raise InputError(f"rope_parameters={given!r}: Gemma 3 gives them per layer type ({list(ATTENTION_LAYER_TYPES)})")
    if raw.get("rope_scaling"):
        params.setdefault("full_attention", {"rope_type": "default"}).update(raw["rope_scaling"])
    for layer_type, key, theta in (("full_attention", "rope_theta", 1e6), ("sliding_attention", "rope_local_base_freq", 1e4)):
        p = params.setdefault(layer_type, {"rope_type": "default"})
        p.setdefault("rope_theta", theta if raw.get(key) is None else raw[key])
        params[layer_type] = rope_parameters_of({**values, "rope_parameters": p, "layer_types": None}, {})
    values["rope_parameters"] = params


# Gemma 3 (text): Gemma 2's layers with QK-norm (gains 1 + w) and a RoPE base per layer type
GEMMA3 = dataclasses.replace(
    GEMMA2,
    name="gemma3",
    configs=(
        ConfigSchema("gemma3_text", "Gemma3TextConfig", _sandwich_fields(262208, 131072, caps=(None, None), bidirectional=False),
                     derive=_derive_gemma3, consumed=("rope_scaling", "rope_theta", "rope_local_base_freq", "sliding_window_pattern")),
    ),
    stems={"gemma3_text": "Gemma3Text"},
    heads=tuple(h for h in HEADS if h.name in ("lm", "sequence_classification")),
    class_names={"Gemma3TextForCausalLM": "Gemma3ForCausalLM"},
)


# Gemma: the Llama family's tensors and forward pass, its own gain convention (1 + w: folding moves
# 1 + w into the readers and leaves w = 0) and heads (no question answering in transformers).
GEMMA = dataclasses.replace(
    LLAMA,
    name="gemma",
    configs=(
        schema("gemma", "GemmaConfig", {
            **sizes(256000, 3072, 24576, 28, 16), "num_key_value_heads": (INT, 16), "head_dim": (INT, 256), "hidden_act": (STR, "gelu_pytorch_tanh"),
            "max_position_embeddings": (INT, 8192), "initializer_range": (FLOAT, 0.02), "pad_token_id": (INT.optional(), 0),
            "tie_word_embeddings": (BOOL, True), "attention_bias": (BOOL, False), "use_bidirectional_attention": (BOOL.optional(), None),
        }, derive=derive_gemma),
    ),
    stems={"gemma": "Gemma"},
    heads=tuple(h for h in HEADS if h.name != "question_answering"),
    norm=Norm("rmsnorm", placement="pre", gain="one_plus", folds=FOLDS),
    ignored=(),
)


def _derive_olmo2(values: dict, raw) -> None:
    """Olmo2Config: num_key_value_heads defaults to the heads; no layer types (every layer attends
    to the whole causal context)."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters_of(values, raw)
    resolve_layer_types(values, raw.get("layer_types"), supported=False)
    _check_head_dim(raw)


def _check_head_dim(raw) -> None:
    head_dim = raw.get("head_dim")
    if is_odd_rope_dim(head_dim):
        raise InputError(f"head_dim={head_dim}: RoPE needs an even head dimension")


# OLMo-2: no norm before the sublayers, an RMSNorm on each sublayer's output (HF's
# post_attention_layernorm is the attention output's, post_feedforward_layernorm the MLP's), and
# QK-norm over all heads' q at once (gain (H*dh,)) and over all k (G*dh,), before RoPE.
_OLMO2_LAYER = (
    *(t for t in LAYER if not t.hf.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/attention_post_norm", bias=False),
    *norm("layers.{i}.post_feedforward_layernorm", "layers/{i}/mlp_post_norm", bias=False),
)


OLMO2 = dataclasses.replace(
    LLAMA,
    name="olmo2",
    configs=(
        schema("olmo2", "Olmo2Config", {
            **sizes(50304, 4096, 11008, 32, 32), "num_key_value_heads": (INT.optional(), None), "max_position_embeddings": (INT, 2048),
            "initializer_range": (FLOAT, 0.02), "pad_token_id": (INT.optional(), 1), "attention_bias": (BOOL, False),
            "rms_norm_eps": (FLOAT, 1e-5),
        }, derive=_derive_olmo2),
    ),
    stems={"olmo2": "Olmo2"},
    layer=_OLMO2_LAYER,
    heads=tuple(h for h in HEADS if h.name in ("lm", "sequence_classification")),
    # The stream is read raw; the sublayers' output gains have no reader (they follow a
    # permutation, with sign flips under RMSNorm); the final norm folds into the heads.
    norm=Norm("rmsnorm", placement="post", folds=((r"layers/(\d+)/(attention|mlp)_post_norm/scale", NO_READER), FOLDS[-1])),
    ignored=(),
)


def _derive_olmo3(values: dict, raw) -> None:
    """Olmo3Config: num_key_value_heads defaults to the heads; layer_types sliding but every 4th layer; RoPE
    parameters per layer type (a legacy rope_scaling and rope_theta the full layers')."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values["layer_types"] is None:
        values["layer_types"] = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(values["num_hidden_layers"])]
    resolve_layer_types(values, values["layer_types"], supported=True)
    if values["sliding_window"] is None:
        raise InputError("sliding_window is null: Olmo3Model builds a sliding-window mask for every forward pass, which transformers "
                         "refuses without one")
    given = values["rope_parameters"]
    if given is not None and not all(t in ATTENTION_LAYER_TYPES and isinstance(p, dict) for t, p in given.items()):
        raise InputError(f"rope_parameters={given!r}: OLMo 3 gives them per layer type ({list(ATTENTION_LAYER_TYPES)})")
    params = {t: dict(p) for t, p in (given or {}).items()}
    if raw.get("rope_scaling"):
        params.setdefault("full_attention", {"rope_type": "default"}).update(raw["rope_scaling"])
    # as Olmo3Config pops a legacy rope_theta: into the full layers' parameters only (the sliding ones' theta 500000)
    for layer_type, theta in (("full_attention", raw.get("rope_theta", 500000.0)), ("sliding_attention", 500000.0)):
        p = params.setdefault(layer_type, {"rope_type": "default"})
        p.setdefault("rope_theta", theta)
        params[layer_type] = rope_parameters_of({**values, "rope_parameters": p, "layer_types": None}, {})
    values["rope_parameters"] = params
    _check_head_dim(raw)


# OLMo 3: OLMo-2's layers (norms on the sublayers' outputs, the full-width QK-norm), sliding windows on the layers
# layer_types marks (3 of 4 by default), RoPE parameters per layer type
OLMO3 = dataclasses.replace(
    OLMO2,
    name="olmo3",
    configs=(
        ConfigSchema("olmo3", "Olmo3Config", {
            **sizes(50304, 4096, 11008, 32, 32), "num_key_value_heads": (INT.optional(), None), "hidden_act": (STR, "silu"),
            "max_position_embeddings": (INT, 2048), "initializer_range": (FLOAT, 0.02), "pad_token_id": (INT.optional(), 1),
            "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None), "attention_bias": (BOOL, False),
            "rms_norm_eps": (FLOAT, 1e-5), "sliding_window": (INT.optional(), 4096), "layer_types": (STRINGS.optional(), None),
        }, derive=_derive_olmo3, consumed=("rope_scaling", "rope_theta")),
    ),
    stems={"olmo3": "Olmo3"},
)


def _derive_exaone4(values: dict, raw) -> None:
    """Exaone4Config: layer_types from sliding_window_pattern (every pattern-th layer full, the
    others sliding; no sliding layer without sliding_window), the full layers without RoPE where
    there are sliding ones (`layer_rope_parameters`)."""
    pattern = values["sliding_window_pattern"]
    if values["sliding_window"] is None:
        pattern = values["sliding_window_pattern"] = 0
    if values["layer_types"] is None:
        if not isinstance(pattern, int):
            raise InputError(f"sliding_window_pattern={pattern!r}: only a number of layers is read (the 'LLLG' pattern strings are not)")
        values["layer_types"] = ["sliding_attention" if pattern and (i + 1) % pattern else "full_attention"
                                 for i in range(values["num_hidden_layers"])]
    resolve_layer_types(values, values["layer_types"], supported=True)
    values["rope_parameters"] = rope_parameters_of(values, raw)
    _check_head_dim(raw)


# EXAONE 4: OLMo-2's layers (norms after the sublayers only) with a per-head QK-norm, sliding-window layers
# with RoPE and, every sliding_window_pattern-th layer, full attention without RoPE
EXAONE4 = dataclasses.replace(
    OLMO2,
    name="exaone4",
    configs=(
        schema("exaone4", "Exaone4Config", {
            **sizes(102400, 4096, 16384, 32, 32), "num_key_value_heads": (INT, 32), "max_position_embeddings": (INT, 2048),
            "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5), "sliding_window": (INT.optional(), 4096),
            "sliding_window_pattern": (Kind("an int or a string", lambda v: v is None or isinstance(v, (int, str))), 4),
            "layer_types": (STRINGS.optional(), None),
        }, derive=_derive_exaone4),
    ),
    stems={"exaone4": "Exaone4"},
    heads=HEADS,
)


def _derive_olmoe(values: dict, raw) -> None:
    """OlmoeConfig: num_key_value_heads defaults to the heads; the head is hidden_size / heads (its
    q_norm spans hidden_size)."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters_of(values, raw)
    resolve_layer_types(values, raw.get("layer_types"), supported=False)
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if positive_ints(values, "hidden_size", "num_attention_heads") and hidden % heads:
        raise InputError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (OLMoE's q_norm spans hidden_size)")
    if values["num_experts_per_tok"] > values["num_experts"]:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} exceeds num_experts={values['num_experts']}")


# OLMoE: Llama's pre-norm layers, OLMo-2's full-width QK-norm, a mixture of experts in every layer
OLMOE = dataclasses.replace(
    LLAMA,
    name="olmoe",
    configs=(
        schema("olmoe", "OlmoeConfig", {
            **sizes(50304, 2048, 2048, 16, 16), "num_key_value_heads": (INT.optional(), None), "max_position_embeddings": (INT, 4096),
            "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5), "pad_token_id": (INT.optional(), 1),
            "attention_bias": (BOOL, False), "clip_qkv": (FLOAT.optional(), None), "num_experts_per_tok": (INT, 8),
            "num_experts": (INT, 64), "norm_topk_prob": (BOOL, False),
        }, derive=_derive_olmoe, aliases={"num_local_experts": "num_experts"}),
    ),
    stems={"olmoe": "Olmoe"},
    heads=tuple(h for h in HEADS if h.name == "lm"),
    # a clamp of q, k and v elementwise: permutations and sign flips commute with it, V's rotations do not
    unsupported=(("clip_qkv", "q, k and v clamped elementwise, which no rotation of V commutes with"),),
    ignored=(),
)


def _derive_flex_olmo(values: dict, raw) -> None:
    """FlexOlmoConfig: as Olmo2Config with RoPE's theta 500000 by default (its default_theta); the router
    picks no more experts than there are."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters_of(values, raw, default_theta=500000.0)
    resolve_layer_types(values, raw.get("layer_types"), supported=False)
    _check_head_dim(raw)
    if values["num_experts_per_tok"] > values["num_experts"]:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} exceeds num_experts={values['num_experts']}")


# FlexOlmo: OLMo-2's layers (each sublayer's output normed, the full-width QK-norm) with OLMoE's mixture
# on every layer (a softmax router `mlp.gate`, top k renormalised with norm_topk_prob, experts of intermediate_size)
FLEX_OLMO = dataclasses.replace(
    OLMO2,
    name="flex_olmo",
    configs=(
        schema("flex_olmo", "FlexOlmoConfig", {
            **sizes(100352, 4096, 11008, 32, 32), "num_key_value_heads": (INT.optional(), None), "max_position_embeddings": (INT, 4096),
            "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-6), "pad_token_id": (INT.optional(), 100277),
            "attention_bias": (BOOL, False), "num_experts_per_tok": (INT, 5), "num_experts": (INT, 7), "norm_topk_prob": (BOOL, False),
        }, derive=_derive_flex_olmo, aliases={"num_local_experts": "num_experts"}),
    ),
    stems={"flex_olmo": "FlexOlmo"},
    heads=tuple(h for h in HEADS if h.name == "lm"),
)


# transformers declares Granite's multipliers `float | int`
NUMBER = Kind("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def _derive_granite(values: dict, raw) -> None:
    """GraniteConfig: as Olmo2Config (the head hidden_size / heads unless config.json names a
    head_dim); the four multipliers finite numbers."""
    _derive_olmo2(values, raw)
    for name in _MULTIPLIERS:
        check_number(name, values[name])
    if values["logits_scaling"] == 0:
        raise InputError("logits_scaling=0: the LM logits are divided by it")


# Granite: Llama's tensors (attention_bias on q/k/v/o, mlp_bias) and forward pass with four scalar
# multipliers (`_config.is_granite`), which commute with every group of Llama's; a causal LM only.
GRANITE = dataclasses.replace(
    LLAMA,
    name="granite",
    configs=(
        schema("granite", "GraniteConfig", {
            **sizes(32000, 4096, 11008, 32, 32), "num_key_value_heads": (INT.optional(), None), "max_position_embeddings": (INT, 2048),
            "initializer_range": (FLOAT, 0.02), "attention_bias": (BOOL, False), "mlp_bias": (BOOL, False),
            **{name: (NUMBER, 1.0) for name in _MULTIPLIERS},
        }, derive=_derive_granite),
    ),
    stems={"granite": "Granite"},
    heads=tuple(h for h in HEADS if h.name == "lm"),
)


def _derive_apertus(values: dict, raw) -> None:
    """ApertusConfig: Llama 3's scaled RoPE (theta 1.2e7) where config.json gives none; kv heads
    default to the heads; head_dim only where config.json names one (else hidden_size / heads)."""
    if not raw.get("rope_scaling") and values["rope_parameters"] is None:
        values["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0}
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    resolve_layer_types(values, raw.get("layer_types"), supported=False)
    values["rope_parameters"] = rope_parameters_of(values, raw, default_theta=12000000.0)
    _check_head_dim(raw)


def _xielu(config) -> bool:
    return config.hidden_act == "xielu"


# Apertus: pre-norm layers (its own norm names), a per-head QK-norm, an MLP without a gate whose
# xIELU activation holds two trained scalars and two constants per layer: elementwise, it commutes
# with the FFN's permutations (not with any rescaling: it is not homogeneous).
_APERTUS_LAYER = (
    *(t for t in LAYER if not t.hf.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))),
    *norm("layers.{i}.attention_layernorm", "layers/{i}/attention_norm", bias=False),
    *norm("layers.{i}.feedforward_layernorm", "layers/{i}/mlp_norm", bias=False),
    *(Tensor(f"layers.{{i}}.mlp.act_fn.{name}", (f"layers/{{i}}/mlp/act/{name}",), (shape,), (None,), when=_xielu)
      for name, shape in (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ()))),
)


APERTUS = dataclasses.replace(
    LLAMA,
    name="apertus",
    configs=(
        schema("apertus", "ApertusConfig", {
            **sizes(131072, 4096, 14336, 32, 32), "num_key_value_heads": (INT.optional(), None), "hidden_act": (STR, "xielu"),
            "max_position_embeddings": (INT, 65536), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
            "pad_token_id": (INT.optional(), 3), "attention_bias": (BOOL, False), "head_dim": (INT.optional(), None),
        }, derive=_derive_apertus),
    ),
    stems={"apertus": "Apertus"},
    layer=_APERTUS_LAYER,
    heads=tuple(h for h in HEADS if h.name in ("lm", "token_classification")),
    ignored=(),
)


def _derive_exaone(values: dict, raw) -> None:
    """ExaoneConfig: LlamaConfig's values with RoPE theta 5e5 where config.json gives none."""
    derive_llama(values, {**raw, "rope_theta": raw.get("rope_theta", 500000.0)})


# EXAONE 3.0 and 3.5's names for Llama's tensors (LG's own code's, which transformers 5 reads and
# writes as they are), from the names in `LAYER`
_EXAONE_NAMES = ((r"^layers\.", "h."), (r"\.self_attn\.o_proj\.", ".attn.attention.out_proj."), (r"\.self_attn\.", ".attn.attention."),
                 (r"\.input_layernorm\.", ".ln_1."), (r"\.post_attention_layernorm\.", ".ln_2."), (r"\.mlp\.gate_proj\.", ".mlp.c_fc_0."),
                 (r"\.mlp\.up_proj\.", ".mlp.c_fc_1."), (r"\.mlp\.down_proj\.", ".mlp.c_proj."))


def _exaone_name(name: str) -> str:
    for pattern, replacement in _EXAONE_NAMES:
        name = re.sub(pattern, replacement, name)
    return name


# EXAONE 3.0 / 3.5: transformers runs them as LlamaForCausalLM (its classes, saved in `architectures`)
EXAONE = dataclasses.replace(
    LLAMA,
    name="exaone",
    configs=(
        schema("exaone", "ExaoneConfig", {
            **sizes(102400, 4096, 14336, 32, 32), "num_key_value_heads": (INT.optional(), 8), "max_position_embeddings": (INT, 4096),
            "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5), "pad_token_id": (INT.optional(), 0),
            "attention_bias": (BOOL, False), "mlp_bias": (BOOL, False), "head_dim": (INT.optional(), None),
        }, derive=_derive_exaone,
           aliases={"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps", "activation_function": "hidden_act"}),
    ),
    stems={"exaone": "Llama"},
    prefix="transformer.",
    marker="wte.weight",
    embeddings=embedding("wte.weight", "embeddings/word/embedding", "vocab_size"),
    layer=tuple(dataclasses.replace(t, hf=_exaone_name(t.hf)) for t in LAYER),
    final=norm("ln_f", "final_norm", bias=False),
    heads=tuple(h for h in HEADS if h.name == "lm"),
    ignored=(),
)
