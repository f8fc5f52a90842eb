"""DistilBERT: every head transformers defines read, run against transformers' PyTorch model
(float32, non-zero biases and non-unit gains), saved byte-exact, and aligned on the command line."""

import json

import numpy as np
import pytest
import transformers as tf
from parity_utils import assert_outputs_match, assert_same_state_dict, reference_outputs, save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax import cli

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


# The default run's time budget: the masked LM and the sequence classifier by default, the other heads in the slow run.
DEFAULT = ("ForMaskedLM", "ForSequenceClassification")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n.endswith(DEFAULT) else [pytest.mark.slow]) for n in sorted(CASES)])
def test_every_head_matches_transformers_round_trips_and_aligns(name, tmp_path):
    make_config, head = CASES[name]
    cls = getattr(tf, name)
    model = save_reference(cls, make_config(), tmp_path / "a", seed=0)
    ck = rj.load_hf(tmp_path / "a")
    assert ck.family == "distilbert" and ck.layout.head == head
    ids, mask = token_batch(60, batch=2, length=7)
    inputs = {"input_ids": np.stack([ids, ids[::-1]], axis=1), "attention_mask": np.stack([mask, mask[::-1]], axis=1)} if head == "multiple_choice" \
        else {"input_ids": ids, "attention_mask": mask}
    if head != "multiple_choice":
        ref = reference_outputs(model, **inputs)
        keys = [k for k in ("last_hidden_state", "logits", "start_logits", "end_logits") if k in ref]
        ours = ck.apply(ck.params, **inputs)
        assert_outputs_match(ours, ref, keys, valid=mask.astype(bool) if "last_hidden_state" in keys else None)
    rj.save_hf(ck, ck.params, tmp_path / "saved")
    reloaded, info = cls.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not any(info.values()), info
    assert_same_state_dict(reloaded, model)
    # B: A with every group moved (post-LN: the stream permuted): transformers keeps A's outputs, align undoes it
    spec = rj.spec_for(ck)
    import jax

    t = rj.random_transform(spec, ck.params, jax.random.key(1), ("heads", "perm", "qk", "vo"))
    t["residual"] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
    rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "b")
    moved = reference_outputs(cls.from_pretrained(tmp_path / "b").eval(), **inputs)
    want = reference_outputs(model, **inputs)
    for key in want:
        if key != "last_hidden_state":
            np.testing.assert_allclose(moved[key], want[key], rtol=0, atol=1e-4 * max(1.0, np.abs(want[key]).max()))
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out"), "--quiet", "--residual", "permutation",
                     "--heads", "permute"]) == 0
    report = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())["result"]
    assert report["after"]["total"] <= 1e-4 * report["before"]["total"]


def test_rotation_of_the_stream_is_refused_and_an_untied_masked_lm_is_named(tmp_path):
    ck = rj.init_checkpoint(tf.DistilBertConfig(**SMALL), __import__("jax").random.key(0), head="sequence_classification")
    with pytest.raises(ValueError, match="pre-norm"):
        rj.align(ck.params, ck.params, rj.spec_for(ck), residual="rotation")
    with pytest.raises(ValueError, match="untied DistilBERT"):
        rj.init_checkpoint(tf.DistilBertConfig(**SMALL, tie_word_embeddings=False), __import__("jax").random.key(0), head="masked_lm")
