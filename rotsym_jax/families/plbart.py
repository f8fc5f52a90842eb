"""PLBART (plbart): BART's tensors and post-LN layers under `PLBartConfig`'s defaults (embeddings
scaled by sqrt(d_model), 6 layers a stack); without decoder inputs the decoder starts from each
example's last token that is not padding (its language id), as mBART's does. Heads: BART's
conditional generation and sequence classification; PLBART has no question-answering class, and
PLBartForCausalLM (the decoder alone) is not read. Groups: BART's (`families/bart.py`).
"""

from __future__ import annotations

import dataclasses

from .bart import BART, check_heads
from .config import BOOL, FLOAT, INT, STR, ConfigSchema


def _derive(values: dict, raw) -> None:
    """PLBartConfig: each stack's heads divide d_model."""
    check_heads(values)


SCHEMA = ConfigSchema("plbart", "PLBartConfig", {
    "vocab_size": (INT, 50005), "max_position_embeddings": (INT, 1024), "encoder_layers": (INT, 6), "encoder_ffn_dim": (INT, 3072),
    "encoder_attention_heads": (INT, 12), "decoder_layers": (INT, 6), "decoder_ffn_dim": (INT, 3072), "decoder_attention_heads": (INT, 12),
    "activation_function": (STR, "gelu"), "d_model": (INT, 768), "init_std": (FLOAT, 0.02), "scale_embedding": (BOOL, True),
    "pad_token_id": (INT.optional(), 1), "bos_token_id": (INT.optional(), 0), "eos_token_id": (INT.optional(), 2),
    "decoder_start_token_id": (INT.optional(), None), "tie_word_embeddings": (BOOL, True),
}, derive=_derive, aliases={"num_attention_heads": "encoder_attention_heads", "hidden_size": "d_model", "num_hidden_layers": "encoder_layers"})


PLBART = dataclasses.replace(
    BART,
    name="plbart",
    configs=(SCHEMA,),
    stems={"plbart": "PLBart"},
    heads=tuple(h for h in BART.heads if h.name != "question_answering"),
)
