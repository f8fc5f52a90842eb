"""Helpers for tests that write small random checkpoints and compare checkpoint folders tensor by
tensor."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from rotsym_jax import hf


def plus_noise(x, key, scale=1.0, dtype=None):
    """x + scale * jax.random.normal(key, x.shape, dtype) (dtype: float32 unless given), the same
    float32 bits, the arithmetic on the host: jnp's eager multiply and add compiled two programs per
    leaf shape. Other dtypes take jnp's arithmetic as they did."""
    noise = jax.random.normal(key, np.shape(x), np.float32 if dtype is None else dtype)
    if noise.dtype != np.float32 or np.asarray(x).dtype != np.float32:
        return x + scale * noise
    # jnp rounds a Python or float64 scale to float32 before multiplying: so does this
    return jax.device_put(np.asarray(x) + np.asarray(scale, np.float32) * np.asarray(noise))


def save_random(raw_config: dict, head: str, seed: int, folder, pooler: bool = False, **kwargs) -> Path:
    """A random checkpoint of `raw_config` (a config.json's dict) with task head `head`, saved to
    `folder` (save_hf's `kwargs`). Not an identity: random norm gains and biases, so every leaf
    kind is measured."""
    ck = hf.init_checkpoint(hf.read_config(raw_config), jax.random.key(seed), head=head, pooler=pooler)
    keys = iter(jax.random.split(jax.random.key(100 + seed), 1000))
    params = jax.tree.map(lambda x: plus_noise(x, next(keys), 0.1, x.dtype), ck.params)
    return hf.save_hf(ck, params, folder, **kwargs)


def checkpoint_tensors(folder) -> dict:
    """{name: (dtype, shape, bytes)} of every tensor in a checkpoint folder's safetensors files."""
    files = hf.TensorFiles(Path(folder))
    try:
        return {n: (files.dtype(n), files.shape(n), files.read(n).tobytes()) for n in sorted(files.names())}
    finally:
        files.close()


def float_tensors(folder) -> dict:
    """{name: float32 array} of every tensor in a checkpoint folder's safetensors files."""
    files = hf.TensorFiles(Path(folder))
    try:
        return {n: np.asarray(files.read(n), np.float32) for n in files.names()}
    finally:
        files.close()


def assert_same_checkpoint(got, want):
    """The same tensors, bit for bit, and the same config.json."""
    a, b = checkpoint_tensors(got), checkpoint_tensors(want)
    assert a.keys() == b.keys()
    differ = [n for n in a if a[n] != b[n]]
    assert not differ, f"tensors differ: {differ}"
    assert json.loads((Path(got) / "config.json").read_text()) == json.loads((Path(want) / "config.json").read_text())


def assert_stacked_reads_as_apart(model, apart: Path, root: Path, names, skip=()) -> dict:
    """`model`'s state dict as transformers 5 holds it (experts stacked; what tools that save it
    write) reads as the same leaves as `apart`, the folder save_pretrained wrote; the stacked
    tensors `names` (HF names, each in that state dict) are written back as they came. `skip`:
    state dict entries no folder stores (a tied head). Returns the leaves read."""
    from safetensors.torch import save_file

    import rotsym_jax as rj
    from rotsym_jax.pytree import flatten

    stacked = root / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((apart / "config.json").read_text())
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in skip}
    assert all(n in state for n in names), [n for n in names if n not in state]
    save_file(state, stacked / "model.safetensors")
    a, b = rj.load_hf(apart), rj.load_hf(stacked)
    assert b.layout.stacked_experts and not a.layout.stacked_experts
    flat_a, flat_b = flatten(a.params), flatten(b.params)
    assert flat_a.keys() == flat_b.keys() and all(np.array_equal(flat_a[k], flat_b[k]) for k in flat_a)
    files = hf.TensorFiles(rj.save_hf(b, b.params, root / "again"))
    try:
        for name in names:
            np.testing.assert_array_equal(files.read(name), state[name].numpy())
    finally:
        files.close()
    return flat_a


def assert_renamed_reads_alike(model, folder: Path, renames: dict, root: Path, renamed: int) -> None:
    """`folder` (save_pretrained of `model`) with the tensors whose names end in a key of `renames`
    renamed to its value (transformers 5's newer names of one mixture, stacked), `renamed` of them:
    the names `model` holds in memory; both read as the same leaves and each is written back under
    the names it came with."""
    from safetensors.numpy import load_file, save_file

    import rotsym_jax as rj
    from rotsym_jax.pytree import flatten

    tensors = load_file(folder / "model.safetensors")
    newer = {next((k.replace(a, b) for a, b in renames.items() if k.endswith(a)), k): v for k, v in tensors.items()}
    assert len(set(newer) - set(tensors)) == renamed
    assert all(np.array_equal(model.state_dict()[k].numpy(), v) for k, v in newer.items())  # the names in memory
    (root / "new").mkdir()
    save_file(newer, root / "new" / "model.safetensors", metadata={"format": "pt"})
    (root / "new" / "config.json").write_text((folder / "config.json").read_text())
    given, new = rj.load_hf(folder), rj.load_hf(root / "new")
    assert (given.layout.stacked_experts, new.layout.stacked_experts) == (False, True)
    a, b = flatten(given.params), flatten(new.params)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    for ck, want in ((given, tensors), (new, newer)):
        again = load_file(rj.save_hf(ck, ck.params, root / f"saved-{ck.layout.stacked_experts}") / "model.safetensors")
        assert again.keys() == want.keys() and all(np.array_equal(again[k], want[k]) for k in want)
