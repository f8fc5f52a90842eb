"""pyproject.toml as setuptools reads it at every install: the metadata built without a deprecation
warning (a license table instead of an SPDX string printed one at each `pip install`)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BUILD = """
import sys
from setuptools import build_meta
out = sys.argv[1]  # setuptools rewrites sys.argv
name = build_meta.prepare_metadata_for_build_wheel(out)
with open(f"{out}/{name}/METADATA") as f:
    print(f.read())
"""


def test_the_metadata_builds_without_setuptools_warnings(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    (source / "rotsym_jax").mkdir()
    (source / "rotsym_jax" / "__init__.py").touch()
    (source / "experiments").mkdir()
    (tmp_path / "out").mkdir()
    done = subprocess.run([sys.executable, "-W", "always", "-c", BUILD, str(tmp_path / "out")], cwd=source, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "SetuptoolsDeprecationWarning" not in done.stderr, done.stderr
    assert "License-Expression: Apache-2.0" in done.stdout.split("\n\n")[0]
