"""BART and mBART (model types bart, mbart), the first encoder–decoders. The generic contracts (parity of our forward
pass, round trip, a random element of every group kept in transformers, planted recovery, streamed =
in memory, aligned and averaged is A) run on its rows of family_cases.py; here, what is particular:
each stack's attention and the cross-attention are groups of their own, every element kind proven
in transformers, the older checkpoints that store each stack's copy of the shared embedding, a
pair aligned from its activations, and the untied embeddings refused by name."""

import json

import numpy as np
import pytest
import safetensors.numpy
import transformers as tf
from family_cases import BART
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")


def test_each_stack_and_the_cross_attention_are_groups_of_their_own(tmp_path):
    save_reference(tf.BartForConditionalGeneration, tf.BartConfig(**BART), tmp_path / "bart")
    ck = rj.load_hf(tmp_path / "bart")
    bound = rj.bind(rj.spec_for(ck), ck.params)
    blocks = {b.name: (len(b.layers), b.geometry.num_heads) for b in bound.attention}
    assert blocks == {"encoder": (2, 4), "decoder": (3, 2), "cross": (3, 2)}
    assert {p.name: (len(p.layers), p.size) for p in bound.perms} == {"encoder_ffn": (2, 48), "decoder_ffn": (3, 40)}
    cross = {m.template: m.role for b in bound.attention if b.name == "cross" for m in b.members}
    assert cross["decoder/layers/{layer}/cross_attention/key/kernel"] == "k"
    # the cross-attention's keys and values read the encoder's stream: its permutation moves their rows
    stream = dict(rj.spec_for(ck).residual.rules)
    assert stream[r"decoder/layers/\d+/cross_attention/key/kernel"] == 0


def test_every_group_holds_in_transformers(tmp_path):
    """Head permutations, QK and VO rotations, scales and invertible maps of all three attention
    sites, both stacks' FFN permutations and the one residual permutation each keep the LM's
    logits in transformers; the stream cannot rotate or flip signs (post-LN), and `verify` says why."""
    save_reference(tf.BartForConditionalGeneration, tf.BartConfig(**BART), tmp_path / "bart")
    checks = {c.element: c for c in verify_groups(tmp_path / "bart")}
    assert "no gated FFN" in checks.pop("FFN unit scales").note  # a GELU MLP: no unit scales
    unproven = ("residual signed permutation", "residual rotation")
    assert all(c.ok and c.difference is not None for name, c in checks.items() if name not in unproven), checks
    assert all(checks[name].difference is None and "LayerNorm" in checks[name].note for name in unproven), checks


def test_a_checkpoint_storing_each_stacks_embedding_loads_and_saves_as_transformers_does(tmp_path):
    """Older BART checkpoints also store encoder.embed_tokens and decoder.embed_tokens, equal to
    model.shared: they are read as the shared embedding (another value is refused) and not written back."""
    save_reference(tf.BartForConditionalGeneration, tf.BartConfig(**BART), tmp_path / "bart")
    tensors = safetensors.numpy.load_file(tmp_path / "bart" / "model.safetensors")
    shared = tensors["model.shared.weight"]
    for name, copy in (("old", shared), ("other", shared + 1)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_bytes((tmp_path / "bart" / "config.json").read_bytes())
        stored = {**tensors, "model.encoder.embed_tokens.weight": shared, "model.decoder.embed_tokens.weight": copy}
        safetensors.numpy.save_file(stored, folder / "model.safetensors", metadata={"format": "pt"})
    saved = rj.save_hf(rj.load_hf(tmp_path / "old"), rj.load_hf(tmp_path / "old").params, tmp_path / "saved")
    assert "model.encoder.embed_tokens.weight" not in safetensors.numpy.load_file(saved / "model.safetensors")
    _, info = tf.BartForConditionalGeneration.from_pretrained(saved, output_loading_info=True)
    assert not any(info.values()), info
    with pytest.raises(rj.RotsymError, match="decoder.embed_tokens.weight"):
        rj.load_hf(tmp_path / "other")


def test_aligned_from_activations_it_keeps_bs_function_in_transformers(tmp_path):
    """Data flows through our forward pass (the encoder on the ids, the decoder on them shifted):
    activation matching aligns B to A, and transformers computes B's logits from the output."""
    torch = pytest.importorskip("torch")
    config = tf.BartConfig(**BART)
    save_reference(tf.BartForConditionalGeneration, config, tmp_path / "a")
    model_b = save_reference(tf.BartForConditionalGeneration, config, tmp_path / "b", seed=1)
    ids = np.random.default_rng(0).integers(3, BART["vocab_size"], size=(16, 9))
    np.savez(tmp_path / "ids.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out"), "--method", "activations",
                     "--data", str(tmp_path / "ids.npz"), "--quiet"]) == 0
    report = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())
    assert report["result"]["after"]["total"] < report["result"]["before"]["total"]
    moved = tf.BartForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    x = torch.as_tensor(ids[:4])
    with torch.no_grad():
        np.testing.assert_allclose(moved(input_ids=x).logits.numpy(), model_b(input_ids=x).logits.numpy(), rtol=1e-4, atol=1e-4)


def test_untied_embeddings_are_refused_by_name(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    tf.BartForConditionalGeneration(tf.BartConfig(**BART, tie_word_embeddings=False)).save_pretrained(tmp_path / "bart")
    with pytest.raises(rj.RotsymError, match="tie_word_embeddings=False"):
        rj.load_hf(tmp_path / "bart")


def test_mbart_is_proven_in_transformers_and_refuses_a_rotation_by_its_embedding_norms(tmp_path):
    """mBART (pre-LN, a final norm per stack): every group BART has holds in transformers; the stream
    cannot rotate, since the embedding norms' outputs are the streams themselves (their gains are
    read by no kernel that could take them)."""
    save_reference(tf.MBartForConditionalGeneration, tf.MBartConfig(**BART), tmp_path / "mbart")
    checks = {c.element: c for c in verify_groups(tmp_path / "mbart")}
    assert "no gated FFN" in checks.pop("FFN unit scales").note  # a GELU MLP: no unit scales
    rotation, signed = checks.pop("residual rotation"), checks.pop("residual signed permutation")
    assert rotation.difference is None and "embeddings/encoder_norm/scale" in rotation.note
    assert signed.difference is None and "LayerNorm" in signed.note
    assert all(c.ok and c.difference is not None for c in checks.values()), checks


def test_mbart_starts_the_decoder_from_each_examples_language_id(tmp_path):
    """MBartModel makes its decoder inputs by wrapping each example's last token that is not padding
    (its language id) to the front; ours, given no decoder inputs, computes transformers' logits."""
    model = save_reference(tf.MBartForConditionalGeneration, tf.MBartConfig(**BART), tmp_path / "mbart")
    ids = np.random.default_rng(1).integers(3, BART["vocab_size"], size=(3, 7))
    mask = np.ones_like(ids)
    mask[2, 5:] = 0
    ids[2, 5:] = 1  # padding after the last row's language id, ids[2, 4]
    assert len({int(ids[0, 6]), int(ids[1, 6]), int(ids[2, 4])}) > 1
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    ck = rj.load_hf(tmp_path / "mbart")
    got = np.asarray(ck.apply(ck.params, input_ids=ids, attention_mask=mask)["logits"])
    np.testing.assert_allclose(got[mask == 1], want[mask == 1], rtol=0, atol=1e-4 * np.abs(want).max())


def test_sequences_past_the_position_table_are_refused_not_nan(tmp_path):
    """A lookup past the learned positions would fill NaN: refused by name, for either stack."""
    save_reference(tf.BartModel, tf.BartConfig(**BART), tmp_path / "bart")
    ck = rj.load_hf(tmp_path / "bart")
    long = np.full((1, BART["max_position_embeddings"] + 1), 5)
    short = long[:, :4]
    for inputs, stack in (({"input_ids": long, "decoder_input_ids": short}, "encoder"), ({"input_ids": short, "decoder_input_ids": long}, "decoder")):
        with pytest.raises(rj.RotsymError, match=f"the {stack}'s inputs hold 21 tokens; the model has 20 learned positions"):
            ck.apply(ck.params, **inputs)
