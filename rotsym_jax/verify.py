"""Prove a checkpoint's symmetry groups against transformers (`rotsym inspect A --verify`).

rotsym_jax moves weights, so every group it uses must keep the model's function exactly. For each
kind of group element the family's spec declares (head permutations, QK and VO elements and their
scales, FFN unit permutations and a gated FFN's unit scales, the residual stream's permutations, signed permutations and rotations), `verify_groups`
draws a random element, applies it to the checkpoint's weights (norm gains folded first for a
rotation of the stream, a tied LM head untied), saves the result and runs it in transformers' own PyTorch model beside
the original: outputs equal within `tol` (relative, float32) prove the element kind. A kind the
model does not have (no RoPE pairs to flip, a residual rotation a post-LN stream forbids) is
reported as not applicable, with the reason.

Beside them, the residual stream as the pipelines take it (`rotation_as_run`, `strongest_as_run`):
whether a run, which unties and folds as the proof above does, can rotate a checkpoint's stream.

A checkpoint with MLA's latents (`Spec.unit_norms`: DeepSeek-V2/V3's q_lora and kv_lora) has one
row more, their rotations (`align(latents="rotation")`), each latent norm's gain folded into the
layers reading the latent first, as align folds it (`_latent_check`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from . import owned
from .engine.groups import apply_transform
from .engine.latents import fold_latents, random_latent_rotations, rotatable_groups
from .engine.residual import (
    check_rotatable,
    fold_norms,
    mode_refusal,
    random_residual,
    rotation_refusal,
    stream_modes,
    strongest_of,
)
from .errors import InputError
from .families.bart import EncoderDecoderFamily
from .families.family import InferredRecord
from .io.hf import Checkpoint, CheckpointError, family_of, load_hf, save_hf, spec_for, supported_model_types
from .io.inferred import candidate_records
from .io.ties import blocks_rotation, can_untie, stream_folds, untie
from .pytree import flatten
from .spec import MIXTURE, SINK_ROLE, bind
from .transforms import random_transform

# (name, random_transform kinds, residual mode): one element kind at a time.
ELEMENTS = (
    ("head permutations", ("heads",), None),
    ("QK rotations", ("qk",), None),
    ("VO rotations", ("vo",), None),
    ("QK scales", ("qk_scale",), None),
    ("VO scales", ("vo_scale",), None),
    ("QK invertible maps", ("qk_invertible",), None),
    ("VO invertible maps", ("vo_invertible",), None),
    ("FFN unit permutations", ("perm",), None),
    ("FFN unit scales", ("unit_scale",), None),
    ("residual permutation", (), "permutation"),
    ("residual signed permutation", (), "signed_permutation"),
    ("residual rotation", (), "rotation"),
)


@dataclasses.dataclass(frozen=True)
class Check:
    """One element kind: its name, the group it stands for on this model, the largest relative
    difference of the outputs transformers computes (None when not applicable), and whether it
    holds (`note` says why not applicable)."""

    element: str
    group: str
    difference: float | None
    ok: bool
    note: str = ""


def verify_groups(path, *, seed: int = 0, tol: float = 1e-4, record: InferredRecord | None = None) -> list[Check]:
    """Every element kind of the checkpoint at `path` (a Hugging Face folder; `record`: read with
    an inferred record) applied at random and run in transformers: see the module docstring.
    Needs torch and transformers."""
    transformers, torch = _transformers("verifying the groups")
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # one load per element kind; restored below
    try:
        return _verify(path, seed, tol, transformers, torch, record)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _transformers(what: str):
    try:
        import torch
        import transformers
    except ImportError as e:
        raise RuntimeError(f"{what} runs the model in transformers' PyTorch implementation: {e}") from e
    return transformers, torch


def _verify(path, seed, tol, transformers, torch, record=None) -> list[Check]:
    ck = load_hf(path, dtype=np.float32, record=record)
    family = family_of(ck.model_config)
    cls = getattr(transformers, family.architecture(ck.model_config, ck.layout))
    inputs = _inputs(ck, seed)
    reference = _outputs(cls, Path(path), inputs, torch)
    spec = spec_for(ck)
    bound = bind(spec, ck.params)
    key = jax.random.key(seed)
    checks = []
    with owned.scratch("rotsym-verify-") as tmp:
        for i, (name, kinds, residual) in enumerate(ELEMENTS):
            group, note = _blocks_group(name, bound, ck)
            name = _title(name, bound)  # the element kind as this model's groups are (Mamba's state entries, not FFN units)
            if note:
                checks.append(Check(name, group, None, True, note))
                continue
            # a rotation folds the gains first, a tied LM head's final one into the head untied (io.ties);
            # where a family ties otherwise, the gains say whether a rotation could apply at all
            moving = _untied(ck) if residual == "rotation" else ck
            moving_spec = spec_for(moving)
            params = fold_norms(moving_spec, moving.params) if residual == "rotation" else ck.params
            if residual == "rotation":
                try:  # a gain that cannot fold: no rotation applies
                    moving_bound = bind(moving_spec, params)
                    modes = stream_modes(moving_bound, residual)
                    check_rotatable(moving_bound, params, "A", [s for s in moving_bound.streams if modes[s.name] == "rotation"])
                except ValueError as e:
                    checks.append(Check(name, group, None, True, str(e).removeprefix("A: ")))
                    continue
            moved = _moving_draw(moving_spec, params, key, i, kinds, residual)
            if moved is None:
                checks.append(Check(name, group, None, True, f"every one of {DRAWS} draws was the identity here: nothing to compare"))
                continue
            folder = save_hf(moving, moved, Path(tmp) / f"element-{i}", dtype=np.float32)
            got = _outputs(cls, folder, inputs, torch)
            # a dual encoder's joint space moves both embeddings (MATH §10): its logits are what it keeps
            kept = [k for k in reference if not (residual and _dual(ck) and k.endswith("_embeds"))]
            difference = max(_relative(got[k], reference[k]) for k in kept)
            checks.append(Check(name, group, difference, difference <= tol))
        latent = _latent_check(ck, spec, bound, jax.random.fold_in(key, len(ELEMENTS)), lambda folder: _outputs(cls, folder, inputs, torch),
                               reference, Path(tmp), tol)
    return checks + ([latent] if latent else [])


LATENT_ROTATIONS = "latent rotations"


def _latent_check(ck: Checkpoint, spec, bound, key, outputs, reference: dict, tmp: Path, tol: float) -> Check | None:
    """The row of the latents' rotations (None where the checkpoint has no latent): a Haar rotation
    per layer of each latent (`random_latent_rotations`) on the params with every latent norm's gain
    folded into its readers' rows (`fold_latents`, as align folds them for latents="rotation")."""
    groups = rotatable_groups(bound)
    if not groups:
        return None
    params = fold_latents(spec, ck.params)
    moved = apply_transform(spec, params, random_latent_rotations(spec, params, key))
    got = outputs(save_hf(ck, moved, tmp / "element-latents", dtype=np.float32))
    difference = max(_relative(got[k], reference[k]) for k in reference)
    group = (f"orthogonal, per layer, of {', '.join(f'{g.name} ({g.size})' for g in groups)}; each norm's gain folded into its "
             "readers' rows first")
    return Check(LATENT_ROTATIONS, group, difference, difference <= tol)


DRAWS = 8  # draws of an element before a row says every one was the identity


def _moving_draw(spec, params, key, i: int, kinds, residual):
    """The params moved by the first of `DRAWS` random elements (row i's keys) that moves a leaf (a
    small group draws the identity often: 2 heads, half the time), or None."""
    flat = flatten(params)
    for j in range(DRAWS):
        t = random_transform(spec, params, jax.random.fold_in(key, i + 1000 * j), kinds)
        modes = stream_modes(bind(spec, params), residual) if residual else {}  # a ceiling on a model of several streams
        for k, (stream, mode) in enumerate(modes.items()):  # every stream's element, each its own draw
            t[stream] = random_residual(spec, params, jax.random.fold_in(key, 100 + i + 1000 * j + 10**6 * k), mode, stream)
        moved = apply_transform(spec, params, t)
        if any(not np.array_equal(np.asarray(x), np.asarray(flat[p])) for p, x in flatten(moved).items()):
            return moved
    return None


def _streams_shown(bound, mode: str) -> tuple[str, str]:
    """A model of several streams: what each takes under `mode`, a ceiling (`stream_modes`), or
    why none takes it."""
    modes = stream_modes(bound, mode)
    if mode not in modes.values():
        return "-", mode_refusal(bound.streams, mode)
    words = {"permutation": "permutations", "signed_permutation": "permutations with sign flips", "rotation": "rotations (gains folded)"}
    by_mode: dict = {}
    for stream, m in modes.items():
        by_mode.setdefault(m, []).append(stream)
    return "; ".join(f"{words[m]} of {', '.join(names)}" for m, names in by_mode.items()), ""


def _untied(ck: Checkpoint) -> Checkpoint:
    try:
        return untie(ck)
    except InputError:
        return ck


def _unit_nouns(bound) -> list[str]:
    """What the "perm" kind moves on this model, singular, each once: an experts block's experts and
    units (a mixture's are FFN units), each permutation group's units (`Spec.unit_names`, bound as `PermGroup.unit`)."""
    nouns = [noun for g in bound.experts for noun in (("FFN unit",) if g.names == MIXTURE else (g.names.expert, g.names.unit))]
    nouns += [g.unit or "FFN unit" for g in bound.perms]
    return list(dict.fromkeys(nouns))


def _title(name: str, bound) -> str:
    """An element kind's row title: "FFN unit permutations" says what the model's permutation groups
    and experts blocks are where they are something else (Mamba-2's SSM heads, channels, state entries)."""
    nouns = _unit_nouns(bound)
    if name != "FFN unit permutations" or nouns in ([], ["FFN unit"]):
        return name
    return (f"{', '.join(nouns[:-1])} and " if len(nouns) > 1 else "") + f"{nouns[-1]} permutations"


def _experts_shown(group) -> str:
    """An experts block as verify's group column says it (a mixture's: "4 experts (router rows with them) x their units")."""
    n = group.names
    router = "router rows" if n == MIXTURE else n.router
    return f"{group.num_experts} {n.expert}s ({router} with them) x their {n.unit}s"


_ATTENTION_ELEMENTS = ("head permutations", "QK rotations", "VO rotations", "QK scales", "VO scales", "QK invertible maps", "VO invertible maps")


def _blocks_group(name: str, bound, ck: Checkpoint) -> tuple[str, str]:
    """`_group` over every attention block: one answer where they agree; else each block's where it applies, and why
    not in the others (a vision–language model's tower beside its text model's QK-norm)."""
    blocks = bound.attention if name in _ATTENTION_ELEMENTS else bound.attention[:1]
    per = {b.name: _group(name, b.geometry, bound, ck) for b in blocks} or {"": _group(name, None, bound, ck)}
    if len(set(per.values())) == 1:
        return next(iter(per.values()))
    held = {n: g for n, (g, note) in per.items() if not note}
    if not held:
        return next(iter(per.values()))
    others = [f"not {n}: {note}" for n, (_, note) in per.items() if note]
    return "; ".join(f"{n}: {g}" for n, g in held.items()) + (f" ({'; '.join(others)})" if others else ""), ""


def _value_width(geometry) -> str:
    """V/O's width where it is not Q/K's (`HeadGeometry.value_dim`)."""
    return f" ({geometry.v_dim} wide, Q/K {geometry.head_dim})" if geometry.split_widths else ""


def _group(name: str, geometry, bound, ck: Checkpoint) -> tuple[str, str]:
    """(the group this element kind stands for on this model, why it does not apply or "")."""
    if name in ("head permutations", "QK rotations", "VO rotations", "QK scales", "VO scales", "QK invertible maps", "VO invertible maps") \
            and geometry is None:
        return "-", "no attention block"
    if name == "QK invertible maps":
        if geometry.qk_norm == "unit":
            return "-", "a QK-norm without weights divides q and k by each head's RMS: rotations keep it, no other invertible map"
        if geometry.qk_norm:
            return "-", "a QK-norm normalises q and k with one gain per entry: only sign flips of rotary pairs commute with it"
        return ("2x2 scaled rotations of each rotary pair" + (", any invertible map of the rest" if geometry.rotary_dim < geometry.head_dim else "")
                if geometry.rotary_dim else "invertible, per kv group"), ""
    if name == "VO invertible maps" and geometry.gated_output:
        return "-", "the heads' outputs are gated entry by entry: only sign flips and scales of V/O commute with the gate"
    if name == "VO invertible maps":
        return "invertible, per kv group" + _value_width(geometry), ""
    if name == "head permutations" and all(b.geometry.fixed_order for b in bound.attention):
        return "-", ("the heads' order is fixed: something outside their block is indexed by head (T5's relative position bias, "
                     "BLOOM's ALiBi slopes, which no weight holds)")
    if name == "head permutations":
        gains = (" (the full-width QK-norm's gains with them)" if geometry.qk_norm == "full"
                 else " (the output gate's rows with them)" if geometry.gated_output
                 else " (each head's RoPE query rows with them; the RoPE key every head shares stays)" if geometry.shared_rope_dim else "")
        if any(m.role == SINK_ROLE for b in bound.attention for m in b.members):
            gains += " (each head's attention sink with it)"
        if geometry.shared_rope_dim:  # MLA: one RoPE key (and a latent) every head shares, no kv groups
            return f"{geometry.num_heads} heads{gains}", ""
        return f"{geometry.num_kv_heads} kv groups x {geometry.heads_per_group} query heads{gains}", ""
    if name == "QK rotations" and geometry.shared_rope_dim:  # MLA: the no-RoPE parts', and the shared RoPE key's with every head's RoPE query
        return "orthogonal, per head (no-RoPE parts); 2-D rotations of each rotary pair of the shared RoPE key and every head's RoPE query", ""
    if name == "QK rotations":
        if geometry.qk_signs_only:
            return "sign flips of whole rotary pairs (QK-norm)", ""
        if not geometry.rotary_dim:
            return "orthogonal, per kv group", ""
        return "2-D rotations of each rotary pair" + (", any of the rest" if geometry.rotary_dim < geometry.head_dim else ""), ""
    if name == "VO rotations":
        return ("sign flips of each entry (the heads' outputs gated entry by entry)" if geometry.gated_output else "orthogonal, per kv group"
                + _value_width(geometry)), ""
    if name == "FFN unit permutations":  # the "perm" kind: dense FFN units, and experts with their units
        latents = sorted({name for b in bound.attention for name in b.after})  # MLA's: their readers' rows with them
        ffn = [g for g in bound.perms if g.unit is None]
        parts = (["unit permutations" + (f" (the latents {', '.join(latents)} with their norms' gains and readers' rows)" if latents else "")]
                 if ffn else []) + [f"{g.unit} permutations ({g.size} per layer)" for g in bound.perms if g.unit is not None]
        parts += [_experts_shown(g) for g in bound.experts]
        return (", ".join(parts), "") if parts else ("-", "no FFN group")
    if name == "FFN unit scales":
        scaled = [g.name for g in bound.perms if g.scaled]
        if scaled:  # a gated FFN's units, or units gated as they are (LFM2's convolutions' channels: c as up, out_proj as down)
            return f"positive scalars, per unit of each gated group ({', '.join(scaled)}: up rows times s, down columns divided by s)", ""
        return "-", "no gated FFN (the scales solved are a gated FFN's units')"
    if name.startswith("residual"):
        if not bound.streams:
            return "-", "no residual spec"
        if ck.layout.head is None and not _dual(ck):
            return "-", "a model without a task head returns its stream in the new basis: nothing to compare"
        if len(bound.streams) > 1:
            return _streams_shown(bound, name.removeprefix("residual ").replace(" ", "_"))
        if name == "residual signed permutation":
            refusal = mode_refusal(bound.streams, "signed_permutation")
            return ("-", refusal) if refusal else ("permutations with sign flips (RMSNorm)", "")
        if name == "residual rotation":
            refusal = mode_refusal(bound.streams, "rotation")
            if refusal:
                return "-", refusal
            untied = ", the tied LM head untied" if blocks_rotation(ck) else ""
            return ("rotations fixing the ones vector (LayerNorm" if bound.residual.norm == "layernorm" else "rotations (RMSNorm, gains folded") + untied + ")", ""
        return "permutations", ""
    if name == "QK scales" and geometry.qk_norm == "full":
        return "positive scalars, per kv group, on the full-width QK-norm's gains", ""
    if name == "QK scales" and geometry.qk_norm == "unit":
        return "-", "a QK-norm without weights keeps no QK scale (it erases a kernel's scale only up to its eps)"
    if name == "QK scales" and geometry.qk_norm:
        return "-", "a per-head QK-norm keeps no QK scale (its eps sees a kernel's scale; one gain serves every head)"
    return "positive scalars, per head", ""


def _dual(ck: Checkpoint) -> bool:
    """A dual encoder (CLIPModel): its towers' configs nested in its own."""
    return getattr(ck.model_config, "text_config", None) is not None and getattr(ck.model_config, "vision_config", None) is not None


def _inputs(ck: Checkpoint, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    config = ck.model_config
    if hasattr(family_of(config), "example_inputs"):  # images and text (a vision-language model, a dual encoder)
        return family_of(config).example_inputs(config, rng)
    if family_of(config).input == "pixel_values":  # images (ViT, CLIP's tower)
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        return {"pixel_values": rng.normal(size=(2, config.num_channels, size, size)).astype(np.float32)}
    if family_of(config).input == "input_features":  # log-mel frames (Whisper)
        return {"input_features": rng.normal(size=(2, config.num_mel_bins, 2 * config.max_source_positions)).astype(np.float32),
                "decoder_input_ids": rng.integers(0, config.vocab_size, size=(2, min(8, config.max_target_positions)))}
    length = min(8, getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 8))
    ids = rng.integers(0, config.vocab_size, size=(2, length))
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    if isinstance(family_of(config), EncoderDecoderFamily):
        if getattr(config, "eos_token_id", None) is not None:  # the sequence classifiers read each example's last eos
            ids[:, -1] = config.eos_token_id
        inputs["decoder_input_ids"] = rng.integers(0, config.vocab_size, size=ids.shape)  # T5's LM makes none of its own
    return inputs


def _outputs(cls, folder: Path, inputs: dict, torch) -> dict:
    """The outputs of transformers' `cls` loaded from `folder`, its config read as transformers'
    AutoConfig reads it (EXAONE's num_layers, which LlamaConfig itself ignores); a model that does
    not load every tensor, and no other, is refused: its outputs would prove nothing."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    model, info = cls.from_pretrained(folder, config=config, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    problems = {k: sorted(info.get(k) or ())[:4] for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
    if problems:
        raise CheckpointError(f"{folder}: transformers' {cls.__name__} does not load it as saved ({problems}), so its outputs prove no symmetry")
    model.eval()
    with torch.no_grad():
        try:
            out = model(**{k: torch.as_tensor(v) for k, v in inputs.items()})
        except (IndexError, RuntimeError, TypeError, ValueError) as e:  # its config runs nothing (a token id past the vocabulary)
            detail = (str(e).strip().splitlines() or [""])[-1][:200]
            raise CheckpointError(f"{folder}: transformers' {cls.__name__} does not run it on example inputs ({type(e).__name__}: {detail}), "
                                  "so nothing can prove a symmetry of it; its config may describe a model transformers cannot run") from None
    keys = [k for k in ("logits", "logits_per_image", "start_logits", "end_logits", "prediction_logits", "seq_relationship_logits", "image_embeds", "text_embeds",
                        "last_hidden_state")
            if getattr(out, k, None) is not None]
    keys = [k for k in keys if k != "last_hidden_state"] or keys
    return {k: getattr(out, k).numpy() for k in keys}


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


# ---- records inferred for model types without one ---------------------------------------------------

def _first_line(text: str, limit: int = 240) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def infer_record(path, *, seed: int = 0, tol: float = 1e-4) -> InferredRecord:
    """A record for the checkpoint at `path`, whose model_type has none, inferred and proven.

    Inferred: each model type of ours whose tables hold exactly the checkpoint's tensors (names,
    shapes, dtypes, nothing left over; `inferred.candidate_records`) is a candidate. Proven: a small
    model of the checkpoint's own transformers class, built from its config.json with the sizes
    shrunk (the symmetries follow from the structure, not the sizes), is moved by a random
    element of every group the candidate declares and run in transformers beside the original
    (`verify_groups`); a candidate is accepted when every element holds (float32, `tol`
    relative), the first in our families' order. Returns the record with its proof (`proven`);
    raises CheckpointError naming, per candidate, the groups that failed, or why no layout
    matched. Needs torch and transformers; reads no weight of the checkpoint."""
    transformers, torch = _transformers("proving an inferred record")
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # a small model saved and loaded per element kind; restored below
    try:
        return _infer(Path(path), seed, tol, transformers, torch)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


# The share of a checkpoint's tensor names a layout of ours must hold to be named as close to it.
CLOSE_SHARE = 0.2


def _infer(folder: Path, seed, tol, transformers, torch) -> InferredRecord:
    candidates, why = candidate_records(folder)
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    if not candidates:
        # most names in common first; a layout sharing only a name or two (an `lm_head.weight`) is not close
        closest = [kv for kv in sorted(why.items(), key=lambda kv: (-kv[1][0], kv[0])) if kv[1][0] >= CLOSE_SHARE][:3]
        if not closest:  # little in common: why each family failed would only list its own class names
            raise CheckpointError(f"{folder}: model_type {model_type!r} has no record, and no layout of ours holds {CLOSE_SHARE:.0%} of its "
                                  f"tensor names; rotsym_jax reads {len(supported_model_types())} model types (docs/reference/families.md, "
                                  "rotsym_jax.hf.supported_model_types())")
        raise CheckpointError(f"{folder}: model_type {model_type!r} has no record, and its tensors follow none of our layouts; closest: "
                              + "; ".join(f"as {t} ({shared:.0%} of the names shared), first difference: {_first_line(w)}"
                                          for t, (shared, w) in closest))
    failures = {}
    for record in candidates:
        with owned.scratch("rotsym-infer-") as tmp:
            try:
                small = _small_model(folder, record, Path(tmp) / "model", transformers, torch, seed)
                checks = verify_groups(small, seed=seed, tol=tol, record=record)
            except (RuntimeError, ValueError, IndexError, TypeError) as e:  # transformers' own class fails on the small model
                failures[record.read_as] = f"transformers' {model_type} model does not run at small sizes ({type(e).__name__}: {_first_line(str(e), 160)})"
                continue
        failed = [c for c in checks if not c.ok]
        if not failed:
            return dataclasses.replace(record, proven={c.element: c.difference for c in checks if c.difference is not None})
        failures[record.read_as] = ", ".join(f"{c.element} change the outputs by {c.difference:.2g}" for c in failed)
    detail = "; ".join(f"as {t}: {why}" for t, why in failures.items())
    raise CheckpointError(f"{folder}: model_type {model_type!r} has the tensors of {sorted(failures)}, but no such record's groups hold "
                          f"in transformers' {model_type} model ({detail}); it cannot be aligned safely without a record of its own")


def _small_model(folder: Path, record: InferredRecord, out: Path, transformers, torch, seed: int) -> Path:
    """A random model of the checkpoint's own transformers class and head, from its config.json
    with the sizes shrunk (`_shrunk`), saved at `out`: the norm gains and biases made non-trivial."""
    ck = load_hf(folder, weights=False, record=record)
    family = family_of(ck.model_config)
    raw = _shrunk(ck.model_config.raw, family.schema(record.read_as), family.num_layers)
    config = transformers.CONFIG_MAPPING[record.model_type].from_dict(raw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, family.architecture(ck.model_config, ck.layout))(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(0.2 / max(float(p.std()), 1e-12))
    model.save_pretrained(out)
    return out


def _shrunk(raw: dict, schema, layers_key: str) -> dict:
    """config.json's content with every size small and every structural choice kept: the ratio of
    query heads to kv heads, an explicit head_dim, the first layers and their per-layer lists, the
    experts (at most 4, top 2); token ids past the small vocabulary dropped."""
    out = {k: v for k, v in raw.items() if k not in ("torch_dtype", "dtype", "quantization_config")}
    names = {**{c: [c] for c in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
                                 "head_dim", "moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok", layers_key)}}
    for alias, canonical in schema.aliases.items():
        names.setdefault(canonical, [canonical]).append(alias)

    def get(key):
        return next((out[k] for k in names.get(key, [key]) if out.get(k) is not None), None)

    def put(key, value, always=False):
        for k in names.get(key, [key]):
            if k in out or always and k == key:
                out[k] = value

    heads = get("num_attention_heads") or 4
    kv = get("num_key_value_heads") or heads
    ratio = max(heads // kv, 1)
    small_heads = 4 if 4 % ratio == 0 else 2 * ratio
    dh = 8
    put("num_attention_heads", small_heads, always=True)
    put("num_key_value_heads", small_heads // ratio)
    put("hidden_size", small_heads * dh, always=True)
    if get("head_dim") is not None:
        put("head_dim", dh)
    put("intermediate_size", 48, always=True)
    put("moe_intermediate_size", 24)
    for key, most in (("num_experts", 4), ("num_local_experts", 4), ("num_experts_per_tok", 2)):
        if get(key) is not None:
            put(key, min(get(key), most))
    layers = get(layers_key) or 2
    small_layers = min(layers, 3)
    for k, v in list(out.items()):
        if isinstance(v, list) and len(v) == layers and layers != small_layers:
            out[k] = v[:small_layers]
    put(layers_key, small_layers, always=True)
    vocab = 128
    put("vocab_size", vocab, always=True)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id"):
        v = out.get(k)
        if isinstance(v, list):
            out[k] = [x for x in v if isinstance(x, int) and x < vocab] or None
        elif isinstance(v, int) and v >= vocab:
            out[k] = None
    if isinstance(out.get("sliding_window"), int):
        out["sliding_window"] = min(out["sliding_window"], 4)
    return out


# ---- the residual stream as the pipelines take it (untied and folded as the rotation proven above) -----

def rotation_as_run(checkpoint: Checkpoint) -> str | None:
    """Why a pipeline, which folds the norm gains and unties a tied head where it can, could not
    rotate this checkpoint's stream (None where it can): a placement no rotation commutes with, or
    gains that fold into no kernel (the streams' own norms; a head that stays tied)."""
    spec = spec_for(checkpoint)
    if spec.residual is None:
        return "the spec has no residual rules"
    refusal = next(filter(None, map(rotation_refusal, spec.streams)), None)
    if refusal:
        return refusal
    if blocks_rotation(checkpoint) and can_untie(checkpoint):
        checkpoint = untie(checkpoint)
    stuck = [gain for gain, readers in stream_folds(checkpoint) if not readers]
    return f"norm gains {stuck[:3]} fold into no kernel" if stuck else None


def strongest_as_run(checkpoint: Checkpoint) -> tuple[str, str]:
    """residual="auto" for a data method as the pipelines settle it (`engine.residual.strongest`,
    the gains folded and a tied head untied where it can be): a permutation where a rotation
    could not keep the function (`rotation_as_run`)."""
    mode, why = strongest_of(spec_for(checkpoint).streams)
    if mode == "rotation" and (reason := rotation_as_run(checkpoint)):
        return "permutation", f"a permutation: {reason}, so no rotation of the stream keeps the function"
    return mode, why
