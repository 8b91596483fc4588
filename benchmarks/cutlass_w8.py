"""Design (b) in CUTLASS on the H200 (issue 4, session 15): the weight's MXFP8 copy (FP8 codes
and E8M0 scales from the library's quantize pass, ``cutlass_wq.weight_copy_w8``) converted in
registers by CUTLASS's mixed-input mainloop (``cutlass_wq.cu`` VARIANT 4), for the forward
(blocks along K) and the dgrad (along N, the codes written transposed), against design (a)
(the dequantized bf16 copy, then ``torch._grouped_mm``) and bf16 ``torch._grouped_mm``.

Checks, bit for bit against design (a) on the same quantized operands: the issue's shapes,
ragged groups with empty experts, a special-value weight (every binade, subnormal scales,
E4M3 subnormal codes, non-finite blocks), E5M2. Timing per call (CUDA-graph replay): the
token pass + the weight pass + the GEMM, and the GEMM alone. Exits 1 if a check fails.

    MXMOE_CACHE_DIR=.whl/cache PYTHONPATH=src:benchmarks python3 benchmarks/cutlass_w8.py --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark runs on the H200", file=sys.stderr)
        return 2
    import triton
    from check_grouped_wq import write_and_report
    from grouped_gemm import SHAPES, SKEWED, issue_case
    from quantize import bench
    from wq_kernels_bench import special_weight

    from mxmoe.kernels import cutlass_wq as c
    from mxmoe.ops.gemm import grouped_mm_nn, grouped_mm_nt
    from mxmoe.ops.quantize import fake_quantize
    from mxmoe.recipe import get_recipe

    dev = torch.device("cuda")
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(info), flush=True)
    bf = torch.bfloat16

    def fq(t, r, dim):
        return fake_quantize(t, r, dim=dim, out_dtype=bf)

    def w8_fwd(x, w, offs, r):
        codes, s = c.weight_copy_w8(w, r, "forward")
        return c.grouped_mm_w8(fq(x, r, 1), codes, s, offs, r)

    def w8_dgrad(dy, w, offs, r):
        codes, s = c.weight_copy_w8(w, r, "dgrad")
        return c.grouped_mm_w8(fq(dy, r, 1), codes, s, offs, r)

    def a_fwd(x, w, offs, r):
        return grouped_mm_nt(fq(x, r, 1), fq(w, r, 2), offs)

    def a_dgrad(dy, w, offs, r):
        return grouped_mm_nn(fq(dy, r, 1), fq(w, r, 1), offs)

    def same(a, b):
        return a is not None and a.shape == b.shape and bool((a.view(torch.int16) == b.view(torch.int16)).all())

    checks = {}

    def check(name, x, w, dy, offs, r):
        try:
            of, oa = w8_fwd(x, w, offs, r), a_fwd(x, w, offs, r)
            df, da = w8_dgrad(dy, w, offs, r), a_dgrad(dy, w, offs, r)
            torch.cuda.synchronize()
            res = {"fwd equal": same(of, oa), "dgrad equal": same(df, da)}
            if of is not None and not res["fwd equal"]:
                res["fwd max abs diff"] = float((of.float() - oa.float()).abs().nan_to_num(1e30).max())
            if df is not None and not res["dgrad equal"]:
                res["dgrad max abs diff"] = float((df.float() - da.float()).abs().nan_to_num(1e30).max())
            res["ok"] = res["fwd equal"] and res["dgrad equal"]
        except Exception as e:  # noqa: BLE001 - report and go on
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        checks[name] = res
        print(f"  {name:50s} {res}", flush=True)

    r = get_recipe("mxfp8")
    gen = torch.Generator(dev).manual_seed(0)
    for sizes, K, N in (([162, 0, 2577, 446, 0, 83], 1408, 128), ([300, 17, 0, 900, 31], 2880, 256),
                        ([200] * 8, 2048, 1408)):
        T = sum(sizes) + 40
        x = torch.randn(T, K, device=dev, generator=gen).to(bf)
        dy = torch.randn(T, N, device=dev, generator=gen).to(bf)
        w = (torch.randn(len(sizes), N, K, device=dev, generator=gen) * 0.05).to(bf)
        offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
        check(f"sizes {sizes} K={K} N={N}", x, w, dy, offs, r)
        if K == 1408:
            check("  the same, E5M2", x, w, dy, offs, get_recipe("mxfp8", fmt="e5m2"))
            check("  the same, floor scales", x, w, dy, offs, get_recipe("mxfp8-floor"))
    # special values along K (forward) and, transposed, along N (dgrad); identity-like tokens
    ws, _ = special_weight(dev, N=128, K=2048)  # (1, 128, 2048)
    for name, w in (("special-value weight (blocks along K)", ws), ("special-value weight, transposed",
                                                                      ws.transpose(1, 2).contiguous())):
        E, N, K = w.shape
        x = torch.randn(256, K, device=dev, generator=gen).to(bf)
        dy = torch.randn(256, N, device=dev, generator=gen).to(bf)
        offs = torch.tensor([256], device=dev, dtype=torch.int32)
        check(name, x, w, dy, offs, r)
        check(name + ", E5M2", x, w, dy, offs, get_recipe("mxfp8", fmt="e5m2"))

    rows = []
    for (T, K, N, E), skewed in [(s, False) for s in SHAPES] + [(SKEWED, True)]:
        _, offs, x, w, dy = issue_case(T, K, N, E, skewed, dev)
        check(f"T={T} K={K} N={N} E={E}{' skewed' if skewed else ''}", x, w, dy, offs, r)
        cf, sf = c.weight_copy_w8(w, r, "forward")
        cd, sd = c.weight_copy_w8(w, r, "dgrad")
        xq, dyq = fq(x, r, 1), fq(dy, r, 1)
        t = {
            "fwd: bf16": bench(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)),
            "fwd: (a)": bench(lambda: a_fwd(x, w, offs, r)),
            "fwd: (b) w8": bench(lambda: w8_fwd(x, w, offs, r)),
            "fwd: (b) w8 gemm": bench(lambda: c.grouped_mm_w8(xq, cf, sf, offs, r)),
            "fwd: (b) w8 weight pass": bench(lambda: c.weight_copy_w8(w, r, "forward")),
            "dgrad: bf16": bench(lambda: torch._grouped_mm(dy, w, offs=offs)),
            "dgrad: (a)": bench(lambda: a_dgrad(dy, w, offs, r)),
            "dgrad: (b) w8": bench(lambda: w8_dgrad(dy, w, offs, r)),
            "dgrad: (b) w8 gemm": bench(lambda: c.grouped_mm_w8(dyq, cd, sd, offs, r)),
            "dgrad: (b) w8 weight pass": bench(lambda: c.weight_copy_w8(w, r, "dgrad")),
        }
        row = {"shape": [T, K, N, E], "skewed": skewed, "us": {k: round(v * 1e6, 1) for k, v in t.items()},
               "x bf16": {k: round(t[k.split(":")[0] + ": bf16"] / v, 3) for k, v in t.items() if "pass" not in k}}
        rows.append(row)
        print(f"\nT={T} K={K} N={N} E={E}{' skewed' if skewed else ''}")
        for k in t:
            print(f"  {k:30s} {row['us'][k]:9.1f} us {row['x bf16'].get(k, float('nan')):7.3f}x", flush=True)
        del x, w, dy, cf, sf, cd, sd, xq, dyq
        torch.cuda.empty_cache()
    return write_and_report(args.out, info, checks, rows)


if __name__ == "__main__":
    sys.exit(main())
