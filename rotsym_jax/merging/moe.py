"""Mixtures of experts from dense models: mergekit-moe 0.1.5's configs, its Mixtral and Qwen3-MoE outputs.

    base_model: path/to/base                 # its attention, norms, embeddings and LM head are the output's
    experts:
      - source_model: path/to/math           # its FFN is expert 0 of every layer
        positive_prompts: ["Solve 2x + 3 = 7"]
        negative_prompts: ["Write a poem"]   # optional
        residual_scale: 0.5                  # optional: the expert's down projection scaled
        noise_scale: 0.01                    # optional: Gaussian noise on the expert's projections
      - source_model: path/to/code
        positive_prompts: ["def fib(n):"]
    gate_mode: hidden                        # hidden | cheap_embed | random | uniform_random
    dtype: bfloat16                          # the output's (default: the base's)
    experts_per_token: 2
    rotsym:                                  # mergekit ignores this block
      align: true                            # each expert's model moved onto the base first
      align_options: {residual: rotation}    # `rj.align`'s options
      shared: average                        # base (mergekit's) | average: the shared tensors averaged
      seed: 0                                # the key of random gates and noise
      # data: {file: texts.jsonl}            # for align_options.method activations (relative to this file)

What mergekit-moe does, and so this module: every tensor outside the FFNs is the base's, copied
(nothing is averaged); expert e of layer l is the FFN of layer l of the e-th expert model (with
`noise_scale` noise added to its three projections, then `residual_scale` on its down projection);
the router of layer l is one gate vector per expert (`gate_vectors`):

    hidden       the base model runs each expert's prompts (the base tokenizer's BOS text before
                 each, no other special tokens, padded on the left); each prompt's residual
                 stream at its last token, read at every layer's input; averaged over the
                 prompts, the negative prompts' average subtracted, normalised per layer
    cheap_embed  the sum of the base's embedding rows over every token of the prompts, normalised,
                 the negative prompts' likewise subtracted, normalised again; the same in every layer
    random       standard normal entries; uniform_random: uniform in +-1 / sqrt(d)

mergekit runs the hidden states in bfloat16 and draws random gates and noise from torch's global
generator; here the forward pass runs in the base's dtype (float32 for a float32 base) and draws
come from `seed`. The deterministic modes (hidden, cheap_embed, no noise) give mergekit's tensors
within those roundings.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml

import rotsym_jax as rj

from ..errors import InputError
from ..families.family import Layout
from ..io.hf import Checkpoint, family_of, read_config
from ..io.recipe import ALIGN_KEYS, Data, RecipeError, checked_keys, config_text, data_of, is_seed, line_of, short, yaml_mapping
from ..pytree import flatten, unflatten
from .mergekit import DTYPES, model_path

GATE_MODES = ("hidden", "cheap_embed", "random", "uniform_random")
# mergekit's names of the same computations; hidden_avg (the states averaged over every position,
# the padding's too) is not run
GATE_ALIASES = {"hidden_last": "hidden"}


@dataclasses.dataclass(frozen=True)
class Output:
    """One of mergekit-moe's output architectures: its name (what `architecture` prefixes), the
    dense model types it is made of, and the keys its config.json changes in the base's."""

    name: str
    inputs: tuple[str, ...]
    keys: Callable[[Mapping, int, int], dict]


def _mixtral_keys(raw: Mapping, experts: int, top_k: int) -> dict:
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": experts, "num_experts_per_tok": top_k,
            "sliding_window": None}


def _qwen3_moe_keys(raw: Mapping, experts: int, top_k: int) -> dict:
    # num_local_experts: Qwen3MoeConfig's num_experts under the name transformers 5 writes (and mergekit with it)
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": experts, "num_experts_per_tok": top_k,
            "decoder_sparse_step": 1, "norm_topk_prob": True, "moe_intermediate_size": raw["intermediate_size"], "mlp_only_layers": []}


# mergekit-moe's outputs that rotsym writes, in mergekit's order of preference; its Qwen MoE
# (Qwen2-MoE: a shared expert) and DeepSeek MoE (remote code) are not written
OUTPUTS = (Output("Mixtral", ("llama", "mistral"), _mixtral_keys), Output("Qwen3 MoE", ("qwen3",), _qwen3_moe_keys))
NOT_WRITTEN = ("Qwen MoE", "DeepSeek MoE")
SHARED = ("base", "average")
TOP_KEYS = ("base_model", "experts", "gate_mode", "dtype", "experts_per_token", "shared_experts", "architecture", "rotsym")
_strings = (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of texts")
_scale = (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)), "a number")
EXPERT_KEYS = {
    "source_model": (lambda v: isinstance(v, str), "a model's folder"),
    "positive_prompts": _strings,
    "negative_prompts": (lambda v: v is None or _strings[0](v), "a list of texts"),
    "noise_scale": _scale,
    "residual_scale": _scale,
}
ROTSYM_KEYS = {
    "align": (lambda v: isinstance(v, bool), "true or false (each expert's model moved onto the base first)"),
    "align_options": (lambda v: isinstance(v, dict), "a mapping of align's options"),
    "shared": (lambda v: v in SHARED, f"one of {SHARED} (the tensors outside the FFNs: the base's, or the models' average)"),
    "seed": (is_seed, "an integer (the key of random gates and noise)"),
    "data": (lambda v: isinstance(v, dict), "a mapping (file, text_field, batch_size, count, max_length)"),
}


@dataclasses.dataclass(frozen=True)
class Expert:
    """One expert of the config: its dense model's folder, prompts and scales."""

    model: str
    positive_prompts: tuple[str, ...] = ()
    negative_prompts: tuple[str, ...] = ()
    noise_scale: float | None = None
    residual_scale: float | None = None


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A mergekit-moe config as read (`load`), with its `rotsym:` block's settings."""

    base: str
    experts: tuple[Expert, ...]
    gate_mode: str = "hidden"
    dtype: str | None = None
    experts_per_token: int = 2
    architecture: str | None = None  # a prefix of an output's name, as mergekit reads it
    align: bool = False
    align_options: Mapping = dataclasses.field(default_factory=dict)
    shared: str = "base"
    seed: int = 0
    data: Data | None = None  # what align_options.method activations | learned runs on
    path: Path | None = None
    text: str = ""

    @property
    def models(self) -> list[str]:
        """The distinct models, the base first."""
        return list(dict.fromkeys([self.base, *(e.model for e in self.experts)]))


def is_moe_config(path: str | Path) -> bool:
    """Whether the YAML at `path` is a mergekit-moe config (top-level `experts`, no `merge_method`)."""
    try:
        root = yaml.compose(config_text(Path(path), "config"))
    except (RecipeError, yaml.YAMLError, RecursionError):
        return False
    keys = {k.value for k, _ in root.value} if isinstance(root, yaml.MappingNode) else set()
    return "experts" in keys and "merge_method" not in keys


def load(path: str | Path, *, allow_all_same: bool = False) -> MoeConfig:
    """Read and check the mergekit-moe config at `path`: RecipeError naming the key and its line for
    what mergekit refuses (as its `is_bad_config`) and for what rotsym does not run (shared
    experts, another output architecture, hidden_avg gates), before any weight is read."""
    path = Path(path)
    text, nodes = yaml_mapping(path, "mergekit-moe config", "base_model, experts, gate_mode")
    where = lambda key: f"{path}: line {line_of(nodes[key][0])}: {key}"  # noqa: E731
    unknown = [k for k in nodes if k not in TOP_KEYS]
    if unknown:
        raise RecipeError(f"{path}: line {line_of(nodes[unknown[0]][0])}: unknown key {unknown[0]!r}; a mergekit-moe config's keys: "
                          f"{list(TOP_KEYS)}")
    for key in ("base_model", "experts"):
        if key not in nodes:
            raise RecipeError(f"{path}: the key {key!r} is missing")
    raw = {k: yaml.safe_load(yaml.serialize(v)) for k, (_, v) in nodes.items() if k != "rotsym"}
    if raw.get("shared_experts"):
        raise RecipeError(f"{where('shared_experts')}: shared experts make Qwen2-MoE or DeepSeek outputs, which rotsym does not "
                          "write; it writes mergekit-moe's Mixtral and Qwen3 MoE outputs (no shared experts)")
    arch = raw.get("architecture")
    if arch is not None and not (isinstance(arch, str) and _outputs_named(arch)):
        raise RecipeError(f"{where('architecture')}: {short(repr(arch))}; rotsym writes mergekit-moe's {[o.name for o in OUTPUTS]} "
                          f"outputs (its {list(NOT_WRITTEN)} are not run)")
    mode = raw.get("gate_mode", "hidden")
    mode = GATE_ALIASES.get(mode, mode) if isinstance(mode, str) else mode
    if mode not in GATE_MODES:
        raise RecipeError(f"{where('gate_mode')}: {short(repr(raw['gate_mode']))}; expected one of {GATE_MODES} (or hidden_last, "
                          "hidden's other name; hidden_avg, which averages the padding's states too, is not run)")
    dtype = raw.get("dtype")
    dtype = dtype.removeprefix("torch.") if isinstance(dtype, str) else dtype
    if dtype is not None and dtype not in DTYPES:
        raise RecipeError(f"{where('dtype')}: {short(repr(dtype))}; expected one of {DTYPES}")
    k = raw.get("experts_per_token", 2)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise RecipeError(f"{where('experts_per_token')}: {short(repr(k))}; expected an integer >= 1")
    experts = _experts(path, nodes["experts"][1], mode)
    if len(experts) < k:
        raise RecipeError(f"{where('experts')}: {len(experts)} experts and experts_per_token {k}; give at least as many experts")
    _check_distinct(experts, mode, allow_all_same, where("experts"))
    base = model_path(raw["base_model"], where("base_model"))
    block = _rotsym(path, nodes["rotsym"][1]) if "rotsym" in nodes else {}
    return MoeConfig(base, experts, mode, dtype, k, arch, path=path, text=text, **block)


def _outputs_named(prefix: str) -> list[Output]:
    return [o for o in OUTPUTS if o.name.lower().startswith(prefix.lower())]


def output_for(model_type: str, architecture: str | None = None) -> Output:
    """The output mergekit-moe writes for dense models of `model_type` (InputError where rotsym
    writes none), among those `architecture` names."""
    candidates = _outputs_named(architecture) if architecture else list(OUTPUTS)
    chosen = next((o for o in candidates if model_type in o.inputs), None)
    if chosen is None:
        made_of = "; ".join(f"{o.name} of {list(o.inputs)}" for o in candidates)
        raise InputError(f"model_type {model_type!r}: {'architecture ' + repr(architecture) + ': ' if architecture else ''}rotsym writes "
                         f"{made_of} models (mergekit's {list(NOT_WRITTEN)} are not run)")
    return chosen


def _experts(path: Path, node, mode: str) -> tuple[Expert, ...]:
    if not isinstance(node, yaml.SequenceNode) or not node.value:
        raise RecipeError(f"{path}: line {line_of(node)}: experts must be a list of mappings (source_model, positive_prompts, ...)")
    experts = []
    for i, item in enumerate(node.value):
        at = f"experts[{i}]."
        fields = checked_keys(path, item, EXPERT_KEYS, at)
        if "source_model" not in fields:
            raise RecipeError(f"{path}: line {line_of(item)}: {at}source_model is missing")
        if mode != "random" and not fields.get("positive_prompts"):  # uniform_random too, as mergekit asks
            raise RecipeError(f"{path}: line {line_of(item)}: {at}positive_prompts: gate_mode {mode} needs at least one prompt an expert")
        experts.append(Expert(model_path(fields["source_model"], f"{path}: line {line_of(item)}: {at}source_model"),
                              tuple(fields.get("positive_prompts") or ()), tuple(fields.get("negative_prompts") or ()),
                              fields.get("noise_scale"), fields.get("residual_scale")))
    return tuple(experts)


def _check_distinct(experts: Sequence[Expert], mode: str, allow_all_same: bool, where: str) -> None:
    """mergekit's refusals of a mixture that routes nowhere or whose experts are all one model (a
    single expert is both, as mergekit counts)."""
    if mode != "random" and len({(e.positive_prompts, e.negative_prompts) for e in experts}) == 1:
        raise RecipeError(f"{where}: every expert has the same positive and negative prompts, so every router row is the same "
                          "vector (one expert: mergekit refuses it so too): give each expert prompts of what it should receive")
    if len({e.model for e in experts}) == 1 and not allow_all_same:
        raise RecipeError(f"{where}: every expert is the model {experts[0].model}: the mixture computes that model at more cost; "
                          "allow_all_same=True (--i-understand-this-is-not-useful-without-training) to train it further")


def _rotsym(path: Path, node) -> dict:
    if node is None:
        return {}
    top = checked_keys(path, node, ROTSYM_KEYS, "rotsym.")
    if "align_options" in top:
        child = next(v for k, v in node.value if k.value == "align_options")
        top["align_options"] = checked_keys(path, child, ALIGN_KEYS, "rotsym.align_options.")
    if "data" in top:
        top["data"] = data_of(path, next(v for k, v in node.value if k.value == "data"), prefix="rotsym.data.")
    return top


# ---- gates ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Prompts:
    """Every expert's prompts as one left-padded batch: `input_ids` and `attention_mask` (N, T),
    and `group` (N,): 2 e for expert e's positive prompts, 2 e + 1 for its negative ones."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    group: np.ndarray
    experts: int


def prompt_batch(token_ids: Sequence[tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]]], pad_id: int) -> Prompts:
    """`token_ids[e]` = (positive, negative) token id lists of expert e, padded on the left with
    `pad_id` (masked), as mergekit pads them."""
    rows = [(ids, 2 * e + side) for e, pair in enumerate(token_ids) for side, texts in enumerate(pair) for ids in texts]
    if not rows:
        raise InputError("prompt_batch: no prompt holds a token")
    width = max(len(ids) for ids, _ in rows)
    if width == 0:
        raise InputError("prompt_batch: every prompt is empty after tokenization")
    input_ids = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for n, (ids, _) in enumerate(rows):
        if len(ids):
            input_ids[n, width - len(ids):], mask[n, width - len(ids):] = ids, 1
    return Prompts(input_ids, mask, np.array([g for _, g in rows], np.int32), len(token_ids))


def _normalised(x, axis=-1):
    return x / jnp.maximum(jnp.linalg.norm(x, axis=axis, keepdims=True), 1e-8)  # mergekit's clamp


def _group_sums(values, group, groups: int):
    """(..., groups, d): the sum of `values` (..., N, d) over the rows of each group."""
    return jnp.einsum("gn,...nd->...gd", jax.nn.one_hot(group, groups, axis=0, dtype=values.dtype), values)


@jax.jit
def hidden_gates(states, group, experts_flag):
    """(L, E, d) gates of gate_mode hidden from `states` (L, N, d), each prompt's stream at its last
    token: each group's mean, positive minus negative, normalised per layer. `experts_flag` is a
    zero vector of length E (its length gives the number of experts under jit)."""
    groups = 2 * experts_flag.shape[0]
    counts = jnp.bincount(group, length=groups).astype(states.dtype)
    means = _group_sums(states, group, groups) / jnp.maximum(counts, 1)[:, None]  # a group of no prompt: zero
    return _normalised(means[:, 0::2] - means[:, 1::2])


@jax.jit
def cheap_embed_gates(embedding, input_ids, attention_mask, group, layers_flag, experts_flag):
    """(L, E, d) gates of gate_mode cheap_embed: each group's embedding rows summed over its tokens
    and normalised, positive minus negative, normalised; one vector for every layer."""
    groups = 2 * experts_flag.shape[0]
    rows = jnp.sum(embedding.astype(jnp.float32)[input_ids] * attention_mask[..., None], axis=1)  # (N, d)
    sums = _group_sums(rows, group, groups)
    present = jnp.bincount(group, length=groups) > 0  # mergekit subtracts no vector where there are no negative prompts
    summary = jnp.where(present[:, None], _normalised(sums), 0.0)
    gates = _normalised(summary[0::2] - summary[1::2])
    return jnp.broadcast_to(gates, (layers_flag.shape[0], *gates.shape))


def random_gates(key, mode: str, shape: tuple[int, int, int]):
    """(L, E, d) gates of gate_mode random (standard normal) or uniform_random (U(-s, s), s = 1 / sqrt(d):
    torch.nn.Linear's initialisation), drawn from `key`."""
    if mode == "random":
        return jax.random.normal(key, shape, jnp.float32)
    scale = 1.0 / np.sqrt(shape[-1])
    return jax.random.uniform(key, shape, jnp.float32, -scale, scale)


def gate_vectors(mode: str, base: Checkpoint, params, experts: int, prompts: Prompts | None = None, *, key=None):
    """(L, E, d) float32: the router rows of every layer for `experts` experts (`mode` one of
    GATE_MODES), from the base model `base` with `params`; `prompts` for hidden and cheap_embed,
    `key` for the random modes."""
    config = base.model_config
    layers, d = config.num_hidden_layers, config.hidden_size
    if mode in ("random", "uniform_random"):
        if key is None:
            raise InputError(f"gate_mode {mode}: give key, the draws' PRNG key")
        return random_gates(key, mode, (layers, experts, d))
    if mode not in ("hidden", "cheap_embed"):
        raise InputError(f"gate_mode {mode!r}: expected one of {GATE_MODES}")
    if prompts is None or prompts.experts != experts:
        raise InputError(f"gate_mode {mode} reads the experts' prompts: give prompts (prompt_batch) of {experts} experts")
    flag = jnp.zeros(experts)
    if mode == "cheap_embed":
        table = flatten(params)["embeddings/word/embedding"]
        return cheap_embed_gates(table, prompts.input_ids, prompts.attention_mask, prompts.group, jnp.zeros(layers), flag)
    inputs = {"input_ids": jnp.asarray(prompts.input_ids), "attention_mask": jnp.asarray(prompts.attention_mask)}
    # the Flax forward pass (`rj.nets`, loaded on first use: a merge's command line never loads Flax)
    states = rj.nets.llama.layer_inputs(base.graphdef, base.forward_params(params), inputs)[:, :, -1].astype(jnp.float32)  # left-padded: the last token
    return hidden_gates(states, jnp.asarray(prompts.group), flag)


# ---- the mixture ------------------------------------------------------------------------------------

def check_inputs(base: Checkpoint, experts: Sequence[Checkpoint], names: Sequence[str], architecture: str | None = None) -> Output:
    """The output of these models (`output_for`); InputError, naming the model and the value,
    unless every model is of the base's type and shapes with a plain gated FFN, as mergekit needs."""
    try:
        output = output_for(base.model_config.model_type, architecture)
    except InputError as e:
        raise InputError(f"{names[0]}: {e}") from None
    for ck, name in zip([base, *experts], names):
        config = ck.model_config
        if config.model_type != base.model_config.model_type:
            raise InputError(f"{name}: model_type {config.model_type!r}, the base's {base.model_config.model_type!r}: mergekit-moe "
                             "needs one architecture")
        for key in ("attention_bias", "mlp_bias"):
            if config.raw.get(key):
                raise InputError(f"{name}: {key}=true; biases are not carried into the mixture (Mixtral has none, mergekit-moe drops "
                                 "them): not run")
        if config.raw.get("hidden_act", "silu") != base.model_config.raw.get("hidden_act", "silu"):
            raise InputError(f"{name}: hidden_act {config.raw.get('hidden_act')!r}, the base's {base.model_config.raw.get('hidden_act')!r}")
        if ck.layout.head != "lm":
            raise InputError(f"{name}: a {ck.layout.head or 'bare'} model; the experts and the base are causal LMs (*ForCausalLM)")
    shapes = {p: np.shape(x) for p, x in flatten(base.params).items()}
    for ck, name in zip(experts, names[1:]):
        theirs = {p: np.shape(x) for p, x in flatten(ck.params).items()}
        differ = sorted(p for p in shapes.keys() | theirs.keys() if shapes.get(p) != theirs.get(p))
        if differ:
            p = differ[0]
            raise InputError(f"{name}: {p} has shape {theirs.get(p)}, the base's {shapes.get(p)} ({len(differ)} leaves differ): the "
                             "experts' models must have the base's shapes")
    return output


def moe_config(base: Checkpoint, output: Output, experts: int, experts_per_token: int):
    """The output's config: the base's with `output`'s keys (`experts` experts of the base's FFN
    width, top `experts_per_token`), as mergekit writes it."""
    raw = {**base.model_config.raw, **output.keys(base.model_config.raw, experts, experts_per_token),
           "rope_parameters": dict(base.model_config.rope_parameters)}  # explicit: Mixtral's default theta is not Llama's
    raw.pop("torch_dtype", None)  # the old name of dtype, which saving sets
    return read_config(raw, "the mixture's config")


@dataclasses.dataclass(frozen=True)
class Experts:
    """How the experts' FFNs become the mixture's: each expert's `residual_scales` (its down
    projection's factor) and `noise_scales` (standard normal noise drawn from `key`), None: none."""

    residual_scales: tuple[float | None, ...]
    noise_scales: tuple[float | None, ...] = ()
    key: jax.Array | None = None

    def __post_init__(self):
        if not self.noise_scales:
            object.__setattr__(self, "noise_scales", (None,) * len(self.residual_scales))
        if len(self.noise_scales) != len(self.residual_scales):
            raise InputError(f"noise_scales: {len(self.noise_scales)} values for {len(self.residual_scales)} experts")
        if any(s is not None for s in self.noise_scales) and self.key is None:
            raise InputError("noise_scales: give key, the noise's PRNG key")


_MOE_LEAF = re.compile(r"layers/(\d+)/moe/(router|gate|up|down)/kernel")
_FFN = ("gate", "up", "down")


def mixture_leaf(path: str, shared_leaf: Callable[[str], jax.Array], expert_leaf: Callable[[int, str], jax.Array], router,
                 experts: Experts, layers: int) -> jax.Array:
    """The mixture's leaf `path`: `router[l]` transposed for layer l's router; each expert's leaf of
    its dense FFN (`expert_leaf(e, dense path)`), noised then scaled, stacked; else `shared_leaf(path)`.
    One leaf at a time, so that a streamed run reads only the tensors it writes."""
    found = _MOE_LEAF.fullmatch(path)
    if found is None:
        return shared_leaf(path)
    i, which = int(found[1]), found[2]
    if which == "router":
        return jnp.asarray(router[i]).T
    stack = []
    for e, (noise, scale) in enumerate(zip(experts.noise_scales, experts.residual_scales)):
        x = jnp.asarray(expert_leaf(e, f"layers/{i}/mlp/{which}/kernel"))
        if noise is not None:
            x = x + noise * jax.random.normal(jax.random.fold_in(experts.key, (e * layers + i) * 3 + _FFN.index(which)), x.shape, x.dtype)
        if which == "down" and scale is not None:
            x = x * scale
        stack.append(x)
    return jnp.stack(stack)


def mixture_checkpoint(base: Checkpoint, output: Output, experts: int, experts_per_token: int) -> Checkpoint:
    """The mixture's Checkpoint without params: its config (`moe_config`) and transformers 5's
    layout of stacked experts, as mergekit writes it; the base's folder (its tokenizer) as source."""
    config = moe_config(base, output, experts, experts_per_token)
    layout = Layout(prefix=base.layout.prefix, head="lm", stacked_experts=True)
    return Checkpoint(family_of(config).name, config, {}, layout, base.dtype, base.source)


def build_moe(base: Checkpoint, shared_params: Sequence, expert_params: Sequence, router, *, output: Output = OUTPUTS[0],
              experts_per_token: int = 2, experts: Experts | None = None) -> tuple[Checkpoint, dict]:
    """The mixture's checkpoint (`output`: Mixtral or Qwen3 MoE) and params made of dense params of
    `base`'s architecture: every leaf outside the FFNs the mean of `shared_params` (mergekit: the
    base's alone), expert e of each layer the FFN of `expert_params[e]` (`experts`: its noise and
    residual scale; default none), and the router of layer l the rows `router[l]` (E, d). Pure: the
    inputs are not changed."""
    num = len(expert_params)
    experts = experts or Experts((None,) * num)
    if len(experts.residual_scales) != num:
        raise InputError(f"experts: scales of {len(experts.residual_scales)} experts for {num} expert models")
    layers, d = base.model_config.num_hidden_layers, base.model_config.hidden_size
    if np.shape(router) != (layers, num, d):
        raise InputError(f"router: shape {np.shape(router)}; expected (layers, experts, hidden_size) = {(layers, num, d)}")
    checkpoint = mixture_checkpoint(base, output, num, experts_per_token)
    flats, dense = [flatten(p) for p in shared_params], [flatten(p) for p in expert_params]

    def shared_leaf(path):
        return flats[0][path] if len(flats) == 1 else sum(jnp.asarray(f[path], jnp.float32) for f in flats) / len(flats)

    shapes = family_of(checkpoint.model_config).shapes(checkpoint.model_config, checkpoint.layout)
    params = unflatten({p: mixture_leaf(p, shared_leaf, lambda e, q: dense[e][q], router, experts, layers) for p in shapes})
    return dataclasses.replace(checkpoint, params=params), params
