"""Fine-grained FP8 checkpoints (DeepSeek-V3's, Qwen3-FP8's): an F8_E4M3 weight beside its float32
`weight_scale_inv`, one scale per block of config.json's quantization_config.weight_block_size.
Written here by torch from float32 models (an independent quantizer); read dequantized (each block
times its scale, as transformers dequantizes them on a CPU) and written back in bfloat16 without
the quantization."""

import json

import numpy as np
import pytest
import torch
import transformers as tf
from family_cases import DEEPSEEK, TEXT
from parity_utils import save_reference
from safetensors.torch import load_file, save_file

import rotsym_jax as rj
from rotsym_jax.io._files import CheckpointError

pytestmark = pytest.mark.usefixtures("float32_models")
FP8_MAX = 448.0  # the largest float8_e4m3fn


def _quantized(folder, out, block):
    """`folder`'s linear weights inside its layers (not its norms, routers) quantized to FP8 by blocks of `block` (the
    last block of a row or column cut), with their scales, into `out`; the dequantized weights."""
    out.mkdir()
    tensors, dequantized = load_file(folder / "model.safetensors"), {}
    linear = [n for n in tensors if ".layers." in n and tensors[n].ndim == 2 and "norm" not in n and not n.endswith("mlp.gate.weight")]
    for name in linear:  # (DeepSeek's routers stay unquantized)
        w = tensors[name]
        grid = [-(-n // b) for n, b in zip(w.shape, block)]
        padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
        padded[: w.shape[0], : w.shape[1]] = w
        blocks = padded.reshape(grid[0], block[0], grid[1], block[1])
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
        expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
        tensors[name] = (w / expanded).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
        dequantized[name] = tensors[name].to(torch.float32) * expanded
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(raw))
    return dequantized


def test_an_fp8_checkpoint_reads_as_transformers_dequantizes_it_and_saves_in_bfloat16(tmp_path):
    model = save_reference(tf.Qwen3ForCausalLM, tf.Qwen3Config(**TEXT, num_key_value_heads=2, head_dim=8), tmp_path / "f32")
    dequantized = _quantized(tmp_path / "f32", tmp_path / "fp8", (16, 16))
    ids = np.random.default_rng(0).integers(3, TEXT["vocab_size"], (2, 9))
    with torch.no_grad():  # transformers' model with the dequantized weights (transformers' own FP8 loader needs accelerate)
        plain = model(torch.as_tensor(ids)).logits.numpy()
        model.load_state_dict(dequantized, strict=False)
        want = model(torch.as_tensor(ids)).logits.numpy()
    assert np.abs(want - plain).max() > 1e-4 * np.abs(plain).max()  # the quantization shows
    ck = rj.load_hf(tmp_path / "fp8")
    np.testing.assert_allclose(np.asarray(ck.apply(ck.params, input_ids=ids)["logits"]), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    saved = rj.save_hf(ck, ck.params, tmp_path / "saved")
    config = json.loads((saved / "config.json").read_text())
    assert "quantization_config" not in config
    files = rj.hf.TensorFiles(saved)
    assert not any(n.endswith("_scale_inv") for n in files.names())
    assert files.dtype("model.layers.0.self_attn.q_proj.weight") == "BF16" and files.dtype("model.embed_tokens.weight") == "F32"
    with torch.no_grad():
        got = tf.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())  # its weights rounded to bfloat16


def test_deepseek_v3s_cut_blocks_are_read_scale_by_scale_and_rows_alike(tmp_path):
    """DeepSeek-V3's kv_a_proj_with_mqa has 576 rows, 4.5 blocks of 128: the last block cut. Here
    blocks of 12 rows and 32 columns: its 12 + 4 = 16 rows are a block and a cut one, and every tensor
    whose rows are no multiple of 12 ends on a cut block; the rows of a streamed read alike."""
    save_reference(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(**DEEPSEEK), tmp_path / "f32")
    dequantized = _quantized(tmp_path / "f32", tmp_path / "fp8", (12, 32))
    files = rj.hf.TensorFiles(tmp_path / "fp8")
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert name + "_scale_inv" not in files.names() and files.dtype(name) == "BF16"
    for key, want in dequantized.items():
        np.testing.assert_array_equal(files.read(key), want.numpy(), err_msg=key)
    np.testing.assert_array_equal(files.read(name, rows=(5, 14)), dequantized[name].numpy()[5:14])
    ck = rj.load_hf(tmp_path / "fp8")
    assert ck.family == "deepseek_v3"


def test_an_fp8_checkpoint_without_its_block_size_or_of_another_format_is_refused_by_name(tmp_path):
    save_reference(tf.Qwen3ForCausalLM, tf.Qwen3Config(**TEXT, num_key_value_heads=2, head_dim=8), tmp_path / "f32")
    _quantized(tmp_path / "f32", tmp_path / "fp8", (16, 16))
    raw = json.loads((tmp_path / "fp8" / "config.json").read_text())
    for quantization, message in (({"quant_method": "fp8"}, r"weight_block_size=None; expected \[rows, columns\]"),
                                  ({"quant_method": "fbgemm_fp8"}, r"expected quant_method 'fp8'"),
                                  ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [16, 16]}, r"fmt='e5m2'; only e4m3")):
        (tmp_path / "fp8" / "config.json").write_text(json.dumps({**raw, "quantization_config": quantization}))
        with pytest.raises(CheckpointError, match=message):
            rj.load_hf(tmp_path / "fp8")


def test_an_fp8_checkpoint_aligns_streamed_as_in_memory(tmp_path, capsys):
    """The streamed run reads the FP8 weights (rows of them) through the same dequantization; the
    command line says they are written in bfloat16."""
    from rotsym_jax import cli

    save_reference(tf.Qwen3ForCausalLM, tf.Qwen3Config(**TEXT, num_key_value_heads=2, head_dim=8), tmp_path / "f32")
    _quantized(tmp_path / "f32", tmp_path / "fp8", (16, 16))
    save_reference(tf.Qwen3ForCausalLM, tf.Qwen3Config(**TEXT, num_key_value_heads=2, head_dim=8), tmp_path / "other", seed=1)
    for out, extra in (("memory", []), ("streamed", ["--max-memory", "3G"])):
        assert cli.main(["align", str(tmp_path / "other"), str(tmp_path / "fp8"), str(tmp_path / out), *extra]) == 0
    assert "its FP8 weights (blocks of [16, 16]) are read dequantized" in capsys.readouterr().err
    memory, streamed = rj.hf.TensorFiles(tmp_path / "memory"), rj.hf.TensorFiles(tmp_path / "streamed")
    assert memory.names() == streamed.names() and memory.dtype("model.layers.1.mlp.up_proj.weight") == "BF16"
    for name in memory.names():
        np.testing.assert_array_equal(memory.read(name), streamed.read(name), err_msg=name)
