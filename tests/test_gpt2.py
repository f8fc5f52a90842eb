"""GPT-2: what is particular to it (the fused c_attn split, the tied LM head, old mask buffers, left padding,
cross-attention and upcast attention). Parity and the round trip of every case: test_conformance.py."""

import json

import jax
import numpy as np
import pytest
import safetensors.numpy
import transformers as tf
from parity_utils import assert_outputs_match, assert_same_state_dict, reference_with_base, save_reference, token_batch

import rotsym_jax as rj

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=99, n_positions=64, bos_token_id=1, eos_token_id=2)


def _inputs(config, seed=0):
    ids, mask = token_batch(config.vocab_size, seed=seed)
    return dict(input_ids=ids, attention_mask=mask)


def test_query_key_value_are_thirds_of_c_attn(tmp_path):
    save_reference(tf.GPT2LMHeadModel, tf.GPT2Config(**SMALL), tmp_path)
    ck = rj.load_hf(tmp_path)
    hf = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    for i in range(2):
        weight, bias = hf[f"transformer.h.{i}.attn.c_attn.weight"], hf[f"transformer.h.{i}.attn.c_attn.bias"]
        assert weight.shape == (32, 96)
        attention = ck.params["layers"][i]["attention"]
        for third, proj in enumerate(("query", "key", "value")):
            cols = slice(32 * third, 32 * (third + 1))
            assert attention[proj]["kernel"].shape == (32, 32)
            np.testing.assert_array_equal(np.asarray(attention[proj]["kernel"]), weight[:, cols])
            np.testing.assert_array_equal(np.asarray(attention[proj]["bias"]), bias[cols])
        # Conv1D is already (in, out): c_proj is copied, not transposed.
        np.testing.assert_array_equal(
            np.asarray(attention["out"]["kernel"]), hf[f"transformer.h.{i}.attn.c_proj.weight"]
        )


def _write_with_lm_head(folder, lm_head):
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = lm_head(tensors["transformer.wte.weight"])
    safetensors.numpy.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_explicit_lm_head_is_checked_against_wte_and_not_saved(tmp_path):
    ref_model = save_reference(tf.GPT2LMHeadModel, tf.GPT2Config(**SMALL), tmp_path / "ref")
    _write_with_lm_head(tmp_path / "ref", lambda wte: wte.copy())
    ck = rj.load_hf(tmp_path / "ref")
    rj.save_hf(ck, ck.params, tmp_path / "saved")
    assert "lm_head.weight" not in safetensors.numpy.load_file(tmp_path / "saved" / "model.safetensors")
    reloaded, info = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_same_state_dict(reloaded, ref_model)

    # a head that differs, transformers computes with (it warns and keeps the two apart): read as the untied model's
    _write_with_lm_head(tmp_path / "ref", lambda wte: wte + 1.0)
    with pytest.warns(UserWarning, match=r"\['lm_head.weight'\] differ from \['transformer.wte.weight'\]"):
        ck = rj.load_hf(tmp_path / "ref")
    assert ck.model_config.tie_word_embeddings is False
    stored = safetensors.numpy.load_file(tmp_path / "ref" / "model.safetensors")
    np.testing.assert_array_equal(np.asarray(ck.params["lm_head"]["kernel"]).T, stored["lm_head.weight"])
    rj.save_hf(ck, ck.params, tmp_path / "apart")
    reloaded, info = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "apart", output_loading_info=True)
    assert not any(info.values()) and not reloaded.config.tie_word_embeddings
    assert_same_state_dict(reloaded, tf.GPT2LMHeadModel.from_pretrained(tmp_path / "ref"))


def test_bare_lm_checkpoint_with_old_mask_buffers(tmp_path):
    """The original OpenAI checkpoints: GPT2LMHeadModel in config.json, bare tensor names, and the
    causal-mask buffers attn.bias / attn.masked_bias saved by old transformers versions."""
    ref_model = save_reference(tf.GPT2LMHeadModel, tf.GPT2Config(**SMALL), tmp_path / "ref")
    path = tmp_path / "ref" / "model.safetensors"
    tensors = {k.removeprefix("transformer."): v for k, v in safetensors.numpy.load_file(path).items()}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((64, 64), np.float32))[None, None]
        tensors[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})

    ck = rj.load_hf(tmp_path / "ref")
    assert (ck.layout.prefix, ck.layout.head) == ("", "lm")
    inputs = _inputs(ck.config)
    valid = inputs["attention_mask"].astype(bool)
    ref = reference_with_base(ref_model, **inputs)
    assert_outputs_match(ck.apply(ck.params, **inputs), ref, ["last_hidden_state", "logits"], valid=valid)

    rj.save_hf(ck, ck.params, tmp_path / "saved")
    saved = safetensors.numpy.load_file(tmp_path / "saved" / "model.safetensors")
    assert "wte.weight" in saved and not {"h.0.attn.bias", "h.0.attn.masked_bias"} & set(saved)
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    reloaded, info = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert_same_state_dict(reloaded, ref_model)


def test_position_ids_with_left_padding(tmp_path):
    """Explicit position_ids (counting real tokens only, as generation does for left padding)."""
    ref_model = save_reference(tf.GPT2LMHeadModel, tf.GPT2Config(**SMALL), tmp_path)
    ck = rj.load_hf(tmp_path)
    ids, mask = token_batch(99, seed=1)
    ids, mask = ids[:, ::-1].copy(), mask[:, ::-1].copy()  # the padded row now pads on the left
    position_ids = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    inputs = dict(input_ids=ids, attention_mask=mask, position_ids=position_ids)
    ref = reference_with_base(ref_model, **inputs)
    ours = ck.apply(ck.params, **inputs)
    assert_outputs_match(ours, ref, ["last_hidden_state", "logits"], valid=mask.astype(bool))


def test_init_checkpoint_saves_a_loadable_lm(tmp_path):
    config = tf.GPT2Config(**SMALL)
    ck = rj.init_checkpoint(config, jax.random.key(0), head="lm")
    assert ck.layout.prefix == "transformer."
    rj.save_hf(ck, ck.params, tmp_path / "init")
    reloaded, info = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "init", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    inputs = _inputs(config)
    assert_outputs_match(
        ck.apply(ck.params, **inputs), reference_with_base(reloaded.eval(), **inputs), ["logits"],
        valid=inputs["attention_mask"].astype(bool),
    )


def test_cross_attention_is_refused_on_load(tmp_path):
    save_reference(tf.GPT2Model, tf.GPT2Config(**SMALL, add_cross_attention=True), tmp_path)
    with pytest.raises(rj.CheckpointError, match="add_cross_attention=True .*cross-attention.* is not supported"):
        rj.load_hf(tmp_path)


def test_upcast_attention_is_read_but_not_run(tmp_path):
    """reorder_and_upcast_attn changes only how attention rounds: read and saved, not run."""
    save_reference(tf.GPT2Model, tf.GPT2Config(**SMALL, reorder_and_upcast_attn=True), tmp_path / "ref")
    ck = rj.load_hf(tmp_path / "ref")
    rj.save_hf(ck, ck.params, tmp_path / "saved")
    with pytest.raises(rj.CheckpointError, match="reorder_and_upcast_attn"):
        ck.apply(ck.params, input_ids=np.array([[1, 2]]))


def test_untied_lm_head(tmp_path):
    config = tf.GPT2Config(**SMALL, tie_word_embeddings=False)
    ref_model = save_reference(tf.GPT2LMHeadModel, config, tmp_path / "ref")
    ck = rj.load_hf(tmp_path / "ref")
    assert ck.params["lm_head"]["kernel"].shape == (config.n_embd, config.vocab_size)
    inputs = _inputs(config)
    assert_outputs_match(ck.apply(ck.params, **inputs), reference_with_base(ref_model, **inputs), ["logits"], valid=inputs["attention_mask"].astype(bool))
    reloaded, info = tf.GPT2LMHeadModel.from_pretrained(rj.save_hf(ck, ck.params, tmp_path / "saved"), output_loading_info=True)
    assert not any(info.values())
    assert_same_state_dict(reloaded, ref_model)
