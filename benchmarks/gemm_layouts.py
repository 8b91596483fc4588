"""Which memory layouts of its operands make BF16 ``torch._grouped_mm`` fastest on this GPU.

Design (a) of the MXFP8 grouped GEMM (benchmarks/grouped_gemm.py) writes a new bf16 copy
of every operand in its quantize pass, so it can write each copy in whatever layout the
GEMM runs fastest on, at no extra cost when the pass already writes that layout. This
script times ``torch._grouped_mm`` on the dequantized MXFP8 operands of each expert GEMM
with the weight (forward, dgrad) or both operands (wgrad) stored row-major or
column-major, at the shapes of issue 4, in rounds that interleave the variants (so that
clock drift hits them alike), and prints each variant's median over the rounds relative
to the layout the library uses now ("now").

    PYTHONPATH=src:benchmarks python3 benchmarks/gemm_layouts.py [--out layouts.json] [--rounds 3]

Timing: CUDA-graph replay (benchmarks/quantize.py ``bench``). The commit is read from the
environment variable COMMIT. Needs a CUDA GPU (exits with status 2 without one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from grouped_gemm import SHAPES, SKEWED, group_sizes


def variants(x, w, dy, offs, recipe):
    """name -> zero-argument callable running one torch._grouped_mm on dequantized operands."""
    from mxmoe.ops.quantize import fake_quantize, fake_quantize_grouped_tokens_pair

    bf = torch.bfloat16
    xq = fake_quantize(x, recipe, dim=1, out_dtype=bf)  # (T, K) along K
    dyq = fake_quantize(dy, recipe, dim=1, out_dtype=bf)  # (T, N) along N
    wk = fake_quantize(w, recipe, dim=2, out_dtype=bf)  # (E, N, K) along K
    wn = fake_quantize(w, recipe, dim=1, out_dtype=bf)  # (E, N, K) along N
    wk_kn = wk.transpose(-2, -1).contiguous()  # the same values stored (E, K, N)
    wn_kn = wn.transpose(-2, -1).contiguous()
    a_nl, b_kl, po = fake_quantize_grouped_tokens_pair(dy, x, offs, recipe, out_dtype=bf)  # (N, L), (K, L)
    a_ln, b_lk = a_nl.t().contiguous(), b_kl.t().contiguous()  # stored (L, N), (L, K)
    gm = torch._grouped_mm
    return {
        "fwd: w (E,N,K) [now]": lambda: gm(xq, wk.transpose(-2, -1), offs=offs),
        "fwd: w (E,K,N)": lambda: gm(xq, wk_kn, offs=offs),
        "dgrad: w (E,N,K) [now]": lambda: gm(dyq, wn, offs=offs),
        "dgrad: w (E,K,N)": lambda: gm(dyq, wn_kn.transpose(-2, -1), offs=offs),
        "wgrad: dy (N,L), x (K,L) [now]": lambda: gm(a_nl, b_kl.t(), offs=po),
        "wgrad: dy (N,L), x (L,K)": lambda: gm(a_nl, b_lk, offs=po),
        "wgrad: dy (L,N), x (L,K)": lambda: gm(a_ln.t(), b_lk, offs=po),
        "wgrad: dy (L,N), x (K,L)": lambda: gm(a_ln.t(), b_kl.t(), offs=po),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON result file")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant (default 3)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        print("gemm_layouts.py times torch._grouped_mm on a CUDA GPU; none here", file=sys.stderr)
        return 2
    import triton
    from quantize import bench

    from mxmoe.recipe import get_recipe

    recipe = get_recipe("mxfp8")
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
            "timing": "CUDA-graph replay, median of interleaved rounds"}
    print(json.dumps(info))
    rows = []
    for (T, K, N, E), skewed in [(s, False) for s in SHAPES] + [(SKEWED, True)]:
        offs = torch.tensor(group_sizes(T, E, skewed), device="cuda").cumsum(0).to(torch.int32)
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(E, N, K, device="cuda") * 0.02).to(torch.bfloat16)
        dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
        fns = variants(x, w, dy, offs, recipe)
        now_of = {k: next(n for n in fns if n.split(":")[0] == k.split(":")[0] and n.endswith("[now]")) for k in fns}
        ref = {k: fn() for k, fn in fns.items()}
        same = {k: torch.equal(ref[k], ref[now_of[k]]) for k in fns}  # one GEMM, other layouts: same bits?
        del ref
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                times[k].append(bench(fn, rep=60, graph=True))
        med = {k: statistics.median(v) for k, v in times.items()}
        name = f"T={T} K={K} N={N} E={E}{' skewed' if skewed else ''}"
        print(f"\n{name}\n  {'variant':34s} {'us':>8s} {'spread':>7s} {'now/this':>9s} {'bit-equal':>9s}")
        row = {"T": T, "K": K, "N": N, "E": E, "skewed": skewed, "us": {}, "spread_us": {}, "speedup_vs_now": {},
               "bit_equal_to_now": {}}
        for k in fns:
            now = med[now_of[k]]
            spread = (max(times[k]) - min(times[k])) * 1e6
            print(f"  {k:34s} {med[k] * 1e6:8.1f} {spread:7.1f} {now / med[k]:9.3f} {str(same[k]):>9s}")
            row["us"][k], row["spread_us"][k] = med[k] * 1e6, spread
            row["speedup_vs_now"][k], row["bit_equal_to_now"][k] = now / med[k], same[k]
        rows.append(row)
        del fns, x, w, dy
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
