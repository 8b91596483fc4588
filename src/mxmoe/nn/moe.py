"""The MoE feed-forward layer: router, token dispatch, SwiGLU experts, weighted combine.

Public modules: :class:`MoE` (router + experts + combine; alias ``MoELayer``) and
:class:`GroupedExperts` (the experts alone, for a model with its own router); both run
:func:`routed_experts`, so for the same routing they compute the same bits.

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

from ..ops import mx_grouped_mm, mx_linear
from ..ops.backend import use_gathered_experts, use_native_mx_grouped_mm
from ..ops.combine import combine_rows, combine_weighted, mx_round_rows
from ..ops.moe_experts import mx_moe_experts, supports_fused_experts
from ..ops.moe_experts_gathered import gathered_moe_experts
from ..ops.quantize import check_weight_dtype
from ..recipe import Recipe, get_recipe
from .args import check_flags, check_parameter_dtype, check_size
from .recipe_module import RecipeModule


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
    of the float32 copy F.linear would keep); the backward repeats F.linear's float32 math
    in differentiable torch ops, so double backward is supported."""

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
        check_size("d_model", d_model)
        check_size("n_experts", n_experts)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be an integer in [1, n_experts={n_experts}], got {top_k!r}")
        self.n_experts, self.top_k = n_experts, top_k
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x_TD: Tensor) -> RouterOutput:
        """Route T tokens: x_TD (T, D) float32/bfloat16 -> :class:`RouterOutput` (float32
        logits and probabilities (T, E), top-k weights renormalized to sum to 1 and expert
        indices (T, k); ties broken by the lower expert index, so the routing is deterministic)."""
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


def swiglu_grouped_mm(x_AD: Tensor, w13_E2FD: Tensor, w2_EDF: Tensor, offsets_E: Tensor, recipe: Recipe
                      ) -> Tensor:
    """The composed SwiGLU experts: y = (silu(gate) * up) w2_e^T with [gate; up] = x w13_e^T
    for the rows of each expert e, both GEMMs through :func:`~mxmoe.ops.mx_grouped_mm`
    under ``recipe``, the SwiGLU in the activation dtype.

    Args:
        x_AD: (A, D) float32/bfloat16/float16 rows sorted by expert.
        w13_E2FD: (E, 2F, D) [gate; up] weights. w2_EDF: (E, D, F).
        offsets_E: (E,) int32 cumulative end row of each expert.
        recipe: precision of both grouped GEMMs.

    Returns:
        (A, D) in x's dtype.
    """
    h_A2F = mx_grouped_mm(x_AD, w13_E2FD, offsets_E, recipe)  # (A, D) x (E, 2F, D) -> (A, 2F)
    gate_AF, up_AF = h_A2F.chunk(2, dim=-1)
    act_AF = F.silu(gate_AF) * up_AF
    return mx_grouped_mm(act_AF, w2_EDF, offsets_E, recipe)  # (A, F) x (E, D, F) -> (A, D)


def init_expert_weights_(w13: Tensor, w2: Tensor, n_layers: int) -> None:
    """In place: w13 ~ N(0, 0.02^2); w2 ~ N(0, (0.02 / sqrt(2 * n_layers))^2), the GPT-2
    residual-branch scaling (Radford et al. 2019, section 2.3). Draws w13 first, then w2."""
    nn.init.normal_(w13, std=0.02)
    nn.init.normal_(w2, std=0.02 / math.sqrt(2 * n_layers))


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
        init_expert_weights_(self.w13, self.w2, n_layers)

    def forward(self, x_AD: Tensor, offsets_E: Tensor, recipe: Recipe) -> Tensor:
        """x_AD: (A, D) rows sorted by expert; offsets_E: (E,) int32. Returns (A, D)
        (:func:`swiglu_grouped_mm`)."""
        return swiglu_grouped_mm(x_AD, self.w13, self.w2, offsets_E, recipe)


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


def _check_mx_dispatch(mx_dispatch: bool, recipe: Recipe) -> None:
    if mx_dispatch and not recipe.quantize:
        raise ValueError(f"mx_dispatch needs a quantizing expert recipe (mxfp8, ...), got {recipe.name!r}: "
                         f"under {recipe.name!r} the expert GEMMs read unrounded rows")


def check_activations(x: Tensor, d_model: int, who: str) -> None:
    """TypeError / ValueError unless x is a float32/bfloat16/float16 tensor (..., d_model)
    (the input check of :class:`MoE`, :class:`GroupedExperts` and the expert-parallel layer).

    Raises:
        TypeError: not a tensor, or another dtype. ValueError: 0-d, or last dim not d_model.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{who} takes a tensor of activations, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{who} takes float32, bfloat16 or float16 activations, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != d_model:
        raise ValueError(f"{who} takes activations of shape (..., D={d_model}), got {tuple(x.shape)}")


def routed_experts(x_TD: Tensor, experts_Tk: Tensor, weights_Tk: Tensor, w13_E2FD: Tensor, w2_EDF: Tensor,
                   recipe: Recipe, fused: bool, mx_dispatch: bool = False) -> tuple[Tensor, Tensor, str]:
    """Dispatch, SwiGLU experts and combine for a given routing: the expert path of
    :class:`MoE` and :class:`GroupedExperts` (one code path, so both compute the same bits).

    Sorts the T * k assignments a = t * k + j by expert (stable: token order kept within
    an expert), runs the experts on the sorted rows (the fused op
    :func:`~mxmoe.ops.moe_experts.mx_moe_experts` where :func:`runs_fused` holds, else
    :func:`swiglu_grouped_mm` on the gathered rows), undoes the sort and sums each token's
    k outputs weighted by ``weights_Tk`` (:func:`~mxmoe.ops.combine.combine_weighted`; on
    the fused path :func:`~mxmoe.ops.combine.combine_rows`, which keeps nothing of the
    outputs: the fused op returns the weights' gradient). Where
    :func:`~mxmoe.ops.backend.use_gathered_experts` holds (the bf16 recipe on QuACK, opt-in)
    experts and combine are one op instead
    (:func:`~mxmoe.ops.moe_experts_gathered.gathered_moe_experts`).

    Args:
        x_TD: (T, D) float32/bfloat16/float16 activations.
        experts_Tk: (T, k) int64 expert index of each choice, in [0, E).
        weights_Tk: (T, k) float combine weights (float32 from :class:`TopKRouter`).
        w13_E2FD: (E, 2F, D) [gate; up] weights. w2_EDF: (E, D, F).
        recipe: precision of the expert GEMMs. fused: whether the caller was built for the
            fused op (:func:`runs_fused` then also looks at the activations).
        mx_dispatch: round the expert input rows to MXFP8 along D first, straight-through
            gradient (:func:`~mxmoe.ops.combine.mx_round_rows`).

    Returns:
        (y_TD (T, D) in x's dtype, tokens per expert (E,) int64, the path that ran:
        "fused", "gathered" or "composed").
    """
    T, D = x_TD.shape
    k = experts_Tk.shape[1]
    # dispatch: assignments a = t * k + j, sorted by expert (stable: token order kept)
    experts_A = experts_Tk.reshape(-1)
    order_A = torch.argsort(experts_A, stable=True)
    counts_E = tokens_per_expert(experts_A, w13_E2FD.shape[0])
    offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
    if not mx_dispatch and use_gathered_experts(x_TD, recipe, D, w2_EDF.shape[2]):
        return gathered_moe_experts(x_TD, weights_Tk, w13_E2FD, w2_EDF, order_A, offsets_E, recipe), counts_E, "gathered"
    x_in_TD = mx_round_rows(x_TD, recipe) if mx_dispatch else x_TD
    ran_fused = runs_fused(fused, recipe, x_TD)
    if ran_fused:
        # the gather happens inside the op, fused with quantization; the op also gives the
        # combine weights' gradient, so the combine keeps nothing of the outputs
        weights_A = weights_Tk.reshape(-1).index_select(0, order_A)
        y_sorted_AD = mx_moe_experts(x_in_TD, order_A // k, offsets_E, w13_E2FD, w2_EDF, recipe, weights_A=weights_A)
        return combine_rows(y_sorted_AD, order_A, weights_Tk, recipe), counts_E, "fused"
    x_AD = x_in_TD.unsqueeze(1).expand(T, k, D).reshape(T * k, D)
    x_sorted_AD = x_AD.index_select(0, order_A)  # gather; backward scatters a permutation
    y_sorted_AD = swiglu_grouped_mm(x_sorted_AD, w13_E2FD, w2_EDF, offsets_E, recipe)
    # combine: undo the permutation, weight each choice, sum over k
    return combine_weighted(y_sorted_AD, order_A, weights_Tk), counts_E, "composed"


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


class MoE(RecipeModule, nn.Module):
    """Dropless token-choice top-k MoE feed-forward with SwiGLU experts: router, dispatch,
    experts and weighted combine in one module, for any PyTorch model.

    Args:
        d_model: D, the width of the activations it takes and returns.
        n_experts: E. top_k: k (1 <= k <= E).
        d_expert: F, the hidden width of each expert.
        n_layers: the depth of the model it sits in; it only scales the init of the expert
            down projection w2 (std 0.02 / sqrt(2 * n_layers), GPT-2 residual scaling).
            Default 1 (std 0.02 / sqrt(2)); pass the model depth to match
            :class:`~mxmoe.models.MoETransformer`, or re-initialize the weights yourself.
        recipe: precision of the expert (and shared expert) GEMMs: a
            :class:`~mxmoe.recipe.Recipe` or its name ("bf16", "mxfp8", "mxfp8-floor",
            "mxfp8-bf16-wgrad"). The router always runs in float32. Switch it later with
            :meth:`set_recipe` (what :func:`~mxmoe.nn.convert_to_mxfp8` does).
        shared_expert_hidden: F_s > 0 adds a dense SwiGLU shared expert of that width whose
            output is added to every token.
        fused: under an MXFP8 recipe (D, F multiples of 32, bf16 activations: see
            :func:`runs_fused`) run the experts as the fused op
            :func:`~mxmoe.ops.moe_experts.mx_moe_experts` (gather fused with quantization,
            FP8 activations saved for the backward); False composes two
            :func:`~mxmoe.ops.mx_grouped_mm` calls and a SwiGLU in the activation dtype.
        mx_dispatch: round the expert input rows to MXFP8 along D first (straight-through
            gradient, :func:`mx_round_rows`): the single-process equivalent of the expert-
            parallel MXFP8 dispatch. The forward GEMMs see the same values either way
            (re-quantizing MX values along the same blocks gives them back); the weight-
            gradient GEMM then blocks the rounded rows along tokens, not the original ones.

    Raises:
        ValueError: a size that is not an integer in [1, 2**31 - 1] (``shared_expert_hidden``
            [0, 2**31 - 1]), top_k outside [1, E], unknown recipe, ``mx_dispatch`` with a
            recipe that does not quantize.

    Parameters (state_dict keys): ``router.weight`` (E, D), ``experts.w13`` (E, 2F, D),
    ``experts.w2`` (E, D, F), and with a shared expert ``shared.w13`` (2F_s, D),
    ``shared.w2`` (D, F_s). All float32 at construction (master weights; the GEMMs run in
    the activations' dtype).

    Forward: ``x`` (..., D) float32/bfloat16/float16 -> (y of x's shape and dtype,
    :class:`MoEAux`). Add the auxiliary losses to the training loss yourself, e.g.
    ``loss = ce + 0.01 * aux.aux_loss + 1e-3 * aux.z_loss`` (the coefficients of
    :class:`~mxmoe.models.ModelConfig`). ``fused`` says whether the layer is built for the
    fused op under its current recipe; ``last_ran_fused`` whether the last forward ran it,
    ``last_expert_path`` which path ran ("fused", "gathered" or "composed": :func:`routed_experts`)
    (a float32 or float16 input runs the composed path: see :func:`runs_fused`; in
    float16, GEMM outputs beyond 65504 overflow as in any float16 model, and a gate that
    overflows to -inf makes the SwiGLU NaN: docs/ARCHITECTURE.md). After
    each forward, ``last_tokens_per_expert`` holds the (E,) token counts. (A CUDA graph
    replay of a captured forward rewrites the tensor assigned at capture, not the
    attribute: after any later eager forward, such as an evaluation, the attribute no longer
    follows the replays; read the counts from the model output instead.)

    ``MoELayer`` is an alias of this class (the name :mod:`mxmoe.models` and
    :mod:`mxmoe.distributed` use).
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int, d_expert: int, n_layers: int = 1,
                 recipe: Recipe | str = "mxfp8", shared_expert_hidden: int = 0, fused: bool = True,
                 mx_dispatch: bool = False):
        super().__init__()
        for name, value in (("d_model", d_model), ("n_experts", n_experts), ("d_expert", d_expert),
                            ("n_layers", n_layers)):
            check_size(name, value)
        check_size("shared_expert_hidden", shared_expert_hidden, minimum=0)
        check_flags(fused=fused, mx_dispatch=mx_dispatch)
        recipe = get_recipe(recipe)
        _check_mx_dispatch(mx_dispatch, recipe)
        self.d_model, self.d_expert = d_model, d_expert
        self.n_experts, self.top_k = n_experts, top_k
        self._recipe = recipe
        self.prefer_fused = fused  # what the caller asked for; ``fused`` adds the recipe and shapes
        self.mx_dispatch = mx_dispatch
        self.router = TopKRouter(d_model, n_experts, top_k)
        self.experts = SwiGLUExperts(n_experts, d_model, d_expert, n_layers)
        self.shared = SwiGLU(d_model, shared_expert_hidden, n_layers) if shared_expert_hidden > 0 else None
        self.last_tokens_per_expert: Tensor | None = None
        self.last_ran_fused: bool | None = None  # whether the last forward ran the fused op (runs_fused)
        self.last_expert_path: str | None = None  # "fused", "gathered" or "composed" (routed_experts)

    def _check_recipe(self, recipe: Recipe) -> None:
        """A recipe that does not quantize is refused while ``mx_dispatch`` is on."""
        _check_mx_dispatch(self.mx_dispatch, recipe)

    @property
    def fused(self) -> bool:
        """Whether the layer runs the fused MXFP8 expert op for bf16 activations: built with
        ``fused=True`` and :func:`~mxmoe.ops.moe_experts.supports_fused_experts` holds for
        (D, F, recipe). Assigning sets the constructor's ``fused`` choice."""
        return self.prefer_fused and supports_fused_experts(self.d_model, self.d_expert, self._recipe)

    @fused.setter
    def fused(self, value: bool) -> None:
        check_flags(fused=value)
        self.prefer_fused = value

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_experts={self.n_experts}, top_k={self.top_k}, "
                f"d_expert={self.d_expert}, recipe={self._recipe.name}, fused={self.fused}"
                + (", mx_dispatch=True" if self.mx_dispatch else ""))

    def forward(self, x: Tensor) -> tuple[Tensor, MoEAux]:
        """x (..., D) float32/bfloat16/float16 -> (y of x's shape and dtype, :class:`MoEAux`):
        route, sort the T * k assignments by expert (stable), run the experts, combine with
        the router weights (:func:`routed_experts`); plus the shared expert if any. See the
        class docstring.

        Raises:
            TypeError: x not a float32/bfloat16/float16 tensor. ValueError: x.shape[-1] != D.
        """
        check_activations(x, self.d_model, type(self).__name__)
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        r = self.router(x_TD)
        check_weight_dtype(self.experts.w13, "experts.w13", "MoE", self._recipe)
        check_weight_dtype(self.experts.w2, "experts.w2", "MoE", self._recipe)
        y_TD, counts_E, path = routed_experts(x_TD, r.experts_Tk, r.weights_Tk, self.experts.w13, self.experts.w2,
                                              self._recipe, self.fused, self.mx_dispatch)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD, self._recipe)
        self.last_tokens_per_expert = counts_E.detach()
        self.last_ran_fused = path == "fused"  # set once the forward has run
        self.last_expert_path = path
        aux = MoEAux(
            aux_loss=load_balancing_loss(r.probs_TE, r.experts_Tk),
            z_loss=router_z_loss(r.logits_TE),
            tokens_per_expert=self.last_tokens_per_expert,
        )
        return y_TD.reshape(shape), aux


MoELayer = MoE
"""Alias of :class:`MoE` (the same class), the name :mod:`mxmoe.models` and
:mod:`mxmoe.distributed` use."""


class GroupedExperts(RecipeModule, nn.Module):
    """E SwiGLU experts alone, for a model that keeps its own router: takes each token's
    top-k expert indices and combine weights, returns the weighted sum of its experts'
    outputs.

    y[t] = sum_j weights[t, j] * w2_e (silu(gate) * up), [gate; up] = w13_e x[t],
    e = experts[t, j]; the GEMMs under ``recipe``. The computation is :class:`MoE`'s expert
    path (:func:`routed_experts`): assignments sorted by expert (stable), the fused MXFP8
    op :func:`~mxmoe.ops.moe_experts.mx_moe_experts` where :class:`MoE` would run it
    (``fused``, an MXFP8 recipe, D and F multiples of 32, bf16 activations:
    :func:`runs_fused`), otherwise two :func:`~mxmoe.ops.mx_grouped_mm` calls and a SwiGLU
    in the activation dtype; then the un-sort and the weighted sum over k in a fixed order
    (deterministic). Dropless: every assignment is computed, no capacity factor.

    Args:
        n_experts: E. d_model: D. d_expert: F, the hidden width of each expert.
        recipe: precision of the expert GEMMs, a :class:`~mxmoe.recipe.Recipe` or its name.
        fused: allow the fused MXFP8 op (as :class:`MoE`).
        n_layers: scales the init of w2 (std 0.02 / sqrt(2 * n_layers)); w13 has std 0.02.
        device, dtype: of the weights (default: torch's defaults, float32 master weights).

    Parameters (state_dict keys): ``w13`` (E, 2F, D) = [gate; up] stacked along the
    output dimension, ``w2`` (E, D, F); the layout of :class:`SwiGLUExperts` and of
    ``MoE.experts``. From per-expert ``nn.Linear`` weights (out, in):
    ``w13[e] = cat([gate_e.weight, up_e.weight])``, ``w2[e] = down_e.weight``.

    Raises:
        ValueError: a size that is not an integer in [1, 2**31 - 1], unknown recipe.
        TypeError: a ``dtype`` that is not floating point, or not float32/bfloat16/float16
            under a quantizing recipe.
    """

    def __init__(self, n_experts: int, d_model: int, d_expert: int, *, recipe: Recipe | str = "mxfp8",
                 fused: bool = True, n_layers: int = 1, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        for name, value in (("n_experts", n_experts), ("d_model", d_model), ("d_expert", d_expert),
                            ("n_layers", n_layers)):
            check_size(name, value)
        check_flags(fused=fused)
        self.n_experts, self.d_model, self.d_expert = n_experts, d_model, d_expert
        self._recipe = get_recipe(recipe)
        check_parameter_dtype(dtype, self._recipe, "GroupedExperts")
        self.prefer_fused = fused
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * d_expert, d_model, device=device, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, d_expert, device=device, dtype=dtype))
        init_expert_weights_(self.w13, self.w2, n_layers)
        self.last_tokens_per_expert: Tensor | None = None
        self.last_ran_fused: bool | None = None
        self.last_expert_path: str | None = None

    @property
    def fused(self) -> bool:
        """Whether bf16 activations run the fused MXFP8 op (as :attr:`MoE.fused`)."""
        return self.prefer_fused and supports_fused_experts(self.d_model, self.d_expert, self._recipe)

    @fused.setter
    def fused(self, value: bool) -> None:
        check_flags(fused=value)
        self.prefer_fused = value

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, d_model={self.d_model}, d_expert={self.d_expert}, "
                f"recipe={self._recipe.name}, fused={self.fused}")

    def forward(self, x_TD: Tensor, experts_Tk: Tensor, weights_Tk: Tensor) -> Tensor:
        """Run each token through its k experts and combine.

        Args:
            x_TD: (T, D) float32/bfloat16/float16 activations (flatten batch and sequence
                first).
            experts_Tk: (T, k) int64 expert index of each choice, in [0, E). A token may
                name one expert twice (both choices are computed).
            weights_Tk: (T, k) floating combine weights (not renormalized here; gradients
                flow to them, so a router upstream learns through the combine). On the
                fused MXFP8 path the gradient of a weight that is 0 (or below about
                1e-36) is 0 (:func:`~mxmoe.ops.moe_experts.mx_moe_experts`, ``weights_A``):
                use ``fused=False`` where such a weight's gradient matters (a learned
                gate that starts at 0).

        Returns:
            (T, D) in x's dtype. ``last_tokens_per_expert`` then holds the (E,) int64 counts
            and ``last_ran_fused`` whether the fused op ran (``last_expert_path``: which
            path, :func:`routed_experts`).

        Raises:
            TypeError: x not float32/bfloat16/float16, experts_Tk not int64, weights_Tk not
                floating point.
            ValueError: shapes other than the above, tensors on different devices; on the
                CPU an expert index outside [0, E) (on CUDA it is not checked, which would
                cost a host sync: an out-of-range index fails in a device-side assert).
        """
        check_activations(x_TD, self.d_model, "GroupedExperts")
        if x_TD.dim() != 2:
            raise ValueError(f"GroupedExperts takes x of shape (T, D={self.d_model}), got {tuple(x_TD.shape)}: "
                             f"flatten the leading dimensions with x.reshape(-1, {self.d_model})")
        if not isinstance(experts_Tk, Tensor) or experts_Tk.dtype != torch.int64:
            raise TypeError(f"experts_Tk must be an int64 tensor of expert indices, got "
                            f"{getattr(experts_Tk, 'dtype', type(experts_Tk).__name__)}")
        if not isinstance(weights_Tk, Tensor) or not weights_Tk.is_floating_point():
            raise TypeError(f"weights_Tk must be a floating-point tensor of combine weights, got "
                            f"{getattr(weights_Tk, 'dtype', type(weights_Tk).__name__)}")
        T = x_TD.shape[0]
        if experts_Tk.dim() != 2 or experts_Tk.shape[0] != T or experts_Tk.shape[1] < 1:
            raise ValueError(f"experts_Tk must have shape (T={T}, k) with k >= 1, got {tuple(experts_Tk.shape)}")
        if weights_Tk.shape != experts_Tk.shape:
            raise ValueError(f"weights_Tk must have the shape of experts_Tk {tuple(experts_Tk.shape)}, "
                             f"got {tuple(weights_Tk.shape)}")
        if not (x_TD.device == experts_Tk.device == weights_Tk.device == self.w13.device):
            raise ValueError(f"x_TD, experts_Tk, weights_Tk and the weights must be on one device, got "
                             f"{x_TD.device}, {experts_Tk.device}, {weights_Tk.device}, {self.w13.device}")
        if experts_Tk.device.type == "cpu" and experts_Tk.numel():
            lo, hi = int(experts_Tk.min()), int(experts_Tk.max())
            if lo < 0 or hi >= self.n_experts:
                raise ValueError(f"expert indices must be in [0, {self.n_experts}), got values in [{lo}, {hi}]")
        check_weight_dtype(self.w13, "GroupedExperts.w13", "GroupedExperts", self._recipe)
        check_weight_dtype(self.w2, "GroupedExperts.w2", "GroupedExperts", self._recipe)
        y_TD, counts_E, path = routed_experts(x_TD, experts_Tk, weights_Tk, self.w13, self.w2, self._recipe,
                                              self.fused)
        self.last_tokens_per_expert = counts_E.detach()
        self.last_ran_fused = path == "fused"
        self.last_expert_path = path
        return y_TD
