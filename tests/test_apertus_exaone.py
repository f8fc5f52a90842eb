"""Apertus and EXAONE 3 (model types apertus, exaone), two records of the Llama family. The generic
contracts run on their rows of family_cases.py; here, every element kind proven in transformers,
and EXAONE's checkpoints as LG's code wrote them (its own config keys, `ExaoneForCausalLM`)."""

import json

import numpy as np
import pytest
import torch
import transformers as tf
from family_cases import TEXT
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")
SIZES = dict(TEXT, num_key_value_heads=2, pad_token_id=0)


@pytest.mark.parametrize("cls, config", [(tf.ApertusForCausalLM, lambda: tf.ApertusConfig(**SIZES, attention_bias=True)),
                                         (tf.LlamaForCausalLM, lambda: tf.ExaoneConfig(**SIZES, eos_token_id=2, mlp_bias=True))],
                         ids=["apertus", "exaone"])
def test_every_group_holds_in_transformers(tmp_path, cls, config):
    save_reference(cls, config(), tmp_path / "lm")
    checks = {c.element: c for c in verify_groups(tmp_path / "lm")}
    assert all(c.ok for c in checks.values()), checks
    assert {"FFN unit permutations", "residual rotation"} <= {e for e, c in checks.items() if c.difference is not None}, checks


def test_an_exaone_checkpoint_as_lgs_code_wrote_it_reads_and_saves_as_transformers_reads_it(tmp_path):
    """EXAONE-3.0's config.json names the depth num_layers, the norm's eps layer_norm_epsilon and the
    activation activation_function, its class ExaoneForCausalLM (remote code, never run here):
    read, our forward pass is transformers' (which runs LlamaForCausalLM), every group is proven, and
    what we save keeps LG's tensor names and loads in transformers with the same logits."""
    model = save_reference(tf.LlamaForCausalLM, tf.ExaoneConfig(**SIZES, eos_token_id=2), tmp_path / "lm")
    raw = json.loads((tmp_path / "lm" / "config.json").read_text())
    for ours, theirs in (("num_hidden_layers", "num_layers"), ("rms_norm_eps", "layer_norm_epsilon"), ("hidden_act", "activation_function")):
        raw[theirs] = raw.pop(ours)
    raw.update(architectures=["ExaoneForCausalLM"], auto_map={"AutoModelForCausalLM": "modeling_exaone.ExaoneForCausalLM"})
    (tmp_path / "lm" / "config.json").write_text(json.dumps(raw))
    ck = rj.load_hf(tmp_path / "lm")
    assert (ck.family, ck.layout.head, ck.layout.prefix) == ("exaone", "lm", "transformer.")
    ids = np.random.default_rng(0).integers(3, TEXT["vocab_size"], (2, 9))
    with torch.no_grad():
        want = model(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ck.apply(ck.params, input_ids=ids)["logits"]), want, atol=1e-5 * np.abs(want).max())
    # transformers' LlamaConfig alone reads num_layers as nothing (32 layers, most missing): the proof reads AutoConfig's
    assert all(c.ok for c in verify_groups(tmp_path / "lm"))
    saved = rj.save_hf(ck, ck.params, tmp_path / "saved")
    assert "transformer.h.1.mlp.c_fc_0.weight" in rj.hf.TensorFiles(saved).names()
    with torch.no_grad():
        got = tf.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
