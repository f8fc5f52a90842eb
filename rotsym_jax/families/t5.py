"""T5 (v1.0, v1.1, Flan-T5): an encoder–decoder of pre-norm layers with T5's RMSNorm (no mean, no
bias), no biases anywhere, unscaled attention scores, and a relative position bias per head that
the first layer of each stack holds and every layer of that stack adds.

Because every layer of a stack adds one bias table indexed by head, the heads of its
self-attention keep their order (`HeadGeometry.fixed_order`): each head's QK and VO rotations and
scales remain, its permutations do not (they would have to move the shared table's columns in every
layer at once). The cross-attention has no position bias: its heads permute. The stream: one
rotation or permutation for both stacks (the shared embedding writes both), the norms' gains folded
into their readers (the encoder's final norm into every cross-attention's keys and values); the
decoder's final norm is read by the LM head, tied to the embedding, so a rotation needs it uniform.

Leaves (d = d_model, H = num_heads, dkv = d_kv, f = d_ff):
    embeddings/word/embedding                          (vocab_size, d)   shared (the LM head)
    embeddings/{encoder,decoder}_word/embedding        (vocab_size, d)   {encoder,decoder}.embed_tokens, where the checkpoint
                                                       stores it with values other than shared's (`T5Layout`)
    embeddings/{encoder,decoder}_position_bias/embedding (relative_attention_num_buckets, H)
                                      {encoder,decoder}.block.0.layer.0.SelfAttention.relative_attention_bias
    encoder/layers/{i}/attention/{query,key,value}/kernel (d, H dkv), out/kernel (H dkv, d)   layer.0.SelfAttention
    encoder/layers/{i}/attention_norm/scale, mlp_norm/scale   layer.0.layer_norm, layer.1.layer_norm
    encoder/layers/{i}/mlp/{up,down}/kernel                   layer.1.DenseReluDense.wi, wo (v1.0's ReLU)
        or mlp/{gate,up,down}/kernel                          wi_0 (activated), wi_1, wo (gated, v1.1)
    decoder/layers/{i}/...   as the encoder's; cross_attention (layer.1.EncDecAttention), cross_attention_norm
                             (layer.1.layer_norm); the MLP and its norm are layer.2's
    {encoder,decoder}/final_norm/scale                        final_layer_norm
    task heads (all run here):
        lm                       T5ForConditionalGeneration: the shared embedding, on the decoder's states
                                 times d^-1/2 where scale_decoder_outputs says; v1.1 and Flan-T5 as stored
                                 (tie_word_embeddings false in config.json) hold lm_head/kernel of their own, as
                                 does a checkpoint storing lm_head.weight apart from shared (`T5Layout.own_head`)
        sequence_classification  head/dense, head/out_proj (classification_head) on each example's last eos
        question_answering       head/qa_outputs (d, 2) on the decoder's states
T5EncoderModel and T5ForTokenClassification (the encoder alone) are not read.

mT5 (`MT5`) is this record under MT5Config's defaults, its LM head's input never scaled; umT5 (`UMT5`) holds a
position bias in every self-attention layer ({encoder,decoder}/layers/{i}/position_bias/embedding, layer.0's
relative_attention_bias), none in `embeddings/`.

Each stack embeds its input with its own `embed_tokens`, and the logits are computed by `lm_head`,
which transformers 5 ties to `shared` (T5Config forces tie_word_embeddings true) unless the
checkpoint stores both with different values: then it warns and keeps the two apart
(`PreTrainedModel.tie_weights`), as a model saved after its config was untied (or its module
replaced) stores them. So a stored copy equal to `shared` is read as `shared` and not written
back; one that differs is a tensor of its own, read, run, aligned (a stack's table writes the
stream, as `shared` does; the head reads it) and written back.

Inputs: input_ids, attention_mask, decoder_input_ids (default: input_ids shifted right after
decoder_start_token_id, as T5's task classes make them) and decoder_attention_mask.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry, Spec
from .bart import EncoderDecoderFamily, site_rules
from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import OPTIONAL, SPEC_RULES, Head, Layout, Norm, Tensor, embedding, linear, norm, weight

STACKS = ("encoder", "decoder")


def inner(config) -> int:
    return config.num_heads * config.d_kv


def _gated(config) -> bool:
    return config.is_gated_act


def _plain(config) -> bool:
    return not config.is_gated_act


def _stack(stack: str) -> tuple[Tensor, ...]:
    decoder = stack == "decoder"
    hf, ours = f"{stack}.block.{{i}}.layer", f"{stack}/layers/{{i}}"
    mlp = f"{hf}.{2 if decoder else 1}"

    def attention(module, site):
        return (*(t for proj, leaf in (("q", "query"), ("k", "key"), ("v", "value"))
                  for t in linear(f"{module}.{proj}", f"{ours}/{site}/{leaf}", "d_model", inner, bias=False, reads=True)),
                *linear(f"{module}.o", f"{ours}/{site}/out", inner, "d_model", bias=False, writes=True))

    return (
        *attention(f"{hf}.0.SelfAttention", "attention"),
        *norm(f"{hf}.0.layer_norm", f"{ours}/attention_norm", "d_model", bias=False),
        *((*attention(f"{hf}.1.EncDecAttention", "cross_attention"),
           *norm(f"{hf}.1.layer_norm", f"{ours}/cross_attention_norm", "d_model", bias=False)) if decoder else ()),
        *(Tensor(t.hf, t.ours, t.shapes, t.stream, t.convert, _plain) for t in
          linear(f"{mlp}.DenseReluDense.wi", f"{ours}/mlp/up", "d_model", "d_ff", bias=False, reads=True)),
        *(Tensor(t.hf, t.ours, t.shapes, t.stream, t.convert, _gated) for t in
          linear(f"{mlp}.DenseReluDense.wi_0", f"{ours}/mlp/gate", "d_model", "d_ff", bias=False, reads=True)
          + linear(f"{mlp}.DenseReluDense.wi_1", f"{ours}/mlp/up", "d_model", "d_ff", bias=False, reads=True)),
        *linear(f"{mlp}.DenseReluDense.wo", f"{ours}/mlp/down", "d_ff", "d_model", bias=False, writes=True),
        *norm(f"{mlp}.layer_norm", f"{ours}/mlp_norm", "d_model", bias=False),
    )


def _ffn_rules(stack: str) -> tuple:
    at, group = rf"{stack}/layers/(?P<layer>\d+)/mlp", f"{stack}_ffn"
    # v1.1's gated GELU: each unit's scale too (up and down tagged .in / .out; v1.0 has no gate: permutations)
    return ((rf"{at}/gate/kernel", (None, group)), (rf"{at}/up/kernel", (None, f"{group}.in")), (rf"{at}/down/kernel", (f"{group}.out", None)))


RULES = (
    *site_rules("encoder", "attention", "encoder"), *_ffn_rules("encoder"),
    *site_rules("decoder", "attention", "decoder"), *site_rules("decoder", "cross_attention", "cross"), *_ffn_rules("decoder"),
    (r"(encoder|decoder)/layers/(?P<layer>\d+)/(attention|cross_attention|mlp)_norm/scale", None),
    (r"(?:encoder|decoder)/final_norm/scale", None),
)


def own_lm_head(config) -> bool:
    """T5 v1.1 and Flan-T5 as they are stored (config.json's tie_word_embeddings false): an LM head of
    their own, which transformers 5 loads as one (its config says tied whatever config.json says).
    A value `_derive` keeps (a transformers config forgets it: it says tied, and its loader looks at the tensors)."""
    return bool(getattr(config, "own_lm_head", False))


_LM_HEAD = "lm_head.weight"


def _embed_tokens(stack: str) -> str:
    return f"{stack}.embed_tokens.weight"


def _ties(config) -> dict:
    return {"{prefix}" + _embed_tokens(stack): "embeddings/word/embedding" for stack in STACKS}


@dataclasses.dataclass(frozen=True)
class T5Layout(Layout):
    """A T5 checkpoint's layout whose stacks (`own_embeddings`: a subset of `STACKS`, in that order)
    embed their input with a table of their own, or whose LM head is its own (`own_head`) under a
    config that ties it: `{stack}.embed_tokens.weight` or `lm_head.weight` stored with values other
    than `shared.weight`'s, which transformers keeps apart (see the module docstring)."""

    own_embeddings: tuple[str, ...] = ()
    own_head: bool = False


def own_embeddings(layout) -> tuple[str, ...]:
    """The stacks that embed with a table of their own in `layout` (none in a plain `Layout`)."""
    return getattr(layout, "own_embeddings", ())


def has_own_head(config, layout) -> bool:
    """Whether the LM head is a kernel of its own: as config.json says (`own_lm_head`), or as stored apart (`T5Layout.own_head`)."""
    return own_lm_head(config) or getattr(layout, "own_head", False)


_HEADS = (
    Head("lm", "ForConditionalGeneration",
         tuple(dataclasses.replace(t, when=own_lm_head) for t in linear("lm_head", "lm_head", "d_model", "vocab_size", bias=False, reads=True)),
         tied=lambda c: {} if own_lm_head(c) else {_LM_HEAD: "embeddings/word/embedding"}, forward=True),
    Head("sequence_classification", "ForSequenceClassification",
         linear("classification_head.dense", "head/dense", "d_model", "d_model", reads=True)
         + linear("classification_head.out_proj", "head/out_proj", "d_model", "num_labels"),
         markers=("classification_head.dense.weight",), prefixes={"t5": "transformer.", "mt5": "transformer.", "umt5": "transformer."},
         forward=True),
    Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", "d_model", "num_labels", reads=True),
         markers=("qa_outputs.weight",), loss=False, forward=True),
)


def _derive(values: dict, raw) -> None:
    """T5Config: the decoder as deep as the encoder unless given; feed_forward_proj "act" or
    "gated-act" ("gated-gelu" is gelu_new); the LM head always tied, its input scaled by d^-1/2
    unless the config says tie_word_embeddings false (or scale_decoder_outputs); an LM head of its
    own where config.json says tie_word_embeddings false (`own_lm_head`)."""
    if values["num_decoder_layers"] is None:
        values["num_decoder_layers"] = values["num_layers"]
    proj = values["feed_forward_proj"]
    parts = proj.split("-")
    if len(parts) > 2 or len(parts) == 2 and parts[0] != "gated":
        raise InputError(f"feed_forward_proj={proj!r}: expected 'gated-<activation>' or '<activation>' (T5Config requires it)")
    values["dense_act_fn"] = "gelu_new" if proj == "gated-gelu" else parts[-1]
    values["is_gated_act"] = parts[0] == "gated" and len(parts) == 2
    if values["scale_decoder_outputs"] is None:
        values["scale_decoder_outputs"] = raw.get("tie_word_embeddings") is not False
    # what config.json's flag says of the head, a value of its own: the config's flag reads true, and two configs that
    # differ in the head must not compare equal (a forward pass is cached by config)
    values["own_lm_head"] = raw.get("tie_word_embeddings") is False
    values["tie_word_embeddings"] = True


SCHEMA = ConfigSchema("t5", "T5Config", {
    "vocab_size": (INT, 32128), "d_model": (INT, 512), "d_kv": (INT, 64), "d_ff": (INT, 2048), "num_layers": (INT, 6),
    "num_decoder_layers": (INT.optional(), None), "num_heads": (INT, 8), "relative_attention_num_buckets": (INT, 32),
    "relative_attention_max_distance": (INT, 128), "layer_norm_epsilon": (FLOAT, 1e-6), "initializer_factor": (FLOAT, 1.0),
    "feed_forward_proj": (STR, "relu"), "pad_token_id": (INT.optional(), 0), "eos_token_id": (INT.optional(), 1),
    "decoder_start_token_id": (INT.optional(), None), "tie_word_embeddings": (BOOL, True), "scale_decoder_outputs": (BOOL.optional(), None),
}, derive=_derive, aliases={"hidden_size": "d_model", "num_attention_heads": "num_heads", "num_hidden_layers": "num_layers", "head_dim": "d_kv"})


class T5Family(EncoderDecoderFamily):
    """T5's record: its self-attention blocks keep their heads' order, and a stack may embed with a
    table of its own (`T5Layout`; see the module docstring)."""

    def _tables(self, config, layout: Layout):
        left_out = {_embed_tokens(stack) for stack in STACKS if stack not in own_embeddings(layout)}
        for t, i, in_base in super()._tables(config, layout):
            if t.hf in left_out:
                continue
            yield (dataclasses.replace(t, when=None) if t.hf == _LM_HEAD and has_own_head(config, layout) else t), i, in_base

    def tied(self, config, layout: Layout) -> dict[str, str]:
        apart = {layout.prefix + _embed_tokens(stack) for stack in own_embeddings(layout)} | ({_LM_HEAD} if has_own_head(config, layout) else set())
        return {k: v for k, v in super().tied(config, layout).items() if k not in apart}

    def _tied_head_reads_final_norm(self, config, layout: Layout | None) -> bool:
        return super()._tied_head_reads_final_norm(config, layout) and not has_own_head(config, layout)

    def read_apart(self, config, layout: Layout, names) -> Layout | None:
        """The layout that reads the stored tied copies `names` (HF names, each stored with values
        other than `shared.weight`'s) as tensors of their own, as transformers computes with them:
        each stack's embedding, the LM head."""
        stacks = {stack for stack in STACKS if layout.prefix + _embed_tokens(stack) in names}
        head = _LM_HEAD in names and layout.head == "lm"
        if len(stacks) + head != len(set(names)):  # (no other tie: a family's own name for what it cannot read)
            return None
        held = set(own_embeddings(layout)) | stacks
        return T5Layout(**{f.name: getattr(layout, f.name) for f in dataclasses.fields(Layout)},
                        own_embeddings=tuple(s for s in STACKS if s in held), own_head=head or getattr(layout, "own_head", False))

    def spec(self, config, layout: Layout | None = None) -> Spec:
        heads, dkv = config.num_heads, config.d_kv
        fixed = HeadGeometry(heads, heads, dkv, fixed_order=True)
        return Spec(self.rules + SPEC_RULES, heads={"encoder": fixed, "decoder": fixed, "cross": HeadGeometry(heads, heads, dkv)},
                    residual=self.residual_spec(config, layout), optional=OPTIONAL)


def _position_bias(stack: str) -> tuple[Tensor, ...]:
    return weight(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", f"embeddings/{stack}_position_bias/embedding",
                  ("relative_attention_num_buckets", "num_heads"))


T5 = T5Family(
    name="t5",
    configs=(SCHEMA,),
    stems={"t5": "T5"},
    prefix="",
    marker="shared.weight",
    # the stacks' own tables last: a layout reads them only where it says (`T5Family._tables`)
    embeddings=(*embedding("shared.weight", "embeddings/word/embedding", "vocab_size", "d_model"), *_position_bias("encoder"),
                *_position_bias("decoder"), *(t for stack in STACKS for t in embedding(_embed_tokens(stack), f"embeddings/{stack}_word/embedding", "vocab_size", "d_model"))),
    layer=_stack("encoder"),
    decoder_layer=_stack("decoder"),
    decoder_layers="num_decoder_layers",
    stack_ties=_ties,
    final=(*norm("encoder.final_layer_norm", "encoder/final_norm", "d_model", bias=False),
           *norm("decoder.final_layer_norm", "decoder/final_norm", "d_model", bias=False)),
    heads=_HEADS,
    norm=Norm("rmsnorm", placement="pre", folds=(
        *((rf"{stack}/layers/(\d+)/attention_norm/scale", rf"{stack}/layers/\1/attention/(query|key|value)/kernel") for stack in ("encoder", "decoder")),
        *((rf"{stack}/layers/(\d+)/mlp_norm/scale", rf"{stack}/layers/\1/mlp/(up|gate)/kernel") for stack in ("encoder", "decoder")),
        (r"decoder/layers/(\d+)/cross_attention_norm/scale", r"decoder/layers/\1/cross_attention/query/kernel"),
        (r"encoder/final_norm/scale", r"decoder/layers/\\d+/cross_attention/(key|value)/kernel"),  # a template (match.expand): its backslash doubled
        (r"decoder/final_norm/scale", r"(lm_head|head/(dense|qa_outputs))/kernel"),
    )),
    num_layers="num_layers",
    build=lambda config, layout, dtype, rngs: rj.nets.t5.Seq2Seq(config, layout, dtype, rngs=rngs),
    rules=RULES,
    head_geometry=lambda config: HeadGeometry(config.num_heads, config.num_heads, config.d_kv),
)


def _derive_mt5(values: dict, raw) -> None:
    """MT5Config: T5Config's values; MT5ForConditionalGeneration never scales the decoder's states before the LM head
    (no scale_decoder_outputs: mT5's checkpoints hold an LM head of their own)."""
    values["scale_decoder_outputs"] = False
    _derive(values, raw)


def _mt5_fields(**more) -> dict:
    """MT5Config's and UMT5Config's fields: T5Config's keys with mT5's defaults."""
    fields = {k: v for k, v in SCHEMA.fields.items() if k != "scale_decoder_outputs"}
    defaults = {"vocab_size": 250112, "d_ff": 1024, "num_layers": 8, "num_heads": 6, "feed_forward_proj": "gated-gelu", "decoder_start_token_id": 0}
    return {**{k: (kind, defaults.get(k, d)) for k, (kind, d) in fields.items()}, **more}


# mT5: T5 v1.1's record under MT5Config's defaults, its LM head never scaled
MT5 = dataclasses.replace(
    T5,
    name="mt5",
    configs=(ConfigSchema("mt5", "MT5Config", _mt5_fields(), derive=_derive_mt5, aliases=SCHEMA.aliases),),
    stems={"mt5": "MT5"},
)


def _umt5_stack(stack: str) -> tuple[Tensor, ...]:
    """umT5's layer: T5's, its self-attention holding a relative position bias of its own (every layer, not the first alone)."""
    return (*_stack(stack), *weight(f"{stack}.block.{{i}}.layer.0.SelfAttention.relative_attention_bias.weight",
                                    f"{stack}/layers/{{i}}/position_bias/embedding", ("relative_attention_num_buckets", "num_heads")))


def per_layer_position_bias(config) -> bool:
    """umT5: each self-attention layer adds a relative position bias of its own."""
    return config.model_type == "umt5"


# umT5: T5 v1.1's layers, each self-attention with its own position bias table (buckets, H). Its heads keep their order
# as T5's do (`fixed_order`): a layer's table is indexed by head (a head permutation would move its columns, which no
# group here does); the table takes no map of any group (it is added to the scores).
UMT5 = dataclasses.replace(
    T5,
    name="umt5",
    configs=(ConfigSchema("umt5", "UMT5Config", _mt5_fields(scale_decoder_outputs=(BOOL.optional(), None)), derive=_derive,
                          aliases=SCHEMA.aliases),),
    stems={"umt5": "UMT5"},
    embeddings=tuple(t for t in T5.embeddings if "position_bias" not in t.ours[0]),
    layer=_umt5_stack("encoder"),
    decoder_layer=_umt5_stack("decoder"),
    rules=((r"(encoder|decoder)/layers/(?P<layer>\d+)/position_bias/embedding", None), *RULES),
)
