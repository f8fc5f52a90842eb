"""Whisper: mBART's pre-LN encoder–decoder behind a convolutional front end. The encoder reads
log-mel features through two convolutions (GELU after each; the second halves the frames) and a
position table; the decoder reads tokens, its embedding tied to the LM head (`proj_out`).

Groups: each stack's self-attention and the cross-attention (keys without a bias), each stack's
FFN units, and the first convolution's output channels ("encoder_conv": the second convolution
reads them, through the GELU, which commutes with a permutation). The two streams share no
tensor: each is a residual group of its own ("encoder_residual": the front end's output, the
encoder's positions, layers and final norm, and every cross-attention's keys and values, which
read it; "decoder_residual": the rest), each moved by its own element.

Leaves (d = d_model, m = num_mel_bins):
    encoder/front/0/conv1/{kernel (m, 3, d), bias}, .../conv2/{kernel (d, 3, d), bias}   model.encoder.conv1, conv2
        (numbered as a one-layer stack, so that a streamed run holds the group's two convolutions together)
    embeddings/encoder_position/embedding   (max_source_positions, d)   encoder.embed_positions (sinusoids, saved)
    embeddings/word/embedding               (vocab_size, d)             decoder.embed_tokens (the LM head)
    embeddings/decoder_position/embedding   (max_target_positions, d)   decoder.embed_positions
    {encoder,decoder}/layers/{i}/...        as mBART's (attention, cross_attention, their norms, mlp, mlp_norm)
    {encoder,decoder}/final_norm            layer_norm
    task heads: lm (WhisperForConditionalGeneration: proj_out, tied). WhisperForAudioClassification
    and WhisperForCausalLM (one stack alone) are not read.
Inputs: input_features (B, m, 2 max_source_positions) and decoder_input_ids.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import rotsym_jax as rj

from .bart import MBART, RULES, check_heads, stack_tensors
from .config import BOOL, FLOAT, INT, STR, ConfigSchema
from .family import NO_READER, Convert, Head, Norm, Tensor, embedding, norm, weight

# torch's Conv1d weight (out, in, k) <-> our kernel (in, k, out): its input channels on axis 0, as a
# linear layer's, so that the channels conv2 reads are a permutation group's site (its recorded input)
CONV = Convert("conv1d", lambda a, c: (np.transpose(a, (1, 2, 0)),), lambda t, c: np.transpose(t[0], (2, 0, 1)))


def _conv(hf: str, ours: str, d_in, *, writes: bool) -> tuple[Tensor, ...]:
    return (Tensor(f"{hf}.weight", (f"{ours}/kernel",), ((d_in, 3, "d_model"),), (2 if writes else None,), CONV),
            *weight(f"{hf}.bias", f"{ours}/bias", ("d_model",), stream=0 if writes else None))


def _without_key_bias(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return tuple(t for t in tensors if not t.hf.endswith("k_proj.bias"))


_CONV_RULES = (
    (r"encoder/front/(?P<layer>0)/conv1/kernel", (None, None, "encoder_conv")),
    (r"encoder/front/(?P<layer>0)/conv1/bias", ("encoder_conv",)),
    (r"encoder/front/(?P<layer>0)/conv2/kernel", ("encoder_conv", None, None)),
    (r"encoder/front/(?P<layer>0)/conv2/bias", None),
    (r"(?:encoder|decoder)/final_norm/.*", None),
)


def _derive(values: dict, raw) -> None:
    """WhisperConfig: each stack's heads divide d_model."""
    check_heads(values)


SCHEMA = ConfigSchema("whisper", "WhisperConfig", {
    "vocab_size": (INT, 51865), "num_mel_bins": (INT, 80), "encoder_layers": (INT, 4), "encoder_attention_heads": (INT, 6),
    "decoder_layers": (INT, 4), "decoder_attention_heads": (INT, 6), "decoder_ffn_dim": (INT, 1536), "encoder_ffn_dim": (INT, 1536),
    "decoder_start_token_id": (INT, 50257), "activation_function": (STR, "gelu"), "d_model": (INT, 384), "init_std": (FLOAT, 0.02),
    "scale_embedding": (BOOL, False), "max_source_positions": (INT, 1500), "max_target_positions": (INT, 448),
    "pad_token_id": (INT.optional(), 50256), "bos_token_id": (INT.optional(), 50256), "eos_token_id": (INT.optional(), 50256),
    "tie_word_embeddings": (BOOL, True),
}, derive=_derive, aliases={"num_key_value_heads": "encoder_attention_heads", "num_attention_heads": "encoder_attention_heads",
                            "hidden_size": "d_model", "num_hidden_layers": "encoder_layers"})


WHISPER = dataclasses.replace(
    MBART,
    name="whisper",
    configs=(SCHEMA,),
    stems={"whisper": "Whisper"},
    marker="decoder.embed_tokens.weight",
    embeddings=(
        *_conv("encoder.conv1", "encoder/front/0/conv1", "num_mel_bins", writes=False),
        *_conv("encoder.conv2", "encoder/front/0/conv2", "d_model", writes=True),
        *embedding("encoder.embed_positions.weight", "embeddings/encoder_position/embedding", "max_source_positions", "d_model"),
        *embedding("decoder.embed_tokens.weight", "embeddings/word/embedding", "vocab_size", "d_model"),
        *embedding("decoder.embed_positions.weight", "embeddings/decoder_position/embedding", "max_target_positions", "d_model"),
    ),
    layer=_without_key_bias(stack_tensors("encoder", cross=False)),
    decoder_layer=_without_key_bias(stack_tensors("decoder", cross=True)),
    final=(*norm("encoder.layer_norm", "encoder/final_norm", "d_model"), *norm("decoder.layer_norm", "decoder/final_norm", "d_model")),
    heads=(Head("lm", "ForConditionalGeneration", (), tied=lambda c: {"proj_out.weight": "embeddings/word/embedding"}, forward=True),),
    # mBART's folds without its embedding norms: the streams start at the convolution and the token embedding
    norm=Norm("layernorm", placement="pre", folds=tuple(f for f in MBART.norm.folds if f[1] != NO_READER)),
    stack_ties=lambda config: {},
    build=lambda config, layout, dtype, rngs: rj.nets.whisper.Seq2Seq(config, layout, dtype, rngs=rngs),
    rules=RULES + _CONV_RULES,
    input="input_features",
    # the encoder's stream: its stack, its positions and what reads its output (every cross-attention's keys and values)
    streams=(("encoder_residual", r"encoder/.*|embeddings/encoder_position/.*|decoder/layers/\d+/cross_attention/(?:key|value)/kernel",
              "the front end writes it through a GELU (after conv2), which commutes with permutations alone"),
             ("decoder_residual", ".*")),
)
