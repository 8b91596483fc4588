"""``mx_linear`` (MXFP8) against bf16 ``F.linear`` at attention and MLP shapes.

Shapes (T tokens, K in, N out):

- Qwen3-235B-A22B attention: qkv projection (16384, 4096, 9216) (64 query and 4 key/value
  heads of 128), output projection (16384, 8192, 4096);
- a dense SwiGLU MLP of width 14336 on D = 4096 (Llama-3-8B, Mixtral's expert width):
  gate + up (16384, 4096, 28672), down (16384, 14336, 4096);
- ``mxmoe train --preset h200`` (width 512): qkv (16384, 512, 1536), output (16384, 512, 512).

Passes: forward (``torch.no_grad()``) and forward + backward (``y.backward(dy)`` with x
and w requiring grad: dgrad and wgrad). The baseline gets bf16 x and w; ``mx_linear`` the
same bf16 x and, by default, the same bf16 w (``--weight-dtype float32``: float32 master
weights, as the trainer holds them). TFLOP/s = 2 T K N per GEMM (forward 1 GEMM, forward +
backward 3). "x bf16" = bf16 time / mxfp8 time. Default timing: CUDA-graph replay (at the
h200 preset's sizes eager launches are host-bound).

    PYTHONPATH=src python3 benchmarks/linear.py [--quick] [--timing eager]
    PYTHONPATH=src python3 benchmarks/linear.py --smoke          # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import sys

import harness

SMOKE = harness.interpret_triton_if_smoke()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mxmoe.ops.linear import mx_linear  # noqa: E402
from mxmoe.recipe import get_recipe  # noqa: E402

SUBJECT = "linear"
# name: (T, K, N)
SHAPES = {
    "Qwen3-235B attention qkv": (16384, 4096, 9216),
    "Qwen3-235B attention out": (16384, 8192, 4096),
    "MLP gate + up (D 4096, F 14336)": (16384, 4096, 28672),
    "MLP down (F 14336, D 4096)": (16384, 14336, 4096),
    "h200 preset qkv": (16384, 512, 1536),
    "h200 preset attention out": (16384, 512, 512),
}
QUICK = ("Qwen3-235B attention qkv", "MLP down (F 14336, D 4096)", "h200 preset qkv")
SMOKE_SHAPES = {"smoke": (64, 96, 80)}
PASSES = ("forward", "forward + backward")


def pass_fn(pass_: str, linear, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """A no-argument function running one pass of ``linear(x, w)``."""
    if pass_ == "forward":
        def forward():
            with torch.no_grad():
                return linear(x, w)
        return forward
    xx, ww = x.detach().requires_grad_(True), w.detach().requires_grad_(True)

    def step():
        xx.grad = ww.grad = None
        linear(xx, ww).backward(dy)
    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(p, timing="graph")
    p.add_argument("--weight-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of mx_linear's weight (the baseline's is bf16) (default: %(default)s)")
    p.add_argument("--recipe", default="mxfp8", help="the recipe of mx_linear (default: %(default)s)")
    args = p.parse_args(argv)
    dev = harness.device_for(args)
    recipe = get_recipe(args.recipe, backend="triton" if args.smoke else "auto")
    shapes = SMOKE_SHAPES if args.smoke else {n: SHAPES[n] for n in QUICK} if args.quick else SHAPES
    env = harness.environment()
    print(harness.title("mx_linear against bf16 F.linear", env, args), flush=True)
    rows = []
    for name, (T, K, N) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(T, K, device=dev, dtype=torch.bfloat16, generator=g)
        w = (torch.randn(N, K, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        w_mx = w.to(getattr(torch, args.weight_dtype))
        dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16, generator=g)
        for pass_ in PASSES:
            timing = dict(mode=args.timing, warmup_ms=args.warmup_ms, rep_ms=harness.rep_ms(args), smoke=args.smoke)
            base_us = 1e6 * harness.bench(pass_fn(pass_, F.linear, x, w, dy), label=f"bf16 {pass_}", **timing)
            us = 1e6 * harness.bench(pass_fn(pass_, lambda a, b: mx_linear(a, b, recipe), x, w_mx, dy),
                                     label=f"mxfp8 {pass_}", **timing)
            gemms = 1 if pass_ == "forward" else 3
            row = harness.Row(f"{name}, {pass_}", f"({T}, {K}) x ({N}, {K})", us, base_us,
                              flops=2.0 * T * K * N * gemms, note=f"weight {args.weight_dtype}")
            rows.append(row)
            print(f"  {row.case:52s} {us:10.1f} us  {harness.fmt(row.rate, '.0f')} TFLOP/s  bf16 {base_us:10.1f} us  "
                  f"{harness.fmt(row.ratio, '.3f', 'x')}", flush=True)
            harness.free_memory()
        del x, w, w_mx, dy
        harness.free_memory()
    print()
    print(harness.standard_table(rows, "bf16"))
    harness.write_results(SUBJECT, args, env, rows, {"baseline": "bf16 F.linear, same shapes",
                                                     "shapes": {n: dict(zip("TKN", s)) for n, s in shapes.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
