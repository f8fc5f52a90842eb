"""Vision-language models (gemma3, mistral3, qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe,
llama4). The generic contracts run on
their rows of family_cases.py (transformers' logits on text with an image); here, every element kind proven in
transformers with images (the towers' groups beside the text model's where they are aligned: Gemma 3's SigLIP, Mistral
3's Pixtral, Qwen2-VL's, 2.5-VL's and 3-VL's, Llama 4's, with the projector MLPs' units and Llama 4's adapter's, and what breaks
them), the towers' own streams and
the projector's input side never moved (Qwen3-VL's DeepStack mergers' outputs moved), Qwen3-VL's interleaved multimodal RoPE against each rotary pair's rotations, Gemma 3's and
Qwen3-VL-MoE's Hub layouts (a tower under vision_tower.vision_model.; experts stored (E, in, out)) read and written
back as they were, and what is refused, by name."""

import dataclasses
import json
import re
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers as tf
from family_cases import BY_ID, model_inputs, reference
from parity_utils import assert_same_tensor_files, save_reference
from safetensors.numpy import load_file, save_file

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.io.widths import widen
from rotsym_jax.spec import bind
from rotsym_jax.transforms import KINDS, MAP_KINDS, RESIDUAL, UNIT_KINDS, identity_transform
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

GEMMA3, MISTRAL3 = BY_ID["Gemma3ForConditionalGeneration"], BY_ID["Mistral3ForConditionalGeneration"]
MISTRAL3_TIED = BY_ID["Mistral3ForConditionalGeneration[tied-bias]"]
QWEN2_VL, QWEN2_5_VL = BY_ID["Qwen2VLForConditionalGeneration"], BY_ID["Qwen2_5_VLForConditionalGeneration"]
QWEN3_VL, QWEN3_VL_MOE = BY_ID["Qwen3VLForConditionalGeneration"], BY_ID["Qwen3VLMoeForConditionalGeneration"]
LLAMA4, LLAMA4_TIED = BY_ID["Llama4ForConditionalGeneration"], BY_ID["Llama4ForConditionalGeneration[tied-no-qk-norm]"]


# The VLMs whose towers are aligned (vlm_towers.py): their groups, and the projector MLP's where it has one
TOWERS = {"gemma3_vlm": ("vision", "vision_ffn", "vision_pool", "vision_pool_ffn"), "mistral3": ("vision", "vision_ffn", "projector_ffn"),
          "qwen2_vl": ("vision", "vision_ffn", "projector_ffn"), "qwen2_5_vl": ("vision", "vision_ffn", "projector_ffn"),
          **dict.fromkeys(("qwen3_vl", "qwen3_vl_moe"), ("vision", "vision_ffn", "projector_ffn", "deepstack_ffn")),
          "llama4": ("vision", "vision_ffn", "adapter_ffn", "projector_ffn")}  # Llama 4's pixel-shuffle adapter's units and its outputs'
# the maps of each projector's MLP whose units move (Llama 4's: the adapter's fc1 and fc2, the projector's linear_1)
MLP = {**dict.fromkeys(("mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl_moe"), ("up", "out")), "llama4": ("up", "mid", "out")}
# a tower's own stream: its embeddings, norms, and the biases added to it (the engine moves the text model's stream only)
TOWER_STREAM = r"vision/(embeddings/.*|final_norm/.*|pooler/probe|(pooler/)?layers/\d+/((attention|mlp)_norm/.*|attention/out/bias|mlp/down/bias))"


def _wide_tower(model, folder):
    """The model with its tower's and projector's matrices of std 1/sqrt(fan in) (transformers' 0.02 leaves the images
    next to no say in the logits), saved again."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and re.search(r"vision_tower|visual\.|vision_model\.|multi_modal_projector", name):
                p.normal_(0.0, p[0].numel() ** -0.5)
    model.save_pretrained(folder)
    return model


def _saved(case, folder):
    save_reference(case.model_class, case.config(), folder)
    return folder


@pytest.mark.parametrize("case, unproven", [
    # the text model's QK-norm leaves its QK scales and maps to the SigLIP tower; sandwich norms: the stream does not rotate
    (GEMMA3, {"residual rotation"}),
    (MISTRAL3, set()),
    (MISTRAL3_TIED, set()),  # the stream rotates with the LM head untied
    (QWEN2_VL, set()),  # multimodal RoPE: each rotary pair turns by one of three positions, and its 2-D rotations commute with any
    (QWEN2_5_VL, set()),  # tied
    # QK-norm: the text model's QK group is the sign flips of whole rotary pairs (turns by pi), which commute with interleaved
    # multimodal RoPE; its QK scales and maps are the tower's; the stream moves with the merger's and the DeepStack mergers' outputs
    (QWEN3_VL, set()),
    pytest.param(QWEN3_VL_MOE, {"FFN unit scales"}, marks=pytest.mark.slow),  # its experts stacked, no dense FFN, GELU MLPs elsewhere
    # the text model's L2 QK-norm leaves its QK scales and maps to the tower (tests/test_llama4.py shows them without it); twelve runs
    pytest.param(LLAMA4, set(), marks=pytest.mark.slow),
    pytest.param(LLAMA4_TIED, set(), marks=pytest.mark.slow),  # tied by its text_config: the stream rotates with the LM head untied there
], ids=lambda x: getattr(x, "id", ""))
def test_every_group_holds_in_transformers_on_text_with_an_image(case, unproven, tmp_path):
    folder = _saved(case, tmp_path / "m")
    if case.family in TOWERS:  # so that the tower's groups have a say in the logits
        _wide_tower(case.model_class.from_pretrained(folder), folder)
    checks = {c.element: c for c in verify_groups(folder)}
    assert len(checks) == 12 and all(c.ok for c in checks.values()), checks
    assert {e for e, c in checks.items() if c.difference is None} == unproven, checks
    if case.family in TOWERS:  # the tower's block beside the text model's (their heads differ)
        assert "vision: " in checks["head permutations"].group, checks["head permutations"]


@pytest.mark.parametrize("case", [GEMMA3, MISTRAL3_TIED, QWEN2_VL, QWEN2_5_VL, QWEN3_VL_MOE, LLAMA4], ids=lambda c: c.id)
def test_the_vision_towers_stream_and_the_projectors_input_side_never_move(case, tmp_path):
    """Where the tower is aligned, its heads and MLP units move and, under the text model's stream, its own stream stays
    (Gemma 3's is a group of its own, left out here: its test is the last); elsewhere the whole tower stays. The
    projector's first map (its input side, the tower's stream) moves only by its MLP's units."""
    ck = rj.load_hf(_saved(case, tmp_path / "m"))
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1))
    t[RESIDUAL] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation", RESIDUAL)
    before, after = (rj.pytree.flatten(p) for p in (ck.params, rj.apply_transform(spec, ck.params, t)))
    aligned = case.family in TOWERS
    still = [p for p in before if (re.fullmatch(TOWER_STREAM, p) if aligned else p.startswith("vision/"))
             or p.startswith("projector/") and not re.search("/(up|mid|out)/", p)]
    assert len(still) > (5 if aligned else 20) and all(np.array_equal(before[p], after[p]) for p in still)
    if case is LLAMA4:  # fc1's units solved first (from fc1), fc2's outputs after them (linear_1 and fc2 in that order), as inspect says
        groups = {g.name: g for g in rj.bind(spec, ck.params).perms}
        assert (groups["adapter_ffn"].after, groups["projector_ffn"].after) == ((), ("adapter_ffn",))
        said = {name: groups[name].describe() for name in ("adapter_ffn", "projector_ffn")}
        assert "1 of them also on an axis of 'projector_ffn' (solved after this group" in said["adapter_ffn"], said
        assert "solved after 'adapter_ffn' (1 of its leaf kinds carries" in said["projector_ffn"] and "solved after this" not in said["projector_ffn"], said
    if aligned:  # every other tower leaf is a group's, and moves
        tower = [p for p in before if p.startswith("vision/") and p not in still and not p.endswith("/probe")]
        assert len(tower) > 10 and not any(np.array_equal(before[p], after[p]) for p in tower), tower
    mlp = MLP.get(case.family, ())
    moved = [f"projector/layers/0/{m}/kernel" for m in mlp] or ["projector/out/kernel"]
    moved += ["embeddings/word/embedding", "layers/0/attention/query/kernel"]
    moved += ["projector/deepstack/1/out/kernel", "projector/deepstack/0/out/bias", "projector/deepstack/0/up/kernel",
              "layers/1/moe/up/kernel"] if case is QWEN3_VL_MOE else [
        "layers/0/mlp/up/kernel", "layers/1/moe/up/kernel"] if case is LLAMA4 else ["layers/1/mlp/up/kernel"]
    assert not any(np.array_equal(before[p], after[p]) for p in moved)


def _logits(model, inputs):
    return reference(model, inputs)["logits"]


def _tower_only(family, spec, params, key, kinds):
    """A random element of the tower's and the projector's groups (`TOWERS`), the text model's left as they are."""
    t = rj.random_transform(spec, params, key, kinds)
    identity = identity_transform(bind(spec, params))
    return {name: t[name] if name in TOWERS[family] else identity[name] for name in t}


@pytest.mark.parametrize("case", [GEMMA3, MISTRAL3, QWEN2_VL, QWEN2_5_VL, QWEN3_VL, LLAMA4], ids=lambda c: c.family)
def test_the_towers_groups_keep_transformers_logits_on_text_with_images(case, tmp_path):
    """An element of every kind of the tower's groups (heads permuted, Q/K and V/O invertible maps and scales, MLP units
    permuted and, gated, scaled) and the projector MLP's units permuted: transformers' logits on text with images stay.
    V rotated without O changes them; so does a rotation of each head's Q/K that mixes its rotary pairs where the tower
    turns them by the patches' rows and columns (Pixtral's, Qwen2-VL's and Llama 4's 2-D RoPE, Llama 4's on interleaved
    pairs read in rotate_half order: only each pair's own 2-D rotations commute with it). Llama 4's adapter and projector
    units: each map of the chain left as it was (fc1, fc2 or linear_1) changes them."""
    model = _wide_tower(save_reference(case.model_class, case.config(), tmp_path / "a"), tmp_path / "a")
    inputs, ck = model_inputs(case, model.config), rj.load_hf(tmp_path / "a")
    want, spec = _logits(model, inputs), rj.spec_for(ck)
    other = _logits(model, {**inputs, "pixel_values": inputs["pixel_values"][::-1].copy()})  # the images swapped between rows
    assert np.abs(other - want).max() > 1e-2 * np.abs(want).max()  # the logits read the images

    def logits(spec, kinds, keep=()):
        moved = rj.apply_transform(spec, ck.params, _tower_only(case.family, spec, ck.params, jax.random.key(3), kinds))
        moved = rj.pytree.unflatten({**rj.pytree.flatten(moved), **{p: x for p, x in rj.pytree.flatten(ck.params).items() if p in keep}})
        folder = rj.save_hf(ck, moved, tmp_path / f"b{len(list(tmp_path.iterdir()))}")
        return _logits(case.model_class.from_pretrained(folder).eval(), inputs)

    np.testing.assert_allclose(logits(spec, KINDS + MAP_KINDS + UNIT_KINDS), want, rtol=0, atol=1e-4 * np.abs(want).max())
    outs = [p for p in rj.pytree.flatten(ck.params) if re.fullmatch(r"vision/layers/\d+/attention/out/kernel", p)]
    controls = [logits(spec, ("vo",), keep=outs)]
    geometry = spec.heads["vision"]
    if geometry.rotary_dim:  # Q/K's rotations drawn as if the heads had no RoPE
        controls.append(logits(dataclasses.replace(spec, heads={**spec.heads, "vision": dataclasses.replace(geometry, rotary_dim=None)}), ("qk",)))
    if case.family == "llama4":  # each permutation of the chain undone on one of its maps
        controls += [logits(spec, ("perm",), keep=(f"projector/layers/0/{m}/kernel",)) for m in MLP["llama4"]]
    for got in controls:
        assert np.abs(got - want).max() > 1e-3 * np.abs(want).max()  # ten times the tolerance


def _turn_pairs(model, pairs, angles):
    """Each head's rotary pairs (j, j + dh/2) turned in place on Q's and K's rows (weights and biases), by angles[layer, kv
    group, j] (`pairs`: (j, j') planes; (j, j + dh/2) for a pair's own rotation), every query head of a group as its keys."""
    text = model.config.text_config
    dh, group = text.head_dim, text.num_attention_heads // text.num_key_value_heads
    with torch.no_grad():
        for i, layer in enumerate(model.model.language_model.layers):
            for proj, per_group in ((layer.self_attn.q_proj, group), (layer.self_attn.k_proj, 1)):
                for x in (proj.weight, proj.bias):
                    heads = x.view(-1, dh, *x.shape[1:])
                    for h in range(heads.shape[0]):
                        for n, (a, b) in enumerate(pairs):
                            c, s = np.cos(angles[i, h // per_group, n]), np.sin(angles[i, h // per_group, n])
                            heads[h, a], heads[h, b] = c * heads[h, a] - s * heads[h, b], s * heads[h, a] + c * heads[h, b]


def test_interleaved_multimodal_rope_commutes_with_each_rotary_pairs_rotations_in_transformers(tmp_path):
    """Qwen3-VL turns rotary pair j by the time, height or width position (interleaved: height where j % 3 == 1, width
    where j % 3 == 2, within mrope_section), which differ on an image's tokens. A 2-D rotation of each pair (an angle per
    layer, kv group and pair), on Q's and K's rows alike, commutes with every such turn: transformers' logits on text with
    an image stay (the QK-norm's gains set to one, so that the norm commutes with any rotation of a head: Qwen2-VL's
    group). Turning the plane of two pairs' first entries (pair 1, by height, with pair 2, by width) changes them; so does
    a pair's rotation under the QK-norm's own gains, which leave the record the pairs' turns by pi (proven above)."""
    model = save_reference(QWEN3_VL.model_class, QWEN3_VL.config(), tmp_path / "m")
    inputs = model_inputs(QWEN3_VL, model.config)
    text = model.config.text_config
    angles = np.random.default_rng(0).uniform(-np.pi, np.pi, (text.num_hidden_layers, text.num_key_value_heads, text.head_dim // 2))
    own = [(j, j + text.head_dim // 2) for j in range(text.head_dim // 2)]

    def logits_after(pairs, unit_gains):
        m = QWEN3_VL.model_class.from_pretrained(tmp_path / "m").eval()
        if unit_gains:
            with torch.no_grad():
                for layer in m.model.language_model.layers:
                    layer.self_attn.q_norm.weight.fill_(1.0), layer.self_attn.k_norm.weight.fill_(1.0)
        want = _logits(m, inputs)
        _turn_pairs(m, pairs, angles)
        return _logits(m, inputs), want

    got, want = logits_after(own, unit_gains=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    for pairs, unit_gains in (([(1, 2)], True), (own, False)):
        got, want = logits_after(pairs, unit_gains)
        assert np.abs(got - want).max() > 1e-3 * np.abs(want).max(), (pairs, unit_gains)  # ten times the tolerance


def _hub_experts(folder, out, swap=("gate_up_proj", "down_proj")):
    """The checkpoint with its stacked experts stored as Qwen's releases store them, (E, in, out)."""
    shutil.copytree(folder, out)
    tensors = load_file(folder / "model.safetensors")
    tensors = {n: np.ascontiguousarray(np.swapaxes(x, 1, 2)) if n.rsplit(".", 1)[-1] in swap and ".experts." in n else x
               for n, x in tensors.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out, tensors


def test_qwen3_vl_moe_experts_as_the_hub_stores_them_read_as_transformers_reads_them_and_write_back(tmp_path):
    """Qwen's releases store gate_up_proj (E, d, 2f) and down_proj (E, f, d); transformers 5 writes (E, 2f, d) and
    (E, d, f), and reads either (each its own shape unless the transpose matches). Here with a dense first layer
    (mlp_only_layers): the same leaves as the other layout, which transformers computes A's logits from; written back as
    read."""
    config = QWEN3_VL_MOE.config()
    config.text_config.mlp_only_layers = [0]
    model = save_reference(QWEN3_VL_MOE.model_class, config, tmp_path / "t5")
    hub, tensors = _hub_experts(tmp_path / "t5", tmp_path / "hub")
    assert tensors["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (5, 32, 48)
    inputs = model_inputs(QWEN3_VL_MOE, model.config)
    theirs, info = QWEN3_VL_MOE.model_class.from_pretrained(hub, output_loading_info=True)
    assert not any(info.values()), info
    np.testing.assert_allclose(_logits(theirs.eval(), inputs), _logits(model, inputs), rtol=0, atol=1e-5)
    ours, t5 = rj.load_hf(hub), rj.load_hf(tmp_path / "t5")
    assert (ours.layout.transposed_experts, t5.layout.transposed_experts) == (("gate_up_proj", "down_proj"), ())
    a, b = rj.pytree.flatten(ours.params), rj.pytree.flatten(t5.params)
    assert a.keys() == b.keys() and all(np.array_equal(a[p], b[p]) for p in a)
    written = load_file(rj.save_hf(ours, ours.params, tmp_path / "out") / "model.safetensors")
    assert written.keys() == tensors.keys() and all(np.array_equal(written[n], tensors[n]) for n in tensors)


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


@pytest.mark.slow
def test_qwen3_vl_moe_aligns_across_expert_layouts_in_memory_and_streamed_alike(tmp_path):
    """A as the Hub stores its experts, B (A moved by every group and a permuted stream) as transformers 5 writes them:
    aligned in memory and streamed, the same bits, written in B's layout, which transformers reads to A's logits."""
    model = save_reference(QWEN3_VL_MOE.model_class, QWEN3_VL_MOE.config(), tmp_path / "t5")
    a, _ = _hub_experts(tmp_path / "t5", tmp_path / "a")
    ck = rj.load_hf(tmp_path / "t5")
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1), KINDS + UNIT_KINDS)
    t[RESIDUAL] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
    b = rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "b")
    options = ["--quiet", "--heads", "permute", "--residual", "permutation", "--ffn", "scaled"]
    for out, more in ((tmp_path / "memory", []), (tmp_path / "stream", ["--max-memory", "3G"])):
        assert cli.main(["align", str(a), str(b), str(out), *options, *more]) == 0
    memory, stream = (load_file(tmp_path / f / "model.safetensors") for f in ("memory", "stream"))
    assert memory.keys() == stream.keys() and all(np.array_equal(memory[n], stream[n]) for n in memory)
    assert memory["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (5, 48, 32)
    report = json.loads((tmp_path / "memory" / "rotsym_report.json").read_text())["result"]
    assert report["before"]["total"] > 1.0 and report["after"]["total"] <= 1e-4 * report["before"]["total"]  # the plant undone
    inputs = model_inputs(QWEN3_VL_MOE, model.config)
    got = _logits(QWEN3_VL_MOE.model_class.from_pretrained(tmp_path / "memory").eval(), inputs)
    want = _logits(model, inputs)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_qwen3_vl_moe_experts_one_tensor_each_are_refused_by_name(tmp_path):
    """transformers reads Qwen3-VL-MoE's experts stacked only (no per-expert conversion, unlike Qwen3-MoE's)."""
    folder = _saved(QWEN3_VL_MOE, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".experts.gate_up_proj")]:
        gate, up = np.split(tensors.pop(name), 2, axis=1)
        for e in range(len(gate)):
            tensors[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = np.ascontiguousarray(gate[e])
            tensors[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = np.ascontiguousarray(up[e])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(rj.CheckpointError, match=r"tensor 'model.language_model.layers.0.mlp.experts.gate_up_proj' .* is missing"):
        rj.load_hf(folder)


def test_a_checkpoint_without_its_vision_tower_is_refused_by_name(tmp_path):
    folder = _saved(GEMMA3, tmp_path / "m")
    tensors = {n: x for n, x in load_file(folder / "model.safetensors").items() if not n.startswith("vision_tower.")}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(rj.CheckpointError, match=r"no vision tower: none of \['vision_tower.vision_model.embeddings.patch_embedding.weight'"):
        rj.load_hf(folder)


@pytest.mark.parametrize("case", [GEMMA3, QWEN3_VL], ids=lambda c: c.family)
def test_nothing_runs_the_model_here_and_that_is_said(case, tmp_path):
    ck = rj.load_hf(_saved(case, tmp_path / "m"))
    with pytest.raises(rj.CheckpointError, match=f"a {case.family} model is read, aligned, merged and saved, but rotsym_jax has no forward pass"):
        ck.apply(ck.params, input_ids=np.zeros((1, 4), np.int64))


@pytest.mark.parametrize("case, kv_heads", [(MISTRAL3, 4), (QWEN2_5_VL, None), pytest.param(QWEN3_VL, 4, marks=pytest.mark.slow)],
                         ids=["mistral3", "qwen2_5_vl", "qwen3_vl"])
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


def test_verify_names_a_model_transformers_cannot_run(tmp_path):
    """Llama4Config's default image_token_index (200092) past a small text vocabulary: transformers'
    model fails on the example inputs, which verify says (new-user trial: a 62-line IndexError)."""
    folder = _saved(LLAMA4, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "image_token_index": 200092}))
    with pytest.raises(rj.RotsymError, match="does not run it on example inputs .IndexError"):
        verify_groups(folder)


def test_a_saved_dtype_is_written_in_the_sub_configs_too(tmp_path):
    """--dtype (save_hf's dtype) on a VLM whose config names a dtype in text_config and vision_config
    too (as the Hub's older configs do, under torch_dtype): every one says the dtype written, as
    save_pretrained sets it on each sub-config (new-user trial: they kept float32)."""
    folder = _with_config(_saved(QWEN2_VL, tmp_path / "m"), tmp_path, lambda raw: raw.update(
        torch_dtype="float32", text_config={**raw["text_config"], "torch_dtype": "float32"},
        vision_config={**raw["vision_config"], "dtype": "float32"}))
    ck = rj.load_hf(folder)
    out = rj.save_hf(ck, ck.params, tmp_path / "bf16", dtype="bfloat16")
    raw = json.loads((out / "config.json").read_text())
    assert [(c.get("dtype"), "torch_dtype" in c) for c in (raw, raw["text_config"], raw["vision_config"])] == [("bfloat16", False)] * 3
    config = tf.AutoConfig.from_pretrained(out)
    assert config.dtype == config.text_config.dtype == config.vision_config.dtype == torch.bfloat16


def _map_planes(model, planes, matrices):
    """Llama 4's vision heads' Q and K rows (weights and biases, transformers' interleaved order) mapped in place: plane n
    (entries (a, b) of each head) by matrices[layer, head, n] (2 x 2), on q and k alike."""
    dh = model.config.vision_config.hidden_size // model.config.vision_config.num_attention_heads
    with torch.no_grad():
        for i, layer in enumerate(model.vision_model.model.layers):
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                for x in (proj.weight, proj.bias):
                    heads = x.view(-1, dh, *x.shape[1:])
                    for h in range(heads.shape[0]):
                        for n, (a, b) in enumerate(planes):
                            m = torch.as_tensor(matrices[i, h, n], dtype=x.dtype)
                            heads[h, a], heads[h, b] = m[0, 0] * heads[h, a] + m[0, 1] * heads[h, b], m[1, 0] * heads[h, a] + m[1, 1] * heads[h, b]


def test_llama4_vision_rope_commutes_with_each_interleaved_pairs_rotations_only_in_transformers(tmp_path):
    """Llama 4's vision RoPE turns pair (2k, 2k + 1) of every head by (column + 1) * theta_k for k < head_dim/4, by
    (row + 1) * theta_(k - head_dim/4) after (the class token by 0). A rotation of each pair (an angle per layer, head and
    pair) on Q's and K's rows keeps transformers' logits on text with images. Turning the plane of pair 0's first entry
    with pair head_dim/4's (the same frequency, by column against by row) changes them, as does a reflection of each pair
    (F R(a) F = R(-a)): the record's QK group, each pair's (scaled) rotations in rotate_half order, is what commutes."""
    model = _wide_tower(save_reference(LLAMA4.model_class, LLAMA4.config(), tmp_path / "m"), tmp_path / "m")
    inputs, v = model_inputs(LLAMA4, model.config), model.config.vision_config
    want, dh = _logits(model, inputs), v.hidden_size // v.num_attention_heads
    rng, own = np.random.default_rng(0), [(2 * k, 2 * k + 1) for k in range(dh // 2)]
    angles = rng.uniform(-np.pi, np.pi, (v.num_hidden_layers, v.num_attention_heads, dh // 2))
    turns = np.stack([np.cos(angles), -np.sin(angles), np.sin(angles), np.cos(angles)], -1).reshape(*angles.shape, 2, 2)

    def logits_after(planes, matrices):
        m = LLAMA4.model_class.from_pretrained(tmp_path / "m").eval()
        _map_planes(m, planes, matrices)
        return _logits(m, inputs)

    np.testing.assert_allclose(logits_after(own, turns), want, rtol=0, atol=1e-4 * np.abs(want).max())
    flips = np.broadcast_to(np.diag([1.0, -1.0]), turns.shape)
    for planes, matrices in (([(0, dh // 2)], turns[..., :1, :, :]), (own, flips)):
        assert np.abs(logits_after(planes, matrices) - want).max() > 1e-3 * np.abs(want).max(), planes  # ten times the tolerance


def test_gemma3s_image_tower_stream_is_a_group_with_the_projectors_input(tmp_path):
    """Gemma 3's SigLIP tower has a stream of its own (`vision_residual`: its record's, with the
    projector's norm gain and input rows), besides the text model's. A permutation of each keeps
    the logits in transformers; `--residual signed_permutation` is a ceiling (the image stream's
    LayerNorms take no sign flips: it takes permutations, as `settled` says) and undoes both,
    streamed as in memory to the bit."""
    model = save_reference(GEMMA3.model_class, GEMMA3.config(), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    text, vision = bind(spec, ck.params).streams
    assert (text.name, vision.name) == (RESIDUAL, "vision_residual")
    assert {("projector/norm/scale", 0), ("projector/out/kernel", 0), ("vision/embeddings/patch/kernel", 1)} <= set(vision.axes)
    assert ("projector/out/kernel", 1) in text.axes
    t = rj.random_transform(spec, ck.params, jax.random.key(1), KINDS)
    for k, stream in enumerate((text, vision)):
        t[stream.name] = rj.random_residual(spec, ck.params, jax.random.key(2 + k), "permutation", stream.name)
    rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "b")
    inputs = model_inputs(GEMMA3, model.config)
    want = reference(model, inputs)["logits"]
    got = reference(tf.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "b").eval(), inputs)["logits"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    for name, extra in (("memory", []), ("stream", ["--max-memory", "3G"])):
        out = tmp_path / name
        assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(out), "--quiet", "--heads", "permute",
                         "--residual", "signed_permutation", *extra]) == 0
        report = json.loads((out / "rotsym_report.json").read_text())["result"]
        assert report["after"]["total"] <= 1e-6 * report["before"]["total"]
        assert report["settled"]["streams"] == {RESIDUAL: "signed_permutation", "vision_residual": "permutation"}
        assert report["moved"]["vision_residual"]["coordinates"] > 0.5
    assert_same_tensor_files(tmp_path / "memory", tmp_path / "stream")
    aligned = reference(tf.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "memory").eval(), inputs)["logits"]
    np.testing.assert_allclose(aligned, want, rtol=0, atol=1e-4 * np.abs(want).max())
