"""pytest plugin for benchmarks/suite_profile.py: in each process that runs tests, the seconds of
every test and file, and JAX's own compile timings (jax.monitoring events) and compile log
(program names), written as JSON into $SUITE_PROFILE_DIR at exit."""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import re
import sys

import jax
import jax.monitoring

COMPILED = re.compile(r"Finished XLA compilation of (.+?) in ([0-9.e-]+) sec")

events: collections.Counter = collections.Counter()
programs: dict = collections.defaultdict(lambda: [0.0, 0])
tests: collections.Counter = collections.Counter()
events_by_file: dict = collections.defaultdict(collections.Counter)
sites: dict = collections.defaultdict(lambda: [0.0, 0])
running = {"file": None}


def _on_event(event, duration, **_):
    events[event] += duration
    if running["file"]:
        events_by_file[running["file"]][event] += duration


class _CompileLog(logging.Handler):
    def emit(self, record):
        found = COMPILED.search(record.getMessage())
        if found:
            programs[found.group(1)][0] += float(found.group(2))
            programs[found.group(1)][1] += 1
            site = sites[f"{found.group(1)} from {_caller()} in {running['file']}"]
            site[0] += float(found.group(2))
            site[1] += 1


def _caller() -> str:
    # The innermost frame of the project's own code (the library, the tests or the experiments)
    # that led to this compile: where a per-shape program comes from (past precision.exact_jit, the
    # wrapper every library program is called through).
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "site-packages" not in name and not name.endswith("rotsym_jax/precision.py") and ("/rotsym_jax/" in name or "/tests/" in name or "/experiments/" in name):
            return f"{name.split('/')[-2]}/{name.split('/')[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def pytest_configure(config):
    if os.environ.get("SUITE_PROFILE_DIR") is None:
        return
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    jax.config.update("jax_log_compiles", True)
    handler = _CompileLog(logging.DEBUG)
    for name in ("jax._src.dispatch", "jax._src.interpreters.pxla"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # the compile log is counted here, not printed
    atexit.register(_write)


def pytest_runtest_protocol(item, nextitem):
    running["file"] = item.nodeid.split("::")[0]


def pytest_runtest_logreport(report):
    if not hasattr(report, "node"):  # in the process that ran it (xdist's controller sees it again)
        tests[report.nodeid] += report.duration


def pytest_sessionfinish(session):
    # Written here, in the worker, as well as at exit: a worker that ran test_conformance.py wrote
    # nothing at exit (twice, so its 660 tests were missing from the profile), ended past atexit.
    if os.environ.get("SUITE_PROFILE_DIR") is not None:
        _write()


def _write():
    if not tests:
        return
    out = {"tests": dict(tests), "events": dict(events), "programs": {k: v for k, v in programs.items()},
           "events_by_file": {k: dict(v) for k, v in events_by_file.items()},
           "sites": dict(sites)}
    with open(os.path.join(os.environ["SUITE_PROFILE_DIR"], f"{os.getpid()}.json"), "w") as f:
        json.dump(out, f)
