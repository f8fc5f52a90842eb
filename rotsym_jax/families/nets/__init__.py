"""The Flax NNX forward passes of the families, where data flows through a model (barriers,
statistics, activations, learned alignment). Imported on first use (`rotsym_jax.nets`, or a
record's `build`): aligning and merging from weights never loads Flax."""

from __future__ import annotations

import functools

import jax
from flax import nnx

from ...precision import committed
from . import (  # noqa: F401
    afmoe,
    bart,
    bert,
    bloom,
    clip,
    deberta,
    decoders,
    deepseek,
    dinov2,
    distilbert,
    electra,
    ernie4_5_moe,
    gpt2,
    gpt_neo,
    gpt_neox,
    gpt_oss,
    granitemoehybrid,
    heads,
    layers,
    lfm2,
    llama,
    llama4,
    mamba,
    mamba2,
    marian,
    minimax,
    modernbert,
    opt,
    phi,
    phimoe,
    qwen3_next,
    siglip,
    t5,
    vit,
    whisper,
)


def merged(graphdef, params) -> nnx.Module:
    """The NNX module of `graphdef` with `params` (a pure dict) merged in."""
    return nnx.merge(graphdef, params)


def apply(graphdef, params, inputs: dict) -> dict:
    """The forward pass of `graphdef` with `params` on `inputs`, jitted per graph (and per
    argument placement: `precision.committed`)."""
    return _apply(graphdef, *committed((params, inputs)))


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, params, inputs: dict) -> dict:
    return nnx.merge(graphdef, params)(**inputs)


def initialised(build, key) -> dict:
    """The parameters (a pure dict) of the module `build(rngs)` initialises from `key`."""
    _, state = nnx.split(build(nnx.Rngs(key)))
    return nnx.to_pure_dict(state)


def graph(build):
    """The graph of the module `build(rngs)`, without initialising it (shapes only)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: build(_OneKey(jax.random.key(0)))))
    return graphdef


class _OneKey:
    """Rngs whose every stream (`rngs.params()`) gives one key, for a graph of shapes alone (no
    initial value is computed). nnx.Rngs counts its draws in a Variable, and under eval_shape each
    count's update asks the traced count for its sharding, an AttributeError whose message walks and
    prints the trace so far: 0.27 s a graph of the conformance tests' 2-layer models (253 graphs),
    nearly all of it. The graph is the same: a module keeps no rngs."""

    def __init__(self, key):
        self._key = key

    def __getattr__(self, stream: str):
        if stream.startswith("_"):
            raise AttributeError(stream)
        return lambda: self._key
