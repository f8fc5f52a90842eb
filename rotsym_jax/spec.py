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
                  out (G kv groups, H/G query heads, dh), k and v axes G*dh entries (G, dh)
    "attn.qn"     BLOCK.qn, BLOCK.kn: the gains of a full-width QK-norm (`HeadGeometry.qk_norm="full"`,
                  OLMo-2), laid out as q's and k's axes: permuted with the heads, scaled by the QK scale
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

`bind(spec, params)` validates the spec against a params pytree before any work and returns a
hashable `BoundSpec` that the solvers and `apply_transform` use.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import numpy as np

from .errors import RotsymError
from .pytree import check_same_leaves, flatten, structure_problem

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
# Roles that follow the head permutations alone (and the shared RoPE key's rotation, for qr)
PERMUTED_ONLY_ROLES = (GATE_ROLE, ROPE_QUERY_ROLE)
ATTENTION_ROLES = ROLES + GAIN_ROLES + PERMUTED_ONLY_ROLES + (ROPE_KEY_ROLE,)
QK_NORMS = (False, "head", "full", "unit")
# QK-norms with a gain per entry: of Q/K's rotations only sign flips (of whole rotary pairs) commute with them
SIGN_QK_NORMS = ("head", "full")
# QK-norms that leave no QK scale on the kernels and no gain to carry it ("full" puts it on its gains)
UNSCALED_QK_NORMS = ("head", "unit")
EXPERT_ROLES = ("expert", "unit")
# A permutation group's member roles: "perm" (permuted only), and the two sides of a unit's scale
UNIT_ROLES = ("perm", "in", "out")
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
    (i, i + shared_rope_dim/2). One query head per kv group: a shared key leaves no kv groups."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int | None = None
    qk_norm: bool | str = False
    fixed_order: bool = False  # the heads' order is shared with a leaf outside the block (T5's position bias): no head permutations
    gated_output: bool = False
    shared_rope_dim: int = 0
    shared_rope_interleaved: bool = False

    def __post_init__(self):
        # Sizes first: a zero would divide below, a float or bool would pass it and break shapes later.
        for field in ("num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not self._is_int(value) or value < 1:
                raise SpecError(f"HeadGeometry.{field}={value!r}; expected a positive integer")
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
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def role_shape(self, role: str) -> tuple[int, int, int]:
        """(groups, heads per group, head_dim) of a role's axis (the shared RoPE key: one of each)."""
        if role == ROPE_KEY_ROLE:
            return (1, 1, self.shared_rope_dim)
        per_group = self.heads_per_group if role in ("q", "o", "qn", GATE_ROLE, ROPE_QUERY_ROLE) else 1
        return (self.num_kv_heads, per_group, self.shared_rope_dim if role == ROPE_QUERY_ROLE else self.head_dim)


def signs_only(qk_norm) -> bool:
    """Whether a QK-norm (`HeadGeometry.qk_norm`) leaves Q/K sign flips only (its gains, one per entry)."""
    return isinstance(qk_norm, str) and qk_norm in SIGN_QK_NORMS


NORMS = ("layernorm", "rmsnorm")
GAINS = ("weight", "one_plus")
PLACEMENTS = ("pre", "post", "sandwich")


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
    LayerNorm, whose biases absorb the norm's bias)."""

    rules: tuple[tuple[str, int | None], ...]
    norm: str
    folds: tuple[tuple[str, str], ...] = ()
    placement: str = "pre"
    gain: str = "weight"  # "one_plus": a gain leaf holds w and the norm multiplies by 1 + w (Gemma)

    def __post_init__(self):
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
    attention block. residual: where the residual stream appears (`ResidualSpec`), for
    `align(residual=...)`. optional: a regex of leaves a model may lack or hold with other
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
    mixture's by default), which the reports then name."""

    rules: tuple[tuple[str, tuple | None], ...]
    heads: Mapping[str, HeadGeometry] = dataclasses.field(default_factory=dict)
    residual: ResidualSpec | None = None
    task_head: str | None = None
    optional: str | None = None
    routing_groups: Mapping[str, int] = dataclasses.field(default_factory=dict)
    expert_names: Mapping[str, ExpertNames] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        rules = tuple((pattern, None if tags is None else tuple(tags)) for pattern, tags in self.rules)
        for pattern in [p for p, _ in rules] + [p for p in (self.task_head, self.optional) if p is not None]:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise SpecError(f"rule {pattern!r} is not a valid regex: {e}") from e
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "heads", FrozenMap(self.heads))  # immutable and hashable: a Spec is a static jit argument
        object.__setattr__(self, "routing_groups", FrozenMap(self.routing_groups))
        object.__setattr__(self, "expert_names", FrozenMap(self.expert_names))


@dataclasses.dataclass(frozen=True)
class Member:
    """All leaves that one rule binds to a group, one path per layer of the group (in the group's
    layer order), or a single scanned leaf whose `layer_axis` holds the layers."""

    template: str  # the leaves' path with the layer index as "{layer}"
    paths: tuple[str, ...]
    axis: int  # the tagged axis, counted in the leaf's own axes
    role: str  # "q", "k", "v", "o" for attention, "perm" for permutation groups, "expert" for experts
    layer_axis: int | None = None
    unit_axis: int | None = None  # experts: the axis of each expert's hidden units (None: the router)
    # (the other group, its axis) on leaves two groups hold on two axes, each moving its own (MLA's
    # kv_b_proj: a latent's units on its rows, the heads on its columns; Mamba's A_log: channels, state)
    also: tuple[str, int] | None = None


class _Shared:
    """What a group sharing leaves with another on two axes (`Member.also`) says of the order: `after`
    names the groups solved before it, whose assignments its statistics read (B's leaves they share
    moved by them first); its costs read `reads`."""

    @property
    def reads(self) -> tuple[Member, ...]:
        """The members its statistics read: those of no other group, or of a group solved before it
        (a member shared with a group solved after it is in B's frame of that group's axis, not yet matched)."""
        return tuple(m for m in self.members if m.also is None or m.also[0] in self.after)


@dataclasses.dataclass(frozen=True)
class AttentionBlock(_Shared):
    """The leaves of one attention block's heads (tags BLOCK.ROLE): the group kind "attention"."""

    kind = "attention"  # the engine's solver and the transforms' element of this kind of group
    name: str
    geometry: HeadGeometry
    layers: tuple
    members: tuple[Member, ...]
    # the permutation groups whose units some of the block's leaves hold on another axis (MLA's
    # latents), solved first: the block's statistics read B's leaves with those units assigned
    after: tuple[str, ...] = ()

    def describe(self) -> str:
        g = self.geometry
        rope = f", RoPE on {g.rotary_dim} dims" if g.rotary_dim else ""
        # under a QK-norm V/O keeps its rotations and scales (the solver scales it: engine/attention.solve_cross)
        signs = "rotary-pair signs" if g.rotary_dim else "the signs of each dim"
        qk = (f"; QK: head permutations and {signs} only, the norm's gains permuted with the heads and scaled by the QK "
              "scales (full-width QK-norm; solved on the gains), VO: rotations, scales" if g.qk_norm == "full"
              else f"; QK: head permutations and {signs} only, no scale (QK-norm), VO: rotations, scales" if g.qk_signs_only
              else "; head permutations, QK: rotations of each rotary pair" + (" and of the dims past them" if g.rotary_dim < g.head_dim else "")
              + ", no scale (QK-norm without weights), VO: rotations, scales" if g.qk_norm == "unit" and g.rotary_dim
              else "; head permutations, QK: rotations, no scale (QK-norm without weights), VO: rotations, scales" if g.qk_norm == "unit"
              else "; head permutations, QK: rotations of each rotary pair" + (" and of the dims past them" if g.rotary_dim < g.head_dim else "")
              + " and scales, VO: rotations, scales" if g.rotary_dim else "; head permutations, QK and VO: rotations, scales")
        if g.gated_output:
            qk = qk.replace("VO: rotations, scales", "VO: sign flips of each entry, scales (the heads' outputs gated entry by entry; the gate's rows follow the heads)")
        if g.shared_rope_dim:
            qk += (f"; each head's RoPE query ({g.shared_rope_dim} dims) follows its head, and turns with the RoPE key all heads share "
                   f"by one rotation per rotary pair ({'interleaved' if g.shared_rope_interleaved else 'rotate_half'} pairs)")
        if g.fixed_order:
            qk = qk.replace("head permutations, ", "").replace("head permutations and ", "") + " (the heads' order fixed)"
        return f"attention {self.name!r}: {len(self.layers)} layers, {g.num_heads} heads in {g.num_kv_heads} kv groups, head_dim {g.head_dim}{rope}{qk}"


@dataclasses.dataclass(frozen=True)
class PermGroup(_Shared):
    """The leaves of one permutation group (a plain tag: FFN hidden units): the group kind
    "permutation". `scaled`: each unit's positive scale is a symmetry too (a gated FFN whose
    up and down leaves are tagged NAME.in and NAME.out, MATH §1)."""

    kind = "permutation"
    name: str
    size: int
    layers: tuple
    members: tuple[Member, ...]

    # The group whose axis every leaf of this one carries too: solved first, from its own leaves, and
    # this one on B's leaves moved by its assignment (empty: solved from its own leaves)
    after: tuple[str, ...] = ()

    @property
    def scaled(self) -> bool:
        return {m.role for m in self.members} == set(UNIT_ROLES)

    def describe(self) -> str:
        scales = ", and each unit's scale (up times s, down divided by s)" if self.scaled else ""
        shared = len(self.members) - len(self.reads)
        held = sorted({m.also[0] for m in self.members if m not in self.reads})
        read = f"; {shared} of them held by {', '.join(map(repr, held))} on another axis, solved from the others" if shared else ""
        after = f", solved after {', '.join(map(repr, self.after))} (its leaves carry that group's axis too)" if self.after else ""
        return f"permutation {self.name!r}: {len(self.layers)} layers, {self.size} units ({len(self.members)} leaf kinds{read}){scales}{after}"


@dataclasses.dataclass(frozen=True)
class ExpertGroup(_Shared):
    """The leaves of one mixture-of-experts block (tags BLOCK.expert and BLOCK.unit): the group kind
    "experts". Its element permutes the experts, the router's output units with them, and each
    expert's hidden units on their own (MATH §5)."""

    kind = "experts"
    name: str
    num_experts: int
    units: int
    layers: tuple
    members: tuple[Member, ...]
    routing_groups: int = 1  # experts permute within each of this many blocks of consecutive experts
    names: ExpertNames = MIXTURE  # what its experts, units and router are, as reports say them
    after = ()  # an experts block shares no leaf with another group: solved from its own

    def describe(self) -> str:
        n = self.names
        within = f" within each of {self.routing_groups} {n.groups}" if self.routing_groups > 1 else ""
        named = f"experts {self.name!r}" if n == MIXTURE else f"{n.expert}s {self.name!r} (solved as an experts block)"
        return (f"{named}: {len(self.layers)} layers, {self.num_experts} {n.expert}s of {self.units} {n.unit}s: "
                f"{n.expert} permutations{within} ({n.router} with them), nested with each {n.expert}'s {n.unit} permutation")


@dataclasses.dataclass(frozen=True)
class BoundSpec:
    """A spec checked against concrete params: every leaf's role, in hashable form."""

    spec: Spec
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    attention: tuple[AttentionBlock, ...]
    perms: tuple[PermGroup, ...]
    ignored: tuple[str, ...]
    kinds: tuple[tuple[str, str], ...]  # (path, "qk" | "vo" | perm group name | "other")
    leaf_layers: tuple[tuple[str, object], ...]  # (path, layer index or None)
    residual: ResidualStream | None = None
    experts: tuple[ExpertGroup, ...] = ()

    @property
    def groups(self) -> tuple:
        """Every per-layer group, of every kind (each has `kind`, `name`, `layers`, `members`)."""
        return self.attention + self.perms + self.experts

    def transformed_paths(self, residual: bool = False) -> list[str]:
        """The leaves some group moves (with `residual`, the residual stream's leaves too)."""
        paths = list(dict.fromkeys(p for g in self.groups for m in g.members for p in m.paths))  # a latent's reader once
        if residual:
            paths += [p for p, _ in self.residual.axes if p not in set(paths)]
        return paths


@dataclasses.dataclass(frozen=True)
class ResidualStream:
    """A `ResidualSpec` bound to params: the width, every (path, axis) on the stream, the norm
    kind, the norm gains and, per gain, the leaves that read it (for folding), the placement."""

    size: int
    axes: tuple[tuple[str, int], ...]
    norm: str
    gains: tuple[str, ...]
    folds: tuple[tuple[str, tuple[str, ...]], ...]
    placement: str = "pre"
    gain: str = "weight"


def shape_stand_ins(bound: BoundSpec) -> dict:
    """{path: a zero-size stand-in with the leaf's shape}: a bound spec in the form of the flat
    params it was bound to, for structure checks (no memory is allocated)."""
    return {path: np.broadcast_to(np.zeros((), np.int8), shape) for path, shape in bound.shapes}


def _tag_kind(tag, heads):
    if tag is None:
        return None
    if not isinstance(tag, str):
        raise SpecError(f"a tag must be None or a string, got {tag!r}")
    if tag == LAYER:
        return "layer"
    if "." in tag:
        block, role = tag.rsplit(".", 1)
        if role in EXPERT_ROLES:
            return "experts"
        if role in UNIT_ROLES[1:] and block not in heads:
            return "perm"
        if role not in ATTENTION_ROLES:
            raise SpecError(f"tag {tag!r}: the role after '.' must be one of {ATTENTION_ROLES} (attention), {EXPERT_ROLES} "
                            f"(experts) or {UNIT_ROLES[1:]} (a unit's scale)")
        if block not in heads:
            raise SpecError(f"tag {tag!r} names attention block {block!r}, but Spec.heads has only {sorted(heads)}")
        return "attn"
    return "perm"


def bind(spec: Spec | BoundSpec, params) -> BoundSpec:
    """Validate `spec` against `params` and resolve every leaf's group membership.

    Every leaf must be claimed by a rule (a rule with tags None claims it to leave it alone);
    tag counts must equal leaf ranks; attention axes must have the geometry's sizes; each
    permutation group must have one size; each attention block layer needs q, k, v and o.
    A `BoundSpec` is returned as it is after checking that `params` has its leaves and shapes,
    so every function that takes a spec takes a bound one too and binds only once.
    """
    if isinstance(spec, BoundSpec):
        check_same_leaves([shape_stand_ins(spec), params], ["the bound spec", "params"], SpecError)
        return spec
    if not isinstance(spec, Spec):
        raise SpecError(
            f"spec must be a rotsym_jax.Spec (a built-in family's: rotsym_jax.spec_for(checkpoint)), "
            f"got {type(spec).__name__}"
        )
    problem = structure_problem(params) if isinstance(params, Mapping) else None
    if problem:
        raise SpecError(f"params: {problem}")
    flat = flatten(params)
    found, ignored, kinds, leaf_layers = _claim_leaves(spec, flat)
    position = {p: i for i, p in enumerate(flat)}

    attention, perms = [], []
    blocks = sorted({k[1] for k in found if k[0] == "attn"})
    names = [{k[1] for k in found if k[0] == kind} for kind in ("attn", "perm", "experts")]
    clash = (names[0] & names[1]) | (names[0] & names[2]) | (names[1] & names[2])
    if clash:
        raise SpecError(f"names {sorted(clash)} are used by groups of two kinds (attention blocks, permutation groups, experts)")
    for block in blocks:
        layers, members = _members(found, [("attn", block, r) for r in ATTENTION_ROLES], f"attention block {block!r}")
        roles = {m.role for m in members}
        if not set(ROLES) <= roles:
            raise SpecError(f"attention block {block!r} has leaves for roles {sorted(roles)}; it needs q, k, v and o")
        full = spec.heads[block].qk_norm == "full"
        if full and not set(GAIN_ROLES) <= roles or not full and roles & set(GAIN_ROLES):
            raise SpecError(f"attention block {block!r} has leaves for roles {sorted(roles)} and qk_norm={spec.heads[block].qk_norm!r}: "
                            f"the gains of a full-width QK-norm ({block}.qn, {block}.kn) belong to blocks with qk_norm='full', which need both")
        if spec.heads[block].gated_output != (GATE_ROLE in roles):
            raise SpecError(f"attention block {block!r} has leaves for roles {sorted(roles)} and gated_output={spec.heads[block].gated_output}: "
                            f"the rows of a gate on the heads' outputs ({block}.g) belong to blocks with gated_output=True, which need them")
        if any(bool(spec.heads[block].shared_rope_dim) != (role in roles) for role in (ROPE_QUERY_ROLE, ROPE_KEY_ROLE)):
            raise SpecError(f"attention block {block!r} has leaves for roles {sorted(roles)} and shared_rope_dim={spec.heads[block].shared_rope_dim}: "
                            f"the rows of each head's RoPE query ({block}.qr) and of the RoPE key they share ({block}.kr) belong to "
                            "blocks with shared_rope_dim > 0, which need both")
        attention.append(AttentionBlock(block, spec.heads[block], layers, members))
    for name in sorted({k[1] for k in found if k[0] == "perm"}):
        layers, members = _members(found, [("perm", name, role) for role in UNIT_ROLES], f"permutation group {name!r}")
        members = tuple(sorted(members, key=lambda m: min(position[p] for p in m.paths)))  # as the leaves come, whatever their roles
        if {m.role for m in members} & {"in", "out"} and not {"in", "out"} <= {m.role for m in members}:
            raise SpecError(f"permutation group {name!r} tags {name}.in or {name}.out but not both: a unit's scale multiplies "
                            f"one side and divides the other")
        if "perm" not in {m.role for m in members}:  # no gate: the unit's activation is not linear in up
            members = tuple(dataclasses.replace(m, role="perm") for m in members)
        sizes = {_group_size(flat[p], m) for m in members for p in m.paths}
        if len(sizes) != 1:
            detail = [(p, tuple(np.shape(flat[p]))) for m in members for p in m.paths[:1]]
            raise SpecError(f"permutation group {name!r} has inconsistent sizes {sorted(sizes)} across {detail}")
        perms.append(PermGroup(name, sizes.pop(), layers, members))
    attention, perms = _order_shared(attention, perms)
    experts = [_expert_group(name, found, flat, spec.routing_groups.get(name, 1), spec.expert_names.get(name, MIXTURE))
               for name in sorted(names[2])]
    return BoundSpec(
        spec,
        tuple((p, tuple(np.shape(x))) for p, x in flat.items()),
        tuple(attention),
        tuple(perms),
        tuple(ignored),
        tuple(kinds),
        tuple(leaf_layers),
        None if spec.residual is None else _bind_residual(spec.residual, flat),
        tuple(experts),
    )


def _order_shared(attention: list, perms: list) -> tuple[list, list]:
    """Leaves two groups hold on two axes: each member told the other group (`Member.also`), and each
    group the groups solved before it (`after`). Of two groups sharing a leaf, a permutation group is
    solved before an attention block (MLA's latents), and of two permutation groups one with a leaf
    of its own before one with none (Mamba's channels, then the state and the time step); a group
    solved first is solved from the leaves it holds alone, so it needs one."""
    held = {}
    for g in attention + perms:
        for m in g.members:
            for p in m.paths:
                held.setdefault(p, []).append((g.name, m.axis))

    def marked(g):
        members = tuple(dataclasses.replace(m, also=others[0]) if (others := [h for h in held[m.paths[0]] if h[0] != g.name]) else m
                        for m in g.members)
        return dataclasses.replace(g, members=members)

    attention, perms = [marked(b) for b in attention], [marked(g) for g in perms]
    blocks, by_name, ordered = {b.name for b in attention}, {g.name: g for g in perms}, []
    for g in perms:
        partners = {m.also[0] for m in g.members if m.also is not None}
        if not partners or any(m.also is None for m in g.members):
            ordered.append(g)
            continue
        if partners & blocks:
            raise SpecError(f"permutation group {g.name!r}: every leaf of it is an attention block's too, which leaves nothing to "
                            "solve its units from (tag the leaves that write them: a latent's projection, its norm's gain)")
        first = by_name[next(iter(partners))]
        if len(partners) != 1 or all(m.also is not None for m in first.members):
            raise SpecError(f"permutation group {g.name!r}: every leaf of it carries another group's axis ({sorted(partners)}); one group with "
                            "a leaf of its own must be solved first, and all of its leaves must share that one group's")
        if first.layers != g.layers:
            raise SpecError(f"permutation groups {first.name!r} and {g.name!r} share leaves but not their layers")
        ordered.append(dataclasses.replace(g, after=(first.name,)))
    attention = [dataclasses.replace(b, after=tuple(sorted({m.also[0] for m in b.members if m.also is not None}))) for b in attention]
    return attention, ordered


def _expert_group(name: str, found, flat, routing_groups: int, names: ExpertNames) -> ExpertGroup:
    layers, members = _members(found, [("experts", name, "expert")], f"experts block {name!r}")
    counts = {np.shape(flat[p])[m.axis] for m in members for p in m.paths}
    units = {np.shape(flat[p])[m.unit_axis] for m in members if m.unit_axis is not None for p in m.paths}
    detail = [(m.template, tuple(np.shape(flat[m.paths[0]]))) for m in members]
    if len(counts) != 1 or len(units) != 1:
        raise SpecError(f"experts block {name!r} has inconsistent numbers of experts {sorted(counts)} or units {sorted(units)} across {detail}")
    if all(m.unit_axis is not None for m in members) or all(m.unit_axis is None for m in members):
        raise SpecError(f"experts block {name!r} needs its router (a leaf tagged {name}.expert alone) and its experts' leaves "
                        f"(tagged {name}.expert and {name}.unit); it has {detail}")
    num = counts.pop()
    if not isinstance(routing_groups, int) or routing_groups < 1 or num % routing_groups:
        raise SpecError(f"experts block {name!r}: routing_groups={routing_groups!r} must be a positive int dividing its {num} experts")
    if not isinstance(names, ExpertNames):
        raise SpecError(f"experts block {name!r}: expert_names gives {names!r}, expected an ExpertNames")
    return ExpertGroup(name, num, units.pop(), layers, members, routing_groups, names)


def _bind_residual(residual: ResidualSpec, flat: dict) -> ResidualStream:
    compiled = [(re.compile(p), p, axis) for p, axis in residual.rules]
    axes, sizes = [], {}
    for path, leaf in flat.items():
        shape = tuple(np.shape(leaf))
        match = next(((p, axis) for rx, p, axis in compiled if rx.fullmatch(path)), None)
        if match is None:
            raise SpecError(f"leaf {path} (shape {shape}) is matched by no residual rule; add one (axis None if it does not touch the residual stream)")
        pattern, leaf_axes = match
        for axis in (() if leaf_axes is None else leaf_axes if isinstance(leaf_axes, tuple) else (leaf_axes,)):
            if not -len(shape) <= axis < len(shape):
                raise SpecError(f"residual rule {pattern!r} puts the stream on axis {axis} of leaf {path} of shape {shape}")
            axis %= len(shape)
            axes.append((path, axis))
            sizes.setdefault(shape[axis], []).append(path)
    if len(sizes) != 1:
        detail = {size: paths[:3] for size, paths in sizes.items()}
        raise SpecError(f"the residual stream has inconsistent widths across its leaves: {detail}" if sizes else "no leaf is on the residual stream")
    on_stream = {}
    for path, axis in axes:  # a leaf on the stream twice (a transform a tied decoder reads) reads it on its first axis
        on_stream.setdefault(path, axis)
    folds = []
    for gain_pattern, reader_pattern in residual.folds:
        rx = re.compile(gain_pattern)
        for path in flat:
            m = rx.fullmatch(path)
            if m is None:
                continue
            readers = re.compile(m.expand(reader_pattern))
            paths = tuple(p for p in flat if readers.fullmatch(p))
            # RMSNorm gains fold along the stream axis of any kernel (an expert's (E, d, f) too);
            # a LayerNorm's bias folds through `beta @ W`: (d, out) kernels only.
            if any(p not in on_stream or len(np.shape(flat[p])) < 2 or residual.norm == "layernorm" and (on_stream[p] != 0 or len(np.shape(flat[p])) != 2)
                   for p in paths):
                raise SpecError(f"norm gain {path}: its readers {list(paths)} must be kernels on the residual stream ((d, out) under LayerNorm)")
            folds.append((path, paths))  # no readers (a tied LM head): the gain cannot be folded
    return ResidualStream(sizes.popitem()[0], tuple(axes), residual.norm, tuple(g for g, _ in folds), tuple(folds), residual.placement,
                          residual.gain)


def _claim_leaves(spec: Spec, flat: dict):
    """Match every leaf to its rule (first match wins) and check its tags: {(kind, group name,
    role): {path template: {layer: (path, axis, layer_axis)}}}, the ignored paths, each path's
    kind ("qk", "vo", a permutation group or "other") and each path's layer."""
    compiled = [(re.compile(p), p, tags) for p, tags in spec.rules]
    # (kind, group name, role) -> {rule: {layer: (path, axis, layer_axis)}}
    found: dict[tuple, dict[str, dict]] = {}
    ignored, kinds, leaf_layers = [], [], []
    for path, leaf in flat.items():
        shape = tuple(np.shape(leaf))
        match = next(((rx, p, tags) for rx, p, tags in compiled if rx.fullmatch(path)), None)
        if match is None:
            raise SpecError(
                f"leaf {path} (shape {shape}) is matched by no rule; add a rule for it "
                f"(tags None to leave it alone)"
            )
        rx, pattern, tags = match
        m = rx.fullmatch(path)
        layer = m.groupdict().get("layer", m.group(1) if rx.groups else None)
        layer = int(layer) if layer is not None and str(layer).isdigit() else layer
        leaf_layers.append((path, layer))
        if tags is None or all(t is None for t in tags):
            ignored.append(path)
            kinds.append((path, "other"))
            continue
        if len(tags) != len(shape):
            raise SpecError(
                f"rule {pattern!r} gives {len(tags)} tags {tags} to leaf {path} of shape {shape} "
                f"({len(shape)} axes)"
            )
        layer_axes = [i for i, t in enumerate(tags) if t == LAYER]
        layer_axis = layer_axes[0] if layer_axes else None
        if len(layer_axes) > 1:
            raise SpecError(f"rule {pattern!r}: more than one 'layer' axis for leaf {path}")
        tagged = [(i, t, _tag_kind(t, spec.heads)) for i, t in enumerate(tags)]
        tagged = [(i, t, k) for i, t, k in tagged if k in ("attn", "perm", "experts")]
        for axis, tag, kind, unit_axis in _claims(tagged, pattern, path, shape, layer_axis):
            key = _claim_key(spec, tag, kind, pattern, path, shape, axis, layer_axis)
            if kind != "perm" or len(tagged) == 1 or all(k == "perm" for _, _, k in tagged) and axis == tagged[0][0]:
                # a leaf's kind: its attention block's where it also holds a latent's units, its first group's of two
                kinds.append((path, key[1] if kind != "attn" else "qk" if key[2][0] in "qk" else "vo"))
            if layer_axis is not None:
                layers = list(range(shape[layer_axis]))
                if layer is not None:
                    raise SpecError(f"leaf {path}: a captured layer index and a 'layer' axis at once")
                entry = {"scanned": (path, axis, layer_axis, tuple(layers))}
            else:
                entry = {layer: (path, axis, None, unit_axis)}
            # One member per path template (the path with its layer index blanked): a rule may match
            # several leaves per layer (e.g. mlp/(up|gate)/kernel).
            template = _template(m, path)
            by_rule = found.setdefault(key, {}).setdefault(template, {})
            for k, v in entry.items():
                if k in by_rule:
                    raise SpecError(f"rule {pattern!r} binds leaves {by_rule[k][0]} and {path} to {tag!r} as the same layer {k}")
                by_rule[k] = v

    return found, ignored, kinds, leaf_layers


def _claims(tagged, pattern, path, shape, layer_axis) -> list:
    """The groups a leaf's tags claim it for, as (axis, tag, kind, unit axis): one, or an expert's
    two axes as one claim, or an attention role's axis and a plain permutation's (a latent's units
    that an attention block's kernel reads: MLA's kv_b_proj), two claims of one leaf."""
    if len(tagged) == 2 and {t for _, t, _ in tagged} == {f"{tagged[0][1].rsplit('.', 1)[0]}.{r}" for r in EXPERT_ROLES}:
        (axis, tag, kind), = [x for x in tagged if x[1].endswith(".expert")]  # an expert's leaf: experts and units
        return [(axis, tag, kind, next(i for i, t, _ in tagged if t.endswith(".unit")))]
    if len(tagged) == 2 and sorted(k for _, _, k in tagged) == ["attn", "perm"] and layer_axis is None:
        (_, tag, _), = [x for x in tagged if x[2] == "perm"]
        if tag.endswith(tuple(f".{r}" for r in UNIT_ROLES[1:])):
            raise SpecError(f"rule {pattern!r} tags leaf {path} (shape {shape}) {tag!r} beside an attention role: a unit's scale "
                            "would have to pass the heads' maps; tag it with the plain permutation")
        return [(axis, tag, kind, None) for axis, tag, kind in tagged]
    if len(tagged) == 2 and [k for _, _, k in tagged] == ["perm", "perm"] and all("." not in t for _, t, _ in tagged) and tagged[0][1] != tagged[1][1]:
        if layer_axis is not None:  # two permutation groups, each its axis (Mamba's A_log: channels and state)
            raise SpecError(f"rule {pattern!r}: a leaf of two permutation groups in a scanned layer stack ('layer' axis of {path}) is not supported")
        return [(axis, tag, kind, None) for axis, tag, kind in tagged]
    if len(tagged) != 1:
        raise SpecError(
            f"rule {pattern!r} tags leaf {path} (shape {shape}) with {len(tagged)} group axes; "
            f"exactly one is supported per leaf (two: an expert's BLOCK.expert and BLOCK.unit, an attention role's "
            f"and a plain permutation's, or two permutation groups' plain tags, in a layer of its own)"
        )
    return [(*tagged[0], None)]


def _claim_key(spec: Spec, tag: str, kind: str, pattern: str, path: str, shape, axis: int, layer_axis) -> tuple:
    """(kind, group name, role) of one claim, its sizes checked."""
    if kind == "experts":
        block, role = tag.rsplit(".", 1)
        if role != "expert":
            raise SpecError(f"rule {pattern!r} tags leaf {path} (shape {shape}) {tag!r} without {block}.expert: units belong to an expert")
        if layer_axis is not None:
            raise SpecError(f"rule {pattern!r}: experts in a scanned layer stack ('layer' axis of {path}) are not supported")
        return ("experts", block, "expert")
    if kind == "attn":
        block, role = tag.rsplit(".", 1)
        g, r, dh = spec.heads[block].role_shape(role)
        if shape[axis] != g * r * dh:
            raise SpecError(
                f"leaf {path} has shape {shape}: axis {axis} tagged {tag!r} has {shape[axis]} "
                f"entries, expected {g * r * dh} = {g} kv groups x {r} heads x {dh} head_dim"
            )
        return ("attn", block, role)
    name, _, role = tag.rpartition(".") if tag.endswith(tuple(f".{r}" for r in UNIT_ROLES[1:])) else (tag, "", "perm")
    return ("perm", name, role)


def _template(match, path):
    group = "layer" if "layer" in match.re.groupindex else (1 if match.re.groups else None)
    if group is None or match.start(group) < 0:
        return path
    start, end = match.span(group)
    return path[:start] + "{layer}" + path[end:]


def _layer_order(layer):
    # Ints numerically, then any other captured text, then the layer-less global instance.
    return (layer is None, not isinstance(layer, int), layer if isinstance(layer, int) else 0, str(layer))


def _group_size(leaf, member):
    return np.shape(leaf)[member.axis]


def _members(found, keys, what):
    """Members of one group (one per path template); all must cover the same layers."""
    members, layer_sets = [], {}
    for key in keys:
        for template, by_layer in found.get(key, {}).items():
            role = key[2]
            if "scanned" in by_layer:
                path, axis, layer_axis, layers = by_layer["scanned"]
                members.append(Member(template, (path,), axis, role, layer_axis))
            else:
                layers = tuple(sorted(by_layer, key=_layer_order))
                axes = {by_layer[l][1::2] for l in layers}  # (group axis, unit axis)
                if len(axes) != 1:
                    raise SpecError(f"leaves {template!r} have the group axis at different positions in different layers")
                axis, unit_axis = axes.pop()
                members.append(Member(template, tuple(by_layer[l][0] for l in layers), axis, role, unit_axis=unit_axis))
            layer_sets[template] = tuple(layers)
    distinct = set(layer_sets.values())
    if len(distinct) != 1:
        detail = "; ".join(f"{p!r}: layers {list(l)}" for p, l in layer_sets.items())
        raise SpecError(f"{what}: its rules cover different layers ({detail})")
    return distinct.pop(), tuple(members)
