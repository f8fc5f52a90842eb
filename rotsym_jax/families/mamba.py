"""Mamba (model type mamba: state-spaces/mamba-*-hf, Falcon-Mamba's layout): a stack of selective
state-space mixers, each reading an RMSNorm of the residual stream, no attention.

A mixer (d = hidden_size, f = intermediate_size = expand d, N = state_size, r = time_step_rank):
    x, z = in_proj(h)                        two halves of f channels
    x = act(depthwise causal conv1d(x))      each channel its own kernel of conv_kernel taps
    dt, B, C = x_proj(x)                     r, N, N entries per token, read from every channel
    dt = softplus(dt_proj(dt))               one step per channel
    s_t = exp(dt A) s_{t-1} + dt B_t x_t     A = -exp(A_log): (f, N), a state of N per channel
    y = (C_t . s_t + D x) * silu(z)          out_proj(y) joins the stream
Every operation on the f channels is channel by channel, or a linear map reading or writing
them (x_proj's input, dt_proj's output, out_proj's input), so a permutation of the channels, the
same for x and z, leaves the function as it was (docs/MATH.md §17): our group "channels". The
state's N entries permute too (B's and C's columns of x_proj with A_log's columns): group "state";
and dt's r entries admit any invertible map between x_proj and dt_proj, of which we move the
permutations: group "time_step". Every leaf of those two carries the channels' axis as well: a
leaf of two permutation groups, each solved after the channels on B's leaves in their frame
(spec.PermGroup.after: the channels' assignment handed to them). Not moved: the state's scales (B's by s, C's by 1/s) and the time step's
maps past its permutations, which `left_out` names where inspect lists the groups.
The stream: pre-norm RMSNorm, so permutations, sign flips and (gains folded, the tied LM head
written untied) rotations.

Leaves (per layer i):
    embeddings/word/embedding        (vocab_size, d)     backbone.embeddings
    layers/{i}/mixer_norm/scale      (d,)                norm
    layers/{i}/mixer/in_x/kernel, in_gate/kernel (d, f) (+ biases with use_bias)   in_proj (2f, d)
    layers/{i}/mixer/conv/kernel     (f, conv_kernel), conv/bias (f,) with use_conv_bias   conv1d
    layers/{i}/mixer/x_dt/kernel (f, r), x_b/kernel, x_c/kernel (f, N)          x_proj (r + 2N, f)
    layers/{i}/mixer/dt_proj/kernel  (r, f), dt_proj/bias (f,)                     dt_proj
    layers/{i}/mixer/A_log (f, N), layers/{i}/mixer/D (f,)
    layers/{i}/mixer/out/kernel      (f, d) (+ bias with use_bias)                 out_proj
    final_norm/scale                 (d,)                backbone.norm_f
    task head (run here): lm, MambaForCausalLM's lm_head (tied to the embedding by default)
"""

from __future__ import annotations

import dataclasses
import math

import rotsym_jax as rj

from ..errors import InputError
from ..spec import Spec
from .config import BOOL, FLOAT, INT, STR, ConfigSchema, Kind
from .family import Convert, Family, Norm, Tensor, embedding, linear, norm, split_rows
from .llama._tensors import HEADS as LLAMA_HEADS

_L = r"layers/(?P<layer>\d+)"
_M, _MO = "layers.{i}.mixer", "layers/{i}/mixer"


def _bias(c) -> bool:
    return c.use_bias


def _conv_bias(c) -> bool:
    return c.use_conv_bias


# torch's Conv1d weight (f, 1, k) of a depthwise convolution <-> our (f, k)
_DEPTHWISE = Convert("depthwise", lambda a, c: (a[:, 0, :],), lambda t, c: t[0][:, None, :])

_LAYER = (
    *norm("layers.{i}.norm", "layers/{i}/mixer_norm", bias=False),
    Tensor(f"{_M}.in_proj.weight", (f"{_MO}/in_x/kernel", f"{_MO}/in_gate/kernel"), (("hidden_size", "intermediate_size"),) * 2, (0, 0),
           split_rows(("intermediate_size", "intermediate_size"))),
    Tensor(f"{_M}.in_proj.bias", (f"{_MO}/in_x/bias", f"{_MO}/in_gate/bias"), (("intermediate_size",),) * 2, (None, None),
           split_rows(("intermediate_size", "intermediate_size")), _bias),
    Tensor(f"{_M}.conv1d.weight", (f"{_MO}/conv/kernel",), (("intermediate_size", "conv_kernel"),), (None,), _DEPTHWISE),
    Tensor(f"{_M}.conv1d.bias", (f"{_MO}/conv/bias",), (("intermediate_size",),), (None,), when=_conv_bias),
    Tensor(f"{_M}.x_proj.weight", tuple(f"{_MO}/x_{p}/kernel" for p in ("dt", "b", "c")),
           (("intermediate_size", "time_step_rank"), ("intermediate_size", "state_size"), ("intermediate_size", "state_size")), (None,) * 3,
           split_rows(("time_step_rank", "state_size", "state_size"))),
    *linear(f"{_M}.dt_proj", f"{_MO}/dt_proj", "time_step_rank", "intermediate_size"),
    Tensor(f"{_M}.A_log", (f"{_MO}/A_log",), (("intermediate_size", "state_size"),), (None,)),
    Tensor(f"{_M}.D", (f"{_MO}/D",), (("intermediate_size",),), (None,)),
    *linear(f"{_M}.out_proj", f"{_MO}/out", "intermediate_size", "hidden_size", bias=_bias, writes=True),
)

# The mixer's channels, one permutation for x and z and everything that reads or writes them; the
# state's entries (B's and C's columns of x_proj, A_log's) and the time step's (x_proj's dt columns,
# dt_proj's rows) on those leaves' other axes, solved after the channels (spec.PermGroup.after).
_RULES = (
    (rf"{_L}/mixer/(in_x|in_gate)/kernel", (None, "channels")),
    (rf"{_L}/mixer/(in_x|in_gate)/bias", ("channels",)),
    (rf"{_L}/mixer/conv/kernel", ("channels", None)),
    (rf"{_L}/mixer/(conv|dt_proj)/bias", ("channels",)),
    (rf"{_L}/mixer/x_dt/kernel", ("channels", "time_step")),
    (rf"{_L}/mixer/x_(b|c)/kernel", ("channels", "state")),
    (rf"{_L}/mixer/dt_proj/kernel", ("time_step", "channels")),
    (rf"{_L}/mixer/A_log", ("channels", "state")),
    (rf"{_L}/mixer/D", ("channels",)),
    (rf"{_L}/mixer/out/kernel", ("channels", None)),
    (rf"{_L}/mixer/out/bias", None),
    (rf"{_L}/mixer_norm/scale", None),
)

_FOLDS = (
    (r"layers/(\d+)/mixer_norm/scale", r"layers/\1/mixer/(in_x|in_gate)/kernel"),
    (r"final_norm/scale", r"lm_head/kernel"),
)

_RANK = Kind('an int or "auto"', lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool)))


def _derive(values: dict, raw) -> None:
    """MambaConfig: intermediate_size = expand x hidden_size unless config.json names one (which
    transformers then keeps), the time-step rank ceil(d / 16) where 'auto'."""
    given = raw.get("intermediate_size")
    values["intermediate_size"] = given if INT.accepts(given) else int(values["expand"] * values["hidden_size"])
    if values["time_step_rank"] == "auto":
        values["time_step_rank"] = math.ceil(values["hidden_size"] / 16)
    for key in ("state_size", "conv_kernel", "time_step_rank", "intermediate_size"):
        if values[key] < 1:
            raise InputError(f"{key}={values[key]}: expected a positive size")
    if values["hidden_act"] != "silu":
        raise InputError(f"hidden_act={values['hidden_act']!r}: the mixer's convolution is run with silu only")


SCHEMA = ConfigSchema("mamba", "MambaConfig", {
    "vocab_size": (INT, 50280), "hidden_size": (INT, 768), "state_size": (INT, 16), "num_hidden_layers": (INT, 32),
    "layer_norm_epsilon": (FLOAT, 1e-5), "pad_token_id": (INT.optional(), 0), "expand": (INT, 2), "conv_kernel": (INT, 4),
    "use_bias": (BOOL, False), "use_conv_bias": (BOOL, True), "hidden_act": (STR, "silu"), "initializer_range": (FLOAT, 0.1),
    "time_step_rank": (_RANK, "auto"), "tie_word_embeddings": (BOOL, True),
}, derive=_derive, consumed=("intermediate_size",))  # read by _derive


# What the permutation groups' units are (`Spec.unit_names`), as `rotsym inspect` and `verify` name them
UNIT_NAMES = {"channels": "channel", "state": "state entry", "time_step": "time-step entry"}


@dataclasses.dataclass(frozen=True)
class MambaFamily(Family):
    """Mamba-1: what its spec leaves out, as `rotsym inspect` says it."""

    def spec(self, config, layout=None) -> Spec:
        """`Family.spec`, its permutation groups' units named (channels, state entries, time-step entries)."""
        return dataclasses.replace(super().spec(config, layout), unit_names=UNIT_NAMES)

    def left_out(self, config) -> tuple[str, ...]:
        return (
            f"the state's {config.state_size} entries are permuted, not scaled: B's rows by s and C's by 1/s keep the function too, "
            "but a permutation group scales a unit only where a gate is (docs/MATH.md §17)",
            f"the time step's {config.time_step_rank} entries are permuted, not mapped: any invertible map of them (x_proj's dt rows "
            "by M, dt_proj's columns by M^-1) keeps the function, but a permutation group holds permutations (and a gate's scales) "
            "only (docs/MATH.md §17)",
        )


MAMBA = MambaFamily(
    name="mamba",
    configs=(SCHEMA,),
    stems={"mamba": "Mamba"},
    prefix="backbone.",
    marker="embeddings.weight",
    embeddings=embedding("embeddings.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("norm_f", "final_norm", bias=False),
    heads=tuple(h for h in LLAMA_HEADS if h.name == "lm"),
    default_head="lm",  # a tied *ForCausalLM stores no lm_head.weight
    norm=Norm("rmsnorm", placement="pre", folds=_FOLDS),
    build=lambda config, layout, dtype, rngs: rj.nets.mamba.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=lambda config: None,
    rules=_RULES,
)
