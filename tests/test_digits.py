"""The demo's digits ViTs: data split, training, the orbax cache, and `rotsym demo`."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest

from rotsym_experiments import digits
from rotsym_jax import cli
from rotsym_jax.pytree import flatten

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")

TINY = digits.vit_config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
FAST = digits.TrainSettings(epochs=5, batch_size=32, learning_rate=1e-2)


def _equal(a, b) -> bool:
    fa, fb = flatten(a), flatten(b)
    return fa.keys() == fb.keys() and all(np.array_equal(fa[k], fb[k]) for k in fa)


def test_split_is_fixed_stratified_and_normalised():
    a, b = digits.load_digits(), digits.load_digits()
    assert a.train_images.shape == (1347, 1, 8, 8) and a.test_images.shape == (450, 1, 8, 8)
    np.testing.assert_array_equal(a.test_images, b.test_images)
    assert abs(a.train_images.mean()) < 1e-5 and abs(a.train_images.std() - 1) < 1e-5
    assert np.bincount(a.test_labels).min() >= 40  # stratified: 43 to 46 of each class


def test_training_reduces_loss_and_beats_chance():
    data = digits.load_digits()
    checkpoint = digits.init_model(TINY, seed=0)
    params, losses = digits.train(checkpoint, data, FAST, jax.random.key(0))
    assert losses.shape == (FAST.epochs,) and losses[-1] < losses[0]
    before = digits.loss(checkpoint, checkpoint.params, data.train_images, data.train_labels)
    after = digits.loss(checkpoint, params, data.train_images, data.train_labels)
    assert after < before - 0.5, (before, after)
    assert digits.accuracy(checkpoint, params, data.test_images, data.test_labels) > 0.3  # chance: 0.1


def test_cache_is_reused_and_seeds_differ(tmp_path):
    data = digits.load_digits()
    first = digits.train_or_load(TINY, FAST, 0, data, tmp_path)
    again = digits.train_or_load(TINY, FAST, 0, data, tmp_path)
    other = digits.train_or_load(TINY, FAST, 1, data, tmp_path)
    assert (first.from_cache, again.from_cache, other.from_cache) == (False, True, False)
    assert again.path == first.path and first.path.parent == tmp_path / "digits"
    assert _equal(first.params, again.params)
    assert not _equal(first.params, other.params)
    # Only finished entries, no temporaries left behind.
    assert sorted(p.name for p in (tmp_path / "digits").iterdir()) == sorted([first.path.name, other.path.name])
    # Other settings are another entry.
    assert digits.cache_path(TINY, FAST, 0, tmp_path) != digits.cache_path(
        TINY, digits.TrainSettings(epochs=4), 0, tmp_path
    )


def test_shared_init_models_start_together_and_train_apart(tmp_path):
    data = digits.load_digits()
    shared = digits.train_or_load(TINY, FAST, 1, data, tmp_path, init_seed=0)
    own = digits.train_or_load(TINY, FAST, 0, data, tmp_path)
    assert shared.path != digits.cache_path(TINY, FAST, 1, tmp_path) and "init0" in shared.path.name
    assert _equal(shared.checkpoint.params, digits.init_model(TINY, 0).params)
    assert not _equal(shared.params, own.params)  # another data order
    assert digits.train_or_load(TINY, FAST, 1, data, tmp_path, init_seed=0).from_cache


def test_damaged_cache_entries_are_retrained(tmp_path):
    data = digits.load_digits()
    first = digits.train_or_load(TINY, FAST, 0, data, tmp_path)
    # A readable entry whose params are not the ones recorded (e.g. flipped bits).
    entry = first.path / digits.ENTRY_FILE
    entry.write_text(entry.read_text().replace('"params_sha256": "', '"params_sha256": "0'))
    with pytest.warns(UserWarning, match="checksum"):
        again = digits.train_or_load(TINY, FAST, 0, data, tmp_path)
    assert not again.from_cache
    assert _equal(first.params, again.params)  # training is deterministic given the seed
    # Unreadable orbax files.
    for f in (first.path / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="discarding unreadable cache entry"):
        assert not digits.train_or_load(TINY, FAST, 0, data, tmp_path).from_cache
    assert digits.train_or_load(TINY, FAST, 0, data, tmp_path).from_cache


def test_cache_root_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ROTSYM_CACHE", str(tmp_path))
    assert digits.cache_path(TINY, FAST, 3, None).parent == tmp_path / "digits"
    assert digits.cache_root("elsewhere") == Path("elsewhere")


@pytest.mark.slow  # 50 s: the demo end to end, twice (CI runs the slow tests; the default run ~10 min)
def test_demo_command(tmp_path, capsys, monkeypatch):
    # The tiny model and settings of the other tests (compiled once), not the demo's own.
    monkeypatch.setattr(digits, "vit_config", lambda: TINY)
    monkeypatch.setattr(digits, "TrainSettings", lambda: FAST)
    argv = ["demo", "--cache-dir", str(tmp_path), "--epochs", str(FAST.epochs), "--seeds", "3", "4", "--steps", "5"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for line in ("seed 3", "seed 4", "plain average", "avg, paper's matching", "avg, + residual rotation", "avg, activations", "avg, learned",
                 "fisher, no matching", "fisher, learned"):
        assert line in out and "%" in out.split(line)[1].splitlines()[0], out
    assert len(re.findall(r"\btrained\b", out)) == 2
    # The distance table: each weight alignment brings the moved model closer to the anchor, the
    # residual stream closer still (it adds to the paper's groups, and head permutations).
    total = lambda label: float(re.search(rf"^{label} .* ([\d.]+)$", out, re.M).group(1))
    assert total("after the paper's matching") < total("before") and total("after \\+ residual rotation") < total("before, gains folded")
    # The story under the tables tells what this run measured (it said "here worse" of a result
    # equal to weight matching's, which activation matching had kept).
    row = lambda label: re.search(rf"^{label} +(.*)$", out, re.M).group(1)
    assert ("whose result it kept" in out) == (row("after activations") == row("after \\+ residual rotation")), out
    cli.main(argv)
    assert capsys.readouterr().out.count("cache  ") == 2


@pytest.mark.parametrize("argv", [["demo", "--seeds", "1", "1"], ["demo", "--epochs", "0"], []])
def test_demo_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2 and "rotsym" in (err := capsys.readouterr().err) and "error:" in err and "usage:" not in err
