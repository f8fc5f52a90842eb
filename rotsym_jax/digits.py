"""Small ViTs trained on scikit-learn's bundled digits: the models `rotsym demo` aligns and merges.

The data set ships inside scikit-learn (1797 grey 8x8 images, values 0..16, 10 classes), so the
demo needs no download. `train_or_load` trains one ViT per seed with AdamW (a few seconds on a
CPU) and caches its parameters with orbax-checkpoint under

    <cache root>/digits/seed<seed>-<hash of config, training settings and data split>/params

where the cache root is the `cache_dir` argument, else $ROTSYM_CACHE, else ./.cache/rotsym_jax;
`entry.json` beside `params` records the spec and a SHA-256 of the params. Entries are written
under a temporary name and renamed into place when complete, so an interrupted run leaves nothing
that a later one would read; an entry that fails to restore or to match its checksum is
discarded (with a warning) and retrained.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import time
import uuid
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import sklearn.datasets
import sklearn.model_selection
import transformers
from flax import nnx

from .hf import Checkpoint, init_checkpoint
from .pytree import Params, flatten

HEAD = "image_classification"
# The split is part of every cache key: changing it retrains.
SPLIT_SEED = 0
TEST_FRACTION = 0.25
# Bump when training code changes in a way that changes its results, to invalidate old caches.
CACHE_VERSION = 1
# Beside an entry's orbax `params` folder: what was trained and the params' checksum.
ENTRY_FILE = "entry.json"


@dataclasses.dataclass(frozen=True)
class Digits:
    """Images (N, 1, 8, 8) float32, standardised with the training set's mean and std; labels (N,) int32."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def load_digits() -> Digits:
    """The digits with a fixed, stratified train/test split (1347 / 450 images)."""
    raw = sklearn.datasets.load_digits()
    images = (raw.images / 16.0).astype(np.float32)[:, None]  # (N, C=1, H, W), as ViT takes them
    labels = raw.target.astype(np.int32)
    tr_x, te_x, tr_y, te_y = sklearn.model_selection.train_test_split(
        images, labels, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=labels
    )
    # Statistics of the training images only, so the test set stays unseen.
    mean, std = tr_x.mean(), tr_x.std()
    return Digits((tr_x - mean) / std, tr_y, (te_x - mean) / std, te_y)


def vit_config(**overrides) -> transformers.ViTConfig:
    """A tiny ViT for 8x8 digits: 2x2 patches (16 tokens + CLS), d=64, 4 heads, 2 layers."""
    settings = dict(
        image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, num_labels=10,
    )
    return transformers.ViTConfig(**{**settings, **overrides})


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    epochs: int = 30
    batch_size: int = 64
    learning_rate: float = 1e-3
    weight_decay: float = 0.05


def init_model(config, seed: int) -> Checkpoint:
    """The randomly initialised classifier of `config` for `seed` (its params are the start of training)."""
    return init_checkpoint(config, _keys(seed)[0], head=HEAD)


def _keys(seed: int):
    """(init key, training key) of a seed: one root key, split once, so seeds never share streams."""
    return tuple(jax.random.split(jax.random.key(seed)))


def loss(checkpoint: Checkpoint, params: Params, images, labels) -> jax.Array:
    """Mean cross-entropy of the classifier's logits."""
    return _jitted_loss(checkpoint.graphdef, params, jnp.asarray(images), jnp.asarray(labels))


def accuracy(checkpoint: Checkpoint, params: Params, images, labels) -> float:
    logits = checkpoint.apply(params, pixel_values=images)["logits"]
    return float(jnp.mean(jnp.argmax(logits, -1) == jnp.asarray(labels)))


def _loss(graphdef, params, images, labels):
    logits = nnx.merge(graphdef, params)(pixel_values=images)["logits"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


_jitted_loss = jax.jit(_loss, static_argnums=0)


def _optimizer(settings: TrainSettings, steps: int) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, settings.learning_rate, warmup_steps=max(1, steps // 20), decay_steps=steps
    )
    return optax.adamw(schedule, weight_decay=settings.weight_decay)


def train(
    checkpoint: Checkpoint, data: Digits, settings: TrainSettings, key: jax.Array
) -> tuple[Params, np.ndarray]:
    """Train from `checkpoint.params`; returns the trained params and the mean loss of each epoch.

    Each epoch visits the training images in a fresh random order (from `key`) in full batches,
    skipping the few left over after the last one (different ones each epoch).
    """
    images, labels = jnp.asarray(data.train_images), jnp.asarray(data.train_labels)
    batches = len(images) // settings.batch_size
    if batches == 0:
        raise ValueError(f"batch_size={settings.batch_size} exceeds the {len(images)} training images")
    steps = settings.epochs * batches
    params = checkpoint.params
    opt_state = _optimizer(settings, steps).init(params)
    losses = []
    for epoch_key in jax.random.split(key, settings.epochs):
        params, opt_state, value = _epoch(
            checkpoint.graphdef, settings, steps, params, opt_state, images, labels, epoch_key
        )
        losses.append(value)
    return params, np.asarray(jax.device_get(losses))


# Static graphdef and settings (not a closure over the checkpoint), so that every seed of one
# config reuses one compiled epoch.
@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "steps"))
def _epoch(graphdef, settings, steps, params, opt_state, images, labels, key):
    """One pass over the training set as a `lax.scan` of AdamW steps; returns its mean loss too."""
    optimizer = _optimizer(settings, steps)
    batches = len(images) // settings.batch_size
    order = jax.random.permutation(key, len(images))[: batches * settings.batch_size]
    order = order.reshape(batches, settings.batch_size)

    def step(carry, batch):
        params, opt_state = carry
        value, grads = jax.value_and_grad(_loss, argnums=1)(graphdef, params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    (params, opt_state), values = jax.lax.scan(step, (params, opt_state), (images[order], labels[order]))
    return params, opt_state, values.mean()


@dataclasses.dataclass(frozen=True)
class Trained:
    """One seed's model: `checkpoint` (the family, config and graph; its params are the initial
    ones), the trained `params`, whether they came from the cache, and the seconds it took."""

    checkpoint: Checkpoint
    params: Params
    seed: int
    from_cache: bool
    seconds: float
    path: Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir or os.environ.get("ROTSYM_CACHE") or ".cache/rotsym_jax")


def _spec(config, settings: TrainSettings) -> dict:
    """Everything training depends on besides the seed, as JSON-able data."""
    config_dict = {k: v for k, v in config.to_dict().items() if k != "transformers_version"}
    return dict(
        config=config_dict, settings=dataclasses.asdict(settings), split_seed=SPLIT_SEED,
        test_fraction=TEST_FRACTION, version=CACHE_VERSION,
    )


def cache_path(config, settings: TrainSettings, seed: int, cache_dir=None, init_seed: int | None = None) -> Path:
    """The cache entry of a (config, settings, seed, init seed), named by a hash of `_spec`."""
    spec = json.dumps(_spec(config, settings), sort_keys=True, default=str)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:16]
    init = "" if init_seed is None or init_seed == seed else f"-init{init_seed}"
    return cache_root(cache_dir) / "digits" / f"seed{seed}{init}-{digest}"


def train_or_load(
    config, settings: TrainSettings, seed: int, data: Digits, cache_dir=None, init_seed: int | None = None
) -> Trained:
    """The trained params of `seed`, from the cache when a complete, intact entry exists, else
    trained and cached. The initial params come from `init_seed` (default: `seed`): models that
    share an init seed and differ in `seed` start from one point and see the data in different
    orders (like fine-tunes of one pretrained model)."""
    start = time.perf_counter()
    init_seed = seed if init_seed is None else init_seed
    checkpoint = init_model(config, init_seed)
    path = cache_path(config, settings, seed, cache_dir, init_seed)
    params = _restore(path, checkpoint.params)
    from_cache = params is not None
    if not from_cache:
        params, _ = train(checkpoint, data, settings, _keys(seed)[1])
        _save(path, params, dict(_spec(config, settings), seed=seed, init_seed=init_seed))
    return Trained(checkpoint, params, seed, from_cache, time.perf_counter() - start, path)


def _params_digest(params: Params) -> str:
    """SHA-256 of every leaf's path, dtype, shape and bytes."""
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
        if _params_digest(params) != expected:
            raise ValueError("the params' checksum differs from the one recorded")
        return params
    except Exception as e:  # a damaged entry is only a cache miss: retrain over it
        warnings.warn(f"discarding unreadable cache entry {path}: {type(e).__name__}: {e}", stacklevel=3)
        shutil.rmtree(path, ignore_errors=True)
        return None


def _save(path: Path, params: Params, spec: dict) -> None:
    """Write the entry under a temporary name, then rename it into place in one step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save((tmp / "params").absolute(), params)
            checkpointer.wait_until_finished()
        entry = dict(spec, params_sha256=_params_digest(params))
        (tmp / ENTRY_FILE).write_text(json.dumps(entry, indent=1, sort_keys=True, default=str))
        try:
            tmp.rename(path)
        except OSError:
            if not path.is_dir():
                raise
            shutil.rmtree(tmp)  # another process finished the same entry first; its params are equal
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
