"""GPU check of the CUDA-graph train step (mxmoe.training.step): same numbers, speed, resume.

For each recipe, on the model of ``--preset h200`` (flags may override):

1. same numbers: copies of the model from one seed train ``--check-steps`` steps on the
   same batches, attention on the (deterministic) math backend: eager with the default
   AdamW, eager with the capturable AdamW twice, and graphed. Where the two eager runs
   are identical, graphed must equal them bit for bit (losses, gradient norms, every
   parameter after the last step); where they are not (ops with atomics), the graphed
   losses must stay within 4x the eager run-to-run spread. Eager-default is printed for
   scale.
2. speed: ms/step of eager and graphed steps (perf_counter, synchronized per step, after
   warm-up), and the MXFP8 / BF16 ratio of each mode.
3. resume: ``mxmoe.training.train`` for 12 steps with a checkpoint at step 6, against a
   run stopped right after that checkpoint and resumed: the losses of steps 7-12 must be
   equal.

Prints one PASS/FAIL line per check and exits 1 on any FAIL; ``--json`` writes the figures.
Usage (repo root): PYTHONPATH=src python3 benchmarks/check_cuda_graph.py [--json OUT] [train flags]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import subprocess
import sys
import tempfile
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from mxmoe.cli import add_train_arguments, config_from_args
from mxmoe.cli.presets import parse_with_preset
from mxmoe.model.transformer import MoETransformer
from mxmoe.recipe import get_recipe
from mxmoe.training.step import TrainStep, configure_optimizer
from mxmoe.training.trainer import make_optimizer


def parse(argv):
    def parser():
        p = argparse.ArgumentParser()
        add_train_arguments(p)
        p.add_argument("--recipes", default="bf16,mxfp8")
        p.add_argument("--check-steps", type=int, default=8)
        p.add_argument("--timed", type=int, default=30)
        p.add_argument("--json", default=None)
        p.add_argument("--no-resume", action="store_true", help="skip the resume check")
        return p

    return parse_with_preset(parser, argv, default="h200")[0]


def batches(cfg, n, dev):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), generator=g),
             torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), generator=g)) for _ in range(n)]


def run(model, cfg, dev, data, mode, n_sched=None):
    """Train on ``data``; the lr warms up linearly over ``n_sched`` steps (default len(data))."""
    n_sched = n_sched or len(data)
    opt = make_optimizer(model, cfg)
    step = TrainStep(model, opt, cfg.grad_clip, dev, cuda_graph=(mode == "graph"))
    if mode == "eager-capturable":
        configure_optimizer(opt, dev, capturable=True)
    losses, norms, times = [], [], []
    for i, (x, y) in enumerate(data):
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = step(x, y, cfg.lr * (i + 1) / n_sched)
        loss = outs.ce_loss.item()
        times.append(time.perf_counter() - t)
        losses.append(loss)
        norms.append(outs.grad_norm.item())
    return losses, norms, times, step


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    dev = torch.device("cuda")
    fails, report = [], {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "recipes": {}}

    def check(ok, what):
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        if not ok:
            fails.append(what)

    for name in args.recipes.split(","):
        args.recipe = name
        cfg = config_from_args(args, 256)
        torch.manual_seed(0)
        base = MoETransformer(cfg.model, get_recipe(name)).to(dev)
        data = batches(cfg, args.check_steps, dev)
        res = {}
        models = {}
        # attention through the math backend here: cuDNN's attention backward is not
        # deterministic, which would hide whether the graph computes what eager does
        with sdpa_kernel([SDPBackend.MATH]):
            for mode in ("eager", "eager-capturable", "eager-capturable-2", "graph"):
                models[mode] = copy.deepcopy(base)
                res[mode] = run(models[mode], cfg, dev, data, mode.removesuffix("-2"))

        def gap(a, b):  # (identical?, max |loss diff|, max |param diff|)
            same = res[a][0] == res[b][0] and res[a][1] == res[b][1] and all(
                torch.equal(p, q) for p, q in zip(models[a].parameters(), models[b].parameters()))
            dl = max(abs(u - v) for u, v in zip(res[a][0], res[b][0]))
            dp = max((p.float() - q.float()).abs().max().item() for p, q in zip(models[a].parameters(),
                                                                                 models[b].parameters()))
            return same, dl, dp

        rerun, graph_gap = gap("eager-capturable", "eager-capturable-2"), gap("graph", "eager-capturable")
        print(f"  eager run twice: identical {rerun[0]}, max loss diff {rerun[1]:.3g}, max param diff {rerun[2]:.3g}; "
              f"graphed vs eager: identical {graph_gap[0]}, {graph_gap[1]:.3g}, {graph_gap[2]:.3g}")
        if rerun[0]:
            check(graph_gap[0], f"{name}: graphed == eager with capturable AdamW over {args.check_steps} steps "
                  f"(losses, grad norms, parameters)")
        else:  # the eager step itself is not deterministic: the graph may differ by as much
            check(graph_gap[1] <= 4 * rerun[1] + 1e-6,
                  f"{name}: graphed losses within 4x the run-to-run spread of eager over {args.check_steps} steps")
        same_loss = graph_gap[0]
        if not same_loss:
            for mode in ("eager-capturable", "eager-capturable-2", "graph"):
                print(f"  {mode:20s} losses {res[mode][0]}\n  {'':20s} norms  {res[mode][1]}")
        d = max(abs(a - b) for a, b in zip(res["graph"][0], res["eager"][0]))
        print(f"  max |loss(graph) - loss(eager, default AdamW)| = {d:.3g}; losses {res['graph'][0][-1]:.5f} / "
              f"{res['eager'][0][-1]:.5f}")
        models.clear()
        # uninitialized memory: eager steps with every fresh allocation filled with NaN
        # (torch.utils.deterministic.fill_uninitialized_memory); a kernel that reads memory
        # it did not write turns the loss or the gradients non-finite
        model = copy.deepcopy(base)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        try:
            with sdpa_kernel([SDPBackend.MATH]):
                filled = run(model, cfg, dev, data[:3], "eager", n_sched=len(data))
        finally:
            torch.use_deterministic_algorithms(False)
        finite = all(map(math.isfinite, filled[0] + filled[1]))
        check(finite, f"{name}: eager steps with NaN-filled fresh memory stay finite (no read of unwritten memory)")
        print(f"  NaN-filled losses equal to plain eager: {filled[0] == res['eager'][0][:3]}", filled[0],
              res["eager"][0][:3])
        del model
        # speed: more steps, both modes
        timing = {}
        for mode in (("eager", "graph") if args.timed else ()):
            model = copy.deepcopy(base)
            t = run(model, cfg, dev, batches(cfg, args.timed + 5, dev), mode)[2][5:]
            timing[mode] = 1e3 * sorted(t)[len(t) // 2]
            del model
        if args.timed:
            print(f"  {name}: eager {timing['eager']:.2f} ms/step, graphed {timing['graph']:.2f} ms/step "
                  f"(median of {args.timed})", flush=True)
        report["recipes"][name] = {"ms_per_step": timing, "graph_equals_eager_capturable": same_loss,
                                   "eager_rerun_identical": rerun[0], "eager_rerun_max_loss_diff": rerun[1],
                                   "graph_vs_eager_max_loss_diff": graph_gap[1],
                                   "max_loss_diff_vs_default_adamw": d}
        # which ops of the step have no deterministic CUDA implementation (information only)
        import warnings

        model = copy.deepcopy(base)
        torch.use_deterministic_algorithms(True, warn_only=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(model, cfg, dev, data[:1], "eager")
        torch.use_deterministic_algorithms(False)
        nondet = sorted({str(w.message).split(".")[0] for w in caught if "deterministic" in str(w.message)})
        print(f"  {name}: ops without a deterministic implementation: {nondet or 'none'}")
        report["recipes"][name]["nondeterministic_ops"] = nondet
        del model, base
        torch.cuda.empty_cache()
    r = report["recipes"]
    if "bf16" in r and "mxfp8" in r and args.timed:
        for mode in ("eager", "graph"):
            ratio = r["bf16"]["ms_per_step"][mode] / r["mxfp8"]["ms_per_step"][mode]
            report[f"mxfp8_speed_vs_bf16_{mode}"] = ratio
            print(f"mxfp8 tokens/s / bf16 tokens/s, {mode}: {ratio:.3f}x")
    # resume: a run stopped after its step-6 checkpoint and resumed equals an uninterrupted one
    if not args.no_resume:
        with tempfile.TemporaryDirectory() as tmp:
            # every run on the math attention backend: cuDNN's attention backward is not
            # deterministic, and two uninterrupted runs would already differ (at e576936
            # the losses of both runs split at step 3, before the interruption)
            flags = ["train", "--preset", "h200", "--recipe", "mxfp8", "--steps", "12", "--ckpt-interval", "6",
                     "--eval-interval", "100", "--batch-size", "8", "--no-progress"]
            math_attention = ("import sys\n"
                              "from torch.nn.attention import SDPBackend, sdpa_kernel\n"
                              "sdpa_kernel([SDPBackend.MATH]).__enter__()\n")
            stop = ("import mxmoe.training.trainer as t\n"
                    "orig = t.save_checkpoint\n"
                    "def save(out, state):\n"
                    "    orig(out, state)\n"
                    "    if state['step'] == 6: raise SystemExit(3)\n"
                    "t.save_checkpoint = save\n")
            cli = "from mxmoe.cli import main\nsys.exit(main(sys.argv[1:]))\n"

            def train(code, out, *extra):
                return subprocess.run([sys.executable, "-c", math_attention + code + cli] + flags
                                      + ["--out-dir", out, *extra], capture_output=True)

            assert train("", f"{tmp}/a").returncode == 0
            p = train(stop, f"{tmp}/b")
            check(p.returncode == 3, f"the interrupted run stopped after its step-6 checkpoint (rc {p.returncode})")
            assert train("", f"{tmp}/b", "--resume").returncode == 0

            def losses(d):
                rows = [json.loads(x) for x in open(f"{d}/metrics.jsonl")]
                return {m["step"]: m["loss"] for m in rows if m["kind"] == "train"}

            la, lb = losses(f"{tmp}/a"), losses(f"{tmp}/b")
            check(all(la[s] == lb[s] for s in range(1, 13)), "mxfp8 graphed run resumed at step 6 == uninterrupted "
                  "(losses of steps 1-12)")
            if not all(la[s] == lb[s] for s in range(1, 13)):
                print("  ", [la[s] for s in range(1, 13)], "\n  ", [lb[s] for s in range(1, 13)])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print("OK" if not fails else f"{len(fails)} FAIL")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
