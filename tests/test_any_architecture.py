"""A merge that moves no weight by a symmetry needs no layout: a checkpoint of an architecture we
have no record for (CodeGen here; BLOOM had that role until it had a record) is read as its tensors alone (`families.tensors`) and
merged tensor by tensor, in memory and streamed; alignment still needs a layout and says how to
merge without. Its config.json is not checked for sizes (the tensors give them): every default
config transformers has is read. tests/test_mergekit.py compares such merges with mergekit itself."""

import json
import warnings

import numpy as np
import pytest
import safetensors.numpy
import transformers as tf

from rotsym_jax import cli
from rotsym_jax.families.tensors import tensors_record
from rotsym_jax.io.hf import read_model_config, supported_model_types

CODEGEN = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch = pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("codegen")
    for i in (1, 2):
        torch.manual_seed(i)
        tf.CodeGenForCausalLM(tf.CodeGenConfig(**CODEGEN)).save_pretrained(root / f"j{i}")
    return root


def _tensors(folder):
    return safetensors.numpy.load_file(folder / "model.safetensors")


def test_a_model_without_a_layout_is_merged_tensor_by_tensor(pair, tmp_path, capsys):
    a, b = pair / "j1", pair / "j2"
    outs = {}
    for how, extra in (("memory", []), ("streamed", ["--max-memory", "1G"])):
        outs[how] = tmp_path / how
        assert cli.main(["merge", "--method", "average", str(a), str(b), str(outs[how]), "--align", "none", *extra]) == 0
    assert "no layout of ours reads it, so it is read as its tensors alone and merged tensor by tensor" in capsys.readouterr().err
    want = {k: (x + _tensors(b)[k]) / 2 for k, x in _tensors(a).items()}
    for how, out in outs.items():
        got = _tensors(out)
        assert got.keys() == want.keys()
        for k, x in want.items():
            np.testing.assert_array_equal(got[k], x, err_msg=f"{how}: {k}")
        assert json.loads((out / "config.json").read_text())["model_type"] == "codegen"
        _, info = tf.CodeGenForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info.values()), info


def test_buffers_are_skipped_and_another_architecture_is_refused_saying_what_differs(pair, tmp_path, capsys):
    """Tensors that are not floating (causal-mask buffers, as old checkpoints saved them) are skipped as the
    families skip theirs; each model is read as its own tensors, and a tensor the anchor lacks or
    another depth is another architecture, said as for the families (not blamed on its config)."""
    folders = {}
    mask = {"transformer.h.0.attn.bias": np.ones((1, 1, 4, 4), bool)}
    for name, extra in (("a", mask), ("b", mask), ("c", {"transformer.extra.weight": np.ones(3, np.float32)})):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        source = pair / ("j1" if name == "a" else "j2")
        (folders[name] / "config.json").write_bytes((source / "config.json").read_bytes())
        safetensors.numpy.save_file({**_tensors(source), **extra}, folders[name] / "model.safetensors", metadata={"format": "pt"})
    assert cli.main(["merge", "--method", "average", str(folders["a"]), str(folders["b"]), str(tmp_path / "ab"), "--align", "none"]) == 0
    assert "transformer.h.0.attn.bias" not in _tensors(tmp_path / "ab")
    assert capsys.readouterr().err.count("read as its tensors alone") == 1  # once per model type, not per model
    with pytest.raises(SystemExit):
        cli.main(["merge", "--method", "average", str(folders["a"]), str(folders["c"]), str(tmp_path / "ac"), "--align", "none"])
    err = capsys.readouterr().err
    assert f"model 1 ({folders['c']}) does not have the architecture of the anchor ({folders['a']}): it has ['transformer.extra.weight']" in err
    deeper = tmp_path / "deeper"
    tf.CodeGenForCausalLM(tf.CodeGenConfig(**{**CODEGEN, "n_layer": 3})).save_pretrained(deeper)
    with pytest.raises(SystemExit):
        cli.main(["merge", "--method", "average", str(pair / "j1"), str(deeper), str(tmp_path / "deep"), "--align", "none"])
    assert f"does not have the architecture of the anchor ({pair / 'j1'}): 3 layers, the anchor ({pair / 'j1'})'s 2" in capsys.readouterr().err


def test_aligning_one_needs_a_layout_and_the_refusal_says_how_to_merge_without(pair, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["merge", "--method", "average", str(pair / "j1"), str(pair / "j2"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "model_type 'codegen' has no record" in err and "a merge without alignment (--align none" in err
    assert not (tmp_path / "out").exists()


# DeBERTa-v3's layout (relative attention, no absolute positions); transformers' default type_vocab_size=0
DEBERTA = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=32,
               relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"], position_biased_input=False, norm_rel_ebd="layer_norm")


def test_deberta_is_merged_without_alignment_in_memory_streamed_and_by_a_mergekit_config(tmp_path, capsys):
    """A DeBERTa-v2 pair as transformers writes it (type_vocab_size=0, its default): the average of
    every tensor, in memory, streamed and by a mergekit config, which transformers loads; read by
    its record (families/deberta.py), which also aligns it (tests/test_conformance.py)."""
    torch = pytest.importorskip("torch")
    for i in (1, 2):
        torch.manual_seed(i)
        tf.DebertaV2ForMaskedLM(tf.DebertaV2Config(**DEBERTA)).save_pretrained(tmp_path / f"d{i}")
    a, b = tmp_path / "d1", tmp_path / "d2"
    assert json.loads((a / "config.json").read_text())["type_vocab_size"] == 0
    mergekit = {"models": [{"model": str(m), "parameters": {"weight": 0.5}} for m in (a, b)], "merge_method": "linear", "dtype": "float32"}
    (tmp_path / "mk.yml").write_text(json.dumps(mergekit))
    average = ["--method", "average", str(a), str(b), "--task-head", "merge"]  # its record's LM head: merged as mergekit merges it
    runs = {"memory": [*average, str(tmp_path / "memory"), "--align", "none"],
            "streamed": [*average, str(tmp_path / "streamed"), "--align", "none", "--max-memory", "1G"],
            "mergekit": [str(tmp_path / "mk.yml"), str(tmp_path / "mergekit")]}
    for args in runs.values():
        assert cli.main(["merge", *args]) == 0
    assert "has no record" not in capsys.readouterr().err
    want = {k: (x + _tensors(b)[k]) / 2 for k, x in _tensors(a).items()}
    for how in runs:
        got = _tensors(tmp_path / how)
        assert got.keys() == want.keys(), how
        model, info = tf.DebertaV2ForMaskedLM.from_pretrained(tmp_path / how, output_loading_info=True)
        assert not any(info.values()), (how, info)
        loaded = model.state_dict()
        for k, x in want.items():
            np.testing.assert_allclose(got[k], x, rtol=0, atol=1e-7, err_msg=f"{how}: {k}")
            np.testing.assert_array_equal(loaded[k].numpy(), got[k], err_msg=f"{how}: {k}")


# Default configs whose model transformers itself cannot build, which their records refuse by name
# (a config that builds, a model that does not): {model type: what the refusal says}.
UNBUILDABLE_DEFAULTS = {"nemotron": "NemotronAttention divides by it",
                        "dots1": "Dots1Config's defaults leave the expert counts None",
                        "ministral": "MinistralAttention reads config.head_dim as it is"}


def test_every_default_config_of_transformers_is_read_by_a_merge_without_alignment(tmp_path):
    """Each model type's default config, as to_dict() gives it and as save_pretrained writes it:
    read as its tensors alone where we have no record of it, else by its family. The few defaults
    transformers itself cannot build (5.24: gemma4_assistant, nougat) are left out; those whose
    config builds but whose model does not (`UNBUILDABLE_DEFAULTS`) are refused saying why."""
    read, refused = 0, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verbosity = tf.logging.get_verbosity()
        tf.logging.set_verbosity_error()  # the defaults' token ids outside their own vocabularies
        try:
            for key, cls in tf.CONFIG_MAPPING.items():
                try:
                    config = cls()
                except Exception:  # noqa: BLE001  (transformers refusing its own default)
                    continue
                for how, raw in (("to_dict", json.loads(json.dumps(config.to_dict(), default=repr))),
                                 ("saved", json.loads(config.to_json_string(use_diff=True)))):
                    model_type = raw.setdefault("model_type", config.model_type)
                    path = tmp_path / f"{key}-{how}.json"
                    path.write_text(json.dumps(raw))
                    try:
                        read_model_config(path, None if model_type in supported_model_types() else tensors_record(model_type, {}))
                        read += 1
                    except Exception as e:  # noqa: BLE001
                        refused[f"{key} ({how})"] = f"{type(e).__name__}: {e}"
        finally:
            tf.logging.set_verbosity(verbosity)
    for key, why in UNBUILDABLE_DEFAULTS.items():
        said = [message for case, message in refused.items() if case.startswith(f"{key} (")]
        assert said and all(why in message for message in said), (key, said)
        refused = {case: message for case, message in refused.items() if not case.startswith(f"{key} (")}
    assert not refused, refused
    assert read > 2 * 300, read  # transformers 5 has some 400 model types
