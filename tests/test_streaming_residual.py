"""The residual stream aligned on the streaming path (`streaming._descent.ResidualDescent`): `align`'s
coordinate descent a pass over the chunks at a time. Permutations (signed too) and rotations give
the bits of the command's in-memory alignment (the stream's cross products summed a layer at a
time, then the layers in order, on both paths); a planted stream is recovered."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from checkpoint_utils import assert_same_checkpoint, save_random
from moved_utils import assert_reports

import rotsym_jax as rj
from rotsym_jax import cli, hf, merge, streaming
from rotsym_jax.engine.distances import distance_report
from rotsym_jax.pipeline import aligning_spec
from rotsym_jax.transforms import KINDS

LLAMA = dict(model_type="llama", vocab_size=60, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, max_position_embeddings=16, tie_word_embeddings=False)
CONFIGS = {
    "llama": (LLAMA, "lm"),
    # a score head reads the stream: B's moves with T, though the solve leaves it out (`aligning_spec`)
    "llama-cls": ({**LLAMA, "num_hidden_layers": 3, "num_labels": 3, "pad_token_id": 0}, "sequence_classification"),
    "gpt2": (dict(model_type="gpt2", vocab_size=60, n_embd=32, n_layer=3, n_head=4, n_positions=16), "lm"),  # tied embeddings
    "bert": (dict(model_type="bert", vocab_size=60, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
                  max_position_embeddings=16, num_labels=3), "sequence_classification"),  # post-LN, a pooler
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-residual")

    def pair(family):
        raw, head = CONFIGS[family]
        return [save_random(raw, head, seed, root / f"{family}-{seed}", pooler=family == "bert", **({"max_shard_bytes": 6000} if seed else {}))
                for seed in (0, 1, 2)]

    return {family: pair(family) for family in CONFIGS}


def _logits(path) -> np.ndarray:
    ck = rj.load_hf(path)
    ids = np.random.default_rng(0).integers(3, 60, size=(2, 7))
    with jax.default_matmul_precision("highest"):
        return np.asarray(ck.apply(ck.params, input_ids=ids, attention_mask=np.ones_like(ids))["logits"])


def _same_transforms(want: dict, got: dict) -> None:
    assert set(want) == set(got)
    for name, t in want.items():
        for x, y in zip(jax.tree.leaves(t), jax.tree.leaves(got[name]), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


@pytest.mark.parametrize("family, mode, chunk", [
    ("llama", "permutation", 2),  # two lanes: the layers' cross products arrive in any order
    ("llama", "signed_permutation", 1),
    ("llama-cls", "signed_permutation", 2),
    pytest.param("gpt2", "permutation", 1, marks=pytest.mark.slow),
    pytest.param("bert", "permutation", 2, marks=pytest.mark.slow),
])
def test_residual_permutations_stream_bit_for_bit_as_the_command_aligns_in_memory(family, mode, chunk, models, tmp_path):
    a, b, _ = models[family]
    ca, cb = rj.load_hf(a), rj.load_hf(b)
    want = rj.align(ca.params, cb.params, aligning_spec(cb), residual=mode, heads="permute")
    hf.save_hf(cb, want.params, tmp_path / "memory")
    calls = []
    got = streaming.align_to_disk(a, b, tmp_path / "stream", chunk_layers=chunk, residual=mode, heads="permute", progress=lambda *c: calls.append(c))
    assert_same_checkpoint(got.path, tmp_path / "memory")
    assert calls[-1][0] == calls[-1][1] and all(a[0] < b[0] for a, b in zip(calls, calls[1:]))  # the sweeps not taken counted done
    for key in ("before", "after", "layers", "residual", "moved"):
        assert got.report[key] == want.report[key], key
    _same_transforms(want.transforms, got.transforms[0])
    assert got.report["after"]["total"] < got.report["before"]["total"]
    np.testing.assert_allclose(_logits(got.path), _logits(b), rtol=1e-5, atol=1e-5)  # B's function, B's head moved with the stream
    # the dry run's plan is the run's, and counts the descent's (d, d) cross products
    plan = streaming.plan_align(a, b, chunk_layers=chunk, residual=mode)
    assert got.report["streaming"] == dataclasses.asdict(plan)
    assert plan.peak_bytes > streaming.plan_align(a, b, chunk_layers=chunk).peak_bytes


def test_a_planted_stream_and_every_group_are_recovered(models, tmp_path):
    """B is A moved by random groups and a random signed permutation of the stream: the streamed
    descent brings it back onto A, the planted stream exactly undone."""
    a, _, _ = models["llama"]
    ck = rj.load_hf(a)
    spec = rj.spec_for(ck)
    planted = {**rj.random_transform(spec, ck.params, jax.random.key(2), KINDS),
               "residual": rj.random_residual(spec, ck.params, jax.random.key(3), "signed_permutation")}
    hf.save_hf(ck, rj.apply_transform(spec, ck.params, planted), tmp_path / "planted")
    got = streaming.align_to_disk(a, tmp_path / "planted", tmp_path / "out", chunk_layers=2, residual="signed_permutation",
                                  heads="permute", rescale="joint")
    before, after = got.report["before"]["total"], got.report["after"]["total"]
    assert after <= 1e-6 * before, (before, after)
    undone = np.asarray(planted["residual"].matrix()) @ np.asarray(got.transforms[0]["residual"].matrix())
    np.testing.assert_array_equal(undone, np.eye(len(undone)))  # the planted signed permutation, exactly undone
    assert_reports(got.report["moved"], rj.bind(spec, ck.params), planted)  # the report says what moved: what was planted


@pytest.mark.slow  # ~15 s: every sweep of a rotation descends
def test_residual_rotation_streams_bit_for_bit_as_align_and_folds_as_it_reads(models, tmp_path):
    a, b, _ = models["llama"]
    folded = []
    for i, path in enumerate((a, b)):
        ck = rj.load_hf(path)
        hf.save_hf(ck, rj.fold_norms(rj.spec_for(ck), ck.params), tmp_path / f"folded-{i}")
        folded.append(tmp_path / f"folded-{i}")
    ca, cb = (rj.load_hf(p) for p in folded)
    want = rj.align(ca.params, cb.params, aligning_spec(cb), residual="rotation", residual_sweeps=3)
    # three sweeps, each still descending: the descent ends at the last, measured after it
    got = streaming.align_to_disk(*folded, tmp_path / "stream", chunk_layers=2, residual="rotation", residual_sweeps=3)
    sweeps = got.report["residual"]["distance_per_sweep"]
    assert len(sweeps) == 3 and sweeps[2] < sweeps[1] < sweeps[0]
    assert sweeps == want.report["residual"]["distance_per_sweep"]  # the cross products were summed in another order: 1e-7 apart
    _same_transforms(want.transforms, got.transforms[0])
    np.testing.assert_allclose(_logits(got.path), _logits(folded[1]), rtol=1e-4, atol=1e-4)
    # unfolded folders are folded as they are read (`Source(fold=True)`): the same descent
    unfolded = streaming.align_to_disk(a, b, tmp_path / "unfolded", chunk_layers=2, residual="rotation", residual_sweeps=3)
    assert unfolded.report["residual"]["distance_per_sweep"] == sweeps


def test_merge_with_the_residual_stream_streams_bit_for_bit(models, tmp_path):
    a, b, _ = models["llama"]
    ca, cb = rj.load_hf(a), rj.load_hf(b)
    moved = rj.align(ca.params, cb.params, aligning_spec(cb), residual="permutation").params
    hf.save_hf(ca, jax.device_get(merge.merge("average", [ca.params, moved])), tmp_path / "memory")
    got = streaming.merge_to_disk("average", [a, b], tmp_path / "stream", align_options={"residual": "permutation"}, chunk_layers=2)
    assert_same_checkpoint(got.path, tmp_path / "memory")
    distances = got.report["alignment"]["distances"][0]
    assert distances["after"]["total"] < distances["before"]["total"]


def test_the_sum_of_the_layers_is_taken_in_one_order_whatever_the_arrival():
    """Values of a wide range, added in shuffled orders, eagerly or held until the sum before
    them is known (a later process's share): always the bits of c_0 + c_1 + ... in order."""
    rng = np.random.default_rng(0)
    values = [(rng.normal(size=(4, 4)) * 10.0 ** rng.integers(-6, 6, size=(4, 4))).astype(np.float32) for _ in range(9)]
    ordered = values[0]
    for v in values[1:]:
        ordered = ordered + v
    for seed in range(3):
        order = np.random.default_rng(seed).permutation(9)
        eager = streaming._lanes.OrderedSum(range(9), eager=True)
        for k in order:
            eager.add(k, values[k])
        np.testing.assert_array_equal(eager.total(), ordered)
        first, rest = streaming._lanes.OrderedSum(range(4), eager=True), streaming._lanes.OrderedSum(range(4, 9), eager=False)
        for k in order:
            (first if k < 4 else rest).add(k, values[k])
        np.testing.assert_array_equal(rest.total(first.total()), ordered)
    assert rj.processes.Team().in_order(lambda before: (before, 5)) == (None, 5)  # one process: process 0's step, from nothing


def test_command_line_streams_the_residual_stream_and_refuses_what_it_cannot(models, tmp_path, capsys):
    a, b, _ = models["llama"]
    residual = ["--residual", "signed_permutation", "--quiet"]
    assert cli.main(["align", str(a), str(b), str(tmp_path / "memory"), *residual]) == 0
    assert cli.main(["align", str(a), str(b), str(tmp_path / "stream"), *residual, "--max-memory", "4G"]) == 0
    assert_same_checkpoint(tmp_path / "stream", tmp_path / "memory")
    memory, stream = (json.loads((tmp_path / name / "rotsym_report.json").read_text())["result"] for name in ("memory", "stream"))
    assert stream["residual"] == memory["residual"] and "streaming" in stream
    # a rotation streams too, each tensor read with the norm gains folded: the bits of the run in
    # memory (which summed the stream's cross products in another order: 1e-7 apart, 1.3e-5 of a leaf
    # once the solved rotation amplified it)
    rotation = ["--residual", "rotation", "--quiet"]
    assert cli.main(["align", str(a), str(b), str(tmp_path / "rotation-memory"), *rotation]) == 0
    assert cli.main(["align", str(a), str(b), str(tmp_path / "rotation-stream"), *rotation, "--max-memory", "4G"]) == 0
    assert_same_checkpoint(tmp_path / "rotation-stream", tmp_path / "rotation-memory")
    memory, stream = (json.loads((tmp_path / name / "rotsym_report.json").read_text())["result"] for name in ("rotation-memory", "rotation-stream"))
    assert stream["residual"] == memory["residual"] and stream["after"] == memory["after"]
    assert not np.allclose(rj.load_hf(tmp_path / "rotation-memory").params["layers"][0]["attention_norm"]["scale"],
                           rj.load_hf(b).params["layers"][0]["attention_norm"]["scale"])


def test_big_leaves_outside_the_layers_move_with_the_stream_in_row_blocks(models, tmp_path):
    """block_bytes small: the embeddings and the LM head are read, scored, moved and merged in row
    blocks (the LM head's rows are columns of our kernel): the weights of the whole leaves."""
    a, b, _ = models["llama"]
    ca, cb = rj.load_hf(a), rj.load_hf(b)
    want = rj.align(ca.params, cb.params, aligning_spec(cb), residual="signed_permutation")
    hf.save_hf(cb, want.params, tmp_path / "memory")
    got = streaming.align_to_disk(a, b, tmp_path / "stream", chunk_layers=3, residual="signed_permutation", block_bytes=1024)
    assert_same_checkpoint(got.path, tmp_path / "memory")
    _same_transforms(want.transforms, got.transforms[0])
    # summed on the host in float64 for the blocked leaves: equal to float32 rounding
    np.testing.assert_allclose(got.report["after"]["total"], want.report["after"]["total"], rtol=1e-6)
    hf.save_hf(ca, jax.device_get(merge.merge("average", [ca.params, want.params])), tmp_path / "merged-memory")
    merged = streaming.merge_to_disk("average", [a, b], tmp_path / "merged", align_options={"residual": "signed_permutation"},
                                     chunk_layers=3, block_bytes=1024)
    assert_same_checkpoint(merged.path, tmp_path / "merged-memory")


def test_a_merge_measures_the_merged_model_to_the_anchor_in_one_frame_on_both_paths(models, tmp_path, capsys):
    """With a rotation of the stream every model's norms are folded before the merge: the merged
    model's distance to the anchor is measured to the anchor folded, in memory as streamed (in
    memory it was to the anchor as stored, 5.29 against 2.98 streamed in a new-user trial)."""
    a, b, _ = models["llama"]
    reports = {}
    for where, extra in (("memory", []), ("stream", ["--max-memory", "3G"])):
        out = tmp_path / where
        assert cli.main(["merge", "--method", "average", "--residual", "rotation", str(a), str(b), str(out), *extra]) == 0
        assert "note: --residual rotation folds every model's norm gains" in capsys.readouterr().err  # the frame, said
        reports[where] = json.loads((out / "rotsym_report.json").read_text())["result"]["merged_distance_to_anchor"]["total"]
    ck = rj.load_hf(a)
    spec = rj.spec_for(ck)
    want = distance_report(spec, rj.fold_norms(spec, ck.params), rj.load_hf(tmp_path / "memory").params)["total"]["total"]
    unfolded = distance_report(spec, ck.params, rj.load_hf(tmp_path / "memory").params)["total"]["total"]
    assert reports["memory"] == pytest.approx(want, rel=1e-6) and reports["stream"] == pytest.approx(want, rel=1e-5)
    assert abs(unfolded - want) > 1e-3 * want  # the gains are not all one: the frame shows
