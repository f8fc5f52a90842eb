"""Figures for loss landscapes and merge results, saved as PNGs: interpolation curves of several
alignment variants on one axis, a 2-D contour plane, grouped bar charts.

matplotlib is optional (`pip install rotsym_jax[plots]`); it is imported on first use. Figures are
built as `matplotlib.figure.Figure` objects, never through pyplot's global state, and returned so
that notebooks can display them. With `path`, the PNG is written under a temporary name and
renamed into place.
"""

from __future__ import annotations

import os
import textwrap
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


def _data_points(ax, per_segment: int = 16) -> np.ndarray:
    """(n, 2) display coordinates of what `ax` plots: its lines sampled along every segment (a
    line between two markers is data too) and the corners and top edge of its bars."""
    found = [np.empty((0, 2))]
    for line in ax.lines:
        xy = np.column_stack([np.asarray(line.get_xdata(), np.float64), np.asarray(line.get_ydata(), np.float64)])
        xy = xy[np.isfinite(xy).all(1)]
        if len(xy) > 1:
            t = np.linspace(0, 1, per_segment, endpoint=False)[:, None, None]
            xy = np.concatenate([(xy[:-1] + t * (xy[1:] - xy[:-1])).reshape(-1, 2), xy[-1:]])
        found.append(ax.transData.transform(xy) if len(xy) else xy)
    for patch in ax.patches:
        box = patch.get_window_extent()
        if np.isfinite(box.bounds).all() and box.width * box.height > 0:
            found.append(np.array([[x, box.y1] for x in np.linspace(box.x0, box.x1, per_segment)] + [[box.x0, box.y0], [box.x1, box.y0]]))
    return np.concatenate(found)


def legend_hides_data(fig, ax) -> bool:
    """Whether `ax`'s legend box covers any point of the data it plots (`_data_points`)."""
    legend = ax.get_legend()
    if legend is None:
        return False
    fig.draw_without_rendering()  # the legend's place is settled at draw time
    box, points = legend.get_window_extent(), _data_points(ax)
    inside = (points[:, 0] >= box.x0) & (points[:, 0] <= box.x1) & (points[:, 1] >= box.y0) & (points[:, 1] <= box.y1)
    return bool(inside.any())


def _legend(fig, ax, **options):
    """The legend where matplotlib's "best" puts it if that hides no data, else beside the axes:
    "best" only minimises the overlap, and five bell curves leave no empty corner."""
    ax.legend(fontsize="small", **options)
    if legend_hides_data(fig, ax):
        inside = ax.get_legend()
        # the figure widened by the legend (its width measured where it was), so that the axes keep theirs
        fig.set_figwidth(fig.get_figwidth() + inside.get_window_extent().width / fig.dpi + 0.1)
        inside.remove()
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, **options)


def _finish_lines(fig, ax, xlabel, ylabel, title, path, note=None):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    # the note (curves drawn over each other) as the legend's title: placed with it, never over data
    _legend(fig, ax, **({"title": note, "title_fontsize": "small"} if note else {}))
    return _finish(fig, path)


def _curve_of(name: str, result: Mapping) -> tuple[dict, float | None]:
    """(interpolation dict, barrier or None) of an `interpolate` or `loss_barrier` result."""
    if "curve" in result:
        return result["curve"], result.get("barrier")
    if "alpha" in result:
        return result, None
    raise InputError(f"curves[{name!r}] is neither an `interpolate` result (with 'alpha') nor a `loss_barrier` result (with 'curve')")


# A contour plane's height is at least this fraction of its width on the figure (its y axis stretched).
MIN_HEIGHT = 0.25

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
    return _finish_lines(fig, ax, xlabel, metric, title, path, _coincide(drawn))


def _coincide(drawn: list) -> str | None:
    """The note naming the lines of `drawn` ([(name, (x, y))]) drawn over each other: a line within
    a pixel or so of another hides it, so the figure says so."""
    ys = np.concatenate([xy[1] for _, xy in drawn])
    span = float(np.ptp(ys)) if ys.size and np.isfinite(ys).all() else 0.0
    close = COINCIDE * (span or max(float(np.abs(ys).max(initial=0.0)), 1.0))
    root = list(range(len(drawn)))  # union-find: lines that coincide, directly or along a chain, are one group
    find = lambda i: i if root[i] == i else find(root[i])  # noqa: E731
    for i, (_, xa) in enumerate(drawn):
        for j, (_, xb) in enumerate(drawn[:i]):
            if xa[0].shape == xb[0].shape and np.allclose(xa[0], xb[0]) and float(np.max(np.abs(xa[1] - xb[1]), initial=0.0)) <= close:
                root[find(i)] = find(j)
    groups = [[name for k, (name, _) in enumerate(drawn) if find(k) == r] for r in dict.fromkeys(find(k) for k in range(len(drawn)))]
    same = [g for g in groups if len(g) > 1]
    # a group a line, wrapped: as the legend's title, one long line was wider than the axes
    return "\n".join(textwrap.fill(f"{', '.join(g[:-1])} and {g[-1]} coincide", 48) for g in same) or None


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
    x, y = np.asarray(plane_result["x"], np.float64), np.asarray(plane_result["y"], np.float64)
    (x0, x1), (y0, y1) = (x.min(), x.max()), (y.min(), y.max())
    # Equal axes show distances as they are, but a plane much flatter than wide (B aligned near the
    # line from A to B) would be a strip too thin to read: stretch its y axis, and say by how much.
    stretch = max(1.0, MIN_HEIGHT * (x1 - x0) / max(y1 - y0, 1e-30))
    stretch = float(np.ceil(stretch)) if stretch > 1 else 1.0
    # Long names overlap where two points are near (in the figure) and push the axis labels out:
    # the points are then numbered, their names in a key under the axes.
    tags = labels if max(len(str(label)) for label in labels) <= 10 else ("1", "2", "3")
    # the figure as tall as the plane needs (a flat one left most of a square figure empty)
    height = float(np.clip(1.9 + 3.6 * stretch * (y1 - y0) / (x1 - x0), 2.8, 4.6)) + (0.6 if tags is not labels else 0.0)
    fig = _figure((5.6, height))
    from matplotlib import patheffects  # importable: _figure imported matplotlib

    ax = fig.add_subplot()
    finite = shown[np.isfinite(shown)]
    value = float(finite.mean()) if finite.size else 0.0
    constant = finite.size > 0 and float(np.ptp(finite)) <= 1e-9 * max(1.0, abs(value))
    if constant:  # one band around the value: levels over a spread of rounding made bands of nothing
        half = max(1e-6 * abs(value), 1e-9)
        levels = [value - half, value + half]
    filled = ax.contourf(plane_result["x"], plane_result["y"], shown, levels=levels, cmap="viridis")
    name = f"log {metric}" if log else metric
    bar = fig.colorbar(filled, ax=ax, label=f"{name} (the same everywhere)" if constant else name,
                       **({"ticks": [value], "format": "%.4g"} if constant else {}))
    if hasattr(bar.formatter, "set_useOffset"):
        bar.formatter.set_useOffset(False)  # an offset (1e-13 + 0.916) read as losses from 0.6 to 2.4
        bar.update_ticks()
    points = np.asarray(plane_result["points"])
    ax.scatter(points[:, 0], points[:, 1], c="white", edgecolors="black", zorder=3)
    ax.set_aspect(stretch)
    # Each label on the side of its point that faces the plot's middle, so that a point on the top
    # or right edge keeps its label inside the axes (offset up and right, it left them, white on
    # white); outlined in black, it reads on the light contours too.
    outline = [patheffects.withStroke(linewidth=2.5, foreground="black")]
    for (px, py), label in zip(points, tags):
        right = (px - x0) <= 0.5 * (x1 - x0)
        up = (py - y0) <= 0.5 * (y1 - y0)
        ax.annotate(label, (px, py), textcoords="offset points", xytext=(5 if right else -5, 5 if up else -5),
                    ha="left" if right else "right", va="bottom" if up else "top", color="white", fontweight="bold",
                    path_effects=outline, annotation_clip=False)
    key = "" if tags is labels else "\n" + "\n".join(f"{tag}: {label}" for tag, label in zip(tags, labels))
    ax.set_xlabel(f"parameter distance along {tags[0]} → {tags[1]}{key}")
    # on two or three lines: one ran past a flat plane's figure, top and bottom
    ax.set_ylabel(f"orthogonal direction\ntowards {tags[2]}" + (f"\n(stretched ×{stretch:g})" if stretch > 1 else ""))
    if title:
        fig.suptitle(title)  # over the figure: above the axes alone, a long title ran under the colorbar
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
    if title:
        ax.set_title(title)
    if len(series) > 1:
        _legend(fig, ax)
    return _finish(fig, path)


def lines(xs, ys: Mapping[str, object], *, path=None, xlabel: str = "", ylabel: str = "", title: str | None = None):
    """Several named series over one x axis (e.g. merged loss against the matched layer index)."""
    if not ys:
        raise InputError("lines: `ys` is empty")
    xs = np.asarray(xs)
    fig = _figure()
    ax = fig.add_subplot()
    drawn = []
    for name, y in ys.items():
        y = np.asarray(y, np.float64)
        if y.shape != xs.shape:
            raise InputError(f"lines: series {name!r} has shape {y.shape}, the x axis {xs.shape}")
        ax.plot(xs, y, marker="o", markersize=3, label=name)
        drawn.append((name, (np.asarray(xs, np.float64), y)))
    return _finish_lines(fig, ax, xlabel, ylabel, title, path, _coincide(drawn))
