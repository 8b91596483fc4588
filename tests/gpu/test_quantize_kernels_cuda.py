"""The Triton quantization kernels compiled for the GPU, bit for bit against the pure-torch
reference at large shapes.

tests/kernels/test_quantize_kernels.py runs the same kernels in the Triton interpreter at
small shapes; here they run on the GPU at model shapes: both FP8 formats, both scale
modes, bf16 and float32 input, the shared worked cases (tests/numerics/data/mx_blocks.json)
planted in large tensors, blocks spread over 2^-40..2^40 with NaN / inf / zeros /
subnormals; codes along either dimension at tile edges and odd layouts (partial tiles, a
row stride wider than the row, every other expert of a 3-D stack, a start not 16-byte
aligned); the row + column fake quantization from one read (activations and 3-D weights);
expert groups of 0, 1, 31 and 33 rows; dequantization; the wgrad operand pair; and the
kernels replayed from a CUDA graph.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

pytest.importorskip("triton")

from mxmoe import fake_quantize_mx, quantize_mx  # noqa: E402
from mxmoe.kernels import quantize as kq  # noqa: E402
from mxmoe.numerics.grouped import torch_quantize_grouped_dim0  # noqa: E402

DEV = torch.device("cuda")
SHAPES = ((1, 2880), (33, 96), (1000, 2880), (16384, 8192))
W_SHAPE = (8, 256, 2880)
GROUP_SIZES = [0, 1, 31, 33, 0, 500, 4000, 64, 7] * 3
CASES = json.loads((Path(__file__).parents[1] / "numerics" / "data" / "mx_blocks.json").read_text())["cases"]
FMT_MODE_DTYPE = [(f, m, d) for f in ("e4m3", "e5m2") for m in ("rceil", "floor")
                  for d in (torch.bfloat16, torch.float32)]


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


def ref_fake(x: torch.Tensor, fmt: str, mode: str, dim: int, out_dtype=torch.bfloat16) -> torch.Tensor:
    return fake_quantize_mx(x, fmt, dim=dim, scale_mode=mode, pad=True, out_dtype=out_dtype, backend="reference")


@pytest.mark.parametrize("fmt,mode,dtype", FMT_MODE_DTYPE, ids=[_id(p) for p in FMT_MODE_DTYPE])
def test_layouts_along_both_dims(fmt, mode, dtype):
    """Codes along the last dim and along the one before it, and the row + column fake
    quantization from one read, at tile edges and odd layouts: partial row and column
    tiles, a row stride wider than the row, every other expert of a 3-D stack, a start not
    16-byte aligned, 33 x 33 tiles with partial last ones."""
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
    failed = []
    for name, x in cases.items():
        for dim in (2, 1):
            q, sc = kq.quantize_along_dim(x, dim, fmt, mode)
            ref = quantize_mx(x, fmt, dim=dim, scale_mode=mode, backend="reference")
            if not (same(q, ref.qdata) and same(sc, ref.scale)):
                failed.append(f"{name} codes along dim {dim}")
        rows, cols = kq.fake_quantize_rowcol(x, fmt, mode, torch.bfloat16)
        if not (same_values(rows, ref_fake(x, fmt, mode, -1)) and same_values(cols, ref_fake(x, fmt, mode, -2))):
            failed.append(f"{name} fake_quantize_rowcol")
    assert not failed, f"differ from the reference: {failed}"


def test_kernels_in_a_cuda_graph():
    """Codes along a dim, the row + column fake quantization and the grouped wgrad operands
    captured in a CUDA graph (compiled before), replayed: equal to eager."""
    x = hard(4096, 2880, seed=30, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 1000, 31, 2000, 1065], device=DEV).cumsum(0).to(torch.int32)

    def work():
        return (*kq.quantize_along_dim(x, 0), *kq.fake_quantize_rowcol(x),
                *kq.fake_quantize_grouped_colwise_pair(x, x[:, :1408], offsets))

    want = work()  # compiles the kernels outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = work()
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
        q, sc = kq.quantize_along_dim(x, 1, fmt, mode)
        check(f"codes along K ({M}, {K})", same(q, ref.qdata) and same(sc, ref.scale))
        if M % 32 == 0:
            refc = quantize_mx(x, fmt, dim=0, scale_mode=mode, backend="reference")
            qc, scc = kq.quantize_along_dim(x, 0, fmt, mode)
            check(f"codes along M ({M}, {K})", same(qc, refc.qdata) and same(scc, refc.scale))
            # codes blocked along M, read as the transposed (K, M) layout they have
            check(f"dequantize colwise ({M}, {K})",
                  same_values(kq.dequantize_colwise(qc.t().contiguous(), scc.t().contiguous(), torch.bfloat16),
                              refc.dequantize(torch.bfloat16)))
            rows, cols = kq.fake_quantize_rowcol(x, fmt, mode, torch.bfloat16)
            check(f"fake_quantize_rowcol ({M}, {K})", same_values(rows, ref_fake(x, fmt, mode, -1))
                  and same_values(cols, ref_fake(x, fmt, mode, -2)))
        for dim in (0, 1):
            got = fake_quantize_mx(x, fmt, dim=dim, scale_mode=mode, pad=True, out_dtype=torch.bfloat16,
                                   backend="triton")
            check(f"fake_quantize dim={dim} ({M}, {K})", same_values(got, ref_fake(x, fmt, mode, dim)))
        check(f"dequantize ({M}, {K})",
              same_values(kq.dequantize_rowwise(q, sc, torch.float32), ref.dequantize()))
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
    for dim in (2, 1):
        q, sc = kq.quantize_along_dim(w, dim, fmt, mode)
        ref = quantize_mx(w, fmt, dim=dim, scale_mode=mode, backend="reference")
        check(f"3-D weights ({E}, {N}, {K}) along dim {dim}", same(q, ref.qdata) and same(sc, ref.scale))
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
          same_values(rows, ref_fake(w3, fmt, mode, 2)) and same_values(cols, ref_fake(w3, fmt, mode, 1)))
    assert not failed, f"differ from the reference: {failed}"
