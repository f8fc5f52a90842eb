"""ModernBERT: what is particular to it (the embedding norm on the stream, one role per leaf).
Its heads run every contract in test_conformance.py."""

import jax
import numpy as np
import pytest
import transformers as tf
from checkpoint_utils import plus_noise
from family_cases import MODERNBERT
from parity_utils import token_batch

import rotsym_jax as rj

pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = MODERNBERT


def test_the_embedding_norm_is_on_the_stream_so_a_rotation_needs_its_gain_uniform(tmp_path):
    """The embedding LayerNorm's output is the stream itself: its gain has no reader to fold into.
    With that gain uniform (as initialised) a rotation fixing the ones vector keeps the function
    once the other norms are folded; with it perturbed, the rotation is refused naming it."""
    config = tf.ModernBertConfig(**SMALL, num_labels=3)
    ck = rj.init_checkpoint(config, jax.random.key(0), head="sequence_classification")
    spec = rj.spec_for(ck)
    keys = iter(jax.random.split(jax.random.key(5), 100))
    params = jax.tree.map(lambda x: plus_noise(x, next(keys), 0.2), ck.params)
    params["embeddings"]["norm"]["scale"] = ck.params["embeddings"]["norm"]["scale"]  # uniform
    folded = rj.fold_norms(spec, params)
    t = rj.random_residual(spec, folded, jax.random.key(3), "rotation")
    moved = rj.apply_transform(spec, folded, {**rj.identity_transform(rj.bind(spec, folded)), "residual": t})
    ids, mask = token_batch(60, batch=2, length=9)
    want = np.asarray(ck.apply(params, input_ids=ids, attention_mask=mask)["logits"])
    got = np.asarray(ck.apply(moved, input_ids=ids, attention_mask=mask)["logits"])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    bad = jax.tree.map(lambda x: x, params)
    bad["embeddings"]["norm"]["scale"] = params["embeddings"]["norm"]["scale"] * 1.5 + 0.1 * jax.random.normal(jax.random.key(9), (32,))
    with pytest.raises(ValueError, match="embeddings/norm/scale"):
        rj.align(bad, bad, spec, residual="rotation")


def test_a_leaf_has_one_role_on_the_stream_in_every_head():
    """The residual rules keep one rule per leaf, so a record whose heads give one leaf name two roles
    (ModernBERT's masked LM writes the stream through head/transform, its classifiers do not) is
    refused when its rules are built; every built-in family's are consistent."""
    import dataclasses

    from rotsym_jax.families import FAMILIES
    from rotsym_jax.families.family import Head, linear
    from rotsym_jax.families.modernbert import MODERNBERT

    for family in FAMILIES:
        family.residual_spec()
    clash = Head("clash", "ForClash", linear("head.dense", "head/transform", "hidden_size", "hidden_size", reads=True))
    with pytest.raises(ValueError, match="head/transform/kernel is on the residual stream along"):
        dataclasses.replace(MODERNBERT, heads=MODERNBERT.heads + (clash,)).residual_spec()
