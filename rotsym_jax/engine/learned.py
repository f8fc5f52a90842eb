"""Learned transforms (MATH.md §10, `align(..., method="learned")`): every transform parametrised
so that it stays exactly in its symmetry group, and trained with optax on the loss of the merged
model `(1 - a) theta_A + a g(theta_B)`.

Starting from `t0`, the best of its starts (the identity, weight or activation matching: the
lowest held-out loss of the merged model, `engine.choice`), each element is `t0` composed with a
learned one that is the identity at zero:

    QK, VO rotations   t0 @ cayley(K), K skew (dh x dh) per layer and kv group; on RoPE blocks
                       2-D rotations of the rotary pairs by learned angles (the RoPE group) and
                       cayley(K) on the dims past the rotary part
    QK, VO scales      t0 * exp(s)
    QK, VO stretches   with maps="invertible" (MATH §14): t0 @ rotation @ exp(S), S symmetric
                       (dh x dh) per layer and kv group, its norm bounded so that the condition
                       number stays below MAX_CONDITION (`bounded`), the k and o sides taking
                       t0^-T @ rotation @ exp(-S); on RoPE blocks one scale per rotary pair
    residual rotation  t0 @ cayley(K) (RMSNorm, d x d), or H diag(1, cayley(K)) H (LayerNorm: the
                       rotations that fix the ones vector, MATH §10)
    permutations       the straight-through estimator (Ainsworth et al. 2023): a free copy W of the
                       group's leaves; before each step the permutation P that brings B's units
                       closest to W's (a linear assignment on the host), B moved by P in the
                       forward pass, and the gradient passed to W as if W were used
                       (W + stop_gradient(P(B) - W))

Head permutations and a residual permutation stay as `t0` has them. Cayley maps reach the rotations
of determinant +1 only: composed with `t0` they move within its coset, which is where the closed
form put B. Because every element is in B's symmetry group at every step, B's function never
changes: only where B sits relative to A does, and with it the merged model.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from ..families.labels import check_labels, label_nll, lm_labels
from ..memory import release_freed_memory
from ..options import AlignOptions
from ..precision import exact, exact_jit
from ..pytree import flatten, unflatten
from ..spec import BoundSpec
from ..transforms import identity_transform
from . import choice, driver
from .activations import DataError
from .groups import apply_unchecked

# The options that never reach a compiled program of this module (the loop's, the choice's, the
# closed forms', or an argument: the learning rate): a Problem holds them at their defaults, so that
# a second call with other steps or rates compiles nothing (issue 72).
HOST_OPTIONS = ("steps", "learning_rate", "patience", "holdout", "eval_every", "init", "fallback", "alpha", "objective", "method", "heads",
                "residual_sweeps", "polar_method")


@dataclasses.dataclass(frozen=True)
class Problem:
    """What the learned programs (the step, the loss) are compiled for: a static argument,
    hashable by value, so that every call with the same architecture, program options and shapes
    runs one compiled step, in `align`, `align_many` (one per model and sweep) and every later
    call of the process. The weights, the starts and the learning rate are arguments. Build it
    with `Problem.of`, which sets the options that do not change the programs to their defaults."""

    bound: BoundSpec  # the groups solved (heads set aside)
    full_bound: BoundSpec  # the same models, heads included (the residual moves a head that reads it)
    forward: object  # Checkpoint.forward(): the forward pass without its weights
    options: AlignOptions  # the program's: HOST_OPTIONS at their defaults
    objective: str  # "task" or "distill"

    @classmethod
    def of(cls, bound: BoundSpec, full_bound: BoundSpec, forward, options: AlignOptions, objective: str) -> Problem:
        program = dataclasses.replace(options, **{name: getattr(_DEFAULTS, name) for name in HOST_OPTIONS})
        return cls(bound, full_bound, forward, program, objective)


_DEFAULTS = AlignOptions()


def initial_parameters(problem: Problem, t0: dict, flat_b: dict) -> dict:
    """The learned parameters at the start `t0`: {group name: its kind's (`Kind.learned.initial`)}
    for every group of `t0` that learns under the options (the residual stream's: a skew matrix)."""
    frame = flatten(apply_unchecked(problem.bound, unflatten(flat_b), _frames(problem.bound, t0)))
    params = {}
    for group in problem.bound.groups_of(t0):
        p = rj.kinds.of(group).learned.initial(group, t0[group.name], frame, problem.options)
        if p is not None:
            params[group.name] = p
    return params


def _frames(bound: BoundSpec, t: dict) -> dict:
    """Each group's element of `t` as it acts before the straight-through copies (`Learned.frame`)."""
    return {g.name: rj.kinds.of(g).learned.frame(t[g.name]) for g in bound.groups}


def elements(problem: Problem, t0: dict, learned: dict, projected: dict) -> dict:
    """The group elements at `learned` (`projected`: what each group's kind computed on the host for
    this step, `projections`), each its kind's (`Kind.learned.element`: the residual rotation
    t0 @ cayley(K), on a LayerNorm stream a rotation that fixes the ones vector)."""
    out = dict(t0)
    for group in (g for g in problem.bound.groups_of(t0) if g.name in learned):
        out[group.name] = rj.kinds.of(group).learned.element(group, t0[group.name], learned[group.name], projected.get(group.name))
    # The layers outside options.layers keep their identity elements (as the closed forms do).
    masks = driver.layer_masks(problem.bound, problem.options.layers)
    identity = identity_transform(problem.bound)
    return {**out, **driver.mask_layers({k: out[k] for k in identity}, identity, masks)}


def projections(problem: Problem, learned: dict, flat_b: dict) -> dict:
    """{group name: what its kind computes on the host before a step (`Kind.learned.project`: the
    permutation of B's units closest to the free copy's)}, for the groups that learn."""
    out = {}
    for group in (g for g in problem.bound.groups if g.name in learned):
        projected = rj.kinds.of(group).learned.project(group, learned[group.name], flat_b)
        if projected is not None:
            out[group.name] = projected
    return out


def moved_b(problem: Problem, t0: dict, learned: dict, projected: dict, params_b) -> dict:
    """B moved by the elements at `learned`: each group's `frame` part, then what its kind puts in
    place of the moved leaves (`Kind.learned.straight_through`: the free copies, the scales after
    them), the residual stream's last (another axis of the same leaves)."""
    t = elements(problem, t0, learned, projected)
    bound = problem.full_bound
    flat = flatten(apply_unchecked(bound, params_b, _frames(bound, t)))
    for group in bound.groups_of(t):
        flat.update(rj.kinds.of(group).learned.straight_through(group, learned.get(group.name), t[group.name], flat))
    return unflatten(flat)


def merged(params_a, params_b, alpha):
    """(1 - alpha) A + alpha B on the leaves both hold alike; A's elsewhere (a head of another label set)."""
    fa, fb = flatten(params_a), flatten(params_b)
    return unflatten({p: (1 - alpha) * x + alpha * fb[p] if p in fb and np.shape(fb[p]) == np.shape(x) else x for p, x in fa.items()})


def batch_loss(checkpoint, objective: str, params, inputs, labels, teacher):
    """The objective on one batch: the labels' mean negative log-likelihood (task), or the KL
    divergence from the mean of A's and B's predictive distributions `teacher` (distill)."""
    logits = checkpoint.apply(params, **inputs)["logits"].astype(jnp.float32)
    if objective == "task":
        nll, count = label_nll(logits, labels)
        return nll / jnp.maximum(count, 1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    # a divergence is >= 0; a position's float32 sum rounds to either side of it where q ~ p
    kl = jnp.maximum(jnp.sum(teacher * (jnp.log(jnp.maximum(teacher, 1e-30)) - logp), axis=-1), 0.0)
    weight = _positions(inputs, kl.shape)
    return jnp.sum(kl * weight) / jnp.maximum(jnp.sum(weight), 1)


def _positions(inputs, shape):
    mask = inputs.get("attention_mask")
    if mask is not None and tuple(mask.shape) == tuple(shape):
        return mask.astype(jnp.float32)
    return jnp.ones(shape, jnp.float32)


def teacher_of(checkpoint, objective: str, params_a, params_b, inputs):
    """The mean of A's and B's predictive distributions (the distillation target), or None."""
    if objective != "distill":
        return None
    pa, pb = (jax.nn.softmax(checkpoint.apply(p, **inputs)["logits"].astype(jnp.float32), axis=-1) for p in (params_a, params_b))
    return (pa + pb) / 2


def merge_objective(checkpoint, params_a, params_b) -> str | None:
    """The loss activation matching's result is judged by (`choice`): "distill", the merged
    model's divergence from the mean of A's and B's predictions (label-free, as activation matching
    is: labels are not read), or None where the merged model gives no logits to score (no task head
    that runs, or A and B with heads of other shapes)."""
    try:
        checkpoint.require_head("the merged model's loss")
    except ValueError:
        return None
    fa, fb = flatten(params_a), flatten(params_b)
    if fa.keys() != fb.keys() or any(np.shape(fa[p]) != np.shape(fb[p]) for p in fa):
        return None
    return "distill"


def merge_scorer(checkpoint, objective: str, params_a, params_b, batches: list):
    """moved B (B moved by a transform: the same function) -> the mean over `batches` of the loss
    `objective` of the merged model (A + moved) / 2. The batches and the distillation target are
    read at the first call (after the alignment's own checks of them). Each step is the program a
    streamed run scores with (`predictions`, `halves`, `scored_loss`), so the two score a
    candidate alike to the bit."""
    split, targets, forward = [], [], checkpoint.forward()

    def score(moved) -> float:
        if not split:
            split[:] = labelled_inputs(checkpoint, objective, params_a, batches)
            targets[:] = [teacher(objective, predictions(forward, params_a, x), predictions(forward, params_b, x)) for x, _ in split]
        params = halves(params_a, moved)
        return float(np.mean([scored_loss(forward, objective, params, x, y, t) for (x, y), t in zip(split, targets)]))

    return score


def predictions(forward, params, inputs) -> np.ndarray:
    """A model's predictive distribution on a batch (float32, on the host): the distillation
    target's half."""
    return np.asarray(jax.device_get(_softmax(forward.apply(params, **inputs)["logits"])))


@jax.jit
def _softmax(logits):
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)


def teacher(objective: str, pa: np.ndarray, pb: np.ndarray) -> np.ndarray | None:
    """The distillation target from A's and B's `predictions` (None for the task loss): their
    mean, as `teacher_of` computes it in a traced step."""
    return (pa + pb) / 2 if objective == "distill" else None


def halves(params_a, params_b):
    """(A + B) / 2 leaf by leaf where both hold a leaf alike, A's elsewhere (`merged` at 0.5)."""
    return unflatten(flat_halves(flatten(params_a), flatten(params_b)))


def flat_halves(fa: dict, fb: dict) -> dict:
    """`halves` of flat leaves ({path: leaf}), in A's leaf dtype: the float32 sum rounded once
    (0.5 x is exact), so the same bits on the host (NumPy leaves: a streamed run's chunks) and on
    the device (one program for the model)."""
    both = {p: (x, fb[p]) for p, x in fa.items() if p in fb and np.shape(fb[p]) == np.shape(x)}
    if all(isinstance(x, np.ndarray) and isinstance(y, np.ndarray) for x, y in both.values()):
        summed = {p: (0.5 * x.astype(np.float32) + 0.5 * y.astype(np.float32)).astype(x.dtype) for p, (x, y) in both.items()}
    else:
        summed = _half_sums(both)
    return {**fa, **summed}


@jax.jit
def _half_sums(pairs):
    return {p: (0.5 * x.astype(jnp.float32) + 0.5 * y.astype(jnp.float32)).astype(x.dtype) for p, (x, y) in pairs.items()}


@functools.partial(exact_jit, static_argnums=(0, 1))
def scored_loss(forward, objective: str, params, inputs, labels, teacher):
    """`batch_loss` of a merged model held whole, its target given (`merge_scorer`'s and a streamed
    activation matching's). The forward pass static (hashable by value): one compilation per
    architecture and batch shape, for every scorer of it (align_many builds one per model and sweep)."""
    return batch_loss(forward, objective, params, inputs, labels, teacher)


def objective_for(checkpoint, batches: list, choice: str) -> str:
    """"task" or "distill", checked against the model and the data: the one decision of every
    path (`align`, the pipelines' checks, the command line). `choice` "auto": the task loss where
    every batch has labels, or where the model is a causal LM reading token ids (its texts label
    themselves: the next tokens, `self_labelled`), else distillation."""
    checkpoint.require_head("method='learned' (the merged model's loss)")
    labelled = all("labels" in b for b in batches) or self_labelled(checkpoint, batches)
    if choice == "auto":
        return "task" if labelled else "distill"
    if choice == "task" and not labelled:
        raise DataError("objective='task' needs labels in every batch (a causal LM's token ids label themselves); objective='distill' "
                        "needs none")
    return choice


def self_labelled(checkpoint, batches: list) -> bool:
    """Whether every batch's labels can come from its inputs: a causal LM's next tokens."""
    return checkpoint.layout.head == "lm" and all("input_ids" in b for b in batches)


def learn(problem: Problem, options: AlignOptions, checkpoint, starts: dict, params_a, params_b, batches: list, key, progress=None, *,
          distances: dict | None = None) -> tuple[dict, dict]:
    """Train the learned parameters from the best of `starts` ({name: closed-form transforms}:
    "identity", "weights", "activations", the preferred first): the lowest loss of the merged
    model at a = 1/2 on the held-out batches (on the training batches with holdout=0), a tie
    (`choice.pick`) to the start closest to A in `distances` ({name: weight distance}). Returns
    the elements at the best held-out loss, never above the start's (without a held-out split:
    the last step's, unless the start's training loss is lower), and the learning report, whose
    "start" names the start, with every start's loss."""
    # What the starts freed (sites, moved models, their programs) goes back before the loss and
    # the step compile: glibc kept 0.3 GB of it on MiniLM, under the learning phase's peak.
    release_freed_memory()
    held_count = int(round(options.holdout * len(batches)))
    if options.holdout > 0 and held_count == 0:
        held_count = 1
    if held_count >= len(batches):
        raise DataError(f"method='learned' with holdout={options.holdout} needs at least {held_count + 1} batches (training and "
                        f"held-out); the data gives {len(batches)}: give more data or holdout=0")
    train, held = batches[: len(batches) - held_count], batches[len(batches) - held_count:]
    if options.alpha == "uniform" and key is None:
        raise InputError("alpha='uniform' draws the interpolation weight at every step: give key= (a jax.random key)")
    split = labelled_inputs(checkpoint, problem.objective, params_a, batches)
    train_inputs, held_inputs = split[: len(train)], split[len(train):]
    flat_b = flatten(params_b)
    models = (params_a, params_b)
    project = lambda learned: projections(problem, learned, flat_b)

    def mean_loss(t0, learned, inputs):
        perms = project(learned)
        return float(np.mean([_evaluate(problem, models, t0, learned, perms, batch, jnp.float32(0.5)) for batch in inputs]))

    # Early stopping on the held-out batches; without them, the start and the last step compared on the training batches.
    selection = held_inputs or train_inputs
    losses = {name: mean_loss(t, initial_parameters(problem, t, flat_b), selection) for name, t in starts.items()}
    _check_start(problem, losses, bool(held_inputs))
    release_freed_memory()  # the starts' moved and merged models, before the step compiles
    distances = distances or {name: 0.0 for name in starts}
    chosen = choice.pick(starts, distances, losses, distances.get("identity", 0.0))
    t0 = starts[chosen]
    learned = initial = initial_parameters(problem, t0, flat_b)
    state = transformation(options.optimizer, 1.0).init(learned)  # the state does not depend on the rate (`_step` takes it)
    rate = jnp.float32(options.learning_rate)
    curve, held_curve = [], []
    best, best_loss, best_step = learned, losses[chosen], 0
    stopped = None  # the step at which `patience` steps without a lower held-out loss stopped it
    if held_inputs:
        held_curve.append((0, best_loss))
    start = time.perf_counter()
    for i in range(options.steps):
        inputs, labels = train_inputs[i % len(train_inputs)]
        alpha = 0.5 if options.alpha == "half" else jax.random.uniform(jax.random.fold_in(key, i), minval=0.0, maxval=1.0)
        learned, state, value = _step(problem, models, t0, learned, project(learned), state, (inputs, labels), jnp.float32(alpha), rate)
        curve.append(float(value))
        release_freed_memory()  # the step's buffers: glibc kept 0.6 GB of them by step 10 on MiniLM
        if not np.isfinite(curve[-1]):
            batch = i % len(train_inputs)
            if not np.isfinite(float(_evaluate(problem, models, t0, initial, project(initial), (inputs, labels), jnp.float32(alpha)))):
                raise DataError(f"method='learned': the merged model's loss on training batch {batch} (data[{batch}]) is {curve[-1]} at "
                                f"the start, before any step: the data or the models give a non-finite loss (inputs or labels the "
                                f"model cannot score), not the learning rate")
            raise FloatingPointError(f"method='learned': the loss became {curve[-1]} at step {i + 1} (it is finite at the start on "
                                     f"the same batch); lower learning_rate (it is {options.learning_rate})")
        if held_inputs and ((i + 1) % options.eval_every == 0 or i + 1 == options.steps):
            loss = mean_loss(t0, learned, held_inputs)
            held_curve.append((i + 1, loss))
            if loss < best_loss:
                best, best_loss, best_step = learned, loss, i + 1
            elif options.patience and i + 1 - best_step >= options.patience:
                stopped = i + 1
        if progress is not None:
            progress()
        if stopped:
            break
    if not held_inputs:
        loss = mean_loss(t0, learned, train_inputs)
        if loss <= best_loss:
            best, best_loss, best_step = learned, loss, options.steps
    transforms = jax.device_get(elements(problem, t0, best, project(best)))
    named = isinstance(options.optimizer, str)
    report = {"objective": problem.objective, "alpha": options.alpha, "steps": options.steps,
              "optimizer": options.optimizer if named else f"custom ({type(options.optimizer).__name__})",
              "learning_rate": options.learning_rate if named else None,
              "init": options.init, "train_batches": len(train), "held_out_batches": len(held), "loss": curve,
              "held_out": [{"step": s, "loss": v} for s, v in held_curve], "best_step": best_step, "best_loss": best_loss,
              "stopped_at": stopped, "patience": options.patience,
              "start": {"chosen": chosen, "losses": losses, "measured_on": "held-out batches" if held_inputs else "training batches (holdout=0)"},
              "seconds": time.perf_counter() - start}
    return transforms, report


# The start t0 is an argument, not a constant: one compilation scores every start and trains from the best.
@exact
def _loss_at(problem: Problem, models, t0, learned, perms, batch, alpha):
    (params_a, params_b), (inputs, labels) = models, batch
    b = moved_b(problem, t0, learned, perms, params_b)
    teacher = teacher_of(problem.forward, problem.objective, params_a, params_b, inputs)
    return batch_loss(problem.forward, problem.objective, merged(params_a, b, alpha), inputs, labels, teacher)


_evaluate = exact_jit(_loss_at, static_argnums=0)


def transformation(optimizer, learning_rate):
    """The optax transformation of `AlignOptions.optimizer`: `optax.<name>(learning_rate)`, or the
    GradientTransformation given (its own rate)."""
    import optax  # only when learning: it costs every other command 0.1 s to import

    return getattr(optax, optimizer)(learning_rate) if isinstance(optimizer, str) else optimizer


@functools.partial(exact_jit, static_argnums=0)
def _step(problem: Problem, models, t0, learned, perms, state, batch, alpha, learning_rate):
    import optax

    value, grads = jax.value_and_grad(_loss_at, argnums=3)(problem, models, t0, learned, perms, batch, alpha)
    # The rate an argument (optax takes an array): one program for every rate.
    updates, state = transformation(problem.options.optimizer, learning_rate).update(grads, state, learned)
    return optax.apply_updates(learned, updates), state, value


def labelled_inputs(checkpoint, objective: str, params_a, batches: list) -> list:
    """Every batch as (model inputs, labels): a causal LM's next tokens where the task loss needs
    labels the batch does not give (`objective_for`), and labels that cannot index the merged
    model's logits (A's head) refused here, naming the batch: out of range they give a NaN loss
    that no learning rate cures."""
    out, shapes = [], {}
    for i, batch in enumerate(batches):
        inputs, labels = checkpoint.split_batch(batch, f"data[{i}]")
        if objective != "task":
            out.append((inputs, labels))
            continue
        if labels is None:
            labels = jnp.asarray(lm_labels(checkpoint, {k: np.asarray(v) for k, v in inputs.items()}))
        key = tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in inputs.items()))
        if key not in shapes:
            shapes[key] = jax.eval_shape(lambda p, x: checkpoint.apply(p, **x), params_a, inputs)["logits"].shape
        try:
            check_labels(labels, shapes[key], f"data[{i}]")
        except ValueError as e:
            raise DataError(f"the merged model's task loss: {e}") from None
        out.append((inputs, labels))
    return out


def _check_start(problem: Problem, losses: dict, held: bool) -> None:
    """DataError where the loss is not finite before any step ({start: loss of the merged model at
    a = 1/2}): at the identity (B's own merge with A), or at every start, the data or the models
    are at fault (inputs or labels the model cannot score, weights that overflow), which no
    learning rate cures."""
    where = "held-out" if held else "training"
    bad = "identity" in losses and not np.isfinite(losses["identity"]) or not any(np.isfinite(v) for v in losses.values())
    if bad:
        raise DataError(f"method='learned': the merged model's {problem.objective} loss on the {where} batches is not finite before any "
                        f"step ({', '.join(f'{n}: {v}' for n, v in losses.items())}; the identity is B as given, merged with A at 1/2): "
                        "the data or the models give a non-finite loss (inputs or labels the model cannot score, or weights that "
                        "overflow), not the learning rate")
