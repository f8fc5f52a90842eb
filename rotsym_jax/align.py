"""`align(params_a, params_b, spec)`: move B, without changing its function, close to the anchor A.

Pipeline (MATH.md §2-5): bind the spec; dispatch the permutation-group cost matrices and the
attention solves to the device (jitted, batched over layers x kv groups); run the linear
assignments on the host while the device works; apply every transform in one jitted call.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from typing import Collection

import jax
import jax.numpy as jnp
import numpy as np

from . import solvers
from .groups import (
    act_on_heads,
    apply_unchecked,
    heads_view,
    identity_transform,
    stacked,
)
from .precision import exact, exact_jit
from .pytree import flatten
from .spec import AttentionBlock, BoundSpec, Spec, SpecError, bind


ATTENTION = ("rotation", "permutation", "none")
HEADS = ("fixed", "permute")
RESCALE = ("none", "sequential", "joint")
FFN = ("permutation", "none")
# heads="permute" with GQA tries every matching of query heads inside a (B group, A group) pair
# while R! is at most this (R query heads per group: Llama-3's 4 gives 24), which makes it exact:
# once those are matched the objective splits over group pairs. Beyond, per-head scores pick the
# matching (not exact: 0.5-1.3% above brute force on small random models).
EXACT_QUERY_MATCHINGS = 24


@dataclasses.dataclass(frozen=True)
class AlignResult:
    """params: B moved to the anchor A (same function as B). transforms: what was applied, usable
    with `apply_transform`, `invert_transform`, `compose_transforms`. report: Euclidean distances
    to A before and after, in total, per kind ("qk", "vo", each permutation group, "other") and
    per layer, plus wall times in seconds: "assignment" (from the dispatch of the permutation
    cost matrices until the host has solved every assignment, on a thread pool, awaiting each
    matrix as the device delivers it), "attention" (dispatch until the attention transforms are
    ready: the device solves them while the host assigns, so it overlaps "assignment"),
    "apply", "total"."""

    params: dict
    transforms: dict
    report: dict


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}={value!r}; choose one of {choices}")


@exact
def align(
    params_a,
    params_b,
    spec: Spec,
    *,
    attention: str = "rotation",
    heads: str = "fixed",
    rescale: str = "sequential",
    ffn: str = "permutation",
    layers: Collection[int] | None = None,
    polar_method: str = solvers.DEFAULT_POLAR_METHOD,
) -> AlignResult:
    """Align model B to the anchor model A (A is returned untouched; B is moved).

    attention: "rotation" (per-head orthogonal Procrustes on QK and VO; RoPE blocks use the
        SO(2)-pair solution; GQA shares one transform per kv group), "permutation" (permute head
        dimensions only: a permutation-symmetry baseline), "none".
    heads: "fixed" (head i <-> head i) or "permute" (assign heads first: exact joint optimum over
        head permutations x rotations, MATH §4; with GQA kv groups are assigned on group scores
        after matching query heads within each candidate pair, exact up to
        EXACT_QUERY_MATCHINGS matchings per pair, by per-head scores beyond).
    rescale: "none", "sequential" (the paper's quartic after rotation), "joint" (exact one-scalar
        joint optimum, never worse than sequential; needs attention="rotation").
    ffn: "permutation" (linear assignment per permutation group and layer) or "none".
    layers: layer indices to match; the others keep identity transforms. None: all.
    """
    _check_choice("attention", attention, ATTENTION)
    _check_choice("heads", heads, HEADS)
    _check_choice("rescale", rescale, RESCALE)
    _check_choice("ffn", ffn, FFN)
    if rescale == "joint" and attention != "rotation":
        raise ValueError("rescale='joint' optimises over rotations: it needs attention='rotation'")
    timings = {}
    start = time.perf_counter()
    bound = bind(spec, params_b)
    _check_same_shapes(bind(spec, params_a), bound)
    masks = _layer_masks(bound, layers)
    flat_a, flat_b = flatten(params_a), flatten(params_b)
    # Every leaf's distance first: the report's "before", and a free test for NaN/Inf weights,
    # which must be refused before any solve (LAPACK's SVD hangs on Inf; a NaN spreads through B).
    sq_before = jax.device_get(_sq_dists(flat_a, flat_b))
    if not all(np.isfinite(v) for v in sq_before.values()):
        check_finite(params_a, "params_a (model A, the anchor)")
        check_finite(params_b, "params_b (model B)")
    transforms = identity_transform(bound)

    # Device work first (asynchronous dispatch: one cost matrix per layer, so the host can solve
    # layer l's assignment while the device computes the next ones), then the host assignments.
    t0 = time.perf_counter()
    costs = {}
    if ffn == "permutation":
        costs = {g.name: [_unit_costs(g, flat_a, flat_b, i) for i in range(len(g.layers))] for g in bound.perms}
    attention_out = {}
    if attention != "none":
        for block in bound.attention:
            leaves_a, leaves_b = _leaves(flat_a, block), _leaves(flat_b, block)
            perms = _assign_heads(block, leaves_a, leaves_b) if heads == "permute" else None
            attention_out[block.name] = _solve_block(block, leaves_a, leaves_b, perms, attention, rescale, polar_method)
    solved = iter(solvers.linear_assignments([cost for per_layer in costs.values() for cost in per_layer]))
    for name, per_layer in costs.items():
        transforms[name] = jnp.asarray(np.stack([next(solved) for _ in per_layer]), jnp.int32)
    timings["assignment"] = time.perf_counter() - t0
    blocks = {block.name: block for block in bound.attention}
    for name, out in attention_out.items():
        if attention == "permutation":
            out = _finish_dim_permutation(out, rescale, blocks[name].geometry.rotary_dim)
        transforms[name] = {**transforms[name], **jax.block_until_ready(out)}
    timings["attention"] = time.perf_counter() - t0

    transforms = _mask_layers(transforms, identity_transform(bound), masks)
    t0 = time.perf_counter()
    moved = jax.block_until_ready(apply_unchecked(bound, params_b, transforms))
    timings["apply"] = time.perf_counter() - t0
    sq_after = _sq_dists(flat_a, flatten(moved))
    before, after = (_summarise_distances(bound, sq) for sq in (sq_before, jax.device_get(sq_after)))
    report = {"before": before["total"], "after": after["total"], "layers": _merge_layers(before, after)}
    timings["total"] = time.perf_counter() - start
    report["timings"] = timings
    return AlignResult(moved, transforms, report)


# ---- validation -----------------------------------------------------------------------------------

def _check_same_shapes(bound_a: BoundSpec, bound_b: BoundSpec):
    shapes_a, shapes_b = dict(bound_a.shapes), dict(bound_b.shapes)
    if shapes_a.keys() != shapes_b.keys():
        only_a, only_b = sorted(shapes_a.keys() - shapes_b.keys()), sorted(shapes_b.keys() - shapes_a.keys())
        raise SpecError(f"params_a and params_b have different leaves: only in A {only_a[:5]}, only in B {only_b[:5]}")
    for path, shape in shapes_a.items():
        if shapes_b[path] != shape:
            raise SpecError(f"leaf {path} has shape {shape} in params_a but {shapes_b[path]} in params_b")


def check_finite(params, what: str = "params") -> None:
    """Raise ValueError naming the floating leaves of `params` that hold NaN or Inf: one
    reduction per leaf, one read back. Traced params (under jit) cannot be checked and pass."""
    flat = {p: x for p, x in flatten(params).items() if jnp.issubdtype(jnp.result_type(x), jnp.inexact)}
    if not flat or any(isinstance(x, jax.core.Tracer) for x in flat.values()):
        return
    finite = np.array(jax.device_get([_all_finite(x) for x in flat.values()]))
    if finite.all():
        return
    bad = [p for p, ok in zip(flat, finite) if not ok]
    counts = [f"{p} ({int(jnp.isnan(flat[p]).sum())} NaN, {int(jnp.isinf(flat[p]).sum())} Inf of {np.size(flat[p])})" for p in bad[:8]]
    raise ValueError(
        f"{what}: non-finite values in {len(bad)} leaves: {counts}{' ...' if len(bad) > 8 else ''}; "
        f"alignment needs finite weights"
    )


@jax.jit  # one small program per leaf shape: a model has few, so it compiles fast
def _all_finite(x):
    return jnp.all(jnp.isfinite(x))


def _layer_masks(bound: BoundSpec, layers):
    groups = bound.attention + bound.perms
    if layers is None:
        return {g.name: None for g in groups}
    if isinstance(layers, (str, bytes, int)) or not isinstance(layers, Collection):
        raise TypeError(f"layers={layers!r}; expected a collection of layer indices, e.g. [0, 3], or None for all")
    # A bool is an int to Python: [True] would silently mean layer 1.
    not_labels = [l for l in layers if isinstance(l, (bool, np.bool_)) or not isinstance(l, (int, np.integer, str))]
    if not_labels:
        raise TypeError(f"layers={layers!r}: {not_labels} are not layer indices")
    layers = {l if isinstance(l, str) else int(l) for l in layers}
    known = {l for g in groups for l in g.layers}
    unknown = sorted(layers - known, key=str)
    if unknown:
        raise ValueError(f"layers {unknown} do not exist; the spec's groups have layers {sorted(known, key=str)}")
    return {g.name: np.array([l in layers for l in g.layers]) for g in groups}


def _mask_layers(transforms, identity, masks):
    out = {}
    for name, t in transforms.items():
        mask = masks[name]
        if mask is None:
            out[name] = t
            continue

        def pick(x, i):
            m = mask.reshape((-1,) + (1,) * (x.ndim - 1))
            return jnp.where(m, x, i)

        out[name] = jax.tree_util.tree_map(pick, t, identity[name])
    return out


def _leaves(flat, group):
    return {p: flat[p] for m in group.members for p in m.paths}


# ---- permutation groups (FFN) ---------------------------------------------------------------------

def _unit_costs(group, flat_a, flat_b, i):
    """The cost matrix of layer i of a permutation group (dispatched, not awaited)."""
    axes, leaves_a, leaves_b = [], [], []
    for m in group.members:
        if m.layer_axis is None:
            axes.append(m.axis)
            leaves_a.append(flat_a[m.paths[i]])
            leaves_b.append(flat_b[m.paths[i]])
        else:  # a scanned stack: take layer i
            axes.append(m.axis - (m.axis > m.layer_axis))
            leaves_a.append(jnp.take(flat_a[m.paths[0]], i, axis=m.layer_axis))
            leaves_b.append(jnp.take(flat_b[m.paths[0]], i, axis=m.layer_axis))
    return _layer_costs(tuple(axes), tuple(leaves_a), tuple(leaves_b))


@functools.partial(exact_jit, static_argnums=0)
def _layer_costs(axes, leaves_a, leaves_b):
    """C[i, j] = sum over member leaves of <B unit i, A unit j> (MATH §5), float32."""
    cost = 0.0
    for axis, xa, xb in zip(axes, leaves_a, leaves_b):
        n = xa.shape[axis]
        xa = jnp.moveaxis(jnp.asarray(xa, jnp.float32), axis, 0).reshape(n, -1)
        xb = jnp.moveaxis(jnp.asarray(xb, jnp.float32), axis, 0).reshape(n, -1)
        cost = cost + jnp.matmul(xb, xa.T)
    return cost


# ---- attention ------------------------------------------------------------------------------------

def _role_views(block: AttentionBlock, flat):
    """{role: (L, rows, G, R, dh) float32}, each role's members concatenated along rows:
    the kernel rows and the bias row of q/k/v (MATH's [W; b]), W_o^T for o."""
    views = {}
    for role in ("q", "k", "v", "o"):
        parts = [stacked(flat, m, jnp.float32) for m in block.members if m.role == role]
        views[role] = heads_view(jnp.concatenate(parts, axis=1), block, role)
    return views


def _cross(xb, xa):
    """Per kv group: sum over rows and the group's query heads of xb^T xa -> (L, G, dh, dh)."""
    return jnp.einsum("lngrd,lngre->lgde", xb, xa)


def _cross_from_leaves(block: AttentionBlock, leaves_a, leaves_b):
    """Per role: cross matrices (L, G, dh, dh) and B's squared norms (L, G), layer by layer, each
    leaf read in its own layout (see `_leaf_cross`). Unrolled over layers under jit on purpose:
    stacking the layers for a vmap copies every leaf (measured: bert-large solve 1.64 s stacked,
    0.73 s per layer)."""
    cross, sq = {}, {}
    for role in ("q", "k", "v", "o"):
        g, r, dh = block.geometry.role_shape(role)
        ms, ss = [], []
        for layer in range(len(block.layers)):
            m_sum, s_sum = 0.0, 0.0
            for member in (m for m in block.members if m.role == role):
                axis = member.axis if member.layer_axis is None else member.axis - (member.axis > member.layer_axis)
                xa, xb = (_layer_leaf(leaves, member, layer) for leaves in (leaves_a, leaves_b))
                s_sum = s_sum + jnp.sum(jnp.square(xb), axis=tuple(i for i in range(xb.ndim) if i != axis))
                m_sum = m_sum + _leaf_cross(xa, xb, axis, g, r, dh)
            ms.append(m_sum)
            ss.append(s_sum.reshape(g, r * dh).sum(-1))
        cross[role], sq[role] = jnp.stack(ms), jnp.stack(ss)
    return cross, sq


def _leaf_cross(xa, xb, axis, g, r, dh):
    """sum over the leaf's other axes and the R query heads of a group of xb^T xa per head:
    (G, dh, dh), for a leaf whose tagged axis `axis` holds (G, R, dh).

    XLA:CPU's dot wants the batch (head) axis major, so an einsum first transposes a leaf with
    the heads on its last axis (Q/K/V kernels). Written as a broadcast product summed over the
    leading rows axis, its ynn fusion reads both leaves in place instead: 2x faster (roberta-base
    Q, 12 layers: 15 vs 33 ms). The pattern must stay exactly (rows, heads, dh, dh) reduced over
    axis 0 (an extra size-1 axis falls back to a reduction loop, 200x slower)."""
    if axis == xa.ndim - 1 and xa.ndim > 1 and jax.default_backend() == "cpu":
        hb, ha = xb.reshape(-1, g * r, dh, 1), xa.reshape(-1, g * r, 1, dh)
        return jnp.sum(hb * ha, axis=0).reshape(g, r, dh, dh).sum(1)
    xa, xb = (jnp.moveaxis(x, axis, 0).reshape(g, r, dh, -1) for x in (xa, xb))  # free for O kernels, biases
    return jnp.einsum("grxn,gryn->grxy", xb, xa).sum(1)


def _layer_leaf(leaves, member, layer):
    if member.layer_axis is None:
        return jnp.asarray(leaves[member.paths[layer]], jnp.float32)
    return jnp.take(jnp.asarray(leaves[member.paths[0]], jnp.float32), layer, axis=member.layer_axis)


def _sq(x):
    return jnp.sum(x * x, axis=(1, 3, 4))


def _trace_rt(r, m):
    return jnp.einsum("...ij,...ij->...", r, m)


@functools.partial(exact_jit, static_argnums=(0, 4, 5, 6))
def _solve_block(block: AttentionBlock, leaves_a, leaves_b, perms, attention, rescale, polar_method):
    """QK and VO transforms of one attention block, batched over layers x kv groups. Building
    the views inside the jitted call lets XLA fuse the stacking into the cross products.

    With attention="permutation" the result holds the cross matrices; the host finishes it."""
    if perms is None:
        cross, sq = _cross_from_leaves(block, leaves_a, leaves_b)
    else:  # heads assigned first: solve in B's permuted frame
        xa, xb = _role_views(block, leaves_a), _role_views(block, leaves_b)
        t = {**perms, **_identity_rot(block)}
        xb = {role: act_on_heads(x, t, role) for role, x in xb.items()}
        cross = {role: _cross(xb[role], xa[role]) for role in xa}
        sq = {role: _sq(xb[role]) for role in xb}
    out = dict(perms or {})
    if attention == "permutation":
        for pair, a_side, b_side in PAIRS:
            out[f"{pair}_cross"] = (cross[a_side], cross[b_side], sq[a_side], sq[b_side])
        return out
    # QK and VO stacked on axis -3, solved together: one projection (one polar call) and one
    # rescale, so the program holds a single chain of LAPACK calls (see solvers.DEFAULT_POLAR_METHOD).
    ma, mb = (jnp.stack([cross[p[i]] for p in PAIRS], axis=-3) for i in (1, 2))
    s_aa, s_bb = (jnp.stack([sq[p[i]] for p in PAIRS], axis=-1) for i in (1, 2))
    project = _projector(block.geometry.rotary_dim, polar_method)
    if rescale == "joint":
        scale, rot = solvers.rescale_joint(ma, mb, s_aa, s_bb, project=project)
    else:
        rot = project(ma + mb)
        scale = _sequential_scale(rot, ma, mb, s_aa, s_bb) if rescale == "sequential" else jnp.ones_like(s_aa)
    for i, (pair, _, _) in enumerate(PAIRS):
        out[pair], out[f"{pair}_scale"] = rot[..., i, :, :], scale[..., i]
    return out


PAIRS = (("qk", "q", "k"), ("vo", "v", "o"))


def _projector(rotary_dim, polar_method):
    """QK (RoPE group when rotary) and VO stacked on axis -3, by one `solvers.polar_stack` call."""
    return functools.partial(solvers.polar_stack, rotary_dims=(rotary_dim, None), method=polar_method)


def _sequential_scale(rot, ma, mb, s_aa, s_bb):
    return solvers.rescale_sequential(s_aa, _trace_rt(rot, ma), s_bb, _trace_rt(rot, mb))


def _identity_rot(block: AttentionBlock):
    g, _, dh = block.geometry.role_shape("q")
    n = len(block.layers)
    eye = jnp.broadcast_to(jnp.eye(dh, dtype=jnp.float32), (n, g, dh, dh))
    ones = jnp.ones((n, g), jnp.float32)
    return {"qk": eye, "vo": eye, "qk_scale": ones, "vo_scale": ones}


def _finish_dim_permutation(out, rescale, rotary_dim):
    """Permutation baseline: each head's dims permuted by a linear assignment on M (host).
    With RoPE no permutation of the rotary dims of Q/K commutes with the position rotations
    (every pair has its own frequency), so there only the dims past `rotary_dim` are permuted."""
    result = {k: v for k, v in out.items() if not k.endswith("_cross")}
    ma, mb, s_aa, s_bb = (np.stack([np.asarray(out[f"{pair}_cross"][i]) for pair, _, _ in PAIRS], axis=-3 if i < 2 else -1) for i in range(4))
    scores, dh = ma + mb, ma.shape[-1]
    if not rotary_dim:
        perm = solvers.batched_linear_assignment(scores)  # (L, G, 2, dh): new dim j is old dim perm[j]
    else:  # QK: the rotary dims stay, the rest is assigned
        perm = np.broadcast_to(np.arange(dh, dtype=np.int32), scores.shape[:-1]).copy()
        perm[..., 1, :] = solvers.batched_linear_assignment(scores[..., 1, :, :])
        if rotary_dim < dh:
            perm[..., 0, rotary_dim:] = rotary_dim + solvers.batched_linear_assignment(scores[..., 0, rotary_dim:, rotary_dim:])
    rot = np.zeros(perm.shape + (dh,), np.float32)
    np.put_along_axis(rot, perm[..., None, :], 1.0, axis=-2)  # x @ rot picks column perm[j]
    rot = jnp.asarray(rot)
    scale = jnp.ones(s_aa.shape, jnp.float32)
    if rescale == "sequential":  # both pairs in one call (see solvers.DEFAULT_POLAR_METHOD)
        scale = _sequential_scale(rot, jnp.asarray(ma), jnp.asarray(mb), jnp.asarray(s_aa), jnp.asarray(s_bb))
    for i, (pair, _, _) in enumerate(PAIRS):
        result[pair], result[f"{pair}_scale"] = rot[..., i, :, :], scale[..., i]
    return result


@functools.partial(exact_jit, static_argnums=0)
def _pair_cross(block: AttentionBlock, leaves_a, leaves_b):
    """Cross matrices between every B head and every A head (all pairs at once)."""
    xa, xb = _role_views(block, leaves_a), _role_views(block, leaves_b)
    q = jnp.einsum("lngrd,lnhse->lgrhsde", xb["q"], xa["q"])  # (L, G, R, G, R, dh, dh)
    o = jnp.einsum("lngrd,lnhse->lgrhsde", xb["o"], xa["o"])
    k = jnp.einsum("lngd,lnhe->lghde", xb["k"][:, :, :, 0], xa["k"][:, :, :, 0])  # (L, G, G, dh, dh)
    v = jnp.einsum("lngd,lnhe->lghde", xb["v"][:, :, :, 0], xa["v"][:, :, :, 0])
    return q, k, v, o


@functools.partial(exact_jit, static_argnames=("rotary_dim",))
def _inner_scores(q, k, v, o, rotary_dim):
    """Score of query head (i, r) of B against (j, s) of A, sharing the group's k/v part."""
    r = q.shape[2]
    qk = q + k[:, :, None, :, None] / r
    vo = o + v[:, :, None, :, None] / r
    return _head_scores(qk, vo, rotary_dim)  # (L, G, R, G, R)


@functools.partial(exact_jit, static_argnames=("rotary_dim",))
def _group_scores(q, k, v, o, sigma, rotary_dim):
    """Group-pair scores, query heads matched by sigma[l, i, j, s] (the B slot of A slot s)."""

    def matched(x):  # x[l, i, sigma[l, i, j, s], j, s], summed over s
        x = x.transpose(0, 1, 3, 4, 2, 5, 6)  # (L, G_B, G_A, R_A, R_B, dh, dh)
        return jnp.take_along_axis(x, sigma[..., None, None, None], axis=4)[:, :, :, :, 0].sum(axis=3)

    return _head_scores(matched(q) + k, matched(o) + v, rotary_dim)  # (L, G_B, G_A)


@functools.partial(exact_jit, static_argnames=("rotary_dim",))
def _best_query_matching(q, k, v, o, candidates, rotary_dim):
    """The best of the candidate query-head matchings (C, R) for every group pair, one candidate
    at a time (memory stays that of one): (L, G_B, G_A, R_A) matchings and their scores.
    Ties go to the earlier candidate (the identity first)."""
    n, g = q.shape[:2]
    scores = jax.lax.map(lambda perm: _group_scores(q, k, v, o, jnp.broadcast_to(perm, (n, g, g, perm.shape[0])), rotary_dim), candidates)
    best = jnp.argmax(scores, axis=0)
    return candidates[best], jnp.max(scores, axis=0)


@functools.partial(exact_jit, static_argnames=("rotary_dim",))
def _head_scores(qk, vo, rotary_dim):
    """max tr(R^T qk) + max tr(S^T vo) over orthogonal S and R, R within the RoPE group on rotary
    models (MATH §1-2): there QK scores the length of (M_ii + M_jj, M_ij - M_ji) per rotary pair
    plus the nuclear norm of the non-rotary block. Both nuclear norms by one SVD call (two could
    run at once: see solvers.DEFAULT_POLAR_METHOD)."""
    pairs = 0.0
    if rotary_dim:
        pairs = jnp.sum(jnp.hypot(*solvers._rope_pair_terms(qk, rotary_dim)), axis=-1)
        qk = qk.at[..., :rotary_dim, :].set(0).at[..., :, :rotary_dim].set(0)  # the rest, zero-padded
    n = solvers.nuclear_norm(jnp.stack([qk, vo]))
    return pairs + n[0] + n[1]


def _assign_heads(block: AttentionBlock, leaves_a, leaves_b):
    """Head permutations (MATH §4). Multi-head: one assignment on the H x H scores, exact.
    GQA: query heads within each candidate (B group, A group) pair first (every matching while
    there are at most EXACT_QUERY_MATCHINGS: exact), then the groups."""
    geo = block.geometry
    n, g = len(block.layers), geo.num_kv_heads
    q, k, v, o = _pair_cross(block, leaves_a, leaves_b)
    if geo.heads_per_group == 1:
        scores = _head_scores(q[:, :, 0, :, 0] + k, o[:, :, 0, :, 0] + v, geo.rotary_dim)
        group_perm = solvers.batched_linear_assignment(np.asarray(scores))
        head_perm = np.zeros((n, g, 1), np.int32)
    else:
        sigma, outer = _query_matchings(q, k, v, o, geo)
        group_perm = solvers.batched_linear_assignment(outer)  # (L, G_A): A group j <- B group p[j]
        head_perm = sigma[np.arange(n)[:, None], group_perm, np.arange(g)[None, :]]  # (L, G, R)
    return {"group_perm": jnp.asarray(group_perm, jnp.int32), "head_perm": jnp.asarray(head_perm, jnp.int32)}


def _query_matchings(q, k, v, o, geo):
    """GQA: for every (B group, A group) pair, the matching of query heads (L, G_B, G_A, R_A) and
    the pair's score: the best of every matching while there are at most EXACT_QUERY_MATCHINGS,
    else a linear assignment on per-head scores."""
    r, rd = geo.heads_per_group, geo.rotary_dim
    if math.factorial(r) <= EXACT_QUERY_MATCHINGS:
        candidates = jnp.asarray(list(itertools.permutations(range(r))), jnp.int32)
        return tuple(np.asarray(x) for x in _best_query_matching(q, k, v, o, candidates, rd))
    inner = np.asarray(_inner_scores(q, k, v, o, rd))  # (L, G_B, R_B, G_A, R_A)
    sigma = solvers.batched_linear_assignment(inner.transpose(0, 1, 3, 2, 4))  # (L, G_B, G_A, R_A)
    return sigma, np.asarray(_group_scores(q, k, v, o, jnp.asarray(sigma), rd))


# ---- distances ------------------------------------------------------------------------------------

@exact_jit
def _sq_dists(leaves_a, leaves_b):
    return {p: jnp.sum(jnp.square(jnp.asarray(leaves_a[p], jnp.float32) - jnp.asarray(leaves_b[p], jnp.float32))) for p in leaves_a}


@exact
def distance_report(spec_or_bound, params_a, params_b) -> dict:
    """Euclidean distances ||A - B||: {"total": {kind: d, "total": d}, "layers": {layer: {...}}}.

    Kinds: "qk" (Q and K leaves), "vo" (V and O leaves), each permutation group (e.g. "ffn"), and
    "other" (everything else, the O bias included)."""
    bound = spec_or_bound if isinstance(spec_or_bound, BoundSpec) else bind(spec_or_bound, params_b)
    return _summarise_distances(bound, jax.device_get(_sq_dists(flatten(params_a), flatten(params_b))))


def _summarise_distances(bound: BoundSpec, sq: dict) -> dict:
    """`distance_report`'s dict from the squared distance of every leaf (host values)."""
    sq = {p: float(v) for p, v in sq.items()}
    kinds, layer_of = dict(bound.kinds), dict(bound.leaf_layers)
    total: dict[str, float] = {}
    per_layer: dict = {}
    for path, value in sq.items():
        kind = kinds[path]
        total[kind] = total.get(kind, 0.0) + value
        layer = layer_of[path]
        if layer is not None:
            per_layer.setdefault(layer, {})
            per_layer[layer][kind] = per_layer[layer].get(kind, 0.0) + value
    root = lambda d: {**{k: float(np.sqrt(v)) for k, v in d.items()}, "total": float(np.sqrt(sum(d.values())))}
    return {"total": root(total), "layers": {l: root(d) for l, d in per_layer.items()}}


def _merge_layers(before, after):
    return {l: {"before": before["layers"][l], "after": after["layers"][l]} for l in before["layers"]}
