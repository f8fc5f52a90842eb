"""Group elements: typed pytrees of arrays over a group's layers, and their algebra.

A model's transform is a dict {group name: element}, one element per group of a bound spec:

    HeadTransform     an attention block (MATH.md §1): kv-group and query-head permutations, then
                      per-kv-group QK and VO rotations and scales in the permuted frame
    UnitPermutation   a permutation group (FFN hidden units): new unit j is old unit perm[l, j]
    ExpertPermutation a mixture of experts' block: the experts permuted (the router's outputs
                      with them), then each expert's hidden units
    ResidualTransform the residual stream (MATH §10), optional: a permutation of the width, then
                      an orthogonal matrix (None for a permutation alone); under the key "residual"

Each element knows how to act on its leaves' stacked views, to invert itself, to compose with
another element of its group, and to check that it is a group element (only those preserve the
function). The arrays are pytree children; an element has no static configuration.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import rotsym_jax as rj

from .errors import InputError
from .precision import exact, exact_jit
from .spec import (
    GAIN_ROLES,
    PERMUTED_ONLY_ROLES,
    RESIDUAL,  # noqa: F401  (re-exported: the transforms' key of the residual stream's element)
    ROPE_KEY_ROLE,
    ROPE_QUERY_ROLE,
    UNSCALED_QK_NORMS,
    AttentionBlock,
    BoundSpec,
    ExpertGroup,
    PermGroup,
    Spec,
    bind,
    signs_only,
)
from .spec_rules import UNIT_NORM_ROLE

ATTENTION_KINDS = ("heads", "qk", "vo", "qk_scale", "vo_scale")
KINDS = ATTENTION_KINDS + ("perm",)
# Invertible maps of Q/K and V/O (MATH §14): drawn only when asked (the closed forms solve the orthogonal group)
MAP_KINDS = ("qk_invertible", "vo_invertible")
# Each gated FFN unit's scale (MATH §1): drawn only when asked, as the weights method solves it only with ffn="scaled"
UNIT_KINDS = ("unit_scale",)
_SCALE_SIGN = {"q": 1, "k": -1, "v": 1, "o": -1, "qn": 1, "kn": -1}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadTransform:
    """The group element of one attention block, arrays over the block's L layers:

    group_perm (L, G) int32      new kv group g of B is old group group_perm[l, g]
    head_perm  (L, G, R) int32   new query slot r of group g is old slot head_perm[l, g, r]
    qk (L, G, dh, dh)            orthogonal; q and k head slices map x -> x @ qk[l, g]
    qk_scale (L, G)              q side * a, k side / a
    vo (L, G, dv, dv)            v slices x -> x @ vo; O rows W_o^h -> vo^T W_o^h (dv: the value width,
                                 `HeadGeometry.v_dim`, dh unless the block says otherwise)
    vo_scale (L, G)              v side * c, o side / c
    qk_inv, vo_inv (L, G, dh, dh), (L, G, dv, dv) or None: an invertible map (MATH §14): qk (or vo) is then any
                                 invertible M and these hold M^-T, which the k side (the o side)
                                 takes in its place; None: M orthogonal (M^-T = M)
    rope (L, r, r) or None       a RoPE key every head shares (`HeadGeometry.shared_rope_dim`, MLA):
                                 one 2-D rotation per rotary pair, x -> x @ rope on the key's rows
                                 and on every head's RoPE query (after the head permutations);
                                 None for blocks without one
    """

    group_perm: jax.Array
    head_perm: jax.Array
    qk: jax.Array
    qk_scale: jax.Array
    vo: jax.Array
    vo_scale: jax.Array
    qk_inv: jax.Array | None = None
    vo_inv: jax.Array | None = None
    rope: jax.Array | None = None

    @classmethod
    def identity(cls, block: AttentionBlock) -> HeadTransform:
        g, r, dh = block.geometry.role_shape("q")
        n, rd = len(block.layers), block.geometry.shared_rope_dim
        eye = _constant(np.eye(dh, dtype=np.float32), (n, g, dh, dh))
        dv = block.geometry.v_dim
        vo_eye = eye if dv == dh else _constant(np.eye(dv, dtype=np.float32), (n, g, dv, dv))
        return cls(
            rope=_constant(np.eye(rd, dtype=np.float32), (n, rd, rd)) if rd else None,
            group_perm=_constant(np.arange(g, dtype=np.int32), (n, g)),
            head_perm=_constant(np.arange(r, dtype=np.int32), (n, g, r)),
            qk=eye,
            qk_scale=_constant(np.float32(1), (n, g)),
            vo=vo_eye,
            vo_scale=_constant(np.float32(1), (n, g)),
        )

    def replace(self, **changes) -> HeadTransform:
        return dataclasses.replace(self, **changes)

    preserves_dtype = False  # rotations and scales act in float32 on low-precision weights

    def act_stacked(self, x, block: AttentionBlock, member):
        """Act on a member's stacked (L, rows, H*dh) leaves (`groups.stacked`)."""
        g, r, dh = block.geometry.role_shape(member.role)
        y = self.act(x.reshape(x.shape[0], x.shape[1], g, r, dh), member.role, block.geometry.qk_norm == "full")
        return y.reshape(x.shape[0], x.shape[1], -1)

    def act(self, x, role: str, scale_on_gains: bool = False):
        """Act on one role's (L, rows, G, R, dh) view. `scale_on_gains` (a full-width QK-norm):
        the QK scale multiplies the norm's gains (roles qn, kn), after the norm, where it is
        exact; on the kernels, before it, the norm's eps would make it approximate."""
        if role == ROPE_KEY_ROLE:  # the RoPE key every head shares: no head axis, the pairs' rotation alone
            return jnp.einsum("lngrd,lde->lngre", x, self.rope.astype(x.dtype))
        x = jnp.take_along_axis(x, self.group_perm[:, None, :, None, None], axis=2)
        if role in ("q", "o", "qn") + PERMUTED_ONLY_ROLES:
            x = jnp.take_along_axis(x, self.head_perm[:, None, :, :, None], axis=3)
        if role == ROPE_QUERY_ROLE:  # a head's RoPE query turns with the key it shares
            return jnp.einsum("lngrd,lde->lngre", x, self.rope.astype(x.dtype))
        if role in PERMUTED_ONLY_ROLES:  # a gate on the heads' outputs: VO's sign flips and scales pass through it
            return x
        if role in GAIN_ROLES:  # sign flips pass through the norm: only the scale
            return x * (self.qk_scale.astype(x.dtype) ** _SCALE_SIGN[role])[:, None, :, None, None]
        rot, scale = (self.qk, self.qk_scale) if role in ("q", "k") else (self.vo, self.vo_scale)
        inverse_transposed = {"k": self.qk_inv, "o": self.vo_inv}.get(role)
        if inverse_transposed is not None:  # an invertible map: the k (o) side takes M^-T
            rot = inverse_transposed
        x = jnp.einsum("lngrd,lgde->lngre", x, rot.astype(x.dtype))
        if role in ("q", "k") and scale_on_gains:
            return x
        scale = scale.astype(x.dtype) ** _SCALE_SIGN[role]
        return x * scale[:, None, :, None, None]

    def inverse(self) -> HeadTransform:
        inv = _inverse_perm(self.group_perm)  # new group j of the inverse is old group inv[j]
        t = lambda x: None if x is None else jnp.swapaxes(_take(x, inv, 1), -1, -2)  # noqa: E731
        # M^-1 = (M^-T)^T on the q (v) side, and (M^-1)^-T = M^T on the k (o) side
        return HeadTransform(
            group_perm=inv,
            head_perm=_inverse_perm(_take(self.head_perm, inv, 1)),
            qk=t(self.qk if self.qk_inv is None else self.qk_inv),
            qk_scale=1.0 / _take(self.qk_scale, inv, 1),
            vo=t(self.vo if self.vo_inv is None else self.vo_inv),
            vo_scale=1.0 / _take(self.vo_scale, inv, 1),
            qk_inv=None if self.qk_inv is None else t(self.qk),
            vo_inv=None if self.vo_inv is None else t(self.vo),
            rope=None if self.rope is None else jnp.swapaxes(self.rope, -1, -2),  # the heads' order does not touch it
        )

    def then(self, second: HeadTransform) -> HeadTransform:
        """The element equal to applying self, then `second`."""
        p2 = second.group_perm

        def inverses(first_map, first_inv, second_map, second_inv):  # (M1 M2)^-T = M1^-T M2^-T
            if first_inv is None and second_inv is None:
                return None
            first = first_map if first_inv is None else first_inv
            return _take(first, p2, 1) @ (second_map if second_inv is None else second_inv)

        return HeadTransform(
            group_perm=jnp.take_along_axis(self.group_perm, p2, axis=-1),
            head_perm=jnp.take_along_axis(_take(self.head_perm, p2, 1), second.head_perm, axis=-1),
            qk=_take(self.qk, p2, 1) @ second.qk,
            qk_scale=_take(self.qk_scale, p2, 1) * second.qk_scale,
            vo=_take(self.vo, p2, 1) @ second.vo,
            vo_scale=_take(self.vo_scale, p2, 1) * second.vo_scale,
            qk_inv=inverses(self.qk, self.qk_inv, second.qk, second.qk_inv),
            vo_inv=inverses(self.vo, self.vo_inv, second.vo, second.vo_inv),
            rope=None if self.rope is None else self.rope @ second.rope,  # head permutations commute with it
        )

    def condition_numbers(self) -> dict:
        """{"qk", "vo": the largest condition number of the block's maps (1 for orthogonal ones)}
        (concrete; read back)."""
        out = {}
        for name in ("qk", "vo"):
            inverse_transposed = getattr(self, f"{name}_inv")
            if inverse_transposed is None:
                out[name] = 1.0
                continue
            m = np.asarray(jax.device_get(getattr(self, name)), np.float64)
            out[name] = float(np.max(np.linalg.cond(m))) if m.size else 1.0
        return out

    def matching(self, other: HeadTransform) -> HeadTransform:
        """This element with the optional fields `other` holds filled in (an orthogonal map's
        inverse transpose is itself), so that the two are trees of one structure."""
        return self.replace(**{f: getattr(self, f[:2]) for f in ("qk_inv", "vo_inv")
                               if getattr(other, f) is not None and getattr(self, f) is None})

    def dual(self) -> HeadTransform:
        """The action on gradients, the inverse transpose of the action on params (MATH §13): an
        invertible map's sides swap (M <-> M^-T, an orthogonal one is its own), scales invert."""
        swapped = {name: value for name, inverse_transposed in (("qk", self.qk_inv), ("vo", self.vo_inv)) if inverse_transposed is not None
                   for name, value in ((name, inverse_transposed), (f"{name}_inv", getattr(self, name)))}
        return self.replace(qk_scale=1.0 / self.qk_scale, vo_scale=1.0 / self.vo_scale, **swapped)

    def squared(self) -> HeadTransform:
        """Every entry squared: `dual().squared()` acts on diagonal second moments."""
        inverses = {f"{n}_inv": getattr(self, f"{n}_inv") ** 2 for n in ("qk", "vo") if getattr(self, f"{n}_inv") is not None}
        rope = {} if self.rope is None else {"rope": self.rope**2}
        return self.replace(qk=self.qk**2, vo=self.vo**2, qk_scale=self.qk_scale**2, vo_scale=self.vo_scale**2, **inverses, **rope)

    def check(self, block: AttentionBlock, where: str) -> None:
        """ValueError unless every entry is a group element: permutations, orthogonal matrices
        (of the RoPE form on rotary blocks), positive finite scales. Reads the arrays back."""
        host = jax.device_get(self)
        for name in ("group_perm", "head_perm"):
            _check_permutations(getattr(host, name), f"{where}.{name}")
        for name in ("qk", "vo"):
            inverse_transposed = getattr(host, f"{name}_inv")
            if inverse_transposed is None:
                _check_orthogonal(getattr(host, name), f"{where}.{name}")
            else:
                _check_inverse_pair(getattr(host, name), inverse_transposed, f"{where}.{name}")
        if block.geometry.qk_norm and host.qk_inv is not None:
            kept = "only sign flips of rotary pairs" if block.geometry.qk_signs_only else "rotations but no other invertible map"
            raise InputError(f"{where}.qk is an invertible map, but q and k pass a QK-norm, which {kept} commute with: qk_inv must be None")
        if block.geometry.gated_output and host.vo_inv is not None:
            raise InputError(f"{where}.vo is an invertible map, but the heads' outputs are gated entry by entry, which only sign flips "
                             "and scales of V/O commute with: vo_inv must be None")
        if block.geometry.gated_output:
            _check_sign_form(host.vo, 0, f"{where}.vo", "gated V/O", "the heads' outputs are gated entry by entry (one gate per entry)")
        if host.rope is not None:
            _check_orthogonal(host.rope, f"{where}.rope")
            _check_rope_form(host.rope[..., rope_order(block.geometry), :][..., rope_order(block.geometry)], block.geometry.shared_rope_dim,
                             f"{where}.rope" + (" (in the rotate_half order of its interleaved pairs)" if block.geometry.shared_rope_interleaved else ""))
        if block.geometry.qk_signs_only:
            _check_sign_form(host.qk, block.geometry.rotary_dim or 0, f"{where}.qk")
        elif block.geometry.rotary_dim:
            _check_rope_form(host.qk, block.geometry.rotary_dim, f"{where}.qk")
        for name in ("qk_scale", "vo_scale"):
            scale = np.asarray(getattr(host, name))
            bad = ~(np.isfinite(scale) & (scale > 0))
            if bad.any():
                index = first_index(bad)
                raise InputError(f"{where}.{name}{list(index)} = {scale[index]}; scales must be finite and > 0")
        if block.geometry.qk_norm in UNSCALED_QK_NORMS and not np.all(np.asarray(host.qk_scale) == 1):
            index = first_index(np.asarray(host.qk_scale) != 1)
            raise InputError(f"{where}.qk_scale{list(index)} = {np.asarray(host.qk_scale)[index]}: under a per-head QK-norm no QK scale "
                             "keeps the function (the norm erases a kernel's scale only up to its eps, and a gain, where it has one, is "
                             "shared by every head); it must be 1")



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnitPermutation:
    """The group element of a permutation group: perm (L, n) int32, new unit j of layer l is old
    unit perm[l, j]; scale (L, n) or None (ones): then, in the permuted frame, unit j's scale s > 0,
    its NAME.in leaves (a gated FFN's up) times s and its NAME.out leaves (down) divided by s
    (MATH §1; only a group with `scaled` takes one); rotation (L, n, n) orthogonal or None: then,
    after the permutation, every leaf's units x -> x @ rotation, its norm's gain (role "norm",
    uniform: folded) permuted only (only a `rotatable` group takes one: MLA's latents, MATH §17)."""

    perm: jax.Array
    scale: jax.Array | None = None
    rotation: jax.Array | None = None

    @classmethod
    def identity(cls, group: PermGroup) -> UnitPermutation:
        return cls(_constant(np.arange(group.size, dtype=np.int32), (len(group.layers), group.size)))

    def replace(self, **changes) -> UnitPermutation:
        return dataclasses.replace(self, **changes)

    @property
    def preserves_dtype(self) -> bool:
        return self.scale is None and self.rotation is None  # a permutation is exact in any dtype; scales and rotations act in float32

    def act_stacked(self, x, group: PermGroup, member):
        x = self.act(x)
        if self.rotation is not None and member.role != UNIT_NORM_ROLE:  # a uniform gain commutes with it
            return jnp.einsum("lrn,lnm->lrm", x, self.rotation.astype(x.dtype))
        if self.scale is None or member.role in ("perm", UNIT_NORM_ROLE):
            return x
        scale = self.scale[:, None, :]
        return x * scale if member.role == "in" else x / scale

    def act(self, x):
        """Permute the last axis of a (L, rows, n) view."""
        return jnp.take_along_axis(x, self.perm[:, None, :], axis=2)

    def inverse(self) -> UnitPermutation:
        perm = _inverse_perm(self.perm)
        if self.rotation is not None:  # x = (y R^T)[..., inv]: a rotation alone, R^T with its columns permuted
            return UnitPermutation(_constant(np.arange(perm.shape[-1], dtype=np.int32), perm.shape),
                                   rotation=jnp.take_along_axis(jnp.swapaxes(self.rotation, -1, -2), perm[:, None, :], axis=-1))
        return UnitPermutation(perm, None if self.scale is None else 1 / jnp.take_along_axis(self.scale, perm, axis=-1))

    def then(self, second: UnitPermutation) -> UnitPermutation:
        if self.rotation is not None or second.rotation is not None:  # x[p1] R1 then [p2] R2: x[p1] R1[:, p2] R2
            if self.scale is not None or second.scale is not None:
                raise InputError("a unit permutation with a rotation composes only with others without scales (a rotatable group has none)")
            if self.rotation is None:
                return UnitPermutation(jnp.take_along_axis(self.perm, second.perm, axis=-1), rotation=second.rotation)
            first = jnp.take_along_axis(self.rotation, second.perm[:, None, :], axis=-1)
            return UnitPermutation(self.perm, rotation=first if second.rotation is None else first @ second.rotation)
        perm = jnp.take_along_axis(self.perm, second.perm, axis=-1)
        if self.scale is None and second.scale is None:
            return UnitPermutation(perm)
        first = jnp.ones(self.perm.shape, jnp.float32) if self.scale is None else jnp.take_along_axis(self.scale, second.perm, axis=-1)
        return UnitPermutation(perm, first if second.scale is None else first * second.scale)

    def matching(self, other: UnitPermutation) -> UnitPermutation:
        """This element with scales of ones (the identity rotation) where `other` holds scales (a
        rotation): one tree structure."""
        out = self.replace(scale=jnp.ones(other.scale.shape, other.scale.dtype)) if other.scale is not None and self.scale is None else self
        if other.rotation is not None and self.rotation is None:
            out = out.replace(rotation=_constant(np.eye(other.rotation.shape[-1], dtype=np.float32), other.rotation.shape))
        return out

    def dual(self) -> UnitPermutation:
        """The action on gradients: the permutation (and the rotation, orthogonal), the scales inverted."""
        return self if self.scale is None else self.replace(scale=1.0 / self.scale)

    def squared(self) -> UnitPermutation:
        out = self if self.scale is None else self.replace(scale=self.scale**2)
        return out if self.rotation is None else out.replace(rotation=self.rotation**2)

    def check(self, group: PermGroup, where: str) -> None:
        _check_permutations(jax.device_get(self.perm), f"{where}.perm")
        if self.rotation is not None:
            if not group.rotatable:
                raise InputError(f"{where}.rotation is given, but permutation group {group.name!r} has no norm gain to fold (Spec.unit_norms: "
                                 "MLA's latents), so only permutations of its units keep the function; it must be None")
            _check_orthogonal(jax.device_get(self.rotation), f"{where}.rotation")
        if self.scale is None:
            return
        if not group.scaled:
            raise InputError(f"{where}.scale is given, but permutation group {group.name!r} has no unit scales (a gated FFN's up and "
                             f"down leaves tagged {group.name}.in and {group.name}.out); it must be None")
        scale = np.asarray(jax.device_get(self.scale))
        bad = ~(np.isfinite(scale) & (scale > 0))
        if bad.any():
            index = first_index(bad)
            raise InputError(f"{where}.scale{list(index)} = {scale[index]}; scales must be finite and > 0")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExpertPermutation:
    """The group element of a mixture-of-experts block, over its L layers:

    perm  (L, E) int32     new expert e of B is old expert perm[l, e] (the router's output e with it)
    units (L, E, f) int32  new unit j of new expert e is unit units[l, e, j] of that old expert
    """

    perm: jax.Array
    units: jax.Array

    @classmethod
    def identity(cls, group: ExpertGroup) -> ExpertPermutation:
        n, e, f = len(group.layers), group.num_experts, group.units
        return cls(_constant(np.arange(e, dtype=np.int32), (n, e)), _constant(np.arange(f, dtype=np.int32), (n, e, f)))

    def replace(self, **changes) -> ExpertPermutation:
        return dataclasses.replace(self, **changes)

    preserves_dtype = True

    def act_stacked(self, x, group: ExpertGroup, member):
        """The router's (L, rows, E) view, or an expert leaf's (L, E, rows, f) (`groups.stacked`)."""
        if member.unit_axis is None:
            return jnp.take_along_axis(x, self.perm[:, None, :], axis=2)
        x = jnp.take_along_axis(x, self.perm[:, :, None, None], axis=1)
        return jnp.take_along_axis(x, self.units[:, :, None, :], axis=3)

    def inverse(self) -> ExpertPermutation:
        inv = _inverse_perm(self.perm)
        return ExpertPermutation(inv, _inverse_perm(_take(self.units, inv, 1)))

    def then(self, second: ExpertPermutation) -> ExpertPermutation:
        return ExpertPermutation(jnp.take_along_axis(self.perm, second.perm, axis=-1),
                                 jnp.take_along_axis(_take(self.units, second.perm, 1), second.units, axis=-1))

    def matching(self, other: ExpertPermutation) -> ExpertPermutation:
        return self  # no optional field

    def dual(self) -> ExpertPermutation:
        return self  # a permutation's inverse transpose is itself

    def squared(self) -> ExpertPermutation:
        return self

    def check(self, group: ExpertGroup, where: str) -> None:
        host = jax.device_get(self)
        _check_permutations(host.perm, f"{where}.perm")
        _check_permutations(host.units, f"{where}.units")




@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResidualTransform:
    """The basis change T of the residual stream: every stream axis x becomes x[..., perm] @
    rotation (rotation None: a permutation alone, which is what LayerNorm allows; a diagonal of
    +-1: sign flips, which RMSNorm allows wherever its gains sit). perm (d,) int32: new coordinate
    j is old coordinate perm[j]; rotation (d, d) orthogonal or None."""

    perm: jax.Array
    rotation: jax.Array | None = None

    @classmethod
    def identity(cls, stream) -> ResidualTransform:
        """The identity of a bound `spec.ResidualStream` (as every element's `identity(group)`)."""
        return cls(_constant(np.arange(stream.size, dtype=np.int32), (stream.size,)))

    def replace(self, **changes) -> ResidualTransform:
        return dataclasses.replace(self, **changes)

    def act(self, x, axis: int):
        """Transform axis `axis` of a leaf."""
        x = jnp.take(x, self.perm, axis=axis)
        if self.rotation is None:
            return x
        dtype = jnp.promote_types(x.dtype, jnp.float32)  # bfloat16 weights rotate in float32
        y = jnp.moveaxis(x, axis, -1).astype(dtype) @ self.rotation.astype(dtype)
        return jnp.moveaxis(y, -1, axis).astype(x.dtype)

    def matrix(self):
        """T as a (d, d) matrix: x T equals `act` on the last axis."""
        t = jax.nn.one_hot(self.perm, self.perm.shape[-1], dtype=jnp.float32, axis=0)
        return t if self.rotation is None else t @ self.rotation

    def inverse(self) -> ResidualTransform:
        inv = _inverse_perm(self.perm)
        if self.rotation is None:
            return ResidualTransform(inv)
        # x = (y R^T)[..., inv]: a rotation alone, R^T with its columns permuted.
        return ResidualTransform(jnp.arange(self.perm.shape[-1], dtype=jnp.int32), self.rotation.T[:, inv])

    def then(self, second: ResidualTransform) -> ResidualTransform:
        if self.rotation is None:
            return ResidualTransform(self.perm[second.perm], second.rotation)
        rotation = self.rotation[:, second.perm]
        return ResidualTransform(self.perm, rotation if second.rotation is None else rotation @ second.rotation)

    def matching(self, other: ResidualTransform) -> ResidualTransform:
        """This element with the identity rotation where `other` holds a rotation (one tree structure)."""
        return self.replace(rotation=jnp.eye(self.perm.shape[-1])) if other.rotation is not None and self.rotation is None else self

    def dual(self) -> ResidualTransform:
        return self  # orthogonal: its inverse transpose is itself

    def squared(self) -> ResidualTransform:
        return self if self.rotation is None else self.replace(rotation=self.rotation**2)

    def check(self, stream, where: str) -> None:
        _check_permutations(jax.device_get(self.perm), f"{where}.perm")
        if self.rotation is not None:
            rotation = jax.device_get(self.rotation)
            r = np.asarray(rotation, np.float64)
            signed = bool(np.all(r == np.diag(np.diagonal(r))) and np.all(np.abs(np.diagonal(r)) == 1))
            if stream.placement != "pre" and not (signed and stream.norm == "rmsnorm"):
                raise InputError(f"{where} has a rotation, but the residual stream passes norm gains, which commute only with permutations"
                                 + (" and, under RMSNorm, sign flips" if stream.norm == "rmsnorm" else ""))
            _check_orthogonal(rotation, f"{where}.rotation")
            if stream.norm == "layernorm":  # it must keep the mean over the width: T 1 = 1
                sums = np.asarray(rotation, np.float64).sum(axis=1)
                if not np.allclose(sums, 1.0, atol=1e-3):
                    raise InputError(f"{where}.rotation does not fix the ones vector (row sums {sums.min():.4g} to {sums.max():.4g}): "
                                     "LayerNorm centres the width, so only rotations with T 1 = 1 keep the function (rj.random_residual draws them)")


# ---- whole-model transforms ------------------------------------------------------------------------

def identity_transform(bound: BoundSpec) -> dict:
    """{group name: identity element} for every group of the bound spec (each its kind's element:
    `rj.kinds`, which sits above this module and is reached through the package's lazy attribute)."""
    return {group.name: rj.kinds.of(group).element.identity(group) for group in bound.groups}


@exact
def invert_transform(transforms: dict) -> dict:
    """The transform that undoes `transforms` (apply(apply(p, t), invert(t)) == p)."""
    return {name: t.inverse() for name, t in transforms.items()}


@exact
def compose_transforms(first: dict, second: dict) -> dict:
    """The transform equal to applying `first`, then `second` (a group's element missing from one
    of them, as the residual stream's may be, is the identity)."""
    return {name: first[name].then(second[name]) if name in first and name in second else first.get(name, second.get(name))
            for name in {**first, **second}}


# The random draws below are one program per shape: eagerly, each of their operations compiled a
# program of its own per shape (five for a Haar rotation), for every model a test run draws for.
@functools.partial(exact_jit, static_argnums=(1, 2, 3))
def random_orthogonal(key, shape, n, dtype=jnp.float32):
    """Haar-distributed orthogonal matrices (QR of a Gaussian with the sign fix)."""
    q, r = jnp.linalg.qr(jax.random.normal(key, (*shape, n, n), dtype))
    return q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[..., None, :]


def rope_order(geometry) -> np.ndarray:
    """The shared RoPE key's entries in rotate_half order (pairs (i, i + r/2)): entry i of that order
    is entry order[i] as stored (interleaved pairs (2i, 2i + 1): evens, then odds)."""
    r = geometry.shared_rope_dim
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)]) if geometry.shared_rope_interleaved else np.arange(r)


def shared_rope_rotation(angles, geometry):
    """`rope_rotation` of the shared RoPE key's pairs by `angles` (..., r/2), in the order they are stored."""
    half_order = rope_rotation(angles, geometry.shared_rope_dim, geometry.shared_rope_dim)
    inverse = np.argsort(rope_order(geometry))
    return half_order[..., inverse, :][..., inverse]


@functools.partial(exact_jit, static_argnums=(1, 2))
def rope_rotation(angles, head_dim, rotary_dim):
    """Block rotations of the rotary pairs (i, i + rotary_dim/2) by `angles` (..., rotary_dim/2),
    acting as x @ R; identity on the dims past rotary_dim."""
    half = rotary_dim // 2
    i = jnp.arange(half)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    eye = jnp.broadcast_to(jnp.eye(head_dim, dtype=angles.dtype), (*angles.shape[:-1], head_dim, head_dim))
    r = eye.at[..., i, i].set(cos).at[..., i + half, i + half].set(cos)
    return r.at[..., i, i + half].set(sin).at[..., i + half, i].set(-sin)


def random_transform(spec: Spec | BoundSpec, params, key, kinds=KINDS, *, max_log_scale=0.7) -> dict:
    """A random group element of every requested kind (others identity).

    kinds: subset of "heads" (kv-group and query-head permutations), "qk", "vo" (Haar rotations;
    RoPE blocks draw their QK rotation from SO(2)^(pairs) x O(rest), QK-norm blocks with gains random sign
    flips of pairs and of the entries past them; blocks whose heads' outputs are gated their VO
    sign flips of each entry), "qk_scale", "vo_scale"
    (log-uniform in [-max_log_scale, max_log_scale]), "perm" (every permutation group, and every
    experts block: its experts and each expert's units); and, asked by name (`MAP_KINDS`),
    "qk_invertible", "vo_invertible": the rotation (or identity) times a symmetric positive
    stretch exp(S), S symmetric with N(0, (max_log_scale / 2)^2) entries (RoPE blocks: one scale per
    rotary pair and any stretch of the rest; none under a QK-norm); "unit_scale" (`UNIT_KINDS`): each
    unit's scale of every gated permutation group, log-uniform as the head scales.
    """
    unknown = set(kinds) - set(KINDS) - set(MAP_KINDS) - set(UNIT_KINDS)
    if unknown:
        raise InputError(f"unknown transform kinds {sorted(unknown)}; choose from {KINDS + MAP_KINDS + UNIT_KINDS}")
    bound = bind(spec, params)
    out = identity_transform(bound)
    for block in bound.attention:
        key, *ks = jax.random.split(key, 9)
        t = {}
        geo = block.geometry
        n, g, r, dh, dv = len(block.layers), geo.num_kv_heads, geo.heads_per_group, geo.head_dim, geo.v_dim
        if "heads" in kinds and not geo.fixed_order:
            t["group_perm"] = _random_perms(ks[0], (n,), g)
            t["head_perm"] = _random_perms(ks[1], (n, g), r)
        if "qk" in kinds and signs_only(geo.qk_norm):  # sign flips: one per rotary pair, one per entry past it
            rd = geo.rotary_dim or 0
            flips = _random_signs(ks[3], (n, g, dh - rd // 2))
            flips = jnp.concatenate([flips[..., : rd // 2], flips], axis=-1)
            t["qk"] = flips[..., None, :] * jnp.eye(dh, dtype=jnp.float32)
        elif "qk" in kinds:
            if geo.rotary_dim is None:
                t["qk"] = random_orthogonal(ks[2], (n, g), dh)
            else:
                rd = geo.rotary_dim
                angles = jax.random.uniform(ks[3], (n, g, rd // 2), minval=-np.pi, maxval=np.pi)
                rot = rope_rotation(angles, dh, rd)
                if rd < dh:
                    rest = random_orthogonal(ks[4], (n, g), dh - rd)
                    rot = rot.at[..., rd:, rd:].set(rest)
                t["qk"] = rot
        if "qk" in kinds and geo.shared_rope_dim:  # the shared RoPE key's pairs, with every head's RoPE query
            key, k = jax.random.split(key)
            t["rope"] = shared_rope_rotation(jax.random.uniform(k, (n, geo.shared_rope_dim // 2), minval=-np.pi, maxval=np.pi), geo)
        if "vo" in kinds and geo.gated_output:  # sign flips of each entry
            t["vo"] = _random_signs(ks[5], (n, g, dv))[..., None, :] * jnp.eye(dv, dtype=jnp.float32)
        elif "vo" in kinds:
            t["vo"] = random_orthogonal(ks[5], (n, g), dv)
        key, k_qk, k_vo = jax.random.split(key, 3)
        for name, k in (("qk", k_qk), ("vo", k_vo)):
            if f"{name}_invertible" in kinds and not (name == "qk" and geo.qk_norm) and not (name == "vo" and geo.gated_output):
                width = dh if name == "qk" else dv
                log = stretch_form(_symmetric(jax.random.normal(k, (n, g, width, width)) * max_log_scale / 2), geo.rotary_dim if name == "qk" else None)
                rot = t.get(name, out[block.name].qk if name == "qk" else out[block.name].vo)
                t[name], t[f"{name}_inv"] = rot @ symmetric_exp(log), rot @ symmetric_exp(-log)
        for kind, k in (("qk_scale", ks[6]), ("vo_scale", ks[7])):
            if kind in kinds and not (kind == "qk_scale" and geo.qk_norm in UNSCALED_QK_NORMS):  # a per-head QK-norm has no QK scale
                t[kind] = jnp.exp(jax.random.uniform(k, (n, g), minval=-max_log_scale, maxval=max_log_scale))
        out[block.name] = out[block.name].replace(**t)
    for group in bound.perms:
        perm, scale = out[group.name].perm, None
        if "perm" in kinds:
            key, k = jax.random.split(key)
            perm = _random_perms(k, (len(group.layers),), group.size)
        if "unit_scale" in kinds and group.scaled:
            key, k = jax.random.split(key)
            scale = jnp.exp(jax.random.uniform(k, perm.shape, minval=-max_log_scale, maxval=max_log_scale))
        out[group.name] = UnitPermutation(perm, scale)
    if "perm" in kinds:
        for group in bound.experts:
            key, k1, k2 = jax.random.split(key, 3)
            n = len(group.layers)
            out[group.name] = ExpertPermutation(_random_block_perms(k1, n, group.num_experts, group.routing_groups),
                                                _random_perms(k2, (n, group.num_experts), group.units))
    return out


def stretch_form(log, rotary_dim):
    """A symmetric log-stretch (..., dh, dh) projected onto those whose exponential commutes with
    RoPE (`rotary_dim` None: unchanged): on the rotary dims one scale per pair (i, i + rotary_dim/2),
    their mean, and no coupling to the other dims, which keep any."""
    if not rotary_dim:
        return log
    half = rotary_dim // 2
    i = jnp.arange(half)
    pair = (log[..., i, i] + log[..., i + half, i + half]) / 2
    out = log.at[..., :rotary_dim, :].set(0).at[..., :, :rotary_dim].set(0)
    return out.at[..., i, i].set(pair).at[..., i + half, i + half].set(pair)


def symmetric_exp(log, max_norm: float | None = None):
    """exp(S) of symmetric S (..., n, n), symmetric positive definite: a Taylor series of S / 2^k,
    squared k times, with k such that the scaled Frobenius norm is at most 1/2 (the series' error
    then below 1e-12). Matmuls only: a LAPACK call (an eigendecomposition, Pade's solve) beside
    another in one program can deadlock XLA:CPU (solvers.procrustes), and an eigendecomposition's
    derivative is undefined where eigenvalues repeat (at S = 0). `max_norm`: a bound on ||S||_F that
    sets k statically (inside jit); None reads it from S, which must then be concrete."""
    if max_norm is None:
        max_norm = float(np.max(np.sqrt(np.sum(np.square(np.asarray(log, np.float64)), axis=(-2, -1))), initial=0.0))
    squarings = max(0, math.ceil(math.log2(max_norm / 0.5))) if max_norm > 0.5 else 0
    x = log / 2.0**squarings
    eye = jnp.broadcast_to(jnp.eye(log.shape[-1], dtype=log.dtype), log.shape)
    term, out = eye, eye
    for i in range(1, 11):
        term = term @ x / i
        out = out + term
    for _ in range(squarings):
        out = out @ out
    return out


def _symmetric(x):
    return (x + jnp.swapaxes(x, -1, -2)) / 2


# ---- helpers ---------------------------------------------------------------------------------------

def _constant(x: np.ndarray, shape) -> jax.Array:
    """`x` broadcast to `shape`, built on the host and sent to the device: a constant built by jnp
    ops compiles a small program per op and shape (a quarter of a second for roberta-base's
    identity transforms in a fresh process). Copied on the host first: `jnp.asarray` of a
    broadcast view stages the broadcast as a program of its own, one per shape."""
    return jax.device_put(np.asarray(np.broadcast_to(x, shape), order="C"))


def _random_block_perms(key, layers, n, blocks):
    """(layers, n) permutations that keep each of `blocks` runs of n / blocks consecutive entries in place."""
    size = n // blocks
    within = _random_perms(key, (layers, blocks), size) + (jnp.arange(blocks, dtype=jnp.int32) * size)[:, None]
    return within.reshape(layers, n)


@functools.partial(exact_jit, static_argnums=(1,))
def _random_signs(key, shape):
    """+-1 (float32), each with probability 1/2."""
    return jnp.where(jax.random.bernoulli(key, 0.5, shape), -1.0, 1.0)


@functools.partial(exact_jit, static_argnums=(1, 2))
def _random_perms(key, batch, n):
    keys = jax.random.split(key, int(np.prod(batch)) or 1)
    perms = jax.vmap(lambda k: jax.random.permutation(k, n))(keys)
    return perms.reshape(*batch, n).astype(jnp.int32)


def _inverse_perm(p):
    return jnp.argsort(p, axis=-1).astype(jnp.int32)


def _take(x, index, axis):
    """x[..., index[...], ...] along `axis` for a per-layer index array (L, n)."""
    index = index.reshape(index.shape + (1,) * (x.ndim - index.ndim))
    return jnp.take_along_axis(x, index, axis=axis)


def first_index(bad) -> tuple:
    """Index of the first True entry: the element named in an error."""
    return tuple(int(i) for i in np.argwhere(bad)[0])


def _check_permutations(p, where):
    p = np.asarray(p)
    if not np.issubdtype(p.dtype, np.integer):
        raise InputError(f"{where} has dtype {p.dtype}; permutations are integer index arrays")
    n = p.shape[-1]
    bad = np.any(np.sort(p, axis=-1) != np.arange(n), axis=-1)
    if bad.any():
        index = first_index(bad)
        raise InputError(f"{where}{list(index)} = {p[index].tolist()[:16]} is not a permutation of 0..{n - 1}")


def _orthogonality_tol(dtype) -> float:
    return max(1e-4, 10 * float(np.finfo(dtype).eps)) if np.issubdtype(dtype, np.floating) else 1e-4


def _check_orthogonal(r, where):
    tol = _orthogonality_tol(np.asarray(r).dtype)
    r = np.asarray(r, np.float64)
    err = np.max(np.abs(np.swapaxes(r, -1, -2) @ r - np.eye(r.shape[-1])), axis=(-2, -1))
    bad = ~(err <= tol)  # NaN included
    if bad.any():
        index = first_index(bad)
        raise InputError(f"{where}{list(index)} is not orthogonal (max |R^T R - I| = {err[index]:.3g} > {tol:g})")


def _check_inverse_pair(m, inverse_transposed, where):
    """An invertible map and the inverse transpose it is stored with: finite, M (M^-T)^T = I."""
    m64, inv64 = np.asarray(m, np.float64), np.asarray(inverse_transposed, np.float64)
    err = np.max(np.abs(m64 @ np.swapaxes(inv64, -1, -2) - np.eye(m64.shape[-1])), axis=(-2, -1))
    bad = ~(err <= 10 * _orthogonality_tol(np.asarray(m).dtype))  # NaN included
    if bad.any():
        index = first_index(bad)
        raise InputError(f"{where}{list(index)} and {where}_inv{list(index)} are not an invertible map and its inverse transpose "
                         f"(max |M (M^-T)^T - I| = {err[index]:.3g})")


def _check_sign_form(r, rotary_dim, where, group="QK-norm", why="q and k pass a norm with one gain per entry"):
    """Under QK-norm (MATH §1) the QK element is diagonal with entries +-1, equal on the two
    entries of each rotary pair (i, i + rotary_dim/2); under a gate on the heads' outputs, the VO
    element likewise (no pairs)."""
    r = np.asarray(r, np.float64)
    dh, half = r.shape[-1], rotary_dim // 2
    diag = np.diagonal(r, axis1=-2, axis2=-1)
    err = np.max(np.abs(r - diag[..., None, :] * np.eye(dh)), axis=(-2, -1))
    err = np.maximum(err, np.max(np.abs(np.abs(diag) - 1), axis=-1))
    if half:
        err = np.maximum(err, np.max(np.abs(diag[..., :half] - diag[..., half:rotary_dim]), axis=-1))
    bad = ~(err <= _orthogonality_tol(np.asarray(r).dtype))
    if bad.any():
        index = first_index(bad)
        raise InputError(
            f"{where}{list(index)} is not a {group} group element (off by {err[index]:.3g}): {why}, so only sign flips keep the function"
            + (f", the same on both entries of a rotary pair (i, i + {half})" if half else "")
        )


def _check_rope_form(r, rotary_dim, where):
    """RoPE rotates pairs (i, i + rotary_dim/2) of the first rotary_dim entries; QK rotations
    commute with it only if they are 2-D rotations on those pairs and leave the rest apart."""
    tol = _orthogonality_tol(np.asarray(r).dtype)
    r = np.asarray(r, np.float64)
    dh, half = r.shape[-1], rotary_dim // 2
    i = np.arange(half)
    allowed = np.zeros((dh, dh), bool)
    allowed[rotary_dim:, rotary_dim:] = True
    for a, b in ((i, i), (i + half, i + half), (i, i + half), (i + half, i)):
        allowed[a, b] = True
    err = np.max(np.abs(np.where(allowed, 0.0, r)), axis=(-2, -1))
    err = np.maximum(err, np.max(np.abs(r[..., i, i] - r[..., i + half, i + half]), axis=-1))
    err = np.maximum(err, np.max(np.abs(r[..., i, i + half] + r[..., i + half, i]), axis=-1))
    bad = ~(err <= tol)
    if bad.any():
        index = first_index(bad)
        raise InputError(
            f"{where}{list(index)} does not commute with RoPE (rotary_dim={rotary_dim}): it must rotate "
            f"each pair (i, i + {half}) by a 2-D rotation and leave the other entries apart (off by {err[index]:.3g})"
        )


def condition_numbers(transforms: dict) -> dict:
    """{block name: {"qk", "vo": the largest condition number}} of the blocks whose maps are
    invertible (`HeadTransform.condition_numbers`); empty where every map is orthogonal."""
    return {name: t.condition_numbers() for name, t in transforms.items()
            if getattr(t, "qk_inv", None) is not None or getattr(t, "vo_inv", None) is not None}
