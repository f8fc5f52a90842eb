"""GPT-J (model type gptj). The generic contracts (parity of our forward pass, round trip, every
group kept in transformers, planted recovery, streamed = in memory, aligned and averaged is A) run
on its rows of family_cases.py; here, what is particular: its interleaved rotary pairs, held in
our leaves in the rotate_half order, each group proven in transformers through that reordering,
a model aligned from the command line, and the rotary widths transformers cannot run refused."""

import json

import numpy as np
import pytest
import safetensors.numpy
import transformers as tf
from family_cases import GPTJ
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import cli
from rotsym_jax.io import hf
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")


def test_rotary_pairs_are_held_in_rotate_half_order(tmp_path):
    """Each head's interleaved pairs (2i, 2i + 1) of q_proj and k_proj are our columns (i, i + r/2);
    the entries past rotary_dim and v_proj keep their order."""
    save_reference(tf.GPTJForCausalLM, tf.GPTJConfig(**GPTJ), tmp_path / "gptj")
    stored = safetensors.numpy.load_file(tmp_path / "gptj" / "model.safetensors")
    attention = rj.load_hf(tmp_path / "gptj").params["layers"][1]["attention"]
    heads, dh, r = GPTJ["n_head"], GPTJ["n_embd"] // GPTJ["n_head"], GPTJ["rotary_dim"]
    for proj, leaf in (("q_proj", "query"), ("k_proj", "key")):
        theirs = stored[f"transformer.h.1.attn.{proj}.weight"].T.reshape(-1, heads, dh)
        ours = np.asarray(attention[leaf]["kernel"]).reshape(-1, heads, dh)
        np.testing.assert_array_equal(ours[..., : r // 2], theirs[..., 0:r:2], err_msg=proj)
        np.testing.assert_array_equal(ours[..., r // 2 : r], theirs[..., 1:r:2], err_msg=proj)
        np.testing.assert_array_equal(ours[..., r:], theirs[..., r:], err_msg=proj)
    np.testing.assert_array_equal(np.asarray(attention["value"]["kernel"]), stored["transformer.h.1.attn.v_proj.weight"].T)


def test_every_group_holds_in_transformers(tmp_path):
    """Head permutations, RoPE-compatible QK rotations (in our order, written back interleaved),
    VO rotations, scales and invertible maps, FFN and residual permutations, and rotations of the
    stream that fix the ones vector each keep the LM's logits in transformers; the stream's sign
    flips cannot (LayerNorm), and `verify` says why."""
    save_reference(tf.GPTJForCausalLM, tf.GPTJConfig(**GPTJ), tmp_path / "gptj")
    checks = {c.element: c for c in verify_groups(tmp_path / "gptj")}
    unproven = checks.pop("residual signed permutation")
    assert unproven.difference is None and "LayerNorm" in unproven.note
    scales = checks.pop("FFN unit scales")  # a GELU MLP: no unit scales
    assert scales.difference is None and "no gated FFN" in scales.note
    assert len(checks) == 10 and all(c.ok and c.difference is not None for c in checks.values()), checks


def test_rotsym_align_moves_b_to_a_and_transformers_computes_bs_logits(tmp_path):
    """The command line on two GPT-Js as transformers writes them: the aligned B is nearer A and
    computes B's logits in transformers."""
    torch = pytest.importorskip("torch")
    config = tf.GPTJConfig(**GPTJ)
    save_reference(tf.GPTJForCausalLM, config, tmp_path / "a")
    model_b = save_reference(tf.GPTJForCausalLM, config, tmp_path / "b", seed=1)
    assert cli.main(["align", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "moved"), "--ffn", "permutation"]) == 0
    report = json.loads((tmp_path / "moved" / "rotsym_report.json").read_text())
    assert report["result"]["after"]["total"] < report["result"]["before"]["total"]
    ids = torch.tensor(np.random.default_rng(0).integers(0, GPTJ["vocab_size"], (2, 9)))
    moved = tf.GPTJForCausalLM.from_pretrained(tmp_path / "moved", attn_implementation="eager").eval()
    with torch.no_grad():
        want, got = model_b(ids).logits.numpy(), moved(ids).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("rotary_dim, refusal", [
    (5, "rotary_dim=5"), (32, r"rotary_dim=32: .* in \(0, 16\]"), (None, "rotary_dim=None"),
], ids=["odd", "wider-than-a-head", "null"])
def test_a_rotary_width_transformers_cannot_run_is_refused_by_name(rotary_dim, refusal):
    raw = {"model_type": "gptj", "n_embd": 64, "n_head": 4, "n_layer": 2, "rotary_dim": rotary_dim}
    with pytest.raises(rj.RotsymError, match=refusal):
        hf.read_config(raw)
