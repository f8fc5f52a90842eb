"""The permutation kind ("permutation"): a permutation group's units (`spec.PermGroup`: an FFN's
hidden units, Mamba's channels, MLA's latents), moved by a permutation per layer
(`transforms.UnitPermutation`), solved by a linear assignment per layer on the host
(`engine/ffn.py`, `solvers/assignment.py`), learned by the straight-through estimator. A gated
FFN's units, which a positive scale each moves too, are a kind of their own built on this one
(`kinds/scaled_units.py`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..engine import activations, ffn
from ..engine.driver import in_frame_of
from ..engine.groups import stacked, unstacked
from ..engine.report import MOVED_TOL, fraction, from_identity, mean, unmoved, value_range, with_layers
from ..errors import InputError
from ..options import AlignOptions
from ..precision import exact_jit, is_traced
from ..solvers import assignment, procrustes, transport
from ..spec import GAIN_ROLES, UNIT_NORM_ROLE, PermGroup, counted
from ..transforms import UnitPermutation
from .base import ActivationSites, Fusion, GroupSolver, Kind, Learned, every_member, input_member, unmixed

# ---- the solver: a linear assignment per layer ---------------------------------------------------------


def layer_costs(group, members, leaves_a, leaves_b, options: AlignOptions, solved=()) -> list:
    """Each layer's cost matrices over `members`; with several local devices, concrete leaves and no
    default device set (`jax.default_device`: the caller, as a streamed run's lanes, placed the
    work), layer i's on device i % D: the devices compute them at once, the host assigns each as
    it arrives."""
    devices = jax.local_devices()
    traced = is_traced(leaves_a, leaves_b)
    spread = len(devices) > 1 and not traced and jax.config.jax_default_device is None
    # Its leaves shared with a group solved after it (a latent's readers, the heads'; Mamba's A_log, the state's) are
    # in B's frame of that group's axis: not costed. Those shared with a group solved before it: in A's, moved by it.
    costed = dataclasses.replace(group, members=members)
    leaves_b = in_frame_of(group, leaves_b, solved, options)
    return [ffn.unit_costs(costed, leaves_a, leaves_b, i, devices[i % len(devices)] if spread else None) for i in range(len(group.layers))]


def assign(costs: list, traced: bool):
    """The assignments: on a pool of host threads, each matrix awaited as the device delivers it
    (a matrix the device certifies optimal never leaves it); traced (inside jit / vmap), the
    stacked matrices go to the host in one `assignment.assign` callback."""
    if traced:
        offsets = tuple(jnp.stack(o) for o in zip(*(cost.offsets() for cost in costs)))
        return assignment.assign(jnp.stack([cost.scores for cost in costs]), offsets=offsets, traced_nonfinite="identity")
    solved = assignment.linear_assignments([c.scores for c in costs], offsets=[c.offsets() for c in costs])
    return np.stack(solved).astype(np.int32)


def rotates(group, options: AlignOptions) -> bool:
    """Whether `group` is solved as rotations: a latent under an RMSNorm (`PermGroup.rotatable`) with
    latents="rotation" (its gain folded: MATH §17)."""
    return options.latents == "rotation" and group.rotatable


def _statistics(group, leaves_a, leaves_b, options: AlignOptions, solved=()):
    if options.ffn == "none":
        return None
    if rotates(group, options):  # the writer's columns and bias: the folded gain, uniform, scores no rotation
        return layer_costs(group, tuple(m for m in group.reads if m.role != UNIT_NORM_ROLE), leaves_a, leaves_b, options, solved)
    return layer_costs(group, group.reads, leaves_a, leaves_b, options, solved)


def _reduce(group, costs, options: AlignOptions, traced: bool):
    if costs is not None and rotates(group, options):
        # R_l = polar(M_l), M_l = X_B^T X_A over the writer: one program per layer (every chunk's the same bits)
        rotation = jnp.stack([procrustes.polar(c.scores, method=options.polar_method) for c in costs])
        return UnitPermutation(jax.device_put(np.tile(np.arange(group.size, dtype=np.int32), (len(costs), 1))), rotation=rotation)
    return None if costs is None else assign(costs, traced)


def _combine(parts):
    if isinstance(parts[0], UnitPermutation):  # rotations: each chunk's element over its layers
        return parts[0] if len(parts) == 1 else jax.tree.map(lambda *x: jnp.concatenate(x), *parts)
    return parts[0] if parts[0] is None or len(parts) == 1 else np.concatenate(parts)


def _solve(group, perms, options: AlignOptions):
    if isinstance(perms, UnitPermutation):
        return perms
    # device_put: jnp.asarray of a host array compiles a copy per shape
    return UnitPermutation.identity(group) if perms is None else UnitPermutation(jax.device_put(perms))


SOLVER = GroupSolver(
    statistics=_statistics,
    reduce=_reduce,
    combine=_combine,
    solve=_solve,
    host_reduce=True,
)


# ---- what moved (the report's `moved`) ----------------------------------------------------------------

def summary(group, t) -> dict:
    """What moved: "units" the fraction of units not fixed, "scale" the units' [min, max] where
    their scales are solved, "rotation" a latent's rotations' mean distance from the identity,
    "unit" what its units are where the spec names them (Mamba's channels, state entries)
    (engine/report.py's `moved`)."""
    perm = np.asarray(t.perm)
    n, size = perm.shape
    left = perm != np.arange(size)
    layer = left.any(axis=1)
    out = {"units": fraction(left)}
    if t.scale is not None:
        scale = unmoved(np.asarray(t.scale, np.float64), 1.0)
        layer = layer | (np.abs(scale - 1).max(axis=1, initial=0) > MOVED_TOL)
        out["scale"] = value_range(scale)
    if t.rotation is not None:  # a latent's rotation (MATH §17): the mean over layers of ||R - I||_F / sqrt(2 n), as every map's
        moved = from_identity(t.rotation)
        layer = layer | (moved > MOVED_TOL)
        out["rotation"] = mean(moved)
    out = with_layers(n, layer, out)
    if group.unit is not None:
        out["unit"] = group.unit
    return out


# ---- activation matching's sites (engine/activations.py) ------------------------------------------------

def check(group, shapes) -> None:
    # a kernel reading the units on axis 0: (units, d), or (units, entries, d) where each unit is a block of entries
    # (a Gated DeltaNet's key heads: their conv and out kernels, whose inputs its forward pass records)
    if not any(m.axis == 0 and len(shapes[m.paths[0]]) >= 2 for m in group.members if m.paths[0].endswith("/kernel")):
        raise InputError(f"group {group.name}: no linear layer reads its units, so "
                         "activations give it no site; align this model from its weights (method 'weights')")


def latent_writer(group, member) -> bool:
    """A kernel writing the units of a permutation group whose readers an attention block holds (MLA's
    latents, solved before the block: `Member.also`): its outputs are the units' site (the readers'
    inputs are the heads')."""
    return (len(group.reads) < len(group.members) and member in group.reads and member.axis == 1
            and member.paths[0].endswith("/kernel"))


def reads(group, member) -> tuple[bool, bool]:
    """A latent's writer: its outputs; a hidden layer's reader: its input, the units."""
    return (True, True) if latent_writer(group, member) else (member.axis == 0, False)


def site(group, member, path, options):
    if latent_writer(group, member):
        return path + activations.OUT
    if not path.endswith("/kernel") or member.role in GAIN_ROLES:
        return None
    return path if member.axis == 0 else None


def pseudo(group, member, path, x):
    if x is not None and x.ndim > 2:
        # (tokens, units, entries): each entry standardised, (units, entries, tokens) where the kernel (units, entries, d)
        # is, so that two units cost the sum of their entries' correlations, entry by entry (the group keeps a unit's entries in place)
        z = activations.standardised(x.reshape(len(x), -1)).reshape(x.shape)
        return np.asarray(np.moveaxis(z, 0, -1), order="C")
    if x is not None:
        # (tokens, units) standardised, so that the cost is the units' correlation (a latent's: where its writer's are, axis 1)
        x = activations.standardised(x)
        return x if member.axis == 1 else x.T
    return activations.zeros_leaf(member, path, group.size)


SITES = ActivationSites(check=check, reads=reads, site=site, pseudo=pseudo)


# ---- the memory model, and what it cannot solve -------------------------------------------------------

def cost_matrices(group, per_layer: bool) -> tuple[int, int]:
    """Every layer's cost matrix at once (`align` dispatches them all), or one layer's."""
    return (1 if per_layer else len(group.layers)) * group.size * group.size * 4, 0


def refusal(group, options: AlignOptions, traced: bool) -> str | None:
    """A group solved after another whose leaves it shares (Mamba's state and time step, Llama 4's
    projector): from weights only; the data methods' sites and free copies are one per leaf, of one
    group."""
    if group.after and options.method != "weights":
        return (f"permutation group {group.name!r} shares its leaves with {group.after[0]!r} (each leaf moved on two axes): solved from "
                f"weights only; method={options.method!r} does not solve it yet")
    return None


def said(m: dict) -> list[str]:
    """`summary` as the command line prints it."""
    units = counted(2, m["unit"]).split(" ", 1)[1] if "unit" in m else "units"  # the group's own noun, plural
    rotated = [f"rotation {m['rotation']:.3g} from the identity"] if "rotation" in m else []
    return [f"{m['units']:.0%} of {units} permuted"] + ([f"scales {m['scale'][0]:.3g} to {m['scale'][1]:.3g}"] if "scale" in m else []) + rotated


# ---- learned alignment's parametrisation (engine/learned.py): the straight-through estimator ----------------

def _initial(group, t0, frame, options: AlignOptions):
    """The free copy W of the group's leaves, B's as `frame` moved them (Ainsworth et al. 2023);
    None with ffn="none"."""
    if options.ffn == "none":
        return None
    return {"free": {path: jnp.asarray(frame[path], jnp.float32) for member in group.members for path in member.paths}}


def _project(group, params, flat_b):
    """The permutation P of B's units closest to the free copy's, per layer: the cost matrices on
    the device, the linear assignments on the host (outside the step, which then holds no host
    callback)."""
    scores = _projection_scores(group, params["free"], flat_b)
    return jnp.asarray(assignment.batched_linear_assignment(np.asarray(scores)), jnp.int32)


@functools.partial(exact_jit, static_argnums=0)
def _projection_scores(group, free: dict, flat_b: dict):
    return jnp.stack([ffn.unit_costs(group, free, flat_b, i).scores for i in range(len(group.layers))])


def _straight_through(group, params, t, flat) -> dict:
    """B moved by P in the forward pass, the gradient passed to W as if W were used:
    W + stop_gradient(P(B) - W)."""
    if params is None:
        return {}
    return {path: (w + jax.lax.stop_gradient(flat[path].astype(jnp.float32) - w)).astype(flat[path].dtype)
            for path, w in params["free"].items()}


LEARNED = Learned(initial=_initial, project=_project, element=lambda group, t0, params, projected: UnitPermutation(projected),
                  straight_through=_straight_through)


def _gains(group, t) -> list:
    """A rotated latent's norm gain, per layer, with its layer's rotation."""
    if getattr(t, "rotation", None) is None:
        return []
    return [(p, t.rotation[i]) for m in group.members if m.role == UNIT_NORM_ROLE for i, p in enumerate(m.paths)]


def _mixed(group, t) -> set[str]:
    """A latent's rotation (latents="rotation", MATH §17) mixes its leaves; a permutation mixes none."""
    return every_member(group, t) if getattr(t, "rotation", None) is not None else unmixed(group, t)


# ---- OT fusion's view (merging/otfusion.py, MATH §9): a plan of units per layer ------------------------------

def _fusion_refusal(group) -> str | None:
    """A group whose every leaf is another's (Mamba's state and time step): its features are all
    in that group's unmatched frame. A chain whose groups each have a leaf of their own (Llama 4's
    adapter) is transported, the map they share read as stored by each."""
    if group.after and all(m.also is not None for m in group.members):  # a soft plan would blend a leaf of two groups along one axis
        return (f"OT fusion does not transport groups that share their leaves with another ({group.name!r}, on leaves of "
                f"{group.after[0]!r} too: Mamba's state and time step): align first and merge with an elementwise method")
    return None


def _fusion_features(group, flat, inputs):
    """(L, n, rows): each unit's weights over every member, or its recorded activations."""
    if inputs is not None:
        return np.stack([x.T for x in inputs])
    x = np.concatenate([np.asarray(stacked(flat, m, jnp.float32), np.float64) for m in group.members], axis=1)
    return np.swapaxes(x, 1, 2)


def _fusion_plans(group, features, features_a, transport_kind, reg, what):
    plan = transport.solve(transport.sq_dists(features, features_a), transport_kind, reg, what)
    return {group.name: plan}, plan


def _fusion_soft(group, flat, plan, shapes) -> dict:
    w = jnp.asarray(transport.barycentric(plan), jnp.float32)
    new = {}
    for m in group.members:
        y = jnp.einsum("lrj,ljk->lrk", stacked(flat, m, jnp.float32), w)  # (L, rows, n)
        new.update(unstacked(y, m, shapes, flat[m.paths[0]].dtype))
    return new


FUSION = Fusion(refusal=_fusion_refusal, input_paths=lambda group, bound: input_member(group, bound).paths, features=_fusion_features,
                plans=_fusion_plans, element=lambda group, plan, what: UnitPermutation(jnp.asarray(transport.plan_to_perm(plan, what))),
                soft=_fusion_soft)


KIND = Kind(group=PermGroup, element=UnitPermutation, solver=SOLVER, summary=summary, said=said, activations=SITES,
            cost_matrices=cost_matrices, mixed=_mixed, gains=_gains,
            refusal=refusal, learned=LEARNED, fusion=FUSION)
