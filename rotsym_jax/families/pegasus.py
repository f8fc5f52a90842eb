"""Pegasus (PegasusForConditionalGeneration): mBART's pre-LN encoder–decoder (a final LayerNorm
after each stack) without embedding norms, its positions sinusoids (no offset) that transformers
saves and reads back as saved, token embeddings scaled by sqrt(d_model) where `scale_embedding`,
one word embedding shared by both stacks and the LM head.

Groups: BART's (each stack's self-attention, the cross-attention, each stack's FFN units) and the
residual stream (one permutation moves both stacks' streams, as BART's: the shared embedding writes
both), the position tables with it: they are saved tensors, so a permuted table is what
transformers loads.

Leaves (d = d_model): embeddings/word/embedding (vocab_size, d) model.shared;
embeddings/{encoder,decoder}_position/embedding (max_position_embeddings, d) embed_positions;
{encoder,decoder}/layers/{i}/... and {encoder,decoder}/final_norm as mBART's. Task head: lm (the
shared embedding, tied, and final_logits_bias as lm_head/bias). PegasusForCausalLM (the decoder
alone) is not read.

Blenderbot (`BLENDERBOT`) holds the same tensors, its position tables learned rather than sinusoids
(read from 0, as Pegasus's): the same record under BlenderbotConfig's defaults.
"""

from __future__ import annotations

import dataclasses

import rotsym_jax as rj

from .bart import MBART, check_heads
from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import NO_READER, Norm, embedding


def _derive(values: dict, raw) -> None:
    """PegasusConfig: each stack's heads divide d_model."""
    check_heads(values)


SCHEMA = ConfigSchema("pegasus", "PegasusConfig", {
    "vocab_size": (INT, 50265), "max_position_embeddings": (INT, 1024), "encoder_layers": (INT, 12), "encoder_ffn_dim": (INT, 4096),
    "encoder_attention_heads": (INT, 16), "decoder_layers": (INT, 12), "decoder_ffn_dim": (INT, 4096), "decoder_attention_heads": (INT, 16),
    "activation_function": (STR, "gelu"), "d_model": (INT, 1024), "init_std": (FLOAT, 0.02), "scale_embedding": (BOOL, False),
    "pad_token_id": (INT.optional(), 0), "eos_token_id": (INT.optional(), 1), "decoder_start_token_id": (INT.optional(), 0),
    "tie_word_embeddings": (BOOL, True),
}, derive=_derive, aliases={"num_attention_heads": "encoder_attention_heads", "hidden_size": "d_model", "num_hidden_layers": "encoder_layers"})


PEGASUS = dataclasses.replace(
    MBART,
    name="pegasus",
    configs=(SCHEMA,),
    stems={"pegasus": "Pegasus"},
    embeddings=(
        *embedding("shared.weight", "embeddings/word/embedding", "vocab_size", "d_model"),
        *embedding("encoder.embed_positions.weight", "embeddings/encoder_position/embedding", "max_position_embeddings", "d_model"),
        *embedding("decoder.embed_positions.weight", "embeddings/decoder_position/embedding", "max_position_embeddings", "d_model"),
    ),
    heads=MBART.heads[:1],
    # mBART's folds without its embedding norms: each stream starts at the sum of the word and position embeddings
    norm=Norm("layernorm", placement="pre", folds=tuple(f for f in MBART.norm.folds if f[1] != NO_READER)),
    build=lambda config, layout, dtype, rngs: rj.nets.marian.Seq2Seq(config, layout, dtype, rngs=rngs),
)


def _derive_blenderbot(values: dict, raw) -> None:
    """BlenderbotConfig: each stack's heads divide d_model."""
    check_heads(values)


BLENDERBOT_SCHEMA = ConfigSchema("blenderbot", "BlenderbotConfig", {
    "vocab_size": (INT, 8008), "max_position_embeddings": (INT, 128), "encoder_layers": (INT, 2), "encoder_ffn_dim": (INT, 10240),
    "encoder_attention_heads": (INT, 32), "decoder_layers": (INT, 24), "decoder_ffn_dim": (INT, 10240), "decoder_attention_heads": (INT, 32),
    "activation_function": (STR, "gelu"), "d_model": (INT, 2560), "init_std": (FLOAT, 0.02), "scale_embedding": (BOOL, False),
    "pad_token_id": (INT.optional(), 0), "bos_token_id": (INT.optional(), 1), "eos_token_id": (INT.optional(), 2),
    "decoder_start_token_id": (INT.optional(), 1), "tie_word_embeddings": (BOOL, True),
}, derive=_derive_blenderbot, aliases=SCHEMA.aliases)


# Blenderbot: Pegasus's tensors and layers, its positions learned (the same table, from 0), its defaults its own
BLENDERBOT = dataclasses.replace(PEGASUS, name="blenderbot", configs=(BLENDERBOT_SCHEMA,), stems={"blenderbot": "Blenderbot"})
