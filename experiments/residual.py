"""Residual-stream alignment (beyond the paper) on the experiments' pairs.

    .venv/bin/python experiments/residual.py --task vit|minilm|gpt2|llama [--size small|full]

For the first pair of each setting of experiments/run.py (different init, shared init; MiniLM's
fine-tunes of two domains) and each matching variant, from the paper's groups to the residual
stream permuted with them (`align(..., heads="permute", residual="permutation")`; for the
pre-norm models (ViT, GPT-2, Llama) also rotated, after folding the norm gains of both models,
GPT-2's tied LM head untied first (`rj.untie`: a rotation folds the final norm into the head)):
  distances    A to matched B per module kind, and the coordinate descent's distance per sweep;
  merges       every merge method of run.py but OT fusion with Sinkhorn (minutes per layer);
  barrier      the loss barrier on the linear path (MATH §7);
  seconds      of `align` (compiled).
Only models 0 and 1 of each setting are trained. Writes experiments/results/residual-<task>-<size>.json;
`experiments/write_results.py` renders it into experiments/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
import numpy as np
from run import SIZES, TASKS, VARIANTS, Pair, Run, Setting, result_header, task_arguments, untied

import rotsym_jax as rj
from rotsym_experiments.results_io import write_json
from rotsym_jax import barrier

PAIR_VARIANTS = ("no matching", "paper", "+ head perm.", "+ residual perm.")
# Pre-norm models: the same pair with every norm gain folded into the layers that read it, a tied
# LM head untied first (function-preserving, but a new point in weight space, so its unmatched
# merge is its own row)
FOLDED_VARIANTS = ("no matching", "+ residual rotation")
SKIPPED_METHODS = ("ot_weights_soft", "ot_activations_soft")


def folded(setting: Setting) -> Setting:
    """The setting with its LM head untied where tied, and every norm gain folded (same functions)."""
    untied_setting = untied(setting)
    fold = lambda params: rj.fold_norms(untied_setting.spec, params)  # noqa: E731
    name = f"{setting.name}, {'head untied, ' if untied_setting is not setting else ''}gains folded"
    return dataclasses.replace(untied_setting, name=name, models=[fold(m) for m in untied_setting.models],
                               base=None if untied_setting.base is None else fold(untied_setting.base))


def measure(run: Run, pair: Pair, variants, alphas) -> dict:
    s = run.setting
    primary_name, primary = next(iter(pair.evals.items()))
    a = s.models[pair.a]
    methods = {m: fn for m, fn in run.methods(pair).items() if m not in SKIPPED_METHODS}
    out = {}
    for v in variants:
        result = run.aligned(pair, v)
        b = run.b_params(pair, v)
        seconds = None
        if result is not None:  # the second call: compiled
            t0 = time.perf_counter()
            jax.block_until_ready(rj.align(a, s.models[pair.b], s.spec, **VARIANTS[v]).params)
            seconds = time.perf_counter() - t0
        curve = barrier.loss_barrier(s.loss_fn(primary), a, b, alphas, chunk=s.chunk)
        out[v] = {
            "options": VARIANTS[v],
            "distance": barrier.distance(a, b, s.spec),
            "distance_per_sweep": None if result is None else [float(x) for x in result.report.get("residual", {}).get("distance_per_sweep", [])],
            "merges": {m: {e: s.evaluate(fn(v), batch) for e, batch in pair.evals.items()} for m, fn in methods.items()},
            "barrier": curve["barrier"],
            "curve_loss": np.asarray(curve["curve"]["loss"]).tolist(),
            "align_seconds": seconds,
        }
        print(f"  [{s.name}] {v}: distance {out[v]['distance']['total']:.3f}, average {out[v]['merges']['average'][primary_name]['accuracy']:.1%}, "
              f"barrier {curve['barrier']:.3f}", flush=True)
    return out


def main(argv=None):
    args = task_arguments(__doc__.splitlines()[0], argv)
    size = SIZES[args.task][args.size]
    extra = size.extra
    if args.task == "minilm":  # one pair: the first two domains
        extra = {**extra, "domains": extra["domains"][:2]}
    size = dataclasses.replace(size, models=2, extra=extra)
    start = time.perf_counter()
    alphas = np.linspace(0, 1, size.alphas)
    results = result_header(args, size)
    for setting in TASKS[args.task](size, args.cache_dir):
        pair = setting.pairs[0]
        entry = {
            "individual": [{e: setting.evaluate(setting.models[i], b) for e, b in pair.evals.items()} for i in (pair.a, pair.b)],
            "evals": list(pair.evals),
            "variants": measure(Run(setting, size), pair, PAIR_VARIANTS, alphas),
        }
        if setting.spec.residual.placement == "pre":
            prepared = folded(setting)
            entry["untied"] = prepared.checkpoint is not setting.checkpoint
            entry["folded"] = measure(Run(prepared, size), pair, FOLDED_VARIANTS, alphas)
        results["settings"][setting.name] = entry
    results["seconds"] = time.perf_counter() - start
    write_json(results, Path(args.out_dir) / f"residual-{args.task}-{args.size}.json")


if __name__ == "__main__":
    main()
