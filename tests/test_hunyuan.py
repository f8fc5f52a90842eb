"""HunYuan dense (hunyuan_v1_dense), beyond the conformance contracts (tests/family_cases.py): its
config.json as the Hub's releases write it read as transformers reads it, the configs our forward
pass does not run (a null head_dim, which transformers cannot run either; dynamic RoPE without alpha)
read but not run, the NTK-alpha RoPE base as transformers computes it, the QK-norm after RoPE (a norm
before it, Qwen3's, computes something else), the exact QK group checked element by element on
transformers' own weights (whole rotary pairs' turns by pi and head permutations kept; a pair's
other rotations broken by its two gains unless they are equal; a single entry's flip broken), a
record claiming RoPE's rotations caught by `rotsym inspect --verify`, and a rotated residual stream
kept in transformers and undone by `rotsym align --residual rotation`."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import jax
import numpy as np
import pytest
import torch
import transformers as tf
from family_cases import BY_ID, model_inputs, reference
from parity_utils import save_reference
from safetensors.numpy import load_file, save_file

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.errors import InputError
from rotsym_jax.families import hunyuan
from rotsym_jax.families.llama import rope_inv_freq
from rotsym_jax.families.nets import llama as llama_net
from rotsym_jax.io import configs
from rotsym_jax.io import hf as io_hf
from rotsym_jax.io._files import CheckpointError
from rotsym_jax.transforms import RESIDUAL
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")

# config.json in the form of tencent/Hunyuan-7B-Instruct's (the legacy rope_scaling "dynamic" with a fixed alpha, keys
# transformers does not read: use_qk_norm, use_cla, attention_head_dim)
HUB = {
    "hunyuan-7b-form": {"architectures": ["HunYuanDenseV1ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "attention_head_dim": 128,
                        "bos_token_id": 1, "eod_token_id": 127967, "eos_token_id": 127960, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
                        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768, "mlp_bias": False,
                        "model_type": "hunyuan_v1_dense", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                        "pad_token_id": 127961, "rms_norm_eps": 1e-05,
                        "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                         "type": "dynamic"},
                        "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "use_cla": False,
                        "use_qk_norm": True, "vocab_size": 128167},
    # the class's defaults where config.json is silent (but head_dim, which transformers needs), an int alpha
    "minimal-head-dim": {"model_type": "hunyuan_v1_dense", "head_dim": 64, "rope_scaling": {"type": "dynamic", "alpha": 50, "factor": 1}},
}


def _transformers_config(raw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tf.HunYuanDenseV1Config.from_dict(copy.deepcopy(raw))


@pytest.mark.parametrize("name", sorted(HUB))
def test_hub_config_reads_as_transformers_reads_it(name):
    raw = HUB[name]
    ours, theirs = hf.read_config(raw), _transformers_config(raw)
    schema = hf.family_for(raw["model_type"]).schema(raw["model_type"])
    for field in schema.fields:
        assert json.loads(json.dumps(getattr(ours, field))) == json.loads(json.dumps(getattr(theirs, field, None))), field
    family = hf.family_for(raw["model_type"])
    assert family.spec(ours) == family.spec(theirs)
    # the RoPE frequencies transformers' rotary embedding holds (its "ntk_alpha")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rotary = tf.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense.HunYuanDenseV1RotaryEmbedding(theirs)
    assert rotary.rope_type == "ntk_alpha"
    np.testing.assert_allclose(rope_inv_freq(ours), rotary.inv_freq.numpy(), rtol=1e-6, atol=0)  # float32 pow, as torch's within an ulp
    dh = ours.head_dim
    default = 1.0 / 10000.0 ** (np.arange(0, dh, 2) / dh)
    assert np.abs(default - rotary.inv_freq.numpy()).max() > 1e-3, "alpha changes no frequency: the comparison cannot tell"


def test_a_null_head_dim_is_read_as_hidden_size_over_heads_but_not_run_as_transformers_cannot_run_it():
    raw = {"model_type": "hunyuan_v1_dense", "vocab_size": 60, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 48}
    with pytest.raises(TypeError):
        tf.HunYuanDenseV1ForCausalLM(_transformers_config(raw))
    config = hf.read_config(raw)
    family = hf.family_for("hunyuan_v1_dense")
    assert family.head_geometry(config).head_dim == 8
    with pytest.raises(InputError, match="head_dim is null"):
        rj.nets.graph(lambda rngs: family.build(config, hf.Layout(family.prefix, "lm"), np.float32, rngs))


def test_dynamic_rope_without_alpha_is_read_but_not_run():
    """transformers runs it as dynamic NTK scaling, frequencies that change with the sequence length,
    which our forward pass does not (as for Llama); the groups do not depend on the frequencies."""
    raw = {**HUB["minimal-head-dim"], "num_hidden_layers": 1, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rotary = tf.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense.HunYuanDenseV1RotaryEmbedding(_transformers_config(raw))
    assert rotary.rope_type == "dynamic"
    config = hf.read_config(raw)
    family = hf.family_for("hunyuan_v1_dense")
    assert family.head_geometry(config) == family.head_geometry(hf.read_config(HUB["minimal-head-dim"]))
    with pytest.raises(InputError, match="unsupported rope_type 'dynamic'"):
        rj.nets.graph(lambda rngs: family.build(config, hf.Layout(family.prefix, "lm"), np.float32, rngs))


def test_the_norm_taken_before_rope_as_qwen3_s_computes_something_else(tmp_path, monkeypatch):
    """The parity contract can tell the placement: with the norm moved before RoPE our logits leave transformers'."""
    case = BY_ID["HunYuanDenseV1ForCausalLM"]
    model = save_reference(case.model_class, case.config(), tmp_path / "a")
    inputs = model_inputs(case, model.config)
    want = reference(model, inputs)["logits"]
    mask = inputs["attention_mask"][..., None].astype(bool)

    def ours():
        ck = rj.load_hf(tmp_path / "a")
        return np.where(mask, np.asarray(ck.apply(ck.params, **inputs)["logits"]), 0.0)  # as `reference`

    scale = float(np.abs(want).max())
    np.testing.assert_allclose(ours(), want, rtol=0, atol=1e-4 * scale)
    monkeypatch.setattr(llama_net, "qk_norm_after_rope", lambda config: False)
    io_hf._graph.cache_clear()  # the forward pass's graph is cached per config
    try:
        before = ours()
    finally:
        monkeypatch.undo()
        io_hf._graph.cache_clear()
    assert np.abs(before - want).max() > 1e-2 * scale


# ---- the QK group, on transformers' weights alone ------------------------------------------------------------------

def _logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


def _moved(model, q_map, k_map=None, gains=None):
    """A copy of `model` whose layer-0 q and k rows (and biases) of every head are mapped per head by
    `q_map` (dh, dh) and `k_map` (default q_map): rows (h, i) become sum_j map[i, j] rows (h, j);
    `gains` sets both QK-norms' gains first."""
    moved = copy.deepcopy(model)
    attn = moved.model.layers[0].self_attn
    dh = attn.head_dim
    with torch.no_grad():
        if gains is not None:
            attn.query_layernorm.weight.copy_(gains)
            attn.key_layernorm.weight.copy_(gains)
        for proj, m in ((attn.q_proj, q_map), (attn.k_proj, q_map if k_map is None else k_map)):
            m = torch.as_tensor(m, dtype=torch.float32)
            w = proj.weight.view(-1, dh, proj.weight.shape[1])
            proj.weight.copy_(torch.einsum("ij,hjd->hid", m, w).reshape(proj.weight.shape))
            if proj.bias is not None:
                proj.bias.copy_(torch.einsum("ij,hj->hi", m, proj.bias.view(-1, dh)).reshape(-1))
    return moved


def _pair_rotation(dh, pair, angle):
    """A 2-D rotation of rotary pair `pair` (entries pair, pair + dh/2), as RoPE turns it."""
    m = np.eye(dh)
    i, j = pair, pair + dh // 2
    c, s = np.cos(angle), np.sin(angle)
    m[[i, i, j, j], [i, j, i, j]] = c, -s, s, c
    return m


def test_the_qk_group_is_whole_rotary_pairs_turned_by_pi_and_head_permutations():
    case = BY_ID["HunYuanDenseV1ForCausalLM"]
    torch.manual_seed(0)
    config = case.config()
    config._attn_implementation = "eager"
    model = case.model_class(config).eval()
    with torch.no_grad():  # biases and gains of their own (transformers starts them at 0 and 1)
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    ids = np.array([[3, 5, 7, 9, 11, 13, 2, 40, 50, 1, 17, 23]])
    dh = model.model.layers[0].self_attn.head_dim
    unequal = 1 + 0.3 * torch.randn(dh)  # layer 0's QK-norm gains; rotary pair 1's two apart
    unequal[1], unequal[1 + dh // 2] = 0.6, 1.4
    equal = unequal.clone()
    equal[1 + dh // 2] = equal[1]

    def change(q_map, k_map=None, gains=unequal):
        base = _moved(model, np.eye(dh), gains=gains)
        want = _logits(base, ids)
        return float(np.abs(_logits(_moved(base, q_map, k_map), ids) - want).max() / np.abs(want).max())

    assert change(_pair_rotation(dh, 1, np.pi)) < 1e-6  # a whole pair turned by pi: both entries' signs
    assert change(_pair_rotation(dh, 1, 0.7)) > 1e-3  # any other turn of the pair: its two gains break it
    flip = np.eye(dh)
    flip[1, 1] = -1  # one entry alone: a reflection, which RoPE does not commute with
    assert change(flip) > 1e-3
    stretch = np.linspace(0.5, 2.0, dh)  # an invertible map of Q/K (Llama's, without the norm)
    assert change(np.diag(stretch), np.diag(1 / stretch)) > 1e-3
    # the pair's rotations hold where its two gains are equal: they hold for such weights only, no record claims them
    assert change(_pair_rotation(dh, 1, 0.7), gains=equal) < 1e-5
    # head permutations (the gains serve every head): the kv groups swapped with their query heads, and the query heads within a group
    h, g = model.config.num_attention_heads, model.config.num_key_value_heads
    r = h // g
    q_order = np.concatenate([np.arange(r) + r * grp for grp in range(g)][::-1])
    q_order[:r] = q_order[:r][::-1]
    kv_order = np.arange(g)[::-1].copy()
    want = _logits(model, ids)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        m = moved.model.layers[0].self_attn
        for proj, order in ((m.q_proj, q_order), (m.k_proj, kv_order), (m.v_proj, kv_order)):
            proj.weight.copy_(proj.weight.view(-1, dh, proj.weight.shape[1])[order].reshape(proj.weight.shape))
            if proj.bias is not None:
                proj.bias.copy_(proj.bias.view(-1, dh)[order].reshape(-1))
        m.o_proj.weight.copy_(m.o_proj.weight.view(m.o_proj.weight.shape[0], -1, dh)[:, q_order].reshape(m.o_proj.weight.shape))
    assert float(np.abs(_logits(moved, ids) - want).max() / np.abs(want).max()) < 1e-5
    assert not np.array_equal(q_order, np.arange(h))


def test_inspect_verify_proves_every_group_and_catches_a_record_claiming_rope_s_rotations(tmp_path, monkeypatch, capsys):
    case = BY_ID["HunYuanDenseV1ForCausalLM"]
    folder = tmp_path / "a"
    save_reference(case.model_class, case.config(), folder)
    checks = {c.element: c for c in verify_groups(folder)}
    assert all(c.ok for c in checks.values()), checks
    assert checks["QK rotations"].group == "sign flips of whole rotary pairs (QK-norm)"
    assert checks["residual rotation"].difference is not None  # untied: the stream rotates
    assert cli.main(["inspect", str(folder), "--verify"]) == 0
    assert "CHANGES THE OUTPUTS" not in capsys.readouterr().out

    def geometry(config):  # the record without its QK-norm: RoPE's pair rotations and scales claimed
        return dataclasses.replace(hunyuan.HUNYUAN_V1_DENSE.head_geometry(config), qk_norm=False)

    wrong = dataclasses.replace(hunyuan.HUNYUAN_V1_DENSE, head_geometry=geometry)
    monkeypatch.setattr(configs, "FAMILIES", tuple(wrong if f is hunyuan.HUNYUAN_V1_DENSE else f for f in configs.FAMILIES))
    checks = {c.element: c for c in verify_groups(folder)}
    assert not checks["QK rotations"].ok and checks["QK rotations"].difference > 1e-3
    assert not checks["QK invertible maps"].ok
    assert all(c.ok for name, c in checks.items() if name not in ("QK rotations", "QK scales", "QK invertible maps"))


@pytest.mark.slow  # as the conformance rotation contract (beyond GPT-2 and ViT): the planted contract runs by default
def test_a_rotated_stream_keeps_the_function_and_align_undoes_it(tmp_path):
    """B: A folded, every group and the residual stream rotated: transformers computes A's logits
    from B's tensors, and `--residual rotation` aligns B back to A."""
    case = BY_ID["HunYuanDenseV1ForCausalLM"]
    a = tmp_path / "a"
    model = save_reference(case.model_class, case.config(), a)
    inputs = model_inputs(case, model.config)
    want = reference(model, inputs)["logits"]
    ck = rj.load_hf(a)
    spec = rj.spec_for(ck)
    folded = rj.fold_norms(spec, ck.params)
    t = rj.random_transform(spec, folded, jax.random.key(1), ("perm", "qk", "vo"))
    t[RESIDUAL] = rj.random_residual(spec, folded, jax.random.key(2), "rotation")
    b = rj.save_hf(ck, rj.apply_transform(spec, folded, t), tmp_path / "b")
    scale = float(np.abs(want).max())

    def logits(folder):
        return reference(case.model_class.from_pretrained(folder, attn_implementation="eager").eval(), inputs)["logits"]

    np.testing.assert_allclose(logits(b), want, rtol=0, atol=1e-4 * scale, err_msg="B rotated, in transformers")
    out = tmp_path / "out"
    assert cli.main(["align", str(a), str(b), str(out), "--quiet", "--residual", "rotation", "--heads", "permute"]) == 0
    np.testing.assert_allclose(logits(out), want, rtol=0, atol=1e-4 * scale, err_msg="B aligned, in transformers")
    report = json.loads((out / "rotsym_report.json").read_text())["result"]
    assert report["before"]["total"] > 1.0 and report["after"]["total"] <= 1e-4 * report["before"]["total"]


def test_use_qk_norm_false_is_not_read_by_transformers_which_keeps_the_norm(tmp_path, monkeypatch):
    """Tencent's config.json carries `use_qk_norm` (its remote code skipped the head norm without it);
    transformers 5's HunYuan reads no such key: the attention always holds and applies query_layernorm
    and key_layernorm, and save_pretrained writes their gains. So such a config reads as every other
    (Qwen3's QK group), and a record taking `use_qk_norm: false` as no norm (RoPE's pair rotations
    and Q/K scales claimed) is caught in transformers. A checkpoint without the gains (the remote code's)
    is refused by name: transformers runs it with gains it initialises to 1, not as the code that wrote it."""
    case = BY_ID["HunYuanDenseV1ForCausalLM[use-qk-norm-false]"]
    config = case.config()
    assert config.use_qk_norm is False
    folder = tmp_path / "a"
    model = save_reference(case.model_class, config, folder)
    assert json.loads((folder / "config.json").read_text())["use_qk_norm"] is False
    # the norm runs: its gains (perturbed by save_reference) reach the logits
    ids = np.array([[3, 5, 7, 9, 11, 13, 2, 40]])
    unit = copy.deepcopy(model)
    with torch.no_grad():
        for layer in unit.model.layers:
            layer.self_attn.query_layernorm.weight.fill_(1.0)
            layer.self_attn.key_layernorm.weight.fill_(1.0)
    want = _logits(model, ids)
    assert np.abs(_logits(unit, ids) - want).max() > 1e-3 * np.abs(want).max()
    # read as transformers runs it: the QK-norm's group, every element kept
    checks = {c.element: c for c in verify_groups(folder)}
    assert all(c.ok for c in checks.values()), checks
    assert checks["QK rotations"].group == "sign flips of whole rotary pairs (QK-norm)"

    def geometry(config):  # the flag read as transformers does not: no norm, RoPE's pair rotations and scales claimed
        return dataclasses.replace(hunyuan.HUNYUAN_V1_DENSE.head_geometry(config), qk_norm=False)

    wrong = dataclasses.replace(hunyuan.HUNYUAN_V1_DENSE, head_geometry=geometry)
    with monkeypatch.context() as m:
        m.setattr(configs, "FAMILIES", tuple(wrong if f is hunyuan.HUNYUAN_V1_DENSE else f for f in configs.FAMILIES))
        checks = {c.element: c for c in verify_groups(folder)}
    assert not checks["QK rotations"].ok and checks["QK rotations"].difference > 1e-3
    # the remote code's checkpoint: no norm gains
    stripped = tmp_path / "no-gains"
    stripped.mkdir()
    (stripped / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "_layernorm" not in k or "self_attn" not in k}, stripped / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"query_layernorm\.weight.*is missing"):
        rj.load_hf(stripped)
