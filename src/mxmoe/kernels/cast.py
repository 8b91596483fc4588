"""A widening dtype cast at memory speed: bfloat16 -> float32, exact.

The weight gradients of the expert GEMMs come out of the bf16 grouped GEMM in bf16 and
are widened to the float32 master weights' dtype. torch's ``Tensor.to`` runs that cast in
its unrolled (not vectorized) copy kernel: about 2 TB/s on the H200, 7.5 ms of a 42 ms
Qwen3-235B-A22B MoE layer step (benchmarks/moe_layer.py --breakdown). This kernel reads
and writes 16 contiguous elements per thread, in vector loads and stores.

Every bfloat16 value is a float32 value with the same upper 16 bits: the kernel moves the
bits (a 16-bit shift, no conversion instruction), so the result equals
``x.to(torch.float32)`` bit for bit, NaN payloads and subnormals included, on the GPU and in
Triton's CPU interpreter alike (whose float conversion flushes bf16 subnormals to zero).
tests/kernels/test_cast.py checks every bf16 bit pattern.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 4096  # elements per program: 16 per thread at 8 warps
NUM_WARPS = 8
WIDENING = {(torch.bfloat16, torch.float32)}


@triton.jit
def _widen_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    bits = tl.load(src_ptr + offs, mask=mask).to(tl.uint16, bitcast=True).to(tl.uint32)
    tl.store(dst_ptr + offs, (bits << 16).to(tl.float32, bitcast=True), mask=mask)


def widen(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)`` for the widening cast bfloat16 -> float32, in one Triton launch.

    Args:
        x: bfloat16, any shape, contiguous; a CUDA tensor, or a CPU tensor
            under ``TRITON_INTERPRET=1``.
        dtype: torch.float32.

    Returns:
        A new contiguous tensor of x's shape in ``dtype``, equal to ``x.to(dtype)``.

    Raises:
        ValueError: the cast is not a widening one, or x is not contiguous.
    """
    if (x.dtype, dtype) not in WIDENING:
        raise ValueError(f"widen casts bfloat16 to float32, got {x.dtype} -> {dtype}; use Tensor.to")
    if not x.is_contiguous():
        raise ValueError(f"widen needs a contiguous tensor, got strides {x.stride()} for shape {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = x.numel()
    if n:
        _widen_kernel[(triton.cdiv(n, BLOCK),)](x, out, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out
