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

:func:`all_gather_mx_experts` is the collective. It is not yet what the training step runs:
FSDP2 still all-gathers the float32 expert weights, and each GEMM quantizes them itself
(docs/EXPERT_PARALLEL.md, "Known limits").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..numerics.mx_tensor import MXTensor
from ..ops.quantize import quantize_mx
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
