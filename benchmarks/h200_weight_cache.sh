#!/usr/bin/env bash
# One H200 session for the weight-copy cache and the one-launch wgrad operands (issue 4):
# part "check": CUDA tests and byte checks; part "bench": grouped GEMM and MoE layer
# benchmarks (torchao from PYTHONPATH if importable).
# Usage (repo root, torch + Triton on the GPU): COMMIT=<sha> OUT=<dir> bash benchmarks/h200_weight_cache.sh check|bench
set -u
PART=${1:-check}
OUT_DEFAULT=/tmp/h200_weight_cache LOG_NAME=$PART.log
. "$(dirname "$0")/h200_session.sh"
if [ "$PART" = check ]; then
  run 150 python3 -m pytest -q -p no:cacheprovider tests/test_weight_cache.py tests/test_moe_experts.py \
      tests/test_kernels_quantize.py -k "grouped_token or rowcol or weight or fused or moe or swiglu or gather"
  run 240 python3 benchmarks/check_kernels_cuda.py
  run 100 python3 benchmarks/check_grouped_cuda.py --recipes mxfp8
else
  run 240 python3 benchmarks/grouped_gemm.py --out "$OUT/grouped_gemm.json"
  run 220 python3 benchmarks/moe_layer.py --out "$OUT/moe_layer.json"
fi
grep -E "^===|FAIL|summary|met|MISSED|x bf16|passed|failed|exact|cached|amortized|two launches" "$LOG" | grep -v "^  ok" | cut -c1-240 | tail -90
