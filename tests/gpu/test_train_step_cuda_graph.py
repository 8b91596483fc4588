"""The CUDA-graph train step (:class:`mxmoe.train.step.TrainStep`) on the GPU: the same
numbers as eager steps, no read of unwritten memory, and an interrupted graphed run that
resumes from its checkpoint equal to an uninterrupted one.

On the model of ``mxmoe train --preset h200``, for the bf16 and mxfp8 recipes:

1. Copies of the model from one seed train ``CHECK_STEPS`` steps on the same batches,
   attention on the (deterministic) math backend: eager with the capturable AdamW twice,
   and graphed. Where the two eager runs are identical, the graphed run must equal them
   bit for bit (losses, gradient norms, every parameter after the last step); where they
   are not (ops with atomics), the graphed losses must stay within 4x the eager
   run-to-run spread.
2. Eager steps with every fresh allocation filled with NaN
   (``torch.utils.deterministic.fill_uninitialized_memory``) stay finite: no kernel reads
   memory it did not write.
3. A step whose loss turns NaN inside the replayed graph (a NaN written into a buffer the
   graph reads) is skipped on the device: its "skipped" flag is set, the parameters are
   those before it, and the steps after it run and stay finite.
4. ``mxmoe train`` (graphed, mxfp8, 2 of the preset's blocks to keep the checkpoints small)
   for 12 steps with a checkpoint at step 6, against a run stopped right after that
   checkpoint and resumed: the losses of steps 1-12 are equal.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from mxmoe.cli import add_train_arguments, config_from_args
from mxmoe.cli.presets import parse_with_preset
from mxmoe.models import MoETransformer
from mxmoe.recipe import get_recipe
from mxmoe.train.step import TrainStep, configure_optimizer
from mxmoe.train.trainer import make_optimizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = torch.device("cuda")
CHECK_STEPS = 8
ROOT = Path(__file__).resolve().parents[2]


def h200_config(recipe: str):
    """The TrainConfig of ``mxmoe train --preset h200 --recipe RECIPE`` (vocabulary 256)."""
    def parser():
        import argparse

        p = argparse.ArgumentParser()
        add_train_arguments(p)
        return p

    args = parse_with_preset(parser, ["--recipe", recipe], default="h200")[0]
    return config_from_args(args, 256)


def batches(cfg, n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), generator=g),
             torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), generator=g)) for _ in range(n)]


def run(model, cfg, data, mode):
    """Train on ``data`` (lr warming up linearly over the run); returns (losses, grad norms)."""
    opt = make_optimizer(model, cfg)
    step = TrainStep(model, opt, cfg.grad_clip, DEV, cuda_graph=(mode == "graph"))
    if mode == "eager-capturable":
        configure_optimizer(opt, DEV, capturable=True)
    losses, norms = [], []
    for i, (x, y) in enumerate(data):
        outs = step(x, y, cfg.lr * (i + 1) / len(data))
        losses.append(outs.ce_loss.item())
        norms.append(outs.grad_norm.item())
    assert mode != "graph" or step.graphed, "the graphed step fell back to eager (capture failed)"
    return losses, norms


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_graphed_steps_equal_eager_steps(recipe):
    cfg = h200_config(recipe)
    torch.manual_seed(0)
    base = MoETransformer(cfg.model, get_recipe(recipe)).to(DEV)
    data = batches(cfg, CHECK_STEPS)
    res, models = {}, {}
    # the math attention backend: cuDNN's attention backward is not deterministic, which
    # would hide whether the graph computes what eager does
    with sdpa_kernel([SDPBackend.MATH]):
        for name, mode in (("eager", "eager-capturable"), ("eager-2", "eager-capturable"), ("graph", "graph")):
            models[name] = copy.deepcopy(base)
            res[name] = run(models[name], cfg, data, mode)

    def identical(a, b):
        return res[a] == res[b] and all(torch.equal(p, q) for p, q in zip(models[a].parameters(),
                                                                            models[b].parameters()))

    def loss_gap(a, b):
        return max(abs(u - v) for u, v in zip(res[a][0], res[b][0]))

    if identical("eager", "eager-2"):
        assert identical("graph", "eager"), \
            f"graphed != eager (capturable AdamW): losses {res['graph'][0]} vs {res['eager'][0]}"
    else:  # the eager step itself is not deterministic: the graph may differ by as much
        spread = loss_gap("eager", "eager-2")
        assert loss_gap("graph", "eager") <= 4 * spread + 1e-6, \
            f"graphed losses {res['graph'][0]} vs eager {res['eager'][0]} (eager run-to-run spread {spread:.3g})"


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_steps_with_nan_filled_fresh_memory_stay_finite(recipe):
    cfg = h200_config(recipe)
    torch.manual_seed(0)
    model = MoETransformer(cfg.model, get_recipe(recipe)).to(DEV)
    torch.use_deterministic_algorithms(True, warn_only=True)
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            losses, norms = run(model, cfg, batches(cfg, 3), "eager")
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    assert all(map(math.isfinite, losses + norms)), f"losses {losses}, gradient norms {norms}"


class PoisonableModel(MoETransformer):
    """The model with a float32 buffer ``poison`` (0) added into the loss times the loss:
    writing NaN into it makes the next replayed step's loss and gradients NaN."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.register_buffer("poison", torch.zeros(()))

    def forward(self, idx, targets=None):
        out = super().forward(idx, targets)
        if targets is not None:
            out.loss = out.loss + self.poison * out.loss
        return out


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8"])
def test_a_nan_step_inside_the_graph_is_skipped_on_the_device(recipe):
    cfg = h200_config(recipe)
    cfg.grad_clip = 1.0
    data = batches(cfg, 5)
    torch.manual_seed(0)
    base = PoisonableModel(cfg.model, get_recipe(recipe)).to(DEV)
    graphed = copy.deepcopy(base)
    step = TrainStep(graphed, make_optimizer(graphed, cfg), cfg.grad_clip, DEV, cuda_graph=True)
    skipped, params_before = [], None
    with sdpa_kernel([SDPBackend.MATH]):
        for i, (x, y) in enumerate(data):
            if i == 3:  # steps 1 (eager) and 2 (captured) ran; step 4 replays with NaN
                graphed.poison.fill_(float("nan"))
                params_before = [p.detach().clone() for p in graphed.parameters()]
            outs = step(x, y, cfg.lr)
            skipped.append(bool(outs.skipped))
            if i == 3:
                assert not math.isfinite(outs.grad_norm.item())
                assert all(torch.equal(p, q) for p, q in zip(graphed.parameters(), params_before)), \
                    "a parameter changed in the skipped step"
                graphed.poison.zero_()
    assert step.graphed, "the graphed step fell back to eager (capture failed)"
    assert skipped == [False, False, False, True, False]
    assert all(torch.isfinite(p).all() for p in graphed.parameters())


STOP_AT_CHECKPOINT_6 = """
import mxmoe.train.trainer as t
orig = t.save_checkpoint
def save(out, state):
    orig(out, state)
    if state['step'] == 6:
        raise SystemExit(3)
t.save_checkpoint = save
"""
# every run on the math attention backend and with torch's deterministic algorithms (cuBLAS
# with a fixed workspace): cuDNN's attention backward and some CUDA ops are not
# deterministic, and two uninterrupted runs would already differ (seen at step 2 with the
# GPU shared by a parallel test run)
MATH_ATTENTION = """
import sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
sdpa_kernel([SDPBackend.MATH]).__enter__()
torch.use_deterministic_algorithms(True, warn_only=True)
"""
CLI = "from mxmoe.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def test_graphed_run_resumed_from_checkpoint_equals_uninterrupted(tmp_path):
    flags = ["train", "--preset", "h200", "--layers", "2", "--recipe", "mxfp8", "--steps", "12", "--ckpt-interval",
             "6", "--eval-interval", "100", "--batch-size", "8", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               CUBLAS_WORKSPACE_CONFIG=":4096:8")

    def train(code, out, *extra):
        cmd = [sys.executable, "-c", MATH_ATTENTION + code + CLI, *flags, "--out-dir", str(out), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)

    a = train("", tmp_path / "a")
    assert a.returncode == 0, a.stderr[-3000:]
    b = train(STOP_AT_CHECKPOINT_6, tmp_path / "b")
    assert b.returncode == 3, f"the interrupted run did not stop after its step-6 checkpoint: {b.stderr[-3000:]}"
    b2 = train("", tmp_path / "b", "--resume")
    assert b2.returncode == 0, b2.stderr[-3000:]

    def losses(d):
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        return {m["step"]: m["loss"] for m in rows if m["kind"] == "train"}

    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert [la[s] for s in range(1, 13)] == [lb[s] for s in range(1, 13)]
