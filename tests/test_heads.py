"""Every task head transformers defines for the supported families, read from checkpoints that
transformers writes: a planted symmetry (FFN permutations, per-head rotations, and the residual
stream permuted) keeps the model's outputs in transformers, and `rotsym align` (in memory, with
`--residual permutation`, and streamed) undoes it, writing a folder transformers loads with no
missing or unexpected keys that computes B's outputs. The heads our Flax models run also match
transformers' outputs."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import transformers as tf
from parity_utils import assert_outputs_match, reference_outputs, save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.transforms import RESIDUAL

pytestmark = pytest.mark.usefixtures("float32_models")

TEXT = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, max_position_embeddings=20)
GPT2 = dict(vocab_size=60, n_embd=32, n_layer=2, n_head=4, n_positions=20, pad_token_id=0)
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, image_size=8, patch_size=2,
           num_channels=1, encoder_stride=2)

# class name: (config factory, expected head, runs here)
CASES = {
    "BertForMaskedLM": (lambda: tf.BertConfig(**TEXT), "masked_lm", True),
    "BertForPreTraining": (lambda: tf.BertConfig(**TEXT), "pretraining", False),
    "BertForNextSentencePrediction": (lambda: tf.BertConfig(**TEXT), "next_sentence", True),
    "BertForSequenceClassification": (lambda: tf.BertConfig(**TEXT, num_labels=3), "sequence_classification", True),
    "BertForMultipleChoice": (lambda: tf.BertConfig(**TEXT), "multiple_choice", False),
    "BertForTokenClassification": (lambda: tf.BertConfig(**TEXT, num_labels=5), "token_classification", True),
    "BertForQuestionAnswering": (lambda: tf.BertConfig(**TEXT), "question_answering", True),
    "BertLMHeadModel": (lambda: tf.BertConfig(**TEXT, is_decoder=True), "lm", False),
    "RobertaForMaskedLM": (lambda: tf.RobertaConfig(**TEXT, tie_word_embeddings=False), "masked_lm", True),  # an untied decoder
    "RobertaForCausalLM": (lambda: tf.RobertaConfig(**TEXT, is_decoder=True), "lm", False),
    "RobertaForSequenceClassification": (lambda: tf.RobertaConfig(**TEXT, num_labels=3), "sequence_classification", True),
    "RobertaForMultipleChoice": (lambda: tf.RobertaConfig(**TEXT), "multiple_choice", False),
    "RobertaForTokenClassification": (lambda: tf.RobertaConfig(**TEXT, num_labels=5), "token_classification", True),
    "RobertaForQuestionAnswering": (lambda: tf.RobertaConfig(**TEXT), "question_answering", True),
    "GPT2LMHeadModel": (lambda: tf.GPT2Config(**GPT2), "lm", True),
    "GPT2DoubleHeadsModel": (lambda: tf.GPT2Config(**GPT2), "double_heads", False),
    "GPT2ForSequenceClassification": (lambda: tf.GPT2Config(**GPT2, num_labels=3), "sequence_classification", True),
    "GPT2ForTokenClassification": (lambda: tf.GPT2Config(**GPT2, num_labels=5), "token_classification", True),
    "GPT2ForQuestionAnswering": (lambda: tf.GPT2Config(**GPT2), "question_answering", True),
    "GPTNeoXForCausalLM": (lambda: tf.GPTNeoXConfig(**TEXT, rotary_pct=0.25, pad_token_id=0), "lm", True),
    "GPTNeoXForSequenceClassification": (lambda: tf.GPTNeoXConfig(**TEXT, num_labels=3, pad_token_id=0, use_parallel_residual=False),
                                         "sequence_classification", True),
    "GPTNeoXForTokenClassification": (lambda: tf.GPTNeoXConfig(**TEXT, num_labels=5), "token_classification", True),
    "GPTNeoXForQuestionAnswering": (lambda: tf.GPTNeoXConfig(**TEXT), "question_answering", True),
    "LlamaForCausalLM": (lambda: tf.LlamaConfig(**TEXT, num_key_value_heads=2, pad_token_id=0), "lm", True),
    "LlamaForSequenceClassification": (lambda: tf.LlamaConfig(**TEXT, num_key_value_heads=2, num_labels=3, pad_token_id=0),
                                       "sequence_classification", True),
    "LlamaForTokenClassification": (lambda: tf.LlamaConfig(**TEXT, num_key_value_heads=2, num_labels=5), "token_classification", True),
    "Qwen2ForQuestionAnswering": (lambda: tf.Qwen2Config(**TEXT, num_key_value_heads=2), "question_answering", True),
    "Phi3ForCausalLM": (lambda: tf.Phi3Config(**TEXT, num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1,
                                              eos_token_id=2), "lm", True),
    "Phi3ForSequenceClassification": (lambda: tf.Phi3Config(**TEXT, num_labels=3, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                                      "sequence_classification", True),
    # QK-norm: the planted QK element is sign flips of rotary pairs (MATH §9)
    "Qwen3ForCausalLM": (lambda: tf.Qwen3Config(**TEXT, num_key_value_heads=2, head_dim=16, attention_bias=True), "lm", True),
    "Qwen3ForSequenceClassification": (lambda: tf.Qwen3Config(**TEXT, num_key_value_heads=2, num_labels=3, pad_token_id=0),
                                       "sequence_classification", True),
    "Qwen3ForQuestionAnswering": (lambda: tf.Qwen3Config(**TEXT, num_key_value_heads=2), "question_answering", True),
    "MistralForQuestionAnswering": (lambda: tf.MistralConfig(**TEXT, num_key_value_heads=2), "question_answering", True),
    # Gemma: 1 + w gains, sqrt(d) embedding scale, a tied LM head
    "GemmaForCausalLM": (lambda: tf.GemmaConfig(**TEXT, num_key_value_heads=2, head_dim=16), "lm", True),
    "GemmaForSequenceClassification": (lambda: tf.GemmaConfig(**TEXT, num_key_value_heads=1, head_dim=8, num_labels=3),
                                       "sequence_classification", True),
    "GemmaForTokenClassification": (lambda: tf.GemmaConfig(**TEXT, num_key_value_heads=4, num_labels=5, head_dim=8), "token_classification", True),
    # Gemma 2: sandwich norms (the stream takes signed permutations, not rotations), soft-capping
    "Gemma2ForCausalLM": (lambda: tf.Gemma2Config(**TEXT, num_key_value_heads=2, head_dim=16, sliding_window=3, attn_logit_softcapping=2.0,
                                                  final_logit_softcapping=3.0), "lm", True),
    "Gemma2ForSequenceClassification": (lambda: tf.Gemma2Config(**TEXT, num_key_value_heads=1, head_dim=8, num_labels=3),
                                        "sequence_classification", True),
    "Gemma2ForTokenClassification": (lambda: tf.Gemma2Config(**TEXT, num_key_value_heads=4, head_dim=8, num_labels=5), "token_classification", True),
    # Gemma 3 (text): QK-norm, sandwich norms, a RoPE base per layer type
    "Gemma3ForCausalLM": (lambda: tf.Gemma3TextConfig(**TEXT, num_key_value_heads=2, head_dim=16, sliding_window=3, sliding_window_pattern=2),
                          "lm", True),
    "Gemma3TextForSequenceClassification": (lambda: tf.Gemma3TextConfig(**TEXT, num_key_value_heads=1, head_dim=8, num_labels=3),
                                            "sequence_classification", True),
    # OLMo-2: norms on the sublayers' outputs only (signed permutations of the stream), QK-norm over all heads
    "Olmo2ForCausalLM": (lambda: tf.Olmo2Config(**TEXT, num_key_value_heads=2, attention_bias=True, pad_token_id=0, eos_token_id=1), "lm", True),
    "Olmo2ForSequenceClassification": (lambda: tf.Olmo2Config(**TEXT, num_labels=3, pad_token_id=0, eos_token_id=1),
                                       "sequence_classification", True),
    "OlmoeForCausalLM": (lambda: tf.OlmoeConfig(**TEXT, num_key_value_heads=2, num_experts=3, num_experts_per_tok=2, pad_token_id=0,
                                                 eos_token_id=1), "lm", True),
    # Mixtures of experts: the experts (and the router's outputs) permuted, each expert's units too
    "MixtralForCausalLM": (lambda: tf.MixtralConfig(**TEXT, num_key_value_heads=2, num_local_experts=4), "lm", True),
    "MixtralForSequenceClassification": (lambda: tf.MixtralConfig(**TEXT, num_key_value_heads=2, num_local_experts=3, num_labels=3,
                                                                  pad_token_id=0), "sequence_classification", True),
    "MixtralForTokenClassification": (lambda: tf.MixtralConfig(**TEXT, num_key_value_heads=2, num_labels=5), "token_classification", True),
    "MixtralForQuestionAnswering": (lambda: tf.MixtralConfig(**TEXT, num_key_value_heads=2), "question_answering", True),
    "Qwen3MoeForCausalLM": (lambda: tf.Qwen3MoeConfig(**TEXT, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=24, attention_bias=True), "lm", True),
    "Qwen3MoeForSequenceClassification": (lambda: tf.Qwen3MoeConfig(**TEXT, num_key_value_heads=2, num_experts=3, num_experts_per_tok=2,
                                                                    num_labels=3, pad_token_id=0), "sequence_classification", True),
    "Qwen3MoeForTokenClassification": (lambda: tf.Qwen3MoeConfig(**TEXT, num_key_value_heads=2, num_experts=3, num_experts_per_tok=1,
                                                                 norm_topk_prob=True, num_labels=5), "token_classification", True),
    "Qwen3MoeForQuestionAnswering": (lambda: tf.Qwen3MoeConfig(**TEXT, num_key_value_heads=2, num_experts=3, num_experts_per_tok=2),
                                     "question_answering", True),
    "ViTForImageClassification": (lambda: tf.ViTConfig(**VIT, num_labels=3), "image_classification", True),
    "ViTForMaskedImageModeling": (lambda: tf.ViTConfig(**VIT), "masked_image_modeling", False),
}


def _inputs(name: str, config) -> dict:
    if name.startswith("ViT"):
        return {"pixel_values": np.random.default_rng(0).normal(size=(2, 1, 8, 8)).astype(np.float32)}
    ids, mask = token_batch(config.vocab_size, batch=2, length=7, lo=3)
    if "MultipleChoice" in name:  # (batch, choices, tokens)
        return {"input_ids": np.stack([ids, ids[::-1]], axis=1), "attention_mask": np.stack([mask, mask[::-1]], axis=1)}
    return {"input_ids": ids, "attention_mask": mask}


def _outputs(model, inputs) -> dict:
    """Every float output of the transformers model, padding positions zeroed (unspecified there)."""
    out = reference_outputs(model, **inputs)
    mask = inputs.get("attention_mask")
    for key, x in out.items():
        if mask is not None and x.shape[: mask.ndim] == mask.shape:
            out[key] = np.where(mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim)).astype(bool), x, 0.0)
    return out


def _assert_same_outputs(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), what
    for key in want:
        scale = max(float(np.abs(want[key]).max()), 1e-3)
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-4 * scale, err_msg=f"{what}: {key}")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{class name: (A's folder, A's transformers model)}: A written by transformers."""
    root = tmp_path_factory.mktemp("heads")
    out = {}
    for name, (config, _, _) in CASES.items():
        cls = getattr(tf, name)
        out[name] = (root / name, save_reference(cls, config(), root / name, seed=0))
    return out


def _planted(folder: Path, out: Path, residual: bool | str, seed: int = 1) -> Path:
    """B: A moved by a random element of its symmetry group (FFN permutations, per-head QK and VO
    rotations, and with `residual` a permutation of the residual stream, or with "rotation" A's
    norms folded and the stream rotated), saved."""
    ck = rj.load_hf(folder)
    spec = rj.spec_for(ck)
    params = rj.fold_norms(spec, ck.params) if residual == "rotation" else ck.params
    t = rj.random_transform(spec, params, jax.random.key(seed), ("perm", "qk", "vo"))
    if residual:
        t[RESIDUAL] = rj.random_residual(spec, params, jax.random.key(seed + 1), "rotation" if residual == "rotation" else "permutation")
    return rj.save_hf(ck, rj.apply_transform(spec, params, t), out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_head_reads_saves_and_aligns_keeping_its_function(name, written, tmp_path):
    a_folder, a_model = written[name]
    _, head, runs = CASES[name]
    cls = getattr(tf, name)
    ck = rj.load_hf(a_folder)
    assert (ck.layout.head, ck.runs_head) == (head, runs)
    inputs = _inputs(name, a_model.config)
    want = _outputs(a_model, inputs)
    for residual in (False, True):
        b = _planted(a_folder, tmp_path / f"b-{residual}", residual)
        b_model = cls.from_pretrained(b, attn_implementation="eager").eval()
        _assert_same_outputs(_outputs(b_model, inputs), want, f"B planted (residual={residual}) in transformers")
        out = tmp_path / f"out-{residual}"
        argv = ["align", str(a_folder), str(b), str(out), "--quiet"] + (["--residual", "permutation"] if residual else [])
        assert cli.main(argv) == 0
        moved, info = cls.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
        assert not any(info.values()), info
        _assert_same_outputs(_outputs(moved.eval(), inputs), want, f"B aligned (residual={residual}) in transformers")
        report = json.loads((out / "rotsym_report.json").read_text())["result"]
        assert report["after"]["total"] <= 1e-4 * report["before"]["total"], "the plant was not undone"


# Pre-norm heads whose final norm no tied LM head reads: the residual stream may rotate (MATH §8).
ROTATABLE = sorted(n for n in CASES if n.startswith(("GPT2", "GPTNeoX", "Llama", "Phi3", "Qwen2", "Qwen3", "Mistral", "Mixtral", "Gemma", "ViT"))
                   and n not in ("GPT2LMHeadModel", "GPT2DoubleHeadsModel", "GemmaForCausalLM") and not n.startswith(("Gemma2", "Gemma3")))


@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n.startswith(("GPT2", "ViT")) else [pytest.mark.slow]) for n in ROTATABLE])
def test_every_prenorm_head_keeps_its_function_under_a_residual_rotation(name, written, tmp_path):
    """B: A folded, every group and the residual stream rotated (for LayerNorm, a rotation fixing
    the ones vector): transformers computes A's outputs, and `rotsym align --residual rotation`
    undoes it into a folder transformers loads, with the same outputs."""
    a_folder, a_model = written[name]
    cls = getattr(tf, name)
    inputs = _inputs(name, a_model.config)
    want = _outputs(a_model, inputs)
    b = _planted(a_folder, tmp_path / "b", "rotation")
    _assert_same_outputs(_outputs(cls.from_pretrained(b, attn_implementation="eager").eval(), inputs), want, "B rotated in transformers")
    out = tmp_path / "out"
    assert cli.main(["align", str(a_folder), str(b), str(out), "--quiet", "--residual", "rotation", "--heads", "permute"]) == 0
    moved, info = cls.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info
    _assert_same_outputs(_outputs(moved.eval(), inputs), want, "B aligned in transformers")
    report = json.loads((out / "rotsym_report.json").read_text())["result"]
    assert report["after"]["total"] <= 1e-4 * report["before"]["total"], "the plant was not undone"


def test_a_tied_lm_head_keeps_its_final_norm_and_refuses_a_rotation(written, tmp_path, capsys):
    """GPT-2's LM head is the token embedding: it reads the final norm, whose gain cannot be folded
    into it without untying. Folding keeps that gain (and the function); a rotation is refused
    with the reason, as a post-LN BERT's is."""
    a_folder, _ = written["GPT2LMHeadModel"]
    ck = rj.load_hf(a_folder)
    folded = rj.fold_norms(rj.spec_for(ck), ck.params)
    assert np.array_equal(folded["final_norm"]["scale"], ck.params["final_norm"]["scale"])
    assert not np.array_equal(folded["layers"][0]["mlp_norm"]["scale"], ck.params["layers"][0]["mlp_norm"]["scale"])
    with pytest.raises(SystemExit):
        cli.main(["align", str(a_folder), str(a_folder), str(tmp_path / "out"), "--quiet", "--residual", "rotation"])
    assert "['final_norm/scale'] read by a tied LM head cannot be folded" in capsys.readouterr().err


def test_a_post_norm_model_refuses_a_rotation_before_reading_weights(written, tmp_path, capsys, no_weight_reads):
    bert = written["BertForSequenceClassification"][0]
    with pytest.raises(SystemExit):
        cli.main(["align", str(bert), str(bert), str(tmp_path / "out"), "--residual", "rotation"])
    assert "bert: residual='rotation' needs a pre-norm model" in capsys.readouterr().err


# The default run's time budget: families whose groups the older ones already exercise stream and
# merge in the slow run (their own groups and heads are checked above and in their test files).
SLOW_HEADS = ("GPTNeoX", "Phi3", "Qwen3", "Mixtral", "Gemma", "Olmo")


def _by_budget(names):
    return [pytest.param(n, marks=[pytest.mark.slow] if n.startswith(SLOW_HEADS) else []) for n in names]


@pytest.mark.parametrize("name", _by_budget(sorted(CASES)))
def test_every_head_streams_as_in_memory(name, written, tmp_path):
    a_folder, _ = written[name]
    b = _planted(a_folder, tmp_path / "b", residual=False)
    assert cli.main(["align", str(a_folder), str(b), str(tmp_path / "memory"), "--quiet"]) == 0
    assert cli.main(["align", str(a_folder), str(b), str(tmp_path / "stream"), "--quiet", "--max-memory", "3G"]) == 0
    files = [hf.TensorFiles(tmp_path / f) for f in ("memory", "stream")]
    try:
        assert files[0].names() == files[1].names()
        assert all(np.array_equal(files[0].read(n), files[1].read(n)) for n in files[0].names())
    finally:
        for f in files:
            f.close()


@pytest.mark.parametrize("name", sorted(n for n, (_, _, runs) in CASES.items() if runs))
def test_the_heads_that_run_here_match_transformers(name, written):
    a_folder, a_model = written[name]
    ck = rj.load_hf(a_folder)
    inputs = _inputs(name, a_model.config)
    ref = reference_outputs(a_model, **inputs)
    ours = ck.apply(ck.params, **inputs)
    keys = [k for k in ("logits", "start_logits", "end_logits") if k in ref]
    assert keys and all(k in ours for k in keys)
    valid = inputs["attention_mask"].astype(bool) if "attention_mask" in inputs else None
    assert_outputs_match(ours, ref, keys, valid=valid, min_ref_std=0.05)


def test_heads_not_run_here_are_named_where_logits_are_needed(written, tmp_path, capsys, no_weight_reads):
    folder, _ = written["BertForMultipleChoice"]
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": "a b", "label": 0}) + "\n")
    recipe = tmp_path / "fisher.yaml"
    recipe.write_text(json.dumps({"models": [str(folder), str(folder)], "method": "fisher", "data": {"file": str(texts)}}))
    named = "the 'multiple_choice' head is read, aligned, merged and saved, but rotsym_jax does not run it"

    for argv in (["barrier", folder, folder, "--data", texts, "--out", tmp_path / "curves"], ["merge", recipe, tmp_path / "merged"]):
        with pytest.raises(SystemExit):  # before any weight is read
            cli.main([str(a) for a in argv])
        assert named in capsys.readouterr().err
    ck = rj.load_hf(folder, weights=False)
    with pytest.raises(rj.CheckpointError, match=named):
        rj.stats.fisher(ck, ck.params, [{"input_ids": np.ones((1, 3), int), "labels": np.zeros(1, int)}])
    with pytest.raises(rj.CheckpointError, match="not built here"):
        rj.init_checkpoint(ck.model_config, jax.random.key(0), head="multiple_choice", pooler=True)


@pytest.mark.parametrize("name", _by_budget(sorted(CASES)))
def test_every_head_merges_after_alignment(name, written, tmp_path):
    """A and a planted copy of it, aligned and averaged: A again (the head is the anchor's), a
    folder transformers loads as A's class."""
    a_folder, a_model = written[name]
    b = _planted(a_folder, tmp_path / "b", residual=False)
    assert cli.main(["merge", "--method", "average", str(a_folder), str(b), str(tmp_path / "merged"), "--quiet"]) == 0
    merged, info = getattr(tf, name).from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not any(info.values()), info
    for key, x in a_model.state_dict().items():
        np.testing.assert_allclose(merged.state_dict()[key].numpy(), x.numpy(), atol=1e-4, err_msg=key)


def test_losses_refuse_what_they_cannot_score(written, tmp_path, capsys):
    """Question answering runs but gives start and end logits, not one distribution: no loss or
    Fisher here. A masked LM needs masked inputs, token classification per-token labels."""
    qa = rj.load_hf(written["BertForQuestionAnswering"][0])
    with pytest.raises(rj.CheckpointError, match="'question_answering' head runs, but gives no one distribution of logits"):
        rj.stats.fisher(qa, qa.params, [{"input_ids": np.ones((1, 3), int), "labels": np.zeros((1, 3), int)}])
    batch = [{"input_ids": np.full((2, 4), 5), "attention_mask": np.ones((2, 4), int), "labels": np.zeros(2, int)}]
    with pytest.raises(rj.recipe.RecipeError, match="'masked_lm' head predicts masked tokens"):
        rj.recipe.loss_fn(rj.load_hf(written["BertForMaskedLM"][0]), batch)
    with pytest.raises(rj.recipe.RecipeError, match=r"labels has shape \(2,\); expected \(2, 4\).* \(per token: each example's label a list of 4 label ids"):
        rj.recipe.loss_fn(rj.load_hf(written["BertForTokenClassification"][0]), batch)
    tokens = rj.recipe.loss_fn(rj.load_hf(written["BertForTokenClassification"][0]), [{**batch[0], "labels": np.zeros((2, 4), int)}])
    assert np.isfinite(float(tokens(rj.load_hf(written["BertForTokenClassification"][0]).params)))
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": "a b", "label": 0}) + "\n")
    with pytest.raises(SystemExit):
        cli.main(["barrier", str(written["BertForTokenClassification"][0]), str(written["BertForSequenceClassification"][0]),
                  "--data", str(texts), "--out", str(tmp_path / "curves")])
    assert "A has a 'token_classification' head and B a 'sequence_classification' head" in capsys.readouterr().err
    assert cli.main(["inspect", str(written["BertForMultipleChoice"][0])]) == 0
    assert "head multiple_choice (read, aligned, merged and saved; not run here)" in capsys.readouterr().out


def test_residual_alignment_of_a_model_without_a_head_says_what_moves(tmp_path, capsys):
    bare = tmp_path / "bare"
    save_reference(tf.GPT2Model, tf.GPT2Config(**GPT2), bare)
    assert cli.main(["align", str(bare), str(bare), str(tmp_path / "out"), "--residual", "permutation"]) == 0
    assert "note: B has no task head, so with --residual the last hidden state comes out in the aligned basis" in capsys.readouterr().err
