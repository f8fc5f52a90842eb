"""Shared fixtures."""

import jax
import pytest


@pytest.fixture
def float32_models():
    """Model forward passes (ours, and what the tests compute from them) at full float32 matmul
    precision. Tests that compare model outputs need it: with PyTorch at 1e-4, before and after a
    transform at 1e-5, a training run against a stored one. JAX's default on GPUs is TF32, about
    1e-3 relative on these outputs. The library's own alignment, merge and statistics code pins its
    precision itself (test_precision.py), so engine tests never use this."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Any read of a tensor's bytes fails the test: for refusals that must come from the configs
    and safetensors headers alone, before any weight is read."""
    from rotsym_jax import hf

    def refuse(self, name, rows=None):
        raise AssertionError(f"read the weights of {name} before refusing")

    monkeypatch.setattr(hf.TensorFiles, "read", refuse)
    monkeypatch.setattr(hf.TensorFiles, "get", refuse)
