"""A mergekit config run (`merge_mergekit`): each output tensor merged from its slice's tensors
(`mergekit_plan`: which layer of which model, stacked or cut as the slices say) by mergekit's
method (`merging.tensorwise`) with its parameters resolved for that tensor (`merging.mergekit`),
read and written one tensor at a time, so that a run holds one tensor of each model whatever their
size, `--max-memory` or not; with alignment (`rotsym:` block, `--align`), the models are aligned
in memory by the pipeline's own alignment first and their tensors read from the aligned weights
(where slices put one model's layers after another's: every model's residual stream moved into the
anchor's basis, so that each seam joins layers that read and write one basis). With a tokenizer_source,
the models' embedding and LM-head rows are matched by token string onto the output's vocabulary before
any merge (and before alignment: `merging.vocabulary`). Every refusal comes before any weight is read.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import zlib
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import yaml

from . import mergekit_plan as plan_mod
from . import options as options_mod
from . import verify
from .io import hf
from .io import recipe as recipe_mod
from .io.card import distance_rows, files_of, model_card, report_of
from .io.loading import PipelineError, load_checkpoint, note_unused_records, proven, unusable
from .io.memory import runtime_bytes, size_text
from .io.reconcile import notes as change_notes
from .io.reconcile import reconciled
from .io.ties import read_apart_together, untie_together
from .io.tokenizers import load_tokenizer, output_tokenizer, tokenizer_files, vocabulary
from .merging import mergekit, tensorwise
from .merging import vocabulary as vocabulary_mod
from .options import recorded
from .pipeline import (
    DryRun,
    RunOptions,
    Written,
    align_options_of,
    aligned,
    check_out,
    check_rotation,
    checked,
    folded,
    note_alignment,
    same_architecture,
    settled_for,
)
from .pytree import flatten, unflatten
from .streaming._source import Source, check_same_storage
from .timings import Clock


def _alignment_of(cfg, align: str | None, align_options: dict | None, progress) -> tuple[str, dict, str]:
    """(mode, alignment options, the config's text as run) of a mergekit config whose rotsym:
    block the command line's `align` and `align_options` override."""
    mode = align or cfg.align
    # align="none" wins over the block as "anchor" does: its options are then unused, and said so
    unused = [what for what, there in (("align_options", cfg.align_options), ("data", cfg.data)) if there] if align == "none" else []
    given = {**({} if unused else cfg.align_options), **(align_options or {})}
    moving = sorted(options_mod.moving(given))
    if mode == "none" and moving:
        said = "--align none" if align == "none" else "align: none, the default of a mergekit config"
        raise PipelineError(f"alignment options {moving} given, but this merge aligns nothing ({said}): give --align anchor "
                            "(or the rotsym: block's align), or drop them")
    if unused:
        progress.note(f"note: --align none over {cfg.file}'s rotsym: block (align: {cfg.align}): its {' and '.join(unused)} "
                      "are unused, this merge aligns nothing")
    return mode, given, _as_run(cfg.text, mode, given) if align is not None or align_options else cfg.text


def _as_run(text: str, mode: str, given: dict) -> str:
    """The config as a run whose command line overrode its rotsym: block ran it, so that the copy
    in OUT replays the run: the block as run (the YAML written anew, its comments lost), or the
    text as it is where the block already said so."""
    raw = yaml.safe_load(text)
    block = dict(raw.get("rotsym") or {})
    block["align"] = mode
    for key in ("align_options", "data") if mode == "none" else ():
        block.pop(key, None)
    if mode != "none":
        block.pop("align_options", None)
        block.update({"align_options": given} if given else {})
    if block == (raw.get("rotsym") or {"align": "none"}):
        return text
    return yaml.safe_dump({**raw, "rotsym": block}, sort_keys=False)


def merge_mergekit(config, out, *, align: str | None = None, align_options: dict | None = None, run: RunOptions | None = None,
                   **keywords) -> DryRun | Written:
    """Run the mergekit config `config` (a path, or a `mergekit.MergekitConfig`) into `out`.
    `align`, `align_options`: over the config's `rotsym:` block (the command line's --align and
    align flags). `run`, `keywords`: as `pipeline.merge_checkpoints`'."""
    start = time.perf_counter()
    run = RunOptions.of(run, keywords)
    cfg = config if isinstance(config, mergekit.MergekitConfig) else checked(mergekit.load, config)
    mode, given, text = _alignment_of(cfg, align, align_options, run.progress)
    options = align_options_of(given)
    for note in cfg.notes:
        run.progress.note(note)
    names, cks, options, changes = _loaded(cfg, mode, options, run)
    ref = cfg.reference
    sources = [Source(ck, name) for ck, name in zip(cks, names)]
    try:
        for source in sources:
            checked(check_same_storage, sources[ref], source, "a mergekit config is merged tensor by tensor")
        vocab = _vocabulary(cfg, cks, names) if cfg.tokenizer_source is not None else None
        vmap = vocab.map if vocab is not None else None
        if vmap is not None and mode != "none" and options["method"] != "weights":
            raise PipelineError(f"{cfg.file}: align_options.method {options['method']!r} over vocabularies mapped onto the output's "
                                f"(tokenizer_source {cfg.tokenizer_source}) is not run: the data are tokenized by the anchor's tokenizer, "
                                "not the output's, and a model lacking a token would read a zero row; align by weights (method: weights)")
        # the map of the tables read: aligned, they are on the output's rows already (`_readers`)
        read_map = checked(vocabulary_mod.in_output_order, vmap) if vmap is not None and mode != "none" else vmap
        # tensors and shapes by their names in the files first, then the rest of the configs
        planned = plan_mod.plan(cfg, sources, vmap.size if vmap is not None else None)
        plan = planned.steps
        # every model sized to the output's vocabulary, whose rows are mapped onto it
        sized = [plan_mod.with_vocabulary(ck, vmap.size) if vmap is not None else ck for ck in cks]
        for i, ck in enumerate(sized if planned.in_place or mode != "none" else ()):  # stacked layers: each tensor's shape checked by the plan
            same_architecture(sized[ref], ck, f"model {i}", f"model {ref}")
        out_dtypes = {key: np.dtype(hf.floating_dtype(cfg.out_dtype or cfg.dtype)) if (cfg.out_dtype or cfg.dtype)
                      else sources[step.inputs[0]].stored(step.keys[0]) for key, step in plan.items()}
        shapes = {key: _resized(sources[step.inputs[0]].hf_shape(step.keys[0]), planned.vocabulary_axes.get(key), vmap)
                  for key, step in plan.items()}
        if vmap is not None:
            _check_token_sources(cfg, vmap, plan, planned.vocabulary_axes)
        output_bytes = sum(int(np.prod(shapes[k])) * out_dtypes[k].itemsize for k in plan)
        check_out(out, cks, output_bytes, run)
        working = _working_bytes(cfg, cks, shapes, mode, options, run, mapped=vmap is not None)
        what = [f"merge {len(cks)} {cks[ref].family} models by mergekit's {cfg.method.name} (alignment: {mode}), write {out}",
                *(f"  {name}" + (" (base)" if i == cfg.base_index else "") for i, name in enumerate(names)),
                f"  {len(plan)} tensors, one at a time" + ("" if planned.in_place else f", {_depth_note(cfg, planned)}"),
                *([f"  {vocab.note}"] if vocab is not None else [])]
        if run.dry_run:
            return DryRun(what, working, "the runtime + one float32 tensor of each model and the result" +
                          (" + the models and their aligned copies" if mode != "none" else ""))
        clock = Clock()
        for note in change_notes(changes):
            run.progress.note(f"note: {note}")
        seams = plan_mod.has_seams(cfg, [_depth(ck) for ck in cks])
        readers, alignment = _readers(cfg, cks, sources, mode, options, run, clock, changes, vmap, seams)
        report = {}
        recorded_options = {"mergekit": cfg.method.name, "align": mode, **({"align_options": options} if mode != "none" else {}),
                        **({"anchor": cfg.inputs[cfg.anchor_index].path} if mode == "anchor" else {}),
                        **({"seed": cfg.seed} if cfg.method.random else {})}

        if vocab is not None:
            run.progress.note(f"note: {vocab.note}")  # the dry run lists it with the plan
        write_weights = functools.partial(_write_weights, cfg, plan, readers, shapes, out_dtypes, run.progress, clock,
                                          _row_mapper(cfg, read_map, planned.vocabulary_axes))

        def files():
            result = {"alignment": alignment, **changes, **({"vocabulary": vocab.report} if vocab is not None else {}),
                      "timings": clock.report(start)}
            report.update(report_of(run.command or f"rotsym merge {cfg.file} {out}", dict(zip(names, cks)), recorded_options, result, start))
            card = model_card(Path(out).name, base=[inp.path for inp in cfg.inputs], tags=["merge", "mergekit", "rotsym_jax"],
                              recipe=yaml.safe_load(text), report=report,
                              summary=f"A merge of {len(cks)} models by mergekit's {cfg.method.name}"
                                      + (f", after rotsym's alignment ({mode})" if mode != "none" else "") + ", made by rotsym_jax from the mergekit config below.")
            written = files_of(card, text, report)
            written["mergekit_config.yml"] = written.pop("rotsym_config.yaml")
            if vocab is not None and vocab.files is not None:  # a new tokenizer: none of the donor's vocabulary files beside it
                written.update({**dict.fromkeys(VOCABULARY_FILES + TOKENIZER_FILES), **vocab.files})
            return written

        donor = cks[cfg.inputs_index(cfg.tokenizer_source)]
        layout_source = planned.checkpoint if donor is cks[ref] else _with_files_of(planned.checkpoint, donor)
        try:
            path = hf.write_folder(layout_source, Path(out), out_dtypes, write_weights, files)
        except FileExistsError as e:
            raise PipelineError(f"OUT: {e}") from None
        except hf.NonFiniteWeights as e:  # an input's tensor read while writing: it names its file
            raise unusable(e) from None
    finally:
        for source in sources:
            source.close()
    # the alignment's rows name the models in its order: the anchor (the reference), then the others
    order = _alignment_order(cfg, seams)
    return Written(path, report, distance_rows({"alignment": alignment}, [cfg.inputs[i].path for i in order]))


def _loaded(cfg, mode: str, options: dict, run: RunOptions) -> tuple[list, list, dict, dict]:
    """(the inputs' names, their checkpoints made one architecture, the options as recorded, the
    changes made): a tied head untied beside untied ones without alignment (its tensor read from the
    embedding's; other widths are other shapes, refused); with it, as the pipelines make the models
    before aligning (ties undone, narrower FFNs and head counts widened)."""
    names = [f"model {i} ({inp.path})" for i, inp in enumerate(cfg.inputs)]
    cks = []
    for inp, name in zip(cfg.inputs, names):
        cks.append(load_checkpoint(inp.path, name, weights=False, progress=run.progress, records=proven(run.records, cks),
                                   prove=verify.infer_record if mode != "none" else None,
                                   merging=True))
    note_unused_records(run.progress, run.records, cks)
    for inp, ck in zip(cfg.inputs, cks):  # a dual encoder (CLIPModel, SiglipModel): two stacks, which slices cannot name apart
        if not hf.family_of(ck.model_config).num_layers:
            raise PipelineError(f"{cfg.file}: {inp.path} is a {ck.family} model, two towers with a stack of layers each, which a mergekit "
                                f"config's layer ranges cannot tell apart; merge it with `rotsym merge --method METHOD A B ... OUT`")
    if mode != "none" and plan_mod.has_seams(cfg, [_depth(ck) for ck in cks]):
        options = _seams_options(cfg, options, cks)
    options = recorded(settled_for(options, cks[0]))
    if mode == "none":
        cks, untied = untie_together(cks, "none")
        cks, apart = read_apart_together(cks)  # (after untying, as `reconciled` takes them)
        return names, cks, options, {**({"untied": untied} if untied else {}), **({"apart": apart} if apart else {})}
    cks, changes = reconciled(cks, options["residual"])
    note_alignment(run.progress, options, list(zip(names, cks)))  # as align and merge say them
    return names, cks, options, changes


def _depth(ck) -> int:
    return getattr(ck.model_config, hf.family_of(ck.model_config).num_layers)


def _seams_options(cfg, options, cks: list):
    """Aligned seams: where the slices put a layer of one model after another's, alignment must move
    every model's residual stream into the anchor's basis (the per-layer groups leave each layer's
    function, and so the seams, as they were): residual "auto" is the strongest group the family
    allows, whatever the method; "none" is refused. Every model then has the anchor's depth, the
    engine aligning layer i with layer i."""
    if options.residual == "none":
        raise PipelineError(f"{cfg.file}: slices that put one model's layers after another's, aligned with residual: none: only the residual stream "
                            "moves a model's layers into the anchor's basis (the per-layer groups leave every seam as it was); give "
                            "residual permutation or rotation (or auto: --residual, or the rotsym: block's align_options), or align: none")
    anchor = cks[cfg.anchor_index]
    for i, ck in enumerate(cks):
        if _depth(ck) != _depth(anchor):
            raise PipelineError(f"{cfg.file}: aligned seams: model {i} ({cfg.inputs[i].path}) has {_depth(ck)} layers, the anchor "
                                f"({cfg.inputs[cfg.anchor_index].path}) {_depth(anchor)}; alignment matches layer i with layer i, "
                                "so the models it moves must have the anchor's depth (or give align: none)")
    if options.residual == "auto":
        options = dataclasses.replace(options, residual=verify.strongest_as_run(anchor)[0])
    return options


def _working_bytes(cfg, cks: list, shapes: dict, mode: str, options: dict, run: RunOptions, mapped: bool = False) -> int:
    """The memory a run holds (one float32 tensor of each model and the result; `mapped`: each
    model's table on the output's vocabulary besides; aligned: the models and their aligned copies
    too), checked against --max-memory, with what aligning refuses."""
    largest = max(int(np.prod(shape)) for shape in shapes.values())
    copies = len(cks) * (1 + mapped) + 3
    working = runtime_bytes() + copies * 4 * largest
    if mode != "none":
        if run.max_memory is not None:
            raise PipelineError("a mergekit config's alignment runs in memory (its merge streams a tensor at a time); run it without --max-memory")
        check_rotation(cks[cfg.reference], options)
        if options["method"] != "weights" and cfg.data is None:
            raise PipelineError(f"{cfg.file}: align_options.method {options['method']!r} runs the models on data: give the rotsym: "
                                "block a data section (data: {file: texts.jsonl}, relative to the config)")
        working += sum(hf_bytes(ck) for ck in cks) * 3
    if run.max_memory is not None and working > run.max_memory:
        raise PipelineError(f"--max-memory {size_text(run.max_memory)}: one tensor of each model at a time needs {size_text(working)} "
                            f"(the runtime and {copies} float32 copies of the largest tensor, {largest} entries)")
    return working


def _write_weights(cfg, plan: dict, readers: list, shapes: dict, out_dtypes: dict, progress, clock, map_rows, tmp: Path) -> None:
    """Every tensor of `plan` merged by mergekit's method from its inputs' `readers` (a token-indexed
    one's rows first put on the output's vocabulary by `map_rows(key, step, tensors)`) and written into `tmp`."""
    writer = hf.ShardWriter(tmp, {step.name: (out_dtypes[k], shapes[k]) for k, step in plan.items()}, 5 * 2**30)
    with progress.detail("merging", len(plan), "tensor") as tick:
        for key, step in plan.items():
            tensors = [readers[i](k) for i, k in zip(step.inputs, step.keys)]
            if cfg.dtype is not None:
                tensors = [np.asarray(x).astype(hf.floating_dtype(cfg.dtype)) for x in tensors]
            tensors = map_rows(key, step, tensors)
            with clock.phase("merge"):
                merged = tensorwise.merge_tensor(cfg.method, tensors, step.base, step.shared, step.per_input, _generators(cfg.seed, key))
            with np.errstate(over="ignore"):
                tensor = np.asarray(merged.astype(out_dtypes[key]), order="C")
            if hf.nonfinite_count(tensor):
                raise PipelineError(f"tensor {step.name!r}: the merge made non-finite values (as {out_dtypes[key]})")
            with clock.phase("write"):
                writer.write(step.name, tensor)
            tick()
    writer.finish()


def _depth_note(cfg, planned) -> str:
    depth = getattr(planned.checkpoint.model_config, hf.family_of(planned.checkpoint.model_config).num_layers)
    return f"{depth} layers from {len(cfg.slices)} slices"


def hf_bytes(ck) -> int:
    return sum(int(np.prod(x.shape)) * 4 for x in flatten(ck.params).values())


def _generators(seed: int, key: str):
    """Input i's generator for tensor `key`: seeded by the config's seed, the tensor and i alone."""
    salt = zlib.crc32(key.encode())
    return lambda i: np.random.default_rng([seed % 2**64, salt, i])


def _readers(cfg, cks, sources, mode: str, options: dict, run: RunOptions, clock: Clock, changes: dict, vmap,
             seams: bool) -> tuple[list, dict]:
    """Each input's `tensor(key)` in its stored dtype: from its files, or from its aligned weights
    (loaded with `changes`, as `cks` were made); and the alignment's report. Aligned with a mapped
    vocabulary (`vmap`), each model's token-indexed tables are put on the output's rows by token
    first, so that alignment matches rows of one token (a lacking row zero adds no term), and
    their defaults are filled after, from the aligned rows (`vocabulary.in_output_order`)."""
    if mode == "none":
        return [lambda key, s=s: s.tensor(key, clock) for s in sources], {"mode": "none"}
    models = [run.progress.step(f"loading {s.what}", clock.timed, "read", load_checkpoint, inp.path, s.what, prove=verify.infer_record,
                                record=ck.model_config.record, changes=changes) for inp, s, ck in zip(cfg.inputs, sources, cks)]
    if vmap is not None:
        models = [_on_output_rows(model, vmap, i) for i, model in enumerate(models)]
    order = _alignment_order(cfg, seams)
    anchor = models[order[0]]
    batches = None if cfg.data is None else checked(recipe_mod.batches, cfg.data, anchor)
    params, alignment = run.progress.step(f"alignment: {mode}", checked, aligned, [models[i] for i in order], mode, options, run.progress,
                                          clock, batches, cfg.seed)
    by_input = dict(zip(order, params))
    if cfg.base_index is not None and cfg.base_index not in by_input:  # the base: folded as the models were, not moved
        by_input[cfg.base_index] = folded([models[cfg.base_index].params], anchor, options)[0]

    def reader(i):
        flat = flatten(by_input[i])
        rules = sources[i].rules
        return lambda key: rules[key].to_hf(tuple(np.asarray(flat[p]) for p in rules[key].ours))

    return [reader(i) for i in range(len(models))], alignment


def _on_output_rows(ck, vmap, i: int):
    """Input `i`'s loaded checkpoint with its token-indexed leaves on the output's rows
    (`vocabulary.on_output_rows`) and the output's vocab_size."""
    flat = flatten(ck.params)
    for path, axis in plan_mod.vocabulary_leaves(ck).items():
        flat[path] = jnp.asarray(vocabulary_mod.on_output_rows(vmap, np.asarray(flat[path]), i, axis))
    return dataclasses.replace(ck, model_config=plan_mod.with_vocabulary(ck, vmap.size).model_config, params=unflatten(flat))


# The files that define a tokenizer's vocabulary, as transformers saves them; and the rest of a
# tokenizer's files, which a tokenizer rotsym writes replaces.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "merges.txt", "added_tokens.json")
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The output's vocabulary of a run with a tokenizer_source: `map` (None where every model's
    token-indexed tensors already are the output's: nothing to map), `files` the tokenizer to
    write ({name: text}; None: the donor's files, copied), `report` and `note` say what was done."""

    map: vocabulary_mod.VocabularyMap | None
    files: dict | None
    report: dict
    note: str


def _vocabulary(cfg, cks, names) -> Vocabulary:
    """The output's vocabulary, as mergekit 0.1.5 builds it from tokenizer_source (or the tokenizer:
    section): the donor's (the base's, a model's; union: the reference's with every model's tokens it
    lacks), the section's tokens added; each model's rows matched to it by token string. A model
    without a tokenizer is taken to share the reference's vocabulary, as mergekit takes it; a donor
    without one, or whose tokens reach past its vocab_size (mergekit strips those), is refused."""
    def files(ck):
        return {f: (Path(ck.source) / f).read_bytes() for f in VOCABULARY_FILES if (Path(ck.source) / f).is_file()}

    donor_index = cfg.inputs_index(cfg.tokenizer_source)
    donor = cks[donor_index]
    held = [bool(files(ck)) for ck in cks]
    if not held[donor_index] and any(held):
        named = names[held.index(True)]
        raise PipelineError(f"tokenizer_source {donor.source}: it holds no vocabulary (none of {', '.join(VOCABULARY_FILES)}), "
                            f"which {named} does: name a model with its tokenizer")
    if not any(held):  # no tokenizer anywhere: nothing to map, nothing to write
        return Vocabulary(None, None, {"source": cfg.tokenizer_source, "note": "no model holds a tokenizer"}, "no model holds a tokenizer")
    purpose = "build the output's vocabulary (tokenizer_source)"
    loaded = {i: load_tokenizer(ck.source, purpose, PipelineError) for i, ck in enumerate(cks) if held[i]}
    rows = [getattr(ck.model_config, "vocab_size", None) for ck in cks]
    if None in rows:
        named = names[rows.index(None)]
        raise PipelineError(f"tokenizer_source: {named}'s config has no vocab_size: its token-indexed tensors cannot be told, so no "
                            "vocabulary is mapped onto them; leave tokenizer_source out to copy a tokenizer as it is")
    beyond = sorted(i for t, i in loaded[donor_index].get_vocab().items() if i >= rows[donor_index])
    if beyond:
        raise PipelineError(f"tokenizer_source {donor.source}: its tokenizer has {len(beyond)} tokens with ids from {beyond[0]} past its "
                            f"vocab_size {rows[donor_index]} (no embedding row); mergekit strips them from a base's BPE tokenizer, "
                            "rotsym does not: remove them from the tokenizer first")
    order = [donor_index] + [i for i in range(len(cks)) if i != donor_index and held[i]]
    tokenizer, changed = output_tokenizer(loaded[donor_index], [loaded[i] for i in order], [rows[i] for i in order],
                                          union=cfg.tokenizer_source == "union", added=list(cfg.tokens))
    out = tokenizer.get_vocab()
    tokens = sorted(out, key=out.__getitem__)
    if [out[t] for t in tokens] != list(range(len(tokens))):
        raise PipelineError(f"the output's tokenizer (from {donor.source}) has ids with gaps (its {len(tokens)} tokens reach id "
                            f"{max(out.values())}): rotsym writes a table of one row per id")
    reference = cfg.reference if held[cfg.reference] else donor_index
    vocabularies = [vocabulary(loaded[i if held[i] else reference], rows[i]) for i in range(len(cks))]
    vmap = vocabulary_mod.vocabulary_map(tokens, vocabularies, cfg.tokens, cfg.pad_to_multiple_of, [inp.path for inp in cfg.inputs])
    same = vmap.is_identity(rows) and not changed
    lacked = {inp.path: vmap.lacked(i) for i, inp in enumerate(cfg.inputs)}
    report = {"source": cfg.tokenizer_source, "tokens": len(tokens), "rows": vmap.size,
              "added": len(tokens) - len(loaded[donor_index].get_vocab()), "lacked": lacked, "mapped": not same,
              **({"assumed_reference": [cfg.inputs[i].path for i in range(len(cks)) if not held[i]]} if not all(held) else {})}
    if same:
        note = f"tokenizer_source {cfg.tokenizer_source}: every model's vocabulary is the output's ({len(tokens)} tokens): nothing mapped"
        return Vocabulary(None, None, report, note)
    note = (f"tokenizer_source {cfg.tokenizer_source}: {len(tokens)} tokens ({report['added']} added to {donor.source}'s), "
            f"{vmap.size} rows; embedding rows matched by token string; rows each model lacked (the default row given): "
            + ", ".join(f"{path} {n}" for path, n in lacked.items()))
    return Vocabulary(vmap, tokenizer_files(tokenizer) if changed else None, report, note)


def _resized(shape: tuple, axis: int | None, vmap) -> tuple:
    """A token-indexed tensor's stored shape with the output's rows on its vocabulary `axis`."""
    if axis is None or vmap is None:
        return shape
    return (*shape[:axis], vmap.size, *shape[axis + 1:])


def _row_mapper(cfg, vmap, axes: dict):
    """`map_rows(key, step, tensors)`: a token-indexed tensor's inputs on the output's vocabulary
    (`vocabulary.permuted`), the others as they are."""
    def map_rows(key, step, tensors):
        if vmap is None or key not in axes:
            return tensors
        try:
            return vocabulary_mod.permuted(vmap, tensors, step.inputs, cfg.base_index, axes[key])
        except ValueError as e:
            raise PipelineError(f"tensor {step.name!r}: {e}") from None
    return map_rows


def _check_token_sources(cfg, vmap, plan: dict, axes: dict) -> None:
    """Every configured token source among the models of each token-indexed tensor (mergekit fails
    mid-merge otherwise), and its token held where one is named: before any weight is read."""
    paths = [inp.path for inp in cfg.inputs]
    for token, source in vmap.sources.items():
        if source.model is None:
            continue
        for key in axes:
            step = plan[key]
            if source.model not in step.inputs:
                raise PipelineError(f"{cfg.file}: tokenizer.tokens[{token!r}]: source {paths[source.model]} is not among the models of "
                                    f"tensor {step.name!r} ({[paths[i] for i in step.inputs]})")
        held = vmap.vocabularies[source.model]
        wanted = token if source.kind == "model" else source.token
        if wanted is not None and wanted not in held:
            raise PipelineError(f"{cfg.file}: tokenizer.tokens[{token!r}]: {paths[source.model]}'s vocabulary has no token {wanted!r}")


def _alignment_order(cfg, seams: bool) -> list[int]:
    """The inputs alignment moves, the anchor first: every model but the base, which keeps its
    frame (task vectors are measured from it, as in a recipe), unless it is the anchor or the
    slices have seams (a layer of the base may follow another model's: its stream is moved too)."""
    anchor = cfg.anchor_index
    kept = (anchor,) if seams else (anchor, cfg.base_index)
    return [anchor] + [i for i in range(len(cfg.inputs)) if i not in kept]


def _with_files_of(checkpoint, donor):
    """`checkpoint` (its config and layout) with the non-weight files (the tokenizer) of `donor`'s folder."""
    return dataclasses.replace(checkpoint, source=donor.source)
