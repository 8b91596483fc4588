"""Expert parallelism on torch.distributed (torchrun; NCCL on GPUs, gloo on the CPU).

- :mod:`.ep`: :class:`ExpertParallelMoELayer` (count exchange, all-to-all dispatch and
  combine, padded (no host sync) or host-split sizes, local grouped GEMMs, MXFP8
  dispatch), :func:`shard_experts`, :func:`loss_share`.
- :mod:`.collectives`: the differentiable row all-to-all, the device count all-gather and
  :class:`CommStats`.
- :mod:`.sync`: replicated vs sharded parameters, gradient all-reduce, global-norm
  clipping, gathering and loading checkpoints.
- :mod:`.batch`: each rank's slice of the global batch, evaluation over the ranks.
- :mod:`.launch`: process group from torchrun's environment.
- :mod:`.mesh`: the 2-D DeviceMesh (data-parallel shard x expert parallel) and FSDP2
  sharding (:func:`~mxmoe.distributed.mesh.init_mesh`, :func:`~mxmoe.distributed.mesh.shard_model`).
- :mod:`.mx_gather`: all-gather of expert weight shards as MXFP8 codes + scales.

The training loop that uses these (``mxmoe train --expert-parallel P``, with
``--data-parallel-shard D`` on the mesh) is
:func:`mxmoe.train.train`, one loop for one process and for P ranks.
"""

from .batch import evaluate_expert_parallel, rank_slice
from .collectives import AllToAllRows, CommStats, all_to_all_rows, gather_counts
from .ep import (
    DispatchMode,
    ExpertParallelMoELayer,
    dispatch_capacity,
    expert_major_order,
    expert_parameter_names,
    loss_share,
    mx_row_bytes,
    pack_mx_rows,
    shard_experts,
    unpack_mx_rows,
)
from .launch import DistEnv, init_expert_parallel

__all__ = [
    "AllToAllRows",
    "CommStats",
    "DispatchMode",
    "DistEnv",
    "ExpertParallelMoELayer",
    "all_to_all_rows",
    "dispatch_capacity",
    "evaluate_expert_parallel",
    "expert_major_order",
    "expert_parameter_names",
    "gather_counts",
    "init_expert_parallel",
    "loss_share",
    "mx_row_bytes",
    "pack_mx_rows",
    "rank_slice",
    "shard_experts",
    "unpack_mx_rows",
]
