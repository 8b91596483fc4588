"""The MXFP8 SwiGLU expert block as one autograd op: permute, three grouped GEMMs forward
and six backward, SwiGLU, with FP8 activations saved for the backward.

Legend: T tokens, D model width, F expert hidden width, E experts, A routed rows (T * k)
sorted by expert, Ap = 32 * (A // 32 + E) the per-expert padded token length.

Forward (recipe ``mxfp8``):

    x_TD                                                                             [saved, as given]
         --gather rows src_A, quantize along D--> xq_AD (bf16, exact MXFP8 values)
    h_A2F = xq_AD @ Q_D(w13_E2FD)^T                                      (grouped GEMM)
    act_AF = Q_F(silu(gate) * up), h's codes + scales along F                          [saved]
    y_AD = act_AF @ Q_F(w2_EDF)^T                                        (grouped GEMM)

Backward (dy_AD):

    d_act_AF = Q_D(dy) @ Q_D(w2)                                         (dgrad, grouped GEMM)
    gate', up' = dequantize(saved h); act' = silu(gate') * up'
    dh_A2F = [d_act * up' * silu'(gate'), d_act * silu(gate')]
    dw2_EDF = Q_tok(dy)^T Q_tok(act')                                     (wgrad, over each expert's tokens)
    dx_AD = Q_2F(dh) @ Q_2F(w13)                                          (dgrad)
    dw13_E2FD = Q_tok(dh)^T Q_tok(x[src_A])                               (wgrad; x gathered and quantized
                                                                           along each expert's tokens here)
    dx_TD = sum over each token's k rows of dx_AD                         (deterministic, no atomics)
    with weights_A (the combine weight w_a of each row): d(w_a) = act'_a . d_act_a / w_a
                                                                          (= y_a . dy_t: the combine's
                                                                           weight gradient, from the
                                                                           SwiGLU backward's pass)

Saved activations: x itself (T rows, the tensor the caller passed; the router's GEMM keeps
it too) and h as FP8 + E8M0 along F (2F bytes per routed row + 1/32), against the bf16
layer's gathered x, h and act (2D + 6F bytes per routed row). x's wgrad operand, blocked
along each expert's tokens, is made in the backward from x and the routing: keeping it
from the forward instead would cost D bytes per routed row, k times x's own 2D bytes per
token over 2 (4x x's size at top-8). Following DeepSeek-V3 (arXiv 2412.19437, section 3.3: SwiGLU
inputs cached in FP8, the output recomputed in the backward), the backward of SwiGLU and
the weight gradient of w2 use the dequantized saved h: this differs from the composed
path (:class:`~mxmoe.nn.moe.SwiGLUExperts` without fusion) only in the backward, by the MXFP8
rounding of h and, with weights_A, by the combine weights' gradient taken from the
backward's MXFP8 GEMM output (act' . d_act / w) instead of from y.

Every step has a pure-torch reference (CPU and any device) and a Triton path (CUDA, or
TRITON_INTERPRET=1) selected by the recipe's backend; the element and scale rules are
identical (docs/NUMERICS.md), the SwiGLU float32 math agrees to a few ulps of exp.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..numerics.formats import ElemFormat
from ..numerics.grouped import torch_quantize_grouped_dim0
from ..numerics.mx_tensor import MXTensor
from .autograd import no_double_backward
from .backend import use_triton_for, widen_weight_grad
from .args import check_tensor_args
from .offsets import check_offsets_values
from ..recipe import Recipe, get_recipe
from .gemm import grouped_mm_nn, grouped_mm_nt, grouped_mm_tn
from .quantize import (
    check_weight_dtype,
    dequantize_mx,
    fake_quantize_grouped_tokens,
    fake_quantize_grouped_tokens_pair,
    fake_quantize_operand,
    quantize_mx,
)
from .weight_cache import dgrad_operand, weight_operands

BLOCK = 32
GEMM_DTYPE = torch.bfloat16  # operand dtype of the grouped GEMMs (exact for MXFP8 values)


def gather_fake_quantize_rows(x_TD: Tensor, src_A: Tensor, recipe: Recipe) -> Tensor:
    """(A, D) bf16: x[src[a]] quantized to MXFP8 along D and dequantized (the forward
    GEMM operand), the gather fused into the quantizer's read on the Triton path."""
    if use_triton_for(x_TD, recipe):
        from ..kernels.moe_experts import triton_gather_fake_quantize_rows

        return triton_gather_fake_quantize_rows(x_TD, src_A, recipe.fmt, recipe.scale_mode, GEMM_DTYPE)
    return fake_quantize_operand(x_TD.index_select(0, src_A), recipe, dim=1, out_dtype=GEMM_DTYPE)


def quantize_grouped_gather(x_TD: Tensor, src_A: Tensor, offsets_E: Tensor, recipe: Recipe
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """x[src] quantized along tokens, each expert's tokens in their own blocks: codes
    (D, Ap), E8M0 scales (D, Ap / 32), padded offsets (E,) int32."""
    if use_triton_for(x_TD, recipe):
        from ..kernels.moe_experts import triton_quantize_grouped_gather

        return triton_quantize_grouped_gather(x_TD, src_A, offsets_E, recipe.fmt, recipe.scale_mode)
    return torch_quantize_grouped_dim0(x_TD.index_select(0, src_A), offsets_E, recipe.fmt, recipe.scale_mode)


def _silu_f32(g: Tensor) -> Tensor:
    return g * (1.0 / (1.0 + torch.exp(-g)))


def swiglu_quantize(h_A2F: Tensor, recipe: Recipe) -> tuple[Tensor, Tensor, Tensor]:
    """act = silu(gate) * up in float32, quantized to MXFP8 along F and dequantized to bf16
    (A, F); h's codes (A, 2F) and E8M0 scales (A, 2F / 32), blocks along F."""
    if use_triton_for(h_A2F, recipe):
        from ..kernels.moe_experts import triton_swiglu_quantize

        return triton_swiglu_quantize(h_A2F, recipe.fmt, recipe.scale_mode, GEMM_DTYPE)
    A, F2 = h_A2F.shape
    F = F2 // 2
    mx = quantize_mx(h_A2F.reshape(A, 2, F), recipe.fmt, block_size=BLOCK, dim=2, scale_mode=recipe.scale_mode,
                     backend="reference")
    g, u = h_A2F.float().chunk(2, dim=1)
    act = fake_quantize_operand(_silu_f32(g) * u, recipe, dim=1, out_dtype=GEMM_DTYPE)
    return act, mx.qdata.reshape(A, F2), mx.scale.reshape(A, F2 // BLOCK)


def swiglu_backward(hq: Tensor, hs: Tensor, dact_AF: Tensor, recipe: Recipe, row_dot: bool = False
                    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """From h's saved codes/scales and d(act) (A, F): dh = [d(gate) | d(up)] (A, 2F) and the
    recomputed act (A, F), both bf16, float32 math on the dequantized gate and up; with
    ``row_dot`` also (A,) float32 sum over F of act * d(act) (act before its bf16 rounding),
    else None; and dh's dgrad operand, dh quantized along 2F and dequantized to bf16 (on the
    Triton path in the same pass)."""
    if use_triton_for(dact_AF, recipe):
        from ..kernels.moe_experts import triton_swiglu_backward

        dh, act, dot, dhq = triton_swiglu_backward(hq, hs, dact_AF, GEMM_DTYPE, row_dot, recipe.scale_mode)
        return dh, act, dot if row_dot else None, dhq
    A, F = dact_AF.shape
    mx = MXTensor(qdata=hq.reshape(A, 2, F), scale=hs.reshape(A, 2, F // BLOCK), fmt=ElemFormat.parse(recipe.fmt),
                  block_size=BLOCK, dim=2, scale_mode=recipe.scale_mode, orig_size=F)
    h = dequantize_mx(mx, torch.float32, backend="reference")
    g, u = h[:, 0], h[:, 1]
    s = 1.0 / (1.0 + torch.exp(-g))
    silu = g * s
    da = dact_AF.float()
    dg = da * u * (s * (1.0 + g * (1.0 - s)))
    du = da * silu
    act = silu * u
    dh = torch.cat([dg, du], dim=1).to(GEMM_DTYPE)
    return (dh, act.to(GEMM_DTYPE), (act * da).sum(dim=1) if row_dot else None,
            fake_quantize_operand(dh, recipe, dim=1, out_dtype=GEMM_DTYPE))


def sum_token_rows(x_AD: Tensor, rows_A: Tensor, k: int, out_dtype: torch.dtype, recipe: Recipe) -> Tensor:
    """(T, D) ``out_dtype``: out[t] = sum over j = 0..k-1 of x[rows[t * k + j]] in float32,
    in that order, rounded once (the un-permute of dx; a gather: deterministic). One
    Triton kernel on the Triton path, index_select + float32 sum otherwise.

    Raises:
        ValueError: k < 1, the rows are not k per token, or rows is not one per row of x
            (both paths alike).
    """
    if k < 1 or x_AD.shape[0] % k:
        raise ValueError(f"{x_AD.shape[0]} rows are not k = {k} rows per token (k >= 1)")
    if rows_A.shape != (x_AD.shape[0],):
        raise ValueError(f"rows must have shape ({x_AD.shape[0]},), one per row of x, got {tuple(rows_A.shape)}")
    if use_triton_for(x_AD, recipe):
        from ..kernels.moe_experts import triton_sum_token_rows

        return triton_sum_token_rows(x_AD, rows_A, k, out_dtype)
    T, D = x_AD.shape[0] // k, x_AD.shape[1]
    return x_AD.index_select(0, rows_A).view(T, k, D).float().sum(dim=1).to(out_dtype)


def _dequantize_grouped(q: Tensor, s: Tensor, recipe: Recipe) -> Tensor:
    """Saved (C, Ap) codes + (C, Ap / 32) scales -> (C, Ap) bf16 (blocks along Ap); on the
    Triton path the transposed view of a contiguous (Ap, C) tensor, the layout of the
    other wgrad operand (:func:`~mxmoe.ops.quantize.fake_quantize_grouped_tokens`)."""
    if use_triton_for(q, recipe, GEMM_DTYPE):
        from ..kernels.quantize import dequantize_colwise

        return dequantize_colwise(q, s, GEMM_DTYPE).t()
    C, Ap = q.shape
    mx = MXTensor(qdata=q, scale=s, fmt=ElemFormat.parse(recipe.fmt), block_size=BLOCK, dim=1,
                  scale_mode=recipe.scale_mode, orig_size=Ap)
    return dequantize_mx(mx, GEMM_DTYPE, backend="reference")


class _MXExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: Tensor, w13_E2FD: Tensor, w2_EDF: Tensor, src_A: Tensor, offsets_E: Tensor,
                weights_A: Tensor | None, recipe: Recipe, x_saved_as_codes: bool) -> Tensor:
        xq_AD = gather_fake_quantize_rows(x_TD, src_A, recipe)
        # x's token-blocked wgrad operand: made here and kept as MXFP8 codes, or made in the
        # backward from x itself (kept instead)
        xg = quantize_grouped_gather(x_TD, src_A, offsets_E, recipe) if x_saved_as_codes else None
        need_dx = ctx.needs_input_grad[0]  # the dgrad copies are made here only inside weight_copy_cache()
        w13q, ctx.w13q_dgrad = weight_operands(w13_E2FD, recipe, GEMM_DTYPE, dgrad=need_dx)  # along D
        h_A2F = grouped_mm_nt(xq_AD, w13q, offsets_E, all_rows=True)  # (A, D) x (E, 2F, D) -> (A, 2F)
        del xq_AD, w13q
        act_AF, hq, hs = swiglu_quantize(h_A2F, recipe)
        del h_A2F
        w2q, ctx.w2q_dgrad = weight_operands(w2_EDF, recipe, GEMM_DTYPE, dgrad=any(ctx.needs_input_grad))  # F
        y_AD = grouped_mm_nt(act_AF, w2q, offsets_E, all_rows=True)  # (A, F) x (E, D, F) -> (A, D)
        if xg is None:
            ctx.save_for_backward(x_TD, w13_E2FD, w2_EDF, src_A, offsets_E, hq, hs, weights_A)
        else:
            ctx.save_for_backward(None, w13_E2FD, w2_EDF, src_A, offsets_E, hq, hs, weights_A, *xg)
        ctx.recipe, ctx.T, ctx.x_dtype = recipe, x_TD.shape[0], x_TD.dtype
        return y_AD.to(x_TD.dtype)

    @staticmethod
    @no_double_backward("mx_moe_experts", "compute the expert GEMMs that need second-order gradients with plain torch ops (torch.matmul over each expert's rows)")
    def backward(ctx, dy_AD: Tensor):
        x_TD, w13, w2, src_A, offsets_E, hq, hs, weights_A, *xg = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        dy_AD = dy_AD.to(GEMM_DTYPE).contiguous()
        # w2 dgrad along D
        dyq = fake_quantize_operand(dy_AD, recipe, dim=1, out_dtype=GEMM_DTYPE)
        w2q = dgrad_operand(w2, recipe, GEMM_DTYPE, ctx.w2q_dgrad)  # (E, D, F) along D
        dact_AF = grouped_mm_nn(dyq, w2q, offsets_E, all_rows=True)  # (A, D) x (E, D, F) -> (A, F)
        del dyq, w2q
        with_w = weights_A is not None and ctx.needs_input_grad[5]
        dh_A2F, act_AF, dot_A, dhq = swiglu_backward(hq, hs, dact_AF, recipe, row_dot=with_w)
        del dact_AF
        d_weights = None
        if with_w:  # act . (w dy w2) / w = y . dy, the weight's gradient; 0 where w rounds to 0
            w_bf = weights_A.to(dy_AD.dtype).float()
            d_weights = torch.where(w_bf != 0, dot_A / torch.where(w_bf != 0, w_bf, 1.0), 0.0).to(weights_A.dtype)
        # w13 dgrad along 2F (dhq: dh quantized in the SwiGLU backward's pass), then the
        # un-permute (each token's k rows summed in a fixed order), before dhq and dx_AD wait
        w13q = dgrad_operand(w13, recipe, GEMM_DTYPE, ctx.w13q_dgrad)  # (E, 2F, D) along 2F
        dx_AD = grouped_mm_nn(dhq, w13q, offsets_E, all_rows=True)  # (A, 2F) x (E, 2F, D) -> (A, D)
        del dhq, w13q
        A = dx_AD.shape[0]
        T = ctx.T
        k = A // T if T else 1
        order = torch.argsort(src_A, stable=True)  # the rows of token t, in increasing row order
        dx_TD = sum_token_rows(dx_AD, order, k, ctx.x_dtype, recipe)
        del dx_AD
        # w2 wgrad along tokens
        dy_t, act_t, po = fake_quantize_grouped_tokens_pair(dy_AD, act_AF, offsets_E, recipe,
                                                            out_dtype=GEMM_DTYPE)  # (D, Ap), (F, Ap)
        dw2 = grouped_mm_tn(dy_t, act_t, po, nonempty_groups=True)  # (E, D, F); padded layout: empty experts give 0
        del dy_t, act_t, act_AF
        # w13 wgrad along tokens
        dh_t, _ = fake_quantize_grouped_tokens(dh_A2F, offsets_E, recipe, out_dtype=GEMM_DTYPE)  # (2F, Ap)
        xg_q, xg_s, padded_offsets = xg if xg else quantize_grouped_gather(x_TD, src_A, offsets_E, recipe)
        x_t = _dequantize_grouped(xg_q, xg_s, recipe)  # (D, Ap)
        del xg_q, xg_s, xg
        dw13 = grouped_mm_tn(dh_t, x_t, padded_offsets, nonempty_groups=True)  # (E, 2F, D)
        del dh_t, x_t
        return (dx_TD, widen_weight_grad(dw13, w13.dtype, recipe), widen_weight_grad(dw2, w2.dtype, recipe), None,
                None, d_weights, None, None)


def supports_fused_experts(d_model: int, d_expert: int, recipe: Recipe) -> bool:
    """The fused op needs a quantizing FP8 recipe with 32-blocks and D, F multiples of 32."""
    return (recipe.quantize and not recipe.wgrad_high_precision and recipe.block_size == BLOCK
            and recipe.fmt in ("e4m3", "e5m2") and d_model % BLOCK == 0 and d_expert % BLOCK == 0)


@torch.compiler.disable
def _apply(x_TD: Tensor, w13_E2FD: Tensor, w2_EDF: Tensor, src_A: Tensor, offsets_E: Tensor, recipe: Recipe,
           unrouted_tail: bool = False, weights_A: Tensor | None = None, x_saved_as_codes: bool = False) -> Tensor:
    """The routing preconditions on the CPU (free there; on CUDA reading them back would
    sync), then the op. Eager under torch.compile (the note at
    ``mxmoe.ops.grouped_mm._apply``), so the checks hold there too."""
    T, A = x_TD.shape[0], src_A.numel()
    # every row belongs to an expert, unless the caller declared an unrouted tail
    check_offsets_values(offsets_E, A, "mx_moe_experts", exact=not unrouted_tail)
    if x_TD.device.type == "cpu" and A:
        k = A // T
        low, high = int(src_A.min()), int(src_A.max())
        if low < 0 or high >= T:
            raise ValueError(f"src_A holds token index {low if low < 0 else high}; token indices are 0 .. T - 1 = {T - 1}")
        if not bool((torch.bincount(src_A, minlength=T) == k).all()):
            raise ValueError(f"every token must appear exactly k = {k} times in src_A")
    return _MXExpertsFunction.apply(x_TD, w13_E2FD, w2_EDF, src_A, offsets_E, weights_A, recipe, x_saved_as_codes)


def mx_moe_experts(x_TD: Tensor, src_A: Tensor, offsets_E: Tensor, w13_E2FD: Tensor, w2_EDF: Tensor,
                   recipe: Recipe | str, unrouted_tail: bool = False, weights_A: Tensor | None = None,
                   x_saved_as_codes: bool = False) -> Tensor:
    """The SwiGLU experts of an MoE layer under an MXFP8 recipe, fused (module docstring).

    Args:
        x_TD: (T, D) bfloat16 token activations (not permuted).
        src_A: (A,) int64, the token of each routed row, rows sorted by expert; every token
            appears exactly k = A / T times.
        offsets_E: (E,) int32 cumulative row ends per expert: 0 <= offsets[0],
            non-decreasing, offsets[-1] == A (every row belongs to an expert: the GEMMs
            skip zeroing rows past the end; the contract in :mod:`mxmoe.ops.offsets`).
        w13_E2FD: (E, 2F, D) [gate; up] weights. w2_EDF: (E, D, F), the same E, D and F.
        recipe: a :class:`~mxmoe.recipe.Recipe` or its name, for which :func:`supports_fused_experts` holds.
        unrouted_tail: allow offsets[-1] < A: rows past offsets[-1] belong to no expert
            (the padding of a fixed-size expert-parallel receive buffer). Their outputs and
            their input gradients are unspecified (not computed, not zeroed): the caller
            must not read them. No GEMM or wgrad quantizer reads them.
        weights_A: (A,) float32 combine weight of each sorted row, when the caller sums
            the rows weighted by them and their gradient should come from this op
            (:func:`~mxmoe.ops.combine.combine_rows`, which keeps nothing of the outputs
            for it). The backward then returns d(weights_A)[a] = act_a . d(act)_a / w_a,
            which is y_a . dy_t (y_a = act_a w2_e^T, d(y_a) = w_a dy_t) with the MXFP8
            operands of the backward's GEMMs: the w2 dgrad's output d(act) and act
            recomputed from h's MXFP8 copy, float32 sums (SonicMoE, arXiv 2512.14080,
            takes the router-score gradient from its dgrad epilogue the same way). The
            incoming gradient of the rows must be w_a dy_t, as from combine_rows (with a
            combine that also differentiates the weights, their gradient would count
            twice). Where w_a dy_t underflows, the gradient is 0: w_a = 0 (a masked
            choice) or |w_a| below about 1e-36 (MXFP8's smallest scale is 2^-127); a
            softmax router's own gradient is 0 there anyway, but a weight whose upstream
            derivative is not (a learned gate initialised at 0) needs the composed path
            (``fused=False``).
        x_saved_as_codes: keep x's token-blocked weight-gradient operand from the forward
            as MXFP8 codes (D + D / 32 bytes per padded routed row) instead of x itself
            (made from x in the backward). For callers whose x is a buffer nobody else
            keeps and that holds more rows than are routed (the expert-parallel receive
            buffer); in one process x is the router's input, kept anyway, and smaller.

    Returns:
        (A, D) in x's dtype: expert outputs of the sorted rows.

    Raises:
        TypeError: an argument is not a tensor, offsets not int32, src_A not an integer
            tensor, weights_A not a float tensor of 16 bits or more.
        ValueError: a tensor on the meta device or tensors on different devices,
            weights_A not (A,), unsupported recipe or shapes (x (T, D), w13 (E, 2F, D), w2 (E, D, F),
            offsets (E,), src_A (A,)), activations not bf16; on the CPU also offsets that
            break the contract (a negative start, a decrease, offsets[-1] != A), a token
            index outside 0 .. T - 1 or a token not appearing exactly k times. On CUDA these values are not checked (it would
            cost a host sync), except the offsets with ``MXMOE_CHECK_OFFSETS=1``.

    Under ``torch.compile`` the op runs eagerly, with a graph break on each side (note at
    ``mxmoe.ops.grouped_mm._apply``).
    """
    recipe = get_recipe(recipe)
    check_tensor_args("mx_moe_experts", x_TD=x_TD, src_A=src_A, offsets_E=offsets_E, w13_E2FD=w13_E2FD, w2_EDF=w2_EDF)
    check_weight_dtype(w13_E2FD, "w13", "mx_moe_experts", recipe)
    check_weight_dtype(w2_EDF, "w2", "mx_moe_experts", recipe)
    if w13_E2FD.dim() != 3 or w13_E2FD.shape[1] % 2:
        raise ValueError(f"w13 must be (E, 2F, D) [gate; up] weights, got shape {tuple(w13_E2FD.shape)}")
    E, F2, D = w13_E2FD.shape
    if not (E and F2 and D):
        raise ValueError(f"w13 (E, 2F, D) = {tuple(w13_E2FD.shape)} has an empty dimension; mx_moe_experts needs "
                         f"E, F and D >= 1")
    if tuple(w2_EDF.shape) != (E, D, F2 // 2):
        raise ValueError(f"w2 must be (E, D, F) = ({E}, {D}, {F2 // 2}) to match w13 (E, 2F, D) = "
                         f"{tuple(w13_E2FD.shape)}, got {tuple(w2_EDF.shape)}")
    if x_TD.dim() != 2 or x_TD.shape[1] != D:
        raise ValueError(f"x must be (T, D) with D = {D} (w13's last dim), got {tuple(x_TD.shape)}")
    if offsets_E.dtype != torch.int32:
        raise TypeError(f"offsets must be int32 cumulative end rows, got dtype {offsets_E.dtype}")
    if tuple(offsets_E.shape) != (E,):
        raise ValueError(f"offsets must have shape (E,) = ({E},), one end row per expert, got {tuple(offsets_E.shape)}")
    if src_A.dim() != 1 or src_A.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"src_A must be a 1-D int64 (or int32) tensor of token indices, got {src_A.dtype} of shape "
                        f"{tuple(src_A.shape)}")
    if not supports_fused_experts(D, F2 // 2, recipe):
        raise ValueError(f"the fused MXFP8 expert op needs an FP8 recipe with block 32, no high-precision wgrad, "
                         f"and D, F multiples of 32; got recipe {recipe.name!r}, D={D}, F={F2 // 2}")
    if x_TD.dtype != torch.bfloat16:
        raise ValueError(f"the fused MXFP8 expert op takes bfloat16 activations, got {x_TD.dtype} "
                         f"(float32/float16 would be rounded to bf16 before MXFP8); use mx_grouped_mm")
    T, A = x_TD.shape[0], src_A.numel()
    if (T == 0) != (A == 0) or (T and A % T):
        raise ValueError(f"src_A has {A} rows, not a multiple of T={T}")
    devices = {t.device for t in (x_TD, src_A, offsets_E, w13_E2FD, w2_EDF)}
    if len(devices) > 1:
        raise ValueError(f"x, src_A, offsets, w13 and w2 must be on one device, got x on {x_TD.device}, src_A on "
                         f"{src_A.device}, offsets on {offsets_E.device}, w13 on {w13_E2FD.device}, w2 on "
                         f"{w2_EDF.device}")
    if weights_A is not None:
        check_tensor_args("mx_moe_experts", weights_A=weights_A)
        if weights_A.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise TypeError(f"weights_A must be float32 (or another float dtype of 16+ bits), got {weights_A.dtype}")
        if tuple(weights_A.shape) != (src_A.numel(),):
            raise ValueError(f"weights_A must have shape (A,) = ({src_A.numel()},), one weight per routed row, got "
                             f"{tuple(weights_A.shape)}")
        if weights_A.device != x_TD.device:
            raise ValueError(f"weights_A is on {weights_A.device}, x on {x_TD.device}: put them on one device")
    return _apply(x_TD, w13_E2FD, w2_EDF, src_A, offsets_E, recipe, unrouted_tail, weights_A,
                  bool(x_saved_as_codes))
