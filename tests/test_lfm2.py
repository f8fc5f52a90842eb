"""LFM2 (model type lfm2): attention layers and gated short convolutions. The generic contracts run
on its rows of family_cases.py (a planted element there scales the convolutions' channels too);
here, every element kind proven in transformers, the convolutions' channel permutations and scales
among them, and the diagonal scalings of MATH §17, each applied in transformers."""

import copy

import numpy as np
import pytest
import transformers as tf
from family_cases import TEXT
from parity_utils import save_reference, token_batch

import rotsym_jax as rj
from rotsym_jax.verify import verify_groups

pytestmark = pytest.mark.usefixtures("float32_models")
torch = pytest.importorskip("torch")


def test_every_group_holds_in_transformers(tmp_path):
    config = tf.Lfm2Config(**{**TEXT, "num_hidden_layers": 3}, num_key_value_heads=2, full_attn_idxs=[1], conv_bias=True, tie_word_embeddings=False)
    save_reference(tf.Lfm2ForCausalLM, config, tmp_path / "lm")
    checks = {c.element: c for c in verify_groups(tmp_path / "lm")}
    assert all(c.ok for c in checks.values()), checks
    proven = {e for e, c in checks.items() if c.difference is not None}
    assert {"head permutations", "QK rotations", "FFN unit permutations", "residual rotation"} <= proven, checks
    ck = rj.load_hf(tmp_path / "lm")  # the "perm" kind proven above moves both: the FFNs' units, the convolutions' channels
    perms = rj.bind(rj.spec_for(ck), ck.params).perms
    assert sorted((g.name, g.size) for g in perms) == [("channels", 32), ("ffn", 256)]  # 2/3 of 48, up to a multiple of 256
    assert all(g.scaled for g in perms) and checks["FFN unit scales"].difference is not None  # the channels' scales among those proven


# Each channel's diagonal scalings (MATH §17): (b's row, x's row, the kernel, the conv bias, c's row,
# out_proj's column) times these; the rows' biases with their rows. Four hold; the last, the kernel
# scaled without its bias, does not.
SCALINGS = {
    "b against x": (1, -1, 0, 0, 0, 0),
    "c against out_proj (the unit scale solved)": (0, 0, 0, 0, 1, -1),
    "kernel and bias against c": (0, 0, 1, 1, -1, 0),
    "b and the conv bias against out_proj": (1, 0, 0, 1, 0, -1),
}


@pytest.fixture(scope="module")
def conv_model():
    torch.manual_seed(0)
    config = tf.Lfm2Config(**TEXT, num_key_value_heads=2, full_attn_idxs=[1], conv_bias=True, tie_word_embeddings=False)
    model = tf.Lfm2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # biases and gains away from their constants
    ids, mask = token_batch(TEXT["vocab_size"], pad_id=0)
    return model, torch.as_tensor(ids), torch.as_tensor(mask)


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits.numpy()


@pytest.mark.parametrize("name", [*SCALINGS, "kernel without its bias against c"])
def test_the_short_convolutions_diagonal_scalings(conv_model, name):
    """y = c * conv(b * x) + out_proj: b's channel against x's, c's against out_proj's column, the
    kernel (with its bias) against c, b (with the conv bias) against out_proj keep transformers'
    logits; the kernel scaled without its bias does not (the bias is added after the product)."""
    model, ids, mask = conv_model
    want = _logits(model, ids, mask)
    model = copy.deepcopy(model)
    powers = SCALINGS.get(name, (0, 0, 1, 0, -1, 0))
    d = TEXT["hidden_size"]
    s = torch.as_tensor(np.random.default_rng(2).uniform(0.3, 3.0, d), dtype=torch.float32)
    conv = model.model.layers[0].conv
    with torch.no_grad():
        for power, rows in zip((powers[0], powers[4], powers[1]), (slice(0, d), slice(d, 2 * d), slice(2 * d, 3 * d))):  # in_proj's b, c, x
            conv.in_proj.weight[rows] *= s[:, None] ** power
            conv.in_proj.bias[rows] *= s ** power
        conv.conv.weight.mul_(s[:, None, None] ** powers[2])
        conv.conv.bias.mul_(s ** powers[3])
        conv.out_proj.weight.mul_(s[None, :] ** powers[5])
    got = _logits(model, ids, mask)
    change = np.abs(got - want).max() / np.abs(want).max()
    assert change < 1e-5 if name in SCALINGS else change > 1e-3, change
