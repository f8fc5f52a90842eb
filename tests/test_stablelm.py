"""StableLM: LayerNorms, partial rotary, SwiGLU, sequential or parallel layers. The generic
contracts run on its rows of family_cases.py; here, every group proven in transformers on both
kinds of layer (a parallel layer's one norm folds into attention and MLP alike), StableLM 2's
config.json as on the hub, and the per-head QK LayerNorm refused."""

import json

import numpy as np
import pytest
import transformers as tf
from parity_utils import assert_outputs_match, reference_outputs, save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(vocab_size=60, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
             max_position_embeddings=32)


@pytest.mark.parametrize("parallel, tied", [pytest.param(False, False, marks=pytest.mark.slow), (True, True)], ids=["sequential", "parallel-tied"])
def test_every_group_holds_in_transformers(tmp_path, parallel, tied):
    config = tf.StableLmConfig(**SMALL, use_qkv_bias=True, use_parallel_residual=parallel, tie_word_embeddings=tied)
    save_reference(tf.StableLmForCausalLM, config, tmp_path / "stablelm")
    assert ("mlp_norm" in rj.load_hf(tmp_path / "stablelm").params["layers"][0]) != parallel
    checks = {c.element: c for c in verify_groups(tmp_path / "stablelm")}
    assert all(c.ok and c.difference is not None for name, c in checks.items() if name != "residual signed permutation"), checks
    assert checks["QK rotations"].group == "2-D rotations of each rotary pair, any of the rest"  # 4 of 16 dims rotary
    assert ("tied LM head untied" in checks["residual rotation"].group) == tied


def test_stablelm2_config_json_as_on_the_hub(tmp_path):
    """StableLM 2's config.json names the rotary part and base beside rope_scaling: null."""
    model = save_reference(tf.StableLmForCausalLM, tf.StableLmConfig(**SMALL, use_qkv_bias=True), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(partial_rotary_factor=0.5, rope_theta=1000, rope_scaling=None, hidden_dropout=0.0, qk_layernorm=False)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ck = rj.load_hf(tmp_path)
    assert rj.spec_for(ck).heads["attn"].rotary_dim == 8
    legacy = tf.StableLmForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids, mask = token_batch(ck.config.vocab_size, pad_id=0)
    inputs = dict(input_ids=ids, attention_mask=mask)
    assert_outputs_match(ck.apply(ck.params, **inputs), reference_outputs(legacy, **inputs), ["logits"], valid=mask.astype(bool))
    assert np.abs(reference_outputs(legacy, **inputs)["logits"] - reference_outputs(model, **inputs)["logits"]).max() > 1e-5  # the keys took effect


def test_a_per_head_qk_layernorm_is_refused_naming_it(tmp_path):
    save_reference(tf.StableLmForCausalLM, tf.StableLmConfig(**SMALL, qk_layernorm=True), tmp_path)
    with pytest.raises(rj.CheckpointError, match="qk_layernorm=True .* each head's own gains"):
        rj.load_hf(tmp_path)
