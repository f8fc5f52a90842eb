"""Run a notebook top to bottom with its size parameter, and save it with its outputs.

    .venv/bin/python notebooks/run.py notebooks/loss_barriers.ipynb [--size full] [--out PATH]

The notebook's cell tagged "parameters" is replaced by `SIZE = "<size>"` (papermill's
convention). The kernel runs in the repository root, so the trained models' cache is shared with
`rotsym demo` and experiments/run.py. The notebook is written under a temporary name, then renamed.
"""

from __future__ import annotations

import argparse
import os
import uuid
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parent.parent
SIZES = ("small", "full")


def execute(path, size: str, out=None, timeout: int = 1800) -> nbformat.NotebookNode:
    """The notebook at `path` executed with `SIZE = size`; written to `out` when given."""
    if size not in SIZES:
        raise ValueError(f"size={size!r}; choose one of {SIZES}")
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise ValueError(f"{path}: expected one cell tagged 'parameters', found {len(cells)}")
    cells[0].source = f'SIZE = "{size}"'
    nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    if out is not None:
        out = Path(out)
        tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            nbformat.write(nb, tmp)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return nb


def images(nb) -> int:
    """How many PNG figures the notebook's outputs hold."""
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--size", default="full", choices=SIZES)
    parser.add_argument("--out", default=None, help="output path (one notebook only); default: in place")
    args = parser.parse_args(argv)
    if args.out and len(args.notebooks) > 1:
        parser.error("--out takes one notebook")
    for path in args.notebooks:
        nb = execute(path, args.size, args.out or path)
        print(f"{path}: executed with SIZE={args.size!r}, {images(nb)} figures")


if __name__ == "__main__":
    main()
