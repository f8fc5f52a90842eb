"""RoBERTa's architecture under other model_types: XLM-RoBERTa (`xlm-roberta`) and CamemBERT
(`camembert`). transformers' modeling files for both are RoBERTa's, renamed (same module tree,
base_model_prefix "roberta", padding_idx position ids, the dense + tanh + out_proj classification
head): each is read as the `roberta` family, against the transformers model of its own class, and
saved back with its own model_type and `architectures`. Their parity, round trip, invariance and
recovery run in test_conformance.py.

Model types with RoBERTa-like names whose architecture or tensor names differ stay refused
(test_the_look_alikes_stay_refused says which and why)."""

import json

import pytest
import transformers as tf
from family_cases import BY_ID
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import hf

# Model outputs are compared: run them at float32 (conftest.float32_models says why).
pytestmark = pytest.mark.usefixtures("float32_models")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=99)

# The alias rows of the conformance table (parity, round trip, invariance and recovery run there), by model_type.
ALIASES = {"xlm-roberta": ("XLMRobertaModel", "XLMRobertaModel[no-pooler]", "XLMRobertaForSequenceClassification"),
           "camembert": ("CamembertModel", "CamembertModel[no-pooler]", "CamembertForSequenceClassification")}


@pytest.mark.parametrize("name", [n for names in ALIASES.values() for n in names])
def test_saved_with_its_own_model_type_and_loaded_by_the_auto_class(name, tmp_path):
    case = BY_ID[name]
    model_type = next(t for t, names in ALIASES.items() if name in names)
    save_reference(case.model_class, case.config(), tmp_path / "ref", **dict(case.kwargs))
    ck = rj.load_hf(tmp_path / "ref")
    assert (ck.family, ck.model_config.model_type, ck.config.pad_token_id) == ("roberta", model_type, 1)
    assert ck.layout.prefix == ("roberta." if case.head else "")
    assert rj.spec_for(ck) == rj.spec_for(ck.model_config)
    out = rj.save_hf(ck, ck.params, tmp_path / "saved")
    saved = json.loads((out / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == (model_type, [case.cls])
    # transformers' Auto classes map the saved model_type back to this model_type's own class.
    auto_cls = tf.AutoModelForSequenceClassification if case.head else tf.AutoModel
    auto = auto_cls.from_pretrained(out, attn_implementation="eager", **dict(case.kwargs))
    assert type(auto) is case.model_class and type(auto.config) is type(case.config())


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
