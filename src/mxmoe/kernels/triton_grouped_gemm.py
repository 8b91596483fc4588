"""Triton MXFP8 grouped GEMMs for sm90: FP8 bytes from memory, scales applied in the main loop.

The three expert GEMMs of an MoE layer (docs/NUMERICS.md, "Quantizing for training"), each
operand FP8 E4M3 codes plus one E8M0 scale byte per 32 values along the contraction dim:

    forward  out[t] = x[t] w[e]^T      x (T, Kc), w (E, N, Kc)       both blocked along Kc
    dgrad    dx[t]  = dy[t] w[e]       dy (T, Nc), w^T (E, K, Nc)    the column-wise copy of w
    wgrad    dw[e]  = dy_e^T x_e       dy^T (N, Lp), x^T (K, Lp)     per-expert padded tokens

Both operands of every GEMM are stored "K-major" (contiguous along the contraction), so one
kernel, ``_mx_grouped_gemm_nt_kernel``, serves the forward and dgrad (groups of rows given
by cumulative offsets), and ``_mx_grouped_gemm_tn_kernel`` the wgrad (groups along the
contraction, one (N, K) output per expert).

How the scales are applied. Hopper has no block-scaled tensor core, so each loaded tile of
codes (BLOCK_M x BLOCK_K bytes) and its scale bytes (BLOCK_M x BLOCK_K / 32) are decoded
to float32, multiplied by 2^(b - 127) (exact: a power of two), rounded to bfloat16 (exact
while the value lies in bfloat16's normal range, see below) and fed to a bfloat16
``tl.dot`` with float32 accumulation. The tensor core then computes the exact MXFP8
products; only the float32 accumulation order differs from any other exact GEMM.

Exactness bound. An E4M3 value times 2^s has at most 4 significant bits, so it is exact
in bfloat16 (8-bit exponent like float32) when its magnitude lies in [2^-126, 2^128).
Outside: a scale byte b <= 9 can give magnitudes below 2^-126, rounded (nearest even) to
bfloat16's subnormal grid, the same rounding the emulated path (dequantize to bf16, then
``torch._grouped_mm``) applies; b >= 247 can overflow to +-inf, as float32 dequantization
does. rceil scales of float32 data never exceed b = 246 except within one element step of
float32's largest value (docs in :func:`mxmoe.quantize_mx`).

Tile schedule (no host synchronization). Every program reads the (E,) offsets, forms
groups 0..E-1 (the experts) plus group E = rows [offsets[-1], T) (written as zeros, never
read), counts each group's row tiles and walks tile ids ``pid, pid + P, ...`` up to the
total (a persistent grid when P is the SM count, a plain grid when P is the static bound
(T // BLOCK_M + E + 1) * n_col_tiles). A tile id maps to (group, row tile, column tile):

- supergrouped (``group_m > 1``): experts one after another; inside an expert, tiles go in
  bands of ``group_m`` row tiles, column by column (the GROUP_SIZE_M order of the Triton
  matmul tutorial), so the tiles in flight cover a compact block of one or two experts
  and their A rows and B columns stay in L2;
- row-major (``group_m = 1``): experts one after another, each expert row tile by row tile
  (the supergrouping switched off, experts still contiguous);
- spread (``spread = 1``): the order of a naive 2-D launch, column tile outermost and the
  row tiles of all experts inside (forward/dgrad), or experts innermost (wgrad): the tiles
  in flight span many experts.

All orders compute every tile the same way, so their results are bitwise identical.

Under ``TRITON_INTERPRET=1`` (CPU tests) codes are decoded from their bits and the dot
runs in float32 (the interpreter's bfloat16 dot multiplies raw bit patterns); the values
entering the dot are the same bfloat16-exact numbers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_quantize import (_abs_bits, _col_block_scales, _dequantized, _from_float32, _quantize_values,
                              _to_float32)

BLOCK = 32  # the MX block size
# Decoding of E4M3 codes (constexpr DEQUANT): all exact, they differ in instruction mix.
DEQUANT_CVT = 0  # hardware float8 -> float32 conversion, float32 scale multiply, round to bf16
DEQUANT_BITS = 1  # integer bit placement (E4M3 bits into a float32) and two float32 multiplies
DEQUANT_CVT_BF16 = 2  # hardware float8 -> bfloat16 conversion, bfloat16 scale multiply

TWO_POW_120 = tl.constexpr(2.0 ** 120)


@triton.jit
def _e8m0_to_f32(sbytes):
    """E8M0 scale bytes (any int type) -> float32 2^(b - 127); b = 0 is the float32
    subnormal 2^-127, b = 255 is NaN (docs/NUMERICS.md)."""
    b = sbytes.to(tl.int32)
    bits = tl.where(b == 0, 0x400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_e4m3(codes, DEQUANT: tl.constexpr):
    """E4M3 codes (uint8) -> float32 values, exact (NaN for S.1111.111)."""
    if DEQUANT == 1:
        # E4M3 bits S.EEEE.MMM placed as float32 S.0000EEEE.MMM0...: value * 2^-120,
        # subnormals included (they land on float32 subnormals), then * 2^120 exactly
        c = codes.to(tl.int32)
        bits = ((c & 0x7F) << 20) | ((c & 0x80) << 24)
        v = bits.to(tl.float32, bitcast=True) * TWO_POW_120
        return tl.where((c & 0x7F) == 0x7F, float("nan"), v)
    else:
        return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_tile(codes, sbytes, R: tl.constexpr, C: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  DEQUANT: tl.constexpr, SCALE_GATHER: tl.constexpr):
    """E4M3 codes (R, C) uint8 with scale bytes, blocks of 32 along C -> values (R, C) in
    DOT_DTYPE: code value * 2^(b - 127), exact (see the module docs). The scale bytes are
    (R, C // 32), broadcast over each block through a 3-D view, or with SCALE_GATHER
    already (R, C) (each element's own scale byte, loaded by address)."""
    scale = _e8m0_to_f32(sbytes)
    if DEQUANT == 2:
        v = codes.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        if SCALE_GATHER:
            return (v * scale.to(tl.bfloat16)).to(DOT_DTYPE)
        else:
            v = tl.reshape(v, (R, C // 32, 32)) * scale.to(tl.bfloat16)[:, :, None]
            return tl.reshape(v, (R, C)).to(DOT_DTYPE)
    else:
        v = _decode_e4m3(codes, DEQUANT)
        if SCALE_GATHER:
            return (v * scale).to(DOT_DTYPE)
        else:
            v = tl.reshape(v, (R, C // 32, 32)) * scale[:, :, None]
            return tl.reshape(v, (R, C)).to(DOT_DTYPE)


@triton.jit
def _dot(a, b_t, acc, DOT_DTYPE: tl.constexpr):
    """acc + a @ b_t^T. float32 operands (interpreter) in full precision, never tf32."""
    if DOT_DTYPE == tl.float32:
        return tl.dot(a, tl.trans(b_t), acc, input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b_t), acc)


@triton.jit
def _mx_dot_step(acc, a_ptrs, sa_ptrs, b_ptrs, sb_ptrs, row_ok, col_ok, k_ok, s_ok,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 DEQUANT: tl.constexpr, SCALE_GATHER: tl.constexpr):
    """One step of the K loop: acc + A_tile @ B_tile^T, A codes (BLOCK_M, BLOCK_K) and B codes
    (BLOCK_N, BLOCK_K) with their scale bytes loaded where row_ok (BLOCK_M,) / col_ok
    (BLOCK_N,) and, along K, k_ok (codes) / s_ok (scales) hold (None: the whole K tile);
    masked codes read 0, masked scales 127 (2^0). Dequantized in registers."""
    if k_ok is None:
        a_ok = row_ok[:, None]
        sa_ok = row_ok[:, None]
        b_ok = col_ok[:, None]
        sb_ok = col_ok[:, None]
    else:
        a_ok = row_ok[:, None] & k_ok[None, :]
        sa_ok = row_ok[:, None] & s_ok[None, :]
        b_ok = col_ok[:, None] & k_ok[None, :]
        sb_ok = col_ok[:, None] & s_ok[None, :]
    a = tl.load(a_ptrs, mask=a_ok, other=0)
    sa = tl.load(sa_ptrs, mask=sa_ok, other=127)
    b = tl.load(b_ptrs, mask=b_ok, other=0)
    sb = tl.load(sb_ptrs, mask=sb_ok, other=127)
    a_v = _dequant_tile(a, sa, BLOCK_M, BLOCK_K, DOT_DTYPE, DEQUANT, SCALE_GATHER)
    b_v = _dequant_tile(b, sb, BLOCK_N, BLOCK_K, DOT_DTYPE, DEQUANT, SCALE_GATHER)
    return _dot(a_v, b_v, acc, DOT_DTYPE)


@triton.jit
def _swizzle(local, n_rows, n_cols, group_m):
    """Tile ``local`` of an (n_rows x n_cols) tile grid in bands of ``group_m`` rows, each
    band column by column (group_m = 1: row-major). Returns (row tile, column tile)."""
    width = group_m * n_cols
    first = (local // width) * group_m
    band = tl.minimum(n_rows - first, group_m)
    in_band = local % width
    return first + in_band % band, in_band // band


@triton.jit
def _row_groups(offs_ptr, T, E, G_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """The row groups of a grouped GEMM over tokens, from the (E,) cumulative ends: groups
    0..E-1 are the experts (rows clamped to [0, T]), group E the rows [offsets[-1], T) (written as
    zeros, never read), groups beyond are empty. Returns (g, starts, ends, row_tiles,
    cum_rows (inclusive), total_rows): per-group vectors of length G_POW2 and the total."""
    g = tl.arange(0, G_POW2)
    is_expert = g < E
    # offsets clamped into [0, T]: rows outside x are never read or written, whatever the offsets
    ends = tl.where(is_expert, tl.minimum(tl.maximum(tl.load(offs_ptr + g, mask=is_expert, other=0), 0), T), T)
    has_prev = (g > 0) & (g <= E)
    starts = tl.where(has_prev, tl.minimum(tl.maximum(tl.load(offs_ptr + g - 1, mask=has_prev, other=0), 0), T), 0)
    starts = tl.where(g > E, T, starts)
    sizes = tl.maximum(ends - starts, 0)
    row_tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    cum_rows = tl.cumsum(row_tiles, 0)
    return g, starts, ends, row_tiles, cum_rows, tl.sum(row_tiles, 0)


@triton.jit
def _group_tile(tile, g, row_tiles, cum_rows, col_tiles, group_m):
    """Tile id -> (group, row tile in the group, column tile): group by group, inside a
    group bands of group_m row tiles (:func:`_swizzle`)."""
    grp = tl.sum((cum_rows * col_tiles <= tile).to(tl.int32), 0)
    local = tile - tl.sum(tl.where(g == grp, cum_rows - row_tiles, 0), 0) * col_tiles
    row, col = _swizzle(local, tl.sum(tl.where(g == grp, row_tiles, 0), 0), col_tiles, group_m)
    return grp, row, col


@triton.jit
def _tile_rows_cols(grp, row, col, g, starts, ends, E, k_tiles, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Output tile (group, row tile, column tile) -> (expert as int64, K steps (0 for the
    tail group, which reads nothing and writes zeros), rows and columns as int64, their
    in-bounds masks: rows inside the group, columns below N)."""
    row_start = tl.sum(tl.where(g == grp, starts, 0), 0)
    row_end = tl.sum(tl.where(g == grp, ends, 0), 0)
    e = tl.minimum(grp, E - 1).to(tl.int64)
    n_k = tl.where(grp < E, k_tiles, 0)
    rows = row_start + row * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, n_k, rows.to(tl.int64), cols.to(tl.int64), rows < row_end, cols < N


@triton.jit(do_not_specialize=["group_m", "spread"])
def _mx_grouped_gemm_nt_kernel(
    a_ptr, sa_ptr,  # A codes (T, Kc) uint8, scales (T, Kc / 32)
    b_ptr, sb_ptr,  # B codes (E, N, Kc) uint8, scales (E, N, Kc / 32)
    out_ptr,  # (T, N), rows past the last offset written as zeros
    offs_ptr,  # (E,) int32 cumulative row ends
    T, N, Kc, E, group_m, spread,
    G_POW2: tl.constexpr,  # next power of two >= E + 1 (the experts and the tail group)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DEQUANT: tl.constexpr, SCALE_GATHER: tl.constexpr, DOT_DTYPE: tl.constexpr, SOFT_CASTS: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """out[t, n] = sum_k A[t, k] B[e(t), n, k], both dequantized in registers."""
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    col_tiles = tl.cdiv(N, BLOCK_N)
    g, starts, ends, row_tiles, cum_rows, total_rows = _row_groups(offs_ptr, T, E, G_POW2, BLOCK_M)
    k_tiles = tl.cdiv(Kc, BLOCK_K)
    scale_cols = Kc // 32

    for tile in range(pid, total_rows * col_tiles, n_progs):
        if spread:  # column tile outermost, the row tiles of every group inside
            col = tile // total_rows
            global_row = tile - col * total_rows
            grp = tl.sum((cum_rows <= global_row).to(tl.int32), 0)
            row = global_row - tl.sum(tl.where(g == grp, cum_rows - row_tiles, 0), 0)
        else:  # group by group; inside a group bands of group_m row tiles
            grp, row, col = _group_tile(tile, g, row_tiles, cum_rows, col_tiles, group_m)
        e, n_k, rows64, cols64, row_ok, col_ok = _tile_rows_cols(grp, row, col, g, starts, ends, E, k_tiles, N,
                                                                 BLOCK_M, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        if SCALE_GATHER:  # one scale byte per element, (BLOCK, BLOCK_K)
            ss = ks // 32
        else:  # one per block, (BLOCK, BLOCK_K // 32)
            ss = tl.arange(0, BLOCK_K // 32)
        a_ptrs = a_ptr + rows64[:, None] * Kc + ks[None, :]
        sa_ptrs = sa_ptr + rows64[:, None] * scale_cols + ss[None, :]
        b_ptrs = b_ptr + (e * N + cols64)[:, None] * Kc + ks[None, :]
        sb_ptrs = sb_ptr + (e * N + cols64)[:, None] * scale_cols + ss[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(0, n_k):
            if EVEN_K:
                acc = _mx_dot_step(acc, a_ptrs, sa_ptrs, b_ptrs, sb_ptrs, row_ok, col_ok, None, None,
                                   BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, DEQUANT, SCALE_GATHER)
            else:
                k_ok = kt * BLOCK_K + ks < Kc
                s_ok = kt * (BLOCK_K // 32) + ss < scale_cols
                acc = _mx_dot_step(acc, a_ptrs, sa_ptrs, b_ptrs, sb_ptrs, row_ok, col_ok, k_ok, s_ok,
                                   BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, DEQUANT, SCALE_GATHER)
            a_ptrs += BLOCK_K
            sa_ptrs += BLOCK_K // 32
            b_ptrs += BLOCK_K
            sb_ptrs += BLOCK_K // 32
        out = _from_float32(acc, out_ptr.dtype.element_ty, SOFT_CASTS)
        tl.store(out_ptr + rows64[:, None] * N + cols64[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["group_m", "spread"])
def _mx_grouped_gemm_tn_kernel(
    a_ptr, sa_ptr,  # A codes (M, Lp) uint8 (dy^T), scales (M, Lp / 32)
    b_ptr, sb_ptr,  # B codes (N, Lp) uint8 (x^T), scales (N, Lp / 32)
    out_ptr,  # (E, M, N)
    poffs_ptr,  # (E,) int32 cumulative ends along Lp, multiples of 32
    M, N, Lp, E, group_m, spread,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DEQUANT: tl.constexpr, SCALE_GATHER: tl.constexpr, DOT_DTYPE: tl.constexpr, SOFT_CASTS: tl.constexpr,
):
    """out[e, m, n] = sum over l in expert e's padded token range of A[m, l] B[n, l]."""
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    row_tiles = tl.cdiv(M, BLOCK_M)
    col_tiles = tl.cdiv(N, BLOCK_N)
    per_expert = row_tiles * col_tiles
    scale_cols = Lp // 32
    for tile in range(pid, E * per_expert, n_progs):
        if spread:  # experts innermost: the tiles in flight span every expert
            e = tile % E
            local = tile // E
            row = local // col_tiles
            col = local % col_tiles
        else:
            e = tile // per_expert
            row, col = _swizzle(tile - e * per_expert, row_tiles, col_tiles, group_m)
        l_end = tl.minimum(tl.load(poffs_ptr + e), Lp)
        l_start = tl.where(e > 0, tl.minimum(tl.load(poffs_ptr + tl.maximum(e - 1, 0)), Lp), 0)
        l_start = tl.multiple_of(l_start, 32)
        n_k = tl.cdiv(tl.maximum(l_end - l_start, 0), BLOCK_K)  # 0 for an empty expert: zeros
        block_end = l_end // 32

        rows = row * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = col * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        rows64 = rows.to(tl.int64)
        cols64 = cols.to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        if SCALE_GATHER:
            ss = ks // 32
        else:
            ss = tl.arange(0, BLOCK_K // 32)
        a_ptrs = a_ptr + rows64[:, None] * Lp + (l_start + ks)[None, :]
        sa_ptrs = sa_ptr + rows64[:, None] * scale_cols + (l_start // 32 + ss)[None, :]
        b_ptrs = b_ptr + cols64[:, None] * Lp + (l_start + ks)[None, :]
        sb_ptrs = sb_ptr + cols64[:, None] * scale_cols + (l_start // 32 + ss)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(0, n_k):
            k_ok = l_start + kt * BLOCK_K + ks < l_end
            s_ok = l_start // 32 + kt * (BLOCK_K // 32) + ss < block_end
            acc = _mx_dot_step(acc, a_ptrs, sa_ptrs, b_ptrs, sb_ptrs, row_ok, col_ok, k_ok, s_ok,
                               BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, DEQUANT, SCALE_GATHER)
            a_ptrs += BLOCK_K
            sa_ptrs += BLOCK_K // 32
            b_ptrs += BLOCK_K
            sb_ptrs += BLOCK_K // 32
        out = _from_float32(acc, out_ptr.dtype.element_ty, SOFT_CASTS)
        tl.store(out_ptr + (e.to(tl.int64) * M + rows64)[:, None] * N + cols64[None, :], out,
                 mask=row_ok[:, None] & col_ok[None, :])


# ---- design (c): the weight quantized inside the GEMM's operand load ----------------------

@triton.jit
def _fake_quantize_k(w, ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr,
                     SOFT_CASTS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """A raw weight tile w (BLOCK_K, BLOCK_N) (bf16 or float32), quantized to MX along axis 0
    (the contraction) in blocks of 32 and dequantized: float32 values, bit for bit the
    values the row/column quantizers of :mod:`mxmoe.kernels.triton_quantize` write
    (the same scale and rounding helpers)."""
    x = _to_float32(w, SOFT_CASTS)
    _, _, e_x, nf_x = _col_block_scales(_abs_bits(x), ELEM, MODE, BLOCK_K, 32, BLOCK_N)
    r, _ = _quantize_values(x, e_x, nf_x, ELEM, HW_ROUND, False)
    return _dequantized(r, e_x, nf_x)


@triton.jit(do_not_specialize=["group_m"])
def _mx_grouped_gemm_wq_kernel(
    a_ptr,  # (T, Kc) bf16: the activation, already quantized along Kc and dequantized
    w_ptr,  # raw weight, w[e, n, k] at w_ptr + e * stride_we + n * stride_wn + k * stride_wk
    out_ptr,  # (T, N), rows past the last offset written as zeros
    offs_ptr,  # (E,) int32 cumulative row ends
    T, N, Kc, E, stride_we, stride_wn, stride_wk, group_m,
    G_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr,
):
    """out[t, n] = sum_k a[t, k] Q(w[e(t), n, :])[k]: each (BLOCK_K, BLOCK_N) weight tile is
    read raw, quantized along k (blocks of 32 from k = 0) and dequantized in registers, then
    fed to the dot. One program per output tile (the static bound of the nt kernel)."""
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(N, BLOCK_N)
    g, starts, ends, row_tiles, cum_rows, total_rows = _row_groups(offs_ptr, T, E, G_POW2, BLOCK_M)
    if pid < total_rows * col_tiles:
        grp, row, col = _group_tile(pid, g, row_tiles, cum_rows, col_tiles, group_m)
        e, n_k, rows64, cols64, row_ok, col_ok = _tile_rows_cols(grp, row, col, g, starts, ends, E,
                                                                 tl.cdiv(Kc, BLOCK_K), N, BLOCK_M, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows64[:, None] * Kc + ks[None, :]
        w_ptrs = w_ptr + e * stride_we + cols64[None, :] * stride_wn + ks.to(tl.int64)[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(0, n_k):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = kt * BLOCK_K + ks < Kc
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            # rounded to bf16 as the quantize passes write it (exact but below 2^-126)
            wq = _from_float32(_fake_quantize_k(w, ELEM, MODE, HW_ROUND, SOFT_CASTS, BLOCK_K, BLOCK_N),
                               tl.bfloat16, SOFT_CASTS)
            if DOT_DTYPE == tl.float32:  # the interpreter: float32 values of the same bf16 numbers
                acc = tl.dot(_to_float32(a, SOFT_CASTS), _to_float32(wq, SOFT_CASTS), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, wq, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        out = _from_float32(acc, out_ptr.dtype.element_ty, SOFT_CASTS)
        tl.store(out_ptr + rows64[:, None] * N + cols64[None, :], out, mask=row_ok[:, None] & col_ok[None, :])
