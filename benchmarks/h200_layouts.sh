#!/usr/bin/env bash
# One H200 session (issue 4, 2026-12-01): which operand layouts make the BF16 grouped GEMM
# of design (a) fastest, and the grouped GEMM benchmark against torchao.
# part "pair": launch settings of the wgrad operand pass (wgrad_pair_sweep.py);
# part "final": the CUDA tests of the grouped GEMMs (design (c) included) and the MoE
# expert op, then part "gluon"; part "gluon": the same with design (d) only (the Gluon kernel);
# part "wq": benchmarks/grouped_gemm_wq.py (design (c), the weight quantized inside the GEMM);
# part "layouts": benchmarks/gemm_layouts.py and the CUDA tests of the kernels changed since
# the last GPU run; part "bench": grouped_gemm.py (torchao from PYTHONPATH if importable).
# Usage (repo root, torch + Triton on the GPU): COMMIT=<sha> OUT=<dir> bash benchmarks/h200_layouts.sh layouts|wq|gluon|final|pair|bench
set -u
PART=${1:-layouts}
case "$PART" in layouts|wq|gluon|final|pair|bench) ;; *) echo "unknown part '$PART': use layouts|wq|gluon|final|pair|bench" >&2; exit 2;; esac
OUT_DEFAULT=/tmp/h200_layouts LOG_NAME=$PART.log
. "$(dirname "$0")/h200_session.sh"
if [ "$PART" = layouts ]; then
  run 200 python3 benchmarks/gemm_layouts.py --out "$OUT/gemm_layouts.json"
  run 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe_experts.py tests/test_kernels_quantize.py \
      -k "grid or launch or gather or swiglu or combine or grouped or rows"
  run 150 python3 benchmarks/check_kernels_cuda.py
elif [ "$PART" = wq ]; then
  run 330 python3 benchmarks/grouped_gemm_wq.py --out "$OUT/grouped_gemm_wq.json"
elif [ "$PART" = pair ]; then
  run 280 python3 benchmarks/wgrad_pair_sweep.py --out "$OUT/wgrad_pair_sweep.json"
elif [ "$PART" = final ]; then
  run 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_grouped_gemm.py tests/test_moe_experts.py
  run 200 python3 benchmarks/grouped_gemm_wq.py --designs d --out "$OUT/grouped_gemm_gluon.json"
elif [ "$PART" = gluon ]; then
  run 330 python3 benchmarks/grouped_gemm_wq.py --designs d --out "$OUT/grouped_gemm_gluon.json"
else
  run 300 python3 benchmarks/grouped_gemm.py --out "$OUT/grouped_gemm.json"
fi
grep -E "^===|FAIL|summary|x bf16|now|passed|failed|exact|x torchao|variant|sweep|design|\\(d\\)|\\(c\\)|\\(a\\)|bf16 |settings|Error" "$LOG" | grep -v "^  ok" | cut -c1-200 | tail -90
