"""Invertible maps of Q/K and V/O (MATH §14, `maps="invertible"`): W_Q M, W_K M^-T, W_V N, N^-1 W_O
keep transformers' outputs in every family (RoPE-compatible on rotary blocks, none on a QK-norm's
queries), their algebra (inverse, composition, the gradients' action) is exact, the learned maps
keep B's function with their condition numbers bounded and reported, and what is not solved is
refused."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from family_cases import BY_ID, model_inputs, reference
from parity_utils import save_reference
from test_invariance import random_model
from test_learned import labelled, pair
from test_opt_state import loss_fn, move, relative
from test_opt_state import setup as opt_setup

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.engine import learned
from rotsym_jax.pytree import flatten
from rotsym_jax.transforms import KINDS, MAP_KINDS, symmetric_exp

pytestmark = pytest.mark.usefixtures("float32_models")

FAMILIES = [pytest.param(c, id=c) for c in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM")] + [
    pytest.param(c, id=c, marks=pytest.mark.slow) for c in ("BertForSequenceClassification", "Phi3ForCausalLM", "ViTForImageClassification")]


@pytest.mark.parametrize("case_id", FAMILIES)
def test_invertible_maps_keep_the_function_in_transformers(case_id, tmp_path):
    """A random element of every kind with invertible Q/K and V/O maps (condition numbers well
    above 1: not orthogonal), saved: transformers computes A's logits; its inverse gives A back."""
    case = BY_ID[case_id]
    model = save_reference(case.model_class, case.config(), tmp_path / "a")
    inputs = model_inputs(case, model.config)
    want = reference(model, inputs)["logits"]
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(3), KINDS + MAP_KINDS)
    conditions = t["attn"].condition_numbers()
    assert conditions["vo"] > 2
    assert conditions["qk"] == 1.0 if case.cls.startswith("Qwen3") else conditions["qk"] > 1.5  # a QK-norm keeps its sign flips
    moved = rj.apply_transform(spec, ck.params, t)
    got = reference(case.model_class.from_pretrained(rj.save_hf(ck, moved, tmp_path / "b"), attn_implementation="eager").eval(), inputs)
    np.testing.assert_allclose(got["logits"], want, rtol=0, atol=1e-4 * np.abs(want).max())
    back = flatten(rj.apply_transform(spec, moved, rj.invert_transform(t)))
    for path, x in flatten(ck.params).items():
        np.testing.assert_allclose(np.asarray(back[path]), np.asarray(x), rtol=0, atol=2e-5, err_msg=path)


def test_composition_and_inverse_are_the_group_law():
    """(t1 then t2) acts as t1 followed by t2, and its inverse as t2^-1 followed by t1^-1, for
    invertible maps composed with orthogonal ones."""
    ck, spec, a, _ = pair("llama-gqa")
    t1 = rj.random_transform(spec, a, jax.random.key(1), KINDS + MAP_KINDS)
    t2 = rj.random_transform(spec, a, jax.random.key(2), KINDS)
    both = rj.compose_transforms(t1, t2)
    one_by_one = rj.apply_transform(spec, rj.apply_transform(spec, a, t1), t2)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=1e-5), rj.apply_transform(spec, a, both), one_by_one)
    undone = rj.apply_transform(spec, one_by_one, rj.invert_transform(both))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=1e-5), undone, a)


def test_elements_outside_the_group_are_refused():
    """A map stored with a wrong inverse, a stretch that couples rotary pairs (RoPE's rotations do
    not commute with it), an invertible QK map under a QK-norm: each refused by name."""
    ck, spec, a, _ = pair("llama-gqa")
    t = rj.random_transform(spec, a, jax.random.key(1), KINDS + MAP_KINDS)
    block = t["attn"]
    with pytest.raises(rj.InputError, match=r"attn'\]\.vo\[.*are not an invertible map and its inverse transpose"):
        rj.apply_transform(spec, a, {**t, "attn": block.replace(vo_inv=block.vo)})
    dh = block.qk.shape[-1]
    log = 0.3 * (np.eye(dh, dh, 1) + np.eye(dh, dh, -1))  # couples neighbouring entries: rotary pairs (i, i + dh/2) broken
    broken = block.replace(qk=block.qk @ symmetric_exp(log), qk_inv=block.qk_inv @ symmetric_exp(-log))
    with pytest.raises(rj.InputError, match="does not commute with RoPE"):
        rj.apply_transform(spec, a, {**t, "attn": broken})
    qwen, qa = random_model("qwen3-qknorm")
    qspec = rj.spec_for(qwen)
    qt = rj.random_transform(qspec, qa, jax.random.key(1), KINDS)
    with pytest.raises(rj.InputError, match="QK-norm"):
        rj.apply_transform(qspec, qa, {**qt, "attn": qt["attn"].replace(qk_inv=qt["attn"].qk)})


def test_gradients_move_by_the_contragredient_action():
    """Under invertible maps the gradients move by M^-T where the params move by M (the two
    stored sides swap): autodiff of the moved model agrees."""
    ck, bound, params, t = opt_setup("llama-gqa", kinds=KINDS + MAP_KINDS)
    grad = loss_fn(ck)
    g = grad(params, 0)
    moved = rj.transform_opt_state(t, optax.TraceState(trace=g), bound).trace
    want = grad(move(bound, params, t), 0)
    assert relative(moved, want) < 1e-5
    assert relative(move(bound, g, t), want) > 1e-2


def test_the_condition_number_is_bounded():
    """However far the free parameter goes, exp(bounded(S)) stays below MAX_CONDITION."""
    s = jax.random.normal(jax.random.key(0), (64, 8, 8)) * np.geomspace(1e-3, 1e3, 64)[:, None, None]
    extreme = 1e3 * np.diag([1.0, -1.0, 0, 0, 0, 0, 0, 0])  # two eigenvalues +-|S|/sqrt(2): the bound reached
    conditions = np.linalg.cond(np.asarray(symmetric_exp(learned.bounded(np.concatenate([s, extreme[None]]))), np.float64))
    assert conditions.max() <= learned.MAX_CONDITION * (1 + 1e-4)
    assert conditions[-1] > 0.99 * learned.MAX_CONDITION and conditions.min() < 1.01


@pytest.mark.parametrize("name", ["vit-cls", pytest.param("llama-gqa", marks=pytest.mark.slow)])
def test_learned_invertible_maps_keep_b_and_report_their_conditioning(name):
    ck, spec, a, b = pair(name)
    data = labelled(ck)
    result = rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, heads="permute", residual="rotation", maps="invertible",
                      steps=12, learning_rate=3e-2, eval_every=3, holdout=0.25, key=jax.random.key(0), fallback=False)
    assert result.transforms["attn"].vo_inv is not None
    again = rj.apply_transform(spec, b, result.transforms)  # checked: every element in its group
    for path, x in flatten(again).items():
        np.testing.assert_allclose(np.asarray(flatten(result.params)[path]), np.asarray(x), atol=1e-5, err_msg=path)
    inputs, _ = ck.split_batch(data[0])
    want, got = (ck.apply(p, **inputs)["logits"] for p in (b, result.params))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    conditions = result.report["condition_numbers"]["attn"]
    assert 1 <= conditions["vo"] <= learned.MAX_CONDITION
    if result.report["learned"]["best_step"] > 0:  # the maps trained (early stopping may keep the start, where they are orthogonal)
        assert conditions["vo"] > 1.05
    assert conditions == result.transforms["attn"].condition_numbers()


def test_invertible_maps_are_learned_only(tmp_path, capsys):
    ck, spec, a, b = pair("vit-cls")
    with pytest.raises(rj.InputError, match="maps='invertible' is learned"):
        rj.align(a, b, spec, maps="invertible")
    with pytest.raises(rj.InputError, match="needs attention='rotation'"):
        rj.AlignOptions(maps="invertible", attention="none")
    folder = tmp_path / "vit"
    save_reference(BY_ID["ViTForImageClassification"].model_class, BY_ID["ViTForImageClassification"].config(), folder)
    with pytest.raises(SystemExit):
        cli.main(["align", str(folder), str(folder), str(tmp_path / "out"), "--maps", "invertible"])
    assert "maps='invertible' is learned" in capsys.readouterr().err
