"""Helium, ERNIE 4.5 and ERNIE 4.5 MoE, beyond the conformance contracts (tests/family_cases.py):
their config.json as the Hub's releases write it read as transformers reads it, Helium's refusal of a
head width transformers cannot run, a rotated residual stream (pre-RMSNorm decoders; the
conformance module's rotation contract lists the families it rotates) kept in transformers and
undone by `rotsym align --residual rotation`, and the MoE router's correction bias (zero in every
model save_reference writes) read, run and permuted with its experts."""

from __future__ import annotations

import copy
import json
import warnings

import jax
import numpy as np
import pytest
import torch
import transformers as tf
from checkpoint_utils import assert_stacked_reads_as_apart
from family_cases import BY_ID, model_inputs, reference
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.errors import InputError
from rotsym_jax.transforms import KINDS, RESIDUAL, UNIT_KINDS

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
    # ERNIE-4.5-21B-A3B-PT's form (its mixture from the 2nd layer to the last, 64 experts, 2 shared, one MTP layer)
    "ernie-4.5-21b-a3b": {"architectures": ["Ernie4_5_MoeForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 2560,
                          "intermediate_size": 12288, "max_position_embeddings": 131072, "model_type": "ernie4_5_moe", "num_attention_heads": 20,
                          "num_key_value_heads": 4, "num_hidden_layers": 28, "pad_token_id": 0, "rms_norm_eps": 1e-05, "use_cache": False,
                          "vocab_size": 103424, "rope_theta": 500000, "use_bias": False, "tie_word_embeddings": True, "moe_num_experts": 64,
                          "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": 27, "moe_intermediate_size": 1536,
                          "moe_k": 6, "moe_layer_interval": 1, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"},
    "ernie-moe-minimal-head-dim": {"model_type": "ernie4_5_moe", "head_dim": 64, "moe_layer_end_index": -1, "moe_layer_interval": 2},
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
        assert json.loads(json.dumps(getattr(ours, field))) == json.loads(json.dumps(getattr(theirs, field, None)))  # (a key the class lacks: None), field
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


@pytest.mark.slow  # as the conformance rotation contract (beyond GPT-2 and ViT): the planted contract runs by default
@pytest.mark.parametrize("case_id", ["HeliumForCausalLM", "Ernie4_5ForCausalLM[untied-mha-head-dim-null]",
                                     "Ernie4_5_MoeForCausalLM[untied-no-shared-every-layer]"])
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


def test_ernie_moe_correction_bias_is_read_changes_the_choice_and_moves_with_the_experts(tmp_path):
    """The correction bias picks the experts (not their weights): set, it changes transformers'
    logits here; our forward pass computes them, and a random element of every group (experts
    permuted with their router rows and bias entries) keeps them in transformers."""
    case = BY_ID["Ernie4_5_MoeForCausalLM"]
    model = save_reference(case.model_class, case.config(), tmp_path / "zero")
    inputs = model_inputs(case, model.config)
    unbiased = reference(model, inputs)["logits"]
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.3 * torch.randn_like(p))
    a = tmp_path / "a"
    model.save_pretrained(a)
    want = reference(model, inputs)["logits"]
    scale = float(np.abs(want).max())
    assert np.abs(want - unbiased).max() > 1e-2 * scale, "the correction bias changed no choice: the test cannot tell"
    ck = rj.load_hf(a)
    ours = np.where(inputs["attention_mask"][..., None].astype(bool), np.asarray(ck.apply(ck.params, **inputs)["logits"]), 0.0)  # as `reference`
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-4 * scale, err_msg="ours")
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1), KINDS + UNIT_KINDS)
    t[RESIDUAL] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
    b = rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "b")
    loaded = case.model_class.from_pretrained(b, attn_implementation="eager").eval()
    np.testing.assert_allclose(reference(loaded, inputs)["logits"], want, rtol=0, atol=1e-4 * scale, err_msg="B planted, in transformers")


def test_ernie_moe_experts_stored_stacked_read_as_the_ones_stored_apart(tmp_path):
    """transformers 5's state dict (what tools that save it write): the experts stacked and the
    correction bias under the router (`mlp.gate.moe_statics`, which save_pretrained renames to
    `mlp.moe_statics`): the same leaves as save_pretrained's tensors, written back as they came."""
    case = BY_ID["Ernie4_5_MoeForCausalLM"]
    model = save_reference(case.model_class, case.config(), tmp_path / "apart")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p))
    model.save_pretrained(tmp_path / "apart")
    names = ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.moe_statics.e_score_correction_bias")
    assert_stacked_reads_as_apart(model, tmp_path / "apart", tmp_path, names, skip=("lm_head.weight",))  # tied: the embedding's


def test_ernie_moe_multi_token_prediction_block_is_skipped_as_transformers_skips_it(tmp_path):
    """A full ERNIE-4.5-MoE checkpoint holds its MTP layer (`model.mtp_*`), which transformers
    neither loads nor reports (`_keys_to_ignore_on_load_unexpected`): read without it."""
    from safetensors.numpy import load_file, save_file

    case = BY_ID["Ernie4_5_MoeForCausalLM"]
    a = tmp_path / "a"
    save_reference(case.model_class, case.config(), a)
    tensors = load_file(a / "model.safetensors")
    extra = {"model.mtp_linear_proj.0.weight": np.ones((64, 128), np.float32), "model.mtp_block.0.mlp.up_proj.weight": np.ones((96, 64), np.float32)}
    save_file({**tensors, **extra}, a / "model.safetensors", metadata={"format": "pt"})
    _, info = case.model_class.from_pretrained(a, output_loading_info=True)
    assert not any(info.values()), info
    ck = rj.load_hf(a)
    files = hf.TensorFiles(rj.save_hf(ck, ck.params, tmp_path / "saved"))
    try:
        assert set(files.names()) == set(tensors)
    finally:
        files.close()
