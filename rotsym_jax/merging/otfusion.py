"""OT fusion: the optimal-transport fusion baseline for transformers (Imfeld et al. 2024,
"Transformer Fusion with Optimal Transport"; the OT-WTS and OT-ACTS rows of their tables).

`ot_fuse(params_list, spec)` transports the FFN neurons and the attention heads (whole heads; kv
groups, then their query heads, with GQA) of every model i >= 1 onto those of the anchor
`params_list[0]`, then averages the models. Costs are squared distances between the units' weights
(source="weights") or activations (source="activations"); transport="hard" is exact OT, a
permutation that keeps each model's function, transport="soft" entropic OT with a barycentric
projection, which does not. The units, costs, plans and the baseline's limits are derived in
docs/MATH.md §9. Each group's kind transports it (its view `kinds.Fusion`: its units' features,
its plans, its element, its projection, or why it cannot); the OT kernels are
`solvers/transport.py`.

Nothing is modified in place; the fused params have the anchor's leaves and dtypes. The task head
(the top-level key "head") is the anchor's (task_head="anchor", as in `rotsym_jax.merge`) or
averaged (task_head="merge", heads of equal shape only). Registered in `merge.METHODS` as
"ot_fusion". POT is imported only when a plan is solved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

import rotsym_jax as rj

from .. import checks
from ..engine.groups import apply_transform
from ..errors import InputError
from ..options import OT_SOURCES, OT_TRANSPORTS
from ..precision import exact
from ..pytree import flatten, unflatten
from ..spec import BoundSpec, Spec, bind
from ..transforms import identity_transform
from . import methods
from .stats import layer_inputs

TASK_HEAD = checks.TASK_HEAD

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
    for group in bound_a.groups:  # each kind says what OT fusion cannot transport of it
        refusal = rj.kinds.of(group).fusion.refusal(group)
        if refusal:
            raise InputError(refusal)
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

def _features(bound: BoundSpec, flat, source, checkpoint, params, batches):
    """{group name: its units' features, as its kind's view of OT fusion makes them}."""
    inputs = _recorded_inputs(bound, checkpoint, params, batches) if source == "activations" else {}
    return {g.name: rj.kinds.of(g).fusion.features(g, flat, inputs.get(g.name)) for g in bound.groups}


def _recorded_inputs(bound: BoundSpec, checkpoint, params, batches):
    """{group name: [per layer (rows, n or H*dh) float64]}: the inputs of the kernels its kind reads
    (`Fusion.input_paths`), from `stats.layer_inputs`."""
    wanted = {g.name: rj.kinds.of(g).fusion.input_paths(g, bound) for g in bound.groups}
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


# ---- one model ------------------------------------------------------------------------------------

def _transport_one(bound, params, flat, feats, feats_a, transport, reg, i):
    plans, solved = {}, {}
    for group in bound.groups:
        what = f"params_list[{i}], group {group.name!r}"
        group_plans, solved[group.name] = rj.kinds.of(group).fusion.plans(group, feats[group.name], feats_a[group.name], transport, reg, what)
        plans.update(group_plans)
    if transport == "hard":
        t = identity_transform(bound)
        for group in bound.groups:
            t[group.name] = rj.kinds.of(group).fusion.element(group, solved[group.name], f"params_list[{i}], group {group.name!r}")
        return apply_transform(bound, params, t), plans, t
    shapes = dict(bound.shapes)
    new = {}
    for group in bound.groups:  # the barycentric projection of every member slice of every unit (float32, the leaves' dtypes)
        new.update(rj.kinds.of(group).fusion.soft(group, flat, solved[group.name], shapes))
    return unflatten({**flat, **new}), plans, None
