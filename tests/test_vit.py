"""ViT: what is particular to it (leaf shapes, the patch kernel's order, masks, init, image sizes, masked image
modeling). Parity and the round trip of every case: test_conformance.py."""

import jax
import numpy as np
import pytest
import transformers as tf
from parity_utils import (
    assert_outputs_match,
    assert_same_state_dict,
    reference_outputs,
    save_reference,
)

import rotsym_jax as rj

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
GRAY = dict(image_size=8, patch_size=2, num_channels=1)
RGB = dict(image_size=16, patch_size=4, num_channels=3)


def _pixels(config, batch=3, seed=0):
    h, w = (config.image_size,) * 2 if isinstance(config.image_size, int) else config.image_size
    return np.random.default_rng(seed).normal(size=(batch, config.num_channels, h, w)).astype(np.float32)


def test_layout_and_leaf_shapes(tmp_path):
    save_reference(tf.ViTForImageClassification, tf.ViTConfig(**SMALL, **RGB, num_labels=5), tmp_path)
    ck = rj.load_hf(tmp_path)
    assert (ck.family, ck.layout.prefix, ck.layout.head, ck.layout.pooler) == (
        "vit", "vit.", "image_classification", False,
    )
    emb = ck.params["embeddings"]
    assert emb["patch"]["kernel"].shape == (3 * 4 * 4, 32)
    assert emb["cls_token"].shape == (1, 1, 32)
    assert emb["position"].shape == (1, 16 + 1, 32)
    assert ck.params["layers"][0]["attention"]["query"]["kernel"].shape == (32, 4 * 8)
    assert ck.params["layers"][1]["attention"]["out"]["kernel"].shape == (4 * 8, 32)
    assert ck.params["final_norm"]["scale"].shape == (32,)
    assert ck.params["head"]["classifier"]["kernel"].shape == (32, 5)
    assert "pooler" not in ck.params


def test_patch_kernel_flattening_order(tmp_path):
    """Row c*p*p + i*p + j of the patch kernel is the conv weight at (:, c, i, j)."""
    ref_model = save_reference(tf.ViTModel, tf.ViTConfig(**SMALL, **RGB), tmp_path)
    ck = rj.load_hf(tmp_path)
    conv = ref_model.embeddings.patch_embeddings.projection.weight.detach().numpy()  # (d, C, p, p)
    kernel = np.asarray(ck.params["embeddings"]["patch"]["kernel"])
    c, i, j = 2, 1, 3
    np.testing.assert_array_equal(kernel[c * 16 + i * 4 + j], conv[:, c, i, j])


def test_attention_mask_matches(tmp_path):
    ref_model = save_reference(tf.ViTModel, tf.ViTConfig(**SMALL, **GRAY), tmp_path)
    ck = rj.load_hf(tmp_path)
    pixels = _pixels(ck.config)
    mask = np.ones((3, 17), np.int64)
    mask[-1, 10:] = 0
    ref = reference_outputs(ref_model, pixel_values=pixels, attention_mask=mask)
    ours = ck.apply(ck.params, pixel_values=pixels, attention_mask=mask)
    # Masked keys still produce outputs of their own (as queries): compare every position.
    assert_outputs_match(ours, ref, ["last_hidden_state", "pooler_output"])


def test_init_checkpoint_round_trips(tmp_path):
    """A randomly initialised ViT (what the demo trains) saves as a loadable ViTForImageClassification."""
    config = tf.ViTConfig(**SMALL, **GRAY, num_labels=10)
    ck = rj.init_checkpoint(config, jax.random.key(0), head="image_classification")
    assert ck.layout.prefix == "vit."
    pixels = _pixels(config)
    rj.save_hf(ck, ck.params, tmp_path / "init")
    model, info = tf.ViTForImageClassification.from_pretrained(tmp_path / "init", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ref = reference_outputs(model.eval(), pixel_values=pixels)
    assert_outputs_match(ck.apply(ck.params, pixel_values=pixels), ref, ["logits"])


def test_wrong_image_size_is_a_clear_error(tmp_path):
    save_reference(tf.ViTModel, tf.ViTConfig(**SMALL, **GRAY), tmp_path)
    ck = rj.load_hf(tmp_path)
    with pytest.raises(ValueError, match="interpolate_pos_encoding"):
        ck.apply(ck.params, pixel_values=np.zeros((1, 1, 12, 12), np.float32))


def test_masked_image_modeling_is_read_and_saved_but_not_run(tmp_path):
    ref_model = save_reference(tf.ViTForMaskedImageModeling, tf.ViTConfig(**SMALL, **GRAY, encoder_stride=2), tmp_path / "ref")
    ck = rj.load_hf(tmp_path / "ref")
    assert (ck.layout.head, ck.runs_head) == ("masked_image_modeling", False)
    assert ck.params["head"]["mask_token"].shape == (1, 1, SMALL["hidden_size"])
    reloaded, info = tf.ViTForMaskedImageModeling.from_pretrained(rj.save_hf(ck, ck.params, tmp_path / "saved"), output_loading_info=True)
    assert not any(info.values())
    assert_same_state_dict(reloaded, ref_model)
    out = ck.apply(ck.params, pixel_values=np.zeros((1, 1, 8, 8), np.float32))  # the base model runs; the head does not
    assert "logits" not in out and out["last_hidden_state"].shape[-1] == SMALL["hidden_size"]
    with pytest.raises(rj.CheckpointError, match="'masked_image_modeling' head is read, aligned, merged and saved, but rotsym_jax does not run it"):
        ck.require_head("a loss")
