"""experiments/RESULTS.md and benchmarks/RESULTS.md are written from the JSON results by the
write_results.py beside each, never by hand: each committed file must equal what its script
renders from the committed JSON."""

import importlib.util
import json
from pathlib import Path

import pytest

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
