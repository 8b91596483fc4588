"""``mx_grouped_mm`` (MXFP8) forward, dgrad and wgrad against bf16 ``torch._grouped_mm``.

The expert GEMMs of three real MoE layers, (D, F, E, top-k, T) = model width, expert
width, experts, experts per token, tokens:

- Qwen3-235B-A22B: (4096, 1536, 128, 8, 16384)
- DeepSeek-V3: (7168, 2048, 256, 8, 16384)
- Mixtral-8x7B: (4096, 14336, 8, 2, 8192)

Each layer has two grouped GEMMs over its A = T * top-k routed rows: "up" (K = D, N = 2F,
the fused gate and up projections) and "down" (K = F, N = D). Routing: each token's top-k
of random router logits (near balanced; ``--routing skewed``: a quarter of the experts draw
70% of the rows). Both sides get the same bf16 tokens, bf16 weights (``--weight-dtype
float32`` gives ``mx_grouped_mm`` float32 master weights instead) and int32 offsets.

- forward: ``mx_grouped_mm(x, w, offsets, "mxfp8")`` under ``torch.no_grad()`` against
  ``torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)``;
- dgrad: ``torch.autograd.grad(y, x, dy, retain_graph=True)`` of each (w not requiring grad):
  the backward's input-gradient GEMM with its quantize passes;
- wgrad: ``torch.autograd.grad(y, w, dy, retain_graph=True)`` (x not requiring grad).

TFLOP/s = 2 A K N / time. "x bf16" = bf16 time / mxfp8 time (above 1: faster). The note
says which implementation ``mxmoe.ops.backend.grouped_gemm_backend`` chose for the pass.

    PYTHONPATH=src python3 benchmarks/grouped_mm.py [--quick] [--models qwen3-235b-a22b,...]
    PYTHONPATH=src python3 benchmarks/grouped_mm.py --smoke          # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import functools
import sys

import harness

SMOKE = harness.interpret_triton_if_smoke()

import torch  # noqa: E402

from mxmoe.ops.backend import grouped_gemm_backend  # noqa: E402
from mxmoe.ops.grouped_mm import mx_grouped_mm  # noqa: E402
from mxmoe.recipe import get_recipe  # noqa: E402

SUBJECT = "grouped_mm"
SMOKE_MODEL = {"smoke": (64, 48, 4, 2, 64)}
PASSES = ("forward", "dgrad", "wgrad")


def routed_sizes(T: int, E: int, k: int, skewed: bool, seed: int = 0) -> list[int]:
    """Rows per expert when each of T tokens picks its top-k experts from random logits
    (skewed: the logits of a quarter of the experts raised so that they draw about 70%)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    if skewed:
        logits[:, : max(E // 4, 1)] += 1.6
    experts = logits.topk(k, dim=1).indices.flatten()
    return torch.bincount(experts, minlength=E).tolist()


@functools.cache
def _grouped_mm_works(device_type: str) -> bool:
    """Whether torch._grouped_mm runs bf16 on this device type (CPU support varies by torch)."""
    try:
        x = torch.randn(32, 16, dtype=torch.bfloat16, device=device_type)
        w = torch.randn(2, 16, 16, dtype=torch.bfloat16, device=device_type)
        torch._grouped_mm(x, w, offs=torch.tensor([16, 32], dtype=torch.int32, device=device_type))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def bf16_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The baseline: out[t] = x[t] @ w[e]^T in bf16, ``torch._grouped_mm`` (a loop over the
    experts only where this torch has no CPU kernel for it, in smoke runs)."""
    if _grouped_mm_works(x.device.type):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    starts = [0] + offsets.tolist()[:-1]
    parts = [x[s:e] @ w[i].t() for i, (s, e) in enumerate(zip(starts, offsets.tolist()))]
    return torch.cat(parts + [x.new_zeros(x.shape[0] - offsets[-1].item(), w.shape[1])])


def pass_fn(pass_: str, gemm, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, dy: torch.Tensor):
    """A no-argument function running one pass of ``gemm(x, w, offsets)``."""
    if pass_ == "forward":
        def forward():
            with torch.no_grad():
                return gemm(x, w, offsets)
        return forward
    wrt = x if pass_ == "dgrad" else w
    xx = x.detach().requires_grad_(pass_ == "dgrad")
    ww = w.detach().requires_grad_(pass_ == "wgrad")
    y = gemm(xx, ww, offsets)
    target = xx if wrt is x else ww
    return lambda: torch.autograd.grad(y, target, dy, retain_graph=True)


def run_gemm(model: str, gemm_name: str, A: int, K: int, N: int, E: int, sizes: list[int], args, dev,
             recipe) -> list[harness.Row]:
    gen = torch.Generator(device=dev).manual_seed(0)
    offsets = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(A, K, device=dev, dtype=torch.bfloat16, generator=gen)
    w_bf16 = (torch.randn(E, N, K, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    w_mx = w_bf16.to(getattr(torch, args.weight_dtype))
    dy = torch.randn(A, N, device=dev, dtype=torch.bfloat16, generator=gen)
    shape = f"({A}, {K}) x ({E}, {N}, {K})"
    rows = []
    for pass_ in PASSES:
        if pass_ not in args.passes:
            continue
        timing = dict(mode=args.timing, warmup_ms=args.warmup_ms, rep_ms=harness.rep_ms(args), smoke=args.smoke)
        base = pass_fn(pass_, bf16_grouped_mm, x, w_bf16, offsets, dy)
        base_us = 1e6 * harness.bench(base, label=f"bf16 {pass_}", **timing)
        del base
        harness.free_memory()
        mx = pass_fn(pass_, lambda a, b, o: mx_grouped_mm(a, b, o, recipe), x, w_mx, offsets, dy)
        us = 1e6 * harness.bench(mx, label=f"mxfp8 {pass_}", **timing)
        del mx
        harness.free_memory()
        a = dy if pass_ != "forward" else x
        impl = grouped_gemm_backend(pass_, a, w_mx, offsets, recipe).value
        row = harness.Row(f"{model} {gemm_name}, {pass_}", shape, us, base_us, flops=2.0 * A * K * N,
                          note=f"{impl}; tokens per expert {min(sizes)}-{max(sizes)}")
        rows.append(row)
        print(f"  {row.case:40s} {us:10.1f} us  {harness.fmt(row.rate, '.0f')} TFLOP/s  bf16 {base_us:10.1f} us  "
              f"{harness.fmt(row.ratio, '.3f', 'x')}  ({impl})", flush=True)
    del x, w_bf16, w_mx, dy
    harness.free_memory()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(p, timing="eager")
    harness.add_models_arg(p)
    p.add_argument("--gemms", default="up,down", help="which GEMMs of each layer: up, down (default: %(default)s)")
    p.add_argument("--passes", default=",".join(PASSES), help="comma-separated passes (default: %(default)s)")
    p.add_argument("--routing", default="balanced", choices=("balanced", "skewed"), help="default: %(default)s")
    p.add_argument("--weight-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of mx_grouped_mm's weights (the baseline's are bf16) (default: %(default)s)")
    p.add_argument("--recipe", default="mxfp8", help="the recipe of mx_grouped_mm (default: %(default)s)")
    args = p.parse_args(argv)
    args.passes = [s.strip() for s in args.passes.split(",") if s.strip()]
    bad = [s for s in args.passes if s not in PASSES]
    if bad:
        p.error(f"unknown pass(es) {bad}; use {', '.join(PASSES)}")
    gemms = [s.strip() for s in args.gemms.split(",") if s.strip()]
    if not gemms or any(s not in ("up", "down") for s in gemms):
        p.error(f"--gemms takes up and/or down, got {args.gemms!r}")
    models = harness.selected_models(p, args, SMOKE_MODEL)
    dev = harness.device_for(args)
    recipe = get_recipe(args.recipe, backend="triton" if args.smoke else "auto")
    env = harness.environment()
    print(harness.title("mx_grouped_mm against bf16 torch._grouped_mm", env, args), flush=True)
    rows = []
    for name, (D, F, E, k, T) in models.items():
        sizes = routed_sizes(T, E, k, args.routing == "skewed")
        A = T * k
        print(f"{name}: D={D} F={F} E={E} top-{k} T={T} ({args.routing} routing, {A} rows)", flush=True)
        for gemm_name in gemms:
            K, N = (D, 2 * F) if gemm_name == "up" else (F, D)
            rows += run_gemm(name, gemm_name, A, K, N, E, sizes, args, dev, recipe)
    print()
    print(harness.standard_table(rows, "bf16"))
    harness.write_results(SUBJECT, args, env, rows, {"baseline": "bf16 torch._grouped_mm, same shapes and routing",
                                                     "models": {n: dict(zip("DFEkT", m)) for n, m in models.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
