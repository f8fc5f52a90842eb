"""The residual stream's symmetry (MATH.md §10): one basis change T of the model width, applied to
every leaf that reads from or writes to the stream.

Which T keep the function depends on the norms (the family's `Norm`, bound as the spec's
`ResidualStream`):
- post-norm (BERT/RoBERTa): the stream itself passes each LayerNorm's gain after every residual
  sum, so T must commute with it: permutations only.
- pre-norm RMSNorm (Llama-style): RMS is invariant under every orthogonal T; each gain g folds into
  the input rows of the layers that read its norm (`fold_norms`: W -> diag(g) W), after which any
  orthogonal T is a symmetry.
- pre-norm LayerNorm (GPT-2, ViT): the mean and standard deviation over the width are invariant
  under the orthogonal T that fix the ones vector (T 1 = 1), the group O(d-1); once each gain is
  folded into the readers' rows and each norm bias into the readers' biases (or kept as beta / g
  where a reader has no bias: a vector on the stream), every such T is a symmetry.
A gain no layer can absorb (the final norm read by a tied LM head) must be uniform for a rotation.

Each family's record (`rotsym_jax.families.family`) declares the axis of every leaf that carries
the width, and the readers of each norm gain; `Family.spec` turns them into the spec's
`ResidualSpec`. `residual_cross` and `solve_residual` are the closed-form step of `align`'s
coordinate descent (Hungarian for permutations, Procrustes for rotations: on the complement of
the ones vector for LayerNorm).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputError
from ..options import DEFAULT_POLAR_METHOD
from ..precision import exact, exact_jit, is_traced
from ..pytree import flatten, unflatten
from ..solvers import assignment, procrustes
from ..spec import BoundSpec, Spec, SpecError, bind
from ..transforms import RESIDUAL, ResidualTransform, random_orthogonal

# The one refusal of a residual-stream group on a spec without residual rules, in memory and streamed.
NO_STREAM = ("residual alignment needs the spec's residual rules (Spec.residual), and this spec has none: no group moves this model's "
             "residual stream (for a checkpoint, `rotsym inspect` says why); use residual='none'")


def _bound_streams(spec, params):
    bound = bind(spec, params)
    if not bound.streams:
        raise SpecError(NO_STREAM)
    return bound


def stream_named(bound: BoundSpec, name: str | None):
    """The stream `name` (None: the model's one stream) of a bound spec with streams."""
    if name is None:
        if len(bound.streams) > 1:
            raise InputError(f"this model has {len(bound.streams)} residual streams ({', '.join(s.name for s in bound.streams)}): name one")
        return bound.residual
    found = [s for s in bound.streams if s.name == name]
    if not found:
        raise InputError(f"no residual stream {name!r}: the model's are {[s.name for s in bound.streams]}")
    return found[0]


@exact
def fold_norms(spec: Spec | BoundSpec, params) -> dict:
    """New params computing the same function with every foldable pre-norm gain moved into the
    input rows of the kernels that read it (gain -> 1, W -> diag(g) W). A LayerNorm's bias folds
    into the readers' biases (b -> b + beta W, beta -> 0), or, where a reader has none, stays as
    beta / g (then no gain may be zero). A gain without readers (the final norm read by a tied LM
    head) is left as it is; `align(residual="rotation")` then refuses it unless it is uniform
    (`rj.untie` gives the head its own kernel, which takes the gain).
    On a model of several streams, the gains of every stream that may rotate.
    Raises for post-norm specs (BERT: the gains act on the stream itself, nothing reads them)."""
    bound = _bound_streams(spec, params)
    rotatable = [s for s in bound.streams if rotation_refusal(s) is None]
    if not rotatable:
        raise InputError(f"fold_norms: {rotation_refusal(bound.streams[0])}")
    flat = dict(flatten(params))
    folds = Folds(rotatable, flat)
    return unflatten({path: folds.leaf(path, leaf, flat.__getitem__) for path, leaf in flat.items()})


class Folds:
    """What folding the norm gains into their readers does to each leaf, one leaf at a time:
    `fold_norms` applies it to a whole pytree, a streamed run to each tensor as it is read
    (`leaf(path, x, get)`: `get` returns the other leaves, as stored, that `needs(path)` names).
    `streams`: a stream, or several (a model's streams, a latent's): each reader reads one norm."""

    def __init__(self, streams, paths):
        streams = tuple(streams) if isinstance(streams, (tuple, list)) else (streams,)
        self.one_plus = {g for s in streams if s.gain == "one_plus" for g in s.gains}  # Gemma stores w, gain 1 + w
        self.axes, self.roles = {}, {}
        paths = set(paths)
        for stream in streams:
            axes = {}
            for path, axis in stream.axes:  # a reader's input axis: its first on the stream whose norm it reads
                axes.setdefault(path, axis)
            for _, readers in stream.folds:
                for r in readers:
                    self.axes[r] = axes[r]
        for stream, (gain, readers) in ((s, f) for s in streams for f in s.folds):
            if not readers:
                continue
            self.roles[gain] = ("gain",)
            for r in readers:
                self.roles[r] = ("scaled", gain)
            bias = _sibling(gain, "bias")
            if stream.norm != "layernorm" or bias not in paths:
                continue
            reader_biases = {r: _sibling(r, "bias") for r in readers}
            unbiased = sorted(r for r, b in reader_biases.items() if b not in paths)
            self.roles[bias] = ("over_gain", gain, unbiased) if unbiased else ("cleared",)
            if not unbiased:
                for r, b in reader_biases.items():
                    self.roles[b] = ("shifted", bias, r)

    def needs(self, path: str) -> tuple:
        role = self.roles.get(path, ("",))
        return {"scaled": role[1:2], "over_gain": role[1:2], "shifted": role[1:3]}.get(role[0], ())

    def _gain(self, get, path):
        return jnp.asarray(get(path), jnp.float32) + (1.0 if path in self.one_plus else 0.0)

    def leaf(self, path: str, x, get, stacked: bool = False):
        """`x` (the leaf at `path`, or one expert's slice of a stacked leaf with `stacked`) folded."""
        role = self.roles.get(path)
        if role is None:
            return x
        kind = role[0]
        if kind == "gain":
            return jnp.zeros_like(x) if path in self.one_plus else jnp.ones_like(x)
        if kind == "cleared":
            return jnp.zeros_like(x)
        if kind == "scaled":  # the gain scales the reader's input rows, along its stream axis
            return _scaled_rows(self._gain(get, role[1]), x, self.axes[path] - (1 if stacked else 0))
        if kind == "shifted":  # b + beta W, with W as stored
            beta = jnp.asarray(get(role[1]), jnp.float32)
            return (jnp.asarray(x, jnp.float32) + beta @ jnp.asarray(get(role[2]), jnp.float32)).astype(x.dtype)
        gain = self._gain(get, role[1])  # over_gain: beta / g, kept on the stream
        zeros = int(np.sum(np.asarray(gain) == 0)) if not is_traced(gain) else 0
        if zeros:
            raise InputError(f"fold_norms: {role[1]} has {zeros} zero entries and {role[2]} no bias to take {path}: the norm's bias cannot "
                             "be kept as beta / gain")
        return (jnp.asarray(x, jnp.float32) / gain).astype(x.dtype)


@exact_jit(static_argnums=(2,))
def _scaled_rows(gain, x, axis: int):
    # one program per leaf shape and axis: eagerly, the reshape, the casts and the product compiled one each
    shape = [1] * jnp.ndim(x)
    shape[axis] = -1
    return (gain.reshape(shape) * jnp.asarray(x, jnp.float32)).astype(x.dtype)


def _sibling(path: str, name: str) -> str:
    """`layers/0/mlp/up/kernel` -> `layers/0/mlp/up/<name>`."""
    return path.rsplit("/", 1)[0] + "/" + name


def rotation_refusal(stream) -> str | None:
    """Why no rotation of this residual stream keeps the function (a `ResidualSpec` or its bound
    `ResidualStream`), or None where one does (pre-norm, once the gains are folded)."""
    if getattr(stream, "permutations_only", None):
        return f"residual='rotation' cannot move the residual stream {stream.name!r}: {stream.permutations_only}; use residual='permutation'"
    if stream.placement == "post" and stream.norm == "rmsnorm":
        return ("residual='rotation' needs a pre-norm model: here an RMSNorm gain acts after each sublayer (post-norms: OLMo-2 norms "
                "each sublayer's output before it joins the stream, MiniMax the stream itself), which no rotation commutes with; "
                "use residual='signed_permutation' "
                "(permutations with sign flips, which commute with RMSNorm and its gains)")
    if stream.placement == "post":
        return ("residual='rotation' needs a pre-norm model: here the residual stream itself passes each LayerNorm's gain "
                "(post-LN, as BERT and RoBERTa), and only permutations commute with an elementwise gain; use residual='permutation'")
    if stream.placement == "sandwich":
        return ("residual='rotation' needs a pre-norm model: here each sublayer's output passes an RMSNorm gain before it joins the "
                "stream (sandwich norms, as Gemma 2 and 3), which no rotation commutes with; use residual='signed_permutation' "
                "(permutations with sign flips, which commute with RMSNorm and its gains)")
    return None


def signed_refusal(stream) -> str | None:
    """Why sign flips of this residual stream do not keep the function, or None where they do
    (RMSNorm: rms(x S) = rms(x) and S commutes with every gain; LayerNorm's mean does not)."""
    if getattr(stream, "permutations_only", None):
        return f"residual='signed_permutation' cannot move the residual stream {stream.name!r}: {stream.permutations_only}; use residual='permutation'"
    if stream.norm != "rmsnorm":
        return ("residual='signed_permutation' needs RMSNorm: LayerNorm subtracts the mean over the width, which a sign flip "
                "changes; use residual='permutation'")
    return None


def is_signed_permutation(t: ResidualTransform) -> bool:
    """Whether `t` (concrete) is a permutation with sign flips: its rotation diagonal, entries +-1."""
    if t.rotation is None:
        return True
    r = np.asarray(jax.device_get(t.rotation), np.float64)
    return bool(np.all(r == np.diag(np.diagonal(r))) and np.all(np.abs(np.diagonal(r)) == 1))


def fixes_ones(stream) -> bool:
    """Whether the stream's rotations must fix the ones vector (LayerNorm centres the width)."""
    return stream.norm == "layernorm"


def check_rotatable(bound: BoundSpec, params, what: str, streams=None) -> None:
    """A rotation of a stream keeps the function only on a pre-norm model whose norm gains are
    all uniform (after `fold_norms`): checked for `streams` (None: every stream)."""
    for stream in bound.streams if streams is None else streams:
        _check_stream_rotatable(stream, params, what)


def _check_stream_rotatable(stream, params, what: str) -> None:
    refusal = rotation_refusal(stream)
    if refusal:
        raise InputError(refusal)
    flat = flatten(params)
    if is_traced([flat[g] for g in stream.gains]):
        return  # inside jit: the caller folded (documented)
    bad = nonuniform_gains(stream, flat)
    if bad:
        unfoldable = [g for g, readers in stream.folds if not readers and g in bad]
        # no reader here: a tied LM head (the embedding's weights), or heads set aside because A's and B's differ
        hint = (f" {unfoldable} is read by no kernel aligned here: a tied LM head cannot be folded (it shares the embedding's "
                "weights): untie the head first (rj.untie(checkpoint): its own kernel, which takes the gain; then rj.fold_norms); "
                "a head held by one model only takes it once each model is folded with its own spec "
                "(rj.fold_norms(rj.spec_for(ck), ck.params)); or align the residual stream with 'permutation'" if unfoldable
                else " fold them first: rj.fold_norms(spec, params) on both models (function-preserving)")
        raise InputError(f"{what}: norm gains {bad[:4]} are not uniform, so a rotation of the residual stream would change the function;{hint}")


def stream_modes(bound: BoundSpec, mode: str, signed: bool = True) -> dict:
    """{stream name: the group solved on it} for `options.residual` = `mode` (none: {}). A model of
    one stream takes `mode` as asked (what cannot be solved is refused by name, as always). On a
    model of several streams `mode` is a ceiling: a stream whose record rules it out takes the
    strongest group below it that it allows (a rotation needs a pre-norm stream whose every gain
    some kernel absorbs: Whisper's decoder under its tied LM head, a CLIP image tower's embedding
    norm take signed permutations where RMSNorm allows them, else permutations), and the report
    says so (`settled`): a run need not fail on one tower for what the others allow. `signed`:
    whether the method solves signed permutations (from weights only), else permutations below."""
    if mode == "none":
        return {}
    if len(bound.streams) <= 1:
        return {s.name: mode for s in bound.streams}
    out = {}
    for stream in bound.streams:
        m = mode
        if m == "rotation" and stream_refusal(stream, m):
            m = "signed_permutation"
        if m == "signed_permutation" and (stream_refusal(stream, m) or not signed):
            m = "permutation"
        out[stream.name] = m
    return out


def stream_refusal(stream, mode: str) -> str | None:
    """Why one stream of a model of several cannot take `mode` from its record, or None: its norms'
    refusal, or (a rotation) a norm gain that no kernel absorbs."""
    if mode == "rotation":
        return rotation_refusal(stream) or next((f"norm gain {g} folds into no kernel" for g, r in stream.folds if not r), None)
    return signed_refusal(stream) if mode == "signed_permutation" else None


def mode_refusal(streams, mode: str) -> str | None:
    """Why a model whose streams are `streams` (`ResidualSpec`s or bound) cannot take
    residual=`mode` from its records, or None where it can: one stream, its own refusal; several,
    the ceiling's (each stream's reason, where none takes it). The norm gains' values are the
    data's to check (`check_rotatable`). A model without a stream refuses every mode that moves one."""
    if not streams:
        return None if mode in ("none", "auto") else NO_STREAM
    if len(streams) > 1:
        reasons = [f"{s.name}: {why}" for s in streams if (why := stream_refusal(s, mode))]
        return f"residual={mode!r}: no stream of this model takes it ({'; '.join(reasons)})" if len(reasons) == len(streams) else None
    refuse = {"rotation": rotation_refusal, "signed_permutation": signed_refusal}.get(mode)
    return next(filter(None, map(refuse, streams)), None) if refuse else None


def solve_streams(bound: BoundSpec, modes: dict, cross_of, polar_method: str | None, t_before: dict, solve=None) -> dict:
    """{stream name: T}, one stream after the other (`solve_order`), for every source of weights:
    `cross_of(stream, mode, t)` gives the stream's cross products (`residual_cross`, or
    `signed_cross`'s pair) on B moved by the groups and, on the leaves it shares with the streams
    solved before it, by `t` (`t_before` with their new T); `solve` is `solve_residual` or a timed
    call of it."""
    solve = solve or solve_residual
    out = {}
    for stream in solve_order(bound):
        mode = modes[stream.name]
        cross = cross_of(stream, mode, {**t_before, **out})
        out[stream.name] = solve(cross, mode, polar_method, fix_ones=mode == "rotation" and fixes_ones(stream))
    return out


def settled_streams(bound: BoundSpec, mode: str, signed: bool = True) -> dict | None:
    """report["settled"]'s part on the streams: each one's group where not every stream took `mode`."""
    modes = stream_modes(bound, mode, signed)
    if all(m == mode for m in modes.values()):
        return None
    return {"streams": modes, "streams_why": f"residual={mode!r} is a ceiling on a model of {len(modes)} streams: each takes the "
                                              "strongest group up to it that its norms allow"}


def strongest_of(streams, flats: list | None = None) -> tuple[str, str]:
    """`strongest` over a model's streams (`ResidualSpec`s or bound): the weakest of each one's
    strongest group, which every stream allows."""
    if not streams:
        return strongest(None)
    found = [(s, *strongest(s, flats)) for s in streams]
    order = ("none", "permutation", "rotation")
    stream, mode, why = min(found, key=lambda f: order.index(f[1]))
    return mode, why + (f" (stream {stream.name!r}, the weakest of {len(streams)})" if len(streams) > 1 else "")


def strongest(stream, flats: list | None = None) -> tuple[str, str]:
    """residual="auto" for the data methods: the strongest group of the residual stream (a
    `ResidualSpec` or its bound `ResidualStream`) that keeps every model of `flats` (flat params,
    concrete; None: models whose gains will be folded, as the command line does) as it is, and
    why. A rotation on a pre-norm model with uniform norm gains; else a permutation, which every
    family allows (signed permutations are solved from weights only)."""
    if stream is None:
        return "none", "the spec has no residual rules (Spec.residual)"
    refusal = rotation_refusal(stream)
    if refusal is not None:
        return "permutation", "a permutation: the stream passes the norms' gains (post-norm), so no rotation keeps the function"
    bad = [] if flats is None else sorted({g for flat in flats for g in nonuniform_gains(stream, flat)})
    if not bad:
        return "rotation", "a rotation: a pre-norm model " + ("whose norm gains are uniform" if flats is not None else "with its norm gains folded")
    return "permutation", (f"a permutation: a rotation needs uniform norm gains and {bad[0]} (of {len(bad)}) is not; fold them first for "
                           "one (rj.fold_norms(spec, params) on both models, rj.untie a tied head; the command line does both)")


def scored_axes(bound: BoundSpec, stream, rotation: bool = False, untouched_only: bool = False, gains_only: bool = False) -> list:
    """The (path, stream axis) pairs of `stream` that score T in `residual_cross`, in the stream's order. A
    rotation leaves the (uniform) RMSNorm gains alone, so they do not score it; `gains_only`: the
    gains alone (sign flips leave the gains unsigned: they score a signed permutation's
    permutation, not its signs). `untouched_only`: only the leaves no per-layer group moves
    (embeddings, norms, output biases, heads), which score T before the groups are known: the
    descent's first step. A leaf on the stream along two axes (T^T W T) is not linear in T: it
    follows T, scores nothing. A leaf on two streams (a projection between a tower's stream and a
    joint space) scores only the one solved last (`solve_order`), moved along the others first
    (`groups.moved_by_others`), so no stream's T waits on another's in a loop."""
    skip = set(stream.gains) if rotation else set()
    order = [s.name for s in solve_order(bound)]
    skip |= {p for p in shared_paths(bound) if max(order.index(s.name) for s in bound.streams if any(q == p for q, _ in s.axes))
             != order.index(stream.name)}
    if gains_only:
        skip = {p for p, _ in stream.axes} - set(stream.gains)
    if untouched_only:
        skip |= set(bound.transformed_paths())
    counts = collections.Counter(p for p, _ in stream.axes)  # a count per path, not a scan per path
    return [(path, axis) for path, axis in stream.axes if path not in skip and counts[path] == 1]


def shared_paths(bound: BoundSpec) -> frozenset:
    """The leaves on more than one residual stream (a projection between a tower's stream and a
    joint space): each stream's T is scored on them last, B's moved along the others first."""
    counts = collections.Counter(p for s in bound.streams for p in {q for q, _ in s.axes})
    return frozenset(p for p, n in counts.items() if n > 1)


def solve_order(bound: BoundSpec) -> tuple:
    """The streams in the order their T are solved: those with more leaves of their own first (a
    tower's before a joint space, which is read through the towers' new T)."""
    shared = shared_paths(bound)
    return tuple(sorted(bound.streams, key=lambda s: -len({p for p, _ in s.axes if p not in shared})))


def nonuniform_gains(stream, flat) -> list:
    """The norm gains among `flat` (concrete) whose entries are not all equal: what a rotation of
    the stream cannot commute with."""
    return [g for g in stream.gains if g in flat and not np.allclose(np.asarray(flat[g], np.float32), np.asarray(flat[g], np.float32).ravel()[0])]


def residual_cross(bound: BoundSpec, stream, flat_a, flat_b, rotation: bool = False, untouched_only: bool = False, gains_only: bool = False):
    """M = sum over `stream`'s leaves that score T (`scored_axes`) of X_B^T X_A (d, d), each
    leaf's stream axis last and its other axes flattened into rows: the Procrustes / assignment
    score of T (MATH §10). The leaves it shares with another stream are summed last (`shared_paths`)."""
    scored = scored_axes(bound, stream, rotation, untouched_only, gains_only)
    shared = shared_paths(bound)
    # Summed as a streamed run sums it: each layer's leaves (those outside the layers first), then
    # the layers in order, so that a rotation, which every rounding moves, is the same bits both ways.
    layer_of = dict(bound.leaf_layers)
    by_layer: dict = {}
    for path, axis in scored:
        by_layer.setdefault("shared" if path in shared else layer_of.get(path), []).append((path, axis))
    total = None
    for layer in sorted(by_layer, key=lambda k: (k == "shared", k is not None, not isinstance(k, int), k if isinstance(k, int) else 0, str(k))):
        pairs = by_layer[layer]
        part = stream_cross(tuple(flat_a[p] for p, _ in pairs), tuple(flat_b[p] for p, _ in pairs), tuple(a for _, a in pairs), stream.size)
        total = part if total is None else total + part
    return jnp.zeros((stream.size,) * 2, jnp.float32) if total is None else total


@exact_jit(static_argnums=(2, 3))
def stream_cross(xas: tuple, xbs: tuple, axes: tuple, d: int):
    """sum_k X_Bk^T X_Ak (d, d) in float32, in the order given: one layer's part of
    `residual_cross` (a streamed run sums a layer's leaves with it, then the layers on the host).
    One program for both paths, keyed on what it computes (the leaves' shapes and dtypes, their
    stream axes, the width): eagerly, the transposes are laid out before the products, which then
    round otherwise than the program's."""
    m = jnp.zeros((d, d), jnp.float32)
    for xa, xb, axis in zip(xas, xbs, axes):
        xa = jnp.moveaxis(jnp.asarray(xa, jnp.float32), axis, -1).reshape(-1, d)
        xb = jnp.moveaxis(jnp.asarray(xb, jnp.float32), axis, -1).reshape(-1, d)
        m = m + xb.T @ xa
    return m


def signed_cross(bound: BoundSpec, stream, flat_a, flat_b, untouched_only: bool = False) -> tuple:
    """`solve_residual`'s cross products for a signed permutation: (M without the gains, the gains' M)."""
    return (residual_cross(bound, stream, flat_a, flat_b, True, untouched_only),
            residual_cross(bound, stream, flat_a, flat_b, False, untouched_only, True))


def solve_residual(cross, mode: str, polar_method: str | None = None, *, fix_ones: bool = False) -> ResidualTransform:
    """The T maximising tr(T^T M): a linear assignment (permutation; with signs: `cross` is the pair
    (M without the gains, the gains' part), `signed_cross`), or the polar factor (rotation);
    with `fix_ones` (LayerNorm, `fixes_ones`), the best rotation with T 1 = 1: the polar factor on
    the complement of the ones vector (MATH §10)."""
    if mode == "permutation":
        return ResidualTransform(assignment.assign(cross, traced_nonfinite="identity"))
    if mode == "signed_permutation":
        # cross = (M of the signed leaves, G of the gains, which follow the permutation unsigned):
        # max over perms p and signs s of sum_j s_j M[p_j, j] + G[p_j, j] assigns |M| + G, each sign that of M
        cross, gains = cross
        perm = assignment.assign(jnp.abs(cross) + gains, traced_nonfinite="identity")
        signs = jnp.sign(jnp.take_along_axis(cross, perm[None, :], axis=0)[0])
        return ResidualTransform(perm, jnp.diag(jnp.where(signs == 0, 1.0, signs).astype(jnp.float32)))
    method = polar_method or DEFAULT_POLAR_METHOD
    rotation = _polar_fixing_ones(cross, method) if fix_ones else procrustes.polar(cross, method=method)
    return ResidualTransform(jnp.arange(cross.shape[-1], dtype=jnp.int32), rotation)


def _householder(d: int):
    """v and 2 / (v . v) of the Householder reflection H = I - 2 v v^T / (v . v) that maps e_0 to
    1 / sqrt(d) (symmetric, orthogonal): H diag(1, R) H fixes the ones vector for every orthogonal
    R of size d - 1, and every orthogonal matrix fixing it is one of these. H is never formed."""
    v = np.full((d,), -1 / np.sqrt(d), np.float32)
    v[0] += 1.0
    return v, np.float32(2 / np.dot(v, v))


def _reflect_both(x, d: int):
    """H x H for a (d, d) x."""
    v, c = _householder(d)
    x = x - c * jnp.outer(v, v @ x)
    return x - c * jnp.outer(x @ v, v)


@exact
def fixing_ones(rotation) -> jax.Array:
    """The orthogonal (d, d) matrix fixing the ones vector that acts as `rotation` (d - 1, d - 1) on
    its complement: H diag(1, R) H (`_householder`)."""
    d = rotation.shape[-1] + 1
    block = jnp.zeros((d, d), jnp.float32).at[0, 0].set(1.0).at[1:, 1:].set(jnp.asarray(rotation, jnp.float32))
    return _reflect_both(block, d)


@exact_jit(static_argnums=(1,))
def _polar_fixing_ones(cross, method: str):
    d = cross.shape[-1]
    inner = _reflect_both(cross.astype(jnp.float32), d)[1:, 1:]
    return fixing_ones(procrustes.polar(inner, method=method))


def random_residual(spec: Spec | BoundSpec, params, key, mode: str, stream: str | None = None) -> ResidualTransform:
    """A random element of the stream's group: a permutation, a permutation with sign flips
    (RMSNorm), or a Haar rotation (pre-RMSNorm: of O(d); pre-LayerNorm: of the rotations fixing
    the ones vector, O(d - 1)). `stream`: which of a model's several streams (its name), to be
    held under that name in a transforms dict."""
    found = stream_named(_bound_streams(spec, params), stream)
    d = found.size
    perm = jax.random.permutation(key, d).astype(jnp.int32)
    if mode == "permutation":
        return ResidualTransform(perm)
    if mode == "signed_permutation":
        refusal = signed_refusal(found)
        if refusal:
            raise InputError(refusal)
        signs = jnp.where(jax.random.bernoulli(jax.random.fold_in(key, 2), 0.5, (d,)), -1.0, 1.0)
        return ResidualTransform(perm, jnp.diag(signs))
    if mode != "rotation":
        raise InputError(f"mode={mode!r}; expected 'permutation', 'signed_permutation' or 'rotation'")
    refusal = rotation_refusal(found)
    if refusal:
        raise InputError(refusal)
    key = jax.random.fold_in(key, 1)
    rotation = fixing_ones(random_orthogonal(key, (), d - 1)) if fixes_ones(found) else random_orthogonal(key, (), d)
    return ResidualTransform(jnp.arange(d, dtype=jnp.int32), rotation)


__all__ = [
    "RESIDUAL",
    "check_rotatable",
    "fixes_ones",
    "fixing_ones",
    "fold_norms",
    "is_signed_permutation",
    "mode_refusal",
    "nonuniform_gains",
    "random_residual",
    "residual_cross",
    "rotation_refusal",
    "scored_axes",
    "signed_cross",
    "stream_cross",
    "stream_modes",
    "stream_named",
    "stream_refusal",
    "settled_streams",
    "shared_paths",
    "signed_refusal",
    "solve_order",
    "solve_residual",
    "solve_streams",
    "strongest",
    "strongest_of",
]


# ---- the coordinate descent (MATH §10), written once ------------------------------------------------

# A sweep that lowers the squared distance by less than this fraction is no progress: the descent stops.
# Ten times float32's rounding of the distance's sums: at 1e-7 two runs that sum in other orders (in
# memory and streamed, or two CPUs' code) stopped one sweep apart, where a last sweep of no measurable
# gain still turned flat directions of the rotations by 1%.
PROGRESS = 1e-6


def descend(first, groups_given, residual_given, squared_distance, max_sweeps: int, traced: bool = False) -> tuple[dict, list]:
    """The descent over (per-layer groups, residual T), for every source of weights: `align` runs
    it on the params in memory, the streamed runs with each step a pass over the chunks. The two
    commute (they act on different axes), so each sweep solves the groups on B moved by T, then T
    on B moved by the groups. T is {stream name: element}, one per stream, each solved from the
    same pass but for the leaves two streams share (`shared_paths`), which score only a stream
    with no leaf of its own, moved along the others by their T just solved (`solve_order`,
    `groups.moved_by_others`).

    first(): the first T, from the leaves no per-layer group moves (embeddings, norms, biases,
        heads: from the identity, a rotated stream scrambles every per-layer solve and the descent
        stalls); groups_given(t, sweep): the groups solved on B moved by `t`; residual_given(groups, t):
        T solved on B moved by `groups` (and, where streams share a leaf, by `t`); squared_distance(transforms): the total squared distance
        to A of B moved by them.
    Returns (the transforms, each stream's T under its name, of the sweep with the smallest distance; the
    distance after every sweep). The descent stops at the first sweep that makes no progress
    (PROGRESS); inside jit every sweep runs and the best is chosen on the device (`_descend_traced`)."""
    if traced:
        return _descend_traced(first, groups_given, residual_given, squared_distance, max_sweeps)
    t = first()
    best = best_sq = None
    per_sweep = []
    for sweep in range(max_sweeps):
        groups = groups_given(t, sweep)
        t = residual_given(groups, t)
        transforms = {**groups, **t}
        sq = squared_distance(transforms)
        per_sweep.append(float(np.sqrt(sq)))
        if best is None:
            best, best_sq = transforms, sq
        elif sq < best_sq * (1 - PROGRESS):
            best, best_sq = transforms, sq
        else:  # no progress: a fixed point of the descent
            break
    return best, per_sweep


def _descend_traced(first, groups_given, residual_given, squared_distance, max_sweeps: int) -> tuple[dict, list]:
    """`descend` inside jit, its sweeps the steps of one `lax.scan`: unrolled, each sweep put another
    copy of the whole group solve in the program (85k equations at 8 sweeps on a tiny BART or
    Whisper, 10k a sweep), which XLA did not compile in 15 minutes. The same choice: the first
    sweep's transforms, then each sweep's that comes strictly closer to A."""
    t = first()

    def sweep(t, i):
        groups = groups_given(t, i)
        t = residual_given(groups, t)
        return t, {**groups, **t}

    empty = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(lambda t: sweep(t, 0)[1], t))

    def step(carry, i):
        t, best, best_sq = carry
        t_next, transforms = sweep(t, i)
        sq = squared_distance(transforms)
        better = (i == 0) | (sq < best_sq)
        best = jax.tree.map(lambda new, old: jnp.where(better, new, old), transforms, best)
        t_next = jax.tree.map(lambda new, old: new.astype(old.dtype), t_next, t)
        return (t_next, best, jnp.where(better, sq, best_sq)), jnp.sqrt(sq)

    (_, best, _), per_sweep = jax.lax.scan(step, (t, empty, jnp.float32(jnp.inf)), jnp.arange(max_sweeps))
    return best, list(per_sweep)
