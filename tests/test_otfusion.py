"""OT fusion baseline (Imfeld et al. 2024): planted recovery by exact OT from weights and from
activations, function preservation of hard transport, Sinkhorn plans (marginals, the tiny- and
large-regularisation limits), the EMD plan against brute force with independently computed
costs, the options, and the errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf
from test_invariance import assert_same_function, model_inputs, random_model

import rotsym_jax as rj
from rotsym_jax import stats
from rotsym_jax.otfusion import OTResult, ot_fuse, ot_transport
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
    return max(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)))) for x, y in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)))


def rel_dist(p, q):
    num = sum(float(jnp.sum((jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)) ** 2)) for x, y in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)))
    return (num / sum(float(jnp.sum(jnp.asarray(x, jnp.float32) ** 2)) for x in jax.tree_util.tree_leaves(p))) ** 0.5


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
    n = planted["ffn"].shape[-1]
    np.testing.assert_array_equal(perm_of(result.plans["ffn"]), np.argsort(np.asarray(planted["ffn"]), axis=-1))
    np.testing.assert_allclose(result.plans["ffn"] * n, np.eye(n)[perm_of(result.plans["ffn"])].swapaxes(-1, -2), atol=1e-12)
    geo = spec.heads["attn"]
    heads = perm_of(result.plans["attn"])  # over query heads
    assert result.plans["attn"].shape == (2, geo.num_heads, geo.num_heads)
    g, r = geo.num_kv_heads, geo.heads_per_group
    t = planted["attn"]  # planted head (k, t) of B is A's head (group_perm[k], head_perm[k, t])
    planted_heads = (np.asarray(t["group_perm"])[:, :, None] * r + np.asarray(t["head_perm"])).reshape(2, -1)
    np.testing.assert_array_equal(heads, np.argsort(planted_heads, axis=-1))
    if r > 1:
        np.testing.assert_array_equal(perm_of(result.plans["attn/kv_groups"]), np.argsort(np.asarray(t["group_perm"]), axis=-1))


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
    with pytest.raises(ValueError, match=r"leaf 'head/\w+/\w+' has shape .* task_head=\"anchor\" keeps"):
        ot_fuse([a, five], spec, task_head="merge")
    with pytest.raises(ValueError, match=r"params_list\[1\] does not have the leaves of params_list\[0\].*missing \['pooler/dense/bias'"):
        ot_fuse([a, {k: v for k, v in b.items() if k != "pooler"}], spec)
