"""QK-norm (Qwen3): the exact QK group, no more and no less (MATH §9). q and k pass an RMSNorm over
each head's entries (one gain for all heads) before RoPE, so of the RoPE group only sign flips of
whole rotary pairs survive; head permutations and scales survive, VO keeps its rotations."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_invariance import model_inputs, outputs, random_model

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.engine.groups import apply_unchecked
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
    assert "QK: head permutations and rotary-pair signs only (QK-norm), VO: rotations" in capsys.readouterr().out
