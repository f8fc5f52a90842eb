#!/usr/bin/env bash
# Every GPU check in one call on a lent machine (its billed time is short): `make test-gpu` (the
# engine's tests, then align_speed, each with its own limit), align_throughput, and the streaming benchmark on an
# 8B-shaped pair written on the host meanwhile. Each step has its own time limit so that one hang
# loses one result, not all; the JSONs written land in OUT with one log.
#
#   RESULTS_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu_evidence.sh OUT [LAYERS] [SECONDS]
#
# LAYERS: how many of Llama-3.1-8B's 32 layers (full widths) the streamed pair has (default 8: on
# the H200 machine the host wrote 16 layers in 341 s, 72 s of it the embeddings, and streamed them
# in 238 s; two models and the merge must fit its 64 GB disk).
# The streamed pair runs under --max-memory 8G: at 55b682c the plan said one layer at a time needs
# 6.38 GiB (the runtime 2 GiB, a layer 4.38 GiB) and refused 6G up front.
# SECONDS: the whole budget (default 570); the streaming step gets what is left but 75 s,
# align_throughput the rest.
set -u
OUT=${1:?usage: gpu_evidence.sh OUT [LAYERS] [SECONDS]}
LAYERS=${2:-8}
BUDGET=${3:-570}
PY=${GPU_PYTHON:-python3}
PAIR=${PAIR:-/tmp/rotsym-8b}
SHAPE=${SHAPE:-llama-3.1-8b}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" benchmarks/results
LOG="$OUT/log.txt"
START=$SECONDS
touch /tmp/gpu_evidence.start
step() { echo "== $* ($((SECONDS - START)) s)" | tee -a "$LOG"; }

# lapx (the host's assignment solver) is not in the device image and it has no network: the
# wheels come carried in .wheels/ (run's carry; fetched beforehand with
#   pip download lapx==0.11.1 --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.1X -d .wheels
# for each 3.1X), else SciPy solves every assignment there.
if ls .wheels/lapx-*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-deps --no-index --find-links .wheels lapx >>"$LOG" 2>&1
fi
step machine
{ $PY -c "import lap; print('lapx', lap.__version__)" || echo "no lapx: SciPy solves the assignments"; nvidia-smi; PYTHONPATH=$PWD $PY -c "import jax, scipy, transformers; print(jax.__version__, jax.devices(), scipy.__version__, transformers.__version__)"; } >>"$LOG" 2>&1

# The pair is written on the host (JAX on the CPU: the tests hold the GPU) while the tests run.
rm -rf "$PAIR"
JAX_PLATFORMS=cpu PYTHONPATH=$PWD timeout 400 $PY benchmarks/make_large_pair.py "$PAIR" --shape "$SHAPE" \
    --layers "$LAYERS" --partners finetune >"$OUT/pair.txt" 2>&1 &
WRITER=$!

step make test-gpu-engine
# -v in the target: each verdict is written as its test ends, so a cut run still names its failures
timeout 240 make test-gpu-engine GPU_PYTHON="$PY" GPU_WORKERS=8 >"$OUT/engine_tests.txt" 2>&1
echo "rc $?" | tee -a "$LOG"
grep -E "FAILED|ERROR|passed|failed" "$OUT/engine_tests.txt" | tee -a "$LOG"

step align_speed "(the rest of make test-gpu)"
# (roberta-base alone took 150 s on the H200 with the NumPy loop and three fresh processes)
PYTHONPATH=$PWD:$PWD/experiments timeout 150 $PY benchmarks/align_speed.py --random-repeats 1 --shapes roberta-base bert-large --no-peer-check >>"$LOG" 2>&1
echo "rc $?" | tee -a "$LOG"

step waiting for the pair
wait $WRITER
echo "rc $?" | tee -a "$LOG"
cat "$OUT/pair.txt" >>"$LOG"; rm -f "$OUT/pair.txt"
df -h /tmp >>"$LOG"

LEFT=$((BUDGET - (SECONDS - START) - 75))  # 75 s stay for align_throughput
step streaming "(${LEFT} s left)"
if [ "$LEFT" -gt 30 ]; then
    PYTHONPATH=$PWD:$PWD/experiments timeout "$LEFT" $PY benchmarks/streaming.py "$PAIR" --max-memory 8G >>"$LOG" 2>&1
    echo "rc $?" | tee -a "$LOG"
fi

step align_throughput
PYTHONPATH=$PWD:$PWD/experiments timeout $((BUDGET - (SECONDS - START))) $PY benchmarks/align_throughput.py >>"$LOG" 2>&1
echo "rc $?" | tee -a "$LOG"

find benchmarks/results -name '*.json' -newer /tmp/gpu_evidence.start -exec cp {} "$OUT"/ \;
step done
ls -l "$OUT" | tee -a "$LOG"
