"""A small DeBERTa-v3-style encoder pretrained here by masked-language modelling on the generated
review text of `textcls`, and its per-domain fine-tunes: the paper's Table 1 model family at CPU scale.

Model. `config()`: DeBERTa-v3's attention (relative positions in log buckets, c2p and p2c through
the tokens' own query and key projections: share_att_key, normed relative embeddings, no absolute
positions, no token types), 128 wide, 4 layers of 4 heads, FFN 512, over the MiniLM tokenizer's
vocabulary (30522 word pieces), so that `textcls.tokenize` feeds it.

Pretraining. The library's Flax DeBERTa with its masked-LM head (`init_checkpoint(..., head="masked_lm")`:
transform, LayerNorm and the word embeddings as decoder) from a seeded init, trained by AdamW
(`training.optimizer`, one jitted `training._epoch` scan per epoch, as `training.fit`) on the
sentences of the five domains' *train* splits only (`textcls.generate(domain, "train", ...)`;
never test or held-out). Each epoch masks afresh (dynamic masking, NumPy seeded by (seed, epoch)):
15% of each sentence's word pieces (at least one, at most MAX_MASKED), of which 80% become [MASK],
10% a random word piece of the corpus and 10% stay; the loss is the cross-entropy of the masked
positions only (the head runs on those positions alone: the 30522-way decoder is most of the cost).
The params are cached like every trained model here (`training.cached`) under

    <cache root>/deberta-mlm/seed<seed>-<hash of config, settings, corpus, masking and CACHE_VERSION>/params

with `pretraining.json` beside them: each epoch's mean loss, the seconds it took, and the masked-
token loss and accuracy on a fixed masking of the test sentences before and after (evaluation only).

Fine-tunes. `base()` is the `textcls.Base` of the pretrained body with a fresh, seeded sequence-
classification head (transformers' ContextPooler and classifier: `head/pooler`, `head/classifier`),
fine-tuned per domain by `textcls.finetune_or_load(..., FINETUNE_SETTINGS, base=base())` as MiniLM's are
(the same code and data; 20 epochs instead of 3, see FINETUNE_SETTINGS), and cached under
`<cache root>/deberta/<domain>-seed<seed>-<hash>` (the key records the pretraining recipe and the
pretrained params' SHA-256).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import transformers
from flax import nnx

from rotsym_jax import Checkpoint, init_checkpoint
from rotsym_jax.pytree import Params, flatten, unflatten

from . import textcls, training
from .training import TrainSettings

KIND = "deberta-mlm"
HEAD = "masked_lm"
# Bump when pretraining changes its results (invalidates the pretrained and the fine-tuned caches).
CACHE_VERSION = 1
# 1024 train sentences per domain (5120 in all) x 10 epochs at batch 64: 800 AdamW steps, about
# 6 minutes on 2 CPU cores; the masked-token loss falls from ln(30522) = 10.3 to 1.9 (62% of the
# masked test word pieces right).
PRETRAIN_SETTINGS = TrainSettings(epochs=10, batch_size=64, learning_rate=1e-3, weight_decay=0.01)
PRETRAIN_PER_DOMAIN = 1024
# The pretraining corpus is drawn with its own generation seed (the fine-tunes' sets use seed 0):
# the same templates and vocabulary, other sentences.
CORPUS_SEED = 1
MASK_RATE = 0.15
MAX_MASKED = 6  # masked positions per sentence (the longest has 35 word pieces: 15% is 5)
INIT_SEED = 0
# evaluation only: the masked-token loss on this many test sentences per domain
EVAL_PER_DOMAIN = 200
INFO_FILE = "pretraining.json"
# The fine-tunes: MiniLM's settings (batch 16, learning rate 2e-4, weight decay 0.01) for 20 epochs
# instead of 3. This small model, pretrained on 5120 templated sentences, learns the domain from
# 512 sentences far more slowly than MiniLM: on movies, MiniLM's 3 epochs leave it at 49% of its
# training sentences and 37% of the test ones (chance: 33%); 3 epochs at 1e-3: 47% test; 10 at
# 5e-4 or 1e-3: 58%; 20 at 2e-4: 62% (99% of the training sentences).
FINETUNE_SETTINGS = dataclasses.replace(textcls.DEFAULT_SETTINGS, epochs=20)


def config(num_labels: int = len(textcls.LABELS), **overrides) -> transformers.DebertaV2Config:
    """The small DeBERTa-v3-style config (model type deberta-v2) over the MiniLM tokenizer's vocabulary."""
    tok = textcls.tokenizer()
    values = dict(
        vocab_size=len(tok), hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
        hidden_act="gelu", max_position_embeddings=64, type_vocab_size=0, relative_attention=True,
        share_att_key=True, pos_att_type=["p2c", "c2p"], position_biased_input=False, position_buckets=32,
        max_relative_positions=-1, norm_rel_ebd="layer_norm", layer_norm_eps=1e-7, pad_token_id=tok.pad_token_id,
        num_labels=num_labels,
    )
    return transformers.DebertaV2Config(**{**values, **overrides})


# ---- the corpus and its masking ---------------------------------------------------------------

def corpus(per_domain: int = PRETRAIN_PER_DOMAIN, seed: int = CORPUS_SEED, split: str = "train") -> dict[str, np.ndarray]:
    """The tokenized sentences (input_ids, attention_mask) of every domain's `split` (pretraining: "train")."""
    texts = [e.text for d in textcls.DOMAINS for e in textcls.generate(d, split, per_domain, seed)]
    enc = textcls.tokenize(texts)
    return {k: enc[k] for k in ("input_ids", "attention_mask")}


def mask(data: dict, rng: np.random.Generator, pieces: np.ndarray) -> dict[str, np.ndarray]:
    """BERT's masking of `data` (input_ids, attention_mask): MASK_RATE of each sentence's word
    pieces (not [CLS], [SEP] or padding; at least one, at most MAX_MASKED) are picked; 80% of them
    become [MASK], 10% a random entry of `pieces`, 10% stay. Returns the model inputs and, per
    sentence, MAX_MASKED `positions`, their original `targets` and `weights` (1 picked, 0 filler)."""
    tok = textcls.tokenizer()
    ids = np.array(data["input_ids"], np.int32, copy=True)
    n = len(ids)
    lengths = np.asarray(data["attention_mask"]).sum(1)
    positions = np.zeros((n, MAX_MASKED), np.int32)
    targets = np.zeros((n, MAX_MASKED), np.int32)
    weights = np.zeros((n, MAX_MASKED), np.float32)
    for i in range(n):
        candidates = np.arange(1, lengths[i] - 1)  # between [CLS] and [SEP]
        k = min(MAX_MASKED, len(candidates), max(1, int(round(MASK_RATE * len(candidates)))))
        picked = np.sort(rng.choice(candidates, k, replace=False))
        positions[i, :k], targets[i, :k], weights[i, :k] = picked, ids[i, picked], 1.0
        fate = rng.random(k)
        ids[i, picked[fate < 0.8]] = tok.mask_token_id
        swap = picked[(fate >= 0.8) & (fate < 0.9)]
        ids[i, swap] = rng.choice(pieces, len(swap))
    return dict(input_ids=ids, attention_mask=np.asarray(data["attention_mask"], np.int32),
                positions=positions, targets=targets, weights=weights)


def _pieces(data: dict) -> np.ndarray:
    """The word pieces the corpus uses (the random replacements are drawn from them)."""
    tok = textcls.tokenizer()
    ids = np.unique(np.asarray(data["input_ids"])[np.asarray(data["attention_mask"]) == 1])
    return ids[~np.isin(ids, tok.all_special_ids)].astype(np.int32)


def _mlm_terms(graphdef, params, batch):
    """(cross-entropy, correct) per masked slot: the encoder on the inputs, the library's masked-LM
    head on the masked positions only."""
    model = nnx.merge(graphdef, params)
    head, model.head = model.head, None
    hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["last_hidden_state"]
    picked = jnp.take_along_axis(hidden, batch["positions"][..., None], axis=1)
    logits = head(picked, word=model.embeddings.word)["logits"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return ce, (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)


def _mlm_loss(graphdef, params, batch):
    ce, _ = _mlm_terms(graphdef, params, batch)
    return (ce * batch["weights"]).sum() / jnp.maximum(batch["weights"].sum(), 1.0)


@functools.partial(jax.jit, static_argnums=0)
def _mlm_sums(graphdef, params, batch):
    ce, correct = _mlm_terms(graphdef, params, batch)
    w = batch["weights"]
    return (ce * w).sum(), (correct * w).sum(), w.sum()


def mlm_metrics(checkpoint: Checkpoint, params: Params, data: dict, batch_size: int = 250) -> dict[str, float]:
    """Masked-token loss and accuracy of `params` on masked `data` (the output of `mask`)."""
    n = len(data["input_ids"])
    total = np.zeros(3)
    for start in range(0, n, batch_size):
        chunk = {k: jnp.asarray(v[start : start + batch_size]) for k, v in data.items()}
        total += np.asarray(jax.device_get(_mlm_sums(checkpoint.graphdef, params, chunk)), np.float64)
    return {"loss": float(total[0] / total[2]), "accuracy": float(total[1] / total[2]), "masked": int(total[2])}


def pretrain(checkpoint: Checkpoint, data: dict, settings: TrainSettings, key: jax.Array, mask_seed: int) -> tuple[Params, np.ndarray]:
    """`training.fit` with a fresh masking of `data` each epoch: AdamW with warmup and cosine decay
    over all epochs' steps, one jitted scan per epoch; returns the params and each epoch's mean loss."""
    pieces = _pieces(data)
    n = len(data["input_ids"])
    batches = n // settings.batch_size
    if batches == 0:
        raise ValueError(f"batch_size={settings.batch_size} exceeds the {n} sentences")
    steps = settings.epochs * batches
    params = checkpoint.params
    opt_state = training.optimizer(settings, steps).init(params)
    losses = []
    for epoch, epoch_key in enumerate(jax.random.split(key, settings.epochs)):
        masked = {k: jnp.asarray(v) for k, v in mask(data, np.random.default_rng([mask_seed, epoch]), pieces).items()}
        params, opt_state, value = training._epoch(
            checkpoint.graphdef, _mlm_loss, settings, steps, params, opt_state, masked, epoch_key)
        losses.append(value)
    return params, np.asarray(jax.device_get(losses))


# ---- the cached pretrained model --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Pretrained:
    """The pretrained masked LM: `checkpoint` (its params the initial ones), the trained `params`,
    and `info` (the pretraining's losses, seconds, evaluation; whether it came from the cache)."""

    checkpoint: Checkpoint
    params: Params
    recipe: dict
    info: dict
    path: Path


def recipe(settings: TrainSettings = PRETRAIN_SETTINGS, per_domain: int = PRETRAIN_PER_DOMAIN, seed: int = INIT_SEED) -> dict:
    """Everything pretraining depends on (JSON-able): the cache key of the pretrained params."""
    data = corpus(per_domain)
    return training.config_recipe(
        config(), settings, head=HEAD, seed=seed,
        corpus=dict(domains=list(textcls.DOMAINS), split="train", per_domain=per_domain, generation_seed=CORPUS_SEED,
                    max_length=textcls.MAX_LENGTH, generation_version=textcls.GENERATION_VERSION),
        data_sha256=training.params_digest(data),
        masking=dict(rate=MASK_RATE, max_masked=MAX_MASKED, replace=[0.8, 0.1, 0.1], dynamic=True),
        version=CACHE_VERSION,
    )


def _eval_data(pieces: np.ndarray) -> dict:
    test = corpus(EVAL_PER_DOMAIN, seed=0, split="test")
    return mask(test, np.random.default_rng([CORPUS_SEED, 12345]), pieces)


def pretrain_or_load(settings: TrainSettings = PRETRAIN_SETTINGS, per_domain: int = PRETRAIN_PER_DOMAIN,
                     seed: int = INIT_SEED, cache_dir=None) -> Pretrained:
    """The pretrained masked LM, from the cache when a complete, intact entry exists, else trained
    (a few CPU minutes) and cached, with its losses and evaluation in `pretraining.json`."""
    start = time.perf_counter()
    rec = recipe(settings, per_domain, seed)
    init_key, train_key = training.seed_keys(seed)
    checkpoint = init_checkpoint(config(), init_key, head=HEAD)
    path = training.cache_path(KIND, f"seed{seed}", rec, cache_dir)
    data = corpus(per_domain)
    trained = {}

    def train():
        t0 = time.perf_counter()
        params, losses = pretrain(checkpoint, data, settings, train_key, mask_seed=seed)
        trained.update(losses=[float(x) for x in losses], train_seconds=time.perf_counter() - t0)
        return params

    params, from_cache = training.cached(path, checkpoint.params, train, rec)
    if from_cache:
        info = json.loads((path / INFO_FILE).read_text()) if (path / INFO_FILE).is_file() else {}
    else:
        evaluation = _eval_data(_pieces(data))
        info = dict(
            trained, steps=settings.epochs * (len(data["input_ids"]) // settings.batch_size), sentences=len(data["input_ids"]),
            test_before=mlm_metrics(checkpoint, checkpoint.params, evaluation),
            test_after=mlm_metrics(checkpoint, params, evaluation),
        )
        (path / INFO_FILE).write_text(json.dumps(info, indent=1))
    info = dict(info, from_cache=from_cache, seconds=time.perf_counter() - start, path=str(path))
    return Pretrained(checkpoint, params, rec, info, path)


def classifier(pre: Pretrained, num_labels: int = len(textcls.LABELS), head_seed: int = 0) -> Checkpoint:
    """The pretrained encoder with a fresh sequence-classification head (pooler and classifier,
    transformers-style init from `head_seed`), as `textcls.base_model` is for MiniLM."""
    fresh = init_checkpoint(config(num_labels), jax.random.key(head_seed), head="sequence_classification")
    ours = flatten(fresh.params)
    body = {p: leaf for p, leaf in flatten(pre.params).items() if not p.startswith("head/")}
    for path, leaf in body.items():
        if path not in ours or (leaf.shape, leaf.dtype) != (ours[path].shape, ours[path].dtype):
            raise AssertionError(f"{path}: the pretrained leaf has no equal place in the classifier")
    new = sorted(set(ours) - set(body))
    if not new or not all(p.startswith("head/") for p in new):
        raise AssertionError(f"the leaves left to initialise should be the head's, got {new}")
    return dataclasses.replace(fresh, params=unflatten({**ours, **body}))


def base(cache_dir=None, pre: Pretrained | None = None) -> textcls.Base:
    """The `textcls.Base` the DeBERTa fine-tunes start from (pretrained here; see `pretrain_or_load`)."""
    pre = pre if pre is not None else pretrain_or_load(cache_dir=cache_dir)
    digest = training.params_digest(pre.params)

    def describe(head_seed: int) -> dict:
        return dict(model="small DeBERTa-v3-style, pretrained here by MLM", pretraining=pre.recipe,
                    pretrained_sha256=digest, head_seed=head_seed, num_labels=len(textcls.LABELS))

    return textcls.Base("deberta", lambda num_labels, head_seed: classifier(pre, num_labels, head_seed), describe)
