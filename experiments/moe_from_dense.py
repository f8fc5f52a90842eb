"""Mixtures of experts from dense models (issue 75, `rotsym moe` = mergekit-moe), with and without
aligning the experts' models onto the base first.

    PYTHONPATH=.:experiments .venv/bin/python experiments/moe_from_dense.py [--cache-dir DIR]

Models: three Llama decoders of `seqtask.llama_config` (d = 64, 2 layers, FFN 172) trained on the
sequence task (experiments/run.py's decoders, read from its cache or trained), from different inits
and from one shared init. The base is model 0; the mixtures (Mixtral, top 2, as mergekit-moe
writes them: the base's attention, norms, embeddings and LM head, each expert's FFN, gates from the
base) are

    experts 1, 2       two models none of whose FFNs was trained on the base's residual stream
    experts 0, 1, 2    the base's own FFN among them (the usual mergekit-moe config)

for every gate mode: hidden and cheap_embed (each expert's prompts: 16 training sequences of 16
tokens whose last token is e modulo the number of experts), and random (seed 0). Variants:

    mergekit-moe            the models as they are (what mergekit-moe builds)
    aligned, residual perm. each expert's model moved onto the base (`rj.align`: the paper's groups,
                            head permutations, the residual stream permuted); its FFN then reads
                            the base's stream in its own units' order
    aligned, residual rot.  the same with the stream rotated (every model's norm gains folded)
    + shared averaged       then the shared tensors averaged over the models (rotsym.shared: average)
    from activations        the rotation matched on the models' activations over 256 training
                            sequences (method="activations", experiments/moe.py's) instead of weights

Metrics: loss and next-token accuracy on the task's test set (Bayes-optimal: 70%). Writes
experiments/results/moe-from-dense.json (with the commit, command and device); write_results.py
renders it into RESULTS.md.
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

from rotsym_experiments import seqtask
from rotsym_experiments.results_io import provenance, write_json
from rotsym_jax.merging import moe
from rotsym_jax.moe_pipeline import mixture

RESULTS = Path(__file__).parent / "results" / "moe-from-dense.json"
PROMPTS_PER_EXPERT, PROMPT_TOKENS = 16, 16
MODES = ("hidden", "cheap_embed", "random")
EXPERT_SETS = {"experts 1, 2": (1, 2), "experts 0, 1, 2": (0, 1, 2)}
VARIANTS = {
    "mergekit-moe": (False, None, "base"),
    "aligned, residual perm.": (True, dict(heads="permute", residual="permutation"), "base"),
    "aligned, residual rot.": (True, dict(heads="permute", residual="rotation"), "base"),
    "aligned, residual rot. + shared averaged": (True, dict(heads="permute", residual="rotation"), "average"),
    "aligned from activations, residual rot.": (True, dict(heads="permute", residual="rotation", method="activations"), "base"),
}
MATCHING_SEQUENCES = 256  # training sequences whose activations the data-driven variant matches


def prompts(data: seqtask.SeqData, experts: int) -> moe.Prompts:
    """Expert e's positive prompts: the first training sequences (cut to PROMPT_TOKENS) whose last
    token is e modulo `experts`; no negative prompts."""
    rows = np.asarray(data.train["input_ids"])[:, :PROMPT_TOKENS]
    chosen = [rows[rows[:, -1] % experts == e][:PROMPTS_PER_EXPERT] for e in range(experts)]
    return moe.prompt_batch([(list(map(list, c)), []) for c in chosen], pad_id=0)


def matching_batches(data: seqtask.SeqData) -> list[dict]:
    rows = data.train
    return [{k: np.asarray(v[i : i + 32]) for k, v in rows.items()} for i in range(0, MATCHING_SEQUENCES, 32)]


def measure(models: list, test: dict, data) -> dict:
    out = {"models": [seqtask.evaluate(m.checkpoint, m.params, test) for m in models], "mixtures": {}}
    checkpoints = {str(i): dataclasses.replace(m.checkpoint, params=m.params) for i, m in enumerate(models)}
    for set_name, indices in EXPERT_SETS.items():
        for mode in MODES:
            for variant, (align, options, shared) in VARIANTS.items():
                cfg = moe.MoeConfig(base="0", experts=tuple(moe.Expert(str(i)) for i in indices), gate_mode=mode, shared=shared)
                t0 = time.perf_counter()
                batches = matching_batches(data) if options and options.get("method") == "activations" else None
                ck, params, result = mixture(cfg, checkpoints, prompts(data, len(indices)), align=align, align_options=options,
                                             data=batches, key=jax.random.key(0))
                seconds = time.perf_counter() - t0
                metrics = seqtask.evaluate(ck, params, test)
                out["mixtures"].setdefault(set_name, {}).setdefault(mode, {})[variant] = {**metrics, "seconds": seconds,
                                                                                          "gate_condition_numbers": result["gate_condition_numbers"]}
                print(f"  {set_name}, {mode:<11} {variant:<42} loss {metrics['loss']:.3f}  accuracy {metrics['accuracy']:.1%}", flush=True)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=None, help="the experiments' cache (default: $ROTSYM_CACHE, else ./.cache/rotsym_jax)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    data, config = seqtask.make_data(), seqtask.llama_config()
    test = dict(data.test)
    results = {**provenance(), "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "jax": jax.__version__,
                                           "cpus": os.cpu_count(), "device": jax.devices()[0].device_kind},
               "config": config.to_diff_dict(), "expert_sets": {k: list(v) for k, v in EXPERT_SETS.items()},
               "variants": {k: {"align": a, "align_options": o, "shared": s} for k, (a, o, s) in VARIANTS.items()},
               "prompts": {"per_expert": PROMPTS_PER_EXPERT, "tokens": PROMPT_TOKENS}, "settings": {}}
    for name, init_seed in (("different init", None), ("shared init", 0)):
        models = [seqtask.train_or_load(config, seqtask.SETTINGS, s, data, args.cache_dir, init_seed=init_seed) for s in (0, 1, 2)]
        print(name, flush=True)
        results["settings"][name] = measure(models, test, data)
    results["seconds"] = time.perf_counter() - start
    write_json(results, RESULTS)


if __name__ == "__main__":
    main()
