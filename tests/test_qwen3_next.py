"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next (families/qwen3_next.py), beyond the conformance contracts
(tests/family_cases.py): our gated delta rule against transformers' two torch implementations; the
Gated DeltaNet's key-head permutation shown in transformers on its own weights (fused and split
projections), and planted and undone by `rotsym align`; what the record leaves out shown to break
transformers' outputs (value heads moved off their key head, a V/O rotation under the output gate);
the key heads matched from activations (their sites: what the conv and out kernels read);
transformers 5's stacked experts read as save_pretrained's; the `mtp.*` block skipped as transformers skips it;
attention biases refused by name."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from checkpoint_utils import assert_stacked_reads_as_apart
from family_cases import QWEN3_NEXT, QWEN3_NEXT_MOE, reference
from parity_utils import save_reference
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.families.nets.qwen3_next import gated_delta_rule, l2_normed
from rotsym_jax.io._files import CheckpointError
from rotsym_jax.pytree import flatten
from rotsym_jax.transforms import UnitPermutation

pytestmark = pytest.mark.usefixtures("float32_models")

# 3 key heads of 8, each serving 2 value heads of 8: a permutation of 3 is rarely its own inverse
THREE_KEY_HEADS = dict(QWEN3_NEXT, linear_num_key_heads=3, linear_num_value_heads=6, num_hidden_layers=3,
                       layer_types=["linear_attention", "full_attention", "linear_attention"])
NK, DK, R, DV = 3, 8, 2, 8
MODELS = {"split": (Qwen3_5ForCausalLM, lambda: Qwen3_5TextConfig(**THREE_KEY_HEADS)),
          "fused": (Qwen3NextForCausalLM, lambda: Qwen3NextConfig(**THREE_KEY_HEADS, **QWEN3_NEXT_MOE, mlp_only_layers=[0]))}


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def _differs(got, want):
    assert np.abs(got - want).max() > 1e-2 * np.abs(want).max()


@pytest.mark.parametrize("value_heads", [3, 6])
def test_the_scan_computes_transformers_gated_delta_rule(value_heads):
    """Ours (L2-norm, q / sqrt(dk), key heads repeated, a lax.scan) = transformers' token-by-token
    and chunked torch implementations (chunks of 4 over 9 tokens: the padding of the last chunk too)."""
    rng = np.random.default_rng(0)
    b, t, nk, dk, dv = 2, 9, 3, 4, 5
    q, k = (rng.normal(size=(b, t, nk, dk)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(b, t, value_heads, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 2.0, size=(b, t, value_heads)).astype(np.float32)
    beta = rng.uniform(0, 1, size=(b, t, value_heads)).astype(np.float32)
    r = value_heads // nk
    ours = gated_delta_rule(*(jnp.repeat(l2_normed(jnp.asarray(x)), r, axis=2) * s for x, s in ((q, dk ** -0.5), (k, 1.0))),
                            jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta))
    args = [torch.from_numpy(x) for x in (q, k, v)]
    recurrent, _ = hf_next.torch_recurrent_gated_delta_rule(*args, g=torch.from_numpy(g), beta=torch.from_numpy(beta), use_qk_l2norm_in_kernel=True)
    chunked, _ = hf_next.torch_chunk_gated_delta_rule(*args, g=torch.from_numpy(g), beta=torch.from_numpy(beta), chunk_size=4,
                                                      use_qk_l2norm_in_kernel=True)
    _close(np.asarray(ours), recurrent.numpy())
    _close(np.asarray(ours), chunked.numpy())


def _blocks(perm, size):
    """Row indices moving blocks of `size` rows by `perm` (block j of the result is block perm[j])."""
    return np.concatenate([np.arange(p * size, (p + 1) * size) for p in perm])


def _permute_key_heads(state, layer, perm, fused, value_perm=None):
    """transformers' tensors of layer `layer`'s Gated DeltaNet with its key heads moved by `perm` (each
    with its value heads); with `value_perm`, the value heads alone moved instead (q and k stay)."""
    p = f"model.layers.{layer}.linear_attn."
    state = dict(state)
    keys, values = (np.arange(NK), value_perm) if value_perm is not None else (perm, _blocks(perm, R))
    qk, v = _blocks(keys, DK), _blocks(values, DV)
    channels = np.concatenate([qk, NK * DK + qk, 2 * NK * DK + v])
    state[p + "conv1d.weight"] = state[p + "conv1d.weight"][channels]
    for name in ("A_log", "dt_bias"):
        state[p + name] = state[p + name][values]
    state[p + "out_proj.weight"] = state[p + "out_proj.weight"][:, v]
    if fused:  # each key head's [q; k; v; z] rows and [b; a] rows move as one block
        assert value_perm is None
        state[p + "in_proj_qkvz.weight"] = state[p + "in_proj_qkvz.weight"][_blocks(perm, 2 * DK + 2 * R * DV)]
        state[p + "in_proj_ba.weight"] = state[p + "in_proj_ba.weight"][_blocks(perm, 2 * R)]
    else:
        state[p + "in_proj_qkv.weight"] = state[p + "in_proj_qkv.weight"][channels]
        state[p + "in_proj_z.weight"] = state[p + "in_proj_z.weight"][v]
        for name in ("in_proj_b.weight", "in_proj_a.weight"):
            state[p + name] = state[p + name][values]
    return state


def _logits(model, state, inputs):
    model.load_state_dict(state)
    return reference(model, inputs)["logits"]


@pytest.mark.parametrize("layout", sorted(MODELS))
def test_a_key_head_permutation_keeps_transformers_logits(layout, tmp_path):
    """The group "deltanet", on transformers' own tensors: key heads moved with their value heads keep
    the logits; two value heads of different key heads swapped (q and k left) change them."""
    cls, config = MODELS[layout]
    model = save_reference(cls, config(), tmp_path / "a")
    inputs = {"input_ids": np.random.default_rng(0).integers(1, 60, (2, 9))}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    want = reference(model, inputs)["logits"]
    moved = _permute_key_heads(_permute_key_heads(state, 0, [2, 0, 1], layout == "fused"), 2, [1, 2, 0], layout == "fused")
    _close(_logits(model, moved, inputs), want)
    if layout == "split":
        swapped = _permute_key_heads(state, 0, None, False, value_perm=[2, 1, 0, 3, 4, 5])  # value heads 0 and 2: key heads 0 and 1
        _differs(_logits(model, swapped, inputs), want)


def test_a_planted_key_head_permutation_is_undone_by_align(tmp_path):
    """B: A with its DeltaNet key heads permuted ([2, 0, 1] and [1, 2, 0]; every other group's element
    random): transformers computes A's logits from B, and `rotsym align` writes A's tensors back."""
    cls, config = MODELS["fused"]
    model = save_reference(cls, config(), tmp_path / "a")
    inputs = {"input_ids": np.random.default_rng(0).integers(1, 60, (2, 9))}
    want = reference(model, inputs)["logits"]
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1), ("perm",))
    t["deltanet"] = UnitPermutation(perm=jnp.asarray([[2, 0, 1], [1, 2, 0]], jnp.int32))
    rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "b")
    b = cls.from_pretrained(tmp_path / "b").eval()
    _close(reference(b, inputs)["logits"], want)
    qkvz = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert not torch.allclose(b.state_dict()[qkvz], model.state_dict()[qkvz])
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out"), "--quiet", "--heads", "permute"]) == 0
    result = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())["result"]
    assert result["after"]["total"] <= 1e-4 * result["before"]["total"], result
    out = cls.from_pretrained(tmp_path / "out").state_dict()
    for name, x in model.state_dict().items():
        if ".linear_attn." in name:
            np.testing.assert_allclose(out[name].numpy(), x.numpy(), atol=1e-6, err_msg=name)


@pytest.mark.parametrize("layout", sorted(MODELS))
def test_a_planted_key_head_permutation_is_undone_from_activations(layout, tmp_path):
    """Activation matching's sites of the group "deltanet": each key head's entries where its conv and
    out kernels read them (the q/k/v projections, the gated norm's output), as the forward pass records
    them. B: A moved by a random element of every group, its key heads by [2, 0, 1] and [1, 2, 0]: matched
    from activations alone, every key head goes back (each permutation the plant's inverse), B's function kept."""
    cls, config = MODELS[layout]
    save_reference(cls, config(), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1))
    t["deltanet"] = UnitPermutation(perm=jnp.asarray([[2, 0, 1], [1, 2, 0]], jnp.int32))
    b = rj.apply_transform(spec, ck.params, t)
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(3, 60, size=(6, 10)), "attention_mask": np.ones((6, 10), int)} for _ in range(2)]
    data[1]["attention_mask"][-1, 7:] = 0  # padding is left out of every site
    result = rj.align(ck.params, b, spec, method="activations", data=data, checkpoint=ck, heads="permute", residual="permutation")
    np.testing.assert_array_equal(np.asarray(result.transforms["deltanet"].perm), [[1, 2, 0], [2, 0, 1]])
    report = result.report
    assert report["before"]["deltanet"] > 1.0 and report["after"]["total"] <= 1e-6 * report["before"]["total"], report
    inputs, _ = ck.split_batch(data[0])
    want, got = (np.asarray(ck.apply(p, **inputs)["logits"]) for p in (b, result.params))
    _close(got, want)


def test_a_vo_rotation_changes_the_gated_attention(tmp_path):
    """Why V/O keeps sign flips and scales only: the output gate multiplies each entry of a head's
    output, so a rotation of a head's V rows and O columns changes transformers' logits, a sign flip
    of each entry does not."""
    cls, config = MODELS["split"]
    model = save_reference(cls, config(), tmp_path / "a")
    inputs = {"input_ids": np.random.default_rng(0).integers(1, 60, (2, 9))}
    want = reference(model, inputs)["logits"]
    dh = model.config.head_dim
    p = "model.layers.1.self_attn."

    def vo(m):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        state[p + "v_proj.weight"][:dh] = m @ state[p + "v_proj.weight"][:dh]  # kv head 0, which query heads 0 and 1 read
        for head in (0, 1):
            state[p + "o_proj.weight"][:, head * dh:(head + 1) * dh] = state[p + "o_proj.weight"][:, head * dh:(head + 1) * dh] @ m.T
        return state

    rotation = torch.linalg.qr(torch.randn(dh, dh, generator=torch.Generator().manual_seed(0)))[0]
    signs = torch.diag(torch.tensor([1.0, -1.0] * (dh // 2)))
    _close(_logits(model, vo(signs), inputs), want)
    _differs(_logits(model, vo(rotation), inputs), want)


def test_the_stacked_state_dict_reads_as_save_pretrained_writes_it(tmp_path):
    """save_pretrained writes one tensor per expert; transformers 5's state dict holds them stacked:
    the same leaves, each form written back as it came."""
    cls, config = MODELS["fused"]
    model = save_reference(cls, config(), tmp_path / "apart")
    assert_stacked_reads_as_apart(model, tmp_path / "apart", tmp_path, ("model.layers.1.mlp.experts.gate_up_proj",
                                                                         "model.layers.1.mlp.experts.down_proj"))


def test_attention_biases_are_refused_by_name(tmp_path):
    """attention_bias puts a bias on q_proj's gate rows too, which the gated attention read here does not hold."""
    cls, config = MODELS["split"]
    save_reference(cls, Qwen3_5TextConfig(**{**THREE_KEY_HEADS, "attention_bias": True}), tmp_path / "a")
    with pytest.raises(CheckpointError, match="attention_bias=True .*q_proj's query and gate rows"):
        rj.load_hf(tmp_path / "a")


def test_multi_token_prediction_tensors_are_skipped_as_transformers_skips_them(tmp_path):
    """Qwen3-Next's and Qwen3.5's checkpoints carry an `mtp.*` block that their causal LMs ignore on load."""
    from safetensors.torch import load_file, save_file

    cls, config = MODELS["fused"]
    save_reference(cls, config(), tmp_path / "a")
    state = load_file(tmp_path / "a" / "model.safetensors")
    save_file({**state, "mtp.fc.weight": torch.ones(4, 4), "mtp.layers.0.input_layernorm.weight": torch.ones(32)},
              tmp_path / "a" / "model.safetensors", metadata={"format": "pt"})
    read = rj.load_hf(tmp_path / "a")
    assert not any("mtp" in path for path in flatten(read.params))
    save_file({**state, "extra.fc.weight": torch.ones(4, 4)}, tmp_path / "a" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="extra.fc.weight"):  # any other tensor the record does not know is refused
        rj.load_hf(tmp_path / "a")
