"""Expert parallelism: the MoE layer with its experts spread over the ranks of a group.

Legend of shape suffixes: T this rank's tokens, D model width, E experts (all ranks),
P ranks in the expert-parallel group, L = E / P experts held by this rank, k top-k,
A = T * k this rank's routed assignments, R rows this rank's experts receive, B bytes per
row of the MXFP8 wire format.

One forward of :class:`ExpertParallelMoELayer` on every rank of the group:

    x_TD --router (replicated, float32)--> top-k experts, weights
         --sort assignments by expert--> x_AD rows, grouped by destination rank (expert e
           lives on rank e // L)
    1. counts: all_gather of every rank's (E,) assignment counts -> (P, E) on the host
       (the one host sync of the layer: all-to-all split sizes must be host ints); it
       also gives the global counts the load-balancing loss needs
    2. dispatch: all_to_all of the rows (bf16, or MXFP8 codes + scales, below)
         -> x_RD in source-major order [src 0: expert l0, l1, ..; src 1: l0, l1, ..]
         -> re-sorted expert-major [l0: src 0, src 1, ..; l1: ..]: expert l's rows in global
            token order (rank r holds global tokens r*T..(r+1)*T-1), exactly the rows and
            order the single-process layer gives that expert
    3. local SwiGLU experts: mx_grouped_mm over the L local experts (the recipe acts here)
    4. combine: back to source-major, the reverse all_to_all, unpermute, weight, sum over k

Backward runs through both exchanges (:class:`~mxmoe.distributed.collectives.AllToAllRows`:
the backward of an all-to-all is the reverse all-to-all). Every step is a permutation or a
per-row operation, so the layer is deterministic, and each expert's forward, dgrad and
wgrad GEMMs see the same rows in the same order as in one process: expert weight
gradients equal the single-process ones bit for bit when the upstream gradients do.

Losses (shares): every rank returns its share of the load-balancing and z losses, with
the global token count and the global per-expert fractions f_e, so that the shares of
the P ranks sum to the single-process value over the whole batch and each share's
gradient is exactly the single-process gradient for this rank's tokens. With the
cross-entropy share ``sum over own tokens / global tokens`` (:func:`loss_share`), the
per-rank gradients of replicated parameters sum (all-reduce, :mod:`.sync`) to the
single-process gradient, and expert gradients, which already gather the contributions of
every rank through the backward all-to-all, need no reduction at all.

MXFP8 dispatch (``mx_dispatch=True``): the sending rank quantizes each row along D with
the expert recipe's format, scale rule and block size (:func:`mxmoe.quantize_mx`) and
sends E4M3 codes + E8M0 scale bytes, D_pad + D_pad / 32 bytes per row instead of 2 D
for bf16 (0.516x); the receiver dequantizes to the activation dtype. The expert forward
GEMM quantizes these rows along D again, with the same blocks, and gets the same values
back (no second rounding: tested for rceil and floor, including the special cases), so
the forward equals the plain single-process MXFP8 forward. The weight-gradient GEMM
blocks x along tokens; the receiver only has the rounded rows, so it quantizes those.
The exact single-process equivalent is therefore ``MoELayer(mx_dispatch=True)``, which
rounds the expert input rows the same way (straight-through gradient); the gradients go
back in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..nn.moe import MoEAux, MoELayer, SwiGLUExperts, combine_weighted, runs_fused
from ..ops.moe_experts import mx_moe_experts
from ..numerics.formats import ElemFormat
from ..numerics.mx_tensor import MXTensor
from ..ops.quantize import dequantize_mx, quantize_mx
from ..recipe import Recipe
from .collectives import AllToAllRows, CommStats, all_to_all_rows

# element formats the MXFP8 wire format carries: one byte per element, viewable as uint8
WIRE_FORMATS = (ElemFormat.E4M3, ElemFormat.E5M2)


def mx_row_bytes(d_model: int, block_size: int) -> int:
    """Bytes per row of the MXFP8 wire format: D padded to the block size (one byte per
    element code) plus one E8M0 byte per block."""
    d_pad = -(-d_model // block_size) * block_size
    return d_pad + d_pad // block_size


def pack_mx_rows(x_TD: Tensor, recipe: Recipe) -> Tensor:
    """Quantize rows along D to the recipe's MX format and pack codes and scales per row.

    Args:
        x_TD: (T, D) float32/bfloat16/float16 (not differentiated).
        recipe: a quantizing recipe with an FP8 element format (:data:`WIRE_FORMATS`).

    Returns:
        (T, B) uint8, B = :func:`mx_row_bytes`: per row the D_pad element codes (D zero
        padded to the block size), then the D_pad / block_size E8M0 scale bytes.

    Raises:
        ValueError: the recipe does not quantize, or its format is not FP8.
    """
    _check_wire_recipe(recipe)
    mx = quantize_mx(x_TD.detach(), recipe.fmt, block_size=recipe.block_size, dim=1,
                     scale_mode=recipe.scale_mode, pad=True, backend=recipe.backend)
    return torch.cat([mx.qdata.view(torch.uint8), mx.scale.view(torch.uint8)], dim=1)


def unpack_mx_rows(buf_TB: Tensor, d_model: int, recipe: Recipe, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`pack_mx_rows`: dequantize packed rows to ``dtype``.

    Args:
        buf_TB: (T, B) uint8 from :func:`pack_mx_rows` (possibly after an all-to-all).
        d_model: D. recipe: the recipe that packed them. dtype: output dtype.

    Returns:
        (T, D) in ``dtype``: ``dequantize_mx`` of the codes and scales, bit-equal to
        ``fake_quantize_mx`` of the original rows (the single-process rounding).
    """
    _check_wire_recipe(recipe)
    bs = recipe.block_size
    d_pad = -(-d_model // bs) * bs
    if buf_TB.shape[1] != d_pad + d_pad // bs:
        raise ValueError(f"packed rows have {buf_TB.shape[1]} bytes, expected {d_pad + d_pad // bs} for D={d_model}")
    codes = buf_TB[:, :d_pad].contiguous().view(recipe.fmt.spec.torch_dtype)
    scales = buf_TB[:, d_pad:].contiguous().view(torch.float8_e8m0fnu)
    mx = MXTensor(codes, scales, recipe.fmt, bs, 1, recipe.scale_mode, d_model)
    return dequantize_mx(mx, dtype, backend=recipe.backend)


def _check_wire_recipe(recipe: Recipe) -> None:
    if not recipe.quantize or recipe.fmt not in WIRE_FORMATS:
        raise ValueError(f"MXFP8 dispatch needs a quantizing recipe with FP8 elements ({[f.value for f in WIRE_FORMATS]}), "
                         f"got {recipe.name!r} (quantize={recipe.quantize}, fmt={recipe.fmt.value})")


class _MXDispatch(torch.autograd.Function):
    """Forward: all-to-all of packed MXFP8 rows, dequantized on arrival. Backward: the
    reverse all-to-all of the gradient rows in the activation dtype (straight through the
    rounding, as :func:`mxmoe.nn.moe.mx_round_rows`), an :class:`AllToAllRows`: differentiable
    again (double backward is supported)."""

    @staticmethod
    def forward(ctx, x_AD: Tensor, packed_AB: Tensor, d_model: int, recipe: Recipe, recv_splits, send_splits,
                group, stats):
        ctx.recv_splits, ctx.send_splits, ctx.group, ctx.stats = recv_splits, send_splits, group, stats
        recv_RB = all_to_all_rows(packed_AB, recv_splits, send_splits, group, stats, "dispatch")
        return unpack_mx_rows(recv_RB, d_model, recipe, x_AD.dtype)

    @staticmethod
    def backward(ctx, dx_RD: Tensor):
        dx_AD = AllToAllRows.apply(dx_RD, ctx.send_splits, ctx.recv_splits, ctx.group, ctx.stats, "dispatch.grad")
        return dx_AD, None, None, None, None, None, None, None


def expert_major_order(recv_counts_PL: Tensor) -> Tensor:
    """Permutation from source-major to expert-major row order.

    Args:
        recv_counts_PL: (P, L) int64 CPU tensor: rows received from source rank s for local
            expert l. Received rows are source-major: [s=0: l=0, 1, ..; s=1: l=0, ..].

    Returns:
        (R,) int64 CPU: ``perm`` with ``received[perm]`` expert-major
        [l=0: s=0, s=1, ..; l=1: ..], each (s, l) block in its received order.
    """
    P, L = recv_counts_PL.shape
    flat = recv_counts_PL.reshape(-1)
    R = int(flat.sum())
    starts_LP = (torch.cumsum(flat, 0) - flat).view(P, L).t().reshape(-1)  # where block (s, l) starts, expert-major
    sizes_LP = recv_counts_PL.t().reshape(-1)
    block_R = torch.repeat_interleave(torch.arange(P * L), sizes_LP, output_size=R)
    first_R = (torch.cumsum(sizes_LP, 0) - sizes_LP)[block_R]  # first output row of each row's block
    return starts_LP[block_R] + (torch.arange(R) - first_R)


class ExpertParallelMoELayer(nn.Module):
    """A :class:`~mxmoe.nn.moe.MoELayer` whose experts are split over the ranks of ``group``.

    Built from a full ``MoELayer`` (constructed identically on every rank, for example under
    the same seed): the router and the shared expert are kept whole (replicated: their
    gradients must be summed over the ranks, :func:`mxmoe.distributed.sync.all_reduce_grads`),
    the experts are cut to this rank's L = E / P consecutive ones, rank r holding experts
    r*L .. r*L + L - 1. Parameter names are those of ``MoELayer`` (``router.weight``,
    ``experts.w13`` (L, 2F, D), ``experts.w2`` (L, D, F), ``shared.*``).

    Args:
        layer: the full layer (its router and shared expert modules are reused, its expert
            weights sliced and copied).
        group: the expert-parallel process group (None: the default group). Every rank of
            it must call forward (and backward) the same number of times.
        mx_dispatch: send the dispatched rows as MXFP8 (default: ``layer.mx_dispatch``).
        comm_stats: optional :class:`~mxmoe.distributed.collectives.CommStats` recording
            every collective of this layer (bytes, time).
        batch_group: where the global batch spans several expert-parallel groups (the
            data-parallel shard dimension of :mod:`mxmoe.distributed.mesh`), the group of
            this rank's peers in the other groups: the global counts are summed over it
            (one all-reduce of E ints), so the loss shares use the whole batch's counts.
            None: the global batch is this group's.

    Forward: ``x`` (..., D) -> (y (..., D), :class:`~mxmoe.nn.moe.MoEAux`) like ``MoELayer``,
    except that ``aux_loss`` and ``z_loss`` are this rank's shares (their sum over the
    ranks is the single-process value for the whole batch, see the module docstring) and
    ``tokens_per_expert`` counts the whole batch's assignments (E,) over all ranks.

    Raises:
        ValueError: E not divisible by the group size; ``mx_dispatch`` with a recipe that
            does not quantize to an FP8 format.
    """

    def __init__(self, layer: MoELayer, group=None, mx_dispatch: bool | None = None,
                 comm_stats: CommStats | None = None, batch_group=None):
        super().__init__()
        self.batch_group = batch_group
        P, rank = dist.get_world_size(group), dist.get_rank(group)
        E = layer.n_experts
        if E % P:
            raise ValueError(f"{E} experts cannot be split evenly over {P} expert-parallel ranks; "
                             f"use a number of experts divisible by {P} (or --expert-parallel dividing {E})")
        self.mx_dispatch = layer.mx_dispatch if mx_dispatch is None else mx_dispatch
        if self.mx_dispatch:
            _check_wire_recipe(layer.recipe)
        self.group, self.world_size, self.rank = group, P, rank
        self.n_experts, self.n_local, self.top_k, self.recipe = E, E // P, layer.top_k, layer.recipe
        self.router, self.shared = layer.router, layer.shared
        self.fused = layer.fused
        w13, w2 = layer.experts.w13, layer.experts.w2
        lo, hi = rank * self.n_local, (rank + 1) * self.n_local
        with torch.random.fork_rng(devices=[]):  # its random init is overwritten: leave the RNG as it was
            self.experts = SwiGLUExperts(self.n_local, w13.shape[2], w2.shape[2], 1)
        self.experts.w13 = nn.Parameter(w13.detach()[lo:hi].clone())
        self.experts.w2 = nn.Parameter(w2.detach()[lo:hi].clone())
        self.comm_stats = comm_stats
        self.last_tokens_per_expert: Tensor | None = None
        self.last_ran_fused: bool | None = None  # whether the last forward ran the fused op (runs_fused)

    @property
    def expert_range(self) -> tuple[int, int]:
        """Global indices [first, last + 1) of the experts on this rank."""
        return self.rank * self.n_local, (self.rank + 1) * self.n_local

    def _exchange_counts(self, counts_E: Tensor) -> Tensor:
        """all_gather of the (E,) counts -> (P, E) int64 on the CPU (host sync)."""
        gathered = [torch.empty_like(counts_E) for _ in range(self.world_size)]
        if self.comm_stats is None:
            dist.all_gather(gathered, counts_E, group=self.group)
        else:
            nbytes = counts_E.numel() * counts_E.element_size()
            with self.comm_stats.record("counts", nbytes * (self.world_size - 1), nbytes, counts_E.device):
                dist.all_gather(gathered, counts_E, group=self.group)
        return torch.stack(gathered).cpu()

    def forward(self, x: Tensor) -> tuple[Tensor, MoEAux]:
        """This rank's tokens x (..., D) -> (y like x, :class:`~mxmoe.nn.moe.MoEAux`): route
        locally, all-to-all the rows to the ranks that own their experts (MXFP8 codes +
        scales with ``mx_dispatch``), run the local experts, all-to-all back, combine. Every
        rank must call it (collectives); the module docstring has the data flow."""
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        T, D = x_TD.shape
        k, E, L, P, device = self.top_k, self.n_experts, self.n_local, self.world_size, x.device
        r = self.router(x_TD)
        experts_A = r.experts_Tk.reshape(-1)
        order_A = torch.argsort(experts_A, stable=True)
        counts_E = torch.bincount(experts_A, minlength=E)
        # 1. counts of every rank -> split sizes (host ints) and global counts
        counts_PE = self._exchange_counts(counts_E)
        lo, hi = self.expert_range
        send_splits = counts_PE[self.rank].view(P, L).sum(dim=1).tolist()  # rows to each rank
        recv_counts_PL = counts_PE[:, lo:hi]  # rows from each rank, per local expert
        recv_splits = recv_counts_PL.sum(dim=1).tolist()
        counts_global_E = counts_PE.sum(dim=0)
        if self.batch_group is not None:  # the global batch spans several expert-parallel groups
            counts_global_E = counts_global_E.to(device)
            dist.all_reduce(counts_global_E, group=self.batch_group)
        tokens_global = int(counts_global_E.sum()) // k
        # 2. dispatch (rows sorted by expert = grouped by destination rank, rank order)
        x_AD = x_TD.unsqueeze(1).expand(T, k, D).reshape(T * k, D)
        x_sorted_AD = x_AD.index_select(0, order_A)
        if self.mx_dispatch:  # quantize the T token rows once, then route their bytes
            packed_AB = pack_mx_rows(x_TD, self.recipe).index_select(0, order_A // k)
            x_RD = _MXDispatch.apply(x_sorted_AD, packed_AB, D, self.recipe, recv_splits, send_splits, self.group,
                                     self.comm_stats)
        else:
            x_RD = AllToAllRows.apply(x_sorted_AD, recv_splits, send_splits, self.group, self.comm_stats, "dispatch")
        perm_R = expert_major_order(recv_counts_PL).to(device, non_blocking=True)
        offsets_L = torch.cumsum(recv_counts_PL.sum(dim=0), 0).to(device=device, dtype=torch.int32)
        # 3. local experts, rows in (local expert, global token) order (the same rows in the
        # same order as the single-process layer's experts see)
        fused = runs_fused(self.fused, self.recipe, x_RD)
        if fused:
            y_local_RD = mx_moe_experts(x_RD, perm_R, offsets_L, self.experts.w13, self.experts.w2, self.recipe)
        else:
            y_local_RD = self.experts(x_RD.index_select(0, perm_R), offsets_L, self.recipe)
        # 4. combine: back to source-major, reverse exchange, unpermute, weight, sum over k
        y_RD = torch.zeros_like(y_local_RD).index_copy(0, perm_R, y_local_RD)
        y_sorted_AD = AllToAllRows.apply(y_RD, send_splits, recv_splits, self.group, self.comm_stats, "combine")
        y_TD = combine_weighted(y_sorted_AD, order_A, r.weights_Tk, self.recipe if fused else None)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD, self.recipe)
        self.last_tokens_per_expert = counts_global_E.to(device)
        self.last_ran_fused = fused  # set once the forward has run
        aux_share, z_share = self._loss_shares(r.probs_TE, r.logits_TE, self.last_tokens_per_expert, tokens_global)
        return y_TD.reshape(shape), MoEAux(aux_share, z_share, self.last_tokens_per_expert)

    def _loss_shares(self, probs_TE: Tensor, logits_TE: Tensor, counts_global_E: Tensor,
                     tokens_global: int) -> tuple[Tensor, Tensor]:
        """This rank's shares of the load-balancing loss E * sum_e f_e * P_e and of the
        z-loss mean_t lse_t^2, both over the whole batch (``load_balancing_loss`` and
        ``router_z_loss`` of :mod:`mxmoe.nn.moe`): f_e from the global counts, P_e and
        the z-loss with sums over this rank's tokens divided by the global token count.
        The operations mirror the single-process ones so the gradients match bit for bit."""
        if tokens_global == 0:
            zero = probs_TE.new_zeros(())
            return zero, zero
        f_E = counts_global_E.to(probs_TE.dtype) / (tokens_global * self.top_k)
        aux = self.n_experts * torch.sum(f_E * (probs_TE.sum(dim=0) / tokens_global))
        z = torch.logsumexp(logits_TE, dim=-1).pow(2).sum() / tokens_global
        return aux, z


def shard_experts(model: nn.Module, group=None, mx_dispatch: bool | None = None,
                  comm_stats: CommStats | None = None, batch_group=None) -> list[ExpertParallelMoELayer]:
    """Replace every :class:`~mxmoe.nn.moe.MoELayer` inside ``model`` by an
    :class:`ExpertParallelMoELayer` holding this rank's experts (in place).

    Build ``model`` identically on every rank first (same seed), so that the replicated
    parameters agree and the experts are those of the single-process model.

    Returns:
        The new layers, in module order.

    Raises:
        ValueError: as :class:`ExpertParallelMoELayer`.
    """
    layers = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, MoELayer):
                ep = ExpertParallelMoELayer(child, group, mx_dispatch, comm_stats, batch_group)
                setattr(module, child_name, ep)
                layers.append(ep)
    return layers


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the sharded expert weights."""
    names = []
    for mod_name, module in model.named_modules():
        if isinstance(module, ExpertParallelMoELayer):
            prefix = f"{mod_name}.experts." if mod_name else "experts."
            names += [prefix + n for n, _ in module.experts.named_parameters()]
    return names


def loss_share(logits: Tensor, targets: Tensor, aux_loss: Tensor, z_loss: Tensor, tokens_global: int,
               aux_loss_coef: float, z_loss_coef: float) -> tuple[Tensor, Tensor]:
    """This rank's share of the training loss of :class:`~mxmoe.models.MoETransformer`.

    ``ce_share = sum over this rank's tokens of the cross entropy / tokens_global``; the
    aux and z losses are already shares (from :class:`ExpertParallelMoELayer`). Summed
    over the ranks, the shares give the single-process loss of the whole batch; the
    gradient of one rank's share is the single-process gradient restricted to its tokens
    (the cross entropy's ``1 / T`` comes out as the same float as in ``reduction="mean"``).

    Args:
        logits: float32 (B_r, S, V) this rank's logits. targets: int64 (B_r, S).
        aux_loss, z_loss: float32 scalar shares (``LMOutput.aux_loss`` / ``z_loss``).
        tokens_global: B * S over all ranks. aux_loss_coef, z_loss_coef: loss weights.

    Returns:
        ``(loss_share, ce_share)``, float32 scalars.
    """
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                           reduction="sum") / tokens_global
    return ce + aux_loss_coef * aux_loss + z_loss_coef * z_loss, ce
