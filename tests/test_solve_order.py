"""Groups that share leaves on two axes (Mamba-1's channels with its state and time step, DeepSeek's
MLA latents with the attention block): the group solved first hands its assignment to the groups
solved after it, so each layer's linear assignment of a group runs once per chunk, in memory,
streamed and inside jit (counted on the host solver and on the traced callback)."""

import collections

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import DEEPSEEK, MAMBA
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax import streaming
from rotsym_jax.precision import is_traced
from rotsym_jax.solvers import assignment

pytestmark = pytest.mark.usefixtures("float32_models")
torch = pytest.importorskip("torch")

# Two layers each; DeepSeek without experts (their search is host-only, refused inside jit)
PAIRS = {
    "mamba": (tf.MambaForCausalLM, lambda: tf.MambaConfig(**MAMBA)),
    "deepseek": (tf.DeepseekV3ForCausalLM, lambda: tf.DeepseekV3Config(**{**DEEPSEEK, "num_hidden_layers": 2, "first_k_dense_replace": 2})),
}


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request, tmp_path_factory):
    cls, config = PAIRS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    for seed, name in enumerate("ab"):
        save_reference(cls, config(), root / name, seed=seed)
    return root / "a", root / "b"


@pytest.fixture
def solves(monkeypatch):
    """{(where, n): how many n x n assignments were asked of the host solver ("host") and, traced,
    of the callback (counted when traced, once per matrix of the batch)}."""
    counts = collections.Counter()
    host, assign = assignment.linear_assignments, assignment.assign

    def counted_host(scores, *args, **kwargs):
        counts.update(("host", np.shape(s)[-1]) for s in scores)
        return host(scores, *args, **kwargs)

    def counted_assign(scores, *args, **kwargs):
        if is_traced(scores):
            counts[("traced", scores.shape[-1])] += int(np.prod(scores.shape[:-2]))
        return assign(scores, *args, **kwargs)

    monkeypatch.setattr(assignment, "linear_assignments", counted_host)
    monkeypatch.setattr(assignment, "assign", counted_assign)
    return counts


def _once_per_layer(bound) -> dict:
    return {g.size: len(g.layers) for g in bound.perms}


def test_each_group_is_assigned_once_per_layer(pair, solves, tmp_path):
    a, b = pair
    ca, cb = rj.load_hf(a), rj.load_hf(b)
    spec = rj.spec_for(ca)
    bound = rj.bind(spec, ca.params)
    want = _once_per_layer(bound)
    assert len(want) == len(bound.perms) and any(g.after for g in bound.groups)  # the sizes tell the groups apart; some group reads another's
    rj.align(ca.params, cb.params, spec)
    assert {n: c for (where, n), c in solves.items() if where == "host"} == want, "in memory"
    solves.clear()
    streaming.align_to_disk(a, b, tmp_path / "streamed", chunk_layers=1)
    assert {n: c for (where, n), c in solves.items() if where == "host"} == want, "streamed"
    solves.clear()
    jax.jit(lambda x, y: rj.align(x, y, spec).params)(ca.params, cb.params)
    assert {n: c for (where, n), c in solves.items() if where == "traced"} == want, "traced"
