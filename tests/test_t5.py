"""T5 (model type t5: v1.0, v1.1, Flan-T5). The generic contracts (parity of our forward pass, round
trip, a random element of every group kept in transformers, planted recovery, streamed = in memory,
aligned and averaged is A) run on its rows of family_cases.py; here, what is particular: every
element kind proven in transformers (a rotation of the stream where no tied LM head reads the final
norm), the self-attention heads' order fixed by the shared position bias (a permutation of them
changes transformers' outputs), the relative position buckets, OT fusion refused by name, each
stack's embedding and the LM head stored apart from `shared` read, aligned and merged as transformers
computes with them, on every path, and a v1.0 config untied keeping its scale."""

import jax
import numpy as np
import pytest
import transformers as tf
from checkpoint_utils import assert_same_checkpoint, float_tensors
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


def _stack_tables_apart(folder, seed=0):
    """A T5 LM as transformers writes one whose config was untied after construction (T5Config sets
    tie_word_embeddings true; false before the model is built, every table is a parameter of its
    own): shared.weight, each stack's embed_tokens.weight and lm_head.weight stored, all different,
    and config.json's tie_word_embeddings false beside scale_decoder_outputs true. Returns the model."""
    config = tf.T5Config(**GATED)
    config.tie_word_embeddings = False
    return save_reference(tf.T5ForConditionalGeneration, config, folder, seed=seed)


def _replaced_after_construction(folder, encoder=True, head=False):
    """A T5 LM of a tied config whose encoder's embedding (and, with `head`, its LM head) was
    replaced after construction, saved by transformers: shared.weight, encoder.embed_tokens.weight
    (and lm_head.weight) stored, the decoder tied to shared."""
    import torch

    model = save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**GATED), folder)
    torch.manual_seed(5)
    if encoder:
        model.encoder.embed_tokens = torch.nn.Embedding(T5["vocab_size"], T5["d_model"])
    if head:
        model.lm_head = torch.nn.Linear(T5["d_model"], T5["vocab_size"], bias=False)
    model.save_pretrained(folder)
    return model


def _with_stack_copies_of_shared(folder):
    """Each stack's embed_tokens stored beside shared with its values (as older checkpoints store them)."""
    import safetensors.numpy

    save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**GATED), folder)
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    for stack in ("encoder", "decoder"):
        tensors[f"{stack}.embed_tokens.weight"] = tensors["shared.weight"].copy()
    safetensors.numpy.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _transformers_logits(folder, ids):
    """transformers' logits (float32) of the T5 LM in `folder`, the model, and what its loader said."""
    import torch

    model, info = tf.T5ForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    with torch.no_grad():
        return model.eval()(input_ids=torch.as_tensor(ids), decoder_input_ids=torch.as_tensor(ids)).logits.numpy(), model, info


@pytest.mark.parametrize("writer", ["config-untied", "encoder-replaced", "encoder-and-head-replaced", "equal-copies"])
def test_stack_embeddings_and_a_head_stored_apart_are_read_as_transformers_computes_with_them(tmp_path, writer):
    """transformers 5 embeds each stack's input with its embed_tokens and computes the logits with
    lm_head, each tied to shared unless the checkpoint stores the two with different values: then
    it keeps them apart (with a warning). We read such a tensor as one of its own (T5Layout), from
    the headers as from the whole load; our logits are transformers'; save_hf writes the tensors
    read, and transformers loads them as they were. Copies equal to shared are shared, and are not
    written back."""
    import safetensors.numpy
    import torch

    folder = tmp_path / "a"
    {"config-untied": _stack_tables_apart, "encoder-replaced": _replaced_after_construction,
     "encoder-and-head-replaced": lambda f: _replaced_after_construction(f, head=True), "equal-copies": _with_stack_copies_of_shared}[writer](folder)
    own = {"config-untied": ("encoder", "decoder"), "encoder-replaced": ("encoder",), "encoder-and-head-replaced": ("encoder",),
           "equal-copies": ()}[writer]
    ids = np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 9))
    want, model, _ = _transformers_logits(folder, ids)
    stored = safetensors.numpy.load_file(folder / "model.safetensors")
    for stack in ("encoder", "decoder"):  # what transformers computes with: the premise
        table = getattr(model, stack).embed_tokens.weight
        assert (table is not model.shared.weight) == (stack in own), stack
        if stack in own:
            np.testing.assert_array_equal(table.detach().numpy(), stored[f"{stack}.embed_tokens.weight"])
            assert not torch.equal(table, model.shared.weight)
    assert (model.lm_head.weight is not model.shared.weight) == (writer in ("config-untied", "encoder-and-head-replaced"))
    ck = rj.load_hf(folder)
    assert getattr(ck.layout, "own_embeddings", ()) == own and rj.load_hf(folder, weights=False).layout == ck.layout
    assert getattr(ck.layout, "own_head", False) == (writer == "encoder-and-head-replaced")  # (config-untied: config.json says so)
    assert ("kernel" in ck.params.get("lm_head", {})) == (writer in ("config-untied", "encoder-and-head-replaced"))
    assert {k for k in ck.params["embeddings"] if k.endswith("_word")} == {f"{stack}_word" for stack in own}
    got = np.asarray(ck.apply(ck.params, input_ids=ids, decoder_input_ids=ids)["logits"])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    saved = rj.save_hf(ck, ck.params, tmp_path / "saved")
    written = safetensors.numpy.load_file(saved / "model.safetensors")
    assert written.keys() == stored.keys() - ({"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"} - {f"{s}.embed_tokens.weight" for s in own})
    for name, x in written.items():
        np.testing.assert_array_equal(x, stored[name], err_msg=name)
    again, _, info = _transformers_logits(saved, ids)
    assert not any(info.values()), info
    np.testing.assert_array_equal(again, want)


# every group T5 has (its self-attention heads keep their order: --heads permute permutes the cross-attention's)
EVERY_GROUP = ["--heads", "permute", "--ffn", "scaled"]


def _streamed_in_chunks(capsys, out) -> None:
    """The run that wrote `out` said it streamed fewer layers at a time than T5's 2 + 3."""
    import re

    said = capsys.readouterr().out
    chunk = re.search(rf"wrote {re.escape(str(out))} \([\d.]+ s, (\d+) layers? at a time\)", said)
    assert chunk and int(chunk[1]) < 2 + 3, said


@pytest.mark.parametrize("residual", ["permutation", "rotation"])
def test_aligned_with_stack_embeddings_of_their_own_b_keeps_its_function_in_memory_and_streamed(tmp_path, capsys, residual):
    """Two T5 LMs whose stacks embed with tables of their own, B aligned to A with every group and
    the residual stream, which moves the three tables alike (each writes the stream): transformers
    computes B's logits from the output, in memory and streamed in several chunks; the streamed
    output is the in-memory one's bits (a rotated stream: to float32 rounding, as
    docs/guides/big-checkpoints.md says of every family: its cross products summed in another order)."""
    import safetensors.numpy

    from rotsym_jax import cli, streaming

    a, b = tmp_path / "a", tmp_path / "b"
    _stack_tables_apart(a, seed=0)
    _stack_tables_apart(b, seed=1)
    flags = [*EVERY_GROUP, "--residual", residual]
    budget = streaming.plan_align(a, b, residual=residual, heads="permute", ffn="scaled", chunk_layers=1).peak_bytes
    assert cli.main(["align", str(a), str(b), str(tmp_path / "memory"), *flags]) == 0
    capsys.readouterr()
    assert cli.main(["align", str(a), str(b), str(tmp_path / "streamed"), *flags, "--max-memory", str(budget)]) == 0
    _streamed_in_chunks(capsys, tmp_path / "streamed")
    if residual == "permutation":
        assert_same_checkpoint(tmp_path / "streamed", tmp_path / "memory")
    else:
        memory, streamed = (float_tensors(tmp_path / f) for f in ("memory", "streamed"))
        assert memory.keys() == streamed.keys()
        for name, x in memory.items():
            np.testing.assert_allclose(streamed[name], x, rtol=0, atol=1e-4 * np.abs(x).max(), err_msg=name)
    ids = np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 9))
    want, _, _ = _transformers_logits(b, ids)
    for out in ("memory", "streamed"):
        got, model, info = _transformers_logits(tmp_path / out, ids)
        assert not any(info.values()), info
        np.testing.assert_allclose(got, want, rtol=0, atol=(1e-5 if residual == "permutation" else 1e-4) * np.abs(want).max(), err_msg=out)
        assert all(getattr(model, stack).embed_tokens.weight is not model.shared.weight for stack in ("encoder", "decoder"))
    before, after = (safetensors.numpy.load_file(f / "model.safetensors") for f in (b, tmp_path / "memory"))
    stream = np.linalg.lstsq(before["shared.weight"], after["shared.weight"], rcond=None)[0]  # (vocab > d: the one map of the stream)
    assert np.abs(stream - np.eye(T5["d_model"])).max() > 0.5  # the stream moved
    for stack in ("encoder", "decoder"):  # each stack's table moved with it
        name = f"{stack}.embed_tokens.weight"
        np.testing.assert_allclose(after[name], before[name] @ stream, rtol=0, atol=1e-4 * np.abs(before[name]).max(), err_msg=name)


def test_a_merge_of_t5s_with_stack_embeddings_of_their_own_is_read_by_transformers(tmp_path, capsys):
    """An average of two such models, B aligned to A as `rotsym align` aligns it: each stored table
    (the stacks' own included) is the mean of A's and aligned B's, in memory and streamed in
    several chunks (the same bits), and transformers loads the output with nothing missing or
    unexpected, its stacks' tables still their own."""
    from rotsym_jax import cli, streaming

    a, b = tmp_path / "a", tmp_path / "b"
    _stack_tables_apart(a, seed=0)
    _stack_tables_apart(b, seed=1)
    flags = [*EVERY_GROUP, "--residual", "permutation"]
    assert cli.main(["align", str(a), str(b), str(tmp_path / "aligned"), *flags]) == 0
    options = {"residual": "permutation", "heads": "permute", "ffn": "scaled"}
    budget = streaming.plan_merge("average", [a, b], align_options=options, chunk_layers=1).peak_bytes
    assert cli.main(["merge", "--method", "average", str(a), str(b), str(tmp_path / "merged"), *flags]) == 0
    capsys.readouterr()
    assert cli.main(["merge", "--method", "average", str(a), str(b), str(tmp_path / "streamed"), *flags, "--max-memory", str(budget)]) == 0
    _streamed_in_chunks(capsys, tmp_path / "streamed")
    assert_same_checkpoint(tmp_path / "streamed", tmp_path / "merged")
    merged, aligned, ta = (float_tensors(f) for f in (tmp_path / "merged", tmp_path / "aligned", a))
    assert merged.keys() == ta.keys() and {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"} <= merged.keys()
    for name, x in merged.items():
        np.testing.assert_allclose(x, (ta[name] + aligned[name]) / 2, rtol=0, atol=1e-6 * np.abs(x).max(), err_msg=name)
    _, model, info = _transformers_logits(tmp_path / "merged", np.ones((1, 3), np.int64))
    assert not any(info.values()), info
    assert all(getattr(model, stack).embed_tokens.weight is not model.shared.weight for stack in ("encoder", "decoder"))


@pytest.mark.parametrize("argv", [["align"], ["align", "--max-memory", "1G"], ["merge", "--method", "average", "--max-memory", "1G"],
                                  ["mergekit"]], ids=["in-memory", "streamed", "streamed-merge", "mergekit-config"])
def test_tensors_stored_apart_from_shared_are_read_on_every_path(tmp_path, capsys, argv):
    """A checkpoint whose encoder.embed_tokens and lm_head differ from shared.weight under a config
    that ties them (a model whose modules were replaced after construction: transformers keeps
    them apart and computes with them). Every path reads them: A aligned to itself, averaged with
    itself, or merged by a mergekit config with a copy of weight 0 computes A's logits in
    transformers. (Before, the in-memory run refused them; before that, the streamed and
    mergekit-config runs dropped them unread: their output ran the encoder on `shared`, logits off
    by ~10.)"""
    import json

    import safetensors.numpy

    from rotsym_jax import cli

    _replaced_after_construction(tmp_path / "a", head=True)
    if argv == ["mergekit"]:
        import shutil

        shutil.copytree(tmp_path / "a", tmp_path / "b")
        (tmp_path / "r.yaml").write_text(json.dumps({"merge_method": "linear", "dtype": "float32", "models": [
            {"model": str(tmp_path / n), "parameters": {"weight": w}} for n, w in (("a", 1.0), ("b", 0.0))]}))
        argv = ["merge", str(tmp_path / "r.yaml")]
    else:
        argv = [*argv[:1], str(tmp_path / "a"), str(tmp_path / "a"), *argv[1:]]
    assert cli.main([*argv, str(tmp_path / "out"), "--quiet"]) == 0
    stored = safetensors.numpy.load_file(tmp_path / "out" / "model.safetensors")
    assert {"encoder.embed_tokens.weight", "lm_head.weight"} <= stored.keys() and "decoder.embed_tokens.weight" not in stored
    ids = np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 9))
    want, _, _ = _transformers_logits(tmp_path / "a", ids)
    got, _, info = _transformers_logits(tmp_path / "out", ids)
    assert not any(info.values()), info
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("anchor", ["resaved", "tied"])
def test_a_v1_1_resaved_by_transformers_5_aligns_with_a_tied_t5_under_a_rotation(tmp_path, anchor):
    """T5 v1.1 and Flan-T5 as transformers 5 saves them once loaded (config.json tied,
    scale_decoder_outputs false, lm_head.weight stored apart from shared: before, refused on load),
    beside a T5 whose head is tied: for a rotation of the stream the tied one is untied (the stacks'
    ties, which untying leaves, are not a head's: before, they kept anything from being untied and
    the rotation was refused), and transformers computes B's logits from the output."""
    import json

    from rotsym_jax import cli

    save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**GATED), tmp_path / "hub")
    _as_stored_on_the_hub(tmp_path / "hub")
    tf.T5ForConditionalGeneration.from_pretrained(tmp_path / "hub").save_pretrained(tmp_path / "resaved")
    written = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert (written.get("tie_word_embeddings", True), written["scale_decoder_outputs"]) == (True, False)
    assert getattr(rj.load_hf(tmp_path / "resaved").layout, "own_head", False)
    save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**GATED), tmp_path / "tied", seed=1)
    a, b = (tmp_path / "resaved", tmp_path / "tied") if anchor == "resaved" else (tmp_path / "tied", tmp_path / "resaved")
    assert cli.main(["align", str(a), str(b), str(tmp_path / "out"), "--quiet", "--residual", "rotation"]) == 0
    ids = np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 9))
    want, _, _ = _transformers_logits(b, ids)
    got, model, info = _transformers_logits(tmp_path / "out", ids)
    assert not any(info.values()) and model.lm_head.weight is not model.shared.weight, info
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())  # (a rotation: float32 rounding, amplified)


def test_a_v1_0_config_written_before_transformers_5_keeps_its_scaling_when_untied_for_a_rotation(tmp_path):
    """T5 v1.0 as transformers 4 wrote it (t5-small's config.json states neither tie_word_embeddings
    nor scale_decoder_outputs): its decoder's output scaled by d^-1/2, which config.json leaves to
    the tie. Untied for a rotation of the stream, it is written with scale_decoder_outputs true
    beside tie_word_embeddings false (before: neither, so transformers read the head unscaled and
    the logits changed by about 5 times their size), and transformers computes B's logits from the
    output; the tied and the untied model run in one process (before, their configs compared
    equal and the second ran the first's forward pass: it failed)."""
    import json

    from rotsym_jax import cli

    for name, seed in (("a", 0), ("b", 1)):
        save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**T5), tmp_path / name, seed=seed)
        config = json.loads((tmp_path / name / "config.json").read_text())
        for key in ("tie_word_embeddings", "scale_decoder_outputs"):
            config.pop(key, None)
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    ids = np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 9))
    ck = rj.load_hf(tmp_path / "b")
    untied = rj.untie(ck)
    assert "kernel" in untied.params["lm_head"] and ck.model_config != untied.model_config
    tied_logits = np.asarray(ck.apply(ck.params, input_ids=ids, decoder_input_ids=ids)["logits"])
    np.testing.assert_allclose(np.asarray(untied.apply(untied.params, input_ids=ids, decoder_input_ids=ids)["logits"]), tied_logits,
                               rtol=0, atol=1e-6 * np.abs(tied_logits).max())
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out"), "--quiet", "--residual", "rotation"]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["tie_word_embeddings"], written["scale_decoder_outputs"]) == (False, True)
    assert written.keys() - json.loads((tmp_path / "b" / "config.json").read_text()).keys() == {"tie_word_embeddings", "scale_decoder_outputs"}
    want, _, _ = _transformers_logits(tmp_path / "b", ids)
    got, model, info = _transformers_logits(tmp_path / "out", ids)
    assert not any(info.values()) and model.lm_head.weight is not model.shared.weight, info
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())  # (a rotation)


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


def _fine_tuned_apart(source, folder, seed=7):
    """A fine-tune of the T5 in `source` saved by transformers 5 whose stacks' tables were trained
    apart from `shared`: each stack's embed_tokens replaced by shared plus noise (0.1 of its
    scale), the rest as it was; transformers stores shared, both tables (and lm_head where it is
    its own), and keeps the tables apart on load."""
    import torch

    model = tf.T5ForConditionalGeneration.from_pretrained(source).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        shared = model.shared.weight
        for stack in (model.encoder, model.decoder):
            table = torch.nn.Embedding(*shared.shape)
            table.weight.copy_(shared + 0.1 * shared.std() * torch.randn(shared.shape, generator=generator))
            stack.embed_tokens = table
    model.save_pretrained(folder)


def _computed_with(folder) -> dict:
    """{HF name: array} of every tensor transformers computes with in the T5 LM of `folder` (a stack's
    table or the head tied to shared: shared's values), as its state dict holds them."""
    model = tf.T5ForConditionalGeneration.from_pretrained(folder).eval()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _planted(folder, out, residual, seed):
    """The T5 of `folder` moved by a random permutation of every group and a random permutation or
    (its gains folded, a tied head untied) rotation of the stream, saved in its own layout: a
    model with only `shared` stays one."""
    from rotsym_jax.transforms import RESIDUAL

    ck = rj.load_hf(folder)
    if residual == "rotation":
        ck = rj.untie(ck)
    spec = rj.spec_for(ck)
    params = rj.fold_norms(spec, ck.params) if residual == "rotation" else ck.params
    t = rj.random_transform(spec, params, jax.random.key(seed), ("perm",))
    t[RESIDUAL] = rj.random_residual(spec, params, jax.random.key(seed + 1), residual)
    return rj.save_hf(ck, rj.apply_transform(spec, params, t), out)


def _shared_and_apart(root, kind):
    """S, a T5 LM whose stacks embed with `shared` alone ("hub": a Flan-T5 as released, its LM head
    of its own; "tied": as transformers 5 writes a T5, shared.weight alone), and P, a fine-tune of
    it saved with its stacks' tables apart (`_fine_tuned_apart`)."""
    save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**GATED), root / "S")
    if kind == "hub":
        _as_stored_on_the_hub(root / "S")
    _fine_tuned_apart(root / "S", root / "P")
    stored = {f: set(safetensors_names(root / f)) for f in ("S", "P")}
    tables = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    assert not stored["S"] & tables and tables <= stored["P"], stored  # the premise: one stores the tables, the other has shared alone
    assert getattr(rj.load_hf(root / "P").layout, "own_embeddings", ()) == ("encoder", "decoder")
    assert getattr(rj.load_hf(root / "S").layout, "own_embeddings", ()) == ()
    return root / "S", root / "P"


def safetensors_names(folder):
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "np") as f:
        return list(f.keys())


def _stream_budget(a, b, residual, merge=False) -> int:
    """A --max-memory that streams the pair one layer at a time (planned on the models as the run reconciles them)."""
    from rotsym_jax import streaming
    from rotsym_jax.io.reconcile import reconciled

    cks, _ = reconciled([rj.load_hf(a, weights=False), rj.load_hf(b, weights=False)], residual)
    options = {"residual": residual, "heads": "permute", "ffn": "scaled"}
    if merge:
        return streaming.plan_merge("average", cks, align_options=options, chunk_layers=1).peak_bytes
    return streaming.plan_align(*cks, **options, chunk_layers=1).peak_bytes


# (S's kind, the stream's group, the anchor): each kind, group and anchor at least once
MIXED = [("hub", "permutation", "S"), ("hub", "rotation", "P"), ("tied", "permutation", "P"), ("tied", "rotation", "S")]


@pytest.mark.parametrize(("kind", "residual", "anchor"), MIXED, ids=["-".join(c) for c in MIXED])
def test_a_pair_whose_stacks_embed_apart_and_with_shared_aligns_in_memory_and_streamed(tmp_path, capsys, kind, residual, anchor):
    """A T5 whose stacks embed with shared alone beside one whose stacks' tables are their own
    (before: refused, "does not have the architecture"): the one with shared alone is read with its
    tables copies of shared (the same function, as transformers computes it), which the run says.
    B, the other model moved by a planted permutation or rotation, aligned to A in memory and
    streamed in several chunks: transformers loads the output (its tables stored apart) with nothing
    missing or unexpected and computes B's logits; the planted element is undone (a permutation: the
    output holds the unmoved model's tensors as transformers computes with them, shared's values in
    the tables it tied)."""
    import json

    from rotsym_jax import cli

    s, p = _shared_and_apart(tmp_path, kind)
    a, moved = (s, p) if anchor == "S" else (p, s)
    b = _planted(moved, tmp_path / "B", residual, seed=3)
    flags = [*EVERY_GROUP, "--residual", residual]
    assert cli.main(["align", str(a), str(b), str(tmp_path / "memory"), *flags]) == 0
    said = capsys.readouterr().err
    assert "encoder.embed_tokens.weight" in said and "copies of shared.weight" in said, said
    assert cli.main(["align", str(a), str(b), str(tmp_path / "streamed"), *flags, "--max-memory", str(_stream_budget(a, b, residual))]) == 0
    _streamed_in_chunks(capsys, tmp_path / "streamed")
    ids = np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 9))
    want, _, _ = _transformers_logits(b, ids)
    unmoved = _computed_with(moved)
    for out in ("memory", "streamed"):
        folder = tmp_path / out
        got, model, info = _transformers_logits(folder, ids)
        assert not any(info.values()), (out, info)
        np.testing.assert_allclose(got, want, rtol=0, atol=(1e-5 if residual == "permutation" else 1e-4) * np.abs(want).max(), err_msg=out)
        assert {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"} <= set(safetensors_names(folder)), out
        result = json.loads((folder / "rotsym_report.json").read_text())["result"]
        assert result["apart"]["tensors"] == ["decoder.embed_tokens.weight", "encoder.embed_tokens.weight"], result.get("apart")
        assert result["before"]["total"] > 1.0, "nothing was planted"
        if residual == "permutation":  # undone: the unmoved model's tensors (to the rounding of the heads' and units' solved scales)
            for name, x in float_tensors(folder).items():
                np.testing.assert_allclose(x, unmoved[name], rtol=0, atol=1e-5 * np.abs(unmoved[name]).max(), err_msg=f"{out}: {name}")
        else:  # undone to the tables' difference (a rotation solved from every stream tensor, the tables a small part)
            assert result["after"]["total"] < 0.05 * result["before"]["total"], (out, result["before"], result["after"])


MERGED = [("hub", "S", "average"), ("tied", "P", "average"), ("hub", "P", "mergekit"), ("tied", "S", "mergekit")]


@pytest.mark.parametrize(("kind", "anchor", "how"), MERGED, ids=["-".join(c) for c in MERGED])
def test_a_pair_whose_stacks_embed_apart_and_with_shared_merges_as_transformers_averages_them(tmp_path, capsys, kind, anchor, how):
    """The same pair, B the other model with a planted permutation, aligned and averaged (in memory
    and streamed in several chunks, or by a mergekit config with --align): transformers loads the
    output with nothing missing or unexpected, its stacks' tables apart, and computes the logits
    of the average that transformers' own two models give (each tensor the mean of the two as they
    compute with it: shared's values for the tables a model ties)."""
    import torch

    from rotsym_jax import cli

    s, p = _shared_and_apart(tmp_path, kind)
    a, moved = (s, p) if anchor == "S" else (p, s)
    b = _planted(moved, tmp_path / "B", "permutation", seed=5)
    flags = [*EVERY_GROUP, "--residual", "permutation"]
    if how == "average":
        runs = {"memory": ["merge", "--method", "average", str(a), str(b), str(tmp_path / "memory"), *flags],
                "streamed": ["merge", "--method", "average", str(a), str(b), str(tmp_path / "streamed"), *flags,
                             "--max-memory", str(_stream_budget(a, b, "permutation", merge=True))]}
    else:
        (tmp_path / "r.yaml").write_text(f"merge_method: linear\ndtype: float32\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n"
                                         f"  - model: {b}\n    parameters: {{weight: 0.5}}\n")
        runs = {"mergekit": ["merge", str(tmp_path / "r.yaml"), str(tmp_path / "mergekit"), "--align", "anchor", *flags]}
    for out, argv in runs.items():
        capsys.readouterr()
        assert cli.main(argv) == 0
        if out == "streamed":
            _streamed_in_chunks(capsys, tmp_path / out)
    # the expected model: transformers' two, averaged tensor by tensor, in the model that holds its tables apart
    expected = tf.T5ForConditionalGeneration.from_pretrained(p).eval()
    ts, tp = _computed_with(s), _computed_with(p)
    assert ts.keys() == tp.keys() == expected.state_dict().keys()
    mean = {k: (ts[k] + tp[k]) / 2 for k in tp}
    expected.load_state_dict({k: torch.as_tensor(v) for k, v in mean.items()})
    assert expected.encoder.embed_tokens.weight is not expected.shared.weight
    ids = np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 9))
    with torch.no_grad():
        want = expected(input_ids=torch.as_tensor(ids), decoder_input_ids=torch.as_tensor(ids)).logits.numpy()
    for out in runs:
        got, model, info = _transformers_logits(tmp_path / out, ids)
        assert not any(info.values()), (out, info)
        assert all(getattr(model, stack).embed_tokens.weight is not model.shared.weight for stack in ("encoder", "decoder")), out
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=out)
    if how == "average":
        assert_same_checkpoint(tmp_path / "streamed", tmp_path / "memory")


@pytest.mark.parametrize("writer", ["config-untied", "encoder-and-head-replaced"])
def test_an_orbax_checkpoint_of_a_t5_with_tables_of_its_own_reads_back(tmp_path, writer):
    """A T5 whose stacks' tables (and LM head) are its own, saved as Orbax (save_orbax, and `rotsym
    align --format orbax`), reads back in its layout (before: refused, "unexpected leaves"; the
    layout's own fields are in no file, only its leaves): the same params, and written as a Hugging
    Face folder it computes the source's logits in transformers."""
    from rotsym_jax import cli

    folder = tmp_path / "a"
    (_stack_tables_apart if writer == "config-untied" else lambda f: _replaced_after_construction(f, head=True))(folder)
    ck = rj.load_hf(folder)
    assert getattr(ck.layout, "own_embeddings", ()) and type(ck.layout) is not rj.families.family.Layout
    saved = rj.save_orbax(ck, ck.params, tmp_path / "orbax")
    assert cli.main(["align", str(folder), str(folder), str(tmp_path / "aligned"), "--format", "orbax", "--residual", "permutation", "--quiet"]) == 0
    ids = np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 9))
    want, _, _ = _transformers_logits(folder, ids)
    for name, path in (("save_orbax", saved), ("align --format orbax", tmp_path / "aligned")):
        back = rj.load_orbax(path)
        assert back.layout == ck.layout, name
        if name == "save_orbax":
            jax.tree.map(np.testing.assert_array_equal, back.params, ck.params)
        got, _, info = _transformers_logits(rj.save_hf(back, back.params, tmp_path / f"hf-{len(name)}"), ids)
        assert not any(info.values()), (name, info)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=name)


def test_a_mergekit_config_without_alignment_merges_the_pair_and_the_card_says_what_was_read_apart(tmp_path, capsys):
    """A mergekit config run with --align none on a T5 that embeds with shared alone and one whose
    stacks' tables are their own (refused before, as the aligned runs were): the tables read apart,
    averaged as transformers' two models compute them, and the model card says so, as it says an
    untied head."""
    import torch

    from rotsym_jax import cli

    s, p = _shared_and_apart(tmp_path, "hub")
    (tmp_path / "r.yaml").write_text(f"merge_method: linear\ndtype: float32\nmodels:\n  - model: {s}\n    parameters: {{weight: 0.5}}\n"
                                     f"  - model: {p}\n    parameters: {{weight: 0.5}}\n")
    assert cli.main(["merge", str(tmp_path / "r.yaml"), str(tmp_path / "out"), "--align", "none"]) == 0
    assert "## Tables read apart" in (tmp_path / "out" / "README.md").read_text()
    expected = tf.T5ForConditionalGeneration.from_pretrained(p).eval()
    ts, tp = _computed_with(s), _computed_with(p)
    expected.load_state_dict({k: torch.as_tensor((ts[k] + tp[k]) / 2) for k in tp})
    ids = np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 9))
    with torch.no_grad():
        want = expected(input_ids=torch.as_tensor(ids), decoder_input_ids=torch.as_tensor(ids)).logits.numpy()
    got, _, info = _transformers_logits(tmp_path / "out", ids)
    assert not any(info.values()), info
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("decoder", ["equal", "apart"])
def test_a_t5_stored_without_shared_reads_it_from_its_stacks_tables(tmp_path, decoder):
    """MADLAD-400's T5s store each stack's embed_tokens and no shared.weight: transformers fills
    shared through the tie from the encoder's table (and keeps a decoder table of other values
    apart). Read so (refused before: "shared.weight is missing"): transformers' logits, a save it
    loads with nothing missing, and an alignment in memory and streamed that keeps them."""
    import safetensors.numpy

    from rotsym_jax import cli

    save_reference(tf.T5ForConditionalGeneration, tf.T5Config(**GATED, tie_word_embeddings=False), tmp_path / "m")
    tensors = safetensors.numpy.load_file(tmp_path / "m" / "model.safetensors")
    shared = tensors.pop("shared.weight")
    tensors["encoder.embed_tokens.weight"] = shared.copy()
    noise = np.random.default_rng(1).normal(scale=0.1 * shared.std(), size=shared.shape).astype(np.float32)
    tensors["decoder.embed_tokens.weight"] = shared + noise if decoder == "apart" else shared.copy()
    safetensors.numpy.save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    ids = np.random.default_rng(0).integers(2, T5["vocab_size"], size=(2, 9))
    want, _, info = _transformers_logits(tmp_path / "m", ids)
    assert not any(info.values()), info

    ck = rj.load_hf(tmp_path / "m")
    np.testing.assert_array_equal(np.asarray(ck.params["embeddings"]["word"]["embedding"]), shared)
    assert getattr(ck.layout, "own_embeddings", ()) == (("decoder",) if decoder == "apart" else ())
    rj.save_hf(ck, ck.params, tmp_path / "saved")
    flags = ["--heads", "permute", "--residual", "permutation", "--quiet"]
    for out, budget in (("memory", []), ("streamed", ["--max-memory", "1G"])):
        assert cli.main(["align", str(tmp_path / "saved"), str(tmp_path / "m"), str(tmp_path / out), *flags, *budget]) == 0
    for folder in ("saved", "memory", "streamed"):
        got, _, info = _transformers_logits(tmp_path / folder, ids)
        assert not any(info.values()), (folder, info)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=folder)
