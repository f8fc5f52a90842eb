"""The timings every report gives, in one place: `Timings` names the phases (the same keys on
every path: `align`, the streamed runs, the pipelines), `Clock` adds up their seconds."""

from __future__ import annotations

import contextlib
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
    total: float  # the whole call


TIMINGS = tuple(Timings.__annotations__)


class Clock(dict):
    """Seconds per phase of `TIMINGS` (every key but `total`, which `report(start)` adds)."""

    def __init__(self):
        super().__init__({key: 0.0 for key in TIMINGS if key != "total"})

    def timed(self, what: str, fn, /, *args, **kwargs):
        """`fn(*args, **kwargs)`, its device arrays awaited, its seconds added to `what`."""
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        self[what] += time.perf_counter() - t0
        return out

    @contextlib.contextmanager
    def phase(self, what: str):
        """The block's seconds added to `what` (host work: nothing is awaited)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self[what] += time.perf_counter() - t0

    def report(self, start: float) -> Timings:
        """The timings as a report gives them, with `total` since `start`."""
        return {**self, "total": time.perf_counter() - start}
