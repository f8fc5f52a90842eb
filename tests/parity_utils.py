"""Helpers for tests that compare our models with transformers' PyTorch implementation."""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is the independent reference for parity tests and is not installed"
)

TOL = 1e-4


# Parameters of the task head and pooler (and, below, a tied LM head): drawn at unit gain so that
# the logits are O(1), not O(0.01) as at transformers' initializer_range of 0.02.
_HEAD = re.compile(r"(^|\.)(classifier|lm_head|pooler|qa_outputs|score|seq_relationship|summary)\.")
# Matrices transformers initialises to zero (Gemma 3's image projection): drawn N(0, 1/fan_in), or
# what they carry (the image features) would not reach the outputs at all.
_ZEROS = re.compile(r"(^|\.)mm_input_projection_weight$")
# Linear weights (out, in) transformers initialises to zero: AFMoE's router, whose sigmoid scores would all tie
_ZERO_LINEARS = re.compile(r"(^|\.)mlp\.router\.gate\.weight$")


def save_reference(cls, config, folder, seed=0, attn_implementation="eager", *, perturb=True, **model_kwargs):
    """A seeded random transformers model saved with save_pretrained; returns the model (eval).

    `model_kwargs` go to the model class (e.g. add_pooling_layer=False). With `perturb` (the
    default), the parameters are made non-trivial: transformers initialises every bias to 0 and
    every norm gain to 1, which would hide a bias or norm mapped to the wrong place, and its head
    weights (std initializer_range) give logits so small that a wrong head barely shows. So every
    1-D parameter gets N(0, 0.1) noise, and the 2-D weights of the head, the pooler and the output
    embeddings are rescaled to std 1/sqrt(fan_in)."""
    torch.manual_seed(seed)
    config._attn_implementation = attn_implementation
    model = cls(config, **model_kwargs).eval()
    if perturb:
        with torch.no_grad():
            heads = [p for name, p in model.named_parameters() if p.ndim == 2 and _HEAD.search(name)]
            output_embeddings = model.get_output_embeddings()
            if output_embeddings is not None:
                heads.append(output_embeddings.weight)  # may be tied to the input embeddings
            for p in heads:  # (out, in) for nn.Linear; (vocab, d) for embeddings
                p.mul_(1.0 / (p.shape[1] ** 0.5 * p.std()))
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(0.1 * torch.randn_like(p))
            for name, p in model.named_parameters():
                if _ZEROS.search(name):  # stored (in, out)
                    p.normal_(0.0, p.shape[0] ** -0.5)
                elif _ZERO_LINEARS.search(name):
                    p.normal_(0.0, p.shape[1] ** -0.5)
    model.save_pretrained(folder)
    return model


def reference_outputs(model, **inputs) -> dict[str, np.ndarray]:
    with torch.no_grad():
        out = model(**{k: torch.as_tensor(v) for k, v in inputs.items() if v is not None})
    return {k: v.float().numpy() for k, v in out.items() if isinstance(v, torch.Tensor)}


def reference_with_base(model, **inputs) -> dict[str, np.ndarray]:
    """reference_outputs, plus the base model's last_hidden_state and pooler_output for a model
    with a head (transformers' *ForSequenceClassification etc. return only logits)."""
    ref = reference_outputs(model, **inputs)
    base_model = model.base_model
    if base_model is model and isinstance(getattr(model, "model", None), torch.nn.Module) and type(model).__name__.endswith("ForCausalLM"):
        base_model = model.model  # Llama4ForCausalLM's base_model_prefix ("language_model") names no attribute of it
    if base_model is not model:
        base = reference_outputs(base_model, **inputs)
        for key in ("last_hidden_state", "pooler_output"):
            if key in base:
                ref.setdefault(key, base[key])
    return ref


def assert_outputs_match(ours: dict, ref: dict, keys, *, valid=None, tol=TOL, min_ref_std=None):
    """Max abs difference <= tol for each key. `valid` (B, T) bool restricts per-token outputs
    to real (non-padding) tokens: what a model computes at padded positions is not specified.
    `min_ref_std`: also require each reference output's std to exceed it, so that a comparison
    at `tol` is not passed by outputs too small to show a difference."""
    for key in keys:
        a, b = np.asarray(ours[key], np.float32), np.asarray(ref[key], np.float32)
        assert a.shape == b.shape, f"{key}: shape {a.shape} vs reference {b.shape}"
        if valid is not None and a.ndim >= 2 and a.shape[:2] == valid.shape:
            a, b = a[valid], b[valid]
        if min_ref_std is not None:
            std = float(b.std())
            assert std > min_ref_std, f"{key}: reference std {std:.3g} <= {min_ref_std}, too small to test at {tol}"
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


def assert_same_tensor_files(a, b) -> None:
    """The checkpoint folders `a` and `b` hold the same tensors, bit for bit (a streamed run's and
    an in-memory run's)."""
    from rotsym_jax.io import hf

    files = [hf.TensorFiles(f) for f in (a, b)]
    try:
        assert files[0].names() == files[1].names()
        assert all(np.array_equal(files[0].read(n), files[1].read(n)) for n in files[0].names())
    finally:
        for f in files:
            f.close()
