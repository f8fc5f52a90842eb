"""Figures for loss landscapes and merge results, saved as PNGs: interpolation curves of several
alignment variants on one axis, a 2-D contour plane, grouped bar charts.

matplotlib is optional (`pip install rotsym_jax[plots]`); it is imported on first use. Figures are
built as `matplotlib.figure.Figure` objects, never through pyplot's global state, and returned so
that notebooks can display them. With `path`, the PNG is written under a temporary name and
renamed into place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..pytree import atomic_path


def _figure(size=(6.4, 4.0)):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # only the plots need it
        raise ImportError("rotsym_jax.plots needs matplotlib: pip install 'rotsym_jax[plots]'") from e
    return Figure(figsize=size, layout="constrained")


def save(fig, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Write `fig` as a PNG at `path` atomically (temporary name, then rename)."""
    with atomic_path(path, ".png") as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    return Path(path)


def _finish(fig, path):
    if path is not None:
        save(fig, path)
    return fig


def _finish_lines(fig, ax, xlabel, ylabel, title, path):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    return _finish(fig, path)


def _curve_of(name: str, result: Mapping) -> tuple[dict, float | None]:
    """(interpolation dict, barrier or None) of an `interpolate` or `loss_barrier` result."""
    if "curve" in result:
        return result["curve"], result.get("barrier")
    if "alpha" in result:
        return result, None
    raise InputError(f"curves[{name!r}] is neither an `interpolate` result (with 'alpha') nor a `loss_barrier` result (with 'curve')")


# Curves closer than this fraction of the y axis's span are drawn over each other (a pixel or two).
COINCIDE = 0.005


def curves(results: Mapping[str, Mapping], *, metric: str = "loss", path=None, title: str | None = None,
           xlabel: str = "α  (0: model A, 1: model B)"):
    """One line per entry of `results` ({variant name: `barrier.interpolate` or
    `barrier.loss_barrier` result}), `metric` against α; the legend gives each loss barrier, and
    a note names the curves drawn over each other (within `COINCIDE` of the axis's span)."""
    if not results:
        raise InputError("curves: `results` is empty")
    fig = _figure()
    ax = fig.add_subplot()
    drawn = []
    for name, result in results.items():
        curve, barrier = _curve_of(name, result)
        if metric not in curve:
            raise InputError(f"curves[{name!r}] has no metric {metric!r}; it has {sorted(k for k in curve if k != 'alpha')}")
        label = name if barrier is None or metric != "loss" else f"{name} (barrier {barrier:.3g})"
        xy = (np.asarray(curve["alpha"], np.float64), np.asarray(curve[metric], np.float64))
        ax.plot(*xy, marker="o", markersize=3, label=label)
        drawn.append((name, xy))
    # A line drawn over one within a pixel or so of it hides it: say so on the figure.
    ys = np.concatenate([xy[1] for _, xy in drawn])
    span = float(np.ptp(ys)) if ys.size and np.isfinite(ys).all() else 0.0
    close = COINCIDE * (span or max(float(np.abs(ys).max(initial=0.0)), 1.0))
    same = [f"{a} and {b}" for i, (a, xa) in enumerate(drawn) for b, xb in drawn[i + 1:]
            if xa[0].shape == xb[0].shape and np.allclose(xa[0], xb[0]) and float(np.max(np.abs(xa[1] - xb[1]), initial=0.0)) <= close]
    if same:
        ax.text(0.02, 0.02, "; ".join(f"{pair} coincide" for pair in same), transform=ax.transAxes, fontsize="small", alpha=0.8)
    return _finish_lines(fig, ax, xlabel, metric, title, path)


def contour(plane_result: Mapping, *, metric: str = "loss", labels=("A", "B", "C"), path=None,
            title: str | None = None, levels: int = 20, log: bool = True):
    """Filled contours of `metric` over a `barrier.plane` result, with its three points marked.
    `log`: contour the log of a positive metric (losses span orders of magnitude)."""
    if metric not in plane_result:
        raise InputError(f"contour: the plane has no metric {metric!r}; it has {sorted(k for k in plane_result if k not in ('x', 'y', 'points'))}")
    if len(labels) != 3:
        raise InputError(f"contour: labels must name the plane's 3 points, got {labels!r}")
    z = np.asarray(plane_result[metric], np.float64)
    shown = np.log(np.maximum(z, 1e-12)) if log else z
    fig = _figure((5.6, 4.6))
    ax = fig.add_subplot()
    filled = ax.contourf(plane_result["x"], plane_result["y"], shown, levels=levels, cmap="viridis")
    fig.colorbar(filled, ax=ax, label=f"log {metric}" if log else metric)
    points = np.asarray(plane_result["points"])
    ax.scatter(points[:, 0], points[:, 1], c="white", edgecolors="black", zorder=3)
    for (px, py), label in zip(points, labels):
        ax.annotate(label, (px, py), textcoords="offset points", xytext=(5, 5), color="white", fontweight="bold")
    ax.set_aspect("equal")
    ax.set_xlabel(f"parameter distance along {labels[0]} → {labels[1]}")
    ax.set_ylabel(f"orthogonal direction towards {labels[2]}")
    if title:
        ax.set_title(title)
    return _finish(fig, path)


def bars(table: Mapping[str, Mapping[str, float]], *, path=None, ylabel: str | None = None,
         title: str | None = None, percent: bool = False):
    """Grouped bars: one group per outer key of `table`, one bar per inner key (the series, in the
    order they first appear). Missing or None values leave a gap."""
    if not table:
        raise InputError("bars: `table` is empty")
    series = list(dict.fromkeys(k for row in table.values() for k in row))
    groups = list(table)
    width = 0.8 / len(series)
    fig = _figure((max(6.4, 0.9 * len(groups) * max(1, len(series) / 2)), 4.0))
    ax = fig.add_subplot()
    x = np.arange(len(groups))
    for i, name in enumerate(series):
        values = [table[g].get(name) for g in groups]
        heights = np.array([np.nan if v is None else float(v) for v in values]) * (100 if percent else 1)
        ax.bar(x + (i - (len(series) - 1) / 2) * width, heights, width, label=name)
    ax.set_xticks(x, groups, rotation=30 if len(groups) > 4 else 0, ha="right" if len(groups) > 4 else "center")
    if ylabel:
        ax.set_ylabel(ylabel + (" (%)" if percent else ""))
    ax.grid(axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    return _finish(fig, path)


def lines(xs, ys: Mapping[str, object], *, path=None, xlabel: str = "", ylabel: str = "", title: str | None = None):
    """Several named series over one x axis (e.g. merged loss against the matched layer index)."""
    if not ys:
        raise InputError("lines: `ys` is empty")
    xs = np.asarray(xs)
    fig = _figure()
    ax = fig.add_subplot()
    for name, y in ys.items():
        y = np.asarray(y, np.float64)
        if y.shape != xs.shape:
            raise InputError(f"lines: series {name!r} has shape {y.shape}, the x axis {xs.shape}")
        ax.plot(xs, y, marker="o", markersize=3, label=name)
    return _finish_lines(fig, ax, xlabel, ylabel, title, path)
