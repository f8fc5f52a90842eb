"""The alignment engine (docs/engine.md): `driver` holds a solver per group kind and the `Solve`
that in-memory `align` and the streamed runs share; `attention` and `ffn` compute their statistics
and solves, `groups` moves leaves by group elements, `residual` the residual stream's transform;
`alignment` (align), `many` (align_many) and `distances` are what users call."""
