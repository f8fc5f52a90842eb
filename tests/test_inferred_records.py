"""Records inferred for model types without one (issue 35 ★): a checkpoint whose tensors are exactly
those of one of our records is read with it only once every group that record declares held in
transformers' own model of the checkpoint's type; otherwise it is refused naming the groups that
failed. The proofs run on small models of the real transformers classes (no downloads)."""

import json
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy
import transformers as tf
from parity_utils import save_reference, torch

import rotsym_jax as rj
from rotsym_jax import cli, verify
from rotsym_jax.io.hf import CheckpointError
from rotsym_jax.io.inferred import candidate_records
from rotsym_jax.verify import infer_record

pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _saved(cls, config, folder):
    save_reference(cls, config, folder, seed=0)
    return folder


@pytest.fixture(scope="module")
def cwm(tmp_path_factory):
    """CWM: Llama's tensors, a sliding window on some layers (layer_types: layer 1 here), which no
    group notices (a window masks scores, whatever the heads hold), so Llama's record holds; our
    forward pass is not CWM's. (SmolLM3, the example before, has a record of its own now.)"""
    return _saved(tf.CwmForCausalLM, tf.CwmConfig(**SMALL, head_dim=8, sliding_window=3, layer_types=["full_attention", "sliding_attention"]),
                  tmp_path_factory.mktemp("cwm") / "a")


def _logits(folder, inputs):
    model = tf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(**{k: torch.as_tensor(v) for k, v in inputs.items()}).logits.numpy()


def test_a_model_type_with_llamas_tensors_is_read_as_llama_once_every_group_is_proven(cwm, tmp_path, capsys):
    with pytest.raises(CheckpointError, match="unsupported model_type 'cwm'.*infer_record"):
        rj.load_hf(cwm)
    candidates, why = candidate_records(cwm)
    assert [c.read_as for c in candidates] == ["llama", "mistral", "ministral", "gemma", "granite", "helium", "ernie4_5"] and "qwen3" in why
    record = infer_record(cwm)
    assert (record.read_as, record.stem) == ("llama", "Cwm")
    assert len(record.proven) == 12 and max(record.proven.values()) < 1e-4  # every element kind, invertible Q/K and V/O maps too
    assert rj.InferredRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    ck = rj.load_hf(cwm, record=record)
    with pytest.raises(CheckpointError, match="our forward pass is llama's, not cwm's"):
        ck.apply(ck.params, input_ids=np.ones((1, 3), int))
    # saved back as Cwm, byte for byte
    out = rj.save_hf(ck, ck.params, tmp_path / "saved")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "cwm" and config["architectures"] == ["CwmForCausalLM"]
    from safetensors.numpy import load_file
    a, b = load_file(cwm / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # a planted B, aligned by the command line (which infers the record itself), in memory and streamed
    spec = rj.spec_for(ck)
    moved = rj.apply_transform(spec, ck.params, rj.random_transform(spec, ck.params, jax.random.key(3)))
    planted = rj.save_hf(ck, moved, tmp_path / "b")
    inputs = {"input_ids": np.random.default_rng(0).integers(3, 80, size=(2, 7))}
    want = _logits(cwm, inputs)
    np.testing.assert_allclose(_logits(planted, inputs), want, rtol=0, atol=1e-4 * np.abs(want).max())  # B computes A's function
    assert cli.main(["align", str(cwm), str(planted), str(tmp_path / "aligned"), "--heads", "permute"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "'cwm' has no record of its own; its tensors are llama's" in line]
    assert len(notes) == 1 and notes[0].startswith("A: ")  # proven once for A and B, which share the model type
    report = json.loads((tmp_path / "aligned" / "rotsym_report.json").read_text())["result"]
    assert report["after"]["total"] <= 1e-5 * report["before"]["total"]
    np.testing.assert_allclose(_logits(tmp_path / "aligned", inputs), want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert cli.main(["align", str(cwm), str(planted), str(tmp_path / "streamed"), "--heads", "permute", "--max-memory", "1G", "--quiet"]) == 0
    a, b = load_file(tmp_path / "aligned" / "model.safetensors"), load_file(tmp_path / "streamed" / "model.safetensors")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert cli.main(["inspect", str(cwm)]) == 0
    printed = capsys.readouterr().out
    assert "cwm, read as llama" in printed and json.dumps(record.to_json()) in printed


def test_a_saved_record_given_back_skips_the_proof(cwm, tmp_path, capsys, monkeypatch):
    """The proof costs seconds on every run (the new-user trial: 12-17 s for a command of 1 s):
    the record the note prints, saved and given with --record, reads the model type at once, and
    the run writes what the proven run writes."""
    assert cli.main(["align", str(cwm), str(cwm), str(tmp_path / "proven")]) == 0
    note = next(line for line in capsys.readouterr().err.splitlines() if "has no record of its own" in line)
    saved = tmp_path / "cwm.json"
    saved.write_text(note[note.index("{"):])
    monkeypatch.setattr(verify, "infer_record", lambda *a, **k: pytest.fail("proven again"))
    assert cli.main(["align", str(cwm), str(cwm), str(tmp_path / "given"), "--quiet", "--record", str(saved)]) == 0
    assert "has no record of its own" not in capsys.readouterr().err
    assert (tmp_path / "given" / "model.safetensors").read_bytes() == (tmp_path / "proven" / "model.safetensors").read_bytes()
    other = tmp_path / "other.json"  # a record of another model type is said to read nothing, not ignored in silence
    other.write_text(json.dumps({**json.loads(saved.read_text()), "model_type": "nemotron"}))
    assert cli.main(["align", str(cwm), str(cwm), str(tmp_path / "both"), "--record", str(other), "--record", str(saved)]) == 0
    assert "note: the record given for model_type 'nemotron' reads no model of this run (their types: cwm)" in capsys.readouterr().err
    for text, message in (("{}", "not an inferred record as the note prints it"),
                          (json.dumps({**json.loads(saved.read_text()), "proven": {}}), "its 'proven' is empty")):
        saved.write_text(text)
        with pytest.raises(SystemExit):
            cli.main(["merge", "--method", "average", str(cwm), str(cwm), str(tmp_path / "x"), "--record", str(saved)])
        assert f"--record {saved}: {message}" in capsys.readouterr().err


def test_a_merge_that_moves_no_weight_reads_the_tensors_without_a_proof(cwm, tmp_path, capsys, monkeypatch):
    """A merge without alignment (a mergekit config, --align none) needs the tensors' names and
    shapes, not the groups: it reads them unproven (the trial: 9 s of proof for a 1 s merge), and
    writes the average; an aligning merge still proves."""
    monkeypatch.setattr(verify, "infer_record", lambda *a, **k: pytest.fail("proven for a merge that moves nothing"))
    copy = shutil.copytree(cwm, tmp_path / "copy")
    config = tmp_path / "linear.yml"
    config.write_text(f"models:\n  - model: {cwm}\n    parameters: {{weight: 1}}\n  - model: {copy}\n    parameters: {{weight: 3}}\n"
                      "merge_method: linear\ndtype: float32\n")
    assert cli.main(["merge", str(config), str(tmp_path / "mk")]) == 0
    assert cli.main(["merge", "--method", "average", str(cwm), str(copy), str(tmp_path / "avg"), "--align", "none"]) == 0
    err = capsys.readouterr().err
    assert "its tensors are llama's: read by their names and shapes (its symmetry groups are not proven" in err
    for out in ("mk", "avg"):
        assert json.loads((tmp_path / out / "config.json").read_text())["model_type"] == "cwm"
        want = safetensors.numpy.load_file(cwm / "model.safetensors")
        for name, x in safetensors.numpy.load_file(tmp_path / out / "model.safetensors").items():
            np.testing.assert_allclose(x, want[name], rtol=1e-6, err_msg=name)
    with pytest.raises(pytest.fail.Exception, match="proven for a merge"):
        cli.main(["merge", "--method", "average", str(cwm), str(copy), str(tmp_path / "aligned")])


def test_a_record_whose_groups_do_not_hold_is_refused_naming_them(tmp_path):
    """Youtu has MiniCPM3's tensor names (DeepSeek-V3's MLA in dense layers; past DeepSeek-V3's
    first_k_dense_replace=3 layers, not V3's), but its RoPE turns interleaved pairs (rope_interleave),
    MiniCPM3's rotate_half pairs: the record's QK rotations change its outputs, and no candidate is
    taken (MiniCPM3 and Helium, the examples before, have records of their own now)."""
    config = tf.YoutuConfig(**{**SMALL, "num_key_value_heads": 4, "num_hidden_layers": 4}, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                            qk_rope_head_dim=8, v_head_dim=8)
    folder = _saved(tf.YoutuForCausalLM, config, tmp_path / "youtu")
    with pytest.raises(CheckpointError, match=r"tensors of \['minicpm3'\], but no such record's groups hold.*"
                                              r"as minicpm3: QK rotations change the outputs by"):
        infer_record(folder)
    with pytest.raises(SystemExit):
        cli.main(["inspect", str(folder)])


def test_tensors_of_no_known_layout_are_refused_naming_the_closest(tmp_path):
    """DiffLlama: Llama's names and four scalars more per layer (its differential attention's
    lambdas): no record of ours has exactly its tensors (Nemotron, the example before, has a record now)."""
    folder = _saved(tf.DiffLlamaForCausalLM, tf.DiffLlamaConfig(**SMALL), tmp_path / "diffllama")
    assert candidate_records(folder)[0] == []
    with pytest.raises(CheckpointError, match=r"follow none of our layouts; closest: as \w+ \(\d+% of the names shared\), first difference: "
                                              r"8 unexpected tensors .*self_attn.lambda_"):
        infer_record(folder)


def test_a_layout_sharing_a_name_or_two_is_not_called_close(tmp_path):
    """MPT shares almost no tensor name with ours: such a model (GPT-J, before it had a record) was
    called "closest: as phi3 (0% of the names shared)", with Phi-3's default sizes quoted as if its
    config held them."""
    folder = _saved(tf.MptForCausalLM, tf.MptConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4), tmp_path / "mpt")
    with pytest.raises(CheckpointError, match="no layout of ours holds 20% of its tensor names") as caught:
        infer_record(folder)
    assert "closest" not in str(caught.value)


@pytest.mark.slow  # CWM's test runs the same path by default
def test_a_newer_decoder_is_read_as_the_record_it_extends(tmp_path):
    """Mellum: Qwen3-MoE's tensors (the per-head QK-norm, the mixture in mlp.gate and mlp.experts), sliding windows on
    some layers (which no group notices). (OLMo 3, the example before, has a record of its own now.)"""
    config = tf.MellumConfig(**{**SMALL, "num_hidden_layers": 4}, head_dim=8, sliding_window=3, moe_intermediate_size=16, num_experts=3,
                             num_experts_per_tok=2)
    folder = _saved(tf.MellumForCausalLM, config, tmp_path / "mellum")
    record = infer_record(folder)
    assert record.read_as == "qwen3_moe" and record.stem == "Mellum" and "QK scales" not in record.proven  # the QK-norm: no QK scale


def test_records_are_checked_against_the_checkpoint(cwm):
    record = infer_record(cwm)
    with pytest.raises(CheckpointError, match="inferred record given is for 'helium'"):
        rj.load_hf(cwm, record=rj.InferredRecord("helium", "llama", "Helium"))
    with pytest.raises(ValueError, match="needs strings"):
        rj.InferredRecord.from_json({"model_type": "cwm"})
    assert rj.load_hf(cwm, record=record, weights=False).model_config.record == record
