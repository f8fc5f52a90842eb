"""Nemotron: LayerNorms whose gain is stored as w and applied as 1 + w, an ungated relu2 MLP,
partial rotary. The generic contracts run on its rows of family_cases.py; here, every group proven in
transformers (the stream's rotations among them, which test_conformance's rotated-stream contract
does not list), folding 1 + w and the bias into the readers checked against the stored tensors,
Minitron's config.json keys, and a config transformers cannot build refused."""

import json

import numpy as np
import pytest
import transformers as tf
from parity_utils import assert_outputs_match, reference_outputs, save_reference, token_batch
from safetensors.numpy import load_file

import rotsym_jax as rj
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(vocab_size=60, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
             max_position_embeddings=32)


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["untied-biases", "tied"])
def test_every_group_holds_in_transformers(tmp_path, tied):
    config = tf.NemotronConfig(**SMALL, attention_bias=not tied, mlp_bias=not tied, tie_word_embeddings=tied)
    save_reference(tf.NemotronForCausalLM, config, tmp_path)
    checks = {c.element: c for c in verify_groups(tmp_path)}
    # LayerNorm centres the width: no sign flips; an ungated MLP has no unit scales of ours
    assert all(c.ok and c.difference is not None for name, c in checks.items()
               if name not in ("residual signed permutation", "FFN unit scales")), checks
    assert checks["QK rotations"].group == "2-D rotations of each rotary pair, any of the rest"  # 8 of 16 dims rotary
    assert checks["residual rotation"].group.startswith("rotations fixing the ones vector")


def test_folding_moves_one_plus_w_and_the_bias_into_the_readers(tmp_path):
    """The stored w and bias against the folded leaves: gain 1 + w into the readers' rows, the
    bias through their kernels into their biases, w = 0 and bias 0 left; transformers computes A's
    outputs from the folded weights."""
    model = save_reference(tf.NemotronForCausalLM, tf.NemotronConfig(**SMALL, attention_bias=True, mlp_bias=True), tmp_path / "a")
    stored = load_file(tmp_path / "a" / "model.safetensors")
    ck = rj.load_hf(tmp_path / "a")
    folded = rj.fold_norms(rj.spec_for(ck), ck.params)
    w, beta = stored["model.layers.1.post_attention_layernorm.weight"], stored["model.layers.1.post_attention_layernorm.bias"]
    up, up_bias = stored["model.layers.1.mlp.up_proj.weight"], stored["model.layers.1.mlp.up_proj.bias"]
    mlp, norm = folded["layers"][1]["mlp"], folded["layers"][1]["mlp_norm"]
    np.testing.assert_allclose(np.asarray(mlp["up"]["kernel"]), (1.0 + w)[:, None] * up.T, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(mlp["up"]["bias"]), up_bias + beta @ up.T, rtol=1e-5, atol=1e-6)
    assert not np.asarray(norm["scale"]).any() and not np.asarray(norm["bias"]).any()
    assert np.abs(w).max() > 0.5  # transformers' gains 1 + w with w = 1 (and noise): a fold forgetting the 1 would show
    rj.save_hf(ck, folded, tmp_path / "folded")
    ids, mask = token_batch(60, pad_id=0)
    ref = tf.NemotronForCausalLM.from_pretrained(tmp_path / "folded", attn_implementation="eager").eval()
    assert_outputs_match(reference_outputs(ref, input_ids=ids, attention_mask=mask), reference_outputs(model, input_ids=ids, attention_mask=mask),
                         ["logits"], valid=mask.astype(bool))


def test_minitron_config_json_as_on_the_hub(tmp_path):
    """Minitron's config.json names the rotary part and base at the top level beside rope_scaling:
    null (and keys transformers keeps as they are)."""
    model = save_reference(tf.NemotronForCausalLM, tf.NemotronConfig(**SMALL), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(partial_rotary_factor=0.25, rope_theta=1000, rope_scaling=None, kv_channels=16, rope_percent=0.25)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ck = rj.load_hf(tmp_path)
    assert rj.spec_for(ck).heads["attn"].rotary_dim == 4
    legacy = tf.NemotronForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids, mask = token_batch(ck.config.vocab_size, pad_id=0)
    inputs = dict(input_ids=ids, attention_mask=mask)
    assert_outputs_match(ck.apply(ck.params, **inputs), reference_outputs(legacy, **inputs), ["logits"], valid=mask.astype(bool))
    assert np.abs(reference_outputs(legacy, **inputs)["logits"] - reference_outputs(model, **inputs)["logits"]).max() > 1e-5  # the keys took effect


def test_a_config_without_kv_heads_is_refused_naming_it(tmp_path):
    save_reference(tf.NemotronForCausalLM, tf.NemotronConfig(**SMALL), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["num_key_value_heads"] = None  # NemotronConfig leaves it None, and NemotronAttention divides by it
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(TypeError):
        tf.NemotronForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(rj.CheckpointError, match="num_key_value_heads is not set"):
        rj.load_hf(tmp_path)
