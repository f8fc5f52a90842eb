"""The paper's experiments, reproduced on a CPU with models trained here.

    .venv/bin/python experiments/run.py --task vit|minilm|deberta|gpt2|llama|qwen3 [--size small|full]

Writes experiments/results/<task>-<size>.json and the figures beside it in <task>-<size>/*.png;
`experiments/write_results.py` turns every JSON there into experiments/RESULTS.md.

Each task has one or two settings (models trained from different random inits, and models trained
from one shared init; MiniLM and DeBERTa fine-tunes always share the pretrained init). In every setting, for
the pair (model 0, model 1), and for every pair of domains in the MiniLM and DeBERTa tasks:
  1. fusion    every merge method on the plain pair and with B matched to A (the paper's method:
               per-head rotations, sequential rescale, FFN permutations) -- Tables 1-2;
  2. ablation  average / Fisher / RegMean / OT fusion after each matching variant -- Fig. 3;
  3. distances between A and matched B per module kind for each variant -- Fig. 4;
  4. curves    loss along the linear path and the loss barrier (MATH §7) per variant, plus the
               2-D plane through A, B and matched B -- Fig. 5;
  5. layers    average-merge loss after matching attention in one layer only, or in the last k
               layers -- Fig. 6;
  6. runtime   matching and merging times (statistics included) -- Table 3;
and, with more than two models, merges of all of them with no alignment, all aligned to model 0,
and `align_many` (common reference).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

import rotsym_jax as rj
from rotsym_experiments import deberta, digits, seqtask, textcls
from rotsym_experiments.results_io import provenance, write_json
from rotsym_jax import barrier, merge, plots, stats
from rotsym_jax.pytree import fingerprint

RESULTS_DIR = Path(__file__).parent / "results"
DARE_KEY = 0

# Matching variants: name -> `align` options (None: B unmatched). The paper's method is "paper".
VARIANTS = {
    "no matching": None,
    "perm. attention": dict(attention="permutation", rescale="none"),  # a permutation-symmetry baseline
    "rotation": dict(rescale="none"),  # = the paper's "w/o rescaling"
    "paper": {},  # rotation + sequential rescale + FFN permutation
    "+ head perm.": dict(heads="permute"),
    "+ head perm. + joint rescale": dict(heads="permute", rescale="joint"),
    "w/o attention": dict(attention="none"),
    "w/o FFN": dict(ffn="none"),
    # beyond the paper (experiments/residual.py): the residual stream too, MATH.md §10
    "+ residual perm.": dict(heads="permute", residual="permutation"),
    "+ residual rotation": dict(heads="permute", residual="rotation"),  # RMSNorm models, gains folded
}
DISTANCE_VARIANTS = ("no matching", "perm. attention", "rotation", "paper", "+ head perm.", "+ head perm. + joint rescale")
ABLATION_VARIANTS = ("no matching", "paper", "w/o attention", "w/o FFN", "rotation", "+ head perm.", "+ head perm. + joint rescale")
ABLATION_METHODS = ("average", "fisher", "regmean", "ot_activations_hard")
CURVE_VARIANTS = ("no matching", "perm. attention", "w/o attention", "w/o FFN", "paper", "+ head perm. + joint rescale")
MATCHED = "paper"


@dataclasses.dataclass
class Pair:
    """Two models of a setting and the data the merged model is judged on: `evals` maps a name
    to a batch (the first one is the primary: curves, ablation and layers use it)."""

    a: int
    b: int
    evals: dict


@dataclasses.dataclass
class Setting:
    """Trained models sharing one architecture. `stat_batches[i]`: model i's own training data
    for its statistics (Fisher, Gram matrices, OT activations). `base`: the shared init, for the
    task-vector methods (None when the models do not share one). `evals`: judge the merge of all
    models (`many`). `chunk`: interpolation points evaluated at once (memory)."""

    name: str
    checkpoint: rj.Checkpoint
    models: list
    base: object
    stat_batches: list
    pairs: list
    evals: dict
    metrics: Callable
    training: list
    chunk: int | None = None
    skip: tuple = ()  # merge methods too slow for this setting
    pretraining: dict | None = None  # how the shared pretrained model was trained here (DeBERTa)
    broken: dict = dataclasses.field(default_factory=dict)  # {merge method: why the library cannot run it on this model}

    def __post_init__(self):
        self.spec = rj.spec_for(self.checkpoint)
        ck, metrics = self.checkpoint, self.metrics
        self._evaluate = jax.jit(lambda params, batch: metrics(ck, params, batch))

    def evaluate(self, params, batch) -> dict:
        return {k: float(v) for k, v in self._evaluate(params, batch).items()}

    def loss_fn(self, batch):
        return lambda params: self.metrics(self.checkpoint, params, batch)


def untied(setting: Setting) -> Setting:
    """The setting with a tied LM head untied in its checkpoint and every model (`rj.untie`: the
    same functions; the head then takes the final norm's gain, so the residual stream may rotate);
    the setting itself where nothing is tied."""
    checkpoint = rj.untie(setting.checkpoint)
    if checkpoint is setting.checkpoint:
        return setting
    untie = lambda params: rj.untie(dataclasses.replace(setting.checkpoint, params=params)).params  # noqa: E731
    return dataclasses.replace(setting, checkpoint=checkpoint, models=[untie(m) for m in setting.models],
                               base=None if setting.base is None else untie(setting.base))


@dataclasses.dataclass(frozen=True)
class Size:
    models: int
    stats_examples: int
    alphas: int
    plane_resolution: int
    extra: dict = dataclasses.field(default_factory=dict)


# ---- tasks: each returns its settings ---------------------------------------------------------

def vit_settings(sz: Size, cache_dir) -> list[Setting]:
    """ViTs on scikit-learn's digits (the paper's ViT/CIFAR-10 setting, scaled to the CPU)."""
    config = digits.vit_config(**sz.extra.get("config", {}))
    train_settings = dataclasses.replace(digits.TrainSettings(), **sz.extra.get("train", {}))
    n = sz.models
    data = digits.load_digits()
    examples = sz.stats_examples
    stat = [{"pixel_values": data.train_images[i : i + 64], "labels": data.train_labels[i : i + 64]} for i in range(0, examples, 64)]
    test = {"test": digits.test_batch(data)}
    out = []
    for name, init_seed in (("different init", None), ("shared init", 0)):
        trained = [digits.train_or_load(config, train_settings, s, data, cache_dir, init_seed=init_seed) for s in range(n)]
        base = digits.init_model(config, 0).params if init_seed is not None else None
        out.append(Setting(
            name, trained[0].checkpoint, [t.params for t in trained], base, [stat] * n, [Pair(0, 1, test)], test,
            digits.metrics, [_training(t) for t in trained],
        ))
    return out


def _batches(data: dict, examples: int, size: int) -> list[dict]:
    return [{k: v[i : i + size] for k, v in data.items()} for i in range(0, examples, size)]


def decoder_settings(family: str, sz: Size, cache_dir) -> list[Setting]:
    """GPT-2, Llama-style or Qwen3 (QK-norm) decoders on the synthetic order-2 Markov task (`rotsym_experiments.seqtask`)."""
    config = {"gpt2": seqtask.gpt2_config, "llama": seqtask.llama_config, "qwen3": seqtask.qwen3_config}[family]()
    data = seqtask.make_data()
    stat = _batches(data.train, sz.stats_examples, 32)
    test = {"test": {k: v[: sz.extra["test_sequences"]] for k, v in data.test.items()}}
    out = []
    for name, init_seed in (("different init", None), ("shared init", 0)):
        trained = [seqtask.train_or_load(config, seqtask.SETTINGS, s, data, cache_dir, init_seed=init_seed) for s in range(sz.models)]
        base = seqtask.init_model(config, 0).params if init_seed is not None else None
        out.append(Setting(
            name, trained[0].checkpoint, [t.params for t in trained], base, [stat] * sz.models, [Pair(0, 1, test)], test,
            seqtask.metrics, [_training(t) for t in trained], chunk=7,
        ))
    return out


def minilm_settings(sz: Size, cache_dir) -> list[Setting]:
    """The pretrained MiniLM fine-tuned on each domain of the generated sentiment task
    (`rotsym_experiments.textcls`), merged pairwise: the paper's Table 1 setting. A pair is judged on its
    two domains' test sentences (in-domain), on their held-out templates, and on the other
    domains (out-of-domain); the merge of all models on every domain."""
    return [_textcls_setting("fine-tuned from MiniLM", textcls.MINILM, sz, cache_dir)]


def deberta_settings(sz: Size, cache_dir) -> list[Setting]:
    """The MiniLM setting on the paper's own model family: a small DeBERTa-v3-style encoder,
    pretrained here by masked-language modelling on the task's training sentences
    (`rotsym_experiments.deberta`), fine-tuned on each domain by MiniLM's code, data and settings
    except the number of epochs (`deberta.FINETUNE_SETTINGS`: 20, not 3)."""
    pre = deberta.pretrain_or_load(cache_dir=cache_dir)
    setting = _textcls_setting("fine-tuned from DeBERTa", deberta.base(pre=pre), sz, cache_dir, deberta.FINETUNE_SETTINGS)
    setting.pretraining = {k: v for k, v in pre.info.items() if k != "path"} | {"recipe": pre.recipe}
    setting.broken = _layer_input_failure(setting)
    return [setting]


def _layer_input_failure(setting: Setting) -> dict:
    """{method: reason} for the methods that read every linear layer's inputs (RegMean's Gram
    matrices, OT fusion from activations) when the library's statistics fail on the setting's
    model; empty when they run. DeBERTa-v3's shared attention keys (share_att_key) call the query
    and key projections twice per forward pass (the tokens and the relative-position table), and
    `rotsym_jax.nets.layers.record_dense_inputs` expects one call per layer (a library bug,
    reported, not worked around here): those methods are left out and named in the results."""
    try:
        stats.grams(setting.checkpoint, setting.models[0], setting.stat_batches[0][:1])
    except ValueError as e:
        reason = f"rotsym_jax.stats.grams raises {type(e).__name__}: {e}"
        return {m: reason for m in ("regmean", "ot_activations_hard", "ot_activations_soft")}
    return {}


def _textcls_setting(name: str, pretrained: textcls.Base, sz: Size, cache_dir,
                     settings: textcls.TrainSettings = textcls.DEFAULT_SETTINGS) -> Setting:
    domains = sz.extra["domains"]
    tasks = textcls.load_tasks()  # the default generation: the cached fine-tunes were trained on it
    trained = [textcls.finetune_or_load(tasks, d, settings, cache_dir=cache_dir, base=pretrained) for d in domains]
    tests = {split: {d: {k: v[: sz.extra["test_per_domain"]] for k, v in tasks.data[split][d].items()} for d in domains} for split in ("test", "heldout")}

    def joined(split, names):
        parts = [tests[split][d] for d in names]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    pairs = []
    for i, j in itertools.combinations(range(len(domains)), 2):
        pair_domains = (domains[i], domains[j])
        others = [d for d in domains if d not in pair_domains]
        evals = {"in-domain": joined("test", pair_domains), "held-out templates": joined("heldout", pair_domains)}
        if others:
            evals["other domains"] = joined("test", others)
        pairs.append(Pair(i, j, evals))
    stat = [_batches(tasks.train[d], sz.stats_examples, 16) for d in domains]
    evals = {"in-domain": joined("test", domains), "held-out templates": joined("heldout", domains)}
    base = pretrained.model(len(textcls.LABELS), 0)
    return Setting(
        name, trained[0].checkpoint, [t.params for t in trained], base.params, stat, pairs, evals,
        textcls.metrics, [_training(t) | {"domain": t.domain} for t in trained], chunk=3,
        # Sinkhorn on 1536 x 1536 costs of near-identical fine-tunes runs for minutes per layer
        skip=("ot_weights_soft", "ot_activations_soft"),
    )


def _training(trained) -> dict:
    return {"seed": trained.seed, "seconds": trained.seconds, "from_cache": trained.from_cache}


TASKS = {
    "vit": vit_settings,
    "minilm": minilm_settings,
    "deberta": deberta_settings,
    "gpt2": lambda sz, cache_dir: decoder_settings("gpt2", sz, cache_dir),
    "llama": lambda sz, cache_dir: decoder_settings("llama", sz, cache_dir),
    "qwen3": lambda sz, cache_dir: decoder_settings("qwen3", sz, cache_dir),
}
_DECODER_SIZES = {
    "small": Size(models=2, stats_examples=64, alphas=11, plane_resolution=9, extra={"test_sequences": 256}),
    "full": Size(models=4, stats_examples=256, alphas=21, plane_resolution=21, extra={"test_sequences": 1024}),
}
SIZES = {
    "vit": {
        "small": Size(models=2, stats_examples=128, alphas=11, plane_resolution=9),  # the demo's ViT
        "full": Size(models=4, stats_examples=256, alphas=21, plane_resolution=21, extra={"config": dict(num_hidden_layers=6)}),
    },
    "minilm": {
        "small": Size(models=2, stats_examples=64, alphas=7, plane_resolution=7, extra={"domains": ("movies", "restaurants"), "test_per_domain": 100}),
        # three domains: three pairs, each judged on the third domain too
        "full": Size(models=3, stats_examples=128, alphas=11, plane_resolution=11, extra={"domains": ("movies", "restaurants", "electronics"), "test_per_domain": 300}),
    },
    # MiniLM's sizes on the DeBERTa pretrained here
    "deberta": {
        "small": Size(models=2, stats_examples=64, alphas=7, plane_resolution=7, extra={"domains": ("movies", "restaurants"), "test_per_domain": 100}),
        "full": Size(models=3, stats_examples=128, alphas=11, plane_resolution=11, extra={"domains": ("movies", "restaurants", "electronics"), "test_per_domain": 300}),
    },
    "gpt2": _DECODER_SIZES,
    "llama": _DECODER_SIZES,
    "qwen3": _DECODER_SIZES,
}


# ---- one setting ------------------------------------------------------------------------------

class Run:
    """Every experiment on one setting, with each alignment and each statistic computed once."""

    def __init__(self, setting: Setting, size: Size):
        self.setting, self.size = setting, size
        self._aligned, self._stats = {}, {}

    def aligned(self, pair: Pair, variant: str, **extra):
        """`align` of model b to model a with a variant's options (None for "no matching")."""
        key = (pair.a, pair.b, variant, tuple(sorted(extra.items())))
        if key not in self._aligned:
            options = VARIANTS[variant]
            a, b = self.setting.models[pair.a], self.setting.models[pair.b]
            self._aligned[key] = None if options is None else rj.align(a, b, self.setting.spec, **options, **extra)
        return self._aligned[key]

    def b_params(self, pair: Pair, variant: str, **extra):
        result = self.aligned(pair, variant, **extra)
        return self.setting.models[pair.b] if result is None else result.params

    # statistics of model i on its own data; B's follow (Gram) or are recomputed (Fisher) after matching
    def fisher(self, i: int, params) -> stats.Stats:
        key = ("fisher", i, fingerprint(params))
        if key not in self._stats:
            self._stats[key] = stats.fisher(self.setting.checkpoint, params, self.setting.stat_batches[i])
        return self._stats[key]

    def grams(self, pair: Pair, variant: str, which: str) -> stats.Stats:
        i = pair.a if which == "a" else pair.b
        if ("gram", i) not in self._stats:
            self._stats[("gram", i)] = stats.grams(self.setting.checkpoint, self.setting.models[i], self.setting.stat_batches[i])
        plain = self._stats[("gram", i)]
        if which == "a" or VARIANTS[variant] is None:
            return plain
        key = ("gram", pair.a, pair.b, variant)
        if key not in self._stats:
            self._stats[key] = stats.follow(plain, self.aligned(pair, variant))
        return self._stats[key]

    def methods(self, pair: Pair) -> dict:
        """{method: f(variant) -> merged params of (A, B matched with variant)}."""
        s = self.setting
        a = s.models[pair.a]
        both = s.stat_batches[pair.a] + s.stat_batches[pair.b]

        def via_registry(method, inputs=lambda b, variant: {}, **params):
            def run(variant):
                b = self.b_params(pair, variant)
                return merge.merge(method, [a, b], **inputs(b, variant), **params)

            return run

        methods = {
            "average": via_registry("average"),
            "fisher": via_registry("fisher", lambda b, v: {"fishers": [self.fisher(pair.a, a), self.fisher(pair.b, b)]}),
            "regmean": via_registry("regmean", lambda b, v: {"grams": [self.grams(pair, v, "a"), self.grams(pair, v, "b")]}, alpha=0.9),
            "slerp": via_registry("slerp", t=0.5),
        }
        for method in s.broken:
            methods.pop(method, None)
        if s.base is not None:  # task vectors need the shared init
            base = lambda b, v: {"base": s.base}
            methods.update({
                "task_arithmetic": via_registry("task_arithmetic", base, lam=0.5),
                "ties": via_registry("ties", base, density=0.2, lam=1.0),
                "dare": via_registry("dare", lambda b, v: {"base": s.base, "key": jax.random.key(DARE_KEY)}, drop=0.9, lam=0.5),
            })
        ot_inputs = lambda b, v: {"spec": s.spec, "checkpoint": s.checkpoint, "batches": both}
        for source in ("weights", "activations"):
            for transport in ("hard", "soft"):
                if f"ot_{source}_{transport}" not in s.skip and f"ot_{source}_{transport}" not in s.broken:
                    methods[f"ot_{source}_{transport}"] = via_registry("ot_fusion", ot_inputs, source=source, transport=transport)
        return methods

    def merged(self, pair: Pair, method: str, variant: str):
        return self.methods(pair)[method](variant)

    # ---- the experiments ----
    def fusion(self, pair: Pair) -> dict:
        rows = {}
        for method, fn in self.methods(pair).items():
            rows[method] = {
                "no matching": {e: self.setting.evaluate(fn("no matching"), batch) for e, batch in pair.evals.items()},
                "matching": {e: self.setting.evaluate(fn(MATCHED), batch) for e, batch in pair.evals.items()},
            }
        return rows

    def ablation(self, pair: Pair) -> dict:
        primary = next(iter(pair.evals.values()))
        methods = [m for m in ABLATION_METHODS if m not in self.setting.broken]
        return {
            variant: {m: self.setting.evaluate(self.merged(pair, m, variant), primary) for m in methods}
            for variant in ABLATION_VARIANTS
        }

    def distances(self, pair: Pair) -> dict:
        a = self.setting.models[pair.a]
        return {v: barrier.distance(a, self.b_params(pair, v), self.setting.spec) for v in DISTANCE_VARIANTS}

    def curves(self, pair: Pair) -> dict:
        batch = next(iter(pair.evals.values()))
        alphas = np.linspace(0, 1, self.size.alphas)
        a = self.setting.models[pair.a]
        out = {}
        for v in CURVE_VARIANTS:
            result = barrier.loss_barrier(self.setting.loss_fn(batch), a, self.b_params(pair, v), alphas, chunk=self.setting.chunk)
            out[v] = {"barrier": result["barrier"], "alpha_max": result["alpha_max"], "curve": _lists(result["curve"])}
        return out

    def plane(self, pair: Pair) -> dict:
        batch = next(iter(pair.evals.values()))
        s = self.setting
        result = barrier.plane(
            s.loss_fn(batch), s.models[pair.a], s.models[pair.b], self.b_params(pair, MATCHED),
            resolution=self.size.plane_resolution, chunk=s.chunk,
        )
        return _lists(result)

    def layers(self, pair: Pair) -> dict:
        """Attention matching (rotation + rescale, no FFN) in a subset of layers, as the paper's Fig. 6;
        judged by the average merge on the primary eval."""
        batch = next(iter(pair.evals.values()))
        n_layers = len(self.setting.models[pair.a]["layers"])
        a = self.setting.models[pair.a]

        def merged_metrics(layers):
            b = self.b_params(pair, "w/o FFN", layers=tuple(layers))
            return self.setting.evaluate(merge.average([a, b]), batch)

        return {
            "layers": n_layers,
            "none": self.setting.evaluate(merge.average([a, self.setting.models[pair.b]]), batch),
            "single": [merged_metrics([i]) for i in range(n_layers)],
            "tail": [merged_metrics(range(n_layers - k, n_layers)) for k in range(1, n_layers + 1)],
        }

    def runtime(self, pair: Pair) -> dict:
        """Seconds per matching variant (compiled) and per merge method (with its statistics,
        computed afresh, on the plain pair; second call, compiled)."""
        a, b = self.setting.models[pair.a], self.setting.models[pair.b]
        matching = {}
        for v in ABLATION_VARIANTS:
            if VARIANTS[v] is not None:
                self.aligned(pair, v)  # compiled
                t0 = time.perf_counter()
                jax.block_until_ready(rj.align(a, b, self.setting.spec, **VARIANTS[v]).params)
                matching[v] = time.perf_counter() - t0
        merging = {}
        for method, fn in self.methods(pair).items():
            jax.block_until_ready(fn("no matching"))  # compile
            self._stats.clear()  # statistics count as merging time
            t0 = time.perf_counter()
            jax.block_until_ready(fn("no matching"))
            merging[method] = time.perf_counter() - t0
        return {"matching": matching, "merging": merging}

    def many(self) -> dict:
        s = self.setting
        ps = s.models
        variants = {"no matching": ps}
        info = {}
        anchored = [ps[0]] + [rj.align(ps[0], p, s.spec).params for p in ps[1:]]
        variants["all to model 0"] = anchored
        t0 = time.perf_counter()
        result = rj.align_many(ps, s.spec, mode="mean")
        info["align_many_seconds"] = time.perf_counter() - t0
        info["align_many_objective"] = [float(x) for x in result.objective]
        variants["align_many"] = result.params
        out = {}
        for name, params in variants.items():
            fishers = [stats.fisher(s.checkpoint, p, b) for p, b in zip(params, s.stat_batches)]
            merged = {
                "average": merge.average(params),
                "fisher": merge.fisher(params, fishers),
            }
            if "regmean" not in s.broken:
                grams = [stats.grams(s.checkpoint, p, b) for p, b in zip(params, s.stat_batches)]
                merged["regmean"] = merge.regmean(params, grams, alpha=0.9)
            out[name] = {m: {e: s.evaluate(p, batch) for e, batch in s.evals.items()} for m, p in merged.items()}
        return {"rows": out, **info}


def _lists(tree):
    return {k: (np.asarray(v).tolist() if not isinstance(v, (int, float)) else v) for k, v in tree.items()}


def _mean_rows(per_pair: list[dict]) -> dict:
    """The fusion tables of several pairs averaged entry by entry (the paper's pairwise mean)."""
    def mean(xs):
        if isinstance(xs[0], dict):
            return {k: mean([x[k] for x in xs]) for k in xs[0]}
        return float(np.mean(xs))
    return mean(per_pair)


def run_setting(setting: Setting, size: Size, figures: Path, log=print) -> dict:
    run = Run(setting, size)
    first = setting.pairs[0]
    t0 = time.perf_counter()
    out = {
        "models": len(setting.models),
        "skipped_methods": list(setting.skip),
        **({"broken_methods": setting.broken} if setting.broken else {}),
        "training": setting.training,
        **({"pretraining": setting.pretraining} if setting.pretraining is not None else {}),
        "individual": [{e: setting.evaluate(p, b) for e, b in setting.evals.items()} for p in setting.models],
    }
    log(f"  [{setting.name}] individual models done ({time.perf_counter() - t0:.0f} s)")
    pairs = []
    for pair in setting.pairs:
        pairs.append({"models": [pair.a, pair.b], "evals": list(pair.evals), "fusion": run.fusion(pair)})
        log(f"  [{setting.name}] fusion of pair {pair.a},{pair.b} done ({time.perf_counter() - t0:.0f} s)")
    out["pairs"] = pairs
    out["fusion"] = _mean_rows([p["fusion"] for p in pairs])
    for name in ("ablation", "distances", "curves", "plane", "layers", "runtime"):
        out[name] = getattr(run, name)(first)
        log(f"  [{setting.name}] {name} done ({time.perf_counter() - t0:.0f} s)")
    if len(setting.models) > 2:
        out["many"] = run.many()
        log(f"  [{setting.name}] many done ({time.perf_counter() - t0:.0f} s)")
    out["figures"] = draw(out, setting.name, figures, setting.name.replace(" ", "-"))
    return out


# ---- figures ----------------------------------------------------------------------------------

def draw(result: dict, title: str, folder: Path, tag: str) -> dict:
    """PNG figures of one setting in `folder`; returns {figure: path relative to folder's parent}."""
    paths = {}
    primary = result["pairs"][0]["evals"][0]

    def path(name):
        p = folder / f"{tag}-{name}.png"
        paths[name] = f"{folder.name}/{p.name}"
        return p

    plots.bars(
        {m: {k: row[k][primary]["accuracy"] for k in row} for m, row in result["fusion"].items()},
        path=path("fusion"), ylabel=f"{primary} accuracy", percent=True, title=f"{title}: merge methods",
    )
    plots.bars(
        {m: {v: result["ablation"][v][m]["accuracy"] for v in result["ablation"]} for m in next(iter(result["ablation"].values()))},
        path=path("ablation"), ylabel=f"{primary} accuracy", percent=True, title=f"{title}: ablation",
    )
    kinds = [k for k in result["distances"]["no matching"] if k != "total"] + ["total"]
    plots.bars(
        {k: {v: d[k] for v, d in result["distances"].items()} for k in kinds},
        path=path("distances"), ylabel="Euclidean distance to A", title=f"{title}: distances",
    )
    plots.curves(result["curves"], path=path("curves"), title=f"{title}: linear interpolation ({primary} loss)")
    plots.contour(result["plane"], labels=("A", "B", "B matched"), path=path("plane"), title=f"{title}: plane through A, B, matched B")
    layers = result["layers"]
    xs = np.arange(1, layers["layers"] + 1)
    plots.lines(
        xs,
        {
            "match layer k only": [m["loss"] for m in layers["single"]],
            "match the last k layers": [m["loss"] for m in layers["tail"]],
            "no matching": [layers["none"]["loss"]] * len(xs),
        },
        path=path("layers"), xlabel="k", ylabel=f"average-merge {primary} loss", title=f"{title}: attention matching in a subset of layers",
    )
    return paths


def redraw(folder: Path = RESULTS_DIR) -> list[Path]:
    """Every setting's figures drawn again from its committed JSON (no model trained), as `draw`
    now draws them: the figures the plots module's fixes change, without re-running an experiment."""
    written = []
    for source in sorted(folder.glob("*-full.json")):
        r = json.loads(source.read_text())
        for name, setting in r.get("settings", {}).items():
            if isinstance(setting, dict) and setting.get("figures") and set(setting["figures"]) == {"fusion", "ablation", "distances", "curves", "plane", "layers"}:
                paths = draw(setting, name, folder / source.stem, name.replace(" ", "-"))
                assert paths == setting["figures"], (source.name, name)  # the same files the JSON names
                written += [folder / p for p in paths.values()]
    return written


# ---- main -------------------------------------------------------------------------------------

def task_arguments(description: str, argv=None) -> argparse.Namespace:
    """--task, --size, --cache-dir, --out-dir: the command line of run.py and residual.py."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--task", required=True, choices=sorted(TASKS))
    parser.add_argument("--size", default="small", choices=("small", "full"))
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    return parser.parse_args(argv)


def result_header(args: argparse.Namespace, size: Size) -> dict:
    """What a result JSON says of its origin (commit, command, machine) and of its run."""
    return {
        **provenance(),
        "task": args.task,
        "size": args.size,
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "jax": jax.__version__, "cpus": os.cpu_count(), "device": jax.devices()[0].device_kind},
        "size_config": dataclasses.asdict(size),
        "settings": {},
    }


def main(argv=None):
    args = task_arguments(__doc__.splitlines()[0], argv)
    size = SIZES[args.task][args.size]
    out_dir = Path(args.out_dir)
    stem = f"{args.task}-{args.size}"
    start = time.perf_counter()
    print(f"{stem}: loading or training the models")
    settings = TASKS[args.task](size, args.cache_dir)
    results = result_header(args, size)
    for setting in settings:
        results["settings"][setting.name] = run_setting(setting, size, out_dir / stem)
        summarise(setting.name, results["settings"][setting.name])
    results["seconds"] = time.perf_counter() - start
    write_json(results, out_dir / f"{stem}.json")


def summarise(name: str, r: dict):
    primary = r["pairs"][0]["evals"][0]
    print(f"\n== {name}: individual {primary} accuracy " + ", ".join(f"{m[primary]['accuracy']:.1%}" for m in r["individual"]))
    print(f"{'method':24s} {'no matching':>12s} {'matching':>9s}")
    for method, row in r["fusion"].items():
        print(f"{method:24s} {row['no matching'][primary]['accuracy']:12.1%} {row['matching'][primary]['accuracy']:9.1%}")
    print(f"{'variant':30s} {'distance':>9s} {'barrier':>9s}")
    for v in VARIANTS:
        d = r["distances"].get(v, {}).get("total")
        b = r["curves"].get(v, {}).get("barrier")
        print(f"{v:30s} {'' if d is None else f'{d:9.3f}'} {'' if b is None else f'{b:9.3f}'}")


if __name__ == "__main__":
    main()
