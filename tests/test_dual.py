"""The dual encoders (model types clip: CLIPModel, siglip: SiglipModel), whose outputs (a logit
for every text and every image) the conformance rows cannot compare, against transformers' own
classes: parity, round trip, every tower's groups kept (every output), the joint space moved (the
logits kept, both embeddings moved by one orthogonal map), planted recovery by `rotsym align`,
`rotsym merge`, the streamed run, every element kind proven by `verify_groups`, and the data
methods refused by name."""

import json

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import CLIP_TEXT, CLIP_VISION, SIGLIP_TEXT, SIGLIP_VISION
from parity_utils import assert_outputs_match, assert_same_tensor_files, reference_outputs, save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.pytree import flatten
from rotsym_jax.spec import bind
from rotsym_jax.transforms import RESIDUAL
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

# Each model: its transformers class and config, its joint space's width, its towers' attention blocks and FFN groups (name:
# heads), and the joint-space elements it takes beyond permutations (LayerNorm in SigLIP's pooling head: no sign flips).
# CLIP: the tower rows' shapes, the widths apart (no leaf of one fits the other), eos 7, a logit scale other than the default.
# SigLIP: a text head as wide as the image tower, the pooling head's attention a third block.
DUALS = {
    "clip": (tf.CLIPModel, lambda: tf.CLIPConfig(
        text_config=dict(CLIP_TEXT, eos_token_id=7), vision_config=dict(CLIP_VISION, hidden_size=48, num_attention_heads=3, hidden_act="gelu"),
        projection_dim=24, logit_scale_init_value=1.5), 24, {"text": 4, "vision": 3}, ("rotation", "signed_permutation")),
    "siglip": (tf.SiglipModel, lambda: tf.SiglipConfig(
        text_config=dict(SIGLIP_TEXT, projection_size=40), vision_config=dict(SIGLIP_VISION, hidden_size=40, num_attention_heads=5)),
        40, {"text": 4, "vision": 5, "vision_pool": 5}, ("rotation", "permutation")),
}
OUTPUTS = ("logits_per_image", "logits_per_text", "text_embeds", "image_embeds")
ALIGN = ["--quiet", "--heads", "permute"]


def _inputs() -> dict:
    ids, mask = token_batch(60, pad_id=0)
    ids[np.arange(len(ids)), mask.sum(1) - 1] = 7  # each text ends with CLIP's eos, before its padding
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": np.random.default_rng(0).normal(size=(2, 3, 16, 16)).astype(np.float32)}


class Dual:
    def __init__(self, name, folder):
        self.name, self.a = name, folder
        self.cls, self.config, self.width, self.blocks, self.joints = DUALS[name]
        save_reference(self.cls, self.config(), folder)
        self.want = self.outputs(folder)

    def load(self, folder):
        model, info = self.cls.from_pretrained(folder, attn_implementation="eager", output_loading_info=True)
        assert not any(info.values()), info
        return model.eval()

    def outputs(self, folder) -> dict:
        return reference_outputs(self.load(folder), **_inputs())

    def planted(self, out, joint=None):
        """B: A moved by a random element of every group of both towers (and, with `joint`, of the joint space, the
        gains folded first for a rotation); its transforms."""
        ck = rj.load_hf(self.a)
        spec = rj.spec_for(ck)
        params = rj.fold_norms(spec, ck.params) if joint == "rotation" else ck.params
        t = rj.random_transform(spec, params, jax.random.key(1), ("heads", "qk", "vo", "qk_scale", "vo_scale", "perm"))
        if joint:
            t[RESIDUAL] = rj.random_residual(spec, params, jax.random.key(2), joint, RESIDUAL)
        rj.save_hf(ck, rj.apply_transform(spec, params, t), out)
        return t


def _same(got: dict, want: dict, what: str, keys=OUTPUTS):
    for key in keys:
        scale = float(np.abs(want[key]).max())
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-4 * scale, err_msg=f"{what}: {key}")


def _assert_undone(out):
    report = json.loads((out / "rotsym_report.json").read_text())["result"]
    assert report["before"]["total"] > 1.0, "nothing was planted"
    assert report["after"]["total"] <= 1e-4 * report["before"]["total"], "the plant was not undone"


@pytest.fixture(scope="module", params=sorted(DUALS))
def dual(request, tmp_path_factory):
    return Dual(request.param, tmp_path_factory.mktemp(request.param) / "a")


def test_the_dual_model_computes_transformers_outputs(dual):
    ck = rj.load_hf(dual.a)
    assert (ck.family, ck.layout.head) == (dual.name, None)
    inputs = _inputs()
    ours = ck.apply(ck.params, **inputs)
    assert_outputs_match(ours, dual.want, OUTPUTS, tol=1e-5, min_ref_std=0.05)
    model = dual.load(dual.a)  # each tower's own states: a wrong tower table would show here first
    text = reference_outputs(model.text_model, input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])["last_hidden_state"]
    valid = inputs["attention_mask"].astype(bool)
    np.testing.assert_allclose(np.asarray(ours["text_last_hidden_state"])[valid], text[valid], rtol=0, atol=1e-4)
    vision = reference_outputs(model.vision_model, pixel_values=inputs["pixel_values"])["last_hidden_state"]
    np.testing.assert_allclose(ours["vision_last_hidden_state"], vision, rtol=0, atol=1e-4)


def test_the_dual_model_round_trips_transformers_tensors(dual, tmp_path):
    ck = rj.load_hf(dual.a)
    saved = rj.save_hf(ck, ck.params, tmp_path / "saved")
    files = [hf.TensorFiles(f) for f in (dual.a, saved)]
    try:
        assert files[0].names() == files[1].names()
        assert [n for n in files[0].names() if not np.array_equal(files[0].read(n), files[1].read(n))] == []
    finally:
        for f in files:
            f.close()
    dual.load(saved)


def test_the_dual_models_groups_are_each_towers_and_the_joint_space(dual):
    ck = rj.load_hf(dual.a)
    bound = bind(rj.spec_for(ck), ck.params)
    attention = {g.name: g for g in bound.attention}
    assert {name: g.geometry.num_heads for name, g in attention.items()} == dual.blocks
    assert {g.name for g in bound.perms} == {f"{name}_ffn" for name in dual.blocks}
    for g in bound.groups:  # each group within its tower
        assert all(p.startswith(g.name.split("_")[0] + "/") for m in g.members for p in m.paths), g.name
    streams = {s.name: s for s in bound.streams}
    assert streams[RESIDUAL].size == dual.width
    assert {p.split("/")[0] for p, _ in streams[RESIDUAL].axes} == {"text", "vision"}
    assert set(streams) == {RESIDUAL, "text_residual", "vision_residual"}
    for name in ("text_residual", "vision_residual"):  # each tower's own stream
        assert {p.split("/")[0] for p, _ in streams[name].axes} == {name.split("_")[0]}
    # what reads a tower's stream into the joint space: CLIP's projections, SigLIP's text head (its image
    # tower's pooling head reads its stream as keys and values, and writes the joint space)
    readers = (("text/projection/kernel", "vision/projection/kernel") if dual.name == "clip"
               else ("text/pooler/dense/kernel", "vision/pooler/layers/0/attention/key/kernel"))
    for name, path in zip(("text_residual", "vision_residual"), readers):
        assert (path, 0) in streams[name].axes
    assert not {p for p, _ in streams["vision_residual"].axes} & {p for p, _ in streams[RESIDUAL].axes if "pooler" in p}


def test_every_towers_groups_keep_every_output_and_align_undoes_them(dual, tmp_path):
    dual.planted(tmp_path / "b")
    got = dual.outputs(tmp_path / "b")
    assert float(np.abs(got["text_embeds"] - dual.want["text_embeds"]).max()) < 1e-5  # nothing of the joint space moved
    _same(got, dual.want, "B planted, in transformers")
    assert cli.main(["align", str(dual.a), str(tmp_path / "b"), str(tmp_path / "out"), *ALIGN]) == 0
    _same(dual.outputs(tmp_path / "out"), dual.want, "B aligned, in transformers")
    _assert_undone(tmp_path / "out")
    original, aligned = (flatten(rj.load_hf(f).params) for f in (dual.a, tmp_path / "out"))
    for path, x in original.items():
        np.testing.assert_allclose(aligned[path], x, rtol=0, atol=1e-4 * float(np.abs(x).max()), err_msg=path)


@pytest.mark.parametrize("which", [0, 1])
def test_a_moved_joint_space_keeps_the_logits_and_align_undoes_it(dual, tmp_path, which):
    """An orthogonal R of the joint space (a rotation, or a signed permutation where no LayerNorm
    reads it) applied to what writes it and read back by what reads it keeps every cosine
    similarity: the logits stay and both embeddings are A's times R."""
    joint = dual.joints[which]
    t = dual.planted(tmp_path / "b", joint=joint)
    got = dual.outputs(tmp_path / "b")
    _same(got, dual.want, "B planted, in transformers", keys=("logits_per_image", "logits_per_text"))
    r = np.asarray(t[RESIDUAL].matrix())
    assert not np.allclose(r, np.eye(dual.width), atol=0.1)
    for key in ("text_embeds", "image_embeds"):
        np.testing.assert_allclose(got[key], dual.want[key] @ r, rtol=0, atol=1e-5, err_msg=key)
    assert cli.main(["align", str(dual.a), str(tmp_path / "b"), str(tmp_path / "out"), *ALIGN, "--residual", joint]) == 0
    _same(dual.outputs(tmp_path / "out"), dual.want, "B aligned, in transformers")
    _assert_undone(tmp_path / "out")


def test_merge_and_the_streamed_run_on_the_dual_model(dual, tmp_path):
    """Aligned and averaged is A again; streamed, the alignment writes the in-memory run's bits."""
    dual.planted(tmp_path / "b", joint="permutation")
    assert cli.main(["merge", "--method", "average", str(dual.a), str(tmp_path / "b"), str(tmp_path / "merged"), *ALIGN, "--residual",
                     "permutation"]) == 0
    _same(dual.outputs(tmp_path / "merged"), dual.want, "A and B aligned and averaged")
    runs = {}
    for name, extra in (("memory", []), ("stream", ["--max-memory", "3G"])):
        runs[name] = tmp_path / name
        assert cli.main(["align", str(dual.a), str(tmp_path / "b"), str(runs[name]), *ALIGN, "--residual", "permutation", *extra]) == 0
    assert_same_tensor_files(*runs.values())


def test_each_towers_stream_is_a_group_and_align_undoes_all_three(dual, tmp_path):
    """A dual model's three streams: each tower's (what reads it into the joint space moves with
    it) and the joint space. A permutation of each tower's stream and a rotation of the joint space
    keep the logits in transformers; `--residual rotation` is a ceiling: CLIP's image tower (its
    embedding norm's gain reads nothing) takes permutations, as the report's `settled` says, the
    other streams rotate; every plant is undone, streamed as in memory to the bit."""
    ck = rj.load_hf(dual.a)
    spec = rj.spec_for(ck)
    params = rj.fold_norms(spec, ck.params)  # SigLIP's joint space: its pooling head's norm folded for a rotation
    t = rj.random_transform(spec, params, jax.random.key(1), ("heads", "qk", "vo", "perm"))
    for k, (name, mode) in enumerate(((RESIDUAL, "rotation"), ("text_residual", "permutation"), ("vision_residual", "permutation"))):
        t[name] = rj.random_residual(spec, params, jax.random.key(2 + k), mode, name)
    rj.save_hf(ck, rj.apply_transform(spec, params, t), tmp_path / "b")
    _same(dual.outputs(tmp_path / "b"), dual.want, "B planted, in transformers", keys=("logits_per_image", "logits_per_text"))
    runs = {}
    for name, extra in (("memory", []), ("stream", ["--max-memory", "3G"])):
        runs[name] = tmp_path / name
        assert cli.main(["align", str(dual.a), str(tmp_path / "b"), str(runs[name]), *ALIGN, "--residual", "rotation", *extra]) == 0
        _assert_undone(runs[name])
        report = json.loads((runs[name] / "rotsym_report.json").read_text())["result"]
        if dual.name == "clip":
            assert report["settled"]["streams"] == {RESIDUAL: "rotation", "text_residual": "rotation", "vision_residual": "permutation"}
        else:  # every SigLIP stream rotates: no ceiling reached
            assert "settled" not in report or report["settled"] is None
        assert all(report["moved"][s]["coordinates"] > 0 for s in ("text_residual", "vision_residual")) and report["moved"][RESIDUAL]["rotation"] > 0.1
    _same(dual.outputs(runs["memory"]), dual.want, "B aligned, in transformers")
    assert_same_tensor_files(*runs.values())


def test_every_group_of_the_dual_model_holds_in_transformers(dual):
    """`rotsym inspect --verify`'s proof: each tower's groups keep every output, the joint space's its logits."""
    checks = {c.element: c for c in verify_groups(dual.a)}
    assert len(checks) == 12 and all(c.ok for c in checks.values()), checks
    unproven = {e for e, c in checks.items() if c.difference is None}
    assert unproven == {"FFN unit scales"} | (set() if "signed_permutation" in dual.joints else {"residual signed permutation"}), checks  # GELU MLPs


def test_data_methods_refuse_the_dual_model_by_name(dual):
    ck = rj.load_hf(dual.a)
    with pytest.raises(ValueError, match=f"{dual.name} model, two towers .* from data do not run on it yet"):
        ck.check_batch(_inputs())


def test_a_siglip_model_whose_widths_differ_is_refused(tmp_path):
    raw = {"model_type": "siglip", "text_config": dict(SIGLIP_TEXT, projection_size=24), "vision_config": dict(SIGLIP_VISION)}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_reference(tf.SiglipVisionModel, tf.SiglipVisionConfig(**SIGLIP_VISION), tmp_path / "weights")  # any weights: refused before
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "weights" / "model.safetensors")
    with pytest.raises(rj.CheckpointError, match="text_config.projection_size=24 and vision_config.hidden_size=32"):
        rj.load_hf(tmp_path)


@pytest.mark.parametrize("name", sorted(DUALS))
def test_a_model_made_here_saves_as_transformers_reads_it(name, tmp_path):
    """init_checkpoint's leaves are the record's (the class embedding's too): saved, transformers loads every
    tensor and computes what our forward pass computes."""
    cls, config = DUALS[name][:2]
    ck = rj.init_checkpoint(config(), jax.random.key(0))
    rj.save_hf(ck, ck.params, tmp_path / "made")
    model, info = cls.from_pretrained(tmp_path / "made", attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    want = reference_outputs(model.eval(), **_inputs())
    assert_outputs_match(ck.apply(ck.params, **_inputs()), want, ("logits_per_image", "text_embeds", "image_embeds"), tol=1e-5)


def test_a_mergekit_config_refuses_the_dual_model_by_name(dual, tmp_path, capsys):
    (tmp_path / "merge.yaml").write_text(f"merge_method: linear\nmodels:\n  - model: {dual.a}\n    parameters: {{weight: 1.0}}\ndtype: float32\n")
    with pytest.raises(SystemExit):
        cli.main(["merge", str(tmp_path / "merge.yaml"), str(tmp_path / "out")])
    assert f"is a {dual.name} model, two towers with a stack of layers each" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_distance_table_names_every_towers_group(dual, tmp_path, capsys):
    assert cli.main(["align", str(dual.a), str(dual.a), str(tmp_path / "out"), "--heads", "permute"]) == 0
    (legend,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("(Euclidean distance")]
    assert "the text's feed-forward units" in legend and "the leaves of group" not in legend, legend
