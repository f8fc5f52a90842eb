"""Align and merge checkpoints bigger than memory: disk to disk, a few layers at a time.

`align_to_disk(a, b, out)` and `merge_to_disk(method, [a, b, ...], out)` read the safetensors
files lazily (single or sharded; plain reads, so the pages read never count in this process's
resident memory), hold at most `chunk_layers` layers of each model at once, and write the output
shards tensor by tensor as layers complete (`hf.ShardWriter`) in a temporary folder that appears
atomically at the end (`hf.write_folder`, as `save_hf`). `plan_align` / `plan_merge` give the
chunk size and the peak memory from the headers alone (what `--dry-run` prints).

Every layer's attention and FFN matching depends only on that layer (MATH §2-5), so alignment
runs in two passes over the layers. Pass 1 reads A and B a chunk at a time: the FFN cost matrices
and their assignments (one per layer, as `align` does them) and each attention block's cross
products, a few (dh x dh) matrices per layer. Then every layer's rotations are solved in one
batched call from the gathered cross products: the same batch as `align`'s, which matters, as the
polar iteration takes one branch per batch (`procrustes._newton_schulz`). Pass 2 reads the chunks
again, moves B's (or merges the models), and writes. Each chunk's leaves are renamed to layers
0..k-1 so that every chunk of one size runs the same compiled programs. The results (weights,
transforms, distances) equal `align` / `merge` + `save_hf` in memory bit for bit
(tests/test_streaming.py), with one exception: a leaf outside the layers bigger than
`block_bytes` (embeddings, LM heads of large models) is handled in row blocks, and its distance is
then summed on the host in float64 rather than by XLA in float32 (the weights stay bit-identical
for the elementwise methods, average and task arithmetic; others take such a leaf whole).

Statistics-based merges (fisher, regmean; `merge.STATISTICS`) compute their statistics in a
pass of their own over the data (`batches`), between the two passes over the weights: each model
in turn is loaded whole (`load_hf`), moved by its solved transforms as `align` moves it (the
anchor is not moved), its diagonal Fisher (`stats.fisher`) or input Gram matrices (`stats.grams`)
computed on it as aligned, and spilled leaf by leaf into a temporary folder beside the output
(removed at the end, on error too) before the next model is loaded: one model is resident at a
time, never the pair, its moved copy and the cost matrices. Pass 2 reads each chunk's statistics
(and those of the leaves outside the layers) from the spill and merges with the in-memory merge's
kernels (`merge.fisher_leaves`, `merge.regmean_leaves`): the weights equal `stats.*` +
`merge.fisher` / `merge.regmean` on the aligned models + `save_hf` bit for bit. Fisher is entry
by entry, so a big leaf outside the layers goes in row blocks with its Fisher's rows (spilled in
the HF tensor's layout); RegMean averages a big leaf without a Gram matrix (the embeddings) in row
blocks too, and solves a kernel with one (an untied LM head) whole. Such a run needs one model
whole plus its statistics and the forward/backward working set of the statistics on one batch
(`StreamPlan.statistics_bytes`), whatever the chunk size.

Chunks in flight: a run works on `StreamPlan.in_flight` chunks at once (`_in_flight`), a thread
each, one per local device and at least two on one device where the memory allows, so that one
chunk's reads, transfers and host assignments run while another's device work does; every chunk's
part carries its key and the solver combines them in key order, so the bits do not depend on the
order the chunks finish in. Many processes (`processes.Team`, a JAX multi-process program) split
the chunks: each reads, solves and writes its contiguous share; the solvers' parts and the
distances go through JAX collectives, every process then solves every group over all layers,
process 0 makes the output files and publishes them, the others write their tensors into them
(`_write_together`). Both are bit for bit the one-process, one-device run (tests/test_processes.py).

The residual stream (`residual != "none"`) couples every layer: `_ResidualDescent` runs
`align`'s coordinate descent a pass over the chunks at a time, its cross products summed over
the layers in one order whatever the lanes and processes; a rotation needs the norm gains folded
beforehand (`fold_norms`), as `align` does.

`merge_to_disk(align="many")` runs `align_many` (`_AlignMany`) a pass over the chunks per step,
bit for bit.

Not streamed (refused with an error): alignment from data (`method="activations"`: forward passes
of whole models), `align_many` with the residual stream, and OT fusion (it needs every model whole).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import inspect
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from . import checks, owned
from .checks import architecture_mismatch, is_head
from .engine import driver
from .engine import many as many_mod
from .engine import residual as residual_mod
from .engine.distances import before_after, host_sq_dist, sq_dists, summarise_distances
from .engine.groups import apply_to_leaves, apply_unchecked
from .errors import InputError, InputTypeError, RotsymError
from .families.family import assemble
from .io import hf
from .io.memory import F32_COPIES_ALIGN, F32_COPIES_MERGE, HOST_COST_COPY, STORED_COPIES, cost_matrix_bytes, in_memory_bytes, runtime_bytes
from .merging import methods as merge_methods
from .merging import stats as stats_mod
from .options import ALIGN_MODES, DEFAULT_BLOCK_BYTES, FIELDS, STREAM_FIELDS, AlignOptions, StreamOptions
from .precision import exact_jit
from .processes import Team
from .pytree import flatten, layer_chunks, leaf_signatures, signature_digest, unflatten
from .spec import bind
from .timings import Clock
from .transforms import RESIDUAL


def _stream_options(stream, keywords: Mapping | None = None) -> StreamOptions:
    """`StreamOptions.of(stream, **keywords)`, its refusals StreamingErrors."""
    try:
        return StreamOptions.of(stream, **(keywords or {}))
    except (InputError, InputTypeError) as e:
        raise StreamingError(str(e)) from None


def streamed_method(name: str) -> merge_methods.Method:
    """The registered merge method `name` where a streamed run can merge with it (its
    `granularity` is "element" or "tensor": a chunk of layers merges as the whole model would;
    Fisher and RegMean from a statistics pass of their own), else a StreamingError saying why."""
    try:
        m = merge_methods.method_named(name)
    except InputError as e:
        raise StreamingError(str(e)) from None
    why = m.unstreamed()
    if why:
        raise StreamingError(f"method {name!r} is not streamed: {why}; streamed methods: {streamed_methods()}")
    return m


def streamed_methods() -> list[str]:
    """The registered merge methods a streamed run merges with (those of `register` too)."""
    return [name for name, m in merge_methods.METHODS.items() if m.unstreamed() is None]


def _row_blocked(m: merge_methods.Method) -> bool:
    """Whether a big tensor outside the layers may be merged in row blocks: an entry-by-entry
    method without statistics (Fisher's rows come from its statistics pass: `_StatisticsMerge`)."""
    return m.granularity == "element" and m.statistics is None


# align="many": `align_many`'s sweeps and tolerance, as the merge command runs it (its defaults)
MANY_STOPS = tuple(inspect.signature(many_mod.align_many).parameters[name].default for name in ("max_iters", "tol"))

# The memory model (bytes) of a chunk: see `memory`.


class StreamingError(RotsymError, ValueError):
    """An option or input the streaming path cannot handle (it names the alternative)."""


# ---- sources ---------------------------------------------------------------------------------------

def tensor_key(rule) -> str:
    """A tensor's name that does not depend on the checkpoint holding it: the leaves it fills.
    Checkpoints of one architecture name a tensor differently (a bare `BertModel` stores
    `encoder.layer.0...`, a `BertForSequenceClassification` `bert.encoder.layer.0...`), and
    `load_hf` maps each through its own layout onto the same leaves; every streamed pass works on
    these keys and asks each source for its own tensor names."""
    return "+".join(rule.ours) + ("" if rule.index is None else f"#{rule.index}")


class _Source:
    """A checkpoint folder read lazily: its abstract Checkpoint (every name, shape and dtype checked
    from the headers by `load_hf(weights=False)`) and its tensors on demand, by `tensor_key`."""

    def __init__(self, source, what: str, allow_nonfinite: bool = False):
        """`source`: a checkpoint folder, or the Checkpoint `load_hf(folder, weights=False)` read
        from one (with the inferred record it was read with, if any)."""
        self.what, self.allow_nonfinite = what, allow_nonfinite
        self.ck = source if isinstance(source, hf.Checkpoint) else hf.load_hf(source, weights=False)
        if self.ck.source is None:
            raise StreamingError(f"{what}: streaming reads a Hugging Face checkpoint folder; this checkpoint has none")
        self.path = self.ck.source
        self.record = self.ck.model_config.record
        self.files = hf.TensorFiles(self.path)
        family = hf.family_of(self.ck.model_config)
        self.rules = {tensor_key(r): r for r in family.tensors(self.ck.model_config, self.ck.layout)}
        self.keys_of: dict[str, list[str]] = {}  # our leaf -> its tensors' keys (a stacked leaf: one per expert)
        for key, r in self.rules.items():
            for p in r.ours:
                self.keys_of.setdefault(p, []).append(key)
        self.shapes = {p: tuple(x.shape) for p, x in flatten(self.ck.params).items()}

    def hf_name(self, key: str) -> str:
        return self.rules[key].hf

    def stored(self, key: str) -> np.dtype:
        return np.dtype(self.ck.stored_dtypes[self.rules[key].ours[0]])

    def hf_shape(self, key: str) -> tuple:
        return self.files.shape(self.rules[key].hf)

    def tensor(self, key: str, clock, rows=None) -> np.ndarray:
        name = self.rules[key].hf
        with clock.phase("read"):
            array = self.files.read(name, rows)
            bad = hf.nonfinite_count(array)
        if bad and not self.allow_nonfinite:
            raise hf.CheckpointError(
                f"{self.files.where[name]}: tensor {name!r} holds {bad} non-finite values (NaN or Inf) of {array.size}"
                f"{'' if rows is None else f' in rows {rows[0]}:{rows[1]}'}; {self.what} must be finite"
            )
        return array

    def leaves(self, keys: Sequence[str], clock, device: bool = True) -> dict:
        """{our path: leaf} of the tensors `keys`, as `load_hf` makes them (device arrays of the
        stored dtype), or host arrays with device=False."""
        def put(x):
            return hf.to_device(x, None) if device else np.ascontiguousarray(x, jax.dtypes.canonicalize_dtype(x.dtype))

        out, experts = {}, []
        for key in keys:
            rule = self.rules[key]
            tensor = self.tensor(key, clock)
            with clock.phase("transfer"):
                if rule.index is not None:  # one expert of a stacked leaf: stacked once all are read
                    experts.append((rule, rule.to_ours(tensor)))
                else:
                    out.update({path: put(leaf) for path, leaf in zip(rule.ours, rule.to_ours(tensor))})
                    jax.block_until_ready(out)
            del tensor  # one tensor as read at a time, not two while the next is read
        with clock.phase("transfer"):
            out.update({path: put(leaf) for path, leaf in assemble(experts).items()})
            jax.block_until_ready(out)
        return out

    def close(self):
        self.files.close()


class _Writer:
    """`hf.ShardWriter` of an output checkpoint laid out as `source` (its tensor names), written
    by `tensor_key`."""

    def __init__(self, folder: Path, source: _Source, specs: Mapping[str, tuple], max_shard_bytes: int, *, create: bool = True,
                 writes=None):
        self._names = {key: source.hf_name(key) for key in specs}
        self._writer = hf.ShardWriter(folder, {self._names[k]: v for k, v in specs.items()}, max_shard_bytes, create=create,
                                      writes=None if writes is None else [self._names[k] for k in writes])

    def write(self, key: str, tensor: np.ndarray):
        self._writer.write(self._names[key], tensor)

    def write_rows(self, key: str, start: int, rows: np.ndarray):
        self._writer.write_rows(self._names[key], start, rows)

    def done(self, key: str):
        self._writer.done(self._names[key])

    def finish(self):
        self._writer.finish()

    def close(self):
        self._writer.close()


def _same_architecture(anchor: _Source, other: _Source) -> None:
    problem = architecture_mismatch((f"{anchor.what} ({anchor.path})", anchor.ck.family, anchor.shapes),
                                           (f"{other.what} ({other.path})", other.ck.family, other.shapes))
    if problem:
        raise StreamingError(problem)


# ---- layers and chunks --------------------------------------------------------------------------------

@dataclasses.dataclass
class _Layout:
    """Which HF tensors belong to which layer, and each chunk's renamed sub-spec."""

    bound: object  # the spec bound to the body (every leaf but the task head)
    layers: list  # layer indices, in order
    layer_rules: dict  # layer -> [tensor keys]
    global_rules: list  # tensor keys outside the layers (embeddings, final norm, task head)
    local_name: dict  # member path -> (layer, path template)
    rule_ours: dict  # tensor key -> our leaf paths
    layer_members: dict = dataclasses.field(default_factory=dict)  # layer -> member paths, in flatten order

    def __post_init__(self):
        for path, (layer, _) in self.local_name.items():
            self.layer_members.setdefault(layer, []).append(path)

    @classmethod
    def of(cls, source: _Source, spec) -> _Layout:
        body = unflatten({p: np.broadcast_to(np.zeros((), np.int8), s) for p, s in source.shapes.items() if not is_head(p)})
        bound = bind(spec if spec is not None else hf.spec_for(source.ck), body)
        leaf_layer = dict(bound.leaf_layers)
        local_name = {}
        for group in bound.groups:
            for member in group.members:
                if member.layer_axis is not None or not all(isinstance(layer, int) for layer in group.layers):
                    raise StreamingError(f"group {group.name!r}: streaming needs one leaf per integer layer (not a scanned stack)")
                for layer, path in zip(group.layers, member.paths):
                    local_name[path] = (layer, member.template)
        layer_rules, global_rules = {}, []
        for name, rule in source.rules.items():
            layers = {leaf_layer.get(p) for p in rule.ours}
            if len(layers) != 1:
                raise StreamingError(f"tensor {name!r} feeds leaves of several layers {sorted(map(str, layers))}")
            layer = layers.pop()
            if layer is None:
                global_rules.append(name)
            elif not isinstance(layer, int):
                raise StreamingError(f"tensor {name!r}: layer {layer!r} is not an integer index")
            else:
                layer_rules.setdefault(layer, []).append(name)
        return cls(bound, sorted(layer_rules), layer_rules, global_rules, local_name, {n: r.ours for n, r in source.rules.items()})

    def chunks(self, size: int) -> list[list[int]]:
        return [self.layers[i:i + size] for i in range(0, len(self.layers), size)]

    def members(self, chunk) -> list[str]:
        paths = [p for layer in chunk for name in self.layer_rules[layer] for p in self.rule_ours[name]]
        return [p for p in paths if p in self.local_name]

    def rename(self, chunk, flat: Mapping) -> dict:
        """{local path: leaf} of the members among `flat`: layer chunk[j] renamed layer j."""
        out = {}
        for j, layer in enumerate(chunk):
            for path in self.layer_members[layer]:
                if path in flat:
                    out[self.local_name[path][1].replace("{layer}", str(j))] = flat[path]
        return out

    def restore(self, chunk, local: Mapping) -> dict:
        """`rename` undone."""
        out = {}
        for j, layer in enumerate(chunk):
            for path in self.layer_members[layer]:
                name = self.local_name[path][1].replace("{layer}", str(j))
                if name in local:
                    out[path] = local[name]
        return out

    def local_bound(self, chunk, shapes: Mapping):
        """The spec bound to the chunk's renamed members: the same BoundSpec (so the same compiled
        programs) for every chunk of one size. Its groups list their members in the same order
        as the whole model's (both follow `flatten`'s order), so the cross products sum in it."""
        local = self.rename(chunk, {p: np.broadcast_to(np.zeros((), np.int8), shapes[p]) for layer in set(chunk) for p in self.layer_members[layer]})
        spec = dataclasses.replace(self.bound.spec, residual=None)
        bound = bind(spec, unflatten(local))
        full = {g.name: g for g in self.bound.groups}
        for g in bound.groups:
            if [(m.template, m.role) for m in g.members] != [(m.template, m.role) for m in full[g.name].members]:
                raise AssertionError(f"group {g.name!r}: a chunk's members are not in the model's order")
        return bound

    def positions(self, group, chunk) -> np.ndarray:
        return np.array([group.layers.index(layer) for layer in chunk if layer in group.layers], dtype=np.int32)


def _chunk_transforms(layout: _Layout, transforms: dict, chunk) -> dict:
    """The chunk's slice of every group's element (arrays over the group's layers)."""
    groups = {g.name: g for g in layout.bound.groups}
    out = {}
    for name, t in transforms.items():
        idx = layout.positions(groups[name], chunk)
        if idx.size:  # a group with no layer in the chunk (a mixture of experts' dense layers) is not in its spec
            out[name] = jax.tree.map(lambda x, idx=idx: x[idx], t)
    return out


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
    `in_flight`: chunks worked on at once (`_in_flight`): one per local device, and at least two
    where the memory allows; the lanes of one device take turns to compute, so that one chunk's
    reads, transfers and writes overlap another's device work. The peak counts a chunk's working
    set per device and what each other lane holds while it waits (its chunk as read, or its
    results as written). `passes_per_sweep`, `max_sweeps`: an alignment that sweeps (the residual
    descent, each aligned model's; `align_many`) reads the weights `passes_per_sweep` more times a
    sweep, for at most `max_sweeps` sweeps, besides its `passes` (`_with_sweeps`)."""

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


def _with_sweeps(plan: StreamPlan, *, align: str = "anchor", residual: str = "none", residual_sweeps: int = 8, models: int = 2) -> StreamPlan:
    """`plan` with the passes of an alignment that sweeps: each aligned model's residual descent
    reads the weights once for its first T and 3 times a sweep (`_ResidualDescent`); `align_many`
    4 times before its sweeps (the order, the objective, the medoid's alignment, the objective)
    and twice a model a sweep (`_AlignMany`)."""
    if align == "many":
        return dataclasses.replace(plan, passes=plan.passes + 3, passes_per_sweep=2 * models, max_sweeps=MANY_STOPS[0])
    if align == "anchor" and residual != "none":
        return dataclasses.replace(plan, passes=models, passes_per_sweep=3 * (models - 1), max_sweeps=residual_sweeps)
    return plan


def _moved_models(align: str, models: int) -> int:
    """How many of `models` an alignment mode moves: none, every one but the anchor, all."""
    return {"none": 0, "anchor": models - 1, "many": models}[align]


def _layer_bytes(source: _Source, layout: _Layout) -> tuple[list[int], list[int], list[int]]:
    """Per layer: bytes stored, entries, and the bytes of its biggest tensor."""
    stored, entries, biggest = [], [], []
    for layer in layout.layers:
        n = [math.prod(source.hf_shape(name)) for name in layout.layer_rules[layer]]
        sizes = [k * source.stored(name).itemsize for k, name in zip(n, layout.layer_rules[layer])]
        entries.append(sum(n))
        stored.append(sum(sizes))
        biggest.append(max(sizes, default=0))
    return stored, entries, biggest


def _cost_bytes(layout: _Layout) -> int:
    """One layer's permutation cost matrices (float32), and the host's float64 copy in SciPy."""
    return int(cost_matrix_bytes(layout.bound, per_layer=True) * (1 + HOST_COST_COPY))


def _plan(sources: Sequence[_Source], layout: _Layout, stream: StreamOptions, *, aligned: int, merging: bool, elementwise: bool, out_dtype=None,
          statistics_per_layer: Sequence[int] | None = None, statistics_global: int = 0, output: _Source | None = None,
          moved: int | None = None, processes: int = 1, max_in_flight: int | None = None, residual: str = "none") -> StreamPlan:
    """`output`: the source whose layout is written and whose tensors `layout` lists (default the
    anchor, `sources[0]`). `moved`: how many models alignment moves (default: one if `aligned`).
    `processes`: how many processes split the chunks; each works on `StreamPlan.in_flight` of
    its share at once (at most `max_in_flight`), over its local devices. `residual`: the
    alignment's residual mode; its descent holds (d, d) cross products (`_ResidualDescent`)."""
    max_memory, chunk_layers, block_bytes = stream.max_memory, stream.chunk_layers, stream.block_bytes
    moved = (1 if aligned else 0) if moved is None else moved
    output = sources[0] if output is None else output
    stored, entries, biggest = _layer_bytes(output, layout)
    n = len(sources)
    per_layer_align = [STORED_COPIES * 2 * s + F32_COPIES_ALIGN * 4 * e + _cost_bytes(layout) for s, e in zip(stored, entries)]
    per_layer_merge = [STORED_COPIES * n * s + 4 * e * (F32_COPIES_MERGE * n + 1) for s, e in zip(stored, entries)]
    if statistics_per_layer is not None:  # fisher / regmean: every model's statistics of the layer, read from the spill
        per_layer_merge = [y + z for y, z in zip(per_layer_merge, statistics_per_layer)]
    per_layer = [max(x if aligned else 0, y if merging else 0, x if not merging else 0) for x, y in zip(per_layer_align, per_layer_merge)]
    # A lane waiting for its device's turn (`_in_flight`) holds the layer as read (every model it
    # reads, as stored; one tensor at a time also as read and transposed), or, written after its
    # turn, the results (float32) and one tensor converted.
    waiting_per_layer = [max((n if merging else 2) * s + 2 * t, 4 * e + t) for s, e, t in zip(stored, entries, biggest)]
    per_layer_max = max(per_layer) if per_layer else 0
    global_sizes = [math.prod(output.hf_shape(name)) for name in layout.global_rules]
    biggest = max(global_sizes, default=0)
    if block_bytes is None:
        block_bytes = DEFAULT_BLOCK_BYTES
    # Outside the layers: a leaf whole unless it is blocked; all small ones together.
    whole = [k for k in global_sizes if not (elementwise and k * 4 > block_bytes)]
    blocked = block_bytes * (n + 2) if elementwise and biggest * 4 > block_bytes else 0
    global_peak = max(blocked, (STORED_COPIES * n * 2 + 4 * (F32_COPIES_MERGE * n + 1)) * max(whole, default=0))
    global_peak += statistics_global  # fisher / regmean: the statistics of the leaves outside the layers
    total_stored = sum(math.prod(output.hf_shape(key)) * (np.dtype(out_dtype).itemsize if out_dtype else output.stored(key).itemsize)
                       for key in output.rules)
    model_bytes = sum(stored) + sum(math.prod(output.hf_shape(nm)) * output.stored(nm).itemsize for nm in layout.global_rules)
    held = [sum(math.prod(s.hf_shape(key)) * s.stored(key).itemsize for key in s.rules) for s in sources]
    in_memory = in_memory_bytes(held, moved=[model_bytes] * moved, cost_bytes=cost_matrix_bytes(layout.bound) if moved else 0,
                                merged_bytes=4 * (sum(entries) + sum(global_sizes)) if merging else 0)

    devices = len(jax.local_devices())

    # the residual descent's (d, d) float32 cross products (two for a signed permutation): the
    # running sum and the lanes' layers not yet added; a later process holds its share's until its turn
    cross = 0 if residual == "none" or layout.bound.residual is None else (2 if residual == "signed_permutation" else 1) * 4 * layout.bound.residual.size ** 2

    def peak(k, lanes):
        in_flight = min(lanes, max(1, math.ceil(len(per_layer) / k)))
        turns = min(in_flight, devices)  # one chunk computing per device, the others hold theirs as read or written
        chunk = max(sum(per_layer[i:i + k]) for i in range(0, max(1, len(per_layer)), k))
        waiting = max(sum(waiting_per_layer[i:i + k]) for i in range(0, max(1, len(per_layer)), k))
        crosses = cross * (1 + k * in_flight + (math.ceil(len(per_layer) / processes) if processes > 1 else 0))
        return int(runtime_bytes() + max(global_peak, turns * chunk + (in_flight - turns) * waiting + crosses))

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
            raise StreamingError(
                f"max_memory={max_memory / 2**30:.2f} GiB is below what one layer at a time needs, about "
                f"{peak(1, 1) / 2**30:.2f} GiB (the runtime {runtime_bytes() / 2**30:.2f} GiB, the biggest layer "
                f"{per_layer_max / 2**30:.2f} GiB, the biggest leaf outside the layers {global_peak / 2**30:.2f} GiB)"
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

def _check_output(out, sources: Sequence[_Source], overwrite: bool, output_bytes: int, scratch_bytes: int = 0) -> Path:
    """`hf.check_output` before any heavy work: not a source, not existing without `overwrite`,
    room on its disk for the output (and the statistics spilled beside it)."""
    return hf.check_output(out, [s.path for s in sources], overwrite=overwrite, output_bytes=output_bytes, scratch_bytes=scratch_bytes)


def _out_specs(source: _Source, dtype) -> dict:
    """{tensor key: (dtype, shape)} of the output tensors, laid out as `source`."""
    return {key: (np.dtype(dtype) if dtype is not None else source.stored(key), source.hf_shape(key)) for key in source.rules}


def _to_hf(rule, leaves: Mapping, out_dtype) -> np.ndarray:
    """The HF tensor of `rule` as save_hf writes it, refusing non-finite values as it does."""
    with np.errstate(over="ignore"):
        tensor = np.ascontiguousarray(rule.to_hf(tuple(np.asarray(leaves[p]) for p in rule.ours)).astype(out_dtype, copy=False))
    bad = hf.nonfinite_count(tensor)
    if bad:
        raise hf.CheckpointError(f"output tensor {rule.hf!r}: {bad} of {tensor.size} values are not finite as {out_dtype} (NaN, Inf or overflow)")
    return tensor


def _release_freed_memory() -> None:
    """Hand the allocator's freed pages back to the system (glibc's `malloc_trim`; elsewhere
    nothing). Freed buffers below glibc's moving mmap threshold stay in its heaps, fragmented:
    measured on the 3B-shape Llama pair, pass 1's resident memory grew 30 MB per layer without
    this, 8 MB with it (the gathered cross products), at ~10 ms a call."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def _ticker(total: int, progress: Callable[[int, int], None] | None) -> Callable[[], None]:
    """The step-done call of a run: after each chunk (and each model of the statistics pass),
    freed memory goes back to the system and `progress(done, total)` is told. `tick.skip(n)`:
    n steps the run will not take (the sweeps a converged alignment did not need) counted done."""
    done = [0]

    def tick(steps: int = 1):
        _release_freed_memory()
        done[0] += steps
        if progress is not None:
            progress(done[0], total)

    tick.skip = lambda steps: steps and tick(steps)
    return tick


def _skip(tick, steps: int) -> None:
    """`tick.skip(steps)` where `tick` is a run's `_ticker`."""
    getattr(tick, "skip", lambda steps: None)(steps)


def _write(writer, clock, name, rule, leaves: Mapping, out_dtype):
    """`name` written from our `leaves` (host arrays), converted to its HF form and `out_dtype`."""
    with clock.phase("write"):
        writer.write(name, _to_hf(rule, leaves, out_dtype))


class _Turn:
    """A device's turn to compute (`_in_flight`), held by one lane at a time."""

    def __init__(self):
        self._lock = threading.Lock()

    def __enter__(self):
        _release_freed_memory()  # what the lane freed while reading goes back before it computes
        self._lock.acquire()

    def __exit__(self, *exc):
        self._lock.release()


def _in_flight(items: Sequence, work: Callable, clock: Clock, lanes: int) -> list:
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
    turns, warm = [_Turn() for _ in devices], [threading.Event() for _ in devices]
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


def _write_together(team: Team, ck, target: Path, dtypes: Mapping, new_writer: Callable, write_mine: Callable, summarise: Callable,
                    extra_files, report: dict, start: float) -> tuple[Path, dict]:
    """The output folder written by every process of `team`, each its own tensors: process 0
    makes the files (`new_writer(tmp, True)`: every header and the index) in `hf.write_folder`'s
    temporary folder, the others then open them (`new_writer(tmp, False)`); each runs
    `write_mine(writer)`, whose results (one per process) `summarise` turns into `report` on
    process 0, which then writes `extra_files` and publishes. Returns the folder and process 0's
    report, in every process. One process: `hf.write_folder` with `write_mine` and `summarise`."""
    def write_weights(tmp):
        writer = []
        team.exchange(lambda: writer.append(new_writer(tmp, True)) or str(tmp))
        summarise(team.exchange(lambda: write_mine(writer[0])))

    if team.lead:
        files = (lambda: extra_files(report)) if callable(extra_files) else extra_files
        path = hf.write_folder(ck, target, dtypes, write_weights, files)
        report["timings"]["total"] = time.perf_counter() - start
        team.exchange(lambda: (str(path), report))
        return path, report
    tmp = Path(team.exchange(lambda: None)[0])
    team.exchange(lambda: write_mine(new_writer(tmp, False)))
    published, report = team.exchange(lambda: None)[0]
    return Path(published), report


# ---- pass 1: the alignment statistics ----------------------------------------------------------------

def _solve_transforms(layout: _Layout, anchor: _Source, others: Sequence[_Source], chunks, options: AlignOptions, clock, tick,
                      team: Team | None = None, lanes: int = 1, prepare: Callable | None = None,
                      read_anchor: Callable | None = None) -> list[dict]:
    """Each of `others` aligned to `anchor`: its transforms over all layers (`driver.Solve`, as
    `align` runs it, fed a chunk at a time), and the squared distance of every body leaf before
    alignment. With several processes, each reads and reduces its share of the chunks, and every
    process then solves every group from all the processes' parts (the same transforms in each);
    `lanes` chunks at a time (`_in_flight`). `prepare(chunk, flat_a, flat_b, clock)`: the leaves
    to solve on and the squared distances to return in place of B's as read and their distances
    (the residual descent's: B moved by its T, and the previous sweep measured).
    `read_anchor(chunk, names, clock)`: the anchor's leaves of a chunk, in place of `anchor`'s
    (`align_many`'s: the mean of the other models as aligned)."""
    team = team or Team()

    def solve_share(share, clock, turn):
        runs = [driver.Solve(layout.bound, options, clock, blocking=True) for _ in others]
        sq_before = [{} for _ in others]
        for key, chunk in share:
            names = [name for layer in chunk for name in layout.layer_rules[layer]]
            flat_a = anchor.leaves(names, clock) if read_anchor is None else read_anchor(chunk, names, clock)
            local_a = layout.rename(chunk, flat_a)
            bound = layout.local_bound(chunk, others[0].shapes)  # every model has the same shapes
            for other, run, sq in zip(others, runs, sq_before):
                flat_b = other.leaves(names, clock)
                with turn:
                    if prepare is None:
                        sq.update(_sq(clock, flat_a, flat_b, list(flat_a)))
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
        shares = _in_flight(team.share(list(enumerate(chunks))), solve_share, clock, lanes)
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


def _moved(layout: _Layout, chunk, flat: dict, transforms: dict, clock) -> dict:
    """`flat` (a chunk's leaves) with its members moved by the chunk's slice of `transforms`, then
    every leaf on the residual stream by its transform, if `transforms` has one (as `align`
    applies them: the groups, then the stream, another axis of the same leaves)."""
    groups = {name: t for name, t in transforms.items() if name != RESIDUAL}
    shapes = {p: np.shape(x) for p, x in flat.items()}
    bound = layout.local_bound(chunk, shapes)
    moved = clock.timed("apply", apply_to_leaves, bound, layout.rename(chunk, flat), _chunk_transforms(layout, groups, chunk))
    moved = {**flat, **layout.restore(chunk, moved)}
    if RESIDUAL in transforms:
        moved = _on_stream(layout.bound.residual, moved, transforms[RESIDUAL], clock)
    return moved


def _gathered(team: Team, chunks, clock, lanes: int, tick, read: Callable, compute: Callable) -> dict:
    """{path: value} of `compute(chunk, read(chunk, clock), clock)` over this process's `chunks`,
    each read before its device's turn and computed in it (`_in_flight`), gathered from every
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

    mine = {p: v for part in _in_flight(chunks, work, clock, lanes) for p, v in part.items()}
    return {p: v for part in team.exchange(lambda: mine) for p, v in part.items()}


# ---- the residual stream, streamed -------------------------------------------------------------------

@functools.partial(exact_jit, static_argnums=(2, 3))
def _stream_leaf(x, t, axis: int, gain: bool):
    # an RMSNorm gain is a diagonal map, not a vector of the stream: it follows the permutation only
    return jnp.take(x, t.perm, axis=axis) if gain else t.act(x, axis)


def _full_stream(layout: _Layout, source: _Source):
    """The residual stream of `source` with its task head: `align` moves a head that reads the
    stream (a sequence classifier's score) by T too, though it solves without it."""
    return bind(layout.bound.spec, unflatten(shape_stand_ins_of(source.shapes))).residual


def _moved_rows(rule, stream, t, block: np.ndarray, clock) -> np.ndarray:
    """Rows of an HF tensor outside the layers holding one leaf, moved by `t` along the leaf's
    stream axes (through the leaf's layout: the rows of an LM head are columns of our kernel)."""
    (path,) = rule.ours
    if not any(p == path for p, _ in stream.axes):
        return block
    (leaf,) = rule.to_ours(block)
    moved = _on_stream(stream, {path: leaf}, t, clock)[path]
    return np.ascontiguousarray(rule.to_hf((np.asarray(moved),)))


def _on_stream(stream, flat: Mapping, t, clock) -> dict:
    """`flat` with each of its leaves on the residual stream moved by `t` along its stream axes,
    as `align` moves them (`engine.groups._act_on_stream`), a leaf at a time."""
    gains, out = set(stream.gains), dict(flat)
    t0 = time.perf_counter()
    for path, axis in stream.axes:
        if path in out:
            out[path] = _stream_leaf(out[path], t, axis, path in gains)
    jax.block_until_ready(out)
    clock["apply"] += time.perf_counter() - t0
    return out


class _OrderedSum:
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


class _ResidualDescent:
    """`align`'s coordinate descent over (per-layer groups, residual T) (MATH §10,
    `engine.residual.descend`), streamed: every step a pass over the chunks.

    - The first T from the leaves no group moves (one pass reading those alone).
    - Each sweep: a pass solving the groups on B moved by T (`_solve_transforms`), a pass summing
      T's cross products on B moved by the groups, and a pass measuring {groups, T}; the descent
      stops when a sweep makes no progress, keeping the best, as `align` does. (Measuring in the
      next sweep's solve pass saves a read but solves the groups once more when the descent
      stops, which on the 3B-shaped pair cost more: the FFN cost products dominate.)

    The cross products are summed per layer, on the device, then over the layers on the host in
    float32 in a fixed order: the leaves outside the layers first, then layer 0, 1, ... With
    several processes each adds its layers to the sum of the layers before them, passed on from
    process to process (`Team.in_order`): the same additions in the same order as one process,
    so the same bits. A process other than the first holds its layers' (d, d) sums until its
    turn. The descent's result equals `align`'s up to the order of those float32 sums (the same
    permutations on the tests' pairs)."""

    def __init__(self, layout: _Layout, anchor: _Source, other: _Source, chunks, options: AlignOptions, clock, team: Team, lanes: int,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, tick: Callable[[], None] = _release_freed_memory):
        self.layout, self.anchor, self.other, self.options, self.clock, self.team, self.lanes, self.tick = (
            layout, anchor, other, options, clock, team, lanes, tick)
        self.block_bytes = block_bytes
        self.chunks, self.mine = chunks, team.share(chunks)
        bound = layout.bound
        if bound.residual is None:
            raise StreamingError("residual alignment needs the spec's residual rules (Spec.residual; the built-in families' specs have them)")
        self.stream, self.mode = bound.residual, options.residual
        refusal = (residual_mod.signed_refusal(self.stream) if self.mode == "signed_permutation"
                   else residual_mod.rotation_refusal(self.stream) if self.mode == "rotation" else None)
        if refusal:
            raise StreamingError(refusal)
        self.leaf_layer = dict(bound.leaf_layers)
        # the leaves outside the layers that alignment measures: the body's, where the anchor has them
        self.globals = [name for name in layout.global_rules if name in anchor.rules and any(not is_head(p) for p in other.rules[name].ours)]
        # the big ones (embeddings, LM heads) in row blocks, as the write pass takes them
        self.blocked = [n for n in _blocked_globals(layout, [anchor, other], block_bytes, lambda name: True) if n in self.globals]

    def _blocks(self, name: str):
        """(A's rows, B's rows as our leaf) of the tensor outside the layers `name`, block by block."""
        rule = self.other.rules[name]
        shape = self.other.hf_shape(name)
        rows = max(1, self.block_bytes // (4 * max(1, math.prod(shape[1:]))))
        for start in range(0, shape[0], rows):
            span = (start, min(shape[0], start + rows))
            (a,), (b,) = (rule.to_ours(s.tensor(name, self.clock, span)) for s in (self.anchor, self.other))
            yield a, b

    def _scored(self, untouched: bool) -> list:
        rotation = self.mode == "rotation"
        if self.mode == "signed_permutation":  # (M without the gains, the gains' M): `residual.signed_cross`
            return [residual_mod.scored_axes(self.layout.bound, True, untouched), residual_mod.scored_axes(self.layout.bound, False, untouched, True)]
        return [residual_mod.scored_axes(self.layout.bound, rotation, untouched)]

    def _crosses(self, scored: list, layer, flat_a: Mapping, flat_b: Mapping):
        """The cross products of `layer`'s scored leaves (None: those outside the layers), on the
        host: one (d, d) array, or the pair of a signed permutation."""
        d = self.stream.size
        parts = []
        for pairs in scored:
            pairs = [(p, axis) for p, axis in pairs if self.leaf_layer.get(p) == layer and p in flat_a]
            if not pairs:
                parts.append(np.zeros((d, d), np.float32))
                continue
            m = residual_mod.stream_cross(tuple(flat_a[p] for p, _ in pairs), tuple(flat_b[p] for p, _ in pairs), tuple(a for _, a in pairs), d)
            parts.append(np.asarray(jax.device_get(m)))
        return parts[0] if len(parts) == 1 else tuple(parts)

    def _names(self, chunk, paths: set | None) -> list:
        """The chunk's tensors holding any of `paths` (None: all)."""
        names = [name for layer in chunk for name in self.layout.layer_rules[layer]]
        return names if paths is None else [n for n in names if set(self.layout.rule_ours[n]) & paths]

    def _solve(self, cross):
        rotation = self.mode == "rotation"
        fix_ones = rotation and residual_mod.fixes_ones(self.stream)
        cross = tuple(jnp.asarray(c) for c in cross) if isinstance(cross, tuple) else jnp.asarray(cross)
        return self.clock.timed("solve", residual_mod.solve_residual, cross, self.mode, self.options.polar_method, fix_ones=fix_ones)

    def cross_pass(self, groups: dict | None):
        """T from B moved by `groups` (None: the first T, from the leaves no group moves)."""
        scored = self._scored(untouched=groups is None)
        paths = {p for pairs in scored for p, _ in pairs}
        if self.mode == "rotation" and groups is None:
            paths |= set(self.stream.gains)  # read to check they are uniform
        keys = (["outside"] if self.team.lead else []) + [layer for chunk in self.mine for layer in chunk]
        total = _OrderedSum(keys, eager=self.team.lead)
        if self.team.lead:  # the leaves outside the layers: the small ones at once, then the big ones' row blocks
            names = [n for n in self.globals if set(self.layout.rule_ours[n]) & paths and n not in self.blocked]
            flat_a, flat_b = self.anchor.leaves(names, self.clock), self.other.leaves(names, self.clock)
            self._check_gains(flat_a, flat_b)
            outside = self._crosses(scored, None, flat_a, flat_b)
            del flat_a, flat_b
            for name in self.blocked:
                (path,) = self.layout.rule_ours[name]
                if path not in paths:
                    continue
                for a, b in self._blocks(name):
                    outside = jax.tree.map(np.add, outside, self._crosses(scored, None, {path: a}, {path: b}))
            total.add("outside", outside)

        def work(share, clock, turn):
            for chunk in share:
                names = self._names(chunk, paths if groups is None else None)
                flat_a, flat_b = self.anchor.leaves(names, clock), self.other.leaves(names, clock)
                self._check_gains(flat_a, flat_b)
                with turn:
                    moved = flat_b if groups is None else _moved(self.layout, chunk, flat_b, groups, clock)
                    with clock.phase("statistics"):
                        for layer in chunk:
                            total.add(layer, self._crosses(scored, layer, flat_a, moved))
                del flat_a, flat_b, moved
                self.tick()

        _in_flight(self.mine, work, self.clock, self.lanes)
        return self._solve(self.team.in_order(total.total))

    def _check_gains(self, flat_a, flat_b) -> None:
        """A rotation keeps the function only with uniform norm gains (`residual.check_rotatable`)."""
        if self.mode != "rotation":
            return
        for flat, what in ((flat_a, "A (the anchor)"), (flat_b, "B")):
            bad = residual_mod.nonuniform_gains(self.stream, flat)
            if bad:
                raise StreamingError(f"{what}: norm gains {bad[:4]} are not uniform, so a rotation of the residual stream would change the "
                                     "function; fold them first (rj.fold_norms), or use residual='permutation'")

    def outside_sq(self, t) -> dict:
        """The squared distances of the leaves outside the layers, B's moved by `t` (None: as
        read), every process's view (process 0 measures them)."""
        def measure():
            if not self.team.lead:
                return {}
            whole = [n for n in self.globals if n not in self.blocked]
            flat_a, flat_b = self.anchor.leaves(whole, self.clock), self.other.leaves(whole, self.clock)
            moved = flat_b if t is None else _on_stream(self.stream, flat_b, t, self.clock)
            sq = _sq(self.clock, flat_a, moved, [p for p in flat_a if not is_head(p)])
            for name in self.blocked:  # summed on the host in float64, as the write pass sums them
                (path,) = self.layout.rule_ours[name]
                total = 0.0
                for a, b in self._blocks(name):
                    b = b if t is None else np.asarray(_on_stream(self.stream, {path: b}, t, self.clock)[path])
                    total += host_sq_dist(a, b)
                sq[path] = total
            return sq
        return {p: v for part in self.team.exchange(measure) for p, v in part.items()}

    def measure_pass(self, transforms) -> dict:
        """The squared distance of every leaf of the layers, B's moved by `transforms`."""
        def read(chunk, clock):
            names = self._names(chunk, None)
            return self.anchor.leaves(names, clock), self.other.leaves(names, clock)

        def compute(chunk, flats, clock):
            flat_a, flat_b = flats
            return _sq(clock, flat_a, _moved(self.layout, chunk, flat_b, transforms, clock), list(flat_a))

        return _gathered(self.team, self.mine, self.clock, self.lanes, self.tick, read, compute)

    def solve_pass(self, t, before: bool):
        """The groups solved on B moved by `t`; with `before`, the squared distances of the
        leaves of the layers, B as read (the report's before)."""
        def prepare(chunk, flat_a, flat_b, clock):
            moved = _on_stream(self.stream, flat_b, t, clock)
            return moved, (_sq(clock, flat_a, flat_b, list(flat_a)) if before else {})

        (solved,) = _solve_transforms(self.layout, self.anchor, [self.other], self.chunks, self.options, self.clock, self.tick,
                                      self.team, self.lanes, prepare=prepare)
        return solved["transforms"], solved["sq_before"]

    def run(self) -> dict:
        """{"transforms": the best sweep's groups and T, "sq_before": every body leaf's squared
        distance before alignment, "distance_per_sweep": the distance after each sweep}."""
        before = {}

        def groups_given(t, sweep):
            groups, sq = self.solve_pass(t, before=sweep == 0)
            if sweep == 0:
                before.update({**sq, **self.outside_sq(None)})
            return groups

        def squared_distance(transforms):
            sq = {**self.measure_pass(transforms), **self.outside_sq(transforms[RESIDUAL])}
            # `align`'s sum, in float32 and in its order: `sq_dists`' (a model's leaves by layer)
            return sum(sq[p] for chunk in layer_chunks([p for p in self.anchor.shapes if p in sq]) for p in chunk)

        best, per_sweep = residual_mod.descend(lambda: self.cross_pass(None), groups_given, self.cross_pass, squared_distance,
                                               self.options.residual_sweeps)
        sq_before = before
        _skip(self.tick, 3 * (self.options.residual_sweeps - len(per_sweep)) * len(self.mine))  # the sweeps it did not need
        return {"transforms": best, "sq_before": sq_before, "distance_per_sweep": per_sweep}


def streamed_options(options: AlignOptions | Mapping | None) -> AlignOptions:
    """`AlignOptions.of(options)`, refused when the streaming path cannot do them."""
    try:
        options = AlignOptions.of(options)
    except TypeError as e:
        raise StreamingError(str(e)) from None
    if options.method != "weights":
        raise StreamingError(
            f"method={options.method!r} runs both models whole on the data (forward passes): it is not streamed; align in "
            "memory (without --max-memory), or use method='weights'"
        )
    return options


def split_options(options, stream, keywords: Mapping) -> tuple[AlignOptions, StreamOptions]:
    """A streamed call's `AlignOptions` and `StreamOptions`, each from its object (or mapping)
    with the keywords that name its fields over it; refused (StreamingError) when streaming cannot
    do them or a keyword names neither."""
    unknown = sorted(set(keywords) - set(FIELDS) - set(STREAM_FIELDS))
    if unknown:
        raise StreamingError(f"unknown options {unknown}; the align options are {list(FIELDS)}, the stream options {list(STREAM_FIELDS)}")
    stream = _stream_options(stream, {k: v for k, v in keywords.items() if k in STREAM_FIELDS})
    aligning = {k: v for k, v in keywords.items() if k in FIELDS}
    return streamed_options(AlignOptions.of(options, **aligning) if isinstance(options, AlignOptions) else {**dict(options or {}), **aligning}), stream


def _summary(bound, sq: dict) -> dict:
    """`align`'s summary: the leaves in the order its distances come back from the device
    (JAX returns a dict's keys sorted), so the sums run in the same order."""
    return summarise_distances(bound, {p: sq[p] for p in sorted(p for p, _ in bound.shapes) if p in sq})


# ---- align_many, streamed --------------------------------------------------------------------------

class _AlignMany:
    """`align_many(models, mode="mean")` (`engine.many`), streamed: the same steps, each a pass
    over the chunks reading every model.

    - The canonical order: each model's `fingerprint`, from its leaves' signatures gathered chunk
      by chunk (a tie, bitwise-equal models in practice, is broken by `content_digest`, the tied
      models read leaf by leaf).
    - The objective F and each model's distance to the mean: each leaf's squares, as
      `many.total_and_squares` computes them, gathered and added exactly (`math.fsum`), so
      their order does not matter.
    - The medoid's alignment of the others: `_solve_transforms` with the medoid as the anchor.
    - Each sweep aligns each model in turn to the mean of the others as aligned (computed chunk
      by chunk, `read_anchor`), then a pass measures F, and the update is kept only if F falls.
    Each update reads every model twice. The transforms, F and the stop equal `align_many`'s bit
    for bit, over any lanes and processes: every sum runs as in memory, per leaf."""

    def __init__(self, layout: _Layout, sources: Sequence[_Source], chunks, options: AlignOptions, clock, team: Team, lanes: int,
                 tick: Callable[[], None] = _release_freed_memory):
        if options.residual != "none":
            raise StreamingError(f"align='many' with residual={options.residual!r} is not streamed (each of its updates is a descent "
                                 "of its own); merge in memory, or align the residual stream with align='anchor'")
        self.layout, self.sources, self.chunks, self.options, self.clock, self.team, self.lanes, self.tick = (
            layout, list(sources), chunks, options, clock, team, lanes, tick)
        self.mine = team.share(chunks)
        self.globals = [name for name in layout.global_rules if any(not is_head(p) for p in layout.rule_ours[name])]
        self.order = list(range(len(sources)))

    def _names(self, chunk) -> list:
        return [name for layer in chunk for name in self.layout.layer_rules[layer]]

    def _body(self, flat: Mapping) -> dict:
        return {p: x for p, x in flat.items() if not is_head(p)}

    def _read(self, chunk, clock) -> list:
        """Every model's leaves of `chunk` (None: those outside the layers), in the canonical order."""
        names = self.globals if chunk is None else self._names(chunk)
        return [self._body(self.sources[i].leaves(names, clock)) for i in self.order]

    def _moved(self, chunk, flats: list, transforms, clock) -> list:
        """`flats` (canonical order) moved by their transforms (None: as read); `chunk` None: the
        leaves outside the layers, never moved."""
        return [flat if chunk is None or t is None else _moved(self.layout, chunk, flat, t, clock) for flat, t in zip(flats, transforms)]

    def _per_leaf(self, compute: Callable) -> dict:
        """{path: compute(chunk, every model's leaves, clock)[path]} over every leaf, gathered from
        the lanes and processes (process 0's leaves outside the layers too, chunk None)."""
        every = _gathered(self.team, self.mine, self.clock, self.lanes, self.tick, self._read, compute)
        outside = self.team.exchange(lambda: compute(None, self._read(None, self.clock), self.clock) if self.team.lead and self.globals else {})
        return {**every, **outside[0]}

    def objective(self, transforms) -> tuple[float, list]:
        """(F, each model's squared distance to the mean), the models moved by `transforms`."""
        def compute(chunk, flats, clock):
            flats = self._moved(chunk, flats, transforms, clock)
            with clock.phase("distances"):
                _, squares = many_mod.total_and_squares(flats)
                squares = np.asarray(jax.device_get(squares), np.float64)
            return {p: squares[:, j] for j, p in enumerate(flats[0])}

        squares = np.stack(list(self._per_leaf(compute).values()))
        return math.fsum(squares.ravel()), [math.fsum(squares[:, c]) for c in range(len(self.sources))]

    def canonical_order(self) -> list:
        """`many._canonical_order`: the input indices sorted by fingerprint, ties by content."""
        def compute(chunk, flats, clock):  # read in input order (the canonical order is not known yet)
            signed = [leaf_signatures(flat) for flat in flats]
            return {p: [s[p] for s in signed] for p in signed[0]}

        signed = self._per_leaf(compute)
        prints = [signature_digest({p: per_model[i] for p, per_model in signed.items()}) for i in range(len(self.sources))]
        tied = [i for i in range(len(prints)) if prints.count(prints[i]) > 1]
        contents = dict(zip(tied, self.team.exchange(lambda: [self._content_digest(i) for i in tied] if self.team.lead else None)[0]))
        keys = [(prints[i], contents.get(i, "")) for i in range(len(prints))]
        return sorted(range(len(prints)), key=lambda i: keys[i])

    def _content_digest(self, i: int) -> str:
        """`content_digest` of model i's body, read a leaf at a time in its order."""
        source, digest = self.sources[i], hashlib.sha256()
        for path in (p for p in source.shapes if not is_head(p)):
            leaf = source.leaves(source.keys_of[path], self.clock, device=False)[path]
            digest.update(f"{path}|{leaf.dtype}|{leaf.shape}|".encode())
            digest.update(np.ascontiguousarray(leaf).tobytes())
        return digest.hexdigest()

    def solve(self, c: int, transforms) -> dict:
        """Model c (canonical) aligned to the mean of the others as moved by `transforms`."""
        n = len(self.sources)

        def leave_one_out(chunk, names, clock):
            flats = self._moved(chunk, self._read(chunk, clock), transforms, clock)
            with clock.phase("merge"):  # the running sum of the models as `align_many` keeps it
                total, _ = many_mod.total_and_squares(flats)
                return jax.block_until_ready(many_mod.leave_one_out(total, flats[c], n))

        (solved,) = _solve_transforms(self.layout, None, [self.sources[self.order[c]]], self.chunks, self.options, self.clock,
                                      self.tick, self.team, self.lanes, read_anchor=leave_one_out)
        return solved["transforms"]

    def run(self, max_iters: int, tol: float) -> tuple[list, dict]:
        """(each model's transforms, in input order: None for the medoid as it stays;
        {"mode": "many", "objective": F after the initial alignment and each sweep, "stop"})."""
        n = len(self.sources)
        self.order = self.canonical_order()
        _, per_model = self.objective([None] * n)
        medoid = min(range(n), key=lambda c: per_model[c])  # the first minimum, as `align_many`
        others = [c for c in range(n) if c != medoid]
        solved = _solve_transforms(self.layout, self.sources[self.order[medoid]], [self.sources[self.order[c]] for c in others], self.chunks,
                                   self.options, self.clock, self.tick, self.team, self.lanes)
        transforms = [None] * n
        for c, s in zip(others, solved):
            transforms[c] = s["transforms"]
        objective, _ = self.objective(transforms)

        def update(c):
            candidate = transforms[:c] + [self.solve(c, transforms)] + transforms[c + 1:]

            def keep():
                transforms[:] = candidate

            return self.objective(candidate)[0], keep

        objectives, report = many_mod.gauss_seidel(objective, n, update, max_iters, tol)
        _skip(self.tick, 2 * n * (max_iters - (len(objectives) - 1)) * len(self.mine))  # the sweeps it did not need
        out = [None] * n
        for c, i in enumerate(self.order):
            out[i] = transforms[c]
        return out, {"mode": "many", "objective": objectives, "stop": report["stop"]}


# ---- align -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StreamResult:
    """A streaming run's outcome: `path` written, `report` (distances as `align` / the merge
    command report them, "timings": the keys of `timings.TIMINGS`, as `align` reports them),
    `transforms` (per aligned model, over all layers: what `align` returns; with align="many",
    every model's, None for the one that stays as given), `plan`."""

    path: Path
    report: dict
    transforms: list
    plan: StreamPlan


def plan_align(a, b, options: AlignOptions | Mapping | None = None, *, spec=None, stream: StreamOptions | Mapping | None = None,
               **keywords) -> StreamPlan:
    """The plan of `align_to_disk(a, b, options, ...)` from the configs and headers alone."""
    options, stream = split_options(options, stream, keywords)
    residual, residual_sweeps = options.residual, options.residual_sweeps
    sa, sb = _Source(a, "A (the anchor)"), _Source(b, "B")
    try:
        _same_architecture(sa, sb)
        layout = _Layout.of(sb, spec)
        plan = _plan([sa, sb], layout, stream, aligned=1, merging=False, elementwise=True, output=sb, processes=Team.current().count,
                     residual=residual)
        return _with_sweeps(plan, residual=residual, residual_sweeps=residual_sweeps)
    finally:
        sa.close(), sb.close()


def align_to_disk(a, b, out, options: AlignOptions | Mapping | None = None, *, spec=None, stream: StreamOptions | Mapping | None = None,
                  overwrite: bool = False, extra_files=None, progress: Callable[[int, int], None] | None = None, **keywords) -> StreamResult:
    """`align(A, B)` then `save_hf` of B moved, from folder `a` and `b` to folder `out`, a chunk of
    layers at a time (see the module docstring). The options are `align`'s (method "weights";
    residual="rotation" needs folded norm gains, as `align` does). Chunk size: `stream`'s
    `chunk_layers`, else the most layers whose estimated peak fits its `max_memory` bytes, else 4. B's task head is kept, as `rotsym align` keeps it.
    `extra_files`: as `save_hf`'s, or a function of the report returning them (written with the
    checkpoint). `progress(done, total)` is called after every chunk of every pass (`total`: the
    most the run can take; the residual descent may stop sooner). `keywords`: fields of
    `AlignOptions` or of `StreamOptions` (`max_memory=...`), over `options` and `stream`.
    Raises before reading any weight on bad input: architectures that differ, missing or
    truncated shards, an output that exists (without `overwrite`) or does not fit on its disk."""
    start = time.perf_counter()
    team = Team.current()
    with team.together():
        options, stream = split_options(options, stream, keywords)
        sa, sb = _Source(a, "A (the anchor)"), _Source(b, "B")
        try:
            return _align_to_disk(sa, sb, out, team, start, options, spec=spec, stream=stream, overwrite=overwrite, extra_files=extra_files,
                                  progress=progress)
        finally:
            sa.close(), sb.close()


def _align_to_disk(sa: _Source, sb: _Source, out, team: Team, start: float, options: AlignOptions, *, spec, stream: StreamOptions, overwrite,
                   extra_files, progress) -> StreamResult:
    _same_architecture(sa, sb)
    layout = _Layout.of(sb, spec)
    driver.layer_masks(layout.bound, options.layers)  # bad layer indices: the error `align` gives, before any read
    residual = options.residual != "none"
    plan = _plan([sa, sb], layout, stream, aligned=1, merging=False, elementwise=True, output=sb, processes=team.count,
                 residual=options.residual)
    plan = _with_sweeps(plan, residual=options.residual, residual_sweeps=options.residual_sweeps)
    target = _check_output(out, [sa, sb], overwrite, plan.output_bytes)
    team.agree("runs", {"a": str(sa.path), "b": str(sb.path), "out": str(target), "options": options.as_dict(), "plan": plan,
                        "spec": None if spec is None else repr(spec)})
    chunks = layout.chunks(plan.chunk_layers)
    mine = team.share(chunks)  # the chunks this process reads, solves and writes
    tick = _ticker(len(mine) * (plan.passes + plan.passes_per_sweep * plan.max_sweeps) + 1, progress)
    clock = Clock()
    if residual:
        solved = _ResidualDescent(layout, sa, sb, chunks, options, clock, team, plan.in_flight, plan.block_bytes, tick).run()
    else:
        (solved,) = _solve_transforms(layout, sa, [sb], chunks, options, clock, tick, team, plan.in_flight)
    transforms, sq_before = solved["transforms"], solved["sq_before"]
    specs = _out_specs(sb, None)
    writes = [name for chunk in mine for layer in chunk for name in layout.layer_rules[layer]] + (layout.global_rules if team.lead else [])
    residual_stream = _full_stream(layout, sb) if residual else None

    def write_mine(writer) -> dict:
        """This process's chunks (and, process 0, the tensors outside the layers) moved and
        written; the squared distances after, those outside the layers apart, and its timings."""
        def write_share(share, clock, turn):
            sq_after = {}
            for chunk in share:
                names = [name for layer in chunk for name in layout.layer_rules[layer]]
                # the leaves that move: the groups' members, every leaf with the residual stream
                measured = [p for layer in chunk for name in layout.layer_rules[layer] for p in layout.rule_ours[name]] if residual else layout.members(chunk)
                flat_b = sb.leaves(names, clock)
                flat_a = sa.leaves(sorted({k for p in measured for k in sa.keys_of[p]}), clock)
                with turn:
                    moved = _moved(layout, chunk, flat_b, transforms, clock)
                    sq_after.update(_sq(clock, flat_a, moved, measured))
                sq_after.update({p: sq_before[p] for p in moved if p not in measured})
                del flat_b, flat_a  # held while written: the moved leaves only
                for name in names:
                    _write(writer, clock, name, sb.rules[name], moved, sb.stored(name))
                del moved
                tick()
            return sq_after

        sq_after, sq_global = {}, {}
        try:
            for part in _in_flight(mine, write_share, clock, plan.in_flight):
                sq_after.update(part)
            for name in layout.global_rules if team.lead else ():
                sq_global.update(_copy_global(sb, sa, name, writer, plan.block_bytes, clock, transforms.get(RESIDUAL), residual_stream))
            tick()
            writer.finish()
        finally:
            writer.close()
        return {"sq_after": sq_after, "sq_global": sq_global, "timings": clock.report(start)}

    def summarise(every):
        sq_global = {p: v for done in every for p, v in done["sq_global"].items()}
        if not residual:  # left as they were: the same distance before and after
            sq_before.update(sq_global)
        sq_after = {p: v for done in every for p, v in done["sq_after"].items()} | sq_global
        report.update(before_after(_summary(layout.bound, sq_before), _summary(layout.bound, sq_after)))
        if residual:
            report["residual"] = {"distance_per_sweep": solved["distance_per_sweep"]}
        report["timings"] = clock.report(start)
        report["streaming"] = dataclasses.asdict(plan)
        if team.count > 1:
            report["processes"] = {"count": team.count, "timings": [done["timings"] for done in every]}

    report = {}
    path, report = _write_together(
        team, sb.ck, target, {n: d for n, (d, _) in specs.items()},
        lambda tmp, create: _Writer(tmp, sb, specs, stream.max_shard_bytes, create=create, writes=writes), write_mine, summarise,
        extra_files, report, start)
    return StreamResult(path, report, [transforms], plan)


def _sq(clock, flat_a, flat_b, paths) -> dict:
    """{path: squared distance} of `paths`, by `align`'s jitted `sq_dists` (one leaf's sum does
    not depend on which other leaves share the call)."""
    t0 = time.perf_counter()
    out = jax.device_get(sq_dists({p: flat_a[p] for p in paths}, {p: flat_b[p] for p in paths}))
    clock["distances"] += time.perf_counter() - t0
    return out


def _copy_global(source: _Source, anchor: _Source | None, name: str, writer, block_bytes: int, clock, residual=None, stream=None) -> dict:
    """A tensor outside the layers, left as it is (align), or moved by the residual stream's
    transform `residual` (whole then): written back as `save_hf` writes it,
    with its squared distance to the anchor's (body leaves only; None for no anchor). Whole when
    small (the distance as `align` computes it); in row blocks otherwise, the distance summed on
    the host in float64. A stored dtype JAX does not hold (float64 without x64) goes through the
    leaf, as `load_hf` rounds it."""
    rule = source.rules[name]
    shape, stored = source.hf_shape(name), source.stored(name)
    # measured against the anchor's: the body's leaves (not the head, not a pooler the anchor lacks)
    body = [p for p in rule.ours if not is_head(p)] if anchor is not None and name in anchor.rules else []
    canonical = np.dtype(jax.dtypes.canonicalize_dtype(stored)) == stored
    if math.prod(shape) * 4 <= block_bytes or not canonical or len(shape) == 0 or (residual is not None and len(rule.ours) > 1):
        flat = source.leaves([name], clock)
        if residual is not None:
            flat = _on_stream(stream, flat, residual, clock)
        sq = {}
        if anchor is not None and body:
            flat_a = anchor.leaves([name], clock)
            sq = _sq(clock, flat_a, flat, body)
        _write(writer, clock, name, rule, flat, stored)
        return sq
    rows = max(1, block_bytes // (4 * max(1, math.prod(shape[1:]))))
    total = 0.0
    for start in range(0, shape[0], rows):
        span = (start, min(shape[0], start + rows))
        block = source.tensor(name, clock, span)
        if residual is not None:
            block = _moved_rows(rule, stream, residual, block, clock)
        if anchor is not None and body:
            anchor_block = anchor.tensor(name, clock, span)
            with clock.phase("distances"):
                d = (anchor_block.astype(np.float32) - block.astype(np.float32)).astype(np.float64).ravel()
                total += float(np.dot(d, d))
        with clock.phase("write"):
            writer.write_rows(name, span[0], block)
    writer.done(name)
    return {p: total for p in body} if anchor is not None else {}


# ---- statistics (fisher, regmean) ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _StatisticsInputs:
    """What the statistics pass computes: `stats.fisher(ck, params, batches, kind=kind, key=key,
    samples=samples)` (method "fisher") or `stats.grams(ck, params, batches)` ("regmean")."""

    method: str
    batches: list
    kind: str = "empirical"
    key: object = None
    samples: int = 1


def _statistics_inputs(method: str, batches, fisher_kind: str, fisher_key, fisher_samples) -> _StatisticsInputs | None:
    """The checked statistics inputs of `method` (None for a method without statistics), before
    any weight is read."""
    if method not in merge_methods.STATISTICS:
        if batches is not None:
            raise StreamingError(f"method {method!r} takes no statistics from data: batches are for {sorted(merge_methods.STATISTICS)}")
        return None
    if batches is None:
        what = "diagonal Fisher (stats.fisher)" if method == "fisher" else "input Gram matrices (stats.grams)"
        raise StreamingError(
            f"method {method!r} needs statistics from data, each model's {what} computed on it as aligned: pass "
            "batches=[...], the batches of model inputs the in-memory path takes (dicts of input_ids, attention_mask, "
            "labels, or pixel_values); they are computed in a statistics pass that holds one model at a time"
        )
    if isinstance(batches, Mapping) or isinstance(batches, (str, bytes)) or not isinstance(batches, Sequence):
        raise StreamingError(
            f"batches is a {type(batches).__name__}; expected a list of batches (dicts of model inputs): "
            "every model's statistics read them again, so an iterator or generator cannot serve"
        )
    if not batches:
        raise StreamingError("batches is empty: the statistics need at least one batch of model inputs")
    for i, batch in enumerate(batches):
        if not isinstance(batch, Mapping) or not batch:
            raise StreamingError(f"batches[{i}] is {type(batch).__name__ if not isinstance(batch, Mapping) else 'an empty dict'}; "
                                 "expected a dict of model inputs (input_ids, attention_mask, labels, pixel_values...)")
    if method == "fisher":
        try:
            checks.choice("fisher_kind", fisher_kind, stats_mod.FISHER_KINDS)
            if fisher_key is not None:
                checks.prng_key(fisher_key)
        except ValueError as e:
            raise StreamingError(str(e)) from None
        if isinstance(fisher_samples, bool) or not isinstance(fisher_samples, (int, np.integer)) or fisher_samples < 1:
            raise StreamingError(f"fisher_samples={fisher_samples!r}; expected a positive integer (draws per example)")
        if fisher_kind == "empirical":
            unlabelled = [i for i, b in enumerate(batches) if "labels" not in b]
            if unlabelled:
                raise StreamingError(f"fisher_kind='empirical' needs labels: batches {unlabelled[:5]} have no 'labels' "
                                     "(fisher_kind='expected' draws them from the model)")
    return _StatisticsInputs(method, list(batches), fisher_kind, fisher_key, int(fisher_samples))


def _merged_paths(paths, task_head: str) -> list:
    return [p for p in paths if task_head == "merge" or not is_head(p)]


def _is_kernel(path: str, shape) -> bool:
    """A leaf that may carry a RegMean Gram matrix (a Dense kernel, (d_in, d_out)): for the
    estimates, made before the statistics tell which leaves have one."""
    return path.endswith("/kernel") and len(shape) == 2


def _statistics_budget(sources: Sequence[_Source], layout: _Layout, inputs: _StatisticsInputs, *, aligned: bool, task_head: str,
                       block_bytes: int) -> dict:
    """Estimates (bytes) for a statistics run: "peak", of the statistics pass (the runtime, then
    for the biggest model: its tensors as loaded, its moved layers, its statistics, and the
    working set of the statistics on one batch: the per-example squared gradients, B x draws
    copies of the params in float32 for the Fisher, and the activations of the forward (and
    backward) pass); "in_memory", what the in-memory path holds on top of the models (every
    model's statistics, one working set); "scratch", the statistics spilled to disk; "per_layer"
    and "global", the statistics pass 2 reads with each layer (all models) and with the leaves
    outside the layers."""
    anchor, n = sources[0], len(sources)
    fisher = inputs.method == "fisher"

    def stats_bytes(path, shape):
        if fisher:
            return 4 * math.prod(shape)
        return 4 * shape[0] ** 2 if _is_kernel(path, shape) else 0

    per_layer = []
    for layer in layout.layers:
        paths = [p for name in layout.layer_rules[layer] for p in layout.rule_ours[name]]
        per_layer.append(n * sum(stats_bytes(p, anchor.shapes[p]) for p in _merged_paths(paths, task_head)))
    blocked = _blocked_globals(layout, sources, block_bytes, lambda name: fisher)
    whole = [p for name in layout.global_rules if name not in blocked for p in layout.rule_ours[name]]
    global_ = n * max(sum(stats_bytes(p, anchor.shapes[p]) for p in _merged_paths(whole, task_head)), block_bytes if blocked else 0)

    config = anchor.ck.model_config
    sizes, tokens = [1], 1
    for batch in inputs.batches:
        first = np.shape(next(iter(batch.values())))
        sizes.append(first[0] if first else 1)
        if "input_ids" in batch and np.ndim(batch["input_ids"]) >= 2:
            tokens = max(tokens, np.shape(batch["input_ids"])[-1])
        elif "pixel_values" in batch and getattr(config, "patch_size", None):
            image, patch = getattr(config, "image_size", 0), getattr(config, "patch_size", 1)
            side = (image[0] if isinstance(image, (list, tuple)) else image) // (patch[0] if isinstance(patch, (list, tuple)) else patch)
            tokens = max(tokens, side * side + 1)
    batch_size = max(sizes)
    heads = layout.bound.attention[0].geometry.num_heads if layout.bound.attention else 1
    width = getattr(config, "hidden_size", None) or (layout.bound.attention[0].geometry.num_heads * layout.bound.attention[0].geometry.head_dim
                                                     if layout.bound.attention else 1)
    ffn = max((g.size for g in layout.bound.perms), default=4 * width)
    classes = (getattr(config, "vocab_size", 0) if anchor.ck.layout.head == "lm" else getattr(config, "num_labels", 0)) or 1
    # float32 activations of one batch: per token and layer the attention's and FFN's intermediates
    # (and the attention scores), then the logits and their log-softmax.
    activations = 4 * batch_size * tokens * (len(layout.layers) * (16 * width + 4 * ffn + 2 * heads * tokens) + 3 * classes)
    draws = 1 if inputs.kind == "empirical" else (inputs.samples if inputs.key is not None else classes)
    peak = values_all = work_max = scratch = 0
    for i, s in enumerate(sources):
        stored = sum(math.prod(s.hf_shape(name)) * s.stored(name).itemsize for name in s.rules)
        moved = sum(math.prod(s.hf_shape(name)) * s.stored(name).itemsize for name in s.rules if name not in layout.global_rules)
        entries = sum(math.prod(shape) for shape in s.shapes.values())
        values = 4 * entries if fisher else sum(4 * shape[0] ** 2 for p, shape in s.shapes.items() if _is_kernel(p, shape))
        # Fisher: per example the squared gradients of every draw, B examples at once (vmapped),
        # the batch's sum and the running total; the forward and backward activations. Grams: the
        # batch's Grams and the forward's activations (the recorded layer inputs among them).
        # Measured on a 28M-parameter Llama (4 layers, vocabulary 16000; 64 tokens), the whole run's
        # peak RSS: Fisher 1.51 / 1.96 GiB for B = 4 / 8 (estimated 1.76 / 2.39), Grams 1.03 GiB
        # for B = 4 (estimated 1.04).
        work = 4 * entries * (batch_size * draws + 2) + 2 * activations if fisher else values + activations
        # Loading: the biggest tensor's host read and its device copy, while the model fills in.
        loading = 2 * max((math.prod(s.hf_shape(name)) * s.stored(name).itemsize for name in s.rules), default=0)
        peak = max(peak, stored + (moved if aligned and i > 0 else 0) + values + max(work, loading))
        values_all, work_max = values_all + values, max(work_max, work)
        scratch += sum(stats_bytes(p, shape) for p, shape in s.shapes.items() if task_head == "merge" or not is_head(p))
    return {"peak": int(runtime_bytes() + peak), "in_memory": int(values_all + work_max), "scratch": int(scratch),
            "per_layer": per_layer, "global": int(global_)}


def _plan_merge(sources, layout, method, stream: StreamOptions, *, aligned: bool, moved: int, inputs: _StatisticsInputs | None, task_head: str,
                out_dtype, processes: int = 1, residual: str = "none") -> StreamPlan:
    """`_plan` of a merge; with statistics, the statistics pass too (refused first when it does
    not fit `max_memory`: no chunk size makes it smaller). `residual`: the alignment's residual mode."""
    if inputs is None:
        return _plan(sources, layout, stream, aligned=aligned, moved=moved, merging=True, elementwise=_row_blocked(streamed_method(method)),
                     out_dtype=out_dtype, processes=processes, residual=residual)
    budget = _statistics_budget(sources, layout, inputs, aligned=aligned, task_head=task_head,
                                block_bytes=DEFAULT_BLOCK_BYTES if stream.block_bytes is None else stream.block_bytes)
    if stream.max_memory is not None and budget["peak"] > stream.max_memory:
        raise StreamingError(
            f"max_memory={stream.max_memory / 2**30:.2f} GiB is below what the statistics pass of {method} needs, about "
            f"{budget['peak'] / 2**30:.2f} GiB: it holds one model whole at a time with its statistics and the "
            "forward/backward working set of one batch (smaller batches need less); chunking the layers does not reduce it"
        )
    # Fisher is entry by entry: big leaves outside the layers go in row blocks. RegMean solves
    # kernels whole; counted whole here, though its embeddings go in row blocks.
    # one chunk at a time: the merge reads the statistics' spill and times on the run's one clock
    plan = _plan(sources, layout, stream, aligned=aligned, moved=moved, merging=True, elementwise=method == "fisher", out_dtype=out_dtype,
                 max_in_flight=1,
                 statistics_per_layer=budget["per_layer"], statistics_global=budget["global"], residual=residual)
    return dataclasses.replace(plan, peak_bytes=max(plan.peak_bytes, budget["peak"]), statistics_bytes=budget["peak"],
                               in_memory_bytes=plan.in_memory_bytes + budget["in_memory"], scratch_bytes=budget["scratch"])


def _check_statistics_models(sources: Sequence[_Source], task_head: str, inputs: _StatisticsInputs) -> None:
    """Before any weight is read: the task heads merge (task_head="merge") only when they have
    the same leaves and shapes, and the batches' token ids lie in the anchor's vocabulary."""
    try:
        checks.mergeable([(s.what, unflatten(shape_stand_ins_of(s.shapes))) for s in sources], task_head)
        for i, batch in enumerate(inputs.batches):
            hf.check_token_ids(sources[0].ck.model_config, batch, f"batches[{i}]")
    except ValueError as e:
        raise StreamingError(str(e)) from None


class _Spill:
    """Each model's statistics on disk, leaf by leaf (a safetensors file per model, written with
    `hf.ShardWriter`, read back with plain reads), in a temporary folder beside the output that
    `remove()` deletes (marked with its owner: a killed run's is removed by the next, `owned.sweep`)."""

    def __init__(self, parent: Path):
        parent.mkdir(parents=True, exist_ok=True)
        owned.sweep(parent)
        self.root = owned.temp_folder(parent, ".rotsym-stats-")
        self.files: list = []

    def add(self, values: Mapping, clock) -> None:
        """Spill one model's statistics: {name: array}, each converted to the host as it is written."""
        folder = self.root / f"model-{len(self.files)}"
        folder.mkdir()
        specs = {name: (np.dtype(x.dtype), tuple(np.shape(x))) for name, x in values.items()}
        writer = hf.ShardWriter(folder, specs, 2**62)  # one file
        try:
            for name, x in values.items():
                with clock.phase("transfer"):
                    host = np.ascontiguousarray(np.asarray(jax.device_get(x)))
                with clock.phase("write"):
                    writer.write(name, host)
            writer.finish()
        finally:
            writer.close()
        self.files.append(hf.TensorFiles(folder))

    def names(self, i: int) -> set:
        return self.files[i].names()

    def read(self, i: int, name: str, clock, rows=None) -> np.ndarray:
        t0 = time.perf_counter()
        out = self.files[i].read(name, rows)
        clock["read"] += time.perf_counter() - t0
        return out

    def remove(self) -> None:
        for f in self.files:
            f.close()
        owned.discard(self.root)


def _rows_name(hf_name: str) -> str:
    """The spill's name of a row-blocked tensor's Fisher, stored in the HF tensor's layout."""
    return f"rows:{hf_name}"


class _StatisticsMerge:
    """The statistics pass (`run`) and pass 2's merge of a chunk or a row block from the spilled
    statistics (`merged`), with the kernels and options of `merge.fisher` / `merge.regmean`."""

    def __init__(self, inputs: _StatisticsInputs, spill: _Spill, *, task_head: str, weights, params: Mapping, clock):
        self.inputs, self.spill, self.task_head, self.clock = inputs, spill, task_head, clock
        declared = merge_methods.METHODS[inputs.method].params
        options = {k: params.get(k, p.default) for k, p in declared.items()}
        if inputs.method == "fisher":  # as merge.fisher checks them
            self.eps = checks.scalar("eps", options["eps"], low=0.0, low_open=True)
            self.weights = weights
        else:
            self.alpha = checks.scalar("alpha", options["alpha"], low=0.0, high=1.0, low_open=True)
            self.jitter = checks.scalar("jitter", options["jitter"], low=0.0)
        self.blocked: list = []  # Fisher: HF names whose Fisher is spilled in rows
        self.grams: set = set()  # RegMean: the kernels with Gram matrices
        self.report: dict = {}

    def blockable(self, name: str, rule_ours) -> bool:
        """Whether a big tensor outside the layers may go in row blocks: any for Fisher (entry by
        entry); for RegMean one without a Gram matrix (uniformly averaged)."""
        return self.inputs.method == "fisher" or not any(p in self.grams for p in rule_ours)

    def run(self, sources: Sequence[_Source], layout: _Layout, transforms: Sequence, tick) -> None:
        """Each model in turn: loaded whole, moved by its transforms as `align` moves it (its own
        task head kept, as the merge command keeps it), its statistics computed on it and spilled;
        dropped before the next is loaded."""
        clock, inputs = self.clock, self.inputs
        anchor = sources[0]
        blocked_paths = {anchor.rules[name].ours[0]: name for name in self.blocked}
        counts = []
        for i, source in enumerate(sources):
            t0 = time.perf_counter()
            ck = hf.load_hf(source.path, allow_nonfinite=source.allow_nonfinite, record=source.record)
            clock["read"] += time.perf_counter() - t0
            if transforms[i] is not None:
                body = {k: v for k, v in ck.params.items() if k != "head"}
                head = {k: v for k, v in ck.params.items() if k == "head"}
                moved = clock.timed("apply", apply_unchecked, layout.bound, body, transforms[i])
                ck = dataclasses.replace(ck, params={**moved, **head})  # the weights as loaded are dropped
                del body, head, moved
            t0 = time.perf_counter()
            if inputs.method == "fisher":
                st = stats_mod.fisher(ck, ck.params, inputs.batches, kind=inputs.kind, key=inputs.key, samples=inputs.samples)
                values = flatten(st.values)
            else:
                st = stats_mod.grams(ck, ck.params, inputs.batches)
                values = dict(st.values)
            keep = set(_merged_paths(values, self.task_head))
            values = {p: jax.block_until_ready(x) for p, x in values.items() if p in keep}
            clock["statistics"] += time.perf_counter() - t0
            spilled = {}
            for path, x in values.items():
                if path in blocked_paths:  # its Fisher in the HF tensor's layout, read in the weights' row blocks
                    spilled[_rows_name(blocked_paths[path])] = source.rules[blocked_paths[path]].to_hf((np.asarray(x),))
                else:
                    spilled[path] = x
            self.spill.add(spilled, clock)
            counts.append(st.count)
            del ck, st, values, spilled
            tick()
        if inputs.method == "regmean":
            self.grams = self.spill.names(0)
            for i in range(1, len(sources)):
                if self.spill.names(i) != self.grams:
                    raise StreamingError(f"model {i} has Gram matrices for other kernels than model 0: "
                                         f"{sorted(self.spill.names(i) ^ self.grams)[:5]}")
        self.report = {"method": inputs.method, "examples": counts[0],
                       **({"kind": inputs.kind} if inputs.method == "fisher" else {})}

    def merged(self, flats: Sequence[Mapping], rows=None) -> dict:
        """The merge of `flats` (every model's {path: leaf} of a chunk, or of a row block `rows`
        = (HF name, (start, stop))), on the host: `merge.fisher` / `merge.regmean`'s arithmetic
        with the spilled statistics; leaves not merged (the anchor's head) the anchor's."""
        clock, spill, n = self.clock, self.spill, len(flats)
        anchor = flats[0]
        paths = _merged_paths(anchor, self.task_head)
        models = [{p: f[p] for p in paths} for f in flats]
        if self.inputs.method == "fisher":
            if rows is None:
                values = [{p: spill.read(i, p, clock) for p in paths} for i in range(n)]
            else:
                values = [{p: spill.read(i, _rows_name(rows[0]), clock, rows[1]) for p in paths} for i in range(n)]
            weights = checks.weights(self.weights, n)
            merged = clock.timed("merge", merge_methods.fisher_leaves, models, values, weights, self.eps)
        else:
            kernels = [p for p in paths if p in self.grams]
            grams = [{p: merge_methods.to_jax(spill.read(i, p, clock)) for p in kernels} for i in range(n)]
            merged = clock.timed("merge", merge_methods.regmean_leaves, models, grams, self.alpha, self.jitter)
        return jax.device_get({p: merged[p] if p in merged else anchor[p] for p in anchor})


# ---- merge -----------------------------------------------------------------------------------------

def plan_merge(method: str, models: Sequence, *, base=None, align: str = "anchor", dtype=None, stream: StreamOptions | Mapping | None = None,
               task_head: str = "anchor", batches=None,
               fisher_kind: str = "empirical", fisher_key=None, fisher_samples: int = 1, residual: str = "none",
               residual_sweeps: int = 8, **stream_keywords) -> StreamPlan:
    """The plan of `merge_to_disk(method, models, ...)` from the configs and headers alone (and,
    for fisher / regmean, the shapes of `batches`: the statistics pass's estimate); `residual`:
    the alignment's residual mode."""
    inputs = _statistics_inputs(method, batches, fisher_kind, fisher_key, fisher_samples)
    sources = [_Source(m, f"model {i}") for i, m in enumerate(models)] + ([] if base is None else [_Source(base, "base")])
    try:
        for s in sources[1:]:
            _same_architecture(sources[0], s)
        layout = _Layout.of(sources[0], None)
        residual = residual if align == "anchor" else "none"
        plan = _plan_merge(sources, layout, method, _stream_options(stream, stream_keywords), aligned=align != "none", moved=_moved_models(align, len(models)),
                           inputs=inputs, task_head=task_head, out_dtype=dtype, processes=Team.current().count, residual=residual)
        return _with_sweeps(plan, align=align, residual=residual, residual_sweeps=residual_sweeps, models=len(models))
    finally:
        for s in sources:
            s.close()


def merge_to_disk(
    method: str, models: Sequence, out, *, base=None, align: str = "anchor", align_options: Mapping | None = None,
    weights: Sequence[float] | None = None, seed: int = 0, task_head: str = "anchor", dtype=None, params: Mapping | None = None,
    stream: StreamOptions | Mapping | None = None, overwrite: bool = False, extra_files=None, progress: Callable[[int, int], None] | None = None,
    batches: Sequence[Mapping] | None = None, fisher_kind: str = "empirical", fisher_key=None, fisher_samples: int = 1, **stream_keywords,
) -> StreamResult:
    """`rotsym merge` from disk to disk a chunk of layers at a time: the models (folders; the
    first is the anchor) aligned to the anchor (align="anchor", `align_options` as `align`'s, the
    residual stream included), to one another (align="many": `align_many`'s sweeps, `_AlignMany`)
    or not ("none"), merged by `method` (one of `streamed_methods()`, its options in `params`; dare
    draws from `jax.random.key(seed)`), written to `out` in the anchor's dtypes (or `dtype`).
    The weights equal `merge.merge` on the in-memory aligned models, saved by `save_hf`, bit for
    bit. report: {"alignment": as the merge command's, "merged_distance_to_anchor", "timings"}.

    fisher and regmean (`merge.STATISTICS`) need `batches`: a list of dicts of model inputs, as
    `stats.fisher` / `stats.grams` take them. Each model's statistics are computed on it as aligned
    in a statistics pass that holds one model at a time (`stats.fisher(ck, aligned, batches,
    kind=fisher_kind, key=fisher_key, samples=fisher_samples)`, or `stats.grams(ck, aligned,
    batches)`), spilled to a temporary folder beside `out` and read back chunk by chunk; the
    weights equal `merge.fisher` / `merge.regmean` (with `weights`, `params`) on the in-memory
    aligned models with those statistics, bit for bit. The report then has "statistics"."""
    start = time.perf_counter()
    team = Team.current()
    with team.together():
        return _merge_to_disk(method, models, out, team, start, base=base, align=align, align_options=align_options, weights=weights,
                              seed=seed, task_head=task_head, dtype=dtype, params=params, stream=_stream_options(stream, stream_keywords),
                              overwrite=overwrite, extra_files=extra_files, progress=progress, batches=batches, fisher_kind=fisher_kind, fisher_key=fisher_key,
                              fisher_samples=fisher_samples)


def _merge_to_disk(method, models, out, team: Team, start: float, *, base, align, align_options, weights, seed, task_head, dtype, params,
                   stream: StreamOptions, overwrite, extra_files, progress, batches, fisher_kind, fisher_key, fisher_samples) -> StreamResult:
    m = streamed_method(method)
    statistics_inputs = _statistics_inputs(method, batches, fisher_kind, fisher_key, fisher_samples)
    if statistics_inputs is not None and team.count > 1:
        raise StreamingError(f"method {method!r} over {team.count} processes: its statistics pass holds each model whole, which the "
                             "processes do not split; run it in one process")
    given = {k for k, v in (("base", base), ("weights", weights)) if v is not None} | ({"key"} if "key" in m.needs else set())
    given |= {m.statistics} if m.statistics else set()  # computed by the statistics pass
    try:
        checks.choice("align", align, ALIGN_MODES)
        params = m.bind(len(models), params, given)
        if weights is not None:
            checks.weights(weights, len(models))
    except InputError as e:
        raise StreamingError(str(e)) from None
    checks.choice("task_head", task_head, checks.TASK_HEAD)
    options = streamed_options(align_options) if align != "none" else None
    out_dtype = None if dtype is None else hf.floating_dtype(dtype)
    sources = [_Source(p, f"model {i}") for i, p in enumerate(models)]
    base_source = None if base is None else _Source(base, "base")
    everything = sources + ([base_source] if base_source else [])
    spill = None
    try:
        for s in everything[1:]:
            _same_architecture(sources[0], s)
        anchor = sources[0]
        layout = _Layout.of(anchor, None)
        if options is not None:
            driver.layer_masks(layout.bound, options.layers)
        if statistics_inputs is not None:
            _check_statistics_models(sources, task_head, statistics_inputs)
        residual = options is not None and options.residual != "none"  # the models' leaves outside the layers move too
        plan = _plan_merge(everything, layout, method, stream, aligned=align != "none", moved=_moved_models(align, len(models)),
                           inputs=statistics_inputs, task_head=task_head, out_dtype=out_dtype, processes=team.count, residual=options.residual if residual else "none")
        plan = _with_sweeps(plan, align=align, residual=options.residual if residual else "none",
                            residual_sweeps=options.residual_sweeps if options is not None else 8, models=len(models))
        target = _check_output(out, everything, overwrite, plan.output_bytes, plan.scratch_bytes)
        team.agree("runs", {"models": [str(s.path) for s in everything], "out": str(target), "method": method, "params": params,
                            "weights": weights, "seed": seed, "task_head": task_head, "dtype": str(out_dtype), "align": align,
                            "options": None if options is None else options.as_dict(), "plan": plan})
        chunks = layout.chunks(plan.chunk_layers)
        mine = team.share(chunks)  # the chunks this process reads, merges and writes
        tick = _ticker(len(mine) * (plan.passes + plan.passes_per_sweep * plan.max_sweeps) + 1 + (len(sources) if statistics_inputs is not None else 0),
                       progress)
        clock = Clock()
        key = jax.random.key(seed) if "key" in m.needs else None
        inputs = {"weights": weights} if weights is not None else {}
        many = None
        if align == "many":  # every model moved, the first too: no distances to an anchor
            transforms, many = _AlignMany(layout, sources, chunks, options, clock, team, plan.in_flight, tick).run(*MANY_STOPS)
            solved = []
        else:
            if residual:  # each model's descent in turn
                solved = [_ResidualDescent(layout, anchor, other, chunks, options, clock, team, plan.in_flight, plan.block_bytes, tick).run()
                          for other in sources[1:]]
            else:
                solved = _solve_transforms(layout, anchor, sources[1:], chunks, options, clock, tick, team, plan.in_flight) if options is not None else []
            transforms = [None] + ([s["transforms"] for s in solved] if solved else [None] * (len(sources) - 1))
        statistics = None
        if statistics_inputs is not None:  # the statistics pass: one model at a time, spilled beside the output
            spill = _Spill(target.parent)
            statistics = _StatisticsMerge(statistics_inputs, spill, task_head=task_head, weights=weights, params=params, clock=clock)
            if method == "fisher":
                statistics.blocked = _blocked_globals(layout, sources, plan.block_bytes, lambda name: True)
            statistics.run(sources, layout, transforms, tick)
        report = {}
        specs = _out_specs(anchor, out_dtype)
        writes = [name for chunk in mine for layer in chunk for name in layout.layer_rules[layer]] + (layout.global_rules if team.lead else [])

        def merged_of(flats, base_flat, rows=None, clock=clock):
            if statistics is not None:
                return statistics.merged(flats, rows)
            nested = [unflatten(f) for f in flats]
            extra = {} if base_flat is None else {"base": unflatten(base_flat)}
            if key is not None:
                extra["key"] = key
            out = clock.timed("merge", merge_methods.merge, method, nested, task_head=task_head, **extra, **inputs, **(params or {}))
            with clock.phase("transfer"):
                return jax.device_get(flatten(out))

        def write_mine(writer) -> dict:
            """This process's chunks (and, process 0, the tensors outside the layers) merged and
            written; the squared distances (those outside the layers before alignment apart)."""
            def merge_share(share, clock, turn):
                sq_after, sq_merged = [{} for _ in solved], {}
                for chunk in share:
                    names = [name for layer in chunk for name in layout.layer_rules[layer]]
                    # the leaves that move: the groups' members, every leaf with the residual stream
                    members = [p for name in names for p in layout.rule_ours[name]] if residual else layout.members(chunk)
                    flats = [s.leaves(names, clock) for s in sources]
                    base_flat = None if base_source is None else base_source.leaves(names, clock)
                    with turn:
                        anchor_flat = flats[0]  # as read: the merge's distance is to the anchor as given
                        for i in range(len(flats)):
                            if transforms[i] is not None:
                                flats[i] = _moved(layout, chunk, flats[i], transforms[i], clock)
                            if transforms[i] is not None and solved:
                                sq_after[i - 1].update(_sq(clock, flats[0], flats[i], members))
                                sq_after[i - 1].update({p: solved[i - 1]["sq_before"][p] for p in flats[i] if p not in members})
                        merged = merged_of(flats, base_flat, clock=clock)
                        sq_merged.update(_merged_sq(anchor_flat, merged, clock))
                        del anchor_flat
                    del flats, base_flat  # held while written: the merged leaves only
                    for name in names:
                        _write(writer, clock, name, anchor.rules[name], merged, specs[name][0])
                    del merged
                    tick()
                return sq_after, sq_merged

            sq_after, sq_merged, sq_global = [{} for _ in solved], {}, [{} for _ in solved]
            try:
                for after, merged in _in_flight(mine, merge_share, clock, plan.in_flight):
                    for i, sq in enumerate(after):
                        sq_after[i].update(sq)
                    sq_merged.update(merged)
                if team.lead:
                    _merge_globals(layout, sources, base_source, merged_of, method, task_head, writer, specs, plan.block_bytes, clock,
                                   sq_merged, sq_global, sq_after, transforms if solved else [None] * len(sources),
                                   None if statistics is None else (lambda name: statistics.blockable(name, anchor.rules[name].ours)))
                tick()
                writer.finish()
            finally:
                writer.close()
            return {"sq_after": sq_after, "sq_merged": sq_merged, "sq_global": sq_global, "timings": clock.report(start)}

        def summarise(every):
            sq_after = [{p: v for done in every for p, v in done["sq_after"][i].items()} for i in range(len(solved))]
            sq_merged = {p: v for done in every for p, v in done["sq_merged"].items()}
            for i, s in enumerate(solved):
                s["sq_before"].update({p: v for done in every for p, v in done["sq_global"][i].items()})
            full = bind(hf.spec_for(anchor.ck), unflatten(shape_stand_ins_of(anchor.shapes)))
            alignment = many or ({"mode": "none"} if options is None else {"mode": "anchor", "distances": [
                before_after(_summary(layout.bound, s["sq_before"]), _summary(layout.bound, after)) for s, after in zip(solved, sq_after)]})
            report.update({"alignment": alignment,
                           "merged_distance_to_anchor": summarise_distances(full, {p: sq_merged[p] for p, _ in full.shapes})["total"]})
            if statistics is not None:
                report["statistics"] = statistics.report
            report["timings"] = clock.report(start)
            report["streaming"] = dataclasses.asdict(plan)
            if team.count > 1:
                report["processes"] = {"count": team.count, "timings": [done["timings"] for done in every]}

        path, report = _write_together(
            team, anchor.ck, target, {n: d for n, (d, _) in specs.items()},
            lambda tmp, create: _Writer(tmp, anchor, specs, stream.max_shard_bytes, create=create, writes=writes), write_mine, summarise,
            extra_files, report, start)
        return StreamResult(path, report, transforms if many else [t for t in transforms[1:] if t is not None], plan)
    finally:
        if spill is not None:
            spill.remove()
        for s in everything:
            s.close()


def shape_stand_ins_of(shapes: Mapping) -> dict:
    return {p: np.broadcast_to(np.zeros((), np.int8), s) for p, s in shapes.items()}


def _merged_sq(anchor_flat: Mapping, merged: Mapping, clock) -> dict:
    """{path: squared distance of the merge to the anchor}, on the host (the merge is there)."""
    with clock.phase("transfer"):
        anchor_host = jax.device_get({p: anchor_flat[p] for p in merged})
    with clock.phase("distances"):
        return {p: host_sq_dist(np.asarray(anchor_host[p]), np.asarray(merged[p])) for p in merged}


def _blocked_globals(layout, sources, block_bytes, blockable: Callable[[str], bool]) -> list[str]:
    """The tensors outside the layers that go in row blocks: bigger than `block_bytes` in float32,
    one leaf each, stored in a dtype JAX holds, in every model, and `blockable(name)` (the
    method's arithmetic on that tensor is entry by entry)."""
    anchor = sources[0]
    blocked = []
    for name in layout.global_rules:
        rule = anchor.rules[name]
        shape = anchor.hf_shape(name)
        canonical = all(np.dtype(jax.dtypes.canonicalize_dtype(s.stored(name))) == s.stored(name) for s in sources if name in s.rules)
        big = math.prod(shape) * 4 > block_bytes and len(shape) > 0
        if big and blockable(name) and len(rule.ours) == 1 and canonical and all(name in s.rules for s in sources):
            blocked.append(name)
    return blocked


def _merge_globals(layout, sources, base_source, merged_of, method, task_head, writer, specs, block_bytes, clock,
                   sq_merged, sq_before, sq_after, transforms, blockable=None):
    """The tensors outside the layers (never moved by the per-layer groups; by a residual
    transform, whole): small ones merged together, as `merge` does; big ones of an elementwise
    method (`blockable`, default: `_row_blocked`) in row blocks,
    `merged_of(blocks, base, (name, rows))`."""
    anchor = sources[0]
    row_blocked = _row_blocked(merge_methods.METHODS[method])
    blocked = _blocked_globals(layout, sources, block_bytes, blockable or (lambda name: row_blocked))
    streams = [None if t is None or RESIDUAL not in t else _full_stream(layout, s) for s, t in zip(sources, transforms)]
    whole = [name for name in layout.global_rules if name not in blocked]
    # Whole: every model's own global leaves (heads may differ when the anchor's is kept).
    flats = [s.leaves([n for n in whole if n in s.rules], clock) for s in sources]
    for i in range(1, len(flats)):
        if transforms[i] is not None:
            body = {p for p in flats[i] if not is_head(p) and p in flats[0]}  # not a pooler the anchor lacks
            if RESIDUAL in transforms[i]:  # moved along the stream; their distances before are the descent's
                flats[i] = _on_stream(streams[i], flats[i], transforms[i][RESIDUAL], clock)
                sq_after[i - 1].update(_sq(clock, flats[0], flats[i], sorted(body)))
                continue
            sq = _sq(clock, flats[0], flats[i], sorted(body))
            sq_before[i - 1].update(sq)
            sq_after[i - 1].update(sq)
    base_flat = None
    if base_source is not None:
        base_flat = base_source.leaves([n for n in whole if n in base_source.rules], clock)
        if task_head == "anchor":  # as the merge command gives the base the anchor's head
            base_flat = {**{p: x for p, x in base_flat.items() if not is_head(p)}, **{p: x for p, x in flats[0].items() if is_head(p)}}
    if whole:
        merged = merged_of(flats, base_flat)
        sq_merged.update(_merged_sq(flats[0], merged, clock))
        for name in whole:
            _write(writer, clock, name, anchor.rules[name], merged, specs[name][0])
    del flats, base_flat
    for name in blocked:
        path = anchor.rules[name].ours[0]
        shape = anchor.hf_shape(name)
        rows = max(1, block_bytes // (4 * max(1, math.prod(shape[1:]))))
        totals = {"merged": 0.0, **{i: 0.0 for i in range(1, len(sources))}}
        for start in range(0, shape[0], rows):
            span = (start, min(shape[0], start + rows))
            blocks = [s.tensor(name, clock, span) for s in sources]
            blocks = [b if stream is None else _moved_rows(s.rules[name], stream, t[RESIDUAL], b, clock)
                      for b, s, t, stream in zip(blocks, sources, transforms, streams)]
            with clock.phase("distances"):
                for i in range(1, len(sources)):
                    if transforms[i] is not None and not is_head(path):
                        d = (blocks[0].astype(np.float32) - blocks[i].astype(np.float32)).astype(np.float64).ravel()
                        totals[i] += float(np.dot(d, d))
            base_block = None
            if base_source is not None:
                base_block = {path: blocks[0] if (task_head == "anchor" and is_head(path)) else base_source.tensor(name, clock, span)}
            merged = merged_of([{path: b} for b in blocks], base_block, (name, span))[path]
            with clock.phase("distances"):
                d = (np.asarray(blocks[0], np.float32) - np.asarray(merged, np.float32)).astype(np.float64).ravel()
                totals["merged"] += float(np.dot(d, d))
            with clock.phase("write"):
                writer.write_rows(name, span[0], np.ascontiguousarray(np.asarray(merged).astype(specs[name][0], copy=False)))
            del blocks, base_block, merged, d  # before the next block is read: one block's arrays at a time
        writer.done(name)
        sq_merged[path] = totals["merged"]
        for i in range(1, len(sources)):
            if transforms[i] is not None and not is_head(path):
                if RESIDUAL not in transforms[i]:  # else moved: its distance before is the descent's
                    sq_before[i - 1][path] = totals[i]
                sq_after[i - 1][path] = totals[i]


__all__ = ["StreamOptions", "StreamPlan", "StreamResult", "StreamingError", "align_to_disk", "merge_to_disk", "plan_align", "plan_merge",
           "available_memory", "streamed_method", "streamed_methods"]
