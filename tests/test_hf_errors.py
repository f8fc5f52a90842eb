"""Bad checkpoint folders and params get errors that name the file/tensor and the shapes."""

import json
import re

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
    """A refusal like any other (`except rj.RotsymError`), and the builtin a caller expects."""
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder") as e:
        rj.load_hf(tmp_path / "nope")
    assert isinstance(e.value, rj.RotsymError)


def test_a_file_of_a_checkpoint_is_named_with_its_folder(folder):
    """config.json (or a shard) given for its folder: said so, with the folder to give instead."""
    for file in (folder / "config.json", folder / "model.safetensors"):
        for load in (rj.load_hf, rj.load_orbax):
            with pytest.raises(rj.CheckpointError, match=rf"^{re.escape(str(file))} is a file, not a checkpoint folder: give the folder "
                                                         rf"it is in, {re.escape(str(folder))}$"):
                load(file)


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
    _edit_config(folder, model_type="mpt")
    with pytest.raises(rj.CheckpointError, match=r"unsupported model_type 'mpt'.*supported: .*bert"):
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


# ---- hostile files: every failure is a CheckpointError naming the file ----------------------------

QUERY = "encoder.layer.0.attention.self.query.weight"


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8])
def test_integer_parameter_tensors_are_refused(folder, dtype):
    _edit_tensors(folder, lambda t: t.update({QUERY: t[QUERY].view(np.int32).astype(dtype)}))
    with pytest.raises(rj.CheckpointError, match=rf"model\.safetensors: tensor '{QUERY}' has dtype [IU]\d+; parameters must be floating"):
        rj.load_hf(folder)


def test_header_relabelled_as_integer_is_refused(folder):
    """The bytes stay, the header says I32: the values would load as integers like 1.19e9."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header[QUERY]["dtype"] = "I32"
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    path.write_bytes(data[:8] + raw + data[8 + n:])
    with pytest.raises(rj.CheckpointError, match=rf"'{QUERY}' has dtype I32"):
        rj.load_hf(folder)


def test_non_finite_values_are_refused_unless_allowed(folder):
    def poison(t):
        t[QUERY][0, 0] = np.nan
        t["pooler.dense.bias"][:3] = np.inf

    _edit_tensors(folder, poison)
    with pytest.raises(rj.CheckpointError, match=rf"non-finite.*2 tensors: '{QUERY}' \(1 of 1024\), 'pooler\.dense\.bias' \(3 of 32\); pass allow_nonfinite"):
        rj.load_hf(folder)
    with pytest.warns(UserWarning, match="non-finite"):
        ck = rj.load_hf(folder, allow_nonfinite=True)
    assert np.isnan(ck.params["layers"][0]["attention"]["query"]["kernel"][0, 0])


@pytest.mark.parametrize(
    "damage",
    {
        "truncated": lambda b: b[: len(b) - 100],
        "header only": lambda b: b[:64],
        "empty": lambda b: b"",
        "random bytes": lambda b: np.random.default_rng(0).bytes(len(b)),
    }.items(),
    ids=lambda d: d[0],
)
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "shard"])
def test_corrupt_weight_files_name_the_file(folder, tmp_path, damage, sharded):
    if sharded:
        folder = rj.save_hf(rj.load_hf(folder), rj.load_hf(folder).params, tmp_path / "sharded", max_shard_bytes=20_000)
        victim = sorted(folder.glob("model-*.safetensors"))[1]
    else:
        victim = folder / "model.safetensors"
    victim.write_bytes(damage[1](victim.read_bytes()))
    with pytest.raises(rj.CheckpointError, match=rf"{victim.name}: not a readable safetensors file"):
        rj.load_hf(folder)


def test_dangling_weights_link(folder):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(folder / "gone.safetensors")
    with pytest.raises(rj.CheckpointError, match=r"model\.safetensors is a symbolic link to .*gone\.safetensors.*does not exist"):
        rj.load_hf(folder)


@pytest.mark.parametrize("shard", ["../other/model.safetensors", "/etc/model.safetensors"])
def test_index_pointing_outside_the_folder_is_refused(folder, tmp_path, shard):
    other = tmp_path / "other"
    other.mkdir()
    (folder / "model.safetensors").rename(other / "model.safetensors")
    names = safe_open(other / "model.safetensors", "numpy").keys()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    with pytest.raises(rj.CheckpointError, match="outside the checkpoint folder"):
        rj.load_hf(folder)


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json"])
def test_json_that_is_a_list(folder, file):
    if file != "config.json":
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / file).write_text("[1, 2]")
    with pytest.raises(rj.CheckpointError, match=rf"{file}: .*must be a JSON object, got a JSON list"):
        rj.load_hf(folder)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_attention_heads=0), "num_attention_heads=0; expected a positive integer"),
        (dict(hidden_size=-32), "hidden_size=-32; expected a positive integer"),
        (dict(num_hidden_layers=1.5), r"cannot read the model from this config.*'num_hidden_layers'"),
        (dict(num_attention_heads=5), "hidden_size=32 is not a multiple of num_attention_heads=5"),
        (dict(layer_norm_eps=-1.0), "layer_norm_eps=-1.0; expected a finite number >= 0"),
    ],
)
def test_config_values_that_cannot_describe_a_model(folder, change, message):
    _edit_config(folder, **change)
    with pytest.raises(rj.CheckpointError, match=rf"config\.json: {message}"):
        rj.load_hf(folder)


def test_a_config_the_forward_pass_cannot_run_is_refused_when_it_runs(folder, tmp_path):
    """Reading, aligning and saving need the layout alone: an activation our forward pass lacks
    is refused when the model runs, naming it, not when the checkpoint is read."""
    _edit_config(folder, hidden_act="no_such_activation")
    ck = rj.load_hf(folder)
    rj.save_hf(ck, rj.align(ck.params, ck.params, rj.spec_for(ck)).params, tmp_path / "saved")
    with pytest.raises(rj.CheckpointError, match="the forward pass cannot run this config.*no_such_activation"):
        ck.apply(ck.params, input_ids=np.array([[1, 2]]))


def test_init_checkpoint_checks_the_config():
    with pytest.raises(rj.CheckpointError, match="num_attention_heads=0"):
        rj.init_checkpoint(tf.BertConfig(**{**SMALL, "num_attention_heads": 0}), jax.random.key(0))


def test_apply_refuses_ids_outside_the_vocabulary(folder):
    ck = rj.load_hf(folder)
    ids = np.array([[1, 2, 99]])  # vocab_size=99
    with pytest.raises(ValueError, match=r"input_ids holds values in \[1, 99\], outside \[0, 99\) \(vocab_size=99"):
        ck.apply(ck.params, input_ids=ids)
    with pytest.raises(ValueError, match=r"token_type_ids .* outside \[0, 2\)"):
        ck.apply(ck.params, input_ids=ids - 1, token_type_ids=np.full_like(ids, 2))
    # Under jit the ids are traced and cannot be checked; in range they run as before.
    out = jax.jit(lambda p, i: ck.apply(p, input_ids=i))(ck.params, ids - 1)
    assert np.isfinite(np.asarray(out["last_hidden_state"])).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_nonfinite_count_agrees_with_isfinite_on_every_bit_pattern(dtype):
    """The count that refuses non-finite checkpoints: every 16-bit pattern (NaNs, infinities,
    subnormals, both zeros), and for float32 every exponent with random mantissas and signs."""
    from rotsym_jax.io.hf import nonfinite_count

    if dtype == "float32":
        rng = np.random.default_rng(0)
        bits = (rng.integers(0, 2**23, 2**16, dtype=np.uint32) | (np.arange(2**16, dtype=np.uint32) % 512 << 23)).view(np.float32)
    else:
        bits = np.arange(2**16, dtype=np.uint16).view(jnp.dtype(dtype))
    expected = bits.size - int(np.count_nonzero(np.isfinite(bits.astype(np.float32))))
    assert expected > 0 and nonfinite_count(bits) == expected
    assert nonfinite_count(bits.reshape(256, -1).T) == expected  # a strided view (a transposed kernel)
