"""The record of a group kind (`Kind`) and of its solver (`GroupSolver`): what each kind module
(`kinds/attention.py`, `kinds/permutation.py`, `kinds/scaled_units.py`, `kinds/experts.py`,
`kinds/residual.py`)
declares once and the orchestrators (the driver, the report, activation matching, learned
alignment, `identity_transform`) look up by `group.kind` (`kinds.of(group)`), naming no kind
themselves; with `ActivationSites`, where activation matching reads a kind's sites, and `Learned`,
how learned alignment parametrises its elements."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..engine.groups import act_on_groups
from ..errors import InputError


@dataclasses.dataclass(frozen=True)
class GroupSolver:
    """How one group kind is solved, as four pure functions in the manner of optax's
    `GradientTransformation` (engine/driver.py says how `Solve` drives them):

        statistics(group, leaves_a, leaves_b, options, solved)
                                        what one chunk of layers of A and B gives (dispatched to
                                        the device, not awaited); `solved`: (group, its chunk's
                                        part) of each group solved before it (`group.after`)
        reduce(group, statistics, options, traced)
                                        the chunk's part of the answer, small enough to hold for
                                        every layer
        combine(parts)                  the chunks' parts as one, in layer order
        solve(group, part, options)     the group's element over all its layers

    `host_reduce`: whether `reduce` is host work that the device's solves of the other groups
    should overlap."""

    statistics: Callable
    reduce: Callable
    combine: Callable
    solve: Callable
    host_reduce: bool = False


@dataclasses.dataclass(frozen=True)
class ActivationSites:
    """Where activation matching (engine/activations.py) reads one group kind's sites and what it
    writes where the solver reads the members' leaves:

        check(group, shapes)            InputError where activations give the group no site
        reads(group, member)            (its input, its output): whether a kernel of `member` has
                                        its input, its output recorded by the forward pass
        site(group, member, path, options)
                                        the key of the site that `path`'s pseudo-leaf is made of
                                        (the kernel path for its input, + `activations.OUT` for
                                        its output; None: zeros) under the run's `AlignOptions`;
                                        only for members the group reads
        pseudo(group, member, path, x)  the pseudo-leaf of `path` from its site `x` (None: zeros,
                                        the tagged axis kept)"""

    check: Callable
    reads: Callable
    site: Callable
    pseudo: Callable


@dataclasses.dataclass(frozen=True)
class Learned:
    """How learned alignment (engine/learned.py, MATH §10) moves one kind's groups, each element
    staying in its group at every step:

        initial(group, t0, frame, options)
                                        the parameters at which the element is the start `t0`
                                        (the group's element); `frame`: B's flat
                                        leaves moved by every group's `frame(t0)`; None: the group
                                        learns nothing under `options` and keeps `t0`
        project(group, params, flat_b)  host work before each step that the step holds fixed (the
                                        permutation of B's units closest to the free copy), or None
        element(group, t0, params, projected)
                                        the element at `params` (traced: inside the step)
        frame(t)                        the part of element `t` that acts on B before
                                        `straight_through` (`t` itself, or `t` less its scales)
        straight_through(group, params, t, flat)
                                        {path: leaf} replacing the leaves of `flat` (B moved by
                                        every group's `frame`), for every group, learned
                                        (`params`) or not (None): the free copies that carry the
                                        gradient of a discrete choice, what acts after them"""

    initial: Callable
    element: Callable
    project: Callable = lambda group, params, flat_b: None
    frame: Callable = lambda t: t
    straight_through: Callable = lambda group, params, t, flat: {}


@dataclasses.dataclass(frozen=True)
class Fusion:
    """How OT fusion (merging/otfusion.py, MATH §9) transports one kind's groups of a model onto
    the anchor's, on the host:

        refusal(group)                  why OT fusion cannot transport the group, or None (then
                                        the other pieces are never called)
        input_paths(group, bound)       source="activations": the kernels whose recorded inputs
                                        are its units' activations, a path per layer
        features(group, flat, inputs)   its units' features (float64): from the weights `flat`
                                        (`inputs` None), or from the inputs of `input_paths`
                                        recorded on the batches (one array per layer)
        plans(group, features, features_a, transport, reg, what)
                                        (its plans as `OTTransport.plans` gives them, {name:
                                        (L, n, n)}; what `element` and `soft` take)
        element(group, solved, what)    transport="hard": its group element (a permutation)
        soft(group, flat, solved, shapes)
                                        transport="soft": {path: leaf}, the barycentric
                                        projection of its members' leaves"""

    refusal: Callable
    input_paths: Callable
    features: Callable
    plans: Callable
    element: Callable
    soft: Callable


def unfused(refusal: Callable) -> Fusion:
    """The view of a kind that OT fusion does not transport: `refusal(group)` says why."""
    def never(*args):
        raise AssertionError("OT fusion refuses this kind before it transports anything")

    return Fusion(refusal=refusal, input_paths=never, features=never, plans=never, element=never, soft=never)


def input_member(group, bound, role=None):
    """The member whose leaves are 2-D kernels with the group's units on their input axis (0) (of
    `role`): its recorded inputs are the units' activations (OT fusion's source="activations")."""
    shapes = dict(bound.shapes)
    for m in group.members:
        if (role is None or m.role == role) and m.axis == 0 and m.layer_axis is None and all(len(shapes[p]) == 2 for p in m.paths):
            return m
    what = f"attention block {group.name!r} (role {role})" if role else f"permutation group {group.name!r}"
    raise InputError(
        f"source='activations': {what} has no 2-D kernel with its units on the input axis (axis 0), "
        f"whose recorded input would give the units' activations; members: {[m.template for m in group.members]}"
    )


# What a kind whose element only permutes declares as `Kind.mixed`: no leaf's coordinates mix.
def unmixed(group, t) -> set[str]:
    return set()


def every_member(group, t) -> set[str]:
    """`Kind.mixed` of a kind whose element may mix the coordinates of all its members' leaves."""
    return {p for m in group.members for p in m.paths}


# What a kind that learns nothing declares: learned alignment keeps its start's element.
FIXED = Learned(initial=lambda group, t0, frame, options: None, element=lambda group, t0, params, projected: t0)


@dataclasses.dataclass(frozen=True)
class Kind:
    """Every piece of one group kind. `group`: its record in `spec` (a frozen dataclass whose class
    attribute `kind` names the kind); `element`: its element in `transforms` (`identity(group)`,
    its actions, inverse, composition, check); `solver`: how the engine solves it; `summary`:
    (group, its element on the host) -> what moved, JSON-ready (the report's `moved`, less "kind");
    `said`: that summary as the command line prints it, (summary) -> its phrases (engine/report.py's
    `moved_lines`); `activations`: its sites for activation matching; `cost_matrices`: (group, per_layer) ->
    (bytes held with every other group's, bytes held by one group at a time): its solver's float32
    cost matrices, every layer's or one layer's (`per_layer`), for the memory model
    (`io.memory.cost_matrix_bytes`); `mixed`: (group, its element) -> the leaves whose coordinates
    the element may mix (a rotation, a map), which a diagonal second moment then follows only
    approximately (`transform_opt_state(second_moments="reset")` resets those leaves'); `refusal`: (group,
    options, traced) -> why the engine cannot solve the group under the settled `AlignOptions`
    (inside jit / vmap where `traced`), or None; `align` raises it before any work; `learned`: how
    learned alignment parametrises its element; `fusion`: OT fusion's view of it; `act`: (group,
    leaves, its element) -> {path: moved leaf} of its members, `leaves` a mapping that holds them
    (`engine.groups.apply_to_leaves`; a per-layer group's layers one program each, shared);
    `gains`: (group, its element) -> [(path, rotation)] of the norm gains the element only
    permutes while a rotation acts on the coordinates they scale (the residual stream's, a rotated
    latent's): an optimizer state of such a gain cannot follow (`transform_opt_state`).

    The residual stream's kind (kinds/residual.py), solved by the descent around the per-layer
    groups, has no `solver`, `activations`, `cost_matrices` or `fusion` (None): the driver,
    activation matching, the memory model and OT fusion loop over the per-layer groups alone
    (`BoundSpec.groups`); the report, learned alignment, the optimizer state and the checks of a
    transforms dict loop over the groups it holds (`BoundSpec.groups_of`)."""

    group: type
    element: type
    solver: GroupSolver | None
    summary: Callable
    said: Callable
    activations: ActivationSites | None
    cost_matrices: Callable | None
    mixed: Callable
    refusal: Callable
    learned: Learned
    fusion: Fusion | None
    act: Callable = lambda group, leaves, t: act_on_groups((group,), leaves, {group.name: t})
    gains: Callable = lambda group, t: []

    @property
    def name(self) -> str:
        return self.group.kind
