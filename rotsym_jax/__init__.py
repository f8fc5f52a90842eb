"""rotsym_jax: align and merge transformers through their parameter-space symmetries.

The public surface is this namespace: the names below, and the modules users import by their short
name (`from rotsym_jax import merge, stats, barrier, plots, hf, recipe, streaming, lora, moe`), wherever they
live in the folders. The folders follow the data (docs/engine.md):

    pytree, errors, precision, options, checks, timings, version  foundations (no group knowledge)
    spec_rules, spec, transforms                            Spec (its tags, geometry) -> BoundSpec; typed group elements
    solvers/      numerical kernels: polar and Procrustes, rescaling, linear assignment
    families/     one record per family and head; the Flax forward passes
    io/           Hugging Face checkpoints in and out (a run's checkpoints read: folders, Orbax, Hub ids), recipes, the memory model
    engine/       the driver and each kind's statistics and solves; align, align_many, residual, distances
    kinds/        each group kind declared once (its record, element, solver, summary, sites): KINDS,
                  which the modules above reach as `rj.kinds` when they run
    merging/      merge methods and their registry, statistics, OT fusion; mergekit's methods and configs; LoRA extraction;
                  mixtures of experts from dense models (mergekit-moe)
    landscape/    barriers, plots
    verify        the groups proven in transformers; records inferred for model types without one; the stream as a run takes it
    streaming     the engine and the merges over checkpoints read a chunk at a time
    pipeline/     load -> fold -> align -> statistics -> merge -> save, in memory or streamed (a module a step)
    mergekit_plan       a mergekit config's output tensors laid out from its slices, as mergekit plans them
    mergekit_pipeline   a mergekit config, a tensor at a time (aligned first by the pipeline's alignment)
    moe_pipeline        a mergekit-moe config: a Mixtral from dense models (their experts aligned onto the base first, or not)
    cli/          the `rotsym` command: parse and print only

Each folder imports only from the rows above it (tests/test_architecture.py). Names are imported on
first use (PEP 562), so that `import rotsym_jax` and the `rotsym` command's help do not load JAX.
The package's own modules use these lazy attributes (`rj.align`, `rj.stats`, `rj.streaming`...)
where they need a heavy module on some paths only (the command line, merge's OT fusion), and
to look a group's kind up (`rj.kinds.of(group)`) from a row above `kinds/`;
everywhere else a module imports what it uses at its top.
"""

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "AlignResult": "engine.alignment",
    "align": "engine.alignment",
    "distance_report": "engine.distances",
    "apply_transform": "engine.groups",
    "Checkpoint": "io.hf",
    "CheckpointError": "io.hf",
    "init_checkpoint": "io.hf",
    "load_hf": "io.hf",
    "save_hf": "io.hf",
    "load_orbax": "io.orbax",
    "save_orbax": "io.orbax",
    "save_config": "io.orbax",
    "spec_for": "io.hf",
    "untie": "io.ties",
    "InferredRecord": "families.family",
    "infer_record": "verify",
    "AlignOptions": "options",
    "StreamOptions": "options",
    "MergeOptions": "options",
    "RotsymError": "errors",
    "InputError": "errors",
    "align_checkpoints": "pipeline",
    "merge_checkpoints": "pipeline",
    "merge_mergekit": "mergekit_pipeline",
    "moe_to_disk": "moe_pipeline",
    "RunOptions": "pipeline",
    "ManyResult": "engine.many",
    "align_many": "engine.many",
    "fold_norms": "engine.residual",
    "fold_latents": "engine.latents",
    "random_latent_rotations": "engine.latents",
    "random_residual": "engine.residual",
    "transform_opt_state": "engine.opt_state",
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
# public module name -> where it lives
_MODULES = {
    "barrier": "landscape.barrier",
    "hf": "io.hf",
    "lora": "merging.lora",
    "merge": "merging.methods",
    "mergekit": "merging.mergekit",
    "moe": "merging.moe",
    "nets": "families.nets",
    "otfusion": "merging.otfusion",
    "plots": "landscape.plots",
    "recipe": "io.recipe",
    "stats": "merging.stats",
}

__all__ = sorted([*_EXPORTS, *_MODULES])


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _MODULES:
        module = importlib.import_module(f".{_MODULES[name]}", __name__)
        globals()[name] = module
        return module
    try:  # any other submodule: rotsym_jax.streaming, rotsym_jax.engine, ...
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(__all__))
