"""Zero the rows of a grouped-GEMM output past the last group, in place, without reading
the offsets on the host.

``torch._grouped_mm`` leaves the rows past ``offsets[-1]`` unwritten. A masked
``torch.where`` over the whole output costs a full read and write of it; this kernel
reads ``offsets[-1]`` on the device and stores zeros only at rows >= it, so when every row
belongs to a group (the MoE layer's case) it moves no data. CUDA tensors, or CPU tensors
under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_R, BLOCK_C = 32, 256


@triton.jit
def _zero_rows_from_kernel(out_ptr, ends_ptr, E, T, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    end = tl.load(ends_ptr + E - 1).to(tl.int64)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(1).to(tl.int64) * BLOCK_R + BLOCK_R > end:  # uniform: tiles wholly in a group skip
        cols = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = ((rows >= end) & (rows < T))[:, None] & (cols < C)[None, :]
        zero = tl.zeros((BLOCK_R, BLOCK_C), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], zero, mask=mask)


def zero_rows_past_end_(out_TC: Tensor, offsets_E: Tensor) -> Tensor:
    """Set rows ``offsets_E[-1]:`` of the contiguous (T, C) ``out_TC`` to zero, in place;
    returns it. offsets_E: (E,) int32/int64 on the same device, E >= 1."""
    if not out_TC.is_contiguous() or out_TC.dim() != 2:
        raise ValueError(f"zero_rows_past_end_ needs a contiguous 2-D tensor, got shape {tuple(out_TC.shape)}")
    T, C = out_TC.shape
    if T and C:
        grid = (triton.cdiv(C, BLOCK_C), triton.cdiv(T, BLOCK_R))
        _zero_rows_from_kernel[grid](out_TC, offsets_E.contiguous(), offsets_E.numel(), T, C,
                                     BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    return out_TC


__all__ = ["zero_rows_past_end_"]
