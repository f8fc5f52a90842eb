"""The engine on any backend: exact whatever the global matmul precision, low-precision params
computed in float32, and every `align` option combination compiling and running on every family
(the GPU compiler crashed on some: this is the test the GPU run relies on)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_invariance import FAMILIES, assert_same_function, model_inputs, random_model

import rotsym_jax as rj
from rotsym_jax import merge, stats
from rotsym_jax.options import ATTENTION, FFN, HEADS, RESCALE
from rotsym_jax.transforms import KINDS


def _lowest_precision():
    """A global setting under which an unpinned float32 matmul is caught: XLA:CPU rejects TF32
    dot algorithms outright (ValueError); a GPU accepts "bfloat16" and rounds (TF32 or bfloat16
    passes: 1e-4 to 1e-2 relative), which every comparison below sees."""
    return "TF32_TF32_F32" if jax.default_backend() == "cpu" else "bfloat16"


def test_lowest_precision_setting_catches_unpinned_matmuls():
    """The control: the setting does break a plain float32 matmul on this backend."""
    x = jax.random.normal(jax.random.key(0), (64, 64))
    exact = np.asarray(x, np.float64) @ np.asarray(x, np.float64)
    with jax.default_matmul_precision(_lowest_precision()):
        try:
            y = np.asarray(jax.jit(lambda m: m @ m)(x))
        except ValueError:
            return
    assert np.abs(y - exact).max() > 1e-5 * np.abs(exact).max()  # float32 itself: about 1e-7


def _engine_outputs(ck, params_a, params_b):
    """Everything the library computes from two models: alignment (every attention, heads and
    rescale mode), transforms and their algebra, distances, align_many, merges, statistics."""
    spec = rj.spec_for(ck)
    out = {}
    for attention, heads, rescale in [("rotation", "permute", "joint"), ("rotation", "fixed", "sequential"), ("permutation", "permute", "sequential")]:
        result = rj.align(params_a, params_b, spec, attention=attention, heads=heads, rescale=rescale)
        out[f"align-{attention}-{heads}-{rescale}"] = (result.params, result.transforms)
    t = rj.random_transform(spec, params_a, jax.random.key(2), KINDS)
    out["transform"] = (rj.apply_transform(spec, params_a, t), rj.compose_transforms(t, rj.invert_transform(t)))
    out["distance"] = rj.distance_report(spec, params_a, params_b)["total"]
    out["many"] = rj.align_many([params_a, params_b, out["transform"][0]], spec, max_iters=2).params
    inputs = model_inputs(ck)
    batch = {**inputs, "labels": inputs["input_ids"] if ck.layout.head == "lm" else np.array([1, 0, 2])}
    grams = [stats.grams(ck, p, [batch]) for p in (params_a, params_b)]
    fishers = [stats.fisher(ck, p, [batch]) for p in (params_a, params_b)]
    result = rj.align(params_a, params_b, spec)
    out["follow"] = stats.follow(grams[1], result).values
    out["merges"] = [
        merge.average([params_a, params_b]),
        merge.fisher([params_a, params_b], fishers),
        merge.regmean([params_a, params_b], grams),
        merge.ties(params_a, [params_b, out["transform"][0]], density=0.5),
        merge.slerp(params_a, params_b, 0.3),
    ]
    return out


@pytest.mark.slow  # its point is a GPU's TF32 default (make test-gpu); CPUs compute float32 anyway
@pytest.mark.parametrize("name", ["bert-cls", "llama-gqa"])
def test_engine_is_exact_whatever_the_global_matmul_precision(name):
    """Every matmul of the library pins full float32 precision: under the lowest global setting
    the results equal those under "highest" (on CPU the run would raise at the first matmul
    left at the default)."""
    ck, params_a = random_model(name)
    _, params_b = random_model(name, seed=1)
    with jax.default_matmul_precision("highest"):
        want = _engine_outputs(ck, params_a, params_b)
    with jax.default_matmul_precision(_lowest_precision()):
        got = _engine_outputs(ck, params_a, params_b)
    flat_want, tree_want = jax.tree_util.tree_flatten(want)
    flat_got, tree_got = jax.tree_util.tree_flatten(got)
    assert tree_want == tree_got
    for w, g in zip(flat_want, flat_got):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_low_precision_params_are_computed_in_float32(dtype):
    """bfloat16 / float16 params: every solve runs in float32 on the upcast values (the same
    transforms as for the float32 copy of those values) and the params come back in their dtype."""
    ck, params_a = random_model("llama-gqa")
    spec = rj.spec_for(ck)
    planted = rj.random_transform(spec, params_a, jax.random.key(11), KINDS)
    params_b = rj.apply_transform(spec, params_a, planted)
    low_a, low_b = (jax.tree_util.tree_map(lambda x: x.astype(dtype), p) for p in (params_a, params_b))
    up_a, up_b = (jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), p) for p in (low_a, low_b))
    low = rj.align(low_a, low_b, spec, heads="permute", rescale="joint")
    up = rj.align(up_a, up_b, spec, heads="permute", rescale="joint")
    assert {x.dtype for x in jax.tree_util.tree_leaves(low.params)} == {jnp.dtype(dtype)}
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5), low.transforms, up.transforms)
    # the params are B moved by those transforms, rounded once to the dtype
    moved = rj.apply_transform(spec, up_b, up.transforms)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y.astype(dtype))), low.params, moved)
    assert low.report["after"]["total"] < 0.01 * low.report["before"]["total"]  # the planted transform is undone


def _option_sets():
    for attention, heads, rescale, ffn, layers in itertools.product(ATTENTION, HEADS, RESCALE, FFN, (None, (1,))):
        if rescale == "joint" and attention != "rotation":
            continue  # refused with a clear error (test_align)
        yield dict(attention=attention, heads=heads, rescale=rescale, ffn=ffn, layers=layers)


OPTION_SETS = list(_option_sets())


def _check_every_option(name):
    ck, params_a = random_model(name)
    spec = rj.spec_for(ck)
    params_b = rj.apply_transform(spec, params_a, rj.random_transform(spec, params_a, jax.random.key(5), KINDS))
    inputs = model_inputs(ck)
    for options in OPTION_SETS:
        result = rj.align(params_a, params_b, spec, **options)
        report = result.report
        assert report["after"]["total"] <= report["before"]["total"] * (1 + 1e-6), options
        assert np.all(np.isfinite([v for v in report["after"].values()])), options
        assert_same_function(ck, params_b, result.params, inputs)


def test_every_option_combination_runs():
    """Every combination of attention x heads x rescale x ffn x layers compiles, runs, lowers
    the distance to A and keeps B's function, on a RoPE model with GQA; every other family in
    the slow run."""
    _check_every_option("llama-gqa")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(FAMILIES) - {"llama-gqa"}))
def test_every_option_combination_runs_on_every_family(name):
    _check_every_option(name)


def test_exact_programs_run_inside_jit_with_constant_arguments():
    """A library program called inside the user's jit with every argument a constant (closed over)
    is a nested jit: it must not pass compiler options (JAX refuses them there)."""
    m = np.eye(4, dtype=np.float32) + 0.1
    out = jax.jit(lambda: rj.solvers.polar(m))()
    np.testing.assert_allclose(np.asarray(out), np.asarray(rj.solvers.polar(m)), atol=1e-6)


def test_a_program_compiles_once_whatever_its_arguments_placement():
    """jax.jit compiles a program again when committed arguments (a jitted result, a device_put to
    a device) come with uncommitted ones (made from host data) after all committed: the library's
    programs commit the others to that device first (precision.committed), the same buffers, the
    same bits."""
    from rotsym_jax.engine.distances import _leaf_sq_dist  # an exact_jit program of two arrays

    m = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    fresh, placed = jnp.asarray(m), jax.device_put(m, jax.devices()[0])
    assert not fresh.committed and placed.committed
    results = [np.asarray(_leaf_sq_dist(placed, placed))]  # compiled here, or by an earlier test in this worker
    compiled = _leaf_sq_dist._cache_size()
    results += [np.asarray(_leaf_sq_dist(x, placed)) for x in (m, fresh)]
    assert _leaf_sq_dist._cache_size() == compiled  # (a count of new programs would read what ran before it)
    assert all(np.array_equal(results[0], r) for r in results)
    # the control: a plain jit compiles twice for the same arrays
    plain = jax.jit(lambda x, y: x + y)
    plain(fresh, placed), plain(placed, placed)
    assert plain._cache_size() == 2


def test_a_program_compiles_once_whatever_the_callers_matmul_precision():
    """jit keys its cache on the caller's `jax_default_matmul_precision`, though an exact_jit
    program pins its own: the library's programs run under the pinned setting, one program (the
    same bits) for a caller at the default, at "highest" (the tests' float32_models) or lowest."""
    from rotsym_jax.engine.distances import _leaf_sq_dist

    m = np.random.default_rng(1).normal(size=(13, 5)).astype(np.float32)  # a shape no other test uses
    results = [np.asarray(_leaf_sq_dist(m, m[::-1]))]
    compiled = _leaf_sq_dist._cache_size()
    for setting in ("highest", _lowest_precision(), "default"):
        with jax.default_matmul_precision(setting):
            results.append(np.asarray(_leaf_sq_dist(m, m[::-1])))
    assert _leaf_sq_dist._cache_size() == compiled
    assert all(np.array_equal(results[0], r) for r in results)
    # the control: a plain jit compiles again under another setting
    plain = jax.jit(lambda x: x @ x.T)
    plain(m)
    with jax.default_matmul_precision("highest"):
        plain(m)
    assert plain._cache_size() == 2


def test_model_init_draws_nnx_normals_from_one_program_per_size():
    """A model's random init: the values of nnx.initializers.normal, bit for bit, from one program
    per power-of-two size (threefry's partitionable counters: a longer draw starts with the
    shorter one), where an eager draw compiles a program per shape."""
    from flax import nnx

    from rotsym_jax.families.nets.layers import normal_init

    key, init = jax.random.key(7), normal_init(0.02)
    for shape in [(32, 48), (48, 32), (60, 32), (3, 40, 24), (5,)]:
        assert np.array_equal(np.asarray(init(key, shape)), np.asarray(nnx.initializers.normal(0.02)(key, shape, jnp.float32))), shape
    compiled, listening = [], [True]  # JAX keeps a listener for the process: it stops recording below
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compiled.append(event) if listening[0] and event == "/jax/core/compile/backend_compile_duration" else None)
    for shape in [(33, 47), (47, 33), (50, 31)]:  # sizes of the 2048 draw compiled above
        init(key, shape)
    assert compiled == []
    nnx.initializers.normal(0.02)(key, (33, 47), jnp.float32)  # the control: a shape of its own compiles
    listening[0] = False
    assert compiled


def test_committing_keeps_buffers_and_leaves_traced_and_host_scalars_alone():
    fresh = jnp.arange(4.0)
    assert not rj.precision.committed({"x": fresh})["x"].committed  # nothing committed: left free
    out = rj.precision.committed({"x": fresh, "n": 3, "s": "name", "placed": jax.device_put(fresh, jax.devices()[0])})
    assert out["x"].committed and out["x"].unsafe_buffer_pointer() == fresh.unsafe_buffer_pointer()
    assert out["n"] == 3 and out["s"] == "name"
    seen = []
    jax.jit(lambda x: seen.append(rj.precision.committed({"x": x})["x"] is x) or x)(fresh)
    assert seen == [True]
