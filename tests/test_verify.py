"""`rotsym inspect A --verify`: every group of a family proven on a checkpoint in transformers, and
a wrong group (a record claiming more than the model has) caught, naming the element kind."""

from __future__ import annotations

import dataclasses

import transformers as tf
from parity_utils import save_reference, torch

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.families import family as family_module
from rotsym_jax.families import llama
from rotsym_jax.io import configs
from rotsym_jax.spec import HeadGeometry
from rotsym_jax.verify import verify_groups

TEXT = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, max_position_embeddings=20)


def _qwen3(folder):
    save_reference(tf.Qwen3ForCausalLM, tf.Qwen3Config(**TEXT, num_key_value_heads=2, head_dim=16, attention_bias=True), folder, seed=0)
    return folder


def test_every_group_of_a_family_holds_in_transformers(tmp_path, capsys):
    folder = _qwen3(tmp_path / "qwen3")
    checks = {c.element: c for c in verify_groups(folder)}
    assert all(c.ok for c in checks.values()), checks
    assert checks["QK rotations"].group == "sign flips of whole rotary pairs (QK-norm)" and checks["QK rotations"].difference < 1e-4
    assert checks["residual rotation"].difference is not None  # an untied LM head: the stream may rotate
    assert cli.main(["inspect", str(folder), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verified in transformers" in out and "CHANGES THE OUTPUTS" not in out


def test_a_tied_lm_head_is_untied_to_prove_the_rotation(tmp_path):
    """GPT-2's tied head reads the final norm: the rotation is proven with the head untied, which
    the group names."""
    folder = tmp_path / "gpt2"
    save_reference(tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=20), folder)
    rotation = {c.element: c for c in verify_groups(folder)}["residual rotation"]
    assert rotation.ok and rotation.difference is not None and rotation.difference < 1e-4
    assert rotation.group == "rotations fixing the ones vector (LayerNorm, the tied LM head untied)"


def test_a_record_that_claims_too_much_is_caught(tmp_path, monkeypatch, capsys):
    """Qwen3 declared without its QK-norm: the RoPE pair rotations it would then allow change what
    transformers computes, and verify says so."""
    folder = _qwen3(tmp_path / "qwen3")

    def geometry(config):
        real = llama.LLAMA.head_geometry(config)
        return dataclasses.replace(real, qk_norm=False)

    wrong = dataclasses.replace(llama.LLAMA, head_geometry=geometry)
    monkeypatch.setattr(configs, "FAMILIES", tuple(wrong if f is llama.LLAMA else f for f in configs.FAMILIES))
    assert isinstance(geometry(rj.load_hf(folder, weights=False).model_config), HeadGeometry)
    checks = {c.element: c for c in verify_groups(folder)}
    assert not checks["QK rotations"].ok and checks["QK rotations"].difference > 1e-3
    assert not checks["QK invertible maps"].ok  # the wrong record claims them too, and they are caught as well
    assert all(c.ok for name, c in checks.items() if name not in ("QK rotations", "QK invertible maps"))
    assert cli.main(["inspect", str(folder), "--verify"]) == 1
    captured = capsys.readouterr()
    assert "QK rotations" in captured.out and "CHANGES THE OUTPUTS" in captured.out
    assert "not a symmetry of this model: QK rotations" in captured.err


def test_groups_a_model_does_not_have_are_named_not_failed(tmp_path):
    folder = tmp_path / "bert"
    save_reference(tf.BertForSequenceClassification, tf.BertConfig(**TEXT, num_labels=3), folder, seed=0)
    checks = {c.element: c for c in verify_groups(folder)}
    assert all(c.ok for c in checks.values())
    assert checks["residual rotation"].difference is None and "pre-norm" in checks["residual rotation"].note
    assert checks["residual permutation"].difference < 1e-4 and checks["QK rotations"].group == "orthogonal, per kv group"


def test_a_parallel_residual_layernorm_family_holds_every_group(tmp_path):
    """Pythia-style GPT-NeoX: parallel residual, partial rotary, LayerNorm: the stream rotates
    (fixing the ones vector) once both norms of each layer are folded."""
    folder = tmp_path / "neox"
    save_reference(tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(**TEXT, rotary_pct=0.25), folder, seed=0)
    checks = {c.element: c for c in verify_groups(folder)}
    assert all(c.ok and c.difference is not None for name, c in checks.items() if name not in ("residual signed permutation", "FFN unit scales")), checks
    assert "LayerNorm" in checks["residual signed permutation"].note  # sign flips change the mean
    assert "no gated FFN" in checks["FFN unit scales"].note  # a GELU MLP
    assert checks["residual rotation"].group == "rotations fixing the ones vector (LayerNorm)"
    assert checks["QK rotations"].group == "2-D rotations of each rotary pair, any of the rest"  # 4 of 16 dims rotary


def test_experts_are_proven_and_a_wrong_experts_record_is_caught(tmp_path, monkeypatch):
    """Mixtral: the experts permuted with the router's outputs and each expert's units, in
    transformers. A record that moves the gate's units but not the up projection's is caught."""
    folder = tmp_path / "mixtral"
    save_reference(tf.MixtralForCausalLM, tf.MixtralConfig(**TEXT, num_key_value_heads=2, num_local_experts=4), folder, seed=0)
    checks = {c.element: c for c in verify_groups(folder)}
    assert all(c.ok and c.difference is not None for name, c in checks.items() if name != "FFN unit scales"), checks
    assert "no gated FFN" in checks["FFN unit scales"].note  # routed experts: permutations only
    assert checks["FFN unit permutations"].group == "4 experts (router rows with them) x their units"
    wrong = tuple((r"layers/(?P<layer>\d+)/moe/up/kernel", ("moe.expert", None, None)) if pattern.endswith("moe/(up|gate)/kernel") else (pattern, tags)
                  for pattern, tags in family_module.SPEC_RULES)
    wrong = ((r"layers/(?P<layer>\d+)/moe/gate/kernel", ("moe.expert", None, "moe.unit")),) + wrong
    monkeypatch.setattr(family_module, "SPEC_RULES", wrong)
    checks = {c.element: c for c in verify_groups(folder)}
    assert not checks["FFN unit permutations"].ok and all(c.ok for name, c in checks.items() if name != "FFN unit permutations")


def test_sandwich_norms_are_proven_to_take_signed_permutations_not_rotations(tmp_path):
    """Gemma 2: the stream's signed permutations hold in transformers; rotations are named as not
    applying (sandwich norms), not failed."""
    folder = tmp_path / "gemma2"
    save_reference(tf.Gemma2ForCausalLM, tf.Gemma2Config(**TEXT, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=2.0,
                                                          final_logit_softcapping=3.0, sliding_window=3), folder, seed=0)
    checks = {c.element: c for c in verify_groups(folder)}
    assert all(c.ok for c in checks.values()), checks
    assert checks["residual signed permutation"].difference < 1e-4
    assert checks["residual rotation"].difference is None and "sandwich norms" in checks["residual rotation"].note


def test_a_full_width_qk_norm_is_proven_with_its_gains_and_caught_without_them(tmp_path, monkeypatch):
    """OLMo-2: head permutations hold in transformers only with the QK-norm's gains permuted along
    (a record that leaves them untagged is caught), QK scales on the gains hold, the stream takes
    signed permutations (its sublayers' outputs pass RMSNorm gains), not rotations."""
    folder = tmp_path / "olmo2"
    model = save_reference(tf.Olmo2ForCausalLM, tf.Olmo2Config(**TEXT, num_key_value_heads=2, attention_bias=True, pad_token_id=0,
                                                                eos_token_id=1), folder, seed=0)
    with torch.no_grad():  # gains far from one another, so that moving heads without them shows
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(torch.rand_like(norm.weight) * 2 + 0.2)
    model.save_pretrained(folder)
    checks = {c.element: c for c in verify_groups(folder)}
    assert all(c.ok for c in checks.values()), checks
    assert "gains with them" in checks["head permutations"].group and "gains" in checks["QK scales"].group
    assert checks["residual signed permutation"].difference < 1e-4 and "post-norms" in checks["residual rotation"].note
    # the gains untagged (and the block declared per-head, so that it binds): head permutations now break transformers' model
    wrong_geometry = lambda config: dataclasses.replace(llama.OLMO2.head_geometry(config), qk_norm="head")  # noqa: E731
    wrong = dataclasses.replace(llama.OLMO2, head_geometry=wrong_geometry)
    monkeypatch.setattr(configs, "FAMILIES", tuple(wrong if f is llama.OLMO2 else f for f in configs.FAMILIES))
    checks = {c.element: c for c in verify_groups(folder)}
    assert not checks["head permutations"].ok and checks["head permutations"].difference > 1e-3


def test_a_row_tests_an_element_that_moves_something(tmp_path, monkeypatch):
    """A small group draws the identity often (two heads: half the time), which keeps every output
    and proves nothing (a MiniMax softmax layer's head permutations did): a row draws again until
    its element moves a leaf, and says so where none of its draws did."""
    from rotsym_jax import verify
    from rotsym_jax.spec import bind
    from rotsym_jax.transforms import identity_transform

    folder = _qwen3(tmp_path / "qwen3")
    real, drawn = verify.random_transform, []

    def identity_first(spec, params, key, kinds):  # each row's first draw the identity, its next ones real
        drawn.append(kinds)
        return identity_transform(bind(spec, params)) if drawn.count(kinds) == 1 else real(spec, params, key, kinds)

    monkeypatch.setattr(verify, "random_transform", identity_first)
    checks = {c.element: c for c in verify_groups(folder)}
    assert checks["head permutations"].difference > 0 and drawn.count(("heads",)) == 2, checks["head permutations"]
    monkeypatch.setattr(verify, "random_transform", lambda spec, params, key, kinds: identity_transform(bind(spec, params)))
    checks = {c.element: c for c in verify_groups(folder)}
    assert checks["head permutations"].difference is None and "was the identity" in checks["head permutations"].note
