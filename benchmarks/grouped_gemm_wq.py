"""Designs (c) and (d) of the MXFP8 grouped GEMM: the weight quantized inside the GEMM.

Design (a) (benchmarks/grouped_gemm.py) pays a memory-bound pass over the bf16 weight in
every forward and dgrad call; at E = 64 that pass costs 179-904 us, more than the 15%
budget of the 0.85x target. Both designs here read the raw bf16 weight tile by tile inside
the GEMM and quantize and dequantize it in registers with the quantizers' own scale and
rounding helpers: no pass over the weight, at the price of CUDA-core work in the GEMM.
The activation (x, or dy for the dgrad) still takes its quantize pass.

- (c) ``mxmoe.kernels.grouped_gemm.triton_grouped_mm_wq``: a Triton grouped GEMM, forward
  and dgrad (tl.dot; Triton schedules the quantization and the MMA).
- (d) ``benchmarks/gluon_wq.py``: a Gluon wgmma kernel, forward only, explicitly
  pipelined so that the quantization of step i + 1 runs while the tensor core works on
  step i; also timed without the quantization (the same kernel's GEMM alone).

For each shape of issue 4, in one process:
  bf16          torch._grouped_mm on bf16 operands (the baseline)
  (a)           the activation pass, the weight pass, torch._grouped_mm (per call)
  (c), (d)      the activation pass + the kernel (fastest swept launch setting)
  ...: kernel   the kernel alone
and a check against (a) (the same dequantized operands; only the float32 accumulation
order may differ): max |design - a| / max |a| over the output, bf16 outputs.

    PYTHONPATH=src:benchmarks python3 benchmarks/grouped_gemm_wq.py [--designs c,d] [--out wq.json]

Timing: CUDA-graph replay (benchmarks/quantize.py ``bench``). The commit is read from the
environment variable COMMIT. Needs a CUDA GPU (exits with status 2 without one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from grouped_gemm import SHAPES, SKEWED, group_sizes

D_SWEEP = [  # design (d): (block_w, block_t, block_k, stages, num_warps, w_async); each also without the
    # quantization (quantize=False: the kernel's GEMM alone) and without the MMA (mma=False: its
    # quantization and data movement alone), timing references
    (128, 256, 64, 3, 8, False), (128, 256, 64, 4, 8, True),
]
SWEEP = [  # (block_m, block_n, block_k, num_warps, num_stages)
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3),
    (64, 128, 64, 4, 4), (128, 128, 32, 8, 4), (256, 128, 64, 8, 3), (64, 256, 64, 8, 3),
    (128, 64, 64, 4, 4), (128, 256, 32, 8, 4), (256, 128, 32, 8, 4), (64, 128, 128, 4, 3),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON result file")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole run (default 240)")
    ap.add_argument("--designs", default="c,d", help="designs to run besides (a): c (Triton), d (Gluon)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        print("grouped_gemm_wq.py times GPU kernels; no CUDA GPU here", file=sys.stderr)
        return 2
    import triton
    from quantize import bench

    from gluon_wq import gluon_grouped_mm_wq_fwd
    from mxmoe.kernels.grouped_gemm import WQ_TUNING, GemmConfig, triton_grouped_mm_wq
    from mxmoe.ops.gemm import grouped_mm_nn, grouped_mm_nt
    from mxmoe.ops.quantize import fake_quantize
    from mxmoe.recipe import get_recipe

    t_start = time.time()
    recipe = get_recipe("mxfp8")
    fmt, mode = recipe.fmt, recipe.scale_mode
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
            "fmt": str(fmt), "mode": str(mode), "timing": "CUDA-graph replay"}
    print(json.dumps(info), flush=True)
    bf = torch.bfloat16

    def fq(t, dim):
        return fake_quantize(t, recipe, dim=dim, out_dtype=bf)

    def case(T, K, N, E, skewed):
        offs = torch.tensor(group_sizes(T, E, skewed), device="cuda").cumsum(0).to(torch.int32)
        x = torch.randn(T, K, device="cuda", dtype=bf)
        w = (torch.randn(E, N, K, device="cuda") * 0.02).to(bf)
        dy = torch.randn(T, N, device="cuda", dtype=bf)
        return offs, x, w, dy

    def c_fn(op, x, w, dy, offs, cfg):
        if op == "fwd":
            return lambda: triton_grouped_mm_wq(fq(x, 1), w, offs, fmt=fmt, mode=mode, config=cfg)
        return lambda: triton_grouped_mm_wq(fq(dy, 1), w, offs, fmt=fmt, mode=mode, dgrad=True, config=cfg)

    designs = set(args.designs.split(","))
    # sweep the launch settings at the weight-heavy shape, forward and dgrad
    sweep = {}
    offs, x, w, dy = case(*SHAPES[2], False)
    xq, dyq = fq(x, 1), fq(dy, 1)
    d_cfg = None
    if "d" in designs:
        ref = grouped_mm_nt(xq, fq(w, 2), offs)
        res = []
        for (bw, bt, bk, st, nw, wa), (qz, mm) in [(c, v) for c in D_SWEEP for v in ((1, 1), (0, 1), (1, 0))]:
            kw = dict(block_w=bw, block_t=bt, block_k=bk, stages=st, num_warps=nw, w_async=bool(wa), quantize=bool(qz),
                      mma=bool(mm))
            try:
                fn = (lambda kw=kw: gluon_grouped_mm_wq_fwd(xq, w, offs, fmt=fmt, mode=mode, **kw))
                out = fn()
                torch.cuda.synchronize()
                diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                us = bench(fn, rep=40, graph=True) * 1e6
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"  sweep (d) {kw}: {type(e).__name__}: {str(e)[:300]}")
                continue
            print(f"  sweep (d) fwd {kw}: {us:8.1f} us, max |d - a| / max |a| {diff:.2e}", flush=True)
            if qz and mm and diff < 1e-2:
                res.append((us, kw))
        res.sort(key=lambda r: r[0])
        d_cfg = res[0][1] if res else None
        del ref
    for op in ("fwd", "dgrad") if "c" in designs else ():
        res = []
        for bm, bn, bk, nw, ns in SWEEP:
            if time.time() - t_start > args.budget * 0.45:
                break
            cfg = GemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=nw, num_stages=ns)
            a = xq if op == "fwd" else dyq
            try:
                fn = (lambda a=a, cfg=cfg, d=op == "dgrad":
                      triton_grouped_mm_wq(a, w, offs, fmt=fmt, mode=mode, dgrad=d, config=cfg))
                fn()
                torch.cuda.synchronize()
                us = bench(fn, rep=40, graph=True) * 1e6
            except Exception as e:  # noqa: BLE001 - a setting that does not compile (registers, smem)
                print(f"  sweep {op} {dataclasses.astuple(cfg)[:6]}: {type(e).__name__}: {str(e)[:100]}")
                continue
            res.append((us, cfg))
            print(f"  sweep {op} bm={bm} bn={bn} bk={bk} warps={nw} stages={ns}: {us:8.1f} us", flush=True)
        res.sort(key=lambda r: r[0])
        sweep[op] = res[0][1] if res else WQ_TUNING
    del offs, x, w, dy, xq, dyq
    rows = []
    for (T, K, N, E), skewed in [(s, False) for s in SHAPES] + [(SKEWED, True)]:
        if time.time() - t_start > args.budget:
            print(f"budget spent: T={T} K={K} N={N} E={E} skipped")
            continue
        offs, x, w, dy = case(T, K, N, E, skewed)
        flop = 2.0 * T * K * N
        t, check = {}, {}
        w_t = w.transpose(-2, -1)
        t["bf16 fwd"] = bench(lambda: torch._grouped_mm(x, w_t, offs=offs), graph=True)
        t["bf16 dgrad"] = bench(lambda: torch._grouped_mm(dy, w, offs=offs), graph=True)
        t["(a) fwd"] = bench(lambda: grouped_mm_nt(fq(x, 1), fq(w, 2), offs), graph=True)
        t["(a) dgrad"] = bench(lambda: grouped_mm_nn(fq(dy, 1), fq(w, 1), offs), graph=True)
        xq, dyq = fq(x, 1), fq(dy, 1)
        ref_f = grouped_mm_nt(xq, fq(w, 2), offs).float()
        ref_d = grouped_mm_nn(dyq, fq(w, 1), offs).float()
        if "c" in designs:
            for op in ("fwd", "dgrad"):
                t[f"(c) {op}"] = bench(c_fn(op, x, w, dy, offs, sweep[op]), graph=True)
            t["(c) fwd: kernel"] = bench(lambda: triton_grouped_mm_wq(xq, w, offs, fmt=fmt, mode=mode,
                                                                      config=sweep["fwd"]), graph=True)
            t["(c) dgrad: kernel"] = bench(lambda: triton_grouped_mm_wq(dyq, w, offs, fmt=fmt, mode=mode, dgrad=True,
                                                                        config=sweep["dgrad"]), graph=True)
            out_f = c_fn("fwd", x, w, dy, offs, sweep["fwd"])().float()
            out_d = c_fn("dgrad", x, w, dy, offs, sweep["dgrad"])().float()
            check["(c) fwd"] = ((out_f - ref_f).abs().max() / ref_f.abs().max()).item()
            check["(c) dgrad"] = ((out_d - ref_d).abs().max() / ref_d.abs().max()).item()
        if d_cfg is not None:
            t["(d) fwd"] = bench(lambda: gluon_grouped_mm_wq_fwd(fq(x, 1), w, offs, fmt=fmt, mode=mode, **d_cfg),
                                 graph=True)
            t["(d) fwd: kernel"] = bench(lambda: gluon_grouped_mm_wq_fwd(xq, w, offs, fmt=fmt, mode=mode, **d_cfg),
                                         graph=True)
            out_f = gluon_grouped_mm_wq_fwd(xq, w, offs, fmt=fmt, mode=mode, **d_cfg).float()
            check["(d) fwd"] = ((out_f - ref_f).abs().max() / ref_f.abs().max()).item()
            check["(d) fwd bit-equal to (a)"] = bool(torch.equal(out_f, ref_f))
        name = f"T={T} K={K} N={N} E={E}{' skewed' if skewed else ''}"
        print(f"\n{name}  (max |design - a| / max |a|: {json.dumps(check)})")
        print(f"  {'what':22s} {'us':>9s} {'TFLOP/s':>8s} {'x bf16':>7s}")
        for k, v in t.items():
            op = "fwd" if "fwd" in k else "dgrad"
            whole = ":" not in k
            print(f"  {k:22s} {v * 1e6:9.1f} {flop / v / 1e12 if whole else float('nan'):8.1f} "
                  f"{t[f'bf16 {op}'] / v if whole else float('nan'):7.2f}")
        rows.append({"T": T, "K": K, "N": N, "E": E, "skewed": skewed, "us": {k: v * 1e6 for k, v in t.items()},
                     "ratio": {k: t[f"bf16 {'fwd' if 'fwd' in k else 'dgrad'}"] / v for k, v in t.items() if ":" not in k},
                     "max_rel_diff_c_vs_a": check})
        del offs, x, w, dy, xq, dyq, ref_f, ref_d
        torch.cuda.empty_cache()
    cfgs = {op: dataclasses.asdict(c) for op, c in sweep.items()}
    cfgs["(d) fwd"] = d_cfg
    print("\nsettings used:", json.dumps(cfgs))
    if args.out:
        args.out.write_text(json.dumps({"info": info, "settings": cfgs, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
