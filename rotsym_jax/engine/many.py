"""`align_many(params_list, spec)`: align N >= 2 models to one common reference, for merging.

It minimises F = sum_i ||theta_i - m||^2 (m the mean of the aligned models) by Gauss-Seidel
sweeps: each model in turn is aligned, from its original params, to the leave-one-out mean of
the others, and an update that does not lower F is rejected, so F never increases. Models are
visited in an order given by their contents, never by their position, which makes the result
independent of the input order. The derivation, the initialisation (the medoid) and the stopping
rules are in docs/MATH.md §8.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from ..errors import InputError, InputTypeError
from ..options import MANY_MODES, AlignOptions, ManyOptions
from ..precision import exact, exact_jit, upcast
from ..pytree import check_same_leaves, content_digest, fingerprint, flatten, unflatten
from ..spec import BoundSpec, Spec, SpecError, bind
from ..transforms import identity_transform
from . import residual as residual_mod
from .alignment import align, check_finite, identity_like, set_aside
from .groups import apply_unchecked
from .report import moved as what_moved

MODES = MANY_MODES


@dataclasses.dataclass(frozen=True)
class ManyResult:
    """params: the aligned models, in input order (each computes its original's function).
    transforms: transforms[i] maps params_list[i] to params[i] (`apply_transform`).
    objective: F = sum_i ||params[i] - reference||^2 after initialisation (objective[0]) and after
        each sweep; non-increasing. A task head or pooler that not every model holds alike is set
        aside (`Spec.optional`, as `align` does): each model keeps its own (moved only by a
        residual transform), and F and the reference leave it out.
    reference: the mean of the aligned models (each leaf in its input dtype): the merged model.
    report: {"mode", "reference_model" (input index of the medoid / anchor), "sweeps"
        (mode="mean"), "accepted" and
        "rejected" (counts of single-model updates), "stop" ("converged", "rejected": a sweep
        changed no model, "max_iters", "zero_objective" or "single_pass" for mode="anchor"),
        "rejected_objective" (F the last rejected update would have given, or None), "unaligned_objective" (F of the inputs), "order" (the
        canonical order used, as input indices; mode="mean"), "settled" (a data method's
        residual="auto": the group chosen for every model, as `align` reports it), "moved" (per model,
        in input order, what its transforms move: `report.moved`, the identity's, of that group's
        shape, where a model stays as given)}."""

    params: list
    transforms: list
    objective: list
    reference: dict
    report: dict = dataclasses.field(default_factory=dict)


@exact
def align_many(
    params_list, spec: Spec, *, mode: str = ManyOptions.mode, max_iters: int = ManyOptions.max_iters, tol: float = ManyOptions.tol,
    progress=None, data=None, checkpoint=None, key=None, **align_options
) -> ManyResult:
    """Align N >= 2 models of one architecture to a common reference (see the module docstring).

    mode: "mean" (medoid initialisation, then Gauss-Seidel leave-one-out-mean sweeps with a
        monotone safeguard; independent of the input order) or "anchor" (all aligned to
        params_list[0] in one pass: the baseline).
    max_iters: at most this many sweeps (>= 1; unused by mode="anchor").
    tol: stop when a sweep lowers F by less than this fraction of F.
    progress: None, or a callable called with no arguments after each pass over the models: the
        initial alignment (to the medoid, or to the anchor), then each sweep, so
        1 + report["sweeps"] times (once for mode="anchor"); a sweep aligns every model once.
    align_options: passed to `align` unchanged (attention, heads, rescale, ffn, layers,
        polar_method, method), and `data`, `checkpoint` with them (method="activations": each
        model and the reference it is aligned to run on the data).
    """
    ManyOptions(mode, max_iters, tol)  # checked (`options.ManyOptions`: the defaults every path reads)
    if progress is not None and not callable(progress):
        raise InputTypeError(f"progress={progress!r}; expected None or a callable taking no arguments")
    settled = AlignOptions.of(align_options).settled()  # checked once, before any work
    align_options = settled.as_dict()
    if align_options["method"] != "weights":
        if data is None or checkpoint is None:
            raise InputError(f"method={align_options['method']!r} runs the models on data: give data= and checkpoint=")
        align_options.update(data=list(data), checkpoint=checkpoint, key=key)
    if isinstance(params_list, Mapping) or not isinstance(params_list, Sequence):
        raise InputTypeError(f"params_list must be a list or tuple of params pytrees, got {type(params_list).__name__}")
    params_list = list(params_list)
    if len(params_list) < 2:
        raise InputError(f"align_many needs at least 2 models, got {len(params_list)}")
    full = [flatten(p) for p in params_list]
    flats, heads = set_aside(spec, full)  # a head or pooler not every model holds alike
    check_same_leaves(flats, [f"params_list[{i}]" for i in range(len(flats))], SpecError)
    if any(heads):
        bound = bind(spec.spec if isinstance(spec, BoundSpec) else spec, unflatten(flats[0]))
        params_list = [unflatten(f) for f in flats]
    else:
        bound = bind(spec, params_list[0])  # the spec against the params, before any work
    for i, params in enumerate(params_list):
        check_finite(params, f"params_list[{i}]")
    chosen = {}
    if settled.residual == "auto":  # a data method: the strongest stream group all the models allow, one for every pair
        mode_of_stream, why = residual_mod.strongest_of(bound.streams, flats)
        settled, chosen = settled.settled(mode_of_stream), {"settled": {"residual": mode_of_stream, "why": why}}
        align_options["residual"] = settled.residual
    identity = identity_transform(bound)
    dtypes = tuple((p, jnp.result_type(x).name) for p, x in flats[0].items())
    run = _anchor if mode == "anchor" else _mean
    tick = progress if progress is not None else (lambda: None)
    aligned, transforms, objective, total, report = run(params_list, flats, bound, identity, max_iters, tol, align_options, tick)
    reference = unflatten(_mean_as(total, len(params_list), dtypes))
    if any(heads):  # each model's own head back, moved where it reads a moved residual stream
        aligned = [_with_head(spec, full[i], aligned[i], heads[i], transforms[i]) for i in range(len(full))]
    return ManyResult(aligned, transforms, objective, reference, {"mode": mode, **report, **chosen, "moved": moved_per_model(bound, settled, transforms)})


def moved_per_model(bound: BoundSpec, options: AlignOptions, transforms: list) -> list:
    """Each model's `moved` section: what its transforms move, the identity (`identity_like`, the
    stream's too where `options` solve it) standing for a model that stays as given or a group
    its transforms lack (None: a streamed model never moved), so every path reports alike."""
    identity = identity_like(bound, options)
    return [what_moved(bound, {**identity, **(t or {})}) for t in transforms]


def _with_head(spec, original: dict, aligned_body: dict, head: dict, transforms: dict) -> dict:
    if not head:
        return aligned_body
    bound = bind(spec.spec if isinstance(spec, BoundSpec) else spec, unflatten(original))
    if not bound.streams_in(transforms):
        return unflatten({**flatten(aligned_body), **head})
    return apply_unchecked(bound, unflatten(original), transforms)


# ---- the two modes ---------------------------------------------------------------------------------

def _anchor(params_list, flats, bound, identity, max_iters, tol, options, tick):
    aligned, transforms = [unflatten(flats[0])], [identity]
    for params in params_list[1:]:
        result = align(params_list[0], params, bound, **options)
        aligned.append(result.params)
        transforms.append(result.transforms)
    tick()
    _, unaligned = _total_and_objective(flats)
    total, objective = _total_and_objective([flatten(p) for p in aligned])
    report = dict(reference_model=0, accepted=0, rejected=0, stop="single_pass", rejected_objective=None, unaligned_objective=unaligned)
    return aligned, transforms, [objective], total, report


def _mean(params_list, flats, bound, identity, max_iters, tol, options, tick):
    n = len(params_list)
    order = _canonical_order(flats)  # work in this order; map back at the end
    originals = [params_list[i] for i in order]
    total, unaligned, per_model = _total_and_objective([flats[i] for i in order], per_model=True)
    # sum_j ||x_i - x_j||^2 = N ||x_i - m||^2 + F: the medoid is the model closest to the mean.
    # min() returns the first minimum: ties go to the lowest canonical (content-based) index.
    medoid = min(range(n), key=lambda c: per_model[c])

    current, transforms = [], []
    for c in range(n):
        if c == medoid:
            current.append(unflatten(flatten(originals[c])))  # a new dict, the same leaves
            transforms.append(identity)
        else:
            result = align(originals[medoid], originals[c], bound, **options)
            current.append(result.params)
            transforms.append(result.transforms)
    current_flats = [flatten(p) for p in current]
    total, objective = _total_and_objective(current_flats)
    tick()

    def update(c):
        result = align(unflatten(leave_one_out(total, current_flats[c], n)), originals[c], bound, **options)
        flats = current_flats[:c] + [flatten(result.params)] + current_flats[c + 1:]
        new_total, new_objective = _total_and_objective(flats)

        def keep():
            nonlocal total, current_flats
            current[c], transforms[c], current_flats, total = result.params, result.transforms, flats, new_total

        return new_objective, keep

    objectives, sweep_report = gauss_seidel(objective, n, update, max_iters, tol, tick, unaligned)

    aligned, transforms_out = [None] * n, [None] * n
    for c, i in enumerate(order):
        aligned[i], transforms_out[i] = current[c], transforms[c]
    report = dict(reference_model=order[medoid], sweeps=len(objectives) - 1, **sweep_report, unaligned_objective=unaligned, order=list(order))
    return aligned, transforms_out, objectives, total, report


# F at or below this fraction of the unaligned F: the aligned models coincide up to float rounding
# (models equal up to a symmetry end near 1e-13 of it, where sweeps only trade rounding).
COINCIDE = 1e-9


def gauss_seidel(objective: float, n: int, update, max_iters: int, tol: float, tick=lambda: None, unaligned: float = 0.0
                 ) -> tuple[list, dict]:
    """The sweeps of mode="mean" from F = `objective`: each sweep visits the models c = 0..n-1
    (canonical order); `update(c)` aligns model c to the leave-one-out mean of the models as they
    are and returns (F with it, `keep`), and `keep()` is called only if F falls (the safeguard).
    Stops as the module docstring says, and once F <= COINCIDE * `unaligned` (F of the inputs). Returns (F after the start and each sweep, {"accepted",
    "rejected", "stop", "rejected_objective"}). The in-memory and the streamed `align_many` both run it."""
    objectives = [objective]
    accepted = rejected = 0
    stop, rejected_objective = "max_iters", None
    for _ in range(max_iters):
        if objective <= COINCIDE * unaligned:
            stop = "zero_objective"
            break
        start, changed = objective, 0
        # Gauss-Seidel sweep in the canonical order: each model aligned to the leave-one-out mean
        # of the models as they are now (earlier updates of the sweep included).
        for c in range(n):
            new_objective, keep = update(c)
            if not new_objective < objective:  # the safeguard: this model keeps its alignment
                rejected += 1
                rejected_objective = new_objective
                continue
            accepted += 1
            changed += 1
            keep()
            objective = new_objective
        objectives.append(objective)
        tick()
        if changed == 0:
            stop = "rejected"
            break
        if (start - objective) / start < tol:
            stop = "converged"
            break
    return objectives, dict(accepted=accepted, rejected=rejected, stop=stop, rejected_objective=rejected_objective)


# ---- validation ------------------------------------------------------------------------------------

# ---- jitted tree maps ------------------------------------------------------------------------------

@exact_jit
def total_and_squares(flats):
    """The sum over models of every leaf (compute dtype) and, per model, the squared distance of
    each leaf to the mean: (N, leaves). Models are summed in list order."""
    n = len(flats)
    total = {p: sum(upcast(f[p]) for f in flats) for p in flats[0]}
    mean = {p: t / n for p, t in total.items()}
    squares = jnp.stack([jnp.stack([jnp.sum(jnp.square(upcast(f[p]) - mean[p])).astype(jnp.float32) for p in f]) for f in flats])
    return total, squares


def _total_and_objective(flats, per_model=False):
    """(sum of the models, F) or, with per_model, (sum, F, [||x_i - m||^2]). The per-leaf squares
    are added on the host in exact arithmetic (math.fsum), so F is accurate to float32 rounding
    of each leaf's sum, whatever the number of leaves."""
    total, squares = total_and_squares(flats)
    squares = np.asarray(squares, np.float64)
    per = [math.fsum(row) for row in squares]
    objective = math.fsum(squares.ravel())
    return (total, objective, per) if per_model else (total, objective)


@exact_jit
def leave_one_out(total, flat, n):
    """The mean of the other models: (N m - theta_i) / (N - 1), N m being the running sum."""
    return {p: (t - upcast(flat[p])) / (n - 1) for p, t in total.items()}


@functools.partial(exact_jit, static_argnums=(1, 2))
def _mean_as(total, n, dtypes):
    """The mean, each leaf cast to its input dtype; dtypes: ((path, dtype name), ...)."""
    return {p: (total[p] / n).astype(d) for p, d in dtypes}


# ---- canonical, content-based order ---------------------------------------------------------------

def _canonical_order(flats):
    """Input indices sorted by a content key: `stats.fingerprint`, then (only among models whose
    fingerprints are bitwise equal) a SHA-256 of their bytes. Only bitwise-equal models keep
    their input order relative to each other, and swapping those changes nothing."""
    prints = [fingerprint(f) for f in flats]
    counts = {}
    for key in prints:
        counts[key] = counts.get(key, 0) + 1
    keys = [(key, content_digest(f) if counts[key] > 1 else "") for key, f in zip(prints, flats)]
    return sorted(range(len(flats)), key=lambda i: keys[i])
