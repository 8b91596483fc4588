"""Triton quantization kernels: bit-exact against the pure-torch reference.

Without a GPU these run in the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at small shapes, with float32-arithmetic rounding; on a GPU the same
tests run the kernels' PTX rounding path. The GPU-only code (inline PTX) is also compiled
for sm90 here without a GPU (test_gpu_only_kernel_paths_compile_for_sm90).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from mxmoe import dequantize_mx, quantize_mx  # noqa: E402
from mxmoe.kernels import quantize as kq  # noqa: E402
from mxmoe import fake_quantize_mx  # noqa: E402
from mxmoe.numerics.grouped import torch_quantize_grouped_dim0  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FMT_MODES = [(f, m) for f in ("e4m3", "e5m2") for m in ("rceil", "floor")]
CASES = json.loads((Path(__file__).parents[1] / "numerics" / "data" / "mx_blocks.json").read_text())["cases"]


def hard(M: int, K: int, seed: int, dtype=torch.float32, specials: bool = True) -> torch.Tensor:
    """(M, K) with per-32-block exponents over 2^-40..2^40 (along both axes), zeros,
    float32 subnormals and, optionally, NaN / +-inf sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    e_row = torch.randint(-40, 41, (M, 1), generator=g)
    e_col = torch.randint(-20, 21, (1, (K + 31) // 32), generator=g).repeat_interleave(32, 1)[:, :K]
    inner = torch.rand(M, K, generator=g, dtype=torch.float64) * 10 - 9
    x = torch.exp2((e_row + e_col).clamp(-60, 60) + inner) * torch.where(torch.rand(M, K, generator=g) < 0.5, -1, 1)
    x = x.float()
    x[torch.rand(M, K, generator=g) < 0.03] = 0.0
    x[torch.rand(M, K, generator=g) < 0.01] = 1e-40
    if specials and M * K > 64:
        flat = x.view(-1)
        for v in (float("nan"), float("inf"), -float("inf")):
            flat[torch.randint(0, M * K, (max(M * K // 500, 1),), generator=g)] = v
    return x.to(dtype).to(DEV)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def ref_rowwise(x, fmt, mode, pad=False):
    mx = quantize_mx(x.cpu(), fmt, dim=-1, scale_mode=mode, pad=pad, backend="reference")
    return u8(mx.qdata), u8(mx.scale)


def ref_colwise(x, fmt, mode, pad=False):
    """Blocks along dim -2, in place: (..., Mp, K) codes, (..., Mp / 32, K) scales."""
    mx = quantize_mx(x.cpu(), fmt, dim=-2, scale_mode=mode, pad=pad, backend="reference")
    return u8(mx.qdata), u8(mx.scale)


def assert_same_values(got, want, what=""):
    """Equal values, NaN where the other is NaN."""
    got, want = got.cpu(), want.cpu()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], want[~nan]), what


def ref_fake(x, fmt, mode, dim, out_dtype=torch.bfloat16):
    return fake_quantize_mx(x.cpu(), fmt, dim=dim, scale_mode=mode, out_dtype=out_dtype, pad=True,
                            backend="reference")


@pytest.mark.parametrize("M,K", [(1, 32), (33, 96), (1000, 96), (33, 2880), (1, 2880), (1000, 32)])
@pytest.mark.parametrize("fmt,mode", FMT_MODES)
def test_rowwise_bit_exact(M, K, fmt, mode):
    """Row-wise codes and scales (quantize_mx's Triton op along the last dim): the
    contiguous-rows kernel, and the tile kernel for a strided view of the same values."""
    dtype = torch.bfloat16 if (M + K) % 2 else torch.float32
    x = hard(M, K, seed=M * 7 + K, dtype=dtype)
    rq, rs = ref_rowwise(x, fmt, mode)
    for xin in (x, x.t().contiguous().t()):  # contiguous: _mx_rows_kernel; strided: _mx_tile_kernel
        q, s = kq.quantize_along_dim(xin, 1, fmt, mode)
        assert q.shape == (M, K) and s.shape == (M, K // 32)
        assert torch.equal(u8(q), rq) and torch.equal(u8(s), rs)


def test_rowwise_large_shape_both_dtypes():
    """M = 1000, K = 2880: masked row tail and a column tail inside a tile."""
    for dtype, (fmt, mode) in ((torch.float32, ("e4m3", "rceil")), (torch.bfloat16, ("e5m2", "floor"))):
        x = hard(1000, 2880, seed=5, dtype=dtype)
        q, s = kq.quantize_along_dim(x, 1, fmt, mode)
        rq, rs = ref_rowwise(x, fmt, mode)
        assert torch.equal(u8(q), rq) and torch.equal(u8(s), rs)


@pytest.mark.parametrize("M,K", [(32, 32), (96, 33), (1024, 96), (64, 2880)])
@pytest.mark.parametrize("fmt,mode", FMT_MODES)
def test_colwise_and_rowcol_bit_exact(M, K, fmt, mode):
    """Column-wise codes and scales (blocks along M, in place), and the row + column fake
    quantization from one read (fake_quantize_rowcol, what mx_linear and the weight cache
    run): both along each dim as the reference has them."""
    dtype = torch.bfloat16 if K % 2 else torch.float32
    x = hard(M, K, seed=M + K, dtype=dtype)
    q, s = kq.quantize_along_dim(x, 0, fmt, mode)
    rq, rs = ref_colwise(x, fmt, mode)
    assert q.shape == (M, K) and s.shape == (M // 32, K)
    assert torch.equal(u8(q), rq) and torch.equal(u8(s), rs)
    rows, cols = kq.fake_quantize_rowcol(x, fmt, mode, torch.bfloat16)
    assert rows.shape == cols.shape == (M, K)
    assert_same_values(rows, ref_fake(x, fmt, mode, -1))
    assert_same_values(cols, ref_fake(x, fmt, mode, -2))


def test_colwise_needs_a_multiple_of_32_or_pad():
    x = hard(33, 64, seed=1)
    with pytest.raises(ValueError, match="33, not a multiple of the block size 32.*pad=True"):
        kq.quantize_along_dim(x, 0)
    q, s = kq.quantize_along_dim(x, 0, pad=True)
    rq, rs = ref_colwise(x, "e4m3", "rceil", pad=True)
    assert q.shape == (64, 64) and torch.equal(u8(q), rq) and torch.equal(u8(s), rs)


@pytest.mark.parametrize("fmt,mode", FMT_MODES)
def test_expert_weights_3d_both_ways(fmt, mode):
    """(E, N, K) expert weights along K and along N (one tile grid axis per expert), and
    their row + column fake quantization from one read."""
    E, N, K = 3, 64, 96
    w = torch.stack([hard(N, K, seed=e) for e in range(E)]).to(DEV)
    q, s = kq.quantize_along_dim(w, 2, fmt, mode)
    qn, sn = kq.quantize_along_dim(w, 1, fmt, mode)
    rq, rs = ref_rowwise(w, fmt, mode)
    rqn, rsn = ref_colwise(w, fmt, mode)
    assert q.shape == qn.shape == (E, N, K) and sn.shape == (E, N // 32, K)
    assert torch.equal(u8(q), rq) and torch.equal(u8(s), rs)
    assert torch.equal(u8(qn), rqn) and torch.equal(u8(sn), rsn)
    rows, cols = kq.fake_quantize_rowcol(w, fmt, mode, torch.float32)
    assert_same_values(rows, ref_fake(w, fmt, mode, -1, torch.float32))
    assert_same_values(cols, ref_fake(w, fmt, mode, -2, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_worked_cases_at_every_position(dtype):
    """Each case of ../shared/cases/mx_blocks.json placed inside larger tensors, as a
    row-wise block and as a column-wise block, at several positions; in bf16 the cases
    become bf16 subnormals, huge values and ties of their own, which must match too."""
    for i, case in enumerate(CASES):
        if case["fmt"] not in ("e4m3", "e5m2"):
            continue
        vals = torch.tensor([float(v) for v in case["values"]], dtype=torch.float32)
        x = hard(96, 128, seed=100 + i, specials=False).cpu()
        r, c = (i * 7) % 96, 32 * (i % 4)
        x[r, c:c + 32] = vals  # a row-wise block
        cc, rr = (c + 32 + (i * 13) % 32) % 128, 32 * (i % 3)
        x[rr:rr + 32, cc] = vals  # a column-wise block, in another column group
        x = x.to(dtype).to(DEV)
        q, s = kq.quantize_along_dim(x, 1, case["fmt"], case["scale_mode"])
        qc, sc = kq.quantize_along_dim(x, 0, case["fmt"], case["scale_mode"])
        rq, rs = ref_rowwise(x, case["fmt"], case["scale_mode"])
        rqc, rsc = ref_colwise(x, case["fmt"], case["scale_mode"])
        assert torch.equal(u8(q), rq) and torch.equal(u8(s), rs), case["name"]
        assert torch.equal(u8(qc), rqc) and torch.equal(u8(sc), rsc), case["name"]
        if dtype is torch.float32:
            assert u8(s)[r, c // 32].item() == case["scale_byte"], case["name"]
            assert u8(sc)[rr // 32, cc].item() == case["scale_byte"], case["name"]
        for d in (0, 1):  # the fused quantize-dequantize of the recipe, bf16 output
            want = fake_quantize_mx(x.cpu(), case["fmt"], dim=d, scale_mode=case["scale_mode"],
                                    out_dtype=torch.bfloat16, backend="reference")
            got = fake_quantize_mx(x, case["fmt"], dim=d, scale_mode=case["scale_mode"],
                                   out_dtype=torch.bfloat16, backend="triton").cpu()
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], want[~nan]), case["name"]


GROUPS = {
    "empty_one_31_33": [0, 1, 31, 33, 0, 64],
    "all_on_one_expert": [0, 130, 0],
    "single_expert": [70],
}


@pytest.mark.parametrize("name", list(GROUPS))
@pytest.mark.parametrize("fmt,mode", FMT_MODES)
def test_grouped_colwise_bit_exact(name, fmt, mode):
    sizes = GROUPS[name]
    T, C = sum(sizes) + 9, 96  # 9 rows past the last offset hold NaN: never read
    x = hard(T, C, seed=len(name))
    x[sum(sizes):] = float("nan")
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32).to(DEV)
    q, s, pofs = kq.quantize_grouped_colwise(x, offsets, fmt, mode)
    rq, rs, rpofs = torch_quantize_grouped_dim0(x.cpu(), offsets.cpu(), fmt, mode)
    Tp = 32 * (T // 32 + len(sizes))
    assert q.shape == (C, Tp) and s.shape == (C, Tp // 32)
    assert torch.equal(u8(q), u8(rq)) and torch.equal(u8(s), u8(rs))
    assert torch.equal(pofs.cpu(), rpofs)
    dq, pofs2 = kq.fake_quantize_grouped_colwise(x, offsets, fmt, mode, torch.float32)
    want = torch.ops.mxmoe.dequantize_rowwise(q, s, torch.float32)  # (C, Tp)
    assert dq.shape == (Tp, C) and dq.is_contiguous()
    assert torch.equal(dq.t().cpu().nan_to_num(7.0), want.cpu().nan_to_num(7.0)) and torch.equal(pofs2, pofs)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dequantize_and_fake_quantize_match_reference(out_dtype, fmt):
    x = hard(64, 96, seed=3, dtype=torch.bfloat16)
    mx = quantize_mx(x.cpu(), fmt, backend="reference")
    want = dequantize_mx(mx, out_dtype, backend="reference")
    got = kq.dequantize_rowwise(mx.qdata.to(DEV), mx.scale.to(DEV), out_dtype).cpu()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], want[~nan])
    for dim in (0, 1):
        want = fake_quantize_mx(x.cpu(), fmt, dim=dim, out_dtype=out_dtype, backend="reference", pad=True)
        got = fake_quantize_mx(x, fmt, dim=dim, out_dtype=out_dtype, backend="triton", pad=True).cpu()
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], want[~nan])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(96, 160), (33, 64), (1, 32), (200, 96)])
def test_dequantize_colwise_is_the_transposed_rowwise(shape, fmt, out_dtype):
    """dequantize_colwise(codes (K, M), scales) == dequantize_rowwise(...).t(), contiguous
    (M, K), at shapes that are not multiples of the transposing tile (masked edges)."""
    K, M = shape
    x = hard(K, M, seed=K + M)
    mx = quantize_mx(x.cpu(), fmt, backend="reference")
    q, s = mx.qdata.to(DEV), mx.scale.to(DEV)
    got = kq.dequantize_colwise(q, s, out_dtype)
    assert got.shape == (M, K) and got.is_contiguous() and got.dtype == out_dtype
    want = kq.dequantize_rowwise(q, s, out_dtype).t()
    assert torch.equal(got.cpu().nan_to_num(7.0), want.cpu().nan_to_num(7.0))
    with pytest.raises(ValueError, match="2-D"):
        kq.dequantize_colwise(q.unsqueeze(0), s.unsqueeze(0), out_dtype)


@pytest.mark.parametrize("shape", [(5, 0), (0, 64), (0, 0)])
def test_dequantize_empty_shapes_match_their_fakes(shape):
    """Empty codes give the shapes the ops' fake (meta) functions give: (M, K) for
    dequantize_colwise of (K, M) codes, the codes' shape for dequantize_rowwise."""
    K, M = shape
    q = torch.zeros(K, M, device=DEV).to(torch.float8_e4m3fn)
    s = torch.zeros(K, M // 32, dtype=torch.uint8, device=DEV)
    assert kq.dequantize_colwise(q, s, torch.float32).shape == (M, K)
    assert kq.dequantize_rowwise(q, s, torch.float32).shape == (K, M)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fq = torch.empty(K, M, dtype=torch.float8_e4m3fn)
        fs = torch.empty(K, M // 32, dtype=torch.uint8)
        assert torch.ops.mxmoe.dequantize_colwise(fq, fs, torch.float32).shape == (M, K)


@pytest.mark.parametrize("block_g,block_c", [(1, 32), (2, 64), (4, 32)])
def test_grouped_token_dequantized_any_tile(monkeypatch, block_g, block_c):
    """The (Tp, C) dequantized wgrad operand is the same for any blocks per program and
    column tile (experts with 0, 1, 31, 33 rows, NaN rows past the end, C not a multiple
    of the tile), and equals the reference path of ops.fake_quantize_grouped_tokens,
    which returns the same (C, Tp) view of a contiguous (Tp, C) tensor."""
    from mxmoe.ops.quantize import fake_quantize_grouped_tokens
    from mxmoe.recipe import get_recipe

    monkeypatch.setattr(kq, "_TILE_INTERPRETER", (64, block_c))
    monkeypatch.setattr(kq, "_GROUPED_TOK_INTERPRETER_G", block_g)
    sizes = [0, 1, 31, 33, 0, 64]
    T, C = sum(sizes) + 5, 96
    x = hard(T, C, seed=block_g * block_c)
    x[sum(sizes):] = float("nan")
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32).to(DEV)
    rq, rs, rpofs = torch_quantize_grouped_dim0(x.cpu(), offsets.cpu())
    want = kq.dequantize_rowwise(rq.to(DEV), rs.to(DEV), torch.float32).t().cpu()
    dq, pofs = kq.fake_quantize_grouped_colwise(x, offsets, "e4m3", "rceil", torch.float32)
    assert dq.shape == want.shape and torch.equal(dq.cpu().nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.equal(pofs.cpu(), rpofs)
    for backend in ("triton", "reference"):
        got, po = fake_quantize_grouped_tokens(x, offsets, get_recipe("mxfp8", backend=backend),
                                               out_dtype=torch.float32)
        assert got.shape == (C, want.shape[0]) and got.t().is_contiguous()
        assert torch.equal(got.t().cpu().nan_to_num(7.0), want.nan_to_num(7.0)) and torch.equal(po.cpu(), rpofs)



@pytest.mark.parametrize("block_g,block_c,fmt,mode,out_dtype", [
    (1, 32, "e4m3", "rceil", torch.float32), (2, 64, "e5m2", "floor", torch.bfloat16),
    (4, 32, "e4m3", "floor", torch.bfloat16), (2, 32, "e5m2", "rceil", torch.float32)])
def test_grouped_token_pair_equals_two_singles(monkeypatch, block_g, block_c, fmt, mode, out_dtype):
    """The one-launch pair kernel (the wgrad operands dY, X) writes bit for bit what two
    single-tensor launches write, for either operand taking the first or the second
    column programs: widths that are and are not multiples of the tile (96, 40, 1),
    strided input, experts with 0, 1, 31, 33 rows, NaN rows past the end."""
    monkeypatch.setattr(kq, "_TILE_INTERPRETER", (64, block_c))
    monkeypatch.setattr(kq, "_GROUPED_TOK_INTERPRETER_G", block_g)
    sizes = [0, 1, 31, 33, 0, 64]
    T = sum(sizes) + 5
    a = hard(T, 96, seed=block_g + block_c)
    b = hard(2 * T, 40, seed=7)[::2]  # row stride 80: a strided view
    c = hard(T, 1, seed=8)
    for t in (a, b, c):
        t[sum(sizes):] = float("nan")
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32).to(DEV)
    for first, second in ((a, b), (b, a), (c, a), (a, c)):
        first, second = first.to(DEV), second.to(DEV)
        want1, po1 = kq.fake_quantize_grouped_colwise(first, offsets, fmt, mode, out_dtype)
        want2, _ = kq.fake_quantize_grouped_colwise(second, offsets, fmt, mode, out_dtype)
        got1, got2, po = kq.fake_quantize_grouped_colwise_pair(first, second, offsets, fmt, mode, out_dtype)
        for got, want in ((got1, want1), (got2, want2)):
            assert got.shape == want.shape and got.dtype == out_dtype
            assert torch.equal(got.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                               want.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32))
        assert torch.equal(po, po1)


def test_grouped_token_pair_ops_level_and_edges():
    """ops.fake_quantize_grouped_tokens_pair equals two fake_quantize_grouped_tokens calls
    on both backends (and for operands of different dtypes, which take the two-call
    path); no tokens and no experts give zeros; mismatched rows are refused."""
    from mxmoe.ops.quantize import fake_quantize_grouped_tokens, fake_quantize_grouped_tokens_pair
    from mxmoe.recipe import get_recipe

    sizes = [5, 0, 40, 19]
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32).to(DEV)
    a = hard(70, 64, seed=1).to(DEV)
    b = hard(70, 33, seed=2).to(DEV)
    for backend in ("triton", "reference"):
        r = get_recipe("mxfp8", backend=backend)
        for bb in (b, b.to(torch.bfloat16)):
            ga, gb, po = fake_quantize_grouped_tokens_pair(a, bb, offsets, r, out_dtype=torch.float32)
            wa, wpo = fake_quantize_grouped_tokens(a, offsets, r, out_dtype=torch.float32)
            wb, _ = fake_quantize_grouped_tokens(bb, offsets, r, out_dtype=torch.float32)
            assert torch.equal(ga.view(torch.int32), wa.view(torch.int32)) and torch.equal(po, wpo)
            assert torch.equal(gb.view(torch.int32), wb.view(torch.int32))
            assert ga.t().is_contiguous() and gb.t().is_contiguous()
    # no tokens (T = 0) and no experts (E = 0): zero-filled outputs of the padded size
    for T, offs in ((0, torch.zeros(3, dtype=torch.int32)), (10, torch.zeros(0, dtype=torch.int32))):
        da, db, po = kq.fake_quantize_grouped_colwise_pair(hard(T, 32, 3, specials=False).to(DEV),
                                                           hard(T, 8, 4, specials=False).to(DEV), offs.to(DEV))
        Tp = 32 * (T // 32 + offs.numel())
        assert da.shape == (Tp, 32) and db.shape == (Tp, 8) and not da.any() and not db.any()
        assert po.shape == offs.shape
    with pytest.raises(ValueError, match="same T"):
        fake_quantize_grouped_tokens_pair(a, b[:69], offsets, get_recipe("mxfp8"), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="one device|\\(T, CA\\)"):
        kq.fake_quantize_grouped_colwise_pair(a, b[:69], offsets)
    with pytest.raises(TypeError, match="out_dtype"):
        kq.fake_quantize_grouped_colwise_pair(a, b, offsets, out_dtype=torch.float16)

def test_quantize_mx_backend_triton_equals_reference_on_views():
    base = hard(96, 64, seed=4)
    for x, dim in ((base, 1), (base, 0), (base.t(), 0), (base.t(), 1), (base[:, ::2], 0), (base.view(3, 32, 64), 1)):
        a = quantize_mx(x, dim=dim, backend="triton")
        b = quantize_mx(x.cpu(), dim=dim, backend="reference")
        assert torch.equal(u8(a.qdata), u8(b.qdata)) and torch.equal(u8(a.scale), u8(b.scale))
        assert a.qdata.shape == b.qdata.shape and a.scale.shape == b.scale.shape
    a = quantize_mx(base[:50], dim=0, pad=True, backend="triton")
    b = quantize_mx(base[:50].cpu(), dim=0, pad=True, backend="reference")
    assert torch.equal(u8(a.qdata), u8(b.qdata)) and a.shape == b.shape == (50, 64)
    da, db = dequantize_mx(a, backend="triton"), dequantize_mx(b, backend="reference")
    assert torch.equal(da.cpu().nan_to_num(7.0), db.nan_to_num(7.0))


def test_triton_backend_refusals():
    x = hard(32, 32, seed=0)
    with pytest.raises(ValueError, match="backend='triton' covers e4m3/e5m2"):
        quantize_mx(x, "e2m1", backend="triton")
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        quantize_mx(x, backend="cuda")
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        kq.quantize_along_dim(x.half(), 1)


def test_custom_ops_are_registered_for_compile():
    """The ops have fake (meta) implementations: torch.compile and autograd can trace them."""
    x = hard(64, 64, seed=2, specials=False)
    offsets = torch.tensor([10, 64], dtype=torch.int32, device=DEV)
    torch.library.opcheck(torch.ops.mxmoe.quantize_along_dim.default, (x, 1, "e4m3", "rceil", False),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.mxmoe.quantize_along_dim.default, (x[:40], 0, "e5m2", "floor", True),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.mxmoe.fake_quantize_rowcol.default, (x, "e5m2", "floor", torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.mxmoe.quantize_grouped_colwise.default, (x, offsets, "e4m3", "rceil"),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.mxmoe.fake_quantize_grouped_colwise.default,
                          (x, offsets, "e4m3", "rceil", torch.float32), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.mxmoe.fake_quantize_along_dim.default, (x, 0, "e4m3", "rceil", torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("recipe_name", ["mxfp8", "mxfp8-floor"])
def test_recipe_on_the_kernels_is_bit_identical(recipe_name):
    """The recipe's GEMMs with the Triton quantizers give the same bits as with the
    reference: outputs, input gradients and weight gradients."""
    from mxmoe import get_recipe, mx_grouped_mm, mx_linear

    sizes = [40, 0, 33, 31]
    T, K, N = sum(sizes) + 3, 64, 96
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(len(sizes), N, K, generator=g) / 8).to(DEV)
    dy = torch.randn(T, N, generator=g).to(torch.bfloat16).to(DEV)
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32).to(DEV)
    results = {}
    for backend in ("reference", "triton"):
        r = get_recipe(recipe_name, backend=backend)
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = mx_grouped_mm(xg, wg, offsets, r)
        y.backward(dy)
        xl, wl = x.clone().requires_grad_(True), w[0].clone().requires_grad_(True)
        yl = mx_linear(xl, wl, r)
        yl.backward(dy)
        results[backend] = [t.detach().cpu() for t in (y, xg.grad, wg.grad, yl, xl.grad, wl.grad)]
    for a, b in zip(results["reference"], results["triton"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tile", [(32, 32), (32, 64), (64, 32), (64, 256), (128, 64)])
def test_every_tile_shape(monkeypatch, tile):
    """Every kernel at tiles one block wide or high (reshape-free reductions; one 32-token
    block per program of the grouped kernels) and wider ones: row-wise codes from the rows
    kernel and, for a strided view, the tile kernel; column-wise codes; the row + column
    fake quantization; grouped codes (t8 layout) and dequantized values; all the same
    bytes as the reference."""
    monkeypatch.setattr(kq, "_TILE_INTERPRETER", tile)
    x = hard(96, 160, seed=sum(tile), dtype=torch.bfloat16)
    rq, rs = ref_rowwise(x, "e4m3", "rceil")
    for xin in (x, x.t().contiguous().t()):
        q, s = kq.quantize_along_dim(xin, 1, "e4m3", "rceil")
        assert torch.equal(u8(q), rq) and torch.equal(u8(s), rs)
    qc, sc = kq.quantize_along_dim(x, 0, "e5m2", "floor")
    rqc, rsc = ref_colwise(x, "e5m2", "floor")
    assert torch.equal(u8(qc), rqc) and torch.equal(u8(sc), rsc)
    rows, cols = kq.fake_quantize_rowcol(x, "e4m3", "rceil", torch.bfloat16)
    assert_same_values(rows, ref_fake(x, "e4m3", "rceil", -1))
    assert_same_values(cols, ref_fake(x, "e4m3", "rceil", -2))
    offsets = torch.tensor([0, 33, 64, 90], dtype=torch.int32, device=DEV)
    qg, sg, _ = kq.quantize_grouped_colwise(x, offsets)
    rqg, rsg, _ = torch_quantize_grouped_dim0(x.cpu(), offsets.cpu())
    assert torch.equal(u8(qg), u8(rqg)) and torch.equal(u8(sg), u8(rsg))
    for dt in (torch.bfloat16, torch.float32):  # dequantized values in the padded token layout
        dqg, _ = kq.fake_quantize_grouped_colwise(x, offsets, "e4m3", "rceil", dt)
        want = kq.dequantize_rowwise(rqg.to(DEV), rsg.to(DEV), torch.float32).to(dt).cpu()
        assert torch.equal(dqg.t().cpu().nan_to_num(7.0), want.nan_to_num(7.0))
    for dim in (0, 1):
        want = fake_quantize_mx(x.cpu(), dim=dim, out_dtype=torch.bfloat16, backend="reference")
        got = fake_quantize_mx(x, dim=dim, out_dtype=torch.bfloat16, backend="triton").cpu()
        assert_same_values(got, want)


def test_grouped_offsets_any_layout_and_past_the_end():
    """Offsets may be a strided view or int64; offsets[-1] > T (outside the contract)
    never makes a kernel read past x: missing rows count as zeros, as in the reference."""
    x = hard(96, 64, seed=11)
    strided = torch.tensor([[0, 10], [10, 40], [40, 96]], dtype=torch.int32, device=DEV)[:, 1]
    for offs in (strided, strided.to(torch.int64)):
        q, s, p = kq.quantize_grouped_colwise(x, offs)
        rq, rs, rp = torch_quantize_grouped_dim0(x.cpu(), offs.cpu())
        assert torch.equal(u8(q), u8(rq)) and torch.equal(u8(s), u8(rs)) and torch.equal(p.cpu(), rp)
        dq, _ = kq.fake_quantize_grouped_colwise(x, offs, "e4m3", "rceil", torch.float32)
        want = kq.dequantize_rowwise(q, s, torch.float32)
        assert torch.equal(dq.t().cpu().nan_to_num(7.0), want.cpu().nan_to_num(7.0))
    big = hard(128, 64, seed=12)
    big[64:] = float("nan")
    view = big[:64]  # the storage goes on past the view's last row
    offs = torch.tensor([20, 100], dtype=torch.int32, device=DEV)
    q, s, _ = kq.quantize_grouped_colwise(view, offs)
    rq, rs, _ = torch_quantize_grouped_dim0(view.cpu().clone(), offs.cpu())
    assert torch.equal(u8(q), u8(rq)) and torch.equal(u8(s), u8(rs))


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (0, 2, 64), (0,), (0, 3, 2, 32)])
def test_empty_inputs(shape):
    x = torch.zeros(shape, device=DEV)
    q, s = kq.quantize_along_dim(x, x.dim() - 1)
    assert q.shape == shape[:-1] + (shape[-1],) and s.shape == shape[:-1] + (shape[-1] // 32,)
    mx = quantize_mx(x, backend="triton")
    assert mx.qdata.shape == shape and dequantize_mx(mx, backend="triton").shape == shape


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dequantize_every_code_and_scale(fmt):
    """All 256 codes, NaN / inf codes included, under scale bytes from 0 to 255."""
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    codes = torch.arange(256, dtype=torch.uint8).repeat(6, 1).view(dt)  # (6, 256)
    scale = torch.tensor([0, 1, 120, 127, 254, 255], dtype=torch.uint8).view(-1, 1).repeat(1, 8)
    scale = scale.view(torch.float8_e8m0fnu)
    mx = quantize_mx(torch.zeros(6, 256), fmt, backend="reference")
    mx.qdata, mx.scale = codes, scale
    want = dequantize_mx(mx, torch.float32, backend="reference")
    got = kq.dequantize_rowwise(codes.to(DEV), scale.to(DEV), torch.float32).cpu()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and torch.equal(got[~nan], want[~nan])


def test_kernel_op_argument_errors():
    x = hard(64, 40, seed=1)
    with pytest.raises(ValueError, match=r"is 40, not a multiple of the block size 32; zero-pad it to 64 or pass "
                                         r"pad=True$"):
        kq.quantize_along_dim(x, 1)
    with pytest.raises(ValueError, match="dim=2 for a 2-d tensor"):
        kq.quantize_along_dim(x, 2)
    with pytest.raises(ValueError, match="dim=5 is out of range"):
        kq.fake_quantize_along_dim(hard(64, 64, seed=1), 5)
    with pytest.raises(ValueError, match="2-D \\(T, C\\) or 3-D"):
        kq.fake_quantize_rowcol(hard(64, 64, seed=1).view(-1))
    q, s = kq.quantize_along_dim(hard(4, 64, seed=1), 1)
    with pytest.raises(TypeError, match="scales must be float8_e8m0fnu"):
        kq.dequantize_rowwise(q, s.view(torch.uint8).float())
    with pytest.raises(ValueError, match="1-D int32 \\(or int64\\)"):
        kq.quantize_grouped_colwise(x[:, :32], torch.tensor([1.0, 64.0], device=DEV))


@pytest.mark.parametrize("end", [0, 1, 31, 32, 70, 100])  # no row / one / a tile edge / all rows in a group
def test_zero_rows_past_end_kernel(end):
    """The in-place tail zeroing of GEMM outputs reads offsets[-1] on the device and zeroes
    exactly the rows at and past it (whole tiles below it are skipped)."""
    from mxmoe.kernels.grouped_zero_fill import zero_rows_past_end_

    out = torch.randn(100, 300, device=DEV).to(torch.bfloat16)
    want = out.clone()
    want[end:] = 0
    offsets = torch.tensor([min(end, 5), end], dtype=torch.int32, device=DEV)
    got = zero_rows_past_end_(out, offsets)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("sizes", [[162, 0, 2577, 446, 0, 83], [0, 0, 5], [7, 0], [0], [3, 4]])
def test_zero_empty_groups_kernel(sizes, monkeypatch):
    """The wgrad's in-place zeroing touches exactly the matrices of experts with no tokens
    (first, middle, last, all), over chunks that do not divide N * K."""
    from mxmoe.kernels import grouped_zero_fill as rows

    monkeypatch.setattr(rows, "CHUNK", 4096 * 2)
    E = len(sizes)
    out = torch.randn(E, 33, 300, device=DEV).to(torch.bfloat16)  # 9900 elements: a partial second chunk
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32).to(DEV)
    want = out.clone()
    for e, n in enumerate(sizes):
        if n == 0:
            want[e] = 0
    got = rows.zero_empty_groups_(out, offsets)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got.cpu(), want.cpu())
    with pytest.raises(ValueError, match="contiguous 3-D"):
        rows.zero_empty_groups_(out.transpose(1, 2), offsets)
    with pytest.raises(ValueError, match="int32/int64"):
        rows.zero_empty_groups_(out, offsets.float())


def test_grouped_gather_with_codes_and_dequantized_values():
    """The fused token gather (src) asked for codes and dequantized values in one call:
    both equal the outputs for the gathered rows (the codes kernel reads through src, the
    dequantizing one reads the gathered rows)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 64, generator=g).to(torch.bfloat16).to(DEV)
    src = torch.randperm(50, generator=g)[:40].to(DEV)
    offs = torch.tensor([10, 25, 40], dtype=torch.int32, device=DEV)
    xs = x.index_select(0, src)
    rq, rs, _ = torch_quantize_grouped_dim0(xs.cpu(), offs.cpu())
    both = kq._grouped_launch(x, offs, "e4m3", "rceil", True, torch.float32, src=src)
    alone = kq._grouped_launch(xs, offs, "e4m3", "rceil", False, torch.float32)
    assert torch.equal(u8(both["q"]), u8(rq)) and torch.equal(u8(both["s"]), u8(rs))
    assert torch.equal(both["dq"].cpu(), alone["dq"].cpu())


@pytest.mark.parametrize("E", [1, 2, 31, 64, 257, 1000])
def test_group_layout_kernel_equals_the_torch_layout(E):
    """kq.group_layout (one Triton launch) gives the block starts, padded offsets and
    padded length of numerics.grouped.padded_group_layout: empty experts, one huge expert,
    and offsets outside the contract (decreasing) alike."""
    from mxmoe.numerics.grouped import padded_group_layout

    g = torch.Generator().manual_seed(E)
    cases = [torch.randint(0, 100, (E,), generator=g), torch.zeros(E, dtype=torch.int64),
             torch.randint(-50, 100, (E,), generator=g), torch.randint(0, 3, (E,), generator=g) * 5000]
    for sizes in cases:
        offsets = sizes.cumsum(0).to(torch.int32).to(DEV)
        T = max(int(offsets.max()), 1)
        got, want = kq.group_layout(offsets, T), padded_group_layout(offsets, T)
        assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())
        assert got[2] == want[2]


def _token_table_by_definition(offsets, T, n_blocks):
    """tok0 and tok_end of every padded block, one expert at a time (the definition in
    numerics.grouped's padded layout: expert g's blocks start at block_starts[g], its
    tokens at offsets[g - 1], and end at offsets[g], never past T)."""
    from mxmoe.numerics.grouped import padded_group_layout

    block_starts, _, _ = padded_group_layout(offsets, T)
    tok0, tok_end = torch.zeros(n_blocks, dtype=torch.int32), torch.zeros(n_blocks, dtype=torch.int32)
    ends = offsets.tolist()
    for g in range(len(ends)):
        first_tok = ends[g - 1] if g else 0
        for b in range(int(block_starts[g]), int(block_starts[g + 1])):
            if b < n_blocks:
                tok0[b] = first_tok + 32 * (b - int(block_starts[g]))
                tok_end[b] = min(ends[g], T)
    return tok0, tok_end


# expert counts below, at and across the kernel's chunk of experts (kq._TABLE_BLOCK_E) and
# its chunk of blocks; 384 as in the largest MoE models
@pytest.mark.parametrize("E", [1, 7, 64, 65, 130, 384])
def test_group_token_table_equals_its_definition(E):
    """kq.group_token_table (one launch, experts walked in chunks) gives each padded block's
    first token and its expert's end as the per-expert definition does: random, empty,
    one-huge-expert and all-empty routings; blocks past the last expert read nothing."""
    g = torch.Generator().manual_seed(E)
    cases = [torch.randint(0, 100, (E,), generator=g), torch.zeros(E, dtype=torch.int64),
             torch.randint(0, 3, (E,), generator=g) * 700, torch.randint(0, 40, (E,), generator=g)]
    cases[3][E // 2] = 2000  # one expert takes most tokens (skewed routing)
    for sizes in cases:
        offsets = sizes.cumsum(0).to(torch.int32)
        T = int(offsets[-1])
        block_starts, _, Tp = kq.group_layout(offsets.to(DEV), T)
        tok0, tok_end = kq.group_token_table(offsets.to(DEV), block_starts, T, Tp // 32)
        want0, want_end = _token_table_by_definition(offsets, T, Tp // 32)
        used = want_end > 0  # tok0 of a block that reads nothing is not read
        assert torch.equal(tok_end.cpu(), want_end)
        assert torch.equal(tok0.cpu()[used], want0[used])
        # strided and int64 offsets: the same table
        spread = torch.zeros(2 * E, dtype=torch.int64)
        spread[::2] = offsets
        s0, s_end = kq.group_token_table(spread.to(DEV)[::2], block_starts, T, Tp // 32)
        assert torch.equal(s_end.cpu(), want_end) and torch.equal(s0.cpu()[used], want0[used])


@pytest.mark.parametrize("E", [65, 130])
def test_grouped_token_quantizer_bit_exact_across_expert_chunks(E):
    """The dequantized wgrad-operand quantizer with more experts than one chunk of the token
    table equals the torch reference (scatter to the padded layout, then blocks along
    tokens) bit for bit, with empty experts and one expert of many blocks."""
    from mxmoe.numerics.grouped import scatter_to_padded_groups
    from mxmoe.numerics.qdq import torch_fake_quantize_mx

    g = torch.Generator().manual_seed(E)
    sizes = torch.randint(0, 9, (E,), generator=g)
    sizes[E // 3] = 97
    offsets = sizes.cumsum(0).to(torch.int32)
    T = int(offsets[-1])
    x = hard(T, 32, seed=E)
    got, po = kq.fake_quantize_grouped_colwise(x.to(DEV), offsets.to(DEV), "e4m3", "rceil", torch.float32)
    padded, want_po = scatter_to_padded_groups(x.cpu(), offsets.cpu(), 32)  # the reference on the CPU
    want = torch_fake_quantize_mx(padded, dim=0)
    assert torch.equal(po.cpu(), want_po)
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))


_COMPILE_SM90 = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mxmoe.kernels import quantize as kq, triton_quantize as tk

def compile_sm90(fn, types, consts, num_warps):
    # as the JIT specialises a launch: 16-byte divisibility of pointers and int32 arguments
    # (large shapes), unit strides as constants
    sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a] != "constexpr" and (sig[a].startswith("*") or sig[a] in ("i32", "i64"))}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm

GPU = {"HW_ROUND": True, "SOFT_CASTS": False}  # what _launch_settings gives on the GPU
kind, dtype = sys.argv[1], sys.argv[2]
E4 = {"ELEM": tk.ELEM_E4M3, "MODE": tk.MODE_RCEIL, **GPU}
ptx = []
if kind == "grouped":  # the grouped codes kernel with its H200 settings, and the one-launch layout kernel
    cfg = kq.TUNING["grouped"]
    asm = compile_sm90(tk._mx_grouped_col_t8_kernel, {"x_ptr": dtype, "tok0_ptr": "*i32", "tok_end_ptr": "*i32",
                                                      "q_ptr": "*u8", "s_ptr": "*u8", "src_ptr": "*i32"},
                       {**E4, "BLOCK_T": cfg["block_t"], "BLOCK_C": cfg["block_c"], "HAS_SRC": True,
                        "stride_xc": 1}, cfg["num_warps"])
    ptx.append(asm["ptx"])
    layout = compile_sm90(tk._group_layout_kernel, {"ends_ptr": "*i32", "block_starts_ptr": "*i32",
                                                    "padded_offsets_ptr": "*i32"}, {"E_POW2": 128}, 4)
    assert len(layout["cubin"]) > 0
    table = compile_sm90(tk._block_token_table_kernel, {"ends_ptr": "*i32", "block_starts_ptr": "*i32",
                                                        "tok0_ptr": "*i32", "tok_end_ptr": "*i32"},
                         {"BLOCK_B": kq._TABLE_BLOCK_B, "BLOCK_E": kq._TABLE_BLOCK_E}, 4)
    assert len(table["cubin"]) > 0
    g = kq.TUNING["grouped_tok"]  # the dequantized wgrad operand (t8 read, rows written back)
    tok = compile_sm90(tk._mx_grouped_tok_dq_kernel, {"x_ptr": dtype, "tok0_ptr": "*i32", "tok_end_ptr": "*i32",
                                                      "d_ptr": "*bf16"},
                       {**E4, "BLOCK_G": g["block_g"], "BLOCK_C": g["block_c"], "stride_xc": 1},
                       g["num_warps"])
    assert "max.NaN.f32" in tok["ptx"] and "ld.global.v4" in tok["ptx"]
    pair = compile_sm90(tk._mx_grouped_tok_dq_pair_kernel,  # both wgrad operands in one launch
                        {"a_ptr": dtype, "da_ptr": "*bf16", "b_ptr": dtype, "db_ptr": "*bf16", "tok0_ptr": "*i32",
                         "tok_end_ptr": "*i32"},
                        {**E4, "BLOCK_G": g["block_g"], "BLOCK_C": g["block_c"], "stride_ac": 1,
                         "stride_bc": 1}, g["num_warps"])
    assert pair["ptx"].count("max.NaN.f32") == 2 * tok["ptx"].count("max.NaN.f32") > 0
    assert pair["ptx"].count("ld.global.v4") == 2 * tok["ptx"].count("ld.global.v4") > 0
else:  # quantize_mx's and the fake quantizers' kernels, and dequantize_colwise's transposed store
    r = kq.TUNING["rows"]
    for write_q in (True, False):
        ptx.append(compile_sm90(tk._mx_rows_kernel, {"x_ptr": dtype, "q_ptr": "*u8", "s_ptr": "*u8", "d_ptr": "*bf16"},
                                {**E4, "WRITE_Q": write_q, "WRITE_DQ": not write_q, "BLOCK_B": r["block_b"]},
                                r["num_warps"])["ptx"])
    for kind_, rowwise, colwise, write_q in (("rowwise", True, False, True), ("colwise", False, True, True),
                                             ("colwise", True, True, False)):
        t = kq.TUNING[kind_]
        ptx.append(compile_sm90(tk._mx_tile_kernel, {"x_ptr": dtype, "stride_xb": "i64", "qr_ptr": "*u8",
                                                     "sr_ptr": "*u8", "dr_ptr": "*bf16", "qc_ptr": "*u8",
                                                     "sc_ptr": "*u8", "dc_ptr": "*bf16"},
                                {**E4, "ROWWISE": rowwise, "COLWISE": colwise, "WRITE_Q": write_q,
                                 "WRITE_DQ": not write_q, "BLOCK_R": t["tile"][0], "BLOCK_C": t["tile"][1]},
                                t["num_warps"])["ptx"])
    d = kq.TUNING["dequant_t"]
    dq_t = compile_sm90(tk._mx_dequant_kernel, {"q_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*bf16"},
                        {"ELEM": tk.ELEM_E4M3, "SOFT_CASTS": False, "BLOCK_R": d["tile"][0], "BLOCK_C": d["tile"][1],
                         "TRANS_OUT": True}, d["num_warps"])
    assert len(dq_t["cubin"]) > 0
    from mxmoe.kernels import cast  # the weight-gradient widening cast: 16-byte vector loads and stores
    widen = compile_sm90(cast._widen_kernel, {"src_ptr": "*bf16", "dst_ptr": "*fp32"}, {"BLOCK": cast.BLOCK},
                         cast.NUM_WARPS)
    assert "ld.global.v4" in widen["ptx"] and "st.global.v4" in widen["ptx"], "the cast is not vectorized"
print(json.dumps({"ptx": ptx}))
"""


@pytest.mark.parametrize("kind", ["grouped", "rows_and_tiles"])
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_gpu_only_kernel_paths_compile_for_sm90(kind, dtype, tmp_path):
    """The interpreter never runs the GPU path (HW_ROUND: the float8 conversion instruction,
    the inline PTX that makes and packs codes and applies the NaN rule, the PTX block amax):
    the kernels with their H200 launch settings must compile for sm90 through Triton's
    bundled ptxas, specialised as a launch at large shapes is (vector loads), with the
    packed conversion in their PTX. No GPU needed; in a subprocess, outside the
    interpreter; skipped where this Triton has no NVIDIA backend. A compile check, not a
    run: the same tests run on a GPU check the bytes."""
    import os
    import subprocess
    import sys

    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src_dir = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src_dir + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    run = subprocess.run([sys.executable, "-c", _COMPILE_SM90, kind, dtype], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = json.loads(run.stdout.strip().splitlines()[-1])["ptx"]
    assert ptx and all("cvt.rn.satfinite.e4m3x2.f32" in p and "ld.global" in p for p in ptx)
    if kind == "grouped":
        assert "ld.global.v4" in ptx[0] and "max.NaN.f32" in ptx[0]
        # the codes' words: one word per four codes, NaN rule by byte select (lop3)
        assert "lop3.b32" in ptx[0] and "prmt.b32" in ptx[0]
    else:
        assert "lop3.b32" in ptx[0]  # the rows kernel's codes: made four at a time in PTX


def test_grouped_expert_ending_at_int32_max_reads_up_to_T():
    """An expert whose cumulative end is INT32_MAX (outside realistic use) still covers the
    rows up to T, as the reference does: the kernels' "no expert after this block" case
    is a flag, not a sentinel value that such an end would collide with."""
    x = hard(96, 64, seed=11, dtype=torch.bfloat16)
    offsets = torch.tensor([5, 2**31 - 1], dtype=torch.int32, device=DEV)
    q, s, _ = kq.quantize_grouped_colwise(x, offsets)
    rq, rs, _ = torch_quantize_grouped_dim0(x, offsets)
    assert torch.equal(u8(q), u8(rq)) and torch.equal(u8(s), u8(rs))
    assert int((u8(q)[:, 32:] != 0).sum()) > 0
    dq, _ = kq.fake_quantize_grouped_colwise(x, offsets, "e4m3", "rceil", torch.float32)
    want = kq.dequantize_rowwise(rq, rs, torch.float32).t()
    assert torch.equal(dq.cpu().nan_to_num(7.0), want.cpu().nan_to_num(7.0))


def test_group_layout_reads_strided_and_int64_offsets():
    """group_layout is public: strided or int64 offsets give the values of the torch layout."""
    from mxmoe.numerics.grouped import padded_group_layout

    base = torch.tensor([3, 999, 40, 999, 100, 999], dtype=torch.int32, device=DEV)
    for offsets in (base[::2], base[::2].to(torch.int64)):
        got, want = kq.group_layout(offsets, 100), padded_group_layout(offsets.contiguous(), 100)
        assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())
