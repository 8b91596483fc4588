"""FSDP2 x expert parallel on two GPUs: tokens/s and peak memory per GPU of the 2-D mesh
runs 2x1 and 1x2 (data-parallel shard x expert parallel), against one GPU.

    torchrun --nproc-per-node 2 benchmarks/fsdp_expert_parallel.py --preset h200        # 2 GPUs, NCCL
    PYTHONPATH=src python3 benchmarks/fsdp_expert_parallel.py --smoke   # CPU, gloo, tiny model

Started without torchrun (as ``--smoke`` in tests/test_benchmark_scripts.py), the script
launches itself with ``torchrun --nproc-per-node 2`` and returns its exit status. One
torchrun launch of 2 processes runs, in turn:

- ``1 GPU``: rank 0 alone trains the single-process model (:class:`mxmoe.train.step.TrainStep`,
  eager) on ``batch_size`` sequences per step; rank 1 waits;
- ``mesh 2x1``: FSDP2 over both ranks for every parameter, each rank running all E experts
  (its FSDP2 shard holds E / 2 of them); global batch 2 x ``batch_size``;
- ``mesh 1x2``: the experts split over the two ranks (expert parallel), FSDP2 for the
  non-expert parameters over both; global batch 2 x ``batch_size``;
- ``mesh 2x1 + MXFP8 weight gather``: as mesh 2x1, the experts gathered as MXFP8 codes +
  scales instead of by FSDP2 (``--mx-weight-gather``; MXFP8 recipes only).

The mesh runs step with :class:`mxmoe.train.fsdp_step.FSDPExpertParallelStep` (the step of
``mxmoe train --data-parallel-shard D --expert-parallel P``); the per-GPU batch is the same
in all three (weak scaling), so tokens/s per GPU compare directly. Each run does
``--warmup`` steps then ``--steps`` timed ones (wall time between two host synchronizations,
median); peak memory is ``torch.cuda.max_memory_allocated`` of each rank over the run
(reset before it). As a check, each mesh run's step-1 loss must equal, to ``STEP1_RTOL``,
the cross entropy of the initial single-process model on the same global batch (rank 0
computes it before the runs); the script exits non-zero after writing its results when not.

The result goes to ``<results dir>/fsdp_expert_parallel.json`` (rank 0; per run and per rank:
ms/step, tokens/s per GPU, peak GiB). Not run yet on two H200s: no figure of it is quoted in
the docs.

Presets: ``h200`` (the model of ``mxmoe train --preset h200``), ``default`` (``mxmoe train``'s
defaults), ``smoke`` (tiny, CPU).
"""

from __future__ import annotations

import argparse
import statistics
import os
import sys
import time

import harness
import torch
import torch.distributed as dist

SUBJECT = "fsdp_expert_parallel"
PRESETS = {
    "default": dict(layers=4, width=256, heads=4, experts=8, top_k=2, expert_width=128, seq_len=256, batch_size=16),
    "h200": dict(layers=8, width=512, heads=8, experts=32, top_k=2, expert_width=512, seq_len=512, batch_size=32),
    "smoke": dict(layers=2, width=64, heads=2, experts=4, top_k=2, expert_width=64, seq_len=32, batch_size=2),
}
# (data-parallel shard, expert parallel, experts gathered as MXFP8: --mx-weight-gather)
MESHES = ((2, 1, False), (1, 2, False), (2, 1, True))
# step-1 loss of a mesh run against the single-process model on the same global batch:
# as STEP1_RTOL of benchmarks/expert_parallel.py (CPU: the shares' summation order; CUDA:
# GEMMs of other shapes leave bf16 activations an ulp apart in places)
STEP1_RTOL = {"cpu": 1e-5, "cuda": 1e-3}


def _model_config(shape: dict):
    from mxmoe.models import ModelConfig

    return ModelConfig(d_model=shape["width"], n_layers=shape["layers"], n_heads=shape["heads"],
                       n_experts=shape["experts"], top_k=shape["top_k"], d_expert=shape["expert_width"],
                       max_seq_len=shape["seq_len"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args, shape: dict, device: torch.device, corpus, mesh_shape: tuple[int, int] | None,
        mx_weight_gather: bool = False) -> dict:
    """One training run: the single process (``mesh_shape`` None, rank 0 only) or a mesh."""
    from mxmoe.distributed.batch import rank_slice
    from mxmoe.distributed.mesh import init_mesh, shard_model
    from mxmoe.models import MoETransformer
    from mxmoe.recipe import get_recipe
    from mxmoe.train.data import random_batch
    from mxmoe.train.fsdp_step import FSDPExpertParallelStep
    from mxmoe.train.step import TrainStep
    from mxmoe.train.trainer import TrainConfig, make_optimizer

    W = 1 if mesh_shape is None else mesh_shape[0] * mesh_shape[1]
    rank = dist.get_rank() if W > 1 else 0
    cfg = TrainConfig(recipe=args.recipe, batch_size=shape["batch_size"] * W, seq_len=shape["seq_len"],
                      steps=args.warmup + args.steps, warmup_steps=1, progress=False, model=_model_config(shape))
    torch.manual_seed(0)
    model = MoETransformer(cfg.model, get_recipe(args.recipe)).to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    tokens = cfg.batch_size * cfg.seq_len
    if mesh_shape is None:
        opt = make_optimizer(model, cfg)
        step_fn = TrainStep(model, opt, cfg.grad_clip, device, cuda_graph=False)
    else:
        shard_model(model, init_mesh(*mesh_shape, device.type), mx_weight_gather=mx_weight_gather)
        opt = make_optimizer(model, cfg)
        step_fn = FSDPExpertParallelStep(model, opt, cfg.grad_clip, device, tokens, cfg.model.aux_loss_coef,
                                         cfg.model.z_loss_coef, weight_cache=mx_weight_gather)
    step_s, losses = [], []
    for step in range(1, cfg.steps + 1):
        x, y = random_batch(corpus.train, cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(step))
        x, y = rank_slice(x, rank, W).to(device), rank_slice(y, rank, W).to(device)
        _sync(device)
        t0 = time.perf_counter()
        losses.append(step_fn(x, y, 3e-3).ce_loss.item())
        _sync(device)
        if step > args.warmup:
            step_s.append(time.perf_counter() - t0)
    med = statistics.median(step_s)
    return {"mesh": None if mesh_shape is None else list(mesh_shape), "mx_weight_gather": mx_weight_gather,
            "rank": rank, "ms_per_step_median": med * 1e3,
            "tokens_per_step_global": tokens, "tokens_per_s_per_gpu": tokens / W / med, "loss_step1": losses[0],
            "loss_last": losses[-1],
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def launch_self(argv: list[str]) -> int:
    """Run this script under ``torchrun --nproc-per-node 2`` (a free local port)."""
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), __file__, *argv]
    return subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "RANK" not in os.environ:
        return launch_self(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="h200", choices=list(PRESETS))
    p.add_argument("--recipe", default="mxfp8")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    p.add_argument("--data", default=None, help="corpus (default: the Python standard library's source)")
    harness.add_common_args(p, timing=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.steps, args.warmup = "smoke", 2, 1
    from mxmoe.distributed.launch import init_expert_parallel
    from mxmoe.train.data import load_corpus

    env_dist = init_expert_parallel(2, "cpu" if args.smoke else "cuda")  # torchrun --nproc-per-node 2
    device, rank = env_dist.device, env_dist.rank
    if device.type == "cpu":
        torch.set_num_threads(1)
    shape = PRESETS[args.preset]
    corpus = load_corpus(args.data)
    results = []
    reference = None
    if rank == 0:  # the single GPU, and the step-1 reference of the mesh runs (their global batch)
        results.append(run(args, shape, device, corpus, None))
        from mxmoe.models import MoETransformer
        from mxmoe.recipe import get_recipe
        from mxmoe.train.data import random_batch

        torch.manual_seed(0)
        model = MoETransformer(_model_config(shape), get_recipe(args.recipe)).to(device)
        x, y = random_batch(corpus.train, shape["batch_size"] * 2, shape["seq_len"], torch.Generator().manual_seed(1))
        with torch.no_grad():
            reference = model(x.to(device), y.to(device)).ce_loss.item()
        del model
    dist.barrier()
    for D, P, mx_gather in MESHES:
        if mx_gather and args.recipe == "bf16":
            continue
        mesh_shape = (D, P)
        mine = run(args, shape, device, corpus, mesh_shape, mx_gather)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        if rank == 0:
            results.append({"mesh": list(mesh_shape), "mx_weight_gather": mx_gather, "per_rank": per_rank,
                            "tokens_per_s_per_gpu": per_rank[0]["tokens_per_s_per_gpu"],
                            "ms_per_step_median": max(r["ms_per_step_median"] for r in per_rank),
                            "loss_step1": per_rank[0]["loss_step1"]})
    status = 0
    if rank == 0:
        env = harness.environment()
        print(harness.title("FSDP2 x expert parallel, meshes 2x1 and 1x2, against one GPU", env, args,
                            timing="timing: median wall time per step"), flush=True)
        base = results[0]["tokens_per_s_per_gpu"]
        tokens_gpu = shape["batch_size"] * shape["seq_len"]
        rows, checks, body = [], [], []
        for r in results:
            name = "1 GPU" if r["mesh"] is None else f"mesh {r['mesh'][0]}x{r['mesh'][1]}" + (
                " + MXFP8 weight gather" if r["mx_weight_gather"] else "")
            mems = [q["peak_mem_gib"] for q in r.get("per_rank", [r])]
            body.append([name, f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['tokens_per_s_per_gpu'] / base:.2f}x",
                         f"{r['ms_per_step_median']:.1f}",
                         " / ".join("-" if m is None else f"{m:.2f}" for m in mems)])
            rows.append(harness.Row(name, f"{tokens_gpu} tokens per GPU per step",
                                    1e6 / r["tokens_per_s_per_gpu"] * tokens_gpu, 1e6 / base * tokens_gpu,
                                    note="us per step per GPU", extra=r))
            if r["mesh"] is not None:
                rel = abs(r["loss_step1"] - reference) / abs(reference)
                checks.append({"run": name, "step1_loss": r["loss_step1"], "reference": reference, "rel": rel,
                               "ok": rel <= STEP1_RTOL[device.type]})
                status |= not checks[-1]["ok"]
        print(harness.format_table(["run", "tokens/s per GPU", "x 1 GPU", "ms/step", "peak GiB per rank"], body))
        print(f"step-1 loss check ({'ok' if not status else 'FAILED'}): {checks}")
        harness.write_results(SUBJECT, args, env, rows, {"preset": args.preset, "shape": shape, "runs": results,
                                                         "step1_checks": checks})
    dist.barrier()
    return int(status)


if __name__ == "__main__":
    # leave without tearing the gloo/NCCL group down: a rank's interpreter teardown could
    # free an exchange's work handle after the group (a C++ std::terminate seen once in CI,
    # after the results were written); every rank has passed the barrier, nothing is pending
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
