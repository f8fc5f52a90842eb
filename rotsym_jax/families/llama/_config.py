"""What the Llama-family records read from config.json: the schemas of twelve model types as
transformers' config classes hold them, their derived values, and the predicates the tensor
tables and the forward pass ask (biases, QK-norm, tied heads, experts, sliding windows, RoPE)."""

from __future__ import annotations

import math

import numpy as np

from ...errors import InputError
from ...spec import HeadGeometry
from ..config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema, Kind, bad_value, check_number, positive_ints, unit_float

STEMS = {"llama": "Llama", "arcee": "Arcee", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3", "mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe",
         "qwen2_moe": "Qwen2Moe", "smollm3": "SmolLM3", "ministral": "Ministral", "seed_oss": "SeedOss"}


ROPE_TYPES = ("default", "linear", "llama3")


def head_dim_of(config) -> int:
    # Llama/Mistral configs fill head_dim; a Qwen2 config has one only when config.json names it.
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def q_width(config) -> int:
    """The width of all query heads (and of O's input)."""
    return config.num_attention_heads * head_dim_of(config)


def kv_width(config) -> int:
    """The width of all key (or value) heads."""
    return config.num_key_value_heads * head_dim_of(config)


def head_geometry_of(config) -> HeadGeometry:
    """GQA heads; RoPE on the first rotary_dim entries of each head (rotate_half pairs): the whole
    head, or Phi-3's partial_rotary_factor of it. The frequencies (the rope_type) do not matter
    to the symmetry; the rotary width does."""
    heads, dh = config.num_attention_heads, head_dim_of(config)
    return HeadGeometry(heads, getattr(config, "num_key_value_heads", None) or heads, dh, rotary_dim=rotary_dim_of(config), qk_norm=qk_norm_of(config))


def rotary_dim_of(config) -> int:
    factor = (config.rope_parameters or {}).get("partial_rotary_factor", 1.0)
    dh = head_dim_of(config)
    if factor != 1.0 and config.model_type not in ("phi3", "phi", "stablelm", "glm4_moe", "glm", "glm4", "nemotron"):
        raise InputError(f"partial_rotary_factor={factor} is not supported for {config.model_type} (only 1.0: RoPE over the whole head)")
    rotary = dh * factor
    if rotary != int(rotary) or int(rotary) % 2 or not rotary:
        raise InputError(f"partial_rotary_factor={factor} gives {rotary} rotary dims of a {dh}-wide head; an even whole number is supported")
    return int(rotary)


def qk_norm_of(config) -> bool | str:
    """Qwen3 and Gemma 3 normalise each head's q and k ("head": an RMSNorm over head_dim, one gain
    for all heads); OLMo-2 all heads' q at once, and k ("full": a gain per entry)."""
    if config.model_type in ("qwen3", "qwen3_moe", "gemma3_text", "exaone4", "apertus", "hunyuan_v1_dense", "hunyuan_v1_moe"):
        return "head"
    return "full" if config.model_type in ("olmo2", "olmoe", "flex_olmo", "olmo3") else False


def qk_norm_after_rope(config) -> bool:
    """HunYuan's per-head QK-norm comes after RoPE (query_layernorm(rope(q))), the others' before it.
    Its group is the same: a whole rotary pair's sign flip commutes with RoPE, the RMS and the gains."""
    return config.model_type in ("hunyuan_v1_dense", "hunyuan_v1_moe")


def post_only(config) -> bool:
    """OLMo-2 and EXAONE 4: no norm before the sublayers; each sublayer's output passes an RMSNorm before it
    joins the stream (HF post_attention_layernorm, post_feedforward_layernorm)."""
    return config.model_type in ("olmo2", "exaone4", "flex_olmo", "olmo3")


def is_tied(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def biases_of(config) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o bias, MLP bias), as each transformers class hard-codes or reads them."""
    if config.model_type == "qwen2":
        return True, False, False
    if config.model_type == "qwen2_moe":
        return config.qkv_bias, False, False
    if config.model_type in ("qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "olmo2", "olmoe", "apertus", "olmo", "hunyuan_v1_dense",
                             "hunyuan_v1_moe", "flex_olmo", "olmo3"):
        return config.attention_bias, config.attention_bias, False
    if config.model_type == "phi3":
        return False, False, False
    if config.model_type in ("glm", "glm4"):
        return config.attention_bias, False, False
    if config.model_type in ("llama", "granite", "arcee", "exaone", "smollm3"):
        return config.attention_bias, config.attention_bias, config.mlp_bias
    if config.model_type == "seed_oss":  # o_proj's bias its own switch
        return config.attention_bias, config.attention_out_bias, config.mlp_bias
    if config.model_type == "helium":  # o_proj without a bias whatever attention_bias says
        return config.attention_bias, False, config.mlp_bias
    if config.model_type in ("ernie4_5", "ernie4_5_moe"):  # use_bias: every projection's
        return (bool(config.use_bias),) * 3
    return False, False, False  # Mistral, Ministral


def parameterless_norms(config) -> bool:
    """OLMo 1: LayerNorms without gain or bias (eps 1e-5) where Llama has its RMSNorms."""
    return config.model_type == "olmo"


def norm_eps(config) -> float:
    return 1e-5 if parameterless_norms(config) else config.rms_norm_eps


def is_gemma(config) -> bool:
    """Gemma 1 to 3: RMSNorm gains stored as w (the gain is 1 + w), the embedding scaled by sqrt(hidden_size)."""
    return config.model_type in ("gemma", "gemma2", "gemma3_text")


def is_sandwich(config) -> bool:
    """Gemma 2 and 3: each sublayer's output passes an RMSNorm before it joins the stream; attention
    scores scaled by query_pre_attn_scalar^-1/2 and soft-capped where the config says, the LM
    logits likewise."""
    return config.model_type in ("gemma2", "gemma3_text")


def output_norms(config) -> bool:
    """Whether each sublayer's output passes an RMSNorm before it joins the stream beside the norms
    before the sublayers: Gemma 2 and 3, GLM-4."""
    return is_sandwich(config) or config.model_type == "glm4"


def gated(config) -> bool:
    """Whether the MLP is gated (gate_proj beside up_proj); Arcee's and Apertus' are not: down(act(up(x)))."""
    return config.model_type not in ("arcee", "apertus")


def activation_of(config) -> str:
    return config.hidden_activation if is_sandwich(config) else config.hidden_act


def embedding_scale(config) -> float | None:
    """A factor on the embedded tokens: Gemma's sqrt(hidden_size), Granite's embedding_multiplier."""
    if is_granite(config):
        return config.embedding_multiplier
    return config.hidden_size ** 0.5 if is_gemma(config) else None


def is_granite(config) -> bool:
    """Granite: Llama's layers with four scalars (none of which any group notices): the embedded
    tokens times embedding_multiplier, each sublayer's output times residual_multiplier before the
    sum, attention_multiplier the score scale (instead of head_dim^-1/2), the LM logits divided by
    logits_scaling."""
    return config.model_type == "granite"


def attention_scale(config) -> float | None:
    """The attention scores' scale where it is not head_dim^-1/2 (None): Gemma 2 and 3's
    query_pre_attn_scalar^-1/2, Granite's attention_multiplier."""
    if is_sandwich(config):
        return config.query_pre_attn_scalar ** -0.5
    return config.attention_multiplier if is_granite(config) else None


def residual_multiplier(config) -> float | None:
    """Granite's factor on each sublayer's output before it joins the stream (None: no factor)."""
    return config.residual_multiplier if is_granite(config) else None


def logits_divisor(config) -> float | None:
    """Granite's logits_scaling: the LM logits are divided by it (None: not divided)."""
    return config.logits_scaling if is_granite(config) else None


def _moe(config) -> bool:
    """Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, FlexOlmo and HunYuan MoE replace each layer's MLP by a sparse mixture of experts (top-k routing)."""
    return config.model_type in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "flex_olmo", "hunyuan_v1_moe")


def is_mixtral(config) -> bool:
    return config.model_type == "mixtral"


def _is_qwen3_moe(config) -> bool:
    """Qwen3-MoE and Qwen2-MoE: dense layers beside the sparse ones, experts of moe_intermediate_size."""
    return config.model_type in ("qwen3_moe", "qwen2_moe")


def experts_in_mlp(config) -> bool:
    """Qwen3-MoE, Qwen2-MoE, OLMoE and FlexOlmo store the mixture as `mlp.gate` (the router) and `mlp.experts.{e}.*_proj`."""
    return config.model_type in ("qwen3_moe", "qwen2_moe", "olmoe", "flex_olmo")


def sparse_layer(config, i: int) -> bool:
    """Whether layer i holds a mixture of experts: every layer of Mixtral; Qwen3-MoE's (Qwen2-MoE's) layers not in
    mlp_only_layers, every decoder_sparse_step-th (the others hold a dense MLP)."""
    if _is_qwen3_moe(config):
        return i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
    return _moe(config)


def shared_expert(config) -> bool:
    """Qwen2-MoE: each mixture holds a shared expert (a SwiGLU of shared_expert_intermediate_size on
    every token), its output times sigmoid(shared_expert_gate(x)), a (1, d) linear of the normed stream."""
    return config.model_type == "qwen2_moe"


def plain_shared_expert(config) -> bool:
    """HunYuan MoE: each mixture holds a shared MLP (`mlp.shared_mlp`, a SwiGLU of intermediate_size on
    every token) added to the experts' output without a gate."""
    return config.model_type == "hunyuan_v1_moe"


def top_k_of(config, i: int) -> int:
    """The experts a token picks in layer i: num_experts_per_tok, or HunYuan MoE's moe_topk per layer."""
    k = config.num_experts_per_tok
    return k[i] if isinstance(k, list) else k


def dense_layer(config, i: int) -> bool:
    return not sparse_layer(config, i)


def dense_mlp(config) -> bool:
    """Whether some layer holds a dense MLP."""
    return not all(sparse_layer(config, i) for i in range(config.num_hidden_layers))


def experts_of(config) -> int:
    return config.num_experts if experts_in_mlp(config) else config.num_local_experts


def expert_width(config) -> int:
    return config.moe_intermediate_size if _is_qwen3_moe(config) else config.intermediate_size


def normalized_top_k(config) -> bool:
    """Mixtral renormalises the top k router probabilities; Qwen3-MoE and OLMoE where norm_topk_prob says so."""
    return config.norm_topk_prob if experts_in_mlp(config) else True


def sliding_windows(config) -> tuple[int | None, ...]:
    """Each layer's attention window (None: full causal attention); see the module docstring."""
    n = config.num_hidden_layers
    if config.model_type in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        return (config.sliding_window,) * n
    if config.model_type in ("qwen2", "qwen3", "qwen2_moe", "gemma2", "gemma3_text", "exaone4", "smollm3", "ministral", "olmo3"):
        windows = tuple(config.sliding_window if t == "sliding_attention" else None for t in config.layer_types[:n])
        if config.sliding_window is None and "sliding_attention" in config.layer_types[:n]:
            raise InputError("config.layer_types has 'sliding_attention' layers but sliding_window is not set")
        return windows
    return (None,) * n


# ---- what the family reads from config.json (config.py), as transformers' config classes hold it --

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


# Keys the RoPE parameters of rope types we run must hold (transformers' _validate_*rope_parameters_of).
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}


def rope_parameters_of(values: dict, raw, default_theta: float = 10000.0) -> dict:
    """config.rope_parameters as transformers standardises it: a legacy rope_scaling wins over
    rope_parameters, rope_theta and partial_rotary_factor beside them fill in (theta 10000 by
    default, or the config class's `default_theta`), "type" is the old name of "rope_type", and the scaled types get
    original_max_position_embeddings = max_position_embeddings unless they name one."""
    params = raw.get("rope_scaling") or values["rope_parameters"] or {}
    if not isinstance(params, dict):
        raise bad_value("rope_scaling", params, DICT.name)
    params = dict(params)
    nested = [k for k in params if k in (values.get("layer_types") or ())]
    if nested:
        raise InputError(f"rope_parameters per layer type ({nested}) are not supported: give one set for every layer")
    theta = raw.get("rope_theta", default_theta)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", theta)
    if raw.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
    check_number("rope_theta", params["rope_theta"], above_zero=True)
    missing = [k for k in _ROPE_KEYS.get(params["rope_type"], ()) if k not in params]
    if missing:
        raise InputError(f"rope_parameters of rope_type {params['rope_type']!r} miss {missing}")
    for key in _ROPE_KEYS.get(params["rope_type"], ()):
        check_number(f"rope_parameters.{key}", params[key])
    return params


def resolve_layer_types(values: dict, layer_types, *, supported: bool) -> None:
    """transformers refuses layer_types whose length is not num_hidden_layers; of the layer types,
    only Qwen2's are read (`supported`), and we run full and sliding-window attention."""
    if layer_types is None:
        return
    if not STRINGS.accepts(layer_types):
        raise bad_value("layer_types", layer_types, STRINGS.name)
    if len(layer_types) != values["num_hidden_layers"]:
        raise InputError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={values['num_hidden_layers']}")
    unknown = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
    if supported and unknown:
        raise InputError(f"layer_types {unknown} are not supported; supported: {list(ATTENTION_LAYER_TYPES)}")


def _derive(values: dict, raw) -> None:
    """The values LlamaConfig, MistralConfig and Qwen2Config compute in __post_init__ and the
    checks of their validators (the ones a config that loads can fail)."""
    heads = values["num_attention_heads"]
    if "use_sliding_window" in values:  # Qwen2
        if not values["use_sliding_window"]:
            values["sliding_window"] = None
        if values["layer_types"] is None:
            windowed = values["sliding_window"] is not None
            values["layer_types"] = [
                "sliding_attention" if windowed and i >= values["max_window_layers"] else "full_attention"
                for i in range(values["num_hidden_layers"])
            ]
        resolve_layer_types(values, values["layer_types"], supported=True)
    else:
        if values["head_dim"] is None and positive_ints(values, "hidden_size", "num_attention_heads"):
            values["head_dim"] = values["hidden_size"] // heads
        resolve_layer_types(values, raw.get("layer_types"), supported=False)
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads
    values["rope_parameters"] = rope_parameters_of(values, raw)
    head_dim = values.get("head_dim", raw.get("head_dim"))
    if is_odd_rope_dim(head_dim):
        raise InputError(f"head_dim={head_dim}: RoPE needs an even head dimension")


def _derive_phi3(values: dict, raw) -> None:
    """Phi3Config: num_key_value_heads defaults to the heads; the legacy rope types 'su' and 'yarn'
    are its 'longrope'; the head is hidden_size / heads (no head_dim key)."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters_of(values, raw)
    if values["rope_parameters"].get("rope_type") in ("su", "yarn"):
        values["rope_parameters"]["rope_type"] = "longrope"
    values["rope_parameters"].setdefault("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if positive_ints(values, "hidden_size", "num_attention_heads") and hidden % heads:
        raise InputError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")


def derive_gemma(values: dict, raw) -> None:
    """GemmaConfig: the legacy hidden_act "gelu" of the official releases means the tanh approximation."""
    if values["hidden_act"] == "gelu":
        values["hidden_act"] = "gelu_pytorch_tanh"
    values["rope_parameters"] = rope_parameters_of(values, raw)
    resolve_layer_types(values, raw.get("layer_types"), supported=False)


def _derive_mixtral(values: dict, raw) -> None:
    """MixtralConfig: num_key_value_heads defaults to the heads; head_dim stays None unless given
    (the attention then takes hidden_size / heads)."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["rope_parameters"] = rope_parameters_of(values, raw, default_theta=1e6)  # MixtralConfig's default
    resolve_layer_types(values, raw.get("layer_types"), supported=False)
    if values["num_experts_per_tok"] > values["num_local_experts"]:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} exceeds num_local_experts={values['num_local_experts']}")


def _derive_qwen3_moe(values: dict, raw) -> None:
    """Qwen3MoeConfig: the window only with use_sliding_window (then on every layer); dense layers
    (a plain MLP of intermediate_size) where mlp_only_layers names them or off every
    decoder_sparse_step-th layer."""
    if not values["use_sliding_window"]:
        values["sliding_window"] = None
    values["mlp_only_layers"] = values["mlp_only_layers"] or []
    values["rope_parameters"] = rope_parameters_of(values, raw)
    if values["decoder_sparse_step"] < 1:
        raise InputError(f"decoder_sparse_step={values['decoder_sparse_step']}: transformers takes layer i + 1 modulo it; expected >= 1")
    if values["num_experts_per_tok"] > values["num_experts"]:
        raise InputError(f"num_experts_per_tok={values['num_experts_per_tok']} exceeds num_experts={values['num_experts']}")


def _derive_qwen2_moe(values: dict, raw) -> None:
    """Qwen2MoeConfig: mlp_only_layers [] where null, sliding_window 0 without use_sliding_window,
    layer_types sliding on the even layers below max_window_layers (with use_sliding_window); and
    what transformers could not build or run refused."""
    values["mlp_only_layers"] = values["mlp_only_layers"] or []
    if not values["use_sliding_window"]:
        values["sliding_window"] = 0
    if values["layer_types"] is None:
        values["layer_types"] = ["sliding_attention" if (i + 1) % 2 and i < values["max_window_layers"] and values["use_sliding_window"]
                                 else "full_attention" for i in range(values["num_hidden_layers"])]
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


def is_odd_rope_dim(head_dim) -> bool:
    # transformers lets tiny test heads (<= 4) through.
    return isinstance(head_dim, int) and head_dim > 4 and head_dim % 2 == 1


def derive_llama(values: dict, raw) -> None:
    _derive(values, raw)
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    if positive_ints(values, "hidden_size", "num_attention_heads") and hidden % heads:
        raise InputError(
            f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (LlamaConfig requires it, "
            "head_dim or not)"
        )


def _derive_smollm3(values: dict, raw) -> None:
    """SmolLM3Config: num_key_value_heads defaults to the heads; no_rope_layers (1: RoPE, 0: NoPE) a NoPE
    layer every no_rope_layer_interval-th; layer_types sliding on the NoPE layers where use_sliding_window
    and sliding_window say so; RoPE theta 2e6 by default."""
    n = values["num_hidden_layers"]
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values["no_rope_layers"] is None:
        interval = values["no_rope_layer_interval"]
        if interval < 1:
            raise InputError(f"no_rope_layer_interval={interval}: SmolLM3Config takes the layer index modulo it; expected >= 1")
        values["no_rope_layers"] = [int((i + 1) % interval != 0) for i in range(n)]
    if len(values["no_rope_layers"]) < n:
        raise InputError(f"no_rope_layers has {len(values['no_rope_layers'])} entries for num_hidden_layers={n}: "
                         "SmolLM3Attention reads one per layer")
    if values["layer_types"] is None:
        windowed = values["use_sliding_window"] and values["sliding_window"] is not None
        values["layer_types"] = ["sliding_attention" if windowed and not values["no_rope_layers"][i] else "full_attention" for i in range(n)]
    resolve_layer_types(values, values["layer_types"], supported=True)
    if "sliding_attention" in values["layer_types"] and not (values["use_sliding_window"] and values["sliding_window"]):
        # the eager and SDPA masks window these layers by config.sliding_window, flash attention (its kwarg) only with use_sliding_window
        raise InputError(f"layer_types has 'sliding_attention' layers but use_sliding_window={values['use_sliding_window']}, "
                         f"sliding_window={values['sliding_window']!r}: transformers' attention implementations disagree on them")
    values["rope_parameters"] = rope_parameters_of(values, raw, default_theta=2000000.0)
    if is_odd_rope_dim(raw.get("head_dim")):
        raise InputError(f"head_dim={raw['head_dim']}: RoPE needs an even head dimension")


def _derive_ministral(values: dict, raw) -> None:
    """MinistralConfig: layer_types all sliding with a sliding_window, else all full (then read as Qwen2's); a head_dim
    (transformers' MinistralAttention takes a null one as it is and cannot be built)."""
    if values["head_dim"] is None:
        raise InputError("head_dim is null: MinistralAttention reads config.head_dim as it is (its score scale head_dim**-0.5 "
                         "fails in transformers); give head_dim")
    if values["sliding_window"] is None:
        raise InputError("sliding_window is null: MinistralModel builds a sliding-window mask for every forward pass, which "
                         "transformers refuses without one")
    if values["layer_types"] is None:
        values["layer_types"] = ["sliding_attention" if values["sliding_window"] is not None else "full_attention"] * values["num_hidden_layers"]
    _derive(values, {**raw, "layer_types": values["layer_types"]})
    resolve_layer_types(values, values["layer_types"], supported=True)


def _derive_seed_oss(values: dict, raw) -> None:
    """SeedOssConfig: num_key_value_heads defaults to the heads, head_dim (128 by default) to hidden_size / heads where null."""
    if values["head_dim"] is None and positive_ints(values, "hidden_size", "num_attention_heads"):
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    _derive(values, raw)


INTS = Kind("a list of ints", lambda v: isinstance(v, list) and all(INT.accepts(x) for x in v))


def schema(model_type, class_name, fields, derive=_derive, aliases=None) -> ConfigSchema:
    common = {
        "hidden_act": (STR, "silu"), "rms_norm_eps": (FLOAT, 1e-6), "pad_token_id": (INT.optional(), None),
        "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None),
    }
    return ConfigSchema(model_type, class_name, {**common, **fields}, derive=derive, aliases=aliases or {},
                        consumed=("rope_scaling", "rope_theta", "partial_rotary_factor"))


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def sizes(*defaults) -> dict:
    return {name: (INT, d) for name, d in zip(_SIZES, defaults)}


CONFIGS = (
    schema("llama", "LlamaConfig", {
        **sizes(32000, 4096, 11008, 32, 32), "num_key_value_heads": (INT.optional(), None),
        "max_position_embeddings": (INT, 2048), "initializer_range": (unit_float(), 0.02),
        "attention_bias": (BOOL, False), "mlp_bias": (BOOL, False), "head_dim": (INT.optional(), None),
    }, derive=derive_llama),
    # Arcee (AFM-4.5B): Llama's layers with an MLP without a gate and a squared ReLU
    schema("arcee", "ArceeConfig", {
        **sizes(32000, 2560, 18432, 32, 32), "num_key_value_heads": (INT.optional(), None), "hidden_act": (STR, "relu2"),
        "max_position_embeddings": (INT, 4096), "initializer_range": (unit_float(), 0.02), "rms_norm_eps": (FLOAT, 1e-5),
        "attention_bias": (BOOL, False), "mlp_bias": (BOOL, False), "head_dim": (INT.optional(), None),
    }, derive=derive_llama),
    schema("mistral", "MistralConfig", {
        **sizes(32000, 4096, 14336, 32, 32), "num_key_value_heads": (INT, 8), "head_dim": (INT.optional(), None),
        "max_position_embeddings": (INT, 4096 * 32), "initializer_range": (FLOAT, 0.02),
        "sliding_window": (INT.optional(), 4096),
    }),
    schema("qwen2", "Qwen2Config", {
        **sizes(151936, 4096, 22016, 32, 32), "num_key_value_heads": (INT.optional(), 32),
        "max_position_embeddings": (INT, 32768), "initializer_range": (FLOAT, 0.02),
        "use_sliding_window": (BOOL, False), "sliding_window": (INT.optional(), 4096), "max_window_layers": (INT, 28),
        "layer_types": (STRINGS.optional(), None),
    }),
    schema("phi3", "Phi3Config", {
        **sizes(32064, 3072, 8192, 32, 32), "num_key_value_heads": (INT.optional(), None),
        "max_position_embeddings": (INT, 4096), "original_max_position_embeddings": (INT, 4096), "initializer_range": (FLOAT, 0.02),
        "rms_norm_eps": (FLOAT, 1e-5), "sliding_window": (INT.optional(), None), "pad_token_id": (INT.optional(), 32000),
    }, derive=_derive_phi3),
    schema("mixtral", "MixtralConfig", {
        **sizes(32000, 4096, 14336, 32, 32), "num_key_value_heads": (INT.optional(), 8), "head_dim": (INT.optional(), None),
        "max_position_embeddings": (INT, 4096 * 32), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
        "sliding_window": (INT.optional(), None), "num_experts_per_tok": (INT, 2), "num_local_experts": (INT, 8),
    }, derive=_derive_mixtral, aliases={"num_experts": "num_local_experts"}),
    schema("qwen3_moe", "Qwen3MoeConfig", {
        **sizes(151936, 2048, 6144, 24, 32), "num_key_value_heads": (INT, 4), "max_position_embeddings": (INT, 32768),
        "initializer_range": (FLOAT, 0.02), "attention_bias": (BOOL, False), "use_sliding_window": (BOOL, False),
        "sliding_window": (INT.optional(), 4096), "decoder_sparse_step": (INT, 1), "moe_intermediate_size": (INT, 768),
        "num_experts_per_tok": (INT, 8), "num_experts": (INT, 128), "norm_topk_prob": (BOOL, False),
        "mlp_only_layers": (INTS.optional(), None),
    }, derive=_derive_qwen3_moe, aliases={"num_local_experts": "num_experts"}),
    # Qwen2-MoE: Qwen2's attention (qkv_bias), Qwen3-MoE's mixture, a shared expert beside it
    schema("qwen2_moe", "Qwen2MoeConfig", {
        **sizes(151936, 2048, 5632, 24, 16), "num_key_value_heads": (INT.optional(), 16), "max_position_embeddings": (INT, 32768),
        "initializer_range": (FLOAT, 0.02), "use_sliding_window": (BOOL, False), "sliding_window": (INT.optional(), 4096),
        "max_window_layers": (INT, 28), "decoder_sparse_step": (INT, 1), "moe_intermediate_size": (INT, 1408),
        "shared_expert_intermediate_size": (INT, 5632), "num_experts_per_tok": (INT, 4), "num_experts": (INT, 60),
        "norm_topk_prob": (BOOL, False), "mlp_only_layers": (INTS.optional(), None), "qkv_bias": (BOOL, True),
        "layer_types": (STRINGS.optional(), None),
    }, derive=_derive_qwen2_moe),
    schema("qwen3", "Qwen3Config", {
        **sizes(151936, 4096, 22016, 32, 32), "num_key_value_heads": (INT.optional(), 32), "head_dim": (INT, 128),
        "max_position_embeddings": (INT, 32768), "initializer_range": (FLOAT, 0.02), "attention_bias": (BOOL, False),
        "use_sliding_window": (BOOL, False), "sliding_window": (INT.optional(), 4096), "max_window_layers": (INT, 28),
        "layer_types": (STRINGS.optional(), None),
    }),
    # SmolLM3: Llama's layers, a NoPE layer (attention without RoPE) every no_rope_layer_interval-th
    schema("smollm3", "SmolLM3Config", {
        **sizes(128256, 2048, 11008, 36, 16), "num_key_value_heads": (INT.optional(), 4), "max_position_embeddings": (INT, 32768),
        "initializer_range": (FLOAT, 0.02), "pad_token_id": (INT.optional(), 128004), "use_sliding_window": (BOOL, False),
        "sliding_window": (INT.optional(), None), "no_rope_layers": (INTS.optional(), None), "no_rope_layer_interval": (INT, 4),
        "layer_types": (STRINGS.optional(), None), "attention_bias": (BOOL, False), "mlp_bias": (BOOL, False),
        "tie_word_embeddings": (BOOL, True),
    }, derive=_derive_smollm3),
    # Ministral: Mistral's layers, windows per layer_types
    schema("ministral", "MinistralConfig", {
        **sizes(32000, 4096, 14336, 32, 32), "num_key_value_heads": (INT, 8), "head_dim": (INT.optional(), None),
        "max_position_embeddings": (INT, 4096 * 32), "initializer_range": (FLOAT, 0.02), "sliding_window": (INT.optional(), 4096),
        "layer_types": (STRINGS.optional(), None),
    }, derive=_derive_ministral),
    # Seed-OSS: Llama's layers, biases on q/k/v (attention_bias) and o (attention_out_bias) apart
    schema("seed_oss", "SeedOssConfig", {
        **sizes(155136, 4096, 27648, 64, 80), "num_key_value_heads": (INT.optional(), 8), "max_position_embeddings": (INT, 524288),
        "initializer_range": (FLOAT, 0.02), "pad_token_id": (INT.optional(), 1), "attention_bias": (BOOL, True),
        "attention_out_bias": (BOOL, False), "mlp_bias": (BOOL, False), "head_dim": (INT.optional(), 128),
    }, derive=_derive_seed_oss),
)


def layer_rope_parameters(config) -> list[dict | None]:
    """Each layer's RoPE parameters: config.rope_parameters, or Gemma 3's of the layer's type
    (its local, sliding layers with their own base); None where a layer takes no RoPE (EXAONE 4's
    full-attention layers, where it has sliding ones)."""
    params = config.rope_parameters or {}
    if config.model_type in ("gemma3_text", "olmo3"):
        return [params[t] for t in config.layer_types[: config.num_hidden_layers]]
    if config.model_type == "exaone4" and config.sliding_window is not None:
        return [params if t == "sliding_attention" else None for t in config.layer_types[: config.num_hidden_layers]]
    if config.model_type == "smollm3":  # its NoPE layers: no_rope_layers[i] == 0
        return [params if config.no_rope_layers[i] else None for i in range(config.num_hidden_layers)]
    return [params] * config.num_hidden_layers


def rope_inv_freq(config, params=None) -> np.ndarray:
    """RoPE inverse frequencies (dh/2,) in float32, computed as transformers' rope init functions do
    (from `params`, default config.rope_parameters)."""
    params = (config.rope_parameters if params is None else params) or {}
    if config.model_type in ("hunyuan_v1_dense", "hunyuan_v1_moe") and params.get("rope_type") == "dynamic" and params.get("alpha"):
        # HunYuan's "dynamic" with a fixed alpha (its "ntk_alpha"): a static base, theta * alpha^(dh / (dh - 2)), in Python floats as transformers
        dh = config.head_dim
        params = {**params, "rope_type": "default", "rope_theta": params["rope_theta"] * params["alpha"] ** (dh / (dh - 2))}
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise InputError(f"unsupported rope_type {rope_type!r} in config.rope_parameters; supported: {ROPE_TYPES}")
    dim = rotary_dim_of(config)
    # float32 throughout, like torch, so the frequencies agree to the last bit or nearly.
    inv_freq = 1.0 / (params["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_context = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, those in between interpolated.
        scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)
