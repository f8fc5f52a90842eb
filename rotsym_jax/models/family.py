"""How a model family maps to Hugging Face checkpoints.

A `Family` says how to build our Flax model from a config, which HF tensor becomes
which of our leaves (a list of `TensorRule`s, one per HF tensor), which head a checkpoint carries
(`Layout`), its symmetry spec (`Family.spec`), and what it reads from config.json (a
`ConfigSchema` per model_type, see `config.py`). The loader and saver in `rotsym_jax.hf` are
generic over families. Every function of a family reads the config by attribute, so it takes a
`ModelConfig` or a transformers config alike.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ..spec import HeadGeometry, Spec
from .config import ConfigSchema

# Every family's leaves follow one naming scheme, so one rule list is every family's spec; the
# head geometry is each family's own (`Family.head_geometry`).
_LAYER = r"layers/(?P<layer>\d+)"
# Leaves no symmetry group touches, listed explicitly so that a new leaf is never skipped silently.
# (The O bias and the FFN output bias live outside every head / hidden unit, MATH §1.)
_UNTOUCHED = (
    r"(embeddings|final_norm|pooler|head|lm_head)/.*"
    r"|layers/(?P<layer>\d+)/(attention_norm/.*|mlp_norm/.*|attention/out/bias|mlp/down/bias)"
)
SPEC_RULES = (
    (rf"{_LAYER}/attention/query/kernel", (None, "attn.q")),
    (rf"{_LAYER}/attention/query/bias", ("attn.q",)),
    (rf"{_LAYER}/attention/key/kernel", (None, "attn.k")),
    (rf"{_LAYER}/attention/key/bias", ("attn.k",)),
    (rf"{_LAYER}/attention/value/kernel", (None, "attn.v")),
    (rf"{_LAYER}/attention/value/bias", ("attn.v",)),
    (rf"{_LAYER}/attention/out/kernel", ("attn.o", None)),
    (rf"{_LAYER}/mlp/(up|gate)/kernel", (None, "ffn")),
    (rf"{_LAYER}/mlp/(up|gate)/bias", ("ffn",)),
    (rf"{_LAYER}/mlp/down/kernel", ("ffn", None)),
    (_UNTOUCHED, None),
)


# Every family keeps its task head under `head/` (`checks.is_head`): it takes no part in alignment.
TASK_HEAD = r"head/.*"


def multi_head_geometry(config) -> HeadGeometry:
    """Multi-head attention without RoPE, head width hidden_size / num_heads."""
    heads = config.num_attention_heads
    return HeadGeometry(heads, heads, config.hidden_size // heads)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a checkpoint holds besides the base model.

    prefix: the base-model prefix its tensor names carry ("" for a bare `BertModel`, "bert." for
        `BertForSequenceClassification`); saved checkpoints keep it.
    head: the task head ("sequence_classification", "image_classification", "lm") or None.
    pooler: whether the base model has a pooler (BERT/RoBERTa/ViT).
    """

    prefix: str = ""
    head: str | None = None
    pooler: bool = False

    def name(self, base_name: str) -> str:
        return self.prefix + base_name


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One HF tensor <-> one or more of our leaves.

    `to_ours(hf_array) -> tuple of arrays` (one per path in `ours`), `to_hf(tuple) -> hf_array`.
    Both take and return NumPy arrays and must be inverses of each other.
    """

    hf: str
    ours: tuple[str, ...]
    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_hf: Callable[[tuple[np.ndarray, ...]], np.ndarray]


def copy(hf: str, ours: str) -> TensorRule:
    return TensorRule(hf, (ours,), lambda a: (a,), lambda t: t[0])


def reshaped(hf: str, ours: str, hf_shape: tuple, our_shape: tuple) -> TensorRule:
    return TensorRule(
        hf, (ours,), lambda a: (a.reshape(our_shape),), lambda t: t[0].reshape(hf_shape)
    )


def linear(hf_module: str, our_module: str, *, bias: bool = True) -> list[TensorRule]:
    """torch nn.Linear (weight (out, in)) -> our kernel (in, out) and bias."""
    rules = [TensorRule(f"{hf_module}.weight", (f"{our_module}/kernel",), lambda a: (a.T,), lambda t: t[0].T)]
    if bias:
        rules.append(copy(f"{hf_module}.bias", f"{our_module}/bias"))
    return rules


def conv1d(hf_module: str, our_module: str) -> list[TensorRule]:
    """GPT-2 Conv1D already stores (in, out)."""
    return [copy(f"{hf_module}.weight", f"{our_module}/kernel"), copy(f"{hf_module}.bias", f"{our_module}/bias")]


def layer_norm(hf_module: str, our_module: str, *, bias: bool = True) -> list[TensorRule]:
    rules = [copy(f"{hf_module}.weight", f"{our_module}/scale")]
    if bias:
        rules.append(copy(f"{hf_module}.bias", f"{our_module}/bias"))
    return rules


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family (one Flax model class, several HF `model_type`s).

    configs: a ConfigSchema per model_type the family serves: what it reads from config.json
    build(config, layout, dtype, rngs) -> nnx.Module
    tensors(config, layout) -> list[TensorRule] (full HF names, prefix applied via layout.name)
    detect(names, config) -> Layout, from the set of HF tensor names present
    architecture(config, layout) -> the transformers class name saved in config.architectures
    prefix: the base-model prefix of headed checkpoints (transformers' `base_model_prefix` + ".")
    ignored: regexes of HF tensor names that are buffers, not parameters (skipped on load)
    tied(config, layout) -> {HF name: our leaf path} of tensors HF ties to one of ours: accepted
        on load when equal to the tensor that fills that leaf, never saved
    head_geometry(config) -> HeadGeometry of the attention blocks (read from the config)
    """

    name: str
    configs: tuple[ConfigSchema, ...]
    build: Callable[..., Any]
    tensors: Callable[[Any, Layout], list[TensorRule]]
    detect: Callable[[set[str], Any], Layout]
    architecture: Callable[[Any, Layout], str]
    prefix: str = ""
    ignored: tuple[str, ...] = ()
    tied: Callable[[Any, Layout], dict[str, str]] = lambda config, layout: {}
    head_geometry: Callable[[Any], HeadGeometry] = multi_head_geometry

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(c.model_type for c in self.configs)

    def schema(self, model_type: str) -> ConfigSchema:
        return next(c for c in self.configs if c.model_type == model_type)

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.ignored)

    def spec(self, config) -> Spec:
        """Per-head QK/VO groups of every layer's attention (GQA groups, RoPE pairs where the
        family uses RoPE) and the FFN hidden-unit permutation (gate and up together)."""
        from ..residual import residual_spec  # the residual stream's rules (MATH §8), used by align(residual=...)

        return Spec(SPEC_RULES, heads={"attn": self.head_geometry(config)}, residual=residual_spec(self.name), task_head=TASK_HEAD)


def detect_prefix(names: set[str], prefix: str, base_marker: str) -> str:
    """'' when the base model's tensors are bare, `prefix` when they carry it."""
    if prefix + base_marker in names:
        return prefix
    return ""
