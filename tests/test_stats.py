"""Statistics for merging: diagonal Fisher against a per-example gradient loop, Gram matrices
against per-example runs without padding, and Grams that follow an alignment against Grams
recomputed on the aligned model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_invariance import random_model

import rotsym_jax as rj
from rotsym_jax import stats
from rotsym_jax.pytree import flatten
from rotsym_jax.transforms import KINDS

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")


def text_batch(seed=0, labels=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 97, size=(3, 6))
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": rng.integers(0, labels, size=3)}


def loop_fisher(ck, params, batch, expected):
    grad_log_prob = jax.jit(jax.grad(lambda p, x, y: jax.nn.log_softmax(ck.apply(p, **x)["logits"][0])[y]))

    """Per example: gradient of log p(y|x) by jax.grad on that example alone (a batch of one),
    squared; averaged."""
    total = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, np.float64), params)
    n = len(batch["labels"])
    for i in range(n):
        x = {"input_ids": batch["input_ids"][i : i + 1], "attention_mask": batch["attention_mask"][i : i + 1]}
        probs = np.exp(np.asarray(jax.nn.log_softmax(ck.apply(params, **x)["logits"][0]), np.float64))
        ys = range(len(probs)) if expected else [int(batch["labels"][i])]
        for y in ys:
            g = grad_log_prob(params, x, jnp.asarray(y))
            w = probs[y] if expected else 1.0
            total = jax.tree_util.tree_map(lambda t, gi, w=w: t + w * np.asarray(gi, np.float64) ** 2, total, g)
    return jax.tree_util.tree_map(lambda t: t / n, total)


# The expected Fisher (18 s) runs in the slow suite: the default run keeps to its time budget.
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "expected" else k for k in stats.FISHER_KINDS])
def test_fisher_matches_per_example_loop(kind):
    ck, params = random_model("bert-cls")
    batch = text_batch()
    got = stats.fisher(ck, params, [batch], kind=kind)
    assert got.kind == "fisher" and got.count == 3
    want = loop_fisher(ck, params, batch, expected=(kind == "expected"))
    for path, w in flatten(want).items():
        g = np.asarray(flatten(got.values)[path], np.float64)
        np.testing.assert_allclose(g, w, rtol=2e-3, atol=1e-6 * np.abs(w).max() + 1e-12, err_msg=path)
    assert max(np.abs(w).max() for w in flatten(want).values()) > 0


@pytest.mark.slow  # the default run keeps to its ~10-minute budget; CI runs this in `make test-slow`
def test_fisher_sampled_is_deterministic_and_unbiased():
    ck, params = random_model("bert-cls")
    batch = text_batch()
    exact = flatten(stats.fisher(ck, params, [batch], kind="expected").values)
    a = flatten(stats.fisher(ck, params, [batch], kind="expected", key=jax.random.key(0), samples=400).values)
    b = flatten(stats.fisher(ck, params, [batch], kind="expected", key=jax.random.key(0), samples=400).values)
    path = "head/classifier/kernel"
    np.testing.assert_array_equal(np.asarray(a[path]), np.asarray(b[path]))
    rel = np.linalg.norm(np.asarray(a[path]) - np.asarray(exact[path])) / np.linalg.norm(np.asarray(exact[path]))
    assert rel < 0.15  # Monte Carlo over 400 draws per example


@pytest.mark.slow  # the default run keeps to its ~10-minute budget; CI runs this in `make test-slow`
def test_fisher_batches_average_per_example():
    ck, params = random_model("bert-cls")
    batch = text_batch()
    whole = flatten(stats.fisher(ck, params, [batch]).values)
    parts = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(3)]
    calls = []
    split = stats.fisher(ck, params, parts, progress=lambda: calls.append(len(calls)))
    assert split.count == 3  # examples over all batches
    assert calls == [0, 1, 2]  # progress: once per batch
    split = flatten(split.values)
    for path in whole:
        np.testing.assert_allclose(np.asarray(split[path]), np.asarray(whole[path]), rtol=1e-4, atol=1e-10)


@pytest.mark.parametrize("name", [pytest.param("bert-cls", marks=pytest.mark.slow), "llama-gqa"])  # bert: slow suite (time budget)
def test_grams_skip_padding(name):
    """Grams of a padded batch equal the sum of Grams of each example run alone, unpadded."""
    ck, params = random_model(name)
    batch = text_batch()
    del batch["labels"]
    got = stats.grams(ck, params, [batch])
    # count: the examples (sequences), padded or not, as for the Fisher; not the 12 tokens summed over
    assert got.kind == "gram" and got.count == len(batch["input_ids"]) == 3 < int(batch["attention_mask"].sum())
    want = {}
    for i in range(3):
        keep = batch["attention_mask"][i] > 0
        alone = {"input_ids": batch["input_ids"][i : i + 1, keep], "attention_mask": batch["attention_mask"][i : i + 1, keep]}
        for path, x in stats.layer_inputs(ck, params, alone).items():
            x = x.astype(np.float64)
            want[path] = want.get(path, 0) + x.T @ x
    assert set(got.values) == set(want) and "layers/0/mlp/down/kernel" in want
    for path, w in want.items():
        np.testing.assert_allclose(np.asarray(got.values[path]), w, rtol=1e-4, atol=1e-4 * np.abs(w).max(), err_msg=path)
    # per-token inputs keep exactly the non-padding tokens
    rows = stats.layer_inputs(ck, params, batch)
    assert rows["layers/0/attention/query/kernel"].shape[0] == int(batch["attention_mask"].sum())


@pytest.mark.parametrize("name, residual", [("llama-gqa", "none"), ("vit-cls", "none"), ("vit-cls", "permutation"),
                                            pytest.param("llama-gqa", "rotation", marks=pytest.mark.slow)])
def test_grams_follow_alignment(name, residual):
    ck, params_a = random_model(name)
    _, params_b = random_model(name, seed=1)
    spec = rj.spec_for(ck)
    if residual == "rotation":  # a rotation of the stream needs the RMSNorm gains folded
        params_a, params_b = rj.fold_norms(spec, params_a), rj.fold_norms(spec, params_b)
    # move B by a random symmetry first so that the alignment has rotations, scales, permutations to undo
    params_b = rj.apply_transform(spec, params_b, rj.random_transform(spec, params_b, jax.random.key(5), KINDS))
    if ck.family == "vit":
        batch = {"pixel_values": np.random.default_rng(0).normal(size=(3, 1, 8, 8)).astype(np.float32)}
    else:
        batch = text_batch()
        del batch["labels"]
    result = rj.align(params_a, params_b, spec, heads="permute", rescale="joint", residual=residual)
    before = stats.grams(ck, params_b, [batch])
    moved = stats.follow(before, result)
    recomputed = stats.grams(ck, result.params, [batch])
    moved.check(result.params)
    changed = 0
    for path, g in recomputed.values.items():
        g = np.asarray(g)
        np.testing.assert_allclose(np.asarray(moved.values[path]), g, rtol=1e-3, atol=2e-4 * np.abs(g).max(), err_msg=path)
        changed += not np.allclose(np.asarray(before.values[path]), g, atol=1e-3 * np.abs(g).max())
    assert changed >= 2  # FFN down and attention out inputs did change
    if residual != "none":  # and the inputs of the stream's readers
        assert not np.allclose(np.asarray(before.values["layers/0/attention/query/kernel"]), np.asarray(recomputed.values["layers/0/attention/query/kernel"]))


def test_grams_follow_an_alignment_that_moves_both_axes_of_a_kernel():
    """MLA's latent readers (q_b_proj, kv_b_proj) take the latent's permutation on their input axis
    and the heads' maps on their output axis: a Gram reads the input alone, so it follows the
    latent (it was refused: both axes transformed), equal to the Grams of the aligned model."""
    import transformers as tf
    from family_cases import DEEPSEEK

    config = tf.DeepseekV3Config(**{**DEEPSEEK, "vocab_size": 97, "num_hidden_layers": 1})  # a dense layer
    a, b = (rj.init_checkpoint(config, jax.random.key(seed), head="lm") for seed in (0, 1))
    spec = rj.spec_for(a)
    batch = {k: v for k, v in text_batch().items() if k != "labels"}
    result = rj.align(a.params, b.params, spec, heads="permute")
    before = stats.grams(b, b.params, [batch])
    moved, recomputed = stats.follow(before, result), stats.grams(b, result.params, [batch])
    readers = [p for p in recomputed.values if p.endswith(("attention/query_up/kernel", "attention/query_up_rope/kernel", "attention/key/kernel",
                                                           "attention/value/kernel"))]
    assert {p.split("/")[-2][0] for p in readers} >= {"q", "k"} or {p.split("/")[-2][0] for p in readers} >= {"q", "v"}, sorted(recomputed.values)
    for path, g in recomputed.values.items():
        g = np.asarray(g)
        np.testing.assert_allclose(np.asarray(moved.values[path]), g, rtol=1e-3, atol=2e-4 * np.abs(g).max(), err_msg=path)
    assert all(not np.allclose(np.asarray(before.values[p]), np.asarray(recomputed.values[p])) for p in readers)  # the latents moved


def test_stats_reject_other_params():
    ck, params = random_model("bert-cls")
    _, other = random_model("bert-cls", seed=1)
    batch = text_batch()
    calls = []
    g = stats.grams(ck, params, [batch, batch], progress=lambda: calls.append(1))
    assert calls == [1, 1]  # progress: once per batch
    with pytest.raises(TypeError, match="progress="):
        stats.grams(ck, params, [batch], progress=3)
    g.check(params)
    with pytest.raises(stats.StatsError, match="follow the alignment"):
        g.check(other)
    with pytest.raises(stats.StatsError, match="recompute"):
        stats.follow(stats.fisher(ck, params, [batch]), rj.align(params, params, rj.spec_for(ck)))
    with pytest.raises(stats.StatsError, match="other params than the model B this alignment moved"):
        stats.follow(g, rj.align(params, other, rj.spec_for(ck)))
    with pytest.warns(DeprecationWarning, match=r"call stats.follow\(stats, result\)"):
        old_form = stats.follow(g, rj.spec_for(ck), params, rj.align(other, params, rj.spec_for(ck)))
    assert old_form.fingerprint == stats.fingerprint(rj.align(other, params, rj.spec_for(ck)).params)
    with pytest.raises(ValueError, match="kind="):
        stats.fisher(ck, params, [batch], kind="nope")
    with pytest.raises(ValueError, match="labels"):
        stats.fisher(ck, params, [{k: v for k, v in batch.items() if k != "labels"}])
