"""FlexOlmo (flex_olmo), beyond the conformance contracts (tests/family_cases.py): its config's own
RoPE theta read as transformers reads it, transformers 5's stacked experts read as save_pretrained's,
the stream's group (signed permutations: OLMo-2's output norms) and what is refused, by name."""

from __future__ import annotations

import pytest
import transformers as tf
from checkpoint_utils import assert_stacked_reads_as_apart
from family_cases import BY_ID
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import hf
from rotsym_jax.errors import InputError

pytestmark = pytest.mark.usefixtures("float32_models")

CASE = BY_ID["FlexOlmoForCausalLM"]


def test_a_config_without_rope_parameters_takes_flex_olmos_theta():
    """FlexOlmoConfig's default_theta is 500000 (Llama's is 10000): a config.json naming no RoPE reads as it."""
    raw = {"model_type": "flex_olmo", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "num_experts": 3,
           "num_experts_per_tok": 2}
    theirs = tf.FlexOlmoConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert hf.read_config(raw).rope_parameters == theirs.rope_parameters == {"rope_theta": 500000.0, "rope_type": "default"}


def test_the_stacked_state_dict_reads_as_save_pretrained_writes_it(tmp_path):
    model = save_reference(CASE.model_class, CASE.config(), tmp_path / "apart")
    names = ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")
    assert_stacked_reads_as_apart(model, tmp_path / "apart", tmp_path, names)


def test_the_stream_is_refused_a_rotation_by_name(tmp_path):
    """OLMo-2's norms on each sublayer's output: no rotation of the stream commutes with them, and
    folding for one is refused, naming the post-norms and the signed permutations that hold."""
    save_reference(CASE.model_class, CASE.config(), tmp_path / "a")
    ck = rj.load_hf(tmp_path / "a")
    with pytest.raises(InputError, match=r"residual='rotation' needs a pre-norm model.*use residual='signed_permutation'"):
        rj.fold_norms(rj.spec_for(ck), ck.params)


@pytest.mark.parametrize("change, match", [
    ({"num_experts_per_tok": 4}, r"num_experts_per_tok=4 exceeds num_experts=3"),
    ({"head_dim": 7}, r"head_dim=7: RoPE needs an even"),
])
def test_configs_we_do_not_read_are_refused_by_name(change, match):
    raw = {"model_type": "flex_olmo", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "num_experts": 3, **change}
    with pytest.raises(InputError, match=match):
        hf.read_config(raw)
