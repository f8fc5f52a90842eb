"""Merge methods against their formulas, recomputed independently in NumPy (float64) on small
hand-made pytrees; fixed points (copies of one model), RegMean as stacked least squares, statistics
checks, task heads, purity, dtypes and every validation error."""

import copy
import math
import warnings
import zlib

import jax
import ml_dtypes
import numpy as np
import pytest

from rotsym_jax import merge
from rotsym_jax.merging import arithmetic
from rotsym_jax.merging.stats import Stats, StatsError, fingerprint
from rotsym_jax.pytree import flatten

BODY = ("embed", "layers/0/w", "layers/0/b", "layers/1/w", "layers/1/b")
HEAD = ("head/kernel", "head/bias")


def make(seed, labels=3, dtype=np.float32, scale=1.0):
    """A tiny "transformer": an embedding, two layers (integer keys), a classification head. Few
    distinct shapes: each one is a compilation per method."""
    rng = np.random.default_rng(seed)
    r = lambda *shape: (scale * rng.normal(size=shape)).astype(dtype)
    return {
        "embed": r(5, 4),
        "layers": {0: {"w": r(4, 5), "b": r(5)}, 1: {"w": r(5, 4), "b": r(4)}},
        "head": {"kernel": r(4, labels), "bias": r(labels)},
    }


def f64(params):
    return {p: np.asarray(x, np.float64) for p, x in flatten(params).items()}


def assert_tree_close(out, expected, rtol=1e-5, atol=1e-6):
    """out: a params pytree; expected: {path: array}, exactly the paths of out."""
    got = f64(out)
    assert sorted(got) == sorted(expected)
    for path in expected:
        np.testing.assert_allclose(got[path], expected[path], rtol=rtol, atol=atol, err_msg=path)


def stats(kind, values, params, count=10):
    return Stats(kind, values, count, fingerprint(params))


def fisher_stats(params, seed):
    rng = np.random.default_rng(seed)
    values = jax.tree.map(lambda x: rng.uniform(0.01, 2.0, size=x.shape).astype(np.float32), params)
    return stats("fisher", values, params)


def gram_stats(params, seed, paths=("layers/0/w", "layers/1/w"), rows=9):
    rng = np.random.default_rng(seed)
    flat = flatten(params)
    values = {}
    for path in paths:
        x = rng.normal(size=(rows, flat[path].shape[0]))
        values[path] = (x.T @ x).astype(np.float32)
    return stats("gram", values, params)


def ties_np(taus, density):
    """TIES on a list of task-vector arrays (one tensor), the paper's three steps."""
    trimmed = []
    for tau in taus:
        flat = tau.ravel()
        k = max(1, math.ceil(density * flat.size))
        keep = np.argsort(-np.abs(flat), kind="stable")[:k]
        out = np.zeros_like(flat)
        out[keep] = flat[keep]
        trimmed.append(out.reshape(tau.shape))
    t = np.stack(trimmed)
    gamma = np.sign(t.sum(0))
    agree = (np.sign(t) == gamma) & (t != 0)
    count = agree.sum(0)
    return np.where(count > 0, (t * agree).sum(0) / np.maximum(count, 1), 0.0)


def slerp_np(a, b, t):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    cos = np.clip(np.dot(a.ravel(), b.ravel()) / (np.linalg.norm(a) * np.linalg.norm(b)), -1, 1)
    omega = np.arccos(cos)
    return (np.sin((1 - t) * omega) * a + np.sin(t * omega) * b) / np.sin(omega)


# ---- each method against its formula ------------------------------------------------------------

def test_average_uniform_and_weighted():
    models = [make(s) for s in range(3)]
    flats = [f64(m) for m in models]
    out = merge.average(models)
    expected = {p: sum(f[p] for f in flats) / 3 for p in BODY}
    assert_tree_close(out, {**expected, **{p: flats[0][p] for p in HEAD}})

    w = np.array([1.0, 2.0, 5.0])
    out = merge.average(models, weights=[1, 2, 5], task_head="merge")
    assert_tree_close(out, {p: sum(wi * f[p] for wi, f in zip(w, flats)) / 8 for p in BODY + HEAD})
    # Structure preserved, integer layer keys included.
    assert jax.tree.structure(out) == jax.tree.structure(models[0])
    assert set(out["layers"]) == {0, 1}


def test_fisher_formula_with_weights():
    models = [make(s) for s in range(3)]
    fishers = [fisher_stats(m, 10 + i) for i, m in enumerate(models)]
    # Entries that no model is informed about: the weighted mean, through eps.
    for f in fishers:
        f.values["layers"][0]["b"][:2] = 0.0
    eps, w = 1e-3, np.array([0.5, 1.0, 2.5])
    out = merge.fisher(models, fishers, weights=w.tolist(), eps=eps, task_head="merge")
    flats, fs = [f64(m) for m in models], [f64(f.values) for f in fishers]
    expected = {}
    for p in BODY + HEAD:
        num = sum(wi * (f[p] + eps) * m[p] for wi, f, m in zip(w, fs, flats))
        den = sum(wi * (f[p] + eps) for wi, f in zip(w, fs))
        expected[p] = num / den
    assert_tree_close(out, expected)
    weighted = sum(wi * m["layers/0/b"] for wi, m in zip(w, flats)) / w.sum()
    np.testing.assert_allclose(np.asarray(out["layers"][0]["b"])[:2], weighted[:2], rtol=1e-5)
    # Weights matter: uniform weights give another result.
    uniform = merge.fisher(models, fishers, eps=eps)
    assert not np.allclose(np.asarray(uniform["embed"]), expected["embed"], rtol=1e-4)


def test_regmean_formula_alpha_and_jitter():
    models = [make(s) for s in range(3)]
    grams = [gram_stats(m, 20 + i, paths=("layers/0/w",)) for i, m in enumerate(models)]
    alpha, jitter = 0.6, 0.05
    out = merge.regmean(models, grams, alpha=alpha, jitter=jitter)
    flats = [f64(m) for m in models]
    gs = [np.asarray(g.values["layers/0/w"], np.float64) for g in grams]
    shrunk = [alpha * g + (1 - alpha) * np.diag(np.diag(g)) for g in gs]
    s = sum(shrunk)
    s = s + jitter * np.mean(np.diag(s)) * np.eye(len(s))
    w = np.linalg.solve(s, sum(g @ f["layers/0/w"] for g, f in zip(shrunk, flats)))
    expected = {p: sum(f[p] for f in flats) / 3 for p in BODY}  # no Gram: uniform mean
    expected["layers/0/w"] = w
    assert_tree_close(out, {**expected, **{p: flats[0][p] for p in HEAD}}, rtol=1e-4, atol=1e-5)
    # alpha and jitter both matter.
    plain = merge.regmean(models, grams)
    assert not np.allclose(np.asarray(plain["layers"][0]["w"]), w, rtol=1e-3)


def test_regmean_is_stacked_least_squares():
    rng = np.random.default_rng(5)
    models = [make(s) for s in range(3)]
    xs = [rng.normal(size=(n, 4)) for n in (7, 9, 11)]
    grams = [stats("gram", {"layers/0/w": (x.T @ x).astype(np.float32)}, m) for x, m in zip(xs, models)]
    out = merge.regmean(models, grams)
    ws = [f64(m)["layers/0/w"] for m in models]
    lstsq = np.linalg.lstsq(np.vstack(xs), np.vstack([x @ w for x, w in zip(xs, ws)]), rcond=None)[0]
    np.testing.assert_allclose(np.asarray(out["layers"][0]["w"]), lstsq, rtol=1e-4, atol=1e-5)
    # ... which is not the plain average.
    assert not np.allclose(lstsq, sum(ws) / 3, atol=1e-2)


def test_regmean_warns_when_too_little_data_leaves_its_regression_underdetermined():
    """Data spanning fewer directions than a kernel's inputs (one example per model, d_in = 4)
    leaves the summed Gram singular: the solve returns a kernel far larger than any model's (the
    new-user trial's MiniLM merge: 5000x, silently). It warns, naming the kernel and the fix;
    alpha < 1 keeps the diagonal and solves it; enough data does not warn."""
    rng = np.random.default_rng(6)
    models = [make(s) for s in range(2)]
    direction = rng.normal(size=(1, 4))
    few = [stats("gram", {"layers/0/w": (x.T @ x).astype(np.float32)}, m)
           for x, m in zip((direction, direction + 1e-3 * rng.normal(size=(1, 4))), models)]
    with pytest.warns(UserWarning, match=r"regmean: 1 merged kernel\(s\) came out over 10x .*'layers/0/w'.*alpha < 1") as caught:
        broken = merge.regmean(models, few)
    assert len(caught) == 1
    growth = np.linalg.norm(np.asarray(broken["layers"][0]["w"])) / max(np.linalg.norm(np.asarray(m["layers"][0]["w"])) for m in models)
    assert growth > 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merge.regmean(models, few, alpha=0.9)
        xs = [rng.normal(size=(16, 4)) for _ in models]
        merge.regmean(models, [stats("gram", {"layers/0/w": (x.T @ x).astype(np.float32)}, m) for x, m in zip(xs, models)])


def test_task_arithmetic_formula():
    base, models = make(100), [make(s) for s in range(3)]
    out = merge.task_arithmetic(base, models, lam=0.7)
    b, flats = f64(base), [f64(m) for m in models]
    expected = {p: b[p] + 0.7 * sum(f[p] - b[p] for f in flats) for p in BODY}
    assert_tree_close(out, {**expected, **{p: flats[0][p] for p in HEAD}}, atol=1e-5)


def test_ties_hand_example():
    """Trim to 3 of 6 entries, elect signs, average the agreeing survivors (worked by hand)."""
    base = {"layers": {0: {"w": np.full((2, 3), 1.0, np.float32), "b": np.zeros(2, np.float32)}}}
    taus_w = [[4, -1, 2, -3, 0.5, 1], [-2, 3, 1, -5, -0.2, -4], [1, -6, 0.1, 2, 3, -0.5]]
    taus_b = [[1, 0.5], [-1, 0.2], [0, 0]]
    models = [
        {
            "layers": {0: {"w": (1.0 + np.array(tw, np.float32)).reshape(2, 3), "b": np.array(tb, np.float32)}},
            "head": {"kernel": np.full((2, 2), float(i), np.float32)},
        }
        for i, (tw, tb) in enumerate(zip(taus_w, taus_b))
    ]
    # trimmed: [4,0,2,-3,0,0], [0,3,0,-5,0,-4], [0,-6,0,2,3,0]; sum [4,-3,2,-6,3,-4];
    # agreeing means: 4, -6, 2, (-3-5)/2, 3, -4.
    # b: trimmed [1,0], [-1,0], [0,0] (0.5 and 0.2 agree but are trimmed); sum 0: no sign, 0.
    out = merge.ties(base, models, density=0.5, lam=1.0)
    np.testing.assert_allclose(np.asarray(out["layers"][0]["w"]), 1.0 + np.array([[4, -6, 2], [-4, 3, -4]]))
    np.testing.assert_array_equal(np.asarray(out["layers"][0]["b"]), [0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(out["head"]["kernel"]), np.zeros((2, 2)))  # the anchor's
    out = merge.ties(base, models, density=0.5, lam=0.5)
    np.testing.assert_allclose(np.asarray(out["layers"][0]["w"]), 1.0 + 0.5 * np.array([[4, -6, 2], [-4, 3, -4]]))
    # A tiny density still keeps one entry (the largest) per model: 4, -5 (model 1), -6 (model 2).
    out = merge.ties(base, models, density=0.01)
    np.testing.assert_allclose(np.asarray(out["layers"][0]["w"]), 1.0 + np.array([[4, -6, 0], [-5, 0, 0]]))


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e-40, 0.0], ids=["normal", "tiny", "subnormal", "zeros"])
def test_trim_keeps_exactly_the_k_largest_earlier_first(scale):
    """TIES' trim (on the host) against a stable sort: exactly k entries, equal magnitudes kept in
    index order, the input untouched."""
    rng = np.random.default_rng(5)
    x = (np.round(rng.normal(size=(37, 29)) * 2) / 2 * scale).astype(np.float32)  # many equal magnitudes, +-0
    before = x.copy()
    for density in (0.01, 0.2, 0.5, 0.99):
        k = arithmetic._keep_count(density, x.size)
        kept = np.argsort(-np.abs(x).ravel(), kind="stable")[:k]
        expected = np.zeros(x.size, np.float32)
        expected[kept] = x.ravel()[kept]
        np.testing.assert_array_equal(arithmetic._trim(x, density), expected.reshape(x.shape), err_msg=str(density))
    np.testing.assert_array_equal(x, before)


def test_ties_random_against_numpy():
    rng = np.random.default_rng(3)
    base = {"a": rng.normal(size=(4, 7)).astype(np.float32), "b": rng.normal(size=7).astype(np.float32)}
    models = [jax.tree.map(lambda x: (x + rng.normal(size=x.shape)).astype(np.float32), base) for _ in range(4)]
    b, flats = f64(base), [f64(m) for m in models]
    for density, lam in ((0.3, 0.8), (1.0, 1.0)):
        out = merge.ties(base, models, density=density, lam=lam)
        expected = {p: b[p] + lam * ties_np([f[p] - b[p] for f in flats], density) for p in b}
        assert_tree_close(out, expected, atol=1e-5)


def test_dare_without_drop_is_task_arithmetic():
    base, models = make(100), [make(s) for s in range(3)]
    out = merge.dare(base, models, jax.random.key(0), drop=0.0, lam=0.4)
    assert_tree_close(out, f64(merge.task_arithmetic(base, models, lam=0.4)))


DARE_SHAPE = (100, 120)  # the DARE tests' one leaf shape (compilations are per shape)


def dare_masks_np(key, path, n_models, shape, drop):
    """The documented DARE masks of leaf `path`: one Bernoulli(1 - drop) draw of shape
    (n_models, *shape) from fold_in(key, crc32(path)), row i for model i (the keep probability is
    1 - drop in float32, as the kernel computes it)."""
    keep = np.float32(1.0) - np.float32(drop)
    sub = jax.random.fold_in(key, np.uint32(zlib.crc32(path.encode())))
    return np.asarray(jax.random.bernoulli(sub, keep, (n_models, *shape)))


def dare_np(base, models, key, drop, lam=1.0):
    """DARE then task arithmetic in NumPy (float64): {path: merged leaf} from the documented masks;
    each kept entry of tau_i = theta_i - base is scaled by 1 / (1 - drop)."""
    b, flats = f64(base), [f64(m) for m in models]
    out = {}
    for p in b:
        masks = dare_masks_np(key, p, len(flats), b[p].shape, drop)
        taus = [np.where(masks[i], (f[p] - b[p]) / (1.0 - drop), 0.0) for i, f in enumerate(flats)]
        out[p] = b[p] + lam * sum(taus)
    return out


@pytest.mark.parametrize("drop", [0.9, 0.3])
def test_dare_masks_per_model_and_rescale(drop):
    """Model i adds 2^i to every entry (model 0 is the base): the merged delta times 1 - drop is an
    integer whose bits are the masks of the three models, read back without the library's RNG.
    Every kept entry is scaled by exactly 1 / (1 - drop), each model keeps a fraction 1 - drop of
    its entries, with its own mask (independent of the others' and of the other leaf's), and the
    masks are the documented draws."""
    keep = 1.0 - drop
    rng = np.random.default_rng(0)
    shape = DARE_SHAPE  # both leaves one shape: one compilation
    base = {"a": {"w": rng.normal(size=shape).astype(np.float32)}, "b": rng.normal(size=shape).astype(np.float32)}
    models = [jax.tree.map(lambda x, c=c: (x + c).astype(np.float32), base) for c in (0.0, 2.0, 4.0)]
    key = jax.random.key(11)
    out = f64(merge.dare(base, models, key, drop=drop))
    fb = f64(base)
    masks = {}
    for p in ("a/w", "b"):
        code = (out[p] - fb[p]) * keep  # sum_i mask_i 2^i, exactly when the scale is 1 / (1 - drop)
        bits = np.rint(code)
        np.testing.assert_allclose(code, bits, atol=2e-4, err_msg=p)
        assert bits.min() >= 0 and bits.max() <= 6 and not np.any(bits.astype(int) & 1)  # model 0: tau = 0
        m = np.stack([(bits.astype(int) >> i) & 1 for i in (1, 2)]).astype(bool)  # models 1 and 2
        masks[p] = m
        for i in range(2):
            assert abs(m[i].mean() - keep) < 0.01, (p, i, m[i].mean())
        # Independent masks: both kept with probability keep^2, and not the same draw.
        assert abs((m[0] & m[1]).mean() - keep**2) < 0.01, p
        assert abs(np.mean(m[0] != m[1]) - 2 * keep * drop) < 0.01, p
        # The documented draw (rows 1 and 2: the models that add something).
        np.testing.assert_array_equal(m, dare_masks_np(key, p, 3, shape, drop)[1:], err_msg=p)
    assert abs(np.mean(masks["a/w"] != masks["b"]) - 2 * keep * drop) < 0.01  # each leaf its own draw
    # The whole merge, with lam, against the NumPy reference.
    out = merge.dare(base, models, key, drop=drop, lam=0.7)
    assert_tree_close(out, dare_np(base, models, key, drop, lam=0.7), rtol=1e-5, atol=1e-4)


def test_dare_keys():
    base, models = make(100), [make(s) for s in range(3)]
    one = merge.dare(base, models, jax.random.key(7), drop=0.5)
    again = merge.dare(base, models, jax.random.key(7), drop=0.5)
    other = merge.dare(base, models, jax.random.key(8), drop=0.5)
    for p, x in f64(one).items():
        np.testing.assert_array_equal(x, f64(again)[p])
    assert not np.allclose(f64(one)["embed"], f64(other)["embed"])
    # A legacy uint32 key works too.
    tiny = [{"w": np.ones(3, np.float32)}, {"w": np.full(3, 2.0, np.float32)}]
    out = merge.dare(tiny[0], tiny, jax.random.PRNGKey(7), drop=0.0)
    np.testing.assert_allclose(np.asarray(out["w"]), [2.0, 2.0, 2.0])


def test_dare_then_ties():
    """TIES on the rescaled DARE task vectors, each model with its own documented mask: against
    `ties_np` of the deltas masked and rescaled in NumPy (no library output in the reference)."""
    rng = np.random.default_rng(4)
    shape = DARE_SHAPE  # one shape: DARE, and the reference draw, compile per shape
    base = {"w": rng.normal(size=shape).astype(np.float32), "v": rng.normal(size=shape).astype(np.float32)}
    models = [jax.tree.map(lambda x: (x + rng.normal(size=x.shape)).astype(np.float32), base) for _ in range(3)]
    key = jax.random.key(3)
    b, flats = f64(base), [f64(m) for m in models]
    for drop in (0.7, 0.25):
        out = merge.dare(base, models, key, drop=drop, then="ties", density=0.3, lam=0.9)
        expected = {}
        for p in b:
            masks = dare_masks_np(key, p, 3, shape, drop)
            assert 0 < masks.mean() < 1 and not np.array_equal(masks[0], masks[1])
            taus = [np.where(masks[i], (f[p] - b[p]) / (1 - drop), 0.0) for i, f in enumerate(flats)]
            expected[p] = b[p] + 0.9 * ties_np(taus, 0.3)
        assert_tree_close(out, expected, rtol=1e-5, atol=1e-5)
    # drop=0 with then="ties" is TIES.
    out = merge.dare(base, models, key, drop=0.0, then="ties", density=0.3, lam=0.9)
    assert_tree_close(out, {p: b[p] + 0.9 * ties_np([f[p] - b[p] for f in flats], 0.3) for p in b}, rtol=1e-5, atol=1e-5)


def test_slerp_orthogonal_pair_closed_form():
    a, b = make(0), make(1)
    fa, fb = f64(a), f64(b)
    ortho = {}  # b made orthogonal to a, per tensor, with 3 times its norm
    for p in fa:
        x, y = fa[p].ravel(), fb[p].ravel()
        y = y - (y @ x) / (x @ x) * x
        ortho[p] = (3.0 * y / np.linalg.norm(y) * np.linalg.norm(x)).reshape(fa[p].shape)
    b = {
        "embed": ortho["embed"].astype(np.float32),
        "layers": {i: {k: ortho[f"layers/{i}/{k}"].astype(np.float32) for k in "wb"} for i in (0, 1)},
        "head": {k: ortho[f"head/{k}"].astype(np.float32) for k in ("kernel", "bias")},
    }
    fb = f64(b)
    # Omega = pi / 2: weights sin(pi/4) each at t = 0.5; cos/sin of t pi / 2 in general.
    out = merge.slerp(a, b, 0.5, task_head="merge")
    assert_tree_close(out, {p: (fa[p] + fb[p]) / np.sqrt(2) for p in fa}, atol=1e-5)
    out = merge.slerp(a, b, 0.3)
    c, s = np.cos(0.3 * np.pi / 2), np.sin(0.3 * np.pi / 2)
    assert_tree_close(out, {**{p: c * fa[p] + s * fb[p] for p in BODY}, **{p: fa[p] for p in HEAD}}, atol=1e-5)


def test_slerp_generic_pair_and_endpoints():
    a, b = make(0), make(1)
    fa, fb = f64(a), f64(b)
    assert_tree_close(merge.slerp(a, b, 0.3, task_head="merge"), {p: slerp_np(fa[p], fb[p], 0.3) for p in fa}, atol=1e-5)
    assert_tree_close(merge.slerp(a, b, 0.0, task_head="merge"), fa, atol=1e-6)
    assert_tree_close(merge.slerp(a, b, 1.0, task_head="merge"), fb, atol=1e-6)


def test_slerp_falls_back_to_lerp():
    x = np.array([1.0, 2.0, -0.5, 3.0], np.float32)
    y = np.array([-1.0, 0.5, 2.0, 0.25], np.float32)
    a = {"par": x, "anti": x, "zero": np.zeros(4, np.float32), "small": x}
    # "small": an angle of 0.3 rad, sin 0.296 < eps = 0.5 below.
    u, v = x / np.linalg.norm(x), y - (y @ x) / (x @ x) * x
    v = v / np.linalg.norm(v)
    small = (np.cos(0.3) * u + np.sin(0.3) * v) * 2.0
    b = {"par": 3 * x, "anti": -2 * x, "zero": x, "small": small.astype(np.float32)}
    lerp = {p: 0.7 * np.asarray(a[p], np.float64) + 0.3 * np.asarray(b[p], np.float64) for p in a}
    out = merge.slerp(a, b, 0.3, eps=0.5)
    assert_tree_close(out, lerp)
    # With the default eps, the 0.3 rad pair is interpolated on the sphere (and that differs).
    out = merge.slerp(a, b, 0.3)
    np.testing.assert_allclose(np.asarray(out["small"]), slerp_np(a["small"], b["small"], 0.3), rtol=1e-5)
    assert not np.allclose(np.asarray(out["small"]), lerp["small"], rtol=1e-3)
    for p in ("par", "anti", "zero"):
        np.testing.assert_allclose(np.asarray(out[p]), lerp[p], rtol=1e-6, atol=1e-6)


# ---- fixed points: N copies of one model ----------------------------------------------------------

COPIES = 3


def _merge_copies(method, model, base):
    models = [model] * COPIES
    if method == "average":
        return merge.average(models, weights=[1, 2, 3])
    if method == "fisher":
        return merge.fisher(models, [fisher_stats(model, i) for i in range(COPIES)], weights=[3, 1, 1])
    if method == "regmean":
        return merge.regmean(models, [gram_stats(model, i) for i in range(COPIES)])
    if method == "task_arithmetic":
        return merge.task_arithmetic(base, models, lam=1 / COPIES)
    if method == "ties":
        return merge.ties(base, models, density=1.0, lam=1.0)
    if method == "dare":
        return merge.dare(base, models, jax.random.key(0), drop=0.0, lam=1 / COPIES)
    if method == "slerp":
        return merge.slerp(model, model, 0.3, task_head="merge")
    raise AssertionError(method)


@pytest.mark.parametrize("method", ["average", "fisher", "regmean", "task_arithmetic", "ties", "dare", "slerp"])
def test_copies_merge_to_the_model(method):
    model, base = make(0), make(100)
    out = _merge_copies(method, model, base)
    assert_tree_close(out, f64(model), rtol=1e-4 if method == "regmean" else 1e-5, atol=1e-5)


def test_ties_copies_with_trimming():
    """Copies agree everywhere, so TIES returns base + the trimmed task vector: per tensor, the
    ceil(0.3 size) largest-magnitude entries of tau, the rest reset to the base."""
    model, base = make(0), make(100)
    out = merge.ties(base, [model] * COPIES, density=0.3)
    fm, fb = f64(model), f64(base)
    expected = {}
    for p in BODY:
        tau = (fm[p] - fb[p]).ravel()
        k = math.ceil(0.3 * tau.size)
        keep = np.argsort(-np.abs(tau))[:k]
        trimmed = np.zeros_like(tau)
        trimmed[keep] = tau[keep]
        expected[p] = fb[p] + trimmed.reshape(fm[p].shape)
    assert_tree_close(out, {**expected, **{p: fm[p] for p in HEAD}}, atol=1e-5)
    changed = np.sum(~np.isclose(f64(out)["embed"], fb["embed"]))
    assert changed == math.ceil(0.3 * 20)


# ---- statistics ----------------------------------------------------------------------------------

def test_statistics_of_other_params_are_rejected():
    models = [make(0), make(1)]
    moved = jax.tree.map(lambda x: x + 1, models[1])  # e.g. params before alignment
    with pytest.raises(StatsError, match=r"params_list\[1\]"):
        merge.fisher(models, [fisher_stats(models[0], 0), fisher_stats(moved, 1)])
    with pytest.raises(StatsError, match=r"params_list\[1\]"):
        merge.regmean(models, [gram_stats(models[0], 0), gram_stats(moved, 1)])


def test_statistics_of_the_wrong_kind_are_rejected():
    models = [make(0), make(1)]
    fishers = [fisher_stats(m, i) for i, m in enumerate(models)]
    grams = [gram_stats(m, i) for i, m in enumerate(models)]
    with pytest.raises(ValueError, match=r"fishers\[0\] has kind 'gram'"):
        merge.fisher(models, grams)
    with pytest.raises(ValueError, match=r"grams\[0\] has kind 'fisher'"):
        merge.regmean(models, fishers)
    with pytest.raises(ValueError, match="one per model"):
        merge.fisher(models, fishers[:1])


def test_bad_statistics_shapes_and_paths():
    models = [make(0), make(1)]
    bad = [gram_stats(models[0], 0), stats("gram", {"layers/0/w": np.eye(5, dtype=np.float32), "layers/1/w": np.eye(5, dtype=np.float32)}, models[1])]
    with pytest.raises(ValueError, match=r"grams\[1\] has shape \(5, 5\) at 'layers/0/w'.*\(4, 5\).*\(4, 4\)"):
        merge.regmean(models, bad)
    uneven = [gram_stats(models[0], 0), gram_stats(models[1], 1, paths=("layers/0/w",))]
    with pytest.raises(ValueError, match=r"grams\[1\].*missing \['layers/1/w'\]"):
        merge.regmean(models, uneven)
    unknown = [gram_stats(m, i, paths=("layers/0/w",)) for i, m in enumerate(models)]
    for g in unknown:
        g.values["layers/9/w"] = np.eye(4, dtype=np.float32)
    with pytest.raises(ValueError, match="'layers/9/w'.*not a leaf"):
        merge.regmean(models, unknown)
    vector = [stats("gram", {"embed": np.eye(5, dtype=np.float32), "layers/0/b": np.eye(5, dtype=np.float32)}, m) for m in models]
    with pytest.raises(ValueError, match=r"'layers/0/b' has shape \(5,\)"):
        merge.regmean(models, vector)
    fishers = [fisher_stats(m, i) for i, m in enumerate(models)]
    del fishers[1].values["layers"][1]["b"]
    with pytest.raises(ValueError, match=r"fishers\[1\] has no Fisher for leaf 'layers/1/b'"):
        merge.fisher(models, fishers)


# ---- task heads ------------------------------------------------------------------------------------

def test_task_head_anchor_keeps_the_anchors_head_across_label_spaces():
    models = [make(0, labels=3), make(1, labels=5), make(2, labels=2)]
    base = {k: v for k, v in make(100).items() if k != "head"}  # a base model has no task head
    anchor = f64(models[0])
    outs = [
        merge.average(models),
        merge.fisher(models, [fisher_stats(m, i) for i, m in enumerate(models)]),
        merge.regmean(models, [gram_stats(m, i) for i, m in enumerate(models)]),
        merge.task_arithmetic(base, models),
        merge.ties(base, models),
        merge.dare(base, models, jax.random.key(0)),
        merge.slerp(models[0], models[1]),
    ]
    for out in outs:
        got = f64(out)
        for p in HEAD:
            np.testing.assert_array_equal(got[p], anchor[p])


def test_task_head_merge():
    models = [make(0, labels=3), make(1, labels=5)]
    with pytest.raises(ValueError, match=r"'head/bias' has shape \(5,\) in params_list\[1\] but \(3,\).*task_head=\"anchor\""):
        merge.average(models, task_head="merge")
    with pytest.raises(ValueError, match="'head/bias' has shape \\(5,\\) in params_b but \\(3,\\) in params_a.*task_head=\"anchor\""):
        merge.slerp(*models, task_head="merge")
    base = {k: v for k, v in make(100).items() if k != "head"}
    same = [make(0), make(1)]
    with pytest.raises(ValueError, match=r"base does not have the leaves.*missing \['head/bias', 'head/kernel'\]"):
        merge.task_arithmetic(base, same, task_head="merge")
    # Equal label spaces: the head is merged like every other leaf.
    out = f64(merge.average(same, task_head="merge"))
    flats = [f64(m) for m in same]
    for p in HEAD:
        np.testing.assert_allclose(out[p], (flats[0][p] + flats[1][p]) / 2, rtol=1e-6)
    out = f64(merge.task_arithmetic(make(100), same, lam=0.5, task_head="merge"))
    b = f64(make(100))
    np.testing.assert_allclose(out["head/kernel"], b["head/kernel"] + 0.5 * sum(f["head/kernel"] - b["head/kernel"] for f in flats), rtol=1e-5, atol=1e-6)


# ---- purity and dtypes ---------------------------------------------------------------------------

def test_inputs_are_not_mutated():
    models, base = [make(0), make(1), make(2)], make(100)
    fishers = [fisher_stats(m, i) for i, m in enumerate(models)]
    grams = [gram_stats(m, i) for i, m in enumerate(models)]
    before = copy.deepcopy((models, base, [f.values for f in fishers], [g.values for g in grams]))
    outs = [
        merge.average(models),
        merge.fisher(models, fishers),
        merge.regmean(models, grams),
        merge.task_arithmetic(base, models),
        merge.ties(base, models),
        merge.dare(base, models, jax.random.key(0)),
        merge.slerp(*models[:2]),
    ]
    after = (models, base, [f.values for f in fishers], [g.values for g in grams])
    assert jax.tree.structure(before) == jax.tree.structure(after)
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(x, y)
    # The result shares no container with the inputs: editing it leaves the anchor alone.
    for out in outs:
        out["head"]["kernel"] = None
        out["layers"][0].clear()
    assert models[0]["head"]["kernel"] is not None and "w" in models[0]["layers"][0]


def test_output_dtype_is_the_anchors():
    """A bfloat16 anchor gives bfloat16 leaves for every method (computed in float32), and a
    float32 anchor float32 ones. One shape per tree: a compilation per method and dtype."""
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)

    def tiny(dtype):
        r = lambda: rng.normal(size=(4, 4)).astype(dtype)
        return {"layers": {0: {"w": r()}}, "head": {"kernel": r()}}

    models, base = [tiny(bf16), tiny(np.float32), tiny(np.float32)], tiny(np.float32)
    fishers = [fisher_stats(m, i) for i, m in enumerate(models)]
    grams = [gram_stats(m, i, paths=("layers/0/w",)) for i, m in enumerate(models)]
    outs = {
        "average": merge.average(models),
        "fisher": merge.fisher(models, fishers),
        "regmean": merge.regmean(models, grams),
        "task_arithmetic": merge.task_arithmetic(base, models),
        "ties": merge.ties(base, models),
        "dare": merge.dare(base, models, jax.random.key(0)),
        "slerp": merge.slerp(models[0], models[1]),
    }
    for method, out in outs.items():
        assert {leaf.dtype for leaf in flatten(out).values()} == {np.dtype(bf16)}, method
    # The values: float32 arithmetic rounded once to bfloat16.
    flats = [f64(m) for m in models]
    expected = (sum(f["layers/0/w"] for f in flats) / 3).astype(np.float32).astype(bf16).astype(np.float64)
    np.testing.assert_allclose(np.asarray(outs["average"]["layers"][0]["w"], np.float64), expected, rtol=1e-2, atol=1e-2)
    assert not np.allclose(expected, flats[0]["layers/0/w"], rtol=1e-2)
    # A float32 anchor with bfloat16 others: float32.
    out = merge.average([models[1], models[0]])
    assert {leaf.dtype for leaf in flatten(out).values()} == {np.dtype(np.float32)}


# ---- validation errors -----------------------------------------------------------------------------

def test_structure_and_shape_mismatches_name_the_leaf():
    a, b = make(0), make(1)
    del b["layers"][1]["b"]
    with pytest.raises(ValueError, match=r"params_list\[1\] does not have the leaves.*missing \['layers/1/b'\]"):
        merge.average([a, b])
    c = make(2)
    c["layers"][0]["extra"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"params_list\[2\].*extra \['layers/0/extra'\]"):
        merge.average([a, make(1), c])
    d = make(3)
    d["layers"][1]["w"] = np.zeros((5, 6), np.float32)
    with pytest.raises(ValueError, match=r"'layers/1/w' has shape \(5, 6\) in params_list\[1\] but \(5, 4\) in params_list\[0\]"):
        merge.ties(make(100), [a, d])
    with pytest.raises(ValueError, match=r"'layers/1/w' has shape \(5, 6\) in base"):
        merge.task_arithmetic(d, [a, make(1)])
    with pytest.raises(ValueError, match=r"'layers/1/w' has shape \(5, 6\) in params_b"):
        merge.slerp(a, d)


def _call(method, **options):
    models, base = [make(0), make(1)], make(100)
    if method == "average":
        return merge.average(models, **options)
    if method == "fisher":
        return merge.fisher(models, [fisher_stats(m, i) for i, m in enumerate(models)], **options)
    if method == "regmean":
        return merge.regmean(models, [gram_stats(m, i) for i, m in enumerate(models)], **options)
    if method == "dare":
        return merge.dare(base, models, options.pop("key", jax.random.key(0)), **options)
    if method == "slerp":
        return merge.slerp(*models, **options)
    return getattr(merge, method)(base, models, **options)


@pytest.mark.parametrize(
    "method, options, message",
    [
        ("average", dict(weights=[1, -1]), r"weights=.*>= 0"),
        ("average", dict(weights=[0, 0]), r"weights=.*positive sum"),
        ("average", dict(weights=[1, 2, 3]), r"weights has shape \(3,\).*\(2,\)"),
        ("average", dict(task_head="both"), r"task_head='both'; choose one of \('anchor', 'merge'\)"),
        ("fisher", dict(eps=0.0), r"eps=0.0; eps must be a finite number in \(0, inf\)"),
        ("fisher", dict(weights=[1, float("nan")]), r"weights=.*finite"),
        ("regmean", dict(alpha=0.0), r"alpha=0.0; alpha must be a finite number in \(0, 1\]"),
        ("regmean", dict(alpha=1.5), r"alpha=1.5; alpha must be .* \(0, 1\]"),
        ("regmean", dict(jitter=-1e-3), r"jitter=-0.001; jitter must be .* \[0, inf\)"),
        ("task_arithmetic", dict(lam=float("nan")), r"lam=nan; lam must be a finite number"),
        ("ties", dict(density=0.0), r"density=0.0; density must be .* \(0, 1\]"),
        ("ties", dict(density=1.2), r"density=1.2"),
        ("ties", dict(task_head=None), r"task_head=None; choose one of"),
        ("dare", dict(drop=1.0), r"drop=1.0; drop must be a finite number in \[0, 1\)"),
        ("dare", dict(drop=-0.1), r"drop=-0.1"),
        ("dare", dict(then="average"), r"then='average'; choose one of \('task_arithmetic', 'ties'\)"),
        ("dare", dict(then="ties", density=0.0), r"density=0.0"),
        ("dare", dict(key=42), r"key=42; expected one jax.random key"),
        ("slerp", dict(t=1.5), r"t=1.5; t must be a finite number in \[0, 1\]"),
        ("slerp", dict(t=-0.5), r"t=-0.5"),
        ("slerp", dict(eps=-1.0), r"eps=-1.0"),
    ],
)
def test_bad_options(method, options, message):
    with pytest.raises(ValueError, match=message):
        _call(method, **options)


def test_too_few_models():
    model = make(0)
    with pytest.raises(ValueError, match=r"params_list has 1 model; merging needs at least 2"):
        merge.average([model])
    with pytest.raises(ValueError, match="at least 2"):
        merge.ties(make(100), [model])
    with pytest.raises(ValueError, match="params_list must be a list of params pytrees, got dict"):
        merge.average(model)


def test_a_bounded_option_out_of_range_names_its_interval_only():
    """density=2 was told "(and finite in float32, |density| <= 3.403e+38)" too; an unbounded lam still is."""
    base, models = make(100), [make(s) for s in range(2)]
    with pytest.raises(ValueError) as bounded:
        merge.ties(base, models, density=2)
    assert str(bounded.value) == "density=2; density must be a finite number in (0, 1]"
    with pytest.raises(ValueError, match=r"lam=inf; lam must be a finite number in \(-inf, inf\) \(and finite in float32"):
        merge.ties(base, models, lam=float("inf"))


def test_elementwise_merges_trace_as_they_run_and_the_host_ones_say_so():
    """average, task_arithmetic and dare (then='task_arithmetic') run their kernel on each whole
    leaf inside jax.jit and vmap, bit for bit the eager result (which streams the leaves through
    it on the host), and differentiate; the merges with host choices are refused by name (they
    ended in a TracerArrayConversionError)."""
    base, a, b = make(0), make(1), make(2)
    key = jax.random.key(4)
    runs = {"average": lambda x, y: merge.average([x, y], [0.3, 0.7]),
            "task_arithmetic": lambda x, y: merge.task_arithmetic(base, [x, y], lam=0.6),
            "dare": lambda x, y: merge.dare(base, [x, y], key, drop=0.5, lam=0.8)}
    for name, run in runs.items():
        eager = run(a, b)
        for traced in (jax.jit(run)(a, b), jax.tree.map(lambda v: v[0], jax.vmap(run)(*(jax.tree.map(lambda v: v[None], p) for p in (a, b))))):
            assert jax.tree.structure(traced) == jax.tree.structure(eager), name
            for x, y in zip(jax.tree.leaves(traced), jax.tree.leaves(eager)):
                assert x.dtype == y.dtype
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    grad = jax.grad(lambda y: sum(jax.numpy.sum(v ** 2) for v in jax.tree.leaves(merge.average([a, y]))))(b)
    expected = {p: 2 * 0.5 * (np.asarray(x) + np.asarray(y)) / 2 for (p, x), y in zip(flatten(a).items(), flatten(b).values())}
    expected.update({p: np.zeros_like(v) for p, v in flatten(b).items() if p.startswith("head/")})  # the anchor's head is kept
    assert_tree_close(grad, expected)
    fishers = [fisher_stats(a, 1), fisher_stats(b, 2)]
    refused = {"ties": lambda x, y: merge.ties(base, [x, y]), "dare": lambda x, y: merge.dare(base, [x, y], key, then="ties"),
               "fisher": lambda x, y: merge.fisher([x, y], fishers)}
    for name, run in refused.items():
        with pytest.raises(ValueError, match=rf"merge\.{name} runs on the host .*call it outside jax\.jit"):
            jax.jit(run)(a, b)
