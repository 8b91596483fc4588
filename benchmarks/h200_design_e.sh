#!/usr/bin/env bash
# One H200 session (issue 4, 2026-12-01, session 12): the weight quantized inside the grouped
# GEMM. Part "e": design (e), the PTX quantization in a Gluon wgmma kernel with TMA loads
# (benchmarks/gluon_wq_tma.py); part "f": design (f), the same quantization in a CUDA kernel
# run in 2-CTA clusters that multicast the token tile (benchmarks/cuda_wq_cluster.py). Both:
# exactness checks, settings sweep, per-call forward timing (benchmarks/wq_kernels_bench.py).
# Usage (repo root, torch + Triton 3.6 on the GPU): COMMIT=<sha> OUT=<dir> bash benchmarks/h200_design_e.sh e|f
set -u
PART=${1:-e}
case "$PART" in e|f) ;; *) echo "unknown part '$PART': use e or f" >&2; exit 2;; esac
OUT_DEFAULT=/tmp/h200_design_e LOG_NAME=$PART.log
. "$(dirname "$0")/h200_session.sh"
export PYTHONPATH=benchmarks:$PYTHONPATH
run 570 python3 benchmarks/wq_kernels_bench.py --design "$PART" --out "$OUT/design_$PART.json"
grep -E "^===|ok|FAIL|summary|x bf16|bit-equal|best|Error|us" "$LOG" | cut -c1-220 | tail -80
