"""CLIP's towers (model types clip_vision_model, clip_text_model). The generic contracts run on their
rows of family_cases.py; here, every element kind proven in transformers (the image tower's stream
rotation refused by name: pre_layrnorm's output is the stream itself; the text tower's stream
rotates). The dual CLIPModel (model type clip), whose outputs (logits between every text and every
image) the conformance rows cannot compare, has its contracts here, against transformers' CLIPModel:
parity, round trip, every tower's groups and the joint space's rotation kept, planted recovery by
`rotsym align`, `rotsym merge`, the streamed run."""

import json

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import CLIP_TEXT, CLIP_VISION
from parity_utils import assert_outputs_match, reference_outputs, save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.pytree import flatten
from rotsym_jax.spec import bind
from rotsym_jax.transforms import RESIDUAL
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


# The dual model: the towers of the rows above (their widths apart, so no leaf of one fits the other), a joint space of 24, the
# eos token 7, a logit scale other than the default
DUAL = dict(text_config=dict(CLIP_TEXT, eos_token_id=7), vision_config=dict(CLIP_VISION, hidden_size=48, num_attention_heads=3, hidden_act="gelu"),
            projection_dim=24, logit_scale_init_value=1.5)
OUTPUTS = ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds")
ALIGN = ["--quiet", "--heads", "permute"]


def _inputs() -> dict:
    ids, mask = token_batch(60, pad_id=0)
    ids[np.arange(len(ids)), mask.sum(1) - 1] = 7  # each text ends with eos, before its padding
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": np.random.default_rng(0).normal(size=(2, 3, 16, 16)).astype(np.float32)}


def _load(folder):
    model, info = tf.CLIPModel.from_pretrained(folder, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


def _outputs(folder) -> dict:
    return reference_outputs(_load(folder), **_inputs())


def _same(got: dict, want: dict, what: str, keys=OUTPUTS):
    for key in keys:
        scale = float(np.abs(want[key]).max())
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-4 * scale, err_msg=f"{what}: {key}")


@pytest.fixture(scope="module")
def dual(tmp_path_factory):
    """(A's folder, A's outputs in transformers)."""
    folder = tmp_path_factory.mktemp("dual") / "a"
    save_reference(tf.CLIPModel, tf.CLIPConfig(**DUAL), folder)
    return folder, _outputs(folder)


def _planted(a, out, kinds=("heads", "qk", "vo", "qk_scale", "vo_scale", "perm"), joint=None):
    """B: A moved by a random element of every group of both towers (and, with `joint`, of the joint space); its transforms."""
    ck = rj.load_hf(a)
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1), kinds)
    if joint:
        t[RESIDUAL] = rj.random_residual(spec, ck.params, jax.random.key(2), joint)
    rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), out)
    return t


def test_the_dual_model_computes_transformers_outputs(dual):
    a, want = dual
    ck = rj.load_hf(a)
    assert (ck.family, ck.layout.head, float(ck.params["logit_scale"])) == ("clip", None, 1.5)
    ours = ck.apply(ck.params, **_inputs())
    assert_outputs_match(ours, want, OUTPUTS, tol=1e-5, min_ref_std=0.05)
    model = _load(a)  # each tower's own states: a wrong tower table would show here first
    inputs = _inputs()
    text = reference_outputs(model.text_model, input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])["last_hidden_state"]
    valid = inputs["attention_mask"].astype(bool)
    np.testing.assert_allclose(np.asarray(ours["text_last_hidden_state"])[valid], text[valid], rtol=0, atol=1e-4)
    vision = reference_outputs(model.vision_model, pixel_values=inputs["pixel_values"])["last_hidden_state"]
    np.testing.assert_allclose(ours["vision_last_hidden_state"], vision, rtol=0, atol=1e-4)


def test_the_dual_model_round_trips_transformers_tensors(dual, tmp_path):
    a, _ = dual
    ck = rj.load_hf(a)
    saved = rj.save_hf(ck, ck.params, tmp_path / "saved")
    files = [hf.TensorFiles(f) for f in (a, saved)]
    try:
        assert files[0].names() == files[1].names()
        assert [n for n in files[0].names() if not np.array_equal(files[0].read(n), files[1].read(n))] == []
    finally:
        for f in files:
            f.close()
    _load(saved)


def test_the_dual_models_groups_are_each_towers_and_the_joint_space():
    ck = rj.init_checkpoint(tf.CLIPConfig(**DUAL), jax.random.key(0))
    bound = bind(rj.spec_for(ck), ck.params)
    groups = {(g.kind, g.name): g for g in bound.groups}
    assert set(groups) == {("attention", "text"), ("attention", "vision"), ("permutation", "text_ffn"), ("permutation", "vision_ffn")}
    assert (groups["attention", "text"].geometry.num_heads, groups["attention", "vision"].geometry.num_heads) == (4, 3)
    assert all(p.startswith("text/") for m in groups["attention", "text"].members + groups["permutation", "text_ffn"].members for p in m.paths)
    assert all(p.startswith("vision/") for m in groups["attention", "vision"].members + groups["permutation", "vision_ffn"].members for p in m.paths)
    assert bound.residual.size == 24 and bound.residual.axes == (("text/projection/kernel", 1), ("vision/projection/kernel", 1))


def test_every_towers_groups_keep_every_output_and_align_undoes_them(dual, tmp_path):
    a, want = dual
    _planted(a, tmp_path / "b")
    got = _outputs(tmp_path / "b")
    assert float(np.abs(got["text_embeds"] - want["text_embeds"]).max()) < 1e-5  # nothing of the joint space moved
    _same(got, want, "B planted, in transformers")
    assert cli.main(["align", str(a), str(tmp_path / "b"), str(tmp_path / "out"), *ALIGN]) == 0
    _same(_outputs(tmp_path / "out"), want, "B aligned, in transformers")
    _assert_undone(tmp_path / "out")
    original, aligned = (flatten(rj.load_hf(f).params) for f in (a, tmp_path / "out"))
    for path, x in original.items():
        np.testing.assert_allclose(aligned[path], x, rtol=0, atol=1e-4 * float(np.abs(x).max()), err_msg=path)


@pytest.mark.parametrize("joint", ["rotation", "signed_permutation"])
def test_a_rotated_joint_space_keeps_the_logits_and_align_undoes_it(dual, tmp_path, joint):
    """A rotation R of the joint space, applied to both projections' outputs, keeps every cosine
    similarity: the logits stay and both embeddings are A's times R."""
    a, want = dual
    t = _planted(a, tmp_path / "b", joint=joint)
    got = _outputs(tmp_path / "b")
    _same(got, want, "B planted, in transformers", keys=("logits_per_image", "logits_per_text"))
    r = np.asarray(t[RESIDUAL].matrix())
    assert not np.allclose(r, np.eye(24), atol=0.1)
    for key in ("text_embeds", "image_embeds"):
        np.testing.assert_allclose(got[key], want[key] @ r, rtol=0, atol=1e-5, err_msg=key)
    assert cli.main(["align", str(a), str(tmp_path / "b"), str(tmp_path / "out"), *ALIGN, "--residual", joint]) == 0
    _same(_outputs(tmp_path / "out"), want, "B aligned, in transformers")
    _assert_undone(tmp_path / "out")


def test_merge_and_the_streamed_run_on_the_dual_model(dual, tmp_path):
    """Aligned and averaged is A again; streamed, the alignment writes the in-memory run's bits."""
    a, want = dual
    _planted(a, tmp_path / "b", joint="permutation")
    assert cli.main(["merge", "--method", "average", str(a), str(tmp_path / "b"), str(tmp_path / "merged"), *ALIGN, "--residual",
                     "permutation"]) == 0
    _same(_outputs(tmp_path / "merged"), want, "A and B aligned and averaged")
    runs = {}
    for name, extra in (("memory", []), ("stream", ["--max-memory", "3G"])):
        runs[name] = tmp_path / name
        assert cli.main(["align", str(a), str(tmp_path / "b"), str(runs[name]), *ALIGN, "--residual", "permutation", *extra]) == 0
    files = [hf.TensorFiles(f) for f in runs.values()]
    try:
        assert files[0].names() == files[1].names()
        assert all(np.array_equal(files[0].read(n), files[1].read(n)) for n in files[0].names())
    finally:
        for f in files:
            f.close()


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


def test_every_group_of_the_dual_model_holds_in_transformers(dual):
    """`rotsym inspect --verify`'s proof: each tower's groups keep every output, the joint space's its logits."""
    checks = {c.element: c for c in verify_groups(dual[0])}
    assert len(checks) == 11 and all(c.ok and c.difference is not None for c in checks.values()), checks


def test_data_methods_refuse_the_dual_model_by_name(dual):
    ck = rj.load_hf(dual[0])
    with pytest.raises(ValueError, match="clip model, two towers .* from data do not run on it yet"):
        ck.check_batch(_inputs())


def _assert_undone(out):
    report = json.loads((out / "rotsym_report.json").read_text())["result"]
    assert report["before"]["total"] > 1.0, "nothing was planted"
    assert report["after"]["total"] <= 1e-4 * report["before"]["total"], "the plant was not undone"
