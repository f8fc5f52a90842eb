"""Option and input checks shared by the merge methods and OT fusion (internal).

Every check raises ValueError naming the option (or the model and leaf path) and what is allowed,
and returns the checked value, so that a caller validates everything before any work.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from .errors import InputError
from .pytree import flatten

TASK_HEAD = ("anchor", "merge")

# The kernels compute in float32: a larger option is inf there.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def choice(name: str, value, choices: Sequence[str]) -> str:
    """`value`, one of the strings `choices`; else ValueError naming the option and the choices."""
    if not isinstance(value, str) or value not in choices:
        raise InputError(f"{name}={value!r}; choose one of {choices}")
    return value


def scalar(name: str, value, *, low=None, high=None, low_open=False, high_open=False) -> float:
    """A real in the given interval, finite in float32, as a float; else ValueError naming the option."""
    lo = "(-inf" if low is None else ("(" if low_open else "[") + f"{low:g}"
    hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
    allowed = f"{name} must be a finite number in {lo}, {hi}"
    if low is None or high is None:  # the float32 bound is news only where the interval has none
        allowed += f" (and finite in float32, |{name}| <= {FLOAT32_MAX:.4g})"
    if isinstance(value, bool) or np.ndim(value) != 0:
        raise InputError(f"{name}={value!r}; {allowed}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name}={value!r}; {allowed}") from None
    ok = abs(x) <= FLOAT32_MAX  # False for inf and nan too
    if ok and low is not None:
        ok = x > low if low_open else x >= low
    if ok and high is not None:
        ok = x < high if high_open else x <= high
    if not ok:
        raise InputError(f"{name}={value!r}; {allowed}")
    return x


def prng_key(key):
    """One jax.random key: a typed key of shape (), or a legacy uint32 PRNGKey of shape (2,)."""
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ()
    raw = dtype == np.uint32 and shape == (2,)
    if not (typed or raw):
        raise InputError(f"key={key!r}; expected one jax.random key, e.g. jax.random.key(0)")
    return key


def weights(weights, n: int) -> np.ndarray:
    """(n,) float32 weights summing to 1: uniform for None, else the given ones (finite, >= 0,
    with a positive sum) normalised."""
    if weights is None:
        return np.full(n, 1.0 / n, np.float32)
    try:
        w = np.asarray(weights, np.float64)
    except (TypeError, ValueError):
        raise InputError(f"weights={weights!r}; expected one number per model") from None
    if w.shape != (n,):
        raise InputError(f"weights has shape {np.shape(weights)}; expected one weight per model, ({n},)")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or not np.any(w > 0):
        raise InputError(f"weights={w.tolist()}; weights must be finite, >= 0, with a positive sum")
    # Scaled by the largest first: the sum of huge weights (1e308 + 1e308) overflows to inf.
    w = w / w.max()
    return (w / w.sum()).astype(np.float32)


# The leaves every built-in family keeps its task head under, and those a model may lack (a pooler
# that some task classes drop): `Spec.task_head` and `Spec.optional` of the family specs.
TASK_HEAD_LEAVES = r"head/.*"
# A decoder's own (untied) LM head is one too where one model lacks it: a base and its classifier.
OPTIONAL_LEAVES = r"(pooler|lm_head)/.*"


# Leaves that stack one checkpoint tensor per slot on axis 0 (a mixture's experts): the per-tensor
# merges (TIES' trim, SLERP's angle) take each slot as its tensor, as a checkpoint stores it.
STACKED_LEAVES = r"layers/\d+/moe/(gate|up|down)/kernel"


def is_stacked(path: str) -> bool:
    return re.fullmatch(STACKED_LEAVES, path) is not None


def is_head(path: str) -> bool:
    """Whether a leaf path belongs to the task head (the top-level key "head")."""
    return re.fullmatch(TASK_HEAD_LEAVES, path) is not None


def is_optional(path: str) -> bool:
    """Whether a leaf path belongs to a part a model may lack (the pooler, a decoder's LM head)."""
    return re.fullmatch(OPTIONAL_LEAVES, path) is not None


def architecture_mismatch(anchor: tuple[str, str, Mapping], other: tuple[str, str, Mapping],
                          heads: tuple[Mapping, Mapping] | None = None) -> str | None:
    """None when two models, each (description, family, {leaf path: shape}), have one architecture
    once their task heads are left out (heads may differ, and a pooler be on one side only); else
    what differs: the family, or the leaves with both shapes (None where a model lacks the leaf),
    and with `heads` (each model's {block: HeadGeometry}) the attention heads where they differ too."""
    (what_a, family_a, shapes_a), (what_b, family_b, shapes_b) = anchor, other
    body_a = {p: tuple(s) for p, s in shapes_a.items() if not is_head(p)}
    body_b = {p: tuple(s) for p, s in shapes_b.items() if not is_head(p)}
    if family_a != family_b:
        return f"{what_b} does not have the architecture of {what_a}: a {family_b} model, not a {family_a} model"
    # A pooler one model lacks is no other architecture (the task classes that drop it).
    differ = sorted(p for p in body_a.keys() | body_b.keys() if body_a.get(p) != body_b.get(p)
                    and not (is_optional(p) and (p not in body_a or p not in body_b)))
    if not differ:
        return None
    differences = _differences(what_a, body_a, body_b)
    if heads is not None and (head_counts := _heads_difference(what_a, *heads)):
        differences.append(head_counts)
    return f"{what_b} does not have the architecture of {what_a}: " + "; ".join(differences)


# Config keys that name, label, store or train a model: no difference in them makes another
# architecture, nor changes what its tensors compute.
CONFIG_KEYS_OF_NO_ARCHITECTURE = frozenset({
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures", "id2label", "label2id",
    "num_labels", "problem_type", "finetuning_task", "use_cache", "return_dict", "output_hidden_states", "output_attentions",
    "tokenizer_class", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range", "gradient_checkpointing", "task_specific_params",
    "quantization_config",  # FP8 weights are read dequantized (a note of their own) and written unquantized
})


def dotted(config: Mapping, prefix: str = "") -> dict:
    """A config's values by dotted key ("text_config.use_qk_norm"): a difference is named where it is."""
    out = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(configs: Mapping[str, Mapping], ignore=CONFIG_KEYS_OF_NO_ARCHITECTURE, skip=()) -> tuple[list[str], str]:
    """The dotted keys whose values differ among configs ({model: config.json's dict}), dropouts,
    keys with a part in `ignore` and the keys `skip` left out, and the first four said with each
    model's value."""
    flat = {what: dotted(raw) for what, raw in configs.items()}
    keys = sorted({k for raw in flat.values() for k in raw if not ignore.intersection(k.split(".")) and k not in skip})
    differ = [k for k in keys if "dropout" not in k and "pdrop" not in k
              and len({json.dumps(raw.get(k), sort_keys=True, default=str) for raw in flat.values()}) > 1]
    shown = "; ".join(f"{k}: " + ", ".join(f"{w} {json.dumps(raw.get(k), default=str)[:40]}" for w, raw in flat.items()) for k in differ[:4])
    return differ, shown + (f" (and {len(differ) - 4} more)" if len(differ) > 4 else "")


def with_config_differences(problem: str | None, configs: Mapping[str, Mapping]) -> str | None:
    """`problem` (two models' architectures differ: their leaves or heads), followed by the config
    keys that differ ({model: config.json's dict}), which made them so: a reader changes a key, not a
    leaf (Llama 4's interleave_moe_layer_step moves its experts to other layers)."""
    if problem is None:
        return None
    differ, shown = config_differences(configs)
    return problem if not differ else f"{problem}; their configs differ in {shown}"


# A layer's index in our leaves (layers/3/...) and in a checkpoint's own names (model.layers.3., transformer.h.3.)
LAYER_INDEX = re.compile(r"(^|[./])(layers|layer|h|blocks|block)([./])(\d+)(?=[./])")


def _differences(what_a: str, body_a: Mapping, body_b: Mapping) -> list[str]:
    """How two bodies differ, as a reader says it: the depth, the leaves (in any layer) one holds
    and the other does not, the leaves of other shapes (the first three of each)."""
    def pattern(p):
        return LAYER_INDEX.sub(r"\1\2\3{i}", p)

    def depth(body):
        return len({m.group(4) for p in body if (m := LAYER_INDEX.search(p))})

    out = []
    if depth(body_a) != depth(body_b):
        out.append(f"{depth(body_b)} layers, {what_a}'s {depth(body_a)}")
    common_a = {pattern(p): tuple(s) for p, s in body_a.items()}
    common_b = {pattern(p): tuple(s) for p, s in body_b.items()}
    only_b = sorted(set(common_b) - set(common_a))
    only_a = sorted(set(common_a) - set(common_b))
    if only_b:
        out.append(f"it has {some(only_b, 3)}, which {what_a} has not")
    if only_a:
        out.append(f"it lacks {some(only_a, 3)}")
    shapes = [f"{p} {common_b[p]} vs {common_a[p]}" for p in sorted(set(common_a) & set(common_b)) if common_a[p] != common_b[p]]
    if shapes:
        out.append(f"other shapes (its vs {what_a}'s): " + ", ".join(shapes[:3]) + (f" (+{len(shapes) - 3} more)" if len(shapes) > 3 else ""))
    return out


def heads_mismatch(anchor: tuple[str, Mapping], other: tuple[str, Mapping]) -> str | None:
    """None when two models, each (description, {block: HeadGeometry}), split their attention into
    the same heads; else what differs. Their leaves may agree where the heads do not (GPT-2's
    c_attn holds 4 heads of 12 or 6 heads of 8 alike), and one spec reads both."""
    (what_a, heads_a), (what_b, heads_b) = anchor, other
    difference = _heads_difference(what_a, heads_a, heads_b)
    if difference is None:
        return None
    counts = lambda g: None if g is None else (g.num_heads, g.num_kv_heads, g.head_dim, g.v_dim)  # noqa: E731
    name = next(n for n in sorted(heads_a.keys() | heads_b.keys()) if heads_a.get(n) != heads_b.get(n))
    if counts(heads_a.get(name)) == counts(heads_b.get(name)):  # the heads compute otherwise (a QK-norm on one side)
        return f"{what_b} does not have the architecture of {what_a}: {difference}"
    return (f"{what_b} does not have the architecture of {what_a}: {difference}; heads of one size but other counts are embedded (a "
            "head size given by the config, as Llama's head_dim), heads of other sizes are not")


# What else makes two blocks' heads differ, as a reader says it.
_HEAD_TRAITS = {"rotary_dim": lambda v: f"RoPE on {v} dims" if v else "no RoPE", "qk_norm": lambda v: f"QK-norm {v!r}" if v else "no QK-norm",
                "fixed_order": lambda v: "the heads' order fixed" if v else "the heads' order free",
                "gated_output": lambda v: "gated outputs" if v else "ungated outputs",
                "shared_rope_dim": lambda v: f"a shared RoPE key of {v} dims" if v else "no shared RoPE key",
                "shared_rope_interleaved": lambda v: "the shared RoPE key's pairs interleaved" if v else "the shared RoPE key's pairs rotate_half's",
                "value_dim": lambda v: f"values {v} wide" if v else "values as wide as the keys"}


def _heads_difference(what_a: str, heads_a: Mapping, heads_b: Mapping) -> str | None:
    differ = sorted(name for name in heads_a.keys() | heads_b.keys() if heads_a.get(name) != heads_b.get(name))
    if not differ:
        return None
    name = differ[0]
    a, b = heads_a.get(name), heads_b.get(name)
    traits = [] if a is None or b is None else [t for t in _HEAD_TRAITS if getattr(a, t) != getattr(b, t)]

    def describe(g):
        if g is None:
            return "none"
        return ", ".join([f"{g.num_heads} heads of {g.head_dim} in {g.num_kv_heads} kv groups"]
                         + [_HEAD_TRAITS[t](getattr(g, t)) for t in traits])
    return f"its attention block {name!r} has {describe(b)}, {what_a}'s {describe(a)}"


def some(paths, n: int = 5) -> str:
    """The first `n` of a list of paths, and how many more there are."""
    return f"{paths[:n]}" + (f" (+{len(paths) - n} more)" if len(paths) > n else "")


# ---- models ----------------------------------------------------------------------------------------

def model_list(params_list, least: int = 2) -> list[tuple[str, Mapping]]:
    """[("params_list[i]", params)] for a list of at least `least` models."""
    if isinstance(params_list, Mapping) or not isinstance(params_list, Sequence):
        raise InputError(f"params_list must be a list of params pytrees, got {type(params_list).__name__}")
    if len(params_list) < least:
        raise InputError(f"params_list has {len(params_list)} model{'s' * (len(params_list) != 1)}; merging needs at least {least}")
    return [(f"params_list[{i}]", p) for i, p in enumerate(params_list)]


def mergeable(named: Sequence[tuple[str, Mapping]], task_head: str, anchor: int = 0):
    """Check that every named model has the anchor's merged leaves, with the same shapes (the head
    only counts when task_head="merge"; a pooler some models lack is not merged: the anchor's, if
    it has one, is kept).

    Returns the anchor's full flat params and, per model, {path: leaf} of the leaves to merge
    (everything, or everything but the head when task_head="anchor")."""
    choice("task_head", task_head, TASK_HEAD)
    for name, params in named:
        if not isinstance(params, Mapping):
            hint = ": pass checkpoint.params" if hasattr(params, "graphdef") else ""
            raise InputError(f"{name} must be a params pytree (a nested dict), got {type(params).__name__}{hint}")
    flats = [flatten(params) for _, params in named]
    ref_name, ref = named[anchor][0], flats[anchor]
    partial = {p for flat in flats for p in flat if is_optional(p) and any(p not in f for f in flats)}
    merged = [p for p in ref if (task_head == "merge" or not is_head(p)) and p not in partial]
    wanted = set(merged)
    for (name, _), flat in zip(named, flats):
        have = {p for p in flat if (task_head == "merge" or not is_head(p)) and p not in partial}
        if have != wanted:
            missing, extra = sorted(wanted - have), sorted(have - wanted)
            hint = ""
            if any(is_head(p) for p in missing + extra):
                hint = '; the task heads differ: task_head="anchor" (--task-head anchor, the default) keeps the anchor\'s head'
            raise InputError(
                f"{name} does not have the leaves of {ref_name} (the anchor): missing {some(missing)}, "
                f"extra {some(extra)}{hint}"
            )
        for path in merged:
            shape, ref_shape = np.shape(flat[path]), np.shape(ref[path])
            if shape != ref_shape:
                hint = ""
                if is_head(path):
                    hint = (
                        " (task heads of different label spaces cannot be merged: "
                        'task_head="anchor" (--task-head anchor, the default) keeps the anchor\'s head)'
                    )
                raise InputError(f"leaf {path!r} has shape {shape} in {name} but {ref_shape} in {ref_name} (the anchor){hint}")
    return ref, [{p: flat[p] for p in merged} for flat in flats]
