"""Mamba-2 (model type mamba2: state-spaces/mamba2-*, Mamba-Codestral) and its mixer, which
Granite-4's hybrid (`granitemoehybrid.py`) shares.

A mixer (d = hidden_size; f = H heads x P channels; G groups of B/C with N state entries each):
    z, x, B, C, dt = in_proj(h)             rows f, f, G N, G N, H
    x, B, C = silu(depthwise conv1d(x, B, C))   each channel its own taps
    dt = clamp(softplus(dt + dt_bias)); A = -exp(A_log)   one per head
    s_t = exp(dt A) s + dt x_t B_t^T        per head (P, N); head h reads group h // (H / G)
    y = s_t C_t + D x_t                     per head
    out_proj(gain * rms_G(y * silu(z)))     the RMS over each group's f / G channels
docs/MATH.md §17 works out its symmetries (each checked in transformers by
tests/test_mamba2_symmetries.py). Ours: the heads permute within their group, each head's channels
among themselves: an experts block ("ssm": heads as experts, a head's channels as its units; dt's
rows, A_log, dt_bias and D move with their head as a router's row does; the G groups as routing
groups); where G = 1 the state's N entries permute in B and C alike (a permutation group "state";
with G > 1 each group's would need its own, which one leaf of G N rows cannot carry: left as is).

Leaves of a mixer under `ours` (per layer i):
    in_z/kernel, in_x/kernel (H, d, P)   in_b/kernel, in_c/kernel (d, G N)   in_dt/kernel (d, H)   in_proj
        (+ biases (H, P), (G N,), (H,) with the projection's bias)
    conv_x/kernel (H, P, k), conv_b/kernel, conv_c/kernel (G N, k) (+ biases)   conv1d
    A_log, D, dt_bias (H,)   norm/scale (H, P)   out/kernel (H, P, d) (+ bias (d,))   out_proj
"""

from __future__ import annotations

import dataclasses

import numpy as np

import rotsym_jax as rj

from ..errors import InputError
from ..spec import ExpertNames, Spec
from .config import BOOL, FLOAT, INT, STR, ConfigSchema, Kind
from .family import OPTIONAL, SPEC_RULES, Convert, Family, Norm, Tensor, embedding, norm
from .llama._tensors import HEADS as LLAMA_HEADS

_L = r"layers/(?P<layer>\d+)"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A mixer's sizes, which each model type's config names its own way."""

    heads: int
    head_dim: int
    groups: int
    state: int
    conv: int
    bias: bool
    conv_bias: bool
    limit: tuple | None  # time_step_limit (min, max) of softplus(dt)
    eps: float  # the gated norm's


def sizes(c) -> Sizes:
    """The mixer's sizes of a config (ours or transformers', Mamba2Config or GraniteMoeHybridConfig)."""
    limit = None if c.time_step_limit is None else tuple(c.time_step_limit)
    if c.model_type == "mamba2":
        return Sizes(c.num_heads, c.head_dim, c.n_groups, c.state_size, c.conv_kernel, c.use_bias, c.use_conv_bias, limit, c.layer_norm_epsilon)
    return Sizes(c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv, c.mamba_proj_bias, c.mamba_conv_bias, limit,
                 c.rms_norm_eps)


def inner(c) -> int:
    return sizes(c).heads * sizes(c).head_dim


def _gn(c) -> int:
    return sizes(c).groups * sizes(c).state


def _h(c) -> int:
    return sizes(c).heads


def _p(c) -> int:
    return sizes(c).head_dim


def _k(c) -> int:
    return sizes(c).conv


def _heads(a, c):
    """(f, ...) rows of the f channels -> (H, P, ...)."""
    return a.reshape(_h(c), _p(c), *a.shape[1:])


def _in_to_ours(a, c):
    f, gn = inner(c), _gn(c)
    z, x, b, cc, dt = np.split(a, np.cumsum([f, f, gn, gn])[:4], axis=0)
    if a.ndim == 1:
        return _heads(z, c), _heads(x, c), b, cc, dt
    return np.swapaxes(_heads(z, c), 1, 2), np.swapaxes(_heads(x, c), 1, 2), b.T, cc.T, dt.T


def _in_to_hf(t, c):
    z, x, b, cc, dt = t
    if z.ndim == 2:
        return np.concatenate([z.reshape(-1), x.reshape(-1), b, cc, dt])
    rows = lambda y: np.swapaxes(y, 1, 2).reshape(-1, y.shape[1])  # noqa: E731  (H, d, P) -> (f, d)
    return np.concatenate([rows(z), rows(x), b.T, cc.T, dt.T])


def _conv_to_ours(a, c):
    a = a[:, 0, :] if a.ndim == 3 else a  # torch's depthwise (channels, 1, k)
    x, b, cc = np.split(a, np.cumsum([inner(c), _gn(c)]), axis=0)
    return _heads(x, c), b, cc


def _conv_to_hf(t, c):
    x, b, cc = t
    out = np.concatenate([x.reshape(-1, *x.shape[2:]), b, cc])
    return out[:, None, :] if out.ndim == 2 else out


IN_PROJ = Convert("mamba2_in_proj", _in_to_ours, _in_to_hf)
CONV = Convert("mamba2_conv", _conv_to_ours, _conv_to_hf)
_PER_HEAD = Convert("per_head", lambda a, c: (_heads(a, c),), lambda t, c: t[0].reshape(-1))
_OUT = Convert("mamba2_out", lambda a, c: (_heads(a.T, c),), lambda t, c: t[0].reshape(-1, t[0].shape[-1]).T)

_IN_SHAPES = (((_h, "hidden_size", _p),) * 2 + (("hidden_size", _gn),) * 2 + (("hidden_size", _h),))
_IN_BIAS_SHAPES = (((_h, _p),) * 2 + ((_gn,),) * 2 + ((_h,),))
_CONV_SHAPES = ((_h, _p, _k), (_gn, _k), (_gn, _k))


def mixer(hf: str, ours: str) -> tuple[Tensor, ...]:
    """A Mamba-2 mixer's tensors under `hf` (e.g. layers.{i}.mixer) and our leaves under `ours`."""
    parts = ("z", "x", "b", "c", "dt")
    return (
        Tensor(f"{hf}.in_proj.weight", tuple(f"{ours}/in_{p}/kernel" for p in parts), _IN_SHAPES, (1, 1, 0, 0, 0), IN_PROJ),
        Tensor(f"{hf}.in_proj.bias", tuple(f"{ours}/in_{p}/bias" for p in parts), _IN_BIAS_SHAPES, (None,) * 5, IN_PROJ,
               lambda c: sizes(c).bias),
        Tensor(f"{hf}.conv1d.weight", tuple(f"{ours}/conv_{p}/kernel" for p in "xbc"), _CONV_SHAPES, (None,) * 3, CONV),
        Tensor(f"{hf}.conv1d.bias", tuple(f"{ours}/conv_{p}/bias" for p in "xbc"), (_CONV_SHAPES[0][:2], (_gn,), (_gn,)), (None,) * 3, CONV,
               lambda c: sizes(c).conv_bias),
        *(Tensor(f"{hf}.{p}", (f"{ours}/{p}",), ((_h,),), (None,)) for p in ("A_log", "D", "dt_bias")),
        Tensor(f"{hf}.norm.weight", (f"{ours}/norm/scale",), ((_h, _p),), (None,), _PER_HEAD),
        Tensor(f"{hf}.out_proj.weight", (f"{ours}/out/kernel",), ((_h, _p, "hidden_size"),), (2,), _OUT),
        Tensor(f"{hf}.out_proj.bias", (f"{ours}/out/bias",), (("hidden_size",),), (0,), when=lambda c: sizes(c).bias),
    )


def mixer_rules(at: str, state: bool) -> tuple:
    """The groups of the mixers under `layers/{i}/<at>`: the heads with their channels (experts block
    "ssm"), and with `state` (one group of B/C) the state's entries ("state"); else B, C stay."""
    m = rf"{_L}/{at}"
    state_tag = "state" if state else None
    return (
        (rf"{m}/in_(z|x)/kernel", ("ssm.expert", None, "ssm.unit")),
        (rf"{m}/(in_(z|x)|conv_x)/bias", ("ssm.expert", "ssm.unit")),
        (rf"{m}/norm/scale", ("ssm.expert", "ssm.unit")),
        (rf"{m}/(conv_x|out)/kernel", ("ssm.expert", "ssm.unit", None)),
        (rf"{m}/in_dt/kernel", (None, "ssm.expert")),
        (rf"{m}/(in_dt/bias|A_log|D|dt_bias)", ("ssm.expert",)),
        (rf"{m}/in_(b|c)/kernel", (None, state_tag)),
        (rf"{m}/(in_(b|c)|conv_(b|c))/bias", (state_tag,)),
        (rf"{m}/conv_(b|c)/kernel", (state_tag, None)),
        (rf"{m}/out/bias", None),
    )


# What the "ssm" block's experts, units and routing groups are, as inspect, verify and the notes say them.
SSM_NAMES = ExpertNames(expert="SSM head", unit="channel", router="their dt rows, A_log, dt_bias and D", groups="B/C groups",
                        block="the Mamba-2 mixers' SSM heads")


def mixer_left_out(config) -> tuple[str, ...]:
    m = sizes(config)
    if m.groups == 1:
        return ()
    return (f"no state group: the mixers' {m.groups} groups of B/C would each need a permutation of their own "
            f"({m.state} entries), and B's and C's leaves hold them all: B and C stay as they are (docs/MATH.md §17)",)


# transformers writes a float JSON cannot hold (time_step_limit's infinity) as {"__float__": "Infinity"}
_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf")}


def _limit_value(v):
    if isinstance(v, dict) and set(v) == {"__float__"} and v["__float__"] in _FLOAT_TAGS:
        return _FLOAT_TAGS[v["__float__"]]
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise InputError(f"time_step_limit entry {v!r}: expected a number")


def check_mixer(values: dict, names: dict) -> None:
    """The mixer's sizes (`names`: Sizes' field -> the config's key) as transformers requires them
    (positive, heads in whole groups); time_step_limit read as two floats, as transformers reads it."""
    for field in ("heads", "head_dim", "groups", "state", "conv"):
        value = values[names[field]]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{names[field]}={value!r}: expected a positive size")
    if values[names["heads"]] % values[names["groups"]]:
        raise InputError(f"{names['heads']}={values[names['heads']]} heads in {names['groups']}={values[names['groups']]} groups: "
                         "the heads must fill whole groups")
    limit = values["time_step_limit"]
    if limit is not None:
        if not isinstance(limit, (list, tuple)) or len(limit) != 2:
            raise InputError(f"time_step_limit={limit!r}: expected two numbers (min, max)")
        values["time_step_limit"] = tuple(_limit_value(v) for v in limit)


@dataclasses.dataclass(frozen=True)
class MixerFamily(Family):
    """A family with Mamba-2 mixers: the heads move within their B/C group (routing groups of "ssm")."""

    mixer_at: str = "mixer"

    def spec(self, config, layout=None) -> Spec:
        geometry = self.head_geometry(config)
        rules = mixer_rules(self.mixer_at, sizes(config).groups == 1) + self.rules + SPEC_RULES
        return Spec(rules, heads={} if geometry is None else {"attn": geometry}, residual=self.residual_spec(config, layout), optional=OPTIONAL,
                    routing_groups={"ssm": sizes(config).groups}, expert_names={"ssm": SSM_NAMES},
                    unit_names={"state": "state entry"})

    def left_out(self, config) -> tuple[str, ...]:
        return mixer_left_out(config)


_LAYER = (
    *norm("layers.{i}.norm", "layers/{i}/mixer_norm", bias=False),
    *mixer("layers.{i}.mixer", "layers/{i}/mixer"),
)

_FOLDS = (
    (r"layers/(\d+)/mixer_norm/scale", r"layers/\1/mixer/in_(z|x|b|c|dt)/kernel"),
    (r"final_norm/scale", r"lm_head/kernel"),
)

_LIMIT = Kind("two numbers", lambda v: isinstance(v, (list, tuple)) and len(v) == 2)


def _derive(values: dict, raw) -> None:
    """Mamba2Config: heads x head_dim must be expand x hidden_size; the mixer's sizes checked."""
    if values["num_heads"] * values["head_dim"] != values["expand"] * values["hidden_size"]:
        raise InputError(f"num_heads={values['num_heads']} x head_dim={values['head_dim']} differs from expand={values['expand']} x "
                         f"hidden_size={values['hidden_size']}: Mamba2Config requires them equal")
    if values["hidden_act"] != "silu":
        raise InputError(f"hidden_act={values['hidden_act']!r}: the mixer's convolution is run with silu only")
    check_mixer(values, dict(heads="num_heads", head_dim="head_dim", groups="n_groups", state="state_size", conv="conv_kernel"))


SCHEMA = ConfigSchema("mamba2", "Mamba2Config", {
    "vocab_size": (INT, 32768), "hidden_size": (INT, 4096), "state_size": (INT, 128), "num_hidden_layers": (INT, 64), "num_heads": (INT, 128),
    "head_dim": (INT, 64), "layer_norm_epsilon": (FLOAT, 1e-5), "pad_token_id": (INT.optional(), 1), "expand": (INT, 2), "conv_kernel": (INT, 4),
    "n_groups": (INT, 8), "use_bias": (BOOL, False), "use_conv_bias": (BOOL, True), "hidden_act": (STR, "silu"), "initializer_range": (FLOAT, 0.1),
    "time_step_limit": (_LIMIT, (0.0, float("inf"))), "tie_word_embeddings": (BOOL, False),
    "residual_in_fp32": (BOOL, True),
}, derive=_derive)


MAMBA2 = MixerFamily(
    name="mamba2",
    configs=(SCHEMA,),
    stems={"mamba2": "Mamba2"},
    prefix="backbone.",
    marker="embeddings.weight",
    embeddings=embedding("embeddings.weight", "embeddings/word/embedding", "vocab_size"),
    layer=_LAYER,
    final=norm("norm_f", "final_norm", bias=False),
    heads=tuple(h for h in LLAMA_HEADS if h.name == "lm"),
    default_head="lm",  # a tied *ForCausalLM stores no lm_head.weight
    norm=Norm("rmsnorm", placement="pre", folds=_FOLDS),
    build=lambda config, layout, dtype, rngs: rj.nets.mamba2.Decoder(config, layout, dtype, rngs=rngs),
    head_geometry=lambda config: None,
    rules=((rf"{_L}/mixer_norm/scale", None),),
)
