"""V/O heads of another width than Q/K's (`HeadGeometry.value_dim`, MLA's v_head_dim != qk_nope_head_dim):
a custom model whose values are 6 wide and keys 4, with GQA, checked against its own forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rotsym_jax as rj
from rotsym_jax import HeadGeometry, Spec, SpecError
from rotsym_jax.engine import attention as al

L, D, H, KV, DH, DV, F = 2, 16, 4, 2, 4, 6, 12
GEO = HeadGeometry(num_heads=H, num_kv_heads=KV, head_dim=DH, value_dim=DV)
SPEC = Spec(
    rules=(
        (r"blocks/(\d+)/attn/q", (None, "attn.q")),
        (r"blocks/(\d+)/attn/k", (None, "attn.k")),
        (r"blocks/(\d+)/attn/v", (None, "attn.v")),
        (r"blocks/(\d+)/attn/vb", ("attn.v",)),
        (r"blocks/(\d+)/attn/o", ("attn.o", None)),
        (r"blocks/(\d+)/mlp/fc1", (None, "ffn")),
        (r"blocks/(\d+)/mlp/fc2", ("ffn", None)),
        (r"emb", None),
    ),
    heads={"attn": GEO},
)


def params(seed):
    rng = np.random.default_rng(seed)
    w = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)  # noqa: E731
    layer = lambda: {"attn": {"q": w(D, H * DH), "k": w(D, KV * DH), "v": w(D, KV * DV), "vb": w(KV * DV), "o": w(H * DV, D)},  # noqa: E731
                     "mlp": {"fc1": w(D, F), "fc2": w(F, D)}}
    return {"blocks": {i: layer() for i in range(L)}, "emb": w(10, D)}


def forward(p, ids):
    """GQA attention (query head h reads kv group h // (H / KV)), values DV wide, keys DH, then a ReLU MLP."""
    x = p["emb"][ids]
    for layer in p["blocks"].values():
        a = layer["attn"]
        q = (x @ a["q"]).reshape(-1, KV, H // KV, DH)
        k, v = (x @ a["k"]).reshape(-1, KV, DH), (x @ a["v"] + a["vb"]).reshape(-1, KV, DV)
        att = jax.nn.softmax(jnp.einsum("tgrd,sgd->grts", q, k) / np.sqrt(DH), axis=-1)
        x = x + jnp.einsum("grts,sgd->tgrd", att, v).reshape(-1, H * DV) @ a["o"]
        x = x + jax.nn.relu(x @ layer["mlp"]["fc1"]) @ layer["mlp"]["fc2"]
    return x


IDS = np.arange(7) % 10


def _rel(a, b):
    fa, fb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return float(np.sqrt(sum(np.sum((np.asarray(x) - np.asarray(y)) ** 2) for x, y in zip(fa, fb))
                         / sum(np.sum(np.asarray(x) ** 2) for x in fa)))


def test_geometry_gives_each_role_its_width_and_one_width_one_spelling():
    assert GEO.role_shape("q") == (KV, H // KV, DH) and GEO.role_shape("k") == (KV, 1, DH)
    assert GEO.role_shape("v") == (KV, 1, DV) and GEO.role_shape("o") == (KV, H // KV, DV)
    assert HeadGeometry(4, 4, 8, value_dim=8) == HeadGeometry(4, 4, 8) and HeadGeometry(4, 4, 8, value_dim=8).value_dim is None
    with pytest.raises(SpecError, match="value_dim=0"):
        HeadGeometry(4, 4, 8, value_dim=0)
    bad = params(0)
    bad["blocks"][0]["attn"]["o"] = bad["blocks"][0]["attn"]["o"][: H * DH]
    with pytest.raises(SpecError, match=r"expected 24 = 2 kv groups x 2 heads x 6 value_dim"):
        rj.bind(SPEC, bad)


@pytest.mark.usefixtures("float32_models")
def test_a_planted_transform_keeps_the_function_and_align_undoes_it():
    a = params(0)
    planted = rj.random_transform(SPEC, a, jax.random.key(3))
    t = planted["attn"]
    assert t.qk.shape == (L, KV, DH, DH) and t.vo.shape == (L, KV, DV, DV)
    b = rj.apply_transform(SPEC, a, planted)
    assert _rel(a, b) > 0.1
    np.testing.assert_allclose(forward(b, IDS), forward(a, IDS), rtol=1e-5, atol=1e-5)
    result = rj.align(a, b, SPEC, heads="permute", rescale="joint")
    assert _rel(a, result.params) <= 1e-5  # QK and VO (and heads, scales, units) recovered
    moved = result.report["moved"]["attn"]
    assert moved["qk"] > 0.1 and moved["vo"] > 0.1 and moved["heads"] > 0
    for rescale in ("none", "sequential"):  # the other solves of the two stacks: the rotations alone come back
        rotated = rj.apply_transform(SPEC, a, rj.random_transform(SPEC, a, jax.random.key(4), ("heads", "qk", "vo")))
        assert _rel(a, rj.align(a, rotated, SPEC, heads="permute", rescale=rescale).params) <= 1e-5


def test_invertible_maps_and_the_dimension_permutation_baseline_on_two_widths():
    a = params(1)
    kinds = ("heads", "qk", "vo", "qk_invertible", "vo_invertible")
    planted = rj.random_transform(SPEC, a, jax.random.key(5), kinds, max_log_scale=0.3)
    assert planted["attn"].vo_inv.shape == (L, KV, DV, DV)
    b = rj.apply_transform(SPEC, a, planted)
    np.testing.assert_allclose(forward(b, IDS), forward(a, IDS), rtol=1e-4, atol=1e-4)
    result = rj.align(a, b, SPEC, heads="permute", maps="invertible", ffn="none", fallback=False)
    assert _rel(a, result.params) < 1e-2 * _rel(a, b)
    np.testing.assert_allclose(forward(result.params, IDS), forward(a, IDS), rtol=1e-3, atol=1e-3)
    # dims permuted within each head (QK over 4, VO over 6): a planted permutation of each comes back
    rng = np.random.default_rng(2)
    perm = lambda n: jnp.asarray(np.stack([np.stack([np.eye(n)[:, rng.permutation(n)] for _ in range(KV)]) for _ in range(L)]), jnp.float32)  # noqa: E731
    identity = rj.identity_transform(rj.bind(SPEC, a))
    permuted = rj.apply_transform(SPEC, a, {**identity, "attn": identity["attn"].replace(qk=perm(DH), vo=perm(DV))})
    back = rj.align(a, permuted, SPEC, attention="permutation", rescale="none", ffn="none")
    assert _rel(a, back.params) <= 1e-6


def test_head_scores_of_two_widths_are_those_of_each():
    """The head-permutation score of QK (4 wide) and VO (6 wide): the sum of each one's nuclear norm (zero padding keeps both)."""
    rng = np.random.default_rng(0)
    qk, vo = rng.normal(size=(3, DH, DH)).astype(np.float32), rng.normal(size=(3, DV, DV)).astype(np.float32)
    expected = np.linalg.svd(qk, compute_uv=False).sum(-1) + np.linalg.svd(vo, compute_uv=False).sum(-1)
    np.testing.assert_allclose(np.asarray(al.head_scores(jnp.asarray(qk), jnp.asarray(vo), None)), expected, rtol=1e-5)


def test_ot_fusion_transports_heads_of_two_widths():
    """OT fusion's features of a head are its Q/K slices (4 wide) beside its V/O slices (6 wide): B = A with its heads and FFN
    units permuted, fused with A (hard transport, weights 1:1), is A; and fused with another model its output has A's shapes."""
    a = params(0)
    b = rj.apply_transform(SPEC, a, rj.random_transform(SPEC, a, jax.random.key(6), ("heads", "perm")))
    assert _rel(a, b) > 0.1
    assert _rel(a, rj.otfusion.ot_fuse([a, b], SPEC).params) <= 1e-6
    fused = rj.otfusion.ot_fuse([a, params(1)], SPEC, transport="soft").params
    assert jax.tree.map(np.shape, fused) == jax.tree.map(np.shape, a)
