"""OT fusion: the optimal-transport fusion baseline for transformers (Imfeld et al. 2024,
"Transformer Fusion with Optimal Transport"; the OT-WTS and OT-ACTS rows of their tables).

`ot_fuse(params_list, spec)` transports the FFN neurons and the attention heads (whole heads; kv
groups, then their query heads, with GQA) of every model i >= 1 onto those of the anchor
`params_list[0]`, then averages the models. Costs are squared distances between the units' weights
(source="weights") or activations (source="activations"); transport="hard" is exact OT, a
permutation that keeps each model's function, transport="soft" entropic OT with a barycentric
projection, which does not. The units, costs, plans and the baseline's limits are derived in
docs/MATH.md §9.

Nothing is modified in place; the fused params have the anchor's leaves and dtypes. The task head
(the top-level key "head") is the anchor's (task_head="anchor", as in `rotsym_jax.merge`) or
averaged (task_head="merge", heads of equal shape only). Registered in `merge.METHODS` as
"ot_fusion". POT is imported only when a plan is solved.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from .. import checks
from ..engine.groups import apply_transform, heads_view, stacked, unstacked
from ..errors import InputError
from ..options import OT_SOURCES, OT_TRANSPORTS
from ..precision import exact
from ..pytree import flatten, unflatten
from ..solvers import assignment
from ..spec import BoundSpec, Spec, bind
from ..transforms import UnitPermutation, identity_transform
from . import methods
from .stats import layer_inputs

TASK_HEAD = checks.TASK_HEAD

# Sinkhorn: iteration cap; it stops when the L2 norm of the marginal violation is below
# SINKHORN_TOL / n (marginals 1/n: relative 1e-6 per unit).
SINKHORN_ITERS = 5_000
SINKHORN_TOL = 1e-6
# A plan whose marginals are still off by more than this (relative to 1/n) gets a warning; every
# plan is then rounded onto the exact marginals.
MARGINAL_WARN = 1e-3


@dataclasses.dataclass(frozen=True)
class OTTransport:
    """models: the anchor `params_list[0]` (as given), then every model i >= 1 transported onto
    it. plans: one dict per model i >= 1, {group or block name: (L, n, n) float64 plan per
    layer, rows: the model's units, columns: the anchor's, entries summing to 1}; an attention
    block's plan is over query heads (n = num_heads; the kv-group plan composed with the query
    plans inside each group), and with GQA the kv-group plan is also given as
    "{block}/kv_groups" (L, G, G). transforms: for transport="hard", per model i >= 1 the group
    element (`rotsym_jax.transforms`) that was applied (so `apply_transform(spec,
    params_list[i], transforms[i-1])` is `models[i]`); None for transport="soft"."""

    models: list
    plans: tuple
    transforms: tuple


@dataclasses.dataclass(frozen=True)
class OTResult:
    """params: the fused model. plans: the transport plans of params_list[1] (the only other
    model when two are fused): {group or block name: (L, n, n)}, see `OTTransport`. all_plans:
    one such dict per model i >= 1, in order."""

    params: dict
    plans: dict
    all_plans: tuple


# ---- public API -----------------------------------------------------------------------------------

def ot_fuse(
    params_list: Sequence[Mapping],
    spec: Spec | BoundSpec,
    *,
    source: str = "weights",
    transport: str = "hard",
    checkpoint=None,
    batches=None,
    sinkhorn_reg: float = 0.05,
    weights: Sequence[float] | None = None,
    task_head: str = "anchor",
) -> OTResult:
    """OT fusion (Imfeld et al. 2024): transport the FFN neurons and the attention heads of every
    model i >= 1 onto those of the anchor `params_list[0]`, then average (uniform, or `weights`:
    one non-negative weight per model, normalised to sum to 1). See docs/MATH.md §9 for the costs,
    the two transports and the baseline's limitations.

    source: "weights" or "activations" (needs `checkpoint`, whose graph runs every model, and
        `batches`, an iterable of dicts of model inputs, e.g. with "attention_mask").
    transport: "hard" (exact EMD: a permutation, function-preserving) or "soft" (Sinkhorn with
        regularisation `sinkhorn_reg` times the median of each cost matrix; barycentric
        projection, not function-preserving).
    task_head: "anchor" (the anchor's head) or "merge" (heads averaged; they must have equal
        shapes).
    """
    sinkhorn_reg = _check_options(source, transport, checkpoint, batches, sinkhorn_reg, task_head)
    _check_models(params_list, task_head)
    checks.weights(weights, len(params_list))  # everything is validated before any work
    moved = _transport(params_list, spec, source, transport, checkpoint, batches, sinkhorn_reg)
    fused = methods.average(moved.models, weights, task_head=task_head)
    return OTResult(fused, moved.plans[0], moved.plans)


def ot_transport(
    params_list: Sequence[Mapping],
    spec: Spec | BoundSpec,
    *,
    source: str = "weights",
    transport: str = "hard",
    checkpoint=None,
    batches=None,
    sinkhorn_reg: float = 0.05,
) -> OTTransport:
    """The transport step of `ot_fuse` alone: every model i >= 1 transported onto the anchor
    `params_list[0]` (same options as `ot_fuse`), not averaged. With transport="hard" each
    transported model computes exactly its original function."""
    sinkhorn_reg = _check_options(source, transport, checkpoint, batches, sinkhorn_reg, "anchor")
    _check_models(params_list, "anchor")
    return _transport(params_list, spec, source, transport, checkpoint, batches, sinkhorn_reg)




@exact
def _transport(params_list, spec, source, transport, checkpoint, batches, sinkhorn_reg) -> OTTransport:
    if source == "activations":
        batches = list(batches)
        if not batches:
            raise InputError("source='activations': `batches` is empty; give at least one batch of model inputs")
    anchor = params_list[0]
    if not isinstance(spec, (Spec, BoundSpec)):
        raise InputError(f"spec must be a rotsym_jax Spec (or BoundSpec), got {type(spec).__name__}")
    # Each model is bound on its own: task heads may differ in shape (task_head="anchor").
    spec = spec.spec if isinstance(spec, BoundSpec) else spec
    bound_a = bind(spec, anchor)
    # Refused: groups whose every leaf is another's (Mamba's state), all their features in its unmatched frame. A chain whose
    # groups each have a leaf of their own (Llama 4's adapter) is transported, the map they share read as stored by each.
    shared = [g for g in bound_a.perms if g.after and all(m.also is not None for m in g.members)]
    if shared:  # a soft plan per group would blend a leaf of two groups along one axis only, the other group's as stored
        raise InputError(f"OT fusion does not transport groups that share their leaves with another ({[g.name for g in shared]}, on leaves of "
                         f"{shared[0].after[0]!r} too: Mamba's state and time step): align first and merge with an elementwise method")
    if bound_a.experts:  # the transport plans are of units and heads; experts would be left unmatched
        raise InputError(f"OT fusion does not transport experts yet (experts block {bound_a.experts[0].name!r}): "
                         "align the mixture of experts first and merge with an elementwise method (average, ties, ...)")
    shared = sorted({name for b in bound_a.attention for name in b.after})
    if shared:  # a plan would transport the readers' rows and their heads' columns, each from the leaves as stored
        raise InputError(f"OT fusion does not transport units that attention kernels read ({shared}: MLA's latents, whose readers' "
                         "columns are the heads'): align the models first and merge with an elementwise method (average, ties, ...)")
    fixed = [b.name for b in bound_a.attention if b.geometry.fixed_order]
    if fixed:  # the plans transport heads, which these blocks cannot move
        raise InputError(f"OT fusion transports attention heads, and the heads of {fixed} keep their order (they share a leaf "
                         "indexed by head, as T5's position bias): align the models first and merge with an elementwise method")
    flat_a = flatten(anchor)
    feats_a = _features(bound_a, flat_a, source, checkpoint, anchor, batches)
    models, plans, transforms = [anchor], [], []
    for i, params in enumerate(params_list[1:], 1):
        bound = bind(spec, params)
        flat = flatten(params)
        feats = _features(bound, flat, source, checkpoint, params, batches)
        moved, plan, transform = _transport_one(bound, params, flat, feats, feats_a, transport, sinkhorn_reg, i)
        models.append(moved)
        plans.append(plan)
        transforms.append(transform)
    return OTTransport(models, tuple(plans), tuple(transforms))


# ---- validation -----------------------------------------------------------------------------------

def _check_options(source, transport, checkpoint, batches, sinkhorn_reg, task_head):
    """The options, checked; returns sinkhorn_reg as a float."""
    checks.choice("source", source, OT_SOURCES)
    checks.choice("transport", transport, OT_TRANSPORTS)
    checks.choice("task_head", task_head, TASK_HEAD)
    sinkhorn_reg = checks.scalar("sinkhorn_reg", sinkhorn_reg, low=0.0, low_open=True)
    if source == "activations":
        missing = [n for n, v in (("checkpoint", checkpoint), ("batches", batches)) if v is None]
        if missing:
            raise InputError(
                f"source='activations' needs {' and '.join(missing)}: the checkpoint whose graph runs the "
                "models and the batches of inputs every model sees"
            )
        if not hasattr(checkpoint, "graphdef"):
            raise InputError(f"checkpoint must be a rotsym_jax Checkpoint (with a graphdef), got {type(checkpoint).__name__}")
    return sinkhorn_reg


def _check_models(params_list, task_head):
    """At least two params pytrees with the anchor's leaves and shapes (heads: only when merged),
    checked exactly as `rotsym_jax.merge` checks them, and not traced (the plans are the host's)."""
    methods.refuse_traced("ot_fusion", params_list)
    checks.mergeable(checks.model_list(params_list), task_head)


# ---- unit features --------------------------------------------------------------------------------

def _np64(x):
    return np.asarray(x, np.float32).astype(np.float64)


def _features(bound: BoundSpec, flat, source, checkpoint, params, batches):
    """{group name: (L, n, D)} and {block name: (kv (L, G, Dkv) or None, heads (L, G, R, Dh))}."""
    if source == "weights":
        out = {}
        for group in bound.perms:
            x = np.concatenate([_np64(stacked(flat, m, jnp.float32)) for m in group.members], axis=1)
            out[group.name] = np.swapaxes(x, 1, 2)  # (L, n, rows)
        for block in bound.attention:
            views = {}
            for role in ("q", "k", "v", "o"):
                parts = [_np64(stacked(flat, m, jnp.float32)) for m in block.members if m.role == role]
                views[role] = np.asarray(heads_view(np.concatenate(parts, axis=1), block, role))  # (L, rows, G, R, dh)
            kv = np.concatenate([_unit_major(views["k"])[:, :, 0], _unit_major(views["v"])[:, :, 0]], axis=-1)
            heads = np.concatenate([_unit_major(views["q"]), _unit_major(views["o"])], axis=-1)
            out[block.name] = (kv, heads)
        return out
    inputs = _recorded_inputs(bound, checkpoint, params, batches)
    out = {}
    for group in bound.perms:
        out[group.name] = np.stack([x.T for x in inputs[group.name]])  # (L, n, rows)
    for block in bound.attention:
        g, r, dh = block.geometry.role_shape("o")
        x = np.stack(inputs[block.name])  # (L, rows, H*dh)
        out[block.name] = (None, _unit_major(x.reshape(x.shape[0], x.shape[1], g, r, dh)))
    return out


def _unit_major(view):
    """(L, rows, G, R, dh) -> (L, G, R, rows*dh), float64."""
    v = np.asarray(view, np.float64)
    return np.transpose(v, (0, 2, 3, 1, 4)).reshape(v.shape[0], v.shape[2], v.shape[3], -1)


def _input_member(group, bound: BoundSpec, role=None):
    """The member whose leaves are 2-D kernels with the group's units on their input axis (0)."""
    shapes = dict(bound.shapes)
    for m in group.members:
        if (role is None or m.role == role) and m.axis == 0 and m.layer_axis is None and all(len(shapes[p]) == 2 for p in m.paths):
            return m
    what = f"attention block {group.name!r} (role o)" if role else f"permutation group {group.name!r}"
    raise InputError(
        f"source='activations': {what} has no 2-D kernel with its units on the input axis (axis 0), "
        f"whose recorded input would give the units' activations; members: {[m.template for m in group.members]}"
    )


def _recorded_inputs(bound: BoundSpec, checkpoint, params, batches):
    """{group / block name: [per layer (rows, n or H*dh) float64]} from `stats.layer_inputs`."""
    wanted = {g.name: _input_member(g, bound).paths for g in bound.perms}
    wanted.update({b.name: _input_member(b, bound, "o").paths for b in bound.attention})
    per_batch = []
    for batch in batches:
        try:
            recorded = layer_inputs(checkpoint, params, batch)
        except Exception as e:
            raise InputError(f"source='activations': running the checkpoint's model on a batch failed: {e}") from e
        per_batch.append(recorded)
    out = {}
    for name, paths in wanted.items():
        layers = []
        for path in paths:
            missing = [i for i, rec in enumerate(per_batch) if path not in rec]
            if missing:
                raise InputError(
                    f"source='activations': the input of {path!r} was not recorded (batch {missing[0]}); "
                    f"recorded kernels: {sorted(per_batch[missing[0]])[:8]}"
                )
            layers.append(np.concatenate([np.asarray(rec[path], np.float64) for rec in per_batch], axis=0))
        out[name] = layers
    return out


# ---- costs and plans ------------------------------------------------------------------------------

def _sq_dists(xb, xa):
    """(..., n, D), (..., m, D) -> (..., n, m) squared Euclidean distances, float64, >= 0."""
    cross = np.matmul(xb, np.swapaxes(xa, -1, -2))
    d = np.sum(xb * xb, -1)[..., :, None] + np.sum(xa * xa, -1)[..., None, :] - 2.0 * cross
    return np.maximum(d, 0.0)


def _group_costs(feats_b, feats_a):
    """kv-group costs (L, G_B, G_A): k, v slices plus the best matching of the query heads."""
    kv_b, heads_b = feats_b
    kv_a, heads_a = feats_a
    L, g, r, _ = heads_b.shape
    # head costs between B group j slot s and A group k slot t: (L, G_B, G_A, R_B, R_A)
    c = _sq_dists(heads_b.reshape(L, g * r, -1), heads_a.reshape(L, g * r, -1)).reshape(L, g, r, g, r)
    c = np.transpose(c, (0, 1, 3, 2, 4))
    if r == 1:
        inner = c[..., 0, 0]
    else:
        p = assignment.batched_linear_assignment(c, maximize=False)  # (L, G_B, G_A, R_A): B slot of A slot t
        inner = np.take_along_axis(c, p[..., None, :], axis=-2)[..., 0, :].sum(-1)
    if kv_b is not None:
        inner = inner + _sq_dists(kv_b, kv_a)
    return inner


def _relative_reg(cost, reg):
    med = float(np.median(cost))
    scale = med if med > 0 else float(np.max(cost))
    return reg * (scale if scale > 0 else 1.0)


def _solve(costs, transport, reg, what):
    """Plans (..., n, n) for cost matrices (..., n, n), uniform marginals 1/n; one solver call
    per matrix (a layer, or a layer's kv group)."""
    import ot  # POT: only OT fusion needs it, so the engine runs where it is not installed

    costs = np.asarray(costs, np.float64)
    n = costs.shape[-1]
    a = np.full(n, 1.0 / n)
    plans = np.empty_like(costs)
    for idx in np.ndindex(costs.shape[:-2]):
        c = np.asarray(costs[idx], order="C")
        where = f"{what}, layer index {idx[0]}" + (f", kv group {idx[1]}" if len(idx) > 1 else "")
        if not np.all(np.isfinite(c)):
            raise InputError(f"{where}: the cost matrix has non-finite entries (NaN or inf in the weights or activations)")
        if transport == "hard":
            plan, log = ot.emd(a, a, c, numItermax=max(100_000, 100 * n * n), log=True)
            if log["warning"] is not None:
                raise RuntimeError(f"{where}: exact OT (ot.emd) did not solve: {log['warning']}")
        else:
            plan = _sinkhorn(a, c, _relative_reg(c, reg), where)
        plans[idx] = plan
    return plans


def _sinkhorn(a, cost, reg, where):
    """Entropic OT plan with exact marginals `a`: POT's stabilised Sinkhorn (its log-domain
    Sinkhorn where that overflows), then rounded onto the marginals (Altschuler et al. 2017, Alg. 2:
    a change of the order of the remaining marginal error), so every plan is a coupling."""
    import ot

    n = a.shape[0]
    plan = None
    for method in ("sinkhorn_stabilized", "sinkhorn_log"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # non-convergence is judged below, with context
            plan = np.asarray(
                ot.sinkhorn(a, a, cost, reg, method=method, numItermax=SINKHORN_ITERS, stopThr=SINKHORN_TOL / n, warn=False),
                np.float64,
            )
        if np.all(np.isfinite(plan)) and np.all(plan.sum(0) > 0) and np.all(plan.sum(1) > 0):
            break
    else:
        raise RuntimeError(f"{where}: Sinkhorn failed (non-finite or empty plan) with regularisation {reg:.3g}; increase sinkhorn_reg")
    err = max(np.abs(plan.sum(0) - a).max(), np.abs(plan.sum(1) - a).max()) * n
    if err > MARGINAL_WARN:
        warnings.warn(
            f"{where}: Sinkhorn did not converge in {SINKHORN_ITERS} iterations (relative marginal error "
            f"{err:.1e}, rounded onto the marginals); a larger sinkhorn_reg converges faster",
            RuntimeWarning,
            stacklevel=5,
        )
    return _round_to_marginals(plan, a)


def _round_to_marginals(plan, a):
    plan = plan * np.minimum(a / plan.sum(1), 1.0)[:, None]
    plan = plan * np.minimum(a / plan.sum(0), 1.0)[None, :]
    err_rows, err_cols = a - plan.sum(1), a - plan.sum(0)
    total = err_cols.sum()
    return plan + np.outer(err_rows, err_cols) / total if total > 0 else plan


def _plan_to_perm(plans, what):
    """Permutation matrices / n (..., n, n) -> p (..., n) with B'[k] = B[p[k]]; checked."""
    n = plans.shape[-1]
    p = np.argmax(plans, axis=-2)
    onehot = np.zeros_like(plans)
    np.put_along_axis(onehot, p[..., None, :], 1.0, axis=-2)
    if not np.allclose(plans * n, onehot, atol=1e-9) or np.any(np.sort(p, axis=-1) != np.arange(n)):
        raise RuntimeError(f"{what}: the exact OT plan is not a permutation (units of equal count must give one)")
    return p.astype(np.int32)


def _barycentric(plans):
    """Column-normalised plans: fused unit k = sum_j W[j, k] unit_j (= n T[j, k] at convergence)."""
    return plans / plans.sum(-2, keepdims=True)


# ---- one model ------------------------------------------------------------------------------------

def _transport_one(bound, params, flat, feats, feats_a, transport, reg, i):
    plans_out = {}
    perms, group_plans, query_plans = {}, {}, {}
    for group in bound.perms:
        what = f"params_list[{i}], group {group.name!r}"
        plan = _solve(_sq_dists(feats[group.name], feats_a[group.name]), transport, reg, what)
        plans_out[group.name] = plan
        if transport == "hard":
            perms[group.name] = _plan_to_perm(plan, what)
    for block in bound.attention:
        what = f"params_list[{i}], attention block {block.name!r}"
        g_plan = _solve(_group_costs(feats[block.name], feats_a[block.name]), transport, reg, what + " (kv groups)")
        _, heads_b = feats[block.name]
        _, heads_a = feats_a[block.name]
        L, g, r, _ = heads_b.shape
        if r == 1:
            q_plan = np.ones((L, g, 1, 1))
        else:
            # The query heads of each transported group onto the anchor group's query heads.
            moved = np.einsum("ljk,ljsd->lksd", _barycentric(g_plan), heads_b)
            q_plan = _solve(_sq_dists(moved, heads_a), transport, reg, what + " (query heads)")  # rows 1/R
            plans_out[f"{block.name}/kv_groups"] = g_plan
        # Head-level plan: B head (j, s) -> anchor head (k, t) with mass T_g[j, k] P_k[s, t].
        plans_out[block.name] = np.einsum("ljk,lkst->ljskt", g_plan, q_plan).reshape(L, g * r, g * r)
        group_plans[block.name], query_plans[block.name] = g_plan, q_plan
    if transport == "hard":
        t = identity_transform(bound)
        t.update({name: UnitPermutation(jnp.asarray(p)) for name, p in perms.items()})
        for block in bound.attention:
            what = f"params_list[{i}], attention block {block.name!r}"
            gp = _plan_to_perm(group_plans[block.name], what + " (kv groups)")
            hp = _plan_to_perm(query_plans[block.name], what + " (query heads)")
            t[block.name] = t[block.name].replace(group_perm=jnp.asarray(gp), head_perm=jnp.asarray(hp))
        return apply_transform(bound, params, t), plans_out, t
    return _soft_apply(bound, flat, plans_out, group_plans, query_plans), plans_out, None


def _soft_apply(bound: BoundSpec, flat, plans, group_plans, query_plans):
    """Barycentric projection of every member slice of every unit (float32, the leaves' dtypes)."""
    shapes = dict(bound.shapes)
    new = {}
    for group in bound.perms:
        w = jnp.asarray(_barycentric(plans[group.name]), jnp.float32)
        for m in group.members:
            x = stacked(flat, m, jnp.float32)  # (L, rows, n)
            y = jnp.einsum("lrj,ljk->lrk", x, w)
            new.update(unstacked(y, m, shapes, flat[m.paths[0]].dtype))
    for block in bound.attention:
        wg = jnp.asarray(_barycentric(group_plans[block.name]), jnp.float32)  # (L, G, G)
        wq = jnp.asarray(_barycentric(query_plans[block.name]), jnp.float32)  # (L, G, R, R)
        for m in block.members:
            x = heads_view(stacked(flat, m, jnp.float32), block, m.role)  # (L, rows, G, R, dh)
            y = jnp.einsum("lnjrd,ljk->lnkrd", x, wg)
            if m.role in ("q", "o", "qn", "g", "qr"):  # qn: a full-width QK-norm's gains on q's heads; g: a gate on their outputs; qr: their RoPE queries
                y = jnp.einsum("lnksd,lkst->lnktd", y, wq)
            new.update(unstacked(y.reshape(y.shape[0], y.shape[1], -1), m, shapes, flat[m.paths[0]].dtype))
    return unflatten({**flat, **new})
