#!/usr/bin/env bash
# One H200 session (issue 4, 2026-12-01, session 12): design (e) of the grouped GEMM, the
# raw weight quantized in PTX inside a Gluon wgmma kernel with TMA operand loads
# (benchmarks/gluon_wq_tma.py): exactness checks, settings sweep, per-call forward timing.
# Usage (repo root, torch + Triton 3.6 on the GPU): COMMIT=<sha> OUT=<dir> bash benchmarks/h200_design_e.sh [e]
set -u
PART=${1:-e}
case "$PART" in e) ;; *) echo "unknown part '$PART': use e" >&2; exit 2;; esac
OUT_DEFAULT=/tmp/h200_design_e LOG_NAME=$PART.log
. "$(dirname "$0")/h200_session.sh"
export PYTHONPATH=benchmarks:$PYTHONPATH
run 570 python3 benchmarks/gluon_wq_tma_bench.py --out "$OUT/gluon_wq_tma.json"
grep -E "^===|ok|FAIL|summary|x bf16|bit-equal|best|Error|us" "$LOG" | cut -c1-220 | tail -80
