"""``mx_grouped_mm``: the expert GEMM of an MoE layer under a precision recipe.

x (T, K) holds tokens sorted by expert; expert e owns rows offsets[e-1]:offsets[e]
(offsets int32, cumulative ends, offsets[-1] <= T). With w (E, N, K):

    forward  out_e = x_e w_e^T      x along K,                  w along K
    dgrad    dx_e  = dout_e w_e      dout along N,               w along N
    wgrad    dw_e  = dout_e^T x_e    dout and x along tokens, each expert's tokens blocked
                                     separately and zero padded to a multiple of 32

Every copy is quantized from the high-precision tensor (docs/NUMERICS.md). Which
implementation runs each pass is decided by :func:`mxmoe.ops.backend.grouped_gemm_backend`
(one documented rule). Nothing here synchronizes with the host on CUDA, except the first
CUTLASS quantized-weight forward or dgrad of a shape on a device (its stride arrays:
kernels/cutlass_mx_grouped_gemm.py) and that library's build at first use. Rows past
offsets[-1] are never read: their outputs and input gradients are exact zeros. Experts
with no tokens get exact zero gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import cutlass_mx_grouped_gemm
from ..recipe import Recipe, get_recipe
from .autograd import no_double_backward
from .backend import GroupedGemmBackend, grouped_gemm_backend, widen_weight_grad
from .args import check_tensor_args
from .offsets import check_offsets_values
from .gemm import grouped_mm_nn, grouped_mm_nt, grouped_mm_tn
from .quantize import check_weight_dtype, fake_quantize_grouped_tokens_pair, fake_quantize_operand
from .sm100 import native_grouped_mm_nn, native_grouped_mm_nt, native_grouped_mm_tn
from .weight_cache import active_cache, dgrad_operand, weight_operands


class _MXGroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TK: Tensor, w_ENK: Tensor, offsets_E: Tensor, recipe: Recipe) -> Tensor:
        dtype = x_TK.dtype
        # rows past offsets[-1] may hold anything: no GEMM below reads them (the quantizers
        # are row-local along K, the grouped GEMMs read only the groups' rows, the wgrad
        # quantizer only each expert's tokens), and the outputs there are written as zeros
        ctx.save_for_backward(x_TK, w_ENK, offsets_E)
        ctx.recipe = recipe
        backend = grouped_gemm_backend("forward", x_TK, w_ENK, offsets_E, recipe,
                                        weight_cached=active_cache(w_ENK) is not None)
        ctx.native = backend is GroupedGemmBackend.NATIVE_MXFP8
        ctx.wq_dgrad = None
        if ctx.native:  # sm100: block-scaled MXFP8 tensor cores (untested on hardware)
            return native_grouped_mm_nt(x_TK, w_ENK, offsets_E, recipe, out_dtype=dtype)
        xq_TK = fake_quantize_operand(x_TK, recipe, dim=1, out_dtype=dtype) if recipe.quantize else x_TK.to(torch.bfloat16)
        if backend is GroupedGemmBackend.CUTLASS_QUANTIZED_WEIGHT:  # same values as the pass below
            out = cutlass_mx_grouped_gemm.grouped_mm_nt_wq(xq_TK, w_ENK, offsets_E, recipe)
            if out is not None:
                return out
        # w along K; inside weight_copy_cache() also the dgrad copy (along N), from one read
        gemm_dtype = dtype if recipe.quantize else torch.bfloat16
        wq_ENK, ctx.wq_dgrad = weight_operands(w_ENK, recipe, gemm_dtype, dgrad=ctx.needs_input_grad[0])
        return grouped_mm_nt(xq_TK, wq_ENK, offsets_E).to(dtype)  # (T, K) x (E, N, K) -> (T, N)

    @staticmethod
    @no_double_backward("mx_grouped_mm", "compute the expert GEMMs that need second-order gradients with plain torch ops (torch.matmul over each expert's rows)")
    def backward(ctx, dy_TN: Tensor):
        x_TK, w_ENK, offsets_E = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        dtype = x_TK.dtype
        dy_TN = dy_TN.to(dtype).contiguous()  # may arrive expanded; rows past the end are not read
        dx = dw = None
        if ctx.native:
            if ctx.needs_input_grad[0]:
                dx = native_grouped_mm_nn(dy_TN, w_ENK, offsets_E, recipe, out_dtype=dtype)
            if ctx.needs_input_grad[1]:
                wgrad = grouped_gemm_backend("wgrad", dy_TN, w_ENK, offsets_E, recipe)
                dw = (native_grouped_mm_tn(dy_TN, x_TK, offsets_E, recipe) if wgrad is GroupedGemmBackend.NATIVE_MXFP8
                      else grouped_mm_tn(dy_TN.t(), x_TK.t(), offsets_E)).to(w_ENK.dtype)
            return dx, dw, None, None
        if ctx.needs_input_grad[0]:
            dx = _dgrad(dy_TN, w_ENK, offsets_E, recipe, ctx.wq_dgrad)
        if ctx.needs_input_grad[1]:
            if not recipe.quantize:
                a_NL, b_KL, offs = dy_TN.t().to(torch.bfloat16), x_TK.t().to(torch.bfloat16), offsets_E
            elif recipe.wgrad_high_precision:
                a_NL, b_KL, offs = dy_TN.t(), x_TK.t(), offsets_E
            else:  # each expert's tokens blocked separately, in the padded token layout
                a_NL, b_KL, offs = fake_quantize_grouped_tokens_pair(dy_TN, x_TK, offsets_E, recipe, out_dtype=dtype)
            # the padded layout gives an empty expert a block of zeros: its dW comes out of the GEMM as 0
            padded = recipe.quantize and not recipe.wgrad_high_precision
            dw = grouped_mm_tn(a_NL, b_KL, offs, nonempty_groups=padded)  # (N, L) x (K, L) -> (E, N, K)
            dw = widen_weight_grad(dw, w_ENK.dtype, recipe)
        return dx, dw, None, None


def _dgrad(dy_TN: Tensor, w_ENK: Tensor, offsets_E: Tensor, recipe: Recipe, wq_dgrad: Tensor | None = None,
           backend: GroupedGemmBackend | None = None) -> Tensor:
    """The dgrad of ``mx_grouped_mm``: dx (T, K) in dy's dtype = dy_e (quantized along N)
    times w_e (quantized along N, or ``wq_dgrad``: the copy ``weight_operands`` made in the
    forward inside ``weight_copy_cache()``). dy (T, N) contiguous, in x's dtype. ``backend``:
    the caller's :func:`grouped_gemm_backend` for this dgrad, if it has one (else it is
    chosen here); not ``NATIVE_MXFP8``, which the callers run themselves."""
    dtype = dy_TN.dtype
    if not recipe.quantize:
        return grouped_mm_nn(dy_TN.to(torch.bfloat16), dgrad_operand(w_ENK, recipe, torch.bfloat16, wq_dgrad),
                             offsets_E).to(dtype)
    dyq_TN = fake_quantize_operand(dy_TN, recipe, dim=1, out_dtype=dtype)  # along N
    if backend is None:
        backend = grouped_gemm_backend("dgrad", dy_TN, w_ENK, offsets_E, recipe,
                                       weight_cached=wq_dgrad is not None or active_cache(w_ENK) is not None)
    if backend is GroupedGemmBackend.CUTLASS_QUANTIZED_WEIGHT:  # same values as the pass below
        dx = cutlass_mx_grouped_gemm.grouped_mm_nn_wq(dyq_TN, w_ENK, offsets_E, recipe)
        if dx is not None:
            return dx
    wq_ENK = dgrad_operand(w_ENK, recipe, dtype, wq_dgrad)  # along N
    return grouped_mm_nn(dyq_TN, wq_ENK, offsets_E).to(dtype)  # (T, N) x (E, N, K) -> (T, K)


def mx_grouped_mm_dgrad(dy: Tensor, w: Tensor, offsets: Tensor, recipe: Recipe | str = "mxfp8") -> Tensor:
    """The input gradient of :func:`mx_grouped_mm` alone: dx[t] = dy[t] @ w[e] for the rows
    t of expert e, dy and w quantized along N under ``recipe`` (what its backward runs; for
    benchmarks and for callers that need no weight gradient).

    Args:
        dy: (T, N) float32/bfloat16/float16, rows sorted by expert.
        w: (E, N, K) expert weights.
        offsets: (E,) int32 / int64 cumulative end rows on dy's device.
        recipe: a :class:`~mxmoe.recipe.Recipe` or its name.

    Returns:
        (T, K) in dy's dtype; rows past offsets[-1] are zeros. No autograd graph: this is
        the backward's computation, not a differentiable op.

    Raises:
        TypeError, ValueError: as :func:`mx_grouped_mm` (dy in x's place, with N for K).

    The implementation follows :func:`mxmoe.ops.backend.grouped_gemm_backend`, as in the backward.
    """
    recipe = get_recipe(recipe)
    check_tensor_args("mx_grouped_mm_dgrad", dy=dy, w=w, offsets=offsets)
    check_weight_dtype(w, "w", "mx_grouped_mm_dgrad", recipe)
    _check_args(dy, w, offsets, "mx_grouped_mm_dgrad", "dy", "N")
    check_offsets_values(offsets, dy.shape[0], "mx_grouped_mm_dgrad")
    with torch.no_grad():  # the backward's computation: no graph for any recipe
        dy = dy.contiguous()
        backend = grouped_gemm_backend("dgrad", dy, w, offsets, recipe, weight_cached=active_cache(w) is not None)
        if backend is GroupedGemmBackend.NATIVE_MXFP8:
            return native_grouped_mm_nn(dy, w, offsets, recipe, out_dtype=dy.dtype)
        return _dgrad(dy, w, offsets, recipe, backend=backend)


# torch.compile runs our MXFP8 autograd Functions eagerly, a graph break on each side (the
# ops around them still compile); this is the one note for all of them (mx_grouped_mm,
# mx_linear, mx_moe_experts, the layer's MXFP8 combine and dispatch rounding): Dynamo's
# tracing of them returned zero gradients on the H200 (torch 2.11; root cause not pinned
# down), and their kernels are custom ops Inductor cannot fuse into anyway
# (tests/nn/test_compile.py).
@torch.compiler.disable
def _apply(x_TK: Tensor, w_ENK: Tensor, offsets_E: Tensor, recipe: Recipe) -> Tensor:
    """The offsets' values checked (:mod:`mxmoe.ops.offsets`; eager, so under
    torch.compile too), then the op."""
    check_offsets_values(offsets_E, x_TK.shape[0], "mx_grouped_mm")
    return _MXGroupedMMFunction.apply(x_TK, w_ENK, offsets_E, recipe)


def mx_grouped_mm(x: Tensor, w: Tensor, offsets: Tensor, recipe: Recipe | str = "mxfp8") -> Tensor:
    """Grouped GEMM out[t] = x[t] @ w[e]^T for the rows t of expert e, under ``recipe``.

    Args:
        x: (T, K) float32/bfloat16/float16, rows sorted by expert. The GEMMs run in x's
            dtype with float32 accumulation.
        w: (E, N, K) expert weights (any float dtype, usually float32 master weights).
        offsets: (E,) int32 (or int64) on x's device: cumulative end row of each expert
            (0 <= offsets[0], non-decreasing, offsets[-1] <= T: the contract in
            :mod:`mxmoe.ops.offsets`). Rows past offsets[-1] are ignored.
        recipe: a :class:`~mxmoe.recipe.Recipe` or its name.

    Returns:
        (T, N) in x's dtype; rows past offsets[-1] are zeros.

    Raises:
        TypeError: an argument is not a tensor, x not float32/bfloat16/float16, offsets
            not int32/int64.
        ValueError: a tensor on the meta device, shapes disagree (x (T, K), w (E, N, K), offsets (E,)), devices differ;
            offsets that break the contract (a negative start, a decrease, past T): checked
            on the CPU, and on CUDA only with ``MXMOE_CHECK_OFFSETS=1`` (no host sync by
            default).

    Gradients flow to x and w (not offsets). K, N and group sizes need not be multiples of
    32 (zero padded, exact). Under ``torch.compile`` the op runs eagerly, with a graph
    break on each side (module note at ``_apply``).
    """
    recipe = get_recipe(recipe)
    check_tensor_args("mx_grouped_mm", x=x, w=w, offsets=offsets)
    check_weight_dtype(w, "w", "mx_grouped_mm", recipe)
    _check_args(x, w, offsets, "mx_grouped_mm", "x", "K")
    return _apply(x, w, offsets, recipe)


def _check_args(a: Tensor, w: Tensor, offsets: Tensor, fn: str, a_name: str, dim: str) -> None:
    """The argument rules of mx_grouped_mm (a = x (T, K), dim "K") and mx_grouped_mm_dgrad
    (a = dy (T, N), dim "N") against w (E, N, K) and offsets (E,)."""
    if a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{a_name} has dtype {a.dtype}; {fn} takes float32, bfloat16 or float16")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"offsets must be int32 or int64 cumulative end rows, got dtype {offsets.dtype}")
    w_dim = 2 if dim == "K" else 1
    if a.dim() != 2 or w.dim() != 3 or w.shape[w_dim] != a.shape[1]:
        raise ValueError(f"expected {a_name} (T, {dim}) and w (E, N, K) with the same {dim}, got {tuple(a.shape)} "
                         f"and {tuple(w.shape)}")
    if a.shape[1] == 0:
        raise ValueError(f"{a_name} has {dim} = 0 (shape {tuple(a.shape)}); {fn} needs {dim} >= 1")
    if offsets.shape != (w.shape[0],):
        raise ValueError(f"offsets must have shape (E,) = ({w.shape[0]},), got {tuple(offsets.shape)}")
    if not (a.device == w.device == offsets.device):
        raise ValueError(f"{a_name}, w and offsets must be on one device, got {a.device}, {w.device}, {offsets.device}")
