#!/usr/bin/env bash
# The whole GPU check of mxmoe on one H200 (or any CUDA machine), in one command from the repo root:
#   1. the test suite, tests/gpu first (python3 -m pytest -v tests/gpu tests), without
#      tests/test_benchmark_scripts.py (CPU smoke runs of the scripts, for CI; step 2 runs them for real)
#   2. every benchmark in --quick mode: grouped_mm, moe_layer, quantize, linear, train_step
#      (expert_parallel too where the machine has 2 GPUs)
# Measured on the H200 (torch 2.11): tests/gpu about 3.5 minutes, the whole suite about 8-9, the quick
# benchmarks about 2 (each under 40 s). Inside one 10-minute call the suite is cut at TESTS_S (its log
# lists every test that ran, -v); for everything, make two calls: --no-bench with TESTS_S=570, then --no-tests.
#
# Usage (repo root):  OUT=<dir> COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_h200.sh [--full] [--no-tests] [--no-bench]
#   --full      the benchmarks' full shape lists instead of --quick (needs more than 10 minutes)
#   --no-tests  benchmarks only;  --no-bench  tests only
# Environment:
#   OUT        where the log and the JSON files go (default benchmarks/results): run_h200.log plus one
#              <subject>.json per benchmark, at most 7 files
#   COMMIT     recorded in the JSON files where .git did not travel with the tree (default: git, else "unknown")
#   TOTAL_S    time budget of the whole run in seconds (default 580); each step gets what is left, capped:
#   TESTS_S    cap of the test suite (default 420); BENCH_S: cap of each benchmark (default 90)
#   MXMOE_CACHE_DIR  the CUTLASS quantized-weight GEMM builds (tests/gpu skips that GEMM's checks without them)
# SonicMoE: if .hopper/activate exists (made by the project's bundle tool and carried to the machine) it is
# sourced first; --quick leaves SonicMoE out (QuACK compiles its GEMMs for 1-3 minutes on first use), --full
# times it. In its own call: source .hopper/activate && PYTHONPATH=src:$PYTHONPATH python3 benchmarks/moe_layer.py
#   --models qwen3-235b-a22b --variants "SonicMoE bf16,HF grouped_mm bf16" --sonic-configs one   (82 s on the H200)
# Exit status: 0 if every step passed, else 1.
set -u
cd "$(dirname "$0")/.."
FULL=0 TESTS=1 BENCH=1
for arg in "$@"; do
  case $arg in
    --full) FULL=1 ;;
    --no-tests) TESTS=0 ;;
    --no-bench) BENCH=0 ;;
    *) echo "unknown argument $arg; use --full, --no-tests, --no-bench" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
LOG=$OUT/run_h200.log
: > "$LOG"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -f .hopper/activate ]; then
  # shellcheck disable=SC1091
  source .hopper/activate && echo "sourced .hopper/activate (SonicMoE)" | tee -a "$LOG"
fi
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device (or python3 cannot import torch): run this on the GPU machine" | tee -a "$LOG" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
echo "commit $COMMIT" | tee -a "$LOG"

DEADLINE=$(( $(date +%s) + ${TOTAL_S:-580} ))
FAILED=()
# step NAME CAP_S SHOW CMD...: run CMD under min(CAP_S, time left), output to the log (SHOW=1: also here)
step() {
  local name=$1 cap=$2 show=$3; shift 3
  local left=$(( DEADLINE - $(date +%s) ))
  local limit=$(( left < cap ? left : cap ))
  if [ "$limit" -lt 20 ]; then
    echo "=== $name: skipped, the time budget is spent" | tee -a "$LOG"; FAILED+=("$name (not run)"); return
  fi
  echo "=== $name: $* (limit ${limit}s)" | tee -a "$LOG"
  local t0=$(date +%s) rc
  if [ "$show" = 1 ]; then
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"; rc=${PIPESTATUS[0]}
  else
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1; rc=$?
  fi
  echo "=== $name: exit $rc after $(( $(date +%s) - t0 ))s$([ "$rc" = 124 ] && echo ' (time limit)')" | tee -a "$LOG"
  [ "$rc" = 0 ] || FAILED+=("$name (exit $rc)")
}

if [ "$TESTS" = 1 ]; then
  step tests "${TESTS_S:-420}" 0 python3 -m pytest -v -p no:cacheprovider -rfEs --tb=short \
    --ignore=tests/test_benchmark_scripts.py tests/gpu tests
  # every failure, also when the time limit cut the run before pytest's summary
  grep -E "(FAILED|ERROR)( |$)|^[0-9]+ (passed|failed|skipped|error)|^=+ [0-9]+ (passed|failed)" "$LOG" \
    | grep -v "^===" | sort -u | tail -60
  echo "tests: $(grep -c " PASSED" "$LOG") passed, $(grep -c " FAILED" "$LOG") failed, $(grep -c " SKIPPED" "$LOG") skipped (from the -v lines)"
fi
if [ "$BENCH" = 1 ]; then
  MODE=--quick; [ "$FULL" = 1 ] && MODE=
  for script in grouped_mm moe_layer quantize linear train_step; do
    step "$script" "${BENCH_S:-90}" 1 python3 "benchmarks/$script.py" $MODE --results-dir "$OUT"
  done
  if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)"; then
    step expert_parallel "${BENCH_S:-90}" 1 python3 benchmarks/expert_parallel.py $MODE --results-dir "$OUT"
  else
    echo "=== expert_parallel: skipped (needs 2 GPUs)" | tee -a "$LOG"
  fi
fi
if [ ${#FAILED[@]} -eq 0 ]; then
  echo "run_h200: every step passed; log and JSON in $OUT" | tee -a "$LOG"; exit 0
fi
echo "run_h200: FAILED: ${FAILED[*]}; log in $LOG" | tee -a "$LOG"
exit 1
