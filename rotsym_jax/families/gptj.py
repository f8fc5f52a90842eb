"""GPT-J: Phi's parallel layer (attention and MLP read one LayerNorm of the stream and both add to
it) without attention biases, and rotary embeddings on the first rotary_dim entries of each head
in the interleaved layout (pairs (2i, 2i + 1): `rotate_every_two`).

Our q and k kernels hold each head's rotary entries in the rotate_half order (pairs (i, i + r/2))
that every other family and the attention solvers use: the loader reorders their columns, the
saver restores GPT-J's. The same reordering of q and of k leaves every score as it was, and RoPE on
the reordered entries is GPT-J's RoPE reordered, so the groups and the forward pass are Phi's.

Leaves (d = n_embd, f = n_inner or 4 d, H = n_head, dh = d // H, r = rotary_dim):
    embeddings/word/embedding        (vocab_size, d)     transformer.wte
    layers/{i}/attention_norm/{scale,bias}   (d,)     ln_1 (read by attention and MLP)
    layers/{i}/attention/{query,key,value}/kernel (d, d)   attn.{q,k,v}_proj, no bias
    layers/{i}/attention/out/kernel  (d, d)              attn.out_proj, no bias
    layers/{i}/mlp/up/kernel (d, f), .../bias (f,)      mlp.fc_in
    layers/{i}/mlp/down/kernel (f, d), .../bias (d,)    mlp.fc_out
    final_norm/{scale,bias}          (d,)                transformer.ln_f
    task heads (all run here):
        lm                       GPTJForCausalLM: lm_head/kernel (d, V) and lm_head/bias (V,)
        sequence_classification  head/score (d, num_labels), no bias, on the last non-padding token
        question_answering       head/qa_outputs (d, 2): start and end logits
rotary_dim must be even and at most dh: transformers' GPT-J fails on anything else (its null
rotary_dim rotates by d / 2 frequencies, which fit a head only when there is one head).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from ..spec import HeadGeometry
from .config import BOOL, FLOAT, INT, STR, ConfigSchema, positive_ints
from .family import Family, Head, Norm, Tensor, embedding, interleaved_rotary, linear, norm, pre_norm_folds
from .phi import lm_tied, untied


def inner_width(config) -> int:
    return config.n_inner if config.n_inner is not None else 4 * config.n_embd


def head_geometry(config) -> HeadGeometry:
    heads = config.n_head
    return HeadGeometry(heads, heads, config.n_embd // heads, rotary_dim=config.rotary_dim)


def inv_freq(config) -> np.ndarray:
    """GPT-J's inverse frequencies (r/2,), in float32 as its sinusoid table computes them."""
    r = config.rotary_dim
    return (1.0 / (np.float32(10000.0) ** (np.arange(0, r, 2, dtype=np.float32) / np.float32(r)))).astype(np.float32)


def _head_width(config) -> int:
    return config.n_embd // config.n_head


# torch's (out, in) weight, transposed, its output columns in our rotary order; and back
ROTARY_PAIRS = interleaved_rotary("n_head", _head_width, "rotary_dim")


def _rotated(hf: str, ours: str) -> Tensor:
    return Tensor(f"{hf}.weight", (f"{ours}/kernel",), (("n_embd", "n_embd"),), (0,), ROTARY_PAIRS)


_A = "h.{i}.attn"
_LAYER = (
    *norm("h.{i}.ln_1", "layers/{i}/attention_norm", "n_embd"),
    _rotated(f"{_A}.q_proj", "layers/{i}/attention/query"),
    _rotated(f"{_A}.k_proj", "layers/{i}/attention/key"),
    *linear(f"{_A}.v_proj", "layers/{i}/attention/value", "n_embd", "n_embd", bias=False, reads=True),
    *linear(f"{_A}.out_proj", "layers/{i}/attention/out", "n_embd", "n_embd", bias=False, writes=True),
    *linear("h.{i}.mlp.fc_in", "layers/{i}/mlp/up", "n_embd", inner_width, reads=True),
    *linear("h.{i}.mlp.fc_out", "layers/{i}/mlp/down", inner_width, "n_embd", writes=True),
)

_LM = linear("lm_head", "lm_head", "n_embd", "vocab_size", reads=True)
_HEADS = (
    # The LM head merges like the body (not under head/); tied, its kernel is the embedding and its bias its own.
    Head("lm", "ForCausalLM", (dataclasses.replace(_LM[0], when=untied), _LM[1]), markers=("lm_head.bias",), tied=lm_tied, forward=True),
    Head("sequence_classification", "ForSequenceClassification", linear("score", "head/score", "n_embd", "num_labels", bias=False, reads=True),
         markers=("score.weight",), forward=True),
    Head("question_answering", "ForQuestionAnswering", linear("qa_outputs", "head/qa_outputs", "n_embd", 2, reads=True),
         markers=("qa_outputs.weight",), loss=False, forward=True),
)

# The one norm of a layer is read by Q/K/V and by the MLP's up projection.
_READERS = pre_norm_folds("up", r"(lm_head|head/(score|qa_outputs))")
_FOLDS = ((_READERS[0][0], r"layers/\1/(attention/(query|key|value)|mlp/up)/kernel"), _READERS[2])


def _derive(values: dict, raw) -> None:
    """GPTJConfig: the head width is n_embd / n_head; RoPE on an even rotary_dim <= that width."""
    if not positive_ints(values, "n_embd", "n_head"):
        return  # the loader's checks name the size
    d, heads, r = values["n_embd"], values["n_head"], values["rotary_dim"]
    if d % heads:
        raise InputError(f"n_embd={d} is not a multiple of n_head={heads} (GPTJAttention requires it)")
    if r is None or r <= 0 or r % 2 or r > d // heads:
        raise InputError(f"rotary_dim={r!r}: GPT-J's RoPE needs an even rotary_dim in (0, {d // heads}], the head width "
                         "(transformers' GPT-J fails on any other)")


SCHEMA = ConfigSchema("gptj", "GPTJConfig", {
    "vocab_size": (INT, 50400), "n_positions": (INT, 2048), "n_embd": (INT, 4096), "n_layer": (INT, 28), "n_head": (INT, 16),
    "rotary_dim": (INT.optional(), 64), "n_inner": (INT.optional(), None), "activation_function": (STR, "gelu_new"),
    "layer_norm_epsilon": (FLOAT, 1e-5), "initializer_range": (FLOAT, 0.02), "tie_word_embeddings": (BOOL, False),
    "pad_token_id": (INT.optional(), None),
}, derive=_derive, aliases={"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
                            "num_hidden_layers": "n_layer"})


GPTJ = Family(
    name="gptj",
    configs=(SCHEMA,),
    stems={"gptj": "GPTJ"},
    prefix="transformer.",
    marker="wte.weight",
    embeddings=embedding("wte.weight", "embeddings/word/embedding", "vocab_size", "n_embd"),
    layer=_LAYER,
    final=norm("ln_f", "final_norm", "n_embd"),
    heads=_HEADS,
    norm=Norm("layernorm", placement="pre", folds=_FOLDS),
    rotary="rotate_half",  # as our leaves hold it (the loader reorders GPT-J's pairs)
    num_layers="n_layer",
    build=lambda config, layout, dtype, rngs: rj.nets.phi.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=head_geometry,
    # Causal-mask buffers that older transformers versions saved with the weights.
    ignored=(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",),
)
