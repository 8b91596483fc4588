"""Gradients and state of an expert-parallel model: replicated vs sharded parameters.

Replicated (every rank holds the same copy): embedding, attention, norms, dense FFNs,
router, shared experts, LM head. Each rank's backward gives the gradient of its share of
the loss (:func:`mxmoe.distributed.ep.loss_share`), so the full gradient is the **sum**
over ranks: one flat all-reduce after the backward (:func:`all_reduce_grads`).

Sharded (each rank holds its own E / P experts): ``experts.w13`` / ``experts.w2`` of every
:class:`~mxmoe.distributed.ep.ExpertParallelMoELayer`. Their gradients already hold every
rank's contribution (the rows came from all ranks through the all-to-all): no reduction.

Why not DDP: DDP averages (divides by P) where the shares need a sum, would have to be
told to skip the expert weights (only a private API does that), and interleaves its
bucketed all-reduces with the backward's all-to-alls. One flat all-reduce after backward
costs one collective per step, is deterministic and keeps the order of collectives
obvious; what it gives up is overlapping that all-reduce with the backward, which matters
little while the replicated parameters are small next to the experts. FSDP2 is not
needed at these sizes for the same reason.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .ep import ExpertParallelMoELayer, expert_parameter_names

# torch.nn.utils.clip_grad_norm_'s epsilon in max_norm / (total_norm + eps)
CLIP_EPS = 1e-6


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(replicated, sharded)`` parameters of ``model``, each in ``named_parameters`` order."""
    sharded_names = set(expert_parameter_names(model))
    replicated, sharded = [], []
    for name, p in model.named_parameters():
        (sharded if name in sharded_names else replicated).append(p)
    return replicated, sharded


def all_reduce_grads(params: list[nn.Parameter], group=None) -> None:
    """Sum the gradients of replicated ``params`` over the ranks, in place: one flat
    all-reduce per gradient dtype. A missing gradient counts as zeros (so every rank
    sends buffers of one size)."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for ps in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for p, g in zip(ps, flat.split([p.numel() for p in ps])):
            p.grad.copy_(g.view_as(p.grad))


def clip_grad_norm_(replicated: list[nn.Parameter], sharded: list[nn.Parameter], max_norm: float,
                    group=None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole expert-parallel model.

    The global norm counts each replicated gradient once and every rank's expert
    gradients: sqrt(||g_replicated||^2 + sum over ranks ||g_sharded,r||^2) (one all-reduce
    of a scalar). Call after :func:`all_reduce_grads`. Gradients are scaled by
    min(1, max_norm / (norm + 1e-6)), torch's rule.

    Returns:
        The global norm before clipping, float32 scalar on the parameters' device
        (identical on every rank).
    """
    def sq(ps):
        gs = [p.grad for p in ps if p.grad is not None]
        if not gs:
            return None
        return torch.stack([torch.linalg.vector_norm(g.float()) for g in gs]).pow(2).sum()

    device = (replicated or sharded)[0].device
    rep, shd = sq(replicated), sq(sharded)
    shd = torch.zeros((), device=device) if shd is None else shd
    dist.all_reduce(shd, op=dist.ReduceOp.SUM, group=group)
    total = (shd if rep is None else rep + shd).sqrt()
    clip = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
    for p in replicated + sharded:
        if p.grad is not None:
            p.grad.mul_(clip.to(p.grad.dtype))
    return total


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def gather_state(model: nn.Module, optimizer: torch.optim.Optimizer, group=None,
                 dst: int = 0) -> tuple[dict[str, Tensor], list[dict]] | None:
    """Collect the whole model and every rank's optimizer state on rank ``dst``.

    Returns (on ``dst``; None on the other ranks):
        ``(model_state, optimizer_states)``: the model's state dict in the single-process
        format (each expert weight concatenated over the ranks along E, CPU tensors) and
        the list of the ranks' optimizer state dicts (CPU), rank order.
    """
    names = set(expert_parameter_names(model))
    state = model.state_dict()
    local = {"experts": {n: state[n].detach().cpu() for n in names}, "optimizer": _to_cpu(optimizer.state_dict())}
    rank = dist.get_rank(group)
    gathered = [None] * dist.get_world_size(group) if rank == dst else None
    dist.gather_object(local, gathered, dst=dist.get_global_rank(group, dst) if group is not None else dst,
                       group=group)
    if rank != dst:
        return None
    full = {}
    for n, t in state.items():
        full[n] = torch.cat([g["experts"][n] for g in gathered], dim=0) if n in names else t.detach().cpu()
    return full, [g["optimizer"] for g in gathered]


def load_sharded_model_state(model: nn.Module, full_state: dict[str, Tensor], group=None) -> None:
    """Load a single-process-format state dict into an expert-parallel model: replicated
    tensors as they are, each expert weight cut to this rank's experts.

    Raises:
        ValueError: an expert weight whose expert count does not split over the ranks.
    """
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    names = set(expert_parameter_names(model))
    local = {}
    for n, t in full_state.items():
        if n in names:
            if t.shape[0] % P:
                raise ValueError(f"{n} holds {t.shape[0]} experts, which do not split over {P} ranks")
            t = t.chunk(P, dim=0)[rank]
        local[n] = t
    model.load_state_dict(local)


def moe_layers(model: nn.Module) -> list[ExpertParallelMoELayer]:
    """The expert-parallel layers of ``model`` in module order."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelMoELayer)]
