"""Which result an alignment keeps (issue 46): no method ends worse than leaving B as it is.

Every method's result is compared with the identity (B as given) and, where cheap, with the other
closed forms, on the objective the method is judged by, and the best is kept (`fallback=False`:
the method's own result, whatever it gives):

- weight matching (no data): the weight distance to A, its own objective and the report's.
- activation matching: the merged model (A + B') / 2 on its data, by the KL divergence of its
  predictions from the mean of A's and B's (label-free, as activation matching is). Not the
  weight distance: activation matching helps a merge most where it moves B *farther* from A than
  it was (the digits ViTs of different inits: distance 16.2 -> 17.2, barrier 2.70 -> 0.89); and
  not its own activation similarity, on which it beats the identity by construction (the issue's
  MiniLM fine-tunes: distance 1.1 -> 41). Losses within LOSS_TIE of the best are a tie, which
  the result closest to A wins: where the data cannot tell results apart (fine-tunes of one
  base), a merge with a base or task vectors wants B where it was. Without logits to score (no
  task head that runs, or heads of other shapes) the weight distance decides.
- learned transforms: their start, and then their best iterate against that start, on the merged
  model's held-out loss (their own objective), by the same tie rule: a trained point that beats
  its start by no more than a tie is set aside for the start, closer to A. The report says what
  was kept as for the others (`learned`): "learned" where a trained point was, else the start.
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError

# How the reports name the candidates, and the order that wins a tie (the method's own result first).
NAMES = {"weights": "weight matching", "activations": "activation matching", "identity": "the identity (B as given)",
         "learned": "the learned transforms"}
SHORT = {"identity": "identity"}
# A weight distance within this fraction of the distance before (float32 sums of squares) is a tie.
DISTANCE_TIE = 1e-5
# A loss within max(LOSS_TIE_ABS, LOSS_TIE_REL * best) of the best one is a tie (the noise of a few batches).
LOSS_TIE_ABS, LOSS_TIE_REL = 1e-3, 1e-2


def total_distance(sq: dict) -> float:
    """The weight distance the choice compares, from the squared distance of every leaf measured:
    summed in float64 in path order, so that a run in memory and a streamed one, whose squares
    come in other orders and dtypes, compare the same number."""
    return float(np.sqrt(sum(float(sq[p]) for p in sorted(sq))))


def loss_tie(losses: dict) -> float:
    best = min(v for v in losses.values() if np.isfinite(v))
    return max(LOSS_TIE_ABS, LOSS_TIE_REL * abs(best))


def pick(order, distances: dict, losses: dict | None, scale: float) -> str:
    """The candidate kept, of `order` (names, the preferred first): with `losses`, those with a
    finite loss within `loss_tie` of the lowest, else all; of these the closest to A in weight
    distance, a distance within DISTANCE_TIE * `scale` of another's being a tie (the earlier wins)."""
    names = list(order)
    if losses is not None:
        names = [n for n in names if np.isfinite(losses[n])]
        if not names:
            raise InputError("the merged model's loss on the data is not finite for any result, B as given included: the data give "
                             "the models inputs they cannot read, or the models compute NaN on them")
        best, tie = min(losses[n] for n in names), loss_tie({n: losses[n] for n in names})
        names = [n for n in names if losses[n] <= best + tie]
    winner = names[0]
    for name in names[1:]:
        if distances[name] < distances[winner] - DISTANCE_TIE * scale:
            winner = name
    return winner


def report(requested: str, winner: str, distances: dict, losses: dict | None, measure: str, before: float) -> dict:
    """report["chosen"]: the winner, what was asked, the measure, every candidate's weight distance
    (and loss), why, and `note`: one line for the user where the result is not the method's own,
    or is farther from A than B was (None otherwise)."""
    candidates = {n: {"distance": distances[n], **({"loss": losses[n]} if losses is not None else {})} for n in distances}
    shown = "; ".join(f"{SHORT.get(n, NAMES[n])} {_values(n, distances, losses)}" for n in distances)
    unit = "merged loss / weight distance to A" if losses is not None else "weight distance to A"
    if winner == requested:
        why = "the lowest" + (f" {measure}" if losses is not None else " weight distance to A")
        if losses is not None and distances[winner] > before * (1 + DISTANCE_TIE):
            why += f", although B ends farther from A in weight distance ({distances[winner]:.4g}, from {before:.4g})"
    elif losses is not None and losses[winner] > min(losses.values()):
        why = f"a {measure} as low (within {loss_tie(losses):.2g}) and closer to A"
    else:
        why = "the lowest" + (f" {measure}" if losses is not None else " weight distance to A")
    reason = f"{NAMES[winner]}: {why} ({unit}: {shown})"
    note = None
    if winner != requested:
        note = f"note: kept {NAMES[winner]} instead of {NAMES[requested]}: {why} ({unit}: {shown})"
    elif distances[winner] > before * (1 + DISTANCE_TIE):
        note = f"note: kept {reason}"
    return {"method": winner, "requested": requested, "measure": measure if losses is not None else "weight distance to A",
            "candidates": candidates, "reason": reason, "note": note}


def _values(name: str, distances: dict, losses: dict | None) -> str:
    return f"{distances[name]:.4g}" if losses is None else f"{losses[name]:.4g} / {distances[name]:.4g}"


def learned(learning: dict, distances: dict, init: str) -> dict:
    """report["chosen"] of method="learned" (`learning`: `engine.learned.learn`'s report, with
    "set_aside" where a trained point within a loss tie of its start gave way to it), as `report`
    says every kept result: `method` what was kept, "learned" where a trained point was, else the
    start it trained from (the start kept: no step lowered the held-out loss beyond a tie);
    `requested` "learned"; `start`, and `init` the start asked for ("best": the lowest loss of
    `distances`' starts, the first preferred); every start's loss and distance; `note` where the
    start was not the one asked for, or was kept."""
    start, losses = learning["start"]["chosen"], learning["start"]["losses"]
    measure = f"{learning['objective']} loss of the merged model on the {learning['start']['measured_on']}"
    out = report(next(iter(distances)) if init == "best" else init, start, distances, losses, measure, distances["identity"])
    aside = learning.get("set_aside")
    if aside:
        steps = (f"training lowered it to {aside['loss']:.4g} at step {aside['step']}, within the tie, {aside['distance']:.4g} from A: "
                 "the start is kept")
    elif learning["best_step"] == 0:
        steps = "no step lowered it: the start is kept"
    else:
        steps = f"best at step {learning['best_step']}: {learning['best_loss']:.4g}"
    trained = learning["best_step"] > 0
    out.update(method="learned" if trained else start, requested="learned", start=start, init=init,
               reason=f"started from {out['reason']}; {steps}")
    if not trained:
        out["note"] = f"note: kept {NAMES[start]} instead of {NAMES['learned']}: {out['reason']}"
    elif init == "best" or start != init:
        out["note"] = f"note: method='learned' {out['reason']}"
    return out
