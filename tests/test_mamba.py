"""Mamba (model type mamba: selective state-space mixers, no attention). The generic contracts run on
its rows of family_cases.py; here, what is particular: every element kind proven in transformers
(the channels' permutation, the stream's, its rotation with the tied head written untied), and the
symmetries docs/MATH.md §17 states that no group of ours moves (the state's permutation and
scales, the time step's invertible maps: their leaves carry the channels' axis too), each proven
in transformers and named by inspect."""

import numpy as np
import pytest
import transformers as tf
from family_cases import MAMBA
from parity_utils import save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")
torch = pytest.importorskip("torch")


def test_every_group_holds_in_transformers(tmp_path, capsys):
    save_reference(tf.MambaForCausalLM, tf.MambaConfig(**MAMBA, use_bias=True), tmp_path / "lm")
    checks = {c.element: c for c in verify_groups(tmp_path / "lm")}
    proven = {e for e, c in checks.items() if c.ok and c.difference is not None}
    assert proven == {"FFN unit permutations", "residual permutation", "residual signed permutation", "residual rotation"}, checks
    assert all(c.note == ("no gated FFN (the scales solved are a gated FFN's units')" if e == "FFN unit scales" else "no attention block")
               for e, c in checks.items() if e not in proven)
    bound = rj.bind(rj.spec_for(rj.load_hf(tmp_path / "lm")), rj.load_hf(tmp_path / "lm").params)
    assert [(g.name, g.size) for g in bound.perms] == [("channels", 64)] and not bound.attention
    capsys.readouterr()
    assert cli.main(["inspect", str(tmp_path / "lm")]) == 0
    said = capsys.readouterr().out  # the groups left out, each named with its size (time_step_rank ceil(32 / 16))
    assert "no state group: the mixers' 4 state entries" in said and "no time-step group: any invertible map of dt's 2 entries" in said, said


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()


@pytest.mark.parametrize("element", ["state permutation", "state scale", "time-step map"])
def test_the_symmetries_no_group_moves_yet_keep_the_function(tmp_path, element):
    """MATH §17: the state's N entries permute (B's and C's rows of x_proj, A_log's columns, alike)
    and scale (B's rows by s, C's by 1/s: both linear in x, the state linear in B), and the time
    step's r entries take any invertible map M (x_proj's dt rows by M, dt_proj's columns by M^-1):
    transformers' logits stay; a permutation of B's rows alone changes them, and so does B's scale alone."""
    model = save_reference(tf.MambaForCausalLM, tf.MambaConfig(**MAMBA), tmp_path / "a")
    ids, mask = token_batch(MAMBA["vocab_size"], pad_id=0)
    want = _logits(model, ids, mask)
    r, n = model.config.time_step_rank, MAMBA["state_size"]
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for layer in model.backbone.layers:
            mixer = layer.mixer
            w = mixer.x_proj.weight  # (r + 2N, f): dt rows, B rows, C rows
            if element == "state permutation":
                p = torch.as_tensor(rng.permutation(n))
                w[r:r + n] = w[r:r + n][p].clone()
                w[r + n:] = w[r + n:][p].clone()
                mixer.A_log.copy_(mixer.A_log[:, p])
            elif element == "state scale":
                scale = torch.as_tensor(rng.uniform(0.3, 3.0, n)[:, None], dtype=torch.float32)
                w[r:r + n] *= scale
                w[r + n:] /= scale
            else:
                m = torch.as_tensor(rng.normal(size=(r, r)) + 2 * np.eye(r), dtype=torch.float32)
                w[:r] = m @ w[:r]
                mixer.dt_proj.weight.copy_(mixer.dt_proj.weight @ torch.linalg.inv(m))
    np.testing.assert_allclose(_logits(model, ids, mask), want, rtol=0, atol=1e-4 * np.abs(want).max())
    if element != "time-step map":  # B's rows alone: the states no longer pair with their readouts (or keep their scale)
        with torch.no_grad():
            w = model.backbone.layers[0].mixer.x_proj.weight
            w[r:r + n] = w[r:r + n].flip(0).clone() if element == "state permutation" else 2 * w[r:r + n]
        assert np.abs(_logits(model, ids, mask) - want).max() > 1e-3 * np.abs(want).max()
