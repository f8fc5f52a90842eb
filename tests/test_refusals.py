"""Hostile inputs are refused with an error that names the argument, the bad value and what was
expected, instead of an unrelated exception or a silently wrong answer. Tiny models: each test
runs in about a second."""


import jax
import numpy as np
import pytest
import transformers as tf

import rotsym_jax as rj
from rotsym_experiments import digits
from rotsym_jax import HeadGeometry, SpecError, cli, merge, stats

TINY = dict(vocab_size=11, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)


def bert(**kwargs):
    config = tf.BertConfig(**TINY, max_position_embeddings=8, type_vocab_size=2, num_labels=3)
    return rj.init_checkpoint(config, jax.random.key(0), **kwargs)


def classifier():
    return bert(head="sequence_classification", pooler=True)


def lm():
    config = tf.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=11, n_positions=8)
    return rj.init_checkpoint(config, jax.random.key(0), head="lm")


def batch(labels=None, ids=None):
    ids = np.array([[1, 2, 3, 4], [5, 6, 7, 8]]) if ids is None else np.asarray(ids)
    out = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    return out if labels is None else {**out, "labels": np.asarray(labels)}


# ---- HeadGeometry ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "sizes, message",
    [
        ((0, 0, 8), r"num_heads=0; expected a positive integer"),
        ((0, 1, 8), r"num_heads=0; expected a positive integer"),
        ((4, -2, 8), r"num_kv_heads=-2; expected a positive integer"),
        ((4, 4, 0), r"head_dim=0; expected a positive integer"),
        ((2.5, 1, 8), r"num_heads=2.5; expected a positive integer"),
        ((True, True, 8), r"num_heads=True; expected a positive integer"),
        ((4, 4, 8.0), r"head_dim=8.0; expected a positive integer"),
        ((4, 4, 8, 2.0), r"rotary_dim=2.0; expected None or an even integer in \(0, head_dim=8\]"),
    ],
)
def test_head_geometry_refuses_bad_sizes(sizes, message):
    with pytest.raises(SpecError, match=message):
        HeadGeometry(*sizes)


def test_head_geometry_takes_numpy_integers():
    assert HeadGeometry(np.int64(4), np.int32(2), np.int64(8)).heads_per_group == 2


# ---- stats ----------------------------------------------------------------------------------------

def test_fisher_refuses_a_model_without_logits():
    headless = bert()  # returns last_hidden_state only
    with pytest.raises(ValueError, match=r"a bert model without a task head: the Fisher needs the logits of one"):
        stats.fisher(headless, headless.params, [batch(labels=[0, 1])])


@pytest.mark.parametrize(
    "model, labels, message",
    [
        (classifier, [0, 3], r"labels holds 1 value in \[3, 3\] outside \[0, 3\): the model has 3 classes"),
        (classifier, [-1, 0], r"labels holds 1 value in \[-1, -1\] outside \[0, 3\)"),
        (classifier, [-100, 0], r"labels holds 1 value in \[-100, -100\] outside \[0, 3\)"),
        (classifier, [[0, 1], [1, 2]], r"labels has shape \(2, 2\); expected \(2,\)"),
        (classifier, [0.0, 1.0], r"labels has dtype float32; expected integer"),
        (lm, [[1, 2, 11, 12], [-100, 1, 2, 3]], r"labels holds 2 values in \[11, 12\] outside \[0, 11\): the model predicts 11 classes per token"),
        (lm, [[1, 2, -5, 3], [-100, 1, 2, 3]], r"labels holds 1 value in \[-5, -5\] outside \[0, 11\)"),
        (lm, [0, 1], r"labels has shape \(2,\); expected \(2, 4\)"),
    ],
)
def test_empirical_fisher_refuses_labels_outside_the_label_space(model, labels, message):
    ck = model()
    with pytest.raises(ValueError, match=r"fisher: batches\[0\]: " + message):
        stats.fisher(ck, ck.params, [batch(labels=labels)])


def test_exact_expected_fisher_refuses_per_token_logits():
    ck = lm()
    with pytest.raises(ValueError, match=r"fisher: batches\[0\]: kind='expected' without a key .*classification.*key="):
        stats.fisher(ck, ck.params, [batch()], kind="expected")


@pytest.mark.parametrize("samples", [0, 2.5, True])
def test_fisher_refuses_bad_sample_counts(samples):
    ck = classifier()
    with pytest.raises(ValueError, match=rf"samples={samples!r}; expected a positive integer"):
        stats.fisher(ck, ck.params, [batch()], kind="expected", key=jax.random.key(0), samples=samples)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda ck, bad: stats.fisher(ck, ck.params, [{**bad, "labels": np.array([0, 1])}]), r"fisher: batches\[0\]"),
        (lambda ck, bad: stats.grams(ck, ck.params, [batch(), bad]), r"grams: batches\[1\]"),
        (lambda ck, bad: stats.layer_inputs(ck, ck.params, bad), r"layer_inputs: batch"),
    ],
)
def test_stats_refuse_token_ids_outside_the_vocabulary(call, message):
    ck = classifier()
    with pytest.raises(ValueError, match=message + r": input_ids holds values in \[1, 11\], outside \[0, 11\)"):
        call(ck, batch(ids=[[1, 2, 3, 11], [5, 6, 7, 8]]))
    bad_types = {**batch(), "token_type_ids": np.array([[0, 0, 1, 2], [0, 0, 0, 0]])}
    with pytest.raises(ValueError, match=message + r": token_type_ids holds values in \[0, 2\], outside \[0, 2\)"):
        call(ck, bad_types)


# ---- merge ----------------------------------------------------------------------------------------

def _params(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(3, 2)).astype(np.float32), "b": rng.normal(size=2).astype(np.float32)}


def test_average_with_huge_weights_is_the_plain_average():
    models = [_params(0), _params(1)]
    plain = merge.average(models)
    huge = merge.average(models, weights=[1e308, 1e308])
    for path in plain:
        np.testing.assert_allclose(np.asarray(huge[path]), np.asarray(plain[path]), rtol=1e-6)
        assert np.abs(np.asarray(huge[path])).max() > 0
    tiny = merge.average(models, weights=[5e-324, 5e-324])  # subnormal
    np.testing.assert_allclose(np.asarray(tiny["w"]), np.asarray(plain["w"]), rtol=1e-6)


@pytest.mark.parametrize(
    "weights, message",
    [
        ([np.inf, 1], r"weights=\[inf, 1\.0\]; .*finite"),
        ([np.nan, 1], r"weights=\[nan, 1\.0\]; .*finite"),
        ([-1, 2], r"weights=\[-1\.0, 2\.0\]; .*>= 0"),
        ([0, 0], r"weights=\[0\.0, 0\.0\]; .*positive sum"),
    ],
)
def test_average_refuses_bad_weights(weights, message):
    with pytest.raises(ValueError, match=message):
        merge.average([_params(0), _params(1)], weights=weights)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: merge.task_arithmetic(m[0], m[1:], lam=1e39), r"lam=1e\+39; lam must be a finite number"),
        (lambda m: merge.ties(m[0], m[1:], lam=-1e39), r"lam=-1e\+39"),
        (lambda m: merge.slerp(m[0], m[1], eps=1e39), r"eps=1e\+39"),
    ],
)
def test_merge_scalars_beyond_float32_are_refused(call, message):
    # The arithmetic runs in float32, where these are inf.
    with pytest.raises(ValueError, match=message + r".*float32"):
        call([_params(0), _params(1), _params(2)])


# ---- the command line -----------------------------------------------------------------------------

@pytest.fixture
def no_training(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the demo started instead of refusing its arguments")

    monkeypatch.setattr(digits, "load_digits", fail)
    monkeypatch.setattr(digits, "train_or_load", fail)


@pytest.mark.parametrize("where, message", [("file", "is not a directory"), ("file/sub", "cannot be created")])
def test_demo_refuses_a_cache_dir_that_is_not_a_directory(where, message, tmp_path, capsys, no_training):
    (tmp_path / "file").write_text("not a directory\n")
    cache_dir = tmp_path / where
    compilation_cache = jax.config.jax_compilation_cache_dir
    with pytest.raises(SystemExit) as exit_info:  # no_training: refused before the data is read or a model trained
        cli.main(["demo", "--cache-dir", str(cache_dir)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "rotsym demo: error:" in err and "usage:" not in err
    assert f"--cache-dir {cache_dir}: {message}" in err and "Traceback" not in err, err
    assert jax.config.jax_compilation_cache_dir == compilation_cache  # refused before any side effect


def test_a_checkpoint_where_params_go_is_refused_with_the_fix():
    ck = rj.init_checkpoint(tf.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48), jax.random.key(0))
    with pytest.raises(TypeError, match=r"got Checkpoint; a Checkpoint holds its params in .params: pass checkpoint.params"):
        rj.align(ck, ck, rj.spec_for(ck))
    with pytest.raises(TypeError, match=r"spec_for takes a Checkpoint or a transformers config, got dict"):
        rj.spec_for(ck.params)
    with pytest.raises(ValueError, match=r"params_list\[0\] must be a params pytree \(a nested dict\), got Checkpoint: pass checkpoint.params"):
        rj.merge.average([ck, ck])
