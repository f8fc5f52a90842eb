"""Downloaded checkpoints are untrusted (issue 76): a folder's code never runs and never travels
into an output, no config integer, data line or YAML file stalls the machine, and replacing an
output deletes only the files the library wrote. Tiny models written by transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import transformers as tf

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.errors import PathExists
from rotsym_jax.io import recipe, tokenizers
from rotsym_jax.io._publish import MANIFEST

TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, max_position_embeddings=16)
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(45)]
DISGUISED = ("training_args.bin", "tokenizer.pth", "vocab.pth", "chat_template.pth", "tokenizer.pkl.gz", "NOTICE.bat", "tokenizer.pyw",
             "tokenizer.so.1", "tokenizer/tokenizer.pth")
CODE = "import pathlib\npathlib.Path({canary!r}).write_text('ran')\nfrom transformers import BertTokenizerFast as MyTokenizer\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two BERT classifiers with a tokenizer; `hostile` is the first with code of its own beside it:
    a tokenizer and a model class named in auto_map, a pickle of training arguments."""
    root = tmp_path_factory.mktemp("models")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(WORDS) + "\n")
    for name in ("bert0", "bert1"):
        tf.BertForSequenceClassification(tf.BertConfig(**TINY, num_labels=2)).save_pretrained(root / name)
        tf.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(root / name)
    hostile = root / "hostile"
    tf.BertForSequenceClassification(tf.BertConfig(**TINY, num_labels=2)).save_pretrained(hostile)
    tf.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(hostile)
    (hostile / "tok.py").write_text(CODE.format(canary=str(root / "canary")))
    (hostile / "modeling_evil.py").write_text(CODE.format(canary=str(root / "canary")))
    for name in DISGUISED:  # pickles and scripts named like tokenizer data
        (hostile / name).parent.mkdir(exist_ok=True)
        (hostile / name).write_bytes(b"\x80\x04pickled")
    (hostile / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tok.MyTokenizer", None]}}))
    (hostile / "preprocessor_config.json").write_text(json.dumps({"image_processor": {"auto_map": {"AutoImageProcessor": "tok.P"}}}))
    for file, extra in (("tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["tok.MyTokenizer", "tok.MyTokenizer"]}}),
                        ("config.json", {"auto_map": {"AutoModelForSequenceClassification": "modeling_evil.Model"},
                                         "custom_pipelines": {"impl": "attacker/repo--evil.Pipe"}})):
        raw = json.loads((hostile / file).read_text())
        (hostile / file).write_text(json.dumps({**raw, **extra}))
    return root


def run(capsys, *argv) -> tuple[int, str]:
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out + err


def texts(path: Path, n: int = 8, long_line: int | None = None, length: int = 0) -> Path:
    lines = [json.dumps({"text": ("w7 " * (length // 3)) if i + 1 == long_line else f"w{5 + i} w{9 + i} w{20 + i}", "label": i % 2})
             for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- 1. a checkpoint's code never runs ---------------------------------------------------------------

def test_a_tokenizer_that_names_code_is_refused_without_asking_and_its_code_never_runs(models, tmp_path):
    """As a user would hit it: the command line with "y" on standard input (transformers' prompt)."""
    data = texts(tmp_path / "texts.jsonl")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(rj.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "rotsym_jax.cli", "align", models / "hostile", models / "bert1", tmp_path / "out",
                           "--method", "activations", "--data", data, "--quiet"], input="y\ny\n", capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 2, done.stderr
    assert "its tokenizer names code of its own (tokenizer_config.json: auto_map['AutoTokenizer']" in done.stderr, done.stderr
    assert "give the token ids instead (an .npz with input_ids" in done.stderr and "custom code" not in done.stdout + done.stderr
    assert not (models / "canary").exists() and not (tmp_path / "out").exists()


def test_transformers_is_told_never_to_run_code_where_the_check_misses_it(models, monkeypatch):
    monkeypatch.setattr(tokenizers, "named_code", lambda folder: None)
    calls = []
    load = tf.AutoTokenizer.from_pretrained
    monkeypatch.setattr(tf.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(k) or load(*a, **k))
    tokenizers.load_tokenizer(models / "hostile", "read it")  # transformers 5 falls back on tokenizer_class
    assert calls == [{"trust_remote_code": False, "local_files_only": True}] and not (models / "canary").exists()


def test_custom_code_and_other_files_do_not_travel_into_outputs(models, tmp_path, capsys):
    code, text = run(capsys, "merge", "--method", "average", "--align", "none", models / "hostile", models / "bert1", tmp_path / "out")
    assert code == 0, text
    out = tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "README.md", MANIFEST} <= names, names
    assert not {"tok.py", "modeling_evil.py", *DISGUISED} & names, names
    assert {p.name for p in (out / "tokenizer").iterdir()} == {"tokenizer_config.json"}
    for file in ("config.json", "tokenizer_config.json", "tokenizer/tokenizer_config.json", "preprocessor_config.json"):
        text = (out / file).read_text()
        assert "auto_map" not in text and "custom_pipelines" not in text, file
    card = (out / "README.md").read_text()
    assert "## Files not copied" in card
    for left in ("modeling_evil.py", "tok.py", *DISGUISED, "config.json: auto_map", "config.json: custom_pipelines",
                 "tokenizer_config.json: auto_map", "tokenizer/tokenizer_config.json: auto_map", "preprocessor_config.json: image_processor.auto_map"):
        assert left in card, left
    assert tf.AutoTokenizer.from_pretrained(out)("w5 w9").input_ids  # still a tokenizer transformers loads, without code
    assert not (models / "canary").exists()


# ---- 3. absurd sizes ------------------------------------------------------------------------------------

def test_a_config_claiming_a_billion_layers_is_refused_at_once(models, tmp_path):
    """Run in a process of its own with a time limit: before the bound, it looped over 10**9 layers."""
    for name, layers in (("huge", 10**9), ("deep", 1000)):
        folder = tmp_path / name
        folder.mkdir()
        for f in ("config.json", "model.safetensors"):
            os.link(models / "bert0" / f, folder / f)
        raw = json.loads((models / "bert0" / "config.json").read_text())
        (folder / "config.json").unlink()
        (folder / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": layers}))
    mixtral = tmp_path / "mixtral"  # 2 layers of 4 experts, claiming 20 layers of 65,536 (within each count's bound)
    tf.MixtralForCausalLM(tf.MixtralConfig(**TINY, num_key_value_heads=2, num_local_experts=4)).save_pretrained(mixtral)
    raw = json.loads((mixtral / "config.json").read_text())
    (mixtral / "config.json").write_text(json.dumps({**raw, "num_local_experts": 65536, "num_hidden_layers": 20}))
    script = ("import sys, rotsym_jax as rj\nfor f in sys.argv[1:]:\n    try:\n        rj.load_hf(f, weights=False)\n"
              "    except rj.RotsymError as e:\n        print(e)\n")
    done = subprocess.run([sys.executable, "-c", script, tmp_path / "huge", tmp_path / "deep", mixtral], capture_output=True, text=True,
                          timeout=120)
    lines = done.stdout.splitlines()
    assert "'num_hidden_layers' is 1000000000 (int); expected at most 65536" in lines[0], done.stdout + done.stderr
    assert "num_hidden_layers=1000, but the checkpoint holds" in lines[1] and "the config does not describe these weights" in lines[1]
    assert "its config implies more than" in lines[2] and "(its layers or experts?)" in lines[2], lines


def test_a_huge_text_is_refused_by_its_line_before_it_is_tokenized(models, tmp_path, capsys, no_weight_reads, monkeypatch):
    data = texts(tmp_path / "long.jsonl", long_line=3, length=recipe.MAX_TEXT_CHARS + 3)
    ck = rj.load_hf(models / "bert0", weights=False)
    monkeypatch.setattr(tokenizers, "load_tokenizer", lambda *a: pytest.fail("tokenized a text past the bound"))
    with pytest.raises(recipe.RecipeError, match=r"long.jsonl: line 3: its text holds 131,07\d characters; a text may hold at most 131,072"):
        recipe._tokenized(recipe.Data(data), ck)
    line = tmp_path / "line.jsonl"
    line.write_text(json.dumps({"text": "w5", "other": "x" * (9 * recipe.MAX_TEXT_CHARS)}) + "\n")
    with pytest.raises(recipe.RecipeError, match="line.jsonl: line 1 is over 1,048,576 characters long"):
        recipe._tokenized(recipe.Data(line), ck)
    monkeypatch.setattr(recipe, "MAX_TEXTS_CHARS", 40)
    with pytest.raises(recipe.RecipeError, match=r"line 5: the texts so far hold \d+ characters, over the 40 read at most; use fewer texts"):
        recipe._tokenized(recipe.Data(texts(tmp_path / "many.jsonl")), ck)


def test_only_the_examples_used_are_read(models, tmp_path, monkeypatch):
    data = texts(tmp_path / "texts.jsonl", n=4)
    data.write_text(data.read_text() + "not JSON\n")
    ck = rj.load_hf(models / "bert0", weights=False)
    columns, lines = recipe._tokenized(recipe.Data(data, count=4), ck)
    assert lines == [1, 2, 3, 4] and columns["input_ids"].shape[0] == 4
    with pytest.raises(recipe.RecipeError, match="line 5 is not JSON"):
        recipe._tokenized(recipe.Data(data), ck)
    bomb = tmp_path / "bomb.npz"  # 0.5 MB compressed, 477 MiB once read
    np.savez_compressed(bomb, input_ids=np.zeros((100_000, 5000), np.int8))
    with pytest.raises(recipe.RecipeError, match=r"bomb.npz: its arrays hold 477 MiB once read, over the 256 MiB read at most"):
        recipe._arrays(bomb, 8)
    np.savez(bomb, input_ids=np.ones((10, 6), np.int64), attention_mask=np.ones((10, 6), np.int64))
    assert {k: v.shape for k, v in recipe._arrays(bomb, 4).items()} == {"input_ids": (4, 6), "attention_mask": (4, 6)}


def test_a_yaml_listing_200000_models_is_refused_before_it_is_parsed(tmp_path, capsys):
    cfg = tmp_path / "huge.yml"
    cfg.write_text("merge_method: linear\nmodels:\n" + "".join(f"  - model: m{i}\n    parameters: {{weight: 1.0}}\n" for i in range(200_000)))
    code, text = run(capsys, "merge", cfg, tmp_path / "out")
    assert code == 2 and "huge.yml: over 262,144 bytes" in text, text
    with pytest.raises(recipe.RecipeError, match="over 262,144 bytes; a recipe is at most"):
        recipe.load(cfg)


# ---- 5. only the library's files are deleted ----------------------------------------------------------

def _merge(capsys, models, out, *extra):
    return run(capsys, "merge", "--method", "average", "--align", "none", models / "bert0", models / "bert1", out, *extra)


def test_overwrite_keeps_the_files_the_user_put_in_the_output(models, tmp_path, capsys):
    out = tmp_path / "out"
    assert _merge(capsys, models, out)[0] == 0
    assert "Files not copied" not in (out / "README.md").read_text()  # nothing of these inputs was left out
    (out / "notes.txt").write_text("mine")
    (out / "eval").mkdir()
    (out / "eval" / "results.json").write_text('{"accuracy": 0.9}')
    for name in ("adapter_model.safetensors", "backup.bin"):  # named like weights, but not the output's
        (out / name).write_bytes(b"mine")
    code, text = _merge(capsys, models, out, "--overwrite")
    assert code == 0, text
    assert (out / "notes.txt").read_text() == "mine" and json.loads((out / "eval" / "results.json").read_text()) == {"accuracy": 0.9}
    assert (out / "backup.bin").read_bytes() == b"mine" and (out / "adapter_model.safetensors").read_bytes() == b"mine"
    assert "kept 4 files that rotsym did not write (adapter_model.safetensors, backup.bin, eval/results.json, notes.txt)" in text, text
    written = json.loads((out / MANIFEST).read_text())["files"]
    assert "notes.txt" not in written and "eval/results.json" not in written and "README.md" in written


def test_overwrite_refuses_to_replace_a_file_the_user_changed(models, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert _merge(capsys, models, out)[0] == 0
    before = sorted(p.name for p in out.iterdir())
    (out / "README.md").write_text((out / "README.md").read_text() + "\n## My evaluation\n\n91% on the dev set.\n")
    with monkeypatch.context() as patched:  # the command line refuses before any weight is read
        patched.setattr(rj.hf.TensorFiles, "read", lambda *a, **k: pytest.fail("read a weight before refusing"))
        code, text = _merge(capsys, models, out, "--overwrite")
    assert code == 2 and "holds README.md, which rotsym did not write (or which changed since it did)" in text, text
    assert "91% on the dev set" in (out / "README.md").read_text() and sorted(p.name for p in out.iterdir()) == before
    ck = rj.load_hf(models / "bert0")  # save_hf, which copies bert0's files: refused when it comes to publish
    (ck.source / "README.md").write_text("bert0's card")
    try:
        with pytest.raises(PathExists, match="holds README.md, which rotsym did not write"):
            rj.save_hf(ck, ck.params, out, overwrite=True)
    finally:
        (ck.source / "README.md").unlink()
    assert "91% on the dev set" in (out / "README.md").read_text() and sorted(p.name for p in out.iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".rotsym-")]


def test_an_output_written_before_the_manifest_is_replaced_as_the_library_wrote_it(models, tmp_path, capsys):
    out = tmp_path / "out"
    assert _merge(capsys, models, out)[0] == 0
    (out / MANIFEST).unlink()  # as an earlier version wrote it: the card and report are known by their content
    (out / "notes.txt").write_text("mine")
    code, text = _merge(capsys, models, out, "--overwrite")
    assert code == 0 and "kept 1 files that rotsym did not write (notes.txt)" in text, text
    assert (out / "notes.txt").read_text() == "mine" and (out / MANIFEST).is_file()


def test_save_hf_over_a_checkpoint_keeps_foreign_files_and_says_so(models, tmp_path):
    ck = rj.load_hf(models / "bert0")
    out = rj.save_hf(ck, ck.params, tmp_path / "out")
    (out / "notes.txt").write_text("mine")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rj.save_hf(ck, ck.params, out, overwrite=True)
    assert any("kept 1 files that rotsym did not write (notes.txt)" in str(w.message) for w in caught)
    assert (out / "notes.txt").read_text() == "mine"


# ---- 6. smaller ----------------------------------------------------------------------------------------

def test_an_output_under_a_symbolic_link_is_refused(models, tmp_path, capsys):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    ck = rj.load_hf(models / "bert0", weights=False)
    with pytest.raises(PathExists, match=f"lies under the symbolic link {tmp_path / 'link'}"):
        rj.save_hf(ck, ck.params, tmp_path / "link" / "out")
    code, text = _merge(capsys, models, tmp_path / "link" / "sub" / "out")
    assert code == 2 and "lies under the symbolic link" in text and f"({tmp_path / 'real' / 'sub' / 'out'})" in text, text
    (tmp_path / "real" / "deep").mkdir()
    (tmp_path / "deeplink").symlink_to(tmp_path / "real" / "deep")  # deeplink/.. is real/, not tmp_path
    code, text = _merge(capsys, models, tmp_path / "deeplink" / ".." / "out")
    assert code == 2 and f"lies under the symbolic link {tmp_path / 'deeplink'}" in text, text
    assert list((tmp_path / "real").iterdir()) == [tmp_path / "real" / "deep"] and not (tmp_path / "out").exists()


def test_sequences_longer_than_the_learned_positions_are_refused_not_nan(models, tmp_path, capsys):
    """The trial's `--count 8` run: 128 padded tokens on a model of 16 positions gave NaN everywhere
    and then "min() arg is an empty sequence"."""
    code, text = run(capsys, "align", "--method", "activations", "--data", texts(tmp_path / "t.jsonl"), "--count", "8",
                     models / "bert0", models / "bert1", tmp_path / "out")
    assert code == 2 and "lines 1-8: sequences of 128 tokens, and the model has 16 learned positions: give at most 16 tokens" in text, text
    roberta = tmp_path / "roberta"  # positions counted from padding_idx + 1 = 2: 18 rows hold 16 tokens
    tf.RobertaForMaskedLM(tf.RobertaConfig(**{**TINY, "max_position_embeddings": 18}, pad_token_id=1)).save_pretrained(roberta)
    ck = rj.load_hf(roberta, weights=False)
    assert ck.check_batch({"input_ids": np.full((2, 16), 5)}) == 32
    with pytest.raises(rj.RotsymError, match=r"sequences of 17 tokens, and the model has 18 learned positions \(the first 2 unused\)"):
        ck.check_batch({"input_ids": np.full((2, 17), 5)})
