"""Merging: `methods` (public as `rotsym_jax.merge`: the methods and their registry), `stats`
(Fisher and RegMean statistics on the aligned models) and `otfusion` (the OT fusion baseline)."""
