"""Streaming align + merge, disk to disk, on large checkpoint pairs written by make_large_pair.py.

    python benchmarks/make_large_pair.py /tmp/rotsym-3b --shape llama-3.2-3b
    python benchmarks/streaming.py /tmp/rotsym-3b [--method average] [--max-memory 3G | --chunk-layers K] [--residual MODE] [--out FILE]

Each run goes in a fresh process (the peak resident memory is that process's max RSS,
`resource.getrusage(RUSAGE_SELF).ru_maxrss`): `rotsym_jax.streaming.merge_to_disk` aligns the
fine-tune-like partner to A and merges (average by default), reading both from disk and writing
the merge to a temporary folder beside them (removed afterwards). Reports the wall time and its
split (the report's timings: read, solve and its assignments and attention, distances, apply, merge, write), the peak RSS against the size of one model,
the distance after alignment against the planted noise level (finetune.json) and the fraction of
planted FFN permutations recovered (a mixture of experts: of units found in their expert and place). Writes benchmarks/results/streaming.json on a CPU,
streaming-<device>.json on an accelerator (e.g. the 8B shape on a lent GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(args) -> dict:
    """One run, in this (fresh) process."""
    import jax
    import numpy as np

    from rotsym_jax import streaming
    from rotsym_jax.transforms import ExpertPermutation

    pair = Path(args.pair)
    out = pair / f"merged-{os.getpid()}"
    start = time.perf_counter()
    try:
        result = streaming.merge_to_disk(args.method, [pair / "a", pair / "finetune"], out, align="anchor",
                                         align_options={"residual": args.residual}, max_memory=args.max_memory, chunk_layers=args.chunk_layers)
    finally:
        wall = time.perf_counter() - start
        shutil.rmtree(out, ignore_errors=True)
    report = result.report
    planted = np.load(pair / "finetune-planted.npz")
    found = result.transforms[0]
    if "ffn" in found:
        p, s = planted["ffn.perm"], np.asarray(found["ffn"].perm)
        recovered = float(np.mean(np.take_along_axis(p, s, axis=1) == np.arange(p.shape[1])))
    else:  # a mixture of experts: a unit is recovered when its expert and its place in it are
        composed = ExpertPermutation(planted["moe.perm"], planted["moe.units"]).then(found["moe"])
        perm, units = np.asarray(composed.perm), np.asarray(composed.units)
        recovered = float(np.mean((perm == np.arange(perm.shape[1]))[..., None] & (units == np.arange(units.shape[2]))))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"wall_s": wall, "peak_rss_bytes": rss, "timings_s": report["timings"], "plan": report["streaming"],
            "alignment": report["alignment"]["distances"][0], "ffn_perm_recovered": recovered,
            "merged_distance_to_anchor": report["merged_distance_to_anchor"]["total"], "device": jax.devices()[0].device_kind,
            "backend": jax.default_backend()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pair", help="a folder written by make_large_pair.py (a/, finetune/, finetune.json)")
    parser.add_argument("--method", default="average")
    parser.add_argument("--max-memory", default=None, help="e.g. 3G: the chunk size is picked to fit")
    parser.add_argument("--chunk-layers", type=int, default=None)
    parser.add_argument("--residual", default="none", help="align the residual stream too (permutation, signed_permutation)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.max_memory is not None:
        from rotsym_jax.cli.parsers import parse_size

        args.max_memory = parse_size(args.max_memory)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    command = [sys.executable, __file__, "--child", args.pair, "--method", args.method]
    command += [] if args.max_memory is None else ["--max-memory", str(args.max_memory)]
    command += [] if args.chunk_layers is None else ["--chunk-layers", str(args.chunk_layers)]
    command += ["--residual", args.residual]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        return done.returncode
    run = json.loads(done.stdout.strip().splitlines()[-1])
    pair = Path(args.pair)
    info = json.loads((pair / "finetune.json").read_text())
    model_bytes = sum(f.stat().st_size for f in (pair / "a").glob("*.safetensors"))
    run.update({"model_bytes": model_bytes, "rss_over_model": run["peak_rss_bytes"] / model_bytes,
                "noise_level": info["noise_level"], "distance_before_planted": info["distance_before"],
                "after_over_noise": run["alignment"]["after"]["total"] / info["noise_level"]})
    t = run["timings_s"]
    phases = ", ".join(f"{k} {v:.1f}" for k, v in t.items() if k != "total")
    print(f"{info['shape']} ({info['config']['num_hidden_layers']} layers, {model_bytes / 1e9:.2f} GB per model), {args.method}, "
          f"chunk {run['plan']['chunk_layers']} layers: wall {run['wall_s']:.1f} s ({phases}); peak RSS {run['peak_rss_bytes'] / 2**30:.2f} GiB "
          f"({run['rss_over_model']:.2f} of one model); distance {run['alignment']['before']['total']:.3f} -> "
          f"{run['alignment']['after']['total']:.4f}, noise level {info['noise_level']:.4f}; FFN permutations recovered "
          f"{100 * run['ffn_perm_recovered']:.2f}%")
    sys.path.insert(0, str(HERE.parent / "experiments"))
    import jax  # noqa: F401  (device_result_path reads the backend)

    from rotsym_experiments.results_io import device_result_path, provenance, write_json

    results = {**provenance(), "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": run["device"],
                                           "backend": run["backend"], "python": platform.python_version()},
               "pair": {"folder": str(pair), "shape": info["shape"], "layers": info["config"]["num_hidden_layers"], "noise": info["noise"]},
               "method": args.method, "max_memory": args.max_memory, "residual": args.residual, "run": run}
    write_json(results, args.out or device_result_path(HERE / "results", "streaming"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
