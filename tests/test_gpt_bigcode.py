"""GPTBigCode (model type gpt_bigcode: StarCoder 1, SantaCoder). The generic contracts (parity of our
forward pass, round trip, every group kept in transformers, planted recovery, streamed = in memory,
aligned and averaged is A) run on its rows of family_cases.py; here, what is particular: the fused
c_attn of multi-query ([q | k | v]) and multi-head ([H, (q, k, v), dh]) attention split into our
query, key and value and fused back exactly, every group proven in transformers on both, and the
cross-attention refused by name."""

import numpy as np
import pytest
import safetensors.numpy
import transformers as tf
from family_cases import GPT_BIGCODE
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

D, H = GPT_BIGCODE["n_embd"], GPT_BIGCODE["n_head"]
DH = D // H


@pytest.mark.parametrize("multi_query", [True, False], ids=["mqa", "mha"])
def test_c_attn_is_split_by_head_and_fused_back(tmp_path, multi_query):
    """Multi-query, c_attn's rows are [q (d) | k (dh) | v (dh)]; multi-head, transformers views
    them (H, 3 dh): head h's query, key and value are rows (3h, 3h + 1, 3h + 2) of dh each (read
    here independently of ours), weights and biases alike; the saver writes the exact tensor back."""
    config = tf.GPTBigCodeConfig(**GPT_BIGCODE, multi_query=multi_query)
    save_reference(tf.GPTBigCodeForCausalLM, config, tmp_path / "bigcode")
    stored = safetensors.numpy.load_file(tmp_path / "bigcode" / "model.safetensors")
    ck = rj.load_hf(tmp_path / "bigcode")
    attention = ck.params["layers"][1]["attention"]
    for suffix, ours in (("weight", "kernel"), ("bias", "bias")):
        fused = stored[f"transformer.h.1.attn.c_attn.{suffix}"]
        query, key, value = (np.asarray(attention[p][ours]) for p in ("query", "key", "value"))
        if ours == "kernel":
            query, key, value = query.T, key.T, value.T
        if multi_query:
            assert fused.shape[0] == D + 2 * DH
            for ref, mine in ((fused[:D], query), (fused[D:D + DH], key), (fused[D + DH:], value)):
                np.testing.assert_array_equal(mine, ref)
        else:
            blocks = fused.reshape((H, 3, DH) + fused.shape[1:])
            for j, mine in enumerate((query, key, value)):
                np.testing.assert_array_equal(mine, blocks[:, j].reshape(mine.shape), err_msg=str(j))
    saved = safetensors.numpy.load_file(rj.save_hf(ck, ck.params, tmp_path / "saved") / "model.safetensors")
    assert saved.keys() == stored.keys() and all(np.array_equal(saved[k], stored[k]) for k in stored)


@pytest.mark.parametrize("config", [
    dict(multi_query=False, tie_word_embeddings=False),
    pytest.param(dict(multi_query=True), marks=pytest.mark.slow),
], ids=["mha-untied", "mqa-tied"])
def test_every_group_holds_in_transformers(tmp_path, config):
    """Head (and kv-group) permutations, per-head rotations, scales and invertible maps of QK and
    VO, FFN permutations and the stream's permutations and rotations fixing the ones vector each
    keep the LM's logits in transformers; the stream's sign flips cannot (LayerNorm)."""
    save_reference(tf.GPTBigCodeForCausalLM, tf.GPTBigCodeConfig(**{**GPT_BIGCODE, **config}), tmp_path / "bigcode")
    checks = {c.element: c for c in verify_groups(tmp_path / "bigcode")}
    assert "no gated FFN" in checks.pop("FFN unit scales").note  # a GELU MLP: no unit scales
    unproven = checks.pop("residual signed permutation")
    assert unproven.difference is None and "LayerNorm" in unproven.note
    assert checks and all(c.ok and c.difference is not None for c in checks.values()), checks
    assert ("tied LM head untied" in checks["residual rotation"].group) == config.get("tie_word_embeddings", True)


def test_cross_attention_is_refused_naming_it(tmp_path):
    save_reference(tf.GPTBigCodeForCausalLM, tf.GPTBigCodeConfig(**GPT_BIGCODE, multi_query=False, add_cross_attention=True), tmp_path)
    with pytest.raises(rj.CheckpointError, match="add_cross_attention=True .* cross-attention"):
        rj.load_hf(tmp_path)
