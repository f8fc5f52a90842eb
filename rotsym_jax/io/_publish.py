"""An output folder checked before any work (not a source, not existing, room on its disk) and published
atomically: written under a temporary name, then renamed (exchanged, where it replaces one)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from ..errors import PathExists
from ._files import ORBAX_ITEM, ST_DTYPES, WEIGHT_SUFFIXES, WEIGHTS, WEIGHTS_INDEX, CheckpointError, is_orbax_item, is_orbax_run, json_object_or_empty

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


def held_dtype(dtype, checkpoints) -> np.dtype | None:
    """The dtype a run holds the weights of `checkpoints` (headers suffice) in when it writes
    `dtype` (None: each leaf's stored dtype, as written by default): float32 where a leaf stored
    narrower than float32 is written in another dtype, so that what is written is the float32
    computation rounded once, to `dtype` (a bfloat16 model written in float32 is not its result
    rounded to bfloat16 first); else None, each leaf as stored."""
    if dtype is None:
        return None
    dtype = floating_dtype(dtype)
    stored = [d for ck in checkpoints for d in (ck.stored_dtypes.values() if ck.stored_dtypes else [ck.dtype])]
    narrower = any(np.dtype(d) != dtype and np.dtype(d).itemsize < 4 for d in stored)
    return np.dtype(np.float32) if narrower else None


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
                 overwrite_option: str = "overwrite=True", writes: tuple[str, ...] = ("config.json",)) -> Path:
    """Refuse, before any work, an output folder that `save_hf` (or a streamed run) must not or
    cannot write: a symbolic link, a mount point, one of the source folders `sources` (or an
    ancestor of one, or a folder inside one),
    something that exists without `overwrite` (or that is not a checkpoint folder), a place that
    is not writable, or a disk without room for `output_bytes` of weights and `scratch_bytes`
    written beside them during the run. `overwrite_option` names, in the message, how the caller
    asks to overwrite (the command line's `--overwrite`); `writes`, the names of the files the run
    writes beside the weights, which may not replace files someone else wrote there."""
    target = Path(target)
    for source in list(sources) or [None]:
        check_target(target, None if source is None else Path(source), overwrite, overwrite_option, writes)
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


def check_target(target: Path, source: Path | None, overwrite: bool, overwrite_option: str = "overwrite=True",
                 writes: tuple[str, ...] = ("config.json",)):
    """Refuse, before writing anything, a target that save_hf must not or cannot replace (one
    whose files among `writes` someone else wrote or changed, too)."""
    if target.name.isdigit() and is_orbax_run(target.parent):
        raise PathExists(f"{target} would become step {target.name} of the Orbax training run {target.parent} (its latest, for "
                              "Orbax and rotsym alike); save elsewhere")
    if target.is_symlink():
        raise PathExists(f"{target} is a symbolic link (to {os.readlink(target)!r}); save to a real path")
    # every folder of the path as given: '..' is not collapsed first (the kernel follows link/.. to the link's parent)
    link = next((p for p in Path(os.getcwd(), target).parents if p.is_symlink()), None)
    if link is not None:  # written through it, the output would land where the path does not say
        raise PathExists(f"{target} lies under the symbolic link {link} (to {os.readlink(link)!r}); save to a real path "
                         f"({target.resolve()})")
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
        clashes = [rel for rel in foreign_files(target) if rel in writes]
        if clashes:
            raise not_ours(target, clashes)
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


# What a checkpoint needs beside its config and weights, copied from the source folder by exact
# name: tokenizer and processor data, generation settings, chat templates, licences. Code and
# anything else (pickled training arguments, logs, a file named like one of these with another
# suffix) is left out: a downloaded folder is untrusted, and its code would reach whoever loads the
# output. The suffixes are formats their readers parse as data (sentencepiece, tiktoken).
CHECKPOINT_DATA = frozenset(name.lower() for name in (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt", "vocab.json",
    "merges.txt", "generation_config.json", "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "chat_template.jinja", "chat_template.json", "README.md", "LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE", "NOTICE.txt",
    "NOTICE.md", "USE_POLICY.md"))
DATA_SUFFIXES = (".model", ".tiktoken", ".spm")
DATA_FOLDERS = frozenset({"tokenizer"})  # a tokenizer's subfolder, as some checkpoints keep one
# Keys of a JSON file that name code to fetch or run (transformers' auto_map, custom pipelines and
# generation code): removed, at any depth, from what is copied.
CODE_KEYS = ("auto_map", "custom_pipelines", "custom_generate")


def extra_files_source(source: Path) -> Path:
    # An Orbax run's step folder has its model files (config, tokenizer) in the run's folder.
    if not (source / "config.json").is_file() and (source.parent / "config.json").is_file():
        return source.parent
    return source


def is_checkpoint_data(path: Path) -> bool:
    name = path.name.lower()
    return path.is_file() and not path.is_symlink() and (name in CHECKPOINT_DATA or name.endswith(DATA_SUFFIXES))


def _code_keys(raw, where: str = "") -> list[str]:
    """The CODE_KEYS of a JSON value, as paths ("auto_map", "image_processor.auto_map")."""
    found = []
    if isinstance(raw, dict):
        for key, value in raw.items():
            path = f"{where}.{key}" if where else str(key)
            found += [path] if key in CODE_KEYS else _code_keys(value, path)
    elif isinstance(raw, list):
        for value in raw:
            found += _code_keys(value, where)
    return found


def without_code_keys(raw):
    if isinstance(raw, dict):
        return {k: without_code_keys(v) for k, v in raw.items() if k not in CODE_KEYS}
    return [without_code_keys(v) for v in raw] if isinstance(raw, list) else raw


def left_out(source) -> list[str]:
    """What `copy_extra_files` leaves out of the folder `source` (its own code and other files a
    checkpoint does not need) and the keys naming code it removes, for the model card."""
    if source is None or not Path(source).is_dir():
        return []
    source = extra_files_source(Path(source))
    names = [f"config.json: {key}" for key in _code_keys(json_object_or_empty(source / "config.json"))]
    for item in sorted(source.iterdir()):
        # the weights, which the output holds as its own (a pickled .bin among the rest: never read, never copied)
        if item.name in OWN_FILES or item.name.endswith((".safetensors", ".index.json")) or item.name.startswith(".") \
                or is_checkpoint_folder(item) or is_orbax_item(item):
            continue
        folder = item.is_dir() and not item.is_symlink() and item.name.lower() in DATA_FOLDERS
        for file in sorted(item.iterdir()) if folder else [item]:
            rel = file.relative_to(source).as_posix()
            if not is_checkpoint_data(file):
                names.append(rel + ("/" if file.is_dir() else ""))
            elif file.suffix == ".json":
                names += [f"{rel}: {key}" for key in _code_keys(json_object_or_empty(file))]
    return names


def copy_data_file(item: Path, dest: Path):
    """`item` copied to `dest`; a JSON file's keys naming code (`CODE_KEYS`) removed."""
    raw = json_object_or_empty(item) if item.suffix == ".json" else {}
    if _code_keys(raw):
        dest.write_text(json.dumps(without_code_keys(raw), indent=2, ensure_ascii=False) + "\n")
    else:
        shutil.copy2(item, dest)


def copy_extra_files(source: Path, dest: Path):
    """The files of `source` that a checkpoint needs beside config and weights (`CHECKPOINT_DATA`),
    copied into `dest` without keys naming code; the rest is left out (`left_out` names it)."""
    # Folders only from a Hugging Face folder; an Orbax checkpoint's or run's folders hold its
    # params, its steps, a training run's logs.
    source = extra_files_source(source)
    folders = (source / WEIGHTS).is_file() or (source / WEIGHTS_INDEX).is_file()
    for item in source.iterdir():
        if item.name in OWN_FILES or item.name.endswith(WEIGHT_SUFFIXES) or item.name.startswith("."):
            continue
        if is_checkpoint_data(item):
            copy_data_file(item, dest / item.name)
        elif folders and item.is_dir() and not item.is_symlink() and item.name.lower() in DATA_FOLDERS and not is_checkpoint_folder(item):
            (dest / item.name).mkdir()
            for sub in item.iterdir():
                if is_checkpoint_data(sub):
                    copy_data_file(sub, dest / item.name / sub.name)


# ---- what an output holds that rotsym did not write -----------------------------------------------

# Every file a run wrote into an output, with its size and modification time: when the output is
# replaced, a file of the earlier one that is not listed (or changed since) is someone else's.
MANIFEST = ".rotsym-written.json"


SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def is_weights_file(relpath: str) -> bool:
    """The weights of the checkpoint an output is (as rotsym names them: model.safetensors, its index
    and shards, Orbax params), which replacing the output replaces. In a streamed run of several
    processes, others write into them after the manifest is made: they are known by name."""
    return relpath in (WEIGHTS, WEIGHTS_INDEX) or bool(SHARD.fullmatch(relpath)) or relpath.split("/", 1)[0] == ORBAX_ITEM


def _files_under(folder: Path) -> dict[str, os.stat_result]:
    """{path relative to `folder`: lstat} of every file and link under `folder` (folders walked, links not followed)."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = os.lstat(path)
    return found


def write_manifest(folder: Path) -> None:
    """`MANIFEST` in `folder`, listing what is there now (the run's files, before any other is kept)."""
    files = {rel: [st.st_size, st.st_mtime_ns] for rel, st in _files_under(folder).items() if not rel.startswith(".rotsym-")}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=0, sort_keys=True) + "\n")


def _written_by_an_earlier_rotsym(folder: Path, relpath: str) -> bool:
    """Before outputs held a manifest: the report, recipe and card a rotsym run writes, by their content."""
    report = json_object_or_empty(folder / "rotsym_report.json")
    ours = str(report.get("command", "")).startswith("rotsym") or "rotsym_jax" in (report.get("versions") or {})
    if relpath in ("rotsym_report.json", "rotsym_config.yaml"):
        return ours
    if relpath == "README.md" and ours:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            return "Made with rotsym_jax" in (folder / relpath).read_text()
    return False


def foreign_files(folder: Path) -> list[str]:
    """The files of an output folder that no rotsym run wrote, or that changed since one did
    (relative paths); the checkpoint's own weights are never among them, nor the config.json of
    an output written before outputs listed their files."""
    listed = json_object_or_empty(folder / MANIFEST).get("files")
    foreign = []
    for rel, st in sorted(_files_under(folder).items()):
        if rel == MANIFEST or is_weights_file(rel) or rel.startswith(".rotsym-"):
            continue
        if isinstance(listed, dict):
            if listed.get(rel) == [st.st_size, st.st_mtime_ns]:
                continue
        elif rel == "config.json" or _written_by_an_earlier_rotsym(folder, rel):
            continue
        foreign.append(rel)
    return foreign


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.is_file() and b.is_file() and a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()
    except OSError:
        return False


def keep_foreign_files(target: Path, tmp: Path) -> list[str]:
    """Put into the new output `tmp` the files of the output `target` it replaces that rotsym did
    not write (hard links, or copies), so that replacing an output deletes only the library's own
    files; returns their paths. A file of the new output's name that differs is refused (`PathExists`):
    nothing is replaced."""
    kept, clashes = [], []
    for rel in foreign_files(target):
        old, new = target / rel, tmp / rel
        if new.exists() or new.is_symlink():
            if not _same_file(old, new):
                clashes.append(rel)
            continue
        new.parent.mkdir(parents=True, exist_ok=True)
        if old.is_symlink():
            os.symlink(os.readlink(old), new)
        else:
            try:
                os.link(old, new)
            except OSError:
                shutil.copy2(old, new)
        kept.append(rel)
    if clashes:
        raise not_ours(target, clashes)
    return kept


def not_ours(target: Path, clashes: list[str]) -> PathExists:
    return PathExists(f"{target} holds {', '.join(clashes[:8])}{' …' if len(clashes) > 8 else ''}, which rotsym did not write (or which "
                      "changed since it did), and the new output writes files of these names; nothing was replaced: move them out of "
                      "it, or write another output")
