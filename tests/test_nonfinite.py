"""NaN/Inf weights are refused before any solve, naming the model and the leaves; solvers return NaN
(never hang) on non-finite input; only group elements are applied; bad arguments get clear errors.

A batched LAPACK SVD of a matrix holding Inf never returns, so the cases that could hang run in a
subprocess with a time limit: a regression fails here instead of stalling the test run."""

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf

import rotsym_jax as rj
from rotsym_jax import solvers
from rotsym_jax.engine import groups
from rotsym_jax.pytree import flatten, unflatten

LLAMA = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, vocab_size=50)

# Every kind of leaf: Q, K, V, O, FFN gate/up/down, a norm, the embedding (read only by the report).
LEAVES = [
    "layers/0/attention/query/kernel", "layers/1/attention/key/kernel", "layers/0/attention/value/kernel",
    "layers/1/attention/out/kernel", "layers/0/mlp/gate/kernel", "layers/1/mlp/up/kernel",
    "layers/0/mlp/down/kernel", "layers/1/attention_norm/scale", "embeddings/word/embedding",
]

_ALIGN_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np, transformers as tf
    import rotsym_jax as rj
    from rotsym_jax.engine import driver
    from rotsym_jax.pytree import flatten, unflatten

    solved, add = [], driver.Solve.add
    driver.Solve.add = lambda self, *args, **kwargs: solved.append(1) or add(self, *args, **kwargs)

    leaves, config = json.loads(sys.argv[1]), tf.LlamaConfig(**json.loads(sys.argv[2]))
    a, b = (rj.init_checkpoint(config, jax.random.key(s)).params for s in (0, 1))
    spec, out = rj.spec_for(config), []
    for model in "AB":
        for leaf in leaves:
            for value in (float("nan"), float("inf"), float("-inf")):
                fa, fb = flatten(a), flatten(b)
                f = fa if model == "A" else fb
                f[leaf] = f[leaf].at[(0,) * f[leaf].ndim].set(value)
                solved.clear()
                try:
                    rj.align(unflatten(fa), unflatten(fb), spec, heads="permute", rescale="joint")
                    message = None
                except ValueError as e:
                    message = str(e)
                out.append([model, leaf, str(value), message, len(solved)])
    print(json.dumps(out))
    """
)


def test_align_refuses_every_non_finite_pattern_before_any_solve():
    """Quickly, as a count (a wall-clock bound would depend on the machine's load): no chunk
    reaches the solvers, where a NaN could stall an assignment."""
    run = subprocess.run(
        [sys.executable, "-c", _ALIGN_SCRIPT, json.dumps(LEAVES), json.dumps(LLAMA)],
        capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    cases = json.loads(run.stdout.splitlines()[-1])
    assert len(cases) == 2 * len(LEAVES) * 3
    for model, leaf, value, message, solves in cases:
        assert message is not None, f"align accepted {value} in {leaf} of model {model}"
        assert f"(model {model}" in message and leaf in message and "non-finite" in message, message
        kind = "NaN" if value == "nan" else "Inf"
        assert f"1 {kind}" in message, message
        assert solves == 0, f"{model} {leaf} {value}: refused after {solves} chunks were solved"


_SOLVER_SCRIPT = textwrap.dedent(
    """
    import json
    import numpy as np
    from rotsym_jax import solvers

    M = np.random.default_rng(0).normal(size=(4, 6, 6)).astype(np.float32)
    M[1, 0, 0], M[2, 3, 4], M[3, 5, 5] = np.inf, np.nan, -np.inf
    out = {}
    for method in solvers.POLAR_METHODS:
        out[method] = np.asarray(solvers.polar(M, method=method)).tolist()
    out["rope"] = np.asarray(solvers.rope_polar(M, 4)).tolist()
    out["stack"] = np.asarray(solvers.polar_stack(M.reshape(2, 2, 6, 6), (None, 4))).reshape(4, 6, 6).tolist()
    out["nuclear"] = np.asarray(solvers.nuclear_norm(M)).tolist()
    print(json.dumps(out))
    """
)


def test_solvers_give_nan_for_non_finite_matrices_and_never_hang():
    run = subprocess.run([sys.executable, "-c", _SOLVER_SCRIPT], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    out = {k: np.array(v, dtype=np.float64) for k, v in json.loads(run.stdout.splitlines()[-1]).items()}
    M = np.random.default_rng(0).normal(size=(4, 6, 6)).astype(np.float32)
    u, _, vt = np.linalg.svd(M[0].astype(np.float64))
    for name in [*solvers.POLAR_METHODS, "rope", "stack"]:
        R = out[name]
        assert np.isnan(R[1:]).all(), f"{name}: a non-finite matrix must give an all-NaN factor"
        assert np.isfinite(R[0]).all(), name
    for method in solvers.POLAR_METHODS:
        np.testing.assert_allclose(out[method][0], u @ vt, atol=1e-5)
    np.testing.assert_allclose(out["nuclear"][0], np.linalg.svd(M[0].astype(np.float64), compute_uv=False).sum(), rtol=1e-5)
    assert np.isnan(out["nuclear"][1:]).all()


def test_linear_assignment_names_non_finite_scores():
    with pytest.raises(ValueError, match=r"shape \(2, 2\) hold 1 non-finite entries"):
        solvers.linear_assignment(np.array([[1.0, np.nan], [0.0, 1.0]]))


@pytest.fixture(scope="module")
def llama():
    config = tf.LlamaConfig(**LLAMA)
    a, b = (rj.init_checkpoint(config, jax.random.key(s)).params for s in (0, 1))
    return config, rj.spec_for(config), a, b


def test_align_many_names_the_model(llama):
    _, spec, a, b = llama
    fb = flatten(b)
    fb["layers/1/mlp/down/kernel"] = fb["layers/1/mlp/down/kernel"].at[2, 3].set(jnp.nan)
    with pytest.raises(ValueError, match=r"params_list\[2\]: non-finite values in 1 leaves: \['layers/1/mlp/down/kernel \(1 NaN"):
        rj.align_many([a, b, unflatten(fb)], spec)


@pytest.mark.parametrize(
    "layers, message",
    [(1, r"layers=1; expected a collection"), ([True], r"\[True\] are not layer indices"), ("0", "expected a collection")],
)
def test_layers_argument(llama, layers, message):
    _, spec, a, b = llama
    with pytest.raises(TypeError, match=message):
        rj.align(a, b, spec, layers=layers)


@pytest.mark.parametrize("spec", [None, "llama", {"rules": ()}])
def test_spec_must_be_a_spec(llama, spec):
    _, _, a, b = llama
    with pytest.raises(rj.SpecError, match="spec must be a rotsym_jax.Spec"):
        rj.align(a, b, spec)


def _edit(t, name, **changes):
    t[name] = t[name].replace(**changes)


def _broken(llama, edit):
    _, spec, a, _ = llama
    t = rj.random_transform(spec, a, jax.random.key(3))
    edit(t)
    return spec, a, t


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: _edit(t, "ffn", perm=jnp.zeros_like(t["ffn"].perm)), r"transforms\['ffn'\]\.perm\[0\] = \[0, 0, .* is not a permutation of 0..47"),
        (lambda t: _edit(t, "ffn", perm=t["ffn"].perm.at[1, 0].set(48)), r"transforms\['ffn'\]\.perm\[1\] .* not a permutation"),
        (lambda t: _edit(t, "ffn", perm=t["ffn"].perm.astype(jnp.float32)), r"transforms\['ffn'\]\.perm has dtype float32"),
        (lambda t: _edit(t, "attn", head_perm=t["attn"].head_perm.at[0, 1, 0].set(-1)), r"\.head_perm\[0, 1\]"),
        (lambda t: _edit(t, "attn", vo=2 * t["attn"].vo), r"transforms\['attn'\]\.vo\[0, 0\] is not orthogonal \(max \|R\^T R - I\| = 3"),
        (lambda t: _edit(t, "attn", qk=t["attn"].qk.at[1, 0, 0, 0].set(jnp.nan)), r"\.qk\[1, 0\] is not orthogonal"),
        (lambda t: _edit(t, "attn", vo_scale=t["attn"].vo_scale.at[0, 1].set(0.0)), r"\.vo_scale\[0, 1\] = 0.0; scales must be finite and > 0"),
        (lambda t: _edit(t, "attn", qk_scale=t["attn"].qk_scale.at[1, 0].set(jnp.inf)), r"\.qk_scale\[1, 0\] = inf"),
    ],
)
def test_apply_transform_takes_only_group_elements(llama, edit, message):
    spec, a, t = _broken(llama, edit)
    with pytest.raises(ValueError, match=message):
        rj.apply_transform(spec, a, t)


def test_rope_blocks_take_only_rope_compatible_rotations(llama):
    """An orthogonal QK rotation that mixes rotary pairs changes a RoPE model's function."""
    config, spec, a, _ = llama
    t = rj.identity_transform(rj.bind(spec, a))
    haar = rj.random_transform(spec, a, jax.random.key(5), kinds=("vo",))["attn"].vo
    t["attn"] = t["attn"].replace(qk=haar)
    with pytest.raises(ValueError, match=r"\.qk\[0, 0\] does not commute with RoPE \(rotary_dim=8\)"):
        rj.apply_transform(spec, a, t)
    # The check is what keeps the function: without it the outputs move.
    ck = rj.init_checkpoint(config, jax.random.key(0))
    ids = np.arange(12).reshape(2, 6) % config.vocab_size
    moved = groups.apply_to_leaves(rj.bind(spec, a), {p: flatten(a)[p] for p in rj.bind(spec, a).transformed_paths()}, t)
    out = ck.apply(unflatten({**flatten(a), **moved}), input_ids=ids)["last_hidden_state"]
    assert float(jnp.max(jnp.abs(out - ck.apply(a, input_ids=ids)["last_hidden_state"]))) > 1e-3
    # Valid RoPE rotations pass.
    rj.apply_transform(spec, a, rj.random_transform(spec, a, jax.random.key(6)))


# Under jit nothing can be read back before the solve: NaN/Inf in A or B comes back flagged in
# report["nonfinite"] with B as given (the identity), and `check_finite` raises the eager refusal.
JITTED = [
    pytest.param("B", "layers/0/attention/query/kernel", {"ffn": "none"}, id="attention"),  # was unflagged: only report["after"] was NaN
    pytest.param("B", "layers/1/mlp/up/kernel", {}, id="ffn"),  # was a JaxRuntimeError from the host assignment
    pytest.param("A", "layers/0/mlp/down/kernel", {"residual": "permutation", "residual_sweeps": 1}, id="residual"),
]


def _poisoned(params, leaf, value):
    flat = flatten(params)
    flat[leaf] = flat[leaf].at[(0,) * flat[leaf].ndim].set(value)
    return unflatten(flat)


def _flagged(report):
    return {m: {p: (int(c["nan"]), int(c["inf"])) for p, c in leaves.items() if c["nan"] or c["inf"]} for m, leaves in report["nonfinite"].items()}


@pytest.mark.parametrize("model, leaf, options", JITTED)
def test_jitted_align_flags_non_finite_inputs_and_returns_b_as_given(llama, model, leaf, options, caplog):
    _, spec, a, b = llama
    jitted = jax.jit(lambda x, y: rj.align(x, y, spec, **options))
    for value, counts in ((np.nan, (1, 0)), (np.inf, (0, 1))):
        pa, pb = (_poisoned(a, leaf, value), b) if model == "A" else (a, _poisoned(b, leaf, value))
        result = jitted(pa, pb)
        other = "params_b" if model == "A" else "params_a"
        assert _flagged(result.report) == {f"params_{model.lower()}": {leaf: counts}, other: {}}
        for x, y in zip(jax.tree.leaves(result.params), jax.tree.leaves(pb)):  # a NaN in A never spreads into B
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        with pytest.raises(rj.RotsymError) as eager:
            rj.align(pa, pb, spec, **options)
        with pytest.raises(rj.RotsymError) as flagged:
            result.check_finite()
        assert str(flagged.value) == str(eager.value)
    finite = jitted(a, b).check_finite()  # finite models: aligned as ever, nothing flagged
    assert finite.report["after"]["total"] < finite.report["before"]["total"] and _flagged(finite.report) == {"params_a": {}, "params_b": {}}
    assert not [r for r in caplog.records if "callback failed" in r.getMessage()]  # no host callback raised


def test_vmapped_align_flags_only_the_non_finite_model(llama):
    """One NaN model in a stack neither fails the batch nor changes the others' results."""
    _, spec, a, b = llama
    bad = _poisoned(b, "layers/0/mlp/gate/kernel", np.nan)
    result = jax.jit(jax.vmap(lambda y: rj.align(a, y, spec)))(jax.tree.map(lambda *x: jnp.stack(x), b, bad))
    eager = rj.align(a, b, spec)
    for x, y, z in zip(jax.tree.leaves(result.params), jax.tree.leaves(eager.params), jax.tree.leaves(bad)):
        np.testing.assert_allclose(np.asarray(x[0]), np.asarray(y), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(x[1]), np.asarray(z))
    counts = result.report["nonfinite"]["params_b"]["layers/0/mlp/gate/kernel"]
    np.testing.assert_array_equal(np.asarray(counts["nan"]), [0, 1])
    with pytest.raises(rj.RotsymError, match=r"params_b \(model B\) at vmapped index \(1,\): non-finite values in 1 leaves: "
                                             r"\['layers/0/mlp/gate/kernel \(1 NaN, 0 Inf of 1536\)'\]"):
        result.check_finite()


def test_learned_alignment_is_refused_inside_jit_and_refuses_non_finite_weights_eagerly(llama):
    """method="learned" runs forward passes on host data: it cannot be traced, so under jit it is
    refused when traced (before any NaN could pass), and eagerly NaN weights are refused by name."""
    config, spec, a, b = llama
    ck = rj.init_checkpoint(config, jax.random.key(0))
    data = [{"input_ids": np.arange(12).reshape(2, 6) % config.vocab_size}]
    bad = _poisoned(b, "layers/0/attention/value/kernel", np.nan)
    with pytest.raises(rj.RotsymError, match="method='learned' cannot run inside jit"):
        jax.jit(lambda x, y: rj.align(x, y, spec, method="learned", data=data, checkpoint=ck))(a, bad)
    with pytest.raises(rj.RotsymError, match=r"params_b \(model B\): non-finite values in 1 leaves: \['layers/0/attention/value/kernel \(1 NaN"):
        rj.align(a, bad, spec, method="learned", data=data, checkpoint=ck)
