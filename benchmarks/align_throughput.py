"""Models aligned per second: a stack of N small models aligned to one anchor, three ways.

    eager    a Python loop of `align` calls (each dispatches its jitted pieces and returns to Python)
    jitted   a Python loop over one `jax.jit(align)` program
    vmapped  one `jax.jit(jax.vmap(align))` call on the stack (a leading model axis on every leaf);
             every model's assignments reach the host in one callback, on one thread pool

for the digits ViT and the decoder task's GPT-2 (experiments/, random inits: the work does not
depend on the weights' values), N = 1, 8, 64. Steady state is the best of --repeats runs; the
first call (tracing and compilation) is reported apart. Prints a table and writes
benchmarks/results/align_throughput.json on a CPU, align_throughput-<device>.json on an accelerator.

    PYTHONPATH=.:experiments python benchmarks/align_throughput.py [--sizes 1 8 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import rotsym_jax as rj
from rotsym_experiments import digits, seqtask
from rotsym_experiments.results_io import device_result_path, provenance, write_json

HERE = Path(__file__).resolve().parent
MODELS = {"vit-digits": digits.vit_config, "gpt2-seqtask": seqtask.gpt2_config}
# Issue 16's targets for vmapped N = 64 against the eager loop, in models per second.
TARGET_SPEEDUP = {"cpu": 2.0, "gpu": 10.0}


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def first_and_warm(fn, repeats: int) -> tuple[float, float]:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start, best_of(fn, repeats)


def measure(config, sizes, repeats) -> dict:
    ck = rj.init_checkpoint(config, jax.random.key(0))
    spec = rj.bind(rj.spec_for(ck), ck.params)
    anchor = ck.params
    models = [rj.init_checkpoint(config, jax.random.key(1 + i)).params for i in range(max(sizes))]
    one = jax.jit(lambda b: rj.align(anchor, b, spec).params)
    many = jax.jit(jax.vmap(lambda b: rj.align(anchor, b, spec).params))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(anchor))
    out = {"parameters": n_params, "sizes": {}}
    for n in sizes:
        batch = models[:n]
        stack = jax.tree.map(lambda *x: jnp.stack(x), *batch)
        eager_first, eager = first_and_warm(lambda batch=batch: [rj.align(anchor, b, spec).params for b in batch], repeats)
        jit_first, jitted = first_and_warm(lambda batch=batch: [one(b) for b in batch], repeats)
        vmap_first, vmapped = first_and_warm(lambda stack=stack: many(stack), repeats)
        row = {
            "eager_s": eager, "jitted_s": jitted, "vmapped_s": vmapped,
            "eager_models_per_s": n / eager, "jitted_models_per_s": n / jitted, "vmapped_models_per_s": n / vmapped,
            "vmapped_over_eager": eager / vmapped, "jitted_over_eager": eager / jitted,
            "first_call_s": {"eager": eager_first, "jitted": jit_first, "vmapped": vmap_first},
        }
        out["sizes"][str(n)] = row
        print(f"{n:4d} {n / eager:10.1f} {n / jitted:10.1f} {n / vmapped:10.1f} {eager / vmapped:9.1f}x   "
              f"first: eager {eager_first:.2f} s, jitted {jit_first:.2f} s, vmapped {vmap_first:.2f} s", flush=True)
    return out


def machine() -> dict:
    dev = jax.devices()[0]
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "backend": jax.default_backend(),
            "device": dev.device_kind, "jax": jax.__version__, "python": sys.version.split()[0]}


def default_out() -> Path:
    return device_result_path(HERE / "results", "align_throughput")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.sizes) or args.repeats < 1:
        parser.error("sizes and repeats must be positive")
    backend = "cpu" if jax.default_backend() == "cpu" else "gpu"
    results = {**provenance(), "machine": machine(), "options": "align defaults (rotation, heads fixed, sequential rescale, FFN permutation)",
               "target_vmapped_over_eager_at_64": TARGET_SPEEDUP[backend], "models": {}}
    print(f"{results['machine']['device']} ({jax.default_backend()}), jax {jax.__version__}, {os.cpu_count()} cores; models/s, best of {args.repeats}")
    for name in args.models:
        config = MODELS[name]()
        print(f"\n{name}\n{'N':>4s} {'eager':>10s} {'jitted':>10s} {'vmapped':>10s} {'vmap/eager':>10s}")
        results["models"][name] = measure(config, sorted(set(args.sizes)), args.repeats)
        write_json(results, args.out or default_out(), quiet=True)  # a run cut short keeps what it measured
    write_json(results, args.out or default_out())


if __name__ == "__main__":
    main()
