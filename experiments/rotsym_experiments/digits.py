"""Small ViTs trained on scikit-learn's bundled digits: the models `rotsym demo` aligns and merges.

The data set ships inside scikit-learn (1797 grey 8x8 images, values 0..16, 10 classes), so the
demo needs no download. `train_or_load` trains one ViT per seed with AdamW (a few seconds on a
CPU) and caches its parameters (`training.cached`) under

    <cache root>/digits/seed<seed>-<hash of config, training settings and data split>/params
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import sklearn.datasets
import sklearn.model_selection
import transformers
from flax import nnx

from rotsym_jax import Checkpoint
from rotsym_jax.pytree import Params

from . import training
from .training import ENTRY_FILE, Trained, TrainSettings, cache_root  # noqa: F401 (re-exported)

HEAD = "image_classification"
# The split is part of every cache key: changing it retrains.
SPLIT_SEED = 0
TEST_FRACTION = 0.25
# Bump when training code changes in a way that changes its results, to invalidate old caches.
CACHE_VERSION = 1


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


def init_model(config, seed: int) -> Checkpoint:
    """The randomly initialised classifier of `config` for `seed` (its params are the start of training)."""
    return training.init_model(config, seed, HEAD)


def loss(checkpoint: Checkpoint, params: Params, images, labels) -> jax.Array:
    """Mean cross-entropy of the classifier's logits."""
    return _jitted_loss(checkpoint.graphdef, params, {"pixel_values": jnp.asarray(images), "labels": jnp.asarray(labels)})


def accuracy(checkpoint: Checkpoint, params: Params, images, labels) -> float:
    logits = checkpoint.apply(params, pixel_values=images)["logits"]
    return float(jnp.mean(jnp.argmax(logits, -1) == jnp.asarray(labels)))


def metrics(checkpoint: Checkpoint, params: Params, batch: dict) -> dict:
    """{"loss": mean cross-entropy, "accuracy"} on a batch {"pixel_values", "labels"}; jittable
    (the loss function of `barrier.interpolate`)."""
    logits = checkpoint.apply(params, pixel_values=batch["pixel_values"])["logits"].astype(jnp.float32)
    labels = jnp.asarray(batch["labels"])
    return {
        "loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels),
    }


def test_batch(data: Digits) -> dict:
    return {"pixel_values": data.test_images, "labels": data.test_labels}


def _loss(graphdef, params, batch):
    logits = nnx.merge(graphdef, params)(pixel_values=batch["pixel_values"])["logits"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


_jitted_loss = jax.jit(_loss, static_argnums=0)


def train(
    checkpoint: Checkpoint, data: Digits, settings: TrainSettings, key: jax.Array
) -> tuple[Params, np.ndarray]:
    """Train from `checkpoint.params` (`training.fit`); returns the trained params and the mean loss of each epoch."""
    batch = {"pixel_values": data.train_images, "labels": data.train_labels}
    return training.fit(checkpoint.graphdef, checkpoint.params, batch, _loss, settings, key)


def _recipe(config, settings: TrainSettings) -> dict:
    """Everything training depends on besides the seeds, as JSON-able data."""
    return training.config_recipe(
        config, settings, split_seed=SPLIT_SEED, test_fraction=TEST_FRACTION, version=CACHE_VERSION
    )


def cache_path(config, settings: TrainSettings, seed: int, cache_dir=None, init_seed: int | None = None) -> Path:
    """The cache entry of a (config, settings, seed, init seed), named by a hash of `_recipe`."""
    return training.seed_cache_path("digits", _recipe(config, settings), seed, init_seed, cache_dir)


def train_or_load(
    config, settings: TrainSettings, seed: int, data: Digits, cache_dir=None, init_seed: int | None = None
) -> Trained:
    """The trained params of `seed`, from the cache when a complete, intact entry exists, else
    trained and cached; the initial params come from `init_seed` (default: `seed`), see
    `training.train_or_load`."""
    return training.train_or_load(
        "digits", _recipe(config, settings), config, HEAD, seed, init_seed,
        lambda checkpoint, key: train(checkpoint, data, settings, key)[0], cache_dir,
    )
