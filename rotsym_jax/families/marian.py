"""Marian (MarianMTModel): BART's post-LN encoder–decoder without embedding norms, its positions
fixed sinusoids (no offset) that transformers computes and does not save, token embeddings scaled
by sqrt(d_model) where `scale_embedding`, and one vocabulary shared by both stacks
(`share_encoder_decoder_embeddings`, `model.shared`) or one per stack (`encoder.embed_tokens`,
`decoder.embed_tokens` of `decoder_vocab_size` rows); the LM head is tied to the decoder's.

Groups: BART's (each stack's self-attention, the cross-attention, each stack's FFN units). The
residual stream stays where it is: each stack adds its sinusoids to it, a table no element moves
(MarianMTModel rebuilds it on load: `_keys_to_ignore_on_save`), so no permutation of the stream
keeps the function.

Leaves (d = d_model): embeddings/word/embedding (vocab_size, d) shared, or the encoder's;
embeddings/decoder_word/embedding (decoder_vocab_size, d) where the vocabularies are separate;
{encoder,decoder}/layers/{i}/... as BART's. Task head: lm (MarianMTModel: the decoder's embedding,
tied, and final_logits_bias as lm_head/bias). MarianForCausalLM (the decoder alone) is not read.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from ..spec import Spec
from .bart import BART, RULES, EncoderDecoderFamily, check_heads
from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import Head, Layout, Tensor, weight

STREAM_REFUSAL = ("the residual stream stays unmoved: each stack adds fixed sinusoidal positions to it, which MarianMTModel "
                  "recomputes on load rather than saves (embed_positions.weight is in _keys_to_ignore_on_save), so a "
                  "permuted stream would no longer match them")


def _shared(config) -> bool:
    return bool(config.share_encoder_decoder_embeddings)


def _derive(values: dict, raw) -> None:
    """MarianConfig: decoder_vocab_size defaults to vocab_size (its __post_init__); heads divide d_model."""
    if values.get("decoder_vocab_size") is None:
        values["decoder_vocab_size"] = values["vocab_size"]
    check_heads(values)


SCHEMA = ConfigSchema("marian", "MarianConfig", {
    "vocab_size": (INT, 58101), "decoder_vocab_size": (INT.optional(), None), "max_position_embeddings": (INT, 1024),
    "encoder_layers": (INT, 12), "encoder_ffn_dim": (INT, 4096), "encoder_attention_heads": (INT, 16), "decoder_layers": (INT, 12),
    "decoder_ffn_dim": (INT, 4096), "decoder_attention_heads": (INT, 16), "activation_function": (STR, "gelu"), "d_model": (INT, 1024),
    "init_std": (FLOAT, 0.02), "scale_embedding": (BOOL, False), "pad_token_id": (INT.optional(), 58100),
    "eos_token_id": (INT.optional(), 0), "bos_token_id": (INT.optional(), None), "decoder_start_token_id": (INT.optional(), 58100),
    "share_encoder_decoder_embeddings": (BOOL, True), "tie_word_embeddings": (BOOL, True),
}, derive=_derive, aliases={"num_attention_heads": "encoder_attention_heads", "hidden_size": "d_model", "num_hidden_layers": "encoder_layers"})


def _stack_ties(config) -> dict:
    """With one vocabulary both stacks' embed_tokens are `shared` (transformers ties them)."""
    if not _shared(config):
        return {}
    return {"{prefix}encoder.embed_tokens.weight": "embeddings/word/embedding", "{prefix}decoder.embed_tokens.weight": "embeddings/word/embedding"}


def _lm_tied(config) -> dict:
    return {"lm_head.weight": "embeddings/word/embedding" if _shared(config) else "embeddings/decoder_word/embedding"}


def _lm_rows(config) -> int:
    return config.vocab_size if _shared(config) else config.decoder_vocab_size


# the sinusoids as MarianModel saves them; off the stream, which stays unmoved
POSITIONS = tuple(t for stack in ("encoder", "decoder") for t in weight(
    f"{stack}.embed_positions.weight", f"embeddings/{stack}_position/embedding", ("max_position_embeddings", "d_model")))


@dataclasses.dataclass(frozen=True)
class MarianFamily(EncoderDecoderFamily):
    """BART's two stacks; no residual stream (`refusal` says why). `base_positions`: the base
    model's checkpoints hold these position tables (MarianModel's), read and written back as they are."""

    refusal: str = STREAM_REFUSAL
    base_positions: tuple[Tensor, ...] = ()

    def _tables(self, config, layout: Layout):
        yield from super()._tables(config, layout)
        if layout.head is None:
            for t in self.base_positions:
                yield t, None, True

    def record_tensors(self) -> tuple[Tensor, ...]:
        return super().record_tensors() + self.base_positions

    def spec(self, config, layout: Layout | None = None) -> Spec:
        return dataclasses.replace(super().spec(config, layout), residual=None)

    def left_out(self, config) -> tuple[str, ...]:
        return (self.refusal,)


MARIAN = MarianFamily(
    name="marian",
    configs=(SCHEMA,),
    stems={"marian": "Marian"},
    prefix="model.",
    marker="encoder.layers.0.self_attn.q_proj.weight",
    embeddings=(
        *weight("shared.weight", "embeddings/word/embedding", ("vocab_size", "d_model"), stream=1, when=_shared),
        *weight("encoder.embed_tokens.weight", "embeddings/word/embedding", ("vocab_size", "d_model"), stream=1,
                when=lambda c: not _shared(c)),
        *weight("decoder.embed_tokens.weight", "embeddings/decoder_word/embedding", ("decoder_vocab_size", "d_model"), stream=1,
                when=lambda c: not _shared(c)),
    ),
    layer=BART.layer,
    decoder_layer=BART.decoder_layer,
    final=(),
    heads=(Head("lm", "MTModel", weight("final_logits_bias", "lm_head/bias", (1, _lm_rows)), markers=("final_logits_bias",),
                tied=_lm_tied, forward=True),),
    norm=BART.norm,
    num_layers="encoder_layers",
    stack_ties=_stack_ties,
    # the sinusoids where MarianMTModel's checkpoints hold them: transformers rebuilds them on load
    ignored=(r"(model\.)?(encoder|decoder)\.embed_positions\.weight",),
    build=lambda config, layout, dtype, rngs: rj.nets.marian.Seq2Seq(config, layout, dtype, rngs=rngs),
    rules=RULES,
    base_positions=POSITIONS,
)
