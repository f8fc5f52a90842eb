"""Many processes, one alignment (rotsym_jax.processes): two local CPU processes, joined by
jax.distributed and JAX's CPU collectives, split a streamed run's layers and write the files one
process writes, byte for byte; a process that fails makes both fail with nothing published."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from checkpoint_utils import save_random

import rotsym_jax as rj
from rotsym_jax import processes, streaming

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(model_type="llama", vocab_size=60, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, max_position_embeddings=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("processes")
    # sharded output (max_shard_bytes below): shards hold tensors of both processes' layers
    return tuple(save_random(CONFIG, "lm", seed, root / name) for seed, name in enumerate("abc"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_processes(argv_of, count=2, timeout=240, devices=1):
    """`count` local processes, process i running `python argv_of(i)...` with `devices` host
    CPU devices; their (returncode, output) once all have ended."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"}  # the suite's compile flags kept (conftest)
    procs = [subprocess.Popen([sys.executable, *argv_of(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(count)]
    try:
        return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()


def _files(folder: Path) -> dict:
    """{file name: sha256} of the weights, the index and config.json."""
    names = [p for p in sorted(folder.iterdir()) if p.suffix in (".safetensors", ".json") and p.name not in ("rotsym_report.json",)]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in names if p.name.startswith(("model", "config"))}


ALIGN = """
import sys
from rotsym_jax import processes, streaming
processes.initialize(sys.argv[1], 2, int(sys.argv[2]))
if sys.argv[3] == "fail" and int(sys.argv[2]) == 1:  # this process cannot write: the run must fail as a whole
    def broken(*args, **kwargs):
        raise OSError("No space left on device (planted)")
    streaming._align.write_tensor = broken
heads = "fixed" if sys.argv[3] == "differ" and int(sys.argv[2]) == 1 else "permute"  # a copy-paste slip in one command
residual = "rotation" if sys.argv[3] == "residual" else "none"
result = streaming.align_to_disk(sys.argv[4], sys.argv[5], sys.argv[6], chunk_layers=1, max_shard_bytes=6000, heads=heads, residual=residual,
                                 residual_sweeps=2)
print("REPORT", __import__("json").dumps({k: result.report[k] for k in ("before", "after", "processes", "residual") if k in result.report}))
"""


@pytest.mark.parametrize("residual", ["none", pytest.param("rotation", marks=pytest.mark.slow)])  # rotation: 18 s
def test_two_processes_write_the_bits_of_one(residual, pair, tmp_path):
    """Two processes (chunks of one layer: one takes 2 layers, the other 3) write the files that
    one process writes, byte for byte, and report the same distances; each did its share. With
    the residual stream rotated (the norm gains folded as each tensor is read), each sweep's cross products are
    summed from process to process in the one process's order: a rotation solved from another
    order of float32 sums would differ in its last bits."""
    a, b, _ = pair
    one = streaming.align_to_disk(a, b, tmp_path / "one", chunk_layers=1, max_shard_bytes=6000, heads="permute", residual=residual,
                                  residual_sweeps=2)
    port = _free_port()
    mode = "ok" if residual == "none" else "residual"
    runs = _run_processes(lambda i: ["-c", ALIGN, f"localhost:{port}", str(i), mode, str(a), str(b), str(tmp_path / "two")])
    for code, output in runs:
        assert code == 0, output[-3000:]
    assert len(_files(tmp_path / "one")) > 3  # several shards and their index
    assert _files(tmp_path / "two") == _files(tmp_path / "one")
    reports = [json.loads(line.split(" ", 1)[1]) for _, output in runs for line in output.splitlines() if line.startswith("REPORT ")]
    assert len(reports) == 2 and reports[0] == reports[1]
    assert reports[0]["before"] == one.report["before"] and reports[0]["after"] == one.report["after"]
    assert reports[0].get("residual") == one.report.get("residual")
    assert reports[0]["after"]["total"] < reports[0]["before"]["total"]
    assert reports[0]["processes"]["count"] == 2
    assert all(t["read"] > 0 and t["write"] > 0 for t in reports[0]["processes"]["timings"])  # each read and wrote its share
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".rotsym-tmp")]


MERGE_MANY = """
import sys
from rotsym_jax import processes, streaming
processes.initialize(sys.argv[1], 2, int(sys.argv[2]))
result = streaming.merge_to_disk("average", sys.argv[3:6], sys.argv[6], align="many", chunk_layers=1, max_shard_bytes=6000,
                                 align_options={"residual": sys.argv[7], "residual_sweeps": 2})
print("REPORT", __import__("json").dumps(result.report["alignment"]))
"""


@pytest.mark.slow  # ~20 s: every update of the sweeps is two passes over three models
@pytest.mark.parametrize("residual", ["none", "permutation"])
def test_two_processes_sweep_align_many_to_the_bits_of_one(residual, pair, tmp_path):
    """`align_many`'s sweeps over two processes: each model update solved from both processes'
    parts, each objective summed from both processes' squares; the files, the objectives and the
    stop of one process. With the residual stream, each update is the streamed residual descent
    against the other models' mean, its cross products summed over both processes in layer order."""
    one = streaming.merge_to_disk("average", list(pair), tmp_path / "one", align="many", chunk_layers=1, max_shard_bytes=6000,
                                  align_options={"residual": residual, "residual_sweeps": 2})
    port = _free_port()
    runs = _run_processes(lambda i: ["-c", MERGE_MANY, f"localhost:{port}", str(i), *map(str, pair), str(tmp_path / "two"), residual])
    for code, output in runs:
        assert code == 0, output[-3000:]
    assert _files(tmp_path / "two") == _files(tmp_path / "one")
    reports = [json.loads(line.split(" ", 1)[1]) for _, output in runs for line in output.splitlines() if line.startswith("REPORT ")]
    assert reports == [one.report["alignment"]] * 2 and len(one.report["alignment"]["objective"]) > 2
    # the embedding, outside the layers, moves only with the stream: the mean of the three as read without it
    embeddings = [rj.load_hf(folder).params["embeddings"]["word"]["embedding"] for folder in (*pair, tmp_path / "one")]
    mean = (embeddings[0] + embeddings[1] + embeddings[2]) / 3
    assert np.allclose(embeddings[3], mean, atol=1e-6) == (residual == "none")


def test_a_failing_process_fails_the_run_and_nothing_is_published(pair, tmp_path):
    a, b, _ = pair
    port = _free_port()
    runs = _run_processes(lambda i: ["-c", ALIGN, f"localhost:{port}", str(i), "fail", str(a), str(b), str(tmp_path / "two")])
    (code_0, out_0), (code_1, out_1) = runs
    assert code_0 != 0 and code_1 != 0
    assert "No space left on device (planted)" in out_1
    assert "process 1 of 2 failed: OSError: No space left on device (planted)" in out_0
    assert not (tmp_path / "two").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".rotsym-tmp")]


def test_processes_given_different_runs_refuse_before_any_work(pair, tmp_path):
    """One process given other options (heads) than the other: both refuse at their first
    exchange, naming the difference, and nothing is written."""
    a, b, _ = pair
    port = _free_port()
    runs = _run_processes(lambda i: ["-c", ALIGN, f"localhost:{port}", str(i), "differ", str(a), str(b), str(tmp_path / "two")])
    for code, output in runs:
        assert code != 0 and "the processes were given different runs: process 1 has options.heads: 'fixed' (process 0: 'permute')" in output, output[-2000:]
    assert not (tmp_path / "two").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".rotsym-tmp")]


@pytest.mark.slow  # ~10 s; the default run has the two processes' bits and a failing process
def test_command_line_merges_over_two_processes(pair, tmp_path):
    """`rotsym merge ... --coordinator --num-processes --process-id`: the same files as one
    process's `rotsym merge`; process 0 alone prints the summary."""
    a, b, c = pair
    from rotsym_jax import cli

    argv = ["merge", "--method", "average", str(a), str(b), str(c)]
    assert cli.main([*argv, str(tmp_path / "one"), "--quiet", "--max-memory", "8G"]) == 0
    port = _free_port()
    runs = _run_processes(lambda i: ["-m", "rotsym_jax.cli", *argv, str(tmp_path / "two"), "--coordinator", f"localhost:{port}",
                                     "--num-processes", "2", "--process-id", str(i)])
    for code, output in runs:
        assert code == 0, output[-3000:]
    assert "wrote" in runs[0][1] and "wrote" not in runs[1][1]
    assert _files(tmp_path / "two") == _files(tmp_path / "one")
    report = json.loads((tmp_path / "two" / "rotsym_report.json").read_text())
    assert report["result"]["processes"]["count"] == 2


DEVICES = """
import sys, jax
from rotsym_jax import streaming
from test_processes import _aligned_digest
assert len(jax.local_devices()) == 4
a, b, c, out = sys.argv[1:]
used, moved = set(), streaming._lanes.moved_chunk
def recording(layout, chunk, flat, transforms, clock):  # where each chunk's moved leaves are
    out = moved(layout, chunk, flat, transforms, clock)
    used.update(d.id for x in jax.tree.leaves(out) for d in x.devices())
    return out
streaming._align.moved_chunk = streaming._merge.moved_chunk = recording
result = streaming.align_to_disk(a, b, out + "/align", chunk_layers=1, max_shard_bytes=6000, heads="permute")
merged = streaming.merge_to_disk("ties", [a, b], out + "/merge", base=c, chunk_layers=1, params={"density": 0.5})
from rotsym_jax.engine import ffn
cost_devices, layer_costs = set(), ffn.layer_costs
def recording_costs(*args):  # where align's FFN cost matrices are computed
    out = layer_costs(*args)
    cost_devices.update(d.id for d in out.scores.devices())
    return out
ffn.layer_costs = recording_costs
in_memory = _aligned_digest(a, b)
print("REPORT", __import__("json").dumps({"before": result.report["before"], "after": result.report["after"],
                                          "merged": merged.report["merged_distance_to_anchor"], "devices": sorted(used),
                                          "in_memory": in_memory, "cost_devices": sorted(cost_devices)}))
"""


def _aligned_digest(a, b) -> str:
    """sha256 of in-memory `align`'s params and transforms for the pair (heads permuted)."""
    import rotsym_jax as rj

    ca, cb = rj.load_hf(a), rj.load_hf(b)
    body = lambda p: {k: v for k, v in p.items() if k != "head"}  # noqa: E731
    result = rj.align(body(ca.params), body(cb.params), rj.spec_for(cb), heads="permute")
    digest = hashlib.sha256()
    for x in jax.tree.leaves((result.params, result.transforms)):
        digest.update(np.asarray(x).tobytes())
    return digest.hexdigest()


@pytest.mark.slow  # ~25 s: a fresh process compiling every program on four devices
def test_four_devices_write_the_bits_of_one(pair, tmp_path):
    """One process with four host CPU devices: streamed, a chunk in flight on each (its programs
    there), the files and distances of one device, for an alignment and an aligned TIES merge;
    in memory, `align` computes layer i's FFN costs on device i % 4, with the same bits."""
    a, b, c = pair
    one = streaming.align_to_disk(a, b, tmp_path / "one" / "align", chunk_layers=1, max_shard_bytes=6000, heads="permute")
    merged = streaming.merge_to_disk("ties", [a, b], tmp_path / "one" / "merge", base=c, chunk_layers=1, params={"density": 0.5})
    ((code, output),) = _run_processes(lambda i: ["-c", DEVICES, str(a), str(b), str(c), str(tmp_path / "four")], count=1, devices=4)
    assert code == 0, output[-3000:]
    for what in ("align", "merge"):
        assert _files(tmp_path / "four" / what) == _files(tmp_path / "one" / what), what
    (report,) = [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith("REPORT ")]
    assert report.pop("devices") == [0, 1, 2, 3]  # every device moved chunks
    assert report.pop("cost_devices") == [0, 1, 2, 3] and report.pop("in_memory") == _aligned_digest(a, b)
    assert report == {"before": one.report["before"], "after": one.report["after"], "merged": merged.report["merged_distance_to_anchor"]}


def test_shares_cover_every_chunk_once():
    for count in range(1, 6):
        for n in range(0, 12):
            shares = [processes.Team(i, count).share(list(range(n))) for i in range(count)]
            assert [x for share in shares for x in share] == list(range(n))
            sizes = [len(share) for share in shares]
            assert max(sizes) - min(sizes) <= 1


def test_command_line_refuses_partial_flags_and_unstreamed_runs(pair, tmp_path, capsys):
    from rotsym_jax import cli

    a, b, _ = pair
    with pytest.raises(SystemExit):
        cli.main(["align", str(a), str(b), str(tmp_path / "x"), "--num-processes", "2"])
    assert "--num-processes needs --coordinator, --process-id too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["align", str(a), str(b), str(tmp_path / "x"), "--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"])
    assert "--process-id 2: expected 0 to 1" in capsys.readouterr().err
    # refused before joining (a lone process would wait for the others): an existing OUT
    joined = ["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "0"]
    (tmp_path / "exists").mkdir()
    with pytest.raises(SystemExit):
        cli.main(["align", str(a), str(b), str(tmp_path / "exists"), *joined])
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert jax.process_count() == 1  # nothing joined
    np.testing.assert_equal(processes.Team().exchange(lambda: 7), [7])  # one process: the work's result, no collective
