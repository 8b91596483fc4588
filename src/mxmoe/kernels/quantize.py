"""Host side of the Triton MX quantization kernels, registered as ``torch.library`` custom
ops (``torch.ops.mxmoe.*``) so that autograd and ``torch.compile`` see them as single ops.

Ops (FP8 elements only: fmt "e4m3" or "e5m2"; mode "rceil" or "floor"; block size 32), and
the library function that calls each:

| op | input | outputs | called by |
|---|---|---|---|
| ``quantize_along_dim`` | x (any rank), dim | codes (x's shape), scales (dim divided by 32) | ``ops.quantize.quantize_mx`` |
| ``dequantize_rowwise`` | codes (..., K), scales (..., K / 32) | values (..., K) in bf16 or float32 | ``ops.quantize.dequantize_mx`` |
| ``dequantize_colwise`` | codes (K, M), scales (K, M / 32) | values (M, K): the transposed copy back | ``ops.moe_experts`` (wgrad operand) |
| ``fake_quantize_along_dim`` | x, dim | dequantize(quantize(x along dim)) in one pass | ``ops.quantize.fake_quantize_mx`` |
| ``fake_quantize_rowcol`` | x (T, C) or (E, N, K) | both fake quantizations (last dim, the one before) from one read | ``ops.quantize.fake_quantize_rowcol`` |
| ``quantize_grouped_colwise`` | x (T, C), offsets (E,) | codes (C, Tp), scales (C, Tp / 32), padded offsets (E,) | ``ops.sm100`` (wgrad operands) |
| ``fake_quantize_grouped_colwise`` | x (T, C), offsets | dequantized (Tp, C) (not transposed), padded offsets | ``ops.quantize.fake_quantize_grouped_tokens`` |
| ``fake_quantize_grouped_colwise_pair`` | a (T, CA), b (T, CB), offsets | both of the above in one launch | ``ops.quantize.fake_quantize_grouped_tokens_pair`` |

Inputs may have any strides; sizes along a blocked dimension must be multiples of 32
(``pad=True`` zero-pads where an op offers it).

The kernels run on CUDA tensors; on CPU tensors only under ``TRITON_INTERPRET=1`` (the
Triton interpreter, used by the CPU tests).
"""

from __future__ import annotations

import math
import os

import torch
import triton
from torch import Tensor

from ..numerics.formats import ElemFormat, ScaleMode
from ..numerics.grouped import padded_group_layout
from . import triton_quantize as tk

FP8_FORMATS = {"e4m3": (tk.ELEM_E4M3, torch.float8_e4m3fn), "e5m2": (tk.ELEM_E5M2, torch.float8_e5m2)}
MODES = {"floor": tk.MODE_FLOOR, "rceil": tk.MODE_RCEIL}
_INPUT_DTYPES = (torch.float32, torch.bfloat16)
_DQ_DTYPES = (torch.float32, torch.bfloat16)
BLOCK = tk.BLOCK
# Launch settings on the GPU: tiles and warps measured on the H200 at 16384 x 8192 (the
# interpreter takes large tiles instead, _TILE_INTERPRETER). On the GPU the kernels round
# with the float8 conversion instruction and make codes four at a time in PTX
# (triton_quantize's HW_ROUND); the interpreter rounds in float32 arithmetic.
TUNING = {
    "rows": {"block_b": 128, "num_warps": 8},  # contiguous row-wise input: (n_blocks, 32) view, _mx_rows_kernel
    "rowwise": {"tile": (32, 128), "num_warps": 2},  # strided or padded row-wise input: _mx_tile_kernel
    "colwise": {"tile": (32, 128), "num_warps": 2},  # column-wise (and row + column) codes or values: _mx_tile_kernel
    "dequant": {"tile": (32, 128), "num_warps": 4},
    # dequantize_colwise (transposed output): checked bit for bit on the H200 at this tile
    "dequant_t": {"tile": (64, 64), "num_warps": 4},
    # grouped column-wise codes (with or without the fused token gather) through
    # _mx_grouped_col_t8_kernel: block_t tokens (a power of two, at least 32) x block_c columns
    # per program
    "grouped": {"block_t": 256, "block_c": 64, "num_warps": 8},
    # dequantized values along each expert's tokens (the wgrad operand) through
    # _mx_grouped_tok_dq_kernel: block_g 32-token blocks x block_c columns per program (8 x 64
    # with 8 warps ran at 93% of a copy's bandwidth on the H200; 128 columns or one warp per
    # 32-row block were slower)
    "grouped_tok": {"block_g": 8, "block_c": 64, "num_warps": 8},
}
# Under the interpreter every program costs a fixed overhead: large tiles, few programs.
_TILE_INTERPRETER = (64, 256)
_GROUPED_TOK_INTERPRETER_G = 2  # 32-token blocks per program of the grouped dequantized kernel


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (env TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _codes(fmt: str, mode: str) -> tuple[int, torch.dtype, int]:
    fmt = ElemFormat.parse(fmt).value
    mode = ScaleMode.parse(mode).value
    if fmt not in FP8_FORMATS:
        raise ValueError(f"the Triton kernels cover the FP8 formats 'e4m3' and 'e5m2', not {fmt!r}; "
                         f"use backend='reference' for it")
    elem, dtype = FP8_FORMATS[fmt]
    return elem, dtype, MODES[mode]


def _check_tensor(x: Tensor, name: str = "x") -> None:
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; the Triton quantizers take float32 or bfloat16")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name} is on {x.device}: the Triton kernels need a CUDA tensor "
                         f"(or TRITON_INTERPRET=1 for the CPU interpreter); use backend='reference'")


def _check_blocked_dim(size: int, what: str, pad: bool) -> int:
    """The padded size of a blocked dimension; ValueError if it needs padding and ``pad`` is False."""
    if size % BLOCK and not pad:
        raise ValueError(f"{what} is {size}, not a multiple of the block size {BLOCK}; "
                         f"zero-pad it to {_ceil_to(size, BLOCK)} or pass pad=True")
    return _ceil_to(size, BLOCK)


def _launch_settings(kind: str) -> dict:
    """TUNING for ``kind`` with the kernels' rounding switches: on the GPU ``hw_round``
    (the float8 conversion instruction, codes in PTX) and exact hardware casts; under the
    interpreter large tiles, float32-arithmetic rounding (its float8 cast does not break
    ties to even) and exact bit-level casts (``soft_casts``: its own casts flush bfloat16
    subnormals)."""
    if interpreting():
        return {"tile": _TILE_INTERPRETER, "block_t": _TILE_INTERPRETER[0], "block_c": _TILE_INTERPRETER[1],
                "block_b": 256, "num_warps": 4, "hw_round": False, "soft_casts": True}
    return {"hw_round": True, "soft_casts": False, **TUNING[kind]}


CUDA_GRID_YZ_MAX = 65535  # programs along grid axes 1 and 2 (axis 0: 2^31 - 1)


def _grid(*dims: int, what: str) -> tuple[int, ...]:
    """A launch grid, checked: CUDA caps axes 1 and 2 at 65535 programs and answers a
    larger launch with "invalid argument" (the interpreter has no cap). Raises ValueError
    naming the kernel and the count instead."""
    for axis, n in enumerate(dims[1:], 1):
        if n > CUDA_GRID_YZ_MAX:
            raise ValueError(f"{what}: {n} programs along grid axis {axis}, over CUDA's limit of "
                             f"{CUDA_GRID_YZ_MAX}; split the input into smaller calls")
    return dims


def launch_tile(
    x3: Tensor, fmt: str, mode: str, *, rowwise: bool, colwise: bool, write_q: bool = True,
    dq_dtype: torch.dtype | None = None, pad: bool = False,
) -> dict[str, Tensor]:
    """Quantize x3 (B, R, C, any strides) row-wise (blocks along C) and/or column-wise
    (blocks along R, written in place, not transposed) from one read: ``_mx_rows_kernel``
    for contiguous row-wise-only jobs, ``_mx_tile_kernel`` otherwise. Returns the outputs
    asked for by name: codes and scales ``q_row`` (B, R, Cp) / ``s_row`` (B, R, Cp / 32) and
    ``q_col`` (B, Rp, C) / ``s_col`` (B, Rp / 32, C) if ``write_q``; dequantized values
    ``dq_row`` / ``dq_col`` (B, R, C) in ``dq_dtype`` if given. Rp, Cp: R, C rounded up to
    32 (``pad``; ValueError otherwise)."""
    _check_tensor(x3)
    elem, q_dtype, mode_code = _codes(fmt, mode)
    B, R, C = x3.shape
    Cp = _check_blocked_dim(C, "the row length (blocked dim of the row-wise copy)", pad) if rowwise else C
    Rp = _check_blocked_dim(R, "the column length (blocked dim of the column-wise copy)", pad) if colwise else R
    dev = x3.device
    out: dict[str, Tensor] = {}
    u8 = torch.uint8
    dummy = torch.empty(1, dtype=u8, device=dev)
    q_row = s_row = dq_row = q_col = s_col = dq_col = dummy
    if rowwise:
        if write_q:
            q_row = out["q_row"] = torch.empty(B, R, Cp, dtype=u8, device=dev)
            s_row = out["s_row"] = torch.empty(B, R, Cp // BLOCK, dtype=u8, device=dev)
        if dq_dtype is not None:
            dq_row = out["dq_row"] = torch.empty(B, R, C, dtype=dq_dtype, device=dev)
    if colwise:
        if write_q:
            q_col = out["q_col"] = torch.empty(B, Rp, C, dtype=u8, device=dev)
            s_col = out["s_col"] = torch.empty(B, Rp // BLOCK, C, dtype=u8, device=dev)
        if dq_dtype is not None:
            dq_col = out["dq_col"] = torch.empty(B, R, C, dtype=dq_dtype, device=dev)
    flat_rows = rowwise and not colwise and Cp == C and x3.is_contiguous()
    if B and R and C and flat_rows:
        cfg = _launch_settings("rows")
        n_blocks = B * R * (C // BLOCK)
        tk._mx_rows_kernel[(triton.cdiv(n_blocks, cfg["block_b"]),)](
            x3, n_blocks, q_row, s_row, dq_row,
            ELEM=elem, MODE=mode_code, WRITE_Q=write_q, WRITE_DQ=dq_dtype is not None,
            HW_ROUND=cfg["hw_round"], SOFT_CASTS=cfg["soft_casts"], BLOCK_B=cfg["block_b"],
            num_warps=cfg["num_warps"],
        )
    elif B and R and C:
        cfg = _launch_settings("colwise" if colwise else "rowwise")
        block_r, block_c = cfg["tile"]
        grid = _grid(triton.cdiv(Cp, block_c), triton.cdiv(Rp, block_r), B, what="tile quantizer (rows, matrices)")
        tk._mx_tile_kernel[grid](
            x3, x3.stride(0), x3.stride(1), x3.stride(2), R, C,
            q_row, s_row, dq_row, q_col, s_col, dq_col, Rp, Cp,
            ELEM=elem, MODE=mode_code, ROWWISE=rowwise, COLWISE=colwise,
            WRITE_Q=write_q, WRITE_DQ=dq_dtype is not None, HW_ROUND=cfg["hw_round"],
            SOFT_CASTS=cfg["soft_casts"], BLOCK_R=block_r, BLOCK_C=block_c, num_warps=cfg["num_warps"],
        )
    for k in ("q_row", "q_col"):
        if k in out:
            out[k] = out[k].view(q_dtype)
    for k in ("s_row", "s_col"):
        if k in out:
            out[k] = out[k].view(torch.float8_e8m0fnu)
    return out


def launch_along_dim(x: Tensor, dim: int, fmt: str, mode: str, *, write_q: bool = True,
                     dq_dtype: torch.dtype | None = None, pad: bool = False) -> dict[str, Tensor]:
    """Quantize any-rank ``x`` with blocks along ``dim`` (non-negative), outputs in x's
    layout: x is seen as (P, L, S) with L = x.shape[dim]; S == 1 goes row-wise, else
    column-wise without transposing. Returns ``q`` (padded shape) and ``s`` (scale shape:
    padded shape with ``dim`` divided by 32) if ``write_q``, and ``dq`` (x's shape) if
    ``dq_dtype``."""
    shape = x.shape
    P, L, S = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])
    if S == 1:
        out = launch_tile(x.reshape(1, P, L), fmt, mode, rowwise=True, colwise=False, write_q=write_q,
                          dq_dtype=dq_dtype, pad=pad)
        q, s, dq = out.get("q_row"), out.get("s_row"), out.get("dq_row")
    else:
        out = launch_tile(x.reshape(P, L, S), fmt, mode, rowwise=False, colwise=True, write_q=write_q,
                          dq_dtype=dq_dtype, pad=pad)
        q, s, dq = out.get("q_col"), out.get("s_col"), out.get("dq_col")
    padded = list(shape)
    padded[dim] = _ceil_to(L, BLOCK)
    scale_shape = list(padded)
    scale_shape[dim] //= BLOCK
    result = {}
    if write_q:
        result["q"], result["s"] = q.view(padded), s.view(scale_shape)
    if dq_dtype is not None:
        result["dq"] = dq.view(shape)
    return result


@torch.library.custom_op("mxmoe::quantize_along_dim", mutates_args=())
def quantize_along_dim(x: Tensor, dim: int, fmt: str = "e4m3", mode: str = "rceil",
                       pad: bool = False) -> tuple[Tensor, Tensor]:
    """:func:`launch_along_dim`'s codes and scales as a custom op (what
    :func:`mxmoe.ops.quantize.quantize_mx` runs on the Triton backend). x any rank, dim
    non-negative; returns codes (x's shape, dim padded to 32) FP8 and scales (that shape
    with dim divided by 32) E8M0.

    Raises:
        ValueError: dim outside 0..x.dim() - 1; x.shape[dim] not a multiple of 32 and pad
            False; fmt not an FP8 format. TypeError: x not float32/bfloat16."""
    _along_dim_checks(x, dim, fmt, mode, pad)
    out = launch_along_dim(x, dim, fmt, mode, pad=pad)
    return out["q"], out["s"]


def _along_dim_checks(x: Tensor, dim: int, fmt: str, mode: str, pad: bool) -> None:
    """The argument rules of :func:`quantize_along_dim`, shared by its real and fake impls."""
    _check_tensor(x)
    _codes(fmt, mode)
    if not 0 <= dim < x.dim():
        raise ValueError(f"dim={dim} for a {x.dim()}-d tensor; quantize_along_dim takes 0..{x.dim() - 1}")
    _check_blocked_dim(x.shape[dim], f"the size along dim {dim}", pad)


@quantize_along_dim.register_fake
def _(x, dim, fmt="e4m3", mode="rceil", pad=False):
    _along_dim_checks(x, dim, fmt, mode, pad)
    padded = list(x.shape)
    padded[dim] = _ceil_to(padded[dim], BLOCK)
    scale_shape = list(padded)
    scale_shape[dim] //= BLOCK
    return x.new_empty(padded, dtype=_codes(fmt, mode)[1]), x.new_empty(scale_shape, dtype=torch.float8_e8m0fnu)


_GROUP_LAYOUT_MAX_E = 4096  # one program holds all experts


def group_layout(offsets: Tensor, T: int) -> tuple[Tensor, Tensor, int]:
    """``numerics.grouped.padded_group_layout`` (same values) for ``offsets`` (E,) int32 or
    int64, any strides, on a CUDA device (or under the interpreter), in one Triton launch
    instead of the ~10 small torch kernels of the reference, which cost more than the
    quantization at moderate sizes under CUDA-graph replay; other devices and E > 4096 use
    the reference.

    Returns:
        ``(block_starts, padded_offsets, Tp)``: int32 (E + 1,) cumulative 32-token block
        counts from 0, int32 (E,) cumulative padded token ends, and the padded length
        32 * (T // 32 + E), on offsets' device.
    """
    E = offsets.numel()
    if not (offsets.is_cuda or interpreting()) or E == 0 or E > _GROUP_LAYOUT_MAX_E:
        return padded_group_layout(offsets, T)
    offsets = offsets.to(torch.int32).contiguous()  # the kernel reads E dense int32 values
    block_starts = torch.empty(E + 1, dtype=torch.int32, device=offsets.device)
    padded_offsets = torch.empty(E, dtype=torch.int32, device=offsets.device)
    tk._group_layout_kernel[(1,)](offsets, E, block_starts, padded_offsets, E_POW2=triton.next_power_of_2(E + 1),
                                  num_warps=4)
    return block_starts, padded_offsets, BLOCK * (T // BLOCK + E)


_TABLE_BLOCK_B = 64  # padded 32-token blocks per program of the token table kernel
_TABLE_BLOCK_E = 64  # experts per step of its walk


def group_token_table(offsets: Tensor, block_starts: Tensor, T: int, n_blocks: int) -> tuple[Tensor, Tensor]:
    """The token table of the per-expert padded layout, one Triton launch, no host sync.

    Args:
        offsets: (E,) int32 or int64 cumulative token ends (non-decreasing), any strides.
        block_starts: (E + 1,) int32 cumulative 32-token block counts from :func:`group_layout`.
        T: the rows that may be read (a block never reads past row T).
        n_blocks: padded blocks to describe (Tp / 32).

    Returns:
        ``(tok0, tok_end)``: int32 (n_blocks,) each: the first token of padded block b and
        the end of its expert's tokens (0 for blocks past the last expert's), so block b
        holds tokens tok0[b] .. min(tok0[b] + 32, tok_end[b]) and zeros after them.
    """
    dev = offsets.device
    offsets = offsets.to(torch.int32).contiguous()  # the kernel reads E dense int32 values
    tok0 = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    tok_end = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    if n_blocks:
        tk._block_token_table_kernel[(triton.cdiv(n_blocks, _TABLE_BLOCK_B),)](
            offsets, block_starts.to(torch.int32).contiguous(), offsets.numel(), T, n_blocks, tok0, tok_end,
            BLOCK_B=_TABLE_BLOCK_B, BLOCK_E=_TABLE_BLOCK_E, num_warps=4)
    return tok0, tok_end


def _checked_offsets(offsets: Tensor, device: torch.device) -> Tensor:
    """offsets as the grouped kernels index them: dense int32 on ``device``; ValueError otherwise."""
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64) or offsets.device != device:
        raise ValueError(f"offsets must be a 1-D int32 (or int64) tensor on {device}, got {offsets.dtype} "
                         f"{tuple(offsets.shape)} on {offsets.device}")
    return offsets.to(torch.int32).contiguous()


def _grouped_tok_settings() -> tuple[dict, int, int]:
    """Launch settings of the dequantized grouped kernels: (settings, block_g, block_c)."""
    cfg = _launch_settings("grouped_tok")
    block_g = _GROUPED_TOK_INTERPRETER_G if interpreting() else cfg["block_g"]
    return cfg, block_g, cfg["block_c"]


def _grouped_launch(x: Tensor, offsets: Tensor, fmt: str, mode: str, write_q: bool,
                    dq_dtype: torch.dtype | None, src: Tensor | None = None) -> dict[str, Tensor]:
    """Each expert's tokens of x (T, C), sorted by expert, quantized in their own 32-token
    blocks: ``q`` (C, Tp) codes and ``s`` (C, Tp / 32) scales if ``write_q`` (the grouped t8
    kernel), ``dq`` (Tp, C) dequantized values in ``dq_dtype`` if given, and
    ``padded_offsets``. src: optional (A,) integer row of x for each sorted row (the token
    permute fused into the codes kernel's read); the sorted rows then number A, not
    x.shape[0]."""
    _check_tensor(x)
    if x.dim() != 2:
        raise ValueError(f"x must be (T, C), got shape {tuple(x.shape)}")
    offsets = _checked_offsets(offsets, x.device)
    elem, q_dtype, mode_code = _codes(fmt, mode)
    T, C = x.shape
    if src is not None:
        T = src.numel()
    E = offsets.numel()
    block_starts, padded_offsets, Tp = group_layout(offsets, T)
    dev = x.device
    u8 = torch.uint8
    dummy = torch.empty(1, dtype=u8, device=dev)
    out = {"padded_offsets": padded_offsets}
    q = s = dq = dummy
    if write_q:
        q = torch.empty(C, Tp, dtype=u8, device=dev)
        s = torch.empty(C, Tp // BLOCK, dtype=u8, device=dev)
        out["q"], out["s"] = q.view(q_dtype), s.view(torch.float8_e8m0fnu)
    if dq_dtype is not None:
        dq = out["dq"] = torch.empty(Tp, C, dtype=dq_dtype, device=dev)
    if not (C and Tp and E):  # nothing to read: every output is zeros (scale byte 0)
        for t in (q, s, dq):
            if t is not dummy:
                t.zero_()
        return out
    tok0, tok_end = group_token_table(offsets, block_starts, T, Tp // BLOCK)
    if dq_dtype is not None:  # dequantized values: padded token layout, not transposed
        # only the codes kernel fuses the gather: this one reads the gathered rows (T counts them)
        xg = x if src is None else x.index_select(0, src.to(torch.int64))
        cfg, block_g, block_c = _grouped_tok_settings()
        tk._mx_grouped_tok_dq_kernel[_grid(triton.cdiv(C, block_c), triton.cdiv(Tp // BLOCK, block_g),
                                            what="grouped token quantizer (tokens)")](
            xg, xg.stride(0), xg.stride(1), C, tok0, tok_end, dq, Tp,
            ELEM=elem, MODE=mode_code, HW_ROUND=cfg["hw_round"], SOFT_CASTS=cfg["soft_casts"],
            BLOCK_G=block_g, BLOCK_C=block_c, num_warps=cfg["num_warps"],
        )
    if write_q:  # codes, with or without the gather
        cfg = _launch_settings("grouped")
        block_t, block_c = cfg["block_t"], cfg["block_c"]
        tk._mx_grouped_col_t8_kernel[_grid(triton.cdiv(C, block_c), triton.cdiv(Tp, block_t),
                                            what="grouped column quantizer (tokens)")](
            x, x.stride(0), x.stride(1), C, tok0, tok_end, q, s, Tp,
            src if src is not None else dummy,
            ELEM=elem, MODE=mode_code, HW_ROUND=cfg["hw_round"], SOFT_CASTS=cfg["soft_casts"],
            BLOCK_T=block_t, BLOCK_C=block_c, HAS_SRC=src is not None, num_warps=cfg["num_warps"],
        )
    return out


@torch.library.custom_op("mxmoe::quantize_grouped_colwise", mutates_args=())
def quantize_grouped_colwise(x: Tensor, offsets: Tensor, fmt: str = "e4m3",
                             mode: str = "rceil") -> tuple[Tensor, Tensor, Tensor]:
    """Tokens of each expert in their own blocks, transposed and padded per expert:
    x (T, C) float32/bfloat16 sorted by expert, offsets (E,) int32/int64 cumulative ends ->
    codes (C, Tp) FP8, scales (C, Tp / 32) E8M0, padded offsets (E,) int32.
    Tp = 32 * (T // 32 + E); equal to :func:`mxmoe.numerics.grouped.torch_quantize_grouped_dim0`.

    Raises:
        ValueError: x not 2-D, offsets not a 1-D integer tensor on x's device, fmt not FP8.
        TypeError: x not float32/bfloat16."""
    out = _grouped_launch(x, offsets, fmt, mode, True, None)
    return out["q"], out["s"], out["padded_offsets"]


@quantize_grouped_colwise.register_fake
def _(x, offsets, fmt="e4m3", mode="rceil"):
    T, C = x.shape
    Tp = BLOCK * (T // BLOCK + offsets.shape[0])
    q = x.new_empty(C, Tp, dtype=_codes(fmt, mode)[1])
    s = x.new_empty(C, Tp // BLOCK, dtype=torch.float8_e8m0fnu)
    return q, s, offsets.new_empty(offsets.shape, dtype=torch.int32)


def _dequantize_launch(q: Tensor, scale: Tensor, out_dtype: torch.dtype, transposed: bool) -> Tensor:
    if q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"codes must be float8_e4m3fn or float8_e5m2, got {q.dtype}")
    if out_dtype not in _DQ_DTYPES:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"scales must be float8_e8m0fnu (or their uint8 bytes), got {scale.dtype}")
    if transposed and q.dim() != 2:
        raise ValueError(f"dequantize_colwise takes 2-D codes (K, M), got shape {tuple(q.shape)}")
    K = q.shape[-1]
    if K % BLOCK or scale.shape != (*q.shape[:-1], K // BLOCK):
        raise ValueError(f"scales must have shape {(*q.shape[:-1], K // BLOCK)} for codes {tuple(q.shape)} "
                         f"(blocked dim a multiple of {BLOCK}), got {tuple(scale.shape)}")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError("the dequantize kernels need CUDA tensors (or TRITON_INTERPRET=1)")
    elem = tk.ELEM_E4M3 if q.dtype == torch.float8_e4m3fn else tk.ELEM_E5M2
    rows = math.prod(q.shape[:-1])
    q2 = q.contiguous().view(torch.uint8).reshape(rows, K)
    s2 = scale.contiguous().view(torch.uint8).reshape(rows, K // BLOCK)
    out = torch.empty((K, rows) if transposed else (rows, K), dtype=out_dtype, device=q.device)
    if rows and K:
        cfg = _launch_settings("dequant_t" if transposed else "dequant")
        block_r, block_c = cfg["tile"]
        grid = _grid(triton.cdiv(K, block_c), triton.cdiv(rows, block_r), what="dequantizer (rows)")
        tk._mx_dequant_kernel[grid](q2, s2, out, rows, K, ELEM=elem, SOFT_CASTS=cfg["soft_casts"],
                                    BLOCK_R=block_r, BLOCK_C=block_c, TRANS_OUT=transposed,
                                    num_warps=cfg["num_warps"])
    return out if transposed else out.view(q.shape)


@torch.library.custom_op("mxmoe::dequantize_rowwise", mutates_args=())
def dequantize_rowwise(q: Tensor, scale: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """codes (..., K) FP8 and plain scales (..., K / 32) E8M0 -> values (..., K) in
    ``out_dtype`` (float32 or bfloat16): P_i * 2^(b - 127) exact in float32, then rounded."""
    return _dequantize_launch(q, scale, out_dtype, False)


@dequantize_rowwise.register_fake
def _(q, scale, out_dtype=torch.float32):
    return q.new_empty(q.shape, dtype=out_dtype)


@torch.library.custom_op("mxmoe::dequantize_colwise", mutates_args=())
def dequantize_colwise(q: Tensor, scale: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """A transposed column-wise copy back in the input's layout: codes (K, M) and scales
    (K, M / 32) (blocks along M, as ``quantize_grouped_colwise`` writes them) -> values
    (M, K) in ``out_dtype``; equal to ``dequantize_rowwise(q, scale).t()``, written
    contiguous."""
    return _dequantize_launch(q, scale, out_dtype, True)


@dequantize_colwise.register_fake
def _(q, scale, out_dtype=torch.float32):
    return q.new_empty(q.shape[1], q.shape[0], dtype=out_dtype)


@torch.library.custom_op("mxmoe::fake_quantize_along_dim", mutates_args=())
def fake_quantize_along_dim(x: Tensor, dim: int, fmt: str = "e4m3", mode: str = "rceil",
                  out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """dequantize(quantize(x, blocks along ``dim``)) in one pass, same shape as x; a
    blocked size that is not a multiple of 32 is zero padded (exact for a GEMM along it)."""
    if out_dtype not in _DQ_DTYPES:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a {x.dim()}-d tensor")
    return launch_along_dim(x, dim % x.dim(), fmt, mode, write_q=False, dq_dtype=out_dtype, pad=True)["dq"]


@fake_quantize_along_dim.register_fake
def _(x, dim, fmt="e4m3", mode="rceil", out_dtype=torch.bfloat16):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("mxmoe::fake_quantize_rowcol", mutates_args=())
def fake_quantize_rowcol(x: Tensor, fmt: str = "e4m3", mode: str = "rceil",
                         out_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """``(fake_quantize_along_dim(x, -1), fake_quantize_along_dim(x, -2))`` of x (T, C) or (E, N, K) from one
    read of it (one kernel): x's shape each, blocked along the last dimension and along
    the one before it (per expert for 3-D x); tails zero padded."""
    if out_dtype not in _DQ_DTYPES:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(f"expected a 2-D (T, C) or 3-D (E, N, K) tensor, got shape {tuple(x.shape)}")
    out = launch_tile(x if x.dim() == 3 else x.unsqueeze(0), fmt, mode, rowwise=True, colwise=True,
                      write_q=False, dq_dtype=out_dtype, pad=True)
    if x.dim() == 3:
        return out["dq_row"], out["dq_col"]
    return out["dq_row"][0], out["dq_col"][0]


@fake_quantize_rowcol.register_fake
def _(x, fmt="e4m3", mode="rceil", out_dtype=torch.bfloat16):
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("mxmoe::fake_quantize_grouped_colwise", mutates_args=())
def fake_quantize_grouped_colwise(x: Tensor, offsets: Tensor, fmt: str = "e4m3", mode: str = "rceil",
                                  out_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """Dequantized per-expert token blocks in the padded token layout, not transposed:
    x (T, C) -> (Tp, C) values in ``out_dtype`` (row 32 b + i: token i of padded block b,
    zeros past its expert's tokens) and the padded offsets (E,) int32. Read and written
    along C, no transpose (93-95% of a copy's bandwidth on the H200, where the transposed
    (C, Tp) layout ran at 54-56%); ``out.t()`` is the (C, Tp) operand of the wgrad GEMM,
    which ``torch._grouped_mm`` runs about as fast in any layout."""
    if out_dtype not in _DQ_DTYPES:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    out = _grouped_launch(x, offsets, fmt, mode, False, out_dtype)
    return out["dq"], out["padded_offsets"]


@fake_quantize_grouped_colwise.register_fake
def _(x, offsets, fmt="e4m3", mode="rceil", out_dtype=torch.bfloat16):
    T, C = x.shape
    Tp = BLOCK * (T // BLOCK + offsets.shape[0])
    return x.new_empty(Tp, C, dtype=out_dtype), offsets.new_empty(offsets.shape, dtype=torch.int32)


@torch.library.custom_op("mxmoe::fake_quantize_grouped_colwise_pair", mutates_args=())
def fake_quantize_grouped_colwise_pair(a: Tensor, b: Tensor, offsets: Tensor, fmt: str = "e4m3", mode: str = "rceil",
                                       out_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`fake_quantize_grouped_colwise` of two tensors with the same rows (the wgrad
    operands dY (T, CA) and X (T, CB)) in one launch, the padded layout computed once:
    returns (Tp, CA), (Tp, CB) and the padded offsets (E,) int32, each bit for bit the
    single-tensor result.

    Raises:
        TypeError: out_dtype not float32/bfloat16.
        ValueError: a or b not 2-D, different row counts or devices, bad offsets.
    """
    if out_dtype not in _DQ_DTYPES:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    _check_tensor(a, "a")
    _check_tensor(b, "b")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0] or a.device != b.device:
        raise ValueError(f"expected a (T, CA) and b (T, CB) on one device, got {tuple(a.shape)} on {a.device} "
                         f"and {tuple(b.shape)} on {b.device}")
    offsets = _checked_offsets(offsets, a.device)
    elem, _, mode_code = _codes(fmt, mode)
    T, CA = a.shape
    CB = b.shape[1]
    E = offsets.numel()
    block_starts, padded_offsets, Tp = group_layout(offsets, T)
    da = torch.empty(Tp, CA, dtype=out_dtype, device=a.device)
    db = torch.empty(Tp, CB, dtype=out_dtype, device=a.device)
    if not (Tp and E):  # no tokens to read: zeros
        return da.zero_(), db.zero_(), padded_offsets
    cfg, block_g, block_c = _grouped_tok_settings()
    nca, ncb = triton.cdiv(CA, block_c), triton.cdiv(CB, block_c)
    if nca + ncb == 0:
        return da, db, padded_offsets
    tok0, tok_end = group_token_table(offsets, block_starts, T, Tp // BLOCK)
    tk._mx_grouped_tok_dq_pair_kernel[_grid(nca + ncb, triton.cdiv(Tp // BLOCK, block_g),
                                             what="grouped token quantizer pair (tokens)")](
        a, a.stride(0), a.stride(1), CA, da, nca, b, b.stride(0), b.stride(1), CB, db,
        tok0, tok_end, Tp,
        ELEM=elem, MODE=mode_code, HW_ROUND=cfg["hw_round"], SOFT_CASTS=cfg["soft_casts"],
        BLOCK_G=block_g, BLOCK_C=block_c, num_warps=cfg["num_warps"],
    )
    return da, db, padded_offsets


@fake_quantize_grouped_colwise_pair.register_fake
def _(a, b, offsets, fmt="e4m3", mode="rceil", out_dtype=torch.bfloat16):
    Tp = BLOCK * (a.shape[0] // BLOCK + offsets.shape[0])
    return (a.new_empty(Tp, a.shape[1], dtype=out_dtype), a.new_empty(Tp, b.shape[1], dtype=out_dtype),
            offsets.new_empty(offsets.shape, dtype=torch.int32))
