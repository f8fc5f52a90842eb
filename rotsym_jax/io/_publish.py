"""An output folder checked before any work (not a source, not existing, room on its disk) and published
atomically: written under a temporary name, then renamed (exchanged, where it replaces one)."""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from ..errors import PathExists
from ._files import ORBAX_ITEM, ST_DTYPES, WEIGHT_SUFFIXES, WEIGHTS, WEIGHTS_INDEX, CheckpointError, is_orbax_item, is_orbax_run

# Files of a checkpoint folder that save_hf writes itself; everything else (tokenizer, README…)
# is copied from the source folder.
OWN_FILES = ("config.json", WEIGHTS, WEIGHTS_INDEX)


def check_extra_name(name: str):
    if not isinstance(name, str) or not name or "/" in name or name.startswith(".") or name in OWN_FILES or name.endswith(WEIGHT_SUFFIXES):
        raise CheckpointError(f"extra_files: {name!r} cannot be written beside the checkpoint (a plain file name that is not config.json or weights)")


def floating_dtype(dtype) -> np.dtype:
    dtype = np.dtype(jnp.dtype(dtype))
    if dtype not in {np.dtype(d) for d in ST_DTYPES.values()}:
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
            raise PathExists(f"{target} lies inside the input {source}; a run writes outside the folders it reads")
    existing = next(p for p in (target.parent, *target.parent.parents) if p.exists())
    usage = shutil.disk_usage(existing)
    free, need = usage.free, output_bytes + scratch_bytes + 16 * 2**20
    if (output_bytes or scratch_bytes) and free < need:
        if usage.total == 0:
            raise PermissionError(f"{existing} is on a file system of no size (as /proc and /sys are), which holds no checkpoint; "
                                  "write the output elsewhere")
        what = "the output needs" if not scratch_bytes else "the output and the statistics spilled beside it need"
        raise OSError(errno.ENOSPC, f"{existing}: {free / 2**30:.2f} GiB free, {what} {need / 2**30:.2f} GiB; nothing was written")
    return target


def check_target(target: Path, source: Path | None, overwrite: bool, overwrite_option: str = "overwrite=True"):
    """Refuse, before writing anything, a target that save_hf must not or cannot replace."""
    if target.name.isdigit() and is_orbax_run(target.parent):
        raise PathExists(f"{target} would become step {target.name} of the Orbax training run {target.parent} (its latest, for "
                              "Orbax and rotsym alike); save elsewhere")
    if target.is_symlink():
        raise PathExists(f"{target} is a symbolic link (to {os.readlink(target)!r}); save to a real path")
    if target.is_dir() and os.path.ismount(target):  # a rename cannot replace it (EBUSY): refused before any work
        raise PathExists(f"{target} is a mount point, which a folder cannot be renamed over; write to a folder inside it or elsewhere")
    if source is not None:
        resolved, source = target.resolve(), source.resolve()
        if resolved == source or resolved in source.parents:
            raise PathExists(
                f"{target} holds the source checkpoint {source} these params came from; save elsewhere"
            )
    if target.exists():
        if not is_checkpoint_folder(target):  # never replaced: naming the option would mislead
            kind = "a folder that is not a checkpoint (no config.json + model.safetensors)" if target.is_dir() else "a file, not a folder"
            raise PathExists(f"{target} exists and is {kind}; {overwrite_option} replaces only checkpoint folders: choose another path")
        if not overwrite:
            raise PathExists(f"{target} exists; pass {overwrite_option} to replace it")
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise NotADirectoryError(f"{existing} is not a folder; cannot save {target} there")
    for folder in {existing, target.parent}:
        if folder.exists() and not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"{folder} is not writable; cannot save {target}")


def publish(tmp: Path, target: Path) -> Path | None:
    """Move the finished folder `tmp` to `target`. Returns where the replaced content now is (to
    delete), or None when there was none."""
    if not target.exists():
        rename_noreplace(tmp, target)
        return None
    try:
        exchange(tmp, target)
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


RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
AT_FDCWD = -100


def renameat2(source: Path, dest: Path, flags: int):
    """Linux renameat2(2); NotImplementedError where libc or the filesystem lacks it."""
    renameat2 = getattr(libc(), "renameat2", None) if sys.platform.startswith("linux") else None
    if renameat2 is None:
        raise NotImplementedError("renameat2 is not available")
    if renameat2(AT_FDCWD, os.fsencode(source), AT_FDCWD, os.fsencode(dest), flags) != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise NotImplementedError(f"renameat2 flags={flags} unsupported here: {os.strerror(err)}")
        raise OSError(err, os.strerror(err), str(source), None, str(dest))


@functools.cache
def libc():
    return ctypes.CDLL(None, use_errno=True)


def exchange(a: Path, b: Path):
    """Atomically swap two folders."""
    renameat2(a, b, RENAME_EXCHANGE)


def rename_noreplace(source: Path, dest: Path):
    try:
        renameat2(source, dest, RENAME_NOREPLACE)
    except NotImplementedError:
        if dest.exists():
            raise PathExists(f"{dest} appeared while saving; not replacing it") from None
        os.rename(source, dest)


def copy_extra_files(source: Path, dest: Path):
    # Folders only from a Hugging Face folder (tokenizer subfolders); an Orbax checkpoint's or
    # run's folders hold its params, its steps, a training run's logs. A run's step folder has
    # its model files (config, tokenizer) in the run's folder.
    if not (source / "config.json").is_file() and (source.parent / "config.json").is_file():
        source = source.parent
    folders = (source / WEIGHTS).is_file() or (source / WEIGHTS_INDEX).is_file()
    for item in source.iterdir():
        if item.name in OWN_FILES or item.name.endswith(WEIGHT_SUFFIXES) or item.name.startswith("."):
            continue
        if item.is_file():
            shutil.copy2(item, dest / item.name)
        elif folders and item.is_dir() and not is_checkpoint_folder(item) and not is_orbax_item(item):  # not an earlier output
            shutil.copytree(item, dest / item.name)
