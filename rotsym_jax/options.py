"""The choices of `align` and of the command line, in a module that imports nothing heavy (the
`rotsym` command builds its parsers from it before JAX is loaded)."""

ATTENTION = ("rotation", "permutation", "none")
HEADS = ("fixed", "permute")
RESCALE = ("none", "sequential", "joint")
FFN = ("permutation", "none")
RESIDUAL = ("none", "permutation", "rotation")
ALIGN_MODES = ("none", "anchor", "many")
DTYPES = ("float32", "bfloat16", "float16", "float64")
TASK_HEADS = ("anchor", "merge")
