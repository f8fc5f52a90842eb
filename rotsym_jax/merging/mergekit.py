"""mergekit configs, as they are: `rotsym merge CONFIG.yml OUT` runs a mergekit YAML unchanged
(`is_mergekit` tells one from a rotsym recipe by its `merge_method` key).

    models:                                  # or slices: (below)
      - model: path/to/a
        parameters: {weight: 0.7, density: [1, 0.5]}   # per model: scalars, gradients, filters
      - model: path/to/b
        parameters: {weight: 0.3}
    base_model: path/to/base
    merge_method: ties                       # tensorwise.METHODS
    parameters:                              # shared by every model, overridden per model
      density: [{filter: self_attn, value: 0.8}, {value: 0.5}]
      normalize: true
    dtype: float32                           # inputs cast to it; out_dtype: what is saved
    tokenizer_source: base                   # base, a model of the config, or union; or a tokenizer: section
                                             # {source, tokens: {TOKEN: {source, force}}, pad_to_multiple_of}
    rotsym:                                  # ignored by mergekit: alignment before the merge
      align: anchor                          # none | anchor | many
      anchor: path/to/a                      # the model the others move onto (default: the base, else the first)
      align_options: {heads: permute, residual: permutation}
      seed: 0                                # random sparsification (dare_*, della*)
      data: {file: texts.jsonl}              # align_options.method activations | learned (relative to this file, as in a recipe)
The base is never moved unless it is the anchor: task vectors are measured from it in its frame.

    slices:                                  # frankenmerges: the output's layers, slice after slice
      - sources: [{model: path/to/a, layer_range: [0, 2]}]
      - sources: [{model: path/to/b, layer_range: [1, 3], parameters: {scale: 0.5}}]
    merge_method: passthrough                # a slice of several sources (ranges of one length) is merged by it

A `models:` config is one slice of every layer of each model (the base added to it, as mergekit
adds it); a `slices:` config names each model once in `inputs` and its layer ranges in `slices`
(`mergekit_plan` lays out the output's tensors from them, as mergekit 0.1.5's planner does).

Parameters resolve as mergekit resolves them (`resolve`): a source's own, then the slice's, then
the shared ones; a list of numbers is a gradient over the slice's layers (t = offset / (length - 1),
1 in a slice of one layer, t = 0 outside the layers, the final norm and heads too: mergekit
0.1.5's planning, where versions before March 2025 took t = 1 after the layers); a `filter` applies
where its text is in the tensor's name. Paths are relative to the working directory, as mergekit
reads them. What rotsym cannot do is refused by key and line before any weight is read: layer
ranges that are not [first, end) with 0 <= first < end or differ in length within a slice (their
ends against the models' depths once the configs are read), a method's base missing from a slice,
a slice's own base_model, `modules`, a token source without a source or naming no model of the
config, chat templates, LoRA references and Hub ids (offline). Alignment with slices that stack
or cut layers is refused by name when the run plans them (`mergekit_pipeline`): it needs every
output layer to be the same layer of every model.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from pathlib import Path

import yaml

from ..errors import InputError
from ..io.recipe import (
    ALIGN_KEYS,
    Data,
    Recipe,
    RecipeError,
    checked_keys,
    config_text,
    data_of,
    is_seed,
    line_of,
    short,
    value_node,
    yaml_mapping,
)
from ..options import ALIGN_MODES
from . import tensorwise, vocabulary
from .registry import Method, Param, counts

DTYPES = ("float32", "float16", "bfloat16", "float64")
TOP_KEYS = ("models", "slices", "modules", "merge_method", "base_model", "parameters", "dtype", "out_dtype", "tokenizer_source",
            "tokenizer", "chat_template", "rotsym")
ROTSYM_KEYS = ("align", "anchor", "align_options", "seed", "data")
TOKENIZER_KEYS = ("source", "tokens", "pad_to_multiple_of")


@dataclasses.dataclass(frozen=True)
class Input:
    """A model of the config, once however many slices take layers of it: its path and the line
    first naming it (its parameters and layer ranges are its slices' `SliceSource`s)."""

    path: str
    line: int


@dataclasses.dataclass(frozen=True)
class SliceSource:
    """A model of one slice: its input's index, its layers [first, end) (None: every layer, the
    `models:` form), its own parameter settings, its line."""

    input: int
    layer_range: tuple[int, int] | None
    parameters: Mapping
    line: int


@dataclasses.dataclass(frozen=True)
class Slice:
    """A run of output layers merged from its sources' layer ranges of one length (`models:` is one
    slice of every layer), with its own parameter settings."""

    sources: tuple[SliceSource, ...]
    parameters: Mapping
    line: int

    @property
    def length(self) -> int | None:
        first = self.sources[0].layer_range
        return None if first is None else first[1] - first[0]

    def base_position(self, base_index: int | None) -> int | None:
        """The base's position among the sources, or None."""
        return next((k for k, s in enumerate(self.sources) if s.input == base_index), None) if base_index is not None else None


@dataclasses.dataclass(frozen=True)
class MergekitConfig:
    """A mergekit config checked (`load`). `inputs`: every model it names once, in the config's
    order, the base last where only base_model names it; `base_index` its position. `slices`: the
    output's layers, in order, each merged from its sources (a `models:` config: one slice of every
    layer, the base among its sources as mergekit adds it)."""

    file: Path
    text: str
    method: Method
    inputs: tuple[Input, ...]
    base_index: int | None
    parameters: Mapping  # shared settings
    slices: tuple[Slice, ...]
    dtype: str | None = None
    out_dtype: str | None = None
    tokenizer_source: str | None = None  # None, "base", "union" or a model path
    tokens: Mapping[str, vocabulary.TokenSource] = dataclasses.field(default_factory=dict)  # tokenizer.tokens
    pad_to_multiple_of: int | None = None
    align: str = "none"
    align_options: Mapping = dataclasses.field(default_factory=dict)
    seed: int = 0
    data: Data | None = None
    notes: tuple[str, ...] = ()
    anchor: str | None = None  # the model alignment moves the others onto (default: the reference)

    @property
    def slice_parameters(self) -> Mapping:
        """The parameters of a config of one slice (a `models:` config has none)."""
        return self.slices[0].parameters if len(self.slices) == 1 else {}

    @property
    def reference(self) -> int:
        """The input whose config, layout and files the output takes (mergekit's donor: the base, else the first model)."""
        return 0 if self.base_index is None else self.base_index

    @property
    def anchor_index(self) -> int:
        """The input `align: anchor` moves the others onto: the block's `anchor`, else the reference."""
        return self.reference if self.anchor is None else [inp.path for inp in self.inputs].index(self.anchor)

    def inputs_index(self, tokenizer_source: str | None) -> int:
        """The input a tokenizer comes from: the reference for None, "base" and "union" (the union
        starts from the reference's, as mergekit's starts from the base's), else the model of that path."""
        if tokenizer_source in (None, "base", "union"):
            return self.reference
        return [inp.path for inp in self.inputs].index(tokenizer_source)

    def resolve(self, names: list[str], t: float, slice_index: int = 0, name: str | None = None) -> tuple[dict, list[dict]]:
        """The shared parameters and each source's of slice `slice_index` for one output tensor:
        `names[k]` its name in source k, `name` in the output (default: the first source's; the
        shared parameters' filters read it, as mergekit's), `t` its place in the slice's layers.
        InputError names a missing required parameter."""
        m, one = self.method, self.slices[slice_index]
        base = one.base_position(self.base_index)
        shared = {p.name: _resolved(p, (one.parameters, self.parameters), names[0] if name is None else name, t, f"{self.file}: parameters")
                  for p in m.shared()}
        per_input = []
        for k, (source, input_name) in enumerate(zip(one.sources, names)):
            scopes = (source.parameters, one.parameters, self.parameters)
            path = self.inputs[source.input].path
            per_input.append({p.name: _resolved(p, scopes, input_name, t, f"{self.file}: line {source.line}: {path}")
                              for p in m.per_input() if k != base or p.scope == "input"})
        return shared, per_input


def is_mergekit(path: str | Path) -> bool:
    """Whether the YAML at `path` is a mergekit config (a top-level `merge_method`)."""
    try:
        root = yaml.compose(config_text(Path(path), "config"))
    except (RecipeError, yaml.YAMLError, RecursionError):
        return False
    return isinstance(root, yaml.MappingNode) and any(k.value == "merge_method" for k, _ in root.value)


def load(path: str | Path) -> MergekitConfig:
    """Read and check the mergekit config at `path` (RecipeError naming the key and its line)."""
    path = Path(path)
    text, nodes = yaml_mapping(path, "mergekit config", "models, merge_method, parameters")
    where = lambda key: f"{path}: line {line_of(nodes[key][0])}"  # noqa: E731
    unknown = [k for k in nodes if k not in TOP_KEYS]
    if unknown:
        raise RecipeError(f"{where(unknown[0])}: unknown key {unknown[0]!r}; a mergekit config's keys: {list(TOP_KEYS)}")
    raw = {k: yaml.safe_load(yaml.serialize(v)) for k, (_, v) in nodes.items() if k != "rotsym"}
    _refuse(raw, where)
    name = raw.get("merge_method")
    if name not in tensorwise.METHODS:
        raise RecipeError(f"{where('merge_method')}: merge_method {short(repr(name))}: {_unknown_method(name)}; rotsym runs mergekit's "
                          f"{sorted(tensorwise.METHODS)}")
    method = tensorwise.METHODS[name]
    base = model_path(raw["base_model"], where("base_model") + ": base_model") if "base_model" in raw else None
    inputs, slices = _models(path, raw, nodes, where, base) if "models" in raw else _slices(path, raw, nodes, where)
    base_index = None
    if base is not None:
        base_index = next((i for i, inp in enumerate(inputs) if inp.path == base), None)
        if base_index is None:  # mergekit adds the base as a model of its own: to the merge in a models: config, as the donor in any
            inputs.append(Input(base, line_of(nodes["base_model"][0])))
            base_index = len(inputs) - 1
            if "models" in raw:
                slices = [Slice((*slices[0].sources, SliceSource(base_index, None, {}, inputs[-1].line)), {}, slices[0].line)]
    notes = _check_parameters(path, method, raw.get("parameters") or {}, slices, inputs, where)
    for k, one in enumerate(slices):
        at = where("merge_method") if "models" in raw else f"{path}: line {one.line}: slices[{k}]"
        _check_inputs(at, method, len(one.sources), one.base_position(base_index), base_index, inputs)
    dtypes = {}
    for key in ("dtype", "out_dtype"):
        value = raw.get(key)
        value = value.removeprefix("torch.") if isinstance(value, str) else value
        if value is not None and value not in DTYPES:
            raise RecipeError(f"{where(key)}: {key} {short(repr(value))}; expected one of {DTYPES}")
        dtypes[key] = value
    tokenizer_source = _tokenizer_source(raw, inputs, base_index, where)
    tokens, pad = _token_sources(raw, inputs, where)
    block = _rotsym(path, nodes["rotsym"][1]) if "rotsym" in nodes else {}
    if "anchor" in block:  # the same folder however written (./m/a, m/a, its absolute path), as mergekit reads paths
        same = [inp.path for inp in inputs if Path(inp.path).resolve() == Path(block["anchor"]).resolve()]
        if not same:
            raise RecipeError(f"{where('rotsym')}: rotsym.anchor {block['anchor']!r} is not a model of the config {[inp.path for inp in inputs]}")
        block["anchor"] = same[0]
    return MergekitConfig(path, text, method, tuple(inputs), base_index, raw.get("parameters") or {}, tuple(slices), dtypes["dtype"],
                          dtypes["out_dtype"], tokenizer_source, tokens, pad, notes=tuple(notes), **block)


def _refuse(raw: dict, where) -> None:
    if "modules" in raw:
        raise RecipeError(f"{where('modules')}: modules (per-module merges of multimodal models) are not run by rotsym; merge the "
                          "language model with models: or slices:")
    if raw.get("chat_template") is not None:
        raise RecipeError(f"{where('chat_template')}: chat_template: rotsym copies the tokenizer as it is and sets no chat template")
    if "models" in raw and "slices" in raw:
        raise RecipeError(f"{where('slices')}: give models: or slices:, not both")
    if "models" not in raw and "slices" not in raw:
        raise RecipeError(f"{where('merge_method')}: the config names no models (models: or slices:)")
    tokenizer = raw.get("tokenizer")
    if tokenizer is not None:
        if not isinstance(tokenizer, dict) or set(tokenizer) - set(TOKENIZER_KEYS):
            raise RecipeError(f"{where('tokenizer')}: tokenizer: {short(repr(tokenizer))}; expected a mapping of {list(TOKENIZER_KEYS)}")
        if "tokenizer_source" in raw:
            raise RecipeError(f"{where('tokenizer')}: give tokenizer_source or tokenizer, not both")


def model_path(value, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise RecipeError(f"{what}: {short(repr(value))}; expected a model's folder")
    if "+" in value:
        raise RecipeError(f"{what}: {value!r} names a LoRA (model+lora); rotsym merges full checkpoints: merge the LoRA into its model first")
    if not Path(value).expanduser().is_dir():
        hub = "@" in value or (value.count("/") == 1 and not value.startswith((".", "/", "~")))
        raise RecipeError(f"{what}: {value!r} is not a folder" + (" (a Hub id: rotsym reads mergekit configs offline; download the model "
                                                                  "and give its folder)" if hub else f" (relative to {Path.cwd()})" if not Path(value).is_absolute() else ""))
    return value


def _items(node) -> list:
    return node.value if isinstance(node, yaml.SequenceNode) else []


def _entry(entry, what: str, allowed: set) -> tuple[str, dict]:
    """A model entry's path and parameters, checked (a bare string is a model of no parameters)."""
    if isinstance(entry, str):
        entry = {"model": entry}
    if not isinstance(entry, dict) or "model" not in entry or set(entry) - allowed:
        raise RecipeError(f"{what}: {short(repr(entry))}; expected a mapping of {sorted(allowed)}")
    params = entry.get("parameters") or {}
    if not isinstance(params, dict):
        raise RecipeError(f"{what}.parameters: expected a mapping of parameters")
    return model_path(entry["model"], f"{what}.model"), params


def _models(path: Path, raw: dict, nodes: dict, where, base: str | None) -> tuple[list[Input], list[Slice]]:
    """A models: config: its models, one slice of every layer of each."""
    entries = raw["models"]
    if not isinstance(entries, list) or not entries:
        raise RecipeError(f"{where('models')}: models must be a list of models")
    entry_nodes = _items(nodes["models"][1])
    inputs, sources = [], []
    for i, entry in enumerate(entries):
        line = line_of(entry_nodes[i]) if i < len(entry_nodes) else line_of(nodes["models"][0])
        model, params = _entry(entry, f"{path}: line {line}: models[{i}]", {"model", "parameters"})
        inputs.append(Input(model, line))
        sources.append(SliceSource(i, None, params, line))
    paths = [inp.path for inp in inputs]
    if len(set(paths)) != len(paths):
        raise RecipeError(f"{where('models')}: a model is listed twice: {paths}")
    return inputs, [Slice(tuple(sources), {}, line_of(nodes["models"][0]))]


def _slices(path: Path, raw: dict, nodes: dict, where) -> tuple[list[Input], list[Slice]]:
    """A slices: config: every model it names once (in order of first mention), and its slices,
    their layer ranges checked: [first, end) with 0 <= first < end, one length within a slice (the
    models' depths are checked once their configs are read)."""
    slices = raw["slices"]
    if not isinstance(slices, list) or not slices:
        raise RecipeError(f"{where('slices')}: slices must be a list of slices (each sources: with model and layer_range)")
    inputs, out = [], []
    for k, (one, node) in enumerate(zip(slices, _items(nodes["slices"][1]) or [nodes["slices"][0]] * len(slices))):
        at = f"{path}: line {line_of(node)}: slices[{k}]"
        if not isinstance(one, dict) or not isinstance(one.get("sources"), list) or not one["sources"] or set(one) - {"sources", "parameters", "base_model"}:
            raise RecipeError(f"{at}: a slice is sources: (a list of model, layer_range, parameters) and parameters:; got {short(repr(one))}")
        if "base_model" in one:
            raise RecipeError(f"{at}.base_model: a slice's own base_model is not run by rotsym; give base_model at the top of the config")
        parameters = one.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise RecipeError(f"{at}.parameters: expected a mapping of parameters")
        source_nodes = _items(value_node(node, "sources")) if isinstance(node, yaml.MappingNode) else []
        sources = []
        for j, entry in enumerate(one["sources"]):
            line = line_of(source_nodes[j]) if j < len(source_nodes) else line_of(node)
            what = f"{path}: line {line}: slices[{k}].sources[{j}]"
            model, params = _entry(entry, what, {"model", "layer_range", "parameters"})
            layer_range = entry.get("layer_range") if isinstance(entry, dict) else None
            if not (isinstance(layer_range, list) and len(layer_range) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in layer_range)
                    and 0 <= layer_range[0] < layer_range[1]):
                raise RecipeError(f"{what}.layer_range: {short(repr(layer_range))}; expected [first, end], integers with 0 <= first < end "
                                  "(the layers first to end - 1)")
            index = next((i for i, inp in enumerate(inputs) if inp.path == model), None)
            if index is None:
                inputs.append(Input(model, line))
                index = len(inputs) - 1
            sources.append(SliceSource(index, tuple(layer_range), params, line))
        lengths = {b - a for a, b in (s.layer_range for s in sources)}
        if len(lengths) > 1:
            given = ", ".join(f"{inputs[s.input].path} {list(s.layer_range)} ({s.layer_range[1] - s.layer_range[0]} layers)" for s in sources)
            raise RecipeError(f"{at}: its sources' layer ranges differ in length: {given}; a slice merges its sources layer by layer, "
                              "so each gives as many layers")
        models = [inputs[s.input].path for s in sources]
        if len(set(models)) != len(models):
            raise RecipeError(f"{at}: a model is a source of this slice twice: {models} (mergekit refuses duplicate merge inputs)")
        out.append(Slice(tuple(sources), parameters, line_of(node)))
    return inputs, out


def _check_parameters(path: Path, method: Method, shared: dict, slices: list[Slice], inputs: list[Input], where) -> list[str]:
    """Every setting's form and values checked against the method's parameters; notes for the
    parameters the method does not have (mergekit ignores them, so does rotsym, saying so)."""
    known = dict(method.params)
    notes = []
    scopes = [(where("parameters") if shared else "", "parameters", shared)]
    for k, one in enumerate(slices):
        label = "slice parameters" if len(slices) == 1 else f"slices[{k}] parameters"
        scopes.append((f"{path}: line {one.line}", label, one.parameters))
        scopes += [(f"{path}: line {s.line}", f"{inputs[s.input].path} parameters", s.parameters) for s in one.sources]
    for at, label, scope in scopes:
        if not isinstance(scope, dict):
            raise RecipeError(f"{at}: {label}: expected a mapping of parameters")
        for name, setting in scope.items():
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                notes.append(f"{label}: {name!r} is not a parameter of {method.name} ({sorted(known)}"
                             f"{f'; did you mean {close[0]!r}?' if close else ''}): ignored, as mergekit ignores it")
                continue
            for value in _values(setting, f"{at}: {label}.{name}"):
                try:
                    known[name].read(value, f"{at}: {label}.{name}")
                except InputError as e:
                    raise RecipeError(str(e)) from None
    return notes


def _unknown_method(name) -> str:
    close = difflib.get_close_matches(str(name), list(tensorwise.METHODS), n=1)
    return "not a mergekit method" + (f" (did you mean {close[0]!r}?)" if close else "")


def _values(setting, what: str) -> list:
    """The scalars of a setting: a scalar, a gradient (list of scalars), {filter, value} or a list of those."""
    if setting is None or isinstance(setting, (bool, int, float, str)):
        return [setting] if setting is not None else []
    if isinstance(setting, dict):
        if set(setting) - {"filter", "value"} or "value" not in setting or not isinstance(setting.get("filter", ""), (str, type(None))):
            raise RecipeError(f"{what}: {short(repr(setting))}; a conditional setting is {{filter: TEXT, value: VALUE}}")
        return _values(setting["value"], what)
    if isinstance(setting, list):
        if all(isinstance(x, (bool, int, float, str)) for x in setting):
            return list(setting)
        return [v for x in setting for v in _values(x if isinstance(x, dict) else {"bad": x}, what)]
    raise RecipeError(f"{what}: {short(repr(setting))}; expected a value, a list of values (a gradient) or filters")


def evaluate(setting, name: str, t: float, parameter: Param):
    """mergekit's `evaluate_setting`: the value of `setting` for tensor `name` at layer fraction
    `t`, or None where no filter matches."""
    if isinstance(setting, dict):
        setting = [setting]
    if isinstance(setting, (bool, int, float, str)):
        return parameter.read(setting, name)
    if not isinstance(setting, list) or not setting:
        return None
    if all(isinstance(x, (bool, int, float, str)) for x in setting):
        values = [parameter.read(x, name) for x in setting]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return values[int(t * (len(values) - 1))]
        scaled = t * (len(values) - 1)
        i0 = int(scaled)
        i1 = min(len(values) - 1, i0 + 1)
        frac = scaled - i0
        return parameter.read((1 - frac) * values[i0] + frac * values[i1], name)
    for cond in setting:
        f = cond.get("filter")
        if f is None or f == "*" or (name and f in name):
            return evaluate(cond["value"], name, t, parameter)
    return None


def _resolved(parameter: Param, scopes, name: str, t: float, what: str):
    for scope in scopes:
        if parameter.name in scope:
            value = evaluate(scope[parameter.name], name, t, parameter)
            if value is not None:
                return value
    if parameter.required:
        needs = "one for every tensor" if parameter.scope == "shared" else "one per model, for every tensor"
        raise InputError(f"{what}: no {parameter.name} for tensor {name!r} (merge_method needs {needs})")
    return parameter.default


def _check_inputs(where: str, method: Method, n: int, base_position: int | None, base_index: int | None, inputs: list[Input]) -> None:
    """A slice's `n` sources (the base at `base_position` among them, or absent) as the method takes them."""
    label = f"{where}: merge_method {method.name}"
    if method.base == "required" and base_index is None:
        raise RecipeError(f"{label} needs a base_model")
    if method.base != "ignored" and base_index is not None and base_position is None:  # mergekit refuses it so
        raise RecipeError(f"{label} merges each slice with the base_model {inputs[base_index].path}, which is not among this slice's "
                          "sources: add it, with a layer_range")
    why = counts(method, n, base_position is not None)
    if why:
        raise RecipeError(f"{label} {why}")


def _tokenizer_source(raw: dict, inputs: list[Input], base_index, where) -> str | None:
    key = "tokenizer_source" if "tokenizer_source" in raw else "tokenizer" if raw.get("tokenizer") is not None else None
    if key is None:
        return None
    value = raw[key] if key == "tokenizer_source" else raw[key].get("source", "union")  # mergekit's default in a tokenizer: section
    if value is None:
        return None
    if value == "base":
        if base_index is None:
            raise RecipeError(f"{where(key)}: {key}: base, but the config has no base_model")
        return "base"
    if value == "union":
        return "union"
    return _input_path(value, inputs, f"{where(key)}: {key}")


def _input_path(value, inputs: list[Input], what: str) -> str:
    path = model_path(value, what)
    if path not in [inp.path for inp in inputs]:
        raise RecipeError(f"{what} {value!r} is not a model of the config ({[inp.path for inp in inputs]})")
    return path


def _token_sources(raw: dict, inputs: list[Input], where) -> tuple[dict, int | None]:
    """The tokenizer: section's `tokens` ({token: vocabulary.TokenSource}) and `pad_to_multiple_of`,
    as mergekit reads them: a source is a model of the config (its row of the token), {kind: zero},
    or {kind: model_token, model: M, token: T | token_id: N}."""
    section = raw.get("tokenizer") or {}
    at = where("tokenizer") + ": tokenizer" if section else ""
    pad = section.get("pad_to_multiple_of")
    if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool) or pad < 1):
        raise RecipeError(f"{at}.pad_to_multiple_of: {short(repr(pad))}; expected a positive integer")
    tokens = section.get("tokens") or {}
    if not isinstance(tokens, dict):
        raise RecipeError(f"{at}.tokens: {short(repr(tokens))}; expected a mapping of token: {{source: ..., force: ...}}")
    paths = [inp.path for inp in inputs]
    out = {}
    for token, setting in tokens.items():
        what = f"{at}.tokens[{token!r}]"
        if not isinstance(token, str) or not isinstance(setting, dict) or set(setting) - {"source", "force"} \
                or not isinstance(setting.get("force", False), bool):
            raise RecipeError(f"{what}: {short(repr(setting))}; expected {{source: MODEL | {{kind: zero}} | {{kind: model_token, model: "
                              "MODEL, token: TEXT | token_id: N}, force: true | false}")
        source, force = setting.get("source"), setting.get("force", False)
        if source is None:
            raise RecipeError(f"{what}: no source; rotsym needs one (a model, {{kind: zero}} or {{kind: model_token, ...}})")
        if isinstance(source, str):
            out[token] = vocabulary.TokenSource("model", paths.index(_input_path(source, inputs, f"{what}.source")), force=force)
        elif isinstance(source, dict) and source.get("kind") == "zero" and set(source) == {"kind"}:
            out[token] = vocabulary.TokenSource("zero", force=force)
        elif isinstance(source, dict) and source.get("kind") == "model_token" and set(source) - {"kind", "model", "token", "token_id"} == set() \
                and (source.get("token") is None) != (source.get("token_id") is None) and "model" in source:
            token_id = source.get("token_id")
            if token_id is not None and (not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0):
                raise RecipeError(f"{what}.source.token_id: {short(repr(token_id))}; expected a row number (an integer >= 0)")
            model = paths.index(_input_path(source["model"], inputs, f"{what}.source.model"))
            out[token] = vocabulary.TokenSource("model_token", model, source.get("token"), token_id, force)
        else:
            raise RecipeError(f"{what}.source: {short(repr(source))}; expected a model of the config, {{kind: zero}} or "
                              "{kind: model_token, model: MODEL, token: TEXT} (or token_id: N instead of token)")
    return out, pad


def _rotsym(path: Path, node) -> dict:
    if node is None:
        return {}
    keys = {"align": (lambda v: v in ALIGN_MODES, f"one of {ALIGN_MODES}"),
            "anchor": (lambda v: isinstance(v, str), "a model of the config (the one the others are aligned onto)"),
            "align_options": (lambda v: isinstance(v, dict), "a mapping of align's options"),
            "seed": (is_seed, "an integer (the key of random sparsification)"),
            "data": (lambda v: isinstance(v, dict), "a mapping (file, text_field, label_field, batch_size, count, max_length)")}
    top = checked_keys(path, node, keys, "rotsym.")
    children = {k.value: v for k, v in node.value}
    out = {k: top[k] for k in ("align", "seed", "anchor") if k in top}
    if "align_options" in top:
        out["align_options"] = checked_keys(path, children["align_options"], ALIGN_KEYS, "rotsym.align_options.")
    if "data" in top:
        out["data"] = data_of(path, children["data"], prefix="rotsym.data.")
    return out


# ---- conversion ----------------------------------------------------------------------------------------
# A rotsym recipe and a mergekit config say the same merge only where both define the method alike:
# average = linear, task_arithmetic = task_arithmetic. rotsym's ties, dare and slerp follow their
# papers (TIES keeps ceil(density n) entries and votes 0 where signs cancel, DARE rescales by
# 1 / (1 - drop), SLERP is spherical down to sin < 1e-6) where mergekit's differ; fisher, regmean and
# ot_fusion have no mergekit method. Those are refused, with the reason.

NOT_MERGEKIT = {
    "ties": "rotsym's ties keeps ceil(density * n) entries and elects no sign where they cancel; mergekit's keeps floor and elects +",
    "dare": "rotsym's dare rescales the kept entries by 1 / (1 - drop); mergekit's by the task vector's L1 norm",
    "slerp": "rotsym's slerp stays spherical down to sin(angle) < 1e-6; mergekit's is linear below about 1.8 degrees",
}


def to_mergekit(recipe, head_tensors: list[str]) -> dict:
    """The mergekit config (a dict to dump as YAML) of a rotsym `recipe.Recipe`, alignment in its
    `rotsym:` block. `head_tensors`: the anchor's task-head tensor names, which a recipe with
    task_head "anchor" keeps from the anchor (a filter giving the anchor the whole weight there).
    InputError where mergekit has no method that computes the same."""
    if recipe.method not in ("average", "task_arithmetic"):
        why = NOT_MERGEKIT.get(recipe.method, f"mergekit has no {recipe.method} method")
        raise InputError(f"method {recipe.method!r} has no mergekit equivalent: {why} (run the recipe with rotsym merge)")
    if recipe.data is not None and recipe.align_options.get("method", "weights") == "weights":
        raise InputError("the recipe's data feed no part of this merge; remove them")
    weights = list(recipe.weights or [1.0] * len(recipe.models))
    if recipe.method == "task_arithmetic":
        lam = float(recipe.params.get("lam", 1.0))
        if recipe.task_head == "anchor" and head_tensors and lam == 0:
            raise InputError("task_arithmetic with lam = 0 cannot keep the anchor's head in mergekit (its head weight would be 1 / lam)")
        keep, drop = 1.0 / lam if lam else 0.0, 0.0
    else:
        keep, drop = 1.0, 0.0
    models = []
    for i, (path, w) in enumerate(zip(recipe.models, weights)):
        weight = w
        if recipe.task_head == "anchor" and head_tensors:  # the anchor's head, whole: the others weigh 0 there
            weight = [*({"filter": name, "value": keep if i == 0 else drop} for name in head_tensors), {"value": w}]
        models.append({"model": str(Path(path).resolve()), "parameters": {"weight": weight}})
    config = {"models": models, "merge_method": "linear" if recipe.method == "average" else "task_arithmetic"}
    if recipe.method == "task_arithmetic":
        if recipe.base is None:
            raise InputError("task_arithmetic needs the recipe's base")
        config["base_model"] = str(Path(recipe.base).resolve())
        config["parameters"] = {"lambda": float(recipe.params.get("lam", 1.0))}
    config["dtype"] = "float32"
    if recipe.dtype is not None:
        config["out_dtype"] = recipe.dtype
    block = {"align": recipe.align, **({"align_options": dict(recipe.align_options)} if recipe.align_options else {})}
    if recipe.seed:
        block["seed"] = recipe.seed
    if recipe.data is not None:
        block["data"] = {k: (str(Path(v).resolve()) if k == "file" else v) for k, v in dataclasses.asdict(recipe.data).items() if v is not None}
    if recipe.align != "none":
        if recipe.base is not None:  # a recipe aligns onto its first model; a config's default anchor is its base
            block["anchor"] = str(Path(recipe.models[0]).resolve())
        config["rotsym"] = block
    return config


def to_recipe(config: MergekitConfig):
    """The rotsym `recipe.Recipe` of a mergekit config, where rotsym's methods compute the same:
    linear with constant weights (normalized, or summing to 1) as average, task_arithmetic with one
    constant weight for every model as task_arithmetic; the heads merged, as mergekit merges them.
    InputError naming what rotsym's recipe cannot say."""
    name = config.method.name
    if name not in ("linear", "task_arithmetic"):
        raise InputError(f"mergekit's {name} has no rotsym recipe equivalent"
                         + (f" ({NOT_MERGEKIT[name.split('_')[0]]})" if name.split("_")[0] in NOT_MERGEKIT else "")
                         + "; rotsym merge runs the mergekit config as it is")
    if len(config.slices) > 1:
        raise InputError(f"{len(config.slices)} slices: a recipe merges whole models, not layer ranges one by one; rotsym merge runs the "
                         "mergekit config as it is")
    if len(config.slices[0].sources) != len(config.inputs):
        raise InputError(f"base_model {config.inputs[config.reference].path} is not among the slice's sources: a recipe's base is merged")
    if config.slice_parameters:
        raise InputError("the slice's parameters: a recipe has per-model weights and the method's options only")
    others = [i for i in range(len(config.inputs)) if i != config.base_index or name == "linear"]

    def constant(scope: Mapping, key: str, what: str, default=None):
        value = scope.get(key, default)
        if isinstance(value, (list, dict)):
            raise InputError(f"{what}: {key} = {short(repr(value))}: a filter or a gradient; a recipe's {key} is one number")
        return value

    weights = []
    for i in others:
        own = config.slices[0].sources[i].parameters  # source i is input i: the one slice merges every input
        w = constant(own, "weight", config.inputs[i].path, constant(config.parameters, "weight", "parameters"))
        if w is None:
            raise InputError(f"{config.inputs[i].path}: no weight")
        weights.append(float(w))
    normalize = constant(config.parameters, "normalize", "parameters", name == "linear" or None)
    unused = sorted(set(config.parameters) - {"weight", "normalize", "lambda", "int8_mask"})
    if unused:
        raise InputError(f"parameters {unused}: no recipe equivalent")
    if config.align != "none":  # a recipe aligns onto its first model: the config's anchor goes first
        anchor = config.anchor_index
        if anchor not in others:
            raise InputError(f"the config aligns onto its base_model {config.inputs[anchor].path}; a recipe aligns onto its first model "
                             "(give rotsym.anchor one of the other models to convert it)")
        position = others.index(anchor)
        others = [anchor] + others[:position] + others[position + 1:]
        weights = [weights[position]] + weights[:position] + weights[position + 1:]
    models = tuple(str(Path(config.inputs[i].path).resolve()) for i in others)
    dtype = config.out_dtype or config.dtype
    align = {"align": config.align, "align_options": dict(config.align_options), "seed": config.seed, "data": config.data}
    if name == "linear":
        if not normalize and abs(sum(weights) - 1) > 1e-12:
            raise InputError(f"linear with normalize: false and weights summing to {sum(weights)}: rotsym's average normalizes the weights")
        return Recipe(models=models, method="average", weights=tuple(weights), task_head="merge", dtype=dtype, **align)
    if len(set(weights)) != 1:
        raise InputError(f"task_arithmetic with weights {weights}: rotsym's task_arithmetic weighs every model alike")
    lam = float(constant(config.parameters, "lambda", "parameters", 1.0)) * weights[0]
    if normalize:
        lam /= sum(weights)
    return Recipe(models=models, method="task_arithmetic", params={"lam": lam}, base=str(Path(config.inputs[config.base_index].path).resolve()),
                  task_head="merge", dtype=dtype, **align)
