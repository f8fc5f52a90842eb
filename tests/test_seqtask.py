"""The synthetic next-token task and the small decoders trained on it (rotsym_experiments.seqtask)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rotsym_experiments import seqtask
from rotsym_jax import stats
from rotsym_jax.pytree import flatten

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")

V = seqtask.VOCAB_SIZE
T = 16
DATA = seqtask.make_data(n_train=2048, n_test=512, seq_len=T)
CONFIGS = {
    "gpt2": seqtask.gpt2_config(n_embd=32, n_layer=1, n_head=2, n_inner=64, n_positions=T),
    "llama": seqtask.llama_config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, max_position_embeddings=T,
    ),
}
FAST = seqtask.TrainSettings(epochs=8, batch_size=64, learning_rate=1e-2)


def _equal(a, b) -> bool:
    fa, fb = flatten(a), flatten(b)
    return fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k]) for k in fa)


# ---- data -----------------------------------------------------------------------------------------

def test_data_is_deterministic_and_train_and_test_differ():
    again = seqtask.make_data(n_train=2048, n_test=512, seq_len=T)
    for split in ("train", "test"):
        for k in DATA.train:
            np.testing.assert_array_equal(getattr(DATA, split)[k], getattr(again, split)[k])
    np.testing.assert_array_equal(DATA.chain.successors, again.chain.successors)
    assert not np.array_equal(DATA.train["input_ids"][:512], DATA.test["input_ids"])
    other = seqtask.make_data(n_train=2048, n_test=512, seq_len=T, train_seed=7)
    assert not np.array_equal(DATA.train["input_ids"], other.train["input_ids"])
    np.testing.assert_array_equal(DATA.test["input_ids"], other.test["input_ids"])
    assert DATA.digest() != other.digest()
    other_task = seqtask.make_data(n_train=8, n_test=8, seq_len=T, task_seed=1)
    assert not np.array_equal(DATA.chain.successors, other_task.chain.successors)


def test_batches_are_shifted_labels_of_chain_sequences():
    batch = DATA.train
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == mask.shape == labels.shape == (2048, T)
    assert ids.dtype == mask.dtype == labels.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < V and (mask == 1).all()
    np.testing.assert_array_equal(labels[:, 1:-1], ids[:, 2:])  # label at t: the token at t + 1
    assert (labels[:, 0] == -100).all() and (labels[:, -1] == -100).all()
    # Every step is one of its context's successors, taken with the chain's probabilities.
    succ = DATA.chain.successors
    assert all(len(set(s)) == len(s) for s in succ.reshape(-1, succ.shape[-1]))
    a, b, c = ids[:, :-2].ravel(), ids[:, 1:-1].ravel(), ids[:, 2:].ravel()
    rank = np.argmax(succ[a, b] == c[:, None], axis=1)
    assert (succ[a, b, rank] == c).all()
    np.testing.assert_allclose(np.bincount(rank) / len(rank), seqtask.SUCCESSOR_PROBS, atol=0.01)
    np.testing.assert_allclose(DATA.chain.transition().sum(-1), 1.0)


def test_the_task_needs_the_earlier_token():
    bayes = seqtask.bayes(DATA.chain)
    assert bayes["accuracy"] == max(seqtask.SUCCESSOR_PROBS)
    unigram, bigram, trigram = (seqtask.ngram_baseline(DATA, c) for c in (0, 1, 2))
    # Without the token two back (which only attention brings to a position) little is predictable...
    assert unigram["accuracy"] < bigram["accuracy"] < bayes["accuracy"] - 0.4
    assert bigram["loss"] > bayes["loss"] + 1.0
    # ...with it, counts from the training set are nearly Bayes-optimal: the chain is identifiable.
    # (The loss pays for add-one smoothing over few examples per context.)
    assert abs(trigram["accuracy"] - bayes["accuracy"]) < 0.02 and trigram["loss"] < bayes["loss"] + 0.4


# ---- metrics --------------------------------------------------------------------------------------

def _reference(logits, labels):
    valid = labels != -100
    logits = logits.astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, np.where(valid, labels, 0)[..., None], -1)[..., 0]
    return -picked[valid].mean(), (logits.argmax(-1) == labels)[valid].mean(), valid.sum()


def test_metrics_match_numpy():
    checkpoint = seqtask.init_model(CONFIGS["llama"], seed=3)
    # Larger weights than the init, so that the logits are far from uniform.
    params = jax.tree.map(lambda x: x * 20 if x.ndim == 2 else x, checkpoint.params)
    batch = {k: v[:40].copy() for k, v in DATA.test.items()}
    rng = np.random.default_rng(0)
    batch["labels"][rng.random(batch["labels"].shape) < 0.3] = -100  # ignored anywhere
    batch["labels"][5] = -100  # and a sequence with nothing to predict
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    logits = np.asarray(checkpoint.apply(params, **inputs)["logits"])
    loss, accuracy, count = _reference(logits, batch["labels"])
    assert accuracy > 0 and 0 < (batch["labels"] == -100).mean() < 0.5
    got = seqtask.metrics(checkpoint, params, batch)
    np.testing.assert_allclose(float(got["loss"]), loss, rtol=1e-5)
    assert abs(float(got["accuracy"]) - accuracy) <= 1 / count  # rounding may flip a near-tie
    # Traceable with the params as an argument (shapes only: no second compile).
    shapes = jax.eval_shape(lambda p: seqtask.metrics(checkpoint, p, batch), params)
    assert shapes["loss"].shape == shapes["accuracy"].shape == ()
    # In chunks, weighted by labelled tokens: the second chunk has fewer (one row has none).
    tail = {k: v.copy() for k, v in batch.items()}
    tail["labels"][:30] = -100
    both = {k: np.concatenate([batch[k], tail[k]]) for k in batch}
    chunked = seqtask.evaluate(checkpoint, params, both, batch_size=40)
    loss2, accuracy2, count2 = _reference(np.concatenate([logits, logits]), both["labels"])
    np.testing.assert_allclose(chunked["loss"], loss2, rtol=1e-5)
    assert abs(chunked["accuracy"] - accuracy2) <= 1 / count2


# ---- training and the cache -----------------------------------------------------------------------

@pytest.fixture(scope="module", params=sorted(CONFIGS))
def trained(request, tmp_path_factory):
    """(family, cache dir, the model of seed 0): trained once per family for the tests below."""
    cache = tmp_path_factory.mktemp(f"cache-{request.param}")
    return request.param, cache, seqtask.train_or_load(CONFIGS[request.param], FAST, 0, DATA, cache)


def test_training_learns_the_task_with_attention(trained):
    family, _, model = trained
    assert not model.from_cache and model.path.parent.name == "seqtask"
    before = seqtask.evaluate(model.checkpoint, model.checkpoint.params, DATA.test)
    after = seqtask.evaluate(model.checkpoint, model.params, DATA.test)
    bigram = seqtask.ngram_baseline(DATA, 1)
    assert after["loss"] < before["loss"] - 1.0, (before, after)
    assert after["accuracy"] > bigram["accuracy"] + 0.2, (after, bigram)
    # Cut the attention's output: each position sees only its own token, so no better than a bigram.
    cut = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if "attention" in str(path) and "out" in str(path) else x, model.params
    )
    ablated = seqtask.evaluate(model.checkpoint, cut, DATA.test)
    assert ablated["accuracy"] < bigram["accuracy"] + 0.02, (family, ablated, bigram)


def test_cache_is_reused_and_keyed_by_data(trained):
    family, cache, model = trained
    again = seqtask.train_or_load(CONFIGS[family], FAST, 0, DATA, cache)
    assert again.from_cache and again.path == model.path and _equal(again.params, model.params)
    other = seqtask.make_data(n_train=2048, n_test=512, seq_len=T, train_seed=7)
    assert seqtask.cache_path(CONFIGS[family], FAST, 0, other, cache) != model.path


def test_shared_init_models_start_together_and_train_apart(trained):
    family, cache, model = trained
    shared = seqtask.train_or_load(CONFIGS[family], FAST, 1, DATA, cache, init_seed=0)
    assert not shared.from_cache and "init0" in shared.path.name
    assert _equal(shared.checkpoint.params, model.checkpoint.params)
    assert not _equal(shared.params, model.params)  # another data order
    assert not _equal(seqtask.init_model(CONFIGS[family], 1).params, model.checkpoint.params)


def _lm_batches():
    """Two batches of 4 test sequences with padding (labelled -100, the transformers convention),
    -100 labels inside sequences, and a sequence with no label at all."""
    batch = {k: v[:8].copy() for k, v in DATA.test.items()}
    batch["attention_mask"][1, 11:] = 0
    batch["labels"][1, 10:] = -100  # its last real token predicts padding
    batch["labels"][2] = -100  # nothing to predict: adds 0, but counts as an example
    batch["labels"][5, 3:7] = -100
    batch["attention_mask"][6, 5:] = 0
    batch["labels"][6, 4:] = -100
    return [{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}]


def _loop_fisher(checkpoint, params, examples):
    """Reference diagonal Fisher of an LM. `examples`: (inputs of one sequence, its label rows).
    Per sequence alone (a batch of one, no vmap) and label row: jax.grad of the sum over the
    positions labelled other than -100 of log p(label | prefix), squared; averaged over the rows,
    then over the sequences."""
    if checkpoint not in _GRADS:  # one compile per checkpoint
        loglik = lambda p, x, onehot: jnp.sum(onehot * jax.nn.log_softmax(checkpoint.apply(p, **x)["logits"][0], -1))
        _GRADS[checkpoint] = jax.jit(jax.grad(loglik))
    total = jax.tree.map(lambda x: np.zeros(x.shape), params)
    for x, rows in examples:
        for y in rows:
            onehot = np.zeros((T, V), np.float32)
            t = np.flatnonzero(y != -100)
            onehot[t, y[t]] = 1.0  # -100: a row of zeros
            g = _GRADS[checkpoint](params, x, onehot)
            n = len(rows)
            total = jax.tree.map(lambda s, gi, n=n: s + np.asarray(gi, np.float64) ** 2 / n, total, g)
    return jax.tree.map(lambda s: s / len(examples), total)


_GRADS = {}


def _assert_fisher_close(got, want):
    got, want = flatten(got), flatten(want)
    assert got.keys() == want.keys()
    for path, w in want.items():
        assert w.max() > 0, path
        np.testing.assert_allclose(np.asarray(got[path], np.float64), w, rtol=1e-4, atol=1e-6 * w.max(), err_msg=path)


@pytest.mark.slow  # the default run keeps to its ~10-minute budget; CI runs this in `make test-slow`
def test_lm_fisher_matches_per_token_loop():
    """Empirical and sampled expected Fisher of a causal LM against a loop over sequences: an
    example's log-likelihood sums its labelled tokens (-100: skipped), averaged per sequence."""
    checkpoint = seqtask.init_model(CONFIGS["llama"], seed=0)
    params, batches = checkpoint.params, _lm_batches()
    inputs = [{k: b[k] for k in ("input_ids", "attention_mask")} for b in batches]
    rows = [({k: v[i : i + 1] for k, v in x.items()}, b["labels"][i]) for x, b in zip(inputs, batches) for i in range(4)]
    assert any((y == -100).all() for _, y in rows) and any(((y == -100) & (x["attention_mask"][0] > 0)).any() for x, y in rows)

    empirical = stats.fisher(checkpoint, params, batches)
    assert empirical.kind == "fisher" and empirical.count == 8  # sequences, the fully unlabelled one included
    _assert_fisher_close(empirical.values, _loop_fisher(checkpoint, params, [(x, [y]) for x, y in rows]))

    # Sampled: the draws replayed by the documented key use (one split per batch, `samples`
    # categorical draws from the batch's logits), kept where the labels are not -100, else (no
    # labels) where the attention mask is 1.
    samples, key = 1, jax.random.key(3)  # 1: the empirical run's compiled shapes (the mean over draws: test_stats.py)
    for labelled in (True, False):
        given = batches if labelled else inputs
        got = stats.fisher(checkpoint, params, given, kind="expected", key=key, samples=samples)
        k, examples = key, []
        for x, b in zip(inputs, batches):
            k, sub = jax.random.split(k)
            logits = checkpoint.apply(params, **x)["logits"].astype(jnp.float32)
            draws = np.asarray(jax.random.categorical(sub, logits, shape=(samples,) + logits.shape[:-1]))
            keep = b["labels"] != -100 if labelled else x["attention_mask"] > 0
            for i in range(4):
                examples.append(({k2: v[i : i + 1] for k2, v in x.items()}, [np.where(keep[i], d[i], -100) for d in draws]))
        assert got.count == 8
        _assert_fisher_close(got.values, _loop_fisher(checkpoint, params, examples))


def test_grams_count_sequences():
    """`count` is the number of examples (sequences) for Grams as for the Fisher: padded or not,
    not the number of tokens the Grams sum over."""
    checkpoint = seqtask.init_model(CONFIGS["llama"], seed=0)
    batches = [{k: v for k, v in b.items() if k != "labels"} for b in _lm_batches()]
    sequences = sum(len(b["input_ids"]) for b in batches)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    assert sequences == 8 < tokens < 8 * T  # padded
    grams = stats.grams(checkpoint, checkpoint.params, batches)
    assert grams.kind == "gram" and grams.count == sequences
    query = grams.values["layers/0/attention/query/kernel"]
    assert query.shape == (32, 32) and np.isfinite(query).all()  # the values: test_stats.py
