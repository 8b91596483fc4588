"""Data loading, the training loop, checkpoints, resume and the CLI."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mxmoe.cli import main
from mxmoe.models import ModelConfig
from mxmoe.train import TrainConfig, load_corpus, lr_at, train
from mxmoe.train.checkpoint import atomic_write_bytes, load_checkpoint, save_checkpoint
from mxmoe.train.data import eval_batches, random_batch, stdlib_files

TINY_FLAGS = ["--layers", "2", "--width", "64", "--heads", "2", "--experts", "4", "--top-k", "2",
              "--expert-width", "64", "--batch-size", "4", "--seq-len", "32", "--no-progress"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    root = Path(__file__).resolve().parents[2] / "src" / "mxmoe"
    text = b"\n".join(p.read_bytes() for p in sorted(root.rglob("*.py")))
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(text)
    return path


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def tiny_config(out: Path, data: Path, **kw) -> TrainConfig:
    model = ModelConfig(d_model=64, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_expert=64, max_seq_len=32)
    base = dict(batch_size=4, seq_len=32, steps=6, eval_interval=3, eval_batches=2, ckpt_interval=3,
                out_dir=str(out), data=str(data), progress=False, model=model, warmup_steps=2)
    base.update(kw)
    return TrainConfig(**base)


# ---- data ---------------------------------------------------------------------------

def test_stdlib_corpus_excludes_tests_and_site_packages():
    root, files = stdlib_files()
    rel = [f.relative_to(root).parts for f in files]
    assert len(files) > 100
    assert not any(set(parts) & {"site-packages", "test", "tests", "idle_test"} for parts in rel)
    assert all(f.suffix == ".py" for f in files)


def test_default_corpus_split_is_deterministic():
    a, b = load_corpus(), load_corpus()
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.vocab_size == 256 and a.train.dtype == torch.uint8
    assert 0.02 < a.val.numel() / (a.train.numel() + a.val.numel()) < 0.10


def test_data_sources(tmp_path, text_file):
    c = load_corpus(text_file)
    assert c.vocab_size == 256 and c.val.numel() == int((c.train.numel() + c.val.numel()) * 0.05)
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(30):
        (d / f"doc{i}.txt").write_text(f"document {i} " * 50)
    (d / "blob.bin.dat").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    c = load_corpus(d)
    assert c.train.numel() + c.val.numel() > 30 * 500 and 0 not in c.train.tolist()
    ids = np.arange(1000, dtype=np.uint16) * 7
    (tmp_path / "tokens.bin").write_bytes(ids.tobytes())
    c = load_corpus(tmp_path / "tokens.bin")
    assert c.vocab_size == 999 * 7 + 1 and c.train.dtype == torch.int32
    assert torch.equal(torch.cat([c.train, c.val]), torch.from_numpy(ids.astype(np.int32)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "missing")


def test_batches_are_seeded_and_eval_batches_fixed():
    tokens = torch.arange(10_000, dtype=torch.int32)
    x1, y1 = random_batch(tokens, 4, 16, torch.Generator().manual_seed(5))
    x2, y2 = random_batch(tokens, 4, 16, torch.Generator().manual_seed(5))
    assert torch.equal(x1, x2) and torch.equal(y1[:, :-1], x1[:, 1:])
    assert eval_batches(tokens, 4, 16, 3)[2][0].tolist() == eval_batches(tokens, 4, 16, 3)[2][0].tolist()
    with pytest.raises(ValueError, match="fewer than seq_len"):
        random_batch(tokens[:10], 1, 16, torch.Generator())


def test_lr_schedule():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(5, cfg) == pytest.approx(0.5)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)
    assert lr_at(100, cfg) == pytest.approx(0.1)


# ---- training loop ------------------------------------------------------------------

def test_train_writes_metrics_config_and_checkpoint(tmp_path, text_file):
    out = tmp_path / "run"
    r = train(tiny_config(out, text_file))
    lines = read_metrics(out)
    train_lines = [m for m in lines if m["kind"] == "train"]
    eval_lines = [m for m in lines if m["kind"] == "eval"]
    assert [m["step"] for m in train_lines] == [1, 2, 3, 4, 5, 6]
    assert [m["step"] for m in eval_lines] == [0, 3, 6]
    assert all("loss" in m and math.isfinite(m["loss"]) for m in lines)
    assert all("val_loss" in m for m in eval_lines)
    for key in ("aux_loss", "grad_norm", "tokens_per_s", "ms_per_step", "mem_gib", "lr"):
        assert key in train_lines[0]
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["recipe"] == "mxfp8" and config["params"]["total"] > 0
    ckpt = load_checkpoint(out)
    assert ckpt["step"] == 6
    assert r.last_val_loss < r.first_val_loss
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_resume_continues_exactly(tmp_path, text_file):
    full = tmp_path / "full"
    train(tiny_config(full, text_file))
    # the same run stopped right after step 4: the step-3 checkpoint is the latest
    interrupted = tmp_path / "interrupted"
    cfg = tiny_config(interrupted, text_file)
    _train_until(cfg, stop_after=4)
    assert load_checkpoint(interrupted)["step"] == 3
    train(cfg, resume=True)
    a = {m["step"]: m["loss"] for m in read_metrics(full) if m["kind"] == "train"}
    steps = [m["step"] for m in read_metrics(interrupted) if m["kind"] == "train"]
    b = {m["step"]: m["loss"] for m in read_metrics(interrupted) if m["kind"] == "train"}
    assert steps == [1, 2, 3, 4, 5, 6]  # step 4 logged once: the lines past the checkpoint were dropped
    assert a == b
    assert load_checkpoint(interrupted)["step"] == 6


def _train_until(cfg: TrainConfig, stop_after: int) -> None:
    """Run ``cfg`` and stop it with an exception right after step ``stop_after`` is logged."""
    import mxmoe.train.trainer as trainer

    real_write = trainer.MetricsWriter.write

    def write(self, record):
        real_write(self, record)
        if record.get("kind") == "train" and record["step"] == stop_after:
            raise KeyboardInterrupt

    trainer.MetricsWriter.write = write
    try:
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    finally:
        trainer.MetricsWriter.write = real_write


def test_resume_refuses_other_settings(tmp_path, text_file):
    out = tmp_path / "run"
    train(tiny_config(out, text_file, steps=3))
    with pytest.raises(ValueError, match="differ from the checkpoint's: recipe \\(--recipe\\): checkpoint 'mxfp8', "
                                         "now 'bf16'; use"):
        train(tiny_config(out, text_file, steps=3, recipe="bf16"), resume=True)
    # every differing setting with both values, the model's by their own keys
    model = dataclasses.replace(tiny_config(out, text_file).model, n_layers=3)
    with pytest.raises(ValueError) as info:
        train(tiny_config(out, text_file, steps=5, lr=0.002, model=model), resume=True)
    msg = str(info.value)
    saved_lr = tiny_config(out, text_file).lr
    assert f"lr (--lr): checkpoint {saved_lr!r}, now 0.002" in msg
    assert "model.n_layers (--layers): checkpoint 2, now 3" in msg
    assert "recipe" not in msg and "steps" not in msg  # steps may change on resume (RESUME_MAY_CHANGE)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(tiny_config(tmp_path / "empty", text_file), resume=True)
    # a checkpoint of an expert-parallel run (one optimizer state per rank) resumes on its P only
    ckpt = load_checkpoint(out)
    assert ckpt["expert_parallel"] == 1
    ckpt["expert_parallel"] = 2
    save_checkpoint(out, ckpt)
    with pytest.raises(ValueError, match="written with --expert-parallel 2, this run has --expert-parallel 1"):
        train(tiny_config(out, text_file, steps=5), resume=True)


def test_interrupted_checkpoint_write_keeps_the_previous_one(tmp_path):
    save_checkpoint(tmp_path, {"step": 1})

    def failing_write(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(tmp_path / "checkpoint.pt", failing_write)
    assert load_checkpoint(tmp_path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


class _FullDisk(io.RawIOBase):
    """A file object that takes ``limit`` bytes, then fails as a full disk does."""

    def __init__(self, f, limit: int):
        self.f, self.left = f, limit

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if len(b) > self.left:
            self.f.write(bytes(b[: self.left]))
            self.left = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.left -= len(b)
        return self.f.write(b)


# every way a write fails inside atomic_write_bytes: torch.save's zip writer turns the
# disk's OSError into a RuntimeError without a path; plain writes raise OSError with no
# filename or with the temp file's
WRITE_FAILURES = {
    "torch.save on a full disk": lambda f: torch.save({"w": torch.randn(10_000)}, _FullDisk(f, 2000)),
    "a plain write on a full disk": lambda f: _FullDisk(f, 10).write(b"x" * 100),
    "an OSError naming the temp file": lambda f: (_ for _ in ()).throw(
        OSError(errno.EIO, "I/O error", os.readlink(f"/proc/self/fd/{f.fileno()}") if os.path.exists("/proc/self/fd")
                else ".checkpoint.pt.x.tmp")),
    "an OSError naming the file descriptor": lambda f: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error", f.name)),
}


@pytest.mark.parametrize("case", WRITE_FAILURES)
def test_a_failed_write_names_the_destination_and_keeps_the_previous_file(tmp_path, case):
    save_checkpoint(tmp_path, {"step": 1})
    dest = tmp_path / "checkpoint.pt"
    with pytest.raises(OSError) as e:
        atomic_write_bytes(dest, WRITE_FAILURES[case])
    assert e.value.filename == str(dest), e.value  # the file the user knows, not ".checkpoint.pt.xxxx.tmp"
    assert e.value.errno in (errno.ENOSPC, errno.EIO) and ".tmp" not in str(e.value)
    assert load_checkpoint(tmp_path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_a_failed_write_keeps_other_errors_as_they_are(tmp_path):
    with pytest.raises(RuntimeError, match="not a write failure"):
        atomic_write_bytes(tmp_path / "x.pt", lambda f: (_ for _ in ()).throw(RuntimeError("not a write failure")))
    assert list(tmp_path.iterdir()) == []


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, text_file):
    """A real crash: SIGKILL the process after a checkpoint, resume, compare losses."""
    flags = TINY_FLAGS + ["--data", str(text_file), "--steps", "8", "--ckpt-interval", "2",
                          "--eval-interval", "4", "--eval-batches", "1"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ref_dir, crash_dir = tmp_path / "ref", tmp_path / "crash"
    subprocess.run([sys.executable, "-m", "mxmoe", "train", *flags, "--out-dir", str(ref_dir)],
                   check=True, env=env, capture_output=True)
    proc = subprocess.Popen([sys.executable, "-m", "mxmoe", "train", *flags, "--out-dir", str(crash_dir)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if (crash_dir / "metrics.jsonl").exists() and any(
                m.get("step", 0) >= 5 for m in read_metrics(crash_dir) if m.get("kind") == "train"):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert load_checkpoint(crash_dir)["step"] in (4, 6)
    subprocess.run([sys.executable, "-m", "mxmoe", "train", *flags, "--out-dir", str(crash_dir), "--resume"],
                   check=True, env=env, capture_output=True)
    ref = [(m["step"], m["loss"]) for m in read_metrics(ref_dir) if m["kind"] == "train"]
    got = [(m["step"], m["loss"]) for m in read_metrics(crash_dir) if m["kind"] == "train"]
    assert got == ref


# ---- CLI ----------------------------------------------------------------------------

@pytest.mark.parametrize("flags,message", [
    (["--experts", "0"], "--experts must be a positive integer"),
    (["--top-k", "5"], "--top-k=5 exceeds --experts=4"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    (["--steps", "0"], "steps must be an integer in [1, 1,099,511,627,776]"),
    (["--lr", "-1"], "lr must be a positive number"),
    (["--device", "gpu"], "unknown device 'gpu'"),
    (["--grad-clip", "-1"], "--grad-clip must be >= 0"),
    (["--grad-clip", "nan"], "--grad-clip must be >= 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["--shared-expert", "-4"], "--shared-expert must be an integer in [0, 2,147,483,647]"),
    (["--vocab-size", "0"], "--vocab-size must be a positive integer"),
    (["--aux-loss-coef", "nan"], "--aux-loss-coef must be a finite number >= 0"),
    (["--seq-len", "1000000"], "fewer than --seq-len + 1"),
])
def test_cli_bad_flags_stop_before_work(tmp_path, capsys, flags, message):
    rc = main(["train", *TINY_FLAGS, "--out-dir", str(tmp_path / "o"), *flags])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_unknown_recipe_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--recipe", "fp4"])
    assert e.value.code == 2
    assert "invalid choice: 'fp4'" in capsys.readouterr().err


def test_cli_train_end_to_end_loss_falls(tmp_path, text_file, capsys):
    out = tmp_path / "run"
    rc = main(["train", *TINY_FLAGS, "--data", str(text_file), "--steps", "40", "--eval-interval", "20",
               "--lr", "3e-3", "--out-dir", str(out)])
    assert rc == 0
    evals = [m for m in read_metrics(out) if m["kind"] == "eval"]
    # the corpus is this package's source, so the split's content (and the final loss)
    # moves with every edit: ask for a fall, not a level
    assert evals[0]["val_loss"] > 5.0 and evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.5
    assert "done: 40 steps" in capsys.readouterr().out


def test_a_refused_run_leaves_an_existing_run_alone(tmp_path, text_file):
    out = tmp_path / "run"
    train(tiny_config(out, text_file, steps=3))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match="already holds a run.*--resume.*--overwrite"):  # a new run over it
        train(tiny_config(out, text_file, steps=3))
    with pytest.raises(ValueError, match="fewer than seq_len"):
        train(tiny_config(out, text_file, steps=3, overwrite=True, seq_len=100_000, model=ModelConfig(
            d_model=64, n_layers=2, n_heads=2, n_experts=4, top_k=2, d_expert=64, max_seq_len=100_000)))
    with pytest.raises(ValueError, match="at step 3, the run has --steps 3: nothing to do"):
        train(tiny_config(out, text_file, steps=3), resume=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    file_path = tmp_path / "a_file"
    file_path.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        train(tiny_config(file_path, text_file, steps=3))


def test_overwrite_replaces_a_run(tmp_path, text_file):
    out = tmp_path / "run"
    train(tiny_config(out, text_file, steps=3))
    r = train(tiny_config(out, text_file, steps=2, overwrite=True))
    assert r.steps == 2 and load_checkpoint(out)["step"] == 2
    assert [m["step"] for m in read_metrics(out) if m["kind"] == "train"] == [1, 2]


def test_resume_may_extend_the_run(tmp_path, text_file):
    out = tmp_path / "run"
    train(tiny_config(out, text_file, steps=3))
    r = train(tiny_config(out, text_file, steps=5), resume=True)
    assert r.steps == 2 and load_checkpoint(out)["step"] == 5
    assert [m["step"] for m in read_metrics(out) if m["kind"] == "train"] == [1, 2, 3, 4, 5]


def test_odd_sized_token_file_is_refused(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\1\0\2\0\3")
    with pytest.raises(ValueError, match="odd number of bytes"):
        load_corpus(tmp_path / "t.bin")


def test_quantizer_backend_does_not_change_training(tmp_path, text_file):
    """The recipe with the Triton quantizers (interpreted on the CPU) trains to the same
    losses, bit for bit, as with the reference quantizer."""
    losses = {}
    for backend in ("reference", "triton"):
        out = tmp_path / backend
        train(tiny_config(out, text_file, steps=2, eval_interval=2, quant_backend=backend))
        losses[backend] = [(m["step"], m["loss"]) for m in read_metrics(out)]
    assert losses["reference"] == losses["triton"]
