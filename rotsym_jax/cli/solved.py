"""What an alignment's options solve of a model's groups, in words (`rotsym inspect`'s options line)."""

from __future__ import annotations

from ..engine.residual import mode_refusal
from ..spec import MIXTURE


def solved_with(options: dict, blocks=(), perms=(), streams=()) -> str:
    """What an alignment with `options` solves of the groups above, and the option that changes
    each: a group lists every element its model has; the options pick which of them are solved,
    within what each attention block's geometry allows (`blocks`, `perms`, `streams`: the bound spec's; `perms`
    the experts blocks too, which an experts block of something else than experts names: Mamba-2's SSM heads)."""
    clauses: dict[str, list[str]] = {}
    for block in blocks:
        clauses.setdefault(attention_solved(block.geometry, options), []).append(repr(block.name))
    if len(clauses) > 1:  # blocks of other geometries (a QK-norm in some): each its own
        attention = "; ".join(f"attention {', '.join(names)}: {clause}" for clause, names in clauses.items())
    else:
        attention = next(iter(clauses), "no attention group")
    scaled = any(getattr(g, "scaled", False) for g in perms)
    # an experts block names what it permutes (`ExpertGroup.names`): a mixture's experts are FFN units
    named = list(dict.fromkeys(g.names for g in perms if getattr(g, "names", MIXTURE) != MIXTURE))
    plain = any(getattr(g, "names", MIXTURE) == MIXTURE for g in perms) or not named
    units = ", ".join(["FFN units"] * plain + [f"{n.expert}s and their {n.unit}s" for n in named])
    ffn = {"permutation": f"{units} permuted" + (", each gated unit's scale left" if scaled else ""),
           "scaled": f"{units} permuted and each gated unit scaled" if scaled else f"{units} permuted (no gated FFN group: no unit scales)",
           "none": f"{units} left"}[options["ffn"]]
    residual = _residual_solved(options["residual"], streams)
    layers = "" if options.get("layers") is None else f"layers {list(options['layers'])} only, the others left (--layers): "
    return (f"{layers}{attention}; {ffn} (--ffn); {residual}"
            + ("" if options.get("method", "weights") == "weights" else f"; method {options['method']}"))


def _residual_solved(mode: str, streams) -> str:
    """The residual streams' clause: the modes this model's norms allow, and a refused one named so."""
    if not streams:
        return "residual stream left (no group of this model's record moves it)" + ("" if mode == "none" else f"; --residual {mode} is refused")
    refusals = {m: mode_refusal(streams, m) for m in ("permutation", "signed_permutation", "rotation")}
    what = f"residual streams ({', '.join(s.name for s in streams)}, each its own)" if len(streams) > 1 else "residual stream"
    if mode == "none":
        allowed = "|".join(m for m, why in refusals.items() if why is None)
        return f"{what} left (--residual {allowed} moves {'them' if len(streams) > 1 else 'it'})"
    if refusals.get(mode):
        return f"{what}: {mode.replace('_', ' ')}, which align refuses here: {refusals[mode]}"
    return f"{what}: {mode.replace('_', ' ')}"


def attention_solved(g, options: dict) -> str:
    """What `options` solve of an attention block of geometry `g`, as the solver reads them
    (engine/driver._attention_solve, engine/attention.solve_cross and finish_dim_permutation)."""
    attention, rescale = options["attention"], options["rescale"]
    if attention == "none":
        return "heads, Q/K and V/O left (--attention)"
    heads = ("heads in place (their order is fixed)" if g.fixed_order else "head permutations searched" if options["heads"] == "permute"
             else "heads in place (--heads permute searches their order)")
    partial = bool(g.rotary_dim) and g.rotary_dim < g.head_dim
    invertible = attention == "rotation" and options.get("maps") == "invertible"
    vo = "invertible maps" if invertible else "rotated" if attention == "rotation" else "dims permuted"
    if g.gated_output:  # a gate per entry of the heads' outputs: only sign flips (and the scale) commute with it
        vo = "sign flips of each dim (gated outputs)" if attention == "rotation" else "left (gated outputs: no dim permutation)"
    if g.qk_signs_only:  # a gain per dim: sign flips only (of whole rotary pairs), never a dim permutation
        qk = (("sign flips of whole rotary pairs" + (" and of the dims past them" if partial else "") if g.rotary_dim else "sign flips of each dim")
              if attention == "rotation" else "left (QK-norm: no dim permutation)")
    elif attention == "rotation":  # a QK-norm without weights keeps rotations, no other invertible map
        qk = ("rotated" if g.qk_norm else vo) + (" within each rotary pair" + (" and past them" if partial else "") if g.rotary_dim else "")
    else:  # no permutation of rotary dims commutes with RoPE
        qk = "dims past the rotary pairs permuted" if partial else "left (RoPE: no dim permutation)" if g.rotary_dim else "dims permuted"
    what = f"Q/K and V/O {vo}" if qk == vo else f"Q/K {qk}, V/O {vo}"
    scaled = {"sequential": "scaled (sequential, the paper's)", "joint": "scaled (joint)"}.get(rescale)
    if invertible:
        unscaled = ", none on Q/K (QK-norm)"
        scale = "scales within the maps" + {"head": unscaled, "unit": unscaled, "full": ", Q/K's on the norm's gains" if scaled else ", none on Q/K"}.get(g.qk_norm, "")
    elif scaled is None:
        scale = "no scale"
    elif g.qk_norm in ("head", "unit"):  # the norm's eps sees a scale on the kernels (and one gain serves every head)
        scale = f"V/O {scaled}, Q/K not (QK-norm)"
    elif g.qk_norm == "full":
        scale = f"{scaled}, Q/K's on the norm's gains"
    else:
        scale = scaled
    return f"{heads}; {what} (--attention), {scale} (--rescale)"



def settled_line(settled: dict | None, asked: str | None) -> str | None:
    """One short line for a report's `settled` on the streams (what the ceiling `asked`, the residual
    option as recorded, became on each stream that does not take it); None where every one does.
    (The pipelines settle residual="auto" before the run: their options record what it became.)"""
    streams = (settled or {}).get("streams") or {}
    below = [f"{name} {mode}" for name, mode in streams.items() if mode != asked]
    if not below:
        return None
    others = len(streams) - len(below)
    return (f"settled: residual={asked!r} is a ceiling on {len(streams)} streams: {', '.join(below)}"
            + (f"; the other{'s' * (others != 1)} {asked}" if others else ""))
