"""Models of different widths, one embedded in the other's (Theus et al.'s semi-permutations, the
injective case): the narrower model padded with FFN hidden units, or attention heads (kv groups),
whose weights are all zero. Such a unit reads act(0) (its input rows and bias are zero) and writes
nothing (its output rows are zero); such a head attends somewhere and adds nothing (its values and
output rows are zero). So the padded model computes exactly the narrow one's function; aligning it
then permutes its units and heads onto the wider model's (the padding onto those it has no match
for), and a merge is a checkpoint of the wider architecture."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..checks import is_head
from ..errors import InputError
from ..families.vlm import VisionLanguageFamily
from ..pytree import flatten, unflatten
from ..spec import bind
from .hf import Checkpoint, family_of, read_config, spec_for

# The config.json keys of the FFN width, across the families (GPT-2's n_inner may be null: 4 d).
WIDTH_KEYS = ("intermediate_size", "n_inner", "hidden_dim", "ffn_dim")


@dataclasses.dataclass(frozen=True)
class Widths:
    """A dense model's widths: FFN hidden units per layer, kv groups, query heads per group, head size
    (Q/K's) and value size (V/O's, `HeadGeometry.v_dim`: MLA's v_head_dim may differ), None where the
    model has no such group."""

    ffn: int | None
    kv_heads: int | None
    heads_per_group: int | None
    head_dim: int | None
    value_dim: int | None = None


def _text_groups(checkpoint: Checkpoint, groups) -> list:
    """The groups whose widths are the model's: a vision–language model's are its text model's (its tower's and its
    projector's keep theirs, which the text config does not set)."""
    if not isinstance(family_of(checkpoint.model_config), VisionLanguageFamily):
        return list(groups)
    return [g for g in groups if not all(p.startswith(("vision/", "projector/")) for m in g.members for p in m.paths)]


def _geometry(checkpoint: Checkpoint, bound=None):
    """The heads' geometry where every (text) attention block has the same, else None."""
    bound = bind(spec_for(checkpoint), checkpoint.params) if bound is None else bound
    geometries = {b.geometry for b in _text_groups(checkpoint, bound.attention)}
    return geometries.pop() if len(geometries) == 1 else None


def widths_of(checkpoint: Checkpoint) -> Widths:
    bound = bind(spec_for(checkpoint), checkpoint.params)
    sizes = {g.size for g in _text_groups(checkpoint, bound.perms)}
    ffn = sizes.pop() if len(sizes) == 1 and not bound.experts else None
    geo = _geometry(checkpoint, bound)
    if geo is None:
        return Widths(ffn, None, None, None, None)
    return Widths(ffn, geo.num_kv_heads, geo.heads_per_group, geo.head_dim, geo.v_dim)


def ffn_width(checkpoint: Checkpoint) -> int | None:
    """The FFN width (hidden units per layer) of a model whose FFN is one permutation group of one
    size (dense FFNs), else None."""
    return widths_of(checkpoint).ffn


def widen(checkpoint: Checkpoint, width: int | None = None, *, kv_heads: int | None = None) -> Checkpoint:
    """The same model with `width` FFN units per layer and `kv_heads` kv groups of attention heads
    (None: as it is): its own first, then zero units and zero heads (the same function, exactly).
    Raises InputError for a narrower width, a model without one dense FFN width (a mixture of
    experts), heads whose size follows the width (head_dim = d / heads: GPT-2, BERT), a QK-norm
    over all heads at once, or a config whose keys rotsym_jax does not know. Params of shapes
    (`load_hf(weights=False)`) get the new shapes. The result keeps its folder and records the
    config the folder's tensors were written by (`stored_config`), so that a streamed read pads
    each tensor as this pads the leaves."""
    own = widths_of(checkpoint)
    changes = {}
    if width is not None and width != own.ffn:
        if own.ffn is None:
            raise InputError(f"{checkpoint.family}: its FFN is not one group of hidden units of one width (a mixture of experts?): it "
                             "cannot be widened")
        if width < own.ffn:
            raise InputError(f"widen: {width} FFN units is narrower than the model's {own.ffn}: a model is embedded in a wider one, never cut")
        changes["ffn"] = width
    if kv_heads is not None and kv_heads != own.kv_heads:
        if own.kv_heads is None or kv_heads < own.kv_heads:
            raise InputError(f"widen: {kv_heads} kv groups, the model has {own.kv_heads}: a model is embedded in a wider one, never cut")
        changes["heads"] = kv_heads
    if not changes:
        return checkpoint
    config = _config(checkpoint, own, changes)
    bound = bind(spec_for(checkpoint), checkpoint.params)
    if "heads" in changes and any(b.geometry.qk_norm == "full" for b in bound.attention):
        raise InputError(f"{checkpoint.family}: its QK-norm normalises every head at once, so a zero head would change the others: "
                         "its heads cannot be widened")
    axes = {p: m.axis for g in (*bound.perms, *bound.attention) for m in g.members for p in m.paths}
    shapes = family_of(config).shapes(config, checkpoint.layout)
    flat = {}
    for path, leaf in flatten(checkpoint.params).items():
        new = tuple(shapes.get(path, ()))
        if path not in axes or tuple(np.shape(leaf)) == new:
            flat[path] = leaf
        elif isinstance(leaf, jax.ShapeDtypeStruct):
            flat[path] = jax.ShapeDtypeStruct(new, leaf.dtype)
        else:
            pad = [(0, 0)] * leaf.ndim
            pad[axes[path]] = (0, new[axes[path]] - leaf.shape[axes[path]])
            flat[path] = jnp.pad(jnp.asarray(leaf), pad)
    wrong = sorted(p for p, x in flat.items() if tuple(np.shape(x)) != tuple(shapes.get(p, ())))
    if wrong:
        raise InputError(f"{checkpoint.family}: widened to {changes}, leaves {wrong[:4]} would need other shapes than zero units or heads "
                         "give (a head size that follows the model width, d / heads?)")
    return dataclasses.replace(checkpoint, model_config=config, params=unflatten(flat),
                               stored_config=checkpoint.stored_config or checkpoint.model_config)


def _config(checkpoint: Checkpoint, own: Widths, changes: dict):
    """The config with the new widths, its keys found by what they change: a candidate holds where the
    model it describes has the new widths and every head as the model's own (Q/K's and V/O's widths,
    RoPE's), only more of them."""
    raw = checkpoint.model_config.raw
    where = f"{checkpoint.source or checkpoint.family}: config.json"
    record = checkpoint.model_config.record
    nested = isinstance(raw.get("text_config"), dict)  # a vision-language model's widths are its text model's
    text = raw["text_config"] if nested else raw
    own_geometry = _geometry(checkpoint)
    heads = [{}]
    if "heads" in changes:
        text["num_attention_heads"] = changes["heads"] * own.heads_per_group
        text["num_key_value_heads"] = changes["heads"]
        # the config's own head keys first: a head_dim key may be another width's name (GLM-4.7-Flash's
        # maps head_dim onto qk_rope_head_dim); else head_dim kept where it follows the width / heads (absent or null)
        heads = [{}] if text.get("head_dim") is not None else [{}, {"head_dim": own.head_dim}]
    candidates = [k for k in WIDTH_KEYS if k in text] or list(WIDTH_KEYS) if "ffn" in changes else [None]
    refused = None
    for key in candidates:
        for head in heads:
            widened = {**text, **head, **({key: changes["ffn"]} if key else {})}
            try:
                config = read_config({**raw, "text_config": widened} if nested else widened, where, record)
            except InputError as e:  # e.g. a head size that follows the width / heads and no longer divides it
                refused = e
                continue
            shapes = family_of(config).shapes(config, checkpoint.layout)
            candidate = dataclasses.replace(checkpoint, model_config=config,
                                            params=unflatten({p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in shapes.items()}))
            got = widths_of(candidate)
            if got.ffn != changes.get("ffn", own.ffn) or got.kv_heads != changes.get("heads", own.kv_heads):
                continue
            geometry = _geometry(candidate)
            if own_geometry is None or (geometry is not None and geometry == dataclasses.replace(
                    own_geometry, num_heads=geometry.num_heads, num_kv_heads=geometry.num_kv_heads)):
                return config
    raise InputError(f"{checkpoint.family}: no config of its widths {changes} found (tried the keys {list(WIDTH_KEYS)} and "
                     f"num_attention_heads / num_key_value_heads with the heads' widths kept: head_dim {own.head_dim}, values "
                     f"{own.value_dim}); it cannot be widened") from refused


def widen_together(checkpoints: list) -> tuple[list, dict | None]:
    """The checkpoints (None entries kept) with every FFN as wide as the widest and as many kv
    groups as the most, where they differ (and the heads' size and grouping agree); and what was
    done ({"width", "kv_heads": the common ones, None where they agree, "widened": {index: {"ffn",
    "kv_heads": its own}}}),
    else None."""
    fixed = [_unwidened_shapes(ck) for ck in checkpoints if ck is not None]
    common = set.intersection(*(set(f) for f in fixed)) if fixed else set()
    if any(f[p] != fixed[0][p] for f in fixed for p in common):  # another model width: zero units cannot make them one
        return list(checkpoints), None
    widths = {i: widths_of(ck) for i, ck in enumerate(checkpoints) if ck is not None}
    ffns = {w.ffn for w in widths.values()} - {None}
    heads = {w.kv_heads for w in widths.values()} - {None}
    same_heads = len({(w.heads_per_group, w.head_dim, w.value_dim) for w in widths.values()}) == 1
    width = max(ffns) if len(ffns) > 1 else None
    kv_heads = max(heads) if len(heads) > 1 and same_heads else None
    if width is None and kv_heads is None:
        return list(checkpoints), None
    widened = {i: {"ffn": w.ffn, "kv_heads": w.kv_heads} for i, w in widths.items()
               if (width is not None and w.ffn is not None and w.ffn < width) or (kv_heads is not None and w.kv_heads < kv_heads)}
    out = [widen(ck, width, kv_heads=kv_heads) if i in widened else ck for i, ck in enumerate(checkpoints)]
    return out, {"width": width, "kv_heads": kv_heads, "widened": widened}


def _unwidened_shapes(checkpoint: Checkpoint) -> dict:
    """{leaf: shape, the axis `widen` pads None}, task heads aside: what models must agree on
    (where both have the leaf) for zero units and heads to make them one architecture. Models
    that differ there are left as they are, for the architecture check to say how."""
    bound = bind(spec_for(checkpoint), checkpoint.params)
    axes = {p: m.axis for g in (*bound.perms, *bound.attention) for m in g.members for p in m.paths}
    return {p: tuple(None if k == axes.get(p) else n for k, n in enumerate(np.shape(x)))
            for p, x in flatten(checkpoint.params).items() if not is_head(p)}
