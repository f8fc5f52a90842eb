"""OT fusion baseline (Imfeld et al. 2024): planted recovery by exact OT from weights and from
activations, function preservation of hard transport, Sinkhorn plans (marginals, the tiny- and
large-regularisation limits, and an intermediate regularisation against a NumPy Sinkhorn), the
EMD plan against brute force with independently computed costs, GQA kv-group costs and
assignments against brute force, the options, and the errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf
from test_invariance import assert_same_function, model_inputs, random_model

import rotsym_jax as rj
from rotsym_jax import stats
from rotsym_jax.merging.otfusion import OTResult, ot_fuse, ot_transport
from rotsym_jax.pytree import flatten, unflatten

NAMES = ["bert-cls", "llama-gqa"]


@pytest.fixture(scope="module")
def models():
    """{name: (checkpoint, spec, A, B planted = A moved by FFN and head permutations, planted
    transform, C = an unrelated model)}"""
    out = {}
    for name in NAMES:
        ck, a = random_model(name)
        spec = rj.spec_for(ck)
        planted = rj.random_transform(spec, a, jax.random.key(7), ("perm", "heads"))
        b = rj.apply_transform(spec, a, planted)
        _, c = random_model(name, seed=1)
        out[name] = (ck, spec, a, b, planted, c)
    return out


def max_diff(p, q):
    # on the host: eager jnp ops compiled a program per op and leaf shape
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)))) for x, y in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)))


def rel_dist(p, q):
    num = sum(float(np.sum(np.square((np.asarray(x, np.float32) - np.asarray(y, np.float32)).astype(np.float64))))
              for x, y in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)))
    return (num / sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in jax.tree_util.tree_leaves(p))) ** 0.5


def perm_of(plan):
    """(L, n, n) permutation plans -> (L, n): fused unit k is B's unit p[k]."""
    return np.argmax(plan, axis=-2)


# ---- hard transport ---------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["weights", "activations"])
@pytest.mark.parametrize("name", NAMES)
def test_hard_transport_recovers_planted_permutations(models, name, source):
    ck, spec, a, b, planted, _ = models[name]
    assert rel_dist(a, b) > 0.3  # the planted permutations moved B far from A
    result = ot_fuse([a, b], spec, source=source, transport="hard", checkpoint=ck, batches=[model_inputs(ck)])
    assert isinstance(result, OTResult)
    assert max_diff(a, result.params) <= 1e-6
    # The plans are the inverse of the planted permutations (B = A[q] => B[argsort(q)] = A).
    n = planted["ffn"].perm.shape[-1]
    np.testing.assert_array_equal(perm_of(result.plans["ffn"]), np.argsort(np.asarray(planted["ffn"].perm), axis=-1))
    np.testing.assert_allclose(result.plans["ffn"] * n, np.eye(n)[perm_of(result.plans["ffn"])].swapaxes(-1, -2), atol=1e-12)
    geo = spec.heads["attn"]
    heads = perm_of(result.plans["attn"])  # over query heads
    assert result.plans["attn"].shape == (2, geo.num_heads, geo.num_heads)
    r = geo.heads_per_group
    t = planted["attn"]  # planted head (k, t) of B is A's head (group_perm[k], head_perm[k, t])
    planted_heads = (np.asarray(t.group_perm)[:, :, None] * r + np.asarray(t.head_perm)).reshape(2, -1)
    np.testing.assert_array_equal(heads, np.argsort(planted_heads, axis=-1))
    if r > 1:
        np.testing.assert_array_equal(perm_of(result.plans["attn/kv_groups"]), np.argsort(np.asarray(t.group_perm), axis=-1))


@pytest.mark.parametrize("source", ["weights", "activations"])
@pytest.mark.parametrize("name", NAMES)
def test_hard_transport_preserves_function(models, name, source):
    ck, spec, a, _, _, c = models[name]
    inputs = model_inputs(ck)
    moved = ot_transport([a, c], spec, source=source, transport="hard", checkpoint=ck, batches=[inputs, model_inputs(ck, 1)])
    assert moved.models[0] is a
    c_moved = moved.models[1]
    assert rel_dist(c, c_moved) > 0.1  # it did move the units
    assert_same_function(ck, c, c_moved, inputs)
    # The transform it reports is a group element that gives the transported model.
    again = rj.apply_transform(spec, c, moved.transforms[0])
    assert max_diff(again, c_moved) == 0.0
    if source == "weights":  # exact OT minimises the FFN distance; identity is feasible
        before, after = (rj.distance_report(spec, a, p)["total"]["ffn"] for p in (c, c_moved))
        assert after < before


def test_emd_plan_equals_brute_force_on_tiny_layers():
    """FFN (5 neurons) from weights and from activations, attention (4 heads) from weights:
    the EMD plan's cost equals the minimum over all permutations, costs built here from the
    raw leaves and `stats.layer_inputs`."""
    config = tf.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=4, intermediate_size=5, vocab_size=97)
    ck = rj.init_checkpoint(config, jax.random.key(0))
    a, b = ck.params, rj.init_checkpoint(config, jax.random.key(1)).params
    spec = rj.spec_for(config)
    batch = model_inputs(ck)

    def brute(cost):
        n = cost.shape[0]
        return min(cost[list(p), range(n)].sum() for p in itertools.permutations(range(n)))

    def ffn_units(p):
        m = p["layers"][0]["mlp"]
        return np.concatenate([np.asarray(m["up"]["kernel"]).T, np.asarray(m["up"]["bias"])[:, None], np.asarray(m["down"]["kernel"])], axis=1)

    def head_units(p):
        att = p["layers"][0]["attention"]
        parts = []
        for role in ("query", "key", "value"):
            w = np.vstack([np.asarray(att[role]["kernel"]), np.asarray(att[role]["bias"])[None]])  # (9, 8)
            parts.append(w.reshape(9, 4, 2).transpose(1, 0, 2).reshape(4, -1))
        parts.append(np.asarray(att["out"]["kernel"]).reshape(4, 2, 8).reshape(4, -1))
        return np.concatenate(parts, axis=1)

    def acts(p):
        x = stats.layer_inputs(ck, p, batch)["layers/0/mlp/down/kernel"]
        return np.asarray(x, np.float64).T

    def sq(xb, xa):
        return ((xb[:, None, :].astype(np.float64) - xa[None, :, :]) ** 2).sum(-1)

    weights = ot_transport([a, b], spec, source="weights").plans[0]
    activations = ot_transport([a, b], spec, source="activations", checkpoint=ck, batches=[batch]).plans[0]
    for plan, cost in [
        (weights["ffn"][0], sq(ffn_units(b), ffn_units(a))),
        (activations["ffn"][0], sq(acts(b), acts(a))),
        (weights["attn"][0], sq(head_units(b), head_units(a))),
    ]:
        n = cost.shape[0]
        assert plan.shape == (n, n)
        assert n * np.sum(plan * cost) == pytest.approx(brute(cost), rel=1e-6)
        assert brute(cost) < np.trace(cost) * (1 - 1e-3)  # the identity is not the optimum here


# ---- soft transport ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_soft_plans_are_couplings_and_do_not_preserve_function(models, name):
    ck, spec, a, _, _, c = models[name]
    result = ot_fuse([a, c], spec, transport="soft")
    assert set(result.plans) == {"ffn", "attn"} | ({"attn/kv_groups"} if name == "llama-gqa" else set())
    for key, plan in result.plans.items():
        n = plan.shape[-1]
        assert np.all(plan >= 0), key
        np.testing.assert_allclose(plan.sum(-1), 1.0 / n, rtol=1e-9, err_msg=key)
        np.testing.assert_allclose(plan.sum(-2), 1.0 / n, rtol=1e-9, err_msg=key)
        assert (plan.max(-2) * n).min() < 0.99, f"{key}: a soft plan on unrelated models mixes units"
    # Soft transport averages units: B's function is not preserved.
    soft_b = ot_transport([a, c], spec, transport="soft").models[1]
    with pytest.raises(AssertionError, match="relative change"):
        assert_same_function(ck, c, soft_b, model_inputs(ck), tol=1e-2)


@pytest.mark.parametrize("name", NAMES)
def test_soft_regularisation_limits(models, name):
    ck, spec, a, b, planted, _ = models[name]
    exact = ot_fuse([a, b], spec, transport="hard").plans
    sharp = ot_fuse([a, b], spec, transport="soft", sinkhorn_reg=1e-3)
    for key, plan in sharp.plans.items():
        np.testing.assert_allclose(plan, exact[key], atol=1e-6 / plan.shape[-1], err_msg=key)
    assert rel_dist(a, sharp.params) <= 1e-5
    # The default regularisation already mixes a little; a large one spreads every unit evenly.
    default = ot_fuse([a, b], spec, transport="soft")
    assert rel_dist(a, sharp.params) <= rel_dist(a, default.params)
    flat = ot_fuse([a, b], spec, transport="soft", sinkhorn_reg=1e4)
    for key, plan in flat.plans.items():
        n = plan.shape[-1]
        np.testing.assert_allclose(plan, 1.0 / n**2, rtol=1e-3, err_msg=key)
    # ...so the transported FFN neurons of B all become B's mean neuron.
    up = np.asarray(ot_transport([a, b], spec, transport="soft", sinkhorn_reg=1e4).models[1]["layers"][0]["mlp"]["up"]["kernel"])
    np.testing.assert_allclose(up, np.broadcast_to(np.asarray(b["layers"][0]["mlp"]["up"]["kernel"]).mean(1, keepdims=True), up.shape), atol=1e-3 * np.abs(up).max())


def test_soft_activations_recover_planted_with_small_regularisation(models):
    # On 18 tokens some neurons' activations nearly coincide (gaps of 0.4% of the median cost):
    # the regularisation must be well below that for the plan to separate them.
    ck, spec, a, b, _, _ = models["bert-cls"]
    batches = [model_inputs(ck)]
    result = ot_fuse([a, b], spec, source="activations", transport="soft", sinkhorn_reg=1e-4, checkpoint=ck, batches=batches)
    assert rel_dist(a, result.params) <= 1e-5
    blurred = ot_fuse([a, b], spec, source="activations", transport="soft", sinkhorn_reg=0.05, checkpoint=ck, batches=batches)
    assert rel_dist(a, blurred.params) > 1e-3


# ---- options ----------------------------------------------------------------------------------------

def test_weights_task_head_purity_and_determinism(models):
    ck, spec, a, _, _, c = models["bert-cls"]
    snap_a, snap_c = (jax.tree_util.tree_map(np.array, p) for p in (a, c))
    r1 = ot_fuse([a, c], spec, transport="soft")
    r2 = ot_fuse([a, c], spec, transport="soft")
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, snap_a)
    jax.tree_util.tree_map(np.testing.assert_array_equal, c, snap_c)
    jax.tree_util.tree_map(np.testing.assert_array_equal, r1.params, r2.params)
    # The anchor's head by default; averaged with task_head="merge".
    jax.tree_util.tree_map(np.testing.assert_array_equal, r1.params["head"], a["head"])
    merged = ot_fuse([a, c], spec, task_head="merge")
    jax.tree_util.tree_map(lambda x, y, z: np.testing.assert_allclose(x, (y + z) / 2, atol=1e-6), merged.params["head"], a["head"], c["head"])
    # Weights: all on the anchor gives the anchor; all on B gives the transported B, B's function.
    only_a = ot_fuse([a, c], spec, weights=[1.0, 0.0])
    assert max_diff(a, only_a.params) == 0.0
    only_c = ot_fuse([a, c], spec, weights=[0.0, 2.0], task_head="merge")
    assert_same_function(ck, c, only_c.params, model_inputs(ck))
    # Three models: every non-anchor model has its plans.
    three = ot_fuse([a, c, c], spec)
    assert len(three.all_plans) == 2 and three.plans is three.all_plans[0]
    np.testing.assert_array_equal(three.all_plans[0]["ffn"], three.all_plans[1]["ffn"])


def test_errors(models):
    ck, spec, a, b, _, _ = models["bert-cls"]
    with pytest.raises(ValueError, match="source='activations' needs checkpoint and batches"):
        ot_fuse([a, b], spec, source="activations")
    with pytest.raises(ValueError, match="source='activations' needs batches"):
        ot_fuse([a, b], spec, source="activations", checkpoint=ck)
    with pytest.raises(ValueError, match="`batches` is empty"):
        ot_fuse([a, b], spec, source="activations", checkpoint=ck, batches=[])
    with pytest.raises(ValueError, match=r"transport='exact'; choose one of \('hard', 'soft'\)"):
        ot_fuse([a, b], spec, transport="exact")
    with pytest.raises(ValueError, match=r"source='grads'; choose one of \('weights', 'activations'\)"):
        ot_fuse([a, b], spec, source="grads")
    with pytest.raises(ValueError, match=r"task_head='keep'; choose one of"):
        ot_fuse([a, b], spec, task_head="keep")
    with pytest.raises(ValueError, match="sinkhorn_reg=0"):
        ot_fuse([a, b], spec, transport="soft", sinkhorn_reg=0)
    with pytest.raises(ValueError, match=r"weights has shape \(3,\); expected one weight per model, \(2,\)"):
        ot_fuse([a, b], spec, weights=[1, 1, 1])
    with pytest.raises(ValueError, match="at least 2"):
        ot_fuse([a], spec)
    flat = flatten(a)
    wide = unflatten({**flat, "layers/0/mlp/down/kernel": jnp.zeros((40, 32))})
    with pytest.raises(ValueError, match=r"leaf 'layers/0/mlp/down/kernel' has shape \(40, 32\) in params_list\[1\] but \(48, 32\) in params_list\[0\]"):
        ot_fuse([a, wide], spec)
    five = unflatten({**flat, **{p: jnp.zeros(x.shape[:-1] + (5,)) for p, x in flat.items() if p.startswith("head/")}})
    ot_fuse([a, five], spec)  # the anchor's head is kept: different heads are fine
    with pytest.raises(ValueError, match=r"leaf 'head/\w+/\w+' has shape .* task_head=\"anchor\" .*keeps"):
        ot_fuse([a, five], spec, task_head="merge")
    with pytest.raises(ValueError, match=r"params_list\[1\] does not have the leaves of params_list\[0\].*missing \['embeddings/norm/bias'"):
        ot_fuse([a, unflatten({p: x for p, x in flatten(b).items() if not p.startswith("embeddings/norm/")})], spec)
    # a pooler one model lacks is not merged: the anchor's is kept
    fused = ot_fuse([a, {k: v for k, v in b.items() if k != "pooler"}], spec)
    np.testing.assert_array_equal(np.asarray(fused.params["pooler"]["dense"]["kernel"]), np.asarray(a["pooler"]["dense"]["kernel"]))


# ---- independent references: NumPy Sinkhorn, brute-forced GQA groups ---------------------------------

def _np(x):
    return np.asarray(x, np.float64)


def _sq_costs(xb, xa):
    """Squared Euclidean distances between the rows of xb and of xa, float64, the naive way."""
    return ((_np(xb)[:, None, :] - _np(xa)[None, :, :]) ** 2).sum(-1)


def _logsumexp(x, axis):
    m = x.max(axis=axis, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=axis, keepdims=True))).squeeze(axis)


def _numpy_sinkhorn(cost, eps, tol=1e-12, max_iter=100_000):
    """The textbook Sinkhorn iteration for min <T, C> - eps H(T) with uniform marginals (rows 1/n,
    columns 1/m): T = diag(u) exp(-C / eps) diag(v), u and v alternately rescaled to match the
    marginals. Written in the log domain (potentials f = eps log u, g = eps log v) so that it
    neither overflows nor underflows; run until the row sums match to `tol` (relative to 1/n)."""
    n, m = cost.shape
    f, g = np.zeros(n), np.zeros(m)
    for _ in range(max_iter):
        f = eps * np.log(1.0 / n) - eps * _logsumexp((g[None, :] - cost) / eps, axis=1)  # rows
        g = eps * np.log(1.0 / m) - eps * _logsumexp((f[:, None] - cost) / eps, axis=0)  # columns
        plan = np.exp((f[:, None] + g[None, :] - cost) / eps)
        if np.abs(plan.sum(1) * n - 1.0).max() < tol:
            return plan
    raise AssertionError("the reference Sinkhorn did not converge")


def _bert_ffn_units(p, layer):
    """(f, D): neuron i's up kernel column, up bias entry and down kernel row."""
    m = p["layers"][layer]["mlp"]
    return np.concatenate([_np(m["up"]["kernel"]).T, _np(m["up"]["bias"])[:, None], _np(m["down"]["kernel"])], axis=1)


def _bert_head_units(p, layer, heads=4):
    """(H, D): head h's [W; b] slices of q, k, v (its dh columns) and its dh rows of the O kernel."""
    att = p["layers"][layer]["attention"]
    dh = att["out"]["kernel"].shape[0] // heads
    parts = []
    for role in ("query", "key", "value"):
        w = np.vstack([_np(att[role]["kernel"]), _np(att[role]["bias"])[None]])
        parts.append(np.stack([w[:, h * dh:(h + 1) * dh].ravel() for h in range(heads)]))
    parts.append(np.stack([_np(att["out"]["kernel"])[h * dh:(h + 1) * dh].ravel() for h in range(heads)]))
    return np.concatenate(parts, axis=1)


def test_soft_plans_equal_numpy_sinkhorn_at_intermediate_regularisation(models):
    """sinkhorn_reg=0.05 (on unrelated BERT models: plans far from a permutation and from uniform):
    every layer's FFN (48 neurons) and head (4 heads) plan equals a NumPy Sinkhorn on costs built
    here from the raw leaves, with epsilon = 0.05 * median(C) (the library's convention, relative
    to each cost matrix's median); the transported B is the barycentric projection of B's units by
    that plan, every member slice alike."""
    _, spec, a, _, _, c = models["bert-cls"]
    reg = 0.05
    moved = ot_transport([a, c], spec, transport="soft", sinkhorn_reg=reg)
    plans, c_moved = moved.plans[0], moved.models[1]
    for layer, (key, units) in itertools.product(range(2), (("ffn", _bert_ffn_units), ("attn", _bert_head_units))):
        cost = _sq_costs(units(c, layer), units(a, layer))
        n = cost.shape[0]
        ref = _numpy_sinkhorn(cost, reg * np.median(cost))
        assert 1.2 / n < (ref.max(0) * n).max() < 0.9, "an intermediate regularisation: neither a permutation nor uniform"
        assert plans[key].shape == (2, n, n)
        # The library stops at a relative marginal error of 1e-6: entries agree to about that.
        np.testing.assert_allclose(plans[key][layer] * n * n, ref * n * n, rtol=1e-4, atol=1e-6, err_msg=f"{key}, layer {layer}")
        # Fused unit k of B = sum_j T[j, k] unit_j / sum_j T[j, k].
        bary = ref / ref.sum(0, keepdims=True)
        np.testing.assert_allclose(units(c_moved, layer), bary.T @ units(c, layer), atol=1e-5, err_msg=f"{key}, layer {layer}")


# A one-layer Llama: 3 kv groups of 2 query heads of width 2, attention biases.
TINY_GQA = dict(
    hidden_size=12, num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=3, head_dim=2,
    intermediate_size=5, vocab_size=7, attention_bias=True,
)


def _tiny_gqa_params(seed, d=12, heads=6, kv=3, dh=2, f=5, vocab=7):
    """Random params of TINY_GQA (the leaves `rj.init_checkpoint` makes), drawn in NumPy: no
    model init to pay for."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    gain = lambda n: jnp.asarray(1 + 0.3 * rng.normal(size=n), jnp.float32)
    att = {name: {"kernel": w(d, n * dh), "bias": w(n * dh)} for name, n in (("query", heads), ("key", kv), ("value", kv))}
    att["out"] = {"kernel": w(heads * dh, d), "bias": w(d)}
    layer = {"attention": att, "attention_norm": {"scale": gain(d)}, "mlp_norm": {"scale": gain(d)},
             "mlp": {"gate": {"kernel": w(d, f)}, "up": {"kernel": w(d, f)}, "down": {"kernel": w(f, d)}}}
    return {"embeddings": {"word": {"embedding": w(vocab, d)}}, "final_norm": {"scale": gain(d)}, "layers": {0: layer}}


def _gqa_slices(p, g=3, r=2, dh=2):
    """kv (G, D_kv): group j's [W; b] slices of k and v; heads (G, R, D_h): query head (j, s)'s
    [W; b] slice of q and its rows of the O kernel (HF layout: query head j * R + s uses kv head j)."""
    att = p["layers"][0]["attention"]
    wb = {role: np.vstack([_np(att[role]["kernel"]), _np(att[role]["bias"])[None]]) for role in ("query", "key", "value")}
    o = _np(att["out"]["kernel"])
    cols = lambda w, i: w[:, i * dh:(i + 1) * dh].ravel()
    kv = np.stack([np.concatenate([cols(wb["key"], j), cols(wb["value"], j)]) for j in range(g)])
    heads = np.stack([[np.concatenate([cols(wb["query"], j * r + s), o[(j * r + s) * dh:(j * r + s + 1) * dh].ravel()]) for s in range(r)] for j in range(g)])
    return kv, heads


def _gqa_objective(a, b, group_perm, head_perm):
    """||A - B'||^2 over the attention leaves that move with heads (q, k, v kernels and biases, O
    kernel), B' = B with anchor group k taking B's group group_perm[k] and its query head slot t
    taking that group's slot head_perm[k][t]; from the leaves directly."""
    kv_a, heads_a = _gqa_slices(a)
    kv_b, heads_b = _gqa_slices(b)
    total = 0.0
    for k, (j, slots) in enumerate(zip(group_perm, head_perm)):
        total += np.sum((kv_b[j] - kv_a[k]) ** 2)
        total += sum(np.sum((heads_b[j, s] - heads_a[k, t]) ** 2) for t, s in enumerate(slots))
    return total


def _brute_group_costs(a, b):
    """C[j, k]: B group j against anchor group k: its k, v slices plus the best of the 2! matchings
    of its query heads onto group k's, enumerated."""
    kv_a, heads_a = _gqa_slices(a)
    kv_b, heads_b = _gqa_slices(b)
    cost = np.empty((3, 3))
    for j, k in itertools.product(range(3), repeat=2):
        inner = min(sum(np.sum((heads_b[j, s] - heads_a[k, t]) ** 2) for t, s in enumerate(m)) for m in itertools.permutations(range(2)))
        cost[j, k] = np.sum((kv_b[j] - kv_a[k]) ** 2) + inner
    return cost


def test_gqa_group_assignment_and_costs_equal_brute_force():
    """3 kv groups of 2 query heads: hard transport attains the minimum of the attention distance
    over all 3! x 2!^3 group and query-head permutations (enumerated, distances from the raw
    leaves), with the unique optimal group permutation; the soft kv-group plan equals a NumPy
    Sinkhorn on the brute-forced group cost matrix (so every entry of the group cost is checked)."""
    spec = rj.spec_for(tf.LlamaConfig(**TINY_GQA))
    a, b = _tiny_gqa_params(0), _tiny_gqa_params(1)
    hard = ot_transport([a, b], spec, transport="hard")
    head_perms = list(itertools.product(itertools.permutations(range(2)), repeat=3))
    by_groups = {gp: min(_gqa_objective(a, b, gp, hp) for hp in head_perms) for gp in itertools.permutations(range(3))}
    best = min(by_groups, key=by_groups.get)
    assert sorted(by_groups.values())[1] > by_groups[best] * (1 + 1e-3), "a unique optimum"
    assert best != (0, 1, 2), "the identity is not the optimum here"
    identity = ((0, 1),) * 3
    ours = _gqa_objective(a, hard.models[1], (0, 1, 2), identity)  # transported B against A, as it is
    assert ours == pytest.approx(by_groups[best], rel=1e-6)
    t = hard.transforms[0]["attn"]
    np.testing.assert_array_equal(np.asarray(t.group_perm)[0], best)
    assert _gqa_objective(a, b, best, np.asarray(t.head_perm)[0]) == pytest.approx(by_groups[best], rel=1e-6)
    np.testing.assert_array_equal(perm_of(hard.plans[0]["attn/kv_groups"])[0], best)
    # Soft: the kv-group plan is Sinkhorn on exactly these group costs (epsilon relative to their median).
    cost = _brute_group_costs(a, b)
    assert min(cost[list(p), range(3)].sum() for p in itertools.permutations(range(3))) == pytest.approx(by_groups[best], rel=1e-6)
    reg = 0.05
    ref = _numpy_sinkhorn(cost, reg * np.median(cost))
    assert 1.2 / 3 < (ref.max(0) * 3).max() < 0.9, "an intermediate regularisation: neither a permutation nor uniform"
    soft = ot_transport([a, b], spec, transport="soft", sinkhorn_reg=reg).plans[0]["attn/kv_groups"][0]
    np.testing.assert_allclose(soft * 9, ref * 9, rtol=1e-4, atol=1e-6)


def test_inside_jit_it_is_refused_by_name(models):
    ck, spec, a, b, _, _ = models[NAMES[0]]
    with pytest.raises(ValueError, match=r"otfusion\.ot_fuse \(merge 'ot_fusion'\) runs on the host .*SciPy or POT.*call it outside jax\.jit"):
        jax.jit(lambda x, y: ot_fuse([x, y], spec).params)(a, b)
