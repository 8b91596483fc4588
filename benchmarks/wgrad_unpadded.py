"""The wgrad of ``mx_grouped_mm`` in the padded token layout against the tokens' own rows.

Design (a)'s wgrad quantizes dY and X along tokens, each expert's tokens in their own
32-token blocks, and runs a bf16 grouped GEMM over the dequantized copies. Until session
17 the copies were written in the per-expert padded layout (each expert's last block
padded with zero rows, an empty expert given one block of zeros, Tp = 32 (T // 32 + E)
rows), so the GEMM contracted over the padded length. The unpadded variant writes the same
values into the tokens' own rows ((T, C): ``fake_quantize_grouped_colwise_pair_unpadded``)
and the GEMM contracts over the original offsets, zeroing the empty experts' matrices
after it (``grouped_mm_tn``'s ``zero_empty_groups_``). Fewer rows written, fewer
contraction steps; is it faster, and is it bit-equal?

For each issue shape (and routing) in one process, timed by CUDA-graph replay (median):
bf16 ``torch._grouped_mm``; the padded wgrad (pass + GEMM) and its parts; the unpadded
wgrad and its parts. Checks, per case: the dequantized values equal row for row; dW of the
two layouts bit-equal; dW of the unpadded layout with NaN written into the rows past the
last offset (never read) equal and finite; the issue's edge case [162, 0, 2577, 446, 0, 83]
with its empty experts' dW exactly 0.

    PYTHONPATH=src:benchmarks python3 benchmarks/wgrad_unpadded.py [--out results.json]

Needs a CUDA GPU (the H200); prints a table and writes JSON (GPU, versions, commit from
env COMMIT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from grouped_gemm import SHAPES, SKEWED, issue_case
from quantize import bench
from mxmoe.kernels import quantize as kq
from mxmoe.ops.gemm import grouped_mm_tn


def padded_rows(offs: torch.Tensor, po: torch.Tensor) -> torch.Tensor:
    """(n,) int64 padded row of each token in a group (the tokens 0 .. offs[-1] - 1)."""
    ends = offs.to(torch.int64)
    n = int(ends[-1])
    t = torch.arange(n, device=offs.device)
    g = torch.searchsorted(ends, t, right=True)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    pstarts = torch.cat([ends.new_zeros(1), po.to(torch.int64)[:-1]])
    return pstarts[g] + t - starts[g]


def run_case(dy, x, offs, fmt="e4m3", mode="rceil", timing=True) -> dict:
    pa, pb, po = kq.fake_quantize_grouped_colwise_pair(dy, x, offs, fmt, mode, torch.bfloat16)
    ua, ub = kq.fake_quantize_grouped_colwise_pair_unpadded(dy, x, offs, fmt, mode, torch.bfloat16)
    rows = padded_rows(offs, po)
    n = rows.numel()
    same_values = bool(torch.equal(ua[:n], pa[rows]) and torch.equal(ub[:n], pb[rows]))
    dw_p = grouped_mm_tn(pa.t(), pb.t(), po, nonempty_groups=True)
    dw_u = grouped_mm_tn(ua.t(), ub.t(), offs)
    ua_nan, ub_nan = ua.clone(), ub.clone()
    ua_nan[n:] = float("nan")
    ub_nan[n:] = float("nan")
    dw_nan = grouped_mm_tn(ua_nan.t(), ub_nan.t(), offs)
    sizes = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    empty = (sizes == 0).nonzero().flatten().tolist()
    r = {"same_values": same_values, "dw_bit_equal": bool(torch.equal(dw_p, dw_u)),
         "dw_max_abs_diff": float((dw_p.float() - dw_u.float()).abs().max()),
         "nan_tail_unread": bool(torch.equal(dw_nan, dw_u) and torch.isfinite(dw_u).all()),
         "empty_experts_zero": all(bool((dw_u[e] == 0).all()) for e in empty), "empty_experts": empty,
         "padded_len": int(po[-1]), "tokens": n}
    if not timing:
        return r
    t = {}
    t["bf16 wgrad"] = bench(lambda: torch._grouped_mm(dy.t(), x, offs=offs))
    t["padded: wgrad"] = bench(lambda: grouped_mm_tn(*_pair_t(kq.fake_quantize_grouped_colwise_pair(
        dy, x, offs, fmt, mode, torch.bfloat16)), nonempty_groups=True))
    t["padded: pass"] = bench(lambda: kq.fake_quantize_grouped_colwise_pair(dy, x, offs, fmt, mode, torch.bfloat16))
    t["padded: gemm"] = bench(lambda: grouped_mm_tn(pa.t(), pb.t(), po, nonempty_groups=True))
    t["unpadded: wgrad"] = bench(lambda: grouped_mm_tn(*_t(kq.fake_quantize_grouped_colwise_pair_unpadded(
        dy, x, offs, fmt, mode, torch.bfloat16)), offs))
    t["unpadded: pass"] = bench(lambda: kq.fake_quantize_grouped_colwise_pair_unpadded(
        dy, x, offs, fmt, mode, torch.bfloat16))
    t["unpadded: gemm (with the empty experts' zeroing)"] = bench(lambda: grouped_mm_tn(ua.t(), ub.t(), offs))
    t["unpadded: gemm alone"] = bench(lambda: torch._grouped_mm(ua.t(), ub, offs=offs))
    r["us"] = {k: v * 1e6 for k, v in t.items()}
    r["ratio padded"] = t["bf16 wgrad"] / t["padded: wgrad"]
    r["ratio unpadded"] = t["bf16 wgrad"] / t["unpadded: wgrad"]
    return r


def _pair_t(out):
    a, b, po = out
    return a.t(), b.t(), po


def _t(out):
    a, b = out
    return a.t(), b.t()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON result file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("wgrad_unpadded.py times the GPU: no CUDA device here", file=sys.stderr)
        return 2
    import triton

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
            "timing": "CUDA-graph replay, median"}
    print(json.dumps(info))
    dev = torch.device("cuda")
    rows, ok = [], True
    for (T, K, N, E), skewed in [(s, False) for s in SHAPES] + [(SKEWED, True)]:
        torch.manual_seed(0)
        sizes, offs, x, w, dy = issue_case(T, K, N, E, skewed, dev)
        del w
        r = run_case(dy, x, offs)
        r.update(T=T, K=K, N=N, E=E, skewed=skewed, sizes_min_max=[min(sizes), max(sizes)])
        rows.append(r)
        ok &= r["same_values"] and r["dw_bit_equal"] and r["nan_tail_unread"] and r["empty_experts_zero"]
        print(f"\nT={T} K={K} N={N} E={E}{' skewed' if skewed else ''}: tokens {r['tokens']}, padded length "
              f"{r['padded_len']}; values equal {r['same_values']}, dW bit-equal {r['dw_bit_equal']} (max abs diff "
              f"{r['dw_max_abs_diff']:.3g}), tail unread {r['nan_tail_unread']}")
        for k, v in r["us"].items():
            print(f"  {k:50s} {v:9.1f} us  {r['us']['bf16 wgrad'] / v:6.3f}x bf16")
        print(f"  per call: padded {r['ratio padded']:.3f}x, unpadded {r['ratio unpadded']:.3f}x")
    # the issue's edge cases: empty experts, all tokens on one expert, rows past the last offset
    for sizes, K, N, extra in (([162, 0, 2577, 446, 0, 83], 1408, 256, 37), ([0, 0, 500, 0], 64, 96, 0),
                               ([33] * 64, 2880, 136, 5)):
        torch.manual_seed(1)
        T = sum(sizes) + extra
        offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
        x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
        for fmt, mode in (("e4m3", "rceil"), ("e5m2", "floor")):
            r = run_case(dy, x, offs, fmt, mode, timing=False)
            r.update(sizes=sizes if len(sizes) < 10 else f"{len(sizes)} x {sizes[0]}", K=K, N=N, T=T, fmt=fmt,
                     mode=mode)
            rows.append(r)
            ok &= r["same_values"] and r["dw_bit_equal"] and r["nan_tail_unread"] and r["empty_experts_zero"]
            print(f"edge {r['sizes']} K={K} N={N} T={T} {fmt}/{mode}: values {r['same_values']}, dW bit-equal "
                  f"{r['dw_bit_equal']}, tail unread {r['nan_tail_unread']}, empty experts {r['empty_experts']} zero "
                  f"{r['empty_experts_zero']}")
    print("all checks ok" if ok else "CHECK FAILED")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "rows": rows, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
