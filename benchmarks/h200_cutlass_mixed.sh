#!/usr/bin/env bash
# H200 sessions (issue 4, 2026-12-01, sessions 13 and 14): CUTLASS's sm90 mixed-input grouped
# GEMM (e4m3 weight converted in registers) and design (g) (the raw bf16 weight quantized to
# MXFP8 in registers) against torch._grouped_mm (benchmarks/cutlass_mixed.py). Part "bench":
# the table and the exactness checks; part "profile": ncu's warp-state and scheduler
# sections of design (g) and its two timing references at (16384, 2048, 1408, 64).
# The shared library comes prebuilt (LIB, default .whl/cutlass_mixed.so, from
# benchmarks/cutlass_mixed/build.sh) or is built here when CUTLASS_DIR is set.
# Usage (repo root): COMMIT=<sha> OUT=<dir> [LIB=<so>] bash benchmarks/h200_cutlass_mixed.sh [bench|profile]
set -u
PART=${1:-bench}
case "$PART" in bench|profile) ;; *) echo "unknown part '$PART': use bench or profile" >&2; exit 2;; esac
OUT_DEFAULT=/tmp/h200_cutlass_mixed LOG_NAME=cutlass_mixed_$PART.log
. "$(dirname "$0")/h200_session.sh"
export PYTHONPATH=benchmarks:$PYTHONPATH
LIB=${LIB:-.whl/cutlass_mixed.so}
if [ -n "${CUTLASS_DIR:-}" ]; then run 590 bash benchmarks/cutlass_mixed/build.sh "$LIB"; fi
if [ "$PART" = bench ]; then
  run 560 python3 benchmarks/cutlass_mixed.py --lib "$LIB" --out "$OUT/cutlass_mixed.json"
  grep -vE "^\s*$" "$LOG" | cut -c1-200 | tail -70
else
  for v in ${PROFILE_VARIANTS:-q0c q5c q4c}; do
    # the first design (g) kernel of the run (the mangled name holds QdqTransform; torch's
    # own CUTLASS kernels do not): its correctness launch
    run 200 ncu --clock-control none --kernel-name-base mangled -k regex:QdqTransform -c 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      -o "/tmp/ncu_$v" -f python3 benchmarks/cutlass_mixed.py --lib "$LIB" --variants "$v" --shapes 2 --no-exact
    ncu -i "/tmp/ncu_$v.ncu-rep" --page details > "$OUT/ncu_$v.txt" 2>&1
    grep -E "Duration|Stall|Issued|Eligible|Active Warps|No Eligible|One or More|Throughput|Warp Cycles" "$OUT/ncu_$v.txt" | head -40
  done
fi
