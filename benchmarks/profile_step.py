"""Where the time of one training step goes, per recipe (issue 5): wall time against GPU time.

Builds the model of ``mxmoe train --preset h200`` (or the flags given), runs warm-up steps,
then times ``--steps`` steps three ways in the same process:

- wall: perf_counter around each step, synchronized at the end of the step (what the
  trainer reports as ms/step);
- GPU: CUDA events around the same steps; on a host-bound step the GPU waits for the CPU
  and GPU time ~ wall time, so the kernel sum from the profiler is printed as well;
- the top CUDA kernels and CPU ops of the profiled steps (torch.profiler).

Usage (repo root): PYTHONPATH=src python3 benchmarks/profile_step.py --recipes bf16,mxfp8 [train flags]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch.autograd import DeviceType

from mxmoe.cli import add_train_arguments, config_from_args
from mxmoe.cli.presets import parse_with_preset
from mxmoe.model.transformer import MoETransformer
from mxmoe.recipe import get_recipe
from mxmoe.training.step import TrainStep
from mxmoe.training.trainer import make_optimizer


def build_args(argv):
    def parser():
        p = argparse.ArgumentParser()
        add_train_arguments(p)
        p.add_argument("--recipes", default="bf16,mxfp8")
        p.add_argument("--warmup", type=int, default=8)
        p.add_argument("--timed", type=int, default=20)
        p.add_argument("--top", type=int, default=25)
        p.add_argument("--json", default=None)
        return p

    return parse_with_preset(parser, argv, default="h200")[0]


def main(argv=None):
    args = build_args(sys.argv[1:] if argv is None else argv)
    dev = torch.device("cuda")
    results = {}
    for name in args.recipes.split(","):
        args.recipe = name
        cfg = config_from_args(args, 256)
        torch.manual_seed(0)
        model = MoETransformer(cfg.model, get_recipe(name)).to(dev)
        # the trainer's step, eager: the launch cost is what this script measures
        step = TrainStep(model, make_optimizer(model, cfg), cfg.grad_clip, dev, cuda_graph=False)
        x = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device=dev)
        y = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device=dev)
        for _ in range(args.warmup):
            step(x, y, cfg.lr)
        torch.cuda.synchronize()
        walls = []
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(args.timed):
            t = time.perf_counter()
            out = step(x, y, cfg.lr)
            out.ce_loss.item()
            walls.append(time.perf_counter() - t)
        e1.record()
        torch.cuda.synchronize()
        wall_ms = 1e3 * sum(walls) / len(walls)
        gpu_ms = e0.elapsed_time(e1) / args.timed
        # CPU time to enqueue one step when the GPU never waits: time without the final sync
        # is not separable here, so the profiler's kernel sum is the GPU-busy figure
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(x, y, cfg.lr)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        # the kernels themselves (device-side events); the CPU-side ops that launched them
        # carry the same time as their own "Self CUDA" and are left out
        kernels = [e for e in ka if e.device_type == DeviceType.CUDA]
        dev_self = sum(e.self_device_time_total for e in kernels) / 3
        n_kernels = sum(e.count for e in kernels) / 3
        print(f"\n=== {name}: wall {wall_ms:.2f} ms/step | CUDA-event {gpu_ms:.2f} ms/step | kernel sum "
              f"{dev_self / 1e3:.2f} ms/step | {n_kernels:.0f} kernels/step")
        print(ka.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=70))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=70))
        results[name] = {"wall_ms": wall_ms, "event_ms": gpu_ms, "kernel_ms": dev_self / 1e3,
                         "kernels_per_step": n_kernels}
        del model, step
        torch.cuda.empty_cache()
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
