"""DistilBERT: every head transformers defines read, run against transformers' PyTorch model
(float32, non-zero biases and non-unit gains), saved byte-exact, and aligned on the command line."""

import jax
import pytest
import transformers as tf
from encoder_heads import by_budget, check_head

import rotsym_jax as rj

pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(vocab_size=60, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_position_embeddings=20)
CASES = {
    "DistilBertModel": (lambda: tf.DistilBertConfig(**SMALL), None),
    "DistilBertForMaskedLM": (lambda: tf.DistilBertConfig(**SMALL), "masked_lm"),
    "DistilBertForSequenceClassification": (lambda: tf.DistilBertConfig(**SMALL, num_labels=3), "sequence_classification"),
    "DistilBertForTokenClassification": (lambda: tf.DistilBertConfig(**SMALL, num_labels=5, activation="relu"), "token_classification"),
    "DistilBertForQuestionAnswering": (lambda: tf.DistilBertConfig(**SMALL, sinusoidal_pos_embds=True), "question_answering"),
    "DistilBertForMultipleChoice": (lambda: tf.DistilBertConfig(**SMALL), "multiple_choice"),
}


@pytest.mark.parametrize("name", by_budget(CASES))
def test_every_head_matches_transformers_round_trips_and_aligns(name, tmp_path):
    make_config, head = CASES[name]
    check_head(name, make_config(), head, "distilbert", tmp_path, length=7)


def test_rotation_of_the_stream_is_refused_and_an_untied_masked_lm_is_named(tmp_path):
    ck = rj.init_checkpoint(tf.DistilBertConfig(**SMALL), jax.random.key(0), head="sequence_classification")
    with pytest.raises(ValueError, match="pre-norm"):
        rj.align(ck.params, ck.params, rj.spec_for(ck), residual="rotation")
    with pytest.raises(ValueError, match="untied DistilBERT"):
        rj.init_checkpoint(tf.DistilBertConfig(**SMALL, tie_word_embeddings=False), jax.random.key(0), head="masked_lm")
