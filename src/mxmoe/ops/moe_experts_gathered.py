"""The bf16 SwiGLU experts and the weighted combine of an MoE layer as one autograd op on
QuACK's gathered grouped GEMMs (:mod:`mxmoe.kernels.quack_moe`; sm90, the ``hopper`` extra).

Legend: T tokens, D model width, F expert width, E experts, k choices per token, A = T * k
routed rows sorted by expert (stable), s the router score of a row.

Forward (three kernels on the GPU):

    h_A2F, act_AF = x[src] w13_e^T, silu(gate) * up     (gathered up projection, SwiGLU epilogue)  [h saved]
    y_AD = act w2_e^T                                  (grouped GEMM)
    out_TD[t] = sum_j s[t, j] y[row of (t, j)]         (float32 sum in choice order, one rounding)

Backward:

    dh_A2F, sact_AF, ds_A = dgated(dy[src] w2_e; h, s) (dgrad with SwiGLU backward, s and the
                                                        router-score gradient in its epilogue)
    dw2_e = dy[src_e]^T sact_e                         (varlen-K, dy rows gathered in the GEMM)
    dx_AD = dh w13_e;  dx_TD[t] = sum_j dx[row of (t, j)]
    dw13_e = dh_e^T x[src_e]                           (varlen-K, x rows gathered in the GEMM)

Kept for backward: x (the layer input, usually kept by the caller anyway), h (A x 2F bf16)
and the routing: 4 F bytes per routed row, against 2 D + 6 F for the composed bf16 layer
(x gathered, h, act and y). This is SonicMoE's dataflow (arXiv 2512.14080, section 3).

Numerics differ from the composed bf16 path (:func:`mxmoe.nn.moe.swiglu_grouped_mm` and
:func:`mxmoe.ops.combine.combine_weighted`) only by rounding: the SwiGLU, the router scale
and the combine run in float32 with one bf16 rounding each, where the composed path rounds
each bf16 op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import quack_moe
from ..recipe import Recipe, get_recipe
from .args import check_tensor_args
from .autograd import no_double_backward
from .backend import widen_weight_grad
from .combine import inverse_permutation
from .moe_experts import sum_token_rows

GEMM_DTYPE = torch.bfloat16


def weighted_sum_token_rows(y_AD: Tensor, rows_A: Tensor, scores_Tk: Tensor) -> Tensor:
    """(T, D) bf16: out[t] = sum over j of scores[t, j] * y[rows[t * k + j]] in float32, in
    choice order, rounded once (the combine; a gather: deterministic). On the GPU the
    kernel's multiply and add may be fused (one rounding less than the torch path here)."""
    T, k = scores_Tk.shape
    if y_AD.is_cuda:
        from ..kernels.moe_experts import triton_sum_token_rows

        return triton_sum_token_rows(y_AD, rows_A, k, GEMM_DTYPE, scores_Tk.float().contiguous())
    y = y_AD.index_select(0, rows_A).view(T, k, y_AD.shape[1]).float()
    if k == 0:
        return y.new_zeros(T, y_AD.shape[1], dtype=GEMM_DTYPE)
    acc = y[:, 0] * scores_Tk[:, :1].float()
    for j in range(1, k):  # choice order, as the kernel
        acc = acc + y[:, j] * scores_Tk[:, j:j + 1].float()
    return acc.to(GEMM_DTYPE)


class _GatheredExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: Tensor, scores_Tk: Tensor, w13_E2FD: Tensor, w2_EDF: Tensor, src_A: Tensor,
                offsets_E: Tensor, inv_A: Tensor, recipe: Recipe) -> Tensor:
        T, k = scores_Tk.shape
        cu = quack_moe.cu_seqlens(offsets_E)
        src = src_A.to(torch.int32)
        x = x_TD.contiguous()
        w13 = w13_E2FD.to(GEMM_DTYPE).contiguous()  # float32 parameters: one bf16 copy per step, kept
        w2 = w2_EDF.to(GEMM_DTYPE).contiguous()
        h, act = quack_moe.gated_up_projection(x, src, cu, w13)
        y_AD = quack_moe.down_projection(act, w2, cu)
        del act
        out = weighted_sum_token_rows(y_AD, inv_A, scores_Tk)
        # s of each sorted row: row inv[t * k + j] holds choice (t, j)
        scores_A = torch.empty(T * k, dtype=torch.float32, device=x.device)
        scores_A.index_copy_(0, inv_A, scores_Tk.reshape(-1).float())
        ctx.save_for_backward(x, h, w13, w2, src, cu, inv_A, scores_A)
        ctx.meta = (recipe, T, k, w13_E2FD.dtype, w2_EDF.dtype, scores_Tk.dtype, x_TD.dtype)
        return out.to(x_TD.dtype)

    @staticmethod
    @no_double_backward("the gathered bf16 MoE experts", "the composed bf16 path (MXMOE_EXPERT_ENGINE unset)")
    def backward(ctx, dy_TD: Tensor):
        x, h, w13, w2, src, cu, inv_A, scores_A = ctx.saved_tensors
        recipe, T, k, w13_dtype, w2_dtype, s_dtype, x_dtype = ctx.meta
        dy = dy_TD.to(GEMM_DTYPE).contiguous()
        dh, sact, ds_A = quack_moe.down_projection_dgated(dy, src, cu, w2, h, scores_A)
        del h
        dw2 = quack_moe.gathered_weight_grad(dy, src, cu, sact, torch.empty_like(w2), interleaved_b=False)
        del sact
        dx_AD = quack_moe.up_projection_dgrad(dh, w13, cu)
        dw13 = torch.empty_like(w13)
        quack_moe.gathered_weight_grad(x, src, cu, dh, dw13.permute(0, 2, 1), interleaved_b=True)
        del dh
        dx_TD = sum_token_rows(dx_AD, inv_A, k, x_dtype, recipe)  # Triton on CUDA (the bf16 recipe's backend)
        d_scores = ds_A.index_select(0, inv_A).view(T, k).to(s_dtype)
        return (dx_TD, d_scores, widen_weight_grad(dw13, w13_dtype, recipe), widen_weight_grad(dw2, w2_dtype, recipe),
                None, None, None, None)


def gathered_moe_experts(x_TD: Tensor, scores_Tk: Tensor, w13_E2FD: Tensor, w2_EDF: Tensor, order_A: Tensor,
                         offsets_E: Tensor, recipe: Recipe | str) -> Tensor:
    """SwiGLU experts and weighted combine in bf16 on QuACK's gathered grouped GEMMs
    (module docstring): out[t] = sum_j scores[t, j] * expert_{e(t, j)}(x[t]).

    Args:
        x_TD: (T, D) bfloat16 tokens. scores_Tk: (T, k) router scores (float32 from
            :class:`~mxmoe.nn.moe.TopKRouter`; differentiable).
        w13_E2FD: (E, 2F, D) [gate; up]; w2_EDF: (E, D, F); bfloat16 or float32 (cast to
            bf16 once per call, gradients returned in the parameter's dtype).
        order_A: (A,) int64 assignment t * k + j of each row sorted by expert (a stable
            argsort of the experts). offsets_E: (E,) int32 cumulative end row of each expert.
        recipe: a non-quantizing recipe (``bf16``) or its name; decides the widening of
            the weight gradients (:func:`~mxmoe.ops.backend.widen_weight_grad`).

    Returns:
        (T, D) in x's dtype.

    Raises:
        TypeError: an argument is not a tensor; order not int64 or offsets not int32;
            weights or scores not bfloat16/float32.
        ValueError: a quantizing recipe; x not bf16; shapes that do not fit together
            (x (T, D), scores (T, k), w13 (E, 2F, D), w2 (E, D, F), order (T * k,),
            offsets (E,)); or the GEMMs do not apply here
            (:func:`mxmoe.kernels.quack_moe.supports`: an sm90 GPU with QuACK, D and F
            multiples of 8). The routing values are not checked (a host sync on CUDA):
            order must be a permutation sorting the experts and offsets its cumulative
            counts, as :func:`mxmoe.nn.moe.routed_experts` makes them.
    """
    check_tensor_args("gathered_moe_experts", x_TD=x_TD, scores_Tk=scores_Tk, w13_E2FD=w13_E2FD, w2_EDF=w2_EDF,
                      order_A=order_A, offsets_E=offsets_E)
    recipe = get_recipe(recipe)
    if recipe.quantize:
        raise ValueError(f"gathered_moe_experts runs the bf16 recipe, got {recipe.name!r}")
    if x_TD.dtype != torch.bfloat16 or x_TD.dim() != 2:
        raise ValueError(f"gathered_moe_experts takes (T, D) bfloat16 activations, got {x_TD.dtype} "
                         f"{tuple(x_TD.shape)}")
    T, D = x_TD.shape
    if w13_E2FD.dim() != 3 or w13_E2FD.shape[1] % 2 or w13_E2FD.shape[2] != D or not w13_E2FD.shape[0]:
        raise ValueError(f"w13 must be (E >= 1, 2F, D={D}), got {tuple(w13_E2FD.shape)}")
    for name, t in (("w13", w13_E2FD), ("w2", w2_EDF), ("scores", scores_Tk)):
        if t.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"{name} must be bfloat16 or float32, got {t.dtype}")
    E, F = w13_E2FD.shape[0], w13_E2FD.shape[1] // 2
    if tuple(w2_EDF.shape) != (E, D, F):
        raise ValueError(f"w2 must be (E, D, F) = ({E}, {D}, {F}) to match w13, got {tuple(w2_EDF.shape)}")
    if scores_Tk.dim() != 2 or scores_Tk.shape[0] != T:
        raise ValueError(f"scores must be (T={T}, k), got {tuple(scores_Tk.shape)}")
    k = scores_Tk.shape[1]
    if order_A.dtype != torch.int64 or offsets_E.dtype != torch.int32:
        raise TypeError(f"order must be int64 and offsets int32, got {order_A.dtype} and {offsets_E.dtype}")
    if tuple(order_A.shape) != (T * k,) or tuple(offsets_E.shape) != (E,):
        raise ValueError(f"order must be (T * k,) = ({T * k},) and offsets (E,) = ({E},), got "
                         f"{tuple(order_A.shape)} and {tuple(offsets_E.shape)}")
    if not quack_moe.supports(x_TD, D, F):
        raise ValueError(f"gathered_moe_experts runs QuACK's kernels: an sm90 GPU with quack-kernels installed "
                         f"(pip install 'mxmoe[hopper]'), D and F multiples of 8; got x on {x_TD.device}, D={D}, F={F}"
                         f"{'' if quack_moe.available() else ', QuACK not importable'}")
    src_A = torch.div(order_A, k, rounding_mode="floor")
    inv_A = inverse_permutation(order_A)
    return _GatheredExpertsFunction.apply(x_TD, scores_Tk, w13_E2FD, w2_EDF, src_A, offsets_E, inv_A, recipe)
