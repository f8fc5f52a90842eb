"""A gated FFN's unit scales (MATH §1): unit j's up row times s and its down column divided by s
keep act(gate) * up -> down, for any s > 0. The element (`UnitPermutation.scale`), its solve from
weights (the per-unit quartic), from activations (least squares on the hidden units) and learned
(log-scales), against brute force, planted ground truth and transformers (tests/test_conformance.py
plants scales in every family and aligns with --ffn scaled, in memory and streamed)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers as tf
from parity_utils import save_reference
from test_invariance import model_inputs, outputs, random_model
from test_learned import labelled

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.engine import ffn
from rotsym_jax.errors import InputError
from rotsym_jax.pytree import flatten
from rotsym_jax.spec import Spec, SpecError
from rotsym_jax.transforms import KINDS, UNIT_KINDS

pytestmark = pytest.mark.usefixtures("float32_models")


def _plant(name="llama-gqa", seed=2, kinds=("perm", "unit_scale")):
    ck, a = random_model(name)
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, a, jax.random.key(seed), kinds)
    return ck, spec, a, t


def _max_diff(x, y) -> float:
    fx, fy = flatten(x), flatten(y)
    return max(float(np.max(np.abs(np.asarray(fx[p], np.float64) - np.asarray(fy[p], np.float64)))) for p in fx)


def test_only_a_gated_ffn_has_unit_scales():
    for name, scaled in (("llama-gqa", True), ("gpt2-lm", False), ("bert-cls", False)):
        ck, params = random_model(name)
        (group,) = rj.bind(rj.spec_for(ck), params).perms
        assert group.scaled is scaled, name
        assert ("each unit's scale" in group.describe()) is scaled
        if not scaled:  # GELU(up): a scale is no symmetry, and none is drawn
            t = rj.random_transform(rj.spec_for(ck), params, jax.random.key(0), ("perm", "unit_scale"))
            assert t[group.name].scale is None


def test_a_spec_tagging_one_side_of_the_scale_is_refused():
    params = {"up": jnp.ones((3, 4)), "gate": jnp.ones((3, 4)), "down": jnp.ones((4, 3))}
    rules = ((r"up", (None, "ffn.in")), (r"gate", (None, "ffn")), (r"down", ("ffn", None)))
    with pytest.raises(SpecError, match=r"tags ffn.in or ffn.out but not both"):
        rj.bind(Spec(rules), params)
    bound = rj.bind(Spec(rules[:2] + ((r"down", ("ffn.out", None)),)), params)
    assert bound.perms[0].scaled and [m.role for m in bound.perms[0].members] == ["out", "perm", "in"]  # the leaves' order


def test_scales_are_checked_group_elements():
    ck, spec, a, t = _plant()
    group = rj.bind(spec, a).perms[0]
    bad = t[group.name].replace(scale=t[group.name].scale.at[1, 3].set(-0.5))
    with pytest.raises(InputError, match=r"transforms\['ffn'\]\.scale\[1, 3\] = -0.5; scales must be finite and > 0"):
        rj.apply_transform(spec, a, {**t, group.name: bad})
    ck2, gpt = random_model("gpt2-lm")
    spec2 = rj.spec_for(ck2)
    t2 = rj.random_transform(spec2, gpt, jax.random.key(0), ("perm",))
    name = rj.bind(spec2, gpt).perms[0].name
    with pytest.raises(InputError, match="has no unit scales"):
        rj.apply_transform(spec2, gpt, {**t2, name: t2[name].replace(scale=jnp.ones(t2[name].perm.shape))})


def test_the_element_keeps_the_function_inverts_and_composes():
    ck, spec, a, t = _plant(kinds=KINDS + UNIT_KINDS)
    b = rj.apply_transform(spec, a, t)
    inputs = model_inputs(ck)
    want, got = outputs(ck, a, inputs)["logits"], outputs(ck, b, inputs)["logits"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert _max_diff(a, b) > 0.1  # the scales moved the leaves
    assert _max_diff(rj.apply_transform(spec, b, rj.invert_transform(t)), a) < 1e-5
    t2 = rj.random_transform(spec, a, jax.random.key(9), ("perm", "unit_scale"))
    assert _max_diff(rj.apply_transform(spec, b, t2), rj.apply_transform(spec, a, rj.compose_transforms(t, t2))) < 1e-5


def test_weight_matching_undoes_planted_scales_and_permutations():
    ck, spec, a, t = _plant()
    b = rj.apply_transform(spec, a, t)
    scaled = rj.align(a, b, spec, attention="none", ffn="scaled")
    assert scaled.report["after"]["total"] < 1e-6 * scaled.report["before"]["total"]  # float32 rounding
    recovered = rj.compose_transforms(t, scaled.transforms)["ffn"]  # the plant, then its undoing: the identity
    np.testing.assert_array_equal(np.asarray(recovered.perm), np.broadcast_to(np.arange(recovered.perm.shape[1]), recovered.perm.shape))
    np.testing.assert_allclose(np.asarray(recovered.scale), 1, rtol=1e-5)
    plain = rj.align(a, b, spec, attention="none", ffn="permutation")
    assert plain.report["after"]["total"] > 100 * scaled.report["after"]["total"]


def test_each_units_scale_is_the_brute_force_optimum():
    """Unrelated A and B: at the assignment's permutation, each unit's solved scale beats every
    scale of a fine float64 grid around it on that unit's own distance."""
    ck, a = random_model("llama-gqa", seed=0)
    _, b = random_model("llama-gqa", seed=1)
    spec = rj.spec_for(ck)
    result = rj.align(a, b, spec, attention="none", ffn="scaled")
    element = result.transforms["ffn"]
    fa, fb = flatten(a), flatten(b)
    group = rj.bind(spec, a).perms[0]
    scale = np.asarray(element.scale, np.float64)
    for layer in range(len(group.layers)):
        perm = np.asarray(element.perm[layer])
        sides = {"in": [], "out": []}
        for m in group.members:
            if m.role != "perm":
                xa, xb = (np.moveaxis(np.asarray(f[m.paths[layer]], np.float64), m.axis, -1).reshape(-1, group.size) for f in (fa, fb))
                sides[m.role].append((xa, xb[:, perm]))
        for j in range(0, group.size, 5):
            def cost(s, j=j, sides=sides):
                return (sum(np.sum((s * xb[:, j] - xa[:, j]) ** 2) for xa, xb in sides["in"])
                        + sum(np.sum((xb[:, j] / s - xa[:, j]) ** 2) for xa, xb in sides["out"]))
            grid = scale[layer, j] * np.exp(np.linspace(-0.5, 0.5, 2001))
            assert cost(scale[layer, j]) <= min(cost(s) for s in grid) * (1 + 1e-5), (layer, j)


def test_terms_count_every_scaled_leaf_once():
    """`scale_terms` against NumPy on a permutation of B's units."""
    ck, a = random_model("llama-gqa", seed=0)
    _, b = random_model("llama-gqa", seed=1)
    group = rj.bind(rj.spec_for(ck), a).perms[0]
    fa, fb = flatten(a), flatten(b)
    perms = np.stack([np.random.default_rng(k).permutation(group.size) for k in range(len(group.layers))]).astype(np.int32)
    terms = [np.asarray(t) for t in ffn.scale_terms(ffn.scale_sides(group, fa, fb), perms)]
    up, down = (next(m for m in group.members if m.role == r) for r in ("in", "out"))
    for layer in range(len(group.layers)):
        ua, ub = np.asarray(fa[up.paths[layer]]), np.asarray(fb[up.paths[layer]])[:, perms[layer]]
        da, db = np.asarray(fa[down.paths[layer]]), np.asarray(fb[down.paths[layer]])[perms[layer]]
        want = [np.sum(ub * ub, 0), np.sum(ub * ua, 0), np.sum(ua * ua, 0), np.sum(db * db, 1), np.sum(db * da, 1), np.sum(da * da, 1)]
        for got, w in zip(terms, want):
            np.testing.assert_allclose(got[layer], w, rtol=1e-5, atol=1e-6)


def test_jitted_align_is_the_eager_one():
    ck, spec, a, t = _plant()
    b = rj.apply_transform(spec, a, t)
    eager = rj.align(a, b, spec, ffn="scaled", heads="permute")
    jitted = jax.jit(lambda x, y: rj.align(x, y, spec, ffn="scaled", heads="permute").params)(a, b)
    assert _max_diff(eager.params, jitted) < 1e-6


def test_optimizer_state_follows_the_scales():
    """Gradients of the moved model are the moved gradients: the scales act on them inverted."""
    ck, spec, a, t = _plant(kinds=("perm", "unit_scale"))
    bound = rj.bind(spec, a)
    inputs = model_inputs(ck)

    def loss(params):
        with jax.default_matmul_precision("highest"):
            logits = ck.apply(params, **inputs)["logits"]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 5])

    grads = jax.grad(loss)(a)
    moved = rj.transform_opt_state(t, (optax.TraceState(trace=grads),), bound)  # a momentum trace: a gradient-like state
    want = jax.grad(loss)(rj.apply_transform(spec, a, t))
    assert _max_diff(moved[0].trace, want) < 1e-5 * max(float(jnp.abs(x).max()) for x in jax.tree.leaves(want))


def test_learned_scales_stay_symmetries_and_move():
    ck, a = random_model("llama-gqa", seed=0)
    _, b = random_model("llama-gqa", seed=1)
    spec = rj.spec_for(ck)
    data = labelled(ck)
    result = rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, ffn="scaled", steps=6, learning_rate=3e-2, holdout=0,
                      key=jax.random.key(0), fallback=False, init="weights")
    start = rj.align(a, b, spec, ffn="scaled")
    learned_scale, start_scale = np.asarray(result.transforms["ffn"].scale), np.asarray(start.transforms["ffn"].scale)
    assert np.max(np.abs(np.log(learned_scale) - np.log(start_scale))) > 1e-3  # the log-scales trained
    assert _max_diff(rj.apply_transform(spec, b, result.transforms), result.params) < 1e-5  # checked group elements
    inputs, _ = ck.split_batch(data[0])
    want, got = (outputs(ck, p, inputs)["logits"] for p in (b, result.params))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def _llama_pair(tmp_path):
    config = tf.LlamaConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=48, max_position_embeddings=20)
    a_model = save_reference(tf.LlamaForCausalLM, config, tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1), KINDS + UNIT_KINDS)
    rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "b")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 60, size=(16, 12))
    np.savez(tmp_path / "data.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    return a_model, ids


def test_activation_matching_undoes_planted_scales_in_memory_and_streamed(tmp_path):
    a_model, ids = _llama_pair(tmp_path)
    runs = {}
    for name, extra in (("memory", []), ("streamed", ["--max-memory", "3G"])):
        out = tmp_path / name
        assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(out), "--quiet", "--method", "activations",
                         "--data", str(tmp_path / "data.npz"), "--heads", "permute", "--ffn", "scaled", *extra]) == 0
        report = json.loads((out / "rotsym_report.json").read_text())
        assert report["options"]["ffn"] == "scaled"
        assert report["result"]["after"]["total"] <= 1e-5 * report["result"]["before"]["total"], name
        runs[name] = rj.hf.TensorFiles(out)
    try:
        for tensor in runs["memory"].names():
            np.testing.assert_array_equal(runs["memory"].read(tensor), runs["streamed"].read(tensor), err_msg=tensor)
    finally:
        for files in runs.values():
            files.close()
    moved = tf.LlamaForCausalLM.from_pretrained(tmp_path / "memory", attn_implementation="eager").eval()
    with torch.no_grad():
        inputs = torch.as_tensor(ids[:4])
        np.testing.assert_allclose(moved(inputs).logits.numpy(), a_model(inputs).logits.numpy(), atol=1e-4)


def test_scales_from_activations_meet_halfway_on_transformers_hidden_units(tmp_path):
    """Unrelated A and B: each unit's scale is ||h_A|| / ||h_B|| over the data, h the input of
    down_proj as transformers computes it (a hook), B's unit the assignment's."""
    ck, a = random_model("llama-gqa", seed=0)
    _, b = random_model("llama-gqa", seed=1)
    spec = rj.spec_for(ck)
    data = labelled(ck, batches=2)
    result = rj.align(a, b, spec, method="activations", data=data, checkpoint=ck, attention="none", ffn="scaled", fallback=False)
    element = result.transforms["ffn"]
    hidden = {}
    for name, params in (("a", a), ("b", b)):
        model = tf.LlamaForCausalLM.from_pretrained(rj.save_hf(ck, params, tmp_path / name), attn_implementation="eager").eval()
        seen = [[] for _ in model.model.layers]
        for i, layer in enumerate(model.model.layers):
            layer.mlp.down_proj.register_forward_hook(lambda module, args, out, i=i, seen=seen: seen[i].append(args[0].reshape(-1, args[0].shape[-1])))
        with torch.no_grad():
            for batch in data:
                model(torch.as_tensor(batch["input_ids"]), attention_mask=torch.as_tensor(batch["attention_mask"]))
        hidden[name] = [torch.cat(x).double().numpy() for x in seen]
    for layer, (ha, hb) in enumerate(zip(hidden["a"], hidden["b"])):
        perm = np.asarray(element.perm[layer])
        want = np.linalg.norm(ha, axis=0) / np.linalg.norm(hb[:, perm], axis=0)
        np.testing.assert_allclose(np.asarray(element.scale[layer]), want, rtol=1e-4)


def test_inspect_says_whether_the_scales_are_solved(tmp_path, capsys):
    config = tf.LlamaConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48)
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    for flags, said in (([], "FFN units permuted, each gated unit's scale left (--ffn)"), (["--ffn", "scaled"], "FFN units permuted and each gated unit scaled (--ffn)")):
        assert cli.main(["inspect", str(tmp_path / "llama"), *flags]) == 0
        out = capsys.readouterr().out
        assert "48 units (3 leaf kinds), and each unit's scale (up times s, down divided by s)" in out and said in out, out


def test_align_many_undoes_planted_scales():
    ck, a = random_model("llama-gqa")
    spec = rj.spec_for(ck)
    models = [a] + [rj.apply_transform(spec, a, rj.random_transform(spec, a, jax.random.key(k), ("perm", "unit_scale"))) for k in (3, 4)]
    before = [rj.distance_report(spec, a, m)["total"]["total"] for m in models[1:]]
    result = rj.align_many(models, spec, ffn="scaled", attention="none")
    after = [rj.distance_report(spec, result.params[0], m)["total"]["total"] for m in result.params[1:]]
    assert min(before) > 1 and max(after) < 1e-6 * min(before), (before, after)


def test_a_run_says_when_no_unit_scale_can_be_solved(tmp_path, capsys):
    """GPT-2 (GELU, no gate) and Mixtral (its experts' units are never scaled): --ffn scaled permutes only, and says so;
    T5 v1.1's gated GELU has unit scales in both stacks."""
    tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=20)).save_pretrained(tmp_path / "gpt2")
    tf.MixtralForCausalLM(tf.MixtralConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           intermediate_size=48, num_local_experts=4)).save_pretrained(tmp_path / "mixtral")
    for name, why in (("gpt2", "no gate"), ("mixtral", "a mixture's experts")):
        assert cli.main(["align", str(tmp_path / name), str(tmp_path / name), str(tmp_path / f"{name}-out"), "--ffn", "scaled"]) == 0
        err = capsys.readouterr().err
        assert "note: --ffn scaled: " in err and why in err and "so its FFN units are permuted only" in err, err
    t5 = tf.T5Config(vocab_size=60, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu")
    tf.T5ForConditionalGeneration(t5).save_pretrained(tmp_path / "t5")
    ck = rj.load_hf(tmp_path / "t5")
    assert {g.name: g.scaled for g in rj.bind(rj.spec_for(ck), ck.params).perms} == {"decoder_ffn": True, "encoder_ffn": True}
