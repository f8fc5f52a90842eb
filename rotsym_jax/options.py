"""The choices of `align` and of the command line, in a module that imports nothing heavy (the
`rotsym` command builds its parsers from it before JAX is loaded), and `AlignOptions`: every
alignment option, defaulted and checked here once for every path (in memory, streaming,
`align_many`, recipes, the command line)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from .errors import InputError, InputTypeError

ATTENTION = ("rotation", "permutation", "none")
HEADS = ("fixed", "permute")
RESCALE = ("none", "sequential", "joint")
FFN = ("permutation", "none")
# The most bytes of float32 cost matrices an experts block holds at once (its pairs are batched up
# to it; one pair's matrix at least): the memory model counts it.
EXPERT_PAIR_BYTES = 2**28


def expert_pairs_at_once(num_experts: int, units: int) -> int:
    """How many expert pairs' (units, units) float32 cost matrices are held at once."""
    return max(1, min(num_experts, EXPERT_PAIR_BYTES // (4 * units * units)))
RESIDUAL = ("none", "permutation", "signed_permutation", "rotation")
# How the transforms are found: closed forms on the weights (the paper) or on the models' activations
# on data, or learned on data (gradient descent on the merged model's loss, from a closed form).
METHODS = ("weights", "activations", "learned")
# method="learned": the interpolation weight of B in the merged model at each step, the loss it is
# trained on ("auto": the task loss where the data has labels, else distillation), where it starts: "best" the
# start (identity, weight or activation matching) with the lowest held-out loss, or the closed form named (or the
# identity, where that is lower).
ALPHAS = ("half", "uniform")
OBJECTIVES = ("auto", "task", "distill")
INITS = ("best", "weights", "activations")
POLAR_METHODS = ("svd", "newton", "newton_schulz", "qdwh")
# Newton-Schulz: the fastest on CPU and GPU, as accurate as the SVD (see solvers' note on it).
DEFAULT_POLAR_METHOD = "newton_schulz"
# How a merge aligns its models: not at all, each to the first (the anchor), or all to their mean.
ALIGN_MODES = ("none", "anchor", "many")
# OT fusion's unit costs and transports.
OT_SOURCES = ("weights", "activations")
OT_TRANSPORTS = ("hard", "soft")
DTYPES = ("float32", "bfloat16", "float16", "float64")
TASK_HEADS = ("anchor", "merge")
# What the pipelines write: a Hugging Face folder (safetensors) or an Orbax checkpoint folder.
FORMATS = ("hf", "orbax")


@dataclasses.dataclass(frozen=True)
class AlignOptions:
    """Every option of `align` (its docstring says what each means), checked on construction.

    Frozen and hashable: a static argument of jitted code. `AlignOptions.of(mapping)` builds one
    from the keywords the command line, recipes and `align(**options)` use, naming unknown keys."""

    attention: str = "rotation"
    heads: str = "fixed"
    rescale: str = "sequential"
    ffn: str = "permutation"
    layers: tuple | None = None
    residual: str = "none"
    residual_sweeps: int = 8
    polar_method: str = DEFAULT_POLAR_METHOD
    method: str = "weights"
    # Keep the method's result only where neither the identity nor another closed form does better (`engine.choice`).
    fallback: bool = True
    # method="learned" (`engine.learned`)
    steps: int = 300
    learning_rate: float = 1e-3
    alpha: str = "half"
    objective: str = "auto"
    init: str = "best"
    holdout: float = 0.25
    eval_every: int = 10

    def __post_init__(self):
        for name, choices in (("attention", ATTENTION), ("heads", HEADS), ("rescale", RESCALE), ("ffn", FFN),
                              ("residual", RESIDUAL), ("polar_method", POLAR_METHODS), ("method", METHODS),
                              ("alpha", ALPHAS), ("objective", OBJECTIVES), ("init", INITS)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in choices:
                raise InputError(f"{name}={value!r}; choose one of {choices}")
        if not isinstance(self.fallback, bool):
            raise InputError(f"fallback={self.fallback!r}; expected True or False")
        for name in ("steps", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name}={value!r}; expected a positive integer")
        rate = self.learning_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < float("inf"):
            raise InputError(f"learning_rate={rate!r}; expected a positive number")
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, (int, float)) or not 0 <= self.holdout < 1:
            raise InputError(f"holdout={self.holdout!r}; expected a fraction in [0, 1)")
        if self.rescale == "joint" and self.attention != "rotation":
            raise InputError("rescale='joint' optimises over rotations: it needs attention='rotation'")
        sweeps = self.residual_sweeps
        if not isinstance(sweeps, int) or isinstance(sweeps, bool) or sweeps < 1:
            raise InputError(f"residual_sweeps={sweeps!r}; expected a positive integer")
        if self.layers is not None:
            object.__setattr__(self, "layers", _layer_labels(self.layers))

    @classmethod
    def of(cls, options: AlignOptions | Mapping | None = None, **overrides) -> AlignOptions:
        """`options` (an AlignOptions, a mapping of its fields, or None for the defaults) with
        `overrides`; TypeError naming keys that are not options."""
        if isinstance(options, AlignOptions):
            return dataclasses.replace(options, **overrides) if overrides else options
        given = {**dict(options or {}), **overrides}
        unknown = sorted(set(given) - set(FIELDS))
        if unknown:
            raise InputTypeError(f"unknown align options {unknown}; the options are {list(FIELDS)}")
        return cls(**given)

    def as_dict(self) -> dict:
        """The options as plain keywords (layers as a list): what reports and recipes record."""
        out = dataclasses.asdict(self)
        out["layers"] = None if self.layers is None else list(self.layers)
        return out


FIELDS = tuple(f.name for f in dataclasses.fields(AlignOptions))


def _layer_labels(layers) -> tuple:
    """Layer indices as a sorted tuple (ints, or the strings a custom spec captures); TypeError
    for what is not a collection of indices (a bool is an int to Python: [True] would silently
    mean layer 1)."""
    if isinstance(layers, (str, bytes, int)) or not isinstance(layers, Collection):
        raise InputTypeError(f"layers={layers!r}; expected a collection of layer indices, e.g. [0, 3], or None for all")
    def is_label(layer) -> bool:  # ints (NumPy's too, named without importing NumPy) or strings, not bools
        if isinstance(layer, bool) or type(layer).__name__ == "bool_":
            return False
        return isinstance(layer, (int, str)) or type(layer).__name__.startswith(("int", "uint"))

    not_labels = [layer for layer in layers if not is_label(layer)]
    if not_labels:
        raise InputTypeError(f"layers={layers!r}: {not_labels} are not layer indices")
    labels = {layer if isinstance(layer, str) else int(layer) for layer in layers}
    return tuple(sorted(labels, key=lambda l: (isinstance(l, str), str(l) if isinstance(l, str) else l)))
