"""Plot helpers: the figures carry exactly the data they were given, PNGs are written atomically,
bad input is named."""

import numpy as np
import pytest

pytest.importorskip("matplotlib")
import matplotlib.image
import matplotlib.text

from rotsym_jax import plots


def _curve(alphas, losses, barrier=None):
    curve = {"alpha": np.asarray(alphas), "loss": np.asarray(losses), "accuracy": 1 - np.asarray(losses)}
    return curve if barrier is None else {"barrier": barrier, "alpha_max": 0.5, "curve": curve}


def _png_ok(path):
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]  # no temporary left behind


def test_curves_draw_every_variant_with_its_barrier(tmp_path):
    alphas = np.linspace(0, 1, 5)
    results = {"plain": _curve(alphas, [0.1, 0.9, 1.4, 0.8, 0.2], barrier=1.25), "aligned": _curve(alphas, [0.1, 0.3, 0.4, 0.3, 0.2])}
    fig = plots.curves(results, path=tmp_path / "curves.png")
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == ["plain (barrier 1.25)", "aligned"]
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [0.1, 0.9, 1.4, 0.8, 0.2])
    np.testing.assert_allclose(ax.lines[1].get_xdata(), alphas)
    _png_ok(tmp_path / "curves.png")
    acc = plots.curves(results, metric="accuracy")
    np.testing.assert_allclose(acc.axes[0].lines[0].get_ydata(), 1 - np.array([0.1, 0.9, 1.4, 0.8, 0.2]))
    assert acc.axes[0].get_ylabel() == "accuracy"


def test_curves_that_coincide_are_named_on_the_figure():
    alphas = np.linspace(0, 1, 5)
    same = [0.1, 0.5, 0.6, 0.4, 0.2]
    fig = plots.curves({"plain": _curve(alphas, same, barrier=0.45), "aligned": _curve(alphas, same, barrier=0.45)})
    assert _note(fig) == "plain and aligned coincide"
    apart = plots.curves({"plain": _curve(alphas, same), "aligned": _curve(alphas, [0.1, 0.2, 0.3, 0.2, 0.2])})
    assert _note(apart) == ""
    # within a pixel of each other on the axis they share: hidden, so named
    hidden = plots.curves({"plain": _curve(alphas, same), "aligned": _curve(alphas, np.add(same, 1e-4))})
    assert _note(hidden) == "plain and aligned coincide"
    # lines too, each group of lines drawn over one another named once (the federated runs' barriers at 0)
    flat = plots.lines([1, 2, 3], {"a": [0, 0, 0], "b": [1, 2, 3], "c": [0, 0, 0], "d": [0, 1e-4, 0], "e": [1, 2, 3]})
    assert _note(flat) == "a, c and d coincide\nb and e coincide"


def _note(fig) -> str:
    """The note the figure gives on the curves drawn over each other: its legend's title, placed
    with the legend (written on the axes, it sat over the curves' start)."""
    assert not fig.axes[0].texts
    return fig.axes[0].get_legend().get_title().get_text()


def _inside(inner, outer, slack=0.5) -> bool:
    return inner.x0 >= outer.x0 - slack and inner.y0 >= outer.y0 - slack and inner.x1 <= outer.x1 + slack and inner.y1 <= outer.y1 + slack


def _plotted_points(ax, per_segment=50) -> np.ndarray:
    """Display coordinates of every line's markers and of points along its segments."""
    out = []
    for line in ax.lines:
        xy = np.column_stack([line.get_xdata(), line.get_ydata()]).astype(float)
        t = np.linspace(0, 1, per_segment)[:, None, None]
        out.append(ax.transData.transform((xy[:-1] + t * (xy[1:] - xy[:-1])).reshape(-1, 2)))
    return np.concatenate(out)


def test_the_legend_covers_no_curve(tmp_path):
    """Five bell-shaped loss curves (the loss-barriers notebook's): matplotlib's "best" corner put
    the legend over them; now no point of any line lies in the legend's box, which stays inside the
    figure. A legend that fits in a corner stays there."""
    alphas = np.linspace(0, 1, 21)
    results = {f"variant {i} (a longer name)": _curve(alphas, 0.13 + h * np.exp(-(((alphas - 0.5 - 0.02 * i) / 0.17) ** 2)), barrier=h)
               for i, h in enumerate((2.41, 2.31, 2.72, 2.45, 2.6))}
    for fig in (plots.curves(results, path=tmp_path / "bells.png"), plots.lines(alphas, {k: r["curve"]["loss"] for k, r in results.items()})):
        fig.draw_without_rendering()
        ax = fig.axes[0]
        box, points = ax.get_legend().get_window_extent(), _plotted_points(ax)
        covered = (points[:, 0] >= box.x0) & (points[:, 0] <= box.x1) & (points[:, 1] >= box.y0) & (points[:, 1] <= box.y1)
        assert not covered.any() and _inside(box, fig.bbox)
        assert _inside(ax.get_window_extent(), fig.bbox)
    corner = plots.curves({"rising": _curve(alphas, alphas), "also": _curve(alphas, alphas**2)})
    corner.draw_without_rendering()
    assert _inside(corner.axes[0].get_legend().get_window_extent(), corner.axes[0].get_window_extent())


def test_curves_reject_bad_input():
    with pytest.raises(ValueError, match="empty"):
        plots.curves({})
    with pytest.raises(ValueError, match="'x'.*neither"):
        plots.curves({"x": {"loss": [1.0]}})
    with pytest.raises(ValueError, match="no metric 'f1'.*accuracy"):
        plots.curves({"x": _curve([0, 1], [1, 2])}, metric="f1")


def test_contour_marks_the_three_points(tmp_path):
    x, y = np.linspace(-1, 2, 7), np.linspace(-1, 1.5, 6)
    loss = np.exp(np.add.outer(y**2, (x - 0.5) ** 2))
    points = np.array([[0.0, 0.0], [1.0, 0.0], [0.3, 0.8]])
    fig = plots.contour({"x": x, "y": y, "loss": loss, "points": points}, path=tmp_path / "plane.png")
    ax = fig.axes[0]
    np.testing.assert_allclose(ax.collections[-1].get_offsets(), points)
    assert [t.get_text() for t in ax.texts] == ["A", "B", "C"]
    _png_ok(tmp_path / "plane.png")
    with pytest.raises(ValueError, match="no metric 'accuracy'.*loss"):
        plots.contour({"x": x, "y": y, "loss": loss, "points": points}, metric="accuracy")
    with pytest.raises(ValueError, match="3 points"):
        plots.contour({"x": x, "y": y, "loss": loss, "points": points}, labels=("A", "B"))


def test_contour_labels_stay_inside_a_flat_plane():
    """A plane much wider than tall (B aligned near the line from A to B): "B aligned", offset up
    from a point on the top edge, left the axes (white on the white figure); every label now lies
    inside the axes, and the y axis is stretched (and says so) so that the plane is not a sliver."""
    x, y = np.linspace(-2, 12, 21), np.linspace(-0.3, 1.8, 21)
    loss = np.exp(np.add.outer(0.1 * y**2, 0.05 * (x - 5) ** 2))
    points = np.array([[0.0, 0.0], [10.0, 0.0], [0.4, 1.5]])
    fig = plots.contour({"x": x, "y": y, "loss": loss, "points": points}, labels=("A", "B", "B aligned"))
    fig.draw_without_rendering()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.texts] == ["A", "B", "B aligned"]
    for text in ax.texts:
        assert _inside(text.get_window_extent(), ax.get_window_extent()), text.get_text()
    for text in fig.findobj(matplotlib.text.Text):
        if text.get_text() and text.get_visible():
            assert _inside(text.get_window_extent(), fig.bbox), text.get_text()
    height, width = ax.get_window_extent().height, ax.get_window_extent().width
    assert height >= plots.MIN_HEIGHT * width and ax.get_ylabel().endswith("(stretched ×2)")
    square = plots.contour({"x": x, "y": np.linspace(-1, 13, 21), "loss": loss, "points": [[0, 0], [10, 0], [5, 12]]})
    assert square.axes[0].get_aspect() == 1.0 and "×" not in square.axes[0].get_ylabel()  # distances as they are


def test_contour_of_a_constant_plane_with_long_names_reads_as_it_is():
    """The second trial: a plane of one loss showed colorbar ticks 0.6 ... 2.4 under an offset
    (1e-13 + 0.916), and long names ran into each other and out of the figure."""
    x, y = np.linspace(-0.5, 1.5, 11), np.linspace(-0.3, 1.2, 9)
    points = np.array([[0.0, 0.0], [1.0, 0.0], [0.4, 1.0]])
    names = ("model A (seed 0)", "model B (seed 1)", "model B aligned to A")
    fig = plots.contour({"x": x, "y": y, "loss": np.full((9, 11), 2.5), "points": points}, labels=names)
    fig.draw_without_rendering()
    bar = fig.axes[1]
    assert [t.get_text() for t in bar.get_yticklabels()] == [f"{np.log(2.5):.4g}"] and bar.yaxis.get_offset_text().get_text() == ""
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.texts] == ["1", "2", "3"] and all(f"{i}: {n}" in ax.get_xlabel() for i, n in enumerate(names, 1))
    boxes = [t.get_window_extent() for t in ax.texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    for text in fig.findobj(matplotlib.text.Text):
        if text.get_text() and text.get_visible():
            assert _inside(text.get_window_extent(), fig.bbox), text.get_text()


def test_bars_heights_equal_the_table(tmp_path):
    table = {"average": {"plain": 0.1, "matched": 0.3}, "fisher": {"plain": 0.5, "matched": None}}
    fig = plots.bars(table, percent=True, ylabel="accuracy", path=tmp_path / "bars.png")
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    np.testing.assert_allclose(heights[:2], [10.0, 50.0])  # series "plain" over the two groups
    assert heights[2] == pytest.approx(30.0) and np.isnan(heights[3])  # a missing value is a gap
    assert [t.get_text() for t in ax.get_xticklabels()] == ["average", "fisher"]
    assert ax.get_ylabel() == "accuracy (%)"
    _png_ok(tmp_path / "bars.png")


def test_lines_check_lengths():
    fig = plots.lines([1, 2, 3], {"a": [3.0, 2.0, 1.0]}, xlabel="k")
    np.testing.assert_allclose(fig.axes[0].lines[0].get_ydata(), [3, 2, 1])
    with pytest.raises(ValueError, match="series 'b' has shape \\(2,\\), the x axis \\(3,\\)"):
        plots.lines([1, 2, 3], {"b": [1.0, 2.0]})


def test_failed_save_leaves_nothing(tmp_path):
    fig = plots.bars({"g": {"s": 1.0}})

    def broken(path, **kwargs):
        open(path, "wb").write(b"partial")
        raise OSError("disk full")

    fig.savefig = broken
    with pytest.raises(OSError, match="disk full"):
        plots.save(fig, tmp_path / "out.png")
    assert list(tmp_path.iterdir()) == []
