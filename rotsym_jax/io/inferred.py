"""Records for checkpoints whose model_type has none of ours (`rotsym inspect --verify`, the
loaders): every model type whose tables hold exactly a folder's tensors (`candidate_records`),
and the record that reads them as tensors alone (`tensors_record_of`). No weight is read."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from ..families import FAMILIES
from ..families.family import Family, InferredRecord
from ..families.tensors import tensors_record
from ._files import ST_DTYPES, TensorFiles, read_json_object
from .hf import CheckpointError, family_of, load_hf, read_config, supported_model_types


def candidate_records(path: str | os.PathLike, explain: bool = True) -> tuple[list[InferredRecord], dict[str, tuple[float, str]]]:
    """For a checkpoint whose model_type has no record: every model type of ours whose tables hold
    exactly its tensors (each name, shape and dtype, nothing left over: `load_hf(weights=False)`
    read as that type), as unproven `InferredRecord`s in our families' order; and, for each other
    type, (the share of tensor names its tables and the checkpoint have in common, the first
    mismatch; with `explain` false, no such entries: the shares are most of the time). No weight is
    read, nothing is run."""
    folder = Path(path)
    raw = read_json_object(folder / "config.json", "a model config")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type in supported_model_types():
        raise CheckpointError(f"{folder}: model_type {model_type!r} is not one without a record")
    names = TensorFiles(folder).names()
    found, why = [], {}
    for family in FAMILIES:
        for read_as in family.model_types:
            record = InferredRecord(model_type, read_as, _class_stem(raw, family, model_type))
            try:
                load_hf(folder, weights=False, record=record)
            except (CheckpointError, ValueError) as e:
                if explain:
                    why[read_as] = (_shared_names(raw, record, names), str(e).removeprefix(str(folder)).lstrip("/: "))
                continue
            found.append(record)
    return found, why


def tensors_record_of(path: str | os.PathLike) -> InferredRecord:
    """For a checkpoint whose model_type has no record and no layout of ours: the record that reads
    it as its tensors alone (`families.tensors`), for merges that move no weight by a symmetry."""
    folder = Path(path)
    model_type = read_json_object(folder / "config.json", "a model config").get("model_type")
    files = TensorFiles(folder)
    try:
        return tensors_record(model_type, {n: files.shape(n) if files.dtype(n) in ST_DTYPES else None for n in files.names()})
    finally:
        files.close()


def _shared_names(raw: Mapping, record: InferredRecord, names: set) -> float:
    """|ours & theirs| / |ours | theirs| of the tensor names, read as `record` (0 where its config cannot
    be, or implies over 5x the checkpoint's tensors: a share under 20%, where a mixture's defaults,
    128 experts a layer, built hundreds of thousands of names)."""
    try:
        config = read_config(raw, record=record)
        family = family_of(config)
        ours = {r.hf for r in family.tensors(config, family.detect(names, config), limit=5 * len(names))}
    except (CheckpointError, ValueError, KeyError, TypeError):  # InputError (the limit) is a ValueError
        return 0.0
    return len(ours & names) / max(len(ours | names), 1)


def _class_stem(raw: Mapping, family: Family, model_type: str) -> str:
    """transformers' class-name stem of `model_type` ("Helium" of HeliumForCausalLM): from
    config.json's architectures where one ends with a suffix of the family's heads, else from
    transformers' config class, else the model type capitalised."""
    suffixes = sorted([h.suffix for h in family.heads] + ["Model"], key=len, reverse=True)
    for name in raw.get("architectures") or ():
        for suffix in suffixes:
            if isinstance(name, str) and name.endswith(suffix) and len(name) > len(suffix):
                return name[: -len(suffix)]
    module = sys.modules.get("transformers")
    if module is not None and model_type in module.CONFIG_MAPPING:
        return module.CONFIG_MAPPING[model_type].__name__.removesuffix("Config")
    return model_type.capitalize()
