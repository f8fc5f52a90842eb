"""mergekit `slices:` as mergekit runs them (issue 75): layers stacked and cut from several models,
ranges merged slice by slice, checked here against the source tensors at the indices mergekit's
planner maps them from, and against transformers loading what is written. The comparison with
mergekit 0.1.5 itself is in tests/test_mergekit.py (slow, its `slices_*` configs)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from checkpoint_utils import checkpoint_tensors, float_tensors, save_random

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.mergekit_pipeline import merge_mergekit
from rotsym_jax.pipeline import PipelineError

LLAMA = dict(model_type="llama", vocab_size=60, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, max_position_embeddings=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three unrelated tiny Llamas of 3 layers (rotsym-written, float32) and a 4-layer one."""
    root = tmp_path_factory.mktemp("slices")
    out = {f"m{i}": save_random(LLAMA, "lm", i, root / f"m{i}") for i in (1, 2, 3)}
    out["deep"] = save_random({**LLAMA, "num_hidden_layers": 4}, "lm", 4, root / "deep")
    return {k: str(v) for k, v in out.items()}


def _config(tmp_path, raw: dict, name: str = "config.yml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _src(model, first, end, **params):
    return {"model": model, "layer_range": [first, end], **({"parameters": params} if params else {})}


def _layer_map(name: str, mapping: dict[int, int]) -> tuple[str, int | None]:
    """The source tensor name of an output tensor, by hand: model.layers.J. -> model.layers.mapping[J]."""
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        return name, None
    j = int(parts[2])
    return ".".join([*parts[:2], str(mapping[j]), *parts[3:]]), j


def test_stacked_layers_are_the_sources_layers_renamed_and_transformers_loads_them(models, tmp_path):
    """Layers [0, 2) of m1 then [1, 3) of m2 (o_proj scaled by 0.5), as mergekit's passthrough stacks
    them: output layers 0, 1 are m1's 0, 1; 2, 3 are m2's 1, 2; the embedding is the first slice's
    (m1), the final norm and head the last's (m2)."""
    torch = pytest.importorskip("torch")
    import transformers

    raw = {"slices": [{"sources": [_src(models["m1"], 0, 2)]},
                      {"sources": [_src(models["m2"], 1, 3, scale=[{"filter": "o_proj", "value": 0.5}, {"value": 1.0}])]}],
           "merge_method": "passthrough", "dtype": "float32"}
    config = _config(tmp_path, raw)
    assert cli.main(["merge", str(config), str(tmp_path / "memory"), "--quiet"]) == 0
    got, m1, m2 = float_tensors(tmp_path / "memory"), float_tensors(models["m1"]), float_tensors(models["m2"])
    source = {0: (m1, 0), 1: (m1, 1), 2: (m2, 1), 3: (m2, 2)}
    expected_names = set()
    for name in m1:
        if not name.startswith("model.layers."):
            expected_names.add(name)
    for j in range(4):
        expected_names |= {n.replace("model.layers.0.", f"model.layers.{j}.") for n in m1 if n.startswith("model.layers.0.")}
    assert set(got) == expected_names
    for name, x in got.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            model, i = source[int(parts[2])]
            want = model[".".join([*parts[:2], str(i), *parts[3:]])] * (0.5 if "o_proj" in name and int(parts[2]) >= 2 else 1.0)
        else:
            want = (m1 if name == "model.embed_tokens.weight" else m2)[name]
        np.testing.assert_array_equal(x, want, err_msg=name)
    written = json.loads((tmp_path / "memory" / "config.json").read_text())
    assert written["num_hidden_layers"] == 4 and {k: v for k, v in written.items() if k not in ("num_hidden_layers", "dtype", "architectures")} \
        == {k: v for k, v in json.loads((Path(models["m1"]) / "config.json").read_text()).items() if k not in ("num_hidden_layers", "dtype", "architectures")}
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "memory")
    assert model.config.num_hidden_layers == 4 and len(model.model.layers) == 4
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for name, x in got.items():
        np.testing.assert_array_equal(state[name], x, err_msg=name)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    # streamed under --max-memory: the same bits
    assert cli.main(["merge", str(config), str(tmp_path / "stream"), "--quiet", "--max-memory", "3G"]) == 0
    assert checkpoint_tensors(tmp_path / "stream") == checkpoint_tensors(tmp_path / "memory")
    assert (tmp_path / "stream" / "config.json").read_text() == (tmp_path / "memory" / "config.json").read_text()


def test_a_slice_wise_linear_merge_takes_its_gradient_over_the_slices_own_layers(models, tmp_path):
    """Slice 0 merges m1's [0, 2) with m2's [1, 3) (m1's weight a gradient 0 -> 1 over the slice's two
    layers), slice 1 m3's [0, 1) with the 4-layer model's [3, 4) (a gradient in a slice of one layer
    takes t = 1, its last value); outside the layers t = 0 and the tensors come from the first slice
    (embedding) and the last (norm, head)."""
    raw = {"slices": [{"sources": [_src(models["m1"], 0, 2, weight=[0.0, 1.0]), _src(models["m2"], 1, 3, weight=0.5)]},
                      {"sources": [_src(models["m3"], 0, 1, weight=[0.2, 0.6]), _src(models["deep"], 3, 4, weight=1.0)]}],
           "merge_method": "linear", "parameters": {"normalize": False}, "dtype": "float32"}
    config = _config(tmp_path, raw)
    merge_mergekit(config, tmp_path / "out")
    got = float_tensors(tmp_path / "out")
    m1, m2, m3, deep = (float_tensors(models[m]) for m in ("m1", "m2", "m3", "deep"))
    assert len({n.split(".")[2] for n in got if n.startswith("model.layers.")}) == 3
    for name, x in got.items():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            a, b, wa, wb = (m1, m2, 0.0, 0.5) if name == "model.embed_tokens.weight" else (m3, deep, 0.2, 1.0)
            want = wa * a[name] + wb * b[name]
        else:
            j, rest = int(parts[2]), ".".join(parts[3:])
            if j < 2:  # t = j over the slice's two layers
                want = j * m1[f"model.layers.{j}.{rest}"] + 0.5 * m2[f"model.layers.{j + 1}.{rest}"]
            else:  # t = 1: the gradient's last value
                want = 0.6 * m3[f"model.layers.0.{rest}"] + 1.0 * deep[f"model.layers.3.{rest}"]
        np.testing.assert_allclose(x, want, rtol=0, atol=1e-6, err_msg=name)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 3


def test_per_layer_lists_are_sliced_with_their_layers_and_transformers_loads_them(tmp_path):
    """A Qwen2 whose layer_types alternate: the output's are the slices' own, concatenated (mergekit
    0.1.5 keeps the source's list, which transformers then refuses)."""
    pytest.importorskip("torch")
    import transformers

    qwen = dict(LLAMA, model_type="qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=4,
                layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])
    source = save_random(qwen, "lm", 7, tmp_path / "qwen")
    raw = {"slices": [{"sources": [_src(str(source), 0, 3)]}, {"sources": [_src(str(source), 1, 4)]}], "merge_method": "passthrough"}
    merge_mergekit(_config(tmp_path, raw), tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    want = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert written["num_hidden_layers"] == 6 and written["layer_types"] == want
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.layer_types == want and len(model.model.layers) == 6


def test_slices_that_keep_every_layer_in_place_still_align(models, tmp_path):
    """Two slices that together span every layer of same-depth models keep each layer in place:
    aligned, they merge as the models: config of the same weights does (constant weights, so the
    slices' own gradients play no part)."""
    ck = rj.load_hf(models["m1"])
    spec = rj.spec_for(ck)
    moved = hf.save_hf(ck, rj.apply_transform(spec, ck.params, rj.random_transform(spec, ck.params, jax.random.key(3))), tmp_path / "moved")
    block = {"align": "anchor", "align_options": {"heads": "permute"}}
    sliced = {"slices": [{"sources": [_src(models["m1"], 0, 2, weight=1), _src(str(moved), 0, 2, weight=1)]},
                         {"sources": [_src(models["m1"], 2, 3, weight=1), _src(str(moved), 2, 3, weight=1)]}],
              "merge_method": "linear", "dtype": "float32", "rotsym": block}
    whole = {"models": [{"model": models["m1"], "parameters": {"weight": 1}}, {"model": str(moved), "parameters": {"weight": 1}}],
             "merge_method": "linear", "dtype": "float32", "rotsym": block}
    merge_mergekit(_config(tmp_path, sliced, "sliced.yml"), tmp_path / "sliced")
    merge_mergekit(_config(tmp_path, whole, "whole.yml"), tmp_path / "whole")
    assert checkpoint_tensors(tmp_path / "sliced") == checkpoint_tensors(tmp_path / "whole")
    m1 = float_tensors(models["m1"])
    for name, x in float_tensors(tmp_path / "sliced").items():  # the planted copy, aligned back: the average is m1
        np.testing.assert_allclose(x, m1[name], atol=1e-5, err_msg=name)


@pytest.fixture(scope="module")
def planted(models, tmp_path_factory):
    """m1 with a random element of its group planted (the heads kept in place, as alignment's default
    keeps them), the residual stream permuted too: the same function as m1, every tensor in another basis."""
    ck = rj.load_hf(models["m1"])
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(3), ("qk", "vo", "qk_scale", "vo_scale", "perm"))  # heads in place: the paper's groups
    t["residual"] = rj.random_residual(spec, ck.params, jax.random.key(4), "permutation")
    return str(hf.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path_factory.mktemp("planted") / "moved"))


def _logits(folder, tokens):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("residual", ["auto", "permutation"])
def test_aligned_seams_undo_a_planted_basis_so_the_stack_is_the_anchors_own(models, planted, tmp_path, residual):
    """Layers [0, 2) of m1 then [2, 3) of m1 planted in another residual basis: plainly stacked, the
    last layer reads a stream it was not trained on (transformers' logits move); with aligned seams
    (B's stream mapped into the anchor's, residual auto = the strongest group the family allows), the
    stack is m1 itself, and a deeper stack [0, 3) + [1, 3) of the planted copy is m1's over itself."""
    pytest.importorskip("torch")
    tokens = np.random.default_rng(0).integers(0, LLAMA["vocab_size"], (2, 8))
    raw = {"slices": [{"sources": [_src(models["m1"], 0, 2)]}, {"sources": [_src(planted, 2, 3)]}], "merge_method": "passthrough",
           "dtype": "float32"}
    merge_mergekit(_config(tmp_path, raw, "plain.yml"), tmp_path / "plain")
    aligned = {**raw, "rotsym": {"align": "anchor", "anchor": models["m1"], "align_options": {"residual": residual}}}
    written = merge_mergekit(_config(tmp_path, aligned, "aligned.yml"), tmp_path / "aligned")
    want = _logits(models["m1"], tokens)
    assert np.abs(_logits(tmp_path / "plain", tokens) - want).max() > 0.1 * np.abs(want).max()
    np.testing.assert_allclose(_logits(tmp_path / "aligned", tokens), want, atol=1e-4 * np.abs(want).max())
    assert written.report["options"]["align_options"]["residual"] == ("rotation" if residual == "auto" else "permutation")
    deeper = {"slices": [{"sources": [_src(models["m1"], 0, 3)]}, {"sources": [_src(planted, 1, 3)]}], "merge_method": "passthrough",
              "dtype": "float32", "rotsym": {"align": "anchor", "anchor": models["m1"], "align_options": {"residual": residual}}}
    merge_mergekit(_config(tmp_path, deeper, "deeper.yml"), tmp_path / "deeper")
    itself = {**deeper, "slices": [{"sources": [_src(models["m1"], 0, 3)]}, {"sources": [_src(models["m1"], 1, 3)]}], "rotsym": {"align": "none"}}
    merge_mergekit(_config(tmp_path, itself, "itself.yml"), tmp_path / "itself")
    want = _logits(tmp_path / "itself", tokens)
    np.testing.assert_allclose(_logits(tmp_path / "deeper", tokens), want, atol=1e-4 * np.abs(want).max())


def test_aligned_seams_without_the_residual_stream_or_of_other_depths_and_layers_of_two_stacks_are_refused_by_name(
        models, tmp_path, no_weight_reads, capsys):
    raw = {"slices": [{"sources": [_src(models["m1"], 0, 2)]}, {"sources": [_src(models["m2"], 1, 3)]}], "merge_method": "passthrough",
           "rotsym": {"align": "anchor", "align_options": {"residual": "none"}}}
    with pytest.raises(PipelineError, match=r"slices that put one model.s layers after another.s, aligned with residual: none: only the residual stream"):
        merge_mergekit(_config(tmp_path, raw), tmp_path / "out")
    raw["rotsym"] = {"align": "none"}
    with pytest.raises(PipelineError, match=r"aligned seams: model 1 \(.*deep\) has 4 layers, the anchor \(.*m1\) 3"):
        merge_mergekit(_config(tmp_path, {**raw, "slices": [raw["slices"][0], {"sources": [_src(models["deep"], 1, 3)]}]}), tmp_path / "out",
                       align="many")
    with pytest.raises(SystemExit):  # a recipe merges whole models: no layer ranges
        cli.main(["convert-config", str(_config(tmp_path, {**raw, "merge_method": "linear"})), str(tmp_path / "recipe.yaml")])
    assert "2 slices: a recipe merges whole models, not layer ranges" in capsys.readouterr().err
    gpt2 = save_random(dict(model_type="gpt2", vocab_size=60, n_embd=32, n_layer=3, n_head=4, n_positions=16), "lm", 2, tmp_path / "gpt2")
    raw = {"slices": [{"sources": [_src(models["m1"], 0, 2)]}, {"sources": [_src(str(gpt2), 1, 3)]}], "merge_method": "passthrough"}
    with pytest.raises(PipelineError, match=r"model 1 \(.*gpt2\) does not have the architecture of model 0 .*: a gpt2 model, not a llama"):
        merge_mergekit(_config(tmp_path, raw), tmp_path / "out")
    t5 = dict(model_type="t5", vocab_size=60, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
              relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0)
    t5_folder = str(save_random(t5, "lm", 1, tmp_path / "t5"))
    raw = {"slices": [{"sources": [_src(t5_folder, 0, 2)]}, {"sources": [_src(t5_folder, 1, 2)]}], "merge_method": "passthrough"}
    with pytest.raises(PipelineError, match=r"a t5 model has 2 stacks of layers \(decoder, encoder\)"):
        merge_mergekit(_config(tmp_path, raw), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_merging_guides_frankenmerge_runs_as_written(models, tmp_path, monkeypatch):
    page = (Path(__file__).resolve().parent.parent / "docs" / "guides" / "merging.md").read_text()
    text = page[page.index("### Frankenmerges"):].split("```yaml\n", 1)[1].split("```", 1)[0]
    for name, model in (("llama-math", "m1"), ("llama-code", "m2")):
        (tmp_path / name).symlink_to(models[model])
    monkeypatch.chdir(tmp_path)  # paths relative to the working directory, as mergekit reads them
    (tmp_path / "franken.yml").write_text(text)
    assert cli.main(["merge", "franken.yml", "merged", "--quiet"]) == 0
    got, m1, m2 = float_tensors(tmp_path / "merged"), float_tensors(models["m1"]), float_tensors(models["m2"])
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["num_hidden_layers"] == 4  # as the guide says
    for j, (model, i) in enumerate(((m1, 0), (m1, 1), (m2, 1), (m2, 2))):
        np.testing.assert_array_equal(got[f"model.layers.{j}.mlp.up_proj.weight"], model[f"model.layers.{i}.mlp.up_proj.weight"])
        np.testing.assert_array_equal(got[f"model.layers.{j}.self_attn.o_proj.weight"],
                                      model[f"model.layers.{i}.self_attn.o_proj.weight"] * (0.5 if j >= 2 else 1.0))
