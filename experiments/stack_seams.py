"""Stacked layers with aligned seams (issue 75): a frankenmerge of two decoders trained apart, as
`rotsym merge CONFIG.yml OUT` runs mergekit's `slices:` + passthrough, with and without moving
B's residual stream into A's basis first (the config's `rotsym: {align: anchor}`).

    PYTHONPATH=.:experiments .venv/bin/python experiments/stack_seams.py [--cache-dir DIR]

Models: Llama-style decoders of the sequence task (`seqtask.llama_config` at 4 layers, d = 64),
trained here if missing (about 30 s each): A (seed 0), B from another init (seed 1), and B' from A's
init on another data order (seed 1, init 0). For each pair and each seam k, two stacks:

    swap k      A's layers [0, k) then B's [k, 4): 4 layers, B's last ones read A's stream
    deeper k    A's layers [0, 4) then B's [k, 4): 8 - k layers, the usual frankenmerge shape

each written plainly, with aligned seams by a residual permutation, and by a residual rotation
(norm gains folded), all from weights (the default groups otherwise); the test set's loss and
next-token accuracy of each, beside A's and B's own.

Writes experiments/results/stack-seams.json (with the commit, command and device);
`experiments/write_results.py` renders it into experiments/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import yaml

import rotsym_jax as rj
from rotsym_experiments import seqtask
from rotsym_experiments.results_io import provenance, write_json
from rotsym_jax import hf
from rotsym_jax.mergekit_pipeline import merge_mergekit

RESULTS = Path(__file__).parent / "results" / "stack-seams.json"
DEPTH = 4
VARIANTS = {"plain": None, "aligned seams (residual permutation)": "permutation", "aligned seams (residual rotation)": "rotation"}


def decoders(cache_dir) -> dict:
    config, data = seqtask.llama_config(num_hidden_layers=DEPTH), seqtask.make_data()
    a = seqtask.train_or_load(config, seqtask.SETTINGS, 0, data, cache_dir)
    b = seqtask.train_or_load(config, seqtask.SETTINGS, 1, data, cache_dir)
    shared = seqtask.train_or_load(config, seqtask.SETTINGS, 1, data, cache_dir, init_seed=0)
    return {"a": a, "pairs": {"different init": b, "shared init": shared}, "test": data.test}


def _stack(root: Path, a: Path, b: Path, slices: list[tuple[Path, int, int]], residual: str | None, name: str) -> Path:
    """The stack of `slices` written by the mergekit config run, aligned to A when `residual` is given."""
    raw = {"slices": [{"sources": [{"model": str(m), "layer_range": [first, end]}]} for m, first, end in slices],
           "merge_method": "passthrough", "dtype": "float32",
           "rotsym": {"align": "none"} if residual is None else {"align": "anchor", "anchor": str(a), "align_options": {"residual": residual}}}
    config = root / f"{name}.yml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    merge_mergekit(config, root / name)
    return root / name


def measure(a, b, test, root: Path) -> dict:
    folder_a, folder_b = hf.save_hf(a.checkpoint, a.params, root / "a"), hf.save_hf(b.checkpoint, b.params, root / "b")
    rows = {"A": seqtask.evaluate(a.checkpoint, a.params, test), "B": seqtask.evaluate(b.checkpoint, b.params, test), "stacks": {}}
    for k in range(1, DEPTH):
        for shape, slices in ((f"swap {k}", [(folder_a, 0, k), (folder_b, k, DEPTH)]), (f"deeper {k}", [(folder_a, 0, DEPTH), (folder_b, k, DEPTH)])):
            rows["stacks"][shape] = {}
            for variant, residual in VARIANTS.items():
                start = time.perf_counter()
                out = _stack(root, folder_a, folder_b, slices, residual, f"{shape.replace(' ', '')}-{residual}")
                seconds = time.perf_counter() - start
                ck = rj.load_hf(out)
                rows["stacks"][shape][variant] = seqtask.evaluate(ck, ck.params, test) | {"seconds": seconds}
                print(f"{shape:9s} {variant:40s} loss {rows['stacks'][shape][variant]['loss']:.3f} "
                      f"accuracy {rows['stacks'][shape][variant]['accuracy']:.1%}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=None, help="the experiments' cache (default: $ROTSYM_CACHE, else ./.cache/rotsym_jax)")
    args = parser.parse_args()
    models = decoders(args.cache_dir)
    start = time.perf_counter()
    results = {**provenance(), "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "jax": jax.__version__,
                                           "cpus": os.cpu_count(), "device": jax.devices()[0].device_kind},
               "depth": DEPTH, "variants": list(VARIANTS), "bayes": seqtask.bayes(seqtask.make_chain()), "pairs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, b in models["pairs"].items():
            print(f"-- {name}")
            root = Path(tmp) / name.replace(" ", "-")
            root.mkdir()
            results["pairs"][name] = measure(models["a"], b, models["test"], root)
    results["seconds"] = time.perf_counter() - start
    write_json(results, RESULTS)


if __name__ == "__main__":
    main()
