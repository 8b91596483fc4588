"""Non-finite gradients and losses: the update is skipped, the step is marked in the
metrics, a checkpoint with non-finite values is never written, and a run of bad steps
stops with a non-zero exit naming the step and the last good checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mxmoe.cli import main
from mxmoe.models import ModelConfig, MoETransformer
from mxmoe.train import TrainConfig, train, trainer
from mxmoe.train.checkpoint import load_checkpoint
from mxmoe.train.step import TrainStep, guarded_optimizer_step
from mxmoe.train.trainer import make_optimizer, nonfinite_state

TINY_FLAGS = ["--layers", "1", "--width", "64", "--heads", "2", "--experts", "4", "--top-k", "2",
              "--expert-width", "64", "--batch-size", "2", "--seq-len", "32", "--no-progress",
              "--eval-batches", "1", "--recipe", "bf16", "--dtype", "float32", "--device", "cpu"]
# on the CPU: the poisoned forward is Python, which a CUDA graph's replay does not run (the
# guard inside a graph: tests/gpu/test_train_step_cuda_graph.py)

# how a step goes bad: the loss stays finite and its gradient turns NaN or inf, or the
# loss itself is NaN (and so every gradient)
BAD_KINDS = ["nan_grad", "inf_grad", "nan_loss"]


@pytest.fixture(scope="module")
def text_file(corpus) -> Path:
    """mxmoe's own sources as a corpus (the session's ``corpus`` fixture)."""
    return corpus


def poisoned_model(kind: str, bad_steps: set[int]):
    """A MoETransformer class whose training forward number s (s = the step, counted from
    1 in a run started anew) goes bad as ``kind`` says when s is in ``bad_steps``."""

    class Poisoned(MoETransformer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.calls = 0

        def forward(self, idx, targets=None):
            out = super().forward(idx, targets)
            if not (self.training and torch.is_grad_enabled() and targets is not None):
                return out
            self.calls += 1
            if self.calls in bad_steps:
                if kind == "nan_loss":
                    out.loss = out.loss * float("nan")
                    out.ce_loss = out.ce_loss * float("nan")
                else:
                    value = float("nan") if kind == "nan_grad" else float("inf")
                    out.loss.register_hook(lambda g: torch.full_like(g, value))
            return out

    return Poisoned


def poisoned_builder(kind: str, bad_steps: set[int]):
    """``trainer.build_model`` making the :func:`poisoned_model` of ``kind`` and ``bad_steps``."""
    cls = poisoned_model(kind, bad_steps)
    return lambda cfg, recipe="mxfp8": cls(cfg, recipe)


def tiny_config(out: Path, data: Path, **kw) -> TrainConfig:
    model = ModelConfig(d_model=64, n_layers=1, n_heads=2, n_experts=4, top_k=2, d_expert=64, max_seq_len=32,
                        dtype="float32")
    base = {"recipe": "bf16", "batch_size": 2, "seq_len": 32, "steps": 6, "eval_interval": 100, "eval_batches": 1,
            "ckpt_interval": 2, "out_dir": str(out), "data": str(data), "progress": False, "model": model,
            "warmup_steps": 1, "device": "cpu"}
    base.update(kw)
    return TrainConfig(**base)


def train_lines(out: Path) -> list[dict]:
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m["kind"] == "train"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_step_is_skipped_and_marked(tmp_path, text_file, monkeypatch, kind):
    """Step 4 goes bad and a checkpoint is due at step 4: the update is skipped (the
    checkpoint of step 4 holds the weights of step 3), the metrics line says so, the run
    goes on and finishes with finite weights."""
    monkeypatch.setattr(trainer, "build_model", poisoned_builder(kind, {4}))
    out = tmp_path / "run"
    seen = {}
    real_save = trainer.save_checkpoint

    def save(out_dir, state):  # the weights of each checkpoint written
        seen[state["step"]] = {k: v.clone() for k, v in state["model"].items()}
        return real_save(out_dir, state)

    monkeypatch.setattr(trainer, "save_checkpoint", save)
    # the weights right after step 3: the same run without a bad step, checkpointed at step 3
    monkeypatch.setattr(trainer, "build_model", poisoned_builder(kind, set()))
    train(tiny_config(tmp_path / "good", text_file, ckpt_interval=3))
    monkeypatch.setattr(trainer, "build_model", poisoned_builder(kind, {4}))
    after_3 = seen[3]
    seen.clear()
    train(tiny_config(out, text_file))
    lines = train_lines(out)
    assert [m["skipped"] for m in lines] == [False, False, False, True, False, False]
    assert sorted(seen) == [2, 4, 6]
    for k, v in seen[4].items():  # nothing of step 4 applied
        assert torch.equal(v, after_3[k]), k
    ckpt = load_checkpoint(out)
    assert ckpt["step"] == 6 and nonfinite_state(ckpt["model"], ckpt["optimizer"]) is None


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_persistent_bad_steps_stop_with_a_nonzero_exit(tmp_path, text_file, monkeypatch, capsys, kind):
    """Steps 3 on go bad, --max-bad-steps 3: the run stops at step 5 with exit 1 and a
    one-line message naming the step and the last good checkpoint; the checkpoint on disk
    is finite and holds the weights of step 2."""
    monkeypatch.setattr(trainer, "build_model", poisoned_builder(kind, set(range(3, 100))))
    out = tmp_path / "run"
    rc = main(["train", *TINY_FLAGS, "--data", str(text_file), "--out-dir", str(out), "--steps", "10",
               "--ckpt-interval", "2", "--warmup-steps", "1", "--max-bad-steps", "3"])
    err = capsys.readouterr().err
    assert rc == 1
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "3 consecutive steps (3 to 5)" in err and "stopped at step 5" in err
    assert f"{out / 'checkpoint.pt'} (step 4)" in err
    lines = train_lines(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5]
    assert [m["skipped"] for m in lines] == [False, False, True, True, True]
    ckpt = load_checkpoint(out)
    assert ckpt["step"] == 4 and nonfinite_state(ckpt["model"], ckpt["optimizer"]) is None


@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize("bad", [{5, 6}, {6}, {1, 2, 3, 4, 5, 6}], ids=["last two", "last one", "every step"])
def test_a_run_ending_on_skipped_steps_exits_nonzero(tmp_path, text_file, monkeypatch, capsys, kind, bad):
    """Fewer bad steps than --max-bad-steps, but at the end of the run: the weights it saves
    are not those of its last step, so it must not end with exit 0 as if it had trained."""
    monkeypatch.setattr(trainer, "build_model", poisoned_builder(kind, bad))
    out = tmp_path / "run"
    rc = main(["train", *TINY_FLAGS, "--data", str(text_file), "--out-dir", str(out), "--steps", "6",
               "--ckpt-interval", "2", "--warmup-steps", "1", "--max-bad-steps", "10"])
    err = capsys.readouterr().err
    first = min(bad)
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert f"the run ended with {len(bad)} consecutive steps ({first} to 6) whose updates were skipped" in err, err
    assert f"the weights saved at step 6 are those of step {first - 1}" in err, err
    assert [m["skipped"] for m in train_lines(out)] == [s in bad for s in range(1, 7)]
    assert load_checkpoint(out)["step"] == 6


def test_a_checkpoint_with_nonfinite_weights_is_not_written(tmp_path, text_file, monkeypatch):
    """An update that makes a weight NaN with a finite gradient norm (here: an optimizer
    hook that poisons one weight after step 3): the checkpoint due at step 4 is not
    written, the one of step 2 stays on disk, and the run stops there (the end of a run
    included: nothing would repair the weights)."""
    real_make = trainer.make_optimizer

    def make(model, cfg):
        opt = real_make(model, cfg)
        count = [0]

        def poison(opt, args, kwargs):
            count[0] += 1
            if count[0] == 3:
                next(model.parameters()).data[0, 0] = float("nan")

        opt.register_step_post_hook(poison)
        return opt

    monkeypatch.setattr(trainer, "make_optimizer", make)
    for steps in (10, 4):  # a checkpoint due mid-run, and the last one
        out = tmp_path / f"run{steps}"
        with pytest.raises(FloatingPointError, match=r"not writing the checkpoint of step 4: embed holds "
                                                     r"NaN or inf; the last good checkpoint is .*checkpoint.pt "
                                                     r"\(step 2\)"):
            train(tiny_config(out, text_file, steps=steps))
        ckpt = load_checkpoint(out)
        assert ckpt["step"] == 2 and nonfinite_state(ckpt["model"], ckpt["optimizer"]) is None
        assert [m["step"] for m in train_lines(out)] == [1, 2, 3, 4]


def test_an_absurd_finite_loss_gets_one_warning(tmp_path, text_file, capsys):
    """--lr 10 diverges to a finite loss far above ln(vocab): one warning line."""
    train(tiny_config(tmp_path / "run", text_file, lr=10.0, steps=5, ckpt_interval=0, max_bad_steps=5))
    warnings = [s for s in capsys.readouterr().out.splitlines() if "is far above ln(vocab_size)" in s]
    assert len(warnings) == 1 and "lower --lr (now 10)" in warnings[0]


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf")])
def test_guarded_optimizer_step(on_device, bad):
    """A finite gradient norm: the bits of a plain AdamW step. A NaN or inf one: the
    parameters unchanged (and on the host path the AdamW state too)."""
    torch.manual_seed(0)
    cfg = TrainConfig()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = make_optimizer(model, cfg), make_optimizer(ref, cfg)
    x = torch.randn(5, 8)
    for step in range(2):
        for m in (model, ref):
            m.zero_grad()
            m(x).square().sum().backward()
        params = list(model.parameters())
        if step == 1 and bad is not None:
            params[1].grad[0] = bad
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        before = [p.detach().clone() for p in params]
        state_before = {k: v.clone() for k, v in opt.state[params[0]].items()}
        snapshot = [torch.empty_like(p) for p in params] if on_device else None
        skipped = guarded_optimizer_step(opt, params, norm, on_device=on_device, snapshot=snapshot)
        assert skipped.dtype == torch.bool and bool(skipped) == (step == 1 and bad is not None)
        if bool(skipped):
            assert all(torch.equal(p, b) for p, b in zip(params, before))
            if not on_device:
                assert all(torch.equal(opt.state[params[0]][k], v) for k, v in state_before.items())
            return
        ref_opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_train_step_reports_skipped():
    """TrainStep returns the flag; a finite step is not skipped."""
    torch.manual_seed(0)
    cfg = TrainConfig(model=ModelConfig(d_model=64, n_layers=1, n_heads=2, n_experts=4, top_k=2, d_expert=64,
                                        max_seq_len=16, dtype="float32"), recipe="bf16")
    model = poisoned_model("nan_grad", {2})(cfg.model, trainer.get_recipe("bf16"))
    step = TrainStep(model, make_optimizer(model, cfg), 1.0, torch.device("cpu"), cuda_graph=False)
    x = torch.randint(0, 256, (2, 16))
    first = step(x, x, 1e-3)
    assert not bool(first.skipped) and math.isfinite(first.grad_norm.item())
    second = step(x, x, 1e-3)
    assert bool(second.skipped) and not math.isfinite(second.grad_norm.item())
