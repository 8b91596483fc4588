"""Checkpoints never run code: ``mxmoe eval``, ``mxmoe export``, ``mxmoe train --resume``
and the ``mxmoe compare`` worker read checkpoint.pt through
:func:`mxmoe.train.checkpoint.load_checkpoint` (``torch.load(weights_only=True)``). A file
whose unpickling would call a Python function is refused with one line naming it, and the
function is not called; mxmoe's own checkpoints, including those of the format written
before the loader was restricted, load and resume as before."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from mxmoe.cli import main
from mxmoe.models import ModelConfig, MoETransformer
from mxmoe.train import TrainConfig, worker
from mxmoe.train.checkpoint import CHECKPOINT_NAME, load_checkpoint
from mxmoe.train.export import evaluate_source, load_export

REFUSAL = "it contains Python objects other than tensors and plain data (weights_only)"


class OpenPayload:
    """Unpickled with the full unpickler, creates (truncates) ``path``: ``open(path, "w")``."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


class SystemPayload:
    """Unpickled with the full unpickler, runs a shell command that creates ``path``."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch '{self.path}'",)


PAYLOADS = {"open": OpenPayload, "os.system": SystemPayload}


def model_flags(data: Path) -> list[str]:
    return ["--width", "64", "--layers", "2", "--heads", "2", "--experts", "4", "--top-k", "2",
            "--expert-width", "64", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "2",
            "--warmup-steps", "2", "--data", str(data), "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus) -> Path:
    """A tiny mxfp8 run of 2 steps, trained with the `mxmoe train` command."""
    out = tmp_path_factory.mktemp("run") / "r"
    assert main(["train", *model_flags(corpus), "--steps", "2", "--out-dir", str(out)]) == 0
    return out


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def plant(run_dir: Path, dst: Path, payload) -> Path:
    """A copy of ``run_dir`` whose checkpoint.pt is the real one plus ``payload`` under an
    extra key: everything else in it is a valid checkpoint."""
    shutil.copytree(run_dir, dst)
    ckpt = torch.load(run_dir / CHECKPOINT_NAME, map_location="cpu", weights_only=True)
    ckpt["optimizer"]["param_groups"][0]["note"] = payload
    torch.save(ckpt, dst / CHECKPOINT_NAME)
    return dst


@pytest.mark.parametrize("kind", PAYLOADS)
def test_the_planted_payload_is_live_under_the_full_unpickler(run_dir, tmp_path, kind):
    """The control: loaded as before (``weights_only=False``) the payload does run."""
    marker = tmp_path / "pwned"
    bad = plant(run_dir, tmp_path / "bad", PAYLOADS[kind](marker))
    torch.load(bad / CHECKPOINT_NAME, map_location="cpu", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("kind", PAYLOADS)
@pytest.mark.parametrize("command", ["eval", "export", "train --resume", "compare worker --resume"])
def test_a_planted_payload_is_refused_with_one_line_and_never_runs(run_dir, corpus, tmp_path, capsys, kind,
                                                                    command):
    marker = tmp_path / "pwned"
    bad = plant(run_dir, tmp_path / "bad", PAYLOADS[kind](marker))
    before = {p.name: p.read_bytes() for p in bad.iterdir()}
    if command == "eval":
        rc, prefix = main(["eval", str(bad), "--device", "cpu"]), "mxmoe eval: error: "
    elif command == "export":
        rc, prefix = main(["export", str(bad), str(tmp_path / "o.safetensors")]), "mxmoe export: error: "
    elif command == "train --resume":
        rc = main(["train", *model_flags(corpus), "--steps", "4", "--out-dir", str(bad), "--resume"])
        prefix = "mxmoe train: error: "
    else:
        cfg = TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text())["train"])
        cfg.out_dir, cfg.steps = str(bad), 4
        rc, prefix = worker.main([json.dumps(cfg.to_dict()), "--resume"]), "mxmoe compare (mxfp8): error: "
    err = capsys.readouterr().err
    assert rc == 2
    first = f"{open.__module__}.open" if kind == "open" else f"{os.system.__module__}.system"  # io.open, posix.system
    path = str(bad / CHECKPOINT_NAME)
    assert err.startswith(f"{prefix}refusing to load {path!r}: {REFUSAL} (the first: {first});"), err
    assert err.count("\n") == 1 and err.endswith("\n")  # one line
    assert not marker.exists()
    assert not (tmp_path / "o.safetensors").exists()
    assert {p.name: p.read_bytes() for p in bad.iterdir()} == before  # the run directory is untouched


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
def test_load_checkpoint_refuses_and_reports_other_files(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "x": OpenPayload(marker)}, tmp_path / "a.pt")
    with pytest.raises(ValueError, match=r"refusing to load '.*a\.pt': it contains Python objects .*io\.open"):
        load_checkpoint(tmp_path / "a.pt")
    # a bare pickle (not torch.save's zip) with a payload: the restricted unpickler stops at
    # the first opcode it does not take; nothing runs either
    (tmp_path / "b.pt").write_bytes(pickle.dumps({"step": 1, "x": OpenPayload(marker)}, protocol=4))
    with pytest.raises(ValueError, match=r"'.*b\.pt' is not a readable torch checkpoint"):
        load_checkpoint(tmp_path / "b.pt")
    # a protocol-2 pickle that calls os.system through GLOBAL and REDUCE
    (tmp_path / "c.pt").write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    with pytest.raises(ValueError, match=r"refusing to load '.*c\.pt'.*\(the first: os\.system\)"):
        load_checkpoint(tmp_path / "c.pt")
    assert not marker.exists()
    (tmp_path / "d.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match=r"'.*d\.pt' is not a readable torch checkpoint"):
        load_checkpoint(tmp_path / "d.pt")
    torch.save([1, 2], tmp_path / "e.pt")
    with pytest.raises(ValueError, match=r"'.*e\.pt' is not an mxmoe checkpoint \(a list without a 'step'\)"):
        load_checkpoint(tmp_path / "e.pt")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at '.*missing/checkpoint\.pt': it does not exist; "
                                                r"pass a run directory, its checkpoint.pt or \(to eval\) an mxmoe "
                                                r"export$"):
        load_checkpoint(tmp_path / "missing")
    for name in ("missing.pt", "missing.safetensors", "missing.bin"):  # a file name: not taken for a run directory
        with pytest.raises(FileNotFoundError, match=rf"no checkpoint at '[^']*{name}': "):
            load_checkpoint(tmp_path / name)
    for name in "abcde":
        with pytest.raises(ValueError) as e:
            load_checkpoint(tmp_path / f"{name}.pt")
        assert "\n" not in str(e.value)


def test_round_trip_train_resume_eval_export(run_dir, corpus, tmp_path, capsys):
    """A 2-step run resumed to 4 steps gives the metrics of a 4-step run; eval of the
    checkpoint gives the run's own val_loss; export and eval of the export work."""
    straight = tmp_path / "straight"
    assert main(["train", *model_flags(corpus), "--steps", "4", "--out-dir", str(straight)]) == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    assert main(["train", *model_flags(corpus), "--steps", "4", "--out-dir", str(resumed), "--resume"]) == 0
    drop = ("tokens_per_s", "ms_per_step", "mem_gib")  # timings

    def numbers(run: Path) -> list[dict]:  # every train step and the final eval (a 2-step run also evals at 2)
        ms = metrics(run)
        return [{k: v for k, v in m.items() if k not in drop} for m in ms if m["kind"] == "train"] + ms[-1:]

    assert len(numbers(resumed)) == 5 and numbers(resumed) == numbers(straight)
    ckpt = load_checkpoint(resumed)
    ref = torch.load(resumed / CHECKPOINT_NAME, map_location="cpu", weights_only=False)
    assert ckpt["step"] == 4 and set(ckpt) == set(ref) - {"checksums"}  # the loader verifies and drops them
    assert all(torch.equal(ckpt["model"][k], ref["model"][k]) for k in ref["model"])
    val = [m for m in metrics(run_dir) if m["kind"] == "eval"][-1]["val_loss"]
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--device", "cpu"]) == 0
    assert f"val loss {val:.6f}" in capsys.readouterr().out
    assert evaluate_source(run_dir, device="cpu").val_loss == val
    out = tmp_path / "m.safetensors"
    assert main(["export", str(run_dir), str(out)]) == 0
    assert load_export(out).step == 2
    assert evaluate_source(out, device="cpu").val_loss == pytest.approx(val, rel=5e-3)


def old_format_checkpoint(data: Path, out_dir: Path) -> dict:
    """A checkpoint dict of the structure mxmoe wrote before its loader took weights_only
    (one process): the model's state dict (an OrderedDict with ``_metadata``), AdamW's
    state dict (int keys, float32 ``step`` tensors, ``betas`` a tuple), the train config
    as the plain dict of ``TrainConfig.to_dict()`` with the model's nested, and the ranks."""
    model_cfg = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 2, "n_experts": 4, "top_k": 2,
                 "d_expert": 64, "moe_every": 1, "d_ff_dense": 512, "shared_expert": 0, "max_seq_len": 32,
                 "rope_theta": 10000.0, "norm_eps": 1e-05, "aux_loss_coef": 0.01, "z_loss_coef": 0.001,
                 "quantized": ["experts", "attention", "dense"], "dtype": "bfloat16", "mx_dispatch": False}
    train_cfg = {"recipe": "mxfp8", "quant_backend": "auto", "batch_size": 4, "seq_len": 32, "steps": 2,
                 "lr": 0.003, "min_lr_ratio": 0.1, "warmup_steps": 2, "weight_decay": 0.1, "beta1": 0.9,
                 "beta2": 0.95, "grad_clip": 1.0, "seed": 0, "eval_interval": 50, "eval_batches": 2,
                 "ckpt_interval": 100, "out_dir": str(out_dir), "data": str(data), "device": "cpu",
                 "progress": False, "overwrite": False, "expert_parallel": 1, "cuda_graph": True,
                 "model": model_cfg}
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig.from_dict(model_cfg))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=0.003, betas=(0.9, 0.95), fused=False, foreach=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    return {"step": 2, "model": model.state_dict(), "optimizer": opt.state_dict(), "train_config": train_cfg,
            "expert_parallel": 1}


def assert_same(a, b, where="ckpt"):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_a_checkpoint_of_the_earlier_format_loads_evaluates_exports_and_resumes(corpus, tmp_path, capsys):
    run = tmp_path / "old"
    state = old_format_checkpoint(corpus, run)
    assert isinstance(state["model"], OrderedDict) and hasattr(state["model"], "_metadata")
    run.mkdir()
    torch.save(state, run / CHECKPOINT_NAME)  # as save_checkpoint writes it
    got = load_checkpoint(run)
    assert_same(got, state)
    assert got["model"]._metadata == state["model"]._metadata
    ep = dict(state, optimizer=[state["optimizer"], state["optimizer"]], expert_parallel=2)
    torch.save(ep, tmp_path / "ep.pt")  # the expert-parallel form: one optimizer state per rank
    assert_same(load_checkpoint(tmp_path / "ep.pt"), ep)
    assert load_checkpoint(run, mmap=True)["step"] == 2
    assert main(["eval", str(run), "--device", "cpu"]) == 0
    assert main(["export", str(run), str(tmp_path / "m.safetensors")]) == 0
    assert main(["train", *model_flags(corpus), "--steps", "3", "--out-dir", str(run), "--resume"]) == 0
    assert load_checkpoint(run)["step"] == 3
    assert "error" not in capsys.readouterr().err
