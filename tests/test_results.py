"""experiments/RESULTS.md and benchmarks/RESULTS.md are written from the JSON results by the
write_results.py beside each, never by hand: each committed file must equal what its script
renders from the committed JSON."""

import importlib.util
import json
from pathlib import Path

import pytest

from rotsym_experiments import digits

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS, BENCHMARKS = ROOT / "experiments", ROOT / "benchmarks"


def _load(folder: Path):
    spec = importlib.util.spec_from_file_location(f"write_results_{folder.name}", folder / "write_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


write_experiments, write_benchmarks = _load(EXPERIMENTS), _load(BENCHMARKS)


@pytest.mark.parametrize("folder, write_results", [(EXPERIMENTS, write_experiments), (BENCHMARKS, write_benchmarks)])
def test_results_md_is_rendered_from_the_json(folder, write_results):
    rendered = write_results.render()
    committed = (folder / "RESULTS.md").read_text()
    assert rendered == committed, "RESULTS.md is stale or was edited by hand: run `make results`"


def test_every_linked_figure_exists():
    text = (EXPERIMENTS / "RESULTS.md").read_text()
    links = [line.split("](", 1)[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert links, "RESULTS.md links no figures"
    missing = [link for link in links if not (EXPERIMENTS / link).is_file()]
    assert not missing


def _result_files():
    return sorted([*(EXPERIMENTS / "results").rglob("*.json"), *(BENCHMARKS / "results").rglob("*.json")])


def test_every_result_names_its_commit_command_and_device():
    assert _result_files()
    for path in _result_files():
        r = json.loads(path.read_text())
        assert "commit" in r and r.get("command"), f"{path.name}: no commit/command field"
        assert r["commit"] or r.get("provenance_note"), f"{path.name}: no commit and no note saying why"
        device = r.get("device") or r.get("machine", {}).get("device")
        assert device, f"{path.name}: no device"


def test_headline_from_hand_computed_numbers():
    """A real setting's JSON with the numbers the headline quotes replaced by round ones, against
    the sentence written out by hand (the renderer's constants are not used)."""
    r = json.loads(write_experiments.experiment_files()[0].read_text())
    setting = next(iter(r["settings"].values()))
    setting["distances"]["no matching"]["total"], setting["distances"]["paper"]["total"] = 10.0, 8.0
    setting["curves"]["no matching"]["barrier"], setting["curves"]["paper"]["barrier"] = 0.5, 0.125
    fusion = {
        "average": (0.50, 0.70),  # +20 points: helps
        "fisher": (0.60, 0.605),  # +0.5 point: no clear change
        "regmean": (0.80, 0.70),  # -10 points: hurts
    }
    primary = setting["pairs"][0]["evals"][0]
    setting["fusion"] = {
        m: {"no matching": {primary: {"accuracy": a}}, "matching": {primary: {"accuracy": b}}} for m, (a, b) in fusion.items()
    }
    _, headline = write_experiments.setting_section("vit", "S", setting, "x")
    assert headline == [
        "ViTs on scikit-learn digits, S: matching moves B 20.0% closer to A (10.00 → 8.00); loss barrier 0.5 → 0.125; "
        "the plain average 50.0% → 70.0% (helps); matching helps 1 of 3 methods by more than 1 point (average) and hurts regmean."
    ]


def test_missed_targets_are_flagged(tmp_path):
    r = json.loads((BENCHMARKS / "results" / "align_speed-nvidia-h100-80gb-hbm3.json").read_text())
    name = next(iter(r["align"]))
    r["align"] = {"fast/x": {**r["align"][name], "ratio_to_floor": 1.1}, "slow/x": {**r["align"][name], "ratio_to_floor": 1.5}}
    r["solver"] = {
        "roberta-base/ok": {"numpy_loop_s": 0.3, "batched_none_s": 0.004, "batched_sequential_s": 0.005, "speedup": 75.0},
        "bert-large/slow": {"numpy_loop_s": 0.3, "batched_none_s": 0.012, "batched_sequential_s": 0.013, "speedup": 25.0},
    }
    r["first_call"] = {"roberta-base/planted": {"no_cache": {"first_s": 6.0, "warm_s": 0.5}}}
    r["peer_check"]["first_call"] = {"first_s": 4.0, "warm_s": 1.0}
    path = tmp_path / "align_speed-gpu.json"
    path.write_text(json.dumps(r))
    text = "\n".join(write_benchmarks.align_speed_section(path))
    assert "| fast/x |" in text and text.split("| fast/x |")[1].split("\n")[0].rstrip().endswith("| met |")
    assert text.split("| slow/x |")[1].split("\n")[0].rstrip().endswith("| **missed** |")
    assert text.split("| roberta-base/ok |")[1].split("\n")[0].rstrip().endswith("| met |")
    assert text.split("| bert-large/slow |")[1].split("\n")[0].rstrip().endswith("| **missed** |")
    missed = text.split("**Targets missed** in this run: ")[1]
    assert "slow/x total 1.50×" in missed and "bert-large/slow solve 12.00 ms, 25×" in missed
    assert "roberta-base/planted no_cache first call 6.00 s (target ≤ 5 s)" in missed
    assert "fast/x" not in missed and "roberta-base/ok" not in missed and "peer pair" not in missed


# ---- the figures the documentation quotes ------------------------------------------------------
# Each quoted sentence is rebuilt from the JSON it cites: a re-run that moves a figure (or turns
# "falls" into "rises") fails here until the page says what the results say.


def _result(name: str) -> dict:
    return json.loads((EXPERIMENTS / "results" / f"{name}.json").read_text())


def _pct(accuracy: float) -> str:
    return f"{100 * accuracy:.1f}"


def _closer(distances: dict) -> str:
    """How much closer the paper's matching brings B, in %, from a variant -> distance table."""
    return f"{100 * (1 - distances['paper'] / distances['no matching']):.1f}"


def _move(before: float, after: float) -> str:
    return f"{'falls' if after < before else 'rises'} from {_pct(before)}% to {_pct(after)}%"


def _residual(task: str, setting: str = "different init") -> dict:
    """A residual experiment's rows (folded ones prefixed "folded "): distance, barrier, merges."""
    s = _result(f"residual-{task}-full")["settings"][setting]
    return {**s["variants"], **{f"folded {k}": v for k, v in s["folded"].items()}}


def _average(row: dict) -> float:
    return row["merges"]["average"]["test"]["accuracy"]


def _best(row: dict) -> str:
    method, scores = max(row["merges"].items(), key=lambda kv: kv[1]["test"]["accuracy"])
    return f"{_pct(scores['test']['accuracy'])}% ({method})"


def _fusion(task: str, setting: str) -> dict:
    """A main experiment's setting: its fusion table's test accuracies, {method: (no matching, matching)}."""
    s = _result(f"{task}-full")["settings"][setting]
    e = s["pairs"][0]["evals"][0]
    return {m: (row["no matching"][e]["accuracy"], row["matching"][e]["accuracy"]) for m, row in s["fusion"].items()}


def _helped(fusion: dict) -> int:
    return sum(write_experiments.verdict(*pair) == "helps" for pair in fusion.values())


def _readme_claims() -> list[str]:
    vit = _residual("vit")
    none, paper, permuted, rotated = vit["no matching"], vit["paper"], vit["+ residual perm."], vit["folded + residual rotation"]
    gpt2 = _result("from-data-gpt2-full")["settings"]["different init"]
    minilm = _fusion("minilm", "fine-tuned from MiniLM")["average"]
    # which models the ViT numbers come from, and how the demo's differ (its numbers are its own)
    vits = digits.vit_config(**_result("residual-vit-full")["size_config"]["extra"]["config"])
    return [
        f"Two ViTs of {vits.num_hidden_layers} layers (d = {vits.hidden_size}, {vits.num_attention_heads} heads) trained on "
        f"scikit-learn's digits from different initialisations (`python experiments/residual.py --task vit`):",
        f"`make demo` runs this comparison on the same ViTs at {digits.vit_config().num_hidden_layers} layers instead of "
        f"{vits.num_hidden_layers} (`rotsym demo`: seeds 0 and 1, {digits.TrainSettings().epochs} epochs,",
        f"The paper's matching brings B {_closer({k: r['distance']['total'] for k, r in vit.items()})}% closer to A, yet their plain "
        f"average {_move(_average(none), _average(paper))} accuracy.",
        f"Permuting the residual stream as well takes that average to {_pct(_average(permuted))}%, and the best merge from "
        f"{_best(paper)} to {_best(permuted)}.",
        f"Rotating it instead (norm gains folded first) takes the average to {_pct(_average(rotated))}% and the best merge to "
        f"{_best(rotated)}.",
        f"the barrier on the straight path falls from {gpt2['weights (paper)']['barrier']:.2f} nats (the paper's matching) to "
        f"{gpt2['weights + residual']['barrier']:.2f} with the stream rotated, and to "
        f"{gpt2['learned, invertible maps']['barrier']:.2f} with every map learned.",
        f"their plain average already works ({_pct(minilm[0])}%, "
        + ("unchanged by alignment)." if _pct(minilm[0]) == _pct(minilm[1]) else f"{_pct(minilm[1])}% aligned)."),
    ]


def _choosing_claims() -> list[str]:
    minilm_s = _result("minilm-full")["settings"]["fine-tuned from MiniLM"]
    minilm = _fusion("minilm", "fine-tuned from MiniLM")
    gpt2 = _fusion("gpt2", "shared init")
    quiet = [write_experiments.verdict(*_fusion(task, "shared init")["average"]) for task in ("vit", "llama")]
    vit, learned = _residual("vit"), _result("from-data-vit-full")["settings"]["different init"]
    gpt2_res, llama_res = _residual("gpt2"), _residual("llama")
    helped = _helped(minilm)
    layers = digits.vit_config(**_result("residual-vit-full")["size_config"]["extra"]["config"]).num_hidden_layers
    return [
        f"`rotsym demo` runs this comparison end to end on two ViTs of {digits.vit_config().num_hidden_layers} layers",
        f"the ViT numbers above are the experiments' ViTs of {layers} layers.",
        f"Matching moves B {_closer({k: d['total'] for k, d in minilm_s['distances'].items()})}% closer to A.",
        f"Their plain average stays at {_pct(minilm['average'][0])}% accuracy." if _pct(minilm["average"][0]) == _pct(minilm["average"][1])
        else "the MiniLM average moved",
        f"Matching helps {helped or 'none'} of {len(minilm)} merge methods by more than a point.",
        f"The paper's matching takes the plain average from {_pct(gpt2['average'][0])}% to {_pct(gpt2['average'][1])}%.",
        f"It helps {_helped(gpt2)} of {len(gpt2)} methods.",
        "ViTs on digits and Llama-style decoders: no clear change." if quiet == ["no clear change"] * 2 else f"ViT, Llama: {quiet}",
        f"ViTs on digits: the paper's matching brings B {_closer({k: r['distance']['total'] for k, r in vit.items()})}% closer, "
        f"yet the plain average {_move(_average(vit['no matching']), _average(vit['paper']))}.",
        f"| the paper's matching | average {_pct(_average(vit['paper']))}%, best merge {_best(vit['paper'])} |",
        f"| `--residual permutation` | average {_pct(_average(vit['+ residual perm.']))}%, best merge {_best(vit['+ residual perm.'])} |",
        f"| `--residual rotation` | average {_pct(_average(vit['folded + residual rotation']))}%, best merge "
        f"{_best(vit['folded + residual rotation'])} |",
        f"| `method=\"learned\"` (Python) | average {_pct(learned['learned']['average_accuracy'])}%, barrier "
        f"{learned['weights (paper)']['barrier']:.2f} → {learned['learned']['barrier']:.2f} nats |",
        f"GPT-2-style decoders, different seeds, `--residual permutation`: the average "
        f"{_move(_average(gpt2_res['paper']), _average(gpt2_res['+ residual perm.']))}, the best merge "
        f"{_move(*(max(r['merges'][m]['test']['accuracy'] for m in r['merges']) for r in (gpt2_res['paper'], gpt2_res['+ residual perm.'])))}.",
        f"`--residual rotation` (gains folded first, which `rotsym align` does) takes the average to "
        f"{_pct(_average(llama_res['folded + residual rotation']))}%.",
    ]


def _python_guide_claims() -> list[str]:
    vit = _result("from-data-vit-full")["settings"]["different init"]
    gpt2 = _result("from-data-gpt2-full")["settings"]["different init"]
    llama = _result("from-data-width-llama-full")["widths"]
    heads = {task: _result(f"{task}-full")["settings"]["different init"]["distances"] for task in ("vit", "gpt2")}
    shared = [d for task in ("vit", "gpt2", "llama") for d in [_result(f"{task}-full")["settings"]["shared init"]["distances"]]]
    shared.append(_result("minilm-full")["settings"]["fine-tuned from MiniLM"]["distances"])
    unmoved = all(f"{d['paper']['total']:.3f}" == f"{d['+ head perm.']['total']:.3f}" for d in shared)
    return [
        f"the barrier falls from {vit['no matching']['barrier']:.2f} nats (unmatched) and {vit['weights (paper)']['barrier']:.2f} "
        f"(the paper's matching) to {vit['weights + residual']['barrier']:.2f} with the residual rotation, "
        f"{vit['activations']['barrier']:.2f} from activations and {vit['learned']['barrier']:.2f} learned "
        f"({vit['learned']['learned']['steps']} steps), the plain average's accuracy from "
        f"{100 * vit['no matching']['average_accuracy']:.0f}% to {100 * vit['learned']['average_accuracy']:.0f}%.",
        f"learned barriers {gpt2['learned']['barrier']:.2f} (GPT-2) and {llama['64']['learned']['barrier']:.2f} (Llama) at d = 64, "
        f"{llama['128']['learned']['barrier']:.2f} for Llama at d = 128",
        "different inits ("
        + ", ".join(f"{name} {heads[t]['paper']['total']:.3f} → {heads[t]['+ head perm.']['total']:.3f}" for t, name in (("vit", "ViT"), ("gpt2", "GPT-2")))
        + ") and " + ("changed nothing for shared inits and fine-tunes" if unmoved else "moved shared inits too"),
    ]


def _math_claims() -> list[str]:
    gpt2 = _residual("gpt2")
    return [f"the barrier {gpt2['+ residual perm.']['barrier']:.2f} nats with the tie and a permuted stream, "
            f"{gpt2['folded + residual rotation']['barrier']:.2f} untied and rotated"]


def _moe_from_dense(setting: str) -> dict:
    return _result("moe-from-dense")["settings"][setting]["mixtures"]["experts 1, 2"]["hidden"]


def _readme_moe_claims() -> list[str]:
    apart = _moe_from_dense("different init")
    return [f"(experts trained from other inits: {_pct(apart['mergekit-moe']['accuracy'])}% -> "
            f"{_pct(apart['aligned from activations, residual rot.']['accuracy'])}% next-token accuracy"]


def _merging_claims() -> list[str]:
    apart, shared = _moe_from_dense("different init"), _moe_from_dense("shared init")
    return [f"reaches {_pct(apart['mergekit-moe']['accuracy'])}% next-token accuracy as mergekit-moe builds it, "
            f"{_pct(apart['aligned, residual rot.']['accuracy'])}% with the experts aligned from the weights (residual rotation) and "
            f"{_pct(apart['aligned from activations, residual rot.']['accuracy'])}% aligned from activations",
            f"{_pct(shared['mergekit-moe']['accuracy'])}%, {_pct(shared['aligned, residual rot.']['accuracy'])}% (each expert with its own "
            f"folded norm gain) and {_pct(shared['aligned, residual rot. + shared averaged']['accuracy'])}% with the shared tensors averaged"]


QUOTING = {"README.md": lambda: _readme_claims() + _readme_moe_claims(), "docs/guides/merging.md": _merging_claims,
           "docs/guides/choosing.md": _choosing_claims, "docs/guides/python.md": _python_guide_claims,
           "docs/MATH.md": _math_claims}


@pytest.mark.parametrize("page", QUOTING)
def test_the_docs_quote_the_results_as_they_are(page):
    text = " ".join((ROOT / page).read_text().split())  # lines rewrapped, list markers kept
    missing = [claim for claim in QUOTING[page]() if claim not in text]
    assert not missing, f"{page} does not say, as the results now do:\n" + "\n".join(missing)
