"""Probe (issue 4): can design (a)'s memory-bound passes run beside its compute-bound GEMM?

Design (a) at (65536, 7168, 2048, 64) spends ~1.36 ms in its x and weight passes (at the copy
ceiling) and ~3.06 ms in the bf16 GEMM, one after the other. If the passes could run on a few
SMs while the GEMM runs on the rest (experts in chunks: the pass of chunk c + 1 beside the
GEMM of chunk c), the sum would become roughly a maximum. That needs (i) the GEMM to keep its
speed per SM on a partition of the SMs, and (ii) the passes to draw far more bandwidth per SM
than they do on the whole GPU (4.2 TB/s over 132 SMs is 32 GB/s per SM). This probe measures
both with CUDA green contexts (``torch.cuda.green_contexts``): each op alone on a partition of
k SMs, eager launches timed with CUDA events on the partition's stream (medians of 10).

    PYTHONPATH=src:benchmarks python3 benchmarks/green_overlap.py --out r.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import torch


def timed(fn, stream, reps: int = 10) -> float:
    """Median milliseconds of ``fn`` on ``stream`` (2 warm-up calls)."""
    out = []
    with torch.cuda.stream(stream):
        for i in range(reps + 2):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            fn()
            b.record(stream)
            b.synchronize()
            if i >= 2:
                out.append(a.elapsed_time(b))
    return sorted(out)[len(out) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--sms", default="16,24,32,48,66,100,116", help="partition sizes to try")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this probe runs on the H200", file=sys.stderr)
        return 2
    from grouped_gemm import issue_case

    from mxmoe.ops.gemm import grouped_mm_nt
    from mxmoe.ops.quantize import fake_quantize
    from mxmoe.ops.weight_cache import weight_operands
    from mxmoe.recipe import get_recipe

    gc = torch.cuda.green_contexts.GreenContext
    api = {"create": str(inspect.signature(gc.create)), "members": sorted(m for m in dir(gc) if not m.startswith("__"))}
    print(json.dumps(api), flush=True)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    T, K, N, E = 65536, 7168, 2048, 64
    _, offs, x, w, _ = issue_case(T, K, N, E, False, dev)
    r = get_recipe("mxfp8")
    xq = fake_quantize(x, r, dim=1, out_dtype=torch.bfloat16)
    wq, _ = weight_operands(w, r, torch.bfloat16, dgrad=False)
    ops = {
        "gemm (dequantized operands)": lambda: grouped_mm_nt(xq, wq, offs),
        "x pass": lambda: fake_quantize(x, r, dim=1, out_dtype=torch.bfloat16),
        "weight pass": lambda: weight_operands(w, r, torch.bfloat16, dgrad=False),
        "copy 1.88 GB": lambda: dst.copy_(w),
    }
    dst = torch.empty_like(w)
    main_stream = torch.cuda.current_stream()
    rows = {"all SMs": {k: timed(f, main_stream) for k, f in ops.items()}}
    print("all SMs", rows["all SMs"], flush=True)
    for k in [int(s) for s in args.sms.split(",")]:
        try:
            try:
                ctx = gc.create(num_sms=k, device_id=0)
            except TypeError:
                ctx = gc.create(k, 0)
            if hasattr(ctx, "Stream"):
                s = ctx.Stream()
                res = {name: timed(f, s) for name, f in ops.items()}
            else:  # the 2.10 API: the green context made current
                ctx.set_context()
                try:
                    s = torch.cuda.Stream()
                    res = {name: timed(f, s) for name, f in ops.items()}
                finally:
                    ctx.pop_context()
        except Exception as e:  # noqa: BLE001 - report and go on
            res = {"error": f"{type(e).__name__}: {e}"[:300]}
        rows[f"{k} SMs"] = res
        print(f"{k} SMs", res, flush=True)
    # both at once: the passes on a partition of k SMs, the GEMM on one of 132 - k (disjoint
    # only if the driver hands out different SMs: then the time is near the larger of the two)
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    for k in [int(s) for s in args.sms.split(",")]:
        try:
            cp, cg = gc.create(num_sms=k, device_id=0), gc.create(num_sms=nsm - k, device_id=0)
            sp, sg = cp.Stream(), cg.Stream()

            def both():
                ev = torch.cuda.Event()
                ev.record(main_stream)
                sp.wait_event(ev)
                sg.wait_event(ev)
                with torch.cuda.stream(sp):
                    fake_quantize(x, r, dim=1, out_dtype=torch.bfloat16)
                    weight_operands(w, r, torch.bfloat16, dgrad=False)
                with torch.cuda.stream(sg):
                    grouped_mm_nt(xq, wq, offs)
                main_stream.wait_stream(sp)
                main_stream.wait_stream(sg)

            res = {"passes beside gemm": timed(both, main_stream)}
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}"[:300]}
        rows[f"both, passes on {k} SMs"] = res
        print(f"both, passes on {k} SMs", res, flush=True)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("COMMIT", "unknown"),
            "date": time.strftime("%Y-%m-%d"), "shape": [T, K, N, E], "api": api}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "ms": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
