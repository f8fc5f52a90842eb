"""Group elements as pytrees, and how they act on params.

A *transform* is a plain dict with one entry per group of a bound spec:

    transforms[block] = {              # an attention block (MATH.md §1), arrays over the block's layers
        "group_perm": (L, G) int32,    # new kv group g of B is old group group_perm[l, g]
        "head_perm":  (L, G, R) int32, # new query slot r of group g is old slot head_perm[l, g, r]
        "qk": (L, G, dh, dh),          # orthogonal; q and k head slices map x -> x @ qk[l, g]
        "qk_scale": (L, G),            # q side * a, k side / a
        "vo": (L, G, dh, dh),          # v slices x -> x @ vo; O rows W_o^h -> vo^T W_o^h
        "vo_scale": (L, G),            # v side * c, o side / c
    }
    transforms[group] = (L, n) int32   # a permutation group: new unit j is old unit perm[l, j]

Permutations act first, then rotations and scales in the permuted frame. Every action leaves the
network's function unchanged. L runs over `block.layers` / `group.layers` of the bound spec, in order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .precision import exact, exact_jit
from .pytree import flatten, unflatten
from .spec import AttentionBlock, BoundSpec, Member, Spec, bind

ATTENTION_KINDS = ("heads", "qk", "vo", "qk_scale", "vo_scale")
KINDS = ATTENTION_KINDS + ("perm",)
_SCALE_SIGN = {"q": 1, "k": -1, "v": 1, "o": -1}


# ---- stacked views: every member as (L, rows, size), tagged axis last -----------------------------

def _member_axes(member: Member, ndim: int):
    """(order of the leaf's axes: layer first (if scanned), the others, the tagged axis last)."""
    rest = [i for i in range(ndim) if i not in (member.axis, member.layer_axis)]
    lead = [] if member.layer_axis is None else [member.layer_axis]
    return lead + rest + [member.axis]


def stacked(flat, member: Member, dtype=None):
    """The member's leaves as one (L, rows, size) array: layers stacked, tagged axis last."""
    if member.layer_axis is None:
        x = jnp.stack([jnp.asarray(flat[p]) for p in member.paths])
        ndim = x.ndim - 1
        x = jnp.transpose(x, [0] + [i + 1 for i in _member_axes(member, ndim)])
    else:
        x = jnp.asarray(flat[member.paths[0]])
        x = jnp.transpose(x, _member_axes(member, x.ndim))
    x = x.reshape(x.shape[0], -1, x.shape[-1])
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


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


# ---- actions ---------------------------------------------------------------------------------------

def act_on_heads(x, t, role: str):
    """Apply an attention block's transform `t` to one role's (L, rows, G, R, dh) view."""
    x = jnp.take_along_axis(x, t["group_perm"][:, None, :, None, None], axis=2)
    if role in ("q", "o"):
        x = jnp.take_along_axis(x, t["head_perm"][:, None, :, :, None], axis=3)
    pair = "qk" if role in ("q", "k") else "vo"
    x = jnp.einsum("lngrd,lgde->lngre", x, t[pair].astype(x.dtype))
    scale = t[f"{pair}_scale"].astype(x.dtype) ** _SCALE_SIGN[role]
    return x * scale[:, None, :, None, None]


def act_on_units(x, perm):
    """Permute the last axis of a (L, rows, n) view: new unit j is old unit perm[l, j]."""
    return jnp.take_along_axis(x, perm[:, None, :], axis=2)


@functools.partial(exact_jit, static_argnums=0)
def _apply_bound(bound: BoundSpec, leaves: dict, transforms: dict) -> dict:
    shapes = dict(bound.shapes)
    out = {}
    for block in bound.attention:
        for member in block.members:
            dtype = leaves[member.paths[0]].dtype
            x = heads_view(stacked(leaves, member, _compute_dtype(dtype)), block, member.role)
            x = act_on_heads(x, transforms[block.name], member.role)
            out.update(unstacked(x.reshape(x.shape[0], x.shape[1], -1), member, shapes, dtype))
    for group in bound.perms:
        for member in group.members:
            dtype = leaves[member.paths[0]].dtype
            x = act_on_units(stacked(leaves, member), transforms[group.name])
            out.update(unstacked(x, member, shapes, dtype))
    return out


def transformed_paths(bound: BoundSpec) -> list[str]:
    groups = bound.attention + bound.perms
    return [p for g in groups for m in g.members for p in m.paths]


@exact
def apply_transform(spec: Spec | BoundSpec, params, transforms) -> dict:
    """New params with `transforms` applied (the input is not modified). Function-preserving."""
    bound = spec if isinstance(spec, BoundSpec) else bind(spec, params)
    check_transforms(bound, transforms)
    return apply_unchecked(bound, params, transforms)


def apply_unchecked(bound: BoundSpec, params, transforms) -> dict:
    """`apply_transform` for transforms the library's solvers just built (group elements by
    construction): no shape checks, no read-back of the transforms to the host."""
    flat = flatten(params)
    leaves = {p: flat[p] for p in transformed_paths(bound)}
    new = _apply_bound(bound, leaves, transforms)
    return unflatten({**flat, **new})


def check_transforms(bound: BoundSpec, transforms):
    """Clear errors for a transform pytree that does not fit the bound spec."""
    expected = jax.tree_util.tree_map(jnp.shape, identity_transform(bound))
    got = jax.tree_util.tree_map(jnp.shape, dict(transforms))
    if jax.tree_util.tree_structure(expected) != jax.tree_util.tree_structure(got):
        raise ValueError(f"transforms have keys {_keys(got)}, expected {_keys(expected)} for this spec")
    for (path, want), (_, have) in zip(
        jax.tree_util.tree_leaves_with_path(expected, is_leaf=_is_shape),
        jax.tree_util.tree_leaves_with_path(got, is_leaf=_is_shape),
    ):
        if tuple(want) != tuple(have):
            raise ValueError(f"transforms{jax.tree_util.keystr(path)} has shape {tuple(have)}, expected {tuple(want)}")
    if not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(transforms)):
        _check_group_elements(bound, jax.device_get(dict(transforms)))


def _check_group_elements(bound: BoundSpec, host: dict):
    """Only group elements preserve the function: permutations, orthogonal matrices (of the RoPE
    form on rotary blocks), positive finite scales. Host arrays; shapes already checked."""
    for block in bound.attention:
        t, where = host[block.name], f"transforms[{block.name!r}]"
        for key in ("group_perm", "head_perm"):
            _check_permutations(t[key], f"{where}[{key!r}]")
        for key in ("qk", "vo"):
            _check_orthogonal(t[key], f"{where}[{key!r}]")
        if block.geometry.rotary_dim:
            _check_rope_form(t["qk"], block.geometry.rotary_dim, f"{where}['qk']")
        for key in ("qk_scale", "vo_scale"):
            scale = np.asarray(t[key])
            bad = ~(np.isfinite(scale) & (scale > 0))
            if bad.any():
                index = _first(bad)
                raise ValueError(f"{where}[{key!r}]{list(index)} = {scale[index]}; scales must be finite and > 0")
    for group in bound.perms:
        _check_permutations(host[group.name], f"transforms[{group.name!r}]")


def _first(bad) -> tuple:
    """Index of the first True entry: the element named in the error."""
    return tuple(int(i) for i in np.argwhere(bad)[0])


def _check_permutations(p, where):
    p = np.asarray(p)
    if not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"{where} has dtype {p.dtype}; permutations are integer index arrays")
    n = p.shape[-1]
    bad = np.any(np.sort(p, axis=-1) != np.arange(n), axis=-1)
    if bad.any():
        index = _first(bad)
        raise ValueError(f"{where}{list(index)} = {p[index].tolist()[:16]} is not a permutation of 0..{n - 1}")


def _orthogonality_tol(dtype) -> float:
    return max(1e-4, 10 * float(np.finfo(dtype).eps)) if np.issubdtype(dtype, np.floating) else 1e-4


def _check_orthogonal(r, where):
    tol = _orthogonality_tol(np.asarray(r).dtype)
    r = np.asarray(r, np.float64)
    err = np.max(np.abs(np.swapaxes(r, -1, -2) @ r - np.eye(r.shape[-1])), axis=(-2, -1))
    bad = ~(err <= tol)  # NaN included
    if bad.any():
        index = _first(bad)
        raise ValueError(f"{where}{list(index)} is not orthogonal (max |R^T R - I| = {err[index]:.3g} > {tol:g})")


def _check_rope_form(r, rotary_dim, where):
    """RoPE rotates pairs (i, i + rotary_dim/2) of the first rotary_dim entries; QK rotations
    commute with it only if they are 2-D rotations on those pairs and leave the rest apart."""
    tol = _orthogonality_tol(np.asarray(r).dtype)
    r = np.asarray(r, np.float64)
    dh, half = r.shape[-1], rotary_dim // 2
    i = np.arange(half)
    allowed = np.zeros((dh, dh), bool)
    allowed[rotary_dim:, rotary_dim:] = True
    for a, b in ((i, i), (i + half, i + half), (i, i + half), (i + half, i)):
        allowed[a, b] = True
    err = np.max(np.abs(np.where(allowed, 0.0, r)), axis=(-2, -1))
    err = np.maximum(err, np.max(np.abs(r[..., i, i] - r[..., i + half, i + half]), axis=-1))
    err = np.maximum(err, np.max(np.abs(r[..., i, i + half] + r[..., i + half, i]), axis=-1))
    bad = ~(err <= tol)
    if bad.any():
        index = _first(bad)
        raise ValueError(
            f"{where}{list(index)} does not commute with RoPE (rotary_dim={rotary_dim}): it must rotate "
            f"each pair (i, i + {half}) by a 2-D rotation and leave the other entries apart (off by {err[index]:.3g})"
        )


def _is_shape(x):
    return isinstance(x, tuple)


def _keys(tree):
    return {k: sorted(v) if isinstance(v, dict) else "perm" for k, v in tree.items()}


# ---- group elements --------------------------------------------------------------------------------

def identity_transform(bound: BoundSpec) -> dict:
    out = {}
    for block in bound.attention:
        g, r, dh = block.geometry.role_shape("q")
        n = len(block.layers)
        out[block.name] = {
            "group_perm": jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32), (n, g)),
            "head_perm": jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32), (n, g, r)),
            "qk": jnp.broadcast_to(jnp.eye(dh, dtype=jnp.float32), (n, g, dh, dh)),
            "qk_scale": jnp.ones((n, g), jnp.float32),
            "vo": jnp.broadcast_to(jnp.eye(dh, dtype=jnp.float32), (n, g, dh, dh)),
            "vo_scale": jnp.ones((n, g), jnp.float32),
        }
    for group in bound.perms:
        out[group.name] = jnp.broadcast_to(jnp.arange(group.size, dtype=jnp.int32), (len(group.layers), group.size))
    return out


def _inverse_perm(p):
    return jnp.argsort(p, axis=-1).astype(jnp.int32)


def _take(x, index, axis):
    """x[..., index[...], ...] along `axis` for a per-layer index array (L, n)."""
    index = index.reshape(index.shape + (1,) * (x.ndim - index.ndim))
    return jnp.take_along_axis(x, index, axis=axis)


@exact
def invert_transform(transforms: dict) -> dict:
    """The transform that undoes `transforms` (apply(apply(p, t), invert(t)) == p)."""
    out = {}
    for name, t in transforms.items():
        if not isinstance(t, dict):
            out[name] = _inverse_perm(t)
            continue
        inv = _inverse_perm(t["group_perm"])  # new group j of the inverse is old group inv[j]
        out[name] = {
            "group_perm": inv,
            "head_perm": _inverse_perm(_take(t["head_perm"], inv, 1)),
            "qk": jnp.swapaxes(_take(t["qk"], inv, 1), -1, -2),
            "qk_scale": 1.0 / _take(t["qk_scale"], inv, 1),
            "vo": jnp.swapaxes(_take(t["vo"], inv, 1), -1, -2),
            "vo_scale": 1.0 / _take(t["vo_scale"], inv, 1),
        }
    return out


@exact
def compose_transforms(first: dict, second: dict) -> dict:
    """The transform equal to applying `first`, then `second`."""
    out = {}
    for name, t1 in first.items():
        t2 = second[name]
        if not isinstance(t1, dict):
            out[name] = jnp.take_along_axis(t1, t2, axis=-1)
            continue
        p2 = t2["group_perm"]
        out[name] = {
            "group_perm": jnp.take_along_axis(t1["group_perm"], p2, axis=-1),
            "head_perm": jnp.take_along_axis(_take(t1["head_perm"], p2, 1), t2["head_perm"], axis=-1),
            "qk": _take(t1["qk"], p2, 1) @ t2["qk"],
            "qk_scale": _take(t1["qk_scale"], p2, 1) * t2["qk_scale"],
            "vo": _take(t1["vo"], p2, 1) @ t2["vo"],
            "vo_scale": _take(t1["vo_scale"], p2, 1) * t2["vo_scale"],
        }
    return out


def random_orthogonal(key, shape, n, dtype=jnp.float32):
    """Haar-distributed orthogonal matrices (QR of a Gaussian with the sign fix)."""
    q, r = jnp.linalg.qr(jax.random.normal(key, (*shape, n, n), dtype))
    return q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[..., None, :]


def rope_rotation(angles, head_dim, rotary_dim):
    """Block rotations of the rotary pairs (i, i + rotary_dim/2) by `angles` (..., rotary_dim/2),
    acting as x @ R; identity on the dims past rotary_dim."""
    half = rotary_dim // 2
    i = jnp.arange(half)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    eye = jnp.broadcast_to(jnp.eye(head_dim, dtype=angles.dtype), (*angles.shape[:-1], head_dim, head_dim))
    r = eye.at[..., i, i].set(cos).at[..., i + half, i + half].set(cos)
    return r.at[..., i, i + half].set(sin).at[..., i + half, i].set(-sin)


def random_transform(spec: Spec | BoundSpec, params, key, kinds=KINDS, *, max_log_scale=0.7) -> dict:
    """A random group element of every requested kind (others identity).

    kinds: subset of "heads" (kv-group and query-head permutations), "qk", "vo" (Haar rotations;
    RoPE blocks draw their QK rotation from SO(2)^(pairs) x O(rest)), "qk_scale", "vo_scale"
    (log-uniform in [-max_log_scale, max_log_scale]), "perm" (every permutation group).
    """
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown transform kinds {sorted(unknown)}; choose from {KINDS}")
    bound = spec if isinstance(spec, BoundSpec) else bind(spec, params)
    out = identity_transform(bound)
    for block in bound.attention:
        key, *ks = jax.random.split(key, 9)
        t = dict(out[block.name])
        geo = block.geometry
        n, g, r, dh = len(block.layers), geo.num_kv_heads, geo.heads_per_group, geo.head_dim
        if "heads" in kinds:
            t["group_perm"] = _random_perms(ks[0], (n,), g)
            t["head_perm"] = _random_perms(ks[1], (n, g), r)
        if "qk" in kinds:
            if geo.rotary_dim is None:
                t["qk"] = random_orthogonal(ks[2], (n, g), dh)
            else:
                rd = geo.rotary_dim
                angles = jax.random.uniform(ks[3], (n, g, rd // 2), minval=-np.pi, maxval=np.pi)
                rot = rope_rotation(angles, dh, rd)
                if rd < dh:
                    rest = random_orthogonal(ks[4], (n, g), dh - rd)
                    rot = rot.at[..., rd:, rd:].set(rest)
                t["qk"] = rot
        if "vo" in kinds:
            t["vo"] = random_orthogonal(ks[5], (n, g), dh)
        for kind, k in (("qk_scale", ks[6]), ("vo_scale", ks[7])):
            if kind in kinds:
                t[kind] = jnp.exp(jax.random.uniform(k, (n, g), minval=-max_log_scale, maxval=max_log_scale))
        out[block.name] = t
    if "perm" in kinds:
        for group in bound.perms:
            key, k = jax.random.split(key)
            out[group.name] = _random_perms(k, (len(group.layers),), group.size)
    return out


def _random_perms(key, batch, n):
    keys = jax.random.split(key, int(np.prod(batch)) or 1)
    perms = jax.vmap(lambda k: jax.random.permutation(k, n))(keys)
    return perms.reshape(*batch, n).astype(jnp.int32)
