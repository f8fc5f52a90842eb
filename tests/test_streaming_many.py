"""`align_many` on the streaming path (`streaming._descent.AlignMany`, `merge_to_disk(align="many")`):
the same canonical order, medoid, sweeps, safeguard and stop as `align_many` in memory, each step
a pass over the chunks, and so the same bits."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from checkpoint_utils import assert_same_checkpoint, save_random

import rotsym_jax as rj
from rotsym_jax import cli, hf, merge, streaming
from rotsym_jax.pipeline import aligning_spec

CONFIG = dict(model_type="llama", vocab_size=60, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, max_position_embeddings=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-many")
    return [save_random(CONFIG, "lm", seed, root / f"m{seed}", **({"max_shard_bytes": 6000} if seed == 1 else {})) for seed in range(3)]


def _in_memory(paths, out, method="average", **options):
    cks = [rj.load_hf(p) for p in paths]
    many = rj.align_many([ck.params for ck in cks], aligning_spec(cks[0]), **options)
    hf.save_hf(cks[0], jax.device_get(merge.merge(method, many.params)), out)
    return many


def _same_transforms(many, got, path) -> None:
    """Every model's transforms as `align_many`'s; None (a model never moved) where
    `align_many` gives the identity."""
    ck = rj.load_hf(path)
    identity = rj.identity_transform(rj.bind(aligning_spec(ck), {k: v for k, v in ck.params.items() if k != "head"}))
    for want, have in zip(many.transforms, got.transforms, strict=True):
        for name, t in want.items():
            for x, y in zip(jax.tree.leaves(t), jax.tree.leaves((identity if have is None else have)[name]), strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def test_align_many_streams_bit_for_bit(models, tmp_path):
    """Three models, chunks of two layers on two lanes: the merged weights, every model's
    transforms, the objective after each sweep and the stop of `align_many`."""
    many = _in_memory(models, tmp_path / "memory")
    calls = []
    got = streaming.merge_to_disk("average", models, tmp_path / "stream", align="many", chunk_layers=2, progress=lambda *c: calls.append(c))
    assert got.plan.in_flight == 2
    assert calls[-1][0] == calls[-1][1] and all(a[0] < b[0] for a, b in zip(calls, calls[1:]))  # the sweeps not taken counted done
    plan = streaming.plan_merge("average", models, align="many", chunk_layers=2)  # the dry run's: passes before and per sweep
    assert got.plan == plan and (plan.passes, plan.passes_per_sweep, plan.max_sweeps) == (5, 6, 10)
    assert "5 passes over the weights, then 6 more per sweep of the alignment (at most 10 sweeps)" in plan.describe()
    assert_same_checkpoint(got.path, tmp_path / "memory")
    assert got.report["alignment"] == {"mode": "many", "objective": many.objective, "stop": many.report["stop"], "moved": many.report["moved"]}
    assert len(many.objective) > 2 and many.objective[-1] < many.objective[0]  # it swept, and F fell
    _same_transforms(many, got, models[0])


@pytest.mark.slow  # ~25 s: two more align_many runs
@pytest.mark.parametrize("residual, chunk, block", [("permutation", 2, None), pytest.param("signed_permutation", 1, 1024, marks=pytest.mark.slow)])
def test_align_many_with_the_residual_stream_streams_as_in_memory(residual, chunk, block, models, tmp_path):
    """Each of `align_many`'s alignments a residual descent (`ResidualDescent`) whose anchor, in the
    sweeps, is the mean of the other models as moved, read as a source (`LeaveOneOut`); the
    leaves outside the layers move with each model's stream (in row blocks with `block_bytes`).
    The weights, every transform (the stream's too), F after each sweep and the stop are
    `align_many`'s in memory, bit for bit."""
    many = _in_memory(models, tmp_path / "memory", residual=residual)
    assert any(t is not None and rj.transforms.RESIDUAL in t for t in many.transforms)
    got = streaming.merge_to_disk("average", models, tmp_path / "stream", align="many", align_options={"residual": residual},
                                  chunk_layers=chunk, **({"block_bytes": block} if block else {}))
    assert_same_checkpoint(got.path, tmp_path / "memory")
    _same_transforms(many, got, models[0])
    assert got.report["alignment"] == {"mode": "many", "objective": many.objective, "stop": many.report["stop"], "moved": many.report["moved"]}
    assert len(many.objective) > 1 and many.objective[-1] < many.objective[0]
    plan = streaming.plan_merge("average", models, align="many", align_options={"residual": residual}, chunk_layers=chunk)
    descent = 1 + 3 * rj.AlignOptions().residual_sweeps
    assert (plan.passes, plan.passes_per_sweep) == (2 + 2 + 2 * descent, 3 * (descent + 1))


def test_bitwise_equal_models_are_ordered_by_content_as_in_memory(models, tmp_path):
    """Two copies of one model tie on their fingerprints: the order falls to their contents,
    read leaf by leaf, and the result is still `align_many`'s."""
    copy = tmp_path / "copy"
    shutil.copytree(models[0], copy)
    paths = [models[1], copy, models[0]]
    many = _in_memory(paths, tmp_path / "memory")
    got = streaming.merge_to_disk("average", paths, tmp_path / "stream", align="many", chunk_layers=3)
    assert_same_checkpoint(got.path, tmp_path / "memory")
    assert got.report["alignment"]["objective"] == many.objective and got.report["alignment"]["moved"] == many.report["moved"]


@pytest.mark.parametrize("residual", [[], pytest.param(["--residual", "permutation"], marks=pytest.mark.slow)])
def test_command_line_merges_with_align_many_streamed(residual, models, tmp_path, capsys):
    argv = ["merge", "--method", "average", "--align", "many", *residual, *map(str, models)]
    assert cli.main([*argv, str(tmp_path / "memory")]) == 0
    said = capsys.readouterr().out  # every model's `moved` section, the first's too (align_many moves it)
    assert all(f"moved, model {i}:" in said for i in range(3)) and "moved, model 3:" not in said, said
    assert cli.main([*argv, str(tmp_path / "stream"), "--quiet", "--max-memory", "4G"]) == 0
    assert_same_checkpoint(tmp_path / "stream", tmp_path / "memory")
    memory, stream = (json.loads((tmp_path / name / "rotsym_report.json").read_text())["result"] for name in ("memory", "stream"))
    assert stream["alignment"] == memory["alignment"] and stream["merged_distance_to_anchor"] == memory["merged_distance_to_anchor"]
    assert len(memory["alignment"]["moved"]) == 3
    assert "streaming" in stream


def test_align_many_keeps_a_model_as_given_where_align_would_as_streamed(models, tmp_path, monkeypatch):
    """`align_many` runs `align` with its fallback, in memory and streamed alike: transforms that
    move each model away from its anchor (forced here) are found farther than the model as given,
    which is kept, at the start and in every sweep; the bits, F and the stop are the same on both
    paths. With fallback=False both keep the method's transforms, as before."""
    from rotsym_jax.engine import driver

    ck = rj.load_hf(models[0])
    body = {k: v for k, v in ck.params.items() if k != "head"}
    astray = rj.random_transform(aligning_spec(ck), body, jax.random.key(3), ("perm",))
    monkeypatch.setattr(driver.Solve, "finish", lambda self: astray)
    many = _in_memory(models, tmp_path / "memory")
    assert many.objective[0] == many.report["unaligned_objective"]  # at the start every model is kept as given
    got = streaming.merge_to_disk("average", models, tmp_path / "stream", align="many", chunk_layers=2)
    assert_same_checkpoint(got.path, tmp_path / "memory")
    assert got.report["alignment"] == {"mode": "many", "objective": many.objective, "stop": many.report["stop"], "moved": many.report["moved"]}
    _same_transforms(many, got, models[0])

    own = _in_memory(models, tmp_path / "own-memory", fallback=False)
    assert own.objective[0] > own.report["unaligned_objective"]  # astray: the method's own result kept
    got = streaming.merge_to_disk("average", models, tmp_path / "own", align="many", align_options={"fallback": False}, chunk_layers=2)
    assert_same_checkpoint(got.path, tmp_path / "own-memory")
    assert got.report["alignment"] == {"mode": "many", "objective": own.objective, "stop": own.report["stop"], "moved": own.report["moved"]}
