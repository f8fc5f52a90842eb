"""The streaming path (rotsym_jax.streaming): disk to disk, a few layers at a time, bit for bit
the in-memory `align` / `merge` + `save_hf`, and its refusals before any heavy work."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from checkpoint_utils import assert_same_checkpoint, save_random
from moved_utils import assert_nothing_moved

import rotsym_jax as rj
from rotsym_jax import cli, hf, merge, streaming
from rotsym_jax.merging import arithmetic
from rotsym_jax.merging import registry as merge_registry
from rotsym_jax.pytree import flatten

CONFIGS = {
    # 5 layers in chunks of 2: the last chunk holds one layer (the case XLA multiplies differently)
    "llama": (dict(model_type="llama", vocab_size=60, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=48, max_position_embeddings=16, tie_word_embeddings=False), "lm"),
    "gpt2": (dict(model_type="gpt2", vocab_size=60, n_embd=32, n_layer=3, n_head=4, n_positions=16), "lm"),
    "bert": (dict(model_type="bert", vocab_size=60, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
                  max_position_embeddings=16, num_labels=3), "sequence_classification"),
}


def _save(family, seed, folder, **kwargs):
    raw, head = CONFIGS[family]
    return save_random(raw, head, seed, folder, pooler=family == "bert", **kwargs)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    out = {}
    for family in CONFIGS:
        # B sharded (several files and an index), A in one file
        out[family] = [_save(family, 0, root / f"{family}-a"), _save(family, 1, root / f"{family}-b", max_shard_bytes=6000),
                       _save(family, 2, root / f"{family}-base")]
    return out


def _in_memory_align(a, b, out, **options):
    ca, cb = rj.load_hf(a), rj.load_hf(b)
    body = lambda p: {k: v for k, v in p.items() if k != "head"}
    result = rj.align(body(ca.params), body(cb.params), rj.spec_for(cb), **options)
    hf.save_hf(cb, {**result.params, **{k: v for k, v in cb.params.items() if k == "head"}}, out)
    return result


@pytest.mark.parametrize("family, chunk, options", [
    ("llama", 2, {}),
    ("llama", 1, {}),  # a lone layer: its rotations go twice, its permutations once (`_moved`)
    # ~20-30 s each (compilation of each family's shapes): slow
    pytest.param("gpt2", 1, {"heads": "permute"}, marks=pytest.mark.slow),
    pytest.param("bert", 2, {"rescale": "joint", "layers": [0, 2]}, marks=pytest.mark.slow),
])
def test_align_to_disk_equals_align_in_memory_bit_for_bit(family, chunk, options, models, tmp_path):
    a, b, _ = models[family]
    want = _in_memory_align(a, b, tmp_path / "memory", **options)
    got = streaming.align_to_disk(a, b, tmp_path / "stream", chunk_layers=chunk, **options)
    assert_same_checkpoint(got.path, tmp_path / "memory")
    for key in ("before", "after", "layers", "chosen", "moved"):
        assert got.report[key] == want.report[key], key
    for name, t in want.transforms.items():
        for x, y in zip(jax.tree.leaves(t), jax.tree.leaves(got.transforms[0][name])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert got.report["after"]["total"] < got.report["before"]["total"]  # the comparison above can fail: it moved


def test_a_model_aligned_to_itself_reports_that_nothing_moved(models, tmp_path, capsys):
    """The solvers' own result on B = A (no fallback to keep the identity for them): report["moved"]
    says no layer of any group moved, in memory and streamed alike, and the command line says so."""
    a, _, _ = models["llama"]
    want = _in_memory_align(a, a, tmp_path / "memory", fallback=False)
    got = streaming.align_to_disk(a, a, tmp_path / "stream", chunk_layers=2, fallback=False)
    assert got.report["moved"] == want.report["moved"] and set(want.report["moved"]) == {"attn", "ffn"}
    assert_nothing_moved(want.report["moved"])
    from rotsym_jax.cli import commands

    commands._print_moved([("B", want.report["moved"])])
    assert capsys.readouterr().out.splitlines()[1:3] == ["  attn    0/5 layers: nothing moved", "  ffn     0/5 layers: nothing moved"]


def test_a_failing_chunk_stops_the_chunks_in_flight(models, tmp_path, monkeypatch):
    """A chunk whose write fails (a full disk) stops the other lane at its next chunk: the error
    is raised once both have stopped, and nothing is published."""
    a, b, _ = models["llama"]
    written, write = [], streaming._align.write_tensor

    def failing(writer, clock, name, rule, leaves, out_dtype):
        if rule.hf.startswith("model.layers.0."):
            raise OSError(28, "No space left on device (planted)")
        written.append(rule.hf)
        return write(writer, clock, name, rule, leaves, out_dtype)

    monkeypatch.setattr(streaming._align, "write_tensor", failing)
    with pytest.raises(OSError, match="planted"):
        streaming.align_to_disk(a, b, tmp_path / "out", chunk_layers=1)
    layers_written = {name.split(".")[2] for name in written if name.startswith("model.layers.")}
    assert len(layers_written) < 4, layers_written  # the other lane did not go on through every chunk
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_chunks_in_flight_give_the_bits_of_one_at_a_time(models, tmp_path):
    """Two chunks in flight (their reads, host assignments and device work overlapping, finishing
    in any order) against one at a time, which a budget just below two chunks' peak forces: the
    same files, distances and transforms; the overlapped run accounts its extra seconds."""
    a, b, _ = models["llama"]
    two = streaming.plan_align(a, b, chunk_layers=1)
    assert two.in_flight == 2
    one = streaming.plan_align(a, b, max_memory=two.peak_bytes - 1)
    assert (one.in_flight, one.chunk_layers) == (1, 1) and one.peak_bytes < two.peak_bytes
    got_two = streaming.align_to_disk(a, b, tmp_path / "two", chunk_layers=1, heads="permute")
    got_one = streaming.align_to_disk(a, b, tmp_path / "one", max_memory=two.peak_bytes - 1, heads="permute")
    assert (got_two.plan.in_flight, got_one.plan.in_flight) == (2, 1)
    assert_same_checkpoint(got_two.path, got_one.path)
    assert got_two.report["after"] == got_one.report["after"] and got_two.report["before"] == got_one.report["before"]
    for name, t in got_one.transforms[0].items():
        for x, y in zip(jax.tree.leaves(t), jax.tree.leaves(got_two.transforms[0][name])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert got_one.report["timings"]["overlap"] == 0 and got_two.report["timings"]["overlap"] >= 0



def test_lanes_of_one_device_take_turns_to_compute_while_the_other_reads(models, tmp_path, monkeypatch):
    """Two chunks in flight on one device: at most one lane computes (holds a chunk's working set)
    at a time, and a lane reads its next chunk while the other computes. Slowed-down steps make
    both observable: without the turn, both lanes compute at once."""
    a, b, _ = models["llama"]
    assert len(jax.local_devices()) == 1
    lock, state = threading.Lock(), {"computing": 0, "most": 0, "read_while_computing": 0}
    sq, leaves = streaming._merge.sq_of, streaming._source.Source.leaves

    def computing(*args):
        with lock:
            state["computing"] += 1
            state["most"] = max(state["most"], state["computing"])
        time.sleep(0.05)
        try:
            return sq(*args)
        finally:
            with lock:
                state["computing"] -= 1

    def reading(self, *args, **kwargs):
        with lock:
            state["read_while_computing"] += state["computing"] > 0
        time.sleep(0.02)
        return leaves(self, *args, **kwargs)

    monkeypatch.setattr(streaming._merge, "sq_of", computing)
    monkeypatch.setattr(streaming._source.Source, "leaves", reading)
    got = streaming.merge_to_disk("average", [a, b], tmp_path / "out", align="anchor", chunk_layers=1)
    assert got.plan.in_flight == 2
    assert state["most"] == 1 and state["read_while_computing"] > 0, state

def _in_memory_merge(method, paths, out, base=None, params=None, align=True, task_head="anchor"):
    cks = [rj.load_hf(p) for p in paths]
    body = lambda p: {k: v for k, v in p.items() if k != "head"}
    bodies = [body(ck.params) for ck in cks]
    moved = [cks[0].params] + ([{**rj.align(bodies[0], b, rj.spec_for(cks[0])).params, **{k: v for k, v in ck.params.items() if k == "head"}}
                               for b, ck in zip(bodies[1:], cks[1:])] if align else [ck.params for ck in cks[1:]])
    extra = {}
    if base is not None:
        bp = rj.load_hf(base).params
        extra["base"] = {**bp, "head": cks[0].params["head"]} if task_head == "anchor" and "head" in cks[0].params else bp
    if method == "dare":
        extra["key"] = jax.random.key(0)
    merged = merge.merge(method, moved, task_head=task_head, **extra, **(params or {}))
    hf.save_hf(cks[0], merged, out)
    distance = rj.distance_report(rj.spec_for(cks[0]), jax.device_get(cks[0].params), jax.device_get(merged))["total"]
    return distance


@pytest.mark.parametrize("method, params, family", [
    ("average", {}, "llama"),
    pytest.param("ties", {"density": 0.5}, "bert", marks=pytest.mark.slow),
    ("dare", {"drop": 0.5}, "llama"),
    pytest.param("slerp", {"t": 0.3}, "gpt2", marks=pytest.mark.slow),
    ("task_arithmetic", {"lam": 0.7}, "llama"),
])
def test_merge_to_disk_equals_the_in_memory_merge_bit_for_bit(method, params, family, models, tmp_path):
    a, b, base = models[family]
    base = base if method in ("ties", "dare", "task_arithmetic") else None
    distance = _in_memory_merge(method, [a, b], tmp_path / "memory", base=base, params=params)
    got = streaming.merge_to_disk(method, [a, b], tmp_path / "stream", base=base, params=params, chunk_layers=2)
    assert_same_checkpoint(got.path, tmp_path / "memory")
    assert got.report["merged_distance_to_anchor"] == distance


def test_merge_options_as_an_object_or_as_keywords(models, tmp_path, no_weight_reads):
    """`merge_to_disk(method, models, out, MergeOptions(...), stream=StreamOptions(...))` is the
    keyword call, bit for bit; keywords name either object's fields, over the object; a keyword of
    neither, or a bad value, is refused by name before any weight is read."""
    a, b, base = models["llama"]
    options = rj.MergeOptions(params={"density": 0.5}, seed=3, align_options=rj.AlignOptions(heads="permute"))
    with pytest.raises(streaming.StreamingError, match=r"unknown options \['densty'\]; the merge options are \['align', 'align_options'"):
        streaming.merge_to_disk("ties", [a, b], tmp_path / "x", options, base=base, densty=0.5)
    with pytest.raises(streaming.StreamingError, match=r"align='sideways'; choose one of \('none', 'anchor', 'many'\)"):
        streaming.merge_to_disk("ties", [a, b], tmp_path / "x", options, base=base, align="sideways")
    with pytest.raises(streaming.StreamingError, match=r"unknown align options \['head'\]"):
        streaming.plan_merge("ties", [a, b], base=base, align_options={"head": "permute"})
    with pytest.raises(streaming.StreamingError, match=r"task_head='both'; choose one of"):
        streaming.plan_merge("ties", [a, b], options, base=base, task_head="both")
    with pytest.raises(streaming.StreamingError, match=r"overwrite='yes'; expected True or False"):
        streaming.merge_to_disk("ties", [a, b], tmp_path / "x", options, base=base, overwrite="yes")
    with pytest.raises(streaming.StreamingError, match=r"progress=3; expected None or a function progress\(done, total\)"):
        streaming.merge_to_disk("ties", [a, b], tmp_path / "x", options, base=base, stream={"progress": 3})


def test_merge_options_object_and_keywords_write_the_same_bits(models, tmp_path):
    a, b, base = models["llama"]
    options = rj.MergeOptions(params={"density": 0.5}, align_options=rj.AlignOptions(heads="permute"))
    calls = []
    by_object = streaming.merge_to_disk("ties", [a, b], tmp_path / "object", options, base=base,
                                        stream=rj.StreamOptions(chunk_layers=2, progress=lambda *c: calls.append(c)))
    assert calls and calls[-1][0] == calls[-1][1]  # the object's progress, told of every chunk
    by_keywords = streaming.merge_to_disk("ties", [a, b], tmp_path / "keywords", base=base, params={"density": 0.5},
                                          align_options={"heads": "permute"}, chunk_layers=2)
    assert_same_checkpoint(by_object.path, by_keywords.path)
    assert by_object.plan == by_keywords.plan and by_object.plan.chunk_layers == 2
    # a keyword over the object: the plan of another chunk size
    assert streaming.plan_merge("ties", [a, b], options, base=base, chunk_layers=1).chunk_layers == 1


def _norm_kept_mean(params_list, *, scale: float = 1.0, task_head="anchor"):
    """A user's method, tensor by tensor: the mean rescaled to the anchor's norm (times `scale`)."""
    def leaf(*xs):
        mean = sum(x.astype(np.float32) for x in xs) / len(xs)
        return (mean * (scale * np.linalg.norm(np.asarray(xs[0], np.float32)) / max(np.linalg.norm(mean), 1e-12))).astype(xs[0].dtype)
    merged = jax.tree.map(lambda *xs: leaf(*map(np.asarray, xs)), *params_list)
    return {**merged, "head": params_list[0]["head"]} if task_head == "anchor" and "head" in params_list[0] else merged


def test_a_registered_method_streams_when_it_declares_itself_tensor_wise(models, tmp_path, monkeypatch):
    """A method added with `register` is merged a chunk of layers at a time when its granularity
    says a leaf's result reads only that leaf ("tensor"): the same bits as in memory. Left at
    "model" (the default) it is refused by name before any weight is read."""
    declared = {"scale": merge.Param("scale", float, 1.0, "norm relative to the anchor's", low=0.0, low_open=True)}
    user = merge.Method("norm_kept_mean", _norm_kept_mean, declared, granularity="tensor")
    monkeypatch.setitem(merge_registry._VOCABULARIES["rotsym"], user.name, user)  # registered for this test only
    assert "norm_kept_mean" in streaming.streamed_methods()
    a, b, _ = models["llama"]
    distance = _in_memory_merge("norm_kept_mean", [a, b], tmp_path / "memory", params={"scale": 0.9})
    got = streaming.merge_to_disk("norm_kept_mean", [a, b], tmp_path / "stream", params={"scale": 0.9}, chunk_layers=2)
    assert_same_checkpoint(got.path, tmp_path / "memory")
    assert got.report["merged_distance_to_anchor"] == distance
    plain = streaming.merge_to_disk("average", [a, b], tmp_path / "average", chunk_layers=2)  # the check above can fail
    assert plain.report["merged_distance_to_anchor"] != distance
    whole = merge.Method("norm_kept_mean_whole", _norm_kept_mean, declared)
    monkeypatch.setitem(merge_registry._VOCABULARIES["rotsym"], whole.name, whole)
    with pytest.raises(streaming.StreamingError, match=r"method 'norm_kept_mean_whole' is not streamed: it needs every model whole "
                                                       r"\(its granularity is 'model'\); streamed methods: \[.*'norm_kept_mean'"):
        streaming.merge_to_disk("norm_kept_mean_whole", [a, b], tmp_path / "refused")
    with pytest.raises(streaming.StreamingError, match="'norm_kept_mean' has no parameter 'lam'"):
        streaming.merge_to_disk("norm_kept_mean", [a, b], tmp_path / "refused", params={"lam": 1.0})
    assert not (tmp_path / "refused").exists()
    assert rj.pipeline.unstreamed({}, "norm_kept_mean_whole", "anchor") == (
        "the merge method 'norm_kept_mean_whole' is not streamed: it needs every model whole (its granularity is 'model')")
    assert rj.pipeline.unstreamed({}, "norm_kept_mean", "anchor") is None


def _batches(family, count=2, size=2, tokens=6):
    """Batches of model inputs with labels (per token for an LM head, per example otherwise) and
    some padding, as `stats.fisher` / `stats.grams` take them."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        ids = rng.integers(0, 60, size=(size, tokens)).astype(np.int32)
        mask = np.ones_like(ids)
        mask[-1, tokens - 2:] = 0
        if CONFIGS[family][1] == "lm":
            labels = np.full_like(ids, -100)
            labels[:, :-1] = np.where(mask[:, 1:] > 0, ids[:, 1:], -100)
        else:
            labels = rng.integers(0, 3, size=size).astype(np.int32)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _in_memory_statistics_merge(method, paths, out, batches, params=None, align=True, weights=None):
    """What `rotsym merge` does in memory for fisher / regmean: statistics of each model as
    aligned (its own head kept), then merge.fisher / merge.regmean, then save_hf."""
    cks = [rj.load_hf(p) for p in paths]
    body = lambda p: {k: v for k, v in p.items() if k != "head"}
    bodies = [body(ck.params) for ck in cks]
    moved = [cks[0].params] + ([{**rj.align(bodies[0], b, rj.spec_for(cks[0])).params, **{k: v for k, v in ck.params.items() if k == "head"}}
                               for b, ck in zip(bodies[1:], cks[1:])] if align else [ck.params for ck in cks[1:]])
    if method == "fisher":
        merged = merge.fisher(moved, [rj.stats.fisher(ck, p, batches) for ck, p in zip(cks, moved)], weights, **(params or {}))
    else:
        merged = merge.regmean(moved, [rj.stats.grams(ck, p, batches) for ck, p in zip(cks, moved)], **(params or {}))
    hf.save_hf(cks[0], merged, out)
    return rj.distance_report(rj.spec_for(cks[0]), jax.device_get(cks[0].params), jax.device_get(merged))["total"]


def _leftovers(folder) -> list:
    return sorted(p.name for p in Path(folder).iterdir() if p.name.startswith((".rotsym-stats", ".rotsym-tmp")))


@pytest.mark.parametrize("method, params, family, chunk, block", [
    ("fisher", {"eps": 1e-6}, "llama", 2, None),
    ("regmean", {"alpha": 0.9, "jitter": 0.01}, "llama", 2, None),
    # block_bytes small: the embeddings and the LM head in row blocks (Fisher: with their Fisher's
    # rows; RegMean: the embeddings averaged in blocks, the LM head, a kernel with a Gram, whole)
    ("fisher", {}, "llama", 3, 1024),
    ("regmean", {}, "llama", 5, 1024),
    # another family (a classification head, kept from the anchor): ~20-30 s each (compilation), slow
    pytest.param("regmean", {"alpha": 0.5}, "bert", 2, None, marks=pytest.mark.slow),
    pytest.param("fisher", {}, "bert", 1, None, marks=pytest.mark.slow),
])
def test_statistics_merges_stream_bit_for_bit(method, params, family, chunk, block, models, tmp_path):
    a, b, _ = models[family]
    batches = _batches(family)
    with warnings.catch_warnings(record=True) as in_memory:
        warnings.simplefilter("always")
        distance = _in_memory_statistics_merge(method, [a, b], tmp_path / "memory", batches, params=params)
    with warnings.catch_warnings(record=True) as streamed:
        warnings.simplefilter("always")
        got = streaming.merge_to_disk(method, [a, b], tmp_path / "stream", params=params, batches=batches, chunk_layers=chunk, block_bytes=block)
    assert_same_checkpoint(got.path, tmp_path / "memory")
    # RegMean's growth warning (4 examples leave these Grams singular) once for the whole merge, as in memory, not once a chunk
    grown = [[str(w.message) for w in caught if str(w.message).startswith("regmean:")] for caught in (in_memory, streamed)]
    assert grown[0] == grown[1] and len(grown[0]) == (method == "regmean" and params.get("alpha", 1.0) == 1.0), grown
    assert got.report["merged_distance_to_anchor"] == pytest.approx(distance, rel=1e-6)
    if block is None:
        assert got.report["merged_distance_to_anchor"] == distance
    assert got.report["statistics"]["examples"] == 4 and got.plan.statistics_bytes > 0
    assert _leftovers(tmp_path) == []  # the spilled statistics are gone


def test_orbax_inputs_stream_through_every_pass_as_their_folders_do(models, tmp_path):
    """The same models saved by Orbax: a streamed align (the residual descent's passes, the norm
    gains folded as read) and a RegMean merge (its statistics pass loads each model whole) write
    the tensors of the Hugging Face folders' runs."""
    a, b, _ = models["llama"]
    for name, folder in (("a", a), ("b", b)):
        ck = rj.load_hf(folder)
        rj.save_orbax(ck, ck.params, tmp_path / f"orbax-{name}")
    oa, ob = tmp_path / "orbax-a", tmp_path / "orbax-b"
    want = streaming.align_to_disk(a, b, tmp_path / "hf", chunk_layers=2, residual="rotation")
    got = streaming.align_to_disk(oa, ob, tmp_path / "orbax", chunk_layers=2, residual="rotation")
    assert_same_checkpoint(got.path, want.path)
    assert got.report["after"] == want.report["after"] and got.report["chosen"] == want.report["chosen"]
    batches = _batches("llama")
    want = streaming.merge_to_disk("regmean", [a, b], tmp_path / "hf-regmean", batches=batches, chunk_layers=2)
    got = streaming.merge_to_disk("regmean", [oa, ob], tmp_path / "orbax-regmean", batches=batches, chunk_layers=2)
    assert_same_checkpoint(got.path, want.path)


@pytest.mark.parametrize("residual", ["none", "rotation"])
def test_activation_matching_streams_as_align_does(residual, models, tmp_path):
    """method="activations" streamed (each model whole in turn, its sites spilled, solved a chunk
    at a time, the fallback scored on merged models built a chunk at a time) against the
    command line's in-memory align (`pipeline.align_pair`, the gains folded for a rotation): the
    same tensors, distances and choice, each candidate's loss to float32 rounding."""
    a, b, _ = models["llama"]
    ca, cb = rj.load_hf(a), rj.load_hf(b)
    batches = [{k: v for k, v in batch.items() if k != "labels"} for batch in _batches("llama", count=3, size=2, tokens=8)]
    options = rj.AlignOptions(method="activations", residual=residual)
    params_a, params_b = rj.pipeline.folded([ca.params, cb.params], cb, {"residual": residual})
    want = rj.pipeline.align_pair(params_a, params_b, cb, options, batches, 0, rj.pipeline.Progress())
    hf.save_hf(cb, want.params, tmp_path / "memory")
    # "auto" settles to the rotation a Llama allows, its gains folded as read, and says so
    given = dataclasses.replace(options, residual="auto") if residual == "rotation" else options
    got = streaming.align_to_disk(a, b, tmp_path / "stream", given, data=batches, chunk_layers=2)
    assert_same_checkpoint(got.path, tmp_path / "memory")
    assert ("settled" in got.report) == (residual == "rotation") and got.report.get("settled", {}).get("residual", "rotation") == "rotation"
    for key in ("before", "after", "layers"):
        assert got.report[key] == want.report[key], key
    chosen, expected = got.report["chosen"], want.report["chosen"]
    assert chosen["method"] == expected["method"] and set(chosen["candidates"]) == {"activations", "weights", "identity"}
    for name, candidate in expected["candidates"].items():  # the residual descent's sums in another order (`ResidualDescent`)
        assert chosen["candidates"][name]["distance"] == pytest.approx(candidate["distance"], rel=1e-6)
        assert chosen["candidates"][name]["loss"] == pytest.approx(candidate["loss"], rel=1e-5)
    assert got.plan.statistics_bytes > 0 and _leftovers(tmp_path) == []  # the spilled sites are gone
    # fallback=False: activation matching's own result, no choice made
    own = streaming.align_to_disk(a, b, tmp_path / "own", options, data=batches, chunk_layers=2, fallback=False)
    assert "chosen" not in own.report
    mine = rj.pipeline.align_pair(params_a, params_b, cb, dataclasses.replace(options, fallback=False), batches, 0, rj.pipeline.Progress())
    assert own.report["after"] == mine.report["after"]


def test_a_tied_head_streams_activation_matching_as_the_command_aligns_in_memory(tmp_path):
    """`rotsym align --method activations` on a Llama whose LM head is tied to the embedding: the
    command unties the head for the residual rotation, and the streamed pass that holds each
    model whole runs the untied model too (it read the folder as stored and refused: "norm gains
    ['final_norm/scale'] are not uniform"). The same choice and tensors as in memory (the rotation's
    sums in another order: float32 rounding), and B's function."""
    import torch
    import transformers as tf
    from parity_utils import save_reference, token_batch

    config = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  tie_word_embeddings=True)
    model_b = save_reference(tf.LlamaForCausalLM, tf.LlamaConfig(**config), tmp_path / "b", seed=1)  # norm gains perturbed: not uniform
    save_reference(tf.LlamaForCausalLM, tf.LlamaConfig(**config), tmp_path / "a", seed=0)
    ids = np.random.default_rng(0).integers(3, 64, size=(8, 12))
    np.savez(tmp_path / "data.npz", input_ids=ids)
    outputs = {}
    for name, extra in (("memory", []), ("stream", ["--max-memory", "1G"])):
        args = ["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / name), "--method", "activations", "--data", str(tmp_path / "data.npz")]
        assert cli.main(args + extra) == 0
        outputs[name] = json.loads((tmp_path / name / "rotsym_report.json").read_text())["result"]
    assert "streaming" in outputs["stream"] and "streaming" not in outputs["memory"]
    assert outputs["stream"]["chosen"]["method"] == outputs["memory"]["chosen"]["method"]
    streamed, in_memory = (hf.load_hf(tmp_path / name).params for name in ("stream", "memory"))
    for path, x in flatten(in_memory).items():
        np.testing.assert_allclose(np.asarray(flatten(streamed)[path]), np.asarray(x), rtol=0, atol=1e-6, err_msg=path)
    moved = tf.LlamaForCausalLM.from_pretrained(tmp_path / "stream").eval()
    ids, mask = token_batch(64)
    with torch.no_grad():
        want = model_b(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        got = moved(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_activation_matching_scores_its_candidates_alike_in_memory_and_streamed(tmp_path):
    """The fallback's candidates (activation matching, weight matching, B as given) are scored by
    the merged model's divergence with the same programs in memory and streamed: with the stream
    permuted (a rotation's sums run in another order streamed), the reports' chosen sections,
    losses included, are equal to the bit. Run as users run it, XLA's optimisations on (the
    tests' unoptimised programs happened to agree): there weight matching's loss differed by
    1.9e-7 relative (up to 7e-4 in other runs) when the streamed run scored with its own programs."""
    import subprocess

    import transformers as tf
    from parity_utils import save_reference

    config = tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    for name, seed in (("a", 0), ("b", 1)):
        save_reference(tf.GPT2LMHeadModel, config, tmp_path / name, seed=seed)
    np.savez(tmp_path / "data.npz", input_ids=np.random.default_rng(0).integers(3, 64, size=(8, 12)))
    # Both commands in one process, as the command line's own entry point (a second process cost the
    # test 15 s of start and compiling): a streamed run that scored with programs of its own still
    # compiles them apart from the in-memory run's, and would differ as it did in two processes.
    runs = {name: ["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / name), "--method", "activations",
                   "--data", str(tmp_path / "data.npz"), "--residual", "permutation", "--quiet", *extra]
            for name, extra in (("memory", []), ("stream", ["--max-memory", "1G"]))}
    code = "import json, sys; from rotsym_jax import cli; sys.exit(max(cli.main(argv) for argv in json.loads(sys.argv[1])))"
    done = subprocess.run([sys.executable, "-c", code, json.dumps(list(runs.values()))], capture_output=True, text=True,
                          env={**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "0"})
    assert done.returncode == 0, done.stderr
    chosen = {name: json.loads((tmp_path / name / "rotsym_report.json").read_text())["result"]["chosen"] for name in runs}
    assert all("loss" in c for c in chosen["memory"]["candidates"].values()) and len(chosen["memory"]["candidates"]) == 3, chosen
    assert chosen["stream"] == chosen["memory"]


def test_a_source_read_whole_is_the_model_the_run_planned_on(tmp_path):
    """`Source.whole` of a header the run untied and widened (`io.reconcile`) gives those params,
    not the folder's as stored: the head its own leaf, the zero units there."""
    import transformers as tf
    from parity_utils import save_reference

    from rotsym_jax.io import ties, widths
    from rotsym_jax.streaming._source import Source

    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, tie_word_embeddings=True)
    save_reference(tf.LlamaForCausalLM, config, tmp_path / "b")
    planned = widths.widen(ties.untie(hf.load_hf(tmp_path / "b", weights=False)), 64)
    want = widths.widen(ties.untie(hf.load_hf(tmp_path / "b")), 64)
    got = Source(planned, "model B").whole()
    assert got.model_config == want.model_config and flatten(got.params).keys() == flatten(want.params).keys()
    for path, x in flatten(want.params).items():
        np.testing.assert_array_equal(np.asarray(flatten(got.params)[path]), np.asarray(x), err_msg=path)


def test_regmean_refuses_stacked_experts_streamed_as_in_memory(tmp_path):
    """A mixture of experts' stacked kernels (E, d_in, d_out) are no linear layer RegMean solves
    (their Gram pools every token, not those routed to each expert): the streamed merge refuses
    them as `merge.regmean` does (it wrote an output while the in-memory merge refused)."""
    raw = dict(model_type="mixtral", vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16, tie_word_embeddings=False)
    a, b = (save_random(raw, "lm", seed, tmp_path / name) for seed, name in ((0, "a"), (1, "b")))
    batches = [{k: v for k, v in batch.items() if k != "labels"} for batch in _batches("llama")]
    grams = [rj.stats.grams(ck, ck.params, batches) for ck in (rj.load_hf(a), rj.load_hf(b))]
    with pytest.raises(rj.InputError, match=r"regmean merges linear kernels \(d_in, d_out\): leaf 'layers/0/moe/\w+/kernel' has shape \(4, "):
        merge.regmean([rj.load_hf(a).params, rj.load_hf(b).params], grams)
    with pytest.raises(rj.InputError, match=r"regmean merges linear kernels \(d_in, d_out\): leaf 'layers/0/moe/\w+/kernel' has shape \(4, "):
        streaming.merge_to_disk("regmean", [a, b], tmp_path / "out", batches=batches, chunk_layers=1)
    assert not (tmp_path / "out").exists()


def test_a_streamed_run_refuses_what_needs_models_whole_together_in_one_place(models, tmp_path, no_weight_reads):
    a, b, _ = models["llama"]
    batches = _batches("llama")
    merge = lambda **kw: streaming.merge_to_disk("average", [a, b], tmp_path / "x", **kw)  # noqa: E731
    for call, message in ((lambda: streaming.align_to_disk(a, b, tmp_path / "x", method="learned", data=batches), "needs them whole in memory"),
                          (lambda: streaming.align_to_disk(a, b, tmp_path / "x", method="activations"), "give data="),
                          (lambda: merge(align_options={"method": "activations"}), r"give batches=\[\.\.\.\]"),
                          (lambda: merge(align="many", align_options={"method": "activations"}, batches=batches),
                           "align='many' with method='activations'")):
        with pytest.raises(streaming.StreamingError, match=message):
            call()
    assert rj.pipeline.unstreamed({"method": "learned"}, None, "anchor") == streaming.unstreamed_method("learned")


def test_regmean_warns_once_for_a_streamed_merge_as_in_memory(models, tmp_path):
    """Eight tokens leave the summed Grams near singular: in memory one warning names every grown
    kernel; streamed a layer at a time, it was one warning per chunk (the new-user trial's 21 + 1)."""
    a, b, _ = models["llama"]
    batches = _batches("llama", count=1, size=1, tokens=8)
    caught = []
    for merge_it in (lambda: _in_memory_statistics_merge("regmean", [a, b], tmp_path / "memory", batches, align=False),
                     lambda: streaming.merge_to_disk("regmean", [a, b], tmp_path / "stream", align="none", batches=batches, chunk_layers=1)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            merge_it()
        caught.append([str(w.message) for w in seen if str(w.message).startswith("regmean:")])
    assert_same_checkpoint(tmp_path / "stream", tmp_path / "memory")
    assert len(caught[0]) == 1 and caught[0] == caught[1], caught
    assert int(caught[0][0].split()[1]) > 2, caught  # kernels of several layers: several chunks


@pytest.mark.slow  # ~11 s: compiles the sampled Fisher
def test_fisher_streams_with_weights_unaligned_and_the_expected_kind(models, tmp_path):
    a, b, _ = models["llama"]
    batches = [{k: v for k, v in batch.items() if k != "labels"} for batch in _batches("llama")]
    cks = [rj.load_hf(p) for p in (a, b)]
    key = jax.random.key(5)
    fishers = [rj.stats.fisher(ck, ck.params, batches, kind="expected", key=key, samples=2) for ck in cks]
    merged = merge.fisher([ck.params for ck in cks], fishers, [0.25, 0.75])
    hf.save_hf(cks[0], merged, tmp_path / "memory")
    got = streaming.merge_to_disk("fisher", [a, b], tmp_path / "stream", align="none", weights=[0.25, 0.75], batches=batches,
                                  fisher_kind="expected", fisher_key=key, fisher_samples=2, chunk_layers=2)
    assert_same_checkpoint(got.path, tmp_path / "memory")


def test_statistics_merges_refuse_missing_inputs_before_any_weight_is_read(models, tmp_path, no_weight_reads):
    a, b, _ = models["llama"]
    for method in ("fisher", "regmean"):
        with pytest.raises(streaming.StreamingError, match=f"method '{method}' needs statistics from data.*pass batches="):
            streaming.merge_to_disk(method, [a, b], tmp_path / "out")
        with pytest.raises(streaming.StreamingError, match=f"method '{method}' needs statistics from data"):
            streaming.plan_merge(method, [a, b])
    batches = _batches("llama")
    with pytest.raises(streaming.StreamingError, match="batches is a generator; expected a list"):
        streaming.merge_to_disk("fisher", [a, b], tmp_path / "out", batches=(x for x in batches))
    with pytest.raises(streaming.StreamingError, match=r"fisher_kind='empirical' needs labels: batches \[0, 1\]"):
        streaming.merge_to_disk("fisher", [a, b], tmp_path / "out", batches=[{"input_ids": x["input_ids"]} for x in batches])
    with pytest.raises(streaming.StreamingError, match="method 'average' takes no statistics from data"):
        streaming.merge_to_disk("average", [a, b], tmp_path / "out", batches=batches)
    with pytest.raises(streaming.StreamingError, match=r"batches\[1\]: input_ids holds values in \[99, 99\], outside \[0, 60\)"):
        streaming.merge_to_disk("regmean", [a, b], tmp_path / "out", batches=[batches[0], {**batches[1], "input_ids": batches[1]["input_ids"] * 0 + 99}])
    with pytest.raises(streaming.StreamingError, match="merge method 'regmean' does not use weights"):
        streaming.merge_to_disk("regmean", [a, b], tmp_path / "out", batches=batches, weights=[1, 2])
    # The statistics pass holds a model whole: a budget below it is refused, whatever the chunk size.
    plan = streaming.plan_merge("fisher", [a, b], batches=batches, chunk_layers=1)
    assert plan.statistics_bytes > 0 and plan.peak_bytes >= plan.statistics_bytes and "holds one model at a time" in plan.describe()
    with pytest.raises(streaming.StreamingError, match="below what the statistics pass of fisher needs"):
        streaming.merge_to_disk("fisher", [a, b], tmp_path / "out", batches=batches, max_memory=plan.statistics_bytes - 1)
    bigger = streaming.plan_merge("fisher", [a, b], batches=_batches("llama", size=8), chunk_layers=1)
    assert bigger.statistics_bytes > plan.statistics_bytes  # the working set grows with the batch
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_the_spilled_statistics_are_removed_after_an_error(models, tmp_path, monkeypatch):
    a, b, _ = models["llama"]
    seen = []

    def fail(*args, **kwargs):
        seen.extend(_leftovers(tmp_path))  # the spill exists while the weights are merged
        raise RuntimeError("merge failed")

    monkeypatch.setattr(arithmetic, "regmean_leaves", fail)
    with pytest.raises(RuntimeError, match="merge failed"):
        streaming.merge_to_disk("regmean", [a, b], tmp_path / "out", batches=_batches("llama"), chunk_layers=5)
    assert any(name.startswith(".rotsym-stats") for name in seen)
    assert _leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


def test_big_leaves_outside_the_layers_go_in_row_blocks_with_the_same_weights(models, tmp_path):
    """block_bytes small: the embeddings and the LM head are merged / copied in row blocks."""
    a, b, base = models["llama"]
    _in_memory_merge("average", [a, b], tmp_path / "memory", align=False)
    got = streaming.merge_to_disk("average", [a, b], tmp_path / "stream", align="none", chunk_layers=3, block_bytes=1024)
    assert_same_checkpoint(got.path, tmp_path / "memory")
    _in_memory_align(a, b, tmp_path / "aligned")
    got = streaming.align_to_disk(a, b, tmp_path / "stream-aligned", chunk_layers=5, block_bytes=1024)
    assert_same_checkpoint(got.path, tmp_path / "aligned")


def test_command_line_streams_with_max_memory(models, tmp_path, capsys):
    a, b, _ = models["llama"]
    assert cli.main(["align", str(a), str(b), str(tmp_path / "memory"), "--quiet"]) == 0
    assert cli.main(["align", str(a), str(b), str(tmp_path / "stream"), "--quiet", "--max-memory", "4G"]) == 0
    assert_same_checkpoint(tmp_path / "stream", tmp_path / "memory")
    memory = json.loads((tmp_path / "memory" / "rotsym_report.json").read_text())["result"]
    stream = json.loads((tmp_path / "stream" / "rotsym_report.json").read_text())["result"]
    # everything fits: the 5 layers split in two chunks in flight at once (their reads and assignments overlap)
    assert stream["after"] == memory["after"] and (stream["streaming"]["chunk_layers"], stream["streaming"]["in_flight"]) == (3, 2)
    assert (tmp_path / "stream" / "README.md").is_file() and (tmp_path / "stream" / "rotsym_config.yaml").is_file()
    capsys.readouterr()
    assert cli.main(["align", str(a), str(b), str(tmp_path / "dry"), "--dry-run", "--max-memory", "4G"]) == 0
    text = capsys.readouterr().out
    assert "streaming: 5 layers, 3 per chunk, 2 chunks at a time per process" in text and "memory estimate:" in text and not (tmp_path / "dry").exists()


def test_command_line_streams_recipes_with_data_for_fisher_and_regmean(models, tmp_path, capsys):
    """`rotsym merge RECIPE OUT --max-memory` with a data section: the same folder as in memory."""
    tf = pytest.importorskip("transformers")
    yaml = pytest.importorskip("yaml")
    a, b, _ = models["llama"]
    anchor = tmp_path / "anchor"
    shutil.copytree(a, anchor)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(5, 50)]) + "\n")
    # the anchor's tokenizer encodes the data (no token_type_ids: a Llama takes none)
    tf.BertTokenizerFast(vocab_file=str(vocab), model_input_names=["input_ids", "attention_mask"]).save_pretrained(anchor)
    rng = np.random.default_rng(0)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": " ".join(f"w{i}" for i in rng.integers(5, 50, size=rng.integers(2, 6)))}) + "\n" for _ in range(4)))
    data = {"file": str(texts), "batch_size": 2, "max_length": 6}  # LM texts label themselves: the empirical Fisher
    for method, params in (("regmean", {"alpha": 0.8}), ("fisher", {})):
        recipe = tmp_path / f"{method}.yaml"
        recipe.write_text(yaml.safe_dump({"models": [str(anchor), str(b)], "method": method, "params": params, "data": data}))
        assert cli.main(["merge", str(recipe), str(tmp_path / f"{method}-memory"), "--quiet"]) == 0
        assert cli.main(["merge", str(recipe), str(tmp_path / f"{method}-stream"), "--quiet", "--max-memory", "4G"]) == 0
        assert_same_checkpoint(tmp_path / f"{method}-stream", tmp_path / f"{method}-memory")
        report = json.loads((tmp_path / f"{method}-stream" / "rotsym_report.json").read_text())["result"]
        memory = json.loads((tmp_path / f"{method}-memory" / "rotsym_report.json").read_text())["result"]
        assert report["statistics"] == {"method": method, "examples": 4, **({"kind": "empirical"} if method == "fisher" else {})}
        assert report["merged_distance_to_anchor"] == memory["merged_distance_to_anchor"]
        assert yaml.safe_load((tmp_path / f"{method}-stream" / "rotsym_config.yaml").read_text())["data"]["file"] == str(texts)
    assert _leftovers(tmp_path) == []
    capsys.readouterr()
    assert cli.main(["merge", str(recipe), str(tmp_path / "dry"), "--dry-run", "--max-memory", "4G"]) == 0
    text = capsys.readouterr().out
    assert f"data: {texts}" in text and "statistics pass over the data holds one model at a time" in text and not (tmp_path / "dry").exists()
    # OT fusion's activations are not streamed: still refused, with the reason
    recipe.write_text(yaml.safe_dump({"models": [str(anchor), str(b)], "method": "ot_fusion", "params": {"source": "activations"}, "data": data}))
    with pytest.raises(SystemExit):
        cli.main(["merge", str(recipe), str(tmp_path / "ot"), "--max-memory", "4G"])
    assert "method ot_fusion: statistics from data are not streamed; run without --max-memory" in capsys.readouterr().err


def test_max_memory_picks_the_chunk_and_refuses_what_cannot_fit(models):
    a, b, _ = models["llama"]
    by_chunk = [streaming.plan_align(a, b, chunk_layers=k).peak_bytes for k in range(1, 6)]
    assert by_chunk == sorted(by_chunk) and by_chunk[0] < by_chunk[-1]  # more layers at a time, more memory
    budget = (by_chunk[1] + by_chunk[2]) // 2
    plan = streaming.plan_align(a, b, max_memory=budget)
    assert plan.chunk_layers == 2 and plan.peak_bytes <= budget
    roomy = streaming.plan_align(a, b, max_memory=4 * 2**30)  # two chunks in flight: the layers split between them
    assert (roomy.chunk_layers, roomy.in_flight) == (3, 2) and roomy.peak_bytes <= 4 * 2**30
    with pytest.raises(streaming.StreamingError, match=r"max_memory=1.0 MiB is below what one layer at a time needs") as refused:
        streaming.plan_align(a, b, max_memory=2**20)
    need = refused.value.needed
    assert streaming.plan_align(a, b, max_memory=need).peak_bytes <= need
    with pytest.raises(streaming.StreamingError) as refused:  # a budget just short: the two sizes read apart
        streaming.plan_align(a, b, max_memory=need - 1)
    given, needed = re.match(r"max_memory=(\S+ \w+) is below what one layer at a time needs, about (\S+ \w+)", str(refused.value)).groups()
    assert given != needed, str(refused.value)


def test_sizes_compared_in_a_message_read_apart():
    from rotsym_jax.io.memory import size_text

    assert (size_text(2**29), size_text(2**30 // 10 - 1)) == ("0.50 GiB", "102.4 MiB")
    assert (size_text(2**29, 2**29 + 5 * 2**20), size_text(2**29 + 5 * 2**20, 2**29)) == ("0.500 GiB", "0.505 GiB")
    assert size_text(2**29, 2**29) == "0.50 GiB" and size_text(2**29 + 1, 2**29) != size_text(2**29, 2**29 + 1)


def test_refusals_come_before_any_weight_is_read(models, tmp_path, no_weight_reads):
    a, b, base = models["llama"]
    with pytest.raises(streaming.StreamingError, match="residual='signed_permutation' needs RMSNorm"):
        streaming.align_to_disk(models["bert"][0], models["bert"][1], tmp_path / "out", residual="signed_permutation")
    with pytest.raises(streaming.StreamingError, match="method 'ot_fusion' is not streamed"):
        streaming.merge_to_disk("ot_fusion", [a, b], tmp_path / "out")
    bert_a = models["bert"][0]
    with pytest.raises(streaming.StreamingError, match="does not have the architecture"):
        streaming.align_to_disk(a, bert_a, tmp_path / "out")
    other = dict(CONFIGS["llama"][0], intermediate_size=40)
    folder = tmp_path / "narrow"
    ck = hf.init_checkpoint(hf.read_config(other), jax.random.key(3), head="lm")
    hf.save_hf(ck, ck.params, folder)  # reads nothing
    with pytest.raises(streaming.StreamingError, match=r"other shapes \(its vs A .*'s\): layers/\{i\}/mlp/down/kernel \(40, 32\) vs \(48, 32\)"):
        streaming.align_to_disk(a, folder, tmp_path / "out")
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        streaming.align_to_disk(a, b, base)
    with pytest.raises(FileExistsError, match="holds the source checkpoint"):
        streaming.merge_to_disk("average", [a, b], b, overwrite=True)
    with pytest.raises(FileExistsError, match="holds the source checkpoint"):  # overwrite read from the object: past "exists"
        streaming.merge_to_disk("average", [a, b], b, stream=rj.StreamOptions(overwrite=True))
    assert not (tmp_path / "out").exists()


def test_a_missing_shard_is_named(models, tmp_path, no_weight_reads):
    a, b, _ = models["llama"]
    broken = tmp_path / "broken"
    shutil.copytree(b, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(hf.CheckpointError, match=f"names shard files that are missing: .*{shard.name}"):
        streaming.align_to_disk(a, broken, tmp_path / "out")


def _digest(folder) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(folder).iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def test_a_full_disk_is_refused_up_front_or_cleaned_up(models, tmp_path, monkeypatch):
    a, b, _ = models["llama"]
    sources = {p: _digest(p) for p in (a, b)}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(OSError, match="free, the output needs") as e:
        streaming.align_to_disk(a, b, tmp_path / "out")
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    calls = []
    real = os.pwrite

    def fill_up(fd, data, offset):
        calls.append(offset)
        if len(calls) > 6:  # headers written, then the disk fills while the layers are written
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", fill_up)
    with pytest.raises(OSError, match="No space left"):
        streaming.merge_to_disk("average", [a, b], tmp_path / "out", chunk_layers=2)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".rotsym-tmp")]
    assert {p: _digest(p) for p in (a, b)} == sources


def test_non_finite_weights_are_named(models, tmp_path):
    a, _, _ = models["llama"]
    ck = rj.load_hf(a)
    params = flatten(ck.params)
    params["layers/3/mlp/up/kernel"] = params["layers/3/mlp/up/kernel"].at[0, 0].set(np.nan)
    bad = hf.save_hf(ck, rj.pytree.unflatten(params), tmp_path / "nan", allow_nonfinite=True)
    with pytest.raises(hf.NonFiniteWeights, match=r"B: .*: non-finite values \(NaN or Inf\) in 1 tensor: 'model.layers.3.mlp.up_proj.weight' \(1 of "):
        streaming.align_to_disk(a, bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # ~20 s each: a planted pair from the benchmark's generator
@pytest.mark.parametrize("shape", ["tiny", "qwen3-tiny", "mixtral-tiny"])
def test_generator_pair_is_recovered_to_the_noise_level(tmp_path, shape):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import make_large_pair

    assert make_large_pair.main([str(tmp_path / "pair"), "--shape", shape, "--partners", "finetune"]) == 0
    info = json.loads((tmp_path / "pair" / "finetune.json").read_text())
    result = streaming.align_to_disk(tmp_path / "pair" / "a", tmp_path / "pair" / "finetune", tmp_path / "out", chunk_layers=3)
    assert result.report["before"]["total"] == pytest.approx(info["distance_before"], rel=1e-5)
    assert result.report["after"]["total"] < 1.01 * info["noise_level"]
    planted = np.load(tmp_path / "pair" / "finetune-planted.npz")
    if shape.startswith("mixtral"):  # every expert and every unit in it
        composed = rj.transforms.ExpertPermutation(planted["moe.perm"], planted["moe.units"]).then(result.transforms[0]["moe"])
        perm, units = np.asarray(composed.perm), np.asarray(composed.units)
        np.testing.assert_array_equal(perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape))
        np.testing.assert_array_equal(units, np.broadcast_to(np.arange(units.shape[2]), units.shape))
        return
    found = np.asarray(result.transforms[0]["ffn"].perm)
    np.testing.assert_array_equal(np.take_along_axis(planted["ffn.perm"], found, axis=1),
                                  np.broadcast_to(np.arange(planted["ffn.perm"].shape[1]), planted["ffn.perm"].shape))


def test_every_path_reports_the_same_timings(models, tmp_path):
    """One set of phases (`rj.timings.TIMINGS`) in memory and streamed; streamed, the phases are
    disjoint, JAX's compilations one of them (the caches emptied: the streamed run compiles)."""
    a, b, _ = models["llama"]
    in_memory = _in_memory_align(a, b, tmp_path / "memory").report["timings"]
    jax.clear_caches()
    aligned = streaming.align_to_disk(a, b, tmp_path / "aligned", chunk_layers=2).report["timings"]
    assert aligned["compile"] > 0, aligned
    merged = streaming.merge_to_disk("average", [a, b], tmp_path / "merged", chunk_layers=2).report["timings"]
    for timings in (in_memory, aligned, merged):
        assert list(timings) == list(rj.timings.TIMINGS) and min(timings.values()) >= 0, timings
    assert in_memory["read"] == in_memory["transfer"] == in_memory["write"] == in_memory["merge"] == 0 and in_memory["solve"] > 0
    assert aligned["transfer"] > 0 and merged["transfer"] > 0
    assert aligned["read"] > 0 and aligned["write"] > 0 and aligned["merge"] == 0 and merged["merge"] > 0
    for timings in (aligned, merged):
        assert timings["assignment"] + timings["attention"] <= timings["solve"] + 1e-6, timings
        phases = sum(timings[k] for k in rj.timings.DISJOINT) - timings["overlap"]  # chunks in flight at once overlap
        assert phases <= timings["total"], timings


def test_one_memory_model_for_the_dry_run_the_switch_and_the_plan(models, tmp_path, capsys, monkeypatch):
    """`--dry-run`'s in-memory estimate is the streaming plan's `in_memory_bytes`, and the command line
    streams exactly when that estimate exceeds the memory available (MemAvailable) plus what this
    process already holds of the runtime the estimate counts, which MemAvailable no longer does (it
    streamed 300 MiB early for that). A refusal of the budget it chose says what it measured and
    chose, not a max_memory no one gave."""
    from rotsym_jax.io import memory

    a, b, _ = models["llama"]
    estimate, held = streaming.plan_align(a, b).in_memory_bytes, 300 * 2**20
    argv = ["align", str(a), str(b), str(tmp_path / "out"), "--dry-run"]
    monkeypatch.setattr(memory, "resident_bytes", lambda: held)
    monkeypatch.setattr(streaming, "available_memory", lambda: estimate - held)
    assert cli.main(argv) == 0
    assert f"memory estimate: {estimate / 2**30:.2f} GiB" in capsys.readouterr().out
    monkeypatch.setattr(streaming, "available_memory", lambda: estimate - held - 1)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)  # this tiny model's plan does not fit its budget: refused, after the switch
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"the models need about {estimate / 2**30:.1f} GiB in memory" in err, err
    monkeypatch.setattr(streaming, "available_memory", lambda: 100 * 2**20)  # 80 MiB + 300: below the runtime alone
    with pytest.raises(SystemExit):
        cli.main(argv)
    err = capsys.readouterr().err
    assert "max_memory=" not in err and "no --max-memory was given: the models need about" in err, err
    assert ("and 100.0 MiB of memory is free (MemAvailable, measured at the start) beside the 0.29 GiB this process already holds, so the "
            "run streams from disk to disk within 0.37 GiB (80% of the free memory, plus what this process holds), below what one layer at "
            "a time needs") in err, err
    assert "Free some memory (other processes hold it), or pass --max-memory to choose the budget (at least " in err, err


def test_an_accelerator_plans_for_its_runtime_and_staging_buffers(models, monkeypatch):
    """On a GPU the CUDA libraries hold host memory (an H200 run peaked 1.2 GB above a plan that
    left them out): the plan's peak and the in-memory estimate count them. The plan also counts the
    host buffers a transfer passes through (a contiguous layout, the pinned staging copy), per lane
    in flight: of the biggest tensor put whole, or of a row block where the big leaves go in blocks."""
    from safetensors import safe_open

    from rotsym_jax.io import memory

    a, b, _ = models["llama"]
    with safe_open(str(next(Path(a).glob("*.safetensors"))), "np") as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    stored = {name: int(np.prod(shape)) * 4 for name, shape in sizes.items()}  # the pair is stored in float32
    in_layers = max(v for name, v in stored.items() if ".layers." in name)
    assert max(stored.values()) > in_layers  # the embedding: put whole by default, in row blocks below
    small_blocks = max(stored.values()) // 4
    cpu = streaming.plan_align(a, b)
    cpu_blocked = streaming.plan_align(a, b, block_bytes=small_blocks)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    gpu = streaming.plan_align(a, b)
    gpu_blocked = streaming.plan_align(a, b, block_bytes=small_blocks)
    assert gpu.in_memory_bytes - cpu.in_memory_bytes == memory.ACCELERATOR_RUNTIME_BYTES
    staging = memory.STAGING_COPIES * gpu.in_flight
    assert gpu.peak_bytes - cpu.peak_bytes == memory.ACCELERATOR_RUNTIME_BYTES + int(staging * max(stored.values()))
    assert gpu_blocked.peak_bytes - cpu_blocked.peak_bytes == memory.ACCELERATOR_RUNTIME_BYTES + int(staging * max(in_layers, small_blocks))


def test_a_streamed_align_falls_back_to_b_as_given_as_align_does(models, tmp_path, monkeypatch):
    """Transforms that move B away from A (forced here) are written, measured, found farther
    than B as given, and B is written instead: the tensors, transforms and report["chosen"] of
    `align` in memory; fallback=False writes the method's result."""
    from rotsym_jax.engine import driver

    a, b, _ = models["llama"]
    cb = rj.load_hf(b)
    body = {k: v for k, v in cb.params.items() if k != "head"}
    astray = rj.random_transform(rj.spec_for(cb), body, jax.random.key(3), ("perm",))
    monkeypatch.setattr(driver.Solve, "finish", lambda self: astray)
    want = _in_memory_align(a, b, tmp_path / "memory")
    got = streaming.align_to_disk(a, b, tmp_path / "stream", chunk_layers=2)
    assert want.report["chosen"]["method"] == "identity"
    assert got.report["chosen"] == want.report["chosen"]
    for key in ("before", "after", "layers", "moved"):
        assert got.report[key] == want.report[key], key
    assert_nothing_moved(got.report["moved"])
    assert got.report["after"] == got.report["before"]
    assert_same_checkpoint(got.path, tmp_path / "memory")
    assert_same_checkpoint(got.path, b)
    for x, y in zip(jax.tree.leaves(want.transforms), jax.tree.leaves(got.transforms[0])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    own = streaming.align_to_disk(a, b, tmp_path / "own", chunk_layers=2, fallback=False)
    assert "chosen" not in own.report and own.report["after"]["total"] > own.report["before"]["total"]
    perm = np.asarray(astray["ffn"].perm)  # what it wrote moved: the FFN units the forced transforms permute, nothing else
    assert own.report["moved"]["ffn"]["units"] == pytest.approx(np.mean(perm != np.arange(perm.shape[-1])), rel=1e-3)
    assert own.report["moved"]["ffn"]["layers_moved"] == 5
    assert own.report["moved"]["attn"]["layers_moved"] == 0

    # a streamed merge likewise: the model kept as given is merged as given
    distance = _in_memory_merge("average", [a, b], tmp_path / "merged-memory", align=False)
    merged = streaming.merge_to_disk("average", [a, b], tmp_path / "merged", chunk_layers=2)
    (aligned,) = merged.report["alignment"]["distances"]
    assert aligned["chosen"] == want.report["chosen"] and aligned["after"] == aligned["before"] == want.report["before"]
    assert aligned["moved"] == want.report["moved"]
    assert_same_checkpoint(merged.path, tmp_path / "merged-memory")
    assert merged.report["merged_distance_to_anchor"] == distance
