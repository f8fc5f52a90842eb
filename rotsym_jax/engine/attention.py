"""The attention solve (MATH.md §1-4), internal to `align` and documented for tests and benchmarks:
cross products of every role's leaves (a program per layer), the batched QK/VO Procrustes with
rescaling (one jitted program per block), the head-dimension permutation baseline, and the head matching.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp

from ..precision import exact_jit
from ..solvers import assignment, procrustes, stretch
from ..solvers.rescale import rescale_joint, rescale_sequential
from ..spec import GAIN_ROLES, ROPE_KEY_ROLE, ROPE_QUERY_ROLE, AttentionBlock, signs_only
from ..transforms import HeadTransform, rope_order, shared_rope_rotation
from .groups import heads_view, is_scanned, layer_template, stacked, template_leaves

# heads="permute" with GQA tries every matching of query heads inside a (B group, A group) pair
# while R! is at most this (R query heads per group: Llama-3's 4 gives 24), which makes it exact:
# once those are matched the objective splits over group pairs. Beyond, per-head scores pick the
# matching (not exact: 0.5-1.3% above brute force on small random models).
EXACT_QUERY_MATCHINGS = 24

def block_leaves(flat, group):
    return {p: flat[p] for m in group.members for p in m.paths}


def role_views(block: AttentionBlock, flat):
    """{role: (L, rows, G, R, dh) float32}, each role's members concatenated along rows:
    the kernel rows and the bias row of q/k/v (MATH's [W; b]), W_o^T for o."""
    views = {}
    for role in ("q", "k", "v", "o"):
        parts = [stacked(flat, m, jnp.float32) for m in block.members if m.role == role]
        views[role] = heads_view(jnp.concatenate(parts, axis=1), block, role)
    return views


def group_cross(xb, xa):
    """Per kv group: sum over rows and the group's query heads of xb^T xa -> (L, G, dh, dh)."""
    return jnp.einsum("lngrd,lngre->lgde", xb, xa)


def cross_from_leaves(block: AttentionBlock, leaves_a, leaves_b, grams: bool = False):
    """Per role: cross matrices (L, G, dh, dh) and B's squared norms (L, G), layer by layer, each
    leaf read in its own layout (see `_leaf_cross`), and B's Gram matrices (L, G, dh, dh) with
    `grams` (None without). `layer_crosses` calls it on one layer at a time; a scanned block's layers
    are unrolled here. Never stacked for a vmap: that copies every leaf (RESULTS.md, "Engine
    choices, measured")."""
    cross, sq, gram = {}, {}, {}
    for role in ("q", "k", "v", "o"):
        g, r, dh = block.geometry.role_shape(role)
        ms, ss, gs = [], [], []
        for layer in range(len(block.layers)):
            m_sum, s_sum, g_sum = 0.0, 0.0, 0.0
            for member in (m for m in block.members if m.role == role):
                axis = member.axis if member.layer_axis is None else member.axis - (member.axis > member.layer_axis)
                xa, xb = (_layer_leaf(leaves, member, layer) for leaves in (leaves_a, leaves_b))
                s_sum = s_sum + jnp.sum(jnp.square(xb), axis=tuple(i for i in range(xb.ndim) if i != axis))
                m_sum = m_sum + _leaf_cross(xa, xb, axis, g, r, dh)
                if grams:
                    g_sum = g_sum + _leaf_cross(xb, xb, axis, g, r, dh)
            ms.append(m_sum)
            ss.append(s_sum.reshape(g, r * dh).sum(-1))
            gs.append(g_sum)
        cross[role], sq[role], gram[role] = jnp.stack(ms), jnp.stack(ss), jnp.stack(gs) if grams else None
    return cross, sq, gram


def _leaf_cross(xa, xb, axis, g, r, dh):
    """sum over the leaf's other axes and the R query heads of a group of xb^T xa per head:
    (G, dh, dh), for a leaf whose tagged axis `axis` holds (G, R, dh).

    XLA:CPU's dot wants the batch (head) axis major, so an einsum first transposes a leaf with
    the heads on its last axis (Q/K/V kernels); a broadcast product summed over the leading rows
    axis reads both leaves in place instead. The pattern must stay exactly (rows, heads, dh, dh)
    reduced over axis 0: anything else falls back to a slow reduction loop."""
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


def stacked_cross(block: AttentionBlock, leaves_a, leaves_b, perms, grams: bool = False):
    """QK and VO cross matrices stacked on axis -3 (L, G, 2, dh, dh), A's and B's sides, and the
    squared norms (L, G, 2); in B's head-permuted frame when `perms` is given. With `grams` (the
    invertible maps' distance needs them), B's Gram matrices of the two sides too, stacked as the
    crosses. Where V/O's width differs from Q/K's (`HeadGeometry.value_dim`): {"qk": .., "vo": ..},
    each such a tuple of one pair ((L, G, 1, dh, dh) and (L, G, 1, dv, dv)), solved as two stacks
    (`pair_stacks`)."""
    if perms is None:
        cross, sq, gram = cross_from_leaves(block, leaves_a, leaves_b, grams)
    else:
        xa, xb = role_views(block, leaves_a), role_views(block, leaves_b)
        t = HeadTransform.identity(block).replace(**perms)
        xb = {role: t.act(x, role) for role, x in xb.items()}
        cross = {role: group_cross(xb[role], xa[role]) for role in xa}
        sq = {role: _sq(xb[role]) for role in xb}
        gram = {role: group_cross(x, x) for role, x in xb.items()} if grams else None
    if block.geometry.split_widths:
        return {pair: _stack(cross, sq, gram, (p,), grams) for p in PAIRS for pair in p[:1]}
    return _stack(cross, sq, gram, PAIRS, grams)


def _stack(cross, sq, gram, pairs, grams):
    ma, mb = (jnp.stack([cross[p[i]] for p in pairs], axis=-3) for i in (1, 2))
    s_aa, s_bb = (jnp.stack([sq[p[i]] for p in pairs], axis=-1) for i in (1, 2))
    if not grams:
        return ma, mb, s_aa, s_bb
    return ma, mb, s_aa, s_bb, *(jnp.stack([gram[p[i]] for p in pairs], axis=-3) for i in (1, 2))


def pair_stacks(parts) -> list:
    """[(pair names, parts)] of `layer_crosses` parts: one stack of both pairs, or where V/O's
    width differs from Q/K's one stack each (("qk",), ...), (("vo",), ...)."""
    if isinstance(parts[0], dict):
        return [((name,), [part[name] for part in parts]) for name in PAIR_NAMES]
    return [(PAIR_NAMES, parts)]


block_cross = functools.partial(exact_jit, static_argnums=(0, 4))(stacked_cross)


def layer_crosses(block: AttentionBlock, leaves_a, leaves_b, perms, grams: bool = False) -> list:
    """`stacked_cross` of every layer, dispatched: a list of parts along the layer axis, one per
    layer, by one program that every layer shares (`groups.layer_template`; XLA compiles in time
    proportional to a program's leaves); a block with a scanned member (every layer in one leaf)
    gives one part."""
    if is_scanned(block):
        return [block_cross(block, leaves_a, leaves_b, perms, grams)]
    template = layer_template(block)
    return [_layer_cross(template, template_leaves(block, leaves_a, i), template_leaves(block, leaves_b, i), perms, i, grams)
            for i in range(len(block.layers))]


@functools.partial(exact_jit, static_argnums=(0, 5))
def _layer_cross(template: AttentionBlock, leaves_a, leaves_b, perms, layer, grams):
    if perms is not None:
        perms = {k: jax.lax.dynamic_index_in_dim(v, layer, keepdims=True) for k, v in perms.items()}
    return stacked_cross(template, leaves_a, leaves_b, perms, grams)


@functools.partial(exact_jit, static_argnums=0)
def gain_terms(block: AttentionBlock, leaves_a, leaves_b, perms):
    """A full-width QK-norm's QK scale acts on the norm's gains (MATH §1): per layer and kv group,
    its objective's terms (|g_q^B|^2, <g_q^B, g_q^A>, |g_k^B|^2, <g_k^B, g_k^A>), B's heads
    permuted by `perms` (None: as they are); (L, G, 4)."""
    t = HeadTransform.identity(block)
    t = t if perms is None else t.replace(**perms)
    terms = []
    for role in GAIN_ROLES:
        xa, xb = (heads_view(jnp.concatenate([stacked(flat, m, jnp.float32) for m in block.members if m.role == role], axis=1), block, role)
                  for flat in (leaves_a, leaves_b))
        xb = t.act(xb, role)  # the permutations (scales are 1 here)
        terms += [jnp.sum(xb * xb, axis=(1, 3, 4)), jnp.sum(xb * xa, axis=(1, 3, 4))]
    return jnp.stack(terms, axis=-1)


def gain_scale(terms):
    """The QK scales (L, G) that `gain_terms` determine: the sequential rescale's quartic."""
    return rescale_sequential(*(terms[..., i] for i in range(4)))


def concat_crosses(parts) -> tuple | dict:
    """`layer_crosses` parts as one `stacked_cross` over all layers."""
    if isinstance(parts[0], dict):
        return {name: concat_crosses([part[name] for part in parts]) for name in parts[0]}
    return tuple(jnp.concatenate([part[i] for part in parts]) for i in range(len(parts[0])))


def solve_block(block: AttentionBlock, leaves_a, leaves_b, perms, rescale, polar_method):
    """QK and VO rotations and scales of one attention block (and the head permutations it was
    given), batched over layers x kv groups: the cross products layer by layer
    (`layer_crosses`), then one program solves every layer. QK and VO are solved together: one
    projection and one rescale, a single chain of LAPACK calls (see
    `solvers.procrustes`)."""
    geo = block.geometry
    return solve_crossed(layer_crosses(block, leaves_a, leaves_b, perms), geo.rotary_dim, perms, rescale, polar_method, geo.qk_norm,
                         geo.gated_output)


def solve_cross(parts, rotary_dim, perms, rescale, polar_method, qk_norm=False, gated=False, pairs=None):
    """`solve_block` from the parts of `layer_crosses` (the streaming path gathers them chunk by
    chunk) of one stack (`pair_stacks`), the pairs `pairs` (None: both) on its axis -3: every
    layer in one batch (the polar iteration picks one branch per batch). `gated`: the heads'
    outputs are gated entry by entry, VO's maps are sign flips of each entry."""
    pairs = PAIR_NAMES if pairs is None else pairs
    ma, mb, s_aa, s_bb = concat_crosses(parts)[:4]
    project = projector(rotary_dim, polar_method, qk_norm, gated, pairs)
    qk = pairs.index("qk") if "qk" in pairs else None
    qk_norm = qk_norm if qk is not None else False  # a stack of VO alone: no QK-norm reaches it
    if rescale == "joint":
        scale, rot = rescale_joint(ma, mb, s_aa, s_bb, project=project)
    else:
        rot = project(ma + mb)
        scale = sequential_scale(rot, ma, mb, s_aa, s_bb) if rescale == "sequential" else jnp.ones_like(s_aa)
    if qk_norm and rescale == "joint":  # no QK scale on the kernels under QK-norm (MATH §1): the signs (rotations, without gains) at a = 1
        rot = rot.at[..., qk, :, :].set(project(ma + mb)[..., qk, :, :])
    if qk_norm:
        scale = scale.at[..., qk].set(1.0)
    out = dict(perms or {})
    for i, pair in enumerate(pairs):
        out[pair], out[f"{pair}_scale"] = rot[..., i, :, :], scale[..., i]
    return out


_solve_stack = functools.partial(exact_jit, static_argnums=(1, 3, 4, 5, 6, 7))(solve_cross)


def solve_crossed(parts, rotary_dim, perms, rescale, polar_method, qk_norm=False, gated=False) -> dict:
    """`solve_cross` of every stack of `parts` (`pair_stacks`), one program each: where V/O's
    width differs from Q/K's, VO's after QK's (its input waits on QK's result: two chains of
    LAPACK calls at once can deadlock XLA:CPU, see `solvers.procrustes`)."""
    out = {}
    for pairs, stack in pair_stacks(parts):
        if out:
            stack = jax.lax.optimization_barrier((out, stack))[1]
        out.update(_solve_stack(stack, rotary_dim, perms, rescale, polar_method, qk_norm, gated, None if pairs == PAIR_NAMES else pairs))
    return out


def invertible_maps(solved: dict, parts, rotary_dim, qk_norm, gated=False) -> dict:
    """The closed form's QK and VO elements (`solve_cross`'s) made invertible maps (MATH §14):
    from each rotation times its scale, the map that minimises the weight distance
    (`stretch.fit_maps`, from B's Grams in `parts`, which `layer_crosses(..., grams=True)` gave).
    Under a QK-norm the QK element stays as it is (sign flips only), under a gate on the heads'
    outputs the VO element."""
    out = dict(solved)
    for pairs, stack in pair_stacks(parts):
        ma, mb, _, _, ga, gb = concat_crosses(stack)
        for i, pair in enumerate(pairs):
            if pair == "qk" and qk_norm or pair == "vo" and gated:
                continue
            rotation, scale = solved[pair], solved[f"{pair}_scale"][..., None, None]
            maps, inverse_transposed = stretch.fit_maps(rotation * scale, rotation / scale, (ma[..., i, :, :], mb[..., i, :, :]),
                                                        (ga[..., i, :, :], gb[..., i, :, :]), rotary_dim if pair == "qk" else None)
            out.update({pair: maps, f"{pair}_inv": inverse_transposed, f"{pair}_scale": jnp.ones_like(solved[f"{pair}_scale"])})
    return out
PAIRS = (("qk", "q", "k"), ("vo", "v", "o"))
PAIR_NAMES = tuple(p[0] for p in PAIRS)


def projector(rotary_dim, polar_method, qk_norm=False, gated=False, pairs=PAIR_NAMES):
    """QK (RoPE group when rotary; sign flips under a QK-norm with gains) and VO (sign flips of each
    entry under a gate on the heads' outputs), those of `pairs`, stacked on axis -3, by one
    `procrustes.polar_stack` call."""
    rotary, signs = {"qk": rotary_dim, "vo": None}, {"qk": signs_only(qk_norm), "vo": bool(gated)}
    return procrustes.StackedPolar(tuple(rotary[p] for p in pairs), polar_method, tuple(signs[p] for p in pairs))


def sequential_scale(rot, ma, mb, s_aa, s_bb):
    return rescale_sequential(s_aa, _trace_rt(rot, ma), s_bb, _trace_rt(rot, mb))


def finish_dim_permutation(cross, rescale, rotary_dim, qk_norm=False, gated=False):
    """`_finish_stack` of each stack of `cross` (`concat_crosses`; `pair_stacks`)."""
    if not isinstance(cross, dict):
        return _finish_stack(cross, rescale, rotary_dim, qk_norm, gated)
    out = {}
    for name, stack in cross.items():
        out.update(_finish_stack(stack, rescale, rotary_dim, qk_norm, gated, (name,)))
    return out


def _dim_perm(scores, pair, rotary_dim, qk_norm, gated):
    """One pair's dimension permutation (..., d) from its scores (..., d, d), as `_finish_stack`'s."""
    keep = jnp.broadcast_to(jnp.arange(scores.shape[-1], dtype=jnp.int32), scores.shape[:-1])
    if pair == "vo":
        return keep if gated else assignment.assign(scores, traced_nonfinite="identity")
    if signs_only(qk_norm):
        return keep
    if not rotary_dim:
        return assignment.assign(scores, traced_nonfinite="identity")
    if rotary_dim < scores.shape[-1]:
        return keep.at[..., rotary_dim:].set(rotary_dim + assignment.assign(scores[..., rotary_dim:, rotary_dim:], traced_nonfinite="identity"))
    return keep


def _finish_stack(cross, rescale, rotary_dim, qk_norm=False, gated=False, pairs=PAIR_NAMES):
    """Permutation baseline: each head's dims permuted by a linear assignment on M (host).
    With RoPE no permutation of the rotary dims of Q/K commutes with the position rotations
    (every pair has its own frequency), so there only the dims past `rotary_dim` are permuted;
    under a QK-norm with a gain per dim none of Q/K's (one without weights keeps every permutation
    RoPE does); under a gate on the heads' outputs (`gated`) none of V/O's (the gate's rows would
    have to follow, which the element does not hold). Traceable: the assignments go through
    `assignment.assign`."""
    ma, mb, s_aa, s_bb = cross
    scores, dh = ma + mb, ma.shape[-1]
    if pairs != PAIR_NAMES:  # one pair of its own width (`HeadGeometry.value_dim`)
        perm = jnp.stack([_dim_perm(scores[..., i, :, :], pair, rotary_dim, qk_norm, gated) for i, pair in enumerate(pairs)], axis=-2)
    elif signs_only(qk_norm):
        perm = jnp.broadcast_to(jnp.arange(dh, dtype=jnp.int32), scores.shape[:-1])
        perm = perm.at[..., 1, :].set(assignment.assign(scores[..., 1, :, :], traced_nonfinite="identity"))
    elif not rotary_dim:
        perm = assignment.assign(scores, traced_nonfinite="identity")  # (L, G, 2, dh): new dim j is old dim perm[j]
    else:  # QK: the rotary dims stay, the rest is assigned
        perm = jnp.broadcast_to(jnp.arange(dh, dtype=jnp.int32), scores.shape[:-1])
        perm = perm.at[..., 1, :].set(assignment.assign(scores[..., 1, :, :], traced_nonfinite="identity"))
        if rotary_dim < dh:
            perm = perm.at[..., 0, rotary_dim:].set(rotary_dim + assignment.assign(scores[..., 0, rotary_dim:, rotary_dim:], traced_nonfinite="identity"))
    if gated and pairs == PAIR_NAMES:
        perm = perm.at[..., 1, :].set(jnp.arange(dh, dtype=perm.dtype))
    rot = jax.nn.one_hot(perm, dh, dtype=jnp.float32, axis=-2)  # rot[..., perm[j], j] = 1: x @ rot picks column perm[j]
    scale = jnp.ones(jnp.shape(s_aa), jnp.float32)
    if rescale == "sequential":  # both pairs in one call (see `solvers.procrustes`)
        scale = sequential_scale(rot, ma, mb, s_aa, s_bb)
        if qk_norm and "qk" in pairs:  # no QK scale on the kernels under QK-norm (a full-width one's gains take it: driver)
            scale = scale.at[..., pairs.index("qk")].set(1.0)
    result = {}
    for i, pair in enumerate(pairs):
        result[pair], result[f"{pair}_scale"] = rot[..., i, :, :], scale[..., i]
    return result


@functools.partial(exact_jit, static_argnums=0)
def pair_cross(block: AttentionBlock, leaves_a, leaves_b):
    """Cross matrices between every B head and every A head (all pairs at once)."""
    xa, xb = role_views(block, leaves_a), role_views(block, leaves_b)
    q = jnp.einsum("lngrd,lnhse->lgrhsde", xb["q"], xa["q"])  # (L, G, R, G, R, dh, dh)
    o = jnp.einsum("lngrd,lnhse->lgrhsde", xb["o"], xa["o"])
    k = jnp.einsum("lngd,lnhe->lghde", xb["k"][:, :, :, 0], xa["k"][:, :, :, 0])  # (L, G, G, dh, dh)
    v = jnp.einsum("lngd,lnhe->lghde", xb["v"][:, :, :, 0], xa["v"][:, :, :, 0])
    return q, k, v, o


def rope_crosses(block: AttentionBlock, leaves_a, leaves_b, perms) -> list:
    """Each layer's (1, r, r) cross product of a RoPE key every head shares (role kr) and of every
    head's RoPE query (role qr), B's heads permuted by `perms` first: sum of x_B^T x_A over rows
    and heads, one program that every layer shares (a scanned block: one part)."""
    if is_scanned(block):
        return [_rope_cross(block, leaves_a, leaves_b, perms, None)]
    template = layer_template(block)
    return [_rope_cross(template, template_leaves(block, leaves_a, i), template_leaves(block, leaves_b, i), perms, i)
            for i in range(len(block.layers))]


@functools.partial(exact_jit, static_argnums=0)
def _rope_cross(block: AttentionBlock, leaves_a, leaves_b, perms, layer):
    if perms is not None and layer is not None:
        perms = {k: jax.lax.dynamic_index_in_dim(v, layer, keepdims=True) for k, v in perms.items()}
    t = HeadTransform.identity(block)
    t = t if perms is None else t.replace(**perms)
    total = 0.0
    for role in (ROPE_QUERY_ROLE, ROPE_KEY_ROLE):
        xa, xb = (heads_view(jnp.concatenate([stacked(flat, m, jnp.float32) for m in block.members if m.role == role], axis=1), block, role)
                  for flat in (leaves_a, leaves_b))
        total = total + jnp.einsum("lngrd,lngre->lde", t.act(xb, role), xa)  # the permutations (the rotation is the identity here)
    return total


@functools.partial(exact_jit, static_argnums=1)
def rope_key_rotation(cross, geometry):
    """The rotation per rotary pair of the shared RoPE key (L, r, r) that maximises tr(R^T M) for the
    crosses M (`rope_crosses`, concatenated): per pair (a, b), the angle of (M_aa + M_bb, M_ab - M_ba)
    (no pair term: no turn)."""
    order = rope_order(geometry)
    m, half = cross[..., order, :][..., order], geometry.shared_rope_dim // 2
    i = jnp.arange(half)
    angles = jnp.arctan2(m[..., i, i + half] - m[..., i + half, i], m[..., i, i] + m[..., i + half, i + half])
    return shared_rope_rotation(angles, geometry)


@functools.partial(exact_jit, static_argnums=0)
def rope_query_scores(block: AttentionBlock, leaves_a, leaves_b):
    """(L, H_B, H_A): the inner products of B's and A's heads' RoPE query rows (role qr, beside a
    RoPE key every head shares), the term a head permutation adds to the alignment's objective."""
    xa, xb = (heads_view(jnp.concatenate([stacked(flat, m, jnp.float32) for m in block.members if m.role == ROPE_QUERY_ROLE], axis=1),
                         block, ROPE_QUERY_ROLE)[:, :, :, 0] for flat in (leaves_a, leaves_b))
    return jnp.einsum("lngd,lnhd->lgh", xb, xa)


@functools.partial(exact_jit, static_argnames=("rotary_dim", "qk_norm", "gated"))
def inner_scores(q, k, v, o, rotary_dim, qk_norm=False, gated=False):
    """Score of query head (i, r) of B against (j, s) of A, sharing the group's k/v part."""
    r = q.shape[2]
    qk = q + k[:, :, None, :, None] / r
    vo = o + v[:, :, None, :, None] / r
    return head_scores(qk, vo, rotary_dim, qk_norm, gated)  # (L, G, R, G, R)


@functools.partial(exact_jit, static_argnames=("rotary_dim", "qk_norm", "gated"))
def group_scores(q, k, v, o, sigma, rotary_dim, qk_norm=False, gated=False):
    """Group-pair scores, query heads matched by sigma[l, i, j, s] (the B slot of A slot s)."""

    def matched(x):  # x[l, i, sigma[l, i, j, s], j, s], summed over s
        x = x.transpose(0, 1, 3, 4, 2, 5, 6)  # (L, G_B, G_A, R_A, R_B, dh, dh)
        return jnp.take_along_axis(x, sigma[..., None, None, None], axis=4)[:, :, :, :, 0].sum(axis=3)

    return head_scores(matched(q) + k, matched(o) + v, rotary_dim, qk_norm, gated)  # (L, G_B, G_A)


@functools.partial(exact_jit, static_argnames=("rotary_dim", "qk_norm", "gated"))
def best_query_matching(q, k, v, o, candidates, rotary_dim, qk_norm=False, gated=False):
    """The best of the candidate query-head matchings (C, R) for every group pair, one candidate
    at a time (memory stays that of one): (L, G_B, G_A, R_A) matchings and their scores.
    Ties go to the earlier candidate (the identity first)."""
    n, g = q.shape[:2]
    scores = jax.lax.map(lambda perm: group_scores(q, k, v, o, jnp.broadcast_to(perm, (n, g, g, perm.shape[0])), rotary_dim, qk_norm, gated),
                          candidates)
    best = jnp.argmax(scores, axis=0)
    return candidates[best], jnp.max(scores, axis=0)


@functools.partial(exact_jit, static_argnames=("rotary_dim", "qk_norm", "gated"))
def head_scores(qk, vo, rotary_dim, qk_norm=False, gated=False):
    """max tr(R^T qk) + max tr(S^T vo) over orthogonal S and R, R within the RoPE group on rotary
    models (MATH §1-2): there QK scores the length of (M_ii + M_jj, M_ij - M_ji) per rotary pair
    plus the nuclear norm of the non-rotary block; under QK-norm, R within its sign flips
    (`procrustes.sign_score`; a QK-norm without weights keeps the RoPE group's score). Both nuclear
    norms by one SVD call (two could run at once: see `solvers.procrustes`). Under a gate on the
    heads' outputs (`gated`) S within the sign flips of each entry."""
    if qk.shape[-1] != vo.shape[-1]:  # V/O's own width (value_dim): both zero-padded to one, which keeps every score below
        width = max(qk.shape[-1], vo.shape[-1])
        qk, vo = (jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, width - x.shape[-1])] * 2) for x in (qk, vo))
    if gated:  # VO's sign flips; QK's own group (a nuclear norm, the pairs' lengths or signs) as below
        return head_scores(qk, jnp.zeros_like(vo), rotary_dim, qk_norm) + procrustes.sign_score(vo, 0)
    if signs_only(qk_norm):
        return procrustes.sign_score(qk, rotary_dim) + procrustes.nuclear_norm(vo)
    pairs = 0.0
    if rotary_dim:
        pairs = jnp.sum(jnp.hypot(*procrustes.rope_pair_terms(qk, rotary_dim)), axis=-1)
        qk = qk.at[..., :rotary_dim, :].set(0).at[..., :, :rotary_dim].set(0)  # the rest, zero-padded
    n = procrustes.nuclear_norm(jnp.stack([qk, vo]))
    return pairs + n[0] + n[1]


def assign_heads(block: AttentionBlock, leaves_a, leaves_b):
    """Head permutations (MATH §4). Multi-head: one assignment on the H x H scores, exact.
    GQA: query heads within each candidate (B group, A group) pair first (every matching while
    there are at most EXACT_QUERY_MATCHINGS: exact), then the groups. Traceable: the
    assignments go through `assignment.assign`."""
    geo = block.geometry
    n, g = len(block.layers), geo.num_kv_heads
    q, k, v, o = pair_cross(block, leaves_a, leaves_b)
    if geo.heads_per_group == 1:
        scores = _mha_head_scores(q, k, v, o, geo.rotary_dim, geo.qk_norm, geo.gated_output)
        if geo.shared_rope_dim:  # each head's RoPE query, which no map of the block moves: <B's head i, A's head j>
            scores = scores + rope_query_scores(block, leaves_a, leaves_b)
        group_perm = assignment.assign(scores, traced_nonfinite="identity")
        head_perm = jnp.zeros((n, g, 1), jnp.int32)
    else:
        sigma, outer = query_matchings(q, k, v, o, geo)
        group_perm = assignment.assign(outer, traced_nonfinite="identity")  # (L, G_A): A group j <- B group p[j]
        head_perm = _heads_of_groups(sigma, group_perm)  # (L, G, R)
    return {"group_perm": jnp.asarray(group_perm, jnp.int32), "head_perm": jnp.asarray(head_perm, jnp.int32)}


@functools.partial(exact_jit, static_argnums=(4, 5, 6))
def _mha_head_scores(q, k, v, o, rotary_dim, qk_norm, gated):
    # one program: eagerly, the slices and sums before `head_scores` compiled one each per shape
    return head_scores(q[:, :, 0, :, 0] + k, o[:, :, 0, :, 0] + v, rotary_dim, qk_norm, gated)


@exact_jit
def _heads_of_groups(sigma, group_perm):
    # one program: eagerly, the index arrays and the gather compiled one each per shape
    n, g = group_perm.shape
    return sigma[jnp.arange(n)[:, None], group_perm, jnp.arange(g)[None, :]]


def query_matchings(q, k, v, o, geo):
    """GQA: for every (B group, A group) pair, the matching of query heads (L, G_B, G_A, R_A) and
    the pair's score: the best of every matching while there are at most EXACT_QUERY_MATCHINGS,
    else a linear assignment on per-head scores."""
    r, rd, norm, gated = geo.heads_per_group, geo.rotary_dim, geo.qk_norm, geo.gated_output
    if math.factorial(r) <= EXACT_QUERY_MATCHINGS:
        candidates = jnp.asarray(list(itertools.permutations(range(r))), jnp.int32)
        return best_query_matching(q, k, v, o, candidates, rd, norm, gated)
    inner = inner_scores(q, k, v, o, rd, norm, gated)  # (L, G_B, R_B, G_A, R_A)
    sigma = assignment.assign(inner.transpose(0, 1, 3, 2, 4), traced_nonfinite="identity")  # (L, G_B, G_A, R_A)
    return sigma, group_scores(q, k, v, o, sigma, rd, norm, gated)
