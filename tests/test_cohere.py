"""Cohere (model type cohere, Command R). The generic contracts (parity of our forward pass, round
trip, every group kept in transformers, planted recovery, streamed = in memory, aligned and
averaged is A) run on its rows of family_cases.py; here, what is particular: its interleaved
rotary pairs (and q/k biases), held in our leaves in the rotate_half order, each group proven in
transformers through that reordering, the per-head QK-norm of Command R+ refused, and Cohere 2's
groups (the same tensors, RoPE on its sliding layers only) proven in its transformers model."""

import numpy as np
import pytest
import safetensors.numpy
import transformers as tf
from family_cases import COHERE
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")


def test_rotary_pairs_and_their_biases_are_held_in_rotate_half_order(tmp_path):
    """Each head's interleaved pairs (2i, 2i + 1) of q_proj and k_proj (weights and biases) are our
    entries (i, i + dh/2); v_proj keeps its order; the saver writes Cohere's order back."""
    save_reference(tf.CohereForCausalLM, tf.CohereConfig(**COHERE, attention_bias=True), tmp_path / "cohere")
    stored = safetensors.numpy.load_file(tmp_path / "cohere" / "model.safetensors")
    ck = rj.load_hf(tmp_path / "cohere")
    attention = ck.params["layers"][1]["attention"]
    dh = COHERE["hidden_size"] // COHERE["num_attention_heads"]
    for proj, leaf in (("q_proj", "query"), ("k_proj", "key")):
        theirs = stored[f"model.layers.1.self_attn.{proj}.weight"].T.reshape(COHERE["hidden_size"], -1, dh)
        ours = np.asarray(attention[leaf]["kernel"]).reshape(COHERE["hidden_size"], -1, dh)
        np.testing.assert_array_equal(ours[..., : dh // 2], theirs[..., 0::2], err_msg=proj)
        np.testing.assert_array_equal(ours[..., dh // 2 :], theirs[..., 1::2], err_msg=proj)
        bias = stored[f"model.layers.1.self_attn.{proj}.bias"].reshape(-1, dh)
        np.testing.assert_array_equal(np.asarray(attention[leaf]["bias"]).reshape(-1, dh), np.concatenate([bias[:, 0::2], bias[:, 1::2]], -1))
    np.testing.assert_array_equal(np.asarray(attention["value"]["kernel"]), stored["model.layers.1.self_attn.v_proj.weight"].T)
    saved = safetensors.numpy.load_file(rj.save_hf(ck, ck.params, tmp_path / "saved") / "model.safetensors")
    assert saved.keys() == stored.keys() and all(np.array_equal(saved[k], stored[k]) for k in stored)


@pytest.mark.parametrize("config", [
    dict(tie_word_embeddings=False, attention_bias=True, logit_scale=0.5),
    pytest.param(dict(num_key_value_heads=1), marks=pytest.mark.slow),
], ids=["untied-biases", "tied-mqa"])
def test_every_group_holds_in_transformers(tmp_path, config):
    """Head and kv-group permutations, RoPE-compatible QK rotations (in our order, written back
    interleaved), VO rotations, scales and invertible maps, FFN permutations and rotations of the
    stream that fix the ones vector (the one norm of a layer folded into attention and MLP) each
    keep the LM's logits in transformers; the stream's sign flips cannot (LayerNorm)."""
    save_reference(tf.CohereForCausalLM, tf.CohereConfig(**{**COHERE, **config}), tmp_path / "cohere")
    checks = {c.element: c for c in verify_groups(tmp_path / "cohere")}
    unproven = checks.pop("residual signed permutation")
    assert unproven.difference is None and "LayerNorm" in unproven.note
    assert len(checks) == 11 and all(c.ok and c.difference is not None for c in checks.values()), checks
    assert ("tied LM head untied" in checks["residual rotation"].group) == config.get("tie_word_embeddings", True)


def test_a_per_head_qk_norm_is_refused_naming_it(tmp_path):
    save_reference(tf.CohereForCausalLM, tf.CohereConfig(**COHERE, use_qk_norm=True), tmp_path)
    with pytest.raises(rj.CheckpointError, match="use_qk_norm=True .* each head's own gains"):
        rj.load_hf(tmp_path)


def test_every_cohere2_group_holds_in_transformers(tmp_path):
    """Cohere 2 has Cohere's tensors; RoPE on its sliding layers only, windows: every Cohere element
    kind holds in transformers' Cohere 2 (a rotary pair's rotations hold in a layer without RoPE too)."""
    config = tf.Cohere2Config(**{k: v for k, v in COHERE.items() if k != "initializer_range"}, sliding_window=3, layer_types=[
        "sliding_attention", "full_attention"])
    save_reference(tf.Cohere2ForCausalLM, config, tmp_path / "cohere2")
    checks = {c.element: c for c in verify_groups(tmp_path / "cohere2")}
    unproven = checks.pop("residual signed permutation")  # a LayerNorm's mean rules sign flips out
    assert unproven.difference is None and "LayerNorm" in unproven.note
    assert len(checks) == 11 and all(c.ok and c.difference is not None for c in checks.values()), checks
