"""Triton MX quantization kernels (FP8 elements: E4M3 and E5M2; scale rules floor and rceil).

Every kernel matches the pure-torch reference (:mod:`mxmoe.numerics.reference`) bit for bit
on element bytes and scale bytes (docs/NUMERICS.md). Two kernels cover all layouts:

- ``_mx_tile_kernel`` reads a (B, R, C) tensor (any strides) once, tile by tile, and writes
  any of: row-wise codes (blocks along C) with scales (B, R, C/32); column-wise codes
  (blocks along R), either transposed to (B, C, R) with scales (B, C, R/32) (the copy the
  backward GEMMs read) or in place (B, R, C) with scales (B, R/32, C); and the dequantized
  values of either (the fused quantize-dequantize of the emulated GEMMs). B = 1 for a
  2-D tensor, B = E for 3-D expert weights.
- ``_mx_grouped_col_kernel`` quantizes the rows (tokens) of a (T, C) tensor sorted by
  expert, each expert's tokens in their own blocks, into a transposed, per-expert padded
  layout (C, Tp): expert e's tokens start at column 32 * block_start[e], its last block
  is zero padded, Tp = 32 * (T // 32 + E) is a static bound (no host sync).
- ``_mx_grouped_tok_dq_kernel``: the same blocks, dequantized (the wgrad operand of the
  emulated GEMM), written in the padded token layout (Tp, C) without transposing.

Faster kernels for the same outputs, chosen by :mod:`mxmoe.kernels.quantize` where they
apply: ``_mx_rows_kernel`` (contiguous row-wise), the transposing ``_mx_tile_t8_kernel``
and ``_mx_grouped_col_t8_kernel`` (codes; 8 x 8 patches per thread, see the section
comment), and the quarter-read ``_mx_tile_t4_kernel``. On
the GPU (HW_ROUND == 2) the codes are made four at a time in inline PTX
(:func:`_codes_asm`, :func:`_words_asm`); the interpreter runs the same kernels with
float32-arithmetic rounding (HW_ROUND == 0), so CI checks their indexing and masking.

How the bits are made (identical on the GPU and under ``TRITON_INTERPRET=1``):
- amax is an integer max over the float32 bit patterns with the sign cleared, so a NaN
  (largest pattern) or an infinity always wins: no NaN-ignoring float max. The t8 kernels
  (FMAX) take the NaN-propagating float max of |x| instead (max.NaN.f32): the same bits
  for finite blocks, a NaN (non-finite) where the integer max gives one.
- the scale exponent is read off the float32 exponent field (floor) or computed from
  d = amax * float32(1 / max_normal) as ceil(log2(d)) from d's bits (rceil).
- NaN outputs (dequantized values of NaN blocks) are the canonical NaN: the contract
  asks for NaN, not for a payload.
- elements are scaled by an exact power of two, saturated, then rounded to the element
  grid in float32 (add and subtract 1.5 * 2^(k + 23 - mbits), which rounds to nearest
  even at the grid spacing of y's binade k), so the float8 cast that follows is exact:
  no dependence on how a platform's cast breaks ties.
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

    HW_ROUND=False rounds in float32 arithmetic first (the float8 cast is then exact);
    HW_ROUND=True leaves rounding to the float8 cast instruction (round to nearest even
    with saturation on sm89+; not in the interpreter, whose cast does not break ties to even).
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


# ---- PTX fast path (HW_ROUND == 2): codes made and packed four at a time --------------
# Per 4 elements: 4 multiplies by 2^-e, 2 cvt.rn.satfinite (two codes each, round to nearest
# even with saturation, bit-exact on sm89+), one byte permute to pack them, and the NaN rule
# on the packed word: the four input sign bytes gathered with prmt, (signs & 0x80) | 0x7F per
# byte, selected per byte by the block's non-finite mask (lop3). Triton's own lowering of the
# same steps spends ~4x the instructions (byte extracts, per-element selects and repacking),
# which is what bounded the transposing kernels (instruction-bound, not memory-bound).
# The sign bytes: from float32 inputs, byte 3 of each (three prmt); from bfloat16 inputs,
# byte 1 of each 16-bit half of the registers Triton packs them into (B0 = {x0, x1}, B1 =
# {x2, x3}, x0 in the low half): one prmt.
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
_SIGNS_BF16 = "prmt.b32 t, B0, B1, 0x7531;"


def _asm(fmt: str, names: dict, signs: str = _SIGNS_F32) -> str:
    text = _ASM_WORD.replace("SIGNS", signs).replace("FMT", fmt)
    for k, v in names.items():
        text = text.replace(k, v)
    return text


# pack=4: $1..$4 four consecutive elements of x, $5..$8 their 2^-e, $9 their four mask bytes
_CODES4 = {"X0": "$1", "X1": "$2", "X2": "$3", "X3": "$4", "S0": "$5", "S1": "$6", "S2": "$7", "S3": "$8", "M": "$9"}
_CODES4_E4M3 = tl.constexpr(_asm("e4m3x2", _CODES4))
_CODES4_E5M2 = tl.constexpr(_asm("e5m2x2", _CODES4))
# the same with the bfloat16 inputs in $5, $6 (two per register), 2^-e in $7..$10, mask bytes in $11
_CODES4B = {"X0": "$1", "X1": "$2", "X2": "$3", "X3": "$4", "B0": "$5", "B1": "$6",
            "S0": "$7", "S1": "$8", "S2": "$9", "S3": "$10", "M": "$11"}
_CODES4B_E4M3 = tl.constexpr(_asm("e4m3x2", _CODES4B, _SIGNS_BF16))
_CODES4B_E5M2 = tl.constexpr(_asm("e5m2x2", _CODES4B, _SIGNS_BF16))
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
    return _codes_asm_inv(x, x, _inv_scale(e), nonfinite, ELEM)


@triton.jit
def _codes_asm_inv(x, xin, inv_scale, nonfinite, ELEM: tl.constexpr):
    """:func:`_codes_asm` with 2^-e given (float32, broadcast to x's shape; any value
    where ``nonfinite``, whose codes are replaced); ``xin``: the input x was widened from
    (bfloat16: the sign bytes come from its registers), or x itself."""
    mask = tl.where(nonfinite, -1, 0).to(tl.int8)
    if xin.dtype == tl.bfloat16:
        if ELEM == 0:
            return tl.inline_asm_elementwise(_CODES4B_E4M3, "=r" + ",r" * 11, [x, xin, inv_scale, mask],
                                             dtype=tl.uint8, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise(_CODES4B_E5M2, "=r" + ",r" * 11, [x, xin, inv_scale, mask],
                                             dtype=tl.uint8, is_pure=True, pack=4)
    elif ELEM == 0:
        return tl.inline_asm_elementwise(_CODES4_E4M3, "=r,r,r,r,r,r,r,r,r,r", [x, inv_scale, mask],
                                         dtype=tl.uint8, is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(_CODES4_E5M2, "=r,r,r,r,r,r,r,r,r,r", [x, inv_scale, mask],
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
    """Codes only (uint8): the PTX path for HW_ROUND == 2, else :func:`_quantize_values`."""
    if HW_ROUND == 2:
        return _codes_asm(x, e, nonfinite, ELEM)
    else:
        _, codes = _quantize_values(x, e, nonfinite, ELEM, HW_ROUND, True)
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
def _blocked_scale_offset(r, c, n_col_tiles):
    """Byte offset of scale (r, c) in the Blackwell blocked layout (docs/NUMERICS.md)."""
    tile = (r // 128) * n_col_tiles + (c // 4)
    return tile * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + (c % 4)


@triton.jit
def _store_transposed_packed(q_ptr, base, row_words, codes, cols64, col_ok, word0, n_words,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Store uint8 codes (BLOCK_R, BLOCK_C) transposed, as int32 words of 4 consecutive
    codes (little-endian: the first code in the low byte), packed before the transpose so
    that it moves 4x fewer, 4x wider elements. Output row c holds ``row_words`` words;
    this tile's words start at ``word0``."""
    shifts = (tl.arange(0, 4) * 8)[None, :, None]
    words = tl.sum(tl.reshape(codes.to(tl.int32), (BLOCK_R // 4, 4, BLOCK_C)) << shifts, axis=1)  # or of bytes
    _store_words_t(q_ptr, base, row_words, tl.trans(words), cols64, col_ok, word0 + tl.arange(0, BLOCK_R // 4), n_words)


@triton.jit
def _store_words_t(q_ptr, base, row_words, words_t, cols64, col_ok, w_idx, n_words):
    """Store int32 words ``words_t`` (BLOCK_C, W), already transposed, into uint8 codes
    read as int32 words: output row c holds ``row_words`` words from ``base`` on; this
    tile's words are ``w_idx`` (W,), stored where ``col_ok`` and w_idx < n_words."""
    ptr = q_ptr.to(tl.pointer_type(tl.int32)) + base + cols64[:, None] * row_words + w_idx[None, :]
    tl.store(ptr, words_t, mask=col_ok[:, None] & (w_idx < n_words)[None, :])


@triton.jit
def _scale_bits(e, nf):
    """E8M0 scale bytes: biased exponent e + 127, 0xFF (NaN) for non-finite blocks."""
    return tl.where(nf, 255, e + 127).to(tl.uint8)


@triton.jit
def _scale_offset(b, n_rows, rows128, n_elems, r, c, BLOCKED: tl.constexpr):
    """Offset of scale (r, c) of matrix b in scales (B, n_rows, n_elems / 32): row-major,
    or Blackwell blocked (``rows128``: n_rows rounded up to 128)."""
    if BLOCKED:
        n_col_tiles = (n_elems // 32 + 3) // 4
        return b * rows128 * n_col_tiles * 4 + _blocked_scale_offset(r, c, n_col_tiles)
    else:
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
def _col_block_scales(abs_bits, ELEM: tl.constexpr, MODE: tl.constexpr, ROWS: tl.constexpr, PER_BLOCK: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """Scales of blocks of PER_BLOCK consecutive rows of abs_bits (ROWS, BLOCK_C) ->
    (e, nonfinite) (ROWS // PER_BLOCK, BLOCK_C) and both broadcast to (ROWS, BLOCK_C).
    PER_BLOCK is 32, or 8 for a quarter tile (each of its rows stands for 4 rows)."""
    if ROWS == PER_BLOCK:  # one block per column: reduce in place, no reshape
        e, nf = _scale_exponent(tl.max(abs_bits, axis=0)[None, :], ELEM, MODE)  # (1, BLOCK_C)
        e_x = tl.broadcast_to(e, (ROWS, BLOCK_C))
        nf_x = tl.broadcast_to(nf, (ROWS, BLOCK_C))
    else:
        amax = tl.max(tl.reshape(abs_bits, (ROWS // PER_BLOCK, PER_BLOCK, BLOCK_C)), axis=1)
        e, nf = _scale_exponent(amax, ELEM, MODE)  # (ROWS // PER_BLOCK, BLOCK_C)
        e_x = tl.reshape(tl.broadcast_to(e[:, None, :], (ROWS // PER_BLOCK, PER_BLOCK, BLOCK_C)), (ROWS, BLOCK_C))
        nf_x = tl.reshape(tl.broadcast_to(nf[:, None, :], (ROWS // PER_BLOCK, PER_BLOCK, BLOCK_C)), (ROWS, BLOCK_C))
    return e, nf, e_x, nf_x


@triton.jit
def _store_rowwise(qr_ptr, sr_ptr, codes, e, nf, rows64, row_ok, cols64, pid_c, b, R, Cp, R128,
                   BLOCKED: tl.constexpr, BLOCK_C: tl.constexpr):
    """Store row-wise codes (ROWS, BLOCK_C) of rows ``rows64`` into (B, R, Cp) and their
    scales e / nf (ROWS, BLOCK_C // 32) into (B, R, Cp / 32) (or blocked)."""
    q_off = b * R * Cp + rows64[:, None] * Cp + cols64[None, :]
    tl.store(qr_ptr + q_off, codes, mask=row_ok[:, None] & (cols64 < Cp)[None, :])
    scols = pid_c * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
    s_mask = row_ok[:, None] & (scols < Cp // 32)[None, :]
    s_off = _scale_offset(b, R, R128, Cp, rows64[:, None], scols[None, :], BLOCKED)
    tl.store(sr_ptr + s_off, _scale_bits(e, nf), mask=s_mask)


@triton.jit
def _abs_bits(x):
    """float32 bit patterns of x with the sign cleared (int32): ordered like |x|, NaN largest."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _mx_rows_kernel(
    x_ptr, n_blocks, blocks_per_row, q_ptr, s_ptr, d_ptr, rows_per_matrix, R128,
    ELEM: tl.constexpr, MODE: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_DQ: tl.constexpr,
    BLOCKED: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr, BLOCK_B: tl.constexpr,
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
        sbits = _scale_bits(e, nf)
        if BLOCKED:  # one blocked scale matrix per (rows_per_matrix, blocks_per_row) matrix
            rows = blks // blocks_per_row
            n_col_tiles = (blocks_per_row + 3) // 4
            s_off = (rows // rows_per_matrix) * R128 * n_col_tiles * 4 + _blocked_scale_offset(
                rows % rows_per_matrix, blks % blocks_per_row, n_col_tiles)
        else:
            s_off = blks
        tl.store(s_ptr + s_off[:, None], sbits, mask=ok[:, None])
    if WRITE_DQ:
        tl.store(d_ptr + offs, _from_float32(_dequantized(r, e, nf), d_ptr.dtype.element_ty, SOFT_CASTS),
                 mask=ok[:, None])


@triton.jit
def _mx_tile_kernel(
    x_ptr, stride_xb, stride_xr, stride_xc, R, C,
    # row-wise outputs (blocks along C): codes (B, R, Cp), scales (B, R, Cp / 32), dequantized (B, R, C)
    qr_ptr, sr_ptr, dr_ptr,
    # column-wise outputs (blocks along R): transposed (B, C, Rp) / (B, C, Rp / 32), or (B, Rp, C) / (B, Rp / 32, C)
    qc_ptr, sc_ptr, dc_ptr,
    Rp, Cp, R128, C128,  # padded extents; R128 / C128: rows of the blocked scale layouts
    ELEM: tl.constexpr, MODE: tl.constexpr,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, COL_T: tl.constexpr,
    WRITE_Q: tl.constexpr, WRITE_DQ: tl.constexpr, BLOCKED: tl.constexpr, HW_ROUND: tl.constexpr,
    SOFT_CASTS: tl.constexpr, PACK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
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
            _store_rowwise(qr_ptr, sr_ptr, codes, e, nf, rows64, rows < R, cols64, pid_c, b, R, Cp, R128,
                           BLOCKED, BLOCK_C)
        if WRITE_DQ:
            d_off = b * R * C + rows64[:, None] * C + cols64[None, :]
            tl.store(dr_ptr + d_off, _from_float32(_dequantized(r, e_x, nf_x), dr_ptr.dtype.element_ty, SOFT_CASTS), mask=in_mask)

    if COLWISE:
        e, nf, e_x, nf_x = _col_block_scales(abs_bits, ELEM, MODE, BLOCK_R, 32, BLOCK_C)
        r, codes = _quantize_values(x, e_x, nf_x, ELEM, HW_ROUND, True)
        col_ok = cols < C
        out_mask = (rows < Rp)[:, None] & col_ok[None, :]
        srows = pid_r * (BLOCK_R // 32) + tl.arange(0, BLOCK_R // 32)
        s_mask = (srows < Rp // 32)[:, None] & col_ok[None, :]
        sbits = _scale_bits(e, nf)
        if COL_T:
            if WRITE_Q:
                if PACK_T:
                    _store_transposed_packed(qc_ptr, b * C * (Rp // 4), Rp // 4, codes, cols64, cols < C,
                                             pid_r * (BLOCK_R // 4), Rp // 4, BLOCK_R, BLOCK_C)
                else:
                    tl.store(qc_ptr + b * C * Rp + cols64[None, :] * Rp + rows64[:, None], codes, mask=out_mask)
                s_off = _scale_offset(b, C, C128, Rp, cols64[None, :], srows[:, None], BLOCKED)
                tl.store(sc_ptr + s_off, sbits, mask=s_mask)
            if WRITE_DQ:
                d_off = b * C * R + cols64[None, :] * R + rows64[:, None]
                tl.store(dc_ptr + d_off, _from_float32(_dequantized(r, e_x, nf_x), dc_ptr.dtype.element_ty, SOFT_CASTS), mask=in_mask)
        else:
            if WRITE_Q:
                tl.store(qc_ptr + b * Rp * C + rows64[:, None] * C + cols64[None, :], codes, mask=out_mask)
                tl.store(sc_ptr + b * (Rp // 32) * C + srows[:, None] * C + cols64[None, :], sbits, mask=s_mask)
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
def _block_tokens_v(blk, ends_ptr, block_starts_ptr, E, T, E_POW2: tl.constexpr):
    """32-token blocks ``blk`` (N,) of the per-expert padded layout -> (their first tokens,
    the ends of their experts' tokens), both (N,). ends_ptr: (E,) cumulative token ends;
    block_starts_ptr: (E + 1,) cumulative padded block starts (both non-decreasing).

    One round trip to memory: both arrays are read whole, and a block's values are picked
    out by masked reductions instead of loads at its expert's index (which would wait for
    the first load and delay the data loads behind a second trip)."""
    ge = tl.arange(0, E_POW2)
    block_ends = tl.load(block_starts_ptr + 1 + ge, mask=ge < E, other=2147483647)[None, :]
    ends = tl.load(ends_ptr + ge, mask=ge < E, other=0)[None, :]
    before = block_ends <= blk[:, None]  # experts whose padded blocks end at or before the block
    # its expert g = the number of those; its first block block_ends[g - 1] (0 if g = 0) and
    # first token ends[g - 1]: the largest of those experts' values (non-decreasing)
    block_start = tl.max(tl.where(before, block_ends, 0), axis=1)
    tok_start = tl.max(tl.where(before, ends, 0), axis=1)
    # its tokens end at ends[g], the smallest among the others (none past the last expert:
    # read nothing), and never past row T, whatever the offsets say
    after = ~before & (ge < E)[None, :]
    tok_end = tl.min(tl.where(after, ends, 2147483647), axis=1)
    tok_end = tl.minimum(tl.where(tl.max(after.to(tl.int32), axis=1) > 0, tok_end, 0), T)
    return tok_start + (blk - block_start) * 32, tok_end


@triton.jit
def _block_tokens(blk, ends_ptr, block_starts_ptr, E, T, E_POW2: tl.constexpr):
    """:func:`_block_tokens_v` of one block ``blk`` (a scalar): scalars."""
    tok0, tok_end = _block_tokens_v(tl.full((1,), blk, tl.int32), ends_ptr, block_starts_ptr, E, T, E_POW2)
    return tl.sum(tok0, axis=0), tl.sum(tok_end, axis=0)


@triton.jit
def _mx_grouped_col_kernel(
    x_ptr, stride_xt, stride_xc, T, C,
    ends_ptr, block_starts_ptr, E,  # (E,) cumulative token ends; (E + 1,) cumulative padded block starts
    q_ptr, s_ptr, Tp, C128,  # codes (C, Tp), scales (C, Tp / 32)
    ELEM: tl.constexpr, MODE: tl.constexpr, BLOCKED: tl.constexpr, HW_ROUND: tl.constexpr,
    SOFT_CASTS: tl.constexpr, PACK_T: tl.constexpr, E_POW2: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Grouped column-wise codes, one 32-token block x BLOCK_C columns per program, the
    transpose left to Triton (the fallback when the t8 kernel is disabled)."""
    pid_c = tl.program_id(0)
    blk = tl.program_id(1)  # 32-token block of the padded layout
    tok0, tok_end = _block_tokens(blk, ends_ptr, block_starts_ptr, E, T, E_POW2)
    toks = tok0 + tl.arange(0, 32)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cols64 = cols.to(tl.int64)
    tok_ok = toks < tok_end
    in_mask = tok_ok[:, None] & (cols < C)[None, :]
    x = _to_float32(tl.load(x_ptr + toks.to(tl.int64)[:, None] * stride_xt + cols64[None, :] * stride_xc,
                            mask=in_mask, other=0.0), SOFT_CASTS)
    abs_bits = _abs_bits(x)
    amax = tl.max(abs_bits, axis=0)  # (BLOCK_C,)
    e, nf = _scale_exponent(amax, ELEM, MODE)
    e_x = tl.broadcast_to(e[None, :], (32, BLOCK_C))
    nf_x = tl.broadcast_to(nf[None, :], (32, BLOCK_C))
    r, codes = _quantize_values(x, e_x, nf_x, ELEM, HW_ROUND, True)
    pos = blk.to(tl.int64) * 32 + tl.arange(0, 32)  # column in the padded layout
    out_mask = (cols < C)[None, :] & (pos < Tp)[:, None]
    if PACK_T:
        _store_transposed_packed(q_ptr, 0, Tp // 4, codes, cols64, cols < C, blk * 8, Tp // 4, 32, BLOCK_C)
    else:
        tl.store(q_ptr + cols64[None, :] * Tp + pos[:, None], codes, mask=out_mask)
    tl.store(s_ptr + _scale_offset(0, C, C128, Tp, cols64, blk.to(tl.int64), BLOCKED), _scale_bits(e, nf),
             mask=cols < C)


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


# ---- transposing kernels that pack before they transpose ----------------------------------
# A column-wise copy is a transpose: code (r, c) goes to (c, r). Moving single bytes through
# shared memory is what bounded the kernels above (ncu: L1/shared-memory bound). Here a tile
# is read as four row-interleaved quarters x_j = rows 4i + j (each a coalesced load of its
# own), so the four codes that share an output word sit in one thread: they are packed into
# an int32 with shifts (no data movement), and only the words, 4x fewer and 4x wider, are
# transposed.


@triton.jit
def _rowwise_quarter(x, rows64, row_ok, cols64, pid_c, b, R, Cp, R128, qr_ptr, sr_ptr,
                     ELEM: tl.constexpr, MODE: tl.constexpr, BLOCKED: tl.constexpr, HW_ROUND: tl.constexpr,
                     Q: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row-wise codes and scales of the rows ``rows64`` (Q,) of a tile: x (Q, BLOCK_C) float32."""
    e, nf, e_x, nf_x = _row_block_scales(_abs_bits(x), ELEM, MODE, Q, BLOCK_C)
    codes = _quantize_codes(x, e_x, nf_x, ELEM, HW_ROUND)
    _store_rowwise(qr_ptr, sr_ptr, codes, e, nf, rows64, row_ok, cols64, pid_c, b, R, Cp, R128, BLOCKED, BLOCK_C)


@triton.jit
def _pack4(c0, c1, c2, c3):
    """Four uint8 code tensors -> int32 words, c0 in the low byte (little-endian order)."""
    return c0.to(tl.int32) | (c1.to(tl.int32) << 8) | (c2.to(tl.int32) << 16) | (c3.to(tl.int32) << 24)


@triton.jit
def _mx_tile_t4_kernel(
    x_ptr, stride_xb, stride_xr, stride_xc, R, C,
    qr_ptr, sr_ptr,  # row-wise codes (B, R, Cp), scales (B, R, Cp / 32) (or blocked)
    qc_ptr, sc_ptr,  # column-wise codes transposed (B, C, Rp), scales (B, C, Rp / 32) (or blocked)
    Rp, Cp, R128, C128,
    ELEM: tl.constexpr, MODE: tl.constexpr, ROWWISE: tl.constexpr, BLOCKED: tl.constexpr,
    HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Column-wise (transposed) codes, and optionally row-wise codes, of a (B, R, C) tensor
    from one read; tile (BLOCK_R, BLOCK_C), BLOCK_R a multiple of 32, read as 4 quarters."""
    Q: tl.constexpr = BLOCK_R // 4
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    i = tl.arange(0, Q)
    r0 = pid_r * BLOCK_R + 4 * i  # first row of each group of four
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cols64 = cols.to(tl.int64)
    col_in = cols < C
    base = x_ptr + b * stride_xb + cols64[None, :] * stride_xc
    x0 = _to_float32(tl.load(base + r0.to(tl.int64)[:, None] * stride_xr,
                             mask=(r0 < R)[:, None] & col_in[None, :], other=0.0), SOFT_CASTS)
    x1 = _to_float32(tl.load(base + (r0 + 1).to(tl.int64)[:, None] * stride_xr,
                             mask=(r0 + 1 < R)[:, None] & col_in[None, :], other=0.0), SOFT_CASTS)
    x2 = _to_float32(tl.load(base + (r0 + 2).to(tl.int64)[:, None] * stride_xr,
                             mask=(r0 + 2 < R)[:, None] & col_in[None, :], other=0.0), SOFT_CASTS)
    x3 = _to_float32(tl.load(base + (r0 + 3).to(tl.int64)[:, None] * stride_xr,
                             mask=(r0 + 3 < R)[:, None] & col_in[None, :], other=0.0), SOFT_CASTS)
    if ROWWISE:
        _rowwise_quarter(x0, r0.to(tl.int64), r0 < R, cols64, pid_c, b, R, Cp, R128, qr_ptr, sr_ptr,
                         ELEM, MODE, BLOCKED, HW_ROUND, Q, BLOCK_C)
        _rowwise_quarter(x1, (r0 + 1).to(tl.int64), r0 + 1 < R, cols64, pid_c, b, R, Cp, R128, qr_ptr, sr_ptr,
                         ELEM, MODE, BLOCKED, HW_ROUND, Q, BLOCK_C)
        _rowwise_quarter(x2, (r0 + 2).to(tl.int64), r0 + 2 < R, cols64, pid_c, b, R, Cp, R128, qr_ptr, sr_ptr,
                         ELEM, MODE, BLOCKED, HW_ROUND, Q, BLOCK_C)
        _rowwise_quarter(x3, (r0 + 3).to(tl.int64), r0 + 3 < R, cols64, pid_c, b, R, Cp, R128, qr_ptr, sr_ptr,
                         ELEM, MODE, BLOCKED, HW_ROUND, Q, BLOCK_C)
    # column-wise: a 32-row block is 8 consecutive quarter rows of each x_j
    m = tl.maximum(tl.maximum(_abs_bits(x0), _abs_bits(x1)), tl.maximum(_abs_bits(x2), _abs_bits(x3)))
    e, nf, e_x, nf_x = _col_block_scales(m, ELEM, MODE, Q, 8, BLOCK_C)
    if HW_ROUND == 2:
        words = tl.trans(_words_asm(x0, x1, x2, x3, e_x, nf_x, ELEM))  # (BLOCK_C, Q)
    else:
        _, c0 = _quantize_values(x0, e_x, nf_x, ELEM, HW_ROUND, True)
        _, c1 = _quantize_values(x1, e_x, nf_x, ELEM, HW_ROUND, True)
        _, c2 = _quantize_values(x2, e_x, nf_x, ELEM, HW_ROUND, True)
        _, c3 = _quantize_values(x3, e_x, nf_x, ELEM, HW_ROUND, True)
        words = tl.trans(_pack4(c0, c1, c2, c3))  # (BLOCK_C, Q)
    _store_words_t(qc_ptr, b * C * (Rp // 4), Rp // 4, words, cols64, col_in, pid_r * Q + i, Rp // 4)
    srows = pid_r * (BLOCK_R // 32) + tl.arange(0, BLOCK_R // 32)
    s_mask = (srows < Rp // 32)[:, None] & col_in[None, :]
    s_off = _scale_offset(b, C, C128, Rp, cols64[None, :], srows[:, None], BLOCKED)
    tl.store(sc_ptr + s_off, _scale_bits(e, nf), mask=s_mask)


# ---- transposing kernels with the column blocks in registers (t8) -------------------------
# Each thread holds an 8 x 8 patch (8 consecutive rows, 8 consecutive columns) of a 32-row
# block: a tile of G 32-row blocks is read as eight tensors x_k (4 G, BLOCK_C), row i of x_k
# being row 32 (i // 4) + 8 (i % 4) + k of the tile. Triton lays a (4 G, BLOCK_C) load out
# with 8 columns per thread, 8 lanes along the columns and 4 along the rows (BLOCK_C = 64;
# 16 and 2 for 128), warps along the rows, so the same (i, c) of every x_k is in one thread
# and the 4 lanes of one i // 4 are in one warp:
# - a column block (32 rows = 4 lanes x 8 registers) reduces in registers plus two shuffles;
# - the four codes of one transposed output word (rows 4j..4j+3, one column) are in one
#   thread and are packed where they are (:func:`_words_asm`);
# - a row block (32 columns = 4 lanes x 8 registers) reduces with two shuffles.
# The transposed words are stored either straight from the registers (8 bytes per thread,
# a 32-byte sector per column and warp) or STAGED: through Triton's coalesced layout (shared
# memory), which gives each output row 32 G contiguous bytes per program.
# bfloat16 input stays in its registers (two elements each) as loaded: :func:`_widen` makes
# the float32 values with one instruction per element, and the PTX takes the NaN rule's sign
# bytes straight from those registers (:func:`_codes_asm_inv`, :func:`_words_asm_bf16`).


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
def _store_u8(ptr, val, mask, ASM: tl.constexpr):
    """Store ``val`` (uint8, or int32 in [0, 255]: no truncating op) as bytes at ``ptr``
    where ``mask``. ASM: one predicated st.global.b8 per
    element from the registers it is in; Triton's tl.store would first move a small
    reduced tensor (scales) to its own coalesced layout through shared memory, with two
    barriers per store. Redundant copies (lanes that share a reduced value) store the same
    byte to the same address."""
    if ASM:
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b8 [$1], $2; mov.b32 $0, 0; }",
                                  "=r,l,r,r", [ptr.to(tl.int64, bitcast=True), val.to(tl.int32), mask.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, val, mask=mask)


@triton.jit
def _store_2w(ptr, lo, hi, mask):
    """GPU only: store int32 words lo, hi at ptr, ptr + 1 (8-byte aligned) where mask, one
    st.global.v2.b32 per element pair, from the registers they are in."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $4, 0; @p st.global.v2.b32 [$1], {$2, $3}; mov.b32 $0, 0; }",
                              "=r,l,r,r,r", [ptr.to(tl.int64, bitcast=True), lo, hi, mask.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


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
def _load_row8(p0, k: tl.constexpr, step, r0, R, c_ok):
    """Rows r0 + k (r0 (N, 1)) of the input, in its dtype (zero at rows >= R or outside the
    columns); p0: the pointers of rows r0, step: the row stride (one scalar add per row)."""
    return tl.load(p0 + k * step, mask=(r0 + k < R) & c_ok, other=0.0)


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
def _row_codes8(xin, k: tl.constexpr, r0, R, q_p0, s_p0, c0, cols, b, Cp, R128, ELEM: tl.constexpr,
                MODE: tl.constexpr, BLOCKED: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr,
                FMAX: tl.constexpr, N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row-wise codes and scales of rows r0 + k (r0 (N, 1)) of the tile: xin (N, BLOCK_C)
    as loaded; q_p0 / s_p0: the code / scale pointers of rows r0 (s_p0: the scale base when
    BLOCKED), so that row r0 + k is one scalar add away."""
    x = _widen(xin, SOFT_CASTS)
    if FMAX:
        amax = _block_amax_bits(tl.reshape(x, (N, BLOCK_C // 32, 32)), 2, HW_ROUND == 2)  # (N, BLOCK_C // 32)
    else:
        amax = tl.max(tl.reshape(_abs_bits(x), (N, BLOCK_C // 32, 32)), axis=2)
    sb, inv, nf = _scale_byte_inv(amax, ELEM, MODE)
    nf_x = tl.reshape(tl.broadcast_to(nf[:, :, None], (N, BLOCK_C // 32, 32)), (N, BLOCK_C))
    if HW_ROUND == 2:
        inv_x = tl.reshape(tl.broadcast_to(inv[:, :, None], (N, BLOCK_C // 32, 32)), (N, BLOCK_C))
        codes = _codes_asm_inv(x, xin, inv_x, nf_x, ELEM)
    else:
        e = tl.where(nf, 0, sb - 127)
        e_x = tl.reshape(tl.broadcast_to(e[:, :, None], (N, BLOCK_C // 32, 32)), (N, BLOCK_C))
        _, codes = _quantize_values(x, e_x, nf_x, ELEM, HW_ROUND, True)
    row_ok = r0 + k < R
    tl.store(q_p0 + k * Cp, codes, mask=row_ok & (cols < Cp))
    scols = (c0 // 32 + tl.arange(0, BLOCK_C // 32))[None, :]
    if BLOCKED:
        s_p = s_p0 + _scale_offset(b, R, R128, Cp, (r0 + k).to(tl.int64), scols, True)
    else:
        s_p = s_p0 + k * (Cp // 32)
    _store_u8(s_p, sb, row_ok & (scols < Cp // 32), HW_ROUND == 2)


@triton.jit
def _col_words8(x0, x1, x2, x3, b0, b1, b2, b3, nf_x, e_x, ELEM: tl.constexpr, HW_ROUND: tl.constexpr):
    """int32 words of the column-wise codes of four consecutive rows (x0 in the low byte):
    x_k float32, b_k the tensors they were widened from."""
    if HW_ROUND == 2 and b0.dtype == tl.bfloat16:
        return _words_asm_bf16(x0, x1, x2, x3, b0, b1, b2, b3, e_x, nf_x, ELEM)
    elif HW_ROUND == 2:
        return _words_asm(x0, x1, x2, x3, e_x, nf_x, ELEM)
    else:
        _, c0 = _quantize_values(x0, e_x, nf_x, ELEM, HW_ROUND, True)
        _, c1 = _quantize_values(x1, e_x, nf_x, ELEM, HW_ROUND, True)
        _, c2 = _quantize_values(x2, e_x, nf_x, ELEM, HW_ROUND, True)
        _, c3 = _quantize_values(x3, e_x, nf_x, ELEM, HW_ROUND, True)
        return _pack4(c0, c1, c2, c3)


@triton.jit
def _col_scales8(x0, x1, x2, x3, x4, x5, x6, x7, ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr,
                 FMAX: tl.constexpr, G: tl.constexpr, BLOCK_C: tl.constexpr):
    """Column-block scales of a t8 tile: x_k (4 G, BLOCK_C) float32 as loaded (see above) ->
    (E8M0 bytes (G, BLOCK_C) int32, 255 for non-finite blocks; the non-finite flag and the
    scale exponent broadcast to (4 G, BLOCK_C)). FMAX: the block amax by the float max of
    |x| (:func:`_block_amax_bits`), else the integer max of the bit patterns."""
    if FMAX:
        m = _absmax8(x0, x1, x2, x3, x4, x5, x6, x7, HW_ROUND == 2)
        amax = _block_amax_bits(tl.reshape(m, (G, 4, BLOCK_C)), 1, HW_ROUND == 2)  # (G, BLOCK_C)
    else:
        m = tl.maximum(tl.maximum(tl.maximum(_abs_bits(x0), _abs_bits(x1)), tl.maximum(_abs_bits(x2), _abs_bits(x3))),
                       tl.maximum(tl.maximum(_abs_bits(x4), _abs_bits(x5)), tl.maximum(_abs_bits(x6), _abs_bits(x7))))
        amax = tl.max(tl.reshape(m, (G, 4, BLOCK_C)), axis=1)
    sb, _, nf = _scale_byte_inv(amax, ELEM, MODE)
    nf_x = tl.reshape(tl.broadcast_to(nf[:, None, :], (G, 4, BLOCK_C)), (4 * G, BLOCK_C))
    e_x = tl.reshape(tl.broadcast_to(tl.where(nf, 0, sb - 127)[:, None, :], (G, 4, BLOCK_C)), (4 * G, BLOCK_C))
    return sb, nf_x, e_x


@triton.jit
def _grouped_tile8(x_ptr, stride_xt, stride_xc, T, C, ends_ptr, block_starts_ptr, E, src_ptr, pid_c, blk0,
                   E_POW2: tl.constexpr, G: tl.constexpr, BLOCK_C: tl.constexpr, HAS_SRC: tl.constexpr):
    """The t8 read of G consecutive 32-token blocks (from blk0) of the per-expert padded
    layout x BLOCK_C columns (from pid_c * BLOCK_C): eight tensors x_k (4 G, BLOCK_C) in x's
    dtype, row i of x_k being token 8 (i % 4) + k of block blk0 + i // 4 (zero past its
    expert's tokens or past C); also the columns (BLOCK_C,) int64 and their mask. HAS_SRC:
    sorted token t is row src[t] of x."""
    tok0, tok_end = _block_tokens_v(blk0 + tl.arange(0, G), ends_ptr, block_starts_ptr, E, T, E_POW2)
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
def _colwise_t8(b0, b1, b2, b3, b4, b5, b6, b7, q_ptr, s_ptr, b, Rp, blk0, cols, c_ok, C, C128,
                ELEM: tl.constexpr, MODE: tl.constexpr, BLOCKED: tl.constexpr, HW_ROUND: tl.constexpr,
                SOFT_CASTS: tl.constexpr, FMAX: tl.constexpr, G: tl.constexpr, BLOCK_C: tl.constexpr,
                STAGED: tl.constexpr):
    """Column-wise codes and scales of a t8 tile: b_k (4 G, BLOCK_C) as loaded (see above),
    its 32-row blocks being blk0 .. blk0 + G - 1 of the output's row space; cols (BLOCK_C,)
    int64 and c_ok (BLOCK_C,). Codes go to (B, C, Rp) (written as int32 words), scales to
    (B, C, Rp / 32) (or blocked); b is the matrix index."""
    x0, x1, x2, x3 = _widen(b0, SOFT_CASTS), _widen(b1, SOFT_CASTS), _widen(b2, SOFT_CASTS), _widen(b3, SOFT_CASTS)
    x4, x5, x6, x7 = _widen(b4, SOFT_CASTS), _widen(b5, SOFT_CASTS), _widen(b6, SOFT_CASTS), _widen(b7, SOFT_CASTS)
    sb, nf_x, e_x = _col_scales8(x0, x1, x2, x3, x4, x5, x6, x7, ELEM, MODE, HW_ROUND, FMAX, G, BLOCK_C)
    lo = _col_words8(x0, x1, x2, x3, b0, b1, b2, b3, nf_x, e_x, ELEM, HW_ROUND)
    hi = _col_words8(x4, x5, x6, x7, b4, b5, b6, b7, nf_x, e_x, ELEM, HW_ROUND)
    q32 = q_ptr.to(tl.pointer_type(tl.int32)) + b * C * (Rp // 4)
    blk = blk0 + tl.arange(0, G)
    if STAGED:
        # (BLOCK_C, 8 G) words: output row c's 32 G consecutive bytes
        words = tl.reshape(tl.permute(tl.join(lo, hi), (1, 0, 2)), (BLOCK_C, 8 * G))
        w = 8 * blk0 + tl.arange(0, 8 * G)[None, :]
        tl.store(q32 + cols[:, None] * (Rp // 4) + w, words, mask=c_ok[:, None] & (w < Rp // 4))
        s_off = _scale_offset(b, C, C128, Rp, cols[:, None], blk[None, :], BLOCKED)
        tl.store(s_ptr + s_off, tl.trans(sb).to(tl.uint8), mask=c_ok[:, None] & (blk < Rp // 32)[None, :])
    else:
        i = tl.arange(0, 4 * G)
        w0 = (8 * blk0 + 8 * (i // 4) + 2 * (i % 4))[:, None]  # output words w0, w0 + 1 of row i's thread
        ptr = q32 + cols[None, :] * (Rp // 4) + w0
        w_ok = c_ok[None, :] & (w0 < Rp // 4)
        if HW_ROUND == 2:
            _store_2w(ptr, lo, hi, w_ok)
        else:
            tl.store(ptr, lo, mask=w_ok)
            tl.store(ptr + 1, hi, mask=w_ok)
        s_off = _scale_offset(b, C, C128, Rp, cols[None, :], blk[:, None], BLOCKED)
        _store_u8(s_ptr + s_off, sb, c_ok[None, :] & (blk < Rp // 32)[:, None], HW_ROUND == 2)


@triton.jit
def _prefetch_tile(x_ptr, stride_xb, stride_xr, stride_xc, R, C, Rp, pid_c, pid_r, b, DIST_R: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """GPU only: prefetch into L2 (``prefetch.global.L2``, a hint: no registers, no wait)
    the input tile DIST_R row tiles below this one (the next matrix's first row tiles past
    the last; DIST_R below the row-tile count), which the grid (column tiles, row tiles, B),
    launched column tile fastest, reaches DIST_R x (column tiles) programs later: one row
    per lane, each 128-byte line of its BLOCK_C elements that starts inside the row. The t8
    programs keep few loads in flight (two to four programs per multiprocessor, limited by
    registers); this starts a later wave's reads while this one computes. Only addresses of
    elements that exist are touched."""
    n_r = tl.cdiv(Rp, BLOCK_R)
    tr = pid_r + DIST_R
    tb = tl.where(tr >= n_r, b + 1, b)
    tr = tl.where(tr >= n_r, tr - n_r, tr)
    rows = tr * BLOCK_R + tl.arange(0, BLOCK_R)
    ptr = x_ptr + tb * stride_xb + rows.to(tl.int64) * stride_xr + (pid_c * BLOCK_C).to(tl.int64) * stride_xc
    ok = (rows < R) & (tb < tl.num_programs(2))
    PER_LINE: tl.constexpr = 1024 // x_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128-byte line
    N_LINES: tl.constexpr = (BLOCK_C + PER_LINE - 1) // PER_LINE
    for j in tl.static_range(N_LINES):  # each line only where its first column exists
        _prefetch_l2(ptr + j * PER_LINE * stride_xc, ok & (pid_c * BLOCK_C + j * PER_LINE < C))


@triton.jit
def _prefetch_l2(ptr, mask):
    """GPU only: ``prefetch.global.L2`` of the line holding each pointer where mask."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [ptr.to(tl.int64, bitcast=True), mask.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _mx_tile_t8_kernel(
    x_ptr, stride_xb, stride_xr, stride_xc, R, C,
    qr_ptr, sr_ptr,  # row-wise codes (B, R, Cp), scales (B, R, Cp / 32) (or blocked)
    qc_ptr, sc_ptr,  # column-wise codes transposed (B, C, Rp), scales (B, C, Rp / 32) (or blocked)
    Rp, Cp, R128, C128,
    ELEM: tl.constexpr, MODE: tl.constexpr, ROWWISE: tl.constexpr, BLOCKED: tl.constexpr,
    HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    STAGED: tl.constexpr, FMAX: tl.constexpr, PREFETCH: tl.constexpr = 0,
):
    """Column-wise (transposed) codes, and optionally row-wise codes, of a (B, R, C) tensor
    from one read; tile (BLOCK_R, BLOCK_C), both multiples of 32, read as eight
    (BLOCK_R / 8, BLOCK_C) tensors (see the comment above). FMAX: block amax by the float
    max of |x| (:func:`_block_amax_bits`), else the integer max of the bit patterns.
    PREFETCH > 0: first prefetch into L2 the input tile that many row tiles below
    (:func:`_prefetch_tile`). One tile per program: grid (column tiles, row tiles, B)."""
    G: tl.constexpr = BLOCK_R // 32
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    if PREFETCH > 0:
        _prefetch_tile(x_ptr, stride_xb, stride_xr, stride_xc, R, C, Rp, pid_c, pid_r, b, PREFETCH, BLOCK_R, BLOCK_C)
    i = tl.arange(0, 4 * G)
    c0 = pid_c * BLOCK_C
    cols = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
    c_ok = cols < C
    r0 = (pid_r * BLOCK_R + 32 * (i // 4) + 8 * (i % 4))[:, None]  # the first of each thread's 8 rows
    c_in = c_ok[None, :]
    p0 = x_ptr + b * stride_xb + cols[None, :] * stride_xc + r0.to(tl.int64) * stride_xr
    step = stride_xr.to(tl.int64)
    x0 = _load_row8(p0, 0, step, r0, R, c_in)
    x1 = _load_row8(p0, 1, step, r0, R, c_in)
    x2 = _load_row8(p0, 2, step, r0, R, c_in)
    x3 = _load_row8(p0, 3, step, r0, R, c_in)
    x4 = _load_row8(p0, 4, step, r0, R, c_in)
    x5 = _load_row8(p0, 5, step, r0, R, c_in)
    x6 = _load_row8(p0, 6, step, r0, R, c_in)
    x7 = _load_row8(p0, 7, step, r0, R, c_in)
    if ROWWISE:
        N: tl.constexpr = 4 * G
        r64 = r0.to(tl.int64)
        q_p0 = qr_ptr + b * R * Cp + r64 * Cp + cols[None, :]
        if BLOCKED:
            s_p0 = sr_ptr
        else:
            s_p0 = sr_ptr + b * R * (Cp // 32) + r64 * (Cp // 32) + (c0 // 32 + tl.arange(0, BLOCK_C // 32))[None, :]
        cr = cols[None, :]
        xs = (x0, x1, x2, x3, x4, x5, x6, x7)
        for k in tl.static_range(8):
            _row_codes8(xs[k], k, r0, R, q_p0, s_p0, c0, cr, b, Cp, R128, ELEM, MODE, BLOCKED, HW_ROUND, SOFT_CASTS,
                        FMAX, N, BLOCK_C)
    _colwise_t8(x0, x1, x2, x3, x4, x5, x6, x7, qc_ptr, sc_ptr, b, Rp, pid_r * G, cols, c_ok,
                C, C128, ELEM, MODE, BLOCKED, HW_ROUND, SOFT_CASTS, FMAX, G, BLOCK_C, STAGED)


@triton.jit
def _mx_grouped_col_t8_kernel(
    x_ptr, stride_xt, stride_xc, T, C,
    ends_ptr, block_starts_ptr, E,  # (E,) cumulative token ends; (E + 1,) cumulative padded block starts
    q_ptr, s_ptr, Tp, C128,  # codes (C, Tp), scales (C, Tp / 32) (or blocked)
    src_ptr,  # HAS_SRC: (T,) int32, sorted row t is row src[t] of x
    ELEM: tl.constexpr, MODE: tl.constexpr, BLOCKED: tl.constexpr, HW_ROUND: tl.constexpr,
    SOFT_CASTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    STAGED: tl.constexpr, HAS_SRC: tl.constexpr, FMAX: tl.constexpr,
):
    """``_mx_grouped_col_kernel`` (codes only) in the t8 layout: a program takes G =
    BLOCK_T / 32 consecutive 32-token blocks of the padded layout, each read as the rows of
    a 32-row block of ``_mx_tile_t8_kernel``, its rows being its expert's tokens. HAS_SRC:
    the token permute fused into the read (T then counts sorted rows)."""
    G: tl.constexpr = BLOCK_T // 32
    blk0 = tl.program_id(1) * G
    xs, cols, c_ok = _grouped_tile8(x_ptr, stride_xt, stride_xc, T, C, ends_ptr, block_starts_ptr, E, src_ptr,
                                    tl.program_id(0), blk0, E_POW2, G, BLOCK_C, HAS_SRC)
    _colwise_t8(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7], q_ptr, s_ptr, 0, Tp, blk0, cols, c_ok,
                C, C128, ELEM, MODE, BLOCKED, HW_ROUND, SOFT_CASTS, FMAX, G, BLOCK_C, STAGED)


@triton.jit
def _grouped_tok_dq_tile(
    x_ptr, stride_xt, stride_xc, T, C, ends_ptr, block_starts_ptr, E, d_ptr, Tp, pid_c, blk0,
    ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr,
    E_POW2: tl.constexpr, G: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One program's tile of :func:`_mx_grouped_tok_dq_kernel`: G padded 32-token blocks
    from ``blk0`` x BLOCK_C columns from ``pid_c * BLOCK_C``."""
    i = tl.arange(0, 4 * G)
    p0 = ((blk0 + i // 4).to(tl.int64) * 32 + 8 * (i % 4))[:, None]  # output row of x_0's rows
    xs, cols, c_ok = _grouped_tile8(x_ptr, stride_xt, stride_xc, T, C, ends_ptr, block_starts_ptr, E, x_ptr,
                                    pid_c, blk0, E_POW2, G, BLOCK_C, False)
    _, nf_x, e_x = _col_scales8(_widen(xs[0], SOFT_CASTS), _widen(xs[1], SOFT_CASTS), _widen(xs[2], SOFT_CASTS),
                                _widen(xs[3], SOFT_CASTS), _widen(xs[4], SOFT_CASTS), _widen(xs[5], SOFT_CASTS),
                                _widen(xs[6], SOFT_CASTS), _widen(xs[7], SOFT_CASTS), ELEM, MODE, HW_ROUND, True,
                                G, BLOCK_C)
    c_in = c_ok[None, :]
    out_ok = (p0 < Tp) & c_in
    for k in tl.static_range(8):
        r, _ = _quantize_values(_widen(xs[k], SOFT_CASTS), e_x, nf_x, ELEM, HW_ROUND, False)
        tl.store(d_ptr + (p0 + k) * C + cols[None, :],
                 _from_float32(_dequantized(r, e_x, nf_x), d_ptr.dtype.element_ty, SOFT_CASTS), mask=out_ok)


@triton.jit
def _mx_grouped_tok_dq_kernel(
    x_ptr, stride_xt, stride_xc, T, C,
    ends_ptr, block_starts_ptr, E,  # (E,) cumulative token ends; (E + 1,) cumulative padded block starts
    d_ptr, Tp,  # dequantized values (Tp, C), row-major: the per-expert padded token layout, not transposed
    ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Fake quantization along tokens, each expert's tokens in their own 32-token blocks,
    written in the padded token layout without transposing: padded row 32 b + j of the
    output is token tok0(b) + j of x (zero past its expert's end). A program takes BLOCK_G
    blocks x BLOCK_C columns, read in the t8 layout of :func:`_mx_grouped_col_t8_kernel`
    (eight tensors x_k (4 G, BLOCK_C), row i of x_k being row 8 (i % 4) + k of block i // 4),
    so a column block reduces in registers plus two shuffles; each x_k is written back to
    its own rows, reads and writes both coalesced along C."""
    _grouped_tok_dq_tile(x_ptr, stride_xt, stride_xc, T, C, ends_ptr, block_starts_ptr, E, d_ptr, Tp,
                         tl.program_id(0), tl.program_id(1) * BLOCK_G,
                         ELEM, MODE, HW_ROUND, SOFT_CASTS, E_POW2, BLOCK_G, BLOCK_C)


@triton.jit
def _mx_grouped_tok_dq_pair_kernel(
    a_ptr, stride_at, stride_ac, CA, da_ptr, NCA,  # first tensor (T, CA) -> (Tp, CA); NCA column programs
    b_ptr, stride_bt, stride_bc, CB, db_ptr,  # second tensor (T, CB) -> (Tp, CB)
    T, ends_ptr, block_starts_ptr, E, Tp,
    ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """:func:`_mx_grouped_tok_dq_kernel` of two tensors with the same tokens and experts
    (the two wgrad operands dY and X) in one launch: column programs 0 .. NCA - 1 take the
    first, the rest the second. One launch instead of two saves a launch and a tail wave."""
    pid_c = tl.program_id(0)
    blk0 = tl.program_id(1) * BLOCK_G
    if pid_c < NCA:
        _grouped_tok_dq_tile(a_ptr, stride_at, stride_ac, T, CA, ends_ptr, block_starts_ptr, E, da_ptr, Tp,
                             pid_c, blk0, ELEM, MODE, HW_ROUND, SOFT_CASTS, E_POW2, BLOCK_G, BLOCK_C)
    else:
        _grouped_tok_dq_tile(b_ptr, stride_bt, stride_bc, T, CB, ends_ptr, block_starts_ptr, E, db_ptr, Tp,
                             pid_c - NCA, blk0, ELEM, MODE, HW_ROUND, SOFT_CASTS, E_POW2, BLOCK_G, BLOCK_C)
