#!/usr/bin/env bash
# H200 sessions (issue 4, session 15 on): design (g) in the library, the forward and the dgrad
# (mxmoe/kernels/cutlass_wq.py). Part "check": benchmarks/check_grouped_wq.py (every edge case
# bit for bit against design (a), and the per-call ratios of both at the issue's shapes);
# part "gemm": benchmarks/grouped_gemm.py (the issue's table; --no-torchao unless TORCHAO_WHEEL, below); part "w8":
# benchmarks/cutlass_w8.py (design (b) in CUTLASS, measured, not dispatched); "all": the three.
# The builds come from the cache folder MXMOE_CACHE_DIR (default .whl/cache, carried; fill it
# on a machine with nvcc and CUTLASS 4.2's headers: python -c "from mxmoe.kernels import
# cutlass_wq as c; c._build('e4m3', 'rceil', 'dgrad')" and so on for e5m2 / floor and the forward).
# TORCHAO_WHEEL=<path of a torchao wheel> (the H200 machine has no network: carry it, e.g.
# `pip download torchao==0.18.0 --no-deps -d .whl`): installed into a side folder, and part
# "gemm" then also times torchao's emulated MXFP8 grouped GEMM (the issue's ">= 8x torchao").
# Usage (repo root): COMMIT=<sha> OUT=<dir> [TORCHAO_WHEEL=...] bash benchmarks/h200_design_g.sh [check|gemm|w8|all]
set -u
PART=${1:-all}
case "$PART" in check|gemm|w8|all) ;; *) echo "unknown part '$PART': use check, gemm, w8 or all" >&2; exit 2;; esac
if ! PYTHONPATH=src python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "no CUDA device: this script runs on the H200" >&2; exit 2
fi
OUT_DEFAULT=/tmp/h200_design_g LOG_NAME=design_g_$PART.log
. "$(dirname "$0")/h200_session.sh"
export PYTHONPATH=benchmarks:$PYTHONPATH MXMOE_CACHE_DIR=${MXMOE_CACHE_DIR:-.whl/cache}
ls "$MXMOE_CACHE_DIR" | tee -a "$LOG"
if [ "$PART" = check ] || [ "$PART" = all ]; then
  run 400 python3 benchmarks/check_grouped_wq.py --out "$OUT/check_grouped_wq.json"
  grep -vE "^\s*$" "$LOG" | cut -c1-220 | tail -60
fi
if [ "$PART" = gemm ] || [ "$PART" = all ]; then
  TAO=--no-torchao
  if [ -n "${TORCHAO_WHEEL:-}" ]; then
    rm -rf /tmp/mxmoe_torchao  # a fresh side folder: no older torchao beside the wheel's
    if python3 -m pip install -q --no-deps --target /tmp/mxmoe_torchao "$TORCHAO_WHEEL" >>"$LOG" 2>&1 &&
       PYTHONPATH=$PYTHONPATH:/tmp/mxmoe_torchao python3 -c "import sys, importlib.metadata as m
from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm  # what grouped_gemm.py calls
from torchao.quantization.quantize_.common import KernelPreference
print('torchao', m.version('torchao'), 'from', sys.argv[1])" "$TORCHAO_WHEEL" >>"$LOG" 2>&1; then
      export PYTHONPATH=$PYTHONPATH:/tmp/mxmoe_torchao TAO=
      tail -1 "$LOG"
    else
      echo "TORCHAO_WHEEL=$TORCHAO_WHEEL did not install or import (see the log): no torchao column" | tee -a "$LOG"
    fi
  fi
  run 540 python3 benchmarks/grouped_gemm.py $TAO --out "$OUT/grouped_gemm.json"
  grep -E "summary|T=|mx (fwd|dgrad)|bf16 (fwd|dgrad)|torchao" "$LOG" | tail -48
fi
if [ "$PART" = w8 ] || [ "$PART" = all ]; then
  run 300 python3 benchmarks/cutlass_w8.py --out "$OUT/cutlass_w8.json"
  grep -E "FAIL|T=|: \(a\)|: \(b\) w8 " "$LOG" | tail -30
fi
