"""One check for every task head of an encoder family (DistilBERT, ModernBERT): read, run against
transformers' PyTorch model, saved byte-exact, kept by transformers under a random element of
every group and a permuted stream, and undone by `rotsym align`."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import transformers as tf
from parity_utils import assert_outputs_match, assert_same_state_dict, reference_outputs, save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax import cli

KINDS = ("heads", "perm", "qk", "vo", "qk_scale", "vo_scale")
# The default run's time budget: the masked LM and the sequence classifier by default, the other heads in the slow run.
DEFAULT = ("ForMaskedLM", "ForSequenceClassification")


def by_budget(cases) -> list:
    """The class names of `cases` as pytest parameters, those outside DEFAULT marked slow."""
    return [pytest.param(n, marks=[] if n.endswith(DEFAULT) else [pytest.mark.slow]) for n in sorted(cases)]


def check_head(name: str, config, head: str | None, family: str, tmp_path, *, length: int = 7):
    cls = getattr(tf, name)
    model = save_reference(cls, config, tmp_path / "a", seed=0)
    ck = rj.load_hf(tmp_path / "a")
    assert ck.family == family and ck.layout.head == head
    ids, mask = token_batch(config.vocab_size, batch=2, length=length)
    choices = head == "multiple_choice"  # (batch, choices, tokens); not run here, read and saved
    inputs = ({"input_ids": np.stack([ids, ids[::-1]], axis=1), "attention_mask": np.stack([mask, mask[::-1]], axis=1)} if choices
              else {"input_ids": ids, "attention_mask": mask})
    want = reference_outputs(model, **inputs)
    if not choices:
        keys = [k for k in ("last_hidden_state", "logits", "start_logits", "end_logits") if k in want]
        per_token = all(want[k].shape[:2] == mask.shape for k in keys)
        assert_outputs_match(ck.apply(ck.params, **inputs), want, keys, valid=mask.astype(bool) if per_token else None)
    rj.save_hf(ck, ck.params, tmp_path / "saved")
    reloaded, info = cls.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not any(info.values()), info
    assert_same_state_dict(reloaded, model)
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1), KINDS)
    t["residual"] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
    rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "b")
    moved = reference_outputs(cls.from_pretrained(tmp_path / "b").eval(), **inputs)
    for key in (k for k in want if k != "last_hidden_state"):  # the hidden states live in the permuted stream
        got, ref = moved[key], want[key]
        if ref.ndim >= 2 and ref.shape[:2] == mask.shape:
            got, ref = got[mask.astype(bool)], ref[mask.astype(bool)]
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * max(1.0, np.abs(ref).max()))
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out"), "--quiet", "--residual", "permutation",
                     "--heads", "permute", "--rescale", "joint"]) == 0
    report = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())["result"]
    assert report["after"]["total"] <= 1e-4 * report["before"]["total"]
