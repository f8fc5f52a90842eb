"""Falcon (model type falcon). The generic contracts (parity of our forward pass, round trip, every
group kept in transformers, planted recovery, streamed = in memory, aligned and averaged is A) run
on its rows of family_cases.py; here, what is particular: the fused query_key_value of each layout
(grouped by kv head in the new architecture, per head in multi-head, [q | k | v] in multi-query)
split into our query, key and value and fused back exactly, every group proven in transformers on
each layout, and ALiBi and the layouts transformers builds but cannot run refused by name."""

import numpy as np
import pytest
import safetensors.numpy
import transformers as tf
from family_cases import FALCON
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import hf
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

D, H, DH = FALCON["hidden_size"], FALCON["num_attention_heads"], FALCON["hidden_size"] // FALCON["num_attention_heads"]
LAYOUTS = {
    "new-grouped": dict(num_kv_heads=2, bias=True),
    "mqa": dict(new_decoder_architecture=False, multi_query=True, num_kv_heads=None, bias=True),
    "mha-sequential": dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False, num_kv_heads=None, bias=True),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_the_fused_qkv_is_split_by_kv_group_and_fused_back(tmp_path, layout):
    """query_key_value's rows are [G, (H/G queries, k, v), dh] (transformers' own split, read here
    independently of ours): query head h is group h // (H/G)'s slot h % (H/G), key and value are
    the group's last two slots, weights and biases alike; the saver writes the exact tensor back."""
    config = tf.FalconConfig(**{**FALCON, **LAYOUTS[layout]})
    save_reference(tf.FalconForCausalLM, config, tmp_path / "falcon")
    stored = safetensors.numpy.load_file(tmp_path / "falcon" / "model.safetensors")
    ck = rj.load_hf(tmp_path / "falcon")
    g = config.num_kv_heads if config.new_decoder_architecture or not config.multi_query else 1
    r = H // g
    attention = ck.params["layers"][1]["attention"]
    for suffix, ours in (("weight", "kernel"), ("bias", "bias")):
        fused = stored[f"transformer.h.1.self_attention.query_key_value.{suffix}"]
        assert fused.shape[0] == (H + 2 * g) * DH
        rows = fused.reshape((-1, DH) + fused.shape[1:])  # one row block per slot
        query, key, value = (np.asarray(attention[p][ours]) for p in ("query", "key", "value"))
        if ours == "kernel":
            query, key, value = query.T, key.T, value.T
        for h in range(H):
            np.testing.assert_array_equal(query[h * DH:(h + 1) * DH], rows[(h // r) * (r + 2) + h % r], err_msg=f"query head {h}")
        for j in range(g):
            np.testing.assert_array_equal(key[j * DH:(j + 1) * DH], rows[j * (r + 2) + r], err_msg=f"key {j}")
            np.testing.assert_array_equal(value[j * DH:(j + 1) * DH], rows[j * (r + 2) + r + 1], err_msg=f"value {j}")
    saved = safetensors.numpy.load_file(rj.save_hf(ck, ck.params, tmp_path / "saved") / "model.safetensors")
    assert saved.keys() == stored.keys() and all(np.array_equal(saved[k], stored[k]) for k in stored)


@pytest.mark.parametrize("config", [
    dict(tie_word_embeddings=False, bias=True),
    pytest.param(dict(new_decoder_architecture=False, multi_query=True, num_kv_heads=None), marks=pytest.mark.slow),
    pytest.param(dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False, num_kv_heads=None, tie_word_embeddings=False),
                 marks=pytest.mark.slow),
    pytest.param(dict(num_ln_in_parallel_attn=1, num_kv_heads=1), marks=pytest.mark.slow),
], ids=["new-untied-biases", "7b-mqa-tied", "sequential-mha", "new-one-norm-mqa"])
def test_every_group_holds_in_transformers(tmp_path, config):
    """Head and kv-group permutations, RoPE-compatible QK rotations (split out of query_key_value
    and fused back), VO rotations, scales and invertible maps, FFN permutations and rotations of
    the stream that fix the ones vector (each norm folded into its readers) each keep the LM's
    logits in transformers; the stream's sign flips cannot (LayerNorm)."""
    save_reference(tf.FalconForCausalLM, tf.FalconConfig(**{**FALCON, **config}), tmp_path / "falcon")
    checks = {c.element: c for c in verify_groups(tmp_path / "falcon")}
    unproven = checks.pop("residual signed permutation")
    assert unproven.difference is None and "LayerNorm" in unproven.note
    scales = checks.pop("FFN unit scales")  # a GELU MLP: no unit scales
    assert scales.difference is None and "no gated FFN" in scales.note
    assert len(checks) == 10 and all(c.ok and c.difference is not None for c in checks.values()), checks
    assert ("tied LM head untied" in checks["residual rotation"].group) == config.get("tie_word_embeddings", True)


def test_alibi_is_refused_naming_it(tmp_path):
    save_reference(tf.FalconForCausalLM, tf.FalconConfig(**FALCON, alibi=True), tmp_path)
    with pytest.raises(rj.CheckpointError, match="alibi=True .* fix the heads' order"):
        rj.load_hf(tmp_path)


@pytest.mark.parametrize("change, message", [
    (dict(new_decoder_architecture=False, multi_query=False, num_kv_heads=2), "num_kv_heads=2 with multi_query=False"),
    (dict(new_decoder_architecture=True, parallel_attn=False), "parallel_attn=False"),
    (dict(new_decoder_architecture=False, num_ln_in_parallel_attn=2, num_kv_heads=None), "num_ln_in_parallel_attn=2 without"),
], ids=["mha-fewer-kv-heads", "new-sequential", "old-two-norms"])
def test_layouts_transformers_cannot_run_are_refused(change, message):
    """Configs FalconConfig accepts and FalconModel builds but runs wrong or fails on."""
    with pytest.raises(ValueError, match=message):
        hf.read_config({"model_type": "falcon", **FALCON, **change})
