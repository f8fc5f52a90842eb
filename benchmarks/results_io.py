"""Shared by the benchmark scripts: write a results JSON atomically (temporary name, then rename)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(results: dict, path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2, default=float))
    tmp.rename(out)
    print(f"\nwrote {out}")
    return out
