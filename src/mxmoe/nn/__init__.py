"""nn.Modules: MXFP8 building blocks for any PyTorch model, and the MoE layer's parts.

Public modules (thin wrappers over the functional ops of :mod:`mxmoe.ops`):

- :class:`MXLinear`: drop-in ``nn.Linear`` whose forward, dgrad and wgrad GEMMs run under a
  recipe (:func:`~mxmoe.ops.mx_linear`).
- :class:`MoE`: router + SwiGLU experts + combine, dropless top-k (``MoELayer`` is the same
  class).
- :class:`GroupedExperts`: the experts alone, for a model with its own router.
- :func:`convert_to_mxfp8`: swap a model's eligible ``nn.Linear`` for :class:`MXLinear`
  and set the recipe of its MoE blocks, in place.
"""

from .convert import convert_to_mxfp8
from .linear import MXLinear
from .moe import (
    GroupedExperts,
    MoE,
    MoEAux,
    MoELayer,
    RouterOutput,
    SwiGLU,
    SwiGLUExperts,
    TopKRouter,
    load_balancing_loss,
    router_z_loss,
)

__all__ = [
    "GroupedExperts",
    "MXLinear",
    "MoE",
    "MoEAux",
    "MoELayer",
    "RouterOutput",
    "SwiGLU",
    "SwiGLUExperts",
    "TopKRouter",
    "convert_to_mxfp8",
    "load_balancing_loss",
    "router_z_loss",
]
