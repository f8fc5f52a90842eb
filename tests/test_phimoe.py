"""Phi-3.5-MoE (phimoe), beyond the conformance contracts (tests/family_cases.py): its router
(sparsemixer at inference) against transformers' own function, on logits where its masks matter;
an expert permutation with the router's rows keeping transformers' logits; the experts as
transformers 5 holds them (stacked) read as save_pretrained's per-expert tensors; longrope's two
mscales (short within the original context, long past it); config.json in the Hub release's form
read as transformers reads it; what is refused, by name."""

from __future__ import annotations

import copy
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from checkpoint_utils import assert_stacked_reads_as_apart
from family_cases import BY_ID, model_inputs, reference
from parity_utils import save_reference
from transformers.models.phimoe.modeling_phimoe import sparsemixer

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.errors import InputError
from rotsym_jax.families.nets.phimoe import SparseMixerMoE

pytestmark = pytest.mark.usefixtures("float32_models")

CASE = BY_ID["PhimoeForCausalLM"]


def _router_weights(logits: np.ndarray, eps: float) -> np.ndarray:
    """Our SparseMixerMoE's (B, T, E) weights on `logits`: its router the identity, the logits its input."""
    experts = logits.shape[-1]
    config = tf.PhimoeConfig(hidden_size=experts, intermediate_size=4, num_local_experts=experts, router_jitter_noise=eps)
    from flax import nnx

    moe = SparseMixerMoE(config, dtype=jnp.float32, rngs=nnx.Rngs(0), std=0.02)
    moe.router.kernel.set_value(jnp.eye(experts, dtype=jnp.float32))
    return np.asarray(moe.weights(jnp.asarray(logits)))


def _theirs(logits: np.ndarray, eps: float) -> np.ndarray:
    flat = torch.as_tensor(logits.reshape(-1, logits.shape[-1]))
    multiplier, selected = sparsemixer(flat, jitter_eps=eps, training=False)
    dense = torch.zeros_like(flat).scatter_add_(-1, selected, multiplier)
    return dense.numpy().reshape(logits.shape)


@pytest.mark.parametrize("eps", [0.0, 0.01, 0.3, 2.0])
def test_router_weights_are_sparsemixers_at_inference(eps):
    """Logits near one another (so that the masks keep several experts, or one), of both signs."""
    rng = np.random.default_rng(0)
    logits = np.concatenate([rng.normal(size=(2, 16, 6)), 1.0 + 0.05 * rng.normal(size=(1, 16, 6)), -3.0 + 0.5 * rng.normal(size=(1, 16, 6))])
    logits = logits.astype(np.float32)
    want = _theirs(logits, eps)
    np.testing.assert_allclose(_router_weights(logits, eps), want, rtol=0, atol=1e-6)
    # the test tells sparsemixer from Mixtral's renormalised top 2 and from the unmasked softmax's top 2
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top2 = np.argsort(-logits, axis=-1)[..., :2]
    plain = np.zeros_like(probs)
    np.put_along_axis(plain, top2, np.take_along_axis(probs, top2, -1), -1)
    renormalised = plain / plain.sum(-1, keepdims=True)
    assert np.abs(want - plain).max() > 1e-2 and np.abs(want - renormalised).max() > 1e-2


def test_an_expert_permutation_with_the_router_rows_keeps_transformers_logits(tmp_path):
    """sparsemixer reads each expert's logit against the others' as a set: permuting the experts
    and the router's rows alike keeps the logits (in transformers, as `verify` checks ours)."""
    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "a")
    inputs = model_inputs(CASE, model.config)
    want = reference(model, inputs)["logits"]
    perm = torch.tensor([2, 0, 3, 1])
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.weight.copy_(layer.mlp.router.weight[perm])
            layer.mlp.experts.gate_up_proj.copy_(layer.mlp.experts.gate_up_proj[perm])
            layer.mlp.experts.down_proj.copy_(layer.mlp.experts.down_proj[perm])
    np.testing.assert_allclose(reference(model, inputs)["logits"], want, rtol=0, atol=1e-5 * np.abs(want).max())
    with torch.no_grad():  # the router's rows alone permuted: other experts chosen, other logits (the test can tell)
        for layer in model.model.layers:
            layer.mlp.router.weight.copy_(layer.mlp.router.weight[perm])
    assert np.abs(reference(model, inputs)["logits"] - want).max() > 1e-2 * np.abs(want).max()


def test_experts_stored_stacked_read_as_the_ones_stored_apart(tmp_path):
    """transformers 5's state dict (mlp.router, mlp.experts.gate_up_proj / down_proj, as tools
    that save it write it) and save_pretrained's Mixtral names (block_sparse_moe.gate,
    experts.{e}.w1|w3|w2) read as the same leaves; the stacked ones written back as they came."""
    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "apart")
    names = ("model.layers.1.mlp.router.weight", "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")
    assert_stacked_reads_as_apart(model, tmp_path / "apart", tmp_path, names)


@pytest.mark.parametrize("length", [5, 9])
def test_longrope_scales_by_the_short_mscale_within_the_original_context_and_the_long_past_it(tmp_path, length):
    """The default case's longrope: original context 6 positions, short_mscale 1.2, long 1.5;
    5 tokens stay within it, 9 pass it (the frequencies are short_factor's at both lengths, as
    transformers' forward computes them)."""
    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "a")
    ids = np.random.default_rng(1).integers(3, 60, size=(2, length))
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    want = reference(model, inputs)["logits"]
    ck = rj.load_hf(tmp_path / "a")
    np.testing.assert_allclose(np.asarray(ck.apply(ck.params, **inputs)["logits"]), want, rtol=0, atol=1e-4 * np.abs(want).max())
    # the two mscales differ enough here that one in the other's place shows
    config = copy.deepcopy(model.config)
    config.rope_parameters = {**config.rope_parameters, "short_mscale": 1.5, "long_mscale": 1.2}
    swapped = tf.PhimoeForCausalLM(config).eval()
    swapped.load_state_dict(model.state_dict())
    assert np.abs(reference(swapped, inputs)["logits"] - want).max() > 1e-2 * np.abs(want).max()


# config.json in the form of microsoft/Phi-3.5-MoE-instruct's (legacy rope_scaling "longrope" with both mscales, a top-level
# original_max_position_embeddings; the factors here are made up, 64 of them for its 128-wide heads)
HUB = {
    "phi-3.5-moe-instruct": {
        "architectures": ["PhiMoEForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 32000,
        "hidden_act": "silu", "hidden_dropout": 0.0, "hidden_size": 4096, "initializer_range": 0.02, "input_jitter_noise": 0.01,
        "intermediate_size": 6400, "lm_head_bias": True, "max_position_embeddings": 131072, "model_type": "phimoe", "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 16,
        "original_max_position_embeddings": 4096, "output_router_logits": False, "rms_norm_eps": 1e-05,
        "rope_scaling": {"long_factor": [1.0 + i / 8 for i in range(64)], "long_mscale": 1.243, "original_max_position_embeddings": 4096,
                         "short_factor": [1.0 + i / 64 for i in range(64)], "short_mscale": 1.243, "type": "longrope"},
        "rope_theta": 10000.0, "router_aux_loss_coef": 0.0, "router_jitter_noise": 0.01, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32064},
    "phimoe-minimal": {"model_type": "phimoe"},
}


@pytest.mark.parametrize("name", sorted(HUB))
def test_hub_config_reads_as_transformers_reads_it(name):
    raw = HUB[name]
    ours = hf.read_config(raw)
    schema = hf.family_for(raw["model_type"]).schema(raw["model_type"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = tf.PhimoeConfig.from_dict(copy.deepcopy(raw))
    for field in schema.fields:
        assert json.loads(json.dumps(getattr(ours, field))) == json.loads(json.dumps(getattr(theirs, field, None))), field
    family = hf.family_for(raw["model_type"])
    assert family.spec(ours) == family.spec(theirs)


@pytest.mark.parametrize("change, match", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, r"rope_type 'linear' .* not supported for phimoe"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4}},
     r"miss \['short_mscale', 'long_mscale'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 3, "long_factor": [1.0] * 4, "short_mscale": 1.0,
                          "long_mscale": 1.0, "original_max_position_embeddings": 8}}, r"short_factor has 3 entries; expected head_dim / 2 = 4"),
    ({"num_local_experts": 1}, r"num_local_experts=1: sparsemixer always picks two experts"),
])
def test_configs_we_do_not_run_are_refused_by_name(change, match):
    raw = {"model_type": "phimoe", "hidden_size": 32, "num_attention_heads": 4, **change}
    with pytest.raises(InputError, match=match):
        hf.read_config(raw)


def test_a_rotation_of_the_stream_folds_the_mlp_norm_into_the_router_and_experts(tmp_path):
    """The MLP LayerNorm's gain is read by the router and the stacked experts (none with a bias):
    folded, it moves into their input rows and its bias stays as beta / g, so the stream takes
    rotations (before: refused, "norm gains ['layers/0/mlp_norm/scale', ...] are not uniform").
    `rotsym align --residual rotation` of B, A with its stream rotated, undoes the rotation and
    writes B's function, which transformers computes."""
    from rotsym_jax.transforms import RESIDUAL

    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "a")
    inputs = model_inputs(CASE, model.config)
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    folded = rj.fold_norms(spec, ck.params)
    for i in range(len(folded["layers"])):
        assert np.allclose(np.asarray(folded["layers"][i]["mlp_norm"]["scale"]), 1.0)
    t = rj.random_transform(spec, folded, jax.random.key(2), ("perm",))
    t[RESIDUAL] = rj.random_residual(spec, folded, jax.random.key(3), "rotation")
    rj.save_hf(ck, rj.apply_transform(spec, folded, t), tmp_path / "b")
    want = reference(model.eval(), inputs)["logits"]
    rotated = reference(CASE.model_class.from_pretrained(tmp_path / "b").eval(), inputs)["logits"]
    np.testing.assert_allclose(rotated, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out"), "--quiet", "--residual", "rotation"]) == 0
    result = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())["result"]
    assert result["after"]["total"] <= 1e-4 * result["before"]["total"], (result["before"], result["after"])
    got = reference(CASE.model_class.from_pretrained(tmp_path / "out").eval(), inputs)["logits"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


