"""Expert parallelism: the MoE layer with its experts spread over the ranks of a group.

Legend of shape suffixes: T this rank's tokens, D model width, E experts (all ranks),
P ranks in the expert-parallel group, L = E / P experts held by this rank, k top-k,
A = T * k this rank's routed assignments, R rows this rank's experts receive, B bytes per
row of the MXFP8 wire format, C the capacity (rows per source-destination rank pair) of
the padded dispatch.

One forward of :class:`ExpertParallelMoELayer` on every rank of the group:

    x_TD --router (replicated, float32)--> top-k experts, weights
         --sort assignments by expert--> x_AD rows, grouped by destination rank (expert e
           lives on rank e // L)
    1. counts: all_gather of every rank's (E,) assignment counts -> (P, E); it also gives
       the global counts the load-balancing loss needs
    2. dispatch: all_to_all of the rows (bf16, or MXFP8 codes + scales, below)
         -> x_RD in source-major order [src 0: expert l0, l1, ..; src 1: l0, l1, ..]
         -> re-sorted expert-major [l0: src 0, src 1, ..; l1: ..]: expert l's rows in global
            token order (rank r holds global tokens r*T..(r+1)*T-1), exactly the rows and
            order the single-process layer gives that expert
    3. local SwiGLU experts: mx_grouped_mm over the L local experts (the recipe acts here)
    4. combine: back to source-major, the reverse all_to_all, unpermute, weight, sum over k

Two ways to size the exchanges (:class:`DispatchMode`, one rule: ``padded`` unless
``host-splits`` is asked for):

- ``padded`` (default): no host synchronization. The (P, E) counts stay on the device.
  Every rank sends each other rank a buffer of exactly C rows (all_to_all_single with equal
  splits, sizes known from shapes); rows beyond a pair's count are zero padding, and the
  receiver finds its valid rows, their local experts and the expert-major order from the
  device counts (:func:`receive_plan`). The layer can be captured in a CUDA graph. The
  capacity rule (:func:`dispatch_capacity`): by default C = T * min(k, L), the most rows
  one rank can route to another (each token's k experts are distinct and a rank holds L of
  them), so nothing is ever dropped and the layer is exact; the price is bytes: P C rows
  per exchange against the A = T k rows that are real, a factor P min(k, L) / k (2 at
  P = 2, k = 2). ``capacity_factor`` = f bounds C by ceil(f T k / P): rows of a
  (source, destination) pair past C are dropped (the last ones of the source's
  expert-sorted segment: the highest local expert, the latest tokens), contribute zero
  to their token's output, and are counted on the device (``last_dropped_rows``, global,
  the same on every rank). A run with drops is a capacity-factor MoE, not the dropless
  layer: it equals one process only where nothing is dropped.
- ``host-splits``: the counts are read back to the host (one sync per layer) and the
  all-to-alls carry exactly the routed rows (no padding, never a drop); eager only.

Backward runs through both exchanges (:class:`~mxmoe.distributed.collectives.AllToAllRows`:
the backward of an all-to-all is the reverse all-to-all). Every step is a permutation or a
per-row operation, so the layer is deterministic, and each expert's forward, dgrad and
wgrad GEMMs see the same rows in the same order as in one process: expert weight
gradients equal the single-process ones bit for bit when the upstream gradients do. The
padded dispatch hands the experts the valid rows first, then the padding past the last
expert's offset, which no GEMM reads (:func:`~mxmoe.ops.moe_experts.mx_moe_experts` with
``unrouted_tail``; :func:`~mxmoe.ops.mx_grouped_mm` leaves those rows zero).

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

import enum
import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..nn.args import check_flags
from ..nn.moe import (
    MoEAux,
    MoELayer,
    SwiGLUExperts,
    check_activations,
    combine_weighted,
    runs_fused,
    tokens_per_expert,
)
from ..ops.combine import combine_rows
from ..ops.moe_experts import mx_moe_experts
from ..numerics.formats import ElemFormat
from ..numerics.mx_tensor import MXTensor
from ..ops.quantize import dequantize_mx, quantize_mx
from ..recipe import Recipe
from .collectives import (
    AllToAllRows,
    AllToAllStart,
    AllToAllWait,
    CommStats,
    ExchangeTicket,
    all_to_all_rows,
    gather_counts,
)

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


def _check_wire_recipe(recipe: Recipe, what: str = "MXFP8 dispatch") -> None:
    if not recipe.quantize or recipe.fmt not in WIRE_FORMATS:
        raise ValueError(f"{what} needs a quantizing recipe with FP8 elements ({[f.value for f in WIRE_FORMATS]}), "
                         f"got {recipe.name!r} (quantize={recipe.quantize}, fmt={recipe.fmt.value})")


def _place_rows(rows_AC: Tensor, send_index_A: Tensor | None, send_rows: int) -> Tensor:
    """Rows placed in a padded send buffer of ``send_rows`` rows at ``send_index_A`` (rows
    whose index is ``send_rows`` or past it, the dropped ones, fall off the end); None: the
    rows as they are (exact splits)."""
    if send_index_A is None:
        return rows_AC
    buf = rows_AC.new_zeros((send_rows + rows_AC.shape[0], rows_AC.shape[1]))
    return buf.index_copy(0, send_index_A, rows_AC)[:send_rows]


class _MXDispatch(torch.autograd.Function):
    """Forward: all-to-all of packed MXFP8 rows, dequantized on arrival. Backward: the
    reverse all-to-all of the gradient rows in the activation dtype (straight through the
    rounding, as :func:`mxmoe.nn.moe.mx_round_rows`), an :class:`AllToAllRows`: differentiable
    again (double backward is supported). ``kind`` labels the exchange in ``stats``
    (default "dispatch"; its gradient "<kind>.grad")."""

    @staticmethod
    def forward(ctx, x_AD: Tensor, packed_AB: Tensor, d_model: int, recipe: Recipe, recv_splits, send_splits,
                group, stats, kind: str = "dispatch"):
        ctx.recv_splits, ctx.send_splits, ctx.group, ctx.stats, ctx.kind = recv_splits, send_splits, group, stats, kind
        ctx.n_inputs = 9 if kind != "dispatch" else 8  # apply's arguments (kind is optional)
        recv_RB = all_to_all_rows(packed_AB, recv_splits, send_splits, group, stats, kind)
        return unpack_mx_rows(recv_RB, d_model, recipe, x_AD.dtype)

    @staticmethod
    def backward(ctx, dx_RD: Tensor):
        dx_AD = AllToAllRows.apply(dx_RD, ctx.send_splits, ctx.recv_splits, ctx.group, ctx.stats, ctx.kind + ".grad")
        return (dx_AD,) + (None,) * (ctx.n_inputs - 1)


class _CombineExchange(torch.autograd.Function):
    """The combine all-to-all (expert outputs back to their source ranks) whose backward
    sends the output gradients to the expert ranks as MXFP8 rows (codes + scales along D,
    the recipe's format, scale rule and block size), dequantized on arrival: an
    :class:`_MXDispatch` of the gradient (straight through the rounding, so differentiable
    again).

    Exact only where the expert rank reads those gradients solely through the w2 dgrad
    GEMM, which quantizes them along D with the same blocks (re-quantizing MX values gives
    them back): when w2 takes no gradient. The w2 wgrad GEMM quantizes the same gradients
    along tokens, in blocks of 32 rows of one expert that mix source ranks, and needs
    their unrounded values (:class:`ExpertParallelMoELayer` decides).
    """

    @staticmethod
    def forward(ctx, y_NC: Tensor, recv_splits, send_splits, group, stats, recipe: Recipe) -> Tensor:
        ctx.recv_splits, ctx.send_splits, ctx.group, ctx.stats, ctx.recipe = recv_splits, send_splits, group, stats, recipe
        return all_to_all_rows(y_NC, recv_splits, send_splits, group, stats, "combine")

    @staticmethod
    def backward(ctx, dy_NC: Tensor):
        packed = pack_mx_rows(dy_NC, ctx.recipe)
        dy = _MXDispatch.apply(dy_NC, packed, dy_NC.shape[1], ctx.recipe, ctx.send_splits, ctx.recv_splits, ctx.group,
                               ctx.stats, "combine.grad")
        return dy, None, None, None, None, None


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


class DispatchMode(str, enum.Enum):
    """How the expert-parallel layer sizes its all-to-alls (module docstring).

    PADDED: fixed capacity per rank pair, counts kept on the device (no host sync; CUDA
    graph capturable). HOST_SPLITS: exact split sizes read back to the host once per layer.
    """

    PADDED = "padded"
    HOST_SPLITS = "host-splits"


def dispatch_capacity(tokens: int, top_k: int, n_local: int, world_size: int,
                      capacity_factor: float | None = None) -> int:
    """Rows C that one rank sends to (and receives from) each rank in the padded dispatch.

    Args:
        tokens: T, this rank's tokens (the same on every rank). top_k: k. n_local: L,
            experts per rank. world_size: P.
        capacity_factor: None: the worst case T * min(k, L) (a token's k experts are
            distinct, so at most min(k, L) of its rows go to one rank): nothing can be
            dropped. f > 0: min(worst case, ceil(f * T * k / P)), f = 1 being the rows of a
            perfectly balanced routing.

    Returns:
        C >= 0 (0 only for T = 0).

    Raises:
        ValueError: ``tokens`` not an integer >= 0, ``top_k``/``n_local``/``world_size``
            not integers >= 1, or a capacity factor that is not a positive finite number.
    """
    for name, value, low in (("tokens", tokens, 0), ("top_k", top_k, 1), ("n_local", n_local, 1),
                             ("world_size", world_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    _check_capacity_factor(capacity_factor)
    worst = tokens * min(top_k, n_local)
    if capacity_factor is None:
        return worst
    # f >= P already gives the worst case; bounding f first keeps the product finite
    return min(worst, math.ceil(min(capacity_factor, world_size) * tokens * top_k / world_size))


def _check_capacity_factor(capacity_factor) -> None:
    if capacity_factor is None:
        return
    try:  # a Python int past float's range (10**400) is not a usable factor either
        finite = not isinstance(capacity_factor, bool) and isinstance(capacity_factor, (int, float)) \
            and math.isfinite(float(capacity_factor))
    except OverflowError:
        finite = False
    if not finite or capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be a positive number (rows per rank pair relative to a balanced "
                         f"routing, e.g. 1.25) or None (worst case: never drops), got {capacity_factor!r}")


def send_plan(counts_PE: Tensor, rank: int, n_local: int, capacity: int, experts_sorted_A: Tensor
              ) -> tuple[Tensor, Tensor]:
    """Where each of this rank's expert-sorted rows goes in the padded send buffer.

    Args:
        counts_PE: (P, E) int64, every rank's assignment counts (device).
        rank: this rank. n_local: L. capacity: C.
        experts_sorted_A: (A,) int64 expert of each assignment, sorted (stable).

    Returns:
        ``(target_A, kept_A)``: (A,) int64 buffer row of each sorted row, destination
        j's rows at j * C + (its index among the rows to j); a row whose index is >= C is
        dropped and gets row P * C + a instead (a dump region the caller appends and
        discards, so that every target is distinct); (A,) bool kept.
    """
    P = counts_PE.shape[0]
    A = experts_sorted_A.numel()
    send_P = counts_PE[rank].view(P, n_local).sum(dim=1)
    start_P = torch.cumsum(send_P, 0) - send_P
    dest_A = experts_sorted_A // n_local
    rows_A = torch.arange(A, device=experts_sorted_A.device)
    c_A = rows_A - start_P[dest_A]
    kept_A = c_A < capacity
    return torch.where(kept_A, dest_A * capacity + c_A, P * capacity + rows_A), kept_A


def receive_plan(counts_PE: Tensor, rank: int, n_local: int, capacity: int
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The receiver's view of a padded buffer of P * C rows (source s's rows at s*C ..):
    which rows are valid, and the permutation to expert-major order, from the device
    counts alone (no host read; shapes depend only on P and C).

    Source s sends its rows for this rank's experts sorted by local expert (then token),
    the first C of them (:func:`send_plan`), so row s*C + c is valid for
    c < min(C, rows s routes here).

    Args:
        counts_PE: (P, E) int64 every rank's assignment counts. rank, n_local (L),
            capacity (C): as :func:`send_plan`.

    Returns:
        ``(src_N, out_row_N, valid_N, offsets_L)`` with N = P * C: src_N (N,) int64, the
        buffer row of each expert-major row (valid rows first, [l0: src 0, src 1, ..;
        l1: ..], then the padding rows in buffer order; a permutation of range(N));
        out_row_N its inverse (the expert-major row of each buffer row); valid_N (N,)
        bool per buffer row; offsets_L (L,) int32 cumulative expert ends (offsets[-1] =
        valid rows).
    """
    P = counts_PE.shape[0]
    device = counts_PE.device
    lo = rank * n_local
    want_PL = counts_PE[:, lo:lo + n_local]
    end_PL = torch.cumsum(want_PL, 1)
    kept_end_PL = end_PL.clamp_max(capacity)  # the first C rows of each source's segment are sent
    kept_start_PL = (end_PL - want_PL).clamp_max(capacity)
    kept_PL = kept_end_PL - kept_start_PL
    c_PC = torch.arange(capacity, device=device).expand(P, capacity).contiguous()
    valid_PC = c_PC < kept_end_PL[:, -1:]
    l_PC = torch.searchsorted(kept_end_PL.contiguous(), c_PC, right=True).clamp_max(n_local - 1)
    i_PC = c_PC - kept_start_PL.gather(1, l_PC)  # index within its (source, expert) block
    per_expert_L = kept_PL.sum(dim=0)
    expert_start_L = torch.cumsum(per_expert_L, 0) - per_expert_L
    before_PL = torch.cumsum(kept_PL, 0) - kept_PL  # rows of earlier sources for the same expert
    out_valid_PC = expert_start_L[l_PC] + before_PL.gather(1, l_PC) + i_PC
    valid_N = valid_PC.reshape(-1)
    invalid_N = (~valid_N).to(torch.int64)
    out_row_N = torch.where(valid_N, out_valid_PC.reshape(-1), per_expert_L.sum() + torch.cumsum(invalid_N, 0) - 1)
    N = P * capacity
    src_N = torch.empty_like(out_row_N).scatter_(0, out_row_N, torch.arange(N, device=device))
    return src_N, out_row_N, valid_N, torch.cumsum(per_expert_L, 0).to(torch.int32)


def dropped_rows(counts_PE: Tensor, n_local: int, capacity: int) -> Tensor:
    """(scalar int64, device) rows dropped by the padded dispatch over all rank pairs: the
    sum over (source s, destination j) of max(0, rows s routes to j - C)."""
    P = counts_PE.shape[0]
    pair_PP = counts_PE.view(P, P, n_local).sum(dim=2)
    return (pair_PP - capacity).clamp_min(0).sum()


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
        dispatch: :class:`DispatchMode` or its value: ``"padded"`` (default, no host
            sync) or ``"host-splits"`` (module docstring).
        capacity_factor: padded dispatch only: None (default) sizes the buffers for the
            worst case, never dropping; f > 0 bounds them (:func:`dispatch_capacity`) and
            drops the overflow, counted in ``last_dropped_rows``.
        mx_backward: send backward exchanges as MXFP8 where that is exact: the combine's
            gradient (to the expert ranks) while this layer's ``experts.w2`` takes no
            gradient (frozen experts' down projection: its rows then feed only the w2
            dgrad GEMM, which quantizes them along D anyway). Otherwise, and always for
            the dispatch's gradient (summed over k into the residual stream, unquantized
            in one process), the backward travels in the activation dtype.
            ``last_mx_backward`` says whether the last forward's backward will.
        overlap: run the shared expert (if the layer has one) while the combine's rows
            are in flight: the combine is issued with ``async_op=True``, the shared
            expert's forward runs, then the layer waits; in the backward the combine's
            gradient exchange is issued, the shared expert's backward runs, then the
            layer waits (:class:`~mxmoe.distributed.collectives.AllToAllStart`). The same
            operations on the same values, so the results are unchanged. Off with
            ``mx_backward`` in effect (that exchange packs its gradient). ``last_overlapped``
            says whether the last forward did.
        batch_group: where the global batch spans several expert-parallel groups (the
            data-parallel shard dimension of :mod:`mxmoe.distributed.mesh`), the group of
            this rank's peers in the other groups: the global counts are summed over it
            (one all-reduce of E ints), so the loss shares use the whole batch's counts.
            None: the global batch is this group's.

    Forward: ``x`` (..., D) -> (y (..., D), :class:`~mxmoe.nn.moe.MoEAux`) like ``MoELayer``,
    except that ``aux_loss`` and ``z_loss`` are this rank's shares (their sum over the
    ranks is the single-process value for the whole batch, see the module docstring) and
    ``tokens_per_expert`` counts the whole batch's assignments (E,) over all ranks. Under the
    padded dispatch every rank must pass the same number of tokens (the buffer size C is
    computed from it on each rank). After each forward, ``last_dropped_rows`` holds the
    rows dropped over the whole group (int64 scalar on the device; always 0 for the
    host-splits dispatch and for the default capacity).

    Raises:
        TypeError: ``layer`` is not an mxmoe MoE layer; ``mx_dispatch``, ``mx_backward``
            or ``overlap`` not a bool; ``comm_stats`` not a CommStats.
        ValueError: E not divisible by the group size; ``mx_dispatch`` with a recipe that
            does not quantize to an FP8 format; an unknown dispatch mode; a capacity
            factor that is not positive, or one given with the host-splits dispatch.
    """

    def __init__(self, layer: MoELayer, group=None, mx_dispatch: bool | None = None,
                 comm_stats: CommStats | None = None, dispatch: DispatchMode | str = DispatchMode.PADDED,
                 capacity_factor: float | None = None, mx_backward: bool = False, overlap: bool = True,
                 batch_group=None):
        super().__init__()
        if not isinstance(layer, MoELayer):
            raise TypeError(f"ExpertParallelMoELayer wraps an mxmoe MoE layer (mxmoe.nn.MoE), got "
                            f"{type(layer).__name__}")
        check_flags(mx_backward=mx_backward, overlap=overlap,
                    **({} if mx_dispatch is None else {"mx_dispatch": mx_dispatch}))
        if comm_stats is not None and not isinstance(comm_stats, CommStats):
            raise TypeError(f"comm_stats must be a CommStats or None, got {type(comm_stats).__name__}")
        self.batch_group = batch_group
        self.overlap = overlap
        self.last_overlapped: bool | None = None
        if mx_backward:
            _check_wire_recipe(layer.recipe, "mx_backward (MXFP8 gradients on the wire)")
        self.mx_backward = mx_backward
        self.last_mx_backward: bool | None = None
        try:
            self.dispatch = DispatchMode(dispatch)
        except ValueError:
            raise ValueError(f"dispatch must be one of {[m.value for m in DispatchMode]}, got {dispatch!r}") from None
        _check_capacity_factor(capacity_factor)
        if capacity_factor is not None and self.dispatch is DispatchMode.HOST_SPLITS:
            raise ValueError("capacity_factor applies to the padded dispatch; the host-splits dispatch sends exactly "
                             "the routed rows (pass capacity_factor=None)")
        self.capacity_factor = capacity_factor
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
        self.experts.w13 = nn.Parameter(w13.detach()[lo:hi].clone(), requires_grad=w13.requires_grad)
        self.experts.w2 = nn.Parameter(w2.detach()[lo:hi].clone(), requires_grad=w2.requires_grad)
        self.comm_stats = comm_stats
        self.last_tokens_per_expert: Tensor | None = None
        self.last_dropped_rows: Tensor | None = None
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
        check_activations(x, self.router.weight.shape[1], type(self).__name__)
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        r = self.router(x_TD)
        shared = None if self.shared is None else (lambda: self.shared(x_TD, self.recipe))
        route = self._routed_padded if self.dispatch is DispatchMode.PADDED else self._routed_host_splits
        y_TD, y_shared_TD, counts_global_E, tokens_global, fused = route(x_TD, r.experts_Tk, r.weights_Tk, shared)
        if y_shared_TD is not None:
            y_TD = y_TD + y_shared_TD
        self.last_tokens_per_expert = counts_global_E
        self.last_ran_fused = fused  # set once the forward has run
        aux_share, z_share = self._loss_shares(r.probs_TE, r.logits_TE, counts_global_E, tokens_global)
        return y_TD.reshape(shape), MoEAux(aux_share, z_share, counts_global_E)

    def _dispatch_rows(self, x_TD: Tensor, order_A: Tensor, x_sorted_AD: Tensor, recv_splits, send_splits,
                       send_index_A: Tensor | None = None, send_rows: int = 0) -> Tensor:
        """The dispatch exchange: rows x_sorted_AD (bf16) or, with ``mx_dispatch``, their
        MXFP8 packing, placed in a send buffer of ``send_rows`` rows at ``send_index_A``
        (padded dispatch; None: the rows as they are)."""
        k, D = self.top_k, x_TD.shape[1]

        def place(rows_AC: Tensor) -> Tensor:
            return _place_rows(rows_AC, send_index_A, send_rows)

        x_send = place(x_sorted_AD)
        if self.mx_dispatch:  # quantize the T token rows once, then route their bytes
            packed_AB = place(pack_mx_rows(x_TD, self.recipe).index_select(0, order_A // k))
            return _MXDispatch.apply(x_send, packed_AB, D, self.recipe, recv_splits, send_splits, self.group,
                                     self.comm_stats)
        return AllToAllRows.apply(x_send, recv_splits, send_splits, self.group, self.comm_stats, "dispatch")

    def _dispatch_weights(self, weights_sorted_A: Tensor, recv_splits, send_splits, send_index_A: Tensor | None = None,
                          send_rows: int = 0) -> Tensor:
        """The combine weight of each dispatched row (float32), exchanged with the rows' plan
        so that the fused expert op on the receiving rank gets it (``mx_moe_experts``'s
        ``weights_A``) and returns its gradient, which comes back through this exchange's
        backward: the origin's combine then keeps nothing of the expert outputs. One float
        per row."""
        w_A1 = _place_rows(weights_sorted_A.float().unsqueeze(1), send_index_A, send_rows)
        return AllToAllRows.apply(w_A1, recv_splits, send_splits, self.group, self.comm_stats, "weights").squeeze(1)

    def _combine_exchange(self, y_NC: Tensor, recv_splits, send_splits, during=None) -> tuple[Tensor, Tensor | None]:
        """The combine all-to-all; its backward in MXFP8 where exact (``mx_backward``).
        ``during`` (the shared expert, or None) runs while the rows are in flight, forward
        and backward, where ``overlap`` is on and the exchange is not MXFP8; returns
        (received rows, ``during()`` or None)."""
        mx = self.mx_backward and torch.is_grad_enabled() and not self.experts.w2.requires_grad
        self.last_mx_backward = mx
        self.last_overlapped = bool(self.overlap and during is not None and not mx)
        if self.last_overlapped:
            ticket = ExchangeTicket()
            out = AllToAllStart.apply(y_NC, recv_splits, send_splits, self.group, self.comm_stats, "combine", ticket)
            extra = during()  # independent of the exchange: overlaps it (and its gradient, backward)
            return AllToAllWait.apply(out, ticket), extra
        if mx:
            out = _CombineExchange.apply(y_NC, recv_splits, send_splits, self.group, self.comm_stats, self.recipe)
        else:
            out = AllToAllRows.apply(y_NC, recv_splits, send_splits, self.group, self.comm_stats, "combine")
        return out, (during() if during is not None else None)

    def _local_experts(self, x_RD: Tensor, src_R: Tensor, offsets_L: Tensor, unrouted_tail: bool,
                       weights_R: Tensor | None) -> Tensor:
        """The L local experts on the rows x_RD[src_R] (expert-major); returns their outputs
        in expert-major order. ``weights_R`` (the fused path): the combine weight of each
        received row, whose gradient the fused op returns."""
        if weights_R is not None:  # x_RD is the receive buffer: keep x's wgrad operand as codes, not the buffer
            return mx_moe_experts(x_RD, src_R, offsets_L, self.experts.w13, self.experts.w2, self.recipe,
                                  unrouted_tail=unrouted_tail, weights_A=weights_R.index_select(0, src_R),
                                  x_saved_as_codes=True)
        return self.experts(x_RD.index_select(0, src_R), offsets_L, self.recipe)

    def _combine(self, y_sorted_AD: Tensor, order_A: Tensor, weights_Tk: Tensor, fused: bool) -> Tensor:
        """The origin's combine: on the fused path the weights' gradient came from the expert
        op (:meth:`_dispatch_weights`) and nothing of y is kept; otherwise plain autograd."""
        if fused:
            return combine_rows(y_sorted_AD, order_A, weights_Tk, self.recipe)
        return combine_weighted(y_sorted_AD, order_A, weights_Tk)

    def _routed_padded(self, x_TD: Tensor, experts_Tk: Tensor, weights_Tk: Tensor, shared=None
                       ) -> tuple[Tensor, Tensor | None, Tensor, Tensor, bool]:
        """Dispatch, experts and combine with fixed-size buffers (no host sync). Returns
        (y_TD without the shared expert, the shared expert's output (``shared()``, run
        during the combine) or None, global counts (E,), global tokens (device scalar),
        fused)."""
        T, D = x_TD.shape
        k, E, L, P = self.top_k, self.n_experts, self.n_local, self.world_size
        experts_A = experts_Tk.reshape(-1)
        order_A = torch.argsort(experts_A, stable=True)
        counts_PE = gather_counts(tokens_per_expert(experts_A, E), self.group, self.comm_stats)
        counts_global_E = counts_PE.sum(dim=0)
        if self.batch_group is not None:  # the global batch spans several expert-parallel groups
            dist.all_reduce(counts_global_E, group=self.batch_group)  # on the device: no host sync
        C = dispatch_capacity(T, k, L, P, self.capacity_factor)
        N = P * C
        splits = [C] * P
        target_A, _ = send_plan(counts_PE, self.rank, L, C, experts_A.index_select(0, order_A))
        self.last_dropped_rows = dropped_rows(counts_PE, L, C)
        x_sorted_AD = x_TD.unsqueeze(1).expand(T, k, D).reshape(T * k, D).index_select(0, order_A)
        x_ND = self._dispatch_rows(x_TD, order_A, x_sorted_AD, splits, splits, target_A, N)
        fused = runs_fused(self.fused, self.recipe, x_TD)
        w_N = (self._dispatch_weights(weights_Tk.reshape(-1).index_select(0, order_A), splits, splits, target_A, N)
               if fused else None)
        src_N, out_row_N, valid_N, offsets_L = receive_plan(counts_PE, self.rank, L, C)
        y_local_ND = self._local_experts(x_ND, src_N, offsets_L, True, w_N)
        # back to buffer order; the padding rows (unspecified on the fused path) become zeros
        y_ND = torch.where(valid_N.unsqueeze(1), y_local_ND.index_select(0, out_row_N), 0.0)
        y_back_ND, y_shared_TD = self._combine_exchange(y_ND, splits, splits, shared)
        y_back = torch.cat([y_back_ND, y_back_ND.new_zeros(T * k, D)])  # dropped rows read zeros
        y_sorted_AD = y_back.index_select(0, target_A)
        y_TD = self._combine(y_sorted_AD, order_A, weights_Tk, fused)
        return y_TD, y_shared_TD, counts_global_E, counts_global_E.sum() // k, fused

    def _routed_host_splits(self, x_TD: Tensor, experts_Tk: Tensor, weights_Tk: Tensor, shared=None
                            ) -> tuple[Tensor, Tensor | None, Tensor, int, bool]:
        """Dispatch, experts and combine with exact split sizes read on the host (returns
        as :meth:`_routed_padded`, the global tokens a host int)."""
        T, D = x_TD.shape
        k, E, L, P, device = self.top_k, self.n_experts, self.n_local, self.world_size, x_TD.device
        experts_A = experts_Tk.reshape(-1)
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
        self.last_dropped_rows = torch.zeros((), dtype=torch.int64, device=device)
        # 2. dispatch (rows sorted by expert = grouped by destination rank, rank order)
        x_sorted_AD = x_TD.unsqueeze(1).expand(T, k, D).reshape(T * k, D).index_select(0, order_A)
        x_RD = self._dispatch_rows(x_TD, order_A, x_sorted_AD, recv_splits, send_splits)
        fused = runs_fused(self.fused, self.recipe, x_TD)
        w_R = (self._dispatch_weights(weights_Tk.reshape(-1).index_select(0, order_A), recv_splits, send_splits)
               if fused else None)
        perm_R = expert_major_order(recv_counts_PL).to(device, non_blocking=True)
        offsets_L = torch.cumsum(recv_counts_PL.sum(dim=0), 0).to(device=device, dtype=torch.int32)
        # 3. local experts, rows in (local expert, global token) order (the same rows in the
        # same order as the single-process layer's experts see)
        y_local_RD = self._local_experts(x_RD, perm_R, offsets_L, False, w_R)
        # 4. combine: back to source-major, reverse exchange, unpermute, weight, sum over k
        y_RD = torch.zeros_like(y_local_RD).index_copy(0, perm_R, y_local_RD)
        y_sorted_AD, y_shared_TD = self._combine_exchange(y_RD, send_splits, recv_splits, shared)
        y_TD = self._combine(y_sorted_AD, order_A, weights_Tk, fused)
        return y_TD, y_shared_TD, counts_global_E.to(device), tokens_global, fused

    def _loss_shares(self, probs_TE: Tensor, logits_TE: Tensor, counts_global_E: Tensor,
                     tokens_global: int | Tensor) -> tuple[Tensor, Tensor]:
        """This rank's shares of the load-balancing loss E * sum_e f_e * P_e and of the
        z-loss mean_t lse_t^2, both over the whole batch (``load_balancing_loss`` and
        ``router_z_loss`` of :mod:`mxmoe.nn.moe`): f_e from the global counts, P_e and
        the z-loss with sums over this rank's tokens divided by the global token count.
        The operations mirror the single-process ones so the gradients match bit for bit.
        ``tokens_global`` is a host int (host-splits) or an int64 device scalar (padded:
        divided as float32, the same correctly rounded quotient, no host read)."""
        if isinstance(tokens_global, Tensor):
            tg = tokens_global.clamp_min(1).to(probs_TE.dtype)  # 0 tokens: the sums are 0 too
            f_E = counts_global_E.to(probs_TE.dtype) / (tg * self.top_k)
            aux = self.n_experts * torch.sum(f_E * (probs_TE.sum(dim=0) / tg))
            z = torch.logsumexp(logits_TE, dim=-1).pow(2).sum() / tg
            return aux, z
        if tokens_global == 0:
            zero = probs_TE.new_zeros(())
            return zero, zero
        f_E = counts_global_E.to(probs_TE.dtype) / (tokens_global * self.top_k)
        aux = self.n_experts * torch.sum(f_E * (probs_TE.sum(dim=0) / tokens_global))
        z = torch.logsumexp(logits_TE, dim=-1).pow(2).sum() / tokens_global
        return aux, z


def shard_experts(model: nn.Module, group=None, mx_dispatch: bool | None = None,
                  comm_stats: CommStats | None = None, dispatch: DispatchMode | str = DispatchMode.PADDED,
                  capacity_factor: float | None = None, mx_backward: bool = False, overlap: bool = True,
                  batch_group=None) -> list[ExpertParallelMoELayer]:
    """Replace every :class:`~mxmoe.nn.moe.MoELayer` inside ``model`` by an
    :class:`ExpertParallelMoELayer` holding this rank's experts (in place).

    Build ``model`` identically on every rank first (same seed), so that the replicated
    parameters agree and the experts are those of the single-process model. ``dispatch``,
    ``capacity_factor``, ``mx_backward``, ``overlap`` and ``batch_group`` as
    :class:`ExpertParallelMoELayer`.

    Returns:
        The new layers, in module order.

    Raises:
        TypeError: ``model`` is not an nn.Module; as :class:`ExpertParallelMoELayer`.
        ValueError: as :class:`ExpertParallelMoELayer`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_experts takes the model (an nn.Module), got {type(model).__name__}")
    layers = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, MoELayer):
                ep = ExpertParallelMoELayer(child, group, mx_dispatch, comm_stats, dispatch, capacity_factor,
                                            mx_backward, overlap, batch_group)
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
