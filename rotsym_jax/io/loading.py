"""Reading a run's checkpoints: a folder, an Orbax checkpoint or run, or a Hugging Face Hub id, as
a `Checkpoint`, with the record of a model type that has none inferred (`io.inferred`) and proven
by the caller's `prove` (`verify.infer_record`, which needs the engine above io), and the errors
and progress reports every pipeline shares."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import RotsymError
from ..families.family import InferredRecord
from ._files import HUB_ID
from .hf import UNUSABLE, Checkpoint, CheckpointError, NonFiniteWeights, link_problem, load_hf, supported_model_types
from .inferred import candidate_records, tensors_record_of
from .orbax import is_orbax, load_orbax
from .reconcile import prepared


class PipelineError(RotsymError, ValueError):
    """A refusal of a pipeline, naming the problem (the command line prints it as a usage error)."""


class Progress:
    """What a pipeline tells while it runs: its steps, the units inside a step, the chunks of a
    streamed run, notes. This one tells nothing; the command line's draws progress bars."""

    def step(self, name: str, fn: Callable, *args, **kwargs):
        return fn(*args, **kwargs)

    @contextlib.contextmanager
    def detail(self, what: str, total: int | None, unit: str):
        """Yields an `update()` to call once per unit done."""
        yield lambda n=1: None

    @contextlib.contextmanager
    def chunks(self, what: str):
        """Yields a streamed run's `progress(done, total)`."""
        yield None

    def note(self, text: str) -> None:
        """Something the user should know that is not an error (the run goes on)."""

    def close(self) -> None:
        pass


# How a record inferred for a model type without one is proven before weights move by it
# (`verify.infer_record`: each group held in transformers).
Prover = Callable[[str], InferredRecord]

# What a checkpoint folder needs from a Hub repository: config, weights, tokenizer, model card.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.md"]


def proven(records: Sequence[InferredRecord], loaded: Sequence[Checkpoint]) -> tuple[InferredRecord, ...]:
    """`records` and those inferred for the checkpoints already loaded: a run proves a model type
    once, however many of its models share it."""
    return (*records, *(ck.model_config.record for ck in loaded if ck.model_config.record is not None))


def note_unused_records(progress: Progress, records: Sequence[InferredRecord], loaded: Sequence[Checkpoint]) -> None:
    """A given record no model of the run is read by (another model type) is said, not ignored."""
    used = [ck.model_config.record for ck in loaded]
    types = sorted({str(ck.model_config.model_type if ck.model_config.record is None else ck.model_config.record.model_type)
                    for ck in loaded})
    for r in records:
        if r not in used:
            progress.note(f"note: the record given for model_type {r.model_type!r} reads no model of this run (their types: "
                          f"{', '.join(types)})")


def load_checkpoint(path, what: str, weights: bool = True, *, prove: Prover | None, record: InferredRecord | None = None,
                    progress: Progress | None = None, changes: dict | None = None, records: Sequence[InferredRecord] = (),
                    merging: bool = False, dtype=None) -> Checkpoint:
    """`load_orbax` of an Orbax checkpoint, run (its latest step) or step folder, else `load_hf`
    of a folder or a Hub id (see `_folder`); errors a PipelineError naming `what`. `changes`: what
    made the run's models one architecture (`io.reconcile.reconciled`), applied to it. A folder whose
    model_type has no record is read with `record` (or the one of `records` for its model type),
    else with one inferred and proven by `prove` (the pipelines give `verify.infer_record`: every
    group held in transformers), which `progress` notes (with the record, to save and give back:
    `records`, the command line's --record). With `prove` None (a run that moves no weight by a
    symmetry), the record whose tables hold its
    tensors exactly reads them, unproven (only their names and shapes matter then), or, where no
    layout of ours does, its tensors alone (`families.tensors`). `merging`: a refusal says that a
    merge without alignment reads any checkpoint. `dtype`: the params' dtype (`load_hf`'s; None:
    each leaf as stored)."""
    try:
        if changes:
            return prepared(load_checkpoint(path, what, weights, prove=prove, record=record, progress=progress, dtype=dtype), changes)
        if is_orbax(path):
            return load_orbax(path, weights=weights, dtype=dtype)
        folder = _folder(path, what)
        model_type = _model_type(folder)
        # a record read as tensors alone lists one model's tensors: each model is read as its own, then compared
        record = record or next((r for r in records if r.model_type == model_type and not r.tensors), None)
        if record is None and isinstance(model_type, str) and model_type not in supported_model_types():
            noted = any(r.model_type == model_type for r in records)  # said once per model type
            record = _record_of(folder, what, prove, merging, progress or Progress(), noted)
        checkpoint = load_hf(folder, weights=weights, record=record, dtype=dtype)
        quantization = checkpoint.model_config.raw.get("quantization_config")
        if progress is not None and isinstance(quantization, dict) and quantization.get("quant_method") == "fp8":
            progress.note(f"note: {what}: its FP8 weights (blocks of {quantization.get('weight_block_size')}) are read dequantized, in "
                          "float32; what this run writes holds them in bfloat16, without quantization_config (twice their bytes)")
        return checkpoint
    except NonFiniteWeights as e:
        raise unusable(e, what) from None
    except (FileNotFoundError, CheckpointError) as e:
        raise PipelineError(f"{what}: {e}") from None


def _record_of(folder: Path, what: str, prove: Prover | None, merging: bool, progress: Progress, noted: bool = False) -> InferredRecord:
    """The record a folder of a model type without one is read with (`load_checkpoint`), noted
    unless `noted` already."""
    if prove is None:
        candidates, _ = candidate_records(folder, explain=False)
        record = candidates[0] if candidates else tensors_record_of(folder)
        if not noted:
            progress.note(f"{what}: model_type {record.model_type!r} has no record of its own; " + (
                f"its tensors are {record.read_as}'s: read by their names and shapes (its symmetry groups are not proven: this run moves "
                "no weight by one)" if candidates else
                "no layout of ours reads it, so it is read as its tensors alone and merged tensor by tensor (alignment needs a layout)"))
        return record
    try:
        record = prove(folder)
    except RuntimeError as e:  # no transformers to prove an inferred record with
        raise PipelineError(f"{what}: its model_type has no record, and {e}") from None
    except CheckpointError as e:
        if merging:  # the merge itself needs no layout
            raise CheckpointError(f"{e}; a merge without alignment (--align none, or a mergekit config without --align) reads any "
                                  "checkpoint as its tensors") from None
        raise CheckpointError(f"{e}. Aligning it needs a layout (a record of ours, or one `rotsym inspect --verify` infers); merge --align none reads it as its tensors") from None
    progress.note(
        f"{what}: model_type {record.model_type!r} has no record of its own; its tensors are {record.read_as}'s and every group "
        f"of that record held in transformers' {record.stem} model ({len(record.proven)} element kinds proven): read as "
        f"{record.read_as}, for moving weights only. The record, to save as a JSON file and give back with --record FILE "
        f"(Python: records=) to skip this proof: {json.dumps(record.to_json())}")
    return record


def _model_type(folder: Path):
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None  # load_hf names what is wrong with it


def _folder(path, what: str) -> str:
    """`path` itself when it exists; a Hugging Face Hub id (org/name) becomes its snapshot folder
    (downloaded, or read from the local cache with HF_HUB_OFFLINE=1). A symbolic link loop or a
    link to nothing is refused as such, never looked up on the Hub."""
    if link_problem(path):
        raise PipelineError(f"{what}: {link_problem(path)}")
    if Path(path).exists() or not HUB_ID.fullmatch(str(path)):
        return path
    import huggingface_hub  # an optional dependency, needed only for Hub ids

    try:
        return huggingface_hub.snapshot_download(str(path), allow_patterns=HUB_FILES)
    except Exception as e:  # offline and not cached, unknown repository, network errors
        raise PipelineError(
            f"{what}: {path} is neither a folder nor a Hugging Face Hub id that can be fetched or found in the "
            f"local cache ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def unusable(e: NonFiniteWeights, what: str = "") -> PipelineError:
    """A NaN or Inf model's line, one wording however it was read: the Python hint names an
    argument, and no run has a use for such a model."""
    return PipelineError(f"{what or e.what}: {e.found}; {UNUSABLE}")

