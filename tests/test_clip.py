"""CLIP's towers (model types clip_vision_model, clip_text_model). The generic contracts run on their
rows of family_cases.py; here, every element kind proven in transformers (the image tower's stream
rotation refused by name: pre_layrnorm's output is the stream itself; the text tower's stream
rotates), and the dual model's nested config refused."""

import json

import pytest
import transformers as tf
from family_cases import CLIP_TEXT, CLIP_VISION
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")


def test_every_group_holds_in_transformers_and_the_stream_only_permutes(tmp_path):
    save_reference(tf.CLIPVisionModelWithProjection, tf.CLIPVisionConfig(**CLIP_VISION), tmp_path / "tower")
    checks = {c.element: c for c in verify_groups(tmp_path / "tower")}
    assert len(checks) == 11 and all(c.ok for c in checks.values()), checks
    unproven = {e for e, c in checks.items() if c.difference is None}
    assert unproven == {"residual signed permutation", "residual rotation"}, checks


def test_every_group_of_the_text_tower_holds_in_transformers_its_stream_rotating(tmp_path):
    save_reference(tf.CLIPTextModelWithProjection, tf.CLIPTextConfig(**CLIP_TEXT), tmp_path / "tower")
    checks = {c.element: c for c in verify_groups(tmp_path / "tower")}
    assert len(checks) == 11 and all(c.ok for c in checks.values()), checks
    assert {e for e, c in checks.items() if c.difference is None} == {"residual signed permutation"}, checks  # LayerNorm: no sign flips


def test_the_dual_model_is_refused_by_name(tmp_path):
    """CLIPModel nests both towers' configs (text_config, vision_config): not read yet, said so."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip", "text_config": {}, "vision_config": {}}))
    with pytest.raises(rj.CheckpointError, match="clip"):
        rj.load_hf(tmp_path)
