"""What a run tells the user that is not an error (the run goes on): configs that differ, the
changes that made the models one architecture, options that do less than they say on this model."""

from __future__ import annotations

import numpy as np

import rotsym_jax as rj

from ..checks import CONFIG_KEYS_OF_NO_ARCHITECTURE, config_differences
from ..io.loading import Progress
from ..io.reconcile import notes as change_notes
from ..pytree import flatten
from ..spec import MIXTURE, bind

# Config keys the shape checks and width notes cover, besides those that name, label or train a
# model: a difference in any other key (hidden_act, rope_theta, rope_scaling, norm eps...) changes
# what the tensors compute, and OUT keeps one model's.
_CONFIG_KEYS_NOTED_ELSEWHERE = CONFIG_KEYS_OF_NO_ARCHITECTURE | {
    "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "n_inner", "n_head"}


def note_config_differences(progress: Progress, models: list, kept: str) -> None:
    """Checkpoints of one family but other model types (llama and mistral) are aligned and merged
    as the tensors they share, as are checkpoints whose configs compute otherwise (another
    activation, RoPE base or scaling): the user should know the configs differ."""
    types = {what: ck.model_config.model_type for what, ck in models}
    if len(set(types.values())) > 1:
        progress.note(f"note: the models' types differ ({', '.join(f'{w}: {t}' for w, t in types.items())}); their tensors and shapes "
                      f"agree, so they are read as {models[0][1].family} checkpoints; OUT keeps {kept}'s config")
    differ, shown = config_differences({what: ck.model_config.raw for what, ck in models}, _CONFIG_KEYS_NOTED_ELSEWHERE,
                                       skip=("model_type",))  # noted above
    if differ:
        progress.note(f"note: the models' configs differ in what their tensors compute ({shown}); OUT keeps {kept}'s config, "
                      "so it computes as that model's does")


def note_changes(progress: Progress, changes: dict) -> None:
    for note in change_notes(changes):
        progress.note(f"note: {note}")


def note_alignment(progress: Progress, options: dict, moving: list) -> None:
    """Every note on what the alignment `options` do on these models ((name, checkpoint) pairs, the
    first's groups standing for all: one architecture): align, merge and a mergekit config each
    call this one, so a note added here is said by every path."""
    note_headless_residual(progress, options, moving)
    note_folded_frame(progress, options)
    note_unscaled_ffn(progress, options, moving[0][1])


def note_unscaled_ffn(progress: Progress, options: dict, ck) -> None:
    """--ffn scaled on a model with no gated FFN group solves its permutations alone: said, not silent."""
    if options.get("ffn") != "scaled":
        return
    bound = bind(rj.spec_for(ck), {p: np.broadcast_to(np.zeros((), np.int8), x.shape) for p, x in flatten(ck.params).items()})  # shapes alone
    if not any(g.scaled for g in bound.perms):
        names = list(dict.fromkeys(g.names for g in bound.experts))  # what each experts block is (Mamba-2's: SSM heads)
        why = "; ".join(f"{n.block}: their {n.unit}s are never scaled" for n in names) or "no gate: a unit's scale would pass its activation"
        units = (["FFN units"] if bound.perms or MIXTURE in names else []) + [f"{n.expert}s' {n.unit}s" for n in names if n != MIXTURE]
        progress.note(f"note: --ffn scaled: this {ck.model_config.model_type} model has no gated FFN group ({why}), so its {' and '.join(units)} are permuted only")


def note_headless_residual(progress: Progress, options: dict, models: list) -> None:
    """A model without a task head outputs the residual stream itself: aligning the stream moves
    its last hidden state into the new basis (what a head reading it would compute is kept)."""
    headless = [what for what, ck in models if ck.layout.head is None]
    if options.get("residual", "none") != "none" and headless:
        progress.note(f"note: {', '.join(headless)} {'has' if len(headless) == 1 else 'have'} no task head, so with --residual the last "
                      "hidden state comes out in the aligned basis (its features permuted or rotated); what a head reading it computes "
                      "is unchanged")


def note_folded_frame(progress: Progress, options: dict) -> None:
    """A rotation of the stream folds the norms first: the distances are between the folded models
    (the same functions), not the models as stored (a new-user trial saw "before" change)."""
    if options.get("residual") == "rotation":
        progress.note("note: --residual rotation folds every model's norm gains (and LayerNorm biases) into the layers that read them "
                      "before aligning (the same functions): the distances are the folded models'")
    if options.get("latents") == "rotation":
        progress.note("note: --latents rotation folds each MLA latent norm's gain into the rows that read the latent before aligning "
                      "(the same functions): the distances are the folded models'")
