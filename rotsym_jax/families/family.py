"""Model families and their task heads, as data.

A `Family` is one declarative record: what it reads from config.json (a `ConfigSchema` per
model_type it serves, with the transformers class-name stem of each), the base-model prefix that
headed checkpoints put before its tensor names, every tensor of the base model as a `Tensor`
(its HF name with `{i}` for the layer, our leaves, how the layout converts, each leaf's shape
from the config and the axis of each leaf that carries the residual stream), its norm (`Norm`:
kind, gain convention, placement, which leaves read each gain), its rotary layout, its task heads
(`Head` records, the same kind of tables) and the Flax forward pass, which only the features
where data flows need (barriers, statistics, OT fusion from activations).

The loader and saver (`rotsym_jax.hf`), the symmetry spec (`Family.spec`), the residual-stream
rules and the folding of RMSNorm gains all read these records; nothing else knows a family by
name. `docs/families.md` walks through adding a family and adding a head.

Our leaves follow one naming scheme in every family: `embeddings/...`, `layers/{i}/attention/
{query,key,value,out}`, `layers/{i}/mlp/{up,gate,down}`, `layers/{i}/{attention,mlp}_norm`,
`final_norm`, `pooler/dense`, `lm_head` (a decoder's untied LM head), and `head/...` for a task
head, which a model may lack or hold for another label set (`Spec.optional`). So one table of group rules
(`SPEC_RULES`) serves every family.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..checks import OPTIONAL_LEAVES, TASK_HEAD_LEAVES
from ..errors import InputError
from ..spec import HeadGeometry, ResidualSpec, Spec
from .config import ConfigSchema

# ---- the symmetry groups of the shared leaf names -------------------------------------------------

_LAYER = r"layers/(?P<layer>\d+)"
_LAYER_INDEX = r"layers/(\d+)"
# Leaves no symmetry group touches, listed explicitly so that a new leaf is never skipped silently.
# (The O bias and the FFN output bias live outside every head / hidden unit, MATH §1; a QK-norm
# gain is one per head entry, shared by all heads: the QK group left to such a model, head
# permutations and sign flips, commutes with it, MATH §1; an activation's own scalars, Apertus'
# xIELU, act on every hidden unit alike, so the FFN's permutations commute with them.)
_UNTOUCHED = (
    r"(embeddings|final_norm|pooler|head|lm_head)/.*"
    r"|layers/(?P<layer>\d+)/((attention|mlp)(_post)?_norm/.*|attention/(query_norm|key_norm)/.*|attention/out/bias|mlp/down/bias|mlp/act/.*)"
)
# A mixture of experts (MATH §5): experts permuted with the router's outputs, each expert's units on
# their own; the group's name is "moe".
_MOE_RULES = (
    (rf"{_LAYER}/moe/router/kernel", (None, "moe.expert")),
    (rf"{_LAYER}/moe/(up|gate)/kernel", ("moe.expert", None, "moe.unit")),
    (rf"{_LAYER}/moe/down/kernel", ("moe.expert", "moe.unit", None)),
)
SPEC_RULES = (
    (rf"{_LAYER}/attention/query/kernel", (None, "attn.q")),
    (rf"{_LAYER}/attention/query/bias", ("attn.q",)),
    (rf"{_LAYER}/attention/key/kernel", (None, "attn.k")),
    (rf"{_LAYER}/attention/key/bias", ("attn.k",)),
    (rf"{_LAYER}/attention/value/kernel", (None, "attn.v")),
    (rf"{_LAYER}/attention/value/bias", ("attn.v",)),
    (rf"{_LAYER}/attention/out/kernel", ("attn.o", None)),
    (rf"{_LAYER}/mlp/gate/kernel", (None, "ffn")),
    (rf"{_LAYER}/mlp/gate/bias", ("ffn",)),
    (rf"{_LAYER}/mlp/up/kernel", (None, "ffn.in")),  # a unit's scale where a gate is there too (spec.py)
    (rf"{_LAYER}/mlp/up/bias", ("ffn.in",)),
    (rf"{_LAYER}/mlp/down/kernel", ("ffn.out", None)),
    *_MOE_RULES,
    (_UNTOUCHED, None),
)
# A full-width QK-norm's gains (OLMo-2: one per entry of all heads) follow the head permutations.
FULL_QK_NORM_RULES = (
    (rf"{_LAYER}/attention/query_norm/scale", ("attn.qn",)),
    (rf"{_LAYER}/attention/key_norm/scale", ("attn.kn",)),
)
# Every family keeps its task head under `head/` and its pooler, which some task classes drop
# (BertForTokenClassification, ...), under `pooler/`: a model may lack them, or hold a head of
# another label set (`Spec.optional`).
OPTIONAL = rf"({TASK_HEAD_LEAVES})|({OPTIONAL_LEAVES})"
# A fold's reader regex that matches no leaf: the gain stays (a tied LM head reads the norm).
NO_READER = r"(?!)"


def pre_norm_folds(mlp_inputs: str, final_readers: str, moe: bool = False) -> tuple[tuple[str, str], ...]:
    """`Norm.folds` of a pre-norm model with the shared leaf names: each layer's attention norm
    read by its Q/K/V, its MLP norm by `mlp_inputs` (e.g. "up", "(up|gate)") and, with `moe`, by
    a mixture of experts' router and experts, the final norm by `final_readers` (a regex of the
    kernels' owners: heads, pooler, LM head)."""
    mlp = rf"mlp/{mlp_inputs}" + ("|moe/(router|up|gate)" if moe else "")
    return (
        (rf"{_LAYER_INDEX}/attention_norm/scale", r"layers/\1/attention/(query|key|value)/kernel"),
        (rf"{_LAYER_INDEX}/mlp_norm/scale", rf"layers/\1/({mlp})/kernel"),
        (r"final_norm/scale", rf"{final_readers}/kernel"),
    )


def multi_head_geometry(config) -> HeadGeometry:
    """Multi-head attention without RoPE, head width hidden_size / num_heads."""
    heads = config.num_attention_heads
    return HeadGeometry(heads, heads, config.hidden_size // heads)


# ---- tensors ----------------------------------------------------------------------------------------

# A size: a number, a config attribute, or a function of the config.
Dim = Any


def size(config, dim: Dim) -> int:
    if isinstance(dim, str):
        return getattr(config, dim)
    if callable(dim):
        return dim(config)
    return dim


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One HF tensor <-> one or more of our leaves, for one config and layout (what a `Tensor`
    of a record resolves to). `to_ours(hf_array) -> tuple of arrays` (one per path in `ours`),
    `to_hf(tuple) -> hf_array`: inverses of each other, on NumPy arrays."""

    hf: str
    ours: tuple[str, ...]
    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_hf: Callable[[tuple[np.ndarray, ...]], np.ndarray]
    index: int | None = None  # a stacked leaf's slot (axis 0) this tensor fills: one expert's; None: the whole leaf


def assemble(rule_leaves) -> dict:
    """{our path: leaf} from `(rule, leaves)` pairs (`leaves` = `rule.to_ours(...)`): a stacked
    leaf (an expert per slot) is stacked from its rules' slices, in slot order."""
    out, slots = {}, {}
    for rule, leaves in rule_leaves:
        for path, leaf in zip(rule.ours, leaves):
            if rule.index is None:
                out[path] = leaf
            else:
                slots.setdefault(path, {})[rule.index] = leaf
    for path, parts in slots.items():
        out[path] = np.stack([parts[k] for k in range(len(parts))])
    return out


@dataclasses.dataclass(frozen=True)
class Convert:
    """How a stored tensor becomes our leaves: `to_ours(array, config)`, `to_hf(leaves, config)`."""

    name: str
    to_ours: Callable[[np.ndarray, Any], tuple]
    to_hf: Callable[[tuple, Any], np.ndarray]


COPY = Convert("copy", lambda a, c: (a,), lambda t, c: t[0])
# torch nn.Linear stores (out, in); our kernels are (in, out).
TRANSPOSE = Convert("transpose", lambda a, c: (a.T,), lambda t, c: t[0].T)


def _half_order(heads: int, head_dim: int, rotary: int) -> np.ndarray:
    """Our q/k columns, as indices of a layout whose heads rotate interleaved pairs (2i, 2i + 1):
    in each head the even rotary entries, then the odd ones (a pair (2i, 2i + 1) lands on
    (i, i + r/2), the rotate_half order), then the entries past `rotary`."""
    within = np.concatenate([np.arange(0, rotary, 2), np.arange(1, rotary, 2), np.arange(rotary, head_dim)])
    return (np.arange(heads)[:, None] * head_dim + within).reshape(-1)


def interleaved_rotary(heads: Dim, head_dim: Dim, rotary: Dim) -> Convert:
    """A q or k projection of `heads` heads of `head_dim` entries whose first `rotary` entries
    rotate in interleaved pairs (2i, 2i + 1) (GPT-J's `rotate_every_two`, Cohere's `rotate_half`):
    torch's (out, in) weight transposed, or its bias, its output entries reordered into the
    rotate_half order (i, i + r/2) every solver uses; and back. The same reordering of q and k
    leaves every score as it was."""
    def order(c):
        return _half_order(size(c, heads), size(c, head_dim), size(c, rotary))

    return Convert("interleaved_rotary", lambda a, c: ((a.T if a.ndim == 2 else a)[..., order(c)],),
                   lambda t, c: (lambda x: x.T if x.ndim == 2 else x)(t[0][..., np.argsort(order(c))]))


def interleaved_projection(hf: str, ours: str, heads: Dim, head_dim: Dim, rotary: Dim, width: Dim, *, bias) -> tuple[Tensor, ...]:
    """A q or k projection (torch nn.Linear `hf`, reading the stream) whose heads rotate interleaved
    pairs: its weight and bias (True, False or a predicate of the config) reordered by
    `interleaved_rotary` into our kernel and bias under `ours`."""
    pairs = interleaved_rotary(heads, head_dim, rotary)
    return (
        Tensor(f"{hf}.weight", (f"{ours}/kernel",), (("hidden_size", width),), (0,), pairs),
        Tensor(f"{hf}.bias", (f"{ours}/bias",), ((width,),), (None,), pairs, _bias(bias)),
    )


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of a checkpoint, declaratively.

    hf: its name, relative to the base model for the base model's tensors (the loader adds the
        checkpoint's prefix) and to the whole model for a head's, with `{i}` for the layer index
        and `{prefix}` where a head's tensor sits inside the base model (ViT's mask token).
    ours: our leaf paths it fills (several for a fused tensor), `{i}` likewise.
    shapes: each leaf's shape, as sizes (`Dim`).
    stream: each leaf's axis on the residual stream (MATH §10): an int, a tuple of ints (a head's
        transform read from and written to the stream), or None (the leaf does not touch it).
    convert: the layout conversion. when: a predicate of the config (a bias the config may omit).
    experts: a stacked tensor (None: a plain one): the checkpoint stores one tensor per expert
        (`{e}` in `hf`), our leaves stack them along axis 0; the number of experts (a `Dim`).
    in_layer: for a layer tensor that some layers lack (ModernBERT's first layer has no attention
        norm), whether layer i holds it.
    stacked: a mixture's tensor held only where its experts are stored stacked (True), or one per
        expert (False), as `Layout.stacked_experts` says; None: either.
    """

    hf: str
    ours: tuple[str, ...]
    shapes: tuple[tuple[Dim, ...], ...]
    stream: tuple[Any, ...]
    convert: Convert = COPY
    when: Callable[[Any], bool] | None = None
    experts: Dim | None = None
    in_layer: Callable[[Any, int], bool] | None = None  # a layer tensor some layers lack: (config, i) -> held
    stacked: bool | None = None

    def present(self, config) -> bool:
        return self.when is None or bool(self.when(config))

    def rules(self, config, prefix: str, i: int | None = None, *, in_base: bool = True) -> list[TensorRule]:
        """The tensor of layer `i` in a checkpoint whose base model carries `prefix` (`in_base`:
        a base-model tensor, named relative to it): one rule, or one per expert."""
        name = prefix + self.hf if in_base else self.hf.replace("{prefix}", prefix)
        ours = self.ours
        if i is not None:  # once per tensor, not per expert: a default MoE config has 10^5 expert rules
            name, ours = name.replace("{i}", str(i)), tuple(p.replace("{i}", str(i)) for p in ours)
        convert = self.convert

        def to_ours(a):
            return convert.to_ours(a, config)

        if self.experts is None:
            return [TensorRule(name, ours, to_ours, lambda t: convert.to_hf(t, config))]
        return [TensorRule(name.replace("{e}", str(e)), ours, to_ours, functools.partial(_expert_to_hf, convert, config, e), index=e)
                for e in range(size(config, self.experts))]

    def leaf_shapes(self, config, i: int | None = None) -> dict[str, tuple[int, ...]]:
        fill = (lambda s: s) if i is None else (lambda s: s.replace("{i}", str(i)))
        return {fill(p): tuple(size(config, d) for d in shape) for p, shape in zip(self.ours, self.shapes)}


def _expert_to_hf(convert, config, e, t):
    return convert.to_hf(tuple(x[e] for x in t), config)


def _bias(when) -> Callable[[Any], bool] | None:
    return None if when is True else (lambda c: False) if when is False else when


def weight(hf: str, ours: str, shape: tuple[Dim, ...], *, stream=None, when=None) -> tuple[Tensor, ...]:
    """A tensor stored as our leaf is (an embedding table, a token, a gain)."""
    return (Tensor(hf, (ours,), (shape,), (stream,), COPY, when),)


def embedding(hf: str, ours: str, rows: Dim, d: Dim = "hidden_size") -> tuple[Tensor, ...]:
    """An embedding table (rows, d): it writes the residual stream (axis 1)."""
    return weight(hf, ours, (rows, d), stream=1)


def linear(hf: str, ours: str, d_in: Dim, d_out: Dim, *, bias=True, reads: bool = False, writes: bool = False,
           transpose: bool = True) -> tuple[Tensor, ...]:
    """A dense layer: torch's nn.Linear `hf.weight` (out, in) (`transpose=False`: GPT-2's Conv1D,
    (in, out)) <-> our `ours/kernel` (in, out), and `hf.bias` <-> `ours/bias` (bias: True, False
    or a predicate of the config). `reads`: its input is the residual stream (kernel axis 0);
    `writes`: its output is (kernel axis 1 and the bias)."""
    stream = (0, 1) if reads and writes else 0 if reads else 1 if writes else None
    out = [Tensor(f"{hf}.weight", (f"{ours}/kernel",), ((d_in, d_out),), (stream,), TRANSPOSE if transpose else COPY)]
    if bias is not False:
        out.append(Tensor(f"{hf}.bias", (f"{ours}/bias",), ((d_out,),), (0 if writes else None,), COPY, _bias(bias)))
    return tuple(out)


def attention_projections(hf: str, ours: str, q_width: Dim, kv_width: Dim, *, bias=False, out_bias=False,
                          d: Dim = "hidden_size") -> tuple[Tensor, ...]:
    """A decoder layer's `q_proj`, `k_proj`, `v_proj` (reading the stream) and `o_proj` (writing it)
    <-> our query, key, value and out under `ours` (biases: True, False or a predicate of the config)."""
    return (
        *linear(f"{hf}.q_proj", f"{ours}/query", d, q_width, bias=bias, reads=True),
        *linear(f"{hf}.k_proj", f"{ours}/key", d, kv_width, bias=bias, reads=True),
        *linear(f"{hf}.v_proj", f"{ours}/value", d, kv_width, bias=bias, reads=True),
        *linear(f"{hf}.o_proj", f"{ours}/out", q_width, d, bias=out_bias, writes=True),
    )


def gated_mlp(hf: str, ours: str, *, bias=False, d: Dim = "hidden_size", f: Dim = "intermediate_size") -> tuple[Tensor, ...]:
    """A decoder layer's `gate_proj`, `up_proj` (reading the stream) and `down_proj` <-> our gate, up, down."""
    return (
        *linear(f"{hf}.gate_proj", f"{ours}/gate", d, f, bias=bias, reads=True),
        *linear(f"{hf}.up_proj", f"{ours}/up", d, f, bias=bias, reads=True),
        *linear(f"{hf}.down_proj", f"{ours}/down", f, d, bias=bias, writes=True),
    )


def norm(hf: str, ours: str, d: Dim = "hidden_size", *, bias: bool = True, gain: str = "weight", stream: bool = True) -> tuple[Tensor, ...]:
    """A LayerNorm or RMSNorm: `hf.<gain>` <-> `ours/scale` (and `hf.bias` <-> `ours/bias`), on
    the residual stream unless `stream` is False."""
    axis = 0 if stream else None
    out = [Tensor(f"{hf}.{gain}", (f"{ours}/scale",), ((d,),), (axis,))]
    if bias:
        out.append(Tensor(f"{hf}.bias", (f"{ours}/bias",), ((d,),), (axis,)))
    return tuple(out)


# ---- records ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layout:
    """What a checkpoint holds besides the base model.

    prefix: the base-model prefix its tensor names carry ("" for a bare `BertModel`, "bert." for
        `BertForSequenceClassification`); saved checkpoints keep it.
    head: the task head's name (a `Head.name` of the family) or None.
    pooler: whether the base model has a pooler (BERT/RoBERTa/ViT).
    stacked_experts: whether a mixture's experts are stored stacked, as transformers 5 holds them
        (`mlp.experts.gate_up_proj`: what a tool saving its state dict writes), not one per expert.
    """

    prefix: str = ""
    head: str | None = None
    pooler: bool = False
    stacked_experts: bool = False

    def name(self, base_name: str) -> str:
        return self.prefix + base_name


@dataclasses.dataclass(frozen=True)
class Norm:
    """The family's norms. kind: "layernorm" (only permutations of the stream commute with it) or
    "rmsnorm" (any rotation, once the gains are folded). gain: "weight" (the gain is stored as is)
    or "one_plus" (stored as w, the gain is 1 + w). placement: "pre" (each sublayer reads the
    stream through a norm), "post" (the stream passes a norm after each residual sum) or
    "sandwich" (pre-norms, and each sublayer's output normed before the sum: Gemma 2 and 3).
    folds: `(norm gain regex, reader regex)` pairs (`ResidualSpec.folds`): the kernels whose input
    rows absorb each norm's gain; or a function of the config (None: the family's default) giving
    them, where the config says which sublayers read a norm (StableLM's parallel layers)."""

    kind: str
    placement: str
    gain: str = "weight"
    folds: tuple[tuple[str, str], ...] | Callable[[Any], tuple[tuple[str, str], ...]] = ()


@dataclasses.dataclass(frozen=True)
class Head:
    """A task head: a class of transformers (`<stem><suffix>`, e.g. BertForTokenClassification)
    and the tensors it adds to the base model.

    name: the head's name (`Layout.head`), shared across families for the same task.
    tensors: its `Tensor`s (names relative to the whole model; our leaves under `head/`, or
        `lm_head/` for a decoder's own LM head, which merges like the body).
    pooler: True when the head reads the base model's pooler (it must be there); None: either.
    markers: HF tensor names (without prefix) that identify the head when config.json's
        `architectures` does not name its class; () for a head told apart only by the class.
    needs_no_pooler: markers count only in a checkpoint without a pooler (a token classifier
        and a sequence classifier both store `classifier.weight`).
    tied(config): {HF name: our leaf or HF name} of tensors transformers ties to another: read
        only to check they equal it, never saved.
    prefixes: {model_type: base-model prefix} where the head's class names its base model
        otherwise than the family (LlamaForQuestionAnswering: "transformer.").
    forward: whether our Flax model runs the head (the features where data flows need it).
    loss: whether the head's outputs are "logits", one distribution over labels per example or
        token, which losses and Fisher statistics read (question answering gives start and end
        logits instead: it runs, but has no such loss here).
    """

    name: str
    suffix: str
    tensors: tuple[Tensor, ...] = ()
    pooler: bool | None = None
    markers: tuple[str, ...] = ()
    needs_no_pooler: bool = False
    tied: Callable[[Any], Mapping[str, str]] = lambda config: {}
    prefixes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    forward: bool = False
    loss: bool = True


@dataclasses.dataclass(frozen=True)
class InferredRecord:
    """A record for a `model_type` without one, inferred from its tensors (`rotsym_jax.infer_record`):
    its checkpoints hold exactly the tensors of `read_as`, one of our model types, and are read with
    that record's tables and symmetry groups under transformers' class names `stem` + suffix.
    `proven`: the element kinds that held in transformers (name: largest relative difference), the
    proof that made it acceptable. Data only: it can be saved as JSON and given back."""

    model_type: str
    read_as: str
    stem: str
    proven: Mapping[str, float | None] = dataclasses.field(default_factory=dict, compare=False)  # the evidence, not the record
    tensors: tuple = ()  # read_as "tensors" (`families.tensors`): the (name, shape) of every tensor it reads

    def to_json(self) -> dict:
        return {"model_type": self.model_type, "read_as": self.read_as, "stem": self.stem, "proven": dict(self.proven)}

    @classmethod
    def from_json(cls, data: Mapping) -> InferredRecord:
        missing = [k for k in ("model_type", "read_as", "stem") if not isinstance(data.get(k), str)]
        if missing:
            raise InputError(f"an inferred record needs strings {missing}; got {dict(data)}")
        return cls(data["model_type"], data["read_as"], data["stem"], dict(data.get("proven") or {}))


def split_streams(whole: ResidualSpec, streams: tuple[tuple, ...]) -> tuple[ResidualSpec, ...]:
    """`whole`'s rules and folds split into one named spec per stream ((name, regex[, why only
    permutations keep it])): a leaf (and a norm gain) on the first stream whose regex matches its
    path, axis None on the others; the last regex is the rest (".*"), so that every leaf on the
    stream lands on one."""
    if not streams or streams[-1][1] != ".*":
        raise InputError(f"streams {streams}: the last stream takes the rest (regex '.*')")
    out = []
    for k, (name, regex, *only) in enumerate(streams):
        # a guard before each rule: this stream's regex matches the whole path, no earlier stream's does
        guard = "".join(rf"(?!(?:{s[1]})\Z)" for s in streams[:k]) + rf"(?=(?:{regex})\Z)"
        rules = tuple((guard + pattern, axis) for pattern, axis in whole.rules) + ((".*", None),)
        folds = tuple((guard + gain, readers) for gain, readers in whole.folds)
        out.append(dataclasses.replace(whole, rules=rules, folds=folds, name=name, permutations_only=(only or [None])[0]))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family (one Flax model class, one or more HF `model_type`s), as data.

    configs: a ConfigSchema per model_type the family serves: what it reads from config.json.
    stems: {model_type: transformers class-name stem} ("Bert" -> BertModel, BertFor...).
    prefix: the base-model prefix of headed checkpoints (transformers' `base_model_prefix` + ".").
    marker: a base-model tensor every checkpoint holds (unprefixed): it tells the prefix.
    embeddings, layer, final: the base model's tensors before, in (`{i}`) and after the layers.
    pooler: the pooler's tensors (a checkpoint may have them or not).
    heads: the task heads, in the order their markers are tried.
    default_head: the head of a prefixed checkpoint that stores no head tensor (a tied LM head).
    norm: the norms (`Norm`). rotary: the RoPE layout ("rotate_half") or None.
    num_layers: the config attribute holding the depth.
    build(config, layout, dtype, rngs) -> nnx.Module: the forward pass (heads with `forward`).
    ignored: regexes of HF tensor names that are buffers, not parameters (skipped on load).
    unsupported: (config attribute, what it adds) pairs: a config that sets one describes
        tensors or symmetries the record does not (refused on load, naming it).
    head_geometry(config) -> HeadGeometry of the attention blocks (None: the family has none).
    class_names: {<stem><suffix>: transformers' class} where a class is named otherwise
        (Gemma3ForCausalLM, not Gemma3TextForCausalLM).
    input: what the forward pass reads: "input_ids" (token ids) or "pixel_values" (images).
    rules: `Spec` rules of leaves no other family has (tried before the shared `SPEC_RULES`).
    zero_sizes: config sizes the family reads as 0 (DeBERTa-v3's type_vocab_size: no table).
    """

    name: str
    configs: tuple[ConfigSchema, ...]
    stems: Mapping[str, str]
    prefix: str
    marker: str
    embeddings: tuple[Tensor, ...]
    layer: tuple[Tensor, ...]
    final: tuple[Tensor, ...]
    norm: Norm
    build: Callable[..., Any]
    pooler: tuple[Tensor, ...] = ()
    heads: tuple[Head, ...] = ()
    default_head: str | None = None
    rotary: str | None = None
    num_layers: str = "num_hidden_layers"
    ignored: tuple[str, ...] = ()
    unsupported: tuple[tuple[str, str], ...] = ()
    head_geometry: Callable[[Any], HeadGeometry] = multi_head_geometry
    class_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    forward: bool = True  # whether `build` is this family's forward pass (False: a record inferred onto it)
    input: str = "input_ids"
    rules: tuple = ()  # spec rules of leaves only this family has, tried before the shared SPEC_RULES
    zero_sizes: tuple[str, ...] = ()  # config sizes that may be 0 (the loader's checks want the others positive)
    # A model of several residual streams that share no tensor (Whisper's encoder and decoder): (name, regex
    # of the leaves on it[, why only permutations keep it]) each, a leaf on the first whose regex matches;
    # empty: one stream (`residual_spec`)
    streams: tuple[tuple, ...] = ()

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(c.model_type for c in self.configs)

    def schema(self, model_type: str) -> ConfigSchema:
        return next(c for c in self.configs if c.model_type == model_type)

    def head(self, name: str | None) -> Head | None:
        if name is None:
            return None
        for head in self.heads:
            if head.name == name:
                return head
        raise InputError(f"{self.name} has no head {name!r}; its heads: {[h.name for h in self.heads]}")

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.ignored)

    # ---- the checkpoint's tensors ------------------------------------------------------------------

    def _tables(self, config, layout: Layout):
        """(tensor, layer or None, in the base model) of every tensor of a checkpoint of this layout."""
        for t in self.embeddings:
            yield t, None, True
        for i in range(getattr(config, self.num_layers)):
            for t in self.layer:
                if (t.in_layer is None or t.in_layer(config, i)) and t.stacked in (None, layout.stacked_experts):
                    yield t, i, True
        for t in self.final + (self.pooler if layout.pooler else ()):
            yield t, None, True
        head = self.head(layout.head)
        for t in head.tensors if head is not None else ():
            yield t, None, False

    def tensors(self, config, layout: Layout, limit: int | None = None) -> list[TensorRule]:
        """Every HF tensor of a checkpoint of this layout, with our leaves (full HF names). `limit`:
        a checkpoint's number of tensors, past which the config cannot describe it (refused as soon
        as it is passed, before a config claiming 65,536 experts a layer builds them all)."""
        rules = []
        for t, i, in_base in self._tables(config, layout):
            if t.present(config):
                rules += t.rules(config, layout.prefix, i, in_base=in_base)
                if limit is not None and len(rules) > limit:
                    raise InputError(f"its config implies more than {limit} tensors, far more than the checkpoint holds: the config "
                                     "does not describe these weights (its layers or experts?)")
        return rules

    def shapes(self, config, layout: Layout) -> dict[str, tuple[int, ...]]:
        """{our leaf: shape} of a checkpoint of this layout, from the config alone."""
        out = {}
        for t, i, _ in self._tables(config, layout):
            if t.present(config):
                out.update(t.leaf_shapes(config, i))
        return out

    def tied(self, config, layout: Layout) -> dict[str, str]:
        """{HF name: our leaf} of tensors HF ties to one of ours: accepted on load when equal to the
        tensor that fills that leaf, never saved."""
        head = self.head(layout.head)
        if head is None:
            return {}
        out = {}
        for name, target in head.tied(config).items():
            out[name.replace("{prefix}", layout.prefix)] = target
        return out

    def read_apart(self, config, layout: Layout, names) -> Layout | None:
        """The layout that reads the stored tied copies `names` (HF names whose values differ from
        the tensor they are tied to, which transformers then keeps apart and computes with) as
        tensors of their own, or None where this family's layouts have no place for them (`load_hf`
        then refuses the checkpoint, naming the copy)."""
        return None

    def detect(self, names: set[str], config, shapes: Callable[[str], tuple | None] | None = None) -> Layout:
        """The layout of a checkpoint holding the HF tensors `names`: its prefix, its head (the one
        config.json's `architectures` names, else the first whose markers are present) and whether
        it has a pooler. `shapes`: a stored tensor's shape by name (None where absent), for a family
        whose layouts differ by shape alone (Qwen3-VL-MoE's expert orientations)."""
        prefixes = [self.prefix, *{p for h in self.heads for p in h.prefixes.values()}]
        prefix = next((p for p in prefixes if p + self.marker in names), "")
        pooler = bool(self.pooler) and prefix + self.pooler[0].hf in names
        stem = self.stems[config.model_type]
        head = None
        classes = {self.class_name(config, h): h for h in self.heads}
        architectures = list(getattr(config, "architectures", None) or ())
        named = [classes[a] for a in architectures if a in classes]
        unknown = [a for a in architectures if a.startswith(stem) and a not in classes and a != stem + "Model"]
        # another stem's class with this model type's config (Gemma3ForSequenceClassification of a Gemma3TextConfig):
        # transformers writes such folders with this family's tensors; its suffix names the head
        suffixed = [h for a in architectures for h in sorted(self.heads, key=lambda h: -len(h.suffix))
                    if isinstance(a, str) and a.endswith(h.suffix) and not a.startswith(stem)]
        if named:
            head = named[0]
        elif suffixed:
            head = suffixed[0]
        elif unknown:
            raise InputError(f"config.json names {unknown[0]}, a task head rotsym_jax does not read; it reads {stem}Model and "
                             f"{sorted(classes)}")
        elif architectures != [stem + "Model"]:
            for h in self.heads:
                if h.markers and all(m in names for m in h.markers) and not (h.needs_no_pooler and pooler):
                    head = h
                    break
            if head is None and prefix and self.default_head is not None:
                head = self.head(self.default_head)
        if head is not None and prefix and prefix != self.base_prefix(config, head.name):
            raise InputError(f"{stem}{head.suffix} names its base model {self.base_prefix(config, head.name)!r}, "
                             f"but the checkpoint's tensors carry {prefix!r}")
        stacked = any(n.endswith(".experts.gate_up_proj") for n in names)  # transformers 5's in-memory layout of a mixture
        layout = Layout(prefix=prefix, head=None if head is None else head.name, pooler=pooler, stacked_experts=stacked)
        self.check_layout(config, layout)
        return layout

    def data_refusal(self) -> str | None:
        """Why data cannot flow through this family's models for the data methods (None: it can)."""
        return None

    def check_layout(self, config, layout: Layout) -> None:
        """ValueError for a layout the family cannot hold: an unknown head, a pooler it has none
        of, a head that reads a pooler the layout lacks."""
        head = self.head(layout.head)
        if layout.pooler and not self.pooler:
            raise InputError(f"{self.name} has no pooler: layout.pooler must be False")
        if head is not None and head.pooler and not layout.pooler:
            raise InputError(f"{self.stems[config.model_type]}{head.suffix} reads the pooler, which the checkpoint does not hold "
                             f"({layout.prefix}{self.pooler[0].hf})")

    def architecture(self, config, layout: Layout) -> str:
        """The transformers class of the layout (saved in config.json's `architectures`)."""
        head = self.head(layout.head)
        return self.stems[config.model_type] + "Model" if head is None else self.class_name(config, head)

    def class_name(self, config, head: Head) -> str:
        """transformers' class of `head` for this config: `<stem><suffix>`, or its `class_names` entry."""
        name = self.stems[config.model_type] + head.suffix
        return self.class_names.get(name, name)

    def base_prefix(self, config, head: str | None) -> str:
        """The prefix a checkpoint of `head` puts before its base model's tensors."""
        h = self.head(head)
        return "" if h is None else h.prefixes.get(config.model_type, self.prefix)

    def has_forward(self, layout: Layout) -> bool:
        """Whether our Flax model runs this layout's head (the base model always runs, but for a
        record inferred onto this family: its forward pass is the family's, not proven for it)."""
        head = self.head(layout.head)
        return self.forward and (head is None or head.forward)

    def inferred(self, record: InferredRecord) -> Family:
        """This family's tables and groups read under `record`'s class names (`record.read_as` one
        of its model types); our forward pass is not that model's, so it does not run."""
        return dataclasses.replace(self, configs=(self.schema(record.read_as),), stems={record.read_as: record.stem},
                                   class_names={}, forward=False)

    # ---- symmetries ---------------------------------------------------------------------------------

    def record_tensors(self) -> tuple[Tensor, ...]:
        """Every tensor of the base model's tables, each once (a layer's for every layer)."""
        return self.embeddings + self.layer + self.final + self.pooler

    def residual_spec(self, config=None, layout: Layout | None = None) -> ResidualSpec | tuple[ResidualSpec, ...]:
        """Where the residual stream appears in every leaf of every layout (MATH §10): the axes the
        tables declare, base model, pooler and every head; the norm's folds, but none of the final
        norm where a tied LM head reads it (its gain cannot be folded into the embedding that the
        head shares). Without a layout, any head of the family that `config` ties counts. A family
        of several `streams`: one spec each (`split_streams`)."""
        rules, seen = [], {}
        for t in self.record_tensors() + tuple(t for h in self.heads for t in h.tensors):
            for path, axis in zip(t.ours, t.stream):
                pattern = re.escape(path).replace(re.escape("{i}"), r"\d+")
                if pattern not in seen:
                    seen[pattern] = axis
                    rules.append((pattern, axis))
                elif seen[pattern] != axis:  # one rule per leaf: a leaf must have one role on the stream in every head
                    raise InputError(f"{self.name}: leaf {path} is on the residual stream along {seen[pattern]} in one table and "
                                     f"{axis} in another; give the two roles two leaf names")
        folds = self.norm.folds(config) if callable(self.norm.folds) else self.norm.folds
        if config is not None and self._tied_head_reads_final_norm(config, layout):
            final = self.final_read_by_head()
            folds = tuple((gain, NO_READER if any(re.fullmatch(gain, p) for p in final) else readers) for gain, readers in folds)
        whole = ResidualSpec(tuple(rules), self.norm.kind, folds, self.norm.placement, self.norm.gain)
        return split_streams(whole, self.streams) if self.streams else whole

    def final_read_by_head(self) -> list[str]:
        """The final norm's leaves, which a head reads (an encoder–decoder's: the decoder's)."""
        return [p for t in self.final for p in t.ours]

    def _tied_head_reads_final_norm(self, config, layout: Layout | None) -> bool:
        heads = self.heads if layout is None else [h for h in self.heads if h.name == layout.head]
        return any(h.tied(config) for h in heads)

    def check(self, config) -> None:
        """ValueError for a config whose checkpoints the record cannot describe (`unsupported`),
        or whose symmetry groups it cannot state (`head_geometry`)."""
        for attribute, what in self.unsupported:
            if getattr(config, attribute, False):
                raise InputError(f"{attribute}={getattr(config, attribute)!r} ({what}) is not supported")
        self.head_geometry(config)

    def spec(self, config, layout: Layout | None = None) -> Spec:
        """Per-head QK/VO groups of every layer's attention (GQA groups, RoPE pairs where the
        family uses RoPE), the FFN hidden-unit permutation (gate and up together), the residual
        stream (`residual_spec`: the layout tells whether a tied LM head reads the final norm),
        and the task head and pooler a model may lack (`Spec.optional`)."""
        geometry = self.head_geometry(config)  # None: no attention (a state-space model)
        rules = self.rules + (FULL_QK_NORM_RULES + SPEC_RULES if geometry is not None and geometry.qk_norm == "full" else SPEC_RULES)
        return Spec(rules, heads={} if geometry is None else {"attn": geometry}, residual=self.residual_spec(config, layout), optional=OPTIONAL)

    def left_out(self, config) -> tuple[str, ...]:
        """Why `spec(config)` leaves a group of this family out (what `rotsym inspect` says in
        words where a group is missing): none here."""
        return ()


def split_rows(sizes) -> Convert:
    """A fused torch nn.Linear whose output rows are [A; B; ...] of `sizes` (each a `Dim`: Phi-3's
    qkv_proj, ModernBERT's Wqkv and Wi) <-> our leaves: kernels (d, size) transposed, biases
    (size,) as they are."""
    def to_ours(a, c):
        parts = np.split(a, np.cumsum([size(c, s) for s in sizes])[:-1], axis=0)
        return tuple(x.T if x.ndim == 2 else x for x in parts)

    return Convert(f"rows{len(sizes)}", to_ours, lambda t, c: np.concatenate([x.T if x.ndim == 2 else x for x in t], axis=0))


def _stacked_gate_up(a, c):
    gate, up = np.split(a, 2, axis=1)  # (E, 2f, d): every expert's gate rows, then its up rows
    return np.swapaxes(gate, 1, 2), np.swapaxes(up, 1, 2)


# transformers 5's stacked experts: gate_up_proj (E, 2f, d) <-> our gate and up kernels (E, d, f) each;
# down_proj (E, d, f) <-> our down kernels (E, f, d)
STACKED_GATE_UP = Convert("stacked_gate_up", _stacked_gate_up, lambda t, c: np.concatenate([np.swapaxes(x, 1, 2) for x in t], axis=1))
STACKED_TRANSPOSE = Convert("stacked_transpose", lambda a, c: (np.swapaxes(a, 1, 2),), lambda t, c: np.swapaxes(t[0], 1, 2))


def split(parts: int, axis: int = -1) -> Convert:
    """A fused tensor stored as `parts` equal blocks along `axis` (GPT-2's c_attn: [q | k | v])."""
    return Convert(f"split{parts}", lambda a, c: tuple(np.split(a, parts, axis=axis)), lambda t, c: np.concatenate(t, axis=axis))
