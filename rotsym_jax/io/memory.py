"""The memory model of a run, one for every path: `in_memory_bytes` is what the in-memory path
holds at its peak (`--dry-run` prints it, the command line switches to streaming when it exceeds
the memory available, a streaming plan reports it for comparison), and the constants below price
a streamed chunk (`streaming` plans with them)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import rotsym_jax as rj

from ..pytree import flatten
from ..solvers.assignment import lap_solver_available
from ..spec import bind
from .hf import spec_for

# The JAX runtime and compiled programs, allocator slack: 0.25 GiB after the imports.
RUNTIME_BYTES = 512 * 2**20
# On a GPU the CUDA libraries and the GPU client hold host memory too: one H200 run peaked 1.2 GB
# above a plan that did not count it (benchmarks/results/streaming-nvidia-h200.json).
ACCELERATOR_RUNTIME_BYTES = 3 * 2**29
# A streamed chunk, per layer: the tensors read (host + device copies), the float32 working set of
# the solves / merge arithmetic and the FFN cost matrices (`cost_matrix_bytes` of one layer, with
# the host's float64 copy in SciPy). Calibrated on the 3B-shape Llama pair of
# benchmarks/make_large_pair.py, one layer at a time (3-layer cut, align + average, 2-core CPU):
# measured peaks 1.91 GiB computing a cost matrix, 1.98 assigning it (pass 1), 1.74 merging (pass
# 2); planned 2.56 (whole runs: benchmarks/results/streaming.json, planned against measured).
STORED_COPIES = 2.0  # each model's chunk: the host read buffer and the device array
F32_COPIES_ALIGN = 1.5  # a cost member's float32 inputs (`ffn.layer_costs`), the moved copy
F32_COPIES_MERGE = 1.0  # per merged model: the kernels' float32 inputs; plus the results
# On an accelerator, a tensor put on the device passes through host buffers of its own: laid out
# contiguously (a transposed kernel is handed to `device_put` as a strided view) and staged in
# pinned memory, which the GPU client's allocator keeps pooled for the next transfer. Each lane puts
# one tensor at a time (`streaming.Source.leaves` awaits each), so a run holds, per lane in flight,
# this many copies of the biggest tensor it transfers whole. On the CPU the device array is the
# host copy, counted in STORED_COPIES. To be calibrated on a GPU run (issue 52).
STAGING_COPIES = 2.0
# The host solver's copy of a float32 cost matrix, in cost matrices: lapx's float32 copy (its
# lapjvs allocates nothing of the matrix's size: measured on 8192², 0.1 MB), or SciPy's float64.
HOST_COST_COPY = 1.0 if lap_solver_available() else 2.0


def cost_matrix_bytes(bound, per_layer: bool = False) -> int:
    """The float32 cost matrices of a bound spec's groups, as each kind counts them
    (`kinds.Kind.cost_matrices`): the permutation groups' every layer's (as `align` dispatches
    them all at once), or one layer's; and an experts block's batch of pairs (its layers are
    matched one after another, `options.EXPERT_PAIR_BYTES`)."""
    costs = [rj.kinds.of(g).cost_matrices(g, per_layer) for g in bound.groups]  # (held with the others', one group's at a time)
    return sum(held for held, _ in costs) + max((alone for _, alone in costs), default=0)


def size_text(n: int, beside: int | None = None) -> str:
    """Bytes for a message: GiB with two decimals, MiB below a tenth of one (never "0.00 GiB").
    `beside`: another size the message compares it with; more decimals where the two would read
    the same ("0.50 GiB is below 0.50 GiB"), down to bytes."""
    unit, scale, digits = ("GiB", 2**30, 2) if n >= 2**30 / 10 else ("MiB", 2**20, 1)
    while beside not in (None, n) and f"{n / scale:.{digits}f}" == f"{beside / scale:.{digits}f}":
        if digits == 10:
            return f"{n} bytes"
        digits += 1
    return f"{n / scale:.{digits}f} {unit}"


def runtime_bytes() -> int:
    """The host memory a run holds before any weight: the JAX runtime, and on an accelerator its libraries."""
    import jax

    return RUNTIME_BYTES + (ACCELERATOR_RUNTIME_BYTES if jax.default_backend() != "cpu" else 0)


def resident_bytes() -> int:
    """This process's anonymous resident memory now (RssAnon; 0 where /proc cannot say): what it
    already holds of the runtime `runtime_bytes` counts, which MemAvailable no longer includes
    (its libraries' mapped files are page cache, which MemAvailable still counts)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def staging_bytes(biggest: int, lanes: int) -> int:
    """The host buffers of host-to-device copies (`STAGING_COPIES`): `lanes` transfers at once, of
    at most `biggest` bytes each; none on the CPU."""
    import jax

    return int(STAGING_COPIES * biggest * lanes) if jax.default_backend() != "cpu" else 0


def in_memory_bytes(held: Sequence[int], *, moved: Sequence[int] = (), cost_bytes: int = 0, merged_bytes: int = 0) -> int:
    """The in-memory path's peak: the runtime, every model `held` (and a base), a moved copy of
    each aligned model (`moved`), the cost matrices of every layer, the merge's float32 result."""
    return int(runtime_bytes() + sum(held) + sum(moved) + cost_bytes + merged_bytes)


def checkpoint_bytes(checkpoint, dtype=None) -> int:
    """Bytes of a Checkpoint's params as loaded (each leaf in its stored dtype, or `dtype`)."""
    flat = flatten(checkpoint.params)
    return sum(int(np.prod(x.shape)) * np.dtype(dtype or checkpoint.stored_dtypes.get(p, x.dtype)).itemsize for p, x in flat.items())


def cost_bytes(checkpoint) -> int:
    """A Checkpoint's permutation groups' cost matrices, all layers at once (float32 on the device)."""
    return cost_matrix_bytes(bind(spec_for(checkpoint), checkpoint.params))
