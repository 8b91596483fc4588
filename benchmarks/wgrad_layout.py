"""Which operand layout makes the BF16 wgrad ``torch._grouped_mm`` (groups along the
contraction) fastest on this GPU: the four stride combinations of dy^T (N, L) and x (L, K),
with the plain token offsets (only the layout with tokens outermost: torch._grouped_mm
needs 16-byte aligned groups along a contiguous dim) and with the per-expert padded
(multiple of 32) layout.

    PYTHONPATH=src python3 benchmarks/wgrad_layout.py [--out layout.json]

Prints us and TFLOP/s per layout and shape; all timed in one process (do_bench medians).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from triton.testing import do_bench

from grouped_gemm import SHAPES, SKEWED, group_sizes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for (T, K, N, E), skewed in [(s, False) for s in SHAPES] + [(SKEWED, True)]:
        sizes = torch.tensor(group_sizes(T, E, skewed))
        offs = sizes.cumsum(0).to(torch.int32).cuda()
        padded = ((sizes + 31) // 32 * 32).cumsum(0).to(torch.int32).cuda()
        Lp = int(padded[-1])
        flop = 2.0 * T * K * N
        print(f"T={T} K={K} N={N} E={E}{' skewed' if skewed else ''}")
        for L, o, tag in [(T, offs, "plain"), (Lp, padded, "padded")]:
            dy = torch.randn(L, N, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(L, K, device="cuda", dtype=torch.bfloat16)
            variants = {
                "a=(L,N).t(), b=(L,K)": (dy.t(), x),  # what the bf16 wgrad gets
                "a=(N,L), b=(K,L).t()": (dy.t().contiguous(), x.t().contiguous().t()),  # the transposed copies
                "a=(N,L), b=(L,K)": (dy.t().contiguous(), x),
                "a=(L,N).t(), b=(K,L).t()": (dy.t(), x.t().contiguous().t()),
            }
            if tag == "plain":  # groups along a contiguous dim must start at 16-byte multiples
                variants = {k: v for k, v in variants.items() if k == "a=(L,N).t(), b=(L,K)"}
            for name, (a, b) in variants.items():
                us = do_bench(lambda: torch._grouped_mm(a, b, offs=o), warmup=25, rep=100, return_mode="median") * 1e3
                print(f"  {tag:7s} {name:28s} {us:9.1f} us {flop / us / 1e6:7.1f} TFLOP/s")
                rows.append({"T": T, "K": K, "N": N, "E": E, "skewed": skewed, "layout": tag, "operands": name,
                             "us": us})
            del dy, x, variants
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "commit": os.environ.get("COMMIT", "unknown")}
        with open(args.out, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
