"""Phi (Phi-1 to Phi-2): one LayerNorm read by a parallel attention and MLP, partial rotary, an LM
head with a bias of its own (tied or not). The generic contracts run on its rows of
family_cases.py; here, what is particular: every group proven in transformers on Phi-2's shape of
head (80 wide, 0.4 of it rotary), the tied head's bias, Phi-2's config.json as on the hub and the
QK LayerNorm refused."""

import json

import numpy as np
import pytest
import transformers as tf
from parity_utils import assert_outputs_match, reference_outputs, save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

# Phi-2's head: 80 wide, 32 of it rotary (partial_rotary_factor 0.4)
PHI2 = dict(vocab_size=60, hidden_size=160, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
            partial_rotary_factor=0.4)


def _inputs(config):
    ids, mask = token_batch(config.vocab_size, pad_id=0)
    return dict(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.slow), True], ids=["untied", "tied"])
def test_every_group_holds_in_transformers_and_a_tied_head_keeps_its_bias(tmp_path, tied):
    """A tied head's kernel is the embedding, its bias its own: read, run and proven (the rotation
    with the head untied, bias and all)."""
    model = save_reference(tf.PhiForCausalLM, tf.PhiConfig(**PHI2, tie_word_embeddings=tied), tmp_path / "phi")
    ck = rj.load_hf(tmp_path / "phi")
    assert ("kernel" in ck.params["lm_head"]) != tied and np.abs(np.asarray(ck.params["lm_head"]["bias"])).max() > 0
    assert rj.spec_for(ck).heads["attn"].rotary_dim == 32
    inputs = _inputs(ck.config)
    assert_outputs_match(ck.apply(ck.params, **inputs), reference_outputs(model, **inputs), ["logits"], valid=inputs["attention_mask"].astype(bool))
    checks = {c.element: c for c in verify_groups(tmp_path / "phi")}
    assert "no gated FFN" in checks.pop("FFN unit scales").note  # a GELU MLP: no unit scales
    assert all(c.ok and c.difference is not None for name, c in checks.items() if name != "residual signed permutation"), checks
    assert checks["QK rotations"].group == "2-D rotations of each rotary pair, any of the rest"
    assert ("tied LM head untied" in checks["residual rotation"].group) == tied


def test_phi2_config_json_as_on_the_hub(tmp_path):
    """Phi-2's config.json names the rotary part and base beside rope_scaling: null: read as
    transformers reads it."""
    model = save_reference(tf.PhiForCausalLM, tf.PhiConfig(**PHI2), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(partial_rotary_factor=0.4, rope_theta=1000.0, rope_scaling=None, resid_pdrop=0.1, qk_layernorm=False)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ck = rj.load_hf(tmp_path)
    assert ck.model_config.rope_parameters["rope_theta"] == 1000.0 and ck.model_config.rope_parameters["partial_rotary_factor"] == 0.4
    legacy = tf.PhiForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    inputs = _inputs(ck.config)
    assert_outputs_match(ck.apply(ck.params, **inputs), reference_outputs(legacy, **inputs), ["logits"], valid=inputs["attention_mask"].astype(bool))
    assert np.abs(reference_outputs(legacy, **inputs)["logits"] - reference_outputs(model, **inputs)["logits"]).max() > 1e-5  # theta took effect


def test_a_qk_layernorm_is_refused_naming_it(tmp_path):
    save_reference(tf.PhiForCausalLM, tf.PhiConfig(**PHI2, qk_layernorm=True), tmp_path)
    with pytest.raises(rj.CheckpointError, match="qk_layernorm=True .* no rotation of a head commutes with"):
        rj.load_hf(tmp_path)
