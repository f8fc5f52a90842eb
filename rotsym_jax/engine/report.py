"""An alignment's report, built once for `align` and the streamed `align_to_disk` (and each model
a streamed merge aligns): the distances before and after, the residual descent's sweeps, what was
chosen and settled, the maps' condition numbers, what moved (`moved`), the timings, and what only a
streamed run has (its plan, its processes)."""

from __future__ import annotations

import jax
import numpy as np

import rotsym_jax as rj

from ..errors import InputTypeError
from ..spec import BoundSpec, counted
from ..transforms import condition_numbers
from .distances import before_after

# A layer counts as moved where some permutation is not the identity, or some map or scale differs
# from it by more than this (a model aligned to itself solves the identity to about 1e-6).
MOVED_TOL = 1e-4


# What a report copies from its caller, in this order, where given (not None; "settled" not empty):
# the learning run, the fallback's choice, what "auto" became, NaN/Inf counts (traced), the timings,
# and what only a streamed run has.
BEFORE_TRANSFORMS = ("learned", "chosen", "settled")
AFTER_TRANSFORMS = ("nonfinite", "timings", "streaming", "processes")


def alignment_report(bound: BoundSpec, before: dict, after: dict, transforms: dict | None, *, winner: str, sweeps=None, **given) -> dict:
    """The report of one alignment from the summarised distances (`distances.summarise_distances`)
    before and after and the transforms kept (`transforms` None: traced, where nothing can be read
    back: no condition numbers, nothing on what moved). `winner`: the result kept ("weights",
    "activations", "identity", a learned start); `sweeps`: the residual descent's distance after
    each sweep, reported where weight matching's result is kept; `given`: the fields of
    `BEFORE_TRANSFORMS` and `AFTER_TRANSFORMS`, copied where given."""
    unknown = set(given) - set(BEFORE_TRANSFORMS) - set(AFTER_TRANSFORMS)
    if unknown:
        raise InputTypeError(f"alignment_report: unknown fields {sorted(unknown)}; it copies {BEFORE_TRANSFORMS + AFTER_TRANSFORMS}")
    report = before_after(before, after)
    if sweeps and winner == "weights":
        report["residual"] = {"distance_per_sweep": sweeps}
    report.update((k, given[k]) for k in BEFORE_TRANSFORMS if given.get(k) is not None and (k != "settled" or given[k]))
    if transforms is not None:
        conditions = condition_numbers(transforms)
        if conditions:  # invertible maps: how far from orthogonal (1) each block's worst one went
            report["condition_numbers"] = conditions
        report["moved"] = moved(bound, transforms)
    report.update((k, given[k]) for k in AFTER_TRANSFORMS if given.get(k) is not None)
    return report


def moved(bound: BoundSpec, transforms: dict) -> dict:
    """What the transforms move, per group (and "residual", the stream's transform), JSON-ready:

    - every group: "kind", "layers" (its layer count) and "layers_moved" (those where anything
      moved: a permutation not the identity, a map or scale more than `MOVED_TOL` from it);
    - attention: "heads" the fraction of query heads that left their slot (kv group and place in
      it), "qk" and "vo" the mean over layers and kv groups of ||M - I||_F / sqrt(2 dh) (0: the
      identity; about 1: a random rotation; a sign flip of k of the dh entries: sqrt(2k / dh)),
      "qk_scale" and "vo_scale" their [min, max] (1 where not solved), and "rope", the same
      distance of a RoPE key every head shares, where the block has one;
    - permutation: "units" the fraction of units not fixed, "scale" the units' [min, max] where
      their scales are solved, "unit" what its units are where the spec names them
      (`PermGroup.unit`: Mamba's "channel", "state entry"), which the printout says;
    - experts: "experts" the fraction of experts that left their slot, "units" the fraction of
      units not fixed within their expert;
    - residual: "coordinates" the fraction of stream coordinates the transform T does not keep
      (a permutation's moved and, with a rotation, those whose column of T is not their own unit
      vector: a flipped sign counts), "rotation" ||T - I||_F / sqrt(2 d) where a rotation (or a
      signed permutation) is solved (kinds/residual.py).

    The transforms kept by a fallback to B as given are the identity: every count and distance 0,
    every scale [1, 1]."""
    host = jax.device_get(transforms)
    return {g.name: {"kind": g.kind, **rj.kinds.of(g).summary(g, host[g.name])} for g in bound.groups_of(host)}


def with_layers(n: int, layer_moved: np.ndarray, out: dict) -> dict:
    return {"layers": int(n), "layers_moved": int(np.count_nonzero(layer_moved)), **out}


def from_identity(m) -> np.ndarray:
    """||M - I||_F / sqrt(2 n) of each (..., n, n) map, in float64; 0 within `MOVED_TOL` (a solve's rounding)."""
    m = np.asarray(m, np.float64)
    size = m.shape[-1]
    if size == 0:
        return np.zeros(m.shape[:-2])
    return unmoved(np.sqrt(np.square(m - np.eye(size)).sum(axis=(-2, -1)) / (2 * size)), 0.0)


def unmoved(x: np.ndarray, identity: float) -> np.ndarray:
    return np.where(np.abs(x - identity) > MOVED_TOL, x, identity)


def rounded(x: float) -> float:
    return float(f"{x:.4g}")  # a summary: four digits are what it is read for


def fraction(flags: np.ndarray) -> float:
    return rounded(np.count_nonzero(flags) / flags.size) if flags.size else 0.0


def mean(x: np.ndarray) -> float:
    return rounded(float(np.mean(x))) if np.size(x) else 0.0


def value_range(x: np.ndarray) -> list[float]:
    return [rounded(float(np.min(x))), rounded(float(np.max(x)))] if np.size(x) else [1.0, 1.0]


def moved_lines(summary: dict) -> list[str]:
    """A `moved` section as the command line prints it: a line per group, what moved and how far."""
    width = max([8] + [len(name) + 1 for name in summary])
    lines = []
    for name, m in summary.items():
        parts = rj.kinds.KINDS[m["kind"]].said(m)
        head = f"{m['layers_moved']}/{counted(m['layers'], 'layer')}: " if "layers" in m else ""
        still = "layers" in m and not m["layers_moved"] or not parts
        lines.append(f"  {name:<{width}}{head}{'nothing moved' if still else '; '.join(parts)}")
    return lines


# What the distances from the identity in `moved_lines` mean
MOVED_LEGEND = "(a map's distance from the identity: ||M - I||_F / sqrt(2 n), 0 for the identity, about 1 for a random rotation)"
