"""Rotations of latent spaces under an RMSNorm (MATH §17, `align(latents="rotation")`): the units of a
permutation group that pass an RMSNorm whose gain `Spec.unit_norms` names (a member of role "norm",
`PermGroup.rotatable`), read after it by linear layers alone (MLA's q_lora and kv_lora latents).

RMSNorm's mean square is kept by every orthogonal R, but its gain g is one per entry:
`g ⊙ (x R)/rms ≠ (g ⊙ x/rms) R` unless g is uniform. Folded into the readers' rows (`W_b → diag(g)
W_b`, `g → 1`: the same function), every orthogonal R is a symmetry: `W_a → W_a R` (and its bias),
`W_b → R^T W_b`. The fold is the residual stream's (`residual.Folds`, one rule for a whole model
and for each tensor a streamed run reads), on a record of the latents' gains and readers
(`latent_stream`)."""

from __future__ import annotations

import jax

from ..errors import InputError
from ..precision import exact, is_traced
from ..pytree import flatten, unflatten
from ..spec import UNIT_NORM_ROLE, BoundSpec, ResidualStream, Spec, bind
from ..transforms import UnitPermutation, identity_transform, random_orthogonal
from .residual import Folds, nonuniform_gains


def rotatable_groups(bound: BoundSpec) -> tuple:
    """The permutation groups whose units may rotate once their norm's gain is folded."""
    return tuple(g for g in bound.perms if g.rotatable)


def readers(group, shapes: dict) -> tuple:
    """The members that read the latent: kernels with its units on their input axis (0)."""
    return tuple(m for m in group.members if m.role != UNIT_NORM_ROLE and m.axis == 0 and len(shapes[m.paths[0]]) >= 2)


def latent_stream(bound: BoundSpec) -> ResidualStream | None:
    """The latents' gains and, per gain, the kernels whose input rows absorb it, in the form
    `residual.Folds` reads (an RMSNorm whose gain multiplies as stored); None where the spec has no
    rotatable group."""
    shapes, axes, folds = dict(bound.shapes), [], []
    groups = rotatable_groups(bound)
    for group in groups:
        gain = next(m for m in group.members if m.role == UNIT_NORM_ROLE)
        reading = readers(group, shapes)
        for i, path in enumerate(gain.paths):
            folds.append((path, tuple(m.paths[i] for m in reading)))
            axes.extend((m.paths[i], 0) for m in reading)
    if not groups:
        return None
    return ResidualStream(groups[0].size, tuple(axes), "rmsnorm", tuple(g for g, _ in folds), tuple(folds))


def with_latents(streams: tuple, bound: BoundSpec) -> tuple:
    """`streams` (the residual streams whose folds are taken) with the latents' folds added, for
    `residual.Folds` (a streamed run folds each tensor by them as read)."""
    latent = latent_stream(bound)
    return tuple(streams) + (() if latent is None else (latent,))


@exact
def fold_latents(spec: Spec | BoundSpec, params) -> dict:
    """New params computing the same function with each latent norm's gain (`Spec.unit_norms`) moved
    into the input rows of the kernels that read the latent (gain -> 1, W_b -> diag(g) W_b), after
    which any rotation of the latent keeps the function (MATH §17). Params without such a group come
    back as they are."""
    bound = bind(spec, params)
    stream = latent_stream(bound)
    if stream is None:
        return params
    flat = dict(flatten(params))
    folds = Folds(stream, flat)
    return unflatten({path: folds.leaf(path, leaf, flat.__getitem__) for path, leaf in flat.items()})


def check_foldable(bound: BoundSpec, flat, what: str) -> None:
    """InputError where a latent's gain is not uniform: a rotation of it would change the function.
    Inside jit (traced gains) nothing can be read: the caller folded (as the residual stream's check)."""
    stream = latent_stream(bound)
    if stream is None or is_traced([flat[g] for g in stream.gains if g in flat]):
        return
    bad = nonuniform_gains(stream, flat)
    if bad:
        raise InputError(f"{what}: latent norm gains {bad[:4]} (of {len(bad)}) are not uniform, so a rotation of the latent would change the "
                         "function; fold them into the layers reading the latent first: rj.fold_latents(spec, params) on both models "
                         "(function-preserving; the command line does it for --latents rotation)")


def check_rotations(bound: BoundSpec, params, transforms) -> None:
    """`apply_transform`'s check of the latent rotations in `transforms`: their gains uniform."""
    rotated = [g for g in rotatable_groups(bound)
               if isinstance(transforms.get(g.name), UnitPermutation) and transforms[g.name].rotation is not None]
    if rotated:
        flat = flatten(params)
        check_foldable(bound, {p: flat[p] for g in rotated for m in g.members if m.role == UNIT_NORM_ROLE for p in m.paths}, "params")


def random_latent_rotations(spec: Spec | BoundSpec, params, key) -> dict:
    """{group name: UnitPermutation with a Haar rotation per layer} for every rotatable group (the
    identity elsewhere: `identity_transform`'s), to plant with `apply_transform` on folded params."""
    bound = bind(spec, params)
    out = identity_transform(bound)
    for group in rotatable_groups(bound):
        key, k = jax.random.split(key)
        out[group.name] = out[group.name].replace(rotation=random_orthogonal(k, (len(group.layers),), group.size))
    return out


__all__ = ["with_latents", "check_foldable", "check_rotations", "fold_latents", "latent_stream", "random_latent_rotations",
           "readers", "rotatable_groups"]
