#!/usr/bin/env bash
# One H200 session for torch.compile over the library (issue 4's MoE layer against the
# stronger BF16 baseline): part "compile": tests/test_compile.py on CUDA and the MoE layer
# benchmark with torch.compile'd bf16 and fused mxfp8 layers; part "check": the CUDA tests
# and byte checks of the weight cache / fused op / grouped quantizers.
# Usage (repo root, torch + Triton on the GPU): COMMIT=<sha> OUT=<dir> bash benchmarks/h200_compile.sh compile|check
set -u
PART=${1:-compile}
OUT_DEFAULT=/tmp/h200_compile LOG_NAME=$PART.log
. "$(dirname "$0")/h200_session.sh"
if [ "$PART" = compile ]; then
  run 150 python3 -m pytest -q -p no:cacheprovider tests/test_compile.py
  run 400 python3 benchmarks/moe_layer.py --compile --top 10 --out "$OUT/moe_layer_compiled.json"
else
  run 150 python3 -m pytest -q -p no:cacheprovider tests/test_weight_cache.py tests/test_moe_experts.py \
      tests/test_kernels_quantize.py tests/test_grouped_edges.py -k "grouped_token or rowcol or weight or fused or moe or swiglu or gather or zero or empty"
  run 240 python3 benchmarks/check_kernels_cuda.py
  run 100 python3 benchmarks/check_grouped_cuda.py --recipes mxfp8
fi
grep -vE "^W1|^\s+warnings.warn|_warn_once|UserWarning" "$LOG" | grep -E "^===|FAIL|summary|met|MISSED|x bf16|passed|failed|exact|compiled|cached|ms  |Error" | grep -v "^  ok" | cut -c1-240 | tail -90
