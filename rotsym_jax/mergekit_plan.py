"""The tensors a mergekit config writes (`plan`), laid out as mergekit 0.1.5's planner lays them out:
the tensors before the layers (embeddings) merged from the first slice's sources, each slice's
layers in order (output layer j of a slice of sources [a_k, b_k) is layer a_k + (j - offset) of
source k, renamed to j), the tensors after the layers (final norm, heads) from the last slice's;
parameters resolved with t = the layer's place in its slice (0 outside the layers). Everything is
checked from the configs and the files' headers, before any weight is read: each layer range
within its model's depth, every tensor in every source of its slice with the shape the output's
config gives it.

A config whose slices keep every layer in place (output layer j is layer j of every model, the
models' depth) writes the reference's config as it is; one that stacks or cuts layers writes the
reference's config with the new depth and its per-layer lists (layer_types) made of the slices'.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from .checks import LAYER_INDEX
from .errors import InputError
from .io import hf
from .merging import mergekit
from .pipeline import PipelineError
from .pytree import unflatten
from .streaming._source import Source, tensor_key

# The config's per-layer lists, sliced and concatenated as the layers are (transformers refuses
# one whose length is not the depth).
PER_LAYER = ("layer_types",)


@dataclasses.dataclass(frozen=True)
class Step:
    """One output tensor: its name in the output, the config's inputs it merges (a slice's sources,
    in order) with each one's tensor key, the base's position among them, the resolved parameters."""

    name: str
    inputs: tuple[int, ...]
    keys: tuple[str, ...]
    base: int | None
    shared: dict
    per_input: tuple[dict, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """`steps` by the output's tensor key, in its order; `checkpoint`: the output's config and
    layout (abstract params), as `hf.write_folder` writes it; `in_place`: every output layer is the
    same layer of every model, which alignment needs."""

    steps: dict[str, Step]
    checkpoint: hf.Checkpoint
    in_place: bool
    vocabulary_axes: dict[str, int] = dataclasses.field(default_factory=dict)  # token-indexed tensors: key -> HF axis of the tokens


def _layer(key: str) -> tuple[str, int | None]:
    """(the key with its layer index as {i}, the index), or (key, None) outside the layers."""
    match = LAYER_INDEX.search(key)
    if match is None:
        return key, None
    return "+".join(LAYER_INDEX.sub(r"\1\2\3{i}", leaf) for leaf in key.split("+")), int(match.group(4))  # a fused tensor's leaves each


def _layers(source: Source) -> dict[str, dict[int, str]]:
    """{template: {layer: key}} of a source's layer tensors."""
    out: dict[str, dict[int, str]] = {}
    for key in source.rules:
        template, index = _layer(key)
        if index is not None:
            out.setdefault(template, {})[index] = key
    return out


def _depth(layers: dict) -> int:
    return len({i for by_index in layers.values() for i in by_index})


def _ranges(cfg: mergekit.MergekitConfig, depths: list[int]) -> list[list[tuple[int, int]]]:
    """Each slice's sources' layer ranges (a models: source: every layer), checked against the
    models' depths."""
    out = []
    for k, one in enumerate(cfg.slices):
        ranges = []
        for j, s in enumerate(one.sources):
            depth, path = depths[s.input], cfg.inputs[s.input].path
            first, end = s.layer_range or (0, depth)
            if end > depth:
                raise PipelineError(f"{cfg.file}: line {s.line}: slices[{k}].sources[{j}].layer_range [{first}, {end}] of {path}: it has "
                                    f"{depth} layers (0 to {depth - 1}); expected an end of at most {depth}")
            ranges.append((first, end))
        if len({b - a for a, b in ranges}) > 1:  # a models: config of models of other depths
            raise PipelineError(f"{cfg.file}: line {one.line}: the models' depths differ: "
                                + ", ".join(f"{cfg.inputs[s.input].path} {b - a}" for s, (a, b) in zip(one.sources, ranges))
                                + "; a models: config merges whole models of one depth (slices: take layer ranges)")
        out.append(ranges)
    return out


def keeps_layers_in_place(cfg: mergekit.MergekitConfig, depths: list[int]) -> bool:
    """Whether output layer j is layer j of every model the slices use (and of the reference),
    every model of the output's depth; else the slices stack or cut layers."""
    ranges = _ranges(cfg, depths)
    offsets = np.cumsum([0, *(r[0][1] - r[0][0] for r in ranges)]).tolist()
    used = {s.input for one in cfg.slices for s in one.sources}
    return (all(a == offsets[k] for k, r in enumerate(ranges) for a, _ in r) and
            all(depths[i] == offsets[-1] for i in used | {cfg.reference}))


def has_seams(cfg: mergekit.MergekitConfig, depths: list[int]) -> bool:
    """Whether a layer of one model follows another model's (or the embeddings of another model
    come before it): slices that stack or cut layers, or whose sources differ from slice to slice.
    Aligned, every model's residual stream must then be moved into one basis."""
    return not keeps_layers_in_place(cfg, depths) or len({frozenset(s.input for s in one.sources) for one in cfg.slices}) > 1


def plan(cfg: mergekit.MergekitConfig, sources: list[Source], vocabulary_size: int | None = None) -> Plan:
    """The output's tensors and config (see the module docstring); PipelineError naming the config's
    line, the tensor and the shapes where the models do not fit the config. `vocabulary_size`: the
    output's rows of its token-indexed tensors, where the models' vocabularies are mapped onto one
    (their own sizes may differ: those tensors are checked off their vocabulary axis)."""
    ref = sources[cfg.reference]
    layers = [_layers(s) for s in sources]
    depths = [_depth(by) for by in layers]
    ranges = _ranges(cfg, depths)
    lengths = [r[0][1] - r[0][0] for r in ranges]
    offsets = np.cumsum([0, *lengths]).tolist()
    in_place = keeps_layers_in_place(cfg, depths)
    if not in_place:
        _check_stackable(cfg, ref, sources)
    checkpoint = ref.ck if in_place else _output(cfg, sources, ranges, offsets[-1])
    axes = {}
    if vocabulary_size is not None:
        axes = vocabulary_axes(checkpoint)
        checkpoint = with_vocabulary(checkpoint, vocabulary_size)
    family = hf.family_of(checkpoint.model_config)
    rules = {tensor_key(r): r for r in family.tensors(checkpoint.model_config, checkpoint.layout)}
    out_shapes = {p: tuple(s) for p, s in family.shapes(checkpoint.model_config, checkpoint.layout).items()}
    first_layer = next((n for n, key in enumerate(rules) if _layer(key)[1] is not None), len(rules))
    where = {j: (k, j - offsets[k]) for k in range(len(cfg.slices)) for j in range(offsets[k], offsets[k + 1])}
    steps = {}
    for n, (key, rule) in enumerate(rules.items()):
        template, j = _layer(key)
        if j is None:  # before the layers: the first slice's sources; after: the last's, as many as the first has (mergekit's zip)
            k, t = 0 if n < first_layer else len(cfg.slices) - 1, 0.0
            chosen = cfg.slices[k].sources[:len(cfg.slices[0].sources)]
            keys = [key] * len(chosen)
        else:
            k, offset = where[j]
            chosen = cfg.slices[k].sources
            t = offset / (lengths[k] - 1) if lengths[k] > 1 else 1.0
            keys = [layers[s.input].get(template, {}).get(ranges[k][m][0] + offset) for m, s in enumerate(chosen)]
        inputs = tuple(s.input for s in chosen)
        _check_tensor(rule.hf, j, [sources[i] for i in inputs], keys, [rule.ours, out_shapes], axes.get(key))
        try:
            shared, per_input = cfg.resolve([sources[i].hf_name(kk) for i, kk in zip(inputs, keys)], t, k, rule.hf)
        except InputError as e:
            raise PipelineError(str(e)) from None
        base = cfg.slices[k].base_position(cfg.base_index)
        steps[key] = Step(rule.hf, inputs, tuple(keys), base if base is not None and base < len(chosen) else None, shared, tuple(per_input))
    return Plan(steps, checkpoint, in_place, axes)


def _check_tensor(name: str, layer: int | None, sources: list[Source], keys: list, expected, vocabulary_axis: int | None = None) -> None:
    """Every source holds the tensor, all with one shape, the one the output's config gives it (a
    token-indexed tensor, `vocabulary_axis` given: one shape off that axis)."""
    at = "" if layer is None else f" (output layer {layer})"
    for s, key in zip(sources, keys):
        if key is None or key not in s.rules:
            raise PipelineError(f"tensor {name!r}{at}: {s.what} has no such tensor: its architecture is not that of the output")
    shapes = [s.hf_shape(key) for s, key in zip(sources, keys)]
    off_axis = {shape[:vocabulary_axis] + shape[vocabulary_axis + 1:] if vocabulary_axis is not None else shape for shape in shapes}
    if len(off_axis) > 1:
        raise PipelineError(f"tensor {name!r}: the models' shapes differ"
                            + (f" off its vocabulary axis {vocabulary_axis}" if vocabulary_axis is not None else "") + ": "
                            + ", ".join(f"{s.what} {s.hf_name(key)} {shape}" for s, key, shape in zip(sources, keys, shapes)))
    if vocabulary_axis is not None:  # its rows are the output's vocabulary's once mapped
        return
    ours, out_shapes = expected
    want = [out_shapes[p] for p in ours]
    got = [tuple(sources[0].shapes[p]) for p in sources[0].rules[keys[0]].ours]
    if got != want:
        raise PipelineError(f"tensor {name!r}{at}: {sources[0].what}'s {sources[0].hf_name(keys[0])} holds leaves of {got} ((in, out) for a "
                            f"kernel), where the output's config gives {want}: a layer of another kind or width cannot take this place "
                            "(narrower FFNs and fewer heads are widened by alignment: --align anchor)")


def _check_stackable(cfg: mergekit.MergekitConfig, ref: Source, sources: list[Source]) -> None:
    """Slices that stack or cut layers: one stack of layers, every model of the reference's family."""
    stacks = sorted({name[:m.start()] for name in (ref.hf_name(k) for k in ref.rules) if (m := LAYER_INDEX.search(name))})
    if len(stacks) > 1:
        raise PipelineError(f"{cfg.file}: slices that stack or cut layers: a {ref.ck.family} model has {len(stacks)} stacks of layers "
                            f"({', '.join(stacks)}); rotsym stacks the layers of models of one stack (decoders, encoders)")
    for s in sources:
        if s.ck.family != ref.ck.family:
            raise PipelineError(f"{s.what} does not have the architecture of {ref.what}: a {s.ck.family} model, not a {ref.ck.family} model")


def _output(cfg: mergekit.MergekitConfig, sources: list[Source], ranges: list, depth: int) -> hf.Checkpoint:
    """The reference's checkpoint with the output's config: `depth` layers, the per-layer lists
    made of each slice's first source's (abstract params of the output's shapes)."""
    ref = sources[cfg.reference].ck
    config = ref.model_config
    family = hf.family_of(config)
    raw = dict(config.raw)
    aliases = family.schema(config.model_type).aliases
    for key in [k for k in raw if k == family.num_layers or aliases.get(k) == family.num_layers] or [family.num_layers]:
        raw[key] = depth
    lists = {}
    for key in PER_LAYER:
        if getattr(config, key, None) is None:
            continue
        lists[key] = []
        for one, rng in zip(cfg.slices, ranges):
            source = sources[one.sources[0].input]
            values = getattr(source.ck.model_config, key, None)
            if values is None:
                raise PipelineError(f"{source.what} has no {key}, which the output's config (from {sources[cfg.reference].what}) lists per layer")
            lists[key] += list(values[rng[0][0]:rng[0][1]])
    raw.update({k: v for k, v in lists.items() if k in raw})
    out = _read(raw, config)
    changed = {k: v for k, v in lists.items() if getattr(out, k, None) != v}  # derived lists written only where they would differ
    if changed:
        out = _read({**raw, **changed}, config)
    if getattr(out, family.num_layers) != depth:
        raise PipelineError(f"the output's config: {family.num_layers}={getattr(out, family.num_layers)}, expected {depth}")
    shapes = family.shapes(out, ref.layout)
    params = unflatten({p: jax.ShapeDtypeStruct(tuple(s), ref.dtype) for p, s in shapes.items()})
    return dataclasses.replace(ref, model_config=out, params=params, stored_dtypes={}, aliases={}, stored_config=None)


def _read(raw: dict, config, what: str = "the reference's with the slices' depth") -> object:
    try:
        return hf.read_config(raw, "the output's config", record=config.record)
    except (InputError, ValueError) as e:
        raise PipelineError(f"the output's config ({what}): {e}") from None


def with_vocabulary(ck: hf.Checkpoint, size: int) -> hf.Checkpoint:
    """`ck` (its config and abstract params) with `size` tokens: vocab_size, and the keys its family
    reads as vocab_size, set to `size`."""
    config = ck.model_config
    if getattr(config, "vocab_size", None) == size:
        return ck
    family = hf.family_of(config)
    raw = dict(config.raw)
    aliases = family.schema(config.model_type).aliases
    for key in [k for k in raw if k == "vocab_size" or aliases.get(k) == "vocab_size"] or ["vocab_size"]:
        raw[key] = size
    out = _read(raw, config, f"{ck.source}'s with vocab_size {size}")
    shapes = family.shapes(out, ck.layout)
    params = unflatten({p: jax.ShapeDtypeStruct(tuple(s), ck.dtype) for p, s in shapes.items()})
    return dataclasses.replace(ck, model_config=out, params=params, stored_dtypes={}, aliases={}, stored_config=None)


def _probe(ck: hf.Checkpoint) -> hf.Checkpoint:
    """`ck` with one token more: what follows vocab_size changes shape."""
    if getattr(ck.model_config, "vocab_size", None) is None:
        raise PipelineError(f"{ck.source}: its config has no vocab_size: rotsym cannot tell its token-indexed tensors to map "
                            "another vocabulary onto them")
    return with_vocabulary(ck, ck.model_config.vocab_size + 1)


def _changed_axis(what: str, shape: tuple, other: tuple) -> int | None:
    changed = [k for k, (a, b) in enumerate(zip(shape, other)) if a != b]
    if len(changed) > 1:
        raise PipelineError(f"{what}: {len(changed)} axes of its shape {shape} follow vocab_size; rotsym maps a vocabulary onto one axis")
    return changed[0] if changed else None


def vocabulary_leaves(ck: hf.Checkpoint) -> dict[str, int]:
    """{leaf path: its axis of the vocabulary} of `ck`'s token-indexed leaves (in our layout)."""
    family = hf.family_of(ck.model_config)
    probe = _probe(ck)
    now, then = family.shapes(ck.model_config, ck.layout), family.shapes(probe.model_config, probe.layout)
    axes = {p: _changed_axis(f"leaf {p!r} of {ck.source}", tuple(shape), tuple(then.get(p, shape))) for p, shape in now.items()}
    return {p: axis for p, axis in axes.items() if axis is not None}


def vocabulary_axes(ck: hf.Checkpoint) -> dict[str, int]:
    """{tensor key: its axis of the vocabulary, as stored} of `ck`'s token-indexed tensors (input
    embeddings, LM heads and their biases): the tensors whose stored shape follows vocab_size."""
    family = hf.family_of(ck.model_config)
    probe = _probe(ck)

    def stored_shapes(c: hf.Checkpoint) -> dict[str, tuple]:
        shapes = family.shapes(c.model_config, c.layout)
        # each tensor's stored shape from zero-strided views of its leaves: nothing is allocated
        return {tensor_key(r): r.to_hf(tuple(np.broadcast_to(np.int8(0), tuple(shapes[p])) for p in r.ours)).shape
                for r in family.tensors(c.model_config, c.layout)}

    now, then = stored_shapes(ck), stored_shapes(probe)
    axes = {key: _changed_axis(f"tensor {key!r} of {ck.source}", shape, then.get(key, shape)) for key, shape in now.items()}
    return {key: axis for key, axis in axes.items() if axis is not None}
