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


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """{family: (A's folder, B's)}, each pair saved once, when a test first asks for it."""
    saved = {}

    def pair(name):
        if name not in saved:
            cls, config = PAIRS[name]
            root = tmp_path_factory.mktemp(name)
            for seed, side in enumerate("ab"):
                save_reference(cls, config(), root / side, seed=seed)
            saved[name] = root / "a", root / "b"
        return saved[name]

    return pair


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


def _align(mode, a, b, out):
    ca, cb = rj.load_hf(a), rj.load_hf(b)
    spec = rj.spec_for(ca)
    if mode == "memory":
        rj.align(ca.params, cb.params, spec)
    elif mode == "streamed":  # a layer a chunk
        streaming.align_to_disk(a, b, out, chunk_layers=1)
    else:  # inside jit: the assignments are callbacks, counted as they are traced
        jax.jit(lambda x, y: rj.align(x, y, spec).params)(ca.params, cb.params)
    return rj.bind(spec, ca.params)


# Streamed and traced run the same driver on other programs: the slow run's (the default run's budget)
@pytest.mark.parametrize("family, mode", [pytest.param(f, m, marks=[pytest.mark.slow] if m != "memory" else [])
                                          for f in sorted(PAIRS) for m in ("memory", "streamed", "traced")])
def test_each_group_is_assigned_once_per_layer(pairs, family, mode, solves, tmp_path):
    """Every permutation group's assignment (its size tells it apart) asked once per layer: before,
    Mamba's channels were assigned three times (their own, the state's and the time step's) and each
    MLA latent twice (its own, the attention block's)."""
    bound = _align(mode, *pairs(family), tmp_path / "out")
    want = {g.size: len(g.layers) for g in bound.perms}
    assert len(want) == len(bound.perms) and any(g.after for g in bound.groups)  # the sizes tell the groups apart; some group reads another's
    assert {n: c for (where, n), c in solves.items() if where == ("traced" if mode == "traced" else "host")} == want, dict(solves)
