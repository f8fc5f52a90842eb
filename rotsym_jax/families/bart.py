"""BART: an encoder–decoder of post-LayerNorm layers (BERT's), learned positions offset by 2, one
word embedding shared by both stacks and the LM head.

Each stack's self-attention is a group of its own ("encoder", "decoder" blocks), and so is the
decoder's cross-attention ("cross": queries from the decoder's stream, keys and values from the
encoder's output); each stack's FFN units are a permutation group ("encoder_ffn", "decoder_ffn").
The shared embedding writes both streams, so one residual permutation moves both: the encoder's
stream, the decoder's, and the cross-attention's keys and values that read the encoder's.

Leaves (d = d_model, H = heads, f = each stack's ffn_dim):
    embeddings/word/embedding                 (vocab_size, d)   model.shared (the LM head, tied)
    embeddings/{encoder,decoder}_position/embedding (max_position_embeddings + 2, d)
    embeddings/{encoder,decoder}_norm/{scale,bias}  (d,)  layernorm_embedding
    encoder/layers/{i}/attention/{query,key,value,out}/{kernel,bias}   self_attn
    encoder/layers/{i}/attention_norm, mlp/{up,down}, mlp_norm          self_attn_layer_norm, fc1, fc2, final_layer_norm
    decoder/layers/{i}/...   as the encoder's, and cross_attention/{query,key,value,out}, cross_attention_norm
                             (encoder_attn, encoder_attn_layer_norm)
    task heads (all run here):
        lm                       BartForConditionalGeneration: the word embedding, and lm_head/bias (1, V)
                                 (its final_logits_bias)
        sequence_classification  head/dense, head/out_proj (classification_head) on the decoder's state at
                                 each example's last eos token
        question_answering       head/qa_outputs (d, 2) on the decoder's states: start and end logits
Inputs: input_ids and attention_mask of the encoder; decoder_input_ids (default: input_ids shifted
right after decoder_start_token_id, as BartModel makes them) and decoder_attention_mask.

mBART (`MBART`) holds the same tensors and {encoder,decoder}/final_norm (each stack's layer_norm),
its layers pre-LN.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry, Spec
from .config import BOOL, FLOAT, INT, STR, ConfigSchema, positive_ints
from .family import NO_READER, OPTIONAL, SPEC_RULES, Family, Head, Layout, Norm, Tensor, embedding, linear, norm, weight

BLOCKS = ("encoder", "decoder", "cross")


def _positions(config) -> int:
    return config.max_position_embeddings + 2  # BartLearnedPositionalEmbedding's offset


def _attention(hf: str, ours: str, ffn: str) -> tuple[Tensor, ...]:
    return (
        *(t for proj in ("q", "k", "v") for t in linear(f"{hf}.{proj}_proj", f"{ours}/{dict(q='query', k='key', v='value')[proj]}",
                                                       "d_model", "d_model", reads=True)),
        *linear(f"{hf}.out_proj", f"{ours}/out", "d_model", "d_model", writes=True),
    )


def stack_tensors(stack: str, cross: bool) -> tuple[Tensor, ...]:
    hf, ours, ffn = f"{stack}.layers.{{i}}", f"{stack}/layers/{{i}}", f"{stack}_ffn_dim"
    return (
        *_attention(f"{hf}.self_attn", f"{ours}/attention", ffn),
        *norm(f"{hf}.self_attn_layer_norm", f"{ours}/attention_norm", "d_model"),
        *((*_attention(f"{hf}.encoder_attn", f"{ours}/cross_attention", ffn),
           *norm(f"{hf}.encoder_attn_layer_norm", f"{ours}/cross_attention_norm", "d_model")) if cross else ()),
        *linear(f"{hf}.fc1", f"{ours}/mlp/up", "d_model", ffn, reads=True),
        *linear(f"{hf}.fc2", f"{ours}/mlp/down", ffn, "d_model", writes=True),
        *norm(f"{hf}.final_layer_norm", f"{ours}/mlp_norm", "d_model"),
    )


def site_rules(stack: str, site: str, block: str) -> tuple:
    at = rf"{stack}/layers/(?P<layer>\d+)/{site}"
    return (
        *((rf"{at}/{leaf}/kernel", (None, f"{block}.{role}")) for leaf, role in (("query", "q"), ("key", "k"), ("value", "v"))),
        *((rf"{at}/{leaf}/bias", (f"{block}.{role}",)) for leaf, role in (("query", "q"), ("key", "k"), ("value", "v"))),
        (rf"{at}/out/kernel", (f"{block}.o", None)),
    )


def _ffn_rules(stack: str) -> tuple:
    at, group = rf"{stack}/layers/(?P<layer>\d+)/mlp", f"{stack}_ffn"
    return ((rf"{at}/up/kernel", (None, group)), (rf"{at}/up/bias", (group,)), (rf"{at}/down/kernel", (group, None)))


RULES = (
    *site_rules("encoder", "attention", "encoder"), *_ffn_rules("encoder"),
    *site_rules("decoder", "attention", "decoder"), *site_rules("decoder", "cross_attention", "cross"), *_ffn_rules("decoder"),
    (r"(encoder|decoder)/layers/(?P<layer>\d+)/((attention|cross_attention|mlp)_norm/.*|(attention|cross_attention)/out/bias|mlp/down/bias)",
     None),
)


def _shared_tied(config) -> dict:
    """Both stacks' embed_tokens are the shared embedding (older checkpoints store them too)."""
    return {"{prefix}encoder.embed_tokens.weight": "embeddings/word/embedding", "{prefix}decoder.embed_tokens.weight": "embeddings/word/embedding"}


_HEADS = (
    Head("lm", "ForConditionalGeneration", weight("final_logits_bias", "lm_head/bias", (1, "vocab_size")), markers=("final_logits_bias",),
         tied=lambda c: {"lm_head.weight": "embeddings/word/embedding"}, forward=True),
    Head("sequence_classification", "ForSequenceClassification",
         linear("classification_head.dense", "head/dense", "d_model", "d_model", reads=True)
         + linear("classification_head.out_proj", "head/out_proj", "d_model", "num_labels"),
         markers=("classification_head.dense.weight",), forward=True),
    Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", "d_model", 2, reads=True),
         markers=("qa_outputs.weight",), loss=False, forward=True),
)


def _derive(values: dict, raw) -> None:
    """BartConfig: each stack's heads divide d_model (BartAttention requires it); 3 labels unless
    config.json says otherwise."""
    if "num_labels" not in raw and raw.get("id2label") is None:
        values["num_labels"] = 3
    check_heads(values)


def check_heads(values: dict) -> None:
    for heads in ("encoder_attention_heads", "decoder_attention_heads"):
        if positive_ints(values, "d_model", heads) and values["d_model"] % values[heads]:
            raise InputError(f"d_model={values['d_model']} is not a multiple of {heads}={values[heads]} (BartAttention requires it)")


SCHEMA = ConfigSchema("bart", "BartConfig", {
    "vocab_size": (INT, 50265), "max_position_embeddings": (INT, 1024), "encoder_layers": (INT, 12), "encoder_ffn_dim": (INT, 4096),
    "encoder_attention_heads": (INT, 16), "decoder_layers": (INT, 12), "decoder_ffn_dim": (INT, 4096), "decoder_attention_heads": (INT, 16),
    "activation_function": (STR, "gelu"), "d_model": (INT, 1024), "init_std": (FLOAT, 0.02), "scale_embedding": (BOOL, False),
    "pad_token_id": (INT.optional(), 1), "bos_token_id": (INT.optional(), 0), "eos_token_id": (INT.optional(), 2),
    "decoder_start_token_id": (INT.optional(), 2), "tie_word_embeddings": (BOOL, True),
}, derive=_derive, aliases={"num_attention_heads": "encoder_attention_heads", "hidden_size": "d_model", "num_hidden_layers": "encoder_layers"})


def _derive_mbart(values: dict, raw) -> None:
    """MBartConfig: each stack's heads divide d_model."""
    check_heads(values)


MBART_SCHEMA = ConfigSchema("mbart", "MBartConfig", {**SCHEMA.fields, "decoder_start_token_id": (INT.optional(), None)}, derive=_derive_mbart,
                            aliases=SCHEMA.aliases)


@dataclasses.dataclass(frozen=True)
class EncoderDecoderFamily(Family):
    """A `Family` of two stacks: `layer` repeated `num_layers` times (the encoder's), then
    `decoder_layer` repeated `decoder_layers` times; its attention blocks are `BLOCKS`, each with
    its stack's heads."""

    decoder_layer: tuple[Tensor, ...] = ()
    decoder_layers: str = "decoder_layers"
    stack_ties: Callable[[Any], Mapping[str, str]] = lambda config: {}  # {HF name ("{prefix}..."): our leaf} every layout ties

    def _tables(self, config, layout: Layout):
        for t in self.embeddings:
            yield t, None, True
        for stack, count in ((self.layer, self.num_layers), (self.decoder_layer, self.decoder_layers)):
            for i in range(getattr(config, count)):
                for t in stack:
                    yield t, i, True
        for t in self.final:
            yield t, None, True
        head = self.head(layout.head)
        for t in head.tensors if head is not None else ():
            yield t, None, False

    def record_tensors(self) -> tuple[Tensor, ...]:
        return super().record_tensors() + self.decoder_layer

    def tied(self, config, layout: Layout) -> dict[str, str]:
        ties = {**self.stack_ties(config), **(head.tied(config) if (head := self.head(layout.head)) else {})}
        return {k.replace("{prefix}", layout.prefix): v for k, v in ties.items()}

    def final_read_by_head(self) -> list[str]:
        return [p for t in self.final for p in t.ours if p.startswith("decoder/")]

    def _tied_head_reads_final_norm(self, config, layout: Layout | None) -> bool:
        # the stacks' own ties (embed_tokens) read no norm: only a tied LM head, the shared embedding, reads the decoder's
        lm = next((h for h in self.heads if h.name == "lm"), None)
        return lm is not None and (layout is None or layout.head == "lm") and bool(lm.tied(config))

    def check(self, config) -> None:
        super().check(config)
        if not config.tie_word_embeddings:
            raise InputError("tie_word_embeddings=False (an LM head, or a stack's embedding, of its own) is not supported: "
                             f"rotsym_jax reads {self.name} with the embedding tied")

    def spec(self, config, layout: Layout | None = None) -> Spec:
        d = config.d_model
        encoder, decoder = (HeadGeometry(h, h, d // h) for h in (config.encoder_attention_heads, config.decoder_attention_heads))
        return Spec(self.rules + SPEC_RULES, heads={"encoder": encoder, "decoder": decoder, "cross": decoder},
                    residual=self.residual_spec(config, layout), optional=OPTIONAL)


BART = EncoderDecoderFamily(
    name="bart",
    configs=(SCHEMA,),
    stems={"bart": "Bart"},
    prefix="model.",
    marker="shared.weight",
    embeddings=(
        *embedding("shared.weight", "embeddings/word/embedding", "vocab_size", "d_model"),
        *embedding("encoder.embed_positions.weight", "embeddings/encoder_position/embedding", _positions, "d_model"),
        *norm("encoder.layernorm_embedding", "embeddings/encoder_norm", "d_model"),
        *embedding("decoder.embed_positions.weight", "embeddings/decoder_position/embedding", _positions, "d_model"),
        *norm("decoder.layernorm_embedding", "embeddings/decoder_norm", "d_model"),
    ),
    layer=stack_tensors("encoder", cross=False),
    decoder_layer=stack_tensors("decoder", cross=True),
    final=(),
    heads=_HEADS,
    norm=Norm("layernorm", placement="post"),
    num_layers="encoder_layers",
    stack_ties=_shared_tied,
    build=lambda config, layout, dtype, rngs: rj.nets.bart.Seq2Seq(config, layout, dtype, rngs=rngs),
    rules=RULES,
)


# mBART: BART's tensors with pre-LN layers (each sublayer reads its norm of the stream) and a final
# LayerNorm after each stack; the decoder starts from each example's last token (its language id).
MBART = dataclasses.replace(
    BART,
    name="mbart",
    configs=(MBART_SCHEMA,),
    stems={"mbart": "MBart"},
    final=(*norm("encoder.layer_norm", "encoder/final_norm", "d_model"), *norm("decoder.layer_norm", "decoder/final_norm", "d_model")),
    # Each norm folds into the kernels that read it (the encoder's final one into every cross-attention's
    # keys and values); the embedding norms' outputs are the streams themselves: a rotation needs them uniform.
    norm=Norm("layernorm", placement="pre", folds=(
        *((rf"{stack}/layers/(\d+)/attention_norm/scale", rf"{stack}/layers/\1/attention/(query|key|value)/kernel") for stack in ("encoder", "decoder")),
        *((rf"{stack}/layers/(\d+)/mlp_norm/scale", rf"{stack}/layers/\1/mlp/up/kernel") for stack in ("encoder", "decoder")),
        (r"decoder/layers/(\d+)/cross_attention_norm/scale", r"decoder/layers/\1/cross_attention/query/kernel"),
        (r"encoder/final_norm/scale", r"decoder/layers/\\d+/cross_attention/(key|value)/kernel"),  # a template (match.expand): its backslash doubled
        (r"decoder/final_norm/scale", r"head/(dense|qa_outputs)/kernel"),
        (r"embeddings/(encoder|decoder)_norm/scale", NO_READER),
    )),
    rules=RULES + ((r"(?:encoder|decoder)/final_norm/.*", None),),
)
