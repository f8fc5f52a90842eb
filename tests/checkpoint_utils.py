"""Helpers for tests that compare checkpoint folders tensor by tensor."""

from __future__ import annotations

import json
from pathlib import Path

from rotsym_jax import hf


def checkpoint_tensors(folder) -> dict:
    """{name: (dtype, shape, bytes)} of every tensor in a checkpoint folder's safetensors files."""
    files = hf.TensorFiles(Path(folder))
    try:
        return {n: (files.dtype(n), files.shape(n), files.read(n).tobytes()) for n in sorted(files.names())}
    finally:
        files.close()


def assert_same_checkpoint(got, want):
    """The same tensors, bit for bit, and the same config.json."""
    a, b = checkpoint_tensors(got), checkpoint_tensors(want)
    assert a.keys() == b.keys()
    differ = [n for n in a if a[n] != b[n]]
    assert not differ, f"tensors differ: {differ}"
    assert json.loads((Path(got) / "config.json").read_text()) == json.loads((Path(want) / "config.json").read_text())
