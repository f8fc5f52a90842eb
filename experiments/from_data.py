"""Alignment from data (issue 34): weight matching against activation matching and learned
transforms, on the experiments' pairs, and the barrier against model width.

    .venv/bin/python experiments/from_data.py --task vit|gpt2|llama|qwen3 [--size small|full]
    .venv/bin/python experiments/from_data.py --task vit|gpt2|llama|qwen3 --widths 64,128 [--size full]   # the width sweep
    .venv/bin/python experiments/from_data.py --task vit|gpt2|llama|qwen3 --widths 128 --init shared [--size full]   # of shared-init pairs
    .venv/bin/python experiments/from_data.py --task vit|gpt2|llama|qwen3 --budget [--size full]   # learned: steps and rates
    .venv/bin/python experiments/from_data.py --task vit|gpt2|llama|qwen3 --defaults [--size full]   # the data methods' defaults

For the pair (model 0, model 1) of each setting of experiments/run.py (different init, shared
init) and each variant below: the loss barrier on the linear path from A to B as aligned (MATH §7)
and the accuracy of the plain average, both on the test set (which no alignment sees); the
seconds `align` took. Matching data: the first examples of the training set; `learned` holds out
the last quarter of them for early stopping. Pre-norm models are aligned with their norm gains
folded (`rj.fold_norms`, the same functions), so that the residual stream may rotate; GPT-2's
tied LM head is untied first (`rj.untie`), so that its final norm folds into it.

Variants:
    no matching        B as trained
    weights (paper)    the paper's closed forms on the weights
    weights + residual + head permutations and the residual stream (coordinate descent)
    weights + residual, invertible maps   the same with the Q/K and V/O maps invertible (MATH §14: the distance descended)
    activations        the same groups matched on the models' activations (closed forms)
    learned            from activations, every transform trained on the merged model's loss
    learned, invertible maps   the same with the Q/K and V/O maps invertible (MATH §14), not only orthogonal

Writes experiments/results/from-data-<task>-<size>.json (or from-data-width-<task>-<size>.json and
its figure, from-data-width-shared-<task>-<size>.json for shared-init pairs, from-data-budget-<task>-<size>.json,
from-data-defaults-<task>-<size>.json);
`experiments/write_results.py` renders them into experiments/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np
from run import RESULTS_DIR, SIZES, TASKS, Pair, Setting, _training, result_header, untied

import rotsym_jax as rj
from rotsym_experiments import digits, seqtask
from rotsym_experiments.results_io import write_json
from rotsym_jax import barrier

VARIANTS = ("no matching", "weights (paper)", "weights + residual", "weights + residual, invertible maps", "activations", "learned",
            "learned, invertible maps")
# Examples the data methods see (the first of the training set), per task.
MATCHING_EXAMPLES = {"vit": 1024, "gpt2": 512, "llama": 512, "qwen3": 512}
# Each method measured as itself (no fallback to the identity or another start), learning from
# activation matching as when RESULTS.md was written.
LEARNED = dict(steps=300, learning_rate=1e-3, key=jax.random.key(0), init="activations")


def residual_mode(setting) -> str:
    """A rotation of the residual stream where the model's norms allow it (MATH §8; a tied head untied)."""
    return "permutation" if rj.spec_for(setting.checkpoint).residual.placement == "post" else "rotation"


def matching_batches(task: str) -> list[dict]:
    """The first training examples, in batches (with labels, for the learned task loss): what
    the data methods run on. The test set, which the barriers are measured on, is never among them."""
    if task == "vit":
        data = digits.load_digits()
        rows, size = {"pixel_values": data.train_images, "labels": data.train_labels}, 64
    else:
        rows, size = seqtask.make_data().train, 32
    n = MATCHING_EXAMPLES[task]
    return [{k: np.asarray(v[i : i + size]) for k, v in rows.items()} for i in range(0, n, size)]


def variant_options(mode: str, data: dict) -> dict:
    """{variant: rj.align's options (None: B as trained)} of VARIANTS."""
    return {
        "no matching": None,
        "weights (paper)": dict(fallback=False),
        "weights + residual": dict(heads="permute", residual=mode, fallback=False),
        "weights + residual, invertible maps": dict(heads="permute", residual=mode, fallback=False, maps="invertible"),
        "activations": dict(heads="permute", residual=mode, method="activations", fallback=False, **data),
        "learned": dict(heads="permute", residual=mode, method="learned", fallback=False, **data, **LEARNED),
        "learned, invertible maps": dict(heads="permute", residual=mode, method="learned", fallback=False, maps="invertible", **data, **LEARNED),
    }


# The learned method's budget (steps, learning rate), the maps orthogonal or invertible: does the barrier flatten?
BUDGETS = ((300, 1e-3, "orthogonal"), (300, 1e-2, "orthogonal"), (1000, 3e-3, "orthogonal"), (3000, 3e-3, "orthogonal"),
           (1000, 3e-3, "invertible"))


def budget_options(mode: str, data: dict) -> dict:
    learned = dict(heads="permute", residual=mode, method="learned", fallback=False, **data, **LEARNED)
    return {"no matching": None, **{f"learned, {steps} steps at {rate:g}, {maps} maps": {**learned, "steps": steps, "learning_rate": rate, "maps": maps}
                                    for steps, rate, maps in BUDGETS}}


# A gated FFN's unit scales (issue 71): each method with ffn="permutation" and with ffn="scaled".
SCALED = (("weights + residual", {}), ("activations", dict(method="activations")), ("learned", dict(method="learned", **LEARNED)),
          ("learned, 1000 steps at 0.003, invertible maps", dict(method="learned", **{**LEARNED, "steps": 1000, "learning_rate": 3e-3},
                                                                  maps="invertible")))


def scale_options(mode: str, data: dict) -> dict:
    base = dict(heads="permute", residual=mode, fallback=False)
    return {"no matching": None, **{f"{name}{suffix}": {**base, **kw, **(data if "method" in kw else {}), "ffn": ffn}
                                    for name, kw in SCALED for suffix, ffn in (("", "permutation"), (", unit scales", "scaled"))}}


# The data methods' defaults (issue 72): what a user got with no options before (BEFORE pins those
# defaults), each group added to it, and what the defaults give now (only the method named).
# "as given": the models as trained (a tied head tied, norm gains unfolded: what `rj.align` is
# handed); "gains folded": untied and folded first, as `rotsym align` does for a rotation.
BEFORE = dict(residual="none", maps="orthogonal", heads="fixed", steps=300, learning_rate=1e-3, patience=0)
STUDY = (
    ("learned, defaults before", "as given", dict(method="learned", **BEFORE)),
    ("learned + residual permutation", "as given", dict(method="learned", **{**BEFORE, "residual": "permutation"})),
    ("learned + residual permutation + head permutations", "as given",
     dict(method="learned", **{**BEFORE, "residual": "permutation", "heads": "permute"})),
    ("learned + residual permutation, invertible maps", "as given", dict(method="learned", **{**BEFORE, "residual": "permutation", "maps": "invertible"})),
    ("learned, defaults now (as given)", "as given", dict(method="learned")),
    ("activations, defaults before", "as given", dict(method="activations", residual="none")),
    ("activations + residual permutation", "as given", dict(method="activations", residual="permutation")),
    ("activations, defaults now (as given)", "as given", dict(method="activations")),
    ("learned + residual rotation", "gains folded", dict(method="learned", **{**BEFORE, "residual": "rotation"})),
    ("learned + residual rotation + head permutations", "gains folded",
     dict(method="learned", **{**BEFORE, "residual": "rotation", "heads": "permute"})),
    ("learned + residual rotation, invertible maps", "gains folded", dict(method="learned", **{**BEFORE, "residual": "rotation", "maps": "invertible"})),
    ("learned + residual rotation, invertible maps, 1000 steps at 3e-3", "gains folded",
     dict(method="learned", **{**BEFORE, "residual": "rotation", "maps": "invertible", "steps": 1000, "learning_rate": 3e-3})),
    ("learned, defaults now (gains folded)", "gains folded", dict(method="learned")),
    ("activations + residual rotation", "gains folded", dict(method="activations", residual="rotation")),
    ("activations, defaults now (gains folded)", "gains folded", dict(method="activations")),
)


def defaults_study(setting, task: str, alphas) -> dict:
    """Every STUDY variant on the setting's first pair, each with the library's defaults for what it does not name."""
    post = residual_mode(setting) == "permutation"
    out = {}
    for prepared in ("as given",) + (() if post else ("gains folded",)):  # a post-norm model's gains cannot fold
        chosen = [(name, kw) for name, how, kw in STUDY if how == prepared]
        options_of = lambda mode, data, chosen=chosen: {"no matching": None, **{name: {**kw, **data, "key": jax.random.key(0)} for name, kw in chosen}}
        measured = measure(setting, task, alphas, options_of, fold=prepared == "gains folded")
        out.update(measured if not out else {k: v for k, v in measured.items() if k != "no matching"})
        out[f"prepared: {prepared}"] = [name for name, _ in chosen]
    return out


def measure(setting, task: str, alphas, options_of=variant_options, fold: bool | None = None) -> dict:
    """The barrier, average and seconds of each of `options_of`'s variants; the pair untied and its
    gains folded where its residual stream may rotate (`fold` None) or as `fold` says."""
    mode = residual_mode(setting)
    fold = mode == "rotation" if fold is None else fold
    if fold:
        setting = untied(setting)
    pair = setting.pairs[0]
    primary = next(iter(pair.evals.values()))
    loss_fn = setting.loss_fn(primary)
    spec, ck = setting.spec, setting.checkpoint
    prepare = (lambda p: rj.fold_norms(spec, p)) if fold else (lambda p: p)
    a, b = prepare(setting.models[pair.a]), prepare(setting.models[pair.b])
    batches = matching_batches(task)
    data = dict(data=batches, checkpoint=ck)
    options = options_of(mode, data)
    out = {"residual": mode, "matching_examples": MATCHING_EXAMPLES[task], "folded": fold}
    for variant, kw in options.items():
        seconds, report = None, None
        moved = b
        if kw is not None:
            t0 = time.perf_counter()
            result = rj.align(a, b, spec, **kw)
            moved = jax.block_until_ready(result.params)
            seconds, report = time.perf_counter() - t0, result.report
        curve = barrier.loss_barrier(loss_fn, a, moved, alphas, chunk=setting.chunk)
        mid = setting.evaluate(jax.tree.map(lambda x, y: (x + y) / 2, a, moved), primary)
        out[variant] = {"barrier": float(curve["barrier"]), "average_accuracy": mid["accuracy"], "average_loss": mid["loss"],
                        "curve_loss": np.asarray(curve["curve"]["loss"]).tolist(), "align_seconds": seconds,
                        "distance": rj.distance_report(spec, a, moved)["total"]["total"]}
        if report is not None and "learned" in report:
            learned = report["learned"]
            out[variant]["learned"] = {k: learned[k] for k in ("objective", "steps", "best_step", "held_out", "seconds")}
            out[variant]["learned"]["start"] = learned["start"]["chosen"]
            out[variant]["learned"]["stopped_at"] = learned.get("stopped_at")
        if report is not None and "settled" in report:
            out[variant]["settled"] = report["settled"]
        if report is not None and "chosen" in report:
            out[variant]["chosen"] = report["chosen"]["method"]
        if report is not None and "condition_numbers" in report:
            out[variant]["condition_numbers"] = report["condition_numbers"]
        print(f"  [{setting.name}] {variant:<20} barrier {out[variant]['barrier']:.3f}  average {mid['accuracy']:.1%}"
              + (f"  ({seconds:.1f} s)" if seconds else ""), flush=True)
    return out


def decoder_config(task: str, width: int):
    """The sequence task's decoder of `task` at model width `width`: 4 query heads of width / 4, the FFN scaled with the width."""
    if task == "gpt2":
        return seqtask.gpt2_config(n_embd=width, n_inner=4 * width)
    ffn = round(172 * width / 64)
    if task == "llama":
        return seqtask.llama_config(hidden_size=width, intermediate_size=ffn)
    return seqtask.qwen3_config(hidden_size=width, intermediate_size=ffn, head_dim=width // 4)


def width_sweep(task: str, widths: list[int], size_name: str, cache_dir, init_seed: int | None = None) -> dict:
    """Pairs at each width, of different inits (`init_seed` None) or trained from the init of
    `init_seed`: ViT digits (the size's depth, FFN 2x width) or the sequence task's decoders (2
    layers, 4 query heads, the FFN and the heads scaled with the width)."""
    size = SIZES[task][size_name]
    out = {}
    for width in widths:
        if task == "vit":
            layers = size.extra.get("config", {}).get("num_hidden_layers", 2)
            data = digits.load_digits()
            config = digits.vit_config(num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width)
            trained = [digits.train_or_load(config, digits.TrainSettings(), s, data, cache_dir, init_seed=init_seed) for s in (0, 1)]
            test, metrics, chunk = digits.test_batch(data), digits.metrics, None
        else:
            data = seqtask.make_data()
            config = decoder_config(task, width)
            trained = [seqtask.train_or_load(config, seqtask.SETTINGS, s, data, cache_dir, init_seed=init_seed) for s in (0, 1)]
            test = {k: v[: size.extra["test_sequences"]] for k, v in data.test.items()}
            metrics, chunk = seqtask.metrics, 7
        setting = Setting(f"width {width}", trained[0].checkpoint, [t.params for t in trained], None, [], [Pair(0, 1, {"test": test})],
                          {"test": test}, metrics, [_training(t) for t in trained], chunk=chunk)
        print(f"width {width}")
        out[str(width)] = measure(setting, task, np.linspace(0, 1, size.alphas))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, choices=("vit", "gpt2", "llama", "qwen3"))
    parser.add_argument("--size", default="small", choices=("small", "full"))
    parser.add_argument("--widths", default=None, help="comma-separated widths: the barrier against width")
    parser.add_argument("--init", default="different", choices=("different", "shared"), help="the width sweep's pairs: of different inits or one shared")
    parser.add_argument("--budget", action="store_true", help="the different-init pair's learned barrier against the learned method's budget")
    parser.add_argument("--defaults", action="store_true", help="both pairs: the data methods with their defaults, then each group added")
    parser.add_argument("--unit-scales", action="store_true", help="both pairs: each method with and without a gated FFN's unit scales")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    size = SIZES[args.task][args.size]
    start = time.perf_counter()
    results = result_header(args, size)
    results["variants"] = ([name for name, _, _ in STUDY] if args.defaults else list(scale_options("", {})) if args.unit_scales
                           else list(budget_options("", {}) if args.budget else VARIANTS))
    results["learned_options"] = ({"key": 0, "before": BEFORE, "the rest": "the library's defaults", "defaults": rj.AlignOptions().as_dict()} if args.defaults
                                  else {k: v for k, v in LEARNED.items() if k != "key"} | {"key": 0})
    if args.widths:
        widths = [int(w) for w in args.widths.split(",")]
        results["init"] = args.init
        results["widths"] = width_sweep(args.task, widths, args.size, args.cache_dir, None if args.init == "different" else 0)
        stem = f"from-data-width-{'shared-' if args.init == 'shared' else ''}{args.task}-{args.size}"
        _width_figure(results["widths"], Path(args.out_dir) / f"{stem}.png",
                      f"{args.init.capitalize()}-init " + ("ViT digit pairs" if args.task == "vit" else f"{args.task} decoder pairs"))
    elif args.budget:
        results["budgets"] = [dict(steps=n, learning_rate=rate, maps=maps) for n, rate, maps in BUDGETS]
        setting = TASKS[args.task](dataclasses.replace(size, models=2), args.cache_dir)[0]  # different init
        results["settings"][setting.name] = measure(setting, args.task, np.linspace(0, 1, size.alphas), budget_options)
        stem = f"from-data-budget-{args.task}-{args.size}"
    elif args.unit_scales:
        for setting in TASKS[args.task](dataclasses.replace(size, models=2), args.cache_dir):
            print(setting.name)
            results["settings"][setting.name] = measure(setting, args.task, np.linspace(0, 1, size.alphas), scale_options)
        stem = f"from-data-unit-scales-{args.task}-{args.size}"
    elif args.defaults:
        for setting in TASKS[args.task](dataclasses.replace(size, models=2), args.cache_dir):
            print(setting.name)
            results["settings"][setting.name] = defaults_study(setting, args.task, np.linspace(0, 1, size.alphas))
        stem = f"from-data-defaults-{args.task}-{args.size}"
    else:
        alphas = np.linspace(0, 1, size.alphas)
        for setting in TASKS[args.task](dataclasses.replace(size, models=2), args.cache_dir):
            print(setting.name)
            results["settings"][setting.name] = measure(setting, args.task, alphas)
        stem = f"from-data-{args.task}-{args.size}"
    results["seconds"] = time.perf_counter() - start
    write_json(results, Path(args.out_dir) / f"{stem}.json")


def _width_figure(sweep: dict, path: Path, title: str) -> None:
    """The barrier of each variant against the width, through rj.plots.lines: its legend moves beside
    the axes where it would cover a line (here it sat over the unmatched curves), and it names the
    lines drawn over each other (learned with and without invertible maps)."""
    from rotsym_jax import plots

    widths = sorted(int(w) for w in sweep)
    variants = [v for v in VARIANTS if all(v in sweep[str(w)] for w in widths)]
    # log2 of the width as the x values (the ticks say the widths): the data placed as the legend saw it
    fig = plots.lines(np.log2(widths), {v: [sweep[str(w)][v]["barrier"] for w in widths] for v in variants},
                      xlabel="model width d", ylabel="loss barrier (nats, test set)", title=title)
    fig.axes[0].set_xticks(np.log2(widths), [str(w) for w in widths])
    path.parent.mkdir(parents=True, exist_ok=True)
    plots.save(fig, path)


def redraw_width_figures(folder: Path = RESULTS_DIR) -> list[Path]:
    """Every width figure drawn again from its committed JSON (no model trained)."""
    import json

    written = []
    for source in sorted(folder.glob("from-data-width-*.json")):
        r = json.loads(source.read_text())
        init, task = r.get("init", "different"), r["task"]
        _width_figure(r["widths"], source.with_suffix(".png"),
                      f"{init.capitalize()}-init " + ("ViT digit pairs" if task == "vit" else f"{task} decoder pairs"))
        written.append(source.with_suffix(".png"))
    return written


if __name__ == "__main__":
    main()
