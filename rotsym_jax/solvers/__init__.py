"""Numerical solvers for aligning one model to another (MATH.md sections 2 to 5).

Device functions (jittable, batched over arbitrary leading axes, computed in float32 at least:
float16 / bfloat16 / integer inputs are upcast to float32, float64 stays float64):

    polar(M)                         orthogonal polar factor U V^T of M = U S V^T (Procrustes)
    rope_polar(M, rotary_dim)        the same maximiser within the RoPE group SO(2)^(r/2) x O(n-r)
    polar_stack(M, rotary_dims)      several of those (stacked on axis -3) by one polar call
    RopePolar, StackedPolar          those projections as hashable values (`rescale_joint`'s project)
    nuclear_norm(M)                  sum of singular values
    rescale_sequential(...)          best scalar a > 0 for a fixed rotation (quartic, Eq. 11-12)
    rescale_joint(Mq, Mk, ...)       exact joint optimum over (a, R) by a 1-D search over log a
    objective_value(R, a, ...)       the QK/VO alignment cost, up to a constant
    certified_assignment(S)          the assignment of each column's best row, and whether that
                                     is provably optimal (then no host solver is needed)

Host functions (NumPy / SciPy, not jittable):

    linear_assignment(S)             permutation p maximising sum_j S[p[j], j]
    linear_assignments([S, ...])     the same for a sequence, on a thread pool
    batched_linear_assignment(S)     the same over leading axes

and their bridge, usable anywhere: `assign(S)`, `batched_linear_assignment` on concrete arrays and
through `jax.pure_callback` on traced ones (inside jit, vmap, grad-free training steps).

The device functions are wrapped in `precision.exact_jit` (`jax.jit` with every matmul at full
float32 precision; string/int/callable options are static), so eager calls are compiled once per
shape; they can also be called inside other jitted code.

Conventions (MATH.md section 2): `R` acts by right-multiplication, `x @ R`; for cross products
`M = X_B^T X_A` the orthogonal maximiser of `tr(R^T M)` is the `R` for which `X_B @ R` is closest
to `X_A`.

The kernels live in procrustes.py, rescale.py and assignment.py (batched.py: shared helpers);
this package re-exports them.
"""

from ..options import DEFAULT_POLAR_METHOD, POLAR_METHODS
from .assignment import assign, batched_linear_assignment, certified_assignment, linear_assignment, linear_assignments
from .procrustes import RopePolar, StackedPolar, nuclear_norm, polar, polar_stack, rope_pair_terms, rope_polar
from .rescale import objective_value, rescale_joint, rescale_sequential

__all__ = [
    "POLAR_METHODS",
    "DEFAULT_POLAR_METHOD",
    "polar",
    "rope_polar",
    "polar_stack",
    "rope_pair_terms",
    "RopePolar",
    "StackedPolar",
    "nuclear_norm",
    "rescale_sequential",
    "rescale_joint",
    "objective_value",
    "assign",
    "linear_assignment",
    "linear_assignments",
    "certified_assignment",
    "batched_linear_assignment",
]
