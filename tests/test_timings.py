"""The clock's accounting: JAX's compilations are a phase of their own, taken out of the phase
that asked for them, counted once when one jit is traced inside another, and by the clock whose
phase is open in the compiling thread."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from rotsym_jax.timings import COMPILE_EVENTS, Clock

# A constant of this process's own: no persistent cache (a folder kept between runs) holds its programs.
_PROCESS = time.time_ns() % 1_000_003 / 1_000_003


def _fresh_program(seed: int):
    """A jitted function no test has compiled (its constant differs), of some compile time."""
    inner = jax.jit(lambda x: jnp.tanh(x @ x.T + seed + _PROCESS))

    @jax.jit
    def outer(x):
        for _ in range(20):  # enough operations that compiling takes milliseconds, not microseconds
            x = jnp.sin(inner(x)) * 0.5 + x
        return x.sum()

    return outer


def test_a_phase_gives_its_compilation_to_compile_and_keeps_the_rest():
    clock, x = Clock(), jnp.ones((8, 8))
    program = _fresh_program(1)
    # Bounds that a preempted thread cannot break (a loaded machine can stall it for milliseconds
    # anywhere): the phase holds the block (inside) and lies within the outer wall (outside).
    t0 = time.perf_counter()
    with clock.phase("apply"):
        t_in = time.perf_counter()
        program(x).block_until_ready()
        time.sleep(0.05)  # host work of the phase itself
        inside = time.perf_counter() - t_in
    wall = time.perf_counter() - t0
    assert clock["compile"] > 0.005, clock
    assert clock["apply"] >= 0.05, clock
    # nothing lost or counted twice: the compile seconds come from JAX's clock, which disagrees by microseconds
    assert inside - 1e-3 <= clock["apply"] + clock["compile"] <= wall + 1e-3, (clock, inside, wall)
    assert clock["compiled"] == 1, clock  # one program (the inner jit is traced into the outer one)
    compiled = clock["compile"]
    with clock.phase("apply"):  # the same program again: nothing to compile
        program(x).block_until_ready()
    assert clock["compile"] == compiled and clock["compiled"] == 1


def test_a_program_compiled_while_another_is_traced_is_counted_once():
    """A program run while another is traced (a constant computed at trace time) compiles within
    the outer trace: JAX reports both spans, the clock counts their union (measured here by a
    listener of our own)."""
    spans = []

    def record(event, start, end, **_):
        if event in COMPILE_EVENTS:
            spans.append((start, end))

    jax.monitoring.register_event_time_span_listener(record)
    clock = Clock()
    try:
        with clock.phase("solve"):
            constant = _fresh_program(2)

            @jax.jit
            def traced(x):
                with jax.ensure_compile_time_eval():
                    return x * constant(jnp.ones((4, 4)))

            traced(jnp.ones(3)).block_until_ready()
    finally:
        jax.monitoring.unregister_event_time_span_listener(record)
    union, reach = 0.0, -np.inf
    for start, end in sorted(spans):
        union += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    assert sum(end - start for start, end in spans) > union + 1e-6, spans  # nested spans were reported
    assert abs(clock["compile"] - union) < 1e-6, (clock["compile"], union)


def test_the_innermost_clock_counts_and_every_one_of_its_open_phases_gives_up_the_seconds():
    outer, inner = Clock(), Clock()
    with outer.phase("merge"), inner.phase("solve"), inner.phase("assignment"):
        _fresh_program(3)(jnp.ones((4, 4))).block_until_ready()
    assert outer["compile"] == 0 and inner["compile"] > 0
    assert inner["solve"] >= 0 and inner["assignment"] >= 0 and inner["assignment"] <= inner["solve"] + 1e-6, inner
    # the outer clock's phase holds the inner call whole, its compilation included
    assert outer["merge"] >= inner["solve"] + inner["compile"] - 1e-3, (outer, inner)


def test_compilation_outside_every_phase_and_in_other_threads():
    clock = Clock()
    _fresh_program(4)(jnp.ones((4, 4))).block_until_ready()  # no phase open: not this clock's
    assert clock["compile"] == 0
    lane = Clock()

    def work():
        with lane.phase("apply"):
            _fresh_program(5)(jnp.ones((4, 4))).block_until_ready()

    with clock.phase("write"):  # open in this thread, not in the lane's
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    assert lane["compile"] > 0 and clock["compile"] == 0
    report = lane.report(time.perf_counter())
    assert min(report.values()) >= 0 and np.isfinite(list(report.values())).all()
