"""`rotsym align / merge / inspect` on tiny checkpoints written by transformers, checked with
transformers' PyTorch models and against the same steps called from Python."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
import transformers as tf
import yaml
from checkpoint_utils import assert_same_checkpoint, float_tensors
from parity_utils import reference_outputs, save_reference, torch

import rotsym_jax as rj
from rotsym_jax import cli, merge
from rotsym_jax.pytree import flatten
from rotsym_jax.version import version

TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, max_position_embeddings=16)
IDS = (np.arange(16).reshape(2, 8) * 7 + 3) % 50


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """Two BERT classifiers with different seeds, and a third with another label count."""
    root = tmp_path_factory.mktemp("bert")
    config = tf.BertConfig(**TINY, num_labels=3)
    models = [save_reference(tf.BertForSequenceClassification, config, root / f"m{seed}", seed=seed) for seed in (0, 1)]
    save_reference(tf.BertForSequenceClassification, tf.BertConfig(**TINY, num_labels=5), root / "five", seed=2)
    return root, models


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    config = tf.LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False)
    models = [save_reference(tf.LlamaForCausalLM, config, root / f"m{seed}", seed=seed) for seed in (0, 1, 2)]
    return root, models


def run(*argv) -> int:
    return cli.main([str(a) for a in argv])


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_align_writes_b_moved_with_its_function_report_and_card(family, bert, llama, tmp_path, capsys):
    root, models = {"bert": bert, "llama": llama}[family]
    out = tmp_path / "out"
    assert run("align", root / "m0", root / "m1", out, "--heads", "permute") == 0
    cls = type(models[1])
    loaded, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    before, after = reference_outputs(models[1], input_ids=IDS)["logits"], reference_outputs(loaded.eval(), input_ids=IDS)["logits"]
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * np.abs(before).max())
    assert next(loaded.parameters()).dtype == torch.float32
    # The weights equal what align gives in Python.
    a, b = rj.load_hf(root / "m0"), rj.load_hf(root / "m1")
    body = lambda p: {k: v for k, v in p.items() if k != "head"}
    expected = rj.align(body(a.params), body(b.params), rj.spec_for(b), heads="permute")
    chex.assert_trees_all_close(body(rj.load_hf(out).params), expected.params, atol=1e-6)
    report = json.loads((out / "rotsym_report.json").read_text())
    assert report["command"].startswith("rotsym align") and report["options"]["heads"] == "permute"
    assert report["result"]["after"]["total"] < report["result"]["before"]["total"]
    assert set(report["result"]["layers"]) == {"0", "1"} and report["versions"]["rotsym_jax"]
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front == {"base_model": str(root / "m1"), "tags": ["rotsym_jax", "aligned"]}
    assert "| after |" in card
    assert yaml.safe_load((out / "rotsym_config.yaml").read_text())["options"]["heads"] == "permute"
    # "other" holds the leaves no group moves, an untied LM head with them, and its legend says so (the
    # new-user trial read "task heads left out" as the LM head's), under the table and the card's
    legend = "other the rest (embeddings, norms, output biases, and an untied LM head)"
    out = capsys.readouterr().out
    assert legend in out and legend in card
    # what moved, as the report says it: a line per group (new-user trial: the distances alone did not say)
    moved = report["result"]["moved"]
    assert set(moved) == {"attn", "ffn"} and moved["ffn"]["layers_moved"] == moved["ffn"]["layers"] == 2, moved
    lines = out[out.index("moved, B:\n"):].splitlines()
    assert lines[1] == f"  attn    2/2 layers: {moved['attn']['heads']:.0%} of heads permuted; QK {moved['attn']['qk']:.3g}, VO {moved['attn']['vo']:.3g} " \
        f"from the identity; QK scales {moved['attn']['qk_scale'][0]:.3g} to {moved['attn']['qk_scale'][1]:.3g}; VO scales " \
        f"{moved['attn']['vo_scale'][0]:.3g} to {moved['attn']['vo_scale'][1]:.3g}", lines
    assert lines[2] == f"  ffn     2/2 layers: {moved['ffn']['units']:.0%} of units permuted" and lines[3].startswith("(a map's distance"), lines
    if family == "llama":
        ta, tb = float_tensors(root / "m0"), float_tensors(root / "m1")
        untouched = [n for n in ta if "norm" in n or "embed_tokens" in n or n == "lm_head.weight"]
        assert "lm_head.weight" in untouched
        other = np.sqrt(sum(np.sum(np.square(ta[n] - tb[n], dtype=np.float64)) for n in untouched))
        assert report["result"]["before"]["other"] == pytest.approx(other, rel=1e-5)


def test_align_keeps_b_task_head_of_another_size(bert, tmp_path):
    root, _ = bert
    out = tmp_path / "out"
    assert run("align", root / "m0", root / "five", out, "--ffn", "none", "--layers", "1") == 0
    moved, five = rj.load_hf(out), rj.load_hf(root / "five")
    np.testing.assert_array_equal(moved.params["head"]["classifier"]["kernel"], five.params["head"]["classifier"]["kernel"])
    ids = IDS % 50
    np.testing.assert_allclose(moved.apply(moved.params, input_ids=ids)["logits"], five.apply(five.params, input_ids=ids)["logits"], atol=1e-5)


@pytest.mark.parametrize("family, residual", [("bert", "permutation"), ("llama", "rotation")])
def test_align_residual_moves_the_whole_model_and_keeps_its_function(family, residual, bert, llama, tmp_path):
    """--residual moves B's task head too (it reads the stream), folds RMSNorm gains for a rotation,
    and brings B closer to A than the paper's groups alone."""
    root, models = {"bert": bert, "llama": llama}[family]
    out, paper = tmp_path / "out", tmp_path / "paper"
    assert run("align", root / "m0", root / "m1", out, "--residual", residual) == 0
    assert run("align", root / "m0", root / "m1", paper) == 0
    loaded = type(models[1]).from_pretrained(out).eval()
    before, after = reference_outputs(models[1], input_ids=IDS)["logits"], reference_outputs(loaded, input_ids=IDS)["logits"]
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5 * np.abs(before).max())
    report = json.loads((out / "rotsym_report.json").read_text())
    assert report["options"]["residual"] == residual and report["result"]["residual"]["distance_per_sweep"]
    paper_report = json.loads((paper / "rotsym_report.json").read_text())
    assert report["result"]["after"]["total"] < paper_report["result"]["after"]["total"]
    moved = rj.load_hf(out).params
    if family == "llama":  # folded: every gain that a layer reads is 1
        np.testing.assert_array_equal(flatten(moved)["layers/0/attention_norm/scale"], 1.0)
    else:  # the classifier reads the pooler's output, another space; the pooler reads the stream
        original = rj.load_hf(root / "m1").params
        np.testing.assert_array_equal(moved["head"]["classifier"]["kernel"], original["head"]["classifier"]["kernel"])
        assert not np.array_equal(moved["pooler"]["dense"]["kernel"], original["pooler"]["dense"]["kernel"])


def test_a_run_is_the_same_with_and_without_max_memory_and_its_recipe_replays_it(llama, tmp_path):
    """Every option that ran is in the report and the recipe (the solver's too), in memory and
    streamed alike, with the fallback's choice; the merge recipe written replays the merge."""
    root, _ = llama
    flags = ["--residual", "permutation", "--residual-sweeps", "2", "--polar-method", "svd"]
    assert run("align", root / "m0", root / "m1", tmp_path / "memory", *flags) == 0
    assert run("align", root / "m0", root / "m1", tmp_path / "stream", *flags, "--max-memory", "1G") == 0
    memory, stream = (json.loads((tmp_path / d / "rotsym_report.json").read_text()) for d in ("memory", "stream"))
    assert memory["options"] == stream["options"] and memory["options"]["residual_sweeps"] == 2 and memory["options"]["polar_method"] == "svd"
    assert "streaming" in stream["result"] and "streaming" not in memory["result"]
    for key in ("before", "after", "chosen"):
        assert stream["result"][key] == memory["result"][key], key
    assert memory["result"]["chosen"]["method"] == "weights" and len(memory["result"]["residual"]["distance_per_sweep"]) <= 2
    assert_same_checkpoint(tmp_path / "stream", tmp_path / "memory")
    recipes = [yaml.safe_load((tmp_path / d / "rotsym_config.yaml").read_text()) for d in ("memory", "stream")]
    assert recipes[0]["options"] == recipes[1]["options"] == memory["options"]
    # activation matching streams too: each model whole in turn, the same tensors and choice
    ids = np.random.default_rng(0).integers(0, 50, (6, 8))
    np.savez(tmp_path / "ids.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    data = ["--method", "activations", "--data", tmp_path / "ids.npz", "--batch-size", "2"]
    assert run("align", root / "m0", root / "m1", tmp_path / "act-memory", *data) == 0
    assert run("align", root / "m0", root / "m1", tmp_path / "act-stream", *data, "--max-memory", "2G") == 0
    memory, stream = (json.loads((tmp_path / d / "rotsym_report.json").read_text()) for d in ("act-memory", "act-stream"))
    assert memory["options"] == stream["options"] and stream["options"]["residual"] == "rotation" and "streaming" in stream["result"]
    assert memory["options"]["data"] == {**yaml.safe_load((tmp_path / "act-memory" / "rotsym_config.yaml").read_text())["data"],
                                         "file": str(tmp_path / "ids.npz")}  # the data that ran, in the report too
    assert stream["result"]["after"] == memory["result"]["after"] and stream["result"]["chosen"]["method"] == memory["result"]["chosen"]["method"]
    assert_same_checkpoint(tmp_path / "act-stream", tmp_path / "act-memory")
    recipes = [yaml.safe_load((tmp_path / d / "rotsym_config.yaml").read_text()) for d in ("act-memory", "act-stream")]
    assert recipes[0] == recipes[1] and recipes[0]["data"]["file"] == str(tmp_path / "ids.npz") and recipes[0]["data"]["batch_size"] == 2
    recipe = tmp_path / "from-data.yaml"
    recipe.write_text(yaml.safe_dump({"models": [str(root / "m0"), str(root / "m1")], "method": "average",
                                      "align_options": {"method": "activations"}, "data": {"file": str(tmp_path / "ids.npz"), "batch_size": 2}}))
    assert run("merge", recipe, tmp_path / "merge-memory") == 0
    assert run("merge", recipe, tmp_path / "merge-stream", "--max-memory", "2G") == 0
    memory, stream = (json.loads((tmp_path / d / "rotsym_report.json").read_text())["result"] for d in ("merge-memory", "merge-stream"))
    (aligned,), (expected,) = stream["alignment"]["distances"], memory["alignment"]["distances"]
    assert aligned["after"] == expected["after"] and aligned["chosen"]["method"] == expected["chosen"]["method"] and "streaming" in stream
    assert aligned["moved"] == expected["moved"]  # what the alignment moved, said alike by both merges
    assert_same_checkpoint(tmp_path / "merge-stream", tmp_path / "merge-memory")
    # a merge from statistics says what they were computed on, in memory as streamed (only the streamed report said it)
    fisher = tmp_path / "fisher.yaml"
    fisher.write_text(yaml.safe_dump({"models": [str(root / "m0"), str(root / "m1")], "method": "fisher", "align": "none",
                                      "data": {"file": str(tmp_path / "ids.npz"), "batch_size": 2}}))
    assert run("merge", fisher, tmp_path / "fisher-memory") == 0 and run("merge", fisher, tmp_path / "fisher-stream", "--max-memory", "2G") == 0
    said = [json.loads((tmp_path / d / "rotsym_report.json").read_text())["result"]["statistics"] for d in ("fisher-memory", "fisher-stream")]
    assert said[0] == said[1] == {"method": "fisher", "examples": 6, "kind": "empirical"}
    options = [json.loads((tmp_path / d / "rotsym_report.json").read_text())["options"] for d in ("fisher-memory", "fisher-stream")]
    assert options[0] == options[1] and options[0]["data"]["batch_size"] == 2 and options[0]["task_head"] == "anchor" and options[0]["seed"] == 0
    # the recipe it wrote replays it (it wrote data.count: null, which the recipe's reader refuses)
    assert run("merge", tmp_path / "fisher-memory" / "rotsym_config.yaml", tmp_path / "fisher-replayed") == 0
    assert_same_checkpoint(tmp_path / "fisher-replayed", tmp_path / "fisher-memory")
    # a recipe takes every option too: the merge recipe written by the command replays it
    assert run("merge", "--method", "average", root / "m0", root / "m1", tmp_path / "merged", *flags) == 0
    recipe = yaml.safe_load((tmp_path / "merged" / "rotsym_config.yaml").read_text())
    assert recipe["align_options"]["residual_sweeps"] == 2 and recipe["align_options"]["polar_method"] == "svd"
    assert run("merge", tmp_path / "merged" / "rotsym_config.yaml", tmp_path / "replayed") == 0
    assert_same_checkpoint(tmp_path / "replayed", tmp_path / "merged")
    # streamed, the merge reports its alignment alike, the residual descent's sweeps too (only align's reports had them)
    assert run("merge", "--method", "average", root / "m0", root / "m1", tmp_path / "merged-stream", *flags, "--max-memory", "1G") == 0
    memory, stream = (json.loads((tmp_path / d / "rotsym_report.json").read_text())["result"]["alignment"] for d in ("merged", "merged-stream"))
    assert memory == stream and memory["distances"][0]["residual"]["distance_per_sweep"], memory


def test_a_merge_says_the_fallbacks_choice_in_memory_and_streamed(llama, tmp_path, capsys):
    """A model merged with itself: the fallback keeps the identity, and both runs say so (the
    streamed merge said nothing)."""
    root, _ = llama
    for name, extra in (("memory", []), ("stream", ["--max-memory", "1G"])):
        assert run("merge", "--method", "average", root / "m0", root / "m0", tmp_path / name, *extra) == 0
        assert "model 1: note: kept the identity (B as given)" in capsys.readouterr().err, name


def test_a_recipe_written_with_relative_paths_replays_from_anywhere(llama, tmp_path, monkeypatch):
    """The paths a merge was given relative to the working directory are written relative to the
    recipe's folder, against which a recipe's paths are read: the recipe replays from another
    directory (it named the models as typed, so the replay looked for OUT/m0)."""
    import shutil

    root, _ = llama
    for name in ("m0", "m1"):
        shutil.copytree(root / name, tmp_path / "models" / name)
    np.savez(tmp_path / "models" / "ids.npz", input_ids=np.random.default_rng(0).integers(3, 50, size=(6, 8)))
    monkeypatch.chdir(tmp_path / "models")
    assert run("merge", "--method", "average", "m0", "m1", "../runs/merged", "--quiet") == 0
    recipe = yaml.safe_load((tmp_path / "runs" / "merged" / "rotsym_config.yaml").read_text())
    assert recipe["models"] == ["../../models/m0", "../../models/m1"], recipe
    assert run("align", "m0", "m1", "../runs/aligned", "--method", "activations", "--data", "ids.npz", "--quiet") == 0
    written = yaml.safe_load((tmp_path / "runs" / "aligned" / "rotsym_config.yaml").read_text())
    assert (written["a"], written["b"], written["data"]["file"]) == ("../../models/m0", "../../models/m1", "../../models/ids.npz")
    monkeypatch.chdir(tmp_path)
    assert run("merge", "runs/merged/rotsym_config.yaml", "replayed", "--quiet") == 0
    assert_same_checkpoint(tmp_path / "replayed", tmp_path / "runs" / "merged")
    # the align's recipe replays the align, its data with it (no command read it: rotsym merge refused its key `command`)
    assert run("align", "runs/aligned/rotsym_config.yaml", "realigned", "--quiet") == 0
    assert_same_checkpoint(tmp_path / "realigned", tmp_path / "runs" / "aligned")
    reports = [json.loads((tmp_path / d / "rotsym_report.json").read_text()) for d in ("runs/aligned", "realigned")]
    files = [Path(r["options"]["data"].pop("file")) for r in reports]  # each as its run was given it
    assert reports[0]["options"] == reports[1]["options"] and reports[0]["options"]["method"] == "activations"
    assert (tmp_path / "models" / files[0]).resolve() == (tmp_path / files[1]).resolve() == (tmp_path / "models" / "ids.npz").resolve()
    assert reports[0]["result"]["after"] == reports[1]["result"]["after"]


def test_an_align_recipe_is_replayed_by_align_alone_and_checked_as_a_merge_recipe_is(llama, tmp_path, capsys):
    root, _ = llama
    assert run("align", root / "m0", root / "m1", tmp_path / "aligned", "--heads", "permute", "--quiet") == 0
    recipe = tmp_path / "aligned" / "rotsym_config.yaml"
    for argv, said in ((["align", recipe, tmp_path / "x", "--rescale", "joint"], "--rescale: the recipe names its options"),
                       (["align", recipe, tmp_path / "x", "--dtype", "bfloat16"], "--dtype: the recipe names"),
                       (["merge", recipe, tmp_path / "x"], "the recipe of an align (command: align), which `rotsym align")):
        with pytest.raises(SystemExit):
            run(*argv)
        assert said in capsys.readouterr().err, argv
    written = yaml.safe_load(recipe.read_text())
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**written, "options": {**written["options"], "headz": "permute"}}, sort_keys=False))
    with pytest.raises(SystemExit):
        run("align", bad, tmp_path / "x")
    line = next(i for i, text in enumerate(bad.read_text().splitlines(), 1) if "headz" in text)  # where the file has it (one line per option)
    assert f"line {line}: unknown key options.headz" in capsys.readouterr().err
    bad.write_text(yaml.safe_dump({"models": [str(root / "m0"), str(root / "m1")], "method": "average"}))
    with pytest.raises(SystemExit):
        run("align", bad, tmp_path / "x")
    assert "not the recipe of an align (command: align)" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_recipe_reads_a_hub_id_as_a_hub_id():
    """A model named org/name in a recipe, with no such folder beside the recipe, is a Hub id (it
    was made a path under the recipe's folder, which no download could find)."""
    from rotsym_jax.io import recipe as recipe_mod

    folder = Path(__file__).parent
    assert str(recipe_mod._resolve(folder / "r.yaml", "org-x/model-y", hub=True)) == "org-x/model-y"
    assert recipe_mod._resolve(folder / "r.yaml", "org-x/model-y") == folder / "org-x/model-y"  # a data file is a path
    assert recipe_mod.written_path("org-x/model-y", folder) == "org-x/model-y"


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    """Two Llama models as transformers writes them in bfloat16 (`model.to(torch.bfloat16)`)."""
    root = tmp_path_factory.mktemp("llama_bf16")
    config = tf.LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False)
    for seed in (0, 1):
        save_reference(tf.LlamaForCausalLM, config, root / f"m{seed}", seed=seed).to(torch.bfloat16).save_pretrained(root / f"m{seed}")
    return root


def test_dtype_float32_of_bfloat16_models_is_the_float32_computation(llama_bf16, tmp_path):
    """--dtype float32 on bfloat16 checkpoints writes the alignment and the merge computed in
    float32 (the models read in float32), not their results rounded to bfloat16 first, in memory
    and streamed alike; align takes --dtype as merge does, and its recipe and report record it."""
    root = llama_bf16
    a, b = (rj.load_hf(root / m, dtype=np.float32) for m in ("m0", "m1"))
    moved = rj.align(a.params, b.params, rj.spec_for(a)).params
    expected = {"align": moved, "merge": merge.average([a.params, moved])}
    for command in ("merge", "align"):
        argv = ["align"] if command == "align" else ["merge", "--method", "average"]
        for where, flags in (("memory", []), ("stream", ["--max-memory", "1G"])):
            assert run(*argv, root / "m0", root / "m1", tmp_path / f"{command}-{where}", "--dtype", "float32", *flags) == 0
        written = rj.load_hf(tmp_path / f"{command}-memory")
        assert set(written.stored_dtypes.values()) == {np.dtype(np.float32)}
        # bfloat16 rounding would be ~1e-3 off: the float32 result, to its last bits
        chex.assert_trees_all_close(written.params, expected[command], atol=1e-6, rtol=0)
        assert_same_checkpoint(tmp_path / f"{command}-stream", tmp_path / f"{command}-memory")
        recipe = yaml.safe_load((tmp_path / f"{command}-memory" / "rotsym_config.yaml").read_text())
        assert recipe["dtype"] == "float32", recipe
        for where in ("memory", "stream"):  # and the report, which replays the run with its options
            report = json.loads((tmp_path / f"{command}-{where}" / "rotsym_report.json").read_text())
            assert report["options"]["dtype"] == "float32", report["options"]
    assert run("align", root / "m0", root / "m1", tmp_path / "as-stored") == 0  # without --dtype: B's dtype, as before
    assert set(rj.load_hf(tmp_path / "as-stored").stored_dtypes.values()) == {np.dtype("bfloat16")}


def test_align_dtype_writes_b_moved_in_that_dtype_as_merge_does(llama, tmp_path, capsys):
    """rotsym align --dtype: merge's flag, same meaning (the tensors written in it), in the recipe."""
    root, _ = llama
    assert run("align", root / "m0", root / "m1", tmp_path / "out", "--dtype", "bfloat16") == 0
    a, b = rj.load_hf(root / "m0"), rj.load_hf(root / "m1")
    rj.save_hf(b, rj.align(a.params, b.params, rj.spec_for(a)).params, tmp_path / "python", dtype="bfloat16")
    assert_same_checkpoint(tmp_path / "out", tmp_path / "python")
    assert yaml.safe_load((tmp_path / "out" / "rotsym_config.yaml").read_text())["dtype"] == "bfloat16"
    assert run("align", root / "m0", root / "m1", tmp_path / "plan", "--dtype", "float16", "--dry-run") == 0
    assert "in float16" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run("align", root / "m0", root / "m1", tmp_path / "bad", "--dtype", "int8")
    assert "--dtype: invalid choice: 'int8'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "method, extra",
    [("average", []), ("slerp", ["--param", "t=0.3"]), ("ties", ["--base", "m2", "--param", "density=0.5"]),
     pytest.param("dare", ["--base", "m2", "--param", "drop=0.5", "--seed", "3"], marks=pytest.mark.slow)],
)
def test_merge_equals_the_python_calls(method, extra, llama, tmp_path):
    root, _ = llama
    extra = [str(root / x) if x == "m2" else x for x in extra]
    out = tmp_path / "merged"
    assert run("merge", "--method", method, root / "m0", root / "m1", out, *extra) == 0
    a, b, base = (rj.load_hf(root / m) for m in ("m0", "m1", "m2"))
    b_aligned = rj.align(a.params, b.params, rj.spec_for(a)).params
    inputs = {"base": base.params} if "--base" in extra else {}
    if method == "dare":
        inputs["key"] = jax.random.key(3)
    params = {"slerp": {"t": 0.3}, "ties": {"density": 0.5}, "dare": {"drop": 0.5}}.get(method, {})
    expected = merge.merge(method, [a.params, b_aligned], **inputs, **params)
    chex.assert_trees_all_close(rj.load_hf(out).params, expected, atol=1e-6)
    recipe = yaml.safe_load((out / "rotsym_config.yaml").read_text())
    assert recipe["method"] == method and recipe["models"] == [str(root / "m0"), str(root / "m1")]
    card = (out / "README.md").read_text()
    assert yaml.safe_load(card.split("---")[1])["tags"] == ["merge", "rotsym_jax"]
    assert f"{'An' if method == 'average' else 'A'} {method} merge by rotsym_jax of" in card


def test_merge_align_modes(llama, tmp_path, capsys):
    root, _ = llama
    a, b, c = (rj.load_hf(root / m) for m in ("m0", "m1", "m2"))
    assert run("merge", "--method", "average", "--align", "none", root / "m0", root / "m1", tmp_path / "plain") == 0
    chex.assert_trees_all_close(rj.load_hf(tmp_path / "plain").params, merge.average([a.params, b.params]), atol=1e-6)
    assert run("merge", "--method", "average", "--align", "many", root / "m0", root / "m1", root / "m2", tmp_path / "many") == 0
    many = rj.align_many([a.params, b.params, c.params], rj.spec_for(a))
    chex.assert_trees_all_close(rj.load_hf(tmp_path / "many").params, merge.average(many.params), atol=1e-6)
    report = json.loads((tmp_path / "many" / "rotsym_report.json").read_text())
    assert report["result"]["alignment"]["mode"] == "many" and len(report["result"]["alignment"]["objective"]) >= 2
    f, printed = many.objective, capsys.readouterr().out  # every model moves: the summary says how far F fell
    assert f"F = {float(f[0]):.6g} after the first pass, {float(f[-1]):.6g} after {len(f) - 1} sweep" in printed, printed
    assert "(rejected)" not in printed and cli.commands.STOPS[many.report["stop"]] in printed  # why it stopped, in words


@pytest.mark.parametrize(
    "argv, message",
    [
        (["merge", "--method", "mean", "{m0}", "{m1}", "{out}"], r"method 'mean': unknown; known methods: \['average'"),
        (["merge", "--method", "ties", "{m0}", "{m1}", "{out}"], r"merge method 'ties' needs a base model: the model the others were fine-tuned from \(--base"),
        (["merge", "--method", "average", "--param", "lam=2", "{m0}", "{m1}", "{out}"], r"--param 'lam': .* no such parameter; its parameters: \[\]"),
        (["merge", "--method", "slerp", "--param", "t=1.5", "{m0}", "{m1}", "{out}"], r"t=1.5; t must be a finite number in \[0, 1\]"),
        (["merge", "--method", "slerp", "--param", "t", "{m0}", "{m1}", "{out}"], r"--param 't': expected NAME=VALUE"),
        (["merge", "--method", "fisher", "{m0}", "{m1}", "{out}"], r"merge method 'fisher' needs fishers: statistics from data, .* \(give a recipe with a data section"),
        (["merge", "--method", "average", "{m0}", "{out}"], r"at least two models and the output folder"),
        (["merge", "--method", "average", "{m0}", "{bert}", "{out}"], r"model 1 .* does not have the architecture of the anchor"),
        (["align", "{m0}", "{missing}", "{out}"], r"B: .*no such checkpoint folder"),
        (["align", "{m0}", "{m1}", "{m0}"], r"OUT: "),
        (["align", "{m0}", "{m1}", "{out}", "--layers", "0,x"], r"expected comma-separated layer indices"),
        (["align", "{m0}", "{m1}", "{out}", "--layers", "7"], r"layers \[7\] do not exist"),
        (["align", "{bert}", "{bert1}", "{out}", "--residual", "rotation"], r"bert: residual='rotation' needs a pre-norm model: .*post-LN.* use residual='permutation'"),
    ],
)
def test_command_errors_name_the_problem(argv, message, llama, bert, tmp_path, capsys):
    root = llama[0]
    names = {"m0": root / "m0", "m1": root / "m1", "out": tmp_path / "out", "bert": bert[0] / "m0", "bert1": bert[0] / "m1", "missing": tmp_path / "nothing"}
    with pytest.raises(SystemExit) as e:
        run(*[a.format(**names) for a in argv])
    assert e.value.code == 2
    text = capsys.readouterr().err
    assert re.search(message, text), text
    assert not (tmp_path / "out").exists()


def test_inspect(llama, capsys):
    root, _ = llama
    assert run("inspect", root / "m0") == 0
    text = capsys.readouterr().out
    assert "llama (llama), head lm" in text and "4 heads in 2 kv groups, head_dim 8, RoPE on 8 dims" in text
    assert "permutation 'ffn': 2 layers, 48 units" in text
    assert run("inspect", root / "m0", root / "m1", "--rescale", "none") == 0
    rows = {line.split()[0] + (line.split()[2] if line.startswith("layer") else ""): line for line in capsys.readouterr().out.splitlines()}
    before, after = (float(rows[k].split()[-1]) for k in ("before", "after"))
    assert after < before
    assert "layer" in " ".join(rows)


FAMILY_MODELS = {
    "bert": (tf.BertForSequenceClassification, lambda: tf.BertConfig(**TINY, num_labels=3), {"input_ids": IDS}),
    "roberta": (tf.RobertaForSequenceClassification, lambda: tf.RobertaConfig(**{**TINY, "max_position_embeddings": 20}, num_labels=3), {"input_ids": IDS + 2}),
    "vit": (tf.ViTForImageClassification, lambda: tf.ViTConfig(**{k: v for k, v in TINY.items() if k not in ("vocab_size", "max_position_embeddings")},
                                                               image_size=8, patch_size=2, num_channels=1, num_labels=5),
            {"pixel_values": np.random.default_rng(0).normal(size=(2, 1, 8, 8)).astype(np.float32)}),
    "gpt2": (tf.GPT2LMHeadModel, lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=16), {"input_ids": IDS}),
    "llama": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False), {"input_ids": IDS}),
}


def test_the_executable_ends_with_its_commands_code_and_all_its_output(llama, tmp_path):
    """`python -m rotsym_jax.cli` and the `rotsym` script end the process with os._exit once the
    command returns (no teardown of JAX's backends): the output still comes whole through a pipe,
    the written folder is complete, and the exit code is the command's."""
    root, _ = llama
    command = [sys.executable, "-m", "rotsym_jax.cli", "align", root / "m0", root / "m1", tmp_path / "out"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith(f"wrote {tmp_path / 'out'} (")
    assert json.loads((tmp_path / "out" / "rotsym_report.json").read_text())["result"]["after"]["total"] > 0
    again = subprocess.run(command, capture_output=True, text=True)  # OUT exists: a usage error
    assert again.returncode == 2 and again.stderr.startswith("rotsym align: error: OUT:"), again.stderr


def test_python_dash_m_rotsym_jax_is_the_command():
    """`python -m rotsym_jax` runs `rotsym` (as `python -m rotsym_jax.cli` does)."""
    done = subprocess.run([sys.executable, "-m", "rotsym_jax", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"rotsym_jax {version()}", (done.stdout, done.stderr)


def test_a_reader_that_closed_the_pipe_ends_the_command_quietly(llama):
    """`rotsym inspect A | head -1`: the rest of the output has no reader. The command ends with
    the code of a writer that SIGPIPE ended and no error line (it printed "error: Broken pipe")."""
    import os

    root, _ = llama
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first line
    try:
        done = subprocess.run([sys.executable, "-m", "rotsym_jax.cli", "inspect", root / "m0"], stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


@pytest.mark.slow  # a fresh process per family: imports and compiles from scratch
@pytest.mark.parametrize("family", sorted(FAMILY_MODELS))
def test_rotsym_align_as_a_process_on_every_family(family, tmp_path):
    cls, config, inputs = FAMILY_MODELS[family]
    models = [save_reference(cls, config(), tmp_path / f"m{seed}", seed=seed) for seed in (0, 1)]
    command = [sys.executable, "-m", "rotsym_jax.cli", "align", tmp_path / "m0", tmp_path / "m1", tmp_path / "out", "--heads", "permute"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    loaded, info = cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    before = reference_outputs(models[1], **inputs)["logits"]
    np.testing.assert_allclose(reference_outputs(loaded.eval(), **inputs)["logits"], before, rtol=1e-5, atol=1e-5 * np.abs(before).max())
    report = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())
    assert report["result"]["after"]["total"] < report["result"]["before"]["total"]
    version = subprocess.run([sys.executable, "-m", "rotsym_jax.cli", "--version"], capture_output=True, text=True)
    assert version.stdout.startswith("rotsym_jax ")


WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(5, 50)]


@pytest.fixture(scope="module")
def texts(bert, tmp_path_factory):
    """A tokenizer in the anchor's folder, and a JSONL of labelled texts."""
    root, _ = bert
    vocab = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab.write_text("\n".join(WORDS) + "\n")
    tf.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(root / "m0")
    rng = np.random.default_rng(0)
    lines = [json.dumps({"text": " ".join(f"w{i}" for i in rng.integers(5, 50, size=rng.integers(3, 9))), "label": int(rng.integers(0, 3))}) for _ in range(10)]
    data = root / "texts.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return data


def _recipe(folder, **fields):
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(fields, sort_keys=False))
    return path


# Fisher (per-example gradients, 15 s) in the slow suite; RegMean covers the data path by default.
@pytest.mark.parametrize("method, params", [pytest.param("fisher", {}, marks=pytest.mark.slow), ("regmean", {"alpha": 0.9})])
def test_recipe_merge_with_data_equals_the_python_steps(method, params, bert, texts, tmp_path):
    root, _ = bert
    data = {"file": str(texts), "batch_size": 4, "max_length": 12}
    recipe = _recipe(tmp_path, models=[str(root / "m0"), str(root / "m1")], method=method, params=params, data=data)
    assert run("merge", recipe, tmp_path / "out") == 0
    a, b = rj.load_hf(root / "m0"), rj.load_hf(root / "m1")
    body = lambda p: {k: v for k, v in p.items() if k != "head"}
    own = rj.align(body(a.params), body(b.params), rj.spec_for(b))
    moved = {**own.params, "head": b.params["head"]}
    rows = [json.loads(line) for line in texts.read_text().splitlines()]
    enc = tf.AutoTokenizer.from_pretrained(root / "m0")([r["text"] for r in rows], padding="max_length", truncation=True, max_length=12, return_tensors="np")
    columns = {**{k: np.asarray(v, np.int32) for k, v in enc.items()}, "labels": np.asarray([r["label"] for r in rows], np.int32)}
    batches = [{k: v[i : i + 4] for k, v in columns.items()} for i in range(0, 10, 4)]
    if method == "fisher":
        expected = merge.fisher([a.params, moved], [rj.stats.fisher(ck, p, batches) for ck, p in ((a, a.params), (b, moved))])
    else:
        expected = merge.regmean([a.params, moved], [rj.stats.grams(ck, p, batches) for ck, p in ((a, a.params), (b, moved))], alpha=0.9)
    chex.assert_trees_all_close(rj.load_hf(tmp_path / "out").params, expected, atol=1e-6)
    written = yaml.safe_load((tmp_path / "out" / "rotsym_config.yaml").read_text())
    assert written["method"] == method and (tmp_path / "out" / written["data"]["file"]).resolve() == texts.resolve() and written["align_options"]["heads"] == "fixed"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"models": ["{m0}", "{m1}"], "method": "average", "colour": "red"}, r"line 5: unknown key colour; known keys: \['align'"),
        ({"models": ["{m0}", "{m1}"], "method": "average", "align": "all"}, r"line 5: align = 'all'; expected one of \('none', 'anchor', 'many'\)"),
        ({"models": ["{m0}", "{m1}"], "method": "average", "align_options": {"heads": "some"}}, r"line 6: align_options.heads = 'some'"),
        ({"models": ["{m0}"], "method": "average"}, r"line 1: models = .*; expected a list of at least two paths"),
        ({"method": "average"}, r"the key 'models' is missing"),
        ({"models": ["{m0}", "{m1}"], "method": "fisher", "data": {"file": "nothing.jsonl"}}, r"line 6: data.file .*nothing.jsonl does not exist"),
        ({"models": ["{m0}", "{m1}"], "method": "fisher"}, r"merge method 'fisher' needs fishers: statistics from data"),
        ({"models": ["{m0}", "{m1}"], "method": "ties", "params": {"density": 2}}, r"density=2; density must be a finite number in \(0, 1\]"),
    ],
)
def test_recipe_errors_name_the_key_and_line(fields, message, bert, tmp_path, capsys):
    root, _ = bert
    names = {"m0": str(root / "m0"), "m1": str(root / "m1")}
    fill = lambda v: [x.format(**names) for x in v] if isinstance(v, list) else v
    recipe = _recipe(tmp_path, **{k: fill(v) for k, v in fields.items()})
    with pytest.raises(SystemExit):
        run("merge", recipe, tmp_path / "out")
    text = capsys.readouterr().err
    assert re.search(message, text), text
    assert not (tmp_path / "out").exists()


def test_dry_run_reads_no_weights_and_writes_nothing(llama, tmp_path, capsys, monkeypatch):
    root, _ = llama

    def no_weights(self, name):
        raise AssertionError(f"a dry run read the weights of {name}")

    monkeypatch.setattr(rj.hf.TensorFiles, "get", no_weights)
    assert run("align", root / "m0", root / "m1", tmp_path / "out", "--dry-run") == 0
    assert run("merge", "--method", "ties", root / "m0", root / "m1", tmp_path / "out", "--base", root / "m2", "--dry-run") == 0
    text = capsys.readouterr().out
    assert "align" in text and "merge 2 llama models by ties {'density': 0.2, 'lam': 1.0}" in text and text.count("memory estimate:") == 2
    assert "the runtime + the models + the base + the aligned" in text
    # what the estimate counts is what the run holds: no base, no alignment, one layer
    assert run("merge", "--method", "average", root / "m0", root / "m1", tmp_path / "out", "--align", "none", "--dry-run") == 0
    text = capsys.readouterr().out
    assert "by average (alignment: none)" in text and "(the runtime + the models + the merge in float32)" in text, text
    assert run("merge", "--method", "average", root / "m0", root / "m1", tmp_path / "out", "--max-memory", "1G", "--dry-run") == 0
    assert re.search(r"streaming, (1 layer|\d+ layers) at a time", capsys.readouterr().out)
    assert not (tmp_path / "out").exists()
    with pytest.raises(AssertionError, match="a dry run read the weights"):  # the check above can fail
        run("align", root / "m0", root / "m1", tmp_path / "out")


def test_a_hub_id_is_read_from_the_local_cache_offline(llama, tmp_path, monkeypatch, capsys):
    """org/name resolves to its snapshot in the Hugging Face cache; an id in no cache is a clear error."""
    import shutil

    import huggingface_hub.constants as hub

    root, _ = llama
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny--llama"
    shutil.copytree(root / "m1", repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    assert run("align", root / "m0", "tiny/llama", tmp_path / "out") == 0
    a, b = rj.load_hf(root / "m0"), rj.load_hf(root / "m1")
    chex.assert_trees_all_close(rj.load_hf(tmp_path / "out").params, rj.align(a.params, b.params, rj.spec_for(b)).params, atol=1e-6)
    with pytest.raises(SystemExit):
        run("inspect", "nobody/nothing")
    assert "nobody/nothing is neither a folder nor a Hugging Face Hub id" in capsys.readouterr().err


def test_progress_on_a_terminal_and_quiet(llama, tmp_path, monkeypatch, capsys):
    root, _ = llama
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert run("align", root / "m0", root / "m1", tmp_path / "one", "--ffn", "none") == 0
    captured = capsys.readouterr()
    assert "align" in captured.err and "saving" in captured.err and "wrote" in captured.out
    assert run("align", root / "m0", root / "m1", tmp_path / "two", "--ffn", "none", "--quiet") == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    # merge: a bar per step (each model loaded) and one inside the alignment step, per model.
    argv = ["merge", "--method", "average", "--ffn", "none", root / "m0", root / "m1", root / "m2"]
    assert run(*argv, tmp_path / "three") == 0
    err = capsys.readouterr().err
    assert all(step in err for step in ("loading model", "alignment: anchor", "aligning to the anchor", "0/2", "saving")), err
    assert run(argv[0], "--quiet", *argv[1:], tmp_path / "four") == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_recipe_loss_is_transformers_cross_entropy(bert, texts, llama):
    """The loss of `rotsym barrier` against transformers' own loss (PyTorch), classification and causal LM."""
    root, models = bert
    a = rj.load_hf(root / "m0")
    batches = rj.recipe.batches(rj.recipe.Data(texts, batch_size=10, max_length=12), a)
    inputs = {k: torch.as_tensor(v).long() for k, v in batches[0].items()}
    with torch.no_grad():
        expected = models[0](**inputs).loss.item()
    assert float(rj.recipe.loss_fn(a, batches)(a.params)) == pytest.approx(expected, rel=1e-5)
    root, lms = llama
    lm = rj.load_hf(root / "m0")
    ids = np.asarray(IDS, np.int32)
    labels = np.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]  # the library scores position t on token t + 1
    with torch.no_grad():
        expected = lms[0](input_ids=torch.as_tensor(ids).long(), labels=torch.as_tensor(ids).long()).loss.item()  # transformers shifts itself
    assert float(rj.recipe.loss_fn(lm, [{"input_ids": ids, "labels": labels}])(lm.params)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow  # 16 s: four loss curves
def test_barrier_command_equals_the_python_barrier(bert, texts, tmp_path, capsys):
    root, _ = bert
    out = tmp_path / "curves"
    assert run("barrier", root / "m0", root / "m1", "--data", texts, "--out", out, "--points", "5", "--max-length", "12", "--batch-size", "4") == 0
    report = json.loads((out / "barrier.json").read_text())
    assert (out / "barrier.png").stat().st_size > 0
    a, b = rj.load_hf(root / "m0"), rj.load_hf(root / "m1")
    batches = rj.recipe.batches(rj.recipe.Data(texts, batch_size=4, max_length=12), a)
    loss = rj.recipe.loss_fn(a, batches)
    plain = rj.barrier.loss_barrier(loss, a.params, b.params, np.linspace(0, 1, 5))
    assert report["result"]["plain"]["barrier"] == pytest.approx(plain["barrier"], rel=1e-5, abs=1e-6)
    body = lambda p: {k: v for k, v in p.items() if k != "head"}
    own = rj.align(body(a.params), body(b.params), rj.spec_for(b))
    moved = {**own.params, "head": b.params["head"]}
    aligned = rj.barrier.loss_barrier(loss, a.params, moved, np.linspace(0, 1, 5))
    np.testing.assert_allclose(report["result"]["aligned"]["curve"]["loss"], aligned["curve"]["loss"], rtol=1e-5)
    # The ends are the models' own losses, computed independently of the path.
    logits = a.apply(a.params, **{k: v for k, v in batches[0].items() if k != "labels"})["logits"]
    assert np.isfinite(np.asarray(logits)).all() and report["result"]["plain"]["curve"]["loss"][0] == pytest.approx(float(loss(a.params)), rel=1e-5)
    said = capsys.readouterr().out
    assert "plain    barrier" in said
    # what the alignment moved, as `align` reports it: B's transforms to A, recorded and printed
    assert report["result"]["aligned"]["moved"] == json.loads(json.dumps(own.report["moved"])) and "moved" not in report["result"]["plain"]
    assert "moved, B, aligned:\n" in said and said.count("moved, B") == 1, said


def test_the_command_line_starts_without_jax():
    """`rotsym --help` answers before JAX is imported: the package's names load on first use."""
    code = "import sys, rotsym_jax, rotsym_jax.cli; print(sorted(m for m in ('jax', 'flax', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    done = subprocess.run([sys.executable, "-m", "rotsym_jax.cli", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "{demo,align,merge,barrier,inspect,extract-lora,moe,convert-config}" in done.stdout
    assert callable(rj.align) and rj.align.__module__ == "rotsym_jax.engine.alignment"


def test_checkpoints_are_read_merged_and_written_without_torch(llama, tmp_path):
    """Loading (with and without weights), spec_for, aligning, merging, saving and inspecting import
    neither PyTorch nor transformers (seconds of imports; config.json is read by rotsym_jax itself),
    nor orbax.checkpoint (0.2 s) where no Orbax checkpoint is read or written, nor Flax and optax
    (0.6 s) where no data flows through a model, nor SciPy's optimize (0.3 s), whose assignment
    solver only the experts and float64 scores need (lapx, a dependency, solves the rest)."""
    root, _ = llama
    out, again, aligned = tmp_path / "out", tmp_path / "again", tmp_path / "aligned"
    code = f"""
import sys
import rotsym_jax as rj
from rotsym_jax import cli
assert cli.main(["merge", "--method", "ties", "{root / 'm1'}", "{root / 'm2'}", "{out}", "--base", "{root / 'm0'}", "--align", "none", "--quiet"]) == 0
ck = rj.load_hf("{out}")
rj.spec_for(ck)
rj.load_hf("{out}", weights=False)
rj.save_hf(ck, ck.params, "{again}")
assert cli.main(["inspect", "{again}"]) == 0
assert cli.main(["align", "{root / 'm1'}", "{root / 'm2'}", "{aligned}", "--quiet"]) == 0
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "flax", "optax") or m in ("orbax.checkpoint", "scipy.optimize")))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]  # nor Orbax for Hugging Face folders, nor Flax
    # What it wrote loads in transformers (here, where transformers is imported).
    assert isinstance(rj.load_hf(again).config, tf.LlamaConfig)
    model, info = tf.LlamaForCausalLM.from_pretrained(again, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_the_command_line_runs_the_library_pipeline(llama, tmp_path):
    """`rotsym merge` and `rj.merge_checkpoints` write the same weights; the library's refusals are
    PipelineErrors (no exit), its notes go to the caller's Progress, and a dry run returns the plan."""
    root, _ = llama
    a, b, base = (root / f"m{seed}" for seed in (0, 1, 2))
    assert run("merge", "--method", "ties", "--base", base, "--param", "density=0.5", a, b, tmp_path / "cli") == 0
    recipe = rj.recipe.Recipe(models=(str(a), str(b)), method="ties", params={"density": 0.5}, base=str(base))
    written = rj.merge_checkpoints(recipe, tmp_path / "library")
    assert Path(written.path).resolve() == (tmp_path / "library").resolve()
    assert_same_checkpoint(tmp_path / "library", tmp_path / "cli")
    assert written.report["options"]["method"] == "ties" and [label for label, _ in written.rows][-1] == "merged, to the anchor"

    class Notes(rj.pipeline.Progress):
        def __init__(self):
            self.notes = []

        def note(self, text):
            self.notes.append(text)

    notes = Notes()
    plan = rj.align_checkpoints(a, b, tmp_path / "dry", {"residual": "permutation"}, dry_run=True, progress=notes)
    assert isinstance(plan, rj.pipeline.DryRun) and plan.estimate > 0 and not (tmp_path / "dry").exists()
    assert notes.notes == []  # a Llama LM has a head: nothing to note
    with pytest.raises(rj.pipeline.PipelineError, match="OUT: .*exists"):
        rj.align_checkpoints(a, b, tmp_path / "library")
    with pytest.raises(rj.pipeline.PipelineError, match="unknown align options"):
        rj.align_checkpoints(a, b, tmp_path / "other", {"rescal": "joint"})
    # how a call runs: a RunOptions, or its fields as keywords over it; the same dry run either way
    dry = rj.RunOptions(dry_run=True, progress=notes)
    assert rj.align_checkpoints(a, b, tmp_path / "dry", {"residual": "permutation"}, run=dry) == plan
    assert rj.align_checkpoints(a, b, tmp_path / "dry", {"residual": "permutation"}, run=rj.RunOptions(), dry_run=True) == plan
    with pytest.raises(rj.pipeline.PipelineError, match=r"unknown keywords \['dryrun'\]; the run options are \['overwrite', 'max_memory'"):
        rj.align_checkpoints(a, b, tmp_path / "dry", dryrun=True)
    with pytest.raises(rj.pipeline.PipelineError, match="run is a dict; expected a rotsym_jax.pipeline.RunOptions"):
        rj.merge_checkpoints(rj.recipe.Recipe(models=(a, b), method="average"), tmp_path / "dry", run={"dry_run": True})
    with pytest.raises(rj.pipeline.PipelineError, match="format='gguf'; choose one of"):
        rj.RunOptions(format="gguf")



def test_a_bad_pair_of_options_is_a_usage_error(llama, tmp_path, capsys):
    """AlignOptions' joint check, from every command that aligns: one line, exit 2, nothing printed first."""
    root, _ = llama
    a, b = root / "m0", root / "m1"
    for argv in (["align", a, b, tmp_path / "o"], ["merge", "--method", "average", a, b, tmp_path / "o"], ["inspect", a, b]):
        with pytest.raises(SystemExit) as exit_info:
            run(*argv, "--rescale", "joint", "--attention", "none")
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert "rescale='joint' optimises over rotations" in captured.err and captured.out == "", argv


def test_a_recipe_is_checked_when_it_is_built(llama, tmp_path):
    root, _ = llama
    a, b = str(root / "m0"), str(root / "m1")
    for bad, match in (({"align": "bogus"}, "align='bogus'"), ({"task_head": "x"}, "task_head='x'"), ({"dtype": "int8"}, "dtype='int8'")):
        with pytest.raises(rj.recipe.RecipeError, match=match):
            rj.recipe.Recipe(models=(a, b), method="average", **bad)
    with pytest.raises(rj.recipe.RecipeError, match="at least two"):
        rj.recipe.Recipe(models=a, method="average")  # a string, not a list
    assert rj.recipe.Recipe(models=[a, b], method="average").models == (a, b)
    with pytest.raises(rj.pipeline.PipelineError, match="max_memory='2G'"):
        rj.merge_checkpoints(rj.recipe.Recipe(models=(a, b), method="average"), tmp_path / "m", max_memory="2G")


def test_every_pipeline_report_has_the_timings(llama, tmp_path):
    """The in-memory pipelines' reports time every phase, as `align` and the streamed runs do."""
    root, _ = llama
    a, b = str(root / "m0"), str(root / "m1")
    merged = rj.merge_checkpoints(rj.recipe.Recipe(models=(a, b), method="average"), tmp_path / "m")
    aligned = rj.align_checkpoints(a, b, tmp_path / "a")
    for written in (merged, aligned):
        timings = written.report["result"]["timings"]
        assert list(timings) == list(rj.timings.TIMINGS), timings
        assert timings["read"] > 0 and timings["write"] > 0 and timings["solve"] > 0, timings
        assert json.loads((written.path / "rotsym_report.json").read_text())["result"]["timings"] == timings
    assert merged.report["result"]["timings"]["merge"] > 0


def test_the_distance_table_keeps_large_numbers_apart(capsys):
    """A broken merge's distances (the new-user trial's 186437.6515) ran into their neighbours."""
    from rotsym_jax.cli import commands

    commands._print_table([("before", {"qk": 1.5, "total": 2.0}), ("merged", {"qk": 11742.4197, "ffn": 186437.6515, "total": 186886.1175})])
    header, before, merged = capsys.readouterr().out.splitlines()[:3]
    assert merged.split()[1:] == ["11742.4197", "186437.6515", "186886.1175"] and before.split()[1:] == ["1.5000", "2.0000"]
    assert len({len(header), len(before.rstrip()), len(merged)}) == 1  # every column under its heading
    # the legend explains the columns shown: a mixture's "moe" (its legend spoke of "ffn", which it has not)
    commands._print_table([("before", {"qk": 1.0, "moe": 2.0, "total": 3.0})])
    legend = capsys.readouterr().out.splitlines()[-1]
    assert "moe the experts and their router" in legend and "ffn" not in legend and "other" not in legend, legend


def test_a_base_other_than_the_anchor_is_said_to_stay_as_stored(llama, tmp_path, capsys):
    """--base is never aligned unless it is model 0, the anchor (new-user trial: task vectors from a
    base in another frame): a merge says so, and says nothing where the base is the anchor."""
    root, _ = llama
    for base, said in (("m1", True), ("m0", False)):
        assert run("merge", "--method", "task_arithmetic", root / "m0", root / "m1", tmp_path / base, "--base", root / base) == 0
        err = capsys.readouterr().err
        assert ("the base" in err and "is not aligned" in err) == said, err
