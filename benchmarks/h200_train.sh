#!/usr/bin/env bash
# The foundation run on a CUDA machine: the CUDA check of the pure-torch path, then the
# default `mxmoe train` under bf16 and mxfp8. Writes logs and metrics under $OUT (or ./out).
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
echo "commit ${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" | tee -a "$OUT/gpu.txt"
python3 benchmarks/check_cuda_reference.py 2>&1 | tee "$OUT/check_cuda_reference.log"
for r in bf16 mxfp8; do
    python3 -m mxmoe train --recipe "$r" --out-dir "/tmp/run_$r" --no-progress "$@" > "$OUT/train_$r.log" 2>&1
    tail -n 1 "$OUT/train_$r.log"
    cp "/tmp/run_$r/metrics.jsonl" "$OUT/metrics_$r.jsonl"
done
