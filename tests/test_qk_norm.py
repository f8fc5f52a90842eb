"""QK-norm (Qwen3): the exact QK group, no more and no less (MATH §1). q and k pass an RMSNorm over
each head's entries (one gain for all heads) before RoPE, so of the RoPE group only sign flips of
whole rotary pairs survive; head permutations survive, no scale (the norm's eps sees it), VO keeps its rotations and scales."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf
from family_cases import CASES
from parity_utils import save_reference
from test_invariance import model_inputs, outputs, random_model

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.engine.groups import apply_unchecked
from rotsym_jax.pytree import flatten, unflatten
from rotsym_jax.solvers import procrustes
from rotsym_jax.transforms import rope_rotation

NAME = "qwen3-qknorm"


def _moved_outputs(ck, params, spec, qk):
    """Outputs after acting on every block's QK by `qk` (unchecked: also elements outside the group)."""
    bound = rj.bind(spec, params)
    t = rj.identity_transform(bound)
    block = bound.attention[0]
    t[block.name] = t[block.name].replace(qk=jnp.broadcast_to(qk, t[block.name].qk.shape))
    return outputs(ck, apply_unchecked(bound, params, t), model_inputs(ck))["logits"]


def test_the_group_is_sign_flips_of_whole_rotary_pairs():
    ck, params = random_model(NAME)
    spec = rj.spec_for(ck)
    ref = outputs(ck, params, model_inputs(ck))["logits"]
    dh = rj.bind(spec, params).attention[0].geometry.head_dim
    change = lambda qk: float(np.max(np.abs(_moved_outputs(ck, params, spec, qk) - ref)) / np.max(np.abs(ref)))  # noqa: E731
    pair = np.ones(dh, np.float32)
    pair[[1, 1 + dh // 2]] = -1  # both entries of rotary pair 1
    assert change(jnp.diag(pair)) < 1e-5
    one = np.ones(dh, np.float32)
    one[1] = -1  # one entry alone: a reflection
    assert change(jnp.diag(one)) > 1e-3
    angles = jnp.zeros(dh // 2).at[1].set(0.7)  # a RoPE pair rotation, not by pi: the gain breaks it
    assert change(rope_rotation(angles, dh, dh)) > 1e-3
    assert change(rope_rotation(jnp.zeros(dh // 2).at[1].set(np.pi), dh, dh)) < 1e-5
    with pytest.raises(ValueError, match="not a QK-norm group element"):
        bound = rj.bind(spec, params)
        t = rj.identity_transform(bound)
        name = bound.attention[0].name
        t[name] = t[name].replace(qk=jnp.broadcast_to(jnp.diag(one), t[name].qk.shape))
        rj.apply_transform(spec, params, t)


@pytest.mark.parametrize("rotary", [4, 6])
def test_the_sign_solver_is_the_brute_force_optimum(rotary):
    """rope_signs maximises tr(R^T M) over every sign pattern of the group (2^(pairs + rest))."""
    rng = np.random.default_rng(rotary)
    dh = 6
    for _ in range(5):
        M = rng.normal(size=(dh, dh)).astype(np.float32)
        got = np.asarray(procrustes.rope_signs(jnp.asarray(M), rotary))
        best = -np.inf
        half = rotary // 2
        for signs in itertools.product([-1.0, 1.0], repeat=half + dh - rotary):
            d = np.concatenate([signs[:half], signs[:half], signs[half:]])
            best = max(best, float(np.sum(d * np.diag(M))))
        assert float(np.trace(got.T @ M)) == pytest.approx(best, rel=1e-6)
        assert float(procrustes.sign_score(jnp.asarray(M), rotary)) == pytest.approx(best, rel=1e-6)


def test_planted_heads_signs_and_scales_are_recovered_and_inspect_names_the_group(tmp_path, capsys):
    ck, params = random_model(NAME)
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, params, jax.random.key(7))
    b = rj.apply_transform(spec, params, t)
    result = rj.align(params, b, spec, heads="permute")
    assert float(result.report["after"]["total"]) <= 1e-5 * float(result.report["before"]["total"])
    qk = np.asarray(result.transforms[rj.bind(spec, params).attention[0].name].qk)
    assert set(np.unique(np.round(qk, 6))) <= {-1.0, 0.0, 1.0}
    folder = rj.save_hf(ck, params, tmp_path / "qwen3")
    assert cli.main(["inspect", str(folder)]) == 0
    assert "QK: head permutations and rotary-pair signs only, no scale (QK-norm), VO: rotations, scales" in capsys.readouterr().out


OLMO2 = "olmo2-post-qknorm"


def test_a_full_width_qk_norm_permutes_its_gains_with_the_heads_and_scales_them_not_the_kernels():
    """OLMo-2 normalises all heads' q at once, with a gain per entry (MATH §1): a head permutation
    keeps the function only with the gains permuted along; a QK scale per kv group is exact on the
    gains, and on the kernels it is not even approximately a symmetry (the rms spans every head)."""
    ck, params = random_model(OLMO2)
    spec = rj.spec_for(ck)
    bound = rj.bind(spec, params)
    assert bound.attention[0].geometry.qk_norm == "full" and {m.role for m in bound.attention[0].members} == {"q", "k", "v", "o", "qn", "kn"}
    inputs = model_inputs(ck)
    ref = outputs(ck, params, inputs)["logits"]
    change = lambda p: float(np.max(np.abs(outputs(ck, p, inputs)["logits"] - ref)) / np.max(np.abs(ref)))  # noqa: E731
    heads = rj.apply_transform(spec, params, rj.random_transform(spec, params, jax.random.key(1), ("heads",)))
    assert change(heads) < 1e-5
    flat, moved = flatten(params), flatten(heads)
    stale = {p: (flat[p] if "query_norm" in p or "key_norm" in p else moved[p]) for p in moved}
    assert any(not np.array_equal(flat[p], moved[p]) for p in flat if "query_norm" in p)
    assert change(unflatten(stale)) > 1e-3  # the heads moved without their gains
    scaled = rj.random_transform(spec, params, jax.random.key(2), ("qk_scale",))
    moved = flatten(rj.apply_transform(spec, params, scaled))
    assert all(np.array_equal(flat[p], moved[p]) for p in flat if "/query/" in p or "/key/" in p)  # the kernels stay
    assert change(unflatten(moved)) < 1e-5
    t = rj.identity_transform(bound)
    t["attn"] = t["attn"].replace(qk_scale=scaled["attn"].qk_scale)
    on_kernels = apply_unchecked(dataclasses.replace(bound, attention=(dataclasses.replace(
        bound.attention[0], geometry=dataclasses.replace(bound.attention[0].geometry, qk_norm="head")),)), params, t)
    assert change(on_kernels) > 1e-3


def test_a_full_width_qk_norm_block_needs_its_gains_tagged():
    ck, params = random_model(OLMO2)
    spec = rj.spec_for(ck)
    untagged = dataclasses.replace(spec, rules=tuple(r for r in spec.rules if not r[0].endswith(("query_norm/scale", "key_norm/scale"))))
    with pytest.raises(rj.SpecError, match="qk_norm='full'"):
        rj.bind(untagged, params)
    per_head = dataclasses.replace(spec, heads={"attn": dataclasses.replace(spec.heads["attn"], qk_norm="head")})
    with pytest.raises(rj.SpecError, match="belong to blocks with qk_norm='full'"):
        rj.bind(per_head, params)


@pytest.mark.slow  # test_residual.py recovers a planted OLMo-2 (rescale joint, its stream too) in the default run
def test_a_planted_olmo2_is_recovered_its_gain_scales_included(tmp_path, capsys):
    ck, params = random_model(OLMO2)
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, params, jax.random.key(7))
    b = rj.apply_transform(spec, params, t)
    for rescale in ("sequential", "joint"):
        result = rj.align(params, b, spec, heads="permute", rescale=rescale)
        assert float(result.report["after"]["total"]) <= 1e-5 * float(result.report["before"]["total"]), rescale
    assert float(rj.align(params, b, spec, heads="permute", rescale="none").report["after"]["total"]) > 1e-3  # the gains' scales remain
    folder = rj.save_hf(ck, params, tmp_path / "olmo2")
    assert cli.main(["inspect", str(folder)]) == 0
    assert "the norm's gains permuted with the heads and scaled by the QK scales (full-width QK-norm; solved on the gains)" in capsys.readouterr().out


def test_a_per_head_qk_norm_keeps_no_qk_scale():
    """The norm erases a kernel scale only up to its eps (rms(a q) = sqrt(a^2 ms(q) + eps)), and
    its one gain serves every head: a QK scale is refused, and a small one shows why."""
    ck, params = random_model(NAME)
    spec = rj.spec_for(ck)
    bound = rj.bind(spec, params)
    t = rj.identity_transform(bound)
    t["attn"] = t["attn"].replace(qk_scale=jnp.full_like(t["attn"].qk_scale, 1e-3))
    with pytest.raises(ValueError, match="under a per-head QK-norm no QK scale keeps the function"):
        rj.apply_transform(spec, params, t)
    inputs = model_inputs(ck)
    ref = outputs(ck, params, inputs)["logits"]
    moved = outputs(ck, apply_unchecked(bound, params, t), inputs)["logits"]
    assert np.max(np.abs(moved - ref)) > 1e-3 * np.max(np.abs(ref))
    assert np.all(np.asarray(rj.random_transform(spec, params, jax.random.key(0))["attn"].qk_scale) == 1)
    b = rj.apply_transform(spec, params, rj.random_transform(spec, params, jax.random.key(1)))
    assert np.all(np.asarray(rj.align(params, b, spec, rescale="joint").transforms["attn"].qk_scale) == 1)


@pytest.mark.parametrize("cls", ["ApertusForCausalLM", "Qwen3ForCausalLM", "Olmo2ForCausalLM", "Gemma2ForCausalLM",
                                 pytest.param("Llama4ForCausalLM", marks=pytest.mark.slow)])  # its conformance row plants and undoes rotations
def test_inspect_says_what_the_solver_rotates_and_scales(cls, tmp_path, capsys):
    """`rotsym inspect`'s group line and its 'solved with these options' line say what `align`
    returns: under a per-head QK-norm (Apertus, Qwen3) QK sign flips and no QK scale, V/O rotated
    and scaled; OLMo-2's QK scale on its gains; Gemma 2's RoPE rotations and scales of both;
    Llama 4's QK-norm without weights, RoPE rotations and no QK scale."""
    case = next(c for c in CASES if c.cls == cls)
    for seed in (0, 1):
        save_reference(getattr(tf, cls), case.config(), tmp_path / f"m{seed}", seed=seed)
    a, b = rj.load_hf(tmp_path / "m0"), rj.load_hf(tmp_path / "m1")
    spec = rj.spec_for(a)
    block = rj.bind(spec, a.params).attention[0]
    solved = rj.align(a.params, b.params, spec).transforms[block.name]
    assert cli.main(["inspect", str(tmp_path / "m0")]) == 0
    lines = capsys.readouterr().out.splitlines()
    group, options = next(x for x in lines if x.startswith("  attention")), next(x for x in lines if x.startswith("solved with"))
    qk_scaled, vo_scaled = (not np.allclose(np.asarray(s), 1.0) for s in (solved.qk_scale, solved.vo_scale))
    assert vo_scaled and "VO: rotations, scales" in group, group
    qk_norm = block.geometry.qk_norm
    if qk_norm in ("head", "full"):  # sign flips only: QK's entries are 0 and +-1
        assert set(np.unique(np.round(np.asarray(solved.qk), 6))) <= {-1.0, 0.0, 1.0}
        assert "Q/K sign flips of whole rotary pairs, V/O rotated (--attention)" in options, options
    if qk_norm == "head":
        assert not qk_scaled and "no scale (QK-norm)" in group and "V/O scaled (sequential, the paper's), Q/K not (QK-norm) (--rescale)" in options
    elif qk_norm == "full":
        assert qk_scaled and "scaled by the QK scales" in group and "scaled (sequential, the paper's), Q/K's on the norm's gains" in options
    elif qk_norm == "unit":  # rotations of each rotary pair (not only signs), no QK scale
        assert not set(np.unique(np.round(np.asarray(solved.qk), 6))) <= {-1.0, 0.0, 1.0}
        assert not qk_scaled and "QK: rotations of each rotary pair, no scale (QK-norm without weights)" in group, group
        assert "Q/K rotated within each rotary pair, V/O rotated (--attention), V/O scaled (sequential, the paper's), Q/K not (QK-norm)" in options
    else:
        assert qk_scaled and "rotations of each rotary pair and scales" in group, group
        assert "Q/K rotated within each rotary pair, V/O rotated (--attention), scaled (sequential, the paper's) (--rescale)" in options
