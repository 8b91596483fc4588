"""The global batch spread over the ranks of an expert-parallel group.

Every rank draws the same global batch of B sequences (same generator, same seed) and
keeps its own B / P of them (:func:`rank_slice`): rank r takes sequences
r*B/P .. (r+1)*B/P - 1, so that the ranks' tokens, in rank order, are the global batch in
its single-process order (the order :class:`~mxmoe.distributed.ep.ExpertParallelMoELayer`
relies on to give each expert its rows in global token order).

:func:`evaluate_expert_parallel` is the mean cross entropy of whole global batches, each
rank evaluating its slice and the per-batch sums added over the ranks (one all-reduce).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


def rank_slice(batch: Tensor, rank: int, world_size: int) -> Tensor:
    """Rows ``rank*B/P .. (rank+1)*B/P - 1`` of a (B, ...) batch: this rank's sequences.

    Args:
        batch: (B, ...) any dtype (token ids: int64 (B, S)).
        rank: this rank, 0 <= rank < world_size. world_size: P.

    Returns:
        A (B / P, ...) view of ``batch``.

    Raises:
        ValueError: B not divisible by P, or ``rank`` outside [0, P).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size}): pass this process's rank and the group size")
    if batch.shape[0] % world_size:
        raise ValueError(f"a batch of {batch.shape[0]} sequences does not split over {world_size} ranks; "
                         f"use a batch size divisible by {world_size}")
    per = batch.shape[0] // world_size
    return batch[rank * per:(rank + 1) * per]


@torch.no_grad()
def evaluate_expert_parallel(model: nn.Module, batches, device: torch.device, group=None) -> float:
    """Mean over ``batches`` of each global batch's mean cross entropy (nats per token).

    Each rank runs ``model`` (an expert-parallel :class:`~mxmoe.models.MoETransformer`) on
    its :func:`rank_slice` of every batch and sums its tokens' cross entropy divided by the
    global batch's token count; one all-reduce adds these shares over the ranks. Every
    rank of ``group`` must call this together (the model's all-to-alls and the reduction
    are collectives). The model is in eval mode during the call and in train mode after.

    Args:
        model: returns an object with ``logits`` float32 (B / P, S, V) for ``model(x)``.
        batches: list of ``(x, y)`` int64 (B, S) global batches, the same on every rank.
        device: where the model lives. group: the process group (None: the default group).

    Returns:
        The mean, a Python float, identical on every rank.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model.eval()
    sums = []
    for x, y in batches:
        xs, ys = rank_slice(x, rank, world), rank_slice(y, rank, world)
        logits = model(xs.to(device)).logits
        sums.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys.to(device).reshape(-1),
                                    reduction="sum") / y.numel())
    model.train()
    per_batch = torch.stack(sums)
    dist.all_reduce(per_batch, group=group)
    return per_batch.mean().item()
