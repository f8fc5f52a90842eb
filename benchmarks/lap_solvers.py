"""Exact linear-assignment solvers on the matrices alignment produces (issue 36, item 1).

The FFN assignment's score matrix of two models (`scores[i, j]` = the overlap of B's unit i with A's
unit j over gate, up and down, as engine/ffn.py forms it) for three kinds of pairs: planted (B = A
with its units permuted, plus noise 0.01 of the weights' std: what the certificate usually settles
on the device), fine-tune-like (B = A plus noise 0.3: near the identity, not settled) and unrelated
(independent models: every layer goes to the host). Each solver runs on the same matrix, in
float32 and float64; its objective is checked against SciPy's (the reference the tests use).
Solvers: SciPy's `linear_sum_assignment`, and lapx's `lapjv` and `lapjvs` when `lap` (the lapx
package: `pip install lapx`) imports. Prints a table and writes benchmarks/results/lap_solvers.json.

    python benchmarks/lap_solvers.py --sizes 3072 8192
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import time
from pathlib import Path

import numpy as np
from scipy.optimize import linear_sum_assignment

from rotsym_experiments.results_io import provenance, write_json

HERE = Path(__file__).resolve().parent
KINDS = ("planted", "fine-tune-like", "unrelated")


def scores(kind: str, f: int, d: int, rng) -> np.ndarray:
    """B's units against A's: gate and up columns (d, f) and down rows (f, d), summed, float64."""
    a = [rng.standard_normal((d, f)), rng.standard_normal((d, f)), rng.standard_normal((f, d)).T]
    if kind == "unrelated":
        b = [rng.standard_normal(x.shape) for x in a]
    else:
        perm = rng.permutation(f) if kind == "planted" else np.arange(f)
        noise = 0.01 if kind == "planted" else 0.3
        b = [x[:, perm] + noise * rng.standard_normal(x.shape) for x in a]
    return sum(xb.T @ xa for xa, xb in zip(a, b))


def solvers():
    """{name: maximise(scores) -> cols (B's unit i to A's unit cols[i])}."""
    out = {"scipy": lambda s: linear_sum_assignment(s, maximize=True)[1]}
    try:
        import lap
    except ImportError:
        return out
    out["lapx.lapjv"] = lambda s: lap.lapjv(-s, return_cost=False)[0]
    out["lapx.lapjvs"] = lambda s: lap.lapjvs(-s, return_cost=False, jvx_like=False, prefer_float32=s.dtype == np.float32)[0]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[3072, 8192])
    parser.add_argument("--d", type=int, default=1024, help="the model width the score matrices sum over")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "lap_solvers.json"))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    fns, rows = solvers(), []
    for f in args.sizes:
        for kind in KINDS:
            s64 = scores(kind, f, args.d, rng)
            for dtype in (np.float32, np.float64):
                s = s64.astype(dtype)
                reference = None
                for name, fn in fns.items():
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        cols = np.asarray(fn(s))
                        times.append(time.perf_counter() - t0)
                    value = float(s64[np.arange(f), cols].sum())  # every objective in float64, on the float64 scores
                    reference = value if name == "scipy" else reference
                    gap = (reference - value) / abs(reference)
                    rows.append({"size": f, "kind": kind, "dtype": np.dtype(dtype).name, "solver": name, "seconds": min(times),
                                 "objective": value, "gap_to_scipy": gap, "is_permutation": bool(np.array_equal(np.sort(cols), np.arange(f)))})
                    print(f"{f:6d} {kind:15s} {np.dtype(dtype).name:8s} {name:12s} {min(times):8.3f} s  gap to SciPy {gap:+.1e}", flush=True)
    versions = {p: importlib.metadata.version(p) for p in ("scipy", "numpy", "lapx") if _installed(p)}
    write_json({**provenance(), "device": f"CPU ({os.cpu_count()} cores, {platform.machine()})", "versions": versions,
                "d": args.d, "repeats": args.repeats, "rows": rows}, Path(args.out))


def _installed(package: str) -> bool:
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    main()
