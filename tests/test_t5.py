"""T5 (model type t5: v1.0, v1.1, Flan-T5). The generic contracts (parity of our forward pass, round
trip, a random element of every group kept in transformers, planted recovery, streamed = in memory,
aligned and averaged is A) run on its rows of family_cases.py; here, what is particular: every
element kind proven in transformers (a rotation of the stream where no tied LM head reads the final
norm), the self-attention heads' order fixed by the shared position bias (a permutation of them
changes transformers' outputs), the relative position buckets, and OT fusion refused by name."""

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import T5
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax.merging.otfusion import ot_fuse
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")
GATED = dict(T5, feed_forward_proj="gated-gelu")


def test_every_group_holds_in_transformers_and_the_stream_rotates_without_a_tied_head(tmp_path):
    """The classifier: every kind, the stream's rotation with every RMSNorm gain folded into its
    readers (the encoder's final norm into each cross-attention's keys and values); the LM, tied
    as transformers 5 writes it, too, its head untied into a kernel of its own that takes the
    decoder's final gain (while the stacks keep sharing the embedding)."""
    save_reference(tf.T5ForSequenceClassification, tf.T5Config(**GATED, num_labels=3), tmp_path / "cls")
    save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**T5), tmp_path / "lm")
    for model in ("cls", "lm"):
        checks = {c.element: c for c in verify_groups(tmp_path / model)}
        if model == "lm":  # v1.0's ReLU FFN: no unit scales (the classifier's gated GELU has them)
            assert "no gated FFN" in checks.pop("FFN unit scales").note
        assert len(checks) == 12 - (model == "lm") and all(c.ok and c.difference is not None for c in checks.values()), (model, checks)


def test_a_self_attention_head_permutation_would_change_the_function(tmp_path):
    """Why the self-attention heads keep their order: every layer adds the first layer's bias table
    by head, so permuting one layer's heads changes transformers' logits; the cross-attention's
    heads (no position bias) permute freely, and the blocks say which is which."""
    torch = pytest.importorskip("torch")
    model = save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**T5), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    spec = rj.spec_for(ck)
    bound = rj.bind(spec, ck.params)
    assert {b.name: b.geometry.fixed_order for b in bound.attention} == {"encoder": True, "decoder": True, "cross": False}
    ids = torch.as_tensor(np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 9)))
    with torch.no_grad():
        want = model(input_ids=ids, decoder_input_ids=ids).logits.numpy()
    swap = np.array([1, 0, 2, 3], np.int32)
    for block, moves in (("encoder", True), ("cross", False)):
        t = rj.identity_transform(bound)
        perm = np.tile(np.arange(4, dtype=np.int32), (len(t[block].group_perm), 1))
        perm[1] = swap
        t[block] = t[block].replace(group_perm=jax.numpy.asarray(perm))
        folder = rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), tmp_path / block)
        with torch.no_grad():
            got = tf.T5ForConditionalGeneration.from_pretrained(folder).eval()(input_ids=ids, decoder_input_ids=ids).logits.numpy()
        difference = np.abs(got - want).max() / np.abs(want).max()
        assert (difference > 1e-3) if moves else (difference < 1e-5), (block, difference)
    # and no element the library draws or solves permutes them
    random = rj.random_transform(spec, ck.params, jax.random.key(0))
    assert all(np.array_equal(random[b].group_perm, np.tile(np.arange(4), (len(random[b].group_perm), 1))) for b in ("encoder", "decoder"))


@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
def test_relative_position_buckets_are_transformers(bidirectional):
    torch = pytest.importorskip("torch")
    from transformers.models.t5.modeling_t5 import T5Attention

    from rotsym_jax.families.nets.t5 import relative_buckets

    for length, buckets, distance in [(9, 8, 6), (300, 32, 128), (700, 32, 128), (64, 16, 20)]:
        relative = torch.arange(length)[None, :] - torch.arange(length)[:, None]
        want = T5Attention._relative_position_bucket(relative, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance)
        got = relative_buckets(length, length, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance)
        np.testing.assert_array_equal(got, want.numpy(), err_msg=str((length, buckets, distance)))


def test_ot_fusion_refuses_heads_that_keep_their_order(tmp_path):
    save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**T5), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    with pytest.raises(rj.RotsymError, match=r"the heads of 'decoder' keep their order"):
        ot_fuse([ck.params, ck.params], rj.spec_for(ck))


def _as_stored_on_the_hub(folder, seed=3):
    """T5 v1.1 and Flan-T5 as the Hub stores them: config.json's tie_word_embeddings false and an
    lm_head.weight of their own (transformers 5 writes neither, and loads both)."""
    import json

    import safetensors.numpy

    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = np.random.default_rng(seed).normal(size=tensors["shared.weight"].shape).astype(np.float32)
    safetensors.numpy.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(tie_word_embeddings=False, scale_decoder_outputs=False)
    (folder / "config.json").write_text(json.dumps(config))


def test_a_v1_1_lm_head_of_its_own_is_read_run_kept_and_lets_the_stream_rotate(tmp_path):
    """A hub-stored v1.1 checkpoint's own LM head: read (not dropped as a tie), run in parity with
    transformers, written back, and, as it takes the decoder's final gain, every element kind the
    classifier has holds, the stream's rotation included."""
    torch = pytest.importorskip("torch")
    save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**GATED), tmp_path / "a")
    _as_stored_on_the_hub(tmp_path / "a")
    model = tf.T5ForConditionalGeneration.from_pretrained(tmp_path / "a").eval()
    assert not torch.equal(model.lm_head.weight, model.shared.weight)
    ck = rj.load_hf(tmp_path / "a")
    assert "kernel" in ck.params["lm_head"]
    ids = np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 9))
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(ids), decoder_input_ids=torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(ck.apply(ck.params, input_ids=ids, decoder_input_ids=ids)["logits"])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    saved = rj.save_hf(ck, ck.params, tmp_path / "saved")
    import safetensors.numpy

    np.testing.assert_array_equal(safetensors.numpy.load_file(saved / "model.safetensors")["lm_head.weight"],
                                  safetensors.numpy.load_file(tmp_path / "a" / "model.safetensors")["lm_head.weight"])
    checks = {c.element: c for c in verify_groups(tmp_path / "a")}
    assert len(checks) == 12 and all(c.ok and c.difference is not None for c in checks.values()), checks


@pytest.mark.parametrize("argv", [["align"], ["align", "--max-memory", "1G"], ["merge", "--method", "average", "--max-memory", "1G"],
                                  ["mergekit"]], ids=["in-memory", "streamed", "streamed-merge", "mergekit-config"])
def test_stack_embeddings_stored_apart_and_different_are_refused_on_every_path(tmp_path, capsys, argv):
    """A checkpoint whose encoder.embed_tokens differs from shared.weight (a model whose config was
    untied after construction: transformers keeps the two apart, with a warning). Before, the
    in-memory load refused it and the streamed and mergekit-config runs dropped the copy unread:
    their output ran the stack on `shared` (logits off by ~10)."""
    import json

    import safetensors.numpy

    from rotsym_jax import cli

    save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**GATED), tmp_path / "a")
    tensors = safetensors.numpy.load_file(tmp_path / "a" / "model.safetensors")
    tensors["encoder.embed_tokens.weight"] = tensors["shared.weight"].copy()
    tensors["encoder.embed_tokens.weight"][-1, 0] += 1  # the last block of rows: every block is compared
    safetensors.numpy.save_file(tensors, tmp_path / "a" / "model.safetensors", metadata={"format": "pt"})
    if argv == ["mergekit"]:
        import shutil

        shutil.copytree(tmp_path / "a", tmp_path / "b")
        (tmp_path / "r.yaml").write_text(json.dumps({"merge_method": "linear", "dtype": "float32", "models": [
            {"model": str(tmp_path / n), "parameters": {"weight": w}} for n, w in (("a", 1.0), ("b", 0.0))]}))
        argv = ["merge", str(tmp_path / "r.yaml")]
    else:
        argv = [*argv[:1], str(tmp_path / "a"), str(tmp_path / "a"), *argv[1:]]
    capsys.readouterr()  # transformers' progress bars, writing A
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "'encoder.embed_tokens.weight' differs from 'shared.weight', which this model ties it to" in err, err
    assert not (tmp_path / "out").exists()


def test_stored_ties_compared_in_blocks_of_rows(tmp_path):
    import safetensors.numpy

    from rotsym_jax.io import hf
    from rotsym_jax.io._files import TensorFiles

    rng = np.random.default_rng(0)
    x = rng.normal(size=(37, 5)).astype(np.float32)
    y = x.copy()
    y[36, 4] = np.nextafter(y[36, 4], np.inf)
    safetensors.numpy.save_file({"x": x, "x2": x.copy(), "y": y, "z": x[:36]}, tmp_path / "model.safetensors")
    files = TensorFiles(tmp_path)
    for whole in (True, False):
        assert hf._stored_equal(files, "x", "x2", whole=whole, block_bytes=40)
        assert not hf._stored_equal(files, "x", "y", whole=whole, block_bytes=40)
        assert not hf._stored_equal(files, "x", "z", whole=whole, block_bytes=40)


def test_an_lm_is_scored_on_the_tokens_its_decoder_predicts(tmp_path):
    """Self-labelled data for an encoder-decoder LM (learned alignment's task loss, statistics):
    the decoder reads the ids shifted right, so position t is scored on token t (not t + 1, a
    decoder's convention): our loss on those labels is transformers' own loss with labels=ids."""
    import jax

    from rotsym_jax.families.labels import lm_labels

    torch = pytest.importorskip("torch")
    model = save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**T5), tmp_path / "t5")
    ck = rj.load_hf(tmp_path / "t5")
    ids = np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 7))
    mask = np.ones_like(ids)
    mask[1, 5:] = 0
    labels = lm_labels(ck, {"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask), labels=torch.as_tensor(np.where(mask > 0, ids, -100)))
    logp = jax.nn.log_softmax(np.asarray(ck.apply(ck.params, input_ids=ids, attention_mask=mask)["logits"]), -1)
    valid = labels >= 0
    ours = -np.sum(np.where(valid, np.take_along_axis(np.asarray(logp), np.maximum(labels, 0)[..., None], -1)[..., 0], 0)) / valid.sum()
    np.testing.assert_allclose(ours, float(want.loss), rtol=1e-5)
