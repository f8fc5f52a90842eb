"""Merging: `methods` (public as `rotsym_jax.merge`: the methods and their registry), `stats`
(Fisher and RegMean statistics on the aligned models), `otfusion` (the OT fusion baseline),
`tensorwise` and `mergekit` (mergekit's methods and configs) and `lora` (public as
`rotsym_jax.lora`: mergekit-extract-lora's adapters)."""
