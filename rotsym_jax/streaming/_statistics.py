"""Fisher and RegMean streamed: the statistics pass, one model at a time, spilled beside the output."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import numpy as np

from .. import checks, owned
from ..checks import is_head
from ..engine.groups import apply_unchecked
from ..io import hf
from ..io.memory import runtime_bytes, size_text
from ..merging import arithmetic
from ..merging import methods as merge_methods
from ..merging import stats as stats_mod
from ..options import DEFAULT_BLOCK_BYTES, StreamOptions
from ..pytree import flatten, unflatten
from ._common import BudgetError, StreamingError, merges_in_row_blocks, streamed_method
from ._lanes import blocked_globals
from ._plan import StreamPlan, Work, plan_stream
from ._source import Layout, Source, shape_stand_ins_of

# ---- statistics (fisher, regmean) ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StatisticsInputs:
    """What the statistics pass computes: `stats.fisher(ck, params, batches, kind=kind, key=key,
    samples=samples)` (method "fisher") or `stats.grams(ck, params, batches)` ("regmean")."""

    method: str
    batches: list
    kind: str = "empirical"
    key: object = None
    samples: int = 1


def statistics_inputs_of(method: str, batches, fisher_kind: str, fisher_key, fisher_samples, *,
                         aligning_from_data: bool = False) -> StatisticsInputs | None:
    """The checked statistics inputs of `method` (None for a method without statistics), before
    any weight is read. `aligning_from_data`: the batches drive the alignment too (method="activations")."""
    if method not in merge_methods.STATISTICS:
        if batches is not None and not aligning_from_data:
            raise StreamingError(f"method {method!r} takes no statistics from data: batches are for {sorted(merge_methods.STATISTICS)} "
                                 "and for an alignment from activations")
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
    return StatisticsInputs(method, list(batches), fisher_kind, fisher_key, int(fisher_samples))


def merged_paths(paths, task_head: str) -> list:
    return [p for p in paths if task_head == "merge" or not is_head(p)]


def is_kernel(path: str, shape) -> bool:
    """A leaf that may carry a RegMean Gram matrix (a Dense kernel, (d_in, d_out)): for the
    estimates, made before the statistics tell which leaves have one."""
    return path.endswith("/kernel") and len(shape) == 2


def statistics_budget(sources: Sequence[Source], layout: Layout, inputs: StatisticsInputs, *, aligned: bool, task_head: str,
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
        return 4 * shape[0] ** 2 if is_kernel(path, shape) else 0

    per_layer = []
    for layer in layout.layers:
        paths = [p for name in layout.layer_rules[layer] for p in layout.rule_ours[name]]
        per_layer.append(n * sum(stats_bytes(p, anchor.shapes[p]) for p in merged_paths(paths, task_head)))
    blocked = blocked_globals(layout, sources, block_bytes, lambda name: fisher)
    whole = [p for name in layout.global_rules if name not in blocked for p in layout.rule_ours[name]]
    global_ = n * max(sum(stats_bytes(p, anchor.shapes[p]) for p in merged_paths(whole, task_head)), block_bytes if blocked else 0)

    activations, batch_size = forward_bytes(anchor, layout, inputs.batches), largest_batch(inputs.batches)
    draws = 1 if inputs.kind == "empirical" else (inputs.samples if inputs.key is not None else forward_classes(anchor))
    peak = values_all = work_max = scratch = 0
    for i, s in enumerate(sources):
        stored = sum(math.prod(s.hf_shape(name)) * s.stored(name).itemsize for name in s.rules)
        moved = sum(math.prod(s.hf_shape(name)) * s.stored(name).itemsize for name in s.rules if name not in layout.global_rules)
        entries = sum(math.prod(shape) for shape in s.shapes.values())
        values = 4 * entries if fisher else sum(4 * shape[0] ** 2 for p, shape in s.shapes.items() if is_kernel(p, shape))
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


def forward_classes(source: Source) -> int:
    config = source.ck.model_config
    return (getattr(config, "vocab_size", 0) if source.ck.layout.head == "lm" else getattr(config, "num_labels", 0)) or 1


def largest_batch(batches) -> int:
    return max([1, *(np.shape(next(iter(b.values())))[0] for b in batches if np.ndim(next(iter(b.values()))) >= 1)])


def positions(config, batch: Mapping) -> int:
    """The most rows one example gives a site on `batch`, the longest stack's positions: its token
    ids' (an encoder-decoder's decoder ids too), an image's patches and class token, Whisper's
    frames (its features are (examples, mel bins, frames); its front end's site is the second
    convolution's input, a row per frame)."""
    rows = [np.shape(batch[k])[-1] for k in ("input_ids", "decoder_input_ids", "input_features") if k in batch and np.ndim(batch[k]) >= 2]
    if "pixel_values" in batch and getattr(config, "patch_size", None):
        image, patch = getattr(config, "image_size", 0), getattr(config, "patch_size", 1)
        side = (image[0] if isinstance(image, (list, tuple)) else image) // (patch[0] if isinstance(patch, (list, tuple)) else patch)
        rows.append(side * side + 1)
    return max(rows, default=1)


def data_tokens(config, batches: Sequence) -> int:
    """The rows (tokens, patches or frames) the batches give a site, at most (padding counted)."""
    return sum((np.shape(next(iter(b.values())))[0] if np.ndim(next(iter(b.values()))) >= 1 else 1) * positions(config, b) for b in batches)


def forward_bytes(source: Source, layout: Layout, batches) -> int:
    """The float32 activations of a forward pass of `source`'s model on the largest of `batches`:
    per token and layer the attention's and FFN's intermediates (and the attention scores), then
    the logits and their log-softmax."""
    config = source.ck.model_config
    tokens = max([1, *(positions(config, batch) for batch in batches)])
    batch_size = largest_batch(batches)
    heads = layout.bound.attention[0].geometry.num_heads if layout.bound.attention else 1
    width = getattr(config, "hidden_size", None) or (layout.bound.attention[0].geometry.num_heads * layout.bound.attention[0].geometry.head_dim
                                                     if layout.bound.attention else 1)
    ffn = max((g.size for g in layout.bound.perms), default=4 * width)
    return 4 * batch_size * tokens * (len(layout.layers) * (16 * width + 4 * ffn + 2 * heads * tokens) + 3 * forward_classes(source))


def plan_merge_stream(sources, layout, method, stream: StreamOptions, work: Work, *, inputs: StatisticsInputs | None, task_head: str,
                      processes: int = 1) -> StreamPlan:
    """`plan_stream` of a merge (`work`: its alignment and output dtype); with statistics, the
    statistics pass too (refused first when it does not fit `max_memory`: no chunk size makes it
    smaller)."""
    if inputs is None:
        work = dataclasses.replace(work, merging=True, elementwise=merges_in_row_blocks(streamed_method(method)))
        return plan_stream(sources, layout, stream, work, processes=processes)
    budget = statistics_budget(sources, layout, inputs, aligned=work.aligned, task_head=task_head,
                                block_bytes=DEFAULT_BLOCK_BYTES if stream.block_bytes is None else stream.block_bytes)
    if stream.max_memory is not None and budget["peak"] > stream.max_memory:
        raise BudgetError(
            stream.max_memory, budget["peak"],
            f"what the statistics pass of {method} needs, about "
            f"{size_text(budget['peak'], stream.max_memory)}: it holds one model whole at a time with its statistics and the "
            "forward/backward working set of one batch (smaller batches need less); chunking the layers does not reduce it"
        )
    # Fisher is entry by entry: big leaves outside the layers go in row blocks. RegMean solves
    # kernels whole; counted whole here, though its embeddings go in row blocks.
    # one chunk at a time: the merge reads the statistics' spill and times on the run's one clock
    work = dataclasses.replace(work, merging=True, elementwise=method == "fisher", max_in_flight=1,
                               statistics_per_layer=tuple(budget["per_layer"]), statistics_global=budget["global"])
    plan = plan_stream(sources, layout, stream, work)
    return dataclasses.replace(plan, peak_bytes=max(plan.peak_bytes, budget["peak"]), statistics_bytes=budget["peak"],
                               in_memory_bytes=plan.in_memory_bytes + budget["in_memory"], scratch_bytes=budget["scratch"])


def check_statistics_models(sources: Sequence[Source], task_head: str, inputs: StatisticsInputs) -> None:
    """Before any weight is read: the task heads merge (task_head="merge") only when they have
    the same leaves and shapes, and the batches' token ids lie in the anchor's vocabulary."""
    try:
        checks.mergeable([(s.what, unflatten(shape_stand_ins_of(s.shapes))) for s in sources], task_head)
        for i, batch in enumerate(inputs.batches):
            hf.check_token_ids(sources[0].ck.model_config, batch, f"batches[{i}]")
    except ValueError as e:
        raise StreamingError(str(e)) from None


class Spill:
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
                    host = np.asarray(jax.device_get(x), order="C")
                with clock.phase("write"):
                    writer.write(name, host)
            writer.finish()
        finally:
            writer.close()
        self.files.append(hf.TensorFiles(folder))

    def names(self, i: int) -> set:
        return self.files[i].names()

    def read(self, i: int, name: str, clock, rows=None) -> np.ndarray:
        with clock.phase("read"):
            return self.files[i].read(name, rows)

    def remove(self) -> None:
        for f in self.files:
            f.close()
        owned.discard(self.root)


def rows_name(hf_name: str) -> str:
    """The spill's name of a row-blocked tensor's Fisher, stored in the HF tensor's layout."""
    return f"rows:{hf_name}"


class StatisticsMerge:
    """The statistics pass (`run`) and pass 2's merge of a chunk or a row block from the spilled
    statistics (`merged`), with the kernels and options of `merge.fisher` / `merge.regmean`."""

    def __init__(self, inputs: StatisticsInputs, spill: Spill, *, task_head: str, weights, params: Mapping, clock):
        self.inputs, self.spill, self.task_head, self.clock = inputs, spill, task_head, clock
        # `params` as `Method.bind` checked them (merge_to_disk), the declared defaults filled
        options = {k: params.get(k, p.default) for k, p in merge_methods.METHODS[inputs.method].params.items()}
        if inputs.method == "fisher":
            self.eps, self.weights = options["eps"], weights
        else:
            self.alpha, self.jitter = options["alpha"], options["jitter"]
        self.blocked: list = []  # Fisher: HF names whose Fisher is spilled in rows
        self.grams: set = set()  # RegMean: the kernels with Gram matrices
        self.grown: dict = {}  # RegMean: the kernels that grew, over every chunk (`merge.warn_if_grown`)
        self.report: dict = {}

    def blockable(self, name: str, rule_ours) -> bool:
        """Whether a big tensor outside the layers may go in row blocks: any for Fisher (entry by
        entry); for RegMean one without a Gram matrix (uniformly averaged)."""
        return self.inputs.method == "fisher" or not any(p in self.grams for p in rule_ours)

    def run(self, sources: Sequence[Source], layout: Layout, transforms: Sequence, tick) -> None:
        """Each model in turn: loaded whole, moved by its transforms as `align` moves it (its own
        task head kept, as the merge command keeps it), its statistics computed on it and spilled;
        dropped before the next is loaded."""
        clock, inputs = self.clock, self.inputs
        anchor = sources[0]
        blocked_paths = {anchor.rules[name].ours[0]: name for name in self.blocked}
        counts = []
        for i, source in enumerate(sources):
            with clock.phase("read"):
                ck = source.whole()
            if transforms[i] is not None:
                body = {k: v for k, v in ck.params.items() if k != "head"}
                head = {k: v for k, v in ck.params.items() if k == "head"}
                moved = clock.timed("apply", apply_unchecked, layout.bound, body, transforms[i])
                ck = dataclasses.replace(ck, params={**moved, **head})  # the weights as loaded are dropped
                del body, head, moved
            with clock.phase("statistics"):
                if inputs.method == "fisher":
                    st = stats_mod.fisher(ck, ck.params, inputs.batches, kind=inputs.kind, key=inputs.key, samples=inputs.samples)
                    values = flatten(st.values)
                else:
                    st = stats_mod.grams(ck, ck.params, inputs.batches)
                    values = dict(st.values)
                keep = set(merged_paths(values, self.task_head))
                values = {p: jax.block_until_ready(x) for p, x in values.items() if p in keep}
                if inputs.method == "regmean":  # refused as the in-memory merge refuses it, before anything is spilled
                    shapes = {p: np.shape(x) for p, x in flatten(ck.params).items()}
                    for path, x in values.items():
                        merge_methods.check_regmean_kernel(path, shapes[path], np.shape(x), i)
            spilled = {}
            for path, x in values.items():
                if path in blocked_paths:  # its Fisher in the HF tensor's layout, read in the weights' row blocks
                    spilled[rows_name(blocked_paths[path])] = source.rules[blocked_paths[path]].to_hf((np.asarray(x),))
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
        paths = merged_paths(anchor, self.task_head)
        models = [{p: f[p] for p in paths} for f in flats]
        if self.inputs.method == "fisher":
            if rows is None:
                values = [{p: spill.read(i, p, clock) for p in paths} for i in range(n)]
            else:
                values = [{p: spill.read(i, rows_name(rows[0]), clock, rows[1]) for p in paths} for i in range(n)]
            weights = checks.weights(self.weights, n)
            merged = clock.timed("merge", arithmetic.fisher_leaves, models, values, weights, self.eps)
        else:
            kernels = [p for p in paths if p in self.grams]
            grams = [{p: arithmetic.to_jax(spill.read(i, p, clock)) for p in kernels} for i in range(n)]
            merged, grown = clock.timed("merge", arithmetic.regmean_leaves, models, grams, self.alpha, self.jitter)
            self.grown.update(grown)
        return jax.device_get({p: merged[p] if p in merged else anchor[p] for p in anchor})
