"""Safetensors files: a checkpoint's tensors read lazily (a tensor, or rows of one, at a time), checked
(links, truncation, headers), and written in shards as transformers shards them."""

from __future__ import annotations

import errno
import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors.numpy
from safetensors import safe_open

from ..errors import MissingPath, RotsymError

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# An Orbax checkpoint folder (`save_orbax`): config.json beside the params' Orbax item. A training
# run's step folders hold the params as the item "params" (of a Composite) or "default".
ORBAX_ITEM = "params"
ORBAX_ITEMS = (ORBAX_ITEM, "default")
ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".h5", ".msgpack", ".ckpt")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a Hugging Face Hub repository: org/name


class CheckpointError(RotsymError, ValueError):
    """A checkpoint folder, config or params pytree that cannot be read or written as asked."""


class NonFiniteWeights(CheckpointError):
    """A checkpoint with NaN or Inf weights, refused: `found` says where, `what` names the model
    where the reader knows it, `hint` what the caller can do. The command line, which has no use
    for such a model, words its own line from `what` and `found` (`UNUSABLE`)."""

    def __init__(self, found: str, what: str = "", hint: str = "pass allow_nonfinite=True to load them anyway"):
        self.found, self.what = found, what
        super().__init__(f"{what + ': ' if what else ''}{found}; {hint}")


UNUSABLE = "a model with NaN or Inf weights cannot be aligned or merged"


class TensorFiles:
    """Lazy access to the tensors of model.safetensors or a sharded index; every failure to read
    one is a CheckpointError naming the file."""

    def __init__(self, folder: Path):
        self._layouts, self._fds = {}, {}  # for `read`: headers parsed, files opened on first use
        single, index = folder / WEIGHTS, folder / WEIGHTS_INDEX
        if exists(single):
            files = {single: single}
            self.where = None
        elif exists(index):
            weight_map = read_index(index)
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
            check_inside(folder, f)
        self.handles = {f: open_safetensors(f) for f in files}
        if single in self.handles:
            self.where = {name: single for name in self.handles[single].keys()}
        else:
            self.where = {name: folder / f for name, f in weight_map.items()}
            for f, h in self.handles.items():
                present = set(h.keys())
                absent = [n for n, g in self.where.items() if g == f and n not in present]
                if absent:
                    raise CheckpointError(f"{f}: tensors listed in {index.name} are absent: {absent[:5]}")
        # Fine-grained FP8 (DeepSeek-V3, Qwen3-FP8): a weight beside its scales, read dequantized
        self.scales = {name: name + FP8_SCALE for name in self.where if name + FP8_SCALE in self.where}
        self.block = fp8_block(folder) if self.scales else None

    def names(self) -> set[str]:
        """The tensors, an FP8 weight's scales left out (they are read with it)."""
        return set(self.where) - set(self.scales.values())

    def _read(self, name, what):
        file = self.where[name]
        try:
            return what(self.handles[file], name)
        except Exception as e:  # safetensors raises its own SafetensorError without the path
            raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({type(e).__name__}: {e})") from e

    def shape(self, name) -> tuple:
        return tuple(self._read(name, lambda h, n: h.get_slice(n).get_shape()))

    def dtype(self, name) -> str:
        """The stored dtype; an FP8 weight's is bfloat16, the dtype it is written back in."""
        return "BF16" if name in self.scales else self._read(name, lambda h, n: h.get_slice(n).get_dtype())

    def get(self, name) -> np.ndarray:
        return self.read(name) if name in self.scales else self._read(name, lambda h, n: h.get_tensor(n))

    def read(self, name, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Tensor `name` (or its rows [start, stop) along axis 0) read with plain file reads into a
        fresh array: unlike a memory map, the pages read stay in the page cache and never count in
        this process's resident memory, so streaming stays within its budget. An FP8 weight comes
        dequantized, in float32: each block of `self.block` entries times its scale, as
        transformers dequantizes it."""
        if name not in self.scales:
            return self._raw(name, rows, ST_DTYPES)
        weight = self._raw(name, rows, FP8_DTYPES).astype(np.float32)
        scale = self._raw(self.scales[name], None, {"F32": np.float32, "BF16": ml_dtypes.bfloat16}).astype(np.float32)
        shape = self.shape(name)
        grid = tuple(-(-n // b) for n, b in zip(shape, self.block)) if len(shape) == 2 else None
        if grid is None or scale.shape != grid:
            raise CheckpointError(f"{self.where[name]}: FP8 tensor {name!r} {shape} has scales {self.scales[name]!r} {scale.shape}; expected "
                                  f"{grid or 'a 2-D weight'} (blocks of weight_block_size {list(self.block)}, the last one cut)")
        start = 0 if rows is None else rows[0]
        row_blocks = np.arange(start, start + len(weight)) // self.block[0]
        return weight * scale[row_blocks][:, np.arange(shape[1]) // self.block[1]]

    def _raw(self, name, rows, dtypes: Mapping) -> np.ndarray:
        file = self.where[name]
        dtype_name, shape, begin, end = self._layout(file)[name]
        if dtype_name not in dtypes:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype_name}; expected {', '.join(dtypes)}"
                                  + ("" if dtypes is not ST_DTYPES else " (parameters must be floating)"))
        dtype = np.dtype(dtypes[dtype_name])
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


def exists(path: Path) -> bool:
    """True for a file; False for nothing there; a dangling link or a folder is an error."""
    if path.is_symlink() and not path.exists():
        raise CheckpointError(f"{path} is a symbolic link to {os.readlink(path)!r}, which does not exist")
    if path.exists() and not path.is_file():
        raise CheckpointError(f"{path} is not a file")
    return path.exists()


def check_inside(folder: Path, file: Path) -> None:
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


def missing_folder(folder: Path, expected: str) -> CheckpointError | MissingPath:
    """The refusal of a checkpoint folder that is not one: a file (config.json, a shard) named with
    the folder it is in, else a path that does not exist."""
    if folder.is_file():
        holds = "" if (folder.parent / "config.json").is_file() else ", though it holds no config.json either"
        return CheckpointError(f"{folder} is a file, not a checkpoint folder: give the folder it is in, {folder.parent}{holds}")
    return MissingPath(f"{folder}: no such checkpoint folder{expected}")


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


def open_safetensors(file: Path):
    try:
        return safe_open(file, "numpy")
    except Exception as e:  # SafetensorError ("header too small", "incomplete metadata"), OSError
        size = file.stat().st_size if file.exists() else None
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({size} bytes; {type(e).__name__}: {e}); "
            f"truncated or corrupt?"
        ) from e


# config.json and a shard index: the largest indexes (a hundred thousand tensors) hold about 10 MB.
MAX_JSON_BYTES = 2**26


def read_json_object(file: Path, what: str) -> dict:
    with open(file, "rb") as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise CheckpointError(f"{file}: over {MAX_JSON_BYTES:,} bytes, which is not {what}")
    try:
        raw = json.loads(data.decode("utf-8"))
    except ValueError as e:  # not JSON, not UTF-8, an integer of thousands of digits
        raise CheckpointError(f"{file}: invalid JSON: {e}") from e
    except RecursionError:
        raise CheckpointError(f"{file}: JSON nested too deeply to be {what}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: {what} must be a JSON object, got a JSON {type(raw).__name__}")
    return raw


def json_object_or_empty(file: Path) -> dict:
    """A JSON object file as a dict, or {} where it is missing, unreadable or not an object (for
    files that only add to what a checkpoint says: tokenizer and processor configs, a report)."""
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError, UnicodeDecodeError):
        return {}
    return raw if isinstance(raw, dict) else {}


def read_index(index: Path) -> dict[str, str]:
    """The index's weight_map, each shard a relative path inside the folder."""
    weight_map = read_json_object(index, "a safetensors index").get("weight_map")
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


ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
}
FLOATING_DTYPES = frozenset(np.dtype(d) for d in ST_DTYPES.values())  # what parameters are stored as
# Fine-grained FP8 as transformers' FineGrainedFP8Config and DeepSeek's checkpoints store it: an
# F8_E4M3 `<name>` and its float32 scales `<name>_scale_inv`, one per block of weight_block_size.
FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn}
FP8_SCALE = "_scale_inv"


def fp8_block(folder: Path) -> tuple[int, int]:
    """The (rows, columns) of an FP8 checkpoint's scale blocks, from config.json's
    quantization_config; a CheckpointError naming what is missing or not read."""
    try:
        quantization = json.loads((folder / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{folder}/config.json: unreadable ({type(e).__name__}: {e}); its tensors hold FP8 scales") from None
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        raise CheckpointError(f"{folder}: tensors with FP8 scales (*{FP8_SCALE}), but config.json's quantization_config is "
                              f"{quantization!r}; expected quant_method 'fp8' (fine-grained FP8, the only quantization read)")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{folder}/config.json: quantization_config.weight_block_size={block!r}; expected [rows, columns] of "
                              "each scale's block (per-tensor FP8 is not read)")
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{folder}/config.json: quantization_config.fmt={quantization['fmt']!r}; only e4m3 is read")
    return tuple(block)


BF16 = np.dtype(ml_dtypes.bfloat16)


def nonfinite_count(array: np.ndarray) -> int:
    """How many entries of a floating array are NaN or Inf. bfloat16 by its exponent bits (all
    ones: not finite), which NumPy counts 2.5x faster than ml_dtypes' `isfinite`."""
    if array.dtype == BF16:
        return int(np.count_nonzero((array.view(np.uint16) & 0x7F80) == 0x7F80))
    return array.size - int(np.count_nonzero(np.isfinite(array)))


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


def write_index(folder: Path, shards: Mapping[str, list[str]], total_size: int):
    weight_map = {name: fname for fname, names in shards.items() for name in names}
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def write_shards(tensors: dict[str, np.ndarray], folder: Path, max_shard_bytes: int):
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
        write_index(folder, shards, sum(t.nbytes for t in tensors.values()))


DTYPE_NAMES = {np.dtype(v): k for k, v in ST_DTYPES.items()}


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
                header[name] = {"dtype": DTYPE_NAMES[d], "shape": list(shape), "data_offsets": [offset, offset + sizes[name]]}
                offset += sizes[name]
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
            path = folder / fname
            fd = os.open(path, os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0), 0o644)
            self._fds[fname] = fd
            start = 8 + len(text)
            if create:
                write_all(fd, struct.pack("<Q", len(text)) + text, 0, path)
                os.ftruncate(fd, start + offset)
            for name in names:
                self._where[name] = (fd, start + header[name]["data_offsets"][0], path)
        if create and len(self.shards) > 1:
            write_index(folder, self.shards, sum(sizes.values()))

    def write(self, name: str, tensor: np.ndarray):
        d, shape = self._specs[name]
        if tensor.dtype != d or tuple(tensor.shape) != shape:
            raise CheckpointError(f"tensor {name!r}: got {tensor.dtype} {tuple(tensor.shape)}, the header says {d} {shape}")
        fd, offset, path = self._where[name]
        write_all(fd, memoryview(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)), offset, path)
        self._pending.discard(name)

    def write_rows(self, name: str, start: int, rows: np.ndarray):
        """Rows [start, start + len(rows)) of tensor `name` (the whole tensor is then written by
        the calls that cover its rows; `done(name)` marks it written)."""
        d, shape = self._specs[name]
        if rows.dtype != d or tuple(rows.shape[1:]) != shape[1:] or start + rows.shape[0] > shape[0]:
            raise CheckpointError(f"tensor {name!r}: rows {start}+{rows.shape} of {rows.dtype} do not fit {d} {shape}")
        fd, offset, path = self._where[name]
        row = int(np.prod(shape[1:], dtype=np.int64)) * d.itemsize
        write_all(fd, memoryview(np.ascontiguousarray(rows).reshape(-1).view(np.uint8)), offset + start * row, path)

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


def write_all(fd: int, data, offset: int, path: Path):
    """`data` at `offset` of the open file `path`; a failed write (a full disk) names the file."""
    view, done = memoryview(data).cast("B"), 0
    try:
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


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
