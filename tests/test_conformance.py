"""One contract for every family and task head transformers writes (tests/family_cases.py), checked
against transformers' PyTorch models:
- parity: our forward pass computes transformers' outputs (the base model's hidden state and
  pooler output too) wherever it runs the head;
- round trip: save_hf writes the very tensors transformers wrote, which it loads with no missing,
  unexpected or mismatched key;
- invariance: a random element of every group the model has (head and kv-group permutations, FFN
  and expert permutations, a gated FFN's unit scales, QK and VO rotations or sign flips, their
  scales) with the residual stream permuted keeps transformers' outputs;
- recovery: `rotsym align` undoes that element into a folder transformers loads and that computes
  A's outputs; for pre-norm models with no tied head, a rotation of the stream too;
- streamed = in memory: `--max-memory` writes the same bits;
- merge: A and B aligned and averaged is A again."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from family_cases import CASES, SLOW_PARITY, SLOW_PLANTED, model_inputs, reference
from parity_utils import assert_outputs_match, assert_same_tensor_files, save_reference

import rotsym_jax as rj
from rotsym_jax import cli, hf
from rotsym_jax.transforms import KINDS, RESIDUAL, UNIT_KINDS

pytestmark = pytest.mark.usefixtures("float32_models")

HEAD_OUTPUTS = ("logits", "start_logits", "end_logits", "image_embeds", "text_embeds")
# The stream's basis: a permuted stream permutes these (and nothing else).
STREAM_OUTPUTS = ("last_hidden_state", "encoder_last_hidden_state")


def stream_outputs(case) -> tuple[str, ...]:
    """The outputs in the stream's basis: a CLIP tower's pooled output is one token's normed state."""
    if case.family == "opt" and case.config().word_embed_proj_dim != case.config().hidden_size:
        return ()  # OPT-350m's outputs are project_out's, in the word embeddings' space, which no group moves
    return STREAM_OUTPUTS + (("pooler_output",) if case.family in ("clip_vision", "clip_text", "dinov2", "dinov2_with_registers") else ())
ALIGN = ["--quiet", "--heads", "permute", "--residual", "permutation", "--ffn", "scaled"]


def _align(folder) -> list[str]:
    """ALIGN's options, `--residual none` for a model whose spec has no residual stream (Marian's
    fixed sinusoids keep it unmoved)."""
    return ALIGN if rj.spec_for(rj.load_hf(folder)).streams else [*ALIGN[:3], "--residual", "none", *ALIGN[5:]]


def _params(cases, slow=lambda case: False):
    return [pytest.param(case, id=case.id, marks=[pytest.mark.slow] if slow(case) else []) for case in cases]


ALL = _params(CASES)
RUNS = _params([c for c in CASES if c.runs], slow=lambda c: c.id in SLOW_PARITY)
# The group contracts run once per class, on its first case (a variant tests the forward pass, not a new head).
GROUPS = [c for i, c in enumerate(CASES) if all(d.cls != c.cls for d in CASES[:i])]


def _planted_by_default(groups) -> set[str]:
    """The classes whose planted contract runs in the default run (the others in the slow suite, the
    default run's time budget: 187 classes took 200 s of one worker): each family's first class and
    its LM, and each head kind in the first family that has it; a later family's other heads repeat
    what the first one's prove with the same head code."""
    families, heads, default = set(), set(), set()
    for c in groups:
        if c.family not in families or c.head not in heads or (c.head == "lm" and (c.family, "lm") not in heads):
            default.add(c.id)
        families.add(c.family)
        heads |= {c.head, (c.family, c.head)}
    return default - set(SLOW_PLANTED)


PLANTED_BY_DEFAULT = _planted_by_default(GROUPS)


class Models:
    """What the contracts share within this module (one worker runs it): A as transformers wrote
    it, B planted, and the aligned output, each made once per case on first use."""

    def __init__(self, root: Path):
        self.root, self.cache = root, {}

    def _once(self, key, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def a(self, case):
        """(A's folder, A's transformers model, inputs, A's outputs)."""
        def make():
            folder = self.root / case.id / "a"
            model = save_reference(case.model_class, case.config(), folder, **dict(case.kwargs))
            inputs = model_inputs(case, model.config)
            return folder, model, inputs, reference(model, inputs)
        return self._once(("a", case.id), make)

    def planted(self, case):
        """(B's folder, {stream output: its residual permutation}): A moved by a random element of
        every group, each residual stream's too (an encoder's output in its stream's basis)."""
        def make():
            folder = self.a(case)[0]
            ck = rj.load_hf(folder)
            spec = rj.spec_for(ck)
            t = rj.random_transform(spec, ck.params, jax.random.key(1), KINDS + UNIT_KINDS)
            streams = rj.bind(spec, ck.params).streams
            for k, stream in enumerate(streams):
                t[stream.name] = rj.random_residual(spec, ck.params, jax.random.key(2 + k), "permutation", stream.name)
            out = rj.save_hf(ck, rj.apply_transform(spec, ck.params, t), self.root / case.id / "b")
            perm = {s.name: np.asarray(t[s.name].perm) for s in streams}
            one = perm.get(RESIDUAL)  # a model of one stream; Whisper's two each move their stack's output
            return out, {"encoder_last_hidden_state": perm.get("encoder_residual", one), "last_hidden_state": perm.get("decoder_residual", one),
                         "pooler_output": one}
        return self._once(("b", case.id), make)

    def aligned(self, case):
        """B aligned to A in memory (ALIGN's options)."""
        def make():
            out = self.root / case.id / "aligned"
            assert cli.main(["align", str(self.a(case)[0]), str(self.planted(case)[0]), str(out), *_align(self.a(case)[0])]) == 0
            return out
        return self._once(("aligned", case.id), make)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return Models(tmp_path_factory.mktemp("conformance"))


def _load(case, folder):
    model, info = case.model_class.from_pretrained(folder, attn_implementation="eager", output_loading_info=True, **dict(case.kwargs))
    assert not any(info.values()), info
    return model.eval()


def _assert_same_outputs(got: dict, want: dict, what: str, keys=None):
    keys = [k for k in want if keys is None or k in keys]
    assert keys and all(k in got for k in keys), (what, sorted(got), sorted(want))
    for key in keys:
        scale = max(float(np.abs(want[key]).max()), 1e-3)
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-4 * scale, err_msg=f"{what}: {key}")


def _assert_undone(out: Path):
    report = json.loads((out / "rotsym_report.json").read_text())["result"]
    assert report["before"]["total"] > 1.0, "nothing was planted"
    assert report["after"]["total"] <= 1e-4 * report["before"]["total"], "the plant was not undone"


@pytest.mark.parametrize("case", RUNS)
def test_parity_with_transformers(case, models):
    folder, _, inputs, want = models.a(case)
    ck = rj.load_hf(folder)
    ours = ck.apply(ck.params, **inputs)
    keys = [k for k in want if k in ("last_hidden_state", "encoder_last_hidden_state", "pooler_output", *HEAD_OUTPUTS)]
    assert case.head is None or any(k in keys for k in HEAD_OUTPUTS), sorted(want)
    # (T5ForConditionalGeneration is its own base model: transformers returns the encoder's state alone)
    assert {"last_hidden_state", "encoder_last_hidden_state"} & set(keys) and set(keys) <= set(ours), (sorted(ours), keys)
    mask = inputs.get("attention_mask")
    valid = mask.astype(bool) if mask is not None else None
    assert_outputs_match(ours, want, keys, valid=valid, min_ref_std=0.05)


@pytest.mark.parametrize("case", ALL)
def test_round_trip_writes_transformers_tensors(case, models):
    folder, _, _, _ = models.a(case)
    ck = rj.load_hf(folder)
    assert (ck.family, ck.layout.head, ck.runs_head) == (case.family, case.head, case.runs)
    saved = rj.save_hf(ck, ck.params, folder.parent / "saved")
    files = [hf.TensorFiles(f) for f in (folder, saved)]
    try:
        assert files[0].names() == files[1].names()
        changed = [n for n in files[0].names() if not np.array_equal(files[0].read(n), files[1].read(n))]
        assert not changed, f"tensors changed in the round trip: {changed}"
    finally:
        for f in files:
            f.close()
    _load(case, saved)


@pytest.mark.parametrize("case", _params(GROUPS, slow=lambda c: c.id not in PLANTED_BY_DEFAULT))
def test_a_planted_group_element_keeps_the_function_and_align_undoes_it(case, models):
    _, _, inputs, want = models.a(case)
    b, perm = models.planted(case)
    got = reference(_load(case, b), inputs)
    kept = [k for k in want if k not in stream_outputs(case)]
    if kept:  # a bare model without a pooler has only its hidden state
        _assert_same_outputs(got, want, "B planted, in transformers", keys=kept)
    for key in stream_outputs(case):
        if key in want:  # the stream's basis is B's: its hidden state is A's permuted (A's where no stream moves: Marian's)
            np.testing.assert_allclose(got[key], want[key] if perm[key] is None else want[key][..., perm[key]], rtol=0, atol=1e-4 * np.abs(want[key]).max(), err_msg=key)
    out = models.aligned(case)
    _assert_same_outputs(reference(_load(case, out), inputs), want, "B aligned, in transformers")
    _assert_undone(out)


@pytest.mark.parametrize("case", _params(GROUPS, slow=lambda c: c.slow_to_stream))
def test_streamed_alignment_writes_the_bits_of_the_one_in_memory(case, models, tmp_path):
    a, _, _, _ = models.a(case)
    b, _ = models.planted(case)
    assert cli.main(["align", str(a), str(b), str(tmp_path / "stream"), *_align(a), "--max-memory", "3G"]) == 0
    assert_same_tensor_files(models.aligned(case), tmp_path / "stream")


@pytest.mark.parametrize("case", _params(GROUPS, slow=lambda c: c.slow_to_stream))
def test_aligned_and_averaged_is_a_again(case, models, tmp_path):
    """The head is the anchor's; transformers loads the result as A's class."""
    a, a_model, _, _ = models.a(case)
    b, _ = models.planted(case)
    assert cli.main(["merge", "--method", "average", str(a), str(b), str(tmp_path / "merged"), *_align(a)]) == 0
    merged = _load(case, tmp_path / "merged").state_dict()
    for key, x in a_model.state_dict().items():
        np.testing.assert_allclose(merged[key].numpy(), x.numpy(), atol=1e-4, err_msg=key)


# Pre-norm models whose final norm no tied LM head reads: the residual stream may rotate (MATH §10).
ROTATABLE = [c for c in GROUPS if c.family in ("gpt2", "gpt_bigcode", "gpt_neox", "phi", "stablelm", "starcoder2", "cohere", "falcon", "llama", "gemma", "granite", "vit", "t5",
                                              "deepseek_v2", "deepseek_v3", "glm4_moe", "glm", "clip_text", "apertus", "cohere2", "lfm2", "mistral3", "qwen2_vl",
                                              "qwen3_vl_moe", "mamba2", "granitemoehybrid",
                                              "llama4_text", "llama4", "phimoe", "qwen3_next")
             and c.head is not None and c.cls not in ("GPT2LMHeadModel", "GPT2DoubleHeadsModel", "GemmaForCausalLM", "T5ForConditionalGeneration")]


@pytest.mark.parametrize("case", _params(ROTATABLE, slow=lambda c: c.family not in ("gpt2", "vit")))
def test_a_rotated_stream_keeps_the_function_and_align_undoes_it(case, models, tmp_path):
    """B: A folded, every group and the stream rotated (for LayerNorm, a rotation fixing the ones
    vector): transformers computes A's outputs, and `--residual rotation` undoes it."""
    a, _, inputs, want = models.a(case)
    ck = rj.load_hf(a)
    spec = rj.spec_for(ck)
    folded = rj.fold_norms(spec, ck.params)
    t = rj.random_transform(spec, folded, jax.random.key(1), ("perm", "qk", "vo"))
    t[RESIDUAL] = rj.random_residual(spec, folded, jax.random.key(2), "rotation")
    b = rj.save_hf(ck, rj.apply_transform(spec, folded, t), tmp_path / "b")
    head = [k for k in want if k not in stream_outputs(case)]  # the stream, folded and rotated, is B's
    _assert_same_outputs(reference(_load(case, b), inputs), want, "B rotated, in transformers", keys=head)
    out = tmp_path / "out"
    assert cli.main(["align", str(a), str(b), str(out), "--quiet", "--residual", "rotation", "--heads", "permute"]) == 0
    _assert_same_outputs(reference(_load(case, out), inputs), want, "B aligned, in transformers", keys=head)
    _assert_undone(out)
