"""`rotsym demo`: two small ViTs trained on digits from different seeds (`digits`), aligned by
weights, by activations and learned, then averaged and Fisher-merged, their accuracies and
distances printed with what this run measured. The command line checks the arguments and calls
`run`; everything trained, aligned and merged is here, on rotsym_jax's public API.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

import rotsym_jax as rj
from rotsym_experiments import digits


def run(seeds: tuple[int, int], epochs: int | None, steps: int, cache_dir=None, start: float | None = None) -> None:
    """The demo for `seeds` (two that differ), `epochs` of training (None: `TrainSettings`'),
    `steps` of learned alignment, the trained models cached under `cache_dir`; prints its
    tables and story, and the seconds since `start` (default: now)."""
    start = time.perf_counter() if start is None else start
    data = digits.load_digits()
    config = digits.vit_config()
    settings = digits.TrainSettings()
    if epochs is not None:
        settings = dataclasses.replace(settings, epochs=epochs)
    print(
        f"digits: {len(data.train_labels)} train / {len(data.test_labels)} test images, 8x8, 10 classes\n"
        f"ViT: d={config.hidden_size}, {config.num_attention_heads} heads, {config.num_hidden_layers} layers, "
        f"mlp {config.intermediate_size}, patch {config.patch_size}; {settings.epochs} epochs of AdamW\n"
        f"cache: {digits.cache_root(cache_dir).absolute() / 'digits'}\n"
    )
    models = [digits.train_or_load(config, settings, s, data, cache_dir) for s in seeds]

    def score(checkpoint, params):
        return digits.accuracy(checkpoint, params, data.test_images, data.test_labels)

    rows = [
        (f"seed {m.seed}", score(m.checkpoint, m.params), "cache" if m.from_cache else "trained", m.seconds)
        for m in models
    ]
    anchor, other = models[0].params, models[1].params
    rows.append(("plain average", score(models[0].checkpoint, _average(anchor, other)), "", None))
    ck = models[0].checkpoint
    batches = [{"pixel_values": data.train_images[i : i + 64], "labels": data.train_labels[i : i + 64]} for i in range(0, 1024, 64)]
    results = _alignments(ck, anchor, other, batches, steps)
    for name, start_a, result in results:
        rows.append((f"avg, {name}", score(ck, _average(start_a, result.params)), "", result.report["timings"]["total"]))
    rows += _fisher_rows(ck, score, batches, anchor, other, results)
    moved_acc = [score(models[1].checkpoint, r.params) for _, _, r in results]
    _print_tables(rows, moved_acc, seeds, {name: result for name, _, result in results})
    print(_story(rows, results[2][2]))
    print(f"\ntotal {time.perf_counter() - start:.1f} s")


def _average(a, b):
    # Leaf-wise mean (in NumPy: eager JAX would compile one kernel per leaf shape, for a one-off sum).
    return jax.tree.map(lambda x, y: (np.asarray(x) + np.asarray(y)) / 2, a, b)


def _alignments(ck, anchor, other, batches: list, steps: int) -> tuple:
    """(name, the anchor as the moved model is compared with, result) of each alignment.
    The paper's matching (per-head rotations, rescaling, FFN permutations); then, beyond the paper,
    head permutations and the residual stream rotated too (the norm gains folded first: the same
    functions, MATH.md §10); the same groups matched on the models' activations on training images;
    and every transform learned on the merged model's loss (MATH.md §12), from those activations."""
    spec = rj.spec_for(ck)
    anchor_f, other_f = rj.fold_norms(spec, anchor), rj.fold_norms(spec, other)
    data_options = dict(data=batches, checkpoint=ck, heads="permute", residual="rotation")
    paper = rj.align(anchor, other, spec, attention="rotation", rescale="sequential", ffn="permutation")
    residual = rj.align(anchor_f, other_f, spec, heads="permute", residual="rotation")
    activations = rj.align(anchor_f, other_f, spec, method="activations", **data_options)
    learned = rj.align(anchor_f, other_f, spec, method="learned", steps=steps, key=jax.random.key(0), **data_options)
    return (("paper's matching", anchor, paper), ("+ residual rotation", anchor_f, residual), ("activations", anchor_f, activations),
            ("learned", anchor_f, learned))


def _fisher_rows(ck, score, batches: list, anchor, other, results) -> list:
    """Fisher merging weighs each weight by how much each model's training loss depends on it: the
    diagonal Fisher on 128 training images, computed on each model as it is merged."""
    paper, learned = results[0][2], results[3][2]
    anchor_f = results[3][1]
    fisher_of = lambda params: rj.stats.fisher(ck, params, batches[:2])  # noqa: E731
    rows = []
    for name, start_a, moved in (("no matching", anchor, other), ("paper's matching", anchor, paper.params), ("learned", anchor_f, learned.params)):
        t0 = time.perf_counter()
        merged = rj.merge.fisher([start_a, moved], [fisher_of(start_a), fisher_of(moved)], task_head="merge")
        rows.append((f"fisher, {name}", score(ck, merged), "", time.perf_counter() - t0))
    return rows


def _print_tables(rows: list, moved_acc: list, seeds, results: dict) -> None:
    print(f"{'model':<26}{'test acc':>9}  {'source':<8}{'time':>8}")
    for name, acc, source, seconds in rows:
        print(f"{name:<26}{acc:>9.1%}  {source:<8}{'' if seconds is None else f'{seconds:.1f} s':>8}")
    print(f"\nseed {seeds[1]} aligned to seed {seeds[0]}; its accuracy after each alignment: "
          f"{', '.join(f'{a:.1%}' for a in moved_acc)} (function unchanged). Distances to seed {seeds[0]}:")
    kinds = ("qk", "vo", "ffn", "other", "total")
    print(f"{'':<26}" + "".join(f"{k:>9}" for k in kinds))
    paper, residual = results["paper's matching"], results["+ residual rotation"]
    for label, d in (("before", paper.report["before"]), ("after the paper's matching", paper.report["after"]),
                     ("before, gains folded", residual.report["before"]), ("after + residual rotation", residual.report["after"]),
                     ("after activations", results["activations"].report["after"]), ("after learned", results["learned"].report["after"])):
        print(f"{label:<26}" + "".join(f"{d[k]:>9.2f}" for k in kinds))


def _story(rows: list, activations) -> str:
    """What this run measured, not a fixed story (activation matching keeps weight matching's
    result where that merges better: engine/choice.py)."""
    acc = {name: a for name, a, _, _ in rows}
    if activations.report.get("chosen", {}).get("method", "activations") != "activations":
        here = "here no better on the merged model than weight matching's, whose result it kept"
    else:
        here = "here better" if acc["avg, activations"] > acc["avg, + residual rotation"] else "here worse"
    fisher_best = max(a for name, a in acc.items() if name.startswith("fisher"))
    than_fisher = "better than any Fisher merge here" if acc["avg, learned"] > fisher_best else "Fisher merges come close here"
    return (
        "\nThese two models start from different random initialisations, so their residual streams\n"
        "(embeddings, norms, the 'other' distance) live in unrelated bases. The paper's matching\n"
        "(per-head rotations, rescaling, FFN permutations) never touches them: the attention and FFN\n"
        "weights come closer, but the average stays near chance. Rotating the residual stream as well\n"
        "(its norm gains folded first: the same functions) closes much of the gap. Matching the\n"
        "models' activations on training images instead of their weights lands elsewhere, not always\n"
        f"better ({here};\non six-layer pairs better: experiments/RESULTS.md). Learning every\n"
        "transform on the merged model's loss, each kept exactly in its symmetry group so that seed 1\n"
        "computes what it did, puts the two in one basin: their plain average is about as good as\n"
        f"either model ({than_fisher}), at a larger distance than the weight\n"
        "matchings reach: what a merge needs is not the nearest weights. Models that share their\n"
        "residual stream, such as fine-tunes of one pretrained model (the paper's setting), need none\n"
        "of this: their plain average already works."
    )
