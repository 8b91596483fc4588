"""The arithmetic of the quantized-weight grouped GEMM (src/mxmoe/kernels/cutlass_mx_grouped_gemm.cu),
emulated on the CPU against the reference quantizer.

The kernel runs only on sm90. Here its per-element steps (the integer scale exponent, the
bf16x2 multiplies, the float8 conversion and decode, the per-warp choice between the
bf16x2 and the float32 decode) are emulated in torch with the constants and expressions
read out of the CUDA source, and compared with mxmoe's reference quantizer for every bf16
amax and for blocks of every scale exponent: a changed constant, clamp, threshold, NaN rule
or branch in the source fails these tests (each line they read is pinned). Which register
holds which row and k (the fragment layout, the shuffles) is checked only on the GPU.
"""

from __future__ import annotations

import re

import pytest
import torch

from mxmoe.kernels.cutlass_mx_grouped_gemm import SOURCE as CUTLASS_SRC

FMTS = {"e4m3": 0, "e5m2": 1}


def _src() -> str:
    return CUTLASS_SRC.read_text()


def _body(name: str) -> str:
    """The text of the __device__ function ``name`` (its braces matched)."""
    src = _src()
    m = re.search(r"__device__ __forceinline__ (?:[\w:<>]+ )+" + name + r"\(", src)
    assert m, f"no __device__ function {name} in {CUTLASS_SRC.name}"
    i = src.index("{", m.end())
    depth = 0
    for j in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            return src[i:j + 1]
    raise AssertionError(f"unbalanced braces in {name}")


def _const(name: str, fmt: str) -> int:
    """The value of ``constexpr ... name = FMT == 0 ? a : b;`` for the format."""
    m = re.search(r"\b" + name + r" = FMT == 0 \? (-?(?:0x)?[0-9a-fA-F]+)u? : (-?(?:0x)?[0-9a-fA-F]+)u?;", _src())
    assert m, f"no constant {name}"
    return int(m.group(1 + FMTS[fmt]), 0)


def _int(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    assert m, f"pattern {pattern!r} not found"
    return int(m.group(1), 0)


def _scale_exp(amax16: torch.Tensor, fmt: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scale_exp of the source: (e, non-finite) for sign-cleared bf16 amax bit patterns."""
    body = _body("scale_exp")
    emax = _const("kEmax", fmt)
    a = amax16.to(torch.int64)
    nf = a >= _int(r"nf = amax16 >= (0x[0-9a-fA-F]+)u;", body)
    if mode == "floor":
        c = _int(r"int e = int\(amax16 >> 7\) - \((\d+) \+ kEmax\);", body)
        e = (a >> 7) - (c + emax)
    else:
        c = _int(r"int e = int\(amax16 >> 7\) - \((\d+) \+ kEmax\) \+", body)
        thr = _int(r"\(\(amax16 & 0x7Fu\) > (0x[0-9a-fA-F]+)u \? 1 : 0\)", body)
        e = (a >> 7) - (c + emax) + ((a & 0x7F) > thr).to(torch.int64)
    m = re.search(r"e = min\(max\(e, (-?\d+)\), (-?\d+)\);", body)
    assert m, "no clamp in scale_exp"
    e = e.clamp(int(m.group(1)), int(m.group(2)))
    assert "return nf ? 0 : e;" in body
    return torch.where(nf, 0, e), nf


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    """16-bit patterns (int64) as bf16 values in float64."""
    return bits.to(torch.int16).view(torch.bfloat16).to(torch.float64)


def _rn_bf16(v: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to bf16 (nearest even, subnormals kept), as float64."""
    return v.to(torch.bfloat16).to(torch.float64)


def _codes(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """cvt.rn.satfinite to the format, the codes' values as float64 (NaN stays NaN)."""
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    top = 448.0 if fmt == "e4m3" else 57344.0
    return v.to(torch.float32).clamp(-top, top).to(dt).to(torch.float64)


def _cases(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax16, x) pairs: amax of every exponent field with mantissas 0, 0x60, 0x61, 0x7F,
    and inf / NaN; x: a spread of bf16 patterns no larger than amax (both signs, zeros),
    and the format's subnormal grid points and their ties at that scale."""
    ea = torch.arange(0, 255)
    amax = ((ea[:, None] << 7) + torch.tensor([0x00, 0x60, 0x61, 0x7F])[None]).flatten()
    amax = torch.cat([amax, torch.tensor([0x7F80, 0x7FC0])])
    spread = torch.arange(0, 0x7F80, 37)
    xs = []
    for a in amax.tolist():
        lim = min(a, 0x7F7F)
        x = spread[spread <= lim]
        ax = torch.tensor([a]).to(torch.int16).view(torch.bfloat16).float()
        grid = (ax * torch.arange(1, 64, dtype=torch.float32) * 2.0 ** -(18 if fmt == "e4m3" else 25))
        gbits = grid.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0x7FFF
        x = torch.cat([x, gbits[gbits <= lim], torch.tensor([lim])])
        x = torch.cat([x, x | 0x8000])
        xs.append(torch.stack([torch.full_like(x, a), x], 1))
    pairs = torch.cat(xs)
    return pairs[:, 0], pairs[:, 1]


def _reference(amax16: torch.Tensor, x16: torch.Tensor, fmt: str, mode: str) -> torch.Tensor:
    """The reference's dequantized values (as bf16, float64) of x in a block whose amax is
    amax16 (mxmoe.numerics.reference, blocks of 32: the amax, then x, then zeros)."""
    from mxmoe.numerics.formats import ElemFormat, ScaleMode
    from mxmoe.numerics.reference import torch_dequantize_blocks, torch_quantize_blocks

    n = amax16.numel()
    blk = torch.zeros(1, n, 32, 1, dtype=torch.bfloat16)
    blk[0, :, 0, 0] = amax16.to(torch.int16).view(torch.bfloat16)
    blk[0, :, 1, 0] = x16.to(torch.int16).view(torch.bfloat16)
    codes, sb = torch_quantize_blocks(blk, ElemFormat(fmt), ScaleMode(mode))
    return torch_dequantize_blocks(codes, sb, ElemFormat(fmt))[0, :, 1, 0].to(torch.bfloat16).to(torch.float64)


def _ftz(v: torch.Tensor) -> torch.Tensor:
    """The worst case for a bf16x2 multiply's subnormal results: flushed to zero (the
    kernel's fast paths must not produce any; kFastMin exists for that)."""
    return torch.where(v.abs() < 2.0 ** -126, v * 0.0, v)


def _same(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Equal bf16 values with equal signs of zero, or both NaN."""
    gb = got.to(torch.bfloat16).view(torch.int16)
    wb = want.to(torch.bfloat16).view(torch.int16)
    return (gb == wb) | (got.isnan() & want.isnan())


def _qdq(amax16, x16, fmt, mode, path):
    """The kernel's quantize-dequantize of one value x16 (bf16 bits) in a block with amax
    amax16 (row_scale, encode_pair, then decode_bf16 or decode_slow): (values, where to
    compare). The kernel takes one branch per warp: path "fast" (decode_bf16, taken where no
    row of the warp has e < kFastMin; compared for the rows that may be in such a warp) or
    "slow" (decode_slow, taken by every row of a warp with one slow row, non-finite blocks
    included; compared everywhere)."""
    rs = _body("row_scale")
    e, nf = _scale_exp(amax16, fmt, mode)
    c_inv = _int(r"r\.inv2 = \(uint32_t\((\d+) - e\) << 7\) \* 0x10001u;", rs)
    c_sc = _int(r"r\.sc2 = nf \? 0x7FC07FC0u : \(uint32_t\((\d+) \+ e\) << 7\) \* 0x10001u;", rs)
    assert "r.slow = e < kFastMin && !nf;" in rs
    ep = _body("encode_pair")
    assert 'asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(v) : "r"(x), "r"(inv2));' in ep and "return cvt_codes(x0, x1);" in ep
    inv = _bf16((c_inv - e) << 7)
    v = _rn_bf16(_bf16(x16) * inv)
    y = _codes(v, fmt)
    if path == "fast":
        db = _body("decode_bf16")
        assert 'asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out) : "r"(b), "r"(sc2));' in db
        sc_fast = torch.where(nf, torch.nan, _bf16((c_sc + e) << 7))
        return _ftz(_rn_bf16(_rn_bf16(y) * sc_fast)), (e >= _const("kFastMin", fmt)) | nf
    ds = _body("decode_slow")
    assert ds.count("__fmul_rn(") == 2 and 'asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(y1), "f"(y0));' in ds
    return _rn_bf16((y.to(torch.float32) * _sc32(e, nf)).to(torch.float64)), torch.ones_like(nf)


def _sc32(e: torch.Tensor, nf: torch.Tensor, fn: str = "row_scale") -> torch.Tensor:
    """The float32 2^e of ``fn`` (row_scale / row_scale4): subnormal below its threshold,
    NaN for a non-finite block where the source says so."""
    body = _body(fn)
    c = _int(r"uint32_t s = uint32_t\(e \+ (\d+)\) << 23;", body)
    lo = _int(r"if \(e < (-\d+)\) s = 0x400000u;", body)
    bits = (e + c) << 23
    bits = torch.where(e < lo, 0x400000, bits)
    bits = torch.where(nf & ("if (nf) s = 0x7FC00000u;" in body), 0x7FC00000, bits)
    return bits.to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_scale_exponent_matches_the_reference_for_every_bf16_amax(fmt, mode):
    """Every sign-cleared bf16 bit pattern as a block amax: scale_exp (as written in the
    source, integer arithmetic on the bf16 bits) gives the E8M0 byte of mxmoe's reference
    rule (float32 amax * float32(1 / max) in rceil mode), 255 for the non-finite patterns."""
    from mxmoe.numerics.formats import ElemFormat, ScaleMode
    from mxmoe.numerics.reference import torch_mx_scale_bits

    pat = torch.arange(0, 0x8000, dtype=torch.int32)
    amax = (pat << 16).view(torch.float32)
    want = torch_mx_scale_bits(amax, ElemFormat(fmt), ScaleMode(mode)).to(torch.int64)
    e, nf = _scale_exp(pat, fmt, mode)
    got = torch.where(nf, 255, e + 127)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} amax patterns differ, first {[hex(int(p)) for p in pat[bad[:5]]]}"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_quantize_dequantize_matches_the_reference(fmt, mode):
    """The kernel's per-value quantize-dequantize as written in the source, emulated value
    by value, against the reference quantizer for blocks of every scale exponent (-127 ..
    127), non-finite blocks, E4M3/E5M2 subnormal codes and their ties, saturation (floor
    mode), both signs of zero. Both decodes: the bf16x2 one wherever the kernel may take
    it, the float32 one for every row (a warp with one row that needs it takes it for all
    its rows)."""
    amax, x = _cases(fmt)
    want = _reference(amax, x, fmt, mode)
    for path in ("fast", "slow"):
        got, where = _qdq(amax, x, fmt, mode, path)
        bad = ~_same(got, want) & where
        assert not bad.any(), (f"{path}: {int(bad.sum())} of {x.numel()} values differ, first amax "
                               f"{hex(int(amax[bad][0]))} x {hex(int(x[bad][0]))}: {got[bad][0]} vs {want[bad][0]}")


def test_the_fast_decode_is_exact_where_the_kernel_takes_it():
    """kFastMin is the smallest scale exponent at which the smallest nonzero dequantized
    value (the smallest subnormal code times 2^e) is a normal bf16, so the bf16x2 multiply
    (which may flush subnormal results) is exact wherever it runs; one below it would not be."""
    for fmt, (bias, mbits) in (("e4m3", (7, 3)), ("e5m2", (15, 2))):
        smallest_code = -bias - mbits + 1  # log2 of the smallest subnormal code
        kfast = _const("kFastMin", fmt)
        assert smallest_code + kfast >= -126 > smallest_code + kfast - 1, fmt


def test_the_kernel_branches_once_per_warp_between_the_two_decodes():
    """The conversion of a k-block (dequantize_A_kblock): the block amax over both k-blocks
    of a 32-element block and the 4 lanes of a row, the two rows' scales, the warp-wide
    slow flag, and the branch between decode_slow and decode_bf16 on it, as the emulation
    above assumes."""
    src = _src()
    body = src[src.index("CUTLASS_DEVICE static void dequantize_A_kblock("):]
    body = body[:body.index("\n  }\n")]
    assert "m = mxq::vmax2(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));" in body
    assert "m = mxq::vmax2(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));" in body
    assert "rs[0] = mxq::row_scale(m & 0xFFFFu);" in body and "rs[1] = mxq::row_scale(m >> 16);" in body
    assert "rs[2].slow = __any_sync(0xFFFFFFFFu, rs[0].slow || rs[1].slow);" in body
    assert "constexpr uint32_t M = 0x7FFF7FFFu;" in body  # the amax of sign-cleared bf16 patterns
    assert "if (rs[2].slow) {\n      for (int i = 0; i < 4; ++i) q[i] = mxq::decode_slow(h[i], rs[i & 1].sc);" in body
    assert "for (int i = 0; i < 4; ++i) q[i] = mxq::decode_bf16(h[i], rs[i & 1].sc2);" in body
    for fn in ("scale_exp", "row_scale", "encode_pair", "decode_slow", "decode_bf16", "cvt_codes", "codes_to_f16x2"):
        _body(fn)  # each exists once with a body
