"""Checkpoints of an architecture without a layout of ours, read as their tensors alone, for merges
that move no weight by a symmetry (mergekit configs, `rotsym merge --align none`): each floating
tensor one leaf named as in the folder, no layers, heads or groups. Each model's record
(`tensors_record`) lists its own tensors; a run compares the models as it compares any."""

from __future__ import annotations

import dataclasses

from ..spec import Spec
from .config import ConfigSchema
from .family import Family, InferredRecord, Layout, Norm, Tensor

NAME = "tensors"


@dataclasses.dataclass(frozen=True)
class TensorsFamily(Family):
    """A `Family` whose tables are a record's tensors (`tensor_shapes`: (name, shape) pairs), each
    copied to the leaf of its own name; nothing runs, nothing moves. A shape None: a tensor that
    is not floating (a buffer, an index), skipped as the families skip theirs."""

    tensor_shapes: tuple[tuple[str, tuple[int, ...] | None], ...] = ()

    def _tables(self, config, layout: Layout):
        for name, shape in self.tensor_shapes:
            if shape is not None:
                yield Tensor(name, (name,), (shape,), (None,)), None, True

    def is_ignored(self, hf_name: str) -> bool:
        return (hf_name, None) in self.tensor_shapes

    def tied(self, config, layout: Layout) -> dict[str, str]:
        return {}

    def detect(self, names: set[str], config, shapes=None) -> Layout:
        return Layout()

    def check_layout(self, config, layout: Layout) -> None:
        pass

    def architecture(self, config, layout: Layout) -> str:
        return (config.raw.get("architectures") or [config.raw.get("model_type")])[0]

    def check(self, config) -> None:
        pass

    def inferred(self, record: InferredRecord) -> Family:
        return dataclasses.replace(self, tensor_shapes=record.tensors, stems={NAME: record.stem})

    def spec(self, config, layout: Layout | None = None) -> Spec:
        return Spec(((".*", None),))


TENSORS = TensorsFamily(
    name=NAME, configs=(ConfigSchema(NAME, "PretrainedConfig", {}),), stems={NAME: ""}, prefix="", marker="", embeddings=(), layer=(),
    final=(), norm=Norm("none", placement="pre"), build=lambda *a, **k: None, forward=False,
)


def tensors_record(model_type: str, shapes: dict[str, tuple[int, ...] | None]) -> InferredRecord:
    """The record that reads a checkpoint of `model_type` as its tensors: {name: shape}, None for a
    tensor that is not floating (skipped)."""
    return InferredRecord(model_type, NAME, "", tensors=tuple(sorted((n, None if s is None else tuple(s)) for n, s in shapes.items())))
