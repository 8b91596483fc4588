"""Native MXFP8 grouped GEMM on sm100 (Blackwell) through PyTorch's block-scaled grouped GEMM.

**Untested on hardware.** This project has no Blackwell GPU. Everything here is checked on
the CPU only, against an emulator of the PyTorch op that enforces the argument rules below
(``tests/ops/test_sm100.py``). Treat the first run on a B200/B300 as the first real test
(``tests/gpu`` compares it against float64 products).

What PyTorch runs: ``torch._scaled_grouped_mm`` (or, where it exists,
``torch.nn.functional.scaled_grouped_mm`` with ``ScalingType.BlockWise1x32`` and
``SwizzleType.SWIZZLE_32_4_4``, which lands on the same kernel). For E4M3 data with E8M0
scales it dispatches to the FBGEMM/MSLK CUTLASS kernel ``mx8mx8bf16_grouped_mm``
(pytorch ``aten/src/ATen/native/cuda/GroupedBlas.cpp``: ``_scaled_grouped_mm_cuda``,
``_scaled_grouped_mm_cuda_v2``, ``_mx8_mx8_bf16_grouped_mm_fbgemm``,
``_check_scales_blocked``; FBGEMM ``fbgemm_gpu/experimental/gen_ai/src/quantize/``
``mx8mx8bf16_grouped.cu`` and ``cutlass_extensions/mx8mx8bf16_grouped/``
``mx8mx8bf16_grouped_common.cuh``: ``set_stacked_kernel_args_kernel``). Its rules:

- device capability major 9 or 10 (``_scaled_mm_allowed_device(sm90_only, sm100_only)``),
  and the kernel is built for sm100 only, so MXFP8 needs major == 10 (B200 10.0,
  B300 10.3); sm120 is refused. The build must have FBGEMM GenAI / MSLK.
- ``mat_a`` 2-D ``float8_e4m3fn`` row-major contiguous, ``mat_a.size(-1) % 16 == 0``;
  ``mat_b`` column-major (``mat_b.transpose(-2, -1).is_contiguous()``), both of its last
  two sizes multiples of 16; ``offs`` int32, 1-D, contiguous, cumulative group ends;
  output bfloat16 only; scales ``float8_e8m0fnu``, contiguous.
- 2d-3d (forward, dgrad), groups along M: ``mat_a`` (total_M, K), ``mat_b`` (G, K, N).
  ``scale_b`` is (G, round_up(K / 32, 4) * round_up(N, 128)): each expert's (N, K / 32)
  scales in the blocked layout. ``scale_a`` is 2-D with at least total_M rows; group g's
  blocked (n_g, K / 32) scales start at row sum_{i<g} round_up(n_i, 128) of a
  (rows, round_up(K / 32, 4)) matrix. Group sizes need not be multiples of anything.
  Rows past the last offset are not written (the output is ``empty``), and when
  total_M // G == 0 the kernel returns without writing anything (``mx8mx8bf16_grouped_mm``
  divides M by G for its heuristics and exits early on 0).
- 2d-2d (wgrad), groups along K: ``mat_a`` (M, total_K), ``mat_b`` (total_K, N), output
  (G, M, N). Group sizes must be multiples of 16 (device assert) and, for the scale
  offsets to be right, of 32 (the kernel uses group_size / 32). Group g's blocked
  (M, k_g / 32) scales start at element round_up(M, 128) * sum_{i<g} round_up(k_i / 32, 4).
  Empty groups are not written.

So the wrappers here: pad K / N to the sizes above with zeros (exact), feed the wgrad the
per-expert padded token layout of :mod:`mxmoe.numerics.grouped` (every group a multiple
of 32), pad the token dimension to at least E rows, and zero what the kernel leaves
unwritten (rows past the last offset, experts with no tokens). The output is bfloat16;
the GEMM accumulates in float32 on the tensor cores.

Legend: T tokens, K / N contraction and output features, E experts, L padded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..numerics.formats import MX_BLOCK_SIZE
from ..numerics.grouped import scatter_to_padded_groups, torch_quantize_grouped_dim0
from ..numerics.layout import BLOCKED_TILE_COLS, BLOCKED_TILE_ROWS, to_blocked_scales
from ..recipe import Recipe
from .backend import scaled_grouped_mm_api, use_triton_for
from .gemm import zero_rows_past_end
from .quantize import quantize_mx

DIM_ALIGN = 16  # torch: mat_a.size(-1), mat_b.size(-2), mat_b.size(-1) multiples of 16
NATIVE_OUT_DTYPE = torch.bfloat16  # the only output dtype of the MXFP8 grouped kernel
_SUBTILE_ROWS = 32
_TILE_BYTES = BLOCKED_TILE_ROWS * BLOCKED_TILE_COLS  # 512 bytes per 128 x 4 scale tile


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


# ---- scale layouts ------------------------------------------------------------------

def blocked_scales_3d(scale_ERC: Tensor) -> Tensor:
    """Per-expert blocked scales of a 3-D operand: (E, R, C) -> (E, round_up(R, 128) * round_up(C, 4)),
    contiguous e8m0 (what ``_check_scales_blocked`` asks of a (G, K, N) ``mat_b`` with
    R = N, C = K / 32)."""
    return to_blocked_scales(scale_ERC)


def blocked_scales_m_groups(scale_TC: Tensor, offsets_E: Tensor) -> Tensor:
    """Blocked scales of a 2-D operand whose groups run along its rows (tokens).

    Group g's (n_g, C) scale rows are blocked on their own and start at row
    sum_{i<g} round_up(n_i, 128) of the result (each group zero padded to 128 rows), which
    is the blocked layout of the row-major matrix holding each group's rows at those
    starts. Rows past offsets[-1] are dropped. No host synchronization.

    Args:
        scale_TC: (T, C) E8M0 scales (C = K / 32), rows sorted by expert.
        offsets_E: (E,) int32/int64 cumulative row ends.

    Returns:
        (R, round_up(C, 4)) contiguous e8m0 with R = 128 * (T // 128 + E) >= T rows
        (a bound known without reading the offsets); padding bytes are 0.
    """
    T, C = scale_TC.shape
    padded, _ = scatter_to_padded_groups(scale_TC.view(torch.uint8), offsets_E, BLOCKED_TILE_ROWS, empty_block=False)
    R = padded.shape[0]
    return to_blocked_scales(padded.view(scale_TC.dtype)).view(R, _ceil_to(C, BLOCKED_TILE_COLS))


def blocked_scales_k_groups(scale_RC: Tensor, offsets_E: Tensor) -> Tensor:
    """Blocked scales of a 2-D operand whose groups run along its scale columns (the
    contraction of the wgrad: tokens, in the per-expert padded layout).

    Group g owns scale columns offsets[g-1] / 32 .. offsets[g] / 32 (offsets multiples of
    32); its (R, nb_g) scales are blocked on their own, padded to (round_up(R, 128),
    round_up(nb_g, 4)), and start at element round_up(R, 128) * sum_{i<g} round_up(nb_i, 4)
    (FBGEMM ``set_stacked_kernel_args_kernel``, 2D2D case). Columns past offsets[-1] / 32
    are dropped. No host synchronization.

    Args:
        scale_RC: (R, C) E8M0 scales, C = L / 32 block columns along the padded tokens.
        offsets_E: (E,) int32/int64 cumulative ends along L, multiples of 32.

    Returns:
        (round_up(R, 128), C + 4 * E) contiguous e8m0 (an upper bound on the padded
        column count); padding bytes are 0.
    """
    R, C = scale_RC.shape
    E = offsets_E.numel()
    R128 = _ceil_to(R, BLOCKED_TILE_ROWS)
    cols = C + BLOCKED_TILE_COLS * E
    total = R128 * cols
    dev = scale_RC.device
    out = torch.zeros(total + 1, dtype=torch.uint8, device=dev)  # last byte: sink for dropped columns
    if E == 0 or R == 0 or C == 0:
        return out[:total].view(R128, cols).view(scale_RC.dtype)
    ends = offsets_E.to(torch.int64) // MX_BLOCK_SIZE  # cumulative block-column ends
    nb = torch.diff(ends, prepend=ends.new_zeros(1))
    ncb = (nb + BLOCKED_TILE_COLS - 1) // BLOCKED_TILE_COLS  # 4-column tiles per group
    tile_col_start = torch.cumsum(ncb, 0) - ncb  # tiles before group g
    j = torch.arange(C, device=dev)
    g = torch.searchsorted(ends, j, right=True)  # group of block column j (E past the end)
    valid = g < E
    g = g.clamp(max=E - 1)
    local = j - (ends - nb)[g]
    col_term = (R128 * BLOCKED_TILE_COLS * tile_col_start[g] + (local // BLOCKED_TILE_COLS) * _TILE_BYTES
                + local % BLOCKED_TILE_COLS)  # (C,)
    r = torch.arange(R, device=dev)
    row_tile = (r // BLOCKED_TILE_ROWS).view(R, 1)
    row_term = ((r % _SUBTILE_ROWS) * 16 + ((r % BLOCKED_TILE_ROWS) // _SUBTILE_ROWS) * BLOCKED_TILE_COLS).view(R, 1)
    dest = row_term + row_tile * (ncb[g] * _TILE_BYTES).view(1, C) + col_term.view(1, C)
    dest = torch.where(valid.view(1, C), dest, total)
    out.index_put_((dest.reshape(-1),), scale_RC.view(torch.uint8).reshape(-1))
    return out[:total].view(R128, cols).view(scale_RC.dtype)


# ---- arguments and the call -----------------------------------------------------------

@dataclass
class ScaledGroupedMMArgs:
    """Exactly what the PyTorch op receives (positional order of ``torch._scaled_grouped_mm``).

    Attributes:
        mat_a: (M, K) float8_e4m3fn row-major.
        mat_b: (G, K, N) or (K, N) float8_e4m3fn column-major.
        scale_a, scale_b: 2-D contiguous float8_e8m0fnu in the blocked layouts above.
        offs: (G,) int32 cumulative group ends (along M for 2d-3d, along K for 2d-2d).
    """

    mat_a: Tensor
    mat_b: Tensor
    scale_a: Tensor
    scale_b: Tensor
    offs: Tensor


def call_scaled_grouped_mm(args: ScaledGroupedMMArgs) -> Tensor:
    """Call the native op (bfloat16 output). Raises RuntimeError where torch has neither API."""
    api = scaled_grouped_mm_api()
    if api == "functional":
        F = torch.nn.functional
        return F.scaled_grouped_mm(
            args.mat_a, args.mat_b,
            args.scale_a, F.ScalingType.BlockWise1x32,
            args.scale_b, F.ScalingType.BlockWise1x32,
            swizzle_a=F.SwizzleType.SWIZZLE_32_4_4, swizzle_b=F.SwizzleType.SWIZZLE_32_4_4,
            offs=args.offs, output_dtype=NATIVE_OUT_DTYPE,
        )
    if api == "private":
        return torch._scaled_grouped_mm(args.mat_a, args.mat_b, args.scale_a, args.scale_b,
                                        offs=args.offs, out_dtype=NATIVE_OUT_DTYPE)
    raise RuntimeError(f"torch {torch.__version__} has no _scaled_grouped_mm; use the emulated path")


def _quantize(x: Tensor, recipe: Recipe, dim: int):
    mx = quantize_mx(x, recipe.fmt, block_size=recipe.block_size, dim=dim, scale_mode=recipe.scale_mode,
                     pad=True, backend=recipe.backend)
    return mx.qdata, mx.scale


def _pad_dim(x: Tensor, dim: int, multiple: int) -> Tensor:
    size = x.shape[dim]
    pad = _ceil_to(size, multiple) - size
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _rows_at_least(x: Tensor, rows: int) -> Tensor:
    """Zero rows appended up to ``rows`` (the kernel exits early, leaving its output
    unwritten, when total_M // G == 0)."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def native_args_nt(x_TK: Tensor, w_ENK: Tensor, offsets_E: Tensor, recipe: Recipe) -> ScaledGroupedMMArgs:
    """Forward out = x w_e^T (2d-3d): x and w quantized along K (zero padded to 32);
    w's N padded to 16; x padded to at least E rows."""
    E = w_ENK.shape[0]
    xq, xs = _quantize(_rows_at_least(x_TK, E), recipe, dim=1)  # (T', Kp), (T', Kp / 32)
    wq, ws = _quantize(_pad_dim(w_ENK, 1, DIM_ALIGN), recipe, dim=2)  # (E, Np, Kp), (E, Np, Kp / 32)
    return ScaledGroupedMMArgs(
        mat_a=xq.contiguous(),
        mat_b=wq.transpose(-2, -1),  # (E, Kp, Np), column-major
        scale_a=blocked_scales_m_groups(xs, offsets_E),
        scale_b=blocked_scales_3d(ws),
        offs=offsets_E.to(torch.int32).contiguous(),
    )


def native_args_nn(dy_TN: Tensor, w_ENK: Tensor, offsets_E: Tensor, recipe: Recipe) -> ScaledGroupedMMArgs:
    """Dgrad dx = dy w_e (2d-3d): dy and w quantized along N (zero padded to 32); w's K
    padded to 16; dy padded to at least E rows."""
    E = w_ENK.shape[0]
    dyq, dys = _quantize(_rows_at_least(dy_TN, E), recipe, dim=1)  # (T', Np), (T', Np / 32)
    wt_EKN = _pad_dim(w_ENK.transpose(1, 2), 1, DIM_ALIGN)  # (E, Kp, N)
    wq, ws = _quantize(wt_EKN, recipe, dim=2)  # (E, Kp, Np) contiguous, (E, Kp, Np / 32)
    return ScaledGroupedMMArgs(
        mat_a=dyq.contiguous(),
        mat_b=wq.transpose(-2, -1),  # (E, Np, Kp), column-major
        scale_a=blocked_scales_m_groups(dys, offsets_E),
        scale_b=blocked_scales_3d(ws),
        offs=offsets_E.to(torch.int32).contiguous(),
    )


def _quantize_grouped_tokens(x_TC: Tensor, offsets_E: Tensor, recipe: Recipe) -> tuple[Tensor, Tensor, Tensor]:
    """(C, L) codes, (C, L / 32) scales and padded offsets, each expert's tokens in their
    own blocks (the Triton kernel on CUDA where the recipe's backend allows it)."""
    if use_triton_for(x_TC, recipe):
        from ..kernels.quantize import quantize_grouped_colwise

        return quantize_grouped_colwise(x_TC, offsets_E.to(torch.int32), recipe.fmt.value, recipe.scale_mode.value)
    return torch_quantize_grouped_dim0(x_TC, offsets_E, recipe.fmt, recipe.scale_mode)


def native_args_tn(dy_TN: Tensor, x_TK: Tensor, offsets_E: Tensor, recipe: Recipe) -> ScaledGroupedMMArgs:
    """Wgrad dw_e = dy_e^T x_e (2d-2d over the per-expert padded token layout, every group
    a multiple of 32 tokens): dy and x quantized along tokens per expert; x's K padded
    to 16."""
    dyq, dys, padded_offsets = _quantize_grouped_tokens(dy_TN, offsets_E, recipe)  # (N, L), (N, L / 32)
    xq, xs, _ = _quantize_grouped_tokens(_pad_dim(x_TK, 1, DIM_ALIGN), offsets_E, recipe)  # (Kp, L)
    return ScaledGroupedMMArgs(
        mat_a=dyq.contiguous(),
        mat_b=xq.contiguous().t(),  # (L, Kp), column-major
        scale_a=blocked_scales_k_groups(dys, padded_offsets),
        scale_b=blocked_scales_k_groups(xs, padded_offsets),
        offs=padded_offsets.to(torch.int32).contiguous(),
    )


def native_grouped_mm_nt(x_TK: Tensor, w_ENK: Tensor, offsets_E: Tensor, recipe: Recipe,
                         out_dtype: torch.dtype | None = None) -> Tensor:
    """Forward out[t] = x[t] @ w[e(t)]^T on the native MXFP8 kernel (untested on hardware).

    Args:
        x_TK: (T, K) float32/bfloat16, rows sorted by expert; w_ENK: (E, N, K);
        offsets_E: (E,) int32 cumulative ends; recipe: E4M3, block 32
        (:func:`recipe_supported`); out_dtype: result dtype (default x's).

    Returns:
        (T, N); rows past offsets[-1] are zeros. Values are bfloat16-rounded.
    """
    T, _ = x_TK.shape
    E, N, _ = w_ENK.shape
    out_dtype = out_dtype or x_TK.dtype
    if T == 0 or E == 0:
        return x_TK.new_zeros(T, N, dtype=out_dtype)
    out = call_scaled_grouped_mm(native_args_nt(x_TK, w_ENK, offsets_E, recipe))  # (T', Np)
    return zero_rows_past_end(out[:T, :N].to(out_dtype).contiguous(), offsets_E)


def native_grouped_mm_nn(dy_TN: Tensor, w_ENK: Tensor, offsets_E: Tensor, recipe: Recipe,
                         out_dtype: torch.dtype | None = None) -> Tensor:
    """Dgrad dx[t] = dy[t] @ w[e(t)] on the native MXFP8 kernel (untested on hardware).

    Returns:
        (T, K) in ``out_dtype`` (default dy's); rows past offsets[-1] are zeros.
    """
    T, _ = dy_TN.shape
    E, _, K = w_ENK.shape
    out_dtype = out_dtype or dy_TN.dtype
    if T == 0 or E == 0:
        return dy_TN.new_zeros(T, K, dtype=out_dtype)
    out = call_scaled_grouped_mm(native_args_nn(dy_TN, w_ENK, offsets_E, recipe))  # (T', Kp)
    return zero_rows_past_end(out[:T, :K].to(out_dtype).contiguous(), offsets_E)


def native_grouped_mm_tn(dy_TN: Tensor, x_TK: Tensor, offsets_E: Tensor, recipe: Recipe,
                         out_dtype: torch.dtype = torch.float32) -> Tensor:
    """Wgrad dw[e] = dy_e^T @ x_e on the native MXFP8 kernel (untested on hardware).

    Args:
        dy_TN: (T, N); x_TK: (T, K), rows sorted by expert; offsets_E: (E,) int32.

    Returns:
        (E, N, K) in ``out_dtype``; experts with no tokens get exact zeros.
    """
    T, N = dy_TN.shape
    K = x_TK.shape[1]
    E = offsets_E.numel()
    if T == 0 or E == 0:
        return dy_TN.new_zeros(E, N, K, dtype=out_dtype)
    out = call_scaled_grouped_mm(native_args_tn(dy_TN, x_TK, offsets_E, recipe))  # (E, N, Kp)
    out = out[:, :, :K].to(out_dtype)
    sizes = torch.diff(offsets_E.to(torch.int64), prepend=offsets_E.new_zeros(1, dtype=torch.int64))
    return torch.where((sizes > 0).view(E, 1, 1), out, torch.zeros((), dtype=out_dtype, device=out.device))


__all__ = [
    "ScaledGroupedMMArgs",
    "blocked_scales_3d",
    "blocked_scales_k_groups",
    "blocked_scales_m_groups",
    "call_scaled_grouped_mm",
    "native_args_nn",
    "native_args_nt",
    "native_args_tn",
    "native_grouped_mm_nn",
    "native_grouped_mm_nt",
    "native_grouped_mm_tn",
]
