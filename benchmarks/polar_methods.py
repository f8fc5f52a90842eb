"""Polar factor methods on CPU: time and accuracy for a batch of per-head cross products.

    .venv/bin/python benchmarks/polar_methods.py [--batch 288] [--n 64] [--rows 769] [--reps 15]

Inputs: `M = X_B^T X_A` for random `X_A, X_B` (rows x n, "random": condition numbers ~1e2-1e4)
and planted `M = X^T (X Q + 0.1 noise)` ("planted": near-orthogonal up to an SPD factor).
Reference: float64 NumPy SVD `U V^T`. Timings (both inputs) are jitted, `block_until_ready`,
interleaved round-robin over methods, min (and median) over `--reps` runs, wall clock and process CPU time
(CPU > wall means the method used more than one thread). The per-head NumPy SVD loop (float32,
`np.linalg.svd` per matrix) is timed in the same run for comparison. Prints a table and writes
benchmarks/results/polar_methods.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rotsym_experiments.results_io import provenance, write_json
from rotsym_jax import solvers


def cross_products(batch, n, rows, seed=0):
    rng = np.random.default_rng(seed)
    xa = rng.standard_normal((batch, rows, n)).astype(np.float32)
    xb = rng.standard_normal((batch, rows, n)).astype(np.float32)
    random = np.einsum("bri,brj->bij", xb, xa)
    q = np.linalg.qr(rng.standard_normal((batch, n, n)))[0]
    target = xb @ q + 0.1 * rng.standard_normal((batch, rows, n))
    planted = np.einsum("bri,brj->bij", xb, target.astype(np.float32))
    return {"random": random.astype(np.float32), "planted": planted.astype(np.float32)}


def reference(M):
    u, _, vt = np.linalg.svd(M.astype(np.float64))
    return u @ vt


def _svd_gesdd(M):
    u, _, vt = jnp.linalg.svd(M, full_matrices=False)  # divide and conquer ("svd" uses gesvd)
    return u @ vt


def numpy_loop(M):
    out = np.empty_like(M)
    for k, m in enumerate(M):
        u, _, vt = np.linalg.svd(m)
        out[k] = u @ vt
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=288)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--rows", type=int, default=769)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "polar_methods.json"))
    args = parser.parse_args()

    inputs = cross_products(args.batch, args.n, args.rows)
    refs = {k: reference(v) for k, v in inputs.items()}
    methods = {m: jax.jit(lambda M, m=m: solvers.polar(M, method=m)) for m in solvers.POLAR_METHODS}
    methods["svd (gesdd)"] = jax.jit(_svd_gesdd)
    methods["numpy svd loop"] = numpy_loop

    def run(f, M):
        return jax.block_until_ready(f(M))

    device_inputs = {k: jnp.asarray(v) for k, v in inputs.items()}
    rows = {}
    for name, f in methods.items():
        errors = {}
        for k in inputs:
            out = np.asarray(run(f, device_inputs[k] if name != "numpy svd loop" else inputs[k]), np.float64)
            errors[k] = float(np.abs(out - refs[k]).max())
            errors[k + "_orth"] = float(np.abs(np.swapaxes(out, -1, -2) @ out - np.eye(args.n)).max())
        rows[name] = {"errors": errors, "wall": [], "cpu": []}

    for name in rows:
        rows[name].update({k: {"wall": [], "cpu": []} for k in inputs})
    for _ in range(args.reps):
        for kind in inputs:
            for name, f in methods.items():
                arg = inputs[kind] if name == "numpy svd loop" else device_inputs[kind]
                t, c = time.perf_counter(), time.process_time()
                run(f, arg)
                rows[name][kind]["wall"].append(time.perf_counter() - t)
                rows[name][kind]["cpu"].append(time.process_time() - c)

    print(f"polar of {args.batch} matrices {args.n}x{args.n} (cross products of {args.rows}x{args.n}),"
          f" {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f}, {args.reps} reps, default"
          f" {solvers.DEFAULT_POLAR_METHOD!r}; ms: min (median) wall, min CPU; max |R - R_f64|")
    header = (f"{'method':16s} {'random ms':>17s} {'cpu':>6s} {'planted ms':>17s} {'cpu':>6s}"
              f" {'err random':>10s} {'err planted':>11s} {'orth err':>8s}")
    print(header)
    print("-" * len(header))
    result = {**provenance(), "device": jax.devices()[0].device_kind, "batch": args.batch, "n": args.n, "rows": args.rows, "reps": args.reps,
              "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "machine": platform.platform(),
              "jax": jax.__version__, "default": solvers.DEFAULT_POLAR_METHOD, "methods": {}}
    for name, r in rows.items():
        e = r["errors"]
        entry = dict(e)
        line = f"{name:16s}"
        for kind in inputs:
            wall_min, wall_med = 1e3 * min(r[kind]["wall"]), 1e3 * float(np.median(r[kind]["wall"]))
            cpu_min = 1e3 * min(r[kind]["cpu"])
            entry.update({f"{kind}_wall_min_ms": wall_min, f"{kind}_wall_median_ms": wall_med,
                          f"{kind}_cpu_min_ms": cpu_min})
            line += f" {wall_min:7.1f} ({wall_med:7.1f}) {cpu_min:6.1f}"
        line += f" {e['random']:10.2e} {e['planted']:11.2e} {max(e['random_orth'], e['planted_orth']):8.1e}"
        print(line)
        result["methods"][name] = entry
    write_json(result, args.out)


if __name__ == "__main__":
    main()
