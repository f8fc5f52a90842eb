"""Function is sacred: every symmetry transform leaves every family's outputs unchanged.

Models are random (transformers-style init with a large std, and random norm gains and biases, so
that a mishandled bias or gain would show), run on padded inputs; float32, 1e-5 relative."""

import jax
import numpy as np
import pytest
import transformers as tf
from checkpoint_utils import plus_noise

import rotsym_jax as rj
from rotsym_jax.transforms import KINDS

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, initializer_range=0.2)
LM = dict(vocab_size=97, **SMALL)

FAMILIES = {
    "bert-cls": (lambda: tf.BertConfig(**LM, num_labels=3), dict(head="sequence_classification", pooler=True)),
    "roberta-cls": (lambda: tf.RobertaConfig(**LM, num_labels=3), dict(head="sequence_classification")),
    "modernbert-cls": (lambda: tf.ModernBertConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                                                   global_attn_every_n_layers=2, local_attention=4, norm_bias=True, attention_bias=True,
                                                   mlp_bias=True, initializer_range=0.2, num_labels=3, pad_token_id=0, bos_token_id=1,
                                                   eos_token_id=2, cls_token_id=1, sep_token_id=2), dict(head="sequence_classification")),
    "distilbert-cls": (lambda: tf.DistilBertConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, hidden_dim=48, initializer_range=0.2,
                                                   num_labels=3), dict(head="sequence_classification")),
    "vit-cls": (
        lambda: tf.ViTConfig(**SMALL, image_size=8, patch_size=2, num_channels=1, num_labels=5),
        dict(head="image_classification"),
    ),
    "gpt2-lm": (lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97, initializer_range=0.2), dict(head="lm")),
    "llama-mha": (lambda: tf.LlamaConfig(**LM, tie_word_embeddings=False), dict(head="lm")),
    "llama-gqa": (lambda: tf.LlamaConfig(**LM, num_key_value_heads=2, head_dim=16), dict(head="lm")),
    "llama-mqa": (lambda: tf.LlamaConfig(**LM, num_key_value_heads=1), dict(head="lm")),
    "qwen2-gqa-bias": (lambda: tf.Qwen2Config(**LM, num_key_value_heads=2), dict(head="lm")),
    "mistral-window": (lambda: tf.MistralConfig(**LM, num_key_value_heads=2, sliding_window=3), dict(head="lm")),
    "gpt-neox-partial": (lambda: tf.GPTNeoXConfig(**LM, rotary_pct=0.25, max_position_embeddings=16), dict(head="lm")),
    "phi3-partial": (lambda: tf.Phi3Config(**LM, num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1,
                                           eos_token_id=2), dict(head="lm")),
    "qwen3-qknorm": (lambda: tf.Qwen3Config(**LM, num_key_value_heads=2, head_dim=16, attention_bias=True), dict(head="lm")),
    # gains stored as w (1 + w), the embedding scaled by sqrt(d); untied, so the stream may rotate
    "gemma-untied": (lambda: tf.GemmaConfig(**LM, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False), dict(head="lm")),
    # sandwich norms and soft-capping: the stream takes signed permutations only (tests/test_residual.py)
    "gemma2-sandwich": (lambda: tf.Gemma2Config(**LM, num_key_value_heads=2, head_dim=16, sliding_window=3, attn_logit_softcapping=2.0,
                                                final_logit_softcapping=3.0), dict(head="lm")),
    # Gemma 3: sandwich norms, QK-norm (the QK group is sign flips), a RoPE base per layer type
    "gemma3-sandwich-qknorm": (lambda: tf.Gemma3TextConfig(**LM, num_key_value_heads=2, head_dim=16, sliding_window=3, sliding_window_pattern=2,
                                                           rope_local_base_freq=100.0), dict(head="lm")),
    # OLMo-2: post-sublayer norms only, QK-norm over all heads (its gains follow the heads and carry the QK scale)
    "olmo2-post-qknorm": (lambda: tf.Olmo2Config(**LM, num_key_value_heads=2, attention_bias=True, pad_token_id=0, eos_token_id=1),
                          dict(head="lm")),
    # OLMoE: pre-norm, full-width QK-norm and a mixture of experts
    "olmoe-moe-qknorm": (lambda: tf.OlmoeConfig(**LM, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attention_bias=True,
                                                pad_token_id=0, eos_token_id=1), dict(head="lm")),
    # "perm" moves the experts (and the router's outputs) and each expert's units
    "mixtral-moe": (lambda: tf.MixtralConfig(**LM, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2), dict(head="lm")),
}


def random_model(name, seed=0):
    make_config, kwargs = FAMILIES[name]
    ck = rj.init_checkpoint(make_config(), jax.random.key(seed), **kwargs)
    keys = iter(jax.random.split(jax.random.key(seed + 100), 1000))
    # Non-trivial 1-D leaves: norm gains around 1, biases around 0.
    params = jax.tree_util.tree_map(
        lambda x: plus_noise(x, next(keys), 0.3) if x.ndim == 1 else x, ck.params
    )
    return ck, params


def planted_pair(name, residual="permutation"):
    """(checkpoint, spec, A, B): A a random model of `name` (its norms folded for a residual
    rotation), B = A moved by a random element of every group and of the residual stream."""
    ck, params = random_model(name)
    spec = rj.spec_for(ck)
    a = rj.fold_norms(spec, params) if residual == "rotation" else params
    t = rj.random_transform(spec, a, jax.random.key(2), KINDS)
    t["residual"] = rj.random_residual(spec, a, jax.random.key(3), residual)
    return ck, spec, a, rj.apply_transform(spec, a, t)


def model_inputs(ck, seed=0):
    rng = np.random.default_rng(seed)
    if ck.family == "vit":
        return {"pixel_values": rng.normal(size=(2, 1, 8, 8)).astype(np.float32)}
    ids = rng.integers(3, 97, size=(3, 7))
    mask = np.ones_like(ids)
    mask[-1, 4:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask}


def outputs(ck, params, inputs):
    # float32 matmuls: outputs are compared at 1e-5, and GPUs default to TF32 (conftest.float32_models)
    with jax.default_matmul_precision("highest"):
        out = ck.apply(params, **inputs)
    return {k: np.asarray(v) for k, v in out.items()}


def assert_same_function(ck, params, moved, inputs, tol=1e-5):
    ref, new = outputs(ck, params, inputs), outputs(ck, moved, inputs)
    valid = inputs.get("attention_mask")
    for key in ref:
        a, b = ref[key], new[key]
        if valid is not None and a.shape[:2] == valid.shape:
            a, b = a[valid.astype(bool)], b[valid.astype(bool)]
        err = np.max(np.abs(a - b)) / np.max(np.abs(a))
        assert err <= tol, f"{key}: relative change {err:.2e} > {tol}"


def distance(p, q):
    """||p - q||, on the host (eager jnp ops compiled a program per op and leaf shape): float32
    differences, their squares summed in float64."""
    sq = (np.square((np.asarray(a, np.float32) - np.asarray(b, np.float32)).astype(np.float64)).sum()
          for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)))
    return float(sum(sq)) ** 0.5


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_transform_preserves_function(name):
    """Each kind alone, then all kinds together."""
    ck, params = random_model(name)
    spec = rj.spec_for(ck)
    inputs = model_inputs(ck)
    size = distance(params, jax.tree_util.tree_map(np.zeros_like, params))
    for i, kinds in enumerate([(k,) for k in KINDS] + [KINDS]):
        t = rj.random_transform(spec, params, jax.random.key(i), kinds)
        moved = rj.apply_transform(spec, params, t)
        if kinds == ("qk_scale",) and spec.heads["attn"].qk_norm == "head":  # a per-head QK-norm keeps no QK scale
            assert distance(params, moved) == 0
            continue
        assert distance(params, moved) > 0.01 * size, f"{kinds}: the transform did not move the parameters"
        assert_same_function(ck, params, moved, inputs)


@pytest.mark.parametrize("name", ["bert-cls", "llama-gqa"])
def test_inverse_and_composition(name):
    ck, params = random_model(name)
    spec = rj.spec_for(ck)
    t1 = rj.random_transform(spec, params, jax.random.key(1))
    t2 = rj.random_transform(spec, params, jax.random.key(2))
    once = rj.apply_transform(spec, params, t1)
    back = rj.apply_transform(spec, once, rj.invert_transform(t1))
    assert distance(params, back) < 1e-4
    twice = rj.apply_transform(spec, once, t2)
    composed = rj.apply_transform(spec, params, rj.compose_transforms(t1, t2))
    assert distance(twice, composed) < 1e-4
    assert_same_function(ck, params, twice, model_inputs(ck))


def test_gqa_transform_is_shared_by_the_group():
    """With GQA the k/v slice of a group and all its query heads get the same rotation."""
    ck, params = random_model("llama-gqa")  # H = 4, G = 2, dh = 16
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, params, jax.random.key(3), ("qk",))
    assert t["attn"].qk.shape == (2, 2, 16, 16)
    moved = rj.apply_transform(spec, params, t)
    q, q2 = (np.asarray(p["layers"][0]["attention"]["query"]["kernel"]).reshape(32, 2, 2, 16) for p in (params, moved))
    k, k2 = (np.asarray(p["layers"][0]["attention"]["key"]["kernel"]).reshape(32, 2, 16) for p in (params, moved))
    for g in range(2):
        rot = np.asarray(t["attn"].qk[0, g])
        np.testing.assert_allclose(k2[:, g], k[:, g] @ rot, atol=1e-5)
        for r in range(2):
            np.testing.assert_allclose(q2[:, g, r], q[:, g, r] @ rot, atol=1e-5)


def test_rope_rotation_respects_pairs():
    """RoPE models draw QK rotations from SO(2)^(dh/2) on the pairs (i, i + dh/2)."""
    ck, params = random_model("llama-mha")
    t = rj.random_transform(rj.spec_for(ck), params, jax.random.key(4), ("qk",))
    rot = np.asarray(t["attn"].qk[0, 0])
    half = rot.shape[0] // 2
    block = np.zeros_like(rot, dtype=bool)
    i = np.arange(half)
    for a, b in [(i, i), (i, i + half), (i + half, i), (i + half, i + half)]:
        block[a, b] = True
    assert np.all(rot[~block] == 0)
    np.testing.assert_allclose(rot[i, i], rot[i + half, i + half])
    np.testing.assert_allclose(rot[i, i + half], -rot[i + half, i])


def test_inputs_not_mutated_and_deterministic():
    ck, params = random_model("bert-cls")
    snapshot = jax.tree_util.tree_map(np.array, params)
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, params, jax.random.key(5))
    a = rj.apply_transform(spec, params, t)
    b = rj.apply_transform(spec, params, rj.random_transform(spec, params, jax.random.key(5)))
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, snapshot)
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
