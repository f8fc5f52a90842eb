"""A synthetic next-token task and small GPT-2 / Llama decoders trained on it: the language models
that the experiments align and merge.

The task is a fixed random sparse order-2 Markov chain over a small vocabulary: every context
(a, b) of two tokens has `len(SUCCESSOR_PROBS)` distinct successors drawn at random, taken with the
fixed probabilities SUCCESSOR_PROBS. Why this task:

  * it needs attention: a decoder position holds only its own token, and the successors of (a, b)
    are drawn independently for every a, so the token before it (reachable only through attention)
    is worth a lot: a bigram model, the best a decoder without attention can become, reaches
    0.14 accuracy where the Bayes-optimal predictor reaches 0.70 (V = 24);
  * its optimum is known exactly: every labelled position is one step of the chain with the same
    probability profile, so the Bayes-optimal accuracy is max(SUCCESSOR_PROBS) = 0.7 and the
    Bayes-optimal cross-entropy is the profile's entropy (0.80 nats; chance: 1/V and ln V);
  * 2-layer, d=64 decoders learn it within a minute of CPU training, and models from different
    seeds reach similar quality by different parameters, as merging experiments need.

Sequences start with two uniformly random tokens; labels[t] is the token at t + 1 (the standard
causal-LM layout that `stats.fisher` expects: labels aligned with the logits' positions), -100 at
t = 0 (the second token is independent noise) and at the last position (nothing follows). The chain
comes from a task seed; training and test sequences from other seeds.

`train_or_load` trains one decoder per seed with `training.fit` and caches its params under

    <cache root>/seqtask/seed<seed>[-init<init seed>]-<hash of config, settings and data>/params
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import transformers
from flax import nnx

from rotsym_jax import Checkpoint
from rotsym_jax.pytree import Params

from . import training
from .training import Trained, TrainSettings  # noqa: F401 (re-exported)

HEAD = "lm"
IGNORE = -100
VOCAB_SIZE = 24
SEQ_LEN = 32
# Probabilities of a context's successors, most likely first: Bayes accuracy = their maximum.
SUCCESSOR_PROBS = (0.7, 0.2, 0.1)
TASK_SEED = 0
TRAIN_SEED = 1
TEST_SEED = 2
N_TRAIN = 8192
N_TEST = 1024
# Bump when the task, the models' training or the loss change their results, to invalidate old caches.
CACHE_VERSION = 1


# ---- the task -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Chain:
    """successors (V, V, K): the K distinct successors of context (a, b); successor k is taken
    with probability probs[k], the same profile for every context."""

    successors: np.ndarray
    probs: np.ndarray

    @property
    def vocab_size(self) -> int:
        return self.successors.shape[0]

    def transition(self) -> np.ndarray:
        """Dense P[a, b, c] = p(next = c | previous two = a, b), (V, V, V)."""
        v = self.vocab_size
        p = np.zeros((v, v, v))
        a, b = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
        for k, q in enumerate(self.probs):
            p[a, b, self.successors[..., k]] += q
        return p


def make_chain(task_seed: int = TASK_SEED, vocab_size: int = VOCAB_SIZE, probs=SUCCESSOR_PROBS) -> Chain:
    """The task's chain: for each context, len(probs) distinct successors drawn uniformly."""
    probs = np.asarray(probs, np.float64)
    if not (np.all(probs > 0) and math.isclose(probs.sum(), 1.0) and len(probs) <= vocab_size):
        raise ValueError(f"probs={tuple(probs)}: need at most vocab_size positive probabilities summing to 1")
    rng = np.random.default_rng([task_seed, vocab_size])
    successors = np.stack(
        [rng.choice(vocab_size, size=len(probs), replace=False) for _ in range(vocab_size * vocab_size)]
    ).reshape(vocab_size, vocab_size, len(probs))
    return Chain(successors.astype(np.int32), probs)


def sample(chain: Chain, n: int, seq_len: int, seed: int) -> dict[str, np.ndarray]:
    """n sequences of the chain as an LM batch {input_ids, attention_mask, labels}, int32 (n, seq_len)."""
    if seq_len < 3:
        raise ValueError(f"seq_len={seq_len}: sequences need at least 3 tokens")
    rng = np.random.default_rng(seed)
    v = chain.vocab_size
    ids = np.empty((n, seq_len), np.int32)
    ids[:, :2] = rng.integers(0, v, size=(n, 2))
    cdf = np.cumsum(chain.probs)
    for t in range(2, seq_len):
        k = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), len(cdf) - 1)
        ids[:, t] = chain.successors[ids[:, t - 2], ids[:, t - 1], k]
    labels = np.full_like(ids, IGNORE)
    labels[:, 1:-1] = ids[:, 2:]
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels}


@dataclasses.dataclass(frozen=True)
class SeqData:
    """The chain and its training and test batches; `recipe` records how they were made."""

    chain: Chain
    train: dict
    test: dict
    recipe: dict

    def digest(self) -> str:
        """SHA-256 of the training batch: part of every cache key, so other data trains anew."""
        h = hashlib.sha256()
        for k in sorted(self.train):
            h.update(k.encode() + np.ascontiguousarray(self.train[k]).tobytes())
        return h.hexdigest()


def make_data(
    n_train: int = N_TRAIN, n_test: int = N_TEST, *, seq_len: int = SEQ_LEN, vocab_size: int = VOCAB_SIZE,
    probs=SUCCESSOR_PROBS, task_seed: int = TASK_SEED, train_seed: int = TRAIN_SEED, test_seed: int = TEST_SEED,
) -> SeqData:
    """Training and test sequences of the chain of `task_seed` (deterministic in all arguments)."""
    if train_seed == test_seed:
        raise ValueError("train_seed and test_seed must differ, or the test set repeats the training set")
    chain = make_chain(task_seed, vocab_size, probs)
    recipe = dict(
        n_train=n_train, n_test=n_test, seq_len=seq_len, vocab_size=vocab_size, probs=[float(p) for p in chain.probs],
        task_seed=task_seed, train_seed=train_seed, test_seed=test_seed,
    )
    return SeqData(chain, sample(chain, n_train, seq_len, train_seed), sample(chain, n_test, seq_len, test_seed), recipe)


def bayes(chain: Chain) -> dict[str, float]:
    """The best any predictor can do per labelled token (every one is a chain step with the same
    profile): accuracy max(probs), cross-entropy the profile's entropy."""
    p = chain.probs
    return {"loss": float(-(p * np.log(p)).sum()), "accuracy": float(p.max())}


def ngram_baseline(data: SeqData, context: int) -> dict[str, float]:
    """Test loss and accuracy of the count model that predicts from the last `context` tokens
    (0: unigram, 1: bigram, 2: trigram = the chain's order), fitted on the training set with
    add-one smoothing. Predictors without attention are bounded by the bigram (context 1)."""
    if context not in (0, 1, 2):
        raise ValueError(f"context={context}: 0, 1 or 2 tokens")
    v = data.chain.vocab_size

    def contexts(batch):
        ids, labels = batch["input_ids"], batch["labels"]
        t = np.nonzero((labels != IGNORE).any(0))[0]
        if len(t) == 0 or t.min() < 1:
            raise ValueError("ngram_baseline needs labelled positions, none at t = 0 (its context is cut)")
        code = np.zeros((ids.shape[0], len(t)), np.int64)
        for j in range(context):
            code = code * v + ids[:, t - j]
        keep = labels[:, t] != IGNORE
        return code[keep], labels[:, t][keep]

    code, target = contexts(data.train)
    counts = np.ones((v**context, v))
    np.add.at(counts, (code, target), 1)
    logp = np.log(counts / counts.sum(1, keepdims=True))
    code, target = contexts(data.test)
    return {"loss": float(-logp[code, target].mean()), "accuracy": float((logp[code].argmax(1) == target).mean())}


# ---- models ---------------------------------------------------------------------------------------

def gpt2_config(**overrides) -> transformers.GPT2Config:
    """A tiny GPT-2 for the task: d=64, 2 layers, 4 heads, FFN 256 (GELU), tied LM head."""
    settings = dict(
        vocab_size=VOCAB_SIZE, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4, n_inner=256,
        bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2Config(**{**settings, **overrides})


def llama_config(**overrides) -> transformers.LlamaConfig:
    """A tiny Llama for the task: d=64, 2 layers, 4 query heads sharing 2 key/value heads (GQA),
    RoPE, SwiGLU FFN 172 (about GPT-2's FFN parameter count), untied LM head (GPT-2's is tied)."""
    settings = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=172, max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )
    return transformers.LlamaConfig(**{**settings, **overrides})


def qwen3_config(**overrides) -> transformers.Qwen3Config:
    """The Llama of `llama_config` with Qwen3's QK-norm (an RMSNorm over each head's q and k before
    RoPE, MATH §9): its QK group is head permutations and rotary-pair signs only."""
    settings = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=172, max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )
    return transformers.Qwen3Config(**{**settings, **overrides})


def mixtral_config(**overrides) -> transformers.MixtralConfig:
    """The Llama of `llama_config` with a sparse mixture of experts in place of its FFN: 4 experts of
    86 units, top 2 renormalised: each token runs 172 units, as the Llama's FFN."""
    settings = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=86, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQ_LEN, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )
    return transformers.MixtralConfig(**{**settings, **overrides})


def init_model(config, seed: int) -> Checkpoint:
    """The randomly initialised LM of `config` for `seed` (its params are the start of training)."""
    return training.init_model(config, seed, HEAD)


# ---- metrics --------------------------------------------------------------------------------------

def _metrics(graphdef, params, batch):
    logits = nnx.merge(graphdef, params)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["logits"]
    labels = batch["labels"]
    valid = labels != IGNORE
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.where(valid, labels, 0))
    correct = (jnp.argmax(logits, -1) == labels) & valid
    count = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)  # no labels: 0, not NaN
    return {"loss": jnp.sum(jnp.where(valid, ce, 0.0)) / count, "accuracy": jnp.sum(correct) / count}


def _loss(graphdef, params, batch):
    return _metrics(graphdef, params, batch)["loss"]


_jitted_metrics = jax.jit(_metrics, static_argnums=0)


def metrics(checkpoint: Checkpoint, params: Params, batch: dict) -> dict:
    """{"loss": mean cross-entropy, "accuracy"} over the batch's labelled tokens (label != -100),
    as jnp scalars; traceable, so it may be called under jit or grad with params as the argument."""
    return _jitted_metrics(checkpoint.graphdef, params, {k: jnp.asarray(v) for k, v in batch.items()})


def evaluate(checkpoint: Checkpoint, params: Params, batch: dict, batch_size: int = 512) -> dict[str, float]:
    """`metrics` over a large batch as floats, in chunks of `batch_size` sequences, each weighted
    by its number of labelled tokens."""
    n = len(batch["input_ids"])
    loss = correct = count = 0.0
    for start in range(0, n, batch_size):
        chunk = {k: np.asarray(v[start:start + batch_size]) for k, v in batch.items()}
        tokens = int((chunk["labels"] != IGNORE).sum())
        m = metrics(checkpoint, params, chunk)
        loss, correct, count = loss + float(m["loss"]) * tokens, correct + float(m["accuracy"]) * tokens, count + tokens
    if count == 0:
        raise ValueError("evaluate: the batch has no labelled tokens")
    return {"loss": loss / count, "accuracy": correct / count}


# ---- training and the cache -----------------------------------------------------------------------

# Trains a default model to near-Bayes accuracy (0.70).
SETTINGS = TrainSettings(epochs=5, batch_size=64, learning_rate=3e-3, weight_decay=0.05)


def train(checkpoint: Checkpoint, data: SeqData, settings: TrainSettings, key: jax.Array) -> tuple[Params, np.ndarray]:
    """Train from `checkpoint.params` (`training.fit`); returns the trained params and each epoch's mean loss."""
    return training.fit(checkpoint.graphdef, checkpoint.params, data.train, _loss, settings, key)


def _recipe(config, settings: TrainSettings, data: SeqData) -> dict:
    """Everything training depends on besides the seeds, as JSON-able data."""
    return training.config_recipe(config, settings, data=data.recipe, data_sha256=data.digest(), version=CACHE_VERSION)


def cache_path(
    config, settings: TrainSettings, seed: int, data: SeqData, cache_dir=None, init_seed: int | None = None
) -> Path:
    """The cache entry of a (config, settings, data, seed, init seed), named by a hash of `_recipe`."""
    return training.seed_cache_path("seqtask", _recipe(config, settings, data), seed, init_seed, cache_dir)


def train_or_load(
    config, settings: TrainSettings, seed: int, data: SeqData, cache_dir=None, init_seed: int | None = None
) -> Trained:
    """The trained params of `seed`, from the cache when a complete, intact entry exists, else
    trained and cached; the initial params come from `init_seed` (default: `seed`), see
    `training.train_or_load`."""
    if config.vocab_size < data.chain.vocab_size:  # JAX would clamp the out-of-range token ids silently
        raise ValueError(f"config.vocab_size={config.vocab_size} < the task's {data.chain.vocab_size} tokens")
    return training.train_or_load(
        "seqtask", _recipe(config, settings, data), config, HEAD, seed, init_seed,
        lambda checkpoint, key: train(checkpoint, data, settings, key)[0], cache_dir,
    )
