"""HunYuan MoE (hunyuan_v1_moe), beyond the conformance contracts (tests/family_cases.py): the per-layer
top k (moe_topk as a list) and the ungated shared MLP each shown to matter in transformers (so the case's
parity checks both), transformers 5's stacked experts read as save_pretrained's, and what is refused
or read but not run, by name (HunYuanMoEV1Config's own default: a null head_dim, which transformers
cannot build)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from checkpoint_utils import assert_stacked_reads_as_apart
from family_cases import BY_ID, model_inputs, reference
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import hf
from rotsym_jax.errors import InputError

pytestmark = pytest.mark.usefixtures("float32_models")

CASE = BY_ID["HunYuanMoEV1ForCausalLM"]


def _differs(got, want):
    return np.abs(got - want).max() > 1e-3 * np.abs(want).max()


def test_the_per_layer_top_k_and_the_shared_mlp_change_the_logits(tmp_path):
    """Independent of our forward pass: in transformers, the case's moe_topk [2, 1] read as [2, 2], or its
    shared MLP zeroed, changes the logits."""
    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "a")
    inputs = model_inputs(CASE, model.config)
    want = reference(model.eval(), inputs)["logits"]
    other = CASE.model_class(CASE.config().__class__(**{**CASE.config().to_dict(), "moe_topk": [2, 2]})).eval()
    other.load_state_dict(model.state_dict())
    assert _differs(reference(other, inputs)["logits"], want)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.shared_mlp.down_proj.weight.zero_()
    assert _differs(reference(model, inputs)["logits"], want)


def test_the_stacked_state_dict_reads_as_save_pretrained_writes_it(tmp_path):
    """save_pretrained writes one tensor per expert; transformers 5's state dict holds them stacked
    beside the router `mlp.gate.wg`: the same leaves, each form written back as it came."""
    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "apart")
    names = ("model.layers.0.mlp.gate.wg.weight", "model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")
    assert_stacked_reads_as_apart(model, tmp_path / "apart", tmp_path, names)


def test_the_default_head_dim_is_read_but_not_run(tmp_path):
    """HunYuanMoEV1Config() leaves head_dim None, and its attention fails on it (None ** -0.5): the
    tensors are read as hidden_size / heads wide (aligned and merged), our forward pass refuses by name."""
    with pytest.raises(TypeError):
        with torch.device("meta"):
            tf.HunYuanMoEV1ForCausalLM(tf.HunYuanMoEV1Config(num_hidden_layers=1))
    raw = {"model_type": "hunyuan_v1_moe", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "num_experts": 4, "moe_topk": 2}
    config = hf.read_config(raw)
    assert rj.families.hunyuan.HUNYUAN_V1_MOE.head_geometry(config).head_dim == 8
    with pytest.raises(InputError, match=r"head_dim is null: HunYuanDenseV1Attention takes config.head_dim as it is"):
        rj.families.hunyuan.HUNYUAN_V1_MOE.build(config, hf.Layout("model.", "lm"), np.float32, None)


@pytest.mark.parametrize("change, match", [
    ({"moe_topk": [2, 2, 2]}, r"moe_topk=\[2, 2, 2\]: one entry per layer \(2\)"),
    ({"moe_topk": 5}, r"moe_topk=5 of num_experts=4"),
    ({"moe_topk": [1, 0]}, r"moe_topk=\[1, 0\] of num_experts=4"),
    ({"head_dim": 7}, r"head_dim=7: RoPE needs an even"),
])
def test_configs_we_do_not_read_are_refused_by_name(change, match):
    raw = {"model_type": "hunyuan_v1_moe", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "num_experts": 4,
           "head_dim": 8, **change}
    with pytest.raises(InputError, match=match):
        hf.read_config(raw)
