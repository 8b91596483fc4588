"""Per-expert token blocks: the layout of the MoE weight-gradient operands.

In dW_e = dY_e^T X_e the contraction runs over expert e's own tokens, so a 32-block must
not straddle two experts (docs/NUMERICS.md). The tokens (rows of a (T, C) tensor sorted
by expert, expert e owning rows offsets[e-1]:offsets[e]) are therefore quantized into a
transposed, per-expert padded layout (C, Tp):

- expert e's tokens start at column 32 * block_start[e], where block_start is the
  exclusive cumulative sum of max(1, ceil(n_e / 32)); its last block is zero padded, and
  an expert with no tokens gets one block of zeros, so that a grouped GEMM over this
  layout writes every expert's weight gradient itself, exact zeros for an empty expert
  (no separate zeroing pass; ``torch._grouped_mm`` leaves the matrices of empty groups
  unwritten);
- Tp = 32 * (T // 32 + E), a bound known without reading the offsets on the host
  (sum_e max(1, ceil(n_e / 32)) <= sum_e (n_e // 32 + 1) <= T // 32 + E), so nothing
  synchronizes; columns past the last expert are zeros with scale byte 0;
- ``padded_offsets[e] = 32 * block_start[e + 1]`` are the cumulative ends in that layout,
  what a grouped GEMM over the padded token dimension takes.

Rows past offsets[-1] belong to no expert and are never read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import MX_BLOCK_SIZE, ElemFormat, ScaleMode
from .mx_tensor import torch_quantize_mx


def padded_group_layout(offsets_E: Tensor, n_rows: int, block_size: int = MX_BLOCK_SIZE,
                        empty_block: bool = True) -> tuple[Tensor, Tensor, int]:
    """Block starts, padded offsets and padded length of the per-expert layout.

    Args:
        offsets_E: (E,) int32/int64 cumulative token ends, non-decreasing, on any device.
        n_rows: T. block_size: tokens per block (32).
        empty_block: an expert without tokens gets one block of zeros (the MoE wgrad
            layout, module docstring); False: none (the 128-row groups of the Blackwell
            scale layout, :func:`mxmoe.ops.sm100.blocked_scales_m_groups`).

    Returns:
        ``(block_starts, padded_offsets, Tp)``: int32 (E + 1,) cumulative block counts
        starting at 0; int32 (E,) cumulative padded token ends; the padded length
        block_size * (T // block_size + E).
    """
    ends = offsets_E.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    blocks = (sizes + block_size - 1) // block_size
    if empty_block:
        blocks = torch.clamp(blocks, min=1)  # an empty expert: one block of zeros
    block_starts = torch.cat([blocks.new_zeros(1), torch.cumsum(blocks, 0)]).to(torch.int32)
    padded_offsets = (block_starts[1:] * block_size).to(torch.int32)
    return block_starts, padded_offsets, block_size * (n_rows // block_size + offsets_E.numel())


def scatter_to_padded_groups(x_TC: Tensor, offsets_E: Tensor, block_size: int = MX_BLOCK_SIZE,
                             empty_block: bool = True) -> tuple[Tensor, Tensor]:
    """(T, C) rows sorted by expert -> (Tp, C) with each expert's rows at its padded start,
    zeros elsewhere; also returns the padded offsets. No host synchronization.
    ``empty_block``: as :func:`padded_group_layout`."""
    T, C = x_TC.shape
    block_starts, padded_offsets, Tp = padded_group_layout(offsets_E, T, block_size, empty_block)
    E = offsets_E.numel()
    if E == 0:
        return x_TC.new_zeros(Tp, C), padded_offsets
    ends = offsets_E.to(torch.int64)
    rows = torch.arange(T, device=x_TC.device)
    group = torch.searchsorted(ends, rows, right=True)  # E for rows past the last offset
    valid = group < E
    g = group.clamp(max=max(E - 1, 0))
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    dest = torch.where(valid, block_starts[g].to(torch.int64) * block_size + rows - starts[g], Tp)
    padded = x_TC.new_zeros(Tp + 1, C)  # the extra row receives rows past the last offset
    padded.index_copy_(0, dest, x_TC)
    return padded[:Tp], padded_offsets


def torch_quantize_grouped_dim0(
    x_TC: Tensor, offsets_E: Tensor, fmt: ElemFormat | str = ElemFormat.E4M3,
    scale_mode: ScaleMode | str = ScaleMode.RCEIL,
) -> tuple[Tensor, Tensor, Tensor]:
    """Reference: quantize rows per expert into the transposed padded layout.

    Args:
        x_TC: (T, C) float32/bfloat16 rows sorted by expert (any strides).
        offsets_E: (E,) int32 cumulative token ends.
        fmt, scale_mode: as :func:`~mxmoe.quantize_mx`.

    Returns:
        ``(qdata, scale, padded_offsets)``: element codes (C, Tp) in the format's storage
        dtype, E8M0 scales (C, Tp / 32), int32 (E,) padded cumulative ends.
    """
    padded, padded_offsets = scatter_to_padded_groups(x_TC, offsets_E)
    mx = torch_quantize_mx(padded.t(), fmt, dim=1, scale_mode=scale_mode)  # blocks along tokens
    return mx.qdata, mx.scale, padded_offsets
