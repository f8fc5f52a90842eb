"""Models of different widths merged (issue 51): the narrower embedded in the wider (MATH §15),
then aligned and averaged, against the two endpoints and against OT fusion.

    .venv/bin/python experiments/heterogeneous.py [--size small|full]

Three different-init pairs, model A as in experiments/run.py (seed 0) and model B (seed 1) of
another width, trained here on the same data:
    vit     ViT digits (the size's depth): FFN 128 and 96 hidden units (4 : 3, as 4096 : 3072)
    gpt2    the sequence task's GPT-2: FFN 256 and 192
    llama   the sequence task's Llama: 2 kv groups of 2 query heads and 1 kv group of 2 (head size 16)
B is widened to A's architecture with zero units or zero heads (`rotsym_jax.io.widths.widen`: the
same function, checked here), so every merge is a checkpoint of A's architecture. For each pair:
both endpoints' test loss and accuracy; every variant of experiments/from_data.py (the barrier on
the path from A to B as aligned and the plain average's accuracy); and OT fusion (Imfeld et al.;
weights or activations, hard or soft) of A and the widened B. OT fusion's plans are square here:
the narrow model's zero units take part as units of their own.

Writes experiments/results/heterogeneous-<size>.json; `experiments/write_results.py` renders it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np
from from_data import matching_batches, measure
from run import RESULTS_DIR, SIZES, Pair, Setting, _training, result_header

from rotsym_experiments import digits, seqtask
from rotsym_experiments.results_io import write_json
from rotsym_jax.io.widths import widen, widths_of
from rotsym_jax.merging.otfusion import ot_fuse

PAIRS = {
    "vit": ("FFN 128 and 96", dict(intermediate_size=96)),
    "gpt2": ("FFN 256 and 192", dict(n_inner=192)),
    "llama": ("4 heads (2 kv groups) and 2 heads (1 kv group)", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=16)),
}
SEEDS = (0, 1)


def trained_pair(task: str, size_name: str, cache_dir):
    """(A, B, test batch, metrics, chunk): A as experiments/run.py trains it, B of the pair's other width."""
    size = SIZES[task][size_name]
    narrow = PAIRS[task][1]
    if task == "vit":
        data = digits.load_digits()
        base = size.extra.get("config", {})
        configs = digits.vit_config(**base), digits.vit_config(**base, **narrow)
        a, b = (digits.train_or_load(c, digits.TrainSettings(), s, data, cache_dir) for c, s in zip(configs, SEEDS))
        return a, b, digits.test_batch(data), digits.metrics, None
    data = seqtask.make_data()
    make = seqtask.llama_config if task == "llama" else seqtask.gpt2_config
    extra = dict(head_dim=16) if task == "llama" else {}  # the head size in the config: heads may then be added
    configs = make(**extra), make(**narrow)
    a, b = (seqtask.train_or_load(c, seqtask.SETTINGS, s, data, cache_dir) for c, s in zip(configs, SEEDS))
    return a, b, {k: v[: size.extra["test_sequences"]] for k, v in data.test.items()}, seqtask.metrics, 7


def run_pair(task: str, size_name: str, cache_dir) -> dict:
    a, b, test, metrics, chunk = trained_pair(task, size_name, cache_dir)
    own = widths_of(b.checkpoint)
    target = widths_of(a.checkpoint)
    widened = widen(dataclasses.replace(b.checkpoint, params=b.params), target.ffn, kv_heads=target.kv_heads)
    evaluate = jax.jit(lambda ck, params: metrics(ck, params, test), static_argnums=0)
    scores = lambda ck, params: {k: float(v) for k, v in evaluate(ck, params).items()}  # noqa: E731
    endpoint_b = scores(b.checkpoint, b.params)
    as_widened = scores(a.checkpoint, widened.params)  # the widened B run through A's architecture
    out = {
        "pair": PAIRS[task][0],
        "widths": {"a": dataclasses.asdict(target), "b": dataclasses.asdict(own)},
        "endpoints": {"a": scores(a.checkpoint, a.params), "b": endpoint_b},
        "widened_b_loss_change": abs(as_widened["loss"] - endpoint_b["loss"]),
        "training": [_training(a), _training(b)],
    }
    print(f"{task}: {out['pair']}; A {out['endpoints']['a']['accuracy']:.1%}, B {endpoint_b['accuracy']:.1%}, "
          f"widened B's loss moved {out['widened_b_loss_change']:.1e}", flush=True)
    setting = Setting(PAIRS[task][0], a.checkpoint, [a.params, widened.params], None, [], [Pair(0, 1, {"test": test})],
                      {"test": test}, metrics, out["training"], chunk=chunk)
    out["variants"] = measure(setting, task, np.linspace(0, 1, SIZES[task][size_name].alphas))
    out["ot_fusion"] = ot_rows(setting, task, scores)
    return out


def ot_rows(setting: Setting, task: str, scores) -> dict:
    """OT fusion of A and the widened B at the midpoint: test loss and accuracy, and its seconds."""
    batches = [{k: v for k, v in batch.items() if k != "labels"} for batch in matching_batches(task)]
    rows = {}
    for source in ("weights", "activations"):
        for transport in ("hard", "soft"):
            t0 = time.perf_counter()
            fused = ot_fuse(setting.models, setting.spec, source=source, transport=transport, checkpoint=setting.checkpoint, batches=batches)
            fused = jax.block_until_ready(fused.params)
            rows[f"{source}, {transport}"] = scores(setting.checkpoint, fused) | {"seconds": time.perf_counter() - t0}
            print(f"  OT fusion ({source}, {transport}): average {rows[f'{source}, {transport}']['accuracy']:.1%}", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=("small", "full"))
    parser.add_argument("--tasks", default=",".join(PAIRS), help="comma-separated: " + ", ".join(PAIRS))
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = result_header(argparse.Namespace(task="heterogeneous", size=args.size), SIZES["vit"][args.size])
    results.pop("size_config"), results.pop("settings")
    results["pairs"] = {task: run_pair(task, args.size, args.cache_dir) for task in args.tasks.split(",")}
    results["seconds"] = time.perf_counter() - start
    write_json(results, Path(args.out_dir) / f"heterogeneous-{args.size}.json")


if __name__ == "__main__":
    main()
