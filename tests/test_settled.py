"""Found by a new-user trial: `rotsym align` reports `settled` (what a ceiling on a model of several
streams became on each, `--residual rotation` on CLIP: its image tower takes permutations), but
`rotsym merge`'s report did not, and neither command's printed summary said it. Now merge's report
carries it (in memory and streamed, anchor and many, by align's rule) and both summaries say it in
one line, only where it is not what was asked."""

import json
from pathlib import Path

import pytest
from test_dual import Dual

from rotsym_jax import cli
from rotsym_jax.transforms import RESIDUAL

pytestmark = pytest.mark.usefixtures("float32_models")

STREAMS = {RESIDUAL: "rotation", "text_residual": "rotation", "vision_residual": "permutation"}
LINE = "settled: residual='rotation' is a ceiling on 3 streams: vision_residual permutation; the others rotation"


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    root = tmp_path_factory.mktemp("settled")
    dual = Dual("clip", root / "a")
    dual.planted(root / "b")
    return str(dual.a), str(root / "b"), root


def _report(out) -> dict:
    return json.loads((out / "rotsym_report.json").read_text())["result"]


@pytest.mark.parametrize("align", ["anchor", "many"])
@pytest.mark.parametrize("streamed", [False, True], ids=["memory", "streamed"])
def test_merges_report_and_summary_say_what_the_ceiling_settled(clip, align, streamed, capsys):
    a, b, root = clip
    out = root / f"merge-{align}-{streamed}"
    extra = ["--max-memory", "3G"] if streamed else []
    assert cli.main(["merge", "--method", "average", a, b, str(out), "--align", align, "--residual", "rotation", *extra]) == 0
    printed = capsys.readouterr().out.splitlines()
    settled = _report(out)["alignment"]["settled"]
    assert settled["streams"] == STREAMS and "is a ceiling on a model of 3 streams" in settled["streams_why"], settled
    assert LINE in printed, printed


def test_align_says_it_in_one_line_and_nothing_where_every_stream_takes_what_was_asked(clip, capsys):
    a, b, root = clip
    assert cli.main(["align", a, b, str(root / "rotated"), "--residual", "rotation"]) == 0
    assert LINE in capsys.readouterr().out.splitlines()
    assert _report(root / "rotated")["settled"]["streams"] == STREAMS
    for command in (["align", a, b, str(root / "permuted")], ["merge", "--method", "average", a, b, str(root / "merged")]):
        assert cli.main([*command, "--residual", "permutation"]) == 0
        assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("settled")]
        report = _report(Path(command[-1]))
        assert not report.get("settled") and not report.get("alignment", {}).get("settled"), report
