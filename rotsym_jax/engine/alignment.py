"""`align(params_a, params_b, spec)`: move B, without changing its function, close to the anchor A.

Pipeline (MATH.md §2-5): bind the spec; dispatch the permutation-group cost matrices and the
attention solves to the device (jitted, batched over layers x kv groups); run the linear
assignments on the host while the device works; apply every transform (a program per group,
shared by its layers).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from ..memory import release_freed_memory
from ..options import AlignOptions
from ..precision import exact, exact_jit, is_traced
from ..pytree import check_same_leaves, fingerprint, flatten, unflatten
from ..solvers.batched import batch_cond, unbatched_at_one
from ..spec import BoundSpec, Spec, SpecError, bind
from ..timings import Clock
from ..transforms import ResidualTransform, identity_transform
from . import activations, choice, distances, driver
from . import latents as latents_mod
from . import learned as learned_mod
from . import residual as residual_mod
from .attention import EXACT_QUERY_MATCHINGS  # noqa: F401  (align's documented option limit)
from .groups import apply_unchecked, moved_by_others
from .report import alignment_report


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params", "transforms", "report"],
                   meta_fields=["bound", "source_fingerprint"])
@dataclasses.dataclass(frozen=True)
class AlignResult:
    """params: B moved to the anchor A (same function as B; its task head as it was, moved only by
    a residual transform). transforms: what was applied, usable with `apply_transform`,
    `invert_transform`, `compose_transforms`. report: Euclidean distances to A before and after
    (of the leaves that took part), in total, per kind ("qk", "vo", each permutation group, "other")
    and per layer, plus "timings": seconds per phase, the keys of `timings.TIMINGS` on every path
    (in memory "read", "transfer", "statistics", "merge" and "write" are 0; "assignment" and "attention"
    overlap inside "solve": the host assigns while the device solves the attention blocks), and
    "moved": what the transforms move, per group (`engine.report.moved`; built by
    `engine.report.alignment_report`, as a streamed run's report is).
    bound: the spec bound to the models (pass it on: `align_many`,
    `stats.follow`, `apply_transform` need not bind again). source_fingerprint: `fingerprint` of
    the B that was aligned, so statistics of that B can be checked and moved with the result.

    A pytree (params, transforms, report), so jitted and vmapped code can return it. There the
    report's distances are arrays, it has no timings, source_fingerprint is None (traced
    weights cannot be read), no "moved" or "condition_numbers", and report["nonfinite"] counts NaN/Inf
    inputs (`check_finite`)."""

    params: dict
    transforms: dict
    report: dict
    bound: BoundSpec
    source_fingerprint: str

    def check_finite(self) -> AlignResult:
        """This result, or the eager refusal (InputError naming the model and its leaves) where a
        traced align (jit, vmap) found NaN or Inf in A or B: it returned B as given, the identity
        transforms and report["nonfinite"] = {"params_a"/"params_b": {leaf: {"nan": n, "inf": n}}}.
        Call it outside the jitted function: it reads the counts back to the host."""
        return refuse_nonfinite(self)


@exact
def align(
    params_a,
    params_b,
    spec: Spec | BoundSpec,
    options: AlignOptions | Mapping | None = None,
    *,
    data=None,
    checkpoint=None,
    key=None,
    progress=None,
    **option_keywords,
) -> AlignResult:
    """Align model B to the anchor model A (A is returned untouched; B is moved).

    spec: a `Spec`, or a `BoundSpec` (from `bind` or a previous result's `bound`) of models with
        these leaves and shapes, which skips binding. A and B may have different task heads, or
        only one of them a head (a base model and its classification fine-tune), or only one a
        pooler: such parts (the spec's `optional`, the built-in families' `head/...` and
        `pooler/...`) are set aside, neither solved nor measured, and B's comes back as it was.
        Heads of the same leaves and shapes are measured like the body and score a residual
        transform (the command line sets every head aside: its `task_head`). No group moves a
        head; only a residual transform does, where it reads the stream.

    options: an `AlignOptions` (or a mapping of its fields; None: the defaults), each field
        described there; its fields may also be given as keywords, which take precedence
        (`align(a, b, spec, residual="permutation")`). Checked once, before any work.
    data: an iterable of batches, each a dict of model inputs as NumPy arrays ({"input_ids",
        "attention_mask"} for text, {"pixel_values"} for a ViT; "labels" for method="learned"'s
        task loss, which must index the logits; a causal LM's are its next tokens where absent):
        the same inputs for both models. Needed by method="activations" and "learned"; every
        token that is not padding is a row of every site's statistics (held in memory).
    checkpoint: the `Checkpoint` whose forward pass runs params_a and params_b (of its
        architecture), for the data methods; method="learned" needs its task head's logits.
    key: method="learned" with alpha="uniform": the PRNG key of the interpolation weights.
    progress: method="learned": called after each step.

    Inside `jax.jit`, `jax.vmap` and `jax.grad` (method="weights"): its derivative holds the
    chosen transforms constant (MATH.md §16: exact for permutations almost everywhere, and for
    the aligned distance where its optimum is unique). There NaN/Inf weights cannot be refused:
    B comes back as given, counted in report["nonfinite"] (`AlignResult.check_finite` refuses).
    """
    options = AlignOptions.of(options, **option_keywords)
    if options.method != "weights" and (data is None or checkpoint is None):
        raise InputError(f"method={options.method!r} runs both models on data: give data= (batches of model inputs) and "
                         "checkpoint= (the Checkpoint whose forward pass runs them)")
    if options.method == "weights" and is_traced(params_a, params_b):  # vmapped over one model: the jitted program
        # (traced even where an eager vmap hands the one model over as concrete arrays: the same results as vmap's)
        return _differentiable(params_a, params_b, spec, options)
    return _aligned(params_a, params_b, spec, options, data, checkpoint, key, progress)


def _differentiable(params_a, params_b, spec, options: AlignOptions) -> AlignResult:
    """Traced weight matching (jit, vmap, grad) whose derivative holds the transforms constant
    (MATH.md, "Differentiating through align"): the moved params' tangent is the tangent of B moved
    by the same transforms, and the distances' follow from it. That is exact wherever the solution
    is locally constant (permutations: almost everywhere), and for the aligned distance itself
    wherever the optimum is unique (the envelope theorem); the solvers' host assignments, batched
    branches and searches are never differentiated."""
    solve = unbatched_at_one(lambda a, b: _aligned(a, b, spec, options, traced=True))

    @jax.custom_jvp
    def aligned(a, b):
        return solve(a, b)

    @aligned.defjvp
    def moved_by_the_same_transforms(primals, tangents):
        result = solve(*primals)

        def remeasured(a, b):
            run = _Alignment(a, b, result.bound, options, None, None, traced=True)
            moved, sq_after = run.measured(result.transforms)
            before, after = (distances.summarise_distances(run.bound, sq) for sq in (run.sq_before, sq_after))
            return moved, distances.before_after(before, after)

        _, (d_moved, d_report) = jax.jvp(remeasured, primals, tangents)
        constant = jax.tree.map(_zero_tangent, result)
        return result, dataclasses.replace(constant, params=d_moved, report={**constant.report, **d_report})

    return aligned(params_a, params_b)


def _zero_tangent(x):
    x = jnp.asarray(x)
    return jnp.zeros_like(x) if jnp.issubdtype(x.dtype, jnp.inexact) else np.zeros(x.shape, jax.dtypes.float0)


def _aligned(params_a, params_b, spec, options: AlignOptions, data=None, checkpoint=None, key=None, progress=None, *,
             traced: bool = False) -> AlignResult:
    run = _Alignment(params_a, params_b, spec, options, data, checkpoint, traced)
    if options.method == "learned":
        transforms, moved, sq_after, winner, chosen = run.learned(key, progress)
    elif not options.fallback:
        winner, chosen = options.method, None
        transforms = run.solvers[options.method]()
        moved, sq_after = run.measured(transforms)
        if run.traced:  # non-finite inputs: B as given, never a transform solved from NaN
            transforms, moved, sq_after = run.kept_where(run.finite, transforms, moved, sq_after)
    elif run.traced:
        transforms, moved, sq_after, winner, chosen = run.identity_where_farther()
    else:
        transforms, moved, sq_after, winner, chosen = run.closest()
    return run.result(transforms, moved, sq_after, winner, chosen)


class _Alignment:
    """One call of `align`: the models checked and split from what is set aside, the report's
    "before" measured, and the ways to solve (`solvers`), measure and choose that its method uses."""

    def __init__(self, params_a, params_b, spec, options: AlignOptions, data, checkpoint, traced: bool = False):
        self.options, self.checkpoint, self.clock, self.start = options, checkpoint, Clock(), time.perf_counter()
        self.originals = params_a, params_b
        self.params_b = params_b
        bound = bind(spec, params_b)
        # A task head or pooler that not both models hold alike is set aside (Spec.optional), and a task
        # head always where the spec says so (Spec.task_head): B's come back as they were (moved by a
        # residual transform only); the rest is solved and measured.
        (flat_a, flat_b), (head_a, head_b) = set_aside(bound.spec, [flatten(params_a), flatten(params_b)])
        check_same_leaves([flat_a, flat_b], ["params_a", "params_b"], SpecError)
        self.full_bound, self.params_b_body = bound, params_b
        self.params_a = unflatten(flat_a) if head_a else params_a
        if head_b:
            bound = bind(bound.spec, unflatten(flat_b))
            self.params_b_body = unflatten(flat_b)
        self.bound, self.flat_a, self.flat_b = bound, flat_a, flat_b
        self.traced = traced = traced or is_traced(flat_a, flat_b)
        self.settled = None  # what "auto" became (the report's "settled"), where the data methods chose
        if options.residual == "auto" and options.method != "weights" and not traced:
            mode, why = residual_mod.strongest_of(bound.streams, [flat_a, flat_b])
            self.settled = {"residual": mode, "why": why}
            options = options.settled(mode)
        self.options = options = options.settled()
        by_record = driver.settled(bound, options.residual, options.method, options.ffn)
        if by_record:
            self.settled = {**(self.settled or {}), **by_record}
        driver.layer_masks(bound, options.layers)  # layers that do not exist: refused before any work
        refused = residual_mod.mode_refusal(bound.streams, options.residual)
        if refused:
            raise (InputError if bound.streams else SpecError)(refused)  # no stream: the spec's
        for group in bound.groups + rj.kinds.residual.solved(bound, options):  # what a kind cannot solve under these options, refused before any work
            refusal = rj.kinds.of(group).refusal(group, options, traced)
            if refusal:
                raise InputError(refusal)
        if options.latents == "rotation" and not traced:  # a latent rotates only with its norm's gain folded (MATH §17)
            latents_mod.check_foldable(bound, flat_a, "params_a (model A, the anchor)")
            latents_mod.check_foldable(bound, flat_b, "params_b (model B)")
        if traced:  # inside jit / vmap: nothing can be read back, so no refusal and no timings
            self.sq_before = distances.sq_dists(flat_a, flat_b)
            # NaN/Inf inputs are flagged instead (`nonfinite_counts`), and B comes back as given
            self.finite = jnp.isfinite(sum(self.sq_before.values()))
            self.nonfinite = nonfinite_counts(self.finite, {"params_a": flat_a, "params_b": flat_b})
        else:
            # Every leaf's distance first: the report's "before", and a free test for NaN/Inf weights,
            # which must be refused before any solve (LAPACK's SVD hangs on Inf; a NaN spreads through B).
            with self.clock.phase("distances"):
                self.sq_before = jax.device_get(distances.sq_dists(flat_a, flat_b))
            if not all(np.isfinite(v) for v in self.sq_before.values()):
                check_finite(params_a, "params_a (model A, the anchor)")
                check_finite(self.params_b_body, "params_b (model B)")
        if options.method != "weights" and traced:
            raise InputError(f"method={options.method!r} cannot run inside jit, vmap or grad: the forward passes read the data on the host")
        self.batches = None if data is None else (data if isinstance(data, (list, tuple)) else list(data))
        self.sweeps = []  # the residual descent's distance after each sweep
        self.learning = None
        self.identity = identity_like(bound, options)
        self.solvers = {"weights": self.by_weights, "activations": self.from_activations}

    def solve(self, flat_a, flat_b, source="weights"):  # source: what the leaves hold, weights or activations (`pseudo_leaves`)
        # learned's starts and activation matching solve the orthogonal maps; weight matching may descend to invertible ones
        maps = self.options.maps if self.options.method == source == "weights" else "orthogonal"
        run = driver.Solve(self.bound, dataclasses.replace(self.options, method=source, maps=maps), self.clock, traced=self.traced)
        run.add(self.bound, flat_a, flat_b, last=True)
        return run.finish()

    def by_weights(self):
        if self.options.residual == "none":
            return self.solve(self.flat_a, self.flat_b)
        transforms, per_sweep = _solve_with_residual(self.bound, self.params_a, self.params_b_body, self.solve, self.options, self.traced)
        self.sweeps.extend(per_sweep)
        return transforms

    def from_activations(self):
        return _solve_from_activations(self.bound, self.params_a, self.params_b, self.batches, self.checkpoint, self.solve, self.options,
                                       self.clock)

    def measured(self, transforms):
        """(B moved by `transforms`, its squared distances to A leaf by leaf)."""
        def sq_of(moved):
            flat_moved = flatten(moved)
            return distances.sq_dists(self.flat_a, {p: flat_moved[p] for p in self.flat_a})

        if self.traced:
            moved = apply_unchecked(self.full_bound, self.params_b, transforms)
            return moved, sq_of(moved)
        moved = self.clock.timed("apply", apply_unchecked, self.full_bound, self.params_b, transforms)
        with self.clock.phase("distances"):
            return moved, jax.device_get(sq_of(moved))

    def learned(self, key, progress):
        """method="learned": trained from every start it may take (the identity always: B as given),
        the best chosen on the held-out loss."""
        options, checkpoint, batches = self.options, self.checkpoint, self.batches
        order = ("activations", "weights") if options.init == "best" else (options.init,)
        if not options.fallback:
            order = ("activations",) if options.init == "best" else order
        starts = {**{name: self.solvers[name]() for name in order}, **({"identity": self.identity} if options.fallback else {})}
        problem = learned_mod.Problem.of(self.bound, self.full_bound, checkpoint.forward(), options,
                                         learned_mod.objective_for(checkpoint, batches, options.objective))
        start_distances = {name: choice.total_distance(self.measured(t)[1] if name != "identity" else self.sq_before)
                           for name, t in starts.items()}
        with self.clock.phase("solve"):
            transforms, learning = learned_mod.learn(problem, options, checkpoint, starts, *self.originals, batches, key, progress, distances=start_distances)
        moved, sq_after = self.measured(transforms)
        winner = learning["start"]["chosen"]
        if options.fallback and learning["best_step"] > 0:  # a trained point within a loss tie of its start: the closer kept
            trained = {"step": learning["best_step"], "loss": learning["best_loss"], "distance": choice.total_distance(sq_after)}
            kept = choice.pick(("learned", winner), {"learned": trained["distance"], winner: start_distances[winner]},
                               {"learned": trained["loss"], winner: learning["start"]["losses"][winner]}, start_distances["identity"])
            if kept != "learned":
                transforms = starts[winner]
                moved, sq_after = self.measured(transforms)
                learning.update(best_step=0, best_loss=learning["start"]["losses"][winner], set_aside=trained)
        self.learning = learning
        chosen = choice.learned(learning, start_distances, options.init) if options.fallback else None
        return transforms, moved, sq_after, winner, chosen

    def identity_where_farther(self):
        """Inside jit (weights only): the identity where the descent ends farther from A than B
        was, chosen on the device."""
        transforms = self.by_weights()
        moved, sq_after = self.measured(transforms)
        # a NaN distance compares False: non-finite inputs keep the identity too
        keep = self.finite & (sum(sq_after.values()) <= sum(self.sq_before.values()))
        return *self.kept_where(keep, transforms, moved, sq_after), "weights", None

    def kept_where(self, keep, transforms, moved, sq_after):
        """(transforms, moved B, squared distances) where `keep` holds, else the identity and B as given."""
        transforms = jax.tree.map(lambda t, i: jnp.where(keep, t, i), transforms, driver.with_inverses_of(self.identity, transforms))
        moved = jax.tree.map(lambda m, b: jnp.where(keep, m, b), moved, self.params_b)
        sq_after = {p: jnp.where(keep, v, self.sq_before[p]) for p, v in sq_after.items()}
        return transforms, moved, sq_after

    def closest(self):
        """The method's result kept only if neither the identity nor (from activations) weight
        matching does better on what the method is judged by: weights the weight distance;
        activations the merged model's loss on its data (`choice` says why)."""
        method = self.options.method
        candidates = {method: self.solvers[method]}
        scorer = None
        if method == "activations":
            candidates["weights"] = self.by_weights
            objective = learned_mod.merge_objective(self.checkpoint, *self.originals)
            scorer = objective and (objective, learned_mod.merge_scorer(self.checkpoint, objective, *self.originals, self.batches))
        winner, transforms, moved, sq_after, chosen = _closest(candidates, self.identity, self.measured, self.params_b, self.sq_before,
                                                               scorer, self.clock)
        return transforms, moved, sq_after, winner, chosen

    def result(self, transforms, moved, sq_after, winner: str, chosen) -> AlignResult:
        before, after = (distances.summarise_distances(self.bound, sq) for sq in (self.sq_before, sq_after))
        fields = {"winner": winner, "sweeps": self.sweeps, "learned": self.learning, "chosen": chosen, "settled": self.settled}
        if self.traced:  # nothing read back: no condition numbers, nothing on what moved, no timings
            report = alignment_report(self.bound, before, after, None, nonfinite=self.nonfinite, **fields)
            return AlignResult(moved, transforms, report, self.full_bound, None)
        source = fingerprint(self.params_b)  # about 1% of an align: lets `stats.follow` check B's statistics
        report = alignment_report(self.bound, before, after, transforms, timings=self.clock.report(self.start), **fields)
        return AlignResult(moved, transforms, report, self.full_bound, source)


def set_aside(spec: Spec | BoundSpec, flats: list[dict]) -> tuple[list[dict], list[dict]]:
    """Each flat params dict split into the leaves that take part in alignment and those set
    aside (`Spec.set_aside`: the task head always, an optional part not every model holds alike)."""
    spec = spec.spec if isinstance(spec, BoundSpec) else spec
    aside = spec.set_aside([{p: np.shape(x) for p, x in flat.items()} for flat in flats])
    if not aside:
        return list(flats), [{} for _ in flats]
    return ([{p: x for p, x in flat.items() if p not in aside} for flat in flats],
            [{p: x for p, x in flat.items() if p in aside} for flat in flats])


def identity_like(bound: BoundSpec, options: AlignOptions) -> dict:
    """The identity element of every group, and of the residual group `options.residual` solves,
    shaped as the solvers give theirs (a rotation matrix where they give one)."""
    out = identity_transform(bound)
    modes = residual_mod.stream_modes(bound, options.residual, signed=options.method == "weights")
    for stream in rj.kinds.residual.solved(bound, options):
        out[stream.name] = ResidualTransform.identity(stream)
        if modes[stream.name] != "permutation":
            out[stream.name] = out[stream.name].replace(rotation=jnp.eye(stream.size, dtype=jnp.float32))
    return out


def _closest(candidates: dict, identity: dict, measured, params_b, sq_before: dict, scorer, clock):
    """(name, transforms, moved B, squared distances, report["chosen"]) of the result kept
    (`choice.pick`) among the candidates ({name: () -> transforms}, the method's own first) and
    the identity: on the weight distance, or on `scorer` = (objective, moved B -> the merged
    model's loss) where given. Besides B, only the method's own moved B is held (the likely
    winner, not made twice); another candidate that wins is moved again."""
    before = choice.total_distance(sq_before)
    distances, losses, results = {}, ({} if scorer else None), {}
    own = next(iter(candidates))
    for name, solve in [*candidates.items(), ("identity", None)]:
        transforms = identity if solve is None else solve()
        moved, sq = (params_b, dict(sq_before)) if solve is None else measured(transforms)
        distances[name] = choice.total_distance(sq)
        if scorer:
            with clock.phase("statistics"):
                losses[name] = scorer[1](moved)
        results[name] = (transforms, sq, moved if name in (own, "identity") else None)
        del moved
    best = choice.pick(results, distances, losses, before)
    transforms, sq, moved = results[best]
    moved = measured(transforms)[0] if moved is None else jax.tree.map(lambda x: x, moved)
    measure = f"{scorer[0]} loss of the merged model on the data" if scorer else ""
    return best, transforms, moved, sq, choice.report(next(iter(candidates)), best, distances, losses, measure, before)


def _solve_from_activations(bound, params_a, params_b, data, checkpoint, solve, options: AlignOptions, clock) -> dict:
    """Every group's element and the residual transform from both models' activations on `data`
    (`engine.activations`): one forward pass of each, then the weight solvers on the activations."""
    modes = residual_mod.stream_modes(bound, options.residual, signed=False)
    rotated = [s for s in bound.streams if modes.get(s.name) == "rotation"]
    if rotated:
        residual_mod.check_rotatable(bound, params_a, "params_a (model A, the anchor)", rotated)
        residual_mod.check_rotatable(bound, params_b, "params_b (model B)", rotated)
    with clock.phase("statistics"):
        sites_a = activations.sites(checkpoint, params_a, data, bound, "params_a (model A)", options)
        sites_b = activations.sites(checkpoint, params_b, data, bound, "params_b (model B)", options)
    activations.check_enough(bound, sites_a.tokens, options)
    transforms = solve(sites_a.leaves, sites_b.leaves, "activations")
    for stream in bound.streams:
        mode = modes.get(stream.name, "none")
        if mode == "none":
            continue
        rotation = mode == "rotation"
        cross = activations.residual_cross(stream, sites_a.stream, sites_b.stream, standardise=not rotation)
        fix_ones = rotation and residual_mod.fixes_ones(stream)
        transforms[stream.name] = residual_mod.solve_residual(jnp.asarray(cross), mode, options.polar_method, fix_ones=fix_ones)
    del sites_a, sites_b
    # The sites were many mid-sized host arrays: glibc keeps their pages, fragmented, and what
    # runs next (the learned method's compilation and steps) would add to them.
    release_freed_memory()
    return transforms


def _solve_with_residual(bound, params_a, params_b, solve, options: AlignOptions, traced):
    """`residual.descend` on the params in memory (MATH §10): the transforms of the best sweep and
    the distance after every sweep."""
    if not bound.streams:
        raise SpecError(residual_mod.NO_STREAM)
    modes, max_sweeps, polar_method = residual_mod.stream_modes(bound, options.residual), options.residual_sweeps, options.polar_method
    rotated = [s for s in bound.streams if modes[s.name] == "rotation"]
    if rotated:
        residual_mod.check_rotatable(bound, params_a, "params_a (model A, the anchor)", rotated)
        residual_mod.check_rotatable(bound, params_b, "params_b (model B)", rotated)
    flat_a = flatten(params_a)
    identity = identity_transform(bound)
    flat_b = flatten(params_b)

    def solve_t(b, t_before, untouched_only=False):  # every stream's T: a signed permutation scores its signs without the (unsigned) gains
        def cross_of(stream, mode, t):
            b_s = moved_by_others(bound, stream, b, t)  # the streams solved before it: their new T
            return (residual_mod.signed_cross(bound, stream, flat_a, b_s, untouched_only) if mode == "signed_permutation"
                    else residual_mod.residual_cross(bound, stream, flat_a, b_s, mode == "rotation", untouched_only))
        return residual_mod.solve_streams(bound, modes, cross_of, polar_method, t_before)

    def groups_given(t_res, sweep):
        return solve(flat_a, flatten(apply_unchecked(bound, params_b, {**identity, **t_res})))

    def moved_by(transforms):
        return flatten(apply_unchecked(bound, params_b, transforms))

    steps = (lambda: solve_t(flat_b, {}, untouched_only=True), groups_given, lambda groups, t: solve_t(moved_by(groups), t),
             lambda transforms: sum(distances.sq_dists(flat_a, moved_by(transforms)).values()))
    return residual_mod.descend(*steps, max_sweeps, traced)


# ---- validation -----------------------------------------------------------------------------------

def check_finite(params, what: str = "params") -> None:
    """Raise ValueError naming the floating leaves of `params` that hold NaN or Inf: one
    reduction per leaf, one read back. Traced params (under jit) cannot be checked and pass."""
    flat = {p: x for p, x in flatten(params).items() if jnp.issubdtype(jnp.result_type(x), jnp.inexact)}
    if not flat or is_traced(flat):
        return
    finite = np.array(jax.device_get([_all_finite(x) for x in flat.values()]))
    if finite.all():
        return
    bad = [p for p, ok in zip(flat, finite) if not ok]
    raise InputError(_nonfinite_message(what, [(p, int(jnp.isnan(flat[p]).sum()), int(jnp.isinf(flat[p]).sum()), np.size(flat[p]))
                                               for p in bad]))


def _nonfinite_message(what: str, bad: list) -> str:
    """The refusal of NaN/Inf weights, `bad` = [(leaf, NaN count, Inf count, size)]."""
    counts = [f"{p} ({nan} NaN, {inf} Inf of {size})" for p, nan, inf, size in bad[:8]]
    return f"{what}: non-finite values in {len(bad)} leaves: {counts}{' ...' if len(bad) > 8 else ''}; alignment needs finite weights"


_MODELS = {"params_a": "params_a (model A, the anchor)", "params_b": "params_b (model B)"}


def refuse_nonfinite(result: AlignResult) -> AlignResult:
    """`AlignResult.check_finite`."""
    flags = result.report.get("nonfinite")
    if flags is None:  # an eager align refused them already
        return result
    flags = jax.device_get(flags)
    flat = flatten(result.params)
    for model, leaves in flags.items():
        batch = np.shape(next(iter(leaves.values()))["nan"]) if leaves else ()
        for index in np.ndindex(*batch):  # one model of a vmapped batch at a time, in order
            bad = [(p, int(c["nan"][index]), int(c["inf"][index]), int(np.prod(np.shape(flat[p])[len(batch):])))
                   for p, c in leaves.items() if c["nan"][index] or c["inf"][index]]
            if bad:
                raise InputError(_nonfinite_message(_MODELS[model] + (f" at vmapped index {index}" if batch else ""), bad))
    return result


def nonfinite_counts(finite, models: dict) -> dict:
    """Traced: {model: {leaf: NaN/Inf entries}} of each model's floating leaves. Counted only where
    the distances (one sum of squares per leaf, computed anyway) are not finite: a finite run pays
    one branch, not a pass over the weights (under vmap: unless some model of the batch is not)."""
    leaves = {m: {p: x for p, x in flat.items() if jnp.issubdtype(jnp.result_type(x), jnp.inexact)} for m, flat in models.items()}

    def counted(leaves):
        return {m: {p: {"nan": jnp.sum(jnp.isnan(x), dtype=jnp.int32), "inf": jnp.sum(jnp.isinf(x), dtype=jnp.int32)}
                    for p, x in flat.items()} for m, flat in leaves.items()}

    def none(leaves):
        return {m: {p: {"nan": jnp.int32(0), "inf": jnp.int32(0)} for p in flat} for m, flat in leaves.items()}

    return batch_cond(finite, none, counted, leaves)


@exact_jit  # one small program per leaf shape: a model has few, so it compiles fast
def _all_finite(x):
    return jnp.all(jnp.isfinite(x))
