#!/usr/bin/env bash
# Every GPU check of the Triton flash kernel in one run, each step under its own time limit:
#   1. the GPU: model, driver, clocks (nvidia-smi);
#   2. `pytest -m gpu` on the test files that hold GPU tests, while the benchmark's kernels compile
#      in parallel (one process per dtype, head size and causal flag, filling Triton's cache);
#   3. the accuracy of the forward and the Triton backward against autograd of the float32 reference
#      (`python -m mha_lab bench --gpu --accuracy`), and the GPU time of each kernel of a forward and
#      backward, ours and SDPA's (`--profile`);
#   4. the benchmark against PyTorch's flash SDPA, forward and forward+backward
#      (`python -m mha_lab bench --gpu`), with the GPU's clocks and power logged alongside.
#
# Usage, from the repository root on a machine with an NVIDIA GPU:
#   scripts/gpu_check.sh [OUT_DIR]          (default: $OUT, else bench_results/gpu_check)
# Environment: PYTHON (default python3), BENCH_ARGS (extra options of `bench --gpu`, e.g. "--quick"),
# and the step limits in seconds: WARM_S, PYTEST_S, ACCURACY_S, PROFILE_S, BENCH_S.
# Everything lands in OUT_DIR: nvidia_smi.txt, pytest.log, accuracy.json, profile.json, bench_gpu.json (which
# carries the accuracy and the profile along), bench.log, dmon.log and steps.log (each step's exit status and
# seconds). Copy bench_gpu.json to book/data/gpu_bench.json to put the measurement in the book.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-bench_results/gpu_check}}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
STEPS=$OUT_DIR/steps.log
: > "$STEPS"

step() {  # step NAME LIMIT_S LOG COMMAND...: run COMMAND under `timeout`, log its status and time
    local name=$1 limit=$2 log=$3 start=$SECONDS rc
    shift 3
    echo "== $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$STEPS"
    tail -n 15 "$log"
    return 0
}

step "nvidia-smi" 30 "$OUT_DIR/nvidia_smi.txt" bash -c \
    "nvidia-smi; nvidia-smi -q -d CLOCK,POWER,PERFORMANCE; $PY -c 'import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())'"

# the benchmark's kernels, compiled in parallel at a short length (same specialisation as the timed lengths)
WARM=$(mktemp -d)
warm() {
    local i=0
    for dtype in float16 bfloat16; do for d in 64 128; do for causal in no yes; do
        $PY -m mha_lab bench --gpu --no-progress --seq-len 1024 --dtype $dtype --head-dim $d --causal $causal \
            --out "$WARM/$i" > "$WARM/$i.log" 2>&1 &
        i=$((i + 1))
    done; done; done
    wait
    tail -n 3 "$WARM"/*.log
}
export -f warm
export PY WARM
step "compile the benchmark's kernels" "${WARM_S:-150}" "$OUT_DIR/bench.log" bash -c warm &
WARM_PID=$!
GPU_TESTS=$(grep -l "mark.gpu" tests/test_*.py)
step "pytest -m gpu" "${PYTEST_S:-150}" "$OUT_DIR/pytest.log" \
    $PY -m pytest -o addopts="" -p no:cacheprovider -m gpu -n 4 --dist load -q -rA --durations=10 $GPU_TESTS
wait $WARM_PID

step "accuracy against the float32 reference" "${ACCURACY_S:-40}" "$OUT_DIR/accuracy.log" \
    $PY -m mha_lab bench --gpu --accuracy --out "$OUT_DIR"
cat "$OUT_DIR/accuracy.log" >> "$OUT_DIR/pytest.log" && rm "$OUT_DIR/accuracy.log"
step "GPU time per kernel" "${PROFILE_S:-60}" "$OUT_DIR/bench.log" \
    $PY -m mha_lab bench --gpu --profile --out "$OUT_DIR"

nvidia-smi dmon -s pc -d 2 > "$OUT_DIR/dmon.log" 2>&1 &
DMON_PID=$!
TRITON_PRINT_AUTOTUNING=1 step "bench --gpu" "${BENCH_S:-240}" "$OUT_DIR/bench.log" \
    $PY -m mha_lab bench --gpu --no-progress --out "$OUT_DIR" ${BENCH_ARGS:-}
kill "$DMON_PID" 2>/dev/null
grep -E "ratio|^\| (float16|bfloat16)" "$OUT_DIR/bench.log" | tail -n 45
cat "$STEPS"
