"""Benchmark the Triton MX quantizers against a device-to-device copy and torchao.

Effective bandwidth = (bytes read + bytes written) / median time, reported against the
bandwidth of a device-to-device copy of a buffer as large as the kernel's input, measured
in the same process. Every kernel's output is first checked bit for bit against the
pure-torch reference at the benchmark shape.

    PYTHONPATH=src python3 benchmarks/quantize.py [--sweep] [--out results.json]

``--sweep`` first times several tile shapes / warp counts / rounding variants per kernel
at (16384, 8192) and uses the fastest for the table (the printed "tuning" line is what
mxmoe.kernels.quantize.TUNING should hold).

torchao (if importable): its Triton MXFP8 kernels (triton_to_mxfp8_dim0 / dim1), which it
gates to sm100 (we lift the gate and report whether they run on this GPU), and its
pure-torch ``to_mx``. "x torchao" = torchao time / our time for the same job.
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
import triton
from triton.testing import do_bench, do_bench_cudagraph

from mxmoe import quantize_mx
from mxmoe.kernels import quantize as kq
from mxmoe.numerics.grouped import torch_quantize_grouped_dim0

DEV = torch.device("cuda")
SHAPES_2D = [(16384, 8192), (131072, 7168)]
SHAPE_3D = (64, 2048, 7168)
N_EXPERTS = 64
TARGETS = {"rowwise": 0.90, "rowcol": 0.85, "3d rowcol": 0.85, "grouped colwise": 0.80}


GRAPH = {"on": True}  # time kernels by CUDA-graph replay (no host launch overhead in the figure)


def bench(fn, rep: int = 200, warmup: int = 50, graph: bool | None = None) -> float:
    """Median seconds of the device work: replayed from a CUDA graph when ``graph`` (default
    ``GRAPH["on"]``; the op's Python/dispatcher overhead, 20-200 us, would otherwise hide
    the kernel time at the smaller shapes whenever the host is slower than the GPU), else
    eager launches (also when ``fn`` cannot be captured). rep, warmup: milliseconds."""
    if GRAPH["on"] if graph is None else graph:
        try:
            return do_bench_cudagraph(fn, rep=rep, return_mode="median") / 1e3
        except Exception as e:  # noqa: BLE001 - not capturable: fall back to eager timing
            print(f"(graph timing failed: {type(e).__name__}; eager)")
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") / 1e3


def bench_eager(fn) -> float:
    return do_bench(fn, warmup=50, rep=200, return_mode="median") / 1e3


def copy_bandwidth(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    t = bench_eager(lambda: dst.copy_(src))
    return 2 * nbytes / t


def uneven_sizes(T: int, E: int, seed: int) -> list[int]:
    """E expert token counts summing to T: log-normal weights, a few experts empty."""
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.randn(E, generator=g) * 1.2)
    w[torch.randperm(E, generator=g)[:3]] = 0
    sizes = (w / w.sum() * T).floor().long()
    sizes[torch.argmax(w)] += T - sizes.sum()
    return sizes.tolist()


def load_torchao():
    try:
        import torchao.utils as tu

        tu.is_sm_at_least_100 = lambda: True  # lift the sm100 gate to see whether the kernels run here
        import torchao
        from torchao.prototype.mx_formats import kernels as tk
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx

        return {"version": torchao.__version__, "kernels": tk, "to_mx": to_mx, "mode": ScaleCalculationMode}
    except Exception as e:  # noqa: BLE001 - report whatever stops it
        print(f"torchao not usable: {type(e).__name__}: {e}")
        return None


def try_time(fn) -> tuple[float | None, str]:
    try:
        fn()
        torch.cuda.synchronize()
        return bench(fn), ""
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def same(a, b) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _pick(kind: str, options: list[dict], run) -> dict:
    times = []
    for opt in options:
        if "hw_round" in opt:
            kq.TUNING["hw_round"] = opt["hw_round"]
        kq.TUNING[kind] = {k: v for k, v in opt.items() if k != "hw_round"}
        t, err = try_time(run)
        times.append(t if t is not None else float("inf"))
        print(f"sweep {kind:8s} {json.dumps(opt)}: {t * 1e6 if t else float('nan'):.1f} us {err}", flush=True)
    best = options[min(range(len(options)), key=times.__getitem__)]
    if "hw_round" in best:
        kq.TUNING["hw_round"] = best["hw_round"]
    kq.TUNING[kind] = {k: v for k, v in best.items() if k != "hw_round"}
    return best


SWEEP_ONLY = ["t8", "grouped_tok", "dequant_t", "rowcol_cuda"]


def sweep(only: set | None = None) -> dict:
    """Time launch settings at (16384, 8192) bf16; keep the fastest per kernel. ``only``: a
    set of SWEEP_ONLY names to sweep alone ("t8": the t8 tile kernel, row + column then
    column-only codes, each its own settings; "grouped_tok": the dequantized grouped wgrad
    operand; "dequant_t": dequantize_colwise; "rowcol_cuda": the CUDA row + column kernel
    (the t8 sweep turns it off while it runs, so that row + column takes t8)."""
    x = torch.randn(16384, 8192, device=DEV, dtype=torch.bfloat16)
    offsets = torch.tensor(uneven_sizes(16384, N_EXPERTS, 0), device=DEV).cumsum(0).to(torch.int32)
    best = {}
    if only is None or "grouped_tok" in only:
        best["grouped_tok"] = _pick("grouped_tok", [{"block_g": g, "block_c": c, "num_warps": w}
                                                    for g in (2, 4, 8) for c in (64, 128) for w in (g // 2, g)],
                                    lambda: kq.fake_quantize_grouped_colwise(x, offsets, "e4m3", "rceil",
                                                                             torch.bfloat16))
    if only is None or "dequant_t" in only:
        qc, sc = kq.quantize_colwise(x)
        best["dequant_t"] = _pick("dequant_t", [{"tile": t, "num_warps": w} for t in ((64, 64), (64, 128), (128, 64),
                                                                                      (128, 128), (32, 128))
                                                for w in (4, 8)],
                                  lambda: kq.dequantize_colwise(qc, sc, torch.bfloat16))
        del qc, sc
    if only is None or "rowcol_cuda" in only:
        # (threads, rb, gb, scratch): each thread one or two tasks per pass; the other settings
        # (L2 policy, the scales pass's launch shape) as in TUNING, chosen by rowcol_cuda_variants.py
        base = dict(kq.TUNING["rowcol_cuda"])
        best["rowcol_cuda"] = _pick("rowcol_cuda", [
            {**base, "enabled": True, "threads": n, "rb": rb, "gb": gb, "scratch": sc}
            for n, rb, gb, sc in ((128, 4, 2, True), (128, 4, 2, False), (128, 4, 4, True), (128, 2, 1, True),
                                  (256, 2, 1, True), (256, 2, 1, False))]
            + [{**base, "enabled": False}],
            lambda: kq.quantize_rowcol(x))
    if only is not None and "t8" not in only:
        print("tuning:", json.dumps(kq.TUNING))
        return best
    # hw_round 1: Triton's float8 cast; 2: the PTX that also packs codes and applies the NaN rule
    if only is None:
        best["rows"] = _pick("rows", [{"block_b": b, "num_warps": w, "hw_round": h} for h in (1, 2)
                                      for b in (128, 256) for w in (4, 8)],
                             lambda: kq.quantize_rowwise(x))
    # transposing kernels: t8 (8 x 8 patches per thread, one warp per 32-row group), then
    # t4 (quarter reads, shared-memory transpose of words) with t8 off; fmax: block amax by
    # float max of |x| (fewer instructions, other register counts) or integer max of the bits
    # (sweep of 35f56a9: fmax on beats off at every setting; unstaged and 256-row tiles lose;
    # at 506a2f9 two or more row tiles per program, software-pipelined, gained nothing:
    # 167.8-202 us against 168-170, so that kernel option was removed)
    # (session 4, benchmarks/quantize_variants.py: prefetch of the tile 1-2 row tiles below
    # helps, most at 128 x 128 uncapped (two programs per multiprocessor); 4+ hurts)
    cuda_cfg = dict(kq.TUNING["rowcol_cuda"])
    kq.TUNING["rowcol_cuda"] = {**cuda_cfg, "enabled": False}
    best["t8"] = _pick("t8", [{"tile": t, "num_warps": t[0] // 32, "enabled": True, "staged": True, "maxnreg": m,
                               "fmax": True, "prefetch": p} for t, m in (((128, 64), 128), ((128, 128), None))
                              for p in (0, 1, 2)]
                       + [{"tile": t, "num_warps": t[0] // 32, "enabled": True, "staged": True, "maxnreg": None,
                           "fmax": True, "prefetch": p} for t in ((256, 128), (64, 128)) for p in (1, 2)],
                       lambda: kq.quantize_rowcol(x))
    # column-only codes: the same kernel (ROWWISE off), its own settings
    best["t8_colwise"] = _pick("t8_colwise", [{"tile": t, "num_warps": t[0] // 32, "enabled": True, "staged": True,
                                               "maxnreg": 128, "fmax": True, "prefetch": p}
                                              for t in ((128, 64), (256, 64)) for p in (0, 1, 2)],
                               lambda: kq.quantize_colwise(x))
    if only is not None:
        kq.TUNING["rowcol_cuda"] = cuda_cfg
        print("tuning:", json.dumps(kq.TUNING))
        return best
    t8_best = dict(kq.TUNING["t8"])
    kq.TUNING["t8"] = {**t8_best, "enabled": False}
    best["t4"] = _pick("t4", [{"tile": t, "num_warps": w, "enabled": True}
                              for t in ((64, 64), (128, 64)) for w in (4, 8)] + [{"tile": (64, 128), "num_warps": 4, "enabled": False}],
                       lambda: kq.quantize_rowcol(x))
    kq.TUNING["t8"] = t8_best
    kq.TUNING["rowcol_cuda"] = cuda_cfg
    best["grouped_t8"] = _pick("grouped_t8", [{"block_t": t, "block_c": c, "num_warps": t // 32, "enabled": True,
                                               "staged": st, "fmax": f}
                                              for f in (True, False)
                                              for st, t, c in ((False, 128, 64), (True, 128, 64), (True, 256, 64))]
                               + [{"block_t": t, "block_c": 64, "num_warps": t // 32, "enabled": True, "staged": True,
                                   "maxnreg": m, "fmax": f} for f in (True, False) for t in (128, 256)
                                  for m in (128, 120, 112)]
                               + [{"block_t": 64, "block_c": 64, "num_warps": 2, "enabled": False, "staged": False}],
                               lambda: kq.quantize_grouped_colwise(x, offsets))
    best["dequant"] = _pick("dequant", [{"tile": t, "num_warps": 4} for t in ((32, 128), (32, 256))],
                            lambda: kq.dequantize_rowwise(*kq.quantize_rowwise(x), torch.bfloat16))
    print("tuning:", json.dumps(kq.TUNING))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="tune launch settings first")
    ap.add_argument("--sweep-only", default=None, choices=SWEEP_ONLY, action="append",
                    help="sweep only this kernel's settings (repeatable)")
    ap.add_argument("--out", default=None, help="JSON result file")
    ap.add_argument("--torchao-triton", action="store_true",
                    help="also try torchao's Triton MXFP8 kernels (gated to sm100; fail in PTXAS on sm90)")
    ap.add_argument("--eager", action="store_true", help="time eager launches instead of CUDA-graph replay")
    args = ap.parse_args()
    GRAPH["on"] = not args.eager
    commit = os.environ.get("COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                         text=True).stdout.strip() or "unknown"
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit, "date": time.strftime("%Y-%m-%d"), "input": "bf16", "fmt": "e4m3", "mode": "rceil"}
    tao = load_torchao()
    info["torchao"] = tao["version"] if tao else None
    print(json.dumps(info))
    tuning = sweep(set(args.sweep_only) if args.sweep_only else None) if args.sweep or args.sweep_only else None
    info["tuning"] = json.loads(json.dumps(kq.TUNING))
    info["sweep_best"] = tuning
    rows = []

    info["timing"] = "CUDA-graph replay" if GRAPH["on"] else "eager launches"

    def record(shape, kernel, t, nbytes, copy_bw, tao_t=None, tao_note="", exact=True):
        bw = nbytes / t
        row = {"shape": list(shape), "kernel": kernel, "us": t * 1e6, "TB/s": bw / 1e12, "pct_copy": bw / copy_bw,
               "x_torchao": (tao_t / t) if tao_t else None, "torchao_note": tao_note, "bit_exact": exact,
               "target": TARGETS.get(kernel)}
        rows.append(row)
        tx = f"{row['x_torchao']:.2f}x" if row["x_torchao"] else "-"
        print(f"{str(shape):22s} {kernel:18s} {row['us']:9.1f} us {row['TB/s']:6.2f} TB/s "
              f"{100 * row['pct_copy']:5.1f}% of copy  x torchao {tx:>8s}  exact {exact}  {tao_note}", flush=True)

    for M, K in SHAPES_2D:
        x = (torch.randn(M, K, device=DEV) * torch.exp2(torch.randint(-8, 8, (M, 1), device=DEV).float())).to(torch.bfloat16)
        n = M * K
        copy_bw = copy_bandwidth(2 * n)
        rows.append({"shape": [M, K], "kernel": "d2d copy", "TB/s": copy_bw / 1e12})
        print(f"{str((M, K)):22s} {'d2d copy':18s} {copy_bw / 1e12:6.2f} TB/s")
        ref = quantize_mx(x, backend="reference")
        refc = quantize_mx(x, dim=0, backend="reference")
        # torchao
        tao_row = tao_col = tao_tomx = tao_tomx_t = None
        note_row = note_col = ""
        if tao and args.torchao_triton:  # on sm90 these fail in PTXAS (and print the PTX)
            tao_row, note_row = try_time(lambda: tao["kernels"].triton_to_mxfp8_dim0(x, 32, "rceil"))
            tao_col, note_col = try_time(lambda: tao["kernels"].triton_to_mxfp8_dim1(x, 32, "rceil"))
        if tao:
            tao_tomx, _ = try_time(lambda: tao["to_mx"](x, torch.float8_e4m3fn, 32, tao["mode"].RCEIL))
            tao_tomx_t, _ = try_time(lambda: tao["to_mx"](x.t().contiguous(), torch.float8_e4m3fn, 32,
                                                          tao["mode"].RCEIL))
        q, s = kq.quantize_rowwise(x)
        t = bench(lambda: kq.quantize_rowwise(x))
        record((M, K), "rowwise", t, 2 * n + n + n // 32, copy_bw, tao_row or tao_tomx,
               "vs triton_to_mxfp8_dim0" if tao_row else f"vs to_mx (triton dim0: {note_row or 'n/a'})",
               same(q, ref.qdata) and same(s, ref.scale))
        qt, st = kq.quantize_colwise(x)
        t = bench(lambda: kq.quantize_colwise(x))
        record((M, K), "colwise", t, 2 * n + n + n // 32, copy_bw, tao_col or tao_tomx_t,
               "vs triton_to_mxfp8_dim1" if tao_col else f"vs to_mx of x.t() (triton dim1: {note_col or 'n/a'})",
               same(qt, refc.qdata.t()) and same(st, refc.scale.t()))
        out = kq.quantize_rowcol(x)
        t = bench(lambda: kq.quantize_rowcol(x))
        both = (tao_row + tao_col) if (tao_row and tao_col) else ((tao_tomx + tao_tomx_t) if tao_tomx else None)
        record((M, K), "rowcol", t, 2 * n + 2 * n + 2 * (n // 32), copy_bw, both,
               "vs dim0 + dim1 kernels" if tao_row and tao_col else "vs to_mx(x) + to_mx(x.t())",
               same(out[0], ref.qdata) and same(out[1], ref.scale) and same(out[2], refc.qdata.t())
               and same(out[3], refc.scale.t()))
        dq = kq.dequantize_rowwise(q, s, torch.bfloat16)
        t = bench(lambda: kq.dequantize_rowwise(q, s, torch.bfloat16))
        record((M, K), "dequant rowwise", t, n + n // 32 + 2 * n, copy_bw, None, "",
               torch.equal(dq, ref.dequantize(torch.bfloat16, backend="reference")))
        dqc = kq.dequantize_colwise(qt, st, torch.bfloat16)
        t = bench(lambda: kq.dequantize_colwise(qt, st, torch.bfloat16))
        record((M, K), "dequant colwise", t, n + n // 32 + 2 * n, copy_bw, None, "transposed codes back to (M, K)",
               torch.equal(dqc, refc.dequantize(torch.bfloat16, backend="reference")))
        del dqc
        t = bench(lambda: torch.ops.mxmoe.fake_quantize(x, 1, "e4m3", "rceil", torch.bfloat16))
        record((M, K), "fake_quantize", t, 2 * n + 2 * n, copy_bw, None, "read bf16, write dequantized bf16")
        # grouped column-wise: 64 uneven experts
        sizes = uneven_sizes(M, N_EXPERTS, seed=M)
        offsets = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
        qg, sg, _ = kq.quantize_grouped_colwise(x, offsets)
        Tp = qg.shape[1]
        rq, rs, _ = torch_quantize_grouped_dim0(x, offsets)
        t = bench(lambda: kq.quantize_grouped_colwise(x, offsets))
        record((M, K), "grouped colwise", t, 2 * n + K * Tp + K * Tp // 32, copy_bw, tao_col or tao_tomx_t,
               "vs ungrouped dim1 (torchao has no grouped kernel on sm90)", same(qg, rq) and same(sg, rs))
        dqg, _ = kq.fake_quantize_grouped_colwise(x, offsets, "e4m3", "rceil", torch.bfloat16)
        want = kq.dequantize_rowwise(rq, rs, torch.bfloat16)
        t = bench(lambda: kq.fake_quantize_grouped_colwise(x, offsets, "e4m3", "rceil", torch.bfloat16))
        record((M, K), "grouped fake_quant", t, 2 * n + 2 * K * Tp, copy_bw, None,
               "read bf16, write dequantized bf16 (Tp, C) (the wgrad operand)", torch.equal(dqg.t(), want))
        del dqg, want
        del x, q, s, qt, st, out, dq, qg, sg, rq, rs, ref, refc
        torch.cuda.empty_cache()

    E, N, K = SHAPE_3D
    w = torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16)
    n = E * N * K
    copy_bw = copy_bandwidth(2 * n)
    rows.append({"shape": list(SHAPE_3D), "kernel": "d2d copy", "TB/s": copy_bw / 1e12})
    print(f"{str(SHAPE_3D):22s} {'d2d copy':18s} {copy_bw / 1e12:6.2f} TB/s")
    out = kq.quantize_rowcol(w)
    rr = quantize_mx(w, dim=2, backend="reference")
    rc = quantize_mx(w, dim=1, backend="reference")
    exact = same(out[0], rr.qdata) and same(out[1], rr.scale) and same(out[2], rc.qdata.transpose(1, 2)) \
        and same(out[3], rc.scale.transpose(1, 2))
    del rr, rc
    t = bench(lambda: kq.quantize_rowcol(w))
    tao_t = None
    if tao:
        t1, _ = try_time(lambda: tao["to_mx"](w.reshape(E * N, K), torch.float8_e4m3fn, 32, tao["mode"].RCEIL))
        t2, _ = try_time(lambda: tao["to_mx"](w.transpose(1, 2).contiguous().reshape(E * K, N), torch.float8_e4m3fn,
                                              32, tao["mode"].RCEIL))
        tao_t = t1 + t2 if (t1 and t2) else None
    record(SHAPE_3D, "3d rowcol", t, 2 * n + 2 * n + 2 * (n // 32), copy_bw, tao_t, "vs to_mx both ways", exact)

    print("\nsummary against the targets:")
    for r in rows:
        if r.get("target"):
            met = r["pct_copy"] >= r["target"]
            print(f"  {str(tuple(r['shape'])):22s} {r['kernel']:16s} {100 * r['pct_copy']:5.1f}% of copy "
                  f"(target {100 * r['target']:.0f}%): {'met' if met else 'MISSED'}")
    result = {"info": info, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
