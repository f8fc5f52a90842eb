"""The group kinds: each kind of group a bound spec holds (`group.kind`) declared once, in a module
of its own, as a `Kind` (kinds/base.py: its spec record, its element, its solver, its summary of
what moved, its activation sites, its cost matrices, what its element mixes, what it refuses, its
learned parametrisation, OT fusion's view of it), and
registered here in `KINDS`. The orchestrators (engine/driver.py's `Solve`, engine/report.py's
`moved`, engine/activations.py's sites and pseudo-leaves, `transforms.identity_transform`,
io/memory.py's cost matrices, engine/opt_state.py, engine/learned.py, merging/otfusion.py, `align`'s refusals) name no kind: they look
each group's up (`of(group)`). A new kind is a new module here and its line in `KINDS`
(docs/engine.md).

This folder is the row after the engine whose kernels it uses (`engine/attention.py`,
`engine/ffn.py`); the modules of the rows before it (`transforms`, `engine/`, `io/memory.py`) reach
this registry when they run, through the package's lazy attribute `rj.kinds`."""

from __future__ import annotations

from . import attention, experts, permutation, residual, scaled_units
from .base import ActivationSites, Fusion, GroupSolver, Kind, Learned

# Every group kind, by its name (`group.kind`).
KINDS: dict[str, Kind] = {k.name: k for k in (attention.KIND, permutation.KIND, scaled_units.KIND, experts.KIND, residual.KIND)}

__all__ = ["KINDS", "ActivationSites", "Fusion", "GroupSolver", "Kind", "Learned", "of"]


def of(group) -> Kind:
    """The kind of a bound spec's group (the residual stream's too)."""
    return KINDS[group.kind]
