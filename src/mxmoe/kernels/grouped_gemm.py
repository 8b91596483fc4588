"""Host side of the Triton MXFP8 grouped GEMMs (:mod:`mxmoe.kernels.triton_grouped_gemm`).

The three GEMMs of an MoE expert layer, on E4M3 codes and E8M0 scales (block 32 along each
GEMM's contraction, docs/NUMERICS.md). Legend: T tokens, E experts, K / N the two feature
dims of w (E, N, K); ``offsets`` (E,) int32 cumulative token ends (expert e owns rows
offsets[e-1]:offsets[e]); Lp the per-expert padded token length of
:mod:`mxmoe.numerics.grouped`.

| function | GEMM | A (codes, scales) | B (codes, scales) | out |
|---|---|---|---|---|
| :func:`triton_mx_grouped_mm_nt` | forward ``x w^T`` | x (T, K), (T, K/32) | w (E, N, K), (E, N, K/32) | (T, N) |
| :func:`triton_mx_grouped_mm_nn` | dgrad ``dy w`` | dy (T, N), (T, N/32) | w^T (E, K, N), (E, K, N/32) | (T, K) |
| :func:`triton_mx_grouped_mm_tn` | wgrad ``dy^T x`` | dy^T (N, Lp), (N, Lp/32) | x^T (K, Lp), (K, Lp/32) | (E, N, K) |

The operands are what the quantization kernels write: ``quantize_rowwise(x)``,
``quantize_rowwise(w)``, ``quantize_colwise(w)`` (the transposed column-wise copy),
``quantize_grouped_colwise(dy or x, offsets)`` (which also returns the padded offsets).

Rows past offsets[-1] are never read; the forward/dgrad write them as zeros. Experts with
no tokens get exact zero weight gradients. Nothing synchronizes with the host (the grid
size is a bound computed from shapes), so the calls are CUDA-graph capturable. Offsets
must be non-decreasing (not checked: that would need the host); reads never go past T.

Also registered as ``torch.ops.mxmoe.mx_grouped_mm_nt`` / ``_nn`` / ``_tn`` (default
launch settings). The kernels run on CUDA tensors, and on CPU tensors under
``TRITON_INTERPRET=1`` (the CPU tests).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import triton_grouped_gemm as tg
from .quantize import _codes, interpreting

BLOCK = tg.BLOCK
_OUT_DTYPES = (torch.bfloat16, torch.float32)
_CODE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)


class TileOrder(str, enum.Enum):
    """Order in which output tiles are handed to programs (see the kernel module's docs)."""

    SUPERGROUPED = "supergrouped"  # expert by expert, bands of group_m row tiles (compact squares)
    ROW_MAJOR = "row_major"  # expert by expert, row tile by row tile: supergrouping off
    SPREAD = "spread"  # a naive launch order: tiles in flight span many experts

    @classmethod
    def parse(cls, value: "TileOrder | str") -> "TileOrder":
        """The order named ``value``; ValueError naming the valid ones otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown tile order {value!r}; use one of {[o.value for o in cls]}") from None


class Dequant(str, enum.Enum):
    """How E4M3 codes become tensor-core operands (all exact; see the kernel module)."""

    CVT = "cvt"  # float8 -> float32 conversion instruction, float32 scale, round to bf16
    BITS = "bits"  # integer bit placement into float32 (the only one under the interpreter)
    CVT_BF16 = "cvt_bf16"  # float8 -> bfloat16 conversion, bfloat16 scale multiply


_DEQUANT_CODES = {Dequant.CVT: tg.DEQUANT_CVT, Dequant.BITS: tg.DEQUANT_BITS, Dequant.CVT_BF16: tg.DEQUANT_CVT_BF16}


@dataclass(frozen=True)
class GemmConfig:
    """Launch settings of one grouped GEMM kernel.

    block_m / block_n: output tile (rows of A, rows of B); block_k: contraction per step,
    a multiple of 32; group_m: row tiles per supergroup band (used by the supergrouped
    order); persistent: one program per SM walking tiles (else one program per tile of
    the static bound); dequant: a :class:`Dequant` value; scale_gather: load each
    element's scale byte by address instead of one byte per block broadcast in registers.
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = False
    dequant: str = Dequant.CVT.value
    scale_gather: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.block_k % BLOCK:
            raise ValueError(f"block_k must be a multiple of the MX block size {BLOCK}, got {self.block_k}")
        if self.group_m < 1:
            raise ValueError(f"group_m must be >= 1, got {self.group_m}")
        Dequant(self.dequant)


# Launch settings for the H100/H200 (benchmarks/grouped_gemm_tile.py sweeps them and prints
# the fastest); "nt" serves the forward and dgrad, "tn" the wgrad.
TUNING: dict[str, GemmConfig] = {
    "nt": GemmConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3),
    "tn": GemmConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3),
}
# Under the interpreter: small tiles (the test shapes are small), bit decoding, float32 dot.
INTERPRETER_CONFIG = GemmConfig(block_m=32, block_n=32, block_k=64, group_m=2, num_warps=4, num_stages=1,
                                persistent=True, dequant=Dequant.BITS.value)
_INTERPRETER_PROGRAMS = 4


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _resolve(kind: str, config: GemmConfig | None) -> GemmConfig:
    if interpreting():
        # keep the caller's tiles and order knobs, but decode by bits (the interpreter's
        # float8 casts are not the hardware's) and use few programs
        base = config or INTERPRETER_CONFIG
        return dataclasses.replace(base, dequant=Dequant.BITS.value, num_stages=1)
    return config or TUNING[kind]


def _n_programs(cfg: GemmConfig, max_tiles: int, device: torch.device) -> int:
    if interpreting():
        return max(1, min(max_tiles, _INTERPRETER_PROGRAMS)) if cfg.persistent else max(1, max_tiles)
    if cfg.persistent:
        return max(1, min(max_tiles, _sm_count(device.index if device.index is not None else 0)))
    return max(1, max_tiles)


def _as_bytes(t: Tensor, name: str, allowed: tuple[torch.dtype, ...]) -> Tensor:
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {allowed}")
    return t.contiguous().view(torch.uint8)


def _check_device(*tensors: Tensor) -> None:
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"all operands must be on one device, got {t.device} and {dev}")
    if dev.type != "cuda" and not interpreting():
        raise ValueError(f"operands are on {dev}: the Triton grouped GEMMs need CUDA tensors "
                         f"(or TRITON_INTERPRET=1 for the CPU interpreter)")


def _check_offsets(offsets: Tensor, E: int, device: torch.device) -> Tensor:
    if offsets.dim() != 1 or offsets.numel() != E or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be a 1-D int32 tensor of E = {E} cumulative ends, got "
                         f"{offsets.dtype} {tuple(offsets.shape)}")
    if offsets.device != device:
        raise ValueError(f"offsets are on {offsets.device}, the operands on {device}")
    return offsets.to(torch.int32).contiguous()


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")


def _check_pair(q: Tensor, s: Tensor, name: str, rank: int) -> tuple[Tensor, Tensor]:
    """Codes (..., C) with C a multiple of 32 and scales (..., C / 32), as uint8 views."""
    if q.dim() != rank:
        raise ValueError(f"{name} codes must be {rank}-D, got shape {tuple(q.shape)}")
    C = q.shape[-1]
    if C % BLOCK:
        raise ValueError(f"{name}: the contraction dim of the codes is {C}, not a multiple of {BLOCK}; "
                         f"quantize with pad=True (zero padding is exact)")
    if tuple(s.shape) != (*q.shape[:-1], C // BLOCK):
        raise ValueError(f"{name} scales must have shape {(*q.shape[:-1], C // BLOCK)} for codes "
                         f"{tuple(q.shape)}, got {tuple(s.shape)}")
    return _as_bytes(q, f"{name} codes", _CODE_DTYPES), _as_bytes(s, f"{name} scales", _SCALE_DTYPES)


def _launch_nt(a_q: Tensor, a_s: Tensor, b_q: Tensor, b_s: Tensor, offsets: Tensor, out_dtype: torch.dtype,
               order: TileOrder | str, config: GemmConfig | None, names: tuple[str, str]) -> Tensor:
    order = TileOrder.parse(order)
    _check_out_dtype(out_dtype)
    _check_device(a_q, a_s, b_q, b_s)
    a8, as8 = _check_pair(a_q, a_s, names[0], 2)
    b8, bs8 = _check_pair(b_q, b_s, names[1], 3)
    T, Kc = a8.shape
    E, N, Kb = b8.shape
    if Kb != Kc:
        raise ValueError(f"{names[0]} (T, {Kc}) and {names[1]} (E, N, {Kb}) disagree on the contraction dim")
    offs = _check_offsets(offsets, E, a8.device)
    out = torch.empty(T, N, dtype=out_dtype, device=a8.device)
    if T == 0 or N == 0:
        return out
    if E == 0 or Kc == 0:
        return out.zero_()
    cfg = _resolve("nt", config)
    col_tiles = triton.cdiv(N, cfg.block_n)
    max_tiles = (T // cfg.block_m + E + 1) * col_tiles  # experts, plus the tail group
    interp = interpreting()
    tg._mx_grouped_gemm_nt_kernel[(_n_programs(cfg, max_tiles, a8.device),)](
        a8, as8, b8, bs8, out, offs, T, N, Kc, E,
        1 if order is TileOrder.ROW_MAJOR else cfg.group_m, int(order is TileOrder.SPREAD),
        G_POW2=triton.next_power_of_2(E + 1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DEQUANT=_DEQUANT_CODES[Dequant(cfg.dequant)], SCALE_GATHER=cfg.scale_gather,
        DOT_DTYPE=tl.float32 if interp else tl.bfloat16, SOFT_CASTS=interp,
        EVEN_K=Kc % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def triton_mx_grouped_mm_nt(
    x_q: Tensor, x_s: Tensor, w_q: Tensor, w_s: Tensor, offsets: Tensor, *,
    out_dtype: torch.dtype = torch.bfloat16, order: TileOrder | str = TileOrder.SUPERGROUPED,
    config: GemmConfig | None = None,
) -> Tensor:
    """Forward: out[t] = x[t] @ w[e]^T for the rows t of expert e, from MXFP8 operands.

    Args:
        x_q: (T, K) float8_e4m3fn codes (or their uint8 bytes), K a multiple of 32.
        x_s: (T, K / 32) float8_e8m0fnu scales (or uint8), blocks along K.
        w_q: (E, N, K) codes; w_s: (E, N, K / 32) scales, blocks along K.
        offsets: (E,) int32 cumulative row ends, non-decreasing, on the operands' device.
        out_dtype: torch.bfloat16 (default) or torch.float32.
        order: tile order, :class:`TileOrder` (results are identical across orders).
        config: launch settings (default ``TUNING["nt"]``).

    Returns:
        (T, N) ``out_dtype``; rows at and past offsets[-1] are zeros (never read).

    Raises:
        TypeError: wrong dtypes. ValueError: shapes disagree, K not a multiple of 32,
        operands on different devices or on the CPU outside the interpreter.
    """
    return _launch_nt(x_q, x_s, w_q, w_s, offsets, out_dtype, order, config, ("x", "w"))


def triton_mx_grouped_mm_nn(
    dy_q: Tensor, dy_s: Tensor, wt_q: Tensor, wt_s: Tensor, offsets: Tensor, *,
    out_dtype: torch.dtype = torch.bfloat16, order: TileOrder | str = TileOrder.SUPERGROUPED,
    config: GemmConfig | None = None,
) -> Tensor:
    """Dgrad: dx[t] = dy[t] @ w[e] for the rows t of expert e, from MXFP8 operands.

    Args:
        dy_q: (T, N) codes, N a multiple of 32; dy_s: (T, N / 32) scales (blocks along N).
        wt_q: (E, K, N) codes: the column-wise copy of w (E, N, K), blocks along N, stored
            transposed (what ``quantize_colwise(w)`` returns); wt_s: (E, K, N / 32).
        offsets, out_dtype, order, config: as :func:`triton_mx_grouped_mm_nt`.

    Returns:
        (T, K) ``out_dtype``; rows at and past offsets[-1] are zeros.

    Raises:
        As :func:`triton_mx_grouped_mm_nt`.
    """
    return _launch_nt(dy_q, dy_s, wt_q, wt_s, offsets, out_dtype, order, config, ("dy", "w^T"))


def triton_mx_grouped_mm_tn(
    dyt_q: Tensor, dyt_s: Tensor, xt_q: Tensor, xt_s: Tensor, padded_offsets: Tensor, *,
    out_dtype: torch.dtype = torch.float32, order: TileOrder | str = TileOrder.SUPERGROUPED,
    config: GemmConfig | None = None,
) -> Tensor:
    """Wgrad: dw[e] = dy_e^T @ x_e, contracting over expert e's tokens, from MXFP8 operands
    in the per-expert padded token layout (:mod:`mxmoe.numerics.grouped`).

    Args:
        dyt_q: (N, Lp) codes of dy^T, blocks along tokens, each expert's tokens starting at
            a multiple of 32 (``quantize_grouped_colwise(dy, offsets)``); dyt_s: (N, Lp / 32).
        xt_q: (K, Lp) codes of x^T in the same layout; xt_s: (K, Lp / 32).
        padded_offsets: (E,) int32 cumulative ends in the padded layout, multiples of 32.
        out_dtype: torch.float32 (default) or torch.bfloat16.
        order, config: as :func:`triton_mx_grouped_mm_nt` (default ``TUNING["tn"]``).

    Returns:
        (E, N, K) ``out_dtype``; experts with no tokens get exact zeros.

    Raises:
        As :func:`triton_mx_grouped_mm_nt`; ValueError if the two operands' Lp differ.
    """
    order = TileOrder.parse(order)
    _check_out_dtype(out_dtype)
    _check_device(dyt_q, dyt_s, xt_q, xt_s)
    a8, as8 = _check_pair(dyt_q, dyt_s, "dy^T", 2)
    b8, bs8 = _check_pair(xt_q, xt_s, "x^T", 2)
    (N, Lp), (K, Lb) = a8.shape, b8.shape
    if Lp != Lb:
        raise ValueError(f"dy^T (N, {Lp}) and x^T (K, {Lb}) must share the padded token length")
    if padded_offsets.dim() != 1:
        raise ValueError(f"padded_offsets must be 1-D (E,), got shape {tuple(padded_offsets.shape)}")
    E = padded_offsets.numel()
    offs = _check_offsets(padded_offsets, E, a8.device)
    out = torch.empty(E, N, K, dtype=out_dtype, device=a8.device)
    if E == 0 or N == 0 or K == 0:
        return out
    if Lp == 0:
        return out.zero_()
    cfg = _resolve("tn", config)
    max_tiles = E * triton.cdiv(N, cfg.block_m) * triton.cdiv(K, cfg.block_n)
    interp = interpreting()
    tg._mx_grouped_gemm_tn_kernel[(_n_programs(cfg, max_tiles, a8.device),)](
        a8, as8, b8, bs8, out, offs, N, K, Lp, E,
        1 if order is TileOrder.ROW_MAJOR else cfg.group_m, int(order is TileOrder.SPREAD),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DEQUANT=_DEQUANT_CODES[Dequant(cfg.dequant)], SCALE_GATHER=cfg.scale_gather,
        DOT_DTYPE=tl.float32 if interp else tl.bfloat16, SOFT_CASTS=interp,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ---- design (c): the weight quantized inside the GEMM ---------------------------------------

# Launch settings of the design (c) kernel (benchmarks/grouped_gemm_wq.py sweeps them).
WQ_TUNING = GemmConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)


def triton_grouped_mm_wq(a: Tensor, w: Tensor, offsets: Tensor, *, fmt: str = "e4m3", mode: str = "rceil",
                         dgrad: bool = False, out_dtype: torch.dtype = torch.bfloat16,
                         config: GemmConfig | None = None) -> Tensor:
    """Forward or dgrad grouped GEMM with the raw weight quantized inside the GEMM (design (c)).

    The activation operand comes already quantized and dequantized (a quantize pass); each
    weight tile is read in its own dtype, quantized to MX along the GEMM's contraction and
    dequantized in registers, bit for bit the values :func:`mxmoe.ops.quantize.fake_quantize`
    writes, so the result agrees with design (a) (the same operands through
    ``torch._grouped_mm``) to float32 accumulation order. No pass over the weight.

    Args:
        a: (T, C) bfloat16, the dequantized MX values of x (forward, C = K, blocks along K)
            or of dy (dgrad, C = N, blocks along N), rows sorted by expert.
        w: (E, N, K) bfloat16 or float32 raw expert weights (any strides).
        offsets: (E,) int32 cumulative row ends, non-decreasing, on a's device.
        fmt, mode: the MX element format ('e4m3' or 'e5m2') and scale rule ('floor' or
            'rceil') of the weight's quantization.
        dgrad: False: out = a w[e]^T (T, N), w blocked along K; True: out = a w[e] (T, K),
            w blocked along N.
        out_dtype: torch.bfloat16 (default) or torch.float32.
        config: launch settings (default ``WQ_TUNING``; block_k a multiple of 32).

    Returns:
        (T, N) forward or (T, K) dgrad in ``out_dtype``; rows at and past offsets[-1] are zeros.

    Raises:
        TypeError: a not bfloat16, w not bfloat16/float32, wrong out_dtype.
        ValueError: shapes disagree, devices differ, CPU tensors outside the interpreter,
            an unknown format or scale rule.
    """
    _check_out_dtype(out_dtype)
    _check_device(a, w)
    if a.dtype != torch.bfloat16:
        raise TypeError(f"a has dtype {a.dtype}; design (c) takes the bfloat16 dequantized activation")
    if w.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"w has dtype {w.dtype}; expected torch.bfloat16 or torch.float32")
    if a.dim() != 2 or w.dim() != 3:
        raise ValueError(f"expected a (T, C) and w (E, N, K), got {tuple(a.shape)} and {tuple(w.shape)}")
    E, N, K = w.shape
    Kc, N_out = (N, K) if dgrad else (K, N)
    if a.shape[1] != Kc:
        raise ValueError(f"a (T, {a.shape[1]}) does not match w {tuple(w.shape)}: the contraction is "
                         f"{'N' if dgrad else 'K'} = {Kc}")
    elem, _, mode_code = _codes(fmt, mode)
    a = a.contiguous()
    offs = _check_offsets(offsets, E, a.device)
    T = a.shape[0]
    out = torch.empty(T, N_out, dtype=out_dtype, device=a.device)
    if T == 0 or N_out == 0:
        return out
    if E == 0 or Kc == 0:
        return out.zero_()
    interp = interpreting()
    cfg = config or (INTERPRETER_CONFIG if interp else WQ_TUNING)
    s_e, s_n, s_k = w.stride()
    stride_wn, stride_wk = (s_k, s_n) if dgrad else (s_n, s_k)  # output index, contraction index
    max_tiles = (T // cfg.block_m + E + 1) * triton.cdiv(N_out, cfg.block_n)
    tg._mx_grouped_gemm_wq_kernel[(max_tiles,)](
        a, w, out, offs, T, N_out, Kc, E, s_e, stride_wn, stride_wk, cfg.group_m,
        G_POW2=triton.next_power_of_2(E + 1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        ELEM=elem, MODE=mode_code, HW_ROUND=0 if interp else 1, SOFT_CASTS=interp,
        DOT_DTYPE=tl.float32 if interp else tl.bfloat16, EVEN_K=Kc % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=1 if interp else cfg.num_stages,
    )
    return out


# ---- custom ops (default launch settings) ---------------------------------------------------

@torch.library.custom_op("mxmoe::mx_grouped_mm_nt", mutates_args=())
def mx_grouped_mm_nt_op(x_q: Tensor, x_s: Tensor, w_q: Tensor, w_s: Tensor, offsets: Tensor,
                        out_dtype: torch.dtype = torch.bfloat16, order: str = "supergrouped") -> Tensor:
    """:func:`triton_mx_grouped_mm_nt` as an op: (T, K), (E, N, K) -> (T, N)."""
    return triton_mx_grouped_mm_nt(x_q, x_s, w_q, w_s, offsets, out_dtype=out_dtype, order=order)


@mx_grouped_mm_nt_op.register_fake
def _(x_q, x_s, w_q, w_s, offsets, out_dtype=torch.bfloat16, order="supergrouped"):
    return x_q.new_empty(x_q.shape[0], w_q.shape[1], dtype=out_dtype)


@torch.library.custom_op("mxmoe::mx_grouped_mm_nn", mutates_args=())
def mx_grouped_mm_nn_op(dy_q: Tensor, dy_s: Tensor, wt_q: Tensor, wt_s: Tensor, offsets: Tensor,
                        out_dtype: torch.dtype = torch.bfloat16, order: str = "supergrouped") -> Tensor:
    """:func:`triton_mx_grouped_mm_nn` as an op: (T, N), (E, K, N) -> (T, K)."""
    return triton_mx_grouped_mm_nn(dy_q, dy_s, wt_q, wt_s, offsets, out_dtype=out_dtype, order=order)


@mx_grouped_mm_nn_op.register_fake
def _(dy_q, dy_s, wt_q, wt_s, offsets, out_dtype=torch.bfloat16, order="supergrouped"):
    return dy_q.new_empty(dy_q.shape[0], wt_q.shape[1], dtype=out_dtype)


@torch.library.custom_op("mxmoe::mx_grouped_mm_tn", mutates_args=())
def mx_grouped_mm_tn_op(dyt_q: Tensor, dyt_s: Tensor, xt_q: Tensor, xt_s: Tensor, padded_offsets: Tensor,
                        out_dtype: torch.dtype = torch.float32, order: str = "supergrouped") -> Tensor:
    """:func:`triton_mx_grouped_mm_tn` as an op: (N, Lp), (K, Lp) -> (E, N, K)."""
    return triton_mx_grouped_mm_tn(dyt_q, dyt_s, xt_q, xt_s, padded_offsets, out_dtype=out_dtype, order=order)


@mx_grouped_mm_tn_op.register_fake
def _(dyt_q, dyt_s, xt_q, xt_s, padded_offsets, out_dtype=torch.float32, order="supergrouped"):
    return dyt_q.new_empty(padded_offsets.shape[0], dyt_q.shape[0], xt_q.shape[0], dtype=out_dtype)
