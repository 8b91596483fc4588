"""The Triton quantization kernels compiled for the GPU, bit for bit against the pure-torch
reference at large shapes.

tests/kernels/test_quantize_kernels.py runs the same kernels in the Triton interpreter at
small shapes; here they run on the GPU at model shapes: both FP8 formats, both scale
modes, bf16 and float32 input, the shared worked cases (tests/numerics/data/mx_blocks.json)
planted in large tensors, blocks spread over 2^-40..2^40 with NaN / inf / zeros /
subnormals, row + column codes at tile edges and odd layouts, expert groups of 0, 1, 31
and 33 rows, dequantization, fused quantize-dequantize, the wgrad operand pair, the
weight's two copies, the Blackwell blocked scale layout, and ``quantize_rowcol`` replayed
from a CUDA graph.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

pytest.importorskip("triton")

from mxmoe import fake_quantize_mx, quantize_mx, to_blocked_scales  # noqa: E402
from mxmoe.kernels import quantize as kq  # noqa: E402
from mxmoe.numerics.grouped import torch_quantize_grouped_dim0  # noqa: E402

DEV = torch.device("cuda")
SHAPES = ((1, 2880), (33, 96), (1000, 2880), (16384, 8192))
W_SHAPE = (8, 256, 2880)
GROUP_SIZES = [0, 1, 31, 33, 0, 500, 4000, 64, 7] * 3
CASES = json.loads((Path(__file__).parents[1] / "numerics" / "data" / "mx_blocks.json").read_text())["cases"]
FMT_MODE_DTYPE = [(f, m, d) for f in ("e4m3", "e5m2") for m in ("rceil", "floor") for d in (torch.bfloat16, torch.float32)]


def _id(p) -> str:
    f, m, d = p
    return f"{f}-{m}-{str(d)[6:]}"


def hard(M: int, K: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """(M, K) on the GPU: per-32-block exponents over 2^-40..2^40 along both axes, random
    signs, zeros, float32 subnormals, NaN and +-inf, and the worked cases as row blocks."""
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


@pytest.mark.parametrize("fmt,mode,dtype", FMT_MODE_DTYPE, ids=[_id(p) for p in FMT_MODE_DTYPE])
def test_rowcol_layouts(fmt, mode, dtype):
    """Row + column codes at tile edges and odd layouts: partial row and column tiles, a row
    stride wider than the row, every other expert of a 3-D stack, a start not 16-byte
    aligned, 33 x 33 tiles with partial last ones."""
    cases = {
        "(32, 64)": hard(32, 64, seed=1, dtype=dtype)[None],
        "(160, 2880)": hard(160, 2880, seed=2, dtype=dtype)[None],
        "(992, 96)": hard(992, 96, seed=3, dtype=dtype)[None],
        "(3, 224, 320)": torch.stack([hard(224, 320, seed=4 + e, dtype=dtype) for e in range(3)]),
        "row stride 2944 > 2880": hard(96, 2944, seed=8, dtype=dtype)[None, :, :2880],
        "experts ::2 of (6, 64, 128)": torch.stack([hard(64, 128, seed=9 + e, dtype=dtype) for e in range(6)])[::2],
        "start not 16-byte aligned": hard(64, 136, seed=20, dtype=dtype)[None, :, 8:][..., :96]
        if dtype == torch.float32 else hard(64, 136, seed=20, dtype=dtype)[None, :, 1:97],
    }
    if dtype == torch.bfloat16:
        cases["(2, 4160, 4192)"] = torch.stack([hard(4160, 4192, seed=40 + e, dtype=dtype) for e in range(2)])
    failed = [name for name, x in cases.items()
              if not all(same(a, b) for a, b in zip(kq.quantize_rowcol(x, fmt, mode), rowcol_refs(x, fmt, mode)))]
    assert not failed, f"row + column codes differ from the reference for {failed}"


def test_rowcol_in_a_cuda_graph():
    x = hard(4096, 2880, seed=30, dtype=torch.bfloat16)
    want = kq.quantize_rowcol(x)  # compiles the kernel outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = kq.quantize_rowcol(x)
    graph.replay()
    torch.cuda.synchronize()
    assert all(same(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("fmt,mode,dtype", FMT_MODE_DTYPE, ids=[_id(p) for p in FMT_MODE_DTYPE])
def test_2d_kernels_at_large_shapes(fmt, mode, dtype):
    failed = []

    def check(name, ok):
        if not ok:
            failed.append(name)

    for M, K in SHAPES:
        x = hard(M, K, seed=M + K, dtype=dtype)
        ref = quantize_mx(x, fmt, scale_mode=mode, backend="reference")
        q, s = kq.quantize_rowwise(x, fmt, mode)
        check(f"rowwise ({M}, {K})", same(q, ref.qdata) and same(s, ref.scale))
        if M % 32 == 0:
            refc = quantize_mx(x, fmt, dim=0, scale_mode=mode, backend="reference")
            q2, s2, qt, st = kq.quantize_rowcol(x, fmt, mode)
            check(f"rowcol ({M}, {K})", same(q2, ref.qdata) and same(s2, ref.scale) and same(qt, refc.qdata.t())
                  and same(st, refc.scale.t()))
            qc, sc = kq.quantize_colwise(x, fmt, mode)  # column-only codes: their own launch settings
            check(f"colwise ({M}, {K})", same(qc, refc.qdata.t()) and same(sc, refc.scale.t()))
            check(f"dequantize colwise ({M}, {K})",
                  same_values(kq.dequantize_colwise(qc, sc, torch.bfloat16),
                              refc.dequantize(torch.bfloat16, backend="reference")))
            _, sb, _, stb = kq.quantize_rowcol(x, fmt, mode, blocked=True)
            check(f"blocked scales ({M}, {K})", same(sb, to_blocked_scales(ref.scale))
                  and same(stb, to_blocked_scales(refc.scale.t().contiguous())))
        for dim in (0, 1):
            want = fake_quantize_mx(x, fmt, dim=dim, scale_mode=mode, pad=True, out_dtype=torch.bfloat16,
                                    backend="reference")
            got = fake_quantize_mx(x, fmt, dim=dim, scale_mode=mode, pad=True, out_dtype=torch.bfloat16,
                                   backend="triton")
            check(f"fake_quantize dim={dim} ({M}, {K})", same_values(got, want))
        check(f"dequantize ({M}, {K})",
              same_values(kq.dequantize_rowwise(q, s, torch.float32), ref.dequantize(backend="reference")))
        del x, ref
    assert not failed, f"differ from the reference: {failed}"


@pytest.mark.parametrize("fmt,mode,dtype", FMT_MODE_DTYPE, ids=[_id(p) for p in FMT_MODE_DTYPE])
def test_weight_and_grouped_kernels(fmt, mode, dtype):
    failed = []

    def check(name, ok):
        if not ok:
            failed.append(name)

    E, N, K = W_SHAPE
    w = torch.stack([hard(N, K, seed=100 + e, dtype=dtype) for e in range(E)])
    check(f"3-D weights ({E}, {N}, {K})",
          all(same(a, b) for a, b in zip(kq.quantize_rowcol(w, fmt, mode), rowcol_refs(w, fmt, mode))))
    sizes = GROUP_SIZES
    T, C = sum(sizes) + 11, K
    x = hard(T, C, seed=7, dtype=dtype)
    x[sum(sizes):] = float("nan")  # rows past the last offset: never read
    offsets = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
    q, s, pofs = kq.quantize_grouped_colwise(x, offsets, fmt, mode)
    rq, rs, rpofs = torch_quantize_grouped_dim0(x, offsets, fmt, mode)
    check(f"grouped colwise ({T}, {C}), {len(sizes)} experts", same(q, rq) and same(s, rs) and torch.equal(pofs, rpofs))
    dq, _ = kq.fake_quantize_grouped_colwise(x, offsets, fmt, mode, torch.bfloat16)
    check("grouped fake_quantize", same_values(dq.t(), kq.dequantize_rowwise(q, s, torch.bfloat16)))
    # the wgrad pair: x with a narrower, strided second operand, in both orders
    c2 = 1408
    x2 = hard(2 * T, c2 + 33, seed=8, dtype=dtype)[::2, 5:c2 + 5]
    x2[sum(sizes):] = float("nan")
    dq2, _ = kq.fake_quantize_grouped_colwise(x2, offsets, fmt, mode, torch.bfloat16)
    for first, second, w1, w2 in ((x, x2, dq, dq2), (x2, x, dq2, dq)):
        p1, p2, ppofs = kq.fake_quantize_grouped_colwise_pair(first, second, offsets, fmt, mode, torch.bfloat16)
        check(f"grouped fake_quantize pair C={first.shape[1]},{second.shape[1]}",
              same(p1, w1) and same(p2, w2) and torch.equal(ppofs, rpofs))
    # the weight's two copies from one read (weight_copy_cache), N / 2 + 20: not a multiple of 32
    w3 = torch.stack([hard(N // 2 + 20, K, seed=200 + e, dtype=dtype) for e in range(E)])
    rows, cols = kq.fake_quantize_rowcol(w3, fmt, mode, torch.bfloat16)
    check(f"3-D fake_quantize_rowcol {tuple(w3.shape)}",
          same_values(rows, fake_quantize_mx(w3, fmt, dim=2, scale_mode=mode, pad=True, out_dtype=torch.bfloat16,
                                             backend="reference"))
          and same_values(cols, fake_quantize_mx(w3, fmt, dim=1, scale_mode=mode, pad=True, out_dtype=torch.bfloat16,
                                                 backend="reference")))
    assert not failed, f"differ from the reference: {failed}"
