"""Whisper (model type whisper). The generic contracts (parity of our forward pass, round trip, a
random element of every group kept in transformers, planted recovery, streamed = in memory, aligned
and averaged is A) run on its rows of family_cases.py; here, what is particular: the front end's
channels as a permutation group, every element kind proven in transformers, and what it cannot
read said by name (other frame counts, token ids for features, the one-stack classes)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf
from family_cases import BY_ID, WHISPER, model_inputs, reference
from parity_utils import assert_same_tensor_files, save_reference

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.engine.groups import apply_unchecked
from rotsym_jax.engine.residual import Folds, fixing_ones, nonuniform_gains
from rotsym_jax.pytree import flatten, unflatten
from rotsym_jax.transforms import KINDS, ResidualTransform, random_orthogonal
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")


def test_the_front_ends_channels_are_a_group_and_every_kind_holds_in_transformers(tmp_path):
    """The first convolution's output channels (read by the second through a GELU) permute as a
    group of their own; every element kind keeps the LM's logits in transformers; the stream
    cannot flip signs (LayerNorm) nor rotate under the tied LM head (the decoder's final gain)."""
    save_reference(tf.WhisperForConditionalGeneration, tf.WhisperConfig(**WHISPER), tmp_path / "whisper")
    ck = rj.load_hf(tmp_path / "whisper")
    perms = {p.name: (len(p.layers), p.size) for p in rj.bind(rj.spec_for(ck), ck.params).perms}
    assert perms == {"encoder_conv": (1, 32), "encoder_ffn": (2, 48), "decoder_ffn": (3, 40)}
    checks = {c.element: c for c in verify_groups(tmp_path / "whisper")}
    assert "no gated FFN" in checks.pop("FFN unit scales").note  # a GELU MLP: no unit scales
    rotation, signed = checks.pop("residual rotation"), checks.pop("residual signed permutation")
    assert rotation.difference is None and "through a GELU" in rotation.note  # the encoder's stream (below)
    assert signed.difference is None and "through a GELU" in signed.note
    assert checks["residual permutation"].group == "permutations of encoder_residual, decoder_residual"
    assert all(c.ok and c.difference is not None for c in checks.values()), checks


def _plant(ck, spec, keys):
    """A moved by a random element of every group and each stream's own permutation (`keys`)."""
    t = rj.random_transform(spec, ck.params, jax.random.key(1), KINDS)
    for name, key in keys.items():
        t[name] = rj.random_residual(spec, ck.params, jax.random.key(key), "permutation", name)
    return t


def test_each_stack_is_a_residual_stream_of_its_own(tmp_path):
    """The encoder's stream (its front end's output, positions, layers, final norm, and every
    cross-attention's keys and values, which read it) and the decoder's share no tensor: each is
    a group. Two different permutations keep the logits in transformers; align finds both (the
    plant undone), streamed as in memory to the bit."""
    case = BY_ID["WhisperForConditionalGeneration"]
    model = save_reference(tf.WhisperForConditionalGeneration, tf.WhisperConfig(**WHISPER), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    encoder, decoder = rj.bind(spec, ck.params).streams
    assert (encoder.name, decoder.name) == ("encoder_residual", "decoder_residual")
    on = {s.name: {p for p, _ in s.axes} for s in (encoder, decoder)}
    assert {"decoder/layers/0/cross_attention/key/kernel", "encoder/final_norm/scale", "embeddings/encoder_position/embedding"} <= on["encoder_residual"]
    assert {"decoder/layers/0/cross_attention/query/kernel", "decoder/layers/0/cross_attention/out/kernel", "embeddings/word/embedding"} <= on["decoder_residual"]
    assert not on["encoder_residual"] & on["decoder_residual"]
    t = _plant(ck, spec, {"encoder_residual": 2, "decoder_residual": 3})
    assert not np.array_equal(t["encoder_residual"].perm, t["decoder_residual"].perm)
    b = rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / "b")
    inputs = model_inputs(case, model.config)
    want, got = reference(model, inputs), reference(tf.WhisperForConditionalGeneration.from_pretrained(b).eval(), inputs)
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=0, atol=1e-4 * np.abs(want["logits"]).max())
    np.testing.assert_allclose(got["encoder_last_hidden_state"], want["encoder_last_hidden_state"][..., np.asarray(t["encoder_residual"].perm)],
                               rtol=0, atol=1e-5)
    options = ["--quiet", "--heads", "permute", "--residual", "permutation"]
    assert cli.main(["align", str(tmp_path / "a"), str(b), str(tmp_path / "out"), *options]) == 0
    report = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())["result"]
    assert report["after"]["total"] <= 1e-6 * report["before"]["total"]
    assert report["moved"]["encoder_residual"]["coordinates"] > 0 and report["moved"]["decoder_residual"]["coordinates"] > 0
    assert cli.main(["align", str(tmp_path / "a"), str(b), str(tmp_path / "streamed"), *options, "--max-memory", "3G"]) == 0
    assert_same_tensor_files(tmp_path / "out", tmp_path / "streamed")


def test_the_encoders_stream_cannot_rotate_its_front_end_writes_it_through_a_gelu(tmp_path):
    """A rotation of the encoder's stream (fixing the ones vector, its LayerNorms' gains folded)
    changes the logits in transformers: the second convolution's GELU acts on each coordinate.
    A permutation of it keeps them (the test above); a rotation is refused by name."""
    model = save_reference(tf.WhisperForConditionalGeneration, tf.WhisperConfig(**WHISPER), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    bound = rj.bind(spec, ck.params)
    flat = flatten(ck.params)
    folds = Folds(bound.streams, flat)  # every gain folded, the encoder's too (fold_norms leaves a stream that cannot rotate)
    folded = unflatten({p: folds.leaf(p, x, flat.__getitem__) for p, x in flat.items()})
    assert not nonuniform_gains(bound.streams[0], flatten(folded))  # nothing but the GELU in a rotation's way
    d = WHISPER["d_model"]
    rotation = fixing_ones(random_orthogonal(jax.random.key(4), (), d - 1))
    t = {**rj.random_transform(spec, folded, jax.random.key(1), ()), "encoder_residual": ResidualTransform(jnp.arange(d, dtype=jnp.int32), rotation)}
    inputs = model_inputs(BY_ID["WhisperForConditionalGeneration"], model.config)
    want = reference(model, inputs)["logits"]
    for params, changed in ((folded, False), (apply_unchecked(bound, folded, t), True)):
        got = reference(tf.WhisperForConditionalGeneration.from_pretrained(rj.save_hf(ck, params, tmp_path / str(changed))).eval(), inputs)["logits"]
        assert (np.abs(got - want).max() > 1e-3 * np.abs(want).max()) == changed
    with pytest.raises(rj.RotsymError, match="'encoder_residual': the front end writes it through a GELU"):
        rj.random_residual(spec, folded, jax.random.key(4), "rotation", "encoder_residual")
    with pytest.raises(rj.RotsymError, match="through a GELU"):
        rj.apply_transform(spec, folded, t)


def test_what_it_cannot_read_is_said_by_name(tmp_path):
    save_reference(tf.WhisperModel, tf.WhisperConfig(**WHISPER), tmp_path / "whisper")
    ck = rj.load_hf(tmp_path / "whisper")
    ids = np.ones((2, 5), np.int64)
    with pytest.raises(rj.RotsymError, match="reads input_features"):
        ck.check_batch({"input_ids": ids, "attention_mask": ids})
    with pytest.raises(rj.RotsymError, match="input_features have 12 frames; Whisper reads 20"):
        ck.apply(ck.params, input_features=np.zeros((2, WHISPER["num_mel_bins"], 12), np.float32), decoder_input_ids=ids)
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    tf.WhisperForAudioClassification(tf.WhisperConfig(**WHISPER)).save_pretrained(tmp_path / "classifier")
    with pytest.raises(rj.RotsymError, match="WhisperForAudioClassification"):
        rj.load_hf(tmp_path / "classifier")


def test_what_no_stream_takes_is_refused_with_each_streams_reason(tmp_path):
    """On a model of several streams `residual` is a ceiling; where no stream takes it, the refusal
    gives each stream's reason, in Python as on the command line; a transforms dict naming no
    stream of the model, or a stream draw that names none, is refused by name."""
    save_reference(tf.WhisperForConditionalGeneration, tf.WhisperConfig(**WHISPER), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    both = r"no stream of this model takes it \(encoder_residual: .*GELU.*; decoder_residual: .*\)"
    with pytest.raises(rj.RotsymError, match=both):
        rj.align(ck.params, ck.params, spec, residual="rotation")
    with pytest.raises(SystemExit):
        cli.main(["align", str(tmp_path / "a"), str(tmp_path / "a"), str(tmp_path / "out"), "--residual", "signed_permutation"])
    assert not (tmp_path / "out").exists()
    t = rj.random_transform(spec, ck.params, jax.random.key(1), ())
    with pytest.raises(rj.RotsymError, match=r"transforms\['encoder_resid'\]: no group or residual stream .* 'decoder_residual'"):
        rj.apply_transform(spec, ck.params, {**t, "encoder_resid": rj.random_residual(spec, ck.params, jax.random.key(2), "permutation",
                                                                                          "encoder_residual")})
    with pytest.raises(rj.RotsymError, match="2 residual streams .*: name one"):
        rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
