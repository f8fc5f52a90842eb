"""`align_many`: planted recovery, order independence (with a control that shows the comparison is
sensitive), the monotone objective and its definition, transforms that reproduce the aligned
models, function preservation, purity and errors. Small random models from test_invariance."""

import dataclasses
import itertools
import math

import jax
import numpy as np
import pytest
from test_align import rel_dist
from test_invariance import assert_same_function, model_inputs, outputs, random_model

import rotsym_jax as rj
from rotsym_jax.engine.many import ManyResult, align_many

# One set of align options per family keeps the number of compilations (and the runtime) small.
OPTIONS = {"bert-cls": {}, "llama-gqa": dict(rescale="joint", heads="fixed")}


def _sq_distance(p, q) -> float:
    """||p - q||^2 over every leaf, in float64."""
    pairs = zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q))
    return math.fsum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)) for a, b in pairs)


def objective_direct(params):
    """F = sum_i ||theta_i - mean||^2 in float64 NumPy, independently of the library."""
    leaves = [[np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(p)] for p in params]
    mean = [sum(ls[k] for ls in leaves) / len(leaves) for k in range(len(leaves[0]))]
    return math.fsum(float(np.sum((x - m) ** 2)) for ls in leaves for x, m in zip(ls, mean))


def pairwise_direct(params):
    """(1/N) sum over pairs of squared distances: the same F."""
    sq = _sq_distance
    return math.fsum(sq(p, q) for p, q in itertools.combinations(params, 2)) / len(params)


def merged_outputs(ck, result):
    return outputs(ck, result.reference, model_inputs(ck))


def max_rel_diff(a, b):
    return max(float(np.max(np.abs(a[k] - b[k])) / np.max(np.abs(a[k]))) for k in a)


def assert_non_increasing(objective):
    assert all(b <= a for a, b in zip(objective, objective[1:])), objective


@pytest.fixture(scope="module", params=["bert-cls", "llama-gqa"])
def independent(request):
    """Four independently initialised models (nothing planted), aligned by both modes."""
    name = request.param
    ck, _ = random_model(name)
    spec = rj.spec_for(ck)
    models = [random_model(name, seed)[1] for seed in range(4)]
    options = OPTIONS[name]
    ticks = {"mean": [], "anchor": []}
    mean = align_many(models, spec, progress=lambda: ticks["mean"].append(1), **options)
    anchor = align_many(models, spec, mode="anchor", progress=lambda: ticks["anchor"].append(1), **options)
    return dict(name=name, ck=ck, spec=spec, models=models, options=options, mean=mean, anchor=anchor, ticks=ticks)


# ---- planted recovery ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name, copies, kinds",
    [
        ("bert-cls", 3, ("qk", "vo", "perm")),
        ("llama-gqa", 4, ("qk", "vo", "perm", "qk_scale", "vo_scale")),  # rescale="joint", heads="fixed"
    ],
)
def test_planted_copies_are_recovered(name, copies, kinds):
    """Copies of one model, each moved by its own random symmetry: after alignment all copies are
    equal (to a common transform of the original) and F drops by more than 8 orders of magnitude."""
    ck, params = random_model(name)
    spec = rj.spec_for(ck)
    planted_t = [rj.random_transform(spec, params, jax.random.key(20 + i), kinds) for i in range(copies)]
    planted = [rj.apply_transform(spec, params, t) for t in planted_t]
    for p, q in itertools.combinations(planted, 2):
        assert rel_dist(p, q) > 0.1
    result = align_many(planted, spec, mode="mean", **OPTIONS[name])
    for p, q in itertools.combinations(result.params, 2):
        assert rel_dist(p, q) <= 1e-5
    unaligned = result.report["unaligned_objective"]
    assert unaligned == pytest.approx(objective_direct(planted), rel=1e-5)
    assert result.objective[-1] <= 1e-8 * unaligned, (result.objective, unaligned)
    # the medoid's alignment already leaves only rounding: no sweep chases it (ten did before)
    assert result.report["stop"] == "zero_objective" and result.report["sweeps"] == 0, (result.report, result.objective)
    assert_non_increasing(result.objective)
    # `moved`, per model: the medoid stays (nothing moved); each other copy's units permuted as the
    # planted ground truth says (copy i to the medoid: its transform undone, then the medoid's)
    medoid, bound = result.report["reference_model"], rj.bind(spec, params)
    assert len(result.report["moved"]) == copies
    assert all(m["layers_moved"] == 0 for m in result.report["moved"][medoid].values()), result.report["moved"][medoid]
    for i in set(range(copies)) - {medoid}:
        truth = rj.transforms.compose_transforms(rj.transforms.invert_transform(planted_t[i]), planted_t[medoid])
        for g in bound.perms:
            perm = np.asarray(truth[g.name].perm)
            assert result.report["moved"][i][g.name]["units"] == pytest.approx(np.mean(perm != np.arange(perm.shape[-1])), abs=1e-4)
            assert result.report["moved"][i][g.name]["layers"] == len(g.layers)
    # The merged model is a symmetry of the original: it computes the original's function.
    assert_same_function(ck, params, result.reference, model_inputs(ck))


# ---- order independence ----------------------------------------------------------------------------

def test_order_independence_of_the_merged_function(independent):
    ck, spec, models, options = (independent[k] for k in ("ck", "spec", "models", "options"))
    base = independent["mean"]
    reference = merged_outputs(ck, base)
    for perm in [(3, 2, 1, 0), (1, 3, 0, 2)]:
        shuffled = align_many([models[i] for i in perm], spec, **options)
        assert max_rel_diff(reference, merged_outputs(ck, shuffled)) <= 1e-4
        assert shuffled.objective[-1] == pytest.approx(base.objective[-1], rel=1e-6)
        # The same medoid, found by content: the same model whatever its position.
        assert perm[shuffled.report["reference_model"]] == base.report["reference_model"]
        # Per model, the aligned params (not just the mean) agree.
        for j, i in enumerate(perm):
            assert rel_dist(base.params[i], shuffled.params[j]) <= 1e-5
    # Control: the same comparison is sensitive. The anchor baseline with another first model gives
    # a different merged function.
    other = align_many([models[i] for i in (1, 0, 2, 3)], spec, mode="anchor", **options)
    assert max_rel_diff(merged_outputs(ck, independent["anchor"]), merged_outputs(ck, other)) > 1e-2


def test_two_models_order_independent():
    """N = 2: the medoid is a tie on paper; the content key decides, not the position."""
    ck, a = random_model("bert-cls", 5)
    _, b = random_model("bert-cls", 6)
    spec = rj.spec_for(ck)
    ab, ba = align_many([a, b], spec), align_many([b, a], spec)
    assert [a, b][ab.report["reference_model"]] is [b, a][ba.report["reference_model"]]
    assert max_rel_diff(merged_outputs(ck, ab), merged_outputs(ck, ba)) <= 1e-4


# ---- the objective ---------------------------------------------------------------------------------

def test_objective_is_monotone_and_beats_the_anchor(independent):
    mean, anchor = independent["mean"], independent["anchor"]
    assert_non_increasing(mean.objective)
    assert len(anchor.objective) == 1
    assert mean.objective[-1] <= anchor.objective[0]
    assert mean.objective[-1] < mean.report["unaligned_objective"]
    assert len(mean.objective) == 1 + mean.report["sweeps"] and mean.report["sweeps"] <= 10
    assert mean.report["accepted"] + mean.report["rejected"] == len(mean.params) * mean.report["sweeps"]
    # progress: once for the initial pass, then once per sweep; once for mode="anchor".
    assert len(independent["ticks"]["mean"]) == 1 + mean.report["sweeps"] and len(independent["ticks"]["anchor"]) == 1


def test_objective_matches_its_definition(independent):
    """objective[-1] is F of the returned models around the returned reference: when an update
    was rejected, what is returned is the kept alignment, not the rejected one."""
    for result in (independent["mean"], independent["anchor"]):
        direct = objective_direct(result.params)
        assert result.objective[-1] == pytest.approx(direct, rel=1e-5)
        assert result.objective[-1] == pytest.approx(pairwise_direct(result.params), rel=1e-4)
        leaves = lambda p: [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(p)]
        mean = [sum(xs) / len(result.params) for xs in zip(*map(leaves, result.params))]
        for got, want in zip(leaves(result.reference), mean):
            np.testing.assert_allclose(got, want, atol=1e-5)
    report = independent["mean"].report
    if report["rejected"]:  # a rejected update would not have lowered F at its time
        assert report["rejected_objective"] >= independent["mean"].objective[-1]


def test_medoid_initialisation_and_one_sweep(independent):
    """Re-derives the algorithm with `align` and NumPy: the medoid of the unaligned pairwise
    distances, everything aligned to it, then one Gauss-Seidel sweep in the reported order: each
    ORIGINAL model aligned to the leave-one-out mean (N m - theta_i) / (N-1) of the models as they
    stand, kept if it lowers F."""
    spec, models, options = (independent[k] for k in ("spec", "models", "options"))
    n = len(models)
    sq = _sq_distance
    sums = [math.fsum(sq(models[i], models[j]) for j in range(n) if j != i) for i in range(n)]
    medoid = int(np.argmin(sums))
    once = align_many(models, spec, max_iters=1, **options)
    assert once.report["reference_model"] == medoid
    current = [models[i] if i == medoid else rj.align(models[medoid], models[i], spec, **options).params for i in range(n)]
    assert once.objective[0] == pytest.approx(objective_direct(current), rel=1e-5)
    for i in once.report["order"]:
        total = jax.tree_util.tree_map(lambda *xs: sum(np.asarray(x, np.float64) for x in xs), *current)
        loo = jax.tree_util.tree_map(lambda t, x: ((t - np.asarray(x, np.float64)) / (n - 1)).astype(np.float32), total, current[i])
        candidate = rj.align(loo, models[i], spec, **options).params
        trial = current[:i] + [candidate] + current[i + 1 :]
        if objective_direct(trial) < objective_direct(current):
            current = trial
    assert once.objective[1] == pytest.approx(objective_direct(current), rel=1e-5)
    for got, want in zip(once.params, current):  # float32 vs float64 targets: the flat joint
        assert rel_dist(want, got) <= 1e-4  # rescale optimum moves by ~1e-5 (measured 1.4e-5)


def test_stopping_rules(independent):
    spec, models, options = (independent[k] for k in ("spec", "models", "options"))
    once = align_many(models, spec, max_iters=1, **options)
    assert len(once.objective) == 2 and once.report["accepted"] + once.report["rejected"] == len(models)
    assert once.objective == independent["mean"].objective[: len(once.objective)]
    loose = align_many(models, spec, tol=1.0, **options)  # any sweep is "converged"
    assert loose.report["stop"] in ("converged", "rejected") and len(loose.objective) == 2


# ---- transforms and function -----------------------------------------------------------------------

def test_transforms_reproduce_aligned_models_and_function(independent):
    ck, spec, models = independent["ck"], independent["spec"], independent["models"]
    inputs = model_inputs(ck)
    for result in (independent["mean"], independent["anchor"]):
        assert isinstance(result, ManyResult) and len(result.params) == len(result.transforms) == len(models)
        for original, aligned, t in zip(models, result.params, result.transforms):
            assert rel_dist(rj.apply_transform(spec, original, t), aligned) <= 1e-6
            assert_same_function(ck, original, aligned, inputs)
    anchor = independent["anchor"]
    jax.tree_util.tree_map(np.testing.assert_array_equal, anchor.params[0], models[0])
    assert rel_dist(models[1], anchor.params[1]) > 0.1  # the others did move


# ---- purity and errors -----------------------------------------------------------------------------

def test_inputs_not_mutated_and_deterministic():
    ck, _ = random_model("bert-cls")
    spec = rj.spec_for(ck)
    models = [random_model("bert-cls", seed)[1] for seed in (7, 8, 9)]
    snapshot = [jax.tree_util.tree_map(np.array, p) for p in models]
    listed = list(models)
    r1 = align_many(listed, spec)
    r2 = align_many(tuple(models), spec)
    assert listed == models and all(a is b for a, b in zip(listed, models))
    for p, s in zip(models, snapshot):
        jax.tree_util.tree_map(np.testing.assert_array_equal, p, s)
    jax.tree_util.tree_map(np.testing.assert_array_equal, r1.params, r2.params)
    assert r1.objective == r2.objective
    with pytest.raises(dataclasses.FrozenInstanceError):
        r1.objective = []


def copy_tree(params):
    return jax.tree_util.tree_map(lambda x: x, params)  # new containers, the same leaves


def test_errors():
    ck, a = random_model("bert-cls")
    spec = rj.spec_for(ck)
    _, b = random_model("bert-cls", 1)
    with pytest.raises(ValueError, match="at least 2 models, got 1"):
        align_many([a], spec)
    with pytest.raises(ValueError, match="at least 2 models, got 0"):
        align_many([], spec)
    with pytest.raises(ValueError, match=r"mode='median'; choose one of \('mean', 'anchor'\)"):
        align_many([a, b], spec, mode="median")
    with pytest.raises(ValueError, match="max_iters=0"):
        align_many([a, b], spec, max_iters=0)
    with pytest.raises(TypeError, match=r"unknown align options \['rescal'\]"):
        align_many([a, b], spec, rescal="joint")
    with pytest.raises(TypeError, match="progress="):
        align_many([a, b], spec, progress="bar")
    with pytest.raises(TypeError, match="list or tuple"):
        align_many(a, spec)
    with pytest.raises(ValueError, match=r"heads='all'; choose one of"):  # align's own check
        align_many([a, b], spec, heads="all")
    narrow = copy_tree(b)
    narrow["layers"][1]["mlp"]["up"]["kernel"] = b["layers"][1]["mlp"]["up"]["kernel"][:, :40]
    with pytest.raises(rj.SpecError, match=r"leaf layers/1/mlp/up/kernel has shape \(32, 48\) in params_list\[0\] but \(32, 40\) in params_list\[2\]"):
        align_many([a, b, narrow], spec)
    missing = copy_tree(b)
    del missing["layers"][1]["attention_norm"]
    with pytest.raises(rj.SpecError, match=r"only in params_list\[0\] \['layers/1/attention_norm/"):
        align_many([a, missing], spec)
    # a pooler one model lacks (the task classes that drop it) is set aside, not refused
    no_pooler = {k: v for k, v in b.items() if k != "pooler"}
    assert "pooler" not in align_many([a, no_pooler], spec).params[1]
    # Nothing was modified by the failed calls.
    assert b["layers"][1]["mlp"]["up"]["kernel"].shape == (32, 48) and "pooler" in b
