"""Llama 4's text model (model type llama4_text). The generic contracts run on its rows of
family_cases.py (round trip, a planted element of every group kept by transformers and undone,
streamed = in memory, merged); here, each element kind proven in transformers with the L2 QK-norm
and without it, and why the record leaves Q/K's scales and invertible maps out under the norm
(applied anyway, transformers' outputs change) but keeps the rotary pairs' rotations."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers as tf
from family_cases import LLAMA4
from parity_utils import save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.io.widths import widen
from rotsym_jax.transforms import RESIDUAL
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")


@pytest.fixture(scope="module")
def scout(tmp_path_factory):
    """The QK-norm model (as Scout): a RoPE layer with a dense MLP, a NoPE layer with experts."""
    folder = tmp_path_factory.mktemp("llama4") / "scout"
    save_reference(tf.Llama4ForCausalLM, tf.Llama4TextConfig(**LLAMA4, attention_bias=True), folder)
    return folder


@pytest.mark.slow  # every element kind, each saved and run in transformers (the conformance rows plant them all at once)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["maverick", "scout"])
def test_every_group_holds_in_transformers(tmp_path, scout, qk_norm):
    folder = scout
    if not qk_norm:
        folder = tmp_path / "maverick"
        save_reference(tf.Llama4ForCausalLM, tf.Llama4TextConfig(**LLAMA4, use_qk_norm=False), folder)
    checks = {c.element: c for c in verify_groups(folder)}
    assert len(checks) == 12 and all(c.ok for c in checks.values()), checks
    # the L2 QK-norm leaves Q/K the rotary pairs' rotations (no scale, no invertible map); all else is proven
    unproven = {e for e, c in checks.items() if c.difference is None}
    assert unproven == ({"QK scales", "QK invertible maps"} if qk_norm else set()), checks
    assert "2-D rotations of each rotary pair" in checks["QK rotations"].group


def _moved_logits(folder, kinds, out, **fields):
    """Transformers' logits of the model at `folder` with a random element of `kinds` (its `fields`
    replaced) applied as if the model had no QK-norm (the groups of Q/K it would then have)."""
    ck = rj.load_hf(folder)
    spec = rj.spec_for(ck)
    free = dataclasses.replace(spec, heads={"attn": dataclasses.replace(spec.heads["attn"], qk_norm=False)})
    t = rj.random_transform(free, ck.params, jax.random.key(3), kinds)
    t["attn"] = t["attn"].replace(**{k: v(getattr(t["attn"], k)) for k, v in fields.items()})
    rj.save_hf(ck, rj.apply_transform(free, ck.params, t), out)
    return _logits(out)


def _logits(folder):
    model = tf.Llama4ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids, mask = token_batch(model.config.vocab_size, pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    return np.where(mask[..., None].astype(bool), logits, 0.0)


def test_under_the_qk_norm_a_rotary_pair_rotates_but_no_scale_or_invertible_map_holds(scout, tmp_path):
    """The norm divides each head's q and k by their RMS (plus eps) after RoPE: a 2-D rotation of a
    rotary pair keeps both (the record's group: `qk_norm="unit"`); an invertible map (a scale per
    rotary pair) changes the RMS; a scale of q against k is undone by the norm but for its eps,
    which a scale far from 1 brings out (q 100 times smaller). Both are refused by name."""
    want = _logits(scout)
    scale = np.abs(want).max()
    ck = rj.load_hf(scout)
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(3), ("qk", "qk_scale", "qk_invertible"))
    qk = np.asarray(t["attn"].qk)
    assert not set(np.unique(np.round(qk, 6))) <= {-1.0, 0.0, 1.0}, "rotations, not only sign flips"
    assert t["attn"].qk_inv is None and np.all(np.asarray(t["attn"].qk_scale) == 1)
    rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "rotated")
    assert np.abs(_logits(tmp_path / "rotated") - want).max() <= 1e-4 * scale
    stretched = _moved_logits(scout, ("qk_invertible",), tmp_path / "invertible")
    assert np.abs(stretched - want).max() > 1e-2 * scale
    scaled = _moved_logits(scout, ("qk_scale",), tmp_path / "scaled", qk_scale=lambda s: np.full_like(s, 0.01))
    assert np.abs(scaled - want).max() > 1e-2 * scale
    with pytest.raises(ValueError, match="under a per-head QK-norm no QK scale keeps the function"):
        rj.apply_transform(spec, ck.params, {**t, "attn": t["attn"].replace(qk_scale=np.full_like(t["attn"].qk_scale, 0.01))})


def test_the_loader_reads_interleaved_pairs_into_rotate_half_order(scout):
    """Our q kernel's columns of a head are HF's rows (2i) then (2i + 1): a rotary pair (2i, 2i + 1)
    lands on (i, i + dh/2), as every solver pairs them; the experts' fused tensor splits [gate | up]."""
    from safetensors.numpy import load_file

    stored = load_file(scout / "model.safetensors")
    ck = rj.load_hf(scout)
    dh, f = LLAMA4["head_dim"], LLAMA4["intermediate_size"]
    q = stored["model.layers.0.self_attn.q_proj.weight"]  # (H dh, d)
    ours = np.asarray(ck.params["layers"][0]["attention"]["query"]["kernel"])  # (d, H dh)
    head = q[dh:2 * dh]  # the second head
    np.testing.assert_array_equal(ours[:, dh:2 * dh], np.concatenate([head[0::2], head[1::2]]).T)
    gate_up = stored["model.layers.1.feed_forward.experts.gate_up_proj"]  # (E, d, 2f)
    moe = ck.params["layers"][1]["moe"]
    np.testing.assert_array_equal(np.asarray(moe["gate"]["kernel"]), gate_up[..., :f])
    np.testing.assert_array_equal(np.asarray(moe["up"]["kernel"]), gate_up[..., f:])


def test_left_padding_shifts_the_chunks_as_transformers_does(scout):
    """The chunks of a RoPE layer count from each row's first token (transformers' chunked mask
    offsets them by the row's left padding): our forward pass on a left-padded batch computes
    transformers' logits where there are tokens."""
    ids, mask = token_batch(LLAMA4["vocab_size"], pad_id=0)
    ids, mask = ids[:, ::-1].copy(), mask[:, ::-1].copy()  # the padded row padded on the left
    model = tf.Llama4ForCausalLM.from_pretrained(scout, attn_implementation="eager").eval()
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    ck = rj.load_hf(scout)
    got = np.asarray(ck.apply(ck.params, input_ids=ids, attention_mask=mask)["logits"])
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.slow  # an activation pass and its solves, compiled for this model alone
def test_a_planted_model_is_recovered_from_activations(scout):
    """Activation matching: the heads' q/k/v/o outputs (the QK-norm's rotations of rotary pairs),
    the FFNs' and the shared expert's units, the router's logits and every expert's units (at score
    1: an unpicked expert's own are zeros) on every token; a planted B comes back exactly."""
    ck = rj.load_hf(scout)
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(5))
    t[RESIDUAL] = rj.random_residual(spec, ck.params, jax.random.key(6), "permutation")
    b = rj.apply_transform(spec, ck.params, t)
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(3, LLAMA4["vocab_size"], size=(6, 10)), "attention_mask": np.ones((6, 10), np.int64)} for _ in range(3)]
    result = rj.align(ck.params, b, spec, method="activations", data=data, checkpoint=ck, heads="permute", residual="permutation")
    assert result.report["after"]["total"] <= 1e-6 * result.report["before"]["total"], result.report


@pytest.mark.parametrize("raw, match", [
    ({"model_type": "llama4", "text_config": {"model_type": "llama"}}, "text_config.model_type='llama': a llama4 checkpoint is read with a text_config "
                                                                       "of type llama4_text"),
    ({"model_type": "llama4_text", "interleave_moe_layer_step": 0}, "interleave_moe_layer_step=0"),
    ({"model_type": "llama4_text", "num_hidden_layers": 3, "no_rope_layers": [1, 0]}, "no_rope_layers has 2 entries for num_hidden_layers=3"),
    ({"model_type": "llama4_text", "num_experts_per_tok": 3, "num_local_experts": 2}, "num_experts_per_tok=3 exceeds num_local_experts=2"),
], ids=["vlm-text-type", "moe-step", "no-rope-layers", "top-k"])
def test_configs_the_record_cannot_read_are_refused_by_name(raw, match):
    with pytest.raises(rj.InputError, match=match):
        rj.hf.read_config(raw)


@pytest.mark.slow
def test_more_kv_groups_widen_it_and_its_ffns_refuse_to(scout, tmp_path):
    """Zero kv groups keep the function (a zero head's q and k stay zero through the QK-norm, its
    values add nothing); its FFN widths are a mixture's and a dense MLP's: no one width to pad."""
    ck = rj.load_hf(scout)
    with pytest.raises(rj.InputError, match="cannot be widened"):
        widen(ck, 64)
    wide = widen(ck, kv_heads=4)
    folder = rj.save_hf(wide, wide.params, tmp_path / "wide")
    want = _logits(scout)
    assert np.abs(_logits(folder) - want).max() <= 1e-4 * np.abs(want).max()


def test_configs_of_other_architectures_are_refused_naming_the_keys_that_differ(scout, tmp_path, capsys):
    """Llama 4s whose configs differ (new-user trial): the refusal named leaf paths, or heads alike in
    every number shown; it names the config keys, in memory and streamed alike."""
    no_norm = tmp_path / "no-qk-norm"
    shutil.copytree(scout, no_norm)
    config = json.loads((no_norm / "config.json").read_text())
    (no_norm / "config.json").write_text(json.dumps({**config, "use_qk_norm": False}))
    step = tmp_path / "step"  # experts in every layer
    save_reference(tf.Llama4ForCausalLM, tf.Llama4TextConfig(**{**LLAMA4, "interleave_moe_layer_step": 1}, attention_bias=True), step)
    for b, said in ((no_norm, ["has 4 heads of 8 in 2 kv groups, no QK-norm, A (", "'s 4 heads of 8 in 2 kv groups, QK-norm 'unit'",
                               "their configs differ in use_qk_norm: A true, B false"]),
                    (step, ["it lacks ['layers/{i}/mlp/down/kernel'", "their configs differ in interleave_moe_layer_step: A 2, B 1;"])):
        for flags in ([], ["--max-memory", "1M"]):
            with pytest.raises(SystemExit):
                cli.main(["align", str(scout), str(b), str(tmp_path / "out"), *flags])
            err = capsys.readouterr().err
            assert "does not have the architecture of A" in err and all(x in err for x in said), err
            assert "other counts are embedded" not in err
