"""The pipelines' refusals from configs and headers alone, before any weight is read: OUT, the
models' architectures, a rotation the family forbids, the data of an alignment from activations."""

from __future__ import annotations

import errno

import numpy as np

import rotsym_jax as rj

from ..checks import architecture_mismatch, heads_mismatch, with_config_differences
from ..engine.activations import required_tokens
from ..engine.learned import objective_for
from ..engine.residual import NO_STREAM, mode_refusal
from ..io import recipe as recipe_mod
from ..io.card import CARD_FILES
from ..io.hf import Checkpoint, CheckpointError, check_output, family_of, spec_for
from ..io.loading import PipelineError
from ..options import AlignOptions
from ..pytree import flatten
from ..spec import bind
from .run import RunOptions, aligning_spec, checked
from .streamed import stream_call


def check_out(out, sources: list[Checkpoint], output_bytes: int, run: RunOptions) -> None:
    """OUT checked before any weight is read: not a source folder, not existing without
    `run.overwrite`, writable, with room for the weights on its disk."""
    try:
        check_output(out, [ck.source for ck in sources], overwrite=run.overwrite, output_bytes=output_bytes, overwrite_option=run.overwrite_option,
                     writes=("config.json", *CARD_FILES))
    except (FileExistsError, NotADirectoryError, PermissionError) as e:
        raise PipelineError(f"OUT: {e}") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise PipelineError(f"OUT: {e.strerror or e}") from None
        raise


def same_architecture(anchor: Checkpoint, other: Checkpoint, what: str, anchor_what: str = "the anchor") -> None:
    shapes = lambda ck: {p: np.shape(x) for p, x in flatten(ck.params).items()}  # noqa: E731
    named = f"{anchor_what} ({anchor.source})", f"{what} ({other.source})"
    heads = spec_for(anchor).heads, spec_for(other).heads
    problem = (architecture_mismatch((named[0], anchor.family, shapes(anchor)), (named[1], other.family, shapes(other)), heads)
               or heads_mismatch((named[0], heads[0]), (named[1], heads[1])))
    problem = with_config_differences(problem, {anchor_what: anchor.model_config.raw, what: other.model_config.raw})
    if problem:
        raise PipelineError(problem)


def check_rotation(checkpoint: Checkpoint, options: dict) -> None:
    """residual="rotation" on a post-norm family, "signed_permutation" on a LayerNorm one, any mode on
    a model whose record moves no stream (with the record's reason), refused from the config alone;
    on a model of several streams, where none of them takes it (the mode is a ceiling there:
    `engine.residual.stream_modes`)."""
    mode = options.get("residual")
    if mode in (None, "none", "auto"):
        return
    streams = spec_for(checkpoint).streams
    if not streams:  # the record moves no stream, and says why (Marian's rebuilt sinusoids)
        config = checkpoint.model_config
        raise PipelineError(f"{checkpoint.family}: residual={mode!r}: " + ("; ".join(family_of(config).left_out(config)) or NO_STREAM))
    if mode == "permutation":
        return
    if len(streams) > 1:  # a ceiling: a rotation needs each gain's readers, which the bound streams know
        streams = bind(spec_for(checkpoint), checkpoint.params).streams
    refusal = mode_refusal(streams, mode)
    if refusal:
        raise PipelineError(f"{checkpoint.family}: {refusal}")


def data_batches(options: AlignOptions, data, anchor: Checkpoint, max_memory, data_option: str) -> list | None:
    """The batches a data-driven alignment runs on, checked against the model from its config
    and headers alone (token ids in the vocabulary, image shapes, enough tokens), or None."""
    if options.method == "weights":
        if data is not None:
            raise PipelineError(f"{data.file}: data drives method='activations'; method='weights' reads only the weights")
        return None
    if data is None:
        raise PipelineError(f"method={options.method!r} matches the models' activations on data: give {data_option}")
    if max_memory is not None:
        stream_call(rj.streaming.streamed_options, options)  # refused, with the reason
    batches = checked(recipe_mod.batches, data, anchor)
    check_alignment_data(batches, anchor, options, data.file)
    return batches


def check_alignment_data(batches: list, anchor: Checkpoint, options: AlignOptions, file) -> None:
    """Batches a data-driven alignment cannot use refused from the config alone: inputs the model
    cannot read, too few tokens to determine the sites."""
    tokens = 0
    for i, batch in enumerate(batches):
        tokens += checked(anchor.check_batch, batch, f"{file}: batch {i}")
    need, why = required_tokens(bind(aligning_spec(anchor), anchor.params), options)
    if tokens < need:
        raise PipelineError(f"{file}: {tokens} tokens (padding excluded); matching from activations needs at least {need}: {why}")
    _check_learning(batches, anchor, options)


def _check_learning(batches: list, anchor: Checkpoint, options: AlignOptions) -> None:
    """method="learned" refused from the config alone: no task head with logits, the task
    objective without labels, too few batches for the held-out split."""
    if options.method != "learned":
        return
    try:
        objective = objective_for(anchor, batches, options.objective)
        if objective == "task":
            checked(recipe_mod.loss_fn, anchor, batches)  # labels the head can score
    except (CheckpointError, ValueError) as e:
        raise PipelineError(str(e)) from None
    held = max(1, round(options.holdout * len(batches))) if options.holdout > 0 else 0
    if held >= len(batches):
        raise PipelineError(f"method='learned' holds out {held} of {len(batches)} batches for early stopping and trains on the rest: "
                            "give more data (or a smaller --batch-size), or --holdout 0")
