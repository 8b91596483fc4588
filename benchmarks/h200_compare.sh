#!/usr/bin/env bash
# mxmoe compare --preset h200 on one H200: bf16 then mxfp8, then the report.
# Usage (repo root): COMMIT=<sha> OUT=<dir> bash benchmarks/h200_compare.sh [extra flags]
set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/h200_compare}; RUN=/tmp/h200_compare_run; mkdir -p "$OUT" "$RUN"
for r in bf16 mxfp8; do
  timeout 280 python3 -m mxmoe compare --preset h200 --recipes $r --ckpt-interval 0 --out-dir "$RUN" "$@" 2>&1 | grep -v "^step" | tail -4
done
timeout 60 python3 -m mxmoe compare --preset h200 --recipes bf16,mxfp8 --reuse --ckpt-interval 0 --out-dir "$RUN" "$@" 2>&1 | tail -3
cp "$RUN"/report.md "$RUN"/loss.png "$RUN"/metrics-*.jsonl "$OUT"/ 2>/dev/null
sed -n 1,40p "$OUT/report.md"
