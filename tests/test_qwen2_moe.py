"""Qwen2-MoE (model type qwen2_moe, read by the Llama record). The generic contracts run on its rows
of family_cases.py; here what is its own, each against transformers: its config's windows (every
other layer below max_window_layers, sliding_window 0 when off) and refusals, every group kind
(the shared expert's units a group of their own, its sigmoid gate moving with the stream) kept in
transformers and undone when planted, and the experts stored stacked as transformers 5 holds them."""

import json

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import TEXT, WIDE
from parity_utils import reference_outputs, save_reference, token_batch
from safetensors.torch import save_file

import rotsym_jax as rj
from rotsym_jax import hf
from rotsym_jax.families.llama._config import sliding_windows
from rotsym_jax.pytree import flatten
from rotsym_jax.transforms import KINDS, RESIDUAL, UNIT_KINDS
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

MOE = dict(TEXT, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)


@pytest.mark.parametrize("change", [
    dict(use_sliding_window=True, sliding_window=3, max_window_layers=3),  # windows on layers 0 and 2 (odd layers and 3+ full)
    dict(use_sliding_window=False, sliding_window=3),  # off: transformers keeps sliding_window 0
    dict(use_sliding_window=True, sliding_window=2, layer_types=["full_attention", "sliding_attention"] * 2 + ["full_attention"]),
    dict(mlp_only_layers=[0, 3], decoder_sparse_step=2, norm_topk_prob=True, qkv_bias=False, rope_theta=1e6),
], ids=["windows-default", "windows-off", "layer-types", "sparse-step"])
def test_config_reads_as_transformers_reads_it(change):
    theirs = tf.Qwen2MoeConfig(**{**MOE, "num_hidden_layers": 5}, **change)
    ours = hf.read_config(json.loads(theirs.to_json_string(use_diff=False)))
    for name in ("layer_types", "sliding_window", "mlp_only_layers", "rope_parameters", "qkv_bias", "norm_topk_prob", "decoder_sparse_step",
                 "shared_expert_intermediate_size", "moe_intermediate_size"):
        assert getattr(ours, name) == getattr(theirs, name), name
    # the window each layer's attention takes: the config's where transformers' layer type is sliding
    assert sliding_windows(ours) == tuple(theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types)


@pytest.mark.parametrize("change, message", [
    (dict(use_sliding_window=False, layer_types=["sliding_attention", "full_attention"]), r"sliding_window=0 \(use_sliding_window=False\)"),
    (dict(num_experts=2, num_experts_per_tok=3), "num_experts_per_tok=3 exceeds num_experts=2"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    (dict(num_key_value_heads=None), "num_key_value_heads is null"),
])
def test_what_transformers_cannot_run_is_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        hf.read_config({"model_type": "qwen2_moe", **MOE, **change})


def test_windows_every_other_layer_and_dense_layers_run_as_transformers(tmp_path):
    """Four layers: windows of 2 on layers 0 and 2 (below max_window_layers), a mixture on layers 1
    and 3 (decoder_sparse_step 2), layer 3 dense by mlp_only_layers."""
    config = tf.Qwen2MoeConfig(**{**MOE, "num_hidden_layers": 4}, use_sliding_window=True, sliding_window=2, max_window_layers=3,
                               decoder_sparse_step=2, mlp_only_layers=[3], **WIDE)
    model = save_reference(tf.Qwen2MoeForCausalLM, config, tmp_path / "lm")
    ck = rj.load_hf(tmp_path / "lm")
    assert [i for i in range(4) if f"layers/{i}/shared_gate/kernel" in flatten(ck.params)] == [1]
    ids, mask = token_batch(config.vocab_size, pad_id=0)
    want = reference_outputs(model, input_ids=ids, attention_mask=mask)["logits"]
    got = np.asarray(ck.apply(ck.params, input_ids=ids, attention_mask=mask)["logits"])
    valid = mask.astype(bool)
    assert np.max(np.abs(got[valid] - want[valid])) <= 1e-4 * np.max(np.abs(want[valid]))


def test_every_group_holds_in_transformers_and_a_planted_one_is_undone(tmp_path):
    save_reference(tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(**MOE, mlp_only_layers=[1], **WIDE), tmp_path / "a")
    checks = {c.element: c for c in verify_groups(tmp_path / "a")}
    assert len(checks) == 12 and all(c.ok and c.difference is not None for c in checks.values()), checks
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1), KINDS + UNIT_KINDS)
    assert {"attn", "ffn", "shared_ffn", "moe"} <= set(t)
    t[RESIDUAL] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
    planted = rj.apply_transform(spec, ck.params, t)
    moved = flatten(planted)
    # the shared expert's units moved (its own group), its gate's kernel with the stream alone
    np.testing.assert_array_equal(moved["layers/0/shared_gate/kernel"], np.asarray(flatten(ck.params)["layers/0/shared_gate/kernel"])[np.asarray(t[RESIDUAL].perm)])
    result = rj.align(ck.params, planted, spec, heads="permute", residual="permutation", ffn="scaled")
    before, after = result.report["before"], result.report["after"]
    assert before["shared_ffn"] > 1.0 and after["shared_ffn"] <= 1e-6 * before["shared_ffn"]
    assert after["total"] <= 1e-6 * before["total"]


def test_experts_stored_stacked_are_read_run_and_written_so(tmp_path):
    """`mlp.experts.gate_up_proj` (E, 2f, d) and `down_proj` (E, d, f), as transformers 5 holds them
    (and a tool that saves its state dict writes them): the leaves of the per-expert folder,
    transformers' logits, written back stacked and read back by transformers."""
    model = save_reference(tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(**MOE, **WIDE), tmp_path / "per_expert")
    (tmp_path / "stacked").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "stacked" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "stacked" / "config.json").write_bytes((tmp_path / "per_expert" / "config.json").read_bytes())
    stacked, per_expert = rj.load_hf(tmp_path / "stacked"), rj.load_hf(tmp_path / "per_expert")
    assert stacked.layout.stacked_experts and not per_expert.layout.stacked_experts
    for path, leaf in flatten(per_expert.params).items():
        np.testing.assert_array_equal(np.asarray(flatten(stacked.params)[path]), np.asarray(leaf), err_msg=path)
    spec = rj.spec_for(stacked)
    moved = rj.apply_transform(spec, stacked.params, rj.random_transform(spec, stacked.params, jax.random.key(3), KINDS))
    rj.save_hf(stacked, moved, tmp_path / "moved")
    reloaded = tf.Qwen2MoeForCausalLM.from_pretrained(tmp_path / "moved", attn_implementation="eager").eval()
    ids, mask = token_batch(model.config.vocab_size, pad_id=0)
    valid = mask.astype(bool)
    want = reference_outputs(model, input_ids=ids, attention_mask=mask)["logits"]
    got = reference_outputs(reloaded, input_ids=ids, attention_mask=mask)["logits"]
    assert np.max(np.abs(got[valid] - want[valid])) <= 1e-4 * np.max(np.abs(want[valid]))
    files = hf.TensorFiles(tmp_path / "moved")
    try:
        written = files.names()
    finally:
        files.close()
    assert "model.layers.0.mlp.experts.gate_up_proj" in written and not any(".experts.0." in n for n in written)
