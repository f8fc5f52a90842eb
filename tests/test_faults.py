"""Crash safety and hostile inputs (issues 46 item 7 and 53): the essential cases of the fault trial
(benchmarks/faults.py, run whole by the slow test at the end).

Signals go to real `rotsym align` processes, started as `python -c` with the command's own `main`
and one change: writing config.json into the temporary folder then sleeps, so that the folder
stays while the signal is sent (the trial sends them at real moments, unchanged). The rest calls
the command in this process: each refusal is one line on stderr, before any weight is read where
the inputs tell."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import transformers as tf
from parity_utils import save_reference

from rotsym_jax import cli
from rotsym_jax.io import hf
from rotsym_jax.io import recipe as recipe_mod
from rotsym_jax.io._publish import MANIFEST

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, max_position_embeddings=16)

# `rotsym` with writing slowed once the temporary folder exists (and only then).
SLOW_ROTSYM = """
import sys, time
from rotsym_jax.io import hf
write_config = hf.write_config
def slow(*args, **kwargs):
    write_config(*args, **kwargs)
    time.sleep(120)
hf.write_config = slow
from rotsym_jax.cli.parsers import main
sys.exit(main())
"""

# `rotsym` that fails loudly where it reads a tensor's bytes (conftest's `no_weight_reads`, in a
# process of its own): a refusal it prints came before any weight was read.
NO_READS_ROTSYM = """
import sys
from rotsym_jax.io import hf
def refuse(self, name, rows=None):
    raise SystemExit(f"read the weights of {name} before refusing")
hf.TensorFiles.read = hf.TensorFiles.get = refuse
from rotsym_jax.cli.parsers import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    config = tf.LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False)
    for seed in (0, 1):
        save_reference(tf.LlamaForCausalLM, config, root / f"m{seed}", seed=seed)
    return root / "m0", root / "m1"


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        h.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def start(*args, cwd: Path, slow: bool = True) -> subprocess.Popen:
    command = [sys.executable, "-c", SLOW_ROTSYM if slow else NO_READS_ROTSYM]
    return subprocess.Popen([*command, *map(str, args)], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(proc: subprocess.Popen, folder: Path, pattern: str, timeout: float = 180) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(folder.glob(pattern))
        if found:
            return found[0]
        if proc.poll() is not None:
            pytest.fail(f"the process ended (rc {proc.returncode}) before {pattern} appeared: {proc.stderr.read()[-2000:]}")
        time.sleep(0.005)
    proc.kill()
    pytest.fail(f"{pattern} never appeared")


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ---- signals -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("moment", ["lock", "tmp"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_align_in_one_line_and_leaves_nothing(llama, tmp_path, sig, moment):
    """SIGINT (Ctrl-C) or SIGTERM once the lock on OUT is taken (models loading, programs
    compiling), or once the temporary folder exists: one line, exit 128 + the signal, OUT absent,
    nothing left beside it. Before: a KeyboardInterrupt traceback (sometimes a segfault), or a
    silent SIGTERM leaving .rotsym-tmp-*."""
    a, b = llama
    before = digest(a.parent)
    proc = start("align", a, b, "out", cwd=tmp_path)
    wait_for(proc, tmp_path, ".out.rotsym-lock" if moment == "lock" else ".rotsym-tmp-*")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert lines(err) == [f"rotsym align: interrupted ({sig.name}); nothing was written, {tmp_path / 'out'} untouched"]
    assert os.listdir(tmp_path) == []
    assert digest(a.parent) == before


def test_a_signals_cleanup_removes_the_scratch_folders_of_a_records_proof(llama, tmp_path, monkeypatch):
    """A model type read through an inferred record is proven on small models written in the
    system's temporary folder; Ctrl-C there left /tmp/rotsym-verify-* and rotsym-infer-* (a
    TemporaryDirectory outlives os._exit) and named the small models as outputs written."""
    import tempfile

    from rotsym_jax import owned

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    since = owned.published_count()
    with owned.scratch("rotsym-verify-") as scratch:
        assert scratch.parent == tmp_path
        hf.save_hf(hf.load_hf(llama[0]), hf.load_hf(llama[0]).params, scratch / "element-0")  # published, inside the scratch
        owned.temp_folder(scratch, ".rotsym-tmp-", scratch / "element-1")  # a save under way there: no output of the user's
        with owned.critical():  # what the signal's watcher does
            outputs, published, failed = owned.remove_registered(since)
    assert (outputs, published, failed) == ([], [], []) and os.listdir(tmp_path) == []


def test_a_second_run_on_the_same_out_refuses_at_once(llama, tmp_path):
    """Two runs writing one OUT: the second refuses before reading any weight, naming the first
    (before: it computed the whole alignment and failed with `pass overwrite=True`, or replaced
    the first's output)."""
    a, b = llama
    first = start("align", a, b, "out", cwd=tmp_path)
    try:
        wait_for(first, tmp_path, ".rotsym-tmp-*")
        second = start("align", a, b, "out", cwd=tmp_path, slow=False)  # fails where it reads a weight
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err[-3000:]
        (line,) = lines(err)
        assert line.startswith(f"rotsym align: error: OUT: another rotsym run (pid {first.pid} on host {socket.gethostname()}, started ")
        assert f"is writing {tmp_path / 'out'}" in line
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 143 and os.listdir(tmp_path) == []


def test_what_dead_runs_left_is_removed_by_the_next_and_the_rest_named(llama, tmp_path, capsys):
    """A temporary folder marked by a process that is gone (or named by it, if it died before its
    marker was written) is removed by the next run writing beside it, and so is a lock file nobody
    holds; one marked by a running process, or unmarked, is left and named in a note."""
    from rotsym_jax import owned

    a, b = llama
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me = owned.owner()
    running = subprocess.Popen([sys.executable, "-c", "import json, time; from rotsym_jax import owned; print(json.dumps(owned.owner()), "
                                "flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    alive = json.loads(running.stdout.readline())
    for name, record in ((".rotsym-tmp-dead", {**me, "pid": gone.pid, "start": -1}), (".rotsym-stats-dead", {**me, "pid": gone.pid}),
                         (".rotsym-tmp-alive", alive), (".rotsym-tmp-unmarked", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 1000)
        if record is not None:
            (tmp_path / name / owned.MARKER).write_text(json.dumps(record))
    (tmp_path / ".other.rotsym-lock").write_text(json.dumps({**me, "pid": gone.pid}))
    # killed between mkdir and its marker: the folder's name holds its owner
    subprocess.run([sys.executable, "-c", f"import os; from rotsym_jax import owned; owned.unmark(owned.temp_folder({str(tmp_path)!r}, "
                    "'.rotsym-tmp-')); os._exit(0)"], check=True)
    try:
        assert cli.main(["align", str(a), str(b), str(tmp_path / "out")]) == 0
        assert sorted(os.listdir(tmp_path)) == [".rotsym-tmp-alive", ".rotsym-tmp-unmarked", "out"]
        err = capsys.readouterr().err
        assert f"{tmp_path / '.rotsym-tmp-alive'} belongs to a running process (pid {running.pid}" in err
        assert f"{tmp_path / '.rotsym-tmp-unmarked'} was left by an earlier run and bears no owner marker" in err
        assert owned.owner_state({**me, "pid": gone.pid}) == "dead" and owned.owner_state(alive) == "alive"
        assert owned.owner_state({**alive, "start": alive["start"] + 1}) == "dead"  # the pid, reused by another process
        assert owned.owner_state({**me, "host": "elsewhere"}) == "unknown"
    finally:
        running.kill()
        running.wait()


# ---- durability ------------------------------------------------------------------------------------------

def test_every_file_and_the_folder_are_synced_before_the_rename_and_the_parent_after(llama, tmp_path, monkeypatch):
    events = []
    real_fsync, real_publish = os.fsync, hf.publish

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def publish(tmp, target):
        events.append(("publish", str(tmp)))
        return real_publish(tmp, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(hf, "publish", publish)
    ck = hf.load_hf(llama[1])
    out = tmp_path / "out"
    hf.save_hf(ck, ck.params, out, extra_files={"README.md": "card"})
    at = next(i for i, e in enumerate(events) if e[0] == "publish")
    tmp = events[at][1]
    synced_before = {Path(p).relative_to(tmp).as_posix() for kind, p in events[:at] if p.startswith(tmp + "/")}
    assert set(os.listdir(out)) <= synced_before and any(p == tmp for _, p in events[:at])
    assert ("fsync", str(tmp_path)) in events[at:]
    # what is published holds no owner marker, and nothing is left beside it
    assert os.listdir(tmp_path) == ["out"] and not any(p.name.startswith(".rotsym") and p.name != MANIFEST for p in out.iterdir())
    np.testing.assert_array_equal(safetensors.numpy.load_file(out / "model.safetensors")["lm_head.weight"],
                                  safetensors.numpy.load_file(llama[1] / "model.safetensors")["lm_head.weight"])


# ---- hostile and broken inputs -----------------------------------------------------------------------------

def refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as stop:
        cli.main([str(a) for a in argv])
    assert stop.value.code == 2
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("value", ['!!python/object/apply:os.system ["touch PWNED"]', "!!python/name:os.system",
                                   "!!python/object/new:os.system [touch PWNED]",
                                   "!<tag:yaml.org,2002:python/object/apply:subprocess.call> [[touch, PWNED]]"])
def test_a_recipe_with_python_tags_is_refused_by_name(llama, tmp_path, capsys, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "evil.yaml").write_text(f"models: {value}\nmethod: average\n")
    line = refused(capsys, "merge", tmp_path / "evil.yaml", tmp_path / "out")
    assert "line 1: the YAML tag !!python/" in line and "is not allowed in a recipe" in line
    assert sorted(os.listdir(tmp_path)) == ["evil.yaml"]


def test_a_recipe_of_nested_aliases_is_refused_small_and_before_any_value_is_built(llama, tmp_path, capsys, monkeypatch):
    """A "billion laughs": 6 levels of 9 aliases (531,441 values from ~400 bytes; 7 levels made an
    802 MB error line, 2.6 GB and 25 s). Refused from the node graph, before any value is
    constructed, which is what made it slow (a wall-clock bound would depend on the machine's load)."""
    built = []
    monkeypatch.setattr(recipe_mod.yaml, "serialize", lambda *args, **kwargs: built.append(args) or "null")
    a, b = llama
    levels = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    levels += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 6)]
    recipe = tmp_path / "laughs.yaml"
    recipe.write_text("x:\n" + "\n".join(f"  {line}" for line in levels) + f"\nmodels: *a5\nmethod: average\n# {a} {b}\n")
    line = refused(capsys, "merge", recipe, tmp_path / "out")
    assert built == [] and len(line) < 400
    assert "YAML holds more than 10000 values, aliases expanded" in line


def test_a_seed_beyond_64_bits_is_refused_before_any_weight_is_read(llama, tmp_path, capsys, no_weight_reads):
    a, b = llama
    recipe = tmp_path / "dare.yaml"
    recipe.write_text(f"models: [{a}, {b}]\nmethod: dare\nbase: {a}\nseed: {10**50}\n")
    assert "seed = 100000000000000000000000000000000000000000000000000; expected an integer in [-2**63, 2**63)" in \
        refused(capsys, "merge", recipe, tmp_path / "out")
    assert "--seed: must fit in 64 bits" in refused(capsys, "merge", "--method", "dare", a, b, "--base", a, "--seed", str(10**50), tmp_path / "out")


def test_a_config_nested_200000_levels_is_one_line(llama, tmp_path, capsys, no_weight_reads):
    a, b = llama
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "model.safetensors").write_bytes((b / "model.safetensors").read_bytes())
    config = (b / "config.json").read_text().rstrip().rstrip("}")
    (deep / "config.json").write_text(config + ', "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    line = refused(capsys, "align", a, deep, tmp_path / "out")
    assert f"B: {deep / 'config.json'}: JSON nested too deeply" in line


def test_a_shard_linked_from_outside_the_folder_is_refused(llama, tmp_path, capsys, no_weight_reads):
    """As an index entry pointing outside the folder is (before: the link was followed)."""
    a, b = llama
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "config.json").write_text((b / "config.json").read_text())
    (linked / "model.safetensors").symlink_to(b / "model.safetensors")
    line = refused(capsys, "align", a, linked, tmp_path / "out")
    assert f"{linked / 'model.safetensors'} is a symbolic link to {b / 'model.safetensors'}, outside the checkpoint folder" in line


def test_a_symlink_loop_is_named_as_such_not_looked_up_on_the_hub(llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "loop").symlink_to(tmp_path / "org" / "loop")
    line = refused(capsys, "align", "org/loop", llama[1], tmp_path / "out")
    assert line.startswith("rotsym align: error: A: org/loop is a symbolic link loop")


@pytest.mark.parametrize("which", ["A", "B"])
def test_out_inside_an_input_is_refused_before_any_work(llama, tmp_path, capsys, no_weight_reads, which):
    a, b = llama
    source = {"A": a, "B": b}[which]
    before, mtime = digest(source), source.stat().st_mtime_ns
    line = refused(capsys, "align", a, b, source / "sub")
    assert f"OUT: {source / 'sub'} lies inside the input {source}" in line
    assert digest(source) == before and source.stat().st_mtime_ns == mtime  # not even a lock file came and went


def test_a_disk_that_fills_while_writing_is_one_line_and_leaves_nothing(llama, tmp_path, capsys, monkeypatch):
    """safetensors' writer failing with ENOSPC (before: SafetensorError's traceback)."""
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 4096)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    a, b = llama
    assert cli.main(["align", str(a), str(b), str(tmp_path / "out")]) == 1
    (line,) = lines(capsys.readouterr().err)
    assert line.startswith("rotsym align: error: ") and "No space left on device" in line
    assert f"{tmp_path / 'out'} was left as it was and the partial output removed" in line
    assert os.listdir(tmp_path) == []


def test_a_disk_that_fills_while_streaming_is_the_same_line(llama, tmp_path, capsys, monkeypatch):
    """The streamed writer's ENOSPC ends as the in-memory one does: code 1, the file and the note
    (before: code 2, a usage error's line, and no file)."""
    from rotsym_jax.io import _files

    class FullDisk:  # the os module, as the shard writer sees it, on a full disk
        def __getattr__(self, name):
            return getattr(os, name)

        def pwrite(self, fd, data, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_files, "os", FullDisk())
    a, b = llama
    assert cli.main(["align", str(a), str(b), str(tmp_path / "out"), "--max-memory", "1G"]) == 1
    (line,) = lines(capsys.readouterr().err)
    assert line.startswith("rotsym align: error: ") and "model.safetensors: No space left on device" in line
    assert f"{tmp_path / 'out'} was left as it was and the partial output removed" in line
    assert os.listdir(tmp_path) == []


def test_a_mount_point_as_out_is_refused_before_any_work(llama, tmp_path, capsys, no_weight_reads):
    """OUT a mount point holding a checkpoint, with --overwrite (before: `OSError: Device or
    resource busy` after the whole run). Needs a tmpfs mount (root, Linux); skipped elsewhere."""
    a, b = llama
    mount = tmp_path / "mnt"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        for f in b.iterdir():
            (mount / f.name).write_bytes(f.read_bytes())
        before = digest(mount)
        line = refused(capsys, "align", a, b, mount, "--overwrite")
        assert f"OUT: {mount} is a mount point" in line and digest(mount) == before
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_mount_point_as_out_is_refused_where_no_tmpfs_can_be_mounted(llama, tmp_path, capsys, no_weight_reads, monkeypatch):
    """The same refusal where mounting needs rights the machine lacks: OUT reported as a mount
    point (os.path.ismount, which the check reads), so the refusal runs everywhere."""
    a, b = llama
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("mine")
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == out or real(path))
    line = refused(capsys, "align", a, b, out, "--overwrite")
    assert f"OUT: {out} is a mount point" in line and (out / "kept.txt").read_text() == "mine"


@pytest.mark.slow
def test_the_fault_trial(tmp_path):
    """benchmarks/faults.py --quick: every case one line, no input changed, no partial OUT, no
    traceback, no hang, nothing left after the next run."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--quick", "--root", str(tmp_path),
                           "--out", str(tmp_path / "faults.json")], capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    record = json.loads((tmp_path / "faults.json").read_text())
    summary = record["summary"]
    assert summary["cases"] > 20
    for case in (c for c in record["cases"] if c["case"] == "disk full while writing" and "skipped" not in c):
        assert case["rc"] not in (0, None) and case["note"] == "ENOSPC while writing", case
    (second,) = [c for c in record["cases"] if c["case"] == "two runs: the second"]
    assert second["rc"] == 2 and "another rotsym run" in second["stderr_tail"], second
    assert {k: summary[k] for k in ("inputs_changed", "partial_out", "tracebacks", "hangs", "segfaults", "leftovers_after_next",
                                    "refusals_not_one_line")} == dict.fromkeys(("inputs_changed", "partial_out", "tracebacks", "hangs",
                                                                               "segfaults", "leftovers_after_next", "refusals_not_one_line"), 0)
