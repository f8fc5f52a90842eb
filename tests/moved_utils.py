"""What a planted transform moves, computed from its arrays on their own (not by engine/report.py):
the amounts an alignment that undoes it must report in its "moved" section. The inverse of a
permutation fixes as many points, and an orthogonal map's inverse is as far from the identity
(||R^T - I|| = ||R - I||, = sqrt(2 n - 2 tr R)); scales come back inverted."""

from __future__ import annotations

import numpy as np
import pytest


def _distance(m) -> float:
    """The mean of sqrt((2 n - 2 tr M) / (2 n)) over the leading axes of orthogonal (..., n, n) maps."""
    m = np.asarray(m, np.float64)
    n = m.shape[-1]
    return float(np.mean(np.sqrt(np.maximum(2 * n - 2 * np.trace(m, axis1=-2, axis2=-1), 0) / (2 * n))))


def planted_amounts(bound, planted: dict) -> dict:
    """{group: {field: value}} of what undoing `planted` moves, in the fields of report["moved"]."""
    out = {}
    for block in bound.attention:
        t = planted[block.name]
        gp, hp = np.asarray(t.group_perm), np.asarray(t.head_perm)
        n, g, r = hp.shape
        slots = (gp[:, :, None] * r + hp).reshape(n, g * r)  # each new query slot's old slot, flat
        inverse_scales = {k: 1 / np.asarray(getattr(t, k), np.float64) for k in ("qk_scale", "vo_scale")}
        out[block.name] = {"heads": float(np.mean(slots != np.arange(g * r))), "qk": _distance(t.qk), "vo": _distance(t.vo),
                           **{k: [s.min(), s.max()] for k, s in inverse_scales.items()}}
    for group in bound.experts:
        t = planted[group.name]
        perm, units = np.asarray(t.perm), np.asarray(t.units)
        out[group.name] = {"experts": float(np.mean(perm != np.arange(perm.shape[-1]))), "units": float(np.mean(units != np.arange(units.shape[-1])))}
    for group in bound.perms:
        out[group.name] = {"units": float(np.mean(np.asarray(planted[group.name].perm) != np.arange(group.size)))}
    if "residual" in planted:
        m = np.asarray(planted["residual"].matrix(), np.float64)
        out["residual"] = {"coordinates": float(np.mean(np.abs(np.diagonal(m) - 1) > 1e-6)),
                           **({"rotation": _distance(m)} if planted["residual"].rotation is not None else {})}
    return out


def assert_reports(moved: dict, bound, planted: dict) -> None:
    """report["moved"] says every layer of every group moved, by the planted amounts (to its four digits)."""
    want = planted_amounts(bound, planted)
    assert set(moved) == set(want), (moved, want)
    for name, fields in want.items():
        got = moved[name]
        assert got.get("layers_moved", 1) == got.get("layers", 1), (name, got)
        for field, value in fields.items():
            assert got[field] == pytest.approx(value, rel=2e-3, abs=1e-4), (name, field, got, fields)


def assert_nothing_moved(moved: dict) -> None:
    """report["moved"] of transforms that are the identity: no layer moved, every amount 0, every scale 1."""
    assert moved, moved
    for name, m in moved.items():
        assert m.get("layers_moved", 0) == 0, (name, m)
        assert all(v == 0 for k, v in m.items() if k in ("heads", "qk", "vo", "rope", "units", "experts", "coordinates", "rotation")), (name, m)
        assert all(v == [1.0, 1.0] for k, v in m.items() if k.endswith("scale")), (name, m)
