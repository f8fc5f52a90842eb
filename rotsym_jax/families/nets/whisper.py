"""The Whisper forward pass in Flax NNX; its record is `families/whisper.py`. Its layers are mBART's
(`nets/bart.py`), its encoder fed by two convolutions over the log-mel frames."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ...errors import InputError
from ..family import Layout
from .bart import Stack, required
from .layers import attention_bias, embed, normal_init


class Conv(nnx.Module):
    """torch's Conv1d (kernel 3, padding 1) over (B, channels, frames), leaves kernel (in, 3, out) and
    bias. `site`: its input is activation matching's site of the channels it reads (the first
    convolution's, after the GELU), recorded (`record_dense_inputs`) as (B, frames, channels)."""

    record = False

    def __init__(self, d_in: int, d_out: int, stride: int, *, dtype, rngs, std, site: bool = False):
        self.stride, self.site = stride, site
        self.kernel = nnx.Param(normal_init(std)(rngs.params(), (d_in, 3, d_out), dtype))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype))

    def __call__(self, x):
        if self.record:
            self.sow(nnx.Intermediate, "inputs", jnp.transpose(x, (0, 2, 1)))
        y = jax.lax.conv_general_dilated(x, self.kernel[...], (self.stride,), [(1, 1)], dimension_numbers=("NCH", "IHO", "NCH"),
                                         precision=jax.lax.Precision.HIGHEST)
        return y + self.bias[...][None, :, None]


class Front(nnx.Module):
    """The two convolutions, a GELU after each; the second halves the frames."""

    def __init__(self, config, dtype, rngs):
        std = config.init_std
        self.conv1 = Conv(config.num_mel_bins, config.d_model, 1, dtype=dtype, rngs=rngs, std=std)
        self.conv2 = Conv(config.d_model, config.d_model, 2, dtype=dtype, rngs=rngs, std=std, site=True)

    def __call__(self, features):
        return jax.nn.gelu(self.conv2(jax.nn.gelu(self.conv1(features), approximate=False)), approximate=False)


class Encoder(Stack):
    """mBART's encoder stack fed by the front end (leaves front/0/...) and the position table."""

    def __init__(self, config, dtype, rngs):
        super().__init__(config, "encoder", dtype, rngs)
        self.front = nnx.List([Front(config, dtype, rngs)])

    def __call__(self, features, positions):
        x = self.front[0](features)
        x = jnp.transpose(x, (0, 2, 1)) + positions[None]
        return super().__call__(x, attention_bias(None, x.shape[1], causal=False))


class Embeddings(nnx.Module):
    def __init__(self, config, dtype, rngs):
        d, std = config.d_model, config.init_std
        self.encoder_position = embed(config.max_source_positions, d, dtype=dtype, rngs=rngs, std=std)
        self.word = embed(config.vocab_size, d, dtype=dtype, rngs=rngs, std=std)
        self.decoder_position = embed(config.max_target_positions, d, dtype=dtype, rngs=rngs, std=std)


class Seq2Seq(nnx.Module):
    def __init__(self, config, layout: Layout, dtype=jnp.float32, *, rngs: nnx.Rngs):
        if layout.pooler or layout.head not in (None, "lm"):
            raise InputError(f"whisper runs its base model and its LM, not {layout}")
        self.embeddings = Embeddings(config, dtype, rngs)
        self.encoder = Encoder(config, dtype, rngs)
        self.frames = 2 * config.max_source_positions
        self.decoder = Stack(config, "decoder", dtype, rngs)
        self.lm = layout.head == "lm"
        self.max_target = config.max_target_positions

    def __call__(self, input_features=None, decoder_input_ids=None, decoder_attention_mask=None):
        required(input_features, "input_features", "Whisper", "log-mel frames (examples, mel bins, frames) in its encoder")
        # transformers makes none: its decoder reads token ids only as given (or from labels, shifted)
        required(decoder_input_ids, "decoder_input_ids", "Whisper", "the decoder's token ids (examples, tokens) beside the encoder's "
                 "input_features, and makes none of its own")
        if input_features.shape[-1] != self.frames:
            raise InputError(f"input_features have {input_features.shape[-1]} frames; Whisper reads {self.frames} (2 max_source_positions)")
        t = decoder_input_ids.shape[1]
        if t > self.max_target:
            raise InputError(f"decoder_input_ids hold {t} tokens; the model has {self.max_target} positions")
        memory = self.encoder(input_features, self.embeddings.encoder_position.embedding[...])
        y = self.embeddings.word(decoder_input_ids) + self.embeddings.decoder_position.embedding[...][None, :t]
        everything = jnp.zeros((1, 1, t, memory.shape[1]), jnp.float32)  # Whisper masks no frame
        y = self.decoder(y, attention_bias(decoder_attention_mask, t, causal=True), memory, everything)
        out = {"last_hidden_state": y, "encoder_last_hidden_state": memory}
        if self.lm:
            out["logits"] = self.embeddings.word.attend(y)
        return out
