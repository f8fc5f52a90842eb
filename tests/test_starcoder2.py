"""StarCoder2 (model type starcoder2). The generic contracts (parity of our forward pass, round trip,
every group kept in transformers, planted recovery, streamed = in memory, aligned and averaged is
A) run on its rows of family_cases.py; here, what is particular: every group proven in
transformers on a windowed GQA model with biases and on a tied one without, the window taking
effect, and the RoPE transformers' StarCoder2 runs otherwise than our record reads it refused."""

import numpy as np
import pytest
import transformers as tf
from family_cases import STARCODER2
from parity_utils import assert_outputs_match, reference_outputs, save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")


@pytest.mark.parametrize("config", [
    dict(tie_word_embeddings=False, sliding_window=3),
    pytest.param(dict(use_bias=False, num_key_value_heads=1), marks=pytest.mark.slow),
], ids=["untied-window-biases", "tied-no-bias-mqa"])
def test_every_group_holds_in_transformers(tmp_path, config):
    """Head and kv-group permutations, RoPE-compatible QK rotations, VO rotations, scales and
    invertible maps, FFN and residual permutations, and rotations of the stream that fix the ones
    vector each keep the LM's logits in transformers; the stream's sign flips cannot (LayerNorm)."""
    save_reference(tf.Starcoder2ForCausalLM, tf.Starcoder2Config(**{**STARCODER2, **config}), tmp_path / "sc2")
    checks = {c.element: c for c in verify_groups(tmp_path / "sc2")}
    assert "no gated FFN" in checks.pop("FFN unit scales").note  # a GELU MLP: no unit scales
    unproven = checks.pop("residual signed permutation")
    assert unproven.difference is None and "LayerNorm" in unproven.note
    assert checks and all(c.ok and c.difference is not None for c in checks.values()), checks
    assert ("tied LM head untied" in checks["residual rotation"].group) == config.get("tie_word_embeddings", True)


def test_the_sliding_window_takes_effect(tmp_path):
    """A window of 3 over 9 tokens changes transformers' logits, and ours follow them."""
    config = tf.Starcoder2Config(**STARCODER2, tie_word_embeddings=False, sliding_window=3)
    windowed = save_reference(tf.Starcoder2ForCausalLM, config, tmp_path / "w")
    ck = rj.load_hf(tmp_path / "w")
    ids, mask = token_batch(config.vocab_size, pad_id=0)
    inputs = dict(input_ids=ids, attention_mask=mask)
    want = reference_outputs(windowed, **inputs)
    assert_outputs_match(ck.apply(ck.params, **inputs), want, ["logits"], valid=mask.astype(bool))
    windowed.config.sliding_window = None
    assert np.abs(reference_outputs(windowed, **inputs)["logits"] - want["logits"]).max() > 1e-3


def test_a_partial_rotary_factor_is_refused_on_load_by_name(tmp_path):
    """transformers' StarCoder2 rotates the whole head whatever partial_rotary_factor says under the
    default rope type; our record would rotate what the factor says, so it refuses the factor
    rather than guess which."""
    rope = dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)
    save_reference(tf.Starcoder2ForCausalLM, tf.Starcoder2Config(**STARCODER2, rope_parameters=rope), tmp_path)
    with pytest.raises(rj.CheckpointError, match="partial_rotary_factor=0.5 is not supported for starcoder2"):
        rj.load_hf(tmp_path)


def test_a_rope_type_we_do_not_compute_aligns_but_does_not_run(tmp_path):
    """The groups do not depend on the frequencies: a dynamic RoPE loads and has its spec; our
    forward pass, which does not compute its frequencies, refuses it by name."""
    rope = dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)
    save_reference(tf.Starcoder2ForCausalLM, tf.Starcoder2Config(**STARCODER2, rope_parameters=rope), tmp_path)
    ck = rj.load_hf(tmp_path)
    assert rj.spec_for(ck).heads["attn"].rotary_dim == STARCODER2["hidden_size"] // STARCODER2["num_attention_heads"]
    with pytest.raises(rj.RotsymError, match="unsupported rope_type 'dynamic'"):
        ck.apply(ck.params, input_ids=np.zeros((1, 3), np.int32))
