"""Autograd ops of the recipe: ``mx_linear`` and ``mx_grouped_mm`` (forward, dgrad, wgrad),
and the quantize-dequantize helpers they use."""

from .grouped_mm import mx_grouped_mm
from .linear import mx_linear
from .quantize import fake_quantize, fake_quantize_grouped_tokens

__all__ = ["fake_quantize", "fake_quantize_grouped_tokens", "mx_grouped_mm", "mx_linear"]
