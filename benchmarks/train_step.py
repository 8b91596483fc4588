"""Train steps per second of ``mxmoe train --preset h200``'s model: bf16 against MXFP8.

The model of the h200 preset (:data:`mxmoe.cli.presets.PRESETS`: 8 blocks, width 512, 8
heads, 32 SwiGLU experts of width 512, top-2, 32 x 512 tokens per step) trained with the
library's own step (:class:`mxmoe.train.step.TrainStep`: forward, backward, gradient
clipping, AdamW; replayed from a CUDA graph after the first step unless
``--no-cuda-graph``) and optimizer (:func:`mxmoe.train.trainer.make_optimizer`), on
random byte tokens, one recipe after the other in one process from the same seed.

``--warmup`` untimed steps (the first runs eagerly, the second is captured), then
``--steps`` steps timed together between two synchronizations: ms/step, steps/s,
tokens/s, model TFLOP/s (``MoETransformer.flops_per_token``), the peak memory and the last
loss (checked finite). "x bf16" = MXFP8 steps/s / bf16 steps/s.

    PYTHONPATH=src python3 benchmarks/train_step.py [--quick] [--steps N] [--recipes bf16,mxfp8]
    PYTHONPATH=src python3 benchmarks/train_step.py --smoke          # CPU, a tiny model
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import harness

SMOKE = harness.interpret_triton_if_smoke()

import torch  # noqa: E402

from mxmoe.cli.presets import PRESETS  # noqa: E402
from mxmoe.models import ModelConfig, MoETransformer  # noqa: E402
from mxmoe.recipe import RECIPES, get_recipe  # noqa: E402
from mxmoe.train.step import TrainStep  # noqa: E402
from mxmoe.train.trainer import TrainConfig, make_optimizer  # noqa: E402

SUBJECT = "train_step"
VOCAB = 256
SMOKE_SHAPE = dict(layers=2, width=64, heads=2, experts=4, top_k=2, expert_width=64, batch_size=2, seq_len=32)


def model_shape(args: argparse.Namespace) -> dict:
    """The preset's model and batch flags (``--smoke``: a tiny model)."""
    if args.smoke:
        return dict(SMOKE_SHAPE)
    preset = PRESETS["h200"]
    shape = {k: preset[k] for k in ("layers", "width", "heads", "experts", "top_k", "expert_width", "batch_size",
                                    "seq_len")}
    if args.batch_size:
        shape["batch_size"] = args.batch_size
    return shape


def run_recipe(recipe_name: str, shape: dict, args, dev: torch.device) -> dict:
    """Warm-up and timed steps of one recipe; returns its figures."""
    mcfg = ModelConfig(vocab_size=VOCAB, d_model=shape["width"], n_layers=shape["layers"], n_heads=shape["heads"],
                       n_experts=shape["experts"], top_k=shape["top_k"], d_expert=shape["expert_width"],
                       max_seq_len=shape["seq_len"])
    tcfg = TrainConfig(recipe=recipe_name, batch_size=shape["batch_size"], seq_len=shape["seq_len"], model=mcfg,
                       device=str(dev))
    torch.manual_seed(0)
    recipe = get_recipe(recipe_name)  # "auto": the Triton kernels on CUDA, the pure-torch reference on the CPU
    model = MoETransformer(mcfg, recipe).to(dev)
    opt = make_optimizer(model, tcfg)
    step = TrainStep(model, opt, tcfg.grad_clip, dev, cuda_graph=not args.no_cuda_graph, log=print)
    g = torch.Generator().manual_seed(1)
    n_batches = 4
    batches = [tuple(torch.randint(0, VOCAB, (shape["batch_size"], shape["seq_len"]), generator=g).to(dev)
                     for _ in range(2)) for _ in range(n_batches)]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    warmup, steps = args.warmup, args.steps
    for i in range(warmup):
        step(*batches[i % n_batches], tcfg.lr)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for i in range(steps):
        outs = step(*batches[i % n_batches], tcfg.lr)
    loss = outs.ce_loss.item()  # synchronizes
    dt = (time.perf_counter() - t0) / steps
    tokens = shape["batch_size"] * shape["seq_len"]
    result = {"ms_per_step": dt * 1e3, "steps_per_s": 1 / dt, "tokens_per_s": tokens / dt,
              "model_tflops": model.flops_per_token(shape["seq_len"]) * tokens / dt / 1e12,
              "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
              "last_loss": loss, "cuda_graph": step.graphed, "params_M": model.num_params()["total"] / 1e6}
    if not math.isfinite(loss):
        raise FloatingPointError(f"{recipe_name}: loss {loss} after {warmup + steps} steps")
    del model, opt, step, batches
    harness.free_memory()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(p, timing=None)
    p.add_argument("--recipes", default="bf16,mxfp8", help="comma-separated; the first is the baseline "
                                                          "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per recipe (default: 50; --quick: 15)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: the preset's 32)")
    p.add_argument("--no-cuda-graph", action="store_true", help="eager steps (no CUDA-graph replay)")
    args = p.parse_args(argv)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    bad = [r for r in recipes if r not in RECIPES]
    if bad or not recipes:
        p.error(f"unknown recipe(s) {bad or args.recipes!r}; use {', '.join(RECIPES)}")
    if args.smoke:
        args.steps, args.warmup = 1, 2
    if args.steps is None:
        args.steps = 15 if args.quick else 50
    if args.steps < 1 or args.warmup < 2:
        p.error("--steps must be >= 1 and --warmup >= 2 (the first step runs eagerly, the second is captured)")
    dev = harness.device_for(args)
    env = harness.environment()
    print(harness.title("train steps of the h200 preset's model, bf16 against MXFP8", env, args,
                        timing="timing: wall clock over the timed steps, between two synchronizations"), flush=True)
    shape = model_shape(args)
    print(f"model and batch: {shape}; {args.warmup} warm-up + {args.steps} timed steps per recipe; "
          f"CUDA graph {'off' if args.no_cuda_graph else 'on'}", flush=True)
    res = {}
    for name in recipes:
        res[name] = run_recipe(name, shape, args, dev)
        print(f"  {name:18s} {res[name]['ms_per_step']:8.2f} ms/step  {res[name]['tokens_per_s']:12,.0f} tokens/s  "
              f"loss {res[name]['last_loss']:.4f}", flush=True)
    base = res[recipes[0]]
    rows, body = [], []
    for name in recipes:
        r = res[name]
        ratio = base["ms_per_step"] / r["ms_per_step"]
        body.append([name, f"{r['ms_per_step']:.2f}", f"{r['steps_per_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
                     f"{r['model_tflops']:.1f}", f"{ratio:.3f}x", harness.fmt(r["peak_mem_gib"], ".2f"),
                     f"{r['last_loss']:.4f}", str(r["cuda_graph"])])
        rows.append(harness.Row(name, f"{shape['batch_size']} x {shape['seq_len']} tokens", r["ms_per_step"] * 1e3,
                                base["ms_per_step"] * 1e3, flops=r["model_tflops"] * 1e12 * r["ms_per_step"] * 1e-3,
                                note=f"CUDA graph {r['cuda_graph']}", extra=r))
    print()
    print(harness.format_table(["recipe", "ms/step", "steps/s", "tokens/s", "model TFLOP/s", f"x {recipes[0]}",
                                "peak GiB", "last loss", "CUDA graph"], body))
    harness.write_results(SUBJECT, args, env, rows, {"baseline": f"{recipes[0]} recipe, same model and batches",
                                                     "model": shape})
    return 0


if __name__ == "__main__":
    sys.exit(main())
