"""All-gather of expert weights as MXFP8: each rank quantizes its shard, the group gathers
E4M3 codes and E8M0 scales.

Legend: E_s experts in one rank's shard, G ranks in the gathering group (``dp_shard``),
E = G x E_s, N output rows and K contraction columns of one expert's weight (w13: N = 2F,
K = D; w2: N = D, K = F).

An MXFP8 GEMM reads each expert weight quantized along its contraction dimension, in
blocks of 32 (docs/NUMERICS.md): the forward along K (blocks of 32 consecutive elements of
a row), the dgrad along N (blocks of 32 consecutive rows of one column, within one
expert). :func:`~mxmoe.distributed.mesh.shard_model` shards expert weights along the
expert dimension, so each shard holds whole experts and neither blocking crosses a shard
boundary: quantizing each shard and concatenating the codes and scales along E gives the
bytes of quantizing the whole weight (tests/distributed/test_fsdp_expert_parallel.py
checks it bit for bit, both blockings, rceil and floor, K and N not multiples of 32).
(A weight sharded along a blocked dimension would need shard sizes that are multiples of
32 there; the expert dimension needs nothing.)

Bytes on the wire per element: 1 (E4M3 code) + 1/32 (E8M0 scale) = 1.03, against 2 for
bf16 and 4 for the float32 master weights: 0.516x and 0.258x. The forward needs the copy
blocked along K and the backward the one along N; each pass gathers only its own.

:func:`all_gather_mx_experts` is the collective. :func:`gather_experts_as_mxfp8` puts it in
an expert-parallel layer's forward, in place of FSDP2 for the experts
(``mxmoe train --mx-weight-gather``): before each forward, each rank quantizes its shard
along both blockings and gathers codes and scales (2 x 1.03 bytes per element per step,
against 2 x 2 for FSDP2 gathering bf16 for the forward and again for the backward, and
2 x 4 for the float32 master weights); the layer's weight becomes the forward copy's values
(float32, exact), and the open weight-copy cache (:mod:`mxmoe.ops.weight_cache`) is given
both dequantized copies, so the GEMMs read the gathered copies and quantize nothing (their
forward copy equals re-quantizing those values along K, which gives them back: tested in
tests/distributed/test_expert_parallel.py). The weight gradient is reduce-scattered (summed)
over the group back to the shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torch import nn

from ..numerics.mx_tensor import MXTensor
from ..ops.autograd import no_double_backward
from ..ops.quantize import dequantize_mx, quantize_mx
from ..ops.weight_cache import DGRAD_DIM, FWD_DIM, active_cache
from ..recipe import Recipe

# the blockings of an expert weight (E, N, K): the forward GEMM's and the dgrad GEMM's
FORWARD_BLOCKED_DIM = -1  # along K
DGRAD_BLOCKED_DIM = -2  # along N, within each expert


def quantize_expert_shard(w_shard: Tensor, recipe: Recipe, dim: int) -> MXTensor:
    """Quantize a shard of whole experts (E_s, N, K) along ``dim`` with the recipe's format,
    scale rule and block size (the tail block zero padded, as the GEMMs do).

    Args:
        w_shard: (E_s, N, K) float32/bfloat16/float16, this rank's experts.
        recipe: a quantizing recipe (``recipe.quantize``).
        dim: :data:`FORWARD_BLOCKED_DIM` (-1) or :data:`DGRAD_BLOCKED_DIM` (-2).

    Returns:
        :class:`~mxmoe.numerics.MXTensor`, codes (E_s, N_pad, K) or (E_s, N, K_pad),
        scales with ``dim`` divided by the block size.

    Raises:
        ValueError: not 3-D, ``dim`` not -1 / -2 (or 2 / 1), or a recipe that does not quantize.
    """
    if w_shard.dim() != 3:
        raise ValueError(f"an expert weight shard is (E_s, N, K), got shape {tuple(w_shard.shape)}")
    if dim not in (-1, -2, 1, 2):
        raise ValueError(f"dim must be -1 (the forward's K) or -2 (the dgrad's N), got {dim}; the expert "
                         f"dimension 0 is the sharded one and is never blocked")
    if not recipe.quantize:
        raise ValueError(f"recipe {recipe.name!r} does not quantize: gather the weights themselves")
    return quantize_mx(w_shard.detach(), recipe.fmt, block_size=recipe.block_size, dim=dim,
                       scale_mode=recipe.scale_mode, pad=True, backend=recipe.backend)


def all_gather_mx_experts(w_shard: Tensor, recipe: Recipe, dim: int, group=None) -> tuple[MXTensor, int]:
    """Quantize this rank's experts once and all-gather codes and scales over ``group``.

    Every rank of ``group`` calls it with its shard, in rank order of the experts (rank g
    holds experts g*E_s .. (g+1)*E_s - 1, the layout of FSDP2's ``Shard(0)``).

    Args:
        w_shard: (E_s, N, K) this rank's experts (the local tensor of the FSDP2 shard).
        recipe, dim: as :func:`quantize_expert_shard`.
        group: the process group (None: the default group).

    Returns:
        ``(mx, wire_bytes)``: the whole (E, ...) weight as an MXTensor, bit for bit
        ``quantize_mx`` of the gathered float weight along ``dim``; and the bytes this rank
        received (codes and scales of the other ranks' shards).

    Raises:
        ValueError: as :func:`quantize_expert_shard`.
    """
    mx = quantize_expert_shard(w_shard, recipe, dim)
    G = dist.get_world_size(group)
    codes, scales = mx.qdata.view(torch.uint8).contiguous(), mx.scale.view(torch.uint8).contiguous()
    codes_G = [torch.empty_like(codes) for _ in range(G)]
    scales_G = [torch.empty_like(scales) for _ in range(G)]
    dist.all_gather(codes_G, codes, group=group)
    dist.all_gather(scales_G, scales, group=group)
    full = MXTensor(torch.cat(codes_G).view(mx.qdata.dtype), torch.cat(scales_G).view(mx.scale.dtype), mx.fmt,
                    mx.block_size, mx.dim, mx.scale_mode, mx.orig_size)
    wire_bytes = (G - 1) * (codes.numel() + scales.numel())
    return full, wire_bytes


class _GatherExpertsMX(torch.autograd.Function):
    """Forward: shard (E_s, N, K) -> the whole weight (E, N, K) float32, the values of its
    forward copy, gathered as MXFP8 (both blockings; the open weight-copy cache gets both
    copies). Backward: reduce-scatter (sum) of the whole weight's gradient to the shard."""

    @staticmethod
    def forward(ctx, shard: Tensor, recipe: Recipe, group, stats: dict, operand_dtype: torch.dtype) -> Tensor:
        ctx.group = group
        mx_k, bytes_k = all_gather_mx_experts(shard, recipe, FORWARD_BLOCKED_DIM, group)
        mx_n, bytes_n = all_gather_mx_experts(shard, recipe, DGRAD_BLOCKED_DIM, group)
        stats["gathered_bytes"] = stats.get("gathered_bytes", 0) + bytes_k + bytes_n
        full = dequantize_mx(mx_k, torch.float32, backend=recipe.backend)
        cache = active_cache(full)
        if cache is not None:
            cache.put(full, recipe, operand_dtype, {FWD_DIM: dequantize_mx(mx_k, operand_dtype, backend=recipe.backend),
                                                    DGRAD_DIM: dequantize_mx(mx_n, operand_dtype,
                                                                             backend=recipe.backend)})
        return full

    @staticmethod
    @no_double_backward("the MXFP8 expert-weight gather (--mx-weight-gather)",
                        "train without --mx-weight-gather where second-order gradients are needed")
    def backward(ctx, g_full: Tensor):
        G = dist.get_world_size(ctx.group)
        g = g_full.float().contiguous()
        out = g.new_empty((g.shape[0] // G, *g.shape[1:]))
        dist.reduce_scatter_tensor(out, g, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None, None, None


def gather_experts_as_mxfp8(layer: nn.Module, recipe: Recipe, group, rank: int) -> dict:
    """Shard ``layer.experts`` (``w13``, ``w2``: (L, N, K)) along the expert dimension over
    ``group`` and gather them as MXFP8 in each forward (module docstring), in place.

    After the call, ``layer.experts.w13`` / ``w2`` are this rank's shards, (L / G, N, K)
    float32 Parameters (what the optimizer and checkpoints see); during a forward they are
    the whole weights, non-leaf tensors whose gradients reach the shards through a
    reduce-scatter. Open a :func:`~mxmoe.ops.weight_copy_cache` around the forward and
    backward, or each GEMM quantizes the gathered values again and the dgrad copy is
    rounded twice (a different result).

    Args:
        layer: an :class:`~mxmoe.distributed.ep.ExpertParallelMoELayer` (its experts whole
            on this rank: L of them).
        recipe: a quantizing recipe (the layer's). group: the gathering group (G ranks).
        rank: this rank's index in ``group`` (its shard: experts rank*L/G .. ).

    Returns:
        A dict the layer's forwards fill: ``gathered_bytes``, bytes received so far.

    Raises:
        ValueError: a recipe that does not quantize, or L not divisible by G.
    """
    if not recipe.quantize:
        raise ValueError(f"gathering expert weights as MXFP8 needs a quantizing recipe, got {recipe.name!r}")
    G = dist.get_world_size(group)
    experts = layer.experts
    shards = {}
    for name in ("w13", "w2"):
        w = getattr(experts, name)
        if w.shape[0] % G:
            raise ValueError(f"{w.shape[0]} experts do not split over {G} ranks")
        shards[name] = nn.Parameter(w.detach().chunk(G)[rank].clone())
        setattr(experts, name, shards[name])
    stats: dict = {}

    def gather(module, args):
        # the expert GEMMs read their weight copies in the activations' dtype (the fused op:
        # bf16, which it runs for bf16 activations only)
        dtype = args[0].dtype
        for name, shard in shards.items():
            module.experts._parameters[name] = _GatherExpertsMX.apply(shard, recipe, group, stats, dtype)

    def restore(module, args, output):
        for name, shard in shards.items():
            module.experts._parameters[name] = shard

    layer.register_forward_pre_hook(gather)
    layer.register_forward_hook(restore)
    return stats

