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

Chunks in flight: a run works on `StreamPlan.in_flight` chunks at once (`run_in_flight`), a thread
each, one per local device and at least two on one device where the memory allows, so that one
chunk's reads, transfers and host assignments run while another's device work does; every chunk's
part carries its key and the solver combines them in key order, so the bits do not depend on the
order the chunks finish in. Many processes (`processes.Team`, a JAX multi-process program) split
the chunks: each reads, solves and writes its contiguous share; the solvers' parts and the
distances go through JAX collectives, every process then solves every group over all layers,
process 0 makes the output files and publishes them, the others write their tensors into them
(`write_together`). Both are bit for bit the one-process, one-device run (tests/test_processes.py).

The residual stream (`residual != "none"`) couples every layer: `ResidualDescent` runs
`align`'s coordinate descent a pass over the chunks at a time, its cross products summed over
the layers in one order whatever the lanes and processes; for a rotation every source reads its
tensors with the norm gains folded (`Source(fold=True)`: `residual.Folds`, the one rule
`fold_norms` applies to a whole model), and a head untied from the embedding
(`Checkpoint.aliases`) reads the embedding's tensor.

`merge_to_disk(align="many")` runs `align_many` (`AlignMany`) a pass over the chunks per step,
bit for bit; with the residual stream each alignment is a `ResidualDescent`, its anchor in the
sweeps the mean of the other models as moved, read as a source (`LeaveOneOut`).

`align_to_disk(method="activations", data=...)` holds each model whole in turn
(`ActivationMatching`, as the statistics pass of a Fisher or RegMean merge holds it): its sites
spilled, solved a chunk at a time, and `align`'s fallback scored on merged models built a chunk
at a time.

`merge_to_disk` with `align_options` method "activations" (align="anchor", `batches` its data)
aligns each model to the anchor the same way.

Not streamed (refused by `unstreamed_method`, the one place): learned alignment (its backward
pass runs through both models at once), align="many" from activations, and OT fusion (it needs
every model whole)."""

from ..options import MergeOptions, StreamOptions
from ._align import StreamResult, align_to_disk, plan_align
from ._common import BudgetError, StreamingError, split_options, streamed_method, streamed_methods, streamed_options, unstreamed_method
from ._merge import merge_to_disk, plan_merge
from ._plan import StreamPlan, available_memory

__all__ = [
    "BudgetError",
    "MergeOptions",
    "StreamOptions",
    "StreamPlan",
    "StreamResult",
    "StreamingError",
    "align_to_disk",
    "available_memory",
    "merge_to_disk",
    "plan_align",
    "plan_merge",
    "split_options",
    "streamed_method",
    "streamed_methods",
    "streamed_options",
    "unstreamed_method",
]
