"""GLM and GLM-4 (model types glm, glm4). The generic contracts run on their rows of family_cases.py;
here, every element kind proven in transformers: GLM's stream rotates (pre-norm), GLM-4's only
permutes and flips signs (its sublayers' output norms), said by name."""

import pytest
import transformers as tf
from family_cases import TEXT
from parity_utils import save_reference

from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")
SIZES = dict(TEXT, num_key_value_heads=2, head_dim=16, pad_token_id=0)


@pytest.mark.parametrize("cls, config, rotates", [(tf.GlmForCausalLM, tf.GlmConfig, True), (tf.Glm4ForCausalLM, tf.Glm4Config, False)],
                         ids=["glm", "glm4"])
def test_every_group_holds_in_transformers(tmp_path, cls, config, rotates):
    save_reference(cls, config(**SIZES), tmp_path / "lm")
    checks = {c.element: c for c in verify_groups(tmp_path / "lm")}
    assert len(checks) == 12 and all(c.ok for c in checks.values()), checks
    unproven = {e for e, c in checks.items() if c.difference is None}
    assert unproven == (set() if rotates else {"residual rotation"}), checks
    if not rotates:
        assert "each sublayer's output passes an RMSNorm gain" in checks["residual rotation"].note
