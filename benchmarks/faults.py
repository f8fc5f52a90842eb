"""The fault trial (issues 46 item 7 and 53): real `rotsym` processes on transformers-written Llama and
BERT pairs, in memory and streamed (`--max-memory 1G`), each bounded by a timeout, interrupted by
signals at several moments, given hostile files, racing for one OUT, running out of disk.

    .venv/bin/python benchmarks/faults.py [--quick] [--root DIR] [--out FILE] [--fsync-large]

Moments a signal is sent: early (0.5 s after start: the command is importing, or reading configs),
mid (half of an uninterrupted run's wall time: loading, compiling, aligning), lock (the lock beside
OUT appeared: before any weight is read), tmp (the temporary folder appeared), write (a weights file
appeared in it), stats (a streamed Fisher merge's spill appeared). Every case records: the inputs
byte for byte identical or not; OUT absent, complete old, complete new or partial; a traceback or
not; a hang (the timeout passed) or not; a segfault; the lines on stderr (a refusal or an interrupt
must be one); what is left beside OUT, and after the next run writing there (which removes what
provably dead runs left). A run killed by SIGKILL says nothing: only its leftovers count.

Also measured: what fsync costs (the same in-memory align, with the library's fsyncs and with them
made no-ops, alternated; `--fsync-large` adds a ~0.5 GB model). Prints a table and writes
benchmarks/results/faults.json (faults-<device>.json on an accelerator) with the commit, command and
device. `--quick` (tests/test_faults.py's slow test) runs a subset on the Llama pair.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
_SCRIPT = Path(sys.executable).parent / "rotsym"
ROTSYM = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "rotsym_jax.cli"]
# `rotsym` whose check of free room before any work sees 1 PiB free: the disk fills after the check.
ROOM_CHECK_FOOLED = [sys.executable, "-c", "import shutil, sys; from rotsym_jax.cli import console; real = shutil.disk_usage; "
                     "shutil.disk_usage = lambda path: real(path)._replace(free=2**50); console()"]
# What a report and a card hold that changes from run to run (dates, timings): left out of OUT's digest.
# Files that differ between two complete runs: the report and card (times), the list of what a run
# wrote (its files' modification times).
VOLATILE = ("rotsym_report.json", "README.md", ".rotsym-written.json")

SHAPES = {
    "llama": dict(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=688, max_position_embeddings=64, tie_word_embeddings=False),
    "bert": dict(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, intermediate_size=1024,
                 max_position_embeddings=64, num_labels=3),
    "large": dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                  intermediate_size=2752, max_position_embeddings=64, tie_word_embeddings=False),
}


# ---- inputs ------------------------------------------------------------------------------------------

def write_models(root: Path, families) -> dict:
    """Pairs of seeded random models saved by transformers (`save_pretrained`)."""
    import numpy as np
    import torch
    import transformers as tf

    made = {}
    for family in families:
        config = (tf.BertConfig if family == "bert" else tf.LlamaConfig)(**SHAPES[family])
        cls = tf.BertForSequenceClassification if family == "bert" else tf.LlamaForCausalLM
        for seed in (0, 1):
            folder = root / f"{family}-{seed}"
            if not (folder / "config.json").exists():
                torch.manual_seed(seed)
                model = cls(config).eval()
                with torch.no_grad():
                    for p in model.parameters():
                        if p.ndim == 1:
                            p.add_(0.1 * torch.randn_like(p))
                model.save_pretrained(folder)
        made[family] = (root / f"{family}-0", root / f"{family}-1")
    if "bert" in families:  # a Fisher merge's data: token ids and labels
        rng = np.random.default_rng(0)
        np.savez(root / "bert-data.npz", input_ids=rng.integers(0, 8000, (8, 16)), attention_mask=np.ones((8, 16), np.int64),
                 labels=rng.integers(0, 3, 8))
    return made


def digest(folder: Path, skip=()) -> str | None:
    if not folder.exists():
        return None
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.name in skip:
            continue
        h.update(str(path.relative_to(folder)).encode())
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def leftovers(folder: Path, keep=()) -> list[str]:
    """What a run leaves beside its output: temporary folders and files, lock files."""
    return sorted(p.name for p in folder.iterdir() if p.name not in keep and (p.name.startswith(".rotsym") or p.name.endswith(".rotsym-lock")
                                                                             or ".tmp-" in p.name))


# ---- one run -----------------------------------------------------------------------------------------

ABSL_LINE = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ ]+:\d+\] |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] )")
MOMENT_PATTERNS = {"lock": ".{out}.rotsym-lock", "tmp": ".rotsym-tmp-*", "write": ".rotsym-tmp-*/model*.safetensors", "stats": ".rotsym-stats-*"}


def xla_log_split(err: str) -> tuple[list[str], list[str]]:
    """(XLA's log lines, the others) of a process's stderr: an absl-format line and what follows it
    up to a line of rotsym's own ("rotsym ...", "note: ..."), a traceback or a Python warning (XLA's
    messages run over several lines, "constant folding is taking > 1s" among them)."""
    xla, own, in_log = [], [], False
    for line in err.splitlines():
        if ABSL_LINE.match(line):
            in_log = True
        elif line.startswith(("rotsym", "note: ", "Traceback")) or "Warning: " in line:
            in_log = False
        (xla if in_log else own).append(line)
    return xla, own


def run(argv, cwd: Path, *, timeout: float, sig=None, moment=None, delay=None, out_name="out", during=None, program=ROTSYM) -> dict:
    """One `rotsym` process (`program`): its exit, stderr, wall time, peak memory; a signal `sig`
    sent at `moment` (a name of MOMENT_PATTERNS) or after `delay` seconds; `during(proc)` run
    meanwhile."""
    err_file = tempfile.TemporaryFile()
    t0 = time.monotonic()
    proc = subprocess.Popen(program + [str(a) for a in argv], cwd=cwd, stdout=subprocess.DEVNULL, stderr=err_file,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "ROTSYM_COMPILATION_CACHE": "off"})
    sent_at, status, usage = None, None, None

    def reap(block_until):
        nonlocal status, usage
        while time.monotonic() < block_until:
            pid, st, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status, usage = st, ru
                return True
            time.sleep(0.001)
        return False

    if during is not None:
        during(proc)
    if sig is not None:
        pattern = MOMENT_PATTERNS[moment].format(out=out_name) if moment else None
        due = t0 + (delay or 0)
        while status is None and time.monotonic() < t0 + timeout:
            if (pattern is None and time.monotonic() >= due) or (pattern is not None and any(cwd.glob(pattern))):
                proc.send_signal(sig)
                sent_at = time.monotonic() - t0
                break
            reap(time.monotonic() + 0.0005)
    hang = status is None and not reap((time.monotonic() + 60) if sent_at is not None else t0 + timeout)
    if hang:
        proc.kill()
        reap(time.monotonic() + 30)
    seconds = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status) if status is not None else None  # reaped here, not by Popen
    err_file.seek(0)
    err = err_file.read().decode(errors="replace")
    # XLA's own log lines (absl's format) are timing-dependent ("constant folding is taking > 1s" on a
    # loaded machine): kept in the record, not counted against rotsym's one line.
    xla_log, lines = xla_log_split(err)
    lines = [line for line in lines if line.strip() and not line.startswith("note: ")]
    return {"rc": proc.returncode, "seconds": round(seconds, 2), "signal_sent_at": None if sent_at is None else round(sent_at, 3),
            "hang": hang, "segfault": proc.returncode == -signal.SIGSEGV, "traceback": "Traceback (most recent call last)" in err,
            "stderr_lines": len(lines), "stderr_tail": lines[-1][:300] if lines else "",
            # the lines before the last, kept where there are any: what made a one-line ending two
            "stderr_before_tail": [line[:300] for line in lines[:-1][-8:]], "xla_log_lines": [line[:300] for line in xla_log[-8:]],
            "peak_rss_mb": None if usage is None else round(usage.ru_maxrss / 1024, 1)}


def running(proc) -> bool:
    """Whether `proc` has not ended, without reaping it (`run` reaps it, for its resource usage)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


class Trial:
    def __init__(self, root: Path, models: dict, timeout: float):
        self.root, self.models, self.timeout = root, models, timeout
        self.cases, self.baselines = [], {}
        self.counter = 0

    def workdir(self) -> Path:
        self.counter += 1
        folder = self.root / "cases" / f"{self.counter:03d}"
        folder.mkdir(parents=True)
        return folder

    def inputs(self) -> list[Path]:
        return [p for pair in self.models.values() for p in pair] + ([self.root / "inputs" / "bert-data.npz"] if "bert" in self.models else [])

    def command(self, kind: str, family: str, mode: str, out: str = "out") -> list:
        a, b = self.models[family]
        streamed = ["--max-memory", "1G"] if mode == "streamed" else []
        if kind == "align":
            return ["align", a, b, out, *streamed]
        if kind == "merge":
            return ["merge", "--method", "average", a, b, out, *streamed]
        if kind == "fisher":
            recipe = self.root / "fisher.yaml"
            recipe.write_text(f"models: [{a}, {b}]\nmethod: fisher\ndata: {{file: {self.root / 'inputs' / 'bert-data.npz'}, batch_size: 4}}\n")
            return ["merge", recipe, out, *streamed]
        raise ValueError(kind)

    def baseline(self, kind: str, family: str, mode: str) -> dict:
        """An uninterrupted run: its wall time (for "mid") and its output's digest ("complete new")."""
        key = (kind, family, mode)
        if key not in self.baselines:
            cwd = self.workdir()
            r = run(self.command(kind, family, mode), cwd, timeout=self.timeout)
            if r["rc"] != 0:
                raise RuntimeError(f"baseline {key} failed: {r}")
            kept = self.root / "baselines" / "-".join(key)
            shutil.copytree(cwd / "out", kept)
            self.baselines[key] = {"seconds": r["seconds"], "digest": digest(cwd / "out", VOLATILE), "old": kept}
            self.record(f"baseline {kind}", family, mode, r, cwd, outcome="new", note="uninterrupted")
        return self.baselines[key]

    def out_state(self, out: Path, old: str | None, new: str | None) -> str:
        if not out.exists():
            return "absent"
        if old is not None and digest(out) == old:
            return "old"
        if digest(out, VOLATILE) == new and (out / "rotsym_report.json").exists():
            return "new"
        return "partial"

    def record(self, case, family, mode, r, cwd, *, outcome, note="", refusal=False, interrupted=False, before=None, next_run=True,
               out_name="out"):
        left = leftovers(cwd)
        after_next = left
        if left and next_run:  # the next run writing beside it cleans up what provably dead runs left
            run(self.command("align", "llama" if "llama" in self.models else "bert", "memory", "next-out"), cwd, timeout=self.timeout)
            after_next = leftovers(cwd, keep=("next-out",))
        inputs_same = before is None or before == {str(p): digest(p) if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
                                                   for p in self.inputs()}
        one_line = r["stderr_lines"] == 1 if (refusal or (interrupted and r["rc"] in (130, 143, 129))) else None
        row = {"case": case, "family": family, "mode": mode, **r, "out": outcome, "inputs_identical": inputs_same, "leftovers": left,
               "leftovers_after_next": after_next, "one_line": one_line, "note": note}
        self.cases.append(row)
        print(f"{case:<34} {family:<6} {mode:<8} rc {str(r['rc']):>4} {r['seconds']:6.1f}s out {outcome:<7} "
              f"{'TRACEBACK ' if r['traceback'] else ''}{'HANG ' if r['hang'] else ''}{'SEGV ' if r['segfault'] else ''}"
              f"left {len(left)}->{len(after_next)} {'one line' if one_line else '' if one_line is None else 'NOT ONE LINE'} "
              f"| {r['stderr_tail'][:110]}", flush=True)
        shutil.rmtree(cwd, ignore_errors=True)
        return row

    def snapshot(self) -> dict:
        return {str(p): digest(p) if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest() for p in self.inputs()}

    # -- cases --

    def signal_case(self, kind, family, mode, sig, moment, existing: bool):
        base = self.baseline(kind, family, mode)
        cwd = self.workdir()
        argv = self.command(kind, family, mode)
        old = None
        if existing:  # OUT holds a complete checkpoint (another run's), replaced with --overwrite
            shutil.copytree(base["old"], cwd / "out")
            for name in VOLATILE:
                (cwd / "out" / name).write_text("the old output\n")
            old = digest(cwd / "out")
            argv = [*argv, "--overwrite"]
        before = self.snapshot()
        if moment == "early":
            r = run(argv, cwd, timeout=self.timeout, sig=sig, delay=0.5)
        elif moment == "mid":
            r = run(argv, cwd, timeout=self.timeout, sig=sig, delay=base["seconds"] / 2)
        else:
            r = run(argv, cwd, timeout=self.timeout, sig=sig, moment=moment)
        outcome = self.out_state(cwd / "out", old, base["digest"])
        note = "" if r["signal_sent_at"] is not None else "finished before the moment came"
        self.record(f"{kind} {signal.Signals(sig).name} at {moment}{' (--overwrite)' if existing else ''}", family, mode, r, cwd,
                    outcome=outcome, interrupted=True, before=before, note=note)

    def two_runs(self, family, mode):
        base = self.baseline("align", family, mode)
        cwd = self.workdir()
        before = self.snapshot()
        second = {}

        def holds_lock(proc) -> bool:
            # the owner record is written after flock succeeds: a lock file that merely exists may be
            # one the first has opened and not locked yet, which a second run rightly takes
            try:
                return json.loads((cwd / ".out.rotsym-lock").read_bytes()).get("pid") == proc.pid
            except (OSError, ValueError, AttributeError):
                return False

        def race(proc):
            deadline = time.monotonic() + self.timeout
            while not holds_lock(proc) and running(proc) and time.monotonic() < deadline:
                time.sleep(0.002)
            # the first held still while the second runs: it cannot finish first, whatever the machine
            proc.send_signal(signal.SIGSTOP)
            try:
                second.update(run(self.command("align", family, mode), cwd, timeout=self.timeout))
            finally:
                proc.send_signal(signal.SIGCONT)

        r = run(self.command("align", family, mode), cwd, timeout=self.timeout, during=race)
        outcome = self.out_state(cwd / "out", None, base["digest"])
        self.record("two runs: the second", family, mode, second, cwd, outcome=outcome, refusal=True, before=before, next_run=False,
                    note=f"the first: rc {r['rc']}, {r['seconds']} s; the second refused after {second['seconds']} s")

    def disk_full(self, family, mode):
        """A tmpfs with room for half the output, and a run whose up-front check of free room is
        told there is plenty: the disk fills after the check, as when another writer fills it, but
        at the same point of every run (a filler racing the run lost to a fast one)."""
        base = self.baseline("align", family, mode)
        cwd = self.workdir()
        size = sum(f.stat().st_size for f in base["old"].iterdir()) // 2
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(cwd)], capture_output=True).returncode:
            self.cases.append({"case": "disk full while writing", "family": family, "mode": mode, "skipped": "cannot mount a tmpfs here"})
            print(f"disk full while writing: skipped ({family} {mode}: cannot mount a tmpfs)")
            return
        before = self.snapshot()

        try:
            r = run(self.command("align", family, mode), cwd, timeout=self.timeout, program=ROOM_CHECK_FOOLED)
            outcome = self.out_state(cwd / "out", None, base["digest"])
            left = leftovers(cwd)
            self.cases.append({"case": "disk full while writing", "family": family, "mode": mode, **r, "out": outcome, "leftovers": left,
                               "leftovers_after_next": left, "inputs_identical": before == self.snapshot(), "one_line": r["stderr_lines"] == 1,
                               "note": "ENOSPC while writing" if "No space left" in r["stderr_tail"] else "the disk never filled"})
            print(f"{'disk full while writing':<34} {family:<6} {mode:<8} rc {r['rc']:>4} out {outcome} left {left} "
                  f"{'one line' if r['stderr_lines'] == 1 else 'NOT ONE LINE'} | {r['stderr_tail'][:140]}")
        finally:
            subprocess.run(["umount", str(cwd)], capture_output=True)
            shutil.rmtree(cwd, ignore_errors=True)

    def mount_point(self, family):
        cwd = self.workdir()
        mnt = cwd / "out"
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)], capture_output=True).returncode:
            self.cases.append({"case": "OUT a mount point, --overwrite", "family": family, "skipped": "cannot mount a tmpfs here"})
            return
        try:
            for f in self.models[family][1].iterdir():
                shutil.copy2(f, mnt / f.name)
            old = digest(mnt)
            before = self.snapshot()
            r = run([*self.command("align", family, "memory"), "--overwrite"], cwd, timeout=self.timeout)
            outcome = self.out_state(mnt, old, None)
        finally:
            subprocess.run(["umount", str(mnt)], capture_output=True)
        self.record("OUT a mount point, --overwrite", family, "memory", r, cwd, outcome=outcome, refusal=True, before=before, next_run=False)

    def hostile(self, case, argv, family="llama", prepare=None):
        cwd = self.workdir()
        if prepare is not None:
            prepare(cwd)
        before = self.snapshot()
        r = run(argv(cwd) if callable(argv) else argv, cwd, timeout=self.timeout)
        outcome = self.out_state(cwd / "out", None, None)
        self.record(case, family, "memory", r, cwd, outcome=outcome, refusal=True, before=before, next_run=False)

    def fuzz(self, tries: int, seed: int = 0):
        """Random bytes in the first 200 bytes of B's safetensors file (all 200, or a few)."""
        rng = random.Random(seed)
        a, b = self.models["llama"]
        for i in range(tries):
            def prepare(cwd, i=i):
                shutil.copytree(b, cwd / "fuzzed")
                data = bytearray((b / "model.safetensors").read_bytes())
                if i % 3 == 0:
                    data[:200] = rng.randbytes(200)
                else:
                    for _ in range(rng.randint(1, 8)):
                        data[rng.randrange(200)] = rng.randrange(256)
                (cwd / "fuzzed" / "model.safetensors").write_bytes(data)

            mode = "streamed" if i % 2 else "memory"
            cwd = self.workdir()
            prepare(cwd)
            before = self.snapshot()
            r = run(["align", a, cwd / "fuzzed", "out", *(["--max-memory", "1G"] if mode == "streamed" else [])], cwd, timeout=self.timeout)
            outcome = self.out_state(cwd / "out", None, None)
            if r["rc"] == 0 and outcome == "partial":  # a byte the header does not need (padding): a complete output
                outcome = "new"
            self.record(f"fuzzed header #{i}", "llama", mode, r, cwd, outcome=outcome, refusal=r["rc"] != 0, before=before, next_run=False)


# ---- hostile files -----------------------------------------------------------------------------------

PYTHON_TAGS = ['!!python/object/apply:os.system ["touch PWNED"]', "!!python/name:os.system", "!!python/object/new:os.system [touch PWNED]",
               "!<tag:yaml.org,2002:python/object/apply:subprocess.call> [[touch, PWNED]]"]


def laughs(levels: int) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "x:\n" + "\n".join(f"  {line}" for line in lines) + f"\nmodels: *a{levels - 1}\nmethod: average\n"


def hostile_cases(trial: Trial, quick: bool):
    a, b = trial.models["llama"]
    for i, tag in enumerate(PYTHON_TAGS[:2] if quick else PYTHON_TAGS):
        trial.hostile(f"recipe with a Python tag #{i}", lambda cwd, tag=tag: (cwd.joinpath("r.yaml").write_text(f"models: {tag}\nmethod: average\n"),
                                                                             ["merge", "r.yaml", "out"])[1])
    trial.hostile("recipe of 7 levels of aliases", lambda cwd: (cwd.joinpath("r.yaml").write_text(laughs(7)), ["merge", "r.yaml", "out"])[1])
    trial.hostile("seed 10**50 with dare (recipe)", lambda cwd: (cwd.joinpath("r.yaml").write_text(
        f"models: [{a}, {b}]\nmethod: dare\nbase: {a}\nseed: {10**50}\n"), ["merge", "r.yaml", "out"])[1])
    trial.hostile("seed 10**50 with dare (--seed)", ["merge", "--method", "dare", a, b, "--base", a, "--seed", str(10**50), "out"])

    def deep(cwd):
        (cwd / "deep").mkdir()
        shutil.copy2(b / "model.safetensors", cwd / "deep" / "model.safetensors")
        text = (b / "config.json").read_text().rstrip().rstrip("}")
        (cwd / "deep" / "config.json").write_text(text + ', "x": ' + "[" * 200_000 + "]" * 200_000 + "}")

    trial.hostile("config.json nested 200,000 levels", ["align", a, "deep", "out"], prepare=deep)

    def linked(cwd):
        (cwd / "linked").mkdir()
        shutil.copy2(b / "config.json", cwd / "linked" / "config.json")
        (cwd / "linked" / "model.safetensors").symlink_to(b / "model.safetensors")

    trial.hostile("shard linked from outside", ["align", a, "linked", "out"], prepare=linked)

    def loop(cwd):
        (cwd / "org").mkdir()
        (cwd / "org" / "loop").symlink_to(cwd / "org" / "loop")

    trial.hostile("symlink loop as A", ["align", "org/loop", b, "out"], prepare=loop)
    trial.hostile("OUT inside A", ["align", a, b, a / "sub"])
    if not quick:
        trial.hostile("OUT inside B (merge)", ["merge", "--method", "average", a, b, b / "sub"])


# ---- fsync's cost ------------------------------------------------------------------------------------

def fsync_child(a: str, b: str, work: str, reps: int) -> dict:
    """In this process: the same in-memory `rotsym align` (compiled once first), with the library's
    fsyncs and with them made no-ops, alternated: wall seconds of each (the report's "write" timing
    ends before the fsyncs, so the wall time is the measure)."""
    from rotsym_jax import cli, owned

    real = owned.sync_file, owned.sync_folder, owned.sync_tree
    none = (lambda *a, **k: None,) * 3
    times = {"fsync": [], "no fsync": []}
    for i in range(reps + 1):
        for label, fns in (("fsync", real), ("no fsync", none)):
            owned.sync_file, owned.sync_folder, owned.sync_tree = fns
            out = Path(work) / f"out-{i}-{label.replace(' ', '')}"
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                assert cli.main(["align", a, b, str(out), "--quiet"]) == 0
            wall = time.perf_counter() - t0
            if i:  # the first pair compiles
                times[label].append(wall)
            shutil.rmtree(out)
    owned.sync_file, owned.sync_folder, owned.sync_tree = real
    size = sum(f.stat().st_size for f in Path(b).iterdir())
    return {"bytes_written": size, "reps": reps, **{f"{k} wall_s": statistics.median(v) for k, v in times.items()}, "wall_all": times}


def fsync_cost(models: dict, root: Path, reps: int) -> dict:
    out = {}
    for family, (a, b) in models.items():
        work = root / f"fsync-{family}"
        work.mkdir(exist_ok=True)
        done = subprocess.run([sys.executable, __file__, "--fsync-child", str(a), str(b), str(work), str(reps)], capture_output=True, text=True,
                              env={**os.environ, "ROTSYM_COMPILATION_CACHE": "off"})
        if done.returncode:
            raise RuntimeError(done.stderr[-3000:])
        out[family] = json.loads(done.stdout.strip().splitlines()[-1])
        r = out[family]
        print(f"fsync cost, {family} ({r['bytes_written'] / 2**20:.1f} MiB written): in-memory align {r['no fsync wall_s']:.3f} s without "
              f"fsync, {r['fsync wall_s']:.3f} s with (+{r['fsync wall_s'] - r['no fsync wall_s']:.3f} s; median of {reps})", flush=True)
    return out


# ---- the trial ---------------------------------------------------------------------------------------

def summarise(cases: list[dict]) -> dict:
    ran = [c for c in cases if "skipped" not in c]
    return {
        "cases": len(ran),
        "skipped": len(cases) - len(ran),
        "inputs_changed": sum(not c["inputs_identical"] for c in ran),
        "partial_out": sum(c["out"] == "partial" for c in ran),
        "tracebacks": sum(c["traceback"] for c in ran),
        "hangs": sum(c["hang"] for c in ran),
        "segfaults": sum(c["segfault"] for c in ran),
        "leftovers_after_run": sum(bool(c["leftovers"]) for c in ran),
        "leftovers_after_next": sum(bool(c["leftovers_after_next"]) for c in ran),
        "refusals_not_one_line": sum(c["one_line"] is False for c in ran),
        "signals_not_sent": sum(c.get("signal_sent_at") is None and "SIG" in c["case"] for c in ran),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a subset on the Llama pair (the slow test)")
    parser.add_argument("--root", default=None, help="where the models and cases go (default: a temporary folder, removed)")
    parser.add_argument("--out", default=None, help="the JSON (default: benchmarks/results/faults.json)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before a run counts as hung")
    parser.add_argument("--fsync-reps", type=int, default=5)
    parser.add_argument("--fsync-large", action="store_true", help="measure fsync's cost on a ~0.5 GB Llama too")
    parser.add_argument("--fsync-child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fsync_child:
        a, b, work, reps = args.fsync_child
        print(json.dumps(fsync_child(a, b, work, int(reps))))
        return 0
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="rotsym-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    try:
        families = ("llama",) if args.quick else ("llama", "bert")
        models = write_models(root / "inputs", families)
        trial = Trial(root, models, args.timeout)
        sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
        if args.quick:
            for mode in ("memory", "streamed"):
                for sig in sigs:
                    trial.signal_case("align", "llama", mode, sig, "tmp", existing=mode == "memory")
                trial.signal_case("align", "llama", mode, signal.SIGINT, "mid", existing=False)
            trial.signal_case("merge", "llama", "streamed", signal.SIGKILL, "write", existing=False)
            trial.two_runs("llama", "memory")
            trial.disk_full("llama", "memory")
            hostile_cases(trial, quick=True)
            trial.fuzz(4)
        else:
            for family in families:
                for mode in ("memory", "streamed"):
                    for sig in sigs:
                        for moment in ("early", "mid", "lock", "tmp", "write"):
                            trial.signal_case("align", family, mode, sig, moment, existing=moment in ("tmp", "write"))
                    for sig in sigs:
                        trial.signal_case("merge", family, mode, sig, "tmp", existing=False)
                    trial.two_runs(family, mode)
                    trial.disk_full(family, mode)
            for sig in sigs:
                trial.signal_case("fisher", "bert", "streamed", sig, "stats", existing=False)
            trial.mount_point("llama")
            hostile_cases(trial, quick=False)
            trial.fuzz(30)
        fsync = {} if args.quick else fsync_cost({"llama": models["llama"]}, root, args.fsync_reps)
        if args.fsync_large:
            fsync.update(fsync_cost(write_models(root / "inputs", ("large",)), root, max(args.fsync_reps // 2, 2)))
        summary = summarise(trial.cases)
        print("\n" + "  ".join(f"{k} {v}" for k, v in summary.items()))
        import jax

        from rotsym_experiments.results_io import device_result_path, provenance, write_json

        results = {**provenance(), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": jax.devices()[0].device_kind,
                                               "backend": jax.default_backend(), "python": platform.python_version()},
                   "shapes": {k: SHAPES[k] for k in models}, "quick": args.quick, "timeout_s": args.timeout, "wall_s": time.time() - started,
                   "rotsym": " ".join(ROTSYM), "summary": summary, "fsync": fsync, "cases": trial.cases}
        write_json(results, args.out or device_result_path(HERE / "results", "faults"))
        bad = {k: v for k, v in summary.items() if k in ("inputs_changed", "partial_out", "tracebacks", "hangs", "segfaults",
                                                          "leftovers_after_next", "refusals_not_one_line") and v}
        if bad:
            print(f"FAILED: {bad}")
            for c in trial.cases:  # what failed, with the lines before the last (the tail above is cut to a row)
                if any(c.get(k) for k in ("traceback", "hang", "segfault", "leftovers_after_next")) or c.get("one_line") is False \
                        or c.get("out") == "partial" or c.get("inputs_identical") is False:
                    print(f"  {c['case']} ({c['family']} {c['mode']}): rc {c.get('rc')}, stderr:", *c.get("stderr_before_tail", []),
                          c.get("stderr_tail", ""), sep="\n    ")
        return 1 if bad else 0
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
