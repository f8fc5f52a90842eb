"""No alignment ends worse than leaving B as it is (issue 46, `engine.choice`): activation matching
is compared with the identity and weight matching on the merged model's loss (ties: the closest
to A), weight matching with the identity on the weight distance, learned transforms start from the
best start and never end above it; the report and the command line say which result was kept and
why; `objective="auto"` is one decision for the command line and for `align`; a loss that is not
finite before any step is the data's fault, not the learning rate's."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from checkpoint_utils import plus_noise
from parity_utils import save_reference
from test_activations import data_for
from test_invariance import random_model
from test_learned import labelled

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.engine import alignment, learned
from rotsym_jax.engine.activations import DataError
from rotsym_jax.pytree import flatten

pytestmark = pytest.mark.usefixtures("float32_models")


def near_copies(name="vit-cls", eps=0.05, seed=0):
    """(checkpoint, spec, A, B): B = A with every leaf perturbed by eps of its spread, as two
    fine-tunes of one base are: the identity is the right alignment."""
    ck, a = random_model(name, seed=seed)
    keys = iter(jax.random.split(jax.random.key(7), 1000))
    b = jax.tree.map(lambda x: plus_noise(x, next(keys), eps * jnp.std(x)), a)
    return ck, rj.spec_for(ck), a, b


def same(p, q) -> bool:
    fp, fq = flatten(p), flatten(q)
    return fp.keys() == fq.keys() and all(np.array_equal(np.asarray(fp[k]), np.asarray(fq[k])) for k in fp)


def test_activation_matching_on_near_copies_keeps_a_result_no_farther_than_b():
    """The issue's fine-tunes in small: activation matching alone moves B away from A (its noisy
    rotations cost more weight distance than the copies differ by); the merged model's loss cannot
    tell the results apart, so the closest to A is kept, and the report and its note say so."""
    ck, spec, a, b = near_copies()
    data = data_for(ck, 1)
    own = rj.align(a, b, spec, method="activations", data=data, checkpoint=ck, fallback=False)
    before = own.report["before"]["total"]
    assert own.report["after"]["total"] > 1.2 * before and "chosen" not in own.report  # the plant: worse than none
    result = rj.align(a, b, spec, method="activations", data=data, checkpoint=ck)
    chosen = result.report["chosen"]
    assert chosen["requested"] == "activations" and chosen["method"] in ("weights", "identity")
    assert result.report["after"]["total"] <= before * (1 + 1e-6)
    assert set(chosen["candidates"]) == {"activations", "weights", "identity"} and chosen["measure"].startswith("distill loss")
    np.testing.assert_allclose(chosen["candidates"]["activations"]["distance"], own.report["after"]["total"], rtol=1e-5)
    np.testing.assert_allclose(chosen["candidates"][chosen["method"]]["distance"], result.report["after"]["total"], rtol=1e-5)
    assert chosen["note"].startswith(f"note: kept {alignment.choice.NAMES[chosen['method']]} instead of activation matching")
    weights = rj.align(a, b, spec)
    if chosen["method"] == "weights":
        assert same(result.params, weights.params)
    else:
        assert same(result.params, b)


def test_activation_matching_is_kept_where_the_merge_is_better_though_farther():
    """Independent models: activation matching ends farther from A than B was in weight distance
    (as on the digits ViTs of RESULTS.md), yet its merge is far better: it is kept, with a note."""
    ck, a = random_model("vit-cls", seed=0)
    _, b = random_model("vit-cls", seed=1)
    spec = rj.spec_for(ck)
    # the paper's groups (residual="none"): the stream, rotated by default here, would bring it closer
    result = rj.align(a, b, spec, method="activations", data=data_for(ck, 2), checkpoint=ck, residual="none")
    chosen = result.report["chosen"]
    losses = {n: c["loss"] for n, c in chosen["candidates"].items()}
    assert chosen["method"] == "activations" and losses["activations"] < 0.8 * min(losses["weights"], losses["identity"])
    assert result.report["after"]["total"] > result.report["before"]["total"]
    assert "farther from A" in chosen["note"]


def test_without_logits_the_weight_distance_decides():
    ck, spec, a, b = near_copies("bert-cls")
    base = rj.init_checkpoint(ck.model_config, jax.random.key(0), pooler=True)  # no task head: no loss to score
    strip = lambda p: {k: v for k, v in p.items() if k != "head"}
    result = rj.align(strip(a), strip(b), rj.spec_for(base), method="activations", data=data_for(ck, 1), checkpoint=base)
    chosen = result.report["chosen"]
    assert chosen["measure"] == "weight distance to A" and "loss" not in chosen["candidates"]["identity"]
    assert chosen["method"] != "activations" and result.report["after"]["total"] <= result.report["before"]["total"]


def test_weight_matching_falls_back_to_the_identity_where_it_ends_farther(monkeypatch):
    """A residual descent that ends farther from A than B was (forced here) gives B back, in
    Python and inside jit; fallback=False keeps it."""
    ck, spec, a, b = near_copies("gpt2-lm", eps=0.01)

    def astray(bound, params_a, params_b, solve, options, traced):
        t = rj.random_transform(spec, params_b, jax.random.key(1), ("perm",))
        return {**t, "residual": rj.random_residual(spec, params_b, jax.random.key(2), "permutation")}, [1.0]

    monkeypatch.setattr(alignment, "_solve_with_residual", astray)
    result = rj.align(a, b, spec, residual="permutation")
    assert result.report["chosen"]["method"] == "identity" and same(result.params, b)
    assert result.report["after"]["total"] == result.report["before"]["total"] and "residual" not in result.report
    assert result.report["chosen"]["note"].startswith("note: kept the identity (B as given) instead of weight matching")
    jitted = jax.jit(lambda x, y: rj.align(x, y, spec, residual="permutation"))(a, b)
    np.testing.assert_allclose(float(jitted.report["after"]["total"]), result.report["before"]["total"], rtol=1e-6)
    assert np.array_equal(np.asarray(jitted.transforms["residual"].perm), np.arange(32))
    own = rj.align(a, b, spec, residual="permutation", fallback=False)
    assert own.report["after"]["total"] > 2 * own.report["before"]["total"]


def test_learned_starts_from_its_best_start_and_never_ends_above_it():
    ck, spec, a, b = near_copies()
    data = labelled(ck)
    result = rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, steps=4, eval_every=2, learning_rate=3e-2,
                      key=jax.random.key(0))
    report, chosen = result.report["learned"], result.report["chosen"]
    losses = report["start"]["losses"]
    assert set(losses) == {"activations", "weights", "identity"} and report["start"]["measured_on"] == "held-out batches"
    assert chosen["start"] == report["start"]["chosen"] != "activations"  # near copies: a start no farther than B
    assert report["held_out"][0] == {"step": 0, "loss": losses[chosen["start"]]}
    held = [h["loss"] for h in report["held_out"]]
    # The best point, or the start where the best beat it by no more than a tie (`choice`): never above the start.
    assert report["best_loss"] == (held[0] if "set_aside" in report else min(held)) <= losses[chosen["start"]]
    assert report["best_loss"] <= min(losses.values()) + alignment.choice.LOSS_TIE_ABS
    mid = jax.tree.map(lambda x, y: (x + y) / 2, a, result.params)
    np.testing.assert_allclose(float(rj.recipe.loss_fn(ck, data[-1:])(mid)), report["best_loss"], rtol=1e-4)
    assert chosen["note"].startswith("note: method='learned' started from")


def test_learned_gives_its_start_back_where_no_step_helps():
    """Steps that only raise the held-out loss (the copies' merge is near the best there is)."""
    ck, spec, a, b = near_copies()
    data = labelled(ck)
    wild = rj.align(a, b, spec, method="learned", data=data, checkpoint=ck, steps=2, eval_every=1, learning_rate=3.0, init="weights",
                    objective="distill")
    assert wild.report["learned"]["best_step"] == 0 and "no step lowered it" in wild.report["chosen"]["note"]
    start = rj.align(a, b, spec) if wild.report["chosen"]["start"] == "weights" else None
    assert same(wild.params, start.params if start else b)


def test_a_learned_run_that_keeps_its_start_reports_the_start():
    """A new-user trial: a learned run whose descent found nothing better kept its start, and its
    report said method "learned". It says what was kept, as the other methods' kept results do."""
    ck, spec, a, b = near_copies()
    wild = rj.align(a, b, spec, method="learned", data=labelled(ck), checkpoint=ck, steps=2, eval_every=1, learning_rate=3.0,
                    init="weights", objective="distill")
    chosen = wild.report["chosen"]
    assert wild.report["learned"]["best_step"] == 0
    assert (chosen["method"], chosen["requested"], chosen["init"]) == (chosen["start"], "learned", "weights"), chosen
    assert chosen["note"].startswith(f"note: kept {alignment.choice.NAMES[chosen['start']]} instead of the learned transforms: "
                                     "started from"), chosen["note"]


def _learning(best_step: int, set_aside: dict | None = None) -> dict:
    """`learned.learn`'s report as `choice.learned` reads it: weight matching the start (the lowest
    held-out loss), trained `best_step` steps."""
    losses = {"activations": 0.9, "weights": 0.5, "identity": 0.7}
    return {"objective": "task", "best_step": best_step, "best_loss": 0.3 if best_step else 0.5,
            "start": {"chosen": "weights", "losses": losses, "measured_on": "held-out batches"}, **({"set_aside": set_aside} if set_aside else {})}


def test_the_learned_report_names_what_was_kept():
    """`choice.learned`, on learning reports made by hand: a trained point kept is "learned"; the
    start kept (no step helped, or a trained point within the tie set aside) is the start, asked
    for "learned", with the note every other kept result has ("kept X instead of Y")."""
    from rotsym_jax.engine import choice

    distances = {"activations": 3.0, "weights": 2.0, "identity": 2.5}
    trained = choice.learned(_learning(40), distances, "best")
    assert (trained["method"], trained["requested"], trained["start"], trained["init"]) == ("learned", "learned", "weights", "best")
    assert trained["note"] == f"note: method='learned' {trained['reason']}" and trained["reason"].endswith("best at step 40: 0.3")
    for learning, why in ((_learning(0), "no step lowered it: the start is kept"),
                          (_learning(0, {"step": 3, "loss": 0.499, "distance": 2.2}), "within the tie, 2.2 from A: the start is kept")):
        kept = choice.learned(learning, distances, "weights")
        assert (kept["method"], kept["requested"], kept["start"], kept["init"]) == ("weights", "learned", "weights", "weights"), kept
        assert kept["note"] == f"note: kept weight matching instead of the learned transforms: {kept['reason']}", kept["note"]
        assert kept["reason"].startswith("started from weight matching: the lowest task loss") and kept["reason"].endswith(why), kept
    # a trained point from the start asked for, no farther from A than B: nothing to say
    assert choice.learned(_learning(40), {"activations": 3.0, "weights": 2.0, "identity": 2.5}, "weights")["note"] is None


def test_a_loss_that_is_not_finite_before_any_step_is_the_datas_fault():
    ck, spec, a, b = near_copies()
    data = labelled(ck)
    wrong = [{**d, "labels": np.full_like(d["labels"], 49)} for d in data]  # 5 classes
    with pytest.raises(DataError, match=r"data\[0\]: labels .*49"):
        rj.align(a, b, spec, method="learned", data=wrong, checkpoint=ck, steps=2)
    broken = [{**d, "pixel_values": np.full_like(d["pixel_values"], np.inf)} for d in data]
    with pytest.raises(DataError, match="not finite before any step.*not the learning rate"):
        rj.align(a, b, spec, method="learned", data=broken, checkpoint=ck, steps=2, attention="none", ffn="none", init="weights")


# ---- the command line ------------------------------------------------------------------------------

GPT2 = dict(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=20)


@pytest.fixture(scope="module")
def lm_copies(tmp_path_factory):
    """Two near copies of a tiny GPT-2 LM (transformers folders) and an .npz of token ids, no labels."""
    root = tmp_path_factory.mktemp("copies")
    model = save_reference(tf.GPT2LMHeadModel, tf.GPT2Config(**GPT2), root / "a", seed=0)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn_like(p))
    model.save_pretrained(root / "b")
    ids = np.random.default_rng(0).integers(0, 60, size=(32, 12))
    np.savez(root / "data.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    return root


def test_rotsym_align_says_which_result_it_kept(lm_copies, tmp_path, capsys):
    root = lm_copies
    out = tmp_path / "out"
    assert cli.main(["align", str(root / "a"), str(root / "b"), str(out), "--method", "activations", "--data", str(root / "data.npz")]) == 0
    chosen = json.loads((out / "rotsym_report.json").read_text())["result"]["chosen"]
    assert chosen["requested"] == "activations" and chosen["method"] != "activations"
    err = capsys.readouterr().err
    assert err.count(chosen["note"]) == 1 and "\n" not in chosen["note"]
    # --no-fallback keeps the method's own result, and the report records the option
    kept = tmp_path / "kept"
    assert cli.main(["align", str(root / "a"), str(root / "b"), str(kept), "--method", "activations", "--data", str(root / "data.npz"),
                     "--no-fallback"]) == 0
    report = json.loads((kept / "rotsym_report.json").read_text())
    assert "chosen" not in report["result"] and chosen["note"] not in capsys.readouterr().err
    assert report["options"]["fallback"] is False


def test_rotsym_merge_says_which_result_it_kept_for_each_model(lm_copies, tmp_path, capsys):
    root = lm_copies
    recipe = tmp_path / "merge.yaml"
    recipe.write_text(f"models: [{root / 'a'}, {root / 'b'}]\nmethod: average\nalign: anchor\n"
                      f"align_options: {{method: activations}}\ndata: {{file: {root / 'data.npz'}}}\n")
    assert cli.main(["merge", str(recipe), str(tmp_path / "out")]) == 0
    chosen = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())["result"]["alignment"]["distances"][0]["chosen"]
    assert chosen["requested"] == "activations" and chosen["method"] != "activations"
    assert capsys.readouterr().err.count(f"model 1: {chosen['note']}") == 1


def test_the_auto_objective_is_one_decision_for_the_command_line_and_align(lm_copies, tmp_path):
    """A causal LM's token ids label themselves: the task loss in both, from the same file."""
    root = lm_copies
    out = tmp_path / "out"
    assert cli.main(["align", str(root / "a"), str(root / "b"), str(out), "--quiet", "--method", "learned", "--data",
                     str(root / "data.npz"), "--steps", "1", "--batch-size", "8"]) == 0
    by_cli = json.loads((out / "rotsym_report.json").read_text())["result"]["learned"]["objective"]
    ck_a, ck_b = rj.load_hf(root / "a"), rj.load_hf(root / "b")
    arrays = np.load(root / "data.npz")
    batches = [{k: arrays[k][i:i + 8] for k in arrays.files} for i in range(0, 32, 8)]
    assert learned.objective_for(ck_b, batches, "auto") == "task"
    direct = rj.align(ck_a.params, ck_b.params, rj.spec_for(ck_b), method="learned", data=batches, checkpoint=ck_b, steps=1)
    assert by_cli == direct.report["learned"]["objective"] == "task"
