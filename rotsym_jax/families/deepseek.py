"""DeepSeek-V3 (and the checkpoints that share its model type: Kimi K2, DeepSeek-R1) and DeepSeek-V2
(V2-Lite, Coder-V2; its router at the bottom): multi-head latent attention (MLA) and a mixture of
experts with shared experts and group-limited routing.

MLA, per layer (H heads; n = qk_nope_head_dim, r = qk_rope_head_dim, v = v_head_dim):
    queries: q_proj (d -> H (n + r)), or with q_lora_rank q_a_proj (d -> q_lora), an RMSNorm,
        q_b_proj (q_lora -> H (n + r)); each head's first n entries take no RoPE, the last r do;
    keys and values: kv_a_proj_with_mqa (d -> kv_lora + r): a latent of kv_lora entries under an
        RMSNorm, then kv_b_proj (kv_lora -> H (n + v)): each head's key (n) and value (v); and one
        rotary key of r entries that every head shares;
    score of head h = q_nope_h . k_nope_h + RoPE(q_rot_h) . RoPE(k_rot), scaled by (n + r)^-1/2.
The loader splits every fused projection per head into its parts: our `query` / `query_up`
(the no-RoPE queries), `key` and `value` (rows of kv_b_proj), and the RoPE parts apart. So the
attention block "attn" is Q/K over the n no-RoPE entries and V/O over the v entries, a per-head
rotation (or invertible map) of each, and head permutations: the RoPE key is one for every head,
so a head may move to another slot with its RoPE query (`query_rope` / `query_up_rope`, role
`qr`, `HeadGeometry.shared_rope_dim`), which no map of Q/K touches (it meets the shared key, not
the block's). Where v_head_dim != qk_nope_head_dim (no DeepSeek checkpoint has them differ;
GLM-4.7-Flash's do) V/O's maps are v wide and Q/K's n (`HeadGeometry.value_dim`): two groups of
their own widths that share the head permutations.
Each latent (`q_latent`: q_a_proj's columns and bias, q_a_layernorm's gain, the rows of q_b_proj's
both parts; `kv_latent`: the first kv_lora_rank columns of kv_a_proj_with_mqa, kv_a_layernorm's
gain, the rows of kv_b_proj's both parts) is a permutation group: its readers' columns are the
attention block's, so those leaves are members of both (`Member.also`), the latent solved from the
writer's side and its assignment handed to the heads' cross products (`AttentionBlock.after`,
engine/driver.py).
The RoPE key every head shares (`key_rope`, role `kr`) and every head's RoPE query turn by one
2-D rotation per rotary pair (`HeadTransform.rope`), on the pairs as stored: (2i, 2i + 1) with
rope_interleave (V2 always), else (i, i + r/2) (`HeadGeometry.shared_rope_interleaved`).
With latents="rotation" (`--latents rotation`), each latent rotates instead, per layer, once its
RMSNorm's gain is folded into the readers' rows (`Spec.unit_norms`, `rj.fold_latents`, MATH §17).

The mixture (layers from first_k_dense_replace on; the first ones hold a dense MLP): a sigmoid
router `mlp.gate` (E, d) whose choice adds `e_score_correction_bias`; with n_group > 1 a token
picks the topk_group groups of E / n_group consecutive experts whose two best scores sum
highest, then its top k experts among them; the picked scores, normalised with norm_topk_prob,
times routed_scaling_factor, weight the experts' outputs; n_shared_experts dense experts
(`mlp.shared_experts`, width moe_intermediate_size x n_shared_experts) read every token. The
experts (router rows and correction biases with them) permute within their routing group
(`Spec.routing_groups`): moving an expert to another group changes which experts a token can reach.

Leaves (d = hidden_size; per layer i):
    embeddings/word/embedding        (vocab_size, d)     model.embed_tokens
    layers/{i}/attention_norm/scale  (d,)                input_layernorm
    layers/{i}/attention/query/kernel (d, H n), query_rope/kernel (d, H r)        q_proj (no q_lora)
    layers/{i}/attention/query_down/kernel (d, q_lora) (+ bias), query_down_norm/scale (q_lora,),
        query_up/kernel (q_lora, H n), query_up_rope/kernel (q_lora, H r)      q_a_proj, q_a_layernorm, q_b_proj
    layers/{i}/attention/kv_down/kernel (d, kv_lora), key_rope/kernel (d, r) (+ biases)   kv_a_proj_with_mqa
    layers/{i}/attention/kv_down_norm/scale (kv_lora,)                           kv_a_layernorm
    layers/{i}/attention/key/kernel (kv_lora, H n), value/kernel (kv_lora, H v)   kv_b_proj
    layers/{i}/attention/out/kernel  (H v, d) (+ bias)                            o_proj
    layers/{i}/mlp_norm/scale        (d,)                post_attention_layernorm
    layers/{i}/mlp/{gate,up,down}    dense layers        mlp.{gate,up,down}_proj
    layers/{i}/moe/router/kernel (d, E), moe/score_correction (E,), moe/{gate,up}/kernel (E, d, f),
        moe/down/kernel (E, f, d)                        mlp.gate, mlp.experts.{e}.*
    layers/{i}/shared_mlp/{gate,up,down}                 mlp.shared_experts.*
    final_norm/scale (d,)            model.norm
    task heads (run here): lm (lm_head, untied by default), sequence_classification (score),
        token_classification (score)
The multi-token-prediction layer a full checkpoint stores past the last layer (model.layers.61) is
skipped, as transformers skips it on load: a merged checkpoint is written without it.

GLM-4.7-Flash (model type glm4_moe_lite) is DeepSeek-V3's record under Glm4MoeLiteConfig: the same
tensors, MLA and router (n_group always read), its dense and mixture layers placed by
`mlp_layer_types` (by default one dense layer, then mixtures) instead of first_k_dense_replace, a
causal LM head alone. Its checkpoint's value heads (v_head_dim 256) are wider than the keys' no-RoPE
part (192): its attention group's V/O maps are 256 wide, its Q/K maps 192 (`HeadGeometry.value_dim`). The
multi-token-prediction layer transformers skips is model.layers.47.

MiniCPM3 (MiniCPM3-4B) is DeepSeek-V3's record with a dense SwiGLU MLP in every layer (`mlp`, biases
with mlp_bias), RoPE on `rotate_half` pairs always (MiniCPM3Config has no rope_interleave; default,
linear, llama3, YaRN or LongRoPE, the 4B's), and three scalars, none of which any group notices: the
embedded tokens times scale_emb, each sublayer's output times scale_depth / sqrt(num_hidden_layers)
before it joins the stream, the final hidden state divided by hidden_size / dim_model_base before
the LM head (not before the sequence classifier); its LM head tied by default.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry, Spec
from .config import BOOL, DICT, FLOAT, INT, STR, STRINGS, ConfigSchema, check_number
from .family import (
    OPTIONAL,
    SPEC_RULES,
    STACKED_GATE_UP,
    STACKED_TRANSPOSE,
    TRANSPOSE,
    Convert,
    Family,
    Norm,
    Tensor,
    embedding,
    gated_mlp,
    linear,
    norm,
    size,
    split_rows,
)
from .llama._config import rope_parameters_of, sizes
from .llama._records import NUMBER
from .llama._tensors import HEADS as LLAMA_HEADS

_L = r"layers/(?P<layer>\d+)"


def _nope(c) -> int:
    return c.num_attention_heads * c.qk_nope_head_dim


def _rope(c) -> int:
    return c.num_attention_heads * c.qk_rope_head_dim


def _values(c) -> int:
    return c.num_attention_heads * c.v_head_dim


def _q_lora(c) -> bool:
    return c.q_lora_rank is not None


def _no_q_lora(c) -> bool:
    return c.q_lora_rank is None


def _bias(c) -> bool:
    return c.attention_bias


def sparse_layer(c, i: int) -> bool:
    if c.model_type == "minicpm3":  # a dense MLP in every layer
        return False
    if c.model_type == "glm4_moe_lite":  # Glm4MoeLiteConfig has no first_k_dense_replace
        return c.mlp_layer_types[i] == "sparse"
    return i >= c.first_k_dense_replace


def _dense_layer(c, i: int) -> bool:
    return not sparse_layer(c, i)


def _shared_width(c) -> int:
    return c.moe_intermediate_size * c.n_shared_experts


def _experts(c) -> int:
    return c.n_routed_experts


def _corrected(c) -> bool:
    """V3's router (and GLM-4-MoE's, its copy) adds a correction bias to its scores for the choice; V2's has none."""
    return c.model_type != "deepseek_v2"


def _mlp_bias(c) -> bool:
    return bool(getattr(c, "mlp_bias", False))  # V2's dense MLPs and shared experts; V3 has none


def per_head_rows(parts) -> Convert:
    """A torch weight (H (p1 + p2), in) whose rows are, head by head, [part 1; part 2] (q_b_proj: the
    no-RoPE then the RoPE entries; kv_b_proj: the key then the value) <-> a kernel per part,
    (in, H p), its columns head-major."""
    def widths(c):
        return [size(c, p) for p in parts]

    def to_ours(a, c):
        w = widths(c)
        heads = a.reshape(c.num_attention_heads, sum(w), a.shape[-1])
        return tuple(x.reshape(-1, a.shape[-1]).T for x in np.split(heads, np.cumsum(w)[:-1], axis=1))

    def to_hf(t, c):
        heads = np.concatenate([k.T.reshape(c.num_attention_heads, -1, k.shape[0]) for k in t], axis=1)
        return heads.reshape(-1, heads.shape[-1])

    return Convert(f"per_head_rows{len(parts)}", to_ours, to_hf)


def _only(condition, tensors):
    return tuple(dataclasses.replace(t, when=condition if t.when is None else (lambda c, w=t.when: condition(c) and w(c))) for t in tensors)


def _in(in_layer, tensors, stacked=None):
    return tuple(dataclasses.replace(t, in_layer=in_layer, stacked=stacked) for t in tensors)


_A, _AT = "layers.{i}.self_attn", "layers/{i}/attention"
_MOE, _MOE_AT = "layers.{i}.mlp", "layers/{i}/moe"
_QUERY = per_head_rows(("qk_nope_head_dim", "qk_rope_head_dim"))
_KV_DOWN = split_rows(("kv_lora_rank", "qk_rope_head_dim"))

_ATTENTION = (
    *norm("layers.{i}.input_layernorm", "layers/{i}/attention_norm", bias=False),
    Tensor(f"{_A}.q_proj.weight", (f"{_AT}/query/kernel", f"{_AT}/query_rope/kernel"), (("hidden_size", _nope), ("hidden_size", _rope)), (0, 0),
           _QUERY, _no_q_lora),
    *_only(_q_lora, linear(f"{_A}.q_a_proj", f"{_AT}/query_down", "hidden_size", "q_lora_rank", bias=_bias, reads=True)),
    *_only(_q_lora, norm(f"{_A}.q_a_layernorm", f"{_AT}/query_down_norm", "q_lora_rank", bias=False, stream=False)),
    Tensor(f"{_A}.q_b_proj.weight", (f"{_AT}/query_up/kernel", f"{_AT}/query_up_rope/kernel"),
           (("q_lora_rank", _nope), ("q_lora_rank", _rope)), (None, None), _QUERY, _q_lora),
    Tensor(f"{_A}.kv_a_proj_with_mqa.weight", (f"{_AT}/kv_down/kernel", f"{_AT}/key_rope/kernel"),
           (("hidden_size", "kv_lora_rank"), ("hidden_size", "qk_rope_head_dim")), (0, 0), _KV_DOWN),
    Tensor(f"{_A}.kv_a_proj_with_mqa.bias", (f"{_AT}/kv_down/bias", f"{_AT}/key_rope/bias"), (("kv_lora_rank",), ("qk_rope_head_dim",)),
           (None, None), _KV_DOWN, _bias),
    *norm(f"{_A}.kv_a_layernorm", f"{_AT}/kv_down_norm", "kv_lora_rank", bias=False, stream=False),
    Tensor(f"{_A}.kv_b_proj.weight", (f"{_AT}/key/kernel", f"{_AT}/value/kernel"), (("kv_lora_rank", _nope), ("kv_lora_rank", _values)),
           (None, None), per_head_rows(("qk_nope_head_dim", "v_head_dim"))),
    *linear(f"{_A}.o_proj", f"{_AT}/out", _values, "hidden_size", bias=_bias, writes=True),
    *norm("layers.{i}.post_attention_layernorm", "layers/{i}/mlp_norm", bias=False),
)

_EXPERT_SHAPES = {"gate": (_experts, "hidden_size", "moe_intermediate_size"), "up": (_experts, "hidden_size", "moe_intermediate_size"),
                  "down": (_experts, "moe_intermediate_size", "hidden_size")}

MIXTURE = (
    *_in(_dense_layer, gated_mlp("layers.{i}.mlp", "layers/{i}/mlp", bias=_mlp_bias)),
    *_in(sparse_layer, (
        Tensor(f"{_MOE}.gate.weight", (f"{_MOE_AT}/router/kernel",), (("hidden_size", _experts),), (0,), TRANSPOSE),
        Tensor(f"{_MOE}.gate.e_score_correction_bias", (f"{_MOE_AT}/score_correction",), ((_experts,),), (None,), when=_corrected),
        *gated_mlp(f"{_MOE}.shared_experts", "layers/{i}/shared_mlp", f=_shared_width, bias=_mlp_bias),
    )),
    # one tensor per expert, as save_pretrained writes them
    *_in(sparse_layer, tuple(
        Tensor(f"{_MOE}.experts.{{e}}.{proj}_proj.weight", (f"{_MOE_AT}/{proj}/kernel",), (_EXPERT_SHAPES[proj],), (2 if proj == "down" else 1,),
               TRANSPOSE, experts=_experts) for proj in ("gate", "up", "down")), stacked=False),
    # stacked, as transformers 5 holds them in memory (and tools that save its state dict write them)
    *_in(sparse_layer, (
        Tensor(f"{_MOE}.experts.gate_up_proj", (f"{_MOE_AT}/gate/kernel", f"{_MOE_AT}/up/kernel"), (_EXPERT_SHAPES["gate"],) * 2, (1, 1),
               STACKED_GATE_UP),
        Tensor(f"{_MOE}.experts.down_proj", (f"{_MOE_AT}/down/kernel",), (_EXPERT_SHAPES["down"],), (2,), STACKED_TRANSPOSE),
    ), stacked=True),
)

HEADS = tuple(h for h in LLAMA_HEADS if h.name != "question_answering")  # DeepseekV3 has no QA class

# the norm before a mixture (or a dense MLP), read by every MLP, expert and router of the layer
MIXTURE_FOLD = (r"layers/(\d+)/mlp_norm/scale", r"layers/\1/(mlp/(up|gate)|shared_mlp/(up|gate)|moe/(router|up|gate))/kernel")
_FOLDS = (
    (r"layers/(\d+)/attention_norm/scale", r"layers/\1/attention/(query|query_rope|query_down|kv_down|key_rope)/kernel"),
    MIXTURE_FOLD,
    (r"final_norm/scale", r"(lm_head|head/(score|token_classifier))/kernel"),
)

# The shared experts' units, a permutation group of their own, and the correction biases, moving with their experts.
MIXTURE_RULES = (
    (rf"{_L}/shared_mlp/gate/kernel", (None, "shared_ffn")),
    (rf"{_L}/shared_mlp/gate/bias", ("shared_ffn",)),
    (rf"{_L}/shared_mlp/up/kernel", (None, "shared_ffn.in")),  # a gated unit's scale (spec.py)
    (rf"{_L}/shared_mlp/up/bias", ("shared_ffn.in",)),
    (rf"{_L}/shared_mlp/down/kernel", ("shared_ffn.out", None)),
    (rf"{_L}/shared_mlp/down/bias", None),
    (rf"{_L}/moe/score_correction", ("moe.expert",)),
)
# MLA's leaves beside the attention block's: each head's RoPE query follows its head (the RoPE key
# every head shares stays); each latent's units permute (its projection's columns, its norm's gain,
# the rows of the kernels that read it, which the attention block holds on their columns).
_LATENT_READERS = (
    (rf"{_L}/attention/query_up/kernel", ("q_latent", "attn.q")),
    (rf"{_L}/attention/query_up_rope/kernel", ("q_latent", "attn.qr")),
    (rf"{_L}/attention/key/kernel", ("kv_latent", "attn.k")),
    (rf"{_L}/attention/value/kernel", ("kv_latent", "attn.v")),
)
_RULES = (
    *_LATENT_READERS,
    (rf"{_L}/attention/query_rope/kernel", (None, "attn.qr")),
    *((rf"{_L}/attention/{leaf}/kernel", (None, latent)) for leaf, latent in (("query_down", "q_latent"), ("kv_down", "kv_latent"))),
    *((rf"{_L}/attention/{leaf}", (latent,)) for leaf, latent in (("query_down/bias", "q_latent"), ("query_down_norm/scale", "q_latent"),
                                                                   ("kv_down/bias", "kv_latent"), ("kv_down_norm/scale", "kv_latent"))),
    (rf"{_L}/attention/key_rope/kernel", (None, "attn.kr")),
    (rf"{_L}/attention/key_rope/bias", ("attn.kr",)),
    *MIXTURE_RULES,
)


def head_geometry(config) -> HeadGeometry:
    """The heads' no-RoPE Q/K (qk_nope_head_dim wide) and their V/O (v_head_dim wide); each head's
    RoPE query beside them, permuted with its head (the module docstring)."""
    heads = config.num_attention_heads
    # DeepseekV2Config has no rope_interleave (always interleaved), MiniCPM3Config neither (rotate_half always)
    interleaved = getattr(config, "rope_interleave", config.model_type != "minicpm3")
    return HeadGeometry(heads, heads, config.qk_nope_head_dim, shared_rope_dim=config.qk_rope_head_dim, shared_rope_interleaved=interleaved,
                        value_dim=config.v_head_dim)


def group_limited(config) -> bool:
    """Whether the router first keeps topk_group of the n_group groups of experts (V3 always; V2
    with topk_method 'group_limited_greedy')."""
    return config.model_type != "deepseek_v2" or config.topk_method == "group_limited_greedy"


def routing_groups(config) -> int:
    """Blocks of consecutive experts a permutation must keep apart: n_group where a token reaches
    only topk_group of them, else 1 (every group reachable: the grouping changes nothing)."""
    groups = getattr(config, "n_group", None) or 1  # (MiniCPM3: no experts)
    return groups if groups > 1 and group_limited(config) and (config.topk_group or groups) < groups else 1


@dataclasses.dataclass(frozen=True)
class RoutedFamily(Family):
    """A family whose mixtures route by groups of experts (DeepSeek-V2/V3, GLM-4-MoE): its experts
    move within their routing groups."""

    def spec(self, config, layout=None) -> Spec:
        rules, heads = self.rules + SPEC_RULES, {"attn": self.head_geometry(config)}
        return Spec(rules, heads=heads, residual=self.residual_spec(config, layout), optional=OPTIONAL,
                    routing_groups={"moe": routing_groups(config)}, unit_norms=_latent_norms(config))


def _latent_norms(config) -> dict:
    """MLA's latents, each under its RMSNorm, whose gain (folded into the readers' rows) lets the
    latent rotate too (`Spec.unit_norms`, `align(latents="rotation")`, MATH §17)."""
    if getattr(config, "kv_lora_rank", None) is None:  # GLM-4-MoE: no latent
        return {}
    norms = {"kv_latent": rf"{_L}/attention/kv_down_norm/scale"}
    return norms if config.q_lora_rank is None else {**norms, "q_latent": rf"{_L}/attention/query_down_norm/scale"}


def _derive(values: dict, raw) -> None:
    """DeepseekV3Config: num_key_value_heads (unused by MLA) defaults to the heads; head_dim is the
    RoPE width; the routing's sizes checked as the router divides them."""
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["head_dim"] = values["qk_rope_head_dim"]
    values["rope_parameters"] = rope_parameters_of(values, raw)
    experts, groups, top = values["n_routed_experts"], values["n_group"] or 1, values["topk_group"] or 1
    if experts % groups or (groups > 1 and experts // groups < 2):
        raise InputError(f"n_routed_experts={experts} in n_group={groups} groups: the router needs equal groups of at least 2 experts")
    if top > groups or (values["num_experts_per_tok"] or 0) > experts:  # (None: DeepseekV2Config's default; its forward pass refuses it)
        raise InputError(f"topk_group={top} of n_group={groups}, num_experts_per_tok={values['num_experts_per_tok']} of "
                         f"n_routed_experts={experts}: the router cannot pick more than there are")
    if values["qk_rope_head_dim"] % 2:
        raise InputError(f"qk_rope_head_dim={values['qk_rope_head_dim']} is odd: RoPE rotates pairs")


def _derive_v2(values: dict, raw) -> None:
    """DeepseekV2Config: V3's checks, its RoPE on interleaved pairs always (as complex numbers), and
    the router's two choices transformers runs (num_experts_per_tok may be None, as by default: read
    and merged, not run)."""
    if values["topk_method"] not in TOPK_METHODS:
        raise InputError(f"topk_method={values['topk_method']!r}; transformers' DeepseekV2 router runs {list(TOPK_METHODS)}")
    _derive(values, raw)
    values["rope_interleave"] = True


TOPK_METHODS = ("greedy", "group_limited_greedy")


SCHEMA = ConfigSchema("deepseek_v3", "DeepseekV3Config", {
    **sizes(129280, 7168, 18432, 61, 128), "moe_intermediate_size": (INT, 2048), "num_key_value_heads": (INT.optional(), 128),
    "n_shared_experts": (INT, 1), "n_routed_experts": (INT, 256), "routed_scaling_factor": (FLOAT, 2.5), "kv_lora_rank": (INT, 512),
    "q_lora_rank": (INT.optional(), 1536), "qk_rope_head_dim": (INT, 64), "v_head_dim": (INT, 128), "qk_nope_head_dim": (INT, 128),
    "n_group": (INT.optional(), 8), "topk_group": (INT.optional(), 4), "num_experts_per_tok": (INT, 8), "first_k_dense_replace": (INT, 3),
    "norm_topk_prob": (BOOL, True), "hidden_act": (STR, "silu"), "max_position_embeddings": (INT, 4096), "initializer_range": (FLOAT, 0.02),
    "rms_norm_eps": (FLOAT, 1e-6), "pad_token_id": (INT.optional(), None), "tie_word_embeddings": (BOOL, False),
    "rope_parameters": (DICT.optional(), None), "rope_interleave": (BOOL, True), "attention_bias": (BOOL, False),
}, derive=_derive, aliases={"num_local_experts": "n_routed_experts"}, consumed=("rope_scaling", "rope_theta"))


V2_SCHEMA = ConfigSchema("deepseek_v2", "DeepseekV2Config", {
    **sizes(102400, 4096, 11008, 32, 32), "moe_intermediate_size": (INT, 1407), "num_key_value_heads": (INT.optional(), None),
    "n_shared_experts": (INT, 2), "n_routed_experts": (INT, 64), "routed_scaling_factor": (FLOAT, 1.0), "kv_lora_rank": (INT, 512),
    "q_lora_rank": (INT.optional(), 1536), "qk_rope_head_dim": (INT, 64), "v_head_dim": (INT, 128), "qk_nope_head_dim": (INT, 128),
    "n_group": (INT.optional(), None), "topk_group": (INT.optional(), None), "topk_method": (STR.optional(), "greedy"),
    "num_experts_per_tok": (INT.optional(), None), "first_k_dense_replace": (INT, 0), "norm_topk_prob": (BOOL.optional(), False),
    "hidden_act": (STR, "silu"), "max_position_embeddings": (INT, 2048), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-6),
    "pad_token_id": (INT.optional(), None), "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None),
    "attention_bias": (BOOL, False), "mlp_bias": (BOOL, False),
}, derive=_derive_v2, aliases={"num_experts": "n_routed_experts"}, consumed=("rope_scaling", "rope_theta"))


DEEPSEEK_V3 = RoutedFamily(
    name="deepseek_v3",
    configs=(SCHEMA,),
    stems={"deepseek_v3": "DeepseekV3"},
    prefix="model.",
    marker="embed_tokens.weight",
    embeddings=embedding("embed_tokens.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_ATTENTION + MIXTURE,
    final=norm("norm", "final_norm", bias=False),
    heads=HEADS,
    default_head="lm",
    norm=Norm("rmsnorm", placement="pre", folds=_FOLDS),
    build=lambda config, layout, dtype, rngs: rj.nets.deepseek.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry,
    rules=_RULES,
    # the multi-token-prediction layer past the last one (transformers' _keys_to_ignore_on_load_unexpected)
    ignored=(r"(model\.)?layers\.61\..*",),
)


# DeepSeek-V2 (V2-Lite, Coder-V2): V3's layers with a softmax router, its choice greedy or limited to
# the groups holding the best experts, no correction bias, biases on the MLPs with mlp_bias; its
# RoPE rotates interleaved pairs as complex numbers (V3's rope_interleave); no token classifier.
DEEPSEEK_V2 = dataclasses.replace(
    DEEPSEEK_V3,
    name="deepseek_v2",
    configs=(V2_SCHEMA,),
    stems={"deepseek_v2": "DeepseekV2"},
    heads=tuple(h for h in HEADS if h.name != "token_classification"),
    ignored=(),
)


def _derive_glm4_moe_lite(values: dict, raw) -> None:
    """Glm4MoeLiteConfig: V3's checks, and mlp_layer_types by default one dense layer then mixtures
    (its __post_init__), one entry per layer, each "dense" or "sparse" (Glm4MoeLiteDecoderLayer reads
    any other word as dense: refused, not guessed)."""
    _derive(values, raw)
    n = values["num_hidden_layers"]
    if values["mlp_layer_types"] is None:
        values["mlp_layer_types"] = ["dense"] + ["sparse"] * (n - 1)
    types = values["mlp_layer_types"]
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise InputError(f"mlp_layer_types={types}: one entry per layer ({n}), each 'dense' or 'sparse', as Glm4MoeLiteDecoderLayer reads them")


GLM4_MOE_LITE_SCHEMA = ConfigSchema("glm4_moe_lite", "Glm4MoeLiteConfig", {
    **sizes(154880, 2048, 10240, 47, 20), "moe_intermediate_size": (INT, 1536), "num_key_value_heads": (INT.optional(), 20),
    "n_shared_experts": (INT, 1), "n_routed_experts": (INT, 64), "routed_scaling_factor": (FLOAT, 1.8), "kv_lora_rank": (INT, 512),
    "q_lora_rank": (INT.optional(), 768), "qk_rope_head_dim": (INT, 64), "v_head_dim": (INT, 256), "qk_nope_head_dim": (INT, 192),
    "n_group": (INT, 1), "topk_group": (INT, 1), "num_experts_per_tok": (INT, 4), "norm_topk_prob": (BOOL, True), "hidden_act": (STR, "silu"),
    "max_position_embeddings": (INT, 202752), "initializer_range": (FLOAT, 0.02), "rms_norm_eps": (FLOAT, 1e-5),
    "pad_token_id": (INT.optional(), None), "tie_word_embeddings": (BOOL, False), "rope_parameters": (DICT.optional(), None),
    "rope_interleave": (BOOL, True), "mlp_layer_types": (STRINGS.optional(), None), "attention_bias": (BOOL, False),
}, derive=_derive_glm4_moe_lite, aliases={"num_local_experts": "n_routed_experts", "head_dim": "qk_rope_head_dim"},
    consumed=("rope_scaling", "rope_theta"))


# GLM-4.7-Flash: V3's layers placed by mlp_layer_types (`sparse_layer`), a causal LM head alone
# (transformers has no other Glm4MoeLite class), its multi-token-prediction layer model.layers.47.
GLM4_MOE_LITE = dataclasses.replace(
    DEEPSEEK_V3,
    name="glm4_moe_lite",
    configs=(GLM4_MOE_LITE_SCHEMA,),
    stems={"glm4_moe_lite": "Glm4MoeLite"},
    heads=tuple(h for h in HEADS if h.name == "lm"),
    ignored=(r"(model\.)?layers\.47\..*",),  # transformers' _keys_to_ignore_on_load_unexpected
)


def _derive_minicpm3(values: dict, raw) -> None:
    """MiniCPM3Config's __post_init__: head_dim is the RoPE width; v_head_dim, scale_depth and
    dim_model_base set to None fall back to hidden_size / heads, sqrt(num_hidden_layers) (no
    scaling) and hidden_size (no scaling); hidden_size a multiple of the heads (its
    validate_architecture); LongRoPE's factors one per rotary pair, as transformers reads them."""
    heads, d = values["num_attention_heads"], values["hidden_size"]
    if d % heads:
        raise InputError(f"hidden_size={d} is not a multiple of num_attention_heads={heads}, as MiniCPM3Config requires")
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads
    values["head_dim"] = values["qk_rope_head_dim"]
    if values["v_head_dim"] is None:
        values["v_head_dim"] = d // heads
    if values["scale_depth"] is None:
        values["scale_depth"] = math.sqrt(values["num_hidden_layers"])
    if values["dim_model_base"] is None:
        values["dim_model_base"] = d
    for name in ("scale_emb", "scale_depth"):
        check_number(name, values[name])
    check_number("dim_model_base", values["dim_model_base"], above_zero=True)  # the LM's input is divided by hidden_size / it
    values["rope_parameters"] = params = rope_parameters_of(values, raw)
    values["rope_interleave"] = False  # MiniCPM3Attention's apply_rotary_pos_emb: rotate_half
    if values["qk_rope_head_dim"] % 2:
        raise InputError(f"qk_rope_head_dim={values['qk_rope_head_dim']} is odd: RoPE rotates pairs")
    if params["rope_type"] == "longrope":
        pairs = values["qk_rope_head_dim"] // 2
        for key in ("short_factor", "long_factor"):
            factors = params.get(key)
            if not isinstance(factors, list) or len(factors) != pairs:
                raise InputError(f"rope_parameters.{key}={factors!r}: LongRoPE needs one factor per rotary pair ({pairs} for "
                                 f"qk_rope_head_dim={values['qk_rope_head_dim']})")


MINICPM3_SCHEMA = ConfigSchema("minicpm3", "MiniCPM3Config", {
    **sizes(73448, 2560, 6400, 62, 40), "num_key_value_heads": (INT.optional(), 40), "hidden_act": (STR, "silu"),
    "max_position_embeddings": (INT, 32768), "initializer_range": (FLOAT, 0.1), "rms_norm_eps": (FLOAT, 1e-5),
    "pad_token_id": (INT.optional(), None), "tie_word_embeddings": (BOOL, True), "rope_parameters": (DICT.optional(), None),
    "attention_bias": (BOOL, False), "mlp_bias": (BOOL, False), "head_dim": (INT.optional(), None), "kv_lora_rank": (INT, 256),
    "q_lora_rank": (INT.optional(), 768), "qk_nope_head_dim": (INT, 64), "qk_rope_head_dim": (INT, 32), "v_head_dim": (INT.optional(), None),
    "scale_emb": (NUMBER, 12), "scale_depth": (NUMBER.optional(), 1.4), "dim_model_base": (INT.optional(), 256),
}, derive=_derive_minicpm3, consumed=("rope_scaling", "rope_theta"))


# MiniCPM3: DeepSeek-V3's attention (rotate_half), a dense MLP in every layer (`sparse_layer`), its
# scalars in the forward pass; a causal LM (tied by default) and a sequence classifier.
MINICPM3 = dataclasses.replace(
    DEEPSEEK_V3,
    name="minicpm3",
    configs=(MINICPM3_SCHEMA,),
    stems={"minicpm3": "MiniCPM3"},
    heads=tuple(h for h in HEADS if h.name in ("lm", "sequence_classification")),
    ignored=(),
)
