# `make test` and `make demo` work on a fresh machine: they create .venv and install what is needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-slow test-gpu test-gpu-engine demo docs docs-screenshots notebooks results clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch is the independent reference for the parity tests. `torch==2.13.0` installs a CPU build
# from a local file on these machines; it must come first so that nothing pulls a CUDA build.
# Where it cannot be installed, the parity tests skip with a reason.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q torch==2.13.0 || echo "warning: torch==2.13.0 not installable: parity tests will skip"
	$(PY) -m pip install -q -e '.[test,experiments]'
	touch $(STAMP)

install: $(STAMP)

# `make test` lints (ruff, configured in pyproject.toml), then runs the tests, one worker per core
# (pytest-xdist; a test file stays on one worker, so its module fixtures are built once).
# A worker that crashes ends the run naming its test: pytest-xdist 3.8 can hang forever replacing
# a crashed worker under --dist loadfile (pytest-xdist issue #784).
# The default run stays under ~10 minutes on 2 cores; tests marked slow (the notebooks' small
# runs, the peer check on two full-size RoBERTa models) run in `make test-slow`; CI (.ci/run) runs both.
PYTEST := $(PY) -m pytest -q -n auto --dist loadfile --max-worker-restart=0
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PYTEST) -m "not slow"

# mergekit, the reference of the mergekit-config tests (tests/test_mergekit.py, slow), in a folder of
# its own: --no-deps keeps the venv's torch and transformers (it runs beside them as it is). Defined
# before test-slow: make expands a rule's prerequisites where it reads the rule.
MERGEKIT := .mergekit/.installed
$(MERGEKIT): | $(STAMP)
	$(PY) -m pip install -q --no-deps --target .mergekit mergekit==0.1.5 immutables==0.21 accelerate==1.15.0 peft==0.21.2
	touch $(MERGEKIT)

test-slow: $(STAMP) $(MERGEKIT)
	$(PYTEST) -m slow

# On a machine that already has JAX with CUDA (no install, no network needed): the engine's default
# tests, at the tolerances they have on CPU and compiled as users compile them, then the speed
# benchmark, whose JSON (benchmarks/results/align_speed-<device>.json) names the device. POT is
# optional here.
# The benchmark scripts write their JSON with rotsym_experiments.results_io, hence experiments/.
GPU_PYTHON ?= python3
GPU_PATH := $(CURDIR):$(CURDIR)/experiments
# Workers share the one GPU: no preallocation, so that each takes only what it uses.
GPU_WORKERS ?= 4
test-gpu: test-gpu-engine
	PYTHONPATH=$(GPU_PATH) $(GPU_PYTHON) benchmarks/align_speed.py --random-repeats 1

test-gpu-engine:
	PYTHONPATH=$(GPU_PATH) XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DISABLE_MOST_OPTIMIZATIONS=0 $(GPU_PYTHON) -m pytest -v -p no:cacheprovider -n $(GPU_WORKERS) --max-worker-restart=0 \
		-m "not slow" -W ignore::pytest.PytestWarning -o console_output_style=classic \
		tests/test_solvers.py tests/test_align.py tests/test_invariance.py tests/test_many.py tests/test_spec.py tests/test_precision.py \
		tests/test_untie.py tests/test_invertible.py tests/test_jax_native.py

demo: $(STAMP)
	$(VENV)/bin/rotsym demo

# The documentation site (mkdocs.yml) into site/; a warning (a broken link, a public name missing
# from the API reference) fails the build.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): pyproject.toml | $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

# The site as a reader sees it: headless Chromium screenshots of a few pages into site/screenshots/
# (Chromium is not a Python package: apt install chromium, or set CHROMIUM).
CHROMIUM ?= chromium
SHOTS := home:index.html first-hour:tutorials/first-hour/index.html api:reference/api/index.html choosing:guides/choosing/index.html
docs-screenshots: docs
	mkdir -p site/screenshots
	for shot in $(SHOTS); do \
	  $(CHROMIUM) --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1440,1800 \
	    --screenshot=site/screenshots/$${shot%%:*}.png "file://$(CURDIR)/site/$${shot#*:}" 2>/dev/null || exit 1; \
	done

# Re-execute the notebooks at full size (outputs are committed).
notebooks: $(STAMP)
	$(PY) notebooks/run.py notebooks/loss_barriers.ipynb notebooks/fusion.ipynb notebooks/federated.ipynb --size full

# Rewrite experiments/RESULTS.md and benchmarks/RESULTS.md from the JSON in their results/ folders.
results: $(STAMP)
	$(PY) experiments/write_results.py
	$(PY) benchmarks/write_results.py

clean:
	rm -rf $(VENV) .mergekit .cache .pytest_cache site
