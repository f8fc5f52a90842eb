"""Token-indexed tensors (input embeddings, LM heads) of models whose vocabularies differ, put on
one output vocabulary by token string before a merge, as mergekit 0.1.5 puts them
(`tokenizer_source`, the `tokenizer:` section's `tokens`).

Each model's table gets the output's rows, in the output's token order: its own row where its
vocabulary holds the token; where it lacks it, the token's default row, the same for every model
lacking it: the base's (where the base is among the tensor's models and holds it), else the mean
of the rows of the models holding it (the only holder's row, where one holds it), else zeros. A
token the config sources (`tokens: {TOKEN: {source: ...}}`) takes its source's row instead as its
default (a model's row of that token, a model's row of another token or id, zeros); `force: true`
gives every model that default, its own row or not. Rows past the output's vocabulary (mergekit's
`pad_to_multiple_of`) take the mean of each model's table. The merge method then combines the
tables as it combines any tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import InputError


@dataclasses.dataclass(frozen=True)
class TokenSource:
    """A token's configured default row: `kind` "model" (model `model`'s row of the token itself),
    "model_token" (model `model`'s row of `token` or of id `token_id`, in its own vocabulary) or
    "zero"; `force`: every model takes it, not only those lacking the token."""

    kind: str
    model: int | None = None  # an input's index
    token: str | None = None
    token_id: int | None = None
    force: bool = False


@dataclasses.dataclass(frozen=True)
class VocabularyMap:
    """The output's vocabulary (`tokens`, in id order; `size` rows, past them padding) and, for
    each input of the config, its row of every output token (-1: it lacks it) and its own
    vocabulary (token -> row), with the configured token sources."""

    tokens: tuple[str, ...]
    rows: tuple[np.ndarray, ...]
    vocabularies: tuple[Mapping[str, int], ...]
    sources: Mapping[str, TokenSource]
    size: int
    names: tuple[str, ...] = ()  # each input's name, for messages

    def name(self, i: int) -> str:
        return self.names[i] if i < len(self.names) else f"input {i}"

    def lacked(self, i: int) -> int:
        """How many output tokens input `i`'s vocabulary lacks (rows it takes from the default)."""
        return int(np.sum(self.rows[i] < 0))

    def is_identity(self, sizes: Sequence[int]) -> bool:
        """Whether every input's table is already the output's (`sizes`: each input's rows): the
        same tokens in the same order, nothing forced or padded."""
        n = len(self.tokens)
        return (self.size == n and not any(s.force for s in self.sources.values())
                and all(size == n and np.array_equal(r, np.arange(n)) for r, size in zip(self.rows, sizes)))


def vocabulary_map(tokens: Sequence[str], vocabularies: Sequence[Mapping[str, int]], sources: Mapping[str, TokenSource] | None = None,
                   pad_to_multiple_of: int | None = None, names: Sequence[str] = ()) -> VocabularyMap:
    """The map of `vocabularies` (each input's token -> row, its tokens past its table left out,
    `names` for messages) onto the output's `tokens` (in id order)."""
    rows = tuple(np.array([v.get(t, -1) for t in tokens], dtype=np.int64) for v in vocabularies)
    size = len(tokens)
    if pad_to_multiple_of and size % pad_to_multiple_of:
        size += pad_to_multiple_of - size % pad_to_multiple_of
    return VocabularyMap(tuple(tokens), rows, tuple(dict(v) for v in vocabularies), dict(sources or {}), size, tuple(names))


def _default_rows(vmap: VocabularyMap, tables: dict[int, np.ndarray], base: int | None) -> dict[int, np.ndarray]:
    """{output id: the row every model lacking that token (or forced) takes}, for the tables of the
    inputs `tables` (input index -> table, vocabulary first), `base` the base's input index or None."""
    models = list(tables)
    first = tables[models[0]]
    out = {}
    for j, token in enumerate(vmap.tokens):
        source = vmap.sources.get(token)
        present = [i for i in models if vmap.rows[i][j] >= 0]
        if len(present) == len(models) and not (source and source.force):
            continue
        if source is not None:
            out[j] = _configured_row(vmap, tables, token, j, source)
        elif not present:
            out[j] = np.zeros(first.shape[1:], first.dtype)
        elif base in tables and vmap.rows[base][j] >= 0:
            out[j] = tables[base][vmap.rows[base][j]]
        else:  # the holders' mean (the only holder's row: x / 1 is x), summed in the models' order and dtype, as mergekit sums
            total = np.zeros(first.shape[1:], first.dtype)
            for i in present:
                total = total + tables[i][vmap.rows[i][j]]
            out[j] = (total / np.asarray(len(present), first.dtype)).astype(first.dtype)
    return out


def _configured_row(vmap: VocabularyMap, tables: dict[int, np.ndarray], token: str, j: int, source: TokenSource) -> np.ndarray:
    first = next(iter(tables.values()))
    if source.kind == "zero":
        return np.zeros(first.shape[1:], first.dtype)
    if source.model not in tables:
        raise InputError(f"tokenizer.tokens[{token!r}]: its source {vmap.name(source.model)} is not among this tensor's models "
                         f"({[vmap.name(i) for i in tables]})")
    table = tables[source.model]
    if source.kind == "model":
        row = vmap.rows[source.model][j]
        if row < 0:
            raise InputError(f"tokenizer.tokens[{token!r}]: its source {vmap.name(source.model)} has no token {token!r}")
        return table[row]
    row = source.token_id if source.token is None else vmap.vocabularies[source.model].get(source.token, -1)
    if not 0 <= row < table.shape[0]:
        raise InputError(f"tokenizer.tokens[{token!r}]: {vmap.name(source.model)} has no "
                         + (f"token {source.token!r}" if source.token is not None else f"row {source.token_id} (its table has {table.shape[0]})"))
    return table[row]


def permuted(vmap: VocabularyMap, tensors: Sequence[np.ndarray], inputs: Sequence[int], base: int | None, axis: int) -> list[np.ndarray]:
    """`tensors` (input `inputs[k]`'s token-indexed tensor, its vocabulary on `axis`) on the
    output's vocabulary, each with `vmap.size` entries on that axis (see the module docstring);
    `base`: the base's input index, or None. ValueError where the tensors differ off the vocabulary
    axis or a configured source is missing."""
    tables = {i: np.moveaxis(np.asarray(x), axis, 0) for i, x in zip(inputs, tensors)}
    shapes = {tuple(t.shape[1:]) for t in tables.values()}
    if len(shapes) > 1:
        raise InputError(f"the tables' shapes off the vocabulary axis {axis} differ: {[np.shape(x) for x in tensors]}")
    dtype = np.result_type(*tables.values())
    tables = {i: t.astype(dtype, copy=False) for i, t in tables.items()}
    defaults = _default_rows(vmap, tables, base)
    n = len(vmap.tokens)
    forced = np.array([token in vmap.sources and vmap.sources[token].force for token in vmap.tokens], dtype=bool)
    out = []
    for i, table in tables.items():
        rows = vmap.rows[i]
        own = (rows >= 0) & ~forced
        new = np.zeros((vmap.size, *table.shape[1:]), dtype)
        new[:n][own] = table[rows[own]]
        for j, row in defaults.items():
            if not own[j]:
                new[j] = row
        if vmap.size > n:  # padding: the mean of the table's rows (mergekit, after Hewitt's vocabulary expansion)
            new[n:] = np.mean(new[:n], axis=0, dtype=dtype)
        out.append(np.moveaxis(new, 0, axis))
    return out


def on_output_rows(vmap: VocabularyMap, table: np.ndarray, i: int, axis: int) -> np.ndarray:
    """Input `i`'s `table` (its vocabulary on `axis`) with the output's `vmap.size` entries there:
    its own row of each token it holds, zeros for the others and the padding. Aligning models so
    mapped matches their rows by token, the zeros adding nothing to a weights objective; the
    default rows are filled after (`in_output_order`)."""
    own = np.moveaxis(np.asarray(table), axis, 0)
    rows = vmap.rows[i]
    held = rows >= 0
    new = np.zeros((vmap.size, *own.shape[1:]), own.dtype)
    new[:len(rows)][held] = own[rows[held]]
    return np.moveaxis(new, 0, axis)


def in_output_order(vmap: VocabularyMap) -> VocabularyMap:
    """The map of tables already on the output's rows (`on_output_rows`): each input holds the
    output's row of each token it held; a configured source of another token, or of an id, names
    that token's output row. ValueError where that token is not in the output's vocabulary (its row
    was left behind)."""
    n = len(vmap.tokens)
    rows = tuple(np.where(r >= 0, np.arange(n), -1) for r in vmap.rows)
    place = {t: j for j, t in enumerate(vmap.tokens)}
    vocabularies = tuple({t: j for j, t in enumerate(vmap.tokens) if r[j] >= 0} for r in rows)
    sources = {}
    for token, source in vmap.sources.items():
        if source.kind == "model_token":
            by_id = {i: t for t, i in vmap.vocabularies[source.model].items()}
            named = source.token if source.token is not None else by_id.get(source.token_id)
            if named not in place:
                raise InputError(f"tokenizer.tokens[{token!r}]: its source, {vmap.name(source.model)}'s "
                                 + (f"token {named!r}" if named is not None else f"row {source.token_id}")
                                 + ", is not in the output's vocabulary, whose rows alone are aligned")
            source = dataclasses.replace(source, token=named, token_id=None)
        sources[token] = source
    return dataclasses.replace(vmap, rows=rows, vocabularies=vocabularies, sources=sources)
