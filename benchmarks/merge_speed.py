"""End-to-end merge time, `rotsym merge` against `mergekit-yaml`, on the same checkpoints.

Writes a base Llama of about 22M parameters and two fine-tune-like partners (the base plus small
noise) with transformers, then runs every method both tools have as a whole process (start, load,
merge, save), without alignment (mergekit has none), and compares the saved tensors. mergekit
runs from its own environment: pass its `mergekit-yaml` with --mergekit (it pins other versions
of torch and transformers than this project). Prints a table and writes
benchmarks/results/merge_speed.json.

    python benchmarks/merge_speed.py --mergekit /path/to/venv/bin/mergekit-yaml
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import safetensors.numpy
import transformers as tf
import yaml

from rotsym_experiments.results_io import provenance, write_json

HERE = Path(__file__).resolve().parent
CONFIG = dict(vocab_size=16000, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
              intermediate_size=1024, max_position_embeddings=256, tie_word_embeddings=False)
# name: (mergekit method and per-model parameters, global parameters, rotsym method and --param list, needs the base)
METHODS = {
    "linear": ("linear", {"weight": 0.5}, {}, "average", [], False),
    "slerp": ("slerp", {}, {"t": 0.5}, "slerp", ["t=0.5"], False),
    "task_arithmetic": ("task_arithmetic", {"weight": 0.5}, {}, "task_arithmetic", ["lam=0.5"], True),
    "ties": ("ties", {"weight": 1.0, "density": 0.5}, {}, "ties", ["density=0.5", "lam=1.0"], True),
    "dare": ("dare_linear", {"weight": 0.5, "density": 0.5}, {}, "dare", ["drop=0.5", "lam=0.5"], True),
}


def write_models(root: Path) -> dict[str, Path]:
    import torch

    torch.manual_seed(0)
    base = tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG)).eval()
    paths = {"base": root / "base", "a": root / "a", "b": root / "b"}
    base.save_pretrained(paths["base"])
    for i, name in enumerate(("a", "b"), 1):
        torch.manual_seed(i)
        with torch.no_grad():
            tuned = tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG)).eval()
            tuned.load_state_dict(base.state_dict())
            for p in tuned.parameters():
                p.add_(0.01 * torch.randn_like(p))
        tuned.save_pretrained(paths[name])
    return paths


def mergekit_config(name: str, paths: dict[str, Path]) -> dict:
    method, per_model, global_params, _, _, with_base = METHODS[name]
    models = [{"model": str(paths[m]), "parameters": dict(per_model)} if per_model else {"model": str(paths[m])} for m in ("a", "b")]
    config = {"merge_method": method, "models": models, "dtype": "float32"}
    if with_base:
        config["base_model"] = str(paths["base"])
    elif method == "slerp":
        config["base_model"] = str(paths["a"])
    if global_params:
        config["parameters"] = global_params
    return config


def timed(command: list) -> float:
    start = time.perf_counter()
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(safetensors.numpy.load_file(file))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mergekit", required=True, help="the mergekit-yaml executable of mergekit's own environment")
    parser.add_argument("--repeats", type=int, default=2, help="runs per tool and method (the minimum is reported)")
    parser.add_argument("--out", default=str(HERE / "results" / "merge_speed.json"))
    args = parser.parse_args(argv)
    rotsym = [sys.executable, "-m", "rotsym_jax.cli"]
    mergekit_version = subprocess.run([args.mergekit, "--help"], capture_output=True, text=True).returncode == 0
    if not mergekit_version:
        parser.error(f"--mergekit {args.mergekit} does not run")
    rows = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = write_models(root)
        params = sum(int(np.prod(t.shape)) for t in tensors(paths["a"]).values())
        print(f"Llama, {params / 1e6:.1f}M parameters, float32; {args.repeats} runs each, minimum wall time of the whole process")
        print(f"{'method':<16} {'mergekit (s)':>12} {'rotsym (s)':>11} {'ratio':>6} {'max |diff|':>11}")
        for name, (_, _, _, ours, ours_params, with_base) in METHODS.items():
            config = root / f"{name}.yml"
            config.write_text(yaml.safe_dump(mergekit_config(name, paths)))
            ours_command = [*rotsym, "merge", "--method", ours, paths["a"], paths["b"], root / f"ours-{name}", "--align", "none", "--quiet", "--overwrite"]
            ours_command += [x for p in ours_params for x in ("--param", p)] + (["--base", paths["base"]] if with_base else [])
            # Alternated, so that a change in the machine's load falls on both tools alike.
            runs = {"mergekit": [], "rotsym": []}
            for _ in range(args.repeats):
                runs["mergekit"].append(timed([args.mergekit, config, root / f"mk-{name}"]))
                runs["rotsym"].append(timed(ours_command))
            theirs, mine = min(runs["mergekit"]), min(runs["rotsym"])
            a, b = tensors(root / f"mk-{name}"), tensors(root / f"ours-{name}")
            diff = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a) if a.keys() == b.keys() else None
            rows[name] = {"mergekit_s": theirs, "rotsym_s": mine, "ratio": mine / theirs, "max_abs_diff": diff,
                          "random": name == "dare", "mergekit_runs_s": runs["mergekit"], "rotsym_runs_s": runs["rotsym"]}
            shown = "-" if diff is None else f"{diff:.2e}"
            print(f"{name:<16} {theirs:>12.2f} {mine:>11.2f} {mine / theirs:>6.2f} {shown:>11}" + ("  (random drops: values differ)" if name == "dare" else ""))
    results = {
        **provenance(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    # 1/5/15-minute load averages before and after: other work on the machine slows both tools.
                    "load_average": {"before": list(load_before), "after": list(os.getloadavg())}},
        "device": f"rotsym on {jax.devices()[0].device_kind}, mergekit on the CPU",
        "model": {"family": "llama", "parameters": params, "config": CONFIG, "dtype": "float32"},
        "repeats": args.repeats,
        "methods": rows,
    }
    write_json(results, args.out)


if __name__ == "__main__":
    main()
