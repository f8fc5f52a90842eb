"""Optimizer state that follows the alignment: an optax state moved as the params were moved.

Training code that aligns a model (federated averaging, soups, re-basin while training) keeps an
optimizer state whose param-shaped trees (Adam's moments, momentum traces) live in the old basis;
without moving them, the next steps partly undo the alignment. A group element acts linearly on
each leaf, `W -> A W B` (MATH §1, §10), so each kind of state has its own action (MATH §13):

    params       the params' own map (`apply_transform`)
    gradient     the contragredient map A^-T g B^-T, the one under which gradients move: the same
                 as the params' for permutations and rotations, the scales inverted for rescaling.
                 Exact for every group: a gradient-like state (a first moment, a momentum trace, an
                 EMA of updates) becomes what the moved model's own gradients would have built;
                 except a norm gain under a rotation of the coordinates it scales (zero: MATH §13).
    second       a diagonal second moment ν = EMA[g ∘ g]: exact under permutations and rescaling
                 (ν / s²). A rotation mixes coordinates, and ν' = E[(gR)²] needs the cross terms
                 E[g_i g_k] that Adam never stored: `second_moments="diagonal"` drops them,
                 ν' = ν (R ∘ R) (the squared map, which keeps each leaf's total), "reset" replaces
                 ν on every leaf a rotation may act on (every attention leaf; every stream leaf
                 under a residual rotation) by its mean over the leaf (an estimate no rotation
                 changes; zeros would make Adam divide first moments by ε).

Which state is which is read from its field name (`KINDS`), the same in every optax transformation
that holds it; `kinds=` names others. The default is "diagonal": on the Llama pair of
tests/test_opt_state.py, against the ν that the moved gradients' history builds, its error is
0.17 (QK/VO rotated) and 0.78 (the residual stream too) against "reset"'s 0.24 and 0.96, and the
next Adam update's 0.18 and 0.43 against 0.36 and 0.74 (relative; the test checks the order).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from ..precision import exact
from ..pytree import flatten, unflatten
from ..spec import BoundSpec, Spec, bind
from .groups import apply_unchecked, check_transforms

# The kind of a param-shaped state, by the field (or dict key) that holds it in optax's states:
# Adam/AdamW/AMSGrad/Yogi/AdaBelief/Lion/RMSProp/Adagrad/SGD momentum/EMA/MultiSteps.
KINDS = {
    "mu": "gradient",
    "trace": "gradient",
    "ema": "gradient",
    "acc_grads": "gradient",
    "nu": "second",
    "nu_max": "second",
    "sum_of_squares": "second",
}
STATE_KINDS = ("params", "gradient", "second")
SECOND_MOMENTS = ("diagonal", "reset")


@exact
def transform_opt_state(transforms: dict, opt_state, bound: Spec | BoundSpec, *, second_moments: str = "diagonal",
                        kinds: Mapping[str, str] | None = None):
    """`opt_state` (any optax state, any chain of transformations) with every param-shaped tree moved
    as `apply_transform(bound, params, transforms)` moves the params; other leaves (step counts,
    schedules' state) unchanged. A new pytree; the input is not modified. Jittable.

    A param-shaped tree is a nested dict with every leaf `bound` was bound to, of the same shapes
    (optax.masked's `MaskedNode` stands for a leaf it does not hold). Its kind (module docstring)
    comes from the field that holds it: `KINDS`, updated by `kinds` ({field name: "params" |
    "gradient" | "second"}); a param-shaped tree under another field is refused by name, and so
    is a factored statistic (Adafactor's v_row / v_col: every params path, other shapes).
    second_moments: "diagonal" (default) or "reset", for the second moments under rotations.
    `bound`: the `AlignResult.bound` (or a Spec, bound to the first param-shaped tree).
    Moving the state of params that `fold_norms` changed afterwards is not a group action: fold
    before training, or reset that state. A norm gain under a rotation of the coordinates it
    scales (the residual stream's, a rotated latent's) only follows the permutation: its first
    moments become zero and its second moments their mean (`_left_behind`)."""
    if second_moments not in SECOND_MOMENTS:
        raise InputError(f"second_moments={second_moments!r}; choose one of {SECOND_MOMENTS}")
    table = dict(KINDS)
    for field, kind in (kinds or {}).items():
        if kind not in STATE_KINDS:
            raise InputError(f"kinds[{field!r}] = {kind!r}; choose one of {STATE_KINDS}")
        table[field] = kind
    if not isinstance(bound, BoundSpec):
        tree = _first_params_tree(opt_state, bound)
        if tree is None:  # SGD's empty state, a schedule's count: nothing follows the params
            return opt_state
        bound = bind(bound, tree)
    check_transforms(bound, transforms)
    shapes = dict(bound.shapes)
    actions = {
        "params": transforms,
        "gradient": {name: t.dual() for name, t in transforms.items()},
        "second": {name: t.dual().squared() for name, t in transforms.items()},
    }
    rotated = _rotated_paths(bound, transforms) if second_moments == "reset" else set()
    gains = [(p, r) for group in bound.groups_of(transforms) for p, r in rj.kinds.of(group).gains(group, transforms[group.name])]
    found = []

    def move(path, node):
        if not _is_params_tree(node, shapes):
            return node
        field = _field(path)
        where = "opt_state" + jax.tree_util.keystr(path)
        if field not in table:
            raise InputError(f"{where} is param-shaped, but transform_opt_state does not know how a {field!r} state moves; "
                             f"name it with kinds={{{field!r}: 'params' | 'gradient' | 'second'}} (known: {sorted(table)})")
        found.append(where)
        moved = _move_tree(node, bound, shapes, actions[table[field]], rotated if table[field] == "second" else set())
        return moved if table[field] == "params" else _left_behind(moved, gains, table[field])

    _refuse_mirrors(opt_state, shapes)
    out = jax.tree_util.tree_map_with_path(move, opt_state, is_leaf=lambda x: _is_params_tree(x, shapes))
    if not found:
        _refuse_stray(opt_state, bound, shapes)
    return out


def _refuse_mirrors(opt_state, shapes: dict) -> None:
    """A nested dict with every params path but other shapes (Adafactor's factored v_row, v_col):
    a statistic of rows or columns, which no group action moves exactly; refused by name rather
    than left in the old basis."""
    def visit(path, node):
        if isinstance(node, Mapping) and not _is_params_tree(node, shapes) and set(shapes) <= set(flatten(node)):
            flat = flatten(node)
            differ = next((p for p in shapes if _is_array(flat[p]) and tuple(np.shape(flat[p])) != tuple(shapes[p])), None)
            if differ is None:  # every leaf masked (optax.masked with nothing selected): nothing to move
                return node
            raise InputError(
                f"opt_state{jax.tree_util.keystr(path)} has every params leaf but other shapes ({differ}: {tuple(np.shape(flat[differ]))} "
                f"for {tuple(shapes[differ])}), a factored statistic (Adafactor's v_row / v_col): no group action moves it; "
                "re-initialise that optimizer's state after aligning, or use an unfactored one")
        return node

    jax.tree_util.tree_map_with_path(visit, opt_state, is_leaf=lambda x: isinstance(x, Mapping))


def _move_tree(tree: Mapping, bound: BoundSpec, shapes: dict, transforms: dict, reset: set):
    """One param-shaped tree moved by `transforms` (masked leaves stand in as zeros, and stay
    masked); leaves in `reset` set to their mean after the move."""
    flat = flatten(tree)
    masked = {p for p in shapes if not _is_array(flat[p])}
    filled = {**flat, **{p: jnp.zeros(shapes[p], jnp.float32) for p in masked}}
    moved = flatten(apply_unchecked(bound, unflatten(filled), transforms))
    for p in reset - masked:
        moved[p] = jnp.broadcast_to(jnp.mean(moved[p]), moved[p].shape).astype(moved[p].dtype)
    return unflatten({p: flat[p] if p in masked else moved[p] for p in flat})


def _left_behind(tree, gains: list, kind: str):
    """A norm gain's state where its group rotates the coordinates it scales (`Kind.gains`): the
    gain follows the permutation alone, and in the new basis its gradient is diag(R^T G R) of the
    full matrix gradient G, which no state holds. Under a signed permutation (sign flips commute
    with a diagonal gain) the moved state is exact and kept; under any other rotation a first
    moment becomes zero and a second moment its mean (as "reset": an estimate no rotation
    changes). Decided on the arrays, so it runs under jit."""
    if not gains:
        return tree
    flat = flatten(tree)
    for path, rotation in gains:
        x = flat[path]
        if not _is_array(x):  # masked
            continue
        signed = _is_signed(rotation)
        stand_in = jnp.zeros_like(x) if kind == "gradient" else jnp.broadcast_to(jnp.mean(x), x.shape).astype(x.dtype)
        flat[path] = jnp.where(signed, x, stand_in)
    return unflatten(flat)


def _is_signed(r):
    """Whether rotation `r` is a diagonal of +-1 (a traced bool)."""
    diagonal = jnp.diagonal(r)
    return jnp.all(r == jnp.diag(diagonal)) & jnp.all(jnp.abs(diagonal) == 1)


def _rotated_paths(bound: BoundSpec, transforms: dict) -> set[str]:
    """The leaves whose coordinates a group's element may mix (`Kind.mixed`: every attention
    member; the residual stream's leaves when its element has a rotation)."""
    return {p for group in bound.groups_of(transforms) for p in rj.kinds.of(group).mixed(group, transforms[group.name])}


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "shape") and hasattr(x, "dtype")


def _is_params_tree(node, shapes: dict) -> bool:
    if not isinstance(node, Mapping):
        return False
    flat = flatten(node)
    if not set(shapes) <= set(flat):
        return False
    arrays = [p for p in shapes if _is_array(flat[p])]
    return bool(arrays) and all(tuple(np.shape(flat[p])) == tuple(shapes[p]) for p in arrays)


def _field(path) -> str:
    """The name of the field (or dict key) that holds a state: the last named key of its path."""
    for key in reversed(path):
        if isinstance(key, jax.tree_util.GetAttrKey):
            return key.name
        if isinstance(key, jax.tree_util.DictKey):
            return str(key.key)
    return ""


def _first_params_tree(opt_state, spec: Spec):
    """The first nested dict of `opt_state`, outermost first, that `spec` binds to; None when the
    state holds no matrix at all (refused when it holds some: they would stay in the old basis)."""
    pending = [opt_state]
    while pending:
        node = pending.pop(0)
        if isinstance(node, Mapping):
            try:
                bind(spec, node)
                return node
            except (ValueError, TypeError, KeyError):  # not the params' tree: look further down
                pass
        children = jax.tree_util.tree_flatten(node, is_leaf=lambda x, node=node: x is not node)[0]
        pending += [c for c in children if c is not node]
    matrices = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(opt_state)[0] if np.ndim(x) >= 2]
    if matrices:
        raise InputError(f"opt_state holds matrices ({', '.join(matrices[:3])}) but no nested dict that this spec binds to; "
                         "pass the AlignResult's bound spec (`result.bound`)")
    return None


def _refuse_stray(opt_state, bound: BoundSpec, shapes: dict) -> None:
    """No param-shaped tree was found: a leaf shaped as a moved matrix means the state holds the
    params in a form not recognised (another container), which would be left in the old basis."""
    moved = {tuple(shapes[p]): p for p in bound.transformed_paths(bool(bound.streams)) if len(shapes[p]) >= 2}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        shape = tuple(np.shape(leaf))
        if shape in moved:
            raise InputError(
                f"opt_state holds no nested dict of every leaf (paths and shapes) of the params the transforms were solved for: "
                f"was it built for other params? (opt_state{jax.tree_util.keystr(path)} has the shape {shape}, as the params leaf "
                f"{moved[shape]}); transform_opt_state moves states that optax built from the params dict (`optimizer.init(params)`)"
            )

