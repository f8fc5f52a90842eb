"""DeBERTa-v2 and v3 (model type deberta-v2). The generic contracts (parity of our forward pass,
round trip, every group kept in transformers, planted recovery, streamed = in memory, aligned and
averaged is A) run on its rows of family_cases.py; here, what is particular: each group proven in
transformers on both kinds of relative attention (the tokens' own projections, v3; pos_key_proj and
pos_query_proj, v2), the position projections moving with their heads, the relative positions'
log buckets, alignment from activations, and what the record does not describe refused by name."""

import json

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import DEBERTA_V2, DEBERTA_V3, TEXT
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.transforms import RESIDUAL
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")


@pytest.mark.parametrize("attention", [DEBERTA_V3, DEBERTA_V2], ids=["shared-key-v3", "own-positions-v2"])
def test_every_group_holds_in_transformers(tmp_path, attention):
    """Head permutations, QK and VO rotations, scales and invertible maps, FFN and residual
    permutations each keep the classifier's logits in transformers; the stream cannot rotate or
    flip signs (post-LN), and `verify` says why."""
    save_reference(tf.DebertaV2ForSequenceClassification, tf.DebertaV2Config(**TEXT, **attention, num_labels=3), tmp_path / "deberta")
    checks = {c.element: c for c in verify_groups(tmp_path / "deberta")}
    assert "no gated FFN" in checks.pop("FFN unit scales").note  # a GELU MLP: no unit scales
    unproven = ("residual signed permutation", "residual rotation")
    assert all(c.ok and c.difference is not None for name, c in checks.items() if name not in unproven), checks
    assert all(checks[name].difference is None and "LayerNorm" in checks[name].note for name in unproven), checks


def test_the_position_projections_move_with_their_heads(tmp_path):
    """DeBERTa-v2's pos_key_proj and pos_query_proj are members of K and Q: their columns take
    the head's permutation, rotation and scale (K's inverse scale for pos_key), and the relative
    embeddings and their norm take the stream's permutation."""
    save_reference(tf.DebertaV2Model, tf.DebertaV2Config(**TEXT, **DEBERTA_V2, norm_rel_ebd="layer_norm"), tmp_path / "deberta")
    ck = rj.load_hf(tmp_path / "deberta")
    spec = rj.spec_for(ck)
    (block,) = rj.bind(spec, ck.params).attention
    roles = {m.template: m.role for m in block.members}
    assert roles["layers/{layer}/attention/pos_key/kernel"] == roles["layers/{layer}/attention/key/kernel"] == "k"
    assert roles["layers/{layer}/attention/pos_query/kernel"] == roles["layers/{layer}/attention/query/kernel"] == "q"
    t = rj.identity_transform(rj.bind(spec, ck.params))
    t[RESIDUAL] = rj.random_residual(spec, ck.params, jax.random.key(2), "permutation")
    moved = rj.apply_transform(spec, ck.params, t)
    perm = np.asarray(t[RESIDUAL].perm)
    for leaf, axis in (("relative", "embedding"), ("relative_norm", "scale"), ("relative_norm", "bias")):
        before, after = np.asarray(ck.params["embeddings"][leaf][axis]), np.asarray(moved["embeddings"][leaf][axis])
        np.testing.assert_array_equal(after, before[..., perm], err_msg=f"{leaf}/{axis}")


@pytest.mark.parametrize("config, refusal", [
    (dict(conv_kernel_size=3), "conv_kernel_size=3"),
    (dict(embedding_size=16), "embedding_size=16 != hidden_size=32"),
    (dict(pooler_hidden_size=16), "pooler_hidden_size=16 != hidden_size=32"),
], ids=["convolution", "narrow-embedding", "pooler-width"])
def test_what_the_record_does_not_describe_is_refused_by_name(tmp_path, config, refusal):
    """transformers writes these; their tensors or symmetries are not the record's, so loading
    names what the config adds instead of reading part of it."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    cls = tf.DebertaV2ForSequenceClassification if "pooler_hidden_size" in config else tf.DebertaV2Model
    cls(tf.DebertaV2Config(**TEXT, **DEBERTA_V3, **config)).save_pretrained(tmp_path / "deberta")
    with pytest.raises(rj.RotsymError, match=refusal):
        rj.load_hf(tmp_path / "deberta")


@pytest.mark.parametrize("attention", [DEBERTA_V3, DEBERTA_V2], ids=["shared-key-v3", "own-positions-v2"])
def test_aligned_from_activations_it_keeps_bs_function_in_transformers(tmp_path, attention):
    """Data flows through our forward pass: activation matching (the residual stream permuted too,
    the strongest group post-LN allows) aligns B to A from their activations on token ids, and
    transformers computes B's logits from the output (v3's query and key, called on the positions
    too, match on the tokens' rows)."""
    torch = pytest.importorskip("torch")
    config = tf.DebertaV2Config(**TEXT, **attention, num_labels=3)
    save_reference(tf.DebertaV2ForSequenceClassification, config, tmp_path / "a")
    model_b = save_reference(tf.DebertaV2ForSequenceClassification, config, tmp_path / "b", seed=1)
    ids = np.random.default_rng(0).integers(0, TEXT["vocab_size"], size=(16, 9))
    np.savez(tmp_path / "ids.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out"), "--method", "activations",
                     "--data", str(tmp_path / "ids.npz"), "--quiet"]) == 0
    report = json.loads((tmp_path / "out" / "rotsym_report.json").read_text())
    assert report["options"]["residual"] == "permutation" and report["result"]["chosen"]["measure"].endswith("loss of the merged model on the data")
    moved = tf.DebertaV2ForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    x = torch.as_tensor(ids[:4])
    with torch.no_grad():
        np.testing.assert_allclose(moved(input_ids=x).logits.numpy(), model_b(input_ids=x).logits.numpy(), rtol=1e-4, atol=1e-5)


def test_relative_positions_are_transformers_log_buckets():
    """The query-minus-key positions our forward pass gathers with, exact near the diagonal and in
    log buckets beyond, against transformers' build_relative_position (sequences longer than the
    conformance rows' 9 tokens, where the buckets' formula matters)."""
    torch = pytest.importorskip("torch")
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

    from rotsym_jax.families.nets.deberta import relative_positions

    for length, buckets, max_position in [(9, 8, 16), (64, 8, 16), (40, 16, 32), (600, 256, 512), (20, -1, 20)]:
        x = torch.zeros(1, length, 4)
        want = build_relative_position(x, x, bucket_size=buckets, max_position=max_position)[0].numpy()
        np.testing.assert_array_equal(np.asarray(relative_positions(length, buckets, max_position)), want, err_msg=str((length, buckets)))


def test_regmean_grams_count_the_positions_a_shared_projection_reads(tmp_path):
    """DeBERTa-v3's query and key project the tokens and the relative positions: each one's Gram
    matrix is the tokens' X^T X plus the normed position table's, the same for both (they read the
    same rows), and RegMean runs on it."""
    save_reference(tf.DebertaV2ForSequenceClassification, tf.DebertaV2Config(**TEXT, **DEBERTA_V3, num_labels=3), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    ids = np.random.default_rng(0).integers(0, TEXT["vocab_size"], size=(4, 9))
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    grams = rj.stats.grams(ck, ck.params, [batch]).values
    tokens = rj.stats.layer_inputs(ck, ck.params, batch)
    query, key = "layers/0/attention/query/kernel", "layers/0/attention/key/kernel"
    np.testing.assert_allclose(np.asarray(grams[query]), np.asarray(grams[key]), rtol=1e-6, atol=1e-5)
    positions = np.asarray(grams[query]) - tokens[query].T @ tokens[query]
    eigenvalues = np.linalg.eigvalsh(positions)
    assert eigenvalues.min() > -1e-3 * eigenvalues.max() and eigenvalues.max() > 1.0  # a table's X^T X, not nothing
    assert np.sum(eigenvalues > 1e-4 * eigenvalues.max()) <= 2 * DEBERTA_V3["position_buckets"]
    merged = rj.merge.regmean([ck.params, ck.params], [rj.stats.grams(ck, ck.params, [batch])] * 2)
    np.testing.assert_allclose(np.asarray(merged["layers"][0]["attention"]["query"]["kernel"]),
                               np.asarray(ck.params["layers"][0]["attention"]["query"]["kernel"]), rtol=1e-4, atol=1e-5)
