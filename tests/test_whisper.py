"""Whisper (model type whisper). The generic contracts (parity of our forward pass, round trip, a
random element of every group kept in transformers, planted recovery, streamed = in memory, aligned
and averaged is A) run on its rows of family_cases.py; here, what is particular: the front end's
channels as a permutation group, every element kind proven in transformers, and what it cannot
read said by name (other frame counts, token ids for features, the one-stack classes)."""

import numpy as np
import pytest
import transformers as tf
from family_cases import WHISPER
from parity_utils import save_reference

import rotsym_jax as rj
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
    assert rotation.difference is None and "['decoder/final_norm/scale']" in rotation.note
    assert signed.difference is None and "LayerNorm" in signed.note
    assert all(c.ok and c.difference is not None for c in checks.values()), checks


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
