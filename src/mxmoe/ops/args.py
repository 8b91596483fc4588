"""Argument checks shared by the public ops (:func:`~mxmoe.ops.grouped_mm.mx_grouped_mm`,
:func:`~mxmoe.ops.moe_experts.mx_moe_experts`, :func:`~mxmoe.ops.linear.mx_linear`).

The ops compute values, so every tensor argument must be a real ``torch.Tensor`` holding
data: a Python list, a NumPy array or a tensor on the ``meta`` device (shapes without
data, e.g. a model built under ``torch.device("meta")`` and not yet materialized) is
refused here with the argument's name, before any kernel or autograd Function sees it.
"""

from __future__ import annotations

from torch import Tensor


def check_tensor_args(fn: str, **tensors: object) -> None:
    """Check that each named argument is a ``torch.Tensor`` with data.

    Args:
        fn: the op's name, for the message.
        **tensors: the arguments, by their parameter names.

    Raises:
        TypeError: an argument is not a ``torch.Tensor`` (e.g. a list: build it with
            ``torch.tensor(...)`` / ``torch.as_tensor(...)`` on the input's device).
        ValueError: an argument is on the ``meta`` device (materialize the module with
            ``module.to_empty(device=...)`` and initialize it, or move the tensor).
    """
    for name, value in tensors.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(value).__name__}; build it with "
                            f"torch.as_tensor(...) on the input's device")
    for name, value in tensors.items():
        if value.device.type == "meta":
            raise ValueError(f"{fn}: {name} is on the meta device (a shape without data), and {fn} computes "
                             f"values; materialize it first (e.g. module.to_empty(device='cpu') and initialize "
                             f"the parameters, or move the tensor to a real device)")
