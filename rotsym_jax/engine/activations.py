"""Alignment from activations (MATH.md §10): both models run on the same inputs, and every symmetry
site is matched by what flows through it instead of by the weights.

Each site's activations are what its group acts on, so a transform of B moves them exactly as it
moves the weights: head h's queries and keys `x W_q^h + b_q^h` (before RoPE, which commutes with
the QK group), its values and the attention output that enters O (`ctx^h`, moved by the VO
transform), an FFN's hidden units after the activation (the input of its down projection), and
the residual stream as every stream reader sees it (the input of each kernel that reads the
stream: the norms' outputs, or the stream itself after a post-norm). A symmetry transform of B
keeps everything else, so the sites do not interact: one forward pass of each model gives all of
them, and each is solved by the closed form weight matching uses, on activation cross products.

`pseudo_leaves` makes that literal: it writes each group's activations where the weight solvers
read the member leaves (q/k/v kernels: their outputs, rows = tokens; the O kernel: the
transposed attention output; a permutation group's unit-axis kernel: its standardised input, so
that the cost is the units' correlation; every other member: zeros), and the engine's solvers
run unchanged: per-head Procrustes, RoPE pairs, GQA groups, head permutations, rescaling and the
FFN assignments (with the certificate) all come from the same code as weight matching.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import rotsym_jax as rj

from ..errors import InputError, RotsymError
from ..memory import release_freed_memory
from ..options import AlignOptions
from ..precision import exact_jit
from ..pytree import flatten
from ..spec import GAIN_ROLES, ROPE_KEY_ROLE, ROPE_QUERY_ROLE, BoundSpec

# The attention roles whose kernels' outputs are sites (heads on axis 1): Q, K, V and MLA's RoPE
# query and shared RoPE key (before RoPE, which commutes with their rotations per rotary pair)
SITE_ROLES = ("q", "k", "v", ROPE_QUERY_ROLE, ROPE_KEY_ROLE)

# The fewest tokens (rows) that determine a site: a rotation of width n needs n independent rows.
MIN_TOKENS = 2


class DataError(RotsymError, ValueError):
    """Data that cannot drive a data-based alignment: none, too few tokens, or inputs the model
    cannot read."""


class Sites(NamedTuple):
    """One model's activations on the data, as the solvers read them: `leaves`, the groups'
    pseudo-leaves (`pseudo_leaves`, on the device); `stream`, {kernel path: (tokens, d)} of the
    residual stream readers' distinct inputs (`residual_cross`); `tokens`, the rows the data gave."""

    leaves: dict
    stream: dict
    tokens: int


def sites(checkpoint, params, batches, bound: BoundSpec, what: str, options: AlignOptions) -> Sites:
    """`params`'s activations over every batch (padding rows removed), on the host: every linear
    layer's input a site needs and the outputs of the attention kernels, turned into the groups'
    pseudo-leaves one site at a time, and the stream readers' inputs, each distinct one kept once
    (Q, K and V read one: the first path in order). `checkpoint`'s forward pass runs `params` (a
    model of its architecture). Stream readers the forward pass does not run (a head it does not
    run) are left out; all of them with residual="none" (no residual transform to solve). Each
    group's kind says which site each of its pseudo-leaves is made of under `options`
    (`pseudo_leaves`)."""
    needed, outputs = _needed(bound)
    stream = stream_reads(bound) if options.residual != "none" else set()
    reads = stream - needed
    flat = flatten(params)
    parts: dict[str, list] = {}
    # The base model runs (every site is in it): the models' heads may differ, or be set aside.
    base = dataclasses.replace(checkpoint, layout=dataclasses.replace(checkpoint.layout, head=None))
    body = {k: v for k, v in params.items() if k not in HEAD_KEYS}
    for i, batch in enumerate(batches):
        inputs, _ = checkpoint.split_batch(batch, f"{what}: data[{i}]")
        _, xs = rj.nets.layers.record_dense_inputs(base.graphdef, body, inputs, True)
        missing = sorted(needed - set(xs))
        if missing:
            raise DataError(f"{what}: the forward pass of {checkpoint.family} does not run {missing[:3]}: activations match only "
                            "the sites the model computes")
        mask = inputs.get("attention_mask")
        distinct = set()  # the stream readers' distinct inputs: Q, K and V read one, kept once
        for path in sorted(needed | (reads & set(xs))):
            x = np.asarray(xs[path], np.float32)
            rows = x.reshape(-1, *x.shape[2:]) if x.ndim >= 3 else x  # (tokens, ...): an expert's site is (tokens, E, f)
            if mask is not None and x.ndim >= 3 and mask.shape == x.shape[:2]:
                rows = rows[np.asarray(mask, bool).reshape(-1)]
            if path in outputs:
                bias = flat.get(_sibling(path, "bias"))
                out = rows @ np.asarray(flat[path], np.float32)
                parts.setdefault(path + OUT, []).append(out if bias is None else out + np.asarray(bias, np.float32))
            # an attention kernel's (or router's) input is a site only as a stream read (`residual_cross`)
            if path in stream:
                key = (rows.shape, hashlib.sha1(np.asarray(rows, order="C")).hexdigest())
                if key in distinct:
                    continue
                distinct.add(key)
            elif path in outputs:
                continue
            parts.setdefault(path, []).append(rows)
        del xs
        release_freed_memory()  # the batch's recorded inputs: freed, but glibc would keep their pages
    if not parts:
        raise DataError(f"{what}: the data holds no batch")
    # Joined path by path, each path's parts freed as it is joined, and each site freed as its
    # pseudo-leaf is made: the parts, the whole and the leaves at once were three times the sites'
    # memory (377 MB of sites for MiniLM on 4096 tokens).
    acts = {}
    for p in list(parts):
        acts[p] = np.concatenate(parts.pop(p))
        release_freed_memory()
    tokens = max(len(x) for x in acts.values())
    kept = {p: acts.pop(p) for p in sorted(stream & set(acts))}
    leaves = pseudo_leaves(bound, acts, params, options)
    release_freed_memory()
    return Sites(leaves, kept, tokens)


OUT = "#out"
# The top-level keys of a task head: the base model runs without them.
HEAD_KEYS = ("head", "lm_head")


def _sibling(path: str, name: str) -> str:
    return path.rsplit("/", 1)[0] + "/" + name


def _needed(bound: BoundSpec) -> tuple[set, set]:
    """(kernel paths whose inputs the sites need, attention kernels whose outputs they need)."""
    inputs, outputs = set(), set()
    for group in bound.groups:
        if any(m.layer_axis is not None for m in group.members):
            raise InputError(f"group {group.name}: its layers are scanned into one leaf; activation matching needs a leaf per layer")
        sites = rj.kinds.of(group).activations
        sites.check(group, dict(bound.shapes))
        for member in group.members:
            for path in member.paths:
                if not path.endswith("/kernel"):
                    continue
                read_in, read_out = sites.reads(group, member)
                if read_in:
                    inputs.add(path)
                if read_out:
                    outputs.add(path)
    return inputs, outputs


def stream_reads(bound: BoundSpec) -> set:
    """The kernels that read the residual stream (the stream on their input axis 0)."""
    return {p for s in bound.streams for p, axis in s.axes if axis == 0 and p.endswith("/kernel")}


def standardised(x: np.ndarray) -> np.ndarray:
    """Each column centred and scaled to unit norm over the rows (its correlation with another
    column is then their inner product); a constant column becomes zeros."""
    x = x - x.mean(axis=0, keepdims=True)  # the one copy: the rest in place (a site is 25 MB on MiniLM)
    norm = np.sqrt(np.sum(x * x, axis=0, keepdims=True))
    np.divide(x, np.where(norm > 0, norm, 1.0), out=x)
    np.copyto(x, 0.0, where=~(norm > 0))
    return x.astype(np.float32, copy=False)


def pseudo_leaves(bound: BoundSpec, acts: dict, params, options: AlignOptions) -> dict:
    """{member path: array} for every group's members: the activations where the weight solvers
    read leaves (the module docstring), zeros elsewhere, each with the member leaf's tagged axis
    where it is, as each group's kind makes them (`Kind.activations`: with ffn="scaled", a gated
    FFN's up kernel holds the hidden units as they are, kinds/scaled_units.py); a full-width
    QK-norm's gains, which carry the QK scale after the norm where no site sees it, as they are in
    `params`. On the device, so that the solvers do not copy them again.

    `acts` ({site: array}, the caller's own) is emptied as it goes: each site is dropped once the
    last member that reads it has its leaf, so that a model's sites and its leaves are not held
    at once."""
    out, flat = {}, flatten(params)
    members = [(group, member, path) for group in bound.groups for member in group.members for path in member.paths]
    readers = collections.Counter(_site(*m, acts, options) for m in members)
    for group, member, path in members:
        if member not in group.reads:  # a latent's reader: its pseudo-leaf is the attention block's (the latent's cost leaves it out)
            continue
        if member.role in GAIN_ROLES:
            out[path] = jnp.asarray(flat[path], jnp.float32)
            continue
        site = _site(group, member, path, acts, options)
        out[path] = jax.device_put(_pseudo(group, member, path, None if site is None else acts[site]))
        if site is not None:
            readers[site] -= 1
            if not readers[site]:
                del acts[site]
    return out


def _site(group, member, path, acts, options: AlignOptions) -> str | None:
    """The key of the site in `acts` that `path`'s pseudo-leaf is made of (None: zeros)."""
    key = None if member not in group.reads else rj.kinds.of(group).activations.site(group, member, path, options)
    return key if key in acts else None


def _pseudo(group, member, path, x):
    """The pseudo-leaf of `path` from its site `x` (None: zeros): its kind's."""
    return rj.kinds.of(group).activations.pseudo(group, member, path, x)


def zeros_leaf(member, path: str, size: int) -> np.ndarray:
    """The pseudo-leaf of a member that carries nothing of the site: zeros, the tagged axis (`size`)
    kept, the others of size 1 (as many as reach it: a convolution's kernel holds it on axis 2)."""
    shape = [1] * max(1 if path.endswith("/bias") else 2, member.axis + 1)
    shape[member.axis] = size
    return np.zeros(tuple(shape), np.float32)


def one_sided_vo(cross):
    """A layer's stacked QK/VO cross products (`attention.stacked_cross`) with the VO pair's two
    sides as one: from activations the values and the heads' outputs (O's input) both move as
    x S c under the VO transform (S, c), where O's weights move as S^T / c. The rotation is the
    same (polar of the sum); the scale becomes the least-squares one of both
    (`rescale_sequential` with one side empty). V/O of its own width: its own stack."""
    if isinstance(cross, dict):
        return {**cross, "vo": _one_sided(cross["vo"], 0)}
    return _one_sided(cross, 1)  # the pair's index on axis -3 (attention.PAIRS)


@functools.partial(exact_jit, static_argnums=1)  # one program per shape: eagerly, each of its updates compiled its own
def _one_sided(cross, vo):
    ma, mb, s_aa, s_bb = cross
    return (ma.at[..., vo, :, :].add(mb[..., vo, :, :]), mb.at[..., vo, :, :].set(0),
            s_aa.at[..., vo].add(s_bb[..., vo]), s_bb.at[..., vo].set(0))


def residual_cross(stream, stream_a: dict, stream_b: dict, standardise: bool) -> np.ndarray:
    """M = sum over `stream`'s readers' distinct inputs (`Sites.stream`: every stream's) of X_B^T X_A
    (d, d): the stream as the readers see it, each coordinate standardised first for a permutation."""
    d = stream.size
    m = np.zeros((d, d), np.float64)
    readers = {p for p, axis in stream.axes if axis == 0}
    for path in sorted(set(stream_a) & set(stream_b) & readers):
        xa, xb = stream_a[path], stream_b[path]
        if standardise:
            xa, xb = standardised(xa), standardised(xb)
        m += np.asarray(xb, np.float64).T @ np.asarray(xa, np.float64)
    return m.astype(np.float32)


def required_tokens(bound: BoundSpec, options) -> tuple[int, str]:
    """(the fewest tokens that determine every site, why): a rotation of width n needs at least n
    independent rows (else part of it is arbitrary), a correlation at least two."""
    widths = {"two rows for a correlation": MIN_TOKENS}
    if options.attention != "none":
        for block in bound.attention:
            widths[f"the head width of {block.name}"] = max(block.geometry.head_dim, block.geometry.v_dim)
    for stream in bound.streams if options.residual == "rotation" else ():
        widths["the model width (residual='rotation')" if len(bound.streams) == 1 else f"the width of stream {stream.name!r} (residual='rotation')"] = stream.size
    need, why = max((w, k) for k, w in widths.items())
    return need, why


def check_enough(bound: BoundSpec, tokens: int, options) -> None:
    """DataError when the data's `tokens` cannot determine the sites (`required_tokens`)."""
    need, why = required_tokens(bound, options)
    if tokens < need:
        raise DataError(f"the data holds {tokens} tokens (rows, padding excluded); matching from activations needs at least {need}: "
                        f"{why}. Give more or longer examples")
