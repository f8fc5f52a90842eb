"""DeepSeek-V3 and V2 (model types deepseek_v3, deepseek_v2: multi-head latent attention, a mixture
of experts with shared experts, group-limited routing). The generic contracts run on its rows of family_cases.py; here, what
is particular: every element kind proven in transformers, the router's correction bias moving with
its expert, why the experts stay in their routing groups (shown to change transformers' outputs),
the heads permuted with their RoPE queries (and what else would change the outputs), the stacked experts' layout, and V/O heads of another width than Q/K's.
GLM-4.7-Flash (glm4_moe_lite) and MiniCPM3, read by V3's record: the one's layers placed by mlp_layer_types, what
the other's config refuses."""

import types

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import DEEPSEEK, DEEPSEEK_V2, GLM4_MOE_LITE
from parity_utils import assert_outputs_match, save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.io.card import distance_legend, kinds_shown
from rotsym_jax.pytree import flatten, unflatten
from rotsym_jax.transforms import shared_rope_rotation
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")
torch = pytest.importorskip("torch")


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids)).logits.numpy()


def _with_correction(folder, **config):
    """A causal LM whose routers' correction biases are far from zero (transformers starts them at
    zero, a buffer the reference's perturbation skips): they then decide which experts are picked."""
    config = {**DEEPSEEK, **config}
    model = save_reference(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(**config), folder)
    with torch.no_grad():
        for layer in model.model.layers[config["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.as_tensor(np.random.default_rng(0).normal(0, 0.5, config["n_routed_experts"])))
    model.save_pretrained(folder)
    return model


_VERIFIED = {
    "latent": (tf.DeepseekV3ForCausalLM, lambda: tf.DeepseekV3Config(**DEEPSEEK, attention_bias=True)),
    "plain": (tf.DeepseekV3ForSequenceClassification, lambda: tf.DeepseekV3Config(**{**DEEPSEEK, "q_lora_rank": None}, num_labels=3)),
    "v2": (tf.DeepseekV2ForCausalLM, lambda: tf.DeepseekV2Config(**DEEPSEEK_V2, mlp_bias=True)),
}


# the plain queries and V2 repeat the latent model's proofs with other leaves: the slow suite's (the default run's budget)
@pytest.mark.parametrize("model", [pytest.param(m, marks=[pytest.mark.slow] if m != "latent" else []) for m in _VERIFIED])
def test_every_group_holds_in_transformers(tmp_path, model):
    """Latent queries (biases on), plain ones, V2's: head permutations (each head's RoPE query with
    it), Q/K rotations (of the no-RoPE parts, and of the shared RoPE key's pairs with every RoPE
    query), V/O rotations, scales and invertible maps of the no-RoPE parts, the experts (within their
    groups) with their units, the shared experts' and the latents' units, the stream's permutations
    and its rotation with the gains folded, and the latents' rotations with their gains folded (the
    plain queries have the kv latent only)."""
    cls, config = _VERIFIED[model]
    save_reference(cls, config(), tmp_path / model)
    checks = {c.element: c for c in verify_groups(tmp_path / model)}
    proven = {e for e, c in checks.items() if c.ok and c.difference is not None}
    assert len(checks) == 13 and len(proven) == 13, (model, checks)
    latents = "kv_latent (12)" if model == "plain" else "kv_latent (12), q_latent (10)"
    assert checks["latent rotations"].group.startswith(f"orthogonal, per layer, of {latents};"), checks["latent rotations"]
    # MLA has no kv groups: every head reads the one latent (or its own keys, V2-Lite's plain queries alike)
    assert checks["head permutations"].group.startswith(f"{DEEPSEEK['num_attention_heads']} heads (each head's RoPE query rows"), checks


def test_the_correction_bias_moves_with_its_expert(tmp_path):
    """Our forward pass reads the correction bias as transformers does (it changes the picks), and a
    random element of every group, experts and their biases permuted, keeps transformers' logits
    (one routing group: every permutation of the 4 experts, each token's 2 picked by the biases)."""
    model = _with_correction(tmp_path / "a", n_group=1, topk_group=1)
    ids, _ = token_batch(DEEPSEEK["vocab_size"], pad_id=0)
    want = _logits(model, ids)
    ck = rj.load_hf(tmp_path / "a")
    assert_outputs_match(ck.apply(ck.params, input_ids=ids), {"logits": want}, ["logits"])
    unbiased = {k: np.zeros_like(v) if k.endswith("score_correction") else v for k, v in flatten(ck.params).items()}
    assert np.abs(ck.apply(unflatten(unbiased), input_ids=ids)["logits"] - want).max() > 1e-2 * np.abs(want).max()
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(3))
    assert not np.array_equal(t["moe"].perm, np.tile(np.arange(4), (2, 1)))
    moved = rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "moved")
    got = _logits(tf.DeepseekV3ForCausalLM.from_pretrained(moved).eval(), ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("swap, moves", [((0, 4), True), ((0, 1), False)], ids=["across-groups", "within-a-group"])
def test_an_expert_moved_to_another_routing_group_changes_the_function(tmp_path, swap, moves):
    """Why experts permute only within their routing group: a token reaches topk_group of the
    n_group blocks of consecutive experts, so an expert moved to another block is reached by other
    tokens; within a block the router's choice is the same (8 experts in 2 groups, 2 picked of 4)."""
    model = _with_correction(tmp_path / "a", n_routed_experts=8)
    ids, _ = token_batch(DEEPSEEK["vocab_size"], pad_id=0)
    want = _logits(model, ids)
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    bound = rj.bind(spec, ck.params)
    assert [g.routing_groups for g in bound.experts] == [2]
    t = rj.identity_transform(bound)
    perm = np.tile(np.arange(8, dtype=np.int32), (2, 1))
    perm[0, list(swap)] = swap[::-1]
    t["moe"] = t["moe"].replace(perm=jax.numpy.asarray(perm))
    moved = rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "moved")
    got = _logits(tf.DeepseekV3ForCausalLM.from_pretrained(moved).eval(), ids)
    difference = np.abs(got - want).max() / np.abs(want).max()
    assert (difference > 1e-3) if moves else (difference < 1e-5), difference
    # and every permutation the library draws keeps each expert in its block
    for seed in range(5):
        drawn = np.asarray(rj.random_transform(spec, ck.params, jax.random.key(seed))["moe"].perm)
        assert (drawn // 4 == np.arange(8) // 4).all() and (drawn != np.arange(8)).any(), drawn


def _rope_queries(flat):
    return {k: v for k, v in flat.items() if k.endswith(("query_rope/kernel", "query_up_rope/kernel"))}


def test_heads_permute_with_their_rope_queries(tmp_path):
    """MLA's RoPE key is one for every head, so a head may take another slot with its RoPE query
    (role qr) beside its no-RoPE Q/K, its V rows and O's columns: transformers' logits stay. Two
    controls change them: the RoPE queries left in place, and a head's RoPE query rotated as its
    no-RoPE part is (even by a rotation of each rotary pair, which RoPE commutes with: the shared key
    does not follow)."""
    model = save_reference(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(**DEEPSEEK), tmp_path / "a")
    ids, _ = token_batch(DEEPSEEK["vocab_size"], pad_id=0)
    want = _logits(model, ids)
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    bound = rj.bind(spec, ck.params)
    (block,) = bound.attention
    assert block.geometry.shared_rope_dim == DEEPSEEK["qk_rope_head_dim"] and not block.geometry.fixed_order
    assert {m.template for m in block.members if m.role == "qr"} == {"layers/{layer}/attention/query_up_rope/kernel"}
    t = rj.random_transform(spec, ck.params, jax.random.key(0), ("heads", "qk", "vo"))
    assert (np.asarray(t["attn"].group_perm) != np.arange(4)).any()
    moved = flatten(rj.apply_transform(spec, ck.params, t))
    original = flatten(ck.params)
    assert all(not np.array_equal(moved[k], x) for k, x in _rope_queries(original).items())

    def difference(flat, name):
        folder = rj.save_hf(ck, unflatten(flat), tmp_path / name)
        got = _logits(tf.DeepseekV3ForCausalLM.from_pretrained(folder).eval(), ids)
        return np.abs(got - want).max() / np.abs(want).max()

    assert difference(moved, "moved") < 1e-5
    assert difference({**moved, **_rope_queries(original)}, "left") > 1e-3
    # each head's RoPE query rotated by a rotation of each rotary pair, as Q/K's rotations act on a RoPE block
    angle = np.random.default_rng(0).uniform(0.5, 2.5, (4, DEEPSEEK["qk_rope_head_dim"] // 2))
    assert DEEPSEEK.get("rope_interleave", True)  # V3's default: RoPE's pairs are (2i, 2i + 1), stored so
    pairs = {k: x.reshape(x.shape[0], 4, -1, 2) for k, x in _rope_queries(moved).items()}
    c, s = np.cos(angle)[None], np.sin(angle)[None]
    rotated = {k: np.stack([x[..., 0] * c - x[..., 1] * s, x[..., 0] * s + x[..., 1] * c], axis=-1).reshape(x.shape[0], -1)
               for k, x in pairs.items()}
    assert difference({**moved, **rotated}, "rotated") > 1e-3


def test_a_latent_permutes_with_its_gain_and_rotates_only_with_the_gain_folded(tmp_path):
    """Each latent (q_a_proj's columns -> q_a_layernorm -> q_b_proj's rows; kv_a_proj_with_mqa's first
    kv_lora_rank columns -> kv_a_layernorm -> kv_b_proj's rows) is a permutation group, its gain moved
    with its units and its readers' rows held by the attention block too: a random permutation keeps
    transformers' logits. A rotation of the latent changes them (RMSNorm's gain is one per entry), and
    keeps them once the gain is folded into the readers' rows (gain 1), written here by hand: the
    fold `rj.fold_latents` makes (compared below) before latents="rotation" rotates."""
    model = save_reference(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(**DEEPSEEK, attention_bias=True), tmp_path / "a")
    ids, _ = token_batch(DEEPSEEK["vocab_size"], pad_id=0)
    want = _logits(model, ids)
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    bound = rj.bind(spec, ck.params)
    latents = {g.name: g for g in bound.perms if g.name.endswith("_latent")}
    assert {n: (g.size, sorted(m.template.split("/")[-2] for m in g.members if m not in g.reads)) for n, g in latents.items()} == {
        "q_latent": (10, ["query_up", "query_up_rope"]), "kv_latent": (12, ["key", "value"])}
    assert bound.attention[0].after == tuple(sorted(latents)) and bound.attention[0].reads == bound.attention[0].members
    original = flatten(ck.params)

    def difference(flat, name):
        folder = rj.save_hf(ck, unflatten(flat), tmp_path / name)
        got = _logits(tf.DeepseekV3ForCausalLM.from_pretrained(folder).eval(), ids)
        return np.abs(got - want).max() / np.abs(want).max()

    t = rj.random_transform(spec, ck.params, jax.random.key(0), ("perm",))
    t = {**rj.identity_transform(bound), **{n: t[n] for n in latents}}
    moved = flatten(rj.apply_transform(spec, ck.params, t))
    assert not np.array_equal(moved["layers/0/attention/kv_down_norm/scale"], original["layers/0/attention/kv_down_norm/scale"])
    assert difference(moved, "permuted") < 1e-5
    rotation = np.linalg.qr(np.random.default_rng(0).normal(size=(12, 12)))[0].astype(np.float32)
    at = "layers/{}/attention/{}"

    def rotated(fold: bool):
        out = dict(original)
        for i in range(DEEPSEEK["num_hidden_layers"]):
            gain = original[at.format(i, "kv_down_norm/scale")]
            for leaf in ("kv_down/kernel", "kv_down/bias"):
                out[at.format(i, leaf)] = original[at.format(i, leaf)] @ rotation
            for leaf in ("key/kernel", "value/kernel"):
                out[at.format(i, leaf)] = rotation.T @ (gain[:, None] * original[at.format(i, leaf)] if fold else original[at.format(i, leaf)])
            if fold:
                out[at.format(i, "kv_down_norm/scale")] = np.ones_like(gain)
        return out

    assert difference(rotated(fold=False), "rotated") > 1e-3
    assert difference(rotated(fold=True), "folded") < 1e-5
    # the library's fold is that one: every gain of both latents 1, each reader's rows times its gain
    folded = flatten(rj.fold_latents(spec, ck.params))
    for i in range(DEEPSEEK["num_hidden_layers"]):
        for gain, reading in (("kv_down_norm/scale", ("key/kernel", "value/kernel")), ("query_down_norm/scale", ("query_up/kernel", "query_up_rope/kernel"))):
            np.testing.assert_array_equal(folded[at.format(i, gain)], np.ones_like(original[at.format(i, gain)]))
            for leaf in reading:
                np.testing.assert_allclose(folded[at.format(i, leaf)], original[at.format(i, gain)][:, None] * original[at.format(i, leaf)], rtol=1e-6)
    assert {k for k in folded if not np.array_equal(folded[k], original[k])} == {at.format(i, leaf) for i in range(DEEPSEEK["num_hidden_layers"])
                                                                                for leaf in ("kv_down_norm/scale", "key/kernel", "value/kernel", "query_down_norm/scale",
                                                                                             "query_up/kernel", "query_up_rope/kernel")}


def test_the_latent_rotation_row_holds_with_the_fold_and_fails_without_it(tmp_path, monkeypatch):
    """`inspect --verify`'s row of the latents' rotations holds on a tiny DeepSeek-V3 (gains as stored,
    not uniform) because it folds them as align does: the same row without the fold (and without the
    check that refuses a rotation of unfolded gains) changes transformers' logits, and says so. A
    model without latents has no such row."""
    from rotsym_jax import verify
    from rotsym_jax.engine import latents as latents_mod

    save_reference(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(**DEEPSEEK), tmp_path / "a")
    held = verify_groups(tmp_path / "a")[-1]
    assert held.element == "latent rotations" and held.ok and held.difference < 1e-5, held
    monkeypatch.setattr(verify, "fold_latents", lambda spec, params: params)
    monkeypatch.setattr(latents_mod, "check_rotations", lambda *args: None)
    unfolded = verify_groups(tmp_path / "a")[-1]
    assert unfolded.element == "latent rotations" and not unfolded.ok and unfolded.difference > 1e-3, unfolded
    llama = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    save_reference(tf.LlamaForCausalLM, llama, tmp_path / "llama")
    assert "latent rotations" not in {c.element for c in verify_groups(tmp_path / "llama")}


_ROTATED = {
    "v3": (tf.DeepseekV3ForCausalLM, lambda: tf.DeepseekV3Config(**DEEPSEEK, attention_bias=True)),
    "v2": (tf.DeepseekV2ForCausalLM, lambda: tf.DeepseekV2Config(**DEEPSEEK_V2, attention_bias=True)),
    "v3-plain-queries": (tf.DeepseekV3ForCausalLM, lambda: tf.DeepseekV3Config(**{**DEEPSEEK, "q_lora_rank": None})),
}


@pytest.mark.parametrize("model", list(_ROTATED))
def test_a_latent_rotation_after_the_fold_keeps_transformers_logits(tmp_path, model):
    """The library's element (`UnitPermutation.rotation`, drawn by `rj.random_latent_rotations`: a Haar
    rotation per layer of each latent) on the params `rj.fold_latents` gives: transformers' V3 and V2
    logits (float32) unchanged; the same rotation on the params as stored (gains not folded) changes
    them, and `apply_transform` refuses it there by name. Without q_lora the query has no latent."""
    cls, config = _ROTATED[model]
    reference = save_reference(cls, config(), tmp_path / "a")
    ids, _ = token_batch(DEEPSEEK["vocab_size"], pad_id=0)
    want = _logits(reference, ids)
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    bound = rj.bind(spec, ck.params)
    rotatable = sorted(g.name for g in bound.perms if g.rotatable)
    assert rotatable == (["kv_latent"] if model == "v3-plain-queries" else ["kv_latent", "q_latent"])
    folded = rj.fold_latents(spec, ck.params)
    t = rj.random_latent_rotations(spec, folded, jax.random.key(0))
    assert all(t[n].rotation.shape == (DEEPSEEK["num_hidden_layers"], g.size, g.size) for n, g in ((g.name, g) for g in bound.perms if g.rotatable))

    def difference(params, name):
        folder = rj.save_hf(ck, params, tmp_path / name)
        return np.abs(_logits(cls.from_pretrained(folder).eval(), ids) - want).max() / np.abs(want).max()

    assert difference(folded, "folded") < 1e-5
    rotated = rj.apply_transform(spec, folded, t)
    assert difference(rotated, "rotated") < 1e-5
    jitted = jax.jit(lambda p, t: rj.apply_transform(spec, p, t))(folded, t)  # traced gains: nothing read back, no refusal
    for path, leaf in flatten(jitted).items():
        np.testing.assert_allclose(leaf, flatten(rotated)[path], rtol=1e-5, atol=1e-6, err_msg=path)
    with pytest.raises(rj.InputError, match=r"latent norm gains \['layers/0/attention/kv_down_norm/scale'.* rj.fold_latents"):
        rj.apply_transform(spec, ck.params, t)
    from rotsym_jax.engine.groups import apply_unchecked

    assert difference(apply_unchecked(bound, ck.params, t), "unfolded") > 1e-3


def _unit_matrices(t) -> np.ndarray:
    """(L, n, n): per layer the matrix M with x[..., perm] @ rotation = x @ M."""
    perm = np.asarray(t.perm)
    n = perm.shape[-1]
    moves = np.zeros((len(perm), n, n))
    moves[np.arange(len(perm))[:, None], perm, np.arange(n)[None, :]] = 1
    return moves if t.rotation is None else moves @ np.asarray(t.rotation, np.float64)


def test_align_undoes_a_planted_latent_rotation(tmp_path):
    """B = A folded, every group planted (heads, Q/K, V/O, the experts, the FFN units, the latents'
    permutations) then a random rotation of each latent per layer: align(latents="rotation") finds the
    inverse rotation (its element composed with the plant is the identity on the latents) and B comes
    back to A, distance ~0; latents="permutation" cannot undo it. align refuses gains not folded."""
    save_reference(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(**DEEPSEEK, attention_bias=True), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    a = rj.fold_latents(spec, ck.params)
    plant = rj.compose_transforms(rj.random_transform(spec, a, jax.random.key(1)), rj.random_latent_rotations(spec, a, jax.random.key(2)))
    b = rj.apply_transform(spec, a, plant)
    result = rj.align(a, b, spec, latents="rotation", heads="permute")
    flat_a, aligned = flatten(a), flatten(result.params)
    assert all(np.allclose(aligned[k], x, atol=1e-5) for k, x in flat_a.items()), "the plant not undone"
    assert result.report["after"]["total"] < 1e-5 * result.report["before"]["total"]
    for name in ("q_latent", "kv_latent"):
        undone = _unit_matrices(plant[name].then(result.transforms[name]))  # the plant, then its alignment: the identity
        np.testing.assert_allclose(undone, np.broadcast_to(np.eye(undone.shape[-1]), undone.shape), atol=1e-5)
        assert result.report["moved"][name]["rotation"] > 0.5, result.report["moved"][name]
    permuted = rj.align(a, b, spec, heads="permute")
    assert permuted.report["after"]["total"] > 0.1 * permuted.report["before"]["total"], permuted.report["after"]
    with pytest.raises(rj.InputError, match=r"params_a \(model A, the anchor\): latent norm gains .* rj.fold_latents"):
        rj.align(ck.params, b, spec, latents="rotation")
    with pytest.raises(rj.InputError, match="latents='rotation' is solved from weights"):
        rj.AlignOptions(latents="rotation", method="activations")


def _turned(x, angles, interleaved: bool):
    """x's last axis in blocks of r = 2 len(angles) (a head's RoPE part, or the shared key), each rotary
    pair turned by its angle: pairs (2i, 2i + 1) where interleaved, (i, i + r/2) as rotate_half has them."""
    r = 2 * len(angles)
    blocks = x.reshape(*x.shape[:-1], -1, r)
    pairs = blocks.reshape(*blocks.shape[:-1], r // 2, 2) if interleaved else np.swapaxes(blocks.reshape(*blocks.shape[:-1], 2, r // 2), -1, -2)
    c, s = np.cos(angles), np.sin(angles)
    turned = np.stack([pairs[..., 0] * c - pairs[..., 1] * s, pairs[..., 0] * s + pairs[..., 1] * c], axis=-1)
    return (turned if interleaved else np.swapaxes(turned, -1, -2)).reshape(x.shape)


# rotate_half's pairs in the slow suite (the default run's budget), where a planted rotation is undone too
@pytest.mark.parametrize("interleave", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["interleaved", "rotate-half"])
def test_the_shared_rope_key_turns_with_every_heads_rope_query(tmp_path, interleave):
    """One 2-D rotation per rotary pair, the same for the shared RoPE key (kv_a_proj_with_mqa's last
    rows, bias too) and every head's RoPE query, keeps transformers' logits, with the pairs as the
    layout stores them (rope_interleave: (2i, 2i + 1), else (i, i + r/2)): the library's element
    (`HeadTransform.rope`) is that turn; the other layout's pairs, or the key alone, change them."""
    config = tf.DeepseekV3Config(**DEEPSEEK, attention_bias=True, rope_interleave=interleave)
    model = save_reference(tf.DeepseekV3ForCausalLM, config, tmp_path / "a")
    ids, _ = token_batch(DEEPSEEK["vocab_size"], pad_id=0)
    want = _logits(model, ids)
    ck = rj.load_hf(tmp_path / "a")
    original = flatten(ck.params)
    angles = np.random.default_rng(1).uniform(0.5, 2.5, DEEPSEEK["qk_rope_head_dim"] // 2).astype(np.float32)

    def turned(pairs_interleaved: bool, queries: bool):
        parts = ("key_rope/kernel", "key_rope/bias") + (("query_up_rope/kernel",) if queries else ())
        return {**original, **{k: _turned(x, angles, pairs_interleaved) for k, x in original.items() if k.endswith(parts)}}

    def difference(flat, name):
        folder = rj.save_hf(ck, unflatten(flat), tmp_path / name)
        got = _logits(tf.DeepseekV3ForCausalLM.from_pretrained(folder).eval(), ids)
        return np.abs(got - want).max() / np.abs(want).max()

    # the library's element (HeadTransform.rope) is that turn, on the pairs as this layout stores them
    spec = rj.spec_for(ck)
    bound = rj.bind(spec, ck.params)
    geometry = bound.attention[0].geometry
    assert geometry.shared_rope_interleaved == interleave
    t = rj.identity_transform(bound)
    t["attn"] = t["attn"].replace(rope=shared_rope_rotation(np.tile(angles, (DEEPSEEK["num_hidden_layers"], 1)), geometry))
    moved = flatten(rj.apply_transform(spec, ck.params, t))
    assert all(np.allclose(moved[k], x, atol=1e-6) for k, x in turned(interleave, True).items())
    assert difference(moved, "turned") < 1e-5
    assert difference(turned(not interleave, True), "other-pairs") > 1e-3
    if interleave:
        assert difference(turned(interleave, False), "key-alone") > 1e-3
    else:  # the interleaved pairs' plant is undone by the conformance rows (every rope_interleave=True class)
        planted = rj.random_transform(spec, ck.params, jax.random.key(2), ("heads", "qk"))
        result = rj.align(ck.params, rj.apply_transform(spec, ck.params, planted), spec, heads="permute")
        aligned = flatten(result.params)
        assert all(np.allclose(aligned[k], x, atol=1e-5) for k, x in original.items()), "the plant not undone"


def test_experts_stored_stacked_read_as_the_ones_stored_apart(tmp_path):
    """transformers 5 holds the experts stacked (`mlp.experts.gate_up_proj`, `down_proj`), and tools
    that save its state dict (mergekit) write them so: the same leaves as save_pretrained's
    per-expert tensors, written back as they came."""
    from safetensors.torch import save_file

    model = save_reference(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(**DEEPSEEK), tmp_path / "apart")
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_text((tmp_path / "apart" / "config.json").read_text())
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, stacked / "model.safetensors")
    a, b = rj.load_hf(tmp_path / "apart"), rj.load_hf(stacked)
    assert b.layout.stacked_experts and not a.layout.stacked_experts
    flat_a, flat_b = flatten(a.params), flatten(b.params)
    assert flat_a.keys() == flat_b.keys() and all(np.array_equal(flat_a[k], flat_b[k]) for k in flat_a)
    again = rj.save_hf(b, b.params, tmp_path / "again")
    from rotsym_jax.io import hf

    files = hf.TensorFiles(again)
    try:
        assert "model.layers.1.mlp.experts.gate_up_proj" in files.names()
        np.testing.assert_array_equal(files.read("model.layers.1.mlp.experts.gate_up_proj"), state["model.layers.1.mlp.experts.gate_up_proj"].numpy())
    finally:
        files.close()


@pytest.mark.parametrize("v_head_dim", [6, 12])
def test_value_heads_of_another_width_than_the_keys_get_their_own_maps(tmp_path, capsys, v_head_dim):
    """v_head_dim != qk_nope_head_dim (narrower, wider): the attention group holds V/O maps of the
    value width beside Q/K's of the no-RoPE width (`HeadGeometry.value_dim`); a plant of every group
    keeps transformers' logits and `align` undoes it, the heads' Q/K and V/O with the rest; `rotsym
    inspect` names the widths and leaves no attention group out."""
    config = tf.DeepseekV3Config(**{**DEEPSEEK, "v_head_dim": v_head_dim})
    model = save_reference(tf.DeepseekV3ForCausalLM, config, tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    bound = rj.bind(spec, ck.params)
    geometry = bound.attention[0].geometry
    assert (geometry.head_dim, geometry.v_dim) == (DEEPSEEK["qk_nope_head_dim"], v_head_dim)
    assert {g.name for g in bound.groups} == {"attn", "ffn", "shared_ffn", "moe", "q_latent", "kv_latent"}
    assert cli.main(["inspect", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert "no attention group" not in printed and f"{v_head_dim} value dims (v_head_dim)" in printed, printed
    assert printed.count("rotations too with its norm's gain folded into its readers (latents='rotation')") == 2, printed  # q_latent, kv_latent
    planted = rj.random_transform(spec, ck.params, jax.random.key(0))
    assert planted["attn"].vo.shape[-1] == v_head_dim and planted["attn"].qk.shape[-1] == DEEPSEEK["qk_nope_head_dim"]
    b = rj.save_hf(ck, rj.apply_transform(spec, ck.params, planted), tmp_path / "b")
    out = tmp_path / "aligned"
    assert cli.main(["align", str(tmp_path / "a"), str(b), str(out), "--heads", "permute", "--rescale", "joint", "--quiet"]) == 0
    ids, _ = token_batch(DEEPSEEK["vocab_size"], pad_id=0)
    want = _logits(model, ids)
    for folder in (b, out):
        np.testing.assert_allclose(_logits(tf.DeepseekV3ForCausalLM.from_pretrained(folder).eval(), ids), want, rtol=0, atol=1e-4 * np.abs(want).max())
    aligned, original, moved = flatten(rj.load_hf(out).params), flatten(ck.params), flatten(rj.load_hf(b).params)
    assert not np.allclose(moved["layers/0/attention/value/kernel"], original["layers/0/attention/value/kernel"], atol=1e-3)
    assert all(np.allclose(aligned[k], original[k], atol=1e-5) for k in original)  # the plant undone, V/O and Q/K with the rest


def test_glm4_moe_lite_with_wider_values_verifies_every_group(tmp_path, capsys):
    """`rotsym inspect --verify` on a tiny GLM-4.7-Flash whose value heads are wider than the keys'
    no-RoPE part (12 and 8, as its release's 256 and 192): every group holds in transformers."""
    assert GLM4_MOE_LITE["v_head_dim"] != GLM4_MOE_LITE["qk_nope_head_dim"]
    save_reference(tf.Glm4MoeLiteForCausalLM, tf.Glm4MoeLiteConfig(**GLM4_MOE_LITE), tmp_path / "a")
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "a"), "--verify"]) == 0
    printed = capsys.readouterr().out
    checks = printed.split("verified in transformers")[1].splitlines()[1:]
    assert len(checks) == 13 and all(line.endswith("  ok") for line in checks), printed
    assert checks[-1].split()[:2] == ["latent", "rotations"], printed
    widths = f"({GLM4_MOE_LITE['v_head_dim']} wide, Q/K {GLM4_MOE_LITE['qk_nope_head_dim']})"
    assert [line.split()[:2] for line in checks if widths in line] == [["VO", "rotations"], ["VO", "invertible"]], printed
    assert "no attention group" not in printed and "QK rotations" in printed, printed


# 10-25 s each: compiles the forward pass's statistics and steps; the default run keeps learned alignment over values wider than the keys
@pytest.mark.parametrize("method, v_head_dim", [pytest.param(m, v, marks=[] if (m, v) == ("learned", 12) else [pytest.mark.slow])
                                                for m in ("activations", "learned") for v in (DEEPSEEK["v_head_dim"], 12)])
def test_data_methods_run_through_latent_attention_and_the_routers(tmp_path, method, v_head_dim):
    """Our forward pass is what activation matching and learned alignment read: a planted B (every
    group moved, experts within their routing groups, the stream permuted) comes back from
    activations exactly; learned alignment (which matches no experts: refused by name for a
    mixture) runs its steps on the dense layers' model and keeps B's function. Both with the value
    heads as wide as the keys' no-RoPE part and wider (V/O's maps and sites of their own width)."""
    dense = {"first_k_dense_replace": DEEPSEEK["num_hidden_layers"]} if method == "learned" else {}
    save_reference(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(**{**DEEPSEEK, "vocab_size": 100, "v_head_dim": v_head_dim, **dense}), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1), ("perm", "qk", "vo"))
    t["residual"] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
    b = rj.apply_transform(spec, ck.params, t)
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(3, 97, size=(6, 10)), "attention_mask": np.ones((6, 10), int)} for _ in range(3)]
    options = dict(steps=3, patience=0) if method == "learned" else {}
    result = rj.align(ck.params, b, spec, method=method, data=data, checkpoint=ck, residual="permutation", **options)
    want = ck.apply(ck.params, **data[0])["logits"]
    got = ck.apply(result.params, **data[0])["logits"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    if method == "activations":
        assert result.report["after"]["total"] <= 1e-6 * result.report["before"]["total"], result.report["after"]
    if method == "learned":  # the learned elements are in the group: the checked apply takes them and gives the same params
        again = flatten(rj.apply_transform(spec, b, result.transforms))
        assert result.transforms["attn"].vo.shape[-1] == v_head_dim and result.report["learned"]["loss"]
        assert all(np.allclose(np.asarray(x), np.asarray(again[k]), atol=1e-5) for k, x in flatten(result.params).items())


def test_inspect_and_the_legend_say_what_latent_attention_has(tmp_path, capsys):
    """What a new user of DeepSeek's MLA reads: the heads with no kv groups and the latent they all
    read, each head's query/key dims without and with RoPE and its value dims as the config gives
    them, each latent's leaves that the attention block holds too, and the distance legend's columns
    named as the model's latents (not as an unknown group)."""
    config = {**DEEPSEEK, "first_k_dense_replace": DEEPSEEK["num_hidden_layers"]}  # no experts: not what is read here
    save_reference(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(**config), tmp_path / "a", perturb=False)
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "a")]) == 0
    said = {line.split(":")[0].strip(): line for line in capsys.readouterr().out.splitlines()}
    heads, nope, rope, v = (config[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    attention = said["attention 'attn'"]
    assert (f"{heads} heads sharing one RoPE key, no kv groups (MLA: every head's keys and values read from the latent 'kv_latent'); "
            f"per head {nope} query/key dims without RoPE + {rope} with RoPE (qk_nope_head_dim + qk_rope_head_dim), {v} value dims "
            "(v_head_dim)") in attention and " kv groups," not in attention, attention
    for latent, size in (("kv_latent", config["kv_lora_rank"]), ("q_latent", config["q_lora_rank"])):
        assert (f"permutation {latent!r}: {config['num_hidden_layers']} layers, {size} units (4 leaf kinds; 2 of them also on an axis of "
                "'attn' (solved after this group, from its assignment), this one solved from the other 2)") in said[f"permutation {latent!r}"]
    ck = rj.load_hf(tmp_path / "a")
    kinds = kinds_shown([("b", {kind: 0.0 for _, kind in rj.bind(rj.spec_for(ck), ck.params).kinds})])
    legend = distance_legend(kinds)
    assert "q_latent" in kinds and "kv_latent" in kinds and "the leaves of group" not in legend, legend
    assert "kv_latent MLA's key-value latent (kv_a_proj_with_mqa's latent outputs and their norm)" in legend, legend


def test_a_shared_rope_key_needs_its_query_rows_and_one_head_per_group():
    """Bad input named: a geometry with a shared RoPE key and kv groups, a block whose RoPE query rows
    (role qr) and geometry disagree."""
    with pytest.raises(rj.SpecError, match="shared_rope_dim=4 with 4 heads in 2 kv groups"):
        rj.HeadGeometry(4, 2, 8, shared_rope_dim=4)
    params = {"q": np.zeros((3, 32)), "k": np.zeros((3, 32)), "v": np.zeros((3, 32)), "o": np.zeros((32, 3)), "qr": np.zeros((3, 8)),
              "kr": np.zeros((3, 2))}
    rules = [("q", (None, "attn.q")), ("k", (None, "attn.k")), ("v", (None, "attn.v")), ("o", ("attn.o", None)), ("kr", (None, "attn.kr"))]
    with pytest.raises(rj.SpecError, match=r"shared_rope_dim=2: the rows of each head's RoPE query \(attn.qr\) and of the RoPE key"):
        rj.bind(rj.Spec(rules + [("qr", None)], heads={"attn": rj.HeadGeometry(4, 4, 8, shared_rope_dim=2)}), params)
    bound = rj.bind(rj.Spec(rules + [("qr", (None, "attn.qr"))], heads={"attn": rj.HeadGeometry(4, 4, 8, shared_rope_dim=2)}), params)
    assert sorted(m.role for m in bound.attention[0].members) == ["k", "kr", "o", "q", "qr", "v"]
    latent = {"w": np.zeros((5, 3)), "g": np.zeros(3)}
    with pytest.raises(rj.SpecError, match="permutation group 'lat': every leaf of it is an attention block's too"):
        rj.bind(rj.Spec([("q", ("lat", "attn.q"))] + rules[1:] + [("qr", (None, "attn.qr")), ("w|g", None)],
                        heads={"attn": rj.HeadGeometry(4, 4, 8, shared_rope_dim=2)}), {**params, **latent})
    with pytest.raises(rj.SpecError, match="'lat.in' beside an attention role"):
        rj.bind(rj.Spec([("q", ("lat.in", "attn.q"))] + rules[1:] + [("qr", (None, "attn.qr")), ("w", (None, "lat.out")), ("g", None)],
                        heads={"attn": rj.HeadGeometry(4, 4, 8, shared_rope_dim=2)}), {**params, **latent})
    shared = rj.bind(rj.Spec([("q", ("lat", "attn.q"))] + rules[1:] + [("qr", (None, "attn.qr")), ("w", (None, "lat")), ("g", ("lat",))],
                             heads={"attn": rj.HeadGeometry(4, 4, 8, shared_rope_dim=2)}), {**params, **latent})
    assert sorted((m.template, m.also) for m in shared.perms[0].members) == [("g", None), ("q", ("attn", 1)), ("w", None)]
    assert shared.attention[0].after == ("lat",) and dict(shared.kinds)["q"] == "qk"
    with pytest.raises(rj.SpecError, match="expected 8 = 4 kv groups x 1 heads x 2 head_dim"):
        rj.bind(rj.Spec(rules + [("qr", (None, "attn.qr"))], heads={"attn": rj.HeadGeometry(4, 4, 8, shared_rope_dim=2)}),
                {**params, "qr": np.zeros((3, 12))})


def test_glm4_moe_lite_places_its_mixtures_by_mlp_layer_types(tmp_path):
    """GLM-4.7-Flash's layers are dense or sparse as mlp_layer_types says (first_k_dense_replace is not
    its config's): the tensors read follow it; a list of another length or word is refused by name
    (transformers would read any other word as dense, or fail on a short list)."""
    types = ["sparse", "dense", "sparse"]
    save_reference(tf.Glm4MoeLiteForCausalLM, tf.Glm4MoeLiteConfig(**{**GLM4_MOE_LITE, "mlp_layer_types": types}), tmp_path)
    leaves = flatten(rj.load_hf(tmp_path).params)
    assert [f"layers/{i}/moe/router/kernel" in leaves for i in range(3)] == [t == "sparse" for t in types]
    assert [f"layers/{i}/mlp/up/kernel" in leaves for i in range(3)] == [t == "dense" for t in types]
    raw = {"model_type": "glm4_moe_lite", "num_hidden_layers": 3}
    assert hf.read_config(raw).mlp_layer_types == ["dense", "sparse", "sparse"]  # Glm4MoeLiteConfig's default
    for bad in (["dense", "sparse"], ["dense", "moe", "sparse"]):
        with pytest.raises(rj.InputError, match=r"mlp_layer_types=.*one entry per layer \(3\), each 'dense' or 'sparse'"):
            hf.read_config({**raw, "mlp_layer_types": bad})


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 30}, r"hidden_size=30 is not a multiple of num_attention_heads=40"),
    ({"dim_model_base": 0}, r"'dim_model_base' is 0 \(int\); expected a finite positive number"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16, "long_factor": [1.0] * 8}},
     r"rope_parameters.long_factor=.*one factor per rotary pair \(16 for qk_rope_head_dim=32\)"),
], ids=["heads", "logit-divisor", "longrope-factors"])
def test_minicpm3_refuses_what_its_model_cannot_run(change, message):
    """MiniCPM3Config refuses a hidden size its heads do not divide; a dim_model_base of 0 would divide
    the LM's input by infinity; LongRoPE needs a factor per rotary pair (transformers' rope validation
    says so; a single factor broadcasts in its forward, any other count fails there)."""
    with pytest.raises(rj.InputError, match=message):
        hf.read_config({"model_type": "minicpm3", **change})


def test_latent_rotations_stream_as_in_memory_and_are_in_the_report_and_recipe(tmp_path):
    """`rotsym align --latents rotation` on two DeepSeek-V3 models of different seeds (gains as
    stored, not uniform): in memory and streamed a layer at a time (each tensor folded as read) the
    same tensors bit for bit and the same report; the option in the report and the recipe; what
    they write computes B's function in transformers; and it equals `align` on the folded models."""
    import json

    import yaml
    from checkpoint_utils import assert_same_checkpoint

    config = tf.DeepseekV3Config(**DEEPSEEK, attention_bias=True)
    save_reference(tf.DeepseekV3ForCausalLM, config, tmp_path / "a")
    reference = save_reference(tf.DeepseekV3ForCausalLM, config, tmp_path / "b", seed=1)
    flags = ["--latents", "rotation", "--heads", "permute", "--quiet"]
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "memory"), *flags]) == 0
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "stream"), *flags, "--max-memory", "1G"]) == 0
    memory, stream = (json.loads((tmp_path / d / "rotsym_report.json").read_text()) for d in ("memory", "stream"))
    assert memory["options"]["latents"] == stream["options"]["latents"] == "rotation" and "streaming" in stream["result"]
    for key in ("before", "after", "chosen", "moved"):
        assert stream["result"][key] == memory["result"][key], key
    assert memory["result"]["moved"]["kv_latent"]["rotation"] > 0.1, memory["result"]["moved"]
    assert_same_checkpoint(tmp_path / "stream", tmp_path / "memory")
    assert stream["result"]["streaming"]["chunk_layers"] < DEEPSEEK["num_hidden_layers"]  # several chunks, each its layers' rotations
    rj.streaming.align_to_disk(tmp_path / "a", tmp_path / "b", tmp_path / "one", chunk_layers=1, latents="rotation", heads="permute")
    assert_same_checkpoint(tmp_path / "one", tmp_path / "memory")
    recipe = yaml.safe_load((tmp_path / "memory" / "rotsym_config.yaml").read_text())
    assert recipe["options"]["latents"] == "rotation", recipe
    ids, _ = token_batch(DEEPSEEK["vocab_size"], pad_id=0)
    want = _logits(reference, ids)
    got = _logits(tf.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "memory").eval(), ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    a, b = rj.load_hf(tmp_path / "a"), rj.load_hf(tmp_path / "b")
    spec = rj.spec_for(b)
    expected = rj.align(rj.fold_latents(spec, a.params), rj.fold_latents(spec, b.params), spec, latents="rotation", heads="permute")
    written = flatten(rj.load_hf(tmp_path / "memory").params)
    assert all(np.allclose(written[k], x, atol=1e-6) for k, x in flatten(expected.params).items())
    # the rotation lowers the distance the latents' permutations leave
    permuted = rj.align(rj.fold_latents(spec, a.params), rj.fold_latents(spec, b.params), spec, heads="permute")
    assert expected.report["after"]["total"] < permuted.report["after"]["total"], (expected.report["after"], permuted.report["after"])


def test_a_merge_recipe_with_latent_rotations_folds_every_model_in_memory_and_streamed(tmp_path):
    """A merge recipe's `align_options.latents: rotation`, and `rotsym merge --latents rotation`: the
    anchor and B are folded alike (the average of a gain of 1 and a gain as stored would be neither
    model's), in memory and streamed the same tensors bit for bit, the flags' run too, whose report
    and recipe record the option: the mean of A folded and B folded and aligned by `align` (the LM
    head the anchor's, as the recipe's task_head says), the merged latents' gains 1."""
    import json

    import yaml
    from checkpoint_utils import assert_same_checkpoint

    config = tf.DeepseekV3Config(**DEEPSEEK, attention_bias=True)
    save_reference(tf.DeepseekV3ForCausalLM, config, tmp_path / "a")
    save_reference(tf.DeepseekV3ForCausalLM, config, tmp_path / "b", seed=1)
    recipe = {"models": [str(tmp_path / "a"), str(tmp_path / "b")], "method": "average", "align": "anchor",
              "align_options": {"latents": "rotation", "heads": "permute"}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert cli.main(["merge", str(tmp_path / "recipe.yaml"), str(tmp_path / "memory"), "--quiet"]) == 0
    assert cli.main(["merge", str(tmp_path / "recipe.yaml"), str(tmp_path / "stream"), "--quiet", "--max-memory", "1G"]) == 0
    assert_same_checkpoint(tmp_path / "stream", tmp_path / "memory")
    assert yaml.safe_load((tmp_path / "memory" / "rotsym_config.yaml").read_text())["align_options"]["latents"] == "rotation"
    # the merge command's flags run the recipe's merge (a new-user trial found no --latents on merge)
    flags = ["--method", "average", "--latents", "rotation", "--heads", "permute", "--quiet"]
    assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "flags"), *flags]) == 0
    assert_same_checkpoint(tmp_path / "flags", tmp_path / "memory")
    written = yaml.safe_load((tmp_path / "flags" / "rotsym_config.yaml").read_text())
    report = json.loads((tmp_path / "flags" / "rotsym_report.json").read_text())
    assert written["align_options"]["latents"] == report["options"]["align_options"]["latents"] == "rotation", (written, report["options"])
    assert written["align_options"]["heads"] == "permute" and written["align"] == "anchor", written
    merged = flatten(rj.load_hf(tmp_path / "memory").params)
    a, b = rj.load_hf(tmp_path / "a"), rj.load_hf(tmp_path / "b")
    spec = rj.spec_for(a)
    folded_a = rj.fold_latents(spec, a.params)
    aligned = rj.align(folded_a, rj.fold_latents(spec, b.params), spec, latents="rotation", heads="permute").params
    want = {k: (x + y) / 2 for k, x, y in ((k, x, flatten(aligned)[k]) for k, x in flatten(folded_a).items())}
    assert all(np.allclose(merged[k], x, atol=1e-6) for k, x in want.items() if not k.startswith("lm_head"))
    assert all(np.array_equal(merged[f"layers/{i}/attention/kv_down_norm/scale"], np.ones(DEEPSEEK["kv_lora_rank"], np.float32))
               for i in range(DEEPSEEK["num_hidden_layers"]))


def test_latent_rotation_says_the_distances_are_the_folded_models():
    """The latents' gains are folded before aligning, which changes "before" (a new-user trial saw
    it change with no word): the run says so, as --residual rotation does."""
    from rotsym_jax.pipeline.notes import note_folded_frame

    said = []
    progress = types.SimpleNamespace(note=said.append)
    note_folded_frame(progress, {"latents": "permutation", "residual": "none"})
    assert said == []
    note_folded_frame(progress, {"latents": "rotation", "residual": "none"})
    assert len(said) == 1 and "--latents rotation" in said[0] and "folded models'" in said[0]


def test_latent_flags_a_command_cannot_run_are_refused_by_name(tmp_path, capsys):
    """`--latents rotation` where it would do nothing or the wrong thing is refused, naming it: a
    merge that aligns nothing, a recipe (it names its options itself), an adapter extracted against a
    base whose gains are not folded; learned's flags are not the merge command's (it aligns by
    weights). Nothing is written."""
    import yaml

    config = tf.DeepseekV3Config(**DEEPSEEK)
    for name, seed in (("a", 0), ("b", 1)):
        save_reference(tf.DeepseekV3ForCausalLM, config, tmp_path / name, seed=seed)
    pair = [str(tmp_path / "a"), str(tmp_path / "b")]

    def refused(argv) -> str:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        return capsys.readouterr().err

    merge = ["merge", "--method", "average", *pair]
    assert "--latents: alignment options, but this merge aligns nothing (--align none)" in refused(
        [*merge, str(tmp_path / "o1"), "--align", "none", "--latents", "rotation"])
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"models": pair, "method": "average"}))
    assert "--latents: a recipe names its alignment options itself" in refused(
        ["merge", str(tmp_path / "recipe.yaml"), str(tmp_path / "o2"), "--latents", "rotation"])
    assert "unrecognized arguments: --steps 5" in refused([*merge, str(tmp_path / "o3"), "--steps", "5"])
    err = refused(["extract-lora", *pair, str(tmp_path / "o4"), "--align", "--latents", "rotation"])
    assert "--latents rotation: a rotation keeps the function only once the norm gains are folded" in err, err
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


def test_inspect_with_b_folds_the_latents_as_align_does(tmp_path, capsys):
    """`rotsym inspect A B --latents rotation` on gains as stored (a new-user trial got the library's
    "fold them first" from the command that offers the flag): the distances it prints are those of
    `align` on both models folded (`rj.fold_latents`), the latents rotated."""
    config = tf.DeepseekV3Config(**DEEPSEEK)
    for name, seed in (("a", 0), ("b", 1)):
        save_reference(tf.DeepseekV3ForCausalLM, config, tmp_path / name, seed=seed)
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "a"), str(tmp_path / "b"), "--latents", "rotation"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.startswith(("distance ", "after "))}
    a, b = rj.load_hf(tmp_path / "a"), rj.load_hf(tmp_path / "b")
    spec = rj.spec_for(b)
    want = rj.align(rj.fold_latents(spec, a.params), rj.fold_latents(spec, b.params), spec, latents="rotation").report["after"]
    assert {kind: float(value) for kind, value in zip(rows["distance"], rows["after"])} == pytest.approx(
        {kind: want[kind] for kind in rows["distance"]}, abs=1e-4), (rows, want)
