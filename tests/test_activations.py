"""Alignment from activations (MATH §10, `align(..., method="activations")`): B = A moved by a
random element of every group gives its activations back exactly, so matching them recovers the
plant in every family (with head permutations, rescaling, RoPE, GQA and the residual stream); on
a tiny GPT-2 the sites read in transformers by forward hooks give, by brute force over every
permutation and by a float64 SVD, the same matchings; data that cannot drive it is refused."""

import itertools
import json
import re

import jax
import numpy as np
import pytest
import torch
import transformers as tf
import yaml
from parity_utils import save_reference
from test_invariance import FAMILIES, outputs, planted_pair, random_model

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.engine import learned
from rotsym_jax.engine.activations import DataError
from rotsym_jax.transforms import KINDS, RESIDUAL

pytestmark = pytest.mark.usefixtures("float32_models")
DEFAULT = ("bert-cls", "vit-cls", "gpt2-lm", "llama-gqa")


def data_for(ck, batches=3, seed=0):
    rng = np.random.default_rng(seed)
    if ck.family == "vit":
        return [{"pixel_values": rng.normal(size=(8, 1, 8, 8)).astype(np.float32)} for _ in range(batches)]
    out = []
    for _ in range(batches):
        ids = rng.integers(3, 97, size=(6, 10))
        mask = np.ones_like(ids)
        mask[-1, 6:] = 0  # padding is left out of every site
        out.append({"input_ids": ids, "attention_mask": mask, "labels": np.zeros(6, int)})
    return out


@pytest.mark.parametrize("name, residual", [pytest.param(n, r, marks=[] if n in DEFAULT and r == "permutation" else [pytest.mark.slow])
                                            for n in sorted(FAMILIES) if "moe" not in n and "sandwich" not in n for r in ("permutation", "rotation")
                                            if r == "permutation" or n.startswith(("llama", "vit", "qwen2", "mistral"))])
def test_planted_transforms_are_recovered_from_activations(name, residual):
    ck, spec, a, b = planted_pair(name, residual)
    result = rj.align(a, b, spec, method="activations", data=data_for(ck), checkpoint=ck, heads="permute", residual=residual)
    before, after = result.report["before"]["total"], result.report["after"]["total"]
    # a rotated stream goes through float32 polar factors of the model width: 1e-5 as for weights
    assert after <= (1e-6 if residual == "permutation" else 1e-5) * before, (before, after, result.report["after"])
    assert result.report["timings"]["statistics"] > 0
    inputs, _ = ck.split_batch(data_for(ck, 1)[0])
    want, got = (outputs(ck, p, inputs)["logits"] for p in (b, result.params))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# ---- against transformers: the sites read by forward hooks ---------------------------------------

TINY = dict(vocab_size=11, n_embd=4, n_layer=1, n_head=2, n_inner=4, n_positions=16)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = tf.GPT2Model(tf.GPT2Config(**TINY)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        model.save_pretrained(root / str(seed))
        models.append(model)
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(0, 11, size=(5, 9)), "attention_mask": np.ones((5, 9), int)} for _ in range(2)]
    return [rj.load_hf(root / str(s)) for s in (0, 1)], models, data


def _hooked(model, data) -> dict:
    """Each module's input (and c_attn's output) on the data, rows = tokens, float64."""
    got = {}
    block = model.h[0]
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: got.setdefault(name, []).append((args[0], out)))
             for name, m in (("c_attn", block.attn.c_attn), ("c_proj", block.attn.c_proj), ("c_fc", block.mlp.c_fc),
                             ("mlp_proj", block.mlp.c_proj))]
    with torch.no_grad():
        for batch in data:
            model(input_ids=torch.as_tensor(batch["input_ids"]), attention_mask=torch.as_tensor(batch["attention_mask"]))
    for h in hooks:
        h.remove()
    rows = lambda x: x.reshape(-1, x.shape[-1]).double().numpy()
    return {name: (np.concatenate([rows(i) for i, _ in v]), np.concatenate([rows(o) for _, o in v])) for name, v in got.items()}


def _standardised(x):
    x = x - x.mean(0)
    return x / np.linalg.norm(x, axis=0)


def _polar(m):
    u, _, vt = np.linalg.svd(m)
    return u @ vt


def test_ffn_and_residual_permutations_are_the_brute_force_best_correlations(tiny_pair):
    (ck_a, ck_b), (model_a, model_b), data = tiny_pair
    spec = rj.spec_for(ck_a)
    result = rj.align(ck_a.params, ck_b.params, spec, method="activations", data=data, checkpoint=ck_a,
                      attention="none", residual="permutation", fallback=False)  # its own result: no other compared
    ha, hb = _hooked(model_a, data), _hooked(model_b, data)
    # FFN units: B's unit p[j] <-> A's unit j, maximising the summed correlations.
    za, zb = _standardised(ha["mlp_proj"][0]), _standardised(hb["mlp_proj"][0])
    score = lambda p: sum(zb[:, p[j]] @ za[:, j] for j in range(4))
    best = max(itertools.permutations(range(4)), key=score)
    np.testing.assert_array_equal(np.asarray(result.transforms["ffn"].perm)[0], best)
    # The stream as its readers see it: ln_1's output (read by c_attn) and ln_2's (read by c_fc).
    xa = [_standardised(ha[n][0]) for n in ("c_attn", "c_fc")]
    xb = [_standardised(hb[n][0]) for n in ("c_attn", "c_fc")]
    stream = lambda p: sum(b[:, p[j]] @ a[:, j] for a, b in zip(xa, xb) for j in range(4))
    np.testing.assert_array_equal(np.asarray(result.transforms["residual"].perm), max(itertools.permutations(range(4)), key=stream))


def test_head_rotations_are_the_float64_procrustes_of_the_hooked_activations(tiny_pair):
    """QK: polar of sum q_B^T q_A + k_B^T k_A per head; VO: of v_B^T v_A + ctx_B^T ctx_A (ctx: the
    head's attention output, c_proj's input)."""
    (ck_a, ck_b), (model_a, model_b), data = tiny_pair
    result = rj.align(ck_a.params, ck_b.params, rj.spec_for(ck_a), method="activations", data=data, checkpoint=ck_a,
                      rescale="none", ffn="none", fallback=False)
    ha, hb = _hooked(model_a, data), _hooked(model_b, data)
    d, dh = 4, 2
    for head in range(2):
        cols = slice(head * dh, (head + 1) * dh)
        q = [h["c_attn"][1][:, :d][:, cols] for h in (ha, hb)]
        k = [h["c_attn"][1][:, d:2 * d][:, cols] for h in (ha, hb)]
        v = [h["c_attn"][1][:, 2 * d:][:, cols] for h in (ha, hb)]
        ctx = [h["c_proj"][0][:, cols] for h in (ha, hb)]
        qk = _polar(q[1].T @ q[0] + k[1].T @ k[0])
        vo = _polar(v[1].T @ v[0] + ctx[1].T @ ctx[0])
        got = result.transforms["attn"]
        np.testing.assert_allclose(np.asarray(got.qk)[0, head], qk, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got.vo)[0, head], vo, atol=1e-5)


def test_the_vo_scale_is_the_least_squares_one_from_activations(tiny_pair):
    (ck_a, ck_b), (model_a, model_b), data = tiny_pair
    result = rj.align(ck_a.params, ck_b.params, rj.spec_for(ck_a), method="activations", data=data, checkpoint=ck_a, ffn="none",
                      fallback=False)
    ha, hb = _hooked(model_a, data), _hooked(model_b, data)
    got = result.transforms["attn"]
    for head in range(2):
        cols = slice(head * 2, head * 2 + 2)
        xa = np.concatenate([ha["c_attn"][1][:, 8:][:, cols], ha["c_proj"][0][:, cols]])
        xb = np.concatenate([hb["c_attn"][1][:, 8:][:, cols], hb["c_proj"][0][:, cols]]) @ np.asarray(got.vo, np.float64)[0, head]
        np.testing.assert_allclose(float(np.asarray(got.vo_scale)[0, head]), np.sum(xb * xa) / np.sum(xb * xb), rtol=1e-4)


# ---- refusals --------------------------------------------------------------------------------------

def test_what_cannot_drive_activation_matching_is_refused():
    ck, params = random_model("gpt2-lm")
    spec = rj.spec_for(ck)
    with pytest.raises(ValueError, match="runs both models on data: give data="):
        rj.align(params, params, spec, method="activations")
    with pytest.raises(ValueError, match="method='bogus'"):
        rj.align(params, params, spec, method="bogus")
    few = [{"input_ids": np.array([[3, 4]]), "attention_mask": np.array([[1, 1]])}]
    with pytest.raises(DataError, match="holds 2 tokens .* needs at least 8: the head width of attn"):
        rj.align(params, params, spec, method="activations", data=few, checkpoint=ck)
    outside = [{"input_ids": np.array([[3, 400]]), "attention_mask": np.array([[1, 1]])}]
    with pytest.raises(ValueError, match=r"params_a \(model A\): data\[0\].*400"):
        rj.align(params, params, spec, method="activations", data=outside, checkpoint=ck)
    with pytest.raises(DataError, match="no batch"):
        rj.align(params, params, spec, method="activations", data=[], checkpoint=ck)
    with pytest.raises(ValueError, match="cannot run inside jit"):
        jax.jit(lambda a, b: rj.align(a, b, spec, method="activations", data=data_for(ck), checkpoint=ck).params)(params, params)


# ---- the command line ------------------------------------------------------------------------------

CLI_CASES = {
    "BertForSequenceClassification": lambda: tf.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                           intermediate_size=48, max_position_embeddings=20, num_labels=3),
    "GPT2LMHeadModel": lambda: tf.GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=20),
    "LlamaForCausalLM": lambda: tf.LlamaConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=48, max_position_embeddings=20),
    "ViTForImageClassification": lambda: tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                                      image_size=8, patch_size=2, num_channels=1, num_labels=3),
}


def _npz(path, name, rng, images=24, texts=16):
    if name.startswith("ViT"):
        np.savez(path, pixel_values=rng.normal(size=(images, 1, 8, 8)).astype(np.float32), labels=rng.integers(0, 3, images))
    else:
        ids = rng.integers(0, 60, size=(texts, 12))
        mask = np.ones_like(ids)
        mask[::3, 9:] = 0
        np.savez(path, input_ids=ids, attention_mask=mask)
    return path


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_rotsym_align_from_activations_undoes_a_plant_in_transformers(name, tmp_path):
    cls = getattr(tf, name)
    a_model = save_reference(cls, CLI_CASES[name](), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1), KINDS)
    t["residual"] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
    rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "b")
    data = _npz(tmp_path / "data.npz", name, np.random.default_rng(0))
    out = tmp_path / "out"
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(out), "--quiet", "--method", "activations", "--data", str(data),
                     "--heads", "permute", "--residual", "permutation"]) == 0
    report = json.loads((out / "rotsym_report.json").read_text())
    assert report["options"]["method"] == "activations" and report["result"]["after"]["total"] <= 1e-5 * report["result"]["before"]["total"]
    moved = cls.from_pretrained(out, attn_implementation="eager").eval()
    with np.load(data) as arrays:
        inputs = {k: torch.as_tensor(arrays[k][:4]) for k in ("pixel_values", "input_ids", "attention_mask") if k in arrays}
    with torch.no_grad():
        np.testing.assert_allclose(moved(**inputs).logits.numpy(), a_model(**inputs).logits.numpy(), atol=1e-4)


def test_rotsym_align_refuses_data_it_cannot_use_before_reading_weights(tmp_path, capsys, no_weight_reads):
    cls = tf.GPT2LMHeadModel
    save_reference(cls, CLI_CASES["GPT2LMHeadModel"](), tmp_path / "a")
    rng = np.random.default_rng(0)
    good = _npz(tmp_path / "good.npz", "GPT2", rng)
    np.savez(tmp_path / "outside.npz", input_ids=np.full((4, 12), 60))
    np.savez(tmp_path / "few.npz", input_ids=np.ones((1, 3), int))
    np.savez(tmp_path / "images.npz", pixel_values=np.zeros((2, 1, 8, 8), np.float32))
    a = str(tmp_path / "a")
    cases = [
        ([], "method='activations' matches the models' activations on data: give --data FILE"),
        (["--data", str(tmp_path / "outside.npz")], "outside.npz: examples 0-3: input_ids holds values in \\[60, 60\\], outside \\[0, 60\\)"),
        # by default the data methods rotate a pre-norm model's stream: the width bounds the tokens
        (["--data", str(tmp_path / "few.npz")], "3 tokens .*needs at least 32: the model width \\(residual='rotation'\\)"),
        (["--data", str(tmp_path / "few.npz"), "--residual", "none"], "3 tokens .*needs at least 8: the head width of attn"),
        (["--data", str(tmp_path / "images.npz")], "images.npz: examples 0-1: holds pixel_values \\(images\\), and .* reads input_ids"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit):
            cli.main(["align", a, a, str(tmp_path / "out"), "--method", "activations", *extra])
        err = capsys.readouterr().err
        assert re.search(message, err), (extra, err)
    with pytest.raises(SystemExit):
        cli.main(["align", a, a, str(tmp_path / "out"), "--data", str(good)])
    assert "method='weights' reads only the weights" in capsys.readouterr().err
    # activation matching streams (tests/test_streaming.py); learning does not, and says why before any read
    with pytest.raises(SystemExit):
        cli.main(["align", a, a, str(tmp_path / "out"), "--method", "learned", "--data", str(good), "--max-memory", "3G"])
    assert "method='learned' trains through both models' forward and backward passes at once" in capsys.readouterr().err
    recipe = tmp_path / "learned.yaml"  # a merge is told to merge in memory, not to align
    recipe.write_text(yaml.safe_dump({"models": [str(a), str(a)], "method": "average", "align_options": {"method": "learned"},
                                      "data": {"file": str(good)}}))
    with pytest.raises(SystemExit):
        cli.main(["merge", str(recipe), str(tmp_path / "out"), "--max-memory", "3G"])
    assert "needs them whole in memory: merge in memory (without --max-memory)" in capsys.readouterr().err


def test_align_many_and_recipes_match_from_activations(tmp_path):
    """align_many takes the method (each model and its reference run on the data), and so does a
    merge recipe's align_options, with the recipe's data."""
    ck, params = random_model("gpt2-lm")
    spec = rj.spec_for(ck)
    planted = [rj.apply_transform(spec, params, rj.random_transform(spec, params, jax.random.key(k), KINDS)) for k in (1, 2)]
    scorer = (learned.scored_loss, learned._half_sums, learned._softmax)
    compiled = [f._cache_size() for f in scorer]
    many = rj.align_many([params, *planted], spec, method="activations", data=data_for(ck), checkpoint=ck, mode="mean", heads="permute")
    assert many.objective[-1] <= 1e-9 * many.report["unaligned_objective"]
    # residual="auto" settled once for all, as align settles it (these norm gains are not uniform: a permutation); the model
    # left as given reports that group's identity, as the others' permutations are reported (it had a rotation's)
    medoid, entries = many.report["reference_model"], [m[RESIDUAL] for m in many.report["moved"]]
    assert many.report["settled"]["residual"] == "permutation" and "final_norm/scale" in many.report["settled"]["why"], many.report
    assert all(t[RESIDUAL].rotation is None for i, t in enumerate(many.transforms) if i != medoid)
    assert entries[medoid] == {"kind": "residual", "coordinates": 0.0} and all(set(e) == {"kind", "coordinates"} for e in entries), entries
    # every inner align scores its result on the merged model: one program for all of them (it was one per call)
    assert all(f._cache_size() - n <= 1 for f, n in zip(scorer, compiled))
    with pytest.raises(ValueError, match="give data= and checkpoint="):
        rj.align_many([params, *planted], spec, method="activations")
    for i, p in enumerate((params, planted[0])):
        rj.save_hf(ck, p, tmp_path / f"m{i}")
    np.savez(tmp_path / "data.npz", input_ids=np.random.default_rng(0).integers(3, 97, size=(16, 10)))
    recipe = tmp_path / "merge.yaml"
    recipe.write_text(json.dumps({"models": ["m0", "m1"], "method": "average", "align_options": {"method": "activations", "heads": "permute",
                                                                                            "residual": "none"},  # by default the stream rotates: gains folded, other leaves
                                  "data": {"file": "data.npz"}}))
    assert cli.main(["merge", str(recipe), str(tmp_path / "merged"), "--quiet"]) == 0
    merged = rj.load_hf(tmp_path / "merged")
    for path, x in rj.pytree.flatten(params).items():
        np.testing.assert_allclose(np.asarray(rj.pytree.flatten(merged.params)[path]), np.asarray(x), atol=1e-4, err_msg=path)
    recipe.write_text(json.dumps({"models": ["m0", "m1"], "method": "average", "align_options": {"method": "activations"}}))
    with pytest.raises(SystemExit):
        cli.main(["merge", str(recipe), str(tmp_path / "merged2")])
