"""Designs (e) (benchmarks/gluon_wq_tma.py, Gluon) and (f) (benchmarks/cuda_wq_cluster.py,
CUDA with 2-CTA clusters) on the H200: exactness checks, a sweep of settings, and the
per-call forward against bf16 torch._grouped_mm and design (a). ``--design e`` or ``f``.

Checks (each prints ok or FAIL):
- the quantized weight value for value: with one-hot token rows (x = I, one expert) the
  output is Q(w)^T exactly (one product per output, exact in float32; only a zero's sign is
  lost, -0 + 0 = +0); weights with blocks of every binade (float32 subnormal scales, bf16
  subnormal elements, ties, saturation), compared with the quantize pass
  (``fake_quantize``); rows holding an inf or NaN block must be NaN, the others finite;
- the grouped output against design (a) (the same dequantized operands) bit for bit, at
  ragged groups with empty experts, N = 33 and 264, K = 1408 / 2880 / 40 / 1416 (not all
  multiples of 64: TMA's zero fill pads the last block), zeros past the last offset, T = 0;
  and at every setting of the sweep and every timed shape (a setting that is not exact is
  a failure and never the one the shapes are timed with);
- floor and rceil scales, e4m3 and e5m2.
Timing (CUDA-graph replay, median): at (16384, 2048, 1408, 64), with the issue's routing
and with 256 tokens per expert, a sweep of settings, each also as a plain bf16 GEMM on the
same skeleton (``direct``: the raw weight tile into the MMA) and, for (e), without its
quantization, without its MMA and with its data movement alone (``direct``, no MMA); then
per shape of issue 4, bf16, (a) per call, the design with the x pass and its kernel alone.

    PYTHONPATH=src:benchmarks python3 benchmarks/wq_kernels_bench.py --design e|f [--out e.json]

The commit is read from the environment variable COMMIT. Needs a CUDA GPU (exit 2 without).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from grouped_gemm import SHAPES, SKEWED, group_sizes

SWEEP = {  # per design: settings (keyword arguments), the first one also timed at balanced routing
    "e": [dict(block_w=bw, block_t=bt, block_k=bk, stages=st, num_warps=nw, order=o) for bw, bt, bk, st, nw, o in [
        (128, 256, 64, 4, 8, "weight"), (128, 256, 64, 3, 8, "weight"), (128, 256, 64, 3, 8, "token"),
        (128, 128, 64, 4, 8, "weight"), (128, 256, 32, 5, 8, "weight")]],
    "f": [dict(tokens=320, stages=3, order="weight"), dict(tokens=320, stages=3, order="token"),
          dict(tokens=320, stages=3, order="weight", epi=False), dict(tokens=256, stages=4, order="weight", epi=False)],
}
REFS = {  # timing references per design: name -> extra keyword arguments
    "e": {"kernel": {}, "no quant": dict(quantize=False), "no mma": dict(mma=False),
          "bf16 on this skeleton (direct)": dict(direct=True),
          "data movement only (direct, no mma)": dict(direct=True, mma=False)},
    "f": {"kernel": {}, "bf16 on this skeleton (direct)": dict(direct=True)},
}


def special_weight(device, N: int = 96, K: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """A (1, N, K) bf16 weight whose 32-element blocks along K cover every binade (float32
    subnormal scales, bf16 subnormal elements), with rows of special blocks: 0 a block whose
    scale is subnormal, 1 ties at the E4M3 grid, 2 near the bf16 maximum, 3-5 a non-finite
    element (inf, NaN, -inf), 6 and 7 E4M3 subnormal codes and their ties (+ and -). Returns
    it and the (N,) mask of the rows with a non-finite block (their outputs must be NaN)."""
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(1, N, K, device=device, generator=g)
    blk = torch.randint(-150, 110, (1, N, K // 32, 1), device=device, generator=g).float()
    w = (w.view(1, N, K // 32, 32) * torch.exp2(blk)).view(1, N, K)
    w[0, 0, :32] = 448.0 * torch.exp2(torch.tensor(-140.0))  # subnormal block
    w[0, 1, :32] = torch.tensor([1.0, 1.0625, 1.125, 1.1875] * 8) * 256  # ties at the e4m3 grid
    w[0, 2, :32] = 3.0e38  # near bf16 max
    sub = torch.cat([torch.tensor([448.0]), torch.arange(1, 32) * 2.0 ** -10])  # E4M3 subnormals and their ties
    w[0, 6, :32] = sub
    w[0, 7, 32:64] = -sub
    w = w.to(torch.bfloat16)
    w[0, 3, 5] = float("inf")
    w[0, 4, 40] = float("nan")
    w[0, 5, 70] = -float("inf")
    bad_rows = torch.zeros(N, dtype=torch.bool, device=device)
    bad_rows[[3, 4, 5]] = True
    return w, bad_rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON result file")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds for the whole run (default 400)")
    ap.add_argument("--design", choices=("e", "f"), default="e", help="e: Gluon (default); f: CUDA, 2-CTA clusters")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        print("wq_kernels_bench.py times GPU kernels; no CUDA GPU here", file=sys.stderr)
        return 2
    import triton
    from quantize import bench

    if args.design == "e":
        from gluon_wq_tma import gluon_grouped_mm_wq_tma_fwd as efwd
    else:
        from cuda_wq_cluster import cuda_grouped_mm_wq_fwd as efwd
    from mxmoe.ops.gemm import grouped_mm_nt
    from mxmoe.ops.quantize import fake_quantize
    from mxmoe.recipe import get_recipe

    t0 = time.time()
    d = args.design
    recipe = get_recipe("mxfp8")
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
            "fmt": str(recipe.fmt), "mode": str(recipe.scale_mode), "timing": "CUDA-graph replay, median",
            "design": args.design}
    print(json.dumps(info), flush=True)
    bf = torch.bfloat16
    fails = []

    def fq(t, dim, fmt=recipe.fmt, mode=recipe.scale_mode):
        return fake_quantize(t, get_recipe(recipe, fmt=fmt, scale_mode=mode), dim=dim, out_dtype=bf)

    def report(name, ok, extra=""):
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {extra}", flush=True)
        if not ok:
            fails.append(name)

    # ---- the quantized weight bit for bit (one-hot tokens) ----
    w, bad_rows = special_weight("cuda")
    K = w.shape[2]
    x = torch.eye(K, device="cuda", dtype=bf)
    offs = torch.tensor([K], device="cuda", dtype=torch.int32)
    for fmt in ("e4m3", "e5m2"):
        for mode in ("rceil", "floor"):
            out = efwd(x, w, offs, fmt=fmt, mode=mode)  # (K, N) = Q(w)^T
            ref = fq(w, 2, fmt, mode)[0].t()
            good = ~bad_rows
            o, r = out[:, good], ref[:, good]
            # values, not bits: the GEMM sums -0 + 0 = +0, so a zero's sign does not survive it
            same = bool(((o == r) | (o.isnan() & r.isnan())).all())
            nan_ok = bool(out[:, bad_rows].isnan().all()) and bool(o.isfinite().all())
            report(f"one-hot Q(w) value for value {fmt} {mode}", same and nan_ok,
                   f"(differing values {int((o != r).sum())}; rows with a non-finite block NaN, the rest finite: {nan_ok})")
    # ---- grouped output against design (a) ----
    for (T, K, N, sizes) in [(4000, 1408, 33, [162, 0, 2577, 446, 0, 83]), (3000, 2880, 256, [3000]),
                             (5000, 2048, 200, [0] * 30 + [1200, 33, 0, 64]), (1000, 1408, 128, [0, 0, 0]),
                             (700, 40, 96, [300, 0, 350]), (2000, 1416, 264, [257, 1000, 700])]:  # K % 64 != 0
        x = torch.randn(T, K, device="cuda", dtype=bf)
        w = (torch.randn(len(sizes), N, K, device="cuda") * 0.02).to(bf)
        offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        xq = fq(x, 1)
        ref = grouped_mm_nt(xq, fq(w, 2), offs)
        out = efwd(xq, w, offs)
        rel = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()
        end = int(offs[-1])
        report(f"grouped vs (a) T={T} K={K} N={N} groups={len(sizes)} bit for bit",
               torch.equal(out, ref) and bool((out[end:] == 0).all()), f"max rel diff {rel:.2e}")
    out = efwd(torch.empty(0, 64, device="cuda", dtype=bf), torch.randn(2, 8, 64, device="cuda", dtype=bf),
               torch.zeros(2, device="cuda", dtype=torch.int32))
    report("T = 0", out.shape == (0, 8))

    # ---- sweep at the weight-heavy shape; the skeleton's own speed (balanced and issue routing) ----
    T, K, N, E = SHAPES[2]
    x = torch.randn(T, K, device="cuda", dtype=bf)
    w = (torch.randn(E, N, K, device="cuda") * 0.02).to(bf)
    w_t = w.transpose(-2, -1)
    xq = fq(x, 1)
    best = None
    skeleton = {}
    for label, sizes in (("issue routing", group_sizes(T, E, False)), ("balanced, 256 tokens per expert", [T // E] * E)):
        offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        ref = grouped_mm_nt(xq, fq(w, 2), offs)
        t_bf = bench(lambda: torch._grouped_mm(x, w_t, offs=offs), graph=True)
        print(f"sweep at {SHAPES[2]}, {label}: bf16 {t_bf * 1e6:.1f} us", flush=True)
        refs = REFS[args.design]
        for kw in SWEEP[args.design] if label == "issue routing" else SWEEP[args.design][:1]:
            try:
                out = efwd(xq, w, offs, **kw)
                torch.cuda.synchronize()
                eq = torch.equal(out, ref)
                us = {v: bench(lambda r=r: efwd(xq, w, offs, **r, **kw), rep=60, graph=True) * 1e6
                      for v, r in refs.items()}
            except Exception as e:  # noqa: BLE001 - report and go on
                report(f"sweep {label} {kw} runs", False, f"{type(e).__name__}: {str(e)[:300]}")
                continue
            print(f"  {kw}: {json.dumps({k: round(v, 1) for k, v in us.items()})} x bf16 "
                  f"{t_bf * 1e6 / us['kernel']:.3f} bit-equal to (a) {eq}", flush=True)
            skeleton.setdefault(label, []).append({"setting": kw, "bf16_us": t_bf * 1e6, "us": us, "bit_equal_to_a": eq})
            report(f"sweep {label} {kw} bit-equal to (a)", eq)
            if label == "issue routing" and eq and (best is None or us["kernel"] < best[0]):
                best = (us["kernel"], kw)
    kw = best[1] if best is not None else None
    print("best:", kw, flush=True)
    del x, w, xq, ref
    rows = []
    for (T, K, N, E), skewed in [(s, False) for s in SHAPES] + [(SKEWED, True)]:
        if kw is None:  # no setting was exact: nothing to time
            break
        if time.time() - t0 > args.budget:
            print(f"budget spent, skipped {(T, K, N, E)}")
            continue
        offs = torch.tensor(group_sizes(T, E, skewed), device="cuda").cumsum(0).to(torch.int32)
        x = torch.randn(T, K, device="cuda", dtype=bf)
        w = (torch.randn(E, N, K, device="cuda") * 0.02).to(bf)
        w_t = w.transpose(-2, -1)
        xq = fq(x, 1)
        t = {"bf16": bench(lambda: torch._grouped_mm(x, w_t, offs=offs), graph=True),
             "(a)": bench(lambda: grouped_mm_nt(fq(x, 1), fq(w, 2), offs), graph=True),
             f"({d})": bench(lambda: efwd(fq(x, 1), w, offs, **kw), graph=True),
             f"({d}) kernel": bench(lambda: efwd(xq, w, offs, **kw), graph=True),
             "x pass": bench(lambda: fq(x, 1), graph=True)}
        for order in ("weight", "token"):
            if order != kw["order"]:
                t[f"({d}) kernel, order {order}"] = bench(lambda: efwd(xq, w, offs, **{**kw, "order": order}), graph=True)
        name = f"T={T} K={K} N={N} E={E}{' skewed' if skewed else ''}"
        eq = torch.equal(efwd(xq, w, offs, **kw), grouped_mm_nt(xq, fq(w, 2), offs))
        report(f"({d}) bit-equal to (a) at {name}", eq)
        print(f"\n{name}: ({d}) bit-equal to (a): {eq}")
        flop = 2.0 * T * K * N
        for k, v in t.items():
            print(f"  {k:28s} {v * 1e6:9.1f} us {flop / v / 1e12:7.1f} TFLOP/s  x bf16 {t['bf16'] / v:6.3f}")
        rows.append({"T": T, "K": K, "N": N, "E": E, "skewed": skewed, "bit_equal_to_a": eq,
                     "us": {k: v * 1e6 for k, v in t.items()}, "x_bf16": {k: t["bf16"] / v for k, v in t.items()}})
        del x, w, w_t, xq
        torch.cuda.empty_cache()
    print(f"\nsummary: {len(fails)} check failures {fails}")
    if args.out:
        args.out.write_text(json.dumps({"info": info, "setting": kw, "fails": fails, "skeleton": skeleton, "rows": rows},
                                       indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
