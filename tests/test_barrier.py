"""Loss landscapes: interpolation end points, barriers (MATH.md §7) with and without alignment,
and 2-D planes that reproduce their three points; barrier and plane also against closed-form
losses whose curve and grid are written out by hand."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import rotsym_jax as rj
from rotsym_experiments import digits
from rotsym_jax import barrier
from rotsym_jax.transforms import KINDS

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


@pytest.mark.slow  # 16 s; the default run keeps to its time budget
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


def test_plane_of_a_planted_pair_says_why_it_is_a_line_and_what_to_pass(trained):
    """The first-hour tutorial's pair: B is A moved by a symmetry, so B aligned is A again and the
    three points lie on one line. The refusal says which point sits where, and what to pass instead."""
    ck, params, loss_fn = trained
    spec = rj.spec_for(ck)
    moved = rj.apply_transform(spec, params, rj.random_transform(spec, params, jax.random.key(7), KINDS))
    aligned = rj.align(params, moved, spec, heads="permute", rescale="joint").params
    with pytest.raises(ValueError, match=r"lie on one line.*params_2 equals params_0 \(e\.g\. B aligned is A itself.*"
                                         r"a point off that line.*barrier\.interpolate\(loss_fn, params_0, params_1"):
        barrier.plane(loss_fn, params, moved, aligned)
    p0 = np.array([0.5, -1.0, 0.25, 1.5, -0.75, 1.0, 0.125])
    a, b, mid = (_vec_to_params(v) for v in (p0, p0 + 2 * E1, p0 + E1 / 2))
    with pytest.raises(ValueError, match=r"lie on one line.*params_2 equals params_1\."):
        barrier.plane(_plane_loss, a, b, b)
    with pytest.raises(ValueError, match=r"lie on one line.*params_2 = params_0 \+ 0\.25 \(params_1 - params_0\)"):
        barrier.plane(_plane_loss, a, b, mid)


# ---- closed forms: losses whose curve and plane are known exactly -----------------------------------

# Along the path from POLY_A to POLY_B, x = u[0] = alpha and y = v[0, 0] = 1 - alpha, so
# L(alpha) = 1 + 3 alpha + 8 alpha^2 (1 - alpha): L(0) = 1, L(1) = 4, the straight line between
# them 1 + 3 alpha, the excess over it 8 alpha^2 (1 - alpha), largest at alpha = 2/3 (32/27).
POLY_A = {"u": np.array([0.0, 5.0], np.float32), "v": np.array([[1.0]], np.float32)}
POLY_B = {"u": np.array([1.0, -5.0], np.float32), "v": np.array([[0.0]], np.float32)}


def _poly_loss(p):
    x, y = p["u"][0], p["v"][0, 0]
    return {"loss": 1 + 3 * x + 8 * x**2 * y, "x": x}


def test_barrier_closed_form_with_unequal_end_points():
    alphas = np.linspace(0, 1, 11)
    loss = 1 + 3 * alphas + 8 * alphas**2 * (1 - alphas)
    excess = 8 * alphas**2 * (1 - alphas)  # [0, .072, .256, .504, .768, 1, 1.152, 1.176, 1.024, .648, 0]
    result = barrier.loss_barrier(_poly_loss, POLY_A, POLY_B, chunk=4)  # 3 chunks, the last padded
    curve = result["curve"]
    np.testing.assert_allclose(curve["alpha"], alphas, atol=1e-7)
    np.testing.assert_allclose(curve["x"], alphas, atol=1e-6)
    np.testing.assert_allclose(curve["loss"], loss, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(curve["excess"], excess, atol=1e-5)
    # On the grid: alpha 0.7 (excess 8 * 0.49 * 0.3), not where the loss peaks (alpha 0.8).
    assert result["alpha_max"] == pytest.approx(0.7, abs=1e-9)
    assert result["barrier"] == pytest.approx(1.176, abs=1e-5)
    # Reversed: L(0) = 4 > L(1) = 1, the same excess mirrored, its maximum at 1 - 0.7.
    rev = barrier.loss_barrier(_poly_loss, POLY_B, POLY_A)
    np.testing.assert_allclose(rev["curve"]["loss"], loss[::-1], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rev["curve"]["excess"], excess[::-1], atol=1e-5)
    assert rev["alpha_max"] == pytest.approx(0.3, abs=1e-9)
    assert rev["barrier"] == pytest.approx(1.176, abs=1e-5)
    # Given alphas (without 0 and 1, which are added): the true maximum 32/27 at alpha = 2/3.
    result = barrier.loss_barrier(_poly_loss, POLY_A, POLY_B, [0.9, 2 / 3, 0.25])
    np.testing.assert_allclose(result["curve"]["alpha"], [0, 0.25, 2 / 3, 0.9, 1], atol=1e-7)
    np.testing.assert_allclose(result["curve"]["excess"], [0, 8 * 0.25**2 * 0.75, 32 / 27, 8 * 0.81 * 0.1, 0], atol=1e-5)
    assert result["alpha_max"] == pytest.approx(2 / 3, abs=1e-7)
    assert result["barrier"] == pytest.approx(32 / 27, abs=1e-5)


# Plane: an orthonormal pair E1, E2 spread over two leaves ("w" (2, 2), then "b" (3,), the
# flattening order of the leaves), params_1 = params_0 + 2 E1, params_2 = params_0 + 0.5 E1 + 1.5 E2:
# the plane's coordinates are (0, 0), (2, 0), (0.5, 1.5), and its grid point (x, y) is
# params_0 + x E1 + y E2. Dyadic values: every point is exact in float32.
E1 = np.array([1, 1, 0, 0, 1, 1, 0]) / 2
E2 = np.array([1, -1, 0, 0, -1, 1, 0]) / 2
PLANE_C = np.array([1.0, 2.0, 3.0, 0.5])  # weights of w**2
PLANE_D = np.array([0.25, -1.0, 2.0])  # weights of b**3


def _vec_to_params(vec):
    vec = np.asarray(vec, np.float32)
    return {"b": vec[4:], "w": vec[:4].reshape(2, 2)}


def _plane_loss(p):
    w, b = p["w"].ravel(), p["b"]
    return {"loss": jnp.sum(PLANE_C * w**2) + jnp.sum(PLANE_D * b**3), "wsum": jnp.sum(w)}


def _plane_loss_np(vec):
    vec = np.asarray(vec, np.float64)
    return float(np.sum(PLANE_C * vec[:4] ** 2) + np.sum(PLANE_D * vec[4:] ** 3)), float(np.sum(vec[:4]))


def test_plane_closed_form_grid_and_all_three_points():
    assert abs(E1 @ E2) == 0 and E1 @ E1 == 1 and E2 @ E2 == 1
    p0 = np.array([0.5, -1.0, 0.25, 1.5, -0.75, 1.0, 0.125])
    vecs = [p0, p0 + 2 * E1, p0 + 0.5 * E1 + 1.5 * E2]
    params = [_vec_to_params(v) for v in vecs]
    # margin 0.25: x spans [0, 2] padded by 0.5, y [0, 1.5] by 0.375; 7 points per axis put the
    # three points on grid nodes: x index 1, 5, 2; y index 1, 1, 5.
    result = barrier.plane(_plane_loss, *params, resolution=7, margin=0.25, chunk=10)
    np.testing.assert_allclose(result["points"], [[0, 0], [2, 0], [0.5, 1.5]], atol=1e-6)
    np.testing.assert_allclose(result["x"], [-0.5, 0, 0.5, 1, 1.5, 2, 2.5], atol=1e-6)
    np.testing.assert_allclose(result["y"], [-0.375, 0, 0.375, 0.75, 1.125, 1.5, 1.875], atol=1e-6)
    assert result["loss"].shape == result["wsum"].shape == (7, 7)
    # Every grid value, indexed [y, x], against the loss at params_0 + x E1 + y E2.
    expected = np.array([[_plane_loss_np(p0 + x * E1 + y * E2) for x in result["x"]] for y in result["y"]])
    np.testing.assert_allclose(result["loss"], expected[..., 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result["wsum"], expected[..., 1], rtol=1e-5, atol=1e-5)
    # The three points: the grid reproduces each model's own loss.
    for (iy, ix), vec, p in zip(((1, 1), (1, 5), (5, 2)), vecs, params):
        own = _plane_loss_np(vec)[0]
        assert float(_plane_loss(p)["loss"]) == pytest.approx(own, rel=1e-6)
        np.testing.assert_allclose(result["loss"][iy, ix], own, rtol=1e-5, atol=1e-5)
    # The three losses differ, so no point can pass for another.
    assert len({round(_plane_loss_np(v)[0], 3) for v in vecs}) == 3
