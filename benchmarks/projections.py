"""Projected wall time of a streamed align + merge of an 8B and a 70B pair over 1, 4 and 16 hosts
or GPUs, on paper, from the per-layer costs a streaming run measured (benchmarks/streaming.py).

    python benchmarks/projections.py benchmarks/results/streaming.json [benchmarks/results/streaming-nvidia-h200.json ...]

The model, per measured run (one kind of worker: this CPU, a GPU):
- a layer's seconds split in two (with chunks in flight at once, each phase scaled by the wall
  over the phases' sum, their overlap taken off): the engine's arithmetic (`solve`: the FFN cost products, which
  dominate, and the attention statistics) scales with the FFN cost products' flops
  (2 f^2 3d for f hidden units and width d); everything else (reads, transfers, apply,
  distances, merge, writes, and the seconds in no phase) scales with the layer's bytes;
- the leaves outside the layers (embeddings, LM head: process 0's) scale with their bytes;
- N workers split the layers in contiguous shares (`processes.Team.share`): the slowest does
  ceil(L / N) layers; the exchange of the solvers' parts (the attention cross products, each
  worker's FFN permutations) is added at 1 GB/s;
- the host assignments are those of fine-tune-like pairs (certified on the device); unrelated
  pairs add the exact assignments (benchmarks/lap_solvers.json), not modelled here.
Writes benchmarks/results/projections.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "experiments"))

from rotsym_experiments.results_io import provenance, write_json  # noqa: E402
from rotsym_jax.timings import DISJOINT  # noqa: E402

SHAPES = {  # Llama 3 shapes: width, FFN units, layers, heads, kv heads, head dim, vocabulary
    "llama-3.2-3b": dict(d=3072, f=8192, layers=28, heads=24, kv=8, dh=128, vocab=128256),
    "llama-3.1-8b": dict(d=4096, f=14336, layers=32, heads=32, kv=8, dh=128, vocab=128256),
    "llama-3.1-70b": dict(d=8192, f=28672, layers=80, heads=64, kv=8, dh=128, vocab=128256),
}
TARGETS = ("llama-3.1-8b", "llama-3.1-70b")
WORKERS = (1, 4, 16)
EXCHANGE_BYTES_PER_S = 1e9
BYTES = 2  # bf16 checkpoints


def layer_params(s) -> int:
    attention = s["d"] * (s["heads"] * s["dh"] + 2 * s["kv"] * s["dh"]) + s["heads"] * s["dh"] * s["d"]
    return attention + 3 * s["d"] * s["f"] + 2 * s["d"]


def layer_flops(s) -> float:
    return 2.0 * s["f"] ** 2 * 3 * s["d"]


def global_params(s) -> int:
    return 2 * s["vocab"] * s["d"] + s["d"]  # embeddings, untied LM head, final norm


def exchange_bytes(s) -> float:
    """Every layer's attention cross products (float32, a few dh x dh per head) and FFN permutation (int32)."""
    return s["layers"] * (4 * 3 * s["heads"] * s["dh"] ** 2 + 4 * s["f"])


def per_layer(run: dict, shape: dict) -> dict:
    """A measured run's seconds per layer: the engine's arithmetic, the rest, and the leaves outside the layers."""
    t, layers = run["timings_s"], run["plan"]["layers"]
    # chunks in flight at once: their phases overlap by `overlap` seconds; scaled to the wall they share
    disjoint = sum(t.get(k, 0.0) for k in DISJOINT)
    arithmetic = t["solve"] * (disjoint - t.get("overlap", 0.0)) / disjoint
    globals_share = global_params(shape) / (global_params(shape) + layers * layer_params(shape))
    rest = run["wall_s"] - arithmetic  # reads, transfers, apply, distances, merge, writes, no phase
    return {"arithmetic_s": arithmetic / layers, "rest_s": rest * (1 - globals_share) / layers, "globals_s": rest * globals_share}


def project(measured: dict, source: dict, target: dict, workers: int) -> float:
    flops, size = layer_flops(target) / layer_flops(source), layer_params(target) / layer_params(source)
    layer = measured["arithmetic_s"] * flops + measured["rest_s"] * size
    share = math.ceil(target["layers"] / workers)
    exchange = 0.0 if workers == 1 else exchange_bytes(target) / EXCHANGE_BYTES_PER_S
    return share * layer + measured["globals_s"] * global_params(target) / global_params(source) + exchange


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="streaming benchmark JSONs (benchmarks/results/streaming*.json)")
    parser.add_argument("--check", nargs=2, type=Path, default=None, metavar=("FROM", "MEASURED"),
                        help="the model checked: the wall of run MEASURED (another shape, same machine) projected from run FROM")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "projections.json")
    args = parser.parse_args(argv)
    model = __doc__.split("The model, per measured run (one kind of worker: this CPU, a GPU):", 1)[1].split("Writes", 1)[0]
    # arithmetic on the measured runs' figures, which name their own devices
    results = {**provenance(), "device": "cpu (arithmetic only)", "model": " ".join(model.split()), "projections": []}
    if args.check:
        (source_data, measured_data) = (json.loads(p.read_text()) for p in args.check)
        source_run, measured_run = source_data["run"], measured_data["run"]
        source = dict(SHAPES[source_data["pair"]["shape"]], layers=source_run["plan"]["layers"])
        target = dict(SHAPES[measured_data["pair"]["shape"]], layers=measured_run["plan"]["layers"])
        projected = project(per_layer(source_run, source), source, target, 1)
        results["check"] = {"from": str(args.check[0].resolve().relative_to(HERE.parent)), "measured": str(args.check[1].resolve().relative_to(HERE.parent)),
                            "shape": measured_data["pair"]["shape"], "layers": target["layers"], "projected_s": projected,
                            "measured_s": measured_run["wall_s"]}
        print(f"check: {target['layers']} layers of {measured_data['pair']['shape']} projected {projected:.1f} s, measured "
              f"{measured_run['wall_s']:.1f} s ({projected / measured_run['wall_s'] - 1:+.0%})")
    for path in args.runs:
        data = json.loads(path.read_text())
        run, pair = data.get("run") or data["runs"][0], data["pair"]
        source = dict(SHAPES[pair["shape"]], layers=run["plan"]["layers"])
        measured = per_layer(run, source)
        worker = run.get("device", "cpu")
        entry = {"measured": {"file": str(path.resolve().relative_to(HERE.parent)), "commit": data.get("commit"), "device": worker,
                              "machine": data.get("machine"), "shape": pair["shape"], "layers": run["plan"]["layers"],
                              "wall_s": run["wall_s"], **measured},
                 "projected_wall_s": {name: {str(n): project(measured, source, SHAPES[name], n) for n in WORKERS} for name in TARGETS}}
        results["projections"].append(entry)
        print(f"from {path.name} ({worker}, {pair['shape']}, {run['plan']['layers']} layers, {run['wall_s']:.0f} s): "
              f"{measured['arithmetic_s']:.2f} s arithmetic + {measured['rest_s']:.2f} s else per layer")
        for name in TARGETS:
            walls = entry["projected_wall_s"][name]
            print(f"  {name:14s} " + "  ".join(f"{n:>2d} workers {walls[str(n)] / 60:7.1f} min" for n in WORKERS))
    write_json(results, args.out)


if __name__ == "__main__":
    main()
