"""End-to-end merge time, `rotsym merge` against `mergekit-yaml`, on mergekit's own configs.

Writes a base Llama of about 22M parameters and two fine-tune-like partners (the base plus small
noise) with transformers, then runs each config below, one mergekit config in the shapes of
mergekit's documentation per method (per-model weights and densities, filtered and layer-gradient
parameters), through both tools as they are (`mergekit-yaml CONFIG OUT`, `rotsym merge CONFIG OUT`),
each as a whole process (start, load, merge, save), without alignment, and compares the saved
tensors. mergekit runs beside this venv's torch and transformers from the folder `make test-slow`
installs it in (.mergekit, the default of --mergekit), or from its own environment (its
`mergekit-yaml`). Prints a table and writes benchmarks/results/merge_speed.json.

    python benchmarks/merge_speed.py [--mergekit .mergekit | /path/to/venv/bin/mergekit-yaml]
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
# name: the config's merge_method, per-model parameters (a and b), shared parameters, whether it draws at random
ATTN_MLP_T = [{"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]}, {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]}, {"value": 0.5}]
METHODS = {
    "linear": ("linear", ({"weight": 0.5}, {"weight": 0.5}), {}, False),
    "slerp": ("slerp", ({}, {}), {"t": ATTN_MLP_T}, False),
    "nuslerp": ("nuslerp", ({"weight": 0.4}, {"weight": 0.6}), {}, False),
    "task_arithmetic": ("task_arithmetic", ({"weight": 0.5}, {"weight": [0.3, 0.7]}), {"lambda": 0.9}, False),
    "ties": ("ties", ({"weight": 1.0, "density": [1, 0.7, 0.1]}, {"weight": [{"filter": "mlp", "value": 0.5}, {"value": 0}], "density": 0.5}),
             {"normalize": True, "int8_mask": True}, False),
    "breadcrumbs_ties": ("breadcrumbs_ties", ({"weight": 0.5, "density": 0.9, "gamma": 0.01}, {"weight": 0.5, "density": 0.8}), {}, False),
    "dare_ties": ("dare_ties", ({"weight": 0.5, "density": 0.5}, {"weight": 0.5, "density": 0.5}), {}, True),
    "della": ("della", ({"weight": 0.5, "density": 0.5, "epsilon": 0.1}, {"weight": 0.5, "density": 0.5}), {"lambda": 1.0}, True),
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
    method, per_model, shared, _ = METHODS[name]
    models = [{"model": str(paths[m]), **({"parameters": dict(p)} if p else {})} for m, p in zip(("a", "b"), per_model)]
    config = {"models": models, "merge_method": method, "dtype": "float32"}
    if method == "slerp":
        config["base_model"] = str(paths["a"])
    elif method not in ("linear", "nuslerp"):
        config["base_model"] = str(paths["base"])
    if shared:
        config["parameters"] = shared
    return config


def mergekit_command(mergekit: str) -> tuple[list, dict]:
    """The command and environment of `mergekit-yaml`: an executable, or a folder mergekit was
    pip-installed into with --target (run by this Python, offline: its model card looks names up on the Hub)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if Path(mergekit).is_dir():
        return [sys.executable, str(Path(mergekit) / "bin" / "mergekit-yaml")], {**env, "PYTHONPATH": str(Path(mergekit).resolve())}
    return [mergekit], env


def timed(command: list, env: dict | None = None) -> float:
    start = time.perf_counter()
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env)
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
    parser.add_argument("--mergekit", default=str(HERE.parent / ".mergekit"),
                        help="mergekit's folder (pip install --target; make test-slow installs it in .mergekit) or a mergekit-yaml executable")
    parser.add_argument("--repeats", type=int, default=2, help="runs per tool and method (the minimum is reported)")
    parser.add_argument("--out", default=str(HERE / "results" / "merge_speed.json"))
    args = parser.parse_args(argv)
    rotsym = [sys.executable, "-m", "rotsym_jax.cli"]
    mergekit, mergekit_env = mergekit_command(args.mergekit)
    if subprocess.run([*mergekit, "--help"], capture_output=True, text=True, env=mergekit_env).returncode != 0:
        parser.error(f"--mergekit {args.mergekit} does not run")
    rows = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = write_models(root)
        params = sum(int(np.prod(t.shape)) for t in tensors(paths["a"]).values())
        print(f"Llama, {params / 1e6:.1f}M parameters, float32; {args.repeats} runs each, minimum wall time of the whole process")
        print(f"{'method':<16} {'mergekit (s)':>12} {'rotsym (s)':>11} {'ratio':>6} {'max |diff|':>11}")
        for name, (_, _, _, random) in METHODS.items():
            config = root / f"{name}.yml"
            config.write_text(yaml.safe_dump(mergekit_config(name, paths), sort_keys=False))
            ours_command = [*rotsym, "merge", config, root / f"ours-{name}", "--quiet", "--overwrite"]
            # Alternated, so that a change in the machine's load falls on both tools alike.
            runs = {"mergekit": [], "rotsym": []}
            for _ in range(args.repeats):
                runs["mergekit"].append(timed([*mergekit, config, root / f"mk-{name}"], mergekit_env))
                runs["rotsym"].append(timed(ours_command))
            theirs, mine = min(runs["mergekit"]), min(runs["rotsym"])
            a, b = tensors(root / f"mk-{name}"), tensors(root / f"ours-{name}")
            diff = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a) if a.keys() == b.keys() else None
            rows[name] = {"mergekit_s": theirs, "rotsym_s": mine, "ratio": mine / theirs, "max_abs_diff": diff, "random": random,
                          "config": mergekit_config(name, {"a": "A", "b": "B", "base": "BASE"}),
                          "mergekit_runs_s": runs["mergekit"], "rotsym_runs_s": runs["rotsym"]}
            shown = "-" if diff is None else f"{diff:.2e}"
            print(f"{name:<16} {theirs:>12.2f} {mine:>11.2f} {mine / theirs:>6.2f} {shown:>11}" + ("  (random drops: values differ)" if random else ""))
    results = {
        **provenance(),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    # 1/5/15-minute load averages before and after: other work on the machine slows both tools.
                    "load_average": {"before": list(load_before), "after": list(os.getloadavg())}},
        "device": f"rotsym on {jax.devices()[0].device_kind}, mergekit on the CPU",
        "model": {"family": "llama", "parameters": params, "config": CONFIG, "dtype": "float32"},
        "repeats": args.repeats,
        "mergekit": {"given": args.mergekit, "version": _mergekit_version(mergekit, mergekit_env)},
        "methods": rows,
    }
    write_json(results, args.out)


def _mergekit_version(mergekit: list, env: dict) -> str | None:
    code = "import importlib.metadata as m; print(m.version('mergekit'))"
    python = mergekit[0] if mergekit[0] == sys.executable else None
    if python is None:
        return None
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    return done.stdout.strip() or None


if __name__ == "__main__":
    main()
