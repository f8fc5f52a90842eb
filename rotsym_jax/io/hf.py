"""Hugging Face checkpoint folders (config.json + safetensors) <-> our params pytrees.

`load_hf(path)` reads a folder, picks the family from `model_type`, tells the layout (prefix,
task head, pooler) from the tensor names and config.json's `architectures`, converts tensor layouts
once (nn.Linear (out, in) -> kernel (in, out); GPT-2 Conv1D as is), all as the family's record
(`rotsym_jax.models.family`) declares, and returns a `Checkpoint`: no forward pass is built until
one runs.
`save_hf(checkpoint, params, path)` writes a folder that transformers loads with no missing or
unexpected keys, in the input checkpoint's dtype, atomically (temporary folder, then rename).
Neither imports transformers or PyTorch (seconds of imports a merge does not need): config.json
is read as a `ModelConfig` (families/config.py) and written back as it was read.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import errno
import functools
import json
import os
import re
import shutil
import struct
import sys
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx
from safetensors import safe_open

from .. import owned
from ..errors import InputError, InputTypeError, RotsymError
from ..families import FAMILIES
from ..families.config import ModelConfig
from ..families.family import Family, InferredRecord, Layout, assemble
from ..families.heads import check_labels
from ..pytree import Params, flatten, unflatten
from ..spec import Spec

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# Files of a checkpoint folder that save_hf writes itself; everything else (tokenizer, README…)
# is copied from the source folder.
_OWN_FILES = ("config.json", WEIGHTS, WEIGHTS_INDEX)
# An Orbax checkpoint folder (`save_orbax`): config.json beside the params' Orbax item. A training
# run's step folders hold the params as the item "params" (of a Composite) or "default".
ORBAX_ITEM = "params"
ORBAX_ITEMS = (ORBAX_ITEM, "default")
ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".h5", ".msgpack", ".ckpt")


class CheckpointError(RotsymError, ValueError):
    """A checkpoint folder, config or params pytree that cannot be read or written as asked."""


@dataclasses.dataclass(frozen=True, eq=False)
class Checkpoint:
    """A model family, its config, the Flax graph and a params pytree.

    `model_config` is the config as the library reads it (a read-only `ModelConfig`: every value
    the family reads, as transformers' config class holds it); `config` is the transformers config
    (`transformers.PretrainedConfig`), built from it on first use: reading it imports transformers
    and PyTorch. Changing the transformers config changes nothing the library reads; pass a changed
    one to `init_checkpoint` for a new model.
    `params` is a nested dict of arrays (paths documented in each family's module).
    `layout` names the base-model prefix, the task head and the pooler: reading, aligning,
    merging and saving need only it and the family's record.
    `apply(params, **inputs)` runs the model on any params pytree of the same structure and returns
    a dict with `last_hidden_state` (and `logits`, `pooler_output` and the head's other outputs
    where the model has them). The Flax graph (`graphdef`) is built on first use; a head our
    models do not run (`runs_head` False: multiple choice, pre-training, ...) is left out of it,
    and `require_head` names it to the features that need logits.
    `dtype` is the source checkpoint's (most common) stored dtype and `stored_dtypes` each leaf's
    own: `save_hf` writes every tensor back in its stored dtype by default (`dtype` for leaves
    without one).
    """

    family: str
    model_config: ModelConfig
    params: Params
    layout: Layout
    dtype: Any = jnp.float32
    source: Path | None = None
    stored_dtypes: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def config(self):
        """The transformers config (built on first use; imports transformers)."""
        return self.model_config.transformers()

    @property
    def runs_head(self) -> bool:
        """Whether the forward pass runs the task head (always true without one)."""
        return family_of(self.model_config).has_forward(self.layout)

    @property
    def graphdef(self):
        """The Flax graph of the forward pass (the base model, and the head where it runs), built
        on first use for the params' dtype. A config our forward pass cannot run is refused here,
        naming the value: reading, aligning, merging and saving never need it."""
        self.require_forward()
        layout = self.layout if self.runs_head else dataclasses.replace(self.layout, head=None)
        dtypes = collections.Counter(np.dtype(x.dtype) for x in jax.tree_util.tree_leaves(self.params))
        try:
            return _graph(self.model_config, layout, jnp.dtype(dtypes.most_common(1)[0][0] if dtypes else self.dtype))
        except ValueError as e:
            where = str(self.source) if self.source is not None else f"this {self.family} config"
            raise CheckpointError(f"{where}: the forward pass cannot run this config ({e}); reading, aligning, merging and "
                                  "saving do not need it") from e

    def require_forward(self) -> None:
        """CheckpointError where this checkpoint was read with an inferred record: our forward
        pass is the record's family's, not proven for this model (its groups are)."""
        record = self.model_config.record
        if record is not None:
            raise CheckpointError(f"{self.source or 'this model'}: model_type {record.model_type!r} is read with a record inferred from "
                                  f"its tensors ({record.read_as!r}'s, proven in transformers for its symmetry groups), which moves "
                                  f"weights only: our forward pass is {record.read_as}'s, not {record.model_type}'s, so nothing that "
                                  "runs the model (data, losses, barriers, activations) is offered for it")

    def forward_params(self, params: Params) -> Params:
        """`params` as the graph takes them: without a head it does not run."""
        return params if self.runs_head else {k: v for k, v in params.items() if k != "head"}

    def require_head(self, what: str) -> None:
        """Raise CheckpointError, naming the head, when `what` (a feature that needs the model's
        logits) cannot run on this checkpoint: no task head, or one our models do not run."""
        self.require_forward()
        family = family_of(self.model_config)
        where = str(self.source) if self.source is not None else "the model"
        if self.layout.head is None:
            raise CheckpointError(f"{where} is a {self.family} model without a task head: {what} needs the logits of one")
        runs = sorted(h.name for h in family.heads if h.forward and h.loss)
        if not self.runs_head:
            raise CheckpointError(f"{where}: the {self.layout.head!r} head is read, aligned, merged and saved, but rotsym_jax does "
                                  f"not run it, and {what} needs its logits; heads of {self.family} with logits here: {runs}")
        if not family.head(self.layout.head).loss:
            raise CheckpointError(f"{where}: the {self.layout.head!r} head runs, but gives no one distribution of logits (question "
                                  f"answering: start and end logits), which {what} needs; heads of {self.family} with logits: {runs}")

    def split_batch(self, batch: Mapping, what: str = "batch") -> tuple[dict, jax.Array | None]:
        """(model inputs, labels or None) of a batch of data (a "labels" entry is not an input);
        token ids out of the vocabulary are refused (`what` names the batch in the error): an
        embedding lookup out of range gives NaN silently."""
        check_token_ids(self.model_config, batch, what)
        inputs = {k: jnp.asarray(v) for k, v in batch.items() if k != "labels"}
        labels = batch.get("labels")
        return inputs, None if labels is None else jnp.asarray(labels)

    def check_batch(self, batch: Mapping, what: str = "batch") -> int:
        """ValueError, naming `what`, for a batch the model cannot read (token ids outside the
        vocabulary, images of another shape: the forward pass is traced on it, no weight is read
        or needed); else the number of its tokens that are not padding (of its images' patch
        tokens); labels, where the batch has them and the model gives logits, must index them."""
        reads = family_of(self.model_config).input
        if reads not in batch:
            given = next((k for k in ("pixel_values", "input_ids") if k in batch), None)
            kind = {"pixel_values": "images", "input_ids": "token ids"}
            holds = f"holds {given} ({kind[given]})" if given else f"holds {sorted(batch)}"
            raise InputError(f"{what}: {holds}, and {self.source or 'the model'} is a {self.family} model, which reads {reads} "
                             f"({kind.get(reads, reads)}): give data of {reads}")
        inputs, labels = self.split_batch(batch, what)
        try:
            out = jax.eval_shape(lambda p, x: self.apply(p, **x), self.params, inputs)
        except (ValueError, TypeError) as e:
            raise InputError(f"{what}: the model cannot read it: {e}") from None
        if labels is not None and "logits" in out:
            check_labels(labels, out["logits"].shape, what)
        mask = inputs.get("attention_mask")
        hidden = out["last_hidden_state"].shape
        return int(np.sum(np.asarray(mask))) if mask is not None and tuple(mask.shape) == tuple(hidden[:2]) else int(np.prod(hidden[:-1]))

    def apply(self, params: Params, **inputs) -> dict:
        check_token_ids(self.model_config, inputs)
        inputs = {k: (None if v is None else jnp.asarray(v)) for k, v in inputs.items()}
        return _apply(self.graphdef, self.forward_params(params), inputs)

    def model(self, params: Params | None = None) -> nnx.Module:
        """The NNX module with `params` (default: the checkpoint's) merged in."""
        return nnx.merge(self.graphdef, self.forward_params(self.params if params is None else params))


# Index inputs and the config entry bounding them: an embedding lookup out of range gives NaN or
# a clipped row, silently.
_INDEX_INPUTS = (("input_ids", "vocab_size"), ("token_type_ids", "type_vocab_size"))


def check_token_ids(config, inputs: dict, what: str = "inputs") -> None:
    """Raise ValueError when a concrete `input_ids`/`token_type_ids` entry lies outside
    [0, vocab size) of `config`. Traced inputs (under jit) cannot be checked and pass."""
    for name, bound_key in _INDEX_INPUTS:
        ids, bound = inputs.get(name), getattr(config, bound_key, None)
        if ids is None or bound is None or isinstance(ids, jax.core.Tracer):
            continue
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= bound):
            raise InputError(
                f"{what}: {name} holds values in [{ids.min()}, {ids.max()}], outside [0, {bound}) "
                f"({bound_key}={bound} in the config)"
            )


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, params, inputs):
    return nnx.merge(graphdef, params)(**inputs)


def family_for(model_type: str, where: str = "config") -> Family:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise CheckpointError(f"{where}: unsupported model_type {model_type!r}; supported: {supported_model_types()}. A checkpoint whose "
                          "tensors follow one of their layouts can be read with a record inferred and proven in transformers: "
                          "rotsym_jax.infer_record(folder) (the command line infers one itself)")


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in f.model_types)


def family_of(config: ModelConfig) -> Family:
    """The family record a config is read with: its model_type's, or the one its inferred record
    reads it as (`InferredRecord`)."""
    if config.record is not None:
        return family_for(config.record.read_as).inferred(config.record)
    return family_for(config.model_type)


def read_config(raw: Mapping, where: str = "config", record: InferredRecord | None = None) -> ModelConfig:
    """The `ModelConfig` of a config.json's content (`where` names it in errors); ValueError
    naming the key for a value transformers' config class would refuse. `record`: an inferred
    record for a model_type without one (read as `record.read_as`)."""
    model_type = raw.get("model_type")
    if model_type is None:
        raise CheckpointError(f"{where}: no 'model_type' key, so the model family is unknown")
    if not isinstance(model_type, str):
        raise CheckpointError(f"{where}: model_type={model_type!r}; expected a string")
    if record is None:
        return ModelConfig(raw, family_for(model_type, where).schema(model_type))
    if record.model_type != model_type:
        raise CheckpointError(f"{where}: model_type {model_type!r}, but the inferred record given is for {record.model_type!r}")
    if model_type in supported_model_types():
        raise CheckpointError(f"{where}: model_type {model_type!r} has its own record; an inferred one is for model types without")
    return ModelConfig(raw, family_for(record.read_as, where).schema(record.read_as), record=record)


def _transformers_config_class():
    # Only an imported transformers can have made a transformers config: never import it here.
    module = sys.modules.get("transformers.configuration_utils")
    return None if module is None else module.PreTrainedConfig


def as_model_config(config) -> ModelConfig:
    """`config` itself when it is a ModelConfig; a transformers config as a ModelConfig (read from
    what `save_pretrained` would write; its `transformers()` returns `config` itself)."""
    if isinstance(config, ModelConfig):
        return config
    cls = _transformers_config_class()
    if cls is None or not isinstance(config, cls):
        raise InputTypeError(f"expected a transformers config or a ModelConfig, got {type(config).__name__}")
    model_type = config.model_type
    raw = json.loads(config.to_json_string(use_diff=True))
    return ModelConfig(raw, family_for(model_type).schema(model_type), built=config)


def spec_for(checkpoint_or_config) -> Spec:
    """The spec of a built-in family (`Family.spec`), from a Checkpoint, its `model_config` or a
    transformers config. A Checkpoint's layout says which head it has; from a config alone, a
    final norm that any tied head of the config would read is not folded (`Family.residual_spec`)."""
    layout = checkpoint_or_config.layout if isinstance(checkpoint_or_config, Checkpoint) else None
    config = checkpoint_or_config.model_config if isinstance(checkpoint_or_config, Checkpoint) else checkpoint_or_config
    try:
        config = as_model_config(config)
    except TypeError:
        raise InputTypeError(
            f"spec_for takes a Checkpoint or a transformers config, got {type(checkpoint_or_config).__name__} "
            "(for params, pass the Checkpoint they came from)"
        ) from None
    return family_of(config).spec(config, layout)


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

    `config`: a transformers config (the checkpoint's `config` is this object) or a ModelConfig.
    `head` names the task head (see the family's module); `prefix` defaults to the family's
    base-model prefix when there is a head (as transformers' `*For*` classes save) and "" otherwise.
    """
    try:
        config = as_model_config(config)
    except ValueError as e:  # a transformers config that holds what transformers would not load
        raise CheckpointError(f"config: {e}") from e
    family = family_of(config)
    check_config(config)
    if prefix is None:
        prefix = family.base_prefix(config, head)
    layout = Layout(prefix=prefix, head=head, pooler=pooler)
    if not family.has_forward(layout):
        raise CheckpointError(f"{family.name} head {head!r} is read from checkpoints but not built here (no forward pass): "
                              f"initialise it with transformers and load it with load_hf")
    family.check_layout(config, layout)
    model = family.build(config, layout, dtype, nnx.Rngs(key))
    _, state = nnx.split(model)
    return Checkpoint(family.name, config, nnx.to_pure_dict(state), layout, jnp.dtype(dtype))


def describe_config(config) -> str:
    keys = (
        "hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
        "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "image_size",
        "patch_size", "num_channels",
    )
    raw = config.to_dict()
    return ", ".join(f"{k}={raw[k]}" for k in keys if raw.get(k) is not None)


class TensorFiles:
    """Lazy access to the tensors of model.safetensors or a sharded index; every failure to read
    one is a CheckpointError naming the file."""

    def __init__(self, folder: Path):
        self._layouts, self._fds = {}, {}  # for `read`: headers parsed, files opened on first use
        single, index = folder / WEIGHTS, folder / WEIGHTS_INDEX
        if _exists(single):
            files = {single: single}
            self.where = None
        elif _exists(index):
            weight_map = _read_index(index)
            files = {folder / f: folder / f for f in set(weight_map.values())}
            missing = sorted(str(f) for f in files if not f.is_file())
            if missing:
                raise CheckpointError(f"{index} names shard files that are missing: {missing}")
        else:
            present = sorted(p.name for p in folder.iterdir())
            hint = orbax_hint(folder)
            if any(p.endswith((".bin", ".pt", ".h5", ".msgpack")) for p in present):
                hint = " (only safetensors weights are read; re-save with safe_serialization=True)"
            raise CheckpointError(
                f"{folder}: no {WEIGHTS} or {WEIGHTS_INDEX} found{hint}; folder holds {present}"
            )
        for f in files:
            _check_inside(folder, f)
        self.handles = {f: _open_safetensors(f) for f in files}
        if single in self.handles:
            self.where = {name: single for name in self.handles[single].keys()}
        else:
            self.where = {name: folder / f for name, f in weight_map.items()}
            for f, h in self.handles.items():
                present = set(h.keys())
                absent = [n for n, g in self.where.items() if g == f and n not in present]
                if absent:
                    raise CheckpointError(f"{f}: tensors listed in {index.name} are absent: {absent[:5]}")

    def names(self) -> set[str]:
        return set(self.where)

    def _read(self, name, what):
        file = self.where[name]
        try:
            return what(self.handles[file], name)
        except Exception as e:  # safetensors raises its own SafetensorError without the path
            raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({type(e).__name__}: {e})") from e

    def shape(self, name) -> tuple:
        return tuple(self._read(name, lambda h, n: h.get_slice(n).get_shape()))

    def dtype(self, name) -> str:
        return self._read(name, lambda h, n: h.get_slice(n).get_dtype())

    def get(self, name) -> np.ndarray:
        return self._read(name, lambda h, n: h.get_tensor(n))

    def read(self, name, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor `name` (or its rows [start, stop) along axis 0) read with plain file reads into a
        fresh array: unlike a memory map, the pages read stay in the page cache and never count in
        this process's resident memory, so streaming stays within its budget."""
        file = self.where[name]
        dtype_name, shape, begin, end = self._layout(file)[name]
        if dtype_name not in _ST_DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype_name}; parameters must be floating ({', '.join(_ST_DTYPES)})")
        dtype = np.dtype(_ST_DTYPES[dtype_name])
        row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
        start, stop = (0, shape[0] if shape else 1) if rows is None else rows
        out_shape = (stop - start, *shape[1:]) if shape else ()
        out = np.empty(out_shape, dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))
        offset, want = begin + start * row, (stop - start) * row
        if offset + want > end:
            raise CheckpointError(f"{file}: tensor {name!r} rows {start}:{stop} lie beyond its data")
        fd = self._fds.get(file)
        if fd is None:  # threads may read at once (positional reads): the first opened is kept
            opened = os.open(file, os.O_RDONLY)
            fd = self._fds.setdefault(file, opened)
            if fd != opened:
                os.close(opened)
        done = 0
        while done < want:  # pread may return less than asked (large reads, signals)
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise CheckpointError(f"{file}: tensor {name!r} ends early (file truncated at {offset + done} bytes)")
            done += n
        return out

    def _layout(self, file) -> dict:
        """{name: (dtype, shape, absolute begin, absolute end)} from the file's safetensors header."""
        cache = self._layouts
        if file not in cache:
            try:
                with open(file, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    header = json.loads(f.read(n))
            except (OSError, ValueError, struct.error) as e:
                raise CheckpointError(f"{file}: unreadable safetensors header ({type(e).__name__}: {e})") from e
            size = file.stat().st_size
            layout = {}
            try:
                for key, entry in header.items():
                    if key == "__metadata__":
                        continue
                    begin, end = (8 + n + int(x) for x in entry["data_offsets"])
                    if end > size:
                        raise CheckpointError(f"{file}: tensor {key!r} ends at byte {end}, beyond the file's {size} bytes; truncated?")
                    layout[key] = (entry["dtype"], tuple(int(d) for d in entry["shape"]), begin, end)
            except CheckpointError:
                raise
            except (TypeError, KeyError, ValueError, AttributeError) as e:  # a header changed since safe_open checked it
                raise CheckpointError(f"{file}: not a valid safetensors header ({type(e).__name__}: {str(e)[:200]})") from None
            cache[file] = layout
        return cache[file]

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _exists(path: Path) -> bool:
    """True for a file; False for nothing there; a dangling link or a folder is an error."""
    if path.is_symlink() and not path.exists():
        raise CheckpointError(f"{path} is a symbolic link to {os.readlink(path)!r}, which does not exist")
    if path.exists() and not path.is_file():
        raise CheckpointError(f"{path} is not a file")
    return path.exists()


def _check_inside(folder: Path, file: Path) -> None:
    """A shard is a file inside the checkpoint folder, as the index's entries must be: one that is
    a symbolic link to a file elsewhere is refused alike (a Hub cache snapshot's links into its
    repository's blobs excepted: that is how the Hub stores every file)."""
    real, base = file.resolve(), folder.resolve()
    if base in real.parents:
        return
    if base.parent.name == "snapshots" and real.parent == base.parent.parent / "blobs":
        return
    raise CheckpointError(f"{file} is a symbolic link to {real}, outside the checkpoint folder; shards must be files inside it "
                          f"(copy the file in, or give the folder that holds it)")


def link_problem(path) -> str | None:
    """What is wrong with `path` as a symbolic link (a loop, or a link to nothing), or None."""
    path = Path(path)
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"{path} is a symbolic link loop (following it never reaches a file or folder)"
        if path.is_symlink():
            return f"{path} is a symbolic link to {os.readlink(path)!r}, which does not exist"
    except ValueError:  # a NUL byte in the path
        return f"{str(path)!r} is not a valid path"
    return None


def _open_safetensors(file: Path):
    try:
        return safe_open(file, "numpy")
    except Exception as e:  # SafetensorError ("header too small", "incomplete metadata"), OSError
        size = file.stat().st_size if file.exists() else None
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({size} bytes; {type(e).__name__}: {e}); "
            f"truncated or corrupt?"
        ) from e


def _read_json_object(file: Path, what: str) -> dict:
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: invalid JSON: {e}") from e
    except RecursionError:
        raise CheckpointError(f"{file}: JSON nested too deeply to be {what}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: {what} must be a JSON object, got a JSON {type(raw).__name__}")
    return raw


def _read_index(index: Path) -> dict[str, str]:
    """The index's weight_map, each shard a relative path inside the folder."""
    weight_map = _read_json_object(index, "a safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index}: not a safetensors index ('weight_map' must map tensor names to file names)")
    for name, file in weight_map.items():
        parts = Path(file).parts
        if not parts or Path(file).is_absolute() or ".." in parts:
            raise CheckpointError(
                f"{index}: tensor {name!r} is mapped to {file!r}, outside the checkpoint folder; "
                f"shards must be files inside it"
            )
    return weight_map


_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
}
FLOATING_DTYPES = frozenset(np.dtype(d) for d in _ST_DTYPES.values())  # what parameters are stored as
# Sizes a model cannot be built without; each must be a positive integer where the config sets it.
_POSITIVE_SIZES = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "max_position_embeddings", "type_vocab_size", "image_size",
    "patch_size", "num_channels", "num_labels",
)
_PER_AXIS = ("image_size", "patch_size")
_EPSILONS = ("layer_norm_eps", "layer_norm_epsilon", "rms_norm_eps")


def check_config(config, where: str = "config") -> None:
    """Raise CheckpointError when `config`'s sizes cannot describe a model (zero or negative sizes,
    heads that do not divide the width, a negative or non-finite norm epsilon)."""
    for key in _POSITIVE_SIZES:
        value = getattr(config, key, None)
        if value is None:
            continue
        # Image and patch sizes may be (height, width).
        parts = value if key in _PER_AXIS and isinstance(value, (list, tuple)) and len(value) == 2 else [value]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in parts):
            raise CheckpointError(f"{where}: {key}={value!r}; expected a positive integer")
    for key in _EPSILONS:
        value = getattr(config, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not np.isfinite(value) or value < 0):
            raise CheckpointError(f"{where}: {key}={value!r}; expected a finite number >= 0")
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if heads and getattr(config, "head_dim", None) is None and config.hidden_size % heads:
        raise CheckpointError(
            f"{where}: hidden_size={config.hidden_size} is not a multiple of num_attention_heads={heads}"
        )
    if heads and kv and heads % kv:
        raise CheckpointError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")


def load_hf(path: str | os.PathLike, *, dtype=None, allow_nonfinite: bool = False, weights: bool = True,
            record: InferredRecord | None = None) -> Checkpoint:
    """Load a Hugging Face checkpoint folder as a `Checkpoint`.

    dtype: the params' dtype; default: each tensor's stored floating dtype (`save_hf` writes each
    back in it). Tensors the model reads must be floating (F16, BF16, F32, F64); other dtypes are
    refused rather than cast. Non-finite values (NaN, Inf) are refused unless `allow_nonfinite`,
    which loads them with a warning. weights=False reads only config.json and the safetensors
    headers, checks every name, shape and dtype as a full load does, and returns params whose
    leaves are `jax.ShapeDtypeStruct`s (for plans and memory estimates: nothing else is read).
    record: for a model_type without a record of its own, an inferred one (`rotsym_jax.infer_record`).
    Raises `CheckpointError` (or FileNotFoundError) naming the file, tensor and shapes on bad input.
    """
    folder = Path(path)
    if link_problem(folder):
        raise CheckpointError(link_problem(folder))
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such checkpoint folder (expected config.json + {WEIGHTS}, or an Orbax checkpoint or run)")
    config_file = folder / "config.json"
    config, family = read_model_config(config_file, record)

    files = TensorFiles(folder)
    names = files.names()
    stored = {name: files.dtype(name) for name in names}
    float_dtypes = [d for d in stored.values() if d in _ST_DTYPES]
    if not float_dtypes:
        raise CheckpointError(f"{folder}: the checkpoint holds no floating-point tensors")
    majority = jnp.dtype(_ST_DTYPES[collections.Counter(float_dtypes).most_common(1)[0][0]])

    layout = config_step(config_file, lambda: family.detect(names, config))
    rules = config_step(config_file, lambda: family.tensors(config, layout))
    expected = config_step(config_file, lambda: family.shapes(config, layout))

    flat: dict[str, jax.Array] = {}
    leaf_dtypes: dict[str, np.dtype] = {}
    used: set[str] = set()
    nonfinite: list[str] = []
    stacks: list = []
    for rule in rules:
        want = _expected_hf_shape(rule, expected)
        if rule.hf not in names:
            raise CheckpointError(
                f"{folder}: tensor {rule.hf!r} (our leaf {', '.join(rule.ours)}) is missing; expected shape "
                f"{want} from config.json ({describe_config(config)})"
            )
        got = files.shape(rule.hf)
        if got != want:
            raise CheckpointError(
                f"{files.where[rule.hf]}: tensor {rule.hf!r} has shape {got}, expected {want} from "
                f"config.json ({describe_config(config)}); the config disagrees with the weights"
            )
        if stored[rule.hf] not in _ST_DTYPES:
            raise CheckpointError(
                f"{files.where[rule.hf]}: tensor {rule.hf!r} has dtype {stored[rule.hf]}; parameters must "
                f"be floating ({', '.join(_ST_DTYPES)}), and casting would change their values"
            )
        stored_dtype = np.dtype(_ST_DTYPES[stored[rule.hf]])
        used.add(rule.hf)
        if not weights:
            for our_path in rule.ours:
                flat[our_path] = jax.ShapeDtypeStruct(expected[our_path], jnp.dtype(dtype or stored_dtype))
                leaf_dtypes[our_path] = stored_dtype
            continue
        array = files.get(rule.hf)
        bad = nonfinite_count(array)
        if bad:
            nonfinite.append(f"{rule.hf} ({bad} of {array.size})")
        if rule.index is not None:  # one expert of a stacked leaf: stacked once all are read
            stacks.append((rule, rule.to_ours(array)))
        for our_path, leaf in zip(rule.ours, () if rule.index is not None else rule.to_ours(array)):
            flat[our_path] = to_device(leaf, dtype)
        for our_path in rule.ours:
            leaf_dtypes[our_path] = stored_dtype
    for our_path, leaf in assemble(stacks).items():
        flat[our_path] = to_device(leaf, dtype)
    if nonfinite:
        message = f"{folder}: non-finite values (NaN or Inf) in {len(nonfinite)} tensors: {nonfinite[:8]}"
        if not allow_nonfinite:
            raise CheckpointError(message + "; pass allow_nonfinite=True to load them anyway")
        warnings.warn(message, stacklevel=2)

    for hf_name, our_path in family.tied(config, layout).items():
        if hf_name in names:
            used.add(hf_name)
            if not weights:  # the equality check reads both tensors
                continue
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
            f"head={layout.head!r} ({describe_config(config)}): {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}; does config.json match the weights?"
        )
    missing = sorted(set(expected) - set(flat))
    if missing:  # a family whose rules do not cover its model: a bug of ours, not of the input
        raise AssertionError(f"{family.name}: no tensor rule fills {missing}")
    return Checkpoint(family.name, config, unflatten(flat), layout, majority, folder, leaf_dtypes)


def candidate_records(path: str | os.PathLike) -> tuple[list[InferredRecord], dict[str, tuple[float, str]]]:
    """For a checkpoint whose model_type has no record: every model type of ours whose tables hold
    exactly its tensors (each name, shape and dtype, nothing left over: `load_hf(weights=False)`
    read as that type), as unproven `InferredRecord`s in our families' order; and, for each other
    type, (the share of tensor names its tables and the checkpoint have in common, the first
    mismatch). No weight is read, nothing is run."""
    folder = Path(path)
    raw = _read_json_object(folder / "config.json", "a model config")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type in supported_model_types():
        raise CheckpointError(f"{folder}: model_type {model_type!r} is not one without a record")
    names = TensorFiles(folder).names()
    found, why = [], {}
    for family in FAMILIES:
        for read_as in family.model_types:
            record = InferredRecord(model_type, read_as, _class_stem(raw, family, model_type))
            try:
                load_hf(folder, weights=False, record=record)
            except (CheckpointError, ValueError) as e:
                why[read_as] = (_shared_names(raw, record, names), str(e).removeprefix(str(folder)).lstrip("/: "))
                continue
            found.append(record)
    return found, why


def _shared_names(raw: Mapping, record: InferredRecord, names: set) -> float:
    """|ours & theirs| / |ours | theirs| of the tensor names, read as `record` (0 where its config cannot be)."""
    try:
        config = read_config(raw, record=record)
        family = family_of(config)
        ours = {r.hf for r in family.tensors(config, family.detect(names, config))}
    except (CheckpointError, ValueError, KeyError, TypeError):
        return 0.0
    return len(ours & names) / max(len(ours | names), 1)


def _class_stem(raw: Mapping, family: Family, model_type: str) -> str:
    """transformers' class-name stem of `model_type` ("Helium" of HeliumForCausalLM): from
    config.json's architectures where one ends with a suffix of the family's heads, else from
    transformers' config class, else the model type capitalised."""
    suffixes = sorted([h.suffix for h in family.heads] + ["Model"], key=len, reverse=True)
    for name in raw.get("architectures") or ():
        for suffix in suffixes:
            if isinstance(name, str) and name.endswith(suffix) and len(name) > len(suffix):
                return name[: -len(suffix)]
    module = sys.modules.get("transformers")
    if module is not None and model_type in module.CONFIG_MAPPING:
        return module.CONFIG_MAPPING[model_type].__name__.removesuffix("Config")
    return model_type.capitalize()


def read_model_config(config_file: Path, record: InferredRecord | None = None) -> tuple[ModelConfig, Family]:
    """A checkpoint's config.json read and checked as every loader does: (config, family)."""
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: missing; a checkpoint folder needs config.json")
    raw = _read_json_object(config_file, "a model config")
    config = config_step(config_file, lambda: read_config(raw, str(config_file), record))
    family = family_of(config)
    check_config(config, str(config_file))
    config_step(config_file, lambda: family.check(config))
    return config, family


@functools.lru_cache(maxsize=8)
def _graph(config: ModelConfig, layout: Layout, dtype):
    """The Flax graph of a model's forward pass, without initialising it. Cached: tracing the
    initialisers takes ~0.1 s per layer, and a merge runs several checkpoints of one config."""
    family = family_of(config)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: family.build(config, layout, dtype, nnx.Rngs(0))))
    return graphdef


def to_device(leaf: np.ndarray, dtype) -> jax.Array:
    """A host array as a JAX array of `dtype` (default: its own, as JAX canonicalises it). Cast on
    the host (round to nearest even, as XLA casts) and put on the device: `jnp.asarray` would
    compile a staging program per leaf shape. A strided leaf (a transposed kernel) goes as it is:
    `device_put` lays it out 3x faster than a NumPy copy first (a 3072 x 8192 bf16 kernel: 29 ms
    against 92 ms)."""
    target = jax.dtypes.canonicalize_dtype(leaf.dtype if dtype is None else jnp.dtype(dtype))
    return jax.device_put(leaf if leaf.dtype == target else leaf.astype(target))


_BF16 = np.dtype(ml_dtypes.bfloat16)


def nonfinite_count(array: np.ndarray) -> int:
    """How many entries of a floating array are NaN or Inf. bfloat16 by its exponent bits (all
    ones: not finite), which NumPy counts 2.5x faster than ml_dtypes' `isfinite`."""
    if array.dtype == _BF16:
        return int(np.count_nonzero((array.view(np.uint16) & 0x7F80) == 0x7F80))
    return array.size - int(np.count_nonzero(np.isfinite(array)))


def config_step(config_file: Path, step):
    """Run a step that reads the config; a value it cannot use becomes a CheckpointError."""
    try:
        return step()
    except CheckpointError:
        raise
    except Exception as e:  # a value the config or the family cannot use: ValueError, TypeError, ...
        raise CheckpointError(f"{config_file}: cannot read the model from this config ({type(e).__name__}: {e})") from e


def _expected_hf_shape(rule, expected) -> tuple:
    zeros = tuple(np.broadcast_to(np.zeros((), np.float32), expected[p]) for p in rule.ours)
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
    allow_nonfinite: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    extra_files: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
) -> Path:
    """Write `params` as a Hugging Face checkpoint folder of `checkpoint`'s family and head.

    dtype: a floating dtype for every tensor; default: each tensor's stored dtype in the source
    checkpoint. Tensors that are not finite after the cast (NaN, Inf, or values that overflow the
    dtype) are refused unless `allow_nonfinite`. Tokenizer and other non-weight files of the
    source folder are copied along (never checkpoint folders saved inside it). extra_files: {file
    name: text} written into the folder too (replacing a copied file of that name, e.g. the model
    card README.md), so that they appear with the checkpoint, atomically; or a function returning
    them, called once the weights are written (a report that times the writing).

    The folder is written under a temporary name beside `path` and then moved into place, so that
    `path` holds either its old content or the complete new checkpoint at every instant, and a
    failure leaves the old one and no temporary files. `overwrite=True` replaces only a checkpoint
    folder (config.json + weights), never the source's folder or one of its ancestors. On Linux the
    replacement is one atomic exchange; where the filesystem cannot exchange, the old folder is set
    aside for the instant between two renames (and put back if the second one fails).
    """
    target = Path(path)
    check_target(target, checkpoint.source, overwrite)
    flat = check_params(checkpoint, params)
    family = family_of(checkpoint.model_config)
    if dtype is not None:
        dtype = floating_dtype(dtype)
    tensors: dict[str, np.ndarray] = {}
    nonfinite = []
    for rule in family.tensors(checkpoint.model_config, checkpoint.layout):
        leaves = tuple(np.asarray(flat[p]) for p in rule.ours)
        out_dtype = saved_dtype(checkpoint, rule.ours[0], dtype)
        tensors[rule.hf] = saved_array(rule.to_hf(leaves), out_dtype, "/".join(rule.ours), nonfinite)
    check_saved_finite(nonfinite, allow_nonfinite)

    dtypes = {name: t.dtype for name, t in tensors.items()}
    return write_folder(checkpoint, target, dtypes, lambda tmp: _write_shards(tensors, tmp, max_shard_bytes), extra_files)


def saved_dtype(checkpoint: Checkpoint, path: str, dtype=None) -> np.dtype:
    """The dtype a leaf is saved in: `dtype`, else its stored dtype in the source checkpoint."""
    return dtype or np.dtype(checkpoint.stored_dtypes.get(path, checkpoint.dtype))


def saved_array(array: np.ndarray, dtype, what: str, nonfinite: list) -> np.ndarray:
    """`array` cast for saving, C-contiguous (safetensors' NumPy writer stores other arrays in
    the wrong element order); non-finite values after the cast are noted in `nonfinite`."""
    with np.errstate(over="ignore"):  # an overflow shows as Inf, refused with its leaf
        out = np.ascontiguousarray(np.asarray(array).astype(dtype, copy=False))
    bad = nonfinite_count(out)
    if bad:
        nonfinite.append(f"{what} ({bad} of {out.size} as {np.dtype(dtype)})")
    return out


def check_saved_finite(nonfinite: list, allow_nonfinite: bool) -> None:
    if nonfinite and not allow_nonfinite:
        raise CheckpointError(
            f"params: non-finite values (NaN, Inf, or beyond the saved dtype's range) in {len(nonfinite)} "
            f"leaves: {nonfinite[:8]}; pass allow_nonfinite=True to save them anyway"
        )


def write_folder(checkpoint: Checkpoint, target: Path, dtypes: Mapping[str, Any], write_weights, extra_files=None) -> Path:
    """The folder-writing part of `save_hf`, shared with the streaming path: config.json (from
    the saved tensors' dtypes), `write_weights(tmp)`, the source's other files and `extra_files`
    ({name: text}, or a function of nothing returning it, called once the weights are written)
    in a temporary folder beside `target`, synced to disk, then moved into place atomically
    (`_publish`) and the parent synced; on any failure, a full disk included, the temporary folder
    is removed and `target` is left as it was. While it writes, it holds the lock beside `target`
    (another process writing it is refused, `owned.OutputBusy`) and first removes what killed runs
    left beside it (`owned.sweep`; what it cannot prove dead is named in a warning). The
    temporary folder is `owned.temp_folder`'s: owned from its first instant, so that the command
    line's signal handler or, after a kill, the next run removes it. The caller checks `target`
    first (`check_target`)."""
    family = family_of(checkpoint.model_config)
    target.parent.mkdir(parents=True, exist_ok=True)
    with owned.writing(target):  # another process writing `target` is refused here (the command line asks first)
        for note in owned.sweep(target.parent):  # what killed runs left beside it
            warnings.warn(f"note: {note}", stacklevel=2)
        # A short name of its own (the target's may already be near the 255-byte limit), holding its owner.
        tmp = owned.temp_folder(target.parent, ".rotsym-tmp-", target)
        try:
            write_config(checkpoint, family, dtypes, tmp)
            write_weights(tmp)
            if checkpoint.source is not None and checkpoint.source.is_dir():
                _copy_extra_files(checkpoint.source, tmp)
            for name, text in (extra_files() if callable(extra_files) else extra_files or {}).items():
                _check_extra_name(name)
                (tmp / name).write_text(text)
            owned.sync_tree(tmp)  # on disk before the rename publishes it: after a power cut, old or complete new
            with owned.critical():  # a signal's cleanup waits for the renames
                owned.unmark(tmp)
                owned.sync_folder(tmp)
                replaced = _publish(tmp, target)
                owned.published(tmp, target, replaced)
        except BaseException as e:
            owned.discard(tmp)
            if isinstance(e, OSError):
                e.add_note(f"{target} was left as it was and the partial output removed")
            raise
        owned.sync_folder(target.parent)
        if replaced is not None and not owned.discard(replaced):
            warnings.warn(f"saved {target}, but could not delete its previous content at {replaced}", stacklevel=2)
    return target


def _check_extra_name(name: str):
    if not isinstance(name, str) or not name or "/" in name or name.startswith(".") or name in _OWN_FILES or name.endswith(_WEIGHT_SUFFIXES):
        raise CheckpointError(f"extra_files: {name!r} cannot be written beside the checkpoint (a plain file name that is not config.json or weights)")


def floating_dtype(dtype) -> np.dtype:
    dtype = np.dtype(jnp.dtype(dtype))
    if dtype not in {np.dtype(d) for d in _ST_DTYPES.values()}:
        raise CheckpointError(f"dtype={dtype}: checkpoints are saved as float16, bfloat16, float32 or float64")
    return dtype


def is_checkpoint_folder(folder: Path) -> bool:
    """A folder with a config.json naming a model_type and weights: safetensors, or an Orbax
    checkpoint of the params (what `save_orbax` writes)."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    if not ((folder / WEIGHTS).is_file() or (folder / WEIGHTS_INDEX).is_file() or is_orbax_item(folder / ORBAX_ITEM)):
        return False
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and "model_type" in raw


def check_output(target, sources=(), *, overwrite: bool = False, output_bytes: int = 0, scratch_bytes: int = 0,
                 overwrite_option: str = "overwrite=True") -> Path:
    """Refuse, before any work, an output folder that `save_hf` (or a streamed run) must not or
    cannot write: a symbolic link, a mount point, one of the source folders `sources` (or an
    ancestor of one, or a folder inside one),
    something that exists without `overwrite` (or that is not a checkpoint folder), a place that
    is not writable, or a disk without room for `output_bytes` of weights and `scratch_bytes`
    written beside them during the run. `overwrite_option` names, in the message, how the caller
    asks to overwrite (the command line's `--overwrite`)."""
    target = Path(target)
    for source in list(sources) or [None]:
        check_target(target, None if source is None else Path(source), overwrite, overwrite_option)
        if source is not None and Path(source).resolve() in target.resolve().parents:  # a run's inputs are never written to
            raise FileExistsError(f"{target} lies inside the input {source}; a run writes outside the folders it reads")
    existing = next(p for p in (target.parent, *target.parent.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    need = output_bytes + scratch_bytes + 16 * 2**20
    if (output_bytes or scratch_bytes) and free < need:
        what = "the output needs" if not scratch_bytes else "the output and the statistics spilled beside it need"
        raise OSError(errno.ENOSPC, f"{existing}: {free / 2**30:.2f} GiB free, {what} {need / 2**30:.2f} GiB; nothing was written")
    return target


def check_target(target: Path, source: Path | None, overwrite: bool, overwrite_option: str = "overwrite=True"):
    """Refuse, before writing anything, a target that save_hf must not or cannot replace."""
    if target.name.isdigit() and is_orbax_run(target.parent):
        raise FileExistsError(f"{target} would become step {target.name} of the Orbax training run {target.parent} (its latest, for "
                              "Orbax and rotsym alike); save elsewhere")
    if target.is_symlink():
        raise FileExistsError(f"{target} is a symbolic link (to {os.readlink(target)!r}); save to a real path")
    if target.is_dir() and os.path.ismount(target):  # a rename cannot replace it (EBUSY): refused before any work
        raise FileExistsError(f"{target} is a mount point, which a folder cannot be renamed over; write to a folder inside it or elsewhere")
    if source is not None:
        resolved, source = target.resolve(), source.resolve()
        if resolved == source or resolved in source.parents:
            raise FileExistsError(
                f"{target} holds the source checkpoint {source} these params came from; save elsewhere"
            )
    if target.exists():
        if not is_checkpoint_folder(target):  # never replaced: naming the option would mislead
            kind = "a folder that is not a checkpoint (no config.json + model.safetensors)" if target.is_dir() else "a file, not a folder"
            raise FileExistsError(f"{target} exists and is {kind}; {overwrite_option} replaces only checkpoint folders: choose another path")
        if not overwrite:
            raise FileExistsError(f"{target} exists; pass {overwrite_option} to replace it")
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"{existing} is not a folder; cannot save {target} there")
    for folder in {existing, target.parent}:
        if folder.exists() and not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"{folder} is not writable; cannot save {target}")


def write_config(checkpoint: Checkpoint, family: Family, dtypes: Mapping[str, Any], folder: Path):
    """config.json as it was read (every key kept, transformers reads it as it read the source),
    with the saved architecture and dtype, written as `save_pretrained` formats it."""
    config = checkpoint.model_config.raw
    config.pop("torch_dtype", None)  # the old name of `dtype`, which is set below
    config["architectures"] = [family.architecture(checkpoint.model_config, checkpoint.layout)]
    # transformers' `dtype` names one dtype: the most common one, as load_hf picks it.
    common = collections.Counter(np.dtype(d) for d in dtypes.values()).most_common(1)[0][0]
    config["dtype"] = "bfloat16" if common == ml_dtypes.bfloat16 else str(common)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _publish(tmp: Path, target: Path) -> Path | None:
    """Move the finished folder `tmp` to `target`. Returns where the replaced content now is (to
    delete), or None when there was none."""
    if not target.exists():
        _rename_noreplace(tmp, target)
        return None
    try:
        _exchange(tmp, target)
        return tmp
    except NotImplementedError:
        pass
    old = target.parent / f".rotsym-old-{uuid.uuid4().hex}"
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    return old


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _renameat2(source: Path, dest: Path, flags: int):
    """Linux renameat2(2); NotImplementedError where libc or the filesystem lacks it."""
    renameat2 = getattr(_libc(), "renameat2", None) if sys.platform.startswith("linux") else None
    if renameat2 is None:
        raise NotImplementedError("renameat2 is not available")
    if renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(dest), flags) != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise NotImplementedError(f"renameat2 flags={flags} unsupported here: {os.strerror(err)}")
        raise OSError(err, os.strerror(err), str(source), None, str(dest))


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _exchange(a: Path, b: Path):
    """Atomically swap two folders."""
    _renameat2(a, b, _RENAME_EXCHANGE)


def _rename_noreplace(source: Path, dest: Path):
    try:
        _renameat2(source, dest, _RENAME_NOREPLACE)
    except NotImplementedError:
        if dest.exists():
            raise FileExistsError(f"{dest} appeared while saving; not replacing it") from None
        os.rename(source, dest)


def copy_config(config):
    """A copy of a transformers config (a ModelConfig is read-only: itself)."""
    if isinstance(config, ModelConfig):
        return config
    return config.__class__.from_dict(config.to_dict())


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> dict[str, list[str]]:
    """{file name: tensor names} of a checkpoint whose tensors have `sizes` (bytes): names in
    sorted order, a new shard when the next tensor would pass `max_shard_bytes`; one file
    (model.safetensors) when they all fit."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(sizes):
        if shards[-1] and size + sizes[name] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += sizes[name]
    if len(shards) == 1:
        return {WEIGHTS: shards[0]}
    return {f"model-{i:05d}-of-{len(shards):05d}.safetensors": names for i, names in enumerate(shards, 1)}


def _write_index(folder: Path, shards: Mapping[str, list[str]], total_size: int):
    weight_map = {name: fname for fname, names in shards.items() for name in names}
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def _write_shards(tensors: dict[str, np.ndarray], folder: Path, max_shard_bytes: int):
    shards = plan_shards({name: t.nbytes for name, t in tensors.items()}, max_shard_bytes)
    metadata = {"format": "pt"}
    for fname, names in shards.items():
        try:
            safetensors.numpy.save_file({name: tensors[name] for name in names}, folder / fname, metadata=metadata)
        except Exception as e:  # SafetensorError("... No space left on device (os error 28)"): an OSError, as the streamed writer's
            code = re.search(r"os error (\d+)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(folder / fname)) from None
    if len(shards) > 1:
        _write_index(folder, shards, sum(t.nbytes for t in tensors.values()))


_DTYPE_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


class ShardWriter:
    """The safetensors files of a checkpoint whose tensors' dtypes and shapes are known up front,
    written one tensor at a time in any order: every header (and the index) is written first,
    each tensor's bytes then go to their place (`write`), so a streaming run holds no more than
    the tensors it is working on. `finish()` checks that every tensor was written. The files are
    those `save_hf` writes (same shards, same tensors), but not byte for byte: tensors lie in
    name order in each file.

    Several processes write one checkpoint together: one creates the files (`create=True`), the
    others open them (`create=False`, after it), each writing the tensors named in `writes`
    (default: all) at their places; the files are those one process writes, byte for byte."""

    def __init__(self, folder: Path, specs: Mapping[str, tuple[np.dtype, tuple]], max_shard_bytes: int, *, create: bool = True,
                 writes=None):
        self._specs = {name: (np.dtype(d), tuple(shape)) for name, (d, shape) in specs.items()}
        sizes = {name: int(np.prod(shape, dtype=np.int64)) * d.itemsize for name, (d, shape) in self._specs.items()}
        self.shards = plan_shards(sizes, max_shard_bytes)
        self._where, self._fds, self._pending = {}, {}, set(self._specs if writes is None else writes)
        for fname, names in self.shards.items():
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name in names:
                d, shape = self._specs[name]
                header[name] = {"dtype": _DTYPE_NAMES[d], "shape": list(shape), "data_offsets": [offset, offset + sizes[name]]}
                offset += sizes[name]
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
            fd = os.open(folder / fname, os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0), 0o644)
            self._fds[fname] = fd
            start = 8 + len(text)
            if create:
                _write_all(fd, struct.pack("<Q", len(text)) + text, 0)
                os.ftruncate(fd, start + offset)
            for name in names:
                self._where[name] = (fd, start + header[name]["data_offsets"][0])
        if create and len(self.shards) > 1:
            _write_index(folder, self.shards, sum(sizes.values()))

    def write(self, name: str, tensor: np.ndarray):
        d, shape = self._specs[name]
        if tensor.dtype != d or tuple(tensor.shape) != shape:
            raise CheckpointError(f"tensor {name!r}: got {tensor.dtype} {tuple(tensor.shape)}, the header says {d} {shape}")
        fd, offset = self._where[name]
        _write_all(fd, memoryview(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)), offset)
        self._pending.discard(name)

    def write_rows(self, name: str, start: int, rows: np.ndarray):
        """Rows [start, start + len(rows)) of tensor `name` (the whole tensor is then written by
        the calls that cover its rows; `done(name)` marks it written)."""
        d, shape = self._specs[name]
        if rows.dtype != d or tuple(rows.shape[1:]) != shape[1:] or start + rows.shape[0] > shape[0]:
            raise CheckpointError(f"tensor {name!r}: rows {start}+{rows.shape} of {rows.dtype} do not fit {d} {shape}")
        fd, offset = self._where[name]
        row = int(np.prod(shape[1:], dtype=np.int64)) * d.itemsize
        _write_all(fd, memoryview(np.ascontiguousarray(rows).reshape(-1).view(np.uint8)), offset + start * row)

    def done(self, name: str):
        self._pending.discard(name)

    def finish(self):
        """Check that every tensor was written, then close the files."""
        if self._pending:
            raise AssertionError(f"tensors never written: {sorted(self._pending)[:8]}")
        self.close()

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _write_all(fd: int, data, offset: int):
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):  # ENOSPC and other write errors raise OSError here
        done += os.pwrite(fd, view[done:], offset + done)


def _copy_extra_files(source: Path, dest: Path):
    # Folders only from a Hugging Face folder (tokenizer subfolders); an Orbax checkpoint's or
    # run's folders hold its params, its steps, a training run's logs. A run's step folder has
    # its model files (config, tokenizer) in the run's folder.
    if not (source / "config.json").is_file() and (source.parent / "config.json").is_file():
        source = source.parent
    folders = (source / WEIGHTS).is_file() or (source / WEIGHTS_INDEX).is_file()
    for item in source.iterdir():
        if item.name in _OWN_FILES or item.name.endswith(_WEIGHT_SUFFIXES) or item.name.startswith("."):
            continue
        if item.is_file():
            shutil.copy2(item, dest / item.name)
        elif folders and item.is_dir() and not is_checkpoint_folder(item) and not is_orbax_item(item):  # not an earlier output
            shutil.copytree(item, dest / item.name)


def is_orbax_item(folder: Path) -> bool:
    """A folder Orbax wrote one checkpoint (item) into."""
    return folder.is_dir() and not folder.is_symlink() and any((folder / m).is_file() for m in ORBAX_MARKERS)


def is_orbax_run(folder: Path) -> bool:
    """A CheckpointManager folder: numbered step folders holding the params' item."""
    return folder.is_dir() and any(d.name.isdigit() and any(is_orbax_item(d / i) for i in ORBAX_ITEMS) for d in folder.iterdir())


def orbax_hint(folder: Path) -> str:
    """What an Orbax folder that `load_orbax` does not read holds, for an error message ("" when
    the folder shows no Orbax files)."""
    children = [d for d in folder.iterdir() if d.is_dir()] if folder.is_dir() else []
    unfinished = sorted(d.name for d in children if "orbax-checkpoint-tmp" in d.name)
    if unfinished:
        return f" ({unfinished[0]} is an unfinished Orbax save: its step or item is complete once Orbax renames it)"
    steps = sorted((d for d in children if d.name.isdigit() and any(is_orbax_item(x) or (x / "_CHECKPOINT_METADATA").exists() for x in [d, *d.iterdir()])),
                   key=lambda d: int(d.name))
    if steps:
        items = sorted(x.name for x in steps[-1].iterdir() if x.is_dir())
        return (f" (an Orbax CheckpointManager run whose step {steps[-1].name} holds the items {items}; the params are read from "
                f"an item named {' or '.join(repr(i) for i in ORBAX_ITEMS)})")
    items = sorted(d.name for d in children if is_orbax_item(d))
    if items or any((folder / m).is_file() for m in ORBAX_MARKERS):
        return (f" (an Orbax checkpoint{f' with the items {items}' if items else ''}; rotsym_jax reads the params from an item named "
                f"{ORBAX_ITEM!r} beside config.json: rj.save_orbax writes one)")
    return ""
