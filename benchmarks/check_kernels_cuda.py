"""Bit-exactness of the Triton and CUDA quantization kernels on the GPU, at large shapes.

The CPU tests (tests/test_kernels_quantize.py) run the kernels in the Triton interpreter
at small shapes; this script compiles them for the GPU and compares every output byte
with the pure-torch reference (itself checked against the CPU by
benchmarks/check_cuda_reference.py): both FP8 formats, both scale modes, bf16 and
float32 input, the shared worked cases planted in large tensors, blocks spread over
2^-40..2^40 with NaN / inf, expert groups of 0, 1, 31 and 33 rows, dequantization,
fused quantize-dequantize and the Blackwell scale layout.

    PYTHONPATH=src python3 benchmarks/check_kernels_cuda.py
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/check_kernels_cuda.py --smoke  # CPU, small shapes
    PYTHONPATH=src python3 benchmarks/check_kernels_cuda.py --tuning quantize.json  # the launch
        settings a benchmarks/quantize.py --sweep run chose (its JSON result file)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

_ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_ARGS.add_argument("--smoke", action="store_true", help="CPU interpreter, small shapes (the script's own check)")
_ARGS.add_argument("--tuning", metavar="FILE", default=None,
                   help="launch settings from a benchmarks/quantize.py --out JSON result instead of the defaults")
_ARGS.add_argument("--rowcol-cfg", metavar="JSON", action="append", default=None,
                   help="only the row + column layout checks, once per CUDA kernel setting given (repeatable), "
                        "e.g. '{\"threads\": 256, \"rb\": 2, \"gb\": 1, \"scratch\": true, \"cj\": 8}'; "
                        "a setting the kernel refuses is an error")
ARGS = _ARGS.parse_args()
SMOKE = ARGS.smoke
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from mxmoe import quantize_mx, to_blocked_scales  # noqa: E402
from mxmoe.kernels import quantize as kq  # noqa: E402
from mxmoe.numerics import fake_quantize_mx  # noqa: E402
from mxmoe.numerics.grouped import torch_quantize_grouped_dim0  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
if ARGS.tuning:  # launch settings from a quantize.py result file instead of the defaults
    _tuning = json.loads(Path(ARGS.tuning).read_text())["info"]["tuning"]
    for _k, _v in _tuning.items():
        kq.TUNING[_k] = {**_v, "tile": tuple(_v["tile"])} if isinstance(_v, dict) and "tile" in _v else _v
    print("launch settings:", json.dumps(kq.TUNING), flush=True)
SHAPES = ((1, 64), (33, 96), (64, 128)) if SMOKE else ((1, 2880), (33, 96), (1000, 2880), (16384, 8192))
W_SHAPE = (2, 64, 96) if SMOKE else (8, 256, 2880)
GROUP_SIZES = [0, 1, 31, 33, 0, 5] if SMOKE else [0, 1, 31, 33, 0, 500, 4000, 64, 7] * 3
failures: list[str] = []
CASES = json.loads((Path(__file__).resolve().parents[1] / "tests" / "data" / "mx_blocks.json").read_text())["cases"]


def check(name: str, ok: bool) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        failures.append(name)


def hard(M: int, K: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    e_row = torch.randint(-40, 41, (M, 1), generator=g, device=DEV)
    e_col = torch.randint(-20, 21, (1, (K + 31) // 32), generator=g, device=DEV).repeat_interleave(32, 1)[:, :K]
    inner = torch.rand(M, K, generator=g, device=DEV) * 10 - 9
    x = torch.exp2((e_row + e_col).clamp(-60, 60).float() + inner)
    x = x * torch.where(torch.rand(M, K, generator=g, device=DEV) < 0.5, -1.0, 1.0)
    x[torch.rand(M, K, generator=g, device=DEV) < 0.03] = 0.0
    x[torch.rand(M, K, generator=g, device=DEV) < 0.01] = 1e-40
    flat = x.view(-1)
    for v in (float("nan"), float("inf"), -float("inf")):
        flat[torch.randint(0, M * K, (max(M * K // 100000, 1),), generator=g, device=DEV)] = v
    # the worked cases, as row-wise blocks
    for i, case in enumerate(CASES):
        if case["fmt"] in ("e4m3", "e5m2"):
            r, c = (i * 7919) % M, 32 * ((i * 31) % (K // 32)) if K >= 32 else 0
            x[r, c:c + 32] = torch.tensor([float(v) for v in case["values"]], device=DEV)
    return x.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = torch.isnan(b)
    return torch.equal(torch.isnan(a), nan) and torch.equal(a[~nan], b[~nan])


def rowcol_refs(x: torch.Tensor, fmt: str, mode: str):
    """Reference row-wise and transposed column-wise codes and scales of x (B, R, C)."""
    rr = quantize_mx(x, fmt, dim=2, scale_mode=mode, backend="reference")
    rc = quantize_mx(x, fmt, dim=1, scale_mode=mode, backend="reference")
    return rr.qdata, rr.scale, rc.qdata.transpose(1, 2), rc.scale.transpose(1, 2)


def check_rowcol_layouts() -> None:
    """Row + column codes at tile edges and odd layouts: partial row and column tiles,
    a row stride wider than the row, every other expert of a 3-D stack, a start not 16-byte
    aligned (the CUDA kernel declines it: Triton), all three through ``quantize_rowcol``
    (the CUDA kernel for bfloat16 where it applies); and the kernel inside a CUDA graph."""
    from mxmoe.kernels import cuda_quantize

    cfg = kq.TUNING["rowcol_cuda"]
    ran_cuda = 0
    for fmt, mode in (("e4m3", "rceil"), ("e5m2", "floor"), ("e4m3", "floor"), ("e5m2", "rceil")):
        for dtype in (torch.bfloat16, torch.float32):
            cases = {
                "(32, 64)": hard(32, 64, seed=1, dtype=dtype)[None],
                "(160, 2880)": hard(160, 2880, seed=2, dtype=dtype)[None],
                "(992, 96)": hard(992, 96, seed=3, dtype=dtype)[None],
                "(3, 224, 320)": torch.stack([hard(224, 320, seed=4 + e, dtype=dtype) for e in range(3)]),
                "row stride 2944 > 2880": hard(96, 2944, seed=8, dtype=dtype)[None, :, :2880],
                "experts ::2 of (6, 64, 128)": torch.stack([hard(64, 128, seed=9 + e, dtype=dtype)
                                                            for e in range(6)])[::2],
                "start not 16-byte aligned": hard(64, 136, seed=20, dtype=dtype)[None, :, 8:][..., :96]
                if dtype == torch.float32 else hard(64, 136, seed=20, dtype=dtype)[None, :, 1:97],
            }
            if dtype == torch.bfloat16 and not SMOKE:  # 33 x 33 tiles, partial last ones: scale jobs of 1 tile
                cases["(2, 4160, 4192)"] = torch.stack([hard(4160, 4192, seed=40 + e, dtype=dtype) for e in range(2)])
            for name, x in cases.items():
                took = not SMOKE and cuda_quantize.applies(x, fmt, mode, cfg)
                got = kq.quantize_rowcol(x, fmt, mode)
                # applies, and the compile step did not fail (which would have taken Triton)
                took = took and cuda_quantize.is_compiled(fmt, mode, cfg, x.device.index)
                ran_cuda += took
                want = rowcol_refs(x, fmt, mode)
                check(f"rowcol layout {name} {fmt} {mode} {str(dtype)[6:]} ({'cuda' if took else 'triton'})",
                      all(same(a, b) for a, b in zip(got, want)))
    if SMOKE:
        return
    if cfg.get("enabled", True):
        check(f"the CUDA kernel ran ({ran_cuda} of the cases above)", ran_cuda > 0)
    x = hard(4096, 2880, seed=30, dtype=torch.bfloat16)
    want = kq.quantize_rowcol(x)  # compiles the kernel outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = kq.quantize_rowcol(x)
    graph.replay()
    torch.cuda.synchronize()
    check("rowcol in a CUDA graph (replayed)", all(same(a, b) for a, b in zip(got, want)))


def main() -> int:
    print(f"{torch.cuda.get_device_name() if not SMOKE else 'cpu (interpreter)'} | torch {torch.__version__} | "
          f"commit {os.environ.get('COMMIT', 'unknown')}")
    if ARGS.rowcol_cfg:
        default = dict(kq.TUNING["rowcol_cuda"])
        from mxmoe.kernels import cuda_quantize

        for text in ARGS.rowcol_cfg:
            kq.TUNING["rowcol_cuda"] = {"enabled": True, **json.loads(text)}
            if not cuda_quantize._settings_ok(kq.TUNING["rowcol_cuda"]):
                raise SystemExit(f"--rowcol-cfg {text}: not a setting of the CUDA kernel (cuda_quantize._settings_ok)")
            print("rowcol_cuda settings:", json.dumps(kq.TUNING["rowcol_cuda"]), flush=True)
            check_rowcol_layouts()
        kq.TUNING["rowcol_cuda"] = default
        print(f"{len(failures)} failures")
        return 1 if failures else 0
    check_rowcol_layouts()
    for fmt in ("e4m3", "e5m2"):
        for mode in ("rceil", "floor"):
            for dtype in (torch.bfloat16, torch.float32):
                tag = f"{fmt} {mode} {str(dtype)[6:]}"
                for M, K in SHAPES:
                    x = hard(M, K, seed=M + K, dtype=dtype)
                    ref = quantize_mx(x, fmt, scale_mode=mode, backend="reference")
                    q, s = kq.quantize_rowwise(x, fmt, mode)
                    check(f"rowwise {tag} ({M}, {K})", same(q, ref.qdata) and same(s, ref.scale))
                    if M % 32 == 0:
                        refc = quantize_mx(x, fmt, dim=0, scale_mode=mode, backend="reference")
                        q2, s2, qt, st = kq.quantize_rowcol(x, fmt, mode)
                        check(f"rowcol {tag} ({M}, {K})", same(q2, ref.qdata) and same(s2, ref.scale)
                              and same(qt, refc.qdata.t()) and same(st, refc.scale.t()))
                        qc, sc = kq.quantize_colwise(x, fmt, mode)  # column-only codes: their own settings
                        check(f"colwise {tag} ({M}, {K})", same(qc, refc.qdata.t()) and same(sc, refc.scale.t()))
                        check(f"dequantize colwise {tag} ({M}, {K})",
                              same_values(kq.dequantize_colwise(qc, sc, torch.bfloat16),
                                          refc.dequantize(torch.bfloat16, backend="reference")))
                        _, sb, _, stb = kq.quantize_rowcol(x, fmt, mode, blocked=True)
                        check(f"blocked scales {tag} ({M}, {K})", same(sb, to_blocked_scales(ref.scale))
                              and same(stb, to_blocked_scales(refc.scale.t().contiguous())))
                    for dim in (0, 1):
                        want = fake_quantize_mx(x, fmt, dim=dim, scale_mode=mode, pad=True, out_dtype=torch.bfloat16,
                                                backend="reference")
                        got = fake_quantize_mx(x, fmt, dim=dim, scale_mode=mode, pad=True, out_dtype=torch.bfloat16,
                                               backend="triton")
                        check(f"fake_quantize dim={dim} {tag} ({M}, {K})", same_values(got, want))
                    dq = kq.dequantize_rowwise(q, s, torch.float32)
                    check(f"dequantize {tag} ({M}, {K})", same_values(dq, ref.dequantize(backend="reference")))
                E, N, K = W_SHAPE
                w = torch.stack([hard(N, K, seed=100 + e, dtype=dtype) for e in range(E)])
                check(f"3d weights {tag} ({E}, {N}, {K})",
                      all(same(a, b) for a, b in zip(kq.quantize_rowcol(w, fmt, mode), rowcol_refs(w, fmt, mode))))
                sizes = GROUP_SIZES
                T, C = sum(sizes) + 11, W_SHAPE[2]
                x = hard(T, C, seed=7, dtype=dtype)
                x[sum(sizes):] = float("nan")  # rows past the last offset: never read
                offsets = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
                q, s, pofs = kq.quantize_grouped_colwise(x, offsets, fmt, mode)
                rq, rs, rpofs = torch_quantize_grouped_dim0(x, offsets, fmt, mode)
                check(f"grouped colwise {tag} ({T}, {C}), {len(sizes)} experts",
                      same(q, rq) and same(s, rs) and torch.equal(pofs, rpofs))
                dq, _ = kq.fake_quantize_grouped_colwise(x, offsets, fmt, mode, torch.bfloat16)
                check(f"grouped fake_quantize {tag}", same_values(dq.t(), kq.dequantize_rowwise(q, s, torch.bfloat16)))
                # the wgrad pair: x with a narrower, strided second operand, in both orders
                c2 = 40 if SMOKE else 1408
                x2 = hard(2 * T, c2 + 33, seed=8, dtype=dtype)[::2, 5:c2 + 5]
                x2[sum(sizes):] = float("nan")
                dq2, _ = kq.fake_quantize_grouped_colwise(x2, offsets, fmt, mode, torch.bfloat16)
                for first, second, w1, w2 in ((x, x2, dq, dq2), (x2, x, dq2, dq)):
                    p1, p2, ppofs = kq.fake_quantize_grouped_colwise_pair(first, second, offsets, fmt, mode,
                                                                          torch.bfloat16)
                    check(f"grouped fake_quantize pair {tag} C={first.shape[1]},{second.shape[1]}",
                          same(p1, w1) and same(p2, w2) and torch.equal(ppofs, rpofs))
                # the weight's two copies from one read (weight_copy_cache), N = N / 2 + 20: not a multiple of 32
                w3 = torch.stack([hard(N // 2 + 20, K, seed=200 + e, dtype=dtype) for e in range(E)])
                rows, cols = kq.fake_quantize_rowcol(w3, fmt, mode, torch.bfloat16)
                check(f"3d fake_quantize_rowcol {tag} {tuple(w3.shape)}",
                      same_values(rows, fake_quantize_mx(w3, fmt, dim=2, scale_mode=mode, pad=True,
                                                         out_dtype=torch.bfloat16, backend="reference"))
                      and same_values(cols, fake_quantize_mx(w3, fmt, dim=1, scale_mode=mode, pad=True,
                                                             out_dtype=torch.bfloat16, backend="reference")))
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
