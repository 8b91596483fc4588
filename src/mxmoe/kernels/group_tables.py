"""The argument tables of a pointer-array grouped GEMM (CUTLASS's ``GemmUniversalMode::kGrouped``:
:mod:`mxmoe.kernels.cutlass_mx_grouped_gemm`), made from the cumulative offsets on the
device in one launch: no host synchronization, and one kernel instead of the ten small torch
ops that build them otherwise (~1.5 us each in a graph replay on the H200: 16 us of a 300 us
forward at (T, K, N, E) = (16384, 2048, 1408, 64)). CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 256


# No value specialization: Triton would otherwise compile a new variant when an integer
# argument turns 1 or a multiple of 16 (T, E, the base addresses) or the offsets' address
# changes alignment, also inside a CUDA-graph capture (which the H200's torch 2.11 / Triton
# 3.6 allow; a compile there is avoidable work at best). One variant per offsets dtype (part
# of cutlass_mx_grouped_gemm's seen-shape key).
_SCALARS = ("E", "N", "K", "T", "w_base", "x_base", "out_base", "elem_bytes")


@triton.jit(do_not_specialize=_SCALARS, do_not_specialize_on_alignment=("ends_ptr",))
def _group_tables_kernel(ends_ptr, prob_ptr, pa_ptr, pb_ptr, pd_ptr, E, N, K, T, w_base, x_base, out_base,
                         elem_bytes, BLOCK: tl.constexpr):
    for start in range(0, E, BLOCK):
        e = start + tl.arange(0, BLOCK)
        m = e < E
        # clamped to 0 <= beg <= end <= T: offsets outside the contract (decreasing, past T)
        # give groups that may be empty, shortened or overlapping, never rows outside x and out
        end = tl.minimum(tl.maximum(tl.load(ends_ptr + e, mask=m, other=0).to(tl.int64), 0), T)
        beg = tl.minimum(tl.maximum(tl.load(ends_ptr + e - 1, mask=m & (e > 0), other=0).to(tl.int64), 0), T)
        end = tl.maximum(end, beg)
        tl.store(prob_ptr + 3 * e, N + tl.zeros((BLOCK,), tl.int32), mask=m)
        tl.store(prob_ptr + 3 * e + 1, (end - beg).to(tl.int32), mask=m)
        tl.store(prob_ptr + 3 * e + 2, K + tl.zeros((BLOCK,), tl.int32), mask=m)
        tl.store(pa_ptr + e, w_base + e.to(tl.int64) * N * K * elem_bytes, mask=m)
        tl.store(pb_ptr + e, x_base + beg * K * elem_bytes, mask=m)
        tl.store(pd_ptr + e, out_base + beg * N * elem_bytes, mask=m)


def group_tables(offsets_E: Tensor, w_ENK: Tensor, x_TK: Tensor, out_TN: Tensor) -> tuple[Tensor, ...]:
    """Per expert e (rows offsets[e-1]:offsets[e] of x and out, offsets[-1] read as 0):

    Returns:
        (problems, pa, pb, pd), the order of the C entry that takes them:
        problems: int32 (E, 3) rows (N, tokens of e, K), the GEMM of each expert with the
            weight as CUTLASS's M operand;
        pa, pb, pd: int64 (E,) device addresses of w[e], x[first row of e], out[first row of e].

    Args:
        offsets_E: (E,) int32 / int64 cumulative end rows (non-decreasing, at most T). Other
            values are clamped: each group is [offsets[e-1], offsets[e]] clamped to [0, T]
            (empty where it would be negative); groups may then overlap (the results there
            are undefined, as for a weight-pass grouped GEMM), but none reaches outside x
            and out.
        w_ENK: (E, N, K), only its shape and base address are read (a transposed view
            gives the dgrad's tables: w^T (E, K, N) per expert, the same memory).
        x_TK: (T, K), out_TN: (T, N): contiguous; w, x and out of one element size, on
            offsets' device.
    """
    E, N, K = w_ENK.shape
    dev = offsets_E.device
    problems = torch.empty(E, 3, dtype=torch.int32, device=dev)
    pa, pb, pd = (torch.empty(E, dtype=torch.int64, device=dev) for _ in range(3))
    if E:
        _group_tables_kernel[(1,)](offsets_E.contiguous(), problems, pa, pb, pd, E, N, K, x_TK.shape[0],
                                   w_ENK.data_ptr(), x_TK.data_ptr(), out_TN.data_ptr(), x_TK.element_size(),
                                   BLOCK=BLOCK)
    return problems, pa, pb, pd
