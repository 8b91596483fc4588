"""``MXLinear``: a drop-in ``nn.Linear`` whose GEMMs run under a precision recipe.

The module holds the parameters of ``nn.Linear`` (``weight`` (out_features, in_features),
``bias`` (out_features,) or None, the same init) and computes

    y = mx_linear(x, weight, recipe) + bias

where :func:`~mxmoe.ops.mx_linear` quantizes each operand of the forward, dgrad and wgrad
GEMMs along its own contraction dimension (MXFP8: E4M3 elements, one E8M0 scale per block
of 32). The bias is not quantized: it is added to the GEMM's result (already rounded to
x's dtype, as ``mx_linear`` returns it) in the promoted dtype of x and the bias, and the
sum is rounded to x's dtype, as ``F.linear`` on bf16 tensors adds a bf16 bias. Following torchao's
``Float8Linear`` and Liger-Kernel's modules, the module is a thin wrapper: all numerics are
in the functional op.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops import mx_linear
from ..recipe import Recipe, get_recipe
from .args import check_parameter_dtype, check_size
from .recipe_module import RecipeModule

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class MXLinear(RecipeModule, nn.Linear):
    """``nn.Linear`` with its three GEMMs under a precision recipe (default MXFP8).

    Args:
        in_features: K. out_features: N. bias: add a learnable bias (N,) (default False,
            unlike nn.Linear: transformer projections usually have none).
        recipe: a :class:`~mxmoe.recipe.Recipe` or its name ("mxfp8", "mxfp8-floor",
            "mxfp8-bf16-wgrad", "bf16").
        device, dtype: of the parameters, as for nn.Linear (float32 master weights by
            default; the GEMMs run in the activations' dtype).

    Parameters: ``weight`` (N, K), ``bias`` (N,) or None: the names, shapes and init of
    nn.Linear (the constructor is nn.Linear's, so the same seed gives the same values), so
    state_dicts move between the two classes unchanged. It is a subclass of nn.Linear.

    Forward: ``x`` (..., K) float32/bfloat16/float16 -> (..., N) in x's dtype. K and the
    token count need not be multiples of 32 (:func:`~mxmoe.ops.mx_linear` zero pads tail
    blocks, leaving every product unchanged); :func:`~mxmoe.nn.convert_to_mxfp8` still
    converts only layers with K and N multiples of 32, whose blocks carry no padding.

    Raises:
        ValueError: unknown recipe (constructor, :meth:`set_recipe`); ``in_features`` or
            ``out_features`` not an integer in [1, 2**31 - 1] (constructor).
        TypeError: a ``dtype`` that is not floating point, or not float32/bfloat16/float16
            under a quantizing recipe (constructor).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, recipe: Recipe | str = "mxfp8",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        recipe = get_recipe(recipe)  # before nn.Linear's init: bad arguments fail before any RNG draw
        check_size("in_features", in_features)
        check_size("out_features", out_features)
        check_parameter_dtype(dtype, recipe, "MXLinear")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._recipe = recipe

    @classmethod
    def from_float(cls, linear: nn.Linear, recipe: Recipe | str = "mxfp8") -> MXLinear:
        """An MXLinear computing ``linear``'s layer under ``recipe``, holding the very same
        Parameter objects (no copy).

        The state_dict keys and values are unchanged, an optimizer built over ``linear``'s
        parameters keeps updating them, and weights tied elsewhere stay tied. The
        train/eval mode is copied; hooks registered on ``linear`` are not.

        Args:
            linear: an ``nn.Linear`` (or subclass: its forward is not kept).
            recipe: a :class:`~mxmoe.recipe.Recipe` or its name.

        Raises:
            TypeError: ``linear`` is not an nn.Linear. ValueError: unknown recipe.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"MXLinear.from_float takes an nn.Linear, got {type(linear).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)  # no nn.Linear.__init__: no parameter allocation, no RNG draw
        new._recipe = get_recipe(recipe)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.register_parameter("bias", linear.bias)
        new.train(linear.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        """x (..., K) -> (..., N) in x's dtype: ``mx_linear(x, weight, recipe)``, plus the
        bias added to that result in the promoted dtype of x and bias, then rounded to x's dtype.

        Raises:
            TypeError: x is not a float32/bfloat16/float16 tensor.
            ValueError: x is 0-dimensional or x.shape[-1] != in_features.
        """
        if not isinstance(x, Tensor):
            raise TypeError(f"{self._name()} takes a tensor, got {type(x).__name__}")
        if x.dtype not in _ACT_DTYPES:
            raise TypeError(f"{self._name()} takes float32, bfloat16 or float16 activations, got {x.dtype}; "
                            f"cast the input (the GEMMs run in its dtype)")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"{self._name()} takes input of shape (..., {self.in_features}), got {tuple(x.shape)}")
        y = mx_linear(x, self.weight, self._recipe)
        if self.bias is not None:
            y = (y + self.bias).to(y.dtype)
        return y

    def _name(self) -> str:
        return f"MXLinear(in_features={self.in_features}, out_features={self.out_features}, recipe={self._recipe.name})"

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self._recipe.name}"
