"""Checkpoints of one architecture that transformers writes with different layouts: a bare base
model (`BertModel`: tensors `encoder.layer.0...`) beside task-head fine-tunes of it
(`BertForSequenceClassification`: `bert.encoder.layer.0...` and a classifier), a bare `GPT2Model`
beside a `GPT2LMHeadModel` (`transformer.h.0...`, tied head), single files beside shards. Every
path takes them as the in-memory loader does: streaming bit for bit as in memory, the Python API
with a head on one side only."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from checkpoint_utils import assert_same_checkpoint, checkpoint_tensors

import rotsym_jax as rj
from rotsym_jax import cli, hf, streaming
from rotsym_jax.checks import architecture_mismatch

torch = pytest.importorskip("torch", reason="transformers writes these checkpoints with PyTorch")
tf = pytest.importorskip("transformers")

BERT = dict(vocab_size=60, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48, max_position_embeddings=16)
GPT2 = dict(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=16)
LLAMA = dict(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=16, tie_word_embeddings=False, pad_token_id=0)


def _noisy(model, seed: int, scale: float = 0.05):
    """Every parameter moved (fine-tune-sized noise; non-zero biases, non-unit gains)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{name: folder} of checkpoints saved by transformers' `save_pretrained`."""
    root = tmp_path_factory.mktemp("layouts")
    torch.manual_seed(0)
    out = {}
    base = _noisy(tf.BertModel(tf.BertConfig(**BERT)), 0)
    base.save_pretrained(root / "bert-base")
    out["bert-base"] = root / "bert-base"
    for i, name in enumerate(("bert-cls-1", "bert-cls-2")):
        model = _noisy(tf.BertForSequenceClassification.from_pretrained(out["bert-base"], num_labels=3), 10 + i)
        # one fine-tune in shards (an index and several files), as big checkpoints come
        model.save_pretrained(root / name, **({"max_shard_size": "40KB"} if i else {}))
        out[name] = root / name
    gpt2 = _noisy(tf.GPT2Model(tf.GPT2Config(**GPT2)), 1)
    gpt2.save_pretrained(root / "gpt2-base")
    out["gpt2-base"] = root / "gpt2-base"
    lm = _noisy(tf.GPT2LMHeadModel.from_pretrained(out["gpt2-base"]), 2)
    lm.save_pretrained(root / "gpt2-lm")
    out["gpt2-lm"] = root / "gpt2-lm"
    # an untied LM head (Llama-3, Mistral) beside a classifier fine-tuned from it: lm_head/ on one side only
    llama = _noisy(tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)), 3)
    llama.save_pretrained(root / "llama-lm")
    out["llama-lm"] = root / "llama-lm"
    _noisy(tf.LlamaForSequenceClassification.from_pretrained(out["llama-lm"], num_labels=3), 4).save_pretrained(root / "llama-cls")
    out["llama-cls"] = root / "llama-cls"
    return out


def test_the_fixtures_hold_the_layouts_users_have(written):
    assert rj.load_hf(written["bert-base"], weights=False).layout.prefix == ""
    cls = rj.load_hf(written["bert-cls-1"], weights=False)
    assert (cls.layout.prefix, cls.layout.head) == ("bert.", "sequence_classification")
    assert (written["bert-cls-2"] / hf.WEIGHTS_INDEX).is_file()
    lm = rj.load_hf(written["gpt2-lm"], weights=False)
    assert (lm.layout.prefix, lm.layout.head) == ("transformer.", "lm")


def _both_paths(argv: list[str], tmp_path) -> tuple[Path, Path]:
    """The command in memory and streamed (`--max-memory`): both folders."""
    memory, stream = tmp_path / "memory", tmp_path / "stream"
    assert cli.main([*argv, str(memory), "--quiet"]) == 0
    assert cli.main([*argv, str(stream), "--quiet", "--max-memory", "3G"]) == 0
    return memory, stream


@pytest.mark.parametrize("a, b", [
    ("bert-base", "bert-cls-1"),  # bare anchor, headed B
    ("bert-cls-2", "bert-base"),  # headed and sharded anchor, bare B
    ("gpt2-lm", "gpt2-base"),  # a tied LM head, prefixed, against the bare decoder
    ("bert-cls-1", "bert-cls-2"),  # heads alike: the command line sets them aside all the same, as streaming does
    ("llama-lm", "llama-cls"),  # an untied LM head the classifier lacks (refused as another architecture)
    ("llama-cls", "llama-lm"),
])
def test_streamed_align_maps_each_checkpoints_own_names(written, a, b, tmp_path, capsys):
    memory, stream = _both_paths(["align", str(written[a]), str(written[b])], tmp_path)
    assert_same_checkpoint(stream, memory)
    assert checkpoint_tensors(stream).keys() == checkpoint_tensors(written[b]).keys()  # B's own names and head, kept
    reports = [json.loads((f / "rotsym_report.json").read_text())["result"] for f in (memory, stream)]
    assert reports[0]["after"] == reports[1]["after"] and reports[1]["after"]["total"] < reports[1]["before"]["total"]
    capsys.readouterr()
    assert cli.main(["align", str(written[a]), str(written[b]), str(tmp_path / "dry"), "--dry-run", "--max-memory", "3G"]) == 0
    assert "streaming: " in capsys.readouterr().out and not (tmp_path / "dry").exists()


@pytest.mark.parametrize("method, models, base", [
    ("average", ["bert-base", "bert-cls-1"], None),  # a bare anchor
    ("average", ["bert-cls-1", "bert-base"], None),
    ("ties", ["bert-cls-1", "bert-cls-2"], "bert-base"),  # a bare base under headed models
    ("ties", ["bert-base", "bert-cls-2"], "bert-cls-1"),  # a headed base under a bare anchor
])
def test_streamed_merges_map_each_checkpoints_own_names(written, method, models, base, tmp_path, capsys):
    argv = ["merge", "--method", method]
    if base is not None:
        argv += ["--base", str(written[base]), "--param", "density=0.5"]
    argv += [str(written[m]) for m in models]
    memory, stream = _both_paths(argv, tmp_path)
    assert_same_checkpoint(stream, memory)
    assert checkpoint_tensors(stream).keys() == checkpoint_tensors(written[models[0]]).keys()  # the anchor's layout
    capsys.readouterr()
    assert cli.main([*argv, str(tmp_path / "dry"), "--dry-run", "--max-memory", "3G"]) == 0
    assert "streaming: " in capsys.readouterr().out


@pytest.mark.parametrize("a, b", [("llama-lm", "llama-cls"), ("llama-cls", "llama-lm")])
def test_a_rotated_stream_moves_a_head_the_anchor_lacks_streamed_too(written, a, b, tmp_path):
    """The residual stream's rotation moves B's own head (or LM head), which A lacks; streamed,
    the row blocks of the tensors outside the layers looked the head up in A (a KeyError)."""
    model = tf.AutoModelForCausalLM if b == "llama-lm" else tf.AutoModelForSequenceClassification
    ids = torch.tensor([[5, 7, 11, 5, 3, 9], [8, 9, 4, 3, 2, 1]])
    logits = lambda folder: model.from_pretrained(folder).eval()(input_ids=ids).logits.detach().numpy()  # noqa: E731
    want = logits(written[b])
    for extra in ([], ["--max-memory", "3G"]):
        out = tmp_path / f"out{len(extra)}"
        assert cli.main(["align", str(written[a]), str(written[b]), str(out), "--residual", "rotation", "--quiet", *extra]) == 0
        np.testing.assert_allclose(logits(out), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("models, extra", [
    (["llama-lm", "llama-cls"], []),
    (["llama-cls", "llama-lm"], []),
    (["llama-cls", "llama-lm", "llama-lm"], ["--align", "many"]),
])
def test_streamed_merges_with_the_stream_set_aside_an_lm_head_one_model_lacks(written, models, extra, tmp_path, capsys):
    """The residual descent streamed measured every tensor outside the layers of the anchor in the
    other model too: an LM head (or a head) one model lacks was a KeyError traceback."""
    argv = ["merge", "--method", "average", "--residual", "permutation", *extra, *(str(written[m]) for m in models)]
    memory, stream = _both_paths(argv, tmp_path)
    assert_same_checkpoint(stream, memory)
    assert checkpoint_tensors(stream).keys() == checkpoint_tensors(written[models[0]]).keys()


def test_streaming_in_python_takes_mixed_layouts(written, tmp_path):
    base, cls = written["bert-base"], written["bert-cls-1"]
    plan = streaming.plan_align(base, cls, chunk_layers=1)
    assert plan.output_bytes == sum(len(t[2]) for t in checkpoint_tensors(cls).values())  # B's tensors, its head included
    got = streaming.align_to_disk(base, cls, tmp_path / "stream", chunk_layers=2)
    ca, cb = rj.load_hf(base), rj.load_hf(cls)
    want = rj.align(ca.params, cb.params, rj.spec_for(cb))
    moved = rj.load_hf(got.path).params
    for p, x in rj.pytree.flatten(want.params).items():
        np.testing.assert_array_equal(np.asarray(rj.pytree.flatten(moved)[p]), np.asarray(x), err_msg=p)
    assert got.report["after"] == want.report["after"]
    for name, t in want.transforms.items():
        for x, y in zip(jax.tree.leaves(t), jax.tree.leaves(got.transforms[0][name])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---- the Python API: task heads take no part in alignment ------------------------------------------

def _outputs(ck, params):
    ids = np.array([[2, 7, 11, 5, 3, 0], [2, 9, 4, 3, 0, 0]])
    out = ck.apply(params, input_ids=ids, attention_mask=(ids > 0).astype(np.int32))
    return {k: np.asarray(v) for k, v in out.items()}


def _assert_same_function(ck, params, moved):
    before, after = _outputs(ck, params), _outputs(ck, moved)
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_allclose(after[key], before[key], rtol=1e-4, atol=1e-4, err_msg=key)


@pytest.mark.usefixtures("float32_models")
@pytest.mark.parametrize("residual", ["none", "permutation"])
def test_align_takes_a_head_on_one_side_only(written, residual):
    base, cls = rj.load_hf(written["bert-base"]), rj.load_hf(written["bert-cls-1"])
    assert "head" in cls.params and "head" not in base.params
    for a, b in ((base, cls), (cls, base)):
        result = rj.align(a.params, b.params, rj.spec_for(a), residual=residual)
        assert rj.pytree.flatten(result.params).keys() == rj.pytree.flatten(b.params).keys()  # B's own leaves, its head included
        _assert_same_function(b, b.params, result.params)
        body = lambda p: {k: v for k, v in p.items() if k != "head"}
        assert result.report["before"] == rj.distance_report(rj.spec_for(b), body(a.params), body(b.params))["total"]
        assert result.report["after"]["total"] < result.report["before"]["total"]
        if "head" in b.params and residual == "none":  # nothing moves a head but the residual stream
            jax.tree.map(np.testing.assert_array_equal, result.params["head"], b.params["head"])
        # what was applied, applied again: the whole of B, its head too
        again = rj.apply_transform(result.bound, b.params, result.transforms)
        jax.tree.map(np.testing.assert_array_equal, again, result.params)


def test_align_takes_heads_of_other_label_sets_inside_jit(written):
    cls = rj.load_hf(written["bert-cls-1"])
    other = {**cls.params, "head": {"classifier": {"kernel": np.ones((32, 5), np.float32), "bias": np.zeros(5, np.float32)}}}
    spec = rj.bind(rj.spec_for(cls), other)
    eager = rj.align(cls.params, other, spec)
    jitted = jax.jit(lambda a, b: rj.align(a, b, spec).params)(cls.params, other)
    assert np.shape(jitted["head"]["classifier"]["kernel"]) == (32, 5)
    for p, x in rj.pytree.flatten(eager.params).items():
        np.testing.assert_allclose(np.asarray(rj.pytree.flatten(jitted)[p]), np.asarray(x), rtol=1e-5, atol=1e-5, err_msg=p)


@pytest.mark.usefixtures("float32_models")
def test_align_many_takes_a_base_without_the_head(written):
    cks = [rj.load_hf(written[n]) for n in ("bert-cls-1", "bert-cls-2", "bert-base")]
    many = rj.align_many([ck.params for ck in cks], rj.spec_for(cks[0]))
    for ck, moved in zip(cks, many.params):
        assert rj.pytree.flatten(moved).keys() == rj.pytree.flatten(ck.params).keys()
        _assert_same_function(ck, ck.params, moved)
    assert "head" not in many.reference  # the base has none: no head is common to all
    assert many.objective[-1] <= many.objective[0]
    two = rj.align_many([ck.params for ck in cks[:2]], rj.spec_for(cks[0]))
    np.testing.assert_allclose(np.asarray(two.reference["head"]["classifier"]["bias"]),
                               (np.asarray(two.params[0]["head"]["classifier"]["bias"]) + np.asarray(two.params[1]["head"]["classifier"]["bias"])) / 2,
                               rtol=1e-6)


# ---- the command line: refusals before any weight is read, messages, cards ------------------------

@pytest.fixture
def texts(tmp_path):
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": i % 3}) + "\n" for i, t in enumerate(["a b", "c d e", "f"])))
    return path


def _refused(argv, capsys) -> str:
    """The one-line error of a command that must fail with a usage error."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main([str(a) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv", [
    ["align", "{base}", "{cls}", "{out}"],
    ["align", "{base}", "{cls}", "{out}", "--max-memory", "3G"],
    ["align", "{base}", "{cls}", "{out}", "--dry-run"],
    ["merge", "--method", "average", "{cls}", "{cls2}", "{out}"],
    ["merge", "--method", "ties", "--base", "{base}", "{cls}", "{cls2}", "{out}"],
    ["merge", "--method", "ot_fusion", "{cls}", "{cls2}", "{out}"],
    ["merge", "--method", "ties", "--base", "{base}", "{cls}", "{cls2}", "{out}", "--max-memory", "3G"],
])
def test_an_existing_output_is_refused_before_any_weight_is_read(argv, written, tmp_path, capsys, no_weight_reads):
    names = {"base": written["bert-base"], "cls": written["bert-cls-1"], "cls2": written["bert-cls-2"]}
    earlier = tmp_path / "earlier"  # a checkpoint folder: replaced only with --overwrite
    shutil.copytree(written["gpt2-base"], earlier)
    err = _refused([a.format(**names, out=earlier) for a in argv], capsys)
    assert f"OUT: {earlier} exists; pass --overwrite to replace it" in err and "overwrite=True" not in err
    notes = tmp_path / "notes"  # anything else: never replaced, and no option is suggested
    notes.mkdir()
    (notes / "mine.txt").write_text("not the library's")
    for extra in ([], ["--overwrite"]):
        err = _refused([a.format(**names, out=notes) for a in argv] + extra, capsys)
        assert f"OUT: {notes} exists and is a folder that is not a checkpoint" in err and "choose another path" in err
    assert (notes / "mine.txt").read_text() == "not the library's"


def test_an_output_without_room_is_refused_before_any_weight_is_read(written, tmp_path, capsys, monkeypatch, no_weight_reads):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 1000, 1000))
    err = _refused(["align", written["bert-base"], written["bert-cls-1"], tmp_path / "out"], capsys)
    assert "GiB free, the output needs" in err and not (tmp_path / "out").exists()


def test_barrier_refuses_a_model_without_a_head_before_reading_weights(written, texts, tmp_path, capsys, no_weight_reads):
    for a, b in (("bert-base", "bert-cls-1"), ("bert-cls-1", "bert-base")):
        err = _refused(["barrier", written[a], written[b], "--data", texts, "--out", tmp_path / "curves"], capsys)
        assert f"{written['bert-base']} is a bert model without a task head: the loss along the path needs the logits of one" in err
    err = _refused(["barrier", written["bert-cls-1"], written["bert-cls-2"], "--data", texts, "--out", texts], capsys)
    assert f"--out {texts}: exists and is not a folder" in err
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "barrier.json").write_text("{}")
    err = _refused(["barrier", written["bert-cls-1"], written["bert-cls-2"], "--data", texts, "--out", earlier], capsys)
    assert "holds barrier.json (an earlier run?); pass --overwrite to replace them" in err
    with pytest.raises(rj.recipe.RecipeError, match="without a task head"):  # Python users get it too
        rj.recipe.loss_fn(rj.load_hf(written["bert-base"], weights=False), [{"input_ids": np.ones((1, 2), int), "labels": np.zeros(1, int)}])


def test_architecture_errors_say_what_differs_as_a_reader_says_it(written, tmp_path, capsys):
    """The depth, the leaves one model holds in its layers and the other not, the other shapes: not
    a list of every leaf of the layers one model lacks."""
    deeper = tmp_path / "deeper"
    _noisy(tf.BertModel(tf.BertConfig(**{**BERT, "num_hidden_layers": 4})), 3).save_pretrained(deeper)
    for extra in ([], ["--max-memory", "3G"]):
        err = _refused(["align", written["bert-base"], deeper, tmp_path / "out", *extra], capsys)
        assert f"does not have the architecture of A ({written['bert-base']}): 4 layers, A ({written['bert-base']})'s 3" in err
    wide = {"embeddings/word/embedding": (60, 32), "layers/0/mlp/up/kernel": (32, 48), "layers/0/attention/query/kernel": (32, 32)}
    other = {"embeddings/word/embedding": (61, 32), "layers/0/mlp/up/kernel": (32, 48), "layers/0/attention/query/bias": (32,)}
    message = architecture_mismatch(("A", "bert", wide), ("B", "bert", other))
    assert message == ("B does not have the architecture of A: it has ['layers/{i}/attention/query/bias'], which A has not; "
                       "it lacks ['layers/{i}/attention/query/kernel']; other shapes (its vs A's): embeddings/word/embedding (61, 32) vs (60, 32)")


def test_merge_cards_name_the_base_and_hold_the_distances(written, tmp_path):
    base, cls, cls2 = written["bert-base"], written["bert-cls-1"], written["bert-cls-2"]
    out = tmp_path / "ties"
    assert cli.main(["merge", "--method", "ties", "--base", str(base), "--param", "density=0.5", str(cls), str(cls2), str(out), "--quiet"]) == 0
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == str(base) and "merge" in front["tags"]
    assert "## Distances to the anchor" in card and "| model 1 (bert-cls-2) before alignment |" in card and "| merged, to the anchor |" in card
    report = json.loads((out / "rotsym_report.json").read_text())
    assert report["inputs"]["base"]["path"] == str(base) and set(report["inputs"]) == {"model 0", "model 1", "base"}
    assert set(report["result"]["alignment"]["distances"][0]["layers"]) == {"0", "1", "2"}  # per layer, as align's
    merged = report["result"]["merged_distance_to_anchor"]["total"]
    assert f"{merged:.4f}" in card
    out = tmp_path / "average"
    assert cli.main(["merge", "--method", "average", str(cls), str(cls2), str(out), "--quiet"]) == 0
    assert yaml.safe_load((out / "README.md").read_text().split("---")[1])["base_model"] == [str(cls), str(cls2)]


def test_align_times_the_attention_solve_and_the_assignments_apart(written, monkeypatch):
    """"attention" is the attention solve's own time, not the wait for the host assignments: with
    the assignments held up a second and no attention to solve, it stays well under that (a
    loaded machine may preempt the thread that times it for a while: half the hold is the margin)."""
    import time

    from rotsym_jax.solvers import assignment

    a, b = (rj.load_hf(written[n]).params for n in ("bert-cls-1", "bert-cls-2"))
    spec = rj.spec_for(rj.load_hf(written["bert-cls-1"], weights=False))
    assign = assignment.linear_assignments
    monkeypatch.setattr(assignment, "linear_assignments", lambda *args, **kwargs: (time.sleep(1.0), assign(*args, **kwargs))[1])
    timings = rj.align(a, b, spec, attention="none").report["timings"]
    assert timings["assignment"] >= 1.0 and timings["attention"] < 0.5, timings


def test_inspect_rows_sit_under_their_headings(written, capsys):
    assert cli.main(["inspect", str(written["bert-cls-1"]), str(written["bert-cls-2"])]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("distance", "before", "after", "layer"))]
    assert lines[0].startswith("distance") and any(line.startswith("layer 2 after") for line in lines)
    ends = {len(line) for line in lines}
    assert len(ends) == 1, lines  # every number right-aligned to its heading's end


def test_help_lists_the_merge_methods_and_describes_every_barrier_option(capsys):
    from rotsym_jax import merge

    with pytest.raises(SystemExit):
        cli.main(["merge", "--help"])
    text = capsys.readouterr().out
    assert all(f"  {name} " in text for name in merge.METHODS) and "density=0.2" in text
    with pytest.raises(SystemExit):
        cli.main(["barrier", "--help"])
    text = capsys.readouterr().out
    for option in ("--batch-size", "--max-length", "--text-field", "--label-field"):
        assert re.search(rf"{option} \S+\s+\w", text), option
    err = _refused(["align", "a", "b", "out", "--max-memroy", "3G"], capsys)  # named by the subcommand, with the close option
    assert err.startswith("rotsym align: error: unrecognized arguments: --max-memroy 3G (did you mean --max-memory?)")


def test_another_stems_class_of_this_config_is_read_by_its_suffix(tmp_path):
    """transformers writes Gemma3ForSequenceClassification (the multimodal stem) of a
    Gemma3TextConfig with gemma3_text's tensors; AutoModelForSequenceClassification reads it as
    Gemma3TextForSequenceClassification. Its head was taken for an LM head, and `score.weight`
    refused as unexpected (the new-user trial)."""
    config = tf.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    tf.Gemma3ForSequenceClassification(config).save_pretrained(tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    assert ck.layout.head == "sequence_classification"
    spec = rj.spec_for(ck)
    moved = rj.apply_transform(spec, ck.params, rj.random_transform(spec, ck.params, jax.random.key(0)))
    rj.save_hf(ck, moved, tmp_path / "moved")
    ids = torch.tensor([[5, 7, 11, 5, 3, 9], [8, 9, 4, 3, 2, 1]])
    logits = [tf.AutoModelForSequenceClassification.from_pretrained(tmp_path / f).eval()(input_ids=ids).logits.detach().numpy()
              for f in ("a", "moved")]
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-4, atol=1e-5 * np.abs(logits[0]).max())


def test_an_unfolded_rotation_with_heads_set_aside_is_told_to_fold_each_model(written):
    """An untied base and its classifier, unfolded: the final norm's readers are set aside, and
    the refusal blamed a tied LM head neither model has (the verification trial)."""
    base, cls = rj.load_hf(written["llama-lm"]), rj.load_hf(written["llama-cls"])
    with pytest.raises(rj.InputError, match=r"a head held by one model only takes it once each model is folded with its own spec"):
        rj.align(base.params, cls.params, rj.spec_for(cls), residual="rotation")
    folded = [rj.fold_norms(rj.spec_for(ck), ck.params) for ck in (base, cls)]
    assert rj.align(*folded, rj.spec_for(cls), residual="rotation").report["after"]["total"] > 0
