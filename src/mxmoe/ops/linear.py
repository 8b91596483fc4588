"""``mx_linear``: y = x w^T with the three GEMMs of a linear layer under a precision recipe.

For Y = X W^T with X (T, K), W (N, K), dY (T, N) (docs/NUMERICS.md, "Quantizing for
training"):

    forward  Y  = X W^T     X blocked along K,       W blocked along K
    dgrad    dX = dY W      dY blocked along N,      W blocked along N
    wgrad    dW = dY^T X    dY blocked along tokens, X blocked along tokens

Each operand copy is quantized from the high-precision tensor (never from another
quantized copy), so each GEMM sees blocks along its own contraction dimension. The GEMMs
run on the dequantized operands in the activation dtype with float32 accumulation
("emulated" MXFP8: the same products a block-scaled MXFP8 tensor core forms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..recipe import Recipe, get_recipe
from .args import check_tensor_args
from .autograd import no_double_backward
from .quantize import check_weight_dtype, fake_quantize_operand, fake_quantize_rowcol
from .weight_cache import dgrad_operand, weight_operands

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _MXLinearFunction(torch.autograd.Function):
    """Activations are read once per pass over them: x gives both of its copies in the
    forward (``fake_quantize_rowcol``: one kernel on the Triton backend) and its
    token-blocked copy is kept for the backward in place of x (the same bytes in x's
    dtype); dy gives both of its copies in one kernel. The weight is quantized along N in
    the backward from the parameter itself: keeping that copy from the forward would hold
    a bf16 copy of every quantized weight through the step for a saving of about 1.5 us
    per weight at the h200 preset's shapes. The values are those of quantizing each copy
    separately."""

    @staticmethod
    def forward(ctx, x_TK: Tensor, w_NK: Tensor, recipe: Recipe) -> Tensor:
        dtype = x_TK.dtype
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # along K; inside weight_copy_cache() also the dgrad copy (along N), from one read
        wq_NK, ctx.wq_dgrad = weight_operands(w_NK, recipe, dtype, dgrad=need_dx)
        if need_dw and not recipe.wgrad_high_precision:  # x along K here, along tokens for wgrad
            xq_TK, x_wgrad_TK = fake_quantize_rowcol(x_TK, recipe, out_dtype=dtype)
        else:
            xq_TK = fake_quantize_operand(x_TK, recipe, dim=1, out_dtype=dtype)
            x_wgrad_TK = x_TK if need_dw else None
        ctx.save_for_backward(x_wgrad_TK, w_NK if need_dx else None)
        ctx.recipe, ctx.dtype, ctx.w_dtype = recipe, dtype, w_NK.dtype
        return xq_TK @ wq_NK.t()  # (T, K) @ (K, N) -> (T, N)

    @staticmethod
    @no_double_backward("mx_linear under a quantizing recipe", "run the layers that need second-order gradients "
                        "under recipe 'bf16' (mx_linear is then F.linear) or call torch.nn.functional.linear")
    def backward(ctx, dy_TN: Tensor):
        x_wgrad_TK, w_NK = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = ctx.dtype
        dy_TN = dy_TN.to(dtype).contiguous()  # may arrive expanded (stride 0)
        dx = dw = None
        if need_dx and need_dw and not recipe.wgrad_high_precision:
            dyq_TN, dyt_TN = fake_quantize_rowcol(dy_TN, recipe, out_dtype=dtype)  # along N, along tokens
        else:
            dyq_TN = fake_quantize_operand(dy_TN, recipe, dim=1, out_dtype=dtype) if need_dx else None
            dyt_TN = None
            if need_dw:
                dyt_TN = dy_TN if recipe.wgrad_high_precision else fake_quantize_operand(dy_TN, recipe, dim=0,
                                                                                 out_dtype=dtype)
        if need_dx:
            wq_dgrad_NK = dgrad_operand(w_NK, recipe, dtype, ctx.wq_dgrad)  # along N
            dx = dyq_TN @ wq_dgrad_NK  # (T, N) @ (N, K) -> (T, K)
        if need_dw:
            dw = (dyt_TN.t() @ x_wgrad_TK).to(ctx.w_dtype)  # (N, T) @ (T, K) -> (N, K)
        return dx, dw, None


# eager under torch.compile: the note at mxmoe.ops.grouped_mm._apply
_apply = torch.compiler.disable(_MXLinearFunction.apply)


def mx_linear(x: Tensor, w: Tensor, recipe: Recipe | str = "mxfp8") -> Tensor:
    """y = x w^T with the forward, dgrad and wgrad GEMMs computed under ``recipe``.

    Args:
        x: (..., K) activations, float32/bfloat16/float16; the GEMMs run in this dtype
            with float32 accumulation.
        w: (N, K) weight (any float dtype; typically float32 master weights). Its gradient
            comes back in w's dtype.
        recipe: a :class:`~mxmoe.recipe.Recipe` or its name ("bf16", "mxfp8",
            "mxfp8-floor", "mxfp8-bf16-wgrad"). "bf16" rounds both operands to bfloat16.

    Returns:
        (..., N) in x's dtype.

    Raises:
        TypeError: x or w is not a tensor, x is not float32/bfloat16/float16.
        ValueError: x or w on the meta device, w is not 2-D or its K differs from x's; unknown recipe.

    K and the number of tokens need not be multiples of 32: tail blocks are zero padded,
    which leaves every product unchanged. Under ``torch.compile`` the quantizing recipes run
    eagerly, with a graph break on each side (note at ``mxmoe.ops.grouped_mm._apply``); "bf16"
    is F.linear and compiles.
    """
    recipe = get_recipe(recipe)
    check_tensor_args("mx_linear", x=x, w=w)
    if x.dim() == 0:
        raise ValueError("x is a 0-d tensor; mx_linear takes x of shape (..., K)")
    if x.dtype not in _ACT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; mx_linear takes float32, bfloat16 or float16")
    check_weight_dtype(w, "w", "mx_linear", recipe)
    if w.dim() != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"w must be (N, K) with K = x.shape[-1] = {x.shape[-1]}, got {tuple(w.shape)}")
    if x.shape[-1] == 0:
        raise ValueError(f"x has K = 0 features (shape {tuple(x.shape)}); mx_linear needs K >= 1")
    if x.device != w.device:
        raise ValueError(f"x and w must be on one device, got x on {x.device} and w on {w.device}; move w with "
                         f"w.to(x.device)")
    if not recipe.quantize:
        return F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)).to(x.dtype)
    lead = x.shape[:-1]
    x_TK = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        y = _apply(x_TK, w, recipe)
    else:  # no graph (evaluation under no_grad): only the forward GEMM's copies, not the
        # backward's (ctx.needs_input_grad follows requires_grad, not the grad mode)
        wq_NK, _ = weight_operands(w, recipe, x.dtype, dgrad=False)
        y = fake_quantize_operand(x_TK, recipe, dim=1, out_dtype=x.dtype) @ wq_NK.t()
    return y.reshape(*lead, w.shape[0])
