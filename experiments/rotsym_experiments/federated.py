"""Federated averaging (FedAvg) of M models, with and without aligning them before each average.

M models train with AdamW, each on its own shard of the training data, for `local_epochs` over
that shard per round; then the round ends with a sync, one of `SYNCS`:

    none             independent training (the reference): the models are left as they are
    average          every model is reset to the plain parameter average
    align+average    models 1..M-1 are moved onto model 0 with `rotsym_jax.align` (function
                     preserved), then every model is reset to the average

One round (local training of all models, the measurements, the sync) is one jitted function,
`make_round`: the models are a leading axis of stacked params (`jax.vmap`), the local steps a
`lax.scan`, the alignment `rj.align` vmapped over models 1..M-1 inside the same program, and the
whole round vmapped once more over a batch of runs (`run_many`). The sync is an array argument,
so one compilation serves every round, sync and init.

Before each sync a round records, on the test batch: every model's loss and accuracy, the plain
and the aligned average's (whichever sync is run, so "none" shows what a one-shot merge would
give), and between models 0 and 1 the Euclidean distance and the loss barrier (MATH §7) on the
linear path, plain and after alignment.

Choices, and why:
  * Disjoint IID shards, not the same data in another order: that is the federated setting
    (each client holds its own data), and it is where averaging can add something a single
    model lacks. One seed gives the init, the shards and the batch orders, so the runs of one
    seed differ only in their sync (and init).
  * AdamW's moments at a sync follow one of `STATES`: "reset" (the reference: fresh moments every
    round, for every sync), "kept" (each model keeps its own, in its old basis) or "moved" (after
    align+average, model i's state moved by the transform that aligned it, `rj.transform_opt_state`:
    the first moment exactly, the second by the diagonal map under rotations, MATH §13). The
    learning rate follows one warmup + cosine schedule over all rounds' steps (as
    `training.optimizer` does for one model), whichever the state.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import rotsym_jax as rj

from .training import TrainSettings

SYNCS = ("none", "average", "align+average")
# What becomes of each model's optimizer state at a sync ("moved" only after align+average).
STATES = ("reset", "kept", "moved")
# the record entry that every model becomes at the sync
AFTER_SYNC = {"none": None, "average": "average", "align+average": "aligned_average"}
INITS = ("different", "shared")


@dataclasses.dataclass(frozen=True)
class Task:
    """A task to train on: `init(seed)` -> the initial `Checkpoint` of a seed; `metrics(checkpoint,
    params, batch)` -> {"loss", "accuracy"}, jittable; `train` and `test`: dicts of arrays with one
    leading example axis; `settings`: batch size, learning rate and weight decay of the local steps."""

    name: str
    init: Callable
    metrics: Callable
    train: dict
    test: dict
    settings: TrainSettings


@dataclasses.dataclass(frozen=True)
class Schedule:
    """`rounds` rounds of `local_epochs` passes over each model's shard, `models` models."""

    models: int = 2
    rounds: int = 10
    local_epochs: int = 1


def shard(data: dict, models: int, key: jax.Array) -> dict:
    """Disjoint random shards of equal size: every array gets a leading model axis (M, n // M, ...)."""
    n = len(next(iter(data.values())))
    per = n // models
    order = np.asarray(jax.random.permutation(key, n))[: per * models].reshape(models, per)
    return {k: jnp.asarray(np.asarray(v)[order]) for k, v in data.items()}


def stack(trees: list) -> dict:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree, i: int):
    return jax.tree.map(lambda x: x[i], tree)


def initial_params(task: Task, models: int, init: str, seed: int = 0) -> tuple[rj.Checkpoint, dict]:
    """(checkpoint of the first model, stacked initial params): init seeds seed*M .. seed*M + M-1
    for "different", seed*M for every model for "shared"."""
    if init not in INITS:
        raise ValueError(f"init={init!r}; choose one of {INITS}")
    first = seed * models
    seeds = range(first, first + models) if init == "different" else [first] * models
    checkpoints = [task.init(s) for s in seeds]
    return checkpoints[0], stack([c.params for c in checkpoints])


def local_optimizer(settings: TrainSettings, total_steps: int) -> optax.GradientTransformation:
    """AdamW as `optax.adamw` builds it (Adam's scaling, weight decay, the learning rate), its
    three states apart: the schedule's count runs over all rounds while Adam's state may restart
    (`restart_adam`)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, settings.learning_rate, warmup_steps=max(1, total_steps // 20), decay_steps=total_steps)
    return optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(settings.weight_decay), optax.scale_by_learning_rate(schedule))


def restart_adam(state, params):
    """The optimizer state with fresh Adam moments (and bias correction); the schedule goes on."""
    return (optax.scale_by_adam().init(params), *state[1:])


def path_points(params_a, params_b, alphas) -> dict:
    """The params at (1 - α) A + α B for each α: a stack with a leading axis of len(alphas)."""
    def points(a, b):
        t = jnp.asarray(alphas, jnp.float32).reshape((-1,) + (1,) * a.ndim)
        return ((1 - t) * a + t * b).astype(a.dtype)

    return jax.tree.map(points, params_a, params_b)


def barrier_of(losses, alphas) -> jax.Array:
    """The loss barrier of MATH §7 from the losses at `alphas` (which start at 0 and end at 1):
    the largest excess over the straight line between the end points."""
    alphas = np.asarray(alphas, np.float32)
    if alphas[0] != 0 or alphas[-1] != 1:
        raise ValueError("alphas must start at 0 and end at 1")
    return jnp.max(losses - ((1 - alphas) * losses[0] + alphas * losses[-1]))


def linear_barrier(loss_fn, params_a, params_b, alphas) -> tuple[jax.Array, jax.Array]:
    """(barrier, loss curve) along (1 - α) A + α B, traceable, from the pieces the jitted round
    uses (there the points of both paths are evaluated in one batch with the models):
    `barrier.loss_barrier` reads its curve back to the host, so it cannot run inside jit."""
    losses = jax.vmap(loss_fn)(path_points(params_a, params_b, alphas))
    return barrier_of(losses, alphas), losses


def merges(params, spec) -> dict:
    """The two merges of stacked params (M, ...): {"average": plain mean, "aligned": models 1..M-1
    aligned to model 0 (vmapped `rj.align`), "aligned_average": their mean with model 0,
    "distance": {"plain", "aligned"} of model 1 to model 0, "result": the `AlignResult` of models
    1..M-1 (its transforms stacked)}. Jittable."""
    anchor = unstack(params, 0)
    rest = jax.tree.map(lambda x: x[1:], params)
    result = jax.vmap(lambda b: rj.align(anchor, b, spec), in_axes=0)(rest)
    aligned = jax.tree.map(lambda a, r: jnp.concatenate([a[None], r]), anchor, result.params)
    mean = lambda tree: jax.tree.map(lambda x: jnp.mean(x, 0).astype(x.dtype), tree)
    return {
        "average": mean(params),
        "aligned": aligned,
        "aligned_average": mean(aligned),
        "distance": {"plain": result.report["before"]["total"][0], "aligned": result.report["after"]["total"][0]},
        "result": result,
    }


def sync_states(states, params, merged: dict, spec, state_mode):
    """The stacked optimizer states after a sync (`state_mode`: an index into STATES, may be
    traced): restarted, kept, or moved by the transforms that aligned models 1..M-1 (model 0's
    stays: it is the anchor)."""
    def moved():
        rest = jax.tree.map(lambda x: x[1:], states)
        bound = merged["result"].bound
        out = jax.vmap(lambda t, s: rj.transform_opt_state(t, s, bound))(merged["result"].transforms, rest)
        return jax.tree.map(lambda a, r: jnp.concatenate([a[:1], r]), states, out)

    branches = [lambda: jax.vmap(restart_adam)(states, params), lambda: states, moved]
    return jax.lax.switch(state_mode, branches)


def sync_params(params, merged: dict, sync) -> dict:
    """The stacked params after the sync `sync` (an index into SYNCS; may be traced)."""
    m = jax.tree.leaves(params)[0].shape[0]
    everyone = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (m,) + x.shape), tree)
    branches = [lambda: params, lambda: everyone(merged["average"]), lambda: everyone(merged["aligned_average"])]
    return jax.lax.switch(sync, branches)


def make_round(checkpoint: rj.Checkpoint, spec, metrics: Callable, settings: TrainSettings, *, steps_per_epoch: int, local_epochs: int, total_steps: int, alphas):
    """The jitted round of a batch of R runs, `(params, states, shards, test, sync, state_mode, key)
    -> (params, states, record)`: params (R, M, ...), their optimizer states (R, M, ...), shards
    (R, M, n, ...), sync and state_mode (R,) indices into SYNCS and STATES, keys (R,); test
    shared. Per run: `local_epochs` epochs of AdamW on every model's shard (vmapped over the model
    axis), the measurements of the module docstring, then the sync of params and states. Only
    arrays are arguments: it compiles once per R for every round, sync, state and init. Runs are
    batched because small models use a CPU poorly: two runs cost about 1.4 times one."""
    batch = settings.batch_size
    steps = local_epochs * steps_per_epoch
    evaluate = lambda params, data: metrics(checkpoint, params, data)
    opt = local_optimizer(settings, total_steps)

    def local(params, state, data, key):
        n = next(iter(data.values())).shape[0]
        # Each epoch a fresh order of the shard in full batches (the few left over are skipped).
        orders = jnp.concatenate([jax.random.permutation(k, n)[: steps_per_epoch * batch] for k in jax.random.split(key, local_epochs)])

        def step(carry, idx):
            params, state = carry
            loss, grads = jax.value_and_grad(lambda p: evaluate(p, {k: v[idx] for k, v in data.items()})["loss"])(params)
            updates, state = opt.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), loss

        (params, state), losses = jax.lax.scan(step, (params, state), orders.reshape(steps, batch))
        return params, state, losses.mean()

    def one_run(params, states, shards, test, sync, state_mode, key):
        m = jax.tree.leaves(params)[0].shape[0]
        params, states, train_loss = jax.vmap(local)(params, states, shards, jax.random.split(key, m))
        merged = merges(params, spec)
        inner = np.asarray(alphas)[1:-1]  # the end points are models 0 and 1 (aligned model 1 computes model 1's function)
        a, b, b_aligned = unstack(params, 0), unstack(params, 1), unstack(merged["aligned"], 1)
        # every model, merge and path point in one batched evaluation: one copy of the forward pass to compile
        points = [params, *(jax.tree.map(lambda x: x[None], merged[k]) for k in ("average", "aligned_average")),
                  path_points(a, b, inner), path_points(a, b_aligned, inner)]
        scores = jax.vmap(evaluate, in_axes=(0, None))(jax.tree.map(lambda *xs: jnp.concatenate(xs), *points), test)
        models = jax.tree.map(lambda x: x[:m], scores)
        curve = lambda offset: jnp.concatenate([models["loss"][:1], scores["loss"][offset : offset + len(inner)], models["loss"][1:2]])
        record = {
            "train_loss": train_loss,
            "models": models,
            "average": jax.tree.map(lambda x: x[m], scores),
            "aligned_average": jax.tree.map(lambda x: x[m + 1], scores),
            "barrier": {"plain": barrier_of(curve(m + 2), alphas), "aligned": barrier_of(curve(m + 2 + len(inner)), alphas)},
            "distance": merged["distance"],
        }
        return sync_params(params, merged, sync), sync_states(states, params, merged, spec, state_mode), record

    return jax.jit(jax.vmap(one_run, in_axes=(0, 0, 0, None, 0, 0, 0)))


ALPHAS = np.linspace(0, 1, 5)  # the barrier's grid: it peaks near α = 0.5 on these tasks


def steps_per_epoch(task: Task, models: int) -> int:
    per = len(next(iter(task.train.values()))) // models
    if per < task.settings.batch_size:
        raise ValueError(f"batch_size={task.settings.batch_size} exceeds a shard's {per} examples")
    return per // task.settings.batch_size


def round_for(task: Task, schedule: Schedule, alphas=ALPHAS):
    """`make_round` for `task` and `schedule`: one compilation for all its runs (per batch size R)."""
    checkpoint = task.init(0)
    per_epoch = steps_per_epoch(task, schedule.models)
    return make_round(checkpoint, rj.spec_for(checkpoint), task.metrics, task.settings, steps_per_epoch=per_epoch,
                      local_epochs=schedule.local_epochs, total_steps=schedule.rounds * schedule.local_epochs * per_epoch, alphas=alphas)


def run_many(task: Task, schedule: Schedule, runs: list, *, round_fn=None, log=None) -> list[dict]:
    """Train `schedule.models` models of `task` for each run `(sync, init, seed)` or `(sync, init,
    seed, state)` (state one of STATES, default "reset"), with its sync after every round; the
    runs go through each round together (one batched program).

    `seed` gives the initial params (`initial_params`), the shards and every batch order: runs
    with one seed differ only in their sync (and init). `round_fn`: `round_for(task, schedule)`,
    passed to reuse its compilation. Returns per run {"records": one dict of floats per round (the
    round's record, its "round" and "step", and "after_sync": the metrics of the model every one
    was reset to, None for "none"), "seconds" (of the whole batch), "first_round_seconds" (with the
    compilation when round_fn was fresh), "params": the stacked params after the last sync}."""
    runs = [tuple(run) + ("reset",) * (4 - len(run)) for run in runs]
    for sync, init, _, state in runs:
        if sync not in SYNCS or init not in INITS or state not in STATES:
            raise ValueError(f"run ({sync!r}, {init!r}, {state!r}): sync one of {SYNCS}, init one of {INITS}, state one of {STATES}")
        if state == "moved" and sync != "align+average":
            raise ValueError(f"run ({sync!r}, {init!r}, 'moved'): states are moved by the alignment of an align+average sync")
    if schedule.models < 2:
        raise ValueError("federated averaging needs at least 2 models")
    round_fn = round_fn or round_for(task, schedule)
    keys = [jax.random.split(jax.random.key(seed)) for _, _, seed, _ in runs]  # (shards, training) per run
    shards = stack([shard(task.train, schedule.models, k[0]) for k in keys])
    params = stack([initial_params(task, schedule.models, init, seed)[1] for _, init, seed, _ in runs])
    opt = local_optimizer(task.settings, schedule.rounds * schedule.local_epochs * steps_per_epoch(task, schedule.models))
    states = jax.vmap(jax.vmap(opt.init))(params)
    round_keys = jnp.stack([jax.random.split(k[1], schedule.rounds) for k in keys])
    syncs = jnp.asarray([SYNCS.index(sync) for sync, _, _, _ in runs], jnp.int32)
    state_modes = jnp.asarray([STATES.index(state) for _, _, _, state in runs], jnp.int32)
    steps = schedule.local_epochs * steps_per_epoch(task, schedule.models)
    test = {k: jnp.asarray(v) for k, v in task.test.items()}
    records, start, first = [[] for _ in runs], time.perf_counter(), None
    for r in range(schedule.rounds):
        params, states, batch = round_fn(params, states, shards, test, syncs, state_modes, round_keys[:, r])
        batch = jax.device_get(batch)
        for i, (sync, init, seed, state) in enumerate(runs):
            record = _floats(jax.tree.map(lambda x, i=i: x[i], batch)) | {"round": r + 1, "step": (r + 1) * steps}
            record["after_sync"] = AFTER_SYNC[sync] and record[AFTER_SYNC[sync]]
            records[i].append(record)
            if log:
                log(f"    [{init} init, {sync}, {state} state, seed {seed}] round {r + 1}/{schedule.rounds}: " + summary(record))
        first = first or time.perf_counter() - start
    seconds = time.perf_counter() - start
    return [{"records": rec, "seconds": seconds, "first_round_seconds": first, "params": unstack(params, i)} for i, rec in enumerate(records)]


def run(task: Task, schedule: Schedule, sync: str, init: str, seed: int = 0, state: str = "reset", *, round_fn=None, log=None) -> dict:
    """`run_many` of one run."""
    return run_many(task, schedule, [(sync, init, seed, state)], round_fn=round_fn, log=log)[0]


def deployed(record: dict) -> dict:
    """The test metrics of what a round leaves: the model every one was reset to, or (no sync) the
    models' mean loss and accuracy."""
    if record["after_sync"] is not None:
        return record["after_sync"]
    return {k: float(np.mean([m[k] for m in record["models"]])) for k in record["models"][0]}


def series(runs: dict, value) -> dict:
    """{"<init> init, <sync>": [value(record) per round, mean over seeds]} of `runs[init][sync]`
    (a list of `run` results, one per seed)."""
    return {f"{init} init, {sync}": np.mean([[value(r) for r in out["records"]] for out in per_seed], 0).tolist()
            for init, by_sync in runs.items() for sync, per_seed in by_sync.items()}


def draw(runs: dict, steps: list, title: str, path_stem=None) -> dict:
    """{"accuracy", "barrier"}: figures over training steps (means over seeds) of the test accuracy
    (`deployed`) and of the loss barrier between models 0 and 1 before each sync (plain; for the
    runs without syncs also aligned); PNGs at `<path_stem>-<name>.png` when `path_stem` is given."""
    from rotsym_jax import plots

    path = lambda name: None if path_stem is None else f"{path_stem}-{name}.png"
    barriers = series(runs, lambda r: r["barrier"]["plain"])
    barriers |= {f"{k}: aligned": v for k, v in series({i: {"none": s["none"]} for i, s in runs.items()}, lambda r: r["barrier"]["aligned"]).items()}
    return {
        "accuracy": plots.lines(steps, series(runs, lambda r: deployed(r)["accuracy"]), path=path("accuracy"),
                                xlabel="local steps", ylabel="test accuracy after the round", title=f"{title}: accuracy"),
        "barrier": plots.lines(steps, barriers, path=path("barrier"), xlabel="local steps",
                               ylabel="loss barrier, models 0-1, before the sync", title=f"{title}: loss barrier"),
    }


def summary(record: dict) -> str:
    accs = " ".join(f"{m['accuracy']:.3f}" for m in record["models"])
    return (f"models {accs}; average {record['average']['accuracy']:.3f}, aligned average {record['aligned_average']['accuracy']:.3f}; "
            f"barrier {record['barrier']['plain']:.3f} -> {record['barrier']['aligned']:.3f}")


def _floats(record: dict) -> dict:
    """A round's record as JSON-able Python values; the per-model metrics as a list of dicts."""
    host = jax.device_get(record)
    m = len(np.asarray(host["train_loss"]))
    out = {k: v for k, v in host.items() if k != "models"}
    out["models"] = [{k: float(v[i]) for k, v in host["models"].items()} for i in range(m)]
    out = jax.tree.map(lambda x: np.asarray(x).tolist(), out)
    out["train_loss"] = [float(x) for x in out["train_loss"]]
    return out
