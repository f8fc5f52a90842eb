"""Checkpoints made one architecture before a run aligns and merges them, each change exact (the
same functions): a tied LM head untied where a rotation of the residual stream meets it, or beside
untied models (`ties`); a tied copy that other models store as a table of their own (T5's stacks'
embed_tokens beside `shared`) read as one, a copy of its source (`ties.read_apart_together`); the
narrower FFNs widened with zero units to the widest (`widths`)."""

from __future__ import annotations

from .hf import Checkpoint
from .ties import read_apart, read_apart_together, untie, untie_together
from .widths import widen, widen_together


def reconciled(checkpoints: list, residual: str | None) -> tuple[list, dict]:
    """The checkpoints (None entries kept) as one run takes them, and what changed: {"untied": ...
    (`ties.untie_together`), "apart": ... (`ties.read_apart_together`), "widened": {"width",
    "widened": {index: own width}, "note"}}, empty where nothing did."""
    out, untied = untie_together(checkpoints, residual)
    out, apart = read_apart_together(out)  # (after untying: a head untied by the config is not read apart as well)
    out, widened = widen_together(out)
    changes = {}
    if untied:
        changes["untied"] = untied
    if apart:
        changes["apart"] = apart
    if widened:
        parts = []
        if widened["width"] is not None:
            own = sorted({w["ffn"] for w in widened["widened"].values() if w["ffn"] != widened["width"]})
            parts.append(f"FFN widths differ: the models of {', '.join(map(str, own))} hidden units get zero units up to {widened['width']}")
        if widened["kv_heads"] is not None:
            own = sorted({w["kv_heads"] for w in widened["widened"].values() if w["kv_heads"] != widened["kv_heads"]})
            parts.append(f"head counts differ: the models of {', '.join(map(str, own))} kv groups get zero heads up to {widened['kv_heads']}")
        what = " and ".join(x for x, on in (("units", widened["width"]), ("heads", widened["kv_heads"])) if on is not None)
        widened["note"] = "; ".join(parts) + f" (zero {what} compute nothing: the same functions), and the output has the wider architecture."
        changes["widened"] = widened
    return out, changes


def prepared(checkpoint: Checkpoint, changes: dict) -> Checkpoint:
    """A checkpoint loaded whole, changed as `reconciled` changed the configs and headers it came
    from."""
    if "untied" in changes:
        checkpoint = untie(checkpoint)
    if "apart" in changes:
        checkpoint = read_apart(checkpoint, set(changes["apart"]["leaves"]))
    if "widened" in changes:
        checkpoint = widen(checkpoint, changes["widened"]["width"], kv_heads=changes["widened"]["kv_heads"])
    return checkpoint


def notes(changes: dict) -> list[str]:
    return [change["note"] for change in changes.values()]

