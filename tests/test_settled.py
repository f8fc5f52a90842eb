"""Found by a new-user trial: `rotsym align` reports `settled` (what a ceiling on a model of several
streams became on each, `--residual rotation` on CLIP: its image tower takes permutations), but
`rotsym merge`'s report did not, and neither command's printed summary said it. Now merge's report
carries it (in memory and streamed, anchor and many, by align's rule) and both summaries say it in
one line, only where it is not what was asked."""

import json
from pathlib import Path

import jax
import pytest
import transformers as tf
from family_cases import GPT2
from parity_utils import save_reference
from test_dual import Dual

import rotsym_jax as rj
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


def test_ffn_scaled_on_a_model_without_a_gated_ffn_is_settled_in_the_report(tmp_path):
    """--ffn scaled on GPT-2 (a GELU FFN: no gate, so no unit scale keeps the function) permutes its
    units alone; that was said only in a note --quiet hides, while the report recorded
    ffn 'scaled' (issue 71's independent check). The report's settled says it, in memory and
    streamed alike, and in Python; a gated FFN settles nothing."""
    for seed in (0, 1):
        save_reference(tf.GPT2LMHeadModel, tf.GPT2Config(**GPT2), tmp_path / f"m{seed}", seed=seed)
    a, b = str(tmp_path / "m0"), str(tmp_path / "m1")
    for out, extra in (("memory", []), ("streamed", ["--max-memory", "2G"])):
        assert cli.main(["align", a, b, str(tmp_path / out), "--quiet", "--ffn", "scaled", *extra]) == 0
    settled = [_report(tmp_path / out)["settled"] for out in ("memory", "streamed")]
    assert settled[0] == settled[1] and settled[0]["ffn"] == "permutation" and "no gated FFN group" in settled[0]["ffn_why"], settled
    ck_a, ck_b = rj.load_hf(a), rj.load_hf(b)
    assert rj.align(ck_a.params, ck_b.params, rj.spec_for(ck_a), ffn="scaled").report["settled"]["ffn"] == "permutation"
    llama = tf.LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    a, b = (rj.init_checkpoint(llama, jax.random.key(s)).params for s in (0, 1))
    assert "settled" not in rj.align(a, b, rj.spec_for(llama), ffn="scaled").report
