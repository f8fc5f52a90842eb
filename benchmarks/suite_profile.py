"""Where the default test run's seconds go: `make test`'s pytest command (two workers, a test file
per worker, the slow tests left out), with a plugin (suite_profile_plugin.py) that records every
test's seconds and JAX's own compile timings and compile log in each worker.

Prints the wall time, the workers' seconds split into XLA compiling, lowering to MLIR, tracing and
the rest, the files and tests that take longest and the programs compiled most, and writes
benchmarks/results/suite_profile.json (suite_profile-<device>.json on an accelerator).

    PYTHONPATH=.:experiments python benchmarks/suite_profile.py [--workers 2] [--marks slow] [pytest arguments]

The plugin costs time of its own (the compile log at debug level, a stack walk per compile): its
walls compare with each other, not with a plain run's (idle at 8ce9e5f: 12:56 profiled, 8:56 by
`make test` from a clean clone).

With $ROTSYM_TEST_XLA_CACHE set to a folder, the run shares compiled programs with the runs before
it that were given the same folder (as .ci/run's default and slow runs do).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from rotsym_experiments.results_io import device_result_path, provenance, write_json

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EVENTS = {"xla_compile": "/jax/core/compile/backend_compile_duration", "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "trace": "/jax/core/compile/jaxpr_trace_duration", "cache_saved": "/jax/compilation_cache/compile_time_saved_sec"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2")
    parser.add_argument("--marks", default="not slow", help="the tests to run (pytest -m): 'slow' profiles `make test-slow`")
    parser.add_argument("--out", type=Path, default=None)
    args, pytest_args = parser.parse_known_args(argv)
    shared = os.environ.get("ROTSYM_TEST_XLA_CACHE", "")
    shared = "" if shared.lower() == "off" else shared
    cached = len(list(Path(shared).glob("*"))) if shared and Path(shared).is_dir() else 0
    with tempfile.TemporaryDirectory(prefix="suite-profile-") as folder:
        env = {**os.environ, "SUITE_PROFILE_DIR": folder,
               "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
        command = [sys.executable, "-m", "pytest", "-q", "-n", args.workers, "--dist", "loadfile", "--max-worker-restart=0",
                   "-m", args.marks, "-p", "suite_profile_plugin", "-p", "no:cacheprovider", "-rf", *pytest_args]
        start = time.perf_counter()
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        print("\n".join(line for line in run.stdout.splitlines() if line.startswith("FAILED ")))
        print(run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:])
        parts = [json.loads(p.read_text()) for p in Path(folder).glob("*.json")]
    tests, files, events = collections.Counter(), collections.Counter(), collections.Counter()
    events_by_file: dict = collections.defaultdict(collections.Counter)
    programs: dict = collections.defaultdict(lambda: [0.0, 0])
    sites: dict = collections.defaultdict(lambda: [0.0, 0])
    for part in parts:
        tests.update(part["tests"])
        events.update(part["events"])
        for name, counts in part.get("events_by_file", {}).items():
            events_by_file[name].update(counts)
        for name, (seconds, count) in part["programs"].items():
            programs[name][0] += seconds
            programs[name][1] += count
        for name, (seconds, count) in part.get("sites", {}).items():
            sites[name][0] += seconds
            sites[name][1] += count
    for nodeid, seconds in tests.items():
        files[nodeid.split("::")[0]] += seconds
    worker_seconds = sum(tests.values())
    split = {key: events[name] for key, name in EVENTS.items()}
    results = {
        **provenance(),
        "machine": {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "cpus": os.cpu_count()},
        "pytest": command[2:], "returncode": run.returncode,
        "xla_cache": f"$ROTSYM_TEST_XLA_CACHE, {cached} programs in it at the start" if shared else "none (tests/conftest.py)",
        "summary": run.stdout.strip().splitlines()[-1:],
        "failed": [line for line in run.stdout.splitlines() if line.startswith("FAILED ")],
        "wall_seconds": wall, "tests": len(tests), "worker_seconds": worker_seconds,
        "split": {**split, "rest": worker_seconds - split["xla_compile"] - split["lower"] - split["trace"]},
        "programs_compiled": sum(c for _, c in programs.values()),
        # per file, the seconds outside JAX's compiling ("rest"): running, PyTorch, subprocesses, Python
        "files": [{"file": f, "seconds": s, **{key: events_by_file[f][EVENTS[key]] for key in ("xla_compile", "lower", "trace")},
                   "rest": s - sum(events_by_file[f][EVENTS[key]] for key in ("xla_compile", "lower", "trace"))}
                  for f, s in files.most_common()],
        "slowest_tests": [{"test": t, "seconds": s} for t, s in tests.most_common(30)],
        "programs": [{"program": p, "xla_compile": s, "compiles": c} for p, (s, c) in sorted(programs.items(), key=lambda kv: -kv[1][0])[:40]],
        # Where the programs come from: the innermost frame of the project's code and the test file.
        "sites": [{"site": p, "xla_compile": s, "compiles": c} for p, (s, c) in sorted(sites.items(), key=lambda kv: -kv[1][0])[:400]],
    }
    print(f"wall {wall:.0f} s; {len(tests)} tests, {worker_seconds:.0f} worker-seconds: XLA compile {split['xla_compile']:.0f}, "
          f"lowering {split['lower']:.0f}, tracing {split['trace']:.0f}, the rest {results['split']['rest']:.0f}; "
          f"{results['programs_compiled']} programs compiled")
    for row in results["files"][:12]:
        print(f"  {row['file']:<40} {row['seconds']:7.1f} s   XLA compile {row['xla_compile']:6.1f} s, the rest {row['rest']:6.1f} s")
    for row in results["programs"][:12]:
        print(f"  {row['program']:<40} {row['xla_compile']:7.1f} s in {row['compiles']} compiles")
    name = "suite_profile" if args.marks == "not slow" else "suite_profile_" + args.marks.replace(" ", "_")
    write_json(results, args.out or device_result_path(HERE / "results", name))
    return run.returncode


if __name__ == "__main__":
    raise SystemExit(main())
