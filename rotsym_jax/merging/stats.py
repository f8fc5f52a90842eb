"""Data statistics for merging, computed in JAX: diagonal Fisher and RegMean Gram matrices.

Statistics belong to the exact params they were computed on (MATH.md §6: after alignment they
must be recomputed on the aligned params, or transformed with the same transforms). A `Stats`
carries a fingerprint of those params, and the merges check it: passing statistics of the
unaligned model together with the aligned params is rejected with an error that says what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import rotsym_jax as rj

from ..engine.groups import act_on_groups
from ..errors import InputError, InputTypeError, RotsymError
from ..families.labels import IGNORE, check_labels
from ..precision import exact, exact_jit
from ..pytree import Params, fingerprint


class StatsError(RotsymError, ValueError):
    """Statistics that do not belong to the params they are used with."""


@dataclasses.dataclass(frozen=True)
class Stats:
    """kind: "fisher" (values: a pytree like the params, the diagonal Fisher) or "gram" (values:
    {kernel path: (d_in, d_in) Gram matrix of that linear layer's inputs}). count: the number of
    examples (sequences, images) they were computed on, for both kinds: the Fisher is averaged
    over them; the Grams are sums over their non-padding rows (a token per row for per-token
    inputs, an example per row for pooled ones), not normalised: `values[path] / count` is a
    per-example Gram. fingerprint: `fingerprint(params)` of the params they were computed on."""

    kind: str
    values: dict
    count: int
    fingerprint: str

    def check(self, params: Params, what: str = "params") -> None:
        """Raise StatsError unless these statistics were computed on (or transformed to) `params`."""
        if fingerprint(params) != self.fingerprint:
            raise StatsError(
                f"{self.kind} statistics were computed on other params than {what}: statistics follow "
                "the alignment (MATH.md §6). Recompute them on the aligned params, or move them with "
                "`stats.follow(stats, align_result)`."
            )


# ---- linear-layer inputs --------------------------------------------------------------------------

def _row_weights(x, inputs):
    """1 for the rows of a recorded input that are real tokens, 0 for padding: the attention mask
    applies to per-token inputs (batch, tokens, d) of the same length; pooled inputs (batch, d) and
    models without a mask count every row."""
    mask = inputs.get("attention_mask")
    if x.ndim == 3 and mask is not None and mask.shape == x.shape[:2]:
        return mask.astype(jnp.float32)
    return jnp.ones(x.shape[:-1], jnp.float32)


def layer_inputs(checkpoint, params: Params, batch: dict) -> dict[str, np.ndarray]:
    """{kernel path: (rows, d_in) NumPy array} of every linear layer's input on `batch` (model
    inputs; a "labels" entry is ignored), padding tokens removed. Linear layers are the models'
    `Dense` layers (tied LM heads are not one)."""
    inputs, _ = checkpoint.split_batch(batch, "layer_inputs: batch")
    _, xs = rj.nets.layers.record_dense_inputs(checkpoint.graphdef, checkpoint.forward_params(params), inputs)
    out = {}
    for path, x in xs.items():
        if rj.nets.layers.EXTRA_CALL in path:  # a layer's later calls (DeBERTa-v3's positions): not tokens
            continue
        keep = np.asarray(_row_weights(x, inputs)).reshape(-1) > 0
        out[path] = np.asarray(x, np.float32).reshape(-1, x.shape[-1])[keep]
    return out


@functools.partial(exact_jit, static_argnums=0)
def _batch_grams(graphdef, params, inputs):
    _, xs = rj.nets.layers.record_dense_inputs(graphdef, params, inputs)
    grams = {}
    for path, x in sorted(xs.items()):
        # a layer's later calls (DeBERTa-v3's query and key on the relative positions): every row counts
        path, extra = path.split(rj.nets.layers.EXTRA_CALL)[0], rj.nets.layers.EXTRA_CALL in path
        w = jnp.ones(x.shape[:-1], jnp.float32).reshape(-1) if extra else _row_weights(x, inputs).reshape(-1)
        x = x.astype(jnp.float32).reshape(-1, x.shape[-1])
        gram = jnp.einsum("n,ni,nj->ij", w, x, x)
        grams[path] = grams[path] + gram if extra else gram
    return grams


def _check_progress(progress, what: str):
    if progress is not None and not callable(progress):
        raise InputTypeError(f"{what}: progress={progress!r}; expected None or a callable taking no arguments")


def grams(checkpoint, params: Params, batches, *, progress=None) -> Stats:
    """RegMean statistics: for every linear layer, the Gram matrix `X^T X` (d_in, d_in) of its
    inputs summed over all non-padding rows of all batches (Jin et al. 2023), every call's rows
    where a layer is called more than once (DeBERTa-v3's query and key also read the relative
    positions). `batches`: an
    iterable of dicts of model inputs (with "attention_mask" for padded text). `count`: the number
    of examples (sequences), padded or not, as for `fisher`; not the number of tokens.
    progress: None, or a callable called with no arguments after each batch (e.g. a progress
    bar's `update`)."""
    _check_progress(progress, "grams")
    total, examples = None, 0
    for i, batch in enumerate(batches):
        inputs, _ = checkpoint.split_batch(batch, f"grams: batches[{i}]")
        g = _batch_grams(checkpoint.graphdef, checkpoint.forward_params(params), inputs)
        total = g if total is None else jax.tree_util.tree_map(jnp.add, total, g)
        examples += int(next(iter(inputs.values())).shape[0])
        if progress is not None:
            progress()
    if total is None:
        raise InputError("grams: `batches` is empty")
    return Stats("gram", total, examples, fingerprint(params))


# ---- diagonal Fisher ------------------------------------------------------------------------------

FISHER_KINDS = ("empirical", "expected")


def _logits_shape(checkpoint, params, inputs, what) -> tuple[int, ...]:
    """Shape of the model's logits on `inputs`, from a trace alone (`eval_shape`; the jitted forward
    inside is traced once per input shape): checked before the per-example gradients are compiled."""
    out = jax.eval_shape(lambda p, x: checkpoint.apply(p, **x), params, inputs)
    if "logits" not in out:
        raise InputError(
            f"{what}: the model returns no logits (its outputs: {sorted(out)}); the Fisher needs "
            "log-probabilities, from a model with a classification or LM head (e.g. "
            "init_checkpoint(config, key, head=...), or load_hf of a *ForSequenceClassification or *ForCausalLM checkpoint)"
        )
    return tuple(out["logits"].shape)


def _labelled(labels, logits_shape, what) -> None:
    if labels is None:
        raise InputError(f"{what}: fisher(kind='empirical') needs batch['labels']")
    check_labels(labels, logits_shape, what)


def _predicted(inputs, labels, logits_shape, what) -> jax.Array:
    """(batch, tokens) bool: the positions a sampled per-token Fisher draws a label at: the labelled
    ones (not IGNORE) when there are labels, else those the attention mask keeps, else all."""
    if labels is not None:
        check_labels(labels, logits_shape, what)
        return labels != IGNORE
    mask = inputs.get("attention_mask")
    if mask is not None and tuple(mask.shape) == logits_shape[:2]:
        return mask > 0
    return jnp.ones(logits_shape[:2], bool)


def _log_probs(graphdef, params, inputs):
    """Log-probabilities of one example's outputs: (classes,) or (tokens, vocab)."""
    batched = {k: v[None] for k, v in inputs.items()}
    logits = rj.nets.merged(graphdef, params)(**batched)["logits"][0]
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _log_likelihood(graphdef, params, inputs, labels):
    """Sum of log p(label) over the example's labelled positions (label IGNORE: skipped)."""
    logp = _log_probs(graphdef, params, inputs)
    labels = jnp.asarray(labels)
    valid = labels != IGNORE
    picked = jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(valid, picked, 0.0))


def _squared_grads(graphdef, params, x, ys):
    """Squared gradients of log p(y | x) for every label (set) y of `ys`, stacked on axis 0."""

    def one(y):
        g = jax.grad(lambda p: _log_likelihood(graphdef, p, x, y))(params)
        return jax.tree_util.tree_map(jnp.square, g)

    return jax.lax.map(one, ys)


@functools.partial(exact_jit, static_argnums=0)
def _fisher_sum_labels(graphdef, params, inputs, labels):
    """Sum over examples of the squared gradient of log p(labels | x); labels (batch, draws, ...)."""

    def per_example(x, ys):
        return jax.tree_util.tree_map(lambda s: jnp.mean(s, axis=0), _squared_grads(graphdef, params, x, ys))

    per = jax.vmap(per_example)(inputs, labels)
    return jax.tree_util.tree_map(lambda s: jnp.sum(s, axis=0), per)


@functools.partial(exact_jit, static_argnums=0)
def _fisher_sum_exact(graphdef, params, inputs):
    """Sum over examples of E_{y ~ p(y|x)} (grad log p(y|x))^2, summed over all classes."""

    def per_example(x):
        p = jax.lax.stop_gradient(jnp.exp(_log_probs(graphdef, params, x)))  # (classes,)
        sq = _squared_grads(graphdef, params, x, jnp.arange(p.shape[-1]))
        return jax.tree_util.tree_map(lambda s: jnp.tensordot(p, s, axes=1), sq)

    per = jax.vmap(per_example)(inputs)
    return jax.tree_util.tree_map(lambda s: jnp.sum(s, axis=0), per)


def fisher(checkpoint, params: Params, batches, *, kind: str = "empirical", key=None, samples: int = 1, progress=None) -> Stats:
    """Diagonal Fisher information, averaged per example (Matena & Raffel 2022), as a params-shaped
    pytree. The model must return "logits": (batch, classes), or (batch, tokens, vocab) with
    per-token labels (-100: ignored; an example's log-likelihood sums its tokens).

    kind="empirical": squared gradients of log p(y | x) at the given labels (batch["labels"]).
    kind="expected": y drawn from the model's own prediction: summed exactly over the classes when
    `key` is None (classification only), else `samples` draws per example with explicit keys
    (`key` is split once per batch). Per-token logits are drawn at the positions the empirical
    Fisher would use, those labelled other than -100 when the batch has "labels", else the
    non-padding ones (attention_mask), else all: never for padding or unlabelled positions.
    Per-example gradients are vmapped over each batch: choose the batch size for memory.
    Refused (ValueError naming the batch), before anything is computed on that batch: a model
    without logits, labels of another shape than the logits' or outside their classes, token ids
    outside the vocabulary.
    progress: None, or a callable called with no arguments after each batch."""
    _check_progress(progress, "fisher")
    checkpoint.require_head("the Fisher")
    if kind not in FISHER_KINDS:
        raise InputError(f"kind={kind!r}; choose one of {FISHER_KINDS}")
    if not isinstance(samples, (int, np.integer)) or isinstance(samples, bool) or samples < 1:
        raise InputError(f"samples={samples!r}; expected a positive integer (draws per example)")
    total, examples = None, 0
    for i, batch in enumerate(batches):
        what = f"fisher: batches[{i}]"
        inputs, labels = checkpoint.split_batch(batch, what)
        n = int(next(iter(inputs.values())).shape[0])
        logits_shape = _logits_shape(checkpoint, params, inputs, what)
        if kind == "empirical":
            _labelled(labels, logits_shape, what)
            part = _fisher_sum_labels(checkpoint.graphdef, params, inputs, labels[:, None])
        elif key is None:
            if len(logits_shape) != 2:
                raise InputError(
                    f"{what}: kind='expected' without a key sums exactly over the classes of one "
                    f"prediction per example (classification); these logits have shape {logits_shape}: "
                    "pass key=jax.random.key(...) to sample labels per token"
                )
            part = _fisher_sum_exact(checkpoint.graphdef, params, inputs)
        else:
            predicted = _predicted(inputs, labels, logits_shape, what) if len(logits_shape) > 2 else None
            key, sub = jax.random.split(key)
            logits = checkpoint.apply(params, **inputs)["logits"].astype(jnp.float32)
            draws = jax.random.categorical(sub, logits, shape=(samples,) + logits.shape[:-1])
            if predicted is not None:  # per token: a draw only where a token is predicted
                draws = jnp.where(predicted, draws, IGNORE)
            part = _fisher_sum_labels(checkpoint.graphdef, params, inputs, jnp.moveaxis(draws, 0, 1))
        total = part if total is None else jax.tree_util.tree_map(jnp.add, total, part)
        examples += n
        if progress is not None:
            progress()
    if total is None:
        raise InputError("fisher: `batches` is empty")
    return Stats("fisher", jax.tree_util.tree_map(lambda s: s / examples, total), examples, fingerprint(params))


# ---- statistics that follow an alignment ----------------------------------------------------------

@exact
def follow(stats: Stats, result, *deprecated) -> Stats:
    """Gram matrices of the model B that `result` (from `align`) aligned, moved to the aligned
    model `result.params`: equal to Gram matrices recomputed on the aligned model on the same data.

    The aligned model's layer input is `x' = x A^-1` where `A` is how the alignment acts on the
    kernel's input axis (`W' = A W`), so `G' = A^-T G A^-1` (MATH.md §6). `A` is read off by
    applying the transforms to identity probes in place of the kernels (one application per
    block of d_out columns). Diagonal Fisher does not follow rotations (it is not a quadratic
    form): recompute it on the aligned params."""
    if deprecated:  # the former follow(stats, spec, params, result)
        warnings.warn(
            "stats.follow(stats, spec, params, result) is deprecated: the result carries the spec and "
            "B's fingerprint, call stats.follow(stats, result)",
            DeprecationWarning,
            stacklevel=2,
        )
        if len(deprecated) != 2:
            raise InputTypeError("stats.follow(stats, result) takes two arguments")
        params, result = deprecated
        stats.check(params, "the params `follow` was given (the model before alignment)")
    if stats.fingerprint != result.source_fingerprint:
        raise StatsError(
            f"{stats.kind} statistics were computed on other params than the model B this alignment "
            "moved: statistics follow the alignment (MATH.md §6)"
        )
    if stats.kind != "gram":
        raise StatsError(f"{stats.kind} statistics do not follow an alignment: recompute them on result.params")
    bound = result.bound
    # The residual stream's T moves the input side of the kernels that read the stream: their
    # Grams follow it on both sides (T^T G T). The groups are followed below, without it.
    moved_streams = bound.streams_in(result.transforms)
    group_transforms = {k: v for k, v in result.transforms.items() if k not in {s.name for s in moved_streams}}
    reader_of = {path: s for s in moved_streams for path, axis in s.axes if axis == 0}
    # A kernel's Gram reads its input axis alone: it follows the groups acting there, whatever acts on
    # its output axis (MLA's latent readers: the latent on the input, the heads on the output).
    acting: dict = {}
    for group in bound.groups:
        for member in group.members:
            for path in member.paths:
                acting.setdefault(path, {}).setdefault(member.axis, set()).add(group.name)
    shapes_all = dict(bound.shapes)
    moved, inputs_moved = {}, {}
    for path in stats.values:
        on = acting.get(path, {})
        if 0 not in on:  # the input axis is not transformed: the layer sees the same inputs
            moved[path] = stats.values[path]
        elif on[0] & set().union(*(names for axis, names in on.items() if axis != 0)):
            raise StatsError(f"{path}: a group acts on both axes of this kernel; its Gram cannot be moved")
        else:
            inputs_moved.setdefault(frozenset(on[0]), []).append(path)
    for names, paths in inputs_moved.items():
        groups = [g for g in bound.groups if g.name in names]
        for path, a in _input_maps(groups, {p: shapes_all[p] for p in paths}, shapes_all, group_transforms).items():
            left = jnp.linalg.solve(a.T, jnp.asarray(stats.values[path], jnp.float32))  # A^-T G
            moved[path] = jnp.linalg.solve(a.T, left.T).T  # (A^-T G) A^-1
    for path in set(reader_of) & set(moved):
        t = result.transforms[reader_of[path].name]
        moved[path] = t.act(t.act(jnp.asarray(moved[path], jnp.float32), 0), 1)
    return Stats("gram", moved, stats.count, fingerprint(result.params))


def _input_maps(groups, shapes: dict, shapes_all: dict, transforms: dict) -> dict:
    """{path: A} for the kernels `shapes` ({path: (d_in, ...)}), where `groups` act on their input
    axis as `W' = A W`: read off by applying the groups to identity probes, column block by column
    block (each probe tree holds block k of the identity in every kernel, so one application per
    block serves all layers); their other leaves only fill the call (zeros, their outputs unused)."""
    fill = {p: jnp.zeros(shapes_all[p], jnp.float32) for g in groups for m in g.members for p in m.paths if p not in shapes}
    flat = {path: (shape[0], math.prod(shape[1:])) for path, shape in shapes.items()}  # (d_in, d_out): a head's kernel (d, h, dh) flattened
    blocks = {path: list(range(0, d_in, d_out)) for path, (d_in, d_out) in flat.items()}
    columns = {path: [] for path in shapes}
    for k in range(max((len(b) for b in blocks.values()), default=0)):
        probes = {}
        for path, (d_in, d_out) in flat.items():
            start = blocks[path][k] if k < len(blocks[path]) else d_in
            width = min(d_out, d_in - start)
            probe = jnp.zeros((d_in, d_out), jnp.float32).at[start:start + width, :width].set(jnp.eye(width, dtype=jnp.float32))
            probes[path] = probe.reshape(shapes[path])
        out = act_on_groups(groups, {**fill, **probes}, transforms)
        for path, (d_in, d_out) in flat.items():
            if k < len(blocks[path]):
                columns[path].append(out[path].reshape(d_in, d_out)[:, : min(d_out, d_in - blocks[path][k])])
    return {path: jnp.concatenate(columns[path], axis=1) for path in shapes}
