"""How group elements act on params: every group member's leaves as one stacked (L, rows, size)
view, the transform applied to the views, the views written back; a layer at a time, by one
jitted program per group that every layer shares (`layer_template`).

Permutations act first, then rotations and scales in the permuted frame. Every action leaves the
network's function unchanged. L runs over `block.layers` / `group.layers` of the bound spec, in
order; the elements themselves are in `transforms.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import ChainMap
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from ..precision import compute_dtype, exact, exact_jit, is_traced
from ..pytree import flatten, unflatten
from ..spec import AttentionBlock, BoundSpec, Member, Spec, bind
from ..transforms import RESIDUAL
from . import latents
from .residual import check_rotatable, is_signed_permutation

# ---- stacked views: every member as (L, rows, size), tagged axis last -----------------------------

def _member_axes(member: Member, ndim: int):
    """(order of the leaf's axes: layer first (if scanned), the others, the tagged axis last; an
    expert's leaf: experts first, the others, its units last)."""
    rest = [i for i in range(ndim) if i not in (member.axis, member.layer_axis, member.unit_axis)]
    lead = [] if member.layer_axis is None else [member.layer_axis]
    if member.unit_axis is not None:
        return lead + [member.axis] + rest + [member.unit_axis]
    return lead + rest + [member.axis]


def stacked(flat, member: Member, dtype=None):
    """The member's leaves as one (L, rows, size) array: layers stacked, tagged axis last (an
    expert's leaves: (L, E, rows, units))."""
    if member.layer_axis is None:
        x = jnp.stack([jnp.asarray(flat[p]) for p in member.paths])
        ndim = x.ndim - 1
        x = jnp.transpose(x, [0] + [i + 1 for i in _member_axes(member, ndim)])
    else:
        x = jnp.asarray(flat[member.paths[0]])
        x = jnp.transpose(x, _member_axes(member, x.ndim))
    lead = x.shape[:2] if member.unit_axis is not None else x.shape[:1]
    x = x.reshape(*lead, -1, x.shape[-1])
    return x if dtype is None else x.astype(dtype)


def unstacked(x, member: Member, shapes, dtype) -> dict:
    """Inverse of `stacked`: {path: leaf} with the original shapes and dtype."""
    shape = shapes[member.paths[0]]
    order = _member_axes(member, len(shape))
    if member.layer_axis is None:
        moved = [shape[i] for i in order]
        x = x.reshape((x.shape[0], *moved))
        inverse = np.argsort(order)
        x = jnp.transpose(x, [0] + [i + 1 for i in inverse])
        return {p: x[i].astype(dtype) for i, p in enumerate(member.paths)}
    x = x.reshape([shape[i] for i in order])
    return {member.paths[0]: jnp.transpose(x, np.argsort(order)).astype(dtype)}


def heads_view(x, block: AttentionBlock, role: str):
    """(L, rows, G*R*dh) -> (L, rows, G, R, dh)."""
    g, r, dh = block.geometry.role_shape(role)
    return x.reshape(x.shape[0], x.shape[1], g, r, dh)


# ---- actions ---------------------------------------------------------------------------------------

def apply_to_leaves(bound: BoundSpec, leaves: dict, transforms: dict) -> dict:
    """{path: moved leaf} for every transformed path, from `leaves` ({path: leaf}, every path of
    `bound.transformed_paths()`), unchecked: the core of `apply_transform`.

    A group's layers run one at a time through one program, which every layer (and every model
    with the same layer shapes) shares: XLA compiles in time proportional to a program's leaves,
    and a program for all layers at once held a stacked copy of them. A group with a scanned
    member (all layers in one leaf) runs in one program. Each group acts as its kind does
    (`Kind.act`), on the leaves as the groups before it left them: the residual stream's last."""
    out = {}
    for group in bound.groups_of(transforms):
        out.update(rj.kinds.of(group).act(group, ChainMap(out, leaves), transforms[group.name]))
    return out


def act_on_groups(groups, leaves: Mapping, transforms: Mapping) -> dict:
    """{path: moved leaf} of every member of `groups`, each moved by its group's element in
    `transforms` (the residual stream apart): `apply_to_leaves`' groups."""
    out = {}
    for group in groups:
        t = transforms[group.name]
        now = ChainMap(out, leaves)  # a leaf two groups hold on two axes (a latent's reader) takes both actions, which commute
        if is_scanned(group):
            out.update(_act_on_group(group, {p: now[p] for m in group.members for p in m.paths}, t, None))
            continue
        template = layer_template(group)
        for i in range(len(group.layers)):
            moved = _act_on_group(template, template_leaves(group, now, i), t, i)
            out.update({m.paths[i]: moved[str(k)] for k, m in enumerate(group.members)})
    return out


def layer_template(group):
    """`group` (an attention block or a permutation group) as one layer whose member k reads the
    leaf named str(k): equal for every layer of the group (and for groups of other models with
    the same structure), so a jitted function of it compiles once for all of them."""
    members = tuple(dataclasses.replace(m, template=str(k), paths=(str(k),)) for k, m in enumerate(group.members))
    solved_after = {"after": ()} if group.after else {}  # the solve's order, not the action's
    return dataclasses.replace(group, layers=(0,), members=members, **solved_after)


def template_leaves(group, leaves: Mapping, i: int) -> dict:
    """The leaves of the group's layer i (its i-th in `group.layers`), named as its
    `layer_template` names them."""
    return {str(k): leaves[m.paths[i]] for k, m in enumerate(group.members)}


def is_scanned(group) -> bool:
    """Whether a member holds every layer in one leaf (then the group has no per-layer leaves)."""
    return any(m.layer_axis is not None for m in group.members)


@functools.partial(exact_jit, static_argnums=0)
def _act_on_group(group, leaves: dict, transform, layer):
    """The group's element acting on its members' leaves; `layer`: the index of the layer of
    `transform` to apply (the group is then a `layer_template`), None for every layer."""
    if layer is not None:
        transform = jax.tree_util.tree_map(lambda x: jax.lax.dynamic_index_in_dim(x, layer, keepdims=True), transform)
    shapes = {p: x.shape for p, x in leaves.items()}
    out = {}
    for member in group.members:
        dtype = leaves[member.paths[0]].dtype
        x = stacked(leaves, member, None if transform.preserves_dtype else compute_dtype(dtype))
        out.update(unstacked(transform.act_stacked(x, group, member), member, shapes, dtype))
    return out


def act_on_stream(stream, leaves: Mapping, t) -> dict:
    """`leaves` with each of them on the residual stream moved by `t` along its stream axes (a leaf
    on the stream along two axes along both; `stream.axes` not in `leaves` are skipped): a program
    per leaf shape and axis, which every layer and every model of those shapes shares. In memory
    and streamed alike."""
    gains, out = set(stream.gains), dict(leaves)
    for path, axis in stream.axes:
        if path in out:
            out[path] = _act_on_stream_leaf(out[path], t, axis, path in gains)
    return out


def act_on_streams(streams, leaves: Mapping, transforms: Mapping) -> dict:
    """`leaves` moved along every stream of `streams` whose element `transforms` holds (under its
    name), one stream after the other: each on its own axes."""
    out = dict(leaves)
    for stream in streams:
        if stream.name in transforms:
            out = act_on_stream(stream, out, transforms[stream.name])
    return out


def moved_by_others(bound: BoundSpec, stream, flat_b, t: dict):
    """`flat_b` with its leaves that are on `stream` and on other streams too moved along those
    others by their elements in `t` ({stream name: T}, the descent's last): what scores `stream`'s
    T given the others (block coordinate descent). Other leaves as they are."""
    others = [s for s in bound.streams if s.name != stream.name and s.name in t]
    shared = {p for p, _ in stream.axes} & {p for s in others for p, _ in s.axes} & set(flat_b)
    if not shared:
        return flat_b
    return {**flat_b, **act_on_streams(others, {p: flat_b[p] for p in shared}, t)}


@functools.partial(exact_jit, static_argnums=(2, 3))
def _act_on_stream_leaf(x, t, axis: int, gain: bool):
    # An RMSNorm gain is a diagonal map, not a vector of the stream: it only follows the
    # permutation (a rotation needs it uniform: folded, see residual.fold_norms).
    return jnp.take(x, t.perm, axis=axis) if gain else t.act(x, axis)


@exact
def apply_transform(spec: Spec | BoundSpec, params, transforms) -> dict:
    """New params with `transforms` applied (the input is not modified). Function-preserving."""
    bound = bind(spec, params)
    check_transforms(bound, transforms)
    rotated = [s for s in bound.streams_in(transforms) if not is_signed_permutation(transforms[s.name])]  # sign flips commute with every RMSNorm gain
    if rotated:
        check_rotatable(bound, params, "params", rotated)
    latents.check_rotations(bound, params, transforms)  # a latent's rotation needs its norm's gain folded
    return apply_unchecked(bound, params, transforms)


def apply_unchecked(bound: BoundSpec, params, transforms) -> dict:
    """`apply_transform` for transforms the library's solvers just built (group elements by
    construction): no shape checks, no read-back of the transforms to the host."""
    flat = flatten(params)
    leaves = {p: flat[p] for p in bound.transformed_paths(bool(bound.streams_in(transforms)))}
    new = apply_to_leaves(bound, leaves, transforms)
    return unflatten({**flat, **new})


def check_transforms(bound: BoundSpec, transforms) -> None:
    """Clear errors for transforms that do not fit the bound spec: the groups, each element's type
    and array shapes, and (outside jit) that each is a group element."""
    if isinstance(transforms, Mapping) and RESIDUAL in transforms and not bound.streams:
        raise InputError("transforms have a residual element, but the spec has no residual rules (Spec.residual)")
    if isinstance(transforms, Mapping):
        unknown = sorted(set(transforms) - {g.name for g in bound.groups} - {s.name for s in bound.streams})
        if unknown:
            raise InputError(f"transforms[{unknown[0]!r}]: no group or residual stream of this spec is named so; its groups are "
                             f"{[g.name for g in bound.groups]}, its streams {[s.name for s in bound.streams]}")
    groups = {g.name: g for g in (bound.groups_of(transforms) if isinstance(transforms, Mapping) else bound.groups)}
    groups.update({g.name: g for g in bound.groups})  # every per-layer group's element is required
    expected = {name: rj.kinds.of(g).element.identity(g) for name, g in groups.items()}
    if not isinstance(transforms, Mapping) or set(transforms) != set(expected):
        got = sorted(transforms) if isinstance(transforms, Mapping) else type(transforms).__name__
        raise InputError(f"transforms have groups {got}, expected {sorted(expected)} for this spec")
    for name, want in expected.items():
        t, where = transforms[name], f"transforms[{name!r}]"
        if type(t) is not type(want):
            raise InputError(f"{where} is a {type(t).__name__}; expected a {type(want).__name__} (see rotsym_jax.transforms)")
        want = want.matching(t)  # its optional fields (invertible maps, unit scales, a rotation) shaped as the identity's
        for field in dataclasses.fields(want):
            have, need = np.shape(getattr(t, field.name)), np.shape(getattr(want, field.name))
            if tuple(have) != tuple(need):
                raise InputError(f"{where}.{field.name} has shape {tuple(have)}, expected {tuple(need)}")
    if not is_traced(dict(transforms)):
        for name, t in transforms.items():
            t.check(groups[name], f"transforms[{name!r}]")
