"""Merging: `registry` (every merge method declared once, with its jax or tensorwise
implementation or both), `methods` (public as `rotsym_jax.merge`: rotsym's methods), `stats`
(Fisher and RegMean statistics on the aligned models), `otfusion` (the OT fusion baseline),
`tensorwise` and `mergekit` (mergekit's methods and configs) and `lora` (public as
`rotsym_jax.lora`: mergekit-extract-lora's adapters)."""
