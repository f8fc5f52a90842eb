"""The residual-stream kind ("residual"): the basis of the stream every layer reads and writes
(`spec.ResidualStream`), moved by one element for the whole model (or for each of its streams) (`transforms.ResidualTransform`:
a permutation of the coordinates, with sign flips or a rotation where the norms allow it; MATH §8),
acting on another axis of the leaves the per-layer groups move, so it commutes with them.

What sets it apart from the per-layer kinds: it is solved around them, not beside them, by the
residual descent (`engine/residual.py`: each sweep solves the groups in the stream's current
basis, then the stream from its cross products), so it has no `GroupSolver`, no activation sites
and no cost matrices of the driver's, and OT fusion does not transport it. A run solves it where
`options.residual` is not "none" (`solved`); a transforms dict holds its element under the
stream's name, `RESIDUAL` for a model's one stream (`BoundSpec.groups_of`). A model may have
several streams that share no tensor (Whisper's encoder and decoder): each is a group of this kind."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..engine.groups import act_on_stream
from ..engine.report import MOVED_TOL, fraction, rounded, unmoved
from ..engine.residual import fixes_ones, fixing_ones
from ..options import AlignOptions
from ..solvers.stretch import cayley
from ..spec import ResidualStream
from ..transforms import ResidualTransform
from .base import Kind, Learned


def solved(bound, options: AlignOptions) -> tuple:
    """The streams (one group each) where `options` solve them for `bound` (else empty)."""
    return bound.streams if options.residual != "none" else ()


def summary(stream, t) -> dict:
    """What moved: "coordinates" the fraction of stream coordinates T does not keep (a
    permutation's moved and, with a rotation, those whose column of T is not their own unit
    vector: a flipped sign counts), "rotation" ||T - I||_F / sqrt(2 d) where a rotation (or a
    signed permutation) is solved. T = x[..., perm] @ R: a new coordinate j stays where T's column
    j is e_j (T[j, j] = 1, its columns being unit vectors), and ||T - I||_F^2 = ||R||_F^2 - 2 tr T
    + d, read from R in row blocks (a float64 copy of a d x d rotation would double what the report
    holds)."""
    perm = np.asarray(t.perm)
    d = perm.shape[-1]
    if t.rotation is None:
        return {"coordinates": fraction(perm != np.arange(d))}
    rotation = np.asarray(t.rotation)
    diagonal = rotation[perm.argsort(), np.arange(d)].astype(np.float64)  # T[j, j] = R[perm^-1[j], j]
    squares = sum(float(np.square(rotation[i:i + 256].astype(np.float64)).sum()) for i in range(0, d, 256))
    distance = float(unmoved(np.sqrt(max(squares - 2 * diagonal.sum() + d, 0.0) / (2 * d)), 0.0)) if d else 0.0
    return {"coordinates": fraction(np.abs(diagonal - 1) > MOVED_TOL), "rotation": rounded(distance)}


def said(m: dict) -> list[str]:
    """`summary` as the command line prints it (nothing: nothing moved)."""
    if not m["coordinates"] and not m.get("rotation"):
        return []
    return [f"{m['coordinates']:.0%} of coordinates moved"] + ([f"rotation {m['rotation']:.3g} from the identity"] if "rotation" in m else [])


def mixed(stream, t) -> set[str]:
    """The leaves whose coordinates a rotation of the stream mixes (none for a permutation)."""
    return set() if t.rotation is None else {p for p, _ in stream.axes}


def act(stream, leaves, t) -> dict:
    """Every leaf on the stream moved along its stream axes (another axis of the leaves the
    per-layer groups move: it commutes with them)."""
    return act_on_stream(stream, {p: leaves[p] for p, _ in stream.axes}, t)


def gains(stream, t) -> list:
    """The stream's norm gains under a rotation (they follow its permutation alone)."""
    return [] if t.rotation is None else [(p, t.rotation) for p in stream.gains]


def refusal(stream, options: AlignOptions, traced: bool) -> str | None:
    if options.residual == "signed_permutation" and options.method != "weights":
        return f"residual='signed_permutation' is solved from weights only; method={options.method!r} does not solve it yet"
    return None


# ---- learned alignment (MATH §10): the start's rotation times cayley(K), K skew ------------------------------

def _initial(stream, t0, frame, options: AlignOptions):
    """K = 0 (of d - 1 entries on a LayerNorm stream, whose rotations fix the ones vector) with
    residual="rotation" on a stream that rotates (a model's stream that took a permutation under
    the ceiling has none); the permutations keep the closed form's."""
    if options.residual != "rotation" or t0.rotation is None:
        return None
    d = stream.size - (1 if fixes_ones(stream) else 0)
    return jnp.zeros((d, d), jnp.float32)


def _element(stream, t0, k, projected):
    delta = fixing_ones(cayley(k)) if fixes_ones(stream) else cayley(k)
    return t0.replace(rotation=t0.rotation @ delta)


def _straight_through(stream, params, t, flat) -> dict:
    """The stream moved after every group's straight-through copies: another axis of the same leaves."""
    return act(stream, flat, t)


LEARNED = Learned(initial=_initial, element=_element, straight_through=_straight_through)


KIND = Kind(group=ResidualStream, element=ResidualTransform, solver=None, summary=summary, said=said, activations=None,
            cost_matrices=None, mixed=mixed, refusal=refusal, learned=LEARNED, fusion=None, act=act, gains=gains)
