"""Euclidean distances between two models, in total, per kind and per layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..precision import exact, exact_jit, is_traced
from ..pytree import flatten, layer_chunks
from ..spec import BoundSpec, bind


def sq_dists(leaves_a, leaves_b) -> dict:
    """{path: squared distance} of every leaf of `leaves_a` (float32 differences), dispatched: a
    program per leaf shape, which every layer, every leaf of that shape and every model with
    leaves of that shape shares (a program per layer's leaves, as this was, compiled once per
    family: 187 programs in the conformance tests against a few dozen shapes). One leaf's sum does
    not depend on which other leaves are summed beside it (the streamed alignment sums subsets),
    and its program is the one that leaf had in a layer's program: the same bits."""
    return {p: _leaf_sq_dist(leaves_a[p], leaves_b[p]) for chunk in layer_chunks(leaves_a) for p in chunk}


@exact_jit
def _leaf_sq_dist(a, b):
    return jnp.sum(jnp.square(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32)))


@exact
def distance_report(spec_or_bound, params_a, params_b) -> dict:
    """Euclidean distances ||A - B||: {"total": {kind: d, "total": d}, "layers": {layer: {...}}}.

    Kinds: "qk" (Q and K leaves), "vo" (V and O leaves), each permutation group (e.g. "ffn"), and
    "other" (everything else: embeddings, norms, the O bias, an untied LM head).

    Differences are taken in float32. Two pytrees of NumPy arrays are measured on the host, each
    leaf's squares summed in float64 (no compilation: a program over every leaf takes longer to
    compile than the host takes to sum a model of tens of millions of entries); other inputs by
    jitted programs (one per layer, see `sq_dists`), summed in float32."""
    bound = bind(spec_or_bound, params_b)
    flat_a, flat_b = flatten(params_a), flatten(params_b)
    if all(isinstance(x, np.ndarray) for x in (*flat_a.values(), *flat_b.values())):
        return summarise_distances(bound, {p: host_sq_dist(flat_a[p], flat_b[p]) for p in flat_a})
    return summarise_distances(bound, jax.device_get(sq_dists(flat_a, flat_b)))


_HOST_CHUNK = 1 << 16  # entries: a float64 chunk of differences stays in the cache


def host_sq_dist(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b||^2, the differences in float32, their squares summed in float64, in chunks: one
    difference array the size of a MiniLM took 0.3 s to allocate and touch, the chunks 0.04 s."""
    a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    total = 0.0
    for start in range(0, a.size, _HOST_CHUNK):
        chunk = slice(start, start + _HOST_CHUNK)
        d = (a[chunk].astype(np.float32, copy=False) - b[chunk].astype(np.float32, copy=False)).astype(np.float64)
        total += float(np.dot(d, d))
    return total


def summarise_distances(bound: BoundSpec, sq: dict) -> dict:
    """`distance_report`'s dict from the squared distance of every leaf: Python floats from host
    values, scalar arrays from traced ones (inside jit / vmap)."""
    traced = is_traced(sq)
    value_of, sqrt = ((lambda v: v), jnp.sqrt) if traced else (float, lambda v: float(np.sqrt(v)))
    kinds, layer_of = dict(bound.kinds), dict(bound.leaf_layers)
    total: dict = {}
    per_layer: dict = {}
    for path, v in sq.items():
        value, kind = value_of(v), kinds[path]
        total[kind] = total.get(kind, 0.0) + value
        layer = layer_of[path]
        if layer is not None:
            per_layer.setdefault(layer, {})
            per_layer[layer][kind] = per_layer[layer].get(kind, 0.0) + value
    root = lambda d: {**{k: sqrt(v) for k, v in d.items()}, "total": sqrt(sum(d.values()))}
    return {"total": root(total), "layers": {l: root(d) for l, d in per_layer.items()}}


def before_after(before: dict, after: dict) -> dict:
    """The report of an alignment from two `summarise_distances` dicts: "before" and "after" (the
    totals per kind) and "layers" ({layer: {"before": ..., "after": ...}})."""
    layers = {l: {"before": before["layers"][l], "after": after["layers"][l]} for l in before["layers"]}
    return {"before": before["total"], "after": after["total"], "layers": layers}
