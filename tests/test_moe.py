"""Mixtures of experts (MATH §5): the experts permuted with the router's outputs, each expert's units
on their own; B's experts matched to A's by the nested assignment (engine/experts.py), checked
against a brute force over every expert permutation, planted recovery with noise, the residual
stream rotated through the stacked experts, transformers running the moved model, streaming."""

import itertools

import jax
import numpy as np
import pytest
import transformers as tf
from checkpoint_utils import plus_noise
from parity_utils import reference_outputs, token_batch, torch
from scipy.optimize import linear_sum_assignment
from test_invariance import assert_same_function, model_inputs, outputs, planted_pair, random_model

import rotsym_jax as rj
from rotsym_jax import streaming
from rotsym_jax.engine import experts
from rotsym_jax.pytree import flatten, unflatten
from rotsym_jax.solvers import assignment
from rotsym_jax.transforms import KINDS

pytestmark = pytest.mark.usefixtures("float32_models")

NAME = "mixtral-moe"  # test_invariance.FAMILIES: 2 layers, 4 experts of 48 units, top 2


def _noisy(params, scale, seed):
    keys = iter(jax.random.split(jax.random.key(seed), 1000))
    return jax.tree.map(lambda x: plus_noise(x, next(keys), scale * np.std(np.asarray(x))), params)


def _layer(flat, i):
    moe = f"layers/{i}/moe"
    return {k: np.asarray(flat[f"{moe}/{k}/kernel"], np.float64) for k in ("router", "gate", "up", "down")}


def _brute_force(a, b):
    """max over every expert permutation s of sum_e (the inner optimum of (A's e, B's s[e]) by SciPy
    on independently built costs + the router columns' overlap)."""
    num = a["router"].shape[1]
    inner = np.empty((num, num))
    for ea, eb in itertools.product(range(num), repeat=2):
        cost = b["gate"][eb].T @ a["gate"][ea] + b["up"][eb].T @ a["up"][ea] + b["down"][eb] @ a["down"][ea].T
        rows, cols = linear_sum_assignment(cost, maximize=True)
        inner[ea, eb] = cost[rows, cols].sum() + a["router"][:, ea] @ b["router"][:, eb]
    return max(sum(inner[e, s[e]] for e in range(num)) for s in itertools.permutations(range(num)))


def _objective(a, b, perm, units):
    total = 0.0
    for e, (src, u) in enumerate(zip(perm, units)):
        total += sum(float(np.sum(a[k][e] * (b[k][src][:, u] if k != "down" else b[k][src][u, :]))) for k in ("gate", "up", "down"))
        total += float(a["router"][:, e] @ b["router"][:, src])
    return total


def test_expert_matching_equals_brute_force():
    """Unrelated models (nothing planted): the nested assignment reaches the optimum over all 4!
    expert permutations with each pair's exact inner assignment."""
    ck, params_a = random_model(NAME)
    _, params_b = random_model(NAME, seed=1)
    spec = rj.bind(rj.spec_for(ck), params_a)
    (group,) = spec.experts
    flat_a, flat_b = flatten(params_a), flatten(params_b)
    for i in range(len(group.layers)):
        la, lb = experts.layer_leaves(group, flat_a, i), experts.layer_leaves(group, flat_b, i)
        perm, units = experts.match_layer(la[0], la[1], lb[1], la[2], la[3], lb[3])
        a, b = _layer(flat_a, i), _layer(flat_b, i)
        best = _brute_force(a, b)
        assert _objective(a, b, perm, units) == pytest.approx(best, rel=1e-6)


def test_planted_experts_and_units_are_recovered_under_noise(monkeypatch):
    """B = A with its experts shuffled, each expert's units permuted, heads rotated, plus noise:
    every expert and every unit is found, with one exact inner assignment per expert (the bounds
    rule the other pairs out)."""
    ck, params_a = random_model(NAME)
    spec = rj.spec_for(ck)
    planted = rj.random_transform(spec, params_a, jax.random.key(4), ("heads", "qk", "vo", "perm"))  # norm-preserving
    moved = rj.apply_transform(spec, params_a, planted)
    params_b = _noisy(moved, 0.01, 5)
    noise = rj.distance_report(spec, moved, params_b)["total"]["total"]
    solved = []
    original = assignment.linear_assignments
    monkeypatch.setattr(assignment, "linear_assignments", lambda scores, **kw: solved.append(len(scores)) or original(scores, **kw))
    result = rj.align(params_a, params_b, spec, heads="permute")
    composed = rj.compose_transforms(planted, result.transforms)["moe"]
    np.testing.assert_array_equal(np.asarray(composed.perm), np.tile(np.arange(4), (2, 1)))
    np.testing.assert_array_equal(np.asarray(composed.units), np.tile(np.arange(48), (2, 4, 1)))
    assert result.report["after"]["total"] <= 1.01 * noise < 0.05 * result.report["before"]["total"]
    assert sum(solved) - 2 == 2 * 4  # the FFN group's call per layer aside: one inner assignment per expert
    assert_same_function(ck, params_b, result.params, model_inputs(ck))


def test_residual_rotation_folds_into_the_stacked_experts():
    """The MLP norm's gain folds into the router's and the experts' (E, d, f) kernels along their
    stream axis; a rotated stream and every group are then recovered."""
    ck, spec, a, b = planted_pair(NAME, "rotation")
    _, params = random_model(NAME)
    inputs = model_inputs(ck)

    def same_logits(p, q):  # the hidden states themselves are rotated, or scaled by the final gain
        want, got = outputs(ck, p, inputs)["logits"], outputs(ck, q, inputs)["logits"]
        assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))

    same_logits(params, rj.fold_norms(spec, params))
    result = rj.align(a, b, spec, heads="permute", residual="rotation")
    assert result.report["after"]["total"] <= 1e-5 * result.report["before"]["total"]
    same_logits(b, result.params)


def test_transformers_runs_the_aligned_model(tmp_path):
    """B (a planted transform of A) aligned to A and saved: transformers' Mixtral computes B's
    outputs from it, and reads every expert tensor back."""
    ck, params_a = random_model(NAME)
    spec = rj.spec_for(ck)
    params_b = rj.apply_transform(spec, params_a, rj.random_transform(spec, params_a, jax.random.key(7), KINDS))
    aligned = rj.align(params_a, params_b, spec).params
    rj.save_hf(ck, params_b, tmp_path / "b")
    rj.save_hf(ck, aligned, tmp_path / "aligned")
    ids, mask = token_batch(ck.config.vocab_size, pad_id=0)
    want, got = (reference_outputs(tf.MixtralForCausalLM.from_pretrained(tmp_path / p, attn_implementation="eager").eval(),
                                   input_ids=ids, attention_mask=mask)["logits"] for p in ("b", "aligned"))
    valid = mask.astype(bool)
    assert np.max(np.abs(got[valid] - want[valid])) <= 1e-4 * np.max(np.abs(want[valid]))
    assert torch is not None


def test_streamed_alignment_equals_in_memory(tmp_path):
    ck, params_a = random_model(NAME)
    spec = rj.spec_for(ck)
    params_b = _noisy(rj.apply_transform(spec, params_a, rj.random_transform(spec, params_a, jax.random.key(8), KINDS)), 0.01, 9)
    rj.save_hf(ck, params_a, tmp_path / "a")
    rj.save_hf(ck, params_b, tmp_path / "b")
    a, b = rj.load_hf(tmp_path / "a"), rj.load_hf(tmp_path / "b")
    in_memory = rj.align(a.params, b.params, rj.spec_for(b))
    streaming.align_to_disk(tmp_path / "a", tmp_path / "b", tmp_path / "streamed", chunk_layers=1)
    streamed = flatten(rj.load_hf(tmp_path / "streamed").params)
    for path, leaf in flatten(in_memory.params).items():
        np.testing.assert_array_equal(np.asarray(streamed[path]), np.asarray(leaf), err_msg=path)


def test_a_streamed_rotation_of_the_stream_folds_each_expert_as_it_reads(tmp_path):
    """Streamed, each expert's tensor is folded as it is read; it went back to the checkpoint's
    layout as the stack's slot 0 of a slice (a (f,) row: "axis 1 is out of bounds" on every MoE
    folder, the new-user trial). The descent equals align's on the folded models, and
    transformers computes B's outputs from what it wrote."""
    ck, spec, params_a, params_b = planted_pair(NAME, "rotation")
    for name, params in (("a", params_a), ("b", params_b)):
        rj.save_hf(ck, params, tmp_path / name)
    got = streaming.align_to_disk(tmp_path / "a", tmp_path / "b", tmp_path / "streamed", chunk_layers=1, residual="rotation",
                                  residual_sweeps=2)
    want = rj.align(rj.fold_norms(spec, params_a), rj.fold_norms(spec, params_b), spec, residual="rotation", residual_sweeps=2)
    np.testing.assert_allclose(got.report["residual"]["distance_per_sweep"], want.report["residual"]["distance_per_sweep"], rtol=1e-5)
    ids, mask = token_batch(ck.config.vocab_size, pad_id=0)
    want, got = (reference_outputs(tf.MixtralForCausalLM.from_pretrained(tmp_path / p, attn_implementation="eager").eval(),
                                   input_ids=ids, attention_mask=mask)["logits"] for p in ("b", "streamed"))
    valid = mask.astype(bool)
    assert np.max(np.abs(got[valid] - want[valid])) <= 1e-4 * np.max(np.abs(want[valid]))


def test_merging_after_matching_respects_experts():
    """The average of A and a shuffled copy of A is A once the experts are matched (each expert
    averaged with its own), and far from it without."""
    ck, params_a = random_model(NAME)
    spec = rj.spec_for(ck)
    params_b = _noisy(rj.apply_transform(spec, params_a, rj.random_transform(spec, params_a, jax.random.key(10), ("perm",))), 0.01, 11)
    size = sum(float(np.sum(np.square(x))) for x in jax.tree.leaves(params_a)) ** 0.5

    def dist(p):
        return sum(float(np.sum(np.square(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(p))) ** 0.5

    aligned = rj.merge.merge("average", [params_a, rj.align(params_a, params_b, spec).params])
    plain = rj.merge.merge("average", [params_a, params_b])
    assert dist(aligned) < 0.01 * size < 0.2 * size < dist(plain)


def test_what_cannot_match_experts_says_so():
    ck, params_a = random_model(NAME)
    spec = rj.spec_for(ck)
    with pytest.raises(ValueError, match="experts block 'moe'.*method='learned' does not match them yet"):
        rj.align(params_a, params_a, spec, method="learned", data=[model_inputs(ck)], checkpoint=ck, key=jax.random.key(0))
    with pytest.raises(ValueError, match="outside jax.jit"):
        jax.jit(lambda a, b: rj.align(a, b, spec).params)(params_a, params_a)
    with pytest.raises(ValueError, match="OT fusion does not transport experts"):
        rj.merge.merge("ot_fusion", [params_a, params_a], spec=spec)
    assert "experts 'moe': 2 layers, 4 experts of 48 units" in rj.bind(spec, params_a).experts[0].describe()


def test_per_tensor_merges_take_each_expert_as_its_tensor():
    """TIES trims, and SLERP measures its angle, per expert (each a tensor of the checkpoint):
    merging the stacked leaf equals merging each expert alone. With experts of very different
    scales, trimming the whole stack at once would keep only the largest expert's entries."""
    ck, base = random_model(NAME)
    path = "layers/0/moe/up/kernel"
    scales = np.array([1.0, 10.0, 100.0, 1000.0], np.float32)[:, None, None]
    models = []
    for seed in (1, 2):
        flat = dict(flatten(random_model(NAME, seed=seed)[1]))
        flat[path] = np.asarray(flat[path]) * scales
        models.append(unflatten(flat))

    def leaf(p):
        return np.asarray(flatten(p)[path])

    def alone(method, models, **options):  # each expert's tensor merged as a model of its own
        return np.stack([np.asarray(rj.merge.merge(method, [{"w": leaf(m)[e]} for m in models], **options)["w"]) for e in range(4)])

    ties = leaf(rj.merge.merge("ties", models, base=base, density=0.3))
    want = np.stack([np.asarray(rj.merge.merge("ties", [{"w": leaf(m)[e]} for m in models], base={"w": leaf(base)[e]}, density=0.3)["w"])
                     for e in range(4)])
    np.testing.assert_allclose(ties, want, rtol=1e-6)
    assert np.mean(ties[0] != leaf(base)[0]) > 0.2  # the smallest expert kept its own largest entries
    slerp = leaf(rj.merge.merge("slerp", [base, models[0]], t=0.3))
    np.testing.assert_allclose(slerp, alone("slerp", [base, models[0]], t=0.3), rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # 17 s: one layout (dense layers among sparse ones); the other MoE tests run by default
def test_qwen3_moe_with_dense_layers_among_the_sparse_ones(tmp_path):
    """Qwen3-MoE's mlp_only_layers and decoder_sparse_step make some layers a dense MLP: those
    layers join a permutation group, the others the experts group; parity with transformers, the
    saved folder reloaded byte for byte, a planted B recovered in memory and streamed alike."""
    from parity_utils import assert_same_state_dict, save_reference

    config = tf.Qwen3MoeConfig(vocab_size=80, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                               mlp_only_layers=[0], decoder_sparse_step=2)  # layers 1 and 3 sparse, 0 and 2 dense
    model = save_reference(tf.Qwen3MoeForCausalLM, config, tmp_path / "a", seed=0)
    ck = rj.load_hf(tmp_path / "a")
    bound = rj.bind(rj.spec_for(ck), ck.params)
    assert [(g.kind, g.layers) for g in bound.groups] == [("attention", (0, 1, 2, 3)), ("scaled_units", (0, 2)), ("experts", (1, 3))]
    ids, mask = token_batch(80, pad_id=0)
    want = reference_outputs(model, input_ids=ids, attention_mask=mask)["logits"]
    with jax.default_matmul_precision("highest"):
        got = np.asarray(ck.apply(ck.params, input_ids=ids, attention_mask=mask)["logits"])
    valid = mask.astype(bool)
    assert np.max(np.abs(got[valid] - want[valid])) <= 1e-4 * np.max(np.abs(want[valid]))
    rj.save_hf(ck, ck.params, tmp_path / "saved")
    assert_same_state_dict(tf.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "saved"), model)
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(3), KINDS)
    t["residual"] = rj.random_residual(spec, ck.params, jax.random.key(4), "permutation")
    moved = rj.apply_transform(spec, ck.params, t)
    with jax.default_matmul_precision("highest"):
        logits = np.asarray(ck.apply(moved, input_ids=ids, attention_mask=mask)["logits"])
    assert np.max(np.abs(logits[valid] - got[valid])) <= 1e-5 * np.max(np.abs(got[valid]))  # the stream moved, the logits kept
    rj.save_hf(ck, moved, tmp_path / "b")
    in_memory = rj.align(ck.params, moved, spec, heads="permute", residual="permutation")
    assert in_memory.report["after"]["total"] <= 1e-5 * in_memory.report["before"]["total"]
    in_memory = rj.align(ck.params, moved, spec, heads="permute")  # streaming leaves the stream alone
    streaming.align_to_disk(tmp_path / "a", tmp_path / "b", tmp_path / "streamed", heads="permute", chunk_layers=1)
    streamed = flatten(rj.load_hf(tmp_path / "streamed").params)
    for path, leaf in flatten(in_memory.params).items():
        np.testing.assert_array_equal(np.asarray(streamed[path]), np.asarray(leaf), err_msg=path)


def test_olmoes_clamped_qkv_is_refused_before_any_weight_is_read(tmp_path):
    """OLMoE's clip_qkv clamps q, k and v elementwise: permutations and sign flips commute with a
    clamp, V's rotations do not, so such a checkpoint is refused by name on load."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "olmoe", "clip_qkv": 8.0}))
    with pytest.raises(rj.CheckpointError, match="clip_qkv=8.0 .*no rotation of V commutes with"):
        rj.load_hf(tmp_path)


def test_planted_experts_are_recovered_from_activations():
    """Activation matching (MATH §10) on a mixture of experts: the router's logits and every
    expert's hidden units on every token are the sites; a planted B (experts and their units
    shuffled, every other group and the stream moved) comes back exactly."""
    from test_activations import data_for

    ck, spec, a, b = planted_pair(NAME, "permutation")
    result = rj.align(a, b, spec, method="activations", data=data_for(ck), checkpoint=ck, heads="permute", residual="permutation")
    assert result.report["after"]["moe"] == 0.0
    assert result.report["after"]["total"] <= 1e-6 * result.report["before"]["total"]


SMALL_MOE = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                 max_position_embeddings=20)
STACKED = {  # transformers 5 holds these mixtures' experts stacked; a tool that saves its state dict writes them so
    "mixtral": (tf.MixtralForCausalLM, lambda: tf.MixtralConfig(**SMALL_MOE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (tf.Qwen3MoeForCausalLM, lambda: tf.Qwen3MoeConfig(**SMALL_MOE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                                                       head_dim=16)),
    "olmoe": (tf.OlmoeForCausalLM, lambda: tf.OlmoeConfig(**SMALL_MOE, num_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1)),
}


@pytest.mark.parametrize("name", ["mixtral", *(pytest.param(n, marks=pytest.mark.slow) for n in STACKED if n != "mixtral")])
def test_experts_stored_stacked_as_transformers_5_holds_them_are_read_and_written_so(name, tmp_path):
    """A folder holding `mlp.experts.gate_up_proj` (E, 2f, d) and `down_proj` (E, d, f), as
    mergekit writes a mixture with transformers 5 (refused before: "tensor ... block_sparse_moe.gate
    is missing"): read into the leaves the per-expert folder of the same model gives, run as
    transformers runs it, aligned in memory and streamed alike, and written back stacked."""
    from parity_utils import save_reference
    from safetensors.torch import save_file

    cls, make_config = STACKED[name]
    model = save_reference(cls, make_config(), tmp_path / "per_expert")
    (tmp_path / "stacked").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "stacked" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "stacked" / "config.json").write_bytes((tmp_path / "per_expert" / "config.json").read_bytes())
    stacked, per_expert = rj.load_hf(tmp_path / "stacked"), rj.load_hf(tmp_path / "per_expert")
    assert stacked.layout.stacked_experts and not per_expert.layout.stacked_experts
    for path, leaf in flatten(per_expert.params).items():
        np.testing.assert_array_equal(np.asarray(flatten(stacked.params)[path]), np.asarray(leaf), err_msg=path)
    ids, mask = token_batch(stacked.config.vocab_size, pad_id=0)
    want = reference_outputs(model, input_ids=ids, attention_mask=mask)["logits"]
    valid = mask.astype(bool)
    got = np.asarray(stacked.apply(stacked.params, input_ids=ids, attention_mask=mask)["logits"])
    assert np.max(np.abs(got[valid] - want[valid])) <= 1e-4 * np.max(np.abs(want[valid]))
    spec = rj.spec_for(stacked)
    moved = rj.apply_transform(spec, stacked.params, rj.random_transform(spec, stacked.params, jax.random.key(3), KINDS))
    rj.save_hf(stacked, moved, tmp_path / "moved")
    names = set(safetensors_names(tmp_path / "moved"))
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names) and not any(".experts.0." in n for n in names)
    moved_logits = reference_outputs(cls.from_pretrained(tmp_path / "moved", attn_implementation="eager").eval(),
                                     input_ids=ids, attention_mask=mask)["logits"]
    assert np.max(np.abs(moved_logits[valid] - want[valid])) <= 1e-4 * np.max(np.abs(want[valid]))  # transformers reads it back
    in_memory = rj.align(per_expert.params, rj.load_hf(tmp_path / "moved").params, spec)  # either storage, in memory
    with pytest.raises(streaming.StreamingError, match=r"stores its experts stacked .*, A \(the anchor\) one tensor per expert: a streamed run"):
        streaming.align_to_disk(tmp_path / "per_expert", tmp_path / "moved", tmp_path / "refused", chunk_layers=1)
    streaming.align_to_disk(tmp_path / "stacked", tmp_path / "moved", tmp_path / "streamed", chunk_layers=1)
    streamed = flatten(rj.load_hf(tmp_path / "streamed").params)
    for path, leaf in flatten(in_memory.params).items():
        np.testing.assert_array_equal(np.asarray(streamed[path]), np.asarray(leaf), err_msg=path)


def safetensors_names(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        return list(f.keys())
