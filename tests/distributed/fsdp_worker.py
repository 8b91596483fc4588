"""One rank of the 2-D mesh checks (tests/distributed/test_fsdp_expert_parallel.py starts
W of these).

Run as ``python tests/distributed/fsdp_worker.py TASK_JSON`` with torchrun's environment.
The task says which meshes (D data-parallel shards x P expert-parallel ranks, D x P = W)
train which runs, which runs are interrupted and resumed on which meshes, and whether to
check the MXFP8 weight all-gather. Results (metrics lines, measured differences) go to
``OUT/rank{r}.json``; the tolerances live in the test file. Nothing is asserted here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from mxmoe.models import ModelConfig
from mxmoe.train import TrainConfig, train, trainer


def tiny_config(out: Path, data: str, recipe: str, dtype: str, mesh: list[int], steps: int) -> TrainConfig:
    """The model and run of the tests: 2 layers, width 64, 4 experts (divisible by every
    mesh's W <= 4), global batch 4 (divisible by W)."""
    model = ModelConfig(d_model=64, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_expert=64, max_seq_len=32,
                        dtype=dtype)
    D, P = mesh
    return TrainConfig(recipe=recipe, batch_size=4, seq_len=32, steps=steps, eval_interval=3, eval_batches=1,
                       ckpt_interval=3, warmup_steps=2, out_dir=str(out), data=data, progress=False, model=model,
                       expert_parallel=P, data_parallel_shard=D, device="cpu")


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def interrupted_run(cfg: TrainConfig) -> None:
    """Train ``cfg`` and stop every rank right after step 4 (the step-3 checkpoint is the latest)."""
    real_lr_at = trainer.lr_at

    def stop_at_5(step, c):
        if step == 5:
            raise KeyboardInterrupt
        return real_lr_at(step, c)

    trainer.lr_at = stop_at_5
    try:
        train(cfg)
    except KeyboardInterrupt:
        pass
    finally:
        trainer.lr_at = real_lr_at


def mesh_name(mesh: list[int]) -> str:
    return f"{mesh[0]}x{mesh[1]}"


def train_checks(tmp: Path, data: str, task: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    res: dict = {"runs": {}, "resumed": {}}
    for mesh in task.get("meshes", []):
        for recipe, dtype in task["runs"]:
            key = f"{mesh_name(mesh)}_{recipe}_{dtype}"
            train(tiny_config(tmp / key, data, recipe, dtype, mesh, task["steps"]))
            if rank == 0:
                res["runs"][key] = read_metrics(tmp / key)
    for spec in task.get("resume", []):
        recipe, dtype = spec["run"]
        source = Path(spec["source"]) if "source" in spec else tmp / f"interrupted_{mesh_name(spec['write'])}"
        if "source" not in spec:
            interrupted_run(tiny_config(source, data, recipe, dtype, spec["write"], task["steps"]))
        for mesh in spec["resume_on"]:
            target = tmp / f"resumed_{source.name}_on_{mesh_name(mesh)}"
            if rank == 0:
                shutil.copytree(source, target)
            dist.barrier()
            train(tiny_config(target, data, recipe, dtype, mesh, task["steps"]), resume=True)
            if rank == 0:
                latest = json.loads((target / "checkpoint.dcp" / "latest.json").read_text())
                res["resumed"][target.name] = {"metrics": read_metrics(target), "latest_step": latest["step"],
                                               "latest_mesh": latest["mesh"],
                                               "step_dirs": sorted(p.name for p in (target / "checkpoint.dcp").iterdir())}
    res["world"] = world
    return res


def main() -> int:
    task = json.loads(Path(sys.argv[1]).read_text())
    out = Path(task["out"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: dict = {}
    try:
        result["train"] = train_checks(out / "runs", task["data"], task)
    except Exception:
        result["error"] = traceback.format_exc()
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        os._exit(1)  # do not wait in collectives the other ranks will never join
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
