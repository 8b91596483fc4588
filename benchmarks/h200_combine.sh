#!/usr/bin/env bash
# One H200 session for the fused combine / un-permute kernels (issue 4, the MoE layer against
# the torch.compile'd BF16 layer): part "bench": the CUDA tests of the new kernels and the
# layer, the kernels against the torch path (benchmarks/combine.py --sweep), then the MoE
# layer with --compile; part "verify": the tests, combine.py and the eager layer; part "check": the byte checks of the
# other kernels.
# Usage (repo root, torch + Triton on the GPU): COMMIT=<sha> OUT=<dir> bash benchmarks/h200_combine.sh bench|verify|check
set -u
PART=${1:-bench}
OUT_DEFAULT=/tmp/h200_combine LOG_NAME=$PART.log
. "$(dirname "$0")/h200_session.sh"
if [ "$PART" = bench ]; then
  run 150 python3 -m pytest -q -p no:cacheprovider tests/test_moe_experts.py tests/test_compile.py
  run 200 python3 benchmarks/combine.py --sweep --out "$OUT/combine.json"
  run 400 python3 benchmarks/moe_layer.py --compile --top 10 --out "$OUT/moe_layer_compiled.json"
elif [ "$PART" = verify ]; then  # after the review fixes: tests, kernels (incl. 300k tokens), eager layer
  run 120 python3 -m pytest -q -p no:cacheprovider tests/test_moe_experts.py
  run 120 python3 benchmarks/combine.py --out "$OUT/combine.json"
  run 240 python3 benchmarks/moe_layer.py --out "$OUT/moe_layer.json"
else
  run 240 python3 benchmarks/check_kernels_cuda.py
  run 100 python3 benchmarks/check_grouped_cuda.py --recipes mxfp8
fi
grep -vE "^W1|^\s+warnings.warn|_warn_once|UserWarning" "$LOG" | grep -E "^===|FAIL|summary|met|MISSED|x bf16|passed|failed|exact|equal|sweep|compiled|cached|ms  |us|Error|T=|  [a-z]" | grep -v "^  ok" | cut -c1-240 | tail -120
