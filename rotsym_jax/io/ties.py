"""Tied tensors stored as their own: an LM head that shares the token embedding, untied.

A tied head reads the final norm through the embedding's own weights, so that norm's gain cannot
be folded and a rotation of the residual stream would change the function (MATH §10). Untied, the
head is a kernel of its own (`diag(g) E^T` once folded) and every orthogonal map of the stream
applies; the price is the head's bytes, written once more. The untied checkpoint reads the head
from the stored tensor it was tied to (`Checkpoint.aliases`), so a streamed run reads no file
twice and writes `tie_word_embeddings: false` with the head beside the embedding."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputError
from ..families.family import Layout
from ..pytree import flatten, unflatten
from ..spec import bind
from .hf import TIE_KEY, Checkpoint, family_of, spec_for, untied_config


def tied_names(checkpoint: Checkpoint) -> dict[str, str]:
    """{HF name: our leaf} of the tensors this checkpoint's head ties to another (none once untied):
    not the ties a model has without its head (an encoder–decoder's stacks sharing one embedding),
    which untying leaves, so a T5 whose LM head is its own has none."""
    family, config = family_of(checkpoint.model_config), checkpoint.model_config
    headless = family.tied(config, dataclasses.replace(checkpoint.layout, head=None))
    return {k: v for k, v in family.tied(config, checkpoint.layout).items() if k not in headless}


def _untied_config(checkpoint: Checkpoint):
    """(config, family, {HF name: leaf} that untying frees) of the checkpoint with `TIE_KEY` false,
    or None where that frees no head or the family has no untied form (BART, Whisper). Ties that
    stay (an encoder–decoder's stacks sharing one embedding) are not a head's: they stay."""
    config = untied_config(checkpoint.model_config, f"{checkpoint.source or checkpoint.family}: config.json")
    if config is None:
        return None
    family = family_of(config)
    staying = family.tied(config, checkpoint.layout)
    freed = {k: v for k, v in tied_names(checkpoint).items() if k not in staying}
    return (config, family, freed) if freed else None


def can_untie(checkpoint: Checkpoint) -> bool:
    return not tied_names(checkpoint) or _untied_config(checkpoint) is not None


def blocks_rotation(checkpoint: Checkpoint) -> bool:
    """Whether a tied head reads a norm gain that cannot be folded (the final norm, read through
    the shared embedding): then a rotation of the residual stream needs the head untied."""
    return bool(tied_names(checkpoint)) and any(not readers for _, readers in stream_folds(checkpoint))


def stream_folds(checkpoint: Checkpoint):
    spec = spec_for(checkpoint)
    return () if spec.residual is None else tuple(f for s in bind(spec, checkpoint.params).streams for f in s.folds)


def untie(checkpoint: Checkpoint) -> Checkpoint:
    """The same model with every tied tensor (a causal LM's head, tied to the token embedding)
    stored as its own leaf: config.json's `tie_word_embeddings` false, the head a copy of the
    tensor it was tied to, in the head's own layout (`lm_head/kernel`, (d, V)), and saved in that
    tensor's stored dtype. Computes the same function (transformers loads the saved folder and
    returns the same logits). A checkpoint whose params are shapes (`load_hf(weights=False)`)
    gets the head's shape; one with nothing tied is returned as it is. Raises InputError for a
    head that stays tied without the key (a family that ties otherwise)."""
    ties = tied_names(checkpoint)
    if not ties:
        return checkpoint
    untied = _untied_config(checkpoint)
    if untied is None:
        raise InputError(f"untie: {checkpoint.family} ties {sorted(ties)} otherwise than by {TIE_KEY} (or has no untied form); they "
                         "cannot be untied here")
    config, family, ties = untied
    return _with_copies(checkpoint, config, checkpoint.layout, ties, family.tensors(config, checkpoint.layout))


def _with_copies(checkpoint: Checkpoint, config, layout, copies: dict[str, str], rules) -> Checkpoint:
    """The checkpoint under `config` and `layout`, each tied tensor of `copies` ({HF name: the
    leaf it was tied to}) stored as its own leaf (its `rules`' leaves): a copy of that leaf as
    transformers stores it (the tied tensor itself), read from that tensor's stored name
    (`Checkpoint.aliases`) and in its stored dtype; shapes where the params are shapes."""
    family = family_of(checkpoint.model_config)
    tied_rules = family.tensors(checkpoint.model_config, checkpoint.layout)
    by_name = {r.hf: r for r in rules}
    shapes = family.shapes(config, layout)
    flat = dict(flatten(checkpoint.params))
    dtypes = dict(checkpoint.stored_dtypes)
    aliases = dict(checkpoint.aliases)
    for hf_name, target in copies.items():
        source = next(r for r in tied_rules if target in r.ours)
        copy = by_name[hf_name]
        leaves = tuple(flat[p] for p in source.ours)
        if isinstance(leaves[0], jax.ShapeDtypeStruct):
            made = tuple(jax.ShapeDtypeStruct(shapes[p], leaves[0].dtype) for p in copy.ours)
        else:  # the copy as transformers stores it (the tied tensor itself), in the copy's own layout
            made = tuple(np.asarray(x) for x in copy.to_ours(source.to_hf(tuple(np.asarray(x) for x in leaves))))
        for path, leaf in zip(copy.ours, made):
            flat[path] = leaf if isinstance(leaf, jax.ShapeDtypeStruct) else jnp.asarray(leaf)
            dtypes[path] = checkpoint.stored_dtypes.get(target, checkpoint.dtype)
        aliases[hf_name] = aliases.get(source.hf, source.hf)
    return dataclasses.replace(checkpoint, model_config=config, layout=layout, params=unflatten(flat), stored_dtypes=dtypes, aliases=aliases)


def untied_bytes(checkpoint: Checkpoint) -> int:
    """The bytes untying adds to a saved checkpoint: each tied tensor once more, in its stored dtype."""
    flat = flatten(checkpoint.params)
    return sum(int(np.prod(np.shape(flat[t]))) * np.dtype(checkpoint.stored_dtypes.get(t, checkpoint.dtype)).itemsize
               for t in freed_ties(checkpoint).values())


def freed_ties(checkpoint: Checkpoint) -> dict[str, str]:
    """{HF name: leaf} of the tied tensors untying stores as their own (a head's, not an
    encoder–decoder's stacks sharing one embedding)."""
    untied = _untied_config(checkpoint)
    return {} if untied is None else untied[2]


def untie_together(checkpoints: list[Checkpoint], residual: str | None) -> tuple[list[Checkpoint], dict | None]:
    """The checkpoints as a run aligns and merges them: every tied one untied where a rotation of
    the residual stream (`residual`) meets a tied head that reads the final norm
    (`blocks_rotation`), or where others are untied already (a model aligned with a rotation
    beside its tied original: one architecture then). Also what untying costs the output
    ({"tensors": HF names, "bytes": added, "note": why}, from the first tied one), else None."""
    tied = [ck for ck in checkpoints if ck is not None and tied_names(ck)]
    if not tied or not all(can_untie(ck) for ck in tied):  # no untied form: a rotation then needs the head's gain uniform
        return list(checkpoints), None
    rotating = residual == "rotation" and any(blocks_rotation(ck) for ck in tied)
    untied = [ck for ck in checkpoints if ck is not None and not tied_names(ck)]
    beside_untied = False
    if untied and not rotating:  # a family that ties otherwise than by the key (DistilBERT) has no untied form: never asked to
        heads = set(flatten(untie(tied[0]).params)) - set(flatten(tied[0].params))  # the leaves an untied head adds
        beside_untied = any(heads <= set(flatten(ck.params)) for ck in untied)
    if not rotating and not beside_untied:
        return list(checkpoints), None
    cost = {"tensors": sorted(freed_ties(tied[0])), "bytes": untied_bytes(tied[0])}
    cost["note"] = untie_note(cost, rotating)
    return [untie(ck) if ck is not None else None for ck in checkpoints], cost


def untie_note(cost: dict, rotating: bool = True) -> str:
    """One sentence for the run's progress and its model card: what was untied, why, and the bytes."""
    shown = _shown(cost["bytes"])
    why = ("a rotation of the residual stream folds the final norm's gain into the head, which a head sharing the embedding's weights "
           "cannot take. --residual permutation keeps the tie." if rotating else "the other models store their heads untied.")
    return (f"The LM head ({', '.join(cost['tensors'])}) is untied from the token embedding and stored as a tensor of its own "
            f"(tie_word_embeddings: false; {shown} more): {why}")


def apart_layout(family, config, layout: Layout, leaves) -> Layout:
    """`layout`, reading as tables of their own the stored tied copies (`Family.read_apart`: T5's
    stacks' embed_tokens, its LM head) whose leaves are all among `leaves`: the layout a model's
    leaves say it has (an Orbax checkpoint's params), or the one of models that hold such tables
    beside it. `layout` itself where no tied copy's leaves are there."""
    have, names = None, set()
    for name in family.tied(config, layout):
        apart = family.read_apart(config, layout, {name})
        if apart is None:  # (most families: a tied copy has no place of its own)
            continue
        have = set(family.shapes(config, layout)) if have is None else have
        added = set(family.shapes(config, apart)) - have
        if added and added <= set(leaves):
            names.add(name)
    return (family.read_apart(config, layout, names) or layout) if names else layout


def read_apart(checkpoint: Checkpoint, leaves) -> Checkpoint:
    """The same model read in `apart_layout` (its tied copies whose leaves are among `leaves` read
    as tables of their own), each such table a copy of the tensor it is tied to: transformers
    computes with a copy equal to its source as with the source (it ties the two), so the function
    is the same. Read from the source's stored tensor (`Checkpoint.aliases`), as `untie` reads a
    head; saved, the tables are stored apart. The checkpoint itself where nothing is read apart."""
    family, config = family_of(checkpoint.model_config), checkpoint.model_config
    layout = apart_layout(family, config, checkpoint.layout, leaves)
    if layout == checkpoint.layout:
        return checkpoint
    after = family.tied(config, layout)
    copies = {k: v for k, v in family.tied(config, checkpoint.layout).items() if k not in after}
    return _with_copies(checkpoint, config, layout, copies, family.tensors(config, layout))


def read_apart_together(checkpoints: list[Checkpoint]) -> tuple[list[Checkpoint], dict | None]:
    """The checkpoints (None entries kept) in one layout where some hold a tied copy as a table of
    its own and others tie it (a Flan-T5 as released, whose stacks embed with `shared`, beside a
    fine-tune saved with its stacks' tables apart): each model that ties it read with the copy
    apart (`read_apart`). Also what changed ({"tensors": the HF names read apart, "leaves": their
    leaves, "bytes": what storing them adds to a model that tied them, "note"}), else None."""
    held = {p for ck in checkpoints if ck is not None for p in flatten(ck.params)}
    out = [None if ck is None else read_apart(ck, held) for ck in checkpoints]
    changed = [(ck, new) for ck, new in zip(checkpoints, out) if ck is not None and new is not ck]
    if not changed:
        return list(checkpoints), None
    freed = {name: n.aliases[name] for c, n in changed for name in n.aliases.keys() - c.aliases.keys()}  # {copy: its stored source}
    ck, new = changed[0]
    before, after = flatten(ck.params), flatten(new.params)
    size = sum(int(np.prod(np.shape(after[p]))) * np.dtype(new.stored_dtypes.get(p, new.dtype)).itemsize for p in after.keys() - before.keys())
    leaves = sorted({p for c, n in changed for p in flatten(n.params).keys() - flatten(c.params).keys()})
    cost = {"tensors": sorted(freed), "leaves": leaves, "bytes": size}
    cost["note"] = read_apart_note(cost, sorted(set(freed.values())))
    return out, cost


def read_apart_note(cost: dict, sources: list[str]) -> str:
    """One sentence for the run's progress and its model card: which tied copies were read apart, why, and the bytes."""
    them, their = ("them", "their") if len(cost["tensors"]) > 1 else ("it", "its")
    source = ", ".join(sources)
    return (f"{', '.join(cost['tensors'])}: some models store {them} apart from {source}, others tie {them} to {source}: those are "
            f"read with copies of {source} in {their} place (the same function: transformers ties a copy equal to its source), and "
            f"the output stores {them} apart ({_shown(cost['bytes'])} more than tied).")


def _shown(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size:,} bytes"
