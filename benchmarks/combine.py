"""The MoE layer's combine and un-permute on the GPU: fused Triton kernels against the torch path.

At each MoE-layer shape of ``benchmarks/moe_layer.py`` (T tokens, D model width, k
choices; A = T * k routed rows, routed uniformly), timed by CUDA-graph replay (device time
only), each checked against the torch path before it is timed:

- combine forward: the torch path of ``_CombineFP8`` (zero-filled index_copy back to
  (token, choice) order, bf16 products, sum over k, ``quantize_mx`` of the per-choice
  outputs) against ``triton_combine_quantize`` (one kernel), plus the inverse permutation
  the fused path computes first;
- combine backward: dy * w, dequantize, the weights' gradient, index_select back to sorted
  order against ``triton_combine_backward``;
- dx un-permute of the fused expert op: index_select + float32 sum over k against
  ``triton_sum_token_rows``.

Checks: bit for bit where the arithmetic is the same (codes and scales, d(y), and for
k <= 2 the sums), else within one bf16 ulp plus the float32 rounding of a sum in another
order (``close``), with the fraction of elements that differ.
Also reports each kernel's bytes moved / time and a device-to-device copy's rate.
``--sweep`` times the kernels at the tiles of TILES at the first shape. Writes JSON with
``--out`` (GPU, versions, commit from $COMMIT). Last, ``large_batch_check``: every fused
MoE kernel at 300k tokens, k = 8 (grid limits). Exits 1 if a check fails.

Usage: python benchmarks/combine.py [--sweep] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantize import bench  # noqa: E402 - CUDA-graph replay timing, shared with the other benchmarks

from mxmoe.kernels import moe as km  # noqa: E402
from mxmoe.moe.layer import inverse_permutation  # noqa: E402 - what _CombineFP8 runs
from mxmoe.numerics.mx_tensor import MXTensor, dequantize_mx, quantize_mx  # noqa: E402

SHAPES = [(32768, 4096, 2), (16384, 2048, 8), (16384, 7168, 4)]  # (T, D, k) of moe_layer.py's shapes
TILES = [((8, 128), 4), ((16, 128), 4), ((8, 256), 4), ((4, 512), 4), ((2, 1024), 4), ((4, 1024), 8)]


def torch_combine_fwd(y_sorted, order, w):
    T, k = w.shape
    D = y_sorted.shape[1]
    y_AD = torch.zeros_like(y_sorted).index_copy(0, order, y_sorted)
    w_Tk = w.to(y_AD.dtype)
    y_TD = (y_AD.view(T, k, D) * w_Tk.unsqueeze(-1)).sum(dim=1)
    mx = quantize_mx(y_AD, "e4m3", block_size=32, dim=1, scale_mode="rceil", pad=True, backend="triton")
    return y_TD, mx.qdata, mx.scale


def torch_combine_bwd(dy, w_Tk, q, s, order):
    T, k = w_Tk.shape
    D = dy.shape[1]
    d_y_AD = (dy.unsqueeze(1) * w_Tk.unsqueeze(-1)).reshape(T * k, D)
    y_AD = dequantize_mx(MXTensor(q, s, "e4m3", 32, 1, "rceil", D), w_Tk.dtype, backend="triton")
    d_w = (dy.unsqueeze(1) * y_AD.view(T, k, D)).sum(dim=-1).float()
    return d_y_AD.index_select(0, order), d_w


def torch_sum_rows(x, rows, k):
    T, D = x.shape[0] // k, x.shape[1]
    return x.index_select(0, rows).view(T, k, D).float().sum(dim=1).to(torch.bfloat16)


def same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def close(a, b, abs_terms, n_terms):
    """Two roundings to bf16 of float32 sums of the same n_terms terms added in different
    orders: |a - b| <= one bf16 ulp (2^-7 relative) + n_terms 2^-24 sum |terms| (the
    float32 rounding of either order: only where the sum cancels does this term count);
    NaN where NaN. abs_terms: sum |terms| per element, float32."""
    a, b = a.float(), b.float()
    bound = 2.0 ** -7 * a.abs() + n_terms * 2.0 ** -24 * abs_terms
    finite = a.isfinite() & b.isfinite() & abs_terms.isfinite()  # elsewhere the bound is inf: ask for equality
    ok = (a == b) | (finite & ((a - b).abs() <= bound)) | a.isnan()
    return torch.equal(a.isnan(), b.isnan()) and bool(ok.all())


def frac_diff(a, b):
    return (a.float() != b.float()).float().mean().item()


def large_batch_check(dev) -> dict:
    """300k tokens, k = 8 (2.4M routed rows): past CUDA's 65535 programs on a grid axis
    other than 0 for kernels that put rows there. Each fused MoE kernel launches and
    agrees with the torch path (bits for codes, products and the gather; the sums within
    ``close``)."""
    from mxmoe.ops.moe_experts import gather_fake_quantize_rows, swiglu_quantize
    from mxmoe.recipe import get_recipe

    T, k, D = 300_000, 8, 64
    A = T * k
    g = torch.Generator(device=dev).manual_seed(1)
    y = torch.randn(A, D, device=dev, generator=g).bfloat16()
    order = torch.randperm(A, device=dev, generator=g)
    w = torch.softmax(torch.randn(T, k, device=dev, generator=g), -1)
    ref = torch_combine_fwd(y, order, w)
    got = km.triton_combine_quantize(y, inverse_permutation(order), w.bfloat16(), "e4m3", "rceil")
    y_AD = torch.zeros_like(y).index_copy(0, order, y).float().view(T, k, D)
    rows_k = torch.argsort(order // k, stable=True)
    rs = torch_sum_rows(y, rows_k, k)
    gs = km.triton_sum_token_rows(y, rows_k, k, torch.bfloat16)
    x = torch.randn(T, D, device=dev, generator=g).bfloat16()
    tri, refr = get_recipe("mxfp8", backend="triton"), get_recipe("mxfp8", backend="reference")
    h = torch.randn(A, 2 * D, device=dev, generator=g).bfloat16()
    out = {
        "combine codes + scales": same(ref[1], got[1]) and same(ref[2], got[2]),
        "combine y_TD": close(ref[0], got[0], (y_AD * w.bfloat16().float().unsqueeze(-1)).abs().sum(1), k),
        "sum rows": close(rs, gs, y_AD.abs().sum(1), k),
        "gather + quantize": same(gather_fake_quantize_rows(x, order // k, tri),
                                  gather_fake_quantize_rows(x, order // k, refr)),
        "swiglu codes": all(same(a, b) for a, b in zip(swiglu_quantize(h, tri)[1:], swiglu_quantize(h, refr)[1:])),
    }
    print(f"\nT={T} k={k} D={D} ({A} routed rows): "
          + ", ".join(f"{n} {'ok' if v else 'FAIL'}" for n, v in out.items()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="time the kernels at the tiles of TILES first")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("combine.py times CUDA kernels and needs a GPU; on the CPU the same checks run in "
              "tests/test_moe_experts.py (Triton interpreter)")
        return 2
    import triton

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": os.environ.get("COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d"),
            "timing": "CUDA-graph replay, median", "tuning_before": dict(km.TUNING)}
    print(json.dumps(info))
    dev = torch.device("cuda")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() / bench(lambda: dst.copy_(src))
    del src, dst
    print(f"device copy: {copy_bw / 1e12:.2f} TB/s")
    rows_out, sweep = [], {}
    for T, D, k in SHAPES:
        g = torch.Generator(device=dev).manual_seed(0)
        A = T * k
        y = torch.randn(A, D, device=dev, generator=g).bfloat16()
        experts = torch.stack([torch.randperm(64, device=dev, generator=g)[:k] for _ in range(64)])
        experts = experts.repeat(T // 64, 1).reshape(-1)  # k distinct experts per token
        order = torch.argsort(experts, stable=True)
        w = torch.softmax(torch.randn(T, k, device=dev, generator=g), -1)
        dy = torch.randn(T, D, device=dev, generator=g).bfloat16()
        inv = inverse_permutation(order)
        w_b = w.bfloat16()
        # correctness first: the fused kernels against the torch path (bits; d_w to float32 rounding)
        ref = torch_combine_fwd(y, order, w)
        got = km.triton_combine_quantize(y, inv, w_b, "e4m3", "rceil")
        rb = torch_combine_bwd(dy, w_b, ref[1], ref[2], order)
        gb = km.triton_combine_backward(dy, w_b, got[1], got[2], inv)
        rows_k = torch.argsort(order // k, stable=True)
        rs = torch_sum_rows(y, rows_k, k)
        gs = km.triton_sum_token_rows(y, rows_k, k, torch.bfloat16)
        # bits where the arithmetic is the same; the float32 sums over k > 2 (torch on CUDA adds them in
        # another order) and d_w's sum over D: rounded to bf16: within ``close``'s bound
        y_AD = torch.zeros_like(y).index_copy(0, order, y).float().view(T, k, D)  # (token, choice) order
        yd = dequantize_mx(MXTensor(ref[1], ref[2], "e4m3", 32, 1, "rceil", D), torch.float32, backend="triton")
        checks = {
            "codes + scales": same(ref[1], got[1]) and same(ref[2], got[2]),
            "d(y sorted)": same(rb[0], gb[0]),
            "y_TD": same(ref[0], got[0]) if k <= 2 else close(
                ref[0], got[0], (y_AD * w_b.float().unsqueeze(-1)).abs().sum(1), k),
            "d(w)": close(rb[1], gb[1], (dy.float().unsqueeze(1) * yd.view(T, k, D)).abs().sum(-1), D),
            "sum rows": same(rs, gs) if k <= 2 else close(rs, gs, y_AD.abs().sum(1), k),
        }
        del y_AD, yd
        diff = {"y_TD": frac_diff(ref[0], got[0]), "sum rows": frac_diff(rs, gs), "d(w)": frac_diff(rb[1], gb[1])}
        print(f"\nT={T} D={D} k={k}: fused against the torch path: "
              + ", ".join(f"{n} {'ok' if v else 'FAIL'}" for n, v in checks.items())
              + "; elements not bit-equal: " + ", ".join(f"{n} {v:.2e}" for n, v in diff.items()))
        fused = {
            "combine": (lambda: km.triton_combine_quantize(y, inv, w_b, "e4m3", "rceil"),
                        A * D * 2 + T * D * 2 + A * D * 33 // 32),
            "combine_bwd": (lambda: km.triton_combine_backward(dy, w_b, got[1], got[2], inv),
                            T * D * 2 + A * D * 33 // 32 + A * D * 2),
            "sum_rows": (lambda: km.triton_sum_token_rows(y, rows_k, k, torch.bfloat16), A * D * 2 + T * D * 2),
        }
        if args.sweep and (T, D, k) == SHAPES[0]:
            for kind, (fn, _) in fused.items():
                keep = km.TUNING[kind]
                times = {}
                for tile in TILES:
                    km.TUNING[kind] = tile
                    times[str(tile)] = bench(fn) * 1e6
                km.TUNING[kind] = keep
                best = min(times, key=times.get)
                sweep.setdefault(kind, {})[f"T={T} D={D} k={k}"] = times
                print(f"  sweep {kind}: " + ", ".join(f"{t} {us:.1f}" for t, us in times.items()) + f"  best {best}")
        t = {
            "combine fwd, torch path": bench(lambda: torch_combine_fwd(y, order, w)),
            "combine fwd, fused (+ inverse)": bench(lambda: km.triton_combine_quantize(
                y, inverse_permutation(order), w.bfloat16(), "e4m3", "rceil")),
            "combine bwd, torch path": bench(lambda: torch_combine_bwd(dy, w_b, ref[1], ref[2], order)),
            "combine bwd, fused": bench(fused["combine_bwd"][0]),
            "dx un-permute, torch path": bench(lambda: torch_sum_rows(y, rows_k, k)),
            "dx un-permute, fused": bench(fused["sum_rows"][0]),
        }
        kernel_bw = {kind: nbytes / bench(fn) for kind, (fn, nbytes) in fused.items()}
        print(f"  {'what':34s} {'us':>9s}")
        for n, v in t.items():
            print(f"  {n:34s} {v * 1e6:9.1f}")
        print("  kernels, bytes moved / time: " + ", ".join(
            f"{kind} {bw / 1e12:.2f} TB/s" for kind, bw in kernel_bw.items()))
        rows_out.append({"T": T, "D": D, "k": k, "checks": checks, "fraction_not_bit_equal": diff,
                         "us": {n: v * 1e6 for n, v in t.items()},
                         "kernel_TBps": {kind: bw / 1e12 for kind, bw in kernel_bw.items()}})
    large = large_batch_check(dev)
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "copy_TBps": copy_bw / 1e12, "sweep": sweep,
                                              "rows": rows_out, "large_batch": large}, indent=1))
    bad = [r for r in rows_out if not all(r["checks"].values())] + [n for n, v in large.items() if not v]
    if bad:
        print(f"NOT EQUAL to the torch path: {len(bad)} failed check groups (exit 1)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
