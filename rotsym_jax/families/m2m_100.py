"""M2M100 (M2M100ForConditionalGeneration, NLLB's checkpoints too): mBART's pre-LN encoder–decoder
(a final LayerNorm after each stack) without embedding norms, one word embedding shared by both
stacks and the LM head (tied; no final_logits_bias), scaled by sqrt(d_model) where
`scale_embedding` (the default), and fairseq's sinusoidal positions: a non-token's position counts
the tokens before it that are not padding, from pad_token_id + 1, and padding reads a zero row.

Groups: BART's (each stack's self-attention, the cross-attention, each stack's FFN units). The
residual stream stays where it is: the sinusoids are a buffer transformers builds and never saves
(persistent=False), so no permutation of the stream keeps the function.

Leaves (d = d_model): embeddings/word/embedding (vocab_size, d) model.shared; {encoder,decoder}/...
as mBART's. Task head: lm (the shared embedding, tied). M2M100ForCausalLM does not exist; the base
model M2M100Model is read.
"""

from __future__ import annotations

import rotsym_jax as rj

from .bart import MBART, check_heads
from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import NO_READER, Head, Norm, embedding
from .marian import MarianFamily

REFUSAL = ("the residual stream stays unmoved: each stack adds fixed sinusoidal positions to it, a buffer transformers builds "
           "and never saves (M2M100SinusoidalPositionalEmbedding.weights, persistent=False), so a permuted stream would no longer match them")


def _derive(values: dict, raw) -> None:
    """M2M100Config: each stack's heads divide d_model."""
    check_heads(values)


SCHEMA = ConfigSchema("m2m_100", "M2M100Config", {
    "vocab_size": (INT, 128112), "max_position_embeddings": (INT, 1024), "encoder_layers": (INT, 12), "encoder_ffn_dim": (INT, 4096),
    "encoder_attention_heads": (INT, 16), "decoder_layers": (INT, 12), "decoder_ffn_dim": (INT, 4096), "decoder_attention_heads": (INT, 16),
    "activation_function": (STR, "relu"), "d_model": (INT, 1024), "init_std": (FLOAT, 0.02), "scale_embedding": (BOOL, True),
    "pad_token_id": (INT.optional(), 1), "bos_token_id": (INT.optional(), 0), "eos_token_id": (INT.optional(), 2),
    "decoder_start_token_id": (INT.optional(), 2), "tie_word_embeddings": (BOOL, True),
}, derive=_derive, aliases={"num_attention_heads": "encoder_attention_heads", "hidden_size": "d_model", "num_hidden_layers": "encoder_layers"})


M2M_100 = MarianFamily(
    name="m2m_100",
    configs=(SCHEMA,),
    stems={"m2m_100": "M2M100"},
    prefix="model.",
    marker="shared.weight",
    embeddings=(*embedding("shared.weight", "embeddings/word/embedding", "vocab_size", "d_model"),),
    layer=MBART.layer,
    decoder_layer=MBART.decoder_layer,
    final=MBART.final,
    heads=(Head("lm", "ForConditionalGeneration", (), tied=lambda c: {"lm_head.weight": "embeddings/word/embedding"}, forward=True),),
    default_head="lm",
    norm=Norm("layernorm", placement="pre", folds=tuple(f for f in MBART.norm.folds if f[1] != NO_READER)),
    num_layers="encoder_layers",
    stack_ties=MBART.stack_ties,
    build=lambda config, layout, dtype, rngs: rj.nets.marian.Seq2Seq(config, layout, dtype, rngs=rngs),
    rules=MBART.rules,
    refusal=REFUSAL,
)
