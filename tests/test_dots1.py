"""dots.llm1 (dots1), beyond the conformance contracts (tests/family_cases.py): the sliding window
and its layer shown to matter in transformers (so the case's parity checks both), save_pretrained's
correction bias read into its experts' leaf, transformers 5's stacked experts read as
save_pretrained's, and what is refused, by name (Dots1Config's own defaults among them: transformers
cannot build their mixture)."""

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

CASE = BY_ID["Dots1ForCausalLM"]


@pytest.mark.parametrize("change", [{"sliding_window": 2}, {"layer_types": ["full_attention"] * 3}])
def test_the_window_and_its_layer_change_the_logits(tmp_path, change):
    """Independent of our forward pass: in transformers, another window, or no sliding layer, changes
    the case's logits."""
    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "a")
    inputs = model_inputs(CASE, model.config)
    assert inputs["input_ids"].shape[1] > CASE.config().sliding_window
    assert CASE.config().layer_types == ["full_attention", "full_attention", "sliding_attention"]
    other = CASE.model_class(CASE.config().__class__(**{**CASE.config().to_dict(), **change})).eval()
    other.load_state_dict(model.state_dict())
    want = reference(model.eval(), inputs)["logits"]
    assert np.abs(reference(other, inputs)["logits"] - want).max() > 1e-3 * np.abs(want).max()


def test_the_correction_bias_is_read_where_its_router_uses_it(tmp_path):
    """A correction bias that is not zero, as save_pretrained writes it, is the leaf our router adds,
    and our logits follow transformers' with it."""
    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "a")
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.5, -0.5, 1.0]))
    model.save_pretrained(tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    np.testing.assert_array_equal(np.asarray(ck.params["layers"][2]["moe"]["score_correction"][...]), np.float32([0.0, 0.5, -0.5, 1.0]))
    inputs = model_inputs(CASE, model.config)
    valid = inputs["attention_mask"].astype(bool)
    want = reference(model.eval(), inputs)["logits"][valid]
    np.testing.assert_allclose(np.asarray(ck.apply(ck.params, **inputs)["logits"])[valid], want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_the_stacked_state_dict_reads_as_save_pretrained_writes_it(tmp_path):
    """save_pretrained writes one tensor per expert; transformers 5's state dict holds them stacked:
    the same leaves, each form written back as it came."""
    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "apart")
    names = ("model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj")
    assert_stacked_reads_as_apart(model, tmp_path / "apart", tmp_path, names)


def test_the_default_config_is_refused_naming_what_it_lacks():
    """Dots1Config() leaves the expert counts None: transformers fails to build its mixture
    (torch.empty(None, ...)); we say which sizes are missing."""
    with pytest.raises(TypeError):
        with torch.device("meta"):
            tf.Dots1ForCausalLM(tf.Dots1Config(num_hidden_layers=1))
    with pytest.raises(InputError, match=r"n_routed_experts, n_shared_experts, num_experts_per_tok None with mixtures from layer 0 on"):
        hf.read_config({"model_type": "dots1"})
    config = hf.read_config({"model_type": "dots1", "first_k_dense_replace": 62})  # every layer dense: nothing missing
    assert config.layer_types == ["full_attention"] * 62


@pytest.mark.parametrize("change, match", [
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": None}, r"'sliding_attention' layers but sliding_window is None"),
    ({"n_routed_experts": 6, "n_group": 4}, r"n_routed_experts=6 in n_group=4 groups"),
    ({"head_dim": 7}, r"head_dim=7: RoPE needs an even"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, r"partial_rotary_factor=0.5"),
    ({"first_k_dense_replace": None}, r"first_k_dense_replace is None"),
])
def test_configs_we_do_not_read_are_refused_by_name(change, match):
    raw = {"model_type": "dots1", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "n_routed_experts": 4, "n_shared_experts": 1,
           "num_experts_per_tok": 2, **change}
    with pytest.raises(InputError, match=match):
        cfg = hf.read_config(raw)
        rj.families.dots1.head_geometry(cfg)  # the rotary width is checked where the heads are read
