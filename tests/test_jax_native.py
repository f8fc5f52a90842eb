"""`align` as a JAX operation: inside jit (one compilation for a training step), vmapped over a
stack of models or of pairs (equal to the loop), sharded over devices, and its results saved and
restored with orbax."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_invariance import assert_same_function, model_inputs, random_model
from test_spec import CUSTOM_SPEC, custom_forward, custom_params

import rotsym_jax as rj
from rotsym_jax import solvers
from rotsym_jax.pytree import flatten
from rotsym_jax.solvers import assignment
from rotsym_jax.transforms import KINDS

# The joint rescale compiles for seconds (a 1-D search): the slow suite.
OPTIONS = [
    {},
    {"heads": "permute"},
    pytest.param({"heads": "permute", "rescale": "joint"}, marks=pytest.mark.slow),
    {"attention": "permutation"},
    {"layers": [1]},
    {"maps": "invertible"},  # the identity kept on the device must carry the maps' inverses (it had None: a TypeError)
]
OPTION_IDS = ["default", "permute-heads", "joint", "dim-permutation", "one-layer", "invertible"]


def stack(trees):
    # stacked on the host and sent (the same arrays): an eager jnp.stack compiled a program per leaf shape
    return jax.tree.map(lambda *x: jax.device_put(np.stack([np.asarray(v) for v in x])), *trees)


def assert_results_equal(got, want, *, rtol=1e-5):
    """Same permutations exactly; rotations, scales and params to float32 rounding."""
    want_leaves = dict(jax.tree_util.tree_leaves_with_path(want.transforms))
    for path, x in jax.tree_util.tree_leaves_with_path(got.transforms):
        y, path = want_leaves[path], jax.tree_util.keystr(path)
        if jnp.issubdtype(x.dtype, jnp.integer):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=path)
        else:
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol, err_msg=path)
    for path, x in flatten(got.params).items():
        y = np.asarray(flatten(want.params)[path])
        np.testing.assert_allclose(np.asarray(x), y, rtol=rtol, atol=rtol * np.abs(y).max(), err_msg=path)


def item(result, i):
    """Model i of a vmapped AlignResult (the leading axis of every array)."""
    return jax.tree.map(lambda x: np.asarray(x)[i], result)  # on the host: an eager x[i] compiled a program per leaf shape


def model_pair(name, seeds=(0, 1)):
    """(spec, params of each seed): the plain-dict toy transformer of test_spec (fast to compile:
    the default suite), or a built-in family (the slow suite)."""
    if name == "custom":
        return CUSTOM_SPEC, [custom_params(jax.random.key(s)) for s in seeds]
    ck, _ = random_model(name)
    return rj.spec_for(ck), [random_model(name, seed=s)[1] for s in seeds]


MODELS = ["custom", pytest.param("llama-gqa", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_jitted_align_equals_eager(name, options):
    spec, (params_a, params_b) = model_pair(name)
    eager = rj.align(params_a, params_b, spec, **options)
    jitted = jax.jit(lambda a, b: rj.align(a, b, spec, **options))(params_a, params_b)
    assert_results_equal(jitted, eager, rtol=1e-6)
    assert jitted.source_fingerprint is None and "timings" not in jitted.report
    np.testing.assert_allclose(float(jitted.report["after"]["total"]), eager.report["after"]["total"], rtol=1e-5)
    np.testing.assert_allclose(float(jitted.report["layers"][1]["after"]["qk"]), eager.report["layers"][1]["after"]["qk"], rtol=1e-5)


@pytest.mark.usefixtures("float32_models")  # custom model outputs compared at 1e-5 (conftest)
def test_jitted_align_recovers_planted_transform_and_keeps_function():
    params_a = custom_params(jax.random.key(0))
    params_b = rj.apply_transform(CUSTOM_SPEC, params_a, rj.random_transform(CUSTOM_SPEC, params_a, jax.random.key(5), KINDS))
    moved = jax.jit(lambda a, b: rj.align(a, b, CUSTOM_SPEC, heads="permute").params)(params_a, params_b)
    before = rj.distance_report(CUSTOM_SPEC, params_a, params_b)["total"]["total"]
    assert rj.distance_report(CUSTOM_SPEC, params_a, moved)["total"]["total"] <= 1e-5 * before
    ids = jnp.arange(7) % 10
    np.testing.assert_allclose(custom_forward(moved, ids), custom_forward(params_b, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_jitted_align_keeps_a_families_function():
    ck, params_a = random_model("vit-cls")
    spec = rj.spec_for(ck)
    params_b = rj.apply_transform(spec, params_a, rj.random_transform(spec, params_a, jax.random.key(5), KINDS))
    moved = jax.jit(lambda a, b: rj.align(a, b, spec, heads="permute", rescale="joint").params)(params_a, params_b)
    assert_same_function(ck, params_b, moved, model_inputs(ck))


def test_training_step_with_alignment_compiles_once():
    """A jitted step that aligns B to A and averages them: traced and compiled on the first call
    only, then reused on new weights, with the eager result."""
    spec, (params_a, params_b) = model_pair("custom")
    traces = []

    @jax.jit
    def step(pa, pb, lr):
        traces.append(1)  # runs only while tracing
        pa = jax.tree.map(lambda x: x * (1 - lr), pa)  # stands in for an optimizer update
        moved = rj.align(pa, pb, spec).params
        return jax.tree.map(lambda x, y: (x + y) / 2, pa, moved)

    for i in range(3):
        lr = jnp.float32(0.01 * i)
        merged = step(params_a, params_b, lr)
        params_b = jax.tree.map(lambda x: x * 1.01, params_b)
    assert len(traces) == 1 and step._cache_size() == 1
    pa = jax.tree.map(lambda x: x * (1 - lr), params_a)
    eager = jax.tree.map(lambda x, y: (x + y) / 2, pa, rj.align(pa, jax.tree.map(lambda x: x / 1.01, params_b), spec).params)
    for path, x in flatten(merged).items():
        np.testing.assert_allclose(np.asarray(x), np.asarray(flatten(eager)[path]), rtol=1e-5, atol=1e-6, err_msg=path)


def random_direction(tree, key):
    """A direction in parameter space, each leaf at its own scale."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) * jnp.std(x) for k, x in zip(keys, leaves)])


def moved_along(tree, direction, eps):
    return jax.tree.map(lambda x, v: x + eps * v, tree, direction)


def inner(x, y):
    return sum(float(jnp.vdot(u, v)) for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)))


def sq_distance(params_a, params_b):
    """||A - B||^2 summed in float64 on the host, for central differences."""
    return sum(float(np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2))
               for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)))


def discrete_parts(transforms):
    return [np.asarray(x) for x in jax.tree.leaves(transforms) if jnp.issubdtype(x.dtype, jnp.integer)]


# Joint optima (rotations solved per head in closed form, heads assigned with them), so the
# envelope theorem applies; the paper's sequential rescale is not one (its gradient is off by 1.4%).
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("options", [{"rescale": "none"}, pytest.param({"heads": "permute", "rescale": "none"}, marks=pytest.mark.slow)],
                         ids=["rotations", "permute-heads"])
def test_the_aligned_distances_gradient_is_the_envelope_theorems(name, options):
    """The gradient holds the transforms constant (MATH §16): for the aligned distance
    min_T ||A - T.B||^2 that is its exact derivative, in A and in B, which the central difference
    of the distance re-solved at A, B +- eps v measures independently (its permutations unchanged:
    a step that flips one measures the jump). B is A moved by a planted transform after noise, far
    from the near ties of two unrelated models, whose assignments flip within any usable step."""
    spec, (params_a, _) = model_pair(name)
    noisy = moved_along(params_a, random_direction(params_a, jax.random.key(4)), 0.3)
    pair = params_a, rj.apply_transform(spec, noisy, rj.random_transform(spec, noisy, jax.random.key(5), KINDS))

    def aligned_sq(a, b):  # every leaf's, the task head's included (the report leaves out what is set aside)
        moved = rj.align(a, b, spec, **options).params
        return sum(jnp.sum(jnp.square(x - y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(moved)))

    grads = jax.jit(jax.grad(aligned_sq, argnums=(0, 1)))(*pair)
    permutations = discrete_parts(rj.align(*pair, spec, **options).transforms)
    eps = 1e-4
    for which, key in enumerate(jax.random.split(jax.random.key(7), 2)):
        v = random_direction(pair[which], key)

        def resolved(sign, which=which, v=v):
            at = list(pair)
            at[which] = moved_along(at[which], v, sign * eps)
            result = rj.align(*at, spec, **options)
            for x, y in zip(discrete_parts(result.transforms), permutations):
                np.testing.assert_array_equal(x, y)
            return sq_distance(at[0], result.params)

        central = (resolved(1) - resolved(-1)) / (2 * eps)
        largest = np.sqrt(inner(grads[which], grads[which]) * inner(v, v))  # of any direction of v's length
        np.testing.assert_allclose(inner(grads[which], v), central, rtol=1e-3, atol=1e-4 * largest, err_msg=f"d/d{'AB'[which]}")


def test_a_permutation_alignment_differentiates_exactly():
    """Where every transform is a permutation the solution is locally constant, so holding it
    constant is the exact derivative: the JVP of the moved params is their central difference with
    every permutation re-solved (and found unchanged)."""
    spec, (params_a, params_b) = model_pair("custom")
    options = {"attention": "permutation", "rescale": "none"}
    v = random_direction(params_b, jax.random.key(3))
    result, tangent = jax.jvp(lambda b: rj.align(params_a, b, spec, **options), (params_b,), (v,))
    eps = 1e-3
    plus, minus = (rj.align(params_a, moved_along(params_b, v, s * eps), spec, **options) for s in (1, -1))
    for resolved in (plus, minus):
        for x, y in zip(discrete_parts(resolved.transforms), discrete_parts(result.transforms)):
            np.testing.assert_array_equal(x, y)
    for path, t in flatten(tangent.params).items():
        central = (np.asarray(flatten(plus.params)[path]) - np.asarray(flatten(minus.params)[path])) / (2 * eps)
        np.testing.assert_allclose(np.asarray(t), central, rtol=1e-4, atol=1e-4 * np.abs(central).max(), err_msg=path)
    assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(tangent.transforms) if x.dtype != jax.dtypes.float0)


def test_gradients_through_align_vmap_over_a_stack():
    spec, (params_a, *models) = model_pair("custom", seeds=(0, 2, 3))
    distance = lambda b: rj.align(params_a, b, spec).report["after"]["total"]
    batched = jax.jit(jax.vmap(jax.grad(distance)))(stack(models))
    for i, model in enumerate(models):
        for path, x in flatten(jax.grad(distance)(model)).items():
            np.testing.assert_allclose(np.asarray(flatten(batched)[path][i]), np.asarray(x), rtol=1e-5, atol=1e-6, err_msg=path)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("options", [{}, {"heads": "permute"}, {"attention": "permutation"}], ids=["default", "permute-heads", "dim-permutation"])
def test_vmap_over_a_stack_equals_the_loop(name, options):
    spec, (params_a, *models) = model_pair(name, seeds=(0, 2, 3, 4))
    batched = jax.jit(jax.vmap(lambda b: rj.align(params_a, b, spec, **options)))(stack(models))
    for i, params_b in enumerate(models):
        assert_results_equal(item(batched, i), rj.align(params_a, params_b, spec, **options))


def test_vmap_over_pairs_equals_the_loop():
    spec, models = model_pair("custom", seeds=(2, 3, 4, 5))
    anchors, others = stack(models[:2]), stack(models[2:])
    batched = jax.vmap(lambda a, b: rj.align(a, b, spec, heads="permute"))(anchors, others)
    for i in range(2):
        assert_results_equal(item(batched, i), rj.align(models[i], models[2 + i], spec, heads="permute"))


def test_vmapped_assignments_reach_the_host_in_one_call(monkeypatch):
    """The host gets every model's cost matrices at once (one callback per group), so the N x L
    assignments share the thread pool."""
    spec, (params_a, *models) = model_pair("custom", seeds=(0, 2, 3, 4))
    calls = []
    solve = assignment.batched_linear_assignment
    monkeypatch.setattr(assignment, "batched_linear_assignment", lambda s, maximize=True: calls.append(np.shape(s)) or solve(s, maximize))
    jax.block_until_ready(jax.jit(jax.vmap(lambda b: rj.align(params_a, b, spec, attention="none").params))(stack(models)))
    (group,) = rj.bind(spec, params_a).perms
    assert calls == [(3, len(group.layers), group.size, group.size)]


def test_assign_is_the_host_assignment_eagerly_and_traced():
    scores = np.random.default_rng(0).normal(size=(3, 4, 6, 6)).astype(np.float32)
    want = assignment.batched_linear_assignment(scores)
    np.testing.assert_array_equal(np.asarray(solvers.assign(scores)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(solvers.assign)(scores)), want)
    np.testing.assert_array_equal(np.asarray(jax.vmap(jax.vmap(solvers.assign))(scores)), want)
    bad = scores.copy()
    bad[1, 2, 3, 4] = np.nan
    with pytest.raises(Exception, match="non-finite"):
        jax.block_until_ready(jax.jit(solvers.assign)(bad))
    # align's own calls: the identity for that matrix, the others solved (a raising callback fails the batch)
    lenient = np.asarray(jax.jit(lambda s: solvers.assign(s, traced_nonfinite="identity"))(bad))
    want[1, 2] = np.arange(6)
    np.testing.assert_array_equal(lenient, want)


def test_jitted_assign_skips_the_host_when_every_matrix_is_certified(monkeypatch):
    """Inside jit, a batch the device certifies (permuted copies plus noise, offsets = half the
    squared norms) never reaches the host; one uncertified matrix sends the whole batch there,
    with the host's answer."""
    rng = np.random.default_rng(1)
    n, d = 16, 8
    A = rng.standard_normal((3, n, d))
    q = np.stack([rng.permutation(n) for _ in range(3)])
    B = np.take_along_axis(A, q[..., None], axis=1) + 0.01 * rng.standard_normal((3, n, d))
    S, rows, cols = (np.einsum("lid,ljd->lij", B, A), 0.5 * (B * B).sum(-1), 0.5 * (A * A).sum(-1))
    calls = []
    solve = assignment.batched_linear_assignment
    monkeypatch.setattr(assignment, "batched_linear_assignment", lambda s, maximize=True: calls.append(np.shape(s)) or solve(s, maximize))
    jitted = jax.jit(lambda s, r, c: solvers.assign(s, offsets=(r, c)))
    np.testing.assert_array_equal(np.asarray(jitted(S, rows, cols)), np.argsort(q, axis=-1))
    assert calls == []
    S[1] = rng.standard_normal((n, d)) @ A[1].T  # an unrelated model in layer 1
    rows[1] = 0.0
    assert not bool(solvers.certified_assignment(S[1], rows[1], cols[1])[1])
    np.testing.assert_array_equal(np.asarray(jitted(S, rows, cols)), solve(S))
    assert calls == [(3, n, n)]


def test_vmapped_assign_skips_the_host_as_the_jitted_one_does(monkeypatch):
    """Under vmap a lax.cond with a batched predicate runs both branches: the host assignment ran
    for every stack, certified or not (the GPU run: vmapped 4x slower than a loop of jitted calls
    at N = 1). The choice is made for the whole stack (`batch_cond`)."""
    rng = np.random.default_rng(2)
    n, d = 16, 8
    A = rng.standard_normal((2, 3, n, d))
    q = np.stack([[rng.permutation(n) for _ in range(3)] for _ in range(2)])
    B = np.take_along_axis(A, q[..., None], axis=2) + 0.01 * rng.standard_normal((2, 3, n, d))
    S, rows, cols = np.einsum("mlid,mljd->mlij", B, A), 0.5 * (B * B).sum(-1), 0.5 * (A * A).sum(-1)
    calls = []
    solve = assignment.batched_linear_assignment
    monkeypatch.setattr(assignment, "batched_linear_assignment", lambda s, maximize=True: calls.append(np.shape(s)) or solve(s, maximize))
    vmapped = jax.jit(jax.vmap(lambda s, r, c: solvers.assign(s, offsets=(r, c))))
    np.testing.assert_array_equal(np.asarray(vmapped(S, rows, cols)), np.argsort(q, axis=-1))
    assert calls == []
    S[1, 2] = rng.standard_normal((n, d)) @ A[1, 2].T  # model 1's layer 2 is unrelated: the whole stack goes to the host, once
    rows[1, 2] = 0.0
    np.testing.assert_array_equal(np.asarray(vmapped(S, rows, cols)), solve(S))
    assert calls == [(2, 3, n, n)]


@pytest.mark.parametrize("n", [1, 2])
def test_vmapped_align_takes_the_jitted_programs_branches(n):
    """Every lax.cond of the jitted program is kept under vmap (none becomes a select that runs
    both sides), and the results are the jitted ones: bit for bit over one model (vmap over a
    batch of one runs the jitted program: `unbatched_at_one`), to float32 rounding over more (XLA
    batches the matmuls and reductions of a stack in its own order)."""
    spec, (params_a, *models) = model_pair("custom", seeds=(0, 2, 3)[: n + 1])
    conds = lambda jaxpr: str(jaxpr).count(" cond[")  # noqa: E731
    jitted = jax.make_jaxpr(lambda b: rj.align(params_a, b, spec).params)(models[0])
    vmapped = jax.make_jaxpr(jax.vmap(lambda b: rj.align(params_a, b, spec).params))(stack(models))
    assert conds(vmapped) == conds(jitted) > 0
    batched = jax.jit(jax.vmap(lambda b: rj.align(params_a, b, spec)))(stack(models))
    one = jax.jit(lambda b: rj.align(params_a, b, spec))
    for i, params_b in enumerate(models):
        if n == 1:
            got, want = item(batched, i), one(params_b)
            for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
            # vmap without jit hands the one model over as arrays: aligned as traced all the same (the
            # report's distances arrays, no timings), the jitted results to float32 rounding
            eager = jax.vmap(lambda b: rj.align(params_a, b, spec))(stack(models))
            assert jax.tree.structure(eager) == jax.tree.structure(batched)
            assert_results_equal(item(eager, i), want)
        else:
            assert_results_equal(item(batched, i), one(params_b))


SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from test_spec import SCANNED_SPEC, custom_params
    import rotsym_jax as rj
    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("x",))

    def same(got, want):
        want_leaves = dict(jax.tree_util.tree_leaves_with_path(want))
        for path, x in jax.tree_util.tree_leaves_with_path(got):
            y, path = want_leaves[path], jax.tree_util.keystr(path)
            if jnp.issubdtype(x.dtype, jnp.integer):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=path)
            else:
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5, err_msg=path)

    anchor = custom_params(jax.random.key(0), scanned=True)
    models = [custom_params(jax.random.key(s), scanned=True) for s in range(1, 5)]
    stack = jax.tree.map(lambda *x: jnp.stack(x), *models)
    align = jax.jit(jax.vmap(lambda b: rj.align(anchor, b, SCANNED_SPEC, heads="permute").transforms))
    want = align(stack)
    # the model axis of a stack over the 4 devices
    on_models = jax.device_put(stack, NamedSharding(mesh, P("x")))
    assert len(jax.tree.leaves(on_models)[0].sharding.device_set) == 4
    same(align(on_models), want)
    # the layer axis of a scanned model (3 layers, padded view: shard a 4-layer stack)
    deep = lambda key: jax.tree.map(lambda x: jnp.concatenate([x, x[:1]]), custom_params(key, scanned=True)["stack"])
    spec4 = SCANNED_SPEC
    a4 = {"stack": deep(jax.random.key(0)), "emb": anchor["emb"]}
    b4 = {"stack": deep(jax.random.key(1)), "emb": models[0]["emb"]}
    layer_sharded = {"stack": jax.device_put(b4["stack"], NamedSharding(mesh, P("x"))), "emb": b4["emb"]}
    one = jax.jit(lambda a, b: rj.align(a, b, spec4).transforms)
    same(one(a4, layer_sharded), rj.align(a4, b4, spec4).transforms)
    print("sharded ok")
""")


@pytest.mark.slow  # a fresh JAX process with four devices, compiling for each sharding
def test_sharded_inputs_give_the_same_transforms():
    """Four host devices (a fresh process: the device count is fixed when JAX starts)."""
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "sharded ok" in done.stdout


def test_transforms_and_params_round_trip_through_orbax(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    spec, (params_a, params_b) = model_pair("custom")
    result = rj.align(params_a, params_b, spec, heads="permute")
    saved = {"params": result.params, "transforms": result.transforms}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "aligned", saved)
    # The target structure comes from the spec: the identity transforms and the model's shapes.
    target = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_b),
              "transforms": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rj.identity_transform(result.bound))}
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "aligned", target)
    assert set(restored["transforms"]) == set(result.transforms)
    for name, t in restored["transforms"].items():
        assert type(t) is type(result.transforms[name])
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The restored transforms still move B to the aligned params: a job resumes with its alignment.
    again = rj.apply_transform(spec, params_b, restored["transforms"])
    for path, x in flatten(again).items():
        np.testing.assert_allclose(np.asarray(x), np.asarray(flatten(result.params)[path]), rtol=1e-6, atol=1e-6)
