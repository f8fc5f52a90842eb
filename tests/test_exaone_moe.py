"""EXAONE MoE (exaone_moe), beyond the conformance contracts (tests/family_cases.py): the stream
rotated (a pre-norm model whose final norm no tied head reads) and undone by `rotsym align`;
save_pretrained's correction bias name and transformers 5's stacked experts read as one; the
multi-token-prediction tensors of a released checkpoint skipped, as transformers skips them; the
sliding windows and the full layers' missing RoPE, each shown to matter; what is refused, by name."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from checkpoint_utils import assert_stacked_reads_as_apart
from family_cases import BY_ID, model_inputs, reference
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.errors import InputError
from rotsym_jax.transforms import RESIDUAL

pytestmark = pytest.mark.usefixtures("float32_models")

CASE = BY_ID["ExaoneMoeForCausalLM"]


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_a_rotated_stream_keeps_transformers_logits_and_align_undoes_it(tmp_path):
    """B: A's norms folded, every group's element and a rotation of the stream applied: transformers
    computes A's logits from B, and `--residual rotation` finds B's rotation back."""
    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "a")
    inputs = model_inputs(CASE, model.config)
    want = reference(model.eval(), inputs)["logits"]
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    folded = rj.fold_norms(spec, ck.params)
    t = rj.random_transform(spec, folded, jax.random.key(1), ("perm", "qk", "vo"))
    t[RESIDUAL] = rj.random_residual(spec, folded, jax.random.key(2), "rotation")
    rj.save_hf(ck, rj.apply_transform(spec, folded, t), tmp_path / "b")
    b = CASE.model_class.from_pretrained(tmp_path / "b").eval()
    assert not torch.allclose(b.model.embed_tokens.weight, model.model.embed_tokens.weight, atol=1e-2)  # the stream did move
    _close(reference(b, inputs)["logits"], want)
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out"), "--quiet", "--residual", "rotation",
                     "--heads", "permute"]) == 0
    result = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())["result"]
    assert result["before"]["total"] > 1.0 and result["after"]["total"] <= 1e-4 * result["before"]["total"], result
    _close(reference(CASE.model_class.from_pretrained(tmp_path / "out").eval(), inputs)["logits"], want)


def test_the_stacked_state_dict_reads_as_save_pretrained_writes_it(tmp_path):
    """save_pretrained writes `mlp.e_score_correction_bias` and one tensor per expert; transformers 5's
    state dict holds `mlp.gate.e_score_correction_bias` and stacked experts: the same leaves, each
    form written back as it came."""
    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "apart")
    with torch.no_grad():  # a correction bias that is not zero, so that a misplaced one shows
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.1, 0.2, 0.3]))
    model.save_pretrained(tmp_path / "apart")
    written = hf.TensorFiles(tmp_path / "apart")
    try:
        assert "model.layers.1.mlp.e_score_correction_bias" in written.where
    finally:
        written.close()
    names = ("model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")
    flat_a = assert_stacked_reads_as_apart(model, tmp_path / "apart", tmp_path, names)
    np.testing.assert_array_equal(np.asarray(flat_a["layers/1/moe/score_correction"]), np.float32([0.0, 0.1, 0.2, 0.3]))


def test_multi_token_prediction_tensors_are_skipped_as_transformers_skips_them(tmp_path):
    """K-EXAONE's checkpoint carries an `mtp.*` block that ExaoneMoeForCausalLM ignores on load."""
    from safetensors.torch import load_file, save_file

    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "a")
    inputs = model_inputs(CASE, model.config)
    state = load_file(tmp_path / "a" / "model.safetensors")
    state["mtp.layers.0.input_layernorm.weight"] = torch.ones(32)
    save_file(state, tmp_path / "a" / "model.safetensors", metadata={"format": "pt"})
    ck = rj.load_hf(tmp_path / "a")
    valid = inputs["attention_mask"].astype(bool)  # transformers' padded rows are not compared
    _close(np.asarray(ck.apply(ck.params, **inputs)["logits"])[valid], reference(model.eval(), inputs)["logits"][valid])


@pytest.mark.parametrize("change", [{"sliding_window": 2}, {"layer_types": ["sliding_attention"] * 3 + ["full_attention"]}])
def test_the_windows_and_the_full_layers_missing_rope_change_the_logits(tmp_path, change):
    """Independent of our forward pass: in transformers, another window or another place of the
    full (no-RoPE) layers changes the case's logits, so its parity checks both."""
    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "a")
    inputs = model_inputs(CASE, model.config)
    assert inputs["input_ids"].shape[1] > CASE.config().sliding_window
    other = CASE.model_class(CASE.config().__class__(**{**CASE.config().to_dict(), **change})).eval()
    other.load_state_dict(model.state_dict())
    want = reference(model.eval(), inputs)["logits"]
    assert np.abs(reference(other, inputs)["logits"] - want).max() > 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("change, match", [
    ({"sliding_window_pattern": "LLLG"}, r"sliding_window_pattern='LLLG': only a number of layers is read"),
    ({"mlp_layer_types": ["dense", "moe"]}, r"mlp_layer_types=\['dense', 'moe'\]: one entry per layer \(2\), each 'dense' or 'sparse'"),
    ({"sliding_window": None}, r"'sliding_window' is None"),
    ({"num_experts": 6, "n_group": 4}, r"num_experts=6 in n_group=4 groups"),
    ({"head_dim": 7}, r"head_dim=7: RoPE needs an even"),
])
def test_configs_we_do_not_read_are_refused_by_name(change, match):
    raw = {"model_type": "exaone_moe", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, **change}
    with pytest.raises(InputError, match=match):
        hf.read_config(raw)
