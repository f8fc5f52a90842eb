"""MiniMax (families/minimax.py), beyond the conformance contracts (tests/family_cases.py): what the
record leaves out, shown on transformers' own weights. A lightning layer's heads do not permute (each
head's decay slope is fixed by its index), while the same permutation of a softmax layer's heads keeps
the logits; its q and k take no rotation (SiLU acts on every entry) but a permutation of their entries
alike; its v takes no rotation but a permutation of its entries with the norm's gain, the gate's rows and
out_proj's columns; the stream takes no rotation (it passes every norm's gain), which `rotsym inspect
--verify` says, every declared group holding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from family_cases import MINIMAX, reference
from parity_utils import save_reference

from rotsym_jax import cli
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

H, DH = MINIMAX["num_attention_heads"], MINIMAX["hidden_size"] // MINIMAX["num_attention_heads"]
INPUTS = {"input_ids": np.random.default_rng(0).integers(1, 60, (2, 11))}  # 11 tokens: three blocks of 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("minimax") / "a"
    return save_reference(tf.MiniMaxForCausalLM, tf.MiniMaxConfig(**MINIMAX), folder), folder


def _rotation(seed):
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(DH, DH)))
    return q * np.sign(np.diagonal(r))


def _logits(model, state):
    model = type(model)(model.config).eval()
    model.load_state_dict(state)
    return reference(model, INPUTS)["logits"]


def _change(model, moved) -> float:
    want = reference(model, INPUTS)["logits"]
    return float(np.abs(_logits(model, moved) - want).max() / np.abs(want).max())


def _heads_moved(state, layer: int, order, lightning: bool) -> dict:
    """Layer `layer`'s heads in `order` (each kv group with its query heads in a softmax layer, MHA here: kv_heads = H / 2)."""
    p, out = f"model.layers.{layer}.self_attn.", dict(state)
    rows = np.concatenate([np.arange(h * DH, (h + 1) * DH) for h in order])
    if lightning:
        qkv = state[p + "qkv_proj.weight"].view(H, 3 * DH, -1)
        out[p + "qkv_proj.weight"] = qkv[list(order)].reshape(3 * H * DH, -1)
        out[p + "output_gate.weight"] = state[p + "output_gate.weight"][rows]
        out[p + "norm.weight"] = state[p + "norm.weight"][rows]
        out[p + "out_proj.weight"] = state[p + "out_proj.weight"][:, rows]
    else:
        g = MINIMAX["num_key_value_heads"]
        r = H // g
        kv_order = [order[i * r] // r for i in range(g)]
        kv_rows = np.concatenate([np.arange(k * DH, (k + 1) * DH) for k in kv_order])
        out[p + "q_proj.weight"] = state[p + "q_proj.weight"][rows]
        for name in ("k_proj", "v_proj"):
            out[p + name + ".weight"] = state[p + name + ".weight"][kv_rows]
        out[p + "o_proj.weight"] = state[p + "o_proj.weight"][:, rows]
    return out


def test_a_lightning_layer_s_heads_do_not_permute_as_a_softmax_layer_s_do(model):
    model, _ = model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    order = [2, 3, 0, 1]  # the two kv groups swapped, with their query heads
    assert _change(model, _heads_moved(state, 0, order, lightning=False)) < 1e-5  # layer 0: softmax attention
    assert _change(model, _heads_moved(state, 1, order, lightning=True)) > 1e-3  # layer 1: lightning, each head its own slope


def _lightning_mapped(state, q_map=None, v_perm=None) -> dict:
    """Layer 1's q and k rows of every head mapped by `q_map` (dh, dh), or its v rows by the entry permutation `v_perm` with
    the norm's gain, the gate's rows and out_proj's columns."""
    p, out = "model.layers.1.self_attn.", dict(state)
    qkv = state[p + "qkv_proj.weight"].view(H, 3, DH, -1).clone()
    if q_map is not None:
        m = torch.as_tensor(q_map, dtype=torch.float32)
        qkv[:, 0] = torch.einsum("ij,hjd->hid", m, qkv[:, 0])
        qkv[:, 1] = torch.einsum("ij,hjd->hid", m, qkv[:, 1])
    if v_perm is not None:
        qkv[:, 2] = qkv[:, 2][:, list(v_perm)]
        rows = np.concatenate([h * DH + np.asarray(v_perm) for h in range(H)])
        out[p + "output_gate.weight"] = state[p + "output_gate.weight"][rows]
        out[p + "norm.weight"] = state[p + "norm.weight"][rows]
        out[p + "out_proj.weight"] = state[p + "out_proj.weight"][:, rows]
    out[p + "qkv_proj.weight"] = qkv.reshape(3 * H * DH, -1)
    return out


def test_a_lightning_layer_keeps_permutations_of_entries_and_no_rotation(model):
    model, _ = model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    perm = np.random.default_rng(1).permutation(DH)
    assert _change(model, _lightning_mapped(state, q_map=np.eye(DH)[perm])) < 1e-5  # q and k's entries permuted alike
    assert _change(model, _lightning_mapped(state, q_map=_rotation(2))) > 1e-3  # rotated: SiLU
    assert _change(model, _lightning_mapped(state, v_perm=perm)) < 1e-5  # v's entries, with gain, gate rows, out columns
    v = state["model.layers.1.self_attn.qkv_proj.weight"].view(H, 3, DH, -1)
    rotated = _lightning_mapped(state)
    turned = v.clone()
    turned[:, 2] = torch.einsum("ij,hjd->hid", torch.as_tensor(_rotation(3), dtype=torch.float32), v[:, 2])
    rotated["model.layers.1.self_attn.qkv_proj.weight"] = turned.reshape(3 * H * DH, -1)
    assert _change(model, rotated) > 1e-3  # v rotated (and nothing else can undo it: SiLU, then a gain per entry)


def test_inspect_verify_holds_every_declared_group_and_refuses_a_stream_rotation(model, capsys):
    _, folder = model
    checks = {c.element: c for c in verify_groups(folder)}
    held = {name for name, c in checks.items() if c.difference is not None}
    assert {"head permutations", "QK rotations", "VO rotations", "residual signed permutation"} <= held
    assert all(c.ok for c in checks.values()), checks
    assert checks["residual rotation"].difference is None and "pre-norm" in checks["residual rotation"].note
    assert cli.main(["inspect", str(folder), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "CHANGES THE OUTPUTS" not in out and "lightning-attention layers' heads do not permute" in out
