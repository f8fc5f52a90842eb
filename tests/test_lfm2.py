"""LFM2 (model type lfm2): attention layers and gated short convolutions. The generic contracts run
on its rows of family_cases.py; here, every element kind proven in transformers, the
convolutions' channel permutations among them."""

import pytest
import transformers as tf
from family_cases import TEXT
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")


def test_every_group_holds_in_transformers(tmp_path):
    config = tf.Lfm2Config(**{**TEXT, "num_hidden_layers": 3}, num_key_value_heads=2, full_attn_idxs=[1], conv_bias=True, tie_word_embeddings=False)
    save_reference(tf.Lfm2ForCausalLM, config, tmp_path / "lm")
    checks = {c.element: c for c in verify_groups(tmp_path / "lm")}
    assert all(c.ok for c in checks.values()), checks
    proven = {e for e, c in checks.items() if c.difference is not None}
    assert {"head permutations", "QK rotations", "FFN unit permutations", "residual rotation"} <= proven, checks
    ck = rj.load_hf(tmp_path / "lm")  # the "perm" kind proven above moves both: the FFNs' units, the convolutions' channels
    assert sorted((g.name, g.size) for g in rj.bind(rj.spec_for(ck), ck.params).perms) == [("channels", 32), ("ffn", 256)]  # 2/3 of 48, up to a multiple of 256
