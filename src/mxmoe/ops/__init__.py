"""Autograd ops and quantizers with a backend: the public functional API.

- :func:`quantize_mx`, :func:`dequantize_mx`, :func:`fake_quantize_mx`: MX quantization
  (Triton kernels or the pure-torch reference, same bytes).
- :func:`mx_linear`: y = x w^T under a recipe (forward, dgrad, wgrad).
- :func:`mx_grouped_mm`: the expert GEMM over jagged groups of tokens.
- :func:`mx_moe_experts`: the fused SwiGLU expert block (one autograd op).
- :func:`weight_copy_cache`: weight copies made once per optimizer step.

Which implementation runs each pass is decided in :mod:`mxmoe.ops.backend`.
"""

from .backend import GroupedGemmBackend, grouped_gemm_backend, use_triton
from .grouped_mm import mx_grouped_mm, mx_grouped_mm_dgrad
from .linear import mx_linear
from .moe_experts import mx_moe_experts
from .quantize import dequantize_mx, fake_quantize_mx, quantize_mx
from .weight_cache import WeightCopyCache, weight_copy_cache

__all__ = [
    "GroupedGemmBackend",
    "WeightCopyCache",
    "dequantize_mx",
    "fake_quantize_mx",
    "grouped_gemm_backend",
    "mx_grouped_mm",
    "mx_grouped_mm_dgrad",
    "mx_linear",
    "mx_moe_experts",
    "quantize_mx",
    "use_triton",
    "weight_copy_cache",
]
