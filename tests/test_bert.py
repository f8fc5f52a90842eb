"""BERT / RoBERTa: what is particular to them (the prefix, RoBERTa's positions, non-contiguous arrays saved).
Parity and the round trip of every case: test_conformance.py."""

import numpy as np
import pytest
import transformers as tf
from parity_utils import (
    assert_outputs_match,
    reference_outputs,
    save_reference,
    token_batch,
)

import rotsym_jax as rj

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99)

def _inputs(config, seed=0):
    ids, mask = token_batch(config.vocab_size, pad_id=config.pad_token_id, seed=seed)
    token_types = np.zeros_like(ids)
    token_types[:, 4:] = 1
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=token_types)


def test_head_and_prefix_detected(tmp_path):
    save_reference(tf.BertForSequenceClassification, tf.BertConfig(**SMALL, num_labels=3), tmp_path)
    ck = rj.load_hf(tmp_path)
    assert (ck.family, ck.layout.prefix, ck.layout.head, ck.layout.pooler) == (
        "bert", "bert.", "sequence_classification", True,
    )
    assert ck.params["head"]["classifier"]["kernel"].shape == (32, 3)
    # Attention layout: a per-head view is a reshape of the (in, out) kernel.
    assert ck.params["layers"][0]["attention"]["query"]["kernel"].shape == (32, 4 * 8)
    assert ck.params["layers"][1]["attention"]["out"]["kernel"].shape == (4 * 8, 32)


def test_roberta_positions_skip_padding(tmp_path):
    """RoBERTa numbers positions from padding_idx + 1 over non-padding tokens only: left padding
    must not shift the real tokens' outputs (transformers computes the same)."""
    ref_model = save_reference(tf.RobertaModel, tf.RobertaConfig(**SMALL), tmp_path)
    ck = rj.load_hf(tmp_path)
    ids, _ = token_batch(99, batch=1, length=6, seed=3)
    padded = np.concatenate([np.full((1, 2), ck.config.pad_token_id), ids], axis=1)
    mask = np.concatenate([np.zeros((1, 2), np.int64), np.ones((1, 6), np.int64)], axis=1)
    ours = ck.apply(ck.params, input_ids=padded, attention_mask=mask)
    ref = reference_outputs(ref_model, input_ids=padded, attention_mask=mask)
    assert_outputs_match(ours, ref, ["last_hidden_state"], valid=mask.astype(bool))
    plain = ck.apply(ck.params, input_ids=ids)
    np.testing.assert_allclose(ours["last_hidden_state"][:, 2:], plain["last_hidden_state"], atol=1e-5)
    # A RobertaModel with a pooler (the parity cases have one without); unpadded, since the pooler
    # reads the first position.
    keys = ["last_hidden_state", "pooler_output"]
    assert_outputs_match(plain, reference_outputs(ref_model, input_ids=ids), keys, min_ref_std=0.1)


def test_save_column_permuted_noncontiguous_arrays(tmp_path):
    """safetensors' NumPy writer stores non-C-contiguous arrays in the wrong order: save_hf must
    hand it contiguous ones. Permute the FFN hidden units (a function-preserving change) with
    Fortran-ordered and negative-stride NumPy views, save, and check transformers agrees."""
    ref_model = save_reference(tf.BertModel, tf.BertConfig(**SMALL), tmp_path / "ref")
    ck = rj.load_hf(tmp_path / "ref")
    perm = np.random.default_rng(0).permutation(64)
    params = {**ck.params, "layers": dict(ck.params["layers"])}
    for i, layer in params["layers"].items():
        mlp = layer["mlp"]
        up_k = np.asfortranarray(np.asarray(mlp["up"]["kernel"])[:, perm])
        down_k = np.asarray(mlp["down"]["kernel"])[perm][:, ::-1][:, ::-1]  # a strided view
        params["layers"][i] = {
            **layer,
            "mlp": {"up": {"kernel": up_k, "bias": np.asarray(mlp["up"]["bias"])[perm]},
                    "down": {"kernel": down_k, "bias": mlp["down"]["bias"]}},
        }
    assert not params["layers"][0]["mlp"]["up"]["kernel"].flags.c_contiguous
    inputs = _inputs(ck.config)
    ours = ck.apply(params, **inputs)
    ref = reference_outputs(ref_model, **inputs)
    valid = inputs["attention_mask"].astype(bool)
    assert_outputs_match(ours, ref, ["last_hidden_state"], valid=valid)
    rj.save_hf(ck, params, tmp_path / "permuted")
    reloaded = tf.BertModel.from_pretrained(tmp_path / "permuted").eval()
    assert_outputs_match(reference_outputs(reloaded, **inputs), ours, ["last_hidden_state"], valid=valid)
    # The saved tensors really are permuted (not the original ones written back).
    saved = rj.load_hf(tmp_path / "permuted").params["layers"][0]["mlp"]["up"]["kernel"]
    np.testing.assert_array_equal(np.asarray(saved), params["layers"][0]["mlp"]["up"]["kernel"])
