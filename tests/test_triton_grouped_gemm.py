"""Triton MXFP8 grouped GEMMs (forward "nt", dgrad "nn", wgrad "tn") against float64.

Without a GPU these run in the Triton interpreter (tests/conftest.py) at small shapes;
``benchmarks/grouped_gemm_tile.py`` checks the GPU build against bf16 torch._grouped_mm.

Error bound. The kernels multiply the dequantized operands exactly (E4M3 value x 2^s is
exact in bfloat16 and in float32 in the normal range used here) and accumulate in float32,
so for each output, with exact = the float64 product of the dequantized operands and
S = sum_k |a_k b_k|:
    float32 output:  |out - exact| <= gamma_K * S,                    gamma_K = K u / (1 - K u), u = 2^-24
    bfloat16 output: |out - exact| <= 2^-8 |exact| + (1 + 2^-8) gamma_K * S
(any summation order; the last term is the rounding of the float32 result to bfloat16).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mxmoe import quantize_mx  # noqa: E402
from mxmoe.kernels import grouped_gemm as gg  # noqa: E402
from mxmoe.numerics.grouped import torch_quantize_grouped_dim0  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
U32 = 2.0 ** -24
NAN_CODE, NAN_SCALE = 0x7F, 255


def data(shape, seed: int) -> torch.Tensor:
    """Values whose 32-blocks span exponents 2^-20..2^20 (scales far from 1), some zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    blocks = torch.randint(-20, 21, (*shape[:-1], (shape[-1] + 31) // 32), generator=g)
    x = x * torch.exp2(blocks.repeat_interleave(32, -1)[..., : shape[-1]].double())
    x[torch.rand(*shape, generator=g) < 0.05] = 0.0
    return x.float()


def quant(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    mx = quantize_mx(x, "e4m3", dim=dim, scale_mode="rceil", pad=True, backend="reference")
    return mx.qdata, mx.scale


def dq64(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Codes (..., C) and scales (..., C / 32) -> float64 values (scale byte 255: NaN)."""
    b = s.view(torch.uint8).double()
    scale = torch.where(b == NAN_SCALE, float("nan"), torch.exp2(b - 127))
    return q.double() * scale.repeat_interleave(32, -1)


def assert_within(out: torch.Tensor, exact: torch.Tensor, S: torch.Tensor, K: int, out_dtype) -> None:
    gamma = K * U32 / (1 - K * U32)
    bound = gamma * S
    if out_dtype == torch.bfloat16:
        bound = 2.0 ** -8 * exact.abs() + (1 + 2.0 ** -8) * bound
    out = out.cpu().double()
    assert torch.isfinite(out).all()
    err = (out - exact).abs()
    assert (err <= bound).all(), f"max err - bound {(err - bound).max().item()}"


def offsets_of(sizes) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def poison_tail(q: torch.Tensor, s: torch.Tensor, n_valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows from n_valid on become NaN codes with NaN scales: reading them would show."""
    q, s = q.clone(), s.clone()
    q.view(torch.uint8)[n_valid:] = NAN_CODE
    s.view(torch.uint8)[n_valid:] = NAN_SCALE
    return q, s


def rowwise_reference(a: torch.Tensor, b: torch.Tensor, sizes) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float64 out[t] = a[t] @ b[e]^T and S = |a[t]| @ |b[e]|^T per group; zeros past the end."""
    T, E, N = a.shape[0], b.shape[0], b.shape[1]
    exact = torch.zeros(T, N, dtype=torch.float64)
    S = torch.zeros(T, N, dtype=torch.float64)
    start = 0
    for e in range(E):
        end = start + sizes[e]
        exact[start:end] = a[start:end] @ b[e].T
        S[start:end] = a[start:end].abs() @ b[e].abs().T
        start = end
    return exact, S


# (group sizes, extra rows past the end, K, N): the edge each case hits in the comment
NT_CASES = [
    ([45, 0, 70, 3, 0, 33], 9, 96, 50),  # empty experts, groups not multiples of 32, K % 64 != 0, N % 32 != 0
    ([0, 0, 100], 0, 64, 33),  # all tokens in the last expert, N = 33, K a multiple of BLOCK_K
    ([1] * 5 + [0] * 28, 3, 32, 40),  # 33 experts (G_POW2 = 64), one token each, K = 32
]


@pytest.mark.parametrize("sizes,extra,K,N", NT_CASES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_forward_nt_matches_float64(sizes, extra, K, N, out_dtype):
    n_valid = sum(sizes)
    T = n_valid + extra
    xq, xs = quant(data((T, K), seed=T + K))
    wq, ws = quant(data((len(sizes), N, K), seed=N))
    exact, S = rowwise_reference(dq64(xq, xs)[:n_valid], dq64(wq, ws), sizes)
    exact = torch.cat([exact, torch.zeros(extra, N, dtype=torch.float64)])
    S = torch.cat([S, torch.zeros(extra, N, dtype=torch.float64)])
    xq, xs = poison_tail(xq, xs, n_valid)  # rows past the end: never read, written as zeros
    out = gg.triton_mx_grouped_mm_nt(xq.to(DEV), xs.to(DEV), wq.to(DEV), ws.to(DEV), offsets_of(sizes).to(DEV),
                                     out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (T, N)
    assert_within(out, exact, S, K, out_dtype)
    assert (out[n_valid:] == 0).all()


def test_dgrad_nn_matches_float64():
    """dx = dy @ w[e] from dy blocked along N and w's column-wise copy (E, K, N); N = 50
    is zero padded to 64 along the contraction, K = 40 output columns."""
    sizes, extra, N, K = [37, 0, 64, 2], 5, 50, 40
    n_valid = sum(sizes)
    T = n_valid + extra
    dyq, dys = quant(data((T, N), seed=3))  # (T, 64)
    w = data((len(sizes), N, K), seed=4)
    wtq, wts = quant(w.transpose(1, 2).contiguous())  # blocks along N, stored (E, K, 64)
    exact, S = rowwise_reference(dq64(dyq, dys)[:n_valid], dq64(wtq, wts), sizes)
    dyq, dys = poison_tail(dyq, dys, n_valid)
    out = gg.triton_mx_grouped_mm_nn(dyq.to(DEV), dys.to(DEV), wtq.to(DEV), wts.to(DEV), offsets_of(sizes).to(DEV),
                                     out_dtype=torch.float32)
    assert out.shape == (T, K)
    assert_within(out[:n_valid], exact, S, 64, torch.float32)
    assert (out[n_valid:] == 0).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_wgrad_tn_matches_float64_and_empty_experts_are_zero(out_dtype):
    """Group sizes with empty experts (their dw exactly 0) and a 33-token group (two
    blocks, the second padded); rows past the end and padded columns past the last
    expert hold NaN and are never read."""
    sizes, extra, N, K = [33, 0, 70, 0, 5], 7, 36, 48
    T = sum(sizes) + extra
    E = len(sizes)
    offsets = offsets_of(sizes)
    dy, x = data((T, N), seed=5), data((T, K), seed=6)
    dy[sum(sizes):] = float("nan")
    x[sum(sizes):] = float("nan")
    aq, as_, poffs = torch_quantize_grouped_dim0(dy, offsets)  # (N, Lp), blocks along tokens
    bq, bs, _ = torch_quantize_grouped_dim0(x, offsets)
    end = int(poffs[-1])
    for q, s in ((aq, as_), (bq, bs)):  # past the last expert: poison
        q.view(torch.uint8)[:, end:] = NAN_CODE
        s.view(torch.uint8)[:, end // 32:] = NAN_SCALE
    A, B = dq64(aq, as_), dq64(bq, bs)
    out = gg.triton_mx_grouped_mm_tn(aq.to(DEV), as_.to(DEV), bq.to(DEV), bs.to(DEV), poffs.to(DEV),
                                     out_dtype=out_dtype)
    assert out.shape == (E, N, K) and out.dtype == out_dtype
    start = 0
    for e in range(E):
        stop = int(poffs[e])
        exact = A[:, start:stop] @ B[:, start:stop].T
        S = A[:, start:stop].abs() @ B[:, start:stop].abs().T
        assert_within(out[e], exact, S, max(stop - start, 1), out_dtype)
        if sizes[e] == 0:
            assert (out[e] == 0).all()
        start = stop


def test_issue_group_sizes_forward_and_wgrad():
    """Group sizes [162, 0, 2577, 446, 0, 83] (a public report's failing case): forward with
    N = 33, and the weight gradients of the two empty experts exactly 0."""
    sizes, N, K = [162, 0, 2577, 446, 0, 83], 33, 32
    T = sum(sizes)
    offsets = offsets_of(sizes)
    x, w, dy = data((T, K), seed=24), data((len(sizes), N, K), seed=25), data((T, N), seed=26)
    xq, xs = quant(x)
    wq, ws = quant(w)
    exact, S = rowwise_reference(dq64(xq, xs), dq64(wq, ws), sizes)
    out = gg.triton_mx_grouped_mm_nt(*(t.to(DEV) for t in (xq, xs, wq, ws, offsets)), out_dtype=torch.float32)
    assert_within(out, exact, S, K, torch.float32)
    aq, as_, poffs = torch_quantize_grouped_dim0(dy, offsets)
    bq, bs, _ = torch_quantize_grouped_dim0(x, offsets)
    dw = gg.triton_mx_grouped_mm_tn(*(t.to(DEV) for t in (aq, as_, bq, bs, poffs))).cpu()
    A, B = dq64(aq, as_), dq64(bq, bs)
    starts = [0] + poffs.tolist()[:-1]
    for e, (s0, s1) in enumerate(zip(starts, poffs.tolist())):
        assert_within(dw[e], A[:, s0:s1] @ B[:, s0:s1].T, A[:, s0:s1].abs() @ B[:, s0:s1].abs().T,
                      max(s1 - s0, 1), torch.float32)
    assert (dw[1] == 0).all() and (dw[4] == 0).all()


def test_tile_orders_persistence_and_scale_loads_give_identical_bits():
    """Supergrouped / row-major / spread orders, persistent or plain grid, per-block or
    per-element scale loads: the same tiles computed the same way, only in another order."""
    sizes, N, K = [70, 0, 100, 3], 80, 64
    T = sum(sizes) + 4
    xq, xs = quant(data((T, K), seed=7))
    wq, ws = quant(data((len(sizes), N, K), seed=8))
    args = [t.to(DEV) for t in (xq, xs, wq, ws, offsets_of(sizes))]
    base = gg.INTERPRETER_CONFIG if DEV == "cpu" else gg.TUNING["nt"]
    ref = gg.triton_mx_grouped_mm_nt(*args, config=base)
    for order in gg.TileOrder:
        for persistent, gather in ((True, False), (False, True)):
            cfg = gg.GemmConfig(**{**base.__dict__, "persistent": persistent, "scale_gather": gather, "group_m": 3})
            out = gg.triton_mx_grouped_mm_nt(*args, order=order, config=cfg)
            assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), (order, persistent, gather)
    # wgrad
    dyt = quant(data((N, 128), seed=9))
    xt = quant(data((K, 128), seed=10))
    poffs = torch.tensor([32, 32, 96, 128], dtype=torch.int32, device=DEV)
    targs = [t.to(DEV) for t in (*dyt, *xt)]
    ref = gg.triton_mx_grouped_mm_tn(*targs, poffs)
    for order in (gg.TileOrder.ROW_MAJOR, gg.TileOrder.SPREAD):
        assert torch.equal(gg.triton_mx_grouped_mm_tn(*targs, poffs, order=order), ref)


def test_nan_scale_and_nan_code_propagate():
    """A block with scale byte 255 (NaN) or an element NaN code makes its output row NaN."""
    sizes, N, K = [4, 4], 16, 64
    xq, xs = quant(data((8, K), seed=11))
    wq, ws = quant(data((2, N, K), seed=12))
    xs.view(torch.uint8)[1, 1] = NAN_SCALE
    xq.view(torch.uint8)[6, 3] = NAN_CODE
    out = gg.triton_mx_grouped_mm_nt(*(t.to(DEV) for t in (xq, xs, wq, ws, offsets_of(sizes))),
                                     out_dtype=torch.float32).cpu()
    nan_rows = torch.isnan(out).all(1)
    assert nan_rows.tolist() == [False, True, False, False, False, False, True, False]
    assert torch.isfinite(out[~nan_rows]).all()


def on_dev(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(DEV) for t in ts)


def test_empty_inputs():
    wq, ws = on_dev(*quant(data((3, 8, 32), seed=13)))
    xq, xs = on_dev(*quant(data((0, 32), seed=14)))
    offs = torch.zeros(3, dtype=torch.int32, device=DEV)
    assert gg.triton_mx_grouped_mm_nt(xq, xs, wq, ws, offs).shape == (0, 8)  # T = 0
    xq, xs = on_dev(*quant(data((5, 32), seed=15)))
    out = gg.triton_mx_grouped_mm_nt(xq, xs, wq, ws, offs)  # every expert empty: all rows past the end
    assert out.shape == (5, 8) and (out == 0).all()
    aq, as_ = on_dev(*quant(data((8, 64), seed=16)))
    bq, bs = on_dev(*quant(data((4, 64), seed=17)))
    dw = gg.triton_mx_grouped_mm_tn(aq, as_, bq, bs, torch.zeros(3, dtype=torch.int32, device=DEV))
    assert dw.shape == (3, 8, 4) and (dw == 0).all()


def test_custom_ops_match_functions():
    sizes, N, K = [5, 11], 16, 32
    xq, xs = quant(data((16, K), seed=18))
    wq, ws = quant(data((2, N, K), seed=19))
    args = on_dev(xq, xs, wq, ws, offsets_of(sizes))
    assert torch.equal(torch.ops.mxmoe.mx_grouped_mm_nt(*args), gg.triton_mx_grouped_mm_nt(*args))
    assert torch.equal(torch.ops.mxmoe.mx_grouped_mm_nn(*args), gg.triton_mx_grouped_mm_nn(*args))
    targs = on_dev(*quant(data((N, 64), seed=20)), *quant(data((K, 64), seed=21)),
                   torch.tensor([32, 64], dtype=torch.int32))
    assert torch.equal(torch.ops.mxmoe.mx_grouped_mm_tn(*targs), gg.triton_mx_grouped_mm_tn(*targs))


def test_validation_errors(monkeypatch):
    xq, xs = on_dev(*quant(data((8, 64), seed=22)))
    wq, ws = on_dev(*quant(data((2, 16, 64), seed=23)))
    offs = offsets_of([4, 4]).to(DEV)
    f = gg.triton_mx_grouped_mm_nt
    with pytest.raises(TypeError, match="dtype"):
        f(xq.float(), xs, wq, ws, offs)
    with pytest.raises(TypeError, match="out_dtype"):
        f(xq, xs, wq, ws, offs, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="multiple of 32"):
        f(xq[:, :48], xs[:, :1], wq[:, :, :48], ws[:, :, :1], offs)
    with pytest.raises(ValueError, match="scales must have shape"):
        f(xq, xs[:, :1], wq, ws, offs)
    with pytest.raises(ValueError, match="contraction"):
        f(xq[:, :32], xs[:, :1], wq, ws, offs)
    with pytest.raises(ValueError, match="offsets"):
        f(xq, xs, wq, ws, offsets_of([8]))
    with pytest.raises(ValueError, match="tile order"):
        f(xq, xs, wq, ws, offs, order="diagonal")
    with pytest.raises(ValueError, match="block_k"):
        gg.GemmConfig(block_k=16)
    with pytest.raises(ValueError, match="padded token length"):
        gg.triton_mx_grouped_mm_tn(xq, xs, wq[0, :, :32], ws[0, :, :1], offs)
    monkeypatch.setattr(gg, "interpreting", lambda: False)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="CUDA"):
            f(xq, xs, wq, ws, offs)


# ---- design (c): the raw weight quantized inside the GEMM (triton_grouped_mm_wq) ----------

def _dequant_ref(x: torch.Tensor, dim: int, fmt: str, mode: str) -> torch.Tensor:
    """float64 dequantized MX values of x along dim (the reference quantizer)."""
    out = quantize_mx(x, fmt, dim=dim, scale_mode=mode, pad=True, backend="reference").dequantize(torch.float32).double()
    assert out.shape == x.shape
    return out


@pytest.mark.parametrize("sizes,extra,K,N", NT_CASES)
@pytest.mark.parametrize("dgrad", [False, True])
@pytest.mark.parametrize("fmt,mode,w_dtype", [("e4m3", "rceil", torch.float32), ("e5m2", "floor", torch.bfloat16)])
def test_wq_design_c_matches_float64(sizes, extra, K, N, dgrad, fmt, mode, w_dtype):
    """Forward (a (T, K) by Q_K(w)^T) and dgrad (a (T, N) by Q_N(w)) with the weight read raw:
    within float32 accumulation of the exact product of the reference-quantized operands;
    rows past the end are never read (NaN there) and come out as zeros."""
    E, T = len(sizes), sum(sizes)
    w = data((E, N, K), seed=31).to(w_dtype)
    C = N if dgrad else K
    a = _dequant_ref(data((T + extra, C), seed=32), 1, fmt, mode).to(torch.bfloat16)
    a[T:] = float("nan")
    wq = _dequant_ref(w.float(), 1 if dgrad else 2, fmt, mode)  # (E, N, K), blocks along the contraction
    b = wq.transpose(1, 2) if dgrad else wq  # (E, out, contraction)
    exact, S = rowwise_reference(a[:T].double(), b, sizes)
    exact = torch.cat([exact, torch.zeros(extra, exact.shape[1], dtype=torch.float64)])
    S = torch.cat([S, torch.zeros(extra, S.shape[1], dtype=torch.float64)])
    out = gg.triton_grouped_mm_wq(a.to(DEV), w.to(DEV), offsets_of(sizes).to(DEV), fmt=fmt, mode=mode, dgrad=dgrad,
                                  out_dtype=torch.float32)
    assert out.shape == (T + extra, K if dgrad else N)
    assert_within(out, exact, S, C, torch.float32)
    assert (out[T:] == 0).all()


def test_wq_design_c_strided_weight_and_small_tiles():
    """A transposed weight view gives the same bits as its contiguous copy; smaller tiles
    (several row and column tiles per expert) stay within the float64 bound (their float32
    sums may group differently, so their bits may differ)."""
    sizes, K, N = [20, 0, 37], 96, 40
    w = data((3, K, N), seed=33).transpose(1, 2)  # (E, N, K), not contiguous
    a = _dequant_ref(data((57, K), seed=34), 1, "e4m3", "rceil").to(torch.bfloat16)
    offs = offsets_of(sizes).to(DEV)
    ref = gg.triton_grouped_mm_wq(a.to(DEV), w.contiguous().to(DEV), offs, out_dtype=torch.float32)
    assert torch.equal(gg.triton_grouped_mm_wq(a.to(DEV), w.to(DEV), offs, out_dtype=torch.float32), ref)
    small = gg.GemmConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=1)
    out = gg.triton_grouped_mm_wq(a.to(DEV), w.to(DEV), offs, out_dtype=torch.float32, config=small)
    exact, S = rowwise_reference(a.double(), _dequant_ref(w.float(), 2, "e4m3", "rceil"), sizes)
    assert_within(out, exact, S, K, torch.float32)


def test_wq_design_c_refusals():
    a = torch.zeros(8, 64, dtype=torch.bfloat16, device=DEV)
    w = torch.zeros(2, 16, 64, device=DEV)
    offs = offsets_of([4, 4]).to(DEV)
    f = gg.triton_grouped_mm_wq
    with pytest.raises(TypeError, match="bfloat16 dequantized"):
        f(a.float(), w, offs)
    with pytest.raises(TypeError, match="w has dtype"):
        f(a, w.to(torch.int32), offs)
    with pytest.raises(TypeError, match="out_dtype"):
        f(a, w, offs, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="contraction is N = 16"):
        f(a, w, offs, dgrad=True)
    with pytest.raises(ValueError, match="offsets"):
        f(a, w, offsets_of([8]))
    with pytest.raises(ValueError, match="e2m1|FP8|format"):
        f(a, w, offs, fmt="e2m1")
    assert f(a[:0], w, offs).shape == (0, 16)


def test_wq_design_c_nonfinite_weight_blocks_give_nan_where_they_contribute():
    """A NaN or inf in a weight block makes that block's scale NaN (docs/NUMERICS.md): the
    outputs it contributes to are NaN, the others finite; forward and dgrad."""
    sizes, K, N = [6, 5], 64, 40
    for dgrad in (False, True):
        w = data((2, N, K), seed=35)
        w[1, 3, 40] = float("nan")  # expert 1: forward block (n 3, k 32..63); dgrad block (n 32..39, k 40)
        w[0, 33, 7] = float("inf")  # expert 0: forward block (n 33, k 0..31); dgrad block (n 32..39, k 7)
        C = N if dgrad else K
        a = _dequant_ref(data((11, C), seed=36), 1, "e4m3", "rceil").to(torch.bfloat16)
        out = gg.triton_grouped_mm_wq(a.to(DEV), w.to(DEV), offsets_of(sizes).to(DEV), dgrad=dgrad,
                                      out_dtype=torch.float32).cpu()
        want = torch.zeros_like(out, dtype=torch.bool)
        if dgrad:  # dx[t, k] takes w[e, n, k] over n: the poisoned blocks hit column k of their expert's rows
            want[6:, 40] = True
            want[:6, 7] = True
        else:  # out[t, n] takes w[e, n, :]: the poisoned rows hit column n
            want[6:, 3] = True
            want[:6, 33] = True
        assert torch.equal(out.isnan(), want), dgrad


def test_wq_design_c_offsets_outside_rows_never_touch_memory_outside():
    """Offsets below 0 or past T (non-decreasing, so inside the documented contract, or a
    bad caller) are clamped into [0, T]: nothing before or after the output is written and
    the rows outside x are not read; offsets past T count as T."""
    K, N = 64, 24
    w = data((3, N, K), seed=37)
    a = _dequant_ref(data((8, K), seed=38), 1, "e4m3", "rceil").to(torch.bfloat16)
    guard = 16
    for offs, groups in (([-5, -5, 8], [(0, 0), (0, 0), (0, 8)]), ([-5, 4, 8], [(0, 0), (0, 4), (4, 8)]),
                         ([4, 8, 100], [(0, 4), (4, 8), (8, 8)]), ([4, 100, 200], [(0, 4), (4, 8), (8, 8)])):
        buf = torch.full((guard + 8 + guard, N), 7.0, device=DEV)
        out = buf[guard:guard + 8]
        real_empty = torch.empty

        def empty_in_guard(*shape, **kw):
            if tuple(shape) == (8, N) and kw.get("dtype") == torch.float32:
                return out
            return real_empty(*shape, **kw)

        gg.torch.empty = empty_in_guard
        try:
            got = gg.triton_grouped_mm_wq(a.to(DEV), w.to(DEV), torch.tensor(offs, dtype=torch.int32, device=DEV),
                                          out_dtype=torch.float32)
        finally:
            gg.torch.empty = real_empty
        assert got.data_ptr() == out.data_ptr()
        assert (buf[:guard] == 7).all() and (buf[guard + 8:] == 7).all(), offs
        wq = _dequant_ref(w.float(), 2, "e4m3", "rceil")
        for e, (lo, hi) in enumerate(groups):
            exact = a[lo:hi].double() @ wq[e].T
            S = a[lo:hi].double().abs() @ wq[e].abs().T
            assert_within(got[lo:hi], exact, S, K, torch.float32)


def test_wq_design_c_no_experts_or_no_contraction_gives_zeros():
    a = torch.full((5, 32), 3.0, dtype=torch.bfloat16, device=DEV)
    out = gg.triton_grouped_mm_wq(a, torch.ones(0, 8, 32, device=DEV), torch.zeros(0, dtype=torch.int32, device=DEV))
    assert out.shape == (5, 8) and (out == 0).all()  # E = 0
    out = gg.triton_grouped_mm_wq(a[:, :0], torch.ones(2, 8, 0, device=DEV), offsets_of([2, 3]).to(DEV))
    assert out.shape == (5, 8) and (out == 0).all()  # K = 0
