"""Process-group start-up from torchrun's environment.

``torchrun --nproc-per-node P -m mxmoe train --expert-parallel P ...`` starts P processes
with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set. Each rank uses
``cuda:LOCAL_RANK`` with NCCL when CUDA is there (or asked for), the CPU with gloo
otherwise. The expert-parallel group is the whole world: P = WORLD_SIZE (no data
parallelism across groups yet).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """Where this rank runs.

    Attributes:
        rank: global rank (0 logs and writes files). world_size: P.
        local_rank: rank on this machine (the CUDA device index).
        device: ``cuda:LOCAL_RANK`` or ``cpu``. backend: "nccl" or "gloo".
        owns_group: this call created the process group (and should destroy it).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    owns_group: bool

    @property
    def is_main(self) -> bool:
        """Rank 0 (the process that reports and writes files)."""
        return self.rank == 0


def launched_world_size() -> int:
    """WORLD_SIZE from the environment (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def is_main_process() -> bool:
    """True on rank 0 of a torchrun launch and in a plain process."""
    return os.environ.get("RANK", "0") == "0"


def resolve_rank_device(name: str, local_rank: int) -> torch.device:
    """The device of one rank: "auto" -> cuda:LOCAL_RANK if CUDA is available, else cpu;
    "cuda" -> cuda:LOCAL_RANK; "cpu".

    Raises:
        ValueError: "cuda:N" (each rank picks its own GPU), an unknown name, CUDA asked for
            and absent, or fewer GPUs than local ranks.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(f"--device {name!r} under expert parallelism: use auto, cpu or cuda "
                         f"(rank r uses cuda:LOCAL_RANK by itself)")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device; use --device cpu (gloo)")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible; "
                         f"use --nproc-per-node <= {torch.cuda.device_count()}")
    return torch.device("cuda", local_rank)


def init_expert_parallel(expert_parallel: int, device: str = "auto", data_parallel_shard: int = 0) -> DistEnv:
    """Start (or join) the default process group for ``expert_parallel`` ranks (or, with
    ``data_parallel_shard`` D >= 1, the D x P ranks of a 2-D mesh, :mod:`.mesh`).

    Args:
        expert_parallel: P; P (or D x P) must equal torchrun's WORLD_SIZE.
        device: "auto", "cpu" or "cuda" (:func:`resolve_rank_device`).
        data_parallel_shard: D of a 2-D mesh run; 0: no mesh (the expert-parallel group is
            the whole world).

    Returns:
        :class:`DistEnv`. If a default group exists already (a caller initialized it),
        it is used as it is and ``owns_group`` is False.

    Raises:
        ValueError: not launched by torchrun (environment variables missing), WORLD_SIZE
            differs from ``expert_parallel`` (times ``data_parallel_shard``), or a bad device.
    """
    ranks = expert_parallel * max(1, data_parallel_shard)
    flags = (f"--data-parallel-shard {data_parallel_shard} --expert-parallel {expert_parallel}" if data_parallel_shard
             else f"--expert-parallel {expert_parallel}")
    if dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        owns = False
    else:
        missing = [v for v in TORCHRUN_ENV if v not in os.environ]
        if missing:
            raise ValueError(f"{flags} runs one process per rank: launch with `torchrun --nproc-per-node {ranks} -m "
                             f"mxmoe train {flags} ...` (environment lacks {', '.join(missing)})")
        world, rank, local_rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        owns = True
    if data_parallel_shard and world != ranks:
        raise ValueError(f"{world} processes were launched but the mesh {flags} has {ranks} ranks; use torchrun "
                         f"--nproc-per-node {ranks}, or a mesh whose product is {world}")
    if not data_parallel_shard and world != expert_parallel:
        raise ValueError(f"{world} processes were launched but --expert-parallel is {expert_parallel}; "
                         f"use torchrun --nproc-per-node {expert_parallel} (the expert-parallel group is the "
                         f"whole world; data parallelism across groups is not implemented)")
    dev = resolve_rank_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if owns:
        dist.init_process_group(backend)
    elif dist.get_backend() != backend:
        raise ValueError(f"the existing process group uses {dist.get_backend()!r} but device {dev} needs {backend!r}")
    return DistEnv(rank, world, local_rank, dev, backend, owns)
