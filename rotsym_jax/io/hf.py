"""Hugging Face checkpoint folders (config.json + safetensors) <-> our params pytrees.

`load_hf(path)` reads a folder, picks the family from `model_type`, tells the layout (prefix,
task head, pooler) from the tensor names and config.json's `architectures`, converts tensor layouts
once (nn.Linear (out, in) -> kernel (in, out); GPT-2 Conv1D as is), all as the family's record
(`rotsym_jax.models.family`) declares, and returns a `Checkpoint`: no forward pass is built until
one runs.
`save_hf(checkpoint, params, path)` writes a folder that transformers loads with no missing or
unexpected keys, in the input checkpoint's dtype, atomically (temporary folder, then rename).
Neither imports transformers or PyTorch (seconds of imports a merge does not need): config.json
is read as a `ModelConfig` (families/config.py) and written back as it was read.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import rotsym_jax as rj

from .. import owned
from ..errors import InputError, InputTypeError
from ..families.config import ModelConfig
from ..families.family import Family, InferredRecord, Layout, assemble
from ..families.labels import check_labels
from ..pytree import Params, flatten, unflatten
from ..spec import Spec
from ._files import (  # noqa: F401  (what hf uses, and its public names that moved)
    FLOATING_DTYPES,
    ORBAX_ITEM,
    ORBAX_ITEMS,
    ST_DTYPES,
    UNUSABLE,
    WEIGHTS,
    WEIGHTS_INDEX,
    CheckpointError,
    NonFiniteWeights,
    ShardWriter,
    TensorFiles,
    is_orbax_item,
    link_problem,
    missing_folder,
    nonfinite_count,
    orbax_hint,
    read_json_object,
    write_shards,
)
from ._publish import (  # noqa: F401  (what hf uses, and its public names that moved)
    check_extra_name,
    check_output,
    check_target,
    copy_extra_files,
    floating_dtype,
    held_dtype,
    keep_foreign_files,
    publish,
    without_code_keys,
    write_manifest,
)
from .configs import (  # noqa: F401  (what hf uses, and its public names that moved)
    TIE_KEY,
    as_model_config,
    check_config,
    config_step,
    describe_config,
    family_for,
    family_of,
    read_config,
    read_model_config,
    supported_model_types,
    untied_config,
)


@dataclasses.dataclass(frozen=True, eq=False)
class Checkpoint:
    """A model family, its config, the Flax graph and a params pytree.

    `model_config` is the config as the library reads it (a read-only `ModelConfig`: every value
    the family reads, as transformers' config class holds it); `config` is the transformers config
    (`transformers.PretrainedConfig`), built from it on first use: reading it imports transformers
    and PyTorch. Changing the transformers config changes nothing the library reads; pass a changed
    one to `init_checkpoint` for a new model.
    `params` is a nested dict of arrays (paths documented in each family's module).
    `layout` names the base-model prefix, the task head and the pooler: reading, aligning,
    merging and saving need only it and the family's record.
    `apply(params, **inputs)` runs the model on any params pytree of the same structure and returns
    a dict with `last_hidden_state` (and `logits`, `pooler_output` and the head's other outputs
    where the model has them). The Flax graph (`graphdef`) is built on first use; a head our
    models do not run (`runs_head` False: multiple choice, pre-training, ...) is left out of it,
    and `require_head` names it to the features that need logits.
    `dtype` is the source checkpoint's (most common) stored dtype and `stored_dtypes` each leaf's
    own: `save_hf` writes every tensor back in its stored dtype by default (`dtype` for leaves
    without one). `aliases`: {HF name: the stored tensor in `source` that holds it}, for a tensor
    the checkpoint has but its folder stores under another name (a head untied from the
    embedding, `rotsym_jax.io.ties.untie`). `stored_config`: the config its folder's tensors were
    written by, where the checkpoint's own is wider (`rotsym_jax.io.widths.widen`: a streamed read
    pads them with the zero units and heads); None: `model_config`.
    """

    family: str
    model_config: ModelConfig
    params: Params
    layout: Layout
    dtype: Any = jnp.float32
    source: Path | None = None
    stored_dtypes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    stored_config: ModelConfig | None = None

    @property
    def config(self):
        """The transformers config (built on first use; imports transformers)."""
        return self.model_config.transformers()

    @property
    def runs_head(self) -> bool:
        """Whether the forward pass runs the task head (always true without one)."""
        return family_of(self.model_config).has_forward(self.layout)

    @property
    def graphdef(self):
        """The Flax graph of the forward pass (the base model, and the head where it runs), built
        on first use for the params' dtype. A config our forward pass cannot run is refused here,
        naming the value: reading, aligning, merging and saving never need it."""
        self.require_forward()
        layout = self.layout if self.runs_head else dataclasses.replace(self.layout, head=None)
        dtypes = collections.Counter(np.dtype(x.dtype) for x in jax.tree_util.tree_leaves(self.params))
        try:
            return _graph(self.model_config, layout, jnp.dtype(dtypes.most_common(1)[0][0] if dtypes else self.dtype))
        except ValueError as e:
            where = str(self.source) if self.source is not None else f"this {self.family} config"
            raise CheckpointError(f"{where}: the forward pass cannot run this config ({e}); reading, aligning, merging and "
                                  "saving do not need it") from e

    def require_forward(self) -> None:
        """CheckpointError where this checkpoint was read with an inferred record (our forward pass
        is the record's family's, not proven for this model; its groups are), or where its family
        has no forward pass (a vision–language model)."""
        record = self.model_config.record
        if record is not None:
            raise CheckpointError(f"{self.source or 'this model'}: model_type {record.model_type!r} is read with a record inferred from "
                                  f"its tensors ({record.read_as!r}'s, proven in transformers for its symmetry groups), which moves "
                                  f"weights only: our forward pass is {record.read_as}'s, not {record.model_type}'s, so nothing that "
                                  "runs the model (data, losses, barriers, activations) is offered for it")
        family = family_of(self.model_config)
        if not family.forward:
            raise CheckpointError(f"{self.source or 'this model'}: a {family.name} model is read, aligned, merged and saved, but rotsym_jax has "
                                  "no forward pass of it: nothing that runs the model (data, losses, barriers, activations) is offered for it")

    def forward_params(self, params: Params) -> Params:
        """`params` as the graph takes them: without a head it does not run."""
        return self.forward().params_of(params)

    def forward(self) -> Forward:
        """The forward pass alone, hashable by value: a static argument of a jitted function that
        runs any params of this architecture, compiled once for every checkpoint of it."""
        return Forward(self.graphdef, self.runs_head)

    def require_head(self, what: str) -> None:
        """Raise CheckpointError, naming the head, when `what` (a feature that needs the model's
        logits) cannot run on this checkpoint: no task head, or one our models do not run."""
        self.require_forward()
        family = family_of(self.model_config)
        where = str(self.source) if self.source is not None else "the model"
        if self.layout.head is None:
            raise CheckpointError(f"{where} is a {self.family} model without a task head: {what} needs the logits of one")
        runs = sorted(h.name for h in family.heads if h.forward and h.loss)
        if not self.runs_head:
            raise CheckpointError(f"{where}: the {self.layout.head!r} head is read, aligned, merged and saved, but rotsym_jax does "
                                  f"not run it, and {what} needs its logits; heads of {self.family} with logits here: {runs}")
        if not family.head(self.layout.head).loss:
            raise CheckpointError(f"{where}: the {self.layout.head!r} head runs, but gives no one distribution of logits (question "
                                  f"answering: start and end logits), which {what} needs; heads of {self.family} with logits: {runs}")

    def split_batch(self, batch: Mapping, what: str = "batch") -> tuple[dict, jax.Array | None]:
        """(model inputs, labels or None) of a batch of data (a "labels" entry is not an input);
        token ids out of the vocabulary are refused (`what` names the batch in the error): an
        embedding lookup out of range gives NaN silently."""
        check_token_ids(self.model_config, batch, what)
        inputs = {k: jnp.asarray(v) for k, v in batch.items() if k != "labels"}
        labels = batch.get("labels")
        return inputs, None if labels is None else jnp.asarray(labels)

    def check_batch(self, batch: Mapping, what: str = "batch") -> int:
        """ValueError, naming `what`, for a batch the model cannot read (token ids outside the
        vocabulary, images of another shape: the forward pass is traced on it, no weight is read
        or needed); else the number of its tokens that are not padding (of its images' patch
        tokens); labels, where the batch has them and the model gives logits, must index them."""
        refusal = family_of(self.model_config).data_refusal()
        if refusal:  # before its inputs are read: a dual model reads two kinds of input
            raise InputError(f"{what}: {self.source or 'the model'} is a {self.family} model, {refusal}")
        reads = family_of(self.model_config).input
        if reads not in batch:
            given = next((k for k in ("pixel_values", "input_features", "input_ids") if k in batch), None)
            kind = {"pixel_values": "images", "input_features": "log-mel features", "input_ids": "token ids"}
            holds = f"holds {given} ({kind[given]})" if given else f"holds {sorted(batch)}"
            raise InputError(f"{what}: {holds}, and {self.source or 'the model'} is a {self.family} model, which reads {reads} "
                             f"({kind.get(reads, reads)}): give data of {reads}")
        inputs, labels = self.split_batch(batch, what)
        self._check_positions(inputs, what)
        try:
            out = jax.eval_shape(lambda p, x: self.apply(p, **x), self.params, inputs)
        except (ValueError, TypeError) as e:
            raise InputError(f"{what}: the model cannot read it: {e}") from None
        if labels is not None and "logits" in out:
            check_labels(labels, out["logits"].shape, what)
        if "last_hidden_state" not in out:
            raise InputError(f"{what}: {self.source or 'the model'} is a {self.family} model whose forward pass gives no hidden states; "
                             "alignment and statistics from data do not run on it (align it from its weights)")
        mask = inputs.get("attention_mask")
        hidden = out["last_hidden_state"].shape
        return int(np.sum(np.asarray(mask))) if mask is not None and tuple(mask.shape) == tuple(hidden[:2]) else int(np.prod(hidden[:-1]))

    def _check_positions(self, inputs: Mapping, what: str) -> None:
        """Sequences longer than a learned position table (BERT, RoBERTa, DistilBERT, GPT-2) read
        rows past its end, which the lookup fills with NaN: refused."""
        table = flatten(self.params).get("embeddings/position/embedding")
        ids = inputs.get("input_ids")
        if table is None or ids is None or np.ndim(ids) < 2:
            return
        offset = self.model_config.pad_token_id + 1 if self.family == "roberta" else 0  # RoBERTa counts positions from padding_idx + 1
        length, rows = np.shape(ids)[-1], table.shape[0]
        if length + offset > rows:
            raise InputError(f"{what}: sequences of {length} tokens, and the model has {rows} learned positions"
                             f"{f' (the first {offset} unused)' if offset else ''}: give at most {rows - offset} tokens a sequence "
                             "(--max-length, or a recipe's data.max_length)")

    def apply(self, params: Params, **inputs) -> dict:
        check_token_ids(self.model_config, inputs)
        return self.forward().apply(params, **inputs)

    def model(self, params: Params | None = None):
        """The NNX module with `params` (default: the checkpoint's) merged in."""
        return rj.nets.merged(self.graphdef, self.forward_params(self.params if params is None else params))


@dataclasses.dataclass(frozen=True)
class Forward:
    """A checkpoint's forward pass without its weights (`Checkpoint.forward`): the Flax graph and
    whether the task head runs. `apply` runs any params of the architecture, as `Checkpoint.apply`
    does but for the token-id check (traced inputs cannot be checked)."""

    graphdef: Any
    runs_head: bool

    def params_of(self, params: Params) -> Params:
        return params if self.runs_head else {k: v for k, v in params.items() if k != "head"}

    def apply(self, params: Params, **inputs) -> dict:
        inputs = {k: (None if v is None else jnp.asarray(v)) for k, v in inputs.items()}
        return rj.nets.apply(self.graphdef, self.params_of(params), inputs)


# Index inputs and the config entry bounding them: an embedding lookup out of range gives NaN or
# a clipped row, silently.
_INDEX_INPUTS = (("input_ids", "vocab_size"), ("token_type_ids", "type_vocab_size"))


def check_token_ids(config, inputs: dict, what: str = "inputs") -> None:
    """Raise ValueError when a concrete `input_ids`/`token_type_ids` entry lies outside
    [0, vocab size) of `config`. Traced inputs (under jit) cannot be checked and pass."""
    for name, bound_key in _INDEX_INPUTS:
        ids, bound = inputs.get(name), getattr(config, bound_key, None)
        if ids is None or bound is None or isinstance(ids, jax.core.Tracer) or (name == "token_type_ids" and bound == 0):
            continue  # no token types at all (DeBERTa-v3): the model does not read them
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= bound):
            raise InputError(
                f"{what}: {name} holds values in [{ids.min()}, {ids.max()}], outside [0, {bound}) "
                f"({bound_key}={bound} in the config)"
            )


def spec_for(checkpoint_or_config) -> Spec:
    """The spec of a built-in family (`Family.spec`), from a Checkpoint, its `model_config` or a
    transformers config. A Checkpoint's layout says which head it has; from a config alone, a
    final norm that any tied head of the config would read is not folded (`Family.residual_spec`)."""
    layout = checkpoint_or_config.layout if isinstance(checkpoint_or_config, Checkpoint) else None
    config = checkpoint_or_config.model_config if isinstance(checkpoint_or_config, Checkpoint) else checkpoint_or_config
    try:
        config = as_model_config(config)
    except TypeError:
        raise InputTypeError(
            f"spec_for takes a Checkpoint or a transformers config, got {type(checkpoint_or_config).__name__} "
            "(for params, pass the Checkpoint they came from)"
        ) from None
    return family_of(config).spec(config, layout)


def init_checkpoint(
    config,
    key: jax.Array,
    *,
    head: str | None = None,
    pooler: bool = False,
    prefix: str | None = None,
    dtype=jnp.float32,
) -> Checkpoint:
    """A randomly initialised model of `config`'s family (transformers-style init), as a Checkpoint.

    `config`: a transformers config (the checkpoint's `config` is this object) or a ModelConfig.
    `head` names the task head (see the family's module); `prefix` defaults to the family's
    base-model prefix when there is a head (as transformers' `*For*` classes save) and "" otherwise.
    """
    try:
        config = as_model_config(config)
    except ValueError as e:  # a transformers config that holds what transformers would not load
        raise CheckpointError(f"config: {e}") from e
    family = family_of(config)
    check_config(config, zero_sizes=family.zero_sizes)
    if prefix is None:
        prefix = family.base_prefix(config, head)
    layout = Layout(prefix=prefix, head=head, pooler=pooler)
    if not family.has_forward(layout):
        raise CheckpointError(f"{family.name} head {head!r} is read from checkpoints but not built here (no forward pass): "
                              f"initialise it with transformers and load it with load_hf")
    family.check_layout(config, layout)
    params = rj.nets.initialised(lambda rngs: family.build(config, layout, dtype, rngs), key)
    return Checkpoint(family.name, config, params, layout, jnp.dtype(dtype))


def load_hf(path: str | os.PathLike, *, dtype=None, allow_nonfinite: bool = False, weights: bool = True,
            record: InferredRecord | None = None) -> Checkpoint:
    """Load a Hugging Face checkpoint folder as a `Checkpoint`.

    dtype: the params' dtype; default: each tensor's stored floating dtype (`save_hf` writes each
    back in it). Tensors the model reads must be floating (F16, BF16, F32, F64); other dtypes are
    refused rather than cast. Non-finite values (NaN, Inf) are refused unless `allow_nonfinite`,
    which loads them with a warning. weights=False reads only config.json and the safetensors
    headers, checks every name, shape and dtype as a full load does, and returns params whose
    leaves are `jax.ShapeDtypeStruct`s (for plans and memory estimates: nothing else is read).
    record: for a model_type without a record of its own, an inferred one (`rotsym_jax.infer_record`).
    Raises `CheckpointError` (or FileNotFoundError) naming the file, tensor and shapes on bad input.
    """
    folder = Path(path)
    if link_problem(folder):
        raise CheckpointError(link_problem(folder))
    if not folder.is_dir():
        raise missing_folder(folder, f" (expected config.json + {WEIGHTS}, or an Orbax checkpoint or run)")
    config_file = folder / "config.json"
    config, family = read_model_config(config_file, record)

    files = TensorFiles(folder)
    names = files.names()
    stored = {name: files.dtype(name) for name in names}
    float_dtypes = [d for d in stored.values() if d in ST_DTYPES]
    if not float_dtypes:
        raise CheckpointError(f"{folder}: the checkpoint holds no floating-point tensors")
    majority = jnp.dtype(ST_DTYPES[collections.Counter(float_dtypes).most_common(1)[0][0]])

    layers = getattr(config, family.num_layers, None) if family.num_layers else None
    if isinstance(layers, int) and layers > len(names):  # before anything is built per layer
        raise CheckpointError(f"{config_file}: {family.num_layers}={layers}, but the checkpoint holds {len(names)} tensors (a layer holds "
                              "at least one): the config does not describe these weights")
    layout = config_step(config_file, lambda: family.detect(names, config, shapes=lambda n: files.shape(n) if n in names else None))
    # bounded by the tensors there (with room for optional ones a checkpoint may lack)
    rules = config_step(config_file, lambda: family.tensors(config, layout, limit=2 * len(names) + 16))
    read_config_as, read_as, tie_copies, stored_as = _stored_ties(files, family, config, layout, rules, read=weights, config_file=config_file)
    if (read_config_as, read_as) != (config, layout):
        config, layout = read_config_as, read_as
        rules = config_step(config_file, lambda: family.tensors(config, layout, limit=2 * len(names) + 16))
    expected = config_step(config_file, lambda: family.shapes(config, layout))

    flat: dict[str, jax.Array] = {}
    leaf_dtypes: dict[str, np.dtype] = {}
    used: set[str] = set()
    nonfinite: list[str] = []
    stacks: list = []
    for rule in rules:
        stored_dtype = _checked_tensor(files, folder, rule, expected, config, stored_as.get(rule.hf, rule.hf))
        used.add(stored_as.get(rule.hf, rule.hf))
        if not weights:
            for our_path in rule.ours:
                flat[our_path] = jax.ShapeDtypeStruct(expected[our_path], jnp.dtype(dtype or stored_dtype))
                leaf_dtypes[our_path] = stored_dtype
            continue
        array = files.get(stored_as.get(rule.hf, rule.hf))
        bad = nonfinite_count(array)
        if bad:
            nonfinite.append(f"{rule.hf!r} ({bad} of {array.size})")
        if rule.index is not None:  # one expert of a stacked leaf: stacked once all are read
            stacks.append((rule, rule.to_ours(array)))
        for our_path, leaf in zip(rule.ours, () if rule.index is not None else rule.to_ours(array)):
            flat[our_path] = to_device(leaf, dtype)
        for our_path in rule.ours:
            leaf_dtypes[our_path] = stored_dtype
    for our_path, leaf in assemble(stacks).items():
        flat[our_path] = to_device(leaf, dtype)
    if nonfinite:
        message = (f"{folder}: non-finite values (NaN or Inf) in {len(nonfinite)} tensor{'s' * (len(nonfinite) > 1)}: "
                   f"{', '.join(nonfinite[:8])}{' ...' if len(nonfinite) > 8 else ''}")
        if not allow_nonfinite:
            raise NonFiniteWeights(message)
        warnings.warn(message, stacklevel=2)

    used |= tie_copies
    unexpected = sorted(n for n in names - used if not family.is_ignored(n))
    if unexpected:
        raise CheckpointError(
            f"{folder}: {len(unexpected)} unexpected tensors for a {family.name} model with "
            f"head={layout.head!r} ({describe_config(config)}): {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}; does config.json match the weights?"
        )
    missing = sorted(set(expected) - set(flat))
    if missing:  # a family whose rules do not cover its model: a bug of ours, not of the input
        raise AssertionError(f"{family.name}: no tensor rule fills {missing}")
    return Checkpoint(family.name, config, unflatten(flat), layout, majority, folder, leaf_dtypes, aliases=stored_as)


def _checked_tensor(files: TensorFiles, folder: Path, rule, expected: dict, config, stored: str) -> np.dtype:
    """The tensor of `rule`, stored as `stored` (its own name, or a tied copy's where it is
    missing), checked from its header (present, of the shape config.json gives, floating); its
    stored dtype."""
    want = _expected_hf_shape(rule, expected)
    if stored not in files.where:
        raise CheckpointError(
            f"{folder}: tensor {rule.hf!r} (our leaf {', '.join(rule.ours)}) is missing; expected shape "
            f"{want} from config.json ({describe_config(config)})"
        )
    got = files.shape(stored)
    if got != want:
        raise CheckpointError(
            f"{files.where[stored]}: tensor {stored!r} has shape {got}, expected {want} from "
            f"config.json ({describe_config(config)}); the config disagrees with the weights"
        )
    dtype = files.dtype(stored)
    if dtype not in ST_DTYPES:
        raise CheckpointError(
            f"{files.where[stored]}: tensor {stored!r} has dtype {dtype}; parameters must "
            f"be floating ({', '.join(ST_DTYPES)}), and casting would change their values"
        )
    return np.dtype(ST_DTYPES[dtype])


def _stored_ties(files: TensorFiles, family: Family, config, layout: Layout, rules, *, read: bool,
                 config_file: Path) -> tuple[ModelConfig, Layout, set, dict]:
    """The config and layout the stored copies of tied tensors leave (an LM head stored beside the
    embedding it is tied to, T5's stacks' embeddings beside `shared`), and the copies read as the
    tensor they are tied to. A copy equal to its source as stored is that tensor (transformers ties
    the two). One that differs, transformers keeps apart and computes with (it warns), so it is
    read as a tensor of its own: where the family's layout has a place for it (`read_apart`: T5's
    stacks and LM head), else an LM head as the untied model's (config.json's `TIE_KEY` false,
    which a save then writes: the model transformers computes), with a warning as transformers
    gives. A copy neither reads is refused, since reading it as its source would change the
    function. Without `read` (a run that streams, a header-only load) they are compared in blocks
    of rows: a copy that differs would otherwise be dropped unread, and the output lose what it
    computes. A source missing where a copy is stored (MADLAD-400's T5 stores its stacks' tables
    and no `shared`) is read from the first copy, as transformers fills it through the tie: the
    last item, {source: the copy stored for it}.

    Returns (config, layout, the copies read as their source, {source: the copy it is read from})."""
    equal, differing, stored_as = set(), {}, {}
    for hf_name, our_path in family.tied(config, layout).items():
        source = next(r.hf for r in rules if our_path in r.ours)
        if hf_name not in files.where:
            continue
        if source not in files.where and source not in stored_as:  # this copy holds the source (its shape checked as read)
            stored_as[source] = hf_name
            equal.add(hf_name)
            continue
        source = stored_as.get(source, source)
        if _stored_equal(files, hf_name, source, whole=read):
            equal.add(hf_name)
        else:
            differing[hf_name] = source
    if not differing:
        return config, layout, equal, stored_as
    apart = family.read_apart(config, layout, set(differing))
    if apart is not None:
        return config, apart, equal, stored_as
    untied = untied_config(config, str(config_file))
    if untied is not None and not set(differing) & set(family.tied(untied, layout)):
        warnings.warn(f"{config_file.parent}: {sorted(differing)} differ from {sorted(set(differing.values()))}, which config.json ties them to; "
                      f"read apart, as transformers computes with them, and saved with {TIE_KEY}: false", stacklevel=3)
        return untied, layout, {n for n in equal if n in family.tied(untied, layout)}, stored_as
    hf_name, source = next((n, s) for n, s in differing.items() if family.read_apart(config, layout, {n}) is None)
    raise CheckpointError(
        f"{files.where[hf_name]}: {hf_name!r} differs from {source!r}, which this model ties it to (one tensor read for both); "
        f"transformers warns and keeps two such tensors apart, and this {family.name} model has no untied form that reads it: "
        f"save the checkpoint again from a model whose tied weights are one tensor")


def _stored_equal(files: TensorFiles, name: str, other: str, *, whole: bool, block_bytes: int = 64 << 20) -> bool:
    """Whether two stored tensors hold equal values as stored (before any dtype cast); unless
    `whole`, read `block_bytes` of rows at a time."""
    shape = files.shape(name)
    if shape != files.shape(other):
        return False
    if whole or not shape:
        return bool(np.array_equal(files.get(name), files.get(other)))
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * 4)
    step = max(1, block_bytes // row_bytes)
    return all(np.array_equal(files.read(name, (start, min(start + step, shape[0]))), files.read(other, (start, min(start + step, shape[0]))))
               for start in range(0, shape[0], step))


@functools.lru_cache(maxsize=8)
def _graph(config: ModelConfig, layout: Layout, dtype):
    """The Flax graph of a model's forward pass, without initialising it. Cached: tracing the
    initialisers takes ~0.1 s per layer, and a merge runs several checkpoints of one config."""
    family = family_of(config)
    return rj.nets.graph(lambda rngs: family.build(config, layout, dtype, rngs))


def to_device(leaf: np.ndarray, dtype) -> jax.Array:
    """A host array as a JAX array of `dtype` (default: its own, as JAX canonicalises it). Cast on
    the host (round to nearest even, as XLA casts) and put on the device: `jnp.asarray` would
    compile a staging program per leaf shape. A strided leaf (a transposed kernel) goes as it is:
    `device_put` lays it out 3x faster than a NumPy copy first (a 3072 x 8192 bf16 kernel: 29 ms
    against 92 ms)."""
    target = jax.dtypes.canonicalize_dtype(leaf.dtype if dtype is None else jnp.dtype(dtype))
    return jax.device_put(leaf if leaf.dtype == target else leaf.astype(target))


def _expected_hf_shape(rule, expected) -> tuple:
    zeros = tuple(np.broadcast_to(np.zeros((), np.float32), expected[p]) for p in rule.ours)
    return tuple(rule.to_hf(zeros).shape)


def check_params(checkpoint: Checkpoint, params: Params, what: str = "params") -> dict[str, Any]:
    """Flattened `params`, after checking they have the checkpoint's paths and shapes."""
    flat, ref = flatten(params), flatten(checkpoint.params)
    missing, extra = sorted(set(ref) - set(flat)), sorted(set(flat) - set(ref))
    if missing or extra:
        raise CheckpointError(
            f"{what} do not match the {checkpoint.family} checkpoint: missing leaves {missing[:8]}, "
            f"unexpected leaves {extra[:8]}"
        )
    for p, leaf in flat.items():
        if tuple(np.shape(leaf)) != tuple(np.shape(ref[p])):
            raise CheckpointError(
                f"{what}: leaf {p} has shape {tuple(np.shape(leaf))}, expected {tuple(np.shape(ref[p]))}"
            )
    return flat


def save_hf(
    checkpoint: Checkpoint,
    params: Params,
    path: str | os.PathLike,
    *,
    dtype=None,
    overwrite: bool = False,
    allow_nonfinite: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    extra_files: Mapping[str, str] | Callable[[], Mapping[str, str]] | None = None,
) -> Path:
    """Write `params` as a Hugging Face checkpoint folder of `checkpoint`'s family and head.

    dtype: a floating dtype for every tensor; default: each tensor's stored dtype in the source
    checkpoint. Tensors that are not finite after the cast (NaN, Inf, or values that overflow the
    dtype) are refused unless `allow_nonfinite`. Tokenizer and other non-weight files of the
    source folder are copied along (never checkpoint folders saved inside it). extra_files: {file
    name: text} written into the folder too (replacing a copied file of that name, e.g. the model
    card README.md), so that they appear with the checkpoint, atomically; or a function returning
    them, called once the weights are written (a report that times the writing).

    The folder is written under a temporary name beside `path` and then moved into place, so that
    `path` holds either its old content or the complete new checkpoint at every instant, and a
    failure leaves the old one and no temporary files. `overwrite=True` replaces only a checkpoint
    folder (config.json + weights), never the source's folder or one of its ancestors. On Linux the
    replacement is one atomic exchange; where the filesystem cannot exchange, the old folder is set
    aside for the instant between two renames (and put back if the second one fails).
    """
    target = Path(path)
    check_target(target, checkpoint.source, overwrite)
    flat = check_params(checkpoint, params)
    family = family_of(checkpoint.model_config)
    if dtype is not None:
        dtype = floating_dtype(dtype)
    tensors: dict[str, np.ndarray] = {}
    nonfinite = []
    for rule in family.tensors(checkpoint.model_config, checkpoint.layout):
        leaves = tuple(np.asarray(flat[p]) for p in rule.ours)
        out_dtype = saved_dtype(checkpoint, rule.ours[0], dtype)
        tensors[rule.hf] = saved_array(rule.to_hf(leaves), out_dtype, "/".join(rule.ours), nonfinite)
    check_saved_finite(nonfinite, allow_nonfinite)

    dtypes = {name: t.dtype for name, t in tensors.items()}
    return write_folder(checkpoint, target, dtypes, lambda tmp: write_shards(tensors, tmp, max_shard_bytes), extra_files)


def saved_dtype(checkpoint: Checkpoint, path: str, dtype=None) -> np.dtype:
    """The dtype a leaf is saved in: `dtype`, else its stored dtype in the source checkpoint."""
    return dtype or np.dtype(checkpoint.stored_dtypes.get(path, checkpoint.dtype))


def saved_array(array: np.ndarray, dtype, what: str, nonfinite: list) -> np.ndarray:
    """`array` cast for saving, C-contiguous (safetensors' NumPy writer stores other arrays in
    the wrong element order); non-finite values after the cast are noted in `nonfinite`."""
    with np.errstate(over="ignore"):  # an overflow shows as Inf, refused with its leaf
        out = np.asarray(np.asarray(array).astype(dtype, copy=False), order="C")
    bad = nonfinite_count(out)
    if bad:
        nonfinite.append(f"{what} ({bad} of {out.size} as {np.dtype(dtype)})")
    return out


def check_saved_finite(nonfinite: list, allow_nonfinite: bool) -> None:
    if nonfinite and not allow_nonfinite:
        raise CheckpointError(
            f"params: non-finite values (NaN, Inf, or beyond the saved dtype's range) in {len(nonfinite)} "
            f"leaves: {nonfinite[:8]}; pass allow_nonfinite=True to save them anyway"
        )


def write_folder(checkpoint: Checkpoint, target: Path, dtypes: Mapping[str, Any], write_weights, extra_files=None) -> Path:
    """The folder-writing part of `save_hf`, shared with the streaming path: config.json (from
    the saved tensors' dtypes), `write_weights(tmp)`, the source's other files and `extra_files`
    ({name: text, or None: the source's file of that name left out}, or a function of nothing
    returning it, called once the weights are written) in a temporary folder beside `target`, synced to disk, then moved into place atomically
    (`publish`) and the parent synced; on any failure, a full disk included, the temporary folder
    is removed and `target` is left as it was. While it writes, it holds the lock beside `target`
    (another process writing it is refused, `owned.OutputBusy`) and first removes what killed runs
    left beside it (`owned.sweep`; what it cannot prove dead is named in a warning). The
    temporary folder is `owned.temp_folder`'s: owned from its first instant, so that the command
    line's signal handler or, after a kill, the next run removes it. The caller checks `target`
    first (`check_target`)."""
    family = family_of(checkpoint.model_config)
    target.parent.mkdir(parents=True, exist_ok=True)
    with owned.writing(target):  # another process writing `target` is refused here (the command line asks first)
        for note in owned.sweep(target.parent):  # what killed runs left beside it
            warnings.warn(f"note: {note}", stacklevel=2)
        # A short name of its own (the target's may already be near the 255-byte limit), holding its owner.
        tmp = owned.temp_folder(target.parent, ".rotsym-tmp-", target)
        try:
            write_config(checkpoint, family, dtypes, tmp)
            write_weights(tmp)
            if checkpoint.source is not None and checkpoint.source.is_dir():
                copy_extra_files(checkpoint.source, tmp)
            for name, text in (extra_files() if callable(extra_files) else extra_files or {}).items():
                check_extra_name(name)
                if text is None:  # a file of the source's that the output must not carry
                    (tmp / name).unlink(missing_ok=True)
                else:
                    (tmp / name).write_text(text)
            write_manifest(tmp)
            kept = keep_foreign_files(target, tmp) if target.is_dir() else []
            owned.sync_tree(tmp)  # on disk before the rename publishes it: after a power cut, old or complete new
            with owned.critical():  # a signal's cleanup waits for the renames
                owned.unmark(tmp)
                owned.sync_folder(tmp)
                replaced = publish(tmp, target)
                owned.published(tmp, target, replaced)
        except BaseException as e:
            owned.discard(tmp)
            if isinstance(e, OSError):
                e.add_note(f"{target} was left as it was and the partial output removed")
            raise
        owned.sync_folder(target.parent)
        if kept:
            warnings.warn(f"note: {target}: kept {len(kept)} files that rotsym did not write ({', '.join(kept[:5])}"
                          f"{' …' if len(kept) > 5 else ''})", stacklevel=2)
        if replaced is not None and not owned.discard(replaced):
            warnings.warn(f"saved {target}, but could not delete its previous content at {replaced}", stacklevel=2)
    return target


def write_config(checkpoint: Checkpoint, family: Family, dtypes: Mapping[str, Any], folder: Path):
    """config.json as it was read (every key kept, transformers reads it as it read the source),
    with the saved architecture and dtype, written as `save_pretrained` formats it."""
    config = without_code_keys(checkpoint.model_config.raw)  # they name the source's code, which is never passed on
    config.pop("quantization_config", None)  # an FP8 source's weights are read dequantized and written so
    config["architectures"] = [family.architecture(checkpoint.model_config, checkpoint.layout)]
    # transformers' `dtype` names one dtype: the most common one, as load_hf picks it.
    common = collections.Counter(np.dtype(d) for d in dtypes.values()).most_common(1)[0][0]
    _set_dtype(config, "bfloat16" if common == ml_dtypes.bfloat16 else str(common))
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _set_dtype(config: dict, dtype: str, top: bool = True) -> None:
    """`dtype` at the top and in every sub-config that names one (a VLM's text_config and
    vision_config), as save_pretrained sets it on each: a stale sub-config's dtype would say the
    tensors are stored otherwise than they are. `torch_dtype`, its old name, goes."""
    if top or {"dtype", "torch_dtype"} & config.keys():
        config.pop("torch_dtype", None)
        config["dtype"] = dtype
    for key, value in config.items():
        if key.endswith("_config") and isinstance(value, dict):
            _set_dtype(value, dtype, top=False)


def copy_config(config):
    """A copy of a transformers config (a ModelConfig is read-only: itself)."""
    if isinstance(config, ModelConfig):
        return config
    return config.__class__.from_dict(config.to_dict())
