"""Helium and ERNIE 4.5 (dense), beyond the conformance contracts (tests/family_cases.py): their
config.json as the Hub's releases write it read as transformers reads it, Helium's refusal of a head
width transformers cannot run, and a rotated residual stream (both are pre-RMSNorm decoders; the
conformance module's rotation contract lists the families it rotates) kept in transformers and
undone by `rotsym align --residual rotation`."""

from __future__ import annotations

import copy
import json
import warnings

import jax
import numpy as np
import pytest
import torch
import transformers as tf
from family_cases import BY_ID, model_inputs, reference
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.errors import InputError
from rotsym_jax.transforms import RESIDUAL

pytestmark = pytest.mark.usefixtures("float32_models")

# config.json in the form of kyutai/helium-1-2b's and baidu/ERNIE-4.5-0.3B-PT's (legacy rope_theta, no rope_parameters)
HUB = {
    "helium-1-2b": {"architectures": ["HeliumForCausalLM"], "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128,
                    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 4096, "mlp_bias": False,
                    "model_type": "helium", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "pad_token_id": 3,
                    "rms_norm_eps": 1e-08, "rope_theta": 20000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 64000},
    "ernie-4.5-0.3b": {"architectures": ["Ernie4_5ForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 1024,
                       "intermediate_size": 3072, "max_position_embeddings": 131072, "model_type": "ernie4_5", "num_attention_heads": 16,
                       "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 18, "pad_token_id": 0, "rms_norm_eps": 1e-05,
                       "rope_theta": 500000, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_bias": False, "use_cache": False,
                       "vocab_size": 103424},
    # the defaults where config.json is silent, a null head_dim and kv heads, a legacy linear rope_scaling
    "ernie-null-head-dim": {"model_type": "ernie4_5", "hidden_size": 64, "num_attention_heads": 4, "head_dim": None, "num_key_value_heads": None,
                            "use_bias": True, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "helium-minimal": {"model_type": "helium"},
}


@pytest.mark.parametrize("name", sorted(HUB))
def test_hub_config_reads_as_transformers_reads_it(name):
    raw = HUB[name]
    ours = hf.read_config(raw)
    schema = hf.family_for(raw["model_type"]).schema(raw["model_type"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = getattr(tf, schema.class_name).from_dict(copy.deepcopy(raw))
    for field in schema.fields:
        assert json.loads(json.dumps(getattr(ours, field))) == json.loads(json.dumps(getattr(theirs, field))), field
    family = hf.family_for(raw["model_type"])
    assert family.spec(ours) == family.spec(theirs)


def test_helium_heads_narrower_than_the_stream_are_refused_as_transformers_cannot_run_them():
    """HeliumAttention's o_proj reads hidden_size entries, whatever heads * head_dim is."""
    config = tf.HeliumConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                             intermediate_size=48)
    model = tf.HeliumForCausalLM(config).eval()
    with pytest.raises(RuntimeError), torch.no_grad():
        model(torch.tensor([[4, 5, 6]]))
    with pytest.raises(InputError, match=r"num_attention_heads \* head_dim = 4 \* 4 = 16 is not hidden_size=32"):
        hf.read_config(json.loads(config.to_json_string()))


@pytest.mark.parametrize("case_id", ["HeliumForCausalLM", "Ernie4_5ForCausalLM[untied-mha-head-dim-null]"])
def test_a_rotated_stream_keeps_the_function_and_align_undoes_it(case_id, tmp_path):
    """B: A folded, every group and the residual stream rotated: transformers computes A's
    logits from B's tensors (the interleaved q/k written back in Helium's and ERNIE's order), and
    `--residual rotation` aligns B back to A."""
    case = BY_ID[case_id]
    a = tmp_path / "a"
    model = save_reference(case.model_class, case.config(), a)
    inputs = model_inputs(case, model.config)
    want = reference(model, inputs)["logits"]
    ck = rj.load_hf(a)
    spec = rj.spec_for(ck)
    folded = rj.fold_norms(spec, ck.params)
    t = rj.random_transform(spec, folded, jax.random.key(1), ("perm", "qk", "vo"))
    t[RESIDUAL] = rj.random_residual(spec, folded, jax.random.key(2), "rotation")
    b = rj.save_hf(ck, rj.apply_transform(spec, folded, t), tmp_path / "b")
    scale = float(np.abs(want).max())

    def logits(folder):
        loaded = case.model_class.from_pretrained(folder, attn_implementation="eager").eval()
        return reference(loaded, inputs)["logits"]

    np.testing.assert_allclose(logits(b), want, rtol=0, atol=1e-4 * scale, err_msg="B rotated, in transformers")
    out = tmp_path / "out"
    assert cli.main(["align", str(a), str(b), str(out), "--quiet", "--residual", "rotation", "--heads", "permute"]) == 0
    np.testing.assert_allclose(logits(out), want, rtol=0, atol=1e-4 * scale, err_msg="B aligned, in transformers")
    report = json.loads((out / "rotsym_report.json").read_text())["result"]
    assert report["before"]["total"] > 1.0 and report["after"]["total"] <= 1e-4 * report["before"]["total"]
