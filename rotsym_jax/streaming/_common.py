"""The streamed runs' error, their options and the merge methods they take."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from ..engine import choice
from ..errors import InputError, InputTypeError, RotsymError
from ..io.memory import size_text
from ..merging import methods as merge_methods
from ..options import FIELDS, MERGE_FIELDS, STREAM_FIELDS, AlignOptions, MergeOptions, StreamOptions


@dataclasses.dataclass(frozen=True)
class Output:
    """Where and how a streamed run writes: the folder `path` (replaced only with `overwrite`),
    `extra_files` (as `save_hf`'s, or a function of the report returning them, written with the
    checkpoint) and `progress(done, total)`, called after every chunk of every pass."""

    path: object
    overwrite: bool = False
    extra_files: object = None
    progress: Callable[[int, int], None] | None = None


class StreamingError(RotsymError, ValueError):
    """An option or input the streaming path cannot handle (it names the alternative)."""


class BudgetError(StreamingError):
    """`max_memory` below the least a streamed run needs: `needed` bytes, `what` needs them (the
    message's words after "max_memory=... is below"), for a caller that chose the budget itself to
    say so (`pipeline.streamed`)."""

    def __init__(self, max_memory: int, needed: int, what: str):
        self.max_memory, self.needed, self.what = max_memory, needed, what
        super().__init__(f"max_memory={size_text(max_memory, needed)} is below {what}")


def stream_options_of(stream, keywords: Mapping | None = None) -> StreamOptions:
    """`StreamOptions.of(stream, **keywords)`, its refusals StreamingErrors."""
    try:
        return StreamOptions.of(stream, **(keywords or {}))
    except (InputError, InputTypeError) as e:
        raise StreamingError(str(e)) from None


def streamed_method(name: str) -> merge_methods.Method:
    """The registered merge method `name` where a streamed run can merge with it (its
    `granularity` is "element" or "tensor": a chunk of layers merges as the whole model would;
    Fisher and RegMean from a statistics pass of their own), else a StreamingError saying why."""
    try:
        m = merge_methods.method_named(name)
    except InputError as e:
        raise StreamingError(str(e)) from None
    why = m.unstreamed()
    if why:
        raise StreamingError(f"method {name!r} is not streamed: {why}; streamed methods: {streamed_methods()}")
    return m


def streamed_methods() -> list[str]:
    """The registered merge methods a streamed run merges with (those of `register` too)."""
    return [name for name, m in merge_methods.METHODS.items() if m.unstreamed() is None]


def merges_in_row_blocks(m: merge_methods.Method) -> bool:
    """Whether a big tensor outside the layers may be merged in row blocks: an entry-by-entry
    method without statistics (Fisher's rows come from its statistics pass: `StatisticsMerge`)."""
    return m.granularity == "element" and m.statistics is None



def unstreamed_method(method: str, merging: str | None = None) -> str | None:
    """Why a streamed run cannot align by `method`, or None: the one refusal every streamed path
    (and the pipelines' switch to streaming) gives. `merging`: a merge's align mode ("anchor",
    "many"), None for an align."""
    if method == "learned":
        return ("method='learned' trains through both models' forward and backward passes at once, which needs them whole in "
                f"memory: {'merge' if merging else 'align'} in memory (without --max-memory)")
    if method == "activations" and merging == "many":
        return ("align='many' with method='activations' aligns each model to the mean of the others moved, run whole on the data at "
                "every update: streamed, a merge aligns from data to the anchor (align='anchor'); or merge in memory")
    return None


def streamed_options(options: AlignOptions | Mapping | None, merging: str | None = None) -> AlignOptions:
    """`AlignOptions.of(options)` settled, refused (`unstreamed_method`) when the streaming path cannot do them."""
    try:
        options = AlignOptions.of(options)
    except TypeError as e:
        raise StreamingError(str(e)) from None
    why = unstreamed_method(options.method, merging)
    if why:
        raise StreamingError(why)
    return options.settled()


def split_options(options, stream, keywords: Mapping) -> tuple[AlignOptions, StreamOptions]:
    """A streamed call's `AlignOptions` and `StreamOptions`, each from its object (or mapping)
    with the keywords that name its fields over it; refused (StreamingError) when streaming cannot
    do them or a keyword names neither."""
    unknown = sorted(set(keywords) - set(FIELDS) - set(STREAM_FIELDS))
    if unknown:
        raise StreamingError(f"unknown options {unknown}; the align options are {list(FIELDS)}, the stream options {list(STREAM_FIELDS)}")
    stream = stream_options_of(stream, {k: v for k, v in keywords.items() if k in STREAM_FIELDS})
    aligning = {k: v for k, v in keywords.items() if k in FIELDS}
    return streamed_options(AlignOptions.of(options, **aligning) if isinstance(options, AlignOptions) else {**dict(options or {}), **aligning}), stream


def merge_options_of(options, stream, keywords: Mapping) -> tuple[MergeOptions, StreamOptions]:
    """A streamed merge's `MergeOptions` and `StreamOptions`, each from its object (or mapping)
    with the keywords that name its fields over it; refused (StreamingError) as `split_options`."""
    unknown = sorted(set(keywords) - set(MERGE_FIELDS) - set(STREAM_FIELDS))
    if unknown:
        raise StreamingError(f"unknown options {unknown}; the merge options are {list(MERGE_FIELDS)}, the stream options {list(STREAM_FIELDS)}")
    stream = stream_options_of(stream, {k: v for k, v in keywords.items() if k in STREAM_FIELDS})
    try:
        merge = MergeOptions.of(options, **{k: v for k, v in keywords.items() if k in MERGE_FIELDS})
    except (InputError, InputTypeError) as e:
        raise StreamingError(str(e)) from None
    if merge.aligning is not None:
        streamed_options(merge.aligning, merging=merge.align)
    return merge, stream


def fallback_choice(options: AlignOptions, sq_before: Mapping, sq_after: Mapping) -> dict | None:
    """`align`'s fallback (`engine.choice`) once a streamed run has measured B moved: its
    report["chosen"], weight matching against B as given on the weight distance to A (None with
    fallback=False: the method's result is kept)."""
    if not options.fallback:
        return None
    candidates = {"weights": choice.total_distance(sq_after), "identity": choice.total_distance(sq_before)}
    best = choice.pick(candidates, candidates, None, candidates["identity"])
    return choice.report("weights", best, candidates, None, "", candidates["identity"])
