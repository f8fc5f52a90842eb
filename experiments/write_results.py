"""Write experiments/RESULTS.md from the experiments' JSON results (never edit RESULTS.md by hand).

    .venv/bin/python experiments/write_results.py

Reads experiments/results/<task>-<size>.json, residual-<task>-<size>.json, from-data-<task>-<size>.json,
from-data-width-<task>-<size>.json, from-data-width-shared-<task>-<size>.json, from-data-budget-<task>-<size>.json,
from-data-defaults-<task>-<size>.json, from-data-unit-scales-<task>-<size>.json,
heterogeneous-<size>.json, federated-<task>-<size>.json, federated-states-<task>-<size>.json,
moe-<size>.json, moe-from-dense.json, stack-seams.json, lora-rank.json, check_issue73.json and check_issue71.json
(the full size where it exists, else the small one); figures are linked, not copied.
"""

from __future__ import annotations

import json
from pathlib import Path

from rotsym_experiments.results_io import num, origin, pct, table, write_markdown_main

HERE = Path(__file__).parent
RESULTS = HERE / "results"
TASK_ORDER = ("vit", "minilm", "deberta", "gpt2", "llama", "qwen3")
TITLES = {
    "vit": "ViTs on scikit-learn digits (the paper's ViT setting, Table 2, Figs. 3-6)",
    "minilm": "MiniLM fine-tunes on generated text tasks (the paper's language-model setting, Table 1)",
    "deberta": "DeBERTa fine-tunes on generated text tasks (the paper's Table 1 model family, a small DeBERTa-v3 pretrained here)",
    "gpt2": "GPT-2-style decoders on a synthetic sequence task",
    "llama": "Llama-style decoders (GQA, RoPE, SwiGLU) on a synthetic sequence task",
    "qwen3": "Qwen3 decoders (the Llama-style ones with QK-norm) on a synthetic sequence task",
}
# A change of accuracy within this many points is reported as "no clear change".
CLEAR = 0.01


def verdict(before: float, after: float) -> str:
    if after - before > CLEAR:
        return "helps"
    if before - after > CLEAR:
        return "hurts"
    return "no clear change"


def largest_results(stems) -> list[Path]:
    """For each stem the full-size result if there is one, else the small one."""
    found = []
    for stem in stems:
        for size in ("full", "small"):
            path = RESULTS / f"{stem}-{size}.json"
            if path.is_file():
                found.append(path)
                break
    return found


def experiment_files() -> list[Path]:
    return largest_results(TASK_ORDER)


def setting_section(task: str, name: str, r: dict, figure_dir: str) -> tuple[list[str], list[str]]:
    """(markdown lines, headline sentences) of one setting."""
    lines = [f"#### {name} ({r['models']} models)", ""]
    evals = r["pairs"][0]["evals"]
    primary = evals[0]
    acc = ", ".join(pct(m[primary]["accuracy"]) for m in r["individual"])
    trained = [t for t in r["training"] if not t["from_cache"]]
    train_note = f"; training took {sum(t['seconds'] for t in trained) / len(trained):.1f} s per model" if trained else ""
    lines += [f"Individual models, {primary} accuracy (%): {acc}{train_note}.", ""]
    if "pretraining" in r:  # a shared model pretrained here (DeBERTa, by masked-language modelling)
        pre = r["pretraining"]
        lines += [f"Pretrained here by masked-language modelling on the training sentences: {pre['steps']} steps over "
                  f"{pre['sentences']} sentences in {pre['train_seconds'] / 60:.1f} min; loss per epoch "
                  + " → ".join(num(x) for x in pre["losses"])
                  + f"; masked test word pieces {num(pre['test_before']['loss'])} → {num(pre['test_after']['loss'])} nats, "
                  f"{pct(pre['test_after']['accuracy'])}% right.", ""]

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
    if r.get("broken_methods"):
        reasons = {}
        for method, reason in r["broken_methods"].items():
            reasons.setdefault(reason, []).append(method)
        lines += [f"Not run in this setting (the library fails on this model): {', '.join(ms)}: {reason}." for reason, ms in reasons.items()]
        lines += [""]

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


# ---- federated averaging (experiments/federated.py) ---------------------------------------------

FEDERATED_TASKS = ("vit", "gpt2")
FEDERATED_TITLES = {"vit": "digits ViTs", "gpt2": "GPT-2-style decoders on the sequence task"}
SYNC_NAMES = ("none", "average", "align+average")


def federated_files() -> list[Path]:
    return largest_results(f"federated-{task}" for task in FEDERATED_TASKS)


def _mean(xs) -> float:
    return sum(xs) / len(xs)


# what one round's record says (the record of experiments/federated.py, after the round's measurements)
def _deployed(rec: dict) -> dict:
    """What a round leaves: the model every one was reset to, or (no sync) the models' mean."""
    if rec["after_sync"] is not None:
        return rec["after_sync"]
    return {k: _mean([m[k] for m in rec["models"]]) for k in rec["models"][0]}


def _result_acc(rec: dict) -> float:
    return _deployed(rec)["accuracy"]


def _result_loss(rec: dict) -> float:
    return _deployed(rec)["loss"]


def _models_acc(rec: dict) -> float:
    return _mean([m["accuracy"] for m in rec["models"]])


def _average_acc(rec: dict) -> float:
    return rec["average"]["accuracy"]


def _aligned_average_acc(rec: dict) -> float:
    return rec["aligned_average"]["accuracy"]


def _plain_barrier(rec: dict) -> float:
    return rec["barrier"]["plain"]


def _aligned_barrier(rec: dict) -> float:
    return rec["barrier"]["aligned"]


def _seeds(runs: list, value, at: int = -1) -> list[float]:
    """value(record) at round `at` of each seed's run."""
    return [value(run["records"][at]) for run in runs]


def _at(runs: list, value, at: int = -1) -> float:
    return _mean(_seeds(runs, value, at))


def _barriers(runs: list, at: int, digits: int = 3) -> str:
    return f"{num(_at(runs, _plain_barrier, at), digits)} / {num(_at(runs, _aligned_barrier, at), digits)}"


def _pct_range(xs: list[float]) -> str:
    """Mean in percent, with the seeds' range when there are several."""
    return pct(_mean(xs)) + (f" [{pct(min(xs))}–{pct(max(xs))}]" if len(xs) > 1 else "")


def _fed_verdict(diffs: list[float]) -> str:
    """align+average against average, one difference per seed: "helps" / "hurts" only when every
    seed moves more than CLEAR the same way."""
    if all(d > CLEAR for d in diffs):
        return "helps"
    if all(d < -CLEAR for d in diffs):
        return "hurts"
    return "no clear change" if abs(_mean(diffs)) <= CLEAR else "mixed"


def _compared(a: list[float], b: list[float]) -> str:
    """A verdict on per-seed values a against b, with the differences when there are several seeds."""
    diffs = [x - y for x, y in zip(a, b)]
    return _fed_verdict(diffs) + (f"; per seed {', '.join(f'{100 * d:+.1f}' for d in diffs)} points" if len(diffs) > 1 else "")


def _round_mean(run: dict, value) -> float:
    """value(record) averaged over a run's rounds: the area under its curve."""
    return _mean([value(rec) for rec in run["records"]])


def _every(sched: dict) -> str:
    return f"every {sched['local_epochs']} local epoch{'s' if sched['local_epochs'] > 1 else ''}"


def _federated_tables(task: str, sched: dict) -> list[str]:
    runs = sched["runs"]
    compiled = "once" if sched["compiled"] == 1 else f"{sched['compiled']} times"
    lines = [f"#### Syncs {_every(sched)} ({sched['rounds']} rounds of {sched['steps_per_round']} steps; "
             f"the jitted round compiled {compiled} for all runs)", ""]
    lines += ["**End of training** (test accuracy %; *models*: before the last sync, mean of the models; *result*: "
              "what the run leaves, the synced model or, without syncs, the models themselves; barriers "
              "plain / aligned before the first and the last sync):", ""]
    header = ["init", "sync", "models", "average of them", "aligned average", "result", "result loss", "barrier, first sync", "barrier, last sync"]
    rows = [
        [init, sync, pct(_at(by_sync[sync], _models_acc)), pct(_at(by_sync[sync], _average_acc)), pct(_at(by_sync[sync], _aligned_average_acc)),
         _pct_range(_seeds(by_sync[sync], _result_acc)), num(_at(by_sync[sync], _result_loss)), _barriers(by_sync[sync], 0), _barriers(by_sync[sync], -1)]
        for init, by_sync in runs.items() for sync in SYNC_NAMES
    ]
    lines += table(header, rows)
    for init, by_sync in runs.items():
        lines += [f"**Per round, {init} init** (test accuracy % after the round; barriers plain / aligned before the sync):", ""]
        header = ["round", "step", "none: models", "none: average / aligned average", "none: barrier",
                  "average", "average: barrier", "align+average", "align+average: barrier"]
        none, avg, aligned = (by_sync[sync] for sync in SYNC_NAMES)
        rows = [
            [str(rec["round"]), str(rec["step"]), pct(_at(none, _models_acc, i)),
             f"{pct(_at(none, _average_acc, i))} / {pct(_at(none, _aligned_average_acc, i))}", _barriers(none, i),
             pct(_at(avg, _result_acc, i)), _barriers(avg, i), pct(_at(aligned, _result_acc, i)), _barriers(aligned, i)]
            for i, rec in enumerate(none[0]["records"])
        ]
        lines += table(header, rows)
    lines += [f"![federated {task} {_every(sched)} {fig}]({RESULTS.name}/{path})" for fig, path in sched["figures"].items()] + [""]
    return lines


def _federated_summary(sched: dict, by_sync: dict) -> str:
    """One schedule and init in a sentence: final accuracies, the verdict, the barrier without syncs."""
    final = {sync: _seeds(by_sync[sync], _result_acc) for sync in SYNC_NAMES}
    area = {sync: [_round_mean(run, _result_acc) for run in by_sync[sync]] for sync in SYNC_NAMES}
    none = by_sync["none"]
    return (
        f"syncs {_every(sched)}: align+average {pct(_mean(final['align+average']))}%, average {pct(_mean(final['average']))}% "
        f"({_compared(final['align+average'], final['average'])}), no sync {pct(_mean(final['none']))}% per model; "
        f"mean over the rounds {pct(_mean(area['align+average']))}%, {pct(_mean(area['average']))}% "
        f"({_compared(area['align+average'], area['average'])}) and {pct(_mean(area['none']))}%; without syncs the barrier goes "
        f"{num(_at(none, _plain_barrier, 0), 2)} → {num(_at(none, _plain_barrier), 2)} "
        f"(aligned {num(_at(none, _aligned_barrier, 0), 2)} → {num(_at(none, _aligned_barrier), 2)})"
    )


def federated_section(r: dict) -> tuple[list[str], list[str]]:
    """(markdown lines, headline sentences) of one result of experiments/federated.py."""
    task, setup = r["task"], r["setup"]
    st, seeds = setup["settings"], setup["seeds"]
    title = FEDERATED_TITLES.get(task, task)
    lines = [f"### {title}", ""]
    cpu = f", {r['cpu_seconds'] / 60:.1f} min of CPU" if r.get("cpu_seconds") else ""
    lines += [f"`{r['command']}` {origin(r)} ({r['size']} size, {r['seconds'] / 60:.1f} min{cpu})"
              + (f". {r['provenance_note']}" if r.get("provenance_note") else ""), ""]
    lines += [
        f"{setup['models']} models, each trained with AdamW on its own shard of {setup['shard_examples']} of the "
        f"{setup['train_examples']} training examples (batch {st['batch_size']}, learning rate {st['learning_rate']:g} "
        f"with warmup and cosine decay over {setup['epochs']} local epochs in all, Adam's moments reset at every round); "
        f"test metrics on {setup['test_examples']} test examples; loss barrier between models 0 and 1 on "
        f"α ∈ {{{', '.join(f'{a:g}' for a in setup['alphas'])}}}; "
        + (f"{seeds} seeds (init, shards and batch orders), means with the seeds' range in brackets." if seeds > 1
           else "one seed (init, shards and batch orders)."),
        "",
    ]
    parts = {}
    for sched in r["schedules"]:
        lines += _federated_tables(task, sched)
        for init, by_sync in sched["runs"].items():
            parts.setdefault(init, []).append(_federated_summary(sched, by_sync))
    headlines = [f"Federated averaging of {title}, {init} init (beyond the paper): final test accuracy, " + "; ".join(p) + "."
                 for init, p in parts.items()]
    lines += ["**What the data show** (computed from the runs above: align+average against the plain average on the "
              f"final accuracy and on its mean over the rounds (the area under the accuracy curve); \"helps\" or \"hurts\" "
              f"when every seed moves more than {100 * CLEAR:.0f} point the same way, \"mixed\" when the seeds differ):", ""]
    lines += [f"- {h}" for h in headlines] + [""]
    return lines, headlines


def states_section(r: dict) -> tuple[list[str], list[str]]:
    """(markdown lines, headline sentences) of `experiments/federated.py --states`: what each model's
    AdamW state becomes at a sync (reset, kept, moved by the alignment), on the same seeds."""
    task, st = r["task"], r["states"]
    title = FEDERATED_TITLES.get(task, task)
    lines = [f"### Optimizer states at a sync: {title}", "",
             f"`{r['command']}` {origin(r)} ({r['size']} size, {r['seconds'] / 60:.1f} min)", "",
             f"Syncs every {st['local_epochs']} local epochs ({st['rounds']} rounds of {st['steps_per_round']} steps), the "
             "seeds of the federated study above. At each sync every model's AdamW state is *reset* (fresh moments: the "
             "study above's setting, bit for bit when the same runs share a batch; here all ten runs of an init go through "
             "one batched program, and the training, chaotic, differs in its last bits from there on: compare within this "
             "table), *kept* (each model's own, in its old basis) or *moved* (after align+average, by the transform that "
             "aligned the model: `rj.transform_opt_state`, MATH §13); the learning-rate schedule runs on in every case. "
             "Test accuracy % of what each run leaves:", ""]
    header = ["init", "sync, state", "final", "mean over the rounds", "final loss"]
    rows = [[init, name, _pct_range(_seeds(runs, _result_acc)), pct(_mean([_round_mean(run, _result_acc) for run in runs])),
             num(_at(runs, _result_loss))] for init, by_name in st["runs"].items() for name, runs in by_name.items()]
    lines += table(header, rows)
    headlines = []
    for init, by_name in st["runs"].items():
        final = {name: _seeds(runs, _result_acc) for name, runs in by_name.items()}
        area = {name: [_round_mean(run, _result_acc) for run in runs] for name, runs in by_name.items()}
        moved, kept, reset = "align+average, moved state", "align+average, kept state", "align+average, reset state"
        headlines.append(
            f"Optimizer states at an align+average sync ({title}, {init} init): moved {pct(_mean(final[moved]))}%, kept "
            f"{pct(_mean(final[kept]))}%, reset {pct(_mean(final[reset]))}% final accuracy; moved against reset: "
            f"{_compared(final[moved], final[reset])} (mean over the rounds: {_compared(area[moved], area[reset])}); moved against kept: "
            f"{_compared(final[moved], final[kept])} (mean over the rounds: {_compared(area[moved], area[kept])}).")
    lines += ["**What the data show** (\"helps\" or \"hurts\" when every seed moves more than "
              f"{100 * CLEAR:.0f} point the same way):", ""] + [f"- {h}" for h in headlines] + [""]
    return lines, headlines


FEDERATED_INTRO = [
    "Beyond the paper: M models trained in one jitted loop (`experiments/federated.py`, the loop in",
    "`rotsym_experiments/federated.py`), each on its own shard of the training data, synced after every",
    "round of local epochs by *none* (independent training, the reference), *average* (every model reset",
    "to the plain parameter average) or *align+average* (models 1..M-1 moved onto model 0 by `rotsym_jax.align`",
    "inside the jitted round, then averaged). The runs of one seed share init, shards and batch orders, so",
    "they differ only in the sync. Every round records, before its sync, each model's test metrics, both",
    "merges' (in every run, so *none* shows what a one-shot merge would give) and the loss barrier between",
    "models 0 and 1 (MATH §7), plain and after alignment.",
    "",
]


def _machine(r: dict) -> str:
    return f"{r['machine']['platform']}, {r['machine'].get('cpus', '?')} CPU cores, Python {r['machine']['python']}, JAX {r['machine']['jax']}"


# ---- the residual stream (experiments/residual.py) -----------------------------------------------

RESIDUAL_INTRO = [
    "Beyond the paper (MATH.md §10): the residual stream permuted jointly with the paper's groups",
    "(`align(..., heads=\"permute\", residual=\"permutation\")`, coordinate descent), and for the",
    "RMSNorm Llama decoders also rotated after folding both models' norm gains (`rj.fold_norms`:",
    "same functions, another point in weight space, so its unmatched merge is a row of its own).",
    "First pair of each setting only; merges keep the anchor's task head (`task_head=\"anchor\"`).",
    "",
]
RESIDUAL_KINDS = ("qk", "vo", "ffn", "other", "total")


def residual_files() -> list[Path]:
    return largest_results(f"residual-{task}" for task in TASK_ORDER)


def residual_section(r: dict) -> tuple[list[str], list[str]]:
    lines = [f"### {TITLES.get(r['task'], r['task'])}", "",
             f"`{r['command']}` {origin(r)} ({r['size']} size, {r['seconds'] / 60:.1f} min)", ""]
    headlines = []
    for name, s in r["settings"].items():
        primary = s["evals"][0]
        rows = dict(s["variants"]) | {f"gains folded: {v}": x for v, x in s.get("folded", {}).items()}
        acc = ", ".join(pct(m[primary]["accuracy"]) for m in s["individual"])
        lines += [f"#### {name}", "", f"The two models, {primary} accuracy (%): {acc}.", ""]
        lines += [f"Distances between A and matched B, loss barrier on the linear path ({primary} loss), `align` seconds (compiled):", ""]
        lines += table(["variant", *RESIDUAL_KINDS, "distance per sweep", "barrier", "align s"], [
            [v, *(num(x["distance"][k]) for k in RESIDUAL_KINDS), " → ".join(num(d) for d in x["distance_per_sweep"] or []) or "-",
             num(x["barrier"]), num(x["align_seconds"], 2)] for v, x in rows.items()])
        methods = list(next(iter(rows.values()))["merges"])
        lines += [f"Merges of A and matched B ({primary} accuracy %):", ""]
        lines += table(["variant", *methods], [[v, *(pct(x["merges"][m][primary]["accuracy"]) for m in methods)] for v, x in rows.items()])
        average = lambda v, rows=rows, primary=primary: rows[v]["merges"]["average"][primary]["accuracy"]
        best = "+ residual perm."
        top = lambda v, rows=rows, primary=primary: max(rows[v]["merges"].items(), key=lambda kv: kv[1][primary]["accuracy"])
        (top_paper, m_paper), (top_best, m_best) = top("paper"), top(best)
        headlines.append(
            f"{TITLES.get(r['task'], r['task']).split(' (')[0]}, {name}: the residual stream permuted too takes the average merge "
            f"from {pct(average('paper'))}% (the paper's matching) to {pct(average(best))}%, the best merge from "
            f"{pct(m_paper[primary]['accuracy'])}% ({top_paper}) to {pct(m_best[primary]['accuracy'])}% ({top_best}), and the barrier from "
            f"{num(rows['paper']['barrier'])} to {num(rows[best]['barrier'])} nats"
            + (f"; rotated (gains folded{', the tied head untied' if s.get('untied') else ''}): "
               f"{pct(average('gains folded: + residual rotation'))}%, barrier "
               f"{num(rows['gains folded: + residual rotation']['barrier'])}" if "gains folded: + residual rotation" in rows else "") + ".")
    return lines, headlines


# ---- alignment from data (experiments/from_data.py) ----------------------------------------------

FROM_DATA_INTRO = [
    "Issue 34 (MATH.md §10-12): the paper's closed forms on the weights against the same groups matched",
    "on the models' activations, and against every transform learned on the merged model's loss",
    "(`align(..., method=\"learned\")`, from activation matching, 300 Adam steps at 1e-3, alpha = 1/2,",
    "the last quarter of the matching data held out for early stopping). The pair (model 0, model 1) of",
    "each setting; pre-norm models with their norm gains folded so that the residual stream may rotate",
    "(GPT-2's tied LM head untied first, `rj.untie`; before it, permuted). Barriers and the plain average's accuracy on the test set, which",
    "no alignment sees; matching data: the first training examples. `align s` includes compiling what",
    "a shape needs the first time (the different-init pair runs first, so the shared-init pair reuses it).",
    "",
]


def from_data_files() -> list[Path]:
    return largest_results(f"from-data-{task}" for task in ("vit", "gpt2", "llama", "qwen3"))


def _from_data_table(s: dict, variants: list[str]) -> list[str]:
    return table(["variant", "barrier (nats)", "plain average (%)", "distance", "align s"], [
        [v, num(s[v]["barrier"]), pct(s[v]["average_accuracy"]), num(s[v]["distance"]), num(s[v]["align_seconds"], 1) if s[v]["align_seconds"] else "-"]
        for v in variants])


def from_data_section(r: dict) -> tuple[list[str], list[str]]:
    lines = [f"### {TITLES.get(r['task'], r['task'])}", "",
             f"`{r['command']}` {origin(r)} ({r['size']} size, {r['seconds'] / 60:.1f} min)", ""]
    headlines = []
    for name, s in r["settings"].items():
        lines += [f"#### {name} (residual stream: {s['residual']}; {s['matching_examples']} matching examples)", ""]
        lines += _from_data_table(s, r["variants"])
        best = min(r["variants"][1:], key=lambda v: s[v]["barrier"])
        headlines.append(f"{TITLES.get(r['task'], r['task']).split(' (')[0]}, {name}: barrier {num(s['no matching']['barrier'])} nats unmatched, "
                         f"{num(s['weights (paper)']['barrier'])} with the paper's matching, {num(s['learned']['barrier'])} learned "
                         f"(plain average {pct(s['weights (paper)']['average_accuracy'])}% -> {pct(s['learned']['average_accuracy'])}%); "
                         f"best: {best}.")
    return lines, headlines


def width_section(r: dict) -> tuple[list[str], list[str]]:
    sweep = r["widths"]
    widths = sorted(sweep, key=int)
    what = "ViT digit pairs" if r["task"] == "vit" else f"{r['task']} decoder pairs"
    init = r.get("init", "different")
    stem = f"from-data-width-{'shared-' if init == 'shared' else ''}{r['task']}-{r['size']}"
    lines = [f"### The barrier against width ({init}-init {what})", "",
             f"`{r['command']}` {origin(r)} ({r['seconds'] / 60:.1f} min)", "",
             f"![barrier against width]({RESULTS.name}/{stem}.png)", ""]
    lines += table(["variant", *(f"d = {w}" for w in widths)], [[v, *(num(sweep[w][v]["barrier"]) for w in widths)] for v in r["variants"]])
    lines += ["Plain average's accuracy (%):", ""]
    lines += table(["variant", *(f"d = {w}" for w in widths)], [[v, *(pct(sweep[w][v]["average_accuracy"]) for w in widths)] for v in r["variants"]])
    learned = [sweep[w]["learned"]["barrier"] for w in widths]
    return lines, [f"Barrier against width ({what}, {init} init, learned): {', '.join(f'd={w}: {num(b)}' for w, b in zip(widths, learned))} nats."]


def budget_section(r: dict) -> tuple[list[str], list[str]]:
    """The learned barrier of the different-init pair against the learned method's steps and learning rate."""
    what = "ViT digit pair" if r["task"] == "vit" else f"{r['task']} decoder pair"
    (name, s), = r["settings"].items()
    lines = [f"### The learned barrier against its budget ({name} {what}, d = 64)", "",
             f"`{r['command']}` {origin(r)} ({r['seconds'] / 60:.1f} min)", ""]
    rows = [[v, num(s[v]["barrier"]), pct(s[v]["average_accuracy"]),
             s[v]["learned"]["best_step"] if "learned" in s[v] else "-", num(s[v]["align_seconds"], 1) if s[v]["align_seconds"] else "-"]
            for v in r["variants"]]
    lines += table(["variant", "barrier (nats)", "plain average (%)", "best step (held out)", "align s"], rows)
    best = min(r["variants"][1:], key=lambda v: s[v]["barrier"])
    return lines, [f"Learned barrier against its budget ({what}, {name}): best {num(s[best]['barrier'])} nats ({best})."]


def unit_scales_section(r: dict) -> tuple[list[str], list[str]]:
    """Issue 71: each method with a gated FFN's unit scales solved or not, on both pairs."""
    what = f"{r['task']} decoder pairs"
    lines = [f"### A gated FFN's unit scales ({what}, d = 64)", "",
             f"`{r['command']}` {origin(r)} ({r['seconds'] / 60:.1f} min). Each method as itself (no fallback), its FFN "
             "element the permutation alone or the permutation then each unit's scale (`ffn=\"scaled\"`, MATH §5).", ""]
    headlines = []
    for name, s in r["settings"].items():
        methods = [v for v in r["variants"][1:] if not v.endswith(", unit scales")]
        rows = [[v, num(s[v]["barrier"]), num(s[f"{v}, unit scales"]["barrier"]),
                 f"{s[f'{v}, unit scales']['barrier'] - s[v]['barrier']:+.3f}", pct(s[v]["average_accuracy"]),
                 pct(s[f"{v}, unit scales"]["average_accuracy"])] for v in methods]
        lines += [f"#### {name}", "", f"No matching: barrier {num(s['no matching']['barrier'])} nats.", ""]
        lines += table(["method", "barrier, permutation", "barrier, unit scales", "change", "average (%), permutation",
                        "average (%), unit scales"], rows)
        lines.append("")
        change = [s[f"{v}, unit scales"]["barrier"] - s[v]["barrier"] for v in methods]
        headlines.append(f"Unit scales ({what}, {name}): barrier changes {min(change):+.3f} to {max(change):+.3f} nats across the methods.")
    return lines, headlines


def defaults_section(r: dict) -> tuple[list[str], list[str]]:
    """Issue 72: the data methods with the defaults before, each group added, and the defaults now."""
    what = "ViT digit pairs" if r["task"] == "vit" else f"{r['task']} decoder pairs"
    lines = [f"### The data methods' defaults ({what}, d = 64)", "",
             f"`{r['command']}` {origin(r)} ({r['seconds'] / 60:.1f} min). \"before\" pins the defaults of before "
             f"({', '.join(f'{k}={v}' for k, v in r['learned_options']['before'].items())}); \"as given\": the models as trained, "
             "\"gains folded\": untied and folded first, as the command line does.", ""]
    headlines = []
    for name, s in r["settings"].items():
        lines += [f"#### {name}", ""]
        rows = []
        for v in r["variants"]:
            if v not in s:
                continue
            x = s[v]
            learned = x.get("learned", {})
            stop = learned.get("stopped_at") or (learned.get("steps") if learned else None)
            rows.append([v, num(x["barrier"]), pct(x["average_accuracy"]), x.get("settled", {}).get("residual", "-"),
                         f"{learned['best_step']} / {stop}" if learned else "-", num(x["align_seconds"], 1) if x["align_seconds"] else "-"])
        lines += [f"No matching: barrier {num(s['no matching']['barrier'])} nats, plain average {pct(s['no matching']['average_accuracy'])}%.", ""]
        lines += table(["variant", "barrier (nats)", "plain average (%)", "residual chosen", "best step / steps run", "align s"], rows)
        now = [v for v in r["variants"] if v.startswith("learned, defaults now") and v in s]
        headlines.append(f"Defaults ({what}, {name}): learned barrier {num(s['learned, defaults before']['barrier'])} nats with the defaults "
                         f"before, " + ", ".join(f"{num(s[v]['barrier'])} {v.split('now ')[1]}" for v in now) + " now.")
    return lines, headlines


HETEROGENEOUS_INTRO = [
    "Issue 51: different-init pairs of different widths. B (seed 1) is the narrower; it is widened to A's",
    "architecture with zero units or zero heads (MATH §15: the same function; the change in its test loss is",
    "given), then aligned and averaged as in the section above, or fused with A by OT fusion (square plans:",
    "B's zero units take part as units). Every merge has A's architecture. Test set.",
    "",
]


def heterogeneous_section(r: dict) -> tuple[list[str], list[str]]:
    lines = [f"`{r['command']}` {origin(r)} ({r['size']} size, {r['seconds'] / 60:.1f} min)", ""]
    headlines = []
    for task, p in r["pairs"].items():
        ends = p["endpoints"]
        lines += [f"#### {TITLES.get(task, task).split(' (')[0]}: {p['pair']} (A {pct(ends['a']['accuracy'])}%, loss {num(ends['a']['loss'])}; "
                  f"B {pct(ends['b']['accuracy'])}%, loss {num(ends['b']['loss'])}; widened B's loss moved {p['widened_b_loss_change']:.1e})", ""]
        v = p["variants"]
        names = [n for n in v if isinstance(v[n], dict) and "barrier" in v[n]]
        rows = [[n, num(v[n]["barrier"]), pct(v[n]["average_accuracy"]), num(v[n]["average_loss"])] for n in names]
        rows += [[f"OT fusion ({n})", "-", pct(o["accuracy"]), num(o["loss"])] for n, o in p["ot_fusion"].items()]
        lines += table(["merge", "barrier (nats)", "average (%)", "average loss"], rows)
        best_ot = max(p["ot_fusion"].values(), key=lambda o: o["accuracy"])
        headlines.append(f"{TITLES.get(task, task).split(' (')[0]}, {p['pair']}: endpoints {pct(ends['a']['accuracy'])}% / {pct(ends['b']['accuracy'])}%; "
                         f"average {pct(v['no matching']['average_accuracy'])}% unmatched, {pct(v['weights + residual']['average_accuracy'])}% "
                         f"weight-matched, {pct(v['learned']['average_accuracy'])}% learned; best OT fusion {pct(best_ot['accuracy'])}%.")
    return lines, headlines


LORA_INTRO = [
    "Issue 75: the rank a LoRA adapter needs (`rotsym extract-lora`, mergekit-extract-lora's extraction: every",
    "linear layer's delta T - B truncated by SVD), with the tuned model T taken as it is and moved onto the base B",
    "by the symmetries first (`--align`: the same function as T, weights method; the paper's groups, then with head",
    "permutations and the residual stream permuted too). Rank: the smallest uniform `--rank` whose adapter leaves an",
    "error ||delta - BA|| of at most the given fraction of the plain delta's norm (one absolute error for all rows).",
    "",
]


def lora_section(r: dict) -> tuple[list[str], list[str]]:
    lines = [f"`{r['command']}` {origin(r)} ({r['seconds'] / 60:.1f} min)", ""]
    errors = [f"{e:g}" for e in r["errors"]]
    rows = []
    for name, p in r["pairs"].items():
        for variant, v in p["variants"].items():
            rows.append([name, variant, num(v["delta_norm"]), pct(v["relative_to_plain"]), *(str(v["rank_for_error"][e]) for e in errors),
                         str(v["full_rank"])])
    lines += table(["pair", "tuned model", "norm of delta", "% of plain", *(f"rank for {float(e):.0%}" for e in errors), "full rank"], rows)
    headlines = []
    for name, p in r["pairs"].items():
        v = p["variants"]
        plain, best = v["plain"]["rank_for_error"], min((x["rank_for_error"] for k, x in v.items() if k != "plain"), key=lambda x: x["0.1"])
        headlines.append(f"LoRA rank for 10% / 1% error, {name}: {plain['0.1']} / {plain['0.01']} plain, {best['0.1']} / {best['0.01']} aligned first.")
    return lines, headlines


CHECK73_INTRO = [
    "Issue 73's independent check: each model built by transformers, B made from A in PyTorch (not by rotsym's own",
    "transforms) with a random orthogonal map per head on Q/K and on V/O at every attention site and a permutation of",
    "every FFN's units (RoPE-compatible per-pair rotations where RoPE applies), then `rotsym align A B OUT --heads",
    "permute` in memory and streamed. Errors: the largest output difference relative to A's largest output; distance:",
    "the planted tensors' distance to A's, relative to A's norm. A control with a broken plant must change B's outputs.",
    "",
]


def check73_section(r: dict) -> tuple[list[str], list[str]]:
    lines = [f"`{r['command']}` {origin(r)}", ""]
    rows = [[row["model"], "/".join(str(row["planted"][k]) for k in ("qk_head_maps", "vo_head_maps", "ffn_permutations", "attention_sites")),
             *(f"{row['function_error'][k]:.1e}" for k in ("B (torch)", "OUT in memory", "OUT streamed")),
             num(row["weight_distance"]["before"]), f"{max(row['weight_distance']['after (in memory)'], row['weight_distance']['after (streamed)']):.1e}",
             "yes" if row["pass"] else "**no**"] for row in r["rows"]]
    lines += table(["model", "QK / VO maps / FFN perms / sites", "B error", "OUT error, memory", "OUT error, streamed", "distance before",
                    "after", "pass"], rows)
    lines += ["", "Controls (a broken plant; B's error): " + "; ".join(
        f"{c['model']}, {c['broken plant']}: {c['function_error']:.3g}" + ("" if c["caught"] else " **not caught**") for c in r["controls"]) + ".", ""]
    worst = max(max(row["function_error"]["OUT in memory"], row["function_error"]["OUT streamed"]) for row in r["rows"])
    passed = sum(row["pass"] for row in r["rows"])
    return lines, [f"Issue 73's independent check (plants made in PyTorch): {passed} of {len(r['rows'])} models aligned back, "
                   f"their function kept within {worst:.1e} relative, streamed = in memory."]


CHECK71_INTRO = [
    "Issue 71's independent check: tiny checkpoints built by transformers, then the command line as documented, each",
    "run twice, in memory and with `--max-memory` small enough to stream (one layer a chunk): the output tensors, the",
    "reports (every field but timings, streaming, date, command and paths), the recipes, each option passed as recorded,",
    "`chosen` in both, and OUT's logits in transformers against B's (relative to the largest). A refusal passes where",
    "the documentation states it.",
    "",
]


def check71_section(r: dict) -> tuple[list[str], list[str]]:
    lines = [f"`{r['command']}` {origin(r)} ({r['seconds'] / 60:.1f} min)", "", *r["table"], ""]
    ran = [row for row in r["rows"] if not row.get("refused")]
    same = sum(bool(row.get("tensors", {}).get("identical")) and not row.get("report_differences") for row in ran)
    passed = sum(row["pass"] for row in r["rows"])
    return lines, [f"Issue 71's independent check: {passed} of {len(r['rows'])} runs pass; {same} of {len(ran)} that ran wrote the same "
                   "tensors and report in memory and streamed."]


SEAMS_INTRO = [
    "Issue 75: frankenmerges (mergekit's `slices:` + passthrough, run by `rotsym merge CONFIG.yml OUT`) of two",
    "4-layer Llama-style decoders of the sequence task: `swap k` is A's layers [0, k) then B's [k, 4), `deeper k`",
    "A's four then B's [k, 4). Plain, B's layers read a stream written in A's basis; with aligned seams",
    "(`rotsym: {align: anchor}`) B's residual stream is first moved into A's (weights method; a permutation, or a",
    "rotation with the norm gains folded: the default, `residual: auto`, for pre-norm families). Test set.",
    "",
]


def seams_section(r: dict) -> tuple[list[str], list[str]]:
    lines = [f"`{r['command']}` {origin(r)} ({r['seconds'] / 60:.1f} min; Bayes optimum {pct(r['bayes']['accuracy'])}%, "
             f"loss {num(r['bayes']['loss'])})", ""]
    headlines = []
    for name, p in r["pairs"].items():
        lines += [f"#### {name} (A {pct(p['A']['accuracy'])}%, loss {num(p['A']['loss'])}; B {pct(p['B']['accuracy'])}%, "
                  f"loss {num(p['B']['loss'])})", ""]
        lines += table(["stack", *(f"{v}: loss / accuracy (%)" for v in r["variants"])],
                       [[shape, *(f"{num(row[v]['loss'])} / {pct(row[v]['accuracy'])}" for v in r["variants"])]
                        for shape, row in p["stacks"].items()])
        deeper = [row for shape, row in p["stacks"].items() if shape.startswith("deeper")]
        mean = {v: sum(row[v]["accuracy"] for row in deeper) / len(deeper) for v in r["variants"]}
        headlines.append(f"Stacked layers, {name}: A's 4 layers then B's last ones, {pct(mean[r['variants'][0]])}% plain, "
                         + ", ".join(f"{pct(mean[v])}% with {v}" for v in r["variants"][1:]) + " (mean over the seams).")
    return lines, headlines


MOE_INTRO = [
    "Issue 35: two Mixtral-style decoders (`seqtask.mixtral_config`: 4 experts, top 2) trained on the sequence",
    "task, merged after matching nothing, the attention only, each expert's units to the expert of the same",
    "index (what treating every expert as an FFN of its own gives), the experts themselves (the nested",
    "E x E assignment, MATH §9), and the residual stream too (norm gains folded), from weights, and all of it",
    "from activations (256 training sequences: the router's logits and every expert's hidden units are the",
    "experts' sites). Test set; inner assignments: those the exact search solved against the naive E² per layer",
    "(per sweep of a residual descent).",
    "",
]


ACTS = "from activations + residual rotation"


def moe_section(r: dict) -> tuple[list[str], list[str]]:
    lines = [f"`{r['command']}` {origin(r)} ({r['size']} size, {r['seconds'] / 60:.1f} min)", ""]
    headlines = []
    for width, settings in sorted(r["widths"].items(), key=lambda item: int(item[0])):
        for name, s in settings.items():
            models = ", ".join(f"{pct(m['accuracy'])}%" for m in s["models"])
            lines += [f"#### d = {width}, {name} ({s['experts']} experts of {s['units']} units, {s['layers']} layers; models {models})", ""]
            lines += table(["variant", "barrier (nats)", "plain average (%)", "distance", "align s", "inner assignments"], [
                [v, num(s[v]["barrier"]), pct(s[v]["average_accuracy"]), num(s[v]["distance"]),
                 num(s[v]["align_seconds"], 1) if s[v]["align_seconds"] else "-",
                 f"{s[v]['inner_assignments']} of {s[v]['naive_inner_assignments']}" if "inner_assignments" in s[v] else "-"]
                for v in r["variants"]])
            full = s["attention + experts"]
            headlines.append(f"Mixtral-style decoders, d = {width}, {name}: barrier {num(s['no matching']['barrier'])} unmatched, "
                             f"{num(s['experts by index']['barrier'])} experts by index, {num(full['barrier'])} experts matched, "
                             f"{num(s['+ residual rotation']['barrier'])} with the residual stream"
                             + (f", {num(s[ACTS]['barrier'])} matched from activations" if ACTS in s else "")
                             + "; the exact expert search solved "
                             f"{full['inner_assignments']} of {full['naive_inner_assignments']} inner assignments.")
    return lines, headlines


MOE_FROM_DENSE_INTRO = [
    "Issue 75: Mixtral mixtures made of dense Llama decoders (`rotsym moe` = mergekit-moe: the base's attention,",
    "norms, embeddings and LM head, each expert model's FFN, top 2, gates from the base), the base model 0 and the",
    "experts models 1, 2 (none trained on the base's stream) or 0, 1, 2; gates `hidden` and `cheap_embed` from 16",
    "training sequences an expert (those ending in a token e modulo the number of experts), `random` from seed 0.",
    "mergekit-moe takes the models as they are; aligned, each expert's model is first moved onto the base",
    "(`rotsym.align: true`: head permutations and the residual stream permuted or rotated, from the weights or from",
    "the activations of 256 training sequences), and with `shared: average` the shared tensors are then averaged.",
    "Test-set next-token accuracy (loss in nats); each dense model alone reaches the Bayes-optimal 70%.",
    "",
]


def moe_from_dense_section(r: dict) -> tuple[list[str], list[str]]:
    lines = [f"`{r['command']}` {origin(r)} ({r['seconds'] / 60:.1f} min)", ""]
    headlines = []
    for name, s in r["settings"].items():
        models = ", ".join(f"{pct(m['accuracy'])}%" for m in s["models"])
        columns = [(set_name, mode) for set_name, modes in s["mixtures"].items() for mode in modes]
        lines += [f"#### {name} (dense models {models})", ""]
        lines += table(["variant", *(f"{set_name}: {mode}" for set_name, mode in columns)], [
            [variant, *(f"{pct(s['mixtures'][c][m][variant]['accuracy'])} ({num(s['mixtures'][c][m][variant]['loss'], 2)})" for c, m in columns)]
            for variant in r["variants"]])
        hidden = s["mixtures"]["experts 1, 2"]["hidden"]
        best = max(hidden, key=lambda v: hidden[v]["accuracy"])
        headlines.append(f"Mixtures from dense models (mergekit-moe), {name}, experts 1, 2 with hidden gates: "
                         f"{pct(hidden['mergekit-moe']['accuracy'])}% as mergekit-moe builds them, {pct(hidden[best]['accuracy'])}% "
                         f"with the experts aligned onto the base ({best}); the dense models reach {models}.")
    return lines, headlines


def render() -> str:
    body, headlines, machines = [], [], set()

    def add(results: list[dict], section) -> None:
        """Each result's section (markdown lines, headlines) into the page, its machine noted."""
        for r in results:
            machines.add(_machine(r))
            lines, headline = section(r)
            body.extend(lines)
            headlines.extend(headline)
    for path in experiment_files():
        r = json.loads(path.read_text())
        machines.add(_machine(r))
        body += [f"## {TITLES.get(r['task'], r['task'])}", ""]
        body += [f"`{r['command']}` {origin(r)} ({r['size']} size, {r['seconds'] / 60:.1f} min)"
                 + (f". {r['provenance_note']}" if r.get("provenance_note") else ""), ""]
        for name, s in r["settings"].items():
            lines, headline = setting_section(r["task"], name, s, RESULTS.name)
            body += lines
            headlines += headline
    residual = [json.loads(path.read_text()) for path in residual_files()]
    if residual:
        body += ["## The residual stream, aligned too", "", *RESIDUAL_INTRO]
    add(residual, residual_section)
    from_data = [json.loads(path.read_text()) for path in from_data_files()]
    width = [json.loads(path.read_text()) for path in largest_results(f"from-data-width-{init}{task}" for init in ("", "shared-")
                                                                        for task in ("vit", "gpt2", "llama", "qwen3"))]
    if from_data or width:
        body += ["## Alignment from data: activations and learned transforms", "", *FROM_DATA_INTRO]
    add(from_data, from_data_section)
    add(width, width_section)
    add([json.loads(path.read_text()) for path in largest_results(f"from-data-budget-{task}" for task in ("vit", "gpt2", "llama", "qwen3"))],
        budget_section)
    add([json.loads(path.read_text()) for path in largest_results(f"from-data-defaults-{task}" for task in ("vit", "gpt2", "llama", "qwen3"))],
        defaults_section)
    add([json.loads(path.read_text()) for path in largest_results(f"from-data-unit-scales-{task}" for task in ("vit", "gpt2", "llama", "qwen3"))],
        unit_scales_section)
    heterogeneous = [json.loads(path.read_text()) for path in largest_results(["heterogeneous"])]
    if heterogeneous:
        body += ["### Models of different widths", "", *HETEROGENEOUS_INTRO]
    add(heterogeneous, heterogeneous_section)
    federated = [json.loads(path.read_text()) for path in federated_files()]
    if federated:
        body += ["## Federated averaging with and without alignment", "", *FEDERATED_INTRO]
    add(federated, federated_section)
    add([json.loads(path.read_text()) for path in largest_results(f"federated-states-{task}" for task in FEDERATED_TASKS)], states_section)
    moe = [json.loads(path.read_text()) for path in largest_results(["moe"])]
    if moe:
        body += ["## Mixtures of experts: matching the experts", "", *MOE_INTRO]
    add(moe, moe_section)
    from_dense = [json.loads((RESULTS / "moe-from-dense.json").read_text())] if (RESULTS / "moe-from-dense.json").is_file() else []
    if from_dense:
        body += ["## Mixtures of experts from dense models: aligned first or not", "", *MOE_FROM_DENSE_INTRO]
    add(from_dense, moe_from_dense_section)
    seams = [json.loads((RESULTS / "stack-seams.json").read_text())] if (RESULTS / "stack-seams.json").is_file() else []
    if seams:
        body += ["## Stacked layers: aligned seams", "", *SEAMS_INTRO]
    add(seams, seams_section)
    check73 = [json.loads((RESULTS / "check_issue73.json").read_text())] if (RESULTS / "check_issue73.json").is_file() else []
    if check73:
        body += ["## Planted symmetries undone on checkpoints transformers writes", "", *CHECK73_INTRO]
    add(check73, check73_section)
    check71 = [json.loads((RESULTS / "check_issue71.json").read_text())] if (RESULTS / "check_issue71.json").is_file() else []
    if check71:
        body += ["## A run is the same whether it streams, on checkpoints transformers writes", "", *CHECK71_INTRO]
    add(check71, check71_section)
    lora = [json.loads((RESULTS / "lora-rank.json").read_text())] if (RESULTS / "lora-rank.json").is_file() else []
    if lora:
        body += ["## LoRA extraction: the rank, with and without alignment", "", *LORA_INTRO]
    add(lora, lora_section)
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
