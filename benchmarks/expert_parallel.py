"""Expert parallelism on two GPUs: tokens/s per GPU against one GPU, the all-to-all bytes
and time per step, and the exposed all-to-all time from a profiler trace.

    PYTHONPATH=src python3 benchmarks/expert_parallel.py             # 2 GPUs: presets h200, h200-shared
    PYTHONPATH=src python3 benchmarks/expert_parallel.py [--quick] [--presets default,large]
    PYTHONPATH=src python3 benchmarks/expert_parallel.py --smoke     # CPU, gloo, tiny model

The driver (this script without --worker) runs, per preset, four training runs of the
same model and recipe (one process, or torchrun with --nproc-per-node 2):

- ``1 GPU``: the single-process model, ``batch_size`` sequences per step;
- ``EP 2``: expert parallel over 2 ranks (E / 2 experts each), global batch 2 x
  ``batch_size`` (the same sequences per GPU: per-GPU throughput is comparable), the
  padded dispatch (no host sync; with a shared expert, the combine overlapped with it);
- ``EP 2 host-splits``: the same with the host-splits dispatch (one host sync per layer,
  no padding);
- ``EP 2 + MXFP8 dispatch``: padded, the dispatched rows sent as E4M3 codes + E8M0 scales.

Exposed communication (CUDA only): after the timed steps, ``--profile-steps`` more steps
run under ``torch.profiler`` (CUDA activity). From the trace's kernels: the all-to-all
time per step is the union of the NCCL SendRecv kernels' intervals (NCCL runs
all_to_all_single as grouped send/recv); the exposed part is the time within it when no
compute kernel (any non-NCCL kernel, on any stream) runs. The same for all NCCL kernels
(adding the gradient all-reduce and the count all-gather).

Every run steps with the library's step (:class:`mxmoe.train.step.TrainStep`, eager, for
one process; :class:`mxmoe.train.step.ExpertParallelStep` on each rank). The runs train
on different batches (B sequences against 2B), so their losses are not comparable step
for step. As a correctness check, the ``1 GPU`` run also evaluates its initial model (no
gradient, before step 1) on the EP runs' step-1 global batch; that cross entropy must
equal the EP runs' step-1 loss (all-reduced over the ranks) to ``STEP1_RTOL`` (relative);
the driver exits non-zero after writing its results if a run is outside.

Each run does ``--warmup`` steps, then ``--steps`` timed steps (wall time between two
host synchronizations per step, median). In the expert-parallel runs every collective of
the MoE layers is bracketed by CUDA events on the current stream (count all-gather,
dispatch, combine, and their backward exchanges) and so is the replicated-gradient
all-reduce; bytes are what each rank sends to the other rank. The table reports per step
and per rank: tokens/s per GPU, x 1 GPU, ms/step, dispatch (forward) MB and ms, all
all-to-all MB and ms, gradient all-reduce ms. The per-run logs and rank files go to
``--work-dir`` (default: a temporary folder); the result is ``<results dir>/expert_parallel.json``.

Presets (model shapes; --recipe mxfp8 by default):
- ``default``: ``mxmoe train``'s defaults (4 layers, width 256, 8 experts of width 128,
  top-2, 16 x 256 tokens per GPU): launch-bound.
- ``h200``: the model of ``mxmoe train --preset h200`` (8 layers, width 512, 32 experts).
- ``h200-shared``: ``h200`` with a shared expert of width 512 (what the combine overlaps).
- ``large``: 4 layers, width 2048, 16 heads, 16 experts of width 1024, top-2, 8 x 1024
  tokens per GPU: dispatch rows of 4 KiB (bf16) where the bytes matter.
- ``smoke``: tiny, for --smoke on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import torch

SUBJECT = "expert_parallel"
PRESETS = {
    "default": dict(layers=4, width=256, heads=4, experts=8, top_k=2, expert_width=128, seq_len=256, batch_size=16),
    "h200": dict(layers=8, width=512, heads=8, experts=32, top_k=2, expert_width=512, seq_len=512, batch_size=32),
    "h200-shared": dict(layers=8, width=512, heads=8, experts=32, top_k=2, expert_width=512, seq_len=512,
                        batch_size=32, shared=512),
    "large": dict(layers=4, width=2048, heads=16, experts=16, top_k=2, expert_width=1024, seq_len=1024, batch_size=8),
    "smoke": dict(layers=2, width=64, heads=2, experts=4, top_k=2, expert_width=64, seq_len=32, batch_size=2),
}
EP_RANKS = 2
# (label, ranks, MXFP8 dispatch, dispatch mode)
RUNS = (("1 GPU", 1, False, "padded"), (f"EP {EP_RANKS}", EP_RANKS, False, "padded"),
        (f"EP {EP_RANKS} host-splits", EP_RANKS, False, "host-splits"),
        (f"EP {EP_RANKS} + MXFP8 dispatch", EP_RANKS, True, "padded"))
# Step-1 loss, EP run against the single-process model on the same global batch (relative).
# CPU: the ranks' shares are added in another order than the single process's sum (a float32
# ulp or so). CUDA: the single process runs the 2B sequences in one forward and each rank B,
# so GEMMs of other shapes (other kernels and reduction orders) leave bf16 activations an
# ulp (2^-8) apart in places, which can flip E4M3 roundings and near-tied router choices for
# a few tokens; over the global batch of 8k-33k tokens those differences average out, well
# below 1e-3. What it catches: a loss scaled by 1/P (relative 0.5), a different init, a
# different batch.
STEP1_RTOL = {"cpu": 1e-5, "cuda": 1e-3}
A2A_KINDS = ("counts", "dispatch", "combine", "combine.grad", "dispatch.grad", "weights", "weights.grad")
MB = 1e6


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Total length of (union x) and (union y) overlapping; both sorted and disjoint."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposed_communication(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    """From GPU kernels (name, start, end) in microseconds: the union time of the NCCL
    all-to-all (SendRecv) kernels and of all NCCL kernels, and the part of each during
    which no compute (non-NCCL) kernel runs, in microseconds."""
    comm_all = _union([(a, b) for n, a, b in kernels if "nccl" in n.lower()])
    a2a = _union([(a, b) for n, a, b in kernels if "nccl" in n.lower() and "sendrecv" in n.lower()])
    compute = _union([(a, b) for n, a, b in kernels if "nccl" not in n.lower()])
    return {"a2a_us": _length(a2a), "a2a_exposed_us": _length(a2a) - _intersection(a2a, compute),
            "nccl_us": _length(comm_all), "nccl_exposed_us": _length(comm_all) - _intersection(comm_all, compute),
            "compute_us": _length(compute)}


def profile_kernels(step, n_steps: int) -> list[tuple[str, float, float]]:
    """Run ``step()`` n_steps times under torch.profiler (CUDA activity); the CUDA kernels'
    (name, start us, end us)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n_steps):
            step()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == DeviceType.CUDA]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- worker: one training run (one process, or one rank of torchrun) ------------------

def worker(args: argparse.Namespace) -> None:
    from mxmoe.distributed import CommStats, rank_slice, shard_experts
    from mxmoe.distributed.launch import init_expert_parallel
    from mxmoe.distributed.sync import all_reduce_grads
    from mxmoe.models import ModelConfig, MoETransformer
    from mxmoe.recipe import get_recipe
    from mxmoe.train.data import load_corpus, random_batch
    from mxmoe.train.step import ExpertParallelStep, TrainStep
    from mxmoe.train.trainer import TrainConfig, make_optimizer, resolve_device

    shape = PRESETS[args.preset]
    P = args.ranks
    model_cfg = ModelConfig(d_model=shape["width"], n_layers=shape["layers"], n_heads=shape["heads"],
                            n_experts=shape["experts"], top_k=shape["top_k"], d_expert=shape["expert_width"],
                            max_seq_len=shape["seq_len"], mx_dispatch=args.mx_dispatch,
                            shared_expert=shape.get("shared", 0))
    cfg = TrainConfig(recipe=args.recipe, batch_size=shape["batch_size"] * P, seq_len=shape["seq_len"],
                      steps=args.warmup + args.steps, warmup_steps=1, progress=False, device=args.device,
                      expert_parallel=P, model=model_cfg)
    cfg.validate()
    if P > 1:
        env = init_expert_parallel(P, args.device)
        device, rank = env.device, env.rank
    else:
        device, rank = resolve_device(args.device), 0
    corpus = load_corpus(args.data)
    torch.manual_seed(0)
    model = MoETransformer(model_cfg, get_recipe(args.recipe))
    stats = CommStats()
    if P > 1:
        shard_experts(model, comm_stats=stats, dispatch=args.dispatch)
    model = model.to(device)
    loss_step1_global = None
    if P == 1:  # the reference for the EP runs' step-1 loss: this model on their global batch
        gen = torch.Generator().manual_seed(1)  # the loop's step-1 generator
        x, y = random_batch(corpus.train, shape["batch_size"] * EP_RANKS, cfg.seq_len, gen)
        with torch.no_grad():
            loss_step1_global = model(x.to(device), y.to(device)).ce_loss.item()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    opt = make_optimizer(model, cfg)
    tokens = cfg.batch_size * cfg.seq_len

    def timed_all_reduce(params):
        n = sum(p.numel() * p.element_size() for p in params)
        with stats.record("grad_allreduce", n * (P - 1) // P * 2, n, device):  # ring: 2 (P-1)/P of the buffer
            all_reduce_grads(params)

    if P > 1:
        step_fn = ExpertParallelStep(model, opt, cfg.grad_clip, tokens, model_cfg.aux_loss_coef,
                                     model_cfg.z_loss_coef, grad_sync=timed_all_reduce)
    else:
        step_fn = TrainStep(model, opt, cfg.grad_clip, device, cuda_graph=False)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step_s, losses = [], []
    for step in range(1, cfg.steps + 1):
        if step == args.warmup + 1:
            stats.reset()
        gen = torch.Generator().manual_seed(step)
        x, y = random_batch(corpus.train, cfg.batch_size, cfg.seq_len, gen)
        x, y = rank_slice(x, rank, P).to(device), rank_slice(y, rank, P).to(device)
        sync()
        t0 = time.perf_counter()
        loss = step_fn(x, y, 3e-3).ce_loss.item()  # the global batch's loss on every rank
        sync()
        if step > args.warmup:
            step_s.append(time.perf_counter() - t0)
        losses.append(loss)
    if P > 1:
        loss_step1_global = losses[0]
    comm = {k: {kk: vv / args.steps for kk, vv in v.items()} for k, v in stats.summary().items()}
    exposed = None
    if device.type == "cuda" and args.profile_steps > 0:
        gen = torch.Generator().manual_seed(cfg.steps)
        x, y = random_batch(corpus.train, cfg.batch_size, cfg.seq_len, gen)
        x, y = rank_slice(x, rank, P).to(device), rank_slice(y, rank, P).to(device)
        kernels = profile_kernels(lambda: step_fn(x, y, 3e-3), args.profile_steps)
        exposed = {k: v / args.profile_steps / 1e3 for k, v in exposed_communication(kernels).items()}
        exposed = {k.replace("_us", "_ms"): v for k, v in exposed.items()}
    med = statistics.median(step_s)
    result = {
        "rank": rank, "ranks": P, "mx_dispatch": args.mx_dispatch, "preset": args.preset, "shape": shape,
        "recipe": args.recipe, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "ms_per_step_median": med * 1e3, "ms_per_step_mean": statistics.mean(step_s) * 1e3,
        "tokens_per_step_global": tokens, "tokens_per_s_per_gpu": tokens / P / med,
        "comm_per_step": comm, "loss_first": losses[0], "loss_last": losses[-1], "dispatch": args.dispatch,
        "profiled_per_step": exposed,
        "loss_step1_global": loss_step1_global,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    }
    out = Path(args.work_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.rank{rank}.json").write_text(json.dumps(result, indent=2))
    if P > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


# ---- driver -----------------------------------------------------------------------------

def run_one(args: argparse.Namespace, preset: str, label: str, P: int, mx: bool, dispatch: str) -> dict:
    tag = f"{preset}_{'single' if P == 1 else f'ep{P}'}{'_mx' if mx else ''}{'_host' if dispatch != 'padded' else ''}"
    common = [str(Path(__file__).resolve()), "--worker", "--preset", preset, "--ranks", str(P), "--tag", tag,
              "--work-dir", args.work_dir, "--recipe", args.recipe, "--steps", str(args.steps), "--warmup",
              str(args.warmup), "--device", args.device, "--dispatch", dispatch,
              "--profile-steps", str(args.profile_steps)] + (["--mx-dispatch"] if mx else []) \
        + (["--data", args.data] if args.data else [])
    if P == 1:
        cmd = [sys.executable] + common
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(P), "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port())] + common
    print(f"# {label} ({preset}): {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), text=True, capture_output=True,
                          timeout=args.timeout)
    log = Path(args.work_dir) / f"{tag}.log"
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"{label} ({preset}) failed with exit {proc.returncode}; log: {log}\n{proc.stderr[-3000:]}")
    ranks = [json.loads((Path(args.work_dir) / f"{tag}.rank{r}.json").read_text()) for r in range(P)]
    return {"label": label, "tag": tag, "wall_s": time.perf_counter() - t0, "ranks": ranks}


def summarize(run: dict) -> dict:
    """Per-step, per-rank figures (mean over the ranks; time: the slowest rank)."""
    ranks = run["ranks"]
    P = len(ranks)

    def comm(kinds, field, agg):
        vals = [sum(r["comm_per_step"].get(k, {}).get(field, 0.0) for k in kinds) for r in ranks]
        return agg(vals)

    prof = [r["profiled_per_step"] for r in ranks if r.get("profiled_per_step")]

    def prof_max(key):
        return max(p[key] for p in prof) if prof else None

    return {
        "a2a_kernel_ms": prof_max("a2a_ms"), "a2a_exposed_ms": prof_max("a2a_exposed_ms"),
        "nccl_kernel_ms": prof_max("nccl_ms"), "nccl_exposed_ms": prof_max("nccl_exposed_ms"),
        "label": run["label"], "ranks": P,
        "tokens_per_s_per_gpu": min(r["tokens_per_s_per_gpu"] for r in ranks),
        "ms_per_step": max(r["ms_per_step_median"] for r in ranks),
        "dispatch_mb": comm(("dispatch",), "bytes_remote", statistics.mean) / MB,
        "dispatch_ms": comm(("dispatch",), "ms", max),
        "a2a_mb": comm(A2A_KINDS, "bytes_remote", statistics.mean) / MB,
        "a2a_ms": comm(A2A_KINDS, "ms", max),
        "allreduce_ms": comm(("grad_allreduce",), "ms", max),
        "loss_first": ranks[0]["loss_first"], "loss_last": ranks[0]["loss_last"],
        "loss_step1_global": ranks[0]["loss_step1_global"], "device_type": ranks[0]["device"].split(":")[0],
    }


def driver(args: argparse.Namespace) -> int:
    env = harness.environment()
    print(harness.title("expert parallel over 2 ranks against one GPU", env, args,
                        timing="timing: median wall time per step; collectives by CUDA events"), flush=True)
    presets = ["smoke"] if args.smoke else args.presets.split(",")
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}; use {', '.join(PRESETS)}")
    report, rows, failed = {}, [], []
    for preset in presets:
        runs = [summarize(run_one(args, preset, label, P, mx, dispatch)) for label, P, mx, dispatch in RUNS]
        base = runs[0]
        rtol = STEP1_RTOL.get(base["device_type"], STEP1_RTOL["cuda"])
        for r in runs[1:]:
            r["loss_step1_rel_diff"] = abs(r["loss_step1_global"] - base["loss_step1_global"]) / \
                abs(base["loss_step1_global"])
            if not r["loss_step1_rel_diff"] <= rtol:
                failed.append(f"{preset} / {r['label']}: step-1 loss {r['loss_step1_global']:.6f}, single process "
                              f"on the same batch {base['loss_step1_global']:.6f}, relative difference "
                              f"{r['loss_step1_rel_diff']:.2e} > {rtol:g}")
        check = {"tolerance": rtol, "ok": all(r["loss_step1_rel_diff"] <= rtol for r in runs[1:])}
        report[preset] = {"shape": PRESETS[preset], "runs": runs, "step1_loss_check": check}
        body = []
        for r in runs:
            ep = r["ranks"] > 1

            def cell(v, spec):
                return f"{v:{spec}}" if ep else "-"

            body.append([r["label"], f"{r['tokens_per_s_per_gpu']:,.0f}",
                         f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}x", f"{r['ms_per_step']:.1f}",
                         cell(r["dispatch_mb"], ".2f"), cell(r["dispatch_ms"], ".2f"), cell(r["a2a_mb"], ".2f"),
                         cell(r["a2a_ms"], ".2f"), cell(r["allreduce_ms"], ".2f"),
                         harness.fmt(r["a2a_kernel_ms"], ".2f") if ep else "-",
                         harness.fmt(r["a2a_exposed_ms"], ".2f") if ep else "-",
                         f"{r['loss_step1_global']:.6f}", cell(r.get("loss_step1_rel_diff", 0.0), ".1e")])
            tokens_step = PRESETS[preset]["batch_size"] * PRESETS[preset]["seq_len"]
            rows.append(harness.Row(f"{preset} {r['label']}", f"{tokens_step} tokens per GPU per step",
                                    1e6 / r["tokens_per_s_per_gpu"] * tokens_step,
                                    1e6 / base["tokens_per_s_per_gpu"] * tokens_step, note="us per step per GPU",
                                    extra=r))
        print(f"\n### preset {preset}: {PRESETS[preset]}")
        print(harness.format_table(["run", "tokens/s per GPU", "x 1 GPU", "ms/step", "dispatch MB", "dispatch ms",
                                    "all-to-all MB", "all-to-all ms", "grad all-reduce ms", "a2a kernels ms",
                                    "a2a exposed ms", "step-1 loss, global batch",
                                    "rel. diff"], body))
        if runs[1]["dispatch_mb"]:
            print(f"MXFP8 dispatch sends {runs[3]['dispatch_mb'] / runs[1]['dispatch_mb']:.3f}x the bytes of bf16 "
                  f"dispatch and takes {runs[3]['dispatch_ms'] / max(runs[1]['dispatch_ms'], 1e-9):.2f}x its time "
                  f"(per step; forward dispatch only)")
        for r in runs[1:]:
            if r["a2a_kernel_ms"]:
                print(f"{r['label']}: all-to-all kernels {r['a2a_kernel_ms']:.2f} ms per step, exposed (no compute "
                      f"kernel running) {r['a2a_exposed_ms']:.2f} ms = {r['a2a_exposed_ms'] / r['a2a_kernel_ms']:.0%}")
        print(f"step-1 loss check ({'ok' if check['ok'] else 'FAILED'}): each EP run's step-1 loss (global batch, "
              f"all-reduced) against the 1 GPU model's cross entropy on that batch before step 1, relative "
              f"tolerance {rtol:g}")
    harness.write_results(SUBJECT, args, env, rows, {"presets": report, "work_dir": args.work_dir})
    if failed:
        print("step-1 loss check failed:\n" + "\n".join(failed), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(p, timing=None)
    p.add_argument("--presets", default=None,
                   help="comma-separated presets (default: h200,h200-shared; --quick: default)")
    p.add_argument("--recipe", default="mxfp8", help="precision recipe (MXFP8 dispatch needs a quantizing one)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per run (default: 20; --quick: 8; --smoke: 1)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if CUDA, else cpu), cuda or cpu")
    p.add_argument("--data", default=None, help="corpus (default: the Python standard library, as mxmoe train)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run before it is killed")
    p.add_argument("--work-dir", default=None, help="per-run logs and rank files (default: a temporary folder)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--preset", default="default", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--tag", default="run", help=argparse.SUPPRESS)
    p.add_argument("--mx-dispatch", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dispatch", default="padded", choices=["padded", "host-splits"], help=argparse.SUPPRESS)
    p.add_argument("--profile-steps", type=int, default=3,
                   help="steps profiled after the timed ones for the exposed all-to-all time (CUDA; 0: none)")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.device, args.steps, args.warmup = "cpu", 1, 1
    elif torch.cuda.device_count() < EP_RANKS:
        print(f"expert_parallel needs {EP_RANKS} GPUs, this machine has {torch.cuda.device_count()}; "
              f"--smoke runs it on the CPU with gloo", file=sys.stderr)
        return 2
    if args.steps is None:
        args.steps = 8 if args.quick else 20
    if args.presets is None:
        args.presets = "default" if args.quick else "h200,h200-shared"
    if args.work_dir is None:
        args.work_dir = tempfile.mkdtemp(prefix="mxmoe_ep_")
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
