"""BLOOM's particulars: ALiBi's slopes as transformers computes them, and why the heads keep their
order (a head permutation, which every other group of ours allows, changes what transformers computes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from family_cases import BLOOM
from transformers.models.bloom import modeling_bloom

from rotsym_jax.families.bloom import BLOOM as RECORD
from rotsym_jax.families.nets.bloom import alibi_slopes


@pytest.mark.parametrize("heads", [1, 4, 6, 12, 16, 112])
def test_alibi_slopes_are_transformers(heads):
    want = modeling_bloom._get_alibi_slopes(heads, torch.device("cpu")).numpy()
    np.testing.assert_allclose(alibi_slopes(heads), want, rtol=1e-6)


def _permute_heads(model, perm):
    """Head j of every layer moved to slot perm[j]: the fused rows [H, 3, dh] and dense's columns."""
    h, dh = model.config.n_head, model.config.hidden_size // model.config.n_head
    with torch.no_grad():
        for block in model.h:
            qkv = block.self_attention.query_key_value
            qkv.weight.copy_(qkv.weight.reshape(h, 3 * dh, -1)[perm].reshape(qkv.weight.shape))
            qkv.bias.copy_(qkv.bias.reshape(h, 3 * dh)[perm].reshape(-1))
            dense = block.self_attention.dense
            dense.weight.copy_(dense.weight.reshape(-1, h, dh)[:, perm].reshape(dense.weight.shape))


def test_a_head_permutation_changes_the_function_so_the_heads_keep_their_order():
    torch.manual_seed(0)
    model = tf.BloomModel(tf.BloomConfig(**BLOOM)).eval()
    ids = torch.randint(3, 60, (2, 9))
    with torch.no_grad():
        before = model(ids).last_hidden_state
        _permute_heads(model, torch.tensor([1, 0, 2, 3, 4, 5]))
        swapped = model(ids).last_hidden_state
        _permute_heads(model, torch.tensor([1, 0, 2, 3, 4, 5]))  # its own inverse: the same function again
        back = model(ids).last_hidden_state
    assert (swapped - before).abs().max() > 1e-2  # two slopes exchanged between heads
    torch.testing.assert_close(back, before)
    assert RECORD.head_geometry(tf.BloomConfig(**BLOOM)).fixed_order
