"""Federated averaging with and without alignment, in one jitted training loop (beyond the paper).

    .venv/bin/python experiments/federated.py --task vit|gpt2 [--size small|full] [--models M] [--seeds S] [--states]

M models train with AdamW, each on its own shard of the task's training data, and every round
(`local_epochs` passes over the shard) they sync: "none" (independent training, the reference),
"average" (all reset to the plain parameter average) or "align+average" (models 1..M-1 moved
onto model 0 with `rotsym_jax.align` inside the jitted round, then averaged); from different random
inits and from one shared init. Every round records each model's test loss and accuracy before
the sync, the plain and aligned averages', and the loss barrier between models 0 and 1, plain and
aligned (`rotsym_experiments.federated` holds the loop and says why it is built as it is).

Writes experiments/results/federated-<task>-<size>.json; `experiments/write_results.py` renders it
into experiments/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

from rotsym_experiments import digits, federated, seqtask
from rotsym_experiments.results_io import provenance, write_json
from rotsym_experiments.training import config_dict

RESULTS_DIR = Path(__file__).parent / "results"


@dataclasses.dataclass(frozen=True)
class Size:
    """`epochs`: local epochs per model over the whole run (the learning-rate schedule's length),
    split into rounds of each of `local_epochs` (one schedule each); `seeds`: runs of each init and
    sync; `train_examples` / `test_examples`: the data's first ones (None: all)."""

    epochs: int
    local_epochs: tuple
    seeds: int = 1
    train_examples: int | None = None
    test_examples: int | None = None


SIZES = {
    # the 2-layer ViT of `rotsym demo`; 30 epochs as digits.TrainSettings, here over half the data each
    "vit": {
        "small": Size(epochs=3, local_epochs=(1,)),
        "full": Size(epochs=30, local_epochs=(2, 10), seeds=2),
    },
    # the decoders of experiments/run.py; each model sees its half of the sequences 6 times (384 steps
    # at batch 64, where one model trained on all of them takes 640 to near the Bayes accuracy)
    "gpt2": {
        "small": Size(epochs=2, local_epochs=(1,), train_examples=1024, test_examples=128),
        # one schedule: with two seeds a second one (3-epoch rounds: within a point of these) takes the run past 10 minutes
        "full": Size(epochs=6, local_epochs=(1,), seeds=2, test_examples=512),
    },
}


def vit_task(size: Size) -> federated.Task:
    config = digits.vit_config()
    data = digits.load_digits()
    train = {"pixel_values": data.train_images, "labels": data.train_labels}
    # batch 32 over half the images keeps the steps per epoch of one model trained on all at 64
    return federated.Task("vit", lambda seed: digits.init_model(config, seed), digits.metrics, _first(train, size.train_examples),
                          _first(digits.test_batch(data), size.test_examples), digits.TrainSettings(epochs=size.epochs, batch_size=32))


def gpt2_task(size: Size) -> federated.Task:
    config = seqtask.gpt2_config()
    data = seqtask.make_data()
    return federated.Task("gpt2", lambda seed: seqtask.init_model(config, seed), seqtask.metrics, _first(data.train, size.train_examples),
                          _first(data.test, size.test_examples), dataclasses.replace(seqtask.SETTINGS, epochs=size.epochs))


TASKS = {"vit": (vit_task, digits.vit_config), "gpt2": (gpt2_task, seqtask.gpt2_config)}
TITLES = {"vit": "digits ViTs", "gpt2": "GPT-2 decoders"}


def _first(data: dict, n: int | None) -> dict:
    return {k: np.asarray(v)[:n] for k, v in data.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, choices=sorted(TASKS))
    parser.add_argument("--size", default="small", choices=("small", "full"))
    parser.add_argument("--models", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=None, help="seeds per schedule (default: the size's)")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--states", action="store_true",
                        help="instead: the optimizer states at a sync (reset, kept, moved by the alignment), on the first schedule; "
                             "writes federated-states-<task>-<size>.json")
    args = parser.parse_args(argv)
    size = SIZES[args.task][args.size]
    if args.seeds is not None:
        size = dataclasses.replace(size, seeds=args.seeds)
    make_task, make_config = TASKS[args.task]
    out_dir = Path(args.out_dir)
    task = make_task(size)
    start = time.perf_counter()
    results = {
        **provenance(),
        "task": args.task,
        "size": args.size,
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "jax": jax.__version__, "cpus": os.cpu_count(), "device": jax.devices()[0].device_kind},
        "setup": {
            "models": args.models, "epochs": size.epochs, "seeds": size.seeds, "settings": dataclasses.asdict(task.settings),
            "train_examples": len(next(iter(task.train.values()))), "test_examples": len(next(iter(task.test.values()))),
            "shard_examples": len(next(iter(task.train.values()))) // args.models, "alphas": federated.ALPHAS.tolist(),
            "model_config": {k: v for k, v in config_dict(make_config()).items() if v is not None and not isinstance(v, dict)},
        },
        "schedules": [],
    }
    if args.states:
        return states_study(args, size, task, results, out_dir, start)
    for local_epochs in size.local_epochs:
        schedule = federated.Schedule(models=args.models, rounds=size.epochs // local_epochs, local_epochs=local_epochs)
        round_fn = federated.round_for(task, schedule)
        steps = local_epochs * federated.steps_per_epoch(task, args.models)
        print(f"{args.task}-{args.size}: {schedule.rounds} rounds of {local_epochs} local epochs ({steps} steps)")
        runs = {init: {} for init in federated.INITS}
        for init in federated.INITS:
            for sync in federated.SYNCS:
                # the seeds of one init and sync go through the rounds together (one batched program)
                outs = federated.run_many(task, schedule, [(sync, init, seed) for seed in range(size.seeds)], round_fn=round_fn)
                runs[init][sync] = [{k: v for k, v in out.items() if k != "params"} | {"seed": seed} for seed, out in enumerate(outs)]
                for seed, out in enumerate(outs):
                    print(f"  [{init} init, {sync}, seed {seed}] {out['seconds']:.0f} s; last round: {federated.summary(out['records'][-1])}")
        stem = f"federated-{args.task}-{args.size}"
        title = f"{TITLES[args.task]}, syncs every {local_epochs} local epoch{'s' if local_epochs > 1 else ''}"
        federated.draw(runs, [r["step"] for r in runs["shared"]["none"][0]["records"]], title, out_dir / stem / f"every{local_epochs}")
        results["schedules"].append({
            "local_epochs": local_epochs, "rounds": schedule.rounds, "steps_per_round": steps,
            "compiled": round_fn._cache_size(), "runs": runs,
            "figures": {name: f"{stem}/every{local_epochs}-{name}.png" for name in ("accuracy", "barrier")},
        })
    results["seconds"] = time.perf_counter() - start
    results["cpu_seconds"] = time.process_time()  # every thread of the process, the import included
    write_json(results, out_dir / f"federated-{args.task}-{args.size}.json")


def redraw(folder: Path = RESULTS_DIR) -> list[Path]:
    """Every schedule's figures drawn again from the committed JSON (no model trained), as
    federated.draw now draws them."""
    written = []
    for source in sorted(folder.glob("federated-*-full.json")):
        r = json.loads(source.read_text())
        for schedule in r.get("schedules", []):
            if "figures" not in schedule:
                continue
            local_epochs, runs = schedule["local_epochs"], schedule["runs"]
            title = f"{TITLES[r['task']]}, syncs every {local_epochs} local epoch{'s' if local_epochs > 1 else ''}"
            federated.draw(runs, [rec["step"] for rec in runs["shared"]["none"][0]["records"]], title, folder / source.stem / f"every{local_epochs}")
            written += [folder / p for p in schedule["figures"].values()]
    return written


# (sync, state) pairs of the optimizer-state study: "kept" and "moved" differ only after align+average.
STATE_RUNS = (("average", "reset"), ("average", "kept"), ("align+average", "reset"), ("align+average", "kept"), ("align+average", "moved"))


def states_study(args, size: Size, task, results: dict, out_dir: Path, start: float) -> None:
    """Same seeds, syncs every `size.local_epochs[0]` epochs: what each model's AdamW state becomes at
    a sync (federated.STATES), after a plain average and after align+average."""
    local_epochs = size.local_epochs[0]
    schedule = federated.Schedule(models=args.models, rounds=size.epochs // local_epochs, local_epochs=local_epochs)
    round_fn = federated.round_for(task, schedule)
    steps = local_epochs * federated.steps_per_epoch(task, args.models)
    print(f"{args.task}-{args.size}, optimizer states: {schedule.rounds} rounds of {local_epochs} local epochs ({steps} steps)")
    runs = {}
    for init in federated.INITS:
        batch = [(sync, init, seed, state) for sync, state in STATE_RUNS for seed in range(size.seeds)]
        outs = federated.run_many(task, schedule, batch, round_fn=round_fn)
        for (sync, _, seed, state), out in zip(batch, outs):
            runs.setdefault(init, {}).setdefault(f"{sync}, {state} state", []).append(
                {k: v for k, v in out.items() if k != "params"} | {"seed": seed})
            print(f"  [{init} init, {sync}, {state} state, seed {seed}] last round: {federated.summary(out['records'][-1])}")
    results["states"] = {"local_epochs": local_epochs, "rounds": schedule.rounds, "steps_per_round": steps, "runs": runs}
    results["seconds"] = time.perf_counter() - start
    results["cpu_seconds"] = time.process_time()
    write_json(results, out_dir / f"federated-states-{args.task}-{args.size}.json")


if __name__ == "__main__":
    main()
