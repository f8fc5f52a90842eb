"""rotsym_jax: align and merge transformers through their parameter-space symmetries."""

from . import barrier, merge, otfusion, stats
from .align import AlignResult, align
from .distances import distance_report
from .groups import apply_transform
from .hf import Checkpoint, CheckpointError, init_checkpoint, load_hf, save_hf, spec_for
from .many import ManyResult, align_many
from .spec import BoundSpec, HeadGeometry, Spec, SpecError, bind
from .transforms import HeadTransform, UnitPermutation, compose_transforms, identity_transform, invert_transform, random_transform

__all__ = [
    "AlignResult",
    "BoundSpec",
    "Checkpoint",
    "CheckpointError",
    "HeadGeometry",
    "HeadTransform",
    "ManyResult",
    "Spec",
    "SpecError",
    "UnitPermutation",
    "align",
    "align_many",
    "barrier",
    "apply_transform",
    "bind",
    "compose_transforms",
    "distance_report",
    "identity_transform",
    "init_checkpoint",
    "invert_transform",
    "load_hf",
    "merge",
    "otfusion",
    "random_transform",
    "save_hf",
    "spec_for",
    "stats",
]
