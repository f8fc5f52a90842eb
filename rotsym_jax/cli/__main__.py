"""`python -m rotsym_jax.cli`: the `rotsym` command."""

from .parsers import console

console()
