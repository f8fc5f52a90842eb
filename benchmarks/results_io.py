"""Shared by the benchmark scripts: where a result comes from, and writing it atomically."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def provenance() -> dict:
    """The commit (and whether the tree had uncommitted changes), the command and the date."""

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    # RESULTS_COMMIT names the commit of a copy of the tree whose .git is absent or stale (a lent
    # GPU machine gets the working tree over the checkout's original HEAD)
    given = os.environ.get("RESULTS_COMMIT")
    return {
        "commit": given or git("rev-parse", "HEAD"),
        "dirty": None if given or status is None else bool(status),
        "command": " ".join(["python", *[os.path.relpath(a, ROOT) if a.endswith(".py") else a for a in sys.argv]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(results: dict, path, quiet: bool = False) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(json.dumps(results, indent=2, default=float))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    if not quiet:
        print(f"\nwrote {out}")
    return out
