"""Triton MX quantization kernels (FP8 elements: E4M3 and E5M2; scale rules floor and rceil).

Every kernel matches the pure-torch reference (:mod:`mxmoe.numerics.reference`) bit for bit
on element bytes and scale bytes (docs/NUMERICS.md). :mod:`mxmoe.kernels.quantize` launches:

- ``_mx_rows_kernel``: row-wise (blocks along the last dim) codes and scales, or the
  dequantized values, of a contiguous tensor read as (n_blocks, 32).
- ``_mx_tile_kernel`` reads a (B, R, C) tensor (any strides) once, tile by tile, and writes
  any of: row-wise codes (blocks along C) with scales (B, R, C/32); column-wise codes
  (blocks along R) in place (B, R, C) with scales (B, R/32, C); and the dequantized values
  of either (the fused quantize-dequantize of the emulated GEMMs). B = 1 for a 2-D tensor,
  B = E for 3-D expert weights.
- ``_mx_grouped_col_t8_kernel`` quantizes the rows (tokens) of a (T, C) tensor sorted by
  expert (optionally gathered through a row index), each expert's tokens in their own
  blocks, into a transposed, per-expert padded layout (C, Tp): expert e's tokens start at
  column 32 * block_start[e], its last block is zero padded, Tp = 32 * (T // 32 + E) is a
  static bound (no host sync).
- ``_mx_grouped_tok_dq_kernel`` (and ``_mx_grouped_tok_dq_pair_kernel`` for two tensors):
  the same blocks, dequantized (the wgrad operand of the emulated GEMM), written in the
  padded token layout (Tp, C) without transposing.
- ``_mx_dequant_kernel``: codes and scales back to values, optionally transposed.
- ``_group_layout_kernel``: the per-expert padded layout from the cumulative offsets.

Rounding (constexpr HW_ROUND): on the GPU (True) the float8 conversion instruction rounds
(round to nearest even with saturation, bit-exact on sm89+), and where only codes are
written they are made four at a time in inline PTX (:func:`_codes_asm`, :func:`_words_asm`);
the interpreter (False) rounds in float32 arithmetic instead (its float8 cast does not break
ties to even), so CI checks the indexing and masking of the same kernels.

How the bits are made (identical on the GPU and under ``TRITON_INTERPRET=1``):
- amax is an integer max over the float32 bit patterns with the sign cleared, so a NaN
  (largest pattern) or an infinity always wins: no NaN-ignoring float max. The grouped t8
  kernels take the NaN-propagating float max of |x| instead (max.NaN.f32): the same bits
  for finite blocks, a NaN (non-finite) where the integer max gives one.
- the scale exponent is read off the float32 exponent field (floor) or computed from
  d = amax * float32(1 / max_normal) as ceil(log2(d)) from d's bits (rceil).
- NaN outputs (dequantized values of NaN blocks) are the canonical NaN: the contract
  asks for NaN, not for a payload.
- without HW_ROUND, elements are scaled by an exact power of two, saturated, then rounded
  to the element grid in float32 (add and subtract 1.5 * 2^(k + 23 - mbits), which rounds
  to nearest even at the grid spacing of y's binade k), so the float8 cast that follows is
  exact: no dependence on how a platform's cast breaks ties.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Element format and scale mode codes (constexpr arguments).
ELEM_E4M3 = 0
ELEM_E5M2 = 1
MODE_FLOOR = 0
MODE_RCEIL = 1
BLOCK = 32  # the MX block size: every kernel here is specialised to it


# Per-format constants (docs/NUMERICS.md table). The reciprocal is the float32 rounding of
# 1 / max_normal, as the rceil rule prescribes.
E4M3_MAX = tl.constexpr(448.0)
E4M3_INV_MAX = tl.constexpr(1.0 / 448.0)
E4M3_EMAX = tl.constexpr(8)
E4M3_MBITS = tl.constexpr(3)
E4M3_MIN_EXP = tl.constexpr(-6)
E5M2_MAX = tl.constexpr(57344.0)
E5M2_INV_MAX = tl.constexpr(1.0 / 57344.0)
E5M2_EMAX = tl.constexpr(15)
E5M2_MBITS = tl.constexpr(2)
E5M2_MIN_EXP = tl.constexpr(-14)


@triton.jit
def _scale_exponent(amax_bits, ELEM: tl.constexpr, MODE: tl.constexpr):
    """Block amax (int32 bit pattern, sign clear) -> (unbiased scale exponent e in
    [-127, 127] (0 for non-finite blocks), non-finite flag)."""
    nonfinite = amax_bits >= 0x7F800000
    if MODE == 0:
        # floor(log2(amax)) - emax_elem; a zero or subnormal amax clamps to -127 below
        if ELEM == 0:
            e = ((amax_bits >> 23) & 0xFF) - 127 - E4M3_EMAX
        else:
            e = ((amax_bits >> 23) & 0xFF) - 127 - E5M2_EMAX
    else:
        if ELEM == 0:
            d = amax_bits.to(tl.float32, bitcast=True) * E4M3_INV_MAX
        else:
            d = amax_bits.to(tl.float32, bitcast=True) * E5M2_INV_MAX
        d_bits = d.to(tl.int32, bitcast=True)
        d_exp = (d_bits >> 23) & 0xFF
        d_man = d_bits & 0x7FFFFF
        e_normal = d_exp - 127 + (d_man != 0).to(tl.int32)
        # subnormal d = man * 2^-149: ceil(log2 d) is -126 above 2^-127, else <= -127
        e_sub = tl.where(d_man > 0x400000, -126, -127)
        e = tl.where(d_exp == 0, e_sub, e_normal)
    e = tl.minimum(tl.maximum(e, -127), 127)
    e = tl.where(nonfinite, 0, e)
    return e, nonfinite


@triton.jit
def _nan_codes(codes, x, nonfinite):
    """Codes of non-finite blocks replaced by NaN (0x7F) with the input's sign: the
    arithmetic shift puts the sign in bit 7."""
    return tl.where(nonfinite, ((x.to(tl.int32, bitcast=True) >> 24) | 0x7F).to(tl.uint8), codes)


@triton.jit
def _quantize_values(x, e, nonfinite, ELEM: tl.constexpr, HW_ROUND: tl.constexpr, NAN_CODES: tl.constexpr):
    """x float32, e / nonfinite broadcast to x's shape -> (rounded element values r as
    float32 (exact grid values, sign of zero kept), element codes as uint8).
    NAN_CODES=False leaves the codes of non-finite blocks to the caller (:func:`_nan_codes`).

    HW_ROUND=False (the interpreter) rounds in float32 arithmetic first (the float8 cast is
    then exact); HW_ROUND=True (the GPU) leaves rounding to the float8 cast instruction
    (round to nearest even with saturation on sm89+; not in the interpreter, whose cast does
    not break ties to even).
    """
    inv_scale = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, a normal float
    y = x * inv_scale
    if HW_ROUND:  # cvt.rn.satfinite: rounds to nearest even and saturates, no clamp needed
        if ELEM == 0:
            f8 = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        else:
            f8 = y.to(tl.float8e5, fp_downcast_rounding="rtne")
        r = f8.to(tl.float32)
        codes = f8.to(tl.uint8, bitcast=True)
    else:
        if ELEM == 0:
            y = tl.minimum(tl.maximum(y, -E4M3_MAX), E4M3_MAX)
        else:
            y = tl.minimum(tl.maximum(y, -E5M2_MAX), E5M2_MAX)
        y_bits = y.to(tl.int32, bitcast=True)
        # rounding constant 1.5 * 2^(k + 23 - mbits), k = binade of y (not below the normal range)
        if ELEM == 0:
            k_field = tl.maximum(y_bits & 0x7F800000, (127 + E4M3_MIN_EXP) << 23)
            c = (k_field + (((23 - E4M3_MBITS) << 23) + 0x400000)).to(tl.float32, bitcast=True)
        else:
            k_field = tl.maximum(y_bits & 0x7F800000, (127 + E5M2_MIN_EXP) << 23)
            c = (k_field + (((23 - E5M2_MBITS) << 23) + 0x400000)).to(tl.float32, bitcast=True)
        r = (y + c) - c
        r = (r.to(tl.int32, bitcast=True) | (y_bits & -2147483648)).to(tl.float32, bitcast=True)
        if ELEM == 0:
            codes = r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            codes = r.to(tl.float8e5).to(tl.uint8, bitcast=True)
    if NAN_CODES:
        codes = _nan_codes(codes, x, nonfinite)
    return r, codes


# ---- PTX (GPU, HW_ROUND): codes made and packed four at a time -------------------------
# Per 4 elements: 4 multiplies by 2^-e, 2 cvt.rn.satfinite (two codes each, round to nearest
# even with saturation, bit-exact on sm89+), one byte permute to pack them, and the NaN rule
# on the packed word: the four input sign bytes gathered with prmt, (signs & 0x80) | 0x7F per
# byte, selected per byte by the block's non-finite mask (lop3). Triton's own lowering of the
# same steps spends ~4x the instructions (byte extracts, per-element selects and repacking),
# which bounds the transposing kernels (instruction-bound, not memory-bound). The sign
# bytes: byte 3 of each float32 input (three prmt).
_ASM_WORD = """{
.reg .b32 y0, y1, y2, y3, w, t, u;
.reg .b16 h0, h1;
mul.f32 y0, X0, S0;
mul.f32 y1, X1, S1;
mul.f32 y2, X2, S2;
mul.f32 y3, X3, S3;
cvt.rn.satfinite.FMT.f32 h0, y1, y0;
cvt.rn.satfinite.FMT.f32 h1, y3, y2;
mov.b32 w, {h0, h1};
SIGNS
lop3.b32 t, t, 0x80808080, 0x7F7F7F7F, 0xEA;
lop3.b32 $0, w, t, M, 0xD8;
}"""
_SIGNS_F32 = "prmt.b32 t, X0, X1, 0x4473;\nprmt.b32 u, X2, X3, 0x7344;\nprmt.b32 t, t, u, 0x7610;"


def _asm(fmt: str, names: dict) -> str:
    text = _ASM_WORD.replace("SIGNS", _SIGNS_F32).replace("FMT", fmt)
    for k, v in names.items():
        text = text.replace(k, v)
    return text


# pack=4: $1..$4 four consecutive elements of x, $5..$8 their 2^-e, $9 their four mask bytes
_CODES4 = {"X0": "$1", "X1": "$2", "X2": "$3", "X3": "$4", "S0": "$5", "S1": "$6", "S2": "$7", "S3": "$8", "M": "$9"}
_CODES4_E4M3 = tl.constexpr(_asm("e4m3x2", _CODES4))
_CODES4_E5M2 = tl.constexpr(_asm("e5m2x2", _CODES4))
# pack=1: $1..$4 one element of each of four tensors, $5 their common 2^-e, $6 the mask word
_WORD4 = {"X0": "$1", "X1": "$2", "X2": "$3", "X3": "$4", "S0": "$5", "S1": "$5", "S2": "$5", "S3": "$5", "M": "$6"}
_WORD4_E4M3 = tl.constexpr(_asm("e4m3x2", _WORD4))
_WORD4_E5M2 = tl.constexpr(_asm("e5m2x2", _WORD4))
# Two words at once from bfloat16 tensors (pack=2: elements a, b of each tensor): $2..$9 the
# float32 values (x0 a, x0 b, x1 a, ..., x3 b), $10..$13 the bfloat16 pairs {xk a, xk b},
# $14, $15 the 2^-e of a and b, $16, $17 their mask words; word a -> $0, word b -> $1. The
# sign bytes of both words take four prmt (two per word, against three): the high bytes
# {x0 a, x1 a, x0 b, x1 b} of the first two pairs, the same of the last two, then the a and b
# halves of both.
_ASM_WORD2 = """{
.reg .b32 y0, y1, y2, y3, w0, w1, s0, s1, t, u;
.reg .b16 h0, h1;
mul.f32 y0, $2, $14;
mul.f32 y1, $4, $14;
mul.f32 y2, $6, $14;
mul.f32 y3, $8, $14;
cvt.rn.satfinite.FMT.f32 h0, y1, y0;
cvt.rn.satfinite.FMT.f32 h1, y3, y2;
mov.b32 w0, {h0, h1};
mul.f32 y0, $3, $15;
mul.f32 y1, $5, $15;
mul.f32 y2, $7, $15;
mul.f32 y3, $9, $15;
cvt.rn.satfinite.FMT.f32 h0, y1, y0;
cvt.rn.satfinite.FMT.f32 h1, y3, y2;
mov.b32 w1, {h0, h1};
prmt.b32 t, $10, $11, 0x7351;
prmt.b32 u, $12, $13, 0x7351;
lop3.b32 t, t, 0x80808080, 0x7F7F7F7F, 0xEA;
lop3.b32 u, u, 0x80808080, 0x7F7F7F7F, 0xEA;
prmt.b32 s0, t, u, 0x5410;
prmt.b32 s1, t, u, 0x7632;
lop3.b32 $0, w0, s0, $16, 0xD8;
lop3.b32 $1, w1, s1, $17, 0xD8;
}"""
_WORD2B_E4M3 = tl.constexpr(_ASM_WORD2.replace("FMT", "e4m3x2"))
_WORD2B_E5M2 = tl.constexpr(_ASM_WORD2.replace("FMT", "e5m2x2"))


@triton.jit
def _inv_scale(e):
    """2^-e as float32 (e in [-127, 127]: always a normal float)."""
    return ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _codes_asm(x, e, nonfinite, ELEM: tl.constexpr):
    """Codes (uint8, x's shape) of float32 x with scale exponents e and non-finite flags
    (broadcast to x's shape), made four consecutive elements at a time in PTX. Same bytes
    as :func:`_quantize_values` with HW_ROUND (GPU only: no interpreter support)."""
    mask = tl.where(nonfinite, -1, 0).to(tl.int8)
    if ELEM == 0:
        return tl.inline_asm_elementwise(_CODES4_E4M3, "=r,r,r,r,r,r,r,r,r,r", [x, _inv_scale(e), mask],
                                         dtype=tl.uint8, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(_CODES4_E5M2, "=r,r,r,r,r,r,r,r,r,r", [x, _inv_scale(e), mask],
                                         dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _words_asm(x0, x1, x2, x3, e, nonfinite, ELEM: tl.constexpr):
    """int32 words of the codes of four float32 tensors x0..x3 sharing scale exponents e and
    non-finite flags (x0's code in the low byte). GPU only, like :func:`_codes_asm`."""
    mask = tl.where(nonfinite, -1, 0)
    if ELEM == 0:
        return tl.inline_asm_elementwise(_WORD4_E4M3, "=r,r,r,r,r,r,r", [x0, x1, x2, x3, _inv_scale(e), mask],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_WORD4_E5M2, "=r,r,r,r,r,r,r", [x0, x1, x2, x3, _inv_scale(e), mask],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _words_asm_bf16(x0, x1, x2, x3, b0, b1, b2, b3, e, nonfinite, ELEM: tl.constexpr):
    """:func:`_words_asm` of x0..x3 widened from the bfloat16 tensors b0..b3, two words per
    PTX call (fewer sign-byte permutes)."""
    mask = tl.where(nonfinite, -1, 0)
    if ELEM == 0:
        return tl.inline_asm_elementwise(_WORD2B_E4M3, "=r,=r" + ",r" * 16,
                                         [x0, x1, x2, x3, b0, b1, b2, b3, _inv_scale(e), mask],
                                         dtype=tl.int32, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(_WORD2B_E5M2, "=r,=r" + ",r" * 16,
                                         [x0, x1, x2, x3, b0, b1, b2, b3, _inv_scale(e), mask],
                                         dtype=tl.int32, is_pure=True, pack=2)


@triton.jit
def _quantize_codes(x, e, nonfinite, ELEM: tl.constexpr, HW_ROUND: tl.constexpr):
    """Codes only (uint8): the PTX path on the GPU (HW_ROUND), else :func:`_quantize_values`."""
    if HW_ROUND:
        return _codes_asm(x, e, nonfinite, ELEM)
    else:
        _, codes = _quantize_values(x, e, nonfinite, ELEM, False, True)
        return codes


@triton.jit
def _dequantized(r, e, nonfinite):
    """Element values r times 2^e (exact in float32), NaN for non-finite blocks."""
    e_bits = tl.where(e >= -126, (e + 127) << 23, 0x400000)  # 2^-127 is a float32 subnormal
    value = r * e_bits.to(tl.float32, bitcast=True)
    return tl.where(nonfinite, float("nan"), value)


@triton.jit
def _to_float32(x, SOFT_CASTS: tl.constexpr):
    """Exact widening to float32. With SOFT_CASTS (the interpreter, whose own cast
    flushes bf16 subnormals) bfloat16 goes through its bits, the top half of a float32;
    on the GPU the conversion instruction is exact."""
    if SOFT_CASTS and x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _from_float32(v, dtype: tl.constexpr, SOFT_CASTS: tl.constexpr):
    """Round float32 ``v`` to ``dtype`` (nearest, ties to even). With SOFT_CASTS bfloat16
    is rounded on the bits (the interpreter's own cast flushes subnormals); NaN stays NaN."""
    if SOFT_CASTS and dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


@triton.jit
def _scale_bits(e, nf):
    """E8M0 scale bytes: biased exponent e + 127, 0xFF (NaN) for non-finite blocks."""
    return tl.where(nf, 255, e + 127).to(tl.uint8)


@triton.jit
def _scale_offset(b, n_rows, n_elems, r, c):
    """Offset of scale (r, c) of matrix b in row-major scales (B, n_rows, n_elems / 32)."""
    return b * n_rows * (n_elems // 32) + r * (n_elems // 32) + c


@triton.jit
def _row_block_scales(abs_bits, ELEM: tl.constexpr, MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Scales of the 32-element blocks along the columns of abs_bits (ROWS, BLOCK_C) (int32
    bit patterns, sign clear) -> (e, nonfinite) (ROWS, BLOCK_C // 32) (or (ROWS, 1)) and
    both broadcast to (ROWS, BLOCK_C)."""
    if BLOCK_C == 32:  # one block per row: reduce in place, no reshape
        e, nf = _scale_exponent(tl.max(abs_bits, axis=1)[:, None], ELEM, MODE)  # (ROWS, 1)
        e_x = tl.broadcast_to(e, (ROWS, BLOCK_C))
        nf_x = tl.broadcast_to(nf, (ROWS, BLOCK_C))
    else:
        amax = tl.max(tl.reshape(abs_bits, (ROWS, BLOCK_C // 32, 32)), axis=2)
        e, nf = _scale_exponent(amax, ELEM, MODE)  # (ROWS, BLOCK_C // 32)
        e_x = tl.reshape(tl.broadcast_to(e[:, :, None], (ROWS, BLOCK_C // 32, 32)), (ROWS, BLOCK_C))
        nf_x = tl.reshape(tl.broadcast_to(nf[:, :, None], (ROWS, BLOCK_C // 32, 32)), (ROWS, BLOCK_C))
    return e, nf, e_x, nf_x


@triton.jit
def _col_block_scales(abs_bits, ELEM: tl.constexpr, MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Scales of blocks of 32 consecutive rows of abs_bits (ROWS, BLOCK_C) -> (e, nonfinite)
    (ROWS // 32, BLOCK_C) and both broadcast to (ROWS, BLOCK_C)."""
    if ROWS == 32:  # one block per column: reduce in place, no reshape
        e, nf = _scale_exponent(tl.max(abs_bits, axis=0)[None, :], ELEM, MODE)  # (1, BLOCK_C)
        e_x = tl.broadcast_to(e, (ROWS, BLOCK_C))
        nf_x = tl.broadcast_to(nf, (ROWS, BLOCK_C))
    else:
        amax = tl.max(tl.reshape(abs_bits, (ROWS // 32, 32, BLOCK_C)), axis=1)
        e, nf = _scale_exponent(amax, ELEM, MODE)  # (ROWS // 32, BLOCK_C)
        e_x = tl.reshape(tl.broadcast_to(e[:, None, :], (ROWS // 32, 32, BLOCK_C)), (ROWS, BLOCK_C))
        nf_x = tl.reshape(tl.broadcast_to(nf[:, None, :], (ROWS // 32, 32, BLOCK_C)), (ROWS, BLOCK_C))
    return e, nf, e_x, nf_x


@triton.jit
def _store_rowwise(qr_ptr, sr_ptr, codes, e, nf, rows64, row_ok, cols64, pid_c, b, R, Cp, BLOCK_C: tl.constexpr):
    """Store row-wise codes (ROWS, BLOCK_C) of rows ``rows64`` into (B, R, Cp) and their
    scales e / nf (ROWS, BLOCK_C // 32) into (B, R, Cp / 32)."""
    q_off = b * R * Cp + rows64[:, None] * Cp + cols64[None, :]
    tl.store(qr_ptr + q_off, codes, mask=row_ok[:, None] & (cols64 < Cp)[None, :])
    scols = pid_c * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
    s_mask = row_ok[:, None] & (scols < Cp // 32)[None, :]
    s_off = _scale_offset(b, R, Cp, rows64[:, None], scols[None, :])
    tl.store(sr_ptr + s_off, _scale_bits(e, nf), mask=s_mask)


@triton.jit
def _abs_bits(x):
    """float32 bit patterns of x with the sign cleared (int32): ordered like |x|, NaN largest."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _mx_rows_kernel(
    x_ptr, n_blocks, q_ptr, s_ptr, d_ptr,
    ELEM: tl.constexpr, MODE: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_DQ: tl.constexpr,
    HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Row-wise quantization of a contiguous tensor seen as (n_blocks, 32): each program
    reads BLOCK_B whole blocks, one contiguous span of memory; no reshapes."""
    blks = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    ok = blks < n_blocks
    offs = blks[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = _to_float32(tl.load(x_ptr + offs, mask=ok[:, None], other=0.0), SOFT_CASTS)
    abs_bits = _abs_bits(x)
    e, nf = _scale_exponent(tl.max(abs_bits, axis=1)[:, None], ELEM, MODE)
    if WRITE_DQ:
        r, codes = _quantize_values(x, e, nf, ELEM, HW_ROUND, True)
    else:
        codes = _quantize_codes(x, tl.broadcast_to(e, (BLOCK_B, 32)), tl.broadcast_to(nf, (BLOCK_B, 32)), ELEM, HW_ROUND)
    if WRITE_Q:
        tl.store(q_ptr + offs, codes, mask=ok[:, None])
        tl.store(s_ptr + blks[:, None], _scale_bits(e, nf), mask=ok[:, None])
    if WRITE_DQ:
        tl.store(d_ptr + offs, _from_float32(_dequantized(r, e, nf), d_ptr.dtype.element_ty, SOFT_CASTS),
                 mask=ok[:, None])


@triton.jit
def _mx_tile_kernel(
    x_ptr, stride_xb, stride_xr, stride_xc, R, C,
    # row-wise outputs (blocks along C): codes (B, R, Cp), scales (B, R, Cp / 32), dequantized (B, R, C)
    qr_ptr, sr_ptr, dr_ptr,
    # column-wise outputs (blocks along R): codes (B, Rp, C), scales (B, Rp / 32, C), dequantized (B, R, C)
    qc_ptr, sc_ptr, dc_ptr,
    Rp, Cp,  # padded extents
    ELEM: tl.constexpr, MODE: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
    WRITE_Q: tl.constexpr, WRITE_DQ: tl.constexpr, HW_ROUND: tl.constexpr,
    SOFT_CASTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    in_mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = _to_float32(tl.load(x_ptr + b * stride_xb + rows64[:, None] * stride_xr + cols64[None, :] * stride_xc,
                            mask=in_mask, other=0.0), SOFT_CASTS)
    abs_bits = _abs_bits(x)

    if ROWWISE:
        e, nf, e_x, nf_x = _row_block_scales(abs_bits, ELEM, MODE, BLOCK_R, BLOCK_C)
        r, codes = _quantize_values(x, e_x, nf_x, ELEM, HW_ROUND, True)
        if WRITE_Q:
            _store_rowwise(qr_ptr, sr_ptr, codes, e, nf, rows64, rows < R, cols64, pid_c, b, R, Cp, BLOCK_C)
        if WRITE_DQ:
            d_off = b * R * C + rows64[:, None] * C + cols64[None, :]
            tl.store(dr_ptr + d_off, _from_float32(_dequantized(r, e_x, nf_x), dr_ptr.dtype.element_ty, SOFT_CASTS), mask=in_mask)

    if COLWISE:
        e, nf, e_x, nf_x = _col_block_scales(abs_bits, ELEM, MODE, BLOCK_R, BLOCK_C)
        r, codes = _quantize_values(x, e_x, nf_x, ELEM, HW_ROUND, True)
        if WRITE_Q:
            col_ok = cols < C
            out_mask = (rows < Rp)[:, None] & col_ok[None, :]
            srows = pid_r * (BLOCK_R // 32) + tl.arange(0, BLOCK_R // 32)
            s_mask = (srows < Rp // 32)[:, None] & col_ok[None, :]
            tl.store(qc_ptr + b * Rp * C + rows64[:, None] * C + cols64[None, :], codes, mask=out_mask)
            tl.store(sc_ptr + b * (Rp // 32) * C + srows[:, None] * C + cols64[None, :], _scale_bits(e, nf),
                     mask=s_mask)
        if WRITE_DQ:
            d_off = b * R * C + rows64[:, None] * C + cols64[None, :]
            tl.store(dc_ptr + d_off, _from_float32(_dequantized(r, e_x, nf_x), dc_ptr.dtype.element_ty, SOFT_CASTS), mask=in_mask)


@triton.jit
def _group_layout_kernel(ends_ptr, E, block_starts_ptr, padded_offsets_ptr, E_POW2: tl.constexpr):
    """The per-expert padded layout of ``numerics.grouped.padded_group_layout`` in one
    program: ends_ptr (E,) int32 cumulative token ends -> block_starts_ptr (E + 1,) int32
    cumulative 32-token block counts from 0, padded_offsets_ptr (E,) int32 cumulative
    padded token ends (32 x the block counts). Sizes and sums in int64, blocks rounded up
    by floor division (an arithmetic shift), at least one per expert, as the torch
    function does."""
    ge = tl.arange(0, E_POW2)
    ends = tl.load(ends_ptr + ge, mask=ge < E, other=0).to(tl.int64)
    prev = tl.load(ends_ptr + ge - 1, mask=(ge > 0) & (ge < E), other=0).to(tl.int64)
    blocks = tl.where(ge < E, tl.maximum((ends - prev + 31) >> 5, 1), 0)
    total = tl.cumsum(blocks, 0)
    tl.store(block_starts_ptr + ge, tl.zeros_like(ge), mask=ge == 0)
    tl.store(block_starts_ptr + 1 + ge, total.to(tl.int32), mask=ge < E)
    tl.store(padded_offsets_ptr + ge, (total * 32).to(tl.int32), mask=ge < E)


@triton.jit
def _block_token_table_kernel(ends_ptr, block_starts_ptr, E, T, n_blocks, tok0_ptr, tok_end_ptr,
                              BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    """The token table of the per-expert padded layout: for each 32-token block ``blk`` <
    n_blocks, its first token ``tok0[blk]`` and the end of its expert's tokens
    ``tok_end[blk]`` (both int32; the block reads tokens tok0 .. min(tok0 + 32, tok_end)).
    ends_ptr: (E,) int32 cumulative token ends; block_starts_ptr: (E + 1,) int32 cumulative
    padded block starts (both non-decreasing). A program takes BLOCK_B blocks and walks the
    experts BLOCK_E at a time, so its work is n_blocks x E compares whatever E is, and the
    quantizers that read the table do O(1) work per block (reading the offsets whole in
    every quantizer program cost O(E) registers and instructions per program: 4-10% of a
    copy's bandwidth at 128 experts on the H200).

    Block blk belongs to expert g = the number of experts whose padded blocks end at or
    before it; its first block is block_starts[g] and its first token ends[g - 1] (0 for
    g = 0), so tok0 = ends[g - 1] + 32 (blk - block_starts[g]); its tokens end at ends[g],
    never past row T, and a block past the last expert's blocks reads nothing (tok_end 0).
    Max and min are associative, so the walk over expert chunks gives the values of one
    reduction over all experts."""
    blk = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    block_start = tl.zeros((BLOCK_B,), tl.int32)
    tok_start = tl.zeros((BLOCK_B,), tl.int32)
    tok_end = tl.full((BLOCK_B,), 2147483647, tl.int32)
    has_after = tl.zeros((BLOCK_B,), tl.int32)
    for e0 in range(0, E, BLOCK_E):
        ge = e0 + tl.arange(0, BLOCK_E)
        in_e = ge < E
        block_ends = tl.load(block_starts_ptr + 1 + ge, mask=in_e, other=2147483647)[None, :]
        ends = tl.load(ends_ptr + ge, mask=in_e, other=0)[None, :]
        before = block_ends <= blk[:, None]  # experts whose padded blocks end at or before blk
        block_start = tl.maximum(block_start, tl.max(tl.where(before, block_ends, 0), axis=1))
        tok_start = tl.maximum(tok_start, tl.max(tl.where(before, ends, 0), axis=1))
        after = ~before & in_e[None, :]
        tok_end = tl.minimum(tok_end, tl.min(tl.where(after, ends, 2147483647), axis=1))
        has_after = tl.maximum(has_after, tl.max(after.to(tl.int32), axis=1))
    tok_end = tl.minimum(tl.where(has_after > 0, tok_end, 0), T)
    ok = blk < n_blocks
    tl.store(tok0_ptr + blk, tok_start + (blk - block_start) * 32, mask=ok)
    tl.store(tok_end_ptr + blk, tok_end, mask=ok)


@triton.jit
def _block_tokens(blk, tok0_ptr, tok_end_ptr, n_blocks):
    """32-token blocks ``blk`` (N,) -> (their first tokens, the ends of their experts'
    tokens), both (N,), from the table of :func:`_block_token_table_kernel`; blocks at or
    past n_blocks read nothing (end 0)."""
    ok = blk < n_blocks
    return tl.load(tok0_ptr + blk, mask=ok, other=0), tl.load(tok_end_ptr + blk, mask=ok, other=0)


@triton.jit
def _decode_blocks(codes, sbits, ELEM: tl.constexpr, SOFT_CASTS: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """FP8 codes (BLOCK_R, BLOCK_C) uint8 and their scale bytes (BLOCK_R, BLOCK_C // 32),
    blocks along the columns -> values float32 (NaN for scale 255 and FP8 NaN codes)."""
    if ELEM == 0:
        elems = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if SOFT_CASTS:  # the interpreter decodes S.1111.111 as a number
            elems = tl.where((codes & 0x7F) == 0x7F, float("nan"), elems)
    else:
        elems = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
        if SOFT_CASTS:  # and S.11111.xx as numbers: inf for xx = 0, NaN otherwise
            special = (codes & 0x7C) == 0x7C
            inf = tl.where((codes & 0x80) != 0, float("-inf"), float("inf"))
            elems = tl.where(special, tl.where((codes & 0x03) == 0, inf, float("nan")), elems)
    sb = sbits.to(tl.int32)
    sb_x = tl.reshape(tl.broadcast_to(sb[:, :, None], (BLOCK_R, BLOCK_C // 32, 32)), (BLOCK_R, BLOCK_C))
    return _dequantized(elems, sb_x - 127, sb_x == 255)


@triton.jit
def _mx_dequant_kernel(
    q_ptr, s_ptr, out_ptr, n_rows, n_cols,  # codes (rows, cols), scales (rows, cols / 32)
    ELEM: tl.constexpr, SOFT_CASTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    TRANS_OUT: tl.constexpr = False,
):
    """Values (rows, cols), or with TRANS_OUT their transpose (cols, rows) (Triton moves the
    tile through shared memory so that both the read and the write are coalesced)."""
    rows = (tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    codes = tl.load(q_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0)
    scols = tl.program_id(0) * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
    sbits = tl.load(s_ptr + rows[:, None] * (n_cols // 32) + scols[None, :],
                    mask=(rows < n_rows)[:, None] & (scols < n_cols // 32)[None, :], other=127)
    value = _decode_blocks(codes, sbits, ELEM, SOFT_CASTS, BLOCK_R, BLOCK_C)
    value = _from_float32(value, out_ptr.dtype.element_ty, SOFT_CASTS)
    if TRANS_OUT:
        tl.store(out_ptr + cols[None, :] * n_rows + rows[:, None], value, mask=mask)
    else:
        tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], value, mask=mask)


@triton.jit
def _pack4(c0, c1, c2, c3):
    """Four uint8 code tensors -> int32 words, c0 in the low byte (little-endian order)."""
    return c0.to(tl.int32) | (c1.to(tl.int32) << 8) | (c2.to(tl.int32) << 16) | (c3.to(tl.int32) << 24)


# ---- grouped kernels with the column blocks in registers (t8) ------------------------------
# A column-wise copy is a transpose: code (r, c) goes to (c, r). Each thread holds an 8 x 8
# patch (8 consecutive rows, 8 consecutive columns) of a 32-row block: a tile of G 32-row
# blocks is read as eight tensors x_k (4 G, BLOCK_C), row i of x_k being row 32 (i // 4) +
# 8 (i % 4) + k of the tile. Triton lays a (4 G, BLOCK_C) load out with 8 columns per
# thread, 8 lanes along the columns and 4 along the rows (BLOCK_C = 64; 16 and 2 for 128),
# warps along the rows, so the same (i, c) of every x_k is in one thread and the 4 lanes of
# one i // 4 are in one warp:
# - a column block (32 rows = 4 lanes x 8 registers) reduces in registers plus two shuffles;
# - the four codes of one transposed output word (rows 4j..4j+3, one column) are in one
#   thread and are packed into an int32 where they are (:func:`_words_asm`), so only the
#   words, 4x fewer and 4x wider than the codes, are transposed;
# - the words are stored through Triton's coalesced layout (shared memory), which gives
#   each output row 32 G contiguous bytes per program.
# bfloat16 input stays in its registers (two elements each) as loaded: :func:`_widen` makes
# the float32 values with one instruction per element, and the PTX takes the NaN rule's sign
# bytes straight from those registers (:func:`_words_asm_bf16`).


@triton.jit
def _scale_byte_inv(amax_bits, ELEM: tl.constexpr, MODE: tl.constexpr):
    """Block amax (int32 bits, sign clear) -> (E8M0 byte as int32 (255 for non-finite
    blocks), 2^-e as float32, non-finite flag): the rule of :func:`_scale_exponent` in
    fewer instructions, on the biased exponent b = e + 127 directly.
    - floor: b = max(exponent field of amax - emax_elem, 0).
    - rceil: d = amax * (1 / max_normal); for normal d, b = exponent field of d rounded up to
      a power of two, which is (d_bits + 0x7FFFFF) >> 23; a subnormal d gives b = 1 above
      2^-127 (d_bits > 0x400000) and 0 (the clamp at -127) at or below it.
    Finite amax keeps b <= 247 for both formats, so no upper clamp is needed."""
    nonfinite = amax_bits >= 0x7F800000
    if MODE == 0:
        if ELEM == 0:
            b = tl.maximum((amax_bits >> 23) - E4M3_EMAX, 0)
        else:
            b = tl.maximum((amax_bits >> 23) - E5M2_EMAX, 0)
    else:
        if ELEM == 0:
            d_bits = (amax_bits.to(tl.float32, bitcast=True) * E4M3_INV_MAX).to(tl.int32, bitcast=True)
        else:
            d_bits = (amax_bits.to(tl.float32, bitcast=True) * E5M2_INV_MAX).to(tl.int32, bitcast=True)
        b = tl.where(d_bits > 0x400000, (d_bits + 0x7FFFFF) >> 23, 0)
    inv = ((254 - b) << 23).to(tl.float32, bitcast=True)  # 2^-(b - 127), normal for b in [0, 247]
    return tl.where(nonfinite, 255, b), inv, nonfinite


@triton.jit
def _absmax(a, b):
    """max(|a|, |b|) of float32 tensors, NaN if either is NaN."""
    return tl.maximum(tl.abs(a), tl.abs(b), propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _absmax_asm(a, b):
    """:func:`_absmax` in PTX (GPU only): abs.f32 folds into max.NaN.f32 as the |.| operand
    modifier, one instruction (LLVM turns tl.abs into an and per element)."""
    return tl.inline_asm_elementwise("{ .reg .f32 a, b; abs.f32 a, $1; abs.f32 b, $2; max.NaN.f32 $0, a, b; }",
                                     "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _absmax8(x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """Elementwise max of |x_k| over eight float32 tensors (:func:`_absmax`, in PTX if ASM)."""
    if ASM:
        return _absmax_asm(_absmax_asm(_absmax_asm(x0, x1), _absmax_asm(x2, x3)),
                           _absmax_asm(_absmax_asm(x4, x5), _absmax_asm(x6, x7)))
    else:
        return _absmax(_absmax(_absmax(x0, x1), _absmax(x2, x3)), _absmax(_absmax(x4, x5), _absmax(x6, x7)))


@triton.jit
def _block_amax_bits(x, axis: tl.constexpr, ASM: tl.constexpr):
    """The max of |x| along ``axis`` (float32 x; ASM: :func:`_absmax_asm` in PTX) as int32
    bits: the bit-pattern max of :func:`_abs_bits` for finite x (subnormals included:
    max.f32 without .ftz keeps them, as numpy does), and a NaN with the sign clear (at
    least 0x7F800000, so non-finite) where an element is NaN; +inf where one is infinite.
    Without ASM: the float max of |x| with the NaN flag as its own max (0x7FC00000 where
    set): the same bits, from built-in reductions, which the interpreter runs vectorized (a
    reduction over a combine function of our own runs there about 100x slower)."""
    if ASM:
        return tl.reduce(x, axis, _absmax_asm).to(tl.int32, bitcast=True)
    else:
        amax = tl.max(tl.abs(x), axis).to(tl.int32, bitcast=True)
        has_nan = tl.max((x != x).to(tl.int32), axis)
        return tl.where(has_nan != 0, 0x7FC00000, amax)


@triton.jit
def _load_token8(base, src_ptr, t, t_end, c_ok, stride_xt, HAS_SRC: tl.constexpr):
    """Sorted tokens t (N, 1) (zero at t >= t_end): rows t of x, or rows src[t], in x's dtype."""
    if HAS_SRC:
        rows = tl.load(src_ptr + t, mask=t < t_end, other=0)
    else:
        rows = t
    return tl.load(base + rows.to(tl.int64) * stride_xt, mask=(t < t_end) & c_ok, other=0.0)


@triton.jit
def _widen(x, SOFT_CASTS: tl.constexpr):
    """:func:`_to_float32`; on the GPU a bfloat16 pair (one 32-bit register) is widened in
    PTX with one instruction per element (shl, and), where the cvt Triton emits costs a byte
    permute more for the upper half. Pure: the t8 helpers widen the same loads again and
    the compiler keeps one copy."""
    if x.dtype == tl.bfloat16 and not SOFT_CASTS:
        return tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }", "=f,=f,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=2)
    else:
        return _to_float32(x, SOFT_CASTS)


@triton.jit
def _col_words8(x0, x1, x2, x3, b0, b1, b2, b3, nf_x, e_x, ELEM: tl.constexpr, HW_ROUND: tl.constexpr):
    """int32 words of the column-wise codes of four consecutive rows (x0 in the low byte):
    x_k float32, b_k the tensors they were widened from."""
    if HW_ROUND and b0.dtype == tl.bfloat16:
        return _words_asm_bf16(x0, x1, x2, x3, b0, b1, b2, b3, e_x, nf_x, ELEM)
    elif HW_ROUND:
        return _words_asm(x0, x1, x2, x3, e_x, nf_x, ELEM)
    else:
        _, c0 = _quantize_values(x0, e_x, nf_x, ELEM, False, True)
        _, c1 = _quantize_values(x1, e_x, nf_x, ELEM, False, True)
        _, c2 = _quantize_values(x2, e_x, nf_x, ELEM, False, True)
        _, c3 = _quantize_values(x3, e_x, nf_x, ELEM, False, True)
        return _pack4(c0, c1, c2, c3)


@triton.jit
def _col_scales8(x0, x1, x2, x3, x4, x5, x6, x7, ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr,
                 G: tl.constexpr, BLOCK_C: tl.constexpr):
    """Column-block scales of a t8 tile: x_k (4 G, BLOCK_C) float32 as loaded (see above) ->
    (E8M0 bytes (G, BLOCK_C) int32, 255 for non-finite blocks; the non-finite flag and the
    scale exponent broadcast to (4 G, BLOCK_C)). The block amax is the float max of |x|
    (:func:`_block_amax_bits`; in PTX on the GPU)."""
    m = _absmax8(x0, x1, x2, x3, x4, x5, x6, x7, HW_ROUND)
    amax = _block_amax_bits(tl.reshape(m, (G, 4, BLOCK_C)), 1, HW_ROUND)  # (G, BLOCK_C)
    sb, _, nf = _scale_byte_inv(amax, ELEM, MODE)
    nf_x = tl.reshape(tl.broadcast_to(nf[:, None, :], (G, 4, BLOCK_C)), (4 * G, BLOCK_C))
    e_x = tl.reshape(tl.broadcast_to(tl.where(nf, 0, sb - 127)[:, None, :], (G, 4, BLOCK_C)), (4 * G, BLOCK_C))
    return sb, nf_x, e_x


@triton.jit
def _grouped_tile8(x_ptr, stride_xt, stride_xc, C, tok0_ptr, tok_end_ptr, n_blocks, src_ptr, pid_c, blk0,
                   G: tl.constexpr, BLOCK_C: tl.constexpr, HAS_SRC: tl.constexpr):
    """The t8 read of G consecutive 32-token blocks (from blk0) of the per-expert padded
    layout x BLOCK_C columns (from pid_c * BLOCK_C): eight tensors x_k (4 G, BLOCK_C) in x's
    dtype, row i of x_k being token 8 (i % 4) + k of block blk0 + i // 4 (zero past its
    expert's tokens or past C); also the columns (BLOCK_C,) int64 and their mask. HAS_SRC:
    sorted token t is row src[t] of x."""
    tok0, tok_end = _block_tokens(blk0 + tl.arange(0, G), tok0_ptr, tok_end_ptr, n_blocks)
    i = tl.arange(0, 4 * G)
    t0 = tl.reshape(tl.broadcast_to(tok0[:, None], (G, 4)), (4 * G,)) + 8 * (i % 4)
    t0 = t0[:, None]  # (4 G, 1): the first of each thread's 8 tokens
    t_end = tl.reshape(tl.broadcast_to(tok_end[:, None], (G, 4)), (4 * G,))[:, None]
    cols = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    c_ok = cols < C
    base = x_ptr + cols[None, :] * stride_xc
    c_in = c_ok[None, :]
    xs = (_load_token8(base, src_ptr, t0, t_end, c_in, stride_xt, HAS_SRC),
          _load_token8(base, src_ptr, t0 + 1, t_end, c_in, stride_xt, HAS_SRC),
          _load_token8(base, src_ptr, t0 + 2, t_end, c_in, stride_xt, HAS_SRC),
          _load_token8(base, src_ptr, t0 + 3, t_end, c_in, stride_xt, HAS_SRC),
          _load_token8(base, src_ptr, t0 + 4, t_end, c_in, stride_xt, HAS_SRC),
          _load_token8(base, src_ptr, t0 + 5, t_end, c_in, stride_xt, HAS_SRC),
          _load_token8(base, src_ptr, t0 + 6, t_end, c_in, stride_xt, HAS_SRC),
          _load_token8(base, src_ptr, t0 + 7, t_end, c_in, stride_xt, HAS_SRC))
    return xs, cols, c_ok


@triton.jit
def _colwise_t8(b0, b1, b2, b3, b4, b5, b6, b7, q_ptr, s_ptr, Rp, blk0, cols, c_ok, C,
                ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr,
                G: tl.constexpr, BLOCK_C: tl.constexpr):
    """Column-wise codes and scales of a t8 tile: b_k (4 G, BLOCK_C) as loaded (see above),
    its 32-row blocks being blk0 .. blk0 + G - 1 of the output's row space; cols (BLOCK_C,)
    int64 and c_ok (BLOCK_C,). Codes go to (C, Rp) (written as int32 words), scales to
    (C, Rp / 32)."""
    x0, x1, x2, x3 = _widen(b0, SOFT_CASTS), _widen(b1, SOFT_CASTS), _widen(b2, SOFT_CASTS), _widen(b3, SOFT_CASTS)
    x4, x5, x6, x7 = _widen(b4, SOFT_CASTS), _widen(b5, SOFT_CASTS), _widen(b6, SOFT_CASTS), _widen(b7, SOFT_CASTS)
    sb, nf_x, e_x = _col_scales8(x0, x1, x2, x3, x4, x5, x6, x7, ELEM, MODE, HW_ROUND, G, BLOCK_C)
    lo = _col_words8(x0, x1, x2, x3, b0, b1, b2, b3, nf_x, e_x, ELEM, HW_ROUND)
    hi = _col_words8(x4, x5, x6, x7, b4, b5, b6, b7, nf_x, e_x, ELEM, HW_ROUND)
    q32 = q_ptr.to(tl.pointer_type(tl.int32))
    blk = blk0 + tl.arange(0, G)
    # (BLOCK_C, 8 G) words: output row c's 32 G consecutive bytes
    words = tl.reshape(tl.permute(tl.join(lo, hi), (1, 0, 2)), (BLOCK_C, 8 * G))
    w = 8 * blk0 + tl.arange(0, 8 * G)[None, :]
    tl.store(q32 + cols[:, None] * (Rp // 4) + w, words, mask=c_ok[:, None] & (w < Rp // 4))
    s_off = _scale_offset(0, C, Rp, cols[:, None], blk[None, :])
    tl.store(s_ptr + s_off, tl.trans(sb).to(tl.uint8), mask=c_ok[:, None] & (blk < Rp // 32)[None, :])


@triton.jit
def _mx_grouped_col_t8_kernel(
    x_ptr, stride_xt, stride_xc, C,  # x (T, C) or, with HAS_SRC, the rows src gathers
    tok0_ptr, tok_end_ptr,  # (Tp / 32,) int32 token table of the padded blocks (_block_token_table_kernel)
    q_ptr, s_ptr, Tp,  # codes (C, Tp), scales (C, Tp / 32)
    src_ptr,  # HAS_SRC: (T,) int32, sorted row t is row src[t] of x
    ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_SRC: tl.constexpr,
):
    """Grouped column-wise codes in the t8 layout: a program takes G = BLOCK_T / 32
    consecutive 32-token blocks of the padded layout x BLOCK_C columns, each block's rows
    being its expert's tokens (zero past them). HAS_SRC: the token permute fused into the
    read (T then counts sorted rows)."""
    G: tl.constexpr = BLOCK_T // 32
    blk0 = tl.program_id(1) * G
    xs, cols, c_ok = _grouped_tile8(x_ptr, stride_xt, stride_xc, C, tok0_ptr, tok_end_ptr, Tp // 32, src_ptr,
                                    tl.program_id(0), blk0, G, BLOCK_C, HAS_SRC)
    _colwise_t8(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7], q_ptr, s_ptr, Tp, blk0, cols, c_ok,
                C, ELEM, MODE, HW_ROUND, SOFT_CASTS, G, BLOCK_C)


@triton.jit
def _grouped_tok_dq_tile(
    x_ptr, stride_xt, stride_xc, C, tok0_ptr, tok_end_ptr, d_ptr, Tp, pid_c, blk0,
    ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr,
    G: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program's tile of :func:`_mx_grouped_tok_dq_kernel`: G padded 32-token blocks
    from ``blk0`` x BLOCK_C columns from ``pid_c * BLOCK_C``."""
    i = tl.arange(0, 4 * G)
    p0 = ((blk0 + i // 4).to(tl.int64) * 32 + 8 * (i % 4))[:, None]  # output row of x_0's rows
    xs, cols, c_ok = _grouped_tile8(x_ptr, stride_xt, stride_xc, C, tok0_ptr, tok_end_ptr, Tp // 32, x_ptr,
                                    pid_c, blk0, G, BLOCK_C, False)
    _, nf_x, e_x = _col_scales8(_widen(xs[0], SOFT_CASTS), _widen(xs[1], SOFT_CASTS), _widen(xs[2], SOFT_CASTS),
                                _widen(xs[3], SOFT_CASTS), _widen(xs[4], SOFT_CASTS), _widen(xs[5], SOFT_CASTS),
                                _widen(xs[6], SOFT_CASTS), _widen(xs[7], SOFT_CASTS), ELEM, MODE, HW_ROUND,
                                G, BLOCK_C)
    c_in = c_ok[None, :]
    out_ok = (p0 < Tp) & c_in
    for k in tl.static_range(8):
        r, _ = _quantize_values(_widen(xs[k], SOFT_CASTS), e_x, nf_x, ELEM, HW_ROUND, False)
        tl.store(d_ptr + (p0 + k) * C + cols[None, :],
                 _from_float32(_dequantized(r, e_x, nf_x), d_ptr.dtype.element_ty, SOFT_CASTS), mask=out_ok)


@triton.jit
def _mx_grouped_tok_dq_kernel(
    x_ptr, stride_xt, stride_xc, C,  # x (T, C), rows sorted by expert
    tok0_ptr, tok_end_ptr,  # (Tp / 32,) int32 token table of the padded blocks (_block_token_table_kernel)
    d_ptr, Tp,  # dequantized values (Tp, C), row-major: the per-expert padded token layout, not transposed
    ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Fake quantization along tokens, each expert's tokens in their own 32-token blocks,
    written in the padded token layout without transposing: padded row 32 b + j of the
    output is token tok0(b) + j of x (zero past its expert's end). A program takes BLOCK_G
    blocks x BLOCK_C columns, read in the t8 layout of :func:`_mx_grouped_col_t8_kernel`
    (eight tensors x_k (4 G, BLOCK_C), row i of x_k being row 8 (i % 4) + k of block i // 4),
    so a column block reduces in registers plus two shuffles; each x_k is written back to
    its own rows, reads and writes both coalesced along C."""
    _grouped_tok_dq_tile(x_ptr, stride_xt, stride_xc, C, tok0_ptr, tok_end_ptr, d_ptr, Tp,
                         tl.program_id(0), tl.program_id(1) * BLOCK_G,
                         ELEM, MODE, HW_ROUND, SOFT_CASTS, BLOCK_G, BLOCK_C)


@triton.jit
def _mx_grouped_tok_dq_pair_kernel(
    a_ptr, stride_at, stride_ac, CA, da_ptr, NCA,  # first tensor (T, CA) -> (Tp, CA); NCA column programs
    b_ptr, stride_bt, stride_bc, CB, db_ptr,  # second tensor (T, CB) -> (Tp, CB)
    tok0_ptr, tok_end_ptr, Tp,  # (Tp / 32,) int32 token table of the padded blocks; padded rows
    ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """:func:`_mx_grouped_tok_dq_kernel` of two tensors with the same tokens and experts
    (the two wgrad operands dY and X) in one launch: column programs 0 .. NCA - 1 take the
    first, the rest the second. One launch instead of two saves a launch and a tail wave."""
    pid_c = tl.program_id(0)
    blk0 = tl.program_id(1) * BLOCK_G
    if pid_c < NCA:
        _grouped_tok_dq_tile(a_ptr, stride_at, stride_ac, CA, tok0_ptr, tok_end_ptr, da_ptr, Tp,
                             pid_c, blk0, ELEM, MODE, HW_ROUND, SOFT_CASTS, BLOCK_G, BLOCK_C)
    else:
        _grouped_tok_dq_tile(b_ptr, stride_bt, stride_bc, CB, tok0_ptr, tok_end_ptr, db_ptr, Tp,
                             pid_c - NCA, blk0, ELEM, MODE, HW_ROUND, SOFT_CASTS, BLOCK_G, BLOCK_C)
