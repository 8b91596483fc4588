"""MX numerics in pure torch: element formats, scale rules, the reference quantizer (also
the CPU backend), the :class:`MXTensor` container and the Blackwell scale layout
(docs/NUMERICS.md). Nothing here imports a kernel; :mod:`mxmoe.ops.quantize` adds the
Triton backend behind :func:`mxmoe.quantize_mx`."""

from .formats import ELEM_SPECS, MX_BLOCK_SIZE, ElemFormat, ElemSpec, ScaleMode
from .layout import blocked_scales_numel, from_blocked_scales, to_blocked_scales
from .mx_tensor import MXTensor, torch_dequantize_mx, torch_quantize_mx
from .qdq import torch_fake_quantize_mx

__all__ = [
    "ELEM_SPECS",
    "MX_BLOCK_SIZE",
    "ElemFormat",
    "ElemSpec",
    "MXTensor",
    "ScaleMode",
    "blocked_scales_numel",
    "from_blocked_scales",
    "to_blocked_scales",
    "torch_dequantize_mx",
    "torch_fake_quantize_mx",
    "torch_quantize_mx",
]
