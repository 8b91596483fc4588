"""One rank of the two-GPU check of the padded dispatch (tests/distributed/test_ep_cuda_graph.py
starts 2 of these with NCCL). Writes ``OUT/rank{r}.json``; asserts nothing but crashes.

1. ``torch.cuda.set_sync_debug_mode("error")`` around an eager forward and backward of the
   expert-parallel layer (padded dispatch, mxfp8, a shared expert, overlap on): any
   synchronizing CUDA call raises.
2. The forward and backward captured in a CUDA graph (after an eager warm-up on a side
   stream), replayed on new inputs copied into the static input, against eager runs on
   the same inputs: output, input gradient and expert gradients.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from mxmoe.distributed import ExpertParallelMoELayer
from mxmoe.nn.moe import MoELayer
from mxmoe.recipe import get_recipe

D, E, K, F, SHARED, T = 512, 32, 2, 512, 512, 4096


def eager(ep, x):
    for p in ep.parameters():
        p.grad = None
    xr = x.clone().requires_grad_()
    y, aux = ep(xr)
    (y.float().square().mean() + 0.01 * aux.aux_loss).backward()
    return y.detach().clone(), xr.grad.clone(), {n: p.grad.clone() for n, p in ep.named_parameters()}


def main() -> int:
    out = Path(json.loads(Path(sys.argv[1]).read_text())["out"])
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    dev = torch.device("cuda", rank)
    res: dict = {}
    try:
        torch.manual_seed(0)
        layer = MoELayer(D, E, K, F, 8, get_recipe("mxfp8"), shared_expert_hidden=SHARED)
        ep = ExpertParallelMoELayer(copy.deepcopy(layer)).to(dev)
        gen = torch.Generator(device=dev).manual_seed(1 + rank)
        xs = [torch.randn(T, D, device=dev, generator=gen).to(torch.bfloat16) for _ in range(3)]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            ref = [eager(ep, x) for x in xs]  # warm-up (Triton compilation) and references
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager(ep, xs[0])
            res["sync_free"] = True
        except RuntimeError as err:
            res["sync_free"] = False
            res["sync_error"] = str(err).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize(dev)
        static_x = xs[0].clone().requires_grad_()
        for p in ep.parameters():
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            y, aux = ep(static_x)
            (y.float().square().mean() + 0.01 * aux.aux_loss).backward()
        checks = []
        for x, (y_ref, dx_ref, g_ref) in zip(xs, ref):
            with torch.no_grad():
                static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize(dev)
            checks.append({
                "y_equal": torch.equal(y, y_ref),
                "dx_rel": ((static_x.grad - dx_ref).abs().max() / dx_ref.abs().max()).item(),
                "experts_rel": max(((p.grad - g_ref[n]).abs().max() / g_ref[n].abs().max()).item()
                                   for n, p in ep.named_parameters() if n.startswith("experts.")),
            })
        res["replays"] = checks
        res["overlapped"] = ep.last_overlapped
    except Exception:
        res["error"] = traceback.format_exc()
        (out / f"rank{rank}.json").write_text(json.dumps(res))
        os._exit(1)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
