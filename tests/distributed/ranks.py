"""The pieces the multi-process checks of this folder share.

Test side: :func:`run_ranks` starts P worker processes with torchrun's environment (gloo
on the CPU), waits with a hard timeout and reads back each rank's results. Rank side:
:func:`worker_main` is a worker script's main, :func:`interrupted_run` stops a run
mid-way as Ctrl-C would, and :func:`moe_layer` / :func:`routed_inputs` build the
single-process reference layer and its inputs (with a routing forced by feature 0).

A worker is a script taking one argument, a task JSON path (with ``"out"``); rank r writes
``OUT/rank{r}.json`` (its measurements, or ``{"error": traceback}``) and logs to
``OUT/rank{r}.log``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]


def moe_layer(D: int, E: int, K: int, F: int, recipe: str, mx_dispatch: bool = False, shared: int = 0,
              router_feature0: tuple[slice, float] | None = None):
    """The reference MoELayer (seed 0, 2 layers' init, weights x 10 for varied routing and
    outputs); ``router_feature0`` = (experts, value) sets those experts' router weight on
    feature 0, which :func:`routed_inputs` makes a large constant: value > 0 sends tokens
    to them, value < 0 keeps them away."""
    import torch

    from mxmoe.nn.moe import MoELayer
    from mxmoe.recipe import get_recipe

    torch.manual_seed(0)
    layer = MoELayer(D, E, K, F, 2, get_recipe(recipe), shared_expert_hidden=shared, mx_dispatch=mx_dispatch)
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(10)
        if router_feature0 is not None:
            experts, value = router_feature0
            layer.router.weight[experts, 0] = value
    return layer


def routed_inputs(P: int, tokens_per_rank: int, D: int, constant_feature0: bool):
    """(x (P * tokens_per_rank, D) bf16, the output gradient G (same shape) float32), seed
    1; with ``constant_feature0`` x's feature 0 is 4.0 (the routing of :func:`moe_layer`)."""
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(P * tokens_per_rank, D, generator=g).to(torch.bfloat16)
    if constant_feature0:
        x[:, 0] = 4.0
    return x, torch.randn(P * tokens_per_rank, D, generator=g)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: Path, task: Path, world_size: int, out: Path, timeout_s: float) -> list[dict]:
    """Run ``worker task`` as ranks 0..world_size-1 (one thread each), kill any still running
    after ``timeout_s``, and return the ranks' results in rank order.

    Fails the calling test (``pytest.fail``, with the rank's log or traceback) when a rank
    wrote no results or reported an error."""
    import pytest

    port = free_port()
    procs, logs = [], []
    for r in range(world_size):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world_size), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("TRITON_INTERPRET", None)
        log = open(out / f"rank{r}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(worker), str(task)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=ROOT))
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    results = []
    for r in range(world_size):
        path = out / f"rank{r}.json"
        if not path.exists():
            pytest.fail(f"rank {r} of {world_size} wrote no results (exit {procs[r].returncode}); log:\n"
                        + (out / f"rank{r}.log").read_text()[-4000:])
        res = json.loads(path.read_text())
        if "error" in res:
            pytest.fail(f"rank {r} of {world_size} failed:\n{res['error']}")
        results.append(res)
    return results


def worker_main(checks: Callable[[dict, Path], dict]) -> int:
    """A worker's main: join the gloo group (one thread), run ``checks(task, out)`` and
    write its dict to ``OUT/rank{r}.json``. On an exception, write the traceback there and
    exit at once (``os._exit``: the other ranks will never join the collectives this rank
    would wait in)."""
    import torch
    import torch.distributed as dist

    task = json.loads(Path(sys.argv[1]).read_text())
    out = Path(task["out"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = checks(task, out)
    except Exception:
        (out / f"rank{rank}.json").write_text(json.dumps({"error": traceback.format_exc()}))
        os._exit(1)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def interrupted_run(train, cfg, stop_before_step: int = 5) -> None:
    """``train(cfg)`` stopped as Ctrl-C would, when step ``stop_before_step`` starts (the
    trainer asks for its learning rate first): the run keeps its checkpoints up to then."""
    from mxmoe.train import trainer

    real_lr_at = trainer.lr_at

    def stop(step, c):
        if step == stop_before_step:
            raise KeyboardInterrupt
        return real_lr_at(step, c)

    trainer.lr_at = stop
    try:
        train(cfg)
    except KeyboardInterrupt:
        pass
    finally:
        trainer.lr_at = real_lr_at
