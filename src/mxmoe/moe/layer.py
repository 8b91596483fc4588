"""The MoE feed-forward layer: router, token dispatch, SwiGLU experts, weighted combine.

Legend of shape suffixes: T tokens, D model width, F expert hidden width, E experts,
k top-k, A = T * k routed assignments.

Data flow (dropless: every token reaches its k experts, no capacity factor):

    x_TD --router (float32)--> top-k experts and weights per token
         --sort assignments by expert--> x_AD rows grouped by expert, offsets_E
         --mx_grouped_mm(w13_E2FD)--> gate, up --silu(gate) * up--> h_AF
         --mx_grouped_mm(w2_EDF)--> y_AD --unpermute, weight, sum over k--> y_TD

Every gather and scatter here has a deterministic backward: the assignment order is a
permutation, so no two rows land on one destination.

``mx_dispatch=True`` rounds the expert input rows to MXFP8 along D (the recipe's format,
scale rule and block size) before the experts, with a straight-through gradient: the
single-process twin of the expert-parallel layer's MXFP8 dispatch
(:mod:`mxmoe.distributed.ep`), which sends exactly these rows as E4M3 codes + E8M0 scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ..ops import mx_grouped_mm, mx_linear
from ..ops.moe_experts import mx_moe_experts, supports_fused_experts
from ..ops.sm100 import use_native_mx_grouped_mm
from ..numerics.formats import ElemFormat
from ..numerics.mx_tensor import MXTensor, dequantize_mx, quantize_mx, use_triton
from ..ops.quantize import fake_quantize
from ..recipe import Recipe


@dataclass
class RouterOutput:
    """Result of routing T tokens to k of E experts.

    Attributes:
        weights_Tk: float32 (T, k), top-k probabilities renormalized to sum to 1.
        experts_Tk: int64 (T, k), expert index of each choice (ties: lower index first).
        logits_TE: float32 (T, E) router logits.
        probs_TE: float32 (T, E) softmax over experts.
    """

    weights_Tk: Tensor
    experts_Tk: Tensor
    logits_TE: Tensor
    probs_TE: Tensor


class _Float32Linear(torch.autograd.Function):
    """logits = float32(x) @ float32(W)^T, saving x in its own dtype (bf16: half the bytes
    of the float32 copy F.linear would keep); the backward repeats F.linear's float32 math."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, w_ED: Tensor) -> Tensor:
        ctx.save_for_backward(x_TD, w_ED)
        return F.linear(x_TD.float(), w_ED.float())

    @staticmethod
    def backward(ctx, g_TE: Tensor):
        x_TD, w_ED = ctx.saved_tensors
        dx = (g_TE @ w_ED.float()).to(x_TD.dtype) if ctx.needs_input_grad[0] else None
        dw = (g_TE.t() @ x_TD.float()).to(w_ED.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


class TopKRouter(nn.Module):
    """Token-choice top-k router in float32 (softmax over experts, top-k renormalized).

    Args:
        d_model: D. n_experts: E. top_k: k (1 <= k <= E).
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        self.n_experts, self.top_k = n_experts, top_k
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x_TD: Tensor) -> RouterOutput:
        """Route T tokens: x_TD (T, D) float32/bfloat16 -> :class:`RouterOutput` (float32
        logits and probabilities (T, E), top-k weights renormalized to sum to 1 and expert
        indices (T, k); ties broken by the lower expert index, as the issue asks)."""
        logits_TE = _Float32Linear.apply(x_TD, self.weight)
        probs_TE = torch.softmax(logits_TE, dim=-1)
        # topk on probs; a stable sort by descending value keeps the lower index first on ties
        weights_Tk, experts_Tk = torch.sort(probs_TE, dim=-1, descending=True, stable=True)
        weights_Tk, experts_Tk = weights_Tk[:, : self.top_k], experts_Tk[:, : self.top_k]
        weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
        return RouterOutput(weights_Tk, experts_Tk, logits_TE, probs_TE)


def tokens_per_expert(experts: Tensor, n_experts: int) -> Tensor:
    """(E,) int64 counts of each expert index in ``experts`` (any shape, int64 in [0, E)).

    The value ``torch.bincount(experts.flatten(), minlength=E)`` gives, without its
    device-to-host synchronization (on CUDA, bincount reads the maximum back to size its
    output), so the layer can be captured in a CUDA graph. Integer sums: deterministic.
    """
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(probs_TE: Tensor, experts_Tk: Tensor) -> Tensor:
    """Switch-Transformer auxiliary loss E * sum_e f_e * P_e (Fedus et al. 2021, eq. 4).

    f_e: fraction of the T * k assignments routed to expert e (no gradient);
    P_e: mean router probability of expert e. Equals 1 under uniform routing.

    Returns:
        float32 scalar.
    """
    T, E = probs_TE.shape
    if T == 0:
        return probs_TE.new_zeros(())
    counts_E = tokens_per_expert(experts_Tk, E).to(probs_TE.dtype)
    f_E = counts_E / max(experts_Tk.numel(), 1)
    P_E = probs_TE.mean(dim=0)
    return E * torch.sum(f_E * P_E)


def router_z_loss(logits_TE: Tensor) -> Tensor:
    """Router z-loss mean_t logsumexp(logits_t)^2 (ST-MoE, Zoph et al. 2022, eq. 5); 0 for no tokens."""
    if logits_TE.shape[0] == 0:
        return logits_TE.new_zeros(())
    return torch.logsumexp(logits_TE, dim=-1).pow(2).mean()


class _MXRoundRows(torch.autograd.Function):
    """Forward: quantize-dequantize rows along D; backward: the identity (straight through)."""

    @staticmethod
    def forward(ctx, x_TD: Tensor, recipe: Recipe) -> Tensor:
        return fake_quantize(x_TD, recipe, dim=1, out_dtype=x_TD.dtype)

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
    layer on CUDA) each direction is one kernel (:mod:`mxmoe.kernels.moe`): forward
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
            from ..kernels.moe import triton_combine_quantize

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
    @once_differentiable
    def backward(ctx, dy_TD: Tensor):
        q, s, order_A, w_Tk = ctx.saved_tensors
        recipe, D, w_dtype, fused = ctx.meta
        T, k = w_Tk.shape
        dy_TD = dy_TD.to(w_Tk.dtype)
        if fused:  # order_A holds the inverse permutation here
            from ..kernels.moe import triton_combine_backward

            d_y_sorted, d_w = triton_combine_backward(dy_TD, w_Tk, q, s, order_A)
            return d_y_sorted, None, d_w.to(w_dtype), None
        d_y_AD = (dy_TD.unsqueeze(1) * w_Tk.unsqueeze(-1)).reshape(T * k, D)
        mx = MXTensor(q, s, recipe.fmt, recipe.block_size, 1, recipe.scale_mode, D)
        y_AD = dequantize_mx(mx, w_Tk.dtype, backend=recipe.backend)
        d_w = (dy_TD.unsqueeze(1) * y_AD.view(T, k, D)).sum(dim=-1).to(w_dtype)
        return d_y_AD.index_select(0, order_A), None, d_w, None


def _combine_triton(y_sorted_AD: Tensor, recipe: Recipe) -> bool:
    """Whether the MXFP8-saving combine runs as the fused Triton kernels
    (:func:`mxmoe.kernels.moe.triton_combine_quantize`): the recipe's backend resolves to
    Triton for y, y is bf16 (the kernels' products are rounded to bf16; see
    ``_check_bf16`` there) and D is a multiple of the block size (no padding to write)."""
    return (y_sorted_AD.dtype == torch.bfloat16 and y_sorted_AD.shape[1] % recipe.block_size == 0
            and use_triton(y_sorted_AD.device, y_sorted_AD.dtype, ElemFormat.parse(recipe.fmt), recipe.block_size,
                           recipe.backend))


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


class SwiGLUExperts(nn.Module):
    """E SwiGLU experts held as 3-D weights: w13 (E, 2F, D) = [gate; up], w2 (E, D, F).

    Args:
        n_experts: E. d_model: D. d_hidden: F. n_layers: used to scale w2's init
            (std 0.02 / sqrt(2 * n_layers), GPT-2 style residual scaling).
    """

    def __init__(self, n_experts: int, d_model: int, d_hidden: int, n_layers: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * d_hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, d_hidden))
        nn.init.normal_(self.w13, std=0.02)
        nn.init.normal_(self.w2, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, x_AD: Tensor, offsets_E: Tensor, recipe: Recipe) -> Tensor:
        """x_AD: (A, D) rows sorted by expert; offsets_E: (E,) int32. Returns (A, D)."""
        h_A2F = mx_grouped_mm(x_AD, self.w13, offsets_E, recipe)  # (A, D) x (E, 2F, D) -> (A, 2F)
        gate_AF, up_AF = h_A2F.chunk(2, dim=-1)
        act_AF = F.silu(gate_AF) * up_AF
        return mx_grouped_mm(act_AF, self.w2, offsets_E, recipe)  # (A, F) x (E, D, F) -> (A, D)


class SwiGLU(nn.Module):
    """Dense SwiGLU feed-forward (also the optional shared expert): w13 (2F, D), w2 (D, F)."""

    def __init__(self, d_model: int, d_hidden: int, n_layers: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(2 * d_hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(d_model, d_hidden))
        nn.init.normal_(self.w13, std=0.02)
        nn.init.normal_(self.w2, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, x: Tensor, recipe: Recipe) -> Tensor:
        """x (..., D) -> (..., D): w2 (silu(gate) * up) with [gate; up] = w13 x, both GEMMs
        through :func:`~mxmoe.ops.mx_linear` under ``recipe``."""
        gate, up = mx_linear(x, self.w13, recipe).chunk(2, dim=-1)
        return mx_linear(F.silu(gate) * up, self.w2, recipe)


def runs_fused(fused: bool, recipe: Recipe, x: Tensor) -> bool:
    """Whether a layer built with ``fused`` runs this forward through the fused MXFP8 expert
    op: bf16 activations only (the op's GEMMs and saved copies are bf16-based; float32 or
    float16 activations would be rounded to bf16 before their MXFP8 rounding, a second
    rounding the composed path does not make), and not on sm100, where
    :func:`~mxmoe.ops.mx_grouped_mm` runs MXFP8 natively."""
    return fused and x.dtype == torch.bfloat16 and not use_native_mx_grouped_mm(x.device, recipe)


@dataclass
class MoEAux:
    """Auxiliary outputs of one MoE layer forward.

    Attributes:
        aux_loss: float32 scalar load-balancing loss (unweighted).
        z_loss: float32 scalar router z-loss (unweighted).
        tokens_per_expert: int64 (E,), assignments each expert received (detached).
    """

    aux_loss: Tensor
    z_loss: Tensor
    tokens_per_expert: Tensor


class MoELayer(nn.Module):
    """Dropless token-choice top-k MoE feed-forward with SwiGLU experts.

    Args:
        d_model: D. n_experts: E. top_k: k. d_expert: F, hidden width of each expert.
        n_layers: model depth (init scaling). shared_expert_hidden: F_s > 0 adds a dense
            SwiGLU shared expert of that width whose output is added to every token.
        recipe: precision of the expert (and shared expert) GEMMs. The router always runs
            in float32.
        fused: under an MXFP8 recipe (D, F multiples of 32, bf16 activations: see
            :func:`runs_fused`) run the experts as the
            fused op :func:`~mxmoe.ops.moe_experts.mx_moe_experts` (gather fused with
            quantization, FP8 activations saved for the backward); False composes two
            :func:`~mxmoe.ops.mx_grouped_mm` calls and a bf16 SwiGLU.
        mx_dispatch: round the expert input rows to MXFP8 along D first (straight-through
            gradient, :func:`mx_round_rows`): the single-process equivalent of the expert-
            parallel MXFP8 dispatch. The forward GEMMs see the same values either way
            (re-quantizing MX values along the same blocks gives them back); the weight-
            gradient GEMM then blocks the rounded rows along tokens, not the original ones.

    Raises:
        ValueError: ``mx_dispatch`` with a recipe that does not quantize.

    Forward: ``x`` (..., D) in the activation dtype -> (y (..., D), :class:`MoEAux`).
    ``fused`` is what the layer was built for; ``last_ran_fused`` says whether the last
    forward ran the fused op (a float32 or float16 input runs the composed path: see
    :func:`runs_fused`). After each forward, ``last_tokens_per_expert`` holds the (E,) token
    counts. (A CUDA graph
    replay of a captured forward rewrites the tensor assigned at capture, not the
    attribute: after any later eager forward, such as an evaluation, the attribute no longer
    follows the replays; read the counts from the model output instead.)
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, d_expert: int, n_layers: int,
                 recipe: Recipe, shared_expert_hidden: int = 0, fused: bool = True,
                 mx_dispatch: bool = False):
        super().__init__()
        if mx_dispatch and not recipe.quantize:
            raise ValueError(f"mx_dispatch needs a quantizing expert recipe (mxfp8, ...), got {recipe.name!r}: "
                             f"under {recipe.name!r} the expert GEMMs read unrounded rows")
        self.n_experts, self.top_k, self.recipe = n_experts, top_k, recipe
        self.fused = fused and supports_fused_experts(d_model, d_expert, recipe)
        self.mx_dispatch = mx_dispatch
        self.router = TopKRouter(d_model, n_experts, top_k)
        self.experts = SwiGLUExperts(n_experts, d_model, d_expert, n_layers)
        self.shared = SwiGLU(d_model, shared_expert_hidden, n_layers) if shared_expert_hidden > 0 else None
        self.last_tokens_per_expert: Tensor | None = None
        self.last_ran_fused: bool | None = None  # whether the last forward ran the fused op (runs_fused)

    def forward(self, x: Tensor) -> tuple[Tensor, MoEAux]:
        """x (..., D) float32/bfloat16 -> (y of x's shape and dtype, :class:`MoEAux`): route,
        sort the T * k assignments by expert (stable), run the experts, combine with the
        router weights; plus the shared expert if any. See the class docstring."""
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        T, D = x_TD.shape
        k = self.top_k
        r = self.router(x_TD)
        # dispatch: assignments a = t * k + j, sorted by expert (stable: token order kept)
        experts_A = r.experts_Tk.reshape(-1)
        order_A = torch.argsort(experts_A, stable=True)
        counts_E = tokens_per_expert(experts_A, self.n_experts)
        offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
        x_in_TD = mx_round_rows(x_TD, self.recipe) if self.mx_dispatch else x_TD
        fused = runs_fused(self.fused, self.recipe, x_TD)
        if fused:
            # the gather happens inside the op, fused with quantization
            y_sorted_AD = mx_moe_experts(x_in_TD, order_A // k, offsets_E, self.experts.w13, self.experts.w2,
                                         self.recipe)
        else:
            x_AD = x_in_TD.unsqueeze(1).expand(T, k, D).reshape(T * k, D)
            x_sorted_AD = x_AD.index_select(0, order_A)  # gather; backward scatters a permutation
            y_sorted_AD = self.experts(x_sorted_AD, offsets_E, self.recipe)
        # combine: undo the permutation, weight each choice, sum over k (the fused MXFP8 path
        # keeps the per-choice outputs for backward as MXFP8)
        y_TD = combine_weighted(y_sorted_AD, order_A, r.weights_Tk, self.recipe if fused else None)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD, self.recipe)
        self.last_tokens_per_expert = counts_E.detach()
        self.last_ran_fused = fused  # set once the forward has run
        aux = MoEAux(
            aux_loss=load_balancing_loss(r.probs_TE, r.experts_Tk),
            z_loss=router_z_loss(r.logits_TE),
            tokens_per_expert=self.last_tokens_per_expert,
        )
        return y_TD.reshape(shape), aux
