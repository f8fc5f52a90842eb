"""Models of different FFN widths, one embedded in the other's (Theus et al.'s semi-permutations,
the injective case): the narrower model's FFN padded with hidden units whose weights are all zero.
Such a unit reads act(0) (its input rows and bias are zero) and writes nothing (its output rows
are zero), so the padded model computes exactly the narrow one's function; aligning it then
permutes its units onto the wider model's (the padding onto the units it has no match for), and a
merge is a checkpoint of the wider architecture."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputError
from ..pytree import flatten, unflatten
from ..spec import bind
from .hf import Checkpoint, family_of, read_config, spec_for

# The config.json keys of the FFN width, across the families (GPT-2's n_inner may be null: 4 d).
WIDTH_KEYS = ("intermediate_size", "n_inner", "hidden_dim", "ffn_dim")


def ffn_width(checkpoint: Checkpoint) -> int | None:
    """The FFN width (hidden units per layer) of a model whose FFN is one permutation group of one
    size (dense FFNs), else None."""
    bound = bind(spec_for(checkpoint), checkpoint.params)
    sizes = {g.size for g in bound.perms}
    return sizes.pop() if len(sizes) == 1 and not bound.experts else None


def widen(checkpoint: Checkpoint, width: int) -> Checkpoint:
    """The same model with `width` FFN units per layer: its own first, then zero units (the same
    function, exactly). Raises InputError for a narrower `width`, a model without one dense FFN
    width, or a config whose width key rotsym_jax does not know. Params of shapes (`load_hf(
    weights=False)`) get the new shapes. The result keeps its folder for the files beside the
    weights (tokenizer), but its tensors are no longer the folder's: it is not streamed."""
    current = ffn_width(checkpoint)
    if current is None:
        raise InputError(f"{checkpoint.family}: its FFN is not one group of hidden units of one width (a mixture of experts?): it "
                         "cannot be widened")
    if width == current:
        return checkpoint
    if width < current:
        raise InputError(f"widen: {width} FFN units is narrower than the model's {current}: a model is embedded in a wider one, never cut")
    raw = checkpoint.model_config.raw
    keys = [k for k in WIDTH_KEYS if k in raw] or list(WIDTH_KEYS)
    config = None
    for key in keys:
        candidate = read_config({**raw, key: width}, f"{checkpoint.source or checkpoint.family}: config.json",
                                checkpoint.model_config.record)
        if _width_of(candidate, checkpoint) == width:
            config = candidate
            break
    if config is None:
        raise InputError(f"{checkpoint.family}: no config key of the FFN width found (tried {list(WIDTH_KEYS)}); it cannot be widened")
    bound = bind(spec_for(checkpoint), checkpoint.params)
    axes = {p: m.axis for g in bound.perms for m in g.members for p in m.paths}
    shapes = family_of(config).shapes(config, checkpoint.layout)
    flat = {}
    for path, leaf in flatten(checkpoint.params).items():
        if path not in axes:
            flat[path] = leaf
        elif isinstance(leaf, jax.ShapeDtypeStruct):
            flat[path] = jax.ShapeDtypeStruct(shapes[path], leaf.dtype)
        else:
            pad = [(0, 0)] * leaf.ndim
            pad[axes[path]] = (0, width - current)
            flat[path] = jnp.pad(jnp.asarray(leaf), pad)
    wrong = sorted(p for p, x in flat.items() if tuple(np.shape(x)) != tuple(shapes.get(p, ())))
    if wrong:  # a width key that changes more than the FFN: not this family's width
        raise InputError(f"{checkpoint.family}: widening the FFN to {width} gives leaves {wrong[:4]} other shapes than its config says")
    return dataclasses.replace(checkpoint, model_config=config, params=unflatten(flat))


def _width_of(config, checkpoint: Checkpoint) -> int | None:
    shapes = family_of(config).shapes(config, checkpoint.layout)
    return ffn_width(dataclasses.replace(checkpoint, model_config=config,
                                         params=unflatten({p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in shapes.items()})))


def widen_together(checkpoints: list) -> tuple[list, dict | None]:
    """The checkpoints (None entries kept) with every FFN as wide as the widest, where their widths
    differ; and what was done ({"width": the common width, "widened": {index: its own width}}),
    else None."""
    widths = {i: ffn_width(ck) for i, ck in enumerate(checkpoints) if ck is not None}
    known = {w for w in widths.values() if w is not None}
    if len(known) < 2:
        return list(checkpoints), None
    width = max(known)
    widened = {i: w for i, w in widths.items() if w is not None and w < width}
    return [widen(ck, width) if i in widened else ck for i, ck in enumerate(checkpoints)], {"width": width, "widened": widened}
