"""Correctness of ``mx_grouped_mm`` on the GPU at model shapes: forward, dgrad and wgrad.

The CPU tests (tests/test_grouped_edges.py, tests/test_ops.py) cover the edge cases at
small shapes; this script runs them at the issue's shapes on the GPU, in whatever
implementation ``mx_grouped_mm`` dispatches to there (emulated, fused Triton, or the
native sm100 op), and checks:

- out / dx / dw against float64 products of the same quantized operands (quantized here
  with the pure-torch reference, each operand along its own contraction dimension, the
  wgrad operands along each expert's own tokens), on sampled rows and experts:
  |got - ref| <= 2 K 2^-24 (|A| |B|) + 2^-8 |ref| entry by entry (float32 accumulation,
  one bfloat16 rounding of the result);
- no NaN / inf in out, dx, dw although rows past the last offset hold NaN / inf garbage;
  those rows' out and dx exactly 0; dW of experts with no tokens exactly 0;
- bitwise determinism across two runs;
- no host synchronization in forward + backward (``torch.cuda.set_sync_debug_mode("error")``
  after a warm-up run);
- CUDA-graph capture of forward + backward, replayed on new data, bitwise equal to eager.

    PYTHONPATH=src python3 benchmarks/check_grouped_cuda.py            # H200 (or any CUDA GPU)
    PYTHONPATH=src python3 benchmarks/check_grouped_cuda.py --smoke    # CPU, tiny shapes: checks the script

Prints one line per check (``ok`` / ``FAIL`` / ``skip``) and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from mxmoe import get_recipe, mx_grouped_mm, quantize_mx  # noqa: E402

BLOCK = 32
GARBAGE_ROWS = 64  # rows past the last offset, filled with NaN / inf
failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{'  ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(name)


def skip(name: str, why: str) -> None:
    print(f"skip {name}  ({why})", flush=True)


# ---- cases ------------------------------------------------------------------------------

def routed_sizes(T: int, E: int, kind: str, seed: int) -> list[int]:
    """Tokens per expert. "uniform": multinomial over E experts, with expert 1 emptied into
    expert 0 (an empty expert at scale); "skewed": a quarter of the experts draw 70% of the
    tokens."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "skewed":
        hot = max(E // 4, 1)
        p = torch.cat([torch.full((hot,), 0.7 / hot), torch.full((E - hot,), 0.3 / max(E - hot, 1))])
    else:
        p = torch.full((E,), 1.0 / E)
    sizes = torch.bincount(torch.multinomial(p, T, replacement=True, generator=gen), minlength=E).tolist()
    if kind == "uniform" and E > 1:
        sizes[0] += sizes[1]
        sizes[1] = 0
    return sizes


def one_hot_sizes(E: int, used: dict[int, int]) -> list[int]:
    sizes = [0] * E
    for e, n in used.items():
        sizes[e] = n
    return sizes


def cases(smoke: bool) -> list[tuple[str, list[int], int, int]]:
    """(name, group sizes, K, N)."""
    if smoke:
        return [
            ("smoke uniform (256, 64, 48, 4)", routed_sizes(256, 4, "uniform", 0), 64, 48),
            ("smoke skewed (256, 64, 32, 8)", routed_sizes(256, 8, "skewed", 1), 64, 32),
            ("smoke issue sizes [162,0,257,46,0,83] K=96 N=33", [162, 0, 257, 46, 0, 83], 96, 33),
            ("smoke T=0, 4 experts", [0, 0, 0, 0], 64, 32),
        ]
    return [
        # the benchmark shapes (T, K, N, E)
        ("(32768, 4096, 2048, 16) uniform", routed_sizes(32768, 16, "uniform", 0), 4096, 2048),
        ("(65536, 7168, 2048, 64) uniform", routed_sizes(65536, 64, "uniform", 1), 7168, 2048),
        ("(16384, 2048, 1408, 64) uniform", routed_sizes(16384, 64, "uniform", 2), 2048, 1408),
        ("(32768, 4096, 2048, 64) skewed: 1/4 of experts get 70%", routed_sizes(32768, 64, "skewed", 3), 4096, 2048),
        # edge cases of other libraries' public reports, at GPU scale
        ("issue group sizes [162,0,2577,446,0,83], K=2880, N=2048", [162, 0, 2577, 446, 0, 83], 2880, 2048),
        ("all 16384 tokens on one expert of 8, K=1408, N=2048", one_hot_sizes(8, {5: 16384}), 1408, 2048),
        ("33 experts, K=2048, N=1408", routed_sizes(8192, 33, "uniform", 4), 2048, 1408),
        ("128 experts, K=2048, N=1024", routed_sizes(8192, 128, "skewed", 5), 2048, 1024),
        ("256 experts, 40 used, K=1408, N=512", one_hot_sizes(256, {e: 17 * e + 1 for e in range(0, 256, 7)}), 1408, 512),
        ("T = 0 tokens, 16 experts", [0] * 16, 2048, 1408),
        ("N = 33, K=4096, 16 experts", routed_sizes(16384, 16, "uniform", 6), 4096, 33),
        ("K = 1408, N=2048, 64 experts", routed_sizes(16384, 64, "uniform", 7), 1408, 2048),
        ("K = 2880, N=2880, 32 experts", routed_sizes(16384, 32, "uniform", 8), 2880, 2880),
    ]


def octaves(n: int, step: int, dev) -> torch.Tensor:
    """2^k with k cycling over -4..4: magnitudes that vary along an axis."""
    return torch.exp2((torch.arange(n, device=dev) * step % 9 - 4).float())


def spread(rows: int, cols: int, gen, dev) -> torch.Tensor:
    """Gaussian values scaled by octaves along both axes. With plain Gaussian data every
    32-block tends to get the same scale, and an operand blocked along the wrong axis
    would go unnoticed; here it cannot."""
    return torch.randn(rows, cols, generator=gen, device=dev) * octaves(rows, 7, dev).view(-1, 1) * octaves(cols, 5, dev)


def make_inputs(sizes, K, N, dev, dtype, seed):
    T = sum(sizes)
    gen = torch.Generator(device=dev).manual_seed(seed)
    pattern = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38], device=dev)
    x = torch.empty(T + GARBAGE_ROWS, K, device=dev, dtype=dtype)
    dy = torch.empty(T + GARBAGE_ROWS, N, device=dev, dtype=dtype)
    x[:T] = spread(T, K, gen, dev)
    dy[:T] = spread(T, N, gen, dev)
    x[T:] = pattern.repeat(GARBAGE_ROWS * K // 4 + 1)[: GARBAGE_ROWS * K].view(GARBAGE_ROWS, K)
    dy[T:] = pattern.repeat(GARBAGE_ROWS * N // 4 + 1)[: GARBAGE_ROWS * N].view(GARBAGE_ROWS, N)
    w = torch.stack([spread(N, K, gen, dev) for _ in sizes]) / 16 if sizes else torch.empty(0, N, K, device=dev)
    offsets = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    return x, w, dy, offsets


def fwd_bwd(x, w, dy, offsets, recipe):
    xg = x.detach().requires_grad_(True)
    wg = w.detach().requires_grad_(True)
    y = mx_grouped_mm(xg, wg, offsets, recipe)
    y.backward(dy)
    return y.detach(), xg.grad, wg.grad


# ---- float64 references on samples ------------------------------------------------------

def qdq64(t: torch.Tensor, dim: int, recipe) -> torch.Tensor:
    """Operand as the recipe feeds it to the GEMM, in float64 (reference quantizer, zero
    padded to 32 along ``dim``; bf16 recipe: rounded to bfloat16)."""
    if not recipe.quantize:
        return t.to(torch.bfloat16).double()
    mx = quantize_mx(t.float(), recipe.fmt, dim=dim, scale_mode=recipe.scale_mode, pad=True, backend="reference")
    return mx.dequantize(torch.float32).double()


def within(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    """got vs a @ b (float64): float32 accumulation over K plus one bfloat16 rounding."""
    ref = a @ b
    bound = 2 * a.shape[-1] * 2.0**-24 * (a.abs() @ b.abs()) + 2.0**-8 * ref.abs()
    err = (got.double() - ref).abs()
    ratio = (err / bound.clamp_min(1e-300)).max().item() if err.numel() else 0.0
    return bool((err <= bound).all()), ratio


def check_values(tag, sizes, x, w, dy, y, dx, dw, recipe, rng):
    T = sum(sizes)
    K, N = x.shape[1], w.shape[1]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    nonempty = [e for e, n in enumerate(sizes) if n]
    ok_y = ok_dx = True
    worst_y = worst_dx = 0.0
    for e in nonempty:  # 4 sampled rows per expert: first, last, two at random
        s, t = starts[e], starts[e + 1]
        rows = torch.tensor(sorted({s, t - 1, *torch.randint(s, t, (2,), generator=rng).tolist()}), device=x.device)
        ok, r = within(y[rows], qdq64(x[rows], 1, recipe), qdq64(w[e], 1, recipe).t())
        ok_y, worst_y = ok_y and ok, max(worst_y, r)
        ok, r = within(dx[rows], qdq64(dy[rows], 1, recipe), qdq64(w[e], 0, recipe))
        ok_dx, worst_dx = ok_dx and ok, max(worst_dx, r)
    check(f"{tag}: out vs float64 (sampled rows, worst {worst_y:.2f} of bound)", ok_y)
    check(f"{tag}: dx vs float64 (sampled rows, worst {worst_dx:.2f} of bound)", ok_dx)
    # dw: the largest, the smallest and one random non-empty expert, each on its own tokens
    picks = set()
    if nonempty:
        picks = {max(nonempty, key=lambda e: sizes[e]), min(nonempty, key=lambda e: sizes[e]),
                 nonempty[int(torch.randint(len(nonempty), (1,), generator=rng))]}
    ok_dw, worst_dw = True, 0.0
    for e in sorted(picks):
        s, t = starts[e], starts[e + 1]
        ok, r = within(dw[e], qdq64(dy[s:t], 0, recipe).t(), qdq64(x[s:t], 0, recipe))
        ok_dw, worst_dw = ok_dw and ok, max(worst_dw, r)
    check(f"{tag}: dw vs float64 (experts {sorted(picks)}, worst {worst_dw:.2f} of bound)", ok_dw)
    empty = [e for e, n in enumerate(sizes) if n == 0]
    check(f"{tag}: dw of {len(empty)} empty experts exactly 0", all(bool((dw[e] == 0).all()) for e in empty))
    check(f"{tag}: out, dx exactly 0 past the last offset",
          bool((y[T:] == 0).all()) and bool((dx[T:] == 0).all()))
    check(f"{tag}: no NaN / inf in out, dx, dw", all(bool(torch.isfinite(t).all()) for t in (y, dx, dw)))


# ---- the GPU-only checks -----------------------------------------------------------------

def check_no_sync(tag, x, w, dy, offsets, recipe):
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        fwd_bwd(x, w, dy, offsets, recipe)
        ok, detail = True, ""
    except RuntimeError as ex:
        ok, detail = False, str(ex).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    check(f"{tag}: no host synchronization in forward + backward", ok, detail)


def check_graph(tag, x, w, dy, offsets, recipe):
    """Capture forward + backward once, replay on new values, compare with eager."""
    try:
        sx, sw, sdy, soffs = x.clone().requires_grad_(True), w.clone().requires_grad_(True), dy.clone(), offsets.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graphs asks
            for _ in range(2):
                sx.grad = sw.grad = None
                mx_grouped_mm(sx, sw, soffs, recipe).backward(sdy)
        torch.cuda.current_stream().wait_stream(stream)
        sx.grad = sw.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sy = mx_grouped_mm(sx, sw, soffs, recipe)
            sy.backward(sdy)
        # new values in the same buffers (same routing), then replay
        gen = torch.Generator(device=x.device).manual_seed(1234)
        with torch.no_grad():
            T = int(offsets[-1]) if offsets.numel() else 0
            sx[:T].copy_(torch.randn(T, x.shape[1], generator=gen, device=x.device))
            sw.copy_(torch.randn(w.shape, generator=gen, device=x.device) / 16)  # same shapes, new values
            sdy[:T].copy_(torch.randn(T, dy.shape[1], generator=gen, device=x.device))
        graph.replay()
        torch.cuda.synchronize()
        ey, edx, edw = fwd_bwd(sx.detach(), sw.detach(), sdy, soffs, recipe)
        ok = torch.equal(sy, ey) and torch.equal(sx.grad, edx) and torch.equal(sw.grad, edw)
        detail = "" if ok else "replay differs from eager"
    except Exception as ex:  # noqa: BLE001 - report any capture failure as a failed check
        ok, detail = False, f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}"
    check(f"{tag}: CUDA-graph capture of forward + backward, replay == eager", ok, detail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks this script, not the GPU")
    parser.add_argument("--recipes", default="mxfp8,bf16", help="comma-separated recipe names (default: mxfp8,bf16)")
    parser.add_argument("--backend", default="auto", help="quantizer backend of the recipe (auto, reference, triton)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="activation dtype")
    parser.add_argument("--only", default="", help="run only cases whose name contains this text")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on the CPU")
        return 2
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = getattr(torch, args.dtype)
    name = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    print(f"{name} | torch {torch.__version__} | recipes {args.recipes} | backend {args.backend} | {args.dtype}")
    rng = torch.Generator().manual_seed(0)
    for recipe_name in args.recipes.split(","):
        recipe = get_recipe(recipe_name, backend=args.backend)
        for i, (case, sizes, K, N) in enumerate(cases(args.smoke)):
            if args.only and args.only not in case:
                continue
            tag = f"[{recipe_name}] {case}"
            t0 = time.perf_counter()
            x, w, dy, offsets = make_inputs(sizes, K, N, dev, dtype, seed=i)
            y, dx, dw = fwd_bwd(x, w, dy, offsets, recipe)
            y2, dx2, dw2 = fwd_bwd(x, w, dy, offsets, recipe)
            check(f"{tag}: bitwise deterministic across two runs",
                  torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(dw, dw2))
            del y2, dx2, dw2
            check_values(tag, sizes, x, w, dy, y, dx, dw, recipe, rng)
            del y, dx, dw
            if args.smoke:
                skip(f"{tag}: no-sync and CUDA-graph checks", "CUDA only")
            else:
                check_no_sync(tag, x, w, dy, offsets, recipe)
                check_graph(tag, x, w, dy, offsets, recipe)
                torch.cuda.empty_cache()
            print(f"     {tag}: {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"{len(failures)} failures")
    for f in failures:
        print(f"  FAIL {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
