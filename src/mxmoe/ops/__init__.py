"""Autograd ops of the recipe: ``mx_linear`` and ``mx_grouped_mm`` (forward, dgrad, wgrad),
the quantize-dequantize helpers they use, and the weight-copy cache."""

from .grouped_mm import mx_grouped_mm, mx_grouped_mm_dgrad
from .linear import mx_linear
from .quantize import fake_quantize, fake_quantize_grouped_tokens
from .weight_cache import WeightCopyCache, weight_copy_cache

__all__ = ["WeightCopyCache", "fake_quantize", "fake_quantize_grouped_tokens", "mx_grouped_mm", "mx_grouped_mm_dgrad",
           "mx_linear",
           "weight_copy_cache"]
