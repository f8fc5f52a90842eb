"""What this process writes beside its outputs, who wrote what is left there, and writing it durably.

Temporary folders. Every folder the library makes beside an output (`.rotsym-tmp-*` while a
checkpoint is written, `.rotsym-stats-*` while a streamed merge spills its statistics,
`.rotsym-config-*` while a run's config.json is replaced) is made by `temp_folder`: registered in
this process before it exists, named with its owner (pid, start time and a tag of host, machine,
boot and PID namespace: attributable from the instant `mkdir` makes it, a kill -9 landing before
anything else is written included) and marked with it right after, before anything else is
written in it (`MARKER`: pid, host, machine and boot, the pid's start time, the command).
`remove_registered` removes what is registered: the command line's signal handler calls it
(`rotsym_jax.cli.signals`); the library installs no handler. `sweep(parent)`, run by the next
writer beside an output, removes the temporary folders whose owner is provably dead (this machine,
this boot or an earlier one, its pid gone or now another process) and names the others; a folder
that names no owner (no marker, no owner in its name) is never deleted, only named.

Publishing. A run's registry changes and the renames that publish a folder happen in `critical()`:
a signal's cleanup waits for it (a folder is never removed half published, and the message says
whether the output was written: `published`).

The output lock. `writing(target)` holds an exclusive lock beside an output (`.NAME.rotsym-lock`,
flock(2), holding the owner's JSON) while a run writes it: a second run refuses at once
(`OutputBusy`, naming the first). The kernel drops the lock when its process dies, so a killed run
never blocks the next; the file is removed when done (and by the next run, `sweep`).

Durability. `sync_tree` fsyncs every file and folder of a temporary folder before the rename that
publishes it, `sync_folder` the parent after, so that after a power cut the output is the old one
or the complete new one, never a folder of empty files.

Nothing here imports JAX; the module holds no state but this process's registry.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import RotsymError

try:
    import fcntl
except ImportError:  # not POSIX: runs go without the output lock
    fcntl = None

MARKER = ".rotsym-owner.json"
# The temporary folders the library makes beside outputs (`sweep` looks at these names only).
PREFIXES = (".rotsym-tmp-", ".rotsym-stats-", ".rotsym-config-", ".rotsym-old-")
LOCK_SUFFIX = ".rotsym-lock"

# Held while the registry changes and while a folder is published; a signal's cleanup takes it too.
_LOCK = threading.RLock()
_holder: int | None = None  # the thread inside `critical()` (read by a signal handler)
_OWNED: dict[Path, Path | None] = {}  # temporary path -> the output it is for (None: not an output)
_PUBLISHED: list[Path] = []
_HELD: dict[Path, list] = {}  # output -> [lock file, fd, count]
_NOTED: set[Path] = set()  # leftovers already named by `sweep` in this process


class OutputBusy(RotsymError, FileExistsError):
    """Another process holds the lock on the output (`writing`)."""


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """Registry changes and publishing renames: a signal's cleanup waits until the block ends."""
    global _holder
    with _LOCK:
        outer, _holder = _holder, threading.get_ident()
        try:
            yield
        finally:
            _holder = outer


def _key(path) -> Path:
    return Path(os.path.abspath(path))


def in_critical(thread_id: int) -> bool:
    """Whether thread `thread_id` is inside `critical()` now."""
    return _holder == thread_id


# ---- owners ------------------------------------------------------------------------------------------

def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a process, from /proc; None: no such process."""
    text = _read(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return fields[0], int(fields[19])


def _pidns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _started_at(start_ticks: int | None) -> float:
    """The wall-clock time the process started (the boot time plus its start in ticks)."""
    stat_text = _read("/proc/stat") or ""
    btime = next((int(line.split()[1]) for line in stat_text.splitlines() if line.startswith("btime ")), None)
    if btime is None or start_ticks is None:
        return time.time()
    return btime + start_ticks / os.sysconf("SC_CLK_TCK")


_OWNER: dict | None = None


def owner() -> dict:
    """This process, as markers and lock files record it."""
    global _OWNER
    if _OWNER is None or _OWNER["pid"] != os.getpid():  # a forked child is another owner
        proc = _proc_stat(os.getpid())
        start = None if proc is None else proc[1]
        started = datetime.datetime.fromtimestamp(_started_at(start)).astimezone().isoformat(timespec="seconds")
        _OWNER = {"pid": os.getpid(), "host": socket.gethostname(), "machine": _read("/etc/machine-id"),
                  "boot": _read("/proc/sys/kernel/random/boot_id"), "pidns": _pidns(), "start": start, "started": started,
                  "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300] if sys.argv else None}
    return _OWNER


def owner_state(record) -> str:
    """"dead" (provably: this machine; rebooted since, or its pid gone, a zombie or another process
    now), "alive", or "unknown" (another machine or PID namespace, or no way to tell)."""
    if not isinstance(record, dict):
        return "unknown"
    me = owner()
    if (record.get("host"), record.get("machine")) != (me["host"], me["machine"]):
        return "unknown"
    if record.get("boot") and me["boot"] and record["boot"] != me["boot"]:
        return "dead"  # the machine restarted since: every process of the earlier boot is gone
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or record.get("pidns") != me["pidns"]:
        return "unknown"
    if me["start"] is not None:  # /proc: the pid's start time tells a reused pid apart
        proc = _proc_stat(pid)
        if proc is None or proc[0] in ("Z", "X"):
            return "dead"
        return "alive" if proc[1] == record.get("start") else "dead"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "dead"
    except OSError:
        pass
    return "alive"


def describe_owner(record) -> str:
    if not isinstance(record, dict):
        return "an unknown process"
    started = f", started {record['started']}" if record.get("started") else ""
    return f"pid {record.get('pid')} on host {record.get('host')}{started}"


# A temporary folder's name holds its owner too (pid, start time, a tag of host, machine, boot and PID
# namespace), so that it is attributable from the instant `mkdir` makes it, before its marker is written.
_NAME = re.compile(r"\.rotsym-[a-z]+-(\d+)-(\d+)-([0-9a-f]{8})-[0-9a-f]+")


def _tag(record: dict) -> str:
    where = "|".join(str(record.get(k)) for k in ("host", "machine", "boot", "pidns"))
    return hashlib.sha256(where.encode()).hexdigest()[:8]


def _named_owner(name: str) -> dict | None:
    """The owner a temporary folder's name records, where it is of this machine, boot and PID namespace."""
    match = _NAME.fullmatch(name)
    me = owner()
    if match is None or match.group(3) != _tag(me):
        return None
    return {**me, "pid": int(match.group(1)), "start": None if me["start"] is None else int(match.group(2)), "started": None, "command": None}


def read_marker(folder: Path) -> dict | None:
    """The owner recorded in `folder`, or None (no marker, or not one of ours)."""
    try:
        with open(folder / MARKER, "rb") as f:
            record = json.loads(f.read(4096))
    except (OSError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) and "pid" in record else None


def _write_marker(folder: Path) -> None:
    # One small write: the marker is whole or absent (a kill lands between system calls).
    fd = os.open(folder / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, json.dumps(owner()).encode())
    finally:
        os.close(fd)


# ---- temporary folders ---------------------------------------------------------------------------

def temp_folder(parent: Path, prefix: str, target: Path | None = None) -> Path:
    """A new folder `parent/<prefix><pid>-<start>-<tag>-<random>`, registered (before it exists: a
    signal's cleanup finds it from the first instant), its owner in its name from `mkdir` on and in
    its marker right after. `target`: the output it becomes (named by the signal handler's message)."""
    me = owner()
    path = Path(parent) / f"{prefix}{me['pid']}-{me['start'] or 0}-{_tag(me)}-{uuid.uuid4().hex[:16]}"
    with critical():
        _OWNED[_key(path)] = None if target is None else _key(target)
        try:
            path.mkdir()
            _write_marker(path)
        except BaseException:
            _OWNED.pop(_key(path), None)
            remove_tree(path)
            raise
    return path


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A registered folder in the system's temporary directory for the block's own use: removed
    after it, or by a signal's cleanup (a `tempfile.TemporaryDirectory` outlives `os._exit`)."""
    path = temp_folder(Path(tempfile.gettempdir()), prefix)
    try:
        yield path
    finally:
        discard(path)


def claim(path: Path, target: Path | None = None) -> None:
    """Register a temporary path (a file or folder) made by other means: removed by a signal's cleanup."""
    with critical():
        _OWNED[_key(path)] = None if target is None else _key(target)


def forget(path: Path) -> None:
    """Unregister `path` (it was published, or removed)."""
    with critical():
        _OWNED.pop(_key(path), None)


def discard(path: Path) -> bool:
    """Remove a registered temporary path (its marker last), then unregister it; False when
    something of it could not be removed (it stays registered)."""
    done = remove_tree(path)
    if done:
        forget(path)
    return done


def unmark(folder: Path) -> None:
    """Remove the marker of a folder about to be published (it is no longer temporary)."""
    (Path(folder) / MARKER).unlink(missing_ok=True)


def published(tmp: Path, target: Path, replaced: Path | None) -> None:
    """`tmp` became `target`; `replaced` (or None) holds what `target` held, to delete: it is
    registered and marked at once, so that a kill during its deletion leaves it sweepable."""
    with critical():
        _OWNED.pop(_key(tmp), None)
        _PUBLISHED.append(_key(target))
        if replaced is not None:
            _OWNED[_key(replaced)] = None
            with contextlib.suppress(OSError):
                _write_marker(Path(replaced))


def remove_tree(path: Path) -> bool:
    """Remove a file or folder, a folder's marker last (a folder killed while being removed is
    still marked); True when nothing is left. A writer may add files meanwhile: tried again."""
    path = Path(path)
    for _ in range(5):
        try:
            if not (path.is_dir() and not path.is_symlink()):
                path.unlink(missing_ok=True)
                return True
            with os.scandir(path) as entries:
                children = [(e.path, e.name, e.is_dir(follow_symlinks=False)) for e in entries]
            for child, name, is_dir in children:
                if name != MARKER:
                    shutil.rmtree(child, ignore_errors=True) if is_dir else Path(child).unlink(missing_ok=True)
            shutil.rmtree(path)  # the marker, and what a writer added meanwhile
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.01)
    return not os.path.lexists(path)


def published_count() -> int:
    """How many outputs this process has published so far (`remove_registered(since=...)`)."""
    return len(_PUBLISHED)


def remove_registered(since: int = 0) -> tuple[list[Path], list[Path], list[Path]]:
    """What a signal's cleanup does (call it inside `critical()`): every registered temporary path
    removed, every output lock released and its file removed. Returns (the outputs this process
    was writing, those it published after the first `since`, the paths that could not be removed)."""
    roots = list(_OWNED)
    failed = [path for path in roots if not remove_tree(path)]
    # the outputs this process was writing, but not those inside a temporary folder of its own (a proof's small models)
    outputs = [t for t in dict.fromkeys([t for t in _OWNED.values() if t is not None] + list(_HELD))
               if not any(root in t.parents for root in roots)]
    for target, (lock, fd, _) in list(_HELD.items()):
        with contextlib.suppress(OSError):
            lock.unlink()
        with contextlib.suppress(OSError):
            os.close(fd)
        _HELD.pop(target, None)
    _OWNED.clear()
    # published into a temporary folder (a record's proof writes small models) is gone with it
    return outputs, [p for p in _PUBLISHED[since:] if os.path.lexists(p)], failed


# ---- leftovers ---------------------------------------------------------------------------------------

def sweep(parent: Path) -> list[str]:
    """Clean up what earlier runs left in `parent`: the marked temporary folders whose owner is
    provably dead are removed, and so are lock files nobody holds; the other temporary folders
    (a running owner, another machine, no marker) are left alone, each named once per process in
    the notes returned."""
    parent = Path(parent)
    notes = []
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return notes
    for path in entries:
        name = path.name
        if name.startswith(".") and name.endswith(LOCK_SUFFIX) and len(name) > len(LOCK_SUFFIX) + 1:
            _remove_stale_lock(path)
            continue
        if not name.startswith(PREFIXES) or _key(path) in _OWNED or path.is_symlink() or not path.is_dir():
            continue
        record = read_marker(path) or _named_owner(name)
        me = owner()
        if record is not None and (record.get("pid"), record.get("start"), record.get("host")) == (me["pid"], me["start"], me["host"]):
            continue  # this process's own (one it could not remove)
        state = owner_state(record) if record is not None else None
        if state == "dead":
            remove_tree(path)
            continue
        if path in _NOTED:
            continue
        _NOTED.add(path)
        if name.startswith(".rotsym-old-") and record is None:
            notes.append(f"{path} holds an output an earlier run set aside while replacing it, and was stopped before deleting it; "
                         "not removed (delete it by hand once you have checked the output beside it)")
        elif record is None:
            notes.append(f"{path} was left by an earlier run and bears no owner marker ({MARKER}); not removed (delete it by hand "
                         "if no rotsym run is writing there)")
        elif state == "alive":
            notes.append(f"{path} belongs to a running process ({describe_owner(record)}); left alone")
        else:
            notes.append(f"{path} belongs to {describe_owner(record)}, which cannot be checked from here; left alone")
    return notes


def _remove_stale_lock(path: Path) -> None:
    if fcntl is None:
        return
    with contextlib.suppress(OSError):
        fd = _take(path, create=False)
        if fd is not None:
            path.unlink()
            os.close(fd)


# ---- the output lock ---------------------------------------------------------------------------------

def lock_path(target: Path) -> Path:
    """The lock file of an output: `.NAME.rotsym-lock` beside it (a digest of the name where that
    would pass the 255-byte limit)."""
    target = Path(target)
    name = f".{target.name}{LOCK_SUFFIX}"
    if len(os.fsencode(name)) > 255:
        name = f".{hashlib.sha256(os.fsencode(target.name)).hexdigest()[:16]}{LOCK_SUFFIX}"
    return target.parent / name


def _take(path: Path, create: bool = True, retries: int = 0) -> int | None:
    """The lock on `path` taken (its fd), or None where another process holds it (`retries` more
    tries, 20 ms apart: a `sweep` holds a lock file it removes for an instant)."""
    while True:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if retries <= 0:
                return None
            retries -= 1
            time.sleep(0.02)
            continue
        except BaseException:
            os.close(fd)
            raise
        try:  # the file may have been removed (and made anew) between open and flock: lock the one there now
            mine, there = os.fstat(fd), os.stat(path)
            if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                return fd
        except FileNotFoundError:
            if not create:
                os.close(fd)
                return None
        os.close(fd)


def holder(target: Path) -> dict | None:
    """The owner recorded in the lock file of `target`, if any."""
    try:
        with open(lock_path(target), "rb") as f:
            record = json.loads(f.read(4096))
    except (OSError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


@contextlib.contextmanager
def writing(target) -> Iterator[None]:
    """Hold the lock beside `target` while the block writes it; `OutputBusy` at once where another
    process holds it. Taken again by the same process, it is the same lock. Where the lock file
    cannot be made (the parent folder missing or read-only, a filesystem without locks), the block
    runs without it: the write itself then says what is wrong."""
    target = Path(os.path.abspath(target))
    with critical():
        held = _HELD.get(target)
        if held is not None:
            held[2] += 1
        else:
            fd = None
            if fcntl is not None:
                path = lock_path(target)
                try:
                    fd = _take(path, retries=5)
                except OSError:
                    pass
                else:
                    if fd is None:
                        record = holder(target)
                        who = f"another rotsym run ({describe_owner(record)})" if record else "another rotsym run"
                        raise OutputBusy(f"{who} is writing {target} (it holds {path}); wait for it to finish, or write another output")
                if fd is not None:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, json.dumps({**owner(), "output": str(target)}).encode(), 0)
                    _HELD[target] = [path, fd, 1]
            held = _HELD.get(target)
    try:
        yield
    finally:
        if held is not None:
            with critical():
                held[2] -= 1
                if held[2] == 0 and _HELD.get(target) is held:
                    _HELD.pop(target)
                    with contextlib.suppress(OSError):
                        held[0].unlink()
                    os.close(held[1])


# ---- durability --------------------------------------------------------------------------------------

def sync_file(path: Path) -> None:
    """fsync a file's data and metadata (errors, a full disk's among them, raise)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_folder(folder: Path) -> None:
    """fsync a folder (its entries: files made, renamed or removed in it); a filesystem or platform
    that cannot sync a folder is skipped."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.EACCES, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def sync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then every folder, deepest first (links are left as they are)."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                sync_file(Path(path))
        sync_folder(Path(root))
