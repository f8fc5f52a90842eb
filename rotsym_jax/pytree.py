"""Parameter paths and the helpers every module shares: nested params <-> flat {"a/b/0/c": leaf}
dicts, same-leaves checks, content digests and atomic file replacement.

Every params pytree in rotsym_jax is a nested dict (Flax NNX's pure-dict state: layer lists are
dicts with int keys). A leaf is addressed by its `/`-joined path, e.g.
`layers/3/attention/query/kernel`; specs, name maps and error messages all use these paths.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import owned
from .errors import InputError, InputTypeError
from .precision import exact_jit

Params = dict[str, Any]


def flatten(params: Mapping) -> dict[str, Any]:
    """Nested dict -> {path: leaf}, paths `/`-joined, in sorted-key order per level."""
    if not isinstance(params, Mapping):
        hint = "; a Checkpoint holds its params in .params: pass checkpoint.params" if hasattr(params, "graphdef") else ""
        raise InputTypeError(f"params must be a nested dict of arrays (a params pytree), got {type(params).__name__}{hint}")
    flat: dict[str, Any] = {}
    _flatten_into(params, "", flat)
    return flat


def _flatten_into(node, prefix: str, flat: dict) -> None:
    # A module-level function, not a closure calling itself: such a closure is a reference cycle
    # that keeps `flat`, and every array in it, alive until the garbage collector runs.
    if isinstance(node, Mapping):
        for key in sorted(node, key=_sort_key):
            _flatten_into(node[key], f"{prefix}/{key}" if prefix else str(key), flat)
    else:
        flat[prefix] = node


def structure_problem(params: Mapping, prefix: str = "") -> str | None:
    """What keeps `params` from being a params pytree whose paths come back as they went in, or
    None: a list or tuple node (`flatten` would take it for one leaf), a key that is a string of
    digits (`unflatten` makes it an int: layer indices are int keys, as in Flax NNX)."""
    for key, node in params.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(key, str) and key.isdigit():
            return (f"{path}: the key {key!r} is a string of digits; layer indices are int keys (as Flax NNX's state has them), "
                    f"else they come back as ints: {{int(k): v for k, v in layers.items()}}")
        if isinstance(node, (list, tuple)):
            return (f"{path} is a {type(node).__name__}; params are nested dicts with arrays as leaves, a list of layers a dict with "
                    f"int keys: dict(enumerate({key}))")
        if isinstance(node, Mapping):
            problem = structure_problem(node, path)
            if problem:
                return problem
    return None


def unflatten(flat: Mapping[str, Any]) -> Params:
    """{path: leaf} -> nested dict; all-digit path parts become int keys (NNX list indices)."""
    nested: Params = {}
    for path, leaf in flat.items():
        parts = [int(p) if p.isdigit() else p for p in path.split("/")]
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise InputError(f"path {path!r} goes through a leaf at {part!r}")
        if parts[-1] in node:
            raise InputError(f"duplicate path {path!r}")
        node[parts[-1]] = leaf
    return nested


def _sort_key(key):
    # Layer 10 after layer 9: ints sort numerically, before strings.
    return (0, key, "") if isinstance(key, int) else (1, 0, str(key))


# ---- same leaves -----------------------------------------------------------------------------------

def check_same_leaves(trees: Sequence[Mapping], names: Sequence[str], error: type[Exception] = ValueError) -> None:
    """Raise `error` naming the first tree that differs from `trees[0]` in its leaf paths or in a
    leaf's shape (`names[i]` names tree i in the message)."""
    first = {p: tuple(np.shape(x)) for p, x in flatten(trees[0]).items()}
    for name, tree in zip(names[1:], trees[1:]):
        shapes = {p: tuple(np.shape(x)) for p, x in flatten(tree).items()}
        if shapes.keys() != first.keys():
            only_0, only_i = sorted(first.keys() - shapes.keys()), sorted(shapes.keys() - first.keys())
            raise error(
                f"{names[0]} and {name} have different leaves: only in {names[0]} {only_0[:5]}, "
                f"only in {name} {only_i[:5]}"
            )
        for path, shape in first.items():
            if shapes[path] != shape:
                raise error(f"leaf {path} has shape {shape} in {names[0]} but {shapes[path]} in {name}")


# ---- digests ---------------------------------------------------------------------------------------

def layer_chunks(paths) -> list[list[str]]:
    """`paths` grouped by layer: the paths under one numbered node (the first all-digit part,
    e.g. `layers/3/...`) form a chunk, sorted by what follows it; the others form one more. A
    model's layers have the same leaves, so a jitted function of a chunk's leaves compiles once
    for all of them (and for every model of the same layer shapes), where one program for every
    leaf compiles in time proportional to the model's depth."""
    chunks: dict[str, list] = {}
    for path in paths:
        parts = path.split("/")
        k = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts))
        chunks.setdefault("/".join(parts[:k + 1]) if k < len(parts) else "", []).append(("/".join(parts[k + 1:]), path))
    return [[path for _, path in sorted(chunk)] for chunk in chunks.values()]


@exact_jit
def _leaf_signatures(leaves):
    # A fixed pseudo-random projection of each leaf: any change of a leaf changes it.
    out = []
    for x in leaves:
        x = jnp.ravel(jnp.asarray(x, jnp.float32))
        w = jnp.sin(jnp.arange(x.size, dtype=jnp.float32) * 0.7548776662 + 0.5)
        out.append(jnp.stack([jnp.sum(x * w), jnp.sum(x * x)]))
    return out


# A leaf of at most this many entries is signed on the host: its program (one per layer's leaf
# shapes) took longer to compile than the host takes to sign it, 0.1 s of a tiny model's align.
# The rule reads the size alone, so a leaf is signed one way whether it is read or held.
_HOST_SIGNED = 1 << 18


def _host_signature(x) -> np.ndarray:
    # `_leaf_signatures`' projection with weights exact in any arithmetic (an integer hash, no
    # sine), summed in float64: the same bits on every machine.
    x = np.asarray(x, np.float32).reshape(-1).astype(np.float64)
    hashed = np.arange(x.size, dtype=np.uint64) * np.uint64(2654435761) % np.uint64(1 << 32)  # Knuth's multiplicative hash
    w = (hashed >> np.uint64(8)).astype(np.float64) / (1 << 24) - 0.5
    return np.asarray([np.sum(x * w), np.sum(x * x)], np.float32)


def fingerprint(params: Mapping) -> str:
    """A short digest of a params pytree: its paths, shapes, dtypes and a projection of its values
    (small leaves on the host, the others on the device, a program per layer, one read-back).
    Statistics carry it; `align_many` orders by it."""
    return signature_digest(leaf_signatures(flatten(params)))


def leaf_signatures(flat: Mapping) -> dict:
    """{path: (shape, dtype name, signature bytes)} of every leaf of `flat`: a fixed pseudo-random
    projection of its values, a program per layer (`layer_chunks`) for the leaves past
    `_HOST_SIGNED` entries. A leaf's signature does not depend on the others in `flat`, so a
    model's can be gathered a few layers at a time."""
    small = [p for p in flat if np.size(flat[p]) <= _HOST_SIGNED]
    chunks = layer_chunks([p for p in flat if np.size(flat[p]) > _HOST_SIGNED])
    device, host = jax.device_get(([_leaf_signatures([flat[p] for p in chunk]) for chunk in chunks], [flat[p] for p in small]))
    sigs = {p: _host_signature(x) for p, x in zip(small, host)}
    sigs.update((p, sig) for chunk, chunk_sigs in zip(chunks, device) for p, sig in zip(chunk, chunk_sigs))
    return {p: (tuple(flat[p].shape), str(flat[p].dtype), np.asarray(sigs[p], np.float32).tobytes()) for p in flat}


def signature_digest(signed: Mapping) -> str:
    """`fingerprint` from every leaf's `leaf_signatures` entry."""
    digest = hashlib.sha256()
    for path in sorted(signed):
        shape, dtype, sig = signed[path]
        digest.update(f"{path}{shape}{dtype}".encode())
        digest.update(sig)
    return digest.hexdigest()[:16]


def content_digest(params: Mapping) -> str:
    """SHA-256 (hex) of every leaf's path, dtype, shape and bytes: equal iff bitwise equal."""
    digest = hashlib.sha256()
    for path, leaf in flatten(params).items():
        a = np.asarray(leaf, order="C")
        digest.update(f"{path}|{a.dtype}|{a.shape}|".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


# ---- atomic replacement ----------------------------------------------------------------------------

@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write (a file or a folder); on success it is synced
    to disk and replaces `path` in one rename (the folder holding it synced after), on failure it
    is removed and `path` is untouched. A folder can only replace a missing path or an empty
    folder (POSIX rename). The temporary path is registered (`owned`): the command line's signal
    handler removes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}{suffix}"
    owned.claim(tmp, path)
    try:
        yield tmp
        owned.sync_tree(tmp) if tmp.is_dir() and not tmp.is_symlink() else owned.sync_file(tmp)
        with owned.critical():
            os.replace(tmp, path)
            owned.published(tmp, path, None)
        owned.sync_folder(path.parent)
    finally:
        owned.discard(tmp)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through `atomic_path`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)
