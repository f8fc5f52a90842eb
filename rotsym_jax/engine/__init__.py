"""The alignment engine (docs/engine.md): `driver` holds the `Solve` that in-memory `align` and
the streamed runs share, over each group kind's solver (declared in `rotsym_jax/kinds/`);
`attention`, `ffn` and `experts` compute the kinds' statistics and solves, `groups` moves leaves by group elements, `residual` the residual stream's transform;
`alignment` (align), `many` (align_many) and `distances` are what users call."""
