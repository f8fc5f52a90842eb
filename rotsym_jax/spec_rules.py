"""Specs: which axis of which parameter belongs to which symmetry group.

A `Spec` is plain data: an ordered list of rules `(path regex, tags)` matched (re.fullmatch,
first match wins) against `/`-joined parameter paths, plus the head geometry of each attention
block. `tags` has one entry per axis of the leaf, or is None to leave the leaf explicitly alone:

    None          the axis is not transformed
    "ffn"         any plain name: the axis is permuted by the permutation group of that name
    "ffn.in"      NAME.in, NAME.out: permuted as "ffn", and where the group is gated (it also has
    "ffn.out"     a plain NAME member, the gate: a unit computes act(gate) * up, linear in up) the
                  unit's scale s > 0 acts too, times s on the .in axis (up), divided by s on the
                  .out axis (down); without a gate the tags are plain permutations (GELU is not
                  homogeneous)
    "attn.q"      BLOCK.ROLE, ROLE in q, k, v, o: the axis is the (heads, head_dim) axis of attention
                  block BLOCK (its geometry in `Spec.heads`): q and o axes have H*dh entries laid
                  out (G kv groups, H/G query heads, dh), k and v axes G*dh entries (G, dh); v and
                  o take dv for dh where the values are of another width (`HeadGeometry.value_dim`)
    "attn.qn"     BLOCK.qn, BLOCK.kn: the gains of a full-width QK-norm (`HeadGeometry.qk_norm="full"`,
                  OLMo-2), laid out as q's and k's axes: permuted with the heads, scaled by the QK scale
    "attn.s"      BLOCK.s: each query head's attention sink (GPT-OSS), one entry a head laid out as q's
                  heads (G kv groups, H/G query heads): permuted with the heads, nothing else
    "moe.expert"  BLOCK.expert: the experts axis of mixture-of-experts block BLOCK (the stacked
                  experts' leaves and the router's output units): experts are permuted together
    "moe.unit"    BLOCK.unit: an expert's hidden units, permuted per expert; a leaf with both axes
                  (an expert's (E, d, f) kernel) carries the two tags
    "layer"       a leading layer axis of a scanned layer stack

A leaf may be held by two groups on two axes: a plain permutation tag beside an attention role
(MLA's kv_b_proj: a latent's units on its rows, the heads on its columns) or two plain permutation
tags (Mamba's A_log: its channels and its state entries). Each group moves its own axis (the
actions commute), and each member names the other group (`Member.also`). Of the two, one is solved
first, from the leaves it holds alone: the permutation group before an attention block, and of two
permutation groups the one with a leaf of its own; the other (its `after` names the first) is
solved on B's leaves with the first one's assignment applied, which the engine hands it.

The layer index of a leaf comes from the regex's named group `layer` (or its first group);
each layer gets its own group instance. Example for a custom Flax model:

    spec = Spec(
        rules=(
            (r"blocks/(\\d+)/attn/q/kernel", (None, "attn.q")),
            (r"blocks/(\\d+)/attn/k/kernel", (None, "attn.k")),
            (r"blocks/(\\d+)/attn/v/kernel", (None, "attn.v")),
            (r"blocks/(\\d+)/attn/o/kernel", ("attn.o", None)),
            (r"blocks/(\\d+)/mlp/fc1/kernel", (None, "ffn")),
            (r"blocks/(\\d+)/mlp/fc1/bias", ("ffn",)),
            (r"blocks/(\\d+)/mlp/fc2/kernel", ("ffn", None)),
            (r".*", None),  # everything else is left alone
        ),
        heads={"attn": HeadGeometry(num_heads=8, num_kv_heads=8, head_dim=64)},
    )

`spec.bind(spec, params)` validates the spec against a params pytree before any work and returns a
hashable `BoundSpec` that the solvers and `apply_transform` use. Every public name here is
importable from `rotsym_jax.spec` too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

import numpy as np

from .errors import RotsymError

ROLES = ("q", "k", "v", "o")
# Gains of a full-width QK-norm (OLMo-2: one gain per entry of all heads' q, and of k): they
# follow q's and k's head permutations and nothing else (no rotation, no scale).
GAIN_ROLES = ("qn", "kn")
# The rows of a gate on each head's output (AFMoE's gate_proj: one per entry of every query head):
# they follow the head permutations and nothing else (VO's sign flips and scales pass through it).
GATE_ROLE = "g"
# The rows of each query head's RoPE part where every head shares one RoPE key (MLA: q_proj's or
# q_b_proj's rope rows, `HeadGeometry.shared_rope_dim` entries a head): they follow the head
# permutations and nothing else (the key they meet is not the block's, so Q/K's maps stay off them).
ROPE_QUERY_ROLE = "qr"
# The RoPE key those queries meet (MLA's kv_a_proj_with_mqa rows past the latent): no head axis; it
# and every head's RoPE query turn by one rotation per rotary pair (`HeadTransform.rope`).
ROPE_KEY_ROLE = "kr"
# Each query head's attention sink (GPT-OSS's `sinks`: one logit per head that joins its softmax
# beside the scores): it follows the head permutations alone; no map within a head (Q/K's, V/O's)
# reaches it, since q.k and the value a head mixes are unchanged by them.
SINK_ROLE = "s"
# Roles that follow the head permutations alone (and the shared RoPE key's rotation, for qr)
PERMUTED_ONLY_ROLES = (GATE_ROLE, ROPE_QUERY_ROLE, SINK_ROLE)
# Roles whose head axis holds V/O's width (`HeadGeometry.value_dim`): values, outputs and a gate on them
VALUE_ROLES = ("v", "o", GATE_ROLE)
ATTENTION_ROLES = ROLES + GAIN_ROLES + PERMUTED_ONLY_ROLES + (ROPE_KEY_ROLE,)
QK_NORMS = (False, "head", "full", "unit")
# QK-norms with a gain per entry: of Q/K's rotations only sign flips (of whole rotary pairs) commute with them
SIGN_QK_NORMS = ("head", "full")
# QK-norms that leave no QK scale on the kernels and no gain to carry it ("full" puts it on its gains)
UNSCALED_QK_NORMS = ("head", "unit")
EXPERT_ROLES = ("expert", "unit")
# A permutation group's member roles: "perm" (permuted only), and the two sides of a unit's scale
UNIT_ROLES = ("perm", "in", "out")
# A permutation group's member that is the gain of the RMSNorm its units pass (`Spec.unit_norms`: MLA's latents)
UNIT_NORM_ROLE = "norm"
LAYER = "layer"


class SpecError(RotsymError, ValueError):
    """A spec that does not fit the params it is applied to."""


@dataclasses.dataclass(frozen=True)
class HeadGeometry:
    """Heads of one attention block. `rotary_dim`: RoPE in the HF rotate_half layout acts on the
    first `rotary_dim` entries of each head (pairs (i, i + rotary_dim/2)); None: no RoPE.
    `qk_norm`: q and k pass an RMSNorm before RoPE, "head" over each head's `head_dim` entries
    with one gain for all heads (Qwen3, Gemma 3; True means "head"), "full" over all heads at once
    with a gain per entry (OLMo-2: the gains, tagged BLOCK.qn and BLOCK.kn, follow the head
    permutations and carry the QK scale, which on the kernels the norm's eps would spoil). Either
    way the QK group shrinks to sign flips, of both entries of a rotary pair together and of each
    entry past the rotary part (MATH §1), with no scale under a per-head norm (its eps sees a
    kernel's scale, and one gain serves every head); VO keeps its rotations and scales. "unit":
    q and k divided by each head's RMS after RoPE, a norm without weights (Llama 4): every rotation
    of Q/K the RoPE group holds keeps each head's RMS, so the QK group keeps them (rotations of each
    rotary pair and of the entries past them, head permutations), but no scale (the norm erases it
    only up to its eps) and no other invertible map.
    `gated_output`: each entry of a head's output is multiplied by its own gate before O (AFMoE:
    sigmoid of a projection of the block's input, its rows tagged BLOCK.g), which only diagonal
    maps of V/O commute with: VO shrinks to sign flips of each entry and its scale, no invertible
    map; the gate's rows follow the head permutations.
    `shared_rope_dim`: each query head also has a RoPE part of this many entries, outside the
    block, that meets one RoPE key every head shares (MLA, DeepSeek-V2/V3: the block holds the
    no-RoPE parts): its rows, tagged BLOCK.qr, follow the head permutations (the shared key moves
    with none) and no map of Q/K (the key they meet is not in the block); the key's rows, tagged
    BLOCK.kr, and every head's RoPE query turn by one 2-D rotation per rotary pair
    (`HeadTransform.rope`), the pairs (2i, 2i + 1) with `shared_rope_interleaved`, else
    (i, i + shared_rope_dim/2). One query head per kv group: a shared key leaves no kv groups.
    `value_dim`: the width of each head's value and output (V/O's maps act on it), None: head_dim
    (MLA's v_head_dim beside qk_nope_head_dim, GLM-4.7-Flash: QK and VO are then two groups of
    their own widths that share only the head permutations)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int | None = None
    qk_norm: bool | str = False
    fixed_order: bool = False  # the heads' order is fixed outside the block (T5's position bias, ALiBi's slopes): no head permutations
    gated_output: bool = False
    shared_rope_dim: int = 0
    shared_rope_interleaved: bool = False
    value_dim: int | None = None

    def __post_init__(self):
        # Sizes first: a zero would divide below, a float or bool would pass it and break shapes later.
        for field in ("num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not self._is_int(value) or value < 1:
                raise SpecError(f"HeadGeometry.{field}={value!r}; expected a positive integer")
        if self.value_dim is not None and (not self._is_int(self.value_dim) or self.value_dim < 1):
            raise SpecError(f"HeadGeometry.value_dim={self.value_dim!r}; expected None (head_dim) or a positive integer")
        if self.value_dim == self.head_dim:  # one width: one spelling, so equal geometries compare (and hash) equal
            object.__setattr__(self, "value_dim", None)
        if self.num_heads % self.num_kv_heads:
            raise SpecError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.qk_norm is True:
            object.__setattr__(self, "qk_norm", "head")
        if not any(self.qk_norm is q or (isinstance(q, str) and self.qk_norm == q) for q in QK_NORMS):
            raise SpecError(f"HeadGeometry.qk_norm={self.qk_norm!r}; expected one of {QK_NORMS} (True: 'head')")
        if self.shared_rope_dim and (not self._is_int(self.shared_rope_dim) or self.shared_rope_dim < 0 or self.shared_rope_dim % 2
                                     or self.num_kv_heads != self.num_heads):
            raise SpecError(f"HeadGeometry.shared_rope_dim={self.shared_rope_dim!r} with {self.num_heads} heads in {self.num_kv_heads} kv "
                            "groups; expected 0, or a positive even integer (rotary pairs) with one query head per kv group (a RoPE key every head shares)")
        rotary = self.rotary_dim
        if rotary is not None and (not self._is_int(rotary) or rotary % 2 or not 0 < rotary <= self.head_dim):
            raise SpecError(f"HeadGeometry.rotary_dim={rotary!r}; expected None or an even integer in (0, head_dim={self.head_dim}]")

    @property
    def qk_signs_only(self) -> bool:
        """Whether of Q/K's rotations only sign flips keep the QK-norm (one gain per entry)."""
        return signs_only(self.qk_norm)

    @staticmethod
    def _is_int(value) -> bool:
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

    @property
    def v_dim(self) -> int:
        """The width of each head's value and output (`value_dim`, else head_dim)."""
        return self.head_dim if self.value_dim is None else self.value_dim

    @property
    def split_widths(self) -> bool:
        """Whether V/O's heads are of another width than Q/K's (their maps are solved as two stacks)."""
        return self.value_dim is not None

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def role_shape(self, role: str) -> tuple[int, int, int]:
        """(groups, heads per group, width) of a role's axis: head_dim for q/k (and a QK-norm's gains), `v_dim` for v/o
        (and a gate on the heads' outputs); the shared RoPE key: one of each; a sink: one entry a head."""
        if role == ROPE_KEY_ROLE:
            return (1, 1, self.shared_rope_dim)
        per_group = self.heads_per_group if role in ("q", "o", "qn") + PERMUTED_ONLY_ROLES else 1
        width = (self.shared_rope_dim if role == ROPE_QUERY_ROLE else 1 if role == SINK_ROLE
                 else self.v_dim if role in VALUE_ROLES else self.head_dim)
        return (self.num_kv_heads, per_group, width)


def signs_only(qk_norm) -> bool:
    """Whether a QK-norm (`HeadGeometry.qk_norm`) leaves Q/K sign flips only (its gains, one per entry)."""
    return isinstance(qk_norm, str) and qk_norm in SIGN_QK_NORMS


NORMS = ("layernorm", "rmsnorm")
GAINS = ("weight", "one_plus")
PLACEMENTS = ("pre", "post", "sandwich")
RESIDUAL = "residual"  # the name of a model's one residual stream: its element's key in a transforms dict


@dataclasses.dataclass(frozen=True)
class ResidualSpec:
    """Where the residual stream (the model width d) appears: `rules` are `(path regex, axis)`
    pairs (first match wins; axis None: the leaf does not touch the stream; a tuple of axes: the
    leaf reads from and writes to it, as a head's transform whose output a tied decoder reads),
    every leaf must be claimed. A basis change T of the stream acts on every claimed axis as x -> x T (MATH §10).
    `norm`: "layernorm" or "rmsnorm"; `placement`: "pre" (each sublayer reads the stream through
    a norm: once the gains are folded, any orthogonal T for RMSNorm, any orthogonal T fixing the
    ones vector for LayerNorm, MATH §10), "post" (the stream itself passes the norms' gains: only
    permutations, and sign flips under RMSNorm) or "sandwich" (each sublayer's output passes a
    norm too before it joins the stream, Gemma 2 and 3: permutations, and sign flips under RMSNorm). `folds`: `(norm gain regex, reader regex)` pairs, the reader regex may use the
    norm's captured groups (\\1): the linear layers whose input rows absorb that gain (and, for
    LayerNorm, whose biases absorb the norm's bias). `name`: the stream's group name, its
    element's key in a transforms dict; a model of several streams (Whisper's encoder and
    decoder, which share no tensor) names each (`Spec.residual` a tuple), each spec's rules
    claiming every leaf (axis None off that stream). `permutations_only`: why only permutations of
    this stream keep the function, where its norms would allow more (Whisper's encoder stream is
    written through a GELU, which commutes with permutations alone), else None."""

    rules: tuple[tuple[str, int | None], ...]
    norm: str
    folds: tuple[tuple[str, str], ...] = ()
    placement: str = "pre"
    gain: str = "weight"  # "one_plus": a gain leaf holds w and the norm multiplies by 1 + w (Gemma)
    name: str = RESIDUAL
    permutations_only: str | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"ResidualSpec.name={self.name!r}; expected a non-empty str")
        if self.gain not in GAINS:
            raise SpecError(f"ResidualSpec.gain={self.gain!r}; expected one of {GAINS}")
        if self.norm not in NORMS:
            raise SpecError(f"ResidualSpec.norm={self.norm!r}; expected one of {NORMS}")
        if self.placement not in PLACEMENTS:
            raise SpecError(f"ResidualSpec.placement={self.placement!r}; expected one of {PLACEMENTS}")
        object.__setattr__(self, "rules", tuple((p, tuple(a) if isinstance(a, list) else a) for p, a in self.rules))
        object.__setattr__(self, "folds", tuple((n, r) for n, r in self.folds))
        for pattern, _ in self.rules + self.folds:
            try:
                re.compile(pattern)
            except re.error as e:
                raise SpecError(f"residual rule {pattern!r} is not a valid regex: {e}") from e


class FrozenMap(Mapping):
    """An immutable, hashable mapping (a Spec's heads: a Spec is a static jit argument)."""

    __slots__ = ("_items",)

    def __init__(self, items=()):
        object.__setattr__(self, "_items", dict(items))

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._items!r})"

    def __reduce__(self):
        return type(self), (self._items,)


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """What an experts block's parts are, as the reports say them: a block solved as experts that is
    none (Mamba-2's mixers: its heads as experts, a head's channels as their units, B/C's groups as
    routing groups) is named as what it is. `block` says the whole, `router` what moves with an
    expert and has no units."""

    expert: str = "expert"
    unit: str = "unit"
    router: str = "the router's outputs"
    groups: str = "routing groups"
    block: str = "a mixture's experts"


MIXTURE = ExpertNames()


@dataclasses.dataclass(frozen=True)
class Spec:
    """rules: `(path regex, tags)` pairs (the module docstring). heads: the geometry of each
    attention block. residual: where the residual stream appears (`ResidualSpec`, or a tuple of
    them, each named, for a model of several streams), for `align(residual=...)`. optional: a regex of leaves a model may lack or hold with other
    shapes (the built-in families' task heads, `head/...`, of other label sets or on one side
    only, their poolers, which some task classes drop, and a decoder's untied LM head, which its
    classifier fine-tunes drop): each part (the leaves under one
    top-level key) that not every model holds with the same leaves and shapes is set aside:
    `align` neither solves nor measures it, and B's comes back as it was, moved only by a
    residual-stream transform where it reads the stream; held alike, it takes part as any leaf.
    task_head: a regex of leaves always set aside (the command line's choice for `head/...`:
    label spaces may differ even where shapes agree). None for either: every leaf takes part.
    routing_groups: {experts block: n} where a router picks among n groups of consecutive experts
    first (DeepSeek-V3's group-limited routing): experts then permute only within their group.
    expert_names: {experts block: ExpertNames} for a block whose experts are something else (a
    mixture's by default), which the reports then name.
    unit_names: {permutation group: what its units are, singular} where they are not an FFN's
    (Mamba's channels, state entries), which `rotsym inspect` and `verify` then name.
    unit_norms: {permutation group: regex of the leaf (one per layer, a member of the group) that
    is the gain of the RMSNorm its units pass, after which linear layers alone read them (MLA's
    latents)}: with that gain folded into the readers' rows, an orthogonal map of the units keeps
    the function too (`align(latents="rotation")`, MATH §17)."""

    rules: tuple[tuple[str, tuple | None], ...]
    heads: Mapping[str, HeadGeometry] = dataclasses.field(default_factory=dict)
    residual: ResidualSpec | tuple[ResidualSpec, ...] | None = None
    task_head: str | None = None
    optional: str | None = None
    routing_groups: Mapping[str, int] = dataclasses.field(default_factory=dict)
    expert_names: Mapping[str, ExpertNames] = dataclasses.field(default_factory=dict)
    unit_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unit_norms: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        rules = tuple((pattern, None if tags is None else tuple(tags)) for pattern, tags in self.rules)
        for pattern in [p for p, _ in rules] + [p for p in (self.task_head, self.optional) if p is not None] + list(dict(self.unit_norms).values()):
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise SpecError(f"rule {pattern!r} is not a valid regex: {e}") from e
        object.__setattr__(self, "rules", rules)
        if isinstance(self.residual, (tuple, list)):
            streams = tuple(self.residual)
            names = [r.name for r in streams]
            if not streams or len(set(names)) != len(names):
                raise SpecError(f"Spec.residual: several streams need one name each, got {names}")
            object.__setattr__(self, "residual", streams if len(streams) > 1 else streams[0])
        object.__setattr__(self, "heads", FrozenMap(self.heads))  # immutable and hashable: a Spec is a static jit argument
        object.__setattr__(self, "routing_groups", FrozenMap(self.routing_groups))
        object.__setattr__(self, "expert_names", FrozenMap(self.expert_names))
        object.__setattr__(self, "unit_names", FrozenMap(self.unit_names))
        object.__setattr__(self, "unit_norms", FrozenMap(self.unit_norms))

    @property
    def streams(self) -> tuple[ResidualSpec, ...]:
        """Every residual stream's spec (none, one, or a model's several)."""
        return () if self.residual is None else self.residual if isinstance(self.residual, tuple) else (self.residual,)

    def set_aside(self, shapes: Sequence[Mapping[str, tuple]]) -> frozenset[str]:
        """The leaf paths set aside from alignment, given every model's {leaf path: shape}: the
        task head's always, and each part of the optional leaves (the leaves under one top-level
        key) that not every model holds with the same leaves and shapes. The one definition that
        `align`, `align_many` and the streamed runs (which know shapes before any weight) share."""
        aside = set()
        if self.task_head is not None:
            head = re.compile(self.task_head)
            aside |= {p for model in shapes for p in model if head.fullmatch(p)}
        if self.optional is not None:
            optional = re.compile(self.optional)
            parts: dict[str, set] = {}
            for model in shapes:
                for p in model:
                    if optional.fullmatch(p):
                        parts.setdefault(p.split("/")[0], set()).add(p)
            for paths in parts.values():
                held = {tuple((p, tuple(model[p]) if p in model else None) for p in sorted(paths)) for model in shapes}
                if len(held) > 1:
                    aside |= paths
        return frozenset(aside)
