"""The drop-in MoE layer: top-k router, load balancing, SwiGLU experts (3-D weights)."""

from .layer import (
    MoEAux,
    MoELayer,
    RouterOutput,
    SwiGLU,
    SwiGLUExperts,
    TopKRouter,
    load_balancing_loss,
    mx_round_rows,
    router_z_loss,
)

__all__ = [
    "MoEAux",
    "MoELayer",
    "RouterOutput",
    "SwiGLU",
    "SwiGLUExperts",
    "TopKRouter",
    "load_balancing_loss",
    "mx_round_rows",
    "router_z_loss",
]
