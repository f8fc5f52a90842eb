"""Granite 3.0/3.1's mixtures (model types granitemoe and granitemoeshared), read through Granite-4
hybrid's tables and forward pass. The generic contracts run on their rows of family_cases.py; here,
what is particular: config.json as IBM's releases write it, RoPE whatever position_embedding_type
says (transformers builds it always here, unlike the hybrid), the shared MLP only where its width is
positive, both names of the mixture's tensors, and the configs transformers' model fails on."""

from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pytest
import torch
import transformers as tf
from checkpoint_utils import assert_renamed_reads_alike
from family_cases import GRANITE_MOE, reference
from parity_utils import save_reference
from safetensors.numpy import load_file

import rotsym_jax as rj
from rotsym_jax import hf
from rotsym_jax.errors import InputError

pytestmark = pytest.mark.usefixtures("float32_models")

# config.json in the form of ibm-granite/granite-3.1-3b-a800m-instruct's (legacy int rope_theta, tied,
# its multipliers) and of a GraniteMoeShared release (ibm-research/moe-7b-1b-active-shared-experts's form)
HUB = {
    "granite-3.1-3b-a800m": {"architectures": ["GraniteMoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.1,
                             "attention_multiplier": 0.015625, "bos_token_id": 0, "embedding_multiplier": 12.0, "eos_token_id": 0,
                             "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02, "intermediate_size": 512,
                             "logits_scaling": 6.0, "max_position_embeddings": 131072, "model_type": "granitemoe", "num_attention_heads": 24,
                             "num_experts_per_tok": 8, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 40,
                             "output_router_logits": False, "pad_token_id": 0, "residual_multiplier": 0.22, "rms_norm_eps": 1e-06,
                             "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.0, "tie_word_embeddings": True,
                             "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 49155},
    "granitemoeshared-7b-1b": {"architectures": ["GraniteMoeSharedForCausalLM"], "attention_multiplier": 0.0078125, "embedding_multiplier": 12.0,
                               "hidden_size": 2048, "intermediate_size": 512, "logits_scaling": 8.0, "model_type": "granitemoeshared",
                               "num_attention_heads": 16, "num_experts_per_tok": 8, "num_hidden_layers": 24, "num_key_value_heads": 8,
                               "num_local_experts": 40, "residual_multiplier": 0.22, "rope_theta": 10000.0, "shared_intermediate_size": 1024,
                               "tie_word_embeddings": True, "vocab_size": 49152},
    "granitemoe-minimal": {"model_type": "granitemoe"},
    "granitemoeshared-minimal-linear-rope": {"model_type": "granitemoeshared", "rope_scaling": {"type": "linear", "factor": 2.0}},
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
        assert json.loads(json.dumps(getattr(ours, field))) == json.loads(json.dumps(getattr(theirs, field, None))), field
    family = hf.family_for(raw["model_type"])
    assert family.name == "granitemoe"
    assert family.spec(ours) == family.spec(theirs)


@pytest.mark.parametrize("kind", ["nope", None])
def test_rope_is_on_whatever_position_embedding_type_says(tmp_path, kind):
    """GraniteMoe's attention always rotates q and k (the hybrid's only with "rope"): a config.json
    that carries the hybrid's key "nope" computes, in transformers and here, what RoPE computes,
    and the heads' RoPE pairs are a group."""
    extra = {} if kind is None else {"position_embedding_type": kind}
    config = tf.GraniteMoeConfig(**GRANITE_MOE, initializer_range=0.2, **extra)
    model = save_reference(tf.GraniteMoeForCausalLM, config, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text()).get("position_embedding_type") == kind
    ids = torch.tensor([[3, 9, 4, 17, 5, 8, 2]])
    with torch.no_grad():
        want = model(ids).logits.numpy()
        unrotated = model(ids, position_ids=torch.zeros_like(ids)).logits.numpy()
    assert np.abs(want - unrotated).max() > 1e-3, "positions change nothing: the test cannot tell RoPE from none"
    ck = rj.load_hf(tmp_path / "m")
    ours = np.asarray(ck.apply(ck.params, input_ids=ids.numpy())["logits"])
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
    geometry = rj.spec_for(ck).heads["attn"]
    assert geometry.rotary_dim == geometry.head_dim == 8


@pytest.mark.parametrize("width", [0, 24])
def test_the_shared_mlp_is_read_and_a_group_only_where_it_is_wide(tmp_path, width):
    config = tf.GraniteMoeSharedConfig(**GRANITE_MOE, shared_intermediate_size=width)
    model = save_reference(tf.GraniteMoeSharedForCausalLM, config, tmp_path / "s")
    stored = load_file(tmp_path / "s" / "model.safetensors")
    assert any(".shared_mlp." in k for k in stored) == (width > 0) == (model.model.layers[0].shared_mlp is not None)
    ck = rj.load_hf(tmp_path / "s")
    bound = rj.bind(rj.spec_for(ck), ck.params)
    assert {g.name: g.size for g in bound.perms} == ({"shared_ffn": width} if width else {})
    assert [(g.name, g.num_experts, g.units) for g in bound.experts] == [("moe", 4, 16)]
    ids = np.array([[3, 9, 4, 17, 5]])
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ck.apply(ck.params, input_ids=ids)["logits"]), want, rtol=0, atol=1e-4 * float(np.abs(want).max()))


_NEWER = {"block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight",
          "block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
          "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj"}


def test_both_names_of_the_mixture_read_alike_and_are_written_back_as_read(tmp_path):
    """save_pretrained writes IBM's names (router.layer, input_linear, output_linear); transformers 5's
    state dict holds the newer ones: the same leaves, each written back under the names it came with."""
    config = tf.GraniteMoeSharedConfig(**GRANITE_MOE, shared_intermediate_size=24)
    model = save_reference(tf.GraniteMoeSharedForCausalLM, config, tmp_path / "ibm")
    assert_renamed_reads_alike(model, tmp_path / "ibm", _NEWER, tmp_path, renamed=6)  # three tensors in each of the two layers


@pytest.mark.parametrize("change, message", [
    ({"head_dim": 4}, r"head_dim=4 differs from hidden_size / num_attention_heads = 8"),
    ({"num_experts_per_tok": 5}, r"num_local_experts=4, num_experts_per_tok=5"),
    ({"num_local_experts": 0}, r"num_local_experts=0"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"logits_scaling": 0.0}, r"logits_scaling=0"),
])
def test_configs_rotsym_cannot_run_as_transformers_does_are_refused_by_name(change, message):
    raw = {"model_type": "granitemoe", **GRANITE_MOE, **change}
    with pytest.raises(InputError, match=message):
        hf.read_config(raw)


def test_a_head_dim_beside_the_fields_is_what_transformers_reads():
    """Why a head_dim is refused: transformers' GraniteMoe attention reads it (q_proj 4 x 4 wide
    here), so the tensors differ from the ones hidden_size / heads gives."""
    config = tf.GraniteMoeConfig(**GRANITE_MOE, head_dim=4)
    assert tuple(tf.GraniteMoeForCausalLM(config).model.layers[0].self_attn.q_proj.weight.shape) == (16, 32)


def test_the_shared_model_and_its_lm_are_told_apart_by_reference(tmp_path):
    """GraniteMoeSharedModel (no head) loads with no head and computes transformers' last hidden state."""
    config = tf.GraniteMoeSharedConfig(**GRANITE_MOE, shared_intermediate_size=24)
    model = save_reference(tf.GraniteMoeSharedModel, config, tmp_path / "base")
    ck = rj.load_hf(tmp_path / "base")
    assert ck.layout.head is None and ck.layout.prefix == ""
    inputs = {"input_ids": np.array([[3, 9, 4, 17, 5]]), "attention_mask": np.ones((1, 5), np.int64)}
    want = reference(model, inputs)["last_hidden_state"]
    ours = np.asarray(ck.apply(ck.params, **inputs)["last_hidden_state"])
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
