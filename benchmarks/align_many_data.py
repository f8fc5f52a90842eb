"""What `align_many(method="activations")` costs in the Python API (JAX's persistent cache off, as
there by default): three GPT-2-shaped models, the second and third the first moved by random
elements of its groups, aligned to a common reference from their activations, twice in one
process. The first call compiles; the second should only run (issue 48: no retrace on a second
call with the same shapes). Before 8b77fb0 each inner `align` compiled its own scorer.

    PYTHONPATH=.:experiments python benchmarks/align_many_data.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import torch
import transformers as tf

import rotsym_jax as rj
from rotsym_experiments.results_io import device_result_path, provenance, write_json

HERE = Path(__file__).resolve().parent
CONFIG = dict(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=64)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tf.GPT2LMHeadModel(tf.GPT2Config(**CONFIG)).save_pretrained(tmp)
        ck = rj.load_hf(tmp)
    spec = rj.spec_for(ck)
    moved = [rj.apply_transform(spec, ck.params, rj.random_transform(spec, ck.params, jax.random.key(k))) for k in (1, 2)]
    ids = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], size=(4, 8, 16))
    data = [{"input_ids": x, "attention_mask": np.ones_like(x)} for x in ids]
    calls = []
    for i in range(args.calls):
        start = time.perf_counter()
        many = rj.align_many([ck.params, *moved], spec, method="activations", data=data, checkpoint=ck, mode="mean", heads="permute")
        calls.append({"seconds": time.perf_counter() - start, "objective": float(many.objective[-1]),
                      "unaligned_objective": float(many.report["unaligned_objective"])})
        print(f"call {i}: {calls[-1]['seconds']:.1f} s, F {calls[-1]['unaligned_objective']:.4g} -> {calls[-1]['objective']:.3g}", flush=True)
    dev = jax.devices()[0]
    results = {**provenance(), "machine": {"device": dev.device_kind, "backend": jax.default_backend(), "cpus": os.cpu_count()},
               "config": CONFIG, "batches": len(data), "calls": calls}
    write_json(results, args.out or device_result_path(HERE / "results", "align_many_data"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
