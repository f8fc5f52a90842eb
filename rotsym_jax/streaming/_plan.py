"""The plan of a streamed run: the chunk size and lanes whose estimated peak fits the memory bound (the memory
model of a chunk, in bytes: `io.memory`)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from ..io import hf
from ..io.memory import F32_COPIES_ALIGN, F32_COPIES_MERGE, HOST_COST_COPY, STORED_COPIES, cost_matrix_bytes, in_memory_bytes, runtime_bytes, size_text, staging_bytes
from ..options import DEFAULT_BLOCK_BYTES, ManyOptions, StreamOptions
from ._common import BudgetError
from ._source import Layout, Source

# ---- plans -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """What a streaming run will do and need: `chunk_layers` layers per step over `layers`
    layers, `passes` passes over them (2 with alignment, 1 without), a peak resident memory of
    about `peak_bytes` (`in_memory_bytes`: the in-memory path's estimate, for comparison),
    `output_bytes` written; big leaves outside the layers go in row blocks of `block_bytes`.
    `statistics_bytes`: fisher / regmean only (else 0), the peak of the statistics pass, which
    holds one model at a time whole (with its aligned copy, its statistics and the working set of
    a forward/backward pass on one batch); `peak_bytes` is the larger of it and the chunks' peak.
    `scratch_bytes`: the statistics spilled to disk beside the output during the run.
    `in_flight`: chunks worked on at once (`run_in_flight`): one per local device, and at least two
    where the memory allows; the lanes of one device take turns to compute, so that one chunk's
    reads, transfers and writes overlap another's device work. The peak counts a chunk's working
    set per device and what each other lane holds while it waits (its chunk as read, or its
    results as written). `passes_per_sweep`, `max_sweeps`: an alignment that sweeps (the residual
    descent, each aligned model's; `align_many`) reads the weights `passes_per_sweep` more times a
    sweep, for at most `max_sweeps` sweeps, besides its `passes` (`with_sweeps`)."""

    chunk_layers: int
    layers: int
    passes: int
    peak_bytes: int
    in_memory_bytes: int
    output_bytes: int
    block_bytes: int
    statistics_bytes: int = 0
    scratch_bytes: int = 0
    in_flight: int = 1
    passes_per_sweep: int = 0
    max_sweeps: int = 0

    def describe(self) -> str:
        gib = lambda n: f"{n / 2**30:.2f} GiB"
        at_once = ("one chunk at a time" if self.in_flight == 1 else
                   f"{self.in_flight} chunks at a time per process (one per device, at least two: one computes while another reads or writes)")
        text = (f"streaming: {self.layers} layers, {self.chunk_layers} per chunk, {at_once}, "
                f"{self.passes} pass{'es' * (self.passes != 1)} over the weights"
                + (f", then {self.passes_per_sweep} more per sweep of the alignment (at most {self.max_sweeps} sweeps)" if self.passes_per_sweep else "") + "; "
                f"peak memory about {gib(self.peak_bytes)} (in memory: {gib(self.in_memory_bytes)}), output {gib(self.output_bytes)}")
        if self.statistics_bytes:
            text += (f"; a statistics pass over the data holds one model at a time, whole, with its statistics and the "
                     f"forward/backward working set of one batch: about {gib(self.statistics_bytes)} (estimated), "
                     f"its statistics spilled to disk beside the output: {gib(self.scratch_bytes)}")
        return text


def with_sweeps(plan: StreamPlan, *, align: str = "anchor", residual: str = "none", residual_sweeps: int = 8, models: int = 2) -> StreamPlan:
    """`plan` with the passes of an alignment that sweeps: each aligned model's residual descent
    reads the weights once for its first T and 3 times a sweep (`ResidualDescent`); `align_many`
    4 times before its sweeps (the order, the objective, the medoid's alignment, the objective)
    and twice a model a sweep (`AlignMany`), each alignment a descent with the residual stream."""
    if align == "many" and residual != "none":  # each alignment a descent: its first T, then 3 passes a sweep
        descent = 1 + 3 * residual_sweeps
        return dataclasses.replace(plan, passes=plan.passes + 2 + (models - 1) * descent, passes_per_sweep=models * (descent + 1),
                                   max_sweeps=ManyOptions().max_iters)
    if align == "many":
        return dataclasses.replace(plan, passes=plan.passes + 3, passes_per_sweep=2 * models, max_sweeps=ManyOptions().max_iters)
    if align == "anchor" and residual != "none":
        return dataclasses.replace(plan, passes=models, passes_per_sweep=3 * (models - 1), max_sweeps=residual_sweeps)
    return plan


def moved_model_count(align: str, models: int) -> int:
    """How many of `models` an alignment mode moves: none, every one but the anchor, all."""
    return {"none": 0, "anchor": models - 1, "many": models}[align]


def layer_bytes(source: Source, layout: Layout) -> tuple[list[int], list[int], list[int]]:
    """Per layer: bytes held (as read: stored, or in the dtype the source casts to), entries, and
    the bytes of its biggest tensor."""
    stored, entries, biggest = [], [], []
    for layer in layout.layers:
        n = [math.prod(source.hf_shape(name)) for name in layout.layer_rules[layer]]
        sizes = [k * source.held(name).itemsize for k, name in zip(n, layout.layer_rules[layer])]
        entries.append(sum(n))
        stored.append(sum(sizes))
        biggest.append(max(sizes, default=0))
    return stored, entries, biggest


def chunk_cost_bytes(layout: Layout) -> int:
    """One layer's permutation cost matrices (float32), and the host's float64 copy in SciPy."""
    return int(cost_matrix_bytes(layout.bound, per_layer=True) * (1 + HOST_COST_COPY))


@dataclasses.dataclass(frozen=True)
class Work:
    """What a streamed run does with each chunk, as its plan counts it. aligned: alignment reads
    the models (pass 1); merging: pass 2 merges every model (else it moves one); elementwise: a
    big leaf outside the layers goes in row blocks; moved: how many models alignment moves
    (None: one if `aligned`); residual: the alignment's residual mode (its descent holds (d, d)
    cross products, `ResidualDescent`); out_dtype: the dtype written (None: as stored);
    statistics_per_layer, statistics_global: the bytes of fisher's / regmean's statistics read
    from the spill per layer and outside the layers; max_in_flight: the most chunks at once."""

    aligned: bool
    merging: bool
    elementwise: bool
    moved: int | None = None
    residual: str = "none"
    out_dtype: object = None
    statistics_per_layer: tuple | None = None
    statistics_global: int = 0
    max_in_flight: int | None = None


def plan_stream(sources: Sequence[Source], layout: Layout, stream: StreamOptions, work: Work, *, output: Source | None = None,
                processes: int = 1) -> StreamPlan:
    """The chunk size, chunks in flight and peak memory of a run doing `work`. `output`: the
    source whose layout is written and whose tensors `layout` lists (default the anchor,
    `sources[0]`). `processes`: how many processes split the chunks; each works on
    `StreamPlan.in_flight` of its share at once (at most `work.max_in_flight`), over its local
    devices."""
    aligned, merging, elementwise, residual, out_dtype = work.aligned, work.merging, work.elementwise, work.residual, work.out_dtype
    statistics_per_layer, statistics_global, max_in_flight = work.statistics_per_layer, work.statistics_global, work.max_in_flight
    max_memory, chunk_layers, block_bytes = stream.max_memory, stream.chunk_layers, stream.block_bytes
    moved = (1 if aligned else 0) if work.moved is None else work.moved
    output = sources[0] if output is None else output
    stored, entries, biggest_in_layer = layer_bytes(output, layout)
    n = len(sources)
    per_layer_align = [STORED_COPIES * 2 * s + F32_COPIES_ALIGN * 4 * e + chunk_cost_bytes(layout) for s, e in zip(stored, entries)]
    per_layer_merge = [STORED_COPIES * n * s + 4 * e * (F32_COPIES_MERGE * n + 1) for s, e in zip(stored, entries)]
    if statistics_per_layer is not None:  # fisher / regmean: every model's statistics of the layer, read from the spill
        per_layer_merge = [y + z for y, z in zip(per_layer_merge, statistics_per_layer)]
    per_layer = [max(x if aligned else 0, y if merging else 0, x if not merging else 0) for x, y in zip(per_layer_align, per_layer_merge)]
    # A lane waiting for its device's turn (`run_in_flight`) holds the layer as read (every model it
    # reads, as stored; one tensor at a time also as read and transposed), or, written after its
    # turn, the results (float32) and one tensor converted.
    waiting_per_layer = [max((n if merging else 2) * s + 2 * t, 4 * e + t) for s, e, t in zip(stored, entries, biggest_in_layer)]
    per_layer_max = max(per_layer) if per_layer else 0
    global_sizes = [math.prod(output.hf_shape(name)) for name in layout.global_rules]
    biggest = max(global_sizes, default=0)
    if block_bytes is None:
        block_bytes = DEFAULT_BLOCK_BYTES
    # Outside the layers: a leaf whole unless it is blocked; all small ones together.
    put_whole = [not (elementwise and k * 4 > block_bytes) for k in global_sizes]
    whole = [k for k, w in zip(global_sizes, put_whole) if w]
    blocked = block_bytes * (n + 2) if elementwise and biggest * 4 > block_bytes else 0
    global_peak = max(blocked, (STORED_COPIES * n * 2 + 4 * (F32_COPIES_MERGE * n + 1)) * max(whole, default=0))
    global_peak += statistics_global  # fisher / regmean: the statistics of the leaves outside the layers
    # the biggest transfer to the device: a layer's tensor, a leaf outside the layers put whole, or a row block
    stored_outside = [math.prod(output.hf_shape(nm)) * output.stored(nm).itemsize for nm in layout.global_rules]
    transferred = max([*biggest_in_layer, *(b for b, w in zip(stored_outside, put_whole) if w), block_bytes if blocked else 0], default=0)
    total_stored = sum(math.prod(output.hf_shape(key)) * (np.dtype(out_dtype).itemsize if out_dtype else output.stored(key).itemsize)
                       for key in output.rules)
    model_bytes = sum(stored) + sum(stored_outside)
    held = [sum(math.prod(s.hf_shape(key)) * s.held(key).itemsize for key in s.rules) for s in sources]
    in_memory = in_memory_bytes(held, moved=[model_bytes] * moved, cost_bytes=cost_matrix_bytes(layout.bound) if moved else 0,
                                merged_bytes=4 * (sum(entries) + sum(global_sizes)) if merging else 0)

    devices = len(jax.local_devices())

    # the residual descent's (d, d) float32 cross products of each stream (two for a signed permutation): the
    # running sum and the lanes' layers not yet added; a later process holds its share's until its turn
    cross = 0 if residual == "none" else (2 if residual == "signed_permutation" else 1) * 4 * sum(s.size ** 2 for s in layout.bound.streams)

    def peak(k, lanes):
        in_flight = min(lanes, max(1, math.ceil(len(per_layer) / k)))
        turns = min(in_flight, devices)  # one chunk computing per device, the others hold theirs as read or written
        chunk = max(sum(per_layer[i:i + k]) for i in range(0, max(1, len(per_layer)), k))
        waiting = max(sum(waiting_per_layer[i:i + k]) for i in range(0, max(1, len(per_layer)), k))
        crosses = cross * (1 + k * in_flight + (math.ceil(len(per_layer) / processes) if processes > 1 else 0))
        return int(runtime_bytes() + staging_bytes(transferred, in_flight) + max(global_peak, turns * chunk + (in_flight - turns) * waiting + crosses))

    layers = len(layout.layers)
    # chunks in flight: one per device, and two on one device (one computes while the other reads or writes), if they fit
    choices = sorted({min(c, max_in_flight or c) for c in (max(2, devices), devices, 1)}, reverse=True)
    if chunk_layers is not None:
        k = min(chunk_layers, max(layers, 1))
        lanes = next((c for c in choices if max_memory is None or peak(k, c) <= max_memory), 1)
    elif max_memory is None:
        k, lanes = min(4, max(layers, 1)), choices[0]
    else:
        if peak(1, 1) > max_memory:
            raise BudgetError(
                max_memory, peak(1, 1),
                f"what one layer at a time needs, about "
                f"{size_text(peak(1, 1), max_memory)} (the runtime {size_text(runtime_bytes())}, the biggest layer "
                f"{size_text(per_layer_max)}, the biggest leaf outside the layers {size_text(global_peak)})"
            )
        lanes = next(c for c in choices if peak(1, c) <= max_memory)
        k = max(c for c in range(1, max(layers, 1) + 1) if peak(c, lanes) <= max_memory and c <= max(1, math.ceil(layers / (processes * lanes))))
    k = min(k, max(1, math.ceil(layers / (processes * lanes))))  # every process and lane gets a chunk
    lanes = min(lanes, max(1, math.ceil(layers / (processes * k))))
    return StreamPlan(k, layers, 2 if aligned else 1, peak(k, lanes), in_memory, int(total_stored), int(block_bytes), in_flight=lanes)


def available_memory() -> int:
    """Bytes this machine can give a new process now (MemAvailable; physical memory elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ---- output ----------------------------------------------------------------------------------------

def check_stream_output(out, sources: Sequence[Source], overwrite: bool, output_bytes: int, scratch_bytes: int = 0) -> Path:
    """`hf.check_output` before any heavy work: not a source, not existing without `overwrite`,
    room on its disk for the output (and the statistics spilled beside it)."""
    return hf.check_output(out, [s.path for s in sources], overwrite=overwrite, output_bytes=output_bytes, scratch_bytes=scratch_bytes)


def out_specs(source: Source, dtype) -> dict:
    """{tensor key: (dtype, shape)} of the output tensors, laid out as `source`."""
    return {key: (np.dtype(dtype) if dtype is not None else source.stored(key), source.hf_shape(key)) for key in source.rules}
