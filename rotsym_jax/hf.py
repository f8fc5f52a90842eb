"""Hugging Face checkpoint folders (config.json + safetensors) <-> our params pytrees.

`load_hf(path)` reads a folder, picks the family from `model_type`, converts tensor layouts once
(nn.Linear (out, in) -> kernel (in, out); GPT-2 Conv1D as is) and returns a `Checkpoint`.
`save_hf(checkpoint, params, path)` writes a folder that transformers loads with no missing or
unexpected keys, in the input checkpoint's dtype, atomically (temporary folder, then rename).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
import transformers
from flax import nnx
from safetensors import safe_open

from .models import FAMILIES
from .models.family import Family, Layout
from .pytree import Params, flatten, unflatten

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Files of a checkpoint folder that save_hf writes itself; everything else (tokenizer, README…)
# is copied from the source folder.
_OWN_FILES = ("config.json", WEIGHTS, WEIGHTS_INDEX, "generation_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".h5", ".msgpack", ".ckpt")


class CheckpointError(ValueError):
    """A checkpoint folder, config or params pytree that cannot be read or written as asked."""


@dataclasses.dataclass(frozen=True, eq=False)
class Checkpoint:
    """A model family, its transformers config, the Flax graph and a params pytree.

    `params` is a nested dict of arrays (paths documented in each family's module).
    `apply(params, **inputs)` runs the model on any params pytree of the same structure and returns
    a dict with `last_hidden_state` (and `logits`, `pooler_output` where the model has them).
    `dtype` is the stored dtype of the source checkpoint; `save_hf` writes in it by default.
    """

    family: str
    config: Any
    graphdef: Any
    params: Params
    layout: Layout
    dtype: Any = jnp.float32
    source: Path | None = None

    def apply(self, params: Params, **inputs) -> dict:
        inputs = {k: (None if v is None else jnp.asarray(v)) for k, v in inputs.items()}
        return _apply(self.graphdef, params, inputs)

    def model(self, params: Params | None = None) -> nnx.Module:
        """The NNX module with `params` (default: the checkpoint's) merged in."""
        return nnx.merge(self.graphdef, self.params if params is None else params)


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, params, inputs):
    return nnx.merge(graphdef, params)(**inputs)


def family_for(model_type: str, where: str = "config") -> Family:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = sorted(t for f in FAMILIES for t in f.model_types)
    raise CheckpointError(f"{where}: unsupported model_type {model_type!r}; supported: {supported}")


def init_checkpoint(
    config,
    key: jax.Array,
    *,
    head: str | None = None,
    pooler: bool = False,
    prefix: str | None = None,
    dtype=jnp.float32,
) -> Checkpoint:
    """A randomly initialised model of `config`'s family (transformers-style init), as a Checkpoint.

    `head` names the task head (see the family's module); `prefix` defaults to the family's
    base-model prefix when there is a head (as transformers' `*For*` classes save) and "" otherwise.
    """
    family = family_for(config.model_type)
    if prefix is None:
        prefix = family.prefix if head is not None else ""
    layout = Layout(prefix=prefix, head=head, pooler=pooler)
    model = family.build(config, layout, dtype, nnx.Rngs(key))
    graphdef, state = nnx.split(model)
    return Checkpoint(family.name, config, graphdef, nnx.to_pure_dict(state), layout, jnp.dtype(dtype))


def _describe(config) -> str:
    keys = (
        "hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
        "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "image_size",
        "patch_size", "num_channels",
    )
    raw = config.to_dict()
    return ", ".join(f"{k}={raw[k]}" for k in keys if raw.get(k) is not None)


class _TensorFiles:
    """Lazy access to the tensors of model.safetensors or a sharded index."""

    def __init__(self, folder: Path):
        single, index = folder / WEIGHTS, folder / WEIGHTS_INDEX
        if single.is_file():
            handles = {single: safe_open(single, "numpy")}
            self.where = {name: single for name in handles[single].keys()}
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (no 'weight_map'): {e}") from e
            files = {folder / f for f in weight_map.values()}
            missing = sorted(str(f) for f in files if not f.is_file())
            if missing:
                raise CheckpointError(f"{index} names shard files that are missing: {missing}")
            handles = {f: safe_open(f, "numpy") for f in files}
            self.where = {name: folder / f for name, f in weight_map.items()}
            for f, h in handles.items():
                absent = [n for n, g in self.where.items() if g == f and n not in set(h.keys())]
                if absent:
                    raise CheckpointError(f"{f}: tensors listed in {index.name} are absent: {absent[:5]}")
        else:
            present = sorted(p.name for p in folder.iterdir())
            hint = ""
            if any(p.endswith((".bin", ".pt", ".h5", ".msgpack")) for p in present):
                hint = " (only safetensors weights are read; re-save with safe_serialization=True)"
            raise CheckpointError(
                f"{folder}: no {WEIGHTS} or {WEIGHTS_INDEX} found{hint}; folder holds {present}"
            )
        self.handles = handles

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name) -> tuple:
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

    def dtype(self, name) -> str:
        return self.handles[self.where[name]].get_slice(name).get_dtype()

    def get(self, name) -> np.ndarray:
        return self.handles[self.where[name]].get_tensor(name)


_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
}


def load_hf(path: str | os.PathLike, *, dtype=None) -> Checkpoint:
    """Load a Hugging Face checkpoint folder as a `Checkpoint`.

    dtype: the params' dtype; default: the checkpoint's stored floating dtype.
    Raises `CheckpointError` (or FileNotFoundError) naming the file, tensor and shapes on bad input.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such checkpoint folder (expected config.json + {WEIGHTS})")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: missing; a checkpoint folder needs config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: invalid JSON: {e}") from e
    model_type = raw.get("model_type")
    if model_type is None:
        raise CheckpointError(f"{config_file}: no 'model_type' key, so the model family is unknown")
    family = family_for(model_type, where=str(config_file))
    config = transformers.AutoConfig.from_pretrained(folder)

    files = _TensorFiles(folder)
    names = files.names()
    float_dtypes = [files.dtype(n) for n in names if files.dtype(n) in _ST_DTYPES]
    if not float_dtypes:
        raise CheckpointError(f"{folder}: the checkpoint holds no floating-point tensors")
    stored = jnp.dtype(_ST_DTYPES[collections.Counter(float_dtypes).most_common(1)[0][0]])
    dtype = stored if dtype is None else jnp.dtype(dtype)

    layout = family.detect(names, config)
    abstract = nnx.eval_shape(lambda: family.build(config, layout, dtype, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    expected = flatten(nnx.to_pure_dict(state))

    flat: dict[str, jax.Array] = {}
    used: set[str] = set()
    rules = family.tensors(config, layout)
    for rule in rules:
        want = _expected_hf_shape(rule, expected)
        if rule.hf not in names:
            raise CheckpointError(
                f"{folder}: tensor {rule.hf!r} (our leaf {', '.join(rule.ours)}) is missing; expected shape "
                f"{want} from config.json ({_describe(config)})"
            )
        got = files.shape(rule.hf)
        if got != want:
            raise CheckpointError(
                f"{files.where[rule.hf]}: tensor {rule.hf!r} has shape {got}, expected {want} from "
                f"config.json ({_describe(config)}); the config disagrees with the weights"
            )
        for our_path, array in zip(rule.ours, rule.to_ours(files.get(rule.hf))):
            flat[our_path] = jnp.asarray(array, dtype=expected[our_path].dtype)
        used.add(rule.hf)

    for hf_name, our_path in family.tied(config, layout).items():
        if hf_name in names:
            used.add(hf_name)
            # Compare the stored tensors themselves, before any dtype cast.
            source = next(r.hf for r in rules if our_path in r.ours)
            if files.shape(hf_name) != files.shape(source) or not np.array_equal(
                files.get(hf_name), files.get(source)
            ):
                raise CheckpointError(
                    f"{files.where[hf_name]}: {hf_name!r} differs from {source!r} although the "
                    f"config ties them (tie_word_embeddings); the checkpoint is inconsistent"
                )

    unexpected = sorted(n for n in names - used if not family.is_ignored(n))
    if unexpected:
        raise CheckpointError(
            f"{folder}: {len(unexpected)} unexpected tensors for a {family.name} model with "
            f"head={layout.head!r} ({_describe(config)}): {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}; does config.json match the weights?"
        )
    missing = sorted(set(expected) - set(flat))
    if missing:  # a family whose rules do not cover its model: a bug of ours, not of the input
        raise AssertionError(f"{family.name}: no tensor rule fills {missing}")
    return Checkpoint(family.name, config, graphdef, unflatten(flat), layout, stored, folder)


def _expected_hf_shape(rule, expected) -> tuple:
    zeros = tuple(np.broadcast_to(np.zeros((), np.float32), expected[p].shape) for p in rule.ours)
    return tuple(rule.to_hf(zeros).shape)


def check_params(checkpoint: Checkpoint, params: Params, what: str = "params") -> dict[str, Any]:
    """Flattened `params`, after checking they have the checkpoint's paths and shapes."""
    flat, ref = flatten(params), flatten(checkpoint.params)
    missing, extra = sorted(set(ref) - set(flat)), sorted(set(flat) - set(ref))
    if missing or extra:
        raise CheckpointError(
            f"{what} do not match the {checkpoint.family} checkpoint: missing leaves {missing[:8]}, "
            f"unexpected leaves {extra[:8]}"
        )
    for p, leaf in flat.items():
        if tuple(np.shape(leaf)) != tuple(np.shape(ref[p])):
            raise CheckpointError(
                f"{what}: leaf {p} has shape {tuple(np.shape(leaf))}, expected {tuple(np.shape(ref[p]))}"
            )
    return flat


def save_hf(
    checkpoint: Checkpoint,
    params: Params,
    path: str | os.PathLike,
    *,
    dtype=None,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write `params` as a Hugging Face checkpoint folder of `checkpoint`'s family and head.

    dtype: default the source checkpoint's stored dtype. Writes into a temporary folder beside
    `path` and renames it into place, so a failure never leaves a half-written checkpoint.
    Tokenizer and other non-weight files of the source folder are copied along.
    """
    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
    flat = check_params(checkpoint, params)
    family = family_for(checkpoint.config.model_type)
    out_dtype = np.dtype(checkpoint.dtype if dtype is None else jnp.dtype(dtype))
    tensors: dict[str, np.ndarray] = {}
    for rule in family.tensors(checkpoint.config, checkpoint.layout):
        leaves = tuple(np.asarray(flat[p]) for p in rule.ours)
        # safetensors' NumPy writer stores non-C-contiguous arrays in the wrong element order.
        tensors[rule.hf] = np.ascontiguousarray(rule.to_hf(leaves).astype(out_dtype, copy=False))

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        config = copy_config(checkpoint.config)
        config.architectures = [family.architecture(checkpoint.config, checkpoint.layout)]
        config.dtype = str(out_dtype) if out_dtype != ml_dtypes.bfloat16 else "bfloat16"
        config.save_pretrained(tmp)
        _write_shards(tensors, tmp, max_shard_bytes)
        if checkpoint.source is not None and checkpoint.source.is_dir():
            _copy_extra_files(checkpoint.source, tmp)
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def copy_config(config):
    return config.__class__.from_dict(config.to_dict())


def _write_shards(tensors: dict[str, np.ndarray], folder: Path, max_shard_bytes: int):
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        safetensors.numpy.save_file(shards[0], folder / WEIGHTS, metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        safetensors.numpy.save_file(shard, folder / fname, metadata=metadata)
        weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def _copy_extra_files(source: Path, dest: Path):
    for item in source.iterdir():
        if item.name in _OWN_FILES or item.name.endswith(_WEIGHT_SUFFIXES) or item.name.startswith("."):
            continue
        if item.is_file():
            shutil.copy2(item, dest / item.name)
        elif item.is_dir():
            shutil.copytree(item, dest / item.name)
