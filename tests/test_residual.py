"""The residual stream's symmetry (MATH §10): permutations keep every family's function,
rotations keep the RMSNorm families' once their gains are folded; `align(residual=...)` recovers
planted transforms combined with every other group, its T step is the brute-force optimum, and
what cannot work is refused with a reason."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf
from test_invariance import FAMILIES, model_inputs, outputs, random_model

import rotsym_jax as rj
from rotsym_jax.engine import residual as res
from rotsym_jax.pytree import flatten
from rotsym_jax.transforms import KINDS

RMS = sorted(n for n in FAMILIES if n.startswith(("llama", "mistral", "qwen2")))
# The default run keeps one LayerNorm encoder, the ViT and a GQA Llama; the slow suite has them all.
DEFAULT = ("roberta-cls", "vit-cls", "llama-gqa")


def marked(names, extra=()):
    return [pytest.param(n, *extra, marks=[] if n in DEFAULT else [pytest.mark.slow]) for n in names]


def assert_same_function(ck, reference, moved, t_matrix, inputs, tol=1e-5):
    """Every output equal, the hidden states up to the basis change (they live in the stream)."""
    ref, new = outputs(ck, reference, inputs), outputs(ck, moved, inputs)
    for key in ref:
        a, b = np.asarray(ref[key]), np.asarray(new[key])
        if key == "last_hidden_state":
            a = a @ np.asarray(t_matrix)
        err = np.max(np.abs(a - b)) / np.max(np.abs(a))
        assert err <= tol, f"{key}: relative change {err:.2e} > {tol}"


def dense_inputs(ck):
    inputs = model_inputs(ck)
    if "attention_mask" in inputs:  # padded positions' hidden states are not compared
        inputs["attention_mask"] = np.ones_like(inputs["attention_mask"])
    return inputs


@pytest.mark.usefixtures("float32_models")
@pytest.mark.parametrize("name", marked(sorted(FAMILIES)))
def test_residual_permutation_keeps_every_familys_function(name):
    ck, params = random_model(name)
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, params, jax.random.key(2), KINDS)
    t["residual"] = rj.random_residual(spec, params, jax.random.key(3), "permutation")
    moved = rj.apply_transform(spec, params, t)
    assert not np.allclose(moved["embeddings"]["word"]["embedding"] if "word" in moved["embeddings"] else moved["embeddings"]["position"],
                           params["embeddings"]["word"]["embedding"] if "word" in params["embeddings"] else params["embeddings"]["position"])
    assert_same_function(ck, params, moved, t["residual"].matrix(), dense_inputs(ck))


@pytest.mark.usefixtures("float32_models")
@pytest.mark.parametrize("name", marked(RMS))
def test_folding_and_residual_rotation_keep_rmsnorm_function(name):
    ck, params = random_model(name)
    spec = rj.spec_for(ck)
    folded = rj.fold_norms(spec, params)
    assert all(np.all(np.asarray(v) == 1) for p, v in flatten(folded).items() if p.endswith("norm/scale"))
    inputs = dense_inputs(ck)
    ref = outputs(ck, params, inputs)
    np.testing.assert_allclose(outputs(ck, folded, inputs)["logits"], ref["logits"], rtol=1e-5, atol=1e-5 * np.abs(ref["logits"]).max())
    t = rj.random_transform(spec, folded, jax.random.key(2), KINDS)
    t["residual"] = rj.random_residual(spec, folded, jax.random.key(3), "rotation")
    moved = rj.apply_transform(spec, folded, t)
    assert_same_function(ck, folded, moved, t["residual"].matrix(), inputs)


def test_folded_checkpoint_saves_as_a_valid_model(tmp_path):
    ck, params = random_model("llama-gqa")
    folded = rj.fold_norms(rj.spec_for(ck), params)
    rj.save_hf(ck, folded, tmp_path / "folded")
    again = rj.load_hf(tmp_path / "folded")
    inputs = dense_inputs(ck)
    np.testing.assert_allclose(outputs(again, again.params, inputs)["logits"], outputs(ck, params, inputs)["logits"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,mode", [pytest.param(n, "permutation", marks=[] if n == "vit-cls" else [pytest.mark.slow]) for n in sorted(FAMILIES)]
                         + [pytest.param(n, "rotation", marks=[] if n == "llama-gqa" else [pytest.mark.slow]) for n in RMS])
def test_planted_residual_and_every_group_are_recovered(name, mode):
    ck, params = random_model(name)
    spec = rj.spec_for(ck)
    a = rj.fold_norms(spec, params) if mode == "rotation" else params
    t = rj.random_transform(spec, a, jax.random.key(2), KINDS)
    t["residual"] = rj.random_residual(spec, a, jax.random.key(3), mode)
    b = rj.apply_transform(spec, a, t)
    result = rj.align(a, b, spec, heads="permute", rescale="joint", residual=mode)
    before, after = result.report["before"]["total"], result.report["after"]["total"]
    assert after <= 1e-6 * before, (before, after)
    assert result.report["residual"]["distance_per_sweep"][0] >= after * (1 - 1e-5)
    # Without the residual stream the paper's groups cannot get there.
    assert rj.align(a, b, spec, heads="permute", rescale="joint").report["after"]["total"] > 0.1 * before
    assert_same_function(ck, b, result.params, result.transforms["residual"].matrix(), dense_inputs(ck))


def tiny_llama(seed):
    config = tf.LlamaConfig(vocab_size=11, hidden_size=4, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                            intermediate_size=6, max_position_embeddings=16, tie_word_embeddings=False)
    ck = rj.init_checkpoint(config, jax.random.key(seed), head="lm")
    return ck, jax.tree.map(lambda x: x + 0.2 * jax.random.normal(jax.random.key(seed + 7), x.shape), ck.params)


def test_residual_step_is_the_brute_force_optimum():
    """With every other group off, align's T is the best of all 4! permutations of the stream."""
    ck, a = tiny_llama(0)
    _, b = tiny_llama(1)
    spec = rj.spec_for(ck)
    result = rj.align(a, b, spec, attention="none", ffn="none", residual="permutation")
    best = min(
        rj.distance_report(spec, a, rj.apply_transform(spec, b, {**rj.identity_transform(rj.bind(spec, b)),
                                                                  "residual": rj.ResidualTransform(jnp.array(p, jnp.int32))}))["total"]["total"]
        for p in itertools.permutations(range(4))
    )
    np.testing.assert_allclose(result.report["after"]["total"], best, rtol=1e-6)


def test_residual_rotation_step_is_the_procrustes_optimum():
    """Rotation: the T step equals the float64 SVD polar factor of the summed cross products, and
    no random rotation nearby does better."""
    ck, a = tiny_llama(0)
    _, b = tiny_llama(1)
    spec = rj.spec_for(ck)
    a, b = rj.fold_norms(spec, a), rj.fold_norms(spec, b)
    result = rj.align(a, b, spec, attention="none", ffn="none", residual="rotation")
    bound = rj.bind(spec, b)
    m = np.asarray(res.residual_cross(bound, flatten(a), flatten(b), True), np.float64)
    u, _, vt = np.linalg.svd(m)
    np.testing.assert_allclose(np.asarray(result.transforms["residual"].matrix()), u @ vt, atol=1e-5)
    identity = rj.identity_transform(bound)
    for k in range(5):
        s = jax.random.normal(jax.random.key(k), (4, 4))
        nudge = jax.scipy.linalg.expm(0.05 * (s - s.T))  # a rotation near the identity
        other = rj.ResidualTransform(jnp.arange(4, dtype=jnp.int32), jnp.asarray(u @ vt, jnp.float32) @ nudge)
        moved = rj.apply_transform(spec, b, {**identity, "residual": other})
        assert rj.distance_report(spec, a, moved)["total"]["total"] >= result.report["after"]["total"] - 1e-6


def test_what_cannot_work_is_refused():
    ck, params = random_model("vit-cls")
    spec = rj.spec_for(ck)
    with pytest.raises(ValueError, match="LayerNorm"):
        rj.align(params, params, spec, residual="rotation")
    ck, params = random_model("llama-gqa")
    spec = rj.spec_for(ck)
    with pytest.raises(ValueError, match="fold_norms"):
        rj.align(params, params, spec, residual="rotation")
    with pytest.raises(ValueError, match="residual"):
        rj.align(params, params, spec, residual="shear")
    rotation = rj.random_residual(spec, params, jax.random.key(0), "rotation")
    with pytest.raises(ValueError, match="not uniform"):
        rj.apply_transform(spec, params, {**rj.identity_transform(rj.bind(spec, params)), "residual": rotation})
    # A tied LM head reads the final norm through the embedding: that gain cannot be folded.
    config = tf.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                            max_position_embeddings=64, tie_word_embeddings=True)
    tied = rj.init_checkpoint(config, jax.random.key(0))
    params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(1), x.shape) if x.ndim == 1 else x, tied.params)
    spec = rj.spec_for(tied)
    with pytest.raises(ValueError, match="tied LM head"):
        rj.align(params, params, spec, residual="rotation", attention="none", ffn="none")
    with pytest.raises(rj.SpecError, match="residual rules"):
        rj.align(params, params, rj.Spec(spec.rules, spec.heads), residual="permutation")


def test_residual_alignment_inside_jit_equals_eager():
    ck, a = tiny_llama(0)
    _, b = tiny_llama(1)
    spec = rj.spec_for(ck)
    eager = rj.align(a, b, spec, residual="permutation", residual_sweeps=3)
    jitted = jax.jit(lambda x, y: rj.align(x, y, spec, residual="permutation", residual_sweeps=3))(a, b)
    np.testing.assert_allclose(float(jitted.report["after"]["total"]), eager.report["after"]["total"], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(jitted.transforms["residual"].perm), np.asarray(eager.transforms["residual"].perm))


def test_residual_transform_algebra():
    ck, params = random_model("llama-gqa")
    spec = rj.spec_for(ck)
    folded = rj.fold_norms(spec, params)
    bound = rj.bind(spec, folded)
    t1 = {**rj.random_transform(spec, folded, jax.random.key(1), KINDS), "residual": rj.random_residual(spec, folded, jax.random.key(2), "rotation")}
    t2 = {**rj.random_transform(spec, folded, jax.random.key(3), KINDS), "residual": rj.random_residual(spec, folded, jax.random.key(4), "permutation")}
    both = rj.apply_transform(bound, rj.apply_transform(bound, folded, t1), t2)
    composed = rj.apply_transform(bound, folded, rj.compose_transforms(t1, t2))
    undone = rj.apply_transform(bound, both, rj.invert_transform(rj.compose_transforms(t1, t2)))
    for path, x in flatten(folded).items():
        np.testing.assert_allclose(np.asarray(flatten(composed)[path]), np.asarray(flatten(both)[path]), atol=2e-5, err_msg=path)
        np.testing.assert_allclose(np.asarray(flatten(undone)[path]), np.asarray(x), atol=2e-5, err_msg=path)
