"""Labels and the loss of a head's logits: what data methods, learned alignment and barriers read,
without the forward passes (`nets`) that produce the logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import InputError

IGNORE = -100


def label_nll(logits, labels) -> tuple[jax.Array, jax.Array]:
    """(summed negative log-likelihood of `labels` under `logits`, number of scored labels):
    one label per example (logits (B, C), labels (B,)) or per token (logits (B, T, C), labels
    (B, T)), IGNORE not scored; in float32."""
    logits = logits.astype(jnp.float32)
    valid = labels != IGNORE
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(valid, picked, 0.0)), jnp.sum(valid)


def next_token_labels(input_ids, attention_mask=None) -> np.ndarray:
    """A causal LM's labels (B, T) int32: position t is scored on the next token (the library's
    convention, as statistics'); padding and the last position not scored (IGNORE)."""
    ids = np.asarray(input_ids)
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask)
    labels = np.full_like(ids, IGNORE)
    labels[:, :-1] = np.where(mask[:, 1:] > 0, ids[:, 1:], IGNORE)
    return labels.astype(np.int32)


def lm_labels(checkpoint, inputs) -> np.ndarray:
    """The labels an LM scores its inputs on: a decoder's next tokens (`next_token_labels`); an
    encoder–decoder's, the next tokens of its decoder inputs where given, else the encoder's own
    ids, which its decoder reads shifted right (position t predicts token t)."""
    mask = inputs.get("attention_mask")
    if not {"encoder", "decoder"} <= set(checkpoint.params):  # an encoder–decoder's leaves: encoder/..., decoder/...
        return next_token_labels(inputs["input_ids"], mask)
    if "decoder_input_ids" in inputs:
        return next_token_labels(inputs["decoder_input_ids"], inputs.get("decoder_attention_mask"))
    ids = np.asarray(inputs["input_ids"])
    return np.where(np.ones_like(ids) if mask is None else np.asarray(mask) > 0, ids, IGNORE).astype(np.int32)


def check_labels(labels, logits_shape, what) -> None:
    """ValueError, naming `what`, for labels that do not index the logits' last axis: one per
    example, or per token (IGNORE: skipped). Out of range, `take_along_axis` picks nothing and the
    loss is NaN or the example silently adds 0."""
    expected = tuple(logits_shape[:-1])
    if tuple(labels.shape) != expected:
        per = (f"per token: each example's label a list of {logits_shape[1]} label ids, one per token as the inputs are padded "
               f"(-100 for tokens to ignore)" if len(logits_shape) > 2 else "one label per example")
        raise InputError(f"{what}: labels has shape {tuple(labels.shape)}; expected {expected}, the shape of the model's logits "
                         f"{tuple(logits_shape)} without the class axis ({per})")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise InputError(f"{what}: labels has dtype {labels.dtype}; expected integer class indices")
    classes, per_token = logits_shape[-1], len(logits_shape) > 2
    values = np.asarray(labels)
    bad = (values < 0) | (values >= classes)
    if per_token:
        bad &= values != IGNORE
    if bad.any():
        space = (f"the model predicts {classes} classes per token (an LM head: the vocabulary); {IGNORE} marks an ignored token"
                 if per_token else f"the model has {classes} classes")
        count = int(bad.sum())
        raise InputError(f"{what}: labels holds {count} value{'s' * (count != 1)} in [{values[bad].min()}, {values[bad].max()}] "
                         f"outside [0, {classes}): {space}")


# Which hidden states a linear head reads.
