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

import os

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


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (env TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_widen(x: Tensor, dtype: torch.dtype) -> None:
    """The inputs :func:`widen` takes; ValueError naming what is wrong otherwise."""
    if (x.dtype, dtype) not in WIDENING:
        raise ValueError(f"widen casts bfloat16 to float32, got {x.dtype} -> {dtype}; use Tensor.to")
    if not x.is_contiguous():
        raise ValueError(f"widen needs a contiguous tensor, got strides {x.stride()} for shape {tuple(x.shape)}")
    if not (x.is_cuda or (x.device.type == "cpu" and interpreting())):
        raise ValueError(f"widen runs on CUDA tensors, or CPU tensors under TRITON_INTERPRET=1; got a tensor on "
                         f"{x.device}: use Tensor.to")


# A custom op, as every kernel launch of mxmoe.kernels: torch.compile and compiled autograd
# see one opaque op instead of tracing into the launch
@torch.library.custom_op("mxmoe::widen_bf16_to_f32", mutates_args=())
def _widen_op(x: Tensor) -> Tensor:
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        _widen_kernel[(triton.cdiv(n, BLOCK),)](x, out, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


@_widen_op.register_fake
def _(x):
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


def widen(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)`` for the widening cast bfloat16 -> float32, in one Triton launch
    (the custom op ``torch.ops.mxmoe.widen_bf16_to_f32``; no autograd formula: the weight
    gradients it widens are made with grad mode off).

    Args:
        x: bfloat16, any shape, contiguous; a CUDA tensor, or a CPU tensor
            under ``TRITON_INTERPRET=1``.
        dtype: torch.float32.

    Returns:
        A new contiguous tensor of x's shape in ``dtype``, equal to ``x.to(dtype)``.

    Raises:
        ValueError: the cast is not bfloat16 -> float32, x is not contiguous, or x is on a
            device the kernel does not run on.
    """
    check_widen(x, dtype)
    return _widen_op(x)
