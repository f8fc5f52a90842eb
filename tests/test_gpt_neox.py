"""GPT-NeoX (Pythia): our Flax decoder against transformers (parallel and sequential residual,
partial and full rotary, tied and untied heads, Pythia's legacy config keys), the round trip, and
the fused per-head query_key_value split and re-fused exactly."""

import json

import numpy as np
import pytest
import transformers as tf
from parity_utils import assert_outputs_match, reference_outputs, token_batch
from test_llama import save_random

import rotsym_jax as rj

pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=99, max_position_embeddings=32)

# Pythia: parallel residual, a quarter of each head rotary (4 of 16 dims)
PYTHIA = (tf.GPTNeoXForCausalLM, lambda: tf.GPTNeoXConfig(**SMALL, rotary_pct=0.25))


def _inputs(config, seed=0):
    ids, mask = token_batch(config.vocab_size, pad_id=0, seed=seed)
    return dict(input_ids=ids, attention_mask=mask)


def test_the_fused_projection_is_split_per_head(tmp_path):
    """query_key_value's rows are [head, (q | k | v), dh]: head 1's query rows are rows 48..63."""
    cls, make_config = PYTHIA
    model = save_random(cls, make_config(), tmp_path)
    ck = rj.load_hf(tmp_path)
    fused = model.gpt_neox.layers[0].attention.query_key_value.weight.detach().numpy()
    query = np.asarray(ck.params["layers"][0]["attention"]["query"]["kernel"])
    np.testing.assert_array_equal(query[:, 16:32], fused[48:64].T)
    assert rj.bind(rj.spec_for(ck), ck.params).attention[0].geometry.rotary_dim == 4


def test_pythia_config_json_as_on_disk(tmp_path):
    """Pythia's config.json names the rotary part and base in the legacy keys rotary_pct and
    rotary_emb_base: read as transformers reads them (here 0.5 of each head, base 1000)."""
    cls, make_config = PYTHIA
    model = save_random(cls, make_config(), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rotary_pct=0.5, rotary_emb_base=1000)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ck = rj.load_hf(tmp_path)
    assert ck.model_config.rope_parameters["partial_rotary_factor"] == 0.5 and ck.model_config.rope_parameters["rope_theta"] == 1000
    legacy = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert legacy.config.rope_parameters["partial_rotary_factor"] == 0.5
    inputs = _inputs(ck.config)
    assert_outputs_match(ck.apply(ck.params, **inputs), reference_outputs(legacy, **inputs), ["logits"], valid=inputs["attention_mask"].astype(bool))
    assert np.abs(reference_outputs(legacy, **inputs)["logits"] - reference_outputs(model, **inputs)["logits"]).max() > 1e-5  # the keys took effect


def test_unsupported_rope_is_refused_naming_it(tmp_path):
    cls, make_config = PYTHIA
    save_random(cls, make_config(), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for change, message in (({"rope_parameters": {**raw["rope_parameters"], "rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
                            ({"rope_parameters": {**raw["rope_parameters"], "partial_rotary_factor": 0.3}}, "gives 4.8 rotary dims")):
        (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(rj.CheckpointError, match=message):
            rj.load_hf(tmp_path)
