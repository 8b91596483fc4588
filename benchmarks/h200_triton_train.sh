#!/usr/bin/env bash
# Wire-in check on a CUDA machine: the default mxfp8 run with the reference quantizer and
# with the Triton kernels must give identical losses; also compares their speed.
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
for b in reference triton; do
    python3 -m mxmoe train --recipe mxfp8 --quant-backend "$b" --out-dir "/tmp/run_$b" --no-progress "$@" \
        > "$OUT/train_mxfp8_$b.log" 2>&1
    tail -n 1 "$OUT/train_mxfp8_$b.log"
    cp "/tmp/run_$b/metrics.jsonl" "$OUT/metrics_mxfp8_$b.jsonl"
done
python3 - "$OUT" <<'PY'
import json, sys
runs = {b: [json.loads(l) for l in open(f"/tmp/run_{b}/metrics.jsonl")] for b in ("reference", "triton")}
same = [(a["step"], a["loss"]) for a in runs["reference"]] == [(b["step"], b["loss"]) for b in runs["triton"]]
print(f"losses identical at every step and eval: {same} ({len(runs['triton'])} lines)")
PY
