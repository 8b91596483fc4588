"""The MoE layer's autograd ops around the experts: the weighted combine (plain, or with the
weights' gradient left to the fused expert op so that nothing of the expert outputs is
kept) and the MXFP8 rounding of dispatched rows with a straight-through gradient.

Legend of shape suffixes: T tokens, D model width, E experts, k top-k, A = T * k routed
assignments.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..recipe import Recipe
from .autograd import no_double_backward
from .backend import use_triton_for
from .quantize import fake_quantize_operand


class _MXRoundRows(torch.autograd.Function):
    """Forward: quantize-dequantize rows along D; backward: the identity (straight through).
    Differentiable twice: the backward is the identity, whose derivative is the identity."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, recipe: Recipe) -> Tensor:
        return fake_quantize_operand(x_TD, recipe, dim=1, out_dtype=x_TD.dtype)

    @staticmethod
    def backward(ctx, dx_TD: Tensor):
        return dx_TD, None


# eager under torch.compile: the note at mxmoe.ops.grouped_mm._apply
_round_rows_eager = torch.compiler.disable(_MXRoundRows.apply)


def mx_round_rows(x_TD: Tensor, recipe: Recipe) -> Tensor:
    """Round each row of ``x_TD`` to the recipe's MX format along D, straight-through gradient.

    This is what the expert GEMMs see under MXFP8 dispatch: the values of
    ``quantize_mx(x_TD, recipe.fmt, dim=1, scale_mode=recipe.scale_mode, pad=True)``
    dequantized to ``x_TD.dtype`` (bit-equal, docs/NUMERICS.md), with dL/dx passed through
    unchanged (the backward all-to-all of the dispatch carries gradients in the activation
    dtype).

    Args:
        x_TD: (T, D) float32/bfloat16/float16. recipe: a quantizing recipe.

    Returns:
        (T, D) in x_TD's dtype.

    Raises:
        ValueError: ``recipe.quantize`` is False (there is no MX format to round to).
    """
    if not recipe.quantize:
        raise ValueError(f"MXFP8 dispatch needs a quantizing expert recipe, got {recipe.name!r}")
    return _round_rows_eager(x_TD, recipe)


def _combine(y_sorted_AD: Tensor, order_A: Tensor, weights_Tk: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(y_AD in (token, choice) order, weights in y's dtype (T, k), y_TD): the combine's
    arithmetic, shared by the plain and the fused paths."""
    T, k = weights_Tk.shape
    D = y_sorted_AD.shape[1]
    y_AD = torch.zeros_like(y_sorted_AD).index_copy(0, order_A, y_sorted_AD)
    w_Tk = weights_Tk.to(y_AD.dtype)
    return y_AD, w_Tk, (y_AD.view(T, k, D) * w_Tk.unsqueeze(-1)).sum(dim=1)


def inverse_permutation(order_A: Tensor) -> Tensor:
    """(A,) int64 inv with inv[order[i]] = i: for the combine, the sorted row of each
    assignment t * k + j. Zero-filled first, not empty: if order is not a permutation (not
    checked on CUDA: a host sync) the missing entries read row 0, never outside y."""
    return torch.zeros_like(order_A).scatter_(0, order_A, torch.arange(order_A.numel(), device=order_A.device))


class _CombineRows(torch.autograd.Function):
    """The weighted combine with the weights taken as constants, keeping nothing of y.

    Forward (the composed path's arithmetic, :func:`_combine`): y_TD[t] = sum_j w[t, j] *
    y[row of (t, j)], each product rounded to y's dtype, float32 sum in choice order on the
    Triton path. Backward: only the rows' gradient, row of (t, j) = dy[t] * w[t, j] in y's
    dtype. The weights' gradient (y . dy for each choice) comes from the fused expert op,
    which gets the weights of its rows (:func:`mxmoe.ops.moe_experts.mx_moe_experts`,
    ``weights_A``) and takes y . dy = act . (dy w2) from its own backward, as SonicMoE does:
    so the combine keeps no copy of the A x D expert outputs for backward.

    Where :func:`_combine_triton` holds (bf16 y on the Triton backend, D a multiple of 32)
    each direction is one kernel (:mod:`mxmoe.kernels.moe_experts`), bit for bit the torch
    path except the float32 sum over k for k > 2 (torch on CUDA may add in another order).
    """

    @staticmethod
    def forward(ctx, y_sorted_AD: Tensor, order_A: Tensor, weights_Tk: Tensor, recipe: Recipe) -> Tensor:
        fused = _combine_triton(y_sorted_AD, recipe)
        w_Tk = weights_Tk.to(y_sorted_AD.dtype)
        if fused:
            from ..kernels.moe_experts import triton_sum_token_rows

            A = order_A.numel()
            if order_A.device.type != "cuda" and A and not bool((torch.bincount(order_A, minlength=A) == 1).all()):
                raise ValueError("order_A must be a permutation of range(A)")  # on CUDA: a host sync, not checked
            inv_A = inverse_permutation(order_A)
            y_TD = triton_sum_token_rows(y_sorted_AD, inv_A, w_Tk.shape[1], y_sorted_AD.dtype, w_Tk.float(),
                                         round_products=True)
            ctx.save_for_backward(inv_A, w_Tk)
        else:
            y_TD = _combine(y_sorted_AD, order_A, w_Tk)[2]
            ctx.save_for_backward(order_A, w_Tk)
        ctx.fused = fused
        return y_TD

    @staticmethod
    @no_double_backward("the fused MoE combine", "combine_weighted (plain autograd, differentiable twice)")
    def backward(ctx, dy_TD: Tensor):
        rows_A, w_Tk = ctx.saved_tensors
        T, k = w_Tk.shape
        dy_TD = dy_TD.to(w_Tk.dtype)
        if ctx.fused:  # rows_A holds the inverse permutation here
            from ..kernels.moe_experts import triton_combine_rows_backward

            return triton_combine_rows_backward(dy_TD, w_Tk, rows_A), None, None, None
        d_y_AD = (dy_TD.unsqueeze(1) * w_Tk.unsqueeze(-1)).reshape(T * k, dy_TD.shape[1])
        return d_y_AD.index_select(0, rows_A), None, None, None


def _combine_triton(y_sorted_AD: Tensor, recipe: Recipe) -> bool:
    """Whether the fused combine runs as the Triton kernels (:mod:`mxmoe.kernels.moe_experts`):
    the recipe's backend resolves to Triton for y, y is bf16 (the kernels round each product
    to bf16; see ``_check_bf16`` there) and D is a multiple of the block size."""
    return (y_sorted_AD.dtype == torch.bfloat16 and y_sorted_AD.shape[1] % recipe.block_size == 0
            and use_triton_for(y_sorted_AD, recipe))


# eager under torch.compile (the note at mxmoe.ops.grouped_mm._apply); the plain combine compiles
_combine_rows_eager = torch.compiler.disable(_CombineRows.apply)


def combine_weighted(y_sorted_AD: Tensor, order_A: Tensor, weights_Tk: Tensor) -> Tensor:
    """y_TD[t] = sum_j weights[t, j] * y[row of (t, j)]: undo the expert sort (``order_A``
    lists, for each sorted row, its assignment t * k + j), weight each choice, sum over k.
    Plain autograd (differentiable twice; keeps y for the weights' gradient).

    Args:
        y_sorted_AD: (A, D) expert outputs in sorted order; order_A: (A,) int64;
        weights_Tk: (T, k) float32 combine weights.

    Returns:
        (T, D) in y's dtype. Deterministic: a permutation, then a fixed-order sum over k.

    Raises:
        TypeError: order_A not int64.
    """
    if order_A.dtype != torch.int64:
        raise TypeError(f"order_A must be int64 (a permutation of range(A)), got {order_A.dtype}")
    return _combine(y_sorted_AD, order_A, weights_Tk)[2]


def combine_rows(y_sorted_AD: Tensor, order_A: Tensor, weights_Tk: Tensor, recipe: Recipe) -> Tensor:
    """The combine of the fused MXFP8 path (:class:`_CombineRows`): the value of
    :func:`combine_weighted`, no gradient for ``weights_Tk`` (pass the weights to
    :func:`~mxmoe.ops.moe_experts.mx_moe_experts` as ``weights_A``, which returns it), and
    nothing of y kept for backward.

    Args:
        y_sorted_AD: (A, D) expert outputs in sorted order; order_A: (A,) int64
            permutation; weights_Tk: (T, k) combine weights (used as constants).
        recipe: picks the Triton kernels or torch (:func:`_combine_triton`).

    Returns:
        (T, D) in y's dtype.

    Raises:
        TypeError: order_A not int64. ValueError: off CUDA on the Triton path, order_A not
            a permutation (on CUDA unchecked: a host sync; the layer passes an argsort).
    """
    if order_A.dtype != torch.int64:
        raise TypeError(f"order_A must be int64 (a permutation of range(A)), got {order_A.dtype}")
    return _combine_rows_eager(y_sorted_AD, order_A, weights_Tk.detach(), recipe)
