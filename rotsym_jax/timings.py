"""The timings every report gives, in one place: `Timings` names the phases (the same keys on
every path: `align`, the streamed runs, the pipelines), `Clock` adds up their seconds."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TypedDict

import jax


class Timings(TypedDict):
    """The timings of every path's report, in seconds (a phase a path does not have is 0.0)."""

    read: float  # reading tensors from disk and checking them finite (streaming; in memory the params are given)
    transfer: float  # copies between host and device and the casts on the way (streaming)
    solve: float  # the engine: from the first dispatch of the groups' statistics until every element is ready
    #               (streaming: summed over the chunks, their reads excluded); it contains the next two
    assignment: float  # the groups reduced on the host (the FFN's assignments); in memory from the dispatch of
    #                    their cost matrices until the last is assigned, while the device works on
    attention: float  # the groups solved on the device (attention blocks): in memory from the dispatch of their
    #                   statistics and solves until they are ready (on one device, after the cost matrices
    #                   dispatched before them); streaming, their statistics and the batched solve
    distances: float  # measuring the distances to the anchor before and after
    apply: float  # moving the weights by the transforms
    statistics: float  # the data pass of the statistics merges (Fisher, Gram matrices)
    merge: float  # the merge arithmetic
    write: float  # writing the output
    compile: float  # JAX tracing, lowering and compiling programs (or reading them from the persistent cache),
    #                 taken out of the phase that asked for them (`Clock.phase`); outside every phase, not counted
    compiled: float  # a count, not seconds: the programs XLA compiled for the call (not those the persistent cache
    #                  served), counted as `compile` is; 0 when everything it runs was compiled before
    overlap: float  # streaming, chunks in flight at once (`StreamPlan.in_flight`: devices, or reads and solves
    #                 overlapped on one): their phases add up each chunk's seconds, so they run past the wall
    #                 time by this much (the phases minus `overlap` add up to the wall time of those sections)
    total: float  # the whole call


TIMINGS = tuple(Timings.__annotations__)
# The phases that never hold one another (solve holds assignment and attention): with `overlap`
# taken off, they add up to the wall time less what no phase holds.
DISJOINT = ("read", "transfer", "solve", "distances", "apply", "statistics", "merge", "write", "compile")

# What JAX reports of the work before a program first runs (`jax.monitoring` time spans).
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
BACKEND_COMPILE = COMPILE_EVENTS[2]
_open = threading.local()  # .phases: this thread's open phases, [(clock, phase, wall-clock start)], innermost last


class Clock(dict):
    """Seconds per phase of `TIMINGS` (every key but `total`, which `report(start)` adds)."""

    def __init__(self):
        super().__init__({key: 0.0 for key in TIMINGS if key != "total"})
        self._compiles: list[tuple[float, float, float]] = []  # (start, end, seconds not in a span inside it)

    def timed(self, what: str, fn, /, *args, **kwargs):
        """`fn(*args, **kwargs)`, its device arrays awaited, its seconds added to `what`."""
        with self.phase(what):
            return jax.block_until_ready(fn(*args, **kwargs))

    def add_overlapped(self, wall: float, clocks) -> None:
        """The phases of `clocks`, which ran at the same time for `wall` seconds, added, and the
        seconds they ran past `wall` to `overlap` (none when they ran for less: waits between
        phases stay unexplained, as everywhere)."""
        busy = 0.0
        for clock in clocks:
            for phase, seconds in clock.items():
                self[phase] += seconds
                busy += seconds if phase in DISJOINT else 0.0
        self["overlap"] += max(0.0, busy - wall)  # lanes that waited more than they overlapped leave seconds in no phase

    @contextlib.contextmanager
    def phase(self, what: str):
        """The block's seconds added to `what` (host work: nothing is awaited), but those JAX spends
        compiling, which go to `compile`: counted by the innermost clock with a phase open in the
        thread, and taken out of each of its phases open since before the compilation began."""
        stack = _open.__dict__.setdefault("phases", [])
        stack.append((self, what, time.time()))
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self[what] += time.perf_counter() - t0
            stack.pop()

    def _compiled(self, start: float, end: float, open_phases) -> None:
        # A jit traced inside another's trace reports its span first: count those seconds once.
        inside = [span for span in self._compiles if start <= span[0] and span[1] <= end]
        seconds = max(0.0, end - start - sum(own for _, _, own in inside))
        self._compiles = [span for span in self._compiles if span not in inside] + [(start, end, seconds)]
        self["compile"] += seconds
        for what, since in open_phases:
            if since <= start:
                self[what] -= seconds

    def report(self, start: float) -> Timings:
        """The timings as a report gives them, with `total` since `start` (a phase that was all
        compilation reads 0, not the microseconds its two clocks disagree by)."""
        return {**{k: max(0.0, v) for k, v in self.items()}, "total": time.perf_counter() - start}


def _on_time_span(event: str, start: float, end: float, **_) -> None:
    phases = getattr(_open, "phases", None)
    if event in COMPILE_EVENTS and phases:
        clock = phases[-1][0]
        clock._compiled(start, end, [(what, since) for c, what, since in phases if c is clock])
        clock["compiled"] += event == BACKEND_COMPILE


jax.monitoring.register_event_time_span_listener(_on_time_span)
