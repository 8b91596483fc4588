"""A 2-D device mesh (data-parallel shard x expert parallel) with FSDP2 sharding.

Legend: W = world size = D x P, D ranks along ``dp_shard``, P ranks along ``ep``, E experts,
L = E / P experts per expert-parallel rank, E / W experts per rank's FSDP2 shard.

The mesh is ``init_device_mesh(device, (D, P), mesh_dim_names=("dp_shard", "ep"))``:
global rank r sits at (r // P, r % P), so an expert-parallel group holds P consecutive
ranks (one node's GPUs when P <= GPUs per node: the all-to-alls stay on NVLink).

What each rank holds (:func:`shard_model`; the layout of torchtitan, whose expert
parallelism is carved out of its data-parallel shard dimension the same way):

| parameters | sharded how | gradient |
|---|---|---|
| experts (``experts.w13``, ``experts.w2``) | split over ``ep`` (rank (d, p) runs experts p*L .. p*L + L - 1), and those L experts sharded along the expert dimension over ``dp_shard`` by FSDP2 (``fully_shard`` of each :class:`~mxmoe.distributed.ep.ExpertParallelMoELayer` on ``mesh["dp_shard"]``) | reduce-scattered (summed) over ``dp_shard``; the all-to-all backward already summed the ``ep`` group's tokens |
| everything else (embedding, attention, norms, router, shared expert, dense FFNs, LM head) | FSDP2 over all W ranks (a 1-D mesh of the world): each block, each router and shared expert, and the root | reduce-scattered (summed) over the world |

Why all W ranks for the non-expert parameters: every rank computes with all of them, on
its own tokens, so they shard over whoever trains; sharding them only over ``dp_shard``
would leave P copies. Why the experts' FSDP2 shards split the expert dimension: each rank's
shard is whole experts, so no MX block (32 elements along the contraction dimension of
either expert GEMM: K for the forward, N within one expert for the dgrad) crosses a shard
boundary (:mod:`mxmoe.distributed.mx_gather`), and the checkpoint's global view of an
expert weight is a plain concatenation. Hence the rule: E divisible by D x P. With
``mx_weight_gather`` the experts leave FSDP2 and are gathered as MXFP8 codes + scales
(:func:`~mxmoe.distributed.mx_gather.gather_experts_as_mxfp8`), in the same shard layout.

Gradients are sums, not means: each rank backpropagates its share of the global batch's
loss (:func:`~mxmoe.distributed.ep.loss_share`, divided by the global token count), so
every FSDP2 module is set to ``set_gradient_divide_factor(1.0)``. The routers need no
other care: the FSDP2 module around each router is called by the layer's forward, and the
expert-parallel layer itself is the FSDP2 module of its experts (its pre-forward hook
all-gathers them before the fused MXFP8 op reads ``experts.w13`` directly).

Batch: the global batch of B sequences splits over all W ranks in rank order
(:func:`~mxmoe.distributed.batch.rank_slice` with W), and the load-balancing loss uses the
whole batch's counts (the layer's ``batch_group`` sums them over ``dp_shard``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from .ep import ExpertParallelMoELayer, shard_experts
from .mx_gather import gather_experts_as_mxfp8

MESH_DIM_NAMES = ("dp_shard", "ep")


@dataclass(frozen=True)
class ExpertParallelMesh:
    """The meshes of one 2-D run and this rank's place in them.

    Attributes:
        mesh: the 2-D DeviceMesh (D, P), dims ``("dp_shard", "ep")``.
        world: a 1-D DeviceMesh of all W ranks in rank order (the non-expert FSDP2 shards).
        experts_in_order: a 1-D DeviceMesh of all W ranks ordered by the expert shard each
            holds (position c holds experts c*E/W .. (c+1)*E/W - 1): the global view of
            an expert weight in checkpoints, ``Shard(0)`` over it.
        dp_shard, ep: D and P. dp_rank, ep_rank: this rank's coordinates.
    """

    mesh: DeviceMesh
    world: DeviceMesh
    experts_in_order: DeviceMesh
    dp_shard: int
    ep: int
    dp_rank: int
    ep_rank: int

    @property
    def ep_group(self):
        """The expert-parallel process group of this rank (P ranks)."""
        return self.mesh.get_group("ep")

    @property
    def dp_group(self):
        """The data-parallel shard process group of this rank (D ranks)."""
        return self.mesh.get_group("dp_shard")

    @property
    def world_size(self) -> int:
        """W = D x P."""
        return self.dp_shard * self.ep

    @property
    def shape_text(self) -> str:
        """``"DxP"``, the mesh as the docs write it (data-parallel shard x expert parallel)."""
        return f"{self.dp_shard}x{self.ep}"


def check_mesh_shape(dp_shard: int, ep: int, world_size: int) -> None:
    """Refuse a mesh that does not match the launch.

    Raises:
        ValueError: D or P not a positive integer, or D x P != the number of processes.
    """
    for name, v in (("--data-parallel-shard", dp_shard), ("--expert-parallel", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if dp_shard * ep != world_size:
        raise ValueError(f"the mesh --data-parallel-shard {dp_shard} x --expert-parallel {ep} = {dp_shard * ep} ranks, "
                         f"but {world_size} processes were launched; use torchrun --nproc-per-node {dp_shard * ep} "
                         f"or a mesh whose product is {world_size}")


def init_mesh(dp_shard: int, ep: int, device_type: str) -> ExpertParallelMesh:
    """Build the meshes of a (D, P) run on the default process group (every rank calls it).

    Args:
        dp_shard: D. ep: P. device_type: "cuda" or "cpu".

    Returns:
        :class:`ExpertParallelMesh`.

    Raises:
        ValueError: D x P != the world size (:func:`check_mesh_shape`).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    check_mesh_shape(dp_shard, ep, world)
    mesh = init_device_mesh(device_type, (dp_shard, ep), mesh_dim_names=MESH_DIM_NAMES)
    world_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("world",))
    # position c = p * D + d holds expert shard c: rank d * P + p
    order = torch.arange(world).view(dp_shard, ep).t().reshape(-1)
    experts_in_order = DeviceMesh(device_type, order, mesh_dim_names=("experts",))
    return ExpertParallelMesh(mesh, world_mesh, experts_in_order, dp_shard, ep, rank // ep, rank % ep)


def shard_model(model: nn.Module, mesh: ExpertParallelMesh, mx_dispatch: bool | None = None,
                mx_weight_gather: bool = False) -> list[ExpertParallelMoELayer]:
    """Spread ``model`` over the mesh in place: experts over ``ep``, then FSDP2 (module
    docstring's table). Build ``model`` identically on every rank first (same seed) and
    move it to the rank's device.

    Args:
        model: a :class:`~mxmoe.models.MoETransformer` (any module whose MoE layers are
            :class:`~mxmoe.nn.moe.MoELayer`; ``blocks``, if present, are sharded one by one).
        mesh: from :func:`init_mesh`. mx_dispatch: as :func:`~mxmoe.distributed.ep.shard_experts`.
        mx_weight_gather: shard the experts over ``dp_shard`` without FSDP2 and gather them
            as MXFP8 codes + scales in each forward
            (:func:`~mxmoe.distributed.mx_gather.gather_experts_as_mxfp8`; needs a
            quantizing recipe and a weight-copy cache open around forward and backward).

    Returns:
        The expert-parallel layers (now FSDP2 modules), in module order.

    Raises:
        ValueError: an MoE layer's E not divisible by D x P (each FSDP2 shard holds whole
            experts).
    """
    layers = shard_experts(model, group=mesh.ep_group, mx_dispatch=mx_dispatch,
                           batch_group=mesh.dp_group if mesh.dp_shard > 1 else None)
    modules: list[nn.Module] = []
    ignored: dict[int, nn.Parameter] = {}  # expert shards gathered as MXFP8, outside FSDP2
    for layer in layers:
        if layer.n_local % mesh.dp_shard:
            raise ValueError(f"{layer.n_experts} experts do not split over the mesh {mesh.shape_text} "
                             f"(--data-parallel-shard x --expert-parallel = {mesh.world_size} ranks): each rank's "
                             f"shard holds whole experts; use a number of experts divisible by {mesh.world_size}")
        for sub in (layer.router, layer.shared):
            if sub is not None:
                fully_shard(sub, mesh=mesh.world)
                modules.append(sub)
        if mx_weight_gather:
            gather_experts_as_mxfp8(layer, layer.recipe, mesh.dp_group, mesh.dp_rank)
            ignored.update({id(p): p for p in layer.experts.parameters()})
        else:
            fully_shard(layer, mesh=mesh.mesh["dp_shard"])  # manages what is left: experts.w13, experts.w2
            modules.append(layer)

    def ignored_in(module: nn.Module) -> dict:
        mine = {p for p in module.parameters() if id(p) in ignored}
        return {"ignored_params": mine} if mine else {}

    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh.world, **ignored_in(block))
        modules.append(block)
    fully_shard(model, mesh=mesh.world, **ignored_in(model))
    modules.append(model)
    for m in modules:
        m.set_gradient_divide_factor(1.0)  # sums: the losses are shares of the global batch's
        # plain SUM collectives (gloo has no PREMUL_SUM, which a factor of 1 would ask for)
        m.set_force_sum_reduction_for_comms(True)
    return layers


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, ``t`` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, group=None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a model sharded by :func:`shard_model`.

    Every element of every gradient lives on exactly one rank (FSDP2 shards partition
    each tensor; experts are split over ``ep`` and sharded over ``dp_shard``), so the
    global norm is sqrt(all-reduce over the world of each rank's sum of squares): one
    all-reduce of a float32 scalar. Gradients are then scaled by
    min(1, max_norm / (norm + 1e-6)), torch's rule.

    Args:
        params: the model's parameters (DTensors or tensors), grads reduced already.
        max_norm: the bound (``inf``: only the norm). group: the world (None: default).

    Returns:
        The global norm before clipping, float32 0-d tensor, identical on every rank.
    """
    locals_ = [local_tensor(p.grad) for p in params if p.grad is not None]
    device = locals_[0].device if locals_ else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in locals_:
        sq = sq + torch.linalg.vector_norm(g.float()).pow(2)
    dist.all_reduce(sq, group=group)
    total = sq.sqrt()
    clip = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in locals_:
        g.mul_(clip.to(g.dtype))
    return total


def global_expert_view(t: Tensor, mesh: ExpertParallelMesh, n_experts: int) -> DTensor:
    """An expert tensor of this rank (a DTensor over ``dp_shard`` whose global shape is the
    L experts of this rank's ``ep`` group, or its local (E/W, ...) shard) as a DTensor over
    :attr:`ExpertParallelMesh.experts_in_order` with the whole (E, ...) shape: the view a
    checkpoint stores, so that another mesh (or one process) reads its own experts from it.
    Shares storage with ``t``'s local shard (loading into it writes the shard).

    Raises:
        ValueError: the local shard does not hold E / W experts.
    """
    local = local_tensor(t)
    per = n_experts // mesh.world_size
    if local.shape[0] != per:
        raise ValueError(f"an expert shard of {local.shape[0]} experts; expected {n_experts} / {mesh.world_size} = "
                         f"{per}")
    shape = (n_experts, *local.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh.experts_in_order, [Shard(0)], run_check=False, shape=shape, stride=stride)
