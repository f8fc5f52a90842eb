"""Marian and M2M100 (marian, m2m_100): the records whose residual stream stays unmoved. The
generic contracts run on their rows of family_cases.py; here, why the stream is refused (in
transformers: the sinusoids it adds are not what a saved checkpoint carries), that it is refused
by name, and that a MarianMTModel checkpoint of an older writer, which stores the sinusoids, reads."""

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers as tf
from family_cases import MARIAN
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.families import M2M_100
from rotsym_jax.families import MARIAN as MARIAN_RECORD
from rotsym_jax.families.nets.marian import sinusoids

pytestmark = pytest.mark.usefixtures("float32_models")


def test_transformers_saves_no_sinusoids_of_marian_mt_or_m2m100(tmp_path):
    """The reason for the refusal: a permuted position table would not survive a save by transformers."""
    marian = tf.MarianMTModel(tf.MarianConfig(**MARIAN))
    marian.save_pretrained(tmp_path / "marian")
    assert not [n for n in safetensors.numpy.load_file(tmp_path / "marian" / "model.safetensors") if "embed_positions" in n]
    m2m = tf.M2M100ForConditionalGeneration(tf.M2M100Config(**MARIAN))
    assert not [n for n in m2m.state_dict() if "embed_positions" in n]  # a buffer, persistent=False
    # and what transformers adds is the fixed table, whatever the checkpoint's stream basis
    np.testing.assert_allclose(marian.model.encoder.embed_positions.weight.detach().numpy(),
                               sinusoids(MARIAN["max_position_embeddings"], MARIAN["d_model"]), atol=1e-6)


@pytest.mark.parametrize("cls, config", [(tf.MarianMTModel, tf.MarianConfig), (tf.M2M100ForConditionalGeneration, tf.M2M100Config)])
def test_the_stream_is_refused_by_name_and_every_group_else_kept(cls, config, tmp_path):
    save_reference(cls, config(**MARIAN), tmp_path / "m")
    ck = rj.load_hf(tmp_path / "m")
    spec = rj.spec_for(ck)
    assert not spec.streams
    bound = rj.bind(spec, ck.params)
    assert {b.name for b in bound.attention} == {"encoder", "decoder", "cross"}
    assert {p.name for p in bound.perms} == {"encoder_ffn", "decoder_ffn"}
    record = MARIAN_RECORD if cls is tf.MarianMTModel else M2M_100
    (why,) = record.left_out(ck.model_config)
    assert "stays unmoved" in why and "sinusoidal" in why


def test_an_mt_checkpoint_that_stores_its_sinusoids_reads(tmp_path):
    """Older writers stored model.{encoder,decoder}.embed_positions.weight beside MarianMTModel's
    tensors: read (the tables are transformers' buffers), and written back without them."""
    torch.manual_seed(0)
    save_reference(tf.MarianMTModel, tf.MarianConfig(**MARIAN), tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = safetensors.numpy.load_file(path)
    for stack in ("encoder", "decoder"):
        tensors[f"model.{stack}.embed_positions.weight"] = sinusoids(MARIAN["max_position_embeddings"], MARIAN["d_model"]).astype(np.float32)
    safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
    ck = rj.load_hf(tmp_path / "m")
    assert ck.layout.head == "lm"
    out = rj.save_hf(ck, ck.params, tmp_path / "out")
    written = safetensors.numpy.load_file(out / "model.safetensors")
    assert not [n for n in written if "embed_positions" in n]


def test_a_residual_mode_is_refused_with_the_records_reason_and_inspect_says_the_stream_stays(tmp_path, capsys):
    """`--residual permutation` on Marian named no reason ("the built-in families' specs have them",
    untrue of this one), and inspect's options line offered a --residual that align refuses."""
    save_reference(tf.MarianMTModel, tf.MarianConfig(**MARIAN), tmp_path / "a")
    save_reference(tf.MarianMTModel, tf.MarianConfig(**MARIAN), tmp_path / "b", seed=1)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["align", a, b, str(tmp_path / "out"), "--residual", "permutation"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "residual='permutation'" in err and "stays unmoved" in err and "sinusoidal" in err, err
    assert not (tmp_path / "out").exists()
    assert cli.main(["inspect", a]) == 0
    out = capsys.readouterr().out
    assert "residual stream left (no group of this model's record moves it)" in out and "--residual permutation" not in out, out
    ck = rj.load_hf(a)
    with pytest.raises(rj.SpecError, match="this spec has none"):
        rj.align(ck.params, rj.load_hf(b).params, rj.spec_for(ck), residual="permutation")


def test_a_missing_input_is_named_as_for_bart(tmp_path):
    """Marian's forward pass is BART's (`nets.bart.Seq2Seq.__call__`, its own LM head): without the
    encoder's ids it names them, where its own copy of the call raised Python's TypeError."""
    save_reference(tf.MarianMTModel, tf.MarianConfig(**MARIAN), tmp_path / "m")
    ck = rj.load_hf(tmp_path / "m")
    with pytest.raises(rj.RotsymError, match="the inputs lack input_ids: marian reads the encoder's token ids"):
        ck.apply(ck.params, decoder_input_ids=np.ones((2, 5), np.int32))
