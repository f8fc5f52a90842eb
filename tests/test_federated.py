"""The federated-averaging loop of experiments/federated.py: the jitted round's align+average sync
undoes a planted symmetry transform where the plain average does not, the round compiles once for
every round, sync and init, its in-jit barrier is the library's, and its local training learns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rotsym_jax as rj
from rotsym_experiments import digits, federated
from rotsym_jax import barrier
from rotsym_jax.pytree import flatten

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")

TINY = digits.vit_config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
# every symmetry `align`'s defaults undo (heads="fixed" cannot undo head permutations)
PLANTED = ("qk", "vo", "qk_scale", "vo_scale", "perm")


def _rel(p, q) -> float:
    """Relative Euclidean distance over all leaves (NumPy: eager JAX ops compile once per shape)."""
    fp, fq = ({k: np.asarray(v, np.float64) for k, v in flatten(t).items()} for t in (p, q))
    num = sum(float(np.sum((fp[k] - fq[k]) ** 2)) for k in fp)
    return (num / sum(float(np.sum(fp[k] ** 2)) for k in fp)) ** 0.5


def _task(metrics=digits.metrics, train=128, **settings) -> federated.Task:
    data = digits.load_digits()
    return federated.Task(
        "tiny", lambda seed: digits.init_model(TINY, seed), metrics,
        {"pixel_values": data.train_images[:train], "labels": data.train_labels[:train]},
        {"pixel_values": data.test_images[:64], "labels": data.test_labels[:64]},
        dataclasses.replace(digits.TrainSettings(batch_size=32, learning_rate=1e-2), **settings),
    )


def _planted():
    """A tiny ViT A, and B = A moved by a random symmetry transform (B computes A's function)."""
    ck = digits.init_model(TINY, 0)
    spec = rj.spec_for(ck)
    a = ck.params
    b = rj.apply_transform(spec, a, rj.random_transform(spec, a, jax.random.key(3), PLANTED))
    assert _rel(a, b) > 0.1
    return ck, spec, a, b


def test_align_average_sync_undoes_a_planted_transform():
    """After an align+average sync of A and its planted copy B both models are A again (function
    and params); after a plain average they are another function; without a sync they stay. The
    jitted sync is traced once for all three (a Python counter runs only while tracing)."""
    ck, spec, a, b = _planted()
    traces = []

    @jax.jit
    def sync(params, which):
        traces.append(1)
        return federated.sync_params(params, federated.merges(params, spec), which)

    params = federated.stack([a, b])
    run = lambda name: [federated.unstack(sync(params, jnp.int32(federated.SYNCS.index(name))), i) for i in range(2)]
    pixels = _task().test["pixel_values"]
    logits = lambda p: np.asarray(ck.apply(p, pixel_values=pixels)["logits"])
    want = logits(a)
    scale = np.abs(want).max()

    for model in run("align+average"):
        assert _rel(a, model) < 1e-5
        np.testing.assert_allclose(logits(model), want, atol=1e-5 * scale)
    plain = run("average")
    assert _rel(a, plain[0]) > 0.05 and _rel(plain[0], plain[1]) == 0
    assert np.abs(logits(plain[0]) - want).max() > 0.03 * scale  # 3000 times the aligned error
    untouched = run("none")
    assert _rel(a, untouched[0]) == 0 and _rel(b, untouched[1]) == 0
    assert len(traces) == 1 and sync._cache_size() == 1


@pytest.mark.slow  # ~1 min on 2 cores: compiles a whole round (training, align, evaluation)
def test_round_compiles_once_and_measures_a_planted_pair():
    """The jitted round on A and its planted copy B, with a zero learning rate so that its training
    leaves them as they are: the record's aligned barrier and distance are zero, the plain ones
    not; align+average gives A back. Every round and sync reuses the first compilation: the
    traced metrics (a Python counter) run only while tracing, the jit cache holds one entry."""
    traces = []

    def metrics(checkpoint, params, batch):
        traces.append(1)
        return digits.metrics(checkpoint, params, batch)

    ck, spec, a, b = _planted()
    task = _task(metrics, learning_rate=0.0)
    round_fn = federated.round_for(task, federated.Schedule(models=2, rounds=1, local_epochs=1))
    params = federated.stack([federated.stack([a, b])])  # one run of two models
    states = jax.vmap(jax.vmap(federated.local_optimizer(task.settings, 10).init))(params)
    shards = federated.stack([federated.shard(task.train, 2, jax.random.key(0))])
    test = {k: jnp.asarray(v) for k, v in task.test.items()}
    keys = jax.random.split(jax.random.key(1), 1)
    counts = []
    for name in federated.SYNCS * 2:
        state_mode = jnp.asarray([federated.STATES.index("moved" if name == "align+average" else "kept")])
        out, _, record = round_fn(params, states, shards, test, jnp.asarray([federated.SYNCS.index(name)]), state_mode, keys)
        counts.append(len(traces))
        record = jax.tree.map(lambda x: x[0], record)
        assert float(record["distance"]["aligned"]) < 1e-5 * float(record["distance"]["plain"])
        # an untrained ViT's loss is flat (plain barrier ~5e-5): the aligned one is 1000 times below it
        assert float(record["barrier"]["aligned"]) <= 1e-3 * float(record["barrier"]["plain"]) and float(record["barrier"]["plain"]) > 1e-6
        np.testing.assert_allclose(np.asarray(record["models"]["loss"]), float(record["aligned_average"]["loss"]), rtol=1e-5)
        if name == "align+average":
            assert _rel(a, federated.unstack(federated.unstack(out, 0), 1)) < 1e-5
    assert counts[0] > 0 and set(counts) == {counts[0]} and round_fn._cache_size() == 1


def test_in_jit_barrier_is_the_library_barrier():
    ck = digits.init_model(TINY, 0)
    a, b = ck.params, digits.init_model(TINY, 1).params
    batch = {k: jnp.asarray(v) for k, v in _task().test.items()}
    loss_fn = lambda p: digits.metrics(ck, p, batch)["loss"]
    got, curve = jax.jit(lambda a, b: federated.linear_barrier(loss_fn, a, b, federated.ALPHAS))(a, b)
    want = barrier.loss_barrier(loss_fn, a, b, federated.ALPHAS)
    np.testing.assert_allclose(np.asarray(curve), want["curve"]["loss"], rtol=1e-5)
    assert float(got) == pytest.approx(want["barrier"], abs=1e-5)


@pytest.mark.slow  # ~1 min on 2 cores: compiles and trains a batch of runs
def test_runs_learn_and_syncs_make_one_model():
    """Local training lowers the test loss in every run; after a sync the models are one model,
    without one they stay apart; runs batched together equal the same runs one at a time."""
    task = _task(train=None)  # all 1347 images: 21 steps per epoch on each half
    schedule = federated.Schedule(models=2, rounds=3, local_epochs=1)
    runs = [(sync, "different", 0) for sync in federated.SYNCS]
    outs = federated.run_many(task, schedule, runs)
    for (sync, _, _), out in zip(runs, outs):
        first, last = out["records"][0], out["records"][-1]
        assert last["step"] == 3 * 21 and len(last["models"]) == 2
        assert federated.deployed(last)["loss"] < federated.deployed(first)["loss"] - 0.1, sync
        rows = [federated.unstack(out["params"], i) for i in range(2)]
        assert (_rel(*rows) == 0) == (sync != "none"), sync
    alone = federated.run(task, schedule, "align+average", "different", 0)
    np.testing.assert_allclose(alone["records"][-1]["after_sync"]["loss"], outs[2]["records"][-1]["after_sync"]["loss"], rtol=1e-4)


@pytest.mark.slow  # 13 s: an experiment's run; test_opt_state checks the moved states by default
def test_moved_states_follow_the_alignment():
    """A planted pair (B = A moved by a symmetry) and the Adam state each builds from one batch:
    at an align+average sync with state "moved", B's first moment becomes A's (the alignment undoes
    the planted transform, and the state follows it); "kept" leaves it in B's basis, "reset"
    restarts it; model 0's state is never touched."""
    ck, spec, a, b = _planted()
    task = _task()
    opt = federated.local_optimizer(task.settings, 10)
    batch = {k: jnp.asarray(v[:32]) for k, v in task.train.items()}
    params = federated.stack([a, b])

    def one_step(p):
        grads = jax.grad(lambda q: digits.metrics(ck, q, batch)["loss"])(p)
        return opt.update(grads, opt.init(p), p)[1]

    states = jax.vmap(one_step)(params)
    merged = federated.merges(params, spec)
    out = {name: federated.sync_states(states, params, merged, spec, federated.STATES.index(name)) for name in federated.STATES}
    mu = lambda s, i: federated.unstack(s[0].mu, i)  # noqa: E731
    assert _rel(mu(states, 0), mu(states, 1)) > 0.1  # B's state is in B's basis
    assert _rel(mu(out["moved"], 1), mu(states, 0)) < 1e-4
    assert _rel(mu(out["kept"], 1), mu(states, 1)) == 0
    assert float(jnp.abs(out["reset"][0].mu["embeddings"]["cls_token"]).max()) == 0 and int(out["reset"][0].count[1]) == 0
    for name in federated.STATES[1:]:
        assert _rel(mu(out[name], 0), mu(states, 0)) == 0
