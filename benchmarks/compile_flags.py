"""What XLA:CPU's compile options cost and save (issue 72): each setting in a fresh process, with
no persistent cache, measures
- the compile seconds of the attention solve (`solve_cross`, three of its programs),
- the first and a second `align(method="learned")` of a tiny Llama pair (d = 128, 4 heads,
  2 layers, 4 batches of 8 x 16 tokens) with other step counts: the second compiles nothing,
- the warm seconds of weight matching on a random roberta-base pair (what the compiled code costs
  to run: a setting that compiles fast but runs slow is no default for users).

Settings: XLA's defaults and the test suite's (tests/conftest.py: JAX_DISABLE_MOST_OPTIMIZATIONS=1
and the older CPU emitters, code generation on one thread), and each alone.

    PYTHONPATH=.:experiments python benchmarks/compile_flags.py [--skip-roberta]

Prints a table and writes benchmarks/results/compile_flags.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from rotsym_experiments.results_io import device_result_path, provenance, write_json

HERE = Path(__file__).resolve().parent
EMITTERS = "--xla_cpu_use_fusion_emitters=false"
SPLIT = "--xla_cpu_parallel_codegen_split_count=1"
SETTINGS = {
    "xla defaults": {},
    "older emitters": {"XLA_FLAGS": EMITTERS},
    "older emitters, one codegen thread": {"XLA_FLAGS": f"{EMITTERS} {SPLIT}"},
    "unoptimised": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"},
    "unoptimised, older emitters, one codegen thread (the tests')": {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "XLA_FLAGS": f"{EMITTERS} {SPLIT}"},
}

RUN = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
import rotsym_jax as rj
from rotsym_jax import hf
from rotsym_jax.engine import attention

out = {}
L, G, dh = 2, 4, 8
ma, s = jnp.ones((L, G, 2, dh, dh)), jnp.ones((L, G, 2))
for rescale, rotary in (("sequential", None), ("sequential", 8), ("joint", None)):
    f = jax.jit(attention.solve_cross, static_argnums=(1, 3, 4, 5))
    t = time.perf_counter()
    f.lower([(ma, ma, s, s)], rotary, None, rescale, "newton_schulz", False).compile()
    out[f"solve_cross {rescale}{' rope' if rotary else ''} compile_s"] = time.perf_counter() - t

cfg = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
       "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 64, "torch_dtype": "float32"}
ck = hf.init_checkpoint(hf.read_config(cfg), jax.random.key(0), head="lm")
b = hf.init_checkpoint(hf.read_config(cfg), jax.random.key(1), head="lm").params
spec = rj.spec_for(ck)
rng = np.random.default_rng(0)
data = [{"input_ids": rng.integers(3, 97, size=(8, 16)).astype(np.int32)} for _ in range(4)]
for name, steps in (("learned first (1 step)", 1), ("learned second (11 steps)", 11)):
    t = time.perf_counter()
    r = rj.align(ck.params, b, spec, method="learned", data=data, checkpoint=ck, steps=steps, key=jax.random.key(0))
    jax.block_until_ready(r.params)
    out[f"{name} s"] = time.perf_counter() - t
    out[f"{name} compile_s"] = r.report["timings"]["compile"]
    out[f"{name} programs compiled"] = r.report["timings"]["compiled"]

if sys.argv[1] == "roberta":
    import transformers as tf
    import tempfile
    import torch
    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        folder = tempfile.mkdtemp()
        tf.RobertaModel(tf.RobertaConfig(vocab_size=1000)).save_pretrained(folder)
        folders.append(folder)
    a, bb = (rj.load_hf(f) for f in folders)
    spec = rj.spec_for(a)
    t = time.perf_counter()
    jax.block_until_ready(rj.align(a.params, bb.params, spec).params)
    out["roberta-base random first s"] = time.perf_counter() - t
    times = []
    for _ in range(2):
        t = time.perf_counter()
        jax.block_until_ready(rj.align(a.params, bb.params, spec).params)
        times.append(time.perf_counter() - t)
    out["roberta-base random warm s"] = min(times)
print(json.dumps(out))
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-roberta", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = {}
    for name, env in SETTINGS.items():
        base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")}
        run = subprocess.run([sys.executable, "-c", RUN, "skip" if args.skip_roberta else "roberta"], env={**base, **env,
                             "ROTSYM_COMPILATION_CACHE": "off"}, capture_output=True, text=True)
        if run.returncode:
            print(run.stderr[-3000:])
            return run.returncode
        rows[name] = {"env": env, **json.loads(run.stdout.strip().splitlines()[-1])}
        print(name, {k: round(v, 2) for k, v in rows[name].items() if k != "env"}, flush=True)
    import jax  # the parent's device is the children's: they run on this machine's default backend

    results = {**provenance(), "machine": {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "cpus": os.cpu_count()},
               "settings": rows}
    write_json(results, args.out or device_result_path(HERE / "results", "compile_flags"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
