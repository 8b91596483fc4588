#!/usr/bin/env bash
# Expert parallelism on a two-GPU machine (the H200 run of issue 6). Writes under $OUT
# (default out/h200x2_expert_parallel): gpu.txt, train logs and metrics, compare.txt,
# and the benchmark's expert_parallel.{txt,json}. Run from the repository root:
#   COMMIT=<sha> bash benchmarks/h200x2_expert_parallel.sh            # both parts, about 5 minutes
#   PARTS=train COMMIT=<sha> bash benchmarks/h200x2_expert_parallel.sh  # or one part: train | bench
# No network needed; PYTHONPATH=src (nothing installed). TRAIN_FLAGS adds flags to every
# training run (for example a shorter run); BENCH_FLAGS to the benchmark.
set -euo pipefail
OUT=${OUT:-out/h200x2_expert_parallel}
PARTS=${PARTS:-"train bench"}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 COMMIT=${COMMIT:-unknown}
# NVLink multicast stays off (the machines' rule; NCCL's all-reduce would otherwise try it)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpu.txt"
echo "commit $COMMIT" | tee -a "$OUT/gpu.txt"

if [[ " $PARTS " == *" train "* ]]; then
    # the default mxmoe train run (global batch 16 x 256) on one GPU and over two, and the
    # MXFP8-dispatch pair (one GPU with --mx-dispatch is its exact single-process twin)
    run() {  # name, then the command
        local name=$1; shift
        "$@" --recipe mxfp8 --no-progress --out-dir "/tmp/ep_$name" ${TRAIN_FLAGS:-} > "$OUT/train_$name.log" 2>&1
        tail -n 1 "$OUT/train_$name.log"
        cp "/tmp/ep_$name/metrics.jsonl" "$OUT/metrics_$name.jsonl"
    }
    run 1gpu python3 -m mxmoe train
    run ep2 torchrun --nproc-per-node 2 -m mxmoe train --expert-parallel 2
    run 1gpu_mx python3 -m mxmoe train --mx-dispatch
    run ep2_mx torchrun --nproc-per-node 2 -m mxmoe train --expert-parallel 2 --mx-dispatch
    python3 - "$OUT" <<'PY' | tee "$OUT/compare.txt"
import json, sys
out = sys.argv[1]
read = lambda n: [json.loads(l) for l in open(f"{out}/metrics_{n}.jsonl")]
for a, b in (("1gpu", "ep2"), ("1gpu_mx", "ep2_mx")):
    x, y = read(a), read(b)
    assert [(m["kind"], m["step"]) for m in x] == [(m["kind"], m["step"]) for m in y], (a, b)
    rel = [abs(p["loss"] - q["loss"]) / abs(p["loss"]) for p, q in zip(x, y)]
    tr = [(p, q) for p, q in zip(x, y) if p["kind"] == "train"]
    speed = lambda ms: sum(m["ms_per_step"] for m in ms[5:]) / len(ms[5:])
    print(f"{a} vs {b}: step-1 loss {tr[0][0]['loss']!r} vs {tr[0][1]['loss']!r}; max rel loss diff "
          f"{max(rel):.2e} over {len(rel)} lines; last train loss {tr[-1][0]['loss']:.4f} vs {tr[-1][1]['loss']:.4f}; "
          f"ms/step (steps 6+) {speed([p for p, _ in tr]):.1f} vs {speed([q for _, q in tr]):.1f}")
PY
fi

if [[ " $PARTS " == *" bench "* ]]; then
    python3 benchmarks/expert_parallel.py --out-dir "$OUT" ${BENCH_FLAGS:-} 2>&1 | tee "$OUT/bench.log"
fi
