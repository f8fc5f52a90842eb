"""Jais 2: Llama's attention and whole-head RoPE with biases on q/k/v/o, LayerNorms with gains as
stored and biases, Nemotron's ungated relu2 MLP with biases. The generic contracts run on its rows
of family_cases.py; here, every group proven in transformers (the stream's rotations among them),
folding each LayerNorm's gain and bias into its readers checked against the stored tensors, and the
configs transformers cannot run refused by name."""

import json

import numpy as np
import pytest
import torch
import transformers as tf
from parity_utils import assert_outputs_match, reference_outputs, save_reference, token_batch
from safetensors.numpy import load_file

import rotsym_jax as rj
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(vocab_size=60, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
             max_position_embeddings=32)


def test_every_group_holds_in_transformers(tmp_path):
    save_reference(tf.Jais2ForCausalLM, tf.Jais2Config(**SMALL), tmp_path)  # biases on attention and MLP by default
    checks = {c.element: c for c in verify_groups(tmp_path)}
    # LayerNorm centres the width: no sign flips; an ungated MLP has no unit scales of ours
    assert all(c.ok and c.difference is not None for name, c in checks.items()
               if name not in ("residual signed permutation", "FFN unit scales")), checks
    assert checks["QK rotations"].group == "2-D rotations of each rotary pair"  # RoPE over the whole head
    assert checks["residual rotation"].group.startswith("rotations fixing the ones vector")


def test_folding_moves_the_gain_and_the_bias_into_the_readers(tmp_path):
    """The stored gain and bias against the folded leaves: the gain (as stored, not 1 + w) into the
    readers' rows, the bias through their kernels into their biases; transformers computes A's
    outputs from the folded weights."""
    model = save_reference(tf.Jais2ForCausalLM, tf.Jais2Config(**SMALL), tmp_path / "a")
    stored = load_file(tmp_path / "a" / "model.safetensors")
    ck = rj.load_hf(tmp_path / "a")
    folded = rj.fold_norms(rj.spec_for(ck), ck.params)
    g, beta = stored["model.layers.1.post_attention_layernorm.weight"], stored["model.layers.1.post_attention_layernorm.bias"]
    up, up_bias = stored["model.layers.1.mlp.up_proj.weight"], stored["model.layers.1.mlp.up_proj.bias"]
    mlp = folded["layers"][1]["mlp"]
    np.testing.assert_allclose(np.asarray(mlp["up"]["kernel"]), g[:, None] * up.T, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(mlp["up"]["bias"]), up_bias + beta @ up.T, rtol=1e-5, atol=1e-6)
    assert np.abs(beta).max() > 0.05 and np.abs(up_bias).max() > 0.05  # both biases there to move
    rj.save_hf(ck, folded, tmp_path / "folded")
    ids, mask = token_batch(60, pad_id=0)
    ref = tf.Jais2ForCausalLM.from_pretrained(tmp_path / "folded", attn_implementation="eager").eval()
    assert_outputs_match(reference_outputs(ref, input_ids=ids, attention_mask=mask), reference_outputs(model, input_ids=ids, attention_mask=mask),
                         ["logits"], valid=mask.astype(bool))


def test_partial_rotary_is_refused_naming_it(tmp_path):
    """Jais2Attention is Llama's: cos and sin of the rotary part times the whole head, which fails in
    transformers for a partial_rotary_factor below 1 under a scaled rope type (its default type
    ignores the factor; we refuse both, as Llama's record does)."""
    save_reference(tf.Jais2ForCausalLM, tf.Jais2Config(**SMALL), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_parameters"].update(rope_type="linear", factor=2.0, partial_rotary_factor=0.5)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = tf.Jais2ForCausalLM.from_pretrained(tmp_path).eval()
    with pytest.raises(RuntimeError):
        model(input_ids=torch.as_tensor(token_batch(60)[0]))
    with pytest.raises(rj.CheckpointError, match="partial_rotary_factor=0.5 is not supported for jais2"):
        rj.load_hf(tmp_path)


def test_heads_not_dividing_the_width_are_refused(tmp_path):
    save_reference(tf.Jais2ForCausalLM, tf.Jais2Config(**SMALL), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(num_attention_heads=6, num_key_value_heads=6, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(Exception, match="not a multiple"):
        tf.Jais2Config.from_pretrained(tmp_path)
    with pytest.raises(rj.CheckpointError, match="hidden_size=64 is not a multiple of num_attention_heads=6"):
        rj.load_hf(tmp_path)
