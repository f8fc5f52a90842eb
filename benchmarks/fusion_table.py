"""Fusion table on the digits ViTs: every merge method, with and without alignment.

    .venv/bin/python benchmarks/fusion_table.py [--models 4] [--epochs 30] [--stats-examples 256]

Two settings, each with `--models` ViTs (trained here, cached under .cache/rotsym_jax):
  different-init  seeds 0..N-1, each from its own random init (the paper's ViT setting);
  shared-init     one init (seed 0), trained with N different data orders (like fine-tunes of one
                  pretrained model; the init is the base of the task-vector methods).
For the pair (model 0, model 1), every method's test accuracy on the plain pair and on the pair
with model 1 aligned to model 0 (rotations + sequential rescale + FFN permutations, the paper's
method); for all N models, average / Fisher / RegMean with no alignment, all aligned to model 0,
and `align_many` (common reference). Statistics (Fisher, Gram matrices) come from the first
`--stats-examples` training images; after alignment the Fisher is recomputed on the aligned
params and the Grams follow the alignment (`stats.follow`). Prints tables and writes
benchmarks/results/fusion_table.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time
from pathlib import Path

import jax
import numpy as np

import rotsym_jax as rj
from results_io import write_json
from rotsym_jax import digits, merge, stats
from rotsym_jax import align_many
from rotsym_jax.otfusion import ot_fuse

DARE_KEY = 0


def batches(data: digits.Digits, examples: int, size: int = 64):
    x, y = data.train_images[:examples], data.train_labels[:examples]
    return [{"pixel_values": x[i : i + size], "labels": y[i : i + size]} for i in range(0, len(x), size)]


class Setting:
    """N trained models of one setting, their statistics, and the methods to evaluate."""

    def __init__(self, name, models, base, ck, data, stat_batches):
        self.name, self.models, self.base, self.ck, self.data = name, models, base, ck, data
        self.stat_batches = stat_batches
        self.spec = rj.spec_for(ck)

    def accuracy(self, params):
        return digits.accuracy(self.ck, params, self.data.test_images, self.data.test_labels)

    def fisher(self, params):
        return stats.fisher(self.ck, params, self.stat_batches)

    def grams(self, params):
        return stats.grams(self.ck, params, self.stat_batches)

    def pair_methods(self):
        """{method: f(params_list, grams_list) -> merged}; statistics passed in so that the
        aligned variant can hand over Grams that followed the alignment."""
        n = 2
        methods = {
            "average": lambda ps, gs: merge.average(ps),
            "fisher": lambda ps, gs: merge.fisher(ps, [self.fisher(p) for p in ps]),
            "regmean": lambda ps, gs: merge.regmean(ps, gs, alpha=0.9),
            "slerp": lambda ps, gs: merge.slerp(ps[0], ps[1], 0.5),
        }
        if self.base is not None:  # task vectors need a shared starting point
            methods.update({
                "task_arithmetic": lambda ps, gs: merge.task_arithmetic(self.base, ps, lam=1.0 / n),
                "ties": lambda ps, gs: merge.ties(self.base, ps, density=0.2, lam=1.0),
                "dare+task_arithmetic": lambda ps, gs: merge.dare(self.base, ps, jax.random.key(DARE_KEY), drop=0.9, lam=1.0 / n),
            })
        return methods


def pair_table(setting: Setting) -> dict:
    a, b = setting.models[0], setting.models[1]
    grams_a, grams_b = setting.grams(a), setting.grams(b)
    t0 = time.perf_counter()
    result = rj.align(a, b, setting.spec)
    align_s = time.perf_counter() - t0
    grams_b_aligned = stats.follow(grams_b, setting.spec, b, result)
    rows = {}
    for name, method in setting.pair_methods().items():
        t0 = time.perf_counter()
        plain = setting.accuracy(method([a, b], [grams_a, grams_b]))
        merge_s = time.perf_counter() - t0
        aligned = setting.accuracy(method([a, result.params], [grams_a, grams_b_aligned]))
        rows[name] = {"plain": plain, "aligned": aligned, "merge_s": merge_s}
    for source in ("weights", "activations"):
        for transport in ("hard", "soft"):
            t0 = time.perf_counter()
            fused = ot_fuse(
                [a, b], setting.spec, source=source, transport=transport,
                checkpoint=setting.ck, batches=setting.stat_batches,
            ).params
            rows[f"ot_{source}_{transport}"] = {"plain": setting.accuracy(fused), "aligned": None, "merge_s": time.perf_counter() - t0}
    return {"rows": rows, "align_s": align_s, "distance": {"before": result.report["before"], "after": result.report["after"]}}


def many_table(setting: Setting) -> dict:
    ps = setting.models
    out = {}
    variants = {"plain": (ps, None)}
    for mode in ("anchor", "mean"):
        t0 = time.perf_counter()
        result = align_many(ps, setting.spec, mode=mode)
        variants[f"align_many_{mode}"] = (result.params, {"objective": [float(v) for v in result.objective], "seconds": time.perf_counter() - t0})
    for variant, (params, info) in variants.items():
        grams = [setting.grams(p) for p in params]
        out[variant] = {
            "average": setting.accuracy(merge.average(params)),
            "fisher": setting.accuracy(merge.fisher(params, [setting.fisher(p) for p in params])),
            "regmean": setting.accuracy(merge.regmean(params, grams, alpha=0.9)),
            **({"info": info} if info else {}),
        }
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=digits.TrainSettings().epochs)
    parser.add_argument("--stats-examples", type=int, default=256)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fusion_table.json"))
    args = parser.parse_args(argv)
    if args.models < 2:
        parser.error("--models must be at least 2")

    data = digits.load_digits()
    config = digits.vit_config()
    settings = dataclasses.replace(digits.TrainSettings(), epochs=args.epochs)
    stat_batches = batches(data, args.stats_examples)
    results = {
        "machine": {"platform": platform.platform(), "jax": jax.__version__},
        "config": {"models": args.models, "epochs": args.epochs, "stats_examples": args.stats_examples},
        "settings": {},
    }
    for name, init_seed in (("different-init", None), ("shared-init", 0)):
        trained = [digits.train_or_load(config, settings, s, data, args.cache_dir, init_seed=init_seed) for s in range(args.models)]
        ck = trained[0].checkpoint
        base = digits.init_model(config, 0).params if init_seed is not None else None
        setting = Setting(name, [t.params for t in trained], base, ck, data, stat_batches)
        individual = [setting.accuracy(p) for p in setting.models]
        pair = pair_table(setting)
        many = many_table(setting)
        results["settings"][name] = {"individual": individual, "pair": pair, "many": many}

        print(f"\n== {name}: individual test accuracy " + ", ".join(f"{x:.1%}" for x in individual))
        d0, d1 = pair["distance"]["before"]["total"], pair["distance"]["after"]["total"]
        print(f"pair (0, 1): distance {d0:.2f} -> {d1:.2f} after alignment ({pair['align_s']:.2f} s)")
        print(f"{'method':24s} {'no matching':>12s} {'matching':>9s}")
        for method, row in pair["rows"].items():
            aligned = "-" if row["aligned"] is None else f"{row['aligned']:.1%}"
            print(f"{method:24s} {row['plain']:12.1%} {aligned:>9s}")
        print(f"\nall {args.models} models:")
        print(f"{'alignment':22s} {'average':>8s} {'fisher':>8s} {'regmean':>8s}   objective")
        for variant, row in many.items():
            objective = row.get("info", {}).get("objective")
            obj = "" if objective is None else " -> ".join(f"{v:.1f}" for v in (objective[0], objective[-1]))
            print(f"{variant:22s} {row['average']:8.1%} {row['fisher']:8.1%} {row['regmean']:8.1%}   {obj}")

    write_json(results, args.out)


if __name__ == "__main__":
    main()
