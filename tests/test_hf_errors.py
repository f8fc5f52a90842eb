"""Bad checkpoint folders and params get errors that name the file/tensor and the shapes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import transformers as tf
from safetensors import safe_open

import rotsym_jax as rj

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99)


@pytest.fixture
def folder(tmp_path):
    """A valid BERT checkpoint folder written by save_hf (no torch needed)."""
    ck = rj.init_checkpoint(tf.BertConfig(**SMALL), jax.random.key(0), pooler=True)
    return rj.save_hf(ck, ck.params, tmp_path / "bert")


def _edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = safetensors.numpy.load_file(path)
    edit(tensors)
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_valid_folder_loads(folder):
    ck = rj.load_hf(folder)
    assert ck.family == "bert" and ck.layout.pooler


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        rj.load_hf(tmp_path / "nope")


def test_missing_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        rj.load_hf(folder)


def test_missing_weights(folder):
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(rj.CheckpointError, match=r"no model\.safetensors.*only safetensors"):
        rj.load_hf(folder)


def test_missing_shard(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"embeddings.word_embeddings.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(rj.CheckpointError, match="shard files that are missing.*00002"):
        rj.load_hf(folder)


def test_unsupported_model_type(folder):
    _edit_config(folder, model_type="t5")
    with pytest.raises(rj.CheckpointError, match=r"unsupported model_type 't5'.*supported: .*bert"):
        rj.load_hf(folder)


def test_no_model_type(folder):
    config = json.loads((folder / "config.json").read_text())
    del config["model_type"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(rj.CheckpointError, match="no 'model_type'"):
        rj.load_hf(folder)


def test_missing_tensor(folder):
    _edit_tensors(folder, lambda t: t.pop("encoder.layer.1.attention.self.key.weight"))
    with pytest.raises(rj.CheckpointError, match=r"'encoder.layer.1.attention.self.key.weight'.*layers/1/attention/key/kernel.*missing.*\(32, 32\)"):
        rj.load_hf(folder)


def test_wrong_tensor_shape(folder):
    def edit(t):
        t["encoder.layer.0.intermediate.dense.weight"] = np.zeros((48, 32), np.float32)

    _edit_tensors(folder, edit)
    with pytest.raises(rj.CheckpointError, match=r"intermediate\.dense\.weight' has shape \(48, 32\), expected \(64, 32\)"):
        rj.load_hf(folder)


def test_config_disagrees_with_weights(folder):
    _edit_config(folder, hidden_size=64)
    with pytest.raises(rj.CheckpointError, match=r"expected .*64.*hidden_size=64.*disagrees with the weights"):
        rj.load_hf(folder)


def test_config_has_fewer_layers_than_weights(folder):
    _edit_config(folder, num_hidden_layers=1)
    with pytest.raises(rj.CheckpointError, match=r"unexpected tensors.*num_hidden_layers=1.*encoder\.layer\.1\."):
        rj.load_hf(folder)


def test_config_has_more_layers_than_weights(folder):
    _edit_config(folder, num_hidden_layers=3)
    with pytest.raises(rj.CheckpointError, match=r"encoder\.layer\.2\..*missing"):
        rj.load_hf(folder)


def test_save_rejects_params_of_another_shape(folder, tmp_path):
    ck = rj.load_hf(folder)
    params = jax.tree_util.tree_map(lambda x: x, ck.params)
    params["layers"][0]["mlp"]["up"]["kernel"] = jnp.zeros((32, 65))
    with pytest.raises(rj.CheckpointError, match=r"layers/0/mlp/up/kernel has shape \(32, 65\), expected \(32, 64\)"):
        rj.save_hf(ck, params, tmp_path / "out")
    del params["layers"][1]
    with pytest.raises(rj.CheckpointError, match=r"missing leaves \['layers/1/"):
        rj.save_hf(ck, params, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_save_refuses_to_clobber_and_failure_leaves_nothing(folder, tmp_path, monkeypatch):
    ck = rj.load_hf(folder)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        rj.save_hf(ck, ck.params, folder)

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        rj.save_hf(ck, ck.params, folder, overwrite=True)
    with pytest.raises(OSError, match="disk full"):
        rj.save_hf(ck, ck.params, tmp_path / "fresh")
    # The old checkpoint is intact, no new folder, no temporary leftovers.
    assert rj.load_hf(folder).family == "bert"
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]


def test_overwrite_replaces_atomically(folder):
    ck = rj.load_hf(folder)
    params = jax.tree_util.tree_map(lambda x: x + 1, ck.params)
    rj.save_hf(ck, params, folder, overwrite=True)
    np.testing.assert_array_equal(
        np.asarray(rj.load_hf(folder).params["pooler"]["dense"]["bias"]), np.asarray(params["pooler"]["dense"]["bias"])
    )
    assert sorted(p.name for p in folder.parent.iterdir()) == ["bert"]


def test_sharded_round_trip(folder, tmp_path):
    ck = rj.load_hf(folder)
    out = rj.save_hf(ck, ck.params, tmp_path / "sharded", max_shard_bytes=20_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    assert not (out / "model.safetensors").exists()
    again = rj.load_hf(out)
    jax.tree_util.tree_map(np.testing.assert_array_equal, again.params, ck.params)


def test_dtype_kept_and_cast(folder, tmp_path):
    ck = rj.load_hf(folder)
    half = rj.save_hf(ck, ck.params, tmp_path / "bf16", dtype=jnp.bfloat16)
    loaded = rj.load_hf(half)
    assert loaded.dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree_util.tree_leaves(loaded.params)} == {jnp.dtype(jnp.bfloat16)}
    # Saving a bf16-sourced checkpoint keeps bf16 even when params were upcast.
    up = rj.load_hf(half, dtype=jnp.float32)
    assert {x.dtype for x in jax.tree_util.tree_leaves(up.params)} == {jnp.dtype(jnp.float32)}
    again = rj.save_hf(up, up.params, tmp_path / "again")
    with safe_open(again / "model.safetensors", "numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
