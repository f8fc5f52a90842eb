"""What a run writes beside the weights: its report (rotsym_report.json), its model card
(README.md) with the distances to the anchor, and its recipe (rotsym_config.yaml)."""

from __future__ import annotations

import datetime
import json
import platform
import time
from collections.abc import Sequence

import jax
import numpy as np
import yaml

from ..version import version
from ._publish import left_out


def report_of(command: str, inputs: dict, options: dict, result: dict, start: float) -> dict:
    """A run's report (rotsym_report.json): the command, its inputs, options, result, time, versions."""
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "inputs": {name: _input(ck) for name, ck in inputs.items()},
        "options": options,
        "result": jsonable(result),
        "seconds": time.perf_counter() - start,
        "versions": {"rotsym_jax": version(), "jax": jax.__version__, "numpy": np.__version__, "python": platform.python_version()},
        "device": jax.devices()[0].device_kind,
    }


def _input(ck) -> dict:
    entry = {"path": str(ck.source), "family": ck.family, "model_type": ck.model_config.model_type}
    not_copied = left_out(ck.source)
    return {**entry, "not_copied": not_copied} if not_copied else entry


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x


def kinds_shown(rows) -> list[str]:
    """The distance columns of rows of (label, {kind: distance}): QK, VO, every group's own kind
    present (the FFN's "ffn", a mixture's experts "moe", a custom spec's groups), then "other"
    and "total"."""
    present = {k for _, d in rows for k in d}
    first, last = ("qk", "vo"), ("other", "total")
    return [k for k in first if k in present] + sorted(present - set(first) - set(last)) + [k for k in last if k in present]


# The table's columns, explained once under it, those it shows (a mixture's "moe" too).
COLUMNS = {"qk": "the query and key weights", "vo": "the value and output weights", "ffn": "the feed-forward units",
           "moe": "the experts and their router", "shared_ffn": "the shared experts' feed-forward units",
           "pool_ffn": "the pooling head's feed-forward units",
           "channels": "the state-space mixers' channels", "ssm": "the Mamba-2 mixers' heads and their channels",
           "state": "the state-space mixers' state entries (B and C)",
           "time_step": "the Mamba mixers' time-step entries (x_proj's dt rows, dt_proj's columns)",
           # MLA's latents: a latent's writer and norm (its readers' rows are the attention block's leaves, in qk and vo)
           "q_latent": "MLA's query latent (q_a_proj's outputs and their norm)",
           "kv_latent": "MLA's key-value latent (kv_a_proj_with_mqa's latent outputs and their norm)",
           # an untied LM head is a leaf no group moves, as the embeddings it mirrors: measured, with them
           "other": "the rest (embeddings, norms, output biases, and an untied LM head)", "total": "all of them"}


def _stack_column(kind: str) -> str:
    """An encoder–decoder's own groups: each stack's FFN ("decoder_ffn"), Whisper's front end."""
    stack, _, group = kind.partition("_")
    if group == "pool_ffn":  # a dual encoder's image tower's pooling head (SiglipModel)
        return f"the {stack} tower's pooling head's feed-forward units"
    if group == "ffn":
        return f"the {stack}'s feed-forward units"
    if group == "conv":
        return f"the {stack}'s convolution channels"
    return f"the leaves of group {kind!r}"


def distance_legend(kinds: list[str]) -> str:
    columns = ", ".join(f"{k} {COLUMNS.get(k) or _stack_column(k)}" for k in kinds)
    return f"(Euclidean distance ||A - B|| between the weights, task heads (classifiers) left out: {columns})"


def model_card(name: str, *, base: str | list[str], tags: list[str], recipe: dict, report: dict, summary: str,
               names: list[str] | None = None) -> str:
    front = yaml.safe_dump({"base_model": base, "tags": tags}, sort_keys=False).strip()
    lines = ["---", front, "---", "", f"# {name}", "", summary, "", "## Recipe", "", "```yaml",
             yaml.safe_dump(recipe, sort_keys=False).strip(), "```", ""]
    rows = distance_rows(report["result"], names)
    if rows:
        kinds = kinds_shown(rows)
        lines += ["## Distances to the anchor", "", "| | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
        lines += [f"| {label} | " + " | ".join(f"{d[k]:.4f}" if k in d else "" for k in kinds) + " |" for label, d in rows]
        lines += ["", distance_legend(kinds), ""]
    for key, title in (("untied", "Untied LM head"), ("apart", "Tables read apart"), ("widened", "Widths")):
        if key in report["result"]:
            lines += [f"## {title}", "", report["result"][key]["note"], ""]
    not_copied = [(name, entry["not_copied"]) for name, entry in report.get("inputs", {}).items() if entry.get("not_copied")]
    if not_copied:
        lines += ["## Files not copied", "", "rotsym copies a checkpoint's config, weights, tokenizer and processor data, never a "
                  "folder's code or other files. Left out of the inputs:", ""]
        where = lambda name: name if report["inputs"][name]["path"] in name else f"{name} ({report['inputs'][name]['path']})"  # noqa: E731
        lines += [f"- {where(name)}: {', '.join(names)}" for name, names in not_copied] + [""]
    lines += [f"Made with rotsym_jax {report['versions']['rotsym_jax']} (`{report['command']}`); the full report is rotsym_report.json.", ""]
    return "\n".join(lines)


def distance_rows(result: dict, names: Sequence[str] | None = None) -> list[tuple[str, dict]]:
    """(label, {kind: distance}) rows of a report's distances: B before and after (align); each
    model (`names[i]` after its number) before and after its alignment, then the merged model."""
    if "before" in result:
        return [("before", result["before"]), ("after", result["after"])]
    rows = []
    for i, d in enumerate(result.get("alignment", {}).get("distances", []), 1):
        model = f"model {i}" + (f" ({names[i]})" if names else "")
        rows += [(f"{model} before alignment", d["before"]), (f"{model} after alignment", d["after"])]
    if "merged_distance_to_anchor" in result:
        rows.append(("merged, to the anchor", result["merged_distance_to_anchor"]))
    return rows


CARD_FILES = ("README.md", "rotsym_config.yaml", "rotsym_report.json")  # what `files_of` writes


def files_of(card: str, recipe: dict | str, report: dict) -> dict:
    return {
        "README.md": card,
        "rotsym_config.yaml": recipe if isinstance(recipe, str) else yaml.safe_dump(recipe, sort_keys=False),
        "rotsym_report.json": json.dumps(report, indent=2),
    }
