"""What task heads refuse, and say: a rotation where a head reads the final norm or the model is
post-norm, running a head rotsym_jax reads but does not run, a loss a head cannot give. Every head's
contracts (parity, round trip, invariance, recovery, streaming, merging): test_conformance.py."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import BY_ID, GPT2
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import cli

pytestmark = pytest.mark.usefixtures("float32_models")

WRITTEN = ("GPT2LMHeadModel", "BertForSequenceClassification", "BertForMultipleChoice", "BertForQuestionAnswering", "BertForMaskedLM",
           "BertForTokenClassification")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{class name: (its folder, its transformers model)}, as transformers writes them."""
    root = tmp_path_factory.mktemp("heads")
    return {name: (root / name, save_reference(BY_ID[name].model_class, BY_ID[name].config(), root / name)) for name in WRITTEN}


def test_a_tied_lm_head_keeps_its_final_norm_and_is_untied_for_a_rotation(written, tmp_path):
    """GPT-2's LM head is the token embedding: it reads the final norm, whose gain cannot be folded
    into it without untying. Folding keeps that gain (and the function); `align` refuses a
    rotation with the way out, and `rotsym align` takes it (tests/test_untie.py: the function)."""
    a_folder, _ = written["GPT2LMHeadModel"]
    ck = rj.load_hf(a_folder)
    spec = rj.spec_for(ck)
    folded = rj.fold_norms(spec, ck.params)
    assert np.array_equal(folded["final_norm"]["scale"], ck.params["final_norm"]["scale"])
    assert not np.array_equal(folded["layers"][0]["mlp_norm"]["scale"], ck.params["layers"][0]["mlp_norm"]["scale"])
    with pytest.raises(rj.InputError, match=r"\['final_norm/scale'\] is read by no kernel aligned here: a tied LM head cannot be folded .*untie the head first \(rj.untie"):
        rj.align(folded, folded, spec, residual="rotation")
    assert cli.main(["align", str(a_folder), str(a_folder), str(tmp_path / "out"), "--quiet", "--residual", "rotation"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False


def test_a_post_norm_model_refuses_a_rotation_before_reading_weights(written, tmp_path, capsys, no_weight_reads):
    bert = written["BertForSequenceClassification"][0]
    with pytest.raises(SystemExit):
        cli.main(["align", str(bert), str(bert), str(tmp_path / "out"), "--residual", "rotation"])
    assert "bert: residual='rotation' needs a pre-norm model" in capsys.readouterr().err


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
