"""Granite (model type granite): Llama's tensors with four scalar multipliers. The generic contracts
(parity of our forward pass, round trip, every group kept in transformers, planted recovery,
streamed = in memory, aligned and averaged is A) run on its rows of family_cases.py; here, what is
particular: every group of Llama's proven in transformers through the multipliers, each multiplier
read where transformers reads it, and the values transformers would divide by zero with refused."""

import numpy as np
import pytest
import transformers as tf
from family_cases import GRANITE, TEXT
from parity_utils import assert_outputs_match, reference_outputs, save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax.io import hf
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(TEXT, num_key_value_heads=2)


def test_every_group_holds_in_transformers(tmp_path):
    """The multipliers are scalars: head and kv-group permutations, RoPE pair rotations, VO
    rotations, scales and invertible maps, FFN permutations and every residual element Llama's
    record declares (rotations of the stream, its RMSNorm gains folded) keep the logits in
    transformers."""
    save_reference(tf.GraniteForCausalLM, tf.GraniteConfig(**SMALL, **GRANITE), tmp_path / "granite")
    checks = {c.element: c for c in verify_groups(tmp_path / "granite")}
    assert len(checks) == 12 and all(c.ok and c.difference is not None for c in checks.values()), checks


@pytest.mark.parametrize("name", list(GRANITE))
def test_each_multiplier_is_read_where_transformers_reads_it(tmp_path, name):
    """One multiplier away from 1 at a time: our logits follow transformers', which it moves."""
    plain = save_reference(tf.GraniteForCausalLM, tf.GraniteConfig(**SMALL, pad_token_id=0), tmp_path / "plain")
    model = save_reference(tf.GraniteForCausalLM, tf.GraniteConfig(**SMALL, pad_token_id=0, **{name: GRANITE[name]}), tmp_path / name)
    ids, mask = token_batch(SMALL["vocab_size"], pad_id=0)
    inputs = dict(input_ids=ids, attention_mask=mask)
    want = reference_outputs(model, **inputs)
    ck = rj.load_hf(tmp_path / name)
    assert_outputs_match(ck.apply(ck.params, **inputs), want, ["logits"], valid=mask.astype(bool))
    assert np.abs(reference_outputs(plain, **inputs)["logits"] - want["logits"]).max() > 1e-3  # it took effect


@pytest.mark.parametrize("change, refusal", [
    (dict(logits_scaling=0), "logits_scaling=0: the LM logits are divided by it"),
    (dict(residual_multiplier="0.22"), "'residual_multiplier' is '0.22' .*expected a number"),
    (dict(embedding_multiplier=float("inf")), "'embedding_multiplier' is inf .*expected a finite number"),
], ids=["zero-logits-scaling", "string", "infinite"])
def test_a_multiplier_that_is_no_finite_number_is_refused_by_name(change, refusal):
    with pytest.raises(rj.RotsymError, match=refusal):
        hf.read_config({"model_type": "granite", **SMALL, **change})
