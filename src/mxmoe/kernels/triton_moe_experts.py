"""Triton kernels of the MXFP8 MoE expert block, each fused with the quantization next to it.

- ``_gather_fake_quant_rows_kernel``: token permute (gather of the routed rows) fused with
  the forward operand's quantize-dequantize along the model dim.
- ``_swiglu_fwd_kernel``: silu(gate) * up in float32, its MXFP8 quantize-dequantize along F
  (the second expert GEMM's operand), and the MXFP8 codes + E8M0 scales of gate and up
  (what the backward keeps instead of bf16), in one read of h.
- ``_swiglu_bwd_kernel``: from the saved codes of gate and up and d(act): d(gate), d(up)
  and the recomputed activation (for the second GEMM's weight gradient), in one pass; with
  ROW_DOT also each row's partial sums of act * d(act) (the router weights' gradient), with
  QUANT_DH also dh quantize-dequantized along 2F (the first GEMM's dgrad operand).
- ``_combine_rows_backward_kernel``: from d(y) of each token and its combine weights,
  d(outputs) written back in expert-sorted order (the scatter that undoes the unpermute),
  one read of d(y); the weights' gradient comes from the expert op's backward.
- ``_sum_token_rows_kernel``: each token's k rows summed in float32 in a fixed order (the
  expert op's dx, a gather instead of an atomic scatter-add: deterministic), optionally
  weighted (the combine of expert outputs).

Element and scale rules are those of :mod:`mxmoe.kernels.triton_quantize` (docs/NUMERICS.md);
the activation math is float32: silu(g) = g / (1 + exp(-g)).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_quantize import (_abs_bits, _decode_blocks, _dequantized, _from_float32, _quantize_values,
                              _row_block_scales, _scale_bits, _to_float32)


@triton.jit
def _tile_of(pid, n_cols, BLOCK_C: tl.constexpr):
    """(row tile, column tile) of program ``pid`` of a one-axis grid of n_row_tiles x
    n_col_tiles programs, column tiles fastest (consecutive programs read neighbouring
    columns of the same rows). One axis: CUDA allows 2^31 - 1 programs there, 65535 on
    the others."""
    n_cb = tl.cdiv(n_cols, BLOCK_C)
    rb = pid // n_cb
    return rb, pid - rb * n_cb


@triton.jit
def _row_blocks_qdq(x, ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """x (BLOCK_R, BLOCK_C) float32, blocks of 32 along C -> (codes uint8, scale bytes
    (BLOCK_R, BLOCK_C // 32) uint8, dequantized float32)."""
    e, nf, e_x, nf_x = _row_block_scales(_abs_bits(x), ELEM, MODE, BLOCK_R, BLOCK_C)
    r, codes = _quantize_values(x, e_x, nf_x, ELEM, HW_ROUND, True)
    return codes, _scale_bits(e, nf), _dequantized(r, e_x, nf_x)


@triton.jit
def _gather_fake_quant_rows_kernel(
    x_ptr, stride_x, src_ptr, A, D, out_ptr,  # x (T, D) rows; src (A,) int64 token of each row; out (A, D)
    ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rb, cb = _tile_of(tl.program_id(0), D, BLOCK_C)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (cb * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    row_ok = rows < A
    src = tl.load(src_ptr + rows, mask=row_ok, other=0)
    mask = row_ok[:, None] & (cols < D)[None, :]
    x = _to_float32(tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=mask, other=0.0), SOFT_CASTS)
    _, _, dq = _row_blocks_qdq(x, ELEM, MODE, HW_ROUND, BLOCK_R, BLOCK_C)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :],
             _from_float32(dq, out_ptr.dtype.element_ty, SOFT_CASTS), mask=mask)


@triton.jit
def _sigmoid(g):
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _swiglu_fwd_kernel(
    h_ptr, A, F,  # h (A, 2F) contiguous: gate = h[:, :F], up = h[:, F:]
    act_ptr,  # (A, F) dequantized MXFP8 of silu(gate) * up, blocks along F
    hq_ptr, hs_ptr,  # (A, 2F) codes of gate | up, (A, 2F / 32) scale bytes
    ELEM: tl.constexpr, MODE: tl.constexpr, HW_ROUND: tl.constexpr, SOFT_CASTS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rb, cb = _tile_of(tl.program_id(0), F, BLOCK_C)
    rows = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < A)[:, None] & (cols < F)[None, :]
    g_off = rows[:, None] * (2 * F) + cols[None, :]
    g = _to_float32(tl.load(h_ptr + g_off, mask=mask, other=0.0), SOFT_CASTS)
    u = _to_float32(tl.load(h_ptr + g_off + F, mask=mask, other=0.0), SOFT_CASTS)
    gq, gs, _ = _row_blocks_qdq(g, ELEM, MODE, HW_ROUND, BLOCK_R, BLOCK_C)
    uq, us, _ = _row_blocks_qdq(u, ELEM, MODE, HW_ROUND, BLOCK_R, BLOCK_C)
    tl.store(hq_ptr + g_off, gq, mask=mask)
    tl.store(hq_ptr + g_off + F, uq, mask=mask)
    scols = cb * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
    s_mask = (rows < A)[:, None] & (scols < F // 32)[None, :]
    s_off = rows[:, None] * (2 * F // 32) + scols[None, :]
    tl.store(hs_ptr + s_off, gs, mask=s_mask)
    tl.store(hs_ptr + s_off + F // 32, us, mask=s_mask)
    act = g * _sigmoid(g) * u
    _, _, act_dq = _row_blocks_qdq(act, ELEM, MODE, HW_ROUND, BLOCK_R, BLOCK_C)
    tl.store(act_ptr + rows[:, None] * F + cols[None, :], _from_float32(act_dq, act_ptr.dtype.element_ty, SOFT_CASTS),
             mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    hq_ptr, hs_ptr, dact_ptr, A, F,  # saved codes (A, 2F), scale bytes (A, 2F / 32); d(act) (A, F)
    dh_ptr, act_ptr,  # outputs: d(gate) | d(up) (A, 2F); recomputed act (A, F)
    dot_ptr,  # with ROW_DOT: (A, cdiv(F, BLOCK_C)) float32 partial sums of act * d(act) over this tile's columns
    dhq_ptr,  # with QUANT_DH: (A, 2F) dh rounded to dh's dtype, then MXFP8 quantize-dequantized along 2F
    ELEM: tl.constexpr, SOFT_CASTS: tl.constexpr, ROW_DOT: tl.constexpr, QUANT_DH: tl.constexpr,
    MODE: tl.constexpr, HW_ROUND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rb, cb = _tile_of(tl.program_id(0), F, BLOCK_C)
    rows = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < A)[:, None] & (cols < F)[None, :]
    g_off = rows[:, None] * (2 * F) + cols[None, :]
    scols = cb * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
    s_mask = (rows < A)[:, None] & (scols < F // 32)[None, :]
    s_off = rows[:, None] * (2 * F // 32) + scols[None, :]
    g = _decode_blocks(tl.load(hq_ptr + g_off, mask=mask, other=0), tl.load(hs_ptr + s_off, mask=s_mask, other=127),
                ELEM, SOFT_CASTS, BLOCK_R, BLOCK_C)
    u = _decode_blocks(tl.load(hq_ptr + g_off + F, mask=mask, other=0),
                tl.load(hs_ptr + s_off + F // 32, mask=s_mask, other=127), ELEM, SOFT_CASTS, BLOCK_R, BLOCK_C)
    da = _to_float32(tl.load(dact_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0), SOFT_CASTS)
    s = _sigmoid(g)
    silu = g * s
    dg = da * u * (s * (1.0 + g * (1.0 - s)))
    du = da * silu
    dt = dh_ptr.dtype.element_ty
    dg_r, du_r = _from_float32(dg, dt, SOFT_CASTS), _from_float32(du, dt, SOFT_CASTS)
    tl.store(dh_ptr + g_off, dg_r, mask=mask)
    tl.store(dh_ptr + g_off + F, du_r, mask=mask)
    if QUANT_DH:  # the dgrad operand: blocks of 32 along 2F lie within gate or within up (F % 32 == 0)
        _, _, dgq = _row_blocks_qdq(tl.where(mask, _to_float32(dg_r, SOFT_CASTS), 0.0), ELEM, MODE, HW_ROUND,
                                    BLOCK_R, BLOCK_C)
        _, _, duq = _row_blocks_qdq(tl.where(mask, _to_float32(du_r, SOFT_CASTS), 0.0), ELEM, MODE, HW_ROUND,
                                    BLOCK_R, BLOCK_C)
        tl.store(dhq_ptr + g_off, _from_float32(dgq, dt, SOFT_CASTS), mask=mask)
        tl.store(dhq_ptr + g_off + F, _from_float32(duq, dt, SOFT_CASTS), mask=mask)
    tl.store(act_ptr + rows[:, None] * F + cols[None, :],
             _from_float32(silu * u, act_ptr.dtype.element_ty, SOFT_CASTS), mask=mask)
    if ROW_DOT:
        n_cb = tl.cdiv(F, BLOCK_C)
        tl.store(dot_ptr + rows * n_cb + cb, tl.sum(tl.where(mask, silu * u * da, 0.0), axis=1), mask=rows < A)


@triton.jit
def _combine_rows_backward_kernel(
    dy_ptr, w_ptr, inv_ptr, T, D,  # dy (T, D); w (T, k) in dy's dtype; inv (A,) int64: sorted row of a = t * k + j
    dys_ptr,  # out (A, D), expert-sorted rows: d y_sorted[inv[a]] = round(dy[t] * w[t, j]), a = t * k + j
    TOPK: tl.constexpr, SOFT_CASTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rb, cb = _tile_of(tl.program_id(0), D, BLOCK_C)
    tok = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    tok_ok = tok < T
    mask = tok_ok[:, None] & (cols < D)[None, :]
    dt = dys_ptr.dtype.element_ty
    dy = _to_float32(tl.load(dy_ptr + tok[:, None] * D + cols[None, :], mask=mask, other=0.0), SOFT_CASTS)
    for j in tl.static_range(TOPK):
        a = tok * TOPK + j
        row = tl.load(inv_ptr + a, mask=tok_ok, other=0)
        w = _to_float32(tl.load(w_ptr + a, mask=tok_ok, other=0.0), SOFT_CASTS)
        tl.store(dys_ptr + row[:, None] * D + cols[None, :], _from_float32(dy * w[:, None], dt, SOFT_CASTS), mask=mask)


@triton.jit
def _sum_token_rows_kernel(
    x_ptr, rows_ptr, T, D,  # x (A, D); rows (T * k,) int64: the k rows of token t at rows[t * k:(t + 1) * k]
    w_ptr,  # (T, k) float32 weights of the rows (read only with HAS_W)
    out_ptr,  # (T, D): sum over j of [w[t, j] *] float32(x[rows[t * k + j]]) (each product rounded to x's
    # dtype with ROUND_PRODUCTS), j = 0..k-1 in order, rounded once
    TOPK: tl.constexpr, HAS_W: tl.constexpr, ROUND_PRODUCTS: tl.constexpr, SOFT_CASTS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rb, cb = _tile_of(tl.program_id(0), D, BLOCK_C)
    tok = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    tok_ok = tok < T
    mask = tok_ok[:, None] & (cols < D)[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        row = tl.load(rows_ptr + tok * TOPK + j, mask=tok_ok, other=0)
        v = _to_float32(tl.load(x_ptr + row[:, None] * D + cols[None, :], mask=mask, other=0.0), SOFT_CASTS)
        if HAS_W:
            v = v * tl.load(w_ptr + tok * TOPK + j, mask=tok_ok, other=0.0)[:, None]
            if ROUND_PRODUCTS:  # each product rounded to x's dtype first, as (y * w) in that dtype
                v = _to_float32(_from_float32(v, x_ptr.dtype.element_ty, SOFT_CASTS), SOFT_CASTS)
        acc += v
    tl.store(out_ptr + tok[:, None] * D + cols[None, :], _from_float32(acc, out_ptr.dtype.element_ty, SOFT_CASTS),
             mask=mask)
