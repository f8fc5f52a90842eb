"""GLM-4-MoE (model type glm4_moe). The generic contracts run on its rows of family_cases.py (its
mixture is DeepSeek-V3's: tests/test_deepseek.py shows why its experts keep their routing group);
here, every element kind proven in transformers, with the per-head QK-norm and without."""

import pytest
import transformers as tf
from family_cases import GLM4_MOE
from parity_utils import save_reference

from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
def test_every_group_holds_in_transformers(tmp_path, qk_norm):
    save_reference(tf.Glm4MoeForCausalLM, tf.Glm4MoeConfig(**GLM4_MOE, attention_bias=True, use_qk_norm=qk_norm), tmp_path / "lm")
    checks = {c.element: c for c in verify_groups(tmp_path / "lm")}
    assert len(checks) == 12 and all(c.ok for c in checks.values()), checks
    # the QK-norm leaves Q/K sign flips of rotary pairs (no scale, no invertible map); everything else is proven
    unproven = {e for e, c in checks.items() if c.difference is None}
    assert unproven == ({"QK scales", "QK invertible maps"} if qk_norm else set()), checks
