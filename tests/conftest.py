"""Shared fixtures."""

import gc
import os

import jax
import pytest

# XLA's backend optimisations (LLVM's on a CPU) cost the default run about 40% of its compile time
# and save the tests' small programs almost nothing when they run: the tests compile without them
# (JAX_DISABLE_MOST_OPTIMIZATIONS, 1 unless given). Semantics are unchanged; float sums may round in
# another order, so the subprocesses inherit it (tests compare their bits with in-process ones).
# The notebooks' kernels, whose training runs twice as long unoptimised, and the device target
# (make test-gpu-engine) set it to 0.
UNOPTIMISED = "JAX_DISABLE_MOST_OPTIMIZATIONS"
os.environ.setdefault(UNOPTIMISED, "1")
# read as JAX reads it in the subprocesses (jax._src.config.bool_env)
jax.config.update("jax_disable_most_optimizations", os.environ[UNOPTIMISED].lower() in ("y", "yes", "t", "true", "on", "1"))
# Unoptimised, XLA:CPU's MLIR fusion emitters still compile the tests' programs 2-3x slower than its
# older emitters on one code generation thread (in two runs of benchmarks/compile_flags.py the
# attention solve 0.9-1.0 s -> 0.45-0.6 s, a first learned align 7-9 s -> 3.4-4 s; the default
# run's XLA compiling 659 -> 277 worker-seconds). Read when the CPU backend starts (after this file); the
# subprocesses inherit them.
FAST_COMPILE = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *(f for f in FAST_COMPILE if f.split("=")[0] not in os.environ.get("XLA_FLAGS", ""))]).strip()

# PyTorch runs the reference models on OpenMP threads, which spin on a loaded machine: with a
# worker per core (and XLA's threads beside them), a tiny LayerNorm took 4.6 ms on two threads
# against 7 us on one, and the conformance parity tests ran 23 s against 17 s. The tests' models
# are tiny: one thread (read when torch first runs an op; the subprocesses inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The command line keeps compiled programs in a per-user cache (cli.parsers.compilation_cache_dir);
# the tests call it in-process and as subprocesses, and must neither write into the user's cache
# nor read programs an earlier run left there. tests/test_user_errors.py turns it on where it tests it.
os.environ["ROTSYM_COMPILATION_CACHE"] = "off"

# JAX's persistent cache, shared by a run's workers, cost the default run more than it saved once
# compiling was fast (433 s without it against 527 s with it, idle, issue 72):
# every program is hashed, written and read back as a file. So a run keeps none unless
# ROTSYM_TEST_XLA_CACHE names a folder, which its workers then share, and which is left in place
# (.ci/run gives the default and the slow run one folder: the slow tests compile many of the
# default run's programs again).
SHARED_CACHE = "ROTSYM_TEST_XLA_CACHE"


# Python's full garbage collections scan every object alive, and a worker holds millions (torch,
# transformers, JAX and their caches): at the default threshold (a full collection after 10 of
# generation 1) tests/test_t5, test_mixed_layouts, test_commands and test_streaming run in one process
# spent 10.9 s of their 133 CPU-seconds in 19 full collections; with the objects alive once the
# tests are collected (the modules imported) frozen out of the scans and a full collection after
# 100, 3.0 s in 6, the same peak memory (2.15 GB). Collections of the young generations, and
# gc.collect(), are as before: only cyclic garbage that lived long waits longer.
gc.set_threshold(gc.get_threshold()[0], gc.get_threshold()[1], 100)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def pytest_configure(config):
    folder = os.environ.get(SHARED_CACHE, "")
    if folder.lower() in ("", "off"):
        return
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@pytest.fixture(autouse=True, scope="session")
def _memory_as_on_an_idle_machine():
    """Without --max-memory, a run streams where the machine's free memory (MemAvailable, read at
    that instant) is below the in-memory estimate (pipeline.streamed). A test of the in-memory path
    must not turn into a streamed run, and refuse, because other processes hold the memory: 13
    planted-recovery rows failed so on a machine whose memory ran out under four test runs. The
    tests of that choice set the free memory themselves (test_streaming)."""
    from rotsym_jax import streaming

    measured = streaming.available_memory
    streaming.available_memory = lambda: 16 * 2**30
    yield
    streaming.available_memory = measured


@pytest.fixture(autouse=True, scope="session")
def _no_durability_waits():
    """The library fsyncs every file and folder it publishes (power-cut safety, owned.py): 5-6 ms a
    file on this machine's disk, 3266 files in the conformance tests alone, for temporary folders
    no test reads after a power cut. os.fsync returns at once in the test processes; the tests of
    the order of syncs and renames (test_faults) record the calls, which still happen."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", lambda fd: None)
        yield


@pytest.fixture
def float32_models():
    """Model forward passes (ours, and what the tests compute from them) at full float32 matmul
    precision. Tests that compare model outputs need it: with PyTorch at 1e-4, before and after a
    transform at 1e-5, a training run against a stored one. JAX's default on GPUs is TF32, about
    1e-3 relative on these outputs. The library's own alignment, merge and statistics code pins its
    precision itself (test_precision.py), so engine tests never use this."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Any read of a tensor's bytes fails the test: for refusals that must come from the configs
    and safetensors headers alone, before any weight is read."""
    from rotsym_jax import hf

    def refuse(self, name, rows=None):
        raise AssertionError(f"read the weights of {name} before refusing")

    monkeypatch.setattr(hf.TensorFiles, "read", refuse)
    monkeypatch.setattr(hf.TensorFiles, "get", refuse)


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_freed_before_the_mapping_limit():
    """XLA:CPU maps each compiled program's code and data into the process (a test file's programs
    hold thousands of mappings), and JAX's caches keep every program alive: a pytest worker that
    ran a whole suite reached Linux's limit of 65530 mappings (vm.max_map_count), a compile then
    failed and its C++ exception crashed in the unwinder (a segfault in CI, core dump: 65102
    mappings). After a file, a worker past half the limit drops the caches (tests/test_spec.py:
    5986 -> 1061 mappings); clearing after every file cost the default run 2 minutes of compiles."""
    yield
    if _mappings() > _MAPPING_LIMIT // 2:
        jax.clear_caches()
        gc.collect()


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such count, and no such limit
        return 0


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


_MAPPING_LIMIT = _max_map_count()
