"""Write experiments/RESULTS.md from the experiments' JSON results (never edit RESULTS.md by hand).

    .venv/bin/python experiments/write_results.py

Reads experiments/results/<task>-<size>.json (the full size where it exists, else the small one);
figures are linked, not copied.
"""

from __future__ import annotations

import json
from pathlib import Path

from rotsym_experiments.results_io import num, origin, pct, table, write_markdown_main

HERE = Path(__file__).parent
RESULTS = HERE / "results"
TASK_ORDER = ("vit", "minilm", "gpt2", "llama")
TITLES = {
    "vit": "ViTs on scikit-learn digits (the paper's ViT setting, Table 2, Figs. 3-6)",
    "minilm": "MiniLM fine-tunes on generated text tasks (the paper's language-model setting, Table 1)",
    "gpt2": "GPT-2-style decoders on a synthetic sequence task",
    "llama": "Llama-style decoders (GQA, RoPE, SwiGLU) on a synthetic sequence task",
}
# A change of accuracy within this many points is reported as "no clear change".
CLEAR = 0.01


def verdict(before: float, after: float) -> str:
    if after - before > CLEAR:
        return "helps"
    if before - after > CLEAR:
        return "hurts"
    return "no clear change"


def experiment_files() -> list[Path]:
    found = []
    for task in TASK_ORDER:
        for size in ("full", "small"):
            path = RESULTS / f"{task}-{size}.json"
            if path.is_file():
                found.append(path)
                break
    return found


def setting_section(task: str, name: str, r: dict, figure_dir: str) -> tuple[list[str], list[str]]:
    """(markdown lines, headline sentences) of one setting."""
    lines = [f"#### {name} ({r['models']} models)", ""]
    evals = r["pairs"][0]["evals"]
    primary = evals[0]
    acc = ", ".join(pct(m[primary]["accuracy"]) for m in r["individual"])
    trained = [t for t in r["training"] if not t["from_cache"]]
    train_note = f"; training took {sum(t['seconds'] for t in trained) / len(trained):.1f} s per model" if trained else ""
    lines += [f"Individual models, {primary} accuracy (%): {acc}{train_note}.", ""]

    # 1. fusion
    pairs = len(r["pairs"])
    mean_note = f", mean over {pairs} pairs" if pairs > 1 else " of models 0 and 1"
    lines += [f"**Fusion** (accuracy %, {', '.join(evals)}{mean_note}; matching = the paper's method; "
              "every method keeps model A's task head, so \"average\" differs from the loss-barrier path at α = 0.5, "
              "which interpolates the head too):", ""]
    header = ["method"] + [f"{e}: {c}" for e in evals for c in ("no matching", "matching")]
    rows = []
    for method, row in r["fusion"].items():
        rows.append([method] + [pct(row[c][e]["accuracy"]) for e in evals for c in ("no matching", "matching")])
    lines += table(header, rows)
    if r.get("skipped_methods"):
        lines += [f"Not run in this setting (too slow on this CPU): {', '.join(r['skipped_methods'])}.", ""]

    # 2. ablation
    methods = list(next(iter(r["ablation"].values())))
    lines += [f"**Ablation** ({primary} accuracy %, pair 0-1):", ""]
    lines += table(["variant"] + methods, [[v] + [pct(row[m]["accuracy"]) for m in methods] for v, row in r["ablation"].items()])

    # 3. distances and 4. barriers
    kinds = [k for k in r["distances"]["no matching"] if k != "total"] + ["total"]
    lines += ["**Distances** between A and matched B (Euclidean, per module kind):", ""]
    lines += table(["variant"] + kinds, [[v] + [num(d[k]) for k in kinds] for v, d in r["distances"].items()])
    lines += [f"**Loss barriers** on the linear path ({primary} loss; MATH §7):", ""]
    rows = []
    for v, c in r["curves"].items():
        mid = len(c["curve"]["alpha"]) // 2
        rows.append([v, num(c["barrier"], 4), num(c["alpha_max"], 2), pct(c["curve"]["accuracy"][mid])])
    lines += table(["variant", "barrier", "at α", "accuracy at α = 0.5 (%, head interpolated too)"], rows)

    # 5. layers
    lay = r["layers"]
    lines += [f"**Subsets of layers** (attention matched in some layers only; average merge, {primary} loss; no matching: {num(lay['none']['loss'])}):", ""]
    lines += table(
        ["k", "layer k only", "last k layers"],
        [[str(k + 1), num(s["loss"]), num(t["loss"])] for k, (s, t) in enumerate(zip(lay["single"], lay["tail"]))],
    )

    # 6. runtime
    rt = r["runtime"]
    lines += ["**Runtime** (seconds, compiled; merging includes its statistics):", ""]
    lines += table(["matching variant", "s"], [[v, num(s)] for v, s in rt["matching"].items()])
    lines += table(["merge method", "s"], [[m, num(s)] for m, s in rt["merging"].items()])

    if "many" in r:
        many = r["many"]
        e = next(iter(next(iter(many["rows"].values()))["average"]))
        objective = many["align_many_objective"]
        lines += [
            f"**All {r['models']} models** ({e} accuracy %; align_many objective {objective[0]:.2f} → {objective[-1]:.2f} "
            f"in {many['align_many_seconds']:.1f} s):",
            "",
        ]
        ms = list(next(iter(many["rows"].values())))
        lines += table(["alignment"] + ms, [[v] + [pct(row[m][e]["accuracy"]) for m in ms] for v, row in many["rows"].items()])

    lines += [f"![{name} {fig}]({figure_dir}/{path})" for fig, path in r["figures"].items()] + [""]

    # headline sentences
    avg = r["fusion"]["average"]
    b_plain, b_match = r["curves"]["no matching"]["barrier"], r["curves"]["paper"]["barrier"]
    gains = {m: row["matching"][primary]["accuracy"] - row["no matching"][primary]["accuracy"] for m, row in r["fusion"].items()}
    helped = [m for m, g in gains.items() if g > CLEAR]
    hurt = [m for m, g in gains.items() if g < -CLEAR]
    d0, d1 = r["distances"]["no matching"]["total"], r["distances"]["paper"]["total"]
    headline = [
        f"{TITLES[task].split(' (')[0]}, {name}: matching moves B {100 * (1 - d1 / d0):.1f}% closer to A "
        f"({d0:.2f} → {d1:.2f}); loss barrier {b_plain:.3g} → {b_match:.3g}; the plain average "
        f"{pct(avg['no matching'][primary]['accuracy'])}% → {pct(avg['matching'][primary]['accuracy'])}% "
        f"({verdict(avg['no matching'][primary]['accuracy'], avg['matching'][primary]['accuracy'])}); "
        f"matching helps {len(helped)} of {len(gains)} methods by more than {100 * CLEAR:.0f} point"
        + (f" ({', '.join(helped)})" if helped else "")
        + (f" and hurts {', '.join(hurt)}" if hurt else "") + "."
    ]
    return lines, headline


def render() -> str:
    files = experiment_files()
    body, headlines, machines = [], [], set()
    for path in files:
        r = json.loads(path.read_text())
        machines.add(f"{r['machine']['platform']}, {r['machine'].get('cpus', '?')} CPU cores, Python {r['machine']['python']}, JAX {r['machine']['jax']}")
        body += [f"## {TITLES.get(r['task'], r['task'])}", ""]
        body += [f"`{r['command']}` {origin(r)} ({r['size']} size, {r['seconds'] / 60:.1f} min)"
                 + (f". {r['provenance_note']}" if r.get("provenance_note") else ""), ""]
        for name, s in r["settings"].items():
            lines, headline = setting_section(r["task"], name, s, RESULTS.name)
            body += lines
            headlines += headline
    out = [
        "# Experiment results",
        "",
        "Generated by `.venv/bin/python experiments/write_results.py` from the JSON files in",
        "`experiments/results/`; do not edit by hand. Each section names the command that regenerates it.",
        "",
        "Machine: " + ("; ".join(sorted(machines)) if machines else "-") + ".",
        "",
        "## Headlines",
        "",
    ]
    out += [f"- {h}" for h in headlines] + [""]
    out += body
    return "\n".join(out)


def main(argv=None):
    write_markdown_main(render, HERE / "RESULTS.md", __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
