"""The `rotsym` command: `parsers` builds the argument parsers (no JAX: `--help` is instant) and
dispatches to `commands`, which parse arguments into the library's pipeline and print."""

from .parsers import console, main

__all__ = ["console", "main"]
