"""save_hf's sharded output read by transformers itself, not only by our own loader: the index
and the shards it names load with the Auto classes (task model and base model), every tensor
bitwise as in the source checkpoint, with the source's outputs."""

import json

import numpy as np
import pytest
import transformers as tf
from parity_utils import assert_same_state_dict, reference_outputs, save_reference, token_batch
from safetensors import safe_open

import rotsym_jax as rj

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99)
MAX_SHARD_BYTES = 8_000  # the models hold ~60-90 kB: a dozen shards; the embeddings alone exceed it

# (source class, Auto class for the task model, config)
CASES = {
    "llama-gqa": (
        tf.LlamaForCausalLM, tf.AutoModelForCausalLM,
        lambda: tf.LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "bert-cls": (
        tf.BertForSequenceClassification, tf.AutoModelForSequenceClassification,
        lambda: tf.BertConfig(**SMALL, num_labels=3),
    ),
}


def _shards_as_read_by_safetensors(folder):
    """{tensor name: shard file name} and {shard file name: bytes of its tensors}, from the files."""
    where, sizes = {}, {}
    for file in sorted(folder.glob("model-*-of-*.safetensors")):
        with safe_open(file, framework="np") as f:
            for name in f.keys():
                assert name not in where, f"{name} is in {where.get(name)} and in {file.name}"
                where[name] = file.name
                sizes[file.name] = sizes.get(file.name, 0) + f.get_tensor(name).nbytes
    return where, sizes


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_save_loads_in_transformers(case, tmp_path):
    cls, auto_cls, make_config = CASES[case]
    source = save_reference(cls, make_config(), tmp_path / "source")
    ck = rj.load_hf(tmp_path / "source")
    out = rj.save_hf(ck, ck.params, tmp_path / "sharded", max_shard_bytes=MAX_SHARD_BYTES)

    # transformers reads it with its own reader (the index, then the shards it names): the task
    # model and the base model, every tensor bitwise as in the source...
    model, info = auto_cls.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert type(model) is cls
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_same_state_dict(model, source)
    base, info = tf.AutoModel.from_pretrained(out, output_loading_info=True, attn_implementation="eager")
    assert type(base) is type(source.base_model)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert_same_state_dict(base, source.base_model)

    # ...which compute what the source computes.
    ids, mask = token_batch(ck.config.vocab_size, seed=1)
    valid = mask.astype(bool)
    for loaded, ref in ((model.eval(), source), (base.eval(), source.base_model)):
        got, want = (reference_outputs(m, input_ids=ids, attention_mask=mask) for m in (loaded, ref))
        key = "logits" if "logits" in want else "last_hidden_state"
        a, b = got[key], want[key]
        if a.shape[:2] == valid.shape:
            a, b = a[valid], b[valid]
        assert float(np.std(b)) > 0.1
        np.testing.assert_array_equal(a, b, err_msg=key)

    # The layout: no single file; an index whose weight_map names each tensor's shard, as the
    # shards hold them, and whose total_size is their bytes; shards within the limit (or one tensor).
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    where, sizes = _shards_as_read_by_safetensors(out)
    assert len(sizes) >= 3
    assert index["weight_map"] == where
    assert index["metadata"]["total_size"] == sum(sizes.values())
    for file, size in sizes.items():
        assert size <= MAX_SHARD_BYTES or sum(v == file for v in where.values()) == 1, file
    assert set(where) == {k for k in source.state_dict() if not k.endswith("position_ids")}
