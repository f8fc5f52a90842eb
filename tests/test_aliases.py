"""RoBERTa's architecture under other model_types: XLM-RoBERTa (`xlm-roberta`) and CamemBERT
(`camembert`). transformers' modeling files for both are RoBERTa's, renamed (same module tree,
base_model_prefix "roberta", padding_idx position ids, the dense + tanh + out_proj classification
head): each is read as the `roberta` family, against the transformers model of its own class, and
saved back with its own model_type and `architectures`.

Model types with RoBERTa-like names whose architecture or tensor names differ stay refused
(test_the_look_alikes_stay_refused says which and why)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers as tf
from parity_utils import TOL, assert_outputs_match, assert_same_state_dict, reference_with_base, save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax import hf

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99)

# model_type: (config class, base model class, sequence-classification class, class-name stem)
ALIASES = {
    "xlm-roberta": (tf.XLMRobertaConfig, tf.XLMRobertaModel, tf.XLMRobertaForSequenceClassification, "XLMRoberta"),
    "camembert": (tf.CamembertConfig, tf.CamembertModel, tf.CamembertForSequenceClassification, "Camembert"),
}
# variant: (head?, model kwargs, the Auto class transformers loads the saved folder with)
VARIANTS = {
    "base": (False, {}, tf.AutoModel),
    "base-no-pooler": (False, dict(add_pooling_layer=False), tf.AutoModel),
    "cls": (True, {}, tf.AutoModelForSequenceClassification),
}
CASES = [(t, v) for t in sorted(ALIASES) for v in sorted(VARIANTS)]


def _reference(model_type, variant, folder, seed=0):
    config_cls, base_cls, cls_cls, _ = ALIASES[model_type]
    head, kwargs, _ = VARIANTS[variant]
    config = config_cls(**SMALL, num_labels=3) if head else config_cls(**SMALL)
    cls = cls_cls if head else base_cls
    return cls, kwargs, save_reference(cls, config, folder, seed=seed, **kwargs)


def _inputs(pad_id, seed=0):
    """A batch with a right-padded row (token_batch) and a left-padded one: RoBERTa numbers
    positions over the non-padding tokens from padding_idx + 1, so left padding must not shift
    the real tokens' positions."""
    ids, mask = token_batch(SMALL["vocab_size"], batch=4, pad_id=pad_id, seed=seed)
    mask[1, :2] = 0
    ids[1, :2] = pad_id
    token_types = np.zeros_like(ids)
    token_types[:, 5:] = 1
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=token_types)


@pytest.mark.parametrize("model_type, variant", CASES)
def test_matches_transformers_and_round_trips(model_type, variant, tmp_path):
    cls, kwargs, ref_model = _reference(model_type, variant, tmp_path / "ref")
    stem, (head, _, auto_cls) = ALIASES[model_type][3], VARIANTS[variant]
    ck = rj.load_hf(tmp_path / "ref")
    assert (ck.family, ck.model_config.model_type) == ("roberta", model_type)
    assert (ck.layout.prefix, ck.layout.head, ck.layout.pooler) == (
        "roberta." if head else "", "sequence_classification" if head else None, ref_model.base_model.pooler is not None,
    )
    assert ck.config.pad_token_id == 1
    inputs = _inputs(ck.config.pad_token_id)
    ref = reference_with_base(ref_model, **inputs)
    ours = ck.apply(ck.params, **inputs)
    keys = [k for k in ("last_hidden_state", "pooler_output", "logits") if k in ref]
    assert set(keys) == set(ours)
    valid = inputs["attention_mask"].astype(bool)
    assert_outputs_match(ours, ref, keys, valid=valid, min_ref_std=0.1)

    out = rj.save_hf(ck, ck.params, tmp_path / "saved")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == model_type
    assert saved["architectures"] == [stem + ("ForSequenceClassification" if head else "Model")]
    reloaded, info = cls.from_pretrained(out, output_loading_info=True, attn_implementation="eager", **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_same_state_dict(reloaded, ref_model)
    assert_outputs_match(reference_with_base(reloaded.eval(), **inputs), ref, keys, valid=valid, tol=1e-6)
    # transformers' Auto classes map the saved model_type back to this model_type's own class.
    auto = auto_cls.from_pretrained(out, attn_implementation="eager", **kwargs)
    assert type(auto) is cls and type(auto.config) is ALIASES[model_type][0]


@pytest.mark.parametrize("model_type", sorted(ALIASES))
def test_a_symmetry_transform_keeps_the_outputs(model_type, tmp_path):
    """spec_for + a random transform of every kind: our outputs do not change, and transformers
    computes the same outputs from the saved, transformed checkpoint."""
    cls, kwargs, _ = _reference(model_type, "cls", tmp_path / "ref", seed=1)
    ck = rj.load_hf(tmp_path / "ref")
    spec = rj.spec_for(ck)
    assert spec == rj.spec_for(rj.load_hf(tmp_path / "ref").model_config)
    moved = rj.apply_transform(spec, ck.params, rj.random_transform(spec, ck.params, jax.random.key(0)))
    q, q_moved = (np.asarray(p["layers"][0]["attention"]["query"]["kernel"]) for p in (ck.params, moved))
    assert np.max(np.abs(q - q_moved)) > 0.1 * np.max(np.abs(q)), "the transform did not move the parameters"
    inputs = _inputs(ck.config.pad_token_id, seed=2)
    before, after = ck.apply(ck.params, **inputs), ck.apply(moved, **inputs)
    valid = inputs["attention_mask"].astype(bool)
    for key in ("last_hidden_state", "logits"):
        a, b = np.asarray(before[key]), np.asarray(after[key])
        if key == "last_hidden_state":
            a, b = a[valid], b[valid]
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(np.max(np.abs(a))), key

    rj.save_hf(ck, moved, tmp_path / "moved")
    theirs = cls.from_pretrained(tmp_path / "moved", attn_implementation="eager", **kwargs).eval()
    assert_outputs_match(reference_with_base(theirs, **inputs), after, ["last_hidden_state", "logits"], valid=valid, tol=TOL)


@pytest.mark.parametrize("model_type, why", [
    ("xlm-roberta-xl", "pre-LayerNorm layers and a final encoder LayerNorm, no embeddings LayerNorm"),
    ("roberta-prelayernorm", "pre-LayerNorm, base_model_prefix 'roberta_prelayernorm'"),
    ("data2vec-text", "RoBERTa's forward pass, but base_model_prefix 'data2vec_text' (other tensor names)"),
    ("xmod", "per-language adapters in every layer"),
    ("jina_embeddings_v3", "rotary attention, no position embeddings"),
    ("bert-generation", "no token-type embeddings and no pooler"),
    ("megatron-bert", "pre-LayerNorm"),
])
def test_the_look_alikes_stay_refused(model_type, why):
    with pytest.raises(rj.CheckpointError, match=f"unsupported model_type '{model_type}'"):
        hf.read_config({"model_type": model_type, **SMALL})
