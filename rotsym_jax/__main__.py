"""`python -m rotsym_jax`: the `rotsym` command, as `python -m rotsym_jax.cli` runs it."""

from .cli.parsers import console

console()
