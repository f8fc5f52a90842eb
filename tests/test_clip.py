"""CLIP's towers (model types clip_vision_model, clip_text_model). The generic contracts run on their
rows of family_cases.py; here, every element kind proven in transformers (the image tower's stream
rotation refused by name: pre_layrnorm's output is the stream itself; the text tower's stream
rotates), and the dual CLIPModel's nested config read as CLIPConfig reads it (its contracts:
tests/test_dual.py)."""

import json

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import CLIP_TEXT, CLIP_VISION
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import hf
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")


def test_every_group_holds_in_transformers_and_the_stream_only_permutes(tmp_path):
    save_reference(tf.CLIPVisionModelWithProjection, tf.CLIPVisionConfig(**CLIP_VISION), tmp_path / "tower")
    checks = {c.element: c for c in verify_groups(tmp_path / "tower")}
    assert len(checks) == 12 and all(c.ok for c in checks.values()), checks
    unproven = {e for e, c in checks.items() if c.difference is None}
    assert unproven == {"FFN unit scales", "residual signed permutation", "residual rotation"}, checks  # a GELU MLP: no unit scales


def test_every_group_of_the_text_tower_holds_in_transformers_its_stream_rotating(tmp_path):
    save_reference(tf.CLIPTextModelWithProjection, tf.CLIPTextConfig(**CLIP_TEXT), tmp_path / "tower")
    checks = {c.element: c for c in verify_groups(tmp_path / "tower")}
    assert len(checks) == 12 and all(c.ok for c in checks.values()), checks
    assert {e for e, c in checks.items() if c.difference is None} == {"FFN unit scales", "residual signed permutation"}, checks  # LayerNorm: no sign flips


def test_an_image_tower_made_here_saves_as_transformers_reads_it(tmp_path):
    """init_checkpoint names the class embedding as the record does (embeddings/class): save_hf writes it."""
    ck = rj.init_checkpoint(tf.CLIPVisionConfig(**CLIP_VISION), jax.random.key(0), head="image_embeds")
    rj.save_hf(ck, ck.params, tmp_path / "made")
    model, info = tf.CLIPVisionModelWithProjection.from_pretrained(tmp_path / "made", output_loading_info=True)
    assert not any(info.values()), info
    np.testing.assert_array_equal(model.vision_model.embeddings.class_embedding.detach().numpy(), ck.params["embeddings"]["class"])


def test_the_dual_config_reads_as_transformers_reads_it():
    """Each tower's config with its own defaults; a legacy `text_config_dict` replaces `text_config`,
    as CLIPConfig does."""
    raw = {"model_type": "clip", "projection_dim": 16, "text_config": {"hidden_size": 40, "num_attention_heads": 5},
           "text_config_dict": {"hidden_size": 24, "num_attention_heads": 3}, "vision_config": {"patch_size": 16}}
    ours, theirs = hf.read_config(raw), tf.CLIPConfig.from_dict(json.loads(json.dumps(raw)))
    assert ours.projection_dim == theirs.projection_dim == 16
    for tower in ("text_config", "vision_config"):
        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "patch_size", "image_size",
                    "max_position_embeddings", "vocab_size", "eos_token_id", "hidden_act", "layer_norm_eps"):
            assert getattr(getattr(ours, tower), key, None) == getattr(getattr(theirs, tower), key, None), (tower, key)
    with pytest.raises(ValueError, match="'text_config' is \\[1\\]; expected a JSON object"):
        hf.read_config({"model_type": "clip", "text_config": [1]})
    with pytest.raises(ValueError, match="'hidden_size' is 32.0"):  # each tower's values checked as its own config checks them
        hf.read_config({"model_type": "clip", "vision_config": {"hidden_size": 32.0}})
