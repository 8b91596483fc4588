"""MX numerics: element formats, scale rules, the pure-torch reference quantizer, the
:class:`MXTensor` container and the Blackwell scale layout (docs/NUMERICS.md)."""

from .formats import ELEM_SPECS, MX_BLOCK_SIZE, ElemFormat, ElemSpec, ScaleMode
from .layout import blocked_scales_numel, from_blocked_scales, to_blocked_scales
from .mx_tensor import MXTensor, dequantize_mx, quantize_mx
from .qdq import fake_quantize_mx

__all__ = [
    "ELEM_SPECS",
    "MX_BLOCK_SIZE",
    "ElemFormat",
    "ElemSpec",
    "MXTensor",
    "ScaleMode",
    "blocked_scales_numel",
    "dequantize_mx",
    "fake_quantize_mx",
    "from_blocked_scales",
    "quantize_mx",
    "to_blocked_scales",
]
