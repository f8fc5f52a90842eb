"""LoRA extraction (`rotsym_jax.merging.lora`, `rotsym extract-lora`): the factors against NumPy's SVD
(the delta exactly at full rank, the best rank-k approximation below it, mergekit's rank and scale
options), the adapter loaded by peft onto the transformers base against transformers run on base +
the extracted delta, and (slow) the adapter's tensors against mergekit-extract-lora's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
import safetensors.numpy
import transformers as tf
from checkpoint_utils import plus_noise
from family_cases import TEXT
from parity_utils import save_reference, torch

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.errors import InputError, PathExists
from rotsym_jax.merging import lora
from rotsym_jax.pipeline import aligning_spec

ROOT = Path(__file__).resolve().parent.parent
MERGEKIT = ROOT / ".mergekit"
LLAMA = dict(TEXT, num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False)
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=8, patch_size=2, num_channels=1)
CASES = {"llama": (tf.LlamaForCausalLM, lambda: tf.LlamaConfig(**LLAMA)),
         "bert": (tf.BertForMaskedLM, lambda: tf.BertConfig(**TEXT)),
         # transformers 5 renames ViT's tensors on load (encoder.layer.0.attention.attention.query -> layers.0.attention.q_proj)
         "vit": (tf.ViTForImageClassification, lambda: tf.ViTConfig(**VIT))}


def _tuned(ck, seed: int, scale: float = 0.02):
    keys = iter(jax.random.split(jax.random.key(seed), 1000))
    return jax.tree.map(lambda x: plus_noise(x, next(keys), scale, x.dtype), ck.params)


def _pair(name, tmp_path_factory):
    root = tmp_path_factory.mktemp(name)
    cls, config = CASES[name]
    save_reference(cls, config(), root / "base")
    ck = rj.load_hf(root / "base")
    tuned = _tuned(ck, 1)
    hf.save_hf(ck, tuned, root / "tuned")
    return ck, tuned, root


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    """(checkpoint of a transformers-written base, a tuned params pytree near it, the tuned folder)."""
    return _pair(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["bert", "llama"])
def text_pair(request, tmp_path_factory):
    """`pair` of the text models, every leaf of which lies in a module an adapter carries (ViT's class
    token does not: the warning's test)."""
    return _pair(request.param, tmp_path_factory)


def _deltas(ck, tuned, lora_: lora.Lora) -> dict[str, np.ndarray]:
    base, new = lora.hf_tensors(ck, ck.params), lora.hf_tensors(ck, tuned)
    return {n: (new[lora_.stored[n]] - base[lora_.stored[n]]).astype(np.float64) for n in lora_.a}


def _best(delta: np.ndarray, k: int) -> np.ndarray:
    u, s, vt = np.linalg.svd(delta, full_matrices=False)
    return (u[:, :k] * s[:k]) @ vt[:k]


def test_full_rank_reproduces_the_delta(pair):
    ck, tuned, _ = pair
    out = lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=1000))
    assert out.a, "nothing was factored"
    for name, delta in _deltas(ck, tuned, out).items():
        assert out.a[name].shape[0] == min(delta.shape)
        np.testing.assert_allclose(out.delta(name), delta, atol=2e-6, err_msg=name)
    assert lora.relative_error(out, ck.params, tuned, ck) < 1e-5


@pytest.mark.parametrize("distribute_scale", [True, False])
def test_rank_k_is_numpys_best_rank_k_approximation(pair, distribute_scale):
    ck, tuned, _ = pair
    out = lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=3, distribute_scale=distribute_scale))
    for name, delta in _deltas(ck, tuned, out).items():
        k = min(3, *delta.shape)  # ViT's classifier has 2 outputs
        np.testing.assert_allclose(out.delta(name), _best(delta, k), atol=2e-6, err_msg=name)
        u, s, vt = np.linalg.svd(delta, full_matrices=False)
        a, b = out.a[name].astype(np.float64), out.b[name].astype(np.float64)
        sign = np.sign(np.sum(b * u[:, :k], axis=0))  # a singular pair's sign is free: ours against NumPy's
        scale_a, scale_b = (np.sqrt(s[:k]), np.sqrt(s[:k])) if distribute_scale else (s[:k], np.ones(k))
        # a singular vector alone is float32 SVD over a singular gap: looser than the product
        np.testing.assert_allclose(a, sign[:, None] * scale_a[:, None] * vt[:k], atol=1e-4, err_msg=name)
        np.testing.assert_allclose(b, u[:, :k] * scale_b * sign, atol=1e-4, err_msg=name)


def test_sv_epsilon_keeps_the_singular_values_above_it(pair):
    ck, tuned, _ = pair
    full = lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=1000))
    deltas = _deltas(ck, tuned, full)
    epsilon = float(np.median([np.linalg.svd(d, compute_uv=False)[5] for d in deltas.values() if min(d.shape) > 5]))
    out = lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=20, sv_epsilon=epsilon))
    for name, delta in deltas.items():
        want = min(20, int(np.sum(np.linalg.svd(delta, compute_uv=False) > epsilon)))
        assert out.ranks[name] == max(want, 1), name
    assert len(set(out.ranks.values())) > 1  # the threshold told the modules apart
    config = lora.adapter_config(out, "base", None)
    assert config["r"] == max(out.ranks.values()) == config["lora_alpha"]
    assert config["rank_pattern"] == {n: r for n, r in out.ranks.items() if r != config["r"]} == config["alpha_pattern"]


def test_mergekits_plan_of_modules(pair):
    """What is factored and what is kept whole, as mergekit's plan_extraction decides it."""
    ck, tuned, _ = pair
    out = lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=2))
    if ck.family == "llama":
        assert out.modules_to_save == ("embed_tokens", "input_layernorm", "post_attention_layernorm", "norm", "lm_head")
        assert len(out.a) == 2 * 7 and not out.bias
    elif ck.family == "vit":  # named as transformers' model names them, read from the checkpoint's tensors; the patch convolution whole
        assert out.modules_to_save == ("projection", "layernorm_before", "layernorm_after", "layernorm")
        assert out.stored["vit.layers.1.attention.q_proj"] == "vit.encoder.layer.1.attention.attention.query.weight"
        assert len(out.a) == 2 * 6 + 1 and set(out.bias) == set(out.a)
        return
    else:  # BERT: every nn.Embedding, the LayerNorms and the tied decoder kept whole; biases' deltas beside the factors
        assert set(out.modules_to_save) == {"word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm", "decoder"}
        assert set(out.bias) == set(out.a) and "cls.predictions.transform.dense" in out.a
        base, new = lora.hf_tensors(ck, ck.params), lora.hf_tensors(ck, tuned)
        name = next(iter(out.bias))
        np.testing.assert_array_equal(out.bias[name], new[f"{name}.bias"] - base[f"{name}.bias"])
    for name, value in out.saved.items():
        np.testing.assert_array_equal(value, lora.hf_tensors(ck, tuned)[name])
    embed = lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=2, embed_lora=True, exclude=["layers?\\.1\\."], save_modules=["q_proj", "query"]))
    assert not any(".1." in n for n in embed.a) and not any(n.endswith(("q_proj", "query")) for n in embed.a)
    assert any(n.endswith(("q_proj.weight", "query.weight")) for n in embed.saved)
    assert embed.embeddings and all(embed.a[n].shape[1] == ck.model_config.vocab_size for n in embed.embeddings
                                    if "word" in n or "embed_tokens" in n)
    picked = lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=2, include=["mlp|intermediate"], skip_undecomposable=True))
    assert picked.a and all("mlp" in n or "intermediate" in n for n in picked.a)


def _peft():
    if not (MERGEKIT / "peft").is_dir():
        pytest.fail(f"peft is not installed in {MERGEKIT}: `make test-slow` installs it (the reference loader of these tests)")
    if str(MERGEKIT) not in sys.path:
        sys.path.append(str(MERGEKIT))  # after the venv: its torch and transformers stay the ones loaded
    import peft
    return peft


def _inputs(ck) -> dict:
    rng = np.random.default_rng(0)
    if ck.family == "vit":
        return {"pixel_values": torch.as_tensor(rng.normal(size=(2, 1, 8, 8)), dtype=torch.float32)}
    return {"input_ids": torch.as_tensor(rng.integers(0, 60, (2, 9)))}


def _expected_model(ck, cls, root, out: lora.Lora):
    """transformers' base with the extracted delta added by hand: W + B A, b + its delta, and the tensors kept whole."""
    model = cls.from_pretrained(root / "base").eval()
    state = model.state_dict()
    with torch.no_grad():
        for name in out.a:
            state[f"{name}.weight"] += torch.as_tensor(out.delta(name))
        for name, delta in out.bias.items() if lora.bias_loads(out) else ():
            state[f"{name}.bias"] += torch.as_tensor(delta)
        for name, value in out.saved.items():
            state[name].copy_(torch.as_tensor(np.array(value)))
    return model


@pytest.mark.slow  # peft is installed beside mergekit, by `make test-slow`
@pytest.mark.parametrize("embed_lora", [False, True])
def test_peft_loads_the_adapter_onto_the_base(pair, tmp_path, embed_lora):
    peft = _peft()
    ck, tuned, root = pair
    cls = CASES[ck.family][0]
    out = lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=3, embed_lora=embed_lora))
    assert lora.task_type(ck) == ("CAUSAL_LM" if ck.family == "llama" else None)
    assert bool(out.embeddings) == (embed_lora and any(m.kind == "embedding" for m in lora.modules_of(ck)))  # ViT: none to factor
    if out.bias and out.embeddings:  # PEFT's lora_bias refuses factored embeddings
        with pytest.warns(UserWarning, match="are not loaded"):
            lora.save_lora(out, tmp_path / "adapter", base_model=str(root / "base"), task_type=lora.task_type(ck))
    else:
        lora.save_lora(out, tmp_path / "adapter", base_model=str(root / "base"), task_type=lora.task_type(ck))
    merged = peft.PeftModel.from_pretrained(cls.from_pretrained(root / "base").eval(), tmp_path / "adapter").merge_and_unload().eval()
    with torch.no_grad():
        got, want = merged(**_inputs(ck)).logits.numpy(), _expected_model(ck, cls, root, out)(**_inputs(ck)).logits.numpy()
        base = cls.from_pretrained(root / "base").eval()(**_inputs(ck)).logits.numpy()
    assert np.abs(want - base).max() > 1e-2  # the adapter changes the model
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.slow  # peft is installed beside mergekit, by `make test-slow`
def test_aligned_first_the_adapter_still_gives_the_tuned_model(text_pair, tmp_path):
    """T hidden behind a random symmetry (heads, rotations, scales, permutations: the same function),
    moved back onto B, then extracted at full rank: peft's merged model computes what transformers
    computes from T's own folder (the alignment kept T's function, the adapter carries all of it), and
    the adapter is smaller than without aligning."""
    ck, tuned, root = text_pair
    peft = _peft()
    cls = CASES[ck.family][0]
    spec = aligning_spec(ck)
    hidden = rj.apply_transform(spec, tuned, rj.random_transform(spec, tuned, jax.random.key(7)))
    aligned = rj.align(ck.params, hidden, spec, heads="permute").params
    far = lora.extract_lora(ck.params, hidden, ck, lora.LoraOptions(rank=1000))
    out = lora.extract_lora(ck.params, aligned, ck, lora.LoraOptions(rank=1000))
    norm = lambda x: np.sqrt(sum(np.sum(x.delta(n).astype(np.float64) ** 2) for n in x.a))  # noqa: E731
    assert norm(out) < 0.7 * norm(far), (norm(out), norm(far), norm(lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=1000))))
    lora.save_lora(out, tmp_path / "adapter", base_model=str(root / "base"), task_type=lora.task_type(ck))
    merged = peft.PeftModel.from_pretrained(cls.from_pretrained(root / "base").eval(), tmp_path / "adapter").merge_and_unload().eval()
    with torch.no_grad():
        got, want = merged(**_inputs(ck)).logits.numpy(), cls.from_pretrained(root / "tuned").eval()(**_inputs(ck)).logits.numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_a_change_the_adapter_does_not_carry_is_named(pair):
    """Leaves that moved outside every extracted module (left out by a regex, or held by no module
    with a weight, as ViT's class token) are named in a warning; the default plan leaves out nothing else."""
    ck, tuned, _ = pair
    if ck.family == "vit":
        with pytest.warns(UserWarning, match=r"2 leaves changed .* embeddings/cls_token, embeddings/position"):
            lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=2))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=2))
    with pytest.warns(UserWarning, match="the adapter does not carry them"):
        lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=2, exclude=["1"]))
    with warnings.catch_warnings():  # an unchanged leaf left out is no loss
        warnings.simplefilter("error")
        lora.extract_lora(ck.params, ck.params, ck, lora.LoraOptions(rank=2, include=["nothing"], skip_undecomposable=True))


def test_the_writer_never_replaces_a_folder_silently(pair, tmp_path):
    ck, tuned, _ = pair
    out = lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=2))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(PathExists, match="not a PEFT adapter folder"):
        lora.save_lora(out, tmp_path / "mine", base_model="b")
    lora.save_lora(out, tmp_path / "ad", base_model="b")
    with pytest.raises(PathExists, match="pass overwrite=True"):
        lora.save_lora(out, tmp_path / "ad", base_model="b")
    lora.save_lora(out, tmp_path / "ad", base_model="c", overwrite=True)
    assert json.loads((tmp_path / "ad" / "adapter_config.json").read_text())["base_model_name_or_path"] == "c"
    assert sorted(os.listdir(tmp_path)) == ["ad", "mine"]  # no temporary folder left
    with pytest.raises(InputError, match="rank=0"):
        lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(rank=0))


def test_the_command_writes_the_adapter_and_aligns_first(pair, tmp_path, capsys):
    ck, _, root = pair
    argv = ["extract-lora", str(root / "base"), str(root / "tuned"), str(tmp_path / "plain"), "--rank", "3", "--quiet"]
    assert cli.main(argv) == 0
    config = json.loads((tmp_path / "plain" / "adapter_config.json").read_text())
    assert config["r"] == 3 and config["base_model_name_or_path"] == str(root / "base")
    assert cli.main(argv[:3] + [str(tmp_path / "aligned"), "--rank", "3", "--align"]) == 0
    assert "relative error" in capsys.readouterr().out
    assert lora.is_adapter_folder(tmp_path / "aligned")
    with pytest.raises(SystemExit) as e:  # OUT exists: refused before any work
        cli.main(argv)
    assert e.value.code == 2 and "pass --overwrite" in capsys.readouterr().err
    assert cli.main(argv + ["--overwrite"]) == 0


# ---- against mergekit-extract-lora itself (slow) ------------------------------------------------------

def _mergekit_extract(base: Path, tuned: Path, out: Path, *flags: str) -> None:
    script = MERGEKIT / "bin" / "mergekit-extract-lora"
    if not script.exists():
        pytest.fail(f"mergekit is not installed in {MERGEKIT}: `make test-slow` installs it (the reference of this test)")
    env = {**os.environ, "PYTHONPATH": str(MERGEKIT), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(script), "--model", str(tuned), "--base-model", str(base), "--out-path", str(out), *flags],
                         env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


def _tensors(path: Path) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.float32) for k, v in safetensors.numpy.load_file(path / lora.ADAPTER_WEIGHTS).items()}


@pytest.mark.slow
@pytest.mark.parametrize("flags, kwargs", [
    (["--max-rank", "4"], dict(rank=4)),
    (["--max-rank", "6", "--no-distribute-scale", "--sv-epsilon", "0.02"], dict(rank=6, distribute_scale=False, sv_epsilon=0.02)),
    (["--max-rank", "3", "--embed-lora", "-e", "layers?\\.1\\.", "-i", "proj|embed|query|dense"],  # its --save-module fails (a tuple appended to)
     dict(rank=3, embed_lora=True, exclude=["layers?\\.1\\."], include=["proj|embed|query|dense"])),
])
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_the_adapter_is_mergekits(tmp_path_factory, tmp_path, flags, kwargs, family):
    """Our adapter's tensors and config against mergekit-extract-lora's on the same pair (a Llama; a
    BERT with biases); a singular pair's sign is free (NumPy's, torch's and JAX's SVDs each pick one),
    so A's rows and B's columns are compared up to one sign per pair."""
    root = tmp_path_factory.mktemp("mergekit-lora")
    cls, config = CASES[family]
    save_reference(cls, config(), root / "base")
    ck = rj.load_hf(root / "base")
    tuned = _tuned(ck, 2)
    hf.save_hf(ck, tuned, root / "tuned")
    _mergekit_extract(root / "base", root / "tuned", tmp_path / "mergekit", *flags)
    lora.save_lora(lora.extract_lora(ck.params, tuned, ck, lora.LoraOptions(**kwargs)), tmp_path / "ours", base_model=str(root / "base"),
                   task_type=lora.task_type(ck))
    theirs, ours = _tensors(tmp_path / "mergekit"), _tensors(tmp_path / "ours")
    # mergekit drops the biases of modules its architecture file does not list (BERT's MLM head): ours carry them
    known = {"cls.predictions.decoder.bias", "cls.predictions.transform.LayerNorm.bias", "cls.predictions.transform.dense.lora_B.bias"}
    assert set(theirs) <= set(ours) and {n.removeprefix("base_model.model.") for n in set(ours) - set(theirs)} <= (known if family == "bert" else set())
    for name in sorted(n for n in ours if "_A" in n):
        name_b = name.replace("_A", "_B")
        a, b = ours[name], ours[name_b]
        sign = np.sign(np.sum(b * theirs[name_b], axis=0))
        np.testing.assert_allclose(a * sign[:, None], theirs[name], atol=1e-4, err_msg=name)  # a singular vector alone: float32 SVD over a gap
        np.testing.assert_allclose(b * sign, theirs[name_b], atol=1e-4, err_msg=name_b)
        np.testing.assert_allclose(b @ a, theirs[name_b] @ theirs[name], atol=2e-6, err_msg=name)  # well conditioned: tight
    whole = sorted(n for n in theirs if not n.endswith(("_A", "_B", "_A.weight", "_B.weight")))  # kept whole, and the biases' deltas
    assert any(n.endswith("lora_B.bias") for n in whole) == (family == "bert")
    for name in whole:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    want = json.loads((tmp_path / "mergekit" / "adapter_config.json").read_text())
    got = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    for key in ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "lora_dropout"):
        assert got[key] == want[key], key
    assert want["task_type"] == "CAUSAL_LM" and got["task_type"] == lora.task_type(ck)  # ours: CAUSAL_LM for a causal LM only
    assert sorted(got["target_modules"]) == sorted(want["target_modules"])
    assert sorted(got["modules_to_save"]) == sorted(want["modules_to_save"])


@pytest.mark.slow
def test_bfloat16_checkpoints_as_mergekit(tmp_path):
    """bfloat16 checkpoints: the delta taken in bfloat16 (as mergekit subtracts the stored tensors), the
    SVD in float32, the factors saved in bfloat16; each product B A within one bfloat16 rounding of mergekit's."""
    save_reference(tf.LlamaForCausalLM, tf.LlamaConfig(**LLAMA), tmp_path / "base32")
    ck32 = rj.load_hf(tmp_path / "base32")
    hf.save_hf(ck32, ck32.params, tmp_path / "base", dtype="bfloat16")
    hf.save_hf(ck32, _tuned(ck32, 2), tmp_path / "tuned", dtype="bfloat16")
    base, tuned = rj.load_hf(tmp_path / "base"), rj.load_hf(tmp_path / "tuned")
    _mergekit_extract(tmp_path / "base", tmp_path / "tuned", tmp_path / "mergekit", "--max-rank", "4")
    lora.save_lora(lora.extract_lora(base.params, tuned.params, base, lora.LoraOptions(rank=4)), tmp_path / "ours", base_model="base")
    theirs, ours = (safetensors.numpy.load_file(tmp_path / name / lora.ADAPTER_WEIGHTS) for name in ("mergekit", "ours"))
    assert sorted(theirs) == sorted(ours) and {str(v.dtype) for v in ours.values()} == {"bfloat16"}
    for name in (n for n in theirs if n.endswith("lora_A.weight")):
        b = name.replace("_A", "_B")
        want, got = (np.asarray(t[b], np.float32) @ np.asarray(t[name], np.float32) for t in (theirs, ours))
        assert np.abs(got - want).max() <= 2**-8 * np.abs(want).max(), name
    for name in (n for n in theirs if "lora_" not in n):
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
