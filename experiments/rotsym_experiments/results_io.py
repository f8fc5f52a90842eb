"""Shared by the experiment and benchmark scripts: where a result comes from, writing it
atomically, and the Markdown pieces of the RESULTS.md files they generate."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from rotsym_jax.pytree import write_text_atomic


def _git(cwd: Path, *args) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def provenance() -> dict:
    """The commit (and whether the tree had uncommitted changes) of the repository holding the
    running script, the command (paths relative to that repository) and the date."""
    here = Path(sys.argv[0]).resolve().parent
    root = Path(_git(here, "rev-parse", "--show-toplevel") or here)
    # Result files written by earlier runs in the same tree are outputs, not code: they do not count.
    status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude,glob)**/results/**", ":(exclude,glob)**/RESULTS.md")
    # RESULTS_COMMIT names the commit of a copy of the tree whose .git is absent or stale (a lent
    # GPU machine gets the working tree over the checkout's original HEAD)
    given = os.environ.get("RESULTS_COMMIT")
    return {
        "commit": given or _git(root, "rev-parse", "HEAD"),
        "dirty": None if given or status is None else bool(status),
        "command": " ".join(["python", *[os.path.relpath(a, root) if a.endswith(".py") else a for a in sys.argv]]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def jax_version() -> str:
    """JAX's version, for a check that runs rotsym as a command and imports no JAX itself otherwise."""
    import jax

    return jax.__version__


def device_result_path(folder: Path, stem: str) -> Path:
    """`folder/stem.json` on a CPU, `folder/stem-<device kind>.json` on an accelerator: one result
    file per device, so a GPU run never overwrites the CPU's."""
    import jax

    if jax.default_backend() == "cpu":
        return Path(folder) / f"{stem}.json"
    slug = re.sub(r"[^a-z0-9]+", "-", jax.devices()[0].device_kind.lower()).strip("-")
    return Path(folder) / f"{stem}-{slug}.json"


def write_json(results: dict, path, quiet: bool = False) -> Path:
    out = write_text_atomic(path, json.dumps(results, indent=2, default=float))
    if not quiet:
        print(f"\nwrote {out}")
    return out


# ---- Markdown ---------------------------------------------------------------------------------------

def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def num(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def origin(r: dict) -> str:
    """Where a result comes from: its commit, or that it recorded none."""
    if not r.get("commit"):
        return "(commit not recorded)"
    if r.get("dirty"):
        return f"at {r['commit'][:12]} (uncommitted changes{': ' + r['dirty_note'] if r.get('dirty_note') else ''})"
    return f"at {r['commit'][:12]}"


def write_markdown_main(render, default_out: Path, description: str, argv=None) -> None:
    """The command line of a write_results script: render the Markdown and write it atomically."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=str(default_out))
    args = parser.parse_args(argv)
    print(f"wrote {write_text_atomic(args.out, render())}")
