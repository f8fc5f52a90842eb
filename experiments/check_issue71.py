"""Issue 71's independent check: a run is the same whether it streams.

Acting as a user from outside the library: tiny seeded float32 checkpoints written by transformers
(norms and biases perturbed so that none is trivially 0 or 1), then the command line as documented
(`python -m rotsym_jax align|merge ...`), each run twice: in memory, and with `--max-memory` small
enough that it streams (one layer a chunk). Compared per run: the output tensors (safetensors, bit
for bit or the largest relative difference), the two reports (every field but timings, streaming,
date, command and paths), each option passed as recorded in the report and in the recipe written
beside it, `chosen` (the fallback's choice) in both, and, for an align, OUT loaded by transformers
against B (the alignment keeps B's function). A refusal is recorded with its message.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers as tf
import yaml
from safetensors.numpy import load_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from rotsym_experiments.results_io import jax_version, provenance, write_json  # noqa: E402

FUNCTION_TOL = 1e-4  # OUT vs B, relative to the largest output entry

# The shapes of tests/family_cases.py (transformers builds them, rotsym reads them); 3 layers where the
# family allows, so that a one-layer chunk gives several chunks.
TEXT = dict(vocab_size=60, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48, max_position_embeddings=20)
GPT2 = dict(vocab_size=60, n_embd=32, n_layer=3, n_head=4, n_positions=20, pad_token_id=0)
WHISPER = dict(vocab_size=60, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=2,
               encoder_ffn_dim=48, decoder_ffn_dim=40, max_source_positions=10, max_target_positions=20, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, decoder_start_token_id=1)
CLIP_VISION = dict(hidden_size=48, intermediate_size=48, num_hidden_layers=2, num_attention_heads=3, image_size=16, patch_size=4, num_channels=3,
                   projection_dim=24, hidden_act="gelu")
CLIP_TEXT = dict(vocab_size=60, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=20,
                 projection_dim=24, pad_token_id=0, bos_token_id=1, eos_token_id=7)
CLIP_EOS = 7

MODELS = {
    "llama (GQA)": ("LlamaForCausalLM", lambda: tf.LlamaConfig(**TEXT, num_key_value_heads=2, pad_token_id=0), "text"),
    "bert (post-LN)": ("BertForMaskedLM", lambda: tf.BertConfig(**TEXT), "bert"),
    "gpt2": ("GPT2LMHeadModel", lambda: tf.GPT2Config(**GPT2), "text"),
    "qwen3-moe": ("Qwen3MoeForCausalLM", lambda: tf.Qwen3MoeConfig(**TEXT, num_key_value_heads=2, head_dim=16, num_experts=5,
                                                                   num_experts_per_tok=3, moe_intermediate_size=24), "text"),
    "whisper": ("WhisperForConditionalGeneration", lambda: tf.WhisperConfig(**WHISPER), "whisper"),
    "clip (CLIPModel)": ("CLIPModel", lambda: tf.CLIPConfig(text_config=CLIP_TEXT, vision_config=CLIP_VISION, projection_dim=24,
                                                             logit_scale_init_value=1.5), "clip"),
}

# ---- A, B, C, BASE: seeded models whose norms, biases and heads are not trivially 0/1 -------------------


def build(cls_name: str, config, seed: int):
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = getattr(tf, cls_name)(config).eval()
    with torch.no_grad():
        out = model.get_output_embeddings()
        if out is not None:  # logits O(1), not O(0.02)
            out.weight.mul_(1.0 / (out.weight.shape[1] ** 0.5 * out.weight.std()))
        for p in model.parameters():
            if p.ndim == 1:  # transformers starts biases at 0 and gains at 1: a misplaced one would not show
                p.add_(0.1 * torch.randn_like(p))
    return model


def inputs_for(kind: str, config, seed: int, batch: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 60, size=(batch, 9))
    if kind == "whisper":
        frames = 2 * config.max_source_positions
        return {"input_features": rng.standard_normal((batch, config.num_mel_bins, frames)).astype(np.float32), "decoder_input_ids": ids[:, :6]}
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if kind == "bert":
        inputs["token_type_ids"] = np.zeros_like(ids)
    if kind == "clip":
        ids[:, -1] = CLIP_EOS  # the text tower pools at the eos
        inputs["pixel_values"] = rng.standard_normal((batch, 3, 16, 16)).astype(np.float32)
    return inputs


def outputs(model, inputs) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(**{k: torch.as_tensor(v) for k, v in inputs.items()})
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def function_error(ref: dict, other: dict) -> float:
    """max over outputs of max|other - ref| / max|ref|."""
    return max(float((other[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ref)


# ---- comparing two runs ----------------------------------------------------------------------------

IGNORED = re.compile(r"(^|\.)(timings|streaming|seconds|date|command|versions|device)(\.|$|\[)|(^|\.)path$")


def flatten(d, prefix: str = "") -> dict:
    if isinstance(d, dict):
        return {k: v for key, value in d.items() for k, v in flatten(value, f"{prefix}.{key}" if prefix else str(key)).items()}
    if isinstance(d, list):
        return {k: v for i, value in enumerate(d) for k, v in flatten(value, f"{prefix}[{i}]").items()}
    return {prefix: d}


def report_differences(a: dict, b: dict) -> dict:
    """Every flattened field of the two reports that differs (timings, streaming, paths... left out)."""
    fa, fb = flatten(a), flatten(b)
    out = {}
    for key in sorted(set(fa) | set(fb)):
        if IGNORED.search(key):
            continue
        va, vb = fa.get(key, "<absent>"), fb.get(key, "<absent>")
        if va != vb:
            out[key] = [va, vb]
    return out


def find(d, key: str, prefix: str = "") -> dict:
    """{dotted path: value} of every field named `key`, at any depth."""
    hits = {}
    if isinstance(d, dict):
        for k, v in d.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if k == key:
                hits[path] = v
            hits.update(find(v, key, path))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            hits.update(find(v, key, f"{prefix}[{i}]"))
    return hits


def tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def tensor_difference(a: dict, b: dict) -> dict:
    if set(a) != set(b):
        return {"identical": False, "names_only_in_memory": sorted(set(a) - set(b)), "names_only_streamed": sorted(set(b) - set(a))}
    worst, name, differ = 0.0, None, 0
    for k in a:
        if a[k].shape != b[k].shape or a[k].dtype != b[k].dtype:
            return {"identical": False, "shape_or_dtype": {k: [str(a[k].shape), str(a[k].dtype), str(b[k].shape), str(b[k].dtype)]}}
        if not np.array_equal(a[k], b[k]):
            differ += 1
            x, y = a[k].astype(np.float64), b[k].astype(np.float64)
            rel = float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-30))
            if rel > worst:
                worst, name = rel, k
    return {"identical": differ == 0, "tensors": len(a), "tensors_differing": differ, "max_relative_difference": worst, "worst_tensor": name}


def lookup(d, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return "<absent>"
        d = d[part]
    return d


def missing_options(expected: dict, report: dict, recipe: dict | None, recipe_keys: dict) -> dict:
    """Each option passed whose value the report (at `report` paths) or the recipe does not hold as run."""
    missing = {}
    for key, want in expected.items():
        got = lookup(report, key)
        if got != want:
            missing[f"report {key}"] = {"passed": want, "recorded": got}
        if recipe is not None and key in recipe_keys:
            got = lookup(recipe, recipe_keys[key])
            if got != want:
                missing[f"recipe {recipe_keys[key]}"] = {"passed": want, "recorded": got}
    return missing


# ---- the runs ---------------------------------------------------------------------------------------


def rotsym(args: list[str]) -> tuple[str, subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "rotsym_jax", *args]  # not --quiet: it silences the notes compared below
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return " ".join(["rotsym", *args]), proc, time.perf_counter() - t


def short(text: str, limit: int = 1500) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip() and "Writing model shards" not in line]
    return "\n".join(lines)[-limit:]


class Pair:
    """One model's folders: A, B, C (align_many), BASE (ties), their Orbax copies, the data."""

    def __init__(self, name: str, work: Path, seed: int):
        self.name, (self.cls, self.make_config, self.kind) = name, MODELS[name]
        self.dir = work / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        self.models = {}
        for i, role in enumerate(("A", "B", "C", "BASE")):
            m = build(self.cls, self.make_config(), seed + i)
            m.save_pretrained(self.dir / role)
            self.models[role] = m
        # FT: A fine-tuned, as it were (A plus noise of 1% of each tensor's spread): the fallback's other choices
        ft = build(self.cls, self.make_config(), seed)
        g = torch.Generator().manual_seed(seed + 50)
        with torch.no_grad():
            for p in ft.parameters():
                p.add_(0.01 * (p.std() if p.numel() > 1 else p.abs()) * torch.randn(p.shape, generator=g))
        ft.save_pretrained(self.dir / "FT")
        self.models["FT"] = ft
        self.inputs = inputs_for(self.kind, self.models["A"].config, seed + 100)
        self.refs = {role: self.kept(outputs(self.models[role], self.inputs)) for role in ("B", "FT")}
        data = inputs_for(self.kind, self.models["A"].config, seed + 200, batch=16)
        self.data = self.dir / "data.npz"
        np.savez(self.data, **data)
        self._orbax = None
        self.budgets: dict[str, int] = {}

    def orbax(self) -> tuple[Path, Path] | str:
        """A and B written as Orbax checkpoints by the library's own writer (docs/guides/orbax.md)."""
        if self._orbax is None:
            code = ("import sys, rotsym_jax as rj\nfor src, dst in zip(sys.argv[1::2], sys.argv[2::2]):\n"
                    "    c = rj.load_hf(src)\n    rj.save_orbax(c, c.params, dst)\n")
            a, b = self.dir / "A-orbax", self.dir / "B-orbax"
            proc = subprocess.run([sys.executable, "-c", code, str(self.dir / "A"), str(a), str(self.dir / "B"), str(b)], capture_output=True,
                                  text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
            self._orbax = (a, b) if proc.returncode == 0 else "save_orbax failed: " + short(proc.stderr)
        return self._orbax

    @staticmethod
    def kept(outs: dict) -> dict:
        """The outputs alignment keeps: the logits (CLIPModel's similarity logits). Hidden states and CLIP's
        embeddings move with a residual stream's map by design (an encoder's states permuted, CLIP's joint
        space any orthogonal map: docs/reference/families.md)."""
        return {k: v for k, v in outs.items() if k.startswith("logits")}

    def function_error(self, out: Path, b: str = "B") -> float:
        model = getattr(tf, self.cls).from_pretrained(out, attn_implementation="eager").eval()
        return function_error(self.refs[b], self.kept(outputs(model, self.inputs)))


def recipe_text(pair: Pair, method: str, params: dict, align_options: dict, data: bool, align: str = "anchor") -> Path:
    r = {"models": [str(pair.dir / "A"), str(pair.dir / "B")], "method": method, "params": params, "align": align, "align_options": align_options}
    if method in ("ties", "task_arithmetic", "dare"):
        r["base"] = str(pair.dir / "BASE")
    if data:
        r["data"] = {"file": str(pair.data), "batch_size": 4}
    path = pair.dir / f"recipe-{method}-{align}-{'data' if data else 'weights'}.yaml"
    path.write_text(yaml.safe_dump(r, sort_keys=False))
    return path


ACTIVATIONS = "--method activations --data X.npz"
HEADS, ROTATION, FFN_SCALED = "--heads permute --rescale joint", "--residual rotation --residual-sweeps 2 --polar-method svd", "--ffn scaled"
PERMUTATION = "--residual permutation --residual-sweeps 2 --polar-method svd"
# Align option sets: (label, flags, {report path: value as run}). The recipe an align writes holds the
# same under `options.`; a merge's report under `options.align_options.`.
ALIGN_SETS = [
    ("defaults", [], {}),
    (HEADS, ["--heads", "permute", "--rescale", "joint"], {"options.heads": "permute", "options.rescale": "joint"}),
    (ROTATION, ["--residual", "rotation", "--residual-sweeps", "2", "--polar-method", "svd"],
     {"options.residual": "rotation", "options.residual_sweeps": 2, "options.polar_method": "svd"}),
    (FFN_SCALED, ["--ffn", "scaled"], {"options.ffn": "scaled"}),
    (PERMUTATION, ["--residual", "permutation", "--residual-sweeps", "2", "--polar-method", "svd"],
     {"options.residual": "permutation", "options.residual_sweeps": 2, "options.polar_method": "svd"}),
    (ACTIVATIONS, ["--method", "activations", "--data", "{data}"], {"options.method": "activations"}),
]


RUNTIME = 2**29  # rotsym's CPU runtime allowance (docs/guides/big-checkpoints.md): a budget must exceed it
NEEDS = re.compile(r"is below what .*? needs(?: streamed)?, about ([0-9.]+) (GiB|MiB)")


def one_run(pair: Pair, row: dict, how: str, argv: list[str], out: Path, budget_key: str) -> dict | None:
    """Runs `rotsym ARGV`, streamed with the smallest --max-memory rotsym takes for it: first the runtime
    plus one byte, refused with the figure one layer (or, for activations, one model) needs, then that
    figure plus its rounding (1e-4 GiB), kept per model and kind of run. Records the run in
    row["runs"][how] and returns it with the report and recipe, or None where it was refused."""
    budget, tried = pair.budgets.get(budget_key, RUNTIME + 1), []
    for _ in range(4):
        extra = ["--max-memory", str(budget)] if how == "streamed" else []
        cmd, proc, seconds = rotsym([*argv, *extra])
        m = NEEDS.search(proc.stderr) if how == "streamed" and proc.returncode != 0 else None
        if not m:
            break
        tried.append(m.group(0))
        budget = int((float(m.group(1)) + 1e-4) * (2**30 if m.group(2) == "GiB" else 2**20)) + 1
    if how == "streamed":
        pair.budgets[budget_key] = budget
    run = {"command": cmd.replace(str(pair.dir.parent) + "/", ""), "seconds": round(seconds, 1), "rc": proc.returncode,
           "notes": [line.replace(str(pair.dir.parent) + "/", "") for line in proc.stderr.splitlines() if line.startswith("note")]}
    if tried:
        run["budget_refusals"] = tried
    row["runs"][how] = run
    if proc.returncode != 0:
        run["refused"] = short(proc.stderr or proc.stdout)
        return None
    report = json.loads((out / "rotsym_report.json").read_text())
    recipe = yaml.safe_load((out / "rotsym_config.yaml").read_text()) if (out / "rotsym_config.yaml").is_file() else None
    streaming = {k: v for k, v in find(report, "streaming").items() if isinstance(v, dict)}
    run["streamed"] = bool(streaming)
    run["chunks"] = {k: {f: v.get(f) for f in ("layers", "chunk_layers", "in_flight", "passes")} for k, v in streaming.items()}
    run["chosen"] = {k: (v.get("method") if isinstance(v, dict) else v) for k, v in find(report, "chosen").items()}
    run["report"], run["recipe"] = report, recipe
    return run


def check_align(pair: Pair, label: str, flags: list[str], expected: dict, orbax: bool = False, b_role: str = "B", replayed: bool = False) -> dict:
    row = {"model": pair.name, "command": "align", "options": label + (" (Orbax inputs)" if orbax else "") + (f" (B = {b_role})" if b_role != "B" else ""),
           "runs": {}}
    if orbax:
        ab = pair.orbax()
        if isinstance(ab, str):
            return {**row, "error": ab, "pass": False}
        a, b = ab
    else:
        a, b = pair.dir / "A", pair.dir / b_role
    flags = [f.replace("{data}", str(pair.data)) for f in flags]
    slug = re.sub(r"[^a-z0-9]+", "-", row["options"].lower()).strip("-") or "defaults"
    outs = {}
    for how in ("in memory", "streamed"):
        out = pair.dir / f"align-{slug}-{how.replace(' ', '-')}"
        run = one_run(pair, row, how, ["align", str(a), str(b), *flags, str(out)], out, "align-data" if "--data" in flags else "align")
        if run is None:
            continue
        outs[how] = out
        report, recipe = run["report"], run["recipe"]
        missing = missing_options(expected, report, recipe, {k: k for k in expected})
        if "--data" in flags:  # the data as run: its file in the report's options and in the recipe
            for where, rec in (("report options.data", lookup(report, "options.data")), ("recipe data", (recipe or {}).get("data", "<absent>"))):
                if pair.data.name not in json.dumps(rec):
                    missing[where] = {"passed": str(pair.data), "recorded": rec}
        run["missing_options"] = missing
        run["function_error"] = pair.function_error(out, b_role)
    if replayed:
        replay(pair, row, outs, "align", "align-data" if "--data" in flags else "align")
    return finish(row, outs, function=True)


def check_merge(pair: Pair, label: str, args_for, expected: dict, recipe_keys: dict, budget_key: str, replayed: bool = False) -> dict:
    row = {"model": pair.name, "command": "merge", "options": label, "runs": {}}
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")[:60]
    outs = {}
    for how in ("in memory", "streamed"):
        out = pair.dir / f"merge-{slug}-{how.replace(' ', '-')}"
        run = one_run(pair, row, how, ["merge", *args_for(out)], out, budget_key)
        if run is None:
            continue
        outs[how] = out
        run["missing_options"] = missing_options(expected, run["report"], run["recipe"], recipe_keys)
    if replayed:
        replay(pair, row, outs, "merge", budget_key)
    return finish(row, outs, function=False)


# Documented refusals: (model, option set) -> (words the refusal must hold, where the docs say it is refused)
# (None as the place: documented as running, so the refusal is a finding)
REFUSED_BOTH = {("clip (CLIPModel)", ACTIVATIONS): ("from data do not run on it yet",
                                                          "docs/reference/families.md, CLIP (both towers): alignment from data ... refused by name"),
                ("bert (post-LN)", ROTATION): ("needs a pre-norm model", "rotsym align --help, --residual: rotation (pre-norm families ...; "
                                                                                   "not post-LN BERT/RoBERTa)"),
                ("whisper", ROTATION): ("no stream of this model takes it", "docs/reference/families.md, Whisper's groups: no rotation of "
                                                                                    "the encoder's stream (its front end writes it through a GELU)")}
# Refusals the docs do not state (a finding when one is listed here; Whisper from data, refused at 27721f0, runs since 6ac4e71)
UNDOCUMENTED: dict = {}
STREAMED_REFUSALS = {
    "--format orbax (an Orbax output)": (lambda p, out: ["align", str(p.dir / "A"), str(p.dir / "B"), "--format", "orbax", str(out)], "--format orbax",
                                         "docs/guides/orbax.md: an Orbax output (--format orbax) is written whole, so it is not streamed"),
    "--method learned --data X.npz --steps 3": (
        lambda p, out: ["align", str(p.dir / "A"), str(p.dir / "B"), "--method", "learned", "--data", str(p.data), "--steps", "3", str(out)], "learned",
        "docs/guides/big-checkpoints.md: refused by name: --method learned (its backward pass runs through both)"),
    "recipe: average, align: many, align_options {method: activations}, data .npz": (
        lambda p, out: [str(recipe_text(p, "average", {}, {"method": "activations"}, data=True, align="many")), str(out)], "many",
        "docs/guides/big-checkpoints.md: refused by name: align: many from activations"),
}


def check_refusal(pair: Pair, label: str, argv_for, words: str, doc: str | None, both: bool = False) -> dict:
    """A run the docs say is refused by name (`doc`: where), streamed (and in memory where `both`); with no
    `doc` a run the docs say runs, whose refusal is recorded as a finding (UNDOCUMENTED says where)."""
    row = {"model": pair.name, "command": "", "options": label, "runs": {},
           "expected_refusal": {"words": words, "documented": doc or "NOT documented as refused: " + UNDOCUMENTED[(pair.name, label)]}}
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")[:60]
    for how in ("in memory", "streamed") if both else ("streamed",):
        out = pair.dir / f"refused-{slug}-{how.replace(' ', '-')}"
        argv = argv_for(pair, out)
        argv = argv if argv[0] == "align" else ["merge", *argv]  # a recipe is merged
        row["command"] = argv[0]
        one_run(pair, row, how, argv, out, "refusal")
    row["refused"] = {h: r.get("refused") for h, r in row["runs"].items()}
    row["pass"] = doc is not None and all(msg is not None and words in msg for msg in row["refused"].values())
    return row


def replay(pair: Pair, row: dict, outs: dict, command: str, budget_key: str) -> None:
    """The recipe the in-memory run wrote, replayed streamed (`rotsym align|merge OUT/rotsym_config.yaml NEW`):
    the same tensors as that run's, if the recipe holds every option as run."""
    if "in memory" not in outs:
        return
    source = outs["in memory"]
    out = source.parent / (source.name + "-replayed-streamed")
    rec = {"runs": {}}
    if one_run(pair, rec, "streamed", [command, str(source / "rotsym_config.yaml"), str(out)], out, budget_key) is None:
        row["replay"] = {"command": rec["runs"]["streamed"]["command"], "refused": rec["runs"]["streamed"]["refused"]}
    else:
        row["replay"] = {"command": rec["runs"]["streamed"]["command"], "tensors": tensor_difference(tensors(source), tensors(out))}


def finish(row: dict, outs: dict, function: bool) -> dict:
    runs = row["runs"]
    refused = {h: r["refused"] for h, r in runs.items() if "refused" in r}
    row["refused"] = refused
    if len(outs) == 2:
        row["tensors"] = tensor_difference(tensors(outs["in memory"]), tensors(outs["streamed"]))
        row["report_differences"] = report_differences(runs["in memory"]["report"], runs["streamed"]["report"])
        row["recipe_differences"] = report_differences(runs["in memory"]["recipe"] or {}, runs["streamed"]["recipe"] or {})
    notes = {h: [re.sub(r"(in memory|streamed)", "", n) for n in r["notes"]] for h, r in runs.items()}
    if len(set(map(tuple, notes.values()))) > 1:  # what the user is told on stderr, the same on both paths
        row["notes_differ"] = {h: r["notes"] for h, r in runs.items()}
    row["streamed"] = {h: r.get("streamed") for h, r in runs.items() if "report" in r}
    row["chosen"] = {h: r.get("chosen") for h, r in runs.items() if "report" in r}
    row["missing_options"] = {h: r["missing_options"] for h, r in runs.items() if r.get("missing_options")}
    if function:
        row["function_error"] = {h: r["function_error"] for h, r in runs.items() if "function_error" in r}
    ok = (len(outs) == 2 and row["tensors"]["identical"] and not row["report_differences"] and not row["recipe_differences"]
          and not row["missing_options"] and row["streamed"] == {"in memory": False, "streamed": True})
    if "replay" in row:
        ok = ok and row["replay"].get("tensors", {}).get("identical", False)
    if function and ok:
        ok = all(v <= FUNCTION_TOL for v in row["function_error"].values())
    if ok and row["command"] == "align":
        ok = all(row["chosen"].values())  # the fallback's choice stated in both
    row["pass"] = bool(ok)
    for r in runs.values():  # the whole report stays on disk; the JSON keeps what it was compared on
        r.pop("report", None)
        r.pop("recipe", None)
    return row


def merge_sets(pair: Pair) -> dict:
    """label -> (argv for OUT, {report path: value as run}, {report path: recipe path}, budget kind)."""
    d = pair.dir
    abc = [str(d / "A"), str(d / "B"), str(d / "C")]
    opts = {"heads": "permute", "residual": "permutation", "residual_sweeps": 2, "polar_method": "svd"}
    ties = recipe_text(pair, "ties", {"density": 0.5}, opts, data=False)
    act = recipe_text(pair, "task_arithmetic", {"lam": 0.7}, {"method": "activations"}, data=True)
    same = {"options.method": "method", "options.align": "align"}
    return {
        "many": ("--method average --align many (A B C)", lambda out: ["--method", "average", "--align", "many", *abc, str(out)],
                 {"options.method": "average", "options.align": "many"}, same, "many"),
        "many-residual": ("--method average --align many --residual rotation --residual-sweeps 2",
                          lambda out: ["--method", "average", "--align", "many", "--residual", "rotation", "--residual-sweeps", "2", *abc, str(out)],
                          {"options.method": "average", "options.align": "many", "options.align_options.residual": "rotation",
                           "options.align_options.residual_sweeps": 2},
                          {**same, "options.align_options.residual": "align_options.residual",
                           "options.align_options.residual_sweeps": "align_options.residual_sweeps"}, "many-residual"),
        "ties": ("recipe: ties with a base, density 0.5, align_options " + json.dumps(opts), lambda out: [str(ties), str(out)],
                 {"options.method": "ties", "options.params.density": 0.5, **{f"options.align_options.{k}": v for k, v in opts.items()}},
                 {"options.method": "method", "options.params.density": "params.density",
                  **{f"options.align_options.{k}": f"align_options.{k}" for k in opts}}, "recipe"),
        "ta-activations": ("recipe: task_arithmetic with a base, lam 0.7, align_options {method: activations}, data .npz",
                           lambda out: [str(act), str(out)],
                           {"options.method": "task_arithmetic", "options.params.lam": 0.7, "options.align_options.method": "activations"},
                           {"options.method": "method", "options.params.lam": "params.lam", "options.align_options.method": "align_options.method"},
                           "recipe-data"),
    }


# What runs on each model: every align option set and merge on Llama; on the others the sets that
# concern their structure (a gated FFN for --ffn scaled: the MoE's experts; GPT-2's plain one to see
# what it answers), Orbax inputs, align_many and a recipe.
FINE_TUNE = {"fine-tune defaults": "defaults", "fine-tune activations": ACTIVATIONS}  # B = FT: A plus 1% noise
EVERY = [*(label for label, _, _ in ALIGN_SETS if label != PERMUTATION), *FINE_TUNE, "orbax defaults", "orbax residual", "many", "many-residual", "ties",
         "ta-activations"]
PLAN = {
    "llama (GQA)": EVERY,
    "bert (post-LN)": ["defaults", HEADS, ROTATION, ACTIVATIONS, "orbax defaults", "many", "ties"],
    "gpt2": ["defaults", HEADS, ROTATION, FFN_SCALED, ACTIVATIONS, "orbax defaults", "many", "ties"],
    "qwen3-moe": ["defaults", HEADS, ROTATION, FFN_SCALED, ACTIVATIONS, "orbax defaults", "many", "ties"],
    "whisper": ["defaults", HEADS, ROTATION, PERMUTATION, ACTIVATIONS, "orbax defaults", "many", "ties", "ta-activations"],
    "clip (CLIPModel)": ["defaults", HEADS, ROTATION, ACTIVATIONS, "orbax defaults", "orbax residual", "many",
                         "many-residual", "ties"],
}
# Whose in-memory recipe is replayed streamed: the issue's own example (residual sweeps, polar method) and a recipe merge
REPLAYED = {("llama (GQA)", ROTATION), ("llama (GQA)", ACTIVATIONS), ("llama (GQA)", "ties"), ("clip (CLIPModel)", ROTATION)}
ORBAX_SETS = {"orbax defaults": ("defaults", [], {}),
              "orbax residual": ("--heads permute --residual permutation", ["--heads", "permute", "--residual", "permutation"],
                                 {"options.heads": "permute", "options.residual": "permutation"})}


def run_model(pair: Pair, only: str) -> list[dict]:
    rows, aligns, merges = [], {label: (flags, exp) for label, flags, exp in ALIGN_SETS}, merge_sets(pair)
    for what in PLAN[pair.name]:
        if only and only not in what:
            continue
        if (pair.name, what) in REFUSED_BOTH:
            flags = aligns[what][0]
            words, doc = REFUSED_BOTH[(pair.name, what)]
            row = check_refusal(pair, what, lambda p, out, flags=flags: ["align", str(p.dir / "A"), str(p.dir / "B"),
                                                                       *[f.replace("{data}", str(p.data)) for f in flags], str(out)],
                                words, doc, both=True)
        elif what in aligns:
            row = check_align(pair, what, *aligns[what], replayed=(pair.name, what) in REPLAYED)
        elif what in FINE_TUNE:
            row = check_align(pair, FINE_TUNE[what], *aligns[FINE_TUNE[what]], b_role="FT")
        elif what in ORBAX_SETS:
            row = check_align(pair, *ORBAX_SETS[what], orbax=True)
        else:
            label, args_for, expected, recipe_keys, key = merges[what]
            row = check_merge(pair, label, args_for, expected, recipe_keys, key, replayed=(pair.name, what) in REPLAYED)
        rows.append(row)
        print(describe(row), flush=True)
    if pair.name == "llama (GQA)" and not only:
        for label, (argv_for, words, doc) in STREAMED_REFUSALS.items():
            rows.append(check_refusal(pair, label, argv_for, words, doc))
            print(describe(rows[-1]), flush=True)
    return rows


def describe(row: dict) -> str:
    bits = []
    if "expected_refusal" in row:
        return (f"{row['model']} | {row['command']} {row['options']}: {'pass' if row['pass'] else 'FAIL'}: "
                f"refused ({row['expected_refusal']['documented'][:60]}): "
                + "; ".join(f"{h}: {(r or 'NOT REFUSED').splitlines()[-1][:200]}" for h, r in row["refused"].items()))
    if row.get("refused"):
        bits.append("refused " + "; ".join(f"{h}: {r.splitlines()[-1][:160]}" for h, r in row["refused"].items()))
    t = row.get("tensors")
    if t:
        bits.append("tensors identical" if t["identical"] else f"tensors DIFFER {t}")
    if row.get("report_differences"):
        bits.append(f"report differs in {list(row['report_differences'])[:8]}")
    if row.get("recipe_differences"):
        bits.append(f"recipe differs in {list(row['recipe_differences'])[:8]}")
    if row.get("missing_options"):
        bits.append(f"options not recorded {row['missing_options']}")
    if "replay" in row:
        r = row["replay"]
        bits.append("recipe replayed streamed: " + ("tensors identical" if r.get("tensors", {}).get("identical") else f"DIFFERS {r}"))
    bits.append(f"streamed {row.get('streamed')}; chosen {row.get('chosen')}")
    if row.get("function_error"):
        bits.append("function " + ", ".join(f"{h} {v:.1e}" for h, v in row["function_error"].items()))
    return f"{row['model']} | {row['command']} {row['options']}: {'pass' if row['pass'] else 'FAIL'}: " + "; ".join(bits)


def table(rows: list[dict]) -> list[str]:
    """The rows as a Markdown table (for RESULTS.md and the report)."""
    out = ["| model | run | tensors in memory vs streamed | report fields that differ | options missing from report/recipe | chosen in both "
           "| function error (OUT vs B) | pass |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "expected_refusal" in r:
            msgs = "; ".join(f"{h}: {(m or 'not refused').splitlines()[-1][:90]}" for h, m in r["refused"].items())
            how = "refused as documented" if r["pass"] else "**refused, not documented as refused**"
            out.append(f"| {r['model']} | {r['command']} {r['options']} | {how}: {msgs} | | | | | {'pass' if r['pass'] else '**FAIL**'} |")
            continue
        t = r.get("tensors")
        tens = ("bit-identical" if t["identical"] else f"**differ** (max rel. {t.get('max_relative_difference', '?'):.2g})") if t else (
            "**refused**: " + "; ".join(f"{h}: {m.splitlines()[-1][:90]}" for h, m in r.get("refused", {}).items()))
        diff = ", ".join(list(r.get("report_differences", {}))[:6]) or ("none" if t else "")
        if r.get("recipe_differences"):
            diff += "; recipe: " + ", ".join(list(r["recipe_differences"])[:4])
        if r.get("notes_differ"):
            diff += "; **stderr notes differ**"
        missing = "; ".join(f"{h}: {', '.join(m)}" for h, m in r.get("missing_options", {}).items()) or ("none" if t else "")
        chosen = r.get("chosen", {})
        stated = ("yes: " + "/".join(sorted({str(v) for c in chosen.values() for v in c.values()}))) if chosen and all(chosen.values()) else (
            "no (neither run has one)" if chosen and not any(chosen.values()) else ("**one only**" if chosen else ""))
        fe = ", ".join(f"{v:.1e}" for v in r.get("function_error", {}).values()) or "n/a (merge)"
        replayed = ""
        if "replay" in r:
            replayed = "; recipe replayed streamed: " + ("bit-identical" if r["replay"].get("tensors", {}).get("identical") else "**differs**")
        out.append(f"| {r['model']} | {r['command']} {r['options']} | {tens}{replayed} | {diff} | {missing} | {stated} | {fe} | "
                   f"{'pass' if r['pass'] else '**FAIL**'} |")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "check_issue71.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names from: " + ", ".join(MODELS))
    parser.add_argument("--only", default="", help="run only the option sets whose name contains this text")
    parser.add_argument("--work", type=Path, default=None, help="folder for the checkpoints and outputs (default: a temporary one)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",")]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {list(MODELS)}")
    torch.set_num_threads(1)
    results = {**provenance(), "device": "cpu",
               "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "jax": jax_version(), "cpus": os.cpu_count(),
                           "device": "cpu"},
               "seed": args.seed, "function_tolerance": FUNCTION_TOL, "transformers": tf.__version__,
               "torch": torch.__version__, "ignored_report_fields": IGNORED.pattern, "rows": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for name in names:
            results["rows"] += run_model(Pair(name, work, args.seed), args.only)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    results["all_pass"] = all(r["pass"] for r in results["rows"])
    results["table"] = table(results["rows"])
    print("\n".join(results["table"]))
    write_json(results, args.out)


if __name__ == "__main__":
    main()
