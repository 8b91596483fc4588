"""Constructor checks shared by the nn modules (:class:`~mxmoe.nn.MXLinear`,
:class:`~mxmoe.nn.MoE`, :class:`~mxmoe.nn.GroupedExperts`) and by
:class:`~mxmoe.models.ModelConfig`: sizes and parameter dtypes are refused before any
memory is allocated, naming the argument."""

from __future__ import annotations

import torch

from ..ops.quantize import MX_INPUT_DTYPES
from ..recipe import Recipe

# the largest size of any one dimension (width, layers, heads, experts, sequence length):
# the kernels index tensors with int32
MAX_SIZE = 2**31 - 1


def check_size(name: str, value: object, minimum: int = 1) -> None:
    """Check a size argument.

    Args:
        name: the argument's name, for the message.
        value: the size; an ``int`` (``bool`` refused).
        minimum: the smallest allowed value (1, or 0 where "none" is meaningful).

    Raises:
        ValueError: ``value`` is not an int in ``[minimum, MAX_SIZE]`` (2**31 - 1: int32
            indexing in the kernels).
    """
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_SIZE:
        raise ValueError(f"{name} must be an integer in [{minimum}, {MAX_SIZE:,}] (2**31 - 1: the kernels index "
                         f"in int32), got {value!r}")


def check_parameter_dtype(dtype: object, recipe: Recipe, who: str) -> None:
    """Check the ``dtype`` a module builds its parameters in.

    Args:
        dtype: ``None`` (torch's default dtype) or a ``torch.dtype``.
        recipe: the module's recipe: a quantizing recipe reads float32, bfloat16 or
            float16 weights (:data:`~mxmoe.ops.quantize.MX_INPUT_DTYPES`).
        who: the module's name, for the message.

    Raises:
        TypeError: ``dtype`` is not a floating-point ``torch.dtype`` (parameters must take
            gradients), or not one of float32/bfloat16/float16 under a quantizing recipe.
    """
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{who}: dtype must be a floating-point torch.dtype (float32, bfloat16 or float16), got "
                        f"{dtype!r}")
    if recipe.quantize and dtype not in MX_INPUT_DTYPES:
        raise TypeError(f"{who}: recipe {recipe.name!r} quantizes the weights and reads float32, bfloat16 or "
                        f"float16; got dtype {dtype}")


def check_flags(**flags: object) -> None:
    """Check on/off arguments: each must be a ``bool`` (a string such as "no" is truthy and
    would switch the feature on).

    Raises:
        TypeError: naming the first argument that is not True or False.
    """
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
