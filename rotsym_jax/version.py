"""The installed version of rotsym_jax, for reports and `rotsym --version` (imports nothing heavy)."""

import importlib.metadata


def version() -> str:
    try:
        return importlib.metadata.version("rotsym_jax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
