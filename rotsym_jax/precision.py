"""Full float32 precision for everything that decides an alignment or a merge.

JAX's default float32 matmul precision depends on the backend: TF32 on NVIDIA GPUs since Ampere
(about 3e-4 relative error), bfloat16 passes on TPUs. The solvers promise 1e-5 against float64
references, and rounded cross products pick other rotations and permutations, so the library's
computations run under `exact`, which pins "highest" whatever the user's
`jax_default_matmul_precision` is. It acts while a function is traced or dispatched; `exact_jit`
dispatches under it too, so that jit keeps one cache entry for every user setting (it keys its
cache on the setting, and would compile the same program once per setting). Model forward passes
(`Checkpoint.apply`, training, user loss functions) keep the user's setting.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["COMPILER_OPTIONS", "committed", "compute_dtype", "exact", "exact_jit", "upcast"]


def exact(fn):
    """`fn` with every matmul it traces or dispatches at full float32 precision."""

    @functools.wraps(fn)
    def pinned(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return pinned


# XLA:GPU autotunes every matmul fusion of a program by compiling and timing candidate kernels,
# and emits Triton kernels for them. The library's programs run once or a few times per shape, so
# they take cuBLAS with its default heuristics: autotuning costs seconds of compile time per
# program for no faster run (RESULTS.md, "Engine choices, measured"). Other backends ignore these.
COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}


def exact_jit(fn=None, /, **jit_kwargs):
    """`jax.jit(exact(fn), **jit_kwargs)`, compiled with `COMPILER_OPTIONS` where it is called on
    concrete arrays (JAX takes compiler options only for a top-level jit; inside another trace,
    where its arguments are tracers, it is a plain nested jit). Usable as `@exact_jit` or
    `@partial(exact_jit, ...)`."""
    if fn is None:
        return functools.partial(exact_jit, **jit_kwargs)
    pinned = exact(fn)
    top = jax.jit(pinned, compiler_options=COMPILER_OPTIONS, **jit_kwargs)
    nested = jax.jit(pinned, **jit_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if is_traced(args, kwargs) or _staging():
            return nested(*args, **kwargs)
        args, kwargs = committed((args, kwargs))  # one device for both
        # jit keys its cache on the caller's matmul precision: pinned here as `pinned` traces it, one
        # program for every caller's setting (the tests' float32_models and the rest shared each twice)
        with jax.default_matmul_precision("highest"):
            return top(*args, **kwargs)

    call.lower = top.lower
    call._cache_size = top._cache_size
    return call


def committed(tree):
    """`tree` with its uncommitted arrays (and host arrays) committed to the one device its
    committed arrays are on; unchanged where none is committed (uncommitted results stay free to
    follow a later call's device: the streamed lanes rely on it), where they span several devices,
    or where a leaf is a tracer.

    jax.jit compiles a program per placement of its arguments, and a mix of committed arrays (a
    jitted result of committed inputs, a `device_put` to a device) and uncommitted ones (made from
    host data) is a placement: the same program, compiled again (the learned step three times in
    `rotsym demo`, 3.4 s each). jit would move the uncommitted ones to that device itself:
    committing them first is free (the same buffer) and computes the same bits."""
    leaves = jax.tree_util.tree_leaves(tree)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return tree
    devices = {d for x in leaves if isinstance(x, jax.Array) and x.committed for d in x.devices()}
    if len(devices) != 1:
        return tree
    device = devices.pop()

    def commit(x):
        if isinstance(x, jax.Array) and not x.committed or isinstance(x, (np.ndarray, np.generic)):
            return jax.device_put(x, device)
        return x

    return jax.tree_util.tree_map(commit, tree)


def is_traced(*trees) -> bool:
    """Whether any leaf of `trees` is a tracer (the call is inside jit, vmap or grad): its values are
    unknown, so host-side checks and host solvers cannot run on it."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(trees))


# No trace at all (the eager case of nearly every call) is told without a transfer (84 us each);
# JAX has no public form of it, so without this private one every call asks the transfer.
_no_trace = getattr(getattr(getattr(jax, "_src", None), "core", None), "trace_state_clean", lambda: False)


def _staging() -> bool:
    """Whether an enclosing jit is tracing (every operation is then staged into its program), for
    calls whose arguments are all constants: a jit nested there takes no compiler options. A
    transfer, not an operation: an eager operation compiles a program of its own."""
    return not _no_trace() and isinstance(jax.device_put(np.float32(0)), jax.core.Tracer)


def compute_dtype(dtype):
    """The dtype the library computes in for inputs of `dtype`: float32 at least (float16,
    bfloat16 and integers become float32; float64 stays)."""
    return jnp.promote_types(dtype, jnp.float32)


def upcast(x):
    """`x` as an array of `compute_dtype(x.dtype)`."""
    x = jnp.asarray(x)
    return x.astype(compute_dtype(x.dtype))
