"""Loss landscapes between models: linear interpolation curves, loss barriers (MATH.md §7), 2-D
planes through three parameter points, and distances per module kind.

`loss_fn(params)` returns a scalar loss, or a dict of scalars with a "loss" entry (any other
entries, e.g. "accuracy", are metrics carried along the path). It must be jittable; it is
vmapped over a chunk of interpolation points at once (`chunk`: how many param copies fit in
memory; default: as many as fit in `MAX_CHUNK_BYTES`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..engine.distances import distance_report
from ..errors import InputError
from ..pytree import Params, check_same_leaves

# Default memory for the param copies of one vmapped chunk of interpolation points.
MAX_CHUNK_BYTES = 1 << 30


def _as_dict(value) -> dict:
    return dict(value) if isinstance(value, dict) else {"loss": value}


def _param_bytes(params: Params) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params))


def _default_chunk(params: Params, n: int) -> int:
    return max(1, min(n, MAX_CHUNK_BYTES // max(1, _param_bytes(params))))


def _evaluate(loss_fn, point, operands, coords: np.ndarray, chunk: int | None, like: Params) -> dict:
    """Evaluate `loss_fn(point(c, operands))` for every row c of `coords` (n, k), vmapped by chunks.
    The params in `operands` are arguments of the compiled function, not constants baked into it."""
    coords = np.asarray(coords, np.float32)
    chunk = chunk or _default_chunk(like, len(coords))
    if chunk < 1:
        raise InputError(f"chunk={chunk} must be >= 1")
    run = jax.jit(jax.vmap(lambda c, ops: _as_dict(loss_fn(point(c, ops))), in_axes=(0, None)))
    parts = []
    for start in range(0, len(coords), chunk):
        block = coords[start : start + chunk]
        padded = np.concatenate([block, np.repeat(block[-1:], chunk - len(block), axis=0)]) if len(block) < chunk else block
        out = run(jnp.asarray(padded), operands)  # padded to one shape: one compilation
        parts.append({k: np.asarray(v)[: len(block)] for k, v in out.items()})
    result = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    if "loss" not in result:
        raise InputError(f"loss_fn must return a scalar or a dict with a 'loss' entry, got keys {sorted(result)}")
    return result


def interpolate(loss_fn, params_a: Params, params_b: Params, alphas, *, chunk: int | None = None) -> dict:
    """Loss (and metrics) along `theta(alpha) = (1 - alpha) theta_A + alpha theta_B`.

    Returns {"alpha": (n,), "loss": (n,), metric: (n,) ...} as NumPy arrays."""
    check_same_leaves([params_a, params_b], ["params_a", "params_b"])
    alphas = np.asarray(alphas, np.float32).reshape(-1)
    if alphas.size == 0:
        raise InputError("alphas is empty")

    def point(c, ops):
        return jax.tree_util.tree_map(lambda a, b: ((1 - c[0]) * a + c[0] * b).astype(a.dtype), *ops)

    return {"alpha": alphas, **_evaluate(loss_fn, point, (params_a, params_b), alphas[:, None], chunk, params_a)}


def loss_barrier(loss_fn, params_a: Params, params_b: Params, alphas=None, *, chunk: int | None = None) -> dict:
    """The loss barrier of MATH.md §7: `max_alpha [L(theta(alpha)) - ((1 - alpha) L(A) + alpha L(B))]`
    over `alphas` (default 11 points from 0 to 1; 0 and 1 are always included).

    Returns {"barrier", "alpha_max" (where it is reached), "curve" (the `interpolate` dict plus
    "excess": the loss above the straight line between the end points)}."""
    alphas = np.linspace(0, 1, 11) if alphas is None else np.asarray(alphas, np.float64).reshape(-1)
    alphas = np.unique(np.concatenate([alphas, [0.0, 1.0]]))
    if alphas.min() < 0 or alphas.max() > 1:
        raise InputError(f"alphas must lie in [0, 1], got [{alphas.min()}, {alphas.max()}]")
    curve = interpolate(loss_fn, params_a, params_b, alphas, chunk=chunk)
    loss = curve["loss"].astype(np.float64)
    if not np.isfinite(loss).all():  # a NaN would make argmax and the barrier NaN, silently
        bad = alphas[~np.isfinite(loss)]
        raise InputError(f"the loss is not finite at alpha {', '.join(f'{a:.2f}' for a in bad[:5])}{' ...' * (len(bad) > 5)} "
                         f"({loss[~np.isfinite(loss)][0]}): non-finite weights, or data the model cannot score")
    line = (1 - alphas) * loss[0] + alphas * loss[-1]
    curve["excess"] = loss - line
    k = int(np.argmax(curve["excess"]))
    return {"barrier": float(curve["excess"][k]), "alpha_max": float(alphas[k]), "curve": curve}


def _collinear(t: float) -> str:
    """Why three points on one line span no plane, and what to pass instead (a planted pair, B
    aligned back onto A, is the usual case)."""
    if abs(t) < 1e-3:
        where = "params_2 equals params_0 (e.g. B aligned is A itself: B was A moved by a symmetry, which align undid)"
    elif abs(t - 1) < 1e-3:
        where = "params_2 equals params_1"
    else:
        where = f"params_2 = params_0 + {t:.3g} (params_1 - params_0)"
    return (f"the three points lie on one line, so no plane passes through them: {where}. Pass as params_2 a point "
            f"off that line (another model, or B aligned with other options), or draw the line itself with "
            f"barrier.interpolate(loss_fn, params_0, params_1, alphas) or barrier.loss_barrier")


def plane(loss_fn, params_0: Params, params_1: Params, params_2: Params, *, resolution: int = 11, margin: float = 0.2, chunk: int | None = None) -> dict:
    """Loss on the 2-D plane through three parameter points, in orthonormal coordinates: the x
    axis runs from `params_0` towards `params_1`, the y axis is the part of `params_2 - params_0`
    orthogonal to it (Gram-Schmidt over all leaves). The grid covers the three points plus
    `margin` of the span on each side, `resolution` points per axis.

    Returns {"x": (r,), "y": (r,), "loss": (r, r) indexed [y, x], metric: (r, r) ...,
    "points": (3, 2) the coordinates of params_0, params_1, params_2}."""
    check_same_leaves([params_0, params_1, params_2], ["params_0", "params_1", "params_2"])
    if resolution < 2:
        raise InputError(f"resolution={resolution} must be >= 2")
    f32 = lambda t: jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), t)
    p0, p1, p2 = f32(params_0), f32(params_1), f32(params_2)
    sub = lambda a, b: jax.tree_util.tree_map(jnp.subtract, a, b)
    dot = lambda a, b: float(sum(jnp.vdot(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))))
    d1, d2 = sub(p1, p0), sub(p2, p0)
    n1 = math.sqrt(dot(d1, d1))
    if n1 == 0:
        raise InputError("params_0 and params_1 are equal: the plane is undefined")
    u = jax.tree_util.tree_map(lambda x: x / n1, d1)
    proj = dot(d2, u)
    v = jax.tree_util.tree_map(lambda x, y: x - proj * y, d2, u)
    n2 = math.sqrt(dot(v, v))
    if n2 <= 1e-6 * max(n1, math.sqrt(dot(d2, d2))):
        raise InputError(_collinear(proj / n1))
    v = jax.tree_util.tree_map(lambda x: x / n2, v)
    points = np.array([[0.0, 0.0], [n1, 0.0], [proj, n2]])
    lo, hi = points.min(0), points.max(0)
    pad = margin * (hi - lo)
    x = np.linspace(lo[0] - pad[0], hi[0] + pad[0], resolution)
    y = np.linspace(lo[1] - pad[1], hi[1] + pad[1], resolution)
    coords = np.stack(np.meshgrid(x, y), -1).reshape(-1, 2)  # [y, x] order after reshape

    dtypes = jax.tree_util.tree_map(lambda x: jnp.result_type(x), params_0)

    def point(c, ops):
        return jax.tree_util.tree_map(lambda base, a, b, dtype: (base + c[0] * a + c[1] * b).astype(dtype), *ops, dtypes)

    values = _evaluate(loss_fn, point, (p0, u, v), coords, chunk, params_0)
    return {"x": x, "y": y, **{k: val.reshape(resolution, resolution) for k, val in values.items()}, "points": points}


def distance(params_a: Params, params_b: Params, spec) -> dict:
    """Euclidean distances between two models per module kind ("qk", "vo", each permutation group
    such as "ffn", "other") and in total: `distance_report(...)["total"]`."""
    return distance_report(spec, params_a, params_b)["total"]
