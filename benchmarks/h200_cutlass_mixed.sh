#!/usr/bin/env bash
# One H200 session (issue 4, 2026-12-01, session 13): CUTLASS's sm90 mixed-input grouped
# GEMM (e4m3 weight converted in registers) against torch._grouped_mm
# (benchmarks/cutlass_mixed.py). The shared library comes prebuilt (LIB, default
# .whl/cutlass_mixed.so, from benchmarks/cutlass_mixed/build.sh) or is built here when
# CUTLASS_DIR is set.
# Usage (repo root): COMMIT=<sha> OUT=<dir> [LIB=<so>] bash benchmarks/h200_cutlass_mixed.sh
set -u
OUT_DEFAULT=/tmp/h200_cutlass_mixed LOG_NAME=cutlass_mixed.log
. "$(dirname "$0")/h200_session.sh"
export PYTHONPATH=benchmarks:$PYTHONPATH
LIB=${LIB:-.whl/cutlass_mixed.so}
if [ -n "${CUTLASS_DIR:-}" ]; then run 590 bash benchmarks/cutlass_mixed/build.sh "$LIB"; fi
run 560 python3 benchmarks/cutlass_mixed.py --lib "$LIB" --out "$OUT/cutlass_mixed.json"
grep -vE "^\s*$" "$LOG" | cut -c1-200 | tail -70
