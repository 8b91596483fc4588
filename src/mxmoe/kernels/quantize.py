"""Host side of the Triton MX quantization kernels, registered as ``torch.library`` custom
ops (``torch.ops.mxmoe.*``) so that autograd and ``torch.compile`` see them as single ops.

Ops (FP8 elements only: fmt "e4m3" or "e5m2"; mode "rceil" or "floor"; block size 32):

| op | input | outputs |
|---|---|---|
| ``quantize_rowwise`` | x (..., K) | codes (..., K), scales (..., K / 32) |
| ``quantize_colwise`` | x (M, K) or (E, M, K) | codes (..., K, M), scales (..., K, M / 32): blocks along M, transposed |
| ``quantize_rowcol`` | x (M, K) or (E, N, K) | both of the above from one read of x |
| ``quantize_grouped_colwise`` | x (T, C), offsets (E,) | codes (C, Tp), scales (C, Tp / 32), padded offsets (E,) |
| ``dequantize_rowwise`` | codes (..., K), scales (..., K / 32) | values (..., K) in bf16 or float32 |
| ``dequantize_colwise`` | codes (K, M), scales (K, M / 32) | values (M, K): the transposed copy back |
| ``fake_quantize`` | x, dim | dequantize(quantize(x along dim)) in one pass |
| ``fake_quantize_grouped_colwise`` | x (T, C), offsets | dequantized (Tp, C) (not transposed), padded offsets |
| ``fake_quantize_grouped_colwise_pair`` | a (T, CA), b (T, CB), offsets | both of the above in one launch |

``blocked=True`` writes the scales in the Blackwell blocked layout instead (equal to
:func:`~mxmoe.to_blocked_scales` of the plain scales; for 3-D inputs one blocked matrix
per expert). Inputs may have any strides; sizes along a blocked dimension must be
multiples of 32 (``pad=True`` on ``quantize_rowwise`` / ``quantize_colwise`` zero-pads).

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
from ..numerics.layout import blocked_scales_numel
from . import cuda_quantize
from . import triton_quantize as tk

FP8_FORMATS = {"e4m3": (tk.ELEM_E4M3, torch.float8_e4m3fn), "e5m2": (tk.ELEM_E5M2, torch.float8_e5m2)}
MODES = {"floor": tk.MODE_FLOOR, "rceil": tk.MODE_RCEIL}
_INPUT_DTYPES = (torch.float32, torch.bfloat16)
_DQ_DTYPES = (torch.float32, torch.bfloat16)
BLOCK = tk.BLOCK
# Launch settings: measured on the H200 (benchmarks/quantize.py sweeps them); the
# interpreter uses large tiles, fewer programs, to keep the CPU tests quick.
TUNING = {
    "rows": {"block_b": 128, "num_warps": 8},  # contiguous row-wise: (n_blocks, 32) view
    "rowwise": {"tile": (32, 128), "num_warps": 2, "pack_t": False},
    "colwise": {"tile": (32, 128), "num_warps": 2, "pack_t": False},
    "grouped": {"block_c": 128, "num_warps": 2, "pack_t": False},
    "dequant": {"tile": (32, 128), "num_warps": 4},
    # dequantize_colwise (transposed output); the sweep before bb852fe (16384 x 8192) timed
    # 128 x 128 at 110 us against 120 us for this tile, but only this one has been checked
    # bit for bit on the H200 (check_kernels_cuda at bb852fe)
    "dequant_t": {"tile": (64, 64), "num_warps": 4},
    # 1: round with the float8 cast instruction (RNE, satfinite on sm89+); 2: the same
    # instruction inside PTX that also packs the codes and applies the NaN rule four at a
    # time (triton_quantize._codes_asm); 0 (the interpreter): float32-arithmetic rounding
    "hw_round": 2,
    "pack_t": False,  # transposed stores as int32 words of 4 codes (per kernel above)
    "rows_flat": True,  # contiguous row-wise input takes _mx_rows_kernel
    # transposed column-wise codes (and row-wise with them) through _mx_tile_t4_kernel
    "t4": {"tile": (64, 64), "num_warps": 4, "enabled": True},
    # the same through _mx_tile_t8_kernel (8 x 8 patches per thread): preferred over t4
    # when enabled; staged: the transposed words leave through a coalesced layout (one
    # shared-memory pass, whole 128-byte lines); maxnreg: register cap; fmax: block amax by
    # max.NaN.f32 of |x| (the |.| modifier is free) instead of and + integer max over the
    # bits (same scale bytes); prefetch: prefetch.global.L2 of the tile that many row tiles
    # below, a later wave's read started while this one computes (0: off). "t8": row +
    # column codes; "t8_colwise": column-only codes (benchmarks/quantize_variants.py on the
    # H200, session 4: row + column 170.5 us at 128 x 64 capped at 128 registers -> 161.2
    # at 128 x 128 uncapped with prefetch 2 (16384 x 8192); column-only 107.8 -> 104.5 us at
    # 256 x 64, 8 warps, prefetch 1; 128 x 128 column-only: 115 us)
    "t8": {"tile": (128, 128), "num_warps": 4, "enabled": True, "staged": True, "maxnreg": None, "fmax": True,
           "prefetch": 2},
    "t8_colwise": {"tile": (256, 64), "num_warps": 8, "enabled": True, "staged": True, "maxnreg": 128, "fmax": True,
                   "prefetch": 1},
    # grouped column-wise codes (with or without the fused token gather) through
    # _mx_grouped_col_t8_kernel, block_t tokens per program
    "grouped_t8": {"block_t": 256, "block_c": 64, "num_warps": 8, "enabled": True, "staged": True, "maxnreg": None,
                   "fmax": True},
    # dequantized values along each expert's tokens (the wgrad operand) through
    # _mx_grouped_tok_dq_kernel: block_g 32-token blocks x block_c columns per program
    # (sweep at bb852fe, 16384 x 8192, 64 experts: 149 us = 93% of copy at 8 x 64, 8 warps,
    # and 2 x 64, 2 warps; 128 columns 191-224 us; one warp per 32-row block or slower)
    "grouped_tok": {"block_g": 8, "block_c": 64, "num_warps": 8},
    # bfloat16 row + column codes (plain scales) through the CUDA kernel
    # (kernels/cuda_rowcol.cu, compiled by NVRTC) where it applies (cuda_quantize.applies):
    # threads per block, 32-column blocks per row-pass task (rb), 32-row blocks per
    # column-pass task (gb), scales through tile-major scratch arrays (scratch) moved by
    # mx_scales_out (scale_threads per block, at least scale_min_blocks resident per SM),
    # L2 policy of the column code stores (col_policy 3: evict_last on half of them);
    # benchmarks/rowcol_cuda_variants.py, session 7 of 2026-11-30
    "rowcol_cuda": {"enabled": True, "threads": 256, "rb": 2, "gb": 1, "scratch": True, "col_policy": 3,
                    "scale_threads": 256, "scale_min_blocks": 8},
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


def _check_blocked_dim(size: int, what: str, pad: bool | None) -> int:
    """pad None: the caller has no pad option (the error then offers only zero padding)."""
    if size % BLOCK and not pad:
        hint = " or pass pad=True" if pad is not None else ""
        raise ValueError(f"{what} is {size}, not a multiple of the block size {BLOCK}; "
                         f"zero-pad it to {_ceil_to(size, BLOCK)}{hint}")
    return _ceil_to(size, BLOCK)


def _as_3d(x: Tensor) -> Tensor:
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() == 3:
        return x
    raise ValueError(f"expected a 2-D (M, K) or 3-D (E, M, K) tensor, got shape {tuple(x.shape)}")


def _launch_settings(kind: str) -> dict:
    """TUNING for ``kind``; under the interpreter: large tiles, float32-arithmetic
    rounding (its float8 cast does not break ties to even) and exact bit-level casts, with
    the kind's kernel switches (``enabled``, ``codes``) kept as set."""
    common = {"pack_t": TUNING["pack_t"], "rows_flat": TUNING["rows_flat"]}
    if interpreting():
        switches = {k: v for k, v in TUNING[kind].items() if k in ("enabled", "codes", "staged", "fmax")}
        return {"tile": _TILE_INTERPRETER, "block_c": _TILE_INTERPRETER[1], "block_b": 256, "num_warps": 4,
                "hw_round": False, "soft_casts": True, "enabled": True, **switches, **common}
    return {**common, "hw_round": TUNING["hw_round"], "soft_casts": False, **TUNING[kind]}


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


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _register_cap(cfg: dict) -> dict:
    """Launch option capping registers per thread (ptx .maxnreg: more resident warps, to
    hide the memory latency of kernels with one read per tile), if the settings name one."""
    return {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not interpreting() else {}


def launch_tile(
    x3: Tensor, fmt: str, mode: str, *, rowwise: bool, colwise: bool, col_transpose: bool = True,
    write_q: bool = True, dq_dtype: torch.dtype | None = None, blocked: bool = False, pad: bool | None = False,
) -> dict[str, Tensor]:
    """Quantize x3 (B, R, C, any strides) row-wise (blocks along C) and/or column-wise
    (blocks along R) from one read: ``_mx_rows_kernel`` for contiguous row-wise-only jobs,
    ``_mx_tile_kernel`` otherwise. Returns the outputs asked for by name: ``q_row``,
    ``s_row``, ``dq_row``, ``q_col``, ``s_col``, ``dq_col`` (shapes in the kernel's docs)."""
    _check_tensor(x3)
    elem, q_dtype, mode_code = _codes(fmt, mode)
    B, R, C = x3.shape
    Cp = _check_blocked_dim(C, "the row length (blocked dim of the row-wise copy)", pad) if rowwise else C
    Rp = _check_blocked_dim(R, "the column length (blocked dim of the column-wise copy)", pad) if colwise else R
    if blocked and colwise and not col_transpose:
        raise ValueError("blocked scales are written for row-wise and transposed column-wise copies only")
    if (rowwise and colwise and col_transpose and write_q and dq_dtype is None and not blocked
            and not interpreting()):  # bfloat16 row + column codes: the CUDA kernel where it applies
        fmt_s, mode_s = ElemFormat.parse(fmt).value, ScaleMode.parse(mode).value
        cfg = TUNING["rowcol_cuda"]
        res = cuda_quantize.rowcol(x3, fmt_s, mode_s, cfg) if cuda_quantize.applies(x3, fmt_s, mode_s, cfg) else None
        if res is not None:
            return {k: v.view(q_dtype if k.startswith("q") else torch.float8_e8m0fnu) for k, v in res.items()}
    dev = x3.device
    out: dict[str, Tensor] = {}
    u8 = torch.uint8
    dummy = torch.empty(1, dtype=u8, device=dev)
    q_row = s_row = dq_row = q_col = s_col = dq_col = dummy
    R128, C128 = _ceil_to(R, 128), _ceil_to(C, 128)
    if rowwise:
        if write_q:
            q_row = torch.empty(B, R, Cp, dtype=u8, device=dev)
            s_row = (torch.zeros(B, blocked_scales_numel(R, Cp // BLOCK), dtype=u8, device=dev) if blocked
                     else torch.empty(B, R, Cp // BLOCK, dtype=u8, device=dev))
            out["q_row"], out["s_row"] = q_row, s_row
        if dq_dtype is not None:
            dq_row = out["dq_row"] = torch.empty(B, R, C, dtype=dq_dtype, device=dev)
    if colwise:
        if write_q:
            if col_transpose:
                q_col = torch.empty(B, C, Rp, dtype=u8, device=dev)
                s_col = (torch.zeros(B, blocked_scales_numel(C, Rp // BLOCK), dtype=u8, device=dev) if blocked
                         else torch.empty(B, C, Rp // BLOCK, dtype=u8, device=dev))
            else:
                q_col = torch.empty(B, Rp, C, dtype=u8, device=dev)
                s_col = torch.empty(B, Rp // BLOCK, C, dtype=u8, device=dev)
            out["q_col"], out["s_col"] = q_col, s_col
        if dq_dtype is not None:
            shape = (B, C, R) if col_transpose else (B, R, C)
            dq_col = out["dq_col"] = torch.empty(shape, dtype=dq_dtype, device=dev)
    t4, t8 = _launch_settings("t4"), _launch_settings("t8" if rowwise else "t8_colwise")
    transposed_codes = colwise and col_transpose and write_q and dq_dtype is None
    use_t8 = transposed_codes and t8["enabled"] and all(_is_pow2(n) and n >= BLOCK for n in t8["tile"])
    use_t4 = transposed_codes and t4["enabled"] and t4["tile"][0] % BLOCK == 0
    flat_rows = rowwise and not colwise and Cp == C and x3.is_contiguous() and _launch_settings("rows")["rows_flat"]
    if B and R and C and flat_rows:
        cfg = _launch_settings("rows")
        n_blocks = B * R * (C // BLOCK)
        tk._mx_rows_kernel[(triton.cdiv(n_blocks, cfg["block_b"]),)](
            x3, n_blocks, C // BLOCK, q_row, s_row, dq_row, R, R128,
            ELEM=elem, MODE=mode_code, WRITE_Q=write_q, WRITE_DQ=dq_dtype is not None, BLOCKED=blocked,
            HW_ROUND=cfg["hw_round"], SOFT_CASTS=cfg["soft_casts"], BLOCK_B=cfg["block_b"],
            num_warps=cfg["num_warps"],
        )
    elif B and R and C and (use_t8 or use_t4):  # t8 first; both take the same arguments
        cfg = t8 if use_t8 else t4
        kernel = tk._mx_tile_t8_kernel if use_t8 else tk._mx_tile_t4_kernel
        extra = ({"STAGED": cfg["staged"], "FMAX": cfg.get("fmax", True), "PREFETCH": cfg.get("prefetch", 0),
                  **_register_cap(cfg)} if use_t8 else {})
        block_r, block_c = cfg["tile"]
        grid = _grid(triton.cdiv(C, block_c), triton.cdiv(Rp, block_r), B,
                     what="row + column quantizer (rows, matrices)")
        kernel[grid](
            x3, x3.stride(0), x3.stride(1), x3.stride(2), R, C, q_row, s_row, q_col, s_col, Rp, Cp, R128, C128,
            ELEM=elem, MODE=mode_code, ROWWISE=rowwise, BLOCKED=blocked, HW_ROUND=cfg["hw_round"],
            SOFT_CASTS=cfg["soft_casts"], BLOCK_R=block_r, BLOCK_C=block_c, num_warps=cfg["num_warps"], **extra,
        )
    elif B and R and C:
        cfg = _launch_settings("colwise" if colwise else "rowwise")
        block_r, block_c = cfg["tile"]
        grid = _grid(triton.cdiv(Cp, block_c), triton.cdiv(Rp, block_r), B, what="tile quantizer (rows, matrices)")
        tk._mx_tile_kernel[grid](
            x3, x3.stride(0), x3.stride(1), x3.stride(2), R, C,
            q_row, s_row, dq_row, q_col, s_col, dq_col, Rp, Cp, R128, C128,
            ELEM=elem, MODE=mode_code, ROWWISE=rowwise, COLWISE=colwise, COL_T=col_transpose,
            WRITE_Q=write_q, WRITE_DQ=dq_dtype is not None, BLOCKED=blocked, HW_ROUND=cfg["hw_round"],
            SOFT_CASTS=cfg["soft_casts"], PACK_T=cfg["pack_t"], BLOCK_R=block_r, BLOCK_C=block_c,
            num_warps=cfg["num_warps"],
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
        out = launch_tile(x.reshape(P, L, S), fmt, mode, rowwise=False, colwise=True, col_transpose=False,
                          write_q=write_q, dq_dtype=dq_dtype, pad=pad)
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
    :func:`mxmoe.numerics.quantize_mx` runs on the Triton backend). x any rank, dim
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


def _squeeze_to(t: Tensor, was_2d: bool) -> Tensor:
    return t.squeeze(0) if was_2d else t


# ---- custom ops ---------------------------------------------------------------------------

def _rows_view(x: Tensor, blocked: bool) -> Tensor:
    """(B, R, K) view for row-wise quantization: 2-D and 3-D inputs keep their matrices
    (one blocked scale matrix each); other ranks flatten their leading dims into rows."""
    if x.dim() in (2, 3):
        return _as_3d(x)
    if blocked:
        raise ValueError(f"blocked scales need a 2-D or 3-D input, got shape {tuple(x.shape)}")
    return x.reshape(1, math.prod(x.shape[:-1]), x.shape[-1])


@torch.library.custom_op("mxmoe::quantize_rowwise", mutates_args=())
def quantize_rowwise(x: Tensor, fmt: str = "e4m3", mode: str = "rceil", blocked: bool = False,
                     pad: bool = False) -> tuple[Tensor, Tensor]:
    """Blocks along the last dim. x (..., K) -> codes (..., Kp) FP8, scales (..., Kp / 32)
    E8M0; blocked: x (M, K) -> scales (M128 * C4,), x (E, M, K) -> (E, M128 * C4)."""
    if x.dim() == 0:
        raise ValueError("x is a 0-d tensor; quantize_rowwise blocks its last dim")
    out = launch_tile(_rows_view(x, blocked), fmt, mode, rowwise=True, colwise=False, blocked=blocked, pad=pad)
    Kp = _ceil_to(x.shape[-1], BLOCK)
    q = out["q_row"].reshape(*x.shape[:-1], Kp)
    s = out["s_row"]
    s = _squeeze_to(s, x.dim() == 2) if blocked else s.reshape(*x.shape[:-1], Kp // BLOCK)
    return q, s


@quantize_rowwise.register_fake
def _(x, fmt="e4m3", mode="rceil", blocked=False, pad=False):
    lead, Kp = x.shape[:-1], _ceil_to(x.shape[-1], BLOCK)
    q = x.new_empty(*lead, Kp, dtype=_codes(fmt, mode)[1])
    if not blocked:
        return q, x.new_empty(*lead, Kp // BLOCK, dtype=torch.float8_e8m0fnu)
    x3 = _rows_view(x, blocked)
    s = x.new_empty(x3.shape[0], blocked_scales_numel(x3.shape[1], Kp // BLOCK), dtype=torch.float8_e8m0fnu)
    return q, _squeeze_to(s, x.dim() == 2)


@torch.library.custom_op("mxmoe::quantize_colwise", mutates_args=())
def quantize_colwise(x: Tensor, fmt: str = "e4m3", mode: str = "rceil", blocked: bool = False,
                     pad: bool = False) -> tuple[Tensor, Tensor]:
    """Blocks along M, written transposed: x (M, K) / (E, M, K) -> codes (..., K, Mp),
    scales (..., K, Mp / 32) (blocked: (..., K128 * C4))."""
    was_2d = x.dim() == 2
    out = launch_tile(_as_3d(x), fmt, mode, rowwise=False, colwise=True, blocked=blocked, pad=pad)
    return _squeeze_to(out["q_col"], was_2d), _squeeze_to(out["s_col"], was_2d)


@quantize_colwise.register_fake
def _(x, fmt="e4m3", mode="rceil", blocked=False, pad=False):
    x3 = _as_3d(x)
    B, M, K = x3.shape
    Mp = _ceil_to(M, BLOCK)
    q = x.new_empty(B, K, Mp, dtype=_codes(fmt, mode)[1])
    s = (x.new_empty(B, blocked_scales_numel(K, Mp // BLOCK), dtype=torch.float8_e8m0fnu) if blocked
         else x.new_empty(B, K, Mp // BLOCK, dtype=torch.float8_e8m0fnu))
    return _squeeze_to(q, x.dim() == 2), _squeeze_to(s, x.dim() == 2)


@torch.library.custom_op("mxmoe::quantize_rowcol", mutates_args=())
def quantize_rowcol(x: Tensor, fmt: str = "e4m3", mode: str = "rceil",
                    blocked: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both copies from one read: x (M, K) / (E, N, K) -> row-wise codes and scales
    (blocks along K) and transposed column-wise codes (..., K, M) and scales (..., K, M / 32)."""
    was_2d = x.dim() == 2
    out = launch_tile(_as_3d(x), fmt, mode, rowwise=True, colwise=True, blocked=blocked, pad=None)
    return tuple(_squeeze_to(out[k], was_2d) for k in ("q_row", "s_row", "q_col", "s_col"))


@quantize_rowcol.register_fake
def _(x, fmt="e4m3", mode="rceil", blocked=False):
    x3 = _as_3d(x)
    B, M, K = x3.shape
    qd = _codes(fmt, mode)[1]
    e8 = torch.float8_e8m0fnu
    q_row = x3.new_empty(B, M, K, dtype=qd)
    s_row = (x3.new_empty(B, blocked_scales_numel(M, K // BLOCK), dtype=e8) if blocked
             else x3.new_empty(B, M, K // BLOCK, dtype=e8))
    q_col = x3.new_empty(B, K, M, dtype=qd)
    s_col = (x3.new_empty(B, blocked_scales_numel(K, M // BLOCK), dtype=e8) if blocked
             else x3.new_empty(B, K, M // BLOCK, dtype=e8))
    was_2d = x.dim() == 2
    return tuple(_squeeze_to(t, was_2d) for t in (q_row, s_row, q_col, s_col))


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
                    dq_dtype: torch.dtype | None, blocked: bool, src: Tensor | None = None) -> dict[str, Tensor]:
    """src: optional (A,) int64 row of x for each sorted row (the token permute fused into
    the read); the sorted rows then number A, not x.shape[0]."""
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
        s = (torch.zeros(blocked_scales_numel(C, Tp // BLOCK), dtype=u8, device=dev) if blocked
             else torch.empty(C, Tp // BLOCK, dtype=u8, device=dev))
        out["q"], out["s"] = q.view(q_dtype), s.view(torch.float8_e8m0fnu)
    if dq_dtype is not None:
        dq = out["dq"] = torch.empty(Tp, C, dtype=dq_dtype, device=dev)
    if not (C and Tp and E):  # nothing to read: every output is zeros (scale byte 0)
        for t in (q, s, dq):
            if t is not dummy:
                t.zero_()
        return out
    e_pow2 = triton.next_power_of_2(E + 1)
    t8 = _launch_settings("grouped_t8")
    block_t = t8["tile"][0] if interpreting() else t8["block_t"]
    t8_codes = t8["enabled"] and all(_is_pow2(n) and n >= BLOCK for n in (block_t, t8["block_c"]))
    if src is not None and (dq_dtype is not None or not t8_codes):
        # only the t8 codes kernel fuses the gather: the others read the gathered rows (T counts them)
        x, src = x.index_select(0, src.to(torch.int64)), None
    if dq_dtype is not None:  # dequantized values: padded token layout, not transposed
        cfg, block_g, block_c = _grouped_tok_settings()
        tk._mx_grouped_tok_dq_kernel[_grid(triton.cdiv(C, block_c), triton.cdiv(Tp // BLOCK, block_g),
                                            what="grouped token quantizer (tokens)")](
            x, x.stride(0), x.stride(1), T, C, offsets, block_starts, E, dq, Tp,
            ELEM=elem, MODE=mode_code, HW_ROUND=cfg["hw_round"], SOFT_CASTS=cfg["soft_casts"], E_POW2=e_pow2,
            BLOCK_G=block_g, BLOCK_C=block_c, num_warps=cfg["num_warps"],
        )
    if not write_q:
        return out
    if t8_codes:  # codes, with or without the gather
        tk._mx_grouped_col_t8_kernel[_grid(triton.cdiv(C, t8["block_c"]), triton.cdiv(Tp, block_t),
                                            what="grouped column quantizer (tokens)")](
            x, x.stride(0), x.stride(1), T, C, offsets, block_starts, E, q, s, Tp, _ceil_to(C, 128),
            src if src is not None else dummy,
            ELEM=elem, MODE=mode_code, BLOCKED=blocked, HW_ROUND=t8["hw_round"], SOFT_CASTS=t8["soft_casts"],
            E_POW2=e_pow2, BLOCK_T=block_t, BLOCK_C=t8["block_c"],
            STAGED=t8["staged"], HAS_SRC=src is not None, FMAX=t8.get("fmax", True), num_warps=t8["num_warps"],
            **_register_cap(t8),
        )
        return out
    cfg = _launch_settings("grouped")
    block_c = cfg["block_c"]
    tk._mx_grouped_col_kernel[_grid(triton.cdiv(C, block_c), Tp // BLOCK, what="grouped column quantizer (tokens)")](
        x, x.stride(0), x.stride(1), T, C, offsets, block_starts, E, q, s, Tp, _ceil_to(C, 128),
        ELEM=elem, MODE=mode_code, BLOCKED=blocked, HW_ROUND=cfg["hw_round"], SOFT_CASTS=cfg["soft_casts"],
        PACK_T=cfg["pack_t"], E_POW2=e_pow2, BLOCK_C=block_c, num_warps=cfg["num_warps"],
    )
    return out


@torch.library.custom_op("mxmoe::quantize_grouped_colwise", mutates_args=())
def quantize_grouped_colwise(x: Tensor, offsets: Tensor, fmt: str = "e4m3", mode: str = "rceil",
                             blocked: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Tokens of each expert in their own blocks, transposed and padded per expert:
    x (T, C) sorted by expert, offsets (E,) int32 cumulative ends -> codes (C, Tp),
    scales (C, Tp / 32) (blocked: (C128 * C4,)), padded offsets (E,) int32.
    Tp = 32 * (T // 32 + E); see :mod:`mxmoe.numerics.grouped`."""
    out = _grouped_launch(x, offsets, fmt, mode, True, None, blocked)
    return out["q"], out["s"], out["padded_offsets"]


@quantize_grouped_colwise.register_fake
def _(x, offsets, fmt="e4m3", mode="rceil", blocked=False):
    T, C = x.shape
    Tp = BLOCK * (T // BLOCK + offsets.shape[0])
    q = x.new_empty(C, Tp, dtype=_codes(fmt, mode)[1])
    s = (x.new_empty(blocked_scales_numel(C, Tp // BLOCK), dtype=torch.float8_e8m0fnu) if blocked
         else x.new_empty(C, Tp // BLOCK, dtype=torch.float8_e8m0fnu))
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
    """A transposed column-wise copy back in the input's layout: codes (K, M) and plain
    scales (K, M / 32) (what ``quantize_colwise`` / ``quantize_grouped_colwise`` write,
    blocks along M) -> values (M, K) in ``out_dtype``; equal to
    ``dequantize_rowwise(q, scale).t()``, written contiguous."""
    return _dequantize_launch(q, scale, out_dtype, True)


@dequantize_colwise.register_fake
def _(q, scale, out_dtype=torch.float32):
    return q.new_empty(q.shape[1], q.shape[0], dtype=out_dtype)


@torch.library.custom_op("mxmoe::fake_quantize", mutates_args=())
def fake_quantize(x: Tensor, dim: int, fmt: str = "e4m3", mode: str = "rceil",
                  out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """dequantize(quantize(x, blocks along ``dim``)) in one pass, same shape as x; a
    blocked size that is not a multiple of 32 is zero padded (exact for a GEMM along it)."""
    if out_dtype not in _DQ_DTYPES:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a {x.dim()}-d tensor")
    return launch_along_dim(x, dim % x.dim(), fmt, mode, write_q=False, dq_dtype=out_dtype, pad=True)["dq"]


@fake_quantize.register_fake
def _(x, dim, fmt="e4m3", mode="rceil", out_dtype=torch.bfloat16):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("mxmoe::fake_quantize_rowcol", mutates_args=())
def fake_quantize_rowcol(x: Tensor, fmt: str = "e4m3", mode: str = "rceil",
                         out_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """``(fake_quantize(x, -1), fake_quantize(x, -2))`` of x (T, C) or (E, N, K) from one
    read of it (one kernel): x's shape each, blocked along the last dimension and along
    the one before it (per expert for 3-D x); tails zero padded."""
    if out_dtype not in _DQ_DTYPES:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(f"expected a 2-D (T, C) or 3-D (E, N, K) tensor, got shape {tuple(x.shape)}")
    out = launch_tile(x if x.dim() == 3 else x.unsqueeze(0), fmt, mode, rowwise=True, colwise=True,
                      col_transpose=False, write_q=False, dq_dtype=out_dtype, pad=True)
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
    along C, no transpose (93-95% of copy on the H200, where the transposed (C, Tp) layout
    ran at 54-56%); ``out.t()`` is the (C, Tp) operand of the wgrad GEMM, which
    ``torch._grouped_mm`` runs about as fast in any layout (benchmarks/wgrad_layout.py)."""
    if out_dtype not in _DQ_DTYPES:
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    out = _grouped_launch(x, offsets, fmt, mode, False, out_dtype, False)
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
    tk._mx_grouped_tok_dq_pair_kernel[_grid(nca + ncb, triton.cdiv(Tp // BLOCK, block_g),
                                             what="grouped token quantizer pair (tokens)")](
        a, a.stride(0), a.stride(1), CA, da, nca, b, b.stride(0), b.stride(1), CB, db,
        T, offsets, block_starts, E, Tp,
        ELEM=elem, MODE=mode_code, HW_ROUND=cfg["hw_round"], SOFT_CASTS=cfg["soft_casts"],
        E_POW2=triton.next_power_of_2(E + 1), BLOCK_G=block_g, BLOCK_C=block_c, num_warps=cfg["num_warps"],
    )
    return da, db, padded_offsets


@fake_quantize_grouped_colwise_pair.register_fake
def _(a, b, offsets, fmt="e4m3", mode="rceil", out_dtype=torch.bfloat16):
    Tp = BLOCK * (a.shape[0] // BLOCK + offsets.shape[0])
    return (a.new_empty(Tp, a.shape[1], dtype=out_dtype), a.new_empty(Tp, b.shape[1], dtype=out_dtype),
            offsets.new_empty(offsets.shape, dtype=torch.int32))
