"""What a new user's second trial hit (issue 46), each as the command or call that hit it: one-line
refusals instead of tracebacks, labels outside the label space refused instead of a NaN barrier,
options the run ignored refused instead of recorded, dry runs that apply the run's checks, custom
params whose layers would come back changed refused at `bind`, and messages that say what they mean.
Tiny models written by transformers; the refusals come before any weight is read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
import transformers as tf

import rotsym_jax as rj
from rotsym_jax import SpecError, cli
from rotsym_jax.cli import parsers

# 128 positions: the texts are padded to --max-length (128 by default)
TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, max_position_embeddings=128)
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(45)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Llama, Mistral (the same tensors), a 2-class BERT with a tokenizer and label names, a 5-class ViT."""
    root = tmp_path_factory.mktemp("models")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    for seed in (0, 1):
        tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, num_key_value_heads=2)).save_pretrained(root / f"llama{seed}")
        bert = tf.BertConfig(**TINY, num_labels=2, id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1})
        tf.BertForSequenceClassification(bert).save_pretrained(root / f"bert{seed}")
        vit = tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=8, patch_size=4,
                           num_channels=1, num_labels=5)
        tf.ViTForImageClassification(vit).save_pretrained(root / f"vit{seed}")
    tf.MistralForCausalLM(tf.MistralConfig(**TINY, num_key_value_heads=2)).save_pretrained(root / "mistral")
    tf.BertForSequenceClassification(tf.BertConfig(**TINY, num_labels=3)).save_pretrained(root / "bert3")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(WORDS) + "\n")
    tf.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(root / "bert0")
    return root


def run(capsys, *argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `rotsym argv`."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *argv) -> str:
    """The one-line usage error of `rotsym argv`."""
    code, _, err = run(capsys, *argv)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def jsonl(path: Path, labels) -> Path:
    path.write_text("".join(json.dumps({"text": f"w{5 + i} w{9 + i} w{20 + i}", "label": label}) + "\n" for i, label in enumerate(labels)))
    return path


# ---- 1. tracebacks -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dry_run", [False, True])
def test_a_missing_data_file_is_one_line(models, tmp_path, capsys, no_weight_reads, dry_run):
    err = refused(capsys, "align", models / "llama0", models / "llama1", tmp_path / "out", "--method", "activations",
                  "--data", tmp_path / "missing.jsonl", *(["--dry-run"] * dry_run))
    assert "missing.jsonl: no such file" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("data", ["ids_and_labels", "ids"])
def test_token_ids_given_to_a_vit_are_refused_by_what_it_reads(models, tmp_path, capsys, no_weight_reads, data):
    arrays = {"input_ids": np.ones((4, 8), np.int32)} | ({"labels": np.zeros(4, np.int32)} if data == "ids_and_labels" else {})
    np.savez(tmp_path / "data.npz", **arrays)
    err = refused(capsys, "barrier", models / "vit0", models / "vit1", "--data", tmp_path / "data.npz", "--out", tmp_path / "b")
    assert "holds input_ids (token ids)" in err and "reads pixel_values (images)" in err, err


# ---- 2. silent wrong answers -------------------------------------------------------------------------

def test_labels_outside_the_label_space_are_refused_not_a_nan_barrier(models, tmp_path, capsys, no_weight_reads):
    np.savez(tmp_path / "data.npz", pixel_values=np.zeros((6, 1, 8, 8), np.float32), labels=np.array([0, 1, 2, 3, 4, 49]))
    err = refused(capsys, "barrier", models / "vit0", models / "vit1", "--data", tmp_path / "data.npz", "--out", tmp_path / "b",
                  "--batch-size", "4")
    assert "data.npz: examples 4-5: labels holds 1 value in [49, 49] outside [0, 5): the model has 5 classes" in err, err
    assert not (tmp_path / "b" / "barrier.json").exists()


def test_fractional_labels_in_an_npz_are_refused(models, tmp_path, capsys, no_weight_reads):
    np.savez(tmp_path / "data.npz", pixel_values=np.zeros((2, 1, 8, 8), np.float32), labels=np.array([0.5, 1.7]))
    err = refused(capsys, "barrier", models / "vit0", models / "vit1", "--data", tmp_path / "data.npz", "--out", tmp_path / "b")
    assert "labels has dtype float64; labels must be integer class indices" in err


def test_jsonl_labels_outside_the_label_space_name_the_lines(models, tmp_path, capsys, no_weight_reads):
    data = jsonl(tmp_path / "texts.jsonl", [0, 1, 1, 0, 7, 1])
    err = refused(capsys, "align", models / "bert0", models / "bert1", tmp_path / "out", "--method", "learned", "--data", data,
                  "--batch-size", "4")
    assert "texts.jsonl: lines 5-6: labels holds 1 value in [7, 7] outside [0, 2)" in err, err


def test_jsonl_label_names_are_the_models_and_others_name_their_line(models, tmp_path, capsys):
    ck = rj.load_hf(models / "bert0", weights=False)
    named = rj.recipe.batches(rj.recipe.Data(jsonl(tmp_path / "names.jsonl", ["positive", "negative", "positive"])), ck)
    assert named[0]["labels"].tolist() == [1, 0, 1]
    with pytest.raises(rj.recipe.RecipeError, match=r"bad.jsonl: line 2: label 'neutral' is not one of the model's label names \['negative', 'positive'\]"):
        rj.recipe.batches(rj.recipe.Data(jsonl(tmp_path / "bad.jsonl", ["positive", "neutral"])), ck)
    with pytest.raises(rj.recipe.RecipeError, match=r"odd.jsonl: line 1: label 0.5; expected a class index"):
        rj.recipe.batches(rj.recipe.Data(jsonl(tmp_path / "odd.jsonl", [0.5])), ck)


def test_unlabelled_data_names_the_command_line_option(models, tmp_path, capsys, no_weight_reads):
    data = tmp_path / "texts.jsonl"
    data.write_text(json.dumps({"text": "w5 w6"}) + "\n")
    err = refused(capsys, "barrier", models / "bert0", models / "bert1", "--data", data, "--out", tmp_path / "b")
    assert "--label-field" in err and "give label_field" not in err


def test_a_base_the_method_ignores_is_refused(models, tmp_path, capsys, no_weight_reads):
    err = refused(capsys, "merge", "--method", "average", models / "llama0", models / "llama1", tmp_path / "out", "--base", models / "llama0")
    assert "merge method 'average' does not use base (--base, or base: in the recipe)" in err and "the methods that take base: [" in err
    assert "'ties'" in err
    assert not (tmp_path / "out").exists()


def test_paths_may_stand_on_both_sides_of_an_option(models, tmp_path, capsys, no_weight_reads):
    """argparse took the paths in one run: `A B --base X OUT` ended in "unrecognized arguments: OUT"."""
    code, out, _ = run(capsys, "merge", "--method", "ties", models / "llama0", "--param", "density=0.5", models / "llama1",
                       "--base", models / "llama0", tmp_path / "out", "--dry-run")
    assert code == 0 and f"write {tmp_path / 'out'}" in out and "  model 1: " in out, out
    code, _, err = run(capsys, "merge", "--method", "ties", models / "llama0", models / "llama1", tmp_path / "out", "--bsae", "x")
    assert code == 2 and "did you mean --base?" in err, err


def test_model_types_that_differ_are_noted(models, tmp_path, capsys):
    code, _, err = run(capsys, "align", models / "llama0", models / "mistral", tmp_path / "out", "--dry-run")
    assert code == 0 and "the models' types differ (A: llama, B: mistral)" in err


def test_configs_that_compute_otherwise_are_noted(models, tmp_path, capsys):
    """Another activation or RoPE base merges by shape without a word before (the new-user trial:
    a SiLU Llama averaged with a GELU one, OUT silently SiLU); names, dtypes and labels stay unnoted."""
    b = tmp_path / "b"
    shutil.copytree(models / "llama1", b)
    config = json.loads((b / "config.json").read_text())
    same = {**config, "_name_or_path": "elsewhere", "id2label": {"0": "x", "1": "y"}, "torch_dtype": "bfloat16"}
    (b / "config.json").write_text(json.dumps(same))
    code, _, err = run(capsys, "merge", "--method", "average", models / "llama0", b, tmp_path / "out", "--dry-run")
    assert code == 0 and "configs differ" not in err, err
    (b / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu", "rms_norm_eps": 1e-5}))
    code, _, err = run(capsys, "merge", "--method", "average", models / "llama0", b, tmp_path / "out", "--dry-run")
    assert code == 0, err
    assert ("the models' configs differ in what their tensors compute (hidden_act: model 0 \"silu\", model 1 \"gelu\"; rms_norm_eps: "
            in err) and "OUT keeps model 0's config" in err, err


def test_a_model_with_nan_is_refused_naming_it_not_out_nor_a_python_argument(models, tmp_path, capsys):
    """The loader's hint named `allow_nonfinite=True`, which no command takes, a mergekit run
    blamed OUT for model 1's NaN, and a streamed run worded the refusal otherwise: now one line,
    however the model is read, naming the model, its file and the tensor."""
    import safetensors.numpy

    b = tmp_path / "nan"
    shutil.copytree(models / "llama1", b)
    tensors = safetensors.numpy.load_file(b / "model.safetensors")
    name = next(n for n in tensors if n.endswith("up_proj.weight"))
    tensors[name][0, 0] = np.nan
    safetensors.numpy.save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    config = tmp_path / "linear.yml"
    config.write_text(f"models:\n  - model: {models / 'llama0'}\n  - model: {b}\nmerge_method: linear\nparameters: {{weight: 0.5}}\n")
    runs = {"B": ["align", models / "llama0", b, tmp_path / "out"], "model 1": ["merge", "--method", "average", models / "llama0", b, tmp_path / "out"],
            f"model 1 ({b})": ["merge", config, tmp_path / "out"]}
    lines = set()
    for what, argv in runs.items():
        for extra in ([], ["--max-memory", "1G"]):
            err = refused(capsys, *argv, *extra)
            lines.add(err.split(": ", 2)[-1])  # after "rotsym CMD: error: "
            assert f"error: {what}: {b}" in err and "non-finite values (NaN or Inf) in " in err and f"{name}" in err, err
            assert f"(1 of {tensors[name].size}" in err and "cannot be aligned or merged" in err and "allow_nonfinite" not in err and "OUT" not in err, err
    assert len({line.split(": ", 1)[1].split(" (see")[0] for line in lines}) == 1, lines  # one line, whatever reads the model
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="no /proc here")
def test_out_on_a_file_system_of_no_size_is_named_so(models, capsys):
    """/proc reports 0 bytes free; the refusal said "0.00 GiB free", as if the disk were full."""
    err = refused(capsys, "align", models / "llama0", models / "llama1", "/proc/rotsym-out")
    assert "OUT: /proc is on a file system of no size" in err and "GiB free" not in err, err


def test_bind_refuses_string_layer_keys_and_layer_lists():
    ck = rj.init_checkpoint(tf.GPT2Config(n_embd=8, n_layer=2, n_head=2, vocab_size=11, n_positions=8), jax.random.key(0))
    spec = rj.spec_for(ck)
    strings = {**ck.params, "layers": {str(i): layer for i, layer in ck.params["layers"].items()}}
    with pytest.raises(SpecError, match=r"params: layers/0: the key '0' is a string of digits; layer indices are int keys"):
        rj.bind(spec, strings)
    listed = {**ck.params, "layers": [ck.params["layers"][i] for i in range(2)]}
    with pytest.raises(SpecError, match=r"params: layers is a list; .* dict\(enumerate\(layers\)\)"):
        rj.align(ck.params, listed, spec)


# ---- 5. dry runs apply the run's checks --------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--method", "slerp", "llama0", "llama1", "llama1"], "merge method 'slerp' merges at most 2 models; got 3"),
    (["--method", "average", "bert0", "bert3", "--task-head", "merge"], r"leaf 'head/classifier/bias' has shape (3,) in model 1 but (2,)"),
])
def test_a_dry_run_refuses_what_the_run_refuses(models, tmp_path, capsys, no_weight_reads, argv, message):
    argv = [models / a if a.startswith(("llama", "bert")) else a for a in argv]
    err = refused(capsys, "merge", *argv, tmp_path / "out", "--dry-run")
    assert message in err, err


# ---- 6. messages -------------------------------------------------------------------------------------

def test_inspect_says_what_is_untouched_and_tables_say_their_columns(models, capsys):
    code, out, _ = run(capsys, "inspect", models / "llama0", models / "llama1")
    assert code == 0 and "head None" not in out
    assert "untouched: 7 leaves (embeddings, norms, LM head)" in out, out
    assert "qk the query and key weights" in out
    code, out, _ = run(capsys, "inspect", models / "bert0")
    assert "(embeddings, norms, output biases, pooler, task head)" in out


def test_inspect_says_which_elements_the_options_solve(models, capsys):
    """A group lists every element of its model (head permutations and scales too); a line says
    which of them the options given solve, and the option that changes each."""
    _, out, _ = run(capsys, "inspect", models / "bert0")
    assert "head permutations, QK and VO: rotations, scales" in out, out
    assert ("solved with these options: heads in place (--heads permute searches their order); Q/K and V/O rotated (--attention), "
            "scaled (sequential, the paper's) (--rescale); FFN units permuted (--ffn); residual stream left") in out, out
    _, out, _ = run(capsys, "inspect", models / "bert0", "--heads", "permute", "--rescale", "none", "--residual", "permutation")
    assert "solved with these options: head permutations searched; Q/K and V/O rotated (--attention), no scale (--rescale)" in out, out
    assert "residual stream: permutation" in out
    _, out, _ = run(capsys, "inspect", models / "bert0")  # post-LN with LayerNorm: only permutations of the stream
    assert "residual stream left (--residual permutation moves it)" in out, out
    _, out, _ = run(capsys, "inspect", models / "bert0", "--layers", "1")
    assert "solved with these options: layers [1] only, the others left (--layers): heads in place" in out, out
    _, out, _ = run(capsys, "inspect", models / "bert0", "--residual", "rotation")
    assert "residual stream: rotation, which align refuses here: residual='rotation' needs a pre-norm model" in out, out


def test_a_model_type_with_no_tensor_in_common_is_refused_in_one_short_line(tmp_path, capsys):
    tf.MptForCausalLM(tf.MptConfig(vocab_size=50, d_model=16, n_heads=4, n_layers=1, max_seq_len=16)).save_pretrained(tmp_path / "mpt")
    capsys.readouterr()
    err = refused(capsys, "inspect", tmp_path / "mpt")
    assert "no layout of ours holds 20% of its tensor names" in err and "MptForQuestionAnswering" not in err and len(err) < 700, err


def test_a_streaming_plan_counts_its_passes_in_words():
    plan = rj.streaming.StreamPlan(layers=2, chunk_layers=1, passes=1, peak_bytes=0, in_memory_bytes=0, output_bytes=0, block_bytes=0)
    assert "1 pass over the weights" in plan.describe()
    assert "2 passes over" in rj.streaming.StreamPlan(layers=2, chunk_layers=1, passes=2, peak_bytes=0, in_memory_bytes=0, output_bytes=0, block_bytes=0).describe()


# ---- 4. the persistent compilation cache -------------------------------------------------------------

def test_the_compilation_cache_is_per_user_and_can_move_or_stop(monkeypatch, tmp_path):
    monkeypatch.delenv("ROTSYM_COMPILATION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert parsers.compilation_cache_dir() == tmp_path / "xdg" / "rotsym_jax" / "xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert parsers.compilation_cache_dir() == Path.home() / ".cache" / "rotsym_jax" / "xla"
    monkeypatch.setenv("ROTSYM_COMPILATION_CACHE", str(tmp_path / "mine"))
    assert parsers.compilation_cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("ROTSYM_COMPILATION_CACHE", "off")
    assert parsers.compilation_cache_dir() is None


def test_every_command_keeps_its_programs(models, tmp_path):
    """`rotsym inspect A B` (an alignment) as a new process: its programs land in the per-user cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("ROTSYM_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    command = [sys.executable, "-m", "rotsym_jax.cli", "inspect", str(models / "llama0"), str(models / "llama1")]
    subprocess.run(command, check=True, capture_output=True, env=env, timeout=300)
    kept = list((tmp_path / "xdg" / "rotsym_jax" / "xla").iterdir())
    assert len(kept) > 3, kept


def test_a_warning_on_the_command_line_is_one_line(monkeypatch, capsys):
    """Python's format (file, line number, the source line) is for programmers: a note prints as it
    is, another warning as `rotsym CMD: warning: ...`, each on one line; outside the command the
    warnings machinery is as it was."""
    def run(argv):
        warnings.warn("note: a folder left by an earlier run\nwas left alone", stacklevel=1)
        warnings.warn("non-finite values in 2 tensors", RuntimeWarning, stacklevel=1)
        return 0

    before = warnings.showwarning
    monkeypatch.setattr(parsers, "_run", run)
    assert parsers.main(["align", "A", "B", "OUT"]) == 0
    assert capsys.readouterr().err.splitlines() == ["note: a folder left by an earlier run was left alone",
                                                    "rotsym align: warning: non-finite values in 2 tensors"]
    assert warnings.showwarning is before


def test_two_head_geometries_are_told_apart_by_what_differs():
    """Every trait of a block's heads has its words in a refusal: two MLA blocks that differ only in
    how their shared RoPE key's pairs are stored printed the same heads twice (new-user trial)."""
    import dataclasses

    from rotsym_jax import checks
    from rotsym_jax.spec import HeadGeometry

    counts = {"num_heads", "num_kv_heads", "head_dim"}
    assert {f.name for f in dataclasses.fields(HeadGeometry)} - counts == set(checks._HEAD_TRAITS)
    a = HeadGeometry(4, 4, 8, shared_rope_dim=4, shared_rope_interleaved=True)
    b = dataclasses.replace(a, shared_rope_interleaved=False)
    message = checks.heads_mismatch(("A", {"attn": a}), ("B", {"attn": b}))
    assert "the shared RoPE key's pairs rotate_half's, A's 4 heads of 8 in 4 kv groups, the shared RoPE key's pairs interleaved" in message
    wider = checks.heads_mismatch(("A", {"attn": a}), ("B", {"attn": dataclasses.replace(a, value_dim=12)}))  # GLM-4.7-Flash's kind
    assert "4 heads of 8 in 4 kv groups, values 12 wide, A's 4 heads of 8 in 4 kv groups, values as wide as the keys" in wider
