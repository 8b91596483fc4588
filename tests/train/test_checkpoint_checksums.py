"""Checkpoints carry content hashes: a file with flipped bytes, or with a tensor or value
changed after it was written, is refused on load (train --resume, eval, export) with one
line naming the file; a good one, and one written before hashes were stored, loads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from mxmoe.cli import main
from mxmoe.train.checkpoint import (
    CHECKPOINT_NAME,
    CHECKSUMS_KEY,
    load_checkpoint,
    save_checkpoint,
    state_checksums,
)

FLAGS = ["--width", "64", "--layers", "1", "--heads", "2", "--experts", "4", "--top-k", "2", "--expert-width", "64",
         "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--warmup-steps", "1", "--device", "cpu",
         "--no-progress", "--recipe", "bf16", "--dtype", "float32"]
N_FLIPS = 24  # byte positions spread over the whole file


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("run") / "r"
    assert main(["train", *FLAGS, "--data", str(corpus), "--steps", "2", "--out-dir", str(out)]) == 0
    return out


def copy_run(run_dir: Path, dst: Path) -> Path:
    shutil.copytree(run_dir, dst)
    return dst / CHECKPOINT_NAME


def tensor_offset(path: Path, t: torch.Tensor) -> int:
    """Where the bytes of tensor ``t`` start in the file (found by all of them: unique)."""
    raw = path.read_bytes()
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    at = raw.find(data)
    assert at > 0 and raw.find(data, at + 1) < 0
    return at


def test_a_checkpoint_holds_checksums_that_load_verifies(run_dir):
    raw = torch.load(run_dir / CHECKPOINT_NAME, map_location="cpu", weights_only=True)
    sums = raw[CHECKSUMS_KEY]
    assert sums["algorithm"] == "sha256" and "model/embed" in sums["tensors"]
    assert any(k.startswith("optimizer/state/") for k in sums["tensors"])
    ckpt = load_checkpoint(run_dir)
    assert CHECKSUMS_KEY not in ckpt and ckpt["step"] == 2


@pytest.mark.parametrize("where", range(N_FLIPS))
def test_flipped_bytes_anywhere_are_refused_in_one_line(run_dir, tmp_path, where):
    """A byte flipped at any of N_FLIPS positions spread over the file: refused in one line
    (as damaged or as unreadable), or, where the byte is no part of the content (the zip
    container's bookkeeping), loaded with every value equal to the original's."""
    path = copy_run(run_dir, tmp_path / "r")
    good = load_checkpoint(path)
    raw = bytearray(path.read_bytes())
    at = min(len(raw) - 1, where * len(raw) // (N_FLIPS - 1))
    raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))
    try:
        got = load_checkpoint(path)
    except ValueError as e:
        msg = str(e)
        assert str(path) in msg and "\n" not in msg
        assert "is damaged" in msg or "is not a readable torch checkpoint" in msg
        return
    assert state_checksums(got) == state_checksums(good)


@pytest.mark.parametrize("name", ["model/embed", "optimizer/state/0/exp_avg_sq", "model/final_norm.weight"])
def test_a_flip_in_tensor_data_names_the_tensor(run_dir, tmp_path, name):
    path = copy_run(run_dir, tmp_path / "r")
    ckpt = load_checkpoint(path)
    t = ckpt
    for part in name.split("/"):
        t = t[int(part) if part.isdigit() and isinstance(t, dict) and int(part) in t else part]
    raw = bytearray(path.read_bytes())
    raw[tensor_offset(path, t) + 5] ^= 0x01  # one bit of one value
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"'{path}' is damaged: .* tensor {name} differs; use an earlier"):
        load_checkpoint(path)


@pytest.mark.parametrize("edit", ["step", "lr", "tensor", "drop tensor", "checksums"])
def test_values_edited_after_writing_are_refused(run_dir, tmp_path, edit):
    path = copy_run(run_dir, tmp_path / "r")
    raw = torch.load(path, map_location="cpu", weights_only=True)
    if edit == "step":
        raw["step"] = 1
    elif edit == "lr":
        raw["optimizer"]["param_groups"][0]["lr"] = 10.0
    elif edit == "tensor":
        raw["model"]["embed"][0, 0] += 1
    elif edit == "drop tensor":
        del raw["model"]["embed"]
    else:
        raw[CHECKSUMS_KEY] = "?"
    torch.save(raw, path)
    with pytest.raises(ValueError, match=rf"'{path}' is damaged"):
        load_checkpoint(path)


def test_save_replaces_stale_checksums_and_unhashed_checkpoints_load(tmp_path):
    save_checkpoint(tmp_path, {"step": 3, "model": {"w": torch.ones(2)}})
    ckpt = load_checkpoint(tmp_path)
    ckpt["step"] = 4
    save_checkpoint(tmp_path, {**ckpt, CHECKSUMS_KEY: "stale"})
    assert load_checkpoint(tmp_path)["step"] == 4
    torch.save({"step": 5, "model": {"w": torch.ones(2)}}, tmp_path / CHECKPOINT_NAME)  # no checksums
    assert load_checkpoint(tmp_path)["step"] == 5


@pytest.mark.parametrize("command", ["train --resume", "eval", "export"])
def test_every_command_refuses_a_damaged_checkpoint_in_one_line(run_dir, corpus, tmp_path, capsys, command):
    path = copy_run(run_dir, tmp_path / "r")
    ckpt = load_checkpoint(path)
    raw = bytearray(path.read_bytes())
    raw[tensor_offset(path, ckpt["model"]["embed"]) + 9] ^= 0x10
    path.write_bytes(bytes(raw))
    before = {p.name: p.read_bytes() for p in path.parent.iterdir()}
    if command == "eval":
        rc = main(["eval", str(path.parent), "--device", "cpu"])
    elif command == "export":
        rc = main(["export", str(path.parent), str(tmp_path / "o.safetensors")])
    else:
        rc = main(["train", *FLAGS, "--data", str(corpus), "--steps", "4", "--out-dir", str(path.parent), "--resume"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"mxmoe {command.split()[0]}: error: {str(path)!r} is damaged:"), err
    assert err.count("\n") == 1
    assert {p.name: p.read_bytes() for p in path.parent.iterdir()} == before
    assert not (tmp_path / "o.safetensors").exists()
