"""The MoE layer's autograd ops around the experts: the weighted combine (optionally
keeping the per-choice outputs for backward as MXFP8) and the MXFP8 rounding of dispatched
rows with a straight-through gradient.

Legend of shape suffixes: T tokens, D model width, E experts, k top-k, A = T * k routed
assignments.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..numerics.mx_tensor import MXTensor
from ..recipe import Recipe
from .autograd import no_double_backward
from .backend import use_triton_for
from .quantize import dequantize_mx, fake_quantize_operand, quantize_mx


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
    arithmetic, shared by the plain and the MXFP8-saving paths."""
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


class _CombineFP8(torch.autograd.Function):
    """The weighted combine with the per-choice outputs kept for backward as MXFP8.

    Forward (the composed path's arithmetic): y_AD = rows of y_sorted back in (token,
    choice) order; y_TD[t] = sum_j w[t, j] * y_AD[t * k + j] in y's dtype. The backward
    needs y_AD only for the gradient of the combine weights (the router's gradient through
    them); it reads y_AD quantized to MXFP8 along D (the recipe's FP8 element format and
    scale rule, E8M0 scales) instead of a bf16 copy: D + D / 32 bytes per row against 2 D.

    Where :func:`_combine_triton` holds (bf16 y on the Triton backend, the fused MoE
    layer on CUDA) each direction is one kernel (:mod:`mxmoe.kernels.moe_experts`): forward
    gathers, weights, sums and quantizes in one read of y; backward writes d(y) in sorted
    order and d(w) in one read of dy and the codes. Bit for bit the torch path, except
    the float32 sums: over k in choice order (torch on CUDA sums k > 2 terms in another
    order) and, for d(w), over D in column blocks; both are then rounded to bf16. The
    results differ from the torch path by one bf16 ulp in rare elements, more only where
    a sum cancels (bound: n 2^-24 sum |terms| for n terms, before the rounding).
    """

    @staticmethod
    def forward(ctx, y_sorted_AD: Tensor, order_A: Tensor, weights_Tk: Tensor, recipe: Recipe) -> Tensor:
        D = y_sorted_AD.shape[1]
        fused = _combine_triton(y_sorted_AD, recipe)
        if fused:  # one kernel: gather, weight, sum over k, quantize y
            from ..kernels.moe_experts import triton_combine_quantize

            A = order_A.numel()
            if order_A.device.type != "cuda" and A and not bool((torch.bincount(order_A, minlength=A) == 1).all()):
                raise ValueError("order_A must be a permutation of range(A)")  # on CUDA: a host sync, not checked
            inv_A = inverse_permutation(order_A)
            w_Tk = weights_Tk.to(y_sorted_AD.dtype)
            y_TD, q, s = triton_combine_quantize(y_sorted_AD, inv_A, w_Tk, recipe.fmt, recipe.scale_mode)
            ctx.save_for_backward(q, s, inv_A, w_Tk)
        else:
            y_AD, w_Tk, y_TD = _combine(y_sorted_AD, order_A, weights_Tk)
            mx = quantize_mx(y_AD, recipe.fmt, block_size=recipe.block_size, dim=1, scale_mode=recipe.scale_mode,
                             pad=True, backend=recipe.backend)
            ctx.save_for_backward(mx.qdata, mx.scale, order_A, w_Tk)
        ctx.meta = (recipe, D, weights_Tk.dtype, fused)
        return y_TD

    @staticmethod
    @no_double_backward("the MXFP8-saving MoE combine", "combine without MXFP8 saving (combine_weighted with "
                        "fp8_recipe=None: plain autograd, differentiable twice)")
    def backward(ctx, dy_TD: Tensor):
        q, s, order_A, w_Tk = ctx.saved_tensors
        recipe, D, w_dtype, fused = ctx.meta
        T, k = w_Tk.shape
        dy_TD = dy_TD.to(w_Tk.dtype)
        if fused:  # order_A holds the inverse permutation here
            from ..kernels.moe_experts import triton_combine_backward

            d_y_sorted, d_w = triton_combine_backward(dy_TD, w_Tk, q, s, order_A)
            return d_y_sorted, None, d_w.to(w_dtype), None
        d_y_AD = (dy_TD.unsqueeze(1) * w_Tk.unsqueeze(-1)).reshape(T * k, D)
        mx = MXTensor(q, s, recipe.fmt, recipe.block_size, 1, recipe.scale_mode, D)
        y_AD = dequantize_mx(mx, w_Tk.dtype, backend=recipe.backend)
        d_w = (dy_TD.unsqueeze(1) * y_AD.view(T, k, D)).sum(dim=-1).to(w_dtype)
        return d_y_AD.index_select(0, order_A), None, d_w, None


def _combine_triton(y_sorted_AD: Tensor, recipe: Recipe) -> bool:
    """Whether the MXFP8-saving combine runs as the fused Triton kernels
    (:func:`mxmoe.kernels.moe_experts.triton_combine_quantize`): the recipe's backend resolves to
    Triton for y, y is bf16 (the kernels' products are rounded to bf16; see
    ``_check_bf16`` there) and D is a multiple of the block size (no padding to write)."""
    return (y_sorted_AD.dtype == torch.bfloat16 and y_sorted_AD.shape[1] % recipe.block_size == 0
            and use_triton_for(y_sorted_AD, recipe))


# eager under torch.compile (the note at mxmoe.ops.grouped_mm._apply); the plain combine compiles
_combine_fp8_eager = torch.compiler.disable(_CombineFP8.apply)


def combine_weighted(y_sorted_AD: Tensor, order_A: Tensor, weights_Tk: Tensor, fp8_recipe: Recipe | None = None
                     ) -> Tensor:
    """y_TD[t] = sum_j weights[t, j] * y[row of (t, j)]: undo the expert sort (``order_A``
    lists, for each sorted row, its assignment t * k + j), weight each choice, sum over k.

    Args:
        y_sorted_AD: (A, D) expert outputs in sorted order; order_A: (A,) int64;
        weights_Tk: (T, k) float32 combine weights. fp8_recipe: keep the per-choice outputs
            for backward as MXFP8 under this recipe (:class:`_CombineFP8`); None keeps them
            in y's dtype (plain autograd).

    Returns:
        (T, D) in y's dtype. Deterministic: a permutation, then a fixed-order sum over k.

    Raises:
        TypeError: order_A not int64. ValueError: with an MXFP8 recipe on the fused
            kernels' path off CUDA, order_A not a permutation (on CUDA unchecked: a host
            sync; the layer passes an argsort).
    """
    if order_A.dtype != torch.int64:
        raise TypeError(f"order_A must be int64 (a permutation of range(A)), got {order_A.dtype}")
    if fp8_recipe is not None:
        return _combine_fp8_eager(y_sorted_AD, order_A, weights_Tk, fp8_recipe)
    return _combine(y_sorted_AD, order_A, weights_Tk)[2]
