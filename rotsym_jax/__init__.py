"""rotsym_jax: align and merge transformers through their parameter-space symmetries.

The public names below are imported on first use (PEP 562), so that `import rotsym_jax` and the
`rotsym` command's help do not load JAX; `from rotsym_jax import align` works as usual. The
package's own modules use these lazy attributes (`rj.align`, `rj.stats`, `rj.streaming`...) where
they need a heavy module on some paths only (the command line, merge's OT fusion); everywhere else
a module imports what it uses at its top.
"""

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "AlignResult": "alignment",
    "align": "alignment",
    "distance_report": "distances",
    "apply_transform": "groups",
    "Checkpoint": "hf",
    "CheckpointError": "hf",
    "init_checkpoint": "hf",
    "load_hf": "hf",
    "save_hf": "hf",
    "spec_for": "hf",
    "AlignOptions": "options",
    "align_checkpoints": "pipeline",
    "merge_checkpoints": "pipeline",
    "ManyResult": "many",
    "align_many": "many",
    "fold_norms": "residual",
    "random_residual": "residual",
    "BoundSpec": "spec",
    "HeadGeometry": "spec",
    "ResidualSpec": "spec",
    "Spec": "spec",
    "SpecError": "spec",
    "bind": "spec",
    "HeadTransform": "transforms",
    "ResidualTransform": "transforms",
    "UnitPermutation": "transforms",
    "compose_transforms": "transforms",
    "identity_transform": "transforms",
    "invert_transform": "transforms",
    "random_transform": "transforms",
}
_MODULES = ("barrier", "merge", "otfusion", "stats")

__all__ = sorted([*_EXPORTS, *_MODULES])


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    try:  # any submodule: rotsym_jax.stats, rotsym_jax.hf, ...
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(__all__))
