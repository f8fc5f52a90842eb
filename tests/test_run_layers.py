"""`nets.layers.run_layers`: a run of layers with one structure and the same arguments is one scan
over their stacked weights (one layer compiled, not every layer), computing what the layers one
after another compute; layers of another structure, other arguments, a recording layer and a
run past SCANNED_BYTES are not stacked with the others."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from family_cases import CASES, model_inputs, reference
from flax import nnx
from parity_utils import save_reference

import rotsym_jax as rj
from rotsym_jax.families.nets import layers as L


class Block(nnx.Module):
    def __init__(self, d, rngs, act=jax.nn.gelu):
        self.up, self.down, self.act = L.dense(d, 2 * d, bias=True, dtype=jnp.float32, rngs=rngs), L.dense(2 * d, d, bias=True, dtype=jnp.float32, rngs=rngs), act

    def __call__(self, x, scale):
        return x + self.down(self.act(self.up(x))) * scale


def _blocks(acts, key=0):
    rngs = nnx.Rngs(key)
    return nnx.List([Block(8, rngs, act) for act in acts])


def _one_by_one(layers, x, args_of):
    for i, layer in enumerate(layers):
        x = layer(x, *args_of(i))
    return x


def _scans(layers, x, args_of) -> list[int]:
    """The lengths of the scans `run_layers` runs (from its program)."""
    jaxpr = jax.make_jaxpr(lambda x: L.run_layers(layers, x, args_of))(x)
    return [e.params["length"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]


X = np.random.default_rng(0).normal(size=(3, 5, 8)).astype(np.float32)


def test_a_run_of_alike_layers_is_one_scan_computing_the_layers_outputs():
    layers = _blocks([jax.nn.gelu] * 4)
    half, two = jnp.float32(0.5), jnp.float32(2.0)
    args_of = lambda i: (half,) if i < 3 else (two,)  # noqa: E731
    assert _scans(layers, X, args_of) == [3]  # the last layer's argument is another: it runs on its own
    np.testing.assert_allclose(L.run_layers(layers, X, args_of), _one_by_one(layers, X, args_of), rtol=1e-6, atol=1e-6)
    grad = jax.grad(lambda x: L.run_layers(layers, x, args_of).sum())(X)  # the backward pass through the scan
    np.testing.assert_allclose(grad, jax.grad(lambda x: _one_by_one(layers, x, args_of).sum())(X), rtol=1e-5, atol=1e-6)


def test_layers_of_another_structure_a_recording_layer_and_a_large_run_are_not_stacked(monkeypatch):
    args_of = lambda i: ONE  # noqa: E731
    mixed = _blocks([jax.nn.gelu, jax.nn.gelu, jax.nn.relu, jax.nn.relu, jax.nn.relu])
    assert _scans(mixed, X, args_of) == [2, 3]
    np.testing.assert_allclose(L.run_layers(mixed, X, args_of), _one_by_one(mixed, X, args_of), rtol=1e-6, atol=1e-6)
    recording = _blocks([jax.nn.gelu] * 3)
    recording[1].up.record = True  # (as `record_dense_inputs` sets it, under nnx.capture: tests/test_activations.py records every layer)
    assert [L._scannable(layer) for layer in recording] == [True, False, True]
    per_layer = 4 * (8 * 16 + 16 + 16 * 8 + 8)
    monkeypatch.setattr(L, "SCANNED_BYTES", 2 * per_layer)
    assert _scans(_blocks([jax.nn.gelu] * 5), X, args_of) == [2, 2]


ONE = (np.float32(1.0),)


@pytest.mark.parametrize("cls", ["BertForSequenceClassification", "LlamaForCausalLM"])
def test_a_familys_forward_pass_scans_its_layers(cls, tmp_path):
    """The families' passes run their layers through `run_layers`: the tiny models' two layers
    (tests/family_cases.py) in one scan, their outputs transformers' (as tests/test_conformance.py
    checks for every family)."""
    case = next(c for c in CASES if c.id == cls)
    model = save_reference(case.model_class, case.config(), tmp_path, **dict(case.kwargs))
    inputs = model_inputs(case, model.config)
    ck = rj.load_hf(tmp_path)
    assert "scan[" in str(jax.make_jaxpr(lambda p: ck.apply(p, **inputs))(ck.params)), f"{cls}: its layers are not scanned"
    want = reference(model, inputs)
    got = ck.apply(ck.params, **inputs)
    key = "logits"
    scale = float(np.abs(want[key]).max())
    mask = inputs["attention_mask"].astype(bool)[..., None] if np.ndim(want[key]) == 3 else True
    np.testing.assert_allclose(np.where(mask, got[key], 0.0), want[key], rtol=0, atol=1e-4 * scale)
