"""The residual stream's symmetry (MATH §10): permutations keep every family's function,
rotations keep the pre-norm families' once their gains are folded (any rotation for RMSNorm, those
fixing the ones vector for LayerNorm: GPT-2, ViT); `align(residual=...)` recovers planted
transforms combined with every other group, its T step is the brute-force (Procrustes) optimum,
and what cannot work is refused with a reason."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf
from checkpoint_utils import plus_noise
from test_invariance import FAMILIES, SMALL, model_inputs, outputs, planted_pair, random_model

import rotsym_jax as rj
from rotsym_jax.engine import groups
from rotsym_jax.engine import residual as res
from rotsym_jax.pytree import flatten
from rotsym_jax.transforms import KINDS, random_orthogonal

RMS = sorted(n for n in FAMILIES if n.startswith(("llama", "mistral", "qwen2", "qwen3")))
GPT2 = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=97, initializer_range=0.2)
VIT = dict(**SMALL, image_size=8, patch_size=2, num_channels=1, num_labels=5)
# Pre-LayerNorm models whose every norm can be folded: an untied LM head and a bias-free score head
# (their final norm's bias stays as beta / gain), and a ViT without Q/K/V biases (likewise its
# attention norms'); the image classifier of FAMILIES["vit-cls"] has biases everywhere.
PRE_LN = {
    "gpt2-lm-untied": (lambda: tf.GPT2Config(**GPT2, tie_word_embeddings=False), dict(head="lm")),
    "gpt2-score": (lambda: tf.GPT2Config(**GPT2, num_labels=3, pad_token_id=0), dict(head="sequence_classification")),
    "vit-cls": FAMILIES["vit-cls"],
    "vit-no-qkv-bias": (lambda: tf.ViTConfig(**VIT, qkv_bias=False), dict(head="image_classification")),
}


def pre_ln_model(name, seed=0):
    make_config, kwargs = PRE_LN[name]
    ck = rj.init_checkpoint(make_config(), jax.random.key(seed), **kwargs)
    keys = iter(jax.random.split(jax.random.key(seed + 100), 1000))
    return ck, jax.tree_util.tree_map(lambda x: plus_noise(x, next(keys), 0.3) if x.ndim == 1 else x, ck.params)
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
    # The stream's norm gains fold; a QK-norm gain (Qwen3's query_norm, key_norm) is not on the stream.
    gains = set(rj.bind(spec, params).residual.gains)
    assert gains and all(np.all(np.asarray(v) == 1) for p, v in flatten(folded).items() if p in gains)
    assert all(p in gains for p in flatten(folded) if p.endswith("norm/scale") and "/attention/" not in p)
    inputs = dense_inputs(ck)
    ref = outputs(ck, params, inputs)
    np.testing.assert_allclose(outputs(ck, folded, inputs)["logits"], ref["logits"], rtol=1e-5, atol=1e-5 * np.abs(ref["logits"]).max())
    t = rj.random_transform(spec, folded, jax.random.key(2), KINDS)
    t["residual"] = rj.random_residual(spec, folded, jax.random.key(3), "rotation")
    moved = rj.apply_transform(spec, folded, t)
    assert_same_function(ck, folded, moved, t["residual"].matrix(), inputs)


@pytest.mark.usefixtures("float32_models")
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n in ("gpt2-score", "vit-no-qkv-bias") else [pytest.mark.slow]) for n in PRE_LN])
def test_folding_and_residual_rotation_keep_layernorm_function(name):
    """MATH §10: once gains (and biases) are folded, every rotation fixing the ones vector is a
    symmetry of a pre-LayerNorm model; one that does not fix it is not."""
    ck, params = pre_ln_model(name)
    spec = rj.spec_for(ck)
    folded = rj.fold_norms(spec, params)
    flat = flatten(folded)
    assert all(np.all(np.asarray(v) == 1) for p, v in flat.items() if p.endswith("norm/scale"))
    # A norm bias folds into the readers' biases where every reader has one; else it stays as beta / gain.
    kept = {p for p, v in flat.items() if p.endswith("norm/bias") and np.any(np.asarray(v) != 0)}
    assert kept == {"vit-no-qkv-bias": {"layers/0/attention_norm/bias", "layers/1/attention_norm/bias"},
                    "gpt2-lm-untied": {"final_norm/bias"}, "gpt2-score": {"final_norm/bias"}, "vit-cls": set()}[name]
    inputs = dense_inputs(ck)
    ref = outputs(ck, params, inputs)
    key = "logits"
    np.testing.assert_allclose(outputs(ck, folded, inputs)[key], ref[key], rtol=1e-5, atol=1e-5 * np.abs(ref[key]).max())
    t = rj.random_transform(spec, folded, jax.random.key(2), KINDS)
    t["residual"] = rj.random_residual(spec, folded, jax.random.key(3), "rotation")
    matrix = np.asarray(t["residual"].matrix(), np.float64)
    np.testing.assert_allclose(matrix @ np.ones(len(matrix)), np.ones(len(matrix)), atol=1e-5)
    assert np.abs(matrix - np.eye(len(matrix))).max() > 0.1  # a rotation, not a permutation
    moved = rj.apply_transform(spec, folded, t)
    assert_same_function(ck, folded, moved, matrix, inputs)
    # A rotation that moves the ones vector breaks LayerNorm's centring: refused, and it would change the outputs.
    plain = rj.ResidualTransform(jnp.arange(len(matrix), dtype=jnp.int32), random_orthogonal(jax.random.key(4), (), len(matrix)))
    with pytest.raises(ValueError, match="does not fix the ones vector"):
        rj.apply_transform(spec, folded, {**rj.identity_transform(rj.bind(spec, folded)), "residual": plain})
    bound = rj.bind(spec, folded)
    broken = groups.apply_unchecked(bound, folded, {**rj.identity_transform(bound), "residual": plain})
    with pytest.raises(AssertionError):
        assert_same_function(ck, folded, broken, plain.matrix(), inputs)


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
    ck, spec, a, b = planted_pair(name, mode)
    result = rj.align(a, b, spec, heads="permute", rescale="joint", residual=mode)
    before, after = result.report["before"]["total"], result.report["after"]["total"]
    assert after <= 1e-6 * before, (before, after)
    assert result.report["residual"]["distance_per_sweep"][0] >= after * (1 - 1e-5)
    # Without the residual stream the paper's groups cannot get there.
    assert rj.align(a, b, spec, heads="permute", rescale="joint").report["after"]["total"] > 0.1 * before
    assert_same_function(ck, b, result.params, result.transforms["residual"].matrix(), dense_inputs(ck))


@pytest.mark.usefixtures("float32_models")
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "vit-cls" else [pytest.mark.slow]) for n in PRE_LN])
def test_planted_layernorm_rotation_and_every_group_are_recovered(name):
    ck, params = pre_ln_model(name)
    spec = rj.spec_for(ck)
    a = rj.fold_norms(spec, params)
    t = rj.random_transform(spec, a, jax.random.key(2), KINDS)
    t["residual"] = rj.random_residual(spec, a, jax.random.key(3), "rotation")
    b = rj.apply_transform(spec, a, t)
    result = rj.align(a, b, spec, heads="permute", rescale="joint", residual="rotation")
    before, after = result.report["before"]["total"], result.report["after"]["total"]
    assert after <= 1e-5 * before, (before, after)
    matrix = np.asarray(result.transforms["residual"].matrix(), np.float64)
    np.testing.assert_allclose(matrix @ np.ones(len(matrix)), np.ones(len(matrix)), atol=1e-5)
    assert rj.align(a, b, spec, heads="permute", rescale="joint", residual="permutation").report["after"]["total"] > 0.1 * before
    assert_same_function(ck, b, result.params, matrix, dense_inputs(ck))


def test_layernorm_rotation_step_is_the_procrustes_optimum_fixing_ones():
    """The T step on a pre-LayerNorm model: the best rotation with T 1 = 1, computed independently
    in float64 (an orthonormal basis of the complement of 1 from a QR, an SVD there), and no
    nearby rotation fixing 1 does better."""
    config = tf.GPT2Config(n_embd=6, n_layer=1, n_head=2, vocab_size=11, n_positions=8, tie_word_embeddings=False)
    make = lambda seed: jax.tree.map(lambda x: plus_noise(x, jax.random.key(seed + 7), 0.3),
                                     rj.init_checkpoint(config, jax.random.key(seed), head="lm").params)
    ck = rj.init_checkpoint(config, jax.random.key(0), head="lm")
    spec = rj.spec_for(ck)
    a, b = rj.fold_norms(spec, make(0)), rj.fold_norms(spec, make(1))
    result = rj.align(a, b, spec, attention="none", ffn="none", residual="rotation")
    bound = rj.bind(spec, b)
    m = np.asarray(res.residual_cross(bound, bound.residual, flatten(a), flatten(b), True), np.float64)
    d = m.shape[0]
    basis = np.linalg.qr(np.concatenate([np.ones((d, 1)), np.random.default_rng(0).normal(size=(d, d - 1))], axis=1))[0][:, 1:]
    u, _, vt = np.linalg.svd(basis.T @ m @ basis)
    best = np.ones((d, d)) / d + basis @ (u @ vt) @ basis.T
    got = np.asarray(result.transforms["residual"].matrix(), np.float64)
    np.testing.assert_allclose(got, best, atol=1e-5)
    assert np.trace(got.T @ m) >= np.trace(np.eye(d) @ m) - 1e-6
    identity = rj.identity_transform(bound)
    for k in range(5):
        s = jax.random.normal(jax.random.key(k), (d - 1, d - 1))
        nudge = basis @ np.asarray(jax.scipy.linalg.expm(0.05 * (s - s.T)), np.float64) @ basis.T + np.ones((d, d)) / d
        other = rj.ResidualTransform(jnp.arange(d, dtype=jnp.int32), jnp.asarray(best @ nudge, jnp.float32))
        moved = rj.apply_transform(spec, b, {**identity, "residual": other})
        assert rj.distance_report(spec, a, moved)["total"]["total"] >= result.report["after"]["total"] - 1e-6


def tiny_llama(seed):
    config = tf.LlamaConfig(vocab_size=11, hidden_size=4, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                            intermediate_size=6, max_position_embeddings=16, tie_word_embeddings=False)
    ck = rj.init_checkpoint(config, jax.random.key(seed), head="lm")
    return ck, jax.tree.map(lambda x: plus_noise(x, jax.random.key(seed + 7), 0.2), ck.params)


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
    m = np.asarray(res.residual_cross(bound, bound.residual, flatten(a), flatten(b), True), np.float64)
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
    ck, params = random_model("roberta-cls")  # post-LN: the stream passes the gains themselves
    spec = rj.spec_for(ck)
    for call in (lambda: rj.align(params, params, spec, residual="rotation"), lambda: rj.fold_norms(spec, params),
                 lambda: rj.random_residual(spec, params, jax.random.key(0), "rotation")):
        with pytest.raises(ValueError, match="needs a pre-norm model.*post-LN.*use residual='permutation'"):
            call()
    ck, params = random_model("vit-cls")  # pre-LN, gains not folded
    with pytest.raises(ValueError, match="not uniform.*fold_norms"):
        rj.align(params, params, rj.spec_for(ck), residual="rotation")
    # GPT-2's LM head is tied: it reads the final norm through the embedding, so that gain stays.
    ck, params = random_model("gpt2-lm")
    spec = rj.spec_for(ck)
    folded = rj.fold_norms(spec, params)
    assert not np.allclose(flatten(folded)["final_norm/scale"], 1) and np.all(np.asarray(flatten(folded)["layers/0/mlp_norm/scale"]) == 1)
    with pytest.raises(ValueError, match="tied LM head"):
        rj.align(folded, folded, spec, residual="rotation", attention="none", ffn="none")
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
    params = jax.tree.map(lambda x: plus_noise(x, jax.random.key(1), 0.3) if x.ndim == 1 else x, tied.params)
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


# ---- signed permutations: what RMSNorm allows wherever its gains sit (sandwich norms) --------------

@pytest.mark.usefixtures("float32_models")
def test_signed_permutations_keep_an_rmsnorm_models_function_unfolded_and_are_recovered():
    """Sign flips commute with RMSNorm (rms(x S) = rms(x)) and with every gain (both diagonal): a
    permutation with signs keeps the function without folding, and `align` recovers it with every
    group; a sign flip of a LayerNorm stream changes the function and is refused."""
    ck, params = random_model("llama-gqa")
    spec = rj.spec_for(ck)
    t = rj.random_residual(spec, params, jax.random.key(5), "signed_permutation")
    signs = np.diagonal(np.asarray(t.rotation))
    assert set(signs) == {-1.0, 1.0}
    moved = rj.apply_transform(spec, params, {**rj.identity_transform(rj.bind(spec, params)), "residual": t})
    assert_same_function(ck, params, moved, t.matrix(), dense_inputs(ck))
    planted = rj.random_transform(spec, params, jax.random.key(6), KINDS)
    b = rj.apply_transform(spec, params, {**planted, "residual": t})
    result = rj.align(params, b, spec, heads="permute", rescale="joint", residual="signed_permutation")
    assert result.report["after"]["total"] <= 1e-5 * result.report["before"]["total"]
    bert, bert_params = random_model("bert-cls")
    with pytest.raises(ValueError, match="signed_permutation' needs RMSNorm"):
        rj.align(bert_params, bert_params, rj.spec_for(bert), residual="signed_permutation")
    flips = rj.ResidualTransform(jnp.arange(32, dtype=jnp.int32), jnp.diag(jnp.where(jnp.arange(32) % 2 == 0, -1.0, 1.0)))
    with pytest.raises(ValueError, match="commute only with permutations"):
        rj.apply_transform(rj.spec_for(bert), bert_params, {**rj.identity_transform(rj.bind(rj.spec_for(bert), bert_params)), "residual": flips})


def test_signed_permutation_step_is_the_brute_force_optimum():
    """The T step over permutations with signs: the best of all 4! x 2^4 of the stream."""
    ck, a = tiny_llama(0)
    _, b = tiny_llama(1)
    spec = rj.spec_for(ck)
    result = rj.align(a, b, spec, attention="none", ffn="none", residual="signed_permutation")
    identity = rj.identity_transform(rj.bind(spec, b))
    best = min(
        rj.distance_report(spec, a, rj.apply_transform(spec, b, {**identity, "residual": rj.ResidualTransform(
            jnp.array(p, jnp.int32), jnp.diag(jnp.array(s, jnp.float32)))}))["total"]["total"]
        for p in itertools.permutations(range(4)) for s in itertools.product((-1.0, 1.0), repeat=4)
    )
    np.testing.assert_allclose(result.report["after"]["total"], best, rtol=1e-6)


@pytest.mark.usefixtures("float32_models")
@pytest.mark.parametrize("name", ["gemma2-sandwich", "olmo2-post-qknorm", pytest.param("gemma3-sandwich-qknorm", marks=pytest.mark.slow)])
def test_sandwich_norms_take_signed_permutations_and_refuse_rotations(name):
    """Gemma 2 and 3 pass each sublayer's output through an RMSNorm gain before the sum, and so
    does OLMo-2 (without norms before the sublayers): a rotation of the stream changes the
    function even with every foldable gain folded, and is refused; a permutation with signs (the
    post-norm gains only permuted) keeps it and is recovered with every group."""
    ck, params = random_model(name)
    spec = rj.spec_for(ck)
    bound = rj.bind(spec, params)
    assert bound.residual.placement == ("post" if name.startswith("olmo2") else "sandwich")
    assert "layers/0/attention_post_norm/scale" in bound.residual.gains
    inputs = dense_inputs(ck)
    identity = rj.identity_transform(bound)
    t = rj.random_residual(spec, params, jax.random.key(3), "signed_permutation")
    assert_same_function(ck, params, rj.apply_transform(spec, params, {**identity, "residual": t}), t.matrix(), inputs)
    rotation = rj.ResidualTransform(jnp.arange(32, dtype=jnp.int32), random_orthogonal(jax.random.key(4), (), 32))
    with pytest.raises(ValueError, match="commute only with permutations and, under RMSNorm, sign flips"):
        rj.apply_transform(spec, params, {**identity, "residual": rotation})
    moved = groups.apply_unchecked(bound, params, {**identity, "residual": rotation})  # what the check prevents
    logits = outputs(ck, params, inputs)["logits"]
    assert np.max(np.abs(outputs(ck, moved, inputs)["logits"] - logits)) > 1e-2 * np.max(np.abs(logits))
    for call in (lambda: rj.fold_norms(spec, params), lambda: rj.align(params, params, spec, residual="rotation")):
        with pytest.raises(ValueError, match="sandwich norms|post-norms: OLMo-2"):
            call()
    planted = rj.random_transform(spec, params, jax.random.key(6), KINDS)
    b = rj.apply_transform(spec, params, {**planted, "residual": t})
    result = rj.align(params, b, spec, heads="permute", rescale="joint", residual="signed_permutation")
    assert result.report["after"]["total"] <= 1e-5 * result.report["before"]["total"]


def test_the_command_line_refuses_sign_flips_of_a_layernorm_stream_before_reading_weights(tmp_path, capsys, monkeypatch):
    ck, params = random_model("bert-cls")
    rj.save_hf(ck, params, tmp_path / "bert")
    from rotsym_jax import cli, hf

    # as the no_weight_reads fixture does, but after A is written
    monkeypatch.setattr(hf.TensorFiles, "get", lambda *a, **k: pytest.fail("read a weight before refusing"))
    monkeypatch.setattr(hf.TensorFiles, "read", lambda *a, **k: pytest.fail("read a weight before refusing"))
    with pytest.raises(SystemExit):
        cli.main(["align", str(tmp_path / "bert"), str(tmp_path / "bert"), str(tmp_path / "out"), "--residual", "signed_permutation"])
    assert "signed_permutation' needs RMSNorm" in capsys.readouterr().err


@pytest.mark.usefixtures("float32_models")
def test_the_data_methods_take_the_strongest_residual_group_the_models_allow_by_default():
    """residual="auto" (the default): weight matching keeps the paper's "none"; the data methods
    rotate the stream of pre-norm models whose gains are uniform (folded), permute it where a gain
    is not (naming it and how to fold it) and on post-norm BERT; the report says which and why."""
    from test_activations import data_for

    ck, a = pre_ln_model("gpt2-lm-untied", 0)
    _, b = pre_ln_model("gpt2-lm-untied", 1)
    spec = rj.spec_for(ck)
    weights, paper = rj.align(a, b, spec), rj.align(a, b, spec, residual="none", maps="orthogonal")
    assert "settled" not in weights.report and "residual" not in weights.transforms
    assert weights.report["after"]["total"] == paper.report["after"]["total"]
    run = lambda a, b, spec, ck: rj.align(a, b, spec, method="activations", data=data_for(ck), checkpoint=ck)
    unfolded = run(a, b, spec, ck)
    settled = unfolded.report["settled"]
    assert settled["residual"] == "permutation" and "rj.fold_norms" in settled["why"] and "/scale" in settled["why"], settled
    assert unfolded.transforms["residual"].rotation is None
    fa, fb = rj.fold_norms(spec, a), rj.fold_norms(spec, b)
    folded = run(fa, fb, spec, ck)
    assert folded.report["settled"]["residual"] == "rotation" and folded.transforms["residual"].rotation is not None
    inputs = model_inputs(ck)
    # B's function kept by the rotation chosen (its last hidden state comes out in the new basis)
    np.testing.assert_allclose(outputs(ck, folded.params, inputs)["logits"], outputs(ck, fb, inputs)["logits"], atol=1e-4)
    bert, x = random_model("bert-cls", 0)
    _, y = random_model("bert-cls", 1)
    post = run(x, y, rj.spec_for(bert), bert).report["settled"]
    assert post["residual"] == "permutation" and "post-norm" in post["why"], post
