"""ModernBERT: every head transformers defines read, run against transformers' PyTorch model
(float32, non-zero biases and non-unit gains, local and global layers with their RoPE bases),
saved byte-exact, kept by transformers under every group, and aligned on the command line."""


import jax
import numpy as np
import pytest
import transformers as tf
from encoder_heads import by_budget, check_head
from parity_utils import token_batch

import rotsym_jax as rj

pytestmark = pytest.mark.usefixtures("float32_models")

# 3 layers, global every 2nd (layers 0 and 2), a band of 2 tokens in layer 1; 9 tokens
SMALL = dict(vocab_size=60, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=32,
             global_attn_every_n_layers=2, local_attention=4, global_rope_theta=1000.0, local_rope_theta=50.0, pad_token_id=0,
             bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
BIASES = dict(norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True)
CASES = {
    "ModernBertModel": (lambda: tf.ModernBertConfig(**SMALL, **BIASES), None),
    "ModernBertForMaskedLM": (lambda: tf.ModernBertConfig(**SMALL), "masked_lm"),
    "ModernBertForSequenceClassification": (lambda: tf.ModernBertConfig(**SMALL, num_labels=3, classifier_pooling="mean", **BIASES),
                                            "sequence_classification"),
    "ModernBertForTokenClassification": (lambda: tf.ModernBertConfig(**SMALL, num_labels=5, classifier_activation="silu"), "token_classification"),
    "ModernBertForQuestionAnswering": (lambda: tf.ModernBertConfig(**SMALL, **BIASES), "question_answering"),
    "ModernBertForMultipleChoice": (lambda: tf.ModernBertConfig(**SMALL), "multiple_choice"),
}


@pytest.mark.parametrize("name", by_budget(CASES))
def test_every_head_matches_transformers_round_trips_and_aligns(name, tmp_path):
    make_config, head = CASES[name]
    check_head(name, make_config(), head, "modernbert", tmp_path, length=9)


def test_the_embedding_norm_is_on_the_stream_so_a_rotation_needs_its_gain_uniform(tmp_path):
    """The embedding LayerNorm's output is the stream itself: its gain has no reader to fold into.
    With that gain uniform (as initialised) a rotation fixing the ones vector keeps the function
    once the other norms are folded; with it perturbed, the rotation is refused naming it."""
    config = tf.ModernBertConfig(**SMALL, num_labels=3)
    ck = rj.init_checkpoint(config, jax.random.key(0), head="sequence_classification")
    spec = rj.spec_for(ck)
    keys = iter(jax.random.split(jax.random.key(5), 100))
    params = jax.tree.map(lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape), ck.params)
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
