"""MXFP8 grouped GEMM on the GPU: forward, dgrad and wgrad against BF16 ``torch._grouped_mm``.

For each shape (T tokens, K, N, E experts) and routing, in one process:

- bf16: ``torch._grouped_mm`` on bf16 operands (the baseline; TFLOP/s = 2 T K N / time).
- mxfp8 (design a): each operand quantized to MXFP8 along its GEMM's contraction axis and
  dequantized to bf16 in one memory-bound pass (Triton), then the same BF16
  ``torch._grouped_mm``. Exact: E4M3 code x 2^scale is a bf16 value, and the GEMM
  accumulates in float32. Timed as the library runs it (``mx_grouped_mm``'s forward, and its
  dgrad and wgrad steps), and split into the quantization passes and the GEMM. Since
  session 14 the library's forward takes design (g) (the weight quantized inside CUTLASS's
  grouped GEMM, ``mxmoe.kernels.cutlass_wq``) on sm90 where it applies (at most 640 tokens
  per expert: the (16384, 2048, 1408, 64) case) and can be built, and since session 15 its
  dgrad too (``mx_grouped_mm_dgrad``, what the backward runs; since session 16 up to 1152
  tokens per expert: also (65536, 7168, 2048, 64)); the JSON says which ran ("mx
  fwd design", "mx dgrad design"), and "mx fwd, design (a)" / "mx dgrad, design (a)" time
  design (a)'s composition of the same op in the same run.
  "w cached": the weight's copies from ``mxmoe.weight_copy_cache()`` (made once per
  optimizer step: they do not change between micro-batches), so a GEMM pays only for the
  activation pass; timed as the ops that path runs (the x or dy pass and the GEMM on the
  cached copy; the cache itself is skipped under graph capture), checked bit-equal to the
  library's output. "w copies, one pass": the per-step cost, both copies from one read
  (``fake_quantize_rowcol``). "amortized, M micro-batches": per GEMM, the cached time
  plus the per-step pass shared by the M forward and M dgrad GEMMs of a step,
  t_cached + t_pass / (2 M): derived from the measured parts, for M = 1 and 8.
- wgrad: both token-blocked operands (dy, x) come from one launch
  (``fake_quantize_grouped_tokens_pair``, as ``mx_grouped_mm``'s backward runs it);
  "quantize dy, x (two launches)" times the two single launches it replaced.
- torchao 0.18 MXFP8 grouped GEMM (``_to_mxfp8_then_scaled_grouped_mm``, emulated: the only
  mode it has on sm90), forward and forward + backward, if torchao is importable.

    PYTHONPATH=src python3 benchmarks/grouped_gemm.py [--out results.json] [--smoke] [--eager]

Every ratio is against the bf16 time measured in the same process. Ours and bf16 are timed
by CUDA-graph replay (as the trainer runs its step; ``--eager`` for eager launches);
torchao eagerly in a child process (its emulated GEMM is GPU-bound: host overhead is a
small part of its time). Prints a table and
writes JSON with the GPU name, torch and Triton versions and the commit (env COMMIT).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from mxmoe.kernels import cutlass_wq
from mxmoe.ops.gemm import grouped_mm_nn, grouped_mm_nt, grouped_mm_tn
from mxmoe.ops.grouped_mm import mx_grouped_mm, mx_grouped_mm_dgrad
from mxmoe.ops.quantize import (fake_quantize, fake_quantize_grouped_tokens, fake_quantize_grouped_tokens_pair,
                                fake_quantize_rowcol)
from mxmoe.ops.weight_cache import weight_copy_cache
from mxmoe.recipe import get_recipe

SHAPES = [(32768, 4096, 2048, 16), (65536, 7168, 2048, 64), (16384, 2048, 1408, 64)]
SKEWED = (32768, 4096, 2048, 16)  # a quarter of the experts get 70% of the tokens
TARGET_VS_BF16 = 0.85
TARGET_VS_TORCHAO = 8.0


def group_sizes(T: int, E: int, skewed: bool, seed: int = 0) -> list[int]:
    """E token counts summing to T: balanced with +-20% noise, or a quarter of the experts
    sharing 70% of the tokens."""
    g = torch.Generator().manual_seed(seed)
    if skewed:
        hot = E // 4
        w = torch.cat([torch.full((hot,), 0.70 / hot), torch.full((E - hot,), 0.30 / (E - hot))])
        w = w * (1 + 0.1 * torch.rand(E, generator=g))
    else:
        w = 1 + 0.2 * (2 * torch.rand(E, generator=g) - 1)
    sizes = (w / w.sum() * T).floor().long()
    sizes[0] += T - sizes.sum()
    return sizes.tolist()


def issue_case(T: int, K: int, N: int, E: int, skewed: bool,
               dev) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One of the issue's cases on ``dev``: (sizes, int32 offsets, x (T, K), w (E, N, K) *
    0.02, dy (T, N)), bf16 normal values, drawn in this order from the global generator."""
    sizes = group_sizes(T, E, skewed)
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=dev) * 0.02).to(torch.bfloat16)
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    return sizes, offs, x, w, dy


GRAPH = {"on": True}  # time by CUDA-graph replay: no host launch overhead in the figures


def bench(fn, smoke: bool, graph: bool | None = None) -> float:
    """Median seconds of the device work. Replayed from a CUDA graph by default, as the
    trainer runs a step (issue 5): eager launches of the quantize ops cost 100-200 us of
    host time each, which at the smaller shapes exceeds their GPU time and made the figures
    depend on the host's load. ``graph=False`` (torchao's child process) or ``--eager``
    times eager launches."""
    if smoke:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    from quantize import bench as device_bench  # benchmarks/quantize.py: the same timing

    return device_bench(fn, rep=100, warmup=25, graph=GRAPH["on"] if graph is None else graph)


def torchao_times(T: int, K: int, N: int, E: int, skewed: bool) -> dict:
    """torchao's emulated MXFP8 grouped GEMM at one shape, timed in a child process (a
    device-side assert there would poison this process's CUDA context). Returns seconds
    for "torchao fwd" / "torchao fwd+bwd", or an "error" string."""
    cmd = [sys.executable, __file__, "--torchao-child", json.dumps([T, K, N, E, skewed])]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    for line in res.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": tail[:200]}


def torchao_child(spec: str) -> int:
    from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    T, K, N, E, skewed = json.loads(spec)
    _, offs, x, w, dy = issue_case(T, K, N, E, skewed, "cuda")

    def run(a, b):
        return _to_mxfp8_then_scaled_grouped_mm(a, b.transpose(-2, -1), offs, kernel_preference=KernelPreference.EMULATED,
                                                pad_token_groups_for_grouped_mm=True)

    out = {}
    try:
        out["torchao fwd"] = bench(lambda: run(x, w), False, graph=False)
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out["torchao fwd+bwd"] = bench(lambda: run(xr, wr).backward(dy), False, graph=False)
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    print(json.dumps(out), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON result file")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    ap.add_argument("--no-torchao", action="store_true", help="skip the torchao comparison")
    ap.add_argument("--eager", action="store_true", help="time eager launches instead of CUDA-graph replay")
    ap.add_argument("--torchao-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torchao_child:
        return torchao_child(args.torchao_child)
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: grouped_gemm.py times the GPU (--smoke runs tiny shapes on the CPU)", file=sys.stderr)
        return 2
    GRAPH["on"] = not args.eager
    dev = torch.device("cpu" if smoke else "cuda")
    import triton

    info = {"gpu": "cpu" if smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "commit": os.environ.get("COMMIT", "unknown"),
            "date": time.strftime("%Y-%m-%d"), "fmt": "e4m3", "mode": "rceil",
            "timing": "CPU smoke: the ratios mean nothing" if smoke else
            ("eager launches" if args.eager else "CUDA-graph replay") + " (torchao: eager, its own process)"}
    print(json.dumps(info))
    use_tao = not (smoke or args.no_torchao)
    recipe = get_recipe("mxfp8", backend="reference" if smoke else "auto")
    cases = [(s, False) for s in SHAPES] + [(SKEWED, True)]
    if smoke:
        cases = [((256, 64, 96, 4), False), ((256, 64, 96, 4), True)]
    rows = []
    for (T, K, N, E), skewed in cases:
        sizes, offs, x, w, dy = issue_case(T, K, N, E, skewed, dev)
        flop = 2.0 * T * K * N
        t = {}
        # bf16 baseline: torch._grouped_mm itself (our wrapper adds a zeroing pass for rows
        # past the last offset), falling back to the wrapper where torch has none (CPU smoke)
        raw = hasattr(torch, "_grouped_mm") and not smoke
        if raw:
            w_t = w.transpose(-2, -1)
            t["bf16 fwd"] = bench(lambda: torch._grouped_mm(x, w_t, offs=offs), smoke)
            t["bf16 dgrad"] = bench(lambda: torch._grouped_mm(dy, w, offs=offs), smoke)
            t["bf16 wgrad"] = bench(lambda: torch._grouped_mm(dy.t(), x, offs=offs), smoke)
        else:
            t["bf16 fwd"] = bench(lambda: grouped_mm_nt(x, w, offs), smoke)
            t["bf16 dgrad"] = bench(lambda: grouped_mm_nn(dy, w, offs), smoke)
            t["bf16 wgrad"] = bench(lambda: grouped_mm_tn(dy.t(), x.t(), offs), smoke)
        # the library's forward: design (g) where it applies (kernels/cutlass_wq.py), else
        # design (a): quantize-dequantize passes + bf16 grouped GEMM
        t["mx fwd"] = bench(lambda: mx_grouped_mm(x, w, offs, recipe), smoke)
        fwd_design = "(g)" if not smoke and cutlass_wq.applies(x, w, offs, recipe) and \
            cutlass_wq.library(recipe.fmt.value, recipe.scale_mode.value) is not None else "(a)"
        t["mx fwd, design (a)"] = bench(lambda: grouped_mm_nt(fake_quantize(x, recipe, dim=1, out_dtype=torch.bfloat16),
                                                              fake_quantize(w, recipe, dim=2, out_dtype=torch.bfloat16),
                                                              offs), smoke)
        xq = fake_quantize(x, recipe, dim=1, out_dtype=torch.bfloat16)
        wq_k = fake_quantize(w, recipe, dim=2, out_dtype=torch.bfloat16)
        wq_n = fake_quantize(w, recipe, dim=1, out_dtype=torch.bfloat16)
        dyq = fake_quantize(dy, recipe, dim=1, out_dtype=torch.bfloat16)
        t["mx fwd: quantize x"] = bench(lambda: fake_quantize(x, recipe, dim=1, out_dtype=torch.bfloat16), smoke)
        t["mx fwd: quantize w"] = bench(lambda: fake_quantize(w, recipe, dim=2, out_dtype=torch.bfloat16), smoke)
        t["mx fwd: gemm"] = bench(lambda: grouped_mm_nt(xq, wq_k, offs), smoke)

        def dgrad():
            a = fake_quantize(dy, recipe, dim=1, out_dtype=torch.bfloat16)
            b = fake_quantize(w, recipe, dim=1, out_dtype=torch.bfloat16)
            return grouped_mm_nn(a, b, offs)

        t["mx dgrad"] = bench(lambda: mx_grouped_mm_dgrad(dy, w, offs, recipe), smoke)
        dgrad_design = "(g)" if not smoke and cutlass_wq.applies(dy, w, offs, recipe, "dgrad") and \
            cutlass_wq.library(recipe.fmt.value, recipe.scale_mode.value, "dgrad") is not None else "(a)"
        t["mx dgrad, design (a)"] = bench(dgrad, smoke)
        t["mx dgrad: quantize w"] = bench(lambda: fake_quantize(w, recipe, dim=1, out_dtype=torch.bfloat16), smoke)
        t["mx dgrad: gemm"] = bench(lambda: grouped_mm_nn(dyq, wq_n, offs), smoke)

        def wgrad():
            a, b, po = fake_quantize_grouped_tokens_pair(dy, x, offs, recipe, out_dtype=torch.bfloat16)
            return grouped_mm_tn(a, b, po, nonempty_groups=True)

        t["mx wgrad"] = bench(wgrad, smoke)
        a_nl, b_kl, po = fake_quantize_grouped_tokens_pair(dy, x, offs, recipe, out_dtype=torch.bfloat16)
        t["mx wgrad: quantize dy, x"] = bench(
            lambda: fake_quantize_grouped_tokens_pair(dy, x, offs, recipe, out_dtype=torch.bfloat16), smoke)
        t["mx wgrad: quantize dy, x (two launches)"] = bench(
            lambda: (fake_quantize_grouped_tokens(dy, offs, recipe, out_dtype=torch.bfloat16),
                     fake_quantize_grouped_tokens(x, offs, recipe, out_dtype=torch.bfloat16)), smoke)
        t["mx wgrad: gemm"] = bench(lambda: grouped_mm_tn(a_nl, b_kl, po, nonempty_groups=True), smoke)
        pair_exact = all(torch.equal(p.t(), q.t()) for p, q in zip(
            (a_nl, b_kl), (fake_quantize_grouped_tokens(dy, offs, recipe, out_dtype=torch.bfloat16)[0],
                           fake_quantize_grouped_tokens(x, offs, recipe, out_dtype=torch.bfloat16)[0])))
        # w cached: the copies of weight_copy_cache(), made once per optimizer step
        wc = w.detach().clone().requires_grad_(True)
        xr = x.detach().clone().requires_grad_(True)
        with weight_copy_cache() as cache:
            out_cached = mx_grouped_mm(xr, wc, offs, recipe)  # makes both copies (one read)
            wk_c, wn_c = cache.copies(wc, recipe, torch.bfloat16, (-1, -2))  # hits: the copies just made
            cached_exact = (torch.equal(out_cached, mx_grouped_mm(x, w, offs, recipe))
                            and torch.equal(wk_c, wq_k) and torch.equal(wn_c, wq_n))
            t["mx fwd, w cached"] = bench(lambda: grouped_mm_nt(fake_quantize(x, recipe, dim=1, out_dtype=torch.bfloat16),
                                                                wk_c, offs), smoke)
            t["mx dgrad, w cached"] = bench(lambda: grouped_mm_nn(fake_quantize(dy, recipe, dim=1, out_dtype=torch.bfloat16),
                                                                  wn_c, offs), smoke)
        del out_cached, wk_c, wn_c, wc, xr
        t["w copies, one pass (per step)"] = bench(lambda: fake_quantize_rowcol(w, recipe, out_dtype=torch.bfloat16),
                                                   smoke)
        # exactness: design (a) equals bf16 grouped GEMM of the dequantized operands (same kernel)
        exact = torch.equal(mx_grouped_mm(x, w, offs, recipe), grouped_mm_nt(xq, wq_k, offs))
        if use_tao:
            tao = torchao_times(T, K, N, E, skewed)
            if "error" in tao:
                print(f"torchao: {tao['error']}")
            t.update({k: v for k, v in tao.items() if k != "error"})

        def tf(k):
            return flop / t[k] / 1e12 if k in t else None

        row = {"T": T, "K": K, "N": N, "E": E, "skewed": skewed, "sizes_min_max": [min(sizes), max(sizes)],
               "us": {k: v * 1e6 for k, v in t.items()}, "exact_fwd_vs_bf16_of_dequantized": exact,
               "exact_wgrad_pair_vs_two_launches": pair_exact, "exact_cached_vs_per_call": cached_exact,
               "mx fwd design": fwd_design, "mx dgrad design": dgrad_design,
               "exact_dgrad_vs_design_a": torch.equal(mx_grouped_mm_dgrad(dy, w, offs, recipe), dgrad())}
        for op in ("fwd", "dgrad", "wgrad"):
            row[f"ratio {op}"] = t[f"bf16 {op}"] / t[f"mx {op}"]
        for op in ("fwd", "dgrad"):
            row[f"ratio {op}, w cached"] = t[f"bf16 {op}"] / t[f"mx {op}, w cached"]
            for m in (1, 8):  # derived: the per-step pass shared by the step's 2 M GEMMs that read w
                amort = t[f"mx {op}, w cached"] + t["w copies, one pass (per step)"] / (2 * m)
                row[f"ratio {op}, amortized M={m}"] = t[f"bf16 {op}"] / amort
        if "torchao fwd" in t:
            row["x torchao fwd"] = t["torchao fwd"] / t["mx fwd"]
        if "torchao fwd+bwd" in t:
            row["x torchao fwd+bwd"] = t["torchao fwd+bwd"] / (t["mx fwd"] + t["mx dgrad"] + t["mx wgrad"])
        rows.append(row)
        name = f"T={T} K={K} N={N} E={E}{' skewed' if skewed else ''}"
        print(f"\n{name}  (sizes {min(sizes)}..{max(sizes)}; design a exact: {exact}; wgrad pair exact: "
              f"{pair_exact}; cached exact: {cached_exact}; mx fwd: design {fwd_design}; mx dgrad: design {dgrad_design}, equal to (a): {row['exact_dgrad_vs_design_a']})")
        print(f"  {'what':40s} {'us':>9s} {'TFLOP/s':>8s} {'x bf16':>7s}")
        for k, v in t.items():
            op = k.split()[1].rstrip(":,") if k.startswith(("mx", "bf16")) else None
            base = t.get(f"bf16 {op}") if op in ("fwd", "dgrad", "wgrad") else None
            timed_gemm = ":" not in k and "fwd+bwd" not in k and "copies" not in k
            ratio = f"{base / v:7.2f}" if base and timed_gemm else "       "
            tflops = f"{flop / v / 1e12:8.1f}" if timed_gemm else "        "
            print(f"  {k:40s} {v * 1e6:9.1f} {tflops} {ratio}")
        print("  amortized per GEMM (cached + per-step pass / 2M): " + ", ".join(
            f"{op} M={m} {row[f'ratio {op}, amortized M={m}']:.2f}x" for op in ("fwd", "dgrad") for m in (1, 8)))
        for k in ("x torchao fwd", "x torchao fwd+bwd"):
            if k in row:
                print(f"  {k}: {row[k]:.1f}x")
        del x, w, dy, xq, wq_k, wq_n, dyq, a_nl, b_kl
        if not smoke:
            torch.cuda.empty_cache()
    print("\nsummary against the targets (>= 0.85x bf16 TFLOP/s per GEMM, >= 8x torchao):")
    for r in rows:
        name = f"T={r['T']} K={r['K']} N={r['N']} E={r['E']}{' skewed' if r['skewed'] else ''}"
        parts = [f"{op} {r[f'ratio {op}']:.2f}x" for op in ("fwd", "dgrad", "wgrad")]
        parts += [f"{op} w-cached {r[f'ratio {op}, w cached']:.2f}x" for op in ("fwd", "dgrad")]
        parts += [f"{op} M={m} {r[f'ratio {op}, amortized M={m}']:.2f}x" for op in ("fwd", "dgrad") for m in (1, 8)]
        parts += [f"{k} {r[k]:.1f}x" for k in ("x torchao fwd", "x torchao fwd+bwd") if k in r]
        print(f"  {name:40s} " + ", ".join(parts))
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
