"""Orbax checkpoints in and out (`rj.save_orbax`, `rj.load_orbax`, `rj.save_config`) and the
`rotsym` commands on them: round trips bit-exact against `load_hf`, transformers reloading what
was converted, CheckpointManager runs (their latest step, `--step`, `--last K` averages), and the
same refusals as Hugging Face folders."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import transformers as tf
from checkpoint_utils import assert_same_checkpoint
from parity_utils import reference_outputs, save_reference

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.io import orbax as orbax_mod
from rotsym_jax.io._publish import MANIFEST
from rotsym_jax.pytree import flatten, unflatten

TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, max_position_embeddings=16)
IDS = (np.arange(16).reshape(2, 8) * 7 + 3) % 50
MODELS = {
    "bert-cls": (tf.BertForSequenceClassification, lambda: tf.BertConfig(**TINY, num_labels=3)),
    "bert-base": (tf.BertModel, lambda: tf.BertConfig(**TINY)),
    "roberta-tokens": (tf.RobertaForTokenClassification, lambda: tf.RobertaConfig(**TINY, num_labels=4, pad_token_id=1)),
    "gpt2-lm": (tf.GPT2LMHeadModel, lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=16)),
    "llama-lm": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False)),
    "vit-cls": (tf.ViTForImageClassification, lambda: tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                                                  image_size=8, patch_size=2, num_channels=1, num_labels=3)),
}


def run(*argv) -> int:
    return cli.main([str(a) for a in argv])


def same_params(a, b) -> bool:
    fa, fb = flatten(a), flatten(b)
    return fa.keys() == fb.keys() and all(np.asarray(fa[k]).dtype == np.asarray(fb[k]).dtype and np.array_equal(np.asarray(fa[k]), np.asarray(fb[k])) for k in fa)


def inputs_for(name):
    if name.startswith("vit"):
        return {"pixel_values": np.random.default_rng(0).normal(size=(2, 1, 8, 8)).astype(np.float32)}
    return {"input_ids": IDS}


@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_is_bit_exact_and_transformers_reloads_it(name, tmp_path):
    cls, config = MODELS[name]
    model = save_reference(cls, config(), tmp_path / "hf", seed=0)
    (tmp_path / "hf" / "tokenizer_config.json").write_text("{}")
    ck = rj.load_hf(tmp_path / "hf")
    out = rj.save_orbax(ck, ck.params, tmp_path / "orbax")
    assert sorted(os.listdir(out)) == sorted([MANIFEST, "config.json", "params", *(f for f in os.listdir(tmp_path / "hf") if f not in ("config.json", "model.safetensors"))])
    assert "tokenizer_config.json" in os.listdir(out)
    back = rj.load_orbax(out)
    assert (back.family, back.model_config, back.layout, dict(back.stored_dtypes)) == (ck.family, ck.model_config, ck.layout, dict(ck.stored_dtypes))
    assert same_params(back.params, ck.params)
    # Orbax -> Hugging Face gives the folder save_hf writes from the original, bit for bit.
    rj.save_hf(ck, ck.params, tmp_path / "direct")
    rj.save_hf(back, back.params, tmp_path / "converted")
    assert_same_checkpoint(tmp_path / "converted", tmp_path / "direct")
    loaded, info = cls.from_pretrained(tmp_path / "converted", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    want = reference_outputs(model, **inputs_for(name))
    got = reference_outputs(loaded.eval(), **inputs_for(name))
    key = "logits" if "logits" in want else "last_hidden_state"
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5 * np.abs(want[key]).max())


def test_low_precision_leaves_keep_their_dtype(tmp_path):
    cls, config = MODELS["llama-lm"]
    save_reference(cls, config(), tmp_path / "hf", seed=0)
    ck = rj.load_hf(tmp_path / "hf")
    out = rj.save_orbax(ck, ck.params, tmp_path / "bf16", dtype="bfloat16")
    back = rj.load_orbax(out)
    assert {np.dtype(d) for d in back.stored_dtypes.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    want = {p: np.asarray(x).astype(ml_dtypes.bfloat16) for p, x in flatten(ck.params).items()}
    assert same_params(back.params, want)
    shapes_only = rj.load_orbax(out, weights=False)
    assert {p: (x.shape, x.dtype) for p, x in flatten(shapes_only.params).items()} == {p: (x.shape, x.dtype) for p, x in flatten(back.params).items()}


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    cls, config = MODELS["bert-cls"]
    for seed in (0, 1):
        save_reference(cls, config(), root / f"m{seed}", seed=seed)
    return root


def test_refusals_name_the_problem(bert, tmp_path):
    ck = rj.load_hf(bert / "m0")
    out = rj.save_orbax(ck, ck.params, tmp_path / "ok")
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        rj.save_orbax(ck, ck.params, out)
    rj.save_orbax(ck, ck.params, out, overwrite=True)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        rj.save_orbax(ck, ck.params, tmp_path / "plain", overwrite=True)
    with pytest.raises(rj.CheckpointError, match="neither an Orbax checkpoint"):
        rj.load_orbax(tmp_path / "plain")
    # no config.json
    no_config = tmp_path / "no-config"
    rj.save_orbax(ck, ck.params, no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json beside the Orbax checkpoint"):
        rj.load_orbax(no_config)
    # a config that does not describe the weights
    wrong = tmp_path / "wrong"
    rj.save_orbax(ck, ck.params, wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(rj.CheckpointError, match=r"do not match the bert model of config.json.*intermediate.*\(32, 48\) \(expected \(32, 64\)\)"):
        rj.load_orbax(wrong)
    # non-finite weights: refused on save and on load (unless allowed)
    flat = flatten(ck.params)
    path = next(p for p in flat if p.endswith("kernel"))
    bad = unflatten({**flat, path: flat[path].at[0, 0].set(jnp.nan)})
    with pytest.raises(rj.CheckpointError, match=f"non-finite values.*{path}"):
        rj.save_orbax(ck, bad, tmp_path / "nan")
    rj.save_orbax(ck, bad, tmp_path / "nan", allow_nonfinite=True)
    with pytest.raises(rj.CheckpointError, match=f"non-finite values.*{path}"):
        rj.load_orbax(tmp_path / "nan")
    with pytest.warns(UserWarning, match="non-finite"):
        rj.load_orbax(tmp_path / "nan", allow_nonfinite=True)
    # params of another model
    with pytest.raises(rj.CheckpointError, match="missing leaves"):
        rj.save_orbax(ck, {"embeddings": ck.params["embeddings"]}, tmp_path / "partial")


def test_a_failed_write_leaves_the_old_checkpoint_and_nothing_else(bert, tmp_path, monkeypatch):
    ck = rj.load_hf(bert / "m0")
    old = rj.save_orbax(ck, ck.params, tmp_path / "out")
    before = sorted(os.listdir(tmp_path))

    def fail(*args, **kwargs):
        raise OSError("injected failure while Orbax writes")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", fail)
    with pytest.raises(OSError, match="injected"):
        rj.save_orbax(ck, jax.tree.map(lambda x: x + 1, ck.params), old, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == before
    assert same_params(rj.load_orbax(old).params, ck.params)


@pytest.fixture(scope="module")
def run_dir(bert, tmp_path_factory):
    """A training run as JAX code keeps it: a CheckpointManager saving params and Adam's state
    every step of 4, the model's config.json at its root (save_config)."""
    root = tmp_path_factory.mktemp("run") / "run"
    ck = rj.load_hf(bert / "m0")
    rj.save_config(ck, root)
    opt = optax.adam(1e-2)
    params, state = ck.params, opt.init(ck.params)
    saved = {}
    manager = ocp.CheckpointManager(root.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=4), item_names=("params", "opt_state"))
    for step in range(1, 6):
        grads = jax.tree.map(lambda x, step=step: jnp.full_like(x, 0.1 * step), params)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(state)))
        saved[step] = params
    manager.wait_until_finished()
    manager.close()
    return root, ck, saved


def test_a_run_reads_its_latest_step_or_any_step(run_dir):
    root, ck, saved = run_dir
    assert orbax_mod.steps(root) == [2, 3, 4, 5]
    assert same_params(rj.load_orbax(root).params, saved[5])
    assert same_params(rj.load_orbax(root, step=3).params, saved[3])
    assert same_params(rj.load_orbax(root / "4").params, saved[4])  # a step folder, config.json from the run
    assert rj.load_orbax(root).layout == ck.layout
    with pytest.raises(rj.CheckpointError, match="no step 1; the run has steps 2, 3, 4, 5"):
        rj.load_orbax(root, step=1)


def test_commands_read_runs_and_write_orbax(run_dir, bert, tmp_path, capsys):
    root, ck, saved = run_dir
    # --last K: the average of the last K steps (unaligned), oldest first; --weights weigh them
    assert run("merge", "--method", "average", root, tmp_path / "avg", "--last", "3", "--quiet") == 0
    got = rj.load_hf(tmp_path / "avg").params
    want = rj.merge.average([saved[3], saved[4], saved[5]], task_head="merge")  # the task head averaged too
    assert not np.allclose(np.asarray(saved[3]["head"]["classifier"]["kernel"]), np.asarray(want["head"]["classifier"]["kernel"]))
    assert all(np.allclose(np.asarray(flatten(got)[p]), np.asarray(x), atol=1e-7) for p, x in flatten(want).items())
    report = json.loads((tmp_path / "avg" / "rotsym_report.json").read_text())
    assert report["options"]["align"] == "none"
    assert [report["inputs"][f"model {i}"]["path"] for i in range(3)] == [str(root / str(s)) for s in (3, 4, 5)]
    assert sorted(os.listdir(tmp_path / "avg")) == sorted([MANIFEST, "README.md", "config.json", "model.safetensors", "rotsym_config.yaml",
                                                        "rotsym_report.json"])
    assert run("merge", "--method", "average", root, tmp_path / "weighted", "--last", "2", "--weights", "1,3", "--format", "orbax", "--quiet") == 0
    weighted = rj.load_orbax(tmp_path / "weighted")
    want = rj.merge.average([saved[4], saved[5]], [1, 3], task_head="merge")
    assert all(np.allclose(np.asarray(flatten(weighted.params)[p]), np.asarray(x), atol=1e-7) for p, x in flatten(want).items())
    assert (tmp_path / "weighted" / "rotsym_report.json").is_file() and (tmp_path / "weighted" / "README.md").is_file()
    # align: a run's step against a Hugging Face folder, written as Orbax; the same params as written as HF
    assert run("align", bert / "m1", root, tmp_path / "aligned-orbax", "--step", "2", "--format", "orbax", "--quiet") == 0
    assert run("align", bert / "m1", root / "2", tmp_path / "aligned-hf", "--quiet") == 0
    assert same_params(rj.load_orbax(tmp_path / "aligned-orbax").params, rj.load_hf(tmp_path / "aligned-hf").params)
    assert run("inspect", tmp_path / "aligned-orbax") == 0
    assert "bert (bert), head sequence_classification" in capsys.readouterr().out


def test_orbax_inputs_stream_as_hugging_face_folders_do(run_dir, bert, tmp_path):
    """A training run's steps read tensor by tensor (Orbax's partial restore) by a streamed align
    and merge: the tensors and the report's distances of the run in memory."""
    root, _, _ = run_dir
    for argv, name in ((["align", bert / "m1", root, "{out}", "--residual", "permutation"], "align"),
                       (["merge", "--method", "average", root, "{out}", "--last", "2", "--align", "anchor"], "merge")):
        for streamed in (False, True):
            out = tmp_path / f"{name}-{'stream' if streamed else 'memory'}"
            assert run(*[out if a == "{out}" else a for a in argv], *(["--max-memory", "1G"] if streamed else []), "--quiet") == 0
        memory, stream = (json.loads((tmp_path / f"{name}-{kind}" / "rotsym_report.json").read_text())["result"] for kind in ("memory", "stream"))
        assert "streaming" in stream and "streaming" not in memory
        if name == "align":
            assert stream["after"] == memory["after"] and stream["chosen"] == memory["chosen"]
        else:
            assert stream["alignment"]["distances"][0]["after"] == memory["alignment"]["distances"][0]["after"]
        moved, want = rj.load_hf(tmp_path / f"{name}-stream").params, rj.load_hf(tmp_path / f"{name}-memory").params
        assert all(np.array_equal(np.asarray(x), np.asarray(flatten(want)[p])) for p, x in flatten(moved).items()), name


@pytest.mark.parametrize("argv,message", [
    (["merge", "--method", "average", "{run}", "{out}", "--last", "9"], "--last 9: .* has 4 steps"),
    (["merge", "--method", "average", "{m0}", "{out}", "--last", "2"], "is not an Orbax training run"),
    (["merge", "--method", "slerp", "{run}", "{out}", "--last", "2", "--weights", "1,2"], r"'slerp' does not use weights \(--weights, .*\): it takes no other"),
    (["merge", "--method", "average", "{run}", "{out}", "--last", "2", "--weights", "1,2,3"], "one positive number per model"),
    (["align", "{m0}", "{m1}", "{out}", "--step", "3"], "--step 3: none of the inputs is an Orbax training run"),
    (["align", "{m0}", "{run}", "{out}", "--step", "7"], "no step 7; the run has steps 2, 3, 4, 5"),
    (["align", "{m0}", "{m1}", "{out}", "--max-memory", "1G", "--format", "orbax"], "--format orbax writes the params whole"),
    (["align", "{m0}", "{m1}", "{run}/99", "--format", "orbax"], "would become step 99 of the Orbax training run"),
    (["merge", "{recipe}", "{out}", "--task-head", "merge"], "--task-head: a recipe names its models, weights, alignment and seed itself"),
])
def test_command_refusals(argv, message, run_dir, bert, tmp_path, capsys):
    root, _, _ = run_dir
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"models: [{bert / 'm0'}, {bert / 'm1'}]\nmethod: average\n")
    names = {"run": root, "out": tmp_path / "out", "m0": bert / "m0", "m1": bert / "m1", "recipe": recipe}
    with pytest.raises(SystemExit) as e:
        run(*[a.format(**{k: str(v) for k, v in names.items()}) for a in argv])
    assert e.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists() and not (root / "99").exists()


def test_save_config_writes_what_load_reads(bert, tmp_path):
    ck = rj.load_hf(bert / "m0")
    path = rj.save_config(ck, tmp_path / "new-run")
    assert json.loads(path.read_text())["architectures"] == ["BertForSequenceClassification"]
    assert sorted(os.listdir(tmp_path / "new-run")) == ["config.json"]
    assert Path(path).parent == tmp_path / "new-run"


def test_barrier_dry_run_and_recipes_take_orbax_inputs(run_dir, bert, tmp_path, capsys):
    root, ck, saved = run_dir
    data = tmp_path / "tokens.npz"
    np.savez(data, input_ids=np.tile(IDS, (4, 1)), labels=np.arange(8) % 3)
    assert run("barrier", bert / "m1", root, "--step", "3", "--data", data, "--out", tmp_path / "curves", "--points", "3") == 0
    report = json.loads((tmp_path / "curves" / "barrier.json").read_text())
    assert report["inputs"]["b"]["path"] == str(root / "3") and set(report["result"]) == {"plain", "aligned"}
    capsys.readouterr()
    assert run("align", bert / "m0", root, tmp_path / "never", "--dry-run", "--format", "orbax") == 0
    assert "align" in capsys.readouterr().out and not (tmp_path / "never").exists()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"models: [{root / '4'}, {root / '5'}]\nmethod: average\nalign: none\nweights: [1, 3]\n")
    assert run("merge", recipe, tmp_path / "from-recipe", "--format", "orbax", "--quiet") == 0
    want = rj.merge.average([saved[4], saved[5]], [1, 3])
    got = flatten(rj.load_orbax(tmp_path / "from-recipe").params)
    assert all(np.allclose(np.asarray(got[p]), np.asarray(x), atol=1e-7) for p, x in flatten(want).items())
    assert "weights:\n- 1.0\n- 3.0" in (tmp_path / "from-recipe" / "rotsym_config.yaml").read_text()


def test_folders_orbax_cannot_read_say_what_they_hold(bert, tmp_path, capsys):
    """A run whose items are named otherwise, an unfinished save, a config of another model: each
    refused with what was found, not a safetensors message alone."""
    ck = rj.load_hf(bert / "m0")
    other = tmp_path / "other-items"
    rj.save_config(ck, other)
    manager = ocp.CheckpointManager(other.absolute(), item_names=("model", "opt"))
    manager.save(1, args=ocp.args.Composite(model=ocp.args.StandardSave(ck.params), opt=ocp.args.StandardSave({"x": np.zeros(2)})))
    manager.wait_until_finished()
    manager.close()
    with pytest.raises(SystemExit):
        run("inspect", other)
    assert "an Orbax CheckpointManager run whose step 1 holds the items ['model', 'opt']" in capsys.readouterr().err
    unfinished = tmp_path / "unfinished"
    rj.save_config(ck, unfinished)
    (unfinished / "params.orbax-checkpoint-tmp-123").mkdir()
    with pytest.raises(SystemExit):
        run("inspect", unfinished)
    assert "is an unfinished Orbax save" in capsys.readouterr().err
    cls, config = MODELS["gpt2-lm"]
    save_reference(cls, config(), tmp_path / "gpt2", seed=0)
    with pytest.raises(FileExistsError, match=r"describes another model \(a bert model, not gpt2\); pass overwrite=True"):
        rj.save_config(rj.load_hf(tmp_path / "gpt2", weights=False), other)
    rj.save_config(ck, other)  # the same model: rewritten
    with pytest.raises(TypeError, match="step='1'; expected an int"):
        rj.load_orbax(other, step="1")


def test_generation_config_and_tokenizer_files_come_along(tmp_path):
    cls, config = MODELS["llama-lm"]
    save_reference(cls, config(), tmp_path / "hf", seed=0)
    (tmp_path / "hf" / "generation_config.json").write_text('{"max_new_tokens": 7}')
    ck = rj.load_hf(tmp_path / "hf")
    for save, name in ((rj.save_hf, "as-hf"), (rj.save_orbax, "as-orbax")):
        out = save(ck, ck.params, tmp_path / name)
        assert json.loads((out / "generation_config.json").read_text()) == {"max_new_tokens": 7}
