"""The train step module (mxmoe.train.step) and the sync-free expert counts, on the CPU.

The CUDA-graph path itself needs a GPU: tests/gpu/test_train_step_cuda_graph.py checks it
on the H200 (graphed == eager within eager's run-to-run spread; resume).
"""

import contextlib
import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from mxmoe.cli import build_parser, config_from_args
from mxmoe.models import ModelConfig, MoETransformer
from mxmoe.nn.moe import tokens_per_expert
from mxmoe.train.step import TrainStep, configure_optimizer, set_lr
from mxmoe.train.trainer import RESUME_MAY_CHANGE, TrainConfig, make_optimizer


@pytest.mark.parametrize("E", [1, 3, 8, 257])
@pytest.mark.parametrize("n", [0, 1, 5, 1000])
def test_tokens_per_expert_equals_bincount(E, n):
    g = torch.Generator().manual_seed(E * 1000 + n)
    experts = torch.randint(0, E, (n, 2) if n else (0, 2), generator=g)
    got = tokens_per_expert(experts, E)
    assert got.dtype == torch.int64 and got.shape == (E,)
    assert torch.equal(got, torch.bincount(experts.reshape(-1), minlength=E))


def _tiny():
    cfg = TrainConfig(batch_size=2, seq_len=16, steps=4, model=ModelConfig(
        d_model=64, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_expert=32, max_seq_len=16))
    torch.manual_seed(0)
    return cfg, MoETransformer(cfg.model, "bf16")


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)


def test_eager_step_is_the_plain_loop():
    """TrainStep on the CPU: forward, backward, clip, AdamW, zero_grad, as the loop was written."""
    cfg, model = _tiny()
    ref = copy.deepcopy(model)
    opt, ref_opt = make_optimizer(model, cfg), make_optimizer(ref, cfg)
    step = TrainStep(model, opt, cfg.grad_clip, torch.device("cpu"), cuda_graph=True)  # ignored on the CPU
    assert not step.graphed
    for i in range(3):
        x, y = _batch(i)
        outs = step(x, y, 1e-3 * (i + 1))
        for gr in ref_opt.param_groups:
            gr["lr"] = 1e-3 * (i + 1)
        out = ref(x, y)
        out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.grad_clip)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert outs.ce_loss.item() == out.ce_loss.item() and outs.grad_norm.item() == norm.item()
        assert outs.ce_loss.grad_fn is None  # detached: the step's autograd graph is not kept alive
        assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_capturable_optimizer_needs_cuda():
    cfg, model = _tiny()
    with pytest.raises(ValueError, match="CUDA"):
        configure_optimizer(make_optimizer(model, cfg), torch.device("cpu"), capturable=True)


def test_graph_mode_checkpoint_loads_into_an_eager_run():
    """A checkpoint written by a graphed run (lr as a tensor, capturable, device step counts)
    resumes in an eager run exactly as that run's own checkpoint would."""
    cfg, model = _tiny()
    opt = make_optimizer(model, cfg)
    step = TrainStep(model, opt, cfg.grad_clip, torch.device("cpu"), cuda_graph=False)
    step(*_batch(0), 1e-3)
    state = copy.deepcopy(opt.state_dict())
    graph_like = copy.deepcopy(state)  # what a graphed run saves (its device is the CPU here)
    for g in graph_like["param_groups"]:
        g["lr"], g["capturable"] = torch.tensor(g["lr"]), True
    runs = []
    for saved in (state, graph_like):
        m = copy.deepcopy(model)
        o = make_optimizer(m, cfg)
        o.load_state_dict(saved)
        s = TrainStep(m, o, cfg.grad_clip, torch.device("cpu"), cuda_graph=True)
        assert all(isinstance(g["lr"], float) and not g["capturable"] for g in o.param_groups)
        runs.append([s(*_batch(i), 1e-3).ce_loss.item() for i in range(1, 4)] + [list(m.parameters())])
    assert runs[0][:3] == runs[1][:3]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][3], runs[1][3]))


def test_set_lr_writes_tensors_in_place():
    cfg, model = _tiny()
    opt = make_optimizer(model, cfg)
    t = torch.tensor(0.0)
    opt.param_groups[0]["lr"] = t
    set_lr(opt, 0.25)
    assert opt.param_groups[0]["lr"] is t and t.item() == 0.25 and opt.param_groups[1]["lr"] == 0.25


def test_cli_flag_and_resume():
    args = build_parser().parse_args(["train", "--no-cuda-graph"])
    assert config_from_args(args, 256).cuda_graph is False
    assert config_from_args(build_parser().parse_args(["train"]), 256).cuda_graph is True
    assert "cuda_graph" in RESUME_MAY_CHANGE  # a speed setting: a resumed run may change it


# ---- the graphed path's control flow, with torch.cuda stood in for (CPU) -----------------

class _FakeStream:
    def __init__(self, name):
        self.name = name

    def wait_stream(self, other):
        pass

    def __repr__(self):
        return f"<stream {self.name}>"


class _FakeCuda:
    """The torch.cuda calls of TrainStep's graphed path, on the CPU: streams are objects,
    ``torch.cuda.graph`` runs its body (setting ``capturing``) and, like torch's, leaves its
    capture stream current when the body raised (ending an invalidated capture raises)."""

    def __init__(self, monkeypatch):
        self.main = _FakeStream("main")
        self.current = self.main
        self.capturing = False
        self.graph_streams = []
        self.devices = []
        fake = self

        class Graph:
            def replay(self):
                raise AssertionError("a failed capture must not be replayed")

        @contextlib.contextmanager
        def device(d):
            fake.devices.append(d)
            yield

        @contextlib.contextmanager
        def stream(s):
            prev, fake.current = fake.current, s
            try:
                yield
            finally:
                fake.current = prev

        class graph:
            def __init__(self, g, stream=None):
                self.stream = stream or _FakeStream("torch's default capture stream")
                fake.graph_streams.append(stream)

            def __enter__(self):
                self.prev, fake.current, fake.capturing = fake.current, self.stream, True

            def __exit__(self, exc_type, exc, tb):
                fake.capturing = False
                if exc is not None:  # capture_end raises; torch.cuda.graph skips restoring the stream
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
                fake.current = self.prev

        for name, value in {"device": device, "stream": stream, "graph": graph, "CUDAGraph": Graph,
                            "Stream": lambda d=None: _FakeStream("side"),
                            "current_stream": lambda d=None: fake.current,
                            "set_stream": lambda s: setattr(fake, "current", s)}.items():
            monkeypatch.setattr(torch.cuda, name, value, raising=False)


@pytest.mark.parametrize("fail_in", ["forward", "optimizer"])
def test_failed_capture_falls_back_to_the_eager_step(monkeypatch, fail_in):
    """A capture that fails (an op that synchronizes, in the forward or in AdamW) leaves the
    run where eager execution of every step leaves it: the same losses and parameters,
    no stale gradients, AdamW back in its float-lr mode, the current stream restored, and a
    note naming the op's error (not the "previous error during capture" that follows it)."""
    cfg, model = _tiny()
    ref = copy.deepcopy(model)
    opt = make_optimizer(model, cfg)
    ref_step = TrainStep(ref, make_optimizer(ref, cfg), cfg.grad_clip, torch.device("cpu"), cuda_graph=False)
    notes = []
    step = TrainStep(model, opt, cfg.grad_clip, torch.device("cpu"), cuda_graph=False, log=notes.append)
    step.graphed = True  # the graphed path, with torch.cuda faked below
    fake = _FakeCuda(monkeypatch)
    target = model if fail_in == "forward" else opt
    real = target.forward if fail_in == "forward" else target.step

    def failing(*args, **kwargs):
        if fake.capturing:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, "forward" if fail_in == "forward" else "step", failing)
    for i in range(4):
        x, y = _batch(i)
        lr = 1e-3 * (i + 1)
        got, want = step(x, y, lr), ref_step(x, y, lr)
        assert got.ce_loss.item() == want.ce_loss.item() and got.grad_norm.item() == want.grad_norm.item()
        assert all(p.grad is None for p in model.parameters())
        assert fake.current is fake.main, f"step {i + 1} left {fake.current} current"
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert not step.graphed
    assert all(isinstance(g["lr"], float) and not g["capturable"] for g in opt.param_groups)
    assert len(fake.graph_streams) == 1 and fake.graph_streams[0] is step._stream  # captured on the warm-up stream
    assert set(fake.devices) == {torch.device("cpu")}  # under the model's device
    assert notes == ["note: CUDA graph capture of the train step failed (RuntimeError: CUDA error: operation not "
                     "permitted when stream is capturing); running eagerly"]


def test_graph_checkpoint_resumes_through_train_on_the_cpu(tmp_path):
    """A checkpoint as a graphed CUDA run writes it (lr a float32 tensor per group,
    capturable, float32 step counts; torch.load maps them to the CPU) resumes through
    ``train`` on the CPU with the losses of the run's own checkpoint, and the checkpoints
    written after that hold the default AdamW's float lr."""
    from mxmoe.train import train
    from mxmoe.train.checkpoint import load_checkpoint, save_checkpoint

    data = tmp_path / "corpus.txt"
    data.write_bytes(b"".join(p.read_bytes() for p in sorted((Path(__file__).parents[2] / "src").rglob("*.py"))))
    cfg = TrainConfig(batch_size=2, seq_len=16, steps=4, eval_interval=2, eval_batches=1, ckpt_interval=2,
                      warmup_steps=1, data=str(data), progress=False, device="cpu", model=ModelConfig(
                          d_model=64, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_expert=32, max_seq_len=16))
    base = tmp_path / "base"
    train(dataclasses.replace(cfg, out_dir=str(base), steps=2))
    ckpt = load_checkpoint(base)
    graph_like = copy.deepcopy(ckpt)
    for g in graph_like["optimizer"]["param_groups"]:
        g["lr"], g["capturable"] = torch.tensor(g["lr"], dtype=torch.float32), True
    for st in graph_like["optimizer"]["state"].values():
        st["step"] = st["step"].to(torch.float32)
    losses = []
    for name, state in (("eager", ckpt), ("graph", graph_like)):
        out = tmp_path / name
        shutil.copytree(base, out)
        save_checkpoint(out, state)
        train(dataclasses.replace(cfg, out_dir=str(out)), resume=True)
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses.append([(m["step"], m["loss"]) for m in lines if m["kind"] == "train"])
        saved = load_checkpoint(out)["optimizer"]["param_groups"]
        assert all(isinstance(g["lr"], float) and not g["capturable"] for g in saved)
    assert losses[0] == losses[1] and [s for s, _ in losses[0]] == [1, 2, 3, 4]


def test_compare_passes_no_cuda_graph_to_its_workers_and_reuse_compares_it(tmp_path):
    """``mxmoe compare --no-cuda-graph``: the worker's config says so. --reuse takes a run
    with the same cuda_graph only (graphed and eager steps differ several-fold in speed),
    and a run written before the setting existed (no cuda_graph in its config.json) as the
    eager run it was; a report over graphed and eager runs says they differ."""
    from test_compare import fake_run

    from mxmoe.train.compare import build_report, plan_runs

    args = build_parser().parse_args(["compare", "--no-cuda-graph", "--recipes", "bf16"])
    args.recipe = args.recipes[0]
    cfg = config_from_args(args, 256)
    plan = plan_runs(cfg, ("bf16",), tmp_path / "new", reuse=False)[0]
    assert TrainConfig.from_dict(json.loads(json.dumps(plan.cfg.to_dict()))).cuda_graph is False
    cfg = TrainConfig(steps=40, batch_size=8, seq_len=64, lr=1e-3)
    gpu = {"device": "cuda:0", "device_name": "NVIDIA H200"}  # on the CPU the setting is not compared
    fake_run(tmp_path, "bf16", val=2.0, ms=100.0, mem=1.0, **gpu)  # cuda_graph True
    old = fake_run(tmp_path, "mxfp8", val=2.0, ms=100.0, mem=1.0, **gpu)
    config = json.loads((old / "config.json").read_text())
    del config["train"]["cuda_graph"]
    (old / "config.json").write_text(json.dumps(config))
    assert [p.action for p in plan_runs(cfg, ("bf16",), tmp_path, reuse=True)] == ["reuse"]
    assert [p.action for p in plan_runs(dataclasses.replace(cfg, cuda_graph=False), ("mxfp8",), tmp_path,
                                        reuse=True)] == ["reuse"]
    with pytest.raises(ValueError, match=r"cuda_graph=False \(asked True\)"):
        plan_runs(cfg, ("mxfp8",), tmp_path, reuse=True)
    with pytest.raises(ValueError, match=r"cuda_graph=True \(asked False\)"):
        plan_runs(dataclasses.replace(cfg, cuda_graph=False), ("bf16",), tmp_path, reuse=True)
    assert "differ in settings** (cuda_graph)" in build_report(tmp_path).read_text()
