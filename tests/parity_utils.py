"""Helpers for tests that compare our models with transformers' PyTorch implementation."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is the independent reference for parity tests and is not installed"
)

TOL = 1e-4


def save_reference(cls, config, folder, seed=0, attn_implementation="eager"):
    """A seeded random transformers model saved with save_pretrained; returns the model (eval)."""
    torch.manual_seed(seed)
    config._attn_implementation = attn_implementation
    model = cls(config).eval()
    model.save_pretrained(folder)
    return model


def reference_outputs(model, **inputs) -> dict[str, np.ndarray]:
    with torch.no_grad():
        out = model(**{k: torch.as_tensor(v) for k, v in inputs.items() if v is not None})
    return {k: v.float().numpy() for k, v in out.items() if isinstance(v, torch.Tensor)}


def assert_outputs_match(ours: dict, ref: dict, keys, *, valid=None, tol=TOL):
    """Max abs difference <= tol for each key. `valid` (B, T) bool restricts per-token outputs
    to real (non-padding) tokens: what a model computes at padded positions is not specified."""
    for key in keys:
        a, b = np.asarray(ours[key], np.float32), np.asarray(ref[key], np.float32)
        assert a.shape == b.shape, f"{key}: shape {a.shape} vs reference {b.shape}"
        if valid is not None and a.ndim >= 2 and a.shape[:2] == valid.shape:
            a, b = a[valid], b[valid]
        err = float(np.max(np.abs(a - b)))
        assert err <= tol, f"{key}: max abs difference {err:.3g} > {tol}"


def assert_same_state_dict(model_a, model_b):
    """Bitwise-equal parameters (a saved-then-reloaded model against the reference)."""
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert sa.keys() == sb.keys(), sorted(set(sa) ^ set(sb))
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"tensor {k} changed in the round trip"


def token_batch(vocab_size, batch=3, length=9, *, pad_id=0, seed=0, lo=3):
    """Random ids with a right-padded row; returns (input_ids, attention_mask) as int64."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(lo, vocab_size, size=(batch, length)).astype(np.int64)
    mask = np.ones((batch, length), np.int64)
    mask[-1, length - 3 :] = 0
    ids[mask == 0] = pad_id
    return ids, mask
