"""mxmoe: Mixture-of-Experts training in MXFP8 (OCP Microscaling: E4M3 elements, one E8M0
scale per block of 32).

Public API:
- numerics and quantizers: :func:`quantize_mx`, :func:`dequantize_mx`,
  :func:`fake_quantize_mx`, :class:`MXTensor`, :func:`to_blocked_scales`,
  :func:`from_blocked_scales`, :class:`ElemFormat`, :class:`ScaleMode`.
- recipes: :class:`Recipe`, :func:`get_recipe`, :data:`RECIPES`.
- functional ops: :func:`mx_linear`, :func:`mx_grouped_mm`, :func:`mx_moe_experts`,
  :func:`weight_copy_cache`.
- modules for any PyTorch model: :class:`MXLinear` (drop-in nn.Linear), :class:`MoE`
  (router + experts + combine), :class:`GroupedExperts` (experts for your own router), and
  :func:`convert_to_mxfp8` (swap a model's nn.Linear for MXLinear, set its MoE recipes;
  for a Hugging Face transformers MoE model also its experts backend:
  :mod:`mxmoe.integrations.transformers`).
"""

from .integrations import convert_to_mxfp8
from .nn import GroupedExperts, MoE, MXLinear
from .numerics import (
    MX_BLOCK_SIZE,
    ElemFormat,
    MXTensor,
    ScaleMode,
    from_blocked_scales,
    to_blocked_scales,
)
from .ops import (
    dequantize_mx,
    fake_quantize_mx,
    mx_grouped_mm,
    mx_linear,
    mx_moe_experts,
    quantize_mx,
    weight_copy_cache,
)
from .recipe import RECIPES, Recipe, get_recipe

__version__ = "0.2.0"

__all__ = [
    "MX_BLOCK_SIZE",
    "RECIPES",
    "ElemFormat",
    "GroupedExperts",
    "MXLinear",
    "MXTensor",
    "MoE",
    "Recipe",
    "ScaleMode",
    "convert_to_mxfp8",
    "dequantize_mx",
    "fake_quantize_mx",
    "from_blocked_scales",
    "get_recipe",
    "mx_grouped_mm",
    "mx_linear",
    "mx_moe_experts",
    "quantize_mx",
    "to_blocked_scales",
    "weight_copy_cache",
]
