"""What every pipeline call shares: its options (`RunOptions`), what it returns (`DryRun`,
`Written`), its refusals as `PipelineError`s (`checked`), the spec and options it aligns with,
the norm gains folded for a rotation, and the writing of its output."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import rotsym_jax as rj

from .. import verify
from ..checks import TASK_HEAD_LEAVES
from ..errors import RotsymError
from ..families.family import InferredRecord
from ..io.hf import Checkpoint, CheckpointError, save_hf, spec_for
from ..io.loading import PipelineError, Progress
from ..io.orbax import save_orbax
from ..options import FORMATS, OPTIMIZERS, AlignOptions
from ..timings import Clock


@dataclasses.dataclass(frozen=True)
class DryRun:
    """A dry run's plan: what would be done (`lines`), the peak memory `estimate` in bytes and how
    it was counted (`formula`). Nothing was read but configs and headers, nothing written."""

    lines: list[str]
    estimate: int
    formula: str


@dataclasses.dataclass(frozen=True)
class Written:
    """A pipeline's output: the folder `path`, its `report` (rotsym_report.json), the distance
    rows of its tables, and the layers per chunk of a streamed run (None in memory)."""

    path: Path
    report: dict
    rows: list
    chunk_layers: int | None = None


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a pipeline call runs and writes, checked on construction. overwrite: replace an existing
    `out` (`overwrite_option`: how the caller names it in messages, the command line
    "--overwrite"); max_memory: the bytes a streamed run's peak must fit (None: in memory, or
    streamed when the in-memory estimate exceeds the memory available); dry_run: check and plan,
    read no weight, write nothing; format: "hf" or "orbax" (`FORMATS`); command: what the report
    records as the command; progress: what the run tells as it goes (None: nothing); records: the
    inferred records (`infer_record`, saved as JSON) to read the model types without one of their
    own by, instead of proving one in transformers on every run."""

    overwrite: bool = False
    max_memory: int | None = None
    dry_run: bool = False
    format: str = "hf"
    command: str | None = None
    progress: Progress | None = None
    overwrite_option: str = "overwrite=True"
    records: tuple[InferredRecord, ...] = ()

    def __post_init__(self):
        _check_max_memory(self.max_memory)
        _check_format(self.format)
        object.__setattr__(self, "records", tuple(self.records))
        for r in self.records:
            if not isinstance(r, InferredRecord):
                raise PipelineError(f"records holds a {type(r).__name__}; expected InferredRecord (InferredRecord.from_json of a saved record)")
        if self.progress is None:
            object.__setattr__(self, "progress", Progress())

    @classmethod
    def of(cls, run: RunOptions | None, keywords: dict) -> RunOptions:
        """`run` (None: the defaults) with `keywords` naming its fields over it."""
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(keywords) - set(fields))
        if unknown:
            raise PipelineError(f"unknown keywords {unknown}; the run options are {fields}")
        if run is not None and not isinstance(run, cls):
            raise PipelineError(f"run is a {type(run).__name__}; expected a rotsym_jax.pipeline.RunOptions")
        return dataclasses.replace(run, **keywords) if run is not None else cls(**keywords)


def _check_max_memory(max_memory) -> None:
    if max_memory is not None and (isinstance(max_memory, bool) or not isinstance(max_memory, (int, np.integer)) or max_memory < 1):
        raise PipelineError(f"max_memory={max_memory!r}; expected None or a number of bytes (an integer, e.g. 3 * 2**30)")


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise PipelineError(f"format={format!r}; choose one of {FORMATS}")


def checked(fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, its refusals (RotsymError, or any ValueError: bad options, models that
    do not fit) a PipelineError."""
    try:
        return fn(*args, **kwargs)
    except (PipelineError, RuntimeError):  # a ProcessError (another process failed) too: as it is
        raise
    except (RotsymError, ValueError) as e:
        raise PipelineError(str(e)) from None


def align_options_of(options) -> AlignOptions:
    try:
        options = checked(AlignOptions.of, options)
    except TypeError as e:  # unknown keys
        raise PipelineError(str(e)) from None
    if not isinstance(options.optimizer, str):
        raise PipelineError(f"optimizer={options.optimizer!r}: a pipeline writes its options into the report and recipe, which "
                            f"cannot hold an optax object; name one of {OPTIMIZERS} (with learning_rate), or call rj.align in Python")
    return options


def settled_for(options: AlignOptions, checkpoint: Checkpoint) -> AlignOptions:
    """`options` with each "auto" resolved as the pipelines run them (`AlignOptions.settled`): the
    data methods' residual is the strongest group `checkpoint`'s family allows, since the
    pipelines fold the norm gains and untie a tied head for a rotation (`folded`, `reconciled`)."""
    if options.residual == "auto" and options.method != "weights":
        options = options.settled(verify.strongest_as_run(checkpoint)[0])
    return options.settled()


def aligning_spec(checkpoint: Checkpoint):
    """The spec the pipelines align with: the family's, with every task head set aside (label
    spaces may differ even where the heads' shapes agree), as the streamed runs do."""
    return dataclasses.replace(spec_for(checkpoint), task_head=TASK_HEAD_LEAVES)


def folded(params: list, checkpoint: Checkpoint, options: dict) -> list:
    """With residual="rotation", every model's norm gains (and LayerNorm biases) folded into the
    layers that read them (same function, a valid checkpoint of the same type): a rotation of the
    residual stream needs uniform gains (MATH.md §10); with latents="rotation", MLA's latent norm
    gains likewise (§17)."""
    if options.get("latents") == "rotation":  # MLA's latent norm gains into the kernels reading the latent (MATH §17)
        params = [rj.fold_latents(spec_for(checkpoint), p) for p in params]
    if options.get("residual") != "rotation":
        return params
    return [rj.fold_norms(spec_for(checkpoint), p) for p in params]


def add_timings(clock: Clock, timings: list[dict]) -> None:
    """The phases of `align` runs (their in-memory solves, distances, moves) added to a pipeline's clock."""
    for t in timings:
        for key in ("solve", "assignment", "attention", "distances", "apply", "compile"):
            clock[key] += t[key]


def save_output(checkpoint: Checkpoint, params, out, run: RunOptions, dtype, files: Callable[[], dict], clock: Clock) -> Path:
    """`save_hf` (or `save_orbax`); `files()` (the report, card and recipe) is called once the weights
    are written, after their seconds are added to the clock's "write"."""
    t0 = time.perf_counter()

    def timed_files():
        clock["write"] += time.perf_counter() - t0
        return files()

    try:
        save = save_orbax if run.format == "orbax" else save_hf
        return save(checkpoint, params, out, dtype=dtype, overwrite=run.overwrite, extra_files=timed_files)
    except (CheckpointError, FileExistsError) as e:
        raise PipelineError(f"OUT: {e}") from None


def layers_text(n: int) -> str:
    return f"{n} layer{'' if n == 1 else 's'}"
