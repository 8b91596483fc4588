"""Double backward through the MXFP8 autograd Functions: refused with a clear error.

The backward of an MXFP8 op (:func:`~mxmoe.ops.linear.mx_linear`,
:func:`~mxmoe.ops.grouped_mm.mx_grouped_mm`, :func:`~mxmoe.ops.moe_experts.mx_moe_experts`,
the fused path's combine) runs its GEMMs on quantized copies of its operands, computed by
quantizers that have no useful derivative. Differentiating that backward again (a
gradient penalty, a Hessian-vector product: ``torch.autograd.grad(..., create_graph=True)``
and a second backward through the result) would give silently wrong second-order
gradients (zeros where torch's own ops give a value), so :func:`no_double_backward` makes
it an error that names the op and what to use instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

DOUBLE_BACKWARD_ERROR = "does not support double backward"


def double_backward_message(op: str, instead: str) -> str:
    """The error of a second backward through ``op``: what is refused, why, ``instead``."""
    return (f"{op} {DOUBLE_BACKWARD_ERROR} (create_graph=True and a second backward through its gradient, as in "
            f"a gradient penalty or a Hessian-vector product): its backward is hand-written, its GEMMs run on "
            f"copies of the operands (MXFP8-quantized, or cast to bf16 under the bf16 recipe) and it is not "
            f"differentiable, so the second-order gradient would be silently wrong; {instead}")


def no_double_backward(op: str, instead: str) -> Callable:
    """Decorator of an ``autograd.Function``'s ``backward``: the first backward is unchanged
    (run under ``no_grad``); under ``create_graph=True`` (grad mode on inside backward)
    its floating-point outputs come back attached to a node whose own backward raises
    ``RuntimeError(double_backward_message(op, instead))``, so only a second backward that
    actually goes through them fails. This is ``torch.autograd.function.once_differentiable``
    with a message of its own, and the error attached even when no incoming gradient
    requires grad (once_differentiable then returns gradients that silently do not)."""
    message = double_backward_message(op, instead).encode()

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            if not torch.is_grad_enabled():  # create_graph=False: grad mode is off in backward
                return outputs
            single = not isinstance(outputs, tuple)
            outs = (outputs,) if single else outputs

            def alias(v):
                if isinstance(v, Tensor) and v.is_floating_point():
                    v = v.detach()
                    v.requires_grad_(True)
                return v

            err = torch._C._functions.DelayedError(message, len(outs))
            wrapped = err(*[alias(v) for v in outs])
            wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
            # non-float outputs (None for integer inputs) pass through as they were
            result = tuple(w if isinstance(v, Tensor) and v.is_floating_point() else v for v, w in zip(outs, wrapped))
            return result[0] if single else result

        return wrapper

    return decorate
