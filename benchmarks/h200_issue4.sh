#!/usr/bin/env bash
# One H200 session: GPU correctness of the quantizers, the grouped GEMMs and the fused MoE
# op, then the quantizer, grouped GEMM (design a and b) and MoE layer benchmarks.
# Usage (repo root, torch + Triton on the GPU): COMMIT=<sha> OUT=<dir> bash benchmarks/h200_issue4.sh
set -u
OUT_DEFAULT=/tmp/h200_issue4 LOG_NAME=all.log
. "$(dirname "$0")/h200_session.sh"
run 60 python3 -m pytest -q -p no:cacheprovider tests/test_moe_experts.py
run 80 python3 benchmarks/check_grouped_cuda.py --recipes mxfp8
run 50 python3 benchmarks/check_kernels_cuda.py
run 90 python3 benchmarks/quantize.py --out "$OUT/quantize.json"
run 120 python3 benchmarks/grouped_gemm.py --out "$OUT/grouped_gemm.json"
run 95 python3 benchmarks/grouped_gemm_tile.py --budget 85 --sweep-budget 30 --out "$OUT"
run 100 python3 benchmarks/moe_layer.py --out "$OUT/moe_layer.json"
grep -E "^===|FAIL|summary|met|MISSED|x bf16|passed|failed" "$LOG" | grep -v "^  ok" | cut -c1-220 | tail -80
