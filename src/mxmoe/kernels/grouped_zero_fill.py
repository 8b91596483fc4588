"""Zero the parts of a grouped-GEMM output that no group writes, in place, without
reading the offsets on the host: the rows past the last group (forward / dgrad) and the
weight gradients of experts with no tokens (wgrad).

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

from .quantize import _grid

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
    _zero_rows_past_end_op(out_TC, offsets_E)
    return out_TC


# torch.library custom ops (in place): under torch.compile the launches stay opaque calls
@torch.library.custom_op("mxmoe::zero_rows_past_end", mutates_args=("out_TC",))
def _zero_rows_past_end_op(out_TC: Tensor, offsets_E: Tensor) -> None:
    T, C = out_TC.shape
    if T and C:
        grid = _grid(triton.cdiv(C, BLOCK_C), triton.cdiv(T, BLOCK_R), what="zero rows past the end (rows)")
        _zero_rows_from_kernel[grid](out_TC, offsets_E.contiguous(), offsets_E.numel(), T, C,
                                     BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)


@_zero_rows_past_end_op.register_fake
def _(out_TC, offsets_E):
    return None


CHUNK = 1 << 16  # elements of one expert's matrix per program of the empty-group kernel


@triton.jit
def _zero_empty_groups_kernel(out_ptr, ends_ptr, MN, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    end = tl.load(ends_ptr + e)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    if end <= start:  # uniform: programs of experts with tokens store nothing
        base = out_ptr + e.to(tl.int64) * MN
        first = tl.program_id(1).to(tl.int64) * CHUNK
        for j in tl.range(0, CHUNK, BLOCK):
            idx = first + j + tl.arange(0, BLOCK)
            tl.store(base + idx, tl.zeros((BLOCK,), dtype=out_ptr.dtype.element_ty), mask=idx < MN)


def zero_empty_groups_(out_ENK: Tensor, offsets_E: Tensor) -> Tensor:
    """Set ``out_ENK[e]`` to zero for every expert e with no tokens (offsets_E[e] <=
    offsets_E[e - 1], offsets_E[-1] read as 0), in place; returns it. A wgrad from
    ``torch._grouped_mm`` leaves those matrices unwritten; a ``torch.where`` over the
    whole (E, N, K) output would read and write all of it, this kernel writes only the
    empty experts' matrices. out_ENK: contiguous (E, N, K); offsets_E: (E,) int32/int64
    cumulative token ends on the same device.

    Raises:
        ValueError: out_ENK not contiguous 3-D; offsets not (E,) int32/int64 on its device."""
    if not out_ENK.is_contiguous() or out_ENK.dim() != 3:
        raise ValueError(f"zero_empty_groups_ needs a contiguous 3-D tensor, got shape {tuple(out_ENK.shape)}")
    E = out_ENK.shape[0]
    if offsets_E.shape != (E,) or offsets_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offsets must be an int32/int64 tensor of shape ({E},), got {offsets_E.dtype} "
                         f"{tuple(offsets_E.shape)}")
    if offsets_E.device != out_ENK.device:
        raise ValueError(f"offsets are on {offsets_E.device}, the output on {out_ENK.device}")
    _zero_empty_groups_op(out_ENK, offsets_E)
    return out_ENK


@torch.library.custom_op("mxmoe::zero_empty_groups", mutates_args=("out_ENK",))
def _zero_empty_groups_op(out_ENK: Tensor, offsets_E: Tensor) -> None:
    E = out_ENK.shape[0]
    MN = out_ENK[0].numel() if E else 0
    if E and MN:
        grid = _grid(E, triton.cdiv(MN, CHUNK), what="zero empty groups")
        _zero_empty_groups_kernel[grid](out_ENK, offsets_E.contiguous(), MN, CHUNK=CHUNK, BLOCK=4096, num_warps=8)


@_zero_empty_groups_op.register_fake
def _(out_ENK, offsets_E):
    return None


__all__ = ["zero_empty_groups_", "zero_rows_past_end_"]
