"""SigLIP's towers (model types siglip_vision_model, siglip_text_model). The generic contracts
(parity, round trip, every group's element kept in transformers and undone by `rotsym align`,
streamed = in memory, merge) run on their rows of family_cases.py; here, what is particular: the
pooling head's attention and MLP are groups of their own that a plant moves, every element kind
proven in transformers, and the stream rotated (its pooled output, the pooling head's or the text
head's, is outside the stream's basis, so transformers' pooled output is kept)."""

import json

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import BY_ID, model_inputs, reference
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.pytree import flatten
from rotsym_jax.spec import bind
from rotsym_jax.transforms import RESIDUAL
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

TOWERS = ["SiglipVisionModel", "SiglipTextModel"]


def _save(case_id, folder):
    case = BY_ID[case_id]
    model = save_reference(case.model_class, case.config(), folder)
    inputs = model_inputs(case, model.config)
    return model, inputs, reference(model, inputs)


def _pooled(cls, folder, inputs):
    model, info = cls.from_pretrained(folder, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    return reference(model.eval(), inputs)["pooler_output"]


def test_the_pooling_heads_attention_and_mlp_are_groups_a_plant_moves(tmp_path):
    _save("SiglipVisionModel", tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    bound = bind(rj.spec_for(ck), ck.params)
    groups = {g.name: g for g in bound.groups}
    assert set(groups) == {"attn", "pool", "ffn", "pool_ffn"}
    assert groups["pool"].layers == (0,) and groups["pool"].geometry.num_heads == 4
    assert groups["pool_ffn"].size == 48
    # an element of every group drawn: the pooling head's leaves move too
    t = rj.random_transform(bound, ck.params, jax.random.key(3))
    moved = flatten(rj.apply_transform(rj.spec_for(ck), ck.params, t))
    before = flatten(ck.params)
    for leaf in ("query/kernel", "key/kernel", "value/kernel", "out/kernel"):
        assert not np.allclose(moved[f"pooler/layers/0/attention/{leaf}"], before[f"pooler/layers/0/attention/{leaf}"], atol=1e-3), leaf
    assert not np.allclose(moved["pooler/layers/0/mlp/up/kernel"], before["pooler/layers/0/mlp/up/kernel"])


@pytest.mark.parametrize("cls", TOWERS)
def test_every_group_holds_in_transformers(cls, tmp_path):
    _save(cls, tmp_path / "tower")
    checks = {c.element: c for c in verify_groups(tmp_path / "tower")}
    assert len(checks) == 12 and all(c.ok for c in checks.values()), checks
    # the residual elements are proven below, on the pooled output: verify compares a bare model's outputs in the stream's basis
    assert {e for e, c in checks.items() if c.difference is None} == {"FFN unit scales", "residual permutation", "residual signed permutation", "residual rotation"}


@pytest.mark.parametrize("cls", TOWERS)
def test_a_rotated_stream_keeps_the_pooled_output_and_align_undoes_it(cls, tmp_path):
    """B: A folded (post_layernorm into the pooling head's keys and values, or final_layer_norm
    into the text head), every group drawn and the stream rotated (fixing the ones vector):
    transformers' pooled output is A's, and `--residual rotation` brings B back to A."""
    model, inputs, want = _save(cls, tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    folded = rj.fold_norms(spec, ck.params)
    t = rj.random_transform(spec, folded, jax.random.key(1), ("perm", "qk", "vo"))
    t[RESIDUAL] = rj.random_residual(spec, folded, jax.random.key(2), "rotation")
    rj.save_hf(ck, rj.apply_transform(spec, folded, t), tmp_path / "b")
    scale = float(np.abs(want["pooler_output"]).max())
    got = _pooled(type(model), tmp_path / "b", inputs)
    np.testing.assert_allclose(got, want["pooler_output"], rtol=0, atol=1e-4 * scale)
    assert not np.allclose(reference(type(model).from_pretrained(tmp_path / "b").eval(), inputs)["last_hidden_state"],
                           want["last_hidden_state"], atol=1e-2)  # the stream itself did move
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out"), "--quiet", "--residual", "rotation",
                     "--heads", "permute"]) == 0
    np.testing.assert_allclose(_pooled(type(model), tmp_path / "out", inputs), want["pooler_output"], rtol=0, atol=1e-4 * scale)
    report = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())["result"]
    assert report["before"]["total"] > 1.0 and report["after"]["total"] <= 1e-4 * report["before"]["total"], report


def test_a_siglip_text_config_reads_projection_size_as_transformers():
    """projection_size is the hidden size unless given."""
    from rotsym_jax import hf

    for raw in ({"model_type": "siglip_text_model", "hidden_size": 40, "num_attention_heads": 4},
                {"model_type": "siglip_text_model", "hidden_size": 40, "num_attention_heads": 4, "projection_size": 24}):
        assert hf.read_config(raw).projection_size == tf.SiglipTextConfig.from_dict(dict(raw)).projection_size


def test_a_pooling_head_the_config_does_not_declare_is_refused(tmp_path):
    """vision_use_head must say what the weights hold: transformers would build a head of random weights, or drop one."""
    _save("SiglipVisionModel", tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "a" / "config.json").write_text(json.dumps({**config, "vision_use_head": False}))
    with pytest.raises(rj.CheckpointError, match="vision_use_head=False, but the checkpoint holds the pooling head"):
        rj.load_hf(tmp_path / "a")
