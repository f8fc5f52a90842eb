"""Prove a checkpoint's symmetry groups against transformers (`rotsym inspect A --verify`).

rotsym_jax moves weights, so every group it uses must keep the model's function exactly. For each
kind of group element the family's spec declares (head permutations, QK and VO elements and their
scales, FFN unit permutations, the residual stream's permutations, signed permutations and rotations), `verify_groups`
draws a random element, applies it to the checkpoint's weights (norm gains folded first for a
rotation of the stream), saves the result and runs it in transformers' own PyTorch model beside
the original: outputs equal within `tol` (relative, float32) prove the element kind. A kind the
model does not have (no RoPE pairs to flip, a residual rotation a tied LM head forbids) is
reported as not applicable, with the reason.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import jax
import numpy as np

from .engine.groups import apply_transform
from .engine.residual import fold_norms, random_residual, rotation_refusal, signed_refusal
from .io.hf import Checkpoint, family_for, load_hf, save_hf, spec_for
from .spec import bind
from .transforms import RESIDUAL, random_transform

# (name, random_transform kinds, residual mode): one element kind at a time.
ELEMENTS = (
    ("head permutations", ("heads",), None),
    ("QK rotations", ("qk",), None),
    ("VO rotations", ("vo",), None),
    ("QK scales", ("qk_scale",), None),
    ("VO scales", ("vo_scale",), None),
    ("FFN unit permutations", ("perm",), None),
    ("residual permutation", (), "permutation"),
    ("residual signed permutation", (), "signed_permutation"),
    ("residual rotation", (), "rotation"),
)


@dataclasses.dataclass(frozen=True)
class Check:
    """One element kind: its name, the group it stands for on this model, the largest relative
    difference of the outputs transformers computes (None when not applicable), and whether it
    holds (`note` says why not applicable)."""

    element: str
    group: str
    difference: float | None
    ok: bool
    note: str = ""


def verify_groups(path, *, seed: int = 0, tol: float = 1e-4) -> list[Check]:
    """Every element kind of the checkpoint at `path` (a Hugging Face folder) applied at random
    and run in transformers: see the module docstring. Needs torch and transformers."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise RuntimeError(f"verifying the groups runs the model in transformers' PyTorch implementation: {e}") from e
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # one load per element kind; restored below
    try:
        return _verify(path, seed, tol, transformers, torch)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _verify(path, seed, tol, transformers, torch) -> list[Check]:
    ck = load_hf(path, dtype=np.float32)
    family = family_for(ck.model_config.model_type)
    cls = getattr(transformers, family.architecture(ck.model_config, ck.layout))
    inputs = _inputs(ck, seed)
    reference = _outputs(cls, Path(path), inputs, torch)
    spec = spec_for(ck)
    bound = bind(spec, ck.params)
    block = bound.attention[0].geometry if bound.attention else None
    key = jax.random.key(seed)
    checks = []
    with tempfile.TemporaryDirectory(prefix="rotsym-verify-") as tmp:
        for i, (name, kinds, residual) in enumerate(ELEMENTS):
            group, note = _group(name, block, bound, ck)
            if note:
                checks.append(Check(name, group, None, True, note))
                continue
            params = fold_norms(spec, ck.params) if residual == "rotation" else ck.params
            t = random_transform(spec, params, jax.random.fold_in(key, i), kinds)
            if residual:
                t[RESIDUAL] = random_residual(spec, params, jax.random.fold_in(key, 100 + i), residual)
            moved = apply_transform(spec, params, t)
            folder = save_hf(ck, moved, Path(tmp) / f"element-{i}", dtype=np.float32)
            got = _outputs(cls, folder, inputs, torch)
            difference = max(_relative(got[k], reference[k]) for k in reference)
            checks.append(Check(name, group, difference, difference <= tol))
    return checks


def _group(name: str, geometry, bound, ck: Checkpoint) -> tuple[str, str]:
    """(the group this element kind stands for on this model, why it does not apply or "")."""
    if name in ("head permutations", "QK rotations", "VO rotations", "QK scales", "VO scales") and geometry is None:
        return "-", "no attention block"
    if name == "head permutations":
        gains = " (the full-width QK-norm's gains with them)" if geometry.qk_norm == "full" else ""
        return f"{geometry.num_kv_heads} kv groups x {geometry.heads_per_group} query heads{gains}", ""
    if name == "QK rotations":
        if geometry.qk_norm:
            return "sign flips of whole rotary pairs (QK-norm)", ""
        if not geometry.rotary_dim:
            return "orthogonal, per kv group", ""
        return "2-D rotations of each rotary pair" + (", any of the rest" if geometry.rotary_dim < geometry.head_dim else ""), ""
    if name == "VO rotations":
        return "orthogonal, per kv group", ""
    if name == "FFN unit permutations":  # the "perm" kind: dense FFN units, and experts with their units
        parts = (["unit permutations"] if bound.perms else []) + [f"{g.num_experts} experts (router rows with them) x their units"
                                                                for g in bound.experts]
        return (", ".join(parts), "") if parts else ("-", "no FFN group")
    if name.startswith("residual"):
        if bound.residual is None:
            return "-", "no residual spec"
        if ck.layout.head is None:
            return "-", "a model without a task head returns its stream in the new basis: nothing to compare"
        if name == "residual signed permutation":
            refusal = signed_refusal(bound.residual)
            return ("-", refusal) if refusal else ("permutations with sign flips (RMSNorm)", "")
        if name == "residual rotation":
            refusal = rotation_refusal(bound.residual)
            if refusal:
                return "-", refusal
            return ("rotations fixing the ones vector (LayerNorm)" if bound.residual.norm == "layernorm" else "rotations (RMSNorm, gains folded)"), ""
        return "permutations", ""
    if name == "QK scales" and geometry.qk_norm == "full":
        return "positive scalars, per kv group, on the full-width QK-norm's gains", ""
    if name == "QK scales" and geometry.qk_norm:
        return "-", "a per-head QK-norm keeps no QK scale (its eps sees a kernel's scale; one gain serves every head)"
    return "positive scalars, per head", ""


def _inputs(ck: Checkpoint, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    config = ck.model_config
    if ck.family == "vit":
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        return {"pixel_values": rng.normal(size=(2, config.num_channels, size, size)).astype(np.float32)}
    length = min(8, getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 8))
    ids = rng.integers(0, config.vocab_size, size=(2, length))
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def _outputs(cls, folder: Path, inputs: dict, torch) -> dict:
    model = cls.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(**{k: torch.as_tensor(v) for k, v in inputs.items()})
    keys = [k for k in ("logits", "start_logits", "end_logits", "prediction_logits", "seq_relationship_logits", "last_hidden_state")
            if getattr(out, k, None) is not None]
    keys = [k for k in keys if k != "last_hidden_state"] or keys
    return {k: getattr(out, k).numpy() for k in keys}


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
