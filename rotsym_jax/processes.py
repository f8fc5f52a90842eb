"""Many processes, one alignment: the processes of a JAX multi-process program
(`jax.distributed.initialize`) split a streamed run's chunks of layers between them.

Each process reads, solves and writes only its chunks. What couples layers goes through JAX's
collectives (`multihost_utils.process_allgather`): the solvers' per-chunk parts (every process
then solves every group over all layers from the same inputs, so the result is the one process's,
bit for bit), the residual stream's cross products (summed from process to process in the one
process's order: `in_order`), the distances of the report, and each step's outcome. Every exchange carries either
a process's result or its error, so a process that fails makes every process fail at the same
step, and process 0 publishes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from collections.abc import Callable, Sequence

import jax
import numpy as np

from .errors import RotsymError


class ProcessError(RotsymError, RuntimeError):
    """Another process of the run failed (its error is in the message)."""


def _differences(ours, theirs, where: str = "") -> list[str]:
    """Where `theirs` differs from `ours` (process 0's), down through dicts and dataclasses:
    ["options.heads: 'fixed' (process 0: 'permute')", ...]."""
    ours, theirs = (dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v for v in (ours, theirs))
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [d for key in {**ours, **theirs} if ours.get(key) != theirs.get(key)
                for d in _differences(ours.get(key), theirs.get(key), f"{where}{key}.")]
    return [f"{where[:-1] or 'the value'}: {theirs!r} (process 0: {ours!r})"]


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> None:
    """`jax.distributed.initialize` with CPU collectives on (gloo: CPU processes exchange through
    them too). All None: the cluster is detected as JAX detects it (SLURM, Open MPI, TPU pods...)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


@dataclasses.dataclass(frozen=True)
class Team:
    """This process's place among the run's processes (`index` of `count`)."""

    index: int = 0
    count: int = 1

    @classmethod
    def current(cls) -> Team:
        return cls(jax.process_index(), jax.process_count())

    @property
    def lead(self) -> bool:
        """Process 0: it writes what exists once (headers, index, report, card) and publishes."""
        return self.index == 0

    def share(self, items: Sequence) -> list:
        """This process's contiguous share of `items` (chunks of layers), the first shares one
        longer when they do not divide evenly; every item in exactly one share."""
        bounds = np.linspace(0, len(items), self.count + 1).round().astype(int)
        return list(items[bounds[self.index]:bounds[self.index + 1]])

    def exchange(self, work: Callable[[], object]) -> list:
        """`work()` here, then every process's result, in process order. If the work of any
        process raised, every process raises at this exchange: this one its own error, the
        others a ProcessError naming the first process that failed and its error."""
        try:
            outcome = ("ok", work())
        except Exception as e:  # noqa: BLE001 (re-raised below, after the others have been told)
            if self.count == 1:
                raise
            error = e
            outcome = ("error", f"{type(e).__name__}: {e}")
        else:
            error = None
        if self.count == 1:
            return [outcome[1]]
        outcomes = self._allgather(outcome)
        if error is not None:
            error.told_processes = True
            raise error
        failed = [(i, text) for i, (status, text) in enumerate(outcomes) if status == "error"]
        if failed:
            i, text = failed[0]
            error = ProcessError(f"process {i} of {self.count} failed: {text}")
            error.told_processes = True
            raise error
        return [result for _, result in outcomes]

    def in_order(self, step: Callable[[object], object]):
        """`step(previous)` in each process in turn, process 0 first with None, each later one
        with the result of the one before: the last result, in every process. A sum that must
        run in one order across processes (the residual stream's cross products) runs so."""
        value = None
        for turn in range(self.count):
            value = self.exchange(lambda turn=turn, value=value: step(value) if turn == self.index else None)[turn]
        return value

    @contextlib.contextmanager
    def together(self):
        """A run's steps between exchanges: an error raised here that the others have not been
        told of (outside any `exchange`) is sent to the exchange they wait in, then raised."""
        try:
            yield
        except Exception as e:
            if self.count > 1 and not getattr(e, "told_processes", False):
                e.told_processes = True
                self._allgather(("error", f"{type(e).__name__}: {e}"))
            raise

    def agree(self, what: str, value) -> None:
        """Every process must run the same `value` (options, inputs, plan: anything picklable that
        compares equal); ProcessError naming the processes that differ from process 0's, in every
        process, before any of them works on a different run."""
        values = self.exchange(lambda: value)
        differ = [i for i, v in enumerate(values) if v != values[0]]
        if differ:
            error = ProcessError(f"the processes were given different {what}: process {differ[0]} has "
                                 f"{'; '.join(_differences(values[0], values[differ[0]]))}; every process must run the same command")
            error.told_processes = True  # every process raises it at this exchange
            raise error

    def _allgather(self, value) -> list:
        """Every process's picklable `value`, through a JAX collective (uint8 arrays)."""
        from jax.experimental import multihost_utils

        data = np.frombuffer(pickle.dumps(value), np.uint8)
        sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32)))
        padded = np.zeros(int(sizes.max()), np.uint8)
        padded[:data.size] = data
        gathered = np.asarray(multihost_utils.process_allgather(padded))
        return [pickle.loads(gathered[i, :int(sizes[i, 0])].tobytes()) for i in range(self.count)]
