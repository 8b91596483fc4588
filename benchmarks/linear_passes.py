"""Quantization passes of ``mx_linear`` at the h200 preset's shapes (issue 5): both copies of
an operand from one kernel (``fake_quantize_rowcol``) against two separate passes, and the
whole linear (forward + backward) against bf16 ``F.linear``, in one process on one GPU.

Timing: CUDA-graph replay of 20 calls, median of 5 replays (device time only; the train
step is replayed from a CUDA graph too).
Usage (repo root): PYTHONPATH=src python3 benchmarks/linear_passes.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess

import torch
import torch.nn.functional as F

from mxmoe import get_recipe, mx_linear
from mxmoe.ops.quantize import fake_quantize, fake_quantize_rowcol


def graph_us(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args()
    r = get_recipe("mxfp8")
    rows = []
    # operands: activations (T, K) bf16, gradients (T, N) bf16, weights (N, K) float32
    for name, shape, dtype in [("x qkv/out (16384, 512)", (16384, 512), torch.bfloat16),
                               ("dy qkv (16384, 1536)", (16384, 1536), torch.bfloat16),
                               ("dy lm head (16384, 256)", (16384, 256), torch.bfloat16),
                               ("w qkv (1536, 512) fp32", (1536, 512), torch.float32),
                               ("x large (16384, 4096)", (16384, 4096), torch.bfloat16)]:
        x = torch.randn(shape, device="cuda", dtype=dtype)
        one = graph_us(lambda: fake_quantize_rowcol(x, r, torch.bfloat16))
        two = graph_us(lambda: (fake_quantize(x, r, 1, torch.bfloat16), fake_quantize(x, r, 0, torch.bfloat16)))
        row = graph_us(lambda: fake_quantize(x, r, 1, torch.bfloat16))
        rows.append({"operand": name, "one_kernel_us": one, "two_passes_us": two, "row_pass_us": row})
        print(f"{name:28s} one kernel {one:8.1f} us | two passes {two:8.1f} us (row {row:6.1f}) | "
              f"one/two {one / two:.2f}", flush=True)
    lin = []
    for T, K, N in [(16384, 512, 1536), (16384, 512, 512), (16384, 512, 256)]:
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(N, K, device="cuda", requires_grad=True)
        dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)

        def step(fn):
            def run():
                x.grad = w.grad = None
                fn().backward(dy)
            return run

        t_bf16 = graph_us(step(lambda: F.linear(x, w.to(torch.bfloat16))), reps=10)
        t_mx = graph_us(step(lambda: mx_linear(x, w, r)), reps=10)
        lin.append({"T": T, "K": K, "N": N, "bf16_us": t_bf16, "mxfp8_us": t_mx})
        print(f"linear fwd+bwd T {T} K {K} N {N}: bf16 {t_bf16:.1f} us, mxfp8 {t_mx:.1f} us "
              f"({t_bf16 / t_mx:.2f}x)", flush=True)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
                       "passes": rows, "linear": lin}, f, indent=1)


if __name__ == "__main__":
    main()
