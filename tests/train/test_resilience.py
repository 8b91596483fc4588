"""Checkpoint writes interrupted at every point, including by SIGKILL, never leave a
corrupt latest checkpoint. (SIGKILL of a training run followed by --resume is
test_training.py::test_sigkill_then_resume_matches_uninterrupted_run; bad flags of each
command are in test_training.py, test_compare.py and test_export.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from mxmoe.train import checkpoint as ckpt_mod
from mxmoe.train.checkpoint import load_checkpoint, save_checkpoint

PAYLOAD = 1 << 20  # float32 values per checkpoint: 4 MiB, so a kill often lands mid-write


def state(step: int) -> dict:
    return {"step": step, "payload": torch.full((PAYLOAD,), float(step))}


def assert_consistent(ckpt: dict) -> None:
    assert torch.equal(ckpt["payload"], torch.full((PAYLOAD,), float(ckpt["step"])))


@pytest.mark.parametrize("stage,survivor", [
    ("write", 1),  # the serializer dies half way through the temp file
    ("fsync", 1),  # the temp file is complete but not yet on disk
    ("replace", 1),  # the temp file is on disk, the rename never happens
    ("dir_fsync", 2),  # the rename happened: the new checkpoint is the latest
])
def test_checkpoint_write_interrupted_at_each_stage(tmp_path, monkeypatch, stage, survivor):
    save_checkpoint(tmp_path, state(1))
    real = {"write": torch.save, "fsync": os.fsync, "replace": os.replace, "dir_fsync": ckpt_mod._fsync_dir}

    def crash(*args, **kwargs):
        if stage == "write":
            args[1].write(b"\x00" * 1000)  # a partial file, as a crash mid-serialization leaves
        raise KeyboardInterrupt(stage)

    target = {"write": (torch, "save"), "fsync": (os, "fsync"), "replace": (os, "replace"),
              "dir_fsync": (ckpt_mod, "_fsync_dir")}[stage]
    monkeypatch.setattr(*target, crash)
    with pytest.raises(KeyboardInterrupt, match=stage):
        save_checkpoint(tmp_path, state(2))
    monkeypatch.setattr(*target, real[stage])
    got = load_checkpoint(tmp_path)
    assert got["step"] == survivor
    assert_consistent(got)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # the temp file is cleaned up


def test_sigkill_during_checkpoint_writes_leaves_a_loadable_checkpoint(tmp_path):
    """A process that writes checkpoints back to back is killed with SIGKILL at three
    moments; every time, the latest checkpoint loads and is one of the complete ones."""
    script = textwrap.dedent(f"""
        import sys, torch
        from mxmoe.train.checkpoint import save_checkpoint
        step = int(sys.argv[2])
        while True:
            step += 1
            save_checkpoint(sys.argv[1], {{"step": step, "payload": torch.full(({PAYLOAD},), float(step))}})
            print(step, flush=True)
    """)
    last = 0
    for delay in (0.05, 0.13, 0.31):
        proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(last)], stdout=subprocess.PIPE,
                                text=True)
        deadline = time.time() + 60
        while int(proc.stdout.readline() or 0) < last + 2 and time.time() < deadline:
            pass  # wait until it has written two checkpoints, then kill it somewhere in the next ones
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        got = load_checkpoint(tmp_path)
        assert got["step"] >= last + 2
        assert_consistent(got)
        last = got["step"]
    save_checkpoint(tmp_path, state(last + 1))  # the next write removes what the kills left behind
    assert [p.name for p in Path(tmp_path).iterdir()] == ["checkpoint.pt"]
