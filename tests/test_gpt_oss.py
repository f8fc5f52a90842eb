"""GPT-OSS (gpt_oss), beyond the conformance contracts (tests/family_cases.py): the experts' biases
and their interleaved gate/up columns (which save_reference leaves zero, being 2-D) against
transformers and written back as they came; the attention sinks, which move with the heads (a
head permutation made by hand in transformers keeps the logits only with them) and which no map
within a head touches; unit scales, which the clamped SwiGLU does not keep (so the experts' units
are permuted only); and what is refused, by name."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from family_cases import BY_ID, model_inputs, reference
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import hf
from rotsym_jax.errors import InputError
from rotsym_jax.io.hf import CheckpointError
from rotsym_jax.pytree import flatten
from rotsym_jax.spec import bind
from rotsym_jax.transforms import random_transform

pytestmark = pytest.mark.usefixtures("float32_models")

CASE = BY_ID["GptOssForCausalLM"]


def _model(folder):
    """The default case as save_reference makes it, with the experts' biases (2-D: left zero there) drawn too."""
    model = save_reference(CASE.model_class, CASE.config(), folder)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.5)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return model


def _close(got, want, rel=1e-4):
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * np.abs(want).max())


def _differs(got, want, rel=1e-2):
    assert np.abs(got - want).max() > rel * np.abs(want).max()


def test_the_experts_biases_and_interleaved_gate_up_read_run_and_write_back_as_transformers(tmp_path):
    model = _model(tmp_path / "a")
    inputs = model_inputs(CASE, model.config)
    ck = rj.load_hf(tmp_path / "a")
    flat = flatten(ck.params)
    experts = model.model.layers[1].mlp.experts
    # column 2j of gate_up_proj is unit j's gate, 2j + 1 its up (GptOssExperts._apply_gate)
    np.testing.assert_array_equal(flat["layers/1/moe/gate/kernel"], experts.gate_up_proj.detach().numpy()[..., 0::2])
    np.testing.assert_array_equal(flat["layers/1/moe/up/bias"], experts.gate_up_proj_bias.detach().numpy()[..., 1::2])
    want = reference(model, inputs)["logits"]
    mask = inputs["attention_mask"].astype(bool)
    _close(np.asarray(ck.apply(ck.params, **inputs)["logits"])[mask], want[mask])
    files = hf.TensorFiles(rj.save_hf(ck, ck.params, tmp_path / "again"))
    try:
        for name, p in model.state_dict().items():
            np.testing.assert_array_equal(files.read(name), p.numpy(), err_msg=name)
    finally:
        files.close()
    # gate and up swapped (read not interleaved but halved, say) would show
    with torch.no_grad():
        for layer in model.model.layers:
            e = layer.mlp.experts
            e.gate_up_proj.copy_(torch.cat([e.gate_up_proj[..., 0::2], e.gate_up_proj[..., 1::2]], dim=-1))
    _differs(reference(model, inputs)["logits"], want)


def _permute_heads_by_hand(model, groups, within, sinks=True):
    """A head permutation in transformers' own model: kv group k takes old group groups[k], and in
    each group query slot s old slot within[s]; q and o with both, k and v with the groups, the
    sinks (one per query head) with both where `sinks`."""
    config = model.config
    r, dh = config.num_attention_heads // config.num_key_value_heads, config.head_dim
    heads = (np.asarray(groups)[:, None] * r + np.asarray(within)[None, :]).reshape(-1)  # new head h = old head heads[h]
    q_rows = torch.as_tensor((heads[:, None] * dh + np.arange(dh)).reshape(-1))
    kv_rows = torch.as_tensor((np.asarray(groups)[:, None] * dh + np.arange(dh)).reshape(-1))
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            for proj, rows in ((a.q_proj, q_rows), (a.k_proj, kv_rows), (a.v_proj, kv_rows)):
                proj.weight.copy_(proj.weight[rows])
                proj.bias.copy_(proj.bias[rows])
            a.o_proj.weight.copy_(a.o_proj.weight[:, q_rows])
            if sinks:
                a.sinks.copy_(a.sinks[torch.as_tensor(heads)])


def test_a_head_permutation_keeps_transformers_logits_with_the_sinks_moved_and_only_so(tmp_path):
    model = _model(tmp_path / "a")
    inputs = model_inputs(CASE, model.config)
    want = reference(model, inputs)["logits"]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _permute_heads_by_hand(model, groups=[1, 0], within=[1, 0])
    _close(reference(model, inputs)["logits"], want, rel=1e-5)
    model.load_state_dict(state)
    _permute_heads_by_hand(model, groups=[1, 0], within=[1, 0], sinks=False)  # the sinks left where they were
    _differs(reference(model, inputs)["logits"], want)


def test_our_head_permutations_move_the_sinks_with_the_queries_and_maps_within_a_head_leave_them(tmp_path):
    """A drawn element of the attention group, applied by the library and saved: transformers
    computes the same logits; under a head permutation each head's sink is the one of the head
    whose query rows it took; under Q/K and V/O rotations and scales the sinks stay as they are."""
    model = _model(tmp_path / "a")
    inputs = model_inputs(CASE, model.config)
    want = reference(model, inputs)["logits"]
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    flat = flatten(ck.params)
    h, dh = model.config.num_attention_heads, model.config.head_dim
    for seed, kinds in ((0, ("heads",)), (1, ("qk", "vo", "qk_scale", "vo_scale"))):
        moved = rj.apply_transform(spec, ck.params, random_transform(spec, ck.params, jax.random.key(seed), kinds=kinds))
        after = flatten(moved)
        for i in range(model.config.num_hidden_layers):
            old_q = np.asarray(flat[f"layers/{i}/attention/query/bias"]).reshape(h, dh)
            new_q = np.asarray(after[f"layers/{i}/attention/query/bias"]).reshape(h, dh)
            sinks, new_sinks = np.asarray(flat[f"layers/{i}/attention/sinks"]), np.asarray(after[f"layers/{i}/attention/sinks"])
            if kinds == ("heads",):
                source = [int(np.argmin(np.abs(old_q - row).sum(-1))) for row in new_q]  # the old head each new one is
                assert sorted(source) == list(range(h)) and source != list(range(h))
                np.testing.assert_array_equal(new_sinks, sinks[source])
            else:
                assert not np.allclose(new_q, old_q)  # the maps moved the queries, not the sinks
                np.testing.assert_array_equal(new_sinks, sinks)
        folder = rj.save_hf(ck, moved, tmp_path / f"moved{seed}")
        theirs = CASE.model_class.from_pretrained(folder, attn_implementation="eager").eval()
        _close(reference(theirs, inputs)["logits"], want)


def test_no_unit_scale_keeps_the_clamped_swiglu(tmp_path):
    """(clamp(up) + 1) * g * sigmoid(alpha g): a unit's up times s and its down row over s changes
    transformers' logits (the +1, the clamps), as a scaled gate does; so the experts' units are a
    permutation group only (the spec has no scaled group to solve or draw)."""
    model = _model(tmp_path / "a")
    inputs = model_inputs(CASE, model.config)
    want = reference(model, inputs)["logits"]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for column in (1, 0):  # unit 0's up (column 1), then its gate (column 0)
        model.load_state_dict(state)
        with torch.no_grad():
            for layer in model.model.layers:
                e = layer.mlp.experts
                e.gate_up_proj[..., column] *= 2.0
                e.gate_up_proj_bias[..., column] *= 2.0
                e.down_proj[:, 0, :] /= 2.0
        _differs(reference(model, inputs)["logits"], want, rel=1e-3)
    ck = rj.load_hf(tmp_path / "a")
    bound = bind(rj.spec_for(ck), ck.params)
    assert [(g.kind, len(g.layers)) for g in bound.experts] == [("experts", 2)] and not bound.perms


def test_a_quantized_checkpoint_is_refused_by_name(tmp_path):
    _model(tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"quantization_config=.*mxfp4.*quantized experts; dequantize them"):
        rj.load_hf(tmp_path / "a")


def test_a_config_without_a_sliding_window_is_refused_as_transformers_cannot_run_it():
    config = CASE.config()
    config.sliding_window = None
    model = CASE.model_class(config).eval()
    with pytest.raises(ValueError, match="sliding_window"):
        model(torch.zeros((1, 4), dtype=torch.long), use_cache=False)
    with pytest.raises(InputError, match="sliding_window is null"):
        hf.read_config({**json.loads(config.to_json_string()), "sliding_window": None})
