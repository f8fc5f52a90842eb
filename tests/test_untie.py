"""Tied LM heads under a rotation of the residual stream (MATH §10): `rj.untie` gives the head its
own kernel, which takes the final norm's gain, and the pipelines untie where a rotation meets a
tied head (in memory and streamed, the gains folded as each tensor is read), all checked in
transformers, which must load every output and compute the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from family_cases import BY_ID, model_inputs, reference
from parity_utils import save_reference
from safetensors import safe_open

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.pytree import flatten
from rotsym_jax.streaming._source import Source
from rotsym_jax.timings import Clock
from rotsym_jax.transforms import RESIDUAL

pytestmark = pytest.mark.usefixtures("float32_models")

# GPT-2 (LayerNorm: rotations fixing the ones vector, the final norm's bias kept as beta / g before a
# bias-free head) and a tied Llama in the default run; the other tied heads in the slow one.
TIED = [pytest.param(c, id=c) for c in ("GPT2LMHeadModel", "LlamaForCausalLM[gqa-tied]")] + [
    pytest.param(c, id=c, marks=pytest.mark.slow)
    for c in ("Qwen2ForCausalLM[tied]", "GemmaForCausalLM", "Phi3ForCausalLM[tied]", "GPTNeoXForCausalLM[tied-no-bias]")]


class Pair:
    """A as transformers writes it (tied), its logits, and B: A untied, folded, and moved by a random
    element of every group and a random rotation of the stream (saved untied)."""

    def __init__(self, case_id: str, root: Path):
        self.case = BY_ID[case_id]
        self.a = root / "a"
        model = save_reference(self.case.model_class, self.case.config(), self.a)
        self.inputs = model_inputs(self.case, model.config)
        self.logits = reference(model, self.inputs)["logits"]
        ck = rj.load_hf(self.a)
        self.untied = rj.untie(ck)
        spec = rj.spec_for(self.untied)
        folded = rj.fold_norms(spec, self.untied.params)
        t = rj.random_transform(spec, folded, jax.random.key(1), ("perm", "qk", "vo"))
        t[RESIDUAL] = rj.random_residual(spec, folded, jax.random.key(2), "rotation")
        self.b = rj.save_hf(self.untied, rj.apply_transform(spec, folded, t), root / "b")

    def assert_computes_a(self, folder: Path, what: str):
        model, info = self.case.model_class.from_pretrained(folder, attn_implementation="eager", output_loading_info=True)
        assert not any(info.values()), (what, info)
        got = reference(model.eval(), self.inputs)["logits"]
        np.testing.assert_allclose(got, self.logits, rtol=0, atol=1e-4 * float(np.abs(self.logits).max()), err_msg=what)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    made = {}

    def pair(case_id: str) -> Pair:
        if case_id not in made:
            made[case_id] = Pair(case_id, tmp_path_factory.mktemp("untie"))
        return made[case_id]
    return pair


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _tensor(folder: Path, name: str) -> np.ndarray:
    with safe_open(folder / "model.safetensors", "np") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("case_id", TIED)
def test_untied_and_rotated_the_model_computes_the_same_logits(case_id, pairs, tmp_path):
    """The untied head is the embedding as transformers stores it, and transformers loads the
    untied checkpoint with every key (the function kept); B, rotated after folding, too."""
    pair = pairs(case_id)
    ck = rj.load_hf(pair.a)
    untied = pair.untied
    assert untied.model_config.tie_word_embeddings is False and ck.model_config.tie_word_embeddings is True
    assert rj.untie(untied) is untied  # nothing tied: as it is
    (head, target), = hf.family_of(ck.model_config).tied(ck.model_config, ck.layout).items()
    saved = rj.save_hf(untied, untied.params, tmp_path / "untied")
    assert _config(saved)["tie_word_embeddings"] is False
    embedding = next(r.hf for r in hf.family_of(ck.model_config).tensors(ck.model_config, ck.layout) if target in r.ours)
    assert np.array_equal(_tensor(saved, head), _tensor(pair.a, embedding))
    pair.assert_computes_a(saved, "untied")
    pair.assert_computes_a(pair.b, "untied, folded, every group and the stream rotated")


@pytest.mark.parametrize("case_id", TIED)
def test_align_with_a_rotated_stream_unties_the_head_and_undoes_the_rotation(case_id, pairs, tmp_path):
    """A tied, B untied and rotated: `rotsym align --residual rotation` unties A's head too, undoes
    the rotation, and writes an untied B that transformers runs; streamed, the same to float32
    rounding; the report and card say what untying cost."""
    pair = pairs(case_id)
    flags = ["--residual", "rotation", "--heads", "permute", "--quiet"]
    memory, streamed = tmp_path / "memory", tmp_path / "streamed"
    assert cli.main(["align", str(pair.a), str(pair.b), str(memory), *flags]) == 0
    assert cli.main(["align", str(pair.a), str(pair.b), str(streamed), *flags, "--max-memory", "4G"]) == 0
    embedding = pair.untied.params["embeddings"]["word"]["embedding"]
    for out in (memory, streamed):
        assert _config(out)["tie_word_embeddings"] is False
        pair.assert_computes_a(out, str(out.name))
        result = json.loads((out / "rotsym_report.json").read_text())["result"]
        assert result["before"]["total"] > 1.0, "nothing was planted"
        assert result["after"]["total"] <= 1e-4 * result["before"]["total"], "the rotation was not undone"
        assert result["untied"]["bytes"] == embedding.size * 4
        assert "## Untied LM head" in (out / "README.md").read_text()
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=1e-5), rj.load_hf(memory).params, rj.load_hf(streamed).params)


@pytest.mark.parametrize("case_id", TIED)
def test_merged_after_a_rotation_is_a_again(case_id, pairs, tmp_path):
    """B is A rotated: A and B aligned with a rotation and averaged compute A's logits, in memory,
    streamed, and through a mergekit config with rotsym's alignment on top."""
    pair = pairs(case_id)
    flags = ["--residual", "rotation", "--heads", "permute", "--quiet"]
    assert cli.main(["merge", "--method", "average", str(pair.a), str(pair.b), str(tmp_path / "memory"), *flags]) == 0
    assert cli.main(["merge", "--method", "average", str(pair.a), str(pair.b), str(tmp_path / "streamed"), *flags, "--max-memory", "4G"]) == 0
    config = tmp_path / "linear.yml"
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {pair.a}\n    parameters: {{weight: 0.5}}\n"
                      f"  - model: {pair.b}\n    parameters: {{weight: 0.5}}\ndtype: float32\n")
    assert cli.main(["merge", str(config), str(tmp_path / "mergekit"), "--align", "anchor", *flags]) == 0
    for name in ("memory", "streamed", "mergekit"):
        pair.assert_computes_a(tmp_path / name, f"merged ({name})")
        assert _config(tmp_path / name)["tie_word_embeddings"] is False


def test_a_permutation_keeps_the_tie_and_tied_meets_untied_untied(pairs, tmp_path, capsys):
    """Only a rotation needs the head untied: a permuted stream keeps the tie (the gain permuted).
    A tied model merged with an untied one (B aligned by a rotation) is untied, which is said: the
    merged head is the mean of A's embedding and B's head, and transformers loads it."""
    pair = pairs("LlamaForCausalLM[gqa-tied]")
    permuted = tmp_path / "permuted"
    assert cli.main(["align", str(pair.a), str(pair.a), str(permuted), "--residual", "permutation", "--quiet"]) == 0
    assert _config(permuted)["tie_word_embeddings"] is True
    with safe_open(permuted / "model.safetensors", "np") as f:
        assert "lm_head.weight" not in f.keys()
    aligned = tmp_path / "aligned"
    capsys.readouterr()
    assert cli.main(["align", str(pair.a), str(pair.b), str(aligned), "--residual", "rotation", "--dry-run"]) == 0
    assert "is untied from the token embedding" in capsys.readouterr().out  # a dry run says what the run will change
    assert cli.main(["align", str(pair.a), str(pair.b), str(aligned), "--residual", "rotation", "--heads", "permute", "--quiet"]) == 0
    capsys.readouterr()
    assert cli.main(["merge", "--method", "average", "--align", "none", str(pair.a), str(aligned), str(tmp_path / "merged")]) == 0
    assert "the other models store their heads untied" in capsys.readouterr().err
    merged = tmp_path / "merged"
    want = (_tensor(pair.a, "model.embed_tokens.weight") + _tensor(aligned, "lm_head.weight")) / 2
    np.testing.assert_allclose(_tensor(merged, "lm_head.weight"), want, rtol=0, atol=1e-6)
    _, info = pair.case.model_class.from_pretrained(merged, output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize("case_id", ["GPT2LMHeadModel", "LlamaForCausalLM[gqa-tied]",
                                     pytest.param("GemmaForCausalLM", marks=pytest.mark.slow)])
def test_streamed_reads_fold_as_fold_norms_does(case_id, pairs):
    """A streamed run with a rotation reads every tensor folded (the gains, GPT-2's LayerNorm biases
    moved into the readers' biases or kept as beta / g, Gemma's 1 + w) as `fold_norms` leaves the
    whole model: the same bits. The untied head is read from the embedding's stored tensor."""
    pair = pairs(case_id)
    untied = pair.untied
    want = {p: np.asarray(x) for p, x in flatten(rj.fold_norms(rj.spec_for(untied), untied.params)).items()}
    source = Source(rj.untie(rj.load_hf(pair.a, weights=False)), "A", fold=True)
    try:
        got = source.leaves(list(source.rules), Clock(), device=False)
    finally:
        source.close()
    assert set(got) == set(want)
    changed = [p for p in want if not np.array_equal(want[p], np.asarray(flatten(untied.params)[p]))]
    assert len(changed) > 4
    for path in want:
        assert np.array_equal(got[path], want[path]), path


def test_a_head_stored_apart_under_a_tied_config_is_read_as_transformers_computes(pairs, tmp_path, capsys):
    """A tied Llama saved with an LM head of its own values (transformers 5 warns, keeps the two
    apart and computes with the head): read as the untied model, with a warning; `rotsym align`
    with a rotation, in memory and streamed, writes it untied and keeps the logits transformers
    computes from the folder as stored."""
    import safetensors.numpy
    import torch

    pair = pairs("LlamaForCausalLM[gqa-tied]")
    apart = tmp_path / "apart"
    apart.mkdir()
    (apart / "config.json").write_text((pair.a / "config.json").read_text())
    tensors = safetensors.numpy.load_file(pair.a / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embedding + np.random.default_rng(0).normal(scale=0.1, size=embedding.shape).astype(np.float32)
    safetensors.numpy.save_file(tensors, apart / "model.safetensors", metadata={"format": "pt"})
    model = pair.case.model_class.from_pretrained(apart, attn_implementation="eager")
    assert torch.equal(model.lm_head.weight, torch.from_numpy(tensors["lm_head.weight"]))  # transformers computes with the copy
    want = reference(model.eval(), pair.inputs)["logits"]
    assert np.abs(want - pair.logits).max() > 1e-2, "the head's values changed nothing"

    with pytest.warns(UserWarning, match=r"read apart, as transformers computes with them, and saved with tie_word_embeddings: false"):
        ck = rj.load_hf(apart)
    assert ck.model_config.tie_word_embeddings is False
    mask = pair.inputs["attention_mask"][..., None]  # (transformers' padding positions are zeroed)
    got = np.asarray(ck.apply(ck.params, **{k: np.asarray(v) for k, v in pair.inputs.items()})["logits"]) * mask
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())

    flags = ["--residual", "rotation", "--heads", "permute", "--quiet"]
    for out, budget in ((tmp_path / "memory", []), (tmp_path / "streamed", ["--max-memory", "4G"])):
        capsys.readouterr()
        assert cli.main(["align", str(pair.b), str(apart), str(out), *flags, *budget]) == 0
        assert "read apart, as transformers computes with them" in capsys.readouterr().err
        assert _config(out)["tie_word_embeddings"] is False
        moved, info = pair.case.model_class.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
        assert not any(info.values()), info
        np.testing.assert_allclose(reference(moved.eval(), pair.inputs)["logits"], want, rtol=0, atol=1e-4 * np.abs(want).max(),
                                   err_msg=out.name)
