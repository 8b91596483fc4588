"""Quantize-dequantize ("fake quantization") of GEMM operands, as the recipe prescribes.

The emulated MXFP8 GEMMs of :mod:`mxmoe.ops.linear` and :mod:`mxmoe.ops.grouped_mm`
quantize each operand along its contraction dimension and multiply the dequantized
values; the product of two dequantized MXFP8 operands is exactly the product of the FP8
elements times the two scales, so a float32 (or bf16 tensor-core) GEMM on them computes
what a block-scaled MXFP8 GEMM computes, up to accumulation order.

Legend of shape suffixes: T tokens (rows), C columns, E experts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..numerics.qdq import fake_quantize_mx
from ..recipe import Recipe


def fake_quantize(x: Tensor, recipe: Recipe, dim: int, out_dtype: torch.dtype) -> Tensor:
    """Quantize ``x`` along ``dim`` with the recipe's format and scale rule, dequantize.

    The size along ``dim`` need not be a multiple of the block size: the tail block is
    zero padded (exact for a GEMM whose contraction runs along ``dim``).

    Args:
        x: float32/bfloat16/float16, any shape.
        recipe: a quantizing recipe (``recipe.quantize`` is True).
        dim: blocked dimension (the contraction dimension of the GEMM that reads it).
        out_dtype: dtype of the result (the GEMM's operand dtype).

    Returns:
        Tensor of ``x``'s shape and ``out_dtype``, contiguous.
    """
    return fake_quantize_mx(x, recipe.fmt, block_size=recipe.block_size, dim=dim, scale_mode=recipe.scale_mode,
                            pad=True, out_dtype=out_dtype)


def group_padded_rows(offsets_E: Tensor, n_rows: int, block_size: int) -> tuple[Tensor, Tensor, int]:
    """Row map that gives each expert's token group its own whole blocks, without a sync.

    Group e holds rows ``offsets_E[e-1]:offsets_E[e]``. In the padded layout every group
    starts at a multiple of ``block_size``, so no block straddles two experts, and each
    group's last block is zero padded. The padded length is bounded by a static
    ``n_rows + E * (block_size - 1)`` rounded up, plus one block that receives the rows past
    the last offset (never read back), so nothing waits for the offsets on the host.

    Args:
        offsets_E: int32/int64 (E,), cumulative end row of each group, non-decreasing.
        n_rows: T, the number of rows of the tensor to regroup.
        block_size: block size along rows.

    Returns:
        ``(dest_T, valid_T, padded_rows)``: destination row of each source row in the
        padded layout (int64), whether the row belongs to a group, and the padded length.
    """
    device = offsets_E.device
    E = offsets_E.numel()
    ends = offsets_E.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_sizes = (sizes + block_size - 1) // block_size * block_size
    padded_starts = torch.cumsum(padded_sizes, 0) - padded_sizes
    rows = torch.arange(n_rows, device=device)
    group_T = torch.searchsorted(ends, rows, right=True)  # E for rows past the last offset
    valid_T = group_T < E
    g = group_T.clamp(max=max(E - 1, 0))
    bound = (n_rows + E * (block_size - 1) + block_size - 1) // block_size * block_size
    dest_T = torch.where(valid_T, padded_starts[g] + rows - (ends[g] - sizes[g]), bound)
    return dest_T, valid_T, bound + block_size


def fake_quantize_grouped_rows(x_TC: Tensor, offsets_E: Tensor, recipe: Recipe, out_dtype: torch.dtype) -> Tensor:
    """Quantize along rows (tokens) with each expert's rows blocked separately; dequantize.

    This is the wgrad operand rule of docs/NUMERICS.md: the contraction of
    dW_e = dY_e^T X_e runs over expert e's own tokens, so a 32-block never straddles two
    experts; each group's last block is zero padded (exact). Rows past the last offset
    come back as zeros. No device-to-host synchronization.

    Args:
        x_TC: (T, C) float32/bfloat16, rows sorted by expert.
        offsets_E: (E,) int32 cumulative end rows.
        recipe: a quantizing recipe.
        out_dtype: dtype of the result.

    Returns:
        (T, C) tensor of ``out_dtype``.
    """
    T, C = x_TC.shape
    dest_T, valid_T, padded_rows = group_padded_rows(offsets_E, T, recipe.block_size)
    padded = x_TC.new_zeros(padded_rows, C)
    padded.index_copy_(0, dest_T, x_TC)
    deq = fake_quantize(padded, recipe, dim=0, out_dtype=out_dtype)
    out = deq.index_select(0, dest_T)
    return torch.where(valid_T.unsqueeze(1), out, torch.zeros((), dtype=out_dtype, device=out.device))
