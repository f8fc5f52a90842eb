"""Found by a new-user trial: `rj.align` of a Whisper pair inside `jax.jit` with a residual mode
did not finish compiling in 6.5 minutes. Not Whisper's doing: the residual descent's sweeps were a
Python loop, unrolled inside jit, each a copy of the whole group solve (tiny Whisper: 16k equations
at 1 sweep, 85k at the default 8; tiny BART alike), which XLA took over 15 minutes to compile. The
sweeps are now the steps of one `lax.scan`: the program no longer grows with them."""

import jax
import numpy as np
import pytest
import transformers as tf
from family_cases import WHISPER
from parity_utils import save_reference

import rotsym_jax as rj

pytestmark = pytest.mark.usefixtures("float32_models")


def _equations(jaxpr) -> int:
    """Every equation of `jaxpr`, those of the programs it nests (scan bodies, conds, calls) too."""
    count = len(jaxpr.eqns)
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _equations(inner)
    return count


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whisper_jit") / "a"
    save_reference(tf.WhisperForConditionalGeneration, tf.WhisperConfig(**WHISPER), folder)
    ck = rj.load_hf(folder)
    spec = rj.spec_for(ck)
    b = rj.apply_transform(spec, ck.params, rj.random_transform(spec, ck.params, jax.random.key(1), ()))
    return spec, ck.params, b


def test_the_jitted_program_does_not_grow_with_the_residual_sweeps(whisper):
    spec, a, b = whisper
    sizes = {sweeps: _equations(jax.make_jaxpr(lambda x, y, n=sweeps: rj.align(x, y, spec, residual="permutation", residual_sweeps=n).params)(a, b).jaxpr)
             for sweeps in (1, 8)}
    assert sizes[8] <= 1.01 * sizes[1], sizes  # unrolled: 85k against 16k


@pytest.mark.slow  # a compile of about a minute (two on a loaded machine)
def test_the_jitted_alignment_of_both_streams_equals_the_eager_one(whisper):
    spec, a, b = whisper
    eager = rj.align(a, b, spec, residual="permutation")
    jitted = jax.jit(lambda x, y: rj.align(x, y, spec, residual="permutation"))(a, b)
    for name in ("encoder_residual", "decoder_residual"):
        np.testing.assert_array_equal(np.asarray(jitted.transforms[name].perm), np.asarray(eager.transforms[name].perm))
    for x, y in zip(jax.tree.leaves(jitted.params), jax.tree.leaves(eager.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-6)
    np.testing.assert_allclose(float(jitted.report["after"]["total"]), eager.report["after"]["total"], rtol=1e-5)
