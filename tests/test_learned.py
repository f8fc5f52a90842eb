"""Learned transforms (MATH §10, `align(..., method="learned")`): every element stays in its group
(the checked `apply_transform` accepts it, and B computes its function to float32 precision in
every family), training lowers the merged model's loss, early stopping keeps the best held-out
point, the straight-through estimator projects onto B's orbit, runs are deterministic for a key,
and what cannot be learned is refused with the reason."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from parity_utils import save_reference
from test_invariance import outputs, random_model

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.engine import learned
from rotsym_jax.engine.activations import DataError
from rotsym_jax.solvers import stretch

pytestmark = pytest.mark.usefixtures("float32_models")


def labelled(ck, batches=4, seed=0):
    rng = np.random.default_rng(seed)
    if ck.family == "vit":
        return [{"pixel_values": rng.normal(size=(8, 1, 8, 8)).astype(np.float32), "labels": rng.integers(0, 5, 8)} for _ in range(batches)]
    out = []
    for _ in range(batches):
        ids = rng.integers(3, 97, size=(4, 10))
        labels = np.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        out.append({"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels})
    return out


def pair(name):
    """A and an unrelated B (another init) of one family, norms folded (for a residual rotation)."""
    ck, a = random_model(name, seed=0)
    _, b = random_model(name, seed=1)
    spec = rj.spec_for(ck)
    return ck, spec, rj.fold_norms(spec, a), rj.fold_norms(spec, b)


@pytest.mark.parametrize("name", ["vit-cls", pytest.param("llama-gqa", marks=pytest.mark.slow), pytest.param("gpt2-lm", marks=pytest.mark.slow)])
def test_learned_elements_are_symmetries_and_lower_the_merged_loss(name):
    ck, spec, a, b = pair(name)
    data = labelled(ck)
    residual = "rotation" if name != "gpt2-lm" else "permutation"  # GPT-2's tied LM head: no residual rotation
    result = rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, heads="permute", residual=residual, steps=12,
                      learning_rate=3e-3, eval_every=3, holdout=0.25, key=jax.random.key(0), fallback=False)
    # (fallback=False: early stopping itself is tested, not the choice between the trained point and its start)
    # Every element is in its group: the checked apply accepts them and gives the same params.
    again = rj.apply_transform(spec, b, result.transforms)
    for path, x in rj.pytree.flatten(again).items():
        np.testing.assert_allclose(np.asarray(rj.pytree.flatten(result.params)[path]), np.asarray(x), atol=1e-5, err_msg=path)
    inputs, _ = ck.split_batch(data[0])
    want, got = (outputs(ck, p, inputs)["logits"] for p in (b, result.params))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    report = result.report["learned"]
    assert report["objective"] == "task" and len(report["loss"]) == 12 and report["train_batches"] == 3
    held = [h["loss"] for h in report["held_out"]]
    assert report["best_step"] == report["held_out"][int(np.argmin(held))]["step"]
    # Early stopping: the result is the best held-out point, measured here independently.
    mid = jax.tree.map(lambda x, y: (x + y) / 2, a, result.params)
    np.testing.assert_allclose(float(rj.recipe.loss_fn(ck, data[-1:])(mid)), min(held), rtol=1e-4)


@pytest.mark.parametrize("objective", ["task", "distill"])
def test_training_lowers_the_merged_models_loss(objective):
    """Without a held-out split the last step is kept (it is below the start): the merged model's
    loss on the training batches falls below the closed form's (activation matching, as it is:
    fallback=False) it started from."""
    ck, spec, a, b = pair("vit-cls")
    data = labelled(ck, batches=2)
    options = dict(heads="permute", residual="rotation", fallback=False)
    start = rj.align(a, b, spec, method="activations", data=data, checkpoint=ck, **options)
    trained = rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, steps=20, learning_rate=3e-3, holdout=0, objective=objective,
                       **options)
    assert trained.report["learned"]["best_step"] == 20
    loss = rj.recipe.loss_fn(ck, data)
    mid = lambda moved: float(loss(jax.tree.map(lambda x, y: (x + y) / 2, a, moved)))
    assert mid(trained.params) < 0.9 * mid(start.params)


def test_learning_is_deterministic_for_a_key_and_alpha_draws_from_it():
    ck, spec, a, b = pair("vit-cls")
    data = labelled(ck)
    run = lambda key, **kw: rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, steps=4, holdout=0, key=key, **kw)
    one, two = run(jax.random.key(0), alpha="uniform"), run(jax.random.key(0), alpha="uniform")
    assert one.report["learned"]["loss"] == two.report["learned"]["loss"]
    for x, y in zip(jax.tree_util.tree_leaves(one.transforms), jax.tree_util.tree_leaves(two.transforms)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert run(jax.random.key(1), alpha="uniform").report["learned"]["loss"] != one.report["learned"]["loss"]
    assert run(None).report["learned"]["alpha"] == "half"  # alpha=1/2 draws nothing: no key needed


def test_a_second_call_with_other_steps_rates_and_splits_compiles_nothing():
    """The learned programs are keyed by the model graph and the options that change them
    (`learned.Problem.of`): another step budget, learning rate, held-out split or start runs the
    programs the first call compiled, and the report counts none compiled. The rate is an
    argument of the step: one update at another rate changes the loss by another amount."""
    ck, spec, a, b = pair("vit-cls")
    data = labelled(ck)
    run = lambda **kw: rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, key=jax.random.key(0), fallback=False, **kw)
    run(steps=2, learning_rate=1e-3, holdout=0.25)  # compiles what no test before it in this worker did
    programs = [learned._step, learned._evaluate, learned.scored_loss, learned._half_sums, learned._softmax]
    sizes = [f._cache_size() for f in programs]
    second = run(steps=3, learning_rate=3e-2, holdout=0.5, eval_every=1, init="activations")
    assert [f._cache_size() for f in programs] == sizes
    assert second.report["timings"]["compiled"] == 0, second.report["timings"]
    assert second.report["learned"]["steps"] == 3 and len(second.report["learned"]["held_out"]) == 4
    # one batch: the first loss is before any update, the second after one at the call's rate
    small, large = (rj.align(a, b, spec, method="learned", data=data[:1], checkpoint=ck, steps=2, learning_rate=lr, holdout=0,
                             init="weights", fallback=False).report["learned"]["loss"] for lr in (1e-5, 1e-1))
    assert small[0] == large[0] and abs(small[1] - small[0]) < 0.01 * abs(large[1] - large[0]), (small, large)


def test_only_what_the_options_solve_is_learned():
    """layers=[0]: layer 1 keeps identity elements; attention="none": no rotation learned;
    ffn="none": no permutation."""
    ck, spec, a, b = pair("vit-cls")
    data = labelled(ck)
    run = lambda **kw: rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, steps=3, learning_rate=1e-2, holdout=0, **kw).transforms
    eye = np.broadcast_to(np.eye(8), (4, 8, 8))
    layer0 = run(layers=[0])
    np.testing.assert_allclose(np.asarray(layer0["attn"].qk)[1], eye, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(layer0["ffn"].perm)[1], np.arange(48))
    assert np.abs(np.asarray(layer0["attn"].qk)[0] - eye).max() > 1e-3
    still = run(attention="none", ffn="none")
    np.testing.assert_allclose(np.asarray(still["attn"].qk), np.broadcast_to(np.eye(8), (2, 4, 8, 8)), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(still["ffn"].perm), np.broadcast_to(np.arange(48), (2, 48)))


def test_the_straight_through_projection_finds_b_in_the_free_copy():
    """The free copy at B moved by P projects to P; the loss's gradient reaches the free copy."""
    ck, spec, a, b = pair("gpt2-lm")
    bound = rj.bind(spec, b)
    group = bound.perms[0]
    planted = rj.random_transform(spec, b, jax.random.key(5), ("perm",))
    moved = rj.pytree.flatten(rj.apply_transform(spec, b, planted))
    free = {p: jnp.asarray(moved[p], jnp.float32) for m in group.members for p in m.paths}
    problem = learned.Problem.of(bound, bound, ck, rj.AlignOptions(method="learned"), "task")
    perms = learned.projections(problem, {group.name: {"free": free}}, rj.pytree.flatten(b))
    np.testing.assert_array_equal(np.asarray(perms[group.name]), np.asarray(planted[group.name].perm))
    t0 = rj.identity_transform(bound)
    params = learned.initial_parameters(problem, t0, rj.pytree.flatten(b))
    moved = lambda p: learned.moved_b(problem, t0, p, perms, b)
    grads = jax.grad(lambda p: sum(jnp.sum(x ** 2) for x in jax.tree_util.tree_leaves(moved(p))))(params)
    assert all(float(jnp.abs(g).max()) > 0 for g in grads[group.name]["free"].values())


def test_cayley_is_a_rotation_and_the_identity_at_zero():
    k = jax.random.normal(jax.random.key(0), (3, 5, 5))
    r = np.asarray(stretch.cayley(k), np.float64)
    np.testing.assert_allclose(np.swapaxes(r, -1, -2) @ r, np.broadcast_to(np.eye(5), r.shape), atol=1e-5)
    np.testing.assert_allclose(np.linalg.det(r), 1.0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(stretch.cayley(jnp.zeros((4, 4)))), np.eye(4))


def test_what_cannot_be_learned_is_refused():
    ck, spec, a, b = pair("vit-cls")
    data = labelled(ck)
    with pytest.raises(DataError, match="objective='task' needs labels"):
        rj.align(a, b, spec, method="learned", data=[{"pixel_values": d["pixel_values"]} for d in data], checkpoint=ck, objective="task")
    with pytest.raises(DataError, match="needs at least 2 batches"):
        rj.align(a, b, spec, method="learned", data=data[:1], checkpoint=ck)
    with pytest.raises(ValueError, match="give key="):
        rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, alpha="uniform")
    with pytest.raises(ValueError, match="learning_rate=-1"):
        rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, learning_rate=-1)
    base = rj.init_checkpoint(ck.model_config, jax.random.key(0))  # no head: no loss to learn on
    with pytest.raises(rj.CheckpointError, match="without a task head: method='learned'"):
        rj.align(base.params, base.params, rj.spec_for(base), method="learned", data=data, checkpoint=base)


# ---- the command line ------------------------------------------------------------------------------

VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=8, patch_size=2, num_channels=1,
           num_labels=3)


@pytest.fixture(scope="module")
def vit_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("learned")
    models = [save_reference(tf.ViTForImageClassification, tf.ViTConfig(**VIT), root / str(s), seed=s) for s in (0, 1)]
    rng = np.random.default_rng(0)
    for name in ("train", "test"):
        np.savez(root / f"{name}.npz", pixel_values=rng.normal(size=(48, 1, 8, 8)).astype(np.float32), labels=rng.integers(0, 3, 48))
    return root, models


TEXT = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, max_position_embeddings=20)
TEXT_CASES = {  # (config, the residual group by default): post-LN BERT permutes the stream; GPT-2 (its tied head untied) and Llama rotate it
    "BertForSequenceClassification": (lambda: tf.BertConfig(**TEXT, num_labels=3), "permutation"),
    "GPT2LMHeadModel": (lambda: tf.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=20), "rotation"),
    "LlamaForCausalLM": (lambda: tf.LlamaConfig(**TEXT, num_key_value_heads=2), "rotation"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TEXT_CASES))
def test_rotsym_align_learned_keeps_b_in_transformers_for_text_families(name, tmp_path):
    config, residual = TEXT_CASES[name]
    cls = getattr(tf, name)
    b_model = [save_reference(cls, config(), tmp_path / str(s), seed=s) for s in (0, 1)][1]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 60, size=(32, 12))
    np.savez(tmp_path / "data.npz", input_ids=ids, attention_mask=np.ones_like(ids), **({"labels": rng.integers(0, 3, 32)} if "Bert" in name else {}))
    out = tmp_path / "out"
    assert cli.main(["align", str(tmp_path / "0"), str(tmp_path / "1"), str(out), "--quiet", "--method", "learned", "--data",
                     str(tmp_path / "data.npz"), "--steps", "4", "--heads", "permute"]) == 0
    assert json.loads((out / "rotsym_report.json").read_text())["options"]["residual"] == residual
    moved = cls.from_pretrained(out, attn_implementation="eager").eval()
    x = {"input_ids": torch.as_tensor(ids[:4]), "attention_mask": torch.ones(4, 12, dtype=torch.long)}
    with torch.no_grad():
        np.testing.assert_allclose(moved(**x).logits.numpy(), b_model(**x).logits.numpy(), atol=1e-4)


def test_rotsym_align_learned_writes_b_with_its_function(vit_pair, tmp_path):
    root, (_, b_model) = vit_pair
    out = tmp_path / "out"
    assert cli.main(["align", str(root / "0"), str(root / "1"), str(out), "--quiet", "--method", "learned", "--data", str(root / "train.npz"),
                     "--steps", "6", "--seed", "3"]) == 0
    report = json.loads((out / "rotsym_report.json").read_text())
    assert report["options"]["method"] == "learned" and report["options"]["steps"] == 6 and len(report["result"]["learned"]["loss"]) == 6
    # the defaults: the stream rotated (the gains folded first), the maps invertible
    assert report["options"]["residual"] == "rotation" and report["options"]["maps"] == "invertible", report["options"]
    moved = tf.ViTForImageClassification.from_pretrained(out).eval()
    x = torch.as_tensor(np.random.default_rng(1).normal(size=(4, 1, 8, 8)).astype(np.float32))
    with torch.no_grad():
        np.testing.assert_allclose(moved(pixel_values=x).logits.numpy(), b_model(pixel_values=x).logits.numpy(), atol=1e-4)


@pytest.mark.slow  # 13 s; test_commands runs the barrier command by default
def test_rotsym_barrier_draws_a_curve_per_method_on_data_the_alignment_did_not_see(vit_pair, tmp_path, capsys):
    root, _ = vit_pair
    a, b, train, test = str(root / "0"), str(root / "1"), str(root / "train.npz"), str(root / "test.npz")
    out = tmp_path / "curves"
    assert cli.main(["barrier", a, b, "--data", test, "--out", str(out), "--method", "weights,activations,learned", "--align-data", train,
                     "--steps", "4", "--residual", "rotation"]) == 0
    report = json.loads((out / "barrier.json").read_text())
    assert set(report["result"]) == {"plain", "aligned", "aligned (activations)", "aligned (learned)"}
    assert report["options"]["align_data"] == train
    ends = {name: (r["curve"]["loss"][0], r["curve"]["loss"][-1]) for name, r in report["result"].items()}
    for start, end in ends.values():  # every path joins A's function to B's
        np.testing.assert_allclose((start, end), ends["plain"], rtol=1e-4)
    # a method whose result was set aside for another (the identity, weight matching) says so and records it:
    # the activations curve came out as weight matching's, under its own name, with no word (new-user trial)
    err = capsys.readouterr().err
    for name, r in report["result"].items():
        if name in ("plain", "aligned"):
            continue
        assert (r["curve"]["loss"] == report["result"]["aligned"]["curve"]["loss"]) <= ("chosen" in r), name
        if "chosen" in r:
            assert r["chosen"]["note"] in err, (name, err)
    for argv, message in ((["--method", "activations"], "give --align-data FILE"),
                          (["--method", "learned", "--align-data", test], "--align-data is the --data the loss is measured on"),
                          (["--align-data", train], "--method weights reads only weights")):
        with pytest.raises(SystemExit):
            cli.main(["barrier", a, b, "--data", test, "--out", str(tmp_path / "x"), *argv])
        assert message in capsys.readouterr().err


def test_the_optimizer_is_named_or_given_as_an_optax_transformation():
    """optimizer="sgd" with a rate and optax.sgd of that rate train alike (two ways to one
    program); a transformation that never moves (set_to_zero) keeps the start
    at every step; a pipeline refuses an optax object by name (its recipe could not hold it)."""
    import optax

    ck, spec, a, b = pair("vit-cls")
    data = labelled(ck)
    run = lambda **kw: rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, steps=3, eval_every=1, holdout=0.25,
                                key=jax.random.key(0), fallback=False, patience=0, **kw)
    named, given = run(optimizer="sgd", learning_rate=0.3), run(optimizer=optax.sgd(0.3))
    np.testing.assert_allclose(named.report["learned"]["loss"], given.report["learned"]["loss"], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(named.transforms["attn"].qk), np.asarray(given.transforms["attn"].qk), atol=1e-6)
    assert named.report["learned"]["optimizer"] == "sgd" and given.report["learned"]["learning_rate"] is None
    frozen = run(optimizer=optax.set_to_zero())
    held = [h["loss"] for h in frozen.report["learned"]["held_out"]]  # the same held-out batches at every step
    np.testing.assert_allclose(held, [held[0]] * 4, rtol=1e-6)
    assert frozen.report["learned"]["best_step"] == 0 and len(set(h["loss"] for h in named.report["learned"]["held_out"])) > 1
    assert frozen.report["learned"]["optimizer"].startswith("custom")
    with pytest.raises(rj.pipeline.PipelineError, match=r"optimizer=.*cannot hold an optax object; name one of \('adam'"):
        rj.pipeline.align_options_of({"method": "learned", "optimizer": optax.sgd(0.3)})
    with pytest.raises(rj.InputError, match=r"optimizer='adam2'; expected one of \('adam'"):
        rj.AlignOptions(optimizer="adam2")


def test_patience_stops_where_the_held_out_loss_has_not_fallen_for_that_many_steps():
    """The run with patience is the run without it, cut where the rule replayed on the full run's
    held-out curve cuts it: the same best step and elements. By default learning takes invertible maps."""
    ck, spec, a, b = pair("vit-cls")
    data = labelled(ck)
    run = lambda **kw: rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, steps=24, eval_every=1, learning_rate=3e-1,
                                holdout=0.25, key=jax.random.key(0), fallback=False, **kw)
    full = run(patience=0)
    assert full.transforms["attn"].qk_inv is not None and "condition_numbers" in full.report  # maps="auto": invertible
    curve = full.report["learned"]["held_out"]
    patience, best, best_step, stop = 3, curve[0]["loss"], 0, None
    for point in curve[1:]:
        if point["loss"] < best:
            best, best_step = point["loss"], point["step"]
        elif point["step"] - best_step >= patience:
            stop = point["step"]
            break
    assert stop is not None and stop < 24, curve  # the rate makes the curve rise: the rule has something to cut
    cut = run(patience=patience)
    learning = cut.report["learned"]
    assert learning["stopped_at"] == stop and len(learning["loss"]) == stop and learning["best_step"] == best_step
    assert full.report["learned"]["stopped_at"] is None and len(full.report["learned"]["loss"]) == 24
    if best_step == full.report["learned"]["best_step"]:
        np.testing.assert_allclose(np.asarray(cut.transforms["attn"].qk), np.asarray(full.transforms["attn"].qk), atol=1e-6)


def test_the_distillation_loss_of_a_model_against_itself_is_zero_not_below():
    """KL(p || p) = 0: computed as sum p (log p - log q) in float32, a position's sum rounds to
    either side of zero (the command line printed -1.2e-8); a divergence is never negative."""
    class Logits:  # a model whose logits are given
        def __init__(self, logits):
            self.logits = logits

        def apply(self, params, **inputs):
            return {"logits": self.logits}

    def raw(logits, teacher):  # the divergence as summed, at the shape the loss sums it
        return float(jnp.sum(teacher * (jnp.log(jnp.maximum(teacher, 1e-30)) - jax.nn.log_softmax(logits, axis=-1)), axis=-1)[0, 0])

    rows = [jax.random.normal(jax.random.key(i), (1, 1, 97)) * 4 for i in range(64)]
    logits = min(rows, key=lambda x: raw(x, jax.nn.softmax(x, axis=-1)))
    teacher = jax.nn.softmax(logits, axis=-1)
    assert raw(logits, teacher) < 0, "no position rounds below zero: the test sees nothing"
    loss = float(learned.batch_loss(Logits(logits), "distill", None, {"attention_mask": jnp.ones((1, 1), jnp.int32)}, None, teacher))
    assert loss == 0.0
