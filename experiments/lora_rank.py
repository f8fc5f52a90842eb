"""The rank a LoRA adapter needs, with and without aligning the tuned model to the base first.

    PYTHONPATH=.:experiments .venv/bin/python experiments/lora_rank.py [--cache-dir DIR]

For each pair (a base and a model trained from it, or trained apart), the adapter that
`rotsym extract-lora` writes (`rotsym_jax.merging.lora`: mergekit-extract-lora's modules, every
linear layer's delta factored by SVD) is measured by its singular values: the smallest uniform rank
(`--rank`) whose adapter leaves at most a given error of the delta, measured against the norm of the
plain delta ||T - B|| in both cases, so that a threshold is one absolute error of the weights whatever
the alignment. Aligned: T moved onto B by the symmetries first (`rj.align`, weights; the same function
as T), the paper's groups, then with head permutations and the residual stream permuted too.

Pairs (read from the experiments' cache, where only the Llama decoders are trained if missing):
  ViT digits, init -> trained: the initialization as base, the model trained from it (a "fine-tune");
  ViT digits, shared init:     two models trained from one init on different data orders;
  ViT digits, different init:  two models trained from different inits;
  Llama d=64 decoders on the sequence task: the same three pairs;
  DeBERTa, pretrained -> fine-tuned: the MLM-pretrained encoder with its fresh head as base, its
                               fine-tune on a domain.

Writes experiments/results/lora-rank.json (with the commit, command and device).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

import rotsym_jax as rj
from rotsym_experiments import deberta, digits, seqtask, textcls, training
from rotsym_experiments.results_io import provenance, write_json
from rotsym_jax.merging import lora
from rotsym_jax.pipeline import aligning_spec

RESULTS = Path(__file__).parent / "results" / "lora-rank.json"
ERRORS = (0.5, 0.3, 0.1, 0.01)
VARIANTS = {"plain": None, "aligned (paper)": {}, "aligned (+ head perm., residual perm.)": dict(heads="permute", residual="permutation")}


def _cached(path: Path, what: str) -> None:
    if not path.is_dir():
        raise SystemExit(f"{what}: no cache entry at {path}; run experiments/run.py for it first (this script trains only the decoders)")


def vit_pairs(cache_dir) -> dict:
    config, settings, data = digits.vit_config(), digits.TrainSettings(), digits.load_digits()
    for seed, init in ((0, None), (1, None), (1, 0)):
        _cached(digits.cache_path(config, settings, seed, cache_dir, init_seed=init), f"ViT seed {seed} init {init}")
    a = digits.train_or_load(config, settings, 0, data, cache_dir)
    b = digits.train_or_load(config, settings, 1, data, cache_dir)
    shared = digits.train_or_load(config, settings, 1, data, cache_dir, init_seed=0)
    return {
        "ViT digits, init -> trained": (a.checkpoint, a.checkpoint.params, a.params),
        "ViT digits, shared init": (a.checkpoint, a.params, shared.params),
        "ViT digits, different init": (a.checkpoint, a.params, b.params),
    }


def llama_pairs(cache_dir) -> dict:
    """The Llama-style decoders of the sequence task (d=64; trained here if missing, ~20 s each): the
    same three pairs as the ViTs. (GPT-2's layers are transformers' Conv1D, which mergekit keeps whole:
    its adapter factors nothing.)"""
    config, data = seqtask.llama_config(), seqtask.make_data()
    a = seqtask.train_or_load(config, seqtask.SETTINGS, 0, data, cache_dir)
    b = seqtask.train_or_load(config, seqtask.SETTINGS, 1, data, cache_dir)
    shared = seqtask.train_or_load(config, seqtask.SETTINGS, 1, data, cache_dir, init_seed=0)
    return {
        "Llama d=64, init -> trained": (a.checkpoint, a.checkpoint.params, a.params),
        "Llama d=64, shared init": (a.checkpoint, a.params, shared.params),
        "Llama d=64, different init": (a.checkpoint, a.params, b.params),
    }


def deberta_pairs(cache_dir, domain: str = "restaurants") -> dict:
    _cached(training.cache_path(deberta.KIND, f"seed{deberta.INIT_SEED}", deberta.recipe(), cache_dir), "the pretrained DeBERTa")
    base = deberta.base(pre=deberta.pretrain_or_load(cache_dir=cache_dir))
    tasks = textcls.load_tasks()
    path = textcls.cache_path(tasks, domain, deberta.FINETUNE_SETTINGS, cache_dir=cache_dir, base=base)
    _cached(path, f"DeBERTa fine-tune on {domain}")
    tuned = textcls.finetune_or_load(tasks, domain, deberta.FINETUNE_SETTINGS, cache_dir=cache_dir, base=base)
    return {f"DeBERTa, pretrained -> fine-tuned ({domain})": (tuned.checkpoint, tuned.checkpoint.params, tuned.params)}


def singular_values(checkpoint, base, tuned) -> dict[str, np.ndarray]:
    """Each factored module's singular values, from the extracted factors (A = S Vh: its row norms)."""
    full = lora.extract_lora(base, tuned, checkpoint, lora.LoraOptions(rank=10**6, distribute_scale=False))
    return {name: np.linalg.norm(np.asarray(a, np.float64), axis=1) for name, a in full.a.items()}


def rank_for(values: dict[str, np.ndarray], budget: float) -> int:
    """The smallest uniform rank r whose truncation error sqrt(sum of s_i^2 beyond r) is <= budget."""
    top = max(len(s) for s in values.values())
    tails = np.zeros(top + 1)
    for s in values.values():
        tail = np.concatenate([np.cumsum((s**2)[::-1])[::-1], [0.0]])  # tail[r] = sum of s_i^2, i >= r
        tails += np.pad(tail, (0, top + 1 - len(tail)))
    return int(np.argmax(np.sqrt(tails) <= budget))


def measure(name: str, checkpoint, base, tuned) -> dict:
    rows, plain_norm = {}, None
    for variant, options in VARIANTS.items():
        start = time.perf_counter()
        moved = tuned if options is None else rj.align(base, tuned, aligning_spec(checkpoint), **options).params
        values = singular_values(checkpoint, base, moved)
        norm = float(np.sqrt(sum(np.sum(s**2) for s in values.values())))
        plain_norm = norm if plain_norm is None else plain_norm
        ranks = {f"{e:g}": rank_for(values, e * plain_norm) for e in ERRORS}
        check_rank = ranks["0.1"]  # the adapter itself at that rank, measured as the command reports it
        extracted = lora.extract_lora(base, moved, checkpoint, lora.LoraOptions(rank=max(check_rank, 1)))
        rows[variant] = dict(delta_norm=norm, relative_to_plain=norm / plain_norm, full_rank=max(len(s) for s in values.values()),
                             rank_for_error=ranks, error_at_rank_for_0_1=lora.relative_error(extracted, base, moved, checkpoint) * norm / plain_norm,
                             seconds=time.perf_counter() - start)
        print(f"{name:45s} {variant:40s} ||delta|| {norm:9.3f} ({norm / plain_norm:6.1%})  rank for error "
              + "  ".join(f"{k}: {v:3d}" for k, v in ranks.items()))
    return dict(modules=len(values), variants=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=None, help="the experiments' cache (default: $ROTSYM_CACHE, else ./.cache/rotsym_jax)")
    parser.add_argument("--train-cache", default=None,
                        help="where the Llama decoders are read from, or trained into when missing (default: --cache-dir)")
    parser.add_argument("--skip-deberta", action="store_true", help="leave out the DeBERTa pair")
    args = parser.parse_args()
    pairs = vit_pairs(args.cache_dir)
    pairs.update(llama_pairs(args.train_cache or args.cache_dir))
    if not args.skip_deberta:
        pairs.update(deberta_pairs(args.cache_dir))
    start = time.perf_counter()
    results = {**provenance(), "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "jax": jax.__version__,
                                           "cpus": os.cpu_count(), "device": jax.devices()[0].device_kind},
               "errors": list(ERRORS), "pairs": {},
               "metric": "smallest uniform --rank whose adapter's error ||delta - BA|| is <= error * ||plain delta|| (Frobenius, over the factored modules)"}
    for name, (checkpoint, base, tuned) in pairs.items():
        results["pairs"][name] = measure(name, checkpoint, base, tuned) | {"family": checkpoint.family,
                                                                             "layout": dataclasses.asdict(checkpoint.layout)}
    results["seconds"] = time.perf_counter() - start
    write_json(results, RESULTS)


if __name__ == "__main__":
    main()
