"""DistilBERT: what is particular to it. Its heads run every contract in test_conformance.py."""

import jax
import pytest
import transformers as tf
from family_cases import DISTILBERT

import rotsym_jax as rj

pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = DISTILBERT


def test_rotation_of_the_stream_is_refused_and_an_untied_masked_lm_is_named(tmp_path):
    ck = rj.init_checkpoint(tf.DistilBertConfig(**SMALL), jax.random.key(0), head="sequence_classification")
    with pytest.raises(ValueError, match="pre-norm"):
        rj.align(ck.params, ck.params, rj.spec_for(ck), residual="rotation")
    with pytest.raises(ValueError, match="untied DistilBERT"):
        rj.init_checkpoint(tf.DistilBertConfig(**SMALL, tie_word_embeddings=False), jax.random.key(0), head="masked_lm")
