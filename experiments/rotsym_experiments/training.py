"""Training and caching shared by the locally trained models (digits ViTs, MiniLM fine-tunes,
small decoders on a synthetic task).

`fit` runs AdamW with warmup + cosine decay over full, freshly shuffled batches, one jitted
`lax.scan` per epoch. `cached` keeps trained params with orbax-checkpoint under

    <cache root>/<kind>/<name>-<hash of the recipe: everything training depends on>/params

where the cache root is the `cache_dir` argument, else $ROTSYM_CACHE, else ./.cache/rotsym_jax;
`entry.json` beside `params` records that recipe and a SHA-256 of the params. Entries are written
under a temporary name and renamed into place when complete, so an interrupted run leaves nothing
that a later one would read; an entry that fails to restore or to match its checksum is discarded
(with a warning) and retrained.

`train_or_load` is the seeded form the digits and sequence-task models share: one root key per
seed gives the init key and the training key, and the entry is named `seed<seed>[-init<init seed>]`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

from rotsym_jax import Checkpoint, init_checkpoint
from rotsym_jax.pytree import Params, atomic_path, flatten

# Beside an entry's orbax `params` folder: what was trained and the params' checksum.
ENTRY_FILE = "entry.json"


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    epochs: int = 30
    batch_size: int = 64
    learning_rate: float = 1e-3
    weight_decay: float = 0.05


@dataclasses.dataclass(frozen=True)
class Trained:
    """One trained model: `checkpoint` (the family, config and graph; its params are the initial
    ones), the trained `params`, whether they came from the cache, the seconds it took, its cache
    entry, and for a MiniLM fine-tune the text domain it was fine-tuned on."""

    checkpoint: Checkpoint
    params: Params
    seed: int
    from_cache: bool
    seconds: float
    path: Path
    domain: str | None = None


def optimizer(settings: TrainSettings, steps: int) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, settings.learning_rate, warmup_steps=max(1, steps // 20), decay_steps=steps
    )
    return optax.adamw(schedule, weight_decay=settings.weight_decay)


def fit(graphdef, params: Params, data: dict, loss_fn, settings: TrainSettings, key: jax.Array) -> tuple[Params, np.ndarray]:
    """Train `params` on `data` (a dict of arrays with one leading example axis) to minimise
    `loss_fn(graphdef, params, batch) -> scalar`; returns the trained params and each epoch's mean loss.

    Each epoch visits the examples in a fresh random order (from `key`) in full batches, skipping
    the few left over after the last one (different ones each epoch). `loss_fn` must be hashable
    (a module-level function): it is a static argument, so every model of one config reuses one
    compiled epoch."""
    data = {k: jax.numpy.asarray(v) for k, v in data.items()}
    sizes = {k: v.shape[0] for k, v in data.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"data arrays disagree on the number of examples: {sizes}")
    n = next(iter(sizes.values()))
    batches = n // settings.batch_size
    if batches == 0:
        raise ValueError(f"batch_size={settings.batch_size} exceeds the {n} training examples")
    steps = settings.epochs * batches
    opt_state = optimizer(settings, steps).init(params)
    losses = []
    for epoch_key in jax.random.split(key, settings.epochs):
        params, opt_state, value = _epoch(graphdef, loss_fn, settings, steps, params, opt_state, data, epoch_key)
        losses.append(value)
    return params, np.asarray(jax.device_get(losses))


@functools.partial(jax.jit, static_argnames=("graphdef", "loss_fn", "settings", "steps"))
def _epoch(graphdef, loss_fn, settings, steps, params, opt_state, data, key):
    """One pass over the data as a `lax.scan` of AdamW steps; returns its mean loss too."""
    opt = optimizer(settings, steps)
    n = next(iter(data.values())).shape[0]
    batches = n // settings.batch_size
    order = jax.random.permutation(key, n)[: batches * settings.batch_size].reshape(batches, settings.batch_size)

    def step(carry, batch):
        params, opt_state = carry
        value, grads = jax.value_and_grad(loss_fn, argnums=1)(graphdef, params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    (params, opt_state), values = jax.lax.scan(step, (params, opt_state), {k: v[order] for k, v in data.items()})
    return params, opt_state, values.mean()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir or os.environ.get("ROTSYM_CACHE") or ".cache/rotsym_jax")


def cache_path(kind: str, name: str, recipe: dict, cache_dir=None) -> Path:
    """The entry of `name` (e.g. "seed3") trained as described by `recipe` (JSON-able)."""
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_root(cache_dir) / kind / f"{name}-{digest}"


def cached(path: Path, like: Params, train: Callable[[], Params], recipe: dict) -> tuple[Params, bool]:
    """(params, from_cache): the entry at `path` when complete and intact, else `train()`, saved there."""
    params = _restore(path, like)
    if params is not None:
        return params, True
    params = train()
    _save(path, params, recipe)
    return params, False


def config_dict(config) -> dict:
    """A transformers config as JSON-able data, without the transformers version that wrote it."""
    return {k: v for k, v in config.to_dict().items() if k != "transformers_version"}


def config_recipe(config, settings: TrainSettings, **rest) -> dict:
    """A cache recipe: the model config, the training settings and `rest` (data, version)."""
    return dict(config=config_dict(config), settings=dataclasses.asdict(settings), **rest)


def seed_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """(init key, training key) of a seed: one root key, split once, so seeds never share streams."""
    return tuple(jax.random.split(jax.random.key(seed)))


def init_model(config, seed: int, head: str) -> Checkpoint:
    """The randomly initialised model of `config` with `head` for `seed` (the start of training)."""
    return init_checkpoint(config, seed_keys(seed)[0], head=head)


def seed_cache_path(kind: str, recipe: dict, seed: int, init_seed: int | None = None, cache_dir=None) -> Path:
    """The entry `<kind>/seed<seed>[-init<init seed>]-<hash of recipe>`."""
    init = "" if init_seed is None or init_seed == seed else f"-init{init_seed}"
    return cache_path(kind, f"seed{seed}{init}", recipe, cache_dir)


def train_or_load(
    kind: str, recipe: dict, config, head: str, seed: int, init_seed: int | None,
    train: Callable[[Checkpoint, jax.Array], Params], cache_dir=None,
) -> Trained:
    """The params `train(initial checkpoint, training key of seed)` returns, from the cache when a
    complete, intact entry exists, else trained and cached. The initial params come from
    `init_seed` (default: `seed`): models that share an init seed and differ in `seed` start from
    one point and see the data in different orders (like fine-tunes of one pretrained model)."""
    start = time.perf_counter()
    init_seed = seed if init_seed is None else init_seed
    checkpoint = init_model(config, init_seed, head)
    path = seed_cache_path(kind, recipe, seed, init_seed, cache_dir)
    params, from_cache = cached(
        path, checkpoint.params, lambda: train(checkpoint, seed_keys(seed)[1]),
        dict(recipe, seed=seed, init_seed=init_seed),
    )
    return Trained(checkpoint, params, seed, from_cache, time.perf_counter() - start, path)


def params_digest(params: Params) -> str:
    """SHA-256 of every leaf's path, dtype, shape and bytes (also of a flat dict of data arrays).
    Its own format, not `rotsym_jax.pytree.content_digest`'s: cache entries and keys store it."""
    h = hashlib.sha256()
    for leaf_path, leaf in flatten(params).items():
        a = np.ascontiguousarray(leaf)
        h.update(f"{leaf_path}:{a.dtype}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _restore(path: Path, like: Params) -> Params | None:
    """The entry's params, or None when there is none or it is damaged (then it is removed)."""
    if not path.is_dir():
        return None
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), like)
    try:
        expected = json.loads((path / ENTRY_FILE).read_text())["params_sha256"]
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore((path / "params").absolute(), target)
        if params_digest(params) != expected:
            raise ValueError("the params' checksum differs from the one recorded")
        return params
    except Exception as e:  # a damaged entry is only a cache miss: retrain over it
        warnings.warn(f"discarding unreadable cache entry {path}: {type(e).__name__}: {e}", stacklevel=4)
        shutil.rmtree(path, ignore_errors=True)
        return None


def _save(path: Path, params: Params, recipe: dict) -> None:
    """Write the entry under a temporary name, then rename it into place in one step."""
    try:
        with atomic_path(path) as tmp:
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save((tmp / "params").absolute(), params)
                checkpointer.wait_until_finished()
            entry = dict(recipe, params_sha256=params_digest(params))
            (tmp / ENTRY_FILE).write_text(json.dumps(entry, indent=1, sort_keys=True, default=str))
    except OSError:
        if not path.is_dir():
            raise
        # another process finished the same entry first; its params are equal
