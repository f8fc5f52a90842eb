"""benchmarks/RESULTS.md is written from the JSON results by benchmarks/write_results.py, never by
hand: the committed file must equal what the script renders from the committed JSON."""

import importlib.util
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
_spec = importlib.util.spec_from_file_location("write_results", BENCHMARKS / "write_results.py")
write_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(write_results)


def test_results_md_is_rendered_from_the_json():
    rendered = write_results.render()
    committed = (BENCHMARKS / "RESULTS.md").read_text()
    assert rendered == committed, "RESULTS.md is stale or was edited by hand: run `make results`"


def test_every_linked_figure_exists():
    text = (BENCHMARKS / "RESULTS.md").read_text()
    links = [line.split("](", 1)[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert links, "RESULTS.md links no figures"
    missing = [link for link in links if not (BENCHMARKS / link).is_file()]
    assert not missing


def test_headlines_quote_the_json():
    path = write_results.experiment_files()[0]
    r = json.loads(path.read_text())
    name, setting = next(iter(r["settings"].items()))
    _, headline = write_results.setting_section(r["task"], name, setting, "x")
    before = setting["curves"]["no matching"]["barrier"]
    after = setting["curves"]["paper"]["barrier"]
    assert f"loss barrier {before:.3g} → {after:.3g}" in headline[0]
    gains = {m: row["matching"]["test"]["accuracy"] - row["no matching"]["test"]["accuracy"] for m, row in setting["fusion"].items()}
    helped = sum(g > write_results.CLEAR for g in gains.values())
    assert f"matching helps {helped} of {len(gains)} methods" in headline[0]
