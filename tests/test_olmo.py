"""OLMo 1: Llama's layers with LayerNorms that hold no parameters. The generic contracts run on its
rows of family_cases.py; here, every group proven in transformers (the stream's rotations fixing the
ones vector among them, tied head or not: there is no gain to fold), OLMo-1B's config.json keys, and
clip_qkv refused by name."""

import json

import jax
import numpy as np
import pytest
import transformers as tf
from parity_utils import assert_outputs_match, reference_outputs, save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
             max_position_embeddings=32, pad_token_id=0, eos_token_id=1)


@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["tied", "untied-biases"])
def test_every_group_holds_in_transformers(tmp_path, tied):
    save_reference(tf.OlmoForCausalLM, tf.OlmoConfig(**SMALL, attention_bias=not tied, tie_word_embeddings=tied), tmp_path)
    checks = {c.element: c for c in verify_groups(tmp_path)}
    assert all(c.ok and c.difference is not None for name, c in checks.items() if name != "residual signed permutation"), checks
    # a tied head reads the final norm, which has no gain: the stream still rotates, no untying needed
    assert checks["residual rotation"].group == "rotations fixing the ones vector (LayerNorm)"


def test_the_norms_hold_no_leaf_and_fold_to_nothing(tmp_path):
    save_reference(tf.OlmoForCausalLM, tf.OlmoConfig(**SMALL), tmp_path)
    ck = rj.load_hf(tmp_path)
    assert set(ck.params["layers"][0]) == {"attention", "mlp"} and "final_norm" not in ck.params
    folded = rj.fold_norms(rj.spec_for(ck), ck.params)
    same = jax.tree_util.tree_map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), ck.params, folded)
    assert jax.tree_util.tree_structure(same) == jax.tree_util.tree_structure(ck.params) and all(jax.tree_util.tree_leaves(same))


def test_olmo_1b_config_json_as_on_the_hub(tmp_path):
    """allenai/OLMo-1B-hf's config.json: rope_theta and rope_scaling: null at the top level,
    clip_qkv: null, a tied head."""
    model = save_reference(tf.OlmoForCausalLM, tf.OlmoConfig(**SMALL, tie_word_embeddings=True), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=100.0, rope_scaling=None, clip_qkv=None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ck = rj.load_hf(tmp_path)
    legacy = tf.OlmoForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids, mask = token_batch(ck.config.vocab_size, pad_id=0)
    inputs = dict(input_ids=ids, attention_mask=mask)
    assert_outputs_match(ck.apply(ck.params, **inputs), reference_outputs(legacy, **inputs), ["logits"], valid=mask.astype(bool))
    assert np.abs(reference_outputs(legacy, **inputs)["logits"] - reference_outputs(model, **inputs)["logits"]).max() > 1e-5  # the keys took effect


def test_clip_qkv_is_refused_naming_it(tmp_path):
    save_reference(tf.OlmoForCausalLM, tf.OlmoConfig(**SMALL, clip_qkv=8.0), tmp_path)
    with pytest.raises(rj.CheckpointError, match="clip_qkv=8.0 .* no rotation of V commutes with"):
        rj.load_hf(tmp_path)
