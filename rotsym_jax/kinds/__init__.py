"""The group kinds: each kind of group a bound spec holds (`group.kind`) declared once, in a module
of its own, as a `Kind` (kinds/base.py: its spec record, its element, its solver, its summary of
what moved, its activation sites), and registered here in `KINDS`. The orchestrators (engine/driver.py's `Solve`,
engine/report.py's `moved`, engine/activations.py's sites and pseudo-leaves,
`transforms.identity_transform`) name no kind: they look each group's
up (`of(group)`). A new kind is a new module here and its line in `KINDS` (docs/engine.md).

The kinds sit above the engine whose kernels they use (`engine/attention.py`, `engine/ffn.py`);
the modules below them reach this registry through the package's lazy attribute, `rj.kinds`."""

from __future__ import annotations

from . import attention, experts, permutation
from .base import ActivationSites, GroupSolver, Kind

# Every group kind, by its name (`group.kind`).
KINDS: dict[str, Kind] = {k.name: k for k in (attention.KIND, permutation.KIND, experts.KIND)}

__all__ = ["KINDS", "ActivationSites", "GroupSolver", "Kind", "of"]


def of(group) -> Kind:
    """The kind of a bound spec's group."""
    return KINDS[group.kind]
