"""mxmoe: Mixture-of-Experts training in MXFP8 (OCP Microscaling, E4M3 elements, E8M0 scales).

Public API:
- numerics: :func:`quantize_mx`, :func:`dequantize_mx`, :class:`MXTensor`,
  :func:`to_blocked_scales`, :func:`from_blocked_scales`, :class:`ElemFormat`, :class:`ScaleMode`.
- recipe and GEMMs: :class:`Recipe`, :func:`get_recipe`, :func:`mx_linear`, :func:`mx_grouped_mm`,
  :func:`weight_copy_cache` (weight copies made once per optimizer step).
"""

from .numerics import (
    MX_BLOCK_SIZE,
    ElemFormat,
    MXTensor,
    ScaleMode,
    dequantize_mx,
    from_blocked_scales,
    quantize_mx,
    to_blocked_scales,
)

from .ops import mx_grouped_mm, mx_linear, weight_copy_cache
from .recipe import RECIPES, Recipe, get_recipe

__version__ = "0.1.0"

__all__ = [
    "MX_BLOCK_SIZE",
    "RECIPES",
    "Recipe",
    "get_recipe",
    "mx_grouped_mm",
    "mx_linear",
    "weight_copy_cache",
    "ElemFormat",
    "MXTensor",
    "ScaleMode",
    "dequantize_mx",
    "from_blocked_scales",
    "quantize_mx",
    "to_blocked_scales",
]
