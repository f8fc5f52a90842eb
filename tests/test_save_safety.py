"""save_hf never loses data: what it refuses to replace, and a target that holds the complete old
or the complete new checkpoint at every instant, whatever step fails."""

import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf
from safetensors import safe_open

import rotsym_jax as rj
from rotsym_jax import hf
from rotsym_jax.io import _publish as publishing  # the atomic rename's steps
from rotsym_jax.io._publish import MANIFEST

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=99)


@pytest.fixture
def source(tmp_path):
    """A checkpoint folder with a tokenizer file, as a downloaded one would have."""
    ck = rj.init_checkpoint(tf.BertConfig(**SMALL), jax.random.key(0), pooler=True)
    folder = rj.save_hf(ck, ck.params, tmp_path / "src")
    (folder / "tokenizer.json").write_text("{}")
    return rj.load_hf(folder)


def _shifted(ck, by):
    return jax.tree_util.tree_map(lambda x: x + by, ck.params)


def _marker(folder):
    """A value that tells the checkpoints apart (0 for the source, +1/+2 for the others)."""
    return float(rj.load_hf(folder).params["pooler"]["dense"]["bias"][0])


def _listing(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def old(source, tmp_path):
    """An existing output folder (params + 1) that a new save (params + 2) replaces."""
    out = tmp_path / "out"
    out.mkdir()
    return rj.save_hf(source, _shifted(source, 1.0), out / "merged")


def test_overwrite_replaces_and_leaves_nothing_else(source, old):
    base = _marker(source.source)
    rj.save_hf(source, _shifted(source, 2.0), old, overwrite=True)
    assert _marker(old) == pytest.approx(base + 2)
    assert _listing(old.parent) == ["merged"]
    assert (old / "tokenizer.json").is_file()


def test_existing_target_needs_overwrite(source, old):
    with pytest.raises(FileExistsError, match="overwrite=True"):
        rj.save_hf(source, _shifted(source, 2.0), old)
    assert _marker(old) == pytest.approx(_marker(source.source) + 1)


def test_overwrite_refuses_a_folder_that_is_not_a_checkpoint(source, tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        rj.save_hf(source, source.params, folder, overwrite=True)
    assert (folder / "thesis.tex").read_text() == "years of work"
    assert _listing(tmp_path) == ["notes", "src"]


@pytest.mark.parametrize("where", ["source", "parent"])
def test_overwrite_refuses_the_source_and_its_ancestors(source, where):
    target = source.source if where == "source" else source.source.parent
    before = _listing(source.source)
    with pytest.raises(FileExistsError, match="holds the source checkpoint") as e:
        rj.save_hf(source, _shifted(source, 1.0), target, overwrite=True)
    assert isinstance(e.value, rj.RotsymError)  # a refusal like any other
    assert _listing(source.source) == before and _marker(source.source) == 0.0
    assert _listing(source.source.parent) == ["src"]


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "file"])
def test_refuses_a_target_that_is_not_a_folder(source, old, kind):
    target = old.parent / "target"
    if kind == "symlink":
        target.symlink_to(old)
    elif kind == "dangling symlink":
        target.symlink_to(old.parent / "nowhere")
    else:
        target.write_text("keep me")
    with pytest.raises(FileExistsError, match="symbolic link" if "symlink" in kind else "not a folder"):
        rj.save_hf(source, _shifted(source, 2.0), target, overwrite=True)
    assert _listing(old.parent) == ["merged", "target"]
    assert _marker(old) == pytest.approx(1.0)
    if kind == "file":
        assert target.read_text() == "keep me"


def test_refuses_a_read_only_target_before_writing(source, old, monkeypatch):
    # As root every folder is writable, so the permission check is what is tested here.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if os.fspath(p) == os.fspath(old) else real_access(p, mode))
    with pytest.raises(PermissionError, match="not writable"):
        rj.save_hf(source, _shifted(source, 2.0), old, overwrite=True)
    assert _listing(old.parent) == ["merged"] and _marker(old) == pytest.approx(1.0)


def test_refuses_a_non_floating_dtype(source, tmp_path):
    with pytest.raises(rj.CheckpointError, match="int8"):
        rj.save_hf(source, source.params, tmp_path / "int8", dtype=jnp.int8)
    assert not (tmp_path / "int8").exists() and _listing(tmp_path) == ["src"]


def test_refuses_non_finite_params_and_float16_overflow(source, tmp_path):
    params = _shifted(source, 0.0)
    params["layers"][0]["attention"]["query"]["kernel"] = params["layers"][0]["attention"]["query"]["kernel"].at[0, 0].set(jnp.nan)
    with pytest.raises(rj.CheckpointError, match=r"layers/0/attention/query/kernel \(1 of 1024"):
        rj.save_hf(source, params, tmp_path / "nan")
    big = _shifted(source, 0.0)
    big["pooler"]["dense"]["bias"] = big["pooler"]["dense"]["bias"].at[3].set(1e5)  # > float16 max
    with pytest.raises(rj.CheckpointError, match=r"pooler/dense/bias \(1 of 32 as float16\)"):
        rj.save_hf(source, big, tmp_path / "f16", dtype=jnp.float16)
    assert _listing(tmp_path) == ["src"]
    rj.save_hf(source, params, tmp_path / "nan", allow_nonfinite=True)
    with pytest.raises(rj.CheckpointError, match="non-finite"):
        rj.load_hf(tmp_path / "nan")


def test_a_name_of_250_characters(source, tmp_path):
    target = tmp_path / ("m" * 250)
    rj.save_hf(source, _shifted(source, 1.0), target)
    rj.save_hf(source, _shifted(source, 2.0), target, overwrite=True)
    assert _marker(target) == pytest.approx(2.0)
    assert _listing(tmp_path) == sorted(["src", "m" * 250])


def test_saving_inside_the_source_does_not_nest_earlier_outputs(source):
    folder = source.source
    (folder / "docs").mkdir()
    (folder / "docs" / "card.md").write_text("model card")
    first = rj.save_hf(source, _shifted(source, 1.0), folder / "aligned")
    second = rj.save_hf(source, _shifted(source, 2.0), folder / "merged")
    again = rj.save_hf(source, _shifted(source, 3.0), folder / "aligned", overwrite=True)
    for out in (first, second, again):  # docs/ is not checkpoint data: left out
        assert _listing(out) == [MANIFEST, "config.json", "model.safetensors", "tokenizer.json"]


# Every step of a save, in order; a failure at any of them leaves the old checkpoint and no leftovers.
STEPS = ["write_config", "write_shards", "copy_extra_files", "exchange"]
# the module whose name each step is called by (the atomic publishing lives in io/_publish.py)
OWNER = {"exchange": publishing, "rename_noreplace": publishing}


@pytest.mark.parametrize("step", STEPS)
def test_a_failure_at_any_step_leaves_the_old_checkpoint(source, old, monkeypatch, step):
    def fail(*args, **kwargs):
        raise OSError(f"injected failure in {step}")

    monkeypatch.setattr(OWNER.get(step, hf), step, fail)
    with pytest.raises(OSError, match=f"injected failure in {step}"):
        rj.save_hf(source, _shifted(source, 2.0), old, overwrite=True)
    assert _listing(old.parent) == ["merged"]
    assert _marker(old) == pytest.approx(1.0)
    assert _listing(old) == [MANIFEST, "config.json", "model.safetensors", "tokenizer.json"]


@pytest.mark.parametrize("step", ["write_shards", "rename_noreplace"])
def test_a_failed_first_save_leaves_nothing(source, tmp_path, monkeypatch, step):
    monkeypatch.setattr(OWNER.get(step, hf), step, lambda *a, **k: (_ for _ in ()).throw(OSError("injected")))
    with pytest.raises(OSError, match="injected"):
        rj.save_hf(source, source.params, tmp_path / "new")
    assert _listing(tmp_path) == ["src"]


def _watch(monkeypatch, target, allowed):
    """Check the target before and after each filesystem move or delete save_hf makes."""
    seen = []

    def check():
        seen.append(round(_marker(target), 3))
        assert seen[-1] in allowed, f"target holds {seen[-1]}, expected one of {allowed}"

    for name, owner in [("exchange", publishing), ("rename_noreplace", publishing), ("rename", os), ("rmtree", shutil)]:
        real = getattr(owner, name)

        def watched(*args, _real=real, **kwargs):
            check()
            out = _real(*args, **kwargs)
            check()
            return out

        monkeypatch.setattr(owner, name, watched)
    return seen


def test_target_is_complete_at_every_instant(source, old, monkeypatch):
    seen = _watch(monkeypatch, old, allowed={1.0, 2.0})
    rj.save_hf(source, _shifted(source, 2.0), old, overwrite=True)
    assert seen[0] == 1.0 and seen[-1] == 2.0


def test_without_atomic_exchange_the_old_folder_comes_back_on_failure(source, old, monkeypatch):
    """Filesystems without renameat2(RENAME_EXCHANGE): two renames, undone if the second fails."""
    monkeypatch.setattr(publishing, "exchange", lambda a, b: (_ for _ in ()).throw(NotImplementedError()))
    real_rename, calls = os.rename, []

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("injected failure in the second rename")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="second rename"):
        rj.save_hf(source, _shifted(source, 2.0), old, overwrite=True)
    assert _listing(old.parent) == ["merged"] and _marker(old) == pytest.approx(1.0)
    monkeypatch.setattr(os, "rename", real_rename)
    rj.save_hf(source, _shifted(source, 2.0), old, overwrite=True)
    assert _listing(old.parent) == ["merged"] and _marker(old) == pytest.approx(2.0)


def test_a_failed_cleanup_after_the_swap_warns_and_keeps_the_new(source, old, monkeypatch):
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if not kwargs.get("ignore_errors"):
            raise PermissionError("injected: cannot delete")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.warns(UserWarning, match=r"could not delete its previous content at .*\.rotsym-tmp-"):
        rj.save_hf(source, _shifted(source, 2.0), old, overwrite=True)
    assert _marker(old) == pytest.approx(2.0)


def test_each_tensor_keeps_its_dtype(source, tmp_path):
    """A mixed float16/float32 checkpoint loads and saves each tensor in its own dtype."""
    import safetensors.numpy

    path = source.source / "model.safetensors"
    tensors = safetensors.numpy.load_file(path)
    half = "encoder.layer.0.attention.self.query.weight"
    tensors[half] = tensors[half].astype(np.float16)
    mixed = tmp_path / "mixed"
    shutil.copytree(source.source, mixed)
    safetensors.numpy.save_file(tensors, mixed / "model.safetensors", metadata={"format": "pt"})
    ck = rj.load_hf(mixed)
    assert ck.params["layers"][0]["attention"]["query"]["kernel"].dtype == jnp.float16
    assert ck.params["layers"][0]["attention"]["key"]["kernel"].dtype == jnp.float32
    out = rj.save_hf(ck, jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), ck.params), tmp_path / "again")
    with safe_open(out / "model.safetensors", "numpy") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes.pop(half) == "F16" and set(dtypes.values()) == {"F32"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(safetensors.numpy.load_file(out / "model.safetensors")[half], tensors[half])
