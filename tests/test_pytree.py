"""The pytree helpers: memory hygiene (what they return is freed as soon as the caller drops it) and
the fingerprint's digest."""

import gc
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

import rotsym_jax as rj
from rotsym_jax import pytree
from rotsym_jax.pytree import flatten, unflatten


def _freed_without_gc(make):
    """Whether the array `make(leaf)` keeps is freed by reference counting alone (no collector),
    once the caller drops the result: a reference cycle would keep it until a collection."""
    gc.collect()
    gc.disable()
    try:
        leaf = np.ones((4, 3), np.float32)
        alive = weakref.ref(leaf)
        result = make(leaf)
        del leaf, result
        return alive() is None
    finally:
        gc.enable()


def test_flatten_leaves_no_reference_cycle():
    # A recursive closure in flatten once held every flattened array until the collector ran:
    # a streamed merge's row blocks piled up, 50 MB each, on a 3B-parameter model.
    assert _freed_without_gc(lambda x: flatten({"a": {"b": x, "c": {"d": x}}}))
    assert _freed_without_gc(lambda x: unflatten(flatten({"a": {"0": x}})))


def test_merge_results_freed_without_gc():
    assert _freed_without_gc(lambda x: rj.merge.average([{"w": x}, {"w": x + 1}]))


@pytest.mark.parametrize("host_signed", [0, 10**9], ids=["device", "host"])
def test_a_fingerprint_sees_every_change_and_not_how_leaves_are_held(host_signed, monkeypatch):
    """Signed on the device (a program per layer) or on the host (small leaves): a changed entry or
    two swapped entries change the digest; the same values as NumPy or JAX arrays, signed whole or
    a layer at a time (as a streamed run gathers them), do not."""
    monkeypatch.setattr(pytree, "_HOST_SIGNED", host_signed)
    rng = np.random.default_rng(0)
    flat = {f"layers/{i}/w": rng.standard_normal((5, 7)).astype(np.float32) for i in range(2)} | {"embed": rng.standard_normal(9).astype(np.float32)}
    digest = pytree.fingerprint(flat)
    assert pytree.fingerprint({p: jnp.asarray(x) for p, x in flat.items()}) == digest
    layer_by_layer = {}
    for part in (["layers/0/w"], ["layers/1/w", "embed"]):
        layer_by_layer.update(pytree.leaf_signatures({p: flat[p] for p in part}))
    assert pytree.signature_digest(layer_by_layer) == digest
    changed, swapped = dict(flat), dict(flat)
    changed["layers/1/w"] = flat["layers/1/w"].copy()
    changed["layers/1/w"][4, 6] += 1e-3
    swapped["embed"] = flat["embed"][[1, 0, *range(2, 9)]]
    assert len({digest, pytree.fingerprint(changed), pytree.fingerprint(swapped)}) == 3


def test_small_leaves_are_signed_on_the_host_and_large_ones_on_the_device(monkeypatch):
    """The rule reads a leaf's size alone: at the threshold, the host; past it, a program."""
    monkeypatch.setattr(pytree, "_HOST_SIGNED", 35)
    flat = {"small": np.ones((5, 7), np.float32), "large": np.ones((6, 6), np.float32)}
    signed = pytree.leaf_signatures(flat)
    assert signed["small"][2] == pytree._host_signature(flat["small"]).tobytes()
    assert signed["large"][2] == np.asarray(pytree._leaf_signatures([flat["large"]])[0], np.float32).tobytes()
