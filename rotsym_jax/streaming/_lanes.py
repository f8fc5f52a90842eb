"""The passes over the chunks: lanes in flight, moving a chunk by its transforms, the residual stream, the writes."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np

from ..engine import driver
from ..engine.distances import sq_dists
from ..engine.groups import act_on_streams, apply_to_leaves
from ..io import hf
from ..memory import release_freed_memory
from ..options import AlignOptions
from ..processes import Team
from ..pytree import unflatten
from ..spec import bind
from ..timings import Clock
from ._source import Layout, Source, chunk_transforms, shape_stand_ins_of


def to_hf_tensor(rule, leaves: Mapping, out_dtype) -> np.ndarray:
    """The HF tensor of `rule` as save_hf writes it, refusing non-finite values as it does."""
    with np.errstate(over="ignore"):
        tensor = np.asarray(rule.to_hf(tuple(np.asarray(leaves[p]) for p in rule.ours)).astype(out_dtype, copy=False), order="C")
    bad = hf.nonfinite_count(tensor)
    if bad:
        raise hf.CheckpointError(f"output tensor {rule.hf!r}: {bad} of {tensor.size} values are not finite as {out_dtype} (NaN, Inf or overflow)")
    return tensor


def ticker(total: int, progress: Callable[[int, int], None] | None) -> Callable[[], None]:
    """The step-done call of a run: after each chunk (and each model of the statistics pass),
    freed memory goes back to the system and `progress(done, total)` is told. `tick.skip(n)`:
    n steps the run will not take (the sweeps a converged alignment did not need) counted done."""
    done = [0]

    def tick(steps: int = 1):
        release_freed_memory()
        done[0] += steps
        if progress is not None:
            progress(done[0], total)

    tick.skip = lambda steps: steps and tick(steps)
    return tick


def skip_ticks(tick, steps: int) -> None:
    """`tick.skip(steps)` where `tick` is a run's `ticker`."""
    getattr(tick, "skip", lambda steps: None)(steps)


def write_tensor(writer, clock, name, rule, leaves: Mapping, out_dtype):
    """`name` written from our `leaves` (host arrays), converted to its HF form and `out_dtype`."""
    with clock.phase("write"):
        writer.write(name, to_hf_tensor(rule, leaves, out_dtype))


class Turn:
    """A device's turn to compute (`run_in_flight`), held by one lane at a time."""

    def __init__(self):
        self._lock = threading.Lock()

    def __enter__(self):
        release_freed_memory()  # what the lane freed while reading goes back before it computes
        self._lock.acquire()

    def __exit__(self, *exc):
        self._lock.release()


def run_in_flight(items: Sequence, work: Callable, clock: Clock, lanes: int) -> list:
    """`work(share, clock, turn)` on `lanes` threads at once, lane l with local device l % D as
    JAX's default (its arrays and programs there), each lane taking the next of `items` (chunks)
    as it finishes one. `turn` (a context manager) is the lane's device: held while it computes,
    by one lane per device at a time, so that the lanes of one device hold one chunk's working set
    between them, while the others read and transfer their next chunk and write their last one.
    A device's second lane starts once its first has done a chunk: the programs compile with one
    chunk in memory. Returns each lane's result; its phases go to `clock`, the seconds they overlap to its
    `overlap`. The order of the chunks does not matter: the solver combines parts by chunk key.
    One lane: `work(items, clock, turn)` here."""
    lanes = min(lanes, len(items))
    if lanes <= 1:
        return [work(list(items), clock, contextlib.nullcontext())]
    devices = jax.local_devices()
    turns, warm = [Turn() for _ in devices], [threading.Event() for _ in devices]
    queue, lock, failed = iter(list(items)), threading.Lock(), threading.Event()
    clocks = [Clock() for _ in range(lanes)]

    def share(lane):
        if lane >= len(devices):
            warm[lane % len(devices)].wait()
        while not failed.is_set():  # a lane that failed stops the others at their next chunk
            with lock:
                item = next(queue, queue)
            if item is queue:
                return
            yield item
            warm[lane % len(devices)].set()

    def run(lane):
        try:
            with jax.default_device(devices[lane % len(devices)]):
                return work(share(lane), clocks[lane], turns[lane % len(devices)])
        except BaseException:
            failed.set()
            raise
        finally:
            warm[lane % len(devices)].set()  # it failed or had one chunk: the others go on (or stop)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(lanes) as pool:
        results = list(pool.map(run, range(lanes)))
    clock.add_overlapped(time.perf_counter() - start, clocks)
    return results


def write_together(team: Team, ck, target: Path, dtypes: Mapping, new_writer: Callable, writing, extra_files, start: float) -> tuple[Path, dict]:
    """The output folder written by every process of `team`, each its own tensors: process 0
    makes the files (`new_writer(tmp, True)`: every header and the index) in `hf.write_folder`'s
    temporary folder, the others then open them (`new_writer(tmp, False)`); each runs
    `writing.write_mine(writer)`, whose results (one per process) `writing.summary` turns into the
    report on process 0, which then writes `extra_files` and publishes. `writing.again(results)`,
    called in every process on the same results: True writes every tensor once more (into the same
    files, before anything is published; the fallback to B as given). Returns the folder and
    process 0's report, in every process. One process: `hf.write_folder` with `write_mine` and
    `summary`."""
    report = {}

    def written(tmp, first: Callable) -> list:
        every = team.exchange(lambda: writing.write_mine(first()))
        while writing.again(every):
            every = team.exchange(lambda: writing.write_mine(new_writer(tmp, False)))
        return every

    def write_weights(tmp):
        writer = []
        team.exchange(lambda: writer.append(new_writer(tmp, True)) or str(tmp))
        report.update(writing.summary(written(tmp, lambda: writer[0])))

    if team.lead:
        files = (lambda: extra_files(report)) if callable(extra_files) else extra_files
        path = hf.write_folder(ck, target, dtypes, write_weights, files)
        report["timings"]["total"] = time.perf_counter() - start
        team.exchange(lambda: (str(path), report))
        return path, report
    tmp = Path(team.exchange(lambda: None)[0])
    written(tmp, lambda: new_writer(tmp, False))
    published, report = team.exchange(lambda: None)[0]
    return Path(published), report


# ---- pass 1: the alignment statistics ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Passes:
    """How a run goes over its chunks: its `clock`, its progress `tick` (once per chunk of each
    pass), its processes (`team`) and its chunks at once in each (`lanes`, `run_in_flight`)."""

    clock: Clock
    tick: Callable[[], None]
    team: Team
    lanes: int = 1


def solve_transforms(layout: Layout, anchor: Source, others: Sequence[Source], chunks, options: AlignOptions, passes: Passes, *,
                     prepare: Callable | None = None) -> list[dict]:
    """Each of `others` aligned to `anchor`: its transforms over all layers (`driver.Solve`, as
    `align` runs it, fed a chunk at a time), and the squared distance of every body leaf before
    alignment. With several processes, each reads and reduces its share of the chunks, and every
    process then solves every group from all the processes' parts (the same transforms in each);
    `lanes` chunks at a time (`run_in_flight`). `prepare(chunk, flat_a, flat_b, clock)`: the leaves
    to solve on and the squared distances to return in place of B's as read and their distances
    (the residual descent's: B moved by its T, and the previous sweep measured). `anchor`: any
    source (`align_many`'s updates: `LeaveOneOut`, the mean of the other models as aligned)."""
    clock, tick, team, lanes = passes.clock, passes.tick, passes.team, passes.lanes

    def solve_share(share, clock, turn):
        runs = [driver.Solve(layout.bound, options, clock, blocking=True) for _ in others]
        sq_before = [{} for _ in others]
        for key, chunk in share:
            names = [name for layer in chunk for name in layout.layer_rules[layer]]
            flat_a = anchor.leaves(names, clock)
            local_a = layout.rename(chunk, flat_a)
            bound = layout.local_bound(chunk, others[0].shapes)  # every model has the same shapes
            for other, run, sq in zip(others, runs, sq_before):
                flat_b = other.leaves(names, clock)
                with turn:
                    if prepare is None:
                        sq.update(sq_of(clock, flat_a, flat_b, list(flat_a)))
                    else:
                        flat_b, measured = prepare(chunk, flat_a, flat_b, clock)
                        sq.update(measured)
                    run.add(bound, local_a, layout.rename(chunk, flat_b), key=key)
                del flat_b
            del flat_a, local_a
            tick()
        return runs, sq_before

    def pass_1():
        """This process's distances, and its runs if they are the only ones (one lane, one
        process: `whole`), else their parts on the host, to be gathered."""
        shares = run_in_flight(team.share(list(enumerate(chunks))), solve_share, clock, lanes)
        sq_before = [{p: v for _, sq in shares for p, v in sq[j].items()} for j in range(len(others))]
        whole = len(shares) == 1 and team.count == 1
        if whole:
            return shares[0][0], sq_before, whole
        return [[runs[j].export() for runs, _ in shares] for j in range(len(others))], sq_before, whole  # per model, per lane

    every = team.exchange(pass_1)
    if every[0][2]:  # the runs as they are
        runs, sq_before, _ = every[0]
    else:
        runs = [driver.Solve(layout.bound, options, clock, blocking=True) for _ in others]
        for j, run in enumerate(runs):
            run.adopt([exported for parts, _, _ in every for exported in parts[j]])
        sq_before = [{p: v for _, sq, _ in every for p, v in sq[j].items()} for j in range(len(others))]
    return [{"transforms": run.finish(), "sq_before": sq} for run, sq in zip(runs, sq_before)]


def moved_chunk(layout: Layout, chunk, flat: dict, transforms: dict, clock) -> dict:
    """`flat` (a chunk's leaves) with its members moved by the chunk's slice of `transforms`, then
    every leaf on a residual stream by its transform, where `transforms` has one (as `align`
    applies them: the groups, then the streams, other axes of the same leaves)."""
    streams = {s.name for s in layout.bound.streams}
    groups = {name: t for name, t in transforms.items() if name not in streams}
    shapes = {p: np.shape(x) for p, x in flat.items()}
    bound = layout.local_bound(chunk, shapes)
    moved = clock.timed("apply", apply_to_leaves, bound, layout.rename(chunk, flat), chunk_transforms(layout, groups, chunk))
    moved = {**flat, **layout.restore(chunk, moved)}
    return on_streams(layout.bound.streams, moved, transforms, clock)


def gathered(team: Team, chunks, clock, lanes: int, tick, read: Callable, compute: Callable) -> dict:
    """{path: value} of `compute(chunk, read(chunk, clock), clock)` over this process's `chunks`,
    each read before its device's turn and computed in it (`run_in_flight`), gathered from every
    lane and process."""
    def work(share, clock, turn):
        out = {}
        for chunk in share:
            inputs = read(chunk, clock)
            with turn:
                out.update(compute(chunk, inputs, clock))
            del inputs
            tick()
        return out

    mine = {p: v for part in run_in_flight(chunks, work, clock, lanes) for p, v in part.items()}
    return {p: v for part in team.exchange(lambda: mine) for p, v in part.items()}


# ---- the residual stream, streamed -------------------------------------------------------------------

def full_streams(layout: Layout, source: Source) -> tuple:
    """The residual streams of `source` with its task head: `align` moves a head that reads a
    stream (a sequence classifier's score) by T too, though it solves without it."""
    return bind(layout.bound.spec, unflatten(shape_stand_ins_of(source.shapes))).streams


def moved_rows(rule, streams, transforms, block: np.ndarray, clock) -> np.ndarray:
    """Rows of an HF tensor outside the layers holding one leaf, moved by the streams' elements in
    `transforms` along the leaf's stream axes (through the leaf's layout: the rows of an LM head
    are columns of our kernel)."""
    (path,) = rule.ours
    if not any(p == path for s in streams if s.name in transforms for p, _ in s.axes):
        return block
    (leaf,) = rule.to_ours(block)
    moved = on_streams(streams, {path: leaf}, transforms, clock)[path]
    return np.asarray(rule.to_hf((np.asarray(moved),)), order="C")


def on_streams(streams, flat: Mapping, transforms: Mapping, clock) -> dict:
    """`flat` with each of its leaves on a residual stream moved by that stream's element in
    `transforms` (streams it lacks stay), as `align` moves them (`engine.groups.act_on_streams`),
    awaited in the "apply" phase."""
    if not any(s.name in transforms for s in streams):
        return dict(flat)
    with clock.phase("apply"):
        return jax.block_until_ready(act_on_streams(streams, flat, transforms))


class OrderedSum:
    """The sum of values added by key in any order (lanes finish chunks in any order), always
    taken in the order of `keys`: c_0 + c_1 + ... in float32, so the same bits whatever the lanes.
    `eager`: add as the keys come (the run's first keys); else hold every value until `total`
    gives the sum of the keys before these (another process's, `Team.in_order`)."""

    def __init__(self, keys: Sequence, eager: bool):
        self._keys, self._eager = list(keys), eager
        self._next, self._pending, self._total = 0, {}, None
        self._lock = threading.Lock()

    def add(self, key, value) -> None:
        with self._lock:
            self._pending[key] = value
            if self._eager:
                self._advance()

    def _advance(self) -> None:
        while self._next < len(self._keys) and self._keys[self._next] in self._pending:
            value = self._pending.pop(self._keys[self._next])
            self._total = value if self._total is None else jax.tree.map(np.add, self._total, value)
            self._next += 1

    def total(self, before=None):
        """`before` (None: nothing) plus every value, in key order."""
        with self._lock:
            if before is not None:
                if self._next:
                    raise AssertionError("an eager sum starts the run's order: nothing comes before it")
                self._total = before
            self._advance()
            missing = self._keys[self._next:]
            if missing:
                raise AssertionError(f"no value for keys {missing[:4]}")
            return self._total


def sq_of(clock, flat_a, flat_b, paths) -> dict:
    """{path: squared distance} of `paths`, by `align`'s jitted `sq_dists` (one leaf's sum does
    not depend on which other leaves share the call)."""
    with clock.phase("distances"):
        return jax.device_get(sq_dists({p: flat_a[p] for p in paths}, {p: flat_b[p] for p in paths}))


def blocked_globals(layout, sources, block_bytes, blockable: Callable[[str], bool]) -> list[str]:
    """The tensors outside the layers that go in row blocks: bigger than `block_bytes` in float32,
    one leaf each, stored in a dtype JAX holds, in every model, on one residual stream at most (a
    block along one stream may cut another's axis), and `blockable(name)` (the method's
    arithmetic on that tensor is entry by entry)."""
    anchor = sources[0]
    blocked = []
    streams_of: dict = {}
    for stream in layout.bound.streams:
        for path in {p for p, _ in stream.axes}:
            streams_of[path] = streams_of.get(path, 0) + 1
    for name in layout.global_rules:
        if not all(name in s.rules for s in sources):  # a head or LM head one model lacks: whole, as set aside
            continue
        rule = anchor.rules[name]
        shape = anchor.hf_shape(name)
        canonical = all(np.dtype(jax.dtypes.canonicalize_dtype(s.stored(name))) == s.stored(name) for s in sources)
        big = math.prod(shape) * 4 > block_bytes and len(shape) > 0
        if big and blockable(name) and len(rule.ours) == 1 and canonical and streams_of.get(rule.ours[0], 0) <= 1:
            blocked.append(name)
    return blocked
