"""Orbax checkpoints in and out: the form JAX training code keeps its params in.

An Orbax checkpoint folder (`save_orbax`) holds the family's `config.json` (and the source's
tokenizer files) beside `params/`, the params pytree written by Orbax's standard checkpointer:

    folder/config.json  folder/tokenizer.json ...  folder/params/ (Orbax)

A training run's `CheckpointManager` folder is read too: numbered step folders, each with the
params as the item `params` (a `Composite` that may hold the optimizer state beside them) or as
the single `default` item, and the model's config.json at the run's root (`save_config` writes it
once) or in the step folder:

    run/config.json  run/100/params/  run/100/opt_state/  run/200/params/ ...

`load_orbax` returns the same `Checkpoint` as `load_hf`: the leaves are our params' paths, so the
layout (task head, pooler) is the one whose leaves and shapes, from the config, are exactly the
saved ones (config.json's `architectures` decides between layouts with the same leaves).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .. import owned
from ..errors import InputTypeError, MissingPath, PathExists
from ..families.family import Layout
from ..pytree import flatten, unflatten
from .hf import (
    FLOATING_DTYPES,
    ORBAX_ITEM,
    ORBAX_ITEMS,
    Checkpoint,
    CheckpointError,
    NonFiniteWeights,
    check_params,
    check_saved_finite,
    check_target,
    config_step,
    describe_config,
    family_for,
    family_of,
    is_orbax_item,
    missing_folder,
    orbax_hint,
    read_model_config,
    saved_array,
    saved_dtype,
    to_device,
    write_config,
    write_folder,
)
from .ties import apart_layout

# The items a step folder may hold the params in, in the order they are looked for.
ITEMS = ORBAX_ITEMS


def _checkpointer():
    """Orbax's StandardCheckpointer, orbax.checkpoint imported only on the paths that read or
    write Orbax (every command paid its 0.2 s import otherwise)."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def is_orbax(path) -> bool:
    """Whether `path` is an Orbax checkpoint folder, a run's folder or one of its step folders
    (anything `load_orbax` reads; a Hugging Face folder is not)."""
    folder = Path(path)
    if not folder.is_dir():
        return False
    return _item(folder) is not None or bool(steps(folder))


def steps(run) -> list[int]:
    """The finished steps of a CheckpointManager folder, oldest first (Orbax finishes a step by
    renaming its temporary folder to the step number: a number is a finished step)."""
    folder = Path(run)
    if not folder.is_dir():
        return []
    return sorted(int(d.name) for d in folder.iterdir() if d.name.isdigit() and d.is_dir() and _item(d) is not None)


def step_folder(run, step: int | None = None) -> Path:
    """The folder of `step` (default: the latest) of the run at `run`; a folder that is itself a
    checkpoint (or a step) is returned as it is when `step` is None."""
    folder = Path(run)
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
        raise InputTypeError(f"step={step!r}; expected an int (a step number of the run)")
    found = steps(folder)
    if _item(folder) is not None and not found:
        if step is not None:
            raise CheckpointError(f"{folder}: an Orbax checkpoint, not a run with steps; a step ({step}) applies to a CheckpointManager folder")
        return folder
    if not found:
        raise CheckpointError(f"{folder}: neither an Orbax checkpoint (config.json + {ORBAX_ITEM}/) nor a CheckpointManager run (numbered step "
                              f"folders){orbax_hint(folder)}")
    if step is None:
        return folder / str(found[-1])
    if step not in found:
        raise CheckpointError(f"{folder}: no step {step}; the run has steps {_list(found)}")
    return folder / str(step)


def load_orbax(path, *, step: int | None = None, dtype=None, allow_nonfinite: bool = False, weights: bool = True) -> Checkpoint:
    """An Orbax checkpoint folder, a run's folder (its latest step, or `step`) or a step folder,
    as the `Checkpoint` that `load_hf` returns for the same model. Options as `load_hf`'s:
    `dtype` (default: each leaf's saved dtype), `allow_nonfinite`, `weights=False` (shapes and
    dtypes from Orbax's metadata, leaves `jax.ShapeDtypeStruct`s, nothing else read).
    Raises CheckpointError naming the folder, leaf and shapes on bad input."""
    folder = Path(path)
    if not folder.is_dir():
        raise missing_folder(folder, "")
    folder = step_folder(folder, step)
    item = _item(folder)
    config_file = folder / "config.json" if (folder / "config.json").is_file() else folder.parent / "config.json"
    if not config_file.is_file():
        raise MissingPath(f"{folder}: no config.json beside the Orbax checkpoint (nor in {folder.parent}); write the model's "
                                "config with rotsym_jax.save_config(checkpoint, run_folder)")
    config, family = read_model_config(config_file)
    saved = _saved_leaves(item)
    bad = sorted(p for p, (_, d) in saved.items() if d not in FLOATING_DTYPES)
    if bad:
        raise CheckpointError(f"{item}: leaves {bad[:4]} have dtype {saved[bad[0]][1]}; parameters must be floating "
                              f"({', '.join(str(d) for d in sorted(FLOATING_DTYPES, key=str))}), and casting would change their values")
    layout = config_step(config_file, lambda: _layout(family, config, {p: s for p, (s, _) in saved.items()}, item))
    stored = {p: d for p, (_, d) in saved.items()}
    majority = jnp.dtype(collections.Counter(stored.values()).most_common(1)[0][0])
    if not weights:
        flat = {p: jax.ShapeDtypeStruct(s, jnp.dtype(dtype or d)) for p, (s, d) in saved.items()}
    else:
        flat = _restore(item, saved, dtype, allow_nonfinite)
    return Checkpoint(family.name, config, unflatten(flat), layout, majority, folder, stored)


def save_orbax(checkpoint: Checkpoint, params, path, *, dtype=None, overwrite: bool = False, allow_nonfinite: bool = False,
               extra_files: Mapping[str, str] | None = None) -> Path:
    """Write `params` as an Orbax checkpoint folder of `checkpoint`'s family and head: config.json,
    the source's tokenizer and other files, `params/` by Orbax's standard checkpointer, and
    `extra_files` ({name: text}, or a function returning them). Each leaf is saved in `dtype`, else
    its stored dtype (as `save_hf`); non-finite values are refused unless `allow_nonfinite`.
    Atomic as `save_hf`: written under a temporary name beside `path`, then moved into place;
    `overwrite=True` replaces only a checkpoint folder (never the source's)."""
    target = Path(path)
    check_target(target, checkpoint.source, overwrite)
    flat = check_params(checkpoint, params)
    nonfinite: list[str] = []
    leaves = {p: saved_array(leaf, saved_dtype(checkpoint, p, dtype and np.dtype(jnp.dtype(dtype))), p, nonfinite) for p, leaf in flat.items()}
    check_saved_finite(nonfinite, allow_nonfinite)

    def write_weights(tmp: Path):
        checkpointer = _checkpointer()
        try:
            checkpointer.save((tmp / ORBAX_ITEM).absolute(), unflatten(leaves))
            checkpointer.wait_until_finished()
        finally:
            checkpointer.close()

    return write_folder(checkpoint, target, {p: x.dtype for p, x in leaves.items()}, write_weights, extra_files)


def save_config(checkpoint: Checkpoint, folder, *, overwrite: bool = False) -> Path:
    """The model's config.json (with its architecture and dtype, as `save_hf` writes it) in
    `folder`, created if missing: what a CheckpointManager run needs at its root to be read
    (`load_orbax`, the `rotsym` commands). A config.json there already that describes another
    model (family, head or shapes) is replaced only with `overwrite`: the run's steps would no
    longer read. Replaced atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    family = family_for(checkpoint.model_config.model_type)
    existing = folder / "config.json"
    if existing.is_file() and not overwrite:
        other = _other_model(existing, checkpoint)
        if other:
            raise PathExists(f"{existing} describes another model ({other}); pass overwrite=True to replace it")
    tmp = owned.temp_folder(folder, ".rotsym-config-")
    try:
        write_config(checkpoint, family, dict(checkpoint.stored_dtypes) or {"": checkpoint.dtype}, tmp)
        owned.sync_file(tmp / "config.json")
        os.replace(tmp / "config.json", folder / "config.json")
        owned.sync_folder(folder)
    finally:
        owned.discard(tmp)
    return folder / "config.json"


def _other_model(config_file: Path, checkpoint: Checkpoint) -> str | None:
    """How the model of `config_file` differs from `checkpoint`'s (None: the same model)."""
    try:
        config, family = read_model_config(config_file)
    except (CheckpointError, FileNotFoundError) as e:
        return f"unreadable: {e}"
    if family.name != checkpoint.family:
        return f"a {family.name} model, not {checkpoint.family}"
    if family.shapes(config, checkpoint.layout) != family.shapes(checkpoint.model_config, checkpoint.layout):
        return f"{describe_config(config)} against {describe_config(checkpoint.model_config)}"
    if family.architecture(config, _named_layout(family, config)) != family.architecture(checkpoint.model_config, checkpoint.layout):
        return f"architectures {getattr(config, 'architectures', None)}"
    return None


@contextlib.contextmanager
def _quiet_absl():
    """Orbax logs a warning for every item of a Composite step (its metadata file sits in the step
    folder, not the item's); the read itself is complete."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---- reading ----------------------------------------------------------------------------------------

def _item(folder: Path) -> Path | None:
    """The Orbax item holding the params in a checkpoint or step folder, or None."""
    return next((folder / name for name in ITEMS if is_orbax_item(folder / name)), None)


def _saved_leaves(item: Path) -> dict[str, tuple[tuple, np.dtype]]:
    """{our path: (shape, dtype)} from the item's Orbax metadata (no array is read)."""
    checkpointer = _checkpointer()
    try:
        with _quiet_absl():
            metadata = checkpointer.metadata(item.absolute())
    except Exception as e:  # unreadable or partial metadata
        raise CheckpointError(f"{item}: not a readable Orbax checkpoint ({type(e).__name__}: {e})") from e
    finally:
        checkpointer.close()
    tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", None)
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"{item}: the Orbax checkpoint does not hold a params dict (its metadata is a {type(tree).__name__})")
    return {p: (tuple(m.shape), np.dtype(m.dtype)) for p, m in flatten(tree).items()}


def _layout(family, config, saved: dict[str, tuple], item: Path) -> Layout:
    """The layout whose leaves and shapes (from the config) are exactly the saved ones; between
    several (heads of one shape), the one config.json's `architectures` names. A layout of the
    family's own kind that holds tied copies as tables of their own (T5's stacks' embed_tokens,
    `Family.read_apart`) is the one whose leaves are saved: its fields are in no file but the leaves."""
    candidates = []
    for head in [None, *(h.name for h in family.heads)]:
        for pooler in (False, True) if family.pooler else (False,):
            layout = apart_layout(family, config, Layout(prefix=family.base_prefix(config, head), head=head, pooler=pooler), saved)
            if family.shapes(config, layout) == saved:
                candidates.append(layout)
    if not candidates:
        expected = family.shapes(config, _named_layout(family, config))
        missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
        shapes = [f"{p} {saved[p]} (expected {expected[p]})" for p in sorted(set(saved) & set(expected)) if saved[p] != expected[p]]
        raise CheckpointError(
            f"{item}: the saved params do not match the {family.name} model of config.json ({describe_config(config)}): "
            + "; ".join(x for x in (f"missing leaves {missing[:6]}" if missing else "", f"unexpected leaves {extra[:6]}" if extra else "",
                                    f"shapes {shapes[:4]}" if shapes else "") if x)
        )
    named = [a for a in (getattr(config, "architectures", None) or ())]
    for layout in candidates:
        if family.architecture(config, layout) in named:
            return layout
    if len(candidates) > 1:
        classes = sorted({family.architecture(config, c) for c in candidates})
        raise CheckpointError(f"{item}: the saved leaves fit {classes}; config.json's architectures ({named}) names none of them")
    return candidates[0]


def _named_layout(family, config) -> Layout:
    """The layout config.json's `architectures` names (for errors), else the bare model."""
    for a in getattr(config, "architectures", None) or ():
        for h in family.heads:
            if a == family.class_name(config, h):
                return Layout(prefix=family.base_prefix(config, h.name), head=h.name)
    return Layout()


def _restore(item: Path, saved: dict, dtype, allow_nonfinite: bool) -> dict:
    target = unflatten({p: jax.ShapeDtypeStruct(s, d) for p, (s, d) in saved.items()})
    checkpointer = _checkpointer()
    try:
        with _quiet_absl():
            restored = flatten(checkpointer.restore(item.absolute(), target))
    except Exception as e:
        raise CheckpointError(f"{item}: the Orbax checkpoint cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    finally:
        checkpointer.close()
    flat, nonfinite = {}, []
    for p, leaf in restored.items():
        array = np.asarray(leaf)
        bad = array.size - int(np.count_nonzero(np.isfinite(array)))
        if bad:
            nonfinite.append(f"{p} ({bad} of {array.size})")
        flat[p] = to_device(array, dtype)
    if nonfinite:
        message = f"{item}: non-finite values (NaN or Inf) in {len(nonfinite)} leaves: {nonfinite[:8]}"
        if not allow_nonfinite:
            raise NonFiniteWeights(message)
        warnings.warn(message, stacklevel=3)
    return flat


class OrbaxTensors:
    """The tensors of an Orbax checkpoint read as `TensorFiles` reads a folder's (`shape`, `read`,
    `close`), for the streamed runs: each by its Hugging Face name, from the leaves its rule fills,
    restored alone (Orbax's partial restore reads only them). Rows are cut from the whole tensor;
    the leaves last restored (`warm`: a chunk's) are kept, per thread, for the tensors that read
    them, until `close`."""

    def __init__(self, checkpoint: Checkpoint):
        self.item = _item(checkpoint.source)
        self.rules = {r.hf: r for r in family_of(checkpoint.model_config).tensors(checkpoint.model_config, checkpoint.layout)}
        self.saved = {p: (tuple(x.shape), np.dtype(checkpoint.stored_dtypes[p])) for p, x in flatten(checkpoint.params).items()}
        self._shapes, self._held = {}, threading.local()  # per thread: the chunks in flight read apart

    def names(self) -> set[str]:
        return set(self.rules)

    def shape(self, name: str) -> tuple:
        if name not in self._shapes:  # from zeros the OS maps lazily, once per tensor
            rule = self.rules[name]
            self._shapes[name] = tuple(np.shape(rule.to_hf(tuple(np.zeros(self.saved[p][0], np.int8) for p in rule.ours))))
        return self._shapes[name]

    def warm(self, names) -> None:
        """Restore the leaves of the tensors `names` in one call (the tensors a pass reads next):
        each restore has a fixed cost, much more than a small tensor's bytes."""
        paths = tuple(dict.fromkeys(p for name in names for p in self.rules[name].ours))
        if paths and not set(paths) <= set(self._leaves()):
            self._held.leaves = self._restore(paths)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        rule = self.rules[name]
        if not set(rule.ours) <= set(self._leaves()):
            self._held.leaves = self._restore(rule.ours)
        leaves = self._leaves()
        tensor = np.asarray(rule.to_hf(tuple(leaves[p] for p in rule.ours)))
        return np.array(tensor if rows is None else tensor[rows[0]:rows[1]])

    def _restore(self, paths) -> dict:
        import orbax.checkpoint as ocp

        target = unflatten({p: np.zeros(0) for p in paths})  # the tree's structure: the leaves to restore
        restore = unflatten({p: ocp.RestoreArgs(restore_type=np.ndarray, dtype=self.saved[p][1]) for p in paths})
        checkpointer = ocp.PyTreeCheckpointer()
        try:
            with _quiet_absl():
                restored = flatten(checkpointer.restore(self.item.absolute(), args=ocp.args.PyTreeRestore(
                    item=target, restore_args=restore, partial_restore=True)))
        except Exception as e:
            raise CheckpointError(f"{self.item}: leaves {list(paths)[:4]} cannot be read ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from e
        finally:
            checkpointer.close()
        return {p: np.asarray(restored[p]) for p in paths}

    def _leaves(self) -> dict:
        return getattr(self._held, "leaves", {})

    def close(self) -> None:
        self._held.leaves = {}


def _list(values: list[int]) -> str:
    return ", ".join(map(str, values)) if len(values) <= 8 else f"{', '.join(map(str, values[:3]))}, ..., {', '.join(map(str, values[-3:]))}"
