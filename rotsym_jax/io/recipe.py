"""Merge recipes: the YAML file `rotsym merge CONFIG.yaml OUT` reads, checked key by key (errors
name the key and its line), and the data it names, turned into batches of model inputs.

    models: [path/to/a, path/to/b]        # the first is the anchor (its task head and tokenizer are kept)
    method: ties                          # a name of rotsym_jax.merge.METHODS
    params: {density: 0.5}                # the method's declared parameters
    base: path/to/base                    # task_arithmetic, ties, dare
    align: anchor                         # none | anchor | many
    align_options: {heads: permute, rescale: joint, ffn: permutation, attention: rotation, layers: [0, 3], residual: permutation,
                    method: activations}      # method: weights (default) | activations | learned (on the data below;
                                          # fallback: false keeps its own result; learned: steps, learning_rate, patience, alpha, objective, init, holdout, eval_every)
    weights: [1, 2]                       # average, fisher, ot_fusion: one weight per model (normalised)
    task_head: anchor                     # anchor | merge
    dtype: bfloat16                       # the saved dtype (default: the anchor's)
    seed: 0                               # the key of methods that draw (dare)
    data:                                 # fisher, regmean, ot_fusion with source: activations, align_options.method
      file: texts.jsonl                   # {"text": ..., "label": ...} per line, tokenized with the anchor's tokenizer,
                                          # or an .npz with pixel_values (+ labels) for ViTs, or an .npz of token ids:
                                          # input_ids (+ attention_mask, token_type_ids, labels), no tokenizer needed
      text_field: text
      label_field: label                  # optional: without labels the Fisher is the expected one
      batch_size: 8
      count: 64                           # examples used (default: all)
      max_length: 128
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ..errors import RotsymError
from ..families.labels import label_nll, lm_labels
from ..options import ALIGN_MODES, DECLARED, DTYPES, FORMATS, TASK_HEADS, moving
from ._files import HUB_ID
from .tokenizers import load_tokenizer


class RecipeError(RotsymError, ValueError):
    """A recipe that cannot be run as written."""


@dataclasses.dataclass(frozen=True)
class Data:
    file: Path
    text_field: str = "text"
    label_field: str | None = "label"
    batch_size: int = 8
    count: int | None = None
    max_length: int = 128


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A merge as data (`load` reads one from YAML; `pipeline.merge_checkpoints` runs it). Its
    fields are checked on construction, before any model is read (RecipeError naming the field);
    the method's parameters and the alignment options are checked where they are known (the
    method's registry, `AlignOptions`)."""

    models: tuple[str, ...]
    method: str
    params: dict = dataclasses.field(default_factory=dict)
    base: str | None = None
    align: str = "anchor"
    align_options: dict = dataclasses.field(default_factory=dict)
    task_head: str = "anchor"
    dtype: str | None = None
    seed: int = 0
    data: Data | None = None
    weights: tuple[float, ...] | None = None

    def __post_init__(self):
        models = self.models
        if isinstance(models, (str, Path)) or not isinstance(models, (list, tuple)) or len(models) < 2:
            raise RecipeError(f"models={short(repr(models))}; expected a list of at least two checkpoint paths (the first is the anchor)")
        object.__setattr__(self, "models", tuple(str(m) for m in models))
        for name, ok, expected in (
            ("method", isinstance(self.method, str), "a merge method's name"),
            ("params", isinstance(self.params, dict), "a mapping of the method's parameters"),
            ("base", self.base is None or isinstance(self.base, (str, Path)), "None or a path"),
            ("align", self.align in ALIGN_MODES, f"one of {ALIGN_MODES}"),
            ("align_options", isinstance(self.align_options, dict), "a mapping of align's options"),
            ("task_head", self.task_head in TASK_HEADS, f"one of {TASK_HEADS}"),
            ("dtype", self.dtype is None or self.dtype in DTYPES, f"None or one of {DTYPES}"),
            ("seed", is_seed(self.seed), SEED),
        ):
            if not ok:
                raise RecipeError(f"{name}={short(repr(getattr(self, name)))}; expected {expected}")
        given = moving(self.align_options)
        if self.align == "none" and given:
            raise RecipeError(f"align_options {short(repr(given))} with align: none, which aligns nothing; "
                              "give align: anchor (or many), or drop the options")
        if self.base is not None:
            object.__setattr__(self, "base", str(self.base))
        if self.weights is not None:
            w = self.weights
            if not isinstance(w, (list, tuple)) or len(w) != len(self.models) or not all(_positive_number(x) for x in w):
                raise RecipeError(f"weights={short(repr(w))}; expected one positive number per model ({len(self.models)})")
            object.__setattr__(self, "weights", tuple(float(x) for x in w))


SEED = "an integer in [-2**63, 2**63) (a 64-bit random key)"


def is_seed(x) -> bool:
    """A seed `jax.random.key` takes (a larger one was an OverflowError, after the models were read)."""
    return isinstance(x, int) and not isinstance(x, bool) and -2**63 <= x < 2**63


def _positive_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")


# key: (type check, description); the description goes into the error.
_TOP = {
    "models": (lambda v: isinstance(v, list) and len(v) >= 2 and all(isinstance(x, str) for x in v), "a list of at least two paths"),
    "method": (lambda v: isinstance(v, str), "a merge method's name"),
    "params": (lambda v: isinstance(v, dict), "a mapping of the method's parameters"),
    "base": (lambda v: isinstance(v, str), "a path"),
    "align": (lambda v: v in ALIGN_MODES, f"one of {ALIGN_MODES}"),
    "align_options": (lambda v: isinstance(v, dict), "a mapping of align's options"),
    "task_head": (lambda v: v in TASK_HEADS, f"one of {TASK_HEADS}"),
    "dtype": (lambda v: v in DTYPES, f"one of {DTYPES}"),
    "seed": (is_seed, SEED),
    "data": (lambda v: isinstance(v, dict), "a mapping (file, text_field, label_field, batch_size, count, max_length)"),
    "weights": (lambda v: isinstance(v, list) and all(_positive_number(x) for x in v), "a list of positive numbers, one per model"),
}
# every alignment option, checked as `AlignOptions` checks it (declared once there)
ALIGN_KEYS = {name: (declared.ok, declared.expected) for name, declared in DECLARED.items()}
_positive = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1")
DATA_KEYS = {
    "file": (lambda v: isinstance(v, str), "a path to a .jsonl or .npz file"),
    "text_field": (lambda v: isinstance(v, str), "a field name"),
    "label_field": (lambda v: v is None or isinstance(v, str), "a field name or null"),
    "batch_size": _positive,
    "count": _positive,
    "max_length": _positive,
}


# A recipe or mergekit config holds a few hundred lines: a file past this is refused before the YAML
# parser reads it (a config listing 200,000 models held the parser for minutes; 1 MiB takes 10 s).
MAX_CONFIG_BYTES = 2**18


def config_text(path: Path, what: str) -> str:
    """The text of the YAML file `path` (`what`: "recipe", "config"), its size bounded first."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise RecipeError(f"{path}: over {MAX_CONFIG_BYTES:,} bytes; a {what} is at most that much YAML (it holds a few hundred lines)")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: cannot read the {what} ({getattr(e, 'strerror', None) or e})") from None


def yaml_mapping(path: Path, what: str, keys: str) -> tuple[str, dict]:
    """(the text, {key: (key node, value node)}) of the YAML mapping in the file `path` (`what`:
    "mergekit config", ...; `keys`: what its keys are, for the refusal of another YAML value),
    its size, syntax and nodes checked (`check_nodes`) before anything is built from it."""
    text = config_text(path, what)
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({short(getattr(e, 'problem', None) or e)})") from None
    if not isinstance(root, yaml.MappingNode):
        raise RecipeError(f"{path}: a {what} is a mapping of keys ({keys}, ...)")
    check_nodes(path, root)
    return text, {k.value: (k, v) for k, v in root.value}


def _recipe_root(path: Path, keys: str):
    """The checked YAML mapping node of the recipe at `path` (`keys`: what its keys are, for the
    refusal of another YAML value)."""
    text = config_text(path, "recipe")
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise RecipeError(f"{path}: {where}not valid YAML ({short(getattr(e, 'problem', None) or e)})") from None
    except RecursionError:
        raise RecipeError(f"{path}: the YAML is nested too deeply for a recipe") from None
    if not isinstance(root, yaml.MappingNode):
        raise RecipeError(f"{path}: a recipe is a mapping of keys ({keys}, ...)")
    check_nodes(path, root)
    return root


def is_align_recipe(path: str | Path) -> bool:
    """Whether the YAML file `path` is the recipe an align wrote (`command: align` at its top), its
    nodes checked as every recipe's are; a file that does not read is left to the reader that
    refuses it."""
    try:
        root = _recipe_root(Path(path), "command")
    except RecipeError:
        return False
    return any(k.value == "command" and isinstance(v, yaml.ScalarNode) and v.value == "align" for k, v in root.value)


def load(path: str | Path) -> Recipe:
    """Read and check the recipe at `path`: unknown keys, wrong types and missing files are
    RecipeError naming the key and its line. Relative paths are relative to the recipe's folder."""
    path = Path(path)
    root = _recipe_root(path, "models, method, params")
    if is_align_recipe(path):
        raise RecipeError(f"{path}: the recipe of an align (command: align), which `rotsym align {path} OUT` replays; a merge "
                          "recipe names its models and method")
    _refuse_mergekit_without_method(path, root)
    top = checked_keys(path, root, _TOP, "")
    for key in ("models", "method"):
        if key not in top:
            raise RecipeError(f"{path}: the key {key!r} is missing")
    nodes = {k.value: v for k, v in root.value}
    align_options = checked_keys(path, nodes["align_options"], ALIGN_KEYS, "align_options.") if "align_options" in top else {}
    data = data_of(path, nodes["data"], prefix="data.") if "data" in top else None
    models = tuple(str(_resolve(path, m, hub=True)) for m in top["models"])
    base = str(_resolve(path, top["base"], hub=True)) if "base" in top else None
    return Recipe(
        models=models, method=top["method"], params=dict(top.get("params", {})), base=base, align=top.get("align", "anchor"),
        align_options=align_options, task_head=top.get("task_head", "anchor"), dtype=top.get("dtype"), seed=top.get("seed", 0), data=data,
        weights=top.get("weights"),
    )


@dataclasses.dataclass(frozen=True)
class AlignRecipe:
    """What an align ran: the recipe `rotsym align` writes into OUT (`command: align`), which
    `rotsym align RECIPE.yaml OUT` replays. `options`: the alignment options as run (`recorded`)."""

    a: str
    b: str
    options: dict
    format: str = "hf"
    dtype: str | None = None
    data: Data | None = None
    seed: int = 0

    def to_yaml(self, folder: Path | None = None) -> str:
        """The recipe as YAML, its paths relative to `folder`, where it is written (as `to_yaml`)."""
        raw = {"command": "align", "a": written_path(self.a, folder), "b": written_path(self.b, folder), "options": dict(self.options),
               **({"format": self.format} if self.format != "hf" else {}), **({"dtype": self.dtype} if self.dtype is not None else {}),
               **({"data": data_node(self.data, folder)} if self.data is not None else {}),
               **({"seed": self.seed} if self.options.get("method") == "learned" else {})}
        return yaml.safe_dump(raw, sort_keys=False)


_ALIGN_TOP = {
    "command": (lambda v: v == "align", "align"),
    "a": (lambda v: isinstance(v, str), "a path (the anchor)"),
    "b": (lambda v: isinstance(v, str), "a path (the model moved)"),
    "options": (lambda v: isinstance(v, dict), "a mapping of align's options"),
    "format": (lambda v: v in FORMATS, f"one of {FORMATS}"),
    "dtype": (lambda v: v in DTYPES, f"one of {DTYPES}"),
    "data": (lambda v: isinstance(v, dict), "a mapping (file, text_field, label_field, batch_size, count, max_length)"),
    "seed": (is_seed, SEED),
}


def load_align(path: str | Path) -> AlignRecipe:
    """Read and check the align recipe at `path`, as `load` checks a merge recipe; its paths are
    relative to its folder (a Hub id as it is)."""
    path = Path(path)
    root = _recipe_root(path, "command, a, b, options")
    top = checked_keys(path, root, _ALIGN_TOP, "")
    for key in ("command", "a", "b"):
        if key not in top:
            raise RecipeError(f"{path}: the key {key!r} is missing")
    nodes = {k.value: v for k, v in root.value}
    options = checked_keys(path, nodes["options"], ALIGN_KEYS, "options.") if "options" in top else {}
    data = data_of(path, nodes["data"], prefix="data.") if "data" in top else None
    return AlignRecipe(a=str(_resolve(path, top["a"], hub=True)), b=str(_resolve(path, top["b"], hub=True)), options=options,
                       format=top.get("format", "hf"), dtype=top.get("dtype"), data=data, seed=top.get("seed", 0))


# Keys only a mergekit config has: a file with them but no merge_method is a mergekit config whose
# merge_method is missing or misspelled, not a rotsym recipe.
MERGEKIT_KEYS = ("merge_method", "base_model", "slices", "modules", "parameters", "out_dtype", "tokenizer_source", "tokenizer", "chat_template")


def _refuse_mergekit_without_method(path: Path, root) -> None:
    keys = [k for k, _ in root.value]
    models = next((v for k, v in root.value if k.value == "models"), None)
    mergekit_shaped = isinstance(models, yaml.SequenceNode) and any(isinstance(m, yaml.MappingNode) for m in models.value)
    theirs = [k.value for k in keys if k.value in MERGEKIT_KEYS]
    if not (mergekit_shaped or theirs):
        return
    close = difflib.get_close_matches("merge_method", [k.value for k in keys if k.value not in _TOP], n=1)
    hint = f"; {close[0]!r} at line {line_of(next(k for k in keys if k.value == close[0]))} is not merge_method" if close else ""
    raise RecipeError(f"{path}: a mergekit config ({', '.join(theirs) or 'models: with model: entries'}) without its merge_method key"
                      f"{hint}; rotsym reads a file without one as its own recipe (models, method, params)")


def data_of(path: Path, node, prefix: str) -> Data:
    """The data section `node` of the YAML file `path` (its file relative to the file's folder), checked."""
    fields = checked_keys(path, node, DATA_KEYS, prefix)
    if "file" not in fields:
        raise RecipeError(f"{path}: line {line_of(node)}: {prefix}file is missing")
    file = _resolve(path, fields.pop("file"))
    if not file.is_file():
        raise RecipeError(f"{path}: line {line_of(value_node(node, 'file'))}: {prefix}file {file} does not exist")
    if file.suffix not in (".jsonl", ".npz"):
        raise RecipeError(f"{path}: {prefix}file {file}: expected a .jsonl (texts) or an .npz (pixel_values, input_features or input_ids) file")
    return Data(file, **fields)


# A recipe is a few dozen values: YAML aliases that expand it beyond this are refused ("billion
# laughs": 7 levels of nested aliases in 401 bytes made an 802 MB error message and 2.6 GB).
MAX_NODES = 10_000
# The tags of plain values (those YAML's safe loader constructs): `!!python/...` is refused by name.
_PLAIN_TAGS = frozenset([tag for tag in yaml.SafeLoader.yaml_constructors if tag] + ["tag:yaml.org,2002:merge"])


def check_nodes(path: Path, root) -> None:
    """Refuse what a recipe never needs and a hostile one may hold: tags beyond YAML's own (Python
    objects, `!!python/object/apply:os.system`: never constructed here, refused by name), recursive
    aliases, and aliases expanding the recipe beyond MAX_NODES values. The node graph is walked
    once, each shared node counted as often as aliases repeat it, without expanding anything."""
    size, on_path, stack = {}, set(), [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else \
            list(node.value) if isinstance(node, yaml.SequenceNode) else []
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            if size[key] > MAX_NODES:
                raise RecipeError(f"{path}: line {line_of(node)}: its YAML holds more than {MAX_NODES} values, aliases expanded; a "
                                  "recipe holds a few dozen (refused: nested aliases can make a small file expand without bound)")
            continue
        if key in size:
            continue
        if key in on_path:
            raise RecipeError(f"{path}: line {line_of(node)}: a YAML alias refers to a value that contains it (a recursive alias)")
        if node.tag not in _PLAIN_TAGS:
            tag = "!!" + node.tag.removeprefix("tag:yaml.org,2002:") if node.tag.startswith("tag:yaml.org,2002:") else node.tag
            raise RecipeError(f"{path}: line {line_of(node)}: the YAML tag {short(tag)} is not allowed in a recipe (plain "
                              "values only: nothing is constructed from tags)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)


def short(value, limit: int = 60) -> str:
    """`value` as an error message shows it: its repr on one line, cut at `limit` characters."""
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(str(text).split("\n"))
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def checked_keys(path: Path, node, schema: dict, prefix: str) -> dict:
    if not isinstance(node, yaml.MappingNode):
        raise RecipeError(f"{path}: line {line_of(node)}: {prefix.rstrip('.') or 'the recipe'} must be a mapping")
    out = {}
    for key_node, value_node in node.value:
        key = key_node.value
        if key not in schema:
            raise RecipeError(f"{path}: line {line_of(key_node)}: unknown key {prefix}{key}; known keys: {sorted(schema)}")
        try:
            value = yaml.safe_load(yaml.serialize(value_node))
        except (yaml.YAMLError, ValueError, OverflowError) as e:  # a value YAML's safe loader cannot construct (a bad timestamp...)
            raise RecipeError(f"{path}: line {line_of(key_node)}: {prefix}{key}: not a plain value ({short(getattr(e, 'problem', None) or e)})") from None
        ok, expected = schema[key]
        if not ok(value):
            raise RecipeError(f"{path}: line {line_of(key_node)}: {prefix}{key} = {short(repr(value))}; expected {expected}")
        out[key] = value
    return out


def line_of(node) -> int:
    return node.start_mark.line + 1


def value_node(mapping, key):
    return next(v for k, v in mapping.value if k.value == key)


def _resolve(recipe: Path, path: str, *, hub: bool = False) -> Path | str:
    """A path of the recipe at `recipe`, relative to its folder; with `hub`, a Hugging Face Hub id
    (org/name) as it is, where no such folder is there (nor in the working directory)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    beside = recipe.parent / p
    return path if hub and HUB_ID.fullmatch(path) and not beside.exists() and not p.exists() else beside


def written_path(path, folder: Path | None) -> str:
    """`path` as a recipe written into `folder` names it: a relative path made relative to that
    folder, which its reader resolves it against; an absolute path or a Hub id as it is."""
    if folder is None or Path(path).expanduser().is_absolute() or (HUB_ID.fullmatch(str(path)) and not Path(path).exists()):
        return str(path)
    return os.path.relpath(Path(path).expanduser().absolute(), Path(folder).absolute())


def data_node(data: Data, folder: Path | None = None) -> dict:
    """`data` as a recipe's `data` mapping: its file as a string (relative to `folder`, where the
    recipe is written); a field left at its default None (count: every example) left out, since
    the recipe's reader takes an integer there, not null."""
    defaults = {f.name: f.default for f in dataclasses.fields(Data)}
    node = {k: v for k, v in dataclasses.asdict(data).items() if not (v is None and defaults[k] is None)}
    return {**node, "file": written_path(data.file, folder)}


def to_yaml(recipe: Recipe, folder: Path | None = None) -> str:
    """The recipe as YAML (what `rotsym merge` writes into its output as rotsym_config.yaml), its
    paths relative to `folder`, where it is written (None: as they are), so that it replays."""
    raw = dataclasses.asdict(recipe)
    raw["models"] = [written_path(m, folder) for m in recipe.models]
    if recipe.base is not None:
        raw["base"] = written_path(recipe.base, folder)
    raw["weights"] = None if recipe.weights is None else list(recipe.weights)
    if recipe.data is not None:
        raw["data"] = data_node(recipe.data, folder)
    return yaml.safe_dump({k: v for k, v in raw.items() if v not in (None, {})}, sort_keys=False)


# ---- data -------------------------------------------------------------------------------------------

def batches(data: Data, checkpoint) -> list[dict[str, Any]]:
    """Batches of model inputs for `checkpoint` (the anchor) from `data`: texts tokenized with the
    tokenizer in the anchor's folder (padded to max_length), or an .npz's pixel_values or token
    ids; "labels" when the data has them (a causal LM's: the next tokens)."""
    if not data.file.is_file():
        raise RecipeError(f"{data.file}: no such file" + ("" if not data.file.exists() else " (it is a folder)"))
    if data.file.suffix == ".npz":
        columns, lines = _arrays(data.file, data.count), None
    else:
        columns, lines = _tokenized(data, checkpoint)
    if "input_ids" in columns and checkpoint.layout.head == "lm" and "labels" not in columns:
        columns["labels"] = lm_labels(checkpoint, columns)
    n = len(next(iter(columns.values())))
    n = min(n, data.count or n)
    if n == 0:
        raise RecipeError(f"{data.file}: no examples")
    out = []
    for i in range(0, n, data.batch_size):
        batch = {k: v[i : i + data.batch_size] for k, v in columns.items()}
        last = min(n, i + data.batch_size) - 1
        where = f"{data.file}: " + (f"examples {i}-{last}" if lines is None else f"lines {lines[i]}-{lines[last]}")
        try:  # what the model cannot read, labels outside its label space: refused here, not NaN later
            checkpoint.check_batch(batch, where)
        except ValueError as e:
            raise RecipeError(str(e)) from None
        out.append(batch)
    return out


NPZ_TOKENS = ("input_ids", "attention_mask", "token_type_ids", "labels")
# an encoder–decoder's: the decoder's inputs (T5, BART, Whisper), beside the encoder's
NPZ_DECODER = ("decoder_input_ids", "decoder_attention_mask")


# The arrays of an .npz, as stored (uncompressed), read at most: their headers are read first, so
# that a small compressed file of zeros cannot expand to gigabytes.
MAX_NPZ_BYTES = 2**28


def _stored_bytes(archive, file: Path) -> int:
    """The bytes the arrays of an open .npz hold once read, from their headers alone."""
    total = 0
    for member in archive.zip.namelist():
        with archive.zip.open(member) as f:
            try:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(f, max_header_size=2**16)
            except ValueError as e:
                raise RecipeError(f"{file}: {member} is not a NumPy array ({e})") from None
        total += math.prod(shape) * dtype.itemsize
    return total


def _arrays(file: Path, count: int | None = None) -> dict[str, np.ndarray]:
    """An .npz's model inputs: pixel_values (+ labels), input_features (Whisper's log-mel frames),
    or token ids (+ attention_mask, token_type_ids, labels); an encoder–decoder's decoder_input_ids
    (+ decoder_attention_mask) beside them; each with one row per example (the first `count`)."""
    try:
        archive = np.load(file)
    except (OSError, ValueError) as e:
        raise RecipeError(f"{file}: not a readable .npz ({e})") from None
    with archive:
        stored = _stored_bytes(archive, file)
        if stored > MAX_NPZ_BYTES:
            raise RecipeError(f"{file}: its arrays hold {stored / 2**20:,.0f} MiB once read, over the {MAX_NPZ_BYTES / 2**20:.0f} MiB "
                              "read at most; give fewer examples")
        names = set(archive.files)
        read = lambda k: np.asarray(archive[k])[:count]  # noqa: E731
        if "input_features" in names:  # Whisper's log-mel frames (examples, mel bins, frames)
            columns = {"input_features": np.asarray(read("input_features"), np.float32)}
            if columns["input_features"].ndim != 3:
                raise RecipeError(f"{file}: input_features has shape {columns['input_features'].shape}; expected (examples, mel bins, frames)")
        elif "pixel_values" in names:
            columns = {"pixel_values": np.asarray(read("pixel_values"), np.float32)}
            if "labels" in names:
                labels = read("labels")
                if not np.issubdtype(labels.dtype, np.integer):
                    raise RecipeError(f"{file}: labels has dtype {labels.dtype}; labels must be integer class indices")
                columns["labels"] = labels.astype(np.int32)
        elif "input_ids" in names:
            columns = {k: read(k) for k in NPZ_TOKENS if k in names}
            for k, v in columns.items():
                if not np.issubdtype(v.dtype, np.integer):
                    raise RecipeError(f"{file}: {k} has dtype {v.dtype}; token arrays must be integers")
                columns[k] = v.astype(np.int32)
            ids = columns["input_ids"]
            if ids.ndim != 2:
                raise RecipeError(f"{file}: input_ids has shape {ids.shape}; expected (examples, tokens)")
            for k in ("attention_mask", "token_type_ids"):
                if k in columns and columns[k].shape != ids.shape:
                    raise RecipeError(f"{file}: {k} has shape {columns[k].shape}; expected input_ids' {ids.shape}")
        else:
            raise RecipeError(f"{file}: holds {sorted(names)}; an .npz of data needs 'pixel_values' (images), 'input_features' "
                              "(log-mel frames) or 'input_ids' (token ids)")
        for k in NPZ_DECODER:
            if k in names:
                decoder = read(k)
                if not np.issubdtype(decoder.dtype, np.integer) or decoder.ndim != 2:
                    raise RecipeError(f"{file}: {k} has dtype {decoder.dtype} and shape {decoder.shape}; expected integers "
                                      "(examples, tokens)")
                columns[k] = decoder.astype(np.int32)
        if "decoder_attention_mask" in columns and columns["decoder_attention_mask"].shape != columns.get("decoder_input_ids", np.empty(0)).shape:
            raise RecipeError(f"{file}: decoder_attention_mask needs decoder_input_ids of its shape")
    lengths = {k: len(v) for k, v in columns.items()}
    if len(set(lengths.values())) > 1:
        raise RecipeError(f"{file}: its arrays hold different numbers of examples: {lengths}")
    return columns


# Bounds on the texts of a JSONL file, checked as it is read (a line at a time) and before any is
# tokenized: a tokenizer reads a whole text before --max-length cuts it (a 50 MB text took 66 s and
# 6.6 GB). Only the first `count` texts are read.
MAX_TEXT_CHARS = 2**17
MAX_TEXTS_CHARS = 2**24
_MAX_LINE_CHARS = 8 * MAX_TEXT_CHARS  # a text at the limit, as JSON escapes may write it


def _jsonl_lines(file: Path, enough):
    """(number, line) of the lines of a JSONL file, each read with a bound on its length, until
    `enough()` (checked before each line is read)."""
    try:
        with open(file, encoding="utf-8") as f:
            number = 0
            while not enough() and (line := f.readline(_MAX_LINE_CHARS + 1)):
                number += 1
                if len(line) > _MAX_LINE_CHARS:
                    raise RecipeError(f"{file}: line {number} is over {_MAX_LINE_CHARS:,} characters long; a text may hold at most "
                                      f"{MAX_TEXT_CHARS:,} characters (split longer ones: --max-length keeps only a text's first tokens)")
                yield number, line
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{file}: cannot read it as text ({getattr(e, 'strerror', None) or e})") from None


def _tokenized(data: Data, checkpoint) -> dict[str, np.ndarray]:
    texts, labels, lines = [], [], []
    names = None  # the model's label names (config.json's label2id), read when a label is a name
    total = 0
    for number, line in _jsonl_lines(data.file, lambda: data.count is not None and len(texts) >= data.count):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            raise RecipeError(f"{data.file}: line {number} is not JSON") from None
        if not isinstance(row, dict) or not isinstance(row.get(data.text_field), str):
            raise RecipeError(f"{data.file}: line {number} has no text field {data.text_field!r}")
        text = row[data.text_field]
        if len(text) > MAX_TEXT_CHARS:
            raise RecipeError(f"{data.file}: line {number}: its text holds {len(text):,} characters; a text may hold at most "
                              f"{MAX_TEXT_CHARS:,} (split longer ones: --max-length keeps only a text's first tokens)")
        total += len(text)
        if total > MAX_TEXTS_CHARS:
            raise RecipeError(f"{data.file}: line {number}: the texts so far hold {total:,} characters, over the {MAX_TEXTS_CHARS:,} "
                              "read at most; use fewer texts (--count, or a recipe's data.count)")
        texts.append(text)
        lines.append(number)
        if data.label_field is not None and data.label_field in row:
            label = row[data.label_field]
            if isinstance(label, str):
                names = _label_names(checkpoint) if names is None else names
                if label not in names:
                    raise RecipeError(f"{data.file}: line {number}: label {label[:80]!r} is not one of the model's label names "
                                      f"{sorted(names)[:20]} (config.json's label2id); give a name among them or a class index")
                label = names[label]
            elif not _label_value(label):
                raise RecipeError(f"{data.file}: line {number}: label {str(label)[:80]}; expected a class index, a label name, or a list "
                                  "of class indices (one per token)")
            labels.append(label)
    if labels and len(labels) != len(texts):
        raise RecipeError(f"{data.file}: {len(labels)} of {len(texts)} lines have the label field {data.label_field!r}; give it on every line or none")
    tokenizer = load_tokenizer(checkpoint.source, f"encode {data.file} (the anchor's tokenizer)", RecipeError)
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=data.max_length, return_tensors="np")
    columns = {k: np.asarray(v, np.int32) for k, v in encoded.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    if labels and checkpoint.layout.head != "lm":
        try:
            columns["labels"] = np.asarray(labels, np.int32)
        except ValueError:  # ragged per-token lists: check_batch names the expected shape
            raise RecipeError(f"{data.file}: the per-token labels have different lengths; give each line {data.max_length} labels, "
                              "one per token as the texts are padded (-100 for tokens to ignore)") from None
    return columns, lines


def _label_value(label) -> bool:
    integer = lambda x: isinstance(x, int) and not isinstance(x, bool)
    return integer(label) or (isinstance(label, list) and all(integer(x) for x in label))


def _label_names(checkpoint) -> dict[str, int]:
    """{label name: class index} of the anchor's config.json (label2id), empty without one."""
    try:
        raw = json.loads((Path(checkpoint.source) / "config.json").read_text()).get("label2id") or {}
    except (OSError, TypeError, ValueError, AttributeError):
        return {}
    return {str(k): int(v) for k, v in raw.items() if isinstance(v, int)} if isinstance(raw, dict) else {}


def loss_fn(checkpoint, batches: list[dict]):
    """params -> mean negative log-likelihood of the labels over every labelled example or token
    of `batches` (label -100: ignored), run by `checkpoint`'s graph; jittable and vmappable."""
    import jax.numpy as jnp

    try:
        checkpoint.require_head("a loss")
    except ValueError as e:  # no head, or one our models do not run
        raise RecipeError(str(e)) from None
    head = checkpoint.layout.head
    if head == "masked_lm":
        raise RecipeError("the 'masked_lm' head predicts masked tokens: its loss needs masked inputs and their labels, which recipe "
                          "data do not make (texts label themselves for causal language models only)")
    if not batches or "labels" not in batches[0]:
        raise RecipeError("a loss needs labelled data: a label on every line of the JSONL (its field: --label-field, or a recipe's "
                          "data.label_field), or labels in the .npz (causal language-model texts label themselves)")
    for i, batch in enumerate(batches):  # batches() checked them; batches built otherwise are checked here
        try:
            checkpoint.check_batch(batch, f"batch {i}")
        except ValueError as e:
            raise RecipeError(str(e)) from None

    def loss(params):
        total, count = 0.0, 0
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            nll, scored = label_nll(checkpoint.apply(params, **inputs)["logits"], jnp.asarray(batch["labels"]))
            total, count = total + nll, count + scored
        return total / jnp.maximum(count, 1)

    return loss
