"""The attention kind ("attention"): an attention block's heads (`spec.AttentionBlock`), moved by
per-head permutations, QK and VO rotations (or maps) and scales (`transforms.HeadTransform`),
solved by one batched Procrustes over every layer (`engine/attention.py`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..engine import activations, attention
from ..engine.driver import in_frame_of
from ..engine.groups import heads_view, stacked, unstacked
from ..engine.report import MOVED_TOL, fraction, from_identity, mean, unmoved, value_range, with_layers
from ..options import AlignOptions
from ..solvers import assignment, transport
from ..solvers.stretch import STRETCH_NORM, bounded, cayley
from ..spec import GAIN_ROLES, PERMUTED_ONLY_ROLES, UNSCALED_QK_NORMS, AttentionBlock
from ..transforms import HeadTransform, rope_rotation, stretch_form, symmetric_exp
from .base import ActivationSites, Fusion, GroupSolver, Kind, Learned, every_member, input_member

# ---- the solver: per-head rotations (or dimension permutations) and scales -------------------------


def _statistics(block, leaves_a, leaves_b, options: AlignOptions, solved=()):
    if options.attention == "none":
        return None
    la, lb = attention.block_leaves(leaves_a, block), attention.block_leaves(in_frame_of(block, leaves_b, solved, options), block)
    perms = attention.assign_heads(block, la, lb) if options.heads == "permute" and not block.geometry.fixed_order else None
    # a full-width QK-norm's QK scale is solved on its gains
    gains = attention.gain_terms(block, la, lb, perms) if block.geometry.qk_norm == "full" and options.rescale != "none" else None
    # a RoPE key every head shares (MLA): its rotation per rotary pair, with every head's RoPE query
    rope = attention.rope_crosses(block, la, lb, perms) if block.geometry.shared_rope_dim and options.attention == "rotation" else None
    return perms, attention.layer_crosses(block, la, lb, perms, grams=options.maps == "invertible"), gains, rope


def _combine(parts):
    if parts[0] is None:
        return None
    perms = None if parts[0][0] is None else {k: jnp.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}
    gains = None if parts[0][2] is None else jnp.concatenate([p[2] for p in parts])
    rope = None if parts[0][3] is None else [layer for p in parts for layer in p[3]]
    return perms, [layer for p in parts for layer in p[1]], gains, rope


def _solve(block, part, options: AlignOptions):
    element = HeadTransform.identity(block)
    if part is None:
        return element
    perms, crosses, gains, rope = part
    if options.method == "activations":
        crosses = [activations.one_sided_vo(c) for c in crosses]
    rotary, qk_norm, gated = block.geometry.rotary_dim, block.geometry.qk_norm, block.geometry.gated_output
    if options.attention == "rotation":
        out = attention.solve_crossed(crosses, rotary, perms, options.rescale, options.polar_method, qk_norm, gated)
        if options.maps == "invertible":  # from the rotations, a descent of the distance over invertible maps
            out = attention.invertible_maps(out, crosses, rotary, qk_norm, gated)
    else:
        out = {**(perms or {}), **attention.finish_dim_permutation(attention.concat_crosses(crosses), options.rescale, rotary, qk_norm, gated)}
    if gains is not None:
        out["qk_scale"] = attention.gain_scale(gains)
    if rope is not None:
        out["rope"] = attention.rope_key_rotation(jnp.concatenate(rope), block.geometry)
    return element.replace(**out)


SOLVER = GroupSolver(
    statistics=_statistics,
    reduce=lambda block, statistics, options, traced: statistics,
    combine=_combine,
    solve=_solve,
)


# ---- what moved (the report's `moved`) ----------------------------------------------------------------

def summary(block, t) -> dict:
    """What moved: "heads" the fraction of query heads that left their slot, "qk" and "vo" the mean distance of
    the maps from the identity, "qk_scale" and "vo_scale" their [min, max], "rope" a shared RoPE
    key's distance (engine/report.py's `moved`)."""
    group_perm, head_perm = np.asarray(t.group_perm), np.asarray(t.head_perm)
    n, g, r = head_perm.shape
    left = (group_perm != np.arange(g))[..., None] | (head_perm != np.arange(r))  # (L, G, R)
    qk, vo = from_identity(t.qk), from_identity(t.vo)  # (L, G)
    scales = {name: unmoved(np.asarray(getattr(t, name), np.float64), 1.0) for name in ("qk_scale", "vo_scale")}
    per_layer = [left.reshape(n, -1).any(axis=1), qk.reshape(n, -1).max(axis=1, initial=0) > MOVED_TOL,
                 vo.reshape(n, -1).max(axis=1, initial=0) > MOVED_TOL]
    per_layer += [np.abs(s - 1).reshape(n, -1).max(axis=1, initial=0) > MOVED_TOL for s in scales.values()]
    out = {"heads": fraction(left), "qk": mean(qk), "vo": mean(vo), **{k: value_range(s) for k, s in scales.items()}}
    if t.rope is not None:
        rope = from_identity(t.rope)
        per_layer.append(rope > MOVED_TOL)
        out["rope"] = mean(rope)
    return with_layers(n, np.logical_or.reduce(per_layer), out)


# ---- activation matching's sites (engine/activations.py) ------------------------------------------------

def _reads(block, member) -> tuple[bool, bool]:
    """Q, K, V (and MLA's RoPE query and shared key): their outputs; O: its input, the heads' outputs."""
    return (True, True) if member.role in activations.SITE_ROLES else (member.axis == 0, False)


def _site(block, member, path, options):
    if not path.endswith("/kernel") or member.role in GAIN_ROLES:
        return None
    if member.role in activations.SITE_ROLES:
        return path + activations.OUT
    return path if member.axis == 0 else None


def _pseudo(block, member, path, x):
    if x is not None:
        if member.role in activations.SITE_ROLES:
            return x  # (tokens, heads * dh): the head axis stays axis 1
        return x if member.axis == 1 else x.T  # (tokens, heads * dh): O's input, the heads' outputs
    g, r, dh = block.geometry.role_shape(member.role)
    return activations.zeros_leaf(member, path, g * r * dh)


SITES = ActivationSites(check=lambda block, shapes: None, reads=_reads, site=_site, pseudo=_pseudo)


def said(m: dict) -> list[str]:
    """`summary` as the command line prints it."""
    parts = [f"{m['heads']:.0%} of heads permuted"] if m["heads"] else []
    parts += [f"QK {m['qk']:.3g}, VO {m['vo']:.3g} from the identity" + (f", the shared RoPE key {m['rope']:.3g}" if "rope" in m else "")]
    return parts + [f"{k[:2].upper()} scales {lo:.3g} to {hi:.3g}" for k in ("qk_scale", "vo_scale") for lo, hi in [m[k]] if [lo, hi] != [1.0, 1.0]]


# ---- learned alignment's parametrisation (engine/learned.py, MATH §10) -----------------------------------

def _initial(block, t0, frame, options: AlignOptions):
    """Zeros: the Cayley maps' skew matrices, the RoPE pairs' angles, the log-scales unless
    rescale="none", the stretches' symmetric logs with maps="invertible"; None unless
    attention="rotation"."""
    if options.attention != "rotation":
        return None
    n, (g, _, dh), rotary = len(block.layers), block.geometry.role_shape("q"), block.geometry.rotary_dim or 0
    dv = block.geometry.v_dim
    return {"qk": jnp.zeros((n, g, dh, dh), jnp.float32), "qk_angles": jnp.zeros((n, g, rotary // 2), jnp.float32),
            "vo": jnp.zeros((n, g, dv, dv), jnp.float32),
            **({"qk_scale": jnp.zeros((n, g), jnp.float32), "vo_scale": jnp.zeros((n, g), jnp.float32)} if options.rescale != "none" else {}),
            **({"qk_stretch": jnp.zeros((n, g, dh, dh), jnp.float32), "vo_stretch": jnp.zeros((n, g, dv, dv), jnp.float32)}
               if options.maps == "invertible" else {})}


def _element(block, base, p, projected):
    """`base` composed with the learned maps: QK and VO rotations t0 @ cayley(K) (on RoPE blocks 2-D
    rotations of the rotary pairs by learned angles and cayley(K) past them), scales t0 * exp(s),
    with maps="invertible" t0 @ rotation @ exp(S) (S symmetric, bounded) and the inverse side
    t0^-T @ rotation @ exp(-S). One batched Cayley map per block (QK and VO stacked): XLA:CPU runs
    independent LAPACK calls of one program concurrently, which has deadlocked it
    (solvers.procrustes), so the step holds as few as it can: where V/O's width differs from Q/K's,
    both skew matrices zero-padded to one width (the Cayley map of diag(K, 0) is diag(cayley(K), I))."""
    rotary = block.geometry.rotary_dim or 0
    dh = base.qk.shape[-1]
    k = p["qk"]
    if block.geometry.qk_signs_only:  # a discrete group (sign flips): the closed form's stays
        k = jnp.zeros_like(k)
    elif rotary:  # the RoPE group: pair rotations on the rotary dims, any rotation on the rest
        k = k.at[..., :rotary, :].set(0).at[..., :, :rotary].set(0)
    v = jnp.zeros_like(p["vo"]) if block.geometry.gated_output else p["vo"]  # a gate on the heads' outputs: VO's sign flips stay
    if k.shape[-1] == v.shape[-1]:
        qk, vo = cayley(jnp.stack([k, v]))
    else:
        width = max(k.shape[-1], v.shape[-1])
        qk, vo = cayley(jnp.stack([jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, width - x.shape[-1])] * 2) for x in (k, v)]))
        qk, vo = qk[..., : k.shape[-1], : k.shape[-1]], vo[..., : v.shape[-1], : v.shape[-1]]
    if rotary and not block.geometry.qk_signs_only:
        qk = rope_rotation(p["qk_angles"], dh, rotary) @ qk
    qk_scale = base.qk_scale if block.geometry.qk_norm in UNSCALED_QK_NORMS or "qk_scale" not in p else base.qk_scale * jnp.exp(p["qk_scale"])
    scales = {} if "qk_scale" not in p else {"qk_scale": qk_scale, "vo_scale": base.vo_scale * jnp.exp(p["vo_scale"])}  # per-head QK-norm: none
    maps = dict(qk=base.qk @ qk, vo=base.vo @ vo)
    if "qk_stretch" in p:  # invertible maps: M = t0 R exp(S), and M^-T = t0^-T R exp(-S) (S symmetric)
        logs = {"qk": None if block.geometry.qk_norm else stretch_form(bounded(p["qk_stretch"]), rotary),
                "vo": None if block.geometry.gated_output else bounded(p["vo_stretch"])}
        for name, rotation in (("qk", qk), ("vo", vo)):
            if logs[name] is None:
                continue
            first_inv = getattr(base, f"{name}_inv")
            inverse_transposed = (getattr(base, name) if first_inv is None else first_inv) @ rotation
            stretch = symmetric_exp(jnp.stack([logs[name], -logs[name]]), max_norm=STRETCH_NORM)  # one program, matmuls only
            maps[name] = maps[name] @ stretch[0]
            maps[f"{name}_inv"] = inverse_transposed @ stretch[1]
    return base.replace(**maps, **scales)


LEARNED = Learned(initial=_initial, element=_element)


# ---- OT fusion's view (merging/otfusion.py, MATH §9): whole heads, kv groups then their query heads ----------

def _fusion_refusal(block) -> str | None:
    if block.after:  # a plan would transport the readers' rows and their heads' columns, each from the leaves as stored
        return (f"OT fusion does not transport units that attention kernels read ({list(block.after)}: MLA's latents, whose readers' "
                "columns are the heads'): align the models first and merge with an elementwise method (average, ties, ...)")
    if block.geometry.fixed_order:  # the plans transport heads, which this block cannot move
        return (f"OT fusion transports attention heads, and the heads of {block.name!r} keep their order (they share a leaf "
                "indexed by head, as T5's position bias): align the models first and merge with an elementwise method")
    return None


def _unit_major(view):
    """(L, rows, G, R, dh) -> (L, G, R, rows*dh), float64."""
    v = np.asarray(view, np.float64)
    return np.transpose(v, (0, 2, 3, 1, 4)).reshape(v.shape[0], v.shape[2], v.shape[3], -1)


def _fusion_features(block, flat, inputs):
    """(kv (L, G, Dkv) or None, heads (L, G, R, Dh)): from weights, each kv group's K and V slices
    and each query head's Q and O slices; from activations, each head's output (O's input)."""
    if inputs is not None:
        g, r, dh = block.geometry.role_shape("o")
        x = np.stack(inputs)  # (L, rows, H*dh)
        return None, _unit_major(x.reshape(x.shape[0], x.shape[1], g, r, dh))
    views = {}
    for role in ("q", "k", "v", "o"):
        parts = [np.asarray(stacked(flat, m, jnp.float32), np.float64) for m in block.members if m.role == role]
        views[role] = np.asarray(heads_view(np.concatenate(parts, axis=1), block, role))  # (L, rows, G, R, dh)
    kv = np.concatenate([_unit_major(views["k"])[:, :, 0], _unit_major(views["v"])[:, :, 0]], axis=-1)
    return kv, np.concatenate([_unit_major(views["q"]), _unit_major(views["o"])], axis=-1)


def _group_costs(features_b, features_a):
    """kv-group costs (L, G_B, G_A): k, v slices plus the best matching of the query heads."""
    kv_b, heads_b = features_b
    kv_a, heads_a = features_a
    L, g, r, _ = heads_b.shape
    # head costs between B group j slot s and A group k slot t: (L, G_B, G_A, R_B, R_A)
    c = transport.sq_dists(heads_b.reshape(L, g * r, -1), heads_a.reshape(L, g * r, -1)).reshape(L, g, r, g, r)
    c = np.transpose(c, (0, 1, 3, 2, 4))
    if r == 1:
        inner = c[..., 0, 0]
    else:
        p = assignment.batched_linear_assignment(c, maximize=False)  # (L, G_B, G_A, R_A): B slot of A slot t
        inner = np.take_along_axis(c, p[..., None, :], axis=-2)[..., 0, :].sum(-1)
    if kv_b is not None:
        inner = inner + transport.sq_dists(kv_b, kv_a)
    return inner


def _fusion_plans(block, features, features_a, transport_kind, reg, what):
    """The kv groups' plan, then within each transported group its query heads' onto the anchor
    group's; the head-level plan B head (j, s) -> anchor head (k, t) has mass T_g[j, k] P_k[s, t]."""
    g_plan = transport.solve(_group_costs(features, features_a), transport_kind, reg, what + " (kv groups)")
    (_, heads_b), (_, heads_a) = features, features_a
    L, g, r, _ = heads_b.shape
    plans = {}
    if r == 1:
        q_plan = np.ones((L, g, 1, 1))
    else:
        moved = np.einsum("ljk,ljsd->lksd", transport.barycentric(g_plan), heads_b)
        q_plan = transport.solve(transport.sq_dists(moved, heads_a), transport_kind, reg, what + " (query heads)")  # rows 1/R
        plans[f"{block.name}/kv_groups"] = g_plan
    plans = {block.name: np.einsum("ljk,lkst->ljskt", g_plan, q_plan).reshape(L, g * r, g * r), **plans}
    return plans, (g_plan, q_plan)


def _fusion_element(block, solved, what):
    g_plan, q_plan = solved
    group_perm = transport.plan_to_perm(g_plan, what + " (kv groups)")
    head_perm = transport.plan_to_perm(q_plan, what + " (query heads)")
    return HeadTransform.identity(block).replace(group_perm=jnp.asarray(group_perm), head_perm=jnp.asarray(head_perm))


def _fusion_soft(block, flat, solved, shapes) -> dict:
    wg, wq = (jnp.asarray(transport.barycentric(plan), jnp.float32) for plan in solved)  # (L, G, G), (L, G, R, R)
    new = {}
    for m in block.members:
        x = heads_view(stacked(flat, m, jnp.float32), block, m.role)  # (L, rows, G, R, dh)
        y = jnp.einsum("lnjrd,ljk->lnkrd", x, wg)
        # qn: a full-width QK-norm's gains on q's heads; g: a gate on their outputs; qr: their RoPE queries; s: their sinks
        if m.role in ("q", "o", "qn") + PERMUTED_ONLY_ROLES:
            y = jnp.einsum("lnksd,lkst->lnktd", y, wq)
        new.update(unstacked(y.reshape(y.shape[0], y.shape[1], -1), m, shapes, flat[m.paths[0]].dtype))
    return new


FUSION = Fusion(refusal=_fusion_refusal, input_paths=lambda block, bound: input_member(block, bound, "o").paths,
                features=_fusion_features, plans=_fusion_plans, element=_fusion_element, soft=_fusion_soft)


KIND = Kind(group=AttentionBlock, element=HeadTransform, solver=SOLVER, summary=summary, said=said, activations=SITES,
            cost_matrices=lambda block, per_layer: (0, 0),  # its cross products are a few dh x dh matrices per layer
            mixed=every_member, refusal=lambda block, options, traced: None, learned=LEARNED, fusion=FUSION)
