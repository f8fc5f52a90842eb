"""Loss landscapes: interpolation end points, barriers (MATH.md §7) with and without alignment,
and 2-D planes that reproduce their three points."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rotsym_jax as rj
from rotsym_jax import barrier, digits
from rotsym_jax.groups import KINDS

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")

CONFIG = digits.vit_config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
SETTINGS = digits.TrainSettings(epochs=8, batch_size=32, learning_rate=3e-3)


@pytest.fixture(scope="module")
def trained():
    data = digits.load_digits()
    ck = digits.init_model(CONFIG, 0)
    params, _ = digits.train(ck, data, SETTINGS, jax.random.key(1))
    images, labels = jnp.asarray(data.test_images[:200]), jnp.asarray(data.test_labels[:200])

    def loss_fn(p):
        logits = ck.model(p)(pixel_values=images)["logits"]
        return {
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
            "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels),
        }

    return ck, params, loss_fn


def test_interpolation_end_points_are_the_models(trained):
    ck, params, loss_fn = trained
    other = digits.init_model(CONFIG, 3).params
    curve = barrier.interpolate(loss_fn, params, other, [0.0, 0.3, 1.0], chunk=2)
    for alpha, p in ((0, params), (2, other)):
        np.testing.assert_allclose(curve["loss"][alpha], float(loss_fn(p)["loss"]), rtol=1e-5)
        np.testing.assert_allclose(curve["accuracy"][alpha], float(loss_fn(p)["accuracy"]), atol=1e-6)
    mid = jax.tree_util.tree_map(lambda a, b: 0.7 * a + 0.3 * b, params, other)
    np.testing.assert_allclose(curve["loss"][1], float(loss_fn(mid)["loss"]), rtol=1e-5)


def test_barrier_of_a_model_with_itself_is_zero(trained):
    _, params, loss_fn = trained
    result = barrier.loss_barrier(loss_fn, params, params)
    assert abs(result["barrier"]) <= 1e-6 and len(result["curve"]["alpha"]) == 11


def test_barrier_with_a_planted_transform_vanishes_after_alignment(trained):
    ck, params, loss_fn = trained
    spec = rj.spec_for(ck)
    moved = rj.apply_transform(spec, params, rj.random_transform(spec, params, jax.random.key(7), KINDS))
    before = barrier.loss_barrier(loss_fn, params, moved)
    assert float(loss_fn(params)["loss"]) < 1.5  # trained (chance: ln 10 = 2.3)
    assert before["barrier"] > 0.1  # the same function, but the straight path leaves the basin
    aligned = rj.align(params, moved, spec, heads="permute", rescale="joint").params
    after = barrier.loss_barrier(loss_fn, params, aligned)
    assert abs(after["barrier"]) <= 1e-4
    d = barrier.distance(params, aligned, spec)
    assert d["total"] <= 1e-4 * barrier.distance(params, moved, spec)["total"]


def test_plane_reproduces_its_three_points(trained):
    ck, params, loss_fn = trained
    others = [digits.init_model(CONFIG, s).params for s in (3, 4)]
    losses = [float(loss_fn(p)["loss"]) for p in (params, *others)]
    # margin 0: params_0 is the grid's bottom-left corner, params_1 its bottom-right one (here
    # the projection of params_2 falls between them), params_2 lies on the top row
    for first, second, i_first in ((others[0], others[1], 1), (others[1], others[0], 2)):
        result = barrier.plane(loss_fn, params, first, second, resolution=5, margin=0.0)
        pts = result["points"]
        assert result["loss"].shape == (5, 5) and 0 < pts[2][0] < pts[1][0]
        np.testing.assert_allclose([result["x"][0], result["y"][0], result["x"][-1], result["y"][-1]], [0, 0, pts[1][0], pts[2][1]], atol=1e-5)
        np.testing.assert_allclose(result["loss"][0, 0], losses[0], rtol=1e-4)
        np.testing.assert_allclose(result["loss"][0, -1], losses[i_first], rtol=1e-4)


def test_bad_inputs(trained):
    _, params, loss_fn = trained
    with pytest.raises(ValueError, match="shape"):
        barrier.interpolate(loss_fn, params, {**params, "head": jax.tree_util.tree_map(lambda x: x[..., :1], params["head"])}, [0.5])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        barrier.loss_barrier(loss_fn, params, params, [1.5])
    with pytest.raises(ValueError, match="collinear|equal"):
        barrier.plane(loss_fn, params, params, params)
    with pytest.raises(ValueError, match="'loss'"):
        barrier.interpolate(lambda p: {"acc": loss_fn(p)["accuracy"]}, params, params, [0.5])
