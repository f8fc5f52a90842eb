"""The switch to streaming (checkpoints bigger than memory): whether a run streams and under which
budget, why one cannot, and the streaming calls' refusals as `PipelineError`s."""

from __future__ import annotations

import jax

import rotsym_jax as rj

from ..io.hf import CheckpointError, NonFiniteWeights
from ..io.loading import PipelineError, Progress, unusable
from ..merging import methods as merge_methods


def streaming_budget(max_memory: int | None, estimate: int, options: dict, progress: Progress, method=None, align="anchor",
                      unstreamable: str | None = None) -> int | None:
    """The memory budget of a streamed run, or None for the in-memory path: `max_memory` when
    given (the streaming path refuses what it cannot do, with the reason; `unstreamable` says why
    this run cannot stream at all); 80% of the memory available when the in-memory `estimate`
    (`memory.in_memory_bytes`, what a dry run prints) exceeds it and the run is one the
    streaming path can do."""
    processes = jax.process_count()
    if processes > 1:  # the processes split a streamed run's layers: it must stream
        why = unstreamable or unstreamed(options, method, align)
        if why:
            raise PipelineError(f"{processes} processes split a streamed run's layers between them, and {why}; run it in one process")
        return max_memory if max_memory is not None else int(0.8 * rj.streaming.available_memory())
    if max_memory is not None and unstreamable:
        raise PipelineError(f"--max-memory: {unstreamable}; run without it (in memory)")
    if max_memory is not None:
        return max_memory
    if unstreamable or unstreamed(options, method, align):
        return None
    available = rj.streaming.available_memory()
    if estimate <= available:
        return None
    progress.note(f"the models need about {estimate / 2**30:.1f} GiB in memory, {available / 2**30:.1f} GiB is available: "
                  "streaming from disk to disk (--max-memory picks the budget)")
    return int(0.8 * available)


def unstreamed(options: dict, method, align) -> str | None:
    """Why the streaming path cannot do this run, or None."""
    why = rj.streaming.unstreamed_method(options.get("method", "weights"), merging=align if method is not None else None)
    if why:
        return why
    known = merge_methods.METHODS.get(method) if method is not None else None
    why = known.unstreamed() if known is not None else None
    if why:
        return f"the merge method {method!r} is not streamed: {why}"
    return None


def format_unstreamable(format: str) -> str | None:
    """Why a run cannot stream (it writes safetensors a chunk at a time; it reads Hugging Face and
    Orbax inputs alike), or None."""
    return "--format orbax writes the params whole" if format == "orbax" else None


def stream_call(fn, *args, **kwargs):
    """A streaming call, its refusals and bad inputs as PipelineErrors naming the problem."""
    try:
        return fn(*args, **kwargs)
    except NonFiniteWeights as e:
        raise unusable(e) from None
    except (rj.streaming.StreamingError, CheckpointError, FileNotFoundError) as e:
        raise PipelineError(str(e)) from None
    except FileExistsError as e:
        raise PipelineError(f"OUT: {e}") from None
    except ValueError as e:
        raise PipelineError(str(e)) from None
