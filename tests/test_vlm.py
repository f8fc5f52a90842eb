"""Vision-language models (gemma3, mistral3, qwen2_vl, qwen2_5_vl, llama4). The generic contracts run on their rows of
family_cases.py (transformers' logits on text with an image); here, every element kind proven in
transformers with images, the vision tower and the projector's input side never moved, Gemma 3's
Hub layout (its tower under vision_tower.vision_model.) read and written back as it was, and what
is refused, by name."""

import json
import shutil

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import BY_ID, model_inputs, reference
from parity_utils import save_reference
from safetensors.numpy import load_file, save_file

import rotsym_jax as rj
from rotsym_jax.io.widths import widen
from rotsym_jax.transforms import RESIDUAL
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

GEMMA3, MISTRAL3 = BY_ID["Gemma3ForConditionalGeneration"], BY_ID["Mistral3ForConditionalGeneration"]
MISTRAL3_TIED = BY_ID["Mistral3ForConditionalGeneration[tied-bias]"]
QWEN2_VL, QWEN2_5_VL = BY_ID["Qwen2VLForConditionalGeneration"], BY_ID["Qwen2_5_VLForConditionalGeneration"]
LLAMA4, LLAMA4_TIED = BY_ID["Llama4ForConditionalGeneration"], BY_ID["Llama4ForConditionalGeneration[tied-no-qk-norm]"]


def _saved(case, folder):
    save_reference(case.model_class, case.config(), folder)
    return folder


@pytest.mark.parametrize("case, unproven", [
    (GEMMA3, {"QK scales", "QK invertible maps", "residual rotation"}),  # QK-norm; sandwich norms: the stream does not rotate
    (MISTRAL3, set()),
    (MISTRAL3_TIED, set()),  # the stream rotates with the LM head untied
    (QWEN2_VL, set()),  # multimodal RoPE: each rotary pair turns by one of three positions, and its 2-D rotations commute with any
    (QWEN2_5_VL, set()),  # tied
    # the L2 QK-norm (tests/test_llama4.py shows the text model's groups without it); eleven runs of its MoE text model
    pytest.param(LLAMA4, {"QK scales", "QK invertible maps"}, marks=pytest.mark.slow),
    pytest.param(LLAMA4_TIED, set(), marks=pytest.mark.slow),  # tied by its text_config: the stream rotates with the LM head untied there
], ids=lambda x: getattr(x, "id", ""))
def test_every_group_of_the_text_tower_holds_in_transformers_on_text_with_an_image(case, unproven, tmp_path):
    checks = {c.element: c for c in verify_groups(_saved(case, tmp_path / "m"))}
    assert len(checks) == 11 and all(c.ok for c in checks.values()), checks
    assert {e for e, c in checks.items() if c.difference is None} == unproven, checks


@pytest.mark.parametrize("case", [GEMMA3, MISTRAL3_TIED, QWEN2_VL, QWEN2_5_VL, LLAMA4], ids=lambda c: c.id)
def test_the_vision_tower_and_the_projectors_input_side_never_move(case, tmp_path):
    ck = rj.load_hf(_saved(case, tmp_path / "m"))
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1))
    t[RESIDUAL] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
    before, after = (rj.pytree.flatten(p) for p in (ck.params, rj.apply_transform(spec, ck.params, t)))
    still = [p for p in before if p.startswith("vision/") or p.startswith("projector/") and not p.startswith("projector/out/")]
    assert len(still) > 20 and all(np.array_equal(before[p], after[p]) for p in still)
    moved = ["projector/out/kernel", "embeddings/word/embedding", "layers/0/attention/query/kernel", "layers/0/mlp/up/kernel"]
    assert not any(np.array_equal(before[p], after[p]) for p in moved)


def test_gemma3_as_the_hub_stores_it_reads_and_writes_back_under_its_own_names(tmp_path):
    """Gemma 3's releases hold the tower under vision_tower.vision_model. (transformers 5 writes
    vision_tower.): the same leaves, written back under the names read."""
    folder = _saved(GEMMA3, tmp_path / "t5")
    hub = tmp_path / "hub"
    hub.mkdir()
    shutil.copy(folder / "config.json", hub / "config.json")
    tensors = {(n.replace("vision_tower.", "vision_tower.vision_model.", 1) if n.startswith("vision_tower.") else n): x
               for n, x in load_file(folder / "model.safetensors").items()}
    save_file(tensors, hub / "model.safetensors", metadata={"format": "pt"})
    _, info = tf.Gemma3ForConditionalGeneration.from_pretrained(hub, output_loading_info=True)
    assert not any(info.values()), info  # transformers reads this layout too
    ours, theirs = rj.load_hf(hub), rj.load_hf(folder)
    assert (ours.layout.tower, theirs.layout.tower) == ("vision_tower.vision_model.", "vision_tower.")
    a, b = rj.pytree.flatten(ours.params), rj.pytree.flatten(theirs.params)
    assert a.keys() == b.keys() and all(np.array_equal(a[p], b[p]) for p in a)
    written = load_file(rj.save_hf(ours, ours.params, tmp_path / "out") / "model.safetensors")
    assert written.keys() == tensors.keys() and all(np.array_equal(written[n], tensors[n]) for n in tensors)


def _with_config(folder, tmp_path, change):
    out = tmp_path / "changed"
    shutil.copytree(folder, out)
    raw = json.loads((out / "config.json").read_text())
    change(raw)
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.parametrize("change, match", [
    (lambda raw: raw.update(architectures=["Mistral3Model"]), "config.json names Mistral3Model; rotsym_jax reads mistral3 checkpoints as "
                                                               "Mistral3ForConditionalGeneration only"),
    (lambda raw: raw["text_config"].update(model_type="qwen2"), r"text_config.model_type='qwen2': a mistral3 checkpoint is read with a "
                                                                 "text_config of type mistral or llama"),
    (lambda raw: raw["vision_config"].update(hidden_size=16.0), r"vision_config: 'hidden_size' is 16.0"),
    (lambda raw: raw["vision_config"].update(num_hidden_layers=3), r"vision_tower.transformer.layers.2.attention_norm.weight.*missing"),
    (lambda raw: raw.update(multimodal_projector_bias=True), r"multi_modal_projector.linear_1.bias.*missing"),
], ids=["class", "text-type", "vision-value", "tower-depth", "projector-bias"])
def test_what_the_checkpoint_does_not_hold_is_refused_by_name(change, match, tmp_path):
    folder = _with_config(_saved(MISTRAL3, tmp_path / "m"), tmp_path, change)
    with pytest.raises(rj.CheckpointError, match=match):
        rj.load_hf(folder)


def test_a_checkpoint_without_its_vision_tower_is_refused_by_name(tmp_path):
    folder = _saved(GEMMA3, tmp_path / "m")
    tensors = {n: x for n, x in load_file(folder / "model.safetensors").items() if not n.startswith("vision_tower.")}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(rj.CheckpointError, match=r"no vision tower: none of \['vision_tower.vision_model.embeddings.patch_embedding.weight'"):
        rj.load_hf(folder)


def test_nothing_runs_the_model_here_and_that_is_said(tmp_path):
    ck = rj.load_hf(_saved(GEMMA3, tmp_path / "m"))
    with pytest.raises(rj.CheckpointError, match="a gemma3_vlm model is read, aligned, merged and saved, but rotsym_jax has no forward pass"):
        ck.apply(ck.params, input_ids=np.zeros((1, 4), np.int64))


@pytest.mark.parametrize("case, kv_heads", [(MISTRAL3, 4), (QWEN2_5_VL, None)], ids=["mistral3", "qwen2_5_vl"])
def test_a_narrower_text_model_widens_in_its_text_config_and_computes_as_it_did(case, kv_heads, tmp_path):
    """Models of other widths merge: the narrower text model padded with zero FFN units (and kv groups),
    its nested text_config widened; transformers computes its logits on text with an image as before.
    (Qwen's heads are hidden_size / heads wide: more heads would narrow them, refused.)"""
    model = save_reference(case.model_class, case.config(), tmp_path / "narrow")
    inputs = model_inputs(case, model.config)
    narrow = rj.load_hf(tmp_path / "narrow")
    wide = widen(narrow, 64, kv_heads=kv_heads)
    folder = rj.save_hf(wide, wide.params, tmp_path / "wide")
    text = json.loads((folder / "config.json").read_text())["text_config"]
    assert (text["intermediate_size"], text["num_key_value_heads"]) == (64, kv_heads or 2)
    if kv_heads is None:
        with pytest.raises(rj.InputError, match="cannot be widened"):
            widen(narrow, kv_heads=4)
    got, want = reference(case.model_class.from_pretrained(folder).eval(), inputs)["logits"], reference(model, inputs)["logits"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
