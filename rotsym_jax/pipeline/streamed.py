"""The switch to streaming (checkpoints bigger than memory): whether a run streams and under which
budget, why one cannot, and the streaming calls' refusals as `PipelineError`s."""

from __future__ import annotations

import dataclasses

import jax

import rotsym_jax as rj

from ..io import memory
from ..io.hf import CheckpointError, NonFiniteWeights
from ..io.loading import PipelineError, Progress, unusable
from ..merging import methods as merge_methods


@dataclasses.dataclass(frozen=True)
class Chosen:
    """A budget the run chose, no --max-memory given: why it streams, from the free memory it
    measured (MemAvailable) and what this process already holds of its runtime (`held`)."""

    budget: int
    available: int
    held: int
    why: str  # "the models need about ... in memory" or "N processes split ..."

    def refusal(self, e: rj.streaming.BudgetError) -> str:
        """What a streamed run refused under this budget says: what was measured and chosen, not a
        max_memory the user never gave."""
        held = f" beside the {memory.size_text(self.held)} this process already holds" if self.held else ""
        share = "80% of the free memory" + (", plus what this process holds" if self.held else "")
        return (f"no --max-memory was given: {self.why}, and {memory.size_text(self.available)} of memory is free (MemAvailable, measured "
                f"at the start){held}, so the run streams from disk to disk within {memory.size_text(self.budget)} ({share}), below "
                f"{e.what}. Free some memory (other processes hold it), or pass --max-memory to choose the budget "
                f"(at least {memory.size_text(e.needed)})")


def streaming_budget(max_memory: int | None, estimate: int, options: dict, progress: Progress, method=None, align="anchor",
                      unstreamable: str | None = None) -> tuple[int | None, Chosen | None]:
    """The memory budget of a streamed run, or None for the in-memory path, and how it was chosen
    where no `max_memory` was given (for `stream_call` to say so): `max_memory` when given (the
    streaming path refuses what it cannot do, with the reason; `unstreamable` says why this run
    cannot stream at all); 80% of the memory available, plus what this process already holds of
    its runtime, when the in-memory `estimate` (`memory.in_memory_bytes`, what a dry run prints)
    exceeds their sum and the run is one the streaming path can do. The estimate counts the whole
    runtime; MemAvailable, read in this process, no longer counts what it already holds of it."""
    processes = jax.process_count()
    if processes > 1:  # the processes split a streamed run's layers: it must stream
        why = unstreamable or unstreamed(options, method, align)
        if why:
            raise PipelineError(f"{processes} processes split a streamed run's layers between them, and {why}; run it in one process")
        if max_memory is not None:
            return max_memory, None
        return _chosen(rj.streaming.available_memory(), f"{processes} processes split a streamed run's layers between them")
    if max_memory is not None and unstreamable:
        raise PipelineError(f"--max-memory: {unstreamable}; run without it (in memory)")
    if max_memory is not None:
        return max_memory, None
    if unstreamable or unstreamed(options, method, align):
        return None, None
    available = rj.streaming.available_memory()
    held = min(memory.resident_bytes(), memory.runtime_bytes())
    if estimate <= available + held:
        return None, None
    progress.note(f"the models need about {estimate / 2**30:.1f} GiB in memory, {available / 2**30:.1f} GiB is available: "
                  "streaming from disk to disk (--max-memory picks the budget)")
    return _chosen(available, f"the models need about {memory.size_text(estimate)} in memory", held)


def _chosen(available: int, why: str, held: int | None = None) -> tuple[int, Chosen]:
    held = min(memory.resident_bytes(), memory.runtime_bytes()) if held is None else held
    budget = int(0.8 * available) + held
    return budget, Chosen(budget, available, held, why)


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


def stream_call(fn, *args, chosen: Chosen | None = None, **kwargs):
    """A streaming call, its refusals and bad inputs as PipelineErrors naming the problem; a budget
    too small that the run `chosen` itself said as what it measured and chose."""
    try:
        return fn(*args, **kwargs)
    except rj.streaming.BudgetError as e:
        raise PipelineError(str(e) if chosen is None else chosen.refusal(e)) from None
    except NonFiniteWeights as e:
        raise unusable(e) from None
    except (rj.streaming.StreamingError, CheckpointError, FileNotFoundError) as e:
        raise PipelineError(str(e)) from None
    except FileExistsError as e:
        raise PipelineError(f"OUT: {e}") from None
    except ValueError as e:
        raise PipelineError(str(e)) from None
