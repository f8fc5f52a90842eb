"""Specs bound to params: `bind(spec, params)` checks a `Spec` against a params pytree before any
work and returns a hashable `BoundSpec`, the groups of each kind (`AttentionBlock`, `PermGroup`,
`ExpertGroup`: a record with kind, name, layers, members) and the residual stream, which the
solvers and `apply_transform` use.

What a spec says (its rules of tags, the head geometry, the residual stream) is in `spec_rules`,
whose names are imported here too: `rotsym_jax.spec` holds every name of both.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import numpy as np

from .pytree import check_same_leaves, flatten, structure_problem
from .spec_rules import (  # noqa: F401  (re-exported: rotsym_jax.spec is where callers import them from)
    ATTENTION_ROLES,
    EXPERT_ROLES,
    GAIN_ROLES,
    GAINS,
    GATE_ROLE,
    LAYER,
    MIXTURE,
    NORMS,
    PERMUTED_ONLY_ROLES,
    PLACEMENTS,
    QK_NORMS,
    RESIDUAL,
    ROLES,
    ROPE_KEY_ROLE,
    ROPE_QUERY_ROLE,
    SIGN_QK_NORMS,
    SINK_ROLE,
    UNIT_NORM_ROLE,
    UNIT_ROLES,
    UNSCALED_QK_NORMS,
    VALUE_ROLES,
    ExpertNames,
    FrozenMap,
    HeadGeometry,
    ResidualSpec,
    Spec,
    SpecError,
    signs_only,
)


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
        if any(m.role == SINK_ROLE for m in self.members):
            qk += "; each head's attention sink follows its head"
        if g.fixed_order:
            qk = qk.replace("head permutations, ", "").replace("head permutations and ", "") + " (the heads' order fixed)"
        return f"attention {self.name!r}: {counted(len(self.layers), 'layer')}, {self._heads()}{rope}{qk}"

    def _heads(self) -> str:
        """The heads as the model has them: kv groups, or (MLA) one RoPE key and a latent every head reads."""
        g = self.geometry
        if not g.shared_rope_dim:
            return f"{g.num_heads} heads in {g.num_kv_heads} kv groups, head_dim {g.head_dim}" + (f", value_dim {g.v_dim}" if g.split_widths else "")
        latents = sorted({m.also[0] for m in self.members if m.also is not None and m.role in ("k", "v")})
        read = f" (MLA: every head's keys and values read from the latent {', '.join(map(repr, latents))})" if latents else ""
        # the block's head_dim is the no-RoPE part, its v_dim the value width (value_dim, else head_dim)
        return (f"{g.num_heads} heads sharing one RoPE key, no kv groups{read}; per head {g.head_dim} query/key dims without RoPE + "
                f"{g.shared_rope_dim} with RoPE (qk_nope_head_dim + qk_rope_head_dim), {g.v_dim} value dims (v_head_dim)")


def counted(n: int, noun: str) -> str:
    """"1 layer", "2 layers", "4 state entries": a count and its noun, plural where n is not 1."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else f"{n} {noun}s"


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
    unit: str | None = None  # what its units are, singular (`Spec.unit_names`); None: an FFN's hidden units

    @property
    def scaled(self) -> bool:
        return {m.role for m in self.members} == set(UNIT_ROLES)

    @property
    def rotatable(self) -> bool:
        """Whether an orthogonal map of its units keeps the function once the gain of the norm they
        pass (its member of role "norm", `Spec.unit_norms`) is folded into their readers (MLA's latents)."""
        return any(m.role == UNIT_NORM_ROLE for m in self.members)

    def describe(self) -> str:
        scales = ", and each unit's scale (up times s, down divided by s)" if self.scaled else ""
        shared = len(self.members) - len(self.reads)
        held = ", ".join(map(repr, sorted({m.also[0] for m in self.members if m not in self.reads})))
        read = (f"; {shared} of them also on an axis of {held} (solved after this group, from its assignment), this one solved "
                f"from the other {len(self.reads)}" if shared else "")
        carry = sum(m.also is not None and m.also[0] in self.after for m in self.members)
        carry = "its leaves carry" if carry == len(self.members) else f"{carry} of its leaf kinds {'carries' if carry == 1 else 'carry'}"
        after = f", solved after {', '.join(map(repr, self.after))} ({carry} that group's axis too)" if self.after else ""
        rotations = ("; rotations too with its norm's gain folded into its readers (latents='rotation')" if self.rotatable else "")
        return (f"permutation {self.name!r}: {counted(len(self.layers), 'layer')}, {counted(self.size, self.unit or 'unit')} "
                f"({counted(len(self.members), 'leaf kind')}{read}){scales}{after}{rotations}")


@dataclasses.dataclass(frozen=True)
class ScaledUnits(PermGroup):
    """A permutation group whose units a positive scale each moves too (`PermGroup.scaled`: a gated
    FFN's up and down leaves tagged NAME.in and NAME.out, MATH §1): the group kind "scaled_units"
    (kinds/scaled_units.py), which `bind` makes of every such group."""

    kind = "scaled_units"


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
        return (f"{named}: {counted(len(self.layers), 'layer')}, {counted(self.num_experts, n.expert)} of {counted(self.units, n.unit)}: "
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
    streams: tuple[ResidualStream, ...] = ()
    experts: tuple[ExpertGroup, ...] = ()

    @property
    def groups(self) -> tuple:
        """Every per-layer group, of every kind (each has `kind`, `name`, `layers`, `members`)."""
        return self.attention + self.perms + self.experts

    @property
    def residual(self) -> ResidualStream | None:
        """The model's one residual stream (None: the spec has no residual rules). A path that
        handles one stream reads it here; a model of several streams is refused by name."""
        if len(self.streams) > 1:
            raise SpecError(f"this model has {len(self.streams)} residual streams ({', '.join(s.name for s in self.streams)}), and this "
                            "path handles one stream only; use residual='none'")
        return self.streams[0] if self.streams else None

    def streams_in(self, transforms) -> tuple[ResidualStream, ...]:
        """The residual streams whose elements `transforms` ({name: element}) holds."""
        return tuple(s for s in self.streams if s.name in transforms)

    def groups_of(self, transforms) -> tuple:
        """The groups whose elements `transforms` ({name: element}) holds: the per-layer groups,
        then the residual streams (each under its name)."""
        return tuple(g for g in self.groups if g.name in transforms) + self.streams_in(transforms)

    def transformed_paths(self, residual: bool = False) -> list[str]:
        """The leaves some group moves (with `residual`, the residual streams' leaves too)."""
        paths = list(dict.fromkeys(p for g in self.groups for m in g.members for p in m.paths))  # a latent's reader once
        if residual:
            seen = set(paths)
            for stream in self.streams:
                paths += [p for p, _ in stream.axes if p not in seen]
                seen |= {p for p, _ in stream.axes}
        return paths


@dataclasses.dataclass(frozen=True)
class ResidualStream:
    """A `ResidualSpec` bound to params: the width, every (path, axis) on the stream, the norm
    kind, the norm gains and, per gain, the leaves that read it (for folding), the placement.
    One group for the whole model (or for each of its streams), its element under `name`
    (kinds/residual.py)."""

    kind = "residual"

    size: int
    axes: tuple[tuple[str, int], ...]
    norm: str
    gains: tuple[str, ...]
    folds: tuple[tuple[str, tuple[str, ...]], ...]
    placement: str = "pre"
    gain: str = "weight"
    name: str = RESIDUAL
    permutations_only: str | None = None


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
        unit = spec.unit_names.get(name)
        if unit is not None and (not isinstance(unit, str) or not unit):
            raise SpecError(f"permutation group {name!r}: unit_names gives {unit!r}, expected a noun (a str, singular)")
        record = ScaledUnits if {m.role for m in members} == set(UNIT_ROLES) else PermGroup
        perms.append(record(name, sizes.pop(), layers, _unit_norm(spec, name, members, flat), unit=unit))
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
        _bind_streams(spec, flat),
        tuple(experts),
    )


def _unit_norm(spec: Spec, name: str, members: tuple, flat) -> tuple:
    """`members` with the one `Spec.unit_norms` names as the group's norm gain given role "norm"; SpecError
    where no member (or more than one) matches, or it is no vector of the units (one per layer)."""
    pattern = spec.unit_norms.get(name)
    if pattern is None:
        return members
    rx = re.compile(pattern)
    found = [m for m in members if all(rx.fullmatch(p) for p in m.paths)]
    if len(found) != 1 or found[0].role != "perm" or found[0].layer_axis is not None or any(np.ndim(flat[p]) != 1 for p in found[0].paths):
        raise SpecError(f"permutation group {name!r}: unit_norms gives {pattern!r}, which must match the paths of exactly one of its "
                        f"members, a gain vector per layer; its members are {[m.template for m in members]}")
    return tuple(dataclasses.replace(m, role=UNIT_NORM_ROLE) if m is found[0] else m for m in members)


def _order_shared(attention: list, perms: list) -> tuple[list, list]:
    """Leaves two groups hold on two axes: each member told the other group (`Member.also`), and each
    group the groups solved before it (`after`). Of two groups sharing a leaf, a permutation group is
    solved before an attention block (MLA's latents), and of two permutation groups one with a leaf
    of its own before one with none (Mamba's channels, then the state and the time step), and of two
    with leaves of their own the one on the shared leaves' rows, their input side, before the one on
    their outputs (Llama 4's adapter units, fc2's rows, before its outputs, fc2's columns: the chain's
    order); a group solved first is solved from the leaves it holds alone, so it needs one."""
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
            ordered.append(_after_upstream(g, by_name) if partners - blocks else g)
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
    solved = {g.name: g for g in ordered}
    chained = [(g.name, first) for g in ordered for first in g.after if solved[first].after]
    if chained:  # the driver solves the groups with `after` once the others are: one step of order, not a chain
        raise SpecError(f"permutation group {chained[0][0]!r} is solved after {chained[0][1]!r}, which is solved after another group "
                        "it shares leaves with: a chain of three groups sharing leaves is not supported (tag two of them as one group)")
    return attention, ordered


def _after_upstream(group: PermGroup, by_name: dict) -> PermGroup:
    """A permutation group with a leaf of its own, `after` each such group it shares leaves with
    that sits on their rows (their input side) where this one is on their columns (a chain's
    earlier units, solved first from their own leaves; this one then reads the shared leaves too)."""
    upstream = set()
    for name in sorted({m.also[0] for m in group.members if m.also is not None} & set(by_name)):
        other = by_name[name]
        if all(m.also is not None for m in other.members):
            continue  # no leaf of its own: solved after this one
        sides = {m.axis > m.also[1] for m in group.members if m.also is not None and m.also[0] == name}
        if len(sides) != 1:
            raise SpecError(f"permutation groups {group.name!r} and {name!r} share leaves, each on the rows of some and the columns of "
                            "others: no order of the two solves them (a chain's units are on the rows of the map after them)")
        if other.layers != group.layers:
            raise SpecError(f"permutation groups {name!r} and {group.name!r} share leaves but not their layers")
        if sides.pop():
            upstream.add(name)
    return dataclasses.replace(group, after=tuple(sorted(upstream))) if upstream else group


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


def _bind_streams(spec: Spec, flat: dict) -> tuple[ResidualStream, ...]:
    streams = tuple(_bind_residual(r, flat) for r in spec.streams)
    counts: dict = {}
    for stream in streams:
        for path, axis in dict.fromkeys(stream.axes):
            counts.setdefault((path, axis), []).append(stream.name)
    shared = {key: names for key, names in counts.items() if len(names) > 1}
    if shared:
        (path, axis), names = next(iter(shared.items()))
        raise SpecError(f"leaf {path} axis {axis} is on residual streams {names}: an axis belongs to one stream")
    return streams


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
        raise SpecError(f"the residual stream {residual.name!r} has inconsistent widths across its leaves: {detail}" if sizes
                       else f"no leaf is on the residual stream {residual.name!r}")
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
            # Gains fold along the stream axis of any kernel (an expert's (E, d, f) too); a LayerNorm's
            # bias folds through `beta @ W` into (d, out) kernels' biases, or stays as beta / g where a
            # reader has none (Phi-3.5-MoE's router and experts).
            if any(p not in on_stream or len(np.shape(flat[p])) < 2 or residual.norm == "layernorm" and len(np.shape(flat[p])) == 2 and on_stream[p] != 0
                   for p in paths):
                raise SpecError(f"norm gain {path}: its readers {list(paths)} must be kernels on the residual stream ((d, out) or stacked under LayerNorm)")
            folds.append((path, paths))  # no readers (a tied LM head): the gain cannot be folded
    return ResidualStream(sizes.popitem()[0], tuple(axes), residual.norm, tuple(g for g, _ in folds), tuple(folds), residual.placement,
                          residual.gain, residual.name, residual.permutations_only)


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
                f"entries, expected {g * r * dh} = {g} kv groups x {r} heads x {dh} "
                f"{'value_dim' if role in VALUE_ROLES and spec.heads[block].split_widths else 'head_dim'}"
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
