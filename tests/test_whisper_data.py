"""Found by a new-user trial: the data methods on WhisperForConditionalGeneration. An .npz of
input_features alone leaked Python's TypeError (its decoder's ids are required: Whisper makes
none); with them, the first convolution's channels (group encoder_conv) had no site, refused after
the data was read and run. That site is now the second convolution's input (the GELU's output),
read here in transformers by a hook; a plant of every group and of both streams is undone from
activations (streamed as in memory, to the bit) and learned keeps B's function; a missing input of
every encoder-decoder is named, never a TypeError."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers as tf
from family_cases import BART, T5, WHISPER
from parity_utils import assert_same_tensor_files, save_reference

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.engine import activations
from rotsym_jax.options import AlignOptions
from rotsym_jax.streaming._statistics import data_tokens
from rotsym_jax.transforms import KINDS

pytestmark = pytest.mark.usefixtures("float32_models")
FRAMES = 2 * WHISPER["max_source_positions"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A, B = A moved by a random element of every group and a permutation of each stream (saved
    through transformers), an .npz of features with the decoder's ids, and one of features alone."""
    root = tmp_path_factory.mktemp("whisper_data")
    model = save_reference(tf.WhisperForConditionalGeneration, tf.WhisperConfig(**WHISPER), root / "a")
    ck = rj.load_hf(root / "a")
    spec = rj.spec_for(ck)
    t = rj.random_transform(spec, ck.params, jax.random.key(1), KINDS)
    for name, key in (("encoder_residual", 2), ("decoder_residual", 3)):
        t[name] = rj.random_residual(spec, ck.params, jax.random.key(key), "permutation", name)
    rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), root / "b")
    rng = np.random.default_rng(0)
    features = rng.normal(size=(16, WHISPER["num_mel_bins"], FRAMES)).astype(np.float32)
    ids = rng.integers(3, WHISPER["vocab_size"], size=(16, 7))
    ids[:, 0] = WHISPER["decoder_start_token_id"]
    np.savez(root / "data.npz", input_features=features, decoder_input_ids=ids)
    np.savez(root / "features.npz", input_features=features)
    return root, model, features, ids


def test_the_front_ends_site_is_the_second_convolutions_input_in_transformers(pair):
    """The channels encoder_conv permutes are what conv2 reads: the GELU of conv1's output, one
    row per frame, as transformers computes it (a forward hook on conv2)."""
    root, model, features, ids = pair
    ck = rj.load_hf(root / "a")
    seen = []
    hook = model.model.encoder.conv2.register_forward_hook(lambda mod, args, out: seen.append(args[0].numpy()))
    with torch.no_grad():
        model(input_features=torch.as_tensor(features[:3]), decoder_input_ids=torch.as_tensor(ids[:3]))
    hook.remove()
    _, xs = rj.nets.layers.record_dense_inputs(ck.graphdef, ck.forward_params(ck.params),
                                               {"input_features": features[:3], "decoder_input_ids": ids[:3]}, True)
    got = np.asarray(xs["encoder/front/0/conv2/kernel"])
    assert got.shape == (3, FRAMES, WHISPER["d_model"])
    np.testing.assert_allclose(got, np.transpose(seen[0], (0, 2, 1)), rtol=0, atol=1e-5 * np.abs(seen[0]).max())


def test_rotsym_align_from_activations_undoes_a_plant_in_transformers_streamed_as_in_memory(pair):
    root, model, features, ids = pair
    options = ["--quiet", "--method", "activations", "--data", str(root / "data.npz"), "--heads", "permute", "--residual", "permutation"]
    assert cli.main(["align", str(root / "a"), str(root / "b"), str(root / "out"), *options]) == 0
    report = json.loads((root / "out" / "rotsym_report.json").read_text())["result"]
    assert report["after"]["total"] <= 1e-6 * report["before"]["total"], report["after"]
    assert {"encoder_conv", "encoder_residual", "decoder_residual"} <= set(report["moved"])
    moved = tf.WhisperForConditionalGeneration.from_pretrained(root / "out", attn_implementation="eager").eval()
    inputs = {"input_features": torch.as_tensor(features[:4]), "decoder_input_ids": torch.as_tensor(ids[:4])}
    with torch.no_grad():
        want, got = model(**inputs).logits.numpy(), moved(**inputs).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert cli.main(["align", str(root / "a"), str(root / "b"), str(root / "streamed"), *options, "--max-memory", "3G"]) == 0
    assert_same_tensor_files(root / "out", root / "streamed")


def test_learned_alignment_runs_and_keeps_bs_function(pair):
    root, model, features, ids = pair
    a, b = rj.load_hf(root / "a"), rj.load_hf(root / "b")
    data = [{"input_features": features[i:i + 8], "decoder_input_ids": ids[i:i + 8]} for i in (0, 8)]
    result = rj.align(a.params, b.params, rj.spec_for(a), method="learned", data=data, checkpoint=a, heads="permute",
                      residual="permutation", steps=2, holdout=0, key=jax.random.key(0))
    losses = result.report["learned"]["start"]["losses"]  # the activation start undoes the plant, as weight matching does
    assert max(losses["activations"], losses["weights"]) <= 1e-5 * losses["identity"], losses
    want, got = (a.apply(p, **data[0])["logits"] for p in (b.params, result.params))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_features_without_the_decoders_ids_are_refused_by_name(pair, capsys):
    root, _, features, _ = pair
    with pytest.raises(SystemExit):
        cli.main(["align", str(root / "a"), str(root / "b"), str(root / "refused"), "--method", "activations",
                  "--data", str(root / "features.npz")])
    err = capsys.readouterr().err
    assert "the inputs lack decoder_input_ids: Whisper reads the decoder's token ids" in err and "positional argument" not in err, err
    a = rj.load_hf(root / "a")
    for call in (lambda: rj.align(a.params, a.params, rj.spec_for(a), method="activations", data=[{"input_features": features}],
                                  checkpoint=a, residual="permutation"),
                 lambda: a.apply(a.params, input_features=features)):
        with pytest.raises(rj.RotsymError, match="the inputs lack decoder_input_ids"):
            call()


@pytest.mark.parametrize("cls, config, name", [(tf.BartForConditionalGeneration, lambda: tf.BartConfig(**BART), "BART"),
                                               (tf.T5ForConditionalGeneration, lambda: tf.T5Config(**T5), "T5")])
def test_an_encoder_decoder_without_its_encoders_ids_is_refused_by_name(cls, config, name, tmp_path):
    save_reference(cls, config(), tmp_path / "m")
    ck = rj.load_hf(tmp_path / "m")
    decoder = {"decoder_input_ids": np.ones((2, 5), np.int32)}
    for call in (lambda: ck.apply(ck.params, **decoder),
                 lambda: rj.align(ck.params, ck.params, rj.spec_for(ck), method="activations", data=[decoder], checkpoint=ck, residual="none")):
        with pytest.raises(rj.RotsymError, match=f"the inputs lack input_ids: {name} reads the encoder's token ids"):
            call()


def test_a_streamed_plan_counts_every_row_whispers_sites_hold(pair):
    """The streamed memory plan's rows (`data_tokens`) bound what the sites hold: Whisper's most are
    its frames (the second convolution's input), not its features' mel bins (the count was
    examples x mel bins, 37x under the 3000 frames of a real Whisper's 80 bins)."""
    root, _, features, ids = pair
    ck = rj.load_hf(root / "a")
    batches = [{"input_features": features[:8], "decoder_input_ids": ids[:8]}, {"input_features": features[8:], "decoder_input_ids": ids[8:]}]
    options = AlignOptions(method="activations", residual="permutation")
    held = activations.sites(ck, ck.params, batches, rj.bind(rj.spec_for(ck), ck.params), "A", options).tokens
    assert held == 16 * FRAMES > 16 * WHISPER["num_mel_bins"]  # the front end's rows: more than the decoder's 16 x 7
    assert held <= data_tokens(ck.model_config, batches) <= 2 * held
