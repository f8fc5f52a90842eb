"""mergekit configs run as they are (`rotsym merge CONFIG.yml OUT`): the settings resolved as
mergekit documents them, its kernels against formulas written out here, refusals by key and line
before any weight is read, alignment as a plug-in step, and (slow) every method and key against
mergekit 0.1.5 itself on checkpoints transformers wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from checkpoint_utils import checkpoint_tensors, float_tensors, save_random

import rotsym_jax as rj
from rotsym_jax import cli, hf, mergekit_pipeline
from rotsym_jax.io.recipe import RecipeError
from rotsym_jax.mergekit_pipeline import merge_mergekit
from rotsym_jax.merging import mergekit, registry, tensorwise
from rotsym_jax.pipeline import PipelineError, aligned
from rotsym_jax.pytree import flatten
from rotsym_jax.streaming._source import Source

LLAMA = dict(model_type="llama", vocab_size=60, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, max_position_embeddings=16, tie_word_embeddings=False)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A base and three models near it (rotsym-written tiny Llamas, float32)."""
    root = tmp_path_factory.mktemp("mergekit")
    base = save_random(LLAMA, "lm", 0, root / "base")
    ck = rj.load_hf(base)
    out = {"base": base}
    for i in (1, 2, 3):
        keys = iter(jax.random.split(jax.random.key(10 + i), 1000))
        params = jax.tree.map(lambda x, keys=keys: x + 0.02 * jax.random.normal(next(keys), x.shape, x.dtype), ck.params)
        out[f"m{i}"] = hf.save_hf(ck, params, root / f"m{i}")
    return out


def _config(tmp_path, raw: dict) -> Path:
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# ---- settings -------------------------------------------------------------------------------------

WEIGHT = registry.Param("weight", float, registry.REQUIRED, "a weight", scope="input")
FLAG = registry.Param("normalize", bool, True, "a flag")


@pytest.mark.parametrize("setting, name, t, want", [
    (0.3, "x", 0.7, 0.3),
    ([0.0, 1.0], "x", 0.25, 0.25),  # a gradient: linear between its ends
    ([0.0, 0.5, 1.0, 0.0], "x", 0.5, 0.75),  # scaled = 1.5: halfway between 0.5 and 1.0
    ([0.0, 0.5, 1.0, 0.0], "x", 1.0, 0.0),
    ([{"filter": "self_attn", "value": 0.9}, {"value": 0.1}], "model.layers.0.self_attn.q_proj.weight", 0, 0.9),
    ([{"filter": "self_attn", "value": 0.9}, {"value": 0.1}], "model.layers.0.mlp.up_proj.weight", 0, 0.1),
    ([{"filter": "mlp", "value": [0.0, 1.0]}], "model.layers.1.mlp.up_proj.weight", 0.5, 0.5),  # a filter's gradient
    ([{"filter": "mlp", "value": 1.0}], "model.norm.weight", 0, None),  # no filter matches: the next scope decides
    ({"filter": "*", "value": 2}, "anything", 0, 2.0),
    ("0.5", "x", 0, 0.5),  # a number quoted: pydantic, as mergekit reads it, takes the number
    (["0", "1"], "x", 0.25, 0.25),
])
def test_a_setting_evaluates_as_mergekit_documents(setting, name, t, want):
    assert mergekit.evaluate(setting, name, t, WEIGHT) == want


def test_a_gradient_of_flags_picks_a_value_and_scopes_take_precedence(tmp_path, models):
    assert mergekit.evaluate([True, False, False], "x", 0.6, FLAG) is False  # values[int(0.6 * 2)]
    assert mergekit.evaluate([True, False, False], "x", 0.4, FLAG) is True
    cfg = mergekit.load(_config(tmp_path, {
        "slices": [{"sources": [{"model": str(models["m1"]), "layer_range": [0, 3], "parameters": {"weight": 5}},
                                {"model": str(models["m2"]), "layer_range": [0, 3]},
                                {"model": str(models["base"]), "layer_range": [0, 3]}],
                    "parameters": {"weight": [{"filter": "mlp", "value": 3}]}}],
        "base_model": str(models["base"]), "merge_method": "ties", "parameters": {"weight": 1, "density": 0.5}}))
    mlp, attn = "model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"
    _, inputs = cfg.resolve([mlp] * 3, 0)
    assert [p.get("weight") for p in inputs] == [5.0, 3.0, None]  # the model's own, the slice's; the base takes none
    _, inputs = cfg.resolve([attn] * 3, 0)
    assert [p.get("weight") for p in inputs] == [5.0, 1.0, None]  # the slice's filter misses: the shared value
    assert inputs[0]["density"] == 0.5 and "density" not in inputs[2]


# ---- kernels against the formulas -----------------------------------------------------------------

def _ties_by_hand(base, xs, weights, densities, normalize=True, lam=1.0):
    """TIES as mergekit's documentation states it, entry by entry in float64."""
    deltas = []
    for x, w, d in zip(xs, weights, densities):
        delta = (x - base).astype(np.float64).ravel()
        k = max(1, int(d * delta.size))
        keep = np.zeros(delta.size, bool)
        keep[np.argsort(-np.abs(delta), kind="stable")[:k]] = True
        deltas.append(np.where(keep, delta, 0.0) * w)
    out = np.zeros(base.size)
    for j in range(base.size):
        total = sum(d[j] for d in deltas)
        sign = 1.0 if total >= 0 else -1.0
        agree = [(d[j], w) for d, w in zip(deltas, weights) if np.sign(d[j]) == sign]
        mixed = sum(v for v, _ in agree)
        divisor = sum(w for _, w in agree) or 1.0
        out[j] = base.ravel()[j] + lam * (mixed / divisor if normalize else mixed)
    return out.reshape(base.shape)


def test_the_anchor_is_its_model_however_its_path_is_written(tmp_path, monkeypatch):
    """rotsym.anchor names a model of the config as a path, relative to where mergekit runs or absolute."""
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    for anchor in ("./b", "b", str(tmp_path / "b"), "a/../b"):
        cfg = mergekit.load(_config(tmp_path, {"models": [{"model": "a"}, {"model": "./b"}], "merge_method": "linear",
                                               "rotsym": {"align": "anchor", "anchor": anchor}}))
        assert (cfg.anchor, cfg.anchor_index) == ("./b", 1), anchor
    with pytest.raises(RecipeError, match=r"rotsym.anchor 'c' is not a model of the config \['a', './b'\]"):
        mergekit.load(_config(tmp_path, {"models": [{"model": "a"}, {"model": "./b"}], "merge_method": "linear",
                                         "rotsym": {"align": "anchor", "anchor": "c"}}))


@pytest.mark.parametrize("name", ["ties", "dare_ties", "breadcrumbs_ties", "della", "task_arithmetic", "linear", "model_stock"])
def test_a_0d_tensor_merges_as_its_one_entry(name):
    """A scalar tensor (Apertus' xIELU beta and eps) keeps its shape and merges as a tensor of one entry does."""
    values = [np.float32(v) for v in (0.5, 0.7, 0.2, 0.4)]
    inputs = [{"weight": 0.5, "density": 1.0, "gamma": 0.01, "epsilon": 0.0}] * 4
    shared = {"normalize": True, "rescale": False, "lambda": 1.0, "int8_mask": False, "filter_wise": False}
    merge = lambda xs: tensorwise.merge_tensor(tensorwise.METHODS[name], xs, 3, shared, inputs, lambda i: np.random.default_rng(i))  # noqa: E731
    got = merge([np.asarray(v) for v in values])
    assert got.shape == () and np.isfinite(got)
    np.testing.assert_array_equal(got, merge([np.asarray([v]) for v in values])[0])


@pytest.mark.parametrize("normalize, lam", [(True, 1.0), (False, 0.7)])
def test_ties_kernel_is_the_documented_formula(normalize, lam):
    rng = np.random.default_rng(0)
    base = rng.normal(size=(7, 9)).astype(np.float32)
    xs = [base + rng.normal(size=base.shape).astype(np.float32) for _ in range(3)]
    inputs = [{"weight": w, "density": d} for w, d in ((0.5, 0.4), (1.5, 0.7), (1.0, 1.0))] + [{}]
    shared = {"normalize": normalize, "rescale": False, "lambda": lam, "int8_mask": False}
    got = tensorwise.merge_tensor(tensorwise.METHODS["ties"], [*xs, base], 3, shared, inputs, lambda i: None)
    want = _ties_by_hand(base, xs, [0.5, 1.5, 1.0], [0.4, 0.7, 1.0], normalize, lam)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_slerp_kernel_is_the_closed_form_and_linear_when_near_parallel():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(6, 5)).astype(np.float32), rng.normal(size=(6, 5)).astype(np.float32)
    t = 0.3
    got = tensorwise.merge_tensor(tensorwise.METHODS["slerp"], [a, b], 0, {"t": t}, [{}, {}], lambda i: None)
    theta = np.arccos(np.dot(a.ravel(), b.ravel()) / np.linalg.norm(a) / np.linalg.norm(b))
    want = (np.sin((1 - t) * theta) * a + np.sin(t * theta) * b) / np.sin(theta)
    np.testing.assert_allclose(got, want, atol=1e-5)
    near = a + 1e-3 * b  # cos > 0.9995: mergekit interpolates linearly
    got = tensorwise.merge_tensor(tensorwise.METHODS["slerp"], [a, near], 0, {"t": t}, [{}, {}], lambda i: None)
    np.testing.assert_allclose(got, (1 - t) * a + t * near, atol=1e-6)


@pytest.mark.parametrize("cos", [0.6, -0.2])
def test_model_stock_kernel_is_the_papers_ratio_and_keeps_the_base_where_it_is_singular(cos):
    """Two offsets of angle arccos(c) from the base: t = 2c / (1 + c) of their mean, the rest the
    base (Model Stock, eq. 6 for N = 2); filter_wise takes each row's own angle; c = -1 keeps the base."""
    rng = np.random.default_rng(2)
    base = rng.normal(size=(2, 4)).astype(np.float32)
    e1, e2 = np.eye(8, dtype=np.float32)[:2]
    offsets = [3 * e1, 2 * (cos * e1 + np.sqrt(1 - cos**2) * e2)]
    xs = [base + o.reshape(2, 4) for o in offsets]
    t = 2 * cos / (1 + cos)
    got = tensorwise.merge_tensor(tensorwise.METHODS["model_stock"], [base, *xs], 0, {"filter_wise": False}, [{}] * 3, lambda i: None)
    np.testing.assert_allclose(got, base + t * (offsets[0] + offsets[1]).reshape(2, 4) / 2, atol=1e-6)
    rows = [base + np.stack([e1[:4], -e1[:4]]), base + np.stack([e1[:4], e1[:4]])]  # row 0 parallel (t = 1), row 1 opposite (singular)
    got = tensorwise.merge_tensor(tensorwise.METHODS["model_stock"], [base, *rows], 0, {"filter_wise": True}, [{}] * 3, lambda i: None)
    np.testing.assert_allclose(got, base + np.stack([e1[:4], 0 * e1[:4]]), atol=1e-6)


def test_nearswap_takes_the_other_model_where_they_are_near_and_keeps_the_base_elsewhere():
    base = np.array([0.0, 0.0, 0.0, 1.0], np.float32)
    other = np.array([0.001, 0.5, -0.02, 1.0], np.float32)  # |a - b| under t, far, twice t, equal
    got = tensorwise.merge_tensor(tensorwise.METHODS["nearswap"], [base, other], 0, {"t": 0.01}, [{}, {}], lambda i: None)
    np.testing.assert_allclose(got, [0.001, 0.01, -0.01, 1.0], rtol=1e-6)  # w = min(1, t / |a - b|): 1, 0.02, 0.5, 1


def test_multislerp_of_two_equal_norms_at_equal_weights_is_their_spherical_midpoint():
    """Equal weights: the tangent vectors cancel at the mean direction, so the result is that
    direction at the inputs' norm, as SLERP at t = 1/2 gives; one direction thrice: itself."""
    a, b = np.array([3.0, 0.0, 0.0], np.float32), np.array([0.0, 3.0, 0.0], np.float32)
    inputs = [{"weight": 1.0}, {"weight": 1.0}]
    shared = {"normalize_weights": True, "eps": 1e-8}
    got = tensorwise.merge_tensor(tensorwise.METHODS["multislerp"], [a, b], None, shared, inputs, lambda i: None)
    np.testing.assert_allclose(got, 3 * (a + b) / np.linalg.norm(a + b), rtol=1e-6)
    got = tensorwise.merge_tensor(tensorwise.METHODS["multislerp"], [a, 2 * a, 4 * a], None, shared, [{"weight": w} for w in (1.0, 1.0, 2.0)],
                                  lambda i: None)
    np.testing.assert_allclose(got, (3 + 6 + 2 * 12) / 4 * a / 3, rtol=1e-6)


def test_sce_kernel_is_the_papers_select_calculate_erase():
    """Select: the int(0.7 * 3) = 2 entries of largest variance across the models, of the 3 that
    vary; calculate: each model's weight its selected task vector's mean square, normalised; erase: entries
    against the sign of the sum; the rest averaged by the weights left, entry by entry."""
    base = np.zeros(5, np.float32)
    d1 = np.array([2.0, -1.0, 0.5, 0.1, 0.0], np.float32)
    d2 = np.array([1.0, 1.0, -0.3, 0.1, 0.0], np.float32)
    keep = np.array([1, 1, 0, 0, 0])  # variances 0.25, 1, 0.16, 0, 0
    s1, s2 = np.mean((d1 * keep) ** 2), np.mean((d2 * keep) ** 2)
    w = np.array([s1, s2]) / (s1 + s2)
    want = np.zeros(5)
    for j in range(5):
        values = [d1[j] * keep[j], d2[j] * keep[j]]
        sign = 1 if sum(values) >= 0 else -1
        kept = [(wi, v) for wi, v in zip(w, values) if np.sign(v) == sign]
        want[j] = sum(wi * v for wi, v in kept) / max(sum(wi for wi, _ in kept), 1e-6)
    got = tensorwise.merge_tensor(tensorwise.METHODS["sce"], [base, base + d1, base + d2], 0, {"select_topk": 0.7, "int8_mask": False},
                                  [{}] * 3, lambda i: None)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_karcher_mean_of_symmetric_directions_is_their_axis_at_the_mean_norm():
    """Three orthogonal directions of norms 1, 2, 3: their diagonal at the mean norm 2. Three
    points of a great circle at 0, 10 and 80 degrees: the mean angle, 30 degrees, where the plain
    mean of the unit vectors points at 28.2 (so the steps are checked, not just the start)."""
    axes = [np.eye(3, dtype=np.float32)[i] * (i + 1) for i in range(3)]
    shared = {"max_iter": 10, "tol": 1e-5}
    got = tensorwise.merge_tensor(tensorwise.METHODS["karcher"], axes, None, shared, [{}] * 3, lambda i: None)
    np.testing.assert_allclose(got, 2 * np.ones(3) / np.sqrt(3), rtol=1e-6)
    angles = np.radians([0.0, 10.0, 80.0])  # on a great circle: the Karcher mean is the mean angle, 30 degrees
    points = [np.array([np.cos(t), np.sin(t), 0.0], np.float32) for t in angles]
    got = tensorwise.merge_tensor(tensorwise.METHODS["karcher"], points, None, {"max_iter": 50, "tol": 1e-7}, [{}] * 3, lambda i: None)
    np.testing.assert_allclose(got, [np.cos(np.radians(30)), np.sin(np.radians(30)), 0.0], atol=1e-5)


def test_random_sparsification_keeps_its_density_and_l1_norm_and_is_seeded_by_tensor():
    delta = np.random.default_rng(2).normal(size=(200, 500)).astype(np.float32)
    rng = lambda: np.random.default_rng([0, 7, 0])  # noqa: E731
    dropped = tensorwise.bernoulli(delta, 0.3, True, rng())
    assert abs(np.count_nonzero(dropped) / delta.size - 0.3) < 0.005
    np.testing.assert_allclose(np.abs(dropped).sum(), np.abs(delta).sum(), rtol=1e-5)  # mergekit's L1 rescale
    np.testing.assert_array_equal(dropped, tensorwise.bernoulli(delta, 0.3, True, rng()))
    assert not np.array_equal(dropped, tensorwise.bernoulli(delta, 0.3, True, np.random.default_rng([0, 8, 0])))
    pruned = tensorwise.della_magprune(delta, 0.5, True, 0.2, np.random.default_rng(3))
    ranks = np.argsort(np.argsort(np.abs(delta), axis=1), axis=1)  # DELLA keeps large magnitudes more often
    low, high = (ranks < 50), (ranks >= 450)
    assert abs(np.count_nonzero(pruned[low]) / low.sum() - 0.32) < 0.02
    assert abs(np.count_nonzero(pruned[high]) / high.sum() - 0.68) < 0.02


def test_magnitude_keeps_floor_density_entries_and_breadcrumbs_drops_the_outliers():
    delta = np.random.default_rng(4).permutation(np.arange(1, 101, dtype=np.float32))
    kept = tensorwise.magnitude(delta, 0.257, False)
    assert np.sort(kept[kept != 0]).tolist() == list(range(76, 101))  # floor(25.7) = 25 largest
    crumbs = tensorwise.magnitude_outliers(delta, 0.5, False, gamma=0.1)
    assert np.sort(crumbs[crumbs != 0]).tolist() == list(range(41, 91))  # the 10 largest dropped, then the 40 smallest


# ---- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    ({"slices": [{"sources": [{"model": "M1", "layer_range": [2, 2]}]}]},
     "slices[0].sources[0].layer_range: [2, 2]; expected [first, end], integers with 0 <= first < end"),
    ({"slices": [{"sources": [{"model": "M1", "layer_range": [-1, 2]}]}]}, "layer_range: [-1, 2]; expected [first, end]"),
    ({"slices": [{"sources": [{"model": "M1", "layer_range": [0, 2]}, {"model": "BASE", "layer_range": [0, 3]}]}]},
     "slices[0]: its sources' layer ranges differ in length: M1 [0, 2] (2 layers), BASE [0, 3] (3 layers)"),
    ({"slices": [{"sources": [{"model": "M1", "layer_range": [0, 1]}, {"model": "M1", "layer_range": [1, 2]}]}]},
     "slices[0]: a model is a source of this slice twice"),
    ({"slices": [{"sources": [{"model": "M1", "layer_range": [0, 3]}, {"model": "M2", "layer_range": [0, 3]}]}]},
     "slices[0]: merge_method ties merges each slice with the base_model BASE, which is not among this slice's sources"),
    ({"slices": [{"sources": [{"model": "M1", "layer_range": [0, 3]}], "base_model": "M1"}]}, "slices[0].base_model: a slice's own"),
    ({"modules": {"text": {"models": [{"model": "M1"}]}}}, "modules (per-module merges"),
    ({"tokenizer": {"source": "base", "tokens": {"<x>": {"force": True}}}}, "tokenizer.tokens['<x>']: no source; rotsym needs one"),
    ({"tokenizer": {"tokens": {"<x>": {"source": {"kind": "mean"}}}}}, "tokenizer.tokens['<x>'].source: {'kind': 'mean'}; expected a model"),
    ({"tokenizer": {"tokens": {"<x>": {"source": {"kind": "model_token", "model": "M1", "token": "a", "token_id": 3}}}}},
     "tokenizer.tokens['<x>'].source: {'kind': 'model_token'"),
    ({"tokenizer": {"pad_to_multiple_of": 0}}, "tokenizer.pad_to_multiple_of: 0; expected a positive integer"),
    ({"tokenizer": {"source": "union", "vocab": 3}}, "tokenizer: {'source': 'union', 'vocab': 3}; expected a mapping of ['source', 'tokens'"),
    ({"chat_template": "chatml"}, "chat_template"),
    ({"merge_method": "rams"}, "merge_method 'rams': not a mergekit method (did you mean 'ram'?); rotsym runs mergekit's"),
    ({"merge_method": "dare-ties"}, "merge_method 'dare-ties': not a mergekit method (did you mean 'dare_ties'?)"),
    ({"merge_methd": "ties"}, "unknown key 'merge_methd'"),
    ({"base_model": "meta-llama/Llama-3.2-1B"}, "(a Hub id: rotsym reads mergekit configs offline"),
    ({"base_model": "M1+some/lora"}, "names a LoRA"),
    ({"parameters": {"density": "half"}}, "density = 'half'; expected a number"),
    ({"rotsym": {"align": "sideways"}}, "rotsym.align = 'sideways'"),
    # the counts of models each method's declaration takes (registry.counts), in mergekit's terms
    ({"merge_method": "slerp", "parameters": {"t": 0.5}}, "merge_method slerp merges exactly 2 models (the base included); the config gives 3"),
    ({"merge_method": "nuslerp", "models": [{"model": "M1", "parameters": {"weight": 1}}]},
     "merge_method nuslerp merges exactly 2 models besides the base; the config gives 1"),
    ({"merge_method": "model_stock", "models": [{"model": "M1"}]}, "merge_method model_stock merges at least 3 models (the base included); the config gives 2"),
    ({"merge_method": "passthrough"}, "merge_method passthrough merges exactly 1 models (the base included); the config gives 3"),
    ({"merge_method": "multislerp", "models": [{"model": "BASE", "parameters": {"weight": 1}}]},
     "merge_method multislerp merges at least 1 models besides the base; the config gives 0"),
    ({"merge_method": "nearswap", "base_model": None, "parameters": {"t": 0.5}}, "merge_method nearswap needs a base_model"),
])
def test_what_rotsym_cannot_run_is_refused_by_key_and_line(extra, message, models, tmp_path):
    raw = {"models": [{"model": "M1", "parameters": {"weight": 1}}, {"model": "M2", "parameters": {"weight": 1}}], "merge_method": "ties",
           "base_model": "BASE"}
    raw = {k: v for k, v in {**raw, **extra}.items() if v is not None}  # None: the key left out
    if "slices" in raw or "modules" in raw:
        raw.pop("models")
    text = yaml.safe_dump(raw, sort_keys=False).replace("M1", str(models["m1"])).replace("M2", str(models["m2"])).replace("BASE", str(models["base"]))
    (tmp_path / "c.yml").write_text(text)
    with pytest.raises(RecipeError) as e:
        mergekit.load(tmp_path / "c.yml")
    for name in ("m1", "m2", "base"):
        message = message.replace(name.upper() if name != "base" else "BASE", str(models[name]))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "line " in str(e.value) or "merge_method" in message


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_run_time_refusals_come_before_any_weight_is_read(models, tmp_path, no_weight_reads, capsys):
    beyond = {"slices": [{"sources": [{"model": str(models[m]), "layer_range": [1, 4]} for m in ("m1", "m2")]}], "merge_method": "slerp",
              "base_model": str(models["m1"]), "parameters": {"t": 0.5}}
    err = _usage_error(capsys, ["merge", str(_config(tmp_path, beyond)), str(tmp_path / "out")])
    assert "line 3: slices[0].sources[0].layer_range [1, 4] of" in err and "it has 3 layers (0 to 2); expected an end of at most 3" in err
    partial = {"models": [{"model": str(models["m1"]), "parameters": {"weight": [{"filter": "mlp", "value": 1}]}},
                          {"model": str(models["m2"]), "parameters": {"weight": 1}}], "merge_method": "linear"}
    err = _usage_error(capsys, ["merge", str(_config(tmp_path, partial)), str(tmp_path / "out")])
    assert "no weight for tensor 'model.embed_tokens.weight'" in err and "(merge_method needs one per model, for every tensor)" in err
    shared = {**beyond, "slices": None, "models": [{"model": str(models[m])} for m in ("m1", "m2")], "parameters": {"t": [{"filter": "mlp", "value": 0.5}]}}
    err = _usage_error(capsys, ["merge", str(_config(tmp_path, {k: v for k, v in shared.items() if v is not None})), str(tmp_path / "out")])
    assert "no t for tensor 'model.embed_tokens.weight' (merge_method needs one for every tensor)" in err  # a shared parameter: not per model
    whole = {**partial, "models": [{"model": str(models[m]), "parameters": {"weight": 1}} for m in ("m1", "m2")]}
    assert cli.main(["merge", str(_config(tmp_path, whole)), str(tmp_path / "out"), "--dry-run"]) == 0
    assert "memory estimate" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    big = ["merge", str(_config(tmp_path, whole)), str(tmp_path / "out"), "--max-memory", "1M"]
    assert "--max-memory 1.0 MiB: one tensor of each model at a time needs" in _usage_error(capsys, big)


def test_models_of_other_shapes_are_refused_naming_the_tensor(models, tmp_path, capsys):
    other = save_random({**LLAMA, "intermediate_size": 64}, "lm", 5, tmp_path / "wide")
    raw = {"models": [{"model": str(models["m1"]), "parameters": {"weight": 1}}, {"model": str(other), "parameters": {"weight": 1}}],
           "merge_method": "linear"}
    err = _usage_error(capsys, ["merge", str(_config(tmp_path, raw)), str(tmp_path / "out")])
    assert "tensor 'model.layers.0.mlp.gate_proj.weight': the models' shapes differ" in err and "(48, 32)" in err and "(64, 32)" in err


# ---- runs --------------------------------------------------------------------------------------------

def test_task_arithmetic_is_the_formula_and_streams_the_same_bits(models, tmp_path):
    raw = {"models": [{"model": str(models["m1"]), "parameters": {"weight": [0.2, 1.0]}}, {"model": str(models["m2"]), "parameters": {"weight": 0.5}}],
           "base_model": str(models["base"]), "merge_method": "task_arithmetic", "parameters": {"lambda": 0.8}}
    config = _config(tmp_path, raw)
    assert cli.main(["merge", str(config), str(tmp_path / "memory"), "--quiet"]) == 0
    got, base = float_tensors(tmp_path / "memory"), float_tensors(models["base"])
    m1, m2 = float_tensors(models["m1"]), float_tensors(models["m2"])
    for name, x in got.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        w1 = 0.2 if layer is None else 0.2 + 0.8 * layer / 2  # t = 0 outside the layers
        want = base[name] + 0.8 * (w1 * (m1[name] - base[name]) + 0.5 * (m2[name] - base[name]))
        np.testing.assert_allclose(x, want, atol=1e-6, err_msg=name)
    assert cli.main(["merge", str(config), str(tmp_path / "stream"), "--quiet", "--max-memory", "3G"]) == 0
    assert checkpoint_tensors(tmp_path / "stream") == checkpoint_tensors(tmp_path / "memory")
    written = sorted(p.name for p in (tmp_path / "memory").iterdir())
    assert {"mergekit_config.yml", "rotsym_report.json", "README.md", "config.json"} <= set(written)
    assert (tmp_path / "memory" / "mergekit_config.yml").read_text() == config.read_text()


def _toward(tensors, base, shared, inputs, rng):
    """A user's mergekit-vocabulary method: the base moved by `step` toward the other models' mean."""
    others = [x for x in tensors if x is not base]
    return (base + np.float32(shared["step"]) * (sum(others) / np.float32(len(others)) - base)).astype(np.float32)


def test_a_registered_tensorwise_method_runs_from_a_mergekit_config(models, tmp_path):
    """One declaration, registered: a mergekit config names it as merge_method, its parameters
    resolve (a gradient over the layers) and are checked, and the run writes the kernel's formula."""
    step = registry.Param("step", float, registry.REQUIRED, "how far toward the models' mean", low=0.0, high=1.0)
    registry.register(registry.Method("toward_mean", None, [step], needs={"base"}, min_models=1, granularity="element", tensorwise=_toward))
    try:
        raw = {"models": [{"model": str(models[m])} for m in ("m1", "m2")], "base_model": str(models["base"]), "merge_method": "toward_mean",
               "parameters": {"step": [0.0, 0.5]}}
        assert cli.main(["merge", str(_config(tmp_path, raw)), str(tmp_path / "out"), "--quiet"]) == 0
        got, base = float_tensors(tmp_path / "out"), float_tensors(models["base"])
        m1, m2 = float_tensors(models["m1"]), float_tensors(models["m2"])
        for name, x in got.items():
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else 0  # t = 0 outside the layers
            np.testing.assert_allclose(x, base[name] + 0.25 * layer * ((m1[name] + m2[name]) / 2 - base[name]), atol=1e-6, err_msg=name)
        with pytest.raises(RecipeError, match=r"parameters.step: step=1.5; step must be a finite number in \[0, 1\]"):
            mergekit.load(_config(tmp_path, {**raw, "parameters": {"step": 1.5}}))
    finally:
        registry._VOCABULARIES["mergekit"].pop("toward_mean")


def test_random_methods_draw_from_the_seed_and_the_tensor_alone(models, tmp_path):
    raw = {"models": [{"model": str(models[m]), "parameters": {"weight": 1, "density": 0.4}} for m in ("m1", "m2")],
           "base_model": str(models["base"]), "merge_method": "dare_ties", "rotsym": {"seed": 3}}
    merged = []
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        raw["rotsym"]["seed"] = seed
        merge_mergekit(_config(tmp_path, raw), tmp_path / name)
        merged.append(float_tensors(tmp_path / name))
    name = "model.layers.1.mlp.down_proj.weight"
    np.testing.assert_array_equal(merged[0][name], merged[1][name])
    assert not np.array_equal(merged[0][name], merged[2][name])
    # the draw of one tensor depends on the seed, the tensor and the input alone: its masks by hand
    base = float_tensors(models["base"])[name]
    salt = zlib.crc32(_key(models["base"], name).encode())
    kept = [np.random.default_rng([3, salt, i]).random(base.shape, dtype=np.float32) < 0.4 for i in (0, 1)]
    moved = merged[0][name] != base
    assert np.all(moved <= (kept[0] | kept[1])) and np.all(moved >= (kept[0] ^ kept[1]))
    assert 0.3 < np.mean(kept[0] ^ kept[1]) < 0.6  # the check above can fail


def _key(folder, name):
    source = Source(folder, "x")
    return next(k for k in source.rules if source.hf_name(k) == name)


def test_tokenizer_source_copies_that_models_tokenizer(models, tmp_path):
    for m, length in (("m1", 7), ("m2", 9)):
        (tmp_path / m).mkdir()
        for f in Path(models[m]).iterdir():
            (tmp_path / m / f.name).write_bytes(f.read_bytes())
        _save_tokenizer(tmp_path / m, BASE_TOKENS)
        settings = json.loads((tmp_path / m / "tokenizer_config.json").read_text())
        (tmp_path / m / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": length}))
    raw = {"models": [{"model": str(tmp_path / m), "parameters": {"weight": 1}} for m in ("m1", "m2")], "merge_method": "linear",
           "tokenizer_source": str(tmp_path / "m2")}
    merge_mergekit(_config(tmp_path, raw), tmp_path / "out")
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["model_max_length"] == 9
    (tmp_path / "m1" / "tokenizer.json").write_text("{")
    with pytest.raises(PipelineError, match=r"m1: no tokenizer to build the output's vocabulary"):
        merge_mergekit(_config(tmp_path, raw), tmp_path / "out2")
    (tmp_path / "m2" / "tokenizer.json").unlink()  # a source without a vocabulary beside one with: said so, not transformers' own error
    with pytest.raises(PipelineError, match=r"tokenizer_source .*m2: it holds no vocabulary .* which model 0 .* does"):
        merge_mergekit(_config(tmp_path, raw), tmp_path / "out3")


def test_ram_and_ramplus_keep_unique_changes_and_average_shared_ones():
    """RAM on three task vectors written out by hand: an entry one model changes keeps its change,
    one several change takes their mean, one none changes (within epsilon) stays the base's; RAM+
    scales each model's unique changes by 1 + r min(alpha, shared / unique)."""
    from rotsym_jax.merging import tensorwise

    base = np.zeros(4, np.float32)
    a, b, c = (np.asarray(v, np.float32) for v in ([1.0, 2.0, 0.0, 0.0], [3.0, 0.0, 0.0, 1e-6], [0.0, 0.0, 0.0, 4.0]))
    shared = {"epsilon": 1e-5}
    got = tensorwise.merge_tensor(tensorwise.METHODS["ram"], [base, a, b, c], 0, shared, [{}] * 4, None)
    np.testing.assert_array_equal(got, [2.0, 2.0, 0.0, 4.0])
    plus = tensorwise.merge_tensor(tensorwise.METHODS["ramplus_tl"], [base, a, b, c], 0, {**shared, "r": 0.5, "alpha": 0.8}, [{}] * 4, None)
    # a: 1 shared, 1 unique (rho 1, lambda 1.4); b: 1 shared, 0 unique (no unique entry); c: 0 shared, 1 unique (lambda 1)
    np.testing.assert_allclose(plus, [2.0, 2.0 * 1.4, 0.0, 4.0], rtol=1e-6)


# ---- vocabularies that differ (issue 75) -----------------------------------------------------------------

SPECIAL = ["t0", "t1", "t2", "t3"]  # unk, pad, bos, eos


def _save_tokenizer(folder, tokens: list[str]) -> None:
    """A WordLevel tokenizer of `tokens` (id = place in the list; the first four special) saved into
    `folder` as transformers saves it."""
    import tokenizers
    import transformers

    model = tokenizers.Tokenizer(tokenizers.models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="t0"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="t0", pad_token="t1", bos_token="t2",
                                         eos_token="t3").save_pretrained(folder)


# base: t0..t59; m1 (60 rows): the shared tokens reversed, t50..t54 replaced by a0..a4; m2 (56 rows, a
# model of its own): the shared tokens rotated, b0, a0, b1, and t55, t58 missing
BASE_TOKENS = [f"t{i}" for i in range(60)]
M1_TOKENS = SPECIAL + [f"t{i}" for i in range(49, 3, -1)] + [f"a{i}" for i in range(5)] + [f"t{i}" for i in range(55, 60)]
M2_TOKENS = SPECIAL + [f"t{i}" for i in (*range(10, 50), *range(4, 10))] + ["b0", "a0", "b1", "t56", "t57", "t59"]


@pytest.fixture(scope="module")
def vocab_models(models, tmp_path_factory):
    """The models' base and m1 with tokenizers of their own, and a Llama of 56 rows (m2): three
    vocabularies that share most tokens, in other orders, each lacking some of the others'."""
    root = tmp_path_factory.mktemp("vocab")
    out = {}
    for name, tokens in (("base", BASE_TOKENS), ("m1", M1_TOKENS)):
        out[name] = root / name
        out[name].mkdir()
        for f in Path(models[name]).iterdir():
            (out[name] / f.name).write_bytes(f.read_bytes())
        _save_tokenizer(out[name], tokens)
    out["m2"] = save_random({**LLAMA, "vocab_size": 56}, "lm", 7, root / "m2")
    _save_tokenizer(out["m2"], M2_TOKENS)
    return {k: str(v) for k, v in out.items()}


def _tables(folder, tokens: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """{tensor: {token: row}} of a model's embedding and LM head."""
    tensors = float_tensors(folder)
    return {name: dict(zip(tokens, tensors[name])) for name in ("model.embed_tokens.weight", "lm_head.weight")}


def test_a_union_of_differing_vocabularies_matches_rows_by_token_and_fills_the_lacking_ones(vocab_models, tmp_path, capsys):
    """tokenizer_source: union, task arithmetic from the base: the output's vocabulary is the base's
    then the tokens it lacks (m1's by id, then m2's); each model's row of a token it lacks is the
    base's where it holds it, else the holders' mean (one holder: its row), and the merge is the formula on those
    rows. The report counts each model's lacking rows; transformers loads the output and its tokenizer."""
    import transformers

    raw = {"models": [{"model": vocab_models["m1"], "parameters": {"weight": 0.6}}, {"model": vocab_models["m2"], "parameters": {"weight": 0.3}}],
           "base_model": vocab_models["base"], "merge_method": "task_arithmetic", "parameters": {"lambda": 0.9}, "dtype": "float32",
           "tokenizer_source": "union"}
    config = _config(tmp_path, raw)
    assert cli.main(["merge", str(config), str(tmp_path / "out"), "--dry-run"]) == 0
    assert f"67 tokens (7 added to {vocab_models['base']}'s), 67 rows" in capsys.readouterr().out
    assert cli.main(["merge", str(config), str(tmp_path / "out"), "--quiet"]) == 0
    union = BASE_TOKENS + ["a0", "a1", "a2", "a3", "a4", "b0", "b1"]
    tables = {m: _tables(vocab_models[m], tokens) for m, tokens in (("base", BASE_TOKENS), ("m1", M1_TOKENS), ("m2", M2_TOKENS))}
    got = float_tensors(tmp_path / "out")

    def default(base, m1, m2, token):  # the row of a model lacking `token`
        holders = [t for t in (base, m1, m2) if token in t]
        if len(holders) == 1:
            return holders[0][token]
        return base[token] if token in base else (m1[token] + m2[token]) / 2  # a0: m1 and m2 hold it, not the base

    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        own = {m: tables[m][name] for m in ("base", "m1", "m2")}
        rows = {m: np.stack([t[token] if token in t else default(*own.values(), token) for token in union]) for m, t in own.items()}
        want = rows["base"] + 0.9 * (0.6 * (rows["m1"] - rows["base"]) + 0.3 * (rows["m2"] - rows["base"]))
        assert got[name].shape == (67, 32)
        np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-6, err_msg=name)
    for name, x in float_tensors(vocab_models["base"]).items():  # the other tensors: m2 is another model, merged as it is
        if "embed_tokens" not in name and "lm_head" not in name:
            assert got[name].shape == x.shape
    report = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())["result"]["vocabulary"]
    assert report["lacked"] == {vocab_models["m1"]: 7, vocab_models["m2"]: 11, vocab_models["base"]: 7}  # 67 - 60, 67 - 56, 67 - 60
    assert (report["tokens"], report["rows"], report["added"], report["mapped"]) == (67, 67, 7, True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    assert tokenizer.get_vocab() == {t: i for i, t in enumerate(union)}
    assert tokenizer("t5 a4 b1")["input_ids"] == [5, 64, 66]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 67
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    np.testing.assert_array_equal(model.get_input_embeddings().weight.detach().numpy(), got["model.embed_tokens.weight"])
    # the same bits streamed under --max-memory
    assert cli.main(["merge", str(config), str(tmp_path / "stream"), "--quiet", "--max-memory", "3G"]) == 0
    assert checkpoint_tensors(tmp_path / "stream") == checkpoint_tensors(tmp_path / "out")


def test_configured_token_sources_give_their_rows_and_force_replaces_a_models_own(vocab_models, tmp_path):
    """tokenizer: {source: m2, tokens: ...}, linear: the output is m2's vocabulary plus the listed
    tokens it lacks; a listed token's source gives the row of each model lacking it (a model's row of
    another token, zeros) and, forced, of every model; an unlisted token only m2 holds takes m2's row."""
    m1, m2 = vocab_models["m1"], vocab_models["m2"]
    raw = {"models": [{"model": m1, "parameters": {"weight": 0.3}}, {"model": m2, "parameters": {"weight": 0.7}}], "merge_method": "linear",
           "dtype": "float32", "tokenizer": {"source": m2, "tokens": {
               "new": {"source": {"kind": "zero"}},
               "t55": {"source": {"kind": "model_token", "model": m2, "token": "t57"}},  # m2 lacks t55: its row is its own t57's
               "t5": {"source": {"kind": "model_token", "model": m1, "token_id": 0}, "force": True},  # both: m1's row 0
           }}}
    merge_mergekit(_config(tmp_path, raw), tmp_path / "out")
    vocab = M2_TOKENS + ["new", "t55"]
    got = float_tensors(tmp_path / "out")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        r1, r2 = _tables(m1, M1_TOKENS)[name], _tables(m2, M2_TOKENS)[name]
        zero = np.zeros(32, np.float32)
        for k, token in enumerate(vocab):
            if token == "t5":
                a = b = r1["t0"]
            elif token == "new":
                a = b = zero
            elif token == "t55":
                a, b = r1["t55"], r2["t57"]
            else:  # b0, b1: only m2 holds them
                a, b = r1.get(token, r2[token]), r2[token]
            np.testing.assert_allclose(got[name][k], 0.3 * a + 0.7 * b, rtol=0, atol=1e-6, err_msg=f"{name} {token}")
    report = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())["result"]["vocabulary"]
    assert report["lacked"] == {m1: 3, m2: 2}  # m1: b0, b1, new; m2: new, t55


def test_a_union_of_identical_tokenizers_maps_nothing_and_copies_the_tokenizer(vocab_models, models, tmp_path):
    """The union of one vocabulary is that vocabulary: the tensors are the merge's without
    tokenizer_source, the tokenizer's files the reference's, byte for byte."""
    folders = {}
    for m in ("m1", "m2"):
        folders[m] = tmp_path / m
        folders[m].mkdir()
        for f in Path(models[m]).iterdir():
            (folders[m] / f.name).write_bytes(f.read_bytes())
        _save_tokenizer(folders[m], BASE_TOKENS)
    raw = {"models": [{"model": str(folders[m]), "parameters": {"weight": 1}} for m in ("m1", "m2")], "merge_method": "linear",
           "dtype": "float32"}
    merge_mergekit(_config(tmp_path, raw), tmp_path / "plain")
    merge_mergekit(_config(tmp_path, {**raw, "tokenizer_source": "union"}), tmp_path / "union")
    assert checkpoint_tensors(tmp_path / "union") == checkpoint_tensors(tmp_path / "plain")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "union" / f).read_bytes() == (folders["m1"] / f).read_bytes()
    report = json.loads((tmp_path / "union" / "rotsym_report.json").read_text())["result"]["vocabulary"]
    assert report["mapped"] is False and set(report["lacked"].values()) == {0}
    # nothing to map: alignment composes with it as without it
    aligned = {**raw, "tokenizer_source": "union", "rotsym": {"align": "anchor", "align_options": {"heads": "permute"}}}
    merge_mergekit(_config(tmp_path, aligned), tmp_path / "aligned")
    merge_mergekit(_config(tmp_path, {**aligned, "tokenizer_source": None}), tmp_path / "aligned_plain")
    assert checkpoint_tensors(tmp_path / "aligned") == checkpoint_tensors(tmp_path / "aligned_plain")


def test_the_merging_guides_vocabulary_config_runs_as_written(vocab_models, tmp_path, monkeypatch):
    """The guide's tokenizer: section on the three vocabularies (t59 named <s>): the union and the two
    listed tokens, padded to 64 rows; the new token is llama-code's <s> in every model, so in the merge."""
    page = (ROOT / "docs" / "guides" / "merging.md").read_text()
    text = page[page.index("### Vocabularies that differ"):].split("```yaml\n", 1)[1].split("```", 1)[0]
    for name, model, tokens in (("llama-math", "m1", M1_TOKENS), ("llama-code", "m2", M2_TOKENS), ("llama-base", "base", BASE_TOKENS)):
        (tmp_path / name).mkdir()
        for f in ("config.json", "model.safetensors"):
            (tmp_path / name / f).write_bytes((Path(vocab_models[model]) / f).read_bytes())
        _save_tokenizer(tmp_path / name, ["<s>" if t == "t59" else t for t in tokens])
    monkeypatch.chdir(tmp_path)  # paths relative to the working directory, as mergekit reads them
    (tmp_path / "vocab.yml").write_text(text)
    merged = merge_mergekit(mergekit.load("vocab.yml"), tmp_path / "merged")
    report = merged.report["result"]["vocabulary"]
    assert (report["tokens"], report["rows"]) == (69, 128)  # 60 + a0..a4 + b0, b1 + the two listed
    got = float_tensors(tmp_path / "merged")["model.embed_tokens.weight"]
    code = dict(zip(M2_TOKENS, float_tensors(vocab_models["m2"])["model.embed_tokens.weight"]))
    np.testing.assert_allclose(got[67], code["t59"], rtol=0, atol=1e-6)  # <|im_start|>
    np.testing.assert_array_equal(got[68], np.zeros(32, np.float32))  # <pad>


def test_what_a_vocabulary_map_cannot_take_is_refused_before_any_weight_is_read(vocab_models, tmp_path, no_weight_reads, capsys):
    m1, m2, base = (vocab_models[m] for m in ("m1", "m2", "base"))
    wide = tmp_path / "wide"  # m2's 56 rows under a tokenizer of 60 tokens
    wide.mkdir()
    for f in ("config.json", "model.safetensors"):
        (wide / f).write_bytes((Path(m2) / f).read_bytes())
    _save_tokenizer(wide, BASE_TOKENS)
    raw = {"models": [{"model": m1, "parameters": {"weight": 1}}, {"model": str(wide), "parameters": {"weight": 1}}], "merge_method": "linear",
           "tokenizer_source": str(wide)}
    err = _usage_error(capsys, ["merge", str(_config(tmp_path, raw)), str(tmp_path / "out")])
    assert "its tokenizer has 4 tokens with ids from 56 past its vocab_size 56" in err and "rotsym does not" in err
    # the embeddings come from the first slice (the base alone): a token source outside it cannot give their rows
    sliced = {"slices": [{"sources": [{"model": base, "layer_range": [0, 2]}]}, {"sources": [{"model": m1, "layer_range": [2, 3]}]}],
              "merge_method": "passthrough", "tokenizer": {"tokens": {"a0": {"source": m1}}}}
    err = _usage_error(capsys, ["merge", str(_config(tmp_path, sliced)), str(tmp_path / "out")])
    assert f"tokenizer.tokens['a0']: source {m1} is not among the models of tensor 'model.embed_tokens.weight' (['{base}'])" in err
    missing = {"models": raw["models"][:1] + [{"model": base, "parameters": {"weight": 1}}], "merge_method": "linear",
               "tokenizer": {"source": "union", "tokens": {"new": {"source": {"kind": "model_token", "model": base, "token": "a2"}}}}}
    err = _usage_error(capsys, ["merge", str(_config(tmp_path, missing)), str(tmp_path / "out")])
    assert f"tokenizer.tokens['new']: {base}'s vocabulary has no token 'a2'" in err
    from_data = {"models": missing["models"], "merge_method": "linear", "tokenizer_source": "union",
                 "rotsym": {"align": "anchor", "align_options": {"method": "activations"}}}
    err = _usage_error(capsys, ["merge", str(_config(tmp_path, from_data)), str(tmp_path / "out")])
    assert "align_options.method 'activations' over vocabularies mapped onto the output's (tokenizer_source union) is not run" in err
    left_behind = {**from_data, "tokenizer": {"source": "base", "tokens": {"x": {"source": {"kind": "model_token", "model": m1, "token": "a1"}}}},
                   "base_model": base, "rotsym": {"align": "anchor"}}
    left_behind.pop("tokenizer_source")
    err = _usage_error(capsys, ["merge", str(_config(tmp_path, left_behind)), str(tmp_path / "out")])
    assert f"tokenizer.tokens['x']: its source, {m1}'s token 'a1', is not in the output's vocabulary, whose rows alone are aligned" in err
    assert not (tmp_path / "out").exists()


def test_alignment_after_the_vocabulary_matches_rows_by_token(vocab_models, models, tmp_path, monkeypatch):
    """B: the base moved by a random element of every group and a residual permutation, its
    vocabulary shuffled, t50..t52 left out and x0..x2 new (B's rows of t7..t9). Its rows put on the
    union by token, then aligned: the linear merge of the base and B is the base, x0..x2 the base's
    t7..t9; unaligned it is far from it."""
    from safetensors.numpy import save_file

    ck = rj.load_hf(models["base"])
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1))
    t["residual"] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
    moved = hf.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "moved")
    shuffled = [f"t{i}" for i in np.random.default_rng(0).permutation(np.arange(4, 60)) if not 50 <= i <= 52]
    tokens = SPECIAL + shuffled + ["x0", "x1", "x2"]
    ids = [int(tok[1:]) + (7 if tok[0] == "x" else 0) for tok in tokens]  # each row's token in the base: x0..x2 are t7..t9
    tensors = float_tensors(moved)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = np.ascontiguousarray(tensors[name][ids])
    save_file(tensors, str(moved / "model.safetensors"), metadata={"format": "pt"})
    _save_tokenizer(moved, tokens)
    raw = {"models": [{"model": vocab_models["base"], "parameters": {"weight": 1}}, {"model": str(moved), "parameters": {"weight": 1}}],
           "merge_method": "linear", "dtype": "float32", "tokenizer_source": "union",
           "rotsym": {"align": "anchor", "align_options": {"heads": "permute", "residual": "permutation"}}}
    seen = []  # the tables alignment is given: on the union's 63 rows by token, a lacking row zero

    def spy(checkpoints, *args):
        seen.extend(flatten(c.params)["embeddings/word/embedding"] for c in checkpoints)
        return aligned(checkpoints, *args)

    monkeypatch.setattr(mergekit_pipeline, "aligned", spy)
    merged = merge_mergekit(_config(tmp_path, raw), tmp_path / "aligned")
    assert [x.shape for x in seen] == [(63, 32), (63, 32)]
    assert not np.any(seen[0][60:]) and np.all(np.any(seen[1][60:], axis=1))  # x0..x2: the base lacks them
    assert not np.any(seen[1][50:53]) and np.all(np.any(seen[0][50:53], axis=1))  # t50..t52: B lacks them
    assert merged.report["result"]["vocabulary"]["lacked"] == {vocab_models["base"]: 3, str(moved): 3}
    want, got = float_tensors(vocab_models["base"]), float_tensors(tmp_path / "aligned")
    for name, x in want.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            x = np.concatenate([x, x[7:10]])  # x0..x2: B's rows of t7..t9, moved back
        np.testing.assert_allclose(got[name], x, atol=1e-5, err_msg=name)
    merge_mergekit(_config(tmp_path, {**raw, "rotsym": {"align": "none"}}), tmp_path / "plain")
    plain = float_tensors(tmp_path / "plain")
    assert np.abs(plain["model.embed_tokens.weight"][:60] - want["model.embed_tokens.weight"]).max() > 0.1


def test_alignment_before_a_linear_merge_gives_the_anchor_of_a_planted_copy(models, tmp_path):
    """B: the base moved by a random element of every group and a residual permutation (the same
    function); mergekit's linear average of the two is far from the base, aligned first it is the base."""
    ck = rj.load_hf(models["base"])
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1))
    t["residual"] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
    planted = hf.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "planted")
    raw = {"models": [{"model": str(models["base"]), "parameters": {"weight": 1}}, {"model": str(planted), "parameters": {"weight": 1}}],
           "merge_method": "linear", "dtype": "float32"}
    config = _config(tmp_path, raw)
    assert cli.main(["merge", str(config), str(tmp_path / "plain"), "--quiet"]) == 0
    assert cli.main(["merge", str(config), str(tmp_path / "aligned"), "--quiet", "--align", "anchor", "--heads", "permute",
                     "--residual", "permutation"]) == 0
    raw["rotsym"] = {"align": "anchor", "align_options": {"heads": "permute", "residual": "permutation"}}
    merge_mergekit(_config(tmp_path, raw), tmp_path / "block")
    want = float_tensors(models["base"])
    plain, aligned = float_tensors(tmp_path / "plain"), float_tensors(tmp_path / "aligned")
    assert max(np.abs(plain[n] - want[n]).max() for n in want) > 0.1
    for n, x in want.items():
        np.testing.assert_allclose(aligned[n], x, atol=1e-5, err_msg=n)
    assert checkpoint_tensors(tmp_path / "block") == checkpoint_tensors(tmp_path / "aligned")
    report = json.loads((tmp_path / "aligned" / "rotsym_report.json").read_text())
    assert report["options"]["align"] == "anchor" and report["result"]["alignment"]["mode"] == "anchor"


# ---- against mergekit itself (slow) --------------------------------------------------------------------

MERGEKIT = ROOT / ".mergekit"


def _run_mergekit(config: Path, out: Path) -> subprocess.CompletedProcess:
    script = MERGEKIT / "bin" / "mergekit-yaml"
    if not script.is_file():
        pytest.fail(f"mergekit is not installed in {MERGEKIT}: `make test-slow` installs it (the reference of these tests)")
    env = {**os.environ, "PYTHONPATH": str(MERGEKIT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(script), str(config), str(out)], env=env, capture_output=True, text=True)


def _mergekit(config: Path, out: Path) -> None:
    run = _run_mergekit(config, out)
    assert run.returncode == 0, run.stderr[-3000:]


# mergekit's own declarations, read from its registry: each method's parameters (name, type, scope,
# default or required) and which counts of inputs its contract accepts (n inputs, the base among them or not).
_DECLARATIONS = """
import json, sys
from mergekit.merge_methods import registry
out = {}
for m in registry.registered_methods():
    s = m.spec
    def accepts(n, with_base):
        try:
            s.contract.validate_ids(list(range(n)), 0 if with_base else None)
            return True
        except ValueError:
            return False
    out[s.name] = {"base": s.contract.base.value,
                   "params": {p.name: [getattr(p.value_type, "__name__", str(p.value_type)), p.scope.value, None if p.required else p.default,
                                       p.required] for p in s.parameters},
                   "accepts": [[n, b, accepts(n, b)] for n in range(1, 6) for b in (False, True)]}
json.dump(out, sys.stdout)
"""
# Where rotsym's declaration differs from mergekit's on purpose: karcher's max_iter is read as a number
# and run as int(max_iter) steps (mergekit's pydantic refuses 10.5, rotsym runs 10 steps).
_TYPES_KEPT = {("karcher", "max_iter"): ("float", "int")}


@pytest.mark.slow
def test_each_mergekit_method_is_declared_as_mergekit_declares_it():
    """Every method of rotsym's mergekit vocabulary against mergekit 0.1.5's own registry: the same
    names, the same parameters (type, per model or shared, default or required), the same base
    policy, and the same counts of inputs accepted (1 to 5 models, the base among them or not)."""
    if not (MERGEKIT / "mergekit").is_dir():
        pytest.fail(f"mergekit is not installed in {MERGEKIT}: `make test-slow` installs it (the reference of these tests)")
    run = subprocess.run([sys.executable, "-c", _DECLARATIONS], env={**os.environ, "PYTHONPATH": str(MERGEKIT)}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(run.stdout)
    assert set(theirs) == set(tensorwise.METHODS)
    for name, method in tensorwise.METHODS.items():
        want = theirs[name]
        assert method.base == want["base"], name
        ours = {p.name: [p.type.__name__, p.scope, None if p.required else p.default, p.required] for p in method.params.values()}
        for (method_name, param), (our_type, their_type) in _TYPES_KEPT.items():
            if method_name == name:
                assert ours[param][0] == our_type and want["params"][param][0] == their_type
                ours[param][0] = their_type
        if name == "passthrough":  # Optional[float]: a float or nothing
            want["params"]["scale"][0] = "float"
        assert ours == want["params"], name
        for n, with_base, accepted in want["accepts"]:
            if method.base == "ignored":
                with_base = False  # mergekit counts a base the method ignores as an input
            refused = (method.base == "required" and not with_base) or registry.counts(method, n, with_base) is not None
            assert accepted != refused, (name, n, with_base)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Checkpoints transformers wrote: a Llama base and three models near it, two GPT-2s, a tokenizer each."""
    torch = pytest.importorskip("torch")
    import tokenizers
    import transformers

    root = tmp_path_factory.mktemp("mergekit-hf")
    vocab = {f"t{i}": i for i in range(64)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t1", bos_token="t2", eos_token="t3")
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(llama)
    out = {"base": root / "base"}
    base.save_pretrained(out["base"])
    fast.save_pretrained(out["base"])
    for i in (1, 2, 3):
        torch.manual_seed(i)
        model = transformers.LlamaForCausalLM(llama)
        model.load_state_dict(base.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        out[f"m{i}"] = root / f"m{i}"
        model.save_pretrained(out[f"m{i}"])
        fast.save_pretrained(out[f"m{i}"])
    tied = transformers.LlamaConfig(**{**llama.to_dict(), "tie_word_embeddings": True})
    for i in (1, 2):  # a tied LM head: no lm_head tensor in the file
        torch.manual_seed(20 + i)
        out[f"t{i}"] = root / f"t{i}"
        transformers.LlamaForCausalLM(tied).save_pretrained(out[f"t{i}"])
    gpt2 = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=32, bos_token_id=2, eos_token_id=3)
    for i in (1, 2):
        torch.manual_seed(10 + i)
        out[f"g{i}"] = root / f"g{i}"
        transformers.GPT2LMHeadModel(gpt2).save_pretrained(out[f"g{i}"])
    gptj = transformers.GPTJConfig(vocab_size=64, n_embd=32, n_layer=3, n_head=4, rotary_dim=4, n_positions=32)  # no mergekit architecture file
    for i in (1, 2, 3):
        torch.manual_seed(30 + i)
        out[f"j{i}"] = root / f"j{i}"
        transformers.GPTJForCausalLM(gptj).save_pretrained(out[f"j{i}"])
    return {k: str(v) for k, v in out.items()}


def _m(name, **params):
    return {"model": name, **({"parameters": params} if params else {})}


def _s(*sources, **params):
    """A slice: sources (model, first, end[, parameters]), the slice's own parameters."""
    return {"sources": [{"model": m, "layer_range": [a, b], **({"parameters": rest[0]} if rest else {})} for m, a, b, *rest in sources],
            **({"parameters": params} if params else {})}


# Every method both tools have, every key of issue 50 (filters, gradients, per-model parameters,
# slices over every layer, normalize, int8_mask, lambda, dtype/out_dtype, tokenizer_source), in the
# shapes mergekit's documentation shows. Random drops compare at density 1 (mergekit draws from
# torch's global generator).
CONFIGS = {
    "linear": {"models": [_m("m1", weight=[1.0, 0.2]), _m("m2", weight=[{"filter": "mlp", "value": 0.3}, {"value": 0.7}]), _m("m3", weight=0.5)],
               "merge_method": "linear", "parameters": {"normalize": False}, "dtype": "float32"},
    "linear_normalized": {"models": [_m("m1", weight=2), _m("m2", weight=1)], "merge_method": "linear", "dtype": "float32",
                          "tokenizer_source": "m2"},
    # the union of one shared vocabulary: mergekit builds it and maps every embedding row onto it; here, itself
    "linear_union": {"models": [_m("m1", weight=0.4), _m("m2", weight=0.6)], "base_model": "base", "merge_method": "task_arithmetic",
                     "dtype": "float32", "tokenizer_source": "union"},
    "slerp": {"slices": [{"sources": [{"model": "base", "layer_range": [0, 3]}, {"model": "m1", "layer_range": [0, 3]}]}], "base_model": "base",
              "merge_method": "slerp", "dtype": "float32",
              "parameters": {"t": [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]}, {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
                                   {"value": 0.5}]}},
    "slerp_gpt2": {"models": [_m("g1"), _m("g2")], "base_model": "g1", "merge_method": "slerp", "dtype": "float32",
                   "parameters": {"t": [{"filter": "attn", "value": [0, 1]}, {"value": 0.4}]}},
    "nuslerp": {"models": [_m("m1", weight=0.3), _m("m2", weight=0.7)], "merge_method": "nuslerp", "dtype": "float32"},
    "linear_tied": {"models": [_m("t1", weight=0.3), _m("t2", weight=0.7)], "merge_method": "linear"},
    "nuslerp_rows_base": {"models": [_m("m1", weight=0.3), _m("m2", weight=0.7)], "base_model": "base", "merge_method": "nuslerp",
                          "parameters": {"nuslerp_flatten": False, "nuslerp_row_wise": True}, "dtype": "float32"},
    "task_arithmetic": {"models": [_m("m1", weight=0.5), _m("m2", weight=[0.2, 0.8]), _m("m3", weight=0.3)], "base_model": "base",
                        "merge_method": "task_arithmetic", "parameters": {"lambda": 0.8}, "dtype": "float32", "tokenizer_source": "base"},
    "ties": {"models": [_m("m1", weight=0.6, density=[1, 0.5, 0.3]), _m("m2", weight=0.4, density=[{"filter": "self_attn", "value": 0.7},
                                                                                                    {"value": 0.4}]), _m("base")],
             "base_model": "base", "merge_method": "ties", "parameters": {"normalize": True, "int8_mask": True}, "dtype": "float32"},
    "ties_unnormalized": {"models": [_m("m1", weight=1, density=0.5), _m("m2", weight=1), _m("m3", weight=1)], "base_model": "base",
                          "merge_method": "ties", "parameters": {"normalize": False, "density": 0.3}, "dtype": "float32"},
    "dare_ties": {"models": [_m("m1", weight=0.5), _m("m2", weight=0.5)], "base_model": "base", "merge_method": "dare_ties", "dtype": "float32"},
    "dare_linear": {"models": [_m("m1", weight=0.5), _m("m2", weight=0.5)], "base_model": "base", "merge_method": "dare_linear",
                    "parameters": {"normalize": True}, "dtype": "float32"},
    "breadcrumbs": {"models": [_m("m1", weight=0.5, density=0.8, gamma=0.05), _m("m2", weight=0.5, density=0.6)], "base_model": "base",
                    "merge_method": "breadcrumbs", "dtype": "float32"},
    "breadcrumbs_ties": {"models": [_m("m1", weight=0.5, density=0.8, gamma=0.05), _m("m2", weight=0.5, density=0.6)], "base_model": "base",
                         "merge_method": "breadcrumbs_ties", "parameters": {"rescale": True}, "dtype": "float32"},
    # RAM and RAM+: epsilon near the perturbations' scale, so that each entry is changed by none, one or several models
    "ram": {"models": [_m("m1"), _m("m2"), _m("m3")], "base_model": "base", "merge_method": "ram", "parameters": {"epsilon": 0.02},
            "dtype": "float32"},
    "ramplus_tl": {"models": [_m("m1"), _m("m2"), _m("m3")], "base_model": "base", "merge_method": "ramplus_tl",
                   "parameters": {"epsilon": 0.02, "r": 0.5, "alpha": 0.8}, "dtype": "float32"},
    "arcee_fusion": {"models": [_m("m1"), _m("base")], "base_model": "base", "merge_method": "arcee_fusion", "dtype": "float32"},
    "della": {"models": [_m("m1", weight=0.5), _m("m2", weight=0.5)], "base_model": "base", "merge_method": "della", "dtype": "float32"},
    "della_linear": {"models": [_m("m1", weight=0.5), _m("m2", weight=0.5)], "base_model": "base", "merge_method": "della_linear",
                     "parameters": {"epsilon": 0.1}},
    "model_stock": {"models": [_m("m1"), _m("m2"), _m("m3")], "base_model": "base", "merge_method": "model_stock", "dtype": "float32"},
    "model_stock_filter_wise": {"models": [_m("m1"), _m("m2")], "base_model": "base", "merge_method": "model_stock",
                                "parameters": {"filter_wise": True}, "dtype": "float32"},
    "nearswap": {"models": [_m("m1"), _m("base")], "base_model": "base", "merge_method": "nearswap", "parameters": {"t": 0.01},
                 "dtype": "float32"},
    "multislerp": {"models": [_m("m1", weight=0.5), _m("m2", weight=[0.2, 0.8]), _m("m3", weight=0.3)], "merge_method": "multislerp",
                   "dtype": "float32"},
    "multislerp_base": {"models": [_m("m1", weight=1), _m("m2", weight=2)], "base_model": "base", "merge_method": "multislerp",
                        "parameters": {"normalize_weights": False}, "dtype": "float32"},
    "karcher": {"models": [_m("m1"), _m("m2"), _m("m3")], "merge_method": "karcher", "dtype": "float32"},
    "karcher_iterations": {"models": [_m("m1"), _m("base")], "merge_method": "karcher", "parameters": {"max_iter": 3, "tol": 1e-7},
                           "dtype": "float32"},
    "sce": {"models": [_m("m1"), _m("m2"), _m("m3")], "base_model": "base", "merge_method": "sce", "dtype": "float32"},
    "sce_topk": {"models": [_m("m1"), _m("m2")], "base_model": "base", "merge_method": "sce", "parameters": {"select_topk": 0.3},
                 "dtype": "float32"},
    # GPT-J: merged through its record (its loader reorders q and k's interleaved rotary pairs, its saver restores
    # them: a tensorwise merge commutes with that); mergekit has no architecture file for it and infers one from the names (h.N.)
    "ties_gptj": {"models": [_m("j2", weight=0.6, density=[1, 0.3]), _m("j3", weight=0.4, density=0.5)], "base_model": "j1",
                  "merge_method": "ties", "dtype": "float32"},
    "slerp_gptj": {"models": [_m("j1"), _m("j2")], "base_model": "j1", "merge_method": "slerp", "dtype": "float32",
                   "parameters": {"t": [{"filter": "attn", "value": [0, 1]}, {"value": 0.3}]}},
    "passthrough": {"models": [_m("m1", scale=[{"filter": "o_proj", "value": 0.5}, {"value": 1.0}])], "merge_method": "passthrough",
                    "dtype": "float32"},
    "out_dtype": {"models": [_m("m1", weight=1), _m("m2", weight=1)], "merge_method": "linear", "dtype": "float32", "out_dtype": "bfloat16"},
    # slices as mergekit's frankenmerges write them (issue 75): layers stacked from several models, a model's
    # range repeated, ranges merged slice by slice, a gradient over each slice's own layers (t = 1 in a slice of one)
    "slices_stacked": {"slices": [_s(("m1", 0, 2)), _s(("m2", 1, 3))], "merge_method": "passthrough", "dtype": "float32"},
    "slices_repeated_scaled": {"slices": [_s(("m1", 0, 2)), _s(("m1", 1, 3, {"scale": [{"filter": "o_proj", "value": 0.5}, {"value": 1.0}]})),
                                          _s(("m2", 2, 3), scale=0.9)], "merge_method": "passthrough", "base_model": "m1"},
    "slices_linear": {"slices": [_s(("m1", 0, 2, {"weight": [0.1, 0.9]}), ("m2", 1, 3, {"weight": 0.5})),
                                 _s(("m3", 0, 1, {"weight": 1}), ("m1", 2, 3, {"weight": [1, 0]}), normalize=False)],
                      "merge_method": "linear", "dtype": "float32"},
    "slices_slerp_gradient": {"slices": [_s(("base", 0, 2), ("m1", 1, 3)), _s(("base", 2, 3), ("m2", 0, 1))], "base_model": "base",
                              "merge_method": "slerp", "parameters": {"t": [{"filter": "mlp", "value": [0, 1]}, {"value": [1, 0.2]}]},
                              "dtype": "float32"},
    "slices_ties": {"slices": [_s(("base", 0, 2), ("m1", 1, 3, {"weight": 0.6, "density": 0.5}), ("m2", 0, 2, {"weight": 0.4})),
                               _s(("base", 1, 3), ("m3", 1, 3, {"weight": [0.2, 1]}))],
                    "base_model": "base", "merge_method": "ties", "parameters": {"density": 0.7}, "dtype": "float32"},
    "slices_in_place": {"slices": [_s(("base", 0, 2), ("m1", 0, 2)), _s(("base", 2, 3), ("m1", 2, 3))], "base_model": "base",
                        "merge_method": "slerp", "parameters": {"t": [0.1, 0.8]}, "dtype": "float32"},
    "slices_tied": {"slices": [_s(("t1", 0, 2)), _s(("t2", 1, 2))], "merge_method": "passthrough"},
    "slices_gpt2": {"slices": [_s(("g1", 0, 3)), _s(("g2", 1, 3))], "merge_method": "passthrough", "dtype": "float32"},
    "bfloat16": {"models": [_m("m1", weight=1), _m("m2", weight=3)], "merge_method": "linear", "dtype": "bfloat16"},
}


def _with_paths(value, paths: dict):
    """`value` (a config) with each model's name a path: under model, base_model, tokenizer_source
    and a tokenizer: section's source."""
    if isinstance(value, dict):
        return {k: (paths[v] if k in ("model", "base_model", "tokenizer_source", "source") and isinstance(v, str) and v in paths
                    else _with_paths(v, paths)) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_paths(v, paths) for v in value]
    return value


def _assert_mergekits_tensors(mergekit_out: Path, rotsym_out: Path, inputs: tuple[Path, Path] | None = None) -> None:
    """The same tensor names, dtypes and shapes, and values within float32's (or bfloat16's) rounding.
    `inputs` (base, other): a masked merge (arcee_fusion) whose mask may differ at its threshold,
    where the float32 rounding of a sum of nearly cancelling terms decides: each entry that differs
    is the base's in one output and the other's in the other, and at most 0.5% of a tensor's do."""
    theirs, ours = checkpoint_tensors(mergekit_out), checkpoint_tensors(rotsym_out)
    assert theirs.keys() == ours.keys()
    for tensor in theirs:
        assert theirs[tensor][:2] == ours[tensor][:2], tensor  # dtype and shape
    want, got = float_tensors(mergekit_out), float_tensors(rotsym_out)
    if inputs is not None:
        base, other = (float_tensors(p) for p in inputs)
        for tensor, x in want.items():
            y, b, o = got[tensor], base[tensor], other[tensor]
            flipped = ~np.isclose(y, x, rtol=0, atol=1e-7)
            swapped = (np.isclose(y, b, rtol=0, atol=1e-7) & np.isclose(x, o, rtol=0, atol=1e-7)) | \
                      (np.isclose(y, o, rtol=0, atol=1e-7) & np.isclose(x, b, rtol=0, atol=1e-7))
            assert flipped.mean() <= 0.005 and swapped[flipped].all(), (tensor, flipped.mean())
        return
    for tensor, x in want.items():
        # float32 rounding (a few ulps of values near 1); bfloat16: the rounding of one result
        atol = 2e-2 if theirs[tensor][0] == "BF16" else 1e-6
        np.testing.assert_allclose(got[tensor], x, rtol=0, atol=atol * max(1.0, float(np.abs(x).max())), err_msg=tensor)


def _merged_by_both(raw: dict, models: dict, tmp_path: Path) -> None:
    """The config `raw` (models by name in `models`) merged by mergekit-yaml into tmp_path/mergekit and by rotsym into tmp_path/rotsym."""
    config = _config(tmp_path, _with_paths(raw, models))
    _mergekit(config, tmp_path / "mergekit")
    assert cli.main(["merge", str(config), str(tmp_path / "rotsym"), "--quiet"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_mergekit_config_gives_mergekits_tensors(name, hf_models, tmp_path):
    _merged_by_both(CONFIGS[name], hf_models, tmp_path)
    masked = (hf_models["base"], hf_models["m1"]) if CONFIGS[name]["merge_method"] == "arcee_fusion" else None
    _assert_mergekits_tensors(tmp_path / "mergekit", tmp_path / "rotsym", masked)
    if "slices" in CONFIGS[name]:  # the depth mergekit writes
        depth = lambda out: {k: v for k, v in json.loads((tmp_path / out / "config.json").read_text()).items() if k in ("n_layer", "num_hidden_layers")}  # noqa: E731
        assert depth("rotsym") == depth("mergekit")
    if "tokenizer_source" in CONFIGS[name]:
        vocab = lambda out: json.loads((tmp_path / out / "tokenizer.json").read_text())["model"]["vocab"]  # noqa: E731
        assert vocab("rotsym") == vocab("mergekit")


# ---- vocabularies that differ, against mergekit (slow) -----------------------------------------------------
# base: t0..t63 (WordLevel); v1 (64 rows, WordLevel): a0..a4 first, then the shared tokens reversed, t20..t24
# missing; v2 (60 rows, BPE): b0, b1, a0, then the shared tokens in order, t30..t36 missing.
V1_TOKENS = SPECIAL + [f"a{i}" for i in range(5)] + [f"t{i}" for i in range(63, 3, -1) if not 20 <= i <= 24]
V2_TOKENS = SPECIAL + ["b0", "b1", "a0"] + [f"t{i}" for i in range(4, 64) if not 30 <= i <= 36]


@pytest.fixture(scope="module")
def hf_vocab_models(tmp_path_factory):
    """transformers-written Llamas whose tokenizers differ: a base, v1 near it, v2 of its own size (60 rows, a BPE vocabulary)."""
    torch = pytest.importorskip("torch")
    import tokenizers
    import transformers

    root = tmp_path_factory.mktemp("mergekit-vocab")
    llama = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 tie_word_embeddings=False, max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=64, **llama))
    out = {"base": root / "base", "v1": root / "v1", "v2": root / "v2"}
    base.save_pretrained(out["base"])
    _save_tokenizer(out["base"], [f"t{i}" for i in range(64)])
    torch.manual_seed(1)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.02 * torch.randn_like(p))
    base.save_pretrained(out["v1"])
    _save_tokenizer(out["v1"], V1_TOKENS)
    torch.manual_seed(2)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=60, **llama)).save_pretrained(out["v2"])
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE({t: i for i, t in enumerate(V2_TOKENS)}, [], unk_token="t0"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="t0", pad_token="t1", bos_token="t2",
                                         eos_token="t3").save_pretrained(out["v2"])
    for name, rows, source in (("w1", 64, "v1"), ("w2", 60, "v2")):  # tied LM heads: no lm_head tensor in the file
        torch.manual_seed(rows)
        out[name] = root / name
        transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=rows, **{**llama, "tie_word_embeddings": True})).save_pretrained(out[name])
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (out[name] / f).write_bytes((out[source] / f).read_bytes())
    return {k: str(v) for k, v in out.items()}


# mergekit orders the tokens a donor lacks by a hash (of its set of models, of each vocabulary): the
# comparison matches rows by token string
VOCAB_CONFIGS = {
    "union_task_arithmetic": {"models": [_m("v1", weight=0.6), _m("v2", weight=0.5)], "base_model": "base", "merge_method": "task_arithmetic",
                              "parameters": {"lambda": 0.9}, "dtype": "float32", "tokenizer_source": "union"},
    "union_linear_no_base": {"models": [_m("v1", weight=0.3), _m("v2", weight=0.7)], "merge_method": "linear", "dtype": "float32",
                             "tokenizer_source": "union"},
    "union_ties": {"models": [_m("v1", weight=0.6, density=0.5), _m("v2", weight=0.4, density=0.7)], "base_model": "base",
                   "merge_method": "ties", "dtype": "float32", "tokenizer": {"source": "union"}},
    "union_slerp": {"models": [_m("base"), _m("v2")], "base_model": "base", "merge_method": "slerp", "parameters": {"t": 0.3},
                    "dtype": "float32", "tokenizer_source": "union"},
    "tokens_base": {"models": [_m("v1", weight=1.0), _m("v2", weight=0.5)], "base_model": "base", "merge_method": "task_arithmetic",
                    "dtype": "float32", "tokenizer": {"source": "base", "tokens": {
                        "new": {"source": {"kind": "zero"}}, "a0": {"source": "v2"},
                        "t5": {"source": {"kind": "model_token", "model": "v1", "token": "a3"}, "force": True},
                        "t30": {"source": {"kind": "model_token", "model": "v2", "token_id": 7}}}}},
    "model_padded": {"models": [_m("v1", weight=0.5), _m("v2", weight=0.5)], "merge_method": "linear", "dtype": "float32",
                     "tokenizer": {"source": "v2", "pad_to_multiple_of": 16}},
    # the embeddings from the first slice's sources (the base alone: zeros for the tokens it lacks), the head from the last's
    "union_slices": {"slices": [_s(("base", 0, 2)), _s(("v2", 1, 2))], "merge_method": "passthrough", "dtype": "float32",
                     "base_model": "base", "tokenizer_source": "union"},
    "union_tied": {"models": [_m("w1", weight=0.4), _m("w2", weight=0.6)], "merge_method": "linear", "dtype": "float32",
                   "tokenizer_source": "union"},
    # a tied head beside an untied one: its head is its embedding, mapped as the other's head is
    "union_tied_beside_untied": {"models": [_m("v1", weight=0.4), _m("w2", weight=0.6)], "merge_method": "linear", "dtype": "float32",
                                 "tokenizer_source": "union"},
}


def _assert_same_rows_by_token(mergekit_out: Path, rotsym_out: Path) -> None:
    """One vocabulary (as sets of tokens) and config vocab_size; every tensor mergekit's within
    float32 rounding, the token-indexed ones row by row of each token (the padding rows as they are)."""
    import transformers

    theirs, ours = (transformers.AutoTokenizer.from_pretrained(p, local_files_only=True).get_vocab() for p in (mergekit_out, rotsym_out))
    assert theirs.keys() == ours.keys()
    size = lambda out: json.loads((out / "config.json").read_text())["vocab_size"]  # noqa: E731
    assert size(rotsym_out) == size(mergekit_out)
    order = np.array([theirs[t] for t in sorted(ours, key=ours.__getitem__)])
    want, got = float_tensors(mergekit_out), float_tensors(rotsym_out)
    assert want.keys() == got.keys()
    for name, x in want.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            x = np.concatenate([x[order], x[len(order):]])
        assert got[name].shape == x.shape, name
        np.testing.assert_allclose(got[name], x, rtol=0, atol=1e-6 * max(1.0, float(np.abs(x).max())), err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VOCAB_CONFIGS))
def test_a_merge_over_differing_vocabularies_gives_mergekits_tensors(name, hf_vocab_models, tmp_path):
    _merged_by_both(VOCAB_CONFIGS[name], hf_vocab_models, tmp_path)
    _assert_same_rows_by_token(tmp_path / "mergekit", tmp_path / "rotsym")


# ---- the families with records since issue 73, against mergekit (slow) ------------------------------------
# A mergekit config on these goes through the family's record (before, several were merged as plain
# tensors). Three checkpoints each, transformers-written at toy sizes, seeded; mergekit reads them through
# its architecture file where it has one (T5, StarCoder2, Granite, Granite-4's hybrid, Llama 4), BART's and mBART's from the names.

_ENCODER_DECODER = dict(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=48, decoder_ffn_dim=48, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
_DECODER = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2)


def _t5(t, **kw):
    return t.T5ForConditionalGeneration(t.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
                                                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                                   decoder_start_token_id=0, **kw))


FAMILIES = {  # name: the model, from the transformers module
    # v1.1 / Flan-T5's gated-GELU MLP (wi_0, wi_1); transformers 5 ties the LM head always and writes none
    "t5": lambda t: _t5(t, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "t5_relu": lambda t: _t5(t),  # v1.0: ReLU's wi, the LM head tied and scaled
    "bart": lambda t: t.BartForConditionalGeneration(t.BartConfig(max_position_embeddings=32, **_ENCODER_DECODER)),
    "mbart": lambda t: t.MBartForConditionalGeneration(t.MBartConfig(max_position_embeddings=32, **_ENCODER_DECODER)),
    "whisper": lambda t: t.WhisperForConditionalGeneration(t.WhisperConfig(num_mel_bins=8, max_source_positions=8, max_target_positions=32,
                                                                           suppress_tokens=[], begin_suppress_tokens=[], **_ENCODER_DECODER)),
    "starcoder2": lambda t: t.Starcoder2ForCausalLM(t.Starcoder2Config(**_DECODER)),  # biases, the LM head tied
    "cohere": lambda t: t.CohereForCausalLM(t.CohereConfig(**_DECODER)),  # Command R: no QK norm, the LM head tied
    "granite": lambda t: t.GraniteForCausalLM(t.GraniteConfig(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                                              logits_scaling=4.0, **_DECODER)),  # its own LM head
    # Granite-4's hybrid: a Mamba-2 mixer, then attention, each with the shared MLP beside 4 experts (IBM's tensor names)
    "granitemoehybrid": lambda t: t.GraniteMoeHybridForCausalLM(t.GraniteMoeHybridConfig(
        **_DECODER, shared_intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, layer_types=["mamba", "attention"], mamba_n_heads=4,
        mamba_d_state=4, mamba_d_conv=3, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0)),
    # a dense layer, then a mixture of 4 experts (stored one tensor each) with a shared expert; gated attention
    "afmoe": lambda t: t.AfmoeForCausalLM(t.AfmoeConfig(head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                                        num_shared_experts=1, num_dense_layers=1, global_attn_every_n_layers=2,
                                                        sliding_window=4, **_DECODER)),
    # Llama 4 whole (mergekit's llama4 is Llama4ForConditionalGeneration): a dense and a MoE layer, the vision model beside
    "llama4": lambda t: t.Llama4ForConditionalGeneration(t.Llama4Config(
        text_config=dict(_DECODER, head_dim=8, intermediate_size=16, intermediate_size_mlp=48, num_local_experts=4, interleave_moe_layer_step=2),
        vision_config=dict(hidden_size=16, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=2,
                           vision_output_dim=20, projector_input_dim=20, projector_output_dim=20))),
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """family -> {"<family>1".."<family>3": folder}: written on a test's first use of the family."""
    torch = pytest.importorskip("torch")
    import transformers

    root, made = tmp_path_factory.mktemp("mergekit-families"), {}

    def models(family: str) -> dict[str, str]:
        if family not in made:
            made[family] = {}
            for i in (1, 2, 3):
                torch.manual_seed(40 + i)
                folder = root / f"{family}{i}"
                FAMILIES[family](transformers).save_pretrained(folder)
                made[family][f"{family}{i}"] = str(folder)
        return made[family]

    return models


def _family_linear(f):  # a gradient over each stack's layers
    return {"models": [_m(f"{f}1", weight=[1.0, 0.2]), _m(f"{f}2", weight=0.7)], "merge_method": "linear", "dtype": "float32"}


def _family_ties(f):
    return {"models": [_m(f"{f}2", weight=0.6, density=[1, 0.3]), _m(f"{f}3", weight=0.4, density=0.5)], "base_model": f"{f}1",
            "merge_method": "ties", "dtype": "float32"}


def _family_slerp(f):
    return {"models": [_m(f"{f}1"), _m(f"{f}2")], "base_model": f"{f}1", "merge_method": "slerp", "dtype": "float32",
            "parameters": {"t": [{"filter": "attn", "value": [0, 1]}, {"value": 0.3}]}}


FAMILY_CONFIGS = {
    "linear_t5": _family_linear("t5"), "ties_t5": _family_ties("t5"),
    "linear_bart": _family_linear("bart"), "slerp_bart": _family_slerp("bart"),
    "linear_mbart": _family_linear("mbart"), "ties_mbart": _family_ties("mbart"),
    "linear_starcoder2": _family_linear("starcoder2"), "slerp_starcoder2": _family_slerp("starcoder2"),
    "linear_granite": _family_linear("granite"), "ties_granite": _family_ties("granite"),
    "linear_granitemoehybrid": _family_linear("granitemoehybrid"), "ties_granitemoehybrid": _family_ties("granitemoehybrid"),
    "linear_afmoe": _family_linear("afmoe"), "ties_afmoe": _family_ties("afmoe"),
    "linear_llama4": _family_linear("llama4"), "ties_llama4": _family_ties("llama4"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_a_mergekit_config_on_a_recorded_family_gives_mergekits_tensors(name, family_models, tmp_path):
    config = _config(tmp_path, _with_paths(FAMILY_CONFIGS[name], family_models(name.split("_", 1)[1])))
    _mergekit(config, tmp_path / "mergekit")
    assert cli.main(["merge", str(config), str(tmp_path / "rotsym"), "--quiet"]) == 0
    _assert_mergekits_tensors(tmp_path / "mergekit", tmp_path / "rotsym")


# Families of ours that mergekit 0.1.5 refuses, by what it says: its architecture file names tensors
# these checkpoints do not have. Here rotsym's merge is checked against the formulas instead.
MERGEKIT_REFUSES = {
    "t5_relu": "DenseReluDense.wi_0.weight required but not present",  # t5.json knows the gated MLP only (v1.1), not v1.0's wi
    "whisper": "model.decoderembed_tokens.weight required but not present",  # whisper.json's decoder prefix lacks its dot
    "cohere": "self_attn.q_norm.weight required but not present",  # cohere.json requires use_qk_norm's tensors
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MERGEKIT_REFUSES))
def test_a_family_mergekit_refuses_merges_by_the_formulas(family, family_models, tmp_path):
    paths = family_models(family)
    xs = [float_tensors(paths[f"{family}{i}"]) for i in (1, 2, 3)]
    stored = checkpoint_tensors(paths[f"{family}1"])
    linear = {"models": [_m(f"{family}1", weight=0.3), _m(f"{family}2", weight=0.9)], "merge_method": "linear", "dtype": "float32"}
    ties = {"models": [_m(f"{family}2", weight=0.6, density=0.5), _m(f"{family}3", weight=0.4, density=0.7)], "base_model": f"{family}1",
            "merge_method": "ties", "dtype": "float32"}
    run = _run_mergekit(_config(tmp_path, _with_paths(linear, paths)), tmp_path / "mergekit")
    assert run.returncode != 0 and MERGEKIT_REFUSES[family] in run.stderr, run.stderr[-3000:]
    for method, raw in (("linear", linear), ("ties", ties)):
        (tmp_path / method).mkdir()
        out = tmp_path / method / "out"
        assert cli.main(["merge", str(_config(tmp_path / method, _with_paths(raw, paths))), str(out), "--quiet"]) == 0
        written = checkpoint_tensors(out)
        assert written.keys() == stored.keys()  # no tied tensor dropped or added
        for tensor, x in float_tensors(out).items():
            assert written[tensor][:2] == stored[tensor][:2], tensor  # dtype and shape
            base, a, b = (m[tensor].astype(np.float64) for m in xs)
            if method == "linear":  # normalize: the weights' sum divides
                want = (0.3 * base + 0.9 * a) / 1.2
            else:
                want = _ties_by_hand(base, [a, b], [0.6, 0.4], [0.5, 0.7])
            np.testing.assert_allclose(x, want, rtol=0, atol=1e-6 * max(1.0, float(np.abs(want).max())), err_msg=f"{method}: {tensor}")


def test_the_merging_guides_mergekit_config_runs_as_written(models, tmp_path, monkeypatch):
    page = (ROOT / "docs" / "guides" / "merging.md").read_text()
    text = page[page.index("## From mergekit"):].split("```yaml\n", 1)[1].split("```", 1)[0]
    for name, model in (("llama-math", "m1"), ("llama-code", "m2"), ("llama-base", "base")):
        (tmp_path / name).symlink_to(models[model])
    monkeypatch.chdir(tmp_path)  # paths relative to the working directory, as mergekit reads them
    (tmp_path / "ties.yml").write_text(text)
    config = mergekit.load("ties.yml")
    assert config.method.name == "ties" and config.align == "anchor" and config.base_index == 2
    merged = merge_mergekit(config, tmp_path / "merged")
    assert merged.report["result"]["alignment"]["mode"] == "anchor"
    assert set(float_tensors(tmp_path / "merged")) == set(float_tensors(models["base"]))


def test_align_many_moves_every_model_before_the_merge(models, tmp_path):
    raw = {"models": [{"model": str(models[m]), "parameters": {"weight": 1}} for m in ("m1", "m2", "m3")], "merge_method": "linear",
           "rotsym": {"align": "many"}}
    written = merge_mergekit(_config(tmp_path, raw), tmp_path / "many")
    alignment = written.report["result"]["alignment"]
    assert alignment["mode"] == "many" and alignment["objective"][-1] <= alignment["objective"][0]
    plain = merge_mergekit(_config(tmp_path, {**raw, "rotsym": {"align": "none"}}), tmp_path / "plain")
    assert plain.report["result"]["alignment"] == {"mode": "none"}
    many, unaligned = float_tensors(tmp_path / "many"), float_tensors(tmp_path / "plain")
    assert any(not np.array_equal(many[n], unaligned[n]) for n in many)  # the models moved (near-identical models: a little)


def test_seed_on_the_command_line_sets_the_draws_and_is_recorded(models, tmp_path, capsys):
    raw = {"models": [{"model": str(models[m]), "parameters": {"weight": 1, "density": 0.5}} for m in ("m1", "m2")],
           "base_model": str(models["base"]), "merge_method": "dare_linear", "rotsym": {"seed": 3}}
    config = str(_config(tmp_path, raw))
    for out, extra in (("block", []), ("flag", ["--seed", "3"]), ("other", ["--seed", "4"])):
        assert cli.main(["merge", config, str(tmp_path / out), "--quiet", *extra]) == 0
    block, flag, other = (float_tensors(tmp_path / o) for o in ("block", "flag", "other"))
    assert all(np.array_equal(block[n], flag[n]) for n in block) and not all(np.array_equal(block[n], other[n]) for n in block)
    assert json.loads((tmp_path / "other" / "rotsym_report.json").read_text())["options"]["seed"] == 4
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"models": [str(models["m1"]), str(models["m2"])], "method": "average"}))
    assert "--seed: a recipe names" in _usage_error(capsys, ["merge", str(recipe), str(tmp_path / "r"), "--seed", "1"])
    assert "is a config, which names its method itself" in _usage_error(capsys, ["merge", "--method", "ties", config, str(tmp_path / "t")])


def test_a_mergekit_config_without_merge_method_is_named_so(models, tmp_path, capsys):
    raw = {"models": [{"model": str(models["m1"]), "parameters": {"weight": 1}}, {"model": str(models["m2"])}], "merge_methd": "linear"}
    err = _usage_error(capsys, ["merge", str(_config(tmp_path, raw)), str(tmp_path / "out")])
    assert "without its merge_method key; 'merge_methd' at line" in err


def test_a_misspelled_parameter_is_ignored_as_mergekit_does_and_the_note_names_the_likely_one(models, tmp_path):
    raw = {"models": [{"model": str(models["m1"]), "parameters": {"weight": 0.5, "desnity": 0.2}}], "merge_method": "ties",
           "base_model": str(models["base"]), "parameters": {"normalise": True}}
    notes = mergekit.load(_config(tmp_path, raw)).notes
    assert any("'desnity' is not a parameter of ties" in n and "did you mean 'density'?" in n for n in notes), notes
    assert any("'normalise'" in n and "did you mean 'normalize'?" in n for n in notes), notes


def test_alignment_options_without_an_alignment_are_refused_not_ignored(models, tmp_path, capsys):
    """A merge that aligns nothing takes no alignment option: --residual, --heads or a rotsym: block's
    align_options with align none wrote the unaligned merge, silently."""
    ties = {"models": [{"model": str(models["m1"]), "parameters": {"weight": 0.5, "density": 0.5}}], "merge_method": "ties",
            "base_model": str(models["base"]), "dtype": "float32"}
    config = str(_config(tmp_path, ties))
    err = _usage_error(capsys, ["merge", config, str(tmp_path / "a"), "--residual", "rotation", "--heads", "permute"])
    assert "alignment options ['heads', 'residual'] given, but this merge aligns nothing" in err
    (tmp_path / "block").mkdir()
    block = _config(tmp_path / "block", {**ties, "rotsym": {"align": "none", "align_options": {"residual": "rotation"}}})
    assert "alignment options ['residual'] given" in _usage_error(capsys, ["merge", str(block), str(tmp_path / "b")])
    pair = [str(models["m1"]), str(models["m2"])]
    err = _usage_error(capsys, ["merge", "--method", "average", *pair, str(tmp_path / "c"), "--align", "none", "--ffn", "none"])
    assert "--ffn: alignment options, but this merge aligns nothing (--align none)" in err
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(yaml.safe_dump({"models": pair, "method": "average", "align": "none", "align_options": {"heads": "permute"}}))
    assert "with align: none, which aligns nothing" in _usage_error(capsys, ["merge", str(recipe), str(tmp_path / "d")])
    recipe.write_text(yaml.safe_dump({"models": pair, "method": "average"}))
    assert "--residual: a recipe names its alignment options itself" in _usage_error(capsys, ["merge", str(recipe), str(tmp_path / "e"),
                                                                                          "--residual", "rotation"])
    assert not any((tmp_path / name).exists() for name in "abcde")


def test_alignment_from_data_without_data_names_the_rotsym_blocks_data_section(models, tmp_path, capsys):
    raw = {"models": [{"model": str(models["m1"]), "parameters": {"weight": 0.5}}, {"model": str(models["m2"]), "parameters": {"weight": 0.5}}],
           "merge_method": "linear", "rotsym": {"align": "anchor", "align_options": {"method": "activations"}}}
    err = _usage_error(capsys, ["merge", str(_config(tmp_path, raw)), str(tmp_path / "out")])
    assert "align_options.method 'activations' runs the models on data: give the rotsym: block a data section" in err


def test_alignment_flags_add_to_the_rotsym_blocks_options(models, tmp_path):
    """--heads permute over a block's residual: rotation keeps the rotation (a flag left at its
    default resets nothing)."""
    raw = {"models": [{"model": str(models["m1"]), "parameters": {"weight": 0.5}}, {"model": str(models["m2"]), "parameters": {"weight": 0.5}}],
           "merge_method": "linear", "dtype": "float32", "rotsym": {"align": "anchor", "align_options": {"residual": "rotation"}}}
    assert cli.main(["merge", str(_config(tmp_path, raw)), str(tmp_path / "out"), "--heads", "permute", "--quiet"]) == 0
    options = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())["options"]["align_options"]
    assert options["residual"] == "rotation" and options["heads"] == "permute"


def test_the_align_flag_wins_over_the_rotsym_block_both_ways(models, tmp_path, capsys):
    """--align none over a block that aligns merges unaligned (as without the block), saying that
    the block's options go unused; --align anchor over a block's align: none aligns. Alignment flags
    with --align none are still refused, naming the flag."""
    pair = [{"model": str(models[m]), "parameters": {"weight": 0.5}} for m in ("m1", "m2")]
    plain = {"models": pair, "merge_method": "linear", "dtype": "float32"}
    assert cli.main(["merge", str(_config(tmp_path, plain)), str(tmp_path / "plain"), "--quiet"]) == 0
    (tmp_path / "block").mkdir()
    block = _config(tmp_path / "block", {**plain, "rotsym": {"align": "anchor", "align_options": {"residual": "rotation"}}})
    capsys.readouterr()
    assert cli.main(["merge", str(block), str(tmp_path / "none"), "--align", "none"]) == 0
    assert f"note: --align none over {block}'s rotsym: block (align: anchor): its align_options are unused" in capsys.readouterr().err
    assert checkpoint_tensors(tmp_path / "none") == checkpoint_tensors(tmp_path / "plain")
    assert json.loads((tmp_path / "none" / "rotsym_report.json").read_text())["options"]["align"] == "none"
    err = _usage_error(capsys, ["merge", str(block), str(tmp_path / "flags"), "--align", "none", "--heads", "permute"])
    assert "alignment options ['heads'] given, but this merge aligns nothing (--align none)" in err
    (tmp_path / "off").mkdir()
    off = _config(tmp_path / "off", {**plain, "rotsym": {"align": "none"}})
    assert cli.main(["merge", str(off), str(tmp_path / "anchor"), "--align", "anchor", "--quiet"]) == 0
    assert json.loads((tmp_path / "anchor" / "rotsym_report.json").read_text())["result"]["alignment"]["mode"] == "anchor"
    assert not (tmp_path / "flags").exists()
    # the config each output keeps replays its run, not the file's block
    assert yaml.safe_load((tmp_path / "none" / "mergekit_config.yml").read_text())["rotsym"] == {"align": "none"}
    assert yaml.safe_load((tmp_path / "anchor" / "mergekit_config.yml").read_text())["rotsym"] == {"align": "anchor"}
    assert "align: anchor" in (tmp_path / "anchor" / "README.md").read_text()
    assert (tmp_path / "plain" / "mergekit_config.yml").read_text() == (tmp_path / "config.yml").read_text()  # not overridden: as it was


# ---- convert-config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [
    {"method": "average", "weights": [1, 3]},  # the anchor's head kept: a filter gives it the whole weight there
    {"method": "task_arithmetic", "params": {"lam": 0.5}, "base": "BASE", "task_head": "merge", "dtype": "bfloat16"},
    {"method": "task_arithmetic", "params": {"lam": 0.5}, "base": "BASE"},
    # aligned onto the first model, the base folded and not moved, in both
    {"method": "task_arithmetic", "params": {"lam": 0.5}, "base": "BASE", "align": "anchor", "align_options": {"heads": "permute"}},
])
def test_a_recipe_converts_to_a_mergekit_config_that_merges_the_same(recipe, models, tmp_path, capsys):
    raw = {"models": [str(models["m1"]), str(models["m2"])], "align": "none", **recipe}
    m2 = hf.save_hf(rj.load_hf(models["m2"]), _permuted(models["m2"]), tmp_path / "m2-permuted") if "align_options" in recipe else None
    raw["models"][1] = str(m2 or models["m2"])
    raw["base"] = str(models["base"]) if "base" in raw else None
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({k: v for k, v in raw.items() if v is not None}))
    assert cli.main(["convert-config", str(tmp_path / "recipe.yaml"), str(tmp_path / "mk.yml")]) == 0
    assert mergekit.is_mergekit(tmp_path / "mk.yml")
    assert cli.main(["merge", str(tmp_path / "recipe.yaml"), str(tmp_path / "by-recipe"), "--quiet"]) == 0
    assert cli.main(["merge", str(tmp_path / "mk.yml"), str(tmp_path / "by-mergekit"), "--quiet"]) == 0
    want, got = float_tensors(tmp_path / "by-recipe"), float_tensors(tmp_path / "by-mergekit")
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-2 if recipe.get("dtype") else 1e-6, err_msg=name)


def _permuted(folder):
    """The checkpoint's params with its FFN units and heads permuted (the same function)."""
    ck = rj.load_hf(folder)
    spec = rj.spec_for(ck)
    return rj.apply_transform(spec, ck.params, rj.random_transform(spec, ck.params, jax.random.key(5), ("perm",)))


def test_a_mergekit_config_converts_to_a_recipe_where_rotsym_says_the_same(models, tmp_path, capsys):
    raw = {"models": [{"model": str(models["m1"]), "parameters": {"weight": 0.5}}, {"model": str(models["m2"]), "parameters": {"weight": 0.5}},
                      {"model": str(models["base"])}],
           "base_model": str(models["base"]), "merge_method": "task_arithmetic", "parameters": {"lambda": 0.8, "normalize": True},
           "rotsym": {"align": "anchor", "align_options": {"heads": "permute"}}}
    assert "aligns onto its base_model" in _usage_error(capsys, ["convert-config", str(_config(tmp_path, raw)), str(tmp_path / "r.yaml")])
    raw["rotsym"]["anchor"] = str(models["m2"])  # a recipe aligns onto its first model: the anchor goes first
    assert cli.main(["convert-config", str(_config(tmp_path, raw)), str(tmp_path / "recipe.yaml")]) == 0
    recipe = rj.recipe.load(tmp_path / "recipe.yaml")
    assert (recipe.method, recipe.params, recipe.task_head, recipe.align) == ("task_arithmetic", {"lam": 0.4}, "merge", "anchor")
    assert recipe.models == (str(models["m2"]), str(models["m1"]))
    raw.pop("rotsym")
    raw["parameters"]["normalize"] = False
    config = _config(tmp_path, raw)
    assert cli.main(["convert-config", str(config), str(tmp_path / "plain.yaml"), "--overwrite"]) == 0
    assert cli.main(["merge", str(config), str(tmp_path / "by-mergekit"), "--quiet"]) == 0
    assert cli.main(["merge", str(tmp_path / "plain.yaml"), str(tmp_path / "by-recipe"), "--quiet"]) == 0
    want, got = float_tensors(tmp_path / "by-mergekit"), float_tensors(tmp_path / "by-recipe")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("source, message", [
    ({"models": ["M1", "M2"], "method": "ties", "base": "BASE"}, "rotsym's ties keeps ceil(density * n)"),
    ({"models": ["M1", "M2"], "method": "slerp"}, "mergekit's is linear below about 1.8 degrees"),
    ({"models": [{"model": "M1", "parameters": {"weight": 1}}, {"model": "M2", "parameters": {"weight": 1}}], "merge_method": "linear",
      "parameters": {"normalize": False}}, "rotsym's average normalizes"),
    ({"models": [{"model": "M1", "parameters": {"weight": [0, 1]}}, {"model": "M2", "parameters": {"weight": 1}}], "merge_method": "linear"},
     "a filter or a gradient"),
    ({"models": [{"model": "M1", "parameters": {"weight": 1}}, {"model": "M2", "parameters": {"weight": 1}}], "base_model": "BASE",
      "merge_method": "ties"}, "mergekit's ties has no rotsym recipe equivalent"),
])
def test_what_one_format_cannot_say_is_refused(source, message, models, tmp_path, capsys):
    text = yaml.safe_dump(source).replace("M1", str(models["m1"])).replace("M2", str(models["m2"])).replace("BASE", str(models["base"]))
    (tmp_path / "in.yaml").write_text(text)
    assert message in _usage_error(capsys, ["convert-config", str(tmp_path / "in.yaml"), str(tmp_path / "out.yaml")])
    assert not (tmp_path / "out.yaml").exists()


def test_the_rotsym_block_aligns_from_data(models, tmp_path):
    """align_options.method: activations on the block's data: a copy of the base with its FFN units
    permuted (the same function) is matched back by its activations, so the linear average is the base."""
    ck = rj.load_hf(models["base"])
    spec = rj.spec_for(ck)
    planted = hf.save_hf(ck, rj.apply_transform(spec, ck.params, rj.random_transform(spec, ck.params, jax.random.key(3), ("perm",))),
                         tmp_path / "planted")
    ids = np.random.default_rng(0).integers(0, LLAMA["vocab_size"], size=(16, 8)).astype(np.int32)
    np.savez(tmp_path / "data.npz", input_ids=ids)
    raw = {"models": [{"model": str(models["base"]), "parameters": {"weight": 1}}, {"model": str(planted), "parameters": {"weight": 1}}],
           "merge_method": "linear", "rotsym": {"align": "anchor", "align_options": {"method": "activations", "residual": "none"},  # by default the stream rotates
                      "data": {"file": "data.npz"}}}
    written = merge_mergekit(_config(tmp_path, raw), tmp_path / "merged")
    assert written.report["options"]["align_options"]["method"] == "activations"
    want, got = float_tensors(models["base"]), float_tensors(tmp_path / "merged")
    assert max(np.abs(float_tensors(planted)[n] - want[n]).max() for n in want) > 0.1  # the plant moved the weights
    for n, x in want.items():
        np.testing.assert_allclose(got[n], x, atol=1e-5, err_msg=n)


def test_an_aligned_mergekit_config_gives_the_alignment_notes_merge_gives(tmp_path, capsys):
    """A mergekit config aligned with --residual rotation, of models without a task head, says what
    `rotsym merge` says of them (`notes.note_alignment`: the last hidden state in the aligned basis,
    the folded frame of the distances); it said neither."""
    bare = [save_random(LLAMA, None, seed, tmp_path / f"bare{seed}") for seed in (0, 1)]
    flags = ["--align", "anchor", "--residual", "rotation", "--dry-run"]
    assert cli.main(["merge", "--method", "average", *map(str, bare), str(tmp_path / "out"), *flags]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    config = _config(tmp_path, {"models": [{"model": str(m), "parameters": {"weight": 1}} for m in bare], "merge_method": "linear"})
    assert cli.main(["merge", str(config), str(tmp_path / "out"), *flags]) == 0
    err = capsys.readouterr().err
    assert len(said) == 2 and "have no task head, so with --residual the last hidden state" in said[0] and "folds every" in said[1], said
    names = ", ".join(f"model {i} ({m})" for i, m in enumerate(bare))  # the config's models named with their paths
    assert said[0].replace("model 0, model 1", names) in err and said[1] in err, err
