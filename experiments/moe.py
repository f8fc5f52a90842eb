"""Mixtures of experts (issue 35): two Mixtral-style decoders trained on the sequence task, merged
with and without matching their experts.

    .venv/bin/python experiments/moe.py [--size small|full] [--widths 64,128]

Models: `seqtask.mixtral_config` (d = 64, 2 layers, 4 query heads in 2 kv groups, 4 experts of 86
units, top 2; at other widths the experts' units scale with d), trained as experiments/run.py trains the decoders, from different inits and from
one shared init. For the pair (model 0, model 1), on the test set (which no alignment sees): the
loss barrier on the linear path from A to B as aligned (MATH §7) and the plain average's accuracy
and loss, for:

    no matching              B as trained
    attention only           heads' rotations and scales (the paper's attention), experts left in place
    experts by index         + each expert's units matched to the expert of the same index: what
                             treating every expert as an FFN of its own gives, without matching experts
    attention + experts      + the experts matched (nested E x E assignment, MATH §9)
    + residual rotation      + head permutations and the residual stream (norm gains folded)

and for the full matching: how many inner (unit) assignments the exact search solved, against
the E² a naive nested assignment solves, and the seconds it took.

Writes experiments/results/moe-<size>.json; `experiments/write_results.py` renders it into
experiments/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from run import RESULTS_DIR, SIZES, Pair, Setting, _batches, _training, result_header

import rotsym_jax as rj
from rotsym_experiments import seqtask
from rotsym_experiments.results_io import write_json
from rotsym_jax import barrier
from rotsym_jax.engine import experts
from rotsym_jax.pytree import flatten
from rotsym_jax.solvers import assignment
from rotsym_jax.transforms import ExpertPermutation

VARIANTS = ("no matching", "attention only", "experts by index", "attention + experts", "+ residual rotation",
            "from activations + residual rotation")
MATCHING_SEQUENCES = 256  # training sequences whose activations the data-driven variant matches


def matching_batches():
    rows = seqtask.make_data().train
    return [{k: np.asarray(v[i : i + 32]) for k, v in rows.items()} for i in range(0, MATCHING_SEQUENCES, 32)]


def settings(size, cache_dir, width: int) -> list[Setting]:
    config = seqtask.mixtral_config(hidden_size=width, intermediate_size=round(86 * width / 64))
    data = seqtask.make_data()
    test = {"test": {k: v[: size.extra["test_sequences"]] for k, v in data.test.items()}}
    out = []
    for name, init_seed in (("different init", None), ("shared init", 0)):
        trained = [seqtask.train_or_load(config, seqtask.SETTINGS, s, data, cache_dir, init_seed=init_seed) for s in (0, 1)]
        out.append(Setting(name, trained[0].checkpoint, [t.params for t in trained], None, [_batches(data.train, 32, 32)] * 2,
                           [Pair(0, 1, test)], test, seqtask.metrics, [_training(t) for t in trained], chunk=7))
    return out


def experts_by_index(spec, a, b):
    """Each of B's experts' units matched to A's expert of the same index (no expert permutation)."""
    bound = rj.bind(spec, b)
    flat_a, flat_b = flatten(a), flatten(b)
    out = {}
    for group in bound.experts:
        units = []
        for i in range(len(group.layers)):
            la, lb = experts.layer_leaves(group, flat_a, i), experts.layer_leaves(group, flat_b, i)
            costs = [experts.pair_costs(la[0], la[1], lb[1], jnp.int32(e), jnp.int32(e)) for e in range(group.num_experts)]
            units.append(np.stack(assignment.linear_assignments([c.scores for c in costs], offsets=[c.offsets() for c in costs])))
        out[group.name] = ExpertPermutation(jnp.tile(jnp.arange(group.num_experts, dtype=jnp.int32), (len(group.layers), 1)),
                                            jnp.asarray(np.stack(units), jnp.int32))
    return out


@contextlib.contextmanager
def counted_assignments():
    """A list of the numbers of matrices `assignment.linear_assignments` solves inside the block."""
    solved, original = [], assignment.linear_assignments

    def counting(scores, **kw):
        solved.append(len(scores))
        return original(scores, **kw)

    assignment.linear_assignments = counting
    try:
        yield solved
    finally:
        assignment.linear_assignments = original


def measure(setting: Setting, alphas) -> dict:
    pair = setting.pairs[0]
    primary = next(iter(pair.evals.values()))
    loss_fn = setting.loss_fn(primary)
    spec = setting.spec
    a, b = (rj.fold_norms(spec, p) for p in (setting.models[pair.a], setting.models[pair.b]))  # same functions
    (group,) = rj.bind(spec, a).experts
    out = {"experts": group.num_experts, "units": group.units, "layers": len(group.layers)}
    for variant in VARIANTS:
        seconds, moved, solved = None, b, []
        t0 = time.perf_counter()
        if variant == "attention only":
            moved = rj.align(a, b, spec, ffn="none").params
        elif variant == "experts by index":
            attention = rj.align(a, b, spec, ffn="none")
            moved = rj.apply_transform(spec, attention.params, {**rj.identity_transform(rj.bind(spec, b)), **experts_by_index(spec, a, attention.params)})
        elif variant in ("attention + experts", "+ residual rotation", "from activations + residual rotation"):
            with counted_assignments() as solved:
                kw = {"attention + experts": {}, "+ residual rotation": dict(heads="permute", residual="rotation"),
                      "from activations + residual rotation": dict(heads="permute", residual="rotation", method="activations",
                                                                   data=matching_batches(), checkpoint=setting.checkpoint)}[variant]
                result = rj.align(a, b, spec, **kw)
            moved = result.params
            out.setdefault("matched_experts", {})[variant] = np.asarray(result.transforms["moe"].perm).tolist()
        if variant != "no matching":
            moved = jax.block_until_ready(moved)
            seconds = time.perf_counter() - t0
        curve = barrier.loss_barrier(loss_fn, a, moved, alphas, chunk=setting.chunk)
        mid = setting.evaluate(jax.tree.map(lambda x, y: (x + y) / 2, a, moved), primary)
        out[variant] = {"barrier": float(curve["barrier"]), "average_accuracy": mid["accuracy"], "average_loss": mid["loss"],
                        "curve_loss": np.asarray(curve["curve"]["loss"]).tolist(), "align_seconds": seconds,
                        "distance": rj.distance_report(spec, a, moved)["total"]["total"]}
        if solved:  # a residual alignment solves the groups once per sweep of its descent
            solves = len(result.report.get("residual", {}).get("distance_per_sweep", [None]))
            out[variant]["inner_assignments"] = int(sum(solved))
            out[variant]["naive_inner_assignments"] = group.num_experts ** 2 * len(group.layers) * solves
        print(f"  [{setting.name}] {variant:<22} barrier {out[variant]['barrier']:.3f}  average {mid['accuracy']:.1%}"
              + (f"  ({seconds:.1f} s)" if seconds else "")
              + (f"  {out[variant]['inner_assignments']} of {out[variant]['naive_inner_assignments']} inner assignments" if solved else ""),
              flush=True)
    ends = [setting.evaluate(p, primary) for p in (a, b)]
    out["models"] = [{"accuracy": e["accuracy"], "loss": e["loss"]} for e in ends]
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=("small", "full"))
    parser.add_argument("--widths", default="64", help="comma-separated model widths d (the experts' widths scale with d)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    args.task = "moe"
    size = SIZES["llama"][args.size]
    start = time.perf_counter()
    results = result_header(args, size)
    results["variants"] = list(VARIANTS)
    results["config"] = seqtask.mixtral_config().to_diff_dict()
    alphas = np.linspace(0, 1, size.alphas)
    results.pop("settings")
    results["widths"] = {}
    for width in (int(w) for w in args.widths.split(",")):
        results["widths"][str(width)] = {}
        for setting in settings(size, args.cache_dir, width):
            print(f"d = {width}, {setting.name}", flush=True)
            results["widths"][str(width)][setting.name] = measure(setting, alphas)
    results["seconds"] = time.perf_counter() - start
    write_json(results, Path(args.out_dir) / f"moe-{args.size}.json")


if __name__ == "__main__":
    main()
