"""Mixtures of experts from dense models (`rotsym moe`, mergekit-moe's configs): the output loaded
by transformers' MixtralForCausalLM, its tensors taken from the base and the experts, the gates
against their formulas written out here with transformers' own forward pass, refusals by key and
line before any weight is read, experts aligned onto the base, and (slow) every deterministic gate
mode against mergekit-moe 0.1.5 itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.io.recipe import RecipeError
from rotsym_jax.merging import moe
from rotsym_jax.moe_pipeline import build, moe_to_disk
from rotsym_jax.pipeline import PipelineError
from rotsym_jax.pytree import flatten
from rotsym_jax.transforms import KINDS

pytestmark = pytest.mark.usefixtures("float32_models")

ROOT = Path(__file__).resolve().parent.parent
MERGEKIT = ROOT / ".mergekit"
LAYERS, D, F, VOCAB = 2, 32, 48, 64


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """Checkpoints transformers wrote: a Llama base, three Llamas of other inits, a tokenizer each
    (BOS t2, a special token), and a GPT-2."""
    torch = pytest.importorskip("torch")
    import tokenizers
    import transformers

    root = tmp_path_factory.mktemp("moe-dense")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t1", bos_token="t2", eos_token="t3")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=F, num_hidden_layers=LAYERS, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64)
    out = {}
    for i, name in enumerate(("base", "e1", "e2", "e3")):
        torch.manual_seed(i)
        model = transformers.LlamaForCausalLM(config)
        with torch.no_grad():  # gains away from 1: a test that swaps two models' norms must see it
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.add_(0.3 * torch.randn_like(p))
        out[name] = root / name
        model.save_pretrained(out[name])
        fast.save_pretrained(out[name])
    qwen3 = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=D, intermediate_size=F, num_hidden_layers=LAYERS, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, max_position_embeddings=64)
    for i, name in enumerate(("q_base", "q1", "q2", "q3"), 4):
        torch.manual_seed(i)
        out[name] = root / name
        transformers.Qwen3ForCausalLM(qwen3).save_pretrained(out[name])
        fast.save_pretrained(out[name])
    mistral = transformers.MistralConfig(**{**config.to_dict(), "model_type": "mistral", "sliding_window": 4})
    for i, name in enumerate(("m_base", "m1", "m2"), 8):
        torch.manual_seed(i)
        out[name] = root / name
        transformers.MistralForCausalLM(mistral).save_pretrained(out[name])
        fast.save_pretrained(out[name])
    torch.manual_seed(9)
    out["gpt2"] = root / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=D, n_layer=LAYERS, n_head=4, n_positions=32)).save_pretrained(out["gpt2"])
    return out


PROMPTS = [
    {"positive_prompts": ["t5 t6 t7", "t8 t9"], "negative_prompts": ["t10 t11 t12 t13"]},
    {"positive_prompts": ["t20 t21"]},
    {"positive_prompts": ["t30 t31 t32 t33 t34", "t35"], "residual_scale": 0.5},
]


def _config(tmp_path, dense, mode="cheap_embed", experts=("e1", "e2", "e3"), name="moe.yml", base="base", **extra) -> Path:
    raw = {"base_model": str(dense[base]), "gate_mode": mode, "dtype": "float32",
           "experts": [{"source_model": str(dense[e]), **p} for e, p in zip(experts, PROMPTS)], **extra}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _state(folder) -> dict:
    from safetensors.numpy import load_file

    return load_file(Path(folder) / "model.safetensors")


def _left_padded(tokenizer, texts):
    """mergekit-moe's tokenization: BOS text before each prompt, no special tokens added, BOS padding on the left."""
    rows = [tokenizer(tokenizer.bos_token + t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = np.array([[tokenizer.bos_token_id] * (width - len(r)) + r for r in rows])
    return ids, np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows])


def _normalised(x):
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-8)


def _per_expert(summary) -> list:
    """Each expert's gate from `summary(texts)`: its positive prompts' minus its negative ones' (none: nothing), normalised."""
    return [_normalised(summary(p["positive_prompts"]) - (summary(p["negative_prompts"]) if p.get("negative_prompts") else 0))
            for p in PROMPTS]


def _hidden_gates_by_hand(folder) -> np.ndarray:
    """(L, E, d): transformers' float32 hidden states at each layer's input (hidden_states[:-1]), at
    the last token, averaged over an expert's prompts, minus its negative prompts', normalised."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def mean_state(texts):
        ids, mask = _left_padded(tokenizer, texts)
        with torch.no_grad():
            out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True)
        return torch.stack(out.hidden_states[:-1])[:, :, -1].mean(1).numpy()  # (L, d)

    return np.stack(_per_expert(mean_state), 1)


def _cheap_embed_gates_by_hand(folder) -> np.ndarray:
    """(L, E, d): the embedding rows of every token of an expert's prompts summed and normalised,
    its negative prompts' likewise subtracted, normalised again; the same in every layer."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    table = _state(folder)["model.embed_tokens.weight"].astype(np.float64)

    def summed(texts):
        ids, mask = _left_padded(tokenizer, texts)
        return _normalised((table[ids] * mask[..., None]).sum((0, 1)))

    return np.broadcast_to(np.stack(_per_expert(summed)), (LAYERS, len(PROMPTS), D))


def _routers(state) -> np.ndarray:
    return np.stack([state[f"model.layers.{i}.mlp.gate.weight"] for i in range(LAYERS)])


# ---- the output -------------------------------------------------------------------------------------

def test_output_is_a_mixtral_transformers_runs_made_of_the_base_and_the_experts(tmp_path, dense):
    """config.json is a Mixtral of 3 experts of top 2; every tensor outside the FFNs is the base's;
    expert e's stacked gate/up and down are its model's FFN (down times residual_scale); our forward
    pass of the output gives transformers' logits."""
    import torch
    import transformers

    out, report = moe_to_disk(_config(tmp_path, dense), tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["num_local_experts"], config["num_experts_per_tok"]) == \
        ("mixtral", ["MixtralForCausalLM"], 3, 2)
    assert config["sliding_window"] is None and config["rope_parameters"]["rope_theta"] == 10000.0  # the base's, not Mixtral's default
    state, base = _state(out), _state(dense["base"])
    for name, tensor in base.items():
        if ".mlp." not in name:
            np.testing.assert_array_equal(state[name], tensor, err_msg=name)
    for e, (expert, p) in enumerate(zip(("e1", "e2", "e3"), PROMPTS)):
        theirs = _state(dense[expert])
        for i in range(LAYERS):
            mlp = f"model.layers.{i}.mlp"
            want = np.concatenate([theirs[f"{mlp}.gate_proj.weight"], theirs[f"{mlp}.up_proj.weight"]])
            np.testing.assert_array_equal(state[f"{mlp}.experts.gate_up_proj"][e], want)
            np.testing.assert_allclose(state[f"{mlp}.experts.down_proj"][e], theirs[f"{mlp}.down_proj.weight"] * p.get("residual_scale", 1.0),
                                       rtol=1e-7)
    assert (out / "tokenizer.json").is_file() and (out / "mergekit_moe_config.yml").is_file()
    assert json.loads((out / "rotsym_report.json").read_text())["result"]["gate_mode"] == "cheap_embed"

    model = transformers.MixtralForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 7))
    with torch.no_grad():
        want = model(input_ids=torch.tensor(ids)).logits.numpy()
    ours = rj.load_hf(out)
    got = np.asarray(ours.apply(ours.params, input_ids=ids, attention_mask=np.ones_like(ids))["logits"])
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_hidden_gates_are_the_base_models_hidden_states_by_the_formula(tmp_path, dense):
    out, _ = moe_to_disk(_config(tmp_path, dense, "hidden"), tmp_path / "out")
    np.testing.assert_allclose(_routers(_state(out)), _hidden_gates_by_hand(dense["base"]), atol=2e-6)


def test_cheap_embed_gates_are_the_summed_embeddings_by_the_formula(tmp_path, dense):
    out, _ = moe_to_disk(_config(tmp_path, dense, "cheap_embed"), tmp_path / "out")
    np.testing.assert_allclose(_routers(_state(out)), _cheap_embed_gates_by_hand(dense["base"]), atol=2e-6)


def test_random_gates_come_from_the_seed_and_their_distribution(dense, tmp_path):
    base = rj.load_hf(dense["base"])
    a = np.asarray(moe.gate_vectors("random", base, base.params, 3, key=jax.random.key(0)))
    b = np.asarray(moe.gate_vectors("random", base, base.params, 3, key=jax.random.key(0)))
    c = np.asarray(moe.gate_vectors("random", base, base.params, 3, key=jax.random.key(1)))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (LAYERS, 3, D) and not np.allclose(a, c)
    assert abs(a.std() - 1) < 0.15 and abs(a.mean()) < 0.15  # standard normal, as torch.randn
    u = np.asarray(moe.gate_vectors("uniform_random", base, base.params, 3, key=jax.random.key(0)))
    assert np.abs(u).max() <= 1 / np.sqrt(D) and np.abs(u).max() > 0.8 / np.sqrt(D)  # U(-1/sqrt(d), 1/sqrt(d)): nn.Linear's init
    _, params, run = build(moe.load(_config(tmp_path, dense, "random")), seed=5)
    assert run["result"]["seed"] == 5
    np.testing.assert_array_equal(np.asarray(flatten(params)["layers/1/moe/router/kernel"]),
                                  np.asarray(moe.random_gates(jax.random.split(jax.random.key(5))[0], "random", (LAYERS, 3, D)))[1].T)


def test_noise_is_drawn_from_the_seed_then_the_residual_scale_applied(tmp_path, dense):
    cfg = _config(tmp_path, dense, experts=("e1", "e2", "e3"))
    raw = yaml.safe_load(cfg.read_text())
    raw["experts"][2]["noise_scale"] = 0.1
    cfg.write_text(yaml.safe_dump(raw))
    (_, first, _), (_, again, _) = build(moe.load(cfg), seed=3), build(moe.load(cfg), seed=3)
    down = np.asarray(flatten(first)["layers/0/moe/down/kernel"][2])
    np.testing.assert_array_equal(down, np.asarray(flatten(again)["layers/0/moe/down/kernel"][2]))
    dense_down = np.asarray(flatten(rj.load_hf(dense["e3"]).params)["layers/0/mlp/down/kernel"])
    noise = down / 0.5 - dense_down  # (x + noise) * residual_scale
    assert 0.08 < noise.std() < 0.12
    np.testing.assert_array_equal(np.asarray(flatten(first)["layers/0/moe/down/kernel"][0]),
                                  np.asarray(flatten(rj.load_hf(dense["e1"]).params)["layers/0/mlp/down/kernel"]))  # no noise_scale: none


# ---- alignment --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moved(dense, tmp_path_factory):
    """The base moved by a random element of every group and a residual permutation: the same
    function, other weights."""
    base = rj.load_hf(dense["base"])
    spec = rj.spec_for(base)
    t = rj.random_transform(spec, base.params, jax.random.key(2), KINDS)
    t["residual"] = rj.random_residual(spec, base.params, jax.random.key(3), "permutation")
    return rj.save_hf(base, rj.apply_transform(spec, base.params, t), tmp_path_factory.mktemp("moved") / "moved")


def test_aligned_experts_read_the_bases_stream_and_averaging_recovers_the_base(tmp_path, dense, moved):
    """Experts that are the base moved by the symmetries: unaligned (mergekit's), their FFNs read
    another basis than the base's stream; aligned (residual permutation), each is the base's FFN
    again, and the shared tensors averaged over the aligned models are the base's."""
    dense = {**dense, "m1": moved, "m2": moved}
    cfg = _config(tmp_path, dense, experts=("m1", "base"),
                  rotsym={"align": True, "align_options": {"residual": "permutation", "heads": "permute"}, "shared": "average"})
    base = flatten(rj.load_hf(dense["base"]).params)
    _, aligned, run = build(moe.load(cfg))
    _, plain, _ = build(moe.load(cfg), align=False)
    aligned, plain = flatten(aligned), flatten(plain)
    for which in ("gate", "up", "down"):
        want = np.asarray(base[f"layers/1/mlp/{which}/kernel"])
        np.testing.assert_allclose(np.asarray(aligned[f"layers/1/moe/{which}/kernel"][0]), want, atol=1e-6)
        assert not np.allclose(np.asarray(plain[f"layers/1/moe/{which}/kernel"][0]), want, atol=1e-2)
    for path in ("layers/0/attention/query/kernel", "layers/1/attention_norm/scale", "embeddings/word/embedding", "lm_head/kernel"):
        np.testing.assert_allclose(np.asarray(aligned[path]), np.asarray(base[path]), atol=1e-6, err_msg=path)
    assert run["result"]["alignment"]["distances"][str(moved)]["after"] < 1e-4


def test_alignment_from_activations_runs_on_the_configs_data(tmp_path, dense, moved):
    """align_options.method activations reads rotsym.data (texts tokenized by the base's tokenizer):
    the moved base's FFN is found again; without data it is refused by name."""
    rng = np.random.default_rng(0)
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"text": " ".join(f"t{i}" for i in rng.integers(4, VOCAB, 12))}) + "\n"
                                                  for _ in range(64)))
    options = {"method": "activations", "residual": "permutation", "heads": "permute"}
    cfg = _config(tmp_path, {**dense, "m1": moved}, experts=("m1", "e1"),
                  rotsym={"align": True, "align_options": options, "data": {"file": "texts.jsonl", "max_length": 14}})
    _, aligned, run = build(moe.load(cfg))
    base = flatten(rj.load_hf(dense["base"]).params)
    np.testing.assert_allclose(np.asarray(flatten(aligned)["layers/1/moe/down/kernel"][0]), np.asarray(base["layers/1/mlp/down/kernel"]),
                               atol=1e-5)
    assert run["result"]["alignment"]["options"]["method"] == "activations"
    raw = yaml.safe_load(cfg.read_text())
    raw["rotsym"].pop("data")
    with pytest.raises(PipelineError, match="align_options.method activations: it runs the models on data; give rotsym.data"):
        build(moe.load(_write(tmp_path, raw)))


@pytest.mark.parametrize("residual", ["permutation", "rotation"])
def test_a_mixture_of_the_base_and_the_base_moved_computes_the_base_once_aligned(tmp_path, dense, moved, residual):
    """Every expert the base's FFN (the moved base aligned back, and the base): whatever the routers
    weigh, the mixture is the dense base, logit for logit; unaligned (mergekit's) it is not. With a
    rotation every gain is folded first and the routers carry the base's, so they read as before."""
    import torch
    import transformers

    cfg = _config(tmp_path, {**dense, "m1": moved}, experts=("m1", "base"))
    ids = np.random.default_rng(2).integers(0, VOCAB, (2, 7))
    with torch.no_grad():
        want = transformers.LlamaForCausalLM.from_pretrained(dense["base"], dtype=torch.float32)(input_ids=torch.tensor(ids)).logits.numpy()

    def logits(ck, params):
        return np.asarray(ck.apply(params, input_ids=ids, attention_mask=np.ones_like(ids))["logits"])

    ck, params, _ = build(moe.load(cfg), align=True, align_options={"residual": residual, "heads": "permute"})
    np.testing.assert_allclose(logits(ck, params), want, atol=1e-4)
    ck, params, _ = build(moe.load(cfg), align=False)
    assert np.abs(logits(ck, params) - want).max() > 1e-2


def test_a_residual_rotation_folds_the_gains_and_keeps_the_routers_reading(tmp_path, dense):
    """residual: rotation folds every model's gains (the output's norms are ones); the routers then
    carry the base's FFN-norm gains, so that the routing logits are those of the unaligned mixture."""
    cfg = _config(tmp_path, dense, experts=("e1", "e2"))
    _, plain, _ = build(moe.load(cfg))
    _, rotated, _ = build(moe.load(cfg), align=True, align_options={"residual": "rotation"})
    plain, rotated = flatten(plain), flatten(rotated)
    np.testing.assert_allclose(np.asarray(rotated["layers/1/mlp_norm/scale"]), 1.0, atol=1e-6)
    gain = np.asarray(plain["layers/1/mlp_norm/scale"])
    np.testing.assert_allclose(np.asarray(rotated["layers/1/moe/router/kernel"]), np.asarray(plain["layers/1/moe/router/kernel"]) * gain[:, None],
                               atol=1e-6)


# ---- refusals -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"shared_experts": [{"source_model": "x"}]}, "line 19: shared_experts: shared experts make Qwen2-MoE"),
    ({"architecture": "deepseek"}, "architecture: 'deepseek'; rotsym writes mergekit-moe's ['Mixtral', 'Qwen3 MoE'] outputs"),
    ({"gate_mode": "hidden_avg"}, "gate_mode: 'hidden_avg'; expected one of"),
    ({"experts_per_token": 4}, "3 experts and experts_per_token 4"),
    ({"dtype": "int8"}, "dtype: 'int8'; expected one of"),
    ({"gate_mode": ["hidden"]}, "gate_mode: ['hidden']; expected one of"),
    ({"experts": ("e1",), "experts_per_token": 1}, "every expert has the same positive"),  # one expert: mergekit refuses it
    ({"merge_experts": True}, "line 19: unknown key 'merge_experts'"),
    ({"rotsym": {"align": "yes"}}, "rotsym.align = 'yes'; expected true or false"),
    ({"rotsym": {"align": True, "align_options": {"residual": "twist"}}}, "rotsym.align_options.residual"),
    ({"rotsym": {"shared": "mean"}}, "rotsym.shared = 'mean'"),
])
def test_what_is_not_run_is_refused_by_key_and_line_before_any_weight_is_read(tmp_path, dense, change, message):
    cfg = _config(tmp_path, dense, **change)
    with pytest.raises(RecipeError, match=re.escape(message)):
        moe.load(cfg)


def test_mergekits_own_refusals_and_paths(tmp_path, dense):
    cfg = _config(tmp_path, dense, "hidden")
    raw = yaml.safe_load(cfg.read_text())
    bad = {**raw, "experts": [{**e, "positive_prompts": ["t5"], "negative_prompts": []} for e in raw["experts"]]}
    with pytest.raises(RecipeError, match="every expert has the same positive and negative prompts"):
        moe.load(_write(tmp_path, bad))
    same = {**raw, "experts": [{**e, "source_model": str(dense["e1"])} for e in raw["experts"]]}
    with pytest.raises(RecipeError, match="every expert is the model"):
        moe.load(_write(tmp_path, same))
    assert len(moe.load(_write(tmp_path, same), allow_all_same=True).experts) == 3
    silent = {**raw, "experts": [{"source_model": str(dense["e1"])}, *raw["experts"][1:]]}
    with pytest.raises(RecipeError, match=r"line 5: experts\[0\].positive_prompts: gate_mode hidden needs"):
        moe.load(_write(tmp_path, silent))
    assert moe.load(_write(tmp_path, {**silent, "gate_mode": "random"})).gate_mode == "random"  # random needs no prompts
    hub = {**raw, "base_model": "mistralai/Mistral-7B-v0.1"}
    with pytest.raises(RecipeError, match="a Hub id"):
        moe.load(_write(tmp_path, hub))
    assert moe.load(_write(tmp_path, {**raw, "gate_mode": "hidden_last"})).gate_mode == "hidden"


def _write(tmp_path, raw) -> Path:
    path = tmp_path / "changed.yml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_models_no_output_is_made_of_are_refused_by_name(tmp_path, dense):
    with pytest.raises(PipelineError, match=r"gpt2: model_type 'gpt2', the base's 'llama'"):
        build(moe.load(_config(tmp_path, dense, experts=("e1", "gpt2"))))
    with pytest.raises(PipelineError, match=r"base: model_type 'llama': architecture 'qwen': rotsym writes Qwen3 MoE of \['qwen3'\] models"):
        build(moe.load(_config(tmp_path, dense, architecture="qwen")))
    with pytest.raises(PipelineError, match=r"gpt2: model_type 'gpt2': rotsym writes Mixtral of \['llama', 'mistral'\]"):
        build(moe.load(_config(tmp_path, dense, base="gpt2", experts=("e1", "e2"))))


def test_mistral_models_make_a_mixtral_without_their_window(tmp_path, dense):
    """mergekit writes no sliding window into the Mixtral of Mistral models: every token attends to
    all before it, in transformers and in our forward pass alike."""
    import torch
    import transformers

    out, _ = moe_to_disk(_config(tmp_path, dense, experts=("m1", "m2"), base="m_base"), tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"], config["num_local_experts"]) == ("mixtral", None, 2)
    model = transformers.MixtralForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = np.random.default_rng(1).integers(0, VOCAB, (2, 9))  # longer than the dense models' window of 4
    with torch.no_grad():
        want = model(input_ids=torch.tensor(ids)).logits.numpy()
    ours = rj.load_hf(out)
    np.testing.assert_allclose(np.asarray(ours.apply(ours.params, input_ids=ids, attention_mask=np.ones_like(ids))["logits"]), want, atol=2e-5)


def test_qwen3_models_make_a_qwen3_moe_transformers_runs(tmp_path, dense):
    """Qwen3 dense models make mergekit-moe's Qwen3 MoE: config.json's keys as mergekit sets them,
    the base's QK norms kept, our forward pass giving transformers' logits."""
    import torch
    import transformers

    out, report = moe_to_disk(_config(tmp_path, dense, "hidden", experts=("q1", "q2", "q3"), base="q_base"), tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["num_local_experts"], config["moe_intermediate_size"], config["norm_topk_prob"],
            config["decoder_sparse_step"]) == ("qwen3_moe", ["Qwen3MoeForCausalLM"], 3, F, True, 1)
    assert report["result"]["output"] == "Qwen3 MoE"
    state, base = _state(out), _state(dense["q_base"])
    np.testing.assert_array_equal(state["model.layers.1.self_attn.q_norm.weight"], base["model.layers.1.self_attn.q_norm.weight"])
    np.testing.assert_array_equal(state["model.layers.1.mlp.experts.down_proj"][1], _state(dense["q2"])["model.layers.1.mlp.down_proj.weight"])
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 7))
    with torch.no_grad():
        want = model(input_ids=torch.tensor(ids)).logits.numpy()
    ours = rj.load_hf(out)
    np.testing.assert_allclose(np.asarray(ours.apply(ours.params, input_ids=ids, attention_mask=np.ones_like(ids))["logits"]), want, atol=2e-5)


@pytest.mark.parametrize("mode", ["hidden", "cheap_embed", "random"])
def test_a_streamed_run_writes_the_same_tensors(tmp_path, dense, mode):
    """max_memory: each output tensor computed from the tensors read for it, the same bytes as the
    in-memory run (residual_scale and noise_scale too); too little memory is refused with the numbers."""
    cfg = _config(tmp_path, dense, mode)
    raw = yaml.safe_load(cfg.read_text())
    raw["experts"][1]["noise_scale"] = 0.05
    cfg = _write(tmp_path, raw)
    moe_to_disk(cfg, tmp_path / "memory", seed=7)
    _, report = moe_to_disk(cfg, tmp_path / "streamed", seed=7, max_memory=2**30)
    assert report["result"]["streamed"] and report["result"]["seed"] == 7
    memory, streamed = _state(tmp_path / "memory"), _state(tmp_path / "streamed")
    assert sorted(memory) == sorted(streamed)
    for name, tensor in memory.items():
        np.testing.assert_array_equal(streamed[name], tensor, err_msg=name)
    assert json.loads((tmp_path / "streamed" / "config.json").read_text()) == json.loads((tmp_path / "memory" / "config.json").read_text())
    with pytest.raises(PipelineError, match=r"max_memory 1,000 bytes: the largest step needs about [\d,]+"):
        moe_to_disk(cfg, tmp_path / "small", max_memory=1000)
    with pytest.raises(PipelineError, match="a streamed mixture is not aligned"):
        moe_to_disk(cfg, tmp_path / "aligned", align=True, max_memory=2**30)


# ---- the command line -------------------------------------------------------------------------------

def test_the_command_line_runs_a_config_and_refuses_what_it_cannot(tmp_path, dense, capsys):
    cfg = _config(tmp_path, dense, "cheap_embed")
    assert cli.main(["moe", str(cfg), str(tmp_path / "out"), "--quiet"]) == 0
    report = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())
    assert report["command"].startswith("rotsym moe") and report["device"] and "rotsym_jax" in report["versions"]
    assert (tmp_path / "out" / "mergekit_moe_config.yml").read_text() == cfg.read_text()
    with pytest.raises(SystemExit):
        cli.main(["moe", str(cfg), str(tmp_path / "out")])  # exists
    assert "exists; pass --overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["moe", str(cfg), str(tmp_path / "other"), "--residual", "rotation"])
    assert "--residual: alignment options need alignment" in capsys.readouterr().err
    assert cli.main(["moe", str(cfg), str(tmp_path / "aligned"), "--align", "--residual", "permutation", "--quiet"]) == 0
    assert cli.main(["moe", str(cfg), str(tmp_path / "default"), "--align", "--quiet"]) == 0  # the stream rotated unless told
    options = json.loads((tmp_path / "default" / "rotsym_report.json").read_text())["result"]["alignment"]["options"]
    assert (options["residual"], options["heads"]) == ("rotation", "permute")
    assert cli.main(["moe", str(cfg), str(tmp_path / "streamed"), "--max-memory", "1G", "--quiet"]) == 0
    assert json.loads((tmp_path / "streamed" / "rotsym_report.json").read_text())["options"]["max_memory"] == 2**30
    report = json.loads((tmp_path / "aligned" / "rotsym_report.json").read_text())
    assert report["result"]["alignment"]["options"]["residual"] == "permutation"
    with pytest.raises(SystemExit):
        cli.main(["merge", str(cfg), str(tmp_path / "merged")])
    assert "rotsym moe CONFIG.yml OUT runs it" in capsys.readouterr().err


# ---- against mergekit-moe (slow) ------------------------------------------------------------------------

def _run_mergekit_moe(config: Path, out: Path) -> subprocess.CompletedProcess:
    script = MERGEKIT / "bin" / "mergekit-moe"
    if not script.is_file():
        pytest.fail(f"mergekit is not installed in {MERGEKIT}: `make test-slow` installs it (the reference of these tests)")
    env = {**os.environ, "PYTHONPATH": str(MERGEKIT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(script), str(config), str(out), "--random-seed", "0"], env=env, capture_output=True,
                          text=True)


# mergekit runs the base in bfloat16 for hidden gates: unit vectors within a few bfloat16 roundings
GATE_TOLERANCE = {"hidden": 1e-2, "cheap_embed": 2e-6}


@pytest.mark.slow
@pytest.mark.parametrize("mode, family", [("hidden", "llama"), ("cheap_embed", "llama"), ("random", "llama"), ("hidden", "qwen3"),
                                          ("cheap_embed", "qwen3"), ("hidden", "mistral")])
def test_the_same_tensors_as_mergekit_moe(tmp_path, dense, mode, family):
    """Every tensor mergekit-moe writes (Mixtral from Llamas, Qwen3 MoE from Qwen3s), ours by the same
    name and shape: equal outside the routers; the routers within the tolerance of the mode (random
    ones: drawn from torch's generator there, from the seed here, so only their shapes are compared)."""
    experts, base = {"llama": (("e1", "e2", "e3"), "base"), "qwen3": (("q1", "q2", "q3"), "q_base"), "mistral": (("m1", "m2"), "m_base")}[family]
    cfg = _config(tmp_path, dense, mode, experts, base=base)
    run = _run_mergekit_moe(cfg, tmp_path / "mergekit")
    assert run.returncode == 0, run.stderr[-3000:]
    moe_to_disk(cfg, tmp_path / "ours")
    theirs, ours = _state(tmp_path / "mergekit"), _state(tmp_path / "ours")
    assert sorted(theirs) == sorted(ours)
    for name, tensor in theirs.items():
        assert ours[name].shape == tensor.shape and ours[name].dtype == tensor.dtype, name
        if name.endswith("mlp.gate.weight"):
            if mode in GATE_TOLERANCE:
                np.testing.assert_allclose(ours[name], tensor, atol=GATE_TOLERANCE[mode], err_msg=name)
        else:
            np.testing.assert_allclose(ours[name], tensor, rtol=1e-7, atol=0, err_msg=name)
    config, want = (json.loads((tmp_path / f / "config.json").read_text()) for f in ("ours", "mergekit"))
    for key in ("model_type", "architectures", "num_local_experts", "num_experts", "num_experts_per_tok", "sliding_window", "hidden_size",
                "intermediate_size", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "num_hidden_layers",
                "num_key_value_heads", "rms_norm_eps", "rope_parameters", "dtype", "head_dim"):
        assert config.get(key) == want.get(key), key
